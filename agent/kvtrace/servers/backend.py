"""What the servers read: the Session's state and the Analyzer's findings, as two small interfaces.

`kvtrace.session.Session` is the `AgentState` and `kvtrace.analysis.analyzer.Analyzer` the
`AgentAnalysis` of a running agent; tests serve the same real objects fed with synthetic events.
Every method is called from server threads while the agent loop keeps ingesting, so each returns a
consistent copy, never a live view, and must be quick.
"""
from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Protocol

from kvtrace.model.agent import AgentInfo, ComponentStatus, PartyShare, TrackedProcess
from kvtrace.model.crosscheck import ProcessCrossCheck
from kvtrace.model.depth import DepthRequest, ProcessDepth
from kvtrace.model.events import Api
from kvtrace.model.findings import AnalysisSnapshot, LeakReport
from kvtrace.model.ledger import LedgerCounts, Outstanding, RowBatch
from kvtrace.model.processes import ProcessInfo
from kvtrace.model.stacks import NativeFrame, Stack

if TYPE_CHECKING:
    from kvtrace.analysis.analyzer import AnalysisOptions
    from kvtrace.session import SessionCheckpoint, Sink


class AgentState(Protocol):
    """The agent's state as the servers see it (kvtrace.session.Session)."""

    def outstanding(self, pids: Collection[int] = ()) -> Iterable[Outstanding]:
        """Every live ledger entry, as a copy (the server sorts, filters and pages it)."""
        ...

    def outstanding_batches(self, pids: Collection[int] = ()) -> Iterable[RowBatch]:
        """outstanding(pids) in batches of rows in columns (model.ledger.RowBatch), of `pids` only: what a
        listing in columns reads."""
        ...

    def process(self, pid: int) -> ProcessInfo | None:
        """Title, comm and container of `pid` from the cache, None if unknown."""
        ...

    def stack(self, stack_id: int) -> Stack | None:
        """The interned Python stack with this id, None if unknown."""
        ...

    def native_caller(self, pid: int, address: int) -> NativeFrame | None:
        """(module, symbol, offset) of the native code at `address` in `pid`; None where nothing names it."""
        ...

    def processes_holding_memory(self) -> list[TrackedProcess]:
        """Processes holding traced objects, with their totals."""
        ...

    def info(self) -> AgentInfo:
        """Version, attached libraries, component health and counters."""
        ...

    def healthy(self) -> bool:
        """False while the event pipeline is stalled (health then says NOT_SERVING); polled every
        second: must not block."""
        ...

    def components(self) -> list[ComponentStatus]:
        """Each component's health, computed once for every server."""
        ...

    def ledger_counts(self) -> LedgerCounts:
        """Ledger totals and counters, copied consistently."""
        ...

    def counters(self) -> dict[str, int]:
        """events_submitted, events_lost, ledger_full, unknown_frees, events_seen, resyncs, ..."""
        ...

    def report_counters(self, counters: dict[str, int]) -> None:
        """The API's own counters (streams refused and evicted, users at their share), beside the sources'."""
        ...

    def report_component(self, name: str, up: bool, reason: str = "") -> None:
        """The API's own health: up, and degraded for whom (a user at its share) in `reason`."""
        ...

    def shares(self) -> list[PartyShare]:
        """Users and processes refused because their share of a shared map was full (most refused first)."""
        ...

    def process_titles(self) -> dict[int, str]:
        """pid -> full process title of the processes the agent knows (alive)."""
        ...

    def wall_clock_ns(self) -> int:
        """The time the state stands at: now, or a replayed recording's time."""
        ...

    started_wall_seconds: float
    """When the agent started (memory allocated before then was never seen)."""

    def subscribe(self, sink: Sink) -> SessionCheckpoint:
        """Adds a sink, with a copy of the ledger taken at the same moment (a recording's start)."""
        ...

    def checkpoint_locked(self) -> SessionCheckpoint:
        """A copy of the ledger now; called by a sink, under the state's lock."""
        ...

    def remove_sink(self, sink: Sink) -> None: ...

    def cross_checks(self, pid: int | None = None) -> list[ProcessCrossCheck]:
        """The CUPTI tracers heard from (`kvtrace run`) and their agreement with the uprobes, as copies."""
        ...

    def cross_check_totals(self) -> dict[tuple[Api, str], int]:
        """(api, matched|uprobe_only|cupti_only|mismatched) -> calls compared so far, all processes."""
        ...

    def process_depths(self) -> dict[int, ProcessDepth]:
        """pid -> how closely each process the depth policy follows is traced, since when and why (a copy)."""
        ...

    def request_depth(self, request: DepthRequest) -> None:
        """An operator's request (SetProcessDepth), for the depth policy's next turn; SEGMENTS withdraws one."""
        ...

    def depth_requests(self) -> dict[int, DepthRequest]:
        """pid -> the operators' requests not yet ended (a copy)."""
        ...

    def depth_refusal(self, pid: int | None = None) -> str:
        """Why an operator's request (for `pid`, if given) would not be honoured now (--blocks always|never,
        PyTorch's allocator probes down, tracing off, a process without them); "" when it would."""
        ...


class AgentAnalysis(Protocol):
    """What analysis found (kvtrace.analysis.analyzer.Analyzer)."""

    options: AnalysisOptions
    """The thresholds analysis runs with (a recording's header keeps --leak-min-age)."""

    latest: AnalysisSnapshot | None
    """The latest analysis (growth, NVML, time-to-OOM, suspects at the default age), None before
    the first one: an immutable snapshot, replaced whole."""

    def leak_report(self, pids: Collection[int] = (), min_age_seconds: float | None = None,
                    limit: int | None = None, wall_ns: int | None = None) -> LeakReport:
        """Suspects of `pids` (empty: all) at least `min_age_seconds` old (None: the agent's
        threshold), ranked, cut to `limit`, with native callers named."""
        ...
