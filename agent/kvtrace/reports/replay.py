"""Reading a recording: one decoder from frames to model records, and the replay that feeds them to
the agent's own Session and Analyzer.

    recording ──decode_records──▶ Event, EventsLost, NvmlSample, RecordedCheckpoint, StackDefinition,
                                  ProcessInfo, NativeCallerName (in the file's order)
                   └──▶ replay(): Session.ingest (ledger, stacks, processes, native callers' names) ──▶ Analyzer
                   └──▶ read_records(): the same records for an export (reports/perfetto.py)

`replay()` rebuilds the state at a time (`at_ns`; by default the end, which for a flight recorder's
dump is the ledger at its trigger): the first checkpoint, then every record up to that time in order,
with analysis once per second of recorded time, on the recording's clock, as the live agent runs it
on its own. kvtrace.cli.recorded serves the result through the agent's own kvtrace.v1 service.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kvtrace._proto.kvtrace.v1 import agent_service_pb2 as service_pb2
from kvtrace.analysis.analyzer import AnalysisOptions, Analyzer
from kvtrace.model.depth import ProcessDepth
from kvtrace.model.events import Event, EventsLost
from kvtrace.model.gpus import NvmlSample
from kvtrace.model.ledger import Outstanding
from kvtrace.model.processes import ProcessInfo, ProcessTable
from kvtrace.model.stacks import NativeFrame, Stack
from kvtrace.reports.recording import AtTime, RecordedCheckpoint, RecordingReader
from kvtrace.session import Session
from kvtrace.wire import (
    depth_from_proto,
    event_from_proto,
    nvml_from_proto,
    outstanding_from_proto,
    recorded_process_from_proto,
    stack_from_proto,
)

NS_PER_SECOND = 1_000_000_000
ANALYSIS_INTERVAL_NS = NS_PER_SECOND  # as the agent's default --interval
PROGRESS_EVERY_FRAMES = 200_000


@dataclass(frozen=True)
class NativeCallerName:
    """What the live agent named a native caller address of a process (recorded: the process and
    its libraries may be gone when the file is read)."""

    pid: int
    address: int
    frame: NativeFrame


class RecordedNativeNames:
    """The Session's NativeNames in a replay: the names the recording holds. A process's names are
    kept after it exits (its events, read later, still name them); a later name for the same pid and
    address (the pid reused) replaces the earlier."""

    def __init__(self) -> None:
        self.names: dict[tuple[int, int], NativeFrame] = {}

    def symbolize(self, pid: int, address: int) -> NativeFrame:
        return self.names.get((pid, address)) or NativeFrame("", "", address)

    def forget(self, pid: int) -> None:
        pass


@dataclass(frozen=True)
class StackDefinition:
    """A stack the records after it refer to by id (the agent's id, kept)."""

    stack_id: int
    stack: Stack


Recorded = (Event | EventsLost | NvmlSample | RecordedCheckpoint | StackDefinition | ProcessInfo | ProcessDepth
            | NativeCallerName)
TimedRecord = Event | EventsLost | NvmlSample | RecordedCheckpoint


def decode_records(reader: RecordingReader,
                   on_progress: Callable[[int, int], None] | None = None) -> Iterator[Recorded]:
    """The file's records as the model's, in order. A checkpoint spread over several frames comes as
    one RecordedCheckpoint; its processes (titles) come before it as ProcessInfo. A process written
    with its depth is followed by that ProcessDepth (from there on, until the next). Records a newer
    kvtrace wrote in a way this one cannot represent are skipped."""
    entries: list[Outstanding] = []
    titled: set[int] = set()
    for number, frame in enumerate(reader.frames(), start=1):
        if on_progress is not None and number % PROGRESS_EVERY_FRAMES == 0:
            on_progress(number, reader.position)
        record = frame.WhichOneof("record")
        if record == "event":
            message = frame.event
            payload = message.WhichOneof("payload")
            if payload == "stack_definition":
                stack_id, stack = stack_from_proto(message.stack_definition)
                if stack_id:
                    yield StackDefinition(stack_id, stack)
            elif payload == "events_lost":
                lost = message.events_lost
                yield EventsLost(lost.dropped_count + lost.kernel_lost_count, message.timestamp_ns)
            else:
                event = event_from_proto(message)
                if event is not None:
                    yield event
        elif record == "checkpoint":
            for allocation in frame.checkpoint.allocations:
                try:
                    entries.append(outstanding_from_proto(allocation))
                except ValueError:  # a newer agent's kind of object: it cannot be replayed
                    continue
                if allocation.title and allocation.pid not in titled:
                    titled.add(allocation.pid)
                    yield ProcessInfo(allocation.pid, allocation.title, allocation.comm, allocation.container,
                                      "", 0.0, 0.0)
            if frame.checkpoint.last:
                yield RecordedCheckpoint(frame.checkpoint.timestamp_ns, tuple(entries))
                entries, titled = [], set()
        elif record == "nvml":
            yield nvml_from_proto(frame.nvml)
        elif record == "native_caller":
            named = frame.native_caller
            yield NativeCallerName(named.pid, named.address,
                                   NativeFrame(named.frame.module, named.frame.symbol, named.frame.offset))
        elif record == "process":
            yield recorded_process_from_proto(frame.process)
            if frame.process.HasField("depth"):
                depth = depth_from_proto(frame.process.depth)
                if depth is not None:
                    yield depth


class RecordedClock:
    """The recording's time: where the replay has got to (wall clock of the recorded host)."""

    def __init__(self, start_ns: int) -> None:
        self.now_ns = start_ns

    def __call__(self) -> int:
        return self.now_ns


@dataclass
class Replay:
    """A recording replayed up to `at_ns`."""

    path: Path
    header: service_pb2.RecordingHeader
    session: Session
    analyzer: Analyzer
    at_ns: int  # the recorded time the state stands at
    first_ns: int  # the recording's first and last timed records
    last_ns: int
    events_replayed: int
    damage: str | None  # the file is cut or damaged there: read up to it
    unknown_frames: int  # records of a newer kvtrace, skipped
    stopped_at_time: bool  # records after at_ns were left out
    notes: list[str] = field(default_factory=list)  # what the reader should know (a time outside the file)


def resolve_at(at: AtTime | None, header: service_pb2.RecordingHeader) -> int | None:
    """The time `--at` asks for; None: the end."""
    if at is None or at.end:
        return None
    if at.after_start_ns is not None:
        return header.start_time_ns + at.after_start_ns
    return at.wall_ns


def replay(path: Path, at_ns: int | None = None,
           on_progress: Callable[[int, int], None] | None = None) -> Replay:
    """The state of the recording at `path` at `at_ns` (None: its end; a time outside the recording
    is brought inside it, with a note). Raises RecordingError for a file that is not a readable
    recording."""
    with RecordingReader.open(path) as reader:
        header = reader.header
        clock = RecordedClock(header.start_time_ns)
        native_names = RecordedNativeNames()
        session = Session(ProcessTable(), native_names)
        session.wall_clock_ns = clock
        session.monotonic_clock_ns = clock  # the recorded wall clock: series never see a step there
        session.started_wall_seconds = header.agent_start_time_ns / NS_PER_SECOND
        analyzer = Analyzer(session, AnalysisOptions(leak_min_age_seconds=header.leak_min_age_seconds or 60.0))
        feeder = _Feeder(session, analyzer, clock, native_names)
        stopped = False
        for record in decode_records(reader, on_progress):
            if type(record) is ProcessDepth and at_ns is not None and record.since_ns > at_ns:
                continue  # written at the first event after the change: not yet at the time asked
            timestamp_ns = record.timestamp_ns if isinstance(record, TimedRecord) else 0
            # The file's first checkpoint is where it starts: it applies whatever the time asked.
            if at_ns is not None and timestamp_ns > at_ns and feeder.started:
                feeder.last_ns = max(feeder.last_ns, timestamp_ns)
                stopped = True
                break
            feeder.feed(record, timestamp_ns)
        notes = []
        if at_ns is not None and not stopped and at_ns > feeder.last_ns:
            notes.append(f"{wall_time(at_ns)} is after the recording ends ({wall_time(feeder.last_ns)}): "
                         "read at its end")
        elif at_ns is not None and feeder.first_ns and at_ns < feeder.first_ns:
            notes.append(f"{wall_time(at_ns)} is before the recording starts ({wall_time(feeder.first_ns)}): "
                         "read at its start")
        elif at_ns is not None:
            clock.now_ns = max(clock.now_ns, at_ns)
        # What the agent's own counters said of loss is not recorded; the loss markers are.
        session.report_counters({"events_lost": session.lost_total})
        feeder.finish()
        return Replay(path, header, session, analyzer, clock.now_ns, feeder.first_ns or header.start_time_ns,
                      max(feeder.last_ns, clock.now_ns), session.events_total, reader.damage,
                      reader.unknown_frames, stopped, notes)


class _Feeder:
    """Applies records to the Session in order, analysing once per recorded second."""

    def __init__(self, session: Session, analyzer: Analyzer, clock: RecordedClock,
                 native_names: RecordedNativeNames) -> None:
        self.session = session
        self.native_names = native_names
        self.analyzer = analyzer
        self.clock = clock
        self.first_ns = 0
        self.last_ns = clock.now_ns
        self._next_analysis_ns = 0
        self.started = False  # the file's first checkpoint (or, without one, its first event) is in
        self._depths: dict[int, ProcessDepth] = {}  # as the recording says, up to where it is read

    def feed(self, record: Recorded, timestamp_ns: int) -> None:
        if timestamp_ns:
            self._advance(timestamp_ns)
        session = self.session
        if type(record) is RecordedCheckpoint:
            session.resync(record.entries, counted=False)  # not a resync of this Session's
            self.started = True
        elif type(record) is StackDefinition:
            session.define_stack(record.stack_id, record.stack)
        elif type(record) is NativeCallerName:
            self.native_names.names[(record.pid, record.address)] = record.frame
        elif type(record) is ProcessInfo:
            session.remember_process(record)
        elif type(record) is ProcessDepth:
            self._depths[record.pid] = record
            session.set_process_depths(self._depths)
        elif type(record) is Event or type(record) is EventsLost or type(record) is NvmlSample:
            self.started = True  # a recording without a checkpoint starts from nothing
            session.ingest(record)

    def _advance(self, timestamp_ns: int) -> None:
        """Analysis runs at each recorded second boundary passed, as the agent's loop runs it."""
        self.first_ns = self.first_ns or timestamp_ns
        if timestamp_ns > self.clock.now_ns:
            self.clock.now_ns = timestamp_ns
        self.last_ns = max(self.last_ns, timestamp_ns)
        if self._next_analysis_ns == 0:
            self._next_analysis_ns = timestamp_ns + ANALYSIS_INTERVAL_NS
        elif timestamp_ns >= self._next_analysis_ns:
            self._analyse()
            self._next_analysis_ns = timestamp_ns + ANALYSIS_INTERVAL_NS

    def _analyse(self) -> None:
        analyzer = self.analyzer
        sample = self.session.nvml_sample()
        nvml_pids = {process.pid for process in sample.processes} if sample else set()
        analyzer.update(self.session.ledger_view(analyzer.site_sample_due(self.clock.now_ns), nvml_pids))

    def finish(self) -> None:
        """The state at the replay's time: analysed once more, with a site sample (leak suspects)."""
        self.analyzer.sample_sites_now()
        self._analyse()


@dataclass
class RecordedStream:
    """A recording as records for an export: the ledger at its start, then what follows it (events,
    NVML rounds, losses, later checkpoints) in order. `stacks` and `titles` fill in as the records are
    read (a stack is defined before the first event that uses it)."""

    header: service_pb2.RecordingHeader
    checkpoint: tuple[Outstanding, ...]
    stacks: dict[int, Stack]
    titles: dict[int, str]
    records: Iterator[TimedRecord]


def read_records(reader: RecordingReader) -> RecordedStream:
    """The stream of an open recording (the caller closes the reader when done with the records)."""
    decoded = decode_records(reader)
    stream = RecordedStream(reader.header, (), {}, {}, iter(()))
    first: list[TimedRecord] = []
    for record in decoded:
        if _define(record, stream):
            continue
        if type(record) is RecordedCheckpoint:
            stream.checkpoint = record.entries
        else:  # a recording without a checkpoint starts from nothing
            first.append(record)  # type: ignore[arg-type]
        break
    stream.records = _timed(first, decoded, stream)
    return stream


def _define(record: Recorded, stream: RecordedStream) -> bool:
    if type(record) is StackDefinition:
        stream.stacks[record.stack_id] = record.stack
    elif type(record) is ProcessInfo:
        stream.titles[record.pid] = record.title or record.comm
    elif type(record) is ProcessDepth or type(record) is NativeCallerName:
        pass  # an export draws memory, not how closely it was traced nor which native code called
    else:
        return False
    return True


def _timed(first: list[TimedRecord], decoded: Iterator[Recorded], stream: RecordedStream) -> Iterator[TimedRecord]:
    yield from first
    for record in decoded:
        if not _define(record, stream):
            if type(record) is Event:
                stream.titles.setdefault(record.pid, record.title or record.comm)
            yield record  # type: ignore[misc]


def wall_time(timestamp_ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp_ns / NS_PER_SECOND)) + \
        f".{timestamp_ns % NS_PER_SECOND // 1_000_000:03d}"
