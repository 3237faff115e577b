"""Typed client of the kvtrace agent's kvtrace.v1 API; the CLI's commands use it too.

    with AgentClient() as agent:                    # unix:///run/kvtrace/kvtrace.sock
        for event in agent.stream_events(pids=[1234]):
            print(event_to_json_dict(event))

Failures become `CommandError` with one line that says what to do (start the agent, join the
group), so a command needs no handling of its own. This module also turns wire messages back into
the model (`event_from_proto`) and into the JSON objects the CLI prints: the one place that knows
those shapes on the client side.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import grpc

from kvtrace._proto.kvtrace.v1 import agent_service_pb2 as service_pb2
from kvtrace._proto.kvtrace.v1 import agent_service_pb2_grpc as service_grpc
from kvtrace._proto.kvtrace.v1 import events_pb2
from kvtrace.errors import CommandError, ExitCode
from kvtrace.config import DEFAULT_GROUP, DEFAULT_SOCKET, ConfigError, config_from_args
from kvtrace.model.events import Api, Event, Kind, Layer, Memory, ObjectKind
from kvtrace.model.stacks import Frame, Stack

DEFAULT_TARGET = f"unix://{DEFAULT_SOCKET}"
# A snapshot page of 10000 entries with long process titles can pass gRPC's default 4 MiB.
MAX_RECEIVE_MESSAGE_BYTES = 64 << 20

_START_HINT = "start it with `sudo systemctl start kvtrace` or `sudo kvtrace agent`"


@dataclass(frozen=True)
class ClientTls:
    """Mutual TLS for a TCP target: this client's certificate and key, and the agent's CA."""

    cert: Path
    key: Path
    server_ca: Path
    server_name: str | None = None  # the name in the agent's certificate, if not the target host


class AgentClient:
    """A connection to one agent. Methods raise CommandError; use it as a context manager."""

    def __init__(self, target: str = DEFAULT_TARGET, tls: ClientTls | None = None,
                 timeout_seconds: float = 10.0) -> None:
        self.target = target
        self.timeout_seconds = timeout_seconds
        options = [("grpc.max_receive_message_length", MAX_RECEIVE_MESSAGE_BYTES)]
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
        return cls(f"unix://{path}", timeout_seconds=timeout_seconds)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> AgentClient:
        """The client of a command with `config.add_socket_flag`: flag > $KVTRACE_SOCKET > file."""
        try:
            return cls.for_socket(config_from_args(args).socket)
        except ConfigError as error:
            raise CommandError(str(error), ExitCode.USAGE) from None

    def __enter__(self) -> AgentClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

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
        if min_size_bytes < 0:
            raise CommandError("the minimum size cannot be negative", ExitCode.USAGE)
        self._check_socket()
        request = service_pb2.StreamEventsRequest(
            pids=list(pids), title_regex=title_regex, kinds=[int(k) for k in kinds],
            layers=[int(layer) for layer in layers], min_size_bytes=min_size_bytes)
        return self._batches(self._stub.StreamEvents(request))

    def _batches(self, responses) -> Iterator[list[events_pb2.Event]]:
        try:
            for response in responses:
                yield list(response.events)
        except grpc.RpcError as error:
            raise self._command_error(error) from None

    def snapshot(self, pids: Iterable[int] = (), layers: Iterable[Layer] = (),
                 page_size: int = 1000) -> Iterator[service_pb2.OutstandingAllocation]:
        """Every outstanding object, following the pages."""
        request = service_pb2.GetSnapshotRequest(pids=list(pids), layers=[int(layer) for layer in layers],
                                                 page_size=page_size)
        while True:
            response = self._call(self._stub.GetSnapshot, request)
            yield from response.allocations
            if not response.next_page_token:
                return
            request.page_token = response.next_page_token

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

    def _call(self, method, request):
        self._check_socket()
        try:
            return method(request, timeout=self.timeout_seconds)
        except grpc.RpcError as error:
            raise self._command_error(error) from None

    # ---- errors ----

    def _command_error(self, error: grpc.RpcError) -> CommandError:
        code, details = error.code(), error.details()
        if code is grpc.StatusCode.UNAVAILABLE:
            return CommandError(self._unreachable(details), ExitCode.AGENT_UNREACHABLE)
        if code is grpc.StatusCode.INVALID_ARGUMENT:
            return CommandError(f"the agent refused the request: {details}", ExitCode.USAGE)
        if code is grpc.StatusCode.DEADLINE_EXCEEDED:
            return CommandError(f"the agent at {self.target} did not answer within "
                                f"{self.timeout_seconds:g} s", ExitCode.AGENT_UNREACHABLE)
        return CommandError(f"the agent at {self.target} failed: {code.name}: {details}")

    def _check_socket(self) -> None:
        """Fails fast, before gRPC's connection retries, when the socket is missing or closed to us."""
        if self._socket_path is None:
            return
        try:
            os.stat(self._socket_path)
        except FileNotFoundError:
            raise CommandError(f"the kvtrace agent is not running (no socket at {self._socket_path}); "
                               f"{_START_HINT}", ExitCode.AGENT_UNREACHABLE) from None
        except PermissionError:
            raise CommandError(_permission_denied(self._socket_path), ExitCode.AGENT_UNREACHABLE) from None

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
    return (f"permission denied on {path}: add yourself to group {DEFAULT_GROUP} "
            f"(`sudo usermod -aG {DEFAULT_GROUP} $USER`, then log in again), or use sudo")


# ---- wire -> model and JSON ----

def _member(enum_type, value: int):
    """The model enum member for a wire value; None for UNSPECIFIED (0)."""
    return enum_type(value) if value else None


def event_from_proto(message: events_pb2.Event) -> Event | None:
    """The model event of a wire event; None for events_lost, stack_definition, and events from
    a newer agent that this client cannot represent."""
    common = dict(pid=message.pid, tid=message.tid, timestamp_ns=message.timestamp_ns,
                  comm=message.comm, title=message.title, container=message.container)
    payload = message.WhichOneof("payload")
    try:
        if payload == "allocation":
            allocation = message.allocation
            api = Api(allocation.api)
            aux = allocation.handle if api is Api.cuMemMap else \
                allocation.freed_bytes if api is Api.cuMemUnmap else 0
            return Event(kind=Kind(allocation.kind), api=api, layer=_member(Layer, allocation.layer),
                         object=_member(ObjectKind, allocation.object),
                         memory=_member(Memory, allocation.memory), size_bytes=allocation.size_bytes,
                         address=allocation.address, device=allocation.device,
                         error_code=allocation.error_code, caller_address=allocation.caller_address,
                         aux=aux, stack_id=allocation.stack_id, stack_status=allocation.stack_status,
                         **common)
        if payload == "device_change":
            change = message.device_change
            return Event(kind=Kind.SET_DEVICE, api=Api(change.api), layer=_member(Layer, change.layer),
                         device=change.device, error_code=change.error_code, address=change.context,
                         caller_address=change.caller_address, **common)
        if payload == "context_destroy":
            destroy = message.context_destroy
            return Event(kind=Kind.CONTEXT_DESTROY, api=Api(destroy.api), layer=_member(Layer, destroy.layer),
                         device=destroy.device, error_code=destroy.error_code, address=destroy.context,
                         caller_address=destroy.caller_address, **common)
        if payload == "process_exit":
            return Event(kind=Kind.PROCESS_EXIT, api=Api.process_exit, **common)
    except ValueError:  # an enum value this client does not know: a newer agent
        return None
    return None


def stack_from_proto(stack: events_pb2.Stack) -> tuple[int, Stack]:
    """(stack_id, model Stack) of a stack_definition; later events refer to it by stack_id."""
    return stack.stack_id, Stack(tuple(Frame(frame.function, frame.file, frame.line) for frame in stack.frames),
                                 stack.truncated)


def event_to_json_dict(message: events_pb2.Event) -> dict | None:
    """The JSON object `kvtrace agent --json-events` prints for the same event (None: not an event)."""
    event = event_from_proto(message)
    return event.to_json_dict() if event is not None else None


def wire_enum_name(enum_type, value: int) -> str | None:
    """The lower-case model name of a wire enum value ("runtime"); None for UNSPECIFIED (0)."""
    try:
        return enum_type(value).name.lower() if value else None
    except ValueError:
        return str(value)


def outstanding_to_json_dict(entry: service_pb2.OutstandingAllocation) -> dict:
    """One outstanding object for `kvtrace snapshot --json`, named like the event JSON."""
    return {
        "pid": entry.pid, "tid": entry.tid, "comm": entry.comm, "title": entry.title,
        "container": entry.container, "layer": wire_enum_name(Layer, entry.layer),
        "object": wire_enum_name(ObjectKind, entry.object), "memory": wire_enum_name(Memory, entry.memory),
        "api": entry.api_name, "size_bytes": entry.size_bytes, "address": entry.address,
        "device": entry.device, "timestamp_ns": entry.timestamp_ns,
        "caller_address": entry.caller_address, "stack_id": entry.stack_id,
        **({"mapped_count": entry.mapped_count, "released": entry.released}
           if entry.object == ObjectKind.VMM_HANDLE else {}),
        **({"handle": entry.handle} if entry.object == ObjectKind.VMM_MAPPING else {}),
    }


def process_to_json_dict(process: service_pb2.Process) -> dict:
    """One process for `kvtrace ps --json`."""
    return {
        "pid": process.pid, "title": process.title, "comm": process.comm, "container": process.container,
        "totals": [{"device": total.device, "layer": wire_enum_name(Layer, total.layer),
                    "memory": wire_enum_name(Memory, total.memory), "size_bytes": total.size_bytes,
                    "object_count": total.object_count} for total in process.totals],
    }


def optional_field(message, name: str):
    """An optional (has-presence) field's value, None when unset."""
    return getattr(message, name) if message.HasField(name) else None


def leak_report_to_json_dict(response: service_pb2.ListLeakSuspectsResponse) -> dict:
    """The report of `kvtrace leaks --json`: one object, suspects most suspicious first."""
    return {
        "timestamp_ns": response.timestamp_ns, "min_age_seconds": response.min_age_seconds,
        "allocations_considered": response.allocations_considered,
        "suspect_allocations": response.suspect_allocations, "suspect_count": response.suspect_count,
        "suspects": [{
            "rank": suspect.rank, "pid": suspect.pid, "title": suspect.title, "device": suspect.device,
            "outstanding_bytes": suspect.outstanding_bytes, "allocation_count": suspect.allocation_count,
            "oldest_age_seconds": suspect.oldest_age_seconds,
            "growth_bytes_per_second": suspect.growth_bytes_per_second, "stack_id": suspect.stack_id,
            "stack": [frame.to_json_dict() for frame in stack_from_proto(suspect.stack)[1].frames]
            if suspect.HasField("stack") else None,
            "stack_truncated": suspect.stack.truncated,
            "caller_address": suspect.caller_address,
            "native_caller": {"module": suspect.native_caller.module, "symbol": suspect.native_caller.symbol,
                              "offset": suspect.native_caller.offset}
            if suspect.HasField("native_caller") else None,
        } for suspect in response.suspects],
    }
