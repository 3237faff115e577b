"""What the gRPC server needs from the agent: a small interface, so tests can serve a fake.

The real implementation is an adapter over `kvtrace.tracer.Tracer`. Every method except the hub's
publishing side is called from gRPC worker threads while the tracer thread keeps changing the
ledger, so each one must return a consistent copy, never a live view.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kvtrace.analysis.leaks import LeakReport
from kvtrace.model.findings import AnalysisSnapshot
from kvtrace.servers.hub import EventHub
from kvtrace.model.events import Layer, Memory
from kvtrace.model.ledger import Outstanding
from kvtrace.model.processes import ProcessInfo
from kvtrace.model.stacks import Stack
from kvtrace.tracer import AttachedLibrary


@dataclass(frozen=True)
class OutstandingTotal:
    """Outstanding memory of one process on one (device, layer, memory)."""

    device: int
    layer: Layer
    memory: Memory
    size_bytes: int
    object_count: int


@dataclass
class TrackedProcess:
    """A process holding traced memory. title/comm/container are "" once it is unreadable."""

    pid: int
    title: str = ""
    comm: str = ""
    container: str = ""
    totals: list[OutstandingTotal] = field(default_factory=list)


@dataclass(frozen=True)
class ComponentHealth:
    """Whether one part of the agent works; `reason` says why not."""

    name: str
    up: bool
    reason: str = ""


@dataclass
class AgentInfo:
    version: str
    kernel_release: str
    libraries: list[AttachedLibrary] = field(default_factory=list)
    components: list[ComponentHealth] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)


class AgentBackend(Protocol):
    """The agent as the server sees it."""

    hub: EventHub
    """Live events. The tracer thread publishes (`hub.publish` as a Tracer sink, and
    `hub.publish_kernel_loss(counters["events_lost"])` after each poll); streams subscribe."""

    def outstanding(self) -> list[Outstanding]:
        """Every live ledger entry, as a copy (the server sorts, filters and pages it).

        Called from gRPC threads while the tracer thread applies events: copy under a lock, or with
        `list(ledger)` (one C-level copy under the GIL); never hand out the ledger's dict.
        """
        ...

    def process(self, pid: int) -> ProcessInfo | None:
        """Title, comm and container of `pid`, or None if unknown. Called from gRPC threads, once
        per distinct pid of a snapshot page: answer from a cache (ProcessTable), not /proc each time."""
        ...

    def stack(self, stack_id: int) -> Stack | None:
        """The interned Python stack with this id (`StackTable.get`), None if unknown. Called from
        gRPC threads, once per stream and stack id; the table only grows, so a read needs no lock."""
        ...

    def processes(self) -> list[TrackedProcess]:
        """Processes holding traced objects, with their totals (from `Ledger.totals()`), as a copy.
        Called from gRPC threads."""
        ...

    def info(self) -> AgentInfo:
        """The agent's description and counters, as a copy. Called from gRPC threads."""
        ...

    def analysis(self) -> AnalysisSnapshot | None:
        """The latest analysis (growth, NVML, time-to-OOM, suspects at the default age), None before
        the first one. Called from gRPC threads: hand out the immutable snapshot, never build one."""
        ...

    def leak_suspects(self, pids: frozenset[int], min_age_seconds: float | None, limit: int) -> LeakReport:
        """Suspects of `pids` (empty: all) at least `min_age_seconds` old (None: the agent's
        threshold), ranked, cut to `limit`, with native callers resolved. Called from gRPC threads:
        copy the ledger under its lock, rank outside it."""
        ...

    def healthy(self) -> bool:
        """False while the event pipeline is stalled (health then says NOT_SERVING). Polled every
        second from the server's health thread: must be cheap and must not block."""
        ...
