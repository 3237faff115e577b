"""A fake AgentBackend over a real Ledger, and a served agent on a temporary Unix socket.

Tests publish synthetic events through `FakeBackend.apply` (ledger + hub, as the tracer does) and
talk to the server with the real client; no root, no BPF.
"""
from __future__ import annotations

import contextlib
import dataclasses
import grp
import os
import shutil
import tempfile
import time
from pathlib import Path

from kvtrace.analysis.analyzer import Analyzer, ledger_view
from kvtrace.analysis.leaks import LeakReport
from kvtrace.model.findings import AnalysisSnapshot
from kvtrace.config import ApiConfig
from kvtrace.servers.backend import AgentInfo, ComponentHealth, OutstandingTotal, TrackedProcess
from kvtrace.servers.api import AgentServer, ServerLimits
from kvtrace.servers.hub import EventHub
from kvtrace.model.events import Api, Event, Kind, Layer, Memory, ObjectKind
from kvtrace.model.ledger import Ledger
from kvtrace.model.processes import ProcessInfo
from kvtrace.model.stacks import Stack, StackTable
from kvtrace.sources.nvml import NvmlSampler
from kvtrace.tracer import AttachedLibrary

MiB = 1 << 20
TITLES = {100: "VLLM::EngineCore", 200: "VLLM::Worker_TP0", 300: "python train.py"}


def event(kind=Kind.ALLOC, api=Api.cuMemAlloc_v2, pid=200, address=0x7F0000000000, size=MiB,
          layer=Layer.DRIVER, device=0, ts=1_700_000_000_000_000_000, obj=ObjectKind.ALLOCATION,
          memory=Memory.DEVICE, **fields) -> Event:
    return Event(kind=kind, api=api, pid=pid, tid=pid + 1, timestamp_ns=ts, layer=layer, object=obj,
                 memory=memory, size_bytes=size, address=address, device=device,
                 comm=TITLES.get(pid, "python")[:15], title=TITLES.get(pid, "python"), **fields)


class FakeBackend:
    def __init__(self, max_queued_events: int = 65536, nvml: NvmlSampler | None = None,
                 visible_devices=lambda pid: None) -> None:
        self.hub = EventHub(max_queued_events)
        self.ledger = Ledger()
        self.stacks = StackTable()
        self.analyzer = Analyzer(stacks=self.stacks, nvml=nvml, visible_devices=visible_devices)
        self.is_healthy = True
        self.wall_ns: int | None = None  # the clock of leak_suspects; None: time.time_ns()

    def apply(self, *events: Event) -> None:
        for item in events:
            self.ledger.apply(item)
            self.hub.publish(item)

    def outstanding(self):
        return list(self.ledger)

    def process(self, pid: int) -> ProcessInfo | None:
        title = TITLES.get(pid)
        return ProcessInfo(pid, title, title[:15], "c0ffee" if pid == 300 else "", "", 0.0, 0.0) if title else None

    def stack(self, stack_id: int) -> Stack | None:
        try:
            return self.stacks.get(stack_id)
        except KeyError:
            return None

    def processes(self) -> list[TrackedProcess]:
        processes: dict[int, TrackedProcess] = {}
        for key, (size_bytes, count) in self.ledger.totals().items():
            process = processes.setdefault(key.pid, TrackedProcess(key.pid, TITLES.get(key.pid, ""),
                                                                    TITLES.get(key.pid, "")[:15]))
            process.totals.append(OutstandingTotal(key.device, key.layer, key.memory, size_bytes, count))
        return list(processes.values())

    def info(self) -> AgentInfo:
        return AgentInfo(
            version="0.1.0", kernel_release="6.18.0-test",
            libraries=[AttachedLibrary("/usr/lib/libcuda.so.1", 2049, 1234, ["cuMemAlloc_v2"], {200, 100})],
            components=[ComponentHealth("bpf", True), ComponentHealth("nvml", False, "no GPU")],
            counters={"events_seen": 23, "events_lost": 0})

    def analyze(self, wall_ns: int, monotonic_ns: int) -> AnalysisSnapshot:
        """One analysis of the ledger at these times (the agent does this every second)."""
        return self.analyzer.update(ledger_view(self.ledger, wall_ns, monotonic_ns,
                                                titles=dict(TITLES)))

    def analysis(self) -> AnalysisSnapshot | None:
        return self.analyzer.latest

    def leak_suspects(self, pids, min_age_seconds, limit) -> LeakReport:
        wall_ns = self.wall_ns if self.wall_ns is not None else time.time_ns()
        report = self.analyzer.leak_report(list(self.ledger), wall_ns, dict(TITLES), min_age_seconds, pids)
        return dataclasses.replace(report, suspects=report.suspects[:limit])

    def healthy(self) -> bool:
        return self.is_healthy


def own_group() -> str:
    """A group the test user may give its files: its primary group (no root needed)."""
    return grp.getgrgid(os.getgid()).gr_name


@contextlib.contextmanager
def short_directory():
    """A temporary directory with a short path: a socket path must fit in 107 bytes."""
    directory = tempfile.mkdtemp(prefix="kvt", dir="/tmp")
    try:
        yield Path(directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def served(backend: FakeBackend | None = None, limits: ServerLimits = ServerLimits(), **config):
    """(server, backend) with the server listening on a fresh socket."""
    backend = backend or FakeBackend()
    with short_directory() as directory:
        settings = {"socket": directory / "run" / "kvtrace.sock", "group": own_group(), **config}
        server = AgentServer(backend, ApiConfig(**settings), limits)
        server.start()
        try:
            yield server, backend
        finally:
            server.stop(grace_seconds=0)
