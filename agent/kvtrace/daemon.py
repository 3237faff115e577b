"""The agent's composition root: which sources, analysis and servers run, and how they are wired.

    BpfSource ─┐                        ┌─▶ AgentServer (kvtrace.v1; its hub is a Session sink)
    NvmlSampler ┴─▶ Session ─▶ Analyzer ┼─▶ MetricsServer (/metrics)
                         └─▶ JSON printer (--json-events)

`kvtrace agent` (cli/agent.py) parses and checks the flags into `DaemonOptions`; everything else
is decided here. The loop runs in the caller's thread: `run()` until `request_stop()`.
"""
from __future__ import annotations

import json
import logging
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TextIO

from kvtrace.analysis.analyzer import AnalysisOptions, Analyzer
from kvtrace.config import ApiConfig
from kvtrace.errors import CommandError, ExitCode
from kvtrace.human import human_bytes
from kvtrace.model.events import PHYSICAL_LAYERS, Event, Layer, Memory
from kvtrace.model.processes import ProcessTable
from kvtrace.session import Session
from kvtrace.sources.bpf.source import BpfOptions, BpfSource
from kvtrace.sources.nvml import read_cuda_visible_devices
from kvtrace.wire import event_to_json

if TYPE_CHECKING:  # imported when started: a host without them still runs the rest
    from kvtrace.servers.api import AgentServer
    from kvtrace.servers.prometheus import MetricsServer
    from kvtrace.sources.nvml import NvmlSampler

log = logging.getLogger(__name__)

SUMMARY_INTERVAL_SECONDS = 10.0
# What stopping may take, all servers together: systemd's stop and a person's Ctrl-C wait on it.
STOP_GRACE_SECONDS = 1.0


@dataclass
class DaemonOptions:
    bpf: BpfOptions = field(default_factory=BpfOptions)
    api: ApiConfig | None = None  # None: no gRPC API (--no-api)
    json_events: bool = False
    nvml: bool = True
    analysis: AnalysisOptions = field(default_factory=AnalysisOptions)
    metrics_listen: str = ""  # "" : no /metrics
    metrics_allow_remote: bool = False


class JsonPrinter:
    """--json-events: every event as one JSON object per line (a Session sink)."""

    def __init__(self, session: Session, out: TextIO) -> None:
        self.session = session
        self.out = out

    def publish(self, event: Event) -> None:
        data = event_to_json(event, self.session.stack(event.stack_id) if event.stack_id else None,
                             self.session.native_caller(event.pid, event.caller_address))
        self.out.write(json.dumps(data, separators=(",", ":"), ensure_ascii=False) + "\n")

    def publish_loss(self, lost_count: int) -> None:
        pass  # counted in kvtrace_events_lost_total and the summary; the JSON stream has no gap marker


class Daemon:
    def __init__(self, options: DaemonOptions, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> None:
        from kvtrace.sources import procfs
        from kvtrace.sources.native import NativeSymbolizer

        self.options = options
        self.out, self.err = out, err
        self.session = Session(ProcessTable(procfs.read_process), NativeSymbolizer())
        self.analyzer = Analyzer(self.session, options.analysis, visible_devices=read_cuda_visible_devices)
        self.source: BpfSource | None = None
        self.nvml: NvmlSampler | None = None
        self.server: AgentServer | None = None
        self.metrics: MetricsServer | None = None
        self._stopping = threading.Event()

    def start(self) -> None:
        """Loads the probes and starts every part; raises CommandError with one line on failure."""
        if self.options.json_events:
            self.session.add_sink(JsonPrinter(self.session, self.out))
        self.source = BpfSource(self.session, self.options.bpf)
        try:
            self.source.start()
        except Exception as error:
            raise CommandError(f"cannot load the BPF probes: {error} (run `kvtrace doctor`)",
                               ExitCode.KERNEL) from error
        if self.options.metrics_listen:
            from kvtrace.servers.prometheus import MetricsServer, MetricsSetupError

            try:
                self.metrics = MetricsServer(self.session, self.analyzer, self.options.metrics_listen,
                                             allow_remote=self.options.metrics_allow_remote)
                self.metrics.start()
            except MetricsSetupError as error:  # a bad address or a port in use: one clear line
                self.metrics = None
                raise CommandError(str(error), ExitCode.USAGE) from None
        if self.options.nvml:
            from kvtrace.sources.nvml import NvmlSampler

            self.nvml = NvmlSampler(self.session)
            self.nvml.start()
        if self.options.api is not None:
            from kvtrace.servers.api import AgentServer, ServerSetupError

            self.server = AgentServer(self.session, self.analyzer, self.options.api)
            try:
                self.server.start()
            except ServerSetupError as error:
                raise CommandError(str(error), ExitCode.FAILURE) from None
            self.session.add_sink(self.server.hub)

    def announce(self) -> None:
        libraries = self.source.attached_libraries() if self.source else []
        filtered = ", filtered" if self.source is not None and self.source.filtering else ""
        where = f", API on unix:{self.options.api.socket}" if self.server is not None and self.options.api else ""
        if self.metrics is not None:
            print(f"Prometheus metrics on {self.metrics.url}", file=self.err, flush=True)
        print(f"Tracing CUDA allocations ({len(libraries)} libraries attached{filtered}{where}). "
              "Hit Ctrl-C to end.", file=self.err, flush=True)

    def request_stop(self) -> None:
        """Ends `run()` at its next turn (at most 0.1 s): safe from a signal handler."""
        self._stopping.set()

    def run(self) -> None:
        assert self.source is not None, "start() first"
        next_summary = time.monotonic() + SUMMARY_INTERVAL_SECONDS
        while not self._stopping.is_set():
            self.source.run_once(100)
            self.analyzer.tick()
            self.out.flush()
            if not self.options.json_events and time.monotonic() >= next_summary:
                next_summary += SUMMARY_INTERVAL_SECONDS
                self._summary()

    def stop(self) -> None:
        """Stops every part, the servers first (clients are told at once), then the probes."""
        try:
            self.out.flush()
        except OSError:
            pass
        if self.server is not None:
            self.server.stop(grace_seconds=STOP_GRACE_SECONDS)
        if self.metrics is not None:
            self.metrics.stop()
        if self.nvml is not None:
            self.nvml.stop()
        if self.source is not None:
            self.source.stop()

    def _summary(self) -> None:
        counters = self.session.counters()
        processes = self.session.processes_holding_memory()
        device = sum(t.size_bytes for p in processes for t in p.totals
                     if t.layer in PHYSICAL_LAYERS and t.memory is Memory.DEVICE)
        pinned = sum(t.size_bytes for p in processes for t in p.totals
                     if t.layer is Layer.DRIVER and t.memory is Memory.HOST)
        print(f"{time.strftime('%H:%M:%S')} processes {len(processes)}  device {human_bytes(device)}  "
              f"host pinned {human_bytes(pinned)}  events {counters.get('events_seen', 0)}  "
              f"lost {counters.get('events_lost', 0)}", file=self.err, flush=True)
