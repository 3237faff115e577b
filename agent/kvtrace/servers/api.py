"""The kvtrace.v1 gRPC server: AgentService, grpc health and (on the Unix sockets only) reflection.

Secure by default and fail closed:
- the Unix sockets are created 0600 (umask) and only then opened to 0660 owner:group; the agent
  refuses to start if a path holds anything but a stale socket, or if ownership or permissions
  cannot be set;
- TCP is served only with mutual TLS (client certificates required), never in plaintext, and
  without reflection: it is a separate grpc.Server so that reflection cannot leak onto it.

Who sees what (gRPC Python cannot read SO_PEERCRED, so the kernel's file permissions decide):
- the socket (--socket, 0660 root:--group) serves VIEW_REDACTED: titles with secrets redacted as
  /metrics redacts them, no Python stacks or native callers, no addresses, no vLLM request ids; a
  member of the group learns no more than /metrics tells anyone on the host;
- the admin socket (--admin-socket, by default next to it; 0600 root, or 0660 with --admin-group)
  and TCP with mTLS serve VIEW_FULL. All share one hub and one set of stream slots.

Untrusted input stays bounded: title regexes run in RE2 (linear time) on at most 4096 characters,
once per title; without RE2 a title regex is refused, never run in Python's backtracking `re`.
A stream that does not read costs its bounded queue and no work per event (the hub parks it); when
all stream slots are taken, the longest-stalled stream is ended for a new one.

Usage (the agent command):

    server = AgentServer(session, analyzer, config)   # config: kvtrace.config.ApiConfig
    session.add_sink(server.hub)            # events reach the streams
    server.hub.on_readers_changed = session.refresh_block_readers  # streams that read every block come and go
    server.start()                          # raises ServerSetupError with one clear line
    ...
    server.stop(grace_seconds=5)            # on SIGTERM
"""
from __future__ import annotations

import base64
import binascii
import errno
import functools
import grp
import hashlib
import heapq
import logging
import operator
import os
import pwd
import re
import socket
import ssl
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import psutil
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvtrace._proto.kvtrace.v1 import agent_service_pb2 as service_pb2
from kvtrace._proto.kvtrace.v1 import agent_service_pb2_grpc as service_grpc
from kvtrace._proto.kvtrace.v1 import events_pb2
from kvtrace.config import ApiConfig
from kvtrace.model.depth import NO_REQUEST, REQUEST_WITHDRAWN, Depth, DepthCause, DepthRequest, ProcessDepth
from kvtrace.model.events import Event, EventRun, Kind, Layer
from kvtrace.model.ledger import LedgerReadRefused, Outstanding
from kvtrace.model.processes import CONTROL_CHARACTERS, ProcessInfo, TitlePattern, redact_title
from kvtrace.reports.flight import FlightDumpError, FlightRecorder
from kvtrace.reports.recorder import FrameEncoder, ProcessFilter, RecordQueue, encode_stream, recording_header
from kvtrace.servers.backend import AgentAnalysis, AgentState
from kvtrace.servers.hub import EventFilter, EventHub, Lost, QueueItem, Subscription, flatten
from kvtrace.wire import (
    FixedColumnsBatch,
    cross_checks_to_proto,
    depth_to_proto,
    depths_to_proto,
    event_to_proto,
    events_to_columns,
    growth_to_proto,
    info_to_proto,
    leak_report_to_proto,
    lost_to_proto,
    outstanding_to_proto,
    process_to_proto,
    stack_message,
    stack_to_proto,
    vllm_engines_to_proto,
)

try:  # google-re2: linear-time matching for clients' regexes. A host without it refuses them.
    import re2
except ImportError:  # pragma: no cover - depends on the host
    re2 = None

log = logging.getLogger(__name__)

SERVICE_NAME = service_pb2.DESCRIPTOR.services_by_name["AgentService"].full_name

MAX_FILTER_PIDS = 1024
_STACK_ID = operator.attrgetter("stack_id")
MAX_TITLE_REGEX_CHARS = 1024
MAX_REGEX_MEMORY_BYTES = 8 << 20  # RE2's budget for one compiled title regex
NO_SAFE_REGEX = "this agent has no safe regex engine; install google-re2 (pip install google-re2)"
MAX_SIZE_BYTES = 1 << 50  # 1 PiB: no GPU allocation is larger; beyond it the value is a mistake
DEFAULT_PAGE_SIZE = 1000
MAX_PAGE_SIZE = 10000
MAX_PAGE_TOKEN_CHARS = 256
DEFAULT_SUSPECTS = 100
MAX_SUSPECTS = 10000
MAX_MIN_AGE_SECONDS = 365 * 24 * 3600.0
# SetProcessDepth: how long an operator's request holds (`kvtrace deep --for`).
DEFAULT_DEPTH_SECONDS = 600.0
MIN_DEPTH_SECONDS = 1.0
MAX_DEPTH_SECONDS = 24 * 3600.0
MAX_PID = 1 << 22  # the kernel's largest pid_max (64-bit)
SOCKET_PATH_MAX_BYTES = 107  # sun_path is 108 bytes with the terminating NUL
SOCKET_MODE = 0o660
ADMIN_SOCKET_MODE = 0o600  # root only, unless an admin group is given (then SOCKET_MODE)
SOCKET_DIRECTORY_MODE = 0o750
_TITLE_CACHE_MAX_ENTRIES = 4096

VIEW_FULL = service_pb2.VIEW_FULL
VIEW_REDACTED = service_pb2.VIEW_REDACTED
ENCODING_COLUMNS = service_pb2.EVENT_ENCODING_COLUMNS
ENCODING_FIXED_COLUMNS = service_pb2.EVENT_ENCODING_FIXED_COLUMNS


class ServerSetupError(Exception):
    """The server cannot start safely. The message is one line for the operator."""


@dataclass(frozen=True)
class ServerLimits:
    # Concurrent StreamEvents calls, all endpoints together. When all are taken, the stream that has
    # not read for longest is ended (if that is at least evict_stalled_seconds) for the new one;
    # otherwise the new one gets RESOURCE_EXHAUSTED.
    max_streams: int = 64
    evict_stalled_seconds: float = 10.0
    max_receive_message_bytes: int = 4 << 20
    batch_max_events: int = 512  # events per StreamEventsResponse
    # ... with EVENT_ENCODING_COLUMNS (~25 bytes an event). Each response costs the stream's thread a
    # hand-over of the GIL or two (a few ms while the event loop is busy): big ones keep it fed.
    column_batch_max_events: int = 8192
    # A stream waiting for events wakes at once for an event, a cancel or the shutdown; besides
    # that it looks at its call this often (a cheap wake-up, not a poll for events).
    idle_wake_seconds: float = 1.0
    health_poll_seconds: float = 1.0
    extra_workers: int = 16  # threads beyond max_streams, for unary calls and health watches


class InvalidArgument(Exception):
    """A request field is wrong; becomes INVALID_ARGUMENT with `field: reason`."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")


# ---- requests -> model filters ----

def _enum_values(field: str, values, enum_type) -> frozenset:
    """Proto3 keeps unknown enum numbers as plain ints: refuse them, and the zero value, by name."""
    members = []
    for index, value in enumerate(values):
        if value not in enum_type._value2member_map_:
            raise InvalidArgument(f"{field}[{index}]", f"unknown or unspecified value {value}")
        members.append(enum_type(value))
    return frozenset(members)


def _pids(field: str, pids) -> frozenset[int]:
    if len(pids) > MAX_FILTER_PIDS:
        raise InvalidArgument(field, f"{len(pids)} pids; at most {MAX_FILTER_PIDS}")
    return frozenset(pids)


def compile_title_regex(pattern: str) -> TitlePattern:
    """A client's title regex in RE2, whose matching is linear in the text: `(a+)+$` cannot stall
    the agent. Python's `re` backtracks (exponential time), so without RE2 the filter is refused."""
    if len(pattern) > MAX_TITLE_REGEX_CHARS:
        raise InvalidArgument("title_regex", f"longer than {MAX_TITLE_REGEX_CHARS} characters")
    if re2 is None:
        raise InvalidArgument("title_regex", NO_SAFE_REGEX)
    options = re2.Options()
    options.log_errors = False  # a client's typo is its error, not a line in the agent's log
    options.max_mem = MAX_REGEX_MEMORY_BYTES
    try:
        return re2.compile(pattern, options)
    except re2.error as error:
        reason = error.args[0] if error.args else error
        if isinstance(reason, bytes):
            reason = reason.decode("utf-8", "replace")
        raise InvalidArgument("title_regex", f"not a valid RE2 regular expression: {reason}") from None


def stream_filter(request: service_pb2.StreamEventsRequest, redacted_titles: bool = False) -> EventFilter:
    title_regex = compile_title_regex(request.title_regex) if request.title_regex else None
    # A negative int64 sent by a careless client arrives as a uint64 above 2**63: absurd as well.
    if request.min_size_bytes > MAX_SIZE_BYTES:
        raise InvalidArgument("min_size_bytes", f"{request.min_size_bytes} is more than 1 PiB")
    # In the redacted view the regex sees redacted titles: it must not probe for a secret.
    return EventFilter(pids=_pids("pids", request.pids), title_regex=title_regex,
                       redacted_titles=redacted_titles and title_regex is not None,
                       kinds=_enum_values("kinds", request.kinds, Kind),
                       layers=_enum_values("layers", request.layers, Layer),
                       min_size_bytes=request.min_size_bytes)


def _ledger_order(entry: Outstanding) -> tuple[int, int, int, int]:
    key = entry.key
    return key.pid, int(key.layer), int(key.object), key.address


def encode_page_token(position: tuple[int, int, int, int]) -> str:
    return base64.urlsafe_b64encode(("v1:" + ":".join(map(str, position))).encode()).decode()


def decode_page_token(token: str) -> tuple[int, int, int, int]:
    """The ledger position after which the next page starts."""
    try:
        if len(token) > MAX_PAGE_TOKEN_CHARS:
            raise ValueError
        version, *fields = base64.urlsafe_b64decode(token.encode("ascii")).decode("ascii").split(":")
        position = tuple(int(field) for field in fields)
        if version != "v1" or len(position) != 4 or min(position) < 0:
            raise ValueError
    except (ValueError, UnicodeError, binascii.Error):
        raise InvalidArgument("page_token", "not a token from a previous GetSnapshot response") from None
    return position


class TokenSeal:
    """Page tokens for the redacted view: a position holds an address, so it travels encrypted
    (a keystream from the agent's random key and a per-token nonce)."""

    NONCE_BYTES = 12

    def __init__(self, key: bytes | None = None) -> None:
        self._key = key or os.urandom(32)

    def _stream(self, nonce: bytes, length: int) -> bytes:
        return hashlib.shake_256(self._key + nonce).digest(length)

    def seal(self, token: str) -> str:
        nonce, data = os.urandom(self.NONCE_BYTES), token.encode("ascii")
        body = bytes(a ^ b for a, b in zip(data, self._stream(nonce, len(data)), strict=True))
        return base64.urlsafe_b64encode(nonce + body).decode("ascii")

    def unseal(self, token: str) -> tuple[int, int, int, int]:
        try:
            if len(token) > MAX_PAGE_TOKEN_CHARS:
                raise ValueError
            raw = base64.urlsafe_b64decode(token.encode("ascii"))
            nonce, body = raw[:self.NONCE_BYTES], raw[self.NONCE_BYTES:]
            if len(nonce) != self.NONCE_BYTES:
                raise ValueError
            plain = bytes(a ^ b for a, b in zip(body, self._stream(nonce, len(body)), strict=True))
            return decode_page_token(plain.decode("ascii"))
        except (ValueError, UnicodeError, binascii.Error):
            raise InvalidArgument("page_token", "not a token from a previous GetSnapshot response") from None


# ---- the redacted view: what a member of the socket's group may see ----

class TitleRedactor:
    """redact_title with a bounded cache: a stream redacts the same few titles again and again."""

    def __init__(self) -> None:
        self._cache: dict[str, str] = {}

    def __call__(self, title: str) -> str:
        redacted = self._cache.get(title)
        if redacted is None:
            if len(self._cache) >= _TITLE_CACHE_MAX_ENTRIES:
                self._cache.clear()
            redacted = self._cache[title] = redact_title(title)
        return redacted


def redact_event(message: events_pb2.Event, title=redact_title) -> events_pb2.Event:
    """In place: the title redacted; addresses, handles, streams, contexts, callers and the stack
    reference at their defaults. A stack_definition must not be sent at all."""
    message.title = title(message.title)
    payload = message.WhichOneof("payload")
    if payload == "allocation":
        allocation = message.allocation
        allocation.address = allocation.handle = allocation.stream = 0
        allocation.caller_address = allocation.stack_id = 0
    elif payload in ("device_change", "context_destroy"):
        call = getattr(message, payload)
        call.context = call.caller_address = 0
    return message


def redact_outstanding(message: service_pb2.OutstandingAllocation) -> service_pb2.OutstandingAllocation:
    message.title = redact_title(message.title)
    message.address = message.caller_address = message.stack_id = message.handle = message.stream = 0
    return message


def redact_depths(states) -> None:
    """A depth's detail is the policy's words, which may quote a title or a vLLM finding: secrets go."""
    for state in states:
        if state.detail:
            state.detail = redact_title(state.detail)


def redact_processes(message: service_pb2.ListProcessesResponse) -> service_pb2.ListProcessesResponse:
    for process in message.processes:
        process.title = redact_title(process.title)
    redact_depths(process.depth for process in message.processes)
    message.view = VIEW_REDACTED
    return message


def redact_leak_report(message: service_pb2.ListLeakSuspectsResponse) -> service_pb2.ListLeakSuspectsResponse:
    for suspect in message.suspects:
        suspect.title = redact_title(suspect.title)
        suspect.stack_id = suspect.caller_address = 0
        suspect.ClearField("stack")
        suspect.ClearField("native_caller")
    redact_depths(message.depths)
    message.view = VIEW_REDACTED
    return message


def redact_info(message: service_pb2.GetAgentInfoResponse) -> service_pb2.GetAgentInfoResponse:
    """No file paths or pids of other users: libraries by file name only, components that name a
    library (attach:PATH) as one `attach` entry, reasons that may carry paths left out."""
    for library in message.attached_libraries:
        library.path = os.path.basename(library.path)
        del library.pids[:]
    attach = [component for component in message.components if component.name.startswith("attach:")]
    kept = [component for component in message.components if not component.name.startswith("attach:")]
    del message.components[:]
    for component in kept:
        message.components.add(name=component.name, up=component.up,
                               reason="" if component.name in _REASONS_WITH_PATHS else component.reason)
    if attach:
        message.components.add(name="attach", up=False,
                               reason=f"{len(attach)} libraries refused (the admin socket names them)")
    return message


# Components whose reasons name files of other users (the admin socket has them whole).
_REASONS_WITH_PATHS = frozenset({"libraries"})


def redact_growth(message: service_pb2.GetGrowthResponse) -> service_pb2.GetGrowthResponse:
    for row in message.processes:
        row.title = redact_title(row.title)
    redact_depths(row.depth for row in message.processes)
    message.view = VIEW_REDACTED
    return message


def redact_vllm_engines(message: service_pb2.GetVllmEnginesResponse) -> service_pb2.GetVllmEnginesResponse:
    """Titles redacted, and request ids left out (counts, states and blocks kept): vLLM takes a
    request's id from the client's X-Request-Id header or makes one per completion, so an id can
    carry what a user sent and ties a request to its caller; /metrics names no request, and the
    group socket must not tell more. A finding's message can name ids and the title: the ids are
    replaced there by *** (whole words only, longest first) and secrets redacted as in titles."""
    request_ids: set[str] = set()
    for engine in message.engines:
        engine.title = redact_title(engine.title)
        redact_depths(engine.depths)
        for request in engine.holders:
            request_ids.add(request.request_id)
            request.request_id = ""
    for finding in message.findings:
        for request in finding.requests:
            request_ids.add(request.request_id)
            request.request_id = ""
    request_ids.discard("")
    words = re.compile("|".join(f"(?<![\\w.:-]){re.escape(request_id)}(?![\\w.:-])"
                                for request_id in sorted(request_ids, key=len, reverse=True))) \
        if request_ids else None
    for finding in message.findings:
        text = words.sub("***", finding.message) if words is not None else finding.message
        finding.message = redact_title(text)
    message.view = VIEW_REDACTED
    return message


# ---- stream slots ----

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


# ---- the service ----

MAX_RECORDING_STREAMS = 4
MAX_DUMP_REASON_CHARS = 256


def printable_reason(text: str) -> str:
    """A client's reason as one line of plain text (it goes into the log and the dump's header)."""
    return CONTROL_CHARACTERS.sub(" ", text)


class AgentServicer(service_grpc.AgentServiceServicer):
    """AgentService for one view: VIEW_REDACTED on the group socket, VIEW_FULL elsewhere."""

    def __init__(self, state: AgentState, analysis: AgentAnalysis, hub: EventHub,
                 limits: ServerLimits, view: service_pb2.View = VIEW_FULL,
                 slots: StreamSlots | None = None, flight: FlightRecorder | None = None) -> None:
        self._state = state
        self._analysis = analysis
        self._hub = hub
        self._flight = flight
        self._recordings = threading.BoundedSemaphore(MAX_RECORDING_STREAMS)
        self._limits = limits
        self.view = view
        self._redacted = view == VIEW_REDACTED
        self._slots = slots if slots is not None else StreamSlots(limits)
        self._seal = TokenSeal()
        self.stopping = threading.Event()

    def StreamEvents(self, request, context):
        try:
            event_filter = stream_filter(request, redacted_titles=self._redacted)
        except InvalidArgument as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        subscription = self._hub.subscribe(event_filter)
        if not self._slots.open(subscription, context):
            self._hub.unsubscribe(subscription)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"the agent already serves {self._limits.max_streams} event streams (its limit), "
                          "all of them reading")
        context.add_callback(subscription.close)  # a cancel or an expired deadline wakes the reader
        sent_stacks: set[int] = set()
        titles = TitleRedactor() if self._redacted else None
        columns = request.encoding in (ENCODING_COLUMNS, ENCODING_FIXED_COLUMNS)
        fixed = request.encoding == ENCODING_FIXED_COLUMNS and titles is None  # the full view's records
        responses = functools.partial(self._column_responses, fixed=fixed) if columns else self._message_responses
        batch_max_events = self._limits.column_batch_max_events if columns else self._limits.batch_max_events
        try:
            while context.is_active() and not self.stopping.is_set() and not subscription.closed:
                wait_seconds = self._limits.idle_wake_seconds
                remaining = context.time_remaining()
                if remaining is not None:
                    if remaining <= 0:  # say so, rather than end the stream as if completed
                        context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the stream's deadline passed")
                    wait_seconds = min(wait_seconds, remaining)
                items = subscription.read_batches(batch_max_events, wait_seconds)
                if items:
                    yield from responses(items, sent_stacks, titles)
            if self.stopping.is_set():
                context.abort(grpc.StatusCode.UNAVAILABLE, "the kvtrace agent is shutting down")
            if subscription.evicted_reason:  # ended for a new stream (StreamSlots), not completed
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, subscription.evicted_reason)
        finally:
            self._hub.unsubscribe(subscription)
            self._slots.close(subscription)

    def _message_responses(self, items: list[QueueItem], sent_stacks: set[int],
                           titles: TitleRedactor | None) -> list[service_pb2.StreamEventsResponse]:
        return [service_pb2.StreamEventsResponse(events=self._messages(flatten(items), sent_stacks, titles),
                                                 view=self.view)]

    def _column_responses(self, items: list[QueueItem], sent_stacks: set[int], titles: TitleRedactor | None,
                          fixed: bool = False) -> list[service_pb2.StreamEventsResponse]:
        """EVENT_ENCODING_COLUMNS: the events between loss markers in one response's columns, after the
        stack definitions they need; a loss marker goes in `events`, and so ends a response (what follows
        it goes in the next), keeping the stream's order. `fixed` (EVENT_ENCODING_FIXED_COLUMNS, full
        view): consecutive runs with their records go in one response's fixed_columns, copied."""
        responses = []
        events: list[Event] = []  # waiting for a response's columns
        runs = FixedColumnsBatch()  # waiting for a response's fixed_columns (never both waiting)

        def flush() -> None:
            if events:
                responses.append(self._columns_response(events, sent_stacks, titles))
                events.clear()
            if runs:
                response = service_pb2.StreamEventsResponse(view=self.view)
                runs.into(response.fixed_columns)
                responses.append(response)
                runs.clear()

        for item in items:
            if isinstance(item, Lost):
                flush()
                lost = lost_to_proto(item.dropped_count, item.kernel_lost_count)
                responses.append(service_pb2.StreamEventsResponse(events=[lost], view=self.view))
            elif fixed and isinstance(item, EventRun) and item.labels is not None:
                if events or not runs.takes(item):
                    flush()
                runs.add(item)
            else:
                if runs:
                    flush()
                events.extend(item)
        flush()
        return responses

    def _columns_response(self, events: list, sent_stacks: set[int],
                          titles: TitleRedactor | None) -> service_pb2.StreamEventsResponse:
        """One run of events (no markers) in columns, after the definitions of its new stacks."""
        messages = []
        if titles is None:
            for stack_id in sorted(set(map(_STACK_ID, events)) - sent_stacks - {0}):
                sent_stacks.add(stack_id)
                stack = self._state.stack(stack_id)
                if stack is not None:
                    messages.append(stack_to_proto(stack_id, stack))
        return service_pb2.StreamEventsResponse(events=messages, view=self.view,
                                                columns=events_to_columns(events, titles))

    def _messages(self, items: list[Event | Lost], sent_stacks: set[int],
                  titles: TitleRedactor | None) -> list[events_pb2.Event]:
        """Wire events for a batch; each stack is defined once per stream, before its first use
        (never in the redacted view, whose events are redacted)."""
        messages = []
        for item in items:
            if isinstance(item, Lost):
                messages.append(lost_to_proto(item.dropped_count, item.kernel_lost_count))
                continue
            if titles is not None:
                messages.append(redact_event(event_to_proto(item), titles))
                continue
            if item.stack_id and item.stack_id not in sent_stacks:
                sent_stacks.add(item.stack_id)
                stack = self._state.stack(item.stack_id)
                if stack is not None:
                    messages.append(stack_to_proto(item.stack_id, stack))
            messages.append(event_to_proto(item))
        return messages

    def StreamRecording(self, request, context):
        self._admin_only(context, "a recording holds stacks and addresses")
        try:
            wanted = ProcessFilter(_pids("pids", request.pids),
                                   compile_title_regex(request.title_regex) if request.title_regex else None)
        except InvalidArgument as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        if not self._recordings.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"the agent already streams {MAX_RECORDING_STREAMS} recordings (its limit)")
        queue = RecordQueue(self._state, wanted)
        context.add_callback(queue.close)  # a cancel wakes the reader
        try:
            try:
                checkpoint = self._state.subscribe(queue)
            except LedgerReadRefused as refused:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"the recording cannot start: {refused}")
            encoder = FrameEncoder(self._state.stack, self._state.process, wanted,
                                   depths_of=self._state.process_depths, native_of=self._state.native_caller)
            header = recording_header(self._state.started_wall_seconds,
                                      self._analysis.options.leak_min_age_seconds, checkpoint.timestamp_ns,
                                      wanted.describe(request.title_regex))
            yield service_pb2.StreamRecordingResponse(header=header)
            for frames in encode_stream(queue, encoder, checkpoint, self._limits.batch_max_events,
                                        lambda: context.is_active() and not self.stopping.is_set(),
                                        self._limits.idle_wake_seconds):
                yield service_pb2.StreamRecordingResponse(frames=frames)
            if self.stopping.is_set():
                context.abort(grpc.StatusCode.UNAVAILABLE, "the kvtrace agent is shutting down")
        finally:
            self._state.remove_sink(queue)
            queue.close()
            self._recordings.release()

    def DumpFlightRecorder(self, request, context):
        self._admin_only(context, "a dump is written on the agent's host")
        flight = self._flight
        if flight is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the agent runs without a flight recorder "
                          "(it was started with --no-flight-recorder)")
            return None  # abort raised
        if len(request.reason) > MAX_DUMP_REASON_CHARS:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"reason: more than {MAX_DUMP_REASON_CHARS} characters")
        reason = "asked through the API" + (f": {printable_reason(request.reason)}" if request.reason else "")
        try:
            dump = flight.request(service_pb2.FLIGHT_TRIGGER_KIND_REQUEST, reason)
        except FlightDumpError as error:
            context.abort(grpc.StatusCode.INTERNAL, str(error))
        return service_pb2.DumpFlightRecorderResponse(dump=dump)

    def ListFlightDumps(self, request, context):
        self._admin_only(context, "dumps name processes and paths on the agent's host")
        if self._flight is None:
            return service_pb2.ListFlightDumpsResponse()
        return service_pb2.ListFlightDumpsResponse(dumps=self._flight.dumps(),
                                                   directory=str(self._flight.options.directory))

    def _admin_only(self, context: grpc.ServicerContext, why: str) -> None:
        if self._redacted:
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"{why}: use the admin socket (run as root, or ask for the agent's --admin-group)")

    def GetSnapshot(self, request, context):
        try:
            pids = _pids("pids", request.pids)
            layers = _enum_values("layers", request.layers, Layer)
            if not 0 <= request.page_size <= MAX_PAGE_SIZE:
                raise InvalidArgument("page_size", f"{request.page_size} is not in 0..{MAX_PAGE_SIZE}")
            after = None
            if request.page_token:
                after = self._seal.unseal(request.page_token) if self._redacted \
                    else decode_page_token(request.page_token)
        except InvalidArgument as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        page_size = request.page_size or DEFAULT_PAGE_SIZE
        timestamp_ns = self._state.wall_clock_ns()
        # Gone through once, never held: the kernel's copy may have millions of entries.
        candidates = (entry for entry in self._state.outstanding(pids)
                      if (not pids or entry.key.pid in pids) and (not layers or entry.key.layer in layers)
                      and (after is None or _ledger_order(entry) > after))
        # One more than a page tells whether another page follows; nsmallest avoids a full sort.
        page = heapq.nsmallest(page_size + 1, candidates, key=_ledger_order)
        next_token = encode_page_token(_ledger_order(page[page_size - 1])) if len(page) > page_size else ""
        processes: dict[int, ProcessInfo | None] = {}
        allocations = []
        for entry in page[:page_size]:
            pid = entry.key.pid
            if pid not in processes:
                processes[pid] = self._state.process(pid)
            allocations.append(outstanding_to_proto(entry, processes[pid]))
        depths = depths_to_proto(self._state.process_depths(), processes)
        if self._redacted:
            redact_depths(depths)
            return service_pb2.GetSnapshotResponse(
                allocations=[redact_outstanding(allocation) for allocation in allocations],
                next_page_token=self._seal.seal(next_token) if next_token else "",
                timestamp_ns=timestamp_ns, view=VIEW_REDACTED, depths=depths)
        stacks = []
        for stack_id in sorted({entry.stack_id for entry in page[:page_size] if entry.stack_id}):
            stack = self._state.stack(stack_id)
            if stack is not None:
                stacks.append(stack_message(stack_id, stack))
        return service_pb2.GetSnapshotResponse(allocations=allocations, next_page_token=next_token,
                                               timestamp_ns=timestamp_ns, stacks=stacks, view=VIEW_FULL,
                                               depths=depths)

    def ListProcesses(self, request, context):
        processes = sorted(self._state.processes_holding_memory(), key=lambda process: process.pid)
        depths = self._state.process_depths()
        response = service_pb2.ListProcessesResponse(
            processes=[process_to_proto(p, depths.get(p.pid)) for p in processes], view=VIEW_FULL)
        return redact_processes(response) if self._redacted else response

    def GetAgentInfo(self, request, context):
        info = self._state.info()
        # The API's own figures: how many streams it feeds and how many events it offered them.
        info.counters["subscribers"] = self._hub.subscriber_count()
        info.counters["subscribers_parked"] = self._hub.parked_count()
        info.counters["streams_evicted"] = self._slots.evicted_total
        info.counters["events_published"] = self._hub.published_total
        response = info_to_proto(info)
        response.view = self.view
        return redact_info(response) if self.view == VIEW_REDACTED else response

    def ListLeakSuspects(self, request, context):
        try:
            pids = _pids("pids", request.pids)
            min_age_seconds = request.min_age_seconds if request.HasField("min_age_seconds") else None
            if min_age_seconds is not None and not 0 <= min_age_seconds <= MAX_MIN_AGE_SECONDS:  # NaN too
                raise InvalidArgument("min_age_seconds", f"{min_age_seconds} is not in 0..{MAX_MIN_AGE_SECONDS:g}")
            if not 0 <= request.limit <= MAX_SUSPECTS:
                raise InvalidArgument("limit", f"{request.limit} is not in 0..{MAX_SUSPECTS}")
        except InvalidArgument as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        report = self._analysis.leak_report(pids, min_age_seconds, request.limit or DEFAULT_SUSPECTS)
        response = leak_report_to_proto(report, self._state.process_depths(), pids)
        response.view = VIEW_FULL
        return redact_leak_report(response) if self._redacted else response

    def GetGrowth(self, request, context):
        try:
            pids = _pids("pids", request.pids)
        except InvalidArgument as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        response = growth_to_proto(self._analysis.latest, pids, self._state.process_depths())
        response.view = VIEW_FULL
        return redact_growth(response) if self._redacted else response

    def GetCrossCheck(self, request, context):
        try:
            pids = _pids("pids", request.pids)
        except InvalidArgument as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        checks = [check for check in self._state.cross_checks() if not pids or check.pid in pids]
        return cross_checks_to_proto(sorted(checks, key=lambda check: (not check.finished, check.pid)),
                                     with_addresses=not self._redacted)

    def GetVllmEngines(self, request, context):
        try:
            pids = _pids("pids", request.pids)
        except InvalidArgument as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        response = vllm_engines_to_proto(self._analysis.latest, pids, self._state.process_depths())
        response.view = VIEW_FULL
        return redact_vllm_engines(response) if self._redacted else response

    def SetProcessDepth(self, request, context):
        self._admin_only(context, "a depth changes what the agent traces in a process, and what that costs")
        try:
            if not 0 < request.pid <= MAX_PID:
                raise InvalidArgument("pid", f"{request.pid} is not a process id (1 to {MAX_PID})")
            try:
                depth = Depth(request.depth)
            except ValueError:
                raise InvalidArgument("depth", f"unknown or unspecified value {request.depth}: PROCESS_DEPTH_BLOCKS, "
                                      "PROCESS_DEPTH_FULL, or PROCESS_DEPTH_SEGMENTS to withdraw a request") from None
            seconds = request.duration_seconds or DEFAULT_DEPTH_SECONDS
            if not MIN_DEPTH_SECONDS <= seconds <= MAX_DEPTH_SECONDS:  # NaN too
                raise InvalidArgument("duration_seconds", f"{request.duration_seconds:g} is not in "
                                      f"{MIN_DEPTH_SECONDS:g}..{MAX_DEPTH_SECONDS:g} seconds (1 s to 24 h; "
                                      f"0: the default, {DEFAULT_DEPTH_SECONDS:g})")
        except InvalidArgument as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        refusal = self._state.depth_refusal(None if depth is Depth.SEGMENTS else request.pid)
        if refusal:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"the agent does not take depth requests now: {refusal}")
        pid = request.pid
        # When the process started: a request holds for it, not for a later process that takes its pid.
        try:
            started_ns = int(psutil.Process(pid).create_time() * 1e9)
        except psutil.NoSuchProcess:  # gone, or gone in between
            context.abort(grpc.StatusCode.NOT_FOUND, f"no process {pid} runs on the agent's host (pids are the "
                          "host's: inside a container, look the pid up with `kvtrace ps`)")
        except psutil.Error:
            started_ns = 0  # not known
        now_ns = self._state.wall_clock_ns()
        current = self._state.process_depths().get(pid)
        if depth is Depth.SEGMENTS:
            had = pid in self._state.depth_requests() or (current is not None and current.cause is DepthCause.OPERATOR)
            self._state.request_depth(DepthRequest(pid, depth, now_ns, now_ns, started_ns))
            requested = ProcessDepth(pid, depth, now_ns, DepthCause.OPERATOR, REQUEST_WITHDRAWN if had else NO_REQUEST)
            log.info("SetProcessDepth: %s for pid %d", "the request withdrawn" if had else "no request to withdraw",
                     pid)
        else:
            until_ns = now_ns + int(seconds * 1e9)
            self._state.request_depth(DepthRequest(pid, depth, now_ns, until_ns, started_ns))
            requested = ProcessDepth(pid, depth, now_ns, DepthCause.OPERATOR, f"asked for {seconds:g} s",
                                     until_ns=until_ns)
            log.info("SetProcessDepth: pid %d asked at depth %s for %g s", pid, depth.label, seconds)
        response = service_pb2.SetProcessDepthResponse(requested=depth_to_proto(requested))
        if current is not None:
            response.current.CopyFrom(depth_to_proto(current))
        return response


# ---- the Unix socket ----

def socket_group_id(group: str) -> int:
    """The gid for the socket; root's group, with a warning, if the group does not exist."""
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        root_gid = pwd.getpwuid(0).pw_gid
        log.warning("group %r does not exist: the API socket gets root's group (gid %d), so only "
                    "root can use it; create the group with `groupadd --system %s`", group, root_gid, group)
        return root_gid


def _listener_on(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except OSError as error:
            if error.errno in (errno.ECONNREFUSED, errno.ENOENT):
                return False
            raise ServerSetupError(f"cannot tell whether {path} is in use: {error.strerror}") from None
        return True


def prepare_socket_path(path: Path, gid: int) -> None:
    """Makes the socket's directory if missing, and clears a stale socket; refuses anything else."""
    if len(os.fsencode(path)) > SOCKET_PATH_MAX_BYTES:
        raise ServerSetupError(f"socket path {path} is longer than {SOCKET_PATH_MAX_BYTES} bytes")
    directory = path.parent
    if not directory.exists():
        # Only a directory we create gets our mode: never chmod an existing one (it may be /tmp).
        try:
            directory.mkdir(parents=True, mode=SOCKET_DIRECTORY_MODE)
            os.chown(directory, -1, gid)
            os.chmod(directory, SOCKET_DIRECTORY_MODE)
        except OSError as error:
            raise ServerSetupError(f"cannot create {directory} (mode 0750, gid {gid}): {error.strerror}") from None
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ServerSetupError(f"{path} exists and is not a socket; refusing to replace it "
                               "(move it away, or choose another --socket)")
    if _listener_on(path):
        raise ServerSetupError(f"another process is already serving on {path} (is an agent running?)")
    log.info("removing stale socket %s", path)
    path.unlink()


def _secure_port_credentials(config: ApiConfig) -> grpc.ServerCredentials:
    """Mutual TLS credentials; the files are checked here so that a bad one stops the start."""
    contents = {}
    files: dict[str, Path] = {}
    for name in ("tls_cert", "tls_key", "tls_client_ca"):
        file = getattr(config, name)
        try:
            contents[name] = file.read_bytes()
        except (OSError, AttributeError) as error:
            raise ServerSetupError(f"cannot read {name} {file}: {getattr(error, 'strerror', error)}") from None
        files[name] = file
    try:
        check = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        check.load_cert_chain(files["tls_cert"], files["tls_key"])
        check.load_verify_locations(cafile=files["tls_client_ca"])
    except (ssl.SSLError, ValueError) as error:
        raise ServerSetupError(f"the TLS files do not load ({config.tls_cert}, {config.tls_key}, "
                               f"{config.tls_client_ca}): {error}") from None
    return grpc.ssl_server_credentials([(contents["tls_key"], contents["tls_cert"])],
                                       root_certificates=contents["tls_client_ca"],
                                       require_client_auth=True)


class AgentServer:
    """The gRPC endpoints of the agent: the group socket (redacted), the admin socket (full detail)
    and TCP with mTLS (full detail) when configured. One hub and one set of stream slots for all."""

    def __init__(self, state: AgentState, analysis: AgentAnalysis, config: ApiConfig,
                 limits: ServerLimits = ServerLimits(), max_queued_events: int | None = None,
                 flight: FlightRecorder | None = None) -> None:
        self.state = state
        # Each stream's bounded queue; the agent adds this as a Session sink.
        self.hub = EventHub(max_queued_events) if max_queued_events else EventHub()
        self.config = config
        self.limits = limits
        self.slots = StreamSlots(limits)
        self.servicer = AgentServicer(state, analysis, self.hub, limits, VIEW_FULL, self.slots, flight)
        self.redacted_servicer = AgentServicer(state, analysis, self.hub, limits, VIEW_REDACTED, self.slots, flight)
        self.health = health.HealthServicer()
        self.tcp_port: int | None = None
        self._servers: list[grpc.Server] = []
        self._socket_inodes: dict[Path, int] = {}
        self._stop_polling = threading.Event()
        self._poller: threading.Thread | None = None

    def _new_server(self, servicer: AgentServicer, reflection_enabled: bool) -> grpc.Server:
        workers = self.limits.max_streams + self.limits.extra_workers
        server = grpc.server(
            ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvtrace-grpc"),
            maximum_concurrent_rpcs=workers,
            options=[("grpc.max_receive_message_length", self.limits.max_receive_message_bytes),
                     ("grpc.so_reuseport", 0)])
        service_grpc.add_AgentServiceServicer_to_server(servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        if reflection_enabled:
            reflection.enable_server_reflection(
                (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        self._servers.append(server)
        return server

    def start(self) -> None:
        try:
            gid = socket_group_id(self.config.group)
            self._start_unix(self.config.socket, gid, SOCKET_MODE, self.redacted_servicer)
            admin = self.config.admin_path
            if admin is not None:
                if self.config.admin_group:
                    self._start_unix(admin, socket_group_id(self.config.admin_group), SOCKET_MODE, self.servicer)
                else:
                    self._start_unix(admin, gid, ADMIN_SOCKET_MODE, self.servicer)
            if self.config.tcp_enabled:
                self._start_tcp()
        except BaseException:
            self.stop(grace_seconds=0)
            raise
        self._set_health(self._state_healthy())
        self._poller = threading.Thread(target=self._poll_health, name="kvtrace-health", daemon=True)
        self._poller.start()

    def _start_unix(self, path: Path, gid: int, mode: int, servicer: AgentServicer) -> None:
        prepare_socket_path(path, gid)
        server = self._new_server(servicer, reflection_enabled=True)
        # gRPC creates the socket with the process umask: make it owner-only until chmod opens it
        # to the group, so there is no moment where others could connect.
        previous_umask = os.umask(0o177)
        try:
            server.add_insecure_port(f"unix:{path}")
        except RuntimeError as error:
            raise ServerSetupError(f"cannot listen on {path}: {error}") from None
        finally:
            os.umask(previous_umask)
        try:
            self._socket_inodes[path] = os.lstat(path).st_ino  # ours now: stop() removes it
            os.chown(path, -1, gid)
            os.chmod(path, mode)
        except OSError as error:
            raise ServerSetupError(f"cannot give {path} group {gid} and mode {mode:04o}: {error.strerror}") from None
        server.start()
        view = "full detail" if servicer.view == VIEW_FULL else "redacted"
        log.info("serving kvtrace.v1 (%s) on unix:%s (%04o, gid %d)", view, path, mode, gid)

    def _start_tcp(self) -> None:
        server = self._new_server(self.servicer, reflection_enabled=False)
        credentials = _secure_port_credentials(self.config)
        try:
            port = server.add_secure_port(self.config.tcp_listen, credentials)
        except RuntimeError as error:
            raise ServerSetupError(f"cannot listen on {self.config.tcp_listen}: {error}") from None
        if port == 0:
            raise ServerSetupError(f"cannot listen on {self.config.tcp_listen}")
        self.tcp_port = port
        server.start()
        log.info("serving kvtrace.v1 on %s with mutual TLS", self.config.tcp_listen)

    def _state_healthy(self) -> bool:
        try:
            return bool(self.state.healthy())
        except Exception:  # a broken health check is itself unhealthy, never a dead poller
            log.exception("health check failed")
            return False

    def _set_health(self, healthy: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if healthy else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", SERVICE_NAME):
            self.health.set(service, status)

    def _poll_health(self) -> None:
        while not self._stop_polling.wait(self.limits.health_poll_seconds):
            self._set_health(self._state_healthy())

    def stop(self, grace_seconds: float = 5.0) -> None:
        """Stops accepting calls, ends the event streams (UNAVAILABLE), and waits up to
        `grace_seconds` for unary calls in flight."""
        self._stop_polling.set()
        self.health.enter_graceful_shutdown()
        self.servicer.stopping.set()
        self.redacted_servicer.stopping.set()
        self.hub.close_all()
        done = [server.stop(grace_seconds) for server in self._servers]
        for event in done:
            event.wait()
        self._servers.clear()
        self._remove_sockets()

    def _remove_sockets(self) -> None:
        """Removes our socket files, and only ours (a newer agent may have replaced them)."""
        for path, inode in self._socket_inodes.items():
            try:
                if os.lstat(path).st_ino == inode:
                    path.unlink()
            except OSError:
                pass
        self._socket_inodes.clear()
