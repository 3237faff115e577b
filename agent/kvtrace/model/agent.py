"""What the agent says about itself and the processes it traces: component health, attached
libraries, per-process totals. Sources report these to the Session; servers read them back."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvtrace.model.events import Layer, Memory


@dataclass(frozen=True)
class ComponentStatus:
    """Whether one part of the agent works (bpf, nvml, python_stacks, analysis, attach:PATH, ...);
    `reason` says why not."""

    name: str
    up: bool
    reason: str = ""


@dataclass(frozen=True, slots=True)
class PartyShare:
    """What one party (a user, pid 0, or one of its processes) holds of a map every process shares (the kernel's
    ledger, its totals, library slots) and what it was refused because its share was full
    (sources/bpf/shares.py says the rule)."""

    uid: int
    pid: int  # 0: the user's own record
    ledger_entries: int
    totals_keys: int
    refused_entries: int
    refused_totals: int

    @property
    def refused(self) -> int:
        return self.refused_entries + self.refused_totals


@dataclass(frozen=True)
class AttachedLibrary:
    """A file the probes are attached to, and the traced processes that map it."""

    path: str
    device: int
    inode: int
    symbols: tuple[str, ...]
    pids: frozenset[int]


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


@dataclass
class AgentInfo:
    version: str
    kernel_release: str
    libraries: list[AttachedLibrary] = field(default_factory=list)
    components: list[ComponentStatus] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)
