"""The redacted view: what a member of the socket's group may see.

The group socket serves VIEW_REDACTED, and a member of the group must learn no more than /metrics
tells anyone on the host: titles with secrets redacted as /metrics redacts them, no Python stacks
or native callers, no addresses, no vLLM request ids, no other users' file paths. The service
builds a response as for the full view and, in the redacted view, passes it through these functions,
which strip it in place; so what is withheld is decided here, in one place, for every call. (Event
columns take a TitleRedactor and leave the rest out themselves: kvtrace.wire.events_to_columns.)
"""
from __future__ import annotations

import os
import re

from kvtrace._proto.kvtrace.v1 import agent_service_pb2 as service_pb2
from kvtrace._proto.kvtrace.v1 import events_pb2
from kvtrace.model.processes import redact_title

VIEW_FULL = service_pb2.VIEW_FULL
VIEW_REDACTED = service_pb2.VIEW_REDACTED
_TITLE_CACHE_MAX_ENTRIES = 4096


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


def redact_outstanding_columns(message: service_pb2.OutstandingColumns) -> service_pb2.OutstandingColumns:
    """As redact_outstanding, for a page in columns: the titles redacted, the same columns left at their
    defaults (empty)."""
    for label in message.processes:
        label.title = redact_title(label.title)
    for name in ("address", "caller_address", "stack_id", "handle", "stream"):
        message.ClearField(name)
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


# Components whose reasons name files of other users (the admin socket has them whole); vllm_trust
# names other users' pids and titles, shares the titles (command lines) of the processes refused.
_REASONS_WITH_PATHS = frozenset({"libraries", "vllm_trust", "shares"})


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
    # Other users' untrusted senders are not the group's to see (as the vllm_trust component's reason): admin only.
    del message.untrusted_senders[:]
    request_ids.discard("")
    words = re.compile("|".join(f"(?<![\\w.:-]){re.escape(request_id)}(?![\\w.:-])"
                                for request_id in sorted(request_ids, key=len, reverse=True))) \
        if request_ids else None
    for finding in message.findings:
        text = words.sub("***", finding.message) if words is not None else finding.message
        finding.message = redact_title(text)
    message.view = VIEW_REDACTED
    return message
