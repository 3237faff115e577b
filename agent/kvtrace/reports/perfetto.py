"""A recording as a Perfetto trace: memory over time next to the calls that changed it.

`write_perfetto_trace` replays a recording (the ledger at its start, then its records in time order)
through a real `Ledger`, so every figure is the ledger's own, and writes Perfetto's native protobuf
trace (a stream of TracePackets, built with the messages of the `perfetto` package) for
ui.perfetto.dev or trace_processor. It holds the ledger and the last value of each counter, never
the trace: records are read and packets written one at a time.

What the trace holds, per traced process (a process track named ``<title>`` with its pid):

- ``traced bytes GPU <n>``: physical device memory the process holds on CUDA device n as the
  ledger counts it (driver and VMM layers), a value at the start and at every change;
- ``torch block bytes GPU <n>``: the live blocks PyTorch's caching allocator handed out (tensors,
  from its pytorch:malloc probes), where the process has any. Not torch's *reserved* memory: the
  segments those blocks live in are in ``traced bytes``;
- ``NVML used bytes NVML GPU <i>``: what NVML reports the process uses on its GPU i, at each NVML
  sample, and 0 once NVML stops listing the process on a GPU that answered;
- an instant for each allocation, free and failed allocation, on the calling thread's track,
  named after the API, with size_bytes, address, device, layer and the Python stack (outermost
  frame first) as arguments; a failure adds its CUDA error_code.

And per GPU, ``NVML GPU <i> used bytes`` and ``NVML GPU <i> free bytes``. On the ``kvtrace``
track, an ``events lost`` instant wherever the source dropped events, and a ``ledger replaced``
instant at each checkpoint inside the recording (a `RecordedCheckpoint`: the agent resynced its
ledger from the kernel's exact copy, or a flight recorder dump's state at its trigger).

After a loss the traced figures are the replayed ledger's, which misses whatever the lost events
changed; they are exact again from the next checkpoint, where the writer's ledger is replaced by the
checkpoint's entries and every traced and torch counter that differs gets its new value (0 for
memory that went, a new track for a process first seen there) at the checkpoint's time.

CUDA device n (traced) and NVML GPU i are numbered differently: CUDA counts the GPUs a process can
see, NVML all of them in PCI order (model/gpus.py). Timestamps are the recording's wall-clock
nanoseconds, on the trace's default clock.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from itertools import chain
from typing import Any, BinaryIO

from kvtrace.human import device_label
from kvtrace.model.events import Event, EventsLost, Kind, Layer, StackStatus
from kvtrace.model.gpus import NvmlSample
from kvtrace.model.ledger import Ledger, LedgerKey, Outstanding
from kvtrace.model.stacks import Stack
from kvtrace.reports.output import write_whole
from kvtrace.reports.recording import RecordedCheckpoint

Record = Event | NvmlSample | EventsLost | RecordedCheckpoint

# The calls that become instants; the others (maps, context and process events) show only through
# the counters they change.
INSTANT_KINDS = frozenset({Kind.ALLOC, Kind.FREE, Kind.ALLOC_FAILED})
LOSS_TRACK_NAME = "kvtrace"
CHECKPOINT_MARKER = "ledger replaced"
CHECKPOINT_WHY = "checkpoint: the agent resynced its ledger, or a flight recorder dump's state at its trigger"
# All packets come from this one writer: one sequence.
_SEQUENCE_ID = 1
# Names, titles and frames come from the traced processes: capped, so one cannot bloat every packet.
MAX_TEXT_CHARS = 512

_TRACED, _TORCH = "traced", "torch"


@dataclass(frozen=True)
class PerfettoSummary:
    """What was written."""

    packets: int
    tracks: int  # track descriptors: processes, threads, counters, the loss track
    counter_values: int
    instants: int  # allocations, frees and failed allocations
    loss_markers: int
    events: int  # events applied to the ledger
    events_lost: int  # the sum of the loss markers' counts
    checkpoints: int  # ledgers replaced midway (RecordedCheckpoint records), each with a marker


def write_perfetto_trace(path: str | os.PathLike[str], checkpoint: Iterable[Outstanding],
                         records: Iterable[Record], stack_of: Callable[[int], Stack | None],
                         titles: dict[int, str], start_ns: int | None = None) -> PerfettoSummary:
    """Writes the trace of a recording to `path`; `checkpoint` is the ledger at its start, `records`
    its events, NVML samples, losses and later checkpoints in time order. The starting values are
    placed at `start_ns`, by default the first record's time.

    The trace goes to a temporary file in the same directory, renamed over `path` once complete, so
    a failure (a record the ledger refuses, a full disk) never leaves half a trace where a viewer
    would open it. It is created 0600: it holds stacks, titles and addresses. The caller's checkpoint
    entries are copied, not changed.
    """
    # Imported here: only this export needs it (the `perfetto` extra).
    from perfetto.trace_builder.proto_builder import StreamingTraceProtoBuilder

    def write(file: BinaryIO) -> _TraceWriter:
        writer = _TraceWriter(StreamingTraceProtoBuilder(file), stack_of, titles)
        writer.write(checkpoint, records, start_ns)
        return writer

    writer = write_whole(path, write, "trace", "kvtrace.pftrace", 0o600)
    return writer.summary()


class _TraceWriter:
    """Drives the ledger over the records and writes the packets their changes call for."""

    def __init__(self, builder: Any, stack_of: Callable[[int], Stack | None], titles: dict[int, str]) -> None:
        # The message classes come with the builder's module; loaded here to keep the import lazy.
        from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as trace_pb2

        self._pb = trace_pb2
        self._builder = builder
        self._stack_of = stack_of
        self._titles = titles
        self._ledger = Ledger()
        self._uuids: dict[tuple[Any, ...], int] = {}
        # Last value written per pid and (metric, device), nonzero only: a key that goes away is a 0.
        self._held: dict[int, dict[tuple[str, int], int]] = {}
        self._nvml_held: set[tuple[int, int]] = set()  # (pid, NVML index) listed by the last sample
        self._stack_texts: dict[int, str] = {}
        self._packets = self._counter_values = self._instants = self._loss_markers = 0
        self._events = self._events_lost = self._checkpoints = 0

    def summary(self) -> PerfettoSummary:
        return PerfettoSummary(self._packets, len(self._uuids), self._counter_values, self._instants,
                               self._loss_markers, self._events, self._events_lost, self._checkpoints)

    def write(self, checkpoint: Iterable[Outstanding], records: Iterable[Record], start_ns: int | None) -> None:
        entries = _copies(checkpoint)
        self._ledger.resync(entries)
        remaining: Iterator[Record] = iter(records)
        first = next(remaining, None)
        if start_ns is None:
            start_ns = first.timestamp_ns if first is not None else max(
                (entry.timestamp_ns for entry in entries), default=0)
        for pid in sorted({entry.key.pid for entry in entries}):
            self._update_counters(pid, start_ns)
        for record in chain([first] if first is not None else [], remaining):
            if isinstance(record, Event):
                self._on_event(record)
            elif isinstance(record, NvmlSample):
                self._on_nvml(record)
            elif isinstance(record, EventsLost):
                self._on_loss(record)
            elif isinstance(record, RecordedCheckpoint):
                self._on_checkpoint(record)
            else:
                raise TypeError("a Perfetto trace is made of events, NVML samples, losses and checkpoints, "
                                f"not {type(record).__name__}")

    # ---- records ----

    def _on_event(self, event: Event) -> None:
        if event.kind in INSTANT_KINDS:
            self._instant_of(event)  # before applying: a free's size is its entry's, still in the ledger
        self._ledger.apply(event)
        self._events += 1
        self._update_counters(event.pid, event.timestamp_ns)

    def _on_nvml(self, sample: NvmlSample) -> None:
        for gpu in sample.gpus:
            used = self._counter_track(("nvml gpu used", gpu.index), f"NVML GPU {gpu.index} used bytes")
            free = self._counter_track(("nvml gpu free", gpu.index), f"NVML GPU {gpu.index} free bytes")
            self._counter(sample.timestamp_ns, used, gpu.used_bytes)
            self._counter(sample.timestamp_ns, free, gpu.free_bytes)
        listed = set()
        for process in sample.processes:
            if process.used_bytes is None:  # NVML does not say (some drivers, vGPU): no value, not 0
                continue
            key = (process.pid, process.gpu_index)
            listed.add(key)
            self._counter(sample.timestamp_ns, self._nvml_process_track(*key), process.used_bytes)
        # A process NVML stopped listing on a GPU that answered has no memory there any more.
        answered = {gpu.index for gpu in sample.gpus}
        for key in sorted(self._nvml_held - listed):
            if key[1] in answered:
                self._counter(sample.timestamp_ns, self._nvml_process_track(*key), 0)
                self._nvml_held.discard(key)
        self._nvml_held |= listed

    def _on_loss(self, loss: EventsLost) -> None:
        self._instant(loss.timestamp_ns, self._loss_track(), "events lost", {"count": loss.count})
        self._loss_markers += 1
        self._events_lost += loss.count

    def _on_checkpoint(self, checkpoint: RecordedCheckpoint) -> None:
        """The ledger becomes the checkpoint's; every process it or the old one held gets its new values."""
        entries = _copies(checkpoint.entries)
        self._ledger.resync(entries)
        self._instant(checkpoint.timestamp_ns, self._loss_track(), CHECKPOINT_MARKER,
                      {"why": CHECKPOINT_WHY, "entries": len(entries)})
        self._checkpoints += 1
        for pid in sorted(self._held.keys() | {entry.key.pid for entry in entries}):
            self._update_counters(pid, checkpoint.timestamp_ns)

    # ---- counters ----

    def _update_counters(self, pid: int, timestamp_ns: int) -> None:
        """Writes the pid's counters that differ from what was last written. After an event only its
        own pid can change (the ledger applies it to that process's entries alone); after a
        checkpoint, any."""
        now = self._held_now(pid)
        before = self._held.get(pid, {})
        for key in sorted(now.keys() | before.keys()):
            value = now.get(key, 0)
            if value != before.get(key, 0):
                metric, device = key
                self._counter(timestamp_ns, self._process_counter_track(pid, metric, device), value)
        if now:
            self._held[pid] = now
        else:
            self._held.pop(pid, None)

    def _held_now(self, pid: int) -> dict[tuple[str, int], int]:
        held = {}
        for device in {key.device for key in self._ledger.totals() if key.pid == pid}:
            held[(_TRACED, device)] = self._ledger.physical_device_bytes(pid, device)
            held[(_TORCH, device)] = self._ledger.outstanding_bytes(pid, device, layers=(Layer.TORCH,))
        return {key: value for key, value in held.items() if value}

    def _counter(self, timestamp_ns: int, track_uuid: int, value: int) -> None:
        packet = self._packet(timestamp_ns)
        packet.track_event.type = self._pb.TrackEvent.TYPE_COUNTER
        packet.track_event.track_uuid = track_uuid
        packet.track_event.counter_value = value
        self._emit(packet)
        self._counter_values += 1

    # ---- instants ----

    def _instant_of(self, event: Event) -> None:
        size_bytes = event.size_bytes
        if event.kind is Kind.FREE and event.layer is not None and event.object is not None:
            entry = self._ledger.get(LedgerKey(event.pid, event.layer, event.object, event.address))
            if entry is not None:
                size_bytes = entry.size_bytes
        args: dict[str, int | str] = {
            "size_bytes": size_bytes,
            "address": f"{event.address:#x}",
            "device": event.device,
            "layer": event.layer.name.lower() if event.layer is not None else "",
            "stack": self._stack_text(event),
        }
        if event.kind is Kind.ALLOC_FAILED:
            args["error_code"] = event.error_code
        track = self._thread_track(event) if event.tid else self._process_track(event.pid, event.title)
        self._instant(event.timestamp_ns, track, event.api.name, args)
        self._instants += 1

    def _instant(self, timestamp_ns: int, track_uuid: int, name: str, args: dict[str, int | str]) -> None:
        packet = self._packet(timestamp_ns)
        track_event = packet.track_event
        track_event.type = self._pb.TrackEvent.TYPE_INSTANT
        track_event.track_uuid = track_uuid
        track_event.name = name
        for key, value in args.items():
            annotation = track_event.debug_annotations.add()
            annotation.name = key
            if isinstance(value, int):
                annotation.int_value = value
            else:
                annotation.string_value = value
        self._emit(packet)

    def _stack_text(self, event: Event) -> str:
        """The Python stack, one ``function (file:line)`` per line, outermost first."""
        text = self._stack_texts.get(event.stack_id) if event.stack_id else None
        if text is not None:
            return text
        stack = self._stack_of(event.stack_id) if event.stack_id else None
        if stack is None or not stack.frames:
            if event.stack_status in (StackStatus.OK, StackStatus.NOT_WALKED):
                return "[no Python stack]"
            return f"[no Python stack: {event.stack_status.name.lower()}]"
        lines = [_text(f"{frame.function} ({frame.file}:{frame.line})") for frame in reversed(stack.frames)]
        if stack.truncated:
            lines.insert(0, "[truncated]")
        text = self._stack_texts[event.stack_id] = "\n".join(lines)
        return text

    # ---- tracks ----

    def _track(self, key: tuple[Any, ...], describe: Callable[[Any], None]) -> int:
        """The uuid of the track for `key`, its descriptor written the first time it is asked for."""
        uuid = self._uuids.get(key)
        if uuid is None:
            uuid = self._uuids[key] = len(self._uuids) + 1
            packet = self._pb.TracePacket()
            packet.trusted_packet_sequence_id = _SEQUENCE_ID
            packet.track_descriptor.uuid = uuid
            describe(packet.track_descriptor)
            self._emit(packet)
        return uuid

    def _loss_track(self) -> int:
        return self._track(("loss",), lambda descriptor: setattr(descriptor, "name", LOSS_TRACK_NAME))

    def _process_track(self, pid: int, title: str = "") -> int:
        def describe(descriptor: Any) -> None:
            descriptor.process.pid = pid
            name = self._titles.get(pid) or title
            if name:
                descriptor.process.process_name = _text(name)
        return self._track(("process", pid), describe)

    def _thread_track(self, event: Event) -> int:
        parent = self._process_track(event.pid, event.title)

        def describe(descriptor: Any) -> None:
            descriptor.parent_uuid = parent
            descriptor.thread.pid = event.pid
            descriptor.thread.tid = event.tid
            if event.comm:
                descriptor.thread.thread_name = _text(event.comm)
        return self._track(("thread", event.pid, event.tid), describe)

    def _process_counter_track(self, pid: int, metric: str, device: int) -> int:
        gpu = f"GPU {device_label(device)}"
        name = f"traced bytes {gpu}" if metric == _TRACED else f"torch block bytes {gpu}"
        return self._counter_track((metric, pid, device), name, self._process_track(pid))

    def _nvml_process_track(self, pid: int, gpu_index: int) -> int:
        return self._counter_track(("nvml process used", pid, gpu_index), f"NVML used bytes NVML GPU {gpu_index}",
                                   self._process_track(pid))

    def _counter_track(self, key: tuple[Any, ...], name: str, parent: int | None = None) -> int:
        def describe(descriptor: Any) -> None:
            if parent is not None:
                descriptor.parent_uuid = parent
            descriptor.name = name
            descriptor.counter.unit = self._pb.CounterDescriptor.UNIT_SIZE_BYTES
        return self._track(key, describe)

    # ---- packets ----

    def _packet(self, timestamp_ns: int) -> Any:
        packet = self._pb.TracePacket()
        packet.timestamp = timestamp_ns
        packet.trusted_packet_sequence_id = _SEQUENCE_ID
        return packet

    def _emit(self, packet: Any) -> None:
        self._builder.write_packet(packet)
        self._packets += 1


def _copies(entries: Iterable[Outstanding]) -> list[Outstanding]:
    """The ledger changes the entries it holds (VMM mapping counts, stack ids on resync): it gets
    copies, so the caller's checkpoint stays as it was."""
    return [replace(entry) for entry in entries]


def _text(text: str) -> str:
    """Valid UTF-8 (a title read with surrogate escapes would make the packet unserializable), capped."""
    text = text.encode("utf-8", "replace").decode("utf-8")
    return text if len(text) <= MAX_TEXT_CHARS else text[:MAX_TEXT_CHARS - 1] + "…"
