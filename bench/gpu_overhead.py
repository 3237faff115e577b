"""What kvtrace costs on real CUDA (run as root on the GPU machine), measured side by side in one run.

Every configuration is its own torch process (tests/gpu/workloads/torch_worker.py), started once;
rounds run them in turn, the order rotated each round, so that drift on the machine hits all alike.
Probes are planted per process (the agent's -p and bcc's pid argument), so the untraced processes
have no breakpoints at all.

Processes ("roles"):
  untraced, untraced_b  nothing attached (two, so the run shows its own noise floor: A/A)
  empty                 a bcc program of empty entry and return functions on every function kvtrace
                        probes in that process's libcudart and libcuda
  kvtrace               the real `kvtrace agent -p PID ...` (Python stacks on, gRPC, metrics, NVML)
  kvtrace_nostacks      a second agent with --no-python-stacks (pair cost only)
  history               PyTorch's own torch.cuda.memory._record_memory_history (no probes)
  kvtrace_nostacks@base with --baseline-probes DIR: a third agent without stacks whose probes are DIR's
                        (KVTRACE_PROBES_DIR: probes/ as at another commit, named in DIR/COMMIT), so that a
                        change of the probes is measured side by side with what it replaces

1. pair cost: cudaMalloc(1 MiB) + cudaFree through torch's libcudart (ctypes), 16 frames below the
   worker's loop; ns per pair; added cost = role - untraced of the same round.
   Goals: kvtrace (with stacks) adds <= 1.5x what empty probes add; without stacks <= 1.25x.
2. generation: the 8-layer random Llama (tests/gpu/workloads/llama.py), batch 8, 256 prompt + 128
   new tokens per round, in each allocator mode (caching, expandable_segments, no caching).
   Goals: <= 0.5 % fewer tokens/s with caching and with expandable segments; without caching, the
   slowdown at most 1.5x that of empty probes.
3. the agent's CPU (idle and while generating) and RSS. Goal: <= 1 % of a core when idle.

Run: python3 bench/gpu_overhead.py [--pair-rounds 25] [--gen-rounds 6] [--json-out FILE]
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

from worker_client import TorchWorker  # noqa: E402

from agent_process import AgentProcess  # noqa: E402
from benchlib import (  # noqa: E402
    CpuMeter,
    code_version,
    empty_probes,
    median,
    progress,
    require_bpf,
    rotated,
    set_masks,
)

PAIR_GOAL_RATIO = 1.5
NOSTACKS_PAIR_GOAL_RATIO = 1.25
CACHED_GOAL_SLOWDOWN = 0.005
UNCACHED_GOAL_RATIO = 1.5
IDLE_GOAL_CORE_FRACTION = 0.01
MODES = {
    "caching": {},
    "expandable_segments": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    "no_caching": {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"},
}
ROLES = {
    "caching": ("untraced", "untraced_b", "empty", "kvtrace", "history"),
    "expandable_segments": ("untraced", "empty", "kvtrace", "history"),
    "no_caching": ("untraced", "empty", "kvtrace"),
}
PAIR_ROLES = ("untraced", "untraced_b", "empty", "kvtrace_nostacks", "kvtrace_wake1", "kvtrace")
# Pair-only roles, each its own worker and agent: without Python stacks, and waking the agent for
# every event (--wakeup-events 1, as kvtrace did before batching wakeups).
EXTRA_PAIR_AGENTS = {"kvtrace_nostacks": ("--no-python-stacks",), "kvtrace_wake1": ("--wakeup-events", "1")}
BASELINE_ROLE = "kvtrace_nostacks@base"  # with --baseline-probes


def start_workers(names: list[str], new_tokens: int) -> dict[str, TorchWorker]:
    """Starts every worker at once (importing torch and building the model take seconds each)."""
    def start(name):
        mode = name.split("/")[0]
        worker = TorchWorker(MODES.get(mode, {}))
        worker.send(op="init")
        # Every worker holds the model, so that all are in the same state for the pair loop too
        # (in a fresh process a 1 MiB cudaMalloc costs ten times more: the driver maps memory).
        worker.send(timeout_seconds=600, op="llama_load")
        worker.send(op="generate", batch=8, prompt=256, new_tokens=new_tokens, calls=1)  # warm-up
        return name, worker

    with ThreadPoolExecutor(max_workers=len(names)) as pool:
        return dict(pool.map(start, names))


def attach_empty_probes(pids: list[int]):
    """Empty entry/return probes on every function kvtrace would probe in each process's libraries,
    for that process only."""
    from kvtrace.sources.bpf.discovery import Discovery

    points = [(target.path, symbol, pid) for pid in pids
              for target in Discovery().scan_pid(pid) for symbol in target.symbols]
    bpf = empty_probes(points)
    progress(f"empty probes: {2 * len(points)} attached for pids {pids}")
    return bpf


def masks(pid: int) -> dict[int, set[int]]:
    """The CPUs each thread of `pid` may run on."""
    return {int(task): os.sched_getaffinity(int(task)) for task in os.listdir(f"/proc/{pid}/task")}


def restore_masks(pid: int, by_thread: dict[int, set[int]]) -> None:
    everywhere = os.sched_getaffinity(0)
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(task), by_thread.get(int(task), everywhere))
        except ProcessLookupError:
            pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair-rounds", type=int, default=25)
    parser.add_argument("--pairs", type=int, default=3000, help="cudaMalloc+cudaFree pairs per run")
    parser.add_argument("--depth", type=int, default=16, help="Python frames below the pair loop's caller")
    parser.add_argument("--gen-rounds", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per run (batch 8)")
    parser.add_argument("--idle-seconds", type=float, default=20.0)
    parser.add_argument("--json-out", type=Path, help="also write every figure here as JSON")
    parser.add_argument("--only", choices=("pairs",), help="measure only the pair cost (fewer workers)")
    parser.add_argument("--baseline-probes", type=Path, metavar="DIR",
                        help="also a kvtrace_nostacks@base agent compiling DIR's probes (or DIR/probes: e.g. `git "
                             "archive REV agent probes | tar -x -C DIR`, REV written in DIR/COMMIT, as agent_idle.py "
                             "--baseline takes); this agent's user space reads them: for commits of the same ABI")
    parser.add_argument("--pin-cpu", type=int, default=max(os.sched_getaffinity(0)),
                        help="the CPU every worker's threads run on during the pair rounds (they run in "
                             "turn); -1: not pinned")
    args = parser.parse_args()
    require_bpf()
    version = code_version()
    extra_agents_env: dict[str, dict[str, str]] = {}
    if args.baseline_probes:
        commit = args.baseline_probes / "COMMIT"
        if (args.baseline_probes / "probes" / "kvtrace.bpf.c").is_file():  # a tree of agent/ and probes/
            args.baseline_probes = args.baseline_probes / "probes"
        if not (args.baseline_probes / "kvtrace.bpf.c").is_file():
            parser.error(f"--baseline-probes {args.baseline_probes}: no kvtrace.bpf.c there (nor in probes/)")
        EXTRA_PAIR_AGENTS[BASELINE_ROLE] = EXTRA_PAIR_AGENTS["kvtrace_nostacks"]
        extra_agents_env[BASELINE_ROLE] = dict(os.environ, KVTRACE_PROBES_DIR=str(args.baseline_probes.resolve()))
        pair_roles = PAIR_ROLES + (BASELINE_ROLE,)
        version += f"; @base: {commit.read_text().strip() if commit.exists() else args.baseline_probes}"
    else:
        pair_roles = PAIR_ROLES

    if args.only == "pairs":
        for mode in ROLES:
            ROLES[mode] = tuple(role for role in ROLES[mode] if mode == "caching" and role in PAIR_ROLES)
    names = [f"{mode}/{role}" for mode, roles in ROLES.items() for role in roles]
    names += [f"pairs/{role}" for role in EXTRA_PAIR_AGENTS]
    progress(f"starting {len(names)} torch workers (model load + warm-up in parallel)")
    started = time.monotonic()
    workers = start_workers(names, args.new_tokens)
    progress(f"workers ready in {time.monotonic() - started:.0f} s")
    pair_workers = {role: workers.get(f"caching/{role}") or workers[f"pairs/{role}"] for role in pair_roles}

    for mode in ROLES:
        if "history" in ROLES[mode]:
            workers[f"{mode}/history"].send(op="record_history", enabled=True)
    empty_bpf = attach_empty_probes([w.pid for name, w in workers.items() if name.endswith("/empty")])
    traced = [w.pid for name, w in workers.items() if name.endswith("/kvtrace")]
    results: dict = {"version": version, "machine": os.uname().nodename, "date": time.strftime("%Y-%m-%d %H:%M"),
                     "empty_probe_functions": len(empty_bpf.funcs)}
    with tempfile.TemporaryDirectory(prefix="kvtrace-bench-") as directory:
        socket = Path(directory) / "a.sock"
        pid_flags = [flag for pid in traced for flag in ("-p", str(pid))]
        extra_agents = []
        with AgentProcess(socket, *pid_flags) as agent:
            for index, (role, flags) in enumerate(EXTRA_PAIR_AGENTS.items()):
                extra_agents.append(AgentProcess(Path(directory) / f"{index}.sock", *flags, "--no-nvml",
                                                 "-p", str(pair_workers[role].pid), env=extra_agents_env.get(role)))
            meter = CpuMeter(agent.process.pid)
            progress(f"agents attached; agent idle for {args.idle_seconds:.0f} s")
            meter.start()
            time.sleep(args.idle_seconds)
            results["agent_idle_core_fraction"] = meter.stop()
            results["agent_rss_idle_bytes"] = meter.rss_bytes()

            # 1. pair cost. Each worker on the same CPU while the pairs run (one at a time): unpinned, a
            # process kept the core it landed on, and two untraced processes differed by up to 3 µs
            # per pair on the H200, as much as what is measured.
            agent_pids = [agent.process.pid] + [extra.process.pid for extra in extra_agents]
            worker_pids = [worker.pid for worker in pair_workers.values()]
            saved = {pid: masks(pid) for pid in worker_pids + agent_pids} if args.pin_cpu >= 0 else {}
            if saved:  # the agents off that CPU: their reading does not preempt a timed loop
                set_masks(worker_pids, {args.pin_cpu})
                set_masks(agent_pids, os.sched_getaffinity(0) - {args.pin_cpu})
            results["pair_pinned_cpu"] = args.pin_cpu if saved else None
            pair_ns: dict[str, list[float]] = {role: [] for role in pair_workers}
            for round_index in range(args.pair_rounds):
                for role in rotated(pair_workers, round_index):
                    pair_ns[role].append(pair_workers[role].send(op="pairs", count=args.pairs,
                                                                 depth=args.depth)["ns_per_pair"])
                if round_index % 5 == 4:
                    progress(f"pairs round {round_index + 1}/{args.pair_rounds}: " + ", ".join(
                        f"{role} {values[-1]:.0f}" for role, values in pair_ns.items()) + " ns")
            results["pair_ns"] = pair_ns
            for pid, by_thread in saved.items():  # as they were, for the generation rounds
                restore_masks(pid, by_thread)

            # 2. generation
            meter.start()
            tokens_per_second: dict[str, list[float]] = {
                f"{mode}/{role}": [] for mode, roles in ROLES.items() for role in roles}
            for round_index in range(0 if args.only == "pairs" else args.gen_rounds):
                for name in rotated(tokens_per_second, round_index):
                    answer = workers[name].send(timeout_seconds=600, op="generate", batch=8, prompt=256,
                                                new_tokens=args.new_tokens, calls=1)
                    tokens_per_second[name].append(answer["tokens"] / answer["seconds"])
                progress(f"generation round {round_index + 1}/{args.gen_rounds}: " + ", ".join(
                    f"{name} {values[-1]:.0f}" for name, values in tokens_per_second.items()) + " tokens/s")
            results["agent_busy_core_fraction"] = meter.stop()
            results["agent_rss_busy_bytes"] = meter.rss_bytes()
            results["tokens_per_second"] = tokens_per_second
            results["agent_counters"] = agent.counters()
            results["extra_agent_counters"] = {role: extra.counters()
                                               for role, extra in zip(EXTRA_PAIR_AGENTS, extra_agents, strict=True)}
            report(results, args)
            if args.json_out:
                args.json_out.write_text(json.dumps(results, indent=1))
            sys.stdout.flush()
            # Taking probes out costs the kernel a grace period each (hundreds here, seconds in
            # all): the figures are out, so end without waiting for that.
            for process in [agent.process] + [extra.process for extra in extra_agents]:
                process.kill()
            for worker in workers.values():
                worker.process.kill()
            os._exit(0)


def paired(values: list[float], baseline: list[float], how) -> list[float]:
    return [how(value, base) for value, base in zip(values, baseline, strict=True)]


def report(results: dict, args) -> None:
    def verdict(ok):
        return "met" if ok else "MISSED"

    print(f"GPU overhead, {results['date']}, {results['machine']}; measured: {results['version']}")
    pair = results["pair_ns"]
    added = {role: median(paired(pair[role], pair["untraced"], lambda v, b: v - b))
             for role in pair if role != "untraced"}
    pinned = results.get("pair_pinned_cpu")
    print(f"1. cudaMalloc(1 MiB)+cudaFree pair, {args.pair_rounds} rounds x {args.pairs} pairs, "
          f"{args.depth} frames deep; medians" + (f"; every worker on CPU {pinned}" if pinned is not None else ""))
    print(f"   untraced {median(pair['untraced']):.0f} ns/pair")
    for role, value in added.items():
        print(f"   {role:<18} adds {value:>8.0f} ns/pair")
    # the ratio of the medians (the goal's figure), and the median of each round's own ratio beside it
    ratios = {}
    for role, goal in (("kvtrace", PAIR_GOAL_RATIO), ("kvtrace_nostacks", NOSTACKS_PAIR_GOAL_RATIO),
                       (BASELINE_ROLE, NOSTACKS_PAIR_GOAL_RATIO)):
        if role not in added:
            continue
        ratios[role] = added[role] / added["empty"] if added["empty"] > 0 else float("nan")
        rounds = [(value - base) / (empty - base) for value, empty, base
                  in zip(pair[role], pair["empty"], pair["untraced"], strict=True) if empty > base]
        print(f"   {role} added / empty added = {ratios[role]:.3f} (rounds' own: median {median(rounds):.3f})  "
              f"goal <= {goal} ({verdict(ratios[role] <= goal)})")
    results["pair_ratio"] = ratios["kvtrace"]
    results["pair_ratios"] = ratios

    tps = results["tokens_per_second"]
    if args.only == "pairs":
        tps = {}
    if tps:
        print(f"2. generation, {args.gen_rounds} rounds x {8 * args.new_tokens} tokens per process; "
              "median tokens/s, and the "
              f"median of each round's slowdown against untraced")
    for mode, roles in ROLES.items() if tps else ():
        base = tps[f"{mode}/untraced"]
        line = [f"untraced {median(base):.0f}"]
        slowdown = {}
        for role in roles[1:]:
            slowdown[role] = median(paired(tps[f"{mode}/{role}"], base, lambda v, b: 1 - v / b))
            line.append(f"{role} {median(tps[f'{mode}/{role}']):.0f} ({slowdown[role] * 100:+.2f} %)")
        print(f"   {mode:<20} " + ", ".join(line))
        if mode == "no_caching":
            ratio = slowdown["kvtrace"] / slowdown["empty"] if slowdown["empty"] > 0 else float("nan")
            print(f"   {'':<20} kvtrace slowdown / empty-probe slowdown = {ratio:.2f}  goal <= "
                  f"{UNCACHED_GOAL_RATIO} ({verdict(ratio <= UNCACHED_GOAL_RATIO)})")
            results["uncached_ratio"] = ratio
        else:
            print(f"   {'':<20} kvtrace slowdown {slowdown['kvtrace'] * 100:+.2f} %  goal <= "
                  f"{CACHED_GOAL_SLOWDOWN * 100:.1f} % ({verdict(slowdown['kvtrace'] <= CACHED_GOAL_SLOWDOWN)})")
        results[f"slowdown_{mode}"] = slowdown
    idle = results["agent_idle_core_fraction"]
    print(f"3. agent: idle {idle * 100:.2f} % of a core (goal <= {IDLE_GOAL_CORE_FRACTION * 100:.0f} %, "
          f"{verdict(idle <= IDLE_GOAL_CORE_FRACTION)}), "
          f"while generating {results['agent_busy_core_fraction'] * 100:.1f} %"
          f"; RSS idle {results['agent_rss_idle_bytes'] / 2**20:.0f} MiB, after generating "
          f"{results['agent_rss_busy_bytes'] / 2**20:.0f} MiB")
    counters = results["agent_counters"]
    print("   agent counters: " + ", ".join(f"{k} {v}" for k, v in sorted(counters.items())))


if __name__ == "__main__":
    sys.exit(main())
