"""kvtrace run's in-process CUPTI tracer (agent/kvtrace/sources/cupti/tracer.py) and its start-up hook
(boot/sitecustomize.py), against a faithful fake of cupti-python 13.0 (tests/fake_cupti/cupti: real enum
values, real CUpti_CallbackData and driver params structs behind `.ptr`) and a fake torch
(tests/fake_cupti/fake_torch), sending to a real Unix stream socket read with protocol.Decoder.

GIVEN a process whose driver calls are known WHEN the tracer runs in it THEN the receiver gets exactly
those calls and memory records, with stacks; and WHEN CUPTI is held, missing or opted out of THEN one
STATUS says so and CUPTI is not touched further. Nothing the tracer does raises into the program.
"""
from __future__ import annotations

import importlib
import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvtrace.model.events import Api, StackStatus
from kvtrace.sources.cupti import protocol, tracer

ROOT = Path(__file__).resolve().parents[2]
AGENT_DIR = ROOT / "agent"
BOOT_DIR = AGENT_DIR / "kvtrace" / "sources" / "cupti" / "boot"
FAKE_CUPTI_DIR = ROOT / "tests" / "fake_cupti"
FAKE_TORCH_DIR = FAKE_CUPTI_DIR / "fake_torch"
CUDA_ERROR_OUT_OF_MEMORY = 2
MiB = 1 << 20


# ---- the receiving end ----


class Received:
    """One connection as the receiver saw it: the peer's pid (SO_PEERCRED) and its messages, decoded."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.messages: list[tuple[int, object]] = []  # (type, dict for JSON, list of records for packed)
        self.trailing_bytes = 0  # a message cut off at the end
        self.closed = threading.Event()

    def json(self, kind: int) -> list[dict]:
        return [value for message_kind, value in self.messages if message_kind == kind]

    def records(self, kind: int) -> list:
        return [record for message_kind, value in self.messages if message_kind == kind for record in value]

    def kinds(self) -> list[int]:
        return [kind for kind, _value in self.messages]


class Receiver:
    """A listening AF_UNIX stream socket as `kvtrace run` binds it; each connection read to its end."""

    def __init__(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="kvtcupti-")  # short: a socket path has 108 bytes at most
        self.path = os.path.join(self.directory, "cupti.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.path)
        self.sock.listen(16)
        self.connections: list[Received] = []
        self._peers: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                peer, _ = self.sock.accept()
            except OSError:
                return
            pid, _uid, _gid = struct.unpack("3i", peer.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            received = Received(pid)
            self.connections.append(received)
            self._peers.append(peer)
            threading.Thread(target=self._read, args=(peer, received), daemon=True).start()

    def _read(self, peer: socket.socket, received: Received) -> None:
        decoder = protocol.Decoder()
        layouts = {protocol.CALLS: (protocol.CALL_RECORD, protocol.Call),
                   protocol.MEMORY: (protocol.MEMORY_RECORD, protocol.MemoryRecord),
                   protocol.POOLS: (protocol.POOL_RECORD, protocol.PoolRecord)}
        try:
            while data := peer.recv(1 << 16):
                for kind, body in decoder.feed(data):
                    if kind in protocol.JSON_TYPES:
                        received.messages.append((kind, protocol.decode_json(body)))
                    else:
                        layout, record_type = layouts[kind]
                        received.messages.append((kind, [record_type(*row) for row in protocol.unpack(layout, body)]))
        except OSError:
            pass
        finally:
            received.trailing_bytes = decoder.pending_bytes
            received.closed.set()

    def wait(self, count: int, timeout_seconds: float = 20.0) -> list[Received]:
        """The first `count` connections, each read to its end."""
        deadline = time.monotonic() + timeout_seconds
        while len(self.connections) < count and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(self.connections) >= count, f"{len(self.connections)} connections, expected {count}"
        for received in self.connections:
            assert received.closed.wait(max(deadline - time.monotonic(), 0.1)), "a connection never ended"
            assert received.trailing_bytes == 0
        return self.connections

    def close_peers(self) -> None:
        """The receiver goes away: shutdown() first, or a close() would leave the reader's recv() holding
        the socket open."""
        for peer in self._peers:
            peer.shutdown(socket.SHUT_RDWR)
            peer.close()

    def close(self) -> None:
        self.sock.close()
        for peer in self._peers:
            peer.close()
        try:
            os.unlink(self.path)
            os.rmdir(self.directory)
        except OSError:
            pass


@pytest.fixture
def receiver():
    receiving = Receiver()
    yield receiving
    receiving.close()


# ---- the fakes, imported only for the test that needs them ----


def _forget_modules(prefix: str) -> dict:
    gone = {name: module for name, module in sys.modules.items() if name == prefix or name.startswith(prefix + ".")}
    for name in gone:
        del sys.modules[name]
    return gone


@pytest.fixture
def fake_cupti(monkeypatch):
    """The fake cupti-python on sys.path (its dist-info too: importlib.metadata sees 13.0.1), state reset."""
    monkeypatch.syspath_prepend(str(FAKE_CUPTI_DIR))
    monkeypatch.delenv("FAKE_CUPTI_HOLDER", raising=False)
    saved = _forget_modules("cupti")
    cupti = importlib.import_module("cupti.cupti")
    cupti.fake_reset()
    yield cupti
    tracer._reset()
    _forget_modules("cupti")
    sys.modules.update(saved)


@pytest.fixture
def fake_torch_path(monkeypatch):
    """The fake torch importable (never left in sys.modules after the test: other tests would take it for
    torch)."""
    monkeypatch.syspath_prepend(str(FAKE_TORCH_DIR))
    saved = _forget_modules("torch")
    yield
    tracer._reset()
    _forget_modules("torch")
    sys.modules.update(saved)


@pytest.fixture
def fake_torch(fake_torch_path):
    return importlib.import_module("torch")


def make_tracer(receiver: Receiver, **settings) -> tracer.CuptiTracer:
    """A tracer whose flusher never wakes on its own: what is sent when is up to the test (flush, stop)."""
    return tracer.CuptiTracer(tracer.Settings(socket_path=receiver.path, **settings), flush_interval_seconds=3600)


def run_traced(receiver: Receiver, workload, **settings) -> Received:
    traced = make_tracer(receiver, **settings)
    traced.start()
    workload()
    traced.stop()
    (connection,) = receiver.wait(1)
    return connection


def status_of(connection: Received) -> dict:
    """The process's first STATUS (after HELLO)."""
    assert connection.kinds()[:2] == [protocol.HELLO, protocol.STATUS]
    return connection.json(protocol.STATUS)[0]


# ---- tracing ----


def test_a_known_workload_arrives_exactly(receiver, fake_cupti):
    cupti = fake_cupti
    made: dict = {}

    def allocate_workload():
        made["addresses"] = [cupti.fake_mem_alloc((index + 1) * 4096) for index in range(23)]
        for address in made["addresses"][:11]:
            cupti.fake_free(address)
        cupti.fake_mem_alloc(1 << 40, result=CUDA_ERROR_OUT_OF_MEMORY)
        made["va"] = va = cupti.fake_driver_call("cuMemAddressReserve", size=4 * MiB, alignment=0, addr=0, flags=0)
        made["handle"] = handle = cupti.fake_driver_call("cuMemCreate", device=1, size=4 * MiB, flags=0)
        cupti.fake_driver_call("cuMemMap", ptr=va, size=4 * MiB, offset=0, handle=handle, flags=0)
        cupti.fake_driver_call("cuMemUnmap", ptr=va, size=4 * MiB)
        cupti.fake_driver_call("cuMemRelease", handle=handle)
        cupti.fake_driver_call("cuMemAddressFree", ptr=va, size=4 * MiB)
        cupti.fake_static_memory(0x1000, 4096)  # module memory: not the program's allocation
        cupti.fake_pool_record(cupti.ActivityMemoryPoolOperationType.CREATED, 0x7C00_0000_0000, 32 * MiB, 0)

    connection = run_traced(receiver, allocate_workload)

    assert connection.pid == os.getpid()
    (hello,) = connection.json(protocol.HELLO)
    assert hello["v"] == protocol.VERSION and hello["cupti"] == "13.0.1" and hello["argv0"] == sys.argv[0]
    assert status_of(connection)["state"] == "tracing"
    calls = connection.records(protocol.CALLS)
    memory = connection.records(protocol.MEMORY)
    # 29 allocating calls and one cuMemUnmap
    assert [len(calls), len(memory), len(connection.records(protocol.POOLS))] == [30, 36, 1]
    assert cupti.fake_callback_exceptions() == []

    allocations = [call for call in calls if call.api == Api.cuMemAlloc_v2 and call.result == 0]
    assert [call.address for call in allocations] == made["addresses"]
    assert [call.size_bytes for call in allocations] == [(index + 1) * 4096 for index in range(23)]
    assert {call.tid for call in calls} == {threading.get_native_id()}
    by_correlation = {(record.correlation_id, record.operation): record for record in memory}
    for call in allocations:
        record = by_correlation[call.correlation_id, protocol.MEMORY_ALLOCATION]
        assert (record.address, record.size_bytes, record.memory_kind) == (call.address, call.size_bytes,
                                                                           protocol.MEMORY_KIND_DEVICE)
    released = [record.address for record in memory if record.operation == protocol.MEMORY_RELEASE]
    assert released == made["addresses"][:11] + [made["va"]]

    (failed,) = [call for call in calls if call.result != 0]
    assert (failed.api, failed.result, failed.address, failed.size_bytes) == (
        Api.cuMemAlloc_v2, CUDA_ERROR_OUT_OF_MEMORY, 0, 1 << 40)
    assert all(record.correlation_id != failed.correlation_id for record in memory)

    vmm = {Api(call.api).name: call for call in calls if call.api >= Api.cuMemCreate}
    assert (vmm["cuMemAddressReserve"].address, vmm["cuMemAddressReserve"].size_bytes) == (made["va"], 4 * MiB)
    assert (vmm["cuMemCreate"].handle, vmm["cuMemCreate"].size_bytes, vmm["cuMemCreate"].device) == (
        made["handle"], 4 * MiB, 1)
    assert (vmm["cuMemMap"].address, vmm["cuMemMap"].size_bytes, vmm["cuMemMap"].handle) == (
        made["va"], 4 * MiB, made["handle"])
    assert vmm["cuMemRelease"].handle == made["handle"]
    assert vmm["cuMemAddressFree"].address == made["va"]
    mapped = by_correlation[vmm["cuMemMap"].correlation_id, protocol.MEMORY_ALLOCATION]
    assert (mapped.address, mapped.size_bytes, mapped.device) == (made["va"], 4 * MiB, 1)

    # Every call has a stack, sent before it; the 23 allocations from one line share one.
    stack_ids_sent = []
    for kind, value in connection.messages:
        if kind == protocol.STACK:
            stack_ids_sent.append(value["id"])
        elif kind == protocol.CALLS:
            assert all(call.stack_id in stack_ids_sent and call.stack_status == StackStatus.OK for call in value)
    assert stack_ids_sent == list(range(1, 9))  # the allocations, the failed one, six VMM calls
    assert len({call.stack_id for call in allocations}) == 1
    (stack,) = [value for value in connection.json(protocol.STACK) if value["id"] == allocations[0].stack_id]
    functions = [frame[0] for frame in stack["frames"]]
    assert any(name.endswith("allocate_workload") for name in functions)
    assert any(name == "test_a_known_workload_arrives_exactly" for name in functions)
    assert not any(frame[1] == tracer.__file__ for frame in stack["frames"])
    assert len(stack["frames"]) <= tracer.DEFAULT_STACK_FRAMES

    final = connection.json(protocol.STATUS)[-1]["counters"]
    assert final == {"calls": 30, "memory_records": 36, "pool_records": 1, "stacks": 8, "stacks_skipped": 0,
                     "stack_walk_ns": final["stack_walk_ns"], "dropped": 0, "callback_errors": 0, "blocks_read": 0,
                     "blocks_read_ns": 0, "blocks_left_out": 0}
    assert final["stack_walk_ns"] > 0


def test_every_allocating_function_is_read_from_its_own_params(receiver, fake_cupti):
    cupti = fake_cupti
    calls_made = [("cuMemAllocPitch_v2", dict(WidthInBytes=1000, Height=3, ElementSizeBytes=4)),
                  ("cuMemAllocManaged", dict(bytesize=5 * MiB, flags=1)),
                  ("cuMemAllocHost_v2", dict(bytesize=7 * MiB)),
                  ("cuMemHostAlloc", dict(bytesize=11 * MiB, Flags=0)),
                  ("cuMemAllocAsync", dict(bytesize=13 * MiB, hStream=0)),
                  ("cuMemAllocAsync_ptsz", dict(bytesize=17 * MiB, hStream=0)),
                  ("cuMemAllocFromPoolAsync", dict(bytesize=19 * MiB, pool=0x99, hStream=0)),
                  ("cuMemAllocFromPoolAsync_ptsz", dict(bytesize=23 * MiB, pool=0x99, hStream=0))]
    addresses = []

    def workload():
        for name, fields in calls_made:
            addresses.append(cupti.fake_driver_call(name, **fields))

    connection = run_traced(receiver, workload)

    calls = connection.records(protocol.CALLS)
    assert [Api(call.api) for call in calls] == [
        Api.cuMemAllocPitch_v2, Api.cuMemAllocManaged, Api.cuMemAllocHost_v2, Api.cuMemHostAlloc,
        *[Api.cuMemAllocAsync] * 4]
    assert [call.address for call in calls] == addresses
    assert [call.size_bytes for call in calls] == [1024 * 3, *(fields["bytesize"] for _, fields in calls_made[1:])]
    memory = {record.correlation_id: record for record in connection.records(protocol.MEMORY)}
    assert [memory[call.correlation_id].memory_kind for call in calls] == [
        protocol.MEMORY_KIND_DEVICE, protocol.MEMORY_KIND_MANAGED, protocol.MEMORY_KIND_PINNED,
        protocol.MEMORY_KIND_PINNED, *[protocol.MEMORY_KIND_DEVICE] * 4]
    assert [memory[call.correlation_id].is_async for call in calls] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [memory[call.correlation_id].size_bytes for call in calls] == [call.size_bytes for call in calls]


def test_only_the_listed_driver_functions_are_enabled(receiver, fake_cupti):
    cupti = fake_cupti
    run_traced(receiver, lambda: None)
    enabled = {cupti.driver_api_trace_cbid(cbid).name for _domain, cbid in cupti.fake_enabled_callbacks()}
    assert enabled == set(tracer.TRACED_FUNCTIONS)
    assert {domain for domain, _cbid in cupti.fake_enabled_callbacks()} == {cupti.CallbackDomain.DRIVER_API}
    assert cupti.fake_enabled_activities() == {cupti.ActivityKind.MEMORY2, cupti.ActivityKind.MEMORY_POOL}


# ---- held, unavailable, off ----


def test_a_held_cupti_is_left_alone_after_the_failed_subscribe(receiver, fake_cupti, monkeypatch):
    monkeypatch.setenv("FAKE_CUPTI_HOLDER", "CUPTI for Nsight Systems")
    connection = run_traced(receiver, lambda: fake_cupti.fake_mem_alloc(MiB))

    status = status_of(connection)
    assert (status["state"], status["holder"]) == ("held", "CUPTI for Nsight Systems")
    assert "stays out of its way" in status["reason"]
    assert fake_cupti.fake_api_calls() == ["subscribe_v2"]  # no activity call: it hung the H200
    assert connection.records(protocol.CALLS) == []


def test_another_subscribe_error_is_unavailable(receiver, fake_cupti):
    fake_cupti.fake_set_subscribe_error(fake_cupti.Result.ERROR_INSUFFICIENT_PRIVILEGES)
    connection = run_traced(receiver, lambda: None)

    status = status_of(connection)
    assert status["state"] == "unavailable" and "ERROR_INSUFFICIENT_PRIVILEGES" in status["reason"]
    assert fake_cupti.fake_api_calls() == ["subscribe_v2"]


def test_a_running_torch_profiler_holds_cupti(receiver, fake_cupti, fake_torch):
    fake_torch.autograd.profiler._set_is_profiler_enabled(True)
    connection = run_traced(receiver, lambda: None)

    status = status_of(connection)
    assert (status["state"], status["holder"]) == ("held", tracer.TORCH_PROFILER)
    assert fake_cupti.fake_api_calls() == []


def test_opting_out_never_imports_cupti(receiver, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupti", None)  # importing it would fail: "unavailable"
    connection = run_traced(receiver, lambda: None, enabled=False)

    (status,) = connection.json(protocol.STATUS)
    assert (status["state"], status["reason"], status["holder"]) == ("off", tracer.OPT_OUT_REASON, "")


def test_without_cupti_python_the_status_names_the_install(receiver, fake_torch, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "cupti", None)
    connection = run_traced(receiver, lambda: None)

    status = status_of(connection)
    assert status["state"] == "unavailable"
    assert f"(cupti-python) is missing in {sys.executable}" in status["reason"]
    assert "pip install 'kvtrace[cupti13]'" in status["reason"]  # torch here is CUDA 13: pyproject's extra
    assert capsys.readouterr().err == ""  # towards a recording, `kvtrace run`'s summary says it


@pytest.mark.parametrize(("cuda_major", "says"), [
    (13, "pip install 'kvtrace[cupti13]' (or \"cupti-python==13.*\")"),
    (12, 'pip install "cupti-python==12.*" (CUDA 12)'),  # no extra for it
    (0, "pip install 'kvtrace[cupti13]' for CUDA 13; for another CUDA major N, pip install \"cupti-python==N.*\"")])
def test_the_install_hint_follows_the_cuda_major(cuda_major, says):
    try:
        import tomllib
    except ModuleNotFoundError:  # 3.10 (tests/unit/test_builds_in_process.py): its backport
        import tomli as tomllib  # type: ignore[no-redef]

    assert tracer.install_hint(cuda_major) == f"install it into the program's Python: {says}"
    extras = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())[
        "project"]["optional-dependencies"]
    assert all(name in extras for name in tracer.CUPTI_EXTRAS.values())


def test_towards_the_agent_a_missing_cupti_is_said_on_stderr_once(receiver, fake_torch, monkeypatch, capsys):
    """The STATUS goes to the agent's log: the user running the program hears it on the program's stderr,
    in the words of `kvtrace run`'s summary, and the processes it starts do not say it again."""
    monkeypatch.setitem(sys.modules, "cupti", None)
    monkeypatch.setenv(tracer.TELL_ENV, "1")
    connection = run_traced(receiver, lambda: None, tell=True)

    status = status_of(connection)
    (line,) = capsys.readouterr().err.splitlines()
    assert line == f"kvtrace run: {tracer.not_traced_line(os.getpid(), 'unavailable', status['reason'])}"
    assert line.startswith(f"kvtrace run: pid {os.getpid()}: CUPTI unavailable (CUPTI's Python package")
    assert line.endswith("): not traced") and "pip install 'kvtrace[cupti13]'" in line
    assert os.environ[tracer.TELL_ENV] == "0"  # for the processes this one starts


def test_a_cupti_python_for_another_cuda_is_not_used(receiver, fake_cupti, fake_torch):
    fake_torch.version.cuda = "12.8"
    connection = run_traced(receiver, lambda: None)

    status = status_of(connection)
    assert status["state"] == "unavailable"
    assert "13.0.1" in status["reason"] and 'pip install "cupti-python==12.*"' in status["reason"]
    assert fake_cupti.fake_api_calls() == []


def test_an_unreachable_socket_is_one_line_and_no_subscription(fake_cupti, capsys):
    traced = tracer.CuptiTracer(tracer.Settings(socket_path="/nonexistent/kvtrace/cupti.sock"))
    traced.start()
    traced.stop()

    error_lines = capsys.readouterr().err.splitlines()
    assert len(error_lines) == 1
    assert error_lines[0].startswith("kvtrace: cannot reach /nonexistent/kvtrace/cupti.sock: ")
    assert error_lines[0].endswith(f"; CUPTI tracing off in pid {os.getpid()}")
    assert fake_cupti.fake_api_calls() == []


# ---- torch's CUDA initialisation ----


def test_the_torch_hook_subscribes_at_the_first_cuda_init_only(receiver, fake_cupti, fake_torch_path, monkeypatch):
    monkeypatch.setenv(protocol.SOCKET_ENV, receiver.path)
    installed = tracer.install_from_environment()
    import torch  # after the hook: torch.cuda is wrapped as it is imported

    assert getattr(torch.cuda._lazy_init, "_kvtrace_original", None) is not None
    assert torch.cuda.memory._lazy_init is torch.cuda._lazy_init  # bound by name inside torch
    assert fake_cupti.fake_api_calls() == [] and not installed.started

    torch.cuda.empty(MiB)
    torch.cuda.empty(2 * MiB)
    torch.cuda._lazy_init()
    torch.cuda.memory.caching_allocator_alloc(3 * MiB)
    tracer._reset()

    assert fake_cupti.fake_api_calls().count("subscribe_v2") == 1
    assert torch.cuda.init_count == 1
    (connection,) = receiver.wait(1)
    # CUDA's own start-up allocation is seen too: the subscription came before torch's initialisation
    assert [call.size_bytes for call in connection.records(protocol.CALLS)] == [2 * MiB, MiB, 2 * MiB, 3 * MiB]


def test_a_torch_imported_before_the_tracer_is_wrapped_at_once(receiver, fake_cupti, fake_torch, monkeypatch):
    monkeypatch.setenv(protocol.SOCKET_ENV, receiver.path)
    tracer.install_from_environment()
    fake_torch.cuda.empty(MiB)
    tracer._reset()

    (connection,) = receiver.wait(1)
    assert len(connection.records(protocol.CALLS)) == 2


def test_a_profiler_started_later_gets_cupti_back(receiver, fake_cupti, fake_torch, monkeypatch):
    """torch.profiler after kvtrace subscribed: kvtrace sends its last records, gives CUPTI up, says so."""
    monkeypatch.setenv(protocol.SOCKET_ENV, receiver.path)
    tracer.install_from_environment()
    fake_torch.cuda.empty(MiB)  # CUDA starts: kvtrace subscribes
    fake_torch.autograd.profiler.profile()._prepare_trace()
    fake_torch.cuda.empty(2 * MiB)  # the profiler's now: kvtrace records nothing
    tracer._reset()

    assert fake_torch.autograd.profiler.profile.prepared == 1
    calls = fake_cupti.fake_api_calls()
    assert calls.index("unsubscribe") > calls.index("activity_flush_all")
    assert fake_cupti.fake_subscriber() is None
    (connection,) = receiver.wait(1)
    last = connection.json(protocol.STATUS)[-1]
    assert (last["state"], last["holder"]) == ("held", tracer.TORCH_PROFILER) and last["stopped_ns"] > 0
    assert [call.size_bytes for call in connection.records(protocol.CALLS)] == [2 * MiB, MiB]


def test_cuda_starting_inside_a_profilers_preparation_leaves_cupti_to_it(receiver, fake_cupti, fake_torch,
                                                                         monkeypatch):
    monkeypatch.setenv(protocol.SOCKET_ENV, receiver.path)
    monkeypatch.setattr(fake_torch.autograd.profiler.profile, "starts_cuda", True)
    tracer.install_from_environment()
    fake_torch.autograd.profiler.profile()._prepare_trace()  # before any CUDA use: CUDA starts in there
    fake_torch.cuda.empty(MiB)
    tracer._reset()

    assert fake_cupti.fake_api_calls() == []
    (connection,) = receiver.wait(1)
    assert (status_of(connection)["state"], status_of(connection)["holder"]) == ("held", tracer.TORCH_PROFILER)


# ---- PyTorch's block recorder (KVTRACE_CUPTI_BLOCKS=1) ----


def _keep(size_bytes: int, inside: int = 0) -> int:
    import torch

    return torch.cuda.memory.block(size_bytes, inside)  # KEEP_LINE


def _scratch(size_bytes: int) -> int:
    import torch

    return torch.cuda.memory.caching_allocator_alloc(size_bytes)  # the cache grows here


def test_pytorchs_recorder_goes_on_at_cuda_start_and_its_live_blocks_are_read_at_exit(receiver, fake_cupti,
                                                                                      fake_torch_path, monkeypatch):
    monkeypatch.setenv(protocol.SOCKET_ENV, receiver.path)
    monkeypatch.setenv(tracer.BLOCKS_ENV, "1")
    tracer.install_from_environment()
    import torch

    segment = _scratch(64 * MiB)  # CUDA starts here: the recorder goes on right after torch's initialisation
    kept = [_keep(MiB, inside=segment) for _ in range(5)]
    freed = _keep(2 * MiB, inside=segment)
    torch.cuda.memory.free_block(freed)
    tracer._reset()

    # at its cheapest, once; and left on (the process is ending)
    assert torch.cuda.memory.history_calls == [{"enabled": "state", "context": "state", "stacks": "python"}]
    assert torch.cuda.memory.snapshot_subscribers == [None]  # CUPTI given back before the blocks were read
    (connection,) = receiver.wait(1)
    [blocks] = connection.json(protocol.BLOCKS)
    assert blocks["recorder"] == "kvtrace" and 0 < blocks["since_ns"] <= blocks["taken_ns"]
    assert [(device, address, size) for device, address, size, _ in blocks["blocks"]] == [
        (0, address, MiB) for address in kept]
    stacks = {message["id"]: message["frames"] for message in connection.json(protocol.STACK)}
    [stack_id] = {row[3] for row in blocks["blocks"]}
    keep_line = next(number for number, line in enumerate(Path(__file__).read_text().splitlines(), 1)
                     if "# KEEP_LINE" in line)
    assert stacks[stack_id][0] == ["_keep", __file__, keep_line]  # innermost first, as the recorder gives them
    assert "test_pytorchs_recorder_goes_on_at_cuda_start_and_its_live_blocks_are_read_at_exit" in {
        function for function, _, _ in stacks[stack_id]}
    # the STACK before the BLOCKS that names it; the last STATUS after both, counting what was read
    order = [(kind, value.get("id")) for kind, value in connection.messages
             if kind in (protocol.STACK, protocol.BLOCKS)]
    assert order.index((protocol.STACK, stack_id)) < order.index((protocol.BLOCKS, None))
    assert connection.kinds()[-1] == protocol.STATUS
    assert connection.json(protocol.STATUS)[-1]["counters"]["blocks_read"] == 5
    # the segment's CALL still names the function that grew the cache
    [segment_call] = [call for call in connection.records(protocol.CALLS) if call.size_bytes == 64 * MiB]
    segment_functions = [function for function, _, _ in stacks[segment_call.stack_id]]
    assert "_scratch" in segment_functions and "_keep" not in segment_functions


def test_the_programs_own_recorder_is_read_and_left_as_it_was(receiver, fake_cupti, fake_torch, monkeypatch):
    monkeypatch.setenv(protocol.SOCKET_ENV, receiver.path)
    monkeypatch.setenv(tracer.BLOCKS_ENV, "1")
    fake_torch.cuda.memory._record_memory_history(enabled="all")  # the program records its history itself
    tracer.install_from_environment()
    address = _keep(MiB)
    tracer._reset()

    assert fake_torch.cuda.memory.history_calls == [{"enabled": "all", "context": "all", "stacks": "all"}]
    (connection,) = receiver.wait(1)
    [blocks] = connection.json(protocol.BLOCKS)
    assert blocks["recorder"] == "program" and [row[:3] for row in blocks["blocks"]] == [[0, address, MiB]]
    # its C++ frames left out: the stack starts at the Python function that allocated
    [stack] = [message for message in connection.json(protocol.STACK) if message["id"] == blocks["blocks"][0][3]]
    assert stack["frames"][0][0] == "_keep"


def test_without_the_setting_the_recorder_is_never_touched(receiver, fake_cupti, fake_torch, monkeypatch):
    monkeypatch.setenv(protocol.SOCKET_ENV, receiver.path)
    tracer.install_from_environment()
    _keep(MiB)
    tracer._reset()

    assert fake_torch.cuda.memory.history_calls == []
    (connection,) = receiver.wait(1)
    assert protocol.BLOCKS not in connection.kinds() and "unsubscribe" not in fake_cupti.fake_api_calls()


def test_a_recorder_that_fails_is_counted_and_the_program_goes_on(receiver, fake_cupti, fake_torch, monkeypatch):
    monkeypatch.setenv(protocol.SOCKET_ENV, receiver.path)
    monkeypatch.setenv(tracer.BLOCKS_ENV, "1")

    def refuse(**_settings):
        raise RuntimeError("no recorder in this build")

    monkeypatch.setattr(fake_torch.cuda.memory, "_record_memory_history", refuse)
    tracer.install_from_environment()
    address = _keep(MiB)
    tracer._reset()

    (connection,) = receiver.wait(1)
    assert address and protocol.BLOCKS not in connection.kinds()
    assert connection.json(protocol.STATUS)[-1]["counters"]["callback_errors"] == 1


# ---- stacks ----


def test_with_the_stack_budget_spent_calls_go_without_stacks(receiver, fake_cupti):
    def workload():
        for _ in range(23):
            fake_cupti.fake_mem_alloc(MiB)

    connection = run_traced(receiver, workload, stack_budget=0.0)

    calls = connection.records(protocol.CALLS)
    assert len(calls) == 23
    assert {(call.stack_id, call.stack_status) for call in calls} == {(0, StackStatus.NOT_WALKED)}
    assert connection.json(protocol.STACK) == []
    counters = connection.json(protocol.STATUS)[-1]["counters"]
    assert (counters["stacks_skipped"], counters["stacks"]) == (23, 0)


def test_the_stack_budget_refills_with_wall_time():
    now = [0]
    budget = tracer.StackBudget(0.1, clock_ns=lambda: now[0])
    assert budget.allows()  # saved-up credit: 0.1 x the window
    budget.spend(int(0.1 * tracer.STACK_BUDGET_WINDOW_NS) + 1000)
    assert not budget.allows()
    now[0] += 20_000  # 10% of it: 2000 ns of credit, 1000 still owed before
    assert budget.allows()
    now[0] += 10**15  # a long idle time saves up no more than the window's share
    assert budget.allows()
    budget.spend(int(0.1 * tracer.STACK_BUDGET_WINDOW_NS) + 1)
    assert not budget.allows()


def test_a_deep_stack_is_cut_and_says_so(receiver, fake_cupti):
    def recurse(depth):
        return fake_cupti.fake_mem_alloc(MiB) if depth == 0 else recurse(depth - 1)

    connection = run_traced(receiver, lambda: recurse(60), stack_frames=8)

    (stack,) = connection.json(protocol.STACK)
    assert len(stack["frames"]) == 8 and stack["truncated"] is True
    assert stack["frames"][-1][0].endswith("recurse")


# ---- never harmful ----


def test_the_callbacks_never_raise_even_on_garbage(receiver, fake_cupti):
    traced = make_tracer(receiver)
    traced.start()
    garbage = [None, object(), SimpleNamespace(callback_site=1),
               SimpleNamespace(callback_site=1, function_name="cuMemAlloc_v2", ptr=0, correlation_id=1),
               SimpleNamespace(callback_site=1, function_name="cuNotTraced", ptr=8, correlation_id=1),
               SimpleNamespace(callback_site=1, function_name="cuMemAlloc_v2", ptr="not a pointer")]
    for cbdata in garbage:
        traced._on_api(None, 1, 243, cbdata)
    for activities in (None, [object()], [SimpleNamespace(kind=49, memory_kind=3, memory_operation_type=1,
                                                          device_id=0, correlation_id=-5, is_async=0, address=1,
                                                          bytes=1, timestamp=1)]):
        traced._buffer_completed(activities)
    fake_cupti.fake_mem_alloc(MiB)  # and it still traces
    traced.stop()

    (connection,) = receiver.wait(1)
    assert traced.counters()["callback_errors"] == len(garbage) + 3
    errors = [status for status in connection.json(protocol.STATUS) if "callback" in status["reason"]]
    assert len(errors) == 1 and errors[0]["state"] == "tracing"
    assert len(connection.records(protocol.CALLS)) == 1
    assert fake_cupti.fake_callback_exceptions() == []


def test_a_full_queue_drops_counts_and_marks_the_gap(receiver, fake_cupti):
    traced = tracer.CuptiTracer(tracer.Settings(socket_path=receiver.path, stack_budget=0.0),
                                pending_limit_bytes=10 * protocol.CALL_RECORD.size, flush_interval_seconds=3600)
    traced.start()
    for _ in range(23):
        fake_cupti.fake_mem_alloc(MiB)
    traced.flush()  # 10 calls went in; the 23 memory records find the queue full too
    fake_cupti.fake_mem_alloc(MiB)  # room again
    traced.stop()

    (connection,) = receiver.wait(1)
    after_start = [(kind, value) for kind, value in connection.messages if kind != protocol.STATUS][1:]
    assert after_start[0][0] == protocol.CALLS and len(after_start[0][1]) == 10
    assert after_start[1:3] == [(protocol.LOST, {"count": 13, "what": "calls"}),
                                (protocol.LOST, {"count": 23, "what": "memory records"})]
    assert after_start[3][0] == protocol.CALLS and len(after_start[3][1]) == 1
    assert connection.json(protocol.STATUS)[-1]["counters"]["dropped"] == 36


def test_a_receiver_that_goes_away_stops_the_tracer_not_the_program(receiver, fake_cupti):
    traced = make_tracer(receiver)
    traced.start()
    deadline = time.monotonic() + 5
    while not receiver.connections and time.monotonic() < deadline:
        time.sleep(0.01)
    receiver.close_peers()
    for _ in range(5):
        fake_cupti.fake_mem_alloc(MiB)
        traced.flush()
    addresses = [fake_cupti.fake_mem_alloc(MiB) for _ in range(3)]
    traced.stop()

    assert all(addresses) and fake_cupti.fake_callback_exceptions() == []
    assert traced.counters()["dropped"] >= 1


def test_with_nobody_listening_any_more_cupti_is_given_back(receiver, fake_cupti):
    """The agent restarted: the records have no reader, so kvtrace stops paying for them and frees CUPTI."""
    traced = tracer.CuptiTracer(tracer.Settings(socket_path=receiver.path), flush_interval_seconds=0.05)
    traced.start()
    deadline = time.monotonic() + 5
    while not receiver.connections and time.monotonic() < deadline:
        time.sleep(0.01)
    receiver.close_peers()
    deadline = time.monotonic() + 5
    while fake_cupti.fake_subscriber() is not None and time.monotonic() < deadline:
        fake_cupti.fake_mem_alloc(MiB)  # records to send, so that the send finds the peer gone
        time.sleep(0.05)
    assert fake_cupti.fake_subscriber() is None
    assert fake_cupti.fake_mem_alloc(MiB) and fake_cupti.fake_callback_exceptions() == []
    traced.stop()


# ---- processes: fork, spawn, sitecustomize ----


def run_python(receiver: Receiver | None, script: str, tmp_path: Path, pythonpath: list[Path], **env: str):
    path = tmp_path / "workload.py"
    path.write_text(textwrap.dedent(script))
    environment = {name: value for name, value in os.environ.items()
                   if not name.startswith(("KVTRACE_", "FAKE_")) and name != "PYTHONPATH"}
    environment["PYTHONPATH"] = os.pathsep.join(str(entry) for entry in pythonpath)
    if receiver is not None:
        environment[protocol.SOCKET_ENV] = receiver.path
    environment.update(env)
    return subprocess.run([sys.executable, str(path)], env=environment, capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)


TRACED_PATH = [BOOT_DIR, AGENT_DIR, FAKE_CUPTI_DIR, FAKE_TORCH_DIR]


def test_a_forked_child_of_a_tracing_parent_sends_nothing(receiver, tmp_path):
    done = run_python(receiver, """
        import os, sys
        from cupti import cupti
        for _ in range(3):
            cupti.fake_mem_alloc(4096)
        pid = os.fork()
        if pid == 0:
            for _ in range(5):
                cupti.fake_mem_alloc(4096)
            cupti.activity_flush_all(1)
            sys.exit(0)  # the child's atexit handlers run
        os.waitpid(pid, 0)
        for _ in range(2):
            cupti.fake_mem_alloc(4096)
        print(os.getpid())
    """, tmp_path, TRACED_PATH, KVTRACE_CUPTI_EAGER="1", PYTHONWARNINGS="ignore::DeprecationWarning")
    assert done.returncode == 0 and done.stderr == "", done.stderr

    (connection,) = receiver.wait(1)
    assert connection.pid == int(done.stdout)
    assert len(connection.json(protocol.HELLO)) == 1
    assert len(connection.records(protocol.CALLS)) == 5
    assert len(connection.records(protocol.MEMORY)) == 5


def test_a_child_forked_before_cuda_init_traces_itself(receiver, tmp_path):
    done = run_python(receiver, """
        import os, sys
        import torch
        pid = os.fork()
        if pid == 0:
            torch.cuda.empty(4096)
            sys.exit(0)
        os.waitpid(pid, 0)
        torch.cuda.empty(4096)
        print(os.getpid(), pid)
    """, tmp_path, TRACED_PATH, PYTHONWARNINGS="ignore::DeprecationWarning")
    assert done.returncode == 0 and done.stderr == "", done.stderr

    connections = receiver.wait(2)
    assert sorted(connection.pid for connection in connections) == sorted(map(int, done.stdout.split()))
    for connection in connections:
        assert status_of(connection)["state"] == "tracing"
        assert len(connection.records(protocol.CALLS)) == 2


def test_sitecustomize_chains_and_a_spawned_child_sends_its_own(receiver, tmp_path):
    other_site = tmp_path / "other_site"
    other_site.mkdir()
    (other_site / "sitecustomize.py").write_text(
        "import os\nwith open(os.environ['MARKER_FILE'], 'a') as f:\n    f.write(f'{os.getpid()}\\n')\n")
    marker = tmp_path / "marker"
    done = run_python(receiver, """
        import multiprocessing, os
        import torch

        def child():
            torch.cuda.empty(1 << 20)

        if __name__ == "__main__":
            torch.cuda.empty(1 << 20)
            process = multiprocessing.get_context("spawn").Process(target=child)
            process.start()
            process.join()
            print(os.getpid(), process.pid, process.exitcode)
    """, tmp_path, [BOOT_DIR, other_site, AGENT_DIR, FAKE_CUPTI_DIR, FAKE_TORCH_DIR], MARKER_FILE=str(marker))
    assert done.returncode == 0 and done.stderr == "", done.stderr
    parent_pid, child_pid, exit_code = map(int, done.stdout.split())
    assert exit_code == 0

    assert {parent_pid, child_pid} <= set(map(int, marker.read_text().split()))  # ours ran the other one
    connections = receiver.wait(2)
    assert sorted(connection.pid for connection in connections) == sorted([parent_pid, child_pid])
    for connection in connections:
        assert connection.kinds()[0] == protocol.HELLO
        assert len(connection.records(protocol.CALLS)) == 2


def test_sitecustomize_without_the_socket_does_nothing_visible(tmp_path):
    other_site = tmp_path / "other_site"
    other_site.mkdir()
    (other_site / "sitecustomize.py").write_text("import os\nos.environ['CHAINED'] = 'yes'\n")
    done = run_python(None, """
        import os, sys
        print(os.environ.get("CHAINED"), "kvtrace.sources.cupti.tracer" in sys.modules,
              sys.modules["sitecustomize"].__file__)
    """, tmp_path, [BOOT_DIR, other_site, AGENT_DIR])
    assert done.returncode == 0 and done.stderr == ""
    chained, imported, module_file = done.stdout.split()
    assert (chained, imported) == ("yes", "False")
    assert module_file == str(other_site / "sitecustomize.py")  # as if kvtrace were not there


def test_a_failing_user_sitecustomize_is_reported_as_python_would_and_the_tracer_still_installs(tmp_path):
    other_site = tmp_path / "other_site"
    other_site.mkdir()
    (other_site / "sitecustomize.py").write_text("raise RuntimeError('the user sitecustomize failed')\n")
    done = run_python(None, """
        import sys
        print("kvtrace.sources.cupti.tracer" in sys.modules)
    """, tmp_path, [BOOT_DIR, other_site, AGENT_DIR], KVTRACE_CUPTI_SOCKET="/nonexistent/cupti.sock")
    assert done.returncode == 0 and done.stdout.split() == ["True"]
    assert "Error in sitecustomize" in done.stderr and "the user sitecustomize failed" in done.stderr


def test_an_eager_tracer_with_no_receiver_is_one_line_on_stderr(tmp_path):
    done = run_python(None, "print('ran')", tmp_path, TRACED_PATH, KVTRACE_CUPTI_SOCKET="/nonexistent/cupti.sock",
                      KVTRACE_CUPTI_EAGER="1")
    assert done.returncode == 0 and done.stdout == "ran\n"
    (line,) = done.stderr.splitlines()
    assert line.startswith("kvtrace: cannot reach /nonexistent/cupti.sock: ") and "CUPTI tracing off" in line


def test_the_tracer_imports_only_the_standard_library(tmp_path):
    done = run_python(None, """
        import json, sys
        before = set(sys.modules)
        import kvtrace.sources.cupti.tracer
        print(json.dumps(sorted(set(sys.modules) - before)))
    """, tmp_path, [AGENT_DIR])
    assert done.returncode == 0, done.stderr
    foreign = [name for name in json.loads(done.stdout)
               if name.split(".")[0] not in sys.stdlib_module_names and name.split(".")[0] != "kvtrace"]
    assert foreign == []


def test_importing_the_tracer_loads_nothing_heavy(tmp_path):
    """As the vLLM plugin's test holds for the plugin: the tracer is imported into every Python process of a
    `kvtrace run`, so it loads none of the agent's heavy dependencies, neither cupti nor torch before it
    subscribes, and of kvtrace only these few small modules."""
    done = run_python(None, """
        import json, sys
        import kvtrace.sources.cupti.tracer
        print(json.dumps(sorted(sys.modules)))
    """, tmp_path, [AGENT_DIR])
    assert done.returncode == 0, done.stderr
    modules = set(json.loads(done.stdout))
    heavy = {"grpc", "bcc", "prometheus_client", "psutil", "google.protobuf", "rich", "pynvml", "elftools",
             "opentelemetry", "cupti", "torch", "numpy"}
    assert not modules & heavy
    assert {module for module in modules if module.startswith("kvtrace")} == {
        "kvtrace", "kvtrace.model", "kvtrace.model.events", "kvtrace.sources", "kvtrace.sources.cupti",
        "kvtrace.sources.cupti.protocol", "kvtrace.sources.cupti.tracer", "kvtrace.sources.post_import"}


def test_the_models_stack_classes_have_one_meaning_in_the_package():
    """kvtrace.model.stacks's class names (StackTable: the agent's interned stacks) name no other class:
    the tracer's own table of walked stacks is WalkTable."""
    import ast

    package = AGENT_DIR / "kvtrace"
    model = package / "model" / "stacks.py"
    names = {node.name for node in ast.parse(model.read_text()).body if isinstance(node, ast.ClassDef)}
    assert "StackTable" in names and hasattr(tracer, "WalkTable")
    again = [(path.relative_to(package).as_posix(), node.name) for path in sorted(package.rglob("*.py"))
             if path != model and "_proto" not in path.parts
             for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef) and node.name in names]
    assert again == []
