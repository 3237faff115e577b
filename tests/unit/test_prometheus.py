"""The Prometheus exporter over a fake agent state, scraped over HTTP on 127.0.0.1 (ephemeral port)
and parsed with prometheus_client's own parser: exact values, label hygiene, degraded states, the
listener's safety rules and the real Session as its source."""
from __future__ import annotations

import argparse
import math
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtrace import __version__
from kvtrace.cli.agent import add_metrics_flags
from kvtrace.model.agent import ComponentStatus, PartyShare
from kvtrace.model.blocks import Fragmentation
from kvtrace.model.crosscheck import ProcessCrossCheck, TracerStatus
from kvtrace.model.depth import Depth, DepthCause, ProcessDepth, segments_only
from kvtrace.model.events import Api, Event, EventsLost, Kind, Layer, Memory, ObjectKind
from kvtrace.model.findings import AnalysisSnapshot, GpuMemory, LeakSuspect, ProcessGpu
from kvtrace.model.ledger import LedgerCounts, TotalsKey
from kvtrace.model.processes import ProcessInfo, ProcessTable
from kvtrace.model.stacks import Frame, Stack
from kvtrace.model.vllm import FindingKind, KvRequest, RequestState, Role, VllmEngine, VllmFinding
from kvtrace.servers.metrics import METRIC_NAMES, METRICS, TITLE_MAX_CHARS, KvtraceCollector, metric_title
from kvtrace.servers.prometheus import DEFAULT_LISTEN, MetricsServer, MetricsSetupError, check_listen, parse_listen
from kvtrace.session import Session

GiB = 1 << 30
MiB = 1 << 20
NOW_NS = 1_800_000_000_000_000_000
NS = 1_000_000_000
WORKER, ENGINE, TRAIN, EXITED = 4242, 4243, 5151, 6161
ADDRESS = 0x7F3A_1C00_0000  # an allocation address: must never reach a label
CALLER = 0x7F3B_0000_1234
TITLES = {
    WORKER: "VLLM::Worker_TP0",
    ENGINE: "vllm serve meta-llama/Llama-3.1-8B-Instruct --api-key sk-very-secret --port 8000",
    TRAIN: "python train.py",
}
LEAKY_STACK = Stack((Frame("KVCache.grow_forever", "/srv/app/leaky_cache.py", 87),
                     Frame("Engine.step", "/srv/app/engine.py", 12)))


def synthetic_snapshot(timestamp_ns: int = NOW_NS) -> AnalysisSnapshot:
    h200 = 150_754_820_096
    return AnalysisSnapshot(
        timestamp_ns=timestamp_ns,
        gpus=(GpuMemory(0, "GPU-0a1b", "NVIDIA H200", h200, 120 * GiB, h200 - 120 * GiB, 512 * MiB),
              GpuMemory(1, "GPU-2c3d", "NVIDIA H200", h200, 1 * GiB, h200 - 1 * GiB, 512 * MiB)),
        processes=(
            ProcessGpu(WORKER, TITLES[WORKER], 0, 100 * GiB, 101 * GiB, 1 * GiB, 6.5e6, 5.25e6, 2520.0,
                       230, 190, 190 / 230,
                       fragmentation=Fragmentation(WORKER, 0, 96 * GiB, 80 * GiB, 4 * GiB, 7, 4000, 0),
                       role_bytes={Role.KV_CACHE: 80 * GiB, Role.WEIGHTS: 16 * GiB, Role.UNKNOWN: 4 * GiB}),
            ProcessGpu(ENGINE, TITLES[ENGINE], 1, 3 * GiB, None, None, 0.0, -1.5e3, None, 0, 0, None),
            ProcessGpu(TRAIN, TITLES[TRAIN], -1, 2 * MiB, 600 * MiB, 598 * MiB, 0.0, 0.0, math.inf, 0, 0, None),
        ),
        suspects=(
            LeakSuspect(1, WORKER, TITLES[WORKER], 0, 7, LEAKY_STACK, CALLER, 8 * GiB, 23, 840.0, 5.0e6),
            LeakSuspect(2, WORKER, TITLES[WORKER], 0, 9, None, CALLER + 64, 2 * GiB, 3, 700.0, 0.0),
            LeakSuspect(3, ENGINE, TITLES[ENGINE], 1, 0, None, CALLER + 128, 512 * MiB, 1, 650.0, 0.0),
        ),
        # Every vLLM figure known, so that every metric has a sample (tests/unit/test_vllm_outputs.py
        # has the vLLM exposition in detail).
        vllm_engines=(VllmEngine(
            ENGINE, TITLES[ENGINE], (ENGINE, WORKER), plugin=True, traced_bytes=103 * GiB,
            blocks_total=1000, blocks_free=400, kv_cache_usage_ratio=0.6, metrics_kv_cache_usage_ratio=0.59,
            requests_running=0, requests_waiting=0, block_allocations_per_second=2.0, block_frees_per_second=1.0,
            frees_per_allocation_1m=0.5, free_blocks_ratio=0.4, idle_growth_bytes_per_second=6.5e6,
            blocks_held_after_finish=600, sleep_level=1, sleep_residual_bytes=3 * GiB, warming_up=False),),
        vllm_findings=(VllmFinding(FindingKind.BLOCKS_HELD_AFTER_FINISH, ENGINE, "600 blocks held", 600, 0,
                                   timestamp_ns, requests=(KvRequest("req-1", RequestState.ABORTED, 600, 40.0),)),),
    )


UP = [ComponentStatus("bpf", True), ComponentStatus("nvml", True), ComponentStatus("python_stacks", True),
      ComponentStatus("analysis", True)]


def synthetic_ledger() -> LedgerCounts:
    return LedgerCounts(
        totals={
            TotalsKey(WORKER, 0, Layer.DRIVER, Memory.DEVICE): (100 * GiB, 230 - 190),
            TotalsKey(WORKER, 0, Layer.RUNTIME, Memory.DEVICE): (100 * GiB, 40),
            TotalsKey(WORKER, 0, Layer.DRIVER, Memory.HOST): (64 * MiB, 2),
            TotalsKey(ENGINE, 1, Layer.VMM, Memory.DEVICE): (3 * GiB, 3),
            TotalsKey(TRAIN, -1, Layer.DRIVER, Memory.DEVICE): (2 * MiB, 1),
        },
        allocations_total={(WORKER, Layer.DRIVER): 230, (WORKER, Layer.RUNTIME): 229,
                           (ENGINE, Layer.VMM): 3, (EXITED, Layer.DRIVER): 17},
        frees_total={(WORKER, Layer.DRIVER): 190, (WORKER, Layer.RUNTIME): 189,
                     (EXITED, Layer.DRIVER): 17},
        failures_total={(Api.cuMemAlloc_v2, 2): 5, (Api.cudaMalloc, 2): 5, (Api.cuMemCreate, 1): 1},
    )


TRACER_COUNTERS = {"events_submitted": 100_003, "events_lost": 23, "ledger_full": 0, "totals_full": 0,
                   "blocks_unsent": 5, "blocks_sampled": 240, "blocks_not_sampled": 3_760, "blocks_quiet": 3_700,
                   "ledger_entries_in_kernel": 4_000, "ledger_reads_refused": 2,
                   "unknown_frees": 11, "vllm_messages_received": 40, "vllm_messages_rejected": 2,
                   "returns_unpaired": 0, "filtered": 7, "events_seen": 99_980,
                   "events_undecodable": 2, "event_loop_late_turns": 1, "libraries_attached": 3,
                   "libraries_refused": 29, "libraries_detached": 26,
                   "flight_dumps": 3, "flight_dump_failures": 1, "resyncs": 1,
                   "share_refused/vllm_senders/alice": 115, "share_refused/group_connections/other": 3,
                   "vllm_senders_evicted": 1, "vllm_untrusted_senders": 1, "site_samples": 4,
                   "site_sample_entries": 262_144, "site_sample_longest_ms": 1_980}


@dataclass
class FakeSource:
    """The agent's state and analysis as the exporter reads them; parts can be swapped or fail."""

    snapshot_value: AnalysisSnapshot | None = field(default_factory=synthetic_snapshot)
    ledger_value: LedgerCounts = field(default_factory=synthetic_ledger)
    counters_value: dict = field(default_factory=lambda: dict(TRACER_COUNTERS))
    titles: dict = field(default_factory=lambda: dict(TITLES))
    components_value: list = field(default_factory=lambda: list(UP))
    shares_value: list = field(default_factory=lambda: [PartyShare(1001, 0, 262144, 3, 23, 0)])
    broken: set = field(default_factory=set)

    def _check(self, part):
        if part in self.broken:
            raise RuntimeError(f"{part} is broken")

    @property
    def latest(self):
        self._check("snapshot")
        return self.snapshot_value

    def ledger_counts(self):
        self._check("ledger")
        return self.ledger_value

    def components(self):
        self._check("components")
        return self.components_value

    def counters(self):
        self._check("counters")
        return self.counters_value

    def process_titles(self):
        self._check("titles")
        return self.titles

    def shares(self):
        return self.shares_value

    def cross_checks(self):
        return [ProcessCrossCheck(4242, TracerStatus(4242, "tracing"), compared=True)]

    def cross_check_totals(self):
        return {(Api.cuMemAlloc_v2, "matched"): 23, (Api.cuMemFree_v2, "uprobe_only"): 1}

    def process_depths(self):
        self._check("depths")
        return {WORKER: ProcessDepth(WORKER, Depth.BLOCKS, NOW_NS - 90 * NS, DepthCause.GROWTH, "+96 MiB in 60 s"),
                ENGINE: segments_only(ENGINE, NOW_NS - 3600 * NS), EXITED: segments_only(EXITED, NOW_NS)}


@contextmanager
def served(source):
    server = MetricsServer(source, source, "127.0.0.1:0")
    server.start()
    try:
        yield server
    finally:
        server.stop()


class ProxySource:
    """Lets one served exporter read a different source in each test (a stop takes 0.5 s)."""

    target = None
    analysis = None

    @property
    def latest(self):
        return (self.analysis or self.target).latest

    def ledger_counts(self):
        return self.target.ledger_counts()

    def components(self):
        return self.target.components()

    def counters(self):
        return self.target.counters()

    def process_titles(self):
        return self.target.process_titles()

    def shares(self):
        return self.target.shares()

    def cross_checks(self):
        return self.target.cross_checks()

    def cross_check_totals(self):
        return self.target.cross_check_totals()

    def process_depths(self):
        return self.target.process_depths()


_PROXY = ProxySource()
_SERVED: list[MetricsServer] = []


@pytest.fixture(scope="module", autouse=True)
def shared_server():
    with served(_PROXY) as server:
        _SERVED.append(server)
        yield server
        _SERVED.clear()


def scrape_text(server) -> str:
    with urllib.request.urlopen(server.url, timeout=10) as response:
        assert response.status == 200
        return response.read().decode()


def scrape(source, analysis=None):
    """{family name: family} as prometheus_client's parser reads the /metrics text; `source` is the
    agent's state (and its analysis too, unless `analysis` is given)."""
    _PROXY.target, _PROXY.analysis = source, analysis
    try:
        text = scrape_text(_SERVED[0])
    finally:
        _PROXY.target = _PROXY.analysis = None
    return {family.name: family for family in text_string_to_metric_families(text)}


def samples(families, name) -> dict[tuple, float]:
    """{sorted label items: value} of one sample name (counters: the _total samples)."""
    family_name = name[:-len("_total")] if name.endswith("_total") else name
    family = families.get(family_name)
    if family is None:
        return {}
    return {tuple(sorted(s.labels.items())): s.value for s in family.samples if s.name == name}


def labels(**items) -> tuple:
    return tuple(sorted(items.items()))


WORKER_TITLE = "VLLM::Worker_TP0"
ENGINE_TITLE = "vllm serve meta-llama/Llama-3.1-8B-Instruct --api-key *** --p..."
TRAIN_TITLE = "python train.py"


def test_exact_values_for_a_synthetic_snapshot():
    # GIVEN a source with three processes on two GPUs, suspects and counters
    # WHEN /metrics is scraped over HTTP
    families = scrape(FakeSource())

    # THEN every sample is exactly what the snapshot and the ledger say
    w = dict(pid="4242", title=WORKER_TITLE)
    e = dict(pid="4243", title=ENGINE_TITLE)
    t = dict(pid="5151", title=TRAIN_TITLE)
    assert samples(families, "kvtrace_outstanding_bytes") == {
        labels(**w, gpu="0", layer="driver", memory="device"): 100 * GiB,
        labels(**w, gpu="0", layer="runtime", memory="device"): 100 * GiB,
        labels(**w, gpu="0", layer="driver", memory="host"): 64 * MiB,
        labels(**e, gpu="1", layer="vmm", memory="device"): 3 * GiB,
        labels(**t, gpu="unknown", layer="driver", memory="device"): 2 * MiB,
    }
    assert samples(families, "kvtrace_outstanding_objects") == {
        labels(**w, gpu="0", layer="driver", memory="device"): 40,
        labels(**w, gpu="0", layer="runtime", memory="device"): 40,
        labels(**w, gpu="0", layer="driver", memory="host"): 2,
        labels(**e, gpu="1", layer="vmm", memory="device"): 3,
        labels(**t, gpu="unknown", layer="driver", memory="device"): 1,
    }
    # pid 6161 has exited (no memory, not known, not in the snapshot): its counters are not exported
    assert samples(families, "kvtrace_allocations_total") == {
        labels(**w, layer="driver"): 230, labels(**w, layer="runtime"): 229, labels(**e, layer="vmm"): 3}
    assert samples(families, "kvtrace_frees_total") == {
        labels(**w, layer="driver"): 190, labels(**w, layer="runtime"): 189}
    assert samples(families, "kvtrace_allocation_failures_total") == {
        labels(api="cudaMalloc", error_code="2"): 5, labels(api="cuMemAlloc_v2", error_code="2"): 5,
        labels(api="cuMemCreate", error_code="1"): 1}
    assert samples(families, "kvtrace_growth_bytes_per_second") == {
        labels(**w, gpu="0", window="1m"): 6.5e6, labels(**w, gpu="0", window="15m"): 5.25e6,
        labels(**e, gpu="1", window="1m"): 0.0, labels(**e, gpu="1", window="15m"): -1.5e3,
        labels(**t, gpu="unknown", window="1m"): 0.0, labels(**t, gpu="unknown", window="15m"): 0.0}
    # None (not growing) and inf are left out rather than exported as a number
    assert samples(families, "kvtrace_time_to_oom_seconds") == {labels(**w, gpu="0"): 2520.0}
    assert samples(families, "kvtrace_unattributed_bytes") == {
        labels(**w, gpu="0"): 1 * GiB, labels(**t, gpu="unknown"): 598 * MiB}
    assert samples(families, "kvtrace_nvml_used_bytes") == {
        labels(**w, gpu="0"): 101 * GiB, labels(**t, gpu="unknown"): 600 * MiB}
    h200 = 150_754_820_096
    assert samples(families, "kvtrace_gpu_memory_total_bytes") == {
        labels(gpu="0", uuid="GPU-0a1b"): h200, labels(gpu="1", uuid="GPU-2c3d"): h200}
    assert samples(families, "kvtrace_gpu_memory_used_bytes") == {
        labels(gpu="0", uuid="GPU-0a1b"): 120 * GiB, labels(gpu="1", uuid="GPU-2c3d"): 1 * GiB}
    assert samples(families, "kvtrace_gpu_memory_free_bytes") == {
        labels(gpu="0", uuid="GPU-0a1b"): h200 - 120 * GiB, labels(gpu="1", uuid="GPU-2c3d"): h200 - 1 * GiB}
    # Only growing suspects count: the flat 2 GiB and 512 MiB sites (weights-like) do not.
    assert samples(families, "kvtrace_leak_suspects") == {
        labels(**w, gpu="0"): 1, labels(**e, gpu="1"): 0, labels(**t, gpu="unknown"): 0}
    assert samples(families, "kvtrace_leak_suspect_bytes") == {
        labels(**w, gpu="0"): 8 * GiB, labels(**e, gpu="1"): 0, labels(**t, gpu="unknown"): 0}
    assert samples(families, "kvtrace_events_total") == {(): 100_003}
    assert samples(families, "kvtrace_events_lost_total") == {(): 23}
    assert samples(families, "kvtrace_ledger_full_total") == {(): 0}
    assert samples(families, "kvtrace_unknown_frees_total") == {(): 11}
    assert samples(families, "kvtrace_share_refused_total") == {  # issue 31: the user at its share, named
        labels(resource="vllm_senders", user="alice"): 115, labels(resource="group_connections", user="other"): 3,
        labels(resource="ledger", user="1001"): 23, labels(resource="totals", user="1001"): 0}  # the kernel's shares
    assert samples(families, "kvtrace_vllm_messages_received_total") == {(): 40}
    assert samples(families, "kvtrace_vllm_messages_rejected_total") == {(): 2}
    assert samples(families, "kvtrace_events_undecodable_total") == {(): 2}
    assert samples(families, "kvtrace_event_loop_late_turns_total") == {(): 1}
    assert samples(families, "kvtrace_site_samples_total") == {(): 4}
    assert samples(families, "kvtrace_site_sample_objects") == {(): 262_144}
    assert samples(families, "kvtrace_component_up") == {
        labels(component="analysis"): 1, labels(component="bpf"): 1, labels(component="exporter"): 1,
        labels(component="nvml"): 1, labels(component="python_stacks"): 1}
    assert samples(families, "kvtrace_build_info") == {labels(version=__version__): 1}
    # Depth per live process (the exited one's series goes): 1 segments, 2 blocks, 3 full
    assert samples(families, "kvtrace_process_depth") == {labels(**w): 2, labels(**e): 1}
    assert samples(families, "kvtrace_process_depth_start_time_seconds") == {
        labels(**w): (NOW_NS - 90 * NS) / 1e9, labels(**e): (NOW_NS - 3600 * NS) / 1e9}


def test_every_declared_metric_is_exported_with_its_type_help_and_labels():
    families = scrape(FakeSource())
    exported = {name for name in families if name.startswith("kvtrace_")}
    assert exported == {spec.name.removesuffix("_total") if spec.type == "counter" else spec.name
                        for spec in METRICS}
    for spec in METRICS:
        family = families[spec.name.removesuffix("_total") if spec.type == "counter" else spec.name]
        assert family.type == spec.type, spec.name
        assert family.documentation == spec.help, spec.name
        assert {s.name for s in family.samples} == {spec.name}, spec.name  # no _created samples
        for sample in family.samples:
            assert set(sample.labels) == set(spec.labels), spec.name
    # the rest is prometheus-client's process collector: the agent's own CPU and memory
    assert {name for name in families if not name.startswith("kvtrace_")} <= {
        "process_virtual_memory_bytes", "process_resident_memory_bytes", "process_start_time_seconds",
        "process_cpu_seconds", "process_open_fds", "process_max_fds"}
    assert "process_resident_memory_bytes" in families


ALLOWED_LABELS = {"pid", "title", "gpu", "layer", "memory", "window", "api", "error_code", "component",
                  "uuid", "version", "role", "state", "source", "kind", "result",
                  "resource", "user"}  # kvtrace_share_refused_total: at most 8 users by name, then "other"


def test_no_label_carries_an_address_or_a_stack():
    families = scrape(FakeSource())
    forbidden = [f"{ADDRESS:x}", str(ADDRESS), f"{CALLER:x}", str(CALLER), "KVCache.grow_forever",
                 "leaky_cache.py", "engine.py", "sk-very-secret"]
    for family in families.values():
        for sample in family.samples:
            assert set(sample.labels) <= ALLOWED_LABELS, (sample.name, sample.labels)
            for name, value in sample.labels.items():
                assert not re.search(r"0x[0-9a-fA-F]{4,}|\b\d{10,}\b", value), (sample.name, name, value)
                assert not any(bad in value for bad in forbidden), (sample.name, name, value)
                if name == "title":
                    assert len(value) <= TITLE_MAX_CHARS
                if name == "pid":
                    assert value.isdigit()
                if name == "gpu":
                    assert value.isdigit() or value == "unknown"


def test_component_down_is_exported_as_zero():
    components = [ComponentStatus("bpf", True), ComponentStatus("nvml", False, "NVML library not found")]
    families = scrape(FakeSource(components_value=components))
    up = samples(families, "kvtrace_component_up")
    assert up[labels(component="nvml")] == 0
    assert up[labels(component="bpf")] == 1
    assert all("reason" not in dict(key) for key in up)  # reasons are free text: not labels


def test_missing_analysis_reports_analysis_down_and_keeps_the_ledger():
    families = scrape(FakeSource(snapshot_value=None, components_value=[]))
    assert samples(families, "kvtrace_component_up") == {
        labels(component="analysis"): 0, labels(component="exporter"): 1}
    assert len(samples(families, "kvtrace_outstanding_bytes")) == 5
    assert samples(families, "kvtrace_growth_bytes_per_second") == {}
    assert samples(families, "kvtrace_gpu_memory_total_bytes") == {}
    # the known processes keep their counters without a snapshot
    assert samples(families, "kvtrace_allocations_total")[
        labels(pid="4242", title=WORKER_TITLE, layer="driver")] == 230


def test_analysis_is_up_only_while_it_keeps_reporting():
    # GIVEN the Session the agent serves: analysis reported up once, then silent past its heartbeat
    session = Session()
    session.report_component("analysis", True, stale_after_seconds=0.05, stale_reason="stuck")
    collector = KvtraceCollector(session, FakeSource(snapshot_value=None))
    assert _up(collector)["analysis"] == 1
    time.sleep(0.1)
    # THEN it is down, in /metrics and in the API alike (one computation)
    assert _up(collector)["analysis"] == 0
    assert [(c.name, c.up, c.reason) for c in session.info().components] == [("analysis", False, "stuck")]


def _up(collector) -> dict[str, float]:
    family = next(f for f in collector.collect() if f.name == "kvtrace_component_up")
    return {sample.labels["component"]: sample.value for sample in family.samples}


@pytest.mark.parametrize("part", ["snapshot", "ledger", "counters", "titles", "components", "depths"])
def test_a_failing_part_of_the_source_still_gives_a_scrape(part, caplog):
    families = scrape(FakeSource(broken={part}))
    assert samples(families, "kvtrace_component_up")[labels(component="exporter")] == 0
    assert samples(families, "kvtrace_build_info") == {labels(version=__version__): 1}
    assert any(f"reading {'process titles' if part == 'titles' else part} failed" in r.getMessage()
               for r in caplog.records)
    if part != "ledger":
        assert samples(families, "kvtrace_outstanding_bytes")
    if part != "counters":
        assert samples(families, "kvtrace_events_lost_total") == {(): 23}


def test_title_falls_back_to_the_snapshot_and_missing_counters_are_not_invented():
    source = FakeSource(titles={}, counters_value={"events_lost": 2})
    families = scrape(source)
    assert samples(families, "kvtrace_time_to_oom_seconds") == {
        labels(pid="4242", title=WORKER_TITLE, gpu="0"): 2520.0}
    assert samples(families, "kvtrace_events_lost_total") == {(): 2}
    assert samples(families, "kvtrace_events_total") == {}


def test_nan_growth_and_negative_time_to_oom_are_left_out():
    process = ProcessGpu(WORKER, TITLES[WORKER], 0, 1, None, None, math.nan, 1.0, -5.0, 0, 0, None)
    snapshot = AnalysisSnapshot(NOW_NS, processes=(process,))
    families = scrape(FakeSource(snapshot_value=snapshot))
    assert samples(families, "kvtrace_growth_bytes_per_second") == {
        labels(pid="4242", title=WORKER_TITLE, gpu="0", window="15m"): 1.0}
    assert samples(families, "kvtrace_time_to_oom_seconds") == {}


@pytest.mark.parametrize("title, expected", [
    ("VLLM::Worker_TP0", "VLLM::Worker_TP0"),
    ("python serve.py --api-key sk-123 --port 8000", "python serve.py --api-key *** --port 8000"),
    ("python serve.py --hf-token=hf_abc", "python serve.py --hf-token=***"),
    ("HF_TOKEN=hf_abc python x.py", "HF_TOKEN=*** python x.py"),
    ("python serve.py --password hunter2", "python serve.py --password ***"),
    ("python serve.py --use-token --port 8000", "python serve.py --use-token --port 8000"),
    ("python keygen.py out", "python keygen.py out"),
    ("a\x00b\nc\t d", "a b c d"),
    ("x" * 100, "x" * (TITLE_MAX_CHARS - 3) + "..."),
    ("", ""),
])
def test_metric_title(title, expected):
    assert metric_title(title) == expected


# ---- the listener ----

@pytest.mark.parametrize("listen", ["0.0.0.0:9464", "[::]:9464", "10.1.2.3:9464", "192.168.0.10:0"])
def test_a_non_loopback_address_is_refused_unless_allowed(listen):
    with pytest.raises(MetricsSetupError, match="--metrics-allow-remote"):
        MetricsServer(FakeSource(), FakeSource(), listen)
    MetricsServer(FakeSource(), FakeSource(), listen, allow_remote=True)  # not started: nothing is bound


@pytest.mark.parametrize("listen, address", [
    ("127.0.0.1:9464", ("127.0.0.1", 9464)), ("[::1]:9500", ("::1", 9500)),
    ("localhost:0", ("localhost", 0)), ("127.0.0.2:9464", ("127.0.0.2", 9464))])
def test_loopback_addresses_are_accepted(listen, address):
    assert MetricsServer(FakeSource(), FakeSource(), listen).address == address


@pytest.mark.parametrize("listen", ["9464", "127.0.0.1", "127.0.0.1:http", ":9464", "127.0.0.1:70000"])
def test_a_malformed_address_is_refused(listen):
    with pytest.raises(MetricsSetupError, match="HOST:PORT"):
        parse_listen(listen)


def _refused(host, port) -> bool:
    try:
        socket.create_connection((host, port), timeout=2).close()
        return False
    except ConnectionRefusedError:
        return True


def test_stop_closes_the_port_and_it_can_be_served_again():
    server = MetricsServer(FakeSource(), FakeSource(), "127.0.0.1:0", process_metrics=False)
    server.start()
    host, port = server.address
    assert port != 0
    assert "kvtrace_build_info" in scrape_text(server)
    server.stop()
    assert _refused(host, port)
    again = MetricsServer(FakeSource(), FakeSource(), f"127.0.0.1:{port}", process_metrics=False)
    again.start()
    try:
        assert "kvtrace_build_info" in scrape_text(again)
    finally:
        again.stop()
    server.stop()  # twice is fine


def test_a_port_in_use_is_one_clear_error(shared_server):
    port = shared_server.address[1]
    with pytest.raises(MetricsSetupError, match=f"cannot serve metrics on 127.0.0.1:{port}.*--metrics-listen"):
        MetricsServer(FakeSource(), FakeSource(), f"127.0.0.1:{port}").start()


def test_concurrent_scrapes(shared_server):
    _PROXY.target = FakeSource()
    try:
        results = []
        threads = [threading.Thread(target=lambda: results.append(scrape_text(shared_server)))
                   for _ in range(7)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
    finally:
        _PROXY.target = None
    assert len(results) == 7
    assert len({len(text.split("process_")[0]) for text in results}) == 1  # the same kvtrace part


def test_flags():
    parser = argparse.ArgumentParser()
    add_metrics_flags(parser)
    args = parser.parse_args([])
    assert args.metrics_listen == DEFAULT_LISTEN == "127.0.0.1:9464" and not args.metrics_allow_remote
    assert check_listen(args.metrics_listen, args.metrics_allow_remote) == ("127.0.0.1", 9464)
    with pytest.raises(MetricsSetupError):
        check_listen("0.0.0.0:9464", False)
    remote = parser.parse_args(["--metrics-listen", "0.0.0.0:9464", "--metrics-allow-remote"])
    assert check_listen(remote.metrics_listen, remote.metrics_allow_remote) == ("0.0.0.0", 9464)


# ---- the Session as the source ----

def _event(kind, api, layer, address, size=0, pid=WORKER, error=0):
    return Event(kind=kind, api=api, pid=pid, tid=pid, timestamp_ns=NOW_NS, layer=layer,
                 object=ObjectKind.ALLOCATION, memory=Memory.DEVICE, size_bytes=size,
                 address=address, device=0, error_code=error)


def _titled(pid: int) -> ProcessInfo | None:
    title = TITLES.get(pid)
    return ProcessInfo(pid, title, title[:15], "", "", 0.0, time.monotonic()) if title else None


def test_the_session_as_source():
    # GIVEN a Session that took 23 cuMemAlloc_v2 of 1 MiB, 7 frees and 2 out-of-memory failures
    session = Session(ProcessTable(_titled))
    session.ingest_many([_event(Kind.ALLOC, Api.cuMemAlloc_v2, Layer.DRIVER, ADDRESS + i * MiB, MiB)
                         for i in range(23)])
    session.ingest_many([_event(Kind.FREE, Api.cuMemFree_v2, Layer.DRIVER, ADDRESS + i * MiB) for i in range(7)])
    session.ingest_many([_event(Kind.ALLOC_FAILED, Api.cuMemAlloc_v2, Layer.DRIVER, 0, 80 * GiB, error=2)] * 2)
    session.report_counters({"events_submitted": 32, "events_lost": 23})
    session.ingest(EventsLost(23, NOW_NS))

    # WHEN it is scraped
    families = scrape(session, FakeSource(snapshot_value=None))

    # THEN the exporter shows the ledger exactly
    w = dict(pid="4242", title=WORKER_TITLE)
    assert samples(families, "kvtrace_outstanding_bytes") == {
        labels(**w, gpu="0", layer="driver", memory="device"): 16 * MiB}
    assert samples(families, "kvtrace_outstanding_objects") == {
        labels(**w, gpu="0", layer="driver", memory="device"): 16}
    assert samples(families, "kvtrace_allocations_total") == {labels(**w, layer="driver"): 23}
    assert samples(families, "kvtrace_frees_total") == {labels(**w, layer="driver"): 7}
    assert samples(families, "kvtrace_allocation_failures_total") == {
        labels(api="cuMemAlloc_v2", error_code="2"): 2}
    assert samples(families, "kvtrace_events_lost_total") == {(): 23}
    assert samples(families, "kvtrace_events_total") == {(): 32}
    # the copy is a copy: later events do not change what was read
    counts = session.ledger_counts()
    session.ingest(_event(Kind.ALLOC, Api.cuMemAlloc_v2, Layer.DRIVER, ADDRESS + 99 * MiB, MiB))
    assert counts.allocations_total[(WORKER, Layer.DRIVER)] == 23
    assert counts.totals[TotalsKey(WORKER, 0, Layer.DRIVER, Memory.DEVICE)] == (16 * MiB, 16)


def test_collector_works_without_http():
    # the same collector can feed another registry (e.g. a multiprocess or pushgateway setup)
    collector = KvtraceCollector(FakeSource(), FakeSource())
    names = {family.name for family in collector.collect()}
    assert names == {spec.name.removesuffix("_total") if spec.type == "counter" else spec.name
                     for spec in METRICS}
    assert {family.name for family in collector.describe()} == names
    assert METRIC_NAMES == {spec.name for spec in METRICS}
