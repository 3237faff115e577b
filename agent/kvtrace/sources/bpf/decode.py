"""Raw BPF records -> model events. The only place that knows the raw layout's meaning."""
from __future__ import annotations

import time

from kvtrace.model.events import Api, Event, Kind, Layer, Memory, ObjectKind
from kvtrace.model.ledger import LedgerKey, Outstanding
from kvtrace.model.processes import ProcessTable
from kvtrace.sources.bpf import abi


class Clock:
    """bpf_ktime_get_ns() is CLOCK_MONOTONIC; events carry wall-clock nanoseconds."""

    def __init__(self) -> None:
        self.offset_ns = time.time_ns() - time.monotonic_ns()

    def wall_ns(self, monotonic_ns: int) -> int:
        return monotonic_ns + self.offset_ns

    def monotonic_ns(self, wall_ns: int) -> int:
        return wall_ns - self.offset_ns


def _enum(enum_type, value):
    return enum_type(value) if value else None


def decode_event(raw: abi.RawEvent, clock: Clock, processes: ProcessTable | None) -> Event:
    event = Event(
        kind=Kind(raw.kind),
        api=Api(raw.api),
        pid=raw.pid,
        tid=raw.tid,
        timestamp_ns=clock.wall_ns(raw.timestamp_ns),
        layer=_enum(Layer, raw.layer),
        object=_enum(ObjectKind, raw.object),
        memory=_enum(Memory, raw.memory),
        size_bytes=raw.size_bytes,
        address=raw.address,
        device=raw.device,
        error_code=raw.error_code,
        caller_address=raw.caller_address,
        aux=raw.aux,
        comm=raw.comm.decode("utf-8", "replace"),
        stack_status=abi.STACK_STATUS[raw.stack_status] if raw.stack_status < len(abi.STACK_STATUS) else "",
    )
    info = processes.get(raw.pid) if processes is not None else None
    if info is not None:
        event.title = info.title
        event.container = info.container
    else:
        event.title = event.comm
    return event


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
    )
