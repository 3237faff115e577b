"""The one event model. Every source turns its raw records into `Event`; everything after it
(ledger, analysis, servers, CLI) reads only these.

The enum values equal the constants in probes/kvtrace.h so that decoding is a lookup, and a unit
test checks the two stay in step.
"""
from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol


class Layer(enum.IntEnum):
    """Which CUDA layer a call belongs to. Physical device memory = driver + vmm; torch is the
    blocks PyTorch's caching allocator hands out inside them."""

    RUNTIME = 1
    DRIVER = 2
    VMM = 3
    TORCH = 4  # PyTorch's caching allocator: blocks (tensors) inside the driver/VMM segments


class ObjectKind(enum.IntEnum):
    """What a ledger entry stands for."""

    ALLOCATION = 1  # an address with a size (cudaMalloc*, cuMemAlloc*)
    VMM_HANDLE = 2  # physical memory from cuMemCreate, keyed by handle
    VMM_RESERVE = 3  # a virtual address range (no memory)
    VMM_MAPPING = 4  # a VA range backed by a handle (no memory of its own)
    BLOCK = 5  # a tensor's block inside a segment (pytorch:malloc); its bytes are the segment's


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
    pytorch_malloc = 70  # USDT probes of PyTorch's caching allocator (libc10_cuda.so)
    pytorch_free = 71


DEVICE_UNKNOWN = -1


class Source(enum.IntEnum):
    """Who saw the call: the agent's uprobes (in the kernel, every process) or CUPTI inside the process
    (`kvtrace run`: no root, and a second witness of the same calls)."""

    UPROBE = 1
    CUPTI = 2


class StackStatus(enum.IntEnum):
    """Why an event has (or lacks) a Python stack. The probes' KVT_STACK_* values, plus what user
    space decides (UNRESOLVED)."""

    NOT_WALKED = 0  # no walk was made: not an allocation call (or the walker was not loaded)
    OK = 1
    NOT_PYTHON = 2  # no supported Python runtime registered for this process
    NO_THREAD_STATE = 3  # this thread has no Python thread state
    READ_ERROR = 4  # the target's memory could not be read
    EMPTY = 5  # a thread state with no Python frame
    UNRESOLVED = 6  # walked, but its frames were gone before user space could read them
    NOT_SAMPLED = 7  # a PyTorch block that stack sampling passed over (its bytes are estimated from others')


# Physical memory is held at the driver and VMM layers. The runtime layer shows the same bytes from
# the side of the API the program called (cudaMalloc -> cuMemAlloc_v2), so it is never added to them.
PHYSICAL_LAYERS = frozenset({Layer.DRIVER, Layer.VMM})
# Ledger objects that hold memory (a block's are its segment's); VMM reservations and mappings are
# address space only.
MEMORY_OBJECTS = frozenset({ObjectKind.ALLOCATION, ObjectKind.VMM_HANDLE, ObjectKind.BLOCK})

# The Event field a traced call's one extra number is, by API (a uprobe record's and FixedEventColumns' `aux`):
# the handle cuMemMap mapped, the physical bytes cuMemUnmap freed, a PyTorch block's stream. Others: none.
AUX_FIELDS = {Api.cuMemMap: "handle", Api.cuMemUnmap: "freed_bytes", Api.pytorch_malloc: "stream",
              Api.pytorch_free: "stream"}
COMM_BYTES = 16  # a thread's name (Event.comm) as the kernel keeps it: at most 15 bytes and a NUL (TASK_COMM_LEN)


def comm_text(raw: bytes) -> str:
    """Event.comm of a thread name as the kernel keeps it (COMM_BYTES, NUL-terminated unless full)."""
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")

# Kinds whose events describe an object with a size (the wire's Allocation payload).
SIZED_KINDS = frozenset({Kind.ALLOC, Kind.FREE, Kind.ALLOC_FAILED, Kind.FREE_FAILED, Kind.FREE_UNKNOWN,
                         Kind.MAP, Kind.UNMAP, Kind.RELEASE})


@dataclass(slots=True)
class Event:
    """One traced call (or a process exit), with its attribution.

    `address` is the pointer, VMM handle or virtual address the call returned or took; for
    context events it is the context.
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
    error_code: int = 0  # the call's CUDA error; a process exit's wait status (signal, or status << 8)
    caller_address: int = 0
    handle: int = 0  # cuMemMap: the physical-memory handle mapped at `address`
    # cuMemUnmap: physical bytes freed (handles released earlier, now unmapped); a process exit: the
    # physical device bytes it still held (the Session fills it in)
    freed_bytes: int = 0
    stream: int = 0  # pytorch_malloc: the CUDA stream id the block was allocated on
    comm: str = ""
    title: str = ""  # full process title from /proc/PID/cmdline (the Session fills it in)
    container: str = ""  # container id from the cgroup path, "" on the host
    stack_id: int = 0  # interned Python stack (model/stacks.py); 0 = none
    stack_status: StackStatus = StackStatus.NOT_WALKED
    source: Source = Source.UPROBE
    # pytorch_malloc: the mean S in bytes of the stack sampling its block was subject to (0: not subject,
    # exact): a stack_status of NOT_SAMPLED says sampling passed it over, any other that it chose it. Its
    # ledger entry says the same (Outstanding.sample_bytes, .sampled), whichever ledger it is built in.
    sample_bytes: int = 0


class RawRecords(Protocol):
    """The records a source decoded an EventRun from, as they came: what a wire encoder copies instead
    of reading each event (sources/bpf/decode.py's RawEvents)."""

    def __len__(self) -> int: ...

    def columns(self) -> dict[str, bytes]:
        """Each FixedEventColumns column of these events but `processes`, little-endian, by field name."""
        ...

    @property
    def timestamp_offset_ns(self) -> int: ...

    @property
    def block_sample_bytes(self) -> int:
        """The mean of the block stack sampling that the `sampling` column's 1s refer to (Event.sample_bytes)."""
        ...

    def sliced(self, start: int, stop: int) -> RawRecords: ...

    def joins(self, other: RawRecords) -> bool:
        """Whether `other`'s columns may follow these in one batch (one timestamp offset, one sampling mean)."""
        ...


class EventRun(list):  # list[Event]; a generic list subclass is not a runtime class in 3.10
    """Events a source read at once, in order, with the raw records they were decoded from (`raw`): a
    stream may send those copied as they are. Only the uprobes' events of the Session's run kinds
    (allocation-type, no stack), so nothing but their labels changes after decoding.

    `pids` and `kinds` (raw numbers) are those of the events (a slice keeps its whole run's: a superset).
    `labels`: pid -> (title, container) as the Session labelled the events, each of their pids; None for
    a process it knew nothing of (the events' title is their comm). None until then: not to be copied.
    A list: every sink that takes events takes a run."""

    __slots__ = ("raw", "pids", "kinds", "labels")

    def __init__(self, events: list[Event], raw: RawRecords, pids: frozenset[int], kinds: frozenset[int]) -> None:
        super().__init__(events)
        if len(raw) != len(events):
            raise ValueError(f"{len(events)} events from {len(raw)} records")
        self.raw = raw
        self.pids = pids
        self.kinds = kinds
        self.labels: Mapping[int, tuple[str, str] | None] | None = None

    def sliced(self, start: int, stop: int) -> EventRun:
        """Events start..stop (clamped, as a list slice), with their records."""
        start, stop, _ = slice(start, stop).indices(len(self))
        part = EventRun(self[start:stop], self.raw.sliced(start, stop), self.pids, self.kinds)
        part.labels = self.labels
        return part


@dataclass(frozen=True, slots=True)
class EventsLost:
    """Events a source could not deliver (its ring buffer was full), reported where the gap is."""

    count: int
    timestamp_ns: int
