"""The vLLM plugin (agent/kvtrace/sources/vllm/plugin.py) against faithful fakes of vLLM 0.24.0's classes
(vllm_fakes.py, written as a `vllm` package and imported through Python's own import system), sending
to a real AF_UNIX datagram socket as the agent binds it.

GIVEN the plugin enabled (KVTRACE_VLLM_PLUGIN=1, the socket there) WHEN vLLM's modules are imported and
its engine runs THEN the agent receives exactly the messages protocol.py describes, and nothing kvtrace
does can change what vLLM's calls return or raise.
"""
from __future__ import annotations

import gc
import importlib
import json
import logging
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import vllm_fakes  # noqa: E402
from kvtrace.sources.vllm import plugin, protocol  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# vllm_fakes.kv_cache_config's spec: K and V x block_size 16 x 8 KV heads x head size 128 x 2 bytes
PAGE_SIZE_BYTES = 2 * 16 * 8 * 128 * 2
TARGETS = {
    "vllm.v1.core.sched.scheduler": [("Scheduler", "__init__"), ("Scheduler", "finish_requests"),
                                     ("Scheduler", "_free_request")],
    "vllm.v1.core.block_pool": [("BlockPool", "get_new_blocks"), ("BlockPool", "free_blocks"),
                                ("BlockPool", "touch")],
    "vllm.v1.worker.gpu.attn_utils": [(None, "_allocate_kv_cache")],
    "vllm.v1.worker.gpu_model_runner": [("GPUModelRunner", "_allocate_kv_cache_tensors")],
    "vllm.device_allocator.cumem": [("CuMemAllocator", "sleep"), ("CuMemAllocator", "wake_up")],
    "vllm.v1.worker.gpu_worker": [("Worker", "sleep")],
}


class Agent:
    """The agent's end: a bound SOCK_DGRAM socket with SO_PASSCRED (the sender's pid from the kernel)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sizes: list[int] = []
        self.pids: list[int] = []

    def receive(self, timeout_seconds: float = 2.0) -> dict | None:
        self.sock.settimeout(timeout_seconds)
        try:
            data, ancillary, _flags, _address = self.sock.recvmsg(1 << 20, socket.CMSG_SPACE(12))
        except TimeoutError:
            return None
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                self.pids.append(struct.unpack("3i", payload)[0])
        self.sizes.append(len(data))
        return json.loads(data)

    def next(self, kind: str, timeout_seconds: float = 2.0) -> dict:
        """The next message of that type (others skipped)."""
        deadline = time.monotonic() + timeout_seconds
        while (left := deadline - time.monotonic()) > 0:
            message = self.receive(left)
            if message is not None and message["type"] == kind:
                return message
        raise AssertionError(f"no {kind} message within {timeout_seconds} s")

    def drain(self) -> list[dict]:
        messages = []
        while (message := self.receive(0.05)) is not None:
            messages.append(message)
        return messages

    def close(self) -> None:
        self.sock.close()
        self.path.unlink(missing_ok=True)


class Clock:
    """plugin.time stand-in: monotonic() the test sets."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def fake_vllm(tmp_path):
    root = vllm_fakes.install(tmp_path / "site")
    vllm_fakes.forget()
    sys.path.insert(0, str(root))
    importlib.invalidate_caches()
    yield root
    plugin._reset()
    vllm_fakes.forget()
    sys.path.remove(str(root))
    importlib.invalidate_caches()


@pytest.fixture
def agent(monkeypatch):
    # A short directory: a Unix socket path has at most 107 bytes (pytest's tmp_path can be longer).
    directory = Path(tempfile.mkdtemp(prefix="kvtrace-vllm-"))
    receiver = Agent(directory / "vllm.sock")
    monkeypatch.setenv(protocol.ENABLE_ENV, "1")
    monkeypatch.setenv(protocol.SOCKET_ENV, str(receiver.path))
    yield receiver
    receiver.close()
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def quiet_reporter(monkeypatch):
    """The reporter thread sends its first report at once, then none during the test: each test sends
    the reports it checks itself (send_scheduler_report), so the messages are exactly those."""
    monkeypatch.setattr(protocol, "REPORT_INTERVAL_SECONDS", 3600.0)


@pytest.fixture
def clock(monkeypatch):
    fake = Clock()
    monkeypatch.setattr(plugin, "time", fake)
    return fake


def _wrapped(module_name: str) -> dict[str, object]:
    module = importlib.import_module(module_name)
    found = {}
    for owner_name, name in TARGETS[module_name]:
        owner = getattr(module, owner_name) if owner_name else module
        found[f"{owner_name or module_name}.{name}"] = getattr(owner.__dict__[name], plugin._MARK, None)
    return found


def _reporter_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "kvtrace-vllm-reporter"]


def _plant_abort_leak():
    """As tests/gpu/workloads/vllm_engine.py does to the real engine: aborted leak-* requests keep their
    blocks (vLLM still deletes them from scheduler.requests)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import RequestStatus

    original = Scheduler._free_request_blocks

    def leaky(self, request):
        if request.status == RequestStatus.FINISHED_ABORTED and request.request_id.startswith("leak-"):
            return
        return original(self, request)

    Scheduler._free_request_blocks = leaky


def _request(scheduler, request_id: str, blocks: int = 0):
    from vllm.v1.request import Request

    scheduler.add_request(Request(request_id))
    if blocks:
        assert scheduler.allocate(request_id, blocks)


# ---- off unless asked for ----


@pytest.mark.parametrize("enabled", [None, "0", "yes"])
def test_does_nothing_unless_enabled(fake_vllm, monkeypatch, enabled):
    path = Path(tempfile.mkdtemp(prefix="kvtrace-vllm-")) / "vllm.sock"
    bound = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    bound.bind(str(path))
    if enabled is None:
        monkeypatch.delenv(protocol.ENABLE_ENV, raising=False)
    else:
        monkeypatch.setenv(protocol.ENABLE_ENV, enabled)
    monkeypatch.setenv(protocol.SOCKET_ENV, str(path))
    meta_path = list(sys.meta_path)

    plugin.register()
    scheduler = vllm_fakes.new_scheduler()
    _request(scheduler, "r", 3)

    assert sys.meta_path == meta_path
    for module_name in TARGETS:
        assert set(_wrapped(module_name).values()) == {None}, module_name
    assert _reporter_threads() == []
    assert plugin.stats()["active"] is False and plugin.stats()["sent"] == 0
    bound.close()
    shutil.rmtree(path.parent)


def test_builds_nothing_until_an_agent_is_there_then_tells_it_everything(fake_vllm, monkeypatch):
    """Enabled before the agent runs: no report is built (the reporter only looks for the socket); the
    agent that comes gets the KV layout at once and the scheduler's reports; a restarted agent (a new
    socket file at the same path) gets the layout again."""
    monkeypatch.setattr(protocol, "REPORT_INTERVAL_SECONDS", 0.05)
    directory = Path(tempfile.mkdtemp(prefix="kvtrace-vllm-"))
    path = directory / "vllm.sock"
    monkeypatch.setenv(protocol.ENABLE_ENV, "1")
    monkeypatch.setenv(protocol.SOCKET_ENV, str(path))
    built = []
    original_build = plugin.build_scheduler_report
    monkeypatch.setattr(plugin, "build_scheduler_report",
                        lambda scheduler: built.append(1) or original_build(scheduler))
    plugin.register()
    from vllm import _fake_torch
    from vllm.v1.worker.gpu import attn_utils

    scheduler = vllm_fakes.new_scheduler(num_blocks=11)
    attn_utils.init_kv_cache([], {}, vllm_fakes.kv_cache_config(num_blocks=11), [], _fake_torch.Device(), "auto", [],
                             None)
    time.sleep(0.3)
    assert built == [] and plugin.stats()["sent"] == 0
    try:
        first = Agent(path)
        assert first.next(protocol.TYPE_KV_CACHE, timeout_seconds=2.0)["num_blocks"] == 11
        assert first.next(protocol.TYPE_SCHEDULER, timeout_seconds=2.0)["blocks_total"] == 10
        first.close()
        second = Agent(path)  # the agent restarted
        assert second.next(protocol.TYPE_KV_CACHE, timeout_seconds=2.0)["num_blocks"] == 11
        second.close()
    finally:
        del scheduler
        shutil.rmtree(directory, ignore_errors=True)


# ---- patching ----


def test_patches_on_import_through_the_finder_once(fake_vllm, agent, quiet_reporter):
    plugin.register()
    plugin.register()  # vLLM may call it again (several plugin loads in one process): idempotent
    assert sum(getattr(finder, plugin._FINDER_MARK, False) for finder in sys.meta_path) == 1

    for module_name in TARGETS:
        wrapped = _wrapped(module_name)
        assert None not in wrapped.values(), (module_name, wrapped)
        # each wraps vLLM's own function, never another wrapper
        assert all(getattr(original, plugin._MARK, None) is None for original in wrapped.values())
        module = sys.modules[module_name]
        assert type(module.__loader__).__name__ == "SourceFileLoader"  # vLLM never sees kvtrace's loader
        assert module.__spec__.loader is module.__loader__

    before = {name: _wrapped(name) for name in TARGETS}
    plugin.register()
    assert {name: _wrapped(name) for name in TARGETS} == before


def test_modules_imported_before_register_are_patched_at_once(fake_vllm, agent, quiet_reporter):
    for module_name in TARGETS:
        importlib.import_module(module_name)
    assert set(_wrapped("vllm.v1.core.block_pool").values()) == {None}

    plugin.register()

    for module_name in TARGETS:
        assert None not in _wrapped(module_name).values(), module_name


def test_init_kv_cache_reaches_the_patched_module_global(fake_vllm, agent):
    """The V2 runner imports init_kv_cache by name before kvtrace could know; init_kv_cache looks
    _allocate_kv_cache up in attn_utils' globals at each call, which is what is patched."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner  # imported before register()

    plugin.register()
    from vllm import _fake_torch

    GPUModelRunner(_fake_torch.Device("cuda", 3)).initialize_kv_cache(vllm_fakes.kv_cache_config(layers=2))
    assert agent.next(protocol.TYPE_KV_CACHE)["device"] == 3


# ---- scheduler reports ----


def test_report_shows_the_planted_abort_leak_and_not_the_normal_abort(fake_vllm, agent, quiet_reporter, clock):
    from vllm.v1.request import RequestStatus

    plugin.register()
    _plant_abort_leak()
    scheduler = vllm_fakes.new_scheduler(num_blocks=1001)
    first = agent.next(protocol.TYPE_SCHEDULER)  # the reporter's first report, at the scheduler's start
    assert first["blocks_total"] == 1000 and first["blocks_free"] == 1000 and first["requests"] == []

    _request(scheduler, "leak-0", 3)
    _request(scheduler, "abort-0", 2)
    _request(scheduler, "run-0", 5)
    _request(scheduler, "done-0", 4)
    _request(scheduler, "wait-0")
    clock.now = 1000.0
    scheduler.step_finish("done-0")  # a normal finish: blocks back
    clock.now = 1001.0
    assert scheduler.finish_requests(["leak-0", "abort-0"], RequestStatus.FINISHED_ABORTED) in (
        [("leak-0", 0), ("abort-0", 0)], [("abort-0", 0), ("leak-0", 0)])
    clock.now = 1008.5
    plugin.send_scheduler_report(scheduler)

    report = agent.next(protocol.TYPE_SCHEDULER)
    assert report == {
        "v": protocol.VERSION, "type": protocol.TYPE_SCHEDULER,
        "blocks_total": 1000, "blocks_free": 1000 - 3 - 5, "running": 1, "waiting": 1,
        "allocated_total": 3 + 2 + 5 + 4, "freed_total": 2 + 4,
        "requests": [["leak-0", "aborted", 3, 7.5], ["run-0", "running", 5, None]],
        "requests_omitted": 0, "messages_dropped_total": 0,
    }
    assert report["blocks_free"] == report["blocks_total"] - report["allocated_total"] + report["freed_total"]
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == report["blocks_free"]
    assert "leak-0" not in scheduler.requests  # gone from vLLM's view, its blocks still held
    assert set(agent.pids) == {os.getpid()}


def test_states_order_and_counts_with_preemption_and_prefix_hits(fake_vllm, agent, quiet_reporter, clock):
    from vllm.v1.request import RequestStatus

    plugin.register()
    _plant_abort_leak()
    scheduler = vllm_fakes.new_scheduler(num_blocks=101)
    agent.next(protocol.TYPE_SCHEDULER)
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]

    _request(scheduler, "cached", 4)
    cached_blocks = list(manager.req_to_blocks["cached"])
    for number, block in enumerate(cached_blocks):
        block.set_block_hash(("hash", number))
    scheduler.step_finish("cached", RequestStatus.FINISHED_LENGTH_CAPPED)  # 4 back, still cached
    _request(scheduler, "hit", 2)
    manager.share_cached_blocks("hit", cached_blocks)  # a prefix-cache hit on the freed, still cached blocks
    _request(scheduler, "preempted", 3)
    scheduler.preempt("preempted")  # 3 back
    _request(scheduler, "big", 7)
    clock.now = 1000.0
    _request(scheduler, "leak-old", 1)
    scheduler.finish_requests("leak-old", RequestStatus.FINISHED_ABORTED)
    clock.now = 1005.0
    _request(scheduler, "leak-new", 6)
    scheduler.finish_requests("leak-new", RequestStatus.FINISHED_ABORTED)
    manager.req_to_blocks["looked-up-only"]  # vLLM's defaultdict lookups leave empty entries
    clock.now = 1010.0
    plugin.send_scheduler_report(scheduler)

    report = agent.next(protocol.TYPE_SCHEDULER)
    assert report["requests"] == [["leak-old", "aborted", 1, 10.0], ["leak-new", "aborted", 6, 5.0],
                                  ["big", "running", 7, None], ["hit", "running", 6, None]]
    assert (report["running"], report["waiting"]) == (2, 1)
    # blocks out of the free queue: 4 + 2 + 4 (prefix hit, touched) + 3 + 7 + 1 + 6; back: 4 + 3
    assert (report["allocated_total"], report["freed_total"]) == (27, 7)
    assert report["blocks_free"] == 100 - 27 + 7 == scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def test_holders_are_summed_over_kv_cache_groups(fake_vllm, agent, quiet_reporter):
    plugin.register()
    scheduler = vllm_fakes.new_scheduler(num_blocks=101, groups=2)
    agent.next(protocol.TYPE_SCHEDULER)
    _request(scheduler, "two-groups", 3)  # 3 blocks in each group's manager, from the one pool
    plugin.send_scheduler_report(scheduler)
    report = agent.next(protocol.TYPE_SCHEDULER)
    assert report["requests"] == [["two-groups", "running", 6, None]]
    assert report["allocated_total"] == 6 and report["blocks_free"] == 94


def test_a_finish_the_plugin_did_not_see_is_shown_as_finished_with_an_age(fake_vllm, agent, quiet_reporter,
                                                                          clock):
    plugin.register()
    scheduler = vllm_fakes.new_scheduler(num_blocks=101)
    agent.next(protocol.TYPE_SCHEDULER)
    _request(scheduler, "vanished", 2)
    del scheduler.requests["vanished"]  # as if the finish note was dropped (more than 10 000 since)
    scheduler.running.clear()
    clock.now = 1000.0
    plugin.send_scheduler_report(scheduler)
    clock.now = 1004.0
    plugin.send_scheduler_report(scheduler)
    assert agent.next(protocol.TYPE_SCHEDULER)["requests"] == [["vanished", "finished", 2, 0.0]]
    assert agent.next(protocol.TYPE_SCHEDULER)["requests"] == [["vanished", "finished", 2, 4.0]]


def test_finish_notes_are_bounded(fake_vllm, agent, quiet_reporter, monkeypatch):
    from vllm.v1.request import RequestStatus

    monkeypatch.setattr(plugin, "FINISH_NOTES_MAX", 23)
    plugin.register()
    scheduler = vllm_fakes.new_scheduler(num_blocks=101)
    for number in range(50):
        _request(scheduler, f"r{number}")
    scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)
    notes = plugin._STATE.finish_notes
    assert len(notes) == 23 and "r49" in notes and "r0" not in notes


def test_the_reporter_reports_every_interval_and_stops_with_the_scheduler(fake_vllm, agent, monkeypatch):
    monkeypatch.setattr(protocol, "REPORT_INTERVAL_SECONDS", 0.05)
    plugin.register()
    scheduler = vllm_fakes.new_scheduler(num_blocks=11)
    for _ in range(3):
        agent.next(protocol.TYPE_SCHEDULER, timeout_seconds=1.0)
    [reporter] = _reporter_threads()
    assert reporter.daemon

    del scheduler
    gc.collect()
    reporter.join(timeout=2.0)
    assert not reporter.is_alive()


def test_a_report_with_10000_holders_fits_one_datagram(fake_vllm, agent, quiet_reporter, clock):
    from vllm.v1.request import RequestStatus

    plugin.register()
    _plant_abort_leak()
    scheduler = vllm_fakes.new_scheduler(num_blocks=10_001 + 5)
    agent.next(protocol.TYPE_SCHEDULER)
    long_suffix = "\u00e9" * 300  # JSON writes each as \u00e9: six bytes
    for number in range(10_000):
        _request(scheduler, f"{'leak' if number < 300 else 'run'}-{number:05d}-{long_suffix}", 1)
    scheduler.finish_requests([rid for rid in scheduler.requests if rid.startswith("leak-")],
                              RequestStatus.FINISHED_ABORTED)
    plugin.send_scheduler_report(scheduler)

    report = agent.next(protocol.TYPE_SCHEDULER)
    assert agent.sizes[-1] <= protocol.MAX_DATAGRAM_BYTES
    assert 0 < len(report["requests"]) <= protocol.MAX_REQUESTS_PER_REPORT
    assert len(report["requests"]) + report["requests_omitted"] == 10_000
    assert all(len(row[0]) == protocol.MAX_REQUEST_ID_CHARS for row in report["requests"])
    assert all(row[1] == "aborted" for row in report["requests"])  # done ones first


def test_the_size_limit_keeps_the_most_requests_that_fit(fake_vllm, agent, quiet_reporter):
    plugin.register()
    scheduler = vllm_fakes.new_scheduler(num_blocks=1001)
    agent.next(protocol.TYPE_SCHEDULER)
    for number in range(300):
        _request(scheduler, f"r{number:03d}" + "x" * 200, 1)
    plugin.send_scheduler_report(scheduler)
    report = agent.next(protocol.TYPE_SCHEDULER)
    assert len(report["requests"]) == protocol.MAX_REQUESTS_PER_REPORT  # 256 ids of 128 chars fit
    assert report["requests_omitted"] == 300 - protocol.MAX_REQUESTS_PER_REPORT


# ---- KV cache layout ----


def test_kv_cache_message_lists_each_shared_tensor_once(fake_vllm, agent):
    plugin.register()
    from vllm import _fake_torch
    from vllm.v1.worker.gpu.attn_utils import init_kv_cache

    config = vllm_fakes.kv_cache_config(num_blocks=1001, layers=6, shared=2)  # 6 layers, 4 tensors
    tensors = init_kv_cache([], {}, config, [], _fake_torch.Device("cuda", 1), "auto", [], None)
    assert len(tensors) == 6

    message = agent.next(protocol.TYPE_KV_CACHE)
    page_size_bytes = PAGE_SIZE_BYTES
    distinct = {tensor.data_ptr(): tensor for tensor in tensors.values()}
    assert message == {
        "v": protocol.VERSION, "type": protocol.TYPE_KV_CACHE, "device": 1,
        "tensors": [[address, 1001 * page_size_bytes] for address in sorted(distinct)],
        "tensors_omitted": 0, "num_blocks": 1001, "page_size_bytes": page_size_bytes, "block_size": 16,
    }
    assert len(message["tensors"]) == 4


def test_kv_cache_message_for_a_packed_backing_and_the_v1_runner(fake_vllm, agent):
    plugin.register()
    from vllm import _fake_torch
    from vllm.v1.worker.gpu.attn_utils import _allocate_kv_cache
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    packed = _allocate_kv_cache(vllm_fakes.kv_cache_config(num_blocks=11, layers=3, packed=True), {},
                                _fake_torch.Device())
    message = agent.next(protocol.TYPE_KV_CACHE)
    assert len({id(tensor) for tensor in packed.values()}) == 1
    assert message["tensors"] == [[next(iter(packed.values())).data_ptr(), 11 * 3 * PAGE_SIZE_BYTES]]

    runner = GPUModelRunner(_fake_torch.Device("cuda", 0))
    raw = runner.initialize_kv_cache_tensors(vllm_fakes.kv_cache_config(num_blocks=11, layers=2))
    message = agent.next(protocol.TYPE_KV_CACHE)
    assert message["tensors"] == sorted([tensor.data_ptr(), 11 * PAGE_SIZE_BYTES] for tensor in raw.values())
    assert message["num_blocks"] == 11


# ---- sleep mode ----


def _allocator_with_pools():
    from vllm.device_allocator.cumem import CuMemAllocator

    allocator = CuMemAllocator.get_instance()
    with allocator.use_memory_pool(tag="weights"):
        for size in (1 << 20, 3 << 20, 5 << 20):
            allocator.allocate(size)
    with allocator.use_memory_pool(tag="kv_cache"):
        for size in (7 << 20, 11 << 20):
            allocator.allocate(size)
    return allocator


def test_sleep_and_wake_messages(fake_vllm, agent, quiet_reporter):
    plugin.register()
    from vllm.v1.worker.gpu_worker import Worker

    allocator = _allocator_with_pools()
    worker = Worker()
    weights, kv = 9 << 20, 18 << 20

    worker.sleep(1)
    assert agent.next(protocol.TYPE_SLEEP) == {"v": protocol.VERSION, "type": protocol.TYPE_SLEEP, "level": 1,
                                               "pools": [["kv_cache", kv, 0], ["weights", weights, 0]]}
    worker.wake_up(["weights"])  # a partial wake (RLHF: weights first): still asleep, kv_cache released
    assert agent.next(protocol.TYPE_SLEEP)["pools"] == [["kv_cache", kv, 0], ["weights", weights, weights]]
    worker.wake_up(["kv_cache"])
    assert agent.next(protocol.TYPE_SLEEP) == {"v": protocol.VERSION, "type": protocol.TYPE_SLEEP, "level": 0,
                                               "pools": [["kv_cache", kv, kv], ["weights", weights, weights]]}
    worker.sleep(level=2)
    assert agent.next(protocol.TYPE_SLEEP)["level"] == 2
    worker.wake_up()
    assert agent.next(protocol.TYPE_SLEEP)["level"] == 0
    allocator.sleep(offload_tags=tuple())  # not through Worker.sleep: nothing offloaded is level 2
    assert agent.next(protocol.TYPE_SLEEP)["level"] == 2
    allocator.wake_up(None)
    assert agent.next(protocol.TYPE_SLEEP)["level"] == 0
    allocator.sleep()  # the default tag offloaded: level 1
    assert agent.next(protocol.TYPE_SLEEP)["level"] == 1
    assert all(not data.mapped for data in allocator.pointer_to_data.values())  # vLLM's own work done


def test_sleep_in_the_scheduler_process_sends_a_report_right_away(fake_vllm, agent, quiet_reporter):
    plugin.register()
    from vllm.v1.worker.gpu_worker import Worker

    scheduler = vllm_fakes.new_scheduler(num_blocks=11)
    agent.next(protocol.TYPE_SCHEDULER)
    _allocator_with_pools()
    Worker().sleep(1)
    assert [message["type"] for message in agent.drain()] == [protocol.TYPE_SLEEP, protocol.TYPE_SCHEDULER]
    del scheduler


# ---- never harmful ----


def test_an_error_in_kvtraces_part_is_contained_with_one_warning(fake_vllm, agent, quiet_reporter, monkeypatch,
                                                                 caplog):
    from vllm.v1.request import RequestStatus

    plugin.register()
    scheduler = vllm_fakes.new_scheduler(num_blocks=101)
    agent.next(protocol.TYPE_SCHEDULER)

    def broken(*args):
        raise KeyError("kvtrace bug")

    monkeypatch.setattr(plugin, "_note_finish", broken)
    for number in range(3):
        _request(scheduler, f"a{number}", 2)
    with caplog.at_level(logging.WARNING, logger="kvtrace.vllm"):
        assert scheduler.finish_requests("a0", RequestStatus.FINISHED_ABORTED) == [("a0", 0)]
        assert scheduler.finish_requests(["a1"], RequestStatus.FINISHED_ABORTED) == [("a1", 0)]
        scheduler.step_finish("a2")
    warnings = [record for record in caplog.records if record.name == "kvtrace.vllm"]
    assert len(warnings) == 1 and "request finish notes" in warnings[0].getMessage()
    assert plugin.PART_FINISH in plugin.stats()["off"]
    assert scheduler.requests == {} and scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 100

    plugin.send_scheduler_report(scheduler)  # the other parts go on
    assert agent.next(protocol.TYPE_SCHEDULER)["freed_total"] == 6


def test_an_error_in_the_kv_cache_part_leaves_the_allocation_to_vllm(fake_vllm, agent, monkeypatch, caplog):
    plugin.register()
    from vllm import _fake_torch
    from vllm.v1.worker.gpu.attn_utils import _allocate_kv_cache

    def broken(tensors, kv_cache_config):
        raise RuntimeError("kvtrace cannot read")

    monkeypatch.setattr(plugin, "build_kv_cache_message", broken)
    with caplog.at_level(logging.WARNING, logger="kvtrace.vllm"):
        for _ in range(2):
            result = _allocate_kv_cache(vllm_fakes.kv_cache_config(num_blocks=11, layers=2), {},
                                        _fake_torch.Device())
            assert sorted(result) == ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    assert [record.getMessage() for record in caplog.records if record.name == "kvtrace.vllm"] == [
        "kvtrace vLLM plugin: KV-cache layout switched off after an error (vLLM is unaffected): "
        "RuntimeError('kvtrace cannot read')"]
    assert agent.drain() == []


def test_vllms_own_exceptions_pass_through_unchanged(fake_vllm, agent, quiet_reporter):
    plugin.register()
    scheduler = vllm_fakes.new_scheduler(num_blocks=11)
    pool = scheduler.kv_cache_manager.block_pool
    with pytest.raises(ValueError, match="Cannot get 11 free blocks from the pool"):
        pool.get_new_blocks(11)
    assert plugin.stats()["allocated_total"] == 0 and plugin.stats()["off"] == []


def test_free_blocks_takes_vllms_one_shot_iterator_untouched(fake_vllm, agent, quiet_reporter):
    plugin.register()
    scheduler = vllm_fakes.new_scheduler(num_blocks=11)
    pool = scheduler.kv_cache_manager.block_pool
    blocks = pool.get_new_blocks(5)
    pool.free_blocks(reversed(blocks))  # what SingleTypeKVCacheManager.free passes
    assert pool.get_num_free_blocks() == 10
    assert (plugin.stats()["allocated_total"], plugin.stats()["freed_total"]) == (5, 5)


def test_other_block_pools_are_not_counted(fake_vllm, agent, quiet_reporter):
    """vLLM's CPU offloading (simple_kv_offload) makes BlockPools of its own."""
    plugin.register()
    vllm_fakes.new_scheduler(num_blocks=11)
    from vllm.v1.core.block_pool import BlockPool

    other = BlockPool(11, enable_caching=False, hash_block_size=16)
    other.free_blocks(other.get_new_blocks(4))
    assert (plugin.stats()["allocated_total"], plugin.stats()["freed_total"]) == (0, 0)


def test_the_agent_gone_mid_run_drops_reports_counted_with_one_warning(fake_vllm, agent, quiet_reporter, caplog):
    plugin.register()
    scheduler = vllm_fakes.new_scheduler(num_blocks=11)
    agent.next(protocol.TYPE_SCHEDULER)
    agent.close()  # the agent stopped: its socket is gone
    with caplog.at_level(logging.WARNING, logger="kvtrace.vllm"):
        for _ in range(5):
            plugin.send_scheduler_report(scheduler)
        _request(scheduler, "still-works", 2)
    assert plugin.stats()["dropped"] == 5 and plugin.stats()["off"] == []
    warnings = [record.getMessage() for record in caplog.records if record.name == "kvtrace.vllm"]
    assert len(warnings) == 1 and "took no report" in warnings[0]

    back = Agent(agent.path)  # the agent back on the same path: reports flow again, drops told in-band
    try:
        plugin.send_scheduler_report(scheduler)
        assert back.next(protocol.TYPE_SCHEDULER)["messages_dropped_total"] == 5
    finally:
        back.close()


def test_a_full_agent_queue_never_blocks_vllm(fake_vllm, agent, quiet_reporter):
    plugin.register()
    scheduler = vllm_fakes.new_scheduler(num_blocks=11)
    started = time.monotonic()
    for _ in range(2000):  # nobody reads: the socket's queue fills, sends fail at once
        plugin.send_scheduler_report(scheduler)
    assert time.monotonic() - started < 10
    assert plugin.stats()["dropped"] > 0


# ---- packaging ----


def test_importing_the_plugin_loads_nothing_heavy():
    code = ("import json, sys; import kvtrace.sources.vllm.plugin; "
            "print(json.dumps(sorted(sys.modules)))")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "agent"))
    modules = set(json.loads(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                            check=True).stdout))
    heavy = {"grpc", "bcc", "prometheus_client", "psutil", "google.protobuf", "rich", "pynvml", "elftools"}
    assert not modules & heavy
    assert {module for module in modules if module.startswith("kvtrace")} == {
        "kvtrace", "kvtrace.sources", "kvtrace.sources.vllm", "kvtrace.sources.vllm.protocol",
        "kvtrace.sources.vllm.plugin", "kvtrace.sources.post_import"}


def test_the_entry_point_is_declared():
    try:
        import tomllib
    except ModuleNotFoundError:  # 3.10 (tests/unit/test_builds_in_process.py): its backport
        import tomli as tomllib  # type: ignore[no-redef]

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["vllm.general_plugins"] == {"kvtrace": "kvtrace.sources.vllm.plugin:register"}


def test_no_kv_cache_message_for_a_model_without_kv_cache(fake_vllm, agent):
    plugin.register()
    from vllm import _fake_torch
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.worker.gpu.attn_utils import _allocate_kv_cache

    assert _allocate_kv_cache(KVCacheConfig(num_blocks=1, kv_cache_tensors=[], kv_cache_groups=[]), {},
                              _fake_torch.Device()) == {}
    assert agent.drain() == [] and plugin.stats()["off"] == []


def test_the_agents_listener_takes_every_message_the_plugin_sends(fake_vllm, agent, quiet_reporter):
    """The wire shapes of both ends, held together: each message decodes into the record it reports."""
    from kvtrace.model.vllm import KvCacheLayout, RequestState, SchedulerReport, SleepReport
    from kvtrace.sources.vllm.listener import decode_message

    plugin.register()
    _plant_abort_leak()
    from vllm import _fake_torch
    from vllm.v1.request import RequestStatus
    from vllm.v1.worker.gpu.attn_utils import init_kv_cache
    from vllm.v1.worker.gpu_worker import Worker

    init_kv_cache([], {}, vllm_fakes.kv_cache_config(num_blocks=101, layers=3, shared=1), [], _fake_torch.Device(),
                  "auto", [], None)
    records = [decode_message(json.dumps(agent.next(protocol.TYPE_KV_CACHE)).encode(), os.getpid(), 1)]
    scheduler = vllm_fakes.new_scheduler(num_blocks=101)
    records.append(decode_message(json.dumps(agent.next(protocol.TYPE_SCHEDULER)).encode(), os.getpid(), 1))
    agent.drain()  # the reporter started for the layout may have sent the first report too: the same figures
    _request(scheduler, "leak-1", 2)
    _request(scheduler, "running", 3)
    scheduler.finish_requests("leak-1", RequestStatus.FINISHED_ABORTED)
    plugin.send_scheduler_report(scheduler)
    _allocator_with_pools()
    Worker().sleep(1)
    Worker().wake_up()

    while (message := agent.receive(0.2)) is not None:
        records.append(decode_message(json.dumps(message).encode(), os.getpid(), 1))
    kinds = [type(record) for record in records]
    assert kinds == [KvCacheLayout, SchedulerReport, SchedulerReport, SleepReport, SchedulerReport, SleepReport,
                     SchedulerReport]
    layout = records[0]
    assert (len(layout.tensors), layout.num_blocks, layout.block_size_tokens) == (2, 101, 16)
    report = records[2]
    assert [(r.request_id, r.state, r.blocks) for r in report.requests] == [
        ("leak-1", RequestState.ABORTED, 2), ("running", RequestState.RUNNING, 3)]
    assert report.usage_ratio == pytest.approx(5 / 100)
    assert [record.level for record in records if type(record) is SleepReport] == [1, 0]


def _wait_for(predicate, timeout_seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline and not predicate():
        time.sleep(0.01)
    return predicate()


def test_the_pytorch_hook_is_left_alone_unless_asked(fake_vllm, agent, quiet_reporter, monkeypatch):
    monkeypatch.delenv(plugin.TORCH_HOOK_ENV, raising=False)
    plugin.register()
    assert plugin._STATE.torch_hook_started is False and plugin._STATE.torch_hook is None


def test_the_pytorch_hook_is_armed_off_vllms_thread(fake_vllm, agent, quiet_reporter, monkeypatch):
    """KVTRACE_TORCH_HOOK=1: the hook is built and armed on a thread of its own, once per process."""
    import types

    from kvtrace.sources import torch_hook

    armed = []
    monkeypatch.setenv(plugin.TORCH_HOOK_ENV, "1")
    monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))
    monkeypatch.setattr(torch_hook, "arm_in_this_process",
                        lambda: armed.append(threading.current_thread().name) or types.SimpleNamespace(path="x.so"))
    plugin.register()
    plugin.register()
    assert _wait_for(lambda: plugin._STATE.torch_hook is not None)
    assert armed == ["kvtrace-torch-hook"]


def test_a_pytorch_hook_that_cannot_be_built_is_switched_off_with_one_warning(fake_vllm, agent, quiet_reporter,
                                                                              monkeypatch, caplog):
    """A host without g++ (or torch without its headers): one warning naming the fix, vLLM goes on."""
    import types

    from kvtrace.sources import torch_hook

    def no_compiler():
        raise torch_hook.HookBuildError("no C++ compiler 'g++' to build kvtrace's PyTorch hook: install g++")

    monkeypatch.setenv(plugin.TORCH_HOOK_ENV, "1")
    monkeypatch.setitem(sys.modules, "torch", types.ModuleType("torch"))
    monkeypatch.setattr(torch_hook, "arm_in_this_process", no_compiler)
    def warnings():
        return [record.getMessage() for record in caplog.records if record.name == "kvtrace.vllm"]

    with caplog.at_level(logging.WARNING, logger="kvtrace.vllm"):
        plugin.register()
        # the part goes off first, then its warning is logged: on the hook's thread, so wait for both
        assert _wait_for(lambda: plugin.PART_TORCH_HOOK in plugin.stats()["off"] and warnings())
        time.sleep(0.05)  # a second warning would come now
    said = warnings()
    assert len(said) == 1 and "PyTorch hook" in said[0] and "install g++" in said[0]
    assert plugin._STATE.torch_hook is None
