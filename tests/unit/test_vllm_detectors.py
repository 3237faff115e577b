"""vLLM engines from process titles and parentage, and each detector on synthetic plugin reports and
/metrics scrapes: it fires on its planted case with the exact figure, in the time it must, and stays
silent on the healthy case."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from fake_agent import event
from kvtrace.analysis.analyzer import AnalysisOptions, Analyzer
from kvtrace.analysis.vllm import VllmAnalysis, VllmOptions
from kvtrace.model.ledger import ledger_view
from kvtrace.model.processes import ProcessInfo, ProcessTable
from kvtrace.model.vllm import (
    EngineMetrics,
    FindingKind,
    KvCacheLayout,
    KvRequest,
    KvTensor,
    RequestState,
    Role,
    SchedulerReport,
    SleepPool,
    SleepReport,
    VllmMetricsSample,
    VllmView,
)
from kvtrace.session import Session

NS = 1_000_000_000
T0 = 1_700_000_000  # seconds since the epoch at the first tick
MiB = 1 << 20
GiB = 1 << 30
LONG_AGO = T0 - 3600  # an engine started an hour before: out of the cold start


def process(pid: int, title: str, parent: int = 1, started: float = LONG_AGO) -> ProcessInfo:
    return ProcessInfo(pid, title, title[:15], "", "", started, 0.0, parent)


def metrics(engine: str = "0", usage: float | None = 0.0, running: float | None = 0.0, waiting: float | None = 0.0,
            sleep: int | None = 0) -> EngineMetrics:
    return EngineMetrics(engine, "llama", usage, running, waiting, sleep, 0.0, 1001, 16)


def report(pid: int, second: float, free: int = 1000, total: int = 1000, running: int = 0, waiting: int = 0,
           allocated: int = 0, freed: int = 0, requests: tuple[KvRequest, ...] = ()) -> SchedulerReport:
    return SchedulerReport(pid, int((T0 + second) * NS), total, free, running, waiting, allocated, freed, requests)


@dataclass
class Host:
    """What VllmAnalysis.update reads, kept by the test and fed one tick a second."""

    processes: dict[int, ProcessInfo]
    options: dict = field(default_factory=dict)
    view: VllmView = field(default_factory=VllmView)
    # The engine holds traced memory: its plugin's reports count (model/vllm.py's vllm_tie; test_plugin_shares).
    traced: dict[tuple[int, int], int] = field(default_factory=lambda: {(100, 0): GiB})
    roles: dict[tuple[int, int], dict[Role, int]] = field(default_factory=dict)
    second: float = 0.0

    def __post_init__(self) -> None:
        self.analysis = VllmAnalysis(VllmOptions(**self.options))

    def tick(self, second: float | None = None):
        if second is not None:
            self.second = second
        engines, findings = self.analysis.update(self.view, self.processes, self.traced, self.roles,
                                                 int((T0 + self.second) * NS), int(self.second * NS))
        self.second += 1
        return engines, findings

    def engine(self, pid: int = 100):
        engines, findings = self.tick()
        (engine,) = [engine for engine in engines if engine.engine_pid == pid]
        return engine, [finding for finding in findings if finding.engine_pid == pid]


def kinds(findings) -> list[FindingKind]:
    return [finding.kind for finding in findings]


# ---- engines ----


def test_one_gpu_the_engine_core_alone():
    host = Host({50: process(50, "python offline.py"), 100: process(100, "VLLM::EngineCore", parent=50),
                 300: process(300, "python train.py")},
                traced={(100, 0): 30 * GiB, (300, 0): GiB},
                roles={(100, 0): {Role.KV_CACHE: 27 * GiB, Role.WEIGHTS: 3 * GiB}, (300, 0): {Role.OTHER: GiB}})
    engines, findings = host.tick()
    (engine,) = engines
    assert (engine.engine_pid, engine.title, engine.worker_pids, engine.api_server_pid) == \
        (100, "VLLM::EngineCore", (100,), 0)
    assert engine.traced_bytes == 30 * GiB
    assert engine.role_bytes == {Role.KV_CACHE: 27 * GiB, Role.WEIGHTS: 3 * GiB}
    assert not engine.plugin and engine.kv_cache_usage_ratio is None and engine.requests_running is None
    assert findings == ()


def test_two_gpus_the_workers_and_their_layouts_belong_to_the_engine():
    host = Host({100: process(100, "VLLM::EngineCore", parent=50),
                 101: process(101, "VLLM::Worker_TP0", parent=100),
                 102: process(102, "VLLM::Worker_TP1", parent=105),  # through a multiprocessing helper
                 105: process(105, "python -c from multiprocessing.spawn import spawn_main", parent=100),
                 200: process(200, "VLLM::EngineCore", parent=60),
                 201: process(201, "VLLM::Worker_TP0", parent=200),
                 999: process(999, "VLLM::Worker_TP0", parent=998)},  # an orphan: no engine above it
                traced={(101, 0): 20 * GiB, (102, 1): 20 * GiB, (100, 0): 0, (201, 2): 5 * GiB},
                roles={(101, 0): {Role.KV_CACHE: 16 * GiB, Role.WEIGHTS: 4 * GiB},
                       (102, 1): {Role.KV_CACHE: 16 * GiB, Role.WEIGHTS: 3 * GiB, Role.OTHER: GiB}})
    tensors = tuple(KvTensor(0x7F0000000000 + layer * 2 * GiB, 2 * GiB) for layer in range(8))
    host.view.layouts[101] = KvCacheLayout(101, T0 * NS, 0, tensors, 55344, 524288, 16)
    host.view.layouts[102] = KvCacheLayout(102, T0 * NS, 1, tensors, 55344, 524288, 16)
    host.view.schedulers[100] = report(100, 0, free=55343, total=55343)
    engines, _ = host.tick()
    first, second = engines
    assert (first.engine_pid, first.worker_pids) == (100, (100, 101, 102))
    assert (second.engine_pid, second.worker_pids) == (200, (200, 201))
    assert first.traced_bytes == 40 * GiB and second.traced_bytes == 5 * GiB
    assert first.role_bytes == {Role.KV_CACHE: 32 * GiB, Role.WEIGHTS: 7 * GiB, Role.OTHER: GiB}
    assert first.plugin and first.kv_tensor_bytes == 32 * GiB and first.page_size_bytes == 524288
    assert (first.blocks_total, first.blocks_free, first.kv_cache_usage_ratio) == (55343, 55343, 0.0)
    assert not second.plugin and second.kv_tensor_bytes == 0


def test_the_api_server_and_its_metrics_by_data_parallel_rank():
    sample = VllmMetricsSample("http://127.0.0.1:8000/metrics", 50, (T0 + 3) * NS, (
        metrics("0", usage=0.25, running=3, waiting=1), metrics("1", usage=0.5, running=0, waiting=0, sleep=1)))
    host = Host({50: process(50, "/usr/bin/python3 /usr/local/bin/vllm serve m --data-parallel-size 2"),
                 100: process(100, "VLLM::EngineCore_DP1", parent=50),
                 110: process(110, "VLLM::EngineCore_DP0", parent=50)})
    host.view.metrics[sample.url] = sample
    dp1, dp0 = host.tick()[0]
    assert (dp1.engine_pid, dp1.api_server_pid, dp1.metrics_url) == (100, 50, sample.url)
    assert (dp1.kv_cache_usage_ratio, dp1.metrics_kv_cache_usage_ratio, dp1.requests_running) == (0.5, 0.5, 0)
    assert dp1.sleep_level == 1 and not dp1.plugin
    assert (dp0.engine_pid, dp0.kv_cache_usage_ratio, dp0.requests_running, dp0.requests_waiting) == (110, 0.25, 3, 1)


def test_the_only_engine_of_a_server_and_the_plugin_first():
    sample = VllmMetricsSample("http://h:8000/metrics", 0, T0 * NS, (metrics("0", usage=0.2),))
    host = Host({40: process(40, "VLLM::APIServer_0"), 100: process(100, "VLLM::EngineCore", parent=40)})
    host.view.metrics[sample.url] = sample  # a URL given by flag: its pid unknown, the title says
    engine, _ = host.engine()
    assert engine.api_server_pid == 40 and engine.metrics_url == "" and engine.kv_cache_usage_ratio is None
    host.view.metrics[sample.url] = VllmMetricsSample(sample.url, 40, T0 * NS, sample.engines)
    engine, _ = host.engine()
    assert (engine.metrics_url, engine.kv_cache_usage_ratio) == (sample.url, 0.2)
    host.view.schedulers[100] = report(100, 1, free=900, total=1000)
    engine, _ = host.engine()
    assert (engine.kv_cache_usage_ratio, engine.metrics_kv_cache_usage_ratio) == (0.09999999999999998, 0.2)
    failed = VllmMetricsSample(sample.url, 40, T0 * NS, (), error="connection refused")
    host.view.metrics[sample.url] = failed
    engine, _ = host.engine()
    assert engine.metrics_error == "connection refused" and engine.metrics_kv_cache_usage_ratio is None


def test_a_process_sending_scheduler_reports_is_an_engine_and_gone_ones_are_dropped():
    host = Host({100: process(100, "python my_engine.py")})
    host.view.schedulers[100] = report(100, 0)
    engine, _ = host.engine()
    assert engine.worker_pids == (100,) and engine.plugin
    assert set(host.analysis._states) == {100}
    host.processes.clear()
    host.view.schedulers.clear()
    assert host.tick() == ((), ())
    assert host.analysis._states == {}


# ---- blocks held after finish ----


def test_done_requests_holding_blocks_past_the_limit_are_named():
    host = Host({100: process(100, "VLLM::EngineCore")})
    requests = (KvRequest("leak-1", RequestState.ABORTED, 7, 31.0), KvRequest("leak-2", RequestState.FINISHED, 5, 45.0),
                KvRequest("abort-1", RequestState.ABORTED, 3, 2.0),  # a normal abort in its last step
                KvRequest("gone", RequestState.FINISHED, 0, 100.0),
                KvRequest("run-1", RequestState.RUNNING, 10))
    host.view.schedulers[100] = report(100, 0, free=975, running=1, requests=requests)
    engine, findings = host.engine()
    (finding,) = findings
    assert finding.kind is FindingKind.BLOCKS_HELD_AFTER_FINISH and finding.value == 12.0
    assert finding.requests == requests[:2]
    assert finding.since_ns == (T0 - 15) * NS  # leak-2 passed 30 s fifteen seconds before the report
    assert "leak-1 (7), leak-2 (5)" in finding.message and "kvtrace vllm --pid 100" in finding.message
    assert engine.blocks_held_after_finish == 12 and engine.holders == requests


def test_a_normal_abort_is_not_a_finding():
    host = Host({100: process(100, "VLLM::EngineCore")})
    host.view.schedulers[100] = report(100, 0, requests=(KvRequest("abort-1", RequestState.ABORTED, 3, 29.9),))
    engine, findings = host.engine()
    assert findings == [] and engine.blocks_held_after_finish == 0


# ---- usage stuck with nothing to do ----


def test_usage_above_zero_with_nothing_running_for_a_minute():
    host = Host({100: process(100, "VLLM::EngineCore")})
    for second in range(61):
        host.view.schedulers[100] = report(100, second, free=990)
        engine, findings = host.engine()
        assert (FindingKind.STUCK_KV_USAGE in kinds(findings)) == (second >= 60), second
    (finding,) = findings
    assert finding.value == 1.0 - 990 / 1000 and finding.since_ns == T0 * NS
    assert "for 60 s" in finding.message
    host.view.schedulers[100] = report(100, 61, free=990, waiting=1)  # something to do: not stuck
    assert host.engine()[1] == []


def test_idle_with_usage_zero_is_healthy_and_metrics_decide_without_the_plugin():
    host = Host({50: process(50, "VLLM::APIServer_0"), 100: process(100, "VLLM::EngineCore", parent=50)})
    for second in range(70):
        host.view.schedulers[100] = report(100, second, free=1000)
        assert host.engine()[1] == []
    del host.view.schedulers[100]
    for second in range(70, 131):
        sample = VllmMetricsSample("u", 50, (T0 + second) * NS, (metrics(usage=0.3),))
        host.view.metrics["u"] = sample
        _, findings = host.engine()
    assert kinds(findings) == [FindingKind.STUCK_KV_USAGE] and findings[0].since_ns == (T0 + 70) * NS


# ---- free blocks ----


def test_idle_free_blocks_below_95_percent_of_the_first_idle_figure():
    host = Host({100: process(100, "VLLM::EngineCore")})
    host.view.schedulers[100] = report(100, 0, free=1000)
    assert host.engine()[0].free_blocks_ratio == 1.0
    host.view.schedulers[100] = report(100, 1, free=500, running=4)  # busy: not an idle figure
    engine, findings = host.engine()
    assert engine.free_blocks_ratio == 1.0 and findings == []
    host.view.schedulers[100] = report(100, 2, free=950)
    engine, findings = host.engine()
    assert engine.free_blocks_ratio == 0.95 and FindingKind.FREE_BLOCKS_FALLING not in kinds(findings)
    host.view.schedulers[100] = report(100, 3, free=940)
    engine, findings = host.engine()
    (finding,) = [finding for finding in findings if finding.kind is FindingKind.FREE_BLOCKS_FALLING]
    assert finding.value == 0.94 and finding.threshold == 0.95 and finding.since_ns == (T0 + 3) * NS
    assert "940 of 1000" in finding.message


# ---- frees per allocation ----


def _counters(host: Host, allocated_per_second: int, freed_per_second: int, seconds: int = 61):
    for second in range(seconds):
        host.view.schedulers[100] = report(100, second, free=1000, running=1,
                                           allocated=second * allocated_per_second, freed=second * freed_per_second)
        engine, findings = host.engine()
    return engine, findings


def test_low_frees_per_allocation_over_a_minute():
    engine, findings = _counters(Host({100: process(100, "VLLM::EngineCore")}), 20, 13)
    assert engine.block_allocations_per_second == 20.0 and engine.block_frees_per_second == 13.0
    assert engine.frees_per_allocation_1m == 0.65
    (finding,) = findings
    assert (finding.kind, finding.value, finding.threshold) == (FindingKind.LOW_FREE_RATIO, 0.65, 0.7)
    assert "780 KV block frees for 1200 allocations" in finding.message


def test_healthy_ratio_and_too_few_allocations_are_silent():
    engine, findings = _counters(Host({100: process(100, "VLLM::EngineCore")}), 20, 19)
    assert engine.frees_per_allocation_1m == 0.95 and findings == []
    engine, findings = _counters(Host({100: process(100, "VLLM::EngineCore")}), 1, 0)  # 60 allocations
    assert engine.frees_per_allocation_1m == 0.0 and findings == []


def test_a_burst_of_requests_not_yet_finished_is_no_low_ratio():
    """1 032 blocks allocated in 3 s by requests still running, none freed yet: what a healthy engine's burst
    looks like to an agent that started beside it (on the H100 this raised a healthy engine, §K)."""
    host = Host({100: process(100, "VLLM::EngineCore")})
    for second in range(5):
        held = min(second, 3) * 344
        running = tuple(KvRequest(f"r{index}", RequestState.RUNNING, held // 4) for index in range(4))
        host.view.schedulers[100] = report(100, second, free=4000 - held, total=4000, running=4,
                                           allocated=held, freed=0, requests=running)
        engine, findings = host.engine()
    assert engine.frees_per_allocation_1m == 0.0  # the gauge: the raw ratio
    assert FindingKind.LOW_FREE_RATIO not in kinds(findings)


def test_finished_requests_keeping_their_blocks_are_a_low_ratio():
    """The same allocations, but the requests finished and kept them: owed frees that never came."""
    host = Host({100: process(100, "VLLM::EngineCore")})
    for second in range(5):
        held = min(second, 3) * 344
        done = tuple(KvRequest(f"r{index}", RequestState.FINISHED, held // 4, 1.0) for index in range(4))
        host.view.schedulers[100] = report(100, second, free=4000 - held, total=4000, running=0,
                                           allocated=held, freed=0, requests=done)
        engine, findings = host.engine()
    (finding,) = [finding for finding in findings if finding.kind is FindingKind.LOW_FREE_RATIO]
    assert finding.value == 0.0 and "0 KV block frees for 1032 allocations over the last minute (" in finding.message


def test_a_report_cut_among_finished_holders_nets_nothing_out():
    """Finished requests alone fill the report (more left out): the blocks in use are not taken for live requests'."""
    host = Host({100: process(100, "VLLM::EngineCore")})
    host.view.schedulers[100] = report(100, 0, free=4000, total=4000)
    host.engine()
    shown = tuple(KvRequest(f"done{index}", RequestState.FINISHED, 10, 9.0) for index in range(3))
    host.view.schedulers[100] = dataclasses.replace(
        report(100, 10, free=3000, total=4000, allocated=1000, freed=0, requests=shown), requests_omitted=97)
    _, findings = host.engine()
    (finding,) = [finding for finding in findings if finding.kind is FindingKind.LOW_FREE_RATIO]
    assert finding.value == 0.0 and "held by running requests" not in finding.message


def test_a_burst_over_a_leak_still_owes_the_leaks_frees():
    """Running requests hold 600 new blocks, and 400 more were allocated whose requests finished without freeing
    them: 400 frees owed, 100 came."""
    host = Host({100: process(100, "VLLM::EngineCore")})
    host.view.schedulers[100] = report(100, 0, free=4000, total=4000)
    host.engine()
    running = (KvRequest("live", RequestState.RUNNING, 600), KvRequest("kept", RequestState.FINISHED, 300, 9.0))
    host.view.schedulers[100] = report(100, 10, free=4000 - 900, total=4000, running=1, allocated=1000, freed=100,
                                       requests=running)
    _, findings = host.engine()
    (finding,) = [finding for finding in findings if finding.kind is FindingKind.LOW_FREE_RATIO]
    assert finding.value == 0.25 and "600 more held by running requests" in finding.message


# ---- growth with no request ----


def _grow(host: Host, running: int = 0, seconds: int = 60, flat_seconds: int = 30, rate: int = 160 * MiB):
    """Flat for `flat_seconds`, then `rate` bytes a second; returns the second of the first finding."""
    for second in range(seconds):
        host.view.schedulers[100] = report(100, second, running=running)
        host.traced[(100, 0)] = 10 * GiB + max(0, second - flat_seconds) * rate
        engine, findings = host.engine()
        if FindingKind.IDLE_GROWTH in kinds(findings):
            return second, engine, findings
    return None, engine, findings


def test_growth_with_no_request_is_reported_within_30_s_at_its_rate():
    host = Host({100: process(100, "VLLM::EngineCore")})
    second, engine, findings = _grow(host)
    assert second == 40  # ten seconds after the loop started at second 30
    (finding,) = findings
    assert finding.value == 160 * MiB and finding.threshold == 5e6 and finding.since_ns == (T0 + 30) * NS
    assert "+1.6 GiB in 10 s (167.8 MB/s, limit 5 MB/s)" in finding.message
    assert 0 < engine.idle_growth_bytes_per_second < 160 * MiB  # the 1 min gauge, diluted by the flat part
    assert not engine.warming_up


def test_growth_just_under_the_limit_is_silent():
    second, engine, _ = _grow(Host({100: process(100, "VLLM::EngineCore")}), rate=4_999_999)
    assert second is None and engine.idle_growth_bytes_per_second > 0


def test_growth_during_the_cold_start_or_with_requests_or_without_figures_is_silent():
    cold = Host({100: process(100, "VLLM::EngineCore", started=T0 - 60)})
    second, engine, _ = _grow(cold)
    assert second is None and engine.warming_up and engine.idle_growth_bytes_per_second == 0.0
    second, engine, _ = _grow(Host({100: process(100, "VLLM::EngineCore")}), running=2)
    assert second is None and engine.idle_growth_bytes_per_second == 0.0
    host = Host({100: process(100, "VLLM::EngineCore")})
    for second in range(60):  # neither the plugin nor /metrics: nobody says whether requests run
        host.traced[(100, 0)] = 10 * GiB + second * 160 * MiB
        engine, findings = host.engine()
        assert findings == []


def test_cold_start_ends_after_its_seconds():
    host = Host({100: process(100, "VLLM::EngineCore", started=T0 - 100)}, options={"cold_start_seconds": 120})
    host.view.schedulers[100] = report(100, 0)
    assert host.engine()[0].warming_up
    host.second = 20
    assert not host.engine()[0].warming_up


# ---- sleep ----


def _cycle(host: Host, second: int, residue_bytes: int, level: int = 1):
    """Awake at `second`, asleep (level) at +1 holding `residue_bytes`, awake again at +2."""
    host.traced[(100, 0)] = 30 * GiB
    host.tick(second)
    pools = (SleepPool("weights", 2 * GiB, 0), SleepPool("kv_cache", 27 * GiB, 0), SleepPool("custom", GiB, GiB))
    host.view.sleeps[100] = (SleepReport(100, (T0 + second + 1) * NS, level, pools),)
    host.traced[(100, 0)] = residue_bytes
    host.roles[(100, 0)] = {Role.CUDA_GRAPH: residue_bytes - GiB, Role.OTHER: GiB}
    asleep = host.engine()
    host.view.sleeps[100] += (SleepReport(100, (T0 + second + 2) * NS, 0, ()),)
    host.traced[(100, 0)] = 30 * GiB
    awake, _ = host.engine()
    assert awake.sleep_level == 0 and awake.sleep_residual_bytes is None and awake.sleep_held_by_tag == {}
    return asleep


def test_sleep_residue_by_role_and_tag_and_its_growth_from_one_cycle_to_the_next():
    host = Host({100: process(100, "VLLM::EngineCore")})
    engine, findings = _cycle(host, 0, 2 * GiB)
    assert (engine.sleep_level, engine.sleep_residual_bytes, engine.previous_sleep_residual_bytes) == (1, 2 * GiB, None)
    assert engine.sleep_held_by_tag == {"weights": 0, "kv_cache": 0, "custom": GiB}
    assert engine.role_bytes == {Role.CUDA_GRAPH: GiB, Role.OTHER: GiB} and findings == []
    engine, findings = _cycle(host, 10, 2 * GiB + 100 * MiB, level=2)
    assert (engine.sleep_level, engine.previous_sleep_residual_bytes) == (2, 2 * GiB)
    (finding,) = findings
    assert (finding.kind, finding.value, finding.threshold) == (FindingKind.SLEEP_RESIDUE, 100 * MiB, 64 * MiB)
    assert finding.since_ns == (T0 + 11) * NS
    assert finding.held_by_role == {Role.CUDA_GRAPH: GiB + 100 * MiB, Role.OTHER: GiB}
    assert finding.held_by_tag == {"weights": 0, "kv_cache": 0, "custom": GiB}
    assert "2.1 GiB, +100.0 MiB from the previous sleep's 2.0 GiB" in finding.message


def test_sleep_residue_unchanged_across_cycles_is_silent():
    host = Host({100: process(100, "VLLM::EngineCore")})
    for cycle in range(4):
        engine, findings = _cycle(host, cycle * 10, 2 * GiB + 64 * MiB * (cycle % 2))  # +64 MiB is the limit
        assert findings == [] and engine.sleep_residual_bytes == 2 * GiB + 64 * MiB * (cycle % 2)


def test_sleep_level_from_metrics_without_the_plugin():
    host = Host({50: process(50, "VLLM::APIServer_0"), 100: process(100, "VLLM::EngineCore", parent=50)},
                traced={(100, 0): GiB})
    host.view.metrics["u"] = VllmMetricsSample("u", 50, T0 * NS, (metrics(sleep=2),))
    engine, _ = host.engine()
    assert engine.sleep_level == 2 and engine.sleep_residual_bytes == GiB


# ---- through the analyzer ----


def test_the_analyzer_publishes_engines_and_findings():
    known = {100: ProcessInfo(100, "VLLM::EngineCore", "VLLM::EngineCor", "", "", float(LONG_AGO), 0.0, 50)}
    session = Session(ProcessTable(known.get))
    session.processes.get(100)  # the agent reads a process when it first sees it
    analyzer = Analyzer(session, AnalysisOptions(vllm=VllmOptions(held_after_finish_seconds=5)))
    session.ingest(event(pid=100, size=GiB))  # the engine holds traced memory: its reports count (vllm_tie)
    session.ingest(SchedulerReport(100, T0 * NS, 1000, 990, 0, 0, 10, 0,
                                   (KvRequest("r1", RequestState.ABORTED, 10, 6.0),)))
    snapshot = analyzer.update(ledger_view(session.ledger, T0 * NS, 0, with_entries=False))
    (engine,) = snapshot.vllm_engines
    assert engine.engine_pid == 100 and engine.blocks_held_after_finish == 10
    assert kinds(snapshot.vllm_findings) == [FindingKind.BLOCKS_HELD_AFTER_FINISH]


def test_memory_mapped_back_at_wake_is_no_growth_and_a_quick_wake_and_sleep_is_a_new_cycle():
    """Seen on the H200: waking maps the pools back (+27.5 GiB with no request) and was taken for idle
    growth; a wake and the next sleep inside one tick left the second sleep without its predecessor."""
    host = Host({100: process(100, "VLLM::EngineCore")})
    pools = (SleepPool("weights", GiB, 0), SleepPool("kv_cache", 27 * GiB, 0))
    for second in range(20):  # idle and flat, asleep from second 5
        host.view.schedulers[100] = report(100, second)
        if second == 5:
            host.view.sleeps[100] = (SleepReport(100, (T0 + 5) * NS, 1, pools),)
        host.traced[(100, 0)] = 2 * GiB if second >= 5 else 30 * GiB
        engine, findings = host.engine()
    assert engine.sleep_residual_bytes == 2 * GiB and engine.previous_sleep_residual_bytes is None
    # woke and slept again between two ticks: a second cycle, its predecessor the first
    host.view.sleeps[100] += (SleepReport(100, (T0 + 20) * NS, 0, ()),
                              SleepReport(100, int((T0 + 20.5) * NS), 2, pools))
    host.traced[(100, 0)] = 2 * GiB + 100 * MiB
    engine, findings = host.engine()
    assert (engine.sleep_level, engine.previous_sleep_residual_bytes) == (2, 2 * GiB)
    assert kinds(findings) == [FindingKind.SLEEP_RESIDUE]  # 100 MiB more than the last sleep's residue
    # awake: the pools come back at once, with no request running: not growth
    host.view.sleeps[100] += (SleepReport(100, (T0 + 22) * NS, 0, ()),)
    for second in range(22, 40):
        host.view.schedulers[100] = report(100, second)
        host.traced[(100, 0)] = 30 * GiB
        engine, findings = host.engine()
        assert FindingKind.IDLE_GROWTH not in kinds(findings), (second, findings)


def test_a_scheduler_report_that_stopped_coming_is_not_taken_for_now():
    """The plugin's scheduler part may switch itself off after an error: its last report (holders,
    usage) must not stand for the engine's state for ever."""
    host = Host({100: process(100, "VLLM::EngineCore")})
    held = (KvRequest("r-1", RequestState.ABORTED, 4, 100.0),)
    host.view.schedulers[100] = report(100, 0, free=990, requests=held)
    engine, findings = host.engine()
    assert engine.blocks_free == 990 and kinds(findings) == [FindingKind.BLOCKS_HELD_AFTER_FINISH]
    host.tick(11)  # no report for 11 s
    engine, findings = host.engine()
    assert engine.blocks_free is None and engine.kv_cache_usage_ratio is None and findings == []


def test_vllm_titles_with_another_prefix_are_vllms():
    """VLLM_PROCESS_NAME_PREFIX changes the part before `::`; discovery and engine grouping follow one rule."""
    from kvtrace.model.vllm import API_SERVER, ENGINE, WORKER, data_parallel_rank, vllm_part

    assert [vllm_part(title) for title in ("VLLM::EngineCore", "ACME::EngineCore_DP1", "VLLM::Worker_TP0",
                                           "VLLM::APIServer_0", "python3 serve.py", "VLLM:EngineCore")] == [
        ENGINE, ENGINE, WORKER, API_SERVER, None, None]
    assert [data_parallel_rank(title) for title in ("ACME::EngineCore_DP1", "VLLM::EngineCore")] == ["1", None]
    host = Host({100: process(100, "ACME::EngineCore_DP1", parent=90),
                 200: process(200, "ACME::Worker_TP0", parent=100), 90: process(90, "ACME::APIServer_0")})
    (engine,), _ = host.tick()
    assert (engine.engine_pid, engine.worker_pids, engine.api_server_pid) == (100, (100, 200), 90)
