"""What analysis hands to the servers (Prometheus, gRPC, `kvtrace top` / `leaks`).

One immutable snapshot, rebuilt on an interval by the analyzer in the agent; servers only read
the latest one. Growth and forecasts are per process and GPU; "suspect" is the honest word for an
allocation site whose memory is old and growing, not proof of a leak.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvtrace.model.blocks import Fragmentation
from kvtrace.model.gpus import GpuMemory
from kvtrace.model.stacks import NativeFrame, Stack
from kvtrace.model.vllm import Role, UntrustedSender, VllmEngine, VllmFinding


@dataclass(frozen=True)
class ProcessGpu:
    """One process on one GPU: what kvtrace traced, what NVML says, and where it is heading."""

    pid: int
    title: str
    device: int  # CUDA ordinal as traced (-1: unknown)
    outstanding_bytes: int  # traced physical device memory (driver + VMM layers)
    nvml_used_bytes: int | None  # NVML's per-process figure (None: not reported)
    unattributed_bytes: int | None  # nvml_used - outstanding: context, NCCL, memory older than the agent
    growth_bytes_per_second_1m: float
    growth_bytes_per_second_15m: float
    # At the 15 min growth rate against the GPU's free memory; None: not growing, no NVML figure,
    # or less than 5 min of history (mostly start-up then).
    time_to_oom_seconds: float | None
    allocations_1m: int  # of the whole process (all its GPUs): the ledger counts per process
    frees_1m: int
    free_ratio_1m: float | None  # frees / allocations over 1 min (None: no allocations)
    nvml_index: int | None = None  # the GPU in NVML's numbering (gpus[].index); None: not matched
    history_seconds: float = 0.0  # how much of the 15 min window the growth was measured over
    # PyTorch's allocator on this GPU, where its blocks are traced (None: not traced); measured at the
    # last site sample (model/blocks.py says how).
    fragmentation: Fragmentation | None = None
    # The process started before the agent: what it allocated before is in NVML's figure (and in
    # unattributed_bytes), never in the traced one.
    predates_agent: bool = False
    # outstanding_bytes by what they are for (analysis/roles.py), at the last site sample; empty until then.
    role_bytes: dict[Role, int] = field(default_factory=dict)


@dataclass(frozen=True)
class LeakSuspect:
    """Outstanding allocations older than the threshold, grouped by Python stack (or native caller)."""

    rank: int  # 1 = most suspicious
    pid: int
    title: str
    device: int
    stack_id: int  # 0: no Python stack (native_caller_address groups it instead)
    stack: Stack | None
    native_caller_address: int
    outstanding_bytes: int
    count: int
    oldest_age_seconds: float
    growth_bytes_per_second: float  # of this site's outstanding bytes over the last 15 min
    native_caller: NativeFrame | None = None  # the caller's module+symbol; set by ListLeakSuspects
    # outstanding_bytes and count are estimates from sampled blocks' stacks (analysis/leaks.py), not exact
    estimated: bool = False


@dataclass(frozen=True)
class AnalysisSnapshot:
    timestamp_ns: int
    gpus: tuple[GpuMemory, ...] = ()
    processes: tuple[ProcessGpu, ...] = ()
    suspects: tuple[LeakSuspect, ...] = ()
    nvml_timestamp_ns: int = 0  # when the NVML figures (gpus, nvml_used_bytes) were sampled; 0: none
    vllm_engines: tuple[VllmEngine, ...] = ()
    vllm_findings: tuple[VllmFinding, ...] = ()
    # Plugin senders kvtrace cannot tie to vLLM: kept apart, no engine, no finding (analysis/vllm.py).
    vllm_untrusted: tuple[UntrustedSender, ...] = ()


@dataclass(frozen=True)
class LeakReport:
    """The suspects of one moment, ranked, with how many allocations were looked at."""

    timestamp_ns: int  # wall clock of the ledger copy
    min_age_seconds: float
    allocations_considered: int  # outstanding device allocations of the selected processes
    suspect_allocations: int  # of those, at least min_age_seconds old
    suspects: tuple[LeakSuspect, ...]  # most suspicious first; possibly cut to a limit
    suspect_count: int  # suspects before any limit
