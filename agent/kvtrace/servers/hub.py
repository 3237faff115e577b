"""Fan-out of model events to subscribers (gRPC streams), each with its own bounded queue.

The hub is a Session sink: the Session calls `publish()` for every event; it never blocks and costs
O(subscribers that read).
Each subscriber filters at publish time, so its queue holds only events it wants. When a queue is
full the subscriber is *parked*: the hub stops offering it events (a subscriber that does not read
costs no work per event, however many there are) and notes where. When its reader has emptied the
queue it rejoins, and reads a `Lost` marker where the gap is, in order with the events, so the
client learns exactly where it missed how many: every event published while it was parked (exact
for an unfiltered subscriber; for a filtered one more than it would have wanted, because counting
only the wanted ones would mean filtering for it all along). Events a source lost (`publish_loss`:
its kernel ring buffer was full) are counted the same way: in the queue of a subscriber that
reads, in the gap marker of a parked one.

Memory per subscriber is bounded: at most `max_queued_events` events, and markers are never
adjacent (a new loss adds to the last marker), so at most as many markers as events plus one.

The title filter is a client's regular expression: it must be a linear-time engine's (servers/api.py
compiles it with RE2), it sees at most TITLE_MATCH_MAX_CHARS of the title, and it runs once per
distinct title, not per event (model/processes.py's TitleMatcher).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from kvtrace.model.events import SIZED_KINDS, Event, Kind, Layer
from kvtrace.model.gpus import NvmlSample
from kvtrace.model.ledger import LedgerResynced
from kvtrace.model.processes import TitleMatcher, TitlePattern

DEFAULT_MAX_QUEUED_EVENTS = 65536



@dataclass(frozen=True)
class EventFilter:
    """Which events a subscriber wants. Empty sets and None mean "no constraint"."""

    pids: frozenset[int] = frozenset()
    title_regex: TitlePattern | None = None
    redacted_titles: bool = False  # the regex sees titles redacted, as the subscriber's view shows them
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

    def __init__(self, event_filter: EventFilter, max_queued_events: int, hub: EventHub | None = None) -> None:
        self.event_filter = event_filter
        self.max_queued_events = max_queued_events
        self.closed = False
        # Parked: the queue was full, so the hub offers nothing until the reader has emptied it.
        self.parked = False
        self._parked_at_published = 0  # hub.published_total before the first event it missed
        self._parked_at_kernel_lost = 0
        self._hub = hub
        self.evicted_reason = ""  # set when the server ended the stream for another (servers/api.py)
        self._reading = False
        self._last_read_monotonic = time.monotonic()  # when the reader last came back for more
        self.delivered_total = 0
        self.dropped_total = 0
        self._queue: deque[Event | Lost] = deque()  # oldest first
        self._queued_events = 0  # events in _queue (markers not counted)
        self._lock = threading.Lock()
        self._ready = threading.Event()  # set when something was queued since the reader looked
        self._titles = TitleMatcher(event_filter.title_regex, event_filter.redacted_titles) \
            if event_filter.title_regex is not None else None

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
        return self._titles is None or self._titles.matches(event.title)

    def offer(self, event: Event) -> bool:
        """Queues the event; False when the queue is full (the hub then parks this subscriber)."""
        with self._lock:
            if self._queued_events >= self.max_queued_events:
                return False
            self._queue.append(event)
            self._queued_events += 1
        self._wake()
        return True

    def stalled_seconds(self, now: float) -> float:
        """How long the reader has not come back for events (0 while it waits in read())."""
        return 0.0 if self._reading else max(0.0, now - self._last_read_monotonic)

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
        self._reading = True
        try:
            return self._read(max_items, timeout_seconds)
        finally:
            self._last_read_monotonic = time.monotonic()
            self._reading = False

    def _read(self, max_items: int, timeout_seconds: float) -> list[Event | Lost]:
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
            # Emptied while parked: rejoin, with the gap's marker (the queue stays empty meanwhile:
            # nothing is offered to a parked subscriber).
            if self.parked and self._hub is not None and not self.closed:
                gap = self._hub._rejoin(self)
                if gap is not None:
                    return [gap]
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
        # Held by publish and by a subscriber rejoining, so a gap's count is exact. Order: hub, then
        # a subscription's own lock.
        self._lock = threading.Lock()
        # The subscribers offered events. Replaced, never mutated: publish() iterates its snapshot.
        self._subscriptions: tuple[Subscription, ...] = ()
        self._parked: list[Subscription] = []  # full queues: offered nothing until emptied
        self.published_total = 0
        self.kernel_lost_total = 0

    def subscribe(self, event_filter: EventFilter | None = None,
                  max_queued_events: int | None = None) -> Subscription:
        subscription = Subscription(event_filter or EventFilter(),
                                    max_queued_events or self.max_queued_events, self)
        with self._lock:
            self._subscriptions = (*self._subscriptions, subscription)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        subscription.close()
        with self._lock:
            self._subscriptions = tuple(s for s in self._subscriptions if s is not subscription)
            self._parked = [s for s in self._parked if s is not subscription]

    def subscriber_count(self) -> int:
        return len(self._subscriptions) + len(self._parked)

    def parked_count(self) -> int:
        """Subscribers whose queue is full: they cost nothing per event until they read."""
        return len(self._parked)

    def publish(self, event: Event) -> None:
        """Offers the event to every subscriber that wants it. Never blocks."""
        with self._lock:
            self.published_total += 1
            for subscription in self._subscriptions:
                if subscription.wants(event) and not subscription.offer(event):
                    self._park(subscription)

    def _park(self, subscription: Subscription) -> None:
        """The subscription's queue is full: offer it nothing more until its reader empties it.
        Holds the lock; the event being published is the first it misses."""
        subscription.parked = True
        subscription._parked_at_published = self.published_total - 1
        subscription._parked_at_kernel_lost = self.kernel_lost_total
        self._subscriptions = tuple(s for s in self._subscriptions if s is not subscription)
        self._parked.append(subscription)

    def _rejoin(self, subscription: Subscription) -> Lost | None:
        """A parked subscription's reader emptied its queue: the gap's marker, and events again."""
        with self._lock:
            if not subscription.parked or subscription.closed:
                return None
            subscription.parked = False
            self._parked = [s for s in self._parked if s is not subscription]
            self._subscriptions = (*self._subscriptions, subscription)
            gap = Lost(dropped_count=self.published_total - subscription._parked_at_published,
                       kernel_lost_count=self.kernel_lost_total - subscription._parked_at_kernel_lost)
        subscription.dropped_total += gap.dropped_count
        return gap

    def publish_loss(self, lost_count: int) -> None:
        """`lost_count` events never reached the agent here: every subscriber is told in-band."""
        with self._lock:
            self.kernel_lost_total += lost_count
            for subscription in self._subscriptions:
                subscription.offer_kernel_loss(lost_count)

    def publish_state(self, record: NvmlSample | LedgerResynced) -> None:
        """Streams carry events only."""

    def close_all(self) -> None:
        """Wakes every reader so that streams end (at shutdown)."""
        with self._lock:
            subscriptions = (*self._subscriptions, *self._parked)
        for subscription in subscriptions:
            subscription.close()
