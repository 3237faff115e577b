"""The collecting end of the CUPTI tracers and `kvtrace run`: real Unix stream sockets, messages built with
protocol.py's helpers, events in the Session's ledger with source CUPTI and the kernel's pid, stacks
remapped per connection, bounds and errors that close one connection only; `kvtrace run --output FILE --
python -c SCRIPT` writing a recording every report reads back exactly, COMMAND's environment, signals and
exit status, and each mistake as one line naming the fix."""
from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from interpreters import LABELS, interpreter
from kvtrace.cli import run as run_module
from kvtrace.cli.main import main
from kvtrace.daemon import Daemon, DaemonOptions
from kvtrace.model.events import Api, Kind, Layer, Memory, ObjectKind, Source, StackStatus
from kvtrace.model.ledger import LedgerKey
from kvtrace.model.stacks import Frame, Stack
from kvtrace.session import Session
from kvtrace.sources.cupti import protocol
from kvtrace.sources.cupti.listener import COMPONENT, CuptiListener

MiB = 1 << 20
AGENT_ROOT = str(Path(run_module.__file__).resolve().parents[2])  # the directory holding the kvtrace package


@pytest.fixture
def short_dir():
    """A short path: a Unix socket's path has at most 107 bytes, pytest's tmp_path can be longer."""
    directory = tempfile.mkdtemp(prefix="kvc", dir="/tmp")
    yield Path(directory)
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def listening(short_dir):
    session = Session()
    listener = CuptiListener(session, str(short_dir / "cupti" / "cupti.sock"))
    assert listener.start()
    yield session, listener
    listener.stop()


def hello() -> bytes:
    return protocol.json_message(protocol.HELLO, {"v": 1, "python": "3.11", "cupti": "13.0.1", "cuda_driver": 13000})


def status(state: str = "tracing", **fields) -> bytes:
    return protocol.json_message(protocol.STATUS, {"state": state, **fields})


def stack(stack_id: int, *functions: str) -> bytes:
    return protocol.json_message(protocol.STACK, {"id": stack_id, "frames": [[name, "w.py", 7] for name in functions]})


def calls(*records: bytes) -> bytes:
    return b"".join(protocol.packed_messages(protocol.CALLS, protocol.CALL_RECORD, list(records)))


def memory(*records: bytes) -> bytes:
    return b"".join(protocol.packed_messages(protocol.MEMORY, protocol.MEMORY_RECORD, list(records)))


def alloc_call(correlation_id: int, address: int, size_bytes: int, ts: int, stack_id: int = 0) -> bytes:
    return protocol.CALL_RECORD.pack(Api.cuMemAlloc_v2.value, 0, correlation_id, 77, stack_id,
                                     StackStatus.OK.value if stack_id else 0, -1, address, size_bytes, 0, ts)


def alloc_record(correlation_id: int, address: int, size_bytes: int, ts: int, operation: int = 1) -> bytes:
    return protocol.MEMORY_RECORD.pack(operation, protocol.MEMORY_KIND_DEVICE, 0, correlation_id, 0, address,
                                       size_bytes, ts)


def connect(path: str, *messages: bytes) -> socket.socket:
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(path)
    if messages:
        client.sendall(b"".join(messages))
    return client


def wait_for(condition, timeout_seconds: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def run_cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with redirect_stdout(out):
        code = main(list(argv))
    return code, out.getvalue()


# ---- the listener ----


def test_events_reach_the_ledger_with_source_cupti_and_the_kernels_pid(listening):
    session, listener = listening
    now = time.time_ns()
    client = connect(listener.path, hello(), status(), stack(1, "leak_kv", "main"),
                     calls(alloc_call(1, 0x1000, MiB, now, stack_id=1), alloc_call(2, 0x2000, 2 * MiB, now + 1)),
                     memory(alloc_record(1, 0x1000, MiB, now), alloc_record(2, 0x2000, 2 * MiB, now + 1),
                            alloc_record(3, 0x2000, 2 * MiB, now + 2, operation=2)))
    client.close()
    wait_for(lambda: listener.open_connections == 0 and listener.connections_total == 1)
    [entry] = session.outstanding()
    assert entry.key == LedgerKey(os.getpid(), Layer.DRIVER, ObjectKind.ALLOCATION, 0x1000)
    assert (entry.size_bytes, entry.api, entry.memory, entry.tid) == (MiB, Api.cuMemAlloc_v2, Memory.DEVICE, 77)
    assert session.stack(entry.stack_id) == Stack((Frame("leak_kv", "w.py", 7), Frame("main", "w.py", 7)))
    assert session.ledger.frees_total[(os.getpid(), Layer.DRIVER)] == 1
    assert listener.events == 3 and listener.processes[os.getpid()].status.state == "tracing"
    [check] = session.cross_checks(os.getpid())
    assert (check.status.state, check.status.stopped_ns) == ("gone", now + 2)
    counters = session.counters()
    assert (counters["cupti_connections"], counters["cupti_events"], counters["cupti_protocol_errors"]) == (1, 3, 0)
    assert {c.name: c.up for c in session.components()}[COMPONENT] is True


def test_the_pid_is_the_connecting_processes_whatever_it_says(listening):
    session, listener = listening
    sink = []
    session.add_sink(type("Sink", (), {"publish": lambda self, e: sink.append(e), "publish_loss": lambda self, n: None,
                                       "publish_state": lambda self, r: None})())
    script = textwrap.dedent(f"""
        import socket, sys, time
        from kvtrace.sources.cupti import protocol
        now = time.time_ns()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect({listener.path!r})
        s.sendall(protocol.json_message(protocol.HELLO, {{"v": 1, "pid": 1}})
                  + protocol.json_message(protocol.STATUS, {{"state": "tracing", "pid": 1}})
                  + protocol.message(protocol.MEMORY, protocol.MEMORY_RECORD.pack(1, 3, 0, 9, 0, 0x4000, 4096, now)))
        s.close()
    """)
    child = subprocess.run([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": AGENT_ROOT}, check=True)
    assert child.returncode == 0
    wait_for(lambda: listener.connections_total == 1 and listener.open_connections == 0)
    [event] = sink
    assert event.pid not in (1, os.getpid()) and event.source is Source.CUPTI and event.tid == event.pid
    assert (event.kind, event.api, event.address) == (Kind.ALLOC, Api.cuMemAlloc_v2, 0x4000)  # no CALL: its record


def test_stacks_are_remapped_per_connection(listening):
    session, listener = listening
    now = time.time_ns()
    first = connect(listener.path, hello(), status(), stack(1, "a"), calls(alloc_call(1, 0x1000, MiB, now, 1)),
                    memory(alloc_record(1, 0x1000, MiB, now)))
    second = connect(listener.path, hello(), status(), stack(1, "b"), stack(2, "a"),
                     calls(alloc_call(1, 0x2000, MiB, now, 2), alloc_call(2, 0x3000, MiB, now, 1)),
                     memory(alloc_record(1, 0x2000, MiB, now), alloc_record(2, 0x3000, MiB, now)))
    first.close()
    second.close()
    wait_for(lambda: listener.connections_total == 2 and listener.open_connections == 0)
    stacks = {entry.key.address: session.stack(entry.stack_id) for entry in session.outstanding()}
    assert stacks == {0x1000: Stack((Frame("a", "w.py", 7),)), 0x2000: Stack((Frame("a", "w.py", 7),)),
                      0x3000: Stack((Frame("b", "w.py", 7),))}
    ids = {entry.key.address: entry.stack_id for entry in session.outstanding()}
    assert ids[0x1000] == ids[0x2000] != ids[0x3000]


def test_a_malformed_message_closes_its_connection_only_keeping_what_came_before(listening):
    session, listener = listening
    now = time.time_ns()
    good = connect(listener.path, hello(), status())
    bad = connect(listener.path, hello(), status(), calls(alloc_call(1, 0x1000, MiB, now)),
                  memory(alloc_record(1, 0x1000, MiB, now)), protocol.message(protocol.MEMORY, b"\x00" * 7))
    assert bad.recv(1) == b""  # closed by the listener
    wait_for(lambda: listener.open_connections == 1)
    good.sendall(memory(alloc_record(5, 0x5000, MiB, now)))
    good.close()
    wait_for(lambda: listener.open_connections == 0)
    bad.close()
    assert sorted(entry.key.address for entry in session.outstanding()) == [0x1000, 0x5000]
    assert session.counters()["cupti_protocol_errors"] == 1
    gone = listener.processes[os.getpid()]
    assert "protocol error: 7 bytes is no whole number of 40-byte records" in gone.error


def test_an_unknown_message_type_is_a_protocol_error(listening):
    session, listener = listening
    client = connect(listener.path, hello(), protocol.HEADER.pack(99, 0))
    assert client.recv(1) == b""
    client.close()
    wait_for(lambda: listener.protocol_errors == 1)


def test_a_user_past_its_share_is_refused_counted_and_named(short_dir):
    """Issue 31: one user's flood of `kvtrace run`s takes its share only (the kernel's uid, SO_PEERCRED)."""
    import pwd

    session = Session()
    listener = CuptiListener(session, str(short_dir / "c.sock"), max_connections=8, max_connections_per_user=2)
    assert listener.start()
    me = pwd.getpwuid(os.getuid()).pw_name
    try:
        clients = [connect(listener.path, hello()) for _ in range(2)]
        wait_for(lambda: listener.open_connections == 2)
        refused = [connect(listener.path, hello()) for _ in range(3)]
        wait_for(lambda: listener.refused == 3)
        assert listener.open_connections == 2 and listener.shares.held == {os.getuid(): 2}
        wait_for(lambda: session.counters().get(f"share_refused/cupti_connections/{me}") == 3)
        [component] = [c for c in session.components() if c.name == "cupti"]
        assert component.up and "holds 2 connections, its share of 2" in component.reason
        for client in [*clients, *refused]:
            client.close()
        wait_for(lambda: listener.open_connections == 0)
        assert listener.shares.total == 0  # places given back
    finally:
        listener.stop()


def test_connections_past_the_bound_are_refused_and_counted(short_dir):
    session = Session()
    listener = CuptiListener(session, str(short_dir / "c.sock"), max_connections=2)
    assert listener.start()
    try:
        clients = [connect(listener.path, hello()) for _ in range(2)]
        wait_for(lambda: listener.open_connections == 2)
        refused = connect(listener.path, hello())
        try:
            assert refused.recv(1) == b""
        except ConnectionResetError:  # closed with our HELLO unread
            pass
        wait_for(lambda: listener.refused == 1)
        for client in [*clients, refused]:
            client.close()
        wait_for(lambda: listener.open_connections == 0)
        assert session.counters()["cupti_connections_refused"] == 1
    finally:
        listener.stop()


def test_a_connection_that_says_nothing_leaves_no_trace(listening):
    session, listener = listening
    connect(listener.path).close()  # how `kvtrace run` looks for the agent
    wait_for(lambda: listener.connections_total == 1 and listener.open_connections == 0)
    assert listener.processes == {} and session.cross_checks() == [] and listener.protocol_errors == 0


def test_stop_applies_what_the_decoders_hold(listening):
    session, listener = listening
    now = time.time_ns()
    create = protocol.CALL_RECORD.pack(Api.cuMemCreate.value, 0, 1, 77, 0, 0, 0, 0, 2 * MiB, 0x55, now)
    client = connect(listener.path, hello(), status(), calls(create))
    wait_for(lambda: listener.open_connections == 1)
    time.sleep(0.1)
    assert session.outstanding() == []  # held: the MEMORY records up to its time may still come
    listener.stop()
    [entry] = session.outstanding()
    assert entry.key == LedgerKey(os.getpid(), Layer.VMM, ObjectKind.VMM_HANDLE, 0x55) and entry.size_bytes == 2 * MiB
    client.close()
    assert not os.path.exists(listener.path)


def test_the_agents_socket_is_0666_in_a_0755_directory_and_replaces_a_stale_one(short_dir):
    path = short_dir / "run" / "cupti.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path.parent.mkdir()
    stale.bind(str(path))
    stale.close()  # a socket file nobody listens on
    session = Session()
    listener = CuptiListener(session, str(path))
    assert listener.start()
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o666
        assert stat.S_ISSOCK(os.lstat(path).st_mode)
        other = CuptiListener(Session(), str(path))
        assert not other.start()
        assert "another process listens on" in [c.reason for c in other.session.components()][0]
    finally:
        listener.stop()
    assert not path.exists()
    fresh = short_dir / "made" / "deeper" / "c.sock"
    listener = CuptiListener(Session(), str(fresh))
    assert listener.start()
    listener.stop()
    assert stat.S_IMODE(os.stat(fresh.parent).st_mode) == 0o755


@pytest.mark.parametrize(("path", "says"), [("relative.sock", "give an absolute path"),
                                            ("/tmp/" + "x" * 120, "at most 107"),
                                            ("/", "is a directory")])
def test_a_path_that_cannot_be_bound_leaves_the_component_down_saying_why(path, says):
    session = Session()
    assert not CuptiListener(session, path).start()
    [component] = session.components()
    assert component.name == COMPONENT and not component.up and says in component.reason


# ---- the agent's wiring ----


def test_the_daemon_listens_when_given_a_socket(short_dir):
    path = short_dir / "d.sock"
    daemon = Daemon(DaemonOptions(api=None, nvml=False, tracing="off", vllm_socket="", vllm_discover=False,
                                  flight=None, cupti_socket=str(path)))
    daemon.start()
    try:
        assert daemon.cupti_listener is not None and path.exists() and not daemon.session.cupti_witness
    finally:
        daemon.stop()
    assert not path.exists()
    assert Daemon(DaemonOptions(api=None, nvml=False, tracing="off", vllm_socket="", vllm_discover=False,
                                flight=None)).options.cupti_socket == ""


def test_the_agents_cupti_socket_flag(monkeypatch, short_dir):
    import argparse

    from kvtrace.cli.agent import AgentCommand
    from kvtrace.errors import CommandError

    monkeypatch.delenv("KVTRACE_CONFIG", raising=False)
    monkeypatch.delenv("KVTRACE_SOCKET", raising=False)

    def options(*flags: str) -> DaemonOptions:
        parser = argparse.ArgumentParser()
        AgentCommand().prepare_parser(parser)
        return AgentCommand._options(parser.parse_args(["--metrics-listen", "off", "--no-api", *flags]))

    assert options().cupti_socket == protocol.DEFAULT_AGENT_SOCKET
    assert options("--cupti-socket", "off").cupti_socket == ""
    assert options("--cupti-socket", str(short_dir / "x.sock")).cupti_socket == str(short_dir / "x.sock")
    with pytest.raises(CommandError, match="give an absolute path"):
        options("--cupti-socket", "x.sock")
    with pytest.raises(CommandError, match="another socket of the agent's"):
        options("--cupti-socket", str(short_dir / "v.sock"), "--vllm-socket", str(short_dir / "v.sock"))


# ---- kvtrace run ----

# A stand-in for the tracer: connects where kvtrace run says and sends a known stream (protocol.py's helpers).
TRACER_SCRIPT = textwrap.dedent("""
    import os, socket, sys, time
    from kvtrace.sources.cupti import protocol
    MiB = 1 << 20
    now = time.time_ns() - 120 * 10**9  # two minutes old: leak suspects at the default age too
    def call(api, cid, address, size, stack=0, handle=0, device=-1):
        return protocol.CALL_RECORD.pack(api, 0, cid, os.getpid(), stack, 1 if stack else 0, device, address, size,
                                         handle, now + cid)
    def record(op, cid, address, size):
        return protocol.MEMORY_RECORD.pack(op, 3, 0, cid, 0, address, size, now + cid)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(os.environ[protocol.SOCKET_ENV])
    s.sendall(b"".join([
        protocol.json_message(protocol.HELLO, {"v": 1, "python": sys.version.split()[0]}),
        protocol.json_message(protocol.STATUS, {"state": "tracing"}),
        protocol.json_message(protocol.STACK, {"id": 1, "frames": [["leak_kv", "w.py", 12], ["main", "w.py", 30]]}),
        *protocol.packed_messages(protocol.CALLS, protocol.CALL_RECORD, [
            call(20, 1, 0x100000, MiB, stack=1), call(20, 2, 0x200000, 2 * MiB, stack=1),
            call(20, 3, 0x400000, 4 * MiB, stack=1), call(40, 4, 0, 8 * MiB, handle=0x77, device=0)]),
        *protocol.packed_messages(protocol.MEMORY, protocol.MEMORY_RECORD, [
            record(1, 1, 0x100000, MiB), record(1, 2, 0x200000, 2 * MiB), record(1, 3, 0x400000, 4 * MiB),
            record(2, 5, 0x200000, 2 * MiB)]),
    ]))
    s.close()
    with open(sys.argv[1], "w") as out:
        out.write(str(os.getpid()))
    sys.exit(int(sys.argv[2]))
""")


def test_kvtrace_run_records_what_the_tracer_reports_for_every_report_to_read(tmp_path, capfd):
    recording, pid_file = tmp_path / "run.kvtrace", tmp_path / "pid"
    code = main(["run", "-o", str(recording), "--", sys.executable, "-c", TRACER_SCRIPT, str(pid_file), "0"])
    err = capfd.readouterr().err
    assert code == 0, err
    pid = int(pid_file.read_text())
    assert f"kvtrace run: tracing with CUPTI into {recording}" in err
    assert f"kvtrace run: wrote {recording}: 1 process traced, 5 events" in err
    code, out = run_cli("snapshot", "--json", "--input", str(recording))
    entries = sorted((json.loads(line) for line in out.splitlines()), key=lambda entry: entry["address"])
    assert [(e["pid"], e["layer"], e["object"], e["api"], e["address"], e["size_bytes"], e["device"])
            for e in entries] == [
        (pid, "vmm", "vmm_handle", "cuMemCreate", 0x77, 8 * MiB, 0),
        (pid, "driver", "allocation", "cuMemAlloc_v2", 0x100000, MiB, 0),
        (pid, "driver", "allocation", "cuMemAlloc_v2", 0x400000, 4 * MiB, 0),
    ]
    code, out = run_cli("leaks", "--json", "--input", str(recording))
    report = json.loads(out)
    by_stack = {tuple(frame["function"] for frame in suspect["stack"] or ()): suspect for suspect in report["suspects"]}
    assert (by_stack[("leak_kv", "main")]["outstanding_bytes"], by_stack[("leak_kv", "main")]["allocation_count"],
            by_stack[("leak_kv", "main")]["pid"]) == (5 * MiB, 2, pid)
    assert by_stack[()]["outstanding_bytes"] == 8 * MiB


def test_kvtrace_run_exits_with_the_commands_status(tmp_path, capfd):
    assert main(["run", "-o", str(tmp_path / "a.kvtrace"), "--", sys.executable, "-c", "import sys; sys.exit(7)"]) == 7
    assert main(["run", "-o", str(tmp_path / "b.kvtrace"), sys.executable, "-c",
                 "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"]) == 128 + signal.SIGTERM
    assert main(["run", "-o", str(tmp_path / "c.kvtrace"), "--", "/nonexistent/command"]) == 127
    assert "kvtrace: cannot run /nonexistent/command: No such file or directory" in capfd.readouterr().err


def test_kvtrace_run_gives_the_command_its_environment(tmp_path, short_dir, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/user/path")
    dump = tmp_path / "env.json"
    script = (f"import json, os; json.dump({{k: v for k, v in os.environ.items() if k.startswith(('KVTRACE_', "
              f"'PYTHONPATH'))}}, open({str(dump)!r}, 'w'))")
    assert main(["run", "-o", str(tmp_path / "r.kvtrace"), "--no-cupti", "--eager", "--stack-frames", "12", "--",
                 sys.executable, "-c", script]) == 0
    env = json.loads(dump.read_text())
    boot, package_only, user = env["PYTHONPATH"].split(os.pathsep)
    assert (boot, user) == (str(run_module.BOOT_DIRECTORY), "/user/path")
    # kvtrace alone, never the directory it is installed in (a wheel's: grpc, protobuf, ... before the program's)
    assert os.listdir(package_only) == ["kvtrace"]
    assert (Path(package_only) / "kvtrace").resolve() == Path(run_module.__file__).resolve().parents[1]
    assert (env["KVTRACE_CUPTI"], env["KVTRACE_CUPTI_EAGER"], env["KVTRACE_CUPTI_STACK_FRAMES"]) == ("0", "1", "12")
    assert env["KVTRACE_CUPTI_BLOCKS"] == "1"  # a recording: PyTorch's block recorder on by default
    socket_path = env[protocol.SOCKET_ENV]
    assert not os.path.exists(os.path.dirname(socket_path))  # the private directory is gone with the run
    assert (run_module.BOOT_DIRECTORY / "sitecustomize.py").exists()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1])
def test_kvtrace_run_forwards_signals_to_the_command(tmp_path, signum):
    script = textwrap.dedent(f"""
        import signal, sys, time
        signal.signal({int(signum)}, lambda *_: sys.exit(3))
        print("ready", flush=True)
        time.sleep(30)
    """)
    kvtrace = subprocess.Popen([sys.executable, "-m", "kvtrace.cli.main", "run", "-o", str(tmp_path / "s.kvtrace"),
                                "--", sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env={**os.environ, "PYTHONPATH": AGENT_ROOT}, start_new_session=True)
    try:
        assert kvtrace.stdout is not None and kvtrace.stdout.readline() == b"ready\n"
        kvtrace.send_signal(signum)
        assert kvtrace.wait(timeout=20) == 3
    finally:
        if kvtrace.poll() is None:
            kvtrace.kill()
            kvtrace.wait()
        kvtrace.stdout.close()
        kvtrace.stderr.close()


def test_kvtrace_run_reports_to_the_agent_when_one_listens(listening, monkeypatch, tmp_path, capfd):
    session, listener = listening
    monkeypatch.setattr(protocol, "DEFAULT_AGENT_SOCKET", listener.path)
    assert main(["run", "--", sys.executable, "-c", TRACER_SCRIPT, str(tmp_path / "pid"), "0"]) == 0
    assert f"kvtrace run: tracing with CUPTI into the agent at {listener.path}" in capfd.readouterr().err
    wait_for(lambda: listener.connections_total == 2 and listener.open_connections == 0)  # the probe, the script
    assert {entry.key.pid for entry in session.outstanding()} == {int((tmp_path / "pid").read_text())}
    assert len(session.outstanding()) == 3
    assert main(["run", "--agent", listener.path, "--", sys.executable, "-c", "pass"]) == 0


def test_towards_the_agent_pytorchs_recorder_stays_off_and_blocks_always_is_refused(listening, monkeypatch, tmp_path,
                                                                                     capfd):
    _session, listener = listening
    monkeypatch.setattr(protocol, "DEFAULT_AGENT_SOCKET", listener.path)
    assert main(["run", "--blocks", "always", "--", sys.executable, "-c", "pass"]) == 2
    err = capfd.readouterr().err
    assert "--blocks always is for a recording (--output FILE)" in err and err.count("\n") == 1
    dump = tmp_path / "blocks.json"
    script = f"import json, os; json.dump(os.environ.get('KVTRACE_CUPTI_BLOCKS'), open({str(dump)!r}, 'w'))"
    assert main(["run", "--", sys.executable, "-c", script]) == 0
    assert json.loads(dump.read_text()) == "0"


def test_a_missing_cupti_is_said_alike_towards_the_agent_and_into_a_file(listening, monkeypatch, tmp_path, capfd):
    """--eager, in a Python where `import cupti` fails: towards the agent (which alone gets the STATUS) the
    program's stderr says it, once for the process tree; into a file, kvtrace run's summary says it; both
    in one wording, naming what to install."""
    _session, listener = listening
    missing = tmp_path / "site"
    (missing / "cupti").mkdir(parents=True)
    (missing / "cupti" / "__init__.py").write_text("raise ImportError('no CUPTI here')\n")
    monkeypatch.setenv("PYTHONPATH", str(missing))
    script = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'pass'], check=True)"  # a child too

    def said(err: str) -> list[str]:
        return [line for line in err.splitlines() if "CUPTI unavailable" in line]

    assert main(["run", "--eager", "--agent", listener.path, "--", sys.executable, "-c", script]) == 0
    towards_agent = said(capfd.readouterr().err)
    assert main(["run", "--eager", "-o", str(tmp_path / "run.kvtrace"), "--", sys.executable, "-c", script]) == 0
    into_file = said(capfd.readouterr().err)
    assert len(towards_agent) == 1 and len(into_file) == 2  # the summary: both processes
    for line in (*towards_agent, *into_file):
        assert re.fullmatch(r"kvtrace run: pid \d+: CUPTI unavailable \(CUPTI's Python package \(cupti-python\) is "
                            r"missing in .*; install it into the program's Python: pip install 'kvtrace\[cupti13\]'"
                            r".*\): not traced", line), line


def test_kvtrace_run_without_an_agent_writes_a_file_here(monkeypatch, tmp_path, capfd):
    monkeypatch.setattr(protocol, "DEFAULT_AGENT_SOCKET", str(tmp_path / "none.sock"))
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--", sys.executable, "-c", "pass"]) == 0
    expected = f"kvtrace-run-{os.getpid()}.kvtrace"
    err = capfd.readouterr().err
    assert f"no agent at {tmp_path / 'none.sock'}; tracing with CUPTI into ./{expected}" in err
    assert "no process reported" in err
    assert (tmp_path / expected).exists()


@pytest.mark.parametrize(("argv", "code", "says"), [
    (["run"], 2, "give the command to run after --"),
    (["run", "-o", "/tmp/x.kvtrace", "--"], 2, "give the command to run after --"),
    (["run", "-o", "/nonexistent/dir/r.kvtrace", "--", "true"], 2,
     "the directory /nonexistent/dir does not exist (create it, or choose another --output)"),
    (["run", "-o", "/tmp", "--", "true"], 2, "is a directory"),
    (["run", "--agent", "/tmp/kvtrace-no-agent.sock", "--", "true"], 6, "no agent listens on /tmp/kvtrace-no-agent"),
    (["run", "--agent", "python", "x.py"], 2, "put COMMAND after --"),
    (["run", "-o", "/tmp/x.kvtrace", "--stack-frames", "999", "--", "true"], 2, "--stack-frames takes 0 to 256"),
])
def test_kvtrace_run_mistakes_are_one_line_naming_the_fix(argv, code, says, capfd):
    assert main(argv) == code
    err = capfd.readouterr().err
    assert says in err and err.count("\n") == 1


FAKE_CUPTI_DIR = Path(__file__).resolve().parents[1] / "fake_cupti"
FAKE_WORKLOAD = textwrap.dedent("""
    import sys
    from cupti import cupti
    MiB = 1 << 20
    addresses = [cupti.fake_mem_alloc((index + 1) * 4096) for index in range(23)]
    for address in addresses[:11]:
        cupti.fake_free(address)
    cupti.fake_mem_alloc(1 << 40, result=2)
    va = cupti.fake_driver_call("cuMemAddressReserve", size=4 * MiB, alignment=0, addr=0, flags=0)
    handle = cupti.fake_driver_call("cuMemCreate", device=1, size=4 * MiB, flags=0)
    cupti.fake_driver_call("cuMemMap", ptr=va, size=4 * MiB, offset=0, handle=handle, flags=0)
    cupti.fake_driver_call("cuMemUnmap", ptr=va, size=4 * MiB)
    cupti.fake_driver_call("cuMemRelease", handle=handle)
    kept = cupti.fake_driver_call("cuMemCreate", device=1, size=2 * MiB, flags=0)
    print(va, kept, *addresses[11:])
""")


@pytest.mark.skipif(not (FAKE_CUPTI_DIR / "cupti").is_dir(), reason="no fake cupti-python in tests/fake_cupti")
@pytest.mark.parametrize("label", LABELS)
def test_kvtrace_run_with_the_real_tracer_on_a_fake_cupti(tmp_path, label):
    """The tracer of tracer.py, started by boot/sitecustomize.py (--eager: no torch), on tests/fake_cupti, in a
    program run by each CPython build (tests/interpreters.py)."""
    recording = tmp_path / "fake.kvtrace"
    child = subprocess.run([sys.executable, "-m", "kvtrace.cli.main", "run", "--eager", "-o", str(recording), "--",
                            interpreter(label), "-c", FAKE_WORKLOAD], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join([str(FAKE_CUPTI_DIR), AGENT_ROOT])})
    assert child.returncode == 0, child.stderr
    va, kept, *addresses = map(int, child.stdout.split())
    assert "1 process traced, 41 events" in child.stderr
    code, out = run_cli("snapshot", "--json", "--input", str(recording))
    held = sorted((entry["api"], entry["address"], entry["size_bytes"]) for entry in map(json.loads, out.splitlines()))
    assert held == sorted([("cuMemAddressReserve", va, 4 * MiB), ("cuMemCreate", kept, 2 * MiB),
                           *(("cuMemAlloc_v2", address, (index + 12) * 4096)
                             for index, address in enumerate(addresses))])
    code, out = run_cli("tail", "--json", "--input", str(recording))
    kinds = [(event["kind"], event["api"]) for event in map(json.loads, out.splitlines())]
    assert kinds.count(("free", "cuMemFree_v2")) == 11 and kinds.count(("alloc_failed", "cuMemAlloc_v2")) == 1
    assert [kind for kind in kinds if kind[1] in ("cuMemMap", "cuMemUnmap", "cuMemRelease")] == [
        ("map", "cuMemMap"), ("unmap", "cuMemUnmap"), ("free", "cuMemRelease")]  # as the uprobes: unmapped, then freed


FAKE_TORCH_WORKLOAD = textwrap.dedent("""
    import torch
    MiB = 1 << 20

    def grow_cache(size_bytes):
        return torch.cuda.memory.caching_allocator_alloc(size_bytes)

    def keep_activation(segment):
        return torch.cuda.memory.block(MiB, inside=segment)

    segment = grow_cache(64 * MiB)  # CUDA starts; the cache's one segment
    kept = [keep_activation(segment) for _ in range(23)]
    scratch = torch.cuda.memory.block(4 * MiB, inside=segment)
    torch.cuda.memory.free_block(scratch)
    print(*kept)
""")


@pytest.mark.skipif(not (FAKE_CUPTI_DIR / "cupti").is_dir(), reason="no fake cupti-python in tests/fake_cupti")
@pytest.mark.parametrize("blocks", ["always", "never"])
@pytest.mark.parametrize("label", LABELS)
def test_kvtrace_run_names_the_holders_of_blocks_not_the_code_that_grew_the_cache(tmp_path, blocks, label):
    """GIVEN a (fake) torch program whose cache grows in grow_cache() and whose 23 kept 1 MiB blocks are carved
    out of it by keep_activation(), WHEN `kvtrace run -o` records it, THEN `kvtrace leaks --input` ranks
    keep_activation first with exactly those 23 blocks, at depth full (PyTorch's recorder read at the exit);
    with --blocks never it can only name grow_cache, and says the process is at segments."""
    recording = tmp_path / "blocks.kvtrace"
    child = subprocess.run([sys.executable, "-m", "kvtrace.cli.main", "run", "--blocks", blocks, "-o", str(recording),
                            "--", interpreter(label), "-c", FAKE_TORCH_WORKLOAD], capture_output=True, text=True,
                           timeout=60, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                               [str(FAKE_CUPTI_DIR), str(FAKE_CUPTI_DIR / "fake_torch"), AGENT_ROOT])})
    assert child.returncode == 0, child.stderr
    kept = set(map(int, child.stdout.split()))
    code, out = run_cli("leaks", "--input", str(recording), "--min-age", "0", "--json")
    assert code == 0
    first = json.loads(out)["suspects"][0]
    functions = [frame["function"] for frame in first["stack"]]
    code, out = run_cli("ps", "--input", str(recording), "--json")
    [process] = [json.loads(line) for line in out.splitlines()]
    if blocks == "always":
        assert functions[0] == "keep_activation"
        assert (first["allocation_count"], first["outstanding_bytes"]) == (23, 23 * MiB)
        assert not first.get("estimated")  # every block's stack: nothing sampled
        code, out = run_cli("snapshot", "--json", "--input", str(recording))
        blocks_held = {entry["address"] for entry in map(json.loads, out.splitlines())
                       if entry["api"] == "pytorch_malloc"}
        assert blocks_held == kept
        assert process["depth"]["depth"] == "full" and "kvtrace run" in process["depth"]["detail"], process
    else:
        assert "grow_cache" in functions and "keep_activation" not in functions
        assert (first["allocation_count"], first["outstanding_bytes"]) == (1, 64 * MiB)
        assert not process.get("depth"), process  # nobody knows its blocks
