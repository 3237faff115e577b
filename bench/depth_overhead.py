"""What each depth costs a torch generation loop: one process, the agent started and stopped around rounds.

Run as root on the GPU machine (bash tests/gpu/run.sh depth-bench).

One torch worker (tests/gpu/workloads/torch_worker.py) holds an 8-layer random Llama and generates
(batch 8, 256 prompt + --new-tokens tokens, --calls calls a run). Each round runs every role once, the
order rotated each round; a role starts its own agent following the worker (-p), measures one run, and
stops the agent. The same process throughout: only tracing differs. The control is an agent that traces
no blocks (`--blocks never`), not no agent: a busy process beside keeps the CPUs out of deep idle, and
a launch-bound loop ran 10-35 % faster with one than alone on the H100.

Roles (cost = 1 - tokens/s / control's tokens/s of the same round; medians over rounds; the same runs are also
reported by the workload's own CPU a token, user + system, and system alone: a uprobe's trap and its BPF program
are kernel time on the workload's behalf, which idle states and scheduling move less than wall-clock tokens/s):
  control  `kvtrace agent -p PID --blocks never`
  floor    the same as control, a second time: its "cost" is the noise floor of the round
  auto     `kvtrace agent -p PID` as shipped: --blocks auto; nothing raises this healthy loop, so it stays
           at depth segments (its PyTorch semaphores at zero). Goal: <= 1 %.
  blocks   `--blocks always`: depth blocks, block stacks sampled (--block-sample-bytes, default 512 KiB).
           Goal: <= 3 %.
  traps    the control's agent, and an empty BPF program on PyTorch's allocator probe sites with their
           semaphores raised (benchlib.torch_traps): what every block's trap costs before any program does
           anything, the floor of any uprobe-based depth blocks (bench/block_probe_cost.py splits it per hit)
  full     `--blocks always --block-sample-bytes 0`: every block's stack (what the agent did before depth).
  history  PyTorch's own torch.cuda.memory._record_memory_history(enabled="all"), a control agent beside.
  state    PyTorch's recorder at its cheapest: enabled="state", context="state", stacks="python" (only the
           live blocks' Python stacks, what `kvtrace run` could read from inside), a control agent beside.

--workload vllm: the same roles around one real vLLM 0.24 engine (tests/gpu/workloads/vllm_engine.py, random
8-layer Llama, no sleep mode; `--graphs` with CUDA graphs, else enforce_eager) with the kvtrace plugin inside it
reporting to each agent (the default agent's vLLM side on); each run is `throughput --prompts --new-tokens`,
the agent following the engine's processes (the driver and its EngineCore). Needs the vLLM bundle
(bash tests/gpu/run.sh vllm-depth-bench ...).

--hook (torch): the worker attaches kvtrace's PyTorch hook (agent/kvtrace/sources/torch_hook) at its start, so that
depth blocks and full go through the hook's batches (kvtrace:blocks) instead of a trap on every pytorch:malloc/free;
traps still times the per-block trap on PyTorch's own sites. Every role then pays the attached hook's idle cost (the
allocator cannot detach a tracker): bench/block_hook_cost.py measures that part apart.

--best-of K: K runs under each role's agent, the fastest (by tokens/s) kept: a run is only ever slowed by what else
the machine does, so the fastest of a few is the quieter figure. Only the kept run's figures are reported; the
agent's CPU, the workload's context switches and the counters then cover all K runs.

Run: bash tests/gpu/run.sh depth-bench [--rounds 5] [--new-tokens 128] [--calls 4] [--settle-seconds 10]
         [--best-of 1] [--json-out FILE]
     bash tests/gpu/run.sh vllm-depth-bench --workload vllm [--graphs] [--prompts 64] [--new-tokens 128]
     either with [--roles floor,auto] [--pin-workload 0-7 --pin-agents 8-15] [--profile-agents DIR]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import psutil

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT / "bench", ROOT / "tests", ROOT / "tests" / "gpu" / "workloads", ROOT / "agent"):
    sys.path.insert(0, str(_path))

from worker_client import TorchWorker  # noqa: E402

from agent_process import AgentProcess  # noqa: E402
from benchlib import (  # noqa: E402
    NoTorchSites,
    code_version,
    median,
    parse_cpus,
    progress,
    require_bpf,
    rotated,
    set_masks,
    torch_traps,
)
from vllm_overhead import Engine, plugin_site  # noqa: E402

ROLES = ("control", "floor", "auto", "blocks", "traps", "full", "history", "state")
AGENT_FLAGS = {
    "control": ("--blocks", "never"),
    "floor": ("--blocks", "never"),
    "auto": (),
    "blocks": ("--blocks", "always"),
    "traps": ("--blocks", "never"),
    "full": ("--blocks", "always", "--block-sample-bytes", "0"),
    "history": ("--blocks", "never"),
    "state": ("--blocks", "never"),
}
RECORDER_MODES = {"history": "all", "state": "state"}  # roles with PyTorch's own recorder on
GOALS = {"auto": 0.01, "blocks": 0.03}
BLOCK_COUNTERS = ("blocks_sampled", "blocks_not_sampled", "stack_walks", "events_submitted")


class CpuSeconds(NamedTuple):
    user: float
    system: float  # the kernel's time on the workload's behalf: where a uprobe's trap and its BPF program count


def cpu_seconds(pids: list[int]) -> CpuSeconds:
    """User and system CPU of the processes, all their threads."""
    times = [psutil.Process(pid).cpu_times() for pid in pids]
    return CpuSeconds(sum(t.user for t in times), sum(t.system for t in times))


class Run(NamedTuple):
    tokens: int
    seconds: float
    cpu_before: CpuSeconds  # the workload's, around the run
    cpu_after: CpuSeconds

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds

    @property
    def cpu_us_per_token(self) -> float:
        return (sum(self.cpu_after) - sum(self.cpu_before)) * 1e6 / self.tokens

    @property
    def system_us_per_token(self) -> float:
        return (self.cpu_after.system - self.cpu_before.system) * 1e6 / self.tokens


class TorchLoop:
    """The torch worker's generation loop."""

    roles = ROLES

    def __init__(self, args) -> None:
        self.args = args
        self.worker = TorchWorker({})
        self.worker.send(op="init")
        self.worker.send(timeout_seconds=600, op="llama_load")
        self.worker.send(timeout_seconds=600, op="generate", batch=8, prompt=256, new_tokens=args.new_tokens, calls=1)
        if args.hook:
            attached = self.worker.send(timeout_seconds=600, op="torch_hook",
                                        **({"library": str(args.hook_library)} if args.hook_library else {}))
            progress(f"kvtrace's PyTorch hook attached in the worker: {attached['library']} "
                     f"(built in {attached['build_seconds']:.1f} s)")

    def pids(self) -> list[int]:
        return [self.worker.pid]

    def record_history(self, mode: str | None) -> None:
        self.worker.send(op="record_history", enabled=mode is not None, mode=mode)

    def run(self) -> Run:
        """One run, after a short one (the agent's first stacks are symbolized meanwhile)."""
        self.worker.send(timeout_seconds=600, op="generate", batch=8, prompt=256, new_tokens=8, calls=1)
        before = cpu_seconds(self.pids())
        answer = self.worker.send(timeout_seconds=600, op="generate", batch=8, prompt=256,
                                  new_tokens=self.args.new_tokens, calls=self.args.calls)
        return Run(answer["tokens"], answer["seconds"], before, cpu_seconds(self.pids()))

    def close(self) -> None:
        self.worker.process.kill()


class VllmEngineLoop:
    """One vLLM engine with the kvtrace plugin inside, reporting to whichever agent runs (one socket path)."""

    # PyTorch's recorder would have to start inside EngineCore: not compared here
    roles = tuple(role for role in ROLES if role not in RECORDER_MODES)

    def __init__(self, args, directory: Path) -> None:
        self.args = args
        self.plugin_socket = directory / "vllm-plugin.sock"
        env = dict(os.environ, KVTRACE_TEST_SLEEP_MODE="0", KVTRACE_TEST_ENFORCE_EAGER="0" if args.graphs else "1",
                   KVTRACE_VLLM_PLUGIN="1", KVTRACE_VLLM_SOCKET=str(self.plugin_socket),
                   PYTHONPATH=os.pathsep.join([str(plugin_site(directory / "site")), os.environ.get("PYTHONPATH", "")]))
        self.engine = Engine("graphs" if args.graphs else "eager", env)
        self.engine.expect("ready", timeout_seconds=600)
        self.run()  # warm-up

    def pids(self) -> list[int]:
        return self.engine.pids()

    def agent_args(self) -> tuple[str, ...]:
        return ("--vllm-socket", str(self.plugin_socket))

    def run(self) -> Run:
        before = cpu_seconds(self.pids())
        answer = json.loads(self.engine.command(f"throughput {self.args.prompts} {self.args.new_tokens}", "throughput"))
        return Run(answer["tokens"], answer["seconds"], before, cpu_seconds(self.pids()))

    def close(self) -> None:
        self.engine.close()


class AgentSeen(NamedTuple):
    """What one role's agent did around its run (all K runs with --best-of): where a role costs more than another
    that traces the same probes, these say whether the agent itself (its CPU, its decisions, its events) differed."""

    counters: dict[str, int]  # every counter after the run
    cpu_settle_seconds: float  # the agent's CPU (user + system) while settling, and during the run
    cpu_run_seconds: float
    workload_switches: tuple[int, int]  # the workload's voluntary and involuntary context switches in the run
    depth_lines: list[str]  # the agent's log lines about depths (a raise would show here)


def context_switches(pids: list[int]) -> tuple[int, int]:
    switches = [psutil.Process(pid).num_ctx_switches() for pid in pids]
    return sum(s.voluntary for s in switches), sum(s.involuntary for s in switches)


def start_profiler(pid: int, to: Path) -> subprocess.Popen | None:
    """py-spy sampling `pid` (without pausing it) into `to` (collapsed stacks) until stop_profiler; None without
    py-spy (said once)."""
    spy = shutil.which("py-spy") or next((str(path) for path in Path("/tmp/kvtrace-site/bin").glob("py-spy")), None)
    if spy is None:
        progress("--profile-agents: no py-spy here (pip install py-spy, or its wheel in .whl/): not profiled")
        return None
    return subprocess.Popen([spy, "record", "--nonblocking", "--format", "raw", "--rate", "50", "-o", str(to),
                             "-p", str(pid)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop_profiler(profiler: subprocess.Popen) -> None:
    profiler.send_signal(signal.SIGINT)  # py-spy writes what it sampled and exits
    try:
        profiler.wait(timeout=30)
    except subprocess.TimeoutExpired:
        profiler.kill()


def one_run(workload, role: str, directory: Path, settle_seconds: float,
            agent_cpus: set[int] | None = None, profile_to: Path | None = None,
            best_of: int = 1) -> tuple[Run, AgentSeen]:
    """The fastest of `best_of` runs under the role's agent, and what the agent did. The runs start
    `settle_seconds` after the agent said it traces: its start-up (reading libraries, compiling, the first
    analyses) is not what an agent left running costs."""
    pids = [arg for pid in workload.pids() for arg in ("-p", str(pid))]
    agent = AgentProcess(directory / f"{role}.sock", *pids, "--no-nvml", *getattr(workload, "agent_args", tuple)(),
                         *AGENT_FLAGS[role])
    if agent_cpus:
        set_masks([agent.process.pid], agent_cpus)
    agent_process = psutil.Process(agent.process.pid)
    # Closed last to first: the traps' links, PyTorch's recorder, then the agent, each whatever the one before did.
    cleanup = contextlib.ExitStack()
    cleanup.callback(agent.stop)
    try:
        if role == "traps":
            sites = 0
            for pid in workload.pids():
                with contextlib.suppress(NoTorchSites):  # (a vLLM driver without CUDA: nothing to trap there)
                    sites += cleanup.enter_context(torch_traps(pid))
            if not sites:
                raise RuntimeError("traps: no process of the workload has PyTorch's allocator probe sites")
        started = sum(agent_process.cpu_times()[:2])
        time.sleep(settle_seconds)
        if role in RECORDER_MODES:
            workload.record_history(RECORDER_MODES[role])
            cleanup.callback(workload.record_history, None)
        settled = sum(agent_process.cpu_times()[:2])
        switches_before = context_switches(workload.pids())
        profiler = start_profiler(agent.process.pid, profile_to) if profile_to else None
        try:
            run = max((workload.run() for _ in range(best_of)), key=lambda one: one.tokens_per_second)
        finally:
            if profiler is not None:
                stop_profiler(profiler)
        ran = sum(agent_process.cpu_times()[:2])
        switches_after = context_switches(workload.pids())
        counters = agent.counters()
    finally:
        cleanup.close()
    depth_lines = [line[-300:] for line in agent.stderr_text().splitlines() if ": depth " in line][:20]
    return run, AgentSeen(counters, settled - started, ran - settled,
                          (switches_after[0] - switches_before[0], switches_after[1] - switches_before[1]),
                          depth_lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per call (batch 8)")
    parser.add_argument("--calls", type=int, default=4,
                        help="generate calls per run (2 was noise on the H100: bench/RESULTS.md §K)")
    parser.add_argument("--json-out", type=Path, help="also write every figure here as JSON")
    parser.add_argument("--workload", choices=("torch", "vllm"), default="torch")
    parser.add_argument("--graphs", action="store_true", help="vllm: CUDA graphs (default: enforce_eager)")
    parser.add_argument("--prompts", type=int, default=64, help="vllm: prompts of 64 tokens per run")
    parser.add_argument("--roles", type=lambda text: [role for role in text.split(",") if role],
                        help=f"comma-separated roles to run (control always runs): of {','.join(ROLES)}")
    parser.add_argument("--pin-workload", type=parse_cpus, metavar="CPUS",
                        help="taskset-style list: the workload's threads on these CPUs (fewer migrations, less noise)")
    parser.add_argument("--pin-agents", type=parse_cpus, metavar="CPUS",
                        help="taskset-style list: each agent's threads on these CPUs (away from the workload's)")
    parser.add_argument("--settle-seconds", type=float, default=5.0,
                        help="wait this long after each agent started before the run (its start-up apart)")
    parser.add_argument("--best-of", type=int, default=1, metavar="K",
                        help="K runs under each role's agent, the fastest kept (what else the machine does only ever "
                             "slows a run); the agent's figures then cover all K")
    parser.add_argument("--hook", action="store_true",
                        help="torch: kvtrace's PyTorch hook in the worker (depth blocks through its batches)")
    parser.add_argument("--hook-library", type=Path,
                        help="with --hook: a hook library built for this torch (default: the worker builds it)")
    parser.add_argument("--profile-agents", type=Path, metavar="DIR",
                        help="py-spy each agent during its run (not paused: --nonblocking), collapsed stacks in DIR")
    args = parser.parse_args()
    if args.best_of < 1:
        parser.error(f"--best-of must be at least 1, not {args.best_of}")
    if args.profile_agents:
        args.profile_agents.mkdir(parents=True, exist_ok=True)
    roles = (TorchLoop if args.workload == "torch" else VllmEngineLoop).roles
    if args.roles:
        unknown = set(args.roles) - set(roles)
        if unknown:
            parser.error(f"--roles: {', '.join(sorted(unknown))} not among {', '.join(roles)}")
        roles = ("control", *(role for role in roles if role in args.roles and role != "control"))
    require_bpf()
    results: dict = {"version": code_version(), "machine": os.uname().nodename,
                     "date": time.strftime("%Y-%m-%d %H:%M"), "args": {k: str(v) for k, v in vars(args).items()}}
    with tempfile.TemporaryDirectory(prefix="kvtrace-depth-") as directory:
        progress(f"starting the {args.workload} workload (model load + warm-up)")
        workload = TorchLoop(args) if args.workload == "torch" else VllmEngineLoop(args, Path(directory))
        if args.pin_workload:
            set_masks(workload.pids(), args.pin_workload)
        tokens_per_second: dict[str, list[float]] = {role: [] for role in roles}
        tokens: dict[str, list[int]] = {role: [] for role in roles}  # generated in each kept run
        cpu_per_token: dict[str, list[float]] = {role: [] for role in roles}  # µs of the workload's CPU a token
        system_per_token: dict[str, list[float]] = {role: [] for role in roles}  # of which in the kernel
        counters: dict[str, list[dict[str, int]]] = {role: [] for role in roles}
        agents: dict[str, list[dict]] = {role: [] for role in roles}  # what each run's agent did (AgentSeen)
        try:
            for round_index in range(args.rounds):
                for role in rotated(roles, round_index):
                    profile_to = (args.profile_agents / f"{role}-{round_index + 1}.txt" if args.profile_agents
                                  else None)
                    run, seen = one_run(workload, role, Path(directory), args.settle_seconds, args.pin_agents,
                                        profile_to, args.best_of)
                    tokens[role].append(run.tokens)
                    tokens_per_second[role].append(run.tokens_per_second)
                    cpu_per_token[role].append(run.cpu_us_per_token)
                    system_per_token[role].append(run.system_us_per_token)
                    counters[role].append({name: seen.counters.get(name, 0) for name in BLOCK_COUNTERS})
                    agents[role].append(seen._asdict())
                progress(f"round {round_index + 1}/{args.rounds}: " + ", ".join(
                    f"{role} {values[-1]:.0f}" for role, values in tokens_per_second.items()) + " tokens/s")
        finally:
            workload.close()
    results["tokens_per_second"] = tokens_per_second
    results["tokens"] = tokens
    results["cpu_us_per_token"] = cpu_per_token
    results["system_us_per_token"] = system_per_token
    results["counters"] = counters
    results["agents"] = agents
    report(results)
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=1))
    sys.stdout.flush()
    return 0


def report(results: dict) -> None:
    tps = results["tokens_per_second"]
    roles = list(tps)
    cost = {role: [1 - v / c for v, c in zip(tps[role], tps["control"], strict=True)] for role in roles[1:]}
    results["cost"] = {role: median(values) for role, values in cost.items()}
    print(f"depth overhead ({results['args']['workload']}{' graphs' if results['args']['graphs'] == 'True' else ''}"
          f"{', through kvtrace PyTorch hook' if results['args'].get('hook') == 'True' else ''}), "
          f"{results['date']}, {results['machine']}; measured: {results['version']}")
    print(f"   {'role':<8} {'tokens/s':>9} {'cost':>8}  rounds' costs                     agent counters (last run)")
    print(f"   {'control':<8} {median(tps['control']):>9.0f}")
    # The floor (control against control) says how far apart two identical agents' rounds fall: where its
    # rounds spread wider than a goal, no median of this run can say that goal was met.
    floor_spread = max((abs(value) for value in cost.get("floor", [])), default=None)
    results["floor_spread"] = floor_spread
    for role in roles[1:]:
        goal, measured = GOALS.get(role), results["cost"][role]
        if goal is None:
            verdict = ""
        elif floor_spread is not None and floor_spread > goal:
            verdict = f"  goal <= {goal * 100:.0f} %: not resolved (floor's rounds reach {floor_spread * 100:.1f} %)"
        else:
            verdict = f"  goal <= {goal * 100:.0f} % ({'met' if measured <= goal else 'MISSED'})"
        rounds = " ".join(f"{value * 100:+.1f}" for value in cost[role])
        last = ", ".join(f"{k} {v}" for k, v in results["counters"][role][-1].items() if v)
        print(f"   {role:<8} {median(tps[role]):>9.0f} {measured * 100:>7.2f}%  [{rounds}] {last}{verdict}")
    # What each role's agent did: its CPU while settling and during the run, the workload's context switches in the
    # run (involuntary ones: preempted), and any depth it logged. Two roles that trace the same probes should match.
    agents = results.get("agents") or {}
    if agents:
        print("   agents (medians of rounds): CPU s settling / in the run, workload switches voluntary / involuntary, "
              "depth lines (all runs)")
        for role in roles:
            seen = agents.get(role) or []
            if not seen:
                continue
            lines = sorted({line for one in seen for line in one["depth_lines"]})
            print(f"   {role:<8} {median([one['cpu_settle_seconds'] for one in seen]):>6.2f} / "
                  f"{median([one['cpu_run_seconds'] for one in seen]):>6.2f} s  "
                  f"{median([one['workload_switches'][0] for one in seen]):>8.0f} / "
                  f"{median([one['workload_switches'][1] for one in seen]):>6.0f}  "
                  f"{len(lines)} depth lines{': ' + lines[0] if lines else ''}")
        # Counters where a role's last run differs from the floor's (or the control's) by more than a tenth.
        base = "floor" if agents.get("floor") else "control"
        for role in roles:
            if role == base or not agents.get(role) or not agents.get(base):
                continue
            mine, theirs = agents[role][-1]["counters"], agents[base][-1]["counters"]
            differ = [f"{name} {theirs.get(name, 0)}->{value}" for name, value in sorted(mine.items())
                      if abs(value - theirs.get(name, 0)) > max(100, 0.1 * abs(theirs.get(name, 0)))]
            if differ:
                print(f"   {role} vs {base}, counters of the last run: {', '.join(differ[:12])}")
    # The same runs by the workload's own CPU a token: a uprobe's trap and its BPF program are the kernel's time on
    # the workload's behalf (system), which wall-clock noise (idle states, scheduling) moves less than tokens/s.
    # The kernel's share is the quietest figure: a role's added kernel time a token (the traps and programs of its
    # probes, run on the workload's threads) over the control's whole CPU a token of the same round. The control's
    # own kernel time is near zero, so a ratio of kernel times would say nothing. (psutil counts CPU in ticks of
    # 10 ms: a run of 4 096 tokens resolves 2.4 µs a token.)
    cpu = results.get("cpu_us_per_token")
    for name, key, explained in (
            ("CPU a token", "cpu_us_per_token", "role / control - 1"),
            ("of it in the kernel", "system_us_per_token", "(role - control) / control's CPU a token")):
        per_token = results.get(key)
        if not per_token or not cpu or not all(cpu.values()):
            continue
        extra = {role: [(v - c) / whole if whole else 0.0 for v, c, whole
                        in zip(per_token[role], per_token["control"], cpu["control"], strict=True)]
                 for role in roles[1:]}
        results[f"{key}_cost"] = {role: median(values) for role, values in extra.items()}
        spread = max((abs(value) for value in extra.get("floor", [])), default=None)
        print(f"   {name} (µs; cost = {explained}, medians of rounds; floor's rounds reach "
              f"{'-' if spread is None else f'{spread * 100:.1f} %'}):")
        print(f"   {'control':<8} {median(per_token['control']):>9.2f}")
        for role in roles[1:]:
            rounds = " ".join(f"{value * 100:+.1f}" for value in extra[role])
            role_cost = results[f"{key}_cost"][role]
            goal = GOALS.get(role)
            verdict = ""
            if key == "system_us_per_token" and goal is not None and spread is not None and spread < goal:
                # The kernel's part is a lower bound of the cost: above the goal in every round, the goal is missed
                # whatever the rest; within it in every round, the rest (user-side effects) still counts, as
                # tokens/s say above. (The floor is two near-zero figures: it bounds the noise at zero only.)
                if min(extra[role]) > goal:
                    verdict = f"  goal <= {goal * 100:.0f} %: MISSED by the kernel's part alone, in every round"
                elif max(extra[role]) <= goal:
                    verdict = f"  goal <= {goal * 100:.0f} %: the kernel's part is within it in every round"
                else:
                    verdict = f"  goal <= {goal * 100:.0f} %: the kernel's part straddles it"
            print(f"   {role:<8} {median(per_token[role]):>9.2f} {role_cost * 100:>7.2f}%  [{rounds}]{verdict}")


if __name__ == "__main__":
    sys.exit(main())
