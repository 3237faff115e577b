"""Raw BPF records -> model events. The only place that knows the raw layout's meaning."""
from __future__ import annotations

import itertools
import operator
import struct
import sys
import time
from collections.abc import Collection, Iterable, Iterator, Mapping

from kvtrace.model.events import (
    AUX_FIELDS,
    Api,
    Event,
    EventRun,
    Kind,
    Layer,
    Memory,
    ObjectKind,
    RawRecords,
    Source,
    StackStatus,
    comm_text,
)
from kvtrace.model.ledger import ENTRY_ROW_FIELDS, LedgerKey, Outstanding, RowBatch, TotalsKey
from kvtrace.sources.bpf import abi


class Clock:
    """bpf_ktime_get_ns() is CLOCK_MONOTONIC; events carry wall-clock nanoseconds, on the Session's
    clock (monotonic + the offset it fixed when it started) so that every record agrees after a step
    of the system clock."""

    def __init__(self, offset_ns: int | None = None) -> None:
        self.offset_ns = time.time_ns() - time.monotonic_ns() if offset_ns is None else offset_ns

    def wall_ns(self, monotonic_ns: int) -> int:
        return monotonic_ns + self.offset_ns

    def monotonic_ns(self, wall_ns: int) -> int:
        return wall_ns - self.offset_ns


class UndecodableRecord(ValueError):
    """A ring record this build cannot read (too short, or a kind or API it does not know: probes of
    another build?). The BPF source counts these as kvtrace_events_undecodable_total."""


def _lookup(enum_type, zero: bool = True) -> dict:
    """value -> member; 0 (the probes' "none") -> None where a field may be empty."""
    members = {member.value: member for member in enum_type}
    return {0: None, **members} if zero else members


# Every record has a kind and an API: 0 in either is a record this agent cannot read.
_KINDS, _APIS, _LAYERS = _lookup(Kind, zero=False), _lookup(Api, zero=False), _lookup(Layer)
_OBJECTS, _MEMORIES = _lookup(ObjectKind), _lookup(Memory)
_STACK_STATUS = {member.value: member for member in StackStatus}


def decode_event(record: bytes, clock: Clock, block_sample_bytes: int = 0) -> tuple[Event, int]:
    """(event, kernel stack id) of one ring-buffer record (struct kvt_event). The record's `aux`
    is the handle of a cuMemMap, the physical bytes a cuMemUnmap freed, and a block's stream; its
    `sampling` says a block's stack was subject to sampling at the mean the agent set in the probes,
    `block_sample_bytes` (the event's sample_bytes).

    Raises UndecodableRecord (a ValueError) for a record it cannot read, and nothing else."""
    try:
        (timestamp_ns, address, size_bytes, caller_address, aux, kernel_stack_id, pid, tid, device,
         error_code, api, kind, layer, object_kind, memory, stack_status, sampling,
         comm) = abi.EVENT_STRUCT.unpack_from(record)
        kind_member, api_member = _KINDS[kind], _APIS[api]
        layer_member, object_member, memory_member = _LAYERS[layer], _OBJECTS[object_kind], _MEMORIES[memory]
    except struct.error:
        raise UndecodableRecord(f"a record of {len(record)} bytes; struct kvt_event has "
                                f"{abi.EVENT_STRUCT.size}") from None
    except KeyError as error:
        raise UndecodableRecord(f"unknown value {error} (kind {kind}, api {api}, layer {layer}, "
                                f"object {object_kind}, memory {memory})") from None
    event = Event(
        kind=kind_member, api=api_member, pid=pid, tid=tid,
        timestamp_ns=timestamp_ns + clock.offset_ns,
        layer=layer_member, object=object_member, memory=memory_member,
        size_bytes=size_bytes, address=address, device=device, error_code=error_code,
        caller_address=caller_address, handle=aux if _AUX_FIELD[api] == 1 else 0,
        freed_bytes=aux if _AUX_FIELD[api] == 2 else 0, stream=aux if _AUX_FIELD[api] == 3 else 0,
        comm=comm_text(comm),
        stack_status=_STACK_STATUS.get(stack_status, StackStatus.NOT_WALKED),
        sample_bytes=block_sample_bytes if sampling else 0,
    )
    return event, kernel_stack_id


# api number -> which Event field a record's `aux` is (AUX_FIELDS): 1 handle, 2 freed_bytes, 3 stream, 0 none.
_AUX_FIELD = {api.value: {"handle": 1, "freed_bytes": 2, "stream": 3}.get(AUX_FIELDS.get(api, ""), 0) for api in Api}
_RECORD_STRUCTS: dict[tuple[int, int], struct.Struct] = {}
# decode_events reads api, kind, layer, object, memory, stack_status and sampling (8 bytes)
# as one bytes "tag", looked up at once in _TAGS: the same members as the lookups one by one, at a
# seventh of the dictionary work on every event. A tag that is not cached is decoded by _decode_tag.
_TAG_FORMAT = abi.EVENT_STRUCT.format.lstrip("<").replace("HBBBBBB", "8s")
_TAG = struct.Struct("<HBBBBBB")
_TAGS: dict[bytes, tuple] = {}
_TAGS_MAX = 4096  # distinct tags are few (an API has one kind, layer, object, memory per outcome)


def _decode_tag(tag: bytes) -> tuple | None:
    """(kind, api, layer, object, memory, aux field, stack status, sampling) of a record's tag; None for a
    record this agent cannot read."""
    api, kind, layer, object_kind, memory, stack_status, sampling = _TAG.unpack(tag)
    try:
        members = (_KINDS[kind], _APIS[api], _LAYERS[layer], _OBJECTS[object_kind], _MEMORIES[memory],
                   _AUX_FIELD[api], _STACK_STATUS.get(stack_status, StackStatus.NOT_WALKED), sampling != 0)
    except KeyError:
        return None
    if len(_TAGS) < _TAGS_MAX:
        _TAGS[tag] = members
    return members


def _records_struct(stride: int, offset: int) -> struct.Struct:
    """struct kvt_event at `offset` in every `stride` bytes (a ring record: its header, then the event)."""
    layout = _RECORD_STRUCTS.get((stride, offset))
    if layout is None:
        padding = stride - offset - abi.EVENT_STRUCT.size
        if offset < 0 or padding < 0:
            raise ValueError(f"a record of {stride} bytes cannot hold struct kvt_event at offset {offset}")
        layout = _RECORD_STRUCTS[stride, offset] = struct.Struct(f"<{offset}x{_TAG_FORMAT}{padding}x")
    return layout


def decode_events(records: bytes, clock: Clock, stride: int = abi.EVENT_STRUCT.size,
                  offset: int = 0, block_sample_bytes: int = 0) -> tuple[list[Event], list[int], int]:
    """Many records at once: (events, their kernel stack ids, how many records were undecodable).

    `records` holds one struct kvt_event at `offset` in every `stride` bytes (the ring's records as
    they lie in it: loader.py hands them over so); `block_sample_bytes` as decode_event's. The same
    events as decode_event one record at a
    time, at well under half its cost: one C call unpacks the batch, each event is built with
    positional arguments, and comm text is decoded once per distinct comm. A record that
    decode_event would refuse is left out and counted."""
    layout = _records_struct(stride, offset)
    if len(records) % stride:
        raise UndecodableRecord(f"{len(records)} bytes are not whole records of {stride} bytes")
    offset_ns = clock.offset_ns
    tags, decode_tag = _TAGS, _decode_tag
    names: dict[bytes, str] = {}
    events: list[Event] = []
    stack_ids: list[int] = []
    undecodable = 0
    new_event, add_event, add_stack, uprobe = Event, events.append, stack_ids.append, Source.UPROBE
    for (timestamp_ns, address, size_bytes, caller_address, aux, kernel_stack_id, pid, tid, device, error_code,
         tag, comm) in layout.iter_unpack(records):
        members = tags.get(tag) or decode_tag(tag)
        if members is None:
            undecodable += 1
            continue
        kind_member, api_member, layer_member, object_member, memory_member, field, status, sampling = members
        name = names.get(comm)
        if name is None:
            name = names[comm] = comm_text(comm)
        add_event(new_event(
            kind_member, api_member, pid, tid, timestamp_ns + offset_ns, layer_member, object_member, memory_member,
            size_bytes, address, device, error_code, caller_address,
            aux if field == 1 else 0, aux if field == 2 else 0, aux if field == 3 else 0,  # handle, freed, stream
            name, "", "", 0, status, uprobe, block_sample_bytes if sampling else 0))
        add_stack(kernel_stack_id)
    return events, stack_ids, undecodable


# FixedEventColumns' columns but comm (16 bytes: two 8-byte halves), each the kvt_event field of that name,
# by its width in bytes. The records are the host's byte order: little-endian wherever the probes build
# (x86-64, arm64), as the wire's fixed columns are.
_FIXED_COLUMNS = tuple((name, getattr(abi.RawEvent, name).size) for name in (
    "timestamp_ns", "pid", "tid", "size_bytes", "address", "caller_address", "aux", "device", "error_code", "api",
    "kind", "layer", "object", "memory", "stack_status", "sampling"))


class RawEvents:
    """struct kvt_event records at `offset` in every `stride` bytes, as the ring held them, the clock
    offset their events were stamped with, and the mean of the block stack sampling their `sampling`
    refers to: what an EventRun was decoded from (model.events.RawRecords). Each column is one strided
    copy of the records (a C loop), a few nanoseconds an event."""

    __slots__ = ("records", "stride", "offset", "timestamp_offset_ns", "block_sample_bytes")

    def __init__(self, records: bytes, stride: int, offset: int, timestamp_offset_ns: int,
                 block_sample_bytes: int = 0) -> None:
        if not aligned(stride, offset) or len(records) % stride:
            raise ValueError(f"{len(records)} bytes are not whole 8-byte aligned records of {stride} bytes "
                             f"with the event at {offset}")
        self.records = records
        self.stride = stride
        self.offset = offset
        self.timestamp_offset_ns = timestamp_offset_ns
        self.block_sample_bytes = block_sample_bytes

    def __len__(self) -> int:
        return len(self.records) // self.stride

    def sliced(self, start: int, stop: int) -> RawEvents:
        stride = self.stride
        return RawEvents(self.records[start * stride:stop * stride], stride, self.offset, self.timestamp_offset_ns,
                         self.block_sample_bytes)

    def joins(self, other: RawRecords) -> bool:
        return (self.timestamp_offset_ns == other.timestamp_offset_ns
                and self.block_sample_bytes == other.block_sample_bytes)

    def columns(self) -> dict[str, bytes]:
        view = memoryview(self.records)
        casts = {8: view.cast("Q"), 4: view.cast("I"), 2: view.cast("H"), 1: view.cast("B")}
        stride, offset = self.stride, self.offset
        columns = {name: casts[width][(offset + getattr(abi.RawEvent, name).offset) // width::stride // width].tobytes()
                   for name, width in _FIXED_COLUMNS}
        comm = bytearray(len(self) * abi.COMM_LEN)  # two 8-byte halves each
        halves, words = memoryview(comm).cast("Q"), casts[8]
        first = (offset + abi.RawEvent.comm.offset) // 8
        halves[0::2] = words[first::stride // 8]
        halves[1::2] = words[first + 1::stride // 8]
        columns["comm"] = bytes(comm)
        return columns


def aligned(stride: int, offset: int) -> bool:
    """Whether records so laid out can be copied as columns (RawEvents): 8-byte fields on 8-byte bounds, in
    the wire's byte order (little-endian)."""
    return (sys.byteorder == "little" and stride > 0 and stride % 8 == 0 and offset % 8 == 0
            and offset + abi.EVENT_STRUCT.size <= stride)


def event_run(events: list[Event], records: bytes, clock: Clock, stride: int, offset: int,
              block_sample_bytes: int = 0) -> EventRun | None:
    """The events decode_events made of every record of `records` (with `block_sample_bytes`), as a run
    with those records; None where the records are not their events copied (some were left out, or a
    stack status was read as another), or cannot be copied as columns (not aligned)."""
    if not aligned(stride, offset) or len(events) * stride != len(records):
        return None
    view = memoryview(records)
    if not _STACK_STATUS.keys() >= frozenset(view[offset + abi.RawEvent.stack_status.offset::stride]):
        return None
    pids = frozenset(view.cast("I")[(offset + abi.RawEvent.pid.offset) // 4::stride // 4])
    kinds = frozenset(view[offset + abi.RawEvent.kind.offset::stride])
    return EventRun(events, RawEvents(records, stride, offset, clock.offset_ns, block_sample_bytes), pids, kinds)


def decode_ledger_entry(key: abi.RawLedgerKey, value: abi.RawLedgerValue, clock: Clock) -> Outstanding:
    object_kind = ObjectKind(key.object)
    return Outstanding(
        key=LedgerKey(key.pid, Layer(key.layer), object_kind, key.address),
        size_bytes=value.size_bytes,
        timestamp_ns=clock.wall_ns(value.timestamp_ns),
        device=value.device,
        api=Api(value.api),
        memory=Memory(value.memory),
        tid=value.tid,
        caller_address=value.caller_address,
        mapped_count=value.aux if object_kind is ObjectKind.VMM_HANDLE else 0,
        released=bool(value.released),
        handle=value.aux if object_kind is ObjectKind.VMM_MAPPING else 0,
        stream=value.aux if object_kind is ObjectKind.BLOCK else 0,
        sample_bytes=value.sample_kib * 1024,
        sampled=bool(value.sampled) and value.sample_kib != 0,
    )


_LEDGER_KEY = struct.Struct("<IBBHQ")  # struct kvt_ledger_key (abi.RawLedgerKey)
_LEDGER_VALUE = struct.Struct("<QQQQIiHBBHBBQ")  # struct kvt_ledger_value (abi.RawLedgerValue)
_OBJECT_KINDS, _LAYER_VALUES = _lookup(ObjectKind, zero=False), _lookup(Layer, zero=False)
_MEMORY_VALUES = _lookup(Memory, zero=False)
_VMM_HANDLE, _VMM_MAPPING, _BLOCK = ObjectKind.VMM_HANDLE, ObjectKind.VMM_MAPPING, ObjectKind.BLOCK
_KNOWN_LAYERS, _KNOWN_APIS = frozenset(_LAYER_VALUES), frozenset(_APIS)
_KNOWN_MEMORIES = frozenset(_MEMORY_VALUES)
_KEY_BYTES, _VALUE_BYTES = _LEDGER_KEY.size, _LEDGER_VALUE.size


def _raw_entries(keys: bytes, values: bytes) -> Iterator[tuple[tuple, tuple]]:
    """(key fields, value fields) of each raw kvt_ledger_key / kvt_ledger_value pair of a chunk, unpacked in
    bulk (one C call per array)."""
    return zip(_LEDGER_KEY.iter_unpack(keys), _LEDGER_VALUE.iter_unpack(values), strict=True)


def decode_ledger_chunk(keys: bytes, values: bytes, clock: Clock, objects: frozenset[int] | None = None,
                        pids: Collection[int] = ()) -> Iterator[tuple[Outstanding, int]]:
    """(entry, kernel stack id) of raw kvt_ledger_key / kvt_ledger_value arrays (loader.iter_ledger_chunks),
    unpacked in bulk; only `objects` (raw values; None: all) of `pids` (empty: all) are built. Entries this
    build cannot read are left out (a resync reads them one at a time and says why)."""
    offset_ns = clock.offset_ns
    for (pid, layer, object_kind, _, address), (size_bytes, timestamp_ns, caller, aux, tid, device, api, memory,
                                                 released, sample_kib, sampled, _, stack_id) in _raw_entries(keys,
                                                                                                          values):
        if (objects is not None and object_kind not in objects) or (pids and pid not in pids):
            continue
        try:
            kind = _OBJECT_KINDS[object_kind]
            entry = Outstanding(  # positional, in Outstanding's field order: a keyword call costs twice as much
                LedgerKey(pid, _LAYER_VALUES[layer], kind, address), size_bytes, timestamp_ns + offset_ns, device,
                _APIS[api], _MEMORY_VALUES[memory], tid, caller, aux if kind is _VMM_HANDLE else 0, bool(released),
                aux if kind is _VMM_MAPPING else 0, 0, aux if kind is _BLOCK else 0, sample_kib * 1024,
                sampled != 0 and sample_kib != 0)
        except KeyError:
            continue
        yield entry, stack_id


def ledger_batch_in_chunk(keys: bytes, values: bytes, clock: Clock, stack_ids: Mapping[int, int],
                          objects: frozenset[int], pids: Collection[int] = (),
                          gone: Mapping[int, int] | None = None) -> RowBatch:
    """decode_ledger_chunk's entries as a batch of rows in columns (model.ledger.entry_row's fields, in order),
    the stacks named by `stack_ids` (kernel stack id -> the agent's), those of a pid in `gone` at most its wall
    time old left out: each field is read from the chunk's bytes as a column, in one C call (a strided view of
    the arrays); no Outstanding, nor tuple, nor a Python step, per entry where every entry of the chunk is taken
    (where some are not, one step each picks them)."""
    count = len(keys) // _KEY_BYTES
    if not count:
        return RowBatch([[] for _ in ENTRY_ROW_FIELDS], 0)
    key_words, key_bytes = memoryview(keys).cast("I"), memoryview(keys).cast("B")
    value_words = memoryview(values).cast("Q")
    value_u32, value_s32 = memoryview(values).cast("I"), memoryview(values).cast("i")
    value_shorts = memoryview(values).cast("H")
    value_bytes = memoryview(values).cast("B")
    k, v = _KEY_BYTES, _VALUE_BYTES
    pid = key_words[0::k // 4].tolist()
    layer, kind = key_bytes[4::k].tolist(), key_bytes[5::k].tolist()
    api, memory = value_shorts[20::v // 2].tolist(), value_bytes[42::v].tolist()
    taken: list[bool] | None = None  # None: every entry of the chunk
    if not (objects.issuperset(kind) and _KNOWN_LAYERS.issuperset(layer) and _KNOWN_APIS.issuperset(api)
            and _KNOWN_MEMORIES.issuperset(memory) and (not pids or set(pids).issuperset(pid))):
        wanted = set(pids)
        taken = [object_kind in objects and layer_value in _KNOWN_LAYERS and api_value in _KNOWN_APIS
                 and memory_value in _KNOWN_MEMORIES and (not wanted or entry_pid in wanted)
                 for entry_pid, layer_value, object_kind, api_value, memory_value in
                 zip(pid, layer, kind, api, memory, strict=True)]
    timestamp = list(map(operator.add, value_words[1::v // 8].tolist(), itertools.repeat(clock.offset_ns)))
    if gone and not gone.keys().isdisjoint(pid):
        taken = [(taken is None or taken[index]) and timestamp[index] > gone.get(entry_pid, -1)
                 for index, entry_pid in enumerate(pid)]
    aux = value_words[3::v // 8].tolist()
    sample_kib = value_shorts[22::v // 2].tolist()
    kernel_stacks = value_words[6::v // 8].tolist()
    if 0 in stack_ids:
        stacks = [stack_ids.get(stack, 0) if stack else 0 for stack in kernel_stacks]
    else:
        stacks = list(map(stack_ids.get, kernel_stacks, itertools.repeat(0)))
    block = ObjectKind.BLOCK.value
    if kind.count(block) == count:
        stream = aux
    elif block in kind:
        stream = list(map(operator.mul, aux, map(operator.eq, kind, itertools.repeat(block))))
    else:
        stream = [0] * count
    none = [0] * count  # (the kernel keeps allocations and blocks only: no VMM handle's mapped count, nor handle)
    batch = RowBatch([pid, value_u32[8::v // 4].tolist(), layer, kind, memory, api, value_words[0::v // 8].tolist(),
                      memoryview(keys).cast("Q")[1::k // 8].tolist(), value_s32[9::v // 4].tolist(), timestamp,
                      value_words[2::v // 8].tolist(), stacks, none, list(map(bool, value_bytes[43::v].tolist())),
                      none, stream, list(map(operator.mul, sample_kib, itertools.repeat(1024))),
                      list(map(bool, map(operator.mul, value_bytes[46::v].tolist(), sample_kib)))], count)
    return batch if taken is None else batch.where(taken)


def stacks_in_chunk(keys: bytes, values: bytes, objects: frozenset[int],
                    pids: Collection[int] = ()) -> Iterator[tuple[int, int]]:
    """(pid, kernel stack id) of each raw entry of `objects` (raw values) of `pids` (empty: all) that has a
    stack, without building an entry each (a resync goes through millions)."""
    for (pid, _, object_kind, _, _), (*_, stack_id) in _raw_entries(keys, values):
        if stack_id and object_kind in objects and (not pids or pid in pids):
            yield pid, stack_id


def decode_totals(raw: Iterable[tuple[abi.RawTotalsKey, abi.RawTotalsValue]],
                  pids: Collection[int] = ()) -> dict[TotalsKey, tuple[int, int]]:
    """The kernel's totals (struct kvt_totals_key/value) of `pids` (empty: all) as (bytes, count) per
    TotalsKey; a layer or memory this build does not know is left out."""
    totals: dict[TotalsKey, tuple[int, int]] = {}
    for key, value in raw:
        totals_key = _totals_key(key.pid, key.device, key.layer, key.memory)
        if totals_key is not None and (not pids or key.pid in pids):
            totals[totals_key] = (value.size_bytes, value.count)
    return totals


def _totals_key(pid: int, device: int, layer: int, memory: int) -> TotalsKey | None:
    """The TotalsKey of raw values; None for a layer or memory this build does not know."""
    layer_member, memory_member = _LAYER_VALUES.get(layer), _MEMORY_VALUES.get(memory)
    if layer_member is None or memory_member is None:
        return None
    return TotalsKey(pid, device, layer_member, memory_member)


def doomed_in_chunk(keys: bytes, values: bytes, pids: frozenset[int], before_ns: int, device: int | None,
                    counted: frozenset[int], objects: frozenset[int] | None = None,
                    ) -> list[tuple[bytes, TotalsKey | None, int]]:
    """(raw key, totals key, size) of the entries of `pids` at most `before_ns` old (kernel clock; on `device`
    if given; of `objects` only, raw values, if given): what a process exit, a context destroy or processes
    lowered to depth SEGMENTS drop. The totals key is None but for `counted` objects (raw values), whose
    totals the kernel keeps: the Session stops counting those the agent deletes."""
    doomed: list[tuple[bytes, TotalsKey | None, int]] = []
    key_size = _LEDGER_KEY.size
    for index, ((entry_pid, layer, object_kind, _, _), (size_bytes, timestamp_ns, _, _, _, entry_device, _, memory,
                                                        *_)) in enumerate(_raw_entries(keys, values)):
        if entry_pid not in pids or timestamp_ns > before_ns or (device is not None and entry_device != device) or (
                objects is not None and object_kind not in objects):
            continue
        totals = _totals_key(entry_pid, entry_device, layer, memory) if object_kind in counted else None
        doomed.append((keys[index * key_size:(index + 1) * key_size], totals, size_bytes))
    return doomed


def gone_in_chunk(keys: bytes, values: bytes, befores: Mapping[int, int], counted: frozenset[int],
                  ) -> list[tuple[bytes, int, TotalsKey | None, int]]:
    """(raw key, pid, totals key, size) of the entries of gone processes in a chunk: those of a pid in
    `befores` at most its `befores[pid]` old (kernel clock: what it held at its exit; a process that took the
    pid since keeps its own). The pids are read first, in one C call, and only the gone ones' entries are
    unpacked: a chunk costs what its gone entries are, not its size (a host holds millions of entries)."""
    key_size, value_size = _LEDGER_KEY.size, _LEDGER_VALUE.size
    pids = memoryview(keys).cast("I")[::key_size // 4].tolist()  # (pid is the key's first field)
    if befores.keys().isdisjoint(pids):
        return []
    gone: list[tuple[bytes, int, TotalsKey | None, int]] = []
    get = befores.get
    for index in [index for index, pid in enumerate(pids) if get(pid) is not None]:
        entry_pid, layer, object_kind, _, _ = _LEDGER_KEY.unpack_from(keys, index * key_size)
        size_bytes, timestamp_ns, _, _, _, entry_device, _, memory, *_ = _LEDGER_VALUE.unpack_from(
            values, index * value_size)
        if timestamp_ns > befores[entry_pid]:
            continue
        totals = _totals_key(entry_pid, entry_device, layer, memory) if object_kind in counted else None
        gone.append((keys[index * key_size:(index + 1) * key_size], entry_pid, totals, size_bytes))
    return gone


def chunk_objects(keys: bytes) -> set[int]:
    """The object kinds (raw values) of a chunk's entries, read in one C call (the key's sixth byte)."""
    return set(memoryview(keys)[5::_LEDGER_KEY.size])


def chunk_stack_ids(values: bytes) -> set[int]:
    """The kernel stack ids of a chunk's entries (0: none), read in one C call (the value's last field)."""
    return set(memoryview(values).cast("Q")[_LEDGER_VALUE.size // 8 - 1::_LEDGER_VALUE.size // 8])
