"""Typed client of the kvtrace agent's kvtrace.v1 API; the CLI's commands use it too.

    with AgentClient() as agent:                    # unix:///run/kvtrace/kvtrace.sock
        for event in agent.stream_events(pids=[1234]):
            print(message_to_json(event))

Failures become `CommandError` with one line that says what to do (start the agent, join the
group), so a command needs no handling of its own. `for_socket`/`from_args` connect to the agent's
admin socket (full detail) when this user may, else to its group socket, whose answers are redacted
(VIEW_REDACTED: no stacks or addresses); `on_redacted` is then called once, to tell the user.
kvtrace.wire turns the messages back into the model and into the JSON objects the CLI prints.
"""
from __future__ import annotations

import argparse
import grp
import os
import stat
import sys
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc

from kvtrace._proto.kvtrace.v1 import agent_service_pb2 as service_pb2
from kvtrace._proto.kvtrace.v1 import agent_service_pb2_grpc as service_grpc
from kvtrace._proto.kvtrace.v1 import events_pb2
from kvtrace.config import DEFAULT_GROUP, DEFAULT_SOCKET, ApiConfig, ConfigError, config_from_args
from kvtrace.errors import CommandError, ExitCode
from kvtrace.model.depth import Depth, ProcessDepth
from kvtrace.model.events import Kind, Layer
from kvtrace.model.ledger import EntryColumns, Outstanding
from kvtrace.model.stacks import Stack
from kvtrace.wire import (
    columns_from_snapshot,
    depths_by_pid,
    outstanding_from_proto,
    stack_from_proto,
    wire_number,
    wire_numbers,
)

DEFAULT_TARGET = f"unix://{DEFAULT_SOCKET}"
# A snapshot page of 10000 entries with long process titles can pass gRPC's default 4 MiB.
MAX_RECEIVE_MESSAGE_BYTES = 64 << 20

_START_HINT = "start it with `sudo systemctl start kvtrace` or `sudo kvtrace agent`"
REDACTED_NOTICE = ("stacks, addresses and secrets in titles hidden: connect to the admin socket for full "
                   "detail (run as root, or ask for the agent's --admin-group)")


@dataclass(frozen=True)
class ClientTls:
    """Mutual TLS for a TCP target: this client's certificate and key, and the agent's CA."""

    cert: Path
    key: Path
    server_ca: Path
    server_name: str | None = None  # the name in the agent's certificate, if not the target host


@dataclass
class HeldMemory:
    """What a snapshot holds, as the model's: the objects, the stacks they refer to, pid -> title."""

    entries: list[Outstanding]
    stacks: dict[int, Stack]
    titles: dict[int, str]


# Objects per snapshot page the client asks for (the agent allows 10 000): a listing is one pass whatever its
# pages, and fewer pages are fewer round trips; each costs the agent about 2 MB while it is built.
SNAPSHOT_PAGE_SIZE = 5_000
# The largest page the agent allows (GetSnapshotRequest.page_size).
SNAPSHOT_PAGE_MAX = 10_000

class AgentClient:
    """A connection to one agent. Methods raise CommandError; use it as a context manager."""

    def __init__(self, target: str = DEFAULT_TARGET, tls: ClientTls | None = None,
                 timeout_seconds: float = 10.0) -> None:
        self.target = target
        self.timeout_seconds = timeout_seconds
        self.on_redacted: Callable[[], None] | None = None  # called once, at the first redacted answer
        self.redacted = False
        options: list[tuple[str, int | str]] = [("grpc.max_receive_message_length", MAX_RECEIVE_MESSAGE_BYTES)]
        self._socket_path = Path(target.removeprefix("unix://").removeprefix("unix:")) \
            if target.startswith("unix:") else None
        if self._socket_path is not None:
            self._channel = grpc.insecure_channel(target, options)
        elif tls is None:
            raise CommandError(f"{target}: the agent serves TCP with mutual TLS only; give a client "
                               "certificate, key and the agent's CA", ExitCode.USAGE)
        else:
            if tls.server_name:
                options.append(("grpc.ssl_target_name_override", tls.server_name))
            try:
                credentials = grpc.ssl_channel_credentials(
                    root_certificates=tls.server_ca.read_bytes(), private_key=tls.key.read_bytes(),
                    certificate_chain=tls.cert.read_bytes())
            except OSError as error:
                raise CommandError(f"cannot read {error.filename}: {error.strerror}", ExitCode.USAGE) from None
            self._channel = grpc.secure_channel(target, credentials, options)
        self._stub = service_grpc.AgentServiceStub(self._channel)

    @classmethod
    def for_socket(cls, path: Path, timeout_seconds: float = 10.0) -> AgentClient:
        """The agent serving on `path`: its admin socket next to it when this user may use it."""
        return cls.for_config(ApiConfig(socket=path), timeout_seconds)

    @classmethod
    def for_config(cls, config: ApiConfig, timeout_seconds: float = 10.0) -> AgentClient:
        """The admin socket (full detail) if it is there and this user may connect, else the socket."""
        admin = config.admin_path
        path = admin if admin is not None and os.path.exists(admin) and os.access(admin, os.R_OK | os.W_OK) \
            else config.socket
        return cls(f"unix://{path}", timeout_seconds=timeout_seconds)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> AgentClient:
        """The client of a command with `config.add_socket_flag`: flag > $KVTRACE_SOCKET > file;
        the admin socket ($KVTRACE_ADMIN_SOCKET, the file, next to it) when this user may use it.
        (A command with --input reads a recording instead: kvtrace.cli.recorded.connect.)"""
        try:
            client = cls.for_config(config_from_args(args))
        except ConfigError as error:
            raise CommandError(str(error), ExitCode.USAGE) from None
        client.on_redacted = lambda: print(f"kvtrace: {REDACTED_NOTICE}", file=sys.stderr, flush=True)
        return client

    def __enter__(self) -> AgentClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def now_ns(self) -> int:
        """The time the answers stand at (ages are counted to it): now, for a live agent."""
        return time.time_ns()

    # ---- calls ----

    def stream_events(self, pids: Iterable[int] = (), title_regex: str = "", kinds: Iterable[Kind] = (),
                      layers: Iterable[Layer] = (), min_size_bytes: int = 0) -> Iterator[events_pb2.Event]:
        """Events as they happen (no deadline), including in-band `events_lost` reports."""
        for batch in self.stream_batches(pids, title_regex, kinds, layers, min_size_bytes):
            yield from batch

    def stream_batches(self, pids: Iterable[int] = (), title_regex: str = "", kinds: Iterable[Kind] = (),
                       layers: Iterable[Layer] = (), min_size_bytes: int = 0) -> Iterator[list[events_pb2.Event]]:
        """The same events in the batches the agent sends (a printer flushes once per batch).

        Not a generator itself: a missing socket or a bad argument fails here, at the call."""
        request = self._stream_request(pids, title_regex, kinds, layers, min_size_bytes)
        return self._batches(self._stub.StreamEvents(request))

    def stream_responses(self, pids: Iterable[int] = (), title_regex: str = "", kinds: Iterable[Kind] = (),
                         layers: Iterable[Layer] = (), min_size_bytes: int = 0, columns: bool = True,
                         fixed: bool = False) -> Iterator[service_pb2.StreamEventsResponse]:
        """The stream's responses as the agent sends them. With `columns` (EVENT_ENCODING_COLUMNS, what a
        busy reader wants) a response's traced events are in `columns` (kvtrace.wire.events_from_columns
        reads them), after its `events`, which then hold only stack definitions and loss reports; an
        agent older than columns puts every event in `events`, so read both. With `fixed` too
        (EVENT_ENCODING_FIXED_COLUMNS, the cheapest for both sides) a response may carry them in
        `fixed_columns` instead (kvtrace.wire.events_from_fixed_columns).

        Not a generator itself: a missing socket or a bad argument fails here, at the call."""
        request = self._stream_request(pids, title_regex, kinds, layers, min_size_bytes)
        if columns:
            request.encoding = service_pb2.EVENT_ENCODING_FIXED_COLUMNS if fixed else service_pb2.EVENT_ENCODING_COLUMNS
        elif fixed:
            raise ValueError("fixed columns are columns: fixed=True needs columns=True")
        return self._responses(self._stub.StreamEvents(request))

    def _stream_request(self, pids: Iterable[int], title_regex: str, kinds: Iterable[Kind],
                        layers: Iterable[Layer], min_size_bytes: int) -> service_pb2.StreamEventsRequest:
        if min_size_bytes < 0:
            raise CommandError("the minimum size cannot be negative", ExitCode.USAGE)
        self._check_socket()
        return service_pb2.StreamEventsRequest(
            pids=list(pids), title_regex=title_regex, kinds=wire_numbers(kinds),
            layers=wire_numbers(layers), min_size_bytes=min_size_bytes)

    def _responses(self, responses) -> Iterator[service_pb2.StreamEventsResponse]:
        try:
            for response in responses:
                yield self._saw(response)
        except grpc.RpcError as error:
            raise self._command_error(error) from None

    def _batches(self, responses) -> Iterator[list[events_pb2.Event]]:
        try:
            for response in responses:
                self._saw(response)
                yield list(response.events)
        except grpc.RpcError as error:
            raise self._command_error(error) from None

    def snapshot(self, pids: Iterable[int] = (), layers: Iterable[Layer] = (),
                 page_size: int = SNAPSHOT_PAGE_SIZE) -> Iterator[service_pb2.OutstandingAllocation]:
        """Every outstanding object, following the pages."""
        for response in self.snapshot_pages(pids, layers, page_size):
            yield from response.allocations

    def snapshot_pages(self, pids: Iterable[int] = (), layers: Iterable[Layer] = (),
                       page_size: int = SNAPSHOT_PAGE_SIZE,
                       encoding: service_pb2.SnapshotEncoding = service_pb2.SNAPSHOT_ENCODING_MESSAGES,
                       ) -> Iterator[service_pb2.GetSnapshotResponse]:
        """The snapshot's pages as they come, each with the stacks its allocations refer to. The next page is
        asked for before this one is handed over: the agent reads it while the caller uses this one. With
        `encoding` SNAPSHOT_ENCODING_COLUMNS a page's objects are in its `columns`, or in its `allocations`
        from an agent older than columns (snapshot_columns reads either)."""
        pids, layers = list(pids), wire_numbers(layers)
        self._check_socket()
        pending = self._stub.GetSnapshot.future(
            service_pb2.GetSnapshotRequest(pids=pids, layers=layers, page_size=page_size, encoding=encoding),
            timeout=self.timeout_seconds)
        try:
            while True:
                try:
                    response = self._saw(pending.result())
                except grpc.RpcError as error:
                    raise self._command_error(error) from None
                token = response.next_page_token
                if token:
                    pending = self._stub.GetSnapshot.future(service_pb2.GetSnapshotRequest(
                        pids=pids, layers=layers, page_size=page_size, page_token=token, encoding=encoding),
                        timeout=self.timeout_seconds)
                yield response
                if not token:
                    return
        finally:
            pending.cancel()  # a caller that stopped early: the page read ahead is not waited for

    def snapshot_columns(self, pids: Iterable[int] = (), layers: Iterable[Layer] = (),
                         page_size: int = SNAPSHOT_PAGE_MAX, fields: Collection[str] | None = None,
                         depths: dict[int, ProcessDepth] | None = None,
                         ) -> Iterator[tuple[EntryColumns, dict[int, Stack]]]:
        """Every outstanding object, a page at a time in columns, each page with the stacks it refers to: a
        listing of millions without an object for each (an export reads so). Pages are the largest the agent
        allows: the fewer, the fewer round trips, and the agent reads the next while the caller uses this one.
        `fields`: the columns the caller reads (None: all; the others are left empty). `depths`, if given, gets
        each listed process's depth as the pages say it (none from an agent older than depths)."""
        for page in self.snapshot_pages(pids, layers, page_size, encoding=service_pb2.SNAPSHOT_ENCODING_COLUMNS):
            if depths is not None:
                depths.update(depths_by_pid(page.depths))
            try:
                columns = columns_from_snapshot(page, fields)
            except ValueError as error:
                raise CommandError(f"the agent sent a snapshot page this client cannot read: {error}",
                                   ExitCode.FAILURE) from None
            yield columns, dict(stack_from_proto(stack) for stack in page.stacks)

    def held(self, pids: Iterable[int] = ()) -> HeldMemory:
        """Every outstanding object as the model's, with the stacks it refers to and its process's title
        (objects of a kind this client does not know, from a newer agent, are left out)."""
        held = HeldMemory([], {}, {})
        for page in self.snapshot_pages(pids):
            for message in page.allocations:
                try:
                    held.entries.append(outstanding_from_proto(message))
                except ValueError:
                    continue
                held.titles.setdefault(message.pid, message.title or message.comm)
            held.stacks.update(stack_from_proto(stack) for stack in page.stacks)
        return held

    def processes(self) -> list[service_pb2.Process]:
        return list(self._call(self._stub.ListProcesses, service_pb2.ListProcessesRequest()).processes)

    def info(self) -> service_pb2.GetAgentInfoResponse:
        return self._call(self._stub.GetAgentInfo, service_pb2.GetAgentInfoRequest())

    def leak_suspects(self, pids: Iterable[int] = (), min_age_seconds: float | None = None,
                      limit: int = 0) -> service_pb2.ListLeakSuspectsResponse:
        """Ranked suspects; None / 0 take the agent's defaults (--leak-min-age, 100 suspects)."""
        request = service_pb2.ListLeakSuspectsRequest(pids=list(pids), min_age_seconds=min_age_seconds,
                                                      limit=limit)
        return self._call(self._stub.ListLeakSuspects, request)

    def growth(self, pids: Iterable[int] = ()) -> service_pb2.GetGrowthResponse:
        return self._call(self._stub.GetGrowth, service_pb2.GetGrowthRequest(pids=list(pids)))

    def vllm_engines(self, pids: Iterable[int] = ()) -> service_pb2.GetVllmEnginesResponse:
        """The vLLM engines (those with one of `pids` as EngineCore or worker; empty: all) and the
        findings about them."""
        return self._call(self._stub.GetVllmEngines, service_pb2.GetVllmEnginesRequest(pids=list(pids)))

    def stream_recording(self, pids: Iterable[int] = (), title_regex: str = "",
                         duration_seconds: float | None = None) -> Iterator[service_pb2.StreamRecordingResponse]:
        """A recording as the agent sends it: the header first, then frames, for `duration_seconds`
        (None: until the caller stops reading)."""
        self._check_socket()
        request = service_pb2.StreamRecordingRequest(pids=list(pids), title_regex=title_regex)
        return self._until_deadline(self._stub.StreamRecording(request, timeout=duration_seconds))

    def _until_deadline(self, responses) -> Iterator:
        """A stream whose deadline is its planned end: reaching it ends the stream, not in error."""
        try:
            yield from responses
        except grpc.RpcError as error:
            if error.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                return
            raise self._command_error(error) from None

    def dump_flight_recorder(self, reason: str = "") -> service_pb2.FlightDump:
        """Has the agent's flight recorder write its last seconds now; where it went."""
        request = service_pb2.DumpFlightRecorderRequest(reason=reason)
        return self._call(self._stub.DumpFlightRecorder, request, timeout_seconds=120.0).dump

    def cross_checks(self, pids: Iterable[int] = ()) -> service_pb2.GetCrossCheckResponse:
        """The CUPTI tracers (`kvtrace run`) of `pids` (empty: all) and their agreement with the uprobes."""
        return self._call(self._stub.GetCrossCheck, service_pb2.GetCrossCheckRequest(pids=list(pids)))

    def flight_dumps(self) -> service_pb2.ListFlightDumpsResponse:
        return self._call(self._stub.ListFlightDumps, service_pb2.ListFlightDumpsRequest())

    def set_process_depth(self, pid: int, depth: Depth,
                          duration_seconds: float = 0.0) -> service_pb2.SetProcessDepthResponse:
        """Asks the agent to trace `pid` at `depth` for `duration_seconds` (0: the agent's default, 10 min);
        Depth.SEGMENTS withdraws an earlier request. The agent applies it at its next analysis tick.
        Admin socket only."""
        request = service_pb2.SetProcessDepthRequest(pid=pid, depth=wire_number(depth),
                                                     duration_seconds=duration_seconds)
        return self._call(self._stub.SetProcessDepth, request)

    def _call(self, method, request, timeout_seconds: float | None = None):
        self._check_socket()
        try:
            response = method(request, timeout=timeout_seconds or self.timeout_seconds)
        except grpc.RpcError as error:
            raise self._command_error(error) from None
        return self._saw(response)

    def _saw(self, response):
        """Notes a redacted answer (the group socket's), and says so once."""
        if getattr(response, "view", 0) == service_pb2.VIEW_REDACTED and not self.redacted:
            self.redacted = True
            if self.on_redacted is not None:
                self.on_redacted()
        return response

    # ---- errors ----

    def _command_error(self, error: grpc.RpcError) -> CommandError:
        code, details = error.code(), error.details() or ""
        if code is grpc.StatusCode.UNAVAILABLE:
            return CommandError(self._unreachable(details), ExitCode.AGENT_UNREACHABLE)
        if code is grpc.StatusCode.INVALID_ARGUMENT:
            return CommandError(f"the agent refused the request: {details}", ExitCode.USAGE)
        if code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.FAILED_PRECONDITION):
            return CommandError(f"the agent at {self.target} refused: {details}")
        if code is grpc.StatusCode.NOT_FOUND:
            return CommandError(f"the agent at {self.target} found nothing to act on: {details}")
        if code is grpc.StatusCode.UNIMPLEMENTED:
            return CommandError(f"the agent at {self.target} is older than this kvtrace and lacks this call "
                                f"({details or code.name}); upgrade the agent")
        if code is grpc.StatusCode.DEADLINE_EXCEEDED:
            return CommandError(f"the agent at {self.target} did not answer within "
                                f"{self.timeout_seconds:g} s", ExitCode.AGENT_UNREACHABLE)
        return CommandError(f"the agent at {self.target} failed: {code.name}: {details}")

    def _check_socket(self) -> None:
        """Fails fast, before gRPC's connection retries, when the socket is missing or closed to us."""
        if self._socket_path is None:
            return
        try:
            mode = os.stat(self._socket_path).st_mode
        except FileNotFoundError:
            raise CommandError(f"the kvtrace agent is not running (no socket at {self._socket_path}); "
                               f"{_START_HINT}", ExitCode.AGENT_UNREACHABLE) from None
        except PermissionError:
            raise CommandError(_permission_denied(self._socket_path), ExitCode.AGENT_UNREACHABLE) from None
        except OSError as error:  # a file where a directory should be, a link loop, ...
            raise CommandError(f"cannot reach the agent's socket {self._socket_path}: {error.strerror}; give "
                               "its path with --socket or $KVTRACE_SOCKET", ExitCode.USAGE) from None
        if not stat.S_ISSOCK(mode):
            raise CommandError(f"{self._socket_path} is not a socket; give the agent's socket with --socket or "
                               "$KVTRACE_SOCKET", ExitCode.USAGE)

    def _unreachable(self, details: str) -> str:
        if "shutting down" in details:
            return f"the kvtrace agent stopped; {_START_HINT}"
        if self._socket_path is None:
            return f"cannot reach the agent at {self.target}: {details}"
        path = self._socket_path
        try:
            self._check_socket()  # it may have gone since the call started
        except CommandError as error:
            return str(error)
        if not os.access(path, os.R_OK | os.W_OK) or "ermission denied" in details:
            return _permission_denied(path)
        return f"the kvtrace agent does not answer on {path} (is it running? {_START_HINT}): {details}"


def _permission_denied(path: Path) -> str:
    """What to do, naming the group the socket really has: the agent falls back to root's group where its
    --group does not exist, and then joining the group it was meant to have would not help."""
    try:
        gid = path.stat().st_gid
    except OSError:
        gid = -1
    try:
        group = grp.getgrgid(gid).gr_name if gid >= 0 else ""
    except KeyError:
        group = ""
    if group and gid != 0:
        return (f"permission denied on {path}: add yourself to group {group} "
                f"(`sudo usermod -aG {group} $USER`, then log in again), or use sudo")
    owner = f"group {group or gid}" if gid >= 0 else "a group this user cannot see"
    return (f"permission denied on {path}: it belongs to {owner}, so only root may use it; for others, create "
            f"group {DEFAULT_GROUP} (`sudo groupadd --system {DEFAULT_GROUP}`), restart the agent, and join it "
            f"(`sudo usermod -aG {DEFAULT_GROUP} $USER`, then log in again); or use sudo")
