"""Cost of walking Python stacks in the allocation probes, at 5, 20 and 60 Python frames.

A CPython 3.12 target (bench/stack_target.py; pyenv, else any of 3.10-3.13 found, or --python)
calls the stub cudaMalloc+cudaFree through ctypes.CDLL from a given stack depth and times the
pairs itself. Long-lived targets, each on its own copy of the stub libraries:
  untraced  no probes;
  empty     empty entry and return probes on cudaMalloc, cudaFree, cuMemAlloc_v2, cuMemFree_v2
            (the points kvtrace uses for this workload): the floor every probe pays;
  nostacks  a Tracer with python_stacks=False;
  stacks    a Tracer with python_stacks=True (the same probes, plus the frame walk);
  nostacks@REV, stacks@REV (with --baseline REV): the same, with the probes (all of probes/ but
            kvtrace.h) as committed at REV, so that a change is measured side by side with what it
            replaces, in the same run.
Rounds interleave the modes (order rotated); the added cost of stacks is stacks - nostacks of the
same round and depth, medians over rounds; "x empty" is (mode - untraced) / (empty - untraced).
One user allocation is a cudaMalloc whose stub calls cuMemAlloc_v2: both are allocation probes;
the driver call reuses the runtime call's stack (context.h), so each allocation walks once.
Then the symbolization cache figures of the stacks tracer on this steady workload.

Wall-clock figures on a small shared VM are noisy; --bpf-stats adds what is not: the time inside
each BPF program (kernel.bpf_stats_enabled=1), one run per (traced mode, depth).

Run as root: .venv/bin/python bench/stack_overhead.py [--rounds 7] [--pairs 50000] [--bpf-stats]
             [--baseline HEAD] [--python /root/.pyenv/versions/3.11.7/bin/python3]
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from benchlib import (  # noqa: E402
    ROOT,
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

TARGET = HERE / "stack_target.py"
DEPTHS = (5, 20, 60)
MODES = ("untraced", "empty", "nostacks", "stacks")
GOAL_NS_AT_20 = 3000
EMPTY_POINTS = (("libcudart", "cudaMalloc"), ("libcudart", "cudaFree"),
                ("libcuda", "cuMemAlloc_v2"), ("libcuda", "cuMemFree_v2"))


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


def baseline_probes(rev: str, into: Path) -> Path:
    """The probes as committed at `rev`, but for kvtrace.h, which stays the current one (it only
    gains fields and counters, which older probes do not use; user space reads it)."""
    from kvtrace.sources.bpf.abi import probes_dir

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout

    into.mkdir(parents=True)
    shutil.copy(probes_dir() / "kvtrace.h", into / "kvtrace.h")
    for path in git("ls-tree", "--name-only", rev, "probes/").split():
        name = Path(path).name
        if name != "kvtrace.h":
            (into / name).write_text(git("show", f"{rev}:{path}"))
    return into


@contextlib.contextmanager
def probes_from(directory: Path | None):
    """KVTRACE_PROBES_DIR=directory while a tracer compiles its program (None: the current probes)."""
    if directory is None:
        yield
        return
    previous = os.environ.get("KVTRACE_PROBES_DIR")
    os.environ["KVTRACE_PROBES_DIR"] = str(directory)
    try:
        yield
    finally:
        if previous is None:
            del os.environ["KVTRACE_PROBES_DIR"]
        else:
            os.environ["KVTRACE_PROBES_DIR"] = previous


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
                             "time inside each BPF program")
    parser.add_argument("--baseline", metavar="REV",
                        help="also measure the probes with pystack.h, context.h and emit.h as committed "
                             "at REV (modes nostacks@REV, stacks@REV)")
    parser.add_argument("--python", type=Path, help="the target's CPython (default: pyenv 3.12, else 3.10-3.13)")
    args = parser.parse_args()
    require_bpf()
    version = code_version()  # what is imported and compiled now
    python = args.python or find_python()
    modes = MODES + ((f"nostacks@{args.baseline}", f"stacks@{args.baseline}") if args.baseline else ())
    traced = [mode for mode in modes if mode.startswith(("nostacks", "stacks"))]

    work = Path(tempfile.mkdtemp(prefix="kvtrace-bench-"))
    progress(f"target Python {python}; building {len(modes)} copies of the stubs under {work}")
    builds = build_copies(work, list(modes))
    base_dir = baseline_probes(args.baseline, work / "baseline-probes") if args.baseline else None
    guard = Guard(builds)
    stats = {mode: StackStats() for mode in traced}
    tracers = {}
    for mode in traced:
        with probes_from(base_dir if "@" in mode else None):
            tracers[mode] = scoped_tracer(builds[mode], python_stacks=mode.startswith("stacks"),
                                          sinks=[stats[mode]])
    empty_bpf = empty_probes(
        (builds["empty"].libcudart if library == "libcudart" else builds["empty"].libcuda, symbol, -1)
        for library, symbol in EMPTY_POINTS)
    targets: dict[str, Target] = {}
    results: dict[tuple[str, int], list[float]] = {(m, d): [] for m in modes for d in DEPTHS}
    try:
        with Pump(list(tracers.values())) as pump:
            for mode in modes:
                targets[mode] = Target(python, builds[mode].libcudart)
                if mode in tracers:
                    with pump.lock:
                        tracers[mode].follow(targets[mode].pid)
            with pump.lock:
                target_info = tracers["stacks"].python.get(targets["stacks"].pid)
                before = {mode: counters_of(tracer) for mode, tracer in tracers.items()}
            progress(f"stacks tracer sees the target as: {target_info}")
            for round_index in range(args.rounds):
                order = rotated(modes, round_index)
                for mode in order:
                    runs = guard.measure(round_index, mode, lambda mode=mode: [
                        targets[mode].run(frames, args.pairs) for frames in DEPTHS])
                    for frames, result in zip(DEPTHS, runs, strict=True):
                        results[(mode, frames)].append(result["ns_per_pair"])
                progress(f"round {round_index + 1}/{args.rounds}: " + "; ".join(
                    f"{mode} " + "/".join(f"{results[(mode, d)][-1]:.0f}" for d in DEPTHS)
                    + ("" if guard.ok(round_index, mode) else " (dropped)")
                    for mode in modes) + f" ns/pair at {'/'.join(map(str, DEPTHS))} frames")
            bodies = {}  # (mode, frames) -> (BPF ns per pair, ns per run by program)
            if args.bpf_stats:
                with bpf_stats():
                    for frames in DEPTHS:
                        for mode in ["empty", *traced]:
                            bpf = empty_bpf if mode == "empty" else tracers[mode].probes._bpf
                            bodies[(mode, frames)] = body_ns_per_pair(
                                bpf, lambda mode=mode, frames=frames: targets[mode].run(frames, args.pairs),
                                args.pairs)
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
        empty_bpf.cleanup()
        shutil.rmtree(work, ignore_errors=True)

    def clean(mode, frames):
        return [v for r, v in enumerate(results[(mode, frames)]) if guard.ok(r, mode)]

    def added(mode, over, frames):
        pairs = zip(results[(mode, frames)], results[(over, frames)], strict=True)
        return [a - b for r, (a, b) in enumerate(pairs) if guard.ok(r, mode, over)]

    def stacks_added(frames, suffix=""):
        return added("stacks" + suffix, "nostacks" + suffix, frames)

    if not all(clean(mode, DEPTHS[0]) for mode in modes) or not stacks_added(DEPTHS[0]):
        print(f"python stack overhead: no figures: {guard.summary(args.rounds * len(modes))}")
        return 3
    print(f"python stack overhead: {python} target, ctypes.CDLL, {args.rounds} rounds x "
          f"{args.pairs} pairs per depth, medians over clean rounds (ns per cudaMalloc+cudaFree pair)")
    print(f"  measured: {version}" + (f"; @{args.baseline}: probes/ as committed at "
                                       f"{args.baseline} (kvtrace.h as now)" if args.baseline else ""))
    print(f"  {'frames':>6} " + " ".join(f"{mode:>15}" for mode in modes))
    for frames in DEPTHS:
        print(f"  {frames:>6} " + " ".join(f"{median(clean(mode, frames)):>15.0f}" for mode in modes))
    print("  added over untraced, ns per pair (x the empty probes' added cost):")
    print(f"  {'frames':>6} " + " ".join(f"{mode:>15}" for mode in modes[1:]))
    for frames in DEPTHS:
        empty_added = median(added("empty", "untraced", frames))
        cells = []
        for mode in modes[1:]:
            value = median(added(mode, "untraced", frames))
            cells.append(f"{value:>7.0f} ({value / empty_added:4.2f}x)" if empty_added > 0 else f"{value:>15.0f}")
        print(f"  {frames:>6} " + " ".join(cells))
    suffixes = ["", f"@{args.baseline}"] if args.baseline else [""]
    print("  stacks - nostacks of the same round, ns per allocation: " + "; ".join(
        f"{'stacks' + suffix}: " + "/".join(f"{median(stacks_added(frames, suffix)):.0f}" for frames in DEPTHS)
        for suffix in suffixes) + f" at {'/'.join(map(str, DEPTHS))} frames")
    added_at_20 = median(stacks_added(20))
    verdict = "met" if added_at_20 <= GOAL_NS_AT_20 else "MISSED"
    print(f"  added per allocation at 20 frames: {added_at_20:.0f} ns, goal <= {GOAL_NS_AT_20} ns ({verdict})"
          "; an allocation = cudaMalloc + the cuMemAlloc_v2 it makes (which reuses the walk)")
    if bodies:
        print("  BPF program time per pair (bpf_stats, one run each; empty = the floor):")
        print(f"  {'frames':>6} " + " ".join(f"{mode:>15}" for mode in ["empty", *traced]))
        for frames in DEPTHS:
            print(f"  {frames:>6} " + " ".join(f"{bodies[(mode, frames)][0]:>15.0f}" for mode in ["empty", *traced]))
        print("  BPF ns per run of each program at 20 frames:")
        for mode in traced:
            per_run = bodies[(mode, 20)][1]
            print(f"    {mode:>15}: " + ", ".join(f"{name} {ns:.0f}" for name, ns in sorted(per_run.items())))
    for mode in traced:
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
    print(f"  runs: {guard.summary(args.rounds * len(modes))}; tracer loop exceptions: {len(pump.errors)}"
          + (f" (first: {pump.errors[0]})" if pump.errors else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
