"""A scripted NVML backend: GPUs with memory and processes, and failures or hangs on demand."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from kvtrace.sources.nvml import DeviceMemory, NvmlError

GiB = 1 << 30


@dataclass
class FakeGpu:
    uuid: str
    name: str = "NVIDIA H200"
    total_bytes: int = 140 * GiB
    used_bytes: int = 20 * GiB
    free_bytes: int = 119 * GiB
    reserved_bytes: int = 1 * GiB
    processes: list[tuple[int, int | None]] = field(default_factory=list)  # (pid, used bytes or None)
    lost: bool = False  # every call on this GPU fails as NVML_ERROR_GPU_IS_LOST does


class FakeNvml:
    """Implements kvtrace.sources.nvml.NvmlBackend. `hang()` makes every call block until
    `release()`, as a driver stuck on a lost GPU does; `calls` records what was called."""

    def __init__(self, *gpus: FakeGpu) -> None:
        self.gpus = list(gpus)
        self.init_error: str | None = None
        self.calls: list[str] = []
        self._hanging = False
        self._released = threading.Event()

    def hang(self) -> None:
        self._released.clear()
        self._hanging = True

    def release(self) -> None:
        self._hanging = False
        self._released.set()

    def _enter(self, name: str) -> None:
        self.calls.append(name)
        if self._hanging:
            self._released.wait()

    def _gpu(self, index: int, name: str) -> FakeGpu:
        self._enter(name)
        gpu = self.gpus[index]
        if gpu.lost:
            raise NvmlError("GPU is lost")
        return gpu

    def init(self) -> None:
        self._enter("init")
        if self.init_error:
            raise NvmlError(self.init_error)

    def shutdown(self) -> None:
        self._enter("shutdown")

    def device_count(self) -> int:
        self._enter("device_count")
        return len(self.gpus)

    def identity(self, index: int) -> tuple[str, str]:
        gpu = self._gpu(index, "identity")
        return gpu.uuid, gpu.name

    def memory(self, index: int) -> DeviceMemory:
        gpu = self._gpu(index, "memory")
        return DeviceMemory(gpu.total_bytes, gpu.used_bytes, gpu.free_bytes, gpu.reserved_bytes)

    def compute_processes(self, index: int) -> list[tuple[int, int | None]]:
        return list(self._gpu(index, "compute_processes").processes)
