"""The agent's listener for the vLLM plugin: real datagrams over a real Unix socket from this process
(the kernel's SCM_CREDENTIALS pid must be os.getpid()), recorded plugin messages turned into the exact
Session records, every way a message is refused (dropped and counted, the thread goes on), the per-pid
rate limit, the socket file's life cycle, the daemon's wiring and the agent's flags."""
from __future__ import annotations

import argparse
import io
import json
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import pytest

from kvtrace.cli.agent import AgentCommand
from kvtrace.daemon import Daemon, DaemonOptions
from kvtrace.errors import CommandError
from kvtrace.model.vllm import (
    KvCacheLayout,
    KvRequest,
    KvTensor,
    RequestState,
    SchedulerReport,
    SleepPool,
    SleepReport,
)
from kvtrace.session import Session
from kvtrace.sources.vllm import listener as listener_module
from kvtrace.sources.vllm import protocol
from kvtrace.sources.vllm.listener import (
    COMPONENT,
    ListenerSetupError,
    MessageError,
    VllmListener,
    check_socket_path,
    decode_message,
)

RECORDED = Path(__file__).parent / "data" / "vllm_plugin_messages.json"


@pytest.fixture
def short_dir():
    """A directory with a short path: a Unix socket's path has at most 107 bytes, pytest's tmp_path
    can be longer."""
    directory = tempfile.mkdtemp(prefix="kvv", dir="/tmp")
    yield Path(directory)
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def bound(short_dir):
    """(session, listener, send) with the listener bound and receiving."""
    session = Session()
    listener = VllmListener(session, str(short_dir / "vllm.sock"))
    assert listener.start()
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)

    def send(data: bytes | dict) -> None:
        sender.sendto(data if isinstance(data, bytes) else json.dumps(data).encode(), listener.path)

    yield session, listener, send
    sender.close()
    listener.stop()


def wait_received(listener: VllmListener, count: int, timeout_seconds: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_seconds
    while listener.received < count:
        assert time.monotonic() < deadline, f"received {listener.received} of {count}"
        time.sleep(0.005)
    time.sleep(0.01)  # the last one's ingest and counters


def scheduler_message(**changes) -> dict:
    message = {"v": 1, "type": "scheduler", "blocks_total": 100, "blocks_free": 90, "running": 1, "waiting": 0,
               "allocated_total": 10, "freed_total": 0, "requests": [["req-1", "running", 10, None]],
               "requests_omitted": 0}
    message.update(changes)
    return message


# ---- recorded plugin messages -> the exact records ----


def test_recorded_plugin_messages_become_exact_session_records(bound):
    session, listener, send = bound
    messages = json.loads(RECORDED.read_text())["messages"]
    before_ns = time.time_ns()
    for message in messages:
        send(message)
    wait_received(listener, len(messages))
    after_ns = time.time_ns()
    assert (listener.received, listener.rejected) == (4, 0), listener.last_rejection
    view = session.vllm_view()
    pid = os.getpid()
    assert set(view.layouts) == set(view.schedulers) == set(view.sleeps) == {pid}
    for record in (view.layouts[pid], view.schedulers[pid], *view.sleeps[pid]):
        assert before_ns <= record.timestamp_ns <= after_ns

    page_bytes, tensor_bytes = 65536, 55344 * 65536
    assert replace(view.layouts[pid], timestamp_ns=0) == KvCacheLayout(
        pid, 0, device=0,
        tensors=tuple(KvTensor(0x7F2C40000000 + i * (tensor_bytes + (2 << 20)), tensor_bytes) for i in range(8)),
        num_blocks=55344, page_size_bytes=page_bytes, block_size_tokens=16)
    scheduler = view.schedulers[pid]
    assert replace(scheduler, timestamp_ns=0) == SchedulerReport(
        pid, 0, blocks_total=55343, blocks_free=55100, running=2, waiting=1, blocks_allocated_total=1234,
        blocks_freed_total=991, requests=(
            KvRequest("cmpl-3f2a9c0e5b7d4e21-0", RequestState.ABORTED, 120, 42.5),
            KvRequest("chatcmpl-8d1b7e6f0a2c4d3b", RequestState.RUNNING, 80, None),
            KvRequest("cmpl-77aa90c1e2f34b5a-0", RequestState.RUNNING, 43, None)),
        requests_omitted=0)
    assert sum(request.blocks for request in scheduler.requests) == 55343 - 55100
    assert [replace(report, timestamp_ns=0) for report in view.sleeps[pid]] == [
        SleepReport(pid, 0, 1, (SleepPool("weights", 520093696, 0), SleepPool("kv_cache", 29015801856, 0))),
        SleepReport(pid, 0, 0, (SleepPool("weights", 520093696, 520093696),
                                SleepPool("kv_cache", 29015801856, 29015801856)))]
    assert session.counters()["vllm_messages_received"] == 4
    assert session.counters()["vllm_messages_rejected"] == 0
    component = {c.name: c for c in session.components()}[COMPONENT]
    assert component.up


# ---- every rejection: dropped, counted, nothing ingested, the thread goes on ----


def _deep(depth: int) -> bytes:
    return b'{"v": 1, "type": "sleep", "level": 0, "pools": ' + b"[" * depth + b"]" * depth + b"}"


REJECTED = [
    ("bad JSON", b'{"v": 1, "type": "scheduler",', "not JSON"),
    ("not an object", b"[1, 2]", "not a JSON object"),
    ("wrong version", scheduler_message(v=2), "protocol version 2, not 1"),
    ("version as text", scheduler_message(v="1"), "protocol version '1'"),
    ("unknown type", scheduler_message(type="kv_events"), "unknown type 'kv_events'"),
    ("missing field", {key: value for key, value in scheduler_message().items() if key != "running"},
     "running is missing"),
    ("too many requests", scheduler_message(requests=[[f"r{i}", "running", 1, None] for i in range(
        protocol.MAX_REQUESTS_PER_REPORT + 1)]), "requests has 257 entries; the protocol allows 0 to 256"),
    ("too many tensors", {"v": 1, "type": "kv_cache", "device": 0, "tensors": [[4096, 1]] * (protocol.MAX_TENSORS + 1),
                          "num_blocks": 2, "page_size_bytes": 1, "block_size": 16}, "tensors has 4097 entries"),
    ("no tensors", {"v": 1, "type": "kv_cache", "device": 0, "tensors": [], "num_blocks": 2, "page_size_bytes": 1,
                    "block_size": 16}, "tensors has 0 entries; the protocol allows 1 to 4096"),
    ("too many pools", {"v": 1, "type": "sleep", "level": 1, "pools": [["t", 1, 0]] * (protocol.MAX_POOLS + 1)},
     "pools has 65 entries"),
    ("count as text", scheduler_message(running="1"), "running must be an integer from 0 to"),
    ("count as bool", scheduler_message(waiting=True), "waiting must be an integer from 0 to"),
    ("count as float", scheduler_message(blocks_total=100.0), "blocks_total must be an integer"),
    ("negative count", scheduler_message(freed_total=-1), "freed_total must be an integer from 0"),
    ("more free than total", scheduler_message(blocks_free=101), "blocks_free must be an integer from 0 to 100"),
    ("unknown state", scheduler_message(requests=[["r", "swapped", 1, None]]), "state 'swapped' is not one of"),
    ("request id not text", scheduler_message(requests=[[7, "running", 1, None]]), "request id must be non-empty"),
    ("request entry short", scheduler_message(requests=[["r", "running", 1]]), "requests[0] must be a list of 4"),
    ("negative age", scheduler_message(requests=[["r", "aborted", 1, -1]]), "done_age_seconds must be a number"),
    ("age as text", scheduler_message(requests=[["r", "aborted", 1, "5"]]), "done_age_seconds must be a number"),
    ("address zero", {"v": 1, "type": "kv_cache", "device": 0, "tensors": [[0, 1]], "num_blocks": 2,
                      "page_size_bytes": 1, "block_size": 16}, "tensors[0] address must be an integer from 1"),
    ("sleep level 3", {"v": 1, "type": "sleep", "level": 3, "pools": []}, "level must be an integer from 0 to 2"),
    ("mapped beyond size", {"v": 1, "type": "sleep", "level": 0, "pools": [["weights", 10, 11]]},
     "pools[0] mapped_bytes must be an integer from 0 to 10"),
    ("huge integer", b'{"v": 1, "type": "sleep", "level": ' + b"9" * 5000 + b', "pools": []}', "not JSON"),
    ("deep nesting", _deep(30000), "not JSON"),
    ("not UTF-8", b'{"v": 1, "type": "\xff\xfe"}', "not UTF-8 text"),
    ("huge datagram", json.dumps(scheduler_message(pad="x" * 100_000)).encode(), "larger than 65536 bytes"),
]


@pytest.mark.parametrize("name, data, says", REJECTED, ids=[case[0] for case in REJECTED])
def test_bad_messages_are_dropped_and_counted(name, data, says, bound):
    session, listener, send = bound
    send(data)
    send(scheduler_message())  # then a good one: the thread goes on
    wait_received(listener, 2)
    assert listener.rejected == 1
    assert says in listener.last_rejection, listener.last_rejection
    assert listener.last_rejection.startswith(f"pid {os.getpid()}: ")
    counters = session.counters()
    assert (counters["vllm_messages_received"], counters["vllm_messages_rejected"]) == (2, 1)
    view = session.vllm_view()
    assert list(view.schedulers) == [os.getpid()] and not view.layouts and not view.sleeps


def test_request_ids_are_kept_as_printable_text_and_cut():
    long_id = "r" * (protocol.MAX_REQUEST_ID_CHARS + 50)
    report = decode_message(json.dumps(scheduler_message(requests=[
        [long_id, "finished", 3, 1.5], ["a\x1b[31mb\ud800", "aborted", 2, None], ["w", "waiting", 0, 9.0]],
    )).encode(), 4242, 7)
    assert isinstance(report, SchedulerReport)
    assert [request.request_id for request in report.requests] == [
        "r" * protocol.MAX_REQUEST_ID_CHARS, "a\\x1b[31mb\\ud800", "w"]
    # The age is kept for done requests only (the model's None while not done).
    assert [request.done_age_seconds for request in report.requests] == [1.5, None, None]
    assert (report.pid, report.timestamp_ns) == (4242, 7)


def test_unknown_keys_are_ignored_within_a_version():
    record = decode_message(json.dumps({"v": 1, "type": "sleep", "level": 2, "pools": [], "new_field": [1]}).encode(),
                            1, 2)
    assert record == SleepReport(1, 2, 2, ())


def test_decode_errors_are_message_errors_only():
    """Whatever the bytes, decode_message raises MessageError or returns a record: nothing else
    escapes to the receiving thread."""
    samples = [b"", b"null", b"{}", b'{"v": 1}', b"\x00" * 10, b'{"v": 1, "type": "scheduler", "requests": {}}',
               b'{"v": 1, "type": "kv_cache", "tensors": [[1e400, 1]]}', b"[" * 100_000, b'"\\ud800"']
    for data in samples:
        with pytest.raises(MessageError):
            decode_message(data, 1, 1)


def test_a_datagram_without_credentials_is_dropped(bound):
    session, listener, _ = bound
    listener.handle_datagram(json.dumps(scheduler_message()).encode(), None)
    assert (listener.received, listener.rejected) == (1, 1)
    assert "no sender credentials" in listener.last_rejection
    assert not session.vllm_view().schedulers


def test_an_exception_while_handling_does_not_end_the_thread(bound, monkeypatch):
    session, listener, send = bound
    real_ingest = session.ingest
    calls = []

    def failing_once(record):
        calls.append(record)
        if len(calls) == 1:
            raise RuntimeError("boom")
        real_ingest(record)

    monkeypatch.setattr(session, "ingest", failing_once)
    send(scheduler_message())
    send(scheduler_message(running=2))
    wait_received(listener, 2)
    assert listener.rejected == 1 and "internal error: boom" in listener.last_rejection
    assert session.vllm_view().schedulers[os.getpid()].running == 2


def test_at_most_one_warning_a_minute(bound, caplog):
    _, listener, send = bound
    with caplog.at_level(logging.DEBUG, logger=listener_module.__name__):
        for _ in range(3):
            send(b"not json")
        wait_received(listener, 3)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    debugs = [r for r in caplog.records if r.levelno == logging.DEBUG and "dropped a vLLM plugin message" in r.message]
    assert len(warnings) == 1 and "kvtrace_vllm_messages_rejected_total" in warnings[0].message
    assert len(debugs) == 3


# ---- bounds per sender ----


def test_per_pid_rate_limit(short_dir):
    session = Session()
    listener = VllmListener(session, str(short_dir / "vllm.sock"), max_messages_per_second_per_pid=5)
    assert listener.start()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
            for running in range(8):
                sender.sendto(json.dumps(scheduler_message(running=running)).encode(), listener.path)
            wait_received(listener, 8)
        assert (listener.received, listener.rejected) == (8, 3)
        assert "more than 5 messages a second" in listener.last_rejection
        assert session.vllm_view().schedulers[os.getpid()].running == 4  # the fifth, the last let through
    finally:
        listener.stop()


def test_the_default_rate_limit_lets_the_plugins_rate_through():
    assert listener_module.MAX_MESSAGES_PER_SECOND_PER_PID >= 10 / protocol.REPORT_INTERVAL_SECONDS


def test_no_set_of_senders_keeps_an_engine_out_and_what_is_kept_stays_bounded(short_dir):
    """Garbage takes no place; with every place taken by live processes that report, a newcomer is refused
    (counted); one silent SILENT_SECONDS gives its place and its records to a new good sender (seen in review:
    256 idle processes sending garbage once locked every engine out). Issue 31's shares per user: test_plugin_shares."""
    session = Session()
    listener = VllmListener(session, str(short_dir / "vllm.sock"), max_senders=2)
    good = json.dumps(scheduler_message()).encode()
    listener.handle_datagram(b"garbage", os.getppid())
    listener.handle_datagram(b"garbage", 1)
    assert listener.rejected == 2 and listener._senders == {}
    listener.handle_datagram(good, os.getppid())
    listener.handle_datagram(good, 1)  # alive: not freed by a sweep
    listener.handle_datagram(good, os.getpid())  # every place taken by senders that report: refused
    assert set(listener._senders) == {os.getppid(), 1} and listener.rejected == 3
    listener._senders[os.getppid()].last_seen -= listener_module.SILENT_SECONDS
    listener.handle_datagram(good, os.getpid())  # the silent one (os.getppid()) gives its place
    assert set(session.vllm_view().schedulers) == {1, os.getpid()}
    assert set(listener._senders) == {1, os.getpid()} and listener.rejected == 3 and listener.evicted == 1


def test_a_sender_that_exits_is_forgotten_with_its_records(short_dir):
    session = Session()
    listener = VllmListener(session, str(short_dir / "vllm.sock"))
    child = subprocess.Popen(["sleep", "30"])
    try:
        listener.handle_datagram(json.dumps(scheduler_message()).encode(), child.pid)
        listener.handle_datagram(json.dumps(scheduler_message()).encode(), os.getpid())
        assert set(session.vllm_view().schedulers) == {child.pid, os.getpid()}
        listener._sweep()
        assert set(session.vllm_view().schedulers) == {child.pid, os.getpid()}  # alive: kept
    finally:
        child.kill()
        child.wait()
    listener._sweep()
    assert set(session.vllm_view().schedulers) == {os.getpid()}
    assert set(listener._senders) == {os.getpid()}


# ---- the socket file ----


def test_socket_mode_and_stop_removes_it_quickly(short_dir):
    session = Session()
    path = short_dir / "run" / "vllm.sock"  # the directory is made
    listener = VllmListener(session, str(path))
    assert listener.start()
    assert path.is_socket() and (path.stat().st_mode & 0o777) == 0o666
    assert (path.parent.stat().st_mode & 0o777) == 0o755
    started = time.monotonic()
    listener.stop()
    assert time.monotonic() - started < 1.0
    assert not os.path.lexists(path)
    assert not listener._thread.is_alive()


def test_a_stale_socket_is_replaced(short_dir):
    path = short_dir / "vllm.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    stale.bind(str(path))
    stale.close()  # the file stays, nobody bound
    session = Session()
    listener = VllmListener(session, str(path))
    assert listener.start()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
            sender.sendto(json.dumps(scheduler_message()).encode(), str(path))
        wait_received(listener, 1)
        assert listener.rejected == 0
    finally:
        listener.stop()


def test_a_socket_in_use_is_not_taken(short_dir):
    path = short_dir / "vllm.sock"
    first = VllmListener(Session(), str(path))
    assert first.start()
    try:
        session = Session()
        assert not VllmListener(session, str(path)).start()
        component = {c.name: c for c in session.components()}[COMPONENT]
        assert not component.up and "another process is bound to" in component.reason
        assert path.is_socket()
    finally:
        first.stop()


@pytest.mark.parametrize("kind", ["file", "directory"])
def test_something_else_at_the_path_is_refused_with_one_line(kind, short_dir):
    path = short_dir / "vllm.sock"
    if kind == "file":
        path.write_text("keep me")
    else:
        path.mkdir()
    session = Session()
    assert not VllmListener(session, str(path)).start()
    component = {c.name: c for c in session.components()}[COMPONENT]
    assert not component.up and "the agent will not replace it" in component.reason
    assert "\n" not in component.reason
    assert path.exists()  # untouched


def test_a_directory_that_cannot_be_made_leaves_the_component_down(short_dir):
    (short_dir / "file").write_text("")
    session = Session()
    assert not VllmListener(session, str(short_dir / "file" / "sub" / "vllm.sock")).start()
    component = {c.name: c for c in session.components()}[COMPONENT]
    assert not component.up and component.reason.startswith(f"cannot create {short_dir / 'file' / 'sub'}")


def test_a_directory_others_cannot_search_is_named_in_the_reason(short_dir):
    os.chmod(short_dir, 0o750)
    session = Session()
    listener = VllmListener(session, str(short_dir / "vllm.sock"))
    assert listener.start()
    try:
        component = {c.name: c for c in session.components()}[COMPONENT]
        assert component.up and f"{short_dir} is mode 0750" in component.reason
        assert "chmod o+x" in component.reason
        os.chmod(short_dir, 0o751)
        listener2 = VllmListener(Session(), str(short_dir / "other.sock"))
        assert listener2._reach_warning() == ""
    finally:
        listener.stop()


@pytest.mark.parametrize("path, says", [
    ("relative/vllm.sock", "give an absolute path"),
    ("/tmp/" + "x" * 120, "choose a shorter one"),
    (f"/tmp/{os.fsdecode(bytes([0xff]))}/vllm.sock", "is not UTF-8 text"),
])
def test_check_socket_path(path, says):
    with pytest.raises(ListenerSetupError, match=says):
        check_socket_path(path)


# ---- the daemon and the agent's flags ----


def test_daemon_starts_and_stops_the_listener(short_dir):
    path = short_dir / "vllm.sock"
    daemon = Daemon(DaemonOptions(api=None, nvml=False, tracing="off", vllm_socket=str(path), vllm_discover=False),
                    out=io.StringIO(), err=io.StringIO())
    daemon.start()
    try:
        assert path.is_socket()
        assert {c.name: c.up for c in daemon.session.components()}[COMPONENT]
        assert daemon.vllm_metrics is None  # no discovery and no URL: nothing to scrape
    finally:
        daemon.stop()
    assert not os.path.lexists(path)


def test_daemon_runs_on_when_the_socket_cannot_be_bound(short_dir):
    (short_dir / "file").write_text("")
    daemon = Daemon(DaemonOptions(api=None, nvml=False, tracing="off", vllm_discover=False,
                                  vllm_socket=str(short_dir / "file" / "vllm.sock")),
                    out=io.StringIO(), err=io.StringIO())
    daemon.start()
    try:
        component = {c.name: c for c in daemon.session.components()}[COMPONENT]
        assert not component.up
    finally:
        daemon.stop()


def test_daemon_with_the_socket_off_binds_nothing():
    daemon = Daemon(DaemonOptions(api=None, nvml=False, tracing="off", vllm_socket="", vllm_discover=False),
                    out=io.StringIO(), err=io.StringIO())
    daemon.start()
    try:
        assert daemon.vllm_listener is None
        assert COMPONENT not in {c.name for c in daemon.session.components()}
    finally:
        daemon.stop()


def agent_options(*flags: str) -> DaemonOptions:
    parser = argparse.ArgumentParser()
    AgentCommand().prepare_parser(parser)
    return AgentCommand._options(parser.parse_args(["--metrics-listen", "off", *flags]))


def test_agent_flags_default_and_off(monkeypatch):
    monkeypatch.delenv("KVTRACE_CONFIG", raising=False)
    monkeypatch.delenv("KVTRACE_SOCKET", raising=False)
    options = agent_options("--no-api")
    assert (options.vllm_socket, options.vllm_metrics_urls, options.vllm_discover) == (
        protocol.DEFAULT_SOCKET, (), True)
    assert agent_options("--no-api", "--vllm-socket", "off").vllm_socket == ""
    assert agent_options("--no-api", "--vllm-socket", "/tmp/k/v.sock").vllm_socket == "/tmp/k/v.sock"


@pytest.mark.parametrize("flags, says", [
    (["--no-api", "--vllm-socket", "v.sock"], "--vllm-socket: give an absolute path"),
    (["--no-api", "--vllm-socket", "/tmp/" + "x" * 120], "choose a shorter one"),
    (["--socket", "/tmp/kvx/a.sock", "--vllm-socket", "/tmp/kvx/a.sock"], "is the API's socket"),
    (["--socket", "/tmp/kvx/a.sock", "--vllm-socket", "/tmp/kvx/a-admin.sock"], "is the API's socket"),
])
def test_agent_refuses_bad_vllm_socket_with_one_line(flags, says, monkeypatch):
    monkeypatch.delenv("KVTRACE_CONFIG", raising=False)
    monkeypatch.delenv("KVTRACE_SOCKET", raising=False)
    with pytest.raises(CommandError) as raised:
        agent_options(*flags)
    assert says in str(raised.value) and "\n" not in str(raised.value)


def test_agent_refuses_a_file_at_the_vllm_socket_path(short_dir, monkeypatch):
    monkeypatch.delenv("KVTRACE_CONFIG", raising=False)
    (short_dir / "regular").write_text("x")
    with pytest.raises(CommandError, match="is a file that is not a socket; the agent will not replace it"):
        agent_options("--no-api", "--vllm-socket", str(short_dir / "regular"))
