"""Added cost of kvtrace per cudaMalloc+cudaFree pair, against empty probes at the same points.

Modes (each on its own copy of the stub libraries, so nothing is attached or detached per round):
  untraced  workload on copy A, no probes on it;
  empty     copy B: a tiny bcc program, empty entry and return functions on cudaMalloc, cudaFree
            (libcudart stub) and cuMemAlloc_v2, cuMemFree_v2 (libcuda stub) - the points kvtrace
            uses for this workload;
  kvtrace   copy C: the real Tracer following the workload's pid, python_stacks on (the workload
            is C, so the walk stops at the py_targets lookup), ring buffer drained by the tracer
            loop on a background thread.
A round runs `workload loop N` once per mode (order rotated each round); the workload times its
own loop. Added cost = mode - untraced of the same round; medians over rounds.

Run as root: .venv/bin/python bench/probe_overhead.py [--rounds 7] [--pairs 200000] [--bpf-stats]
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import (  # noqa: E402
    Guard,
    Pump,
    Workload,
    body_ns_per_pair,
    bpf_stats,
    build_copies,
    code_version,
    counters_delta,
    counters_of,
    empty_probes,
    median,
    progress,
    require_bpf,
    rotated,
    scoped_tracer,
)

GOAL_RATIO = 1.25
MODES = ("untraced", "empty", "kvtrace")
ATTACH_POINTS = (("libcudart", "cudaMalloc"), ("libcudart", "cudaFree"),
                 ("libcuda", "cuMemAlloc_v2"), ("libcuda", "cuMemFree_v2"))


def load_empty_probes(build):
    return empty_probes((build.libcudart if library == "libcudart" else build.libcuda, symbol, -1)
                        for library, symbol in ATTACH_POINTS)


def run_loop(build, pairs: int, on_ready=None, on_done=None) -> float:
    """Runs `workload loop pairs`; returns its ns per pair."""
    with Workload([build.workload, "loop", str(pairs)]) as workload:
        workload.wait_ready()
        if on_ready:
            on_ready(workload.pid)
        workload.go()
        lines = workload.read_calls(timeout_s=600)
        if on_done:
            on_done(workload.pid)
        status = workload.finish()
        if status != 0 or len(lines) != 1 or lines[0].get("loop_pairs") != pairs:
            raise RuntimeError(f"workload loop failed: status {status}, output {lines}")
        return float(lines[0]["ns_per_pair"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--pairs", type=int, default=200_000, help="cudaMalloc+cudaFree pairs per run")
    parser.add_argument("--bpf-stats", action="store_true",
                        help="then one more run per probed mode with kernel.bpf_stats_enabled=1: "
                             "time spent inside the BPF programs, by program")
    args = parser.parse_args()
    require_bpf()
    version = code_version()  # what is imported and compiled now

    work = Path(tempfile.mkdtemp(prefix="kvtrace-bench-"))
    progress(f"building three copies of the stubs under {work}")
    builds = build_copies(work, list(MODES))
    guard = Guard(builds)
    empty_bpf = load_empty_probes(builds["empty"])
    tracer = scoped_tracer(builds["kvtrace"], python_stacks=True)

    results: dict[str, list[float]] = {mode: [] for mode in MODES}
    checked = {"runs": 0}
    failures: list[str] = []
    bodies = {}
    base_counters = counters_of(tracer)
    try:
        with Pump([tracer]) as pump:
            def follow(pid):
                with pump.lock:
                    tracer.follow(pid)
                    checked["before"] = counters_of(tracer)

            def check_ledger(pid):
                # The loop has ended and the process is still alive: its ledger must be empty, and
                # every call must have been counted (submitted or lost), 4 per pair.
                with pump.lock:
                    after = counters_of(tracer)
                    left = [e for e in tracer.kernel_ledger() if e.key.pid == pid]
                delta = counters_delta(after, checked["before"])
                counted = delta["events_submitted"] + delta["events_lost"]
                if left:
                    failures.append(f"pid {pid}: {len(left)} entries left in the kernel ledger")
                if counted != 4 * args.pairs:
                    failures.append(f"pid {pid}: {counted} events submitted+lost, expected {4 * args.pairs}")
                checked["runs"] += 1

            hooks = {"untraced": {}, "empty": {}, "kvtrace": {"on_ready": follow, "on_done": check_ledger}}
            for round_index in range(args.rounds):
                for mode in rotated(MODES, round_index):
                    results[mode].append(guard.measure(
                        round_index, mode, lambda mode=mode: run_loop(builds[mode], args.pairs, **hooks[mode])))
                progress(f"round {round_index + 1}/{args.rounds}: " + ", ".join(
                    f"{mode} {results[mode][-1]:.0f}" + ("" if guard.ok(round_index, mode) else " (dropped)")
                    for mode in MODES) + " ns/pair")
            pump.drain(tracer)
            with pump.lock:
                counters = counters_delta(counters_of(tracer), base_counters)
            if args.bpf_stats:
                with bpf_stats():
                    bodies["empty"] = body_ns_per_pair(
                        empty_bpf, lambda: run_loop(builds["empty"], args.pairs), args.pairs)
                    bodies["kvtrace"] = body_ns_per_pair(
                        tracer.probes._bpf, lambda: run_loop(builds["kvtrace"], args.pairs, follow,
                                                             check_ledger), args.pairs)
    finally:
        tracer.stop()
        empty_bpf.cleanup()
        shutil.rmtree(work, ignore_errors=True)

    # Added cost: a mode's run minus the untraced run of the same round, where both were clean.
    untraced = [u for r, u in enumerate(results["untraced"]) if guard.ok(r, "untraced")]
    added = {mode: [v - u for r, (v, u) in enumerate(zip(results[mode], results["untraced"], strict=True))
                    if guard.ok(r, mode, "untraced")] for mode in ("empty", "kvtrace")}
    print(f"probe overhead: {args.rounds} rounds x {args.pairs} pairs (cudaMalloc+cudaFree, "
          f"4 traced calls each), medians over clean runs")
    print(f"  measured: {version}")
    if not untraced or not all(added.values()):
        print(f"  no figures: {guard.summary(args.rounds * len(MODES))}")
        return 3
    ratio = median(added["kvtrace"]) / median(added["empty"])
    print(f"  {'untraced':<34} {median(untraced):>9.0f} ns/pair")
    print(f"  {'empty probes, added':<34} {median(added['empty']):>9.0f} ns/pair  "
          f"(8 probes: 4 entry + 4 return; {len(added['empty'])} rounds)")
    print(f"  {'kvtrace, added':<34} {median(added['kvtrace']):>9.0f} ns/pair  ({len(added['kvtrace'])} rounds)")
    print(f"  {'kvtrace added / empty added':<34} {ratio:>9.2f}   goal <= {GOAL_RATIO} "
          f"({'met' if ratio <= GOAL_RATIO else 'MISSED'})")
    print(f"  {'kvtrace events submitted':<34} {counters['events_submitted']:>9}")
    print(f"  {'kvtrace events lost (ring full)':<34} {counters['events_lost']:>9}")
    print(f"  {'kvtrace events delivered':<34} {counters['events_seen']:>9}")
    print(f"  {'kvtrace resyncs':<34} {counters['resyncs']:>9}")
    print(f"  {'kernel ledger exact':<34} {'yes' if not failures else 'NO'} "
          f"({checked['runs']} traced runs checked: 0 entries left, submitted + lost = 4 x pairs)")
    for mode, (total, per_run) in bodies.items():
        print(f"  {mode + ' BPF program time':<34} {total:>9.0f} ns/pair  (bpf_stats, one run; ns per run: "
              + ", ".join(f"{name} {ns:.0f}" for name, ns in sorted(per_run.items())) + ")")
    print(f"  {'runs':<34} {guard.summary(args.rounds * len(MODES))}")
    print(f"  {'tracer loop exceptions':<34} {len(pump.errors)}"
          + (f" (first: {pump.errors[0]})" if pump.errors else ""))
    for failure in failures:
        print(f"  FAILED: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
