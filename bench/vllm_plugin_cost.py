"""What the kvtrace vLLM plugin costs inside vLLM, measured on the fakes of vLLM 0.24.0's classes
(tests/unit/vllm_fakes.py: the real bodies of BlockPool.get_new_blocks / free_blocks, the scheduler's
finish path, the managers' req_to_blocks), so it runs anywhere, no GPU, no root:

- one scheduler report (what the reporter thread does once a second) with 0, 100, 1 000 and 10 000
  requests holding blocks: build (copy vLLM's dicts, sort, JSON) and send, its datagram size, and the
  share of one core at one report a second;
- the block pool's hot calls and one request's life (allocate, run, finish, free) with the plugin's
  wrappers against the same fake classes unwrapped, side by side in each round (the order rotates).

The fakes' bodies are Python like vLLM's, so the ratios are what the wrappers add to vLLM's own
Python; the GPU's work in a real engine step is not here. Figures are printed, never asserted.

    .venv/bin/python bench/vllm_plugin_cost.py [--rounds 7] [--calls 100000]
"""
from __future__ import annotations

import argparse
import importlib
import os
import platform
import socket
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "tests" / "unit"), str(HERE.parent / "agent"), str(HERE)]

import vllm_fakes  # noqa: E402
from benchlib import code_version, median, progress, rotated  # noqa: E402
from kvtrace.sources.vllm import plugin, protocol  # noqa: E402

HOLDERS = (0, 100, 1_000, 10_000)
BLOCKS_PER_HOLDER = 4
LEAKED_SHARE = 10  # one holder in LEAKED_SHARE is an aborted request that kept its blocks


class Copy:
    """One import of the fake vLLM: its classes, wrapped by the plugin or not."""

    def __init__(self, wrapped: bool) -> None:
        vllm_fakes.forget()
        importlib.invalidate_caches()
        self.wrapped = wrapped
        self.scheduler_module = importlib.import_module("vllm.v1.core.sched.scheduler")
        self.request_module = importlib.import_module("vllm.v1.request")
        self.scheduler = vllm_fakes.new_scheduler(num_blocks=1001)
        assert (getattr(self.scheduler_module.Scheduler.__dict__["__init__"], plugin._MARK, None) is not None) \
            == wrapped

    @property
    def pool(self):
        return self.scheduler.kv_cache_manager.block_pool


def time_calls(copy: Copy, calls: int) -> dict[str, float]:
    """ns per call of each hot path, on the scheduler's own pool (the one the plugin counts)."""
    pool, clock = copy.pool, time.perf_counter_ns
    results = {}
    started = clock()
    for _ in range(calls):
        pool.free_blocks(pool.get_new_blocks(1))
    results["get_new_blocks(1) + free_blocks(list)"] = (clock() - started) / calls
    started = clock()
    for _ in range(calls // 4):
        pool.free_blocks(reversed(pool.get_new_blocks(16)))
    results["get_new_blocks(16) + free_blocks(reversed)"] = (clock() - started) / (calls // 4)
    scheduler, request_class = copy.scheduler, copy.request_module.Request
    lifecycle = calls // 10
    started = clock()
    for number in range(lifecycle):
        request_id = f"r{number}"
        scheduler.add_request(request_class(request_id))
        scheduler.allocate(request_id, BLOCKS_PER_HOLDER)
        scheduler.step_finish(request_id)
    results[f"request life ({BLOCKS_PER_HOLDER} blocks: add, allocate, finish, free)"] = \
        (clock() - started) / lifecycle
    return results


def report_costs(holders: int, repeats: int, receiver: socket.socket) -> dict[str, float]:
    """Build and send of one report with `holders` requests holding blocks (LEAKED_SHARE of them aborted
    and leaked), medians over `repeats`."""
    from vllm.v1.request import Request, RequestStatus

    scheduler = vllm_fakes.new_scheduler(num_blocks=holders * BLOCKS_PER_HOLDER + 2)
    leaked = set()
    for number in range(holders):
        request_id = f"cmpl-{number:08d}-0-1a2b3c4d"  # the shape of vLLM's request ids
        scheduler.add_request(Request(request_id))
        scheduler.allocate(request_id, BLOCKS_PER_HOLDER)
        if number % LEAKED_SHARE == 0:
            leaked.add(request_id)
    original = scheduler._free_request_blocks
    scheduler._free_request_blocks = lambda request: None if request.request_id in leaked else original(request)
    scheduler.finish_requests(leaked, RequestStatus.FINISHED_ABORTED)
    builds, sends, size = [], [], 0
    for _ in range(repeats):
        started = time.perf_counter_ns()
        data = plugin.build_scheduler_report(scheduler)
        built = time.perf_counter_ns()
        plugin._send_bytes(data)
        sent = time.perf_counter_ns()
        receiver.recv(1 << 20)
        builds.append(built - started)
        sends.append(sent - built)
        size = len(data)
    return {"build_us": median(builds) / 1e3, "send_us": median(sends) / 1e3, "bytes": size}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=100_000, help="pool calls per mode per round")
    parser.add_argument("--report-repeats", type=int, default=21)
    args = parser.parse_args()

    directory = Path(tempfile.mkdtemp(prefix="kvtrace-bench-"))
    vllm_fakes.install(directory / "site")
    sys.path.insert(0, str(directory / "site"))
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(str(directory / "vllm.sock"))
    receiver.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    interval_seconds = protocol.REPORT_INTERVAL_SECONDS
    protocol.REPORT_INTERVAL_SECONDS = 3600.0  # the reporter thread sends its first report only

    plain = Copy(wrapped=False)
    os.environ[protocol.ENABLE_ENV] = "1"
    os.environ[protocol.SOCKET_ENV] = str(directory / "vllm.sock")
    plugin.register()
    wrapped = Copy(wrapped=True)
    modes = {"unwrapped": plain, "kvtrace": wrapped}

    per_call: dict[tuple[str, str], list[float]] = {}
    for round_index in range(args.rounds):
        for name in rotated(modes, round_index):
            for path, ns in time_calls(modes[name], args.calls).items():
                per_call.setdefault((name, path), []).append(ns)
            while True:  # the reporter's first report; nothing else is sent here
                try:
                    receiver.recv(1 << 20, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    break
        progress(f"round {round_index + 1}/{args.rounds} done")

    reports = {}
    for holders in HOLDERS:
        reports[holders] = report_costs(holders, args.report_repeats, receiver)
        progress(f"report with {holders} holders: {reports[holders]['build_us']:.0f} us")
    counted = plugin.stats()

    print(f"kvtrace vLLM plugin cost, on the fakes of vLLM 0.24.0's classes (Python {platform.python_version()}, "
          f"{platform.machine()})")
    print(f"  measured: {code_version()}")
    print(f"  one scheduler report every {interval_seconds:g} s ({BLOCKS_PER_HOLDER} blocks per holder, "
          f"1 in {LEAKED_SHARE} aborted and leaked), medians of {args.report_repeats}:")
    print(f"  {'holders':>8} {'build us':>9} {'send us':>8} {'bytes':>7} {'core share':>11}")
    for holders, figures in reports.items():
        share = (figures["build_us"] + figures["send_us"]) / 1e6 / interval_seconds
        print(f"  {holders:>8} {figures['build_us']:>9.0f} {figures['send_us']:>8.1f} {figures['bytes']:>7.0f} "
              f"{share:>11.4%}")
    print(f"  hot paths, ns per call, medians over {args.rounds} rounds of {args.calls} calls "
          "(unwrapped and kvtrace side by side each round):")
    print(f"  {'path':<58} {'unwrapped':>9} {'kvtrace':>8} {'added':>6} {'ratio':>6}")
    for path in dict.fromkeys(path for _, path in per_call):
        base, traced = median(per_call[("unwrapped", path)]), median(per_call[("kvtrace", path)])
        print(f"  {path:<58} {base:>9.0f} {traced:>8.0f} {traced - base:>6.0f} {traced / base:>6.2f}")
    print(f"  plugin in this run: {counted['sent']} messages sent, {counted['dropped']} dropped, parts off: "
          f"{counted['off'] or 'none'}")
    plugin._reset()
    receiver.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
