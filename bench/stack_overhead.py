"""Cost of walking Python stacks in the allocation probes, at 5, 20 and 60 Python frames.

A CPython 3.12 target (bench/stack_target.py; pyenv, else any of 3.10-3.13 found) calls the stub
cudaMalloc+cudaFree through ctypes.CDLL from a given stack depth and times the pairs itself.
Three long-lived targets, each on its own copy of the stub libraries:
  untraced  no probes;
  nostacks  a Tracer with python_stacks=False;
  stacks    a Tracer with python_stacks=True (the same probes, plus the frame walk).
Rounds interleave the modes (order rotated); the added cost of stacks is stacks - nostacks of the
same round and depth, medians over rounds. One user allocation is a cudaMalloc whose stub calls
cuMemAlloc_v2: both are allocation probes, so each allocation walks the stack twice.
Then the symbolization cache figures of the stacks tracer on this steady workload.

Run as root: .venv/bin/python bench/stack_overhead.py [--rounds 7] [--pairs 50000] [--bpf-stats]
"""
from __future__ import annotations

import argparse
import glob
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
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
    median,
    progress,
    require_bpf,
    rotated,
    scoped_tracer,
)

TARGET = HERE / "stack_target.py"
DEPTHS = (5, 20, 60)
MODES = ("untraced", "nostacks", "stacks")
GOAL_NS_AT_20 = 3000


def find_python() -> Path:
    preferred = Path("/root/.pyenv/versions/3.12.1/bin/python3")
    if preferred.exists():
        return preferred
    for minor in ("3.12", "3.11", "3.13", "3.10"):
        found = sorted(glob.glob(f"/root/.pyenv/versions/{minor}.[0-9]*/bin/python3"))
        found = [path for path in found if not path.split("/")[-3].endswith("t")]  # free-threaded
        if found:
            return Path(found[-1])
    sys.exit("no CPython 3.10-3.13 under /root/.pyenv/versions: install one with pyenv")


class Target:
    """A long-lived stack_target.py process."""

    def __init__(self, python: Path, libcudart: Path) -> None:
        self.workload = Workload([python, TARGET, libcudart])
        self.pid = self.workload.wait_ready()

    def run(self, frames: int, pairs: int) -> dict:
        self.workload.process.stdin.write(f"run {frames} {pairs}\n")
        self.workload.process.stdin.flush()
        (result,) = self.workload.read_calls(timeout_s=600)
        if result["frames"] != frames:
            raise RuntimeError(f"target ran at {result['frames']} frames, not {frames}")
        return result

    def close(self) -> None:
        self.workload.__exit__(None, None, None)


class StackStats:
    """Sink: stack status of every allocation event, and the stack ids seen."""

    def __init__(self) -> None:
        self.status: Counter[str] = Counter()  # by StackStatus name
        self.stack_ids: Counter[int] = Counter()

    def __call__(self, event) -> None:
        if event.kind.name == "ALLOC":
            self.status[event.stack_status.name.lower()] += 1
            if event.stack_id:
                self.stack_ids[event.stack_id] += 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--pairs", type=int, default=50_000, help="pairs per (mode, depth) run")
    parser.add_argument("--bpf-stats", action="store_true",
                        help="then one more run per (traced mode, depth) with kernel.bpf_stats_enabled=1: "
                             "time inside the two allocation entry programs, where the walk runs")
    args = parser.parse_args()
    require_bpf()
    version = code_version()  # what is imported and compiled now
    python = find_python()

    work = Path(tempfile.mkdtemp(prefix="kvtrace-bench-"))
    progress(f"target Python {python}; building three copies of the stubs under {work}")
    builds = build_copies(work, list(MODES))
    guard = Guard(builds)
    stats = {"nostacks": StackStats(), "stacks": StackStats()}
    tracers = {mode: scoped_tracer(builds[mode], python_stacks=(mode == "stacks"), sinks=[stats[mode]])
               for mode in ("nostacks", "stacks")}
    targets: dict[str, Target] = {}
    results: dict[tuple[str, int], list[float]] = {(m, d): [] for m in MODES for d in DEPTHS}
    try:
        with Pump(list(tracers.values())) as pump:
            for mode in MODES:
                targets[mode] = Target(python, builds[mode].libcudart)
                if mode in tracers:
                    with pump.lock:
                        tracers[mode].follow(targets[mode].pid)
            with pump.lock:
                target_info = tracers["stacks"].python.get(targets["stacks"].pid)
                before = {mode: counters_of(tracer) for mode, tracer in tracers.items()}
            progress(f"stacks tracer sees the target as: {target_info}")
            for round_index in range(args.rounds):
                order = rotated(MODES, round_index)
                for mode in order:
                    runs = guard.measure(round_index, mode, lambda mode=mode: [
                        targets[mode].run(frames, args.pairs) for frames in DEPTHS])
                    for frames, result in zip(DEPTHS, runs, strict=True):
                        results[(mode, frames)].append(result["ns_per_pair"])
                progress(f"round {round_index + 1}/{args.rounds}: " + "; ".join(
                    f"{mode} " + "/".join(f"{results[(mode, d)][-1]:.0f}" for d in DEPTHS)
                    + ("" if guard.ok(round_index, mode) else " (dropped)")
                    for mode in MODES) + f" ns/pair at {'/'.join(map(str, DEPTHS))} frames")
            alloc_entry_ns = {}  # (mode, frames) -> ns in entry_cudaMalloc + entry_cuMemAlloc_v2
            if args.bpf_stats:
                with bpf_stats():
                    for frames in DEPTHS:
                        for mode, tracer in tracers.items():
                            _, per_run = body_ns_per_pair(
                                tracer.probes._bpf,
                                lambda mode=mode, frames=frames: targets[mode].run(frames, args.pairs), args.pairs)
                            alloc_entry_ns[(mode, frames)] = (per_run["entry_cudaMalloc"]
                                                              + per_run["entry_cuMemAlloc_v2"])
            for tracer in tracers.values():
                pump.drain(tracer)
            with pump.lock:
                counters = {mode: counters_delta(counters_of(tracer), before[mode])
                            for mode, tracer in tracers.items()}
                stacks_tracer = tracers["stacks"]
                depth_of_stack = {stack_id: len(stacks_tracer.session.stacks.get(stack_id).frames)
                                  for stack_id in stats["stacks"].stack_ids}
                symbolizer = stacks_tracer.symbolizer
                kernel_stacks_resolved = len(stacks_tracer._stack_ids)
    finally:
        for target in targets.values():
            target.close()
        for tracer in tracers.values():
            tracer.stop()
        shutil.rmtree(work, ignore_errors=True)

    def clean(mode, frames):
        return [v for r, v in enumerate(results[(mode, frames)]) if guard.ok(r, mode)]

    def stacks_added(frames):
        pairs = zip(results[("stacks", frames)], results[("nostacks", frames)], strict=True)
        return [s - n for r, (s, n) in enumerate(pairs)
                if guard.ok(r, "stacks", "nostacks")]

    if not all(clean(mode, DEPTHS[0]) for mode in MODES) or not stacks_added(DEPTHS[0]):
        print(f"python stack overhead: no figures: {guard.summary(args.rounds * len(MODES))}")
        return 3
    print(f"python stack overhead: {python} target, ctypes.CDLL, {args.rounds} rounds x "
          f"{args.pairs} pairs per depth, medians over clean rounds (ns per cudaMalloc+cudaFree pair)")
    print(f"  measured: {version}")
    print(f"  {'frames':>6} {'untraced':>9} {'nostacks':>9} {'stacks':>9} {'stacks added':>13} "
          f"{'per walk':>9}")
    added_at = {}
    for frames in DEPTHS:
        added_at[frames] = median(stacks_added(frames))
        print(f"  {frames:>6} {median(clean('untraced', frames)):>9.0f} "
              f"{median(clean('nostacks', frames)):>9.0f} {median(clean('stacks', frames)):>9.0f} "
              f"{added_at[frames]:>13.0f} {added_at[frames] / 2:>9.0f}")
    verdict = "met" if added_at[20] <= GOAL_NS_AT_20 else "MISSED"
    print(f"  added per allocation at 20 frames: {added_at[20]:.0f} ns, goal <= {GOAL_NS_AT_20} ns ({verdict})"
          "; an allocation = cudaMalloc + the cuMemAlloc_v2 it makes = 2 walks")
    if alloc_entry_ns:
        print("  BPF time in the two allocation entry programs per allocation (bpf_stats, one run each):")
        for frames in DEPTHS:
            nostacks, stacks = alloc_entry_ns[("nostacks", frames)], alloc_entry_ns[("stacks", frames)]
            print(f"  {frames:>6} frames: nostacks {nostacks:.0f} ns, stacks {stacks:.0f} ns, "
                  f"walk {stacks - nostacks:.0f} ns per allocation ({(stacks - nostacks) / 2:.0f} per walk)")
    for mode in ("nostacks", "stacks"):
        c = counters[mode]
        print(f"  {mode}: events submitted {c['events_submitted']}, lost {c['events_lost']}, "
              f"delivered {c['events_seen']}, resyncs {c['resyncs']}; alloc events by stack status "
              f"{dict(stats[mode].status)}")
    depths = Counter(depth_of_stack.values())
    print(f"  stacks seen: {len(depth_of_stack)} distinct, frames per stack {dict(sorted(depths.items()))}")
    lookups = symbolizer.hits + symbolizer.misses
    delivered_with_stack = sum(stats["stacks"].stack_ids.values())
    print(f"  symbolizer (per frame, code-object cache): hits {symbolizer.hits}, misses {symbolizer.misses}, "
          f"hit rate {symbolizer.hit_rate:.3f} ({lookups} frame lookups)")
    print(f"  stack-id cache (per event): {delivered_with_stack} events with a stack, "
          f"{kernel_stacks_resolved} kernel stacks symbolized, hit rate "
          f"{1 - kernel_stacks_resolved / delivered_with_stack if delivered_with_stack else 0:.6f}")
    print(f"  runs: {guard.summary(args.rounds * len(MODES))}; tracer loop exceptions: {len(pump.errors)}"
          + (f" (first: {pump.errors[0]})" if pump.errors else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
