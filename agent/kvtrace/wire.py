"""model <-> kvtrace.v1 <-> JSON: every conversion, in one place, for the server, the client, the
CLI and recordings.

The wire enums carry the model enums' numbers (a unit test keeps them equal), so converting is a
number copy. JSON objects are what `kvtrace agent --json-events`, `kvtrace tail --json` and the
other `--json` outputs print; they are built from the model, so the agent and the client print
the same object for the same event.
"""
from __future__ import annotations

import array
import enum
import operator
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from kvtrace._proto.kvtrace.v1 import agent_service_pb2 as service_pb2
from kvtrace._proto.kvtrace.v1 import events_pb2
from kvtrace.model.agent import AgentInfo, TrackedProcess
from kvtrace.model.blocks import estimated_size
from kvtrace.model.crosscheck import ProcessCrossCheck, Side
from kvtrace.model.depth import Depth, DepthCause, ProcessDepth
from kvtrace.model.events import (
    AUX_FIELDS,
    COMM_BYTES,
    SIZED_KINDS,
    Api,
    Event,
    EventRun,
    Kind,
    Layer,
    Memory,
    ObjectKind,
    Source,
    StackStatus,
    comm_text,
)
from kvtrace.model.findings import (
    AnalysisSnapshot,
    GpuMemory,
    LeakReport,
    LeakSuspect,
    ProcessGpu,
)
from kvtrace.model.gpus import NvmlProcessMemory, NvmlSample
from kvtrace.model.ledger import LedgerKey, Outstanding
from kvtrace.model.processes import ProcessInfo, valid_text
from kvtrace.model.stacks import Frame, NativeFrame, Stack
from kvtrace.model.vllm import FindingKind, KvRequest, RequestState, Role, VllmEngine, VllmFinding

_STACK_STATUS_NAMES = {status: status.name.lower() for status in StackStatus}


def wire_number(value: enum.IntEnum | None) -> Any:
    """A model enum as the wire's: the numbers are the same by design (tests check each enum), so
    the conversion is a number copy; None is the wire's UNSPECIFIED (0)."""
    return int(value) if value is not None else 0


def wire_numbers(values: Iterable[enum.IntEnum]) -> list[Any]:
    return [int(value) for value in values]
_STACK_STATUS_BY_NAME = {name: status for status, name in _STACK_STATUS_NAMES.items()}


# ---- model -> kvtrace.v1 ----

def event_to_proto(event: Event) -> events_pb2.Event:
    """One model event as the wire Event; the payload follows the kind.

    Fields are set on the payload in place: about twice as fast as building it with keyword
    arguments and copying it in, and this runs for every event of every stream."""
    message = events_pb2.Event(timestamp_ns=event.timestamp_ns, pid=event.pid, tid=event.tid,
                               comm=event.comm, title=event.title, container=event.container)
    if event.source is not Source.UPROBE:
        message.source = wire_number(event.source)
    kind = event.kind
    payload: events_pb2.Allocation | events_pb2.DeviceChange | events_pb2.ContextDestroy
    if kind is Kind.PROCESS_EXIT:
        message.process_exit.wait_status = event.error_code
        message.process_exit.freed_bytes = event.freed_bytes
        return message
    if kind is Kind.SET_DEVICE:
        payload = message.device_change
        payload.context = event.address
    elif kind is Kind.CONTEXT_DESTROY:
        payload = message.context_destroy
        payload.context = event.address
    else:
        allocation = payload = message.allocation
        allocation.kind = wire_number(kind)
        allocation.object = wire_number(event.object)
        allocation.memory = wire_number(event.memory)
        allocation.size_bytes = event.size_bytes
        allocation.address = event.address
        allocation.handle = event.handle
        allocation.freed_bytes = event.freed_bytes
        allocation.stack_id = event.stack_id
        allocation.stream = event.stream
        allocation.sample_bytes = event.sample_bytes
        allocation.stack_status_code = wire_number(event.stack_status)
        allocation.stack_status = _STACK_STATUS_NAMES[event.stack_status]  # for 0.1 clients
    payload.SetInParent()
    payload.api = wire_number(event.api)
    payload.api_name = event.api.name
    payload.layer = wire_number(event.layer)
    payload.device = event.device
    payload.error_code = event.error_code
    payload.caller_address = event.caller_address
    return message


# The model fields of EventColumns, each read for a whole batch in one C call (a column at a time: a
# fifth cheaper than one tuple of every field per event and a transposition).
_COLUMN_FIELDS = tuple(operator.attrgetter(name) for name in (
    "kind", "timestamp_ns", "pid", "tid", "api", "layer", "object", "memory", "size_bytes", "address", "device",
    "error_code", "caller_address", "handle", "freed_bytes", "stack_id", "stack_status", "stream", "sample_bytes",
    "source", "comm", "title", "container"))
# Columns the redacted view leaves empty (addresses, handles, streams, contexts, callers, stacks).
_REDACTED_COLUMNS = frozenset({"address", "caller_address", "handle", "stack_id", "stream"})
# Event.source on the wire: the uprobes' left unset (0), as event_to_proto leaves it.
_WIRE_SOURCES: dict[Source, Any] = {Source.UPROBE: 0, Source.CUPTI: events_pb2.EVENT_SOURCE_CUPTI}
_NUMBER_COLUMNS = ("timestamp_ns", "pid", "tid", "size_bytes", "address", "device", "error_code", "caller_address",
                   "handle", "freed_bytes", "stack_id", "stack_status", "stream", "sample_bytes")


def _enum_column(values: tuple) -> tuple | list:
    """Model enums (IntEnum: ints already) with None as the wire's 0."""
    return [value or 0 for value in values] if None in values else values


def events_to_columns(events: Sequence[Event], title: Callable[[str], str] | None = None) -> events_pb2.EventColumns:
    """A batch of model events as EventColumns (the stream's EVENT_ENCODING_COLUMNS): each column in one
    call, a column whose values are all 0 left empty. `title` set: the redacted view (titles through
    it; no addresses, handles, streams, callers or stacks), as redact_event leaves an Event message.

    Costs about a tenth of event_to_proto per event, and the message is about half the bytes."""
    columns = events_pb2.EventColumns()
    if not events:
        return columns
    (kinds, timestamps, pids, tids, apis, layers, objects, memories, sizes, addresses, devices, errors, callers,
     handles, freed, stack_ids, statuses, streams, samples, sources, comms, titles, containers) = \
        [tuple(map(field, events)) for field in _COLUMN_FIELDS]
    numbers = dict(zip(_NUMBER_COLUMNS, (timestamps, pids, tids, sizes, addresses, devices, errors, callers,
                                         handles, freed, stack_ids, statuses, streams, samples), strict=True))
    columns.kind.extend(kinds)
    columns.api.extend(apis)
    for name, values in numbers.items():
        if any(values) and not (title is not None and name in _REDACTED_COLUMNS):
            getattr(columns, name).extend(values)
    for name, values in (("layer", layers), ("object", objects), ("memory", memories)):
        if any(values):
            getattr(columns, name).extend(_enum_column(values))
    if sources.count(Source.UPROBE) != len(sources):  # all the uprobes': left unset, as event_to_proto does
        columns.source.extend([_WIRE_SOURCES[source] for source in sources])
    order: dict[tuple[str, str, str], int] = {}
    if len(set(comms)) == len(set(titles)) == len(set(containers)) == 1:  # one label: index 0 for all, no column
        order[comms[0], titles[0], containers[0]] = 0
    else:
        columns.process.extend([order.setdefault(label, len(order))
                                for label in zip(comms, titles, containers, strict=True)])
    add = columns.processes.add
    for comm, full_title, container in order:
        add(comm=comm, title=title(full_title) if title is not None else full_title, container=container)
    return columns


def columns_event_count(columns: events_pb2.EventColumns) -> int:
    return len(columns.kind)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


# FixedEventColumns' column fields: name -> the field's key on the wire (length-delimited: a packed
# repeated fixed-width field or bytes), so a column's bytes become the field with two small prefixes.
_FIXED_KEYS = {field.name: _varint(field.number << 3 | 2)
               for field in events_pb2.FixedEventColumns.DESCRIPTOR.fields
               if field.name not in ("processes", "timestamp_offset_ns", "block_sample_bytes")}


class FixedColumnsBatch:
    """Runs for one FixedEventColumns (the stream's EVENT_ENCODING_FIXED_COLUMNS), in order: labelled by the
    Session, on one clock, and with one label per process (a title that changed between two runs, at an
    exec say, ends a batch)."""

    def __init__(self) -> None:
        self.runs: list[EventRun] = []
        self._labels: dict[int, tuple[str, str] | None] = {}

    def __len__(self) -> int:
        return len(self.runs)

    def takes(self, run: EventRun) -> bool:
        labels = run.labels
        if labels is None or (self.runs and not self.runs[0].raw.joins(run.raw)):
            return False
        kept = self._labels
        return all(kept.get(pid, labels.get(pid)) == labels.get(pid) for pid in run.pids)

    def add(self, run: EventRun) -> None:
        if not self.takes(run):
            raise ValueError("a run that cannot share this batch (another clock or sampling mean, a process "
                             "labelled otherwise, or not labelled)")
        self.runs.append(run)
        assert run.labels is not None
        self._labels.update((pid, run.labels.get(pid)) for pid in run.pids)

    def into(self, message: events_pb2.FixedEventColumns) -> None:
        """The runs' events into `message`, copied from the records they were decoded from: each column a
        strided copy per run, joined, and a parse that is a copy too; nothing per event."""
        if not self.runs:
            return
        parts = [run.raw.columns() for run in self.runs]
        keys = _FIXED_KEYS
        message.MergeFromString(b"".join(
            keys[name] + _varint(len(column)) + column
            for name, column in ((name, b"".join(part[name] for part in parts)) for name in parts[0])))
        message.timestamp_offset_ns = self.runs[0].raw.timestamp_offset_ns
        message.block_sample_bytes = self.runs[0].raw.block_sample_bytes
        add = message.processes.add
        for pid, label in self._labels.items():
            if label is not None:
                add(pid=pid, title=label[0], container=label[1])

    def clear(self) -> None:
        self.runs.clear()
        self._labels.clear()


def runs_to_fixed_columns(runs: Sequence[EventRun], message: events_pb2.FixedEventColumns) -> None:
    """Runs that may share one batch (FixedColumnsBatch.takes each), in order, into `message`."""
    batch = FixedColumnsBatch()
    for run in runs:
        batch.add(run)
    batch.into(message)


def _fixed_bytes(values: bytes, code: str, count: int, name: str) -> array.array:
    column = array.array(code, values)
    if len(column) != count or len(values) != count * column.itemsize:
        raise ValueError(f"FixedEventColumns.{name} has {len(values)} bytes for {count} events")
    if sys.byteorder != "little":
        column.byteswap()
    return column


def events_from_fixed_columns(columns: events_pb2.FixedEventColumns) -> list[Event | None]:
    """The model events of a FixedEventColumns batch, in order; None for an event this client cannot
    represent (an enum value of a newer agent), as events_from_columns does. ValueError for a batch
    whose columns disagree on how many events there are."""
    count = len(columns.timestamp_ns)
    numbers = (columns.pid, columns.tid, columns.size_bytes, columns.address, columns.caller_address,
               columns.aux, columns.device, columns.error_code)
    if any(len(column) != count for column in numbers):
        raise ValueError(f"FixedEventColumns columns of different lengths for {count} events")
    apis = _fixed_bytes(columns.api, "H", count, "api")
    small = [_fixed_bytes(getattr(columns, name), "B", count, name)
             for name in ("kind", "layer", "object", "memory", "stack_status")]
    # An agent that predates stack sampling sends no `sampling`: none was.
    sampling = _fixed_bytes(columns.sampling, "B", count, "sampling") if columns.sampling else bytes(count)
    block_sample_bytes = columns.block_sample_bytes
    comm_bytes = columns.comm
    if len(comm_bytes) != count * COMM_BYTES:
        raise ValueError(f"FixedEventColumns.comm has {len(comm_bytes)} bytes for {count} events")
    labels = {label.pid: (label.title, label.container) for label in columns.processes}
    offset_ns = columns.timestamp_offset_ns
    names: dict[bytes, str] = {}  # each distinct name decoded once
    events: list[Event | None] = []
    for index, (timestamp_ns, pid, tid, size_bytes, address, caller_address, aux, device, error_code, api, kind,
                layer, obj, memory, stack_status, subject) in enumerate(zip(
            columns.timestamp_ns, *numbers, apis, *small, sampling, strict=True)):
        raw_comm = comm_bytes[index * COMM_BYTES:(index + 1) * COMM_BYTES]
        comm = names.get(raw_comm)
        if comm is None:
            comm = names[raw_comm] = comm_text(raw_comm)
        title, container = labels.get(pid) or (comm, "")
        try:
            api_member = Api(api)
            field = AUX_FIELDS.get(api_member)
            event = Event(kind=Kind(kind), api=api_member, pid=pid, tid=tid, timestamp_ns=timestamp_ns + offset_ns,
                          layer=_member(Layer, layer), object=_member(ObjectKind, obj),
                          memory=_member(Memory, memory), size_bytes=size_bytes, address=address, device=device,
                          error_code=error_code, caller_address=caller_address,
                          handle=aux if field == "handle" else 0, freed_bytes=aux if field == "freed_bytes" else 0,
                          stream=aux if field == "stream" else 0, comm=comm, title=title,
                          container=container, stack_status=StackStatus(stack_status),
                          sample_bytes=block_sample_bytes if subject else 0)
        except ValueError:  # a value this client does not know: a newer agent
            events.append(None)
            continue
        events.append(event)
    return events


def _column(values, count: int, default: int = 0) -> list:
    return list(values) if len(values) else [default] * count


def events_from_columns(columns: events_pb2.EventColumns) -> list[Event | None]:
    """The model events of an EventColumns batch, in order; None for an event this client cannot
    represent (a kind, API or other enum value of a newer agent), as event_from_proto does."""
    count = len(columns.kind)
    if not count:
        return []
    labels = [(label.comm, label.title, label.container) for label in columns.processes] or [("", "", "")]
    rows = zip(columns.kind, _column(columns.timestamp_ns, count), _column(columns.pid, count),
               _column(columns.tid, count), _column(columns.process, count), _column(columns.api, count),
               _column(columns.layer, count), _column(columns.object, count), _column(columns.memory, count),
               _column(columns.size_bytes, count), _column(columns.address, count), _column(columns.device, count),
               _column(columns.error_code, count), _column(columns.caller_address, count),
               _column(columns.handle, count), _column(columns.freed_bytes, count),
               _column(columns.stack_id, count), _column(columns.stack_status, count),
               _column(columns.stream, count), _column(columns.source, count), _column(columns.sample_bytes, count),
               strict=True)
    events: list[Event | None] = []
    for (kind, timestamp_ns, pid, tid, process, api, layer, obj, memory, size_bytes, address, device, error_code,
         caller_address, handle, freed_bytes, stack_id, stack_status, stream, source, sample_bytes) in rows:
        try:
            comm, title, container = labels[process]
            event = Event(kind=Kind(kind), api=Api(api), pid=pid, tid=tid, timestamp_ns=timestamp_ns,
                          layer=_member(Layer, layer), object=_member(ObjectKind, obj),
                          memory=_member(Memory, memory), size_bytes=size_bytes, address=address, device=device,
                          error_code=error_code, caller_address=caller_address, handle=handle,
                          freed_bytes=freed_bytes, stream=stream, comm=comm, title=title, container=container,
                          stack_id=stack_id, stack_status=StackStatus(stack_status),
                          source=Source.CUPTI if source == events_pb2.EVENT_SOURCE_CUPTI else Source.UPROBE,
                          sample_bytes=sample_bytes)
        except (ValueError, IndexError):  # a value this client does not know: a newer agent
            events.append(None)
            continue
        events.append(event)
    return events


def event_messages_from_columns(columns: events_pb2.EventColumns) -> list[events_pb2.Event]:
    """The Event messages an EVENT_ENCODING_MESSAGES stream would have carried for these events (events
    this client cannot represent are left out)."""
    return [event_to_proto(event) for event in events_from_columns(columns) if event is not None]


def stack_message(stack_id: int, stack: Stack) -> events_pb2.Stack:
    return events_pb2.Stack(
        stack_id=stack_id, truncated=stack.truncated,
        frames=[events_pb2.StackFrame(function=frame.function, file=frame.file, line=frame.line)
                for frame in stack.frames])


def stack_to_proto(stack_id: int, stack: Stack) -> events_pb2.Event:
    return events_pb2.Event(timestamp_ns=time.time_ns(), stack_definition=stack_message(stack_id, stack))


def lost_to_proto(dropped_count: int, kernel_lost_count: int) -> events_pb2.Event:
    return events_pb2.Event(timestamp_ns=time.time_ns(), events_lost=events_pb2.EventsLost(
        dropped_count=dropped_count, kernel_lost_count=kernel_lost_count))


def outstanding_to_proto(entry: Outstanding, process: ProcessInfo | None) -> service_pb2.OutstandingAllocation:
    key = entry.key
    return service_pb2.OutstandingAllocation(
        pid=key.pid, tid=entry.tid, comm=process.comm if process else "",
        title=process.title if process else "", container=process.container if process else "",
        layer=wire_number(key.layer), object=wire_number(key.object), memory=wire_number(entry.memory),
        api=wire_number(entry.api),
        api_name=entry.api.name, size_bytes=entry.size_bytes, address=key.address,
        device=entry.device, timestamp_ns=entry.timestamp_ns, caller_address=entry.caller_address,
        stack_id=entry.stack_id, mapped_count=entry.mapped_count, released=entry.released,
        handle=entry.handle, stream=entry.stream, sample_bytes=entry.sample_bytes,
        sampled=entry.sampled and entry.sample_bytes != 0)


def process_to_proto(process: TrackedProcess, depth: ProcessDepth | None = None) -> service_pb2.Process:
    message = service_pb2.Process(
        pid=process.pid, title=process.title, comm=process.comm, container=process.container,
        totals=[service_pb2.OutstandingTotal(device=t.device, layer=wire_number(t.layer), memory=wire_number(t.memory),
                                             size_bytes=t.size_bytes, object_count=t.object_count)
                for t in process.totals])
    if depth is not None:
        message.depth.CopyFrom(depth_to_proto(depth))
    return message


# ---- depth (kvtrace.model.depth) ----

def depth_to_proto(depth: ProcessDepth) -> service_pb2.ProcessDepthState:
    cause: Any = depth.cause.value  # DepthCause is a plain Enum of the wire's numbers
    return service_pb2.ProcessDepthState(
        pid=depth.pid, depth=wire_number(depth.depth), since_ns=depth.since_ns, cause=cause,
        detail=valid_text(depth.detail), until_ns=depth.until_ns, sample_bytes=depth.sample_bytes)


def depths_to_proto(depths: dict[int, ProcessDepth], pids: Iterable[int]) -> list[service_pb2.ProcessDepthState]:
    """The depths of `pids` the agent follows, by pid (each once)."""
    return [depth_to_proto(depths[pid]) for pid in sorted(set(pids)) if pid in depths]


def depth_from_proto(message: service_pb2.ProcessDepthState) -> ProcessDepth | None:
    """The model's depth; None when the message says none (an older agent) or one this client does not
    know (a newer agent's). A cause this client does not know is DEFAULT."""
    try:
        depth = Depth(message.depth)
    except ValueError:
        return None
    try:
        cause = DepthCause(message.cause)
    except ValueError:
        cause = DepthCause.DEFAULT
    return ProcessDepth(pid=message.pid, depth=depth, since_ns=message.since_ns, cause=cause, detail=message.detail,
                        until_ns=message.until_ns, sample_bytes=message.sample_bytes)


def depth_to_json(depth: ProcessDepth | None) -> dict[str, Any] | None:
    """{"depth": "blocks", "since_ns", "cause": "growth", "detail", "until_ns", "sample_bytes"}; None when
    not known."""
    if depth is None:
        return None
    return {"pid": depth.pid, "depth": depth.depth.label, "since_ns": depth.since_ns,
            "cause": depth.cause.name.lower(), "detail": depth.detail, "until_ns": depth.until_ns,
            "sample_bytes": depth.sample_bytes}


def depth_message_to_json(message: service_pb2.ProcessDepthState) -> dict[str, Any] | None:
    return depth_to_json(depth_from_proto(message))


def depths_by_pid(messages: Iterable[service_pb2.ProcessDepthState]) -> dict[int, ProcessDepth]:
    """A response's depth list as pid -> the model's depth (those this client can read)."""
    depths = {}
    for message in messages:
        depth = depth_from_proto(message)
        if depth is not None:
            depths[depth.pid] = depth
    return depths


def info_to_proto(info: AgentInfo) -> service_pb2.GetAgentInfoResponse:
    return service_pb2.GetAgentInfoResponse(
        version=info.version, kernel_release=info.kernel_release,
        attached_libraries=[service_pb2.AttachedLibrary(
            path=valid_text(library.path), file_device=library.device, inode=library.inode,
            symbols=sorted(library.symbols), pids=sorted(library.pids)) for library in info.libraries],
        components=[service_pb2.ComponentHealth(name=valid_text(c.name), up=c.up, reason=valid_text(c.reason))
                    for c in info.components],
        counters=info.counters)


def suspect_to_proto(suspect: LeakSuspect) -> service_pb2.LeakSuspect:
    message = service_pb2.LeakSuspect(
        rank=suspect.rank, pid=suspect.pid, title=suspect.title, device=suspect.device,
        stack_id=suspect.stack_id, caller_address=suspect.native_caller_address,
        outstanding_bytes=suspect.outstanding_bytes, allocation_count=suspect.count,
        oldest_age_seconds=suspect.oldest_age_seconds, growth_bytes_per_second=suspect.growth_bytes_per_second,
        estimated=suspect.estimated)
    if suspect.stack is not None:
        message.stack.CopyFrom(stack_message(suspect.stack_id, suspect.stack))
    if suspect.native_caller is not None:
        caller = suspect.native_caller
        message.native_caller.CopyFrom(
            service_pb2.NativeFrame(module=valid_text(caller.module), symbol=valid_text(caller.symbol),
                                   offset=caller.offset))
    return message


def leak_report_to_proto(report: LeakReport, depths: dict[int, ProcessDepth] | None = None,
                         pids: Iterable[int] = ()) -> service_pb2.ListLeakSuspectsResponse:
    """The report, with the depth of each process that has a suspect or is among `pids` (the request's)."""
    return service_pb2.ListLeakSuspectsResponse(
        suspects=[suspect_to_proto(suspect) for suspect in report.suspects],
        suspect_count=report.suspect_count, allocations_considered=report.allocations_considered,
        suspect_allocations=report.suspect_allocations, min_age_seconds=report.min_age_seconds,
        timestamp_ns=report.timestamp_ns,
        depths=depths_to_proto(depths or {}, [*pids, *(suspect.pid for suspect in report.suspects)]))


def gpu_to_proto(gpu: GpuMemory) -> service_pb2.GpuMemory:
    return service_pb2.GpuMemory(index=gpu.index, uuid=gpu.uuid, name=gpu.name, total_bytes=gpu.total_bytes,
                                 used_bytes=gpu.used_bytes, free_bytes=gpu.free_bytes,
                                 reserved_bytes=gpu.reserved_bytes)


def process_growth_to_proto(row: ProcessGpu, depth: ProcessDepth | None = None) -> service_pb2.ProcessGrowth:
    message = service_pb2.ProcessGrowth(
        pid=row.pid, title=row.title, device=row.device, outstanding_bytes=row.outstanding_bytes,
        growth_bytes_per_second_1m=row.growth_bytes_per_second_1m,
        growth_bytes_per_second_15m=row.growth_bytes_per_second_15m, history_seconds=row.history_seconds,
        allocations_1m=row.allocations_1m, frees_1m=row.frees_1m, predates_agent=row.predates_agent)
    if row.fragmentation is not None:
        row_fragmentation = row.fragmentation
        message.fragmentation.CopyFrom(service_pb2.Fragmentation(
            reserved_bytes=row_fragmentation.reserved_bytes, allocated_bytes=row_fragmentation.allocated_bytes,
            largest_free_bytes=row_fragmentation.largest_free_bytes, ratio=row_fragmentation.ratio,
            segments=row_fragmentation.segments, blocks=row_fragmentation.blocks,
            blocks_outside_segments=row_fragmentation.blocks_outside_segments))
    message.role_bytes.extend(role_bytes_to_proto(row.role_bytes))
    if depth is not None:
        message.depth.CopyFrom(depth_to_proto(depth))
    # None leaves an optional field unset: "not known" stays apart from 0.
    for name, value in (("nvml_index", row.nvml_index), ("nvml_used_bytes", row.nvml_used_bytes),
                        ("unattributed_bytes", row.unattributed_bytes),
                        ("time_to_oom_seconds", row.time_to_oom_seconds), ("free_ratio_1m", row.free_ratio_1m)):
        if value is not None:
            setattr(message, name, value)
    return message


def growth_to_proto(snapshot: AnalysisSnapshot | None, pids: frozenset[int],
                    depths: dict[int, ProcessDepth] | None = None) -> service_pb2.GetGrowthResponse:
    if snapshot is None:
        return service_pb2.GetGrowthResponse()
    depths = depths or {}
    return service_pb2.GetGrowthResponse(
        timestamp_ns=snapshot.timestamp_ns, nvml_timestamp_ns=snapshot.nvml_timestamp_ns,
        gpus=[gpu_to_proto(gpu) for gpu in snapshot.gpus],
        processes=[process_growth_to_proto(row, depths.get(row.pid)) for row in snapshot.processes
                   if not pids or row.pid in pids])


def role_bytes_to_proto(role_bytes: dict[Role, int]) -> list[service_pb2.RoleBytes]:
    """One entry per role, in the enum's order (a stable order for diffs and tests)."""
    return [service_pb2.RoleBytes(role=wire_number(role), size_bytes=size_bytes)
            for role, size_bytes in sorted(role_bytes.items())]


def kv_request_to_proto(request: KvRequest) -> service_pb2.VllmRequest:
    message = service_pb2.VllmRequest(request_id=request.request_id, state=wire_number(request.state),
                                      blocks=request.blocks)
    if request.done_age_seconds is not None:
        message.done_age_seconds = request.done_age_seconds
    return message


def vllm_engine_to_proto(engine: VllmEngine, depths: dict[int, ProcessDepth] | None = None) -> service_pb2.VllmEngine:
    message = service_pb2.VllmEngine(
        engine_pid=engine.engine_pid, title=engine.title, worker_pids=list(engine.worker_pids),
        api_server_pid=engine.api_server_pid, traced_bytes=engine.traced_bytes,
        role_bytes=role_bytes_to_proto(engine.role_bytes), plugin=engine.plugin,
        kv_tensor_bytes=engine.kv_tensor_bytes, page_size_bytes=engine.page_size_bytes,
        block_allocations_per_second=engine.block_allocations_per_second,
        block_frees_per_second=engine.block_frees_per_second, sleep_level=engine.sleep_level,
        warming_up=engine.warming_up, holders=[kv_request_to_proto(request) for request in engine.holders],
        metrics_url=engine.metrics_url, metrics_error=engine.metrics_error,
        idle_growth_bytes_per_second=engine.idle_growth_bytes_per_second,
        blocks_held_after_finish=engine.blocks_held_after_finish,
        sleep_held_by_tag=_tag_bytes_to_proto(engine.sleep_held_by_tag),
        depths=depths_to_proto(depths or {}, (engine.engine_pid, *engine.worker_pids)))
    # None leaves an optional field unset: "not known" stays apart from 0.
    for name in _ENGINE_OPTIONAL_FIELDS:
        value = getattr(engine, name)
        if value is not None:
            setattr(message, name, value)
    return message


# VllmEngine's fields that may be None, the same names on the wire (optional there).
_ENGINE_OPTIONAL_FIELDS = ("blocks_total", "blocks_free", "kv_cache_usage_ratio", "metrics_kv_cache_usage_ratio",
                           "requests_running", "requests_waiting", "frees_per_allocation_1m", "free_blocks_ratio",
                           "sleep_residual_bytes", "previous_sleep_residual_bytes")


def _tag_bytes_to_proto(tag_bytes: dict[str, int]) -> list[service_pb2.TagBytes]:
    return [service_pb2.TagBytes(tag=tag, size_bytes=size_bytes) for tag, size_bytes in sorted(tag_bytes.items())]


def vllm_finding_to_proto(finding: VllmFinding) -> service_pb2.VllmFinding:
    return service_pb2.VllmFinding(
        kind=wire_number(finding.kind), engine_pid=finding.engine_pid, message=finding.message,
        value=finding.value, threshold=finding.threshold, since_ns=finding.since_ns,
        requests=[kv_request_to_proto(request) for request in finding.requests],
        held_by_role=role_bytes_to_proto(finding.held_by_role),
        held_by_tag=_tag_bytes_to_proto(finding.held_by_tag))


def engine_matches(engine: VllmEngine, pids: frozenset[int]) -> bool:
    """A pid filter selects an engine by its EngineCore or any process of it (a worker's pid from
    `kvtrace ps` finds its engine)."""
    return not pids or engine.engine_pid in pids or not pids.isdisjoint(engine.worker_pids)


_SEEN_BY = {Side.UPROBE: events_pb2.EVENT_SOURCE_UPROBE, Side.CUPTI: events_pb2.EVENT_SOURCE_CUPTI, None: 0}


def cross_checks_to_proto(checks: Iterable[ProcessCrossCheck],
                          with_addresses: bool = True) -> service_pb2.GetCrossCheckResponse:
    """The CUPTI tracers and their agreement with the uprobes; `with_addresses` False (the group
    socket) leaves the disagreements' addresses out."""
    response = service_pb2.GetCrossCheckResponse()
    for check in checks:
        status = check.status
        message = response.processes.add(
            pid=check.pid, state=status.state, reason=status.reason, holder=status.holder,
            compared=check.compared, finished=check.finished, pending_count=check.pending)
        message.counters.update({name: value for name, value in status.counters.items() if value >= 0})
        for api, row in sorted(check.apis.items()):
            message.apis.add(api=wire_number(api), api_name=api.name, matched_count=row.matched,
                             uprobe_only_count=row.uprobe_only, cupti_only_count=row.cupti_only,
                             mismatched_count=row.mismatched)
        for example in check.examples:
            message.disagreements.add(
                seen_by=_SEEN_BY[example.side], api=wire_number(example.api), api_name=example.api.name,
                failed=example.failed, address=example.address if with_addresses else 0,
                size_bytes=example.size_bytes, device=example.device, timestamp_ns=example.timestamp_ns,
                detail=example.detail)
    return response


def vllm_engines_to_proto(snapshot: AnalysisSnapshot | None, pids: frozenset[int] = frozenset(),
                          depths: dict[int, ProcessDepth] | None = None) -> service_pb2.GetVllmEnginesResponse:
    """GetVllmEngines' answer: the selected engines by engine pid, and the findings about them."""
    if snapshot is None:
        return service_pb2.GetVllmEnginesResponse()
    engines = sorted((engine for engine in snapshot.vllm_engines if engine_matches(engine, pids)),
                     key=lambda engine: engine.engine_pid)
    selected = {engine.engine_pid for engine in engines}
    return service_pb2.GetVllmEnginesResponse(
        timestamp_ns=snapshot.timestamp_ns, engines=[vllm_engine_to_proto(engine, depths) for engine in engines],
        findings=[vllm_finding_to_proto(finding) for finding in snapshot.vllm_findings
                  if not pids or finding.engine_pid in selected])



# ---- wire -> model and JSON ----

_E = TypeVar("_E", bound=enum.IntEnum)


def _member(enum_type: type[_E], value: int) -> _E | None:
    """The model enum member for a wire value; None for UNSPECIFIED (0)."""
    return enum_type(value) if value else None


def _known(enum_type: type[_E], value: int, fallback: _E) -> _E:
    """The model member for a wire value; `fallback` for a value a newer agent added."""
    try:
        return enum_type(value)
    except ValueError:
        return fallback


def role_bytes_from_proto(entries: Iterable[service_pb2.RoleBytes]) -> dict[Role, int]:
    """A role a newer agent added counts as `other`: its bytes stay in the total."""
    role_bytes: dict[Role, int] = {}
    for entry in entries:
        role = _known(Role, entry.role, Role.OTHER)
        role_bytes[role] = role_bytes.get(role, 0) + entry.size_bytes
    return role_bytes


def kv_request_from_proto(message: service_pb2.VllmRequest) -> KvRequest:
    return KvRequest(request_id=message.request_id,
                     state=_known(RequestState, message.state, RequestState.UNSPECIFIED),
                     blocks=message.blocks, done_age_seconds=optional_field(message, "done_age_seconds"))


def vllm_engine_from_proto(message: service_pb2.VllmEngine) -> VllmEngine:
    return VllmEngine(
        engine_pid=message.engine_pid, title=message.title, worker_pids=tuple(message.worker_pids),
        api_server_pid=message.api_server_pid, traced_bytes=message.traced_bytes,
        role_bytes=role_bytes_from_proto(message.role_bytes), plugin=message.plugin,
        kv_tensor_bytes=message.kv_tensor_bytes, page_size_bytes=message.page_size_bytes,
        block_allocations_per_second=message.block_allocations_per_second,
        block_frees_per_second=message.block_frees_per_second, sleep_level=message.sleep_level,
        warming_up=message.warming_up, holders=tuple(kv_request_from_proto(r) for r in message.holders),
        metrics_url=message.metrics_url, metrics_error=message.metrics_error,
        idle_growth_bytes_per_second=message.idle_growth_bytes_per_second,
        blocks_held_after_finish=message.blocks_held_after_finish,
        sleep_held_by_tag={entry.tag: entry.size_bytes for entry in message.sleep_held_by_tag},
        **{name: optional_field(message, name) for name in _ENGINE_OPTIONAL_FIELDS})


def vllm_finding_from_proto(message: service_pb2.VllmFinding) -> VllmFinding:
    return VllmFinding(
        kind=_known(FindingKind, message.kind, FindingKind.UNSPECIFIED), engine_pid=message.engine_pid,
        message=message.message, value=message.value, threshold=message.threshold, since_ns=message.since_ns,
        requests=tuple(kv_request_from_proto(r) for r in message.requests),
        held_by_role=role_bytes_from_proto(message.held_by_role),
        held_by_tag={entry.tag: entry.size_bytes for entry in message.held_by_tag})


def event_from_proto(message: events_pb2.Event) -> Event | None:
    """The model event of a wire event; None for events_lost, stack_definition, and events from
    a newer agent that this client cannot represent."""
    payload = message.WhichOneof("payload")
    call: events_pb2.Allocation | events_pb2.DeviceChange | events_pb2.ContextDestroy
    try:
        if payload == "allocation":
            call = allocation = message.allocation
            event = Event(kind=Kind(allocation.kind), api=Api(allocation.api), pid=message.pid, tid=message.tid,
                          timestamp_ns=message.timestamp_ns, object=_member(ObjectKind, allocation.object),
                          memory=_member(Memory, allocation.memory), size_bytes=allocation.size_bytes,
                          address=allocation.address, handle=allocation.handle, freed_bytes=allocation.freed_bytes,
                          stack_id=allocation.stack_id, stack_status=_stack_status(allocation),
                          stream=allocation.stream, sample_bytes=allocation.sample_bytes)
        elif payload == "device_change":
            call = message.device_change
            event = Event(kind=Kind.SET_DEVICE, api=Api(call.api), pid=message.pid, tid=message.tid,
                          timestamp_ns=message.timestamp_ns, address=call.context)
        elif payload == "context_destroy":
            call = message.context_destroy
            event = Event(kind=Kind.CONTEXT_DESTROY, api=Api(call.api), pid=message.pid, tid=message.tid,
                          timestamp_ns=message.timestamp_ns, address=call.context)
        elif payload == "process_exit":
            event = Event(kind=Kind.PROCESS_EXIT, api=Api.process_exit, pid=message.pid, tid=message.tid,
                          timestamp_ns=message.timestamp_ns, error_code=message.process_exit.wait_status,
                          freed_bytes=message.process_exit.freed_bytes)
        else:
            return None
        if payload != "process_exit":
            event.layer = _member(Layer, call.layer)
            event.device, event.error_code, event.caller_address = call.device, call.error_code, call.caller_address
    except ValueError:  # an enum value this client does not know: a newer agent
        return None
    event.comm, event.title, event.container = message.comm, message.title, message.container
    if message.source == events_pb2.EVENT_SOURCE_CUPTI:
        event.source = Source.CUPTI
    return event


def _stack_status(allocation: events_pb2.Allocation) -> StackStatus:
    if allocation.stack_status_code:
        return StackStatus(allocation.stack_status_code)
    # An agent of kvtrace 0.1 sends the text only.
    return _STACK_STATUS_BY_NAME.get(allocation.stack_status, StackStatus.NOT_WALKED)


def stack_from_proto(stack: events_pb2.Stack) -> tuple[int, Stack]:
    """(stack_id, model Stack) of a stack_definition; later events refer to it by stack_id."""
    return stack.stack_id, Stack(tuple(Frame(frame.function, frame.file, frame.line) for frame in stack.frames),
                                 stack.truncated)


def message_to_json(message: events_pb2.Event) -> dict | None:
    """The JSON object `kvtrace agent --json-events` prints for the same event (None: not an event)."""
    event = event_from_proto(message)
    return event_to_json(event) if event is not None else None


# ---- model -> JSON ----

def frame_to_json(frame: Frame) -> dict[str, Any]:
    return {"function": frame.function, "file": frame.file, "line": frame.line}


def native_frame_to_json(frame: NativeFrame | service_pb2.NativeFrame) -> dict[str, Any]:
    return {"module": frame.module, "symbol": frame.symbol, "offset": frame.offset}


def _lower(value: Any) -> str | None:
    return value.name.lower() if value is not None else None


def event_to_json(event: Event, stack: Stack | None = None,
                  native_caller: NativeFrame | None = None) -> dict[str, Any]:
    """The stable JSON shape of an event (`kvtrace agent --json-events`, `kvtrace tail --json`).

    `stack` adds "stack": [{function, file, line}, ...] innermost first and "stack_truncated";
    `native_caller` adds "native_caller"."""
    data: dict[str, Any] = {
        "kind": event.kind.name.lower(),
        "pid": event.pid,
        "tid": event.tid,
        "comm": event.comm,
        "title": event.title,
        "api": event.api.name,
        "layer": _lower(event.layer),
        "object": _lower(event.object),
        "memory": _lower(event.memory),
        "size_bytes": event.size_bytes,
        "address": event.address,
        "device": event.device,
        "error_code": event.error_code,
        "timestamp_ns": event.timestamp_ns,
        "caller_address": event.caller_address,
        "container": event.container,
    }
    if event.api is Api.cuMemMap:
        data["handle"] = event.handle
    elif event.api is Api.cuMemUnmap or event.kind is Kind.PROCESS_EXIT:
        data["freed_bytes"] = event.freed_bytes
    elif event.layer is Layer.TORCH:
        data["stream"] = event.stream
        if event.api is Api.pytorch_malloc:
            data["sample_bytes"] = event.sample_bytes  # 0: its stack was not subject to sampling
    if stack is not None:
        data["stack"] = [frame_to_json(frame) for frame in stack.frames]
        data["stack_truncated"] = stack.truncated
    if event.kind in SIZED_KINDS:
        data["stack_status"] = _STACK_STATUS_NAMES[event.stack_status]
    if native_caller is not None:
        data["native_caller"] = native_frame_to_json(native_caller)
    return data


def wire_enum_name(enum_type, value: int) -> str | None:
    """The lower-case model name of a wire enum value ("runtime"); None for UNSPECIFIED (0)."""
    try:
        return enum_type(value).name.lower() if value else None
    except ValueError:
        return str(value)


def outstanding_to_json_dict(entry: service_pb2.OutstandingAllocation) -> dict:
    """One outstanding object for `kvtrace snapshot --json`, named like the event JSON."""
    return {
        "pid": entry.pid, "tid": entry.tid, "comm": entry.comm, "title": entry.title,
        "container": entry.container, "layer": wire_enum_name(Layer, entry.layer),
        "object": wire_enum_name(ObjectKind, entry.object), "memory": wire_enum_name(Memory, entry.memory),
        "api": entry.api_name, "size_bytes": entry.size_bytes, "address": entry.address,
        "device": entry.device, "timestamp_ns": entry.timestamp_ns,
        "caller_address": entry.caller_address, "stack_id": entry.stack_id,
        **({"mapped_count": entry.mapped_count, "released": entry.released}
           if entry.object == ObjectKind.VMM_HANDLE else {}),
        **({"handle": entry.handle} if entry.object == ObjectKind.VMM_MAPPING else {}),
        **({"stream": entry.stream, "sample_bytes": entry.sample_bytes, "sampled": entry.sampled,
            "estimated_bytes": round(estimated_size(entry.size_bytes, entry.sample_bytes, entry.sampled))}
           if entry.object == ObjectKind.BLOCK else {}),
    }


def outstanding_from_proto(entry: service_pb2.OutstandingAllocation) -> Outstanding:
    """The model entry of a snapshot's wire entry (raises ValueError for an enum this client does
    not know: a newer agent)."""
    return Outstanding(
        key=LedgerKey(entry.pid, Layer(entry.layer), ObjectKind(entry.object), entry.address),
        size_bytes=entry.size_bytes, timestamp_ns=entry.timestamp_ns, device=entry.device, api=Api(entry.api),
        memory=Memory(entry.memory), tid=entry.tid, caller_address=entry.caller_address,
        mapped_count=entry.mapped_count, released=entry.released, handle=entry.handle,
        stack_id=entry.stack_id, stream=entry.stream, sample_bytes=entry.sample_bytes,
        sampled=entry.sampled and entry.sample_bytes != 0)


def process_to_json_dict(process: service_pb2.Process) -> dict:
    """One process for `kvtrace ps --json`."""
    return {
        "pid": process.pid, "title": process.title, "comm": process.comm, "container": process.container,
        "totals": [{"device": total.device, "layer": wire_enum_name(Layer, total.layer),
                    "memory": wire_enum_name(Memory, total.memory), "size_bytes": total.size_bytes,
                    "object_count": total.object_count} for total in process.totals],
        "depth": depth_message_to_json(process.depth) if process.HasField("depth") else None,
    }


def optional_field(message, name: str):
    """An optional (has-presence) field's value, None when unset."""
    return getattr(message, name) if message.HasField(name) else None


def leak_report_to_json_dict(response: service_pb2.ListLeakSuspectsResponse) -> dict:
    """The report of `kvtrace leaks --json`: one object, suspects most suspicious first."""
    return {
        "timestamp_ns": response.timestamp_ns, "min_age_seconds": response.min_age_seconds,
        "allocations_considered": response.allocations_considered,
        "suspect_allocations": response.suspect_allocations, "suspect_count": response.suspect_count,
        "suspects": [{
            "rank": suspect.rank, "pid": suspect.pid, "title": suspect.title, "device": suspect.device,
            "outstanding_bytes": suspect.outstanding_bytes, "allocation_count": suspect.allocation_count,
            "oldest_age_seconds": suspect.oldest_age_seconds,
            "growth_bytes_per_second": suspect.growth_bytes_per_second, "estimated": suspect.estimated,
            "stack_id": suspect.stack_id,
            "stack": [frame_to_json(frame) for frame in stack_from_proto(suspect.stack)[1].frames]
            if suspect.HasField("stack") else None,
            "stack_truncated": suspect.stack.truncated,
            "caller_address": suspect.caller_address,
            "native_caller": native_frame_to_json(suspect.native_caller)
            if suspect.HasField("native_caller") else None,
        } for suspect in response.suspects],
        "depths": [depth_message_to_json(depth) for depth in response.depths],
    }


def role_bytes_to_json(role_bytes: dict[Role, int]) -> dict[str, int]:
    """{"kv_cache": bytes, ...} in the enum's order; the names are the `role` label's."""
    return {role.label: size_bytes for role, size_bytes in sorted(role_bytes.items())}


def kv_request_to_json(request: KvRequest) -> dict[str, Any]:
    return {"request_id": request.request_id, "state": request.state.name.lower(), "blocks": request.blocks,
            "done_age_seconds": request.done_age_seconds}


def vllm_engine_to_json(engine: VllmEngine) -> dict[str, Any]:
    return {
        "engine_pid": engine.engine_pid, "title": engine.title, "worker_pids": list(engine.worker_pids),
        "api_server_pid": engine.api_server_pid, "traced_bytes": engine.traced_bytes,
        "role_bytes": role_bytes_to_json(engine.role_bytes), "plugin": engine.plugin,
        "blocks_total": engine.blocks_total, "blocks_free": engine.blocks_free,
        "kv_cache_usage_ratio": engine.kv_cache_usage_ratio,
        "metrics_kv_cache_usage_ratio": engine.metrics_kv_cache_usage_ratio,
        "requests_running": engine.requests_running, "requests_waiting": engine.requests_waiting,
        "kv_tensor_bytes": engine.kv_tensor_bytes, "page_size_bytes": engine.page_size_bytes,
        "block_allocations_per_second": engine.block_allocations_per_second,
        "block_frees_per_second": engine.block_frees_per_second,
        "frees_per_allocation_1m": engine.frees_per_allocation_1m,
        "free_blocks_ratio": engine.free_blocks_ratio,
        "idle_growth_bytes_per_second": engine.idle_growth_bytes_per_second,
        "blocks_held_after_finish": engine.blocks_held_after_finish,
        "sleep_residual_bytes": engine.sleep_residual_bytes,
        "sleep_held_by_tag": dict(sorted(engine.sleep_held_by_tag.items())),
        "previous_sleep_residual_bytes": engine.previous_sleep_residual_bytes,
        "sleep_level": engine.sleep_level, "warming_up": engine.warming_up,
        "holders": [kv_request_to_json(request) for request in engine.holders],
        "metrics_url": engine.metrics_url, "metrics_error": engine.metrics_error,
    }


def vllm_finding_to_json(finding: VllmFinding) -> dict[str, Any]:
    return {
        "kind": finding.kind.label, "engine_pid": finding.engine_pid, "message": finding.message,
        "value": finding.value, "threshold": finding.threshold, "since_ns": finding.since_ns,
        "requests": [kv_request_to_json(request) for request in finding.requests],
        "held_by_role": role_bytes_to_json(finding.held_by_role),
        "held_by_tag": dict(sorted(finding.held_by_tag.items())),
    }


def vllm_engines_to_json_dict(response: service_pb2.GetVllmEnginesResponse) -> dict[str, Any]:
    """The answer of `kvtrace vllm --json`: one object, engines by pid, then the findings."""
    return {
        "timestamp_ns": response.timestamp_ns,
        "engines": [{**vllm_engine_to_json(vllm_engine_from_proto(engine)),
                     "depths": [depth_message_to_json(depth) for depth in engine.depths]}
                    for engine in response.engines],
        "findings": [vllm_finding_to_json(vllm_finding_from_proto(finding)) for finding in response.findings],
    }


# ---- recordings (the frames; the file around them is kvtrace.reports.recording) ----

def nvml_to_proto(sample: NvmlSample) -> service_pb2.NvmlRound:
    return service_pb2.NvmlRound(
        timestamp_ns=sample.timestamp_ns, gpus=[gpu_to_proto(gpu) for gpu in sample.gpus],
        processes=[service_pb2.NvmlProcessUsage(gpu_index=process.gpu_index, pid=process.pid,
                                                used_bytes=process.used_bytes)
                   for process in sample.processes])


def nvml_from_proto(message: service_pb2.NvmlRound) -> NvmlSample:
    return NvmlSample(
        timestamp_ns=message.timestamp_ns,
        gpus=tuple(GpuMemory(index=gpu.index, uuid=gpu.uuid, name=gpu.name, total_bytes=gpu.total_bytes,
                             used_bytes=gpu.used_bytes, free_bytes=gpu.free_bytes, reserved_bytes=gpu.reserved_bytes)
                   for gpu in message.gpus),
        processes=tuple(NvmlProcessMemory(gpu_index=process.gpu_index, pid=process.pid,
                                          used_bytes=optional_field(process, "used_bytes"))
                        for process in message.processes))


def recorded_process_to_proto(info: ProcessInfo, depth: ProcessDepth | None = None) -> service_pb2.RecordedProcess:
    message = service_pb2.RecordedProcess(pid=info.pid, title=info.title, comm=info.comm, container=info.container,
                                          start_time_ns=int(info.start_time * 1e9), parent_pid=info.parent_pid)
    if depth is not None:
        message.depth.CopyFrom(depth_to_proto(depth))
    return message


def recorded_process_from_proto(message: service_pb2.RecordedProcess) -> ProcessInfo:
    return ProcessInfo(pid=message.pid, title=message.title, comm=message.comm, container=message.container,
                       cgroup="", start_time=message.start_time_ns / 1e9, read_at=0.0, parent_pid=message.parent_pid)
