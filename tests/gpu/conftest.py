"""GPU tests: real CUDA through torch, run on the GPU machine (see README.md here)."""
import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from harness import TracerHarness, require_tracing_here

WORKER = Path(__file__).parent / "workloads" / "torch_worker.py"


def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.gpu)


@pytest.fixture(autouse=True)
def _gpu_here():
    require_tracing_here()
    try:
        import torch
    except ImportError:
        pytest.skip("torch is not installed here: GPU tests run on the GPU machine")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here")


def source_line(marker: str) -> int:
    for number, line in enumerate(WORKER.read_text().splitlines(), start=1):
        if marker in line:
            return number
    raise AssertionError(marker)


class TorchWorker:
    """The torch worker process; answers are read on a thread so the tracer can be pumped."""

    def __init__(self, env: dict[str, str] | None = None, title: str | None = None) -> None:
        full_env = dict(os.environ, **(env or {}))
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

    def send(self, harness: TracerHarness, timeout_seconds: float = 120.0, **command) -> dict:
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        answer = {}

        def arrived() -> bool:
            try:
                answer.update(self._answers.get_nowait())
                return True
            except queue.Empty:
                return False

        assert harness.pump_until(arrived, timeout_seconds), f"no answer to {command}"
        return answer

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


@pytest.fixture
def torch_worker():
    workers = []

    def start(env=None):
        worker = TorchWorker(env)
        workers.append(worker)
        return worker

    yield start
    for worker in workers:
        worker.close()
