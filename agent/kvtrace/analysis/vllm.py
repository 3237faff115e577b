"""vLLM engines and their detectors: which processes make up an engine, what its KV cache and
requests look like (the plugin's reports, else the API server's /metrics), and the findings.

    Session.vllm_view() + known_processes() + traced bytes + role bytes
        ──VllmAnalysis.update (every analysis tick)──▶ (VllmEngine, ...), (VllmFinding, ...)

Engines are found by title and parentage (model/processes.py): `VLLM::EngineCore[_DP<n>]` (or any
process tied to vLLM that sends SchedulerReports, the scheduler's owner) is an engine; the `VLLM::Worker*` processes
whose parent chain reaches it are its workers (with one GPU the model runs in EngineCore itself). Its
API server is its parent, when that parent is scraped for /metrics or titled `VLLM::APIServer*`.

Trust what the kernel says, not the sender: the plugin's reports are claims any local process can make. They
count as an engine's only from a sender the kernel ties to vLLM (model/vllm.py's vllm_tie: its title, its
traced GPU memory, its parent chain); the others are kept apart as UntrustedSenders (`untrusted` after each
update), never an engine, never a finding (issue 31: a process with no GPU memory once raised the critical
blocks_held_after_finish about "1.0 TiB" of KV tensors).

The detectors (defaults are the issue's seeds; each finding says the figures and the next step):
- BLOCKS_HELD_AFTER_FINISH: requests finished or aborted more than N s ago still holding blocks (the
  abort-path leak). vLLM frees a request's blocks in the same step it finishes it, so any is a leak.
- STUCK_KV_USAGE: usage above zero while nothing runs or waits, for a minute. With prefix caching the
  pool counts cached-but-unreferenced blocks as free (block_pool.py `free_blocks` puts them back in the
  free queue; `get_usage` is 1 - free / (num_gpu_blocks - 1)), so an idle engine's usage is exactly 0.
- FREE_BLOCKS_FALLING: free blocks at idle moments against the first idle report (healthy: equal).
- LOW_FREE_RATIO: block frees per allocation over the last minute (healthy ~0.95, leak < 0.7), the
  allocations of the blocks that requests still running hold netted out: a burst of requests is all
  allocations for the seconds before its first request finishes, and says nothing of a leak (it raised a
  healthy engine's depth on the H100, bench/RESULTS.md §K). Blocks in use are the pool's (total - free);
  of those, the ones finished requests hold are the leak's, the rest the live requests'.
- IDLE_GROWTH: the engine's traced bytes growing while no request runs, outside the cold start (model
  load, profiling, KV cache and graph capture all grow memory with no request).
- SLEEP_RESIDUE: the bytes still held while asleep, by role and by CuMemAllocator tag; a finding when
  they grew from one sleep to the next (memory left behind by sleep/wake cycles).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from kvtrace.analysis.growth import NS_PER_SECOND, SHORT_WINDOW_SECONDS, SlidingFit, WindowIncrease
from kvtrace.analysis.roles import kv_ranges_of
from kvtrace.human import human_bytes, printable, signed_bytes
from kvtrace.model.processes import ProcessInfo
from kvtrace.model.vllm import (
    API_SERVER,
    ENGINE,
    WORKER,
    EngineMetrics,
    FindingKind,
    KvRequest,
    Role,
    SchedulerReport,
    UntrustedSender,
    VllmEngine,
    VllmFinding,
    VllmMetricsSample,
    VllmView,
    data_parallel_rank,
    gpu_holders,
    vllm_part,
    vllm_tie,
)

MiB = 1 << 20
MAX_PARENT_DEPTH = 8  # a worker's parent chain is walked this far looking for its engine
REQUEST_IDS_IN_MESSAGE = 3
# The plugin reports once a second; a scheduler report older than this is no longer the engine's state.
SCHEDULER_STALE_SECONDS = 10.0


@dataclass(frozen=True)
class VllmOptions:
    """The detectors' thresholds (AnalysisOptions.vllm); defaults are the issue's seeds."""

    held_after_finish_seconds: float = 30.0
    stuck_usage_seconds: float = 60.0
    free_blocks_falling_ratio: float = 0.95  # idle free blocks below this share of the first idle figure
    low_free_ratio: float = 0.7  # block frees per allocation over 1 min below this
    low_free_ratio_min_allocations: int = 100  # ... with at least this many blocks allocated in the minute
    idle_growth_bytes_per_second: float = 5e6
    idle_growth_seconds: float = 10.0  # the growth is measured over at least this long
    cold_start_seconds: float = 120.0  # after the engine started: growth findings stay silent
    sleep_residue_growth_bytes: int = 64 * MiB  # residue grown more than this since the last sleep


@dataclass
class _EngineState:
    """What one engine's detectors remember between ticks."""

    scheduler_timestamp_ns: int = 0  # the last SchedulerReport taken into the rates
    allocated: SlidingFit = field(default_factory=lambda: SlidingFit(SHORT_WINDOW_SECONDS))
    freed: SlidingFit = field(default_factory=lambda: SlidingFit(SHORT_WINDOW_SECONDS))
    # (allocated, freed, live requests' blocks) over 1 min: the counters' increases, and how many more blocks the
    # live requests hold than a minute ago
    counts: WindowIncrease = field(default_factory=WindowIncrease)
    last_counters: tuple[int, int] = (0, 0)
    stuck_since_ns: int | None = None
    idle_free_start: int | None = None  # free blocks at the first idle report
    free_blocks_ratio: float | None = None
    falling_since_ns: int | None = None
    low_ratio_since_ns: int | None = None
    # Idle samples (monotonic ns, wall ns, traced bytes) over the last minute; cleared by a request.
    idle: deque[tuple[int, int, int]] = field(default_factory=deque)
    # The last sleep/wake seen (latest report's time, level): memory that sleep() releases and wake_up()
    # maps back is not growth, so a change restarts the idle window.
    sleep_mark: tuple[int, int] = (0, 0)
    # The time of the report that started the current sleep (0: known from /metrics only); None while awake.
    asleep_report_ns: int | None = None
    asleep_since_ns: int = 0
    residue_bytes: int | None = None  # of the current (or, awake, the last) sleep
    previous_residue_bytes: int | None = None  # of the sleep before


@dataclass
class _Figures:
    """An engine's current figures: the plugin's where it reports, else the API server's /metrics."""

    usage: float | None = None
    running: int | None = None
    waiting: int | None = None
    timestamp_ns: int = 0  # when those figures were taken


def _is(info: ProcessInfo | None, part: str) -> bool:
    """The process is that part of vLLM by its title (model/vllm.py's vllm_part)."""
    return info is not None and vllm_part(info.title) == part


class VllmAnalysis:
    """Engines and detectors, with the state they keep across ticks (Analyzer.update calls `update`)."""

    def __init__(self, options: VllmOptions | None = None) -> None:
        self.options = options if options is not None else VllmOptions()
        self._states: dict[int, _EngineState] = {}  # engine pid -> state
        self.untrusted: tuple[UntrustedSender, ...] = ()  # as of the last update: senders kept apart

    def update(self, view: VllmView, processes: Mapping[int, ProcessInfo], traced: Mapping[tuple[int, int], int],
               role_bytes: Mapping[tuple[int, int], Mapping[Role, int]], now_wall_ns: int, now_monotonic_ns: int,
               gpu_pids: Collection[int] | None = None) -> tuple[tuple[VllmEngine, ...], tuple[VllmFinding, ...]]:
        """Engines and findings now. `traced`: (pid, device) -> traced physical bytes this tick;
        `role_bytes`: (pid, device) -> bytes by role at the last site sample; `gpu_pids`: processes NVML lists
        on a GPU, None where NVML is down (then traced bytes tie a sender: model/vllm.py's gpu_holders). The
        plugin's records of senders not tied to vLLM are left out, and kept in `untrusted`."""
        view = self._trusted(view, processes, traced, gpu_pids)
        members = _engines_and_workers(view, processes)
        for pid in [pid for pid in self._states if pid not in members]:
            del self._states[pid]  # the engine is gone: its state goes too
        servers = _api_servers(view, processes)
        engines_of_server: dict[int, int] = {}
        parents: dict[int, int] = {}
        for pid in members:
            info = processes.get(pid)
            parent = info.parent_pid if info is not None else 0
            if parent and (parent in servers or _is(processes.get(parent), API_SERVER)):
                parents[pid] = parent
                engines_of_server[parent] = engines_of_server.get(parent, 0) + 1
        traced_by_pid: dict[int, int] = {}
        for (pid, _), size_bytes in traced.items():
            traced_by_pid[pid] = traced_by_pid.get(pid, 0) + size_bytes
        engines: list[VllmEngine] = []
        findings: list[VllmFinding] = []
        for pid, workers in sorted(members.items()):
            api_server = parents.get(pid, 0)
            sample = servers.get(api_server) if api_server else None
            metrics = _metrics_of(processes.get(pid), sample, engines_of_server.get(api_server, 0))
            engine, engine_findings = self._engine(
                pid, workers, view, processes, traced_by_pid, role_bytes, api_server, sample, metrics,
                now_wall_ns, now_monotonic_ns)
            engines.append(engine)
            findings.extend(engine_findings)
        return tuple(engines), tuple(findings)

    def _trusted(self, view: VllmView, processes: Mapping[int, ProcessInfo],
                 traced: Mapping[tuple[int, int], int], gpu_pids: Collection[int] | None) -> VllmView:
        """The view of senders tied to vLLM; the others go to `untrusted`."""
        senders = view.senders()
        if not senders:
            self.untrusted = ()
            return view
        traced_pids = gpu_holders(traced, gpu_pids)
        untrusted = []
        for pid in sorted(senders):
            reason = vllm_tie(pid, processes, traced_pids)
            if reason:
                info = processes.get(pid)
                layout = view.layouts.get(pid)
                claimed = sum(end - start for start, end in kv_ranges_of(
                    (tensor.address, tensor.size_bytes) for tensor in layout.tensors)) if layout is not None else 0
                untrusted.append(UntrustedSender(pid, info.title if info is not None else "", reason, claimed,
                                                 pid in view.schedulers))
        self.untrusted = tuple(untrusted)
        return view.without({sender.pid for sender in untrusted})

    def _engine(self, pid: int, workers: tuple[int, ...], view: VllmView, processes: Mapping[int, ProcessInfo],
                traced_by_pid: Mapping[int, int], role_bytes: Mapping[tuple[int, int], Mapping[Role, int]],
                api_server: int, sample: VllmMetricsSample | None, metrics: EngineMetrics | None,
                now_wall_ns: int, now_monotonic_ns: int) -> tuple[VllmEngine, list[VllmFinding]]:
        options = self.options
        state = self._states.setdefault(pid, _EngineState())
        info = processes.get(pid)
        scheduler = view.schedulers.get(pid)
        if scheduler is not None and now_wall_ns - scheduler.timestamp_ns > SCHEDULER_STALE_SECONDS * NS_PER_SECOND:
            scheduler = None  # the plugin stopped reporting (its part switched off): its figures are not now's
        figures = _figures(scheduler, metrics, sample)
        worker_set = set(workers)
        traced_bytes = sum(traced_by_pid.get(worker, 0) for worker in workers)
        roles: dict[Role, int] = {}
        for (worker, _), by_role in role_bytes.items():
            if worker in worker_set:
                for role, size_bytes in by_role.items():
                    roles[role] = roles.get(role, 0) + size_bytes
        layouts = [view.layouts[worker] for worker in workers if worker in view.layouts]
        sleeps = [view.sleeps[worker][-1] for worker in workers if view.sleeps.get(worker)]
        findings: list[VllmFinding] = []

        # ---- blocks and requests (the plugin) ----
        held: tuple[KvRequest, ...] = ()
        if scheduler is not None:
            self._take_counters(state, scheduler)
            held = tuple(request for request in scheduler.requests if request.state.done and request.blocks
                         and (request.done_age_seconds or 0.0) > options.held_after_finish_seconds)
            if held:
                findings.append(self._held_finding(pid, scheduler, held))
            if scheduler.running == 0 and scheduler.waiting == 0:
                self._idle_free_blocks(state, scheduler)
        allocations, frees, live_gained = state.counts.increase() if state.scheduler_timestamp_ns else (0, 0, 0)
        frees_per_allocation = frees / allocations if allocations else None
        # The frees owed: allocations less what the live requests hold more than a minute ago.
        owed = allocations - max(live_gained, 0)
        owed_ratio = frees / owed if owed > 0 else None
        if owed_ratio is not None and owed >= options.low_free_ratio_min_allocations \
                and owed_ratio < options.low_free_ratio:
            if state.low_ratio_since_ns is None:
                state.low_ratio_since_ns = now_wall_ns
            live = f", {live_gained} more held by running requests" if live_gained > 0 else ""
            findings.append(VllmFinding(
                FindingKind.LOW_FREE_RATIO, pid,
                f"{frees} KV block frees for {allocations} allocations over the last minute{live} "
                f"({owed_ratio:.2f} per allocation owed a free, below {options.low_free_ratio:g}; healthy ~0.95): "
                f"requests keep their blocks; see `kvtrace vllm --pid {pid}` for the holders",
                owed_ratio, options.low_free_ratio, state.low_ratio_since_ns))
        else:
            state.low_ratio_since_ns = None
        if state.free_blocks_ratio is not None and state.free_blocks_ratio < options.free_blocks_falling_ratio:
            if state.falling_since_ns is None:
                state.falling_since_ns = now_wall_ns
            findings.append(VllmFinding(
                FindingKind.FREE_BLOCKS_FALLING, pid,
                f"free KV blocks with no request fell to {state.free_blocks_ratio:.1%} of the first idle figure "
                f"({scheduler.blocks_free if scheduler else '?'} of {state.idle_free_start}; below "
                f"{options.free_blocks_falling_ratio:.0%}): blocks leak across requests; "
                f"see `kvtrace vllm --pid {pid}` for the holders",
                state.free_blocks_ratio, options.free_blocks_falling_ratio, state.falling_since_ns))
        else:
            state.falling_since_ns = None

        # ---- usage stuck with nothing to do ----
        stuck = figures.usage is not None and figures.usage > 0 and figures.running == 0 and figures.waiting == 0
        if stuck:
            if state.stuck_since_ns is None:
                state.stuck_since_ns = figures.timestamp_ns
            stuck_seconds = (figures.timestamp_ns - state.stuck_since_ns) / NS_PER_SECOND
            if stuck_seconds >= options.stuck_usage_seconds:
                findings.append(VllmFinding(
                    FindingKind.STUCK_KV_USAGE, pid,
                    f"KV cache usage {_usage_text(figures.usage, scheduler)} with no request running or waiting for "
                    f"{stuck_seconds:.0f} s (limit {options.stuck_usage_seconds:g} s): blocks never went back to "
                    f"the pool; see `kvtrace vllm --pid {pid}` for the requests holding them",
                    figures.usage or 0.0, 0.0, state.stuck_since_ns))
        else:
            state.stuck_since_ns = None

        # ---- growth with no request running ----
        warming_up = info is not None and info.start_time > 0 and \
            now_wall_ns - int(info.start_time * NS_PER_SECOND) < options.cold_start_seconds * NS_PER_SECOND
        idle_growth_bytes_per_second = 0.0
        sleep_level = _sleep_level(sleeps, metrics)
        sleep_mark = (max((report.timestamp_ns for report in sleeps), default=0), sleep_level)
        if sleep_mark != state.sleep_mark:
            state.sleep_mark = sleep_mark
            state.idle.clear()  # slept or woke: the pools went or came back, which is no growth
        if figures.running == 0 and not warming_up:
            state.idle.append((now_monotonic_ns, now_wall_ns, traced_bytes))
            while state.idle[0][0] < now_monotonic_ns - SHORT_WINDOW_SECONDS * NS_PER_SECOND:
                state.idle.popleft()
            idle_growth_bytes_per_second = _slope(state.idle)
            growth = self._idle_growth_finding(pid, state)
            if growth is not None:
                findings.append(growth)
        else:
            state.idle.clear()  # a request ran, the cold start is on, or no source says: not idle

        # ---- sleep ----
        held_by_tag: dict[str, int] = {}
        for report in sleeps:
            if report.level > 0:
                for pool in report.pools:
                    held_by_tag[pool.tag] = held_by_tag.get(pool.tag, 0) + pool.mapped_bytes
        if sleep_level > 0:
            # A new sleep: the last one's residue is the one to compare with. A sleep report of its own
            # says so even when no tick saw the engine awake in between (a quick wake and sleep).
            if state.asleep_report_ns != sleep_mark[0]:
                state.asleep_report_ns = sleep_mark[0]
                state.asleep_since_ns = max((report.timestamp_ns for report in sleeps if report.level > 0),
                                            default=now_wall_ns)
                state.previous_residue_bytes = state.residue_bytes
            state.residue_bytes = traced_bytes
            previous = state.previous_residue_bytes
            if previous is not None and traced_bytes - previous > options.sleep_residue_growth_bytes:
                findings.append(VllmFinding(
                    FindingKind.SLEEP_RESIDUE, pid,
                    f"asleep (level {sleep_level}) the engine still holds {human_bytes(traced_bytes)}, "
                    f"{signed_bytes(traced_bytes - previous)} from the previous sleep's {human_bytes(previous)} "
                    f"(limit +{human_bytes(options.sleep_residue_growth_bytes)}): memory left behind by sleep/wake "
                    f"cycles; see `kvtrace vllm --pid {pid}` for its roles and tags",
                    float(traced_bytes - previous), float(options.sleep_residue_growth_bytes),
                    state.asleep_since_ns, held_by_role=dict(roles), held_by_tag=held_by_tag))
        else:
            state.asleep_report_ns = None

        engine = VllmEngine(
            engine_pid=pid, title=info.title if info is not None else "", worker_pids=workers,
            api_server_pid=api_server, traced_bytes=traced_bytes, role_bytes=roles,
            plugin=scheduler is not None or bool(layouts) or bool(sleeps),
            blocks_total=scheduler.blocks_total if scheduler is not None else None,
            blocks_free=scheduler.blocks_free if scheduler is not None else None,
            kv_cache_usage_ratio=figures.usage,
            metrics_kv_cache_usage_ratio=metrics.kv_cache_usage_ratio if metrics is not None else None,
            requests_running=figures.running, requests_waiting=figures.waiting,
            kv_tensor_bytes=sum(end - start for layout in layouts for start, end in kv_ranges_of(
                (tensor.address, tensor.size_bytes) for tensor in layout.tensors)),
            page_size_bytes=layouts[0].page_size_bytes if layouts else 0,
            block_allocations_per_second=state.allocated.slope_per_second() if scheduler is not None else 0.0,
            block_frees_per_second=state.freed.slope_per_second() if scheduler is not None else 0.0,
            frees_per_allocation_1m=frees_per_allocation, sleep_level=sleep_level, warming_up=warming_up,
            holders=scheduler.requests if scheduler is not None else (),
            metrics_url=sample.url if sample is not None else "",
            metrics_error=sample.error if sample is not None else "",
            blocks_held_after_finish=sum(request.blocks for request in held),
            free_blocks_ratio=state.free_blocks_ratio,
            idle_growth_bytes_per_second=idle_growth_bytes_per_second,
            sleep_residual_bytes=traced_bytes if sleep_level > 0 else None,
            sleep_held_by_tag=held_by_tag if sleep_level > 0 else {},
            previous_sleep_residual_bytes=state.previous_residue_bytes)
        return engine, findings

    @staticmethod
    def _take_counters(state: _EngineState, report: SchedulerReport) -> None:
        """A new report's block counters into the 1 min rates (a restarted plugin starts them over)."""
        if report.timestamp_ns == state.scheduler_timestamp_ns:
            return
        counters = (report.blocks_allocated_total, report.blocks_freed_total)
        if counters[0] < state.last_counters[0] or counters[1] < state.last_counters[1]:
            state.allocated, state.freed = SlidingFit(SHORT_WINDOW_SECONDS), SlidingFit(SHORT_WINDOW_SECONDS)
            state.counts = WindowIncrease()
        state.scheduler_timestamp_ns = report.timestamp_ns
        state.last_counters = counters
        state.allocated.add(report.timestamp_ns, counters[0])
        state.freed.add(report.timestamp_ns, counters[1])
        # Blocks the live (unfinished) requests hold: in use in the pool, less those of finished requests (listed
        # first in `requests`, so all of them are there unless they alone fill the report: then finished holders
        # are left out, and what they hold is not taken for live requests').
        in_use = max(report.blocks_total - report.blocks_free, 0)
        finished = sum(request.blocks for request in report.requests if request.state.done)
        cut_among_finished = report.requests_omitted and all(request.state.done for request in report.requests)
        live = 0 if cut_among_finished else max(in_use - finished, 0)  # (cut: nothing netted out, as before)
        state.counts.add(report.timestamp_ns, (*counters, live))

    @staticmethod
    def _idle_free_blocks(state: _EngineState, report: SchedulerReport) -> None:
        if state.idle_free_start is None:
            state.idle_free_start = report.blocks_free
        if state.idle_free_start > 0:
            state.free_blocks_ratio = report.blocks_free / state.idle_free_start

    def _held_finding(self, pid: int, report: SchedulerReport, held: tuple[KvRequest, ...]) -> VllmFinding:
        threshold = self.options.held_after_finish_seconds
        blocks = sum(request.blocks for request in held)
        oldest = max(request.done_age_seconds or 0.0 for request in held)
        names = ", ".join(f"{printable(request.request_id)} ({request.blocks})"
                          for request in held[:REQUEST_IDS_IN_MESSAGE])
        more = f" and {len(held) - REQUEST_IDS_IN_MESSAGE} more" if len(held) > REQUEST_IDS_IN_MESSAGE else ""
        return VllmFinding(
            FindingKind.BLOCKS_HELD_AFTER_FINISH, pid,
            f"{len(held)} requests finished or aborted more than {threshold:g} s ago still hold {blocks} KV blocks: "
            f"{names}{more}; a finish/abort path never freed them (see `kvtrace vllm --pid {pid}`)",
            float(blocks), 0.0, report.timestamp_ns - int((oldest - threshold) * NS_PER_SECOND),
            requests=held)

    def _idle_growth_finding(self, pid: int, state: _EngineState) -> VllmFinding | None:
        """Growth since the lowest idle point: at least idle_growth_seconds long and faster than the
        threshold. Measured from the low point, a loop that starts after a flat minute reads at its own
        rate once it has run idle_growth_seconds, not diluted by the flat part."""
        samples = state.idle
        low = min(range(len(samples)), key=lambda index: (samples[index][2], -index))  # the last lowest
        rising = [samples[index] for index in range(low, len(samples))]
        span_seconds = (rising[-1][0] - rising[0][0]) / NS_PER_SECOND
        if span_seconds < self.options.idle_growth_seconds:
            return None
        rate = _slope(rising)
        threshold = self.options.idle_growth_bytes_per_second
        if rate <= threshold:
            return None
        grown = rising[-1][2] - rising[0][2]
        return VllmFinding(
            FindingKind.IDLE_GROWTH, pid,
            f"GPU memory of the engine grew {signed_bytes(grown)} in {span_seconds:.0f} s "
            f"({rate / 1e6:.1f} MB/s, limit {threshold / 1e6:g} MB/s) with no request running: "
            f"see `kvtrace leaks --pid {pid}` for the growing allocation site",
            rate, threshold, rising[0][1])


def _engines_and_workers(view: VllmView, processes: Mapping[int, ProcessInfo]) -> dict[int, tuple[int, ...]]:
    """Engine pid -> its processes (itself first, then its workers in pid order)."""
    engines = {pid for pid, info in processes.items() if _is(info, ENGINE)}
    engines |= set(view.schedulers)  # the scheduler's owner, whatever its title
    members: dict[int, list[int]] = {pid: [pid] for pid in engines}
    for pid, info in sorted(processes.items()):
        if pid in engines or not _is(info, WORKER):
            continue
        parent = info.parent_pid
        for _ in range(MAX_PARENT_DEPTH):
            if not parent or parent in engines:
                break
            above = processes.get(parent)
            parent = above.parent_pid if above is not None else 0
        if parent in engines:
            members[parent].append(pid)
    return {pid: tuple(pids) for pid, pids in members.items()}


def _api_servers(view: VllmView, processes: Mapping[int, ProcessInfo]) -> dict[int, VllmMetricsSample | None]:
    """API server pid -> its latest /metrics scrape (None: titled an API server, not scraped)."""
    servers: dict[int, VllmMetricsSample | None] = {
        pid: None for pid, info in processes.items() if _is(info, API_SERVER)}
    for sample in view.metrics.values():
        if sample.api_server_pid:
            servers[sample.api_server_pid] = sample
    return servers


def _metrics_of(info: ProcessInfo | None, sample: VllmMetricsSample | None,
                engines_of_server: int) -> EngineMetrics | None:
    """The engine's figures in its API server's scrape: by the `engine` label against the title's
    data-parallel rank, else the one engine of a server with one engine."""
    if sample is None or not sample.engines:
        return None
    rank = data_parallel_rank(info.title) if info is not None else None
    if rank is not None:
        for metrics in sample.engines:
            if metrics.engine == rank:
                return metrics
    if engines_of_server == 1 and len(sample.engines) == 1:
        return sample.engines[0]
    return None


def _figures(scheduler: SchedulerReport | None, metrics: EngineMetrics | None,
             sample: VllmMetricsSample | None) -> _Figures:
    if scheduler is not None:
        return _Figures(scheduler.usage_ratio, scheduler.running, scheduler.waiting, scheduler.timestamp_ns)
    if metrics is not None and sample is not None:
        return _Figures(metrics.kv_cache_usage_ratio,
                        round(metrics.requests_running) if metrics.requests_running is not None else None,
                        round(metrics.requests_waiting) if metrics.requests_waiting is not None else None,
                        sample.timestamp_ns)
    return _Figures()


def _usage_text(usage: float | None, scheduler: SchedulerReport | None) -> str:
    """"0.04% (20 of 55344 blocks)": a usage too small for a percentage alone says how many blocks."""
    text = f"{usage or 0.0:.2%}"
    if scheduler is not None:
        text += f" ({scheduler.blocks_total - scheduler.blocks_free} of {scheduler.blocks_total} blocks)"
    return text


def _sleep_level(sleeps: list, metrics: EngineMetrics | None) -> int:
    """The latest sleep/wake report of the engine's processes; else /metrics' engine_sleep_state."""
    if sleeps:
        return max(sleeps, key=lambda report: report.timestamp_ns).level
    if metrics is not None and metrics.sleep_level is not None:
        return metrics.sleep_level
    return 0


def _slope(samples) -> float:
    """Least-squares bytes per second of (monotonic ns, wall ns, bytes) samples (growth.py's fit)."""
    fit = SlidingFit(SHORT_WINDOW_SECONDS * 2)
    for monotonic_ns, _, size_bytes in samples:
        fit.add(monotonic_ns, size_bytes)
    return fit.slope_per_second()
