"""The depth policy: which processes have their PyTorch blocks traced, decided on evidence.

Every analysis snapshot, the policy looks at each process and raises it to BLOCKS when one of these
holds (the first that does is its cause), once the process is past its start-up
(`startup_grace_seconds` from its start and from the first time the policy saw it hold traced memory,
whichever is later: loading weights and the KV cache is growth too, and says nothing of a leak; an agent
that starts beside running processes waits that long too):

- VLLM: a vLLM detector fired for its engine (the finding's engine and worker processes; its
  detectors wait out the engine's start themselves, so no grace here);
- TIME_TO_OOM: the analysis forecasts its GPU out of memory within `time_to_oom_seconds`, and its
  traced bytes still grow over the last minute (a forecast from a start-up that has ended is no
  evidence);
- GROWTH: its traced physical bytes rose at least `growth_bytes` above their lowest within
  `window_seconds` (15 min: a fast leak shows within seconds, a slow one of a few MiB a minute within
  the window);
- UNEXPLAINED: what NVML says it uses, less what the probes traced, rose `unexplained_bytes` the
  same way.

It stays there until no evidence was seen for `quiet_seconds`, then goes back to SEGMENTS. An
operator's request (`kvtrace deep`) wins over evidence while it lasts; when it ends the evidence
decides again (a process raised on evidence stays raised through a request and after it). FULL is
only ever asked for. At most `max_raised` processes are held on evidence at once, the strongest
evidence first, so a host where everything grows at once pays a bounded cost.

A process is known by its pid and start time: one that takes a pid later starts afresh, and an
operator's request for the old one ends.

Pure: it reads snapshots and requests and returns decisions; the daemon applies them to the probes.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from kvtrace.analysis.growth import LONG_WINDOW_SECONDS
from kvtrace.model.depth import BlocksMode, Depth, DepthCause, DepthRequest, ProcessDepth
from kvtrace.model.findings import AnalysisSnapshot

NS_PER_SECOND = 1_000_000_000
MIB = 1 << 20

# The mean bytes between two block stacks at depth BLOCKS (--block-sample-bytes): bench/RESULTS.md §K.
DEFAULT_BLOCK_SAMPLE_BYTES = 512 << 10


@dataclass(frozen=True)
class DepthOptions:
    mode: BlocksMode = BlocksMode.AUTO
    sample_bytes: int = DEFAULT_BLOCK_SAMPLE_BYTES  # 0: every block's stack at BLOCKS too
    window_seconds: float = LONG_WINDOW_SECONDS
    growth_bytes: int = 64 * MIB
    unexplained_bytes: int = 256 * MIB
    time_to_oom_seconds: float = 3600.0
    startup_grace_seconds: float = 120.0
    quiet_seconds: float = 600.0
    max_raised: int = 16

    def __post_init__(self) -> None:
        for name in ("window_seconds", "time_to_oom_seconds", "quiet_seconds"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, not {getattr(self, name)}")
        if self.startup_grace_seconds < 0 or self.growth_bytes <= 0 or self.unexplained_bytes <= 0:
            raise ValueError("startup_grace_seconds must be >= 0, growth_bytes and unexplained_bytes > 0")
        if self.max_raised < 0:
            raise ValueError(f"max_raised must be >= 0, not {self.max_raised}")


@dataclass(frozen=True)
class _Evidence:
    cause: DepthCause
    detail: str
    strength: float  # for ranking under max_raised: the larger, the more it needs its blocks traced


@dataclass
class _Followed:
    """What the policy remembers of one process."""

    started_ns: int  # its start (or when the policy first saw it, where not known): its identity with the pid
    seen_ns: int = 0  # when the policy first saw it hold traced memory (its CUDA start, or the agent's)
    traced: deque[tuple[int, int]] = field(default_factory=deque)       # (wall ns, traced bytes)
    unexplained: deque[tuple[int, int]] = field(default_factory=deque)  # (wall ns, NVML used - traced)
    evidence_ns: int = 0  # the last time evidence held (0: never)
    evidence: _Evidence | None = None  # the evidence that raised it (kept while it is held)
    depth: ProcessDepth | None = None  # the last decision


def _gained(series: deque[tuple[int, int]], now_ns: int, value: int, window_ns: int) -> int:
    """Adds (now, value) and returns how much the value rose above its lowest within the window."""
    series.append((now_ns, value))
    while series and series[0][0] < now_ns - window_ns:
        series.popleft()
    return value - min(v for _, v in series)


def _wall_time(ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ns / NS_PER_SECOND))


class DepthPolicy:
    def __init__(self, options: DepthOptions = DepthOptions()) -> None:
        self.options = options
        self.mode = options.mode  # what the agent can do (the daemon lowers it: no probes, a kept ledger)
        self._followed: dict[int, _Followed] = {}

    def set_mode(self, mode: BlocksMode) -> None:
        """What the probes really do: AUTO only where they can trace blocks per process."""
        self.mode = mode

    def decide(self, snapshot: AnalysisSnapshot, requests: Mapping[int, DepthRequest],
               alive: Collection[int] | None = None, started_ns: Mapping[int, int] | None = None,
               deepenable: Collection[int] | None = None,
               pytorch: Collection[int] = ()) -> tuple[dict[int, ProcessDepth], list[int]]:
        """Every followed process's depth after this snapshot, and the pids whose requests ended (their
        time ran out, their process is gone, or the pid is another process's now). `alive`: pids known to
        live (None: every pid the snapshot or a request names). `started_ns`: when processes started (wall
        clock); a process not in it is graced from when the policy first saw it. `deepenable`: the processes
        whose blocks can be traced at all (None: every one); the others stay at SEGMENTS, take no place under
        max_raised, and a request for one waits until it can be. Of those, the ones not in `pytorch` (that
        map no PyTorch allocator with probes) say NO_BLOCKS: their segments are their holders; the others say
        why their blocks cannot be traced."""
        now_ns = snapshot.timestamp_ns
        options = self.options
        started_ns = started_ns or {}
        traced: dict[int, int] = {}
        unexplained: dict[int, int] = {}
        ooming: dict[int, float] = {}
        for row in snapshot.processes:
            traced[row.pid] = traced.get(row.pid, 0) + row.outstanding_bytes
            if row.unattributed_bytes is not None:
                unexplained[row.pid] = unexplained.get(row.pid, 0) + row.unattributed_bytes
            if row.time_to_oom_seconds is not None and row.growth_bytes_per_second_1m > 0:
                ooming[row.pid] = min(ooming.get(row.pid, row.time_to_oom_seconds), row.time_to_oom_seconds)
        vllm: dict[int, str] = {}
        for finding in snapshot.vllm_findings:
            engine = next((e for e in snapshot.vllm_engines if e.engine_pid == finding.engine_pid), None)
            for pid in {finding.engine_pid, *(engine.worker_pids if engine else ())}:
                vllm.setdefault(pid, f"vLLM {finding.kind.name.lower()}: {finding.message}")
        seen = set(traced) | set(unexplained)
        live = seen | set(requests) if alive is None else set(alive)

        for pid in list(self._followed):
            followed = self._followed[pid]
            if pid not in seen and pid not in live or started_ns.get(pid, followed.started_ns) != followed.started_ns:
                del self._followed[pid]  # gone, or its pid is another process's now
        ended = [pid for pid, request in requests.items()
                 if request.until_ns <= now_ns or pid not in live
                 or request.process_started_ns and started_ns.get(pid, request.process_started_ns)
                 != request.process_started_ns]

        window_ns = int(options.window_seconds * NS_PER_SECOND)
        grace_ns = int(options.startup_grace_seconds * NS_PER_SECOND)
        for pid in seen:
            followed = self._followed.setdefault(pid, _Followed(started_ns.get(pid, now_ns)))
            followed.seen_ns = followed.seen_ns or now_ns
            # Settled once past its grace from its start and from its first traced memory: a process may import
            # for a minute before CUDA starts, and then load its weights.
            settled = now_ns - max(followed.started_ns, followed.seen_ns) >= grace_ns
            # The series start after the grace: a window that held the start-up would see its loading as growth.
            grew = _gained(followed.traced, now_ns, traced.get(pid, 0), window_ns) if settled else 0
            unexplained_grew = (_gained(followed.unexplained, now_ns, unexplained[pid], window_ns)
                                if settled and pid in unexplained else 0)
            found: _Evidence | None = None
            if pid in vllm:  # the detectors wait out an engine's start themselves
                found = _Evidence(DepthCause.VLLM, vllm[pid], float("inf"))
            elif not settled:
                continue
            elif pid in ooming and ooming[pid] <= options.time_to_oom_seconds:
                # Ranked above any growth: the sooner out of memory, the stronger.
                found = _Evidence(DepthCause.TIME_TO_OOM,
                                  f"out of GPU memory in {ooming[pid]:.0f} s at its growth rate",
                                  1e18 / max(ooming[pid], 1.0))
            elif grew >= options.growth_bytes:
                found = _Evidence(DepthCause.GROWTH,
                                  f"traced bytes +{grew / MIB:.0f} MiB within {options.window_seconds:g} s",
                                  float(grew))
            elif unexplained_grew >= options.unexplained_bytes:
                found = _Evidence(DepthCause.UNEXPLAINED,
                                  f"memory no probe explains +{unexplained_grew / MIB:.0f} MiB within "
                                  f"{options.window_seconds:g} s", float(unexplained_grew))
            if found is not None:
                followed.evidence_ns = now_ns
                # The evidence that raised it stays its reason while held; a stronger one is kept for ranking.
                if followed.evidence is None or found.strength > followed.evidence.strength:
                    kept = followed.evidence
                    followed.evidence = found if kept is None else _Evidence(kept.cause, kept.detail, found.strength)

        decided: dict[int, ProcessDepth] = {}
        if deepenable is not None:
            for pid in seen - set(deepenable):
                if pid in pytorch:
                    decided[pid] = self._decision(
                        pid, Depth.SEGMENTS, DepthCause.DEFAULT,
                        "its PyTorch allocator probes cannot be put in now (kvtrace doctor --pid says why)", now_ns, 0)
                else:
                    decided[pid] = self._decision(
                        pid, Depth.SEGMENTS, DepthCause.NO_BLOCKS,
                        "no PyTorch allocator probes in this process: its segments are its holders", now_ns, 0)
        if self.mode is not BlocksMode.AUTO:
            depth = Depth.SEGMENTS if self.mode is BlocksMode.NEVER else (
                Depth.FULL if options.sample_bytes == 0 else Depth.BLOCKS)
            for pid in seen - decided.keys():
                decided[pid] = self._decision(pid, depth, DepthCause.CONFIGURED, f"--blocks {self.mode.value}",
                                              now_ns, 0)
            return decided, ended

        quiet_ns = int(options.quiet_seconds * NS_PER_SECOND)
        asked = {pid: request for pid, request in requests.items() if pid not in ended}
        held: list[tuple[float, int]] = []
        for pid in seen:
            followed = self._followed[pid]
            if followed.evidence is not None and now_ns - followed.evidence_ns >= quiet_ns:
                followed.evidence = None  # quiet for long enough
            if followed.evidence is not None and pid not in asked and pid not in decided:
                held.append((followed.evidence.strength, pid))
        # The strongest evidence first; of equal strength, those already raised keep their place.
        held.sort(key=lambda item: (-item[0], not self._raised(item[1]), item[1]))
        for _, pid in held[:options.max_raised]:
            evidence = self._followed[pid].evidence
            assert evidence is not None
            decided[pid] = self._decision(pid, Depth.BLOCKS, evidence.cause, evidence.detail, now_ns, 0)
        for pid, request in asked.items():
            if deepenable is not None and pid not in deepenable:
                continue  # not yet (a process whose libraries are still being found): said as NO_BLOCKS above
            self._followed.setdefault(pid, _Followed(started_ns.get(pid, now_ns)))
            decided[pid] = self._decision(pid, request.depth, DepthCause.OPERATOR,
                                          f"asked for, until {_wall_time(request.until_ns)}", now_ns,
                                          request.until_ns)
        for pid in seen:
            if pid not in decided:
                decided[pid] = self._decision(pid, Depth.SEGMENTS, DepthCause.DEFAULT, "", now_ns, 0)
        return decided, ended

    def _raised(self, pid: int) -> bool:
        followed = self._followed.get(pid)
        return followed is not None and followed.depth is not None and followed.depth.depth >= Depth.BLOCKS

    def _decision(self, pid: int, depth: Depth, cause: DepthCause, detail: str, now_ns: int,
                  until_ns: int) -> ProcessDepth:
        """The decision, remembered. `since_ns` is when its blocks became known (BLOCKS and FULL alike: a
        change between the two keeps it), or when it went back to SEGMENTS."""
        followed = self._followed[pid]
        old = followed.depth
        kept = old is not None and (old.depth >= Depth.BLOCKS) == (depth >= Depth.BLOCKS)
        since = old.since_ns if old is not None and kept else now_ns
        sample = self.options.sample_bytes if depth is Depth.BLOCKS else 0
        followed.depth = ProcessDepth(pid, depth, since, cause, detail, until_ns, sample)
        return followed.depth
