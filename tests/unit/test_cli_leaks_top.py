"""ListLeakSuspects and GetGrowth over a served fake agent, and `kvtrace leaks` / `kvtrace top` as an
operator runs them."""
import io
import json
import math
import time

import pytest
from rich.console import Console

from fake_agent import FakeAgent, MiB, event, served
from fake_nvml import FakeGpu, FakeNvml, GiB
from kvtrace._proto.kvtrace.v1 import agent_service_pb2 as service_pb2
from kvtrace.cli.main import main
from kvtrace.cli.top import render_frame
from kvtrace.client import AgentClient
from kvtrace.errors import CommandError, ExitCode
from kvtrace.human import device_label, human_duration, human_rate
from kvtrace.model.events import Api, Kind
from kvtrace.model.stacks import Frame, Stack
from kvtrace.sources.nvml import NvmlSampler
from kvtrace.wire import optional_field

NS = 1_000_000_000
T0_NS = 1_700_000_000 * NS
SECONDS = 121


def leaky_backend(nvml: FakeNvml | None = None) -> FakeAgent:
    """Two minutes of an agent's life: pid 200's `leak_kv` keeps 1 MiB a second, `load_weights` took
    4 GiB at the start, and `forward` allocates and frees; pid 100 holds 1 GiB from native code."""
    backend = FakeAgent()
    sampler = NvmlSampler(backend.session, nvml) if nvml is not None else None
    leak = backend.stacks.intern(Stack((Frame("leak_kv", "/app/leak.py", 12), Frame("step", "/app/serve.py", 40))))
    weights = backend.stacks.intern(Stack((Frame("load_weights", "/app/model.py", 7),)))
    forward = backend.stacks.intern(Stack((Frame("forward", "/app/model.py", 30),)))
    backend.apply(event(address=0x10, size=4 * GiB, ts=T0_NS, stack_id=weights),
                  event(pid=100, address=0x20, size=GiB, ts=T0_NS, caller_address=0x7F00DEAD))
    for second in range(SECONDS):
        now_ns = T0_NS + second * NS
        backend.apply(event(address=0x1000 + second, size=MiB, ts=now_ns, stack_id=leak),
                      event(address=0x9000, size=64 * MiB, ts=now_ns, stack_id=forward),
                      event(kind=Kind.FREE, api=Api.cuMemFree_v2, address=0x9000, size=0, ts=now_ns))
        if sampler is not None:
            sampler.sample_once()
        backend.analyze(now_ns, second * NS)
    backend.freeze_clock(T0_NS + (SECONDS - 1) * NS)
    return backend


# ---- the RPCs ----

def test_list_leak_suspects_ranks_with_stacks_inline():
    with served(leaky_backend()) as (server, _):
        with AgentClient.for_socket(server.config.socket) as agent:
            response = agent.leak_suspects()
            limited = agent.leak_suspects(pids=[200], min_age_seconds=0, limit=1)
    # The default age (60 s): 60 of the 120 s of leak, the weights and pid 100's native memory
    assert response.min_age_seconds == 60.0
    assert (response.allocations_considered, response.suspect_allocations, response.suspect_count) == (123, 63, 3)
    first, second, third = response.suspects
    assert [frame.function for frame in first.stack.frames] == ["leak_kv", "step"]
    assert (first.rank, first.pid, first.title, first.device) == (1, 200, "VLLM::Worker_TP0", 0)
    assert (first.allocation_count, first.outstanding_bytes, first.growth_bytes_per_second) == (61, 61 * MiB, MiB)
    assert first.oldest_age_seconds == 120.0 and first.stack.stack_id == first.stack_id
    assert [frame.function for frame in second.stack.frames] == ["load_weights"]
    assert (third.pid, third.stack_id, third.HasField("stack"), third.caller_address) == (100, 0, False, 0x7F00DEAD)
    # Any age, one pid, cut to one: the young `forward` memory is freed, so still 3 -> 2 sites
    assert (limited.suspect_count, len(limited.suspects), limited.min_age_seconds) == (2, 1, 0.0)
    assert limited.suspects[0].stack.frames[0].function == "leak_kv"


@pytest.mark.parametrize("arguments, field", [
    (dict(min_age_seconds=-1), "min_age_seconds"), (dict(min_age_seconds=math.nan), "min_age_seconds"),
    (dict(min_age_seconds=400 * 24 * 3600), "min_age_seconds"), (dict(limit=10001), "limit"),
    (dict(limit=-1), "limit"), (dict(pids=range(1, 1100)), "pids")])
def test_list_leak_suspects_refuses_bad_requests(arguments, field):
    with served() as (server, _):
        with AgentClient.for_socket(server.config.socket) as agent:
            with pytest.raises(CommandError, match=f"the agent refused the request: {field}") as error:
                agent.leak_suspects(**arguments)
    assert error.value.exit_code == ExitCode.USAGE


def test_get_growth_before_and_after_the_first_analysis():
    nvml = FakeNvml(FakeGpu("GPU-8e6f0000", processes=[(200, 8 * GiB), (300, None)]))
    backend = FakeAgent()
    sampler = NvmlSampler(backend.session, nvml)
    with served(backend) as (server, _):
        with AgentClient.for_socket(server.config.socket) as agent:
            before = agent.growth()
            backend.apply(event(size=GiB, ts=T0_NS))
            sampler.sample_once()
            backend.analyze(T0_NS, 0)
            after = agent.growth()
            one = agent.growth(pids=[300])
    assert before.timestamp_ns == 0 and not before.processes and not before.gpus
    assert after.timestamp_ns == T0_NS and after.nvml_timestamp_ns > 0
    assert [(gpu.index, gpu.uuid, gpu.free_bytes) for gpu in after.gpus] == [(0, "GPU-8e6f0000", 119 * GiB)]
    traced, untraced = after.processes
    assert (traced.pid, traced.device, traced.nvml_index, traced.outstanding_bytes, traced.nvml_used_bytes,
            traced.unattributed_bytes) == (200, 0, 0, GiB, 8 * GiB, 7 * GiB)
    # Unknown is unset, not 0: one sample makes no forecast and no ratio; NVML has no figure for 300
    assert optional_field(traced, "time_to_oom_seconds") is None and optional_field(traced, "free_ratio_1m") is None
    assert (untraced.pid, untraced.device, untraced.nvml_index) == (300, -1, 0)
    assert optional_field(untraced, "nvml_used_bytes") is None
    assert optional_field(untraced, "unattributed_bytes") is None
    assert [row.pid for row in one.processes] == [300]


def test_the_agent_keeps_serving_while_nvml_hangs():
    # GIVEN the NVML sampler's thread stuck in a call
    nvml = FakeNvml(FakeGpu("GPU-8e6f0000"))
    backend = FakeAgent()
    sampler = NvmlSampler(backend.session, nvml, interval_seconds=0.01, call_timeout_seconds=0.1)
    nvml.hang()
    sampler.start()
    try:
        with served(backend) as (server, _):
            with AgentClient.for_socket(server.config.socket, timeout_seconds=2) as agent:
                deadline = time.monotonic() + 5
                while not sampler.status.reason.startswith("nvml call timed out"):
                    assert time.monotonic() < deadline, sampler.status
                    time.sleep(0.01)
                # WHEN the agent analyses and a client asks, THEN both answer at once
                started = time.monotonic()
                backend.analyze(T0_NS, 0)
                growth = agent.growth()
                info = agent.info()
                assert time.monotonic() - started < 1.0
    finally:
        nvml.release()
        sampler.stop()
    assert growth.timestamp_ns == T0_NS and not growth.gpus and info.version
    assert [(c.name, c.up) for c in info.components] == [("bpf", True), ("nvml", False), ("analysis", True)]


# ---- kvtrace leaks ----

def test_leaks_json_puts_the_leaking_function_first(capsys):
    with served(leaky_backend()) as (server, _):
        assert main(["leaks", "--socket", str(server.config.socket), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["allocations_considered"], report["suspect_allocations"],
            report["min_age_seconds"]) == (123, 63, 60.0)
    first = report["suspects"][0]
    assert first["stack"][0] == {"function": "leak_kv", "file": "/app/leak.py", "line": 12}
    assert {key: first[key] for key in ("rank", "pid", "device", "outstanding_bytes", "allocation_count",
                                        "oldest_age_seconds", "growth_bytes_per_second")} == {
        "rank": 1, "pid": 200, "device": 0, "outstanding_bytes": 61 * MiB, "allocation_count": 61,
        "oldest_age_seconds": 120.0, "growth_bytes_per_second": float(MiB)}
    native = report["suspects"][2]
    assert (native["stack"], native["caller_address"], native["native_caller"]) == (None, 0x7F00DEAD, None)


def test_leaks_report_for_people(capsys):
    with served(leaky_backend()) as (server, _):
        assert main(["leaks", "--socket", str(server.config.socket), "-p", "200", "--min-age", "90", "-n", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:3] == [
        "Leak suspects: device memory held for at least 1m30s, by allocation site, growing first.",
        "A suspect is old and still held, not proven leaked: weights and the KV cache are old too.",
        "122 outstanding allocations considered, 32 at least 1m30s old, in 2 sites. The first 1:"]
    assert lines[4:] == [
        "[1] 31.0 MiB in 31 allocations, growth +1.0 MiB/s (15 min), oldest 2m00s",
        "    pid 200 VLLM::Worker_TP0, GPU 0",
        "        leak_kv (/app/leak.py:12)",
        "        step (/app/serve.py:40)"]


def test_leaks_refuses_a_bad_age_before_connecting(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["leaks", "--min-age", "-5", "--socket", "/nonexistent/kvtrace.sock"])
    assert exit_info.value.code == 2
    assert "not a number of seconds" in capsys.readouterr().err


def test_leaks_without_an_agent_says_how_to_start_it(capsys):
    assert main(["leaks", "--socket", "/nonexistent/kvtrace.sock"]) == ExitCode.AGENT_UNREACHABLE
    assert "the kvtrace agent is not running" in capsys.readouterr().err


# ---- kvtrace top ----

def test_top_once_prints_health_gpus_and_rows_sorted(capsys):
    nvml = FakeNvml(FakeGpu("GPU-8e6f0000", processes=[(200, 6 * GiB), (300, 2 * GiB)]))
    with served(leaky_backend(nvml)) as (server, _):
        assert main(["top", "--once", "--socket", str(server.config.socket)]) == 0
        by_growth = capsys.readouterr().out.splitlines()
        assert main(["top", "--once", "--sort", "outstanding", "--socket", str(server.config.socket)]) == 0
        by_size = capsys.readouterr().out.splitlines()
    assert by_growth[0].startswith("kvtrace 0.1.0 | data ") and by_growth[0].endswith("| sort: growth")
    assert ", NVML 0." in by_growth[0]  # sampled just now; the fake agent's clock is 2023
    # The agent's info: no loss, every component up
    assert by_growth[1] == "lost events 0, resyncs 0 | up: bpf, nvml, analysis"
    assert by_growth[2] == "GPU 0 NVIDIA H200: used 20.0 GiB of 140.0 GiB, free 119.0 GiB"
    assert by_growth[4].split() == ["PID", "GPU", "TRACED", "NVML", "UNATTRIB", "GROW/s", "1m", "GROW/s", "15m",
                                    "OOM", "IN", "FRAG", "DEPTH", "TITLE"]
    # Growing first (pid breaks ties); pid 300 is NVML's only, all unattributed. No depth policy runs in the
    # fake agent: DEPTH is "-" (tests/unit/test_depth_reports.py has depths)
    assert [line.split() for line in by_growth[5:]] == [
        ["200", "0", "4.1", "GiB", "6.0", "GiB", "1.9", "GiB", "+1.0", "MiB", "+1.0", "MiB", "-", "-", "-",
         "VLLM::Worker_TP0"],
        ["100", "0", "1.0", "GiB", "-", "-", "0", "B", "0", "B", "-", "-", "-", "VLLM::EngineCore"],
        ["300", "0", "0", "B", "2.0", "GiB", "2.0", "GiB", "0", "B", "0", "B", "-", "-", "-", "python", "train.py"]]
    assert [line.split()[0] for line in by_size[5:]] == ["200", "100", "300"]


def test_top_says_the_components_up_and_those_down_apart():
    from types import SimpleNamespace

    from kvtrace.cli.top import health_words

    def component(name, up, reason=""):
        return SimpleNamespace(name=name, up=up, reason=reason)

    assert health_words([component("bpf", True), component("nvml", False, "no libnvidia-ml.so.1"),
                         component("analysis", True), component("cupti", False)]) == \
        "up: bpf, analysis | DOWN: nvml (no libnvidia-ml.so.1); cupti"
    assert health_words([component("nvml", False, "gone")]) == "DOWN: nvml (gone)"
    assert health_words([]) == ""


def test_top_once_without_analysis_or_nvml(capsys):
    with served() as (server, _):
        assert main(["top", "--once", "--socket", str(server.config.socket)]) == 0
    out = capsys.readouterr().out
    assert "data none yet, NVML none yet" in out
    assert "no NVML figures: NVML used, unattributed and time-to-OOM are unknown" in out
    assert "no process holds GPU memory" in out


@pytest.mark.parametrize("seconds, text", [(0, "0 s"), (59.9, "59 s"), (60, "1m00s"), (312, "5m12s"),
                                           (3 * 3600 + 240, "3h04m"), (2 * 86400 + 3 * 3600, "2d03h")])
def test_human_duration(seconds, text):
    assert human_duration(seconds) == text


def test_an_unknown_gpu_is_spelled_one_way_everywhere():
    assert (device_label(0), device_label(7), device_label(-1)) == ("0", "7", "?")
    # every report that names a GPU spells it through device_label (ps, top, snapshot, tail, leaks)
    from pathlib import Path

    import kvtrace.cli

    cli = Path(kvtrace.cli.__file__).parent
    for name in ("ps", "top", "snapshot", "tail", "leaks"):
        text = (cli / f"{name}.py").read_text()
        assert "device_label(" in text and '"GPU ?"' not in text, name


def test_human_rate():
    assert (human_rate(MiB), human_rate(-512), human_rate(0.0)) == ("+1.0 MiB/s", "-512 B/s", "0 B/s")


def test_top_sort_keys():
    # GIVEN three rows: fast growth soon out of memory, large and flat, slow growth sooner out of memory
    growth = service_pb2.GetGrowthResponse(timestamp_ns=T0_NS, processes=[
        service_pb2.ProcessGrowth(pid=1, outstanding_bytes=GiB, growth_bytes_per_second_15m=5 * MiB,
                                  time_to_oom_seconds=3000),
        service_pb2.ProcessGrowth(pid=2, outstanding_bytes=40 * GiB),
        service_pb2.ProcessGrowth(pid=3, outstanding_bytes=2 * GiB, growth_bytes_per_second_15m=MiB,
                                  time_to_oom_seconds=600)])
    info = service_pb2.GetAgentInfoResponse(version="0.1.0")

    def order(sort):
        console = Console(width=160, file=io.StringIO())
        console.print(render_frame(info, growth, sort, T0_NS, 160))
        return [line.split()[0] for line in console.file.getvalue().splitlines()[5:]]

    # THEN each key puts first the row to look at first
    assert order("growth") == ["1", "3", "2"]
    assert order("outstanding") == ["2", "3", "1"]
    assert order("ttoom") == ["3", "1", "2"]


def test_top_keeps_every_column_in_80_columns_and_cuts_the_title():
    long_title = "/usr/bin/python3 -m vllm.entrypoints.openai.api_server --model " + "x" * 200
    growth = service_pb2.GetGrowthResponse(timestamp_ns=T0_NS, processes=[
        service_pb2.ProcessGrowth(pid=1234567, device=1, title=long_title, outstanding_bytes=123 * GiB,
                                  unattributed_bytes=-512 * MiB, growth_bytes_per_second_1m=-1.5 * MiB,
                                  time_to_oom_seconds=2 * 86400)])
    console = Console(width=80, file=io.StringIO())
    console.print(render_frame(service_pb2.GetAgentInfoResponse(version="0.1.0"), growth, "growth", T0_NS, 80))
    header, row = console.file.getvalue().splitlines()[4:6]
    # The widest figures leave the title a character or two: every figure stays whole.
    assert header.split()[:3] == ["PID", "GPU", "TRACED"] and header.split()[-2] == "DEPTH"
    assert "TITLE".startswith(header.split()[-1])
    assert row.split()[:9] == ["1234567", "cuda1", "123.0", "GiB", "-", "-512.0", "MiB", "-1.5", "MiB"]
    assert row.split()[-4:-1] == ["2d00h", "-", "-"] and long_title.startswith(row.split()[-1])
    assert len(header.rstrip()) <= 80 and len(row.rstrip()) <= 80


def test_top_prints_a_title_with_brackets_as_it_is():
    # A process title is the operator's text, never rich markup (nor a crash on "[/]").
    growth = service_pb2.GetGrowthResponse(timestamp_ns=T0_NS, processes=[
        service_pb2.ProcessGrowth(pid=7, title="python run.py --tag [bold]x[/] [/oops]", outstanding_bytes=GiB)])
    console = Console(width=160, file=io.StringIO())
    console.print(render_frame(service_pb2.GetAgentInfoResponse(version="0.1.0"), growth, "growth", T0_NS, 160))
    assert console.file.getvalue().splitlines()[5].rstrip().endswith("python run.py --tag [bold]x[/] [/oops]")
