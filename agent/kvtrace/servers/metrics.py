"""The metrics kvtrace exports and how each sample is built: the catalog (METRICS; docs/metrics.md has
the same table), the label values and the collector (KvtraceCollector).

Both exporters read it: the Prometheus listener (kvtrace.servers.prometheus, `/metrics`) and the OTLP
push (kvtrace.servers.otlp). One catalog and one collector, so the two outputs cannot drift, and
neither exporter needs the other.

The collector builds every sample at collection time from the Session (`AgentState`) and the
Analyzer's latest snapshot, so nothing is kept or updated on the event path.

Labels are bounded: pid, title, gpu, layer, memory, window, api, error_code, component, uuid, uid, resource,
version, and for roles and vLLM engines role (6 values), state (used/free, running/waiting), source
(plugin/metrics) and kind (6 detectors). Stacks, addresses and request ids are never labels
(`kvtrace leaks`, `kvtrace vllm` and the gRPC API have them). Series of a process are exported
while it is alive (it holds traced memory, is in the snapshot or is known to the Session), so
exited processes' series go stale instead of piling up.

`gpu` on per-process metrics is the CUDA ordinal the process used ("unknown" when it could not be
known); on kvtrace_gpu_memory_* it is the NVML index. They differ when CUDA_VISIBLE_DEVICES
reorders or hides GPUs; `uuid` is the stable name of a GPU.
"""
from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvtrace import __version__
from kvtrace.model.agent import PartyShare
from kvtrace.model.depth import ProcessDepth
from kvtrace.model.events import DEVICE_UNKNOWN, Api, Layer, Memory
from kvtrace.model.findings import AnalysisSnapshot
from kvtrace.model.ledger import LedgerCounts, TotalsKey
from kvtrace.model.processes import redact_title
from kvtrace.model.user_shares import OTHER_USER, SHARE_COUNTER_PREFIX, UserLabels
from kvtrace.model.vllm import FindingKind
from kvtrace.servers.backend import AgentAnalysis, AgentState

log = logging.getLogger(__name__)

# A title is a command line: long, and sometimes carrying secrets. Labels get a redacted, cut copy.
TITLE_MAX_CHARS = 64
# Label values a process or user chooses are few whatever it does: a process's GPUs beyond these (by its
# bytes) are summed as gpu="other" in the totals and left out of the per-GPU analysis; a call's error codes
# beyond these (by calls) as error_code="other". (The users refused a share: model/user_shares.py, UserLabels.)
GPU_LABELS_PER_PROCESS = 8
ERROR_CODE_LABELS_PER_API = 8
OTHER = "other"


# ---- what is exported (docs/metrics.md has the same table; a unit test keeps them equal) ----

@dataclass(frozen=True)
class MetricSpec:
    name: str  # the sample name as scraped (counters end in _total)
    type: str  # "counter" or "gauge"
    unit: str
    labels: tuple[str, ...]
    help: str


_PROCESS = ("pid", "title")
_PROCESS_GPU = ("pid", "title", "gpu")
_ENGINE = ("pid", "title")  # a vLLM engine: pid is its EngineCore's (the process that owns the scheduler)

METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("kvtrace_outstanding_bytes", "gauge", "bytes", _PROCESS_GPU + ("layer", "memory"),
               "Traced memory allocated and not yet freed. Layers nest (runtime on driver, torch blocks "
               "inside runtime or vmm segments): physical device memory is layer driver plus vmm, never "
               "more layers."),
    MetricSpec("kvtrace_outstanding_objects", "gauge", "objects", _PROCESS_GPU + ("layer", "memory"),
               "Traced allocations (and VMM handles) not yet freed."),
    MetricSpec("kvtrace_allocations_total", "counter", "allocations", _PROCESS + ("layer",),
               "Successful allocations seen, per layer (layer torch: the block events sent; while nobody reads "
               "every block, only sampled blocks are: kvtrace_block_events_quiet_total counts the others)."),
    MetricSpec("kvtrace_frees_total", "counter", "frees", _PROCESS + ("layer",),
               "Frees of allocations the agent saw, per layer (frees of older memory are not counted; layer "
               "torch: as kvtrace_allocations_total)."),
    MetricSpec("kvtrace_allocation_failures_total", "counter", "calls", ("api", "error_code"),
               "Allocation and free calls that returned a CUDA error, by API and CUDA error code "
               "(2 = out of memory)."),
    MetricSpec("kvtrace_growth_bytes_per_second", "gauge", "bytes per second", _PROCESS_GPU + ("window",),
               "Growth of the process's physical device memory on the GPU over the window (1m or 15m); "
               "negative when it shrinks."),
    MetricSpec("kvtrace_time_to_oom_seconds", "gauge", "seconds", _PROCESS_GPU,
               "Time until the GPU's free memory runs out at the process's 15m growth rate. Only "
               "present while the process grows."),
    MetricSpec("kvtrace_unattributed_bytes", "gauge", "bytes", _PROCESS_GPU,
               "NVML used memory of the process minus its traced device memory: CUDA context, NCCL "
               "buffers, memory allocated before the agent started. Only present when NVML reports the "
               "process."),
    MetricSpec("kvtrace_nvml_used_bytes", "gauge", "bytes", _PROCESS_GPU,
               "Device memory NVML attributes to the process. Only present when NVML reports it."),
    MetricSpec("kvtrace_gpu_memory_total_bytes", "gauge", "bytes", ("gpu", "uuid"),
               "Memory of the GPU as NVML reports it (gpu is the NVML index)."),
    MetricSpec("kvtrace_gpu_memory_used_bytes", "gauge", "bytes", ("gpu", "uuid"),
               "Used memory of the GPU as NVML reports it, all processes together."),
    MetricSpec("kvtrace_gpu_memory_free_bytes", "gauge", "bytes", ("gpu", "uuid"),
               "Free memory of the GPU as NVML reports it."),
    MetricSpec("kvtrace_leak_suspects", "gauge", "call sites", _PROCESS_GPU,
               "Allocation call sites whose memory is old, still outstanding and still growing "
               "(suspects, not proof of a leak; kvtrace leaks names them). Flat sites such as model "
               "weights are not counted. 0 when the process has none."),
    MetricSpec("kvtrace_leak_suspect_bytes", "gauge", "bytes", _PROCESS_GPU,
               "Outstanding bytes held by the growing leak suspects of the process on the GPU."),
    MetricSpec("kvtrace_torch_reserved_bytes", "gauge", "bytes", _PROCESS_GPU,
               "Segments of PyTorch's caching allocator (cudaMalloc'd, or mapped under expandable segments), "
               "where the process's blocks are traced: what torch.cuda.memory_reserved() counts."),
    MetricSpec("kvtrace_torch_allocated_bytes", "gauge", "bytes", _PROCESS_GPU,
               "Bytes PyTorch's caching allocator has handed to live tensors, as they were asked for "
               "(torch.cuda.memory_allocated() counts them rounded up)."),
    MetricSpec("kvtrace_torch_largest_free_block_bytes", "gauge", "bytes", _PROCESS_GPU,
               "The largest stretch of PyTorch's segments that no tensor holds: the largest tensor that "
               "fits without a new cudaMalloc."),
    MetricSpec("kvtrace_torch_fragmentation_ratio", "gauge", "ratio", _PROCESS_GPU,
               "1 - largest free stretch / free bytes of PyTorch's segments: 0 when the free memory is one "
               "stretch, near 1 when it is scattered in pieces too small to use (0 when none is free)."),
    MetricSpec("kvtrace_role_bytes", "gauge", "bytes", _PROCESS_GPU + ("role",),
               "Traced physical device memory of the process on the GPU by what it is for: role kv_cache, "
               "weights, cuda_graph, activations, other (a Python stack no rule matches) or unknown (no Python "
               "stack), from each allocation's stack and the KV tensors the vLLM plugin reported; as of the "
               "agent's last site sample."),
    MetricSpec("kvtrace_process_depth", "gauge", "depth", _PROCESS,
               "How closely the agent traces the process: 1 segments (CUDA runtime, driver and VMM calls; a "
               "stack names who grew PyTorch's cache, not who holds it), 2 blocks (PyTorch's blocks too, their "
               "stacks sampled), 3 full (every block's stack). The agent raises a process on evidence or when "
               "asked (kvtrace deep) and lowers it after a quiet window; kvtrace ps says why."),
    MetricSpec("kvtrace_process_depth_start_time_seconds", "gauge", "seconds", _PROCESS,
               "Unix time the process reached its current depth (kvtrace_process_depth): its blocks are traced "
               "from then on, not before."),
    MetricSpec("kvtrace_vllm_kv_blocks", "gauge", "blocks", _ENGINE + ("state",),
               "KV-cache blocks of the vLLM engine in use (state used) and free (state free; cached blocks "
               "that may be evicted count as free), from kvtrace's plugin in the engine."),
    MetricSpec("kvtrace_vllm_kv_cache_usage_ratio", "gauge", "ratio", _ENGINE + ("source",),
               "KV-cache usage of the vLLM engine, 0 to 1: source plugin is kvtrace's plugin (1 - free / total "
               "blocks), source metrics is vllm:kv_cache_usage_perc from the engine's /metrics."),
    MetricSpec("kvtrace_vllm_requests", "gauge", "requests", _ENGINE + ("state",),
               "Requests of the vLLM engine running and waiting (state), from kvtrace's plugin, else from the "
               "engine's /metrics."),
    MetricSpec("kvtrace_vllm_blocks_held_after_finish", "gauge", "blocks", _ENGINE,
               "KV-cache blocks still held by requests that finished or were aborted longer ago than the "
               "detector's threshold (30 s by default): the abort-path leak; kvtrace vllm names the requests. "
               "0 when none; only with the plugin."),
    MetricSpec("kvtrace_vllm_block_allocations_per_second", "gauge", "blocks per second", _ENGINE,
               "KV-cache blocks the engine's block pool handed out per second over the last minute (plugin)."),
    MetricSpec("kvtrace_vllm_block_frees_per_second", "gauge", "blocks per second", _ENGINE,
               "KV-cache blocks the engine's block pool took back per second over the last minute (plugin)."),
    MetricSpec("kvtrace_vllm_block_frees_per_allocation", "gauge", "ratio", _ENGINE,
               "Block frees per block allocation of the engine over the last minute: about 0.95 is healthy, "
               "below 0.7 suggests blocks that are never given back. Absent without allocations in the minute."),
    MetricSpec("kvtrace_vllm_free_blocks_ratio", "gauge", "ratio", _ENGINE,
               "Free KV-cache blocks at the engine's last idle moment over those at its first idle moment: "
               "healthy within 5 % of 1; falling means blocks stay held with nothing running."),
    MetricSpec("kvtrace_vllm_idle_growth_bytes_per_second", "gauge", "bytes per second", _ENGINE,
               "Growth of the engine's traced device memory over the last minute while no request runs; 0 "
               "while one runs; absent where neither the plugin nor /metrics says whether one runs."),
    MetricSpec("kvtrace_vllm_sleep_level", "gauge", "level", _ENGINE,
               "vLLM sleep mode of the engine: 0 awake, 1 weights offloaded to host memory and KV cache "
               "discarded, 2 both discarded."),
    MetricSpec("kvtrace_vllm_sleep_residual_bytes", "gauge", "bytes", _ENGINE,
               "Traced device memory the engine's processes still hold while it sleeps (absent while awake); "
               "kvtrace vllm breaks it down by role and pool tag."),
    MetricSpec("kvtrace_vllm_warming_up", "gauge", "boolean", _ENGINE,
               "1 inside the cold-start window after the engine started (model load, profiling; 120 s by "
               "default), while growth findings stay silent; else 0."),
    MetricSpec("kvtrace_vllm_finding", "gauge", "boolean", _ENGINE + ("kind",),
               "1 while the vLLM detector's finding holds for the engine, else 0. kind: blocks_held_after_finish, "
               "stuck_kv_usage, free_blocks_falling, low_free_ratio, idle_growth, sleep_residue; kvtrace vllm "
               "says what it found."),
    MetricSpec("kvtrace_events_total", "counter", "events", (),
               "Events the probes delivered to the agent's ring buffer."),
    MetricSpec("kvtrace_events_lost_total", "counter", "events", (),
               "Events dropped because the ring buffer was full. Outstanding totals stay exact (the "
               "kernel keeps them; VMM objects are read again from it); stacks and rates of the lost "
               "events are missing."),
    MetricSpec("kvtrace_ledger_full_total", "counter", "allocations", (),
               "Allocations the in-kernel ledger had no room for: outstanding totals are no longer "
               "exact. Restart the agent with a larger --max-ledger-entries."),
    MetricSpec("kvtrace_ledger_totals_full_total", "counter", "changes", (),
               "Changes of allocations or PyTorch blocks the kernel's totals map had no room for (--max-totals "
               "keys, 16 384 by default: a few per process, GPU, layer and kind of memory): those totals are no "
               "longer exact until their processes exit. Restart the agent with a larger --max-totals."),
    MetricSpec("kvtrace_ledger_kernel_objects", "gauge", "objects", (),
               "Allocations and PyTorch blocks of traced processes that the in-kernel ledger holds, from the "
               "kernel's totals: the agent keeps none, and reports read them from the kernel when asked."),
    MetricSpec("kvtrace_ledger_reads_refused_total", "counter", "reads", (),
               "Copies of every kernel ledger entry at once (a recording's or flight dump's checkpoint) not made "
               "because they would exceed --max-read-entries; the agent log says which. Raise "
               "--max-read-entries (about 450 bytes of agent memory per entry)."),
    MetricSpec("kvtrace_block_events_unsent_total", "counter", "events", (),
               "PyTorch block events not sent because a process went over --max-block-events-per-second: "
               "the blocks stay exact in the ledger (resynced from the kernel), their stacks are missing."),
    MetricSpec("kvtrace_block_stacks_sampled_total", "counter", "blocks", (),
               "PyTorch blocks under stack sampling (--block-sample-bytes) whose Python stack was walked: one "
               "every S bytes of a thread's blocks on average, and every block of at least S bytes."),
    MetricSpec("kvtrace_block_stacks_not_sampled_total", "counter", "blocks", (),
               "PyTorch blocks under stack sampling whose stack was not walked (stack_status not_sampled): they "
               "stay exact in the ledger and its totals; bytes per stack (leak suspects, flame graphs) are "
               "estimated from the sampled ones."),
    MetricSpec("kvtrace_block_events_quiet_total", "counter", "events", (),
               "PyTorch block events not sent because no reader wanted every block (no gRPC subscriber, no "
               "recording): the blocks without a walked stack, and their frees. No loss: the kernel's ledger "
               "and totals stay exact without them."),
    MetricSpec("kvtrace_events_undecodable_total", "counter", "events", (),
               "Events the agent could not decode (probes and agent of different builds?): they are "
               "told to subscribers as lost and the ledger resyncs from the kernel's (at most once a "
               "second); reinstall so that both match."),
    MetricSpec("kvtrace_event_loop_late_turns_total", "counter", "turns", (),
               "Turns of the agent's event loop that started more than a second after the one before (the "
               "loop reads the probes' events, drops what exited processes held, resyncs after loss): events "
               "waited meanwhile and `kvtrace ps` lagged. `kvtrace doctor` names the longest gap."),
    MetricSpec("kvtrace_site_samples_total", "counter", "passes", (),
               "Passes of the site sample over the ledger (roles, leak suspects' call sites, fragmentation), "
               "each on a thread of its own beside the event loop (--site-sample-interval); where the kernel keeps "
               "the ledger a pass gives way to a client's listing or report while it reads (10 s at most)."),
    MetricSpec("kvtrace_site_sample_objects", "gauge", "objects", (),
               "Ledger objects (allocations and blocks) the last completed site sample went through: its time "
               "grows with them."),
    MetricSpec("kvtrace_attached_libraries", "gauge", "libraries", (),
               "Libraries (files, by device and inode) with the agent's probes in."),
    MetricSpec("kvtrace_libraries_refused_total", "counter", "attempts", (),
               "Libraries refused probes for want of a place (--max-libraries, or bcc's probe quota on "
               "kernels before 6.6): processes using them are not traced until one is free. The "
               "libraries component is down meanwhile and names one."),
    MetricSpec("kvtrace_libraries_detached_total", "counter", "libraries", (),
               "Libraries whose probes were taken out because no traced process mapped them."),
    MetricSpec("kvtrace_flight_dumps_total", "counter", "dumps", (),
               "Flight recorder dumps written (an allocation failed with out-of-memory, a process died holding "
               "GPU memory, a near time-to-OOM, SIGUSR1 or a request); `kvtrace flight` lists them."),
    MetricSpec("kvtrace_flight_dump_failures_total", "counter", "dumps", (),
               "Flight recorder dumps that could not be written (the agent log says why: a full disk?)."),
    MetricSpec("kvtrace_crosscheck_calls_total", "counter", "calls", ("api", "result"),
               "Calls of processes traced both by the uprobes and by CUPTI from inside (kvtrace run), compared "
               "one for one. result: matched, uprobe_only, cupti_only (the other witness never saw it within "
               "10 s), mismatched (a different size or device). Anything but matched means one witness missed "
               "or misread a call: kvtrace doctor --pid names them."),
    MetricSpec("kvtrace_cupti_traced_processes", "gauge", "processes", ("state",),
               "Processes whose CUPTI tracer (kvtrace run) the agent heard from, by state: tracing, held "
               "(another CUPTI subscriber such as torch.profiler or Nsight holds the process), unavailable, off, "
               "gone; exited ones count for a while."),
    MetricSpec("kvtrace_vllm_messages_received_total", "counter", "messages", (),
               "Reports the kvtrace vLLM plugin sent to the agent's socket and the agent took."),
    MetricSpec("kvtrace_vllm_messages_rejected_total", "counter", "messages", (),
               "Plugin reports the agent dropped: malformed, too large, from a sender over its rate "
               "limit, or without credentials (a plugin of another kvtrace version?); the agent log says why."),
    MetricSpec("kvtrace_vllm_senders_evicted_total", "counter", "senders", (),
               "Plugin senders that gave their place to a newcomer of their user (silent 30 s, or a stranger to "
               "vLLM making room for a traced vLLM process); an engine's KV layout stays."),
    MetricSpec("kvtrace_vllm_untrusted_processes", "gauge", "processes", (),
               "Processes sending vLLM plugin reports that kvtrace cannot tie to vLLM (no traced GPU memory of "
               "their own or of their workers): their reports are kept apart, make no engine and raise no "
               "finding; the vllm_trust component (kvtrace doctor) names them."),
    MetricSpec("kvtrace_share_refused_total", "counter", "refusals", ("resource", "user"),
               "What was refused to a user at its share (issue 31): resource vllm_senders (plugin senders), "
               "cupti_connections (kvtrace run's tracers), group_connections (the API's group socket: a user's "
               "connections beyond its share are shut down), ledger and totals (entries the probes refused "
               "because the user's share of the kernel's maps was full: counted, not stored, no event; one "
               "user may hold a quarter of each map, every user but root together half, root three quarters; "
               "the shares component names their processes). Only that user is degraded; the others keep "
               "their reserve. user: the first 8 users refused (of each resource's kind: places, the maps) by "
               "name for good, every later one as other; (pool full): refused because every place was held "
               "while the user was within its share."),
    MetricSpec("kvtrace_unknown_frees_total", "counter", "frees", (),
               "Frees of memory the agent never saw allocated: memory from before the agent started."),
    MetricSpec("kvtrace_component_up", "gauge", "boolean", ("component",),
               "1 when the component works (bpf, nvml, python_stacks, analysis, exporter, ...), 0 when "
               "it is down; kvtrace doctor and the agent log say why."),
    MetricSpec("kvtrace_build_info", "gauge", "info", ("version",),
               "Always 1; the version label is the agent's version."),
)

METRIC_NAMES: frozenset[str] = frozenset(spec.name for spec in METRICS)
_SPECS = {spec.name: spec for spec in METRICS}

# Session.counters() key -> unlabelled counter.
_SESSION_COUNTERS = {
    "kvtrace_events_total": "events_submitted",
    "kvtrace_events_lost_total": "events_lost",
    "kvtrace_ledger_full_total": "ledger_full",
    "kvtrace_ledger_totals_full_total": "totals_full",
    "kvtrace_unknown_frees_total": "unknown_frees",
    "kvtrace_vllm_messages_received_total": "vllm_messages_received",
    "kvtrace_vllm_messages_rejected_total": "vllm_messages_rejected",
    "kvtrace_vllm_senders_evicted_total": "vllm_senders_evicted",
    "kvtrace_vllm_untrusted_processes": "vllm_untrusted_senders",
    "kvtrace_block_events_unsent_total": "blocks_unsent",
    "kvtrace_block_stacks_sampled_total": "blocks_sampled",
    "kvtrace_block_stacks_not_sampled_total": "blocks_not_sampled",
    "kvtrace_block_events_quiet_total": "blocks_quiet",
    "kvtrace_ledger_kernel_objects": "ledger_entries_in_kernel",
    "kvtrace_ledger_reads_refused_total": "ledger_reads_refused",
    "kvtrace_events_undecodable_total": "events_undecodable",
    "kvtrace_event_loop_late_turns_total": "event_loop_late_turns",
    "kvtrace_site_samples_total": "site_samples",
    "kvtrace_site_sample_objects": "site_sample_entries",
    "kvtrace_attached_libraries": "libraries_attached",
    "kvtrace_libraries_refused_total": "libraries_refused",
    "kvtrace_libraries_detached_total": "libraries_detached",
    "kvtrace_flight_dumps_total": "flight_dumps",
    "kvtrace_flight_dump_failures_total": "flight_dump_failures",
}


# ---- label values ----

def metric_title(title: str, max_chars: int = TITLE_MAX_CHARS) -> str:
    """A process title fit for a label: secrets redacted, control characters gone, cut short."""
    title = redact_title(title)  # the same redaction as the API's group socket
    if len(title) > max_chars:
        title = title[:max_chars - 3].rstrip() + "..."
    return title


def kept_gpus(totals: Mapping[TotalsKey, tuple[int, int]]) -> dict[int, set[int]]:
    """Each process's GPUs that get a label of their own: its GPU_LABELS_PER_PROCESS largest by bytes."""
    by_pid: dict[int, dict[int, int]] = {}
    for key, (size_bytes, _) in totals.items():
        devices = by_pid.setdefault(key.pid, {})
        devices[key.device] = devices.get(key.device, 0) + size_bytes
    return {pid: {device for _, device in sorted(((-size, device) for device, size in devices.items()))
                  [:GPU_LABELS_PER_PROCESS]}
            for pid, devices in by_pid.items()}


def gpu_label(device: int) -> str:
    return "unknown" if device == DEVICE_UNKNOWN or device < 0 else str(device)


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


# ---- the collector ----

class KvtraceCollector:
    """Builds every kvtrace_* sample from the agent's state and analysis at scrape time.

    A part that fails (a read raised) is left out of that scrape and reported as
    kvtrace_component_up{component="exporter"} 0, so a broken part never fails the whole scrape.
    """

    def __init__(self, state: AgentState, analysis: AgentAnalysis, version: str = __version__) -> None:
        self.state = state
        self.analysis = analysis
        self.version = version
        self._map_users = UserLabels()  # users refused by the kernel's shares (ledger, totals), named for good
        self._map_users_lock = threading.Lock()

    def describe(self) -> Iterable[Metric]:
        return [self._family(spec.name) for spec in METRICS]

    @staticmethod
    def _family(name: str) -> GaugeMetricFamily | CounterMetricFamily:
        spec = _SPECS[name]
        kind = CounterMetricFamily if spec.type == "counter" else GaugeMetricFamily
        return kind(spec.name, spec.help, labels=spec.labels)

    def collect(self) -> Iterator[Metric]:
        families = {spec.name: self._family(spec.name) for spec in METRICS}
        failed: list[str] = []

        def read(what: str, call: Callable[[], Any], default: Any) -> Any:
            try:
                return call()
            except Exception:  # a scrape must not die of one broken part
                log.warning("metrics: reading %s failed", what, exc_info=True)
                failed.append(what)
                return default

        snapshot: AnalysisSnapshot | None = read("snapshot", lambda: self.analysis.latest, None)
        ledger: LedgerCounts | None = read("ledger", self.state.ledger_counts, None)
        counters: Mapping[str, int] = read("counters", self.state.counters, {})
        raw_titles: Mapping[int, str] = read("process titles", self.state.process_titles, {})
        components = {c.name: c.up for c in read("components", self.state.components, [])}
        depths: Mapping[int, ProcessDepth] = read("depths", lambda: self.state.process_depths(), {})

        live = set(raw_titles)
        if ledger is not None:
            live.update(key.pid for key in ledger.totals)
        if snapshot is not None:
            live.update(process.pid for process in snapshot.processes)
            live.update(suspect.pid for suspect in snapshot.suspects)
            live.update(engine.engine_pid for engine in snapshot.vllm_engines)
        fallback: dict[int, str] = {}
        if snapshot is not None:
            fallback = {item.pid: item.title for item in snapshot.processes}
            fallback.update({item.pid: item.title for item in snapshot.suspects})
            fallback.update({engine.engine_pid: engine.title for engine in snapshot.vllm_engines})
        titles: dict[int, str] = {}

        def title(pid: int) -> str:
            if pid not in titles:
                titles[pid] = metric_title(raw_titles.get(pid) or fallback.get(pid, ""))
            return titles[pid]

        kept_gpus: dict[int, set[int]] = {}
        if ledger is not None:
            kept_gpus = self._ledger(families, ledger, live, title)
        if snapshot is not None:
            self._snapshot(families, snapshot, title, kept_gpus)
            self._vllm(families, snapshot, title)
        for pid in sorted(depths):
            if pid in live:
                depth = depths[pid]
                families["kvtrace_process_depth"].add_metric([str(pid), title(pid)], int(depth.depth))
                families["kvtrace_process_depth_start_time_seconds"].add_metric(
                    [str(pid), title(pid)], depth.since_ns / 1e9)
        for name, key in _SESSION_COUNTERS.items():
            if key in counters:
                families[name].add_metric([], counters[key])
        refused = families["kvtrace_share_refused_total"]
        for key, value in sorted(counters.items()):
            if key.startswith(SHARE_COUNTER_PREFIX):  # "<resource>/<user>": bounded by model/user_shares.py
                refused.add_metric(key[len(SHARE_COUNTER_PREFIX):].split("/", 1), value)
        calls = families["kvtrace_crosscheck_calls_total"]
        for (api, result), value in sorted(read("cross-check", lambda: self.state.cross_check_totals(), {}).items()):
            calls.add_metric([_api_name(api), result], value)
        tracers: dict[str, int] = {}
        for check in read("CUPTI tracers", lambda: self.state.cross_checks(), []):
            tracers[check.status.state] = tracers.get(check.status.state, 0) + 1
        for state_name in sorted(tracers):
            families["kvtrace_cupti_traced_processes"].add_metric([state_name], tracers[state_name])

        self._shares(families, read("shares", lambda: self.state.shares(), []))
        up = families["kvtrace_component_up"]
        components.setdefault("analysis", False)  # none has run yet
        components["exporter"] = not failed
        for name in sorted(components):
            up.add_metric([name], 1.0 if components[name] else 0.0)
        families["kvtrace_build_info"].add_metric([self.version], 1.0)
        yield from families.values()

    @staticmethod
    def _ledger(families, ledger: LedgerCounts, live: set[int], title) -> dict[int, set[int]]:
        """The totals' samples; returns the GPUs of each process that have labels of their own (the rest are
        summed as gpu="other": GPU_LABELS_PER_PROCESS)."""
        outstanding_bytes = families["kvtrace_outstanding_bytes"]
        outstanding_objects = families["kvtrace_outstanding_objects"]
        kept = kept_gpus(ledger.totals)
        samples: dict[tuple[str, ...], list[int]] = {}
        for key in sorted(ledger.totals):
            size_bytes, count = ledger.totals[key]
            gpu = gpu_label(key.device) if key.device in kept[key.pid] else OTHER
            sample = samples.setdefault((str(key.pid), title(key.pid), gpu, Layer(key.layer).name.lower(),
                                         Memory(key.memory).name.lower()), [0, 0])
            sample[0] += size_bytes
            sample[1] += count
        for labels, (size_bytes, count) in samples.items():
            outstanding_bytes.add_metric(list(labels), size_bytes)
            outstanding_objects.add_metric(list(labels), count)
        for name, counter in (("kvtrace_allocations_total", ledger.allocations_total),
                              ("kvtrace_frees_total", ledger.frees_total)):
            family = families[name]
            for (pid, layer), value in sorted(counter.items()):
                if pid in live:
                    family.add_metric([str(pid), title(pid), Layer(layer).name.lower()], value)
        failures = families["kvtrace_allocation_failures_total"]
        by_api: dict[int, list[tuple[int, int]]] = {}
        for (failed_api, error_code), value in ledger.failures_total.items():
            by_api.setdefault(failed_api, []).append((value, error_code))
        for api in sorted(by_api):
            ranked = sorted(by_api[api], key=lambda item: (-item[0], item[1]))
            for value, error_code in sorted(ranked[:ERROR_CODE_LABELS_PER_API], key=lambda item: item[1]):
                failures.add_metric([_api_name(api), str(error_code)], value)
            if len(ranked) > ERROR_CODE_LABELS_PER_API:
                rest = sum(value for value, _ in ranked[ERROR_CODE_LABELS_PER_API:])
                failures.add_metric([_api_name(api), OTHER], rest)
        return kept

    def _shares(self, families, parties: list[PartyShare]) -> None:
        """The kernel's refusals per user (each user's record counts its own, only growing), labelled by
        UserLabels: a user keeps its label for good, so no series vanishes and "other" never goes down."""
        refused = families["kvtrace_share_refused_total"]
        sums: dict[str, list[int]] = {}
        with self._map_users_lock:
            # New users in one scrape are named most refused first, then by uid: the same whoever scrapes.
            for party in sorted((party for party in parties if party.pid == 0 and party.refused),
                                key=lambda party: (-party.refused, party.uid)):
                sample = sums.setdefault(self._map_users(party.uid), [0, 0])
                sample[0] += party.refused_entries
                sample[1] += party.refused_totals
        for user in sorted(sums, key=lambda user: (user == OTHER_USER, user)):
            refused.add_metric(["ledger", user], sums[user][0])
            refused.add_metric(["totals", user], sums[user][1])

    @staticmethod
    def _snapshot(families, snapshot: AnalysisSnapshot, title, kept: Mapping[int, set[int]]) -> None:
        def labelled(pid: int, device: int) -> bool:  # a GPU of the process's own label (GPU_LABELS_PER_PROCESS)
            return pid not in kept or device in kept[pid]

        growth = families["kvtrace_growth_bytes_per_second"]
        for process in snapshot.processes:
            if not labelled(process.pid, process.device):
                continue
            labels = [str(process.pid), title(process.pid), gpu_label(process.device)]
            for window, value in (("1m", process.growth_bytes_per_second_1m),
                                  ("15m", process.growth_bytes_per_second_15m)):
                if _finite(value):
                    growth.add_metric(labels + [window], value)
            ttoom = process.time_to_oom_seconds
            if ttoom is not None and math.isfinite(ttoom) and ttoom >= 0:
                families["kvtrace_time_to_oom_seconds"].add_metric(labels, ttoom)
            if process.unattributed_bytes is not None:
                families["kvtrace_unattributed_bytes"].add_metric(labels, process.unattributed_bytes)
            if process.nvml_used_bytes is not None:
                families["kvtrace_nvml_used_bytes"].add_metric(labels, process.nvml_used_bytes)
            allocator = process.fragmentation
            for role, size_bytes in sorted(process.role_bytes.items()):
                families["kvtrace_role_bytes"].add_metric(labels + [role.label], size_bytes)
            if allocator is not None:
                families["kvtrace_torch_reserved_bytes"].add_metric(labels, allocator.reserved_bytes)
                families["kvtrace_torch_allocated_bytes"].add_metric(labels, allocator.allocated_bytes)
                families["kvtrace_torch_largest_free_block_bytes"].add_metric(labels, allocator.largest_free_bytes)
                families["kvtrace_torch_fragmentation_ratio"].add_metric(labels, allocator.ratio)

        for gpu in snapshot.gpus:
            labels = [str(gpu.index), gpu.uuid]
            families["kvtrace_gpu_memory_total_bytes"].add_metric(labels, gpu.total_bytes)
            families["kvtrace_gpu_memory_used_bytes"].add_metric(labels, gpu.used_bytes)
            families["kvtrace_gpu_memory_free_bytes"].add_metric(labels, gpu.free_bytes)

        # 0 for every process the analyzer looked at, so "none" is a value rather than no data.
        suspects: dict[tuple[int, int], list[int]] = {(p.pid, p.device): [0, 0] for p in snapshot.processes}
        for suspect in snapshot.suspects:
            if suspect.growth_bytes_per_second <= 0:
                continue  # old but flat (weights, the KV cache): expected, not a leak shape
            group = suspects.setdefault((suspect.pid, suspect.device), [0, 0])
            group[0] += 1
            group[1] += suspect.outstanding_bytes
        for (pid, device), (count, size_bytes) in sorted(suspects.items()):
            if not labelled(pid, device):
                continue
            labels = [str(pid), title(pid), gpu_label(device)]
            families["kvtrace_leak_suspects"].add_metric(labels, count)
            families["kvtrace_leak_suspect_bytes"].add_metric(labels, size_bytes)


    @staticmethod
    def _vllm(families, snapshot: AnalysisSnapshot, title) -> None:
        """The vLLM engines' figures: each only where it is known (the plugin's need the plugin), so
        that "not known" is no data rather than a 0 that looks healthy."""
        findings: dict[int, set[FindingKind]] = {}
        for finding in snapshot.vllm_findings:
            findings.setdefault(finding.engine_pid, set()).add(finding.kind)
        for engine in sorted(snapshot.vllm_engines, key=lambda engine: engine.engine_pid):
            pid = engine.engine_pid
            labels = [str(pid), title(pid)]
            if engine.blocks_total is not None and engine.blocks_free is not None:
                families["kvtrace_vllm_kv_blocks"].add_metric(
                    labels + ["used"], max(0, engine.blocks_total - engine.blocks_free))
                families["kvtrace_vllm_kv_blocks"].add_metric(labels + ["free"], engine.blocks_free)
            usage = families["kvtrace_vllm_kv_cache_usage_ratio"]
            if engine.plugin and _finite(engine.kv_cache_usage_ratio):
                usage.add_metric(labels + ["plugin"], engine.kv_cache_usage_ratio)
            if _finite(engine.metrics_kv_cache_usage_ratio):
                usage.add_metric(labels + ["metrics"], engine.metrics_kv_cache_usage_ratio)
            for state, count in (("running", engine.requests_running), ("waiting", engine.requests_waiting)):
                if count is not None:
                    families["kvtrace_vllm_requests"].add_metric(labels + [state], count)
            if engine.plugin:
                families["kvtrace_vllm_blocks_held_after_finish"].add_metric(labels, engine.blocks_held_after_finish)
                families["kvtrace_vllm_block_allocations_per_second"].add_metric(
                    labels, engine.block_allocations_per_second)
                families["kvtrace_vllm_block_frees_per_second"].add_metric(labels, engine.block_frees_per_second)
            # Idle growth is measured only where something says whether requests run (the plugin or
            # /metrics), the sleep level only where something reports it: elsewhere, absent.
            known_running = engine.requests_running is not None
            for name, value in (("kvtrace_vllm_block_frees_per_allocation", engine.frees_per_allocation_1m),
                                ("kvtrace_vllm_free_blocks_ratio", engine.free_blocks_ratio),
                                ("kvtrace_vllm_idle_growth_bytes_per_second",
                                 engine.idle_growth_bytes_per_second if known_running else None)):
                if _finite(value):
                    families[name].add_metric(labels, value)
            if engine.plugin or engine.metrics_url:
                families["kvtrace_vllm_sleep_level"].add_metric(labels, engine.sleep_level)
            if engine.sleep_residual_bytes is not None:
                families["kvtrace_vllm_sleep_residual_bytes"].add_metric(labels, engine.sleep_residual_bytes)
            families["kvtrace_vllm_warming_up"].add_metric(labels, 1.0 if engine.warming_up else 0.0)
        # Every kind for every engine (0: not found), so that a finding that ends shows as 0, not as a
        # series that stops (a detector whose source is missing, e.g. no plugin, reads 0 too).
        pids = sorted({engine.engine_pid for engine in snapshot.vllm_engines} | set(findings))
        for pid in pids:
            for kind in FindingKind:
                if kind is not FindingKind.UNSPECIFIED:
                    families["kvtrace_vllm_finding"].add_metric(
                        [str(pid), title(pid), kind.label], 1.0 if kind in findings.get(pid, ()) else 0.0)


def _api_name(api: int) -> str:
    try:
        return Api(api).name
    except ValueError:
        return str(int(api))
