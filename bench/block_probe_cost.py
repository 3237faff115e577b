"""What one PyTorch block costs at each depth, split into the trap and kvtrace's program.

Run as root: on the GPU machine `bash tests/gpu/run.sh block-probe-cost` (real torch), here
`.venv/bin/python bench/block_probe_cost.py --workload stub` (the stub allocator of tests/integration).

Every tensor the caching allocator hands out and takes back fires pytorch:malloc and pytorch:free. At
depth segments their semaphores are zero and the sites cost nothing; at depth blocks each one traps
into the kernel (a uprobe) and runs kvtrace's program, in the engine's own thread. This bench times a
loop of `torch.empty(4096, device="cuda")` + `del` pairs (each a cache hit: two probe hits, no CUDA
call) under four roles, each round in a rotated order, an agent started and stopped around each:

  never   `kvtrace agent -p PID --blocks never`: the sites off (the control)
  traps   the same agent, and an empty BPF program on the same sites with their semaphores raised
          (benchlib.torch_traps): the trap alone, what any uprobe-based design pays per block
  blocks  `--blocks always`: depth blocks as shipped (stacks sampled, quiet blocks)
  full    `--blocks always --block-sample-bytes 0 --max-block-events-per-second 0`: every block's stack walked
          (the default limit of 100 000 block events a second would leave most of this loop's stacks unwalked)

Then per hit (a pair is two): trap = (traps - never) / 2, program = (blocks - traps) / 2; and, with
kernel.bpf_stats_enabled=1 for one more pass per role, the time inside the program that ran twice a pair
(the kernel's own count, no wall-clock noise). --ns-per-token and --hits-per-token project the per-hit
cost onto a generation loop: cost = hits x ns per hit / ns a token (a loop's ns a token from its tokens/s; its hits,
twice its blocks, from the blocks_sampled and blocks_not_sampled counters of bench/depth_overhead.py's --json-out,
over the tokens its agent saw).

--workload stub: the same roles around tests/integration's stub allocator (torch_workload loop N, a C
loop: no Python, so no stack is walked and `full` is left out), a fresh process a run.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT / "bench", ROOT / "tests", ROOT / "tests" / "integration", ROOT / "tests" / "gpu" / "workloads",
              ROOT / "agent"):
    sys.path.insert(0, str(_path))

from agent_process import AgentProcess  # noqa: E402
from benchlib import (  # noqa: E402
    Workload,
    bpf_stats,
    build_stubs,
    code_version,
    median,
    process_program_stats,
    progress,
    require_bpf,
    rotated,
    torch_traps,
)

ROLES = ("never", "traps", "blocks", "full")
AGENT_FLAGS = {
    "never": ("--blocks", "never"),
    "traps": ("--blocks", "never"),
    "blocks": ("--blocks", "always"),
    "full": ("--blocks", "always", "--block-sample-bytes", "0", "--max-block-events-per-second", "0"),
}


class TorchPairs:
    """A torch worker's tensor_pairs loop (tests/gpu/workloads/torch_worker.py), one process throughout."""

    roles = ROLES

    def __init__(self, args) -> None:
        from worker_client import TorchWorker

        self.args = args
        self.worker = TorchWorker({})
        try:
            self.worker.send(op="init")
            self.pairs()  # the first block makes the segment; every later one is a cache hit
        except BaseException:
            self.close()
            raise

    @contextlib.contextmanager
    def process(self):
        yield self.worker.pid

    def pairs(self, _pid: int | None = None) -> float:
        return self.worker.send(timeout_seconds=600, op="tensor_pairs", count=self.args.pairs,
                                depth=self.args.depth)["ns_per_pair"]

    def close(self) -> None:
        self.worker.process.kill()


class StubPairs:
    """tests/integration's stub allocator (a C loop of 4 KiB malloc + free), a fresh process a run."""

    roles = tuple(role for role in ROLES if role != "full")  # no Python: no stack to walk

    def __init__(self, args, directory: Path) -> None:
        from torch_stubs import build_torch_stub

        self.args = args
        self.build = build_torch_stub(directory, build_stubs(directory))
        self._running: Workload | None = None

    @contextlib.contextmanager
    def process(self):
        with Workload([self.build.workload, "loop", str(self.args.pairs)]) as workload:
            self._running = workload
            try:
                yield workload.wait_ready()
            finally:
                self._running = None

    def pairs(self, _pid: int | None = None) -> float:
        workload = self._running
        assert workload is not None
        workload.go()
        return next(line["ns_per_pair"] for line in workload.read_calls(timeout_s=600) if "ns_per_pair" in line)

    def close(self) -> None:
        pass


def measure(workload, role: str, directory: Path, settle_seconds: float, with_stats: bool) -> dict:
    """One run of the pair loop under the role's agent: ns per pair, and with_stats the busiest program's
    ns per run (kernel.bpf_stats_enabled=1 during that run only)."""
    with workload.process() as pid:
        with AgentProcess(directory / f"{role}.sock", "-p", str(pid), "--no-nvml", *AGENT_FLAGS[role]) as agent:
            time.sleep(settle_seconds)
            with contextlib.ExitStack() as stack:
                if role == "traps":
                    stack.enter_context(torch_traps(pid))
                if not with_stats:
                    return {"ns_per_pair": workload.pairs(pid)}
                stack.enter_context(bpf_stats())
                holders = [agent.process.pid, os.getpid()] if role == "traps" else [agent.process.pid]
                before = {key: value for holder in holders for key, value in process_program_stats(holder).items()}
                ns_per_pair = workload.pairs(pid)
                after = {key: value for holder in holders for key, value in process_program_stats(holder).items()}
            runs = {key: (after[key][0] - before.get(key, (0, 0))[0], after[key][1] - before.get(key, (0, 0))[1])
                    for key in after}
            busiest = max(runs.values(), key=lambda value: value[1], default=(0, 0))
            if abs(busiest[1] - 2 * workload.args.pairs) > 0.01 * workload.args.pairs:
                progress(f"bpf_stats {role}: the busiest program ran {busiest[1]} times, not 2 x {workload.args.pairs}"
                         ": something else fired too, or the probes missed hits; its time is not the probe's alone")
            return {"ns_per_pair": ns_per_pair, "program_runs": busiest[1],
                    "program_ns_per_run": busiest[0] / busiest[1] if busiest[1] else 0.0}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=("torch", "stub"), default="torch")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pairs", type=int, default=200_000, help="tensor (or stub block) pairs a run")
    parser.add_argument("--depth", type=int, default=16, help="torch: Python frames below the worker's loop")
    parser.add_argument("--settle-seconds", type=float, default=2.0)
    parser.add_argument("--ns-per-token", type=float, help="a generation loop's ns a token (depth_overhead's control)")
    parser.add_argument("--hits-per-token", type=float, help="its probe hits (pytorch:malloc + free) a token")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    require_bpf()
    results: dict = {"version": code_version(), "machine": os.uname().nodename,
                     "date": time.strftime("%Y-%m-%d %H:%M"), "args": {k: str(v) for k, v in vars(args).items()}}
    with tempfile.TemporaryDirectory(prefix="kvtrace-block-cost-") as name:
        directory = Path(name)
        progress(f"starting the {args.workload} workload")
        workload = TorchPairs(args) if args.workload == "torch" else StubPairs(args, directory)
        roles = workload.roles
        ns_per_pair: dict[str, list[float]] = {role: [] for role in roles}
        program: dict[str, list[float]] = {role: [] for role in roles}
        program_runs: dict[str, int] = {}
        try:
            for round_index in range(args.rounds):
                for role in rotated(roles, round_index):
                    ns_per_pair[role].append(measure(workload, role, directory, args.settle_seconds, False)
                                             ["ns_per_pair"])
                progress(f"round {round_index + 1}/{args.rounds}: " + ", ".join(
                    f"{role} {values[-1]:.0f}" for role, values in ns_per_pair.items()) + " ns/pair")
            for role in roles[1:]:  # one pass each with the kernel counting the programs' time
                seen = measure(workload, role, directory, args.settle_seconds, True)
                program[role] = [seen["program_ns_per_run"]]
                program_runs[role] = seen["program_runs"]
                progress(f"bpf_stats {role}: {seen['program_runs']} runs of the busiest program, "
                         f"{seen['program_ns_per_run']:.0f} ns a run")
        finally:
            workload.close()
    results["ns_per_pair"] = ns_per_pair
    results["program_ns_per_run"] = {role: values[0] for role, values in program.items() if values}
    results["program_runs"] = program_runs
    report(results, args)
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=1))
    return 0


def report(results: dict, args) -> None:
    pairs = results["ns_per_pair"]
    roles = list(pairs)
    # Added ns a hit, each round against that round's control; medians of rounds.
    added = {role: [(value - control) / 2 for value, control in zip(pairs[role], pairs["never"], strict=True)]
             for role in roles[1:]}
    results["added_ns_per_hit"] = {role: median(values) for role, values in added.items()}
    print(f"block probe cost ({args.workload}, {args.pairs} pairs a run, {args.rounds} rounds), {results['date']}, "
          f"{results['machine']}; measured: {results['version']}")
    print(f"   {'role':<7} {'ns/pair':>8} {'added ns a hit':>15}  rounds' added ns a hit"
          "  ns a run of the program on the sites (bpf_stats; traps: the empty one)")
    print(f"   {'never':<7} {median(pairs['never']):>8.0f}")
    for role in roles[1:]:
        rounds = " ".join(f"{value:.0f}" for value in added[role])
        stats = results["program_ns_per_run"].get(role)
        print(f"   {role:<7} {median(pairs[role]):>8.0f} {results['added_ns_per_hit'][role]:>15.0f}  [{rounds}]"
              f"   {'' if stats is None else f'{stats:.0f}'}")
    trap = results["added_ns_per_hit"]["traps"]
    blocks = results["added_ns_per_hit"]["blocks"]
    stats = results["program_ns_per_run"]
    print(f"   a block's hit at depth blocks: {blocks:.0f} ns = the trap {trap:.0f} ns + kvtrace's program "
          f"{blocks - trap:.0f} ns (by difference; bpf_stats: {stats.get('blocks', 0) - stats.get('traps', 0):.0f} ns "
          "above the empty program)")
    if args.ns_per_token and args.hits_per_token:
        results["projected_cost"] = {role: args.hits_per_token * value / args.ns_per_token
                                     for role, value in results["added_ns_per_hit"].items()}
        print(f"   projected onto a loop of {args.ns_per_token:.0f} ns and {args.hits_per_token:.1f} hits a token: "
              + ", ".join(f"{role} {cost * 100:.1f} %" for role, cost in results["projected_cost"].items()))


if __name__ == "__main__":
    sys.exit(main())
