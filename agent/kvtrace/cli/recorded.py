"""`--input FILE [--at TIME]`: the commands that read the agent read a recording the same way.

`connect(args)` is the client a command talks to: the running agent, or with --input a replay of
the file (kvtrace.reports.replay) served by the agent's own kvtrace.v1 service on a private socket, so
that snapshot, ps, leaks, top and flamegraph run exactly the code they run live. Events (`tail`) are
read from the file directly, through the server's own filter, without a replay.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from kvtrace._proto.kvtrace.v1 import agent_service_pb2 as service_pb2
from kvtrace._proto.kvtrace.v1 import agent_service_pb2_grpc as service_grpc
from kvtrace._proto.kvtrace.v1 import events_pb2
from kvtrace.client import AgentClient
from kvtrace.errors import CommandError, ExitCode
from kvtrace.human import printable
from kvtrace.model.events import Event, EventsLost, Kind, Layer
from kvtrace.reports.recording import RecordingError, RecordingReader
from kvtrace.reports.replay import Replay, StackDefinition, decode_records, replay, resolve_at, wall_time
from kvtrace.servers.api.requests import InvalidArgument, ServerLimits, stream_filter
from kvtrace.servers.api.servicer import AgentServicer
from kvtrace.servers.hub import EventHub, Subscription
from kvtrace.wire import event_to_proto, lost_to_proto, stack_to_proto, wire_numbers


def connect(args: argparse.Namespace, events_only: bool = False) -> AgentClient:
    """The running agent (AgentClient.from_args), or the recording --input names: replayed at once,
    unless the command reads `events_only` (tail), which come from the file itself."""
    if getattr(args, "input", None) is None:
        if getattr(args, "at", None) is not None:
            raise CommandError("--at reads a recording at a time: give the recording with --input FILE",
                               ExitCode.USAGE)
        return AgentClient.from_args(args)
    try:
        with RecordingReader.open(args.input) as reader:
            header = reader.header
    except RecordingError as error:
        raise CommandError(str(error), ExitCode.USAGE) from None
    # gRPC's C core logs to stderr on its own (at INFO, by default, in grpcio 1.85): about a private
    # server and client that are one process, it has nothing an operator can act on. Read at its
    # first channel or server, so set here; GRPC_VERBOSITY=INFO in the environment still shows it.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    return RecordingClient(args.input, resolve_at(getattr(args, "at", None), header), not events_only)


class ReplayServer:
    """The kvtrace.v1 service over a replayed recording, on a private Unix socket (in a directory of
    this user's, 0700), for the CLI's own client to talk to."""

    def __init__(self, state: Replay) -> None:
        self._directory = Path(tempfile.mkdtemp(prefix="kvtrace-replay-"))
        self.socket = self._directory / "replay.sock"
        servicer = AgentServicer(state.session, state.analyzer, EventHub(), ServerLimits())
        self._server = grpc.server(ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvtrace-replay"))
        service_grpc.add_AgentServiceServicer_to_server(servicer, self._server)
        self._server.add_insecure_port(f"unix:{self.socket}")
        self._server.start()

    def stop(self) -> None:
        # With a grace, not 0: stop(0) cancels with a GOAWAY that the client's connection, not yet
        # torn down by its channel's close, logs to stderr ("Got goaway [2] ... Cancelling all calls").
        # No call is in flight by now, so the grace costs no time.
        self._server.stop(1).wait()
        shutil.rmtree(self._directory, ignore_errors=True)


class RecordingClient(AgentClient):
    """AgentClient's calls answered from a recording: with `replay_now`, the file is replayed and
    served on a private socket; `stream_batches` reads the events from the file either way."""

    def __init__(self, path: Path, at_ns: int | None, replay_now: bool = True) -> None:
        self.path = path
        self.at_ns = at_ns
        self.replay: Replay | None = None
        self._server: ReplayServer | None = None
        if replay_now:
            state = self.replay = self._replay()
            self._server = ReplayServer(state)
            super().__init__(f"unix://{self._server.socket}")
        else:
            # Never connected (a channel connects at its first call): events come from the file. As
            # "unix:" and absolute: "unix://rel.kvtrace" is a URI with an authority, which gRPC refuses
            # on stderr at once.
            super().__init__(f"unix:{Path(path).absolute()}")

    def _replay(self) -> Replay:
        progress = _progress(self.path)
        try:
            state = replay(self.path, self.at_ns, on_progress=progress)
        except RecordingError as error:
            raise CommandError(str(error), ExitCode.USAGE) from None
        finally:
            if progress is not None:
                print("\r\033[K", end="", file=sys.stderr, flush=True)  # the progress line goes
        print(f"kvtrace: {describe(state)}", file=sys.stderr, flush=True)
        for note in state.notes:
            print(f"kvtrace: note: {note}", file=sys.stderr, flush=True)
        if state.damage:
            print(f"kvtrace: warning: {state.damage}", file=sys.stderr, flush=True)
        return state

    def _check_socket(self) -> None:
        if self._server is None:
            raise CommandError("this command reads events only from a recording", ExitCode.USAGE)

    def close(self) -> None:
        super().close()
        if self._server is not None:
            self._server.stop()

    def now_ns(self) -> int:
        assert self.replay is not None, "replay_now was not asked for"
        return self.replay.at_ns

    def stream_batches(self, pids: Iterable[int] = (), title_regex: str = "", kinds: Iterable[Kind] = (),
                       layers: Iterable[Layer] = (), min_size_bytes: int = 0) -> Iterator[list[events_pb2.Event]]:
        request = service_pb2.StreamEventsRequest(
            pids=list(pids), title_regex=title_regex, kinds=wire_numbers(kinds), layers=wire_numbers(layers),
            min_size_bytes=min_size_bytes)
        try:
            subscription = Subscription(stream_filter(request), 1)
        except InvalidArgument as error:
            raise CommandError(str(error), ExitCode.USAGE) from None
        return recorded_events(self.path, self.at_ns, subscription.wants)


def recorded_events(path: Path, at_ns: int | None, wants: Callable[[Event], bool],
                    batch_size: int = 512) -> Iterator[list[events_pb2.Event]]:
    """The recording's events as StreamEvents sends them (a stack defined before its first use, loss
    reports in place), up to `at_ns`, those `wants` accepts, in batches."""
    with RecordingReader.open(path) as reader:
        batch: list[events_pb2.Event] = []
        stacks: dict[int, StackDefinition] = {}
        sent: set[int] = set()
        for record in decode_records(reader):
            if type(record) is StackDefinition:
                stacks[record.stack_id] = record
            elif type(record) is EventsLost:
                batch.append(lost_to_proto(0, record.count))
            elif type(record) is Event:
                if at_ns is not None and record.timestamp_ns > at_ns:
                    break
                if not wants(record):
                    continue
                definition = stacks.get(record.stack_id)
                if definition is not None and record.stack_id not in sent:
                    sent.add(record.stack_id)
                    batch.append(stack_to_proto(definition.stack_id, definition.stack))
                batch.append(event_to_proto(record))
            if len(batch) >= batch_size:
                yield batch
                batch = []
        if batch:
            yield batch
        if reader.damage:
            print(f"kvtrace: warning: {reader.damage}", file=sys.stderr, flush=True)


def describe(state: Replay) -> str:
    """One line on what is read: the file, its host and agent, its span, and the time it is read at."""
    header = state.header
    what = (f"reading {state.path}: recorded on {printable(header.host) or '?'} by kvtrace "
            f"{printable(header.agent_version) or '?'}")
    if header.filter_description:
        what += f" ({printable(header.filter_description)})"
    what += f", {wall_time(state.first_ns)} to {wall_time(state.last_ns)}; {state.events_replayed} events"
    if header.trigger.kind:
        what += f"; a flight recorder dump: {printable(header.trigger.reason)}"
    return what + f"; state at {wall_time(state.at_ns)}"


def _progress(path: Path) -> Callable[[int, int], None] | None:
    """Progress on stderr for a long replay (a terminal only), on one line that is then cleared."""
    if not sys.stderr.isatty():
        return None
    total = max(1, path.stat().st_size)

    def show(frames: int, position: int) -> None:
        print(f"\rkvtrace: replaying {path}: {position * 100 // total}% ({frames} records)\033[K",
              end="", file=sys.stderr, flush=True)
    return show
