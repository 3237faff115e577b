"""Replaying a recording: the agent's own Session and Analyzer, fed from a file instead of probes.

    recording ──frames──▶ Session.ingest (ledger, stacks, processes) ──▶ Analyzer ──▶ AgentServicer
                                                                                      (private socket)

`replay()` rebuilds the state at a time (`at_ns`; the end, or a dump's trigger, by default): the
checkpoint's ledger, then every record up to that time in order, with analysis run once per second
of recorded time on the recording's clock, as the live agent runs it on its own. `ReplayServer`
serves the result through the same kvtrace.v1 service the agent serves, so `kvtrace leaks|snapshot|
ps|top --input FILE` are the live commands talking to a file.
"""
from __future__ import annotations

import argparse
import itertools
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc

from kvtrace._proto.kvtrace.v1 import agent_service_pb2 as service_pb2
from kvtrace._proto.kvtrace.v1 import agent_service_pb2_grpc as service_grpc
from kvtrace._proto.kvtrace.v1 import events_pb2
from kvtrace.analysis.analyzer import AnalysisOptions, Analyzer
from kvtrace.client import AgentClient
from kvtrace.errors import CommandError, ExitCode
from kvtrace.model.events import Event, EventsLost, Kind, Layer
from kvtrace.model.gpus import NvmlSample
from kvtrace.model.ledger import Outstanding
from kvtrace.model.processes import ProcessInfo, ProcessTable
from kvtrace.model.stacks import Stack
from kvtrace.reports.recording import AtTime, RecordingError, RecordingReader
from kvtrace.session import Session
from kvtrace.wire import (
    event_from_proto,
    nvml_from_proto,
    outstanding_from_proto,
    recorded_process_from_proto,
    stack_from_proto,
    wire_numbers,
)

NS_PER_SECOND = 1_000_000_000
ANALYSIS_INTERVAL_NS = NS_PER_SECOND  # as the agent's default --interval
PROGRESS_EVERY_FRAMES = 200_000


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
    end_ns: int  # the last record's time read (the end, or the first record after at_ns)
    events_replayed: int
    damage: str | None  # the file is cut or damaged there: read up to it
    unknown_frames: int  # records of a newer kvtrace, skipped
    stopped_at_time: bool  # records after at_ns were left out


def default_at_ns(header: service_pb2.RecordingHeader) -> int | None:
    """Where a report reads a recording when not told: a flight recorder's dump at its trigger,
    anything else at its end (None)."""
    return header.trigger.timestamp_ns if header.trigger.kind else None


def replay(path: Path, at_ns: int | None = None, use_default_at: bool = True,
           on_progress: Callable[[int, int], None] | None = None) -> Replay:
    """The state of the recording at `path` at `at_ns` (None: its default, see `default_at_ns`).
    Raises RecordingError for a file that is not a readable recording."""
    with RecordingReader.open(path) as reader:
        header = reader.header
        if at_ns is None and use_default_at:
            at_ns = default_at_ns(header)
        clock = RecordedClock(header.start_time_ns)
        session = Session(ProcessTable())
        session.wall_clock_ns = clock
        session.monotonic_clock_ns = clock  # the recorded wall clock: series never see a step there
        session.started_wall_seconds = header.agent_start_time_ns / NS_PER_SECOND
        options = AnalysisOptions(leak_min_age_seconds=header.leak_min_age_seconds or 60.0)
        analyzer = Analyzer(session, options)
        feeder = _Feeder(session, analyzer, clock)
        stopped = False
        frames_read = 0
        for frame in reader.frames():
            frames_read += 1
            if on_progress is not None and frames_read % PROGRESS_EVERY_FRAMES == 0:
                on_progress(frames_read, reader.position)
            timestamp_ns = _timestamp(frame)
            # The first checkpoint is where the file starts: what it holds applies whatever the time asked.
            if at_ns is not None and timestamp_ns > at_ns and feeder.started:
                feeder.end_ns = timestamp_ns
                stopped = True
                break
            feeder.feed(frame, timestamp_ns)
        if at_ns is not None:
            clock.now_ns = max(clock.now_ns, at_ns)
        # What the agent's own counters said of loss is not recorded; the loss markers are.
        session.report_counters({"events_lost": session.lost_total})
        feeder.finish()
        return Replay(path, header, session, analyzer, clock.now_ns, max(feeder.end_ns, clock.now_ns),
                      session.events_total, reader.damage, reader.unknown_frames, stopped)


def _timestamp(frame: service_pb2.RecordingFrame) -> int:
    """The recorded time of a frame; 0 for those outside time (stacks, processes)."""
    record = frame.WhichOneof("record")
    if record == "event":
        return 0 if frame.event.HasField("stack_definition") else frame.event.timestamp_ns
    if record == "checkpoint":
        return frame.checkpoint.timestamp_ns
    if record == "nvml":
        return frame.nvml.timestamp_ns
    return 0


class _Feeder:
    """Applies frames to the Session in order, analysing once per recorded second."""

    def __init__(self, session: Session, analyzer: Analyzer, clock: RecordedClock) -> None:
        self.session = session
        self.analyzer = analyzer
        self.clock = clock
        self.end_ns = clock.now_ns
        self._checkpoint: list[Outstanding] = []
        self._next_analysis_ns = 0
        self.started = False  # the file's first checkpoint is applied

    def feed(self, frame: service_pb2.RecordingFrame, timestamp_ns: int) -> None:
        record = frame.WhichOneof("record")
        if record == "event" and not self.started:
            self.started = True  # a recording without a checkpoint starts from nothing
        if timestamp_ns:
            self._advance(timestamp_ns)
        if record == "event":
            self._event(frame.event)
        elif record == "checkpoint":
            for message in frame.checkpoint.allocations:
                try:
                    self._checkpoint.append(outstanding_from_proto(message))
                except ValueError:  # a newer agent's enum value: that object cannot be replayed
                    continue
                if message.title and self.session.processes.cached(message.pid) is None:
                    self.session.processes.remember(ProcessInfo(message.pid, message.title, message.comm,
                                                                message.container, "", 0.0, 0.0))
            if frame.checkpoint.last:
                self.session.resync(self._checkpoint, counted=False)
                self._checkpoint = []
                self.started = True
        elif record == "nvml":
            self.session.ingest(nvml_from_proto(frame.nvml))
        elif record == "process":
            self.session.processes.remember(recorded_process_from_proto(frame.process))

    def _event(self, message: events_pb2.Event) -> None:
        payload = message.WhichOneof("payload")
        if payload == "stack_definition":
            stack_id, stack = stack_from_proto(message.stack_definition)
            if stack_id:
                with self.session.lock:
                    self.session.stacks.define(stack_id, stack)
        elif payload == "events_lost":
            lost = message.events_lost
            self.session.ingest(EventsLost(lost.dropped_count + lost.kernel_lost_count, message.timestamp_ns))
        else:
            event = event_from_proto(message)
            if event is not None:
                self.session.ingest(event)

    def _advance(self, timestamp_ns: int) -> None:
        """Analysis runs at each recorded second boundary passed, as the agent's loop runs it."""
        if timestamp_ns > self.clock.now_ns:
            self.clock.now_ns = timestamp_ns
        self.end_ns = max(self.end_ns, timestamp_ns)
        if self._next_analysis_ns == 0:
            self._next_analysis_ns = timestamp_ns + ANALYSIS_INTERVAL_NS
        elif timestamp_ns >= self._next_analysis_ns:
            self._analyse()
            self._next_analysis_ns = timestamp_ns + ANALYSIS_INTERVAL_NS

    def _analyse(self) -> None:
        analyzer = self.analyzer
        sample = self.session.nvml_sample()
        nvml_pids = {process.pid for process in sample.processes} if sample else set()
        sites_due = analyzer.site_sample_due(self.clock.now_ns)
        analyzer.update(self.session.ledger_view(sites_due, nvml_pids))

    def finish(self) -> None:
        """The state at the replay's time: analysed once more, with a site sample (leak suspects)."""
        self.analyzer.sample_sites_now()
        self._analyse()


class ReplayServer:
    """The kvtrace.v1 service over a replayed recording, on a private Unix socket (a directory of
    this user's, 0700), for the CLI's own client to talk to."""

    def __init__(self, state: Replay) -> None:
        from kvtrace.servers.api import AgentServicer, ServerLimits
        from kvtrace.servers.hub import EventHub

        self.replay = state
        self._directory = Path(tempfile.mkdtemp(prefix="kvtrace-replay-"))
        self.socket = self._directory / "replay.sock"
        servicer = AgentServicer(state.session, state.analyzer, EventHub(), ServerLimits())
        self._server = grpc.server(ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvtrace-replay"))
        service_grpc.add_AgentServiceServicer_to_server(servicer, self._server)
        self._server.add_insecure_port(f"unix:{self.socket}")
        self._server.start()

    @property
    def target(self) -> str:
        return f"unix://{self.socket}"

    def stop(self) -> None:
        self._server.stop(0).wait()
        shutil.rmtree(self._directory, ignore_errors=True)


def recorded_events(path: Path, at_ns: int | None, wants: Callable[[Event], bool],
                    batch_size: int = 512) -> Iterator[list[events_pb2.Event]]:
    """The recording's events as StreamEvents sends them (stacks defined before their first use,
    loss reports in place), up to `at_ns`, those `wants` accepts, in batches."""
    with RecordingReader.open(path) as reader:
        batch: list[events_pb2.Event] = []
        stacks: dict[int, events_pb2.Event] = {}
        sent: set[int] = set()
        for frame in reader.frames():
            if frame.WhichOneof("record") != "event":
                continue
            message = frame.event
            if message.HasField("stack_definition"):
                stacks[message.stack_definition.stack_id] = message
                continue
            if at_ns is not None and message.timestamp_ns > at_ns:
                break
            if not message.HasField("events_lost"):
                event = event_from_proto(message)
                if event is None or not wants(event):
                    continue
                stack_id = message.allocation.stack_id if message.HasField("allocation") else 0
                if stack_id and stack_id not in sent and stack_id in stacks:
                    sent.add(stack_id)
                    batch.append(stacks[stack_id])
            batch.append(message)
            if len(batch) >= batch_size:
                yield batch
                batch = []
        if batch:
            yield batch
        if reader.damage:
            raise RecordingDamaged(reader.damage)


class RecordingDamaged(Exception):
    """Raised after the last event read from a damaged recording (the message says where)."""


def wall_time(timestamp_ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp_ns / NS_PER_SECOND)) + \
        f".{timestamp_ns % NS_PER_SECOND // 1_000_000:03d}"



def resolve_at(at: AtTime | None, header: service_pb2.RecordingHeader) -> tuple[int | None, bool]:
    """(at_ns, use the file's default) for `--at`."""
    if at is None:
        return None, True
    if at.end:
        return None, False
    if at.after_start_ns is not None:
        return header.start_time_ns + at.after_start_ns, False
    return at.wall_ns, False


class RecordingClient(AgentClient):
    """AgentClient's calls answered from a recording: the replay served by the agent's own service
    on a private socket; events streamed from the file through the server's own filter."""

    def __init__(self, state: Replay, at_ns: int | None) -> None:
        self.replay = state
        self._server = ReplayServer(state)
        self._events_at_ns = at_ns  # tail: up to the time asked for, else every event
        super().__init__(self._server.target)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RecordingClient:
        path: Path = args.input
        try:
            with RecordingReader.open(path) as reader:
                header = reader.header
            at_ns, use_default = resolve_at(getattr(args, "at", None), header)
            state = replay(path, at_ns, use_default, on_progress=_progress(path))
        except RecordingError as error:
            raise CommandError(str(error), ExitCode.USAGE) from None
        print(f"kvtrace: {describe(state)}", file=sys.stderr, flush=True)
        if state.damage:
            print(f"kvtrace: warning: {state.damage}", file=sys.stderr, flush=True)
        return cls(state, state.at_ns if at_ns is not None or not use_default or state.header.trigger.kind else None)

    def close(self) -> None:
        super().close()
        self._server.stop()

    def now_ns(self) -> int:
        return self.replay.at_ns

    def stream_batches(self, pids: Iterable[int] = (), title_regex: str = "", kinds: Iterable[Kind] = (),
                       layers: Iterable[Layer] = (), min_size_bytes: int = 0) -> Iterator[list[events_pb2.Event]]:
        from kvtrace.servers.api import InvalidArgument, stream_filter
        from kvtrace.servers.hub import Subscription

        request = service_pb2.StreamEventsRequest(
            pids=list(pids), title_regex=title_regex, kinds=wire_numbers(kinds), layers=wire_numbers(layers),
            min_size_bytes=min_size_bytes)
        try:
            subscription = Subscription(stream_filter(request), 1)
        except InvalidArgument as error:
            raise CommandError(str(error), ExitCode.USAGE) from None
        return self._recorded(recorded_events(self.replay.path, self._events_at_ns, subscription.wants))

    @staticmethod
    def _recorded(batches: Iterator[list[events_pb2.Event]]) -> Iterator[list[events_pb2.Event]]:
        try:
            yield from batches
        except RecordingDamaged as damage:
            print(f"kvtrace: warning: {damage}", file=sys.stderr, flush=True)


def describe(state: Replay) -> str:
    """One line on what is read: the file, its host and agent, its span, and the time it is read at."""
    header = state.header
    what = f"reading {state.path}: recorded on {header.host or '?'} by kvtrace {header.agent_version or '?'}"
    if header.filter_description:
        what += f" ({header.filter_description})"
    what += f", {wall_time(header.start_time_ns)} to {wall_time(state.end_ns)}; {state.events_replayed} events"
    if header.trigger.kind:
        what += f"; a flight recorder dump: {header.trigger.reason}"
    return what + f"; state at {wall_time(state.at_ns)}"


def _progress(path: Path) -> Callable[[int, int], None] | None:
    """Progress on stderr for a long replay (a terminal only)."""
    if not sys.stderr.isatty():
        return None
    total = max(1, path.stat().st_size)

    def show(frames: int, position: int) -> None:
        print(f"\rkvtrace: replaying {path}: {position * 100 // total}% ({frames} records)",
              end="", file=sys.stderr, flush=True)
    return show


@dataclass
class RecordedStream:
    """A recording as model records, read as they are used: the ledger at its start, then its events,
    NVML rounds and losses in order. `stacks` and `titles` fill in as the records are read (a stack is
    defined before the first event that uses it)."""

    header: service_pb2.RecordingHeader
    checkpoint: list[Outstanding]
    stacks: dict[int, Stack]
    titles: dict[int, str]
    records: Iterator[Event | NvmlSample | EventsLost]
    later_checkpoints: int = 0  # the ledger replaced again (a resync, a dump's end): not in `records`


def read_records(reader: RecordingReader) -> RecordedStream:
    """The stream of an open recording (the caller closes the reader when done with the records)."""
    frames = reader.frames()
    checkpoint: list[Outstanding] = []
    stacks: dict[int, Stack] = {}
    titles: dict[int, str] = {}
    pending: list[service_pb2.RecordingFrame] = []
    for frame in frames:
        record = frame.WhichOneof("record")
        if record == "checkpoint":
            for message in frame.checkpoint.allocations:
                try:
                    checkpoint.append(outstanding_from_proto(message))
                except ValueError:
                    continue
                titles.setdefault(message.pid, message.title or message.comm)
            if frame.checkpoint.last:
                break
        elif record in ("process", "event") and not (record == "event" and _is_call(frame.event)):
            _define(frame, stacks, titles)
        else:  # a recording without a checkpoint: it starts from nothing
            pending.append(frame)
            break
    stream = RecordedStream(reader.header, checkpoint, stacks, titles, iter(()))
    stream.records = _records(itertools.chain(pending, frames), stream)
    return stream


def _is_call(message: events_pb2.Event) -> bool:
    return not message.HasField("stack_definition")


def _define(frame: service_pb2.RecordingFrame, stacks: dict[int, Stack], titles: dict[int, str]) -> None:
    if frame.HasField("process"):
        titles[frame.process.pid] = frame.process.title or frame.process.comm
    elif frame.event.HasField("stack_definition"):
        stack_id, stack = stack_from_proto(frame.event.stack_definition)
        stacks[stack_id] = stack


def _records(frames: Iterable[service_pb2.RecordingFrame],
             stream: RecordedStream) -> Iterator[Event | NvmlSample | EventsLost]:
    for frame in frames:
        record = frame.WhichOneof("record")
        if record == "nvml":
            yield nvml_from_proto(frame.nvml)
        elif record == "checkpoint":
            stream.later_checkpoints += frame.checkpoint.last
        elif record == "process" or frame.event.HasField("stack_definition"):
            _define(frame, stream.stacks, stream.titles)
        elif frame.event.HasField("events_lost"):
            lost = frame.event.events_lost
            yield EventsLost(lost.dropped_count + lost.kernel_lost_count, frame.event.timestamp_ns)
        else:
            event = event_from_proto(frame.event)
            if event is not None:
                stream.titles.setdefault(event.pid, event.title or event.comm)
                yield event
