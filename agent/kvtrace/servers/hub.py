"""Fan-out of model events to subscribers (gRPC streams), each with its own bounded queue.

The hub is a Session sink: the Session calls `publish()` for an event and `publish_many()` for a run of
them; neither blocks, and each costs one list append: runs wait in a pending list as they came, and are
handed out (`_distribute`) when a reader comes for more, when a loss is published, or when the list is
long. Queues hold runs, not events: an unfiltered subscriber's costs nothing per event, and a run the
BPF source decoded at once (model.events.EventRun) reaches the stream whole, with the records a
fixed-column stream copies (servers/api/servicer.py). A filtered subscriber's filter runs over the events (C
loops, no Python call per event), so fan-out work per event is a few tens of nanoseconds a subscriber.
Each subscriber filters its batch before queueing, so its queue holds only events it wants. When a queue is
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

The title filter is a client's regular expression: it must be a linear-time engine's (servers/api/requests.py
compiles it with RE2), it sees at most TITLE_MATCH_MAX_CHARS of the title, and it runs once per
distinct title, not per event (model/processes.py's TitleMatcher).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtrace.model.events import SIZED_KINDS, Event, EventRun, Kind, Layer
from kvtrace.model.gpus import NvmlSample
from kvtrace.model.ledger import LedgerResynced
from kvtrace.model.processes import TitleMatcher, TitlePattern

DEFAULT_MAX_QUEUED_EVENTS = 65536
DEFAULT_DISTRIBUTE_AT = 2048



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


# A run of events as published: an EventRun, the Session's list, or one event's tuple. Never changed after.
Batch = Sequence[Event]
QueueItem = Batch | Lost


def _head(events: Batch, count: int) -> Batch:
    """The first `count` events of a batch; a run stays a run (with its records)."""
    return events.sliced(0, count) if type(events) is EventRun else events[:count]


def _tail(events: Batch, start: int) -> Batch:
    return events.sliced(start, len(events)) if type(events) is EventRun else events[start:]


def flatten(items: list[QueueItem]) -> list[Event | Lost]:
    """The events and markers of queued items, one by one."""
    flat: list[Event | Lost] = []
    for item in items:
        if isinstance(item, Lost):
            flat.append(item)
        else:
            flat.extend(item)
    return flat


class Subscription:
    """One subscriber's queue. The hub hands it batches from the publishing thread or a reader's; one
    reader reads."""

    def __init__(self, event_filter: EventFilter, max_queued_events: int, hub: EventHub | None = None) -> None:
        self.event_filter = event_filter
        self.max_queued_events = max_queued_events
        self.closed = False
        # Parked: the queue was full, so the hub offers nothing until the reader has emptied it.
        self.parked = False
        self._parked_at_published = 0  # the hub's position of the first event it missed
        self._parked_at_kernel_lost = 0
        self._hub = hub
        self.evicted_reason = ""  # set when the server ended the stream for another (servers/api/slots.py)
        self._reading = False
        self._last_read_monotonic = time.monotonic()  # when the reader last came back for more
        self.delivered_total = 0
        self.dropped_total = 0
        self._queue: deque[QueueItem] = deque()  # oldest first
        self._queued_events = 0  # events in _queue (markers not counted)
        self._lock = threading.Lock()
        self._ready = threading.Event()  # set when something was queued since the reader looked
        self._titles = TitleMatcher(event_filter.title_regex, event_filter.redacted_titles) \
            if event_filter.title_regex is not None else None
        self._filtered = bool(event_filter.pids or event_filter.kinds or event_filter.layers
                              or event_filter.min_size_bytes or self._titles is not None)
        # Only processes are chosen: a run of none but chosen ones passes whole, records and all.
        self._pids_only = bool(event_filter.pids) and not (
            event_filter.kinds or event_filter.layers or event_filter.min_size_bytes or self._titles is not None)

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

    def wanted(self, batches: list[Batch]) -> list[Batch]:
        """The events of `batches` this subscriber wants, in order, in batches: what `wants` says of each.
        A run whose processes are all wanted (and nothing else constrains) passes whole; other events are
        filtered together (`_wanted_events`)."""
        if not self._filtered:
            return batches
        kept: list[Batch] = []
        loose: list[Event] = []
        pids = self.event_filter.pids if self._pids_only else None
        for events in batches:
            if pids is not None and type(events) is EventRun and events.pids <= pids:
                if loose:
                    kept.append(self._wanted_events(loose))
                    loose = []
                kept.append(events)
            else:
                loose.extend(events)
        if loose:
            kept.append(self._wanted_events(loose))
        return [events for events in kept if events]

    def _wanted_events(self, batch: list[Event]) -> list[Event]:
        """The events of `batch` this subscriber wants: one comprehension per constraint set (no call per
        event but the title's, cached per title)."""
        wanted = self.event_filter
        if wanted.pids:
            pids = wanted.pids
            batch = [event for event in batch if event.pid in pids]
        if wanted.kinds:
            kinds = wanted.kinds
            batch = [event for event in batch if event.kind in kinds]
        if wanted.layers:
            layers = wanted.layers
            batch = [event for event in batch if event.layer is None or event.layer in layers]
        if wanted.min_size_bytes:
            least = wanted.min_size_bytes
            batch = [event for event in batch if event.size_bytes >= least or event.kind not in SIZED_KINDS]
        if self._titles is not None:
            matches = self._titles.matches
            batch = [event for event in batch if matches(event.title)]
        return batch

    def _take(self, wanted: list[Batch]) -> Event | None:
        """Queues what fits of `wanted` (batches of events this subscriber wants, in order); the first
        event that did not fit, None when all did."""
        missed = None
        taken = 0
        with self._lock:
            room = self.max_queued_events - self._queued_events
            queue = self._queue
            for events in wanted:
                count = len(events)
                if count <= room:
                    queue.append(events)
                    room -= count
                    taken += count
                    continue
                if room > 0:
                    queue.append(_head(events, room))
                    taken += room
                missed = events[max(room, 0)]
                break
            self._queued_events += taken
        if taken:
            self._wake()
        return missed

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

    def read(self, max_events: int, timeout_seconds: float) -> list[Event | Lost]:
        """Up to `max_events` queued events, and the loss markers among them, oldest first.

        Returns at once when something is queued; otherwise waits up to `timeout_seconds` for the
        first item and returns what came ([] on timeout or when closed).
        """
        return flatten(self.read_batches(max_events, timeout_seconds))

    def read_batches(self, max_events: int, timeout_seconds: float) -> list[QueueItem]:
        """read(), in the batches the events were published in (a run stays a run, but for one cut
        at `max_events`)."""
        self._reading = True
        try:
            return self._read(max_events, timeout_seconds)
        finally:
            self._last_read_monotonic = time.monotonic()
            self._reading = False

    def _read(self, max_events: int, timeout_seconds: float) -> list[QueueItem]:
        deadline = time.monotonic() + timeout_seconds
        while True:
            # Clear before looking: a publish after the look then sets it again, so no wake-up is lost.
            self._ready.clear()
            if self._hub is not None and not self.parked:
                self._hub.distribute()
            with self._lock:
                if self._queue:
                    return self._take_out(max(max_events, 1))
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

    def _take_out(self, max_events: int) -> list[QueueItem]:
        """Up to `max_events` queued events (a batch cut where they end) and the markers among them,
        oldest first. Holds the lock."""
        queue = self._queue
        if self._queued_events <= max_events:  # the whole queue (no batch looked at)
            items = list(queue)
            queue.clear()
            events = self._queued_events
        else:
            items = []
            events = 0
            while queue and events < max_events:
                item = queue[0]
                if isinstance(item, Lost):
                    items.append(queue.popleft())
                    continue
                room = max_events - events
                if len(item) <= room:
                    items.append(queue.popleft())
                    events += len(item)
                else:
                    items.append(_head(item, room))
                    queue[0] = _tail(item, room)
                    events += room
        self._queued_events -= events
        self.delivered_total += events
        return items

    def close(self) -> None:
        """Wakes the reader; it then gets what is queued and [] after that."""
        self.closed = True
        self._ready.set()


def _position(batches: list[Batch], event: Event) -> int:
    """Where `event` (that object) is among the events of `batches`."""
    position = 0
    for events in batches:
        for index, candidate in enumerate(events):
            if candidate is event:
                return position + index
        position += len(events)
    raise ValueError("the event is not in the batches")


def _takes_blocks(event_filter: EventFilter) -> bool:
    return (not event_filter.layers or Layer.TORCH in event_filter.layers) and (
        not event_filter.kinds or bool({Kind.ALLOC, Kind.FREE} & event_filter.kinds))


class EventHub:
    """Subscribers and the fan-out to them. Thread-safe; one publisher at a time (the Session's lock)."""

    def __init__(self, max_queued_events: int = DEFAULT_MAX_QUEUED_EVENTS,
                 distribute_at: int = DEFAULT_DISTRIBUTE_AT) -> None:
        self.max_queued_events = max_queued_events
        # Called (outside the hub's lock) when a subscriber came or went: what wants_every_block says may have
        # changed (the agent sets Session.refresh_block_readers; parking changes nothing there).
        self.on_readers_changed: Callable[[], None] | None = None
        # Pending events are handed out when this many wait (when no reader came for them sooner).
        self.distribute_at = distribute_at
        # Held to hand out pending events, and by a subscriber rejoining, so a gap's count is exact.
        # Order: hub, then a subscription's own lock.
        self._lock = threading.Lock()
        # The subscribers offered events. Replaced, never mutated: _distribute iterates its snapshot.
        self._subscriptions: tuple[Subscription, ...] = ()
        self._parked: list[Subscription] = []  # full queues: offered nothing until emptied
        # Published batches, not yet handed out. The publisher only appends; _distribute takes a prefix
        # (one slice and one del, each atomic under the GIL), so publish takes no lock.
        self._pending: list[Batch] = []
        self._kicked = False  # the readers were woken for what is pending
        self._published_total = 0  # events published (written by the publisher only)
        self._distributed_total = 0  # events handed out (or published while nobody took them); under _lock
        self.kernel_lost_total = 0

    @property
    def published_total(self) -> int:
        return self._published_total

    def subscribe(self, event_filter: EventFilter | None = None,
                  max_queued_events: int | None = None) -> Subscription:
        """A new subscriber; it gets the events published from now on."""
        subscription = Subscription(event_filter or EventFilter(),
                                    max_queued_events or self.max_queued_events, self)
        with self._lock:
            self._distribute_locked()  # what was published before is not for it
            self._subscriptions = (*self._subscriptions, subscription)
        self._readers_changed()
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        subscription.close()
        with self._lock:
            self._subscriptions = tuple(s for s in self._subscriptions if s is not subscription)
            self._parked = [s for s in self._parked if s is not subscription]
        self._readers_changed()

    def _readers_changed(self) -> None:
        if self.on_readers_changed is not None:
            self.on_readers_changed()

    def subscriber_count(self) -> int:
        return len(self._subscriptions) + len(self._parked)

    @property
    def wants_every_block(self) -> bool:
        """Whether a subscriber takes PyTorch blocks' allocations and frees (Session.set_block_readers_hook):
        one whose filter lets them through."""
        with self._lock:  # a subscriber being unparked is in neither list for a moment
            return any(_takes_blocks(subscription.event_filter)
                       for subscription in (*self._subscriptions, *self._parked))

    def parked_count(self) -> int:
        """Subscribers whose queue is full: they cost nothing per event until they read."""
        self.distribute()  # counted after what was published so far
        return len(self._parked)

    def publish(self, event: Event) -> None:
        """Offers the event to every subscriber that wants it. Never blocks."""
        self.publish_many((event,))

    def publish_many(self, events: Batch) -> None:
        """publish, for each of a run of events (the hub keeps the run: the caller never changes it)."""
        if not events:
            return
        self._published_total += len(events)  # first: a hand-out meanwhile never counts more than published
        self._pending.append(events)
        if not self._kicked:
            # The first events since the last hand-out: wake the readers (they hand them out).
            self._kicked = True
            for subscription in self._subscriptions:
                subscription._wake()
        elif self._published_total - self._distributed_total >= self.distribute_at:
            self.distribute()

    def distribute(self) -> None:
        """Hands the pending events to the subscribers that read (a reader calls it before reading)."""
        if self._pending:
            with self._lock:
                self._distribute_locked()
        elif self._kicked:
            # An event appended between a hand-out's reset of _kicked and its take was handed out with
            # the rest, and left _kicked set with nothing pending: the next event must wake readers.
            with self._lock:
                if not self._pending:
                    self._kicked = False

    def _distribute_locked(self) -> None:
        self._kicked = False  # before the take: an event appended after it wakes the readers again
        pending = self._pending
        count = len(pending)
        if not count:
            return
        batch = pending[:count]
        del pending[:count]
        base = self._distributed_total
        self._distributed_total = base + sum(map(len, batch))
        for subscription in self._subscriptions:
            wanted = subscription.wanted(batch)
            if not wanted:
                continue
            first_missed = subscription._take(wanted)
            if first_missed is not None:
                self._park(subscription, base + _position(batch, first_missed))

    def _park(self, subscription: Subscription, position: int) -> None:
        """The subscription's queue is full: offer it nothing more until its reader empties it.
        Holds the lock; the event at `position` (the hub's count) is the first it misses."""
        subscription.parked = True
        subscription._parked_at_published = position
        subscription._parked_at_kernel_lost = self.kernel_lost_total
        self._subscriptions = tuple(s for s in self._subscriptions if s is not subscription)
        self._parked.append(subscription)

    def _rejoin(self, subscription: Subscription) -> Lost | None:
        """A parked subscription's reader emptied its queue: the gap's marker, and events again."""
        with self._lock:
            if not subscription.parked or subscription.closed:
                return None
            self._distribute_locked()  # everything published so far is in the gap
            subscription.parked = False
            self._parked = [s for s in self._parked if s is not subscription]
            self._subscriptions = (*self._subscriptions, subscription)
            gap = Lost(dropped_count=self._distributed_total - subscription._parked_at_published,
                       kernel_lost_count=self.kernel_lost_total - subscription._parked_at_kernel_lost)
        subscription.dropped_total += gap.dropped_count
        return gap

    def publish_loss(self, lost_count: int) -> None:
        """`lost_count` events never reached the agent here: every subscriber is told in-band."""
        with self._lock:
            self._distribute_locked()  # the marker goes after the events published before it
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
