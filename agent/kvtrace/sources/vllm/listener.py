"""The agent's end of the in-engine plugin: a Unix datagram socket the plugin (plugin.py, inside vLLM)
sends its reports to, each one checked and turned into a model record for the Session.

    plugin (in vLLM) ──JSON datagram──▶ VllmListener ──KvCacheLayout | SchedulerReport | SleepReport──▶ Session

Who may send, and why that is safe: the socket is mode 0666, so any local process may report (vLLM runs
as whatever user the operator chose; the agent cannot know it in advance). But a process can only report
about itself: the sender's pid is the kernel's (SO_PASSCRED: SCM_CREDENTIALS on every datagram, the pid
as the agent's pid namespace sees it), never a field of the message, so a process can make kvtrace
believe wrong things only about its own KV cache. What a sender can cost is bounded: a datagram is at
most protocol.MAX_DATAGRAM_BYTES (a longer one is cut by the kernel and dropped here), every field is
checked against protocol's limits (list lengths, ranges, request ids cut to MAX_REQUEST_ID_CHARS) before
anything is kept, each pid may send MAX_MESSAGES_PER_SECOND_PER_PID messages a second (more are dropped
and counted), the Session keeps one layout, one scheduler report and a few sleep reports per pid, and at
most MAX_SENDERS live processes are followed at once (a process that is gone frees its place and its
records). A bad message is dropped and counted (vllm_messages_rejected), never an exception out of the
receiving thread; the reason is logged at debug, and at most one warning a minute says messages are being
dropped.

Shares, not a common pool (issue 31): each user (the kernel's uid of the sender) may hold at most
MAX_SENDERS_PER_USER of the places, so one user's flood of processes leaves the others' places alone. A
newcomer over its user's share is dropped before its message is decoded (counted and named:
kvtrace_share_refused_total{resource="vllm_senders"}, the component's reason), unless one of that user's
own senders has been silent SILENT_SECONDS (the plugin reports every second: a silent one is no live
engine's) or the kernel ties the newcomer to vLLM and the place is a stranger's (model/vllm.py's vllm_tie,
the analysis's rule): then that one gives its place. Its scheduler and sleep reports go, its KV layout
stays while the process lives (the plugin sent it once; an engine's layout survives the eviction of its
sender state). What a sender's reports mean is not decided here: analysis/vllm.py counts them as an
engine's only when the kernel ties the sender to vLLM (the same vllm_tie).

The socket's directory must be reachable (search permission) by the vLLM processes' user. It is a
directory of its own (/run/kvtrace-vllm, 0755), apart from the API's /run/kvtrace (0750 root:kvtrace), so
that vLLM processes, and pods that mount it, reach the plugin's socket and not the API sockets. A
directory on the way that others cannot search is named in the component's reason.
"""
from __future__ import annotations

import json
import logging
import math
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvtrace.model.events import PHYSICAL_LAYERS, Memory
from kvtrace.model.user_shares import UserShares
from kvtrace.model.vllm import (
    KvCacheLayout,
    KvRequest,
    KvTensor,
    RequestState,
    SchedulerReport,
    SleepPool,
    SleepReport,
    gpu_holders,
    vllm_tie,
)
from kvtrace.session import Session
from kvtrace.sources import unix_socket
from kvtrace.sources.procfs import start_ticks
from kvtrace.sources.unix_socket import UCRED, ListenerSetupError
from kvtrace.sources.vllm import protocol

log = logging.getLogger(__name__)

COMPONENT = "vllm_plugin"
SOCKET_MODE = 0o666  # any local process may report, about itself only (see the module's docstring)
DIRECTORY_MODE = 0o755  # a directory the listener creates: others must reach the socket inside
MAX_MESSAGES_PER_SECOND_PER_PID = 10  # the plugin sends about 1 a second (protocol.REPORT_INTERVAL_SECONDS)
MAX_SENDERS = 256  # live processes followed at once; a vLLM host has a few per GPU
MAX_SENDERS_PER_USER = 32  # of those, one user's (by the kernel's uid): the rest are the other users' reserve
SILENT_SECONDS = 30.0  # a sender silent this long gives its place to its user's newcomer
SHARE_RESOURCE = "vllm_senders"
SENDER_SWEEP_SECONDS = 5.0  # how often senders that are gone are forgotten
REPORT_SECONDS = 0.25  # the component's reason is worded at most this often
WARNING_INTERVAL_SECONDS = 60.0
RECEIVE_BUFFER_BYTES = 4 << 20  # asked of the kernel (capped by net.core.rmem_max): bursts wait there
POLL_SECONDS = 0.1  # the receiving thread looks at its stop flag this often
MAX_TAG_CHARS = 64  # a CuMemAllocator tag ("weights", "kv_cache")
MAX_INT = (1 << 63) - 1
MAX_ADDRESS = (1 << 64) - 1
MAX_COUNT = (1 << 31) - 1  # blocks, requests, devices: far beyond any engine, far below what breaks sums

_STATES = {name: RequestState[name.upper()] for name in protocol.REQUEST_STATES}


class MessageError(ValueError):
    """A datagram that is not a valid plugin message; the message says which field and why."""


def check_socket_path(path: str, flag: str = "--vllm-socket") -> None:
    """Refuses, with one line, a path the listener could never bind or would have to replace."""
    unix_socket.check_socket_path(path, flag, "the plugin finds", "the agent")


# ---- decoding: bytes -> model record (pure; MessageError on anything wrong) ----


def decode_message(data: bytes, pid: int, timestamp_ns: int) -> KvCacheLayout | SchedulerReport | SleepReport:
    """One datagram as the record it reports, stamped with the sender's (kernel-given) pid and the time
    of receipt. Unknown keys are ignored (a newer plugin may add some within one version)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise MessageError(f"not UTF-8 text (byte {error.start})") from None
    try:
        message = json.loads(text)
    except (ValueError, RecursionError) as error:  # ValueError: bad JSON, or an integer of 4300+ digits
        raise MessageError(f"not JSON: {str(error)[:80]}") from None
    if type(message) is not dict:
        raise MessageError(f"not a JSON object but {_json_type(message)}")
    version = message.get("v")
    if type(version) is not int or version != protocol.VERSION:
        raise MessageError(f"protocol version {version!r:.20}, not {protocol.VERSION} (plugin and agent from "
                           "different kvtrace releases: install the same one in both)")
    kind = message.get("type")
    if kind == protocol.TYPE_SCHEDULER:
        return _scheduler(message, pid, timestamp_ns)
    if kind == protocol.TYPE_KV_CACHE:
        return _kv_cache(message, pid, timestamp_ns)
    if kind == protocol.TYPE_SLEEP:
        return _sleep(message, pid, timestamp_ns)
    raise MessageError(f"unknown type {kind!r:.40}")


def _kv_cache(message: dict[str, Any], pid: int, timestamp_ns: int) -> KvCacheLayout:
    tensors = []
    for index, entry in enumerate(_list(message, "tensors", protocol.MAX_TENSORS, minimum=1)):
        address, size_bytes = _entry(entry, "tensors", index, 2)
        tensors.append(KvTensor(_int_value(address, f"tensors[{index}] address", 1, MAX_ADDRESS),
                                _int_value(size_bytes, f"tensors[{index}] size_bytes", 1, MAX_INT)))
    return KvCacheLayout(pid, timestamp_ns, device=_int(message, "device", 0, 4095), tensors=tuple(tensors),
                         num_blocks=_int(message, "num_blocks", 1, MAX_COUNT),
                         page_size_bytes=_int(message, "page_size_bytes", 1, MAX_INT),
                         block_size_tokens=_int(message, "block_size", 1, MAX_COUNT))


def _scheduler(message: dict[str, Any], pid: int, timestamp_ns: int) -> SchedulerReport:
    blocks_total = _int(message, "blocks_total", 0, MAX_COUNT)
    requests = []
    for index, entry in enumerate(_list(message, "requests", protocol.MAX_REQUESTS_PER_REPORT)):
        request_id, state_name, blocks, age = _entry(entry, "requests", index, 4)
        state = _STATES.get(state_name) if type(state_name) is str else None
        if state is None:
            raise MessageError(f"requests[{index}] state {state_name!r:.40} is not one of "
                               f"{', '.join(protocol.REQUEST_STATES)}")
        if age is not None:
            if type(age) not in (int, float) or not math.isfinite(age) or age < 0:
                raise MessageError(f"requests[{index}] done_age_seconds must be a number >= 0 or null")
        requests.append(KvRequest(_text(request_id, f"requests[{index}] request id", protocol.MAX_REQUEST_ID_CHARS),
                                  state, _int_value(blocks, f"requests[{index}] blocks", 0, MAX_COUNT),
                                  # The model's age is None while the request is not done.
                                  float(age) if age is not None and state.done else None))
    omitted = message.get("requests_omitted", 0)
    return SchedulerReport(pid, timestamp_ns, blocks_total=blocks_total,
                           blocks_free=_int(message, "blocks_free", 0, blocks_total),
                           running=_int(message, "running", 0, MAX_COUNT),
                           waiting=_int(message, "waiting", 0, MAX_COUNT),
                           blocks_allocated_total=_int(message, "allocated_total", 0, MAX_INT),
                           blocks_freed_total=_int(message, "freed_total", 0, MAX_INT),
                           requests=tuple(requests),
                           requests_omitted=_int_value(omitted, "requests_omitted", 0, MAX_COUNT))


def _sleep(message: dict[str, Any], pid: int, timestamp_ns: int) -> SleepReport:
    pools = []
    for index, entry in enumerate(_list(message, "pools", protocol.MAX_POOLS)):
        tag, size_bytes, mapped_bytes = _entry(entry, "pools", index, 3)
        size_bytes = _int_value(size_bytes, f"pools[{index}] size_bytes", 0, MAX_INT)
        pools.append(SleepPool(_text(tag, f"pools[{index}] tag", MAX_TAG_CHARS), size_bytes,
                               _int_value(mapped_bytes, f"pools[{index}] mapped_bytes", 0, size_bytes)))
    return SleepReport(pid, timestamp_ns, level=_int(message, "level", 0, 2), pools=tuple(pools))


def _json_type(value: object) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number"}.get(type(value), "null")


def _int(message: dict[str, Any], key: str, low: int, high: int) -> int:
    if key not in message:
        raise MessageError(f"{key} is missing")
    return _int_value(message[key], key, low, high)


def _int_value(value: object, name: str, low: int, high: int) -> int:
    # `type(...) is int`: JSON's true/false are bools, which Python counts as ints.
    if type(value) is not int or not low <= value <= high:
        raise MessageError(f"{name} must be an integer from {low} to {high}, not {_json_type(value)} "
                           f"{str(value)[:24]}")
    return value


def _list(message: dict[str, Any], key: str, maximum: int, minimum: int = 0) -> list[Any]:
    value = message.get(key)
    if type(value) is not list:
        raise MessageError(f"{key} must be a list, not {_json_type(value)}")
    if not minimum <= len(value) <= maximum:
        raise MessageError(f"{key} has {len(value)} entries; the protocol allows {minimum} to {maximum}")
    return value


def _entry(value: object, key: str, index: int, size: int) -> list[Any]:
    if type(value) is not list or len(value) != size:
        raise MessageError(f"{key}[{index}] must be a list of {size}")
    return value


def _text(value: object, name: str, max_chars: int) -> str:
    """Text every consumer takes: unprintable characters (controls, lone surrogates from a JSON
    \\ud800 escape) written as escapes, then cut to `max_chars`."""
    if type(value) is not str or not value:
        raise MessageError(f"{name} must be non-empty text")
    if not value.isprintable():
        value = "".join(char if char.isprintable() else char.encode("unicode_escape").decode("ascii")
                        for char in value[:max_chars])
    return value[:max_chars]


# ---- the socket ----


@dataclass
class _Sender:
    """A process that reports: its identity (to notice it is gone) and its rate window."""

    start_ticks: int | None  # with the pid, the process's identity (procfs.start_ticks); None: unreadable
    window_start: float  # monotonic start of the current one-second window
    count: int = 0
    last_seen: float = 0.0  # monotonic: its last report taken
    uid: int = 0  # the kernel's (SCM_CREDENTIALS): whose share the place is


class VllmListener:
    """Binds the plugin's datagram socket and turns each report into a Session record, in a thread."""

    def __init__(self, session: Session, path: str = protocol.DEFAULT_SOCKET,
                 max_messages_per_second_per_pid: int = MAX_MESSAGES_PER_SECOND_PER_PID,
                 max_senders: int = MAX_SENDERS, socket_mode: int = SOCKET_MODE,
                 max_senders_per_user: int = MAX_SENDERS_PER_USER) -> None:
        self.session = session
        self.path = path
        self.max_messages_per_second_per_pid = max_messages_per_second_per_pid
        self.max_senders = max_senders
        self.shares = UserShares(SHARE_RESOURCE, max_senders, min(max_senders_per_user, max_senders), "senders")
        self.evicted = 0  # senders that gave their place to a newcomer
        self.socket_mode = socket_mode
        self.received = 0  # every datagram read, good or not
        self.rejected = 0  # of those, dropped (bad, no credentials, over the rate, too many senders)
        self.last_rejection = ""
        self._senders: dict[int, _Sender] = {}
        # Evicted senders whose KV layout the Session keeps while they live: pid -> start ticks (None: unknown).
        self._layouts_kept: dict[int, int | None] = {}
        self._reach = ""  # why others cannot reach the socket ("" when they can), in the component's reason
        self._reported_reason: str | None = None
        self._next_sweep = 0.0
        self._next_full_sweep = 0.0
        self._next_report = 0.0
        self._next_warning = 0.0
        self._socket: socket.socket | None = None
        self._inode = 0  # of the socket file we bound: stop() removes only that one
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- life cycle ----

    def start(self) -> bool:
        """Binds and starts receiving; False when it cannot bind (the component says why, the agent
        goes on without the plugin's reports)."""
        try:
            self._bind()
        except ListenerSetupError as error:
            log.warning("vLLM plugin reports are off: %s", error)
            self.session.report_component(COMPONENT, False, str(error))
            return False
        reach = self._reach = self._reach_warning()
        if reach:
            log.warning("%s", reach)
        self._report_counters()
        self._thread = threading.Thread(target=self._run, name="kvtrace-vllm-listener", daemon=True)
        self._thread.start()
        return True

    def stop(self, timeout_seconds: float = 1.0) -> None:
        """Stops receiving (within POLL_SECONDS), closes the socket and removes its file (if still ours:
        the plugin then sees no agent and sends nothing)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_seconds)
        if self._socket is not None:
            self._socket.close()
            self._socket = None
            unix_socket.remove_own(self.path, self._inode)

    def _bind(self) -> None:
        check_socket_path(self.path)

        def configure(sock: socket.socket) -> None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER_BYTES)
            except OSError:
                pass  # the default buffer still works; bursts beyond it are lost by the sender (nonblocking)

        sock, self._inode = unix_socket.bind_socket(self.path, socket.SOCK_DGRAM, self.socket_mode, DIRECTORY_MODE,
                                                    "--vllm-socket", "the vLLM plugin's socket", configure)
        sock.settimeout(POLL_SECONDS)
        self._socket = sock

    def _reach_warning(self) -> str:
        """Why processes of another user cannot reach the socket ("" when they can): a directory on the
        way that others may not search."""
        found = unix_socket.unsearchable_directory(self.path)
        if found is None:
            return ""
        part, mode = found
        return (f"{part} is mode {mode:04o}: vLLM processes of users other than root and "
                f"its group cannot reach {self.path} (make it searchable by others, chmod o+x; the "
                "packaged unit makes /run/kvtrace-vllm 0755)")

    # ---- receiving ----

    def _run(self) -> None:
        sock = self._socket
        assert sock is not None
        buffer = bytearray(protocol.MAX_DATAGRAM_BYTES)
        ancillary_size = socket.CMSG_SPACE(UCRED.size)
        while not self._stop.is_set():
            try:
                size, ancdata, flags, _ = sock.recvmsg_into([buffer], ancillary_size)
            except TimeoutError:
                self._report_counters()
                self._maybe_sweep()
                continue
            except OSError as error:
                if self._stop.is_set():
                    return
                log.warning("vLLM plugin socket: %s", error)
                self._stop.wait(POLL_SECONDS)
                continue
            try:
                self._handle(bytes(buffer[:size]), ancdata, flags)
            except Exception as error:  # a bug here must not end the thread: the message counts as dropped
                log.debug("handling a vLLM plugin message failed", exc_info=True)
                self._reject(f"internal error: {error}", 0)
            self._report_counters()
            self._maybe_sweep()

    def handle_datagram(self, data: bytes, pid: int | None, truncated: bool = False, uid: int = 0) -> None:
        """One datagram from `pid` of user `uid` (pid None: it came without credentials). For tests and `_run`."""
        self.received += 1
        if pid is None or pid <= 0:
            self._reject("no sender credentials (SCM_CREDENTIALS)", 0)
            return
        if truncated:
            self._reject(f"larger than {protocol.MAX_DATAGRAM_BYTES} bytes", pid)
            return
        now = time.monotonic()
        sender = self._senders.get(pid)
        if sender is not None and not self._within_rate(sender, pid, now):
            return
        victim = None
        if sender is None:
            room, victim = self._room_for(pid, uid, now)
            if not room:
                return  # over its user's share: dropped before any decoding (a flood costs a read and a count)
        try:
            record = decode_message(data, pid, time.time_ns())
        except MessageError as error:
            self._reject(str(error), pid)
            return  # a bad report takes no place: the victim keeps its own, and its state
        if sender is None:  # a place only for a process whose report is good
            if victim is not None:
                self._evict(victim)
            sender = self._follow(pid, uid, now)
        sender.last_seen = now
        self.session.ingest(record)

    def _handle(self, data: bytes, ancdata: list[tuple[int, int, bytes]], flags: int) -> None:
        pid = None
        uid = 0
        for level, kind, payload in ancdata:
            if level != socket.SOL_SOCKET:
                continue
            if kind == socket.SCM_CREDENTIALS and len(payload) >= UCRED.size:
                pid, uid, _ = UCRED.unpack_from(payload)
            elif kind == socket.SCM_RIGHTS:  # descriptors someone passed: never kept open
                for fd in struct.unpack(f"{len(payload) // 4}i", payload[:len(payload) // 4 * 4]):
                    try:
                        os.close(fd)
                    except OSError:
                        pass
        self.handle_datagram(data, pid, truncated=bool(flags & socket.MSG_TRUNC), uid=uid)

    def _within_rate(self, sender: _Sender, pid: int, now: float) -> bool:
        """The per-pid rate limit: False (counted) for a message beyond it."""
        if now - sender.window_start >= 1.0:
            sender.window_start, sender.count = now, 0
        sender.count += 1
        if sender.count > self.max_messages_per_second_per_pid:
            self._reject(f"more than {self.max_messages_per_second_per_pid} messages a second", pid)
            return False
        return True

    def _room_for(self, pid: int, uid: int, now: float) -> tuple[bool, int | None]:
        """Whether a new sender of `uid` may have a place: within its user's share with room in the pool, or
        once a sender gives way (the victim, returned: the caller evicts it only when the newcomer's report
        decodes, so a bad datagram costs nobody a place). (False, None), counted against the user and named,
        otherwise."""
        if self.shares.admits(uid):
            return True, None
        if now >= self._next_full_sweep:  # the gone give their places first (once a second: a flood costs no sweeps)
            self._next_full_sweep = now + 1.0
            self._sweep()
            if self.shares.admits(uid):
                return True, None
        victim = self._victim(pid, uid, now)
        if victim is not None:
            return True, victim
        self.shares.refuse(uid)
        self._reject(self.shares.full_for(uid) or "no place", pid, count_only=True)
        return False, None

    def _victim(self, pid: int, uid: int, now: float) -> int | None:
        """Who gives a place to `pid` of `uid`: the longest silent of its user's own senders (of anyone's when
        the pool is full but the user is within its share), if silent SILENT_SECONDS; else, for a newcomer the
        kernel ties to vLLM (traced, titled), the longest silent of those senders that are not."""
        own = self.shares.held[uid] >= self.shares.per_user
        candidates = [(sender.last_seen, known) for known, sender in self._senders.items()
                      if not own or sender.uid == uid]
        if not candidates:
            return None
        last_seen, silent = min(candidates)
        if now - last_seen >= SILENT_SECONDS:
            return silent
        tied = self._vllm_tied()
        if not tied(pid):
            return None
        strangers = [(seen, known) for seen, known in candidates if not tied(known)]
        return min(strangers)[1] if strangers else None

    def _vllm_tied(self) -> Callable[[int], bool]:
        """Whether the kernel ties a pid to vLLM, by the analysis's rule (model/vllm.py's vllm_tie on gpu_holders:
        NVML's list of GPU processes where NVML is up, else traced bytes), from what the Session holds now (no
        /proc read); copied once for a whole look at the senders."""
        processes = self.session.known_processes()
        sample = self.session.nvml_sample()
        if sample is not None and sample.gpus:
            holders = gpu_holders({}, {process.pid for process in sample.processes})
        else:
            traced: dict[tuple[int, int], int] = {}
            for key, (size_bytes, _) in self.session.ledger_counts().totals.items():
                if key.layer in PHYSICAL_LAYERS and key.memory is Memory.DEVICE:
                    traced[(key.pid, key.device)] = traced.get((key.pid, key.device), 0) + size_bytes
            holders = gpu_holders(traced, None)
        return lambda pid: not vllm_tie(pid, processes, holders)

    def _evict(self, pid: int) -> None:
        """`pid` gives its place: its scheduler and sleep reports go; its KV layout stays while it lives."""
        sender = self._senders.pop(pid)
        self.shares.give_back(sender.uid)
        self.evicted += 1
        if self.session.forget_vllm(pid, keep_layout=True):
            self._layouts_kept[pid] = sender.start_ticks
            while len(self._layouts_kept) > self.max_senders:  # bounded: the oldest kept layout goes
                oldest = next(iter(self._layouts_kept))
                del self._layouts_kept[oldest]
                if oldest not in self._senders:
                    self.session.forget_vllm(oldest)
        log.debug("vLLM plugin: pid %d (uid %d) gave its place to a newcomer", pid, sender.uid)

    def _follow(self, pid: int, uid: int, now: float) -> _Sender:
        """A place for a new sender (`_room_for` made sure there is one)."""
        self._layouts_kept.pop(pid, None)
        sender = self._senders[pid] = _Sender(start_ticks(pid), now, count=1, uid=uid)
        self.shares.take(uid)
        return sender

    def _reject(self, reason: str, pid: int, count_only: bool = False) -> None:
        self.rejected += 1
        self.last_rejection = f"pid {pid}: {reason}" if pid else reason
        if not count_only:  # a flood's refusals: counted, no log record each
            log.debug("dropped a vLLM plugin message: %s", self.last_rejection)
        now = time.monotonic()
        if now >= self._next_warning:
            self._next_warning = now + WARNING_INTERVAL_SECONDS
            log.warning("dropping vLLM plugin messages (%d so far, kvtrace_vllm_messages_rejected_total); last: %s",
                        self.rejected, self.last_rejection)

    def _report_counters(self) -> None:
        self.session.report_counters({"vllm_messages_received": self.received,
                                      "vllm_messages_rejected": self.rejected,
                                      "vllm_senders_evicted": self.evicted, **self.shares.counters()})
        # Up, and when a user was refused a place, who and why (doctor shows it): degraded for that user only.
        # Worded a few times a second at most, not per message of a flood.
        now = time.monotonic()
        if now < self._next_report and self._reported_reason is not None:
            return
        self._next_report = now + REPORT_SECONDS
        reason = "; ".join(part for part in (self._reach, self.shares.describe()) if part)
        if reason != self._reported_reason:
            self._reported_reason = reason
            self.session.report_component(COMPONENT, True, reason)

    def _maybe_sweep(self) -> None:
        if time.monotonic() >= self._next_sweep:
            self._sweep()

    def _sweep(self) -> None:
        """Forgets senders that are gone. One whose pid no longer exists has its records dropped from the
        Session too (without the BPF source no exit event would); a pid reused by another process only
        loses its place here, since forgetting it would drop the new process's traced state."""
        self._next_sweep = time.monotonic() + SENDER_SWEEP_SECONDS
        gone = []
        for pid, sender in self._senders.items():
            ticks = start_ticks(pid)
            if ticks is None or (sender.start_ticks is not None and ticks != sender.start_ticks):
                gone.append((pid, ticks is None))
        for pid, kept_ticks in list(self._layouts_kept.items()):
            ticks = start_ticks(pid)
            if ticks is None or (kept_ticks is not None and ticks != kept_ticks):
                del self._layouts_kept[pid]
                self.session.forget_vllm(pid)
        if not gone:
            return
        view = self.session.vllm_view()
        for pid, exited in gone:
            self.shares.give_back(self._senders.pop(pid).uid)
            if exited and (pid in view.layouts or pid in view.schedulers or pid in view.sleeps):
                self.session.forget_process(pid)
