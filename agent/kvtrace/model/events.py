"""The one event model. Every source turns its raw records into `Event`; everything after it
(ledger, analysis, export, CLI) reads only these.

The enum values equal the constants in probes/kvtrace.h so that decoding is a lookup, and a unit
test checks the two stay in step.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Layer(enum.IntEnum):
    """Which CUDA layer a call belongs to. Physical device memory = driver + vmm."""

    RUNTIME = 1
    DRIVER = 2
    VMM = 3


class ObjectKind(enum.IntEnum):
    """What a ledger entry stands for."""

    ALLOCATION = 1  # an address with a size (cudaMalloc*, cuMemAlloc*)
    VMM_HANDLE = 2  # physical memory from cuMemCreate, keyed by handle
    VMM_RESERVE = 3  # a virtual address range (no memory)
    VMM_MAPPING = 4  # a VA range backed by a handle (no memory of its own)


class Memory(enum.IntEnum):
    """Where the bytes live."""

    DEVICE = 1
    HOST = 2  # pinned host memory
    MANAGED = 3
    NONE = 4  # address space only


class Kind(enum.IntEnum):
    """What happened."""

    ALLOC = 1
    FREE = 2
    ALLOC_FAILED = 3
    FREE_FAILED = 4
    FREE_UNKNOWN = 5  # freed an address the ledger never saw: memory that predates the agent
    MAP = 6
    UNMAP = 7
    RELEASE = 8  # cuMemRelease of a mapped handle: its memory goes at the last unmap
    SET_DEVICE = 9
    CONTEXT_DESTROY = 10
    PROCESS_EXIT = 11


class Api(enum.IntEnum):
    """The traced function. Runtime 1..19, driver 20..39, VMM 40..59."""

    cudaMalloc = 1
    cudaFree = 2
    cudaMallocAsync = 3
    cudaFreeAsync = 4
    cudaMallocManaged = 5
    cudaMallocHost = 6
    cudaHostAlloc = 7
    cudaFreeHost = 8
    cudaMallocPitch = 9
    cudaSetDevice = 10
    cuMemAlloc_v2 = 20
    cuMemFree_v2 = 21
    cuMemAllocAsync = 22
    cuMemFreeAsync = 23
    cuMemAllocManaged = 24
    cuMemAllocPitch_v2 = 25
    cuMemAllocHost_v2 = 26
    cuMemHostAlloc = 27
    cuMemFreeHost = 28
    cuCtxSetCurrent = 29
    cuCtxDestroy_v2 = 30
    cuDevicePrimaryCtxRetain = 31
    cuCtxCreate_v2 = 32
    cuMemCreate = 40
    cuMemRelease = 41
    cuMemMap = 42
    cuMemUnmap = 43
    cuMemAddressReserve = 44
    cuMemAddressFree = 45
    process_exit = 60


DEVICE_UNKNOWN = -1


def _lower(value: enum.IntEnum | None) -> str | None:
    return value.name.lower() if value is not None else None


@dataclass(slots=True)
class Event:
    """One traced call (or a process exit), with its attribution.

    `address` is the pointer, VMM handle or virtual address the call returned or took; for
    context events it is the context. `aux` is the handle for cuMemMap and the physical bytes an
    unmap freed for cuMemUnmap.
    """

    kind: Kind
    api: Api
    pid: int
    tid: int
    timestamp_ns: int  # wall clock (time.time_ns() scale)
    layer: Layer | None = None
    object: ObjectKind | None = None
    memory: Memory | None = None
    size_bytes: int = 0
    address: int = 0
    device: int = DEVICE_UNKNOWN
    error_code: int = 0
    caller_address: int = 0
    aux: int = 0
    comm: str = ""
    title: str = ""  # full process title from /proc/PID/cmdline
    container: str = ""  # container id from the cgroup path, "" on the host
    stack_id: int = 0  # interned Python stack (model/stacks.py); 0 = none
    stack_status: str = ""  # why there is or is not a stack: ok, not_python, no_thread_state, ...
    extra: dict = field(default_factory=dict)

    def to_json_dict(self, stack=None, native_caller=None) -> dict:
        """The stable JSON shape of `kvtrace agent --json-events` (one object per line).

        `stack` (model.stacks.Stack) adds "stack": [{function, file, line}, ...] innermost first
        and "stack_truncated"; `native_caller` (model.stacks.NativeFrame) adds "native_caller".
        """
        extra = dict(self.extra)
        if stack is not None:
            extra["stack"] = [frame.to_json_dict() for frame in stack.frames]
            extra["stack_truncated"] = stack.truncated
        if self.stack_status:
            extra["stack_status"] = self.stack_status
        if native_caller is not None:
            extra["native_caller"] = native_caller.to_json_dict()
        return {
            "kind": self.kind.name.lower(),
            "pid": self.pid,
            "tid": self.tid,
            "comm": self.comm,
            "title": self.title,
            "api": self.api.name,
            "layer": _lower(self.layer),
            "object": _lower(self.object),
            "memory": _lower(self.memory),
            "size_bytes": self.size_bytes,
            "address": self.address,
            "device": self.device,
            "error_code": self.error_code,
            "timestamp_ns": self.timestamp_ns,
            "caller_address": self.caller_address,
            "container": self.container,
            **({"handle": self.aux} if self.api is Api.cuMemMap else {}),
            **({"freed_bytes": self.aux} if self.api is Api.cuMemUnmap else {}),
            **extra,
        }
