"""PyTorch's own memory recorder at its cheapest, in a pair loop: what `kvtrace run --blocks always` adds.

Run on the GPU machine: python3 bench/torch_recorder_cost.py [--pairs 200000]

Prints ns per torch.empty(4096 floats) + del pair with the recorder off, on in the mode `kvtrace run` uses
(enabled="state", context="state", stacks="python": live blocks' Python stacks only) and off again; what one
on+off costs; how long the snapshot that `kvtrace run` reads at exit takes; and that blocks allocated while the
recorder was on keep their stack after it is off, and the others have none.
"""
from __future__ import annotations

import argparse
import time

import torch


def pairs(count: int) -> float:
    started = time.perf_counter_ns()
    for _ in range(count):
        tensor = torch.empty(4096, device="cuda")
        del tensor
    return (time.perf_counter_ns() - started) / count


def keep(count: int, held: list) -> None:
    for _ in range(count):
        held.append(torch.empty(1 << 20, dtype=torch.uint8, device="cuda"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=200_000)
    args = parser.parse_args()
    torch.cuda.init()
    held: list = []
    print(f"ns per pair, recorder off: {pairs(args.pairs):.0f} (warm-up), {pairs(args.pairs):.0f}")
    torch.cuda.memory._record_memory_history(enabled="state", context="state", stacks="python")
    print(f"ns per pair, recorder on (state, python): {pairs(args.pairs):.0f}, {pairs(args.pairs):.0f}")
    keep(5, held)
    torch.cuda.memory._record_memory_history(enabled=None)
    keep(5, held)
    print(f"ns per pair, recorder off again: {pairs(args.pairs):.0f}")
    started = time.perf_counter_ns()
    for _ in range(1000):
        torch.cuda.memory._record_memory_history(enabled="state", context="state", stacks="python")
        torch.cuda.memory._record_memory_history(enabled=None)
    print(f"ns per on or off: {(time.perf_counter_ns() - started) / 2000:.0f}")
    started = time.perf_counter_ns()
    snapshot = torch.cuda.memory._snapshot()
    print(f"_snapshot(): {(time.perf_counter_ns() - started) / 1e6:.1f} ms")
    started = time.perf_counter_ns()
    torch.cuda.memory.memory_snapshot(include_traces=False)
    print(f"memory_snapshot(include_traces=False) after it: {(time.perf_counter_ns() - started) / 1e6:.3f} ms")
    order = {tensor.data_ptr(): index for index, tensor in enumerate(held)}
    for segment in snapshot["segments"]:
        for block in segment["blocks"]:
            if block["address"] in order:
                frames = block.get("frames") or []
                print(f"kept #{order[block['address']]} ({'on' if order[block['address']] < 5 else 'off'}): "
                      f"{block['state']}, {len(frames)} frames, innermost {frames[:1]}")


if __name__ == "__main__":
    main()
