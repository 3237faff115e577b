"""What kvtrace knows of vLLM engines: the roles of traced bytes, the plugin's reports from inside the
engine (KV-cache layout, blocks, requests, sleep mode), the engine's own /metrics, and the findings
of the vLLM detectors.

    sources/vllm/plugin.py (in vLLM) ──datagram──▶ sources/vllm/listener.py ─┐
    sources/vllm/metrics.py (the API server's /metrics) ─────────────────────┴▶ Session.ingest
    Session ──vllm_view()──▶ analysis/vllm.py (engines, detectors) ──▶ AnalysisSnapshot.vllm_engines, vllm_findings

Records here are what sources hand to the Session; `VllmEngine` and `VllmFinding` are what analysis
hands to the servers. Nothing here knows vLLM's classes or wire shapes: those stay in sources/vllm/.
"""
from __future__ import annotations

import dataclasses
import enum
import re
from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from kvtrace.model.processes import ProcessInfo

# vLLM titles its processes `<prefix>::<part>[_<suffix>]` with setproctitle: VLLM::EngineCore,
# VLLM::EngineCore_DP1, VLLM::Worker_TP0, VLLM::APIServer_0; the prefix is VLLM unless vLLM's
# VLLM_PROCESS_NAME_PREFIX says otherwise.
_TITLE = re.compile(r"[^\s:]+::(EngineCore|Worker|APIServer)")
_DATA_PARALLEL_RANK = re.compile(r"[^\s:]+::EngineCore_DP(\d+)")
ENGINE, WORKER, API_SERVER = "EngineCore", "Worker", "APIServer"


def vllm_part(title: str) -> str | None:
    """ENGINE, WORKER or API_SERVER for a title vLLM gave one of its processes; None for any other."""
    match = _TITLE.match(title.strip())
    return match.group(1) if match else None


def data_parallel_rank(title: str) -> str | None:
    """The data-parallel rank in an engine's title (VLLM::EngineCore_DP1 -> "1"), vLLM's `engine` label."""
    match = _DATA_PARALLEL_RANK.match(title.strip())
    return match.group(1) if match else None


MAX_PARENT_DEPTH = 8  # a worker's parent chain is walked this far looking for its engine


def gpu_holders(traced: Mapping[tuple[int, int], int], nvml_pids: Collection[int] | None) -> set[int]:
    """The processes vllm_tie takes as holding GPU memory. Where NVML is up (`nvml_pids`, its list of processes
    on a GPU) only those: the driver's word, which a user's own stub cuMemAlloc cannot fake as it fakes traced
    bytes. Where NVML is down (None), the processes with traced physical bytes (`traced`: (pid, device) ->
    bytes), the only word there is."""
    if nvml_pids is not None:
        return set(nvml_pids)
    return {pid for (pid, _), size_bytes in traced.items() if size_bytes > 0}


def vllm_tie(pid: int, processes: Mapping[int, ProcessInfo], traced_pids: Collection[int]) -> str:
    """"" when what the kernel says ties `pid` to vLLM, else why not, one line: it holds traced GPU memory
    itself (an engine whose model runs in it, whatever its title: offline inference runs the scheduler in the
    script's process), or its title (/proc) is a vLLM engine's and a `VLLM::Worker*` holding traced memory has
    it on its parent chain (an EngineCore whose model runs in its workers). A plugin report is only a claim
    (any local process may send one): it counts as an engine's only from a process tied so.
    `traced_pids`: the processes holding GPU memory now (gpu_holders: NVML's list of processes using a GPU
    where NVML is up, the driver's word, which ties an engine with tracing off too; else the probes' ledger)."""
    if pid in traced_pids:
        return ""
    info = processes.get(pid)
    if info is None:
        return "it holds no traced GPU memory and kvtrace does not know its title"
    if vllm_part(info.title) != ENGINE:
        return "it holds no traced GPU memory and its title is not a vLLM engine's"
    for worker in traced_pids:
        other = processes.get(worker)
        if other is None or vllm_part(other.title) != WORKER:
            continue
        parent = other.parent_pid
        for _ in range(MAX_PARENT_DEPTH):
            if not parent or parent == pid:
                break
            above = processes.get(parent)
            parent = above.parent_pid if above is not None else 0
        if parent == pid:
            return ""
    return "it holds no traced GPU memory, and no vLLM worker that does descends from it"


class Role(enum.IntEnum):
    """What a traced byte is for. Decided per allocation from its Python stack (analysis/roles.py) and,
    where the plugin reported the KV tensors, from their addresses. Values are kvtrace.v1's `Role`."""

    UNKNOWN = 0  # no Python stack to decide from
    KV_CACHE = 1
    WEIGHTS = 2
    CUDA_GRAPH = 3  # memory captured into a CUDA graph pool
    ACTIVATIONS = 4  # activations and workspace: forward passes, sampling, the start-up profile run
    OTHER = 5  # a stack that matches no rule

    @property
    def label(self) -> str:
        """The Prometheus `role` label and the CLI's name: kv_cache, weights, ..."""
        return self.name.lower()


class RequestState(enum.IntEnum):
    """A request's state as the scheduler holds it. Values are kvtrace.v1's `RequestState`."""

    UNSPECIFIED = 0
    WAITING = 1
    RUNNING = 2
    PREEMPTED = 3
    FINISHED = 4  # finished normally (stop, length): its blocks should be back in the pool
    ABORTED = 5  # aborted (client gone, cancelled): its blocks should be back in the pool

    @property
    def done(self) -> bool:
        return self in (RequestState.FINISHED, RequestState.ABORTED)


@dataclass(frozen=True)
class KvRequest:
    """A request that holds KV blocks, as the plugin saw it."""

    request_id: str
    state: RequestState
    blocks: int
    # Seconds since the scheduler finished or aborted it, at the report; None while not done.
    done_age_seconds: float | None = None


@dataclass(frozen=True)
class KvTensor:
    """One KV-cache tensor (a layer's, or the packed backing several layers share)."""

    address: int
    size_bytes: int


# ---- records the Session takes (the plugin's three messages and a /metrics scrape) ----


@dataclass(frozen=True)
class KvCacheLayout:
    """The plugin, in the process that allocated the KV cache (EngineCore with one GPU, each worker with
    several): where the KV tensors are. Block b of a tensor starts at address + b * page_size_bytes."""

    pid: int
    timestamp_ns: int  # wall clock at the agent's receipt
    device: int  # CUDA ordinal of the tensors
    tensors: tuple[KvTensor, ...]
    num_blocks: int
    page_size_bytes: int
    block_size_tokens: int


@dataclass(frozen=True)
class SchedulerReport:
    """The plugin, in the process that owns the scheduler (EngineCore), once a second."""

    pid: int
    timestamp_ns: int
    blocks_total: int  # usable blocks (the null block left out)
    blocks_free: int  # free, including cached blocks that may be evicted
    running: int
    waiting: int
    # Blocks the pool handed out / took back since the engine started (counters).
    blocks_allocated_total: int
    blocks_freed_total: int
    requests: tuple[KvRequest, ...]  # requests holding blocks: every done one first, then the largest
    requests_omitted: int = 0  # holders left out of `requests` (the message has a size limit)

    @property
    def usage_ratio(self) -> float:
        """vLLM's `kv_cache_usage_perc`: 1 - free / total."""
        return 1.0 - self.blocks_free / self.blocks_total if self.blocks_total else 0.0


@dataclass(frozen=True)
class SleepPool:
    """One CuMemAllocator tag (weights, kv_cache, ...) at a sleep or wake."""

    tag: str
    size_bytes: int  # every allocation of the tag
    mapped_bytes: int  # of those, backed by device memory after the call


@dataclass(frozen=True)
class SleepReport:
    """The plugin, after `sleep(level)` (level 1 or 2) or `wake_up()` (level 0) returned."""

    pid: int
    timestamp_ns: int
    level: int  # 0: awake (after wake_up)
    pools: tuple[SleepPool, ...]


@dataclass(frozen=True)
class EngineMetrics:
    """One engine's figures from the API server's /metrics (labels model_name, engine)."""

    engine: str  # vLLM's `engine` label (the data-parallel index)
    model_name: str
    kv_cache_usage_ratio: float | None  # vllm:kv_cache_usage_perc (0-1)
    requests_running: float | None
    requests_waiting: float | None
    sleep_level: int | None  # from vllm:engine_sleep_state: 0 awake, 1 weights offloaded, 2 discard all
    preemptions_total: float | None
    num_gpu_blocks: int | None  # vllm:cache_config_info's label
    block_size_tokens: int | None


@dataclass(frozen=True)
class VllmMetricsSample:
    """One scrape of a vLLM API server's /metrics."""

    url: str
    api_server_pid: int  # 0: a URL given by flag whose process is not known
    timestamp_ns: int
    engines: tuple[EngineMetrics, ...] = ()
    error: str = ""  # why the scrape failed ("" : it worked)


VllmRecord = KvCacheLayout | SchedulerReport | SleepReport | VllmMetricsSample


@dataclass(frozen=True)
class VllmView:
    """What analysis reads from the Session: the latest of each record, copied at once."""

    layouts: dict[int, KvCacheLayout] = field(default_factory=dict)  # pid -> layout
    schedulers: dict[int, SchedulerReport] = field(default_factory=dict)  # pid -> latest report
    sleeps: dict[int, tuple[SleepReport, ...]] = field(default_factory=dict)  # pid -> recent, oldest first
    metrics: dict[str, VllmMetricsSample] = field(default_factory=dict)  # url -> latest scrape

    def without(self, pids: Collection[int]) -> VllmView:
        """The view less the plugin's records of `pids` (senders not tied to vLLM: kept apart)."""
        if not pids:
            return self
        return VllmView({pid: layout for pid, layout in self.layouts.items() if pid not in pids},
                        {pid: report for pid, report in self.schedulers.items() if pid not in pids},
                        {pid: reports for pid, reports in self.sleeps.items() if pid not in pids}, self.metrics)

    def senders(self) -> set[int]:
        """Every pid the plugin's records came from."""
        return set(self.layouts) | set(self.schedulers) | set(self.sleeps)


# Sleep/wake reports kept per process, oldest first (analysis reads the latest; `kvtrace vllm --json` and
# tests see a process's last few transitions).
SLEEP_REPORTS_KEPT = 8


def _same_but_time(kept: KvCacheLayout | SleepReport | None, new: KvCacheLayout | SleepReport) -> bool:
    """`new` says what `kept` said: the plugin sends its layout and sleep state again (to an agent that
    restarted), and a repeat is no new event — its time would restart a sleep cycle or a role sample."""
    return kept is not None and dataclasses.replace(new, timestamp_ns=kept.timestamp_ns) == kept


class VllmStore:
    """The vLLM plugin's latest reports per process and the latest scrape of each /metrics URL, as the Session
    keeps them (under its lock)."""

    def __init__(self) -> None:
        self._layouts: dict[int, KvCacheLayout] = {}
        self._schedulers: dict[int, SchedulerReport] = {}
        self._sleeps: dict[int, deque[SleepReport]] = {}
        self._metrics: dict[str, VllmMetricsSample] = {}

    def take(self, record: VllmRecord) -> None:
        if type(record) is SchedulerReport:
            self._schedulers[record.pid] = record
        elif type(record) is KvCacheLayout:
            if not _same_but_time(self._layouts.get(record.pid), record):
                self._layouts[record.pid] = record
        elif type(record) is SleepReport:
            reports = self._sleeps.setdefault(record.pid, deque(maxlen=SLEEP_REPORTS_KEPT))
            if not reports or not _same_but_time(reports[-1], record):
                reports.append(record)
        elif type(record) is VllmMetricsSample:
            self._metrics[record.url] = record
        else:
            raise TypeError(f"not a vLLM record: {type(record).__name__}")

    def forget(self, pid: int, keep_layout: bool = False) -> bool:
        """The plugin's records of `pid` go (its process exited, or the listener no longer follows it); with
        `keep_layout` its KV-cache layout stays. True when a layout is kept."""
        if not keep_layout:
            self._layouts.pop(pid, None)
        self._schedulers.pop(pid, None)
        self._sleeps.pop(pid, None)
        return pid in self._layouts

    def forget_metrics(self, url: str) -> None:
        self._metrics.pop(url, None)

    def view(self) -> VllmView:
        return VllmView(dict(self._layouts), dict(self._schedulers),
                        {pid: tuple(reports) for pid, reports in self._sleeps.items()}, dict(self._metrics))


# ---- what analysis hands to the servers ----


class FindingKind(enum.IntEnum):
    """The vLLM detectors. Values are kvtrace.v1's `VllmFindingKind`; labels are the `kind` label of
    kvtrace_vllm_findings."""

    UNSPECIFIED = 0
    BLOCKS_HELD_AFTER_FINISH = 1  # done requests still holding blocks after N seconds (abort-path leak)
    STUCK_KV_USAGE = 2  # KV usage above zero while nothing runs or waits
    FREE_BLOCKS_FALLING = 3  # idle free blocks below the start's by more than 5 %
    LOW_FREE_RATIO = 4  # block frees per allocation over the last minute below 0.7
    IDLE_GROWTH = 5  # GPU memory growing with no request running
    SLEEP_RESIDUE = 6  # bytes still held after sleep(), and their change from the last cycle

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(frozen=True)
class VllmFinding:
    kind: FindingKind
    engine_pid: int
    message: str  # one line a person reads: what, how much, since when
    value: float  # the figure the detector compared (blocks, ratio, bytes/s, bytes)
    threshold: float  # what it was compared with
    since_ns: int  # wall clock when the condition started to hold
    requests: tuple[KvRequest, ...] = ()  # BLOCKS_HELD_AFTER_FINISH: the requests and their blocks
    # SLEEP_RESIDUE: bytes still held by role after the engine slept, and by CuMemAllocator tag.
    held_by_role: dict[Role, int] = field(default_factory=dict)
    held_by_tag: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class UntrustedSender:
    """A process whose plugin reports kvtrace cannot tie to vLLM (vllm_tie): kept apart from the engines, never
    the subject of a finding, labelled (untrusted) wherever it is named."""

    pid: int
    title: str  # as the Session knows it ("" : unknown, a process that traced nothing)
    reason: str  # why it is not tied: vllm_tie's words
    kv_tensor_bytes: int = 0  # what its layout claims
    scheduler: bool = False  # it sent scheduler reports

    @property
    def label(self) -> str:
        """How reports and the title label name it: "(untrusted) TITLE", or "(untrusted)" alone."""
        return f"(untrusted) {self.title}" if self.title else "(untrusted)"


@dataclass(frozen=True)
class VllmEngine:
    """One vLLM engine: its EngineCore process, the workers under it, and what is known of its KV cache."""

    engine_pid: int  # the EngineCore (or the process that owns the scheduler)
    title: str
    worker_pids: tuple[int, ...]  # processes of the engine holding GPU memory (EngineCore included)
    api_server_pid: int = 0  # 0: none found
    traced_bytes: int = 0  # physical device memory of the engine's processes
    role_bytes: dict[Role, int] = field(default_factory=dict)  # of traced_bytes, by role
    plugin: bool = False  # the plugin reports from this engine
    blocks_total: int | None = None
    blocks_free: int | None = None
    kv_cache_usage_ratio: float | None = None  # the plugin's; else /metrics'
    metrics_kv_cache_usage_ratio: float | None = None  # vllm:kv_cache_usage_perc, side by side
    requests_running: int | None = None
    requests_waiting: int | None = None
    kv_tensor_bytes: int = 0  # the KV tensors' total as the plugin reported them
    page_size_bytes: int = 0
    block_allocations_per_second: float = 0.0  # over the last minute
    block_frees_per_second: float = 0.0
    frees_per_allocation_1m: float | None = None  # None: no allocations in the minute
    sleep_level: int = 0  # 0 awake
    warming_up: bool = False  # inside the cold-start window: growth findings stay silent
    holders: tuple[KvRequest, ...] = ()  # requests holding blocks (the plugin's list)
    metrics_url: str = ""
    metrics_error: str = ""
    # ---- the detectors' figures (analysis/vllm.py), for gauges and the CLI ----
    blocks_held_after_finish: int = 0  # blocks of requests done more than held_after_finish_seconds ago
    free_blocks_ratio: float | None = None  # free blocks at the last idle report / at the first one
    idle_growth_bytes_per_second: float = 0.0  # traced-bytes growth over 1 min while no request runs, else 0
    sleep_residual_bytes: int | None = None  # traced bytes still held while asleep; None awake
    sleep_held_by_tag: dict[str, int] = field(default_factory=dict)  # asleep: CuMemAllocator tag -> mapped bytes
    previous_sleep_residual_bytes: int | None = None  # the residue of the sleep before this one
