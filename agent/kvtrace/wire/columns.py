"""Batches of events as columns: EventColumns (EVENT_ENCODING_COLUMNS, built from model events) and
FixedEventColumns (EVENT_ENCODING_FIXED_COLUMNS, copied from the records a source decoded), and both
back into model events.

Its own module because it is the stream's hot path, written for cost per event (a column at a time,
nothing per event where it can), unlike the per-message conversions of kvtrace.wire.events.
"""
from __future__ import annotations

import array
import operator
import sys
from collections.abc import Callable, Sequence
from typing import Any

from kvtrace._proto.kvtrace.v1 import events_pb2
from kvtrace.model.events import (
    AUX_FIELDS,
    COMM_BYTES,
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
from kvtrace.wire.common import enum_member
from kvtrace.wire.events import event_to_proto

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
                          layer=enum_member(Layer, layer), object=enum_member(ObjectKind, obj),
                          memory=enum_member(Memory, memory), size_bytes=size_bytes, address=address, device=device,
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
                          layer=enum_member(Layer, layer), object=enum_member(ObjectKind, obj),
                          memory=enum_member(Memory, memory), size_bytes=size_bytes, address=address, device=device,
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
