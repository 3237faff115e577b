"""What tracing PyTorch's caching allocator block by block costs, measured side by side in one run.

Run as root on the GPU machine (bash tests/gpu/run.sh blocks-bench).

Every role is its own torch worker (tests/gpu/workloads/torch_worker.py) holding the same random
Llama, started once; each agent follows one worker (-p), so its probes, and the USDT semaphores
that switch PyTorch's probe sites on, are in that process only. Rounds run the roles in turn, the
order rotated each round, so that drift on the machine hits all alike.

Roles:
  untraced   nothing attached
  nostacks   `kvtrace agent -p PID --no-python-stacks --max-block-events-per-second 0`
  stacks     `kvtrace agent -p PID --max-block-events-per-second 0` (Python stacks on)
  kvtrace    `kvtrace agent -p PID` as shipped: blocks and Python stacks, at most 100 000 block
             events a second per process (beyond, blocks stay exact in the ledger, unsent)
  history    PyTorch's own torch.cuda.memory._record_memory_history(enabled="all"), no probes

1. tensor cost: `x = torch.empty(4096, device="cuda"); del x` in a tight loop, --depth Python frames
   below the worker's loop; with the caching allocator each pair is a cache hit, one pytorch:malloc
   and one pytorch:free and no CUDA call. ns per pair; added = role - untraced of the same round.
   Roles untraced, nostacks, stacks: no rate limit there, so every event is sent (the worst case).
2. generation: tokens/s of the 8-layer random Llama (tests/gpu/workloads/llama.py), batch 8, 256
   prompt + --new-tokens tokens per round; roles untraced, kvtrace, history; slowdown = 1 - tokens/s
   / untraced's of the same round. Goal: kvtrace's slowdown / history's < 0.2.

Run: bash tests/gpu/run.sh blocks-bench [--pair-rounds 20] [--pairs 20000] [--gen-rounds 10] [--json-out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT / "bench", ROOT / "tests", ROOT / "tests" / "gpu" / "workloads", ROOT / "agent"):
    sys.path.insert(0, str(_path))

from agent_process import AgentProcess  # noqa: E402
from benchlib import CpuMeter, code_version, counters_delta, median, progress, require_bpf, rotated  # noqa: E402
from gpu_overhead import agent_counters, start_workers  # noqa: E402

GOAL_RATIO = 0.2  # kvtrace's tokens/s slowdown over PyTorch's own recorder's
PAIR_ROLES = ("untraced", "nostacks", "stacks")
GEN_ROLES = ("untraced", "kvtrace", "history")
AGENT_FLAGS = {
    "nostacks": ("--no-python-stacks", "--max-block-events-per-second", "0"),
    "stacks": ("--max-block-events-per-second", "0"),
    "kvtrace": (),
}
NUMEL = 4096  # floats: a 16 KiB block from the small pool


def start_agents(directory: Path, workers: dict) -> dict[str, AgentProcess]:
    """One agent per traced role, following that role's worker only; started at once (each compiles
    its BPF program and attaches in a few seconds)."""
    def start(role):
        return role, AgentProcess(directory / f"{role}.sock", "-p", str(workers[role].pid), "--no-nvml",
                                  *AGENT_FLAGS[role])

    with ThreadPoolExecutor(max_workers=len(AGENT_FLAGS)) as pool:
        return dict(pool.map(start, AGENT_FLAGS))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair-rounds", type=int, default=20)
    parser.add_argument("--pairs", type=int, default=20000, help="torch.empty + del pairs per run")
    parser.add_argument("--depth", type=int, default=16, help="Python frames below the pair loop's caller")
    parser.add_argument("--gen-rounds", type=int, default=10)
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per run (batch 8)")
    parser.add_argument("--json-out", type=Path, help="also write every figure here as JSON")
    args = parser.parse_args()
    require_bpf()
    results: dict = {"version": code_version(), "machine": os.uname().nodename,
                     "date": time.strftime("%Y-%m-%d %H:%M"), "args": {k: str(v) for k, v in vars(args).items()}}

    names = list(dict.fromkeys(PAIR_ROLES + GEN_ROLES))
    progress(f"starting {len(names)} torch workers (model load + warm-up in parallel)")
    started = time.monotonic()
    workers = start_workers(names, args.new_tokens)
    progress(f"workers ready in {time.monotonic() - started:.0f} s")
    workers["history"].send(op="record_history", enabled=True)
    with tempfile.TemporaryDirectory(prefix="kvtrace-bench-") as directory:
        started = time.monotonic()
        agents = start_agents(Path(directory), workers)
        progress(f"agents attached in {time.monotonic() - started:.0f} s: " + ", ".join(
            f"{role} (pid {agent.process.pid}) -> worker {workers[role].pid}" for role, agent in agents.items()))
        # Warm-up under the probes: first stacks are symbolized, first blocks come from cudaMalloc.
        for role in PAIR_ROLES:
            workers[role].send(op="tensor_pairs", count=args.pairs, numel=NUMEL, depth=args.depth)
        for role in GEN_ROLES:
            workers[role].send(timeout_seconds=600, op="generate", batch=8, prompt=256, new_tokens=16, calls=1)

        # 1. tensor cost
        before = {role: agent_counters(agent.socket) for role, agent in agents.items()}
        meters = {role: CpuMeter(agents[role].process.pid) for role in ("nostacks", "stacks")}
        for meter in meters.values():
            meter.start()
        pair_ns: dict[str, list[float]] = {role: [] for role in PAIR_ROLES}
        for round_index in range(args.pair_rounds):
            for role in rotated(PAIR_ROLES, round_index):
                pair_ns[role].append(workers[role].send(op="tensor_pairs", count=args.pairs, numel=NUMEL,
                                                        depth=args.depth)["ns_per_pair"])
            if round_index % 5 == 4:
                progress(f"tensor round {round_index + 1}/{args.pair_rounds}: " + ", ".join(
                    f"{role} {values[-1]:.0f}" for role, values in pair_ns.items()) + " ns/pair")
        results["agent_core_fraction_pairs"] = {role: meter.stop() for role, meter in meters.items()}
        middle = {role: agent_counters(agent.socket) for role, agent in agents.items()}
        results["counters_pairs"] = {role: counters_delta(middle[role], before[role]) for role in meters}
        results["pair_ns"] = pair_ns

        # 2. generation
        meter = CpuMeter(agents["kvtrace"].process.pid)
        meter.start()
        tokens_per_second: dict[str, list[float]] = {role: [] for role in GEN_ROLES}
        for round_index in range(args.gen_rounds):
            for role in rotated(GEN_ROLES, round_index):
                answer = workers[role].send(timeout_seconds=600, op="generate", batch=8, prompt=256,
                                            new_tokens=args.new_tokens, calls=1)
                tokens_per_second[role].append(answer["tokens"] / answer["seconds"])
            progress(f"generation round {round_index + 1}/{args.gen_rounds}: " + ", ".join(
                f"{role} {values[-1]:.0f}" for role, values in tokens_per_second.items()) + " tokens/s")
        results["agent_core_fraction_generation"] = meter.stop()
        after = agent_counters(agents["kvtrace"].socket)
        results["counters_generation"] = counters_delta(after, middle["kvtrace"])
        results["tokens_per_second"] = tokens_per_second
        report(results, args)
        if args.json_out:
            args.json_out.write_text(json.dumps(results, indent=1))
        sys.stdout.flush()
        # Taking probes out costs the kernel a grace period each: the figures are out, so end
        # without waiting for that (as gpu_overhead.py does).
        for agent in agents.values():
            agent.process.kill()
        for worker in workers.values():
            worker.process.kill()
        os._exit(0)


def report(results: dict, args) -> None:
    def verdict(ok):
        return "met" if ok else "MISSED"

    pair, tps = results["pair_ns"], results["tokens_per_second"]
    added = {role: median([v - b for v, b in zip(pair[role], pair["untraced"], strict=True)])
             for role in PAIR_ROLES[1:]}
    slowdown = {role: median([1 - v / b for v, b in zip(tps[role], tps["untraced"], strict=True)])
                for role in GEN_ROLES[1:]}
    ratio = slowdown["kvtrace"] / slowdown["history"] if slowdown["history"] > 0 else float("nan")
    results.update(added_ns_per_pair=added, slowdown=slowdown, ratio=ratio)
    generation = results["counters_generation"]
    tokens = 8 * args.new_tokens * args.gen_rounds
    print(f"torch blocks overhead, {results['date']}, {results['machine']}; measured: {results['version']}")
    for role, counters in results["counters_pairs"].items():
        # 2.0 events per pair: every malloc and free reached the agent (the check that probes fired)
        per_pair = counters.get("events_submitted", 0) / (args.pair_rounds * args.pairs)
        print(f"agent {role} during the tensor loop: {results['agent_core_fraction_pairs'][role] * 100:.0f} % "
              f"of a core; {per_pair:.2f} events submitted per pair; "
              + ", ".join(f"{k} {v}" for k, v in sorted(counters.items()) if v))
    print(f"agent kvtrace while generating: {results['agent_core_fraction_generation'] * 100:.1f} % of a core; "
          f"{generation.get('events_submitted', 0) / tokens:.1f} events submitted per token; "
          + ", ".join(f"{k} {v}" for k, v in sorted(generation.items()) if v))
    print(f"1. torch.empty({NUMEL}) + del on the GPU, {args.pair_rounds} rounds x {args.pairs} pairs, "
          f"{args.depth} frames deep (medians)")
    print(f"   {'role':<10} {'ns/pair':>9} {'added':>9}")
    print(f"   {'untraced':<10} {median(pair['untraced']):>9.0f}")
    for role, value in added.items():
        print(f"   {role:<10} {median(pair[role]):>9.0f} {value:>+9.0f}")
    print(f"2. generation, {args.gen_rounds} rounds x {8 * args.new_tokens} tokens (median tokens/s; median "
          "slowdown against untraced of the same round)")
    print(f"   {'role':<10} {'tokens/s':>9} {'slowdown':>9}")
    print(f"   {'untraced':<10} {median(tps['untraced']):>9.0f}")
    for role, value in slowdown.items():
        print(f"   {role:<10} {median(tps[role]):>9.0f} {value * 100:>8.2f}%")
    print(f"   kvtrace slowdown / history slowdown = {ratio:.3f}  goal < {GOAL_RATIO} ({verdict(ratio < GOAL_RATIO)})")


if __name__ == "__main__":
    sys.exit(main())
