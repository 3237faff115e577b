"""GPU placement of a real vLLM 0.24 engine on one H200, under sleep mode.

vLLM never calls cudaSetDevice(0) on one GPU, and under sleep mode its CuMemAllocator maps weights and
KV cache through cuMemCreate while the rest goes through cudaMalloc: the engine showed on two rows,
"?" for the cudaMalloc'd memory and 0 for the rest. CUDA's rule puts both on device 0.

Needs vLLM (tests/gpu/README.md: the offline bundle); skipped with the reason otherwise.
"""
from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest

from agent_process import AgentProcess
from conftest import check_all, wait_for
from kvtrace.client import AgentClient
from kvtrace.model.events import Memory

ENGINE = Path(__file__).parent / "workloads" / "vllm_engine.py"
MiB = 1 << 20


def _vllm_rows(socket) -> dict[int, dict[tuple[int, int], int]]:
    """pid -> (device, layer) -> outstanding device bytes, for the processes vLLM titled (pinned host
    memory is on no device)."""
    with AgentClient.for_socket(socket) as client:
        processes = client.processes()
    rows: dict[int, dict[tuple[int, int], int]] = {}
    for process in processes:
        if process.title.startswith("VLLM::"):
            totals: dict[tuple[int, int], int] = defaultdict(int)
            for total in process.totals:
                if total.memory == Memory.DEVICE:
                    totals[(total.device, total.layer)] += total.size_bytes
            rows[process.pid] = dict(totals)
    return rows


def _expect(lines: queue.Queue, word: str, timeout_seconds: float = 240) -> None:
    """Takes the engine's output lines up to `word`; fails (never hangs) after the timeout."""
    deadline = time.monotonic() + timeout_seconds
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"no {word!r} from the engine within {timeout_seconds} s") from None
        if line is None:
            raise AssertionError(f"the engine ended before {word!r}")
        print(line, end="")
        if line.strip() == word:
            return


def _reader(engine: subprocess.Popen) -> queue.Queue:
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in engine.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    return lines


def test_a_vllm_engine_under_sleep_mode_is_on_device_0_on_every_row(agent_socket, tmp_path):
    try:
        import vllm  # noqa: F401
    except Exception as error:  # vLLM's import can fail in more ways than ImportError
        pytest.skip(f"vLLM is not importable here ({error}): see tests/gpu/README.md for the bundle")
    failures = []
    with AgentProcess(agent_socket) as agent:
        engine = subprocess.Popen([sys.executable, str(ENGINE)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, env=dict(os.environ))
        lines = _reader(engine)
        try:
            _expect(lines, "ready")
            rows = wait_for(lambda: _vllm_rows(agent_socket) or None, 30) or {}
            print(f"\nawake: {rows}")
            engine.stdin.write("sleep\n")
            engine.stdin.flush()
            _expect(lines, "slept")
            asleep = wait_for(lambda: _vllm_rows(agent_socket) or None, 10) or {}
            print(f"asleep (level 1): {asleep}")
            engine.stdin.write("wake\n")
            engine.stdin.flush()
            _expect(lines, "woke")
            woke = wait_for(lambda: _vllm_rows(agent_socket) or None, 10) or {}
            print(f"woke: {woke}")
            engine.stdin.write("exit\n")
            engine.stdin.flush()
        finally:
            engine.kill()
            engine.wait()
        print(f"agent log:\n{agent.stderr_text()[-1500:]}")
    if not rows:
        failures.append("no VLLM:: process holds traced memory")
    for name, state in (("awake", rows), ("asleep", asleep), ("woke", woke)):
        devices = {device for totals in state.values() for device, _ in totals}
        if devices - {0}:
            failures.append(f"{name}: rows on devices {sorted(devices)}, not only 0")
    check_all(failures)
