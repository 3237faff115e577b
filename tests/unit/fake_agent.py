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

from kvtrace._proto.kvtrace.v1 import events_pb2
from kvtrace.analysis.analyzer import Analyzer
from kvtrace.config import ApiConfig
from kvtrace.model.agent import AttachedLibrary
from kvtrace.model.events import Api, Event, EventsLost, Kind, Layer, Memory, ObjectKind, Source, StackStatus
from kvtrace.model.findings import AnalysisSnapshot
from kvtrace.model.ledger import ledger_view
from kvtrace.model.processes import ProcessInfo, ProcessTable
from kvtrace.servers.api.requests import ServerLimits
from kvtrace.servers.api.server import AgentServer
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


# One event of every kind (and of each API that fills a field of its own), for wire round trips.
ALL_KINDS = [
    event(),
    event(kind=Kind.FREE, api=Api.cudaFree, layer=Layer.RUNTIME, stack_id=3, stack_status=StackStatus.OK),
    event(kind=Kind.ALLOC_FAILED, api=Api.cudaMalloc, layer=Layer.RUNTIME, address=0, error_code=2),
    event(kind=Kind.FREE_FAILED, api=Api.cuMemFree_v2, error_code=1),
    event(kind=Kind.FREE_UNKNOWN, api=Api.cuMemFree_v2, size=0, device=-1),
    event(kind=Kind.MAP, api=Api.cuMemMap, layer=Layer.VMM, obj=ObjectKind.VMM_MAPPING, memory=Memory.NONE,
          handle=0x55),
    event(kind=Kind.UNMAP, api=Api.cuMemUnmap, layer=Layer.VMM, obj=ObjectKind.VMM_MAPPING,
          memory=Memory.NONE, freed_bytes=2 * MiB),
    event(kind=Kind.RELEASE, api=Api.cuMemRelease, layer=Layer.VMM, obj=ObjectKind.VMM_HANDLE),
    event(kind=Kind.SET_DEVICE, api=Api.cudaSetDevice, layer=Layer.RUNTIME, obj=None, memory=None, size=0,
          address=0, device=3, caller_address=0x401000),
    event(kind=Kind.SET_DEVICE, api=Api.cuCtxSetCurrent, layer=Layer.DRIVER, obj=None, memory=None, size=0,
          address=0xC0, device=1),
    event(kind=Kind.CONTEXT_DESTROY, api=Api.cuCtxDestroy_v2, obj=None, memory=None, size=0, address=0xC0,
          device=1),
    event(kind=Kind.PROCESS_EXIT, api=Api.process_exit, layer=None, obj=None, memory=None, size=0,
          address=0, device=-1, error_code=9 << 8, freed_bytes=3 * MiB),
    event(kind=Kind.ALLOC, api=Api.pytorch_malloc, layer=Layer.TORCH, obj=ObjectKind.BLOCK, stream=7, pid=300,
          title="python train.py", container="c0ffee", source=Source.CUPTI),
    # blocks under stack sampling at 512 KiB: one it chose (walked), one it passed over
    event(kind=Kind.ALLOC, api=Api.pytorch_malloc, layer=Layer.TORCH, obj=ObjectKind.BLOCK, size=16 << 10, stream=7,
          stack_id=3, stack_status=StackStatus.OK, sample_bytes=512 << 10),
    event(kind=Kind.ALLOC, api=Api.pytorch_malloc, layer=Layer.TORCH, obj=ObjectKind.BLOCK, size=16 << 10, stream=7,
          stack_status=StackStatus.NOT_SAMPLED, sample_bytes=512 << 10),
]


# StreamEvents requests and the indexes of stream_filter_events() each must give (messages or columns).
STREAM_FILTER_CASES = [
    ({}, [0, 1, 2, 3, 4, 5]),
    ({"pids": [100, 300]}, [0, 4]),
    ({"title_regex": "Worker_TP\\d$"}, [1, 2, 3, 5]),
    ({"kinds": [events_pb2.EVENT_KIND_FREE, events_pb2.EVENT_KIND_PROCESS_EXIT]}, [2, 5]),
    ({"layers": [events_pb2.LAYER_RUNTIME]}, [3, 5]),  # the exit has no layer: it passes
    ({"min_size_bytes": 2 * MiB}, [1, 5]),  # the exit has no size: it passes
    ({"pids": [200], "min_size_bytes": 2 * MiB}, [1, 5]),
]


def stream_filter_events() -> list[Event]:
    """Six events of three processes: sizes, kinds, layers and an exit, for the stream filters."""
    return [
        event(pid=100, address=0x10),
        event(pid=200, address=0x20, size=4 * MiB),
        event(pid=200, address=0x20, size=MiB, kind=Kind.FREE, api=Api.cuMemFree_v2),
        event(pid=200, address=0x30, api=Api.cudaMalloc, layer=Layer.RUNTIME),
        event(pid=300, address=0x40, size=1),
        event(pid=200, kind=Kind.PROCESS_EXIT, api=Api.process_exit, layer=None, obj=None, memory=None,
              size=0, address=0, device=-1),
    ]


def _process(pid: int) -> ProcessInfo | None:
    title = TITLES.get(pid)
    return ProcessInfo(pid, title, title[:15], "c0ffee" if pid == 300 else "", "", 0.0, time.monotonic()) \
        if title else None


LIBRARY = AttachedLibrary("/usr/lib/libcuda.so.1", 2049, 1234, ("cuMemAlloc_v2",), frozenset({200, 100}))


class FakeAgent:
    """The agent's real Session and Analyzer with no source: tests ingest synthetic events and NVML
    samples, and the servers read what they read in the agent. `hub` is the served API's."""

    def __init__(self, visible_devices=lambda pid: None, native_names=None) -> None:
        self.session = Session(ProcessTable(_process), native_names)
        self.analyzer = Analyzer(self.session, visible_devices=visible_devices)
        self.hub: EventHub | None = None  # set by served()
        self.session.report_libraries([LIBRARY])
        self.session.report_component("bpf", True)
        self.session.set_depth_refusal("")  # takes depth requests, as an agent with --blocks auto does

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
