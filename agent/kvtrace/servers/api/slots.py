"""Stream slots: how many event streams a socket serves at once, and which one gives way.

Each endpoint has its own StreamSlots (issue 31: 64 idle streams from one member of the group once locked root
out of `kvtrace tail` on the admin socket): the admin socket and TCP share one set, the group socket has its
own, and on the group socket each user holds at most a share of the connections (peers.py, the kernel's uid),
each carrying at most a few streams. When every slot is taken, a stream that does not read gives way:

- one blocked in gRPC's send for evict_stalled_seconds (its client's window is full) is ended at once;
- on a quiet host nothing fills the windows (gRPC absorbs about 5 MiB a stream unread), so streams quiet for
  probe_quiet_seconds are *probed*: their handler sends probe_bytes of filler, more than the windows and the
  socket's buffers hold. A client that reads takes it in milliseconds; one that does not blocks the send, and
  blocked probe_stall_seconds it is ended with RESOURCE_EXHAUSTED ("you did not read for N s"). The new stream
  waits up to probe_wait_seconds for that, and is refused only when every stream reads.

The filler is a StreamEventsResponse with no events and one field no kvtrace.v1 message has (PROBE_FIELD, the
largest field number protobuf allows): every protobuf reader skips unknown fields, so a client sees an empty
response. Probes cost a reader probe_bytes at most once a probe_again_seconds, and only while the slots are full.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import grpc

from kvtrace._proto.kvtrace.v1 import agent_service_pb2 as service_pb2
from kvtrace.servers.api.peers import ConnectionShares
from kvtrace.servers.api.requests import ServerLimits
from kvtrace.servers.hub import Subscription

log = logging.getLogger(__name__)

PROBE_FIELD = (1 << 29) - 1  # the largest field number: never one of kvtrace.v1's (unknown fields are skipped)
PROBE_MESSAGE_BYTES = 64 << 10
WAIT_STEP_SECONDS = 0.05


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def probe_response(view: service_pb2.View, size_bytes: int = PROBE_MESSAGE_BYTES) -> service_pb2.StreamEventsResponse:
    """An empty response carrying `size_bytes` of filler in an unknown field (kept when serialized again)."""
    filler = _varint(PROBE_FIELD << 3 | 2) + _varint(size_bytes) + bytes(size_bytes)
    return service_pb2.StreamEventsResponse.FromString(
        service_pb2.StreamEventsResponse(view=view).SerializeToString() + filler)


def _end_stalled(context: grpc.ServicerContext, details: str) -> None:
    """Ends another thread's stream with RESOURCE_EXHAUSTED and why. Its handler is blocked in
    gRPC's send (the client does not read), so abort() is not an option; the call underneath
    takes a status where ServicerContext.cancel() can only say CANCELLED."""
    call = getattr(getattr(context, "_rpc_event", None), "call", None)
    try:
        call.cancel(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], details)  # type: ignore[union-attr]
    except Exception:  # another grpc: still end it
        context.cancel()


@dataclass
class _Stream:
    context: grpc.ServicerContext
    last_sent: float  # monotonic: its last response handed to gRPC (or its start)
    probe_asked: float = 0.0  # monotonic: when a probe was asked (0: none pending)
    probing_since: float = 0.0  # monotonic: its handler began sending the filler (0: not now)
    probed: float = 0.0  # monotonic: its last probe went through (it reads)


class StreamSlots:
    """The event streams of one endpoint, at most `limits.max_streams`; `connections`: the group socket's
    shares per user, enforced as streams open."""

    def __init__(self, limits: ServerLimits, name: str = "admin", connections: ConnectionShares | None = None) -> None:
        self._limits = limits
        self.name = name  # which socket's: "admin" (admin and TCP), "group"
        self.connections = connections
        self._lock = threading.Lock()
        self._streams: dict[Subscription, _Stream] = {}
        self.evicted_total = 0
        self.refused_total = 0
        self.probes_total = 0

    def open(self, subscription: Subscription, context: grpc.ServicerContext) -> bool:
        """Takes a slot for the stream; False when every slot holds a stream that reads."""
        if self.connections is not None:
            self.connections.enforce()  # a user's connections beyond its share end here, their streams with them
        deadline = time.monotonic() + self._limits.probe_wait_seconds
        while True:
            with self._lock:
                now = time.monotonic()
                if len(self._streams) < self._limits.max_streams:
                    self._streams[subscription] = _Stream(context, now)
                    return True
                victim, stalled = self._victim(now)
                if victim is not None:
                    victim_stream = self._streams.pop(victim)
                    self._streams[subscription] = _Stream(context, now)
                    self.evicted_total += 1
                else:
                    probing = self._ask_probes(now)
            if victim is not None:
                self._evict(victim, victim_stream, stalled)
                return True
            if not probing or time.monotonic() >= deadline or not context.is_active():
                self.refused_total += 1
                return False
            time.sleep(WAIT_STEP_SECONDS)

    def _victim(self, now: float) -> tuple[Subscription | None, float]:
        """The stream that does not read, longest: blocked in its send evict_stalled_seconds, or
        probe_stall_seconds while sending a probe's filler. Holds the lock."""
        best, best_stalled = None, 0.0
        for subscription, stream in self._streams.items():
            stalled = subscription.stalled_seconds(now)
            limit = self._limits.probe_stall_seconds if stream.probing_since else self._limits.evict_stalled_seconds
            if stalled >= limit and stalled > best_stalled:
                best, best_stalled = subscription, stalled
        return best, best_stalled

    def _ask_probes(self, now: float) -> bool:
        """Asks the quiet streams (the quiet longest first, at most max_probes at once) to send a probe; whether
        any probe is pending. Holds the lock."""
        limits = self._limits
        pending = sum(1 for stream in self._streams.values() if stream.probe_asked or stream.probing_since)
        quiet = sorted((stream.last_sent, id(stream), stream) for stream in self._streams.values()
                       if not stream.probe_asked and not stream.probing_since
                       and now - stream.last_sent >= limits.probe_quiet_seconds
                       and (not stream.probed or now - stream.probed >= limits.probe_again_seconds))
        for _, _, stream in quiet[:max(0, limits.max_probes - pending)]:
            stream.probe_asked = now
            pending += 1
            self.probes_total += 1
        return pending > 0

    def _evict(self, victim: Subscription, stream: _Stream, stalled: float) -> None:
        why = "its probe" if stream.probing_since else "events"
        log.warning("ending an event stream on the %s socket that did not read %s for %.0f s: all %d slots were "
                    "taken", self.name, why, stalled, self._limits.max_streams)
        victim.evicted_reason = (f"you did not read for {stalled:.0f} s and the agent's "
                                 f"{self._limits.max_streams} stream slots were all taken")
        victim.close()
        _end_stalled(stream.context, victim.evicted_reason)

    # ---- the stream's own handler ----

    def sent(self, subscription: Subscription) -> None:
        """The handler handed a response to gRPC."""
        stream = self._streams.get(subscription)
        if stream is not None:
            stream.last_sent = time.monotonic()

    def probe_due(self, subscription: Subscription) -> int:
        """Bytes of filler the handler is to send now (0: none); the probe counts as begun."""
        with self._lock:
            stream = self._streams.get(subscription)
            if stream is None or not stream.probe_asked:
                return 0
            stream.probe_asked, stream.probing_since = 0.0, time.monotonic()
            return self._limits.probe_bytes

    def probe_done(self, subscription: Subscription) -> None:
        """Every byte of the probe went into gRPC: the client reads."""
        with self._lock:
            stream = self._streams.get(subscription)
            if stream is not None:
                stream.probing_since, stream.probed = 0.0, time.monotonic()

    def close(self, subscription: Subscription) -> None:
        with self._lock:
            self._streams.pop(subscription, None)

    def __len__(self) -> int:
        return len(self._streams)
