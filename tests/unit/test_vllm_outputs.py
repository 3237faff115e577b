"""vLLM's outputs: roles and engines on the wire (kvtrace.v1 <-> model <-> JSON), GetVllmEngines over
the served agent in both views, the kvtrace_vllm_* / kvtrace_role_bytes exposition, and `kvtrace vllm`,
`kvtrace ps` and `kvtrace top --roles` as an operator reads them.

GIVEN synthetic analysis snapshots (analysis/ builds the real ones), WHEN they are served, scraped or
printed, THEN every figure arrives exactly, and the group socket tells no request id.
"""
import dataclasses
import io
import json
import time

import grpc
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from rich.console import Console

from fake_agent import FakeAgent, MiB, event, served
from kvtrace._proto.kvtrace.v1 import agent_service_pb2 as service_pb2
from kvtrace._proto.kvtrace.v1 import agent_service_pb2_grpc as service_grpc
from kvtrace.cli.main import main
from kvtrace.cli.ps import compact_bytes, compact_roles, roles_cell
from kvtrace.cli.top import render_frame
from kvtrace.client import AgentClient
from kvtrace.errors import CommandError
from kvtrace.model.depth import Depth, DepthCause, ProcessDepth, segments_only
from kvtrace.model.findings import AnalysisSnapshot, ProcessGpu
from kvtrace.model.ledger import LedgerCounts
from kvtrace.model.vllm import FindingKind, KvRequest, RequestState, Role, VllmEngine, VllmFinding
from kvtrace.servers.metrics import KvtraceCollector
from kvtrace.wire import (
    process_growth_to_proto,
    role_bytes_from_proto,
    vllm_engine_from_proto,
    vllm_engine_to_proto,
    vllm_engines_to_json_dict,
    vllm_engines_to_proto,
    vllm_finding_from_proto,
    vllm_finding_to_proto,
)

GiB = 1 << 30
T0_NS = 1_700_000_000_000_000_000
ENGINE, WORKER, OTHER_ENGINE, API_SERVER = 100, 200, 400, 90
SECRET = "sk-vllm-secret-42"
ENGINE_TITLE = f"VLLM::EngineCore --api-key {SECRET}"
REDACTED_ENGINE_TITLE = "VLLM::EngineCore --api-key ***"
ROLES = {Role.KV_CACHE: 27 * GiB, Role.WEIGHTS: GiB // 2, Role.ACTIVATIONS: 1288490189, Role.CUDA_GRAPH: 0}

ABORTED = KvRequest("chatcmpl-abc123", RequestState.ABORTED, 12, 45.0)
FINISHED = KvRequest("cmpl-7", RequestState.FINISHED, 3, 31.5)
RUNNING = KvRequest("cmpl-9", RequestState.RUNNING, 40)


def full_engine(**changes) -> VllmEngine:
    """An engine with every field away from its default (the round trips rely on it)."""
    engine = VllmEngine(
        engine_pid=ENGINE, title=ENGINE_TITLE, worker_pids=(ENGINE, WORKER), api_server_pid=API_SERVER,
        traced_bytes=29 * GiB, role_bytes=dict(ROLES), plugin=True, blocks_total=1000, blocks_free=400,
        kv_cache_usage_ratio=0.6, metrics_kv_cache_usage_ratio=0.59, requests_running=1, requests_waiting=2,
        kv_tensor_bytes=27 * GiB, page_size_bytes=524288, block_allocations_per_second=120.5,
        block_frees_per_second=60.25, frees_per_allocation_1m=0.5, sleep_level=1, warming_up=True,
        holders=(ABORTED, FINISHED, RUNNING), metrics_url="http://127.0.0.1:8000/metrics",
        metrics_error="connection refused", free_blocks_ratio=0.75, idle_growth_bytes_per_second=6e6,
        blocks_held_after_finish=15, sleep_residual_bytes=2 * GiB, sleep_held_by_tag={"weights": GiB, "kv_cache": 0},
        previous_sleep_residual_bytes=3 * GiB // 2)
    return dataclasses.replace(engine, **changes)


def held_finding(**changes) -> VllmFinding:
    finding = VllmFinding(
        FindingKind.BLOCKS_HELD_AFTER_FINISH, ENGINE,
        "15 blocks held by 2 requests done more than 30 s ago: chatcmpl-abc123 (12), cmpl-7 (3)",
        15.0, 30.0, T0_NS - 15 * 10**9, requests=(ABORTED, FINISHED))
    return dataclasses.replace(finding, **changes)


def sleep_finding() -> VllmFinding:
    return VllmFinding(FindingKind.SLEEP_RESIDUE, ENGINE, "2.0 GiB still held after sleep(1), +512.0 MiB since the "
                       "last cycle", 2.0 * GiB, 64 * MiB, T0_NS, held_by_role={Role.WEIGHTS: GiB, Role.OTHER: GiB},
                       held_by_tag={"weights": GiB, "kv_cache": 0})


def bare_engine() -> VllmEngine:
    """An engine found by title only: no plugin, /metrics' usage and requests."""
    return VllmEngine(OTHER_ENGINE, "VLLM::EngineCore_DP1", (OTHER_ENGINE,), traced_bytes=3 * GiB,
                      kv_cache_usage_ratio=0.25, metrics_kv_cache_usage_ratio=0.25, requests_running=0,
                      requests_waiting=0, metrics_url="http://127.0.0.1:8001/metrics")


def snapshot(**changes) -> AnalysisSnapshot:
    base = AnalysisSnapshot(
        timestamp_ns=T0_NS,
        processes=(ProcessGpu(ENGINE, ENGINE_TITLE, 0, 29 * GiB, None, None, 0.0, 0.0, None, 0, 0, None,
                              role_bytes=dict(ROLES)),
                   ProcessGpu(WORKER, "VLLM::Worker_TP0", 1, 2 * MiB, None, None, 0.0, 0.0, None, 0, 0, None)),
        vllm_engines=(full_engine(), bare_engine()),
        vllm_findings=(held_finding(), sleep_finding(),
                       VllmFinding(FindingKind.IDLE_GROWTH, OTHER_ENGINE, "growing 6.0 MB/s with no request",
                                   6e6, 5e6, T0_NS)))
    return dataclasses.replace(base, **changes)


# ---- the wire mirrors the model ----

def proto_name(name: str) -> str:
    return name.upper()


@pytest.mark.parametrize("model, wire, prefix", [
    (Role, service_pb2.Role, "ROLE_"), (RequestState, service_pb2.RequestState, "REQUEST_STATE_"),
    (FindingKind, service_pb2.VllmFindingKind, "VLLM_FINDING_KIND_")])
def test_wire_enums_have_the_model_numbers(model, wire, prefix):
    # Role.UNKNOWN (no stack) is the wire's ROLE_UNSPECIFIED; the others' zero is UNSPECIFIED too.
    assert {prefix + m.name: m.value for m in model if m.value} == {n: v for n, v in wire.items() if v}
    assert wire.Value(prefix + "UNSPECIFIED") == 0 and model(0) is not None


def test_every_engine_field_survives_the_wire():
    engine = full_engine()
    defaults = VllmEngine(0, "", ())
    unset = [f.name for f in dataclasses.fields(VllmEngine) if getattr(engine, f.name) == getattr(defaults, f.name)
             and f.name not in ("engine_pid", "title", "worker_pids")]
    assert unset == [], "give the new field a value here, and a wire field"
    message = service_pb2.VllmEngine.FromString(vllm_engine_to_proto(engine).SerializeToString())
    # Every wire field is set: the model has no field the wire forgot, nor the other way round. The depths
    # of its processes are the Session's (the depth policy's), not the engine's: they join it on the wire.
    wire_fields = {f.name for f in service_pb2.VllmEngine.DESCRIPTOR.fields} - {"depths"}
    assert {f.name for f, _ in message.ListFields()} == wire_fields
    assert {f.name for f in dataclasses.fields(VllmEngine)} == wire_fields
    # A role with no bytes travels too (analysis decides what is listed).
    assert vllm_engine_from_proto(message) == engine


def test_unknown_figures_stay_unknown_on_the_wire():
    engine = bare_engine()
    message = service_pb2.VllmEngine.FromString(vllm_engine_to_proto(engine).SerializeToString())
    assert not message.HasField("blocks_total") and not message.HasField("frees_per_allocation_1m")
    assert message.HasField("requests_running") and message.requests_running == 0
    assert not message.HasField("sleep_residual_bytes") and not message.HasField("previous_sleep_residual_bytes")
    assert vllm_engine_from_proto(message) == engine
    assert vllm_engine_from_proto(vllm_engine_to_proto(VllmEngine(1, "", ()))) == VllmEngine(1, "", ())


@pytest.mark.parametrize("finding", [held_finding(), sleep_finding()], ids=["held", "sleep"])
def test_every_finding_field_survives_the_wire(finding):
    message = service_pb2.VllmFinding.FromString(vllm_finding_to_proto(finding).SerializeToString())
    assert vllm_finding_from_proto(message) == finding


def test_sleep_residue_by_role_and_tag_on_the_wire():
    message = vllm_finding_to_proto(sleep_finding())
    assert [(entry.role, entry.size_bytes) for entry in message.held_by_role] == [
        (service_pb2.ROLE_WEIGHTS, GiB), (service_pb2.ROLE_OTHER, GiB)]
    assert [(entry.tag, entry.size_bytes) for entry in message.held_by_tag] == [("kv_cache", 0), ("weights", GiB)]


def test_growth_rows_carry_role_bytes():
    row = snapshot().processes[0]
    message = service_pb2.ProcessGrowth.FromString(process_growth_to_proto(row).SerializeToString())
    assert [(entry.role, entry.size_bytes) for entry in message.role_bytes] == [
        (service_pb2.ROLE_KV_CACHE, 27 * GiB), (service_pb2.ROLE_WEIGHTS, GiB // 2),
        (service_pb2.ROLE_CUDA_GRAPH, 0), (service_pb2.ROLE_ACTIVATIONS, 1288490189)]
    assert role_bytes_from_proto(message.role_bytes) == ROLES
    assert not process_growth_to_proto(snapshot().processes[1]).role_bytes


def test_values_a_newer_agent_added_do_not_break_the_client():
    message = vllm_engine_to_proto(full_engine(role_bytes={Role.OTHER: 5}))
    message.role_bytes.add(role=42, size_bytes=7)
    message.holders[0].state = 9
    engine = vllm_engine_from_proto(message)
    assert engine.role_bytes == {Role.OTHER: 12}  # counted as other: the total stays right
    assert engine.holders[0].state is RequestState.UNSPECIFIED
    finding = vllm_finding_to_proto(held_finding())
    finding.kind = 77
    assert vllm_finding_from_proto(finding).kind is FindingKind.UNSPECIFIED


def test_json_is_built_from_the_model():
    data = vllm_engines_to_json_dict(vllm_engines_to_proto(snapshot()))
    assert data["timestamp_ns"] == T0_NS
    engine = data["engines"][0]
    assert engine["role_bytes"] == {"kv_cache": 27 * GiB, "weights": GiB // 2, "cuda_graph": 0,
                                    "activations": 1288490189}
    assert engine["holders"][0] == {"request_id": "chatcmpl-abc123", "state": "aborted", "blocks": 12,
                                    "done_age_seconds": 45.0}
    assert engine["holders"][2]["done_age_seconds"] is None
    assert data["engines"][1]["blocks_total"] is None and data["engines"][1]["plugin"] is False
    assert [f["kind"] for f in data["findings"]] == ["blocks_held_after_finish", "sleep_residue", "idle_growth"]
    assert data["findings"][1]["held_by_tag"] == {"kv_cache": 0, "weights": GiB}
    assert set(engine) - {"depths"} == {f.name for f in dataclasses.fields(VllmEngine)}
    assert engine["depths"] == []  # its processes' depths, from the Session
    json.dumps(data)  # plain JSON types only


# ---- GetVllmEngines, served ----

def served_snapshot(value: AnalysisSnapshot | None):
    backend = FakeAgent()
    backend.analyzer.latest = value
    return served(backend)


def test_get_vllm_engines_before_the_first_analysis():
    with served_snapshot(None) as (server, _):
        with AgentClient.for_socket(server.config.socket) as agent:
            response = agent.vllm_engines()
    assert (response.timestamp_ns, list(response.engines), list(response.findings)) == (0, [], [])
    assert response.view == service_pb2.VIEW_FULL


@pytest.mark.parametrize("pids, engines, kinds", [
    ([], [ENGINE, OTHER_ENGINE], ["blocks_held_after_finish", "sleep_residue", "idle_growth"]),
    ([ENGINE], [ENGINE], ["blocks_held_after_finish", "sleep_residue"]),
    ([WORKER], [ENGINE], ["blocks_held_after_finish", "sleep_residue"]),  # a worker finds its engine
    ([OTHER_ENGINE, 4242], [OTHER_ENGINE], ["idle_growth"]),
    ([API_SERVER], [], []),  # the API server is not one of the engine's processes
])
def test_get_vllm_engines_filters_by_engine_or_worker_pid(pids, engines, kinds):
    with served_snapshot(snapshot()) as (server, _):
        with AgentClient.for_socket(server.config.socket) as agent:
            response = agent.vllm_engines(pids)
    assert response.view == service_pb2.VIEW_FULL and response.timestamp_ns == T0_NS
    assert [engine.engine_pid for engine in response.engines] == engines
    assert [FindingKind(f.kind).label for f in response.findings] == kinds
    if engines[:1] == [ENGINE]:
        assert vllm_engine_from_proto(response.engines[0]) == full_engine()
        assert vllm_finding_from_proto(response.findings[0]) == held_finding()


def test_get_vllm_engines_refuses_too_many_pids():
    with served_snapshot(snapshot()) as (server, _):
        with AgentClient.for_socket(server.config.socket) as agent, pytest.raises(CommandError) as error:
            agent.vllm_engines(range(1, 1100))
    assert "pids: 1099 pids; at most 1024" in str(error.value)


def test_group_socket_shows_no_request_id_and_no_secret():
    with served_snapshot(snapshot()) as (server, _):
        group = service_grpc.AgentServiceStub(grpc.insecure_channel(f"unix:{server.config.socket}"))
        admin = service_grpc.AgentServiceStub(grpc.insecure_channel(f"unix:{server.config.admin_path}"))
        redacted = group.GetVllmEngines(service_pb2.GetVllmEnginesRequest(), timeout=10)
        full = admin.GetVllmEngines(service_pb2.GetVllmEnginesRequest(), timeout=10)
    assert (redacted.view, full.view) == (service_pb2.VIEW_REDACTED, service_pb2.VIEW_FULL)
    text = str(redacted)
    for secret in (SECRET, "chatcmpl-abc123", "cmpl-7", "cmpl-9"):
        assert secret not in text, secret
        assert secret in str(full), secret
    engine = redacted.engines[0]
    assert engine.title == REDACTED_ENGINE_TITLE
    # Counts, states and blocks stay: the operator still sees the leak, not whose requests they were.
    assert [(r.request_id, r.state, r.blocks, r.done_age_seconds) for r in engine.holders] == [
        ("", service_pb2.REQUEST_STATE_ABORTED, 12, 45.0), ("", service_pb2.REQUEST_STATE_FINISHED, 3, 31.5),
        ("", service_pb2.REQUEST_STATE_RUNNING, 40, 0.0)]
    held = redacted.findings[0]
    assert [(r.request_id, r.blocks) for r in held.requests] == [("", 12), ("", 3)]
    assert held.message == "15 blocks held by 2 requests done more than 30 s ago: *** (12), *** (3)"
    # Every other figure is the full view's.
    for message in (engine, *redacted.engines[1:]):
        full_message = next(e for e in full.engines if e.engine_pid == message.engine_pid)
        assert vllm_engine_from_proto(message) == dataclasses.replace(
            vllm_engine_from_proto(full_message), title=message.title,
            holders=tuple(dataclasses.replace(r, request_id="") for r in vllm_engine_from_proto(full_message).holders))


def test_redaction_replaces_whole_ids_only():
    # vLLM's offline LLM numbers its requests "0", "1", ...: only the id itself is replaced.
    from kvtrace.servers.api.redaction import redact_vllm_engines

    finding = held_finding(message="3 blocks held by 1 request done 40.0 s ago: 0 (3); 10 s", requests=(
        KvRequest("0", RequestState.ABORTED, 3, 40.0),))
    response = redact_vllm_engines(vllm_engines_to_proto(snapshot(vllm_findings=(finding,))))
    assert response.findings[0].message == "3 blocks held by 1 request done 40.0 s ago: *** (3); 10 s"


# ---- Prometheus ----

class Source:
    """The exporter's two sources, with nothing but the snapshot."""

    def __init__(self, value: AnalysisSnapshot) -> None:
        self.latest = value

    def ledger_counts(self):
        return LedgerCounts({}, {}, {}, {})

    def components(self):
        return []

    def counters(self):
        return {}

    def process_titles(self):
        return {ENGINE: ENGINE_TITLE}

    def shares(self):
        return []

    def cross_checks(self):
        return []

    def cross_check_totals(self):
        return {}


def exposition(value: AnalysisSnapshot, prefixes=("kvtrace_vllm_", "kvtrace_role_bytes")) -> list[str]:
    registry = CollectorRegistry()
    registry.register(KvtraceCollector(Source(value), Source(value)))
    return [line for line in generate_latest(registry).decode().splitlines() if line.startswith(prefixes)]


def line(name: str, value: str, **labels: str) -> str:
    """One exposition line as prometheus-client writes it: labels sorted by name."""
    pairs = ",".join(f'{key}="{labels[key]}"' for key in sorted(labels))
    return f"{name}{{{pairs}}} {value}"


def test_exposition_of_roles_and_engines_is_exact():
    e = {"pid": str(ENGINE), "title": REDACTED_ENGINE_TITLE}  # the title as every label shows it
    o = {"pid": str(OTHER_ENGINE), "title": "VLLM::EngineCore_DP1"}
    assert exposition(snapshot()) == [
        line("kvtrace_role_bytes", "2.8991029248e+10", **e, gpu="0", role="kv_cache"),
        line("kvtrace_role_bytes", "5.36870912e+08", **e, gpu="0", role="weights"),
        line("kvtrace_role_bytes", "0.0", **e, gpu="0", role="cuda_graph"),
        line("kvtrace_role_bytes", "1.288490189e+09", **e, gpu="0", role="activations"),
        line("kvtrace_vllm_kv_blocks", "600.0", **e, state="used"),
        line("kvtrace_vllm_kv_blocks", "400.0", **e, state="free"),
        line("kvtrace_vllm_kv_cache_usage_ratio", "0.6", **e, source="plugin"),
        line("kvtrace_vllm_kv_cache_usage_ratio", "0.59", **e, source="metrics"),
        line("kvtrace_vllm_kv_cache_usage_ratio", "0.25", **o, source="metrics"),  # no plugin: /metrics only
        line("kvtrace_vllm_requests", "1.0", **e, state="running"),
        line("kvtrace_vllm_requests", "2.0", **e, state="waiting"),
        line("kvtrace_vllm_requests", "0.0", **o, state="running"),
        line("kvtrace_vllm_requests", "0.0", **o, state="waiting"),
        line("kvtrace_vllm_blocks_held_after_finish", "15.0", **e),
        line("kvtrace_vllm_block_allocations_per_second", "120.5", **e),
        line("kvtrace_vllm_block_frees_per_second", "60.25", **e),
        line("kvtrace_vllm_block_frees_per_allocation", "0.5", **e),
        line("kvtrace_vllm_free_blocks_ratio", "0.75", **e),
        line("kvtrace_vllm_idle_growth_bytes_per_second", "6e+06", **e),
        line("kvtrace_vllm_idle_growth_bytes_per_second", "0.0", **o),
        line("kvtrace_vllm_sleep_level", "1.0", **e),
        line("kvtrace_vllm_sleep_level", "0.0", **o),
        line("kvtrace_vllm_sleep_residual_bytes", "2.147483648e+09", **e),
        line("kvtrace_vllm_warming_up", "1.0", **e),
        line("kvtrace_vllm_warming_up", "0.0", **o),
        # every kind for every engine: 0 is "looked, found nothing"
        *(line("kvtrace_vllm_finding", "1.0" if kind.label in found else "0.0", **labels, kind=kind.label)
          for labels, found in ((e, {"blocks_held_after_finish", "sleep_residue"}), (o, {"idle_growth"}))
          for kind in list(FindingKind)[1:]),
    ]


def test_nothing_vllm_is_exported_without_engines():
    assert exposition(snapshot(vllm_engines=(), vllm_findings=())) == [
        line for line in exposition(snapshot()) if line.startswith("kvtrace_role_bytes")]
    assert exposition(AnalysisSnapshot(timestamp_ns=T0_NS)) == []


def test_awake_engine_has_no_residual_and_no_finding():
    awake = full_engine(sleep_level=0, sleep_residual_bytes=None, blocks_held_after_finish=0, holders=())
    lines = exposition(snapshot(vllm_engines=(awake,), vllm_findings=()), ("kvtrace_vllm_",))
    assert not any(line.startswith("kvtrace_vllm_sleep_residual_bytes") for line in lines)
    assert f'kvtrace_vllm_blocks_held_after_finish{{pid="{ENGINE}",title="{REDACTED_ENGINE_TITLE}"}} 0.0' in lines
    assert sum(line.startswith("kvtrace_vllm_finding{") and line.endswith(" 0.0") for line in lines) == 6


# ---- kvtrace vllm ----

def test_vllm_for_people(capsys):
    with served_snapshot(snapshot()) as (server, _):
        assert main(["vllm", "--socket", str(server.config.socket)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines() == [
        f"vLLM engine pid {ENGINE} {ENGINE_TITLE} (workers {WORKER}), API server pid {API_SERVER}",
        "  GPU memory traced 29.0 GiB: kv 27.0G act 1.2G w 512M +307M unsampled",
        "  KV cache: 600 of 1000 blocks used, 400 free, usage 60.0% (/metrics 59.0%), tensors 27.0 GiB",
        "  requests: 1 running, 2 waiting",
        "  blocks per second (1 min): 120.5 allocated, 60.2 freed, 0.50 frees per allocation",
        "  sleep: asleep, level 1 (weights offloaded, KV cache discarded); 2.0 GiB still held (kv_cache 0 B, "
        "weights 1.0 GiB), +512.0 MiB since the sleep before",
        "  warming up: inside the cold-start window (model load, profiling), growth findings silent",
        "  /metrics http://127.0.0.1:8000/metrics: connection refused",
        "  findings:",
        "    blocks_held_after_finish: 15 blocks held by 2 requests done more than 30 s ago: chatcmpl-abc123 (12), "
        "cmpl-7 (3)",
        "    sleep_residue: 2.0 GiB still held after sleep(1), +512.0 MiB since the last cycle",
        "  requests holding blocks (3):",
        "    REQUEST         STATE      BLOCKS DONE",
        "    chatcmpl-abc123 aborted        12 45 s ago",
        "    cmpl-7          finished        3 31 s ago",
        "    cmpl-9          running        40 -",
        "",
        f"vLLM engine pid {OTHER_ENGINE} VLLM::EngineCore_DP1, no plugin",
        "  GPU memory traced 3.0 GiB: not sampled yet",
        "  KV cache: usage 25.0% (from /metrics)",
        "  requests: 0 running, 0 waiting",
        "  sleep: awake",
        "  findings:",
        "    idle_growth: growing 6.0 MB/s with no request",
    ]


def test_vllm_says_how_closely_each_process_of_an_engine_is_traced(capsys):
    # GIVEN the engine's worker raised to blocks by a vLLM detector, the EngineCore at segments
    backend = FakeAgent()
    backend.analyzer.latest = snapshot()
    raised = ProcessDepth(WORKER, Depth.BLOCKS, T0_NS, DepthCause.VLLM, "blocks_held_after_finish")
    backend.session.set_process_depths({WORKER: raised, ENGINE: segments_only(ENGINE, T0_NS)})
    with served(backend) as (server, _):
        with AgentClient.for_socket(server.config.socket) as agent:
            response = agent.vllm_engines()
        assert main(["vllm", "--socket", str(server.config.socket)]) == 0
    # THEN the wire has them per engine, and the report a line after what it holds
    assert [(state.pid, state.depth) for state in response.engines[0].depths] == [
        (ENGINE, service_pb2.PROCESS_DEPTH_SEGMENTS), (WORKER, service_pb2.PROCESS_DEPTH_BLOCKS)]
    assert list(response.engines[1].depths) == []
    since = time.strftime("%H:%M:%S", time.localtime(T0_NS / 1e9))
    line = capsys.readouterr().out.splitlines()[2]
    assert line == f"  depth: {ENGINE} segments, {WORKER} blocks since {since} (vllm)"


def test_vllm_json_is_the_wire_json(capsys):
    with served_snapshot(snapshot()) as (server, _):
        assert main(["vllm", "--json", "-p", str(WORKER), "--socket", str(server.config.socket)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == vllm_engines_to_json_dict(vllm_engines_to_proto(snapshot(), frozenset({WORKER})))
    assert [engine["engine_pid"] for engine in printed["engines"]] == [ENGINE]


def test_vllm_lists_twenty_holders_and_counts_the_rest(capsys):
    holders = tuple(KvRequest(f"req-{i}", RequestState.RUNNING, i) for i in range(23))
    value = snapshot(vllm_engines=(full_engine(holders=holders, metrics_error=""),), vllm_findings=())
    with served_snapshot(value) as (server, _):
        assert main(["vllm", "--socket", str(server.config.socket)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "  findings: none" in lines and "  requests holding blocks (23):" in lines
    assert lines[-2:] == ["    req-19  running        19 -", "    and 3 more"]


def test_vllm_escapes_what_the_engine_sent(capsys):
    crafted = KvRequest("x\x1b[2Jy", RequestState.ABORTED, 1, 99.0)
    value = snapshot(vllm_engines=(full_engine(title="VLLM::EngineCore\x1b]0;pwned\x07", holders=(crafted,)),),
                     vllm_findings=())
    with served_snapshot(value) as (server, _):
        assert main(["vllm", "--socket", str(server.config.socket)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    assert "VLLM::EngineCore\\x1b]0;pwned\\x07" in out and "x\\x1b[2Jy" in out


@pytest.mark.parametrize("argv, line", [
    ([], "no vLLM engine found: kvtrace knows engines by their process title (VLLM::EngineCore); for KV-cache "
         "blocks and requests start vLLM with KVTRACE_VLLM_PLUGIN=1 in its environment and kvtrace installed in "
         "vLLM's Python, or point the agent at the API server with "
         "`kvtrace agent --vllm-metrics-url http://HOST:PORT/metrics`"),
    (["-p", "7", "-p", "8"], "no vLLM engine with pid 7, 8 found: "),
])
def test_vllm_without_an_engine_says_how_to_get_one(capsys, argv, line):
    with served_snapshot(AnalysisSnapshot(timestamp_ns=T0_NS)) as (server, _):
        assert main(["vllm", *argv, "--socket", str(server.config.socket)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith(line)


def test_vllm_before_the_first_analysis_and_without_an_agent(capsys):
    with served_snapshot(None) as (server, _):
        assert main(["vllm", "--socket", str(server.config.socket)]) == 0
    assert "has not analysed anything yet" in capsys.readouterr().out
    assert main(["vllm", "--socket", "/nonexistent/kvtrace.sock"]) == 6
    assert "the kvtrace agent is not running" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["vllm", "-p", "0"])
    assert exit_info.value.code == 2


# ---- kvtrace ps and top ----

@pytest.mark.parametrize("roles, text", [
    (ROLES, "kv 27.0G act 1.2G w 512M"),
    ({Role.UNKNOWN: 60 * MiB, Role.OTHER: 2048, Role.KV_CACHE: 0}, "unknown 60M other 2K"),
    ({}, "-"), ({Role.CUDA_GRAPH: 100}, "graph 100B")])
def test_compact_roles(roles, text):
    assert compact_roles(roles) == text


@pytest.mark.parametrize("roles, traced, text", [
    ({Role.UNKNOWN: 12 * MiB}, 12 * MiB, "unknown 12M"),  # no Python stack: said, not "?"
    ({}, 12 * MiB, "not sampled yet"),  # traced since the agent's last site sample: no role yet
    ({Role.WEIGHTS: GiB}, GiB + 12 * MiB, "w 1.0G +12M unsampled"),
    ({Role.WEIGHTS: GiB, Role.UNKNOWN: 12 * MiB}, GiB, "w 1.0G unknown 12M, 12M freed since"),
    ({}, 0, "-"), ({Role.KV_CACHE: 0}, 0, "-")])
def test_roles_cell_says_what_is_not_known_yet(roles, traced, text):
    assert roles_cell(roles, traced) == text


def test_compact_bytes():
    assert [compact_bytes(size) for size in (0, 1023, 1024, MiB, 102 * MiB, 103 * MiB, 1500 * GiB)] == [
        "0B", "1023B", "1K", "1M", "102M", "103M", "1500.0G"]


def test_ps_has_a_roles_column(capsys):
    backend = FakeAgent()
    backend.apply(event(pid=ENGINE, address=0x1000, size=29 * GiB, device=0),
                  event(pid=WORKER, address=0x2000, size=2 * MiB, device=1))
    backend.analyzer.latest = snapshot()
    with served(backend) as (server, _):
        assert main(["ps", "--socket", str(server.config.socket)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[-2:] == ["ROLES", "TITLE"]
    assert lines[1].split()[:2] == [str(ENGINE), "0"]
    assert "kv 27.0G act 1.2G w 512M +307M unsampled VLLM::EngineCore" in lines[1]  # 29 GiB traced, 28.7 with roles
    assert lines[2].split()[:2] == [str(WORKER), "1"]
    assert lines[2].endswith(f" {'not sampled yet':<40} VLLM::Worker_TP0")
    assert lines[0].index("TITLE") == lines[1].index("VLLM::EngineCore") == lines[2].index("VLLM::Worker_TP0")


def test_top_shows_roles_when_asked():
    growth = vllm_growth = service_pb2.GetGrowthResponse(
        timestamp_ns=T0_NS, processes=[process_growth_to_proto(row) for row in snapshot().processes])
    info = service_pb2.GetAgentInfoResponse(version="0.1.0")

    def frame(roles):
        console = Console(width=160, file=io.StringIO())
        console.print(render_frame(info, growth, "outstanding", T0_NS, 160, roles=roles))
        return console.file.getvalue().splitlines()

    plain, with_roles = frame(False), frame(True)
    assert "ROLES" not in plain[4] and not any("kv 27.0G" in line for line in plain)
    assert with_roles[4].split()[-2:] == ["ROLES", "TITLE"]
    assert "kv 27.0G act 1.2G w 512M" in with_roles[5] and with_roles[5].rstrip().endswith(ENGINE_TITLE)
    assert with_roles[6].split()[-4:] == ["not", "sampled", "yet", "VLLM::Worker_TP0"]  # 2 MiB since the last sample
    legend = " ".join(with_roles[next(i for i, line in enumerate(with_roles) if line.startswith("ROLES: ")):])
    assert legend.startswith("ROLES: kv KV cache") and "unknown (no Python stack)" in legend and "?" not in legend
    assert vllm_growth is growth


def test_an_engine_known_by_title_alone_exports_no_figure_it_does_not_have():
    """No plugin and no /metrics: whether requests run and whether it sleeps are not known, so neither
    idle growth nor a sleep level is exported (a 0 would look healthy)."""
    bare = VllmEngine(ENGINE, "VLLM::EngineCore", (ENGINE,), traced_bytes=GiB)
    names = {sample.split("{")[0] for sample in exposition(snapshot(vllm_engines=(bare,), vllm_findings=()))}
    assert "kvtrace_vllm_idle_growth_bytes_per_second" not in names and "kvtrace_vllm_sleep_level" not in names
    assert "kvtrace_vllm_warming_up" in names
