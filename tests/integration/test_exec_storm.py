"""An exec storm: 500 short-lived CUDA processes, 8 at a time, under a whole-host tracer.

GIVEN the tracer following every process (no filter), the stub libraries attached at start
WHEN 500 processes each make 3 cudaMalloc + cudaFree pairs and exit
THEN every call is traced (1500 of 1500 cudaMalloc), every exit is seen (their ledgers are empty),
and the tracer's open files and resident memory are flat (what 500 processes leave behind).
"""
import os
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from harness import TracingHarness, require_tracing_here
from kvtrace.model.events import Api, Kind

PROCESSES = 500
PAIRS = 3


@pytest.fixture
def storm_tracer(stub_build):
    require_tracing_here()
    harness = TracingHarness(preattach_globs=(str(stub_build.lib_dir / "*.so.*"),))
    yield harness
    harness.close()


def test_500_processes_are_traced_fully_with_flat_fds_and_memory(storm_tracer, stub_build):
    harness = storm_tracer
    me = psutil.Process()
    harness.pump(1.0)  # the start-up settles
    fds_before, rss_before = me.num_fds(), me.memory_info().rss
    pids: list[int] = []

    def one(_index: int) -> None:
        process = subprocess.Popen([str(stub_build.workload), "loop", str(PAIRS)], stdin=subprocess.PIPE,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        pids.append(process.pid)
        process.communicate(b"go\n", timeout=60)
        assert process.returncode == 0

    done = threading.Event()

    def storm() -> None:
        try:
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(one, range(PROCESSES)))
        finally:
            done.set()

    thread = threading.Thread(target=storm)
    thread.start()
    while not done.is_set():
        harness.source.run_once(20)
    thread.join()
    ours = set(pids)
    mallocs = lambda: [e for e in harness.of(kind=Kind.ALLOC, api=Api.cudaMalloc) if e.pid in ours]  # noqa: E731
    harness.pump_until(lambda: len(mallocs()) >= PROCESSES * PAIRS, 30)
    harness.pump(2.0)  # exits, the sweep
    traced = mallocs()
    per_process = {pid: 0 for pid in ours}
    for event in traced:
        per_process[event.pid] += 1
    held = {entry.key.pid for entry in harness.session.outstanding() if entry.key.pid in ours}
    fds_after, rss_after = me.num_fds(), me.memory_info().rss
    print(f"\n{PROCESSES} processes: {len(traced)} of {PROCESSES * PAIRS} cudaMalloc traced; "
          f"{sum(count != PAIRS for count in per_process.values())} processes short; "
          f"{len(held)} still holding; fds {fds_before} -> {fds_after}; "
          f"RSS {rss_before >> 20} -> {rss_after >> 20} MiB")
    assert len(ours) == PROCESSES
    assert all(count == PAIRS for count in per_process.values())
    assert not held
    assert fds_after - fds_before <= 8
    assert rss_after - rss_before <= 48 << 20
    assert not (set(harness.source.python) | set(harness.source.late_device)) & ours  # forgotten on exit
    assert os.path.exists(stub_build.workload)
