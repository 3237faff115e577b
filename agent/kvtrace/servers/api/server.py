"""AgentServer: the agent's gRPC endpoints, started and stopped as one.

It makes one servicer per view over one hub, each with its own stream slots, and serves them: the group
socket (redacted), the admin socket and TCP with mutual TLS (full detail), each a grpc.Server of its
own so that reflection cannot leak onto TCP. It keeps grpc health in step with the agent's, and on
stop ends the streams and removes the socket files it made. The daemon needs only this module; a
start that cannot be made safe raises ServerSetupError (listeners.py).
"""
from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvtrace._proto.kvtrace.v1 import agent_service_pb2 as service_pb2
from kvtrace._proto.kvtrace.v1 import agent_service_pb2_grpc as service_grpc
from kvtrace.config import ApiConfig
from kvtrace.reports.flight import FlightRecorder
from kvtrace.servers.api.listeners import (
    ADMIN_SOCKET_MODE,
    SOCKET_MODE,
    ServerSetupError,
    _secure_port_credentials,
    prepare_socket_path,
    socket_group_id,
)
from kvtrace.servers.api.peers import ConnectionShares
from kvtrace.servers.api.redaction import VIEW_FULL, VIEW_REDACTED
from kvtrace.servers.api.requests import ServerLimits
from kvtrace.servers.api.servicer import AgentServicer
from kvtrace.servers.api.slots import StreamSlots
from kvtrace.servers.backend import AgentAnalysis, AgentState
from kvtrace.servers.hub import EventHub

log = logging.getLogger(__name__)

SERVICE_NAME = service_pb2.DESCRIPTOR.services_by_name["AgentService"].full_name


class AgentServer:
    """The gRPC endpoints of the agent: the group socket (redacted), the admin socket (full detail)
    and TCP with mTLS (full detail) when configured. One hub; stream slots per socket."""

    def __init__(self, state: AgentState, analysis: AgentAnalysis, config: ApiConfig,
                 limits: ServerLimits = ServerLimits(), max_queued_events: int | None = None,
                 flight: FlightRecorder | None = None) -> None:
        self.state = state
        # Each stream's bounded queue; the agent adds this as a Session sink.
        self.hub = EventHub(max_queued_events) if max_queued_events else EventHub()
        self.config = config
        self.limits = limits
        # Slots of their own per socket: the admin socket (and TCP) never waits behind the group socket, where
        # each user holds a share of the connections (peers.py).
        self.slots = StreamSlots(limits, "admin")
        self.group_slots = StreamSlots(limits, "group", ConnectionShares(str(config.socket),
                                                                         limits.max_group_connections_per_user))
        self.servicer = AgentServicer(state, analysis, self.hub, limits, VIEW_FULL, self.slots, flight)
        self.redacted_servicer = AgentServicer(state, analysis, self.hub, limits, VIEW_REDACTED, self.group_slots,
                                               flight)
        self._shares_reason = ""  # the api component is reported once a user is over its share
        self.health = health.HealthServicer()
        self.tcp_port: int | None = None
        self._servers: list[grpc.Server] = []
        self._socket_inodes: dict[Path, int] = {}
        self._stop_polling = threading.Event()
        self._poller: threading.Thread | None = None

    def _new_server(self, servicer: AgentServicer, reflection_enabled: bool) -> grpc.Server:
        workers = self.limits.max_streams + self.limits.extra_workers
        options: list[tuple[str, int]] = [("grpc.max_receive_message_length", self.limits.max_receive_message_bytes),
                                          ("grpc.so_reuseport", 0)]
        if servicer.view == VIEW_REDACTED:  # a user's share of the group's streams: its connections x this
            options.append(("grpc.max_concurrent_streams", self.limits.max_streams_per_connection))
        server = grpc.server(
            ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvtrace-grpc"),
            maximum_concurrent_rpcs=workers, options=options)
        service_grpc.add_AgentServiceServicer_to_server(servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        if reflection_enabled:
            reflection.enable_server_reflection(
                (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        self._servers.append(server)
        return server

    def start(self) -> None:
        try:
            gid = socket_group_id(self.config.group)
            self._start_unix(self.config.socket, gid, SOCKET_MODE, self.redacted_servicer)
            admin = self.config.admin_path
            if admin is not None:
                if self.config.admin_group:
                    self._start_unix(admin, socket_group_id(self.config.admin_group), SOCKET_MODE, self.servicer)
                else:
                    self._start_unix(admin, gid, ADMIN_SOCKET_MODE, self.servicer)
            if self.config.tcp_enabled:
                self._start_tcp()
        except BaseException:
            self.stop(grace_seconds=0)
            raise
        self._set_health(self._state_healthy())
        self._poller = threading.Thread(target=self._poll_health, name="kvtrace-health", daemon=True)
        self._poller.start()

    def _start_unix(self, path: Path, gid: int, mode: int, servicer: AgentServicer) -> None:
        prepare_socket_path(path, gid)
        server = self._new_server(servicer, reflection_enabled=True)
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
            self._socket_inodes[path] = os.lstat(path).st_ino  # ours now: stop() removes it
            os.chown(path, -1, gid)
            os.chmod(path, mode)
        except OSError as error:
            raise ServerSetupError(f"cannot give {path} group {gid} and mode {mode:04o}: {error.strerror}") from None
        server.start()
        view = "full detail" if servicer.view == VIEW_FULL else "redacted"
        log.info("serving kvtrace.v1 (%s) on unix:%s (%04o, gid %d)", view, path, mode, gid)

    def _start_tcp(self) -> None:
        server = self._new_server(self.servicer, reflection_enabled=False)
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
            self._report_shares()

    def _report_shares(self) -> None:
        """Streams refused and evicted per socket, and the users over their share of the group socket's
        connections: counted (/metrics), and named in the `api` component's reason (doctor)."""
        connections = self.group_slots.connections
        # Also between calls (a burst of connections is caught within a second), while the group socket serves
        # streams: a scan reads /proc/net/unix, 65 ms with 5 000 sockets, too much to pay every second for nothing.
        if connections is not None and len(self.group_slots):
            try:
                connections.enforce()
            except Exception:
                log.debug("holding the group socket's shares failed", exc_info=True)
        shares = connections.shares if connections is not None else None
        counters = {f"streams_{what}_{slots.name}": getattr(slots, f"{what}_total")
                    for slots in (self.slots, self.group_slots) for what in ("evicted", "refused", "probes")}
        if shares is not None:
            counters.update(shares.counters())
        try:
            self.state.report_counters(counters)
            reason = shares.describe() if shares is not None else ""
            if reason != self._shares_reason:
                self._shares_reason = reason
                self.state.report_component("api", True, f"group socket: {reason}" if reason else "")
        except Exception:  # the figures are not worth the poller
            log.debug("reporting the API's shares failed", exc_info=True)

    def stop(self, grace_seconds: float = 5.0) -> None:
        """Stops accepting calls, ends the event streams (UNAVAILABLE), and waits up to
        `grace_seconds` for unary calls in flight."""
        self._stop_polling.set()
        self.health.enter_graceful_shutdown()
        self.servicer.stopping.set()
        self.redacted_servicer.stopping.set()
        self.hub.close_all()
        done = [server.stop(grace_seconds) for server in self._servers]
        for event in done:
            event.wait()
        self._servers.clear()
        self._remove_sockets()

    def _remove_sockets(self) -> None:
        """Removes our socket files, and only ours (a newer agent may have replaced them)."""
        for path, inode in self._socket_inodes.items():
            try:
                if os.lstat(path).st_ino == inode:
                    path.unlink()
            except OSError:
                pass
        self._socket_inodes.clear()
