"""The analyzer: turns the Session's ledger and NVML samples into an AnalysisSnapshot once per
interval.

The agent loop calls `tick()` after each poll. Once per interval it copies what it needs from the
Session (a `LedgerView`, taken under the Session's lock) and analyses the copy without the lock.
Servers read `latest` from any thread: one immutable snapshot, replaced whole; and ask for leak
reports at any age (`leak_report`).

Per process and GPU it keeps a series of traced physical bytes (driver + VMM layers), one sample a
tick from the ledger's running totals, and fits growth over 1 and 15 min (growth.py). Allocation
sites, leak suspects, roles and fragmentation need a pass over every outstanding entry (seconds with a few
hundred thousand), so they are sampled every `site_sample_seconds` at most, paced to SITE_SAMPLE_MAX_CPU: one
pass (`sample_sites`) computes all four from the same entries, the runtime allocation above each stackless
driver one found in a dict of the pass's own entries. In the agent (`tick`) that pass runs on a thread of its
own (issue 31: one unprivileged user can fill a quarter of the kernel's ledger, and a pass of it in the loop
stalled the loop for seconds); its result is taken by the first tick after it ends, and only one runs at a
time. Data flows one way: the loop hands the pass a view of the ledger (taken under the Session's lock, which
the pass never takes: where the kernel keeps the allocations they are read from it on the way), and the pass
hands back what it computed.

Site samples also give each traced byte its role (roles.py: KV cache, weights, CUDA graphs, ...),
and happen at once when the vLLM plugin reports a new KV-cache layout or a sleep/wake. Every tick,
vllm.py groups vLLM's processes into engines and runs its detectors on the Session's vLLM view.

NVML adds each GPU's free memory (for time-to-OOM) and each process's used memory (for
unattributed = NVML used - traced: the CUDA context, NCCL buffers, memory allocated before the
agent started).
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

from kvtrace.analysis.growth import (
    LONG_WINDOW_SECONDS,
    MIN_FORECAST_HISTORY_SECONDS,
    NS_PER_SECOND,
    Growth,
    SlidingFit,
    WindowIncrease,
    free_ratio,
    time_to_oom_seconds,
)
from kvtrace.analysis.leaks import RuntimeIndex, SiteKey, SiteSurvey, SiteTally, find_suspects, rank_suspects
from kvtrace.analysis.roles import RoleMemo, RoleTally, kv_ranges_of
from kvtrace.analysis.vllm import VllmAnalysis, VllmOptions
from kvtrace.model.blocks import Fragmentation, fragmentation, segments_of
from kvtrace.model.events import PHYSICAL_LAYERS, Layer, Memory, ObjectKind
from kvtrace.model.findings import AnalysisSnapshot, LeakReport, LeakSuspect, ProcessGpu
from kvtrace.model.gpus import NvmlSample, nvml_index_for_cuda_ordinal
from kvtrace.model.ledger import LedgerView, Outstanding, pids_with_blocks
from kvtrace.model.stacks import Stack
from kvtrace.model.vllm import Role, UntrustedSender, VllmView
from kvtrace.session import Session

log = logging.getLogger(__name__)

# Site samples may take at most this share of a core; with millions of live allocations they come
# less often than site_sample_seconds.
SITE_SAMPLE_MAX_CPU = 0.02


@dataclass(frozen=True)
class AnalysisOptions:
    interval_seconds: float = 1.0
    leak_min_age_seconds: float = 60.0  # the snapshot's suspects; ListLeakSuspects may ask for another
    site_sample_seconds: float = 10.0  # sites are many more than processes: sampled less often
    # No time-to-OOM from less history than this: it would be mostly the start-up (model, KV cache).
    forecast_min_history_seconds: float = MIN_FORECAST_HISTORY_SECONDS
    vllm: VllmOptions = field(default_factory=VllmOptions)  # the vLLM detectors' thresholds


# After the vLLM plugin said memory moved (a KV layout, a sleep or wake), roles are sampled at once and
# again this much later, when the probes' events of the move have surely arrived.
ROLES_AGAIN_NS = 2 * 1_000_000_000

# Analysis reports in every interval_seconds; silent this long, its figures are stale.
STALE_AFTER_SECONDS = 60.0


def _no_visible_devices(pid: int) -> str | None:
    return None


class Analyzer:
    def __init__(self, session: Session, options: AnalysisOptions = AnalysisOptions(),
                 visible_devices: Callable[[int], str | None] = _no_visible_devices) -> None:
        """`visible_devices(pid)`: the process's CUDA_VISIBLE_DEVICES as started (the agent reads
        /proc/PID/environ), to match its CUDA ordinals with NVML's GPUs."""
        self.session = session
        self.options = options
        self.latest: AnalysisSnapshot | None = None
        # Bytes per second of each site's outstanding bytes over 15 min; replaced whole, so that
        # ListLeakSuspects reads it from gRPC threads without a lock.
        self.site_growth: dict[SiteKey, float] = {}
        self._visible_devices = visible_devices
        self._environ: dict[int, str | None] = {}  # pid -> CUDA_VISIBLE_DEVICES, read once per pid
        self._growth: dict[tuple[int, int], Growth] = {}  # (pid, CUDA ordinal) -> traced bytes series
        self._counts: dict[int, WindowIncrease] = {}  # pid -> (allocations, frees) totals over 1 min
        self._sites: dict[SiteKey, SlidingFit] = {}
        self._suspects: tuple[LeakSuspect, ...] = ()  # at the last site sample
        self._fragmentation: dict[tuple[int, int], Fragmentation] = {}  # (pid, device), last site sample
        self.fragmentation_skipped_total = 0  # site samples with more live blocks than --max-read-entries
        self._next_tick_monotonic = 0.0
        self._next_site_sample_ns = 0
        # (pid, device) -> traced bytes by role at the last site sample; replaced whole.
        self._role_bytes: dict[tuple[int, int], dict[Role, int]] = {}
        self._role_memo = RoleMemo()
        self._vllm = VllmAnalysis(options.vllm)
        self._vllm_marks: tuple[dict[int, int], dict[int, int]] = ({}, {})  # layouts', sleeps' timestamps
        self._untrusted_reason = ""  # the component is reported once a sender is untrusted, and after
        self._roles_again_ns = 0  # monotonic: a second role sample after the vLLM plugin said memory moved
        self._sampling: _SiteSampleJob | None = None  # the site sample running on its thread (tick)
        self.site_samples_total = 0  # taken from their thread (counters: site_samples, its longest, its entries)
        self._site_sample_longest_ms = 0

    def tick(self) -> None:
        """Called by the agent loop after each poll; analyses once per interval. A site sample runs on a thread
        of its own (`sample_sites`): a tick starts one when due and takes its result once it has ended."""
        self._take_site_sample()
        now = time.monotonic()
        if now < self._next_tick_monotonic:
            return
        self._next_tick_monotonic = now + self.options.interval_seconds
        sample = self._nvml()
        sites_due = self._sampling is None and time.monotonic_ns() >= self._next_site_sample_ns
        view = self.session.ledger_view(sites_due, {p.pid for p in sample.processes} if sample else ())
        if sites_due:
            self._start_site_sample(view)
            view = dataclasses.replace(view, entries=None)
        self.update(view)

    def _start_site_sample(self, view: LedgerView) -> None:
        """A site sample of `view` (its entries) on a thread of its own; its result is taken by a later tick."""
        self._next_site_sample_ns = view.monotonic_ns + int(self.options.site_sample_seconds * NS_PER_SECOND)
        kv_ranges = self._kv_ranges(self.session.vllm_view())
        job = _SiteSampleJob(view, kv_ranges, self.session.stack, self._role_memo, self.options.leak_min_age_seconds)
        self._sampling = job
        threading.Thread(target=job.run, name="kvtrace-sites", daemon=True).start()

    def _take_site_sample(self) -> None:
        """The result of the site sample running, once it has ended (nothing while it runs)."""
        job = self._sampling
        if job is None or not job.done.is_set():
            return
        self._sampling = None
        if job.result is not None:
            self._apply_site_sample(job.result, job.view)
        self.site_samples_total += 1
        self._site_sample_longest_ms = max(self._site_sample_longest_ms, job.wall_ns // 1_000_000)
        counters = {"site_samples": self.site_samples_total, "site_sample_longest_ms": self._site_sample_longest_ms}
        if job.result is not None:  # (a pass that failed went through no known number: the last one's stays)
            counters["site_sample_entries"] = job.result.entries
        self.session.report_counters(counters)
        if self._next_site_sample_ns == 0:
            return  # the vLLM plugin said memory moved while it ran (update): roles again at once
        if self._roles_again_ns > job.view.monotonic_ns:
            self._next_site_sample_ns = min(self._next_site_sample_ns, self._roles_again_ns)
        self.pace_site_samples(job.cpu_ns, time.monotonic_ns())

    def wait_site_sample(self, timeout_seconds: float = 60.0) -> bool:
        """Waits for the site sample running on its thread, if any, and takes its result (tests); False if it
        is still running after `timeout_seconds`."""
        job = self._sampling
        if job is not None and not job.done.wait(timeout_seconds):
            return False
        self._take_site_sample()
        return True

    def pace_site_samples(self, spent_ns: int, now_ns: int) -> None:
        """A site sample reads every outstanding allocation (seconds with millions of them): the
        next one waits long enough that sampling takes at most SITE_SAMPLE_MAX_CPU of a core."""
        earliest = now_ns + int(spent_ns / SITE_SAMPLE_MAX_CPU)
        self._next_site_sample_ns = max(self._next_site_sample_ns, earliest)

    def site_sample_due(self, monotonic_ns: int) -> bool:
        return monotonic_ns >= self._next_site_sample_ns

    def sample_sites_now(self) -> None:
        """The next update samples sites whatever the pace (a replay's last analysis)."""
        self._next_site_sample_ns = 0

    def _nvml(self) -> NvmlSample | None:
        """The latest NVML figures; None when there are none (NVML off, down, or no GPU answered)."""
        sample = self.session.nvml_sample()
        return sample if sample is not None and sample.gpus else None

    def update(self, view: LedgerView) -> AnalysisSnapshot:
        """Adds one sample of every series and publishes a new snapshot as `latest`."""
        sample = self._nvml()
        now_ns = view.monotonic_ns
        traced: dict[tuple[int, int], int] = defaultdict(int)
        for key, (size_bytes, _) in view.totals.items():
            if key.layer in PHYSICAL_LAYERS and key.memory is Memory.DEVICE:
                traced[(key.pid, key.device)] += size_bytes
        nvml_used = _nvml_used(sample)
        alive = {key.pid for key in view.totals} | {pid for pid, _ in nvml_used}

        for series in [series for series in self._growth if series[0] not in alive]:
            del self._growth[series]
        for series in set(traced) | set(self._growth):
            self._growth.setdefault(series, Growth()).add(now_ns, traced.get(series, 0))
        for pid in [pid for pid in self._counts if pid not in alive]:
            del self._counts[pid]
        for pid in [pid for pid in self._environ if pid not in alive]:
            del self._environ[pid]
        for pid in alive:
            self._counts.setdefault(pid, WindowIncrease()).add(
                now_ns, (view.allocations_total.get(pid, 0), view.frees_total.get(pid, 0)))
        vllm_view = self.session.vllm_view()
        if self._vllm_memory_moved(vllm_view):
            # Roles now (the next tick copies the entries) and again shortly after: the probes' events of
            # that memory may still be on their way.
            self._next_site_sample_ns = 0
            self._roles_again_ns = now_ns + ROLES_AGAIN_NS
        if view.entries is not None and now_ns >= self._next_site_sample_ns:
            self._sample_sites(view, view.entries, now_ns, vllm_view)
            if self._roles_again_ns > now_ns:
                self._next_site_sample_ns = min(self._next_site_sample_ns, self._roles_again_ns)
        engines, findings = self._vllm.update(vllm_view, self.session.known_processes(), traced, self._role_bytes,
                                              view.wall_ns, now_ns,
                                              {pid for pid, _ in nvml_used} if sample is not None else None)
        self.latest = AnalysisSnapshot(
            timestamp_ns=view.wall_ns, gpus=sample.gpus if sample else (),
            processes=self._rows(view, traced, nvml_used, sample), suspects=self._suspects,
            nvml_timestamp_ns=sample.timestamp_ns if sample else 0, vllm_engines=engines, vllm_findings=findings,
            vllm_untrusted=self._vllm.untrusted)
        self._report_untrusted(self._vllm.untrusted)
        self.session.report_component("analysis", True, stale_after_seconds=STALE_AFTER_SECONDS,
                                      stale_reason="no analysis for a minute (the agent loop is stuck)")
        return self.latest

    def _report_untrusted(self, untrusted: tuple[UntrustedSender, ...]) -> None:
        """Plugin senders not tied to vLLM, counted and named by the `vllm_trust` component (doctor shows it)."""
        reason = ""
        if untrusted:
            named = "; ".join(f"pid {sender.pid} {sender.label}: {sender.reason}" for sender in untrusted[:3])
            more = f" and {len(untrusted) - 3} more" if len(untrusted) > 3 else ""
            reason = (f"{len(untrusted)} plugin senders not tied to vLLM, their reports kept apart (no engine, "
                      f"no finding): {named}{more}")
        if reason != self._untrusted_reason:
            self._untrusted_reason = reason
            self.session.report_component("vllm_trust", True, reason)
            self.session.report_counters({"vllm_untrusted_senders": len(untrusted)})

    def leak_report(self, pids: Collection[int] = (), min_age_seconds: float | None = None,
                    limit: int | None = None, wall_ns: int | None = None) -> LeakReport:
        """Suspects of `pids` (empty: all) at any age threshold (None: the configured one), ranked
        with the site growth of the latest analysis, cut to `limit`, with native callers named.
        Safe from any thread: the ledger is copied under the Session's lock, ranked outside it."""
        entries = self.session.outstanding(pids)
        find = self.session.entry_lookup()
        with_blocks = pids_with_blocks(self.session.ledger_counts().totals)
        titles = self.session.process_titles()
        min_age = self.options.leak_min_age_seconds if min_age_seconds is None else min_age_seconds
        report = find_suspects(entries, self.session.wall_clock_ns() if wall_ns is None else wall_ns, min_age,
                               self.site_growth, titles, self.session.stack, pids, find, with_blocks)
        # Only the suspects returned are named: the first lookup in a library reads its symbols.
        suspects = tuple(
            dataclasses.replace(suspect, native_caller=self.session.native_caller(
                suspect.pid, suspect.native_caller_address))
            if suspect.native_caller_address else suspect
            for suspect in report.suspects[:limit])
        return dataclasses.replace(report, suspects=suspects)

    def _vllm_memory_moved(self, vllm_view: VllmView) -> bool:
        """A new KV-cache layout or sleep/wake report since the last tick: memory changed role (the KV
        tensors are known now) or went and came back, so roles are sampled without waiting."""
        marks = ({pid: layout.timestamp_ns for pid, layout in vllm_view.layouts.items()},
                 {pid: reports[-1].timestamp_ns for pid, reports in vllm_view.sleeps.items() if reports})
        old, self._vllm_marks = self._vllm_marks, marks
        return any(old_marks.get(pid) != timestamp for new_marks, old_marks in zip(marks, old, strict=True)
                   for pid, timestamp in new_marks.items())

    @staticmethod
    def _kv_ranges(vllm_view: VllmView) -> dict[int, list[tuple[int, int]]]:
        return {pid: kv_ranges_of((tensor.address, tensor.size_bytes) for tensor in layout.tensors)
                for pid, layout in vllm_view.layouts.items()}

    def _sample_sites(self, view: LedgerView, entries: Iterable[Outstanding], now_ns: int,
                      vllm_view: VllmView) -> None:
        """A site sample here, now (update() with entries: a replay, tests); the agent's runs on its thread."""
        self._next_site_sample_ns = now_ns + int(self.options.site_sample_seconds * NS_PER_SECOND)
        result = sample_sites(dataclasses.replace(view, entries=entries), self._kv_ranges(vllm_view),
                              self.session.stack, self._role_memo, self.options.leak_min_age_seconds)
        self._apply_site_sample(result, view)

    def _apply_site_sample(self, result: SiteSample, view: LedgerView) -> None:
        """What a site sample of `view` computed becomes the analyzer's: sites' series (sampled at the view's
        time), their growth, roles, fragmentation and suspects."""
        survey = result.survey
        for site in [site for site in self._sites if site not in survey.site_bytes]:
            del self._sites[site]  # all freed: a site that comes back starts a new series
        for site, size_bytes in survey.site_bytes.items():
            self._sites.setdefault(site, SlidingFit(LONG_WINDOW_SECONDS)).add(view.monotonic_ns, size_bytes)
        self.site_growth = {site: fit.slope_per_second() for site, fit in self._sites.items()}
        self._role_bytes = result.role_bytes
        if result.fragmentation is None:
            # Fragmentation nests every block in its segment: more blocks than may be held at once, it waits.
            self.fragmentation_skipped_total += 1
            self._fragmentation = {}  # not last sample's rows served as current
            if self.fragmentation_skipped_total == 1:
                log.warning("fragmentation not computed: %d live PyTorch blocks, more than --max-read-entries %d",
                            result.blocks, view.read_limit)
        else:
            self._fragmentation = result.fragmentation
        self._suspects = rank_suspects(survey, self.site_growth, view.titles, self.session.stack).suspects

    def _rows(self, view: LedgerView, traced: dict[tuple[int, int], int],
              nvml_used: dict[tuple[int, int], int | None], sample: NvmlSample | None) -> tuple[ProcessGpu, ...]:
        gpus = {gpu.index: gpu for gpu in sample.gpus} if sample else {}
        devices_of: dict[int, set[int]] = defaultdict(set)
        for pid, device in self._growth:
            devices_of[pid].add(device)
        nvml_gpus_of: dict[int, set[int]] = defaultdict(set)
        for pid, gpu_index in nvml_used:
            nvml_gpus_of[pid].add(gpu_index)
        rows: list[ProcessGpu] = []
        claimed: set[tuple[int, int | None]] = set()
        for (pid, device), growth in sorted(self._growth.items()):
            index = self._nvml_index(pid, device, sample, devices_of[pid], nvml_gpus_of[pid])
            claimed.add((pid, index))
            outstanding = traced.get((pid, device), 0)
            used = nvml_used.get((pid, index)) if index is not None else None
            allocations, frees = self._counts[pid].increase()
            history = growth.long.span_seconds()
            gpu = gpus.get(index) if index is not None else None
            rows.append(ProcessGpu(
                pid=pid, title=view.titles.get(pid, ""), device=device, outstanding_bytes=outstanding,
                nvml_used_bytes=used, unattributed_bytes=used - outstanding if used is not None else None,
                growth_bytes_per_second_1m=growth.short.slope_per_second(),
                growth_bytes_per_second_15m=growth.long.slope_per_second(),
                time_to_oom_seconds=time_to_oom_seconds(gpu.free_bytes if gpu else None,
                                                        growth.long.slope_per_second(), history,
                                                        self.options.forecast_min_history_seconds),
                allocations_1m=allocations, frees_1m=frees, free_ratio_1m=free_ratio(allocations, frees),
                nvml_index=index, history_seconds=history, fragmentation=self._fragmentation.get((pid, device)),
                predates_agent=pid in view.predates_agent, role_bytes=self._role_bytes.get((pid, device), {})))
        if not view.traced_only:
            # NVML sees processes kvtrace holds nothing of: started before the agent, or using
            # memory no probe sees. All their memory is unattributed.
            for (pid, index), used in sorted(nvml_used.items()):
                if (pid, index) in claimed:
                    continue
                allocations, frees = self._counts[pid].increase()
                rows.append(ProcessGpu(
                    pid=pid, title=view.titles.get(pid, ""), device=-1, outstanding_bytes=0,
                    nvml_used_bytes=used, unattributed_bytes=used, growth_bytes_per_second_1m=0.0,
                    growth_bytes_per_second_15m=0.0, time_to_oom_seconds=None, allocations_1m=allocations,
                    frees_1m=frees, free_ratio_1m=free_ratio(allocations, frees), nvml_index=index,
                    predates_agent=pid in view.predates_agent))
        return tuple(rows)

    def _nvml_index(self, pid: int, device: int, sample: NvmlSample | None, traced_devices: set[int],
                    nvml_gpus: set[int]) -> int | None:
        """The NVML GPU of a traced CUDA ordinal. Seen beats inferred: a process traced on one device
        that NVML lists on one GPU is on that GPU (this also covers containers whose runtime hides
        the other GPUs, where ordinal 0 may be any GPU of the host); otherwise the process's
        CUDA_VISIBLE_DEVICES decides, and without it the ordinal is the index. A process the agent
        attached to after it chose its device is traced on an unknown device (-1): NVML alone can
        tell, when it lists the process on one GPU."""
        if sample is None:
            return None
        if len(traced_devices) == 1 and len(nvml_gpus) == 1:
            return next(iter(nvml_gpus))
        if device < 0:
            return None
        if pid not in self._environ:
            self._environ[pid] = self._visible_devices(pid)
        uuids = [""] * (max((gpu.index for gpu in sample.gpus), default=-1) + 1)
        for gpu in sample.gpus:
            uuids[gpu.index] = gpu.uuid
        return nvml_index_for_cuda_ordinal(device, self._environ[pid], uuids)


@dataclass(frozen=True)
class SiteSample:
    """What one pass over the ledger's entries computed (sample_sites)."""

    role_bytes: dict[tuple[int, int], dict[Role, int]]  # (pid, device) -> bytes by role
    survey: SiteSurvey  # sites' bytes and the old allocations by site, not ranked yet
    fragmentation: dict[tuple[int, int], Fragmentation] | None  # (pid, device); None: skipped (too many blocks)
    blocks: int  # live PyTorch blocks, by the view's totals
    entries: int = 0  # entries the pass went through


def sample_sites(view: LedgerView, kv_ranges: dict[int, list[tuple[int, int]]],
                 stack_of: Callable[[int], Stack | None], memo: RoleMemo, leak_min_age_seconds: float) -> SiteSample:
    """Roles (roles.py), sites and leak suspects (leaks.py) and fragmentation (blocks.py) of `view`'s entries, in
    one pass over them: where the kernel keeps the allocations, one read of its ledger, a chunk at a time. The
    runtime allocation above each stackless driver one is found in a dict of the same pass's runtime entries
    (their stack and caller only), not looked up in the kernel one system call at a time. Held until the pass
    ends: those dict items, the stackless driver allocations, VMM handles, and the entries of processes with
    PyTorch blocks (their segments and blocks, unless there are more blocks than view.read_limit)."""
    entries: Iterable[Outstanding] = view.entries if view.entries is not None else ()
    if view.find is None:  # a view built by hand (tests): its processes with blocks are found in its entries
        entries = list(entries)
        with_blocks = {entry.key.pid for entry in entries if entry.key.object is ObjectKind.BLOCK}
    else:
        with_blocks = view.pids_with_blocks()
    blocks = sum(count for key, (_, count) in view.totals.items() if key.layer is Layer.TORCH)
    nest: list[Outstanding] | None = None if view.read_limit and blocks > view.read_limit else []
    runtime = RuntimeIndex()
    roles = RoleTally(stack_of, kv_ranges, memo, keep_runtime=False)
    sites = SiteTally(view.wall_ns, leak_min_age_seconds, with_blocks)
    add_runtime, add_role, add_site = runtime.add, roles.add, sites.add
    passed = 0
    for entry in entries:
        passed += 1
        add_runtime(entry)
        add_role(entry)
        add_site(entry)
        if nest is not None and entry.key.pid in with_blocks:
            nest.append(entry)
    fragmented = None
    if nest is not None:
        segments, outside = segments_of(nest, with_blocks)
        fragmented = {(row.pid, row.device): row for row in fragmentation(segments, outside)}
    return SiteSample(roles.finish(runtime.stack), sites.finish(runtime.find), fragmented, blocks, passed)


class _SiteSampleJob:
    """One site sample on its own thread: `view` in, `result` (None: it failed, logged) and the CPU it took out;
    `done` is set last."""

    def __init__(self, view: LedgerView, kv_ranges: dict[int, list[tuple[int, int]]],
                 stack_of: Callable[[int], Stack | None], memo: RoleMemo, leak_min_age_seconds: float) -> None:
        self.view = view
        self._args = (kv_ranges, stack_of, memo, leak_min_age_seconds)
        self.result: SiteSample | None = None
        self.cpu_ns = 0
        self.wall_ns = 0
        self.done = threading.Event()

    def run(self) -> None:
        started, started_wall = time.thread_time_ns(), time.monotonic_ns()
        try:
            self.result = sample_sites(self.view, *self._args)
        except Exception:  # the agent goes on; the next sample may succeed
            log.exception("site sample failed")
        finally:
            self.cpu_ns = time.thread_time_ns() - started
            self.wall_ns = time.monotonic_ns() - started_wall
            self.done.set()


def _nvml_used(sample: NvmlSample | None) -> dict[tuple[int, int], int | None]:
    """(pid, NVML index) -> used bytes, None where NVML does not say; a pid listed more than once on
    a GPU (MIG instances) is summed."""
    used: dict[tuple[int, int], int | None] = {}
    for process in sample.processes if sample else ():
        key = (process.pid, process.gpu_index)
        if key not in used:
            used[key] = process.used_bytes
            continue
        so_far = used[key]
        used[key] = None if so_far is None or process.used_bytes is None else so_far + process.used_bytes
    return used
