"""One traced process's CUPTI messages -> the model's records, the same events the uprobes make.

    protocol.Decoder ──(type, body)──▶ CuptiDecoder ──Event | EventsLost | StackDefinition | TracerStatus──▶ listener

The tracer inside the process sends two streams about the same calls (protocol.py): CALLs, an API
callback at each allocation-side driver call's exit, sent at once; and MEMORY records (CUPTI's
MEMORY2 activity), flushed about once a second. Neither alone says everything the uprobes do:

- an allocation (cuMemAlloc_v2 and its kin, cuMemMap) is a CALL (api, stack, handle) joined by
  correlation id with its ALLOCATION record (memory kind, device, the bytes given); either may come first;
- a free is only a RELEASE record: what it frees (an allocation, or a mapping: cuMemUnmap) is known from
  this process's state, and so is the api the uprobes would name;
- cuMemCreate, cuMemRelease, cuMemAddressReserve/Free and every failed call are a CALL alone. A CALL whose
  callback carried no result (result < 0) counts only where its record shows it allocated.

Whether a cuMemRelease frees its handle or only marks it (still mapped) depends on the order of that
call and the cuMemUnmap before it, but the unmap's record arrives up to a second after the release's
CALL. So everything is applied in timestamp order: what is ready waits in a heap until the MEMORY
stream has passed its time (the newest record's timestamp), or for HOLD_SECONDS (the tracer flushes
every second), and a join waits at most JOIN_TIMEOUT_NS of record time (or JOIN_TIMEOUT_SECONDS here)
before its half is taken alone. Every bound is counted, none blocks: pending joins, held records, stacks
and the process's live objects.

The pid is the connection's (the kernel's SO_PEERCRED), never a message's. Anything malformed raises
protocol.ProtocolError; the records made before it stay in `finish()`'s result.

Why this module is long (about 780 lines): one state per traced process (the joins waiting for their half,
the heap of records held for order, the live objects), which every part of the decoding reads and changes.
"""
from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvtrace.model.crosscheck import TracerStatus
from kvtrace.model.depth import Depth, DepthCause, ProcessDepth
from kvtrace.model.events import (
    DEVICE_UNKNOWN,
    Api,
    Event,
    EventsLost,
    Kind,
    Layer,
    Memory,
    ObjectKind,
    Source,
    StackStatus,
)
from kvtrace.model.stacks import Frame, Stack
from kvtrace.sources.cupti import protocol
from kvtrace.sources.cupti.protocol import Call, MemoryRecord, ProtocolError

JOIN_TIMEOUT_NS = 5_000_000_000  # a CALL or an ALLOCATION record waits this long (record time) for its other half
JOIN_TIMEOUT_SECONDS = 5.0  # ... or this long here, when the process sends nothing newer
HOLD_SECONDS = 2.5  # a ready record waits at most this long for the MEMORY records before it (flushed each second)
MAX_PENDING = 65536  # CALLs waiting for their record, and records waiting for their CALL (each)
MAX_HELD = 262144  # records ready but held for order; past it the oldest are applied at once
MAX_STACKS = 65536  # stacks one process may define; more are refused (their events say UNRESOLVED)
MAX_LIVE_OBJECTS = 1 << 20  # allocations, mappings, handles and reservations one process may hold here
MAX_FRAMES = 256
MAX_TEXT_CHARS = 1024  # a frame's function or file, a status's reason or holder, a HELLO field
MAX_COUNTERS = 64
MAX_SIZE_BYTES = 1 << 62
MAX_DEVICE = 1023
MAX_U32 = (1 << 32) - 1
MAX_I64 = (1 << 63) - 1
STATUS_STATES = frozenset(protocol.STATES)

# Allocation calls: joined with their ALLOCATION record. memory as the uprobes say it, and the api the
# uprobes name for the free of what each allocated.
_ALLOCATION_APIS: dict[Api, tuple[Memory, Api]] = {
    Api.cuMemAlloc_v2: (Memory.DEVICE, Api.cuMemFree_v2),
    Api.cuMemAllocPitch_v2: (Memory.DEVICE, Api.cuMemFree_v2),
    Api.cuMemAllocManaged: (Memory.MANAGED, Api.cuMemFree_v2),
    Api.cuMemAllocAsync: (Memory.DEVICE, Api.cuMemFreeAsync),
    Api.cuMemAllocHost_v2: (Memory.HOST, Api.cuMemFreeHost),
    Api.cuMemHostAlloc: (Memory.HOST, Api.cuMemFreeHost),
}
_VMM_APIS = frozenset({Api.cuMemCreate, Api.cuMemRelease, Api.cuMemMap, Api.cuMemUnmap, Api.cuMemAddressReserve,
                       Api.cuMemAddressFree})
CALL_APIS = frozenset({*_ALLOCATION_APIS, *_VMM_APIS})
_CALL_API_BY_VALUE = {api.value: api for api in CALL_APIS}
_JOINED_APIS = frozenset(_ALLOCATION_APIS)  # a successful one made a MEMORY record, joined with it
# Maps and unmaps are taken from their CALL alone (it has the handle; on the H200 CUPTI delivered the MEMORY2
# records of VMM mappings, which have no context, only at the process's exit): their records are dropped.
_RECORDED_BY_CALL = frozenset({Api.cuMemMap, Api.cuMemUnmap})
# CUpti_ActivityMemoryKind -> the model's memory, and the api an ALLOCATION record with no CALL stands for.
_MEMORY_KINDS: dict[int, tuple[Memory, Api]] = {
    protocol.MEMORY_KIND_DEVICE: (Memory.DEVICE, Api.cuMemAlloc_v2),
    protocol.MEMORY_KIND_PINNED: (Memory.HOST, Api.cuMemAllocHost_v2),
    protocol.MEMORY_KIND_MANAGED: (Memory.MANAGED, Api.cuMemAllocManaged),
}
_STACK_STATUSES = {status.value: status for status in StackStatus}

_OP_ALLOCATION, _OP_MAP, _OP_RELEASE, _OP_CALL, _OP_LOST = range(5)


@dataclass(frozen=True, slots=True)
class StackDefinition:
    """A stack the process defined, under its own id (events refer to it by that id until the listener
    rewrites them to the Session's)."""

    stack_id: int
    stack: Stack


Output = Event | EventsLost | StackDefinition | TracerStatus | ProcessDepth


@dataclass(slots=True)
class _Allocation:
    api: Api
    memory: Memory
    device: int
    size_bytes: int


@dataclass(slots=True)
class _Handle:
    size_bytes: int
    device: int
    mapped: int = 0
    released: bool = False


@dataclass(slots=True)
class _Mapping:
    size_bytes: int
    handle: int
    device: int


@dataclass(slots=True)
class _Waiting:
    """Half of a join: a CALL waiting for its record, or a record for its CALL."""

    item: Call | MemoryRecord
    arrived: float  # the decoder's clock (monotonic seconds)
    sequence: int  # arrival order: among equal timestamps, what came first goes first


@dataclass(slots=True)
class _Op:
    """Something ready to apply, held in timestamp order."""

    what: int  # _OP_*
    call: Call | None = None
    record: MemoryRecord | None = None
    lost: int = 0


@dataclass
class DecoderCounters:
    events: int = 0
    unjoined: int = 0  # halves of a join evicted past MAX_PENDING, taken alone
    stale: int = 0  # halves of a join that waited past the timeout, taken alone
    late: int = 0  # the other half of a join already taken alone: dropped (its event was made)
    mismatched: int = 0  # a cuMemMap whose record names another range than its CALL
    forced: int = 0  # held records applied early past MAX_HELD
    ignored: int = 0  # records of memory the ledger keeps not (pageable, arrays, ...), pool records
    stacks_refused: int = 0
    untracked: int = 0  # objects refused past MAX_LIVE_OBJECTS
    lost: int = 0  # what the tracer itself said it lost
    vmm_records: int = 0  # MEMORY2 records of maps and unmaps, whose CALLs said it all
    blocks: int = 0  # PyTorch's live blocks at the exit (BLOCKS)

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


class CuptiDecoder:
    """One connection's (one process's) messages -> model records. Not thread-safe: one reader."""

    def __init__(self, pid: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.pid = pid
        self._clock = clock
        self.counters = DecoderCounters()
        self.hello: dict[str, str] | None = None
        self.status: TracerStatus | None = None
        self._stacks: dict[int, Stack] = {}
        self._out: list[Output] = []
        # Joins, oldest first (insertion order): correlation id -> the half that came first.
        self._pending_calls: dict[int, _Waiting] = {}
        self._pending_records: dict[int, _Waiting] = {}
        # Correlation ids whose half was taken alone: the other half, late, is dropped.
        self._alone_calls: dict[int, None] = {}
        self._alone_records: dict[int, None] = {}
        self._by_call: dict[int, None] = {}  # correlation ids of maps and unmaps: their records are dropped
        self._held: list[tuple[int, int, float, _Op]] = []  # heap of (timestamp, sequence, arrived, op)
        self._sequence = 0
        self._newest_ns = 0  # the newest timestamp of any record
        self._memory_newest_ns = 0  # of any MEMORY record: the activity stream has passed this
        # The process's live objects, as the uprobes' kernel ledger keeps them.
        self._allocations: dict[int, _Allocation] = {}
        self._mappings: dict[int, _Mapping] = {}
        self._handles: dict[int, _Handle] = {}
        self._reservations: dict[int, tuple[int, int]] = {}  # address -> (size, device)
        self._overflow = ""
        self._blocks_seen = False

    # ---- input ----

    def feed(self, kind: int, body: bytes) -> list[Output]:
        """One message; returns the records now ready (statuses and stacks at once, events in order)."""
        if self.hello is None and kind != protocol.HELLO:
            raise ProtocolError("the first message must be HELLO")
        now = self._clock()
        if kind == protocol.HELLO:
            self._hello(body)
        elif kind == protocol.STATUS:
            self._status(body)
        elif kind == protocol.STACK:
            self._stack(body)
        elif kind == protocol.CALLS:
            calls = [self._call(fields) for fields in protocol.unpack(protocol.CALL_RECORD, body)]
            for call in calls:
                self._take_call(call, now)
        elif kind == protocol.MEMORY:
            records = [self._memory(fields) for fields in protocol.unpack(protocol.MEMORY_RECORD, body)]
            for record in records:
                self._take_record(record, now)
        elif kind == protocol.POOLS:
            for fields in protocol.unpack(protocol.POOL_RECORD, body):
                self._pool(fields)
        elif kind == protocol.LOST:
            self._lost(body, now)
        elif kind == protocol.BLOCKS:
            self._blocks(body)
        else:
            raise ProtocolError(f"unknown message type {kind}")
        self._drain(now)
        return self._take_output()

    def expire(self) -> list[Output]:
        """What waited long enough (call it now and then: a process that sends nothing more still has
        its last records applied)."""
        self._drain(self._clock())
        return self._take_output()

    def finish(self) -> list[Output]:
        """The connection is over: every half-join is taken alone, everything held is applied. Also
        after a ProtocolError (what came before it is kept)."""
        self._apply_all_waiting()
        self._allocations.clear()
        self._mappings.clear()
        self._handles.clear()
        self._reservations.clear()
        out, self._out = self._out, []
        return out

    def _apply_all_waiting(self) -> None:
        """Nothing more will come before what waits: every half-join taken alone, everything held applied, in
        order."""
        for waiting in (self._pending_calls, self._pending_records):
            while waiting:
                self._resolve_alone(waiting, next(iter(waiting)))
        while self._held:
            self._apply(heapq.heappop(self._held)[3])

    def _take_output(self) -> list[Output]:
        if self._overflow:
            raise ProtocolError(self._overflow)
        out, self._out = self._out, []
        return out

    # ---- messages ----

    def _hello(self, body: bytes) -> None:
        if self.hello is not None:
            raise ProtocolError("a second HELLO")
        value = protocol.decode_json(body)
        version = value.get("v")
        if type(version) is not int or version != protocol.VERSION:
            raise ProtocolError(f"protocol version {str(version)[:20]}, not {protocol.VERSION} (the tracer and the "
                                "collector are of different kvtrace releases: run the same one)")
        hello = {}
        for key in ("python", "cupti", "cuda_driver", "argv0"):
            field = value.get(key)
            if type(field) is int:  # cuda_driver is CUDA's version number, 13000
                hello[key] = str(field)
            elif field is not None:
                hello[key] = _text(field, f"HELLO's {key}", empty=True)
        self.hello = hello
        parts = [f"{name} {self.hello[key]}" for key, name in (("cupti", "CUPTI"), ("cuda_driver", "CUDA driver"),
                                                                ("python", "Python")) if self.hello.get(key)]
        self._out.append(TracerStatus(self.pid, "connected", ", ".join(parts), timestamp_ns=time.time_ns()))

    def _status(self, body: bytes) -> None:
        value = protocol.decode_json(body)
        state = value.get("state")
        if state not in STATUS_STATES:
            raise ProtocolError(f"state {str(state)[:40]!r} is not one of {', '.join(protocol.STATES)}")
        counters = value.get("counters", {})
        if type(counters) is not dict or len(counters) > MAX_COUNTERS:
            raise ProtocolError(f"counters must be an object of at most {MAX_COUNTERS} names")
        checked = {_text(name, "a counter's name", max_chars=64): _int(number, f"counter {name[:64]!r}", 0, MAX_I64)
                   for name, number in counters.items()}
        times = {name: _int(value.get(name, 0), name, 0, MAX_I64) for name in ("stopped_ns", "now_ns")}
        self.status = TracerStatus(self.pid, str(state), _text(value.get("reason") or "", "reason", empty=True),
                                   _text(value.get("holder") or "", "holder", empty=True), checked,
                                   time.time_ns(), stopped_ns=times["stopped_ns"], sent_ns=times["now_ns"])
        self._out.append(self.status)

    def _stack(self, body: bytes) -> None:
        value = protocol.decode_json(body)
        stack_id = _int(value.get("id"), "a stack's id", 1, MAX_U32)
        frames = value.get("frames")
        if type(frames) is not list or len(frames) > MAX_FRAMES:
            raise ProtocolError(f"a stack's frames must be a list of at most {MAX_FRAMES}")
        checked = []
        for index, frame in enumerate(frames):
            if type(frame) is not list or len(frame) != 3:
                raise ProtocolError(f"frame {index} must be [function, file, line]")
            function, file, line = frame
            checked.append(Frame(_text(function, f"frame {index}'s function"),
                                 _text(file, f"frame {index}'s file", empty=True),
                                 _int(line, f"frame {index}'s line", 0, (1 << 31) - 1)))
        truncated = value.get("truncated", False)
        if type(truncated) is not bool:
            raise ProtocolError("a stack's truncated must be true or false")
        stack = Stack(tuple(checked), truncated)
        known = self._stacks.get(stack_id)
        if known is not None:
            if known != stack:
                raise ProtocolError(f"stack id {stack_id} defined twice, differently")
            return
        if len(self._stacks) >= MAX_STACKS:
            self.counters.stacks_refused += 1
            return
        self._stacks[stack_id] = stack
        self._out.append(StackDefinition(stack_id, stack))

    def _call(self, fields: tuple) -> Call:
        (api_value, result, correlation_id, tid, stack_id, stack_status, device, address, size_bytes, handle,
         timestamp_ns) = fields
        if api_value not in _CALL_API_BY_VALUE:
            raise ProtocolError(f"a CALL of api {api_value}, not one the tracer reports")
        if stack_status not in _STACK_STATUSES:
            raise ProtocolError(f"a CALL's stack status {stack_status} is unknown")
        _check_common(device, size_bytes, timestamp_ns, "CALL")
        if stack_id and stack_id not in self._stacks:
            stack_id, stack_status = 0, StackStatus.UNRESOLVED.value
        return Call(api_value, result, correlation_id, tid, stack_id, stack_status, device, address, size_bytes,
                    handle, timestamp_ns)

    @staticmethod
    def _memory(fields: tuple) -> MemoryRecord:
        operation, memory_kind, device, correlation_id, is_async, address, size_bytes, timestamp_ns = fields
        if operation not in (protocol.MEMORY_ALLOCATION, protocol.MEMORY_RELEASE):
            raise ProtocolError(f"a MEMORY record's operation {operation} is neither 1 (allocation) nor 2 (release)")
        _check_common(device, size_bytes, timestamp_ns, "MEMORY record")
        return MemoryRecord(operation, memory_kind, device, correlation_id, is_async, address, size_bytes,
                            timestamp_ns)

    def _pool(self, fields: tuple) -> None:
        """Pool records: checked and counted; the allocations inside pools come as MEMORY records."""
        _operation, _pool_type, device, _address, size_bytes, utilized_bytes, timestamp_ns = fields
        _check_common(device, size_bytes, timestamp_ns, "POOL record")
        if utilized_bytes >= MAX_SIZE_BYTES:
            raise ProtocolError(f"a POOL record's utilized bytes {utilized_bytes} is out of range")
        self.counters.ignored += 1

    def _lost(self, body: bytes, now: float) -> None:
        value = protocol.decode_json(body)
        count = _int(value.get("count"), "LOST count", 0, MAX_I64)
        _text(value.get("what", ""), "what", empty=True)
        if count:
            self.counters.lost += count
            self._hold(self._newest_ns, _Op(_OP_LOST, lost=count), now)

    def _blocks(self, body: bytes) -> None:
        """PyTorch's live blocks at the process's exit: the process is at depth full from when the recorder
        started (every block's stack since), and each block an allocation event at the time they were read,
        after everything the process sent before (applied first, in order)."""
        value = protocol.decode_json(body)
        taken_ns = _int(value.get("taken_ns"), "BLOCKS taken_ns", 1, MAX_I64)
        since_ns = _int(value.get("since_ns"), "BLOCKS since_ns", 0, taken_ns)
        recorder = value.get("recorder")
        if recorder not in protocol.RECORDERS:
            raise ProtocolError(f"BLOCKS recorder {str(recorder)[:24]!r} is not one of "
                                f"{', '.join(protocol.RECORDERS)}")
        blocks = value.get("blocks")
        if type(blocks) is not list or self.counters.blocks + len(blocks) > protocol.MAX_BLOCKS:
            raise ProtocolError(f"BLOCKS must list at most {protocol.MAX_BLOCKS} blocks in all")
        rows = []
        for row in blocks:
            if type(row) is not list or len(row) != 4:
                raise ProtocolError("a block must be [device, address, bytes, stack id]")
            device = _int(row[0], "a block's device", 0, MAX_DEVICE)
            rows.append((device, _int(row[1], "a block's address", 1, MAX_I64),
                         _int(row[2], "a block's size", 0, MAX_SIZE_BYTES - 1),
                         _int(row[3], "a block's stack", 0, MAX_U32)))
        if not self._blocks_seen:
            self._blocks_seen = True
            # The process's last records came before (its final flush): what waits is applied first. The blocks
            # are the last word.
            self._apply_all_waiting()
            self._out.append(ProcessDepth(self.pid, Depth.FULL, since_ns, DepthCause.CONFIGURED,
                                          f"kvtrace run: {protocol.RECORDERS[recorder]}; blocks read at the exit"))
        for device, address, size_bytes, stack_id in rows:
            self.counters.blocks += 1
            self.counters.events += 1
            self._out.append(Event(
                kind=Kind.ALLOC, api=Api.pytorch_malloc, pid=self.pid, tid=self.pid, timestamp_ns=taken_ns,
                layer=Layer.TORCH, object=ObjectKind.BLOCK, memory=Memory.DEVICE, size_bytes=size_bytes,
                address=address, device=device, stack_id=stack_id,
                stack_status=StackStatus.OK if stack_id else StackStatus.NOT_WALKED, source=Source.CUPTI))

    # ---- joining ----

    def _take_call(self, call: Call, now: float) -> None:
        self._newest_ns = max(self._newest_ns, call.timestamp_ns)
        api = _CALL_API_BY_VALUE[call.api]
        if api in _RECORDED_BY_CALL:
            _remember(self._by_call, call.correlation_id)
        if call.result < 0 and api not in _JOINED_APIS:  # no result in the callback: nothing is known of it
            self.counters.ignored += 1
            return
        if call.result > 0 or api not in _JOINED_APIS:
            self._hold(call.timestamp_ns, _Op(_OP_CALL, call=call), now)
            return
        # Succeeded (or its result is unknown: then its record, if one comes, says it succeeded).
        correlation_id = call.correlation_id
        if correlation_id in self._alone_records:  # its record was already taken alone
            del self._alone_records[correlation_id]
            self.counters.late += 1
            return
        waiting = self._pending_records.pop(correlation_id, None)
        if waiting is not None:
            assert type(waiting.item) is MemoryRecord
            self._hold_joined(call, waiting.item, now, waiting.sequence)
            return
        if correlation_id in self._pending_calls:  # the same id twice: the first goes alone
            self._resolve_alone(self._pending_calls, correlation_id)
            self.counters.unjoined += 1
        self._sequence += 1
        self._pending_calls[correlation_id] = _Waiting(call, now, self._sequence)
        if len(self._pending_calls) > MAX_PENDING:
            self._resolve_alone(self._pending_calls, next(iter(self._pending_calls)))
            self.counters.unjoined += 1

    def _take_record(self, record: MemoryRecord, now: float) -> None:
        self._newest_ns = max(self._newest_ns, record.timestamp_ns)
        self._memory_newest_ns = max(self._memory_newest_ns, record.timestamp_ns)
        if record.correlation_id in self._by_call:
            self.counters.vmm_records += 1
            return
        if record.operation == protocol.MEMORY_RELEASE:
            self._hold(record.timestamp_ns, _Op(_OP_RELEASE, record=record), now)
            return
        correlation_id = record.correlation_id
        if correlation_id in self._alone_calls:  # its CALL was already taken alone
            del self._alone_calls[correlation_id]
            self.counters.late += 1
            return
        waiting = self._pending_calls.pop(correlation_id, None)
        if waiting is not None:
            assert type(waiting.item) is Call
            self._hold_joined(waiting.item, record, now, waiting.sequence)
            return
        if correlation_id in self._pending_records:
            self._resolve_alone(self._pending_records, correlation_id)
            self.counters.unjoined += 1
        self._sequence += 1
        self._pending_records[correlation_id] = _Waiting(record, now, self._sequence)
        if len(self._pending_records) > MAX_PENDING:
            self._resolve_alone(self._pending_records, next(iter(self._pending_records)))
            self.counters.unjoined += 1

    def _hold_joined(self, call: Call, record: MemoryRecord, now: float, sequence: int) -> None:
        what = _OP_MAP if call.api == Api.cuMemMap.value else _OP_ALLOCATION
        self._hold(record.timestamp_ns, _Op(what, call=call, record=record), now, sequence)

    def _resolve_alone(self, waiting: dict[int, _Waiting], correlation_id: int) -> None:
        """Takes one half of a join alone: a CALL from what it says, a record as a call with no callback."""
        half = waiting.pop(correlation_id)
        item = half.item
        if type(item) is Call:
            _remember(self._alone_calls, correlation_id)
            if item.result != 0:  # an unknown result and no record: it made nothing
                self.counters.ignored += 1
                return
            what = _OP_MAP if item.api == Api.cuMemMap.value else _OP_ALLOCATION
            self._hold(item.timestamp_ns, _Op(what, call=item), half.arrived, half.sequence)
        else:
            assert type(item) is MemoryRecord
            _remember(self._alone_records, correlation_id)
            self._hold(item.timestamp_ns, _Op(_OP_ALLOCATION, record=item), half.arrived, half.sequence)

    def _hold(self, timestamp_ns: int, op: _Op, now: float, sequence: int = 0) -> None:
        if not sequence:
            self._sequence += 1
            sequence = self._sequence
        heapq.heappush(self._held, (timestamp_ns, sequence, now, op))
        while len(self._held) > MAX_HELD:
            self.counters.forced += 1
            self._apply(heapq.heappop(self._held)[3])

    def _drain(self, now: float) -> None:
        """Takes stale half-joins alone, then applies, oldest first, what the streams have passed."""
        for waiting in (self._pending_calls, self._pending_records):
            while waiting:
                first = waiting[next(iter(waiting))]
                if (self._newest_ns - first.item.timestamp_ns <= JOIN_TIMEOUT_NS
                        and now - first.arrived <= JOIN_TIMEOUT_SECONDS):
                    break
                self.counters.stale += 1
                self._resolve_alone(waiting, next(iter(waiting)))
        # Nothing after the oldest half-join may go before it: its event will carry about its time.
        watermark = self._memory_newest_ns
        for waiting in (self._pending_calls, self._pending_records):
            if waiting:
                watermark = min(watermark, waiting[next(iter(waiting))].item.timestamp_ns - 1)
        held = self._held
        while held:
            timestamp_ns, _, arrived, op = held[0]
            if (timestamp_ns > watermark and now - arrived < HOLD_SECONDS
                    and self._newest_ns - timestamp_ns <= JOIN_TIMEOUT_NS):
                break
            heapq.heappop(held)
            self._apply(op)

    # ---- applying: the process's state and its events ----

    def _apply(self, op: _Op) -> None:
        if op.what == _OP_ALLOCATION:
            self._apply_allocation(op.call, op.record)
        elif op.what == _OP_MAP:
            assert op.call is not None
            self._apply_map(op.call, op.record)
        elif op.what == _OP_RELEASE:
            assert op.record is not None
            self._apply_release(op.record)
        elif op.what == _OP_CALL:
            assert op.call is not None
            self._apply_call(op.call)
        else:
            self._out.append(EventsLost(op.lost, self._newest_ns or time.time_ns()))

    def _emit(self, kind: Kind, api: Api, timestamp_ns: int, layer: Layer, object_kind: ObjectKind, memory: Memory,
              size_bytes: int = 0, address: int = 0, device: int = DEVICE_UNKNOWN, call: Call | None = None,
              error_code: int = 0, handle: int = 0, freed_bytes: int = 0) -> None:
        self.counters.events += 1
        self._out.append(Event(
            kind=kind, api=api, pid=self.pid, tid=call.tid if call is not None else self.pid,
            timestamp_ns=timestamp_ns, layer=layer, object=object_kind, memory=memory, size_bytes=size_bytes,
            address=address, device=device, error_code=error_code, handle=handle, freed_bytes=freed_bytes,
            stack_id=call.stack_id if call is not None else 0,
            stack_status=_STACK_STATUSES[call.stack_status] if call is not None else StackStatus.NOT_WALKED,
            source=Source.CUPTI))

    def _room(self) -> bool:
        """Whether one more live object fits; past the bound the connection is closed (counted)."""
        live = len(self._allocations) + len(self._mappings) + len(self._handles) + len(self._reservations)
        if live < MAX_LIVE_OBJECTS:
            return True
        self.counters.untracked += 1
        self._overflow = (f"the process holds more than {MAX_LIVE_OBJECTS} CUDA objects; kvtrace follows no more "
                          "of it")
        return False

    def _apply_allocation(self, call: Call | None, record: MemoryRecord | None) -> None:
        if call is not None:
            api = _CALL_API_BY_VALUE[call.api]
            memory = _ALLOCATION_APIS[api][0]
            if record is not None and record.memory_kind in _MEMORY_KINDS:
                memory = _MEMORY_KINDS[record.memory_kind][0]
        else:
            assert record is not None
            known = _MEMORY_KINDS.get(record.memory_kind)
            if known is None:  # pageable, arrays, static module memory: no allocation the ledger keeps
                self.counters.ignored += 1
                return
            memory, api = known
        source = record if record is not None else call
        assert source is not None
        size_bytes = source.size_bytes or (call.size_bytes if call is not None else 0)
        device = DEVICE_UNKNOWN if memory is Memory.HOST else source.device
        if not self._room():
            return
        self._allocations[source.address] = _Allocation(api, memory, device, size_bytes)
        self._emit(Kind.ALLOC, api, source.timestamp_ns, Layer.DRIVER, ObjectKind.ALLOCATION, memory, size_bytes,
                   source.address, device, call)

    def _apply_map(self, call: Call, record: MemoryRecord | None) -> None:
        # What cuMemMap was given, as the uprobes read it (the record's where the callback had no parameters).
        address = call.address or (record.address if record is not None else 0)
        size_bytes = call.size_bytes or (record.size_bytes if record is not None else 0)
        if record is not None and (record.address != address
                                   or (record.size_bytes and record.size_bytes != size_bytes)):
            self.counters.mismatched += 1
        handle = self._handles.get(call.handle)
        device = record.device if record is not None else DEVICE_UNKNOWN
        if device == DEVICE_UNKNOWN and handle is not None:
            device = handle.device
        if not self._room():
            return
        if handle is not None:
            handle.mapped += 1
        old = self._mappings.get(address)  # mapped again: the unmap was not seen
        if old is not None:
            self._unmapped(old)
        self._mappings[address] = _Mapping(size_bytes, call.handle, device)
        timestamp_ns = record.timestamp_ns if record is not None else call.timestamp_ns
        self._emit(Kind.MAP, Api.cuMemMap, timestamp_ns, Layer.VMM, ObjectKind.VMM_MAPPING, Memory.NONE, size_bytes,
                   address, device, call, handle=call.handle)

    def _unmapped(self, mapping: _Mapping) -> int:
        """One fewer mapping of its handle; the handle's bytes when that frees it (released, last unmap)."""
        handle = self._handles.get(mapping.handle)
        if handle is None:
            return 0
        handle.mapped -= 1
        if handle.mapped <= 0 and handle.released:
            del self._handles[mapping.handle]
            return handle.size_bytes
        return 0

    def _apply_release(self, record: MemoryRecord) -> None:
        address = record.address
        allocation = self._allocations.pop(address, None)
        if allocation is not None:
            self._emit(Kind.FREE, _ALLOCATION_APIS[allocation.api][1], record.timestamp_ns, Layer.DRIVER,
                       ObjectKind.ALLOCATION, allocation.memory, allocation.size_bytes, address, allocation.device)
            return
        mapping = self._mappings.get(address)
        if mapping is not None:  # an unmap whose CALL did not come (a tracer without its callback)
            self._unmap(address, record.size_bytes or mapping.size_bytes, record.timestamp_ns, None)
            return
        known = _MEMORY_KINDS.get(record.memory_kind)
        if known is None:
            self.counters.ignored += 1
            return
        memory = known[0]
        self._emit(Kind.FREE_UNKNOWN, Api.cuMemFreeHost if memory is Memory.HOST else Api.cuMemFree_v2,
                   record.timestamp_ns, Layer.DRIVER, ObjectKind.ALLOCATION, memory, record.size_bytes, address,
                   DEVICE_UNKNOWN if memory is Memory.HOST else record.device)

    def _unmap(self, address: int, size_bytes: int, timestamp_ns: int, call: Call | None) -> None:
        """As cuMemUnmap (the ledger and probes/vmm.h): every mapping in [address, address + size)."""
        end, at, freed_bytes = address + size_bytes, address, 0
        first = self._mappings.get(address)
        device = first.device if first is not None else DEVICE_UNKNOWN
        while at < end:
            mapping = self._mappings.pop(at, None)
            if mapping is None:
                break
            device = mapping.device
            freed_bytes += self._unmapped(mapping)
            if mapping.size_bytes == 0:
                break
            at += mapping.size_bytes
        self._emit(Kind.UNMAP, Api.cuMemUnmap, timestamp_ns, Layer.VMM, ObjectKind.VMM_MAPPING, Memory.NONE,
                   size_bytes, address, device, call, freed_bytes=freed_bytes)

    def _apply_call(self, call: Call) -> None:
        """A call with no MEMORY record: a VMM handle or reservation, or any failure."""
        api = _CALL_API_BY_VALUE[call.api]
        ts = call.timestamp_ns
        if call.result != 0:
            self._failed(api, call)
        elif api is Api.cuMemCreate:
            if not self._room():
                return
            self._handles[call.handle] = _Handle(call.size_bytes, call.device)
            self._emit(Kind.ALLOC, api, ts, Layer.VMM, ObjectKind.VMM_HANDLE, Memory.DEVICE, call.size_bytes,
                       call.handle, call.device, call)
        elif api is Api.cuMemRelease:
            handle = self._handles.get(call.handle)
            if handle is None:
                self._emit(Kind.FREE_UNKNOWN, api, ts, Layer.VMM, ObjectKind.VMM_HANDLE, Memory.DEVICE, 0,
                           call.handle, DEVICE_UNKNOWN, call)
            elif handle.mapped > 0:  # its memory goes at the last unmap
                handle.released = True
                self._emit(Kind.RELEASE, api, ts, Layer.VMM, ObjectKind.VMM_HANDLE, Memory.DEVICE, handle.size_bytes,
                           call.handle, handle.device, call)
            else:
                del self._handles[call.handle]
                self._emit(Kind.FREE, api, ts, Layer.VMM, ObjectKind.VMM_HANDLE, Memory.DEVICE, handle.size_bytes,
                           call.handle, handle.device, call)
        elif api is Api.cuMemAddressReserve:
            if not self._room():
                return
            self._reservations[call.address] = (call.size_bytes, call.device)
            self._emit(Kind.ALLOC, api, ts, Layer.VMM, ObjectKind.VMM_RESERVE, Memory.NONE, call.size_bytes,
                       call.address, call.device, call)
        elif api is Api.cuMemAddressFree:
            reservation = self._reservations.pop(call.address, None)
            if reservation is None:
                self._emit(Kind.FREE_UNKNOWN, api, ts, Layer.VMM, ObjectKind.VMM_RESERVE, Memory.NONE, 0,
                           call.address, call.device, call)
            else:
                self._emit(Kind.FREE, api, ts, Layer.VMM, ObjectKind.VMM_RESERVE, Memory.NONE, reservation[0],
                           call.address, reservation[1], call)
        elif api is Api.cuMemMap:
            self._apply_map(call, None)
        elif api is Api.cuMemUnmap:
            self._unmap(call.address, call.size_bytes, ts, call)
        else:  # an allocation taken alone reaches _apply_allocation, never here
            raise AssertionError(f"{api.name} held as a call alone")

    def _failed(self, api: Api, call: Call) -> None:
        """A failed call, as the probes emit it (no state changes)."""
        ts, code = call.timestamp_ns, call.result
        if api in _ALLOCATION_APIS:
            memory = _ALLOCATION_APIS[api][0]
            device = DEVICE_UNKNOWN if memory is Memory.HOST else call.device
            self._emit(Kind.ALLOC_FAILED, api, ts, Layer.DRIVER, ObjectKind.ALLOCATION, memory, call.size_bytes, 0,
                       device, call, code)
        elif api is Api.cuMemCreate:
            self._emit(Kind.ALLOC_FAILED, api, ts, Layer.VMM, ObjectKind.VMM_HANDLE, Memory.DEVICE, call.size_bytes,
                       0, call.device, call, code)
        elif api is Api.cuMemMap:
            handle = self._handles.get(call.handle)
            self._emit(Kind.ALLOC_FAILED, api, ts, Layer.VMM, ObjectKind.VMM_MAPPING, Memory.NONE, call.size_bytes,
                       call.address, handle.device if handle is not None else DEVICE_UNKNOWN, call, code,
                       handle=call.handle)
        elif api is Api.cuMemAddressReserve:
            self._emit(Kind.ALLOC_FAILED, api, ts, Layer.VMM, ObjectKind.VMM_RESERVE, Memory.NONE, call.size_bytes,
                       0, call.device, call, code)
        elif api is Api.cuMemUnmap:
            self._emit(Kind.FREE_FAILED, api, ts, Layer.VMM, ObjectKind.VMM_MAPPING, Memory.NONE, call.size_bytes,
                       call.address, DEVICE_UNKNOWN, call, code)
        elif api is Api.cuMemRelease:
            self._emit(Kind.FREE_FAILED, api, ts, Layer.VMM, ObjectKind.VMM_HANDLE, Memory.DEVICE, 0, call.handle,
                       DEVICE_UNKNOWN, call, code)
        else:  # cuMemAddressFree
            self._emit(Kind.FREE_FAILED, api, ts, Layer.VMM, ObjectKind.VMM_RESERVE, Memory.NONE, 0, call.address,
                       call.device, call, code)

    # ---- views ----

    @property
    def live_objects(self) -> int:
        return len(self._allocations) + len(self._mappings) + len(self._handles) + len(self._reservations)

    @property
    def newest_ns(self) -> int:
        """The newest timestamp the process sent (at its exit: its tracer's last flush); 0 before any."""
        return self._newest_ns

    @property
    def waiting(self) -> int:
        """Half-joins and held records not yet applied."""
        return len(self._pending_calls) + len(self._pending_records) + len(self._held)


def _remember(seen: dict[int, None], correlation_id: int) -> None:
    seen[correlation_id] = None
    if len(seen) > MAX_PENDING:
        del seen[next(iter(seen))]


def _check_common(device: int, size_bytes: int, timestamp_ns: int, what: str) -> None:
    if not DEVICE_UNKNOWN <= device <= MAX_DEVICE:
        raise ProtocolError(f"a {what}'s device {device} is out of range (-1 to {MAX_DEVICE})")
    if size_bytes >= MAX_SIZE_BYTES:
        raise ProtocolError(f"a {what}'s size {size_bytes} is out of range")
    if not 0 < timestamp_ns <= MAX_I64:
        raise ProtocolError(f"a {what}'s timestamp {timestamp_ns} is out of range")


def _int(value: object, name: str, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:  # JSON's true/false are no numbers here
        raise ProtocolError(f"{name} must be an integer from {low} to {high}, not {str(value)[:24]}")
    return value


def _text(value: object, name: str, empty: bool = False, max_chars: int = MAX_TEXT_CHARS) -> str:
    """Untrusted text as every consumer takes it: unprintable characters escaped, cut to `max_chars`."""
    if type(value) is not str or (not value and not empty):
        raise ProtocolError(f"{name} must be {'' if empty else 'non-empty '}text")
    value = value[:max_chars]
    if not value.isprintable():
        value = "".join(char if char.isprintable() else char.encode("unicode_escape").decode("ascii")
                        for char in value)[:max_chars]
    return value
