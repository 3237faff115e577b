"""Tokens per second of a real vLLM engine untraced, traced, and traced with the kvtrace plugin,
measured side by side in one run (as root on the GPU machine, with the vLLM bundle installed).

Three engines (tests/gpu/workloads/vllm_engine.py: random 8-layer Llama, no sleep mode, 0.2 of the
GPU each), started one after the other, then all alive, idle but one: rounds make each generate in
turn, the order rotated each round, so that drift on the machine hits all alike.

  untraced   nothing attached to its processes
  traced     the real `kvtrace agent -p ...` (probes and Python stacks on its processes)
  plugin     traced by the same agent, and the kvtrace plugin inside vLLM (KVTRACE_VLLM_PLUGIN=1)
             reporting to the agent's datagram socket

Each round: one `throughput N T` per engine (N prompts of 64 tokens, T new tokens each).
Output: tokens/s per round and mode, medians, and slowdowns against untraced of the same round.

Run: python3 bench/vllm_overhead.py [--rounds 6] [--prompts 64] [--tokens 128] [--json-out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT / "bench", ROOT / "tests", ROOT / "agent"):
    sys.path.insert(0, str(_path))

from agent_process import AgentProcess  # noqa: E402
from benchlib import CpuMeter, code_version, median, progress, require_bpf, rotated  # noqa: E402

ENGINE = ROOT / "tests" / "gpu" / "workloads" / "vllm_engine.py"
MODES = ("untraced", "traced", "plugin")


class Engine:
    """One engine process driven over stdin (answers are lines starting with the command's word)."""

    def __init__(self, mode: str, env: dict[str, str]) -> None:
        self.mode = mode
        self.process = subprocess.Popen([sys.executable, str(ENGINE)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def expect(self, word: str, timeout_seconds: float = 300) -> str:
        deadline = time.monotonic() + timeout_seconds
        tail: list[str] = []
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise SystemExit(f"{self.mode}: no {word!r} within {timeout_seconds} s:\n{''.join(tail)}") from None
            if line is None:
                raise SystemExit(f"{self.mode}: the engine ended before {word!r}:\n{''.join(tail)}")
            tail = (tail + [line])[-30:]
            if line.split(" ", 1)[0].strip() == word:
                return line[len(word):].strip()

    def command(self, text: str, word: str) -> str:
        assert self.process.stdin is not None
        self.process.stdin.write(text + "\n")
        self.process.stdin.flush()
        return self.expect(word)

    def pids(self) -> list[int]:
        """The engine's processes: the driver and its children (EngineCore)."""
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children").read_text().split()
        return [self.process.pid, *map(int, children)]

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.command("exit", "")
            except SystemExit:
                pass
            self.process.kill()
        self.process.wait()


def plugin_site(directory: Path) -> Path:
    """A dist-info declaring kvtrace's `vllm.general_plugins` entry point (kvtrace runs from the tree)."""
    info = directory / "kvtrace-0.0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvtrace\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text("[vllm.general_plugins]\nkvtrace = kvtrace.sources.vllm.plugin:register\n")
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    require_bpf()
    with tempfile.TemporaryDirectory(prefix="kvtrace-vllm-bench-") as directory:
        work = Path(directory)
        plugin_socket = work / "vllm.sock"
        site = plugin_site(work / "site")
        base = dict(os.environ, KVTRACE_TEST_SLEEP_MODE="0")
        envs = {"untraced": base, "traced": base,
                "plugin": dict(base, KVTRACE_VLLM_PLUGIN="1", KVTRACE_VLLM_SOCKET=str(plugin_socket),
                               PYTHONPATH=os.pathsep.join([str(site), base.get("PYTHONPATH", "")]))}
        engines: dict[str, Engine] = {}
        try:
            for mode in MODES:  # one at a time: vLLM's start-up memory profile must not see another's
                progress(f"starting the {mode} engine")
                engines[mode] = Engine(mode, envs[mode])
                engines[mode].expect("ready")
            progress("engines ready; starting the agent on the traced and plugin engines")
            pid_args = [arg for mode in ("traced", "plugin") for pid in engines[mode].pids()
                        for arg in ("-p", str(pid))]
            with AgentProcess(work / "kvtrace.sock", "--vllm-socket", str(plugin_socket), *pid_args) as agent:
                meter = CpuMeter(agent.process.pid)
                meter.start()
                for engine in engines.values():  # warm-up round, not counted
                    engine.command(f"throughput {args.prompts} {args.tokens}", "throughput")
                rounds: list[dict[str, float]] = []
                for index in range(args.rounds):
                    figures = {}
                    for mode in rotated(list(MODES), index):
                        answer = json.loads(engines[mode].command(f"throughput {args.prompts} {args.tokens}",
                                                                  "throughput"))
                        figures[mode] = answer["tokens_per_second"]
                    rounds.append(figures)
                    progress(f"round {index + 1}: " + ", ".join(f"{mode} {figures[mode]:.0f}" for mode in MODES))
                agent_cpu = meter.stop()
                rss = meter.rss_bytes()
                plugin_messages = _plugin_messages(work / "kvtrace.sock")
        finally:
            for engine in engines.values():
                engine.close()
    medians = {mode: median([figures[mode] for figures in rounds]) for mode in MODES}
    slowdowns = {mode: median([1 - figures[mode] / figures["untraced"] for figures in rounds])
                 for mode in ("traced", "plugin")}
    result = {"code": code_version(), "prompts": args.prompts, "new_tokens": args.tokens, "rounds": rounds,
              "median_tokens_per_second": medians, "median_slowdown": slowdowns,
              "agent_cpu_core_fraction": agent_cpu, "agent_rss_bytes": rss, "plugin_messages": plugin_messages}
    print(json.dumps(result, indent=1))
    print(f"\ntokens/s (median of {args.rounds} rounds, {args.prompts} x {args.tokens} new tokens): "
          + ", ".join(f"{mode} {medians[mode]:.0f}" for mode in MODES))
    print("slowdown vs untraced (median of per-round ratios): "
          + ", ".join(f"{mode} {100 * slowdowns[mode]:+.2f} %" for mode in slowdowns))
    print(f"agent: {100 * agent_cpu:.1f} % of a core, RSS {rss / (1 << 20):.0f} MiB; plugin messages received "
          f"{plugin_messages}")
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1))


def _plugin_messages(agent_socket: Path) -> int | None:
    from kvtrace.client import AgentClient

    try:
        with AgentClient.for_socket(agent_socket) as client:
            return dict(client.info().counters).get("vllm_messages_received")
    except Exception:
        return None


if __name__ == "__main__":
    main()
