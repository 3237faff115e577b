"""Recording a running agent: the Session's records as recording frames.

    Session ──sink──▶ RecordQueue ──▶ FrameEncoder ──▶ RecordingWriter   `kvtrace agent --record FILE`
                                                   └─▶ StreamRecording   `kvtrace record -o FILE`
    Session ──sink──▶ FlightRecorder (a ring of the last seconds) ──dump──▶ a file per trigger

Every recording starts with a checkpoint, the ledger copied at the moment the sink joined (or the
file rotated, or the ledger was resynced after lost events), so that replaying it rebuilds the
ledger exactly: the checkpoint, then each event applied in order. Sinks run under the Session's lock:
they only queue model records; encoding and writing happen on the recorder's own thread.
"""
from __future__ import annotations

import logging
import os
import platform
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kvtrace import __version__
from kvtrace._proto.kvtrace.v1 import agent_service_pb2 as service_pb2
from kvtrace._proto.kvtrace.v1 import events_pb2
from kvtrace.model.depth import ProcessDepth
from kvtrace.model.events import Event, EventsLost, Kind
from kvtrace.model.gpus import NvmlSample
from kvtrace.model.ledger import LedgerReadRefused, LedgerResynced, Outstanding
from kvtrace.model.processes import ProcessInfo, TitleMatcher, TitlePattern, valid_text
from kvtrace.model.stacks import NativeFrame, Stack
from kvtrace.reports.recording import RecordingWriter
from kvtrace.session import Session, SessionCheckpoint
from kvtrace.wire import (
    event_to_proto,
    lost_to_proto,
    nvml_to_proto,
    outstanding_to_proto,
    recorded_process_to_proto,
    stack_message,
)

log = logging.getLogger(__name__)

# A checkpoint of a large ledger is split into frames of this many allocations (~1 MiB each).
CHECKPOINT_FRAME_ENTRIES = 8192
DEFAULT_MAX_QUEUED_RECORDS = 262144  # per recording; past it records are dropped and counted
FLUSH_SECONDS = 1.0  # a crash loses at most this much of a recording

CHECKPOINT_AFTER_DROPS_SECONDS = 1.0
# How often (in the events' time) a recording looks for processes whose depth changed: the depth policy
# decides once per analysis tick (a second).
DEPTH_CHECK_NS = 1_000_000_000


@dataclass(frozen=True)
class _Dropped:
    """Records this recording's own queue dropped (its reader was too slow), at this point."""

    count: int
    timestamp_ns: int


QueuedRecord = Event | EventsLost | NvmlSample | SessionCheckpoint | _Dropped


class ProcessFilter:
    """Which processes a recording keeps; empty: all. The title regex runs as StreamEvents' does (once
    per distinct title, on a bounded part of it): this is asked for every event, under the Session's lock."""

    def __init__(self, pids: frozenset[int] = frozenset(), title_regex: TitlePattern | None = None) -> None:
        self.pids = pids
        self._titles = TitleMatcher(title_regex) if title_regex is not None else None
        self.everything = not pids and title_regex is None

    def wants(self, pid: int, title: str) -> bool:
        if self.pids and pid not in self.pids:
            return False
        return self._titles is None or self._titles.matches(title)

    def describe(self, title_regex: str = "") -> str:
        parts = []
        if self.pids:
            parts.append("pids " + ",".join(str(pid) for pid in sorted(self.pids)))
        if title_regex:
            parts.append(f"title ~ {title_regex}")
        return "; ".join(parts)


EVERYTHING = ProcessFilter()


def recording_header(agent_started_wall_seconds: float, leak_min_age_seconds: float, start_time_ns: int,
                     filter_description: str = "",
                     trigger: service_pb2.FlightTrigger | None = None) -> service_pb2.RecordingHeader:
    return service_pb2.RecordingHeader(
        agent_version=__version__, host=socket.gethostname(), kernel_release=platform.release(),
        start_time_ns=start_time_ns, agent_start_time_ns=int(agent_started_wall_seconds * 1e9),
        leak_min_age_seconds=leak_min_age_seconds, filter_description=filter_description, trigger=trigger)


class FrameEncoder:
    """Model records -> frames of one recording: each stack is defined once, before the first
    allocation that uses it; each process is written before its first event, with its depth, and
    again whenever its depth changes (looked at once per second of the events' time, from `depths_of`:
    the Session's process_depths). With `native_of` (the Session's native_caller), each native caller
    address of a process is named once, before the first event or checkpoint entry that has it, as
    the live agent names it: read back, the process and its libraries may be gone."""

    def __init__(self, stack_of: Callable[[int], Stack | None], process_of: Callable[[int], ProcessInfo | None],
                 wanted: ProcessFilter | None = None,
                 depths_of: Callable[[], Mapping[int, ProcessDepth]] | None = None,
                 native_of: Callable[[int, int], NativeFrame | None] | None = None) -> None:
        self._stack_of = stack_of
        self._process_of = process_of
        self._depths_of = depths_of
        self._native_of = native_of
        self._sent_callers: dict[int, set[int]] = {}  # pid -> caller addresses named
        self._depths: Mapping[int, ProcessDepth] = {}
        self._next_depth_check_ns = 0
        self._sent_stacks: set[int] = set()
        self._sent_processes: dict[int, str] = {}  # pid -> title written
        self._sent_depths: dict[int, ProcessDepth] = {}  # pid -> depth written with it
        self.events_encoded = 0
        self._wanted = wanted if wanted is not None else EVERYTHING  # what its checkpoints keep

    def restart(self) -> None:
        """A new file starts: it defines its stacks and processes again."""
        self._sent_stacks.clear()
        self._sent_processes.clear()
        self._sent_depths.clear()
        self._sent_callers.clear()

    def checkpoint(self, checkpoint: SessionCheckpoint) -> Iterator[service_pb2.RecordingFrame]:
        wanted = self._wanted
        if self._depths_of is not None:  # the processes it writes carry their depth
            self._depths = self._depths_of()
        entries = [entry for entry in checkpoint.entries
                   if wanted.everything or wanted.wants(entry.key.pid, _title(checkpoint.processes, entry))]
        for entry in entries:
            info = checkpoint.processes.get(entry.key.pid)
            yield from self._process(entry.key.pid, info)
            yield from self._stack(entry.stack_id)
            if entry.caller_address:
                yield from self._caller(entry.key.pid, entry.caller_address)
        for start in range(0, max(len(entries), 1), CHECKPOINT_FRAME_ENTRIES):
            part = entries[start:start + CHECKPOINT_FRAME_ENTRIES]
            yield service_pb2.RecordingFrame(checkpoint=service_pb2.RecordingCheckpoint(
                timestamp_ns=checkpoint.timestamp_ns, last=start + CHECKPOINT_FRAME_ENTRIES >= len(entries),
                allocations=[outstanding_to_proto(entry, checkpoint.processes.get(entry.key.pid))
                             for entry in part]))

    def record(self, record: QueuedRecord) -> Iterator[service_pb2.RecordingFrame]:
        if type(record) is Event:
            if self._depths_of is not None and record.timestamp_ns >= self._next_depth_check_ns:
                self._next_depth_check_ns = record.timestamp_ns + DEPTH_CHECK_NS
                yield from self.depth_changes()
            yield from self._process(record.pid, None, record)
            yield from self._stack(record.stack_id)
            if record.caller_address:
                yield from self._caller(record.pid, record.caller_address)
            elif record.kind is Kind.PROCESS_EXIT:  # its pid may come back as another program
                self._sent_callers.pop(record.pid, None)
            self.events_encoded += 1
            yield service_pb2.RecordingFrame(event=event_to_proto(record))
        elif type(record) is EventsLost:  # lost in the kernel's ring: the agent never saw them
            message = lost_to_proto(0, record.count)
            message.timestamp_ns = record.timestamp_ns
            yield service_pb2.RecordingFrame(event=message)
        elif type(record) is _Dropped:  # the agent saw them; this recording could not keep up
            message = lost_to_proto(record.count, 0)
            message.timestamp_ns = record.timestamp_ns
            yield service_pb2.RecordingFrame(event=message)
        elif type(record) is NvmlSample:
            yield service_pb2.RecordingFrame(nvml=nvml_to_proto(record))
        elif type(record) is SessionCheckpoint:
            yield from self.checkpoint(record)

    def _process(self, pid: int, info: ProcessInfo | None,
                 event: Event | None = None) -> Iterator[service_pb2.RecordingFrame]:
        title = event.title if event is not None else (info.title if info is not None else "")
        if self._sent_processes.get(pid) == title:
            return
        self._sent_processes[pid] = title
        if info is None:
            info = self._process_of(pid)
        if info is None and event is not None:
            info = ProcessInfo(pid, event.title, event.comm, event.container, "", 0.0, 0.0)
        if info is not None:
            depth = self._depths.get(pid)
            if depth is not None:
                self._sent_depths[pid] = depth
            yield service_pb2.RecordingFrame(process=recorded_process_to_proto(info, depth))

    def depth_changes(self) -> Iterator[service_pb2.RecordingFrame]:
        """Processes already written whose depth changed since: written again, with the new depth. (Also called
        between events, and before a file closes: a depth decided after a process's last event is written too.)"""
        if self._depths_of is None:
            return
        self._depths = depths = self._depths_of()
        for pid, title in self._sent_processes.items():
            depth = depths.get(pid)
            if depth is None or self._sent_depths.get(pid) == depth:
                continue
            self._sent_depths[pid] = depth
            info = self._process_of(pid) or ProcessInfo(pid, title, "", "", "", 0.0, 0.0)
            yield service_pb2.RecordingFrame(process=recorded_process_to_proto(info, depth))

    def _caller(self, pid: int, address: int) -> Iterator[service_pb2.RecordingFrame]:
        if self._native_of is None:
            return
        sent = self._sent_callers.get(pid)
        if sent is None:
            sent = self._sent_callers[pid] = set()
        elif address in sent:
            return
        sent.add(address)
        frame = self._native_of(pid, address)
        if frame is not None and frame.module:  # no module: the agent knew no more than the address
            yield service_pb2.RecordingFrame(native_caller=service_pb2.NativeCallerName(
                pid=pid, address=address, frame=service_pb2.NativeFrame(
                    module=valid_text(frame.module), symbol=valid_text(frame.symbol), offset=frame.offset)))

    def _stack(self, stack_id: int) -> Iterator[service_pb2.RecordingFrame]:
        if not stack_id or stack_id in self._sent_stacks:
            return
        self._sent_stacks.add(stack_id)
        stack = self._stack_of(stack_id)
        if stack is not None:
            yield service_pb2.RecordingFrame(event=events_pb2.Event(stack_definition=stack_message(stack_id, stack)))


def _title(processes: dict[int, ProcessInfo], entry: Outstanding) -> str:
    info = processes.get(entry.key.pid)
    return info.title if info is not None else ""


class CheckpointSource(Protocol):
    """What a RecordQueue reads of the Session it is a sink of (under the Session's lock)."""

    def checkpoint_locked(self) -> SessionCheckpoint: ...

    def wall_clock_ns(self) -> int: ...


class RecordQueue:
    """A Session sink that queues what one recording wants, bounded to `max_records`.

    Past the bound, records are dropped: the recording gets a loss marker where they are missing and,
    once the queue has room again (a quarter of it) and at most once a second, a checkpoint — the
    ledger as it stands after the event that found room — so that its replay is exact again from
    there. A resync of the Session's ledger (after events lost in the kernel) is followed by a
    checkpoint at once (with no room, by the first event that finds some). `request_checkpoint()` makes
    the next event bring one (a rotated file starts with it)."""

    def __init__(self, session: CheckpointSource, wanted: ProcessFilter | None = None,
                 max_records: int = DEFAULT_MAX_QUEUED_RECORDS) -> None:
        self._session = session
        self._wanted = wanted if wanted is not None else EVERYTHING
        self._max_records = max_records
        self._room_records = max_records * 3 // 4  # a checkpoint after drops waits for this much room
        self._records: deque[QueuedRecord] = deque()
        self._ready = threading.Condition(threading.Lock())
        self._dropped = 0  # since the last marker
        self.dropped_total = 0
        self._checkpoint_due = False
        self.checkpoints_refused_total = 0
        self._dropped_since_checkpoint = False
        self._last_drop_checkpoint = -CHECKPOINT_AFTER_DROPS_SECONDS
        self.closed = False

    # ---- the Session's side (under its lock) ----

    def publish(self, event: Event) -> None:
        if not self._wanted.everything and not self._wanted.wants(event.pid, event.title):
            return
        if self._put(event) and self._checkpoint_due and self._may_checkpoint():
            self._append_checkpoint()

    def publish_loss(self, lost_count: int) -> None:
        self._put(EventsLost(lost_count, self._session.wall_clock_ns()))

    def publish_state(self, record: NvmlSample | LedgerResynced) -> None:
        if type(record) is NvmlSample:
            self._put(record)
        else:  # the events so far no longer add up to the ledger
            self.checkpoint_now()

    def checkpoint_now(self) -> None:
        """The ledger changed without events (a resync; a process lowered to depth segments: its blocks left
        it): a checkpoint now, where the queue has room (else the first event that finds some brings it)."""
        if len(self._records) < self._max_records:
            self._append_checkpoint()
        else:
            self._checkpoint_due = True

    def _append_checkpoint(self) -> None:
        """A copy of the ledger into the queue (a sink runs under the Session's lock). One too large to
        copy (--max-read-entries) is tried again at a later event, at most once a second."""
        try:
            checkpoint = self._session.checkpoint_locked()
        except LedgerReadRefused as refused:
            self._checkpoint_due = True
            self._dropped_since_checkpoint = True  # paced as after drops: at most once a second
            self._last_drop_checkpoint = time.monotonic()
            self.checkpoints_refused_total += 1
            if self.checkpoints_refused_total == 1:
                log.warning("a recording's checkpoint was not written: %s", refused)
            return
        self._checkpoint_due = False
        with self._ready:
            self._records.append(checkpoint)
            self._ready.notify()

    def _may_checkpoint(self) -> bool:
        """After drops: only with room again, and at most once a second (it copies the ledger)."""
        if not self._dropped_since_checkpoint:
            return True
        now = time.monotonic()
        if len(self._records) > self._room_records or \
                now - self._last_drop_checkpoint < CHECKPOINT_AFTER_DROPS_SECONDS:
            return False
        self._last_drop_checkpoint = now
        self._dropped_since_checkpoint = False
        return True

    def _put(self, record: QueuedRecord) -> bool:
        """Queues the record; False when it was dropped."""
        with self._ready:
            if len(self._records) >= self._max_records:
                self._dropped += 1
                self.dropped_total += 1
                self._checkpoint_due = self._dropped_since_checkpoint = True
                return False
            if self._dropped:
                self._records.append(_Dropped(self._dropped, self._session.wall_clock_ns()))
                self._dropped = 0
            self._records.append(record)
            self._ready.notify()
            return True

    # ---- the recorder's side ----

    def request_checkpoint(self) -> None:
        self._checkpoint_due = True

    def take(self, max_records: int, wait_seconds: float) -> list[QueuedRecord]:
        """Up to `max_records` records, waiting up to `wait_seconds` for the first."""
        with self._ready:
            if not self._records and not self.closed:
                self._ready.wait(wait_seconds)
            taken: list[QueuedRecord] = []
            while self._records and len(taken) < max_records:
                taken.append(self._records.popleft())
            return taken

    def close(self) -> None:
        with self._ready:
            self.closed = True
            self._ready.notify_all()


class FileRecorder:
    """`kvtrace agent --record FILE`: every record into FILE, rotated at `max_bytes` into FILE.1 ..
    FILE.<keep> (the oldest dropped). Each file starts with a checkpoint, so any one replays alone."""

    def __init__(self, session: Session, path: Path, leak_min_age_seconds: float,
                 max_bytes: int = 256 << 20, keep: int = 4) -> None:
        self.session = session
        self.path = path
        self.max_bytes = max_bytes
        self.keep = keep
        self._leak_min_age_seconds = leak_min_age_seconds
        self._queue = RecordQueue(session)
        self._encoder = FrameEncoder(session.stack, session.process, depths_of=session.process_depths,
                                     native_of=session.native_caller)
        self._writer: RecordingWriter | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.rotations_total = 0
        self.error: str | None = None

    def start(self) -> None:
        if self.path.exists():  # an earlier agent's recording (of a crash, maybe): kept as FILE.1
            self._shift_older()
        checkpoint = self.session.subscribe(self._queue)
        self._open(checkpoint)
        self._thread = threading.Thread(target=self._run, name="kvtrace-record", daemon=True)
        self._thread.start()
        log.info("recording to %s (rotated at %d MiB, %d kept)", self.path, self.max_bytes >> 20, self.keep)

    def _open(self, checkpoint: SessionCheckpoint) -> None:
        header = recording_header(self.session.started_wall_seconds, self._leak_min_age_seconds,
                                  checkpoint.timestamp_ns)
        self._writer = RecordingWriter.create(self.path, header)
        self._encoder.restart()
        for frame in self._encoder.checkpoint(checkpoint):
            self._writer.write(frame)
        self._writer.flush()

    def _run(self) -> None:
        next_flush = time.monotonic() + FLUSH_SECONDS
        rotating = False
        try:
            while True:
                records = self._queue.take(4096, FLUSH_SECONDS)
                if not records and self._stop.is_set():
                    assert self._writer is not None
                    for frame in self._encoder.depth_changes():  # decided after the last event
                        self._writer.write(frame)
                    break  # stopped, and what was queued before is written
                for record in records:
                    if rotating and type(record) is SessionCheckpoint:
                        rotating = False
                        self._rotate(record)
                        continue
                    assert self._writer is not None
                    for frame in self._encoder.record(record):
                        self._writer.write(frame)
                if time.monotonic() >= next_flush:
                    assert self._writer is not None
                    for frame in self._encoder.depth_changes():  # a quiet process's depth changes too
                        self._writer.write(frame)
                    self._writer.flush()
                    next_flush = time.monotonic() + FLUSH_SECONDS
                    if not rotating and self._writer.size_bytes >= self.max_bytes:
                        rotating = True
                        self._queue.request_checkpoint()
        except Exception as error:  # the file stays readable up to here; the component says why it stopped
            reason = error.strerror if isinstance(error, OSError) else repr(error)
            self.error = f"recording to {self.path} stopped: {reason}"
            log.error("%s", self.error, exc_info=not isinstance(error, OSError))
            self.session.report_component("recording", False, self.error)
            self.session.remove_sink(self._queue)
        finally:
            if self._writer is not None:
                self._writer.close()

    def _rotate(self, checkpoint: SessionCheckpoint) -> None:
        assert self._writer is not None
        self._writer.close()
        self._shift_older()
        self.rotations_total += 1
        self._open(checkpoint)

    def _shift_older(self) -> None:
        """FILE -> FILE.1 -> ... -> FILE.<keep>; the oldest beyond goes (with keep 0, FILE itself)."""
        for index in range(self.keep - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{index}")
            if older.exists():
                os.replace(older, self.path.with_name(f"{self.path.name}.{index + 1}"))
        if self.keep > 0:
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))

    def stop(self) -> None:
        self.session.remove_sink(self._queue)
        self._queue.close()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)


def encode_stream(queue: RecordQueue, encoder: FrameEncoder, checkpoint: SessionCheckpoint,
                  max_frames: int, active: Callable[[], bool],
                  wait_seconds: float = 0.5) -> Iterator[list[service_pb2.RecordingFrame]]:
    """The frames of a recording streamed to a client (StreamRecording), in batches: the checkpoint
    first, then what the queue gets, until `active()` is false or the queue closes."""
    batch: list[service_pb2.RecordingFrame] = []
    for frame in encoder.checkpoint(checkpoint):
        batch.append(frame)
        if len(batch) >= max_frames:
            yield batch
            batch = []
    if batch:
        yield batch
    while active() and not queue.closed:
        # Also empty, when nothing came: the client learns the stream is alive (and flushes its file). A depth
        # decided after a process's last event goes too (a quiet process's raise or lowering).
        records = queue.take(max_frames, wait_seconds)
        yield [*(frame for record in records for frame in encoder.record(record)),
               *(() if records else encoder.depth_changes())]
