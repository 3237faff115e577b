"""Fan-out of model events to subscribers (gRPC streams), each with its own bounded queue.

The hub is a Session sink: the Session calls `publish()` for every event; it never blocks and costs
O(subscribers).
Each subscriber filters at publish time, so its queue holds only events it wants and its loss
counts are exact counts of wanted events. When a queue is full the subscriber's new events are
dropped and counted in a `Lost` marker placed in the queue where the gap is; the reader gets the
marker in order with the events, so the client learns exactly where it missed how many. Events a
source lost (`publish_loss`: its kernel ring buffer was full) go into every queue the same way.

Memory per subscriber is bounded: at most `max_queued_events` events, and markers are never
adjacent (a new drop adds to the last marker), so at most as many markers as events plus one.
"""
from __future__ import annotations

import re
import threading
import time
from collections import deque
from dataclasses import dataclass

from kvtrace.model.events import SIZED_KINDS, Event, Kind, Layer

DEFAULT_MAX_QUEUED_EVENTS = 65536

# The title regex result is cached per title: titles are few, and the regex then runs once per
# title instead of once per event in the event loop. Bounded so an exec storm cannot grow it.
_TITLE_CACHE_MAX_ENTRIES = 4096


@dataclass(frozen=True)
class EventFilter:
    """Which events a subscriber wants. Empty sets and None mean "no constraint"."""

    pids: frozenset[int] = frozenset()
    title_regex: re.Pattern | None = None
    kinds: frozenset[Kind] = frozenset()
    layers: frozenset[Layer] = frozenset()  # events without a layer (process exit) always pass
    min_size_bytes: int = 0  # constrains only SIZED_KINDS; other events always pass


@dataclass
class Lost:
    """Events a subscriber missed at this point of its stream."""

    dropped_count: int = 0  # dropped for this subscriber: its queue was full
    kernel_lost_count: int = 0  # lost in the kernel ring buffer, for everyone


class Subscription:
    """One subscriber's queue. The hub offers events from the publishing thread; one reader reads."""

    def __init__(self, event_filter: EventFilter, max_queued_events: int) -> None:
        self.event_filter = event_filter
        self.max_queued_events = max_queued_events
        self.closed = False
        self.delivered_total = 0
        self.dropped_total = 0
        self._queue: deque[Event | Lost] = deque()  # oldest first
        self._queued_events = 0  # events in _queue (markers not counted)
        self._lock = threading.Lock()
        self._ready = threading.Event()  # set when something was queued since the reader looked
        self._title_matches: dict[str, bool] = {}

    def wants(self, event: Event) -> bool:
        wanted = self.event_filter
        if wanted.pids and event.pid not in wanted.pids:
            return False
        if wanted.kinds and event.kind not in wanted.kinds:
            return False
        if wanted.layers and event.layer is not None and event.layer not in wanted.layers:
            return False
        if wanted.min_size_bytes and event.kind in SIZED_KINDS and event.size_bytes < wanted.min_size_bytes:
            return False
        if wanted.title_regex is not None:
            matches = self._title_matches.get(event.title)
            if matches is None:
                if len(self._title_matches) >= _TITLE_CACHE_MAX_ENTRIES:
                    self._title_matches.clear()
                matches = self._title_matches[event.title] = bool(wanted.title_regex.search(event.title))
            return matches
        return True

    def offer(self, event: Event) -> None:
        with self._lock:
            if self._queued_events < self.max_queued_events:
                self._queue.append(event)
                self._queued_events += 1
            else:
                self.dropped_total += 1
                self._lost_marker().dropped_count += 1
        self._wake()

    def offer_kernel_loss(self, count: int) -> None:
        with self._lock:
            self._lost_marker().kernel_lost_count += count
        self._wake()

    def _lost_marker(self) -> Lost:
        """The marker at the tail of the queue, added if the tail is an event. Holds the lock."""
        tail = self._queue[-1] if self._queue else None
        if not isinstance(tail, Lost):
            tail = Lost()
            self._queue.append(tail)
        return tail

    def _wake(self) -> None:
        # Setting a threading.Event takes its condition lock; skip it when the reader is not waiting.
        if not self._ready.is_set():
            self._ready.set()

    def read(self, max_items: int, timeout_seconds: float) -> list[Event | Lost]:
        """Up to `max_items` queued events and loss markers, oldest first.

        Returns at once when something is queued; otherwise waits up to `timeout_seconds` for the
        first item and returns what came ([] on timeout or when closed).
        """
        deadline = time.monotonic() + timeout_seconds
        while True:
            # Clear before looking: a publish after the look then sets it again, so no wake-up is lost.
            self._ready.clear()
            with self._lock:
                if self._queue:
                    count = min(max_items, len(self._queue))
                    items = [self._queue.popleft() for _ in range(count)]
                    events = sum(1 for item in items if not isinstance(item, Lost))
                    self._queued_events -= events
                    self.delivered_total += events
                    return items
            remaining = deadline - time.monotonic()
            if self.closed or remaining <= 0:
                return []
            self._ready.wait(remaining)

    def close(self) -> None:
        """Wakes the reader; it then gets what is queued and [] after that."""
        self.closed = True
        self._ready.set()


class EventHub:
    """Subscribers and the fan-out to them. Thread-safe."""

    def __init__(self, max_queued_events: int = DEFAULT_MAX_QUEUED_EVENTS) -> None:
        self.max_queued_events = max_queued_events
        self._lock = threading.Lock()
        # Replaced, never mutated, so publish() iterates it without taking the lock.
        self._subscriptions: tuple[Subscription, ...] = ()
        self.published_total = 0

    def subscribe(self, event_filter: EventFilter | None = None,
                  max_queued_events: int | None = None) -> Subscription:
        subscription = Subscription(event_filter or EventFilter(),
                                    max_queued_events or self.max_queued_events)
        with self._lock:
            self._subscriptions = (*self._subscriptions, subscription)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        subscription.close()
        with self._lock:
            self._subscriptions = tuple(s for s in self._subscriptions if s is not subscription)

    def subscriber_count(self) -> int:
        return len(self._subscriptions)

    def publish(self, event: Event) -> None:
        """Offers the event to every subscriber that wants it. Never blocks."""
        self.published_total += 1
        for subscription in self._subscriptions:
            if subscription.wants(event):
                subscription.offer(event)

    def publish_loss(self, lost_count: int) -> None:
        """`lost_count` events never reached the agent here: every subscriber is told in-band."""
        for subscription in self._subscriptions:
            subscription.offer_kernel_loss(lost_count)

    def close_all(self) -> None:
        """Wakes every reader so that streams end (at shutdown)."""
        for subscription in self._subscriptions:
            subscription.close()
