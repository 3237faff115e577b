"""The agent without its sources, and served on a temporary Unix socket.

Tests publish synthetic events through `FakeAgent.apply` (the Session's one entrance, as the BPF
source does) and talk to the server with the real client; no root, no BPF.
"""
from __future__ import annotations

import contextlib
import functools
import grp
import os
import shutil
import tempfile
import time
from pathlib import Path

from kvtrace.analysis.analyzer import Analyzer
from kvtrace.config import ApiConfig
from kvtrace.model.agent import AttachedLibrary
from kvtrace.model.events import Api, Event, EventsLost, Kind, Layer, Memory, ObjectKind
from kvtrace.model.findings import AnalysisSnapshot
from kvtrace.model.ledger import ledger_view
from kvtrace.model.processes import ProcessInfo, ProcessTable
from kvtrace.servers.api import AgentServer, ServerLimits
from kvtrace.servers.hub import EventHub
from kvtrace.session import Session

MiB = 1 << 20
TITLES = {100: "VLLM::EngineCore", 200: "VLLM::Worker_TP0", 300: "python train.py"}


def event(kind=Kind.ALLOC, api=Api.cuMemAlloc_v2, pid=200, address=0x7F0000000000, size=MiB,
          layer=Layer.DRIVER, device=0, ts=1_700_000_000_000_000_000, obj=ObjectKind.ALLOCATION,
          memory=Memory.DEVICE, **fields) -> Event:
    return Event(kind=kind, api=api, pid=pid, tid=pid + 1, timestamp_ns=ts, layer=layer, object=obj,
                 memory=memory, size_bytes=size, address=address, device=device,
                 comm=TITLES.get(pid, "python")[:15], **fields)


def _process(pid: int) -> ProcessInfo | None:
    title = TITLES.get(pid)
    return ProcessInfo(pid, title, title[:15], "c0ffee" if pid == 300 else "", "", 0.0, time.monotonic()) \
        if title else None


LIBRARY = AttachedLibrary("/usr/lib/libcuda.so.1", 2049, 1234, ("cuMemAlloc_v2",), frozenset({200, 100}))


class FakeAgent:
    """The agent's real Session and Analyzer with no source: tests ingest synthetic events and NVML
    samples, and the servers read what they read in the agent. `hub` is the served API's."""

    def __init__(self, visible_devices=lambda pid: None) -> None:
        self.session = Session(ProcessTable(_process))
        self.analyzer = Analyzer(self.session, visible_devices=visible_devices)
        self.hub: EventHub | None = None  # set by served()
        self.session.report_libraries([LIBRARY])
        self.session.report_component("bpf", True)

    @property
    def ledger(self):
        return self.session.ledger

    @property
    def stacks(self):
        return self.session.stacks

    def apply(self, *events: Event) -> None:
        self.session.ingest_many(events)

    def lose(self, count: int) -> None:
        """A source lost `count` events here (its ring buffer was full)."""
        self.session.ingest(EventsLost(count, time.time_ns()))

    def analyze(self, wall_ns: int, monotonic_ns: int) -> AnalysisSnapshot:
        """One analysis of the ledger at these times (the agent does this every second)."""
        return self.analyzer.update(ledger_view(self.ledger, wall_ns, monotonic_ns, titles=dict(TITLES)))

    def freeze_clock(self, wall_ns: int) -> None:
        """Leak reports judge ages at `wall_ns` instead of now."""
        self.analyzer.leak_report = functools.partial(self.analyzer.leak_report, wall_ns=wall_ns)

    def stall(self) -> None:
        """The event loop stops reporting (gRPC health: NOT_SERVING)."""
        self.session.report_component("bpf", False, "the event loop is stalled")


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
def served(agent: FakeAgent | None = None, limits: ServerLimits | None = None,
           max_queued_events: int | None = None, **config):
    """(server, agent) with the server listening on a fresh socket and fed by the agent's Session."""
    backend = agent or FakeAgent()
    with short_directory() as directory:
        settings = {"socket": directory / "run" / "kvtrace.sock", "group": own_group(), **config}
        server = AgentServer(backend.session, backend.analyzer, ApiConfig(**settings), limits or ServerLimits(),
                             max_queued_events=max_queued_events)
        backend.session.add_sink(server.hub)
        backend.hub = server.hub
        server.start()
        try:
            yield server, backend
        finally:
            server.stop(grace_seconds=0)
