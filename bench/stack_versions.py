"""The Python stack walk's cost per allocation on each CPython build, side by side in one run.

Two tracers, one with Python stacks and one without, each on its own copy of the stub libraries,
follow two long-lived bench/stack_target.py per build (CPython 3.13, 3.14, 3.14t, 3.15, 3.15t by
default: tests/interpreters.py finds them, `make pythons` builds 3.14+). With
kernel.bpf_stats_enabled=1, each round runs every build (order rotated) at 20 and 60 frames under both
and reads the kernel's own run time of the probes per cudaMalloc+cudaFree pair (the walk program is
tail-called, so its time is its caller's); the walk's cost per allocation is the difference, stacks -
nostacks, of the same round. Medians over rounds, and each build's walk as a ratio of 3.13's (issue 32:
within 10 %). Kernel run time, not wall clock: what the walk costs the thread, free of the VM's noise.

Run as root: .venv/bin/python bench/stack_versions.py [--rounds 7] [--pairs 20000] [--labels 3.13,3.14,...]
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from benchlib import (  # noqa: E402
    Pump,
    body_ns_per_pair,
    bpf_stats,
    build_copies,
    code_version,
    median,
    progress,
    require_bpf,
    rotated,
    scoped_tracer,
)
from interpreters import find_interpreter  # noqa: E402
from kvtrace.sources.python.runtime import PythonTarget  # noqa: E402
from stack_overhead import Target  # noqa: E402

DEPTHS = (20, 60)
BASELINE = "3.13"
GOAL_RATIO = 1.10
MODES = ("stacks", "nostacks")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--pairs", type=int, default=20_000, help="pairs per (build, depth) run")
    parser.add_argument("--labels", default="3.13,3.14,3.14t,3.15,3.15t",
                        help=f"builds to compare, {BASELINE} first (the baseline)")
    args = parser.parse_args()
    require_bpf()
    labels = args.labels.split(",")
    if labels[0] != BASELINE:
        sys.exit(f"--labels must start with {BASELINE}, the baseline")
    pythons = {}
    for label in labels:
        found = find_interpreter(label)
        if isinstance(found, str):
            sys.exit(found)
        pythons[label] = found
    work = Path(tempfile.mkdtemp(prefix="kvtrace-bench-"))
    builds = build_copies(work, list(MODES))
    tracers = {mode: scoped_tracer(builds[mode], python_stacks=mode == "stacks") for mode in MODES}
    targets: dict[tuple[str, str], Target] = {}
    walk_ns: dict[tuple[str, int], list[float]] = {(label, d): [] for label in labels for d in DEPTHS}
    pair_ns: dict[tuple[str, int], list[float]] = {(label, d): [] for label in labels for d in DEPTHS}
    try:
        with Pump(list(tracers.values())) as pump, bpf_stats():
            for label in labels:
                for mode in MODES:
                    targets[(label, mode)] = target = Target(pythons[label], builds[mode].libcudart)
                    with pump.lock:
                        tracers[mode].follow(target.pid)
                with pump.lock:
                    found = tracers["stacks"].python.get(targets[(label, "stacks")].pid)
                progress(f"{label}: {pythons[label]}: "
                         + (f"CPython {found.offsets.label}" if isinstance(found, PythonTarget) else str(found)))
            for round_index in range(args.rounds):
                for label in rotated(labels, round_index):
                    for frames in DEPTHS:
                        total = {mode: body_ns_per_pair(
                            tracers[mode].probes._bpf,
                            lambda target=targets[(label, mode)], frames=frames: target.run(frames, args.pairs),
                            args.pairs)[0]
                            for mode in MODES}
                        walk_ns[(label, frames)].append(total["stacks"] - total["nostacks"])
                        pair_ns[(label, frames)].append(total["stacks"])
                progress(f"round {round_index + 1}/{args.rounds}: " + "; ".join(
                    f"{label} " + "/".join(f"{walk_ns[(label, d)][-1]:.0f}" for d in DEPTHS) for label in labels)
                    + f" ns per walk at {'/'.join(map(str, DEPTHS))} frames")
    finally:
        for target in targets.values():
            target.close()
        for tracer in tracers.values():
            tracer.stop()
        shutil.rmtree(work, ignore_errors=True)

    print(f"python stack walk by build: {args.rounds} rounds x {args.pairs} cudaMalloc+cudaFree pairs per depth, "
          f"kernel run time (bpf_stats), medians; measured: {code_version()}")
    print(f"  {'build':>6} " + " ".join(f"{'walk@' + str(d):>10} {'x' + BASELINE:>6} {'pair@' + str(d):>10}"
                                         for d in DEPTHS))
    verdicts = []
    for label in labels:
        cells = []
        for frames in DEPTHS:
            walk = median(walk_ns[(label, frames)])
            ratio = walk / median(walk_ns[(BASELINE, frames)])
            cells.append(f"{walk:>10.0f} {ratio:>6.2f} {median(pair_ns[(label, frames)]):>10.0f}")
            if label != BASELINE:
                verdicts.append((label, frames, ratio))
        print(f"  {label:>6} " + " ".join(cells))
    missed = [f"{label}@{frames} {ratio:.2f}x" for label, frames, ratio in verdicts if not ratio <= GOAL_RATIO]
    print(f"  goal: every build's walk within {GOAL_RATIO - 1:.0%} of {BASELINE}'s: "
          + ("met" if not missed else "MISSED: " + ", ".join(missed)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
