"""`kvtrace agent`: the daemon. Loads the probes, follows every CUDA process, keeps the ledger."""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import sys
import time

from kvtrace.errors import CommandError, ExitCode
from kvtrace.config import ConfigError, add_api_flags, config_from_args
from kvtrace.model.events import Event, Layer, Memory

EPILOG = """examples:
  kvtrace agent                      # trace every CUDA process on this host
  kvtrace agent --json-events        # one JSON object per event on stdout
  kvtrace agent -p 1234 --json-events
  kvtrace agent --cmdline 'VLLM::Worker' --json-events
"""

SUMMARY_INTERVAL_SECONDS = 10.0


def _json_printer(tracer, out):
    def print_json(event: Event) -> None:
        data = event.to_json_dict(tracer.stack_of(event), tracer.native_caller(event))
        out.write(json.dumps(data, separators=(",", ":"), ensure_ascii=False) + "\n")

    return print_json


def _serve(tracer, config, analyzer):
    from kvtrace.servers.api import AgentServer, ServerSetupError
    from kvtrace.servers.hub import EventHub
    from kvtrace.servers.tracer_backend import TracerBackend

    backend = TracerBackend(tracer, EventHub(), analyzer)
    server = AgentServer(backend, config)
    try:
        server.start()
    except ServerSetupError as error:
        raise CommandError(str(error), ExitCode.FAILURE) from None
    return server, backend


def human_bytes(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size} B"


class AgentCommand:
    """Run the kvtrace agent: trace CUDA device-memory allocations of every process on this host.

    Needs root (or CAP_BPF + CAP_PERFMON + CAP_SYS_PTRACE) and bcc. Runs in the foreground; stop it
    with Ctrl-C or SIGTERM.
    """

    EPILOG = EPILOG

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("-p", "--pid", type=int, action="append", default=[],
                            help="trace only this process id (repeatable)")
        parser.add_argument("--cmdline", metavar="REGEX",
                            help="trace only processes whose title (/proc/PID/cmdline) matches")
        parser.add_argument("--json-events", action="store_true",
                            help="print every event as one JSON object per line on stdout")
        parser.add_argument("--max-ledger-entries", type=int, default=1 << 20,
                            help="size of the in-kernel ledger (default: %(default)s)")
        parser.add_argument("--no-api", action="store_true",
                            help="do not serve the kvtrace.v1 gRPC API (with --json-events only)")
        parser.add_argument("--wakeup-events", metavar="N", type=int, default=512,
                            help="events a CPU hands over before it wakes the agent (default: %(default)s); "
                                 "the rest the agent takes every 0.1 s. 1 wakes it for every event: the "
                                 "lowest latency, and an interrupt in the traced thread per event")
        parser.add_argument("--no-python-stacks", action="store_true",
                            help="do not walk Python stacks in the probes")
        parser.add_argument("--nvml", action=argparse.BooleanOptionalAction, default=True,
                            help="sample GPU and per-process memory from NVML (default: on)")
        parser.add_argument("--leak-min-age", metavar="SECONDS", type=float, default=60.0,
                            help="allocations this old are leak suspects (default: %(default)g)")
        parser.add_argument("--site-sample-interval", metavar="SECONDS", type=float, default=10.0,
                            help="how often leak suspects and per-site growth are sampled; each sample "
                                 "reads every outstanding allocation (default: %(default)g)")
        parser.add_argument("--forecast-min-history", metavar="SECONDS", type=float, default=300.0,
                            help="forecast time-to-OOM only from this much history of a process "
                                 "(default: %(default)g; less reads the start-up as a leak)")
        add_api_flags(parser)
        from kvtrace.servers.prometheus import add_metrics_flags

        add_metrics_flags(parser)
        parser.add_argument("-v", "--verbose", action="store_true", help="log attach/detach details")
        parser.add_argument("--ebpf", action="store_true", help=argparse.SUPPRESS)

    def run(self, args: argparse.Namespace) -> int:
        from kvtrace.sources.bpf import abi

        if args.ebpf:
            print((abi.probes_dir() / "kvtrace.bpf.c").read_text())
            return ExitCode.OK
        if any(pid <= 0 for pid in args.pid):
            raise CommandError("--pid takes a positive process id", ExitCode.USAGE)
        missing = [pid for pid in args.pid if not os.path.exists(f"/proc/{pid}")]
        if missing:
            raise CommandError(f"no process {', '.join(map(str, missing))} here: -p follows running processes "
                               f"(of this pid namespace); use --cmdline for ones yet to start", ExitCode.USAGE)
        try:
            cmdline = re.compile(args.cmdline) if args.cmdline else None
        except re.error as error:
            raise CommandError(f"--cmdline is not a valid regular expression: {error}", ExitCode.USAGE)
        if not 1 <= args.wakeup_events <= 65536:
            raise CommandError("--wakeup-events takes 1 to 65536", ExitCode.USAGE)
        if args.max_ledger_entries < 1024:
            raise CommandError("--max-ledger-entries must be at least 1024", ExitCode.USAGE)
        if not 0 <= args.leak_min_age <= 365 * 24 * 3600:
            raise CommandError("--leak-min-age takes 0 to one year in seconds", ExitCode.USAGE)
        if not 0.1 <= args.site_sample_interval <= 3600:
            raise CommandError("--site-sample-interval takes 0.1 to 3600 seconds", ExitCode.USAGE)
        if not 0 <= args.forecast_min_history <= 24 * 3600:
            raise CommandError("--forecast-min-history takes 0 to 86400 seconds", ExitCode.USAGE)
        logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                            format="kvtrace: %(message)s", stream=sys.stderr)

        try:
            config = None if args.no_api else config_from_args(args)
        except ConfigError as error:
            raise CommandError(str(error), ExitCode.USAGE) from None

        from kvtrace.sources.bpf.preflight import require_tracing

        require_tracing()
        from kvtrace.sources.bpf.loader import ProbeSettings
        from kvtrace.tracer import Tracer, TracerOptions

        options = TracerOptions(pids=set(args.pid), cmdline=cmdline,
                                settings=ProbeSettings(max_ledger_entries=args.max_ledger_entries,
                                                       wakeup_events=args.wakeup_events),
                                python_stacks=not args.no_python_stacks)
        tracer = Tracer(options)
        if args.json_events:
            tracer.sinks.append(_json_printer(tracer, sys.stdout))
        try:
            tracer.start()
        except Exception as error:
            raise CommandError(f"cannot load the BPF probes: {error} (run `kvtrace doctor`)",
                               ExitCode.KERNEL) from error
        from kvtrace.analysis.analyzer import AnalysisOptions, Analyzer
        from kvtrace.sources.nvml import NvmlSampler

        from kvtrace.servers.prometheus import (MetricsSetupError, TracerMetricsSource,
                                               metrics_server_from_args)

        nvml = NvmlSampler() if args.nvml else None
        analyzer = Analyzer(AnalysisOptions(leak_min_age_seconds=args.leak_min_age,
                                            site_sample_seconds=args.site_sample_interval,
                                            forecast_min_history_seconds=args.forecast_min_history),
                            tracer.stacks, nvml)
        server = backend = metrics = None
        try:
            try:
                metrics = metrics_server_from_args(args, TracerMetricsSource(tracer, lambda: analyzer.latest))
                if metrics is not None:
                    metrics.start()
            except MetricsSetupError as error:  # a bad address or a port in use: one clear line
                metrics = None
                raise CommandError(str(error), ExitCode.USAGE) from None
            if nvml is not None:
                nvml.start()
            if config is not None:
                server, backend = _serve(tracer, config, analyzer)
            if metrics is not None:
                print(f"Prometheus metrics on {metrics.url}", file=sys.stderr, flush=True)
            self._loop(tracer, backend, args.json_events, server, analyzer)
        finally:
            sys.stdout.flush()
            if server is not None:
                server.stop(grace_seconds=5)
            if metrics is not None:
                metrics.stop()
            if nvml is not None:
                nvml.stop()
            tracer.stop()
        return ExitCode.OK

    def _loop(self, tracer, backend, json_events: bool, server, analyzer) -> None:
        stopping = []
        signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
        libraries = tracer.attached_libraries()
        where = f", API on unix:{server.config.socket}" if server is not None else ""
        print(f"Tracing CUDA allocations ({len(libraries)} libraries attached"
              f"{', filtered' if tracer.filtering else ''}{where}). Hit Ctrl-C to end.",
              file=sys.stderr, flush=True)
        next_summary = time.monotonic() + SUMMARY_INTERVAL_SECONDS
        try:
            while not stopping:
                tracer.run_once(100)
                if backend is not None:
                    backend.after_poll()
                analyzer.tick(tracer)
                sys.stdout.flush()
                if not json_events and time.monotonic() >= next_summary:
                    next_summary += SUMMARY_INTERVAL_SECONDS
                    self._summary(tracer)
        except KeyboardInterrupt:
            pass

    @staticmethod
    def _summary(tracer) -> None:
        counters = tracer.counters()
        pids = sorted(tracer.ledger.pids())
        print(f"{time.strftime('%H:%M:%S')} processes {len(pids)}  device "
              f"{human_bytes(tracer.ledger.physical_device_bytes())}  host pinned "
              f"{human_bytes(tracer.ledger.outstanding_bytes(memory=Memory.HOST, layers=(Layer.DRIVER,)))}  "
              f"events {counters['events_seen']}  lost {counters['events_lost']}",
              file=sys.stderr, flush=True)
