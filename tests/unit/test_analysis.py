"""Analysis on synthetic timelines: exact growth rates over 1 and 15 min, time-to-OOM, allocation
and free counts, NVML's figures matched to traced devices, and leak suspects ranked."""
import statistics
import time

import pytest

from fake_agent import TITLES, event
from fake_nvml import FakeGpu, FakeNvml, GiB
from kvtrace.analysis.analyzer import AnalysisOptions, Analyzer
from kvtrace.analysis.growth import SlidingFit, WindowIncrease, time_to_oom_seconds
from kvtrace.analysis.leaks import SiteKey, find_suspects, survey_sites
from kvtrace.model.events import Api, Kind, Layer, Memory
from kvtrace.model.ledger import ledger_view
from kvtrace.model.stacks import Frame, Stack
from kvtrace.session import Session
from kvtrace.sources.nvml import NvmlSampler

NS = 1_000_000_000
MiB = 1 << 20
MB = 1_000_000
T0_NS = 1_700_000_000 * NS
UUIDS = [f"GPU-{index:08x}-0000-0000-0000-000000000000" for index in range(4)]


class Timeline:
    """Synthetic seconds: allocations and frees stamped with the current second, then `tick()`
    analyses as the agent loop does once a second."""

    def __init__(self, nvml: FakeNvml | None = None, visible: dict[int, str] | None = None,
                 traced_only: bool = False, **options) -> None:
        self.session = Session()
        self.ledger = self.session.ledger
        self.stacks = self.session.stacks
        self.nvml = nvml
        self.sampler = NvmlSampler(self.session, nvml) if nvml is not None else None
        self.analyzer = Analyzer(self.session, AnalysisOptions(**options),
                                 visible_devices=lambda pid: (visible or {}).get(pid))
        self.traced_only = traced_only
        self.second = 0
        self._next_address = 0x7F0000000000

    @property
    def now_ns(self) -> int:
        return T0_NS + self.second * NS

    def stack(self, function: str) -> int:
        return self.stacks.intern(Stack((Frame(function, "/app/serve.py", 10), Frame("<module>", "/app/serve.py", 1))))

    def alloc(self, size: int, pid: int = 200, device: int = 0, stack_id: int = 0, caller: int = 0,
              runtime_caller: int | None = None) -> int:
        """cuMemAlloc_v2 (and, with runtime_caller, the cudaMalloc above it); returns the address."""
        address = self._next_address
        self._next_address += 1 << 32
        self.ledger.apply(event(pid=pid, address=address, size=size, device=device, ts=self.now_ns,
                                stack_id=stack_id, caller_address=caller))
        if runtime_caller is not None:
            self.ledger.apply(event(pid=pid, api=Api.cudaMalloc, layer=Layer.RUNTIME, address=address, size=size,
                                    device=device, ts=self.now_ns, caller_address=runtime_caller))
        return address

    def free(self, address: int, pid: int = 200) -> None:
        self.ledger.apply(event(kind=Kind.FREE, api=Api.cuMemFree_v2, pid=pid, address=address, size=0,
                                ts=self.now_ns))

    def tick(self):
        if self.sampler is not None:
            self.sampler.sample_once()
        snapshot = self.analyzer.update(ledger_view(self.ledger, self.now_ns, self.second * NS,
                                                    titles=dict(TITLES), traced_only=self.traced_only))
        self.second += 1
        return snapshot


def only_row(snapshot, pid=200):
    rows = [row for row in snapshot.processes if row.pid == pid]
    assert len(rows) == 1, rows
    return rows[0]


# ---- growth ----

def test_linear_growth_is_exact_over_both_windows_and_forecasts_the_oom():
    # GIVEN a process whose traced memory grows exactly 5 MB/s for 15 min, on a GPU with 100 GB free
    nvml = FakeNvml(FakeGpu(UUIDS[0], free_bytes=100_000 * MB, processes=[(200, 9 * GiB)]))
    timeline = Timeline(nvml)
    for _ in range(901):
        timeline.alloc(5 * MB)
        snapshot = timeline.tick()
    # THEN both windows measure exactly 5 MB/s, over the whole 15 min
    row = only_row(snapshot)
    assert row.outstanding_bytes == 901 * 5 * MB
    assert row.growth_bytes_per_second_1m == 5 * MB
    assert row.growth_bytes_per_second_15m == 5 * MB
    assert row.history_seconds == 900
    # AND the GPU's free memory runs out in free / growth
    assert row.time_to_oom_seconds == 100_000 * MB / (5 * MB) == 20_000
    assert row.nvml_index == 0 and snapshot.gpus[0].free_bytes == 100_000 * MB


def test_the_windows_slide_a_past_ramp_leaves_the_short_window_first():
    # GIVEN 10 min of growth at 5 MB/s, then 5 min flat
    timeline = Timeline()
    values = []
    for second in range(901):
        if second <= 600:
            timeline.alloc(5 * MB)
        values.append((second, 5 * MB * min(second + 1, 601)))
        snapshot = timeline.tick()
    row = only_row(snapshot)
    # THEN the last minute is flat, and the 15 min slope is the least-squares fit of all 901 samples
    assert row.growth_bytes_per_second_1m == 0.0
    expected = statistics.linear_regression([t for t, _ in values], [v for _, v in values]).slope
    assert row.growth_bytes_per_second_15m == pytest.approx(expected, rel=1e-12)
    # WHEN 15 more minutes pass flat, THEN the ramp has left the 15 min window too
    for _ in range(900):
        snapshot = timeline.tick()
    assert only_row(snapshot).growth_bytes_per_second_15m == 0.0


def test_a_model_load_is_not_forecast_as_an_oom():
    # GIVEN a process that loaded 70 GiB over its first 10 s, then held it, on a GPU with 60 GiB free
    nvml = FakeNvml(FakeGpu(UUIDS[0], free_bytes=60 * GiB))
    timeline = Timeline(nvml)
    values = []
    for second in range(301):
        if second < 10:
            timeline.alloc(7 * GiB)
        values.append((second, 7 * GiB * min(second + 1, 10)))
        snapshot = timeline.tick()
    row = only_row(snapshot)
    # THEN growth is the least-squares slope, about 1/7 of the endpoints' (first to last sample)
    endpoints = (values[-1][1] - values[0][1]) / 300
    assert row.growth_bytes_per_second_15m == pytest.approx(
        statistics.linear_regression(*zip(*values, strict=True)).slope, rel=1e-12)
    assert row.growth_bytes_per_second_15m < endpoints / 6
    # AND the forecast is over half an hour, where the endpoints' would say under 5 minutes
    assert 60 * GiB / endpoints < 300 and row.time_to_oom_seconds > 1800


@pytest.mark.parametrize("seconds, rate_bytes, with_nvml", [
    (299, 5 * MB, True),  # less than 5 min of history: mostly start-up, no forecast
    (600, 0, True),  # flat: never
    (600, 5 * MB, False),  # no NVML: no free figure
])
def test_no_forecast(seconds, rate_bytes, with_nvml):
    timeline = Timeline(FakeNvml(FakeGpu(UUIDS[0])) if with_nvml else None)
    timeline.alloc(GiB)
    for _ in range(seconds + 1):
        if rate_bytes:
            timeline.alloc(rate_bytes)
        snapshot = timeline.tick()
    assert only_row(snapshot).time_to_oom_seconds is None


def test_sliding_fit_keeps_exactly_the_window():
    # GIVEN samples every 10 s of a line, then of another line
    fit = SlidingFit(60)
    for second in range(0, 300, 10):
        fit.add(second * NS, 7 * second)
    assert fit.slope_per_second() == 7.0 and fit.span_seconds() == 60
    for second in range(300, 370, 10):
        fit.add(second * NS, 2100 - 3 * (second - 300))
    # THEN only the samples of the last 60 s count
    assert fit.slope_per_second() == -3.0


def test_window_increase_over_one_minute():
    window = WindowIncrease(60)
    for second in range(120):
        window.add(second * NS, (10 * second, 9 * second))
    assert window.increase() == (600, 540)  # second 119 minus second 59


def test_forecast_history_is_an_option():
    # GIVEN a 30 s steady leak of 5 MB/s, with the agent told to forecast from 20 s of history
    nvml = FakeNvml(FakeGpu(UUIDS[0], free_bytes=100_000 * MB, processes=[(200, 9 * GiB)]))
    timeline = Timeline(nvml, forecast_min_history_seconds=20)
    forecasts = []
    for _ in range(31):
        timeline.alloc(5 * MB)
        forecasts.append(only_row(timeline.tick()).time_to_oom_seconds)
    # THEN there is no forecast before 20 s of history, and free / growth from then on
    assert forecasts[:20] == [None] * 20
    assert forecasts[20:] == [20_000.0] * 11


def test_site_samples_that_take_long_come_less_often():
    # GIVEN site samples every 10 s, the last of which took 1 s (millions of live allocations)
    timeline = Timeline(site_sample_seconds=10)
    timeline.tick()  # a site sample at second 0: the next is due at second 10
    assert timeline.analyzer._next_site_sample_ns == 10 * NS
    timeline.analyzer.pace_site_samples(NS, now_ns=1 * NS)
    # THEN the next one waits 50 s: sampling takes at most 2 % of a core
    assert timeline.analyzer._next_site_sample_ns == 51 * NS
    # AND a quick sample leaves the configured interval alone
    timeline.analyzer.pace_site_samples(1000, now_ns=1 * NS)
    assert timeline.analyzer._next_site_sample_ns == 51 * NS


def test_time_to_oom_rules():
    assert time_to_oom_seconds(GiB, MiB, 300) == 1024.0
    assert time_to_oom_seconds(GiB, -MiB, 900) is None
    assert time_to_oom_seconds(None, MiB, 900) is None
    assert time_to_oom_seconds(GiB, MiB, 10, min_history_seconds=10) == 1024.0
    assert time_to_oom_seconds(GiB, MiB, 9, min_history_seconds=10) is None


# ---- allocations and frees ----

def test_allocation_and_free_counts_over_one_minute():
    # GIVEN 10 cudaMalloc (runtime + driver) and 9 frees (driver) a second for 2 min
    timeline = Timeline()
    for _ in range(121):
        addresses = [timeline.alloc(MiB, runtime_caller=0x99) for _ in range(10)]
        for address in addresses[:9]:
            timeline.free(address)
        snapshot = timeline.tick()
    # THEN the last minute counts 600 allocations (the runtime layer not twice) and 540 frees
    row = only_row(snapshot)
    assert (row.allocations_1m, row.frees_1m, row.free_ratio_1m) == (600, 540, 0.9)


def test_no_allocations_no_ratio():
    timeline = Timeline()
    timeline.alloc(MiB)
    timeline.tick()
    for _ in range(61):
        snapshot = timeline.tick()
    assert only_row(snapshot).free_ratio_1m is None and only_row(snapshot).allocations_1m == 0


# ---- NVML next to the trace ----

def test_unattributed_is_nvml_used_minus_traced():
    # GIVEN pid 200 traced at 1 GiB on GPU 0, where NVML says it uses 3 GiB, and pid 100 whose
    # figure NVML does not give
    nvml = FakeNvml(FakeGpu(UUIDS[0], processes=[(200, 3 * GiB), (100, None)]))
    timeline = Timeline(nvml)
    timeline.alloc(GiB, pid=200)
    timeline.alloc(GiB, pid=100)
    snapshot = timeline.tick()
    # THEN the context and cache make 2 GiB unattributed; without a figure, nothing is claimed
    assert (only_row(snapshot, 200).nvml_used_bytes, only_row(snapshot, 200).unattributed_bytes) == (3 * GiB, 2 * GiB)
    assert (only_row(snapshot, 100).nvml_used_bytes, only_row(snapshot, 100).unattributed_bytes) == (None, None)
    assert snapshot.nvml_timestamp_ns > 0


def test_processes_only_nvml_sees_are_all_unattributed_unless_tracing_chosen_pids():
    nvml = FakeNvml(FakeGpu(UUIDS[0]), FakeGpu(UUIDS[1], processes=[(300, 5 * GiB)]))
    timeline = Timeline(nvml)
    timeline.alloc(GiB, pid=200)
    row = only_row(timeline.tick(), 300)
    assert (row.device, row.nvml_index, row.outstanding_bytes, row.unattributed_bytes) == (-1, 1, 0, 5 * GiB)
    assert row.title == "python train.py"
    timeline.traced_only = True
    assert [row.pid for row in timeline.tick().processes] == [200]


def test_cuda_visible_devices_maps_ordinals_to_nvml_gpus():
    # GIVEN pid 200 started with CUDA_VISIBLE_DEVICES=3,1 and traced on its devices 0 and 1
    nvml = FakeNvml(*(FakeGpu(uuid) for uuid in UUIDS))
    nvml.gpus[3].processes = [(200, 4 * GiB)]
    nvml.gpus[1].processes = [(200, 2 * GiB)]
    timeline = Timeline(nvml, visible={200: "3,1"})
    timeline.alloc(GiB, device=0)
    timeline.alloc(GiB, device=1)
    snapshot = timeline.tick()
    # THEN its device 0 is NVML's GPU 3 and device 1 is GPU 1, each with its own NVML figure
    assert [(row.device, row.nvml_index, row.unattributed_bytes) for row in snapshot.processes] == [
        (0, 3, 3 * GiB), (1, 1, GiB)]


def test_one_device_traced_and_one_gpu_in_nvml_is_that_gpu():
    # GIVEN a container that sees only the host's GPU 2 as its device 0, CUDA_VISIBLE_DEVICES unset
    nvml = FakeNvml(*(FakeGpu(uuid) for uuid in UUIDS))
    nvml.gpus[2].processes = [(200, 3 * GiB)]
    timeline = Timeline(nvml)
    timeline.alloc(GiB, device=0)
    row = only_row(timeline.tick())
    # THEN what NVML sees wins over the identity guess
    assert (row.device, row.nvml_index, row.unattributed_bytes) == (0, 2, 2 * GiB)


def test_a_process_attached_late_is_placed_by_nvml_and_forecast():
    # GIVEN a process the agent attached to after it chose its device (traced on device -1),
    # leaking 5 MB/s, that NVML lists on GPU 1 only
    nvml = FakeNvml(*(FakeGpu(uuid, free_bytes=100_000 * MB) for uuid in UUIDS))
    nvml.gpus[1].processes = [(200, 30 * GiB)]
    timeline = Timeline(nvml, forecast_min_history_seconds=10)
    for _ in range(11):
        timeline.alloc(5 * MB, device=-1)
        snapshot = timeline.tick()
    row = only_row(snapshot)
    # THEN NVML places it on GPU 1: its NVML figure, unattributed bytes and time-to-OOM are there
    assert (row.device, row.nvml_index, row.nvml_used_bytes) == (-1, 1, 30 * GiB)
    assert row.unattributed_bytes == 30 * GiB - 11 * 5 * MB
    assert row.time_to_oom_seconds == 20_000
    # AND with the process on two GPUs in NVML, an unknown device stays unplaced
    nvml.gpus[2].processes = [(200, GiB)]
    rows = [r for r in timeline.tick().processes if r.pid == 200 and r.outstanding_bytes]
    assert [(r.nvml_index, r.time_to_oom_seconds) for r in rows] == [(None, None)]


def test_a_process_that_exits_leaves_the_analysis():
    timeline = Timeline()
    timeline.alloc(GiB, pid=100)
    assert [row.pid for row in timeline.tick().processes] == [100]
    timeline.ledger.drop_process(100, before_ns=timeline.now_ns)
    assert timeline.tick().processes == ()


def test_a_hung_nvml_does_not_block_the_analysis():
    # GIVEN the sampler's thread stuck in an NVML call
    nvml = FakeNvml(FakeGpu(UUIDS[0]))
    session = Session()
    sampler = NvmlSampler(session, nvml, interval_seconds=0.01, call_timeout_seconds=0.2)
    sampler.sample_once()
    nvml.hang()
    sampler.start()
    analyzer = Analyzer(session, visible_devices=lambda pid: None)
    ledger = session.ledger
    ledger.apply(event(size=GiB))
    try:
        deadline = time.monotonic() + 5
        while sampler.status.reason != "nvml call timed out" and not sampler.status.reason.startswith("nvml call"):
            assert time.monotonic() < deadline, sampler.status
            time.sleep(0.01)
        # WHEN the agent loop analyses, THEN it does not wait for NVML, and says it is down
        started = time.monotonic()
        snapshot = analyzer.update(ledger_view(ledger, T0_NS, 0))
        assert time.monotonic() - started < 0.05
        assert [(c.name, c.up, c.reason.split(" (")[0]) for c in session.components()
                if c.name == "nvml"] == [("nvml", False, "nvml call timed out")]
        assert snapshot.gpus == () and only_row(snapshot).outstanding_bytes == GiB
    finally:
        nvml.release()
        sampler.stop()


# ---- leak suspects ----

def test_suspects_rank_the_growing_site_first_and_leave_young_memory_out():
    # GIVEN over 15 min: `leak` keeps 1 MiB a second, `load_weights` took 10 GiB at the start,
    # native code (no Python stack) took 2 MiB at the start, and `step` allocates and frees
    timeline = Timeline(leak_min_age_seconds=60)
    leak, weights, step = timeline.stack("leak"), timeline.stack("load_weights"), timeline.stack("step")
    timeline.alloc(10 * GiB, stack_id=weights)
    timeline.alloc(2 * MiB, caller=0x42)
    for _ in range(901):
        timeline.alloc(MiB, stack_id=leak)
        timeline.free(timeline.alloc(64 * MiB, stack_id=step))
        snapshot = timeline.tick()
    # THEN the leak ranks first though smaller, then the largest; the young memory is no suspect
    suspects = snapshot.suspects
    assert [(s.rank, s.stack.frames[0].function if s.stack else hex(s.native_caller_address))
            for s in suspects] == [(1, "leak"), (2, "load_weights"), (3, "0x42")]
    leak_suspect = suspects[0]
    assert leak_suspect.growth_bytes_per_second == MiB  # sampled every 10 s: still exact
    assert (leak_suspect.count, leak_suspect.outstanding_bytes) == (841, 841 * MiB)  # 60 s and older
    assert leak_suspect.oldest_age_seconds == 900.0
    assert (suspects[1].growth_bytes_per_second, suspects[1].outstanding_bytes) == (0.0, 10 * GiB)
    assert suspects[2].stack_id == 0 and suspects[2].stack is None


def test_a_report_counts_what_it_considered_and_honours_age_and_pids():
    # GIVEN allocations 0, 30, 60 and 90 s old in pid 200 and one 90 s old in pid 100
    timeline = Timeline()
    site = timeline.stack("leak")
    timeline.alloc(MiB, pid=100, stack_id=site)
    for second in (0, 30, 60, 90):
        timeline.second = second
        timeline.alloc(MiB, stack_id=site)
    report = timeline.analyzer.leak_report({200}, 60, wall_ns=timeline.now_ns)
    # THEN "at least 60 s" takes the one exactly 60 s old; the other pid is left out
    assert (report.allocations_considered, report.suspect_allocations, report.suspect_count) == (4, 2, 1)
    assert report.suspects[0].count == 2 and report.suspects[0].oldest_age_seconds == 90.0
    everything = timeline.analyzer.leak_report((), 0, wall_ns=timeline.now_ns)
    assert (everything.allocations_considered, everything.suspect_allocations) == (5, 5)
    assert [s.pid for s in everything.suspects] == [200, 100]  # 4 MiB before 1 MiB
    default = timeline.analyzer.leak_report(wall_ns=timeline.now_ns)
    assert default.min_age_seconds == 60.0


def test_without_a_stack_the_cudamalloc_caller_groups_not_libcudart():
    # GIVEN two cudaMalloc call sites in native code: the driver call's caller is libcudart for both
    timeline = Timeline()
    for _ in range(3):
        timeline.alloc(MiB, caller=0xC0DA, runtime_caller=0xAAA)
    timeline.alloc(MiB, caller=0xC0DA, runtime_caller=0xBBB)
    # THEN the sites are the two callers of cudaMalloc
    assert survey_sites(timeline.ledger, timeline.now_ns, 0).site_bytes == {
        SiteKey(200, 0, 0, 0xAAA): 3 * MiB, SiteKey(200, 0, 0, 0xBBB): MiB}
    report = find_suspects(timeline.ledger, timeline.now_ns, 0, {}, {}, lambda stack_id: None)
    assert [(s.native_caller_address, s.count) for s in report.suspects] == [(0xAAA, 3), (0xBBB, 1)]


def test_suspects_are_per_gpu_and_count_only_device_memory():
    timeline = Timeline()
    site = timeline.stack("leak")
    timeline.alloc(MiB, stack_id=site, device=0)
    timeline.alloc(2 * MiB, stack_id=site, device=1)
    timeline.ledger.apply(event(api=Api.cuMemAllocHost_v2, address=0x5, size=GiB, ts=timeline.now_ns,
                                memory=Memory.HOST))  # pinned host memory: no GPU's
    report = find_suspects(timeline.ledger, timeline.now_ns, 0, {}, {}, lambda stack_id: None)
    assert [(s.device, s.outstanding_bytes) for s in report.suspects] == [(1, 2 * MiB), (0, MiB)]
    assert report.allocations_considered == 2
