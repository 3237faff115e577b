"""EventHub: per-subscriber filters, bounded queues, exact in-band loss, non-blocking publish."""
import re
import threading
import time

from fake_agent import TITLES, MiB, event
from kvtrace.model.events import Api, Kind, Layer, Memory, ObjectKind
from kvtrace.servers.hub import EventFilter, EventHub, Lost


def drain(subscription):
    items = []
    while True:
        batch = subscription.read(512, timeout_seconds=0)
        if not batch:
            return items
        items.extend(batch)


def events_of(items):
    return [item for item in items if not isinstance(item, Lost)]


def test_every_subscriber_gets_every_event_in_order():
    hub = EventHub()
    first, second = hub.subscribe(), hub.subscribe()
    published = [event(address=i) for i in range(23)]
    for item in published:
        hub.publish(item)
    assert drain(first) == published
    assert drain(second) == published


def test_slow_subscriber_loses_only_its_own_events_counted_where_the_gap_is():
    hub = EventHub()
    fast = hub.subscribe()
    slow = hub.subscribe(max_queued_events=7)
    for i in range(23):
        hub.publish(event(address=i))
    fast_items = drain(fast)
    slow_items = drain(slow)
    assert [e.address for e in fast_items] == list(range(23))
    # The first 7 fit, then one marker for the 16 that did not.
    assert [e.address for e in slow_items[:7]] == list(range(7))
    assert slow_items[7:] == [Lost(dropped_count=16)]
    # Once read, the queue takes events again; a second gap gets its own marker.
    for i in range(23, 23 + 11):
        hub.publish(event(address=i))
    slow_items = drain(slow)
    assert [e.address for e in slow_items[:7]] == list(range(23, 30))
    assert slow_items[7:] == [Lost(dropped_count=4)]
    assert slow.dropped_total == 20 and slow.delivered_total == 14
    assert fast.dropped_total == 0 and fast.delivered_total == 23


def test_kernel_losses_reach_every_subscriber_once():
    hub = EventHub()
    first, second = hub.subscribe(), hub.subscribe(max_queued_events=1)
    hub.publish(event(address=1))
    hub.publish(event(address=2))  # second: dropped
    hub.publish_loss(5)
    hub.publish(event(address=3))
    hub.publish_loss(3)
    assert drain(first) == [event(address=1), event(address=2), Lost(kernel_lost_count=5),
                            event(address=3), Lost(kernel_lost_count=3)]
    # Losses next to each other merge into one marker.
    assert drain(second) == [event(address=1), Lost(dropped_count=2, kernel_lost_count=8)]


def test_read_waits_for_the_first_event_and_close_wakes_it():
    hub = EventHub()
    subscription = hub.subscribe()
    started = time.monotonic()
    assert subscription.read(512, timeout_seconds=0.05) == []
    assert time.monotonic() - started >= 0.05
    threading.Timer(0.05, hub.publish, [event()]).start()
    assert subscription.read(512, timeout_seconds=5) == [event()]
    threading.Timer(0.05, subscription.close).start()
    started = time.monotonic()
    assert subscription.read(512, timeout_seconds=5) == []
    assert time.monotonic() - started < 2


def test_publish_does_not_block_on_a_full_queue():
    hub = EventHub()
    subscription = hub.subscribe(max_queued_events=1)
    started = time.monotonic()
    for i in range(10_000):
        hub.publish(event(address=i))
    assert time.monotonic() - started < 1
    assert drain(subscription) == [event(address=0), Lost(dropped_count=9_999)]


def test_unsubscribed_gets_nothing_more():
    hub = EventHub()
    subscription = hub.subscribe()
    hub.unsubscribe(subscription)
    hub.publish(event())
    assert hub.subscriber_count() == 0
    assert drain(subscription) == []


def test_concurrent_publisher_and_reader_account_for_every_event():
    hub = EventHub()
    subscription = hub.subscribe(max_queued_events=64)
    total = 50_000
    received, dropped = 0, 0

    def publisher():
        for i in range(total):
            hub.publish(event(address=i))

    thread = threading.Thread(target=publisher)
    thread.start()
    while thread.is_alive() or received + dropped < total:
        for item in subscription.read(512, timeout_seconds=0.01):
            if isinstance(item, Lost):
                dropped += item.dropped_count
            else:
                received += 1
    thread.join()
    assert received + dropped == total
    assert subscription.delivered_total == received and subscription.dropped_total == dropped


def filtered(event_filter, events):
    hub = EventHub()
    subscription = hub.subscribe(event_filter)
    for item in events:
        hub.publish(item)
    return drain(subscription)


def test_pid_filter():
    events = [event(pid=100), event(pid=200), event(pid=300)]
    assert filtered(EventFilter(pids=frozenset({100, 300})), events) == [events[0], events[2]]


def test_title_filter_searches_the_title():
    events = [event(pid=pid, title=TITLES[pid]) for pid in (100, 200, 300)]
    assert filtered(EventFilter(title_regex=re.compile("Worker_TP\\d")), events) == [events[1]]
    assert filtered(EventFilter(title_regex=re.compile("^VLLM")), events) == events[:2]


def test_kind_filter():
    events = [event(kind=Kind.ALLOC), event(kind=Kind.FREE, api=Api.cuMemFree_v2),
              event(kind=Kind.ALLOC_FAILED, error_code=2)]
    assert filtered(EventFilter(kinds=frozenset({Kind.FREE, Kind.ALLOC_FAILED})), events) == events[1:]


def test_layer_filter_lets_events_without_a_layer_pass():
    exit_event = event(kind=Kind.PROCESS_EXIT, api=Api.process_exit, layer=None, obj=None, memory=None,
                       size=0, address=0)
    events = [event(layer=Layer.RUNTIME, api=Api.cudaMalloc), event(layer=Layer.DRIVER),
              event(layer=Layer.VMM, api=Api.cuMemCreate, obj=ObjectKind.VMM_HANDLE), exit_event]
    assert filtered(EventFilter(layers=frozenset({Layer.RUNTIME, Layer.VMM})), events) == \
        [events[0], events[2], exit_event]


def test_min_size_filter_constrains_only_sized_events():
    set_device = event(kind=Kind.SET_DEVICE, api=Api.cudaSetDevice, layer=Layer.RUNTIME, obj=None,
                       memory=Memory.DEVICE, size=0, address=0, device=1)
    events = [event(size=MiB - 1), event(size=MiB), event(size=2 * MiB), set_device]
    assert filtered(EventFilter(min_size_bytes=MiB), events) == events[1:]


def test_filters_combine():
    events = [event(pid=200, size=2 * MiB), event(pid=200, size=1), event(pid=100, size=2 * MiB)]
    both = EventFilter(pids=frozenset({200}), min_size_bytes=MiB)
    assert filtered(both, events) == [events[0]]


def test_a_partial_read_counts_only_its_events_and_a_late_event_still_wakes_the_reader():
    hub = EventHub()
    subscription = hub.subscribe()
    hub.publish(event(Kind.ALLOC, Api.cudaMalloc, Layer.RUNTIME, 0x10, MiB))
    hub.publish_loss(5)  # a kernel loss marker between events
    hub.publish(event(Kind.ALLOC, Api.cudaMalloc, Layer.RUNTIME, 0x20, MiB))
    hub.publish(event(Kind.ALLOC, Api.cudaMalloc, Layer.RUNTIME, 0x30, MiB))
    first = subscription.read(2, 0)  # 2 events of 3, and the marker between them
    assert [type(item) is Lost for item in first] == [False, True, False]
    assert subscription.delivered_total == 2
    assert len(events_of(subscription.read(10, 0))) == 1 and subscription.delivered_total == 3
    # The hand-out reset _kicked while an event came in and took it along: the next event still wakes.
    hub._kicked = True
    hub.distribute()
    woken = threading.Event()
    reader = threading.Thread(target=lambda: woken.set() if subscription.read(1, 5) else None)
    reader.start()
    time.sleep(0.1)
    started = time.monotonic()
    hub.publish(event(Kind.ALLOC, Api.cudaMalloc, Layer.RUNTIME, 0x40, MiB))
    reader.join(5)
    assert woken.is_set() and time.monotonic() - started < 0.5
