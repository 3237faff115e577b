"""The kvtrace.v1 gRPC server: AgentService, grpc health and (on the Unix socket only) reflection.

Secure by default and fail closed:
- the Unix socket is created 0600 (umask) and only then opened to 0660 owner:group; the agent
  refuses to start if the path holds anything but a stale socket, or if ownership or permissions
  cannot be set;
- TCP is served only with mutual TLS (client certificates required), never in plaintext, and
  without reflection: it is a separate grpc.Server so that reflection cannot leak onto it.

Usage (the agent command):

    server = AgentServer(session, analyzer, config)   # config: kvtrace.config.ApiConfig
    session.add_sink(server.hub)            # events reach the streams
    server.start()                          # raises ServerSetupError with one clear line
    ...
    server.stop(grace_seconds=5)            # on SIGTERM
"""
from __future__ import annotations

import base64
import binascii
import errno
import grp
import heapq
import logging
import os
import pwd
import re
import socket
import ssl
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvtrace._proto.kvtrace.v1 import agent_service_pb2 as service_pb2
from kvtrace._proto.kvtrace.v1 import agent_service_pb2_grpc as service_grpc
from kvtrace._proto.kvtrace.v1 import events_pb2
from kvtrace.config import ApiConfig
from kvtrace.model.events import Event, Kind, Layer
from kvtrace.model.ledger import Outstanding
from kvtrace.model.processes import ProcessInfo
from kvtrace.servers.backend import AgentAnalysis, AgentState
from kvtrace.servers.hub import EventFilter, EventHub, Lost
from kvtrace.wire import (
    event_to_proto,
    growth_to_proto,
    info_to_proto,
    leak_report_to_proto,
    lost_to_proto,
    outstanding_to_proto,
    process_to_proto,
    stack_message,
    stack_to_proto,
)

log = logging.getLogger(__name__)

SERVICE_NAME = service_pb2.DESCRIPTOR.services_by_name["AgentService"].full_name

MAX_FILTER_PIDS = 1024
MAX_TITLE_REGEX_CHARS = 1024
MAX_SIZE_BYTES = 1 << 50  # 1 PiB: no GPU allocation is larger; beyond it the value is a mistake
DEFAULT_PAGE_SIZE = 1000
MAX_PAGE_SIZE = 10000
MAX_PAGE_TOKEN_CHARS = 256
DEFAULT_SUSPECTS = 100
MAX_SUSPECTS = 10000
MAX_MIN_AGE_SECONDS = 365 * 24 * 3600.0
SOCKET_PATH_MAX_BYTES = 107  # sun_path is 108 bytes with the terminating NUL
SOCKET_MODE = 0o660
SOCKET_DIRECTORY_MODE = 0o750


class ServerSetupError(Exception):
    """The server cannot start safely. The message is one line for the operator."""


@dataclass(frozen=True)
class ServerLimits:
    max_streams: int = 64  # concurrent StreamEvents calls; more get RESOURCE_EXHAUSTED
    max_receive_message_bytes: int = 4 << 20
    batch_max_events: int = 512  # events per StreamEventsResponse
    flush_seconds: float = 0.05  # a stream waits at most this long before sending what it has
    health_poll_seconds: float = 1.0
    extra_workers: int = 16  # threads beyond max_streams, for unary calls and health watches


class InvalidArgument(Exception):
    """A request field is wrong; becomes INVALID_ARGUMENT with `field: reason`."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")


# ---- requests -> model filters ----

def _enum_values(field: str, values, enum_type) -> frozenset:
    """Proto3 keeps unknown enum numbers as plain ints: refuse them, and the zero value, by name."""
    members = []
    for index, value in enumerate(values):
        if value not in enum_type._value2member_map_:
            raise InvalidArgument(f"{field}[{index}]", f"unknown or unspecified value {value}")
        members.append(enum_type(value))
    return frozenset(members)


def _pids(field: str, pids) -> frozenset[int]:
    if len(pids) > MAX_FILTER_PIDS:
        raise InvalidArgument(field, f"{len(pids)} pids; at most {MAX_FILTER_PIDS}")
    return frozenset(pids)


def stream_filter(request: service_pb2.StreamEventsRequest) -> EventFilter:
    title_regex = None
    if request.title_regex:
        if len(request.title_regex) > MAX_TITLE_REGEX_CHARS:
            raise InvalidArgument("title_regex", f"longer than {MAX_TITLE_REGEX_CHARS} characters")
        try:
            title_regex = re.compile(request.title_regex)
        except (re.error, OverflowError, RecursionError, ValueError) as error:
            raise InvalidArgument("title_regex", f"not a valid regular expression: {error}") from None
    # A negative int64 sent by a careless client arrives as a uint64 above 2**63: absurd as well.
    if request.min_size_bytes > MAX_SIZE_BYTES:
        raise InvalidArgument("min_size_bytes", f"{request.min_size_bytes} is more than 1 PiB")
    return EventFilter(pids=_pids("pids", request.pids), title_regex=title_regex,
                       kinds=_enum_values("kinds", request.kinds, Kind),
                       layers=_enum_values("layers", request.layers, Layer),
                       min_size_bytes=request.min_size_bytes)


def _ledger_order(entry: Outstanding) -> tuple[int, int, int, int]:
    key = entry.key
    return key.pid, int(key.layer), int(key.object), key.address


def encode_page_token(position: tuple[int, int, int, int]) -> str:
    return base64.urlsafe_b64encode(("v1:" + ":".join(map(str, position))).encode()).decode()


def decode_page_token(token: str) -> tuple[int, int, int, int]:
    """The ledger position after which the next page starts."""
    try:
        if len(token) > MAX_PAGE_TOKEN_CHARS:
            raise ValueError
        version, *fields = base64.urlsafe_b64decode(token.encode("ascii")).decode("ascii").split(":")
        position = tuple(int(field) for field in fields)
        if version != "v1" or len(position) != 4 or min(position) < 0:
            raise ValueError
    except (ValueError, UnicodeError, binascii.Error):
        raise InvalidArgument("page_token", "not a token from a previous GetSnapshot response") from None
    return position


# ---- the service ----

class AgentServicer(service_grpc.AgentServiceServicer):
    def __init__(self, state: AgentState, analysis: AgentAnalysis, hub: EventHub,
                 limits: ServerLimits) -> None:
        self._state = state
        self._analysis = analysis
        self._hub = hub
        self._limits = limits
        self._streams_lock = threading.Lock()
        self._streams = 0
        self.stopping = threading.Event()

    def _try_open_stream(self) -> bool:
        with self._streams_lock:
            if self._streams >= self._limits.max_streams:
                return False
            self._streams += 1
            return True

    def _close_stream(self) -> None:
        with self._streams_lock:
            self._streams -= 1

    def StreamEvents(self, request, context):
        try:
            event_filter = stream_filter(request)
        except InvalidArgument as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        if not self._try_open_stream():
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"the agent already serves {self._limits.max_streams} event streams (its limit)")
        subscription = self._hub.subscribe(event_filter)
        context.add_callback(subscription.close)  # a cancel or an expired deadline wakes the reader
        sent_stacks: set[int] = set()
        try:
            while context.is_active() and not self.stopping.is_set():
                wait_seconds = self._limits.flush_seconds
                remaining = context.time_remaining()
                if remaining is not None:
                    if remaining <= 0:  # say so, rather than end the stream as if completed
                        context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the stream's deadline passed")
                    wait_seconds = min(wait_seconds, remaining)
                items = subscription.read(self._limits.batch_max_events, wait_seconds)
                if items:
                    yield service_pb2.StreamEventsResponse(events=self._messages(items, sent_stacks))
            if self.stopping.is_set():
                context.abort(grpc.StatusCode.UNAVAILABLE, "the kvtrace agent is shutting down")
        finally:
            self._hub.unsubscribe(subscription)
            self._close_stream()

    def _messages(self, items: list[Event | Lost], sent_stacks: set[int]) -> list[events_pb2.Event]:
        """Wire events for a batch; each stack is defined once per stream, before its first use."""
        messages = []
        for item in items:
            if isinstance(item, Lost):
                messages.append(lost_to_proto(item.dropped_count, item.kernel_lost_count))
                continue
            if item.stack_id and item.stack_id not in sent_stacks:
                sent_stacks.add(item.stack_id)
                stack = self._state.stack(item.stack_id)
                if stack is not None:
                    messages.append(stack_to_proto(item.stack_id, stack))
            messages.append(event_to_proto(item))
        return messages

    def GetSnapshot(self, request, context):
        try:
            pids = _pids("pids", request.pids)
            layers = _enum_values("layers", request.layers, Layer)
            if not 0 <= request.page_size <= MAX_PAGE_SIZE:
                raise InvalidArgument("page_size", f"{request.page_size} is not in 0..{MAX_PAGE_SIZE}")
            after = decode_page_token(request.page_token) if request.page_token else None
        except InvalidArgument as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        page_size = request.page_size or DEFAULT_PAGE_SIZE
        timestamp_ns = time.time_ns()
        candidates = [entry for entry in self._state.outstanding()
                      if (not pids or entry.key.pid in pids) and (not layers or entry.key.layer in layers)
                      and (after is None or _ledger_order(entry) > after)]
        # One more than a page tells whether another page follows; nsmallest avoids a full sort.
        page = heapq.nsmallest(page_size + 1, candidates, key=_ledger_order)
        next_token = encode_page_token(_ledger_order(page[page_size - 1])) if len(page) > page_size else ""
        processes: dict[int, ProcessInfo | None] = {}
        allocations = []
        for entry in page[:page_size]:
            pid = entry.key.pid
            if pid not in processes:
                processes[pid] = self._state.process(pid)
            allocations.append(outstanding_to_proto(entry, processes[pid]))
        stacks = []
        for stack_id in sorted({entry.stack_id for entry in page[:page_size] if entry.stack_id}):
            stack = self._state.stack(stack_id)
            if stack is not None:
                stacks.append(stack_message(stack_id, stack))
        return service_pb2.GetSnapshotResponse(allocations=allocations, next_page_token=next_token,
                                               timestamp_ns=timestamp_ns, stacks=stacks)

    def ListProcesses(self, request, context):
        processes = sorted(self._state.processes_holding_memory(), key=lambda process: process.pid)
        return service_pb2.ListProcessesResponse(processes=[process_to_proto(p) for p in processes])

    def GetAgentInfo(self, request, context):
        info = self._state.info()
        # The API's own figures: how many streams it feeds and how many events it offered them.
        info.counters["subscribers"] = self._hub.subscriber_count()
        info.counters["events_published"] = self._hub.published_total
        return info_to_proto(info)

    def ListLeakSuspects(self, request, context):
        try:
            pids = _pids("pids", request.pids)
            min_age_seconds = request.min_age_seconds if request.HasField("min_age_seconds") else None
            if min_age_seconds is not None and not 0 <= min_age_seconds <= MAX_MIN_AGE_SECONDS:  # NaN too
                raise InvalidArgument("min_age_seconds", f"{min_age_seconds} is not in 0..{MAX_MIN_AGE_SECONDS:g}")
            if not 0 <= request.limit <= MAX_SUSPECTS:
                raise InvalidArgument("limit", f"{request.limit} is not in 0..{MAX_SUSPECTS}")
        except InvalidArgument as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        report = self._analysis.leak_report(pids, min_age_seconds, request.limit or DEFAULT_SUSPECTS)
        return leak_report_to_proto(report)

    def GetGrowth(self, request, context):
        try:
            pids = _pids("pids", request.pids)
        except InvalidArgument as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        return growth_to_proto(self._analysis.latest, pids)


# ---- the Unix socket ----

def socket_group_id(group: str) -> int:
    """The gid for the socket; root's group, with a warning, if the group does not exist."""
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        root_gid = pwd.getpwuid(0).pw_gid
        log.warning("group %r does not exist: the API socket gets root's group (gid %d), so only "
                    "root can use it; create the group with `groupadd --system %s`", group, root_gid, group)
        return root_gid


def _listener_on(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except OSError as error:
            if error.errno in (errno.ECONNREFUSED, errno.ENOENT):
                return False
            raise ServerSetupError(f"cannot tell whether {path} is in use: {error.strerror}") from None
        return True


def prepare_socket_path(path: Path, gid: int) -> None:
    """Makes the socket's directory if missing, and clears a stale socket; refuses anything else."""
    if len(os.fsencode(path)) > SOCKET_PATH_MAX_BYTES:
        raise ServerSetupError(f"socket path {path} is longer than {SOCKET_PATH_MAX_BYTES} bytes")
    directory = path.parent
    if not directory.exists():
        # Only a directory we create gets our mode: never chmod an existing one (it may be /tmp).
        try:
            directory.mkdir(parents=True, mode=SOCKET_DIRECTORY_MODE)
            os.chown(directory, -1, gid)
            os.chmod(directory, SOCKET_DIRECTORY_MODE)
        except OSError as error:
            raise ServerSetupError(f"cannot create {directory} (mode 0750, gid {gid}): {error.strerror}") from None
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ServerSetupError(f"{path} exists and is not a socket; refusing to replace it "
                               "(move it away, or choose another --socket)")
    if _listener_on(path):
        raise ServerSetupError(f"another process is already serving on {path} (is an agent running?)")
    log.info("removing stale socket %s", path)
    path.unlink()


def _secure_port_credentials(config: ApiConfig) -> grpc.ServerCredentials:
    """Mutual TLS credentials; the files are checked here so that a bad one stops the start."""
    contents = {}
    files: dict[str, Path] = {}
    for name in ("tls_cert", "tls_key", "tls_client_ca"):
        file = getattr(config, name)
        try:
            contents[name] = file.read_bytes()
        except (OSError, AttributeError) as error:
            raise ServerSetupError(f"cannot read {name} {file}: {getattr(error, 'strerror', error)}") from None
        files[name] = file
    try:
        check = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        check.load_cert_chain(files["tls_cert"], files["tls_key"])
        check.load_verify_locations(cafile=files["tls_client_ca"])
    except (ssl.SSLError, ValueError) as error:
        raise ServerSetupError(f"the TLS files do not load ({config.tls_cert}, {config.tls_key}, "
                               f"{config.tls_client_ca}): {error}") from None
    return grpc.ssl_server_credentials([(contents["tls_key"], contents["tls_cert"])],
                                       root_certificates=contents["tls_client_ca"],
                                       require_client_auth=True)


class AgentServer:
    """The gRPC endpoints of the agent: the Unix socket, and TCP with mTLS when configured."""

    def __init__(self, state: AgentState, analysis: AgentAnalysis, config: ApiConfig,
                 limits: ServerLimits = ServerLimits(), max_queued_events: int | None = None) -> None:
        self.state = state
        # Each stream's bounded queue; the agent adds this as a Session sink.
        self.hub = EventHub(max_queued_events) if max_queued_events else EventHub()
        self.config = config
        self.limits = limits
        self.servicer = AgentServicer(state, analysis, self.hub, limits)
        self.health = health.HealthServicer()
        self.tcp_port: int | None = None
        self._servers: list[grpc.Server] = []
        self._socket_inode: int | None = None
        self._stop_polling = threading.Event()
        self._poller: threading.Thread | None = None

    def _new_server(self, reflection_enabled: bool) -> grpc.Server:
        workers = self.limits.max_streams + self.limits.extra_workers
        server = grpc.server(
            ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvtrace-grpc"),
            maximum_concurrent_rpcs=workers,
            options=[("grpc.max_receive_message_length", self.limits.max_receive_message_bytes),
                     ("grpc.so_reuseport", 0)])
        service_grpc.add_AgentServiceServicer_to_server(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        if reflection_enabled:
            reflection.enable_server_reflection(
                (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        self._servers.append(server)
        return server

    def start(self) -> None:
        try:
            self._start_unix()
            if self.config.tcp_enabled:
                self._start_tcp()
        except BaseException:
            self.stop(grace_seconds=0)
            raise
        self._set_health(self._state_healthy())
        self._poller = threading.Thread(target=self._poll_health, name="kvtrace-health", daemon=True)
        self._poller.start()

    def _start_unix(self) -> None:
        path = self.config.socket
        gid = socket_group_id(self.config.group)
        prepare_socket_path(path, gid)
        server = self._new_server(reflection_enabled=True)
        # gRPC creates the socket with the process umask: make it owner-only until chmod opens it
        # to the group, so there is no moment where others could connect.
        previous_umask = os.umask(0o177)
        try:
            server.add_insecure_port(f"unix:{path}")
        except RuntimeError as error:
            raise ServerSetupError(f"cannot listen on {path}: {error}") from None
        finally:
            os.umask(previous_umask)
        try:
            self._socket_inode = os.lstat(path).st_ino  # ours now: stop() removes it
            os.chown(path, -1, gid)
            os.chmod(path, SOCKET_MODE)
        except OSError as error:
            raise ServerSetupError(f"cannot give {path} group {gid} and mode 0660: {error.strerror}") from None
        server.start()
        log.info("serving kvtrace.v1 on unix:%s (0660, gid %d)", path, gid)

    def _start_tcp(self) -> None:
        server = self._new_server(reflection_enabled=False)
        credentials = _secure_port_credentials(self.config)
        try:
            port = server.add_secure_port(self.config.tcp_listen, credentials)
        except RuntimeError as error:
            raise ServerSetupError(f"cannot listen on {self.config.tcp_listen}: {error}") from None
        if port == 0:
            raise ServerSetupError(f"cannot listen on {self.config.tcp_listen}")
        self.tcp_port = port
        server.start()
        log.info("serving kvtrace.v1 on %s with mutual TLS", self.config.tcp_listen)

    def _state_healthy(self) -> bool:
        try:
            return bool(self.state.healthy())
        except Exception:  # a broken health check is itself unhealthy, never a dead poller
            log.exception("health check failed")
            return False

    def _set_health(self, healthy: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if healthy else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", SERVICE_NAME):
            self.health.set(service, status)

    def _poll_health(self) -> None:
        while not self._stop_polling.wait(self.limits.health_poll_seconds):
            self._set_health(self._state_healthy())

    def stop(self, grace_seconds: float = 5.0) -> None:
        """Stops accepting calls, ends the event streams (UNAVAILABLE), and waits up to
        `grace_seconds` for unary calls in flight."""
        self._stop_polling.set()
        self.health.enter_graceful_shutdown()
        self.servicer.stopping.set()
        self.hub.close_all()
        done = [server.stop(grace_seconds) for server in self._servers]
        for event in done:
            event.wait()
        self._servers.clear()
        self._remove_socket()

    def _remove_socket(self) -> None:
        """Removes our socket file, and only ours (a newer agent may have replaced it)."""
        try:
            if self._socket_inode is not None and os.lstat(self.config.socket).st_ino == self._socket_inode:
                self.config.socket.unlink()
        except OSError:
            pass
        self._socket_inode = None
