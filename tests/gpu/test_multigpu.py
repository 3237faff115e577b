"""Attribution across several GPUs (issue 7): needs two GPUs (the nvidia-h200-x2 machine).

GIVEN torch processes on two GPUs — one worker per GPU titled as vLLM's tensor-parallel workers,
one process allocating on both GPUs from two threads, and one started with CUDA_VISIBLE_DEVICES
reordered ("1,0") —
THEN every process's traced bytes per CUDA device equal torch.cuda.memory_reserved(device), and the
agent puts NVML's per-process figure on the same pid and GPU (matched by UUID, not by index).
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from agent_process import AgentProcess
from conftest import wait_for

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _two_gpus():
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip(f"{torch.cuda.device_count()} GPU here: these tests need 2 (the nvidia-h200-x2 machine)")


pytestmark = pytest.mark.multigpu


def nvml_uuids() -> list[str]:
    """NVML's GPUs by index, as UUIDs without the "GPU-" prefix (torch's form)."""
    import pynvml

    pynvml.nvmlInit()
    uuids = []
    for index in range(pynvml.nvmlDeviceGetCount()):
        uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(index))
        uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
        uuids.append(uuid.removeprefix("GPU-"))
    return uuids


def growth_by_pid_device(socket: Path) -> dict[tuple[int, int], object]:
    from kvtrace.client import AgentClient

    with AgentClient.for_socket(socket) as client:
        return {(row.pid, row.device): row for row in client.growth().processes if row.outstanding_bytes}


def wait_for_rows(socket: Path, expected: dict[tuple[int, int], int], timeout_seconds: float = 30):
    """The agent's rows once each (pid, CUDA device) holds the expected bytes with an NVML figure."""
    def settled():
        rows = growth_by_pid_device(socket)
        return rows if all(key in rows and rows[key].outstanding_bytes == size
                           and rows[key].HasField("nvml_used_bytes") for key, size in expected.items()) else None

    return wait_for(settled, timeout_seconds) or growth_by_pid_device(socket)


@pytest.fixture
def worker_agent():
    """The agent following processes titled VLLM::Worker*; yields its socket."""
    with tempfile.TemporaryDirectory(prefix="kvtrace-gpu-") as directory:
        socket = Path(directory) / "kvtrace.sock"
        with AgentProcess(socket, "--cmdline", "VLLM::Worker"):
            yield socket


@pytest.mark.parametrize("visible", [None, "1,0"])
def test_one_process_allocating_on_two_gpus_from_two_threads(torch_worker, worker_agent, visible):
    uuids, socket = nvml_uuids(), worker_agent
    env = {"CUDA_VISIBLE_DEVICES": visible} if visible else {}
    worker = torch_worker(env, title="VLLM::Worker_TP0")
    init = worker.send(op="init", uuids=True)
    answer = worker.send(op="alloc_threads", devices=[0, 1], count=7, step_bytes=MiB)
    reserved = {(worker.pid, int(device)): size for device, size in answer["reserved_by_device"].items()}
    rows = wait_for_rows(socket, reserved)
    for (pid, device), size in sorted(reserved.items()):
        row = rows.get((pid, device))
        print(f"\nCUDA_VISIBLE_DEVICES={visible} two threads, device {device}: {row}")
        assert row is not None and row.outstanding_bytes == size, (device, size, sorted(rows))
        # the CUDA ordinal is NVML's GPU with the same UUID, however the devices are ordered
        assert row.nvml_index == uuids.index(init["uuids"][device])
    assert (worker.pid, -1) not in rows  # every allocation on a known device


@pytest.mark.parametrize("visible", [None, "1,0"])
def test_tensor_parallel_workers_land_on_their_gpus_in_the_trace_and_in_nvml(torch_worker, worker_agent, visible):
    uuids, socket = nvml_uuids(), worker_agent
    env = {"CUDA_VISIBLE_DEVICES": visible} if visible else {}
    workers, expected = {}, {}
    for rank in (0, 1):
        worker = torch_worker(env, title=f"VLLM::Worker_TP{rank}")
        init = worker.send(op="init", device=rank, uuids=True)
        answer = worker.send(op="alloc", count=5 + 10 * rank, step_bytes=MiB)
        workers[rank] = worker
        # the CUDA ordinal `rank` of this process is NVML's GPU with the same UUID
        expected[rank] = (worker.pid, answer["memory_reserved"], uuids.index(init["uuids"][rank]))

    rows = wait_for_rows(socket, {(pid, rank): reserved for rank, (pid, reserved, _) in expected.items()})
    for rank, (pid, reserved, nvml_index) in expected.items():
        row = rows.get((pid, rank))
        print(f"\nCUDA_VISIBLE_DEVICES={visible} TP{rank} pid {pid}: {row}")
        assert row is not None, f"no row for pid {pid} on CUDA device {rank}: {sorted(rows)}"
        assert row.title == f"VLLM::Worker_TP{rank}"
        assert row.outstanding_bytes == reserved
        assert row.nvml_index == nvml_index
        assert 64 * MiB <= row.unattributed_bytes <= 2048 * MiB
