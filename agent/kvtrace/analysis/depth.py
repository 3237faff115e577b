"""The depth policy: which processes have their PyTorch blocks traced, decided on evidence.

Every analysis snapshot, the policy looks at each process and raises it to BLOCKS when one of these
holds (the first that does is its cause):

- GROWTH: its traced physical bytes gained at least `growth_bytes` within `window_seconds` (after
  `startup_grace_seconds` from the process's start: loading weights and the KV cache is growth too,
  and says nothing of a leak);
- TIME_TO_OOM: the analysis forecasts its GPU out of memory within `time_to_oom_seconds`;
- UNEXPLAINED: what NVML says it uses, less what the probes traced, gained `unexplained_bytes` within
  the window (after the same grace);
- VLLM: a vLLM detector fired for its engine (the finding's engine and worker processes).

It stays there until no evidence was seen for `quiet_seconds`, then goes back to SEGMENTS. An
operator's request (`kvtrace deep`) wins over evidence until it ends; FULL is only ever asked for.
At most `max_raised` processes are raised on evidence at once (the ones with the most evidence
first), so a host where everything grows at once still pays a bounded cost.

Pure: it reads snapshots and requests and returns decisions; the daemon applies them to the probes.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from kvtrace.model.depth import BlocksMode, Depth, DepthCause, DepthRequest, ProcessDepth, segments_only
from kvtrace.model.findings import AnalysisSnapshot

NS_PER_SECOND = 1_000_000_000
MIB = 1 << 20

# The mean bytes between two block stacks at depth BLOCKS (--block-sample-bytes): bench/RESULTS.md §K.
DEFAULT_BLOCK_SAMPLE_BYTES = 512 << 10


@dataclass(frozen=True)
class DepthOptions:
    mode: BlocksMode = BlocksMode.AUTO
    sample_bytes: int = DEFAULT_BLOCK_SAMPLE_BYTES  # 0: every block's stack at BLOCKS too
    window_seconds: float = 60.0
    growth_bytes: int = 64 * MIB
    unexplained_bytes: int = 256 * MIB
    time_to_oom_seconds: float = 3600.0
    startup_grace_seconds: float = 120.0
    quiet_seconds: float = 600.0
    max_raised: int = 16
    operator_seconds: float = 600.0  # a request without a duration lasts this long

    def __post_init__(self) -> None:
        for name in ("window_seconds", "time_to_oom_seconds", "quiet_seconds", "operator_seconds"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, not {getattr(self, name)}")
        if self.startup_grace_seconds < 0 or self.growth_bytes <= 0 or self.unexplained_bytes <= 0:
            raise ValueError("startup_grace_seconds must be >= 0, growth_bytes and unexplained_bytes > 0")
        if self.max_raised < 0:
            raise ValueError(f"max_raised must be >= 0, not {self.max_raised}")


@dataclass
class _Followed:
    """What the policy remembers of one process."""

    first_seen_ns: int
    traced: deque[tuple[int, int]] = field(default_factory=deque)       # (wall ns, traced bytes)
    unexplained: deque[tuple[int, int]] = field(default_factory=deque)  # (wall ns, NVML used - traced)
    evidence_ns: int = 0  # the last time evidence held (0: never)


def _gained(series: deque[tuple[int, int]], now_ns: int, value: int, window_ns: int) -> int:
    """Adds (now, value) and returns how much the value rose above its lowest within the window."""
    series.append((now_ns, value))
    while series and series[0][0] < now_ns - window_ns:
        series.popleft()
    return value - min(v for _, v in series)


class DepthPolicy:
    def __init__(self, options: DepthOptions = DepthOptions()) -> None:
        self.options = options
        self._followed: dict[int, _Followed] = {}
        self._depths: dict[int, ProcessDepth] = {}

    def decide(self, snapshot: AnalysisSnapshot, requests: Mapping[int, DepthRequest],
               alive: Collection[int] | None = None,
               started_ns: Mapping[int, int] | None = None) -> tuple[dict[int, ProcessDepth], list[int]]:
        """Every followed process's depth after this snapshot, and the pids whose requests ended
        (their time ran out, or their process is gone). `alive`: pids known to live (None: every pid
        the snapshot or a request names). `started_ns`: when processes started (wall clock), for the
        start-up grace; a process not in it is graced from when the policy first saw it."""
        now_ns = snapshot.timestamp_ns
        options = self.options
        traced: dict[int, int] = {}
        unexplained: dict[int, int] = {}
        ooming: dict[int, float] = {}
        for row in snapshot.processes:
            traced[row.pid] = traced.get(row.pid, 0) + row.outstanding_bytes
            if row.unattributed_bytes is not None:
                unexplained[row.pid] = unexplained.get(row.pid, 0) + row.unattributed_bytes
            if row.time_to_oom_seconds is not None:
                ooming[row.pid] = min(ooming.get(row.pid, row.time_to_oom_seconds), row.time_to_oom_seconds)
        vllm: dict[int, str] = {}
        for finding in snapshot.vllm_findings:
            engine = next((e for e in snapshot.vllm_engines if e.engine_pid == finding.engine_pid), None)
            for pid in {finding.engine_pid, *(engine.worker_pids if engine else ())}:
                vllm.setdefault(pid, f"vLLM {finding.kind.name.lower()}: {finding.message}")
        seen = set(traced) | set(unexplained)
        live = seen | set(requests) if alive is None else set(alive)
        ended = [pid for pid, request in requests.items() if request.until_ns <= now_ns or pid not in live]

        for pid in [pid for pid in self._followed if pid not in seen and pid not in live]:
            del self._followed[pid]
        window_ns = int(options.window_seconds * NS_PER_SECOND)
        evidence: dict[int, tuple[DepthCause, str, float]] = {}  # pid -> cause, words, strength (for ranking)
        for pid in seen:
            followed = self._followed.setdefault(pid, _Followed((started_ns or {}).get(pid, now_ns)))
            settled = now_ns - followed.first_seen_ns >= options.startup_grace_seconds * NS_PER_SECOND
            grew = _gained(followed.traced, now_ns, traced.get(pid, 0), window_ns)
            unexplained_grew = (_gained(followed.unexplained, now_ns, unexplained[pid], window_ns)
                                if pid in unexplained else 0)
            found: tuple[DepthCause, str, float] | None = None
            if pid in vllm:
                found = (DepthCause.VLLM, vllm[pid], float("inf"))
            elif pid in ooming and ooming[pid] <= options.time_to_oom_seconds:
                # Ranked above any growth: the sooner out of memory, the stronger.
                found = (DepthCause.TIME_TO_OOM, f"out of GPU memory in {ooming[pid]:.0f} s at its growth rate",
                         1e18 / max(ooming[pid], 1.0))
            elif settled and grew >= options.growth_bytes:
                found = (DepthCause.GROWTH, f"traced bytes +{grew / MIB:.0f} MiB in {options.window_seconds:g} s",
                         float(grew))
            elif settled and unexplained_grew >= options.unexplained_bytes:
                found = (DepthCause.UNEXPLAINED,
                         f"memory no probe explains +{unexplained_grew / MIB:.0f} MiB in {options.window_seconds:g} s",
                         float(unexplained_grew))
            if found is not None:
                followed.evidence_ns = now_ns
                evidence[pid] = found

        decided: dict[int, ProcessDepth] = {}
        if options.mode is not BlocksMode.AUTO:
            depth = Depth.SEGMENTS if options.mode is BlocksMode.NEVER else (
                Depth.FULL if options.sample_bytes == 0 else Depth.BLOCKS)
            for pid in seen:
                old = self._depths.get(pid)
                since = old.since_ns if old is not None and old.depth is depth else now_ns
                decided[pid] = ProcessDepth(pid, depth, since, DepthCause.CONFIGURED, f"--blocks {options.mode.value}",
                                            sample_bytes=options.sample_bytes if depth is Depth.BLOCKS else 0)
            self._depths = decided
            return decided, ended

        quiet_ns = int(options.quiet_seconds * NS_PER_SECOND)
        # Held on evidence: raised now, or raised before and not yet quiet for long enough.
        held: list[tuple[float, int, DepthCause, str]] = []
        for pid in seen:
            old = self._depths.get(pid)
            if pid in evidence:
                cause, words, strength = evidence[pid]
                if old is not None and old.depth >= Depth.BLOCKS and old.cause not in (DepthCause.OPERATOR,
                                                                                       DepthCause.DEFAULT):
                    cause, words = old.cause, old.detail  # the evidence that raised it stays its reason
                held.append((strength, pid, cause, words))
            elif (old is not None and old.depth is Depth.BLOCKS and old.cause not in (DepthCause.OPERATOR,
                                                                                      DepthCause.DEFAULT)
                  and now_ns - self._followed[pid].evidence_ns < quiet_ns):
                held.append((0.0, pid, old.cause, old.detail))
        # The strongest evidence first; those already raised keep their place over newcomers of equal strength.
        held.sort(key=lambda item: (-item[0], item[1] not in self._depths or self._depths[item[1]].depth
                                    is Depth.SEGMENTS, item[1]))
        for _, pid, cause, words in held[:options.max_raised]:
            decided[pid] = self._keep(pid, Depth.BLOCKS, cause, words, now_ns, 0)
        for pid, request in requests.items():
            if pid in ended:
                continue
            until = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(request.until_ns / NS_PER_SECOND))
            detail = f"asked for, until {until}"
            decided[pid] = self._keep(pid, request.depth, DepthCause.OPERATOR, detail, now_ns, request.until_ns)
        for pid in seen:
            if pid not in decided:
                old = self._depths.get(pid)
                decided[pid] = old if old is not None and old.depth is Depth.SEGMENTS else segments_only(pid, now_ns)
        self._depths = decided
        return decided, ended

    def _keep(self, pid: int, depth: Depth, cause: DepthCause, detail: str, now_ns: int, until_ns: int) -> ProcessDepth:
        """The decision, keeping the time it reached this depth when it was there already."""
        old = self._depths.get(pid)
        since = old.since_ns if old is not None and old.depth is depth else now_ns
        sample = self.options.sample_bytes if depth is Depth.BLOCKS else 0
        return ProcessDepth(pid, depth, since, cause, detail, until_ns, sample)
