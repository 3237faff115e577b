"""The flight recorder's ring, packed: its records as fixed-width bytes, not one Python object graph each (issue 31).

An Event kept as itself costs ~390 bytes (tracemalloc; 540-960 of the agent's RSS under an exit storm,
bench/RESULTS.md §Q continued): the slotted object, a dozen fresh ints, its comm string. Here each is 103 bytes of
a chunk (struct `_EVENT`, the Event's fields in order), its comm, title and container one interned label (an id
into a table, kept while a chunk holds it), and read back as an equal Event only when a dump is written, on the
recorder's thread. What does not pack (an EventsLost, an NvmlSample, an Event with a value outside its field's
width) is kept as itself beside its chunk.

Chunks are written in place (a bytearray of `chunk_records` records, allocated whole) and frozen to bytes when full:
a copy for a dump (`copy`, under the Session's lock) shares the frozen chunks and copies only the one being
written, and the labels' table; it is read (decoded) later, on the writer's thread, while the ring goes on.
"""
from __future__ import annotations

import struct
from collections import deque
from collections.abc import Iterable, Iterator
from operator import attrgetter

from kvtrace.model.events import Api, Event, EventsLost, Kind, Layer, Memory, ObjectKind, Source, StackStatus
from kvtrace.model.gpus import NvmlSample

RingRecord = Event | EventsLost | NvmlSample

# The Event's fields in order, its comm, title and container as one label id (I). kind 0: a record kept as itself.
# layer, object and memory None pack as 0 (no member of theirs is 0) and read back as None.
_EVENT = struct.Struct("<BBIIqBBBQQiqQQQQIQBBQ")
RECORD_BYTES = _EVENT.size  # 103
# What _EVENT packs and _decode makes, in order (tests/unit/test_flight_ring.py holds it to Event's fields).
EVENT_FIELDS = ("kind", "api", "pid", "tid", "timestamp_ns", "layer", "object", "memory", "size_bytes", "address",
                "device", "error_code", "caller_address", "handle", "freed_bytes", "stream", "comm", "title",
                "container", "stack_id", "stack_status", "source", "sample_bytes")
_TIMESTAMP = struct.Struct("<q")
_TIMESTAMP_OFFSET = 10  # kind, api, pid, tid
_KIND_OBJECT = 0
_OBJECT = bytes(RECORD_BYTES)  # a record kept beside the chunk: kind 0, its timestamp written in
_LABEL = attrgetter("comm", "title", "container")
CHUNK_RECORDS = 4096  # 412 KiB a chunk


def _members(enum_type, none_at_zero: bool = False) -> tuple:
    """A lookup of every byte value: the member of that value, None at 0 where the field may be empty, else the
    int itself (an Event made with a number its enum lacks reads back the same number)."""
    members = {member.value: member for member in enum_type}
    return tuple(None if value == 0 and none_at_zero else members.get(value, value) for value in range(256))


_KINDS, _APIS = _members(Kind), _members(Api)
_LAYERS, _OBJECTS, _MEMORIES = _members(Layer, True), _members(ObjectKind, True), _members(Memory, True)
_STACK_STATUSES, _SOURCES = _members(StackStatus), _members(Source)


class _Chunk:
    __slots__ = ("data", "count", "labels", "objects")

    def __init__(self, records: int) -> None:
        self.data: bytearray | bytes = bytearray(records * RECORD_BYTES)
        self.count = 0  # records written
        self.labels: set[int] = set()  # label ids its records use
        self.objects: dict[int, RingRecord] = {}  # index -> a record kept as itself


def _decode(data: bytes | bytearray, index: int, objects: dict[int, RingRecord],
            labels: dict[int, tuple[str, str, str]]) -> RingRecord:
    (kind, api, pid, tid, timestamp_ns, layer, object_kind, memory, size_bytes, address, device, error_code,
     caller_address, handle, freed_bytes, stream, label, stack_id, stack_status, source,
     sample_bytes) = _EVENT.unpack_from(data, index * RECORD_BYTES)
    if kind == _KIND_OBJECT:
        return objects[index]
    comm, title, container = labels[label]
    return Event(_KINDS[kind], _APIS[api], pid, tid, timestamp_ns, _LAYERS[layer], _OBJECTS[object_kind],
                 _MEMORIES[memory], size_bytes, address, device, error_code, caller_address, handle, freed_bytes,
                 stream, comm, title, container, stack_id, _STACK_STATUSES[stack_status], _SOURCES[source],
                 sample_bytes)


class PackedRing:
    """The last `max_records` records, oldest first: a full ring lets its oldest go as records come (as a deque
    with a maxlen). Not thread-safe: the flight recorder uses it under the Session's lock."""

    def __init__(self, max_records: int, chunk_records: int = CHUNK_RECORDS) -> None:
        if max_records < 1:
            raise ValueError(f"a ring of {max_records} records")
        self.max_records = max_records
        self._chunk_records = max(16, min(chunk_records, max_records))
        self._label_ids: dict[tuple[str, str, str], int] = {}
        self._labels: dict[int, tuple[str, str, str]] = {}  # id -> (comm, title, container)
        self._label_chunks: dict[int, int] = {}  # id -> chunks that use it
        self._next_label = 1
        self.clear()

    def clear(self) -> None:
        self._chunks: deque[_Chunk] = deque((_Chunk(self._chunk_records),))
        self._head = 0  # the oldest record's index in the first chunk
        self._length = 0
        self._label_ids.clear()
        self._labels.clear()
        self._label_chunks.clear()

    def __len__(self) -> int:
        return self._length

    def __bool__(self) -> bool:
        return self._length > 0

    def __iter__(self) -> Iterator[RingRecord]:
        """The records, decoded (a test's or a bench's look: a dump reads a copy)."""
        return iter(self.copy())

    # ---- taking records ----

    def append(self, record: RingRecord) -> int | None:
        return self.extend((record,))

    def extend(self, records: Iterable[RingRecord]) -> int | None:
        """Takes the records, letting go of the oldest past max_records (some of these too, when they are more):
        the newest timestamp let go of, None when none was."""
        chunk = self._chunks[-1]
        data, count, per_chunk = chunk.data, chunk.count, self._chunk_records
        label_ids, label_chunks, chunk_labels = self._label_ids, self._label_chunks, chunk.labels
        pack_into = _EVENT.pack_into
        taken = 0
        let_go: int | None = None
        for record in records:
            if count == per_chunk:  # full: frozen (a dump's copy shares it), and a new one
                chunk.data, chunk.count = bytes(data), count
                self._length += taken
                taken = 0
                newest = self._drop_over()
                if newest is not None and (let_go is None or newest > let_go):
                    let_go = newest
                chunk = _Chunk(per_chunk)
                self._chunks.append(chunk)
                data, count, chunk_labels = chunk.data, 0, chunk.labels
            offset = count * RECORD_BYTES
            if type(record) is Event:
                label = _LABEL(record)
                label_id = label_ids.get(label)
                if label_id is None:
                    label_id = label_ids[label] = self._next_label
                    self._labels[label_id] = label
                    self._next_label += 1
                if label_id not in chunk_labels:
                    chunk_labels.add(label_id)
                    label_chunks[label_id] = label_chunks.get(label_id, 0) + 1
                kind = record.kind
                try:  # the fields one by one, not through a tuple: this runs for every event, under the lock
                    if not kind:  # kind 0 marks a record kept as itself
                        raise struct.error("kind 0")
                    pack_into(data, offset, kind, record.api, record.pid, record.tid, record.timestamp_ns,
                              record.layer or 0, record.object or 0, record.memory or 0, record.size_bytes,
                              record.address, record.device, record.error_code, record.caller_address,
                              record.handle, record.freed_bytes, record.stream, label_id, record.stack_id,
                              record.stack_status, record.source, record.sample_bytes)
                except (struct.error, TypeError):  # a value its field cannot hold: kept as itself
                    self._keep(chunk, count, record)
            else:
                self._keep(chunk, count, record)
            count += 1
            taken += 1
        chunk.count = count
        self._length += taken
        if self._length > self.max_records:
            newest = self._drop_over()
            if newest is not None and (let_go is None or newest > let_go):
                let_go = newest
        return let_go

    def _keep(self, chunk: _Chunk, index: int, record: RingRecord) -> None:
        offset = index * RECORD_BYTES
        assert isinstance(chunk.data, bytearray)
        chunk.data[offset:offset + RECORD_BYTES] = _OBJECT
        _TIMESTAMP.pack_into(chunk.data, offset + _TIMESTAMP_OFFSET, record.timestamp_ns)
        chunk.objects[index] = record

    def _drop_over(self) -> int | None:
        """Lets go of the oldest past max_records: the newest timestamp of those (events come a little out of
        order across CPUs), None when none was."""
        over = self._length - self.max_records
        newest: int | None = None
        unpack_from = _TIMESTAMP.unpack_from
        while over > 0:
            first = self._chunks[0]
            head = self._head
            dropped = min(over, first.count - head)
            data = first.data
            for index in range(head, head + dropped):
                timestamp_ns = unpack_from(data, index * RECORD_BYTES + _TIMESTAMP_OFFSET)[0]
                if newest is None or timestamp_ns > newest:
                    newest = timestamp_ns
            if first.objects:
                for index in range(head, head + dropped):
                    first.objects.pop(index, None)
            self._head = head + dropped
            self._length -= dropped
            over -= dropped
            if self._head == first.count and len(self._chunks) > 1:
                self._release(self._chunks.popleft())
                self._head = 0
        return newest

    def _release(self, chunk: _Chunk) -> None:
        label_chunks = self._label_chunks
        for label_id in chunk.labels:
            left = label_chunks[label_id] - 1
            if left:
                label_chunks[label_id] = left
            else:  # no chunk uses it: forgotten (its id is not used again)
                del label_chunks[label_id]
                del self._label_ids[self._labels.pop(label_id)]

    # ---- letting go of the oldest ----

    def first_timestamp_ns(self) -> int:
        """The first record's timestamp, the one popleft lets go of next (the ring is not empty)."""
        return _TIMESTAMP.unpack_from(self._chunks[0].data, self._head * RECORD_BYTES + _TIMESTAMP_OFFSET)[0]

    def popleft_timestamp_ns(self) -> int:
        """Lets the oldest record go; its timestamp."""
        first = self._chunks[0]
        timestamp_ns = self.first_timestamp_ns()
        if first.objects:
            first.objects.pop(self._head, None)
        self._head += 1
        self._length -= 1
        if self._length == 0:
            self.clear()
        elif self._head == first.count and len(self._chunks) > 1:
            self._release(self._chunks.popleft())
            self._head = 0
        return timestamp_ns

    # ---- a dump's copy ----

    def copy(self) -> RingCopy:
        """The records as they stand, for reading later (under the lock: the frozen chunks shared, the one being
        written copied, and the labels' table)."""
        parts = []
        head = self._head
        for chunk in self._chunks:
            if chunk.count > head:
                data = chunk.data if type(chunk.data) is bytes else bytes(
                    chunk.data[head * RECORD_BYTES:chunk.count * RECORD_BYTES])
                start = head if type(chunk.data) is bytes else 0
                objects = {index - (head - start): record for index, record in chunk.objects.items()
                           if index >= head} if chunk.objects else {}
                parts.append((data, start, start + chunk.count - head, objects))
            head = 0
        return RingCopy(parts, dict(self._labels), self._length)


class RingCopy:
    """A ring's records at one moment, decoded as they are read (a dump's, on the writer's thread)."""

    def __init__(self, parts: list[tuple[bytes, int, int, dict[int, RingRecord]]],
                 labels: dict[int, tuple[str, str, str]], length: int, since_ns: int | None = None) -> None:
        self._parts = parts  # (data, first index, end index, records kept as themselves by index)
        self._labels = labels
        self._length = length
        self._since_ns = since_ns

    def __len__(self) -> int:
        """The records copied (before `since`'s filter)."""
        return self._length

    def __bool__(self) -> bool:
        return self._length > 0

    def oldest_timestamp_ns(self) -> int:
        """The oldest timestamp of the records (not the first's: records come a little out of order)."""
        unpack_from = _TIMESTAMP.unpack_from
        return min(unpack_from(data, index * RECORD_BYTES + _TIMESTAMP_OFFSET)[0]
                   for data, start, end, _ in self._parts for index in range(start, end))

    def since(self, oldest_ns: int) -> RingCopy:
        """These records less those older than `oldest_ns` (filtered as they are read)."""
        return RingCopy(self._parts, self._labels, self._length, oldest_ns)

    def __iter__(self) -> Iterator[RingRecord]:
        labels, since_ns = self._labels, self._since_ns
        unpack_from = _TIMESTAMP.unpack_from
        for data, start, end, objects in self._parts:
            for index in range(start, end):
                if since_ns is not None and \
                        unpack_from(data, index * RECORD_BYTES + _TIMESTAMP_OFFSET)[0] < since_ns:
                    continue
                yield _decode(data, index, objects, labels)
