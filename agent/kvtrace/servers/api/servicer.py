"""The service: AgentService's calls of kvtrace.v1, answered for one view.

An AgentServicer answers every call of one endpoint: it checks the request (requests.py), reads the
Session and the analysis through AgentState and AgentAnalysis, encodes the answer (kvtrace.wire)
and, for the group socket, redacts it (redaction.py). Event streams read the hub and hold a stream
slot (slots.py); the calls only the admin may make (recordings, flight dumps, depth requests) are
refused in the redacted view. Where and how it is served is server.py's part.
"""
from __future__ import annotations

import functools
import logging
import operator
import threading
from collections.abc import Iterable
from typing import cast

import grpc
import psutil

from kvtrace._proto.kvtrace.v1 import agent_service_pb2 as service_pb2
from kvtrace._proto.kvtrace.v1 import agent_service_pb2_grpc as service_grpc
from kvtrace._proto.kvtrace.v1 import events_pb2
from kvtrace.model.depth import NO_REQUEST, REQUEST_WITHDRAWN, Depth, DepthCause, DepthRequest, ProcessDepth
from kvtrace.model.events import Event, EventRun, Layer
from kvtrace.model.ledger import ROW_LAYER, LedgerReadRefused, Outstanding, RowBatch, entry_from_row, entry_row
from kvtrace.model.processes import CONTROL_CHARACTERS, ProcessInfo
from kvtrace.reports.flight import FlightDumpError, FlightRecorder
from kvtrace.reports.recorder import FrameEncoder, ProcessFilter, RecordQueue, encode_stream, recording_header
from kvtrace.servers.api.redaction import (
    VIEW_FULL,
    VIEW_REDACTED,
    TitleRedactor,
    redact_depths,
    redact_event,
    redact_growth,
    redact_info,
    redact_leak_report,
    redact_outstanding,
    redact_outstanding_columns,
    redact_processes,
    redact_vllm_engines,
)
from kvtrace.servers.api.requests import (
    DEFAULT_DEPTH_SECONDS,
    DEFAULT_PAGE_SIZE,
    DEFAULT_SUSPECTS,
    MAX_DEPTH_SECONDS,
    MAX_MIN_AGE_SECONDS,
    MAX_PAGE_SIZE,
    MAX_PAGE_TOKEN_CHARS,
    MAX_PID,
    MAX_SUSPECTS,
    MIN_DEPTH_SECONDS,
    InvalidArgument,
    ServerLimits,
    _enum_values,
    _pids,
    compile_title_regex,
    stream_filter,
)
from kvtrace.servers.api.slots import PROBE_MESSAGE_BYTES, StreamSlots, probe_response
from kvtrace.servers.backend import AgentAnalysis, AgentState
from kvtrace.servers.cursors import CursorLost, CursorMismatch, Cursors
from kvtrace.servers.hub import EventHub, Lost, QueueItem, flatten
from kvtrace.wire import (
    FixedColumnsBatch,
    add_processes,
    batches_to_columns,
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

log = logging.getLogger(__name__)

_STACK_ID = operator.attrgetter("stack_id")
ENCODING_COLUMNS = service_pb2.EVENT_ENCODING_COLUMNS
ENCODING_FIXED_COLUMNS = service_pb2.EVENT_ENCODING_FIXED_COLUMNS
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
        self._probe = probe_response(view)  # a probe's filler (slots.py): an empty response to any reader
        # Snapshot listings open on this socket (a token of the other socket's is no token here).
        self._listings: Cursors[Outstanding | RowBatch] = Cursors()  # entries, or batches (a listing in columns)
        self.stopping = threading.Event()

    def StreamEvents(self, request, context):
        try:
            event_filter = stream_filter(request, redacted_titles=self._redacted)
        except InvalidArgument as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        subscription = self._hub.subscribe(event_filter)
        if not self._slots.open(subscription, context):
            self._hub.unsubscribe(subscription)
            other = " (root: the admin socket has slots of its own)" if self._redacted else ""
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"the agent already serves {self._limits.max_streams} event streams on this socket (its "
                          f"limit), all of them reading{other}")
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
                    self._slots.sent(subscription)
                probe_bytes = self._slots.probe_due(subscription)
                if probe_bytes:  # does the client read? A stream that does not blocks here and is ended
                    for _ in range(probe_bytes // PROBE_MESSAGE_BYTES):
                        yield self._probe
                    self._slots.probe_done(subscription)
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
            if len(request.page_token) > MAX_PAGE_TOKEN_CHARS:
                raise InvalidArgument("page_token", "not a token from a previous GetSnapshot response")
        except InvalidArgument as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        page_size = request.page_size or DEFAULT_PAGE_SIZE
        timestamp_ns = self._state.wall_clock_ns()

        in_columns = request.encoding == service_pb2.SNAPSHOT_ENCODING_COLUMNS

        def one_pass() -> Iterable[Outstanding | RowBatch]:
            # The whole listing is one pass over the ledger, whatever its pages (servers/cursors.py): the kernel's
            # copy may have millions of entries, read a chunk at a time, never held. A listing in columns goes
            # through batches of rows in columns (a chunk's: no object made for a kernel entry), of `pids` only.
            if in_columns:
                batches = self._state.outstanding_batches(pids)
                if not layers:
                    return batches
                return (batch.where([layer in layers for layer in batch.columns[ROW_LAYER]]) for batch in batches)
            return (entry for entry in self._state.outstanding(pids)
                    if (not pids or entry.key.pid in pids) and (not layers or entry.key.layer in layers))

        try:
            page, next_token = self._listings.page(request.page_token, (pids, layers), one_pass, page_size)
        except CursorLost:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, (
                "page_token: no open listing has it (listings close after "
                f"{self._listings.idle_seconds:.0f} s without a page, when {self._listings.max_open} newer ones "
                "are open, or when the agent restarts; or it is no token of this agent's): list again from the "
                "first page"))
        except CursorMismatch as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"page_token: {error}")
        except (OSError, ValueError) as error:  # the pass broke (maps gone with the probes): its listing is closed
            log.warning("a snapshot listing stopped: %s", error)
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"reading the ledger failed ({error}); list again from the first page")
        processes: dict[int, ProcessInfo | None] = {}
        response = service_pb2.GetSnapshotResponse(next_page_token=next_token, timestamp_ns=timestamp_ns,
                                                   view=VIEW_REDACTED if self._redacted else VIEW_FULL)
        # (the items of a listing are all of one kind, its pass's; a later page may ask for the other encoding)
        if in_columns:  # filled in place: a page is not copied
            batches = cast(list[RowBatch], page) if not page or isinstance(page[0], RowBatch) else [
                RowBatch.of_rows(map(entry_row, cast(list[Outstanding], page)))]
            page_pids, stack_ids = batches_to_columns(batches, response.columns)
            processes = {pid: self._state.process(pid) for pid in page_pids}
            add_processes(processes, response.columns)
        else:
            entries = cast(list[Outstanding], page) if not page or isinstance(page[0], Outstanding) else [
                entry_from_row(row) for batch in cast(list[RowBatch], page) for row in batch.rows()]
            allocations = []
            for entry in entries:
                pid = entry.key.pid
                if pid not in processes:
                    processes[pid] = self._state.process(pid)
                allocations.append(outstanding_to_proto(entry, processes[pid]))
            response.allocations.extend(allocations)
            stack_ids = {entry.stack_id for entry in entries}
        response.depths.extend(depths_to_proto(self._state.process_depths(), processes))
        if self._redacted:
            redact_depths(response.depths)
            for allocation in response.allocations:
                redact_outstanding(allocation)
            if response.HasField("columns"):
                redact_outstanding_columns(response.columns)
            return response
        for stack_id in sorted(stack_ids - {0}):
            stack = self._state.stack(stack_id)
            if stack is not None:
                response.stacks.append(stack_message(stack_id, stack))
        return response

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
        info.counters["streams_refused"] = self._slots.refused_total
        info.counters["stream_probes"] = self._slots.probes_total
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
