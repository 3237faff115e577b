"""The idle agent's CPU, and what of it is NVML's: agents side by side, one with every default and one
with --no-nvml (more with --variant), each's CPU over the same seconds, as a fraction of one core.

Idle means no traced calls: the agents attach their probes to every CUDA library here and wait. On a
GPU host the default agent samples NVML every second; on a host without a GPU both figures are the
agent's loop, timers and housekeeping alone. Needs root and bcc (as `make test`).

    sudo .venv/bin/python bench/agent_idle.py [--seconds 30] [--rounds 3] [--variant "--no-nvml --no-vllm"]
        [--baseline DIR]

--baseline DIR adds the default agent of another commit, side by side: DIR holds that commit's agent/ and
probes/ (`git archive REV agent probes | tar -x -C DIR`, REV written in DIR/COMMIT).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]

from agent_process import AgentProcess  # noqa: E402
from benchlib import CpuMeter, code_version, median  # noqa: E402

GOAL_CORE_FRACTION = 0.01


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="seconds each round measures")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--settle-seconds", type=float, default=5.0, help="after start, before measuring")
    parser.add_argument("--variant", action="append", default=[],
                        help="another agent's flags (a shell-quoted string); default: --no-nvml")
    parser.add_argument("--baseline", type=Path, metavar="DIR",
                        help="also the default agent of DIR/agent with DIR/probes (another commit's)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("run as root: the agents load BPF", file=sys.stderr)
        return 3
    variants = {"default": []} | {flags or "(none)": shlex.split(flags) for flags in args.variant or ["--no-nvml"]}
    envs: dict[str, dict[str, str]] = {}
    if args.baseline:
        if not (args.baseline / "agent" / "kvtrace").is_dir() or not (args.baseline / "probes").is_dir():
            parser.error(f"--baseline {args.baseline}: no agent/kvtrace and probes/ there")
        commit = args.baseline / "COMMIT"
        name = f"default@{commit.read_text().strip() if commit.exists() else args.baseline}"
        variants[name] = []
        base = args.baseline.resolve()
        envs[name] = dict(os.environ, KVTRACE_PROBES_DIR=str(base / "probes"),
                          PYTHONPATH=os.pathsep.join([str(base / "agent"), *[
                              path for path in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                              if path and Path(path).resolve() != HERE.parent / "agent"]]))
    fractions: dict[str, list[float]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory(prefix="kvtrace-idle-") as directory, contextlib.ExitStack() as stack:
        agents = {name: stack.enter_context(AgentProcess(Path(directory) / f"{index}.sock", *flags,
                                                         env=envs.get(name)))
                  for index, (name, flags) in enumerate(variants.items())}
        time.sleep(args.settle_seconds)
        for round_index in range(args.rounds):
            meters = {name: CpuMeter(agent.process.pid) for name, agent in agents.items()}
            for meter in meters.values():
                meter.start()
            time.sleep(args.seconds)
            for name, meter in meters.items():
                fractions[name].append(meter.stop())
            print(f"round {round_index + 1}/{args.rounds}: " + ", ".join(
                f"{name} {100 * values[-1]:.2f} %" for name, values in fractions.items()), file=sys.stderr)
        rss = {name: CpuMeter(agent.process.pid).rss_bytes() for name, agent in agents.items()}
    print(f"idle agents side by side, {args.rounds} rounds x {args.seconds:.0f} s; measured: {code_version()}")
    for name, values in fractions.items():
        figure = median(values)
        print(f"  {name:<24} {100 * figure:6.2f} % of a core (rounds: "
              f"{', '.join(f'{100 * value:.2f}' for value in values)}); RSS {rss[name] / 2**20:.0f} MiB"
              + (f"  goal <= {100 * GOAL_CORE_FRACTION:.0f} % ({'met' if figure <= GOAL_CORE_FRACTION else 'MISSED'})"
                 if name == "default" else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
