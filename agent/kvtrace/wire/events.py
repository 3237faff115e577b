"""One traced event (and the stack definitions and loss notices around it) as kvtrace.v1's Event
message, and back: the EVENT_ENCODING_MESSAGES stream, recordings' event frames and the CLI's
`kvtrace tail`.

Apart from the columnar encodings (kvtrace.wire.columns), which batch many events and are judged by
their cost per event, this is the one-message-per-event form every client can read.
"""
from __future__ import annotations

import time

from kvtrace._proto.kvtrace.v1 import events_pb2
from kvtrace.model.events import Api, Event, Kind, Layer, Memory, ObjectKind, Source, StackStatus
from kvtrace.model.stacks import Frame, Stack
from kvtrace.wire.common import STACK_STATUS_NAMES, enum_member, wire_number

_STACK_STATUS_BY_NAME = {name: status for status, name in STACK_STATUS_NAMES.items()}


def event_to_proto(event: Event) -> events_pb2.Event:
    """One model event as the wire Event; the payload follows the kind.

    Fields are set on the payload in place: about twice as fast as building it with keyword
    arguments and copying it in, and this runs for every event of every stream."""
    message = events_pb2.Event(timestamp_ns=event.timestamp_ns, pid=event.pid, tid=event.tid,
                               comm=event.comm, title=event.title, container=event.container)
    if event.source is not Source.UPROBE:
        message.source = wire_number(event.source)
    kind = event.kind
    payload: events_pb2.Allocation | events_pb2.DeviceChange | events_pb2.ContextDestroy
    if kind is Kind.PROCESS_EXIT:
        message.process_exit.wait_status = event.error_code
        message.process_exit.freed_bytes = event.freed_bytes
        return message
    if kind is Kind.SET_DEVICE:
        payload = message.device_change
        payload.context = event.address
    elif kind is Kind.CONTEXT_DESTROY:
        payload = message.context_destroy
        payload.context = event.address
    else:
        allocation = payload = message.allocation
        allocation.kind = wire_number(kind)
        allocation.object = wire_number(event.object)
        allocation.memory = wire_number(event.memory)
        allocation.size_bytes = event.size_bytes
        allocation.address = event.address
        allocation.handle = event.handle
        allocation.freed_bytes = event.freed_bytes
        allocation.stack_id = event.stack_id
        allocation.stream = event.stream
        allocation.sample_bytes = event.sample_bytes
        allocation.stack_status_code = wire_number(event.stack_status)
        allocation.stack_status = STACK_STATUS_NAMES[event.stack_status]  # for 0.1 clients
    payload.SetInParent()
    payload.api = wire_number(event.api)
    payload.api_name = event.api.name
    payload.layer = wire_number(event.layer)
    payload.device = event.device
    payload.error_code = event.error_code
    payload.caller_address = event.caller_address
    return message


def event_from_proto(message: events_pb2.Event) -> Event | None:
    """The model event of a wire event; None for events_lost, stack_definition, and events from
    a newer agent that this client cannot represent."""
    payload = message.WhichOneof("payload")
    call: events_pb2.Allocation | events_pb2.DeviceChange | events_pb2.ContextDestroy
    try:
        if payload == "allocation":
            call = allocation = message.allocation
            event = Event(kind=Kind(allocation.kind), api=Api(allocation.api), pid=message.pid, tid=message.tid,
                          timestamp_ns=message.timestamp_ns, object=enum_member(ObjectKind, allocation.object),
                          memory=enum_member(Memory, allocation.memory), size_bytes=allocation.size_bytes,
                          address=allocation.address, handle=allocation.handle, freed_bytes=allocation.freed_bytes,
                          stack_id=allocation.stack_id, stack_status=_stack_status(allocation),
                          stream=allocation.stream, sample_bytes=allocation.sample_bytes)
        elif payload == "device_change":
            call = message.device_change
            event = Event(kind=Kind.SET_DEVICE, api=Api(call.api), pid=message.pid, tid=message.tid,
                          timestamp_ns=message.timestamp_ns, address=call.context)
        elif payload == "context_destroy":
            call = message.context_destroy
            event = Event(kind=Kind.CONTEXT_DESTROY, api=Api(call.api), pid=message.pid, tid=message.tid,
                          timestamp_ns=message.timestamp_ns, address=call.context)
        elif payload == "process_exit":
            event = Event(kind=Kind.PROCESS_EXIT, api=Api.process_exit, pid=message.pid, tid=message.tid,
                          timestamp_ns=message.timestamp_ns, error_code=message.process_exit.wait_status,
                          freed_bytes=message.process_exit.freed_bytes)
        else:
            return None
        if payload != "process_exit":
            event.layer = enum_member(Layer, call.layer)
            event.device, event.error_code, event.caller_address = call.device, call.error_code, call.caller_address
    except ValueError:  # an enum value this client does not know: a newer agent
        return None
    event.comm, event.title, event.container = message.comm, message.title, message.container
    if message.source == events_pb2.EVENT_SOURCE_CUPTI:
        event.source = Source.CUPTI
    return event


def _stack_status(allocation: events_pb2.Allocation) -> StackStatus:
    if allocation.stack_status_code:
        return StackStatus(allocation.stack_status_code)
    # An agent of kvtrace 0.1 sends the text only.
    return _STACK_STATUS_BY_NAME.get(allocation.stack_status, StackStatus.NOT_WALKED)


def stack_message(stack_id: int, stack: Stack) -> events_pb2.Stack:
    return events_pb2.Stack(
        stack_id=stack_id, truncated=stack.truncated,
        frames=[events_pb2.StackFrame(function=frame.function, file=frame.file, line=frame.line)
                for frame in stack.frames])


def stack_to_proto(stack_id: int, stack: Stack) -> events_pb2.Event:
    return events_pb2.Event(timestamp_ns=time.time_ns(), stack_definition=stack_message(stack_id, stack))


def stack_from_proto(stack: events_pb2.Stack) -> tuple[int, Stack]:
    """(stack_id, model Stack) of a stack_definition; later events refer to it by stack_id."""
    return stack.stack_id, Stack(tuple(Frame(frame.function, frame.file, frame.line) for frame in stack.frames),
                                 stack.truncated)


def lost_to_proto(dropped_count: int, kernel_lost_count: int) -> events_pb2.Event:
    return events_pb2.Event(timestamp_ns=time.time_ns(), events_lost=events_pb2.EventsLost(
        dropped_count=dropped_count, kernel_lost_count=kernel_lost_count))
