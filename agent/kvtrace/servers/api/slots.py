"""Stream slots: how many event streams the agent serves at once, and which one gives way.

All endpoints' StreamEvents calls share one StreamSlots (the server hands the same one to both
views' servicers), so it lives apart from the service. Unix-socket peers all look alike to gRPC, so
there is no per-client limit to hold; when every slot is taken, the stream that has not read for
longest is ended with RESOURCE_EXHAUSTED, and why, for the new one.
"""
from __future__ import annotations

import logging
import threading
import time

import grpc

from kvtrace.servers.api.requests import ServerLimits
from kvtrace.servers.hub import Subscription

log = logging.getLogger(__name__)


def _end_stalled(context: grpc.ServicerContext, details: str) -> None:
    """Ends another thread's stream with RESOURCE_EXHAUSTED and why. Its handler is blocked in
    gRPC's send (the client does not read), so abort() is not an option; the call underneath
    takes a status where ServicerContext.cancel() can only say CANCELLED."""
    call = getattr(getattr(context, "_rpc_event", None), "call", None)
    try:
        call.cancel(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], details)  # type: ignore[union-attr]
    except Exception:  # another grpc: still end it
        context.cancel()


class StreamSlots:
    """The event streams of every endpoint, at most `max_streams`.

    Unix-socket peers all look alike to gRPC ("unix:"), so a per-client limit cannot be told;
    instead a full house evicts: the stream that has not read for longest, if that is at least
    `evict_stalled_seconds`, is ended with RESOURCE_EXHAUSTED and the new stream takes its slot.
    One client opening streams it never reads can then lock no reader out."""

    def __init__(self, limits: ServerLimits) -> None:
        self._limits = limits
        self._lock = threading.Lock()
        self._streams: dict[Subscription, grpc.ServicerContext] = {}
        self.evicted_total = 0

    def open(self, subscription: Subscription, context: grpc.ServicerContext) -> bool:
        """Takes a slot for the stream; False when every slot holds a stream that reads."""
        victim = None
        with self._lock:
            if len(self._streams) >= self._limits.max_streams:
                now = time.monotonic()
                stalled, victim = max(((s.stalled_seconds(now), s) for s in self._streams),
                                      key=lambda pair: pair[0])
                if stalled < self._limits.evict_stalled_seconds:
                    return False
                victim_context = self._streams.pop(victim)
                self.evicted_total += 1
            self._streams[subscription] = context
        if victim is not None:
            log.warning("ending an event stream that did not read for %.0f s: all %d slots were taken",
                        stalled, self._limits.max_streams)
            victim.evicted_reason = (f"you did not read for {stalled:.0f} s and the agent's "
                                     f"{self._limits.max_streams} stream slots were all taken")
            victim.close()
            _end_stalled(victim_context, victim.evicted_reason)
        return True

    def close(self, subscription: Subscription) -> None:
        with self._lock:
            self._streams.pop(subscription, None)

    def __len__(self) -> int:
        return len(self._streams)
