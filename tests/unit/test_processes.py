"""Process attribution: container ids from cgroup paths, titles from cmdline."""
import os

from kvtrace.model.processes import ProcessTable, container_id
from kvtrace.sources.procfs import read_process

ID = "4f2c" * 16


def test_container_id_from_the_common_runtimes():
    assert container_id(f"0::/system.slice/docker-{ID}.scope\n") == ID
    assert container_id(f"0::/kubepods.slice/kubepods-burstable.slice/cri-containerd-{ID}.scope") == ID
    assert container_id(f"12:memory:/docker/{ID}\n1:name=systemd:/docker/{ID}") == ID
    assert container_id(f"0::/kubepods/besteffort/pod1234/{ID}") == ID
    assert container_id(f"0::/machine.slice/libpod-{ID}.scope/container") == ID


def test_host_processes_have_no_container():
    assert container_id("0::/user.slice/user-0.slice/session-3.scope\n") == ""
    assert container_id("") == ""


def test_title_is_the_full_command_line():
    info = ProcessTable(read_process).get(os.getpid())
    assert info is not None and info.pid == os.getpid()
    assert "pytest" in info.title or "python" in info.title
    assert len(info.comm) <= 15


def test_titles_are_valid_text_and_cut():
    from kvtrace.model.processes import TITLE_MAX_CHARS, clean_title, valid_text

    assert valid_text("a\udcffb") == "a\\xffb"
    title = clean_title("\udcfe" + "x" * 5000)
    assert title.startswith("\\xfex") and len(title) == TITLE_MAX_CHARS
    assert title.endswith(f"(+{5004 - TITLE_MAX_CHARS} chars)")
    title.encode("utf-8")  # what protobuf does: no lone surrogate left


def test_printable_escapes_every_control_character():
    from kvtrace.human import printable

    assert printable("ok\x1b]0;t\x07\x1b[2J\nx\u202ey\x9b") == "ok\\x1b]0;t\\x07\\x1b[2J\\x0ax\\u202ey\\x9b"
    assert printable("VLLM::Worker_TP0 é") == "VLLM::Worker_TP0 é"


def test_processes_started_before_the_agent_are_marked_and_noted():
    import time

    from kvtrace._proto.kvtrace.v1 import agent_service_pb2
    from kvtrace.cli.ps import predates_agent_notes
    from kvtrace.model.processes import ProcessInfo, ProcessTable
    from kvtrace.session import Session

    now = time.time()

    def reader(pid):
        started = now - 3600 if pid == 1 else now + 1
        return ProcessInfo(pid, f"python serve{pid}.py", "python", "", "", started, time.monotonic())

    session = Session(ProcessTable(reader))
    view = session.ledger_view(with_entries=False, extra_pids=(1, 2))
    assert view.predates_agent == {1}

    growth = agent_service_pb2.GetGrowthResponse(processes=[
        agent_service_pb2.ProcessGrowth(pid=1, outstanding_bytes=16 << 20, nvml_used_bytes=1536 << 20,
                                        nvml_index=0, predates_agent=True),
        agent_service_pb2.ProcessGrowth(pid=2, outstanding_bytes=16 << 20, nvml_used_bytes=600 << 20)])
    assert predates_agent_notes(growth) == [
        "pid 1 predates the agent: NVML shows 1.5 GiB on GPU 0, 16.0 MiB traced; what it allocated before "
        "the agent started is not traced"]


def test_redacting_a_crafted_title_takes_linear_time():
    # A backtracking pattern took 0.5 s on each of these (the hub redacts on the event loop).
    import time

    from kvtrace.model.processes import redact_title

    crafted = ["-key" * 256, "-k" + "key-" * 255, "a=" * 512, "--" + "k" * 1022]
    started = time.monotonic()
    for _ in range(25):
        for title in crafted:
            redact_title(title)
    assert time.monotonic() - started < 1.0
    assert redact_title("serve --api-key abc --hf-token=x HF_TOKEN=y --env=MY_SECRET=z -p 80 --key -v") == \
        "serve --api-key *** --hf-token=*** HF_TOKEN=*** --env=MY_SECRET=*** -p 80 --key -v"
    assert redact_title("a\u202eb\x9bc\x1b[2J") == "a b c [2J"
