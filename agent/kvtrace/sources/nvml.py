"""NVML (nvidia-ml-py, `import pynvml`): what the driver says each GPU and each process uses.

Behind a narrow interface (`NvmlBackend`) with a real backend over pynvml and a fake one in the
tests. `NvmlSampler` samples on an interval in its own thread and never lets NVML hurt the agent:

- every call runs in a worker thread and is given up after a timeout: a hung driver call (a GPU
  falling off the bus can hang NVML for minutes) marks the component down, "nvml call timed out",
  and no new call is made until the hung one returns;
- no pynvml, no NVML library, no driver or no GPU is a state with a reason, not a crash;
- a failed round (no GPU answered, a timeout) re-initialises NVML at the next one, and a lost GPU is
  asked for afresh, so the component comes back on its own when calls work again.

Only this module knows pynvml's shapes; the rest of kvtrace reads `GpuMemory` and
`NvmlProcessMemory`. It also knows how CUDA numbers devices (CUDA_VISIBLE_DEVICES), which is what
it takes to match a traced CUDA ordinal with an NVML GPU.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import (
    TimeoutError as FutureTimeout,  # not the builtin one before 3.11
)
from dataclasses import dataclass
from typing import Any, Protocol

from kvtrace.model.agent import ComponentStatus
from kvtrace.model.gpus import GpuMemory, NvmlProcessMemory, NvmlSample
from kvtrace.session import Session
from kvtrace.sources.procfs import environ_value

log = logging.getLogger(__name__)

COMPONENT = "nvml"
DEFAULT_INTERVAL_SECONDS = 1.0
# Memory and process queries take microseconds to milliseconds; seconds means the driver is stuck.
DEFAULT_CALL_TIMEOUT_SECONDS = 2.0
# nvmlInit can take seconds per GPU when persistence mode is off (the driver initialises each one).
DEFAULT_INIT_TIMEOUT_SECONDS = 30.0


class NvmlError(Exception):
    """An NVML call failed; the message is one line for the operator."""


class NvmlTimeout(NvmlError):
    """An NVML call did not return within its time box."""

    def __init__(self) -> None:
        super().__init__("nvml call timed out")


@dataclass(frozen=True)
class DeviceMemory:
    """nvmlDeviceGetMemoryInfo: with the v2 call, total = reserved + used + free; with v1 (old
    drivers) `used` includes the reserved memory and reserved_bytes is 0."""

    total_bytes: int
    used_bytes: int
    free_bytes: int
    reserved_bytes: int


class NvmlBackend(Protocol):
    """The NVML calls kvtrace makes. Each raises NvmlError with an operator's line on failure."""

    def init(self) -> None:
        """Loads and initialises NVML (again after a failure: shutdown is called first)."""
        ...

    def shutdown(self) -> None: ...

    def device_count(self) -> int: ...

    def identity(self, index: int) -> tuple[str, str]:
        """(uuid, name) of the GPU, e.g. ("GPU-8e6f…", "NVIDIA H200")."""
        ...

    def memory(self, index: int) -> DeviceMemory: ...

    def compute_processes(self, index: int) -> list[tuple[int, int | None]]:
        """(pid, used bytes or None) of each compute process on the GPU."""
        ...


# pynvml raises one class per NVML return code; these deserve more than NVML's own wording.
_REASONS = {
    "NVMLError_LibraryNotFound": "NVML library not found (libnvidia-ml.so.1: is the NVIDIA driver installed?)",
    "NVMLError_DriverNotLoaded": "the NVIDIA driver is not loaded",
    "NVMLError_NoPermission": "NVML refused the call: insufficient permissions",
    "NVMLError_GpuIsLost": "GPU is lost (NVML_ERROR_GPU_IS_LOST: fallen off the bus or needs a reset)",
}


class PynvmlBackend:
    """NVML through pynvml, imported at `init` so that a host without it still runs the agent."""

    def __init__(self) -> None:
        self._pynvml: Any = None  # the pynvml module once imported
        self._handles: dict[int, object] = {}
        self._memory_v2 = True  # until the driver says it has no nvmlDeviceGetMemoryInfo_v2

    def init(self) -> None:
        try:
            import pynvml
        except ImportError:
            raise NvmlError("pynvml is not installed (pip install nvidia-ml-py)") from None
        self._pynvml = pynvml
        self._handles.clear()
        self._checked(pynvml.nvmlInit)

    def shutdown(self) -> None:
        if self._pynvml is not None:
            try:
                self._pynvml.nvmlShutdown()
            except self._pynvml.NVMLError:
                pass  # not initialised: nothing to shut down

    def device_count(self) -> int:
        return self._checked(self._pynvml.nvmlDeviceGetCount)

    def identity(self, index: int) -> tuple[str, str]:
        handle = self._handle(index)
        uuid = self._checked(self._pynvml.nvmlDeviceGetUUID, handle, index=index)
        name = self._checked(self._pynvml.nvmlDeviceGetName, handle, index=index)
        return _text(uuid), _text(name)

    def memory(self, index: int) -> DeviceMemory:
        pynvml, handle = self._pynvml, self._handle(index)
        if self._memory_v2:
            try:
                info = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
                return DeviceMemory(info.total, info.used, info.free, info.reserved)
            except (pynvml.NVMLError_FunctionNotFound, pynvml.NVMLError_NotSupported,
                    pynvml.NVMLError_ArgumentVersionMismatch):
                self._memory_v2 = False  # an older driver: v1 from now on
            except pynvml.NVMLError as error:
                self._failed(index, error)
        info = self._checked(pynvml.nvmlDeviceGetMemoryInfo, handle, index=index)
        return DeviceMemory(info.total, info.used, info.free, 0)

    def compute_processes(self, index: int) -> list[tuple[int, int | None]]:
        processes = self._checked(self._pynvml.nvmlDeviceGetComputeRunningProcesses, self._handle(index),
                                  index=index)
        return [(process.pid, process.usedGpuMemory) for process in processes]

    def _handle(self, index: int):
        handle = self._handles.get(index)
        if handle is None:
            handle = self._handles[index] = self._checked(
                self._pynvml.nvmlDeviceGetHandleByIndex, index, index=index)
        return handle

    def _checked(self, function, *args, index: int | None = None):
        try:
            return function(*args)
        except self._pynvml.NVMLError as error:
            self._failed(index, error)

    def _failed(self, index: int | None, error: Exception):
        if index is not None:
            self._handles.pop(index, None)  # a GPU back from a reset may need a new handle
        raise NvmlError(_REASONS.get(type(error).__name__, f"NVML: {error}")) from None


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value  # old pynvml returns bytes


class _CallThread:
    """Runs NVML calls one at a time in a daemon thread, so that the sampler can stop waiting for a
    hung one. A daemon thread, not a ThreadPoolExecutor: the executor's threads are joined at
    interpreter exit, and a call hung in the driver would then hang the agent's exit as well."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kvtrace-nvml-call", daemon=True)
        self._thread.start()

    def submit(self, function: Callable, *args) -> Future:
        future: Future = Future()
        self._calls.put((future, function, args))
        return future

    def close(self) -> None:
        self._calls.put(None)

    def _run(self) -> None:
        while True:
            call = self._calls.get()
            if call is None:
                return
            future, function, args = call
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(function(*args))
            except BaseException as error:  # handed to the waiting sampler, which decides
                future.set_exception(error)


class NvmlSampler:
    """Samples NVML every `interval_seconds` in its own thread and hands each sample and its
    health to the Session (a round with no figures as a sample with no GPUs: no stale figures).
    `latest` and `status` are read from any thread (each is one immutable object, replaced whole)."""

    def __init__(self, session: Session | None = None, backend: NvmlBackend | None = None,
                 interval_seconds: float = DEFAULT_INTERVAL_SECONDS,
                 call_timeout_seconds: float = DEFAULT_CALL_TIMEOUT_SECONDS,
                 init_timeout_seconds: float = DEFAULT_INIT_TIMEOUT_SECONDS) -> None:
        self.session = session
        self.backend = backend if backend is not None else PynvmlBackend()
        self.interval_seconds = interval_seconds
        self.call_timeout_seconds = call_timeout_seconds
        self.init_timeout_seconds = init_timeout_seconds
        self.latest: NvmlSample | None = None  # None: no figures (down, or not sampled yet)
        self.status = ComponentStatus(COMPONENT, False, "not sampled yet")
        if session is not None:
            session.report_component(COMPONENT, False, self.status.reason)
        self._calls = _CallThread()
        self._initialized = False
        self._identities: dict[int, tuple[str, str]] = {}  # uuid and name do not change while initialised
        self._hung: Future | None = None  # a call that timed out and has not returned yet
        self._hung_since = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvtrace-nvml", daemon=True)
        self._thread.start()

    def stop(self, timeout_seconds: float = 0.5) -> None:
        """Stops sampling; waits at most `timeout_seconds` for a round in progress and never for a
        hung call (its thread is a daemon): the agent's stop must stay quick."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_seconds)
        self._calls.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample_once()
            self._stop.wait(self.interval_seconds)

    def sample_once(self) -> None:
        """One round. Returns within about one call timeout even when a call hangs."""
        try:
            self._sample()
        except NvmlError as error:
            self._down(str(error))
        except Exception as error:  # a pynvml bug must not end the sampling thread
            log.exception("NVML sampling failed")
            self._down(f"NVML sampling failed: {error}")

    def _sample(self) -> None:
        if self._hung is not None:
            if not self._hung.done():
                raise NvmlError(f"nvml call timed out (hung for {time.monotonic() - self._hung_since:.0f} s)")
            self._hung = None
        if not self._initialized:
            self._call(self.backend.shutdown)
            self._call(self.backend.init, timeout_seconds=self.init_timeout_seconds)
            self._identities.clear()
            self._initialized = True
        count = self._call(self.backend.device_count)
        if count == 0:
            raise NvmlError("no NVIDIA GPU")
        gpus, processes, failures = [], [], []
        for index in range(count):
            try:
                gpu, on_gpu = self._sample_gpu(index)
            except NvmlTimeout:
                raise
            except NvmlError as error:  # one GPU lost: still report the others
                failures.append(f"GPU {index}: {error}")
                continue
            gpus.append(gpu)
            processes.extend(on_gpu)
        if not gpus:
            raise NvmlError("; ".join(failures))
        now_ns = self.session.wall_clock_ns() if self.session is not None else time.time_ns()
        self.latest = NvmlSample(now_ns, tuple(gpus), tuple(processes))
        if self.session is not None:
            self.session.ingest(self.latest)
        if failures:  # the backend asks for a lost GPU afresh next round; the others keep going
            self._set_status(False, f"{'; '.join(failures)} ({len(gpus)} of {count} GPUs sampled)")
        else:
            self._set_status(True)

    def _sample_gpu(self, index: int) -> tuple[GpuMemory, list[NvmlProcessMemory]]:
        identity = self._identities.get(index)
        if identity is None:
            identity = self._identities[index] = self._call(self.backend.identity, index)
        memory = self._call(self.backend.memory, index)
        processes = [NvmlProcessMemory(index, pid, used_bytes)
                     for pid, used_bytes in self._call(self.backend.compute_processes, index)]
        uuid, name = identity
        return GpuMemory(index, uuid, name, memory.total_bytes, memory.used_bytes, memory.free_bytes,
                         memory.reserved_bytes), processes

    def _call(self, function: Callable, *args, timeout_seconds: float | None = None):
        future = self._calls.submit(function, *args)
        try:
            return future.result(timeout=timeout_seconds or self.call_timeout_seconds)
        except FutureTimeout:
            if future.done():
                raise  # the call itself raised it
            self._hung, self._hung_since = future, time.monotonic()
            raise NvmlTimeout() from None

    def _down(self, reason: str) -> None:
        self.latest = None  # no stale figures: a forecast from them would mislead
        if self.session is not None:
            self.session.ingest(NvmlSample(self.session.wall_clock_ns(), (), ()))
        self._initialized = False
        self._set_status(False, reason)

    def _set_status(self, up: bool, reason: str = "") -> None:
        # Logged on a change only, ignoring the details in parentheses ("hung for 12 s").
        if up != self.status.up or reason.split(" (")[0] != self.status.reason.split(" (")[0]:
            if up:
                log.info("nvml up")
            else:
                log.warning("nvml down: %s", reason)
        self.status = ComponentStatus(COMPONENT, up, reason)
        if self.session is not None:
            self.session.report_component(COMPONENT, up, reason)


# ---- CUDA ordinals and NVML indices ----

def read_cuda_visible_devices(pid: int) -> str | None:
    """CUDA_VISIBLE_DEVICES as the process was started with; None when unset or unreadable."""
    return environ_value(pid, "CUDA_VISIBLE_DEVICES")
