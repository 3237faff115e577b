"""Raw BPF records -> model events. The only place that knows the raw layout's meaning."""
from __future__ import annotations

import struct
import time

from kvtrace.model.events import (
    Api,
    Event,
    Kind,
    Layer,
    Memory,
    ObjectKind,
    StackStatus,
)
from kvtrace.model.ledger import LedgerKey, Outstanding
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
_MAP, _UNMAP = Api.cuMemMap.value, Api.cuMemUnmap.value
_TORCH_APIS = (Api.pytorch_malloc.value, Api.pytorch_free.value)


def decode_event(record: bytes, clock: Clock) -> tuple[Event, int]:
    """(event, kernel stack id) of one ring-buffer record (struct kvt_event). The record's `aux`
    is the handle of a cuMemMap, the physical bytes a cuMemUnmap freed, and a block's stream.

    Raises UndecodableRecord (a ValueError) for a record it cannot read, and nothing else."""
    try:
        (timestamp_ns, address, size_bytes, caller_address, aux, kernel_stack_id, pid, tid, device,
         error_code, api, kind, layer, object_kind, memory, stack_status, _reserved,
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
        caller_address=caller_address, handle=aux if api == _MAP else 0,
        freed_bytes=aux if api == _UNMAP else 0, stream=aux if api in _TORCH_APIS else 0,
        comm=comm.split(b"\0", 1)[0].decode("utf-8", "replace"),
        stack_status=_STACK_STATUS.get(stack_status, StackStatus.NOT_WALKED),
    )
    return event, kernel_stack_id


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
    )
