"""`kvtrace run`'s tracer inside the traced process: CUPTI (through NVIDIA's cupti-python) tells it, on
the allocating thread, about every driver allocation and VMM call, with the Python stack that made it, and
about every allocation and release of device, pinned and managed memory (activity records). It sends them
to `kvtrace run` over the Unix socket in KVTRACE_CUPTI_SOCKET, in protocol.py's messages.

Every Python process of the run imports this through boot/sitecustomize.py; only one that initialises
CUDA subscribes to CUPTI. By default that is when torch initialises CUDA: torch's C++ calls
`torch.cuda._lazy_init` through the module attribute before anything touches the GPU, so a wrapper on that
attribute (put there by an import hook right after torch.cuda executed) subscribes first, once, and then
calls torch's. KVTRACE_CUPTI_EAGER=1 subscribes at start-up instead (programs without torch). Only then
does the process connect (HELLO, then a STATUS: tracing, held, unavailable or off), so the many Python
processes of a run that never touch CUDA stay silent. The last records go at exit (atexit); a process that
ends with os._exit (multiprocessing's forked workers) loses what the last second's flush did not send.

Who holds each block (KVTRACE_CUPTI_BLOCKS=1, what `kvtrace run --output` sets unless --blocks never): CUPTI
sees the caching allocator's segments only, and a segment's stack names whoever made the cache grow, not
what holds its bytes now. PyTorch's own recorder knows each live block's stack; at its cheapest (enabled
"state", context "state", stacks "python": no event history, no C++ unwinding) kvtrace turns it on right
after torch initialised CUDA (or reads the program's own, if it records already, never turning that off),
and reads it once, at the process's exit, as BLOCKS. It is read only then, with CUPTI given back first and
the GIL let go for a moment: the recorder's snapshot waits for the allocator's lock while holding the GIL,
and a CUPTI callback (Python, so it needs the GIL) runs inside cudaMalloc under that lock. With no new
callbacks, and those already waiting let through, the snapshot waits for no one who waits for it, short of
a thread entering a callback in the instant CUPTI was given back. The recorder is visible to the program
(torch._C._cuda_isHistoryEnabled() is true); a program that turns it off leaves its later blocks without
a stack.

Never harmful to the target:
- CUPTI allows one subscriber. When torch.profiler (Kineto), Nsight or dynolog holds it, kvtrace says
  "held" and touches nothing more: on the H200, touching the activity API after a failed subscribe while
  Kineto held CUPTI hung the process forever. A missing or mismatched cupti-python is "unavailable" with
  the `pip install` that fixes it. KVTRACE_CUPTI=0 leaves CUPTI alone ("off"). Each of these is one STATUS
  message; the program runs as it would have.
- The API callback runs inside the driver call on the program's thread: it reads the call's params with
  ctypes, packs one record and appends it to a bounded queue (over the bound: dropped, counted, and a LOST
  message where the gap is). It never raises; its errors are counted. Stack walks are limited to a share
  of wall time (KVTRACE_CUPTI_STACK_BUDGET); over it, calls go without a stack.
- A daemon thread flushes CUPTI's buffers and sends once a second (the socket blocks at most 2 s); a
  socket that breaks stops the tracer, never the program.
- A forked child is not its parent: it closes the inherited connection without a word and, if the parent
  had initialised CUDA (the child cannot use it), stays off.

Standard library only at import (this runs in the user's Python, in every process of the run); cupti is
imported when subscribing.

Why this module is long (about 1 200 lines): it is imported into every Python process of a run, and may import
only the standard library and two small kvtrace modules (tests/unit/test_cupti_tracer.py holds the list); what
it needs cannot live in the package's other rooms without bringing them into the user's program.
"""
from __future__ import annotations

import atexit
import ctypes
import functools
import importlib.abc
import os
import platform
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import CodeType, FrameType, ModuleType
from typing import Any

from kvtrace.model.events import DEVICE_UNKNOWN, Api, StackStatus
from kvtrace.sources.cupti import protocol
from kvtrace.sources.post_import import wrapped_spec

OPT_OUT_ENV = "KVTRACE_CUPTI"  # "0": leave CUPTI to the user's profiler
EAGER_ENV = "KVTRACE_CUPTI_EAGER"  # "1": subscribe at start-up, not at torch's CUDA initialisation
STACK_FRAMES_ENV = "KVTRACE_CUPTI_STACK_FRAMES"
STACK_BUDGET_ENV = "KVTRACE_CUPTI_STACK_BUDGET"
BLOCKS_ENV = "KVTRACE_CUPTI_BLOCKS"  # "1": PyTorch's recorder on at CUDA's start, its blocks read at exit
# "1": also say on stderr why CUPTI does not trace this process (`kvtrace run` towards the agent: the STATUS
# goes to the agent's log, where the user running the program never looks). The first process to say it
# sets it to "0", so that the processes it starts do not repeat it.
TELL_ENV = "KVTRACE_CUPTI_TELL"
# pyproject.toml's extras that bring cupti-python, by CUDA major version.
CUPTI_EXTRAS = {13: "cupti13"}
DEFAULT_STACK_FRAMES = 48
MAX_STACK_FRAMES = 256  # a STACK message stays far below protocol.MAX_BODY_BYTES
DEFAULT_STACK_BUDGET = 0.02  # share of wall time the stack walks may take
# Unused stack-walk time is saved up for this long at most: a burst of allocations at start-up gets its
# stacks, a process idle for an hour does not earn a long stretch of unbounded walking.
STACK_BUDGET_WINDOW_NS = 5_000_000_000
MAX_STACKS = 65_536  # distinct stacks interned per process; beyond, calls go without one (counted)
PENDING_LIMIT_BYTES = 16 << 20  # records waiting to be sent; beyond, dropped and counted
ACTIVITY_BUFFER_BYTES = 8 << 20
FLUSH_INTERVAL_SECONDS = 1.0  # cupti.activity_flush_period did not deliver on the H200; explicit flushes did
STATUS_INTERVAL_SECONDS = 10.0
SEND_TIMEOUT_SECONDS = 2.0
CALLBACKS_DRAIN_SECONDS = 0.05  # at exit, between giving CUPTI back and reading PyTorch's blocks

SUBSCRIBER_NAME = "kvtrace"
OPT_OUT_REASON = "KVTRACE_CUPTI=0: CUPTI left to the user's profiler"
TORCH_PROFILER = "torch.profiler (Kineto)"
UNKNOWN_HOLDER = "another CUPTI subscriber (Nsight, dynolog)"
CUDA_SUCCESS = 0
RESULT_UNKNOWN = -1  # the callback data had no return value
CU_MEM_LOCATION_TYPE_DEVICE = 1
NO_CALL_VALUES = (0, 0, 0, DEVICE_UNKNOWN)

# Where this module's frames are told apart in a walk (its own callback, the _lazy_init wrapper).
_OWN_FILENAME = sys._getframe().f_code.co_filename
_FINDER_MARK = "_kvtrace_cupti_finder"
_WRAPPED_MARK = "_kvtrace_original"

# CUpti_CallbackData on x86_64: functionParams and functionReturnValue (a pointer to the CUresult).
CALLBACK_PARAMS_OFFSET = 16
CALLBACK_RETURN_VALUE_OFFSET = 24


# ---- reading a call's params (every field of the driver's params structs is pointer-sized) ----


def _u64(address: int) -> int:
    return ctypes.c_uint64.from_address(address).value


def _i32(address: int) -> int:
    return ctypes.c_int32.from_address(address).value


def _written(params: int, offset: int, succeeded: bool) -> int:
    """What the call wrote through the out-pointer at params+offset; 0 unless it succeeded (a failed call
    leaves the caller's variable as it was)."""
    if not succeeded:
        return 0
    pointer = _u64(params + offset)
    return _u64(pointer) if pointer else 0


CallValues = tuple[int, int, int, int]  # address, size_bytes, handle, device


def _read_allocation(params: int, succeeded: bool) -> CallValues:
    """{CUdeviceptr *dptr | void **pp; size_t bytesize; ...}: every allocating function but the pitched."""
    return _written(params, 0, succeeded), _u64(params + 8), 0, DEVICE_UNKNOWN


def _read_allocation_pitch(params: int, succeeded: bool) -> CallValues:
    """{CUdeviceptr *dptr; size_t *pPitch; size_t WidthInBytes; size_t Height; unsigned ElementSizeBytes}:
    pitch x height bytes; a failed call wrote no pitch, so the width it asked for."""
    pitch_bytes = _written(params, 8, succeeded) or _u64(params + 16)
    return _written(params, 0, succeeded), pitch_bytes * _u64(params + 24), 0, DEVICE_UNKNOWN


def _read_mem_create(params: int, succeeded: bool) -> CallValues:
    """{CUmemGenericAllocationHandle *handle; size_t size; const CUmemAllocationProp *prop; flags}: the
    device is prop->location.id when prop->location.type is a device."""
    prop = _u64(params + 16)
    device = _i32(prop + 12) if prop and _i32(prop + 8) == CU_MEM_LOCATION_TYPE_DEVICE else DEVICE_UNKNOWN
    return 0, _u64(params + 8), _written(params, 0, succeeded), device


def _read_mem_release(params: int, succeeded: bool) -> CallValues:
    """{CUmemGenericAllocationHandle handle}."""
    return 0, 0, _u64(params), DEVICE_UNKNOWN


def _read_mem_map(params: int, succeeded: bool) -> CallValues:
    """{CUdeviceptr ptr; size_t size; size_t offset; CUmemGenericAllocationHandle handle; flags}."""
    return _u64(params), _u64(params + 8), _u64(params + 24), DEVICE_UNKNOWN


def _read_address_reserve(params: int, succeeded: bool) -> CallValues:
    """{CUdeviceptr *ptr; size_t size; size_t alignment; CUdeviceptr addr; flags}."""
    return _written(params, 0, succeeded), _u64(params + 8), 0, DEVICE_UNKNOWN


def _read_address_free(params: int, succeeded: bool) -> CallValues:
    """{CUdeviceptr ptr; size_t size}."""
    return _u64(params), _u64(params + 8), 0, DEVICE_UNKNOWN


# The driver functions whose callbacks kvtrace enables. No frees but cuMemUnmap (MEMORY2 release records carry
# them; the VMM's came only at exit on the H200, so maps and unmaps are taken from their callbacks) and
# no runtime API: cudaMalloc and the cuMemAlloc_v2 inside it share one correlation id (seen on the H200).
_CALLS: dict[str, tuple[Api, Callable[[int, bool], CallValues]]] = {
    "cuMemAlloc_v2": (Api.cuMemAlloc_v2, _read_allocation),
    "cuMemAllocPitch_v2": (Api.cuMemAllocPitch_v2, _read_allocation_pitch),
    "cuMemAllocManaged": (Api.cuMemAllocManaged, _read_allocation),
    "cuMemAllocHost_v2": (Api.cuMemAllocHost_v2, _read_allocation),
    "cuMemHostAlloc": (Api.cuMemHostAlloc, _read_allocation),
    "cuMemAllocAsync": (Api.cuMemAllocAsync, _read_allocation),
    "cuMemAllocAsync_ptsz": (Api.cuMemAllocAsync, _read_allocation),
    "cuMemAllocFromPoolAsync": (Api.cuMemAllocAsync, _read_allocation),
    "cuMemAllocFromPoolAsync_ptsz": (Api.cuMemAllocAsync, _read_allocation),
    "cuMemCreate": (Api.cuMemCreate, _read_mem_create),
    "cuMemRelease": (Api.cuMemRelease, _read_mem_release),
    "cuMemMap": (Api.cuMemMap, _read_mem_map),
    "cuMemUnmap": (Api.cuMemUnmap, _read_address_free),  # {CUdeviceptr ptr; size_t size}, as cuMemAddressFree
    "cuMemAddressReserve": (Api.cuMemAddressReserve, _read_address_reserve),
    "cuMemAddressFree": (Api.cuMemAddressFree, _read_address_free),
}
TRACED_FUNCTIONS = tuple(_CALLS)
# CUpti_ActivityMemoryKind values whose MEMORY2 records are sent; static module memory (DEVICE_STATIC,
# correlation 0 on the H200) and the rest are no allocation of the program's.
KEPT_MEMORY_KINDS = frozenset({protocol.MEMORY_KIND_PINNED, protocol.MEMORY_KIND_DEVICE,
                               protocol.MEMORY_KIND_MANAGED})


# ---- settings ----


@dataclass(frozen=True)
class Settings:
    socket_path: str
    enabled: bool = True  # False: KVTRACE_CUPTI=0
    eager: bool = False
    stack_frames: int = DEFAULT_STACK_FRAMES
    stack_budget: float = DEFAULT_STACK_BUDGET
    blocks: bool = False  # KVTRACE_CUPTI_BLOCKS=1
    tell: bool = False  # KVTRACE_CUPTI_TELL=1

    @classmethod
    def from_environment(cls, environ: Mapping[str, str]) -> Settings | None:
        """None without KVTRACE_CUPTI_SOCKET (not run by `kvtrace run`). A malformed number is the default:
        a typo must not stop the program."""
        path = environ.get(protocol.SOCKET_ENV, "")
        if not path:
            return None
        frames = _number(environ.get(STACK_FRAMES_ENV), int, DEFAULT_STACK_FRAMES)
        budget = _number(environ.get(STACK_BUDGET_ENV), float, DEFAULT_STACK_BUDGET)
        return cls(socket_path=path, enabled=environ.get(OPT_OUT_ENV, "1") != "0",
                   eager=environ.get(EAGER_ENV, "0") == "1", blocks=environ.get(BLOCKS_ENV, "0") == "1",
                   tell=environ.get(TELL_ENV, "0") == "1",
                   stack_frames=min(max(frames, 0), MAX_STACK_FRAMES), stack_budget=max(budget, 0.0))


def _number(text: str | None, kind: Callable[[str], Any], default: Any) -> Any:
    if text is None:
        return default
    try:
        return kind(text)
    except ValueError:
        return default


# ---- Python stacks ----


class StackBudget:
    """Keeps stack walks under `fraction` of wall time: credit accrues at fraction x elapsed time, saved up
    for STACK_BUDGET_WINDOW_NS at most (the initial credit); a walk spends what it took; no credit, no walk."""

    def __init__(self, fraction: float, clock_ns: Callable[[], int] = time.perf_counter_ns) -> None:
        self._fraction = fraction
        self._cap_ns = fraction * STACK_BUDGET_WINDOW_NS
        self._credit_ns = self._cap_ns
        self._clock_ns = clock_ns
        self._last_ns = clock_ns()

    def allows(self) -> bool:
        now_ns = self._clock_ns()
        self._credit_ns = min(self._cap_ns, self._credit_ns + (now_ns - self._last_ns) * self._fraction)
        self._last_ns = now_ns
        return self._credit_ns > 0

    def spend(self, cost_ns: int) -> None:
        self._credit_ns -= cost_ns


@dataclass
class Walk:
    """One walk from the allocating frame outward: its key ((id(code), f_lasti) per frame: code objects'
    hashes are computed each time, their ids are not), the frames themselves, and whether it was cut."""

    key: tuple[tuple[int, int], ...]
    frames: list[FrameType]
    truncated: bool


class WalkTable:
    """Walks and interns the Python stacks of allocating calls; ids are this process's own, from 1. Every
    code object of an interned stack is kept alive, so that its id() in a key can never be another's."""

    def __init__(self, max_frames: int, budget: StackBudget) -> None:
        self._max_frames = max_frames
        self._budget = budget
        # walks' keys ((id(code), f_lasti) per frame) and PyTorch recorder's ((name, filename, line)): never equal
        self._ids: dict[tuple, int] = {}
        self._codes: dict[int, CodeType] = {}
        self._next_id = 1
        self.stacks = 0
        self.skipped = 0
        self.walk_ns = 0

    def walk(self, frame: FrameType | None) -> Walk | None:
        """None when no walk is allowed now (the budget is spent, or stacks are off)."""
        if self._max_frames <= 0 or not self._budget.allows():
            self.skipped += 1
            return None
        key: list[tuple[int, int]] = []
        frames: list[FrameType] = []
        while frame is not None:
            code = frame.f_code
            if code.co_filename != _OWN_FILENAME:
                if len(frames) == self._max_frames:
                    return Walk(tuple(key), frames, truncated=True)
                key.append((id(code), frame.f_lasti))
                frames.append(frame)
            frame = frame.f_back
        return Walk(tuple(key), frames, truncated=False)

    def intern(self, walk: Walk | None) -> tuple[int, StackStatus, bytes | None]:
        """(stack id, status, the STACK message to send before the call when the stack is new)."""
        if walk is None:
            return 0, StackStatus.NOT_WALKED, None
        if not walk.key:
            return 0, StackStatus.EMPTY, None
        stack_id = self._ids.get(walk.key)
        if stack_id is not None:
            return stack_id, StackStatus.OK, None
        frames = [[_qualname(frame.f_code), frame.f_code.co_filename, frame.f_lineno or 0] for frame in walk.frames]
        stack_id, message = self._add(walk.key, frames, walk.truncated)
        if not stack_id:
            return 0, StackStatus.NOT_WALKED, None
        for frame in walk.frames:
            self._codes[id(frame.f_code)] = frame.f_code
        return stack_id, StackStatus.OK, message

    def intern_frames(self, frames: list[dict]) -> tuple[int, bytes | None]:
        """(stack id, the STACK message to send first when the stack is new) for frames as PyTorch's recorder
        gives them (innermost first: {"name", "filename", "line"}; its Python frames only, and the function's
        name, not its qualified name: the recorder has no other); 0 for none, or past MAX_STACKS."""
        python = [frame for frame in frames if _is_python_file(frame["filename"])]
        if not python or self._max_frames <= 0:
            return 0, None
        kept = python[:self._max_frames]
        key = tuple((frame["name"], frame["filename"], frame["line"]) for frame in kept)
        stack_id = self._ids.get(key)
        if stack_id is not None:
            return stack_id, None
        return self._add(key, [list(names) for names in key], len(python) > len(kept))

    def _add(self, key: tuple, frames: list[list], truncated: bool) -> tuple[int, bytes | None]:
        """A new stack's id and its STACK message; (0, None) past MAX_STACKS (counted as skipped)."""
        if len(self._ids) >= MAX_STACKS:
            self.skipped += 1
            return 0, None
        stack_id = self._next_id
        message = protocol.json_message(protocol.STACK, {"id": stack_id, "frames": frames, "truncated": truncated})
        self._ids[key] = stack_id
        self._next_id += 1
        self.stacks += 1
        return stack_id, message

    def forget(self, walk: Walk) -> None:
        """A new stack whose message could not be queued: it is sent again with the next call that has it."""
        if self._ids.pop(walk.key, None) is not None:
            self.stacks -= 1

    def spend(self, cost_ns: int) -> None:
        self.walk_ns += cost_ns
        self._budget.spend(cost_ns)


def _is_python_file(filename: str) -> bool:
    """A Python frame of PyTorch's recorder (its C++ frames, with stacks="all", name .cpp and .h files)."""
    return filename.endswith(".py") or filename.startswith("<")


def _qualname(code: CodeType) -> str:
    return getattr(code, "co_qualname", code.co_name)  # co_qualname: Python 3.11+


# ---- the queue of what waits to be sent ----

_LAYOUTS = {protocol.CALLS: protocol.CALL_RECORD, protocol.MEMORY: protocol.MEMORY_RECORD,
            protocol.POOLS: protocol.POOL_RECORD}  # message type -> its records' layout
LOST_CALLS = "calls"
LOST_MEMORY_RECORDS = "memory records"


class Outbox:
    """Messages and records in the order they are to be sent, bounded in bytes: a record over the bound is
    dropped and counted, and a LOST message goes where the gap is, as soon as there is room again (or with
    the next send). HELLO and STATUS messages are few and always kept. Not locked: the tracer's lock
    guards it."""

    def __init__(self, limit_bytes: int) -> None:
        self._limit_bytes = limit_bytes
        self._items: list[tuple[int, bytes]] = []  # (type, a whole JSON message or one packed record)
        self._bytes = 0
        self._records = 0
        self._lost: dict[str, int] = {}
        self.dropped = 0

    def add_message(self, kind: int, message: bytes) -> None:
        self._note_gap()
        self._items.append((kind, message))
        self._bytes += len(message)

    def add_call(self, stack_message: bytes | None, record: bytes) -> bool:
        """The call's record and, first, its new stack's message: both or neither."""
        size_bytes = len(record) + (len(stack_message) if stack_message is not None else 0)
        if not self._make_room(size_bytes, LOST_CALLS):
            return False
        if stack_message is not None:
            self._items.append((protocol.STACK, stack_message))
        self._items.append((protocol.CALLS, record))
        self._bytes += size_bytes
        self._records += 1
        return True

    def add_record(self, kind: int, record: bytes) -> None:
        if self._make_room(len(record), LOST_MEMORY_RECORDS):
            self._items.append((kind, record))
            self._bytes += len(record)
            self._records += 1

    def _make_room(self, size_bytes: int, what: str) -> bool:
        if self._bytes + size_bytes > self._limit_bytes:
            self._lost[what] = self._lost.get(what, 0) + 1
            self.dropped += 1
            return False
        self._note_gap()
        return True

    def _note_gap(self) -> None:
        for what, count in self._lost.items():
            message = protocol.json_message(protocol.LOST, {"count": count, "what": what})
            self._items.append((protocol.LOST, message))
            self._bytes += len(message)
        self._lost.clear()

    def take(self) -> tuple[bytes, int]:
        """Everything queued as the bytes to send (consecutive records of a kind packed into messages),
        and how many records that is; the queue is empty after."""
        self._note_gap()
        items, records = self._items, self._records
        self._items, self._bytes, self._records = [], 0, 0
        messages: list[bytes] = []
        run_kind, run = 0, []
        for kind, payload in items:
            if kind == run_kind:
                run.append(payload)
                continue
            if run:
                messages += protocol.packed_messages(run_kind, _LAYOUTS[run_kind], run)
            run_kind, run = 0, []
            if kind in _LAYOUTS:
                run_kind, run = kind, [payload]
            else:
                messages.append(payload)
        if run:
            messages += protocol.packed_messages(run_kind, _LAYOUTS[run_kind], run)
        return b"".join(messages), records


# ---- the connection ----


class Connection:
    """The stream to `kvtrace run`. Sends block for SEND_TIMEOUT_SECONDS at most; the first failure
    closes it for good (what was sent up to a partial send cannot be resumed)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock: socket.socket | None = sock

    @classmethod
    def open(cls, path: str) -> Connection:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(SEND_TIMEOUT_SECONDS)
            sock.connect(path)
        except BaseException:
            sock.close()
            raise
        return cls(sock)

    @property
    def broken(self) -> bool:
        return self._sock is None

    def send(self, data: bytes) -> bool:
        if self._sock is None:
            return False
        try:
            self._sock.sendall(data)
            return True
        except OSError:
            self.close()
            return False

    def close(self) -> None:
        """Closes this process's descriptor only: no shutdown(), which would end a connection a forked
        parent still uses."""
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()


# ---- the tracer ----


class CuptiTracer:
    """One process's tracer: subscribes once (start), then turns CUPTI's callbacks and activity buffers
    into queued records that a daemon thread sends."""

    def __init__(self, settings: Settings, pending_limit_bytes: int = PENDING_LIMIT_BYTES,
                 flush_interval_seconds: float = FLUSH_INTERVAL_SECONDS) -> None:
        self.settings = settings
        self._pending_limit_bytes = pending_limit_bytes
        self._flush_interval_seconds = flush_interval_seconds
        self._start_lock = threading.Lock()  # held through start(): CUDA waits for the subscription
        self._lock = threading.Lock()  # the outbox, the stack table and the counters
        self._send_lock = threading.Lock()  # one send at a time, in queue order
        self._outbox = Outbox(pending_limit_bytes)
        self._walks = WalkTable(settings.stack_frames, StackBudget(settings.stack_budget))
        self._connection: Connection | None = None
        self._cupti: Any = None
        self._cupti_version = ""
        self._subscriber: int | None = None
        self._stop = threading.Event()
        self._flusher: threading.Thread | None = None
        self.started = False  # start() was called: CUDA initialised here (or eager)
        self.state = ""  # the last STATUS state sent
        self._active = False  # tracing: callbacks record
        self._forked_away = False  # this object is a forked parent's copy: silent
        self._api_enter = 0
        self._memory2_kind = -1
        self._memory_pool_kind = -1
        self._calls = 0
        self._memory_records = 0
        self._pool_records = 0
        self._callback_errors = 0
        self._unsent = 0
        self._recorder = ""  # PyTorch's block recorder: "" off, else one of protocol.RECORDERS
        self._recorder_since_ns = 0
        self._recorder_tried = False
        self._blocks_read = 0
        self._blocks_read_ns = 0
        self._blocks_left_out = 0  # past protocol.MAX_BLOCKS

    # -- subscribing --

    def start(self) -> None:
        """Subscribes to CUPTI, once per process, or says in one STATUS why not. Never raises."""
        with self._start_lock:
            if self.started or self._forked_away:
                return
            self.started = True
            try:
                self._start()
            except Exception as error:  # unforeseen: the program goes on, the receiver hears why
                self._refuse("unavailable", f"kvtrace's CUPTI tracer failed to start: {error!r}")

    def _start(self) -> None:
        if not self._connect():
            return
        if not self.settings.enabled:
            self._refuse("off", OPT_OUT_REASON)
            return
        if _torch_profiler_running() or _profiler_preparing():
            self._refuse("held", f"{TORCH_PROFILER} is profiling this process and holds CUPTI: kvtrace stays "
                                 "out of its way", holder=TORCH_PROFILER)
            return
        cupti = self._import_cupti()
        if cupti is None:
            return
        subscriber = self._subscribe(cupti)
        if subscriber is None:
            return  # no further cupti call: after a failed subscribe it could hang (see the module docstring)
        self._cupti, self._subscriber = cupti, subscriber
        self._api_enter = int(cupti.ApiCallbackSite.API_ENTER)
        self._memory2_kind = int(cupti.ActivityKind.MEMORY2)
        self._memory_pool_kind = int(cupti.ActivityKind.MEMORY_POOL)
        self._active = True
        self._queue_status("tracing")  # before the first callback's record
        try:
            self._enable(cupti, subscriber)
        except Exception as error:
            self._active = False
            self._roll_back(cupti, subscriber)
            self._refuse("unavailable", f"CUPTI refused kvtrace's callbacks or activity kinds: {error}")
            return
        self._flusher = threading.Thread(target=self._flush_loop, args=(self._stop,), name="kvtrace-cupti",
                                         daemon=True)
        self._flusher.start()
        self._send_pending()

    def _connect(self) -> bool:
        """The connection, HELLO first in the queue. Unreachable: one line on stderr, and no subscription
        (records nobody receives are not worth the overhead)."""
        path = self.settings.socket_path
        try:
            self._connection = Connection.open(path)
        except OSError as error:
            sys.stderr.write(f"kvtrace: cannot reach {path}: {error}; CUPTI tracing off in pid {os.getpid()}\n")
            return False
        self._cupti_version = _installed_cupti_version()
        hello = {"v": protocol.VERSION, "python": platform.python_version(), "cupti": self._cupti_version,
                 "cuda_driver": _cuda_driver_version(), "argv0": sys.argv[0] if getattr(sys, "argv", None) else ""}
        with self._lock:
            self._outbox.add_message(protocol.HELLO, protocol.json_message(protocol.HELLO, hello))
        atexit.register(self._at_exit)
        return True

    def _import_cupti(self) -> Any:
        """cupti.cupti, or None after the STATUS that says what to install."""
        cuda_major, from_torch = _cuda_major_version()
        wanted = install_hint(cuda_major)
        try:
            from cupti import cupti  # type: ignore[import-not-found]
        except ImportError:
            self._refuse("unavailable", f"CUPTI's Python package (cupti-python) is missing in {sys.executable}; "
                                        f"{wanted}")
            return None
        except Exception as error:  # installed, but its libraries would not load
            self._refuse("unavailable", f"cupti-python failed to load ({error!r}): {wanted}")
            return None
        mismatch = _version_mismatch(self._cupti_version, cuda_major, from_torch)
        if mismatch:
            self._refuse("unavailable", f"{mismatch}: {wanted}")
            return None
        return cupti

    def _subscribe(self, cupti: Any) -> int | None:
        params = cupti.SubscriberParams()
        params.struct_size = cupti.SUBSCRIBER_PARAMS_SIZE
        params.subscriber_name = SUBSCRIBER_NAME
        try:
            return int(cupti.subscribe_v2(self._on_api, None, params.ptr))
        except cupti.cuptiError as error:
            if error.status == cupti.Result.ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED:
                holder = params.old_subscriber_name or UNKNOWN_HOLDER
                self._refuse("held", f"CUPTI is held by {holder}: kvtrace stays out of its way", holder=holder)
            else:
                self._refuse("unavailable", f"cuptiSubscribe_v2 failed: {error}")
        except Exception as error:
            self._refuse("unavailable", f"cuptiSubscribe_v2 failed: {error!r}")
        return None

    def _enable(self, cupti: Any, subscriber: int) -> None:
        domain = cupti.CallbackDomain.DRIVER_API
        for name in TRACED_FUNCTIONS:
            cbid = getattr(cupti.driver_api_trace_cbid, name, None)
            if cbid is not None:  # an older CUDA without it
                cupti.enable_callback(1, subscriber, domain, cbid)
        cupti.activity_enable(cupti.ActivityKind.MEMORY2)
        cupti.activity_enable(cupti.ActivityKind.MEMORY_POOL)
        cupti.activity_register_callbacks(self._buffer_requested, self._buffer_completed)

    def _roll_back(self, cupti: Any, subscriber: int) -> None:
        """Half-enabled: give CUPTI back as it was (we hold the subscription, so these calls are safe)."""
        for undo in (lambda: cupti.unsubscribe(subscriber),
                     lambda: cupti.activity_disable(cupti.ActivityKind.MEMORY2),
                     lambda: cupti.activity_disable(cupti.ActivityKind.MEMORY_POOL)):
            try:
                undo()
            except Exception:
                pass

    def _refuse(self, state: str, reason: str, holder: str = "") -> None:
        """Not tracing, and why: one STATUS, sent now. The connection stays open until the process ends.
        With `tell` (towards the agent), the line `kvtrace run` writes of it for a recording goes to stderr
        too, once per process tree (the user asked for tracing; "off" they asked for)."""
        self._queue_status(state, reason, holder)
        self._send_pending()
        if self.settings.tell and state != "off" and os.environ.get(TELL_ENV) == "1":
            os.environ[TELL_ENV] = "0"
            sys.stderr.write(f"kvtrace run: {not_traced_line(os.getpid(), state, reason, holder)}\n")

    # -- CUPTI's callbacks --

    def _on_api(self, userdata: Any, domain: int, cbid: int, cbdata: Any) -> None:
        """CUPTI's API callback, inside the driver call on the program's thread (holding the GIL). Records
        the call at its exit; never raises."""
        if not self._active:
            return
        try:
            if cbdata.callback_site == self._api_enter:
                return
            self._record_call(cbdata)
        except Exception as error:
            self._callback_failed(error)

    def _record_call(self, cbdata: Any) -> None:
        name = cbdata.function_name
        api, read = _CALLS[name]
        data = int(cbdata.ptr)
        if not data:
            raise ValueError(f"callback data for {name} has no struct")
        params = _u64(data + CALLBACK_PARAMS_OFFSET)
        result_pointer = _u64(data + CALLBACK_RETURN_VALUE_OFFSET)
        result = _i32(result_pointer) if result_pointer else RESULT_UNKNOWN
        address, size_bytes, handle, device = read(params, result == CUDA_SUCCESS) if params else NO_CALL_VALUES
        correlation_id = int(cbdata.correlation_id)
        timestamp_ns = int(self._cupti.get_timestamp())
        with self._lock:  # the walk too: the budget and the counters stay exact across threads
            walk_started_ns = time.perf_counter_ns()
            walk = self._walks.walk(sys._getframe(1))
            stack_id, stack_status, stack_message = self._walks.intern(walk)
            if walk is not None:
                self._walks.spend(time.perf_counter_ns() - walk_started_ns)
            record = protocol.CALL_RECORD.pack(int(api), result, correlation_id, threading.get_native_id(),
                                               stack_id, stack_status, device, address, size_bytes, handle,
                                               timestamp_ns)
            self._calls += 1
            if not self._outbox.add_call(stack_message, record) and stack_message is not None and walk is not None:
                self._walks.forget(walk)

    def _buffer_requested(self) -> tuple[int, int]:
        return ACTIVITY_BUFFER_BYTES, 0  # 0: as many records as fit

    def _buffer_completed(self, activities: Any) -> None:
        """A buffer of activity records (on the flushing thread): the memory ones are queued. Never raises."""
        if not self._active:
            return
        try:
            records = []
            for activity in activities:  # one bad record is counted and lost alone, not its whole buffer
                try:
                    packed = self._pack_activity(activity)
                except Exception as error:
                    self._callback_failed(error)
                    continue
                if packed is not None:
                    records.append(packed)
            with self._lock:
                for kind, record in records:
                    self._outbox.add_record(kind, record)
                    if kind == protocol.MEMORY:
                        self._memory_records += 1
                    else:
                        self._pool_records += 1
        except Exception as error:
            self._callback_failed(error)

    def _pack_activity(self, activity: Any) -> tuple[int, bytes] | None:
        kind = activity.kind
        if kind == self._memory2_kind:
            if activity.memory_kind not in KEPT_MEMORY_KINDS:
                return None
            return protocol.MEMORY, protocol.MEMORY_RECORD.pack(
                activity.memory_operation_type, activity.memory_kind, activity.device_id, activity.correlation_id,
                activity.is_async, activity.address, activity.bytes, activity.timestamp)
        if kind == self._memory_pool_kind:
            return protocol.POOLS, protocol.POOL_RECORD.pack(
                activity.memory_pool_operation_type, activity.memory_pool_type, activity.device_id,
                activity.address, activity.size_, activity.utilized_size, activity.timestamp)
        return None

    # -- PyTorch's block recorder --

    @property
    def recorder_tried(self) -> bool:
        return self._recorder_tried

    def start_recorder(self, torch: ModuleType) -> None:
        """Right after torch initialised CUDA (nothing allocated yet): PyTorch's recorder on at its cheapest,
        or the program's own taken as it is. Once; never raises."""
        if self._recorder_tried:
            return
        self._recorder_tried = True  # first: the recorder may call torch.cuda._lazy_init, which comes back here
        if not self.settings.blocks or not self._active:
            return
        try:
            if torch._C._cuda_isHistoryEnabled():
                self._recorder = "program"
            else:
                torch.cuda.memory._record_memory_history(enabled="state", context="state", stacks="python")
                self._recorder = "kvtrace"
            self._recorder_since_ns = self._now_ns()
        except Exception as error:
            self._callback_failed(error)

    def _queue_blocks(self, torch: ModuleType) -> None:
        """PyTorch's live blocks now, each with its stack (interned), as BLOCKS messages. Called with no CUPTI
        callback left (see the module docstring)."""
        started_ns = time.perf_counter_ns()
        snapshot = torch.cuda.memory._snapshot()
        taken_ns = self._now_ns()
        if not snapshot["segments"]:
            return  # no caching allocator (PYTORCH_NO_CUDA_MEMORY_CACHING=1), or nothing held: no blocks to tell
        live = [(segment["device"], block["address"], block.get("requested_size", block["size"]),
                 block.get("frames") or ())
                for segment in snapshot["segments"] for block in segment["blocks"]
                if block["state"] == "active_allocated"]
        self._blocks_left_out = max(len(live) - protocol.MAX_BLOCKS, 0)
        del live[protocol.MAX_BLOCKS:]
        with self._lock:
            rows = []
            for device, address, size_bytes, frames in live:
                stack_id, stack_message = self._walks.intern_frames(list(frames))
                if stack_message is not None:
                    self._outbox.add_message(protocol.STACK, stack_message)
                rows.append([device, address, size_bytes, stack_id])
            for start in range(0, max(len(rows), 1), protocol.BLOCKS_PER_MESSAGE):
                self._outbox.add_message(protocol.BLOCKS, protocol.json_message(protocol.BLOCKS, {
                    "taken_ns": taken_ns, "since_ns": self._recorder_since_ns, "recorder": self._recorder,
                    "blocks": rows[start:start + protocol.BLOCKS_PER_MESSAGE]}))
            self._blocks_read = len(rows)
            self._blocks_read_ns = time.perf_counter_ns() - started_ns

    def _callback_failed(self, error: Exception) -> None:
        """Counted; the first one is told (once) in a STATUS. The program's call is unaffected."""
        try:
            self._callback_errors += 1
            if self._callback_errors == 1:
                self._queue_status("tracing", f"a CUPTI callback or flush failed (kvtrace goes on; "
                                              f"callback_errors counts them): {error!r}")
        except Exception:
            pass

    # -- sending --

    def _queue_status(self, state: str, reason: str = "", holder: str = "", stopped_ns: int = 0) -> None:
        """A STATUS with the tracer's clock (the records' clock: CUPTI's once subscribed), which the agent
        ties to its own by the arrival; `stopped_ns`: the last records were taken then (at exit)."""
        now_ns = self._now_ns()
        with self._lock:
            status = {"state": state, "reason": reason, "holder": holder, "counters": self._counters(),
                      "now_ns": now_ns}
            if stopped_ns:
                status["stopped_ns"] = stopped_ns
            self._outbox.add_message(protocol.STATUS, protocol.json_message(protocol.STATUS, status))
        self.state = state

    def _now_ns(self) -> int:
        if self._cupti is not None:
            try:
                return int(self._cupti.get_timestamp())
            except Exception:
                pass
        return time.time_ns()

    def _counters(self) -> dict[str, int]:
        return {"calls": self._calls, "memory_records": self._memory_records, "pool_records": self._pool_records,
                "stacks": self._walks.stacks, "stacks_skipped": self._walks.skipped,
                "stack_walk_ns": self._walks.walk_ns, "dropped": self._outbox.dropped + self._unsent,
                "callback_errors": self._callback_errors, "blocks_read": self._blocks_read,
                "blocks_read_ns": self._blocks_read_ns, "blocks_left_out": self._blocks_left_out}

    def counters(self) -> dict[str, int]:
        with self._lock:
            return self._counters()

    def _send_pending(self) -> None:
        """Sends what is queued, in order. A broken connection stops the tracer (what it held is counted
        as dropped); the program goes on."""
        with self._send_lock:
            with self._lock:
                data, records = self._outbox.take()
            connection = self._connection
            if not data or connection is None:
                return
            if not connection.send(data):
                self._active = False
                with self._lock:
                    self._unsent += records

    def _flush_loop(self, stop: threading.Event) -> None:
        next_status = time.monotonic() + STATUS_INTERVAL_SECONDS
        while not stop.wait(self._flush_interval_seconds):
            if not self._active:
                self._give_back_if_unheard()
                return
            # Forced: on the H200 an unforced flush delivered nothing until a buffer filled (8 MiB of
            # records), so a quiet process's records waited for its exit.
            self.flush(complete=True)
            if time.monotonic() >= next_status:
                next_status = time.monotonic() + STATUS_INTERVAL_SECONDS
                self._queue_status("tracing")
                self._send_pending()

    def flush(self, complete: bool = False) -> None:
        """CUPTI's buffers to the queue (complete: also the buffers still being filled), then the queue to
        the socket."""
        if self._active and self._cupti is not None:
            try:
                self._cupti.activity_flush_all(1 if complete else 0)
            except Exception as error:
                self._callback_failed(error)
        self._send_pending()

    def _give_back_if_unheard(self) -> None:
        """The receiver went away (the connection broke): nobody hears the records any more, so CUPTI goes back
        (callbacks and activity kinds off, unsubscribed), and a profiler started later can have it."""
        with self._start_lock:
            connection = self._connection
            if self._cupti is None or self._subscriber is None or connection is None or not connection.broken:
                return
            self._roll_back(self._cupti, self._subscriber)
            self._subscriber = None

    def yield_to(self, holder: str) -> None:
        """A profiler is about to take CUPTI (torch.profiler starting after kvtrace subscribed): the last
        records are sent, CUPTI is given up (activity kinds off, unsubscribed) and a STATUS says who holds it
        now. The profiler then works as it would without kvtrace; the uprobes still trace the process."""
        with self._start_lock:
            if self._cupti is None or self._subscriber is None:
                return
            cupti, subscriber = self._cupti, self._subscriber
            stopped_ns = self._now_ns()
            self.flush(complete=True)
            self._active = False
            self._stop.set()
            self._roll_back(cupti, subscriber)
            self._subscriber = None
            self._queue_status("held", f"{holder} started profiling and took CUPTI: kvtrace gave it up",
                               holder=holder, stopped_ns=stopped_ns)
            self._send_pending()

    def stop(self) -> None:
        """Ends the tracing before the process ends (tests, benchmarks); at exit it ends by itself."""
        atexit.unregister(self._at_exit)
        self._finish()

    def _at_exit(self) -> None:
        try:
            self._finish()
        except Exception:
            pass

    def _finish(self) -> None:
        """The end of this process's tracing: the flusher stopped, the last records and counters sent,
        the connection closed. CUPTI stays subscribed (the process is ending), unless PyTorch's blocks are to
        be read: then it is given back first (see the module docstring)."""
        if self._forked_away:
            return
        self._stop.set()
        flusher = self._flusher
        if flusher is not None and flusher is not threading.current_thread():
            flusher.join(timeout=SEND_TIMEOUT_SECONDS)
        if self._active:
            stopped_ns = self._now_ns()  # calls after this (Python freeing tensors at shutdown) go unseen
            self.flush(complete=True)
            torch = sys.modules.get("torch")
            if self._recorder and torch is not None and self._cupti is not None and self._subscriber is not None:
                # CUPTI given back first: no new callback can then wait for the GIL inside the allocator's lock
                self._active = False
                self._roll_back(self._cupti, self._subscriber)
                self._subscriber = None
                time.sleep(CALLBACKS_DRAIN_SECONDS)  # the GIL let go: a callback already waiting for it returns
                try:
                    self._queue_blocks(torch)
                except Exception as error:
                    self._callback_failed(error)
            self._queue_status("tracing", stopped_ns=stopped_ns)
        self._active = False
        self._send_pending()
        if self._connection is not None:
            self._connection.close()

    def forked_child(self) -> CuptiTracer:
        """This tracer as a fork's child finds it: the copy goes silent, its descriptor closed without a
        word (the connection is the parent's). The child gets a fresh tracer that subscribes at its own CUDA
        initialisation, unless the parent had already initialised CUDA (the child cannot use it)."""
        self._forked_away = True
        self._active = False
        if self._connection is not None:
            self._connection.close()
        atexit.unregister(self._at_exit)
        child = CuptiTracer(self.settings, self._pending_limit_bytes, self._flush_interval_seconds)
        child.started = self.started
        return child


# ---- what the process runs ----


def _torch_profiler_running() -> bool:
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.autograd.profiler._is_profiler_enabled)
    except AttributeError:  # a torch without the flag: nothing to tell
        return False


def _installed_cupti_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("cupti-python")
    except metadata.PackageNotFoundError:
        return ""


def _cuda_driver_version() -> int:
    """cuDriverGetVersion (e.g. 13000), 0 when there is no driver. Needs no cuInit."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int(0)
        if libcuda.cuDriverGetVersion(ctypes.byref(version)) != CUDA_SUCCESS:
            return 0
        return version.value
    except (OSError, AttributeError):
        return 0


def _cuda_major_version() -> tuple[int, bool]:
    """(the CUDA major version of this process, whether it is torch's build rather than the driver's); 0
    unknown. torch's is the runtime the process uses; the driver's is only the newest it supports."""
    torch = sys.modules.get("torch")
    cuda = getattr(getattr(torch, "version", None), "cuda", None)
    if isinstance(cuda, str) and cuda.split(".")[0].isdigit():
        return int(cuda.split(".")[0]), True
    return _cuda_driver_version() // 1000, False


def install_hint(cuda_major: int) -> str:
    """What to install for CUPTI in the program's Python (it is that Python which imports it), for this CUDA
    major version (0: unknown)."""
    where = "install it into the program's Python"
    extra = CUPTI_EXTRAS.get(cuda_major)
    if extra:
        return f"{where}: pip install 'kvtrace[{extra}]' (or \"cupti-python=={cuda_major}.*\")"
    if cuda_major:
        return f"{where}: pip install \"cupti-python=={cuda_major}.*\" (CUDA {cuda_major})"
    extras = ", ".join(f"pip install 'kvtrace[{name}]' for CUDA {major}"
                       for major, name in sorted(CUPTI_EXTRAS.items()))
    return f"{where}: {extras}; for another CUDA major N, pip install \"cupti-python==N.*\""


def not_traced_line(pid: int, state: str, reason: str, holder: str = "",
                    escape: Callable[[str], str] | None = None) -> str:
    """Why CUPTI does not trace a process, as `kvtrace run` says it (its summary; stderr towards the agent);
    "" when it does. Text from the process goes through `escape` (kvtrace.human.printable in the CLI)."""
    escape = escape or _printable
    reason_text = f" ({escape(reason)})" if reason else ""
    if state == "held":
        return f"pid {pid}: CUPTI held by {escape(holder or 'another subscriber')}{reason_text}: not traced"
    if state in ("unavailable", "off"):
        return f"pid {pid}: CUPTI {state}{reason_text}: not traced"
    return ""


def _printable(text: str) -> str:
    """kvtrace.human.printable's escaping, in the standard library only (this module runs in the program)."""
    return "".join(char if char.isprintable() else f"\\x{ord(char):02x}" if ord(char) < 0x100
                   else f"\\u{ord(char):04x}" for char in text)


def _version_mismatch(cupti_version: str, cuda_major: int, from_torch: bool) -> str:
    """Why the installed cupti-python cannot serve this process, "" when it can (or nothing is known).
    Against torch's CUDA it must be the same major (torch loads that CUDA's own libraries); against the
    driver, it must not be newer than the driver supports."""
    head = cupti_version.split(".")[0]
    if not head.isdigit() or not cuda_major:
        return ""
    cupti_major = int(head)
    if from_torch and cupti_major != cuda_major:
        return f"cupti-python {cupti_version} is for CUDA {cupti_major}, but torch here uses CUDA {cuda_major}"
    if not from_torch and cupti_major > cuda_major:
        return f"cupti-python {cupti_version} is for CUDA {cupti_major}, but this driver supports CUDA {cuda_major}"
    return ""


_TRACER: CuptiTracer | None = None
_INSTALL_LOCK = threading.Lock()
_FORK_HOOK_REGISTERED = False


def install_from_environment(environ: Mapping[str, str] | None = None) -> CuptiTracer | None:
    """What boot/sitecustomize.py calls in every process of the run: nothing without KVTRACE_CUPTI_SOCKET;
    else the tracer, subscribing now (KVTRACE_CUPTI_EAGER=1) or at torch's CUDA initialisation.
    Idempotent."""
    global _TRACER, _FORK_HOOK_REGISTERED
    settings = Settings.from_environment(os.environ if environ is None else environ)
    if settings is None:
        return None
    with _INSTALL_LOCK:
        if _TRACER is not None:
            return _TRACER
        tracer = _TRACER = CuptiTracer(settings)
        if not _FORK_HOOK_REGISTERED:
            os.register_at_fork(after_in_child=_after_fork_in_child)
            _FORK_HOOK_REGISTERED = True
    if settings.eager:
        tracer.start()
    else:
        _hook_torch_cuda_init()
    return tracer


def _after_fork_in_child() -> None:
    global _TRACER, _INSTALL_LOCK
    _INSTALL_LOCK = threading.Lock()  # a thread of the parent may have held it
    if _TRACER is not None:
        _TRACER = _TRACER.forked_child()


def _start_at_cuda_init() -> None:
    tracer = _TRACER
    if tracer is not None and not tracer.started:
        tracer.start()


_PROFILER_PREPARING = threading.local()  # torch.profiler is taking CUPTI on this thread right now


def _profiler_preparing() -> bool:
    return bool(getattr(_PROFILER_PREPARING, "depth", 0))


def _wrap_profiler(module: ModuleType) -> None:
    """torch.profiler (Kineto) takes CUPTI when it prepares a trace (torch.autograd.profiler.profile.
    _prepare_trace). kvtrace tracing already: it steps aside first, so that the user's profile is whole
    (CUPTI has one subscriber per process on this driver generation). Not yet: a CUDA start inside the
    preparation finds the profiler taking CUPTI and leaves it alone."""
    profile = getattr(module, "profile", None)
    original = getattr(profile, "_prepare_trace", None)
    if original is None or getattr(original, _WRAPPED_MARK, None) is not None:
        return

    @functools.wraps(original)
    def _prepare_trace(*args: Any, **kwargs: Any) -> Any:
        tracer = _TRACER
        if tracer is not None:
            try:
                tracer.yield_to(TORCH_PROFILER)
            except Exception:
                pass
        _PROFILER_PREPARING.depth = getattr(_PROFILER_PREPARING, "depth", 0) + 1
        try:
            return original(*args, **kwargs)
        finally:
            _PROFILER_PREPARING.depth -= 1

    setattr(_prepare_trace, _WRAPPED_MARK, original)
    setattr(profile, "_prepare_trace", _prepare_trace)  # noqa: B010


# ---- the hook on torch's CUDA initialisation ----


def _hook_torch_cuda_init() -> None:
    missing = False
    for name, wrap in _AFTER_IMPORT.items():
        module = sys.modules.get(name)
        if module is not None:
            wrap(module)
        else:
            missing = True
    if missing and not any(getattr(finder, _FINDER_MARK, False) for finder in sys.meta_path):
        sys.meta_path.insert(0, _TorchCudaFinder())


class _TorchCudaFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for torch.cuda it asks the other finders for the spec and wraps the loader,
    so that _lazy_init is wrapped right after the module's code ran."""

    _kvtrace_cupti_finder = True

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in _AFTER_IMPORT:
            return None
        try:
            return wrapped_spec(fullname, path, target, _FINDER_MARK, functools.partial(_after_import, fullname))
        except Exception:
            return None  # torch imports as if kvtrace were not there


def _wrap_lazy_init(module: ModuleType) -> None:
    """torch.cuda._lazy_init -> subscribe first (once), then torch's own. torch.cuda's submodules that
    bound the original by name (torch.cuda.memory, random) get the wrapper too."""
    original = module.__dict__.get("_lazy_init")
    if original is None or getattr(original, _WRAPPED_MARK, None) is not None:
        return

    @functools.wraps(original)
    def _lazy_init(*args: Any, **kwargs: Any) -> Any:
        try:
            _start_at_cuda_init()
        except Exception:
            pass
        result = original(*args, **kwargs)
        tracer = _TRACER
        if tracer is not None and not tracer.recorder_tried and "torch" in sys.modules:
            tracer.start_recorder(sys.modules["torch"])
        return result

    setattr(_lazy_init, _WRAPPED_MARK, original)
    setattr(module, "_lazy_init", _lazy_init)  # noqa: B010 (a module's attribute, by its name)
    for name, submodule in list(sys.modules.items()):
        if name.startswith("torch.cuda.") and getattr(submodule, "_lazy_init", None) is original:
            setattr(submodule, "_lazy_init", _lazy_init)  # noqa: B010


def _after_import(fullname: str, module: ModuleType) -> None:
    try:
        _AFTER_IMPORT[fullname](module)
    except Exception:
        pass  # torch goes on as if kvtrace were not there


# Modules whose import kvtrace follows, and what it does right after each one's code ran.
_AFTER_IMPORT: dict[str, Callable[[ModuleType], None]] = {"torch.cuda": _wrap_lazy_init,
                                                          "torch.autograd.profiler": _wrap_profiler}


def _reset() -> None:
    """Back to a process where install_from_environment never ran (tests only): the tracer stopped and
    forgotten, the import hook removed. A wrapped torch.cuda._lazy_init stays (without a tracer it only
    calls through)."""
    global _TRACER
    tracer, _TRACER = _TRACER, None
    if tracer is not None:
        tracer.stop()
    sys.meta_path[:] = [finder for finder in sys.meta_path if not getattr(finder, _FINDER_MARK, False)]
