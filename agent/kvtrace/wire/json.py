"""JSON forms: the stable objects `kvtrace agent --json-events`, `kvtrace tail --json` and the other
`--json` outputs print.

They are built from the model (messages are converted to it first), so the agent and the client
print the same object for the same event. Kept above the wire conversions: JSON reads them, they
never read JSON.
"""
from __future__ import annotations

import functools
from json import encoder as _json_encoder
from typing import Any

from kvtrace._proto.kvtrace.v1 import agent_service_pb2 as service_pb2
from kvtrace._proto.kvtrace.v1 import events_pb2
from kvtrace.model.blocks import estimated_size
from kvtrace.model.depth import ProcessDepth
from kvtrace.model.events import SIZED_KINDS, Api, Event, Kind, Layer, Memory, ObjectKind
from kvtrace.model.stacks import Frame, NativeFrame, Stack
from kvtrace.model.vllm import KvRequest, Role, VllmEngine, VllmFinding
from kvtrace.wire.common import STACK_STATUS_NAMES
from kvtrace.wire.depth import depth_from_proto
from kvtrace.wire.events import event_from_proto, stack_from_proto
from kvtrace.wire.vllm import vllm_engine_from_proto, vllm_finding_from_proto


def message_to_json(message: events_pb2.Event) -> dict | None:
    """The JSON object `kvtrace agent --json-events` prints for the same event (None: not an event)."""
    event = event_from_proto(message)
    return event_to_json(event) if event is not None else None


def frame_to_json(frame: Frame) -> dict[str, Any]:
    return {"function": frame.function, "file": frame.file, "line": frame.line}


def native_frame_to_json(frame: NativeFrame | service_pb2.NativeFrame) -> dict[str, Any]:
    return {"module": frame.module, "symbol": frame.symbol, "offset": frame.offset}


def _lower(value: Any) -> str | None:
    return value.name.lower() if value is not None else None


def event_to_json(event: Event, stack: Stack | None = None,
                  native_caller: NativeFrame | None = None) -> dict[str, Any]:
    """The stable JSON shape of an event (`kvtrace agent --json-events`, `kvtrace tail --json`).

    `stack` adds "stack": [{function, file, line}, ...] innermost first and "stack_truncated";
    `native_caller` adds "native_caller"."""
    data: dict[str, Any] = {
        "kind": event.kind.name.lower(),
        "pid": event.pid,
        "tid": event.tid,
        "comm": event.comm,
        "title": event.title,
        "api": event.api.name,
        "layer": _lower(event.layer),
        "object": _lower(event.object),
        "memory": _lower(event.memory),
        "size_bytes": event.size_bytes,
        "address": event.address,
        "device": event.device,
        "error_code": event.error_code,
        "timestamp_ns": event.timestamp_ns,
        "caller_address": event.caller_address,
        "container": event.container,
    }
    if event.api is Api.cuMemMap:
        data["handle"] = event.handle
    elif event.api is Api.cuMemUnmap or event.kind is Kind.PROCESS_EXIT:
        data["freed_bytes"] = event.freed_bytes
    elif event.layer is Layer.TORCH:
        data["stream"] = event.stream
        if event.api is Api.pytorch_malloc:
            data["sample_bytes"] = event.sample_bytes  # 0: its stack was not subject to sampling
    if stack is not None:
        data["stack"] = [frame_to_json(frame) for frame in stack.frames]
        data["stack_truncated"] = stack.truncated
    if event.kind in SIZED_KINDS:
        data["stack_status"] = STACK_STATUS_NAMES[event.stack_status]
    if native_caller is not None:
        data["native_caller"] = native_frame_to_json(native_caller)
    return data


def depth_to_json(depth: ProcessDepth | None) -> dict[str, Any] | None:
    """{"depth": "blocks", "since_ns", "cause": "growth", "detail", "until_ns", "sample_bytes"}; None when
    not known."""
    if depth is None:
        return None
    return {"pid": depth.pid, "depth": depth.depth.label, "since_ns": depth.since_ns,
            "cause": depth.cause.name.lower(), "detail": depth.detail, "until_ns": depth.until_ns,
            "sample_bytes": depth.sample_bytes}


def depth_message_to_json(message: service_pb2.ProcessDepthState) -> dict[str, Any] | None:
    return depth_to_json(depth_from_proto(message))


@functools.cache  # a few names, asked for several times per row of a snapshot of millions
def wire_enum_name(enum_type, value: int) -> str | None:
    """The lower-case model name of a wire enum value ("runtime"); None for UNSPECIFIED (0)."""
    try:
        return enum_type(value).name.lower() if value else None
    except ValueError:
        return str(value)


def outstanding_to_json_dict(entry: service_pb2.OutstandingAllocation) -> dict:
    """One outstanding object for `kvtrace snapshot --json`, named like the event JSON (a snapshot prints
    millions of these: each field read once)."""
    object_kind = entry.object
    row = {
        "pid": entry.pid, "tid": entry.tid, "comm": entry.comm, "title": entry.title,
        "container": entry.container, "layer": wire_enum_name(Layer, entry.layer),
        "object": wire_enum_name(ObjectKind, object_kind), "memory": wire_enum_name(Memory, entry.memory),
        "api": entry.api_name, "size_bytes": entry.size_bytes, "address": entry.address,
        "device": entry.device, "timestamp_ns": entry.timestamp_ns,
        "caller_address": entry.caller_address, "stack_id": entry.stack_id,
    }
    if object_kind == _VMM_HANDLE:
        row["mapped_count"], row["released"] = entry.mapped_count, entry.released
    elif object_kind == _VMM_MAPPING:
        row["handle"] = entry.handle
    elif object_kind == _BLOCK:
        size_bytes, sample_bytes, sampled = entry.size_bytes, entry.sample_bytes, entry.sampled
        row.update(stream=entry.stream, sample_bytes=sample_bytes, sampled=sampled,
                   estimated_bytes=round(estimated_size(size_bytes, sample_bytes, sampled)))
    return row


_VMM_HANDLE, _VMM_MAPPING, _BLOCK = int(ObjectKind.VMM_HANDLE), int(ObjectKind.VMM_MAPPING), int(ObjectKind.BLOCK)
_json_text = _json_encoder.encode_basestring_ascii  # a string as json.dumps writes it (ensure_ascii, C)


@functools.cache
def _json_name(enum_type, value: int) -> str:
    return _json_text(name) if (name := wire_enum_name(enum_type, value)) is not None else "null"


def outstanding_json_line(entry: service_pb2.OutstandingAllocation) -> str:
    """`json.dumps(outstanding_to_json_dict(entry), separators=(",", ":"))`, the same text (a unit test holds
    it) written directly: `kvtrace snapshot --json` prints millions of these."""
    object_kind = entry.object
    line = (f'{{"pid":{entry.pid},"tid":{entry.tid},"comm":{_json_text(entry.comm)},"title":{_json_text(entry.title)},'
            f'"container":{_json_text(entry.container)},"layer":{_json_name(Layer, entry.layer)},'
            f'"object":{_json_name(ObjectKind, object_kind)},"memory":{_json_name(Memory, entry.memory)},'
            f'"api":{_json_text(entry.api_name)},"size_bytes":{entry.size_bytes},"address":{entry.address},'
            f'"device":{entry.device},"timestamp_ns":{entry.timestamp_ns},'
            f'"caller_address":{entry.caller_address},"stack_id":{entry.stack_id}')
    if object_kind == _VMM_HANDLE:
        return f'{line},"mapped_count":{entry.mapped_count},"released":{"true" if entry.released else "false"}}}'
    if object_kind == _VMM_MAPPING:
        return f'{line},"handle":{entry.handle}}}'
    if object_kind == _BLOCK:
        size_bytes, sample_bytes, sampled = entry.size_bytes, entry.sample_bytes, entry.sampled
        return (f'{line},"stream":{entry.stream},"sample_bytes":{sample_bytes},'
                f'"sampled":{"true" if sampled else "false"},'
                f'"estimated_bytes":{round(estimated_size(size_bytes, sample_bytes, sampled))}}}')
    return line + "}"


def process_to_json_dict(process: service_pb2.Process) -> dict:
    """One process for `kvtrace ps --json`."""
    return {
        "pid": process.pid, "title": process.title, "comm": process.comm, "container": process.container,
        "totals": [{"device": total.device, "layer": wire_enum_name(Layer, total.layer),
                    "memory": wire_enum_name(Memory, total.memory), "size_bytes": total.size_bytes,
                    "object_count": total.object_count} for total in process.totals],
        "depth": depth_message_to_json(process.depth) if process.HasField("depth") else None,
    }


def leak_report_to_json_dict(response: service_pb2.ListLeakSuspectsResponse) -> dict:
    """The report of `kvtrace leaks --json`: one object, suspects most suspicious first."""
    return {
        "timestamp_ns": response.timestamp_ns, "min_age_seconds": response.min_age_seconds,
        "allocations_considered": response.allocations_considered,
        "suspect_allocations": response.suspect_allocations, "suspect_count": response.suspect_count,
        "suspects": [{
            "rank": suspect.rank, "pid": suspect.pid, "title": suspect.title, "device": suspect.device,
            "outstanding_bytes": suspect.outstanding_bytes, "allocation_count": suspect.allocation_count,
            "oldest_age_seconds": suspect.oldest_age_seconds,
            "growth_bytes_per_second": suspect.growth_bytes_per_second, "estimated": suspect.estimated,
            "stack_id": suspect.stack_id,
            "stack": [frame_to_json(frame) for frame in stack_from_proto(suspect.stack)[1].frames]
            if suspect.HasField("stack") else None,
            "stack_truncated": suspect.stack.truncated,
            "caller_address": suspect.caller_address,
            "native_caller": native_frame_to_json(suspect.native_caller)
            if suspect.HasField("native_caller") else None,
        } for suspect in response.suspects],
        "depths": [depth_message_to_json(depth) for depth in response.depths],
    }


def role_bytes_to_json(role_bytes: dict[Role, int]) -> dict[str, int]:
    """{"kv_cache": bytes, ...} in the enum's order; the names are the `role` label's."""
    return {role.label: size_bytes for role, size_bytes in sorted(role_bytes.items())}


def kv_request_to_json(request: KvRequest) -> dict[str, Any]:
    return {"request_id": request.request_id, "state": request.state.name.lower(), "blocks": request.blocks,
            "done_age_seconds": request.done_age_seconds}


def vllm_engine_to_json(engine: VllmEngine) -> dict[str, Any]:
    return {
        "engine_pid": engine.engine_pid, "title": engine.title, "worker_pids": list(engine.worker_pids),
        "api_server_pid": engine.api_server_pid, "traced_bytes": engine.traced_bytes,
        "role_bytes": role_bytes_to_json(engine.role_bytes), "plugin": engine.plugin,
        "blocks_total": engine.blocks_total, "blocks_free": engine.blocks_free,
        "kv_cache_usage_ratio": engine.kv_cache_usage_ratio,
        "metrics_kv_cache_usage_ratio": engine.metrics_kv_cache_usage_ratio,
        "requests_running": engine.requests_running, "requests_waiting": engine.requests_waiting,
        "kv_tensor_bytes": engine.kv_tensor_bytes, "page_size_bytes": engine.page_size_bytes,
        "block_allocations_per_second": engine.block_allocations_per_second,
        "block_frees_per_second": engine.block_frees_per_second,
        "frees_per_allocation_1m": engine.frees_per_allocation_1m,
        "free_blocks_ratio": engine.free_blocks_ratio,
        "idle_growth_bytes_per_second": engine.idle_growth_bytes_per_second,
        "blocks_held_after_finish": engine.blocks_held_after_finish,
        "sleep_residual_bytes": engine.sleep_residual_bytes,
        "sleep_held_by_tag": dict(sorted(engine.sleep_held_by_tag.items())),
        "previous_sleep_residual_bytes": engine.previous_sleep_residual_bytes,
        "sleep_level": engine.sleep_level, "warming_up": engine.warming_up,
        "holders": [kv_request_to_json(request) for request in engine.holders],
        "metrics_url": engine.metrics_url, "metrics_error": engine.metrics_error,
    }


def vllm_finding_to_json(finding: VllmFinding) -> dict[str, Any]:
    return {
        "kind": finding.kind.label, "engine_pid": finding.engine_pid, "message": finding.message,
        "value": finding.value, "threshold": finding.threshold, "since_ns": finding.since_ns,
        "requests": [kv_request_to_json(request) for request in finding.requests],
        "held_by_role": role_bytes_to_json(finding.held_by_role),
        "held_by_tag": dict(sorted(finding.held_by_tag.items())),
    }


def vllm_engines_to_json_dict(response: service_pb2.GetVllmEnginesResponse) -> dict[str, Any]:
    """The answer of `kvtrace vllm --json`: one object, engines by pid, then the findings."""
    return {
        "timestamp_ns": response.timestamp_ns,
        "engines": [{**vllm_engine_to_json(vllm_engine_from_proto(engine)),
                     "depths": [depth_message_to_json(depth) for depth in engine.depths]}
                    for engine in response.engines],
        "findings": [vllm_finding_to_json(vllm_finding_from_proto(finding)) for finding in response.findings],
        "untrusted_senders": [{"pid": sender.pid, "title": sender.title, "reason": sender.reason,
                               "kv_tensor_bytes": sender.kv_tensor_bytes, "scheduler": sender.scheduler}
                              for sender in response.untrusted_senders],
    }
