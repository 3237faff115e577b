"""StreamEvents in columns (EVENT_ENCODING_COLUMNS): the exact events in, the exact events out, with
filters, the redacted view, stacks before their first use and every loss counted in order; clients
that do not ask for columns get the Event messages they always got."""
import threading
import time

import grpc
import pytest

from fake_agent import ALL_KINDS, STREAM_FILTER_CASES, FakeAgent, event, served, stream_filter_events
from kvtrace._proto.kvtrace.v1 import agent_service_pb2 as service_pb2
from kvtrace._proto.kvtrace.v1 import agent_service_pb2_grpc as service_grpc
from kvtrace._proto.kvtrace.v1 import events_pb2
from kvtrace.client import AgentClient
from kvtrace.model.events import Kind, StackStatus
from kvtrace.model.processes import redact_title
from kvtrace.model.stacks import Frame, Stack
from kvtrace.servers.api.redaction import redact_event
from kvtrace.servers.api.requests import ServerLimits
from kvtrace.servers.hub import EventFilter, EventHub, Lost
from kvtrace.wire import (
    event_from_proto,
    event_messages_from_columns,
    event_to_proto,
    events_from_columns,
    events_to_columns,
)

COLUMNS = service_pb2.EVENT_ENCODING_COLUMNS
SECRET_TITLE = "vllm serve /models/llama --api-key sk-kvtrace-secret-0123 --port 8000"


def wait_for(condition, timeout_seconds=5.0):
    deadline = time.monotonic() + timeout_seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def over_the_wire(columns: events_pb2.EventColumns) -> events_pb2.EventColumns:
    return events_pb2.EventColumns.FromString(columns.SerializeToString())


# ---- the message ----

def test_every_kind_survives_columns_exactly():
    events = [*ALL_KINDS, *ALL_KINDS[::-1]]
    assert events_from_columns(over_the_wire(events_to_columns(events))) == events


def test_columns_carry_what_messages_carry():
    """A client reading columns sees what one reading Event messages sees, field for field."""
    messages = [events_pb2.Event.FromString(event_to_proto(item).SerializeToString()) for item in ALL_KINDS]
    assert event_messages_from_columns(over_the_wire(events_to_columns(ALL_KINDS))) == messages
    assert [event_from_proto(message) for message in event_messages_from_columns(events_to_columns(ALL_KINDS))] \
        == [event_from_proto(message) for message in messages]


def test_columns_of_all_zero_values_are_left_empty_and_one_process_needs_no_index():
    columns = events_to_columns([event(address=i, caller_address=0) for i in range(1, 100)])
    assert len(columns.kind) == 99 and len(columns.address) == 99
    for name in ("handle", "freed_bytes", "stack_id", "stream", "caller_address", "error_code", "device",
                 "stack_status", "source", "process", "sample_bytes"):
        assert len(getattr(columns, name)) == 0, name
    assert [(label.comm, label.title) for label in columns.processes] == [("VLLM::Worker_TP", "")]
    # Far smaller than a message each.
    messages = service_pb2.StreamEventsResponse(events=[event_to_proto(event(address=i)) for i in range(1, 100)])
    assert columns.ByteSize() * 2 < messages.ByteSize()


def test_several_processes_are_indexed_in_a_table():
    events = [event(pid=pid, title=f"title {pid}") for pid in (100, 200, 100, 300)]
    columns = events_to_columns(events)
    assert list(columns.process) == [0, 1, 0, 2]
    assert [(label.comm, label.title) for label in columns.processes] == \
        [("VLLM::EngineCor", "title 100"), ("VLLM::Worker_TP", "title 200"), ("python train.py", "title 300")]
    assert events_from_columns(columns) == events


def test_redacted_columns_are_what_redacted_messages_are():
    events = [item for item in ALL_KINDS if item.kind is not Kind.PROCESS_EXIT]
    for item in events:
        item.title = SECRET_TITLE
    columns = over_the_wire(events_to_columns(events, redact_title))
    for name in ("address", "handle", "stream", "caller_address", "stack_id"):
        assert len(getattr(columns, name)) == 0, name
    assert "sk-kvtrace-secret" not in str(columns)
    redacted_messages = [redact_event(event_to_proto(item)) for item in events]
    assert event_messages_from_columns(columns) == redacted_messages


def test_an_event_of_a_newer_agent_is_none_not_fatal():
    columns = events_to_columns([event(address=1), event(address=2)])
    columns.api[1] = 99
    assert [item.address if item else None for item in events_from_columns(columns)] == [1, None]


# ---- the stream ----

def read_columns(responses, count):
    """(kinds of items in stream order: events as model events, markers and stacks as messages)."""
    items = []
    for response in responses:
        assert not (response.HasField("columns") and any(m.HasField("events_lost") for m in response.events))
        items.extend(response.events)  # stacks and loss reports, before the response's columns
        items.extend(events_from_columns(response.columns))
        if sum(1 for item in items if not isinstance(item, events_pb2.Event)) >= count:
            return items
    return items


@pytest.mark.parametrize("request_fields, wanted", STREAM_FILTER_CASES)
def test_column_stream_filters_and_gives_the_exact_events(request_fields, wanted):
    events = stream_filter_events()
    with served() as (server, backend):
        agent = service_grpc.AgentServiceStub(grpc.insecure_channel(f"unix:{server.config.admin_path}"))
        responses = agent.StreamEvents(service_pb2.StreamEventsRequest(encoding=COLUMNS, **request_fields),
                                       timeout=10)
        wait_for(lambda: backend.hub.subscriber_count() == 1)
        backend.apply(*events)
        got = read_columns(responses, len(wanted))
        responses.cancel()
    assert got == [events[i] for i in wanted]  # the Session filled in titles: the same objects


def test_column_stream_defines_stacks_first_and_reports_losses_in_order():
    backend = FakeAgent()
    stack = Stack((Frame("forward", "model.py", 42),))
    stack_id = backend.stacks.intern(stack)
    with served(backend) as (server, backend):
        client = AgentClient.for_socket(server.config.socket)
        responses = client.stream_responses()
        first = event(address=1, stack_id=stack_id, stack_status=StackStatus.OK)
        wait_for(lambda: backend.hub.subscriber_count() == 1)
        backend.apply(first, event(address=2))
        backend.lose(23)
        backend.lose(2)
        backend.apply(event(address=3, stack_id=stack_id, stack_status=StackStatus.OK))
        items = read_columns(responses, 3)
        client.close()
    payloads = [item.WhichOneof("payload") if isinstance(item, events_pb2.Event) else item.address
                for item in items]
    assert payloads == ["stack_definition", 1, 2, "events_lost", 3]  # the stack is defined once
    assert items[3].events_lost.kernel_lost_count == 25  # adjacent losses: one marker


def test_redacted_column_stream_has_no_addresses_stacks_or_secrets(monkeypatch):
    monkeypatch.setitem(__import__("fake_agent").TITLES, 200, SECRET_TITLE)
    backend = FakeAgent()
    stack_id = backend.stacks.intern(Stack((Frame("forward", "model.py", 42),)))
    with served(backend) as (server, backend):
        group = service_grpc.AgentServiceStub(grpc.insecure_channel(f"unix:{server.config.socket}"))
        responses = group.StreamEvents(service_pb2.StreamEventsRequest(encoding=COLUMNS), timeout=10)
        wait_for(lambda: backend.hub.subscriber_count() == 1)
        backend.apply(event(address=0x7F00AA, stack_id=stack_id, stack_status=StackStatus.OK, caller_address=5))
        response = next(responses)
        responses.cancel()
    assert response.view == service_pb2.VIEW_REDACTED and not response.events
    (got,) = events_from_columns(response.columns)
    assert (got.address, got.stack_id, got.caller_address) == (0, 0, 0)
    assert got.stack_status is StackStatus.OK and got.title == redact_title(SECRET_TITLE)
    assert "sk-kvtrace-secret" not in str(response)


def test_a_slow_column_stream_is_told_every_loss_and_a_fast_one_loses_nothing():
    published = 30_000
    with served(max_queued_events=4096) as (server, backend):
        fast = AgentClient.for_socket(server.config.socket).stream_responses()
        slow = grpc.insecure_channel(f"unix:{server.config.socket}", [("grpc.http2.bdp_probe", 0)])
        slow_responses = service_grpc.AgentServiceStub(slow).StreamEvents(
            service_pb2.StreamEventsRequest(encoding=COLUMNS))
        fast_got: list[int] = []

        def read_fast():
            for response in fast:
                assert not response.events  # no losses
                fast_got.extend(item.address for item in events_from_columns(response.columns))
                if len(fast_got) >= published:
                    return

        reader = threading.Thread(target=read_fast)
        reader.start()
        wait_for(lambda: backend.hub.subscriber_count() == 2)
        for i in range(published):
            backend.hub.publish(event(address=i))
            if i % 500 == 0:
                wait_for(lambda i=i: len(fast_got) >= i - 1000)
        reader.join(30)
        received, dropped, addresses = 0, 0, []
        for response in slow_responses:
            for message in response.events:
                dropped += message.events_lost.dropped_count
            addresses.extend(response.columns.address)
            received += len(response.columns.kind)
            if received + dropped >= published:
                break
        slow.close()
    assert fast_got == list(range(published))
    assert dropped > 0 and received + dropped == published
    assert addresses == sorted(addresses)  # in order, with a gap where the marker is


# ---- old clients ----

def test_a_request_without_encoding_gets_event_messages_as_before():
    with served() as (server, backend):
        agent = service_grpc.AgentServiceStub(grpc.insecure_channel(f"unix:{server.config.admin_path}"))
        responses = agent.StreamEvents(service_pb2.StreamEventsRequest(), timeout=10)
        wait_for(lambda: backend.hub.subscriber_count() == 1)
        backend.apply(*(event(address=i) for i in range(1, 4)))
        response = next(responses)
        responses.cancel()
    assert not response.HasField("columns")
    assert [message.allocation.address for message in response.events] == [1, 2, 3]


def test_an_old_client_ignores_the_columns_field_it_does_not_know():
    """What a client generated before `columns` existed parses: the new field is an unknown field."""
    old_response = service_pb2.StreamEventsResponse(view=service_pb2.VIEW_FULL, events=[event_to_proto(event())])
    new_bytes = service_pb2.StreamEventsResponse(events=[event_to_proto(event())], view=service_pb2.VIEW_FULL,
                                                 columns=events_to_columns([event()])).SerializeToString()
    parsed = service_pb2.StreamEventsResponse.FromString(new_bytes)
    parsed.ClearField("columns")
    assert parsed == old_response


def test_client_stream_batches_still_yields_messages():
    with served() as (server, backend):
        client = AgentClient.for_socket(server.config.socket)
        batches = client.stream_batches()
        wait_for(lambda: backend.hub.subscriber_count() == 1)
        backend.apply(event(address=7))
        batch = next(batches)
        client.close()
    assert [message.allocation.address for message in batch] == [7]


def test_columns_responses_are_bigger_than_message_responses():
    limits = ServerLimits(batch_max_events=16, column_batch_max_events=1000)
    with served(limits=limits) as (server, backend):
        client = AgentClient.for_socket(server.config.socket)
        columns = client.stream_responses()
        wait_for(lambda: backend.hub.subscriber_count() == 1)
        backend.apply(*(event(address=i) for i in range(1, 501)))
        response = next(columns)
        client.close()
    assert len(response.columns.kind) == 500  # one response, where messages take 32


# ---- the hub's batches ----

def test_hub_hands_out_in_batches_with_exact_gap_positions_under_a_filter():
    hub = EventHub(distribute_at=1000)
    wanted = hub.subscribe(EventFilter(pids=frozenset({100})), max_queued_events=3)
    everything = hub.subscribe()
    published = [event(pid=100 if i % 2 else 200, address=i) for i in range(20)]
    for item in published:
        hub.publish(item)
    assert hub.published_total == 20 and hub.parked_count() == 1
    first = wanted.read(100, 0)
    assert [item.address for item in first] == [1, 3, 5]
    # It parked at its 4th wanted event, published 8th (index 7): 13 events from there on.
    assert wanted.read(100, 0) == [Lost(dropped_count=13)]
    assert everything.read(100, 0) == published


def test_hub_subscriber_gets_only_what_is_published_after_it_subscribed():
    hub = EventHub()
    early = hub.subscribe()
    hub.publish(event(address=1))
    late = hub.subscribe()
    hub.publish(event(address=2))
    assert [item.address for item in early.read(10, 0)] == [1, 2]
    assert [item.address for item in late.read(10, 0)] == [2]


def test_a_waiting_reader_is_woken_by_a_publish():
    hub = EventHub()
    subscription = hub.subscribe()
    threading.Timer(0.05, hub.publish, [event(address=5)]).start()
    started = time.monotonic()
    assert [item.address for item in subscription.read(10, 5)] == [5]
    assert time.monotonic() - started < 2
