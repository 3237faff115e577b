"""Drives tests/gpu/workloads/torch_worker.py: one JSON command per line in, one answer out.

Shared by the GPU tests (tests/gpu) and the GPU benchmark (bench/gpu_overhead.py); no pytest here.
"""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

WORKER = Path(__file__).parent / "torch_worker.py"
LLAMA = Path(__file__).parent / "llama.py"


class TorchWorker:
    """The torch worker process; answers are read on a thread so the tracer can be pumped meanwhile.

    `title` renames the process as vLLM's setproctitle does (VLLM::Worker_TP0)."""

    def __init__(self, env: dict[str, str] | None = None, title: str | None = None) -> None:
        full_env = dict(os.environ, **(env or {}))
        if title:
            full_env["KVTRACE_TEST_TITLE"] = title
        argv = [sys.executable, str(WORKER)]
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True, env=full_env)
        self._answers: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        ready = self._answers.get(timeout=120)
        self.pid = ready["pid"]

    def _read(self) -> None:
        for line in self.process.stdout:
            self._answers.put(json.loads(line))

    def request(self, **command) -> None:
        """Sends a command without waiting for its answer (see `answer`)."""
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()

    def answer(self, harness=None, timeout_seconds: float = 120.0) -> dict:
        """The next answer; with `harness`, its tracer is pumped while waiting."""
        if harness is None:
            try:
                answer = self._answers.get(timeout=timeout_seconds)
            except queue.Empty:
                raise AssertionError(f"the worker did not answer in {timeout_seconds} s") from None
        else:
            answer = {}

            def arrived() -> bool:
                try:
                    answer.update(self._answers.get_nowait())
                    return True
                except queue.Empty:
                    return False

            assert harness.pump_until(arrived, timeout_seconds), "the worker did not answer"
        assert "error" not in answer, answer
        return answer

    def send(self, harness=None, timeout_seconds: float = 120.0, **command) -> dict:
        self.request(**command)
        return self.answer(harness, timeout_seconds)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
