"""What a PyTorch block costs through kvtrace's hook inside the process, beside the uprobe trap it would replace.

Run as root on the GPU machine: `bash tests/gpu/run.sh block-hook-cost` (real torch; the hook is built there against
that torch, or `--library PATH` loads one built elsewhere for the same torch).

At depth blocks today each pytorch:malloc/free traps into the kernel: 0.5-0.7 us a hit on the H100 before kvtrace's
program runs (bench/RESULTS.md §K), more than issue 34's 3 % of a generation loop. The hook
(agent/kvtrace/sources/torch_hook) hears the blocks from the caching allocator's trace tracker and hands them to the
kernel in batches through one USDT site, kvtrace:blocks, which a uprobe sits on. This bench times the worker's
loop of `torch.empty(4096, device="cuda")` + `del` pairs (cache hits: no CUDA call) in one torch process, a
`--blocks never` agent beside it throughout (a busy process beside keeps the CPUs out of deep idle, as in every
depth bench). The allocator cannot detach a tracker, so there are two phases, rounds rotated within each:

 before the hook is attached
  none     nothing on the allocator's path (the pair's own cost)
  traps    an empty BPF program on pytorch:malloc/free, semaphores raised (benchlib.torch_traps): today's trap
 after it is attached
  idle     the hook's semaphore down: what a process keeps paying once it was raised (the tracker is called, returns)
  batched  an empty program on kvtrace:blocks (semaphore raised): batches of 32, stacks sampled at 512 KiB
  ledger   a program on kvtrace:blocks that reads the batch and keeps a hash of live blocks (insert at
           allocation, delete at free): the map work an in-kernel ledger does, in a prototype program (not kvtrace's
           own; its totals, counters and stack walks are not in it)
  each     batch 1, the empty program: a trap per event (what batching saves)
  traps2   the per-block trap again, the hook attached and idle (so that phase two compares within itself)
  agent    a second agent, `--blocks always` (-p the worker): depth blocks as shipped, through the hook (the agent
           links its kvtrace:blocks site, not PyTorch's own): what a block really costs there

Checks (printed, and failing the run): the hook handed over every allocation and free of the loop (its counts), and
the ledger program saw as many entries as the hook flushed, with no free of an unknown block once the loop ran.
Per block = (role - base) ns a pair; projected onto a loop of --cpu-ns-per-token and --blocks-per-token (from
depth_overhead's control and counters), the share of a token's CPU.
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
for _path in (ROOT / "bench", ROOT / "tests", ROOT / "tests" / "gpu" / "workloads", ROOT / "agent"):
    sys.path.insert(0, str(_path))

from agent_process import AgentProcess  # noqa: E402
from benchlib import (  # noqa: E402
    code_version,
    hook_flush_probe,
    hook_seen_counts,
    median,
    progress,
    require_bpf,
    rotated,
    torch_traps,
)
from block_probe_cost import TorchPairs  # noqa: E402
from kvtrace.sources.torch_hook import BATCH_MAX  # noqa: E402

BEFORE = ("none", "traps")
AFTER = ("idle", "batched", "ledger", "each", "traps2", "agent")
SAMPLE_BYTES = 512 * 1024


class HookedWorker(TorchPairs):
    """block_probe_cost's torch worker and its pair loop, with the hook attached on demand."""

    def __init__(self, args) -> None:
        super().__init__(args)
        self.hook_library: Path | None = None

    @property
    def pid(self) -> int:
        return self.worker.pid

    def attach_hook(self) -> dict:
        answer = self.worker.send(timeout_seconds=600, op="torch_hook",
                                  **({"library": str(self.args.library)} if self.args.library else {}))
        self.hook_library = Path(answer["library"])
        return answer

    def hook_settings(self, batch: int, sample_bytes: int) -> None:
        self.worker.send(op="torch_hook_settings", batch=batch, sample_bytes=sample_bytes)

    def hook_counts(self) -> dict[str, int]:
        return self.worker.send(op="torch_hook_counts")["counts"]


def measure(worker: HookedWorker, role: str, checks: list[str], directory: Path) -> float:
    """One run of the pair loop under `role`; appends to `checks` what did not add up."""
    pairs = worker.args.pairs
    with contextlib.ExitStack() as stack:
        if role == "agent":
            worker.hook_settings(batch=BATCH_MAX, sample_bytes=SAMPLE_BYTES)  # as shipped (each leaves batch 1)
            agent = stack.enter_context(AgentProcess(directory / "blocks.sock", "-p", str(worker.pid), "--no-nvml",
                                                     "--blocks", "always"))
            time.sleep(worker.args.settle_seconds)
            before = worker.hook_counts()
            ns_per_pair = worker.pairs()
            after = worker.hook_counts()
            counters = agent.counters()
            flushed = after["entries"] - before["entries"]
            if flushed != 2 * pairs or counters.get("hook_entries_lost", 0) or counters.get("unknown_frees", 0) > 1:
                checks.append(f"agent: the hook flushed {flushed} entries for {pairs} pairs; the agent's counters "
                              f"hook_entries_lost {counters.get('hook_entries_lost')}, unknown_frees "
                              f"{counters.get('unknown_frees')}")
            progress(f"   agent: {after['flushes'] - before['flushes']} flushes, {after['walks'] - before['walks']} "
                     f"walks; counters {', '.join(f'{k} {v}' for k, v in sorted(counters.items()) if v)}")
            return ns_per_pair
        if role in ("traps", "traps2"):
            stack.enter_context(torch_traps(worker.pid))
            return worker.pairs()
        if role in ("none", "idle"):
            return worker.pairs()
        assert worker.hook_library is not None
        worker.hook_settings(batch=1 if role == "each" else BATCH_MAX, sample_bytes=SAMPLE_BYTES)
        bpf = stack.enter_context(hook_flush_probe(worker.hook_library, worker.pid,
                                              "ledger_flush" if role == "ledger" else "empty_flush"))
        before = worker.hook_counts()
        ns_per_pair = worker.pairs()
        after = worker.hook_counts()
        events = after["events"] - before["events"]
        flushed = after["entries"] - before["entries"]
        if events != 2 * pairs or flushed != events:
            checks.append(f"{role}: the hook heard {events} block events and flushed {flushed}, not 2 x {pairs}")
        if role == "ledger":
            seen = hook_seen_counts(bpf)
            # The one block alive across the probe's attach (allocated before, freed after) may be unknown.
            if seen["entries"] != flushed or seen["unknown_frees"] > 1:
                checks.append(f"ledger: the program saw {seen} for {flushed} entries flushed")
            progress(f"   ledger program: {seen}; hook: {after['flushes'] - before['flushes']} flushes, "
                     f"{after['walks'] - before['walks']} walks")
        return ns_per_pair


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pairs", type=int, default=200_000, help="tensor pairs a run")
    parser.add_argument("--depth", type=int, default=16, help="Python frames below the worker's loop")
    parser.add_argument("--settle-seconds", type=float, default=2.0, help="agent role: wait after its start")
    parser.add_argument("--library", type=Path, help="a hook library built for this torch (default: build it)")
    parser.add_argument("--cpu-ns-per-token", type=float, default=669_000,
                        help="a generation loop's CPU ns a token (depth_overhead's control; 669 us on the H100, §K)")
    parser.add_argument("--blocks-per-token", type=float, default=44.0,
                        help="its blocks a token (depth_overhead's counters; about 44 on the H100, §K)")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    require_bpf()
    results: dict = {"version": code_version(), "machine": os.uname().nodename,
                     "date": time.strftime("%Y-%m-%d %H:%M"), "args": {k: str(v) for k, v in vars(args).items()}}
    ns_per_pair: dict[str, list[float]] = {role: [] for role in BEFORE + AFTER}
    checks: list[str] = []
    with tempfile.TemporaryDirectory(prefix="kvtrace-hook-cost-") as name:
        progress("starting the torch worker")
        worker = HookedWorker(args)
        try:
            with AgentProcess(Path(name) / "agent.sock", "-p", str(worker.pid), "--no-nvml", "--blocks", "never"):
                for phase, roles in (("before", BEFORE), ("after", AFTER)):
                    if phase == "after":
                        built = worker.attach_hook()
                        results["hook"] = built
                        progress(f"hook attached: {built['library']} (built in {built['build_seconds']:.1f} s)")
                    for round_index in range(args.rounds):
                        for role in rotated(roles, round_index):
                            ns_per_pair[role].append(measure(worker, role, checks, Path(name)))
                        progress(f"{phase} round {round_index + 1}/{args.rounds}: " + ", ".join(
                            f"{role} {ns_per_pair[role][-1]:.0f}" for role in roles) + " ns/pair")
        finally:
            worker.close()
    results["ns_per_pair"] = ns_per_pair
    results["checks_failed"] = checks
    report(results, args)
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=1))
    return 1 if checks else 0


def report(results: dict, args) -> None:
    pairs = results["ns_per_pair"]
    # Added ns a block (a pair is one block's allocation and free), each round against its phase's base.
    added = {role: [value - base for value, base in zip(pairs[role], pairs["none"], strict=True)]
             for role in ("traps", "idle")}
    added.update({role: [value - base for value, base in zip(pairs[role], pairs["idle"], strict=True)]
                  for role in AFTER[1:]})
    results["added_ns_per_block"] = {role: median(values) for role, values in added.items()}
    print(f"block hook cost (torch, {args.pairs} pairs a run, {args.rounds} rounds a phase), {results['date']}, "
          f"{results['machine']}; measured: {results['version']}")
    print(f"   {'role':<8} {'ns/pair':>8} {'added ns a block':>17}  against  rounds")
    for role in BEFORE + AFTER:
        base = "" if role == "none" else ("none" if role in ("traps", "idle") else "idle")
        rounds = " ".join(f"{value:.0f}" for value in added.get(role, []))
        value = results["added_ns_per_block"].get(role)
        print(f"   {role:<8} {median(pairs[role]):>8.0f} {'' if value is None else f'{value:>17.0f}':>17}  {base:<7}  "
              f"[{rounds}]")
    share = {role: args.blocks_per_token * value / args.cpu_ns_per_token
             for role, value in results["added_ns_per_block"].items()}
    # The hook's whole cost at depth blocks is its idle cost plus the batch path's, both against `none`.
    share["hook+ledger (idle + ledger)"] = share["idle"] + share["ledger"]
    results["projected_share"] = share
    print(f"   projected onto a loop of {args.cpu_ns_per_token / 1000:.0f} us CPU and "
          f"{args.blocks_per_token:.0f} blocks a token: "
          + ", ".join(f"{role} {value * 100:.2f} %" for role, value in share.items()))
    for failure in results["checks_failed"]:
        print(f"   CHECK FAILED: {failure}")


if __name__ == "__main__":
    sys.exit(main())
