"""The Prometheus exporter over a fake source, scraped over HTTP on 127.0.0.1 (ephemeral port) and
parsed with prometheus_client's own parser: exact values, label hygiene, degraded states, the
listener's safety rules and the tracer adapter."""
from __future__ import annotations

import argparse
import math
import re
import socket
import threading
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtrace import __version__
from kvtrace.model.findings import AnalysisSnapshot, ComponentStatus, GpuMemory, LeakSuspect, ProcessGpu
from kvtrace.servers.prometheus import (DEFAULT_LISTEN, METRIC_NAMES, METRICS, TITLE_MAX_CHARS,
                                       KvtraceCollector, LedgerCounts, MetricsServer, MetricsSetupError,
                                       TracerMetricsSource, add_metrics_flags, metric_title,
                                       metrics_server_from_args, parse_listen)
from kvtrace.model.events import Api, Event, Kind, Layer, Memory, ObjectKind
from kvtrace.model.ledger import Ledger, TotalsKey
from kvtrace.model.processes import ProcessInfo
from kvtrace.model.stacks import Frame, Stack

GiB = 1 << 30
MiB = 1 << 20
NOW_NS = 1_800_000_000_000_000_000
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


def synthetic_snapshot(timestamp_ns: int = NOW_NS, components=None) -> AnalysisSnapshot:
    h200 = 150_754_820_096
    return AnalysisSnapshot(
        timestamp_ns=timestamp_ns,
        gpus=(GpuMemory(0, "GPU-0a1b", "NVIDIA H200", h200, 120 * GiB, h200 - 120 * GiB, 512 * MiB),
              GpuMemory(1, "GPU-2c3d", "NVIDIA H200", h200, 1 * GiB, h200 - 1 * GiB, 512 * MiB)),
        processes=(
            ProcessGpu(WORKER, TITLES[WORKER], 0, 100 * GiB, 101 * GiB, 1 * GiB, 6.5e6, 5.25e6, 2520.0,
                       230, 190, 190 / 230),
            ProcessGpu(ENGINE, TITLES[ENGINE], 1, 3 * GiB, None, None, 0.0, -1.5e3, None, 0, 0, None),
            ProcessGpu(TRAIN, TITLES[TRAIN], -1, 2 * MiB, 600 * MiB, 598 * MiB, 0.0, 0.0, math.inf, 0, 0, None),
        ),
        suspects=(
            LeakSuspect(1, WORKER, TITLES[WORKER], 0, 7, LEAKY_STACK, CALLER, 8 * GiB, 23, 840.0, 5.0e6),
            LeakSuspect(2, WORKER, TITLES[WORKER], 0, 9, None, CALLER + 64, 2 * GiB, 3, 700.0, 0.0),
            LeakSuspect(3, ENGINE, TITLES[ENGINE], 1, 0, None, CALLER + 128, 512 * MiB, 1, 650.0, 0.0),
        ),
        components=components if components is not None else (
            ComponentStatus("bpf", True), ComponentStatus("nvml", True),
            ComponentStatus("python_stacks", True)),
        counters={"events_seen": 1, "events_lost": 1},
    )


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


TRACER_COUNTERS = {"events_submitted": 100_003, "events_lost": 23, "ledger_full": 0,
                   "unknown_frees": 11, "returns_unpaired": 0, "filtered": 7, "events_seen": 99_980,
                   "resyncs": 1}


@dataclass
class FakeSource:
    """A MetricsSource whose parts can be swapped or made to fail."""

    snapshot_value: AnalysisSnapshot | None = field(default_factory=synthetic_snapshot)
    ledger_value: LedgerCounts = field(default_factory=synthetic_ledger)
    counters_value: dict = field(default_factory=lambda: dict(TRACER_COUNTERS))
    titles: dict = field(default_factory=lambda: dict(TITLES))
    broken: set = field(default_factory=set)

    def _check(self, part):
        if part in self.broken:
            raise RuntimeError(f"{part} is broken")

    def snapshot(self):
        self._check("snapshot")
        return self.snapshot_value

    def ledger(self):
        self._check("ledger")
        return self.ledger_value

    def counters(self):
        self._check("counters")
        return self.counters_value

    def process_titles(self):
        self._check("titles")
        return self.titles


@contextmanager
def served(source):
    collector = KvtraceCollector(source, clock_ns=lambda: NOW_NS + 5 * 10**9)
    server = MetricsServer(source, "127.0.0.1:0", collector=collector)
    server.start()
    try:
        yield server
    finally:
        server.stop()


class ProxySource:
    """Lets one served exporter read a different source in each test (a stop takes 0.5 s)."""

    target = None

    def snapshot(self):
        return self.target.snapshot()

    def ledger(self):
        return self.target.ledger()

    def counters(self):
        return self.target.counters()

    def process_titles(self):
        return self.target.process_titles()


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


def scrape(source):
    """{family name: family} as prometheus_client's parser reads the /metrics text."""
    _PROXY.target = source
    try:
        text = scrape_text(_SERVED[0])
    finally:
        _PROXY.target = None
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
    assert samples(families, "kvtrace_component_up") == {
        labels(component="analysis"): 1, labels(component="bpf"): 1, labels(component="exporter"): 1,
        labels(component="nvml"): 1, labels(component="python_stacks"): 1}
    assert samples(families, "kvtrace_build_info") == {labels(version=__version__): 1}


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
                  "uuid", "version"}


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
    snapshot = synthetic_snapshot(components=(ComponentStatus("bpf", True),
                                              ComponentStatus("nvml", False, "NVML library not found")))
    families = scrape(FakeSource(snapshot_value=snapshot))
    up = samples(families, "kvtrace_component_up")
    assert up[labels(component="nvml")] == 0
    assert up[labels(component="bpf")] == 1
    assert all("reason" not in dict(key) for key in up)  # reasons are free text: not labels


def test_stale_or_missing_snapshot_reports_analysis_down_and_keeps_the_ledger():
    stale = synthetic_snapshot(timestamp_ns=NOW_NS - 120 * 10**9)
    families = scrape(FakeSource(snapshot_value=stale))
    assert samples(families, "kvtrace_component_up")[labels(component="analysis")] == 0

    families = scrape(FakeSource(snapshot_value=None))
    assert samples(families, "kvtrace_component_up") == {
        labels(component="analysis"): 0, labels(component="exporter"): 1}
    assert len(samples(families, "kvtrace_outstanding_bytes")) == 5
    assert samples(families, "kvtrace_growth_bytes_per_second") == {}
    assert samples(families, "kvtrace_gpu_memory_total_bytes") == {}
    # the known processes keep their counters without a snapshot
    assert samples(families, "kvtrace_allocations_total")[
        labels(pid="4242", title=WORKER_TITLE, layer="driver")] == 230


def test_analysis_is_up_only_when_fresh_and_not_reported_down():
    says_down = synthetic_snapshot(components=(ComponentStatus("analysis", False, "stuck"),))
    families = scrape(FakeSource(snapshot_value=says_down))
    assert samples(families, "kvtrace_component_up")[labels(component="analysis")] == 0

    stale_says_up = synthetic_snapshot(timestamp_ns=NOW_NS - 3600 * 10**9,
                                       components=(ComponentStatus("analysis", True),))
    families = scrape(FakeSource(snapshot_value=stale_says_up))
    assert samples(families, "kvtrace_component_up")[labels(component="analysis")] == 0


@pytest.mark.parametrize("part", ["snapshot", "ledger", "counters", "titles"])
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
        MetricsServer(FakeSource(), listen)
    MetricsServer(FakeSource(), listen, allow_remote=True)  # not started: nothing is bound


@pytest.mark.parametrize("listen, address", [
    ("127.0.0.1:9464", ("127.0.0.1", 9464)), ("[::1]:9500", ("::1", 9500)),
    ("localhost:0", ("localhost", 0)), ("127.0.0.2:9464", ("127.0.0.2", 9464))])
def test_loopback_addresses_are_accepted(listen, address):
    assert MetricsServer(FakeSource(), listen).address == address


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
    server = MetricsServer(FakeSource(), "127.0.0.1:0", process_metrics=False)
    server.start()
    host, port = server.address
    assert port != 0
    assert "kvtrace_build_info" in scrape_text(server)
    server.stop()
    assert _refused(host, port)
    again = MetricsServer(FakeSource(), f"127.0.0.1:{port}", process_metrics=False)
    again.start()
    try:
        assert "kvtrace_build_info" in scrape_text(again)
    finally:
        again.stop()
    server.stop()  # twice is fine


def test_a_port_in_use_is_one_clear_error(shared_server):
    port = shared_server.address[1]
    with pytest.raises(MetricsSetupError, match=f"cannot serve metrics on 127.0.0.1:{port}.*--metrics-listen"):
        MetricsServer(FakeSource(), f"127.0.0.1:{port}").start()


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
    assert metrics_server_from_args(args, FakeSource()).address == ("127.0.0.1", 9464)
    assert metrics_server_from_args(parser.parse_args(["--metrics-listen", "off"]), FakeSource()) is None
    with pytest.raises(MetricsSetupError):
        metrics_server_from_args(parser.parse_args(["--metrics-listen", "0.0.0.0:9464"]), FakeSource())
    server = metrics_server_from_args(
        parser.parse_args(["--metrics-listen", "0.0.0.0:9464", "--metrics-allow-remote"]), FakeSource())
    assert server.address == ("0.0.0.0", 9464)


# ---- the tracer adapter ----

class FakeProcesses:
    def known(self):
        return {pid: ProcessInfo(pid, title, title[:15], "", "", 0.0, 0.0) for pid, title in TITLES.items()}


class FakeTracer:
    """What TracerMetricsSource uses of kvtrace.tracer.Tracer: lock, ledger, counters(), processes."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ledger = Ledger()
        self.processes = FakeProcesses()

    def counters(self):
        assert self.lock.locked()
        return dict(TRACER_COUNTERS)


def _event(kind, api, layer, address, size=0, pid=WORKER, error=0):
    return Event(kind=kind, api=api, pid=pid, tid=pid, timestamp_ns=NOW_NS, layer=layer,
                 object=ObjectKind.ALLOCATION, memory=Memory.DEVICE, size_bytes=size,
                 address=address, device=0, error_code=error)


def test_tracer_source_over_a_real_ledger():
    # GIVEN a ledger that saw 23 cuMemAlloc_v2 of 1 MiB, 7 frees and 2 out-of-memory failures
    tracer = FakeTracer()
    for i in range(23):
        tracer.ledger.apply(_event(Kind.ALLOC, Api.cuMemAlloc_v2, Layer.DRIVER, ADDRESS + i * MiB, MiB))
    for i in range(7):
        tracer.ledger.apply(_event(Kind.FREE, Api.cuMemFree_v2, Layer.DRIVER, ADDRESS + i * MiB))
    for _ in range(2):
        tracer.ledger.apply(_event(Kind.ALLOC_FAILED, Api.cuMemAlloc_v2, Layer.DRIVER, 0, 80 * GiB, error=2))
    source = TracerMetricsSource(tracer, snapshot=lambda: None)

    # WHEN it is scraped
    families = scrape(source)

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
    # the copy is a copy: later events do not change what was read
    counts = source.ledger()
    tracer.ledger.apply(_event(Kind.ALLOC, Api.cuMemAlloc_v2, Layer.DRIVER, ADDRESS + 99 * MiB, MiB))
    assert counts.allocations_total[(WORKER, Layer.DRIVER)] == 23
    assert counts.totals[TotalsKey(WORKER, 0, Layer.DRIVER, Memory.DEVICE)] == (16 * MiB, 16)


def test_collector_works_without_http():
    # the same collector can feed another registry (e.g. a multiprocess or pushgateway setup)
    collector = KvtraceCollector(FakeSource(), clock_ns=lambda: NOW_NS)
    names = {family.name for family in collector.collect()}
    assert names == {spec.name.removesuffix("_total") if spec.type == "counter" else spec.name
                     for spec in METRICS}
    assert {family.name for family in collector.describe()} == names
    assert METRIC_NAMES == {spec.name for spec in METRICS}
