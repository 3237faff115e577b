"""The agent's composition root: which sources, analysis and servers run, and how they are wired.

    BpfSource ──────────┐                        ┌─▶ AgentServer (kvtrace.v1; its hub is a Session sink)
    NvmlSampler ────────┤                        │
    VllmListener ───────┤  (the vLLM plugin)     │
    VllmMetricsScraper ─┴─▶ Session ─▶ Analyzer ─┼─▶ MetricsServer (/metrics)
                              │                  └─▶ OtlpExporter (the same metrics, pushed over OTLP)
                              └─▶ JSON printer (--json-events)

`kvtrace agent` (cli/agent.py) parses and checks the flags into `DaemonOptions`; everything else
is decided here. The loop runs in the caller's thread: `run()` until `request_stop()`.
"""
from __future__ import annotations

import gc
import json
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import psutil

from kvtrace.analysis.analyzer import AnalysisOptions, Analyzer
from kvtrace.analysis.depth import DepthOptions, DepthPolicy
from kvtrace.config import ApiConfig
from kvtrace.errors import CommandError, ExitCode
from kvtrace.human import human_bytes
from kvtrace.model.depth import BlocksMode, Depth
from kvtrace.model.events import PHYSICAL_LAYERS, Event, Layer, Memory
from kvtrace.model.findings import AnalysisSnapshot
from kvtrace.model.gpus import NvmlSample
from kvtrace.model.ledger import LedgerResynced
from kvtrace.model.processes import ProcessTable
from kvtrace.reports.flight import FlightOptions
from kvtrace.session import Session
from kvtrace.sources.bpf.source import BpfOptions, BpfSource
from kvtrace.sources.nvml import read_cuda_visible_devices
from kvtrace.sources.vllm import protocol as vllm_protocol
from kvtrace.wire import event_to_json

if TYPE_CHECKING:  # imported when started: a host without them still runs the rest
    from kvtrace.reports.flight import FlightRecorder
    from kvtrace.reports.recorder import FileRecorder
    from kvtrace.servers.api.server import AgentServer
    from kvtrace.servers.otlp import OtlpExporter
    from kvtrace.servers.prometheus import MetricsServer
    from kvtrace.sources.cupti.listener import CuptiListener
    from kvtrace.sources.nvml import NvmlSampler
    from kvtrace.sources.vllm.listener import VllmListener
    from kvtrace.sources.vllm.metrics import VllmMetricsScraper

log = logging.getLogger(__name__)

SUMMARY_INTERVAL_SECONDS = 10.0
# What stopping may take, all servers together: systemd's stop and a person's Ctrl-C wait on it.
STOP_GRACE_SECONDS = 1.0
OFF_SWITCH_CHECK_SECONDS = 1.0
RETRY_TRACING_SECONDS = 60.0
# In /etc, not /run: a switch an operator set must survive a restart of the agent (systemd empties
# its RuntimeDirectory) and a reboot.
DEFAULT_OFF_SWITCH = "/etc/kvtrace/tracing-off"


@dataclass
class DaemonOptions:
    bpf: BpfOptions = field(default_factory=BpfOptions)
    api: ApiConfig | None = None  # None: no gRPC API (--no-api)
    json_events: bool = False
    nvml: bool = True
    analysis: AnalysisOptions = field(default_factory=AnalysisOptions)
    depth: DepthOptions = field(default_factory=DepthOptions)  # which processes have their blocks traced
    metrics_listen: str = ""  # "" : no /metrics
    metrics_allow_remote: bool = False
    otlp_endpoint: str = ""  # "": no OTLP push
    otlp_interval_seconds: float = 15.0
    # "on": the probes must load (else the agent exits); "auto": without them the agent serves NVML's
    # figures under the same names, the bpf component down with the reason; "off": NVML only.
    tracing: str = "on"
    tracing_unavailable: str = ""  # why the probes cannot load here (preflight), "" when they can
    # The kill switch: while this file exists the probes are out (NVML only); removed, they go in again.
    off_switch: str = ""
    # vLLM: the plugin's datagram socket ("" : off), /metrics URLs to scrape, and whether to find vLLM's
    # API servers in /proc and scrape theirs.
    vllm_socket: str = vllm_protocol.DEFAULT_SOCKET
    vllm_metrics_urls: tuple[str, ...] = ()
    vllm_discover: bool = True
    # Where `kvtrace run --agent` processes report CUPTI's view ("" : off; the agent's flag defaults to
    # /run/kvtrace-cupti/cupti.sock).
    cupti_socket: str = ""
    flight: FlightOptions | None = field(default_factory=FlightOptions)  # None: no flight recorder
    record: Path | None = None  # --record FILE
    record_max_bytes: int = 256 << 20
    record_keep: int = 4


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

    def publish_state(self, record: NvmlSample | LedgerResynced) -> None:
        pass  # the JSON stream has events only


class Daemon:
    def __init__(self, options: DaemonOptions, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> None:
        from kvtrace.sources import procfs
        from kvtrace.sources.native import NativeSymbolizer

        self.options = options
        self.out, self.err = out, err
        self.session = Session(ProcessTable(procfs.read_process), NativeSymbolizer())
        self.analyzer = Analyzer(self.session, options.analysis, visible_devices=read_cuda_visible_devices)
        self.depth = DepthPolicy(options.depth)
        self.source: BpfSource | None = None
        self.nvml: NvmlSampler | None = None
        self.server: AgentServer | None = None
        self.metrics: MetricsServer | None = None
        self.otlp: OtlpExporter | None = None
        self.vllm_listener: VllmListener | None = None
        self.vllm_metrics: VllmMetricsScraper | None = None
        self.cupti_listener: CuptiListener | None = None
        self.flight: FlightRecorder | None = None
        self.recorder: FileRecorder | None = None
        self._flight_dump_requested = False  # SIGUSR1: the loop dumps at its next turn
        self._stopping = threading.Event()
        self._tracing_impossible = False  # the probes could not load at start ("auto"): not tried again
        self._retry_at = 0.0  # monotonic: when to try again after the switch's re-enable failed

    def start(self) -> None:
        """Loads the probes and starts every part; raises CommandError with one line on failure."""
        if self.options.json_events:
            self.session.add_sink(JsonPrinter(self.session, self.out))
        self._start_recorders()
        if self.options.tracing == "off":
            self._tracing_down("tracing is off (--tracing off): NVML's figures only")
        elif self.options.tracing_unavailable:
            self._tracing_impossible = True
            self._tracing_down(f"cannot trace here: {self.options.tracing_unavailable}")
        elif self._switched_off():
            self._tracing_down(self._switched_off_reason())
        else:
            self._start_tracing(required=self.options.tracing == "on")
        if self.options.metrics_listen:
            from kvtrace.servers.prometheus import MetricsServer, MetricsSetupError

            try:
                self.metrics = MetricsServer(self.session, self.analyzer, self.options.metrics_listen,
                                             allow_remote=self.options.metrics_allow_remote)
                self.metrics.start()
            except MetricsSetupError as error:  # a bad address or a port in use: one clear line
                self.metrics = None
                raise CommandError(str(error), ExitCode.USAGE) from None
        if self.options.otlp_endpoint:
            from kvtrace.servers.otlp import OtlpExporter, OtlpSetupError

            try:
                self.otlp = OtlpExporter(self.session, self.analyzer, self.options.otlp_endpoint,
                                         self.options.otlp_interval_seconds, self.session.report_component)
            except OtlpSetupError as error:  # a bad URL or no opentelemetry: one clear line
                raise CommandError(str(error), ExitCode.USAGE) from None
            self.otlp.start()
        if self.options.nvml:
            from kvtrace.sources.nvml import NvmlSampler

            self.nvml = NvmlSampler(self.session)
            self.nvml.start()
        if self.options.api is not None:
            from kvtrace.servers.api.listeners import ServerSetupError
            from kvtrace.servers.api.server import AgentServer

            self.server = AgentServer(self.session, self.analyzer, self.options.api, flight=self.flight)
            try:
                self.server.start()
            except ServerSetupError as error:
                raise CommandError(str(error), ExitCode.FAILURE) from None
            self.session.add_sink(self.server.hub)
            # A stream that takes PyTorch blocks, coming or going, changes whether the probes send every block.
            self.server.hub.on_readers_changed = self.session.refresh_block_readers
        self._start_vllm()
        if self.options.cupti_socket:  # a socket that cannot be bound leaves the cupti component down, saying why
            from kvtrace.sources.cupti.listener import CuptiListener

            self.cupti_listener = CuptiListener(self.session, self.options.cupti_socket)
            self.cupti_listener.start()

    def _start_recorders(self) -> None:
        """The flight recorder (a dump directory that cannot be made leaves it down, with the reason)
        and --record's file (which must open: it was asked for)."""
        min_age = self.options.analysis.leak_min_age_seconds
        if self.options.flight is not None:
            from kvtrace.reports.flight import FlightRecorder

            flight = FlightRecorder(self.session, self.options.flight, min_age)
            try:
                flight.start()
                self.flight = flight
                self.session.report_component("flight_recorder", True)
            except OSError as error:
                reason = (f"cannot use {self.options.flight.directory} for dumps: {error.strerror} "
                          "(give a writable --flight-dir)")
                log.warning("flight recorder off: %s", reason)
                self.session.report_component("flight_recorder", False, reason)
        if self.options.record is not None:
            from kvtrace.reports.recorder import FileRecorder

            recorder = FileRecorder(self.session, self.options.record, min_age,
                                    self.options.record_max_bytes, self.options.record_keep)
            try:
                recorder.start()
            except OSError as error:
                raise CommandError(f"cannot record to {self.options.record}: {error.strerror}",
                                   ExitCode.USAGE) from None
            self.recorder = recorder
            self.session.report_component("recording", True)

    def request_flight_dump(self) -> None:
        """SIGUSR1: safe from a signal handler (the loop writes the dump)."""
        self._flight_dump_requested = True

    def _start_vllm(self) -> None:
        """The plugin's socket (in a directory of its own, /run/kvtrace-vllm by default, apart from the
        API's) and vLLM's /metrics. Neither stops the agent: a socket that cannot be bound leaves the
        vllm_plugin component down with the reason."""
        if self.options.vllm_socket:
            from kvtrace.sources.vllm.listener import VllmListener

            self.vllm_listener = VllmListener(self.session, self.options.vllm_socket)
            self.vllm_listener.start()
        if self.options.vllm_discover or self.options.vllm_metrics_urls:
            from kvtrace.sources.vllm.metrics import VllmMetricsScraper

            self.vllm_metrics = VllmMetricsScraper(self.session, self.options.vllm_metrics_urls,
                                                   discover=self.options.vllm_discover)
            self.vllm_metrics.start()

    # ---- tracing: on, off, and the kill switch ----

    def _start_tracing(self, required: bool, again: bool = False) -> None:
        """Loads the probes; `again`: switched back on, where a failure is retried a minute later."""
        source = BpfSource(self.session, self.options.bpf)
        try:
            source.start()
        except Exception as error:
            if required:
                raise CommandError(f"cannot load the BPF probes: {error} (run `kvtrace doctor`)",
                                   ExitCode.KERNEL) from error
            log.exception("cannot load the BPF probes: NVML's figures only")
            reason = f"cannot load the BPF probes: {error} (run `kvtrace doctor`)"
            if again:
                self._retry_at = time.monotonic() + RETRY_TRACING_SECONDS
            else:
                self._tracing_impossible = True
            self._tracing_down(reason)
            try:
                source.stop()
            except Exception:
                log.debug("stopping a half-started BPF source failed", exc_info=True)
            return
        self.source = source
        self.depth = DepthPolicy(self.options.depth)  # a new source raised nobody yet: every process starts afresh
        # Requests are taken from now, for the processes that can be raised (each analysis says it again).
        self.session.set_depth_refusal(_depth_refusal(source), source.deepenable_pids())
        self.session.set_cupti_witness(True)  # the probes see every process: CUPTI's events are compared

    def _wait_map_readers(self) -> None:
        """Before the probes go: the analyzer's site sample and a death's flight dump read the kernel's maps on
        threads of their own, and must not read them while they are closed (nor their descriptors once reused)."""
        if self.source is not None:
            self.source.hurry_readers()  # the site sample waits for no listing from now on
        if not self.analyzer.wait_site_sample(SITE_SAMPLE_STOP_SECONDS):
            log.warning("the site sample was still reading the ledger after %g s: the probes go all the same",
                        SITE_SAMPLE_STOP_SECONDS)
        if self.flight is not None and not self.flight.wait_reads(FLIGHT_READS_STOP_SECONDS):
            log.warning("flight dumps were still reading the ledger after %g s: the probes go all the same (those "
                        "dumps fail)", FLIGHT_READS_STOP_SECONDS)

    def _tracing_down(self, reason: str) -> None:
        self.session.report_component("bpf", False, reason)
        log.warning("%s", reason)

    def _switched_off(self) -> bool:
        return bool(self.options.off_switch) and os.path.exists(self.options.off_switch)

    def _switched_off_reason(self) -> str:
        return f"tracing switched off: {self.options.off_switch} exists (remove it to trace again)"

    def _check_off_switch(self) -> None:
        """Takes the probes out while the switch file exists, puts them back when it is gone."""
        if not self.options.off_switch or self.options.tracing == "off" or self._tracing_impossible:
            return
        if self._switched_off():
            if self.source is not None:
                self._wait_map_readers()
                self.source.stop()
                self.source = None
                self.session.set_cupti_witness(False)
                self.session.resync(())  # what was traced is no longer followed: no frozen figures
                self.session.report_libraries(())
                self._tracing_down(self._switched_off_reason())
        elif self.source is None and time.monotonic() >= self._retry_at:
            log.warning("tracing switched on again: %s is gone", self.options.off_switch)
            self._start_tracing(required=False, again=True)

    def announce(self) -> None:
        libraries = self.source.attached_libraries() if self.source else []
        filtered = ", filtered" if self.source is not None and self.source.filtering else ""
        api = self.options.api
        where = f", API on unix:{api.socket}" if self.server is not None and api else ""
        if where and api is not None and api.admin_path is not None:
            where += f" (redacted; full detail on unix:{api.admin_path})"
        if self.metrics is not None:
            print(f"Prometheus metrics on {self.metrics.url}", file=self.err, flush=True)
        if self.otlp is not None:
            print(f"OTLP metrics to {self.otlp.endpoint} every {self.otlp.interval_seconds:g} s",
                  file=self.err, flush=True)
        if self.source is None:
            down = {c.name: c.reason for c in self.session.components() if not c.up}
            print(f"Not tracing ({down.get('bpf', 'no probes')}): NVML's figures only{where}. "
                  "Hit Ctrl-C to end.", file=self.err, flush=True)
            return
        print(f"Tracing CUDA allocations ({len(libraries)} libraries attached{filtered}{where}). "
              "Hit Ctrl-C to end.", file=self.err, flush=True)

    def request_stop(self) -> None:
        """Ends `run()` at its next turn (at most ~0.11 s): safe from a signal handler."""
        self._stopping.set()

    def run(self) -> None:
        next_summary = time.monotonic() + SUMMARY_INTERVAL_SECONDS
        next_switch_check = time.monotonic()
        while not self._stopping.is_set():
            if self.source is not None:
                self.source.run_once(100)
            else:
                self._stopping.wait(0.1)
            if time.monotonic() >= next_switch_check:
                next_switch_check = time.monotonic() + OFF_SWITCH_CHECK_SECONDS
                self._check_off_switch()
            latest = self.analyzer.latest
            self.analyzer.tick()
            if self.analyzer.latest is not latest and self.analyzer.latest is not None:
                self._decide_depths(self.analyzer.latest)
            if self.flight is not None and self.analyzer.latest is not latest:
                self.flight.check(self.analyzer.latest)
                self.flight.expire()
            if self._flight_dump_requested:
                self._flight_dump_requested = False
                self._dump_on_signal()
            self.out.flush()
            if not self.options.json_events and time.monotonic() >= next_summary:
                next_summary += SUMMARY_INTERVAL_SECONDS
                self._summary()

    def _decide_depths(self, snapshot: AnalysisSnapshot) -> None:
        """Each process's depth after an analysis (analysis/depth.py), applied to the probes at once and
        published for reports; ended operator requests are forgotten. What is published is what the probes
        do: nothing while tracing is off, every process's blocks where only that is possible (a kept ledger),
        none where the probes cannot trace blocks, and only the processes the probes follow (-p, --cmdline)."""
        source = self.source
        if source is None:
            self.session.set_process_depths({})
            self.session.set_depth_refusal("tracing is off here: no probes to raise")
            return
        mode = source.blocks_mode
        self.depth.set_mode(mode)
        deepenable = source.deepenable_pids()
        self.session.set_depth_refusal(_depth_refusal(source), deepenable)
        requests = self.session.depth_requests()
        alive = {pid for pid in requests if psutil.pid_exists(pid)}
        alive |= {row.pid for row in snapshot.processes}
        started = {pid: int(info.start_time * 1e9) for pid, info in self.session.known_processes().items()
                   if info.start_time > 0}
        decided, ended = self.depth.decide(snapshot, requests, alive, started,
                                           None if mode is BlocksMode.NEVER else deepenable, source.pytorch_pids())
        depths = {pid: depth for pid, depth in decided.items() if source.follows(pid)}
        for pid in ended:
            self.session.forget_depth_request(pid)
        published = self.session.process_depths()  # the last decision's
        for pid, depth in depths.items():
            old = published[pid].depth if pid in published else Depth.SEGMENTS
            if old is not depth.depth:
                log.warning("pid %d: depth %s (%s%s)", pid, depth.depth.label, depth.cause.name.lower(),
                            f": {depth.detail}" if depth.detail else "")
        try:  # the probes first: a report that says a depth finds it applied
            source.set_block_depths({pid: depth.depth for pid, depth in depths.items()})
        except Exception:  # a library that would not take a link: said, and the loop goes on (tried again next tick)
            log.exception("applying the processes' depths to the probes failed")
        self.session.set_process_depths(depths)

    def _dump_on_signal(self) -> None:
        from kvtrace._proto.kvtrace.v1 import agent_service_pb2 as service_pb2
        from kvtrace.reports.flight import FlightDumpError

        if self.flight is None:
            log.warning("SIGUSR1: no flight recorder to dump (--no-flight-recorder, or its directory failed)")
            return
        # The dump is written on the recorder's thread, which logs where: this loop drains the probes' ring.
        try:
            self.flight.request_soon(service_pb2.FLIGHT_TRIGGER_KIND_SIGNAL, "SIGUSR1")
        except FlightDumpError as error:
            log.warning("SIGUSR1: %s", error)

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
        if self.otlp is not None:
            self.otlp.stop()  # one last export, at most otlp.STOP_SECONDS even if the collector hangs
        if self.nvml is not None:
            self.nvml.stop()
        if self.vllm_listener is not None:
            self.vllm_listener.stop()
        if self.vllm_metrics is not None:
            self.vllm_metrics.stop()
        if self.cupti_listener is not None:
            self.cupti_listener.stop()
        if self.source is not None:
            self._wait_map_readers()
            self.source.stop()
        if self.recorder is not None:
            self.recorder.stop()  # after the probes: the last events are in the file
        if self.flight is not None:
            self.flight.stop()

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


# The cyclic garbage collector's youngest generation, in allocations: Python's default (700) made it
# run ~150 times a second at 100 000 events/s, and with the flight recorder's ring (up to 100 000
# events) and the ledger alive, the older generations' passes walk all of them. Events, ledger entries
# and stacks are freed by their reference counts (they form no cycles), so a collection rarely finds
# anything: bench/api_throughput.py measured the difference (bench/RESULTS.md §J).
GC_YOUNG_ALLOCATIONS = 50_000
# How long a stop waits for a site sample that is reading the kernel's ledger (seconds for millions of entries).
SITE_SAMPLE_STOP_SECONDS = 10.0
# How long a stop (or the off switch) waits for deaths' flight dumps to read the kernel's ledger before the probes go.
FLIGHT_READS_STOP_SECONDS = 10.0


def _depth_refusal(source: BpfSource) -> str:
    """Why operators' depth requests are not honoured with these probes ("" : they are)."""
    mode = source.blocks_mode
    if mode is BlocksMode.AUTO:
        return ""
    if mode is BlocksMode.ALWAYS:
        return f"PyTorch blocks are traced in every process here (--blocks {mode.value})"
    return f"PyTorch blocks are not traced here: {source.torch_blocks_down}"


def tune_garbage_collector() -> None:
    """Once the agent is set up: what it made to start (bcc's program, the modules) is moved out of
    the collector's way for good (gc.freeze), and the youngest generation is collected less often."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_ALLOCATIONS, older, oldest)
