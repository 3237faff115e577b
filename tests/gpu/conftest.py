"""GPU tests: real CUDA through torch, run on the GPU machine (see README.md here)."""
import sys
import tempfile
import time
from pathlib import Path

import pytest

from harness import TracingHarness, require_tracing_here

sys.path.insert(0, str(Path(__file__).parent / "workloads"))
from worker_client import LLAMA, WORKER, TorchWorker  # noqa: E402,F401  (tests import these from here)


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


def source_line(marker: str, path: Path = WORKER) -> int:
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if marker in line:
            return number
    raise AssertionError(marker)


def quiesce(harness: TracingHarness, seconds: float = 0.5) -> None:
    """Lets events in flight arrive."""
    harness.pump(seconds)


def check_all(failures: list[str]) -> None:
    """One assertion that lists every failed check (a GPU run is too dear to stop at the first)."""
    assert not failures, "\n".join(failures)


def wait_for(predicate, timeout_seconds: float):
    """predicate()'s first true value, polled every 0.5 s; its last value at the timeout."""
    deadline = time.monotonic() + timeout_seconds
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.5)


@pytest.fixture
def agent_socket():
    with tempfile.TemporaryDirectory(prefix="kvtrace-gpu-") as directory:
        yield Path(directory) / "kvtrace.sock"


@pytest.fixture
def torch_worker():
    workers = []

    def start(env=None, title=None):
        worker = TorchWorker(env, title)
        workers.append(worker)
        return worker

    yield start
    for worker in workers:
        worker.close()
