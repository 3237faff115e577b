"""What each depth costs a torch generation loop: one process, the agent started and stopped around rounds.

Run as root on the GPU machine (bash tests/gpu/run.sh depth-bench).

One torch worker (tests/gpu/workloads/torch_worker.py) holds an 8-layer random Llama and generates
(batch 8, 256 prompt + --new-tokens tokens, --calls calls a run). Each round runs every role once, the
order rotated each round; a role starts its own agent following the worker (-p), measures one run, and
stops the agent. The same process throughout: only tracing differs. The control is an agent that traces
no blocks (`--blocks never`), not no agent: a busy process beside keeps the CPUs out of deep idle, and
a launch-bound loop ran 10-35 % faster with one than alone on the H100.

Roles (cost = 1 - tokens/s / control's tokens/s of the same round; medians over rounds):
  control  `kvtrace agent -p PID --blocks never`
  auto     `kvtrace agent -p PID` as shipped: --blocks auto; nothing raises this healthy loop, so it stays
           at depth segments (its PyTorch semaphores at zero). Goal: <= 1 %.
  blocks   `--blocks always`: depth blocks, block stacks sampled (--block-sample-bytes, default 512 KiB).
           Goal: <= 3 %.
  full     `--blocks always --block-sample-bytes 0`: every block's stack (what the agent did before depth).
  history  PyTorch's own torch.cuda.memory._record_memory_history(enabled="all"), a control agent beside.

Run: bash tests/gpu/run.sh depth-bench [--rounds 5] [--new-tokens 128] [--calls 2] [--json-out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT / "bench", ROOT / "tests", ROOT / "tests" / "gpu" / "workloads", ROOT / "agent"):
    sys.path.insert(0, str(_path))

from worker_client import TorchWorker  # noqa: E402

from agent_process import AgentProcess  # noqa: E402
from benchlib import code_version, median, progress, require_bpf, rotated  # noqa: E402

ROLES = ("control", "auto", "blocks", "full", "history")
AGENT_FLAGS = {
    "control": ("--blocks", "never"),
    "auto": (),
    "blocks": ("--blocks", "always"),
    "full": ("--blocks", "always", "--block-sample-bytes", "0"),
    "history": ("--blocks", "never"),
}
GOALS = {"auto": 0.01, "blocks": 0.03}
BLOCK_COUNTERS = ("blocks_sampled", "blocks_not_sampled", "stack_walks", "events_submitted")


def one_run(worker: TorchWorker, role: str, directory: Path, args) -> tuple[float, dict[str, int]]:
    """tokens/s of one run under the role's agent, and the agent's counters after it."""
    agent = AgentProcess(directory / f"{role}.sock", "-p", str(worker.pid), "--no-nvml", *AGENT_FLAGS[role])
    try:
        if role == "history":
            worker.send(op="record_history", enabled=True)
        # A short run first: the agent's first stacks are symbolized, the first blocks come from the cache.
        worker.send(timeout_seconds=600, op="generate", batch=8, prompt=256, new_tokens=8, calls=1)
        answer = worker.send(timeout_seconds=600, op="generate", batch=8, prompt=256, new_tokens=args.new_tokens,
                             calls=args.calls)
        counters = agent.counters()
    finally:
        if role == "history":
            worker.send(op="record_history", enabled=False)
        agent.stop()
    return answer["tokens"] / answer["seconds"], counters


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per call (batch 8)")
    parser.add_argument("--calls", type=int, default=2, help="generate calls per run")
    parser.add_argument("--json-out", type=Path, help="also write every figure here as JSON")
    args = parser.parse_args()
    require_bpf()
    results: dict = {"version": code_version(), "machine": os.uname().nodename,
                     "date": time.strftime("%Y-%m-%d %H:%M"), "args": {k: str(v) for k, v in vars(args).items()}}
    progress("starting the torch worker (model load + warm-up)")
    worker = TorchWorker({})
    worker.send(op="init")
    worker.send(timeout_seconds=600, op="llama_load")
    worker.send(timeout_seconds=600, op="generate", batch=8, prompt=256, new_tokens=args.new_tokens, calls=1)
    tokens_per_second: dict[str, list[float]] = {role: [] for role in ROLES}
    counters: dict[str, list[dict[str, int]]] = {role: [] for role in ROLES}
    with tempfile.TemporaryDirectory(prefix="kvtrace-depth-") as directory:
        for round_index in range(args.rounds):
            for role in rotated(ROLES, round_index):
                rate, seen = one_run(worker, role, Path(directory), args)
                tokens_per_second[role].append(rate)
                counters[role].append({name: seen.get(name, 0) for name in BLOCK_COUNTERS})
            progress(f"round {round_index + 1}/{args.rounds}: " + ", ".join(
                f"{role} {values[-1]:.0f}" for role, values in tokens_per_second.items()) + " tokens/s")
    results["tokens_per_second"] = tokens_per_second
    results["counters"] = counters
    report(results)
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=1))
    sys.stdout.flush()
    worker.process.kill()
    return 0


def report(results: dict) -> None:
    tps = results["tokens_per_second"]
    cost = {role: [1 - v / c for v, c in zip(tps[role], tps["control"], strict=True)] for role in ROLES[1:]}
    results["cost"] = {role: median(values) for role, values in cost.items()}
    print(f"depth overhead, {results['date']}, {results['machine']}; measured: {results['version']}")
    print(f"   {'role':<8} {'tokens/s':>9} {'cost':>8}  rounds' costs                     agent counters (last run)")
    print(f"   {'control':<8} {median(tps['control']):>9.0f}")
    for role in ROLES[1:]:
        goal, measured = GOALS.get(role), results["cost"][role]
        verdict = "" if goal is None else f"  goal <= {goal * 100:.0f} % ({'met' if measured <= goal else 'MISSED'})"
        rounds = " ".join(f"{value * 100:+.1f}" for value in cost[role])
        last = ", ".join(f"{k} {v}" for k, v in results["counters"][role][-1].items() if v)
        print(f"   {role:<8} {median(tps[role]):>9.0f} {measured * 100:>7.2f}%  [{rounds}] {last}{verdict}")


if __name__ == "__main__":
    sys.exit(main())
