"""The collecting end of `kvtrace run`'s in-process CUPTI tracers: a Unix stream socket each traced process
connects to, its messages decoded (decode.py) into the Session's records, in one thread.

    tracer (in the process) ──protocol.py stream──▶ CuptiListener ──Event, EventsLost──▶ Session.ingest_many
                                                                   ├─stacks──▶ Session.intern_stack
                                                                   └─TracerStatus──▶ Session.report_tracer

Who may connect, and why that is safe: the agent's socket (/run/kvtrace-cupti/cupti.sock, in a directory of
its own, 0755) is mode 0666, so a process of any local user can report. But a process reports only about
itself: its pid is the kernel's (SO_PEERCRED, read at accept, as the agent's pid namespace sees it), never a
message's, so a process can make kvtrace believe wrong things about its own memory only. `kvtrace run
--output` binds its own socket in a private 0700 directory instead.

What a process can cost is bounded: at most MAX_CONNECTIONS connections, MAX_CONNECTIONS_PER_USER of them one
user's (the kernel's uid, SO_PEERCRED: one user's flood of `kvtrace run`s leaves the others their places; more
are refused, counted and named: kvtrace_share_refused_total{resource="cupti_connections"}, the component's
reason), each
read is at most READ_BYTES, a message at most protocol.MAX_BODY_BYTES, and a decoder's joins, held records,
stacks and live objects are bounded (decode.py). Anything malformed closes that connection only, counted
(cupti_protocol_errors); the thread never stops for one, and never blocks on a socket (non-blocking,
selectors). What a connection holds is dropped when it closes; its traced memory stays in the Session
(the process's exit, or the recording's end, says what became of it).
"""
from __future__ import annotations

import errno
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtrace.model.crosscheck import TracerStatus
from kvtrace.model.depth import ProcessDepth
from kvtrace.model.events import Event, EventsLost, StackStatus
from kvtrace.model.user_shares import UserShares
from kvtrace.session import Record, Session
from kvtrace.sources import unix_socket
from kvtrace.sources.cupti import protocol
from kvtrace.sources.cupti.decode import CuptiDecoder, DecoderCounters, Output, StackDefinition
from kvtrace.sources.unix_socket import UCRED, ListenerSetupError

log = logging.getLogger(__name__)

COMPONENT = "cupti"
SOCKET_MODE = 0o666  # any local process may report, about itself only (see the module's docstring)
DIRECTORY_MODE = 0o755  # a directory the listener creates: others must reach the socket inside
MAX_CONNECTIONS = 256  # traced processes connected at once
MAX_CONNECTIONS_PER_USER = 64  # of those, one user's: the rest are the other users' reserve
SHARE_RESOURCE = "cupti_connections"
MAX_PROCESSES_KEPT = 4096  # what each process said, kept for `kvtrace run`'s summary
READ_BYTES = 256 << 10  # one read of one connection: the others get their turn
ACCEPTS_PER_TURN = 64
TICK_SECONDS = 0.25  # held records are applied and counters reported this often
BACKLOG = 64
WARNING_INTERVAL_SECONDS = 60.0



def check_socket_path(path: str, flag: str = "--cupti-socket") -> None:
    """Refuses, with one line, a path that could never be bound or would replace something else."""
    unix_socket.check_socket_path(path, flag, "traced processes find", "kvtrace")


def socket_accepts(path: str) -> bool:
    """Whether something listens on the stream socket at `path` (connects, and hangs up at once)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


@dataclass
class TracedProcess:
    """What one process's tracer said, for `kvtrace run`'s summary."""

    pid: int
    status: TracerStatus | None = None  # its last STATUS (None: it sent none)
    events: int = 0
    error: str = ""  # why kvtrace closed its connection ("" : the process closed it)
    connected: bool = True


@dataclass
class _Connection:
    sock: socket.socket
    pid: int
    uid: int = 0  # the kernel's (SO_PEERCRED): whose share the connection is
    stream: protocol.Decoder = field(default_factory=protocol.Decoder)
    decoder: CuptiDecoder = field(init=False)
    stacks: dict[int, int] = field(default_factory=dict)  # the process's stack id -> the Session's
    clock: Callable[[], float] = time.monotonic
    fd: int = field(init=False)
    closed: bool = False

    def __post_init__(self) -> None:
        self.decoder = CuptiDecoder(self.pid, self.clock)
        self.fd = self.sock.fileno()


class CuptiListener:
    """Binds the tracers' stream socket and feeds what they send to the Session, in a thread."""

    def __init__(self, session: Session, path: str = protocol.DEFAULT_AGENT_SOCKET,
                 max_connections: int = MAX_CONNECTIONS, socket_mode: int = SOCKET_MODE,
                 directory_mode: int = DIRECTORY_MODE, flag: str = "--cupti-socket",
                 clock: Callable[[], float] = time.monotonic,
                 max_connections_per_user: int = MAX_CONNECTIONS_PER_USER) -> None:
        self.session = session
        self.path = path
        self.max_connections = max_connections
        self.shares = UserShares(SHARE_RESOURCE, max_connections, min(max_connections_per_user, max_connections),
                                 "connections")
        self._reach = ""
        self._reported_reason: str | None = None
        self._failed = False
        self.socket_mode = socket_mode
        self.directory_mode = directory_mode
        self.flag = flag
        self._clock = clock
        self.connections_total = 0
        self.refused = 0  # over max_connections, or a peer with no pid here
        self.protocol_errors = 0
        self.events = 0
        self.lost = 0
        self.last_error = ""
        self.processes: dict[int, TracedProcess] = {}  # by pid, oldest first, at most MAX_PROCESSES_KEPT
        self._closed_counters = DecoderCounters()  # of connections gone
        self._connections: dict[int, _Connection] = {}  # by file descriptor
        self._socket: socket.socket | None = None
        self._inode = 0
        self._selector: selectors.BaseSelector | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._next_warning = 0.0

    # ---- life cycle ----

    def start(self) -> bool:
        """Binds and starts; False when it cannot bind (the component says why, and the caller goes on)."""
        try:
            self._bind()
        except ListenerSetupError as error:
            log.warning("CUPTI tracers' reports are off: %s", error)
            self.session.report_component(COMPONENT, False, str(error))
            return False
        reach = self._reach = self._reach_warning() if self.socket_mode & 0o007 else ""
        if reach:
            log.warning("%s", reach)
        self._report_counters()
        self._thread = threading.Thread(target=self._run, name="kvtrace-cupti-listener", daemon=True)
        self._thread.start()
        return True

    def stop(self, timeout_seconds: float = 5.0) -> None:
        """Takes what the connected tracers still send, applies what their decoders hold, closes every
        connection and the socket, and removes the socket's file (if still ours)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_seconds)
            self._thread = None
        if self._socket is not None:
            self._socket.close()
            self._socket = None
            unix_socket.remove_own(self.path, self._inode)

    @property
    def open_connections(self) -> int:
        return len(self._connections)

    def wait_idle(self, timeout_seconds: float) -> bool:
        """Waits up to `timeout_seconds` for every connection to close (the tracers' last flush at exit);
        True when none is left."""
        deadline = time.monotonic() + timeout_seconds
        while self._connections and time.monotonic() < deadline:
            time.sleep(0.02)
        return not self._connections

    def _bind(self) -> None:
        check_socket_path(self.path, self.flag)
        sock, self._inode = unix_socket.bind_socket(
            self.path, socket.SOCK_STREAM, self.socket_mode, self.directory_mode, self.flag,
            "the CUPTI tracers' socket", backlog=BACKLOG, off_hint=self.flag == "--cupti-socket")
        sock.setblocking(False)
        self._socket = sock

    def _reach_warning(self) -> str:
        """Why processes of another user cannot reach the socket ("" when they can)."""
        found = unix_socket.unsearchable_directory(self.path)
        if found is None:
            return ""
        part, mode = found
        return (f"{part} is mode {mode:04o}: processes of users other than root and its group "
                f"cannot reach {self.path} (make it searchable by others, chmod o+x)")

    # ---- the thread ----

    def _run(self) -> None:
        assert self._socket is not None
        selector = self._selector = selectors.DefaultSelector()
        selector.register(self._socket, selectors.EVENT_READ, None)
        next_tick = self._clock() + TICK_SECONDS
        try:
            while not self._stop.is_set():
                for key, _ in selector.select(TICK_SECONDS):
                    if key.data is None:
                        self._accept()
                    else:
                        self._read(key.data)
                if self._clock() >= next_tick:
                    next_tick = self._clock() + TICK_SECONDS
                    for connection in list(self._connections.values()):
                        self._expire(connection)
                    self._report_counters()
        except Exception:  # a bug: say so, and close what is open (its records kept) rather than die silently
            log.exception("the CUPTI listener failed")
            self._reported_reason = None  # down stays down: no "up" over it
            self._failed = True
            self.session.report_component(COMPONENT, False, "the listener's thread failed (see the agent's log)")
        finally:
            for connection in list(self._connections.values()):
                self._read_rest(connection)
                self._close(connection, "")
            selector.close()
            self._selector = None
            self._report_counters()

    def _accept(self) -> None:
        assert self._socket is not None and self._selector is not None
        for _ in range(ACCEPTS_PER_TURN):
            try:
                sock, _ = self._socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as error:  # out of descriptors: the peer waits in the backlog
                self._warn(f"cannot accept a CUPTI tracer's connection: {error.strerror}")
                return
            try:
                pid, uid, _ = UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, UCRED.size))
            except OSError:
                pid = uid = 0
            if pid <= 0 or not self.shares.admits(uid):
                self.refused += 1
                if pid > 0:
                    self.shares.refuse(uid)
                self._warn(f"refused a CUPTI tracer's connection (pid {pid}): " + (
                    "its pid is not visible here (another pid namespace)" if pid <= 0
                    else self.shares.full_for(uid)))
                sock.close()
                continue
            sock.setblocking(False)
            connection = _Connection(sock, pid, uid, clock=self._clock)
            self.shares.take(uid)
            self._connections[connection.fd] = connection
            self._selector.register(sock, selectors.EVENT_READ, connection)
            self.connections_total += 1

    def _read(self, connection: _Connection) -> None:
        try:
            data = connection.sock.recv(READ_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as error:  # reset by the peer: it is gone
            self._close(connection, "" if error.errno == errno.ECONNRESET else f"read failed: {error.strerror}")
            return
        if not data:
            self._close(connection, "")
            return
        self._take(connection, data)

    def _read_rest(self, connection: _Connection) -> None:
        """At stop: what the connection's socket already holds (bounded), before it is closed."""
        for _ in range(64):
            if connection.closed:
                return
            try:
                data = connection.sock.recv(READ_BYTES)
            except OSError:
                return
            if not data or not self._take(connection, data):
                return

    def _take(self, connection: _Connection, data: bytes) -> bool:
        """Decodes and delivers `data`; False when it closed the connection (malformed)."""
        outputs: list[Output] = []
        error = ""
        try:
            for kind, body in connection.stream.feed(data):
                outputs += connection.decoder.feed(kind, body)
        except protocol.ProtocolError as problem:
            self.protocol_errors += 1
            error = f"protocol error: {problem}"
        except Exception as problem:  # a bug in decoding: this connection ends, the others go on
            log.debug("decoding a CUPTI tracer's message failed", exc_info=True)
            self.protocol_errors += 1
            error = f"internal error: {problem!r}"
        self._deliver(connection, outputs)
        if error:
            self._warn(f"closed pid {connection.pid}'s CUPTI connection: {error}")
            self._close(connection, error)
            return False
        return True

    def _expire(self, connection: _Connection) -> None:
        try:
            outputs = connection.decoder.expire()
        except protocol.ProtocolError as problem:
            self.protocol_errors += 1
            self._close(connection, f"protocol error: {problem}")
            return
        if outputs:
            self._deliver(connection, outputs)

    def _close(self, connection: _Connection, error: str) -> None:
        if connection.closed:
            return
        connection.closed = True
        try:
            self._finish(connection, error)
        finally:
            # Last: wait_idle() sees a connection gone only once everything it sent is in the Session.
            del self._connections[connection.fd]
            self._report_counters()

    def _finish(self, connection: _Connection, error: str) -> None:
        if self._selector is not None:
            try:
                self._selector.unregister(connection.sock)
            except (KeyError, ValueError):
                pass
        connection.sock.close()
        self.shares.give_back(connection.uid)
        decoder = connection.decoder
        try:
            outputs = decoder.finish()
        except Exception:  # a bug: what it held is lost, the listener goes on
            log.debug("finishing a CUPTI decoder failed", exc_info=True)
            outputs = []
        self._deliver(connection, outputs)
        counters = decoder.counters.as_dict()
        for name, value in counters.items():
            setattr(self._closed_counters, name, getattr(self._closed_counters, name) + value)
        if decoder.hello is None:
            return  # a probe (`kvtrace run` looking for the agent), or a peer that never spoke
        last = decoder.status
        self.session.report_tracer(TracerStatus(
            connection.pid, "gone", error, last.holder if last is not None else "",
            dict(last.counters) if last is not None else {}, time.time_ns(),
            stopped_ns=(last.stopped_ns if last is not None and last.stopped_ns else decoder.newest_ns)))
        process = self._process(connection.pid)
        process.connected = False
        if error:  # the first reason stays (a pid may have had more than one connection)
            process.error = process.error or error

    def _deliver(self, connection: _Connection, outputs: list[Output]) -> None:
        """The decoder's records to the Session, in order: events in batches, stacks interned (ids rewritten
        to the Session's), a status between the events before and after it."""
        batch: list[Record] = []
        events = 0
        for output in outputs:
            if type(output) is Event:
                if output.stack_id:
                    session_id = connection.stacks.get(output.stack_id)
                    if session_id is None:
                        output.stack_id, output.stack_status = 0, StackStatus.UNRESOLVED
                    else:
                        output.stack_id = session_id
                batch.append(output)
                events += 1
            elif type(output) is EventsLost:
                self.lost += output.count
                batch.append(output)
            elif type(output) is StackDefinition:
                # Where CUPTI is the uprobes' witness its events never reach the ledger: neither do its stacks
                # (the Session's table only grows, and any local user may send them).
                if not self.session.cupti_witness:
                    connection.stacks[output.stack_id] = self.session.intern_stack(output.stack)
            elif type(output) is ProcessDepth:
                # kvtrace run's recorder: every block's stack (where the uprobes trace, the agent decides depths)
                if not self.session.cupti_witness:
                    if batch:
                        self.session.ingest_many(batch)
                        batch = []
                    self.session.set_process_depth(output)
            elif type(output) is TracerStatus:
                if batch:
                    self.session.ingest_many(batch)
                    batch = []
                self.session.report_tracer(output)
                if output.state != "connected":
                    self._process(connection.pid).status = output
        if batch:
            self.session.ingest_many(batch)
        if events:
            self.events += events
            self._process(connection.pid).events += events

    def _process(self, pid: int) -> TracedProcess:
        process = self.processes.get(pid)
        if process is None:
            process = self.processes[pid] = TracedProcess(pid)
            while len(self.processes) > MAX_PROCESSES_KEPT:
                del self.processes[next(iter(self.processes))]
        return process

    def _warn(self, message: str) -> None:
        self.last_error = message
        log.debug("%s", message)
        now = time.monotonic()
        if now >= self._next_warning:
            self._next_warning = now + WARNING_INTERVAL_SECONDS
            log.warning("%s", message)

    def counters(self) -> dict[str, int]:
        totals = DecoderCounters(**self._closed_counters.as_dict())
        for connection in list(self._connections.values()):
            for name, value in connection.decoder.counters.as_dict().items():
                setattr(totals, name, getattr(totals, name) + value)
        return {"cupti_connections": self.connections_total, "cupti_connections_open": len(self._connections),
                "cupti_connections_refused": self.refused, "cupti_protocol_errors": self.protocol_errors,
                "cupti_events": self.events, "cupti_lost": self.lost, "cupti_unjoined": totals.unjoined,
                "cupti_stale": totals.stale, "cupti_late": totals.late, "cupti_untracked": totals.untracked,
                "cupti_stacks_refused": totals.stacks_refused}

    def _report_counters(self) -> None:
        self.session.report_counters({**self.counters(), **self.shares.counters()})
        # Up, and when a user was refused at its share, who and why (doctor shows it).
        reason = "; ".join(part for part in (self._reach, self.shares.describe()) if part)
        if reason != self._reported_reason and not self._failed:
            self._reported_reason = reason
            self.session.report_component(COMPONENT, True, reason)
