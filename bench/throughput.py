"""Traced calls per second the pipeline sustains, with an exact ledger, on the stub libraries.

Two `workload loop N` processes run at once under kvtrace (the Tracer follows both pids; the tracer
loop consumes on this process's main thread). N is sized from a short calibration run so that the
loops last about --seconds. Each pair is 4 traced calls: cudaMalloc, the cuMemAlloc_v2 it makes,
cudaFree, the cuMemFree_v2 it makes. Reported: traced calls/s, events submitted to the ring buffer,
delivered to Python and lost (kernel counter), and exactness: after the loops (both processes still
alive) the kernel ledger holds nothing for either pid, every call was counted (submitted + lost =
4 per pair), and after tracer.resync() the Python ledger equals the kernel's for both pids.

Run as root: .venv/bin/python bench/throughput.py [--seconds 5] [--rounds 3]
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import (  # noqa: E402
    Guard,
    Workload,
    build_copies,
    code_version,
    counters_delta,
    counters_of,
    median,
    progress,
    require_bpf,
    scoped_tracer,
)

GOAL_CALLS_PER_SECOND = 500_000
CALLS_PER_PAIR = 4
PROCESSES = 2


def ledger_view(entries, pids) -> set:
    return {(e.key.pid, e.key.layer, e.key.object, e.key.address, e.size_bytes)
            for e in entries if e.key.pid in pids}


loop_errors: list[str] = []  # exceptions tracer.run_once raised


def traced_run(tracer, build, pairs: int) -> dict:
    """Runs PROCESSES loops of `pairs` at once, pumping the tracer on this thread; returns figures."""
    workloads = [Workload([build.workload, "loop", str(pairs)]) for _ in range(PROCESSES)]
    try:
        pids = {workload.wait_ready() for workload in workloads}
        for pid in pids:
            tracer.follow(pid)
        before = counters_of(tracer)
        outputs: list = [None] * PROCESSES

        def read(index):
            outputs[index] = workloads[index].read_calls(timeout_s=600)

        readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(PROCESSES)]
        cpu_start, wall_start = time.process_time(), time.monotonic()
        for workload, reader in zip(workloads, readers, strict=True):
            workload.go()
            reader.start()
        longest_loop = 0.0
        while any(reader.is_alive() for reader in readers):
            started = time.monotonic()
            try:
                tracer.run_once(20)
            except Exception as error:  # a tracer bug: count it, keep measuring
                loop_errors.append(f"{type(error).__name__}: {error}")
            longest_loop = max(longest_loop, time.monotonic() - started)
        wall_seconds = time.monotonic() - wall_start
        consumer_cpu = (time.process_time() - cpu_start) / wall_seconds
        during = counters_delta(counters_of(tracer), before)
        # Drain what is still in the ring, then check the ledgers while both processes are alive.
        idle_since = time.monotonic()
        while time.monotonic() - idle_since < 0.5:
            seen = tracer.session.events_total
            try:
                tracer.run_once(50)
            except Exception as error:
                loop_errors.append(f"{type(error).__name__}: {error}")
            if tracer.session.events_total != seen:
                idle_since = time.monotonic()
        after = counters_delta(counters_of(tracer), before)
        kernel = ledger_view(tracer.kernel_ledger(), pids)
        python_before_resync = ledger_view(tracer.session.ledger, pids)
        tracer.resync()
        python = ledger_view(tracer.session.ledger, pids)
        for workload in workloads:
            if workload.finish() != 0:
                raise RuntimeError(f"workload {workload.pid} failed: {workload.stderr_text()}")
    finally:
        for workload in workloads:
            workload.__exit__(None, None, None)
    for output in outputs:
        if not output or output[0].get("loop_pairs") != pairs:
            raise RuntimeError(f"a workload printed {output}")
    loop_seconds = [pairs * output[0]["ns_per_pair"] / 1e9 for output in outputs]
    calls = PROCESSES * pairs * CALLS_PER_PAIR
    return {
        "pairs": pairs, "calls": calls, "loop_seconds": max(loop_seconds), "wall_seconds": wall_seconds,
        "calls_per_second": calls / max(loop_seconds), "consumer_cpu": consumer_cpu,
        "longest_loop_seconds": longest_loop,
        "submitted": after["events_submitted"], "lost": after["events_lost"],
        "delivered": after["events_seen"], "delivered_during": during["events_seen"],
        "resyncs": after["resyncs"], "returns_unpaired": after["returns_unpaired"],
        "ledger_full": after["ledger_full"], "kernel_entries": len(kernel),
        "python_entries_before_resync": len(python_before_resync), "python_equals_kernel": python == kernel,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="target length of each run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=0, help="pairs per process (default: calibrated)")
    args = parser.parse_args()
    require_bpf()
    version = code_version()  # what is imported and compiled now

    work = Path(tempfile.mkdtemp(prefix="kvtrace-bench-"))
    progress(f"building the stubs under {work}")
    builds = build_copies(work, ["kvtrace"])
    guard = Guard(builds)
    tracer = scoped_tracer(builds["kvtrace"], python_stacks=True)
    runs = []
    try:
        pairs = args.pairs
        if not pairs:
            calibration = traced_run(tracer, builds["kvtrace"], 50_000)
            pairs = int(args.seconds * calibration["pairs"] / calibration["loop_seconds"])
            progress(f"calibration: {calibration['calls_per_second']:,.0f} calls/s -> {pairs} pairs "
                     f"per process for ~{args.seconds} s")
        for round_index in range(args.rounds):
            run = guard.measure(round_index, "kvtrace", lambda: traced_run(tracer, builds["kvtrace"], pairs))
            runs.append(run)
            progress(f"round {round_index + 1}/{args.rounds}: {run['calls_per_second']:,.0f} traced calls/s, "
                     f"{run['delivered']} delivered, {run['lost']} lost, kernel ledger "
                     f"{run['kernel_entries']} entries" + ("" if guard.ok(round_index, "kvtrace")
                                                           else " (dropped: foreign uprobes)"))
    finally:
        tracer.stop()
        shutil.rmtree(work, ignore_errors=True)

    failures = []
    for index, run in enumerate(runs):
        if run["kernel_entries"] != 0:
            failures.append(f"round {index + 1}: {run['kernel_entries']} kernel ledger entries left")
        if not run["python_equals_kernel"]:
            failures.append(f"round {index + 1}: Python ledger differs from the kernel's after resync")
        if run["submitted"] + run["lost"] != run["calls"]:
            failures.append(f"round {index + 1}: {run['submitted']} submitted + {run['lost']} lost "
                            f"!= {run['calls']} calls")
    clean = [run for index, run in enumerate(runs) if guard.ok(index, "kvtrace")]
    print(f"throughput: {PROCESSES} processes x `workload loop {pairs}` at once, {args.rounds} rounds, "
          f"median over clean rounds")
    print(f"  measured: {version}")
    if clean:
        rate = median([run["calls_per_second"] for run in clean])
        delivered_rate = median([run["delivered_during"] / run["wall_seconds"] for run in clean])
        verdict = "met" if rate >= GOAL_CALLS_PER_SECOND else "MISSED"
        print(f"  {'traced calls/s (4 per pair)':<40} {rate:>12,.0f}   goal >= {GOAL_CALLS_PER_SECOND:,} ({verdict})")
        print(f"  {'events delivered to Python /s':<40} {delivered_rate:>12,.0f}")
        print(f"  {'consumer CPU (share of one core)':<40} {median([r['consumer_cpu'] for r in clean]):>12.2f}")
        print(f"  {'longest tracer.run_once() (s)':<40} {max(r['longest_loop_seconds'] for r in clean):>12.2f}"
              "   (housekeeping waits this long)")
    for index, run in enumerate(runs):
        print(f"  round {index + 1}: {run['calls']} calls in {run['loop_seconds']:.2f} s; submitted "
              f"{run['submitted']}, delivered {run['delivered']}, lost {run['lost']} "
              f"({run['lost'] / run['calls']:.1%}); resyncs {run['resyncs']}; returns unpaired "
              f"{run['returns_unpaired']}; ledger full {run['ledger_full']}")
        print(f"           kernel ledger entries for both pids {run['kernel_entries']}; Python ledger "
              f"{run['python_entries_before_resync']} before resync, equals kernel after resync: "
              f"{run['python_equals_kernel']}")
    print(f"  {'rounds':<40} {guard.summary(args.rounds)}")
    print(f"  {'tracer loop exceptions':<40} {len(loop_errors)}"
          + (f" (first: {loop_errors[0]})" if loop_errors else ""))
    print(f"  {'ledger exact':<40} {'yes' if not failures else 'NO'}")
    for failure in failures:
        print(f"  FAILED: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
