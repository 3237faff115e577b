"""vLLM engines and their findings (kvtrace.model.vllm) as GetVllmEngines' messages, and back; the
role breakdown (RoleBytes) that growth rows share.

The vLLM shapes are many optional figures with "not known" kept apart from 0 and enums a newer
agent may extend: their rules live together here. Their JSON forms are in kvtrace.wire.json.
"""
from __future__ import annotations

from collections.abc import Iterable

from kvtrace._proto.kvtrace.v1 import agent_service_pb2 as service_pb2
from kvtrace.model.depth import ProcessDepth
from kvtrace.model.findings import AnalysisSnapshot
from kvtrace.model.vllm import FindingKind, KvRequest, RequestState, Role, UntrustedSender, VllmEngine, VllmFinding
from kvtrace.wire.common import known_member, optional_field, wire_number
from kvtrace.wire.depth import depths_to_proto


def role_bytes_to_proto(role_bytes: dict[Role, int]) -> list[service_pb2.RoleBytes]:
    """One entry per role, in the enum's order (a stable order for diffs and tests)."""
    return [service_pb2.RoleBytes(role=wire_number(role), size_bytes=size_bytes)
            for role, size_bytes in sorted(role_bytes.items())]


def kv_request_to_proto(request: KvRequest) -> service_pb2.VllmRequest:
    message = service_pb2.VllmRequest(request_id=request.request_id, state=wire_number(request.state),
                                      blocks=request.blocks)
    if request.done_age_seconds is not None:
        message.done_age_seconds = request.done_age_seconds
    return message


def vllm_engine_to_proto(engine: VllmEngine, depths: dict[int, ProcessDepth] | None = None) -> service_pb2.VllmEngine:
    message = service_pb2.VllmEngine(
        engine_pid=engine.engine_pid, title=engine.title, worker_pids=list(engine.worker_pids),
        api_server_pid=engine.api_server_pid, traced_bytes=engine.traced_bytes,
        role_bytes=role_bytes_to_proto(engine.role_bytes), plugin=engine.plugin,
        kv_tensor_bytes=engine.kv_tensor_bytes, page_size_bytes=engine.page_size_bytes,
        block_allocations_per_second=engine.block_allocations_per_second,
        block_frees_per_second=engine.block_frees_per_second, sleep_level=engine.sleep_level,
        warming_up=engine.warming_up, holders=[kv_request_to_proto(request) for request in engine.holders],
        metrics_url=engine.metrics_url, metrics_error=engine.metrics_error,
        idle_growth_bytes_per_second=engine.idle_growth_bytes_per_second,
        blocks_held_after_finish=engine.blocks_held_after_finish,
        sleep_held_by_tag=_tag_bytes_to_proto(engine.sleep_held_by_tag),
        depths=depths_to_proto(depths or {}, (engine.engine_pid, *engine.worker_pids)))
    # None leaves an optional field unset: "not known" stays apart from 0.
    for name in _ENGINE_OPTIONAL_FIELDS:
        value = getattr(engine, name)
        if value is not None:
            setattr(message, name, value)
    return message


# VllmEngine's fields that may be None, the same names on the wire (optional there).
_ENGINE_OPTIONAL_FIELDS = ("blocks_total", "blocks_free", "kv_cache_usage_ratio", "metrics_kv_cache_usage_ratio",
                           "requests_running", "requests_waiting", "frees_per_allocation_1m", "free_blocks_ratio",
                           "sleep_residual_bytes", "previous_sleep_residual_bytes")


def _tag_bytes_to_proto(tag_bytes: dict[str, int]) -> list[service_pb2.TagBytes]:
    return [service_pb2.TagBytes(tag=tag, size_bytes=size_bytes) for tag, size_bytes in sorted(tag_bytes.items())]


def vllm_finding_to_proto(finding: VllmFinding) -> service_pb2.VllmFinding:
    return service_pb2.VllmFinding(
        kind=wire_number(finding.kind), engine_pid=finding.engine_pid, message=finding.message,
        value=finding.value, threshold=finding.threshold, since_ns=finding.since_ns,
        requests=[kv_request_to_proto(request) for request in finding.requests],
        held_by_role=role_bytes_to_proto(finding.held_by_role),
        held_by_tag=_tag_bytes_to_proto(finding.held_by_tag))


def engine_matches(engine: VllmEngine, pids: frozenset[int]) -> bool:
    """A pid filter selects an engine by its EngineCore or any process of it (a worker's pid from
    `kvtrace ps` finds its engine)."""
    return not pids or engine.engine_pid in pids or not pids.isdisjoint(engine.worker_pids)


def vllm_engines_to_proto(snapshot: AnalysisSnapshot | None, pids: frozenset[int] = frozenset(),
                          depths: dict[int, ProcessDepth] | None = None) -> service_pb2.GetVllmEnginesResponse:
    """GetVllmEngines' answer: the selected engines by engine pid, and the findings about them."""
    if snapshot is None:
        return service_pb2.GetVllmEnginesResponse()
    engines = sorted((engine for engine in snapshot.vllm_engines if engine_matches(engine, pids)),
                     key=lambda engine: engine.engine_pid)
    selected = {engine.engine_pid for engine in engines}
    return service_pb2.GetVllmEnginesResponse(
        timestamp_ns=snapshot.timestamp_ns, engines=[vllm_engine_to_proto(engine, depths) for engine in engines],
        findings=[vllm_finding_to_proto(finding) for finding in snapshot.vllm_findings
                  if not pids or finding.engine_pid in selected],
        untrusted_senders=[untrusted_sender_to_proto(sender)
                           for sender in sorted(snapshot.vllm_untrusted, key=lambda sender: sender.pid)
                           if not pids or sender.pid in pids])


def untrusted_sender_to_proto(sender: UntrustedSender) -> service_pb2.VllmUntrustedSender:
    return service_pb2.VllmUntrustedSender(pid=sender.pid, title=sender.title, reason=sender.reason,
                                           kv_tensor_bytes=sender.kv_tensor_bytes, scheduler=sender.scheduler)


def untrusted_sender_from_proto(message: service_pb2.VllmUntrustedSender) -> UntrustedSender:
    return UntrustedSender(message.pid, message.title, message.reason, message.kv_tensor_bytes, message.scheduler)


def role_bytes_from_proto(entries: Iterable[service_pb2.RoleBytes]) -> dict[Role, int]:
    """A role a newer agent added counts as `other`: its bytes stay in the total."""
    role_bytes: dict[Role, int] = {}
    for entry in entries:
        role = known_member(Role, entry.role, Role.OTHER)
        role_bytes[role] = role_bytes.get(role, 0) + entry.size_bytes
    return role_bytes


def kv_request_from_proto(message: service_pb2.VllmRequest) -> KvRequest:
    return KvRequest(request_id=message.request_id,
                     state=known_member(RequestState, message.state, RequestState.UNSPECIFIED),
                     blocks=message.blocks, done_age_seconds=optional_field(message, "done_age_seconds"))


def vllm_engine_from_proto(message: service_pb2.VllmEngine) -> VllmEngine:
    return VllmEngine(
        engine_pid=message.engine_pid, title=message.title, worker_pids=tuple(message.worker_pids),
        api_server_pid=message.api_server_pid, traced_bytes=message.traced_bytes,
        role_bytes=role_bytes_from_proto(message.role_bytes), plugin=message.plugin,
        kv_tensor_bytes=message.kv_tensor_bytes, page_size_bytes=message.page_size_bytes,
        block_allocations_per_second=message.block_allocations_per_second,
        block_frees_per_second=message.block_frees_per_second, sleep_level=message.sleep_level,
        warming_up=message.warming_up, holders=tuple(kv_request_from_proto(r) for r in message.holders),
        metrics_url=message.metrics_url, metrics_error=message.metrics_error,
        idle_growth_bytes_per_second=message.idle_growth_bytes_per_second,
        blocks_held_after_finish=message.blocks_held_after_finish,
        sleep_held_by_tag={entry.tag: entry.size_bytes for entry in message.sleep_held_by_tag},
        **{name: optional_field(message, name) for name in _ENGINE_OPTIONAL_FIELDS})


def vllm_finding_from_proto(message: service_pb2.VllmFinding) -> VllmFinding:
    return VllmFinding(
        kind=known_member(FindingKind, message.kind, FindingKind.UNSPECIFIED), engine_pid=message.engine_pid,
        message=message.message, value=message.value, threshold=message.threshold, since_ns=message.since_ns,
        requests=tuple(kv_request_from_proto(r) for r in message.requests),
        held_by_role=role_bytes_from_proto(message.held_by_role),
        held_by_tag={entry.tag: entry.size_bytes for entry in message.held_by_tag})
