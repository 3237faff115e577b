"""`kvtrace tail`, `snapshot` and `ps` against a served fake agent, as an operator runs them."""
import argparse
import json
import os
import subprocess
import sys
import time

import pytest

from fake_agent import TITLES, FakeAgent, MiB, event, served
from kvtrace.cli.flags import parse_size
from kvtrace.cli.main import main
from kvtrace.cli.tail import HEADER, Layout, format_event, terminal_columns
from kvtrace.model.events import Api, Kind, Layer, Memory, ObjectKind
from kvtrace.wire import event_to_json


@pytest.mark.parametrize("text, size_bytes", [
    ("123", 123), ("512k", 512 << 10), ("512K", 512 << 10), ("1MiB", MiB), ("1mb", MiB), ("1 M", MiB),
    ("1.5GiB", 3 << 29), ("2t", 2 << 40), ("0", 0)])
def test_parse_size(text, size_bytes):
    assert parse_size(text) == size_bytes


@pytest.mark.parametrize("text", ["", "-1", "1x", "MiB", "1 MiBs", "1e3"])
def test_parse_size_refuses(text):
    with pytest.raises(argparse.ArgumentTypeError, match="not a size"):
        parse_size(text)


def test_format_event_fits_the_header_columns():
    line = format_event(event(pid=200, api=Api.cudaMalloc, layer=Layer.RUNTIME, size=MiB,
                              address=0x7F0000001000, device=1, title=TITLES[200]))
    clock = time.strftime("%H:%M:%S", time.localtime(1_700_000_000))
    assert line == f"{clock}.000     200 cudaMalloc          runtime    1.0 MiB   1 0x7f0000001000 VLLM::Worker_TP0"
    assert line.index("VLLM") == HEADER.index("TITLE")
    failed = format_event(event(kind=Kind.ALLOC_FAILED, address=0, error_code=2, size=1 << 40))
    assert "1.0 TiB" in failed and "error 2" in failed
    unknown = format_event(event(kind=Kind.FREE_UNKNOWN, api=Api.cuMemFree_v2, size=0, device=-1))
    assert " unknown " in unknown
    exit_line = format_event(event(kind=Kind.PROCESS_EXIT, api=Api.process_exit, layer=None, obj=None,
                                   memory=None, size=0, address=0, device=-1))
    assert "process_exit" in exit_line


LONG_TITLE = "python3 -m vllm.entrypoints.openai.api_server --model meta-llama/Llama-3.1-70B-Instruct " * 2


@pytest.mark.parametrize("columns", [80, 100, 120, 200])
def test_tail_lines_fit_the_terminal(columns):
    layout = Layout.for_width(columns)
    header = layout.header
    assert len(header) <= columns
    for api in Api:
        if api in (Api.cuDevicePrimaryCtxRetain, Api.cuCtxCreate_v2):
            continue  # traced for their context's device only: never an event
        line = format_event(event(pid=4_194_303, api=api, size=1023 * MiB, address=0x7FFF_FFFF_F000,
                                  device=7, title=LONG_TITLE), layout)
        assert len(line) == columns, (api, line)
        assert line.endswith("…")
        assert line.index("python3") == header.index("TITLE")  # the API column holds every name
    assert layout.header.split() == (["TIME", "PID", "API", "LAYER", "SIZE", "DEV", "ADDRESS", "TITLE"]
                                     if columns >= 100 else ["TIME", "PID", "API", "SIZE", "ADDRESS", "TITLE"]
                                     if columns == 80 else header.split())
    assert "cuMemAddressReserve " in format_event(event(api=Api.cuMemAddressReserve, title=LONG_TITLE), layout)


def test_tail_keeps_whole_lines_where_it_cannot_cut_well():
    short = format_event(event(title="VLLM::Worker_TP0"), Layout.for_width(120))
    assert short.endswith(" VLLM::Worker_TP0")  # a title that fits is not cut
    narrow = format_event(event(title=LONG_TITLE), Layout.for_width(40))
    assert narrow.endswith(" python3 -m …")  # still MIN_TITLE characters of title: the line runs past
    whole = format_event(event(title=LONG_TITLE), Layout.for_width(None))
    assert whole.endswith(LONG_TITLE) and whole.index("python3") == HEADER.index("TITLE")
    escaped = format_event(event(title="\x1b[2J" + LONG_TITLE), Layout.for_width(80))
    assert "\x1b" not in escaped and "\\x1b[2J" in escaped  # escaped before it is cut


def test_terminal_columns_only_for_a_terminal(monkeypatch, tmp_path):
    import io
    import shutil
    assert terminal_columns(io.StringIO()) is None
    with open(tmp_path / "out", "w") as file:
        assert terminal_columns(file) is None
    monkeypatch.setattr(shutil, "get_terminal_size", lambda: os.terminal_size((80, 24)))

    class Terminal(io.StringIO):
        def isatty(self):
            return True
    assert terminal_columns(Terminal()) == 80


def start_tail(socket_path, *flags):
    return subprocess.Popen([sys.executable, "-m", "kvtrace.cli.main", "tail", "--socket", str(socket_path),
                             *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_subscribers(backend, count, process):
    deadline = time.monotonic() + 20
    while backend.hub.subscriber_count() < count:
        assert process.poll() is None, process.stderr.read()
        assert time.monotonic() < deadline, "tail did not subscribe"
        time.sleep(0.02)


def test_tail_json_prints_the_agent_json_of_the_selected_pid_only():
    wanted = [event(pid=200, address=0x1000 + i, size=MiB * (i + 1)) for i in range(23)]
    with served() as (server, backend):
        tail = start_tail(server.config.socket, "--json", "--pid", "200", "--min-size", "2MiB")
        try:
            wait_for_subscribers(backend, 1, tail)
            for item in wanted:
                backend.apply(event(pid=100, address=item.address), item)
            lines = [json.loads(tail.stdout.readline()) for _ in range(22)]
            backend.lose(7)
            assert tail.stderr.readline() == "-- 7 events lost in the kernel ring buffer --\n"
        finally:
            tail.terminate()
            tail.wait(10)
    assert lines == [event_to_json(item) for item in wanted[1:]]  # the 1 MiB one is under --min-size


def test_tail_prints_one_line_per_event_for_people():
    with served() as (server, backend):
        tail = start_tail(server.config.socket, "--cmdline", "Worker", "--layer", "driver")
        try:
            assert tail.stdout.readline() == HEADER + "\n"
            wait_for_subscribers(backend, 1, tail)
            backend.apply(event(pid=100), event(pid=200, api=Api.cudaMalloc, layer=Layer.RUNTIME),
                          event(pid=200, address=0xABC000))
            line = tail.stdout.readline()
        finally:
            tail.terminate()
            tail.wait(10)
    assert line == format_event(event(pid=200, address=0xABC000, title=TITLES[200])) + "\n"


def test_tail_without_agent_says_what_to_do(tmp_path, capsys):
    assert main(["tail", "--socket", str(tmp_path / "kvtrace.sock")]) == 6
    error = capsys.readouterr().err
    assert error.startswith("kvtrace: the kvtrace agent is not running")
    assert "sudo systemctl start kvtrace" in error and "sudo kvtrace agent" in error


@pytest.mark.skipif(os.geteuid() == 0, reason="root may open any socket")
def test_socket_closed_to_us_says_to_join_the_group(capsys):
    with served() as (server, _):
        server.config.socket.chmod(0)
        assert main(["ps", "--socket", str(server.config.socket)]) == 6
    assert "add yourself to group kvtrace" in capsys.readouterr().err


@pytest.mark.skipif(os.geteuid() != 0, reason="gives a file to other groups: needs root")
def test_permission_advice_names_the_group_the_socket_really_has(tmp_path):
    import grp

    from kvtrace.client import _permission_denied

    socket_file = tmp_path / "kvtrace.sock"
    socket_file.touch()
    other = next(group for group in grp.getgrall() if group.gr_gid not in (0, os.getegid()))
    os.chown(socket_file, -1, other.gr_gid)
    assert f"add yourself to group {other.gr_name} (`sudo usermod -aG {other.gr_name} $USER`" in \
        _permission_denied(socket_file)
    os.chown(socket_file, -1, 0)  # --group did not exist: the agent kept root's
    advice = _permission_denied(socket_file)
    assert "it belongs to group root, so only root may use it" in advice
    assert "sudo groupadd --system kvtrace" in advice and "restart the agent" in advice
    unknown = next(gid for gid in range(54321, 60000) if gid not in {group.gr_gid for group in grp.getgrall()})
    os.chown(socket_file, -1, unknown)
    assert f"it belongs to group {unknown}, so only root may use it" in _permission_denied(socket_file)


def test_tail_refuses_a_bad_regex_before_connecting(capsys):
    assert main(["tail", "--cmdline", "(", "--socket", "/nonexistent/kvtrace.sock"]) == 2
    assert "--cmdline is not a valid regular expression" in capsys.readouterr().err


def vmm_and_driver_backend():
    backend = FakeAgent()
    backend.apply(
        event(pid=200, address=0x1000, size=2 * MiB, device=0),
        event(pid=200, api=Api.cudaMalloc, layer=Layer.RUNTIME, address=0x1000, size=2 * MiB, device=0),
        event(pid=200, api=Api.cuMemCreate, layer=Layer.VMM, obj=ObjectKind.VMM_HANDLE, address=0x77,
              size=4 * MiB, device=1),
        event(pid=100, api=Api.cuMemHostAlloc, address=0x9000, size=MiB, memory=Memory.HOST, device=0))
    return backend


def test_snapshot_json_and_table(capsys):
    with served(vmm_and_driver_backend()) as (server, _):
        assert main(["snapshot", "--socket", str(server.config.socket), "--json", "-p", "200"]) == 0
        objects = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert main(["snapshot", "--socket", str(server.config.socket)]) == 0
        table = capsys.readouterr().out
    # (JSON lines come as the agent reads its ledger, one pass: no order is promised)
    assert sorted((o["layer"], o["object"], o["api"], o["size_bytes"]) for o in objects) == [
        ("driver", "allocation", "cuMemAlloc_v2", 2 * MiB), ("runtime", "allocation", "cudaMalloc", 2 * MiB),
        ("vmm", "vmm_handle", "cuMemCreate", 4 * MiB)]
    handle = next(o for o in objects if o["object"] == "vmm_handle")
    assert handle["mapped_count"] == 0 and handle["released"] is False
    assert "pid 200  VLLM::Worker_TP0" in table and "pid 100  VLLM::EngineCore" in table
    # Runtime bytes are the driver's seen from cudaMalloc: 2 + 4 MiB device memory, not 8.
    assert table.splitlines()[-1] == "4 outstanding objects in 2 processes; device memory held " \
                                     "(driver + VMM): 6.0 MiB"


def test_ps_totals_per_process_and_gpu(capsys):
    with served(vmm_and_driver_backend()) as (server, _):
        assert main(["ps", "--socket", str(server.config.socket)]) == 0
        table = capsys.readouterr().out.splitlines()
        assert main(["ps", "--socket", str(server.config.socket), "--json"]) == 0
        processes = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [row.split()[:2] for row in table[1:]] == [["100", "0"], ["200", "0"], ["200", "1"]]
    assert "1.0 MiB" in table[1] and table[1].endswith("VLLM::EngineCore")  # pinned host
    assert "2.0 MiB" in table[2] and "4.0 MiB" in table[3]
    assert [p["pid"] for p in processes] == [100, 200]
    assert {"device": 0, "layer": "runtime", "memory": "device", "size_bytes": 2 * MiB,
            "object_count": 1} in processes[1]["totals"]
