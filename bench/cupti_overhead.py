"""What CUPTI inside the target (`kvtrace run`) costs on real CUDA, side by side with the uprobes and with
nothing, in one run (run as root on the GPU machine).

Configurations, each a fresh torch process (tests/gpu/workloads/cupti_torch.py) per round:
  untraced   nothing attached, no agent running
  cupti      `kvtrace run --blocks never --output FILE` (CUPTI inside: callbacks on the allocation functions,
             MEMORY2 and MEMORY_POOL records, Python stacks), no agent running; PyTorch's block recorder, on by
             default in a recording, is measured by bench/depth_overhead.py's `state` role
  uprobes    the real `kvtrace agent` (uprobes with Python stacks), the process run plainly
  both       the agent, and `kvtrace run --agent` (CUPTI's events cross-checked against the uprobes')
Rounds run the four in turn (the two without an agent, then the two with one; the order inside each
pair rotates), so drift on the machine hits all alike; figures are medians over rounds.

1. pair cost: torch.empty(1 MiB) + del with PYTORCH_NO_CUDA_MEMORY_CACHING=1 (a cudaMalloc and a
   cudaFree each), ns per pair; added = configuration - untraced of the same round.
2. generation: the random 8-layer Llama, caching allocator, tokens/s.

Run: python3 bench/cupti_overhead.py [--rounds 3] [--pairs 20000] [--generate 3] [--json-out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT / "bench", ROOT / "tests", ROOT / "agent"):
    sys.path.insert(0, str(_path))

from agent_process import KVTRACE, AgentProcess  # noqa: E402
from benchlib import code_version, median, progress  # noqa: E402
from kvtrace.client import AgentClient  # noqa: E402

WORKLOAD = ROOT / "tests" / "gpu" / "workloads" / "cupti_torch.py"
CONFIGS = ("untraced", "cupti", "uprobes", "both")


def measure(config: str, workload_args: list[str], work: Path, agent: AgentProcess | None) -> float:
    command = [sys.executable, str(WORKLOAD), *workload_args]
    if config == "cupti":
        command = [*KVTRACE, "run", "--blocks", "never", "--output", str(work / f"{config}.kvtrace"), "--", *command]
    elif config == "both":
        command = [*KVTRACE, "run", "--agent", str(work / "cupti.sock"), "--", *command]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=env)
    try:
        pid = json.loads(_line(process))["ready"]
        if agent is not None:
            _wait_attached(agent.socket, pid)
        process.stdin.write("\n")
        process.stdin.flush()
        result = json.loads(_line(process))
    finally:
        process.stdin.close()
        process.wait(timeout=120)
    return result.get("ns_per_pair") or result["tokens_per_second"]


def _line(process: subprocess.Popen, timeout_seconds: float = 300) -> str:
    ready, _, _ = select.select([process.stdout], [], [], timeout_seconds)
    text = process.stdout.readline() if ready else ""
    if not text:
        process.kill()
        raise RuntimeError(f"the workload said nothing: {process.stderr.read()[-2000:]}")
    return text


def _wait_attached(socket: Path, pid: int, timeout_seconds: float = 60) -> None:
    import time

    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        with AgentClient.for_socket(socket) as client:
            if any(pid in library.pids for library in client.info().attached_libraries):
                return
        time.sleep(0.5)
    raise RuntimeError(f"the agent did not attach to pid {pid}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=20000)
    parser.add_argument("--generate", type=int, default=3, help="generate() calls per measurement")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    figures: dict[str, dict[str, list[float]]] = {"pair_ns": {c: [] for c in CONFIGS},
                                                  "tokens_per_second": {c: [] for c in CONFIGS}}
    loads = {"pair_ns": ["nocache", "--pairs", str(args.pairs)],
             "tokens_per_second": ["caching", "--generate", str(args.generate)]}
    with tempfile.TemporaryDirectory(prefix="kvtrace-cupti-bench-") as directory:
        work = Path(directory)
        for number in range(args.rounds):
            plain, traced = (("untraced", "cupti"), ("uprobes", "both")) if number % 2 == 0 else \
                (("cupti", "untraced"), ("both", "uprobes"))
            for figure, workload_args in loads.items():
                for config in plain:
                    figures[figure][config].append(measure(config, workload_args, work, None))
            with AgentProcess(work / "kvtrace.sock", "--cupti-socket", str(work / "cupti.sock")) as agent:
                for figure, workload_args in loads.items():
                    for config in traced:
                        figures[figure][config].append(measure(config, workload_args, work, agent))
            progress(f"round {number + 1}/{args.rounds}: " + "; ".join(
                f"{figure} " + ", ".join(f"{c} {values[c][-1]:.0f}" for c in CONFIGS)
                for figure, values in figures.items()))
    pair = {config: median(values) for config, values in figures["pair_ns"].items()}
    tokens = {config: median(values) for config, values in figures["tokens_per_second"].items()}
    print(f"\nkvtrace run (CUPTI) overhead, code {code_version()}, {args.rounds} rounds, medians:")
    print(f"{'configuration':<12} {'ns/pair':>10} {'added ns':>10} {'tokens/s':>10} {'vs untraced':>12}")
    for config in CONFIGS:
        print(f"{config:<12} {pair[config]:>10.0f} {pair[config] - pair['untraced']:>10.0f} "
              f"{tokens[config]:>10.1f} {tokens[config] / tokens['untraced'] - 1:>+11.2%}")
    if args.json_out:
        args.json_out.write_text(json.dumps({"code": code_version(), "rounds": args.rounds, "raw": figures,
                                             "pair_ns": pair, "tokens_per_second": tokens}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
