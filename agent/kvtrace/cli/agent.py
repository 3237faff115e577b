"""`kvtrace agent`: parses and checks the agent's flags; kvtrace.daemon runs it."""
from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
from pathlib import Path

from kvtrace.analysis.analyzer import AnalysisOptions
from kvtrace.analysis.depth import DEFAULT_BLOCK_SAMPLE_BYTES, DepthOptions
from kvtrace.analysis.vllm import VllmOptions
from kvtrace.cli.flags import bounded, bounded_int, bounded_size, parse_size, positive_pid
from kvtrace.config import ApiConfig, ConfigError, add_api_flags, check_served_paths, config_from_args
from kvtrace.daemon import DEFAULT_OFF_SWITCH, DaemonOptions
from kvtrace.errors import CommandError, ExitCode
from kvtrace.model.depth import BlocksMode
from kvtrace.model.ledger import DEFAULT_MAX_READ_ENTRIES
from kvtrace.reports.flight import FlightOptions
from kvtrace.sources.bpf import abi
from kvtrace.sources.bpf.loader import ProbeSettings, block_sample_bytes_problem
from kvtrace.sources.cupti import protocol as cupti_protocol
from kvtrace.sources.vllm import protocol as vllm_protocol

EPILOG = """examples:
  kvtrace agent                      # trace every CUDA process on this host
  kvtrace agent --json-events        # one JSON object per event on stdout
  kvtrace agent -p 1234 --json-events
  kvtrace agent --cmdline 'VLLM::Worker' --json-events
  kvtrace agent --otlp-endpoint http://otel-collector:4317   # also push metrics over OTLP
  kvtrace agent --vllm-metrics-url http://10.0.0.5:8000/metrics   # a vLLM server discovery cannot reach
"""

MAX_LEDGER_ENTRIES = 1 << 26  # 64 Mi entries: gigabytes of kernel memory; far more and the kernel refuses the map
MAX_TOTALS = 1 << 22  # 4 Mi (process, GPU, layer, kind) totals: far more than any host has
DAY = 24 * 3600
WEEK = 7 * DAY
YEAR = 365 * DAY


def block_sample_size(text: str) -> int:
    """--block-sample-bytes: a size the probes can sample at (whole KiB in 16 bits, or 0)."""
    size = parse_size(text)
    if problem := block_sample_bytes_problem(size):
        raise argparse.ArgumentTypeError(f"{problem}, not {text!r}")
    return size


class AgentCommand:
    """Run the kvtrace agent: trace CUDA device-memory allocations of every process on this host.

    Needs root (or CAP_BPF + CAP_PERFMON + CAP_SYS_PTRACE) and bcc. Runs in the foreground; stop it
    with Ctrl-C or SIGTERM.
    """

    EPILOG = EPILOG

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("-p", "--pid", type=positive_pid, action="append", default=[],
                            help="trace only this process id (repeatable)")
        parser.add_argument("--cmdline", metavar="REGEX",
                            help="trace only processes whose title (/proc/PID/cmdline) matches")
        parser.add_argument("--json-events", action="store_true",
                            help="print every event as one JSON object per line on stdout")
        parser.add_argument("--max-ledger-entries", metavar="N", type=bounded_int(1024, MAX_LEDGER_ENTRIES),
                            default=1 << 20,
                            help="size of the in-kernel ledger; one user may hold a quarter of it, every user but "
                                 "root half, root three quarters (default: %(default)s)")
        parser.add_argument("--max-totals", metavar="N", type=bounded_int(1024, MAX_TOTALS),
                            default=abi.DEFAULT_MAX_TOTALS,
                            help="(process, GPU, layer, kind of memory) totals the kernel keeps of allocations "
                                 "and PyTorch blocks, under 100 bytes of kernel memory each; a few per process, "
                                 "shared as the ledger is (default: %(default)s)")
        parser.add_argument("--max-read-entries", metavar="N", type=bounded_int(1, MAX_LEDGER_ENTRIES),
                            default=DEFAULT_MAX_READ_ENTRIES,
                            help="allocations the agent may copy from the kernel's ledger at once, about 450 bytes "
                                 "of agent memory each: a recording's or flight dump's checkpoint, and the live "
                                 "PyTorch blocks nested for fragmentation. Beyond it these wait and are counted; "
                                 "snapshots, leak suspects and roles go through the kernel's entries without "
                                 "holding them (default: %(default)s)")
        parser.add_argument("--ledger-in-kernel", action=argparse.BooleanOptionalAction, default=True,
                            help="keep allocations and PyTorch blocks, and their totals, only in the kernel, where "
                                 "the probes change both as objects come and go: the agent's memory grows per "
                                 "process, not per allocation (about 7 MiB instead of 880 at 1 000 000 live), its "
                                 "totals are exact whatever events are lost, and reports read the entries from the "
                                 "kernel. --no-ledger-in-kernel also keeps every entry in the agent (default: "
                                 "in the kernel)")
        parser.add_argument("--per-process-probes-max", metavar="N", type=bounded_int(0, 65536), default=8,
                            help="with -p of at most N processes, probes go into those processes only and no "
                                 "other pays for them; with more, each library gets one set of probes shared by "
                                 "every process and filtered in the kernel, so attaching and detaching cost per "
                                 "library, not per library and process (default: %(default)s)")
        parser.add_argument("--no-api", action="store_true",
                            help="do not serve the kvtrace.v1 gRPC API (with --json-events only)")
        parser.add_argument("--wakeup-events", metavar="N", type=bounded_int(1, 65536), default=512,
                            help="events a CPU hands over before it wakes the agent (default: %(default)s); "
                                 "the rest the agent takes every 0.1 s. 1 wakes it for every event: the "
                                 "lowest latency, and an interrupt in the traced thread per event")
        parser.add_argument("--no-python-stacks", action="store_true",
                            help="do not walk Python stacks in the probes")
        parser.add_argument("--no-task-storage", action="store_true",
                            help="keep the probes' per-thread state (a call's arguments, its thread's device) in "
                                 "LRU hashes, as before Linux 6.2, instead of task storage")
        depth = DepthOptions()
        parser.add_argument("--blocks", choices=[mode.value for mode in BlocksMode], default=BlocksMode.AUTO.value,
                            help="PyTorch's caching allocator (its USDT probes pytorch:malloc/free: the blocks "
                                 "tensors hold inside the segments, and the stacks that hold them). auto "
                                 "(default): only in processes whose memory grows, is about to run out, or that "
                                 "an operator names (`kvtrace deep`), lowered after a quiet window; every other "
                                 "process pays nothing for them. always: in every process. never: nowhere")
        parser.add_argument("--no-torch-blocks", action="store_true", help="the same as --blocks never")
        parser.add_argument("--block-sample-bytes", metavar="SIZE", type=block_sample_size,
                            default=DEFAULT_BLOCK_SAMPLE_BYTES,
                            help="at depth blocks, one block stack per this many bytes of blocks on average (a "
                                 "block this large or larger always has its stack): bytes per stack are then "
                                 "estimates, the ledger stays exact. 0: every block's stack (default: 512KiB)")
        parser.add_argument("--deepen-growth", metavar="SIZE", type=bounded_size(1 << 20, 1 << 40),
                            default=depth.growth_bytes,
                            help="--blocks auto: a process whose traced bytes rise this much above their lowest of "
                                 "the last 15 minutes (after --deepen-grace-seconds) has its blocks traced "
                                 "(default: 64MiB)")
        parser.add_argument("--deepen-grace-seconds", metavar="SECONDS", type=bounded(0, DAY, "seconds"),
                            default=depth.startup_grace_seconds,
                            help="--blocks auto: a process's growth counts only once it has run, and held traced "
                                 "memory, this long (loading weights and the KV cache is growth too; default: "
                                 "%(default)g)")
        parser.add_argument("--deepen-quiet-seconds", metavar="SECONDS", type=bounded(10, WEEK, "seconds"),
                            default=depth.quiet_seconds,
                            help="--blocks auto: a process raised on evidence goes back to segments after this "
                                 "long without any (default: %(default)g)")
        parser.add_argument("--max-block-events-per-second", metavar="N",
                            type=bounded_int(0, 100_000_000, zero_means="no limit"), default=100_000,
                            help="PyTorch block events one process may send per second (default: %(default)s; "
                                 "0: no limit); beyond, blocks stay exact in the ledger, their events are "
                                 "counted as unsent and the ledger is resynced")
        parser.add_argument("--tracing", choices=("on", "auto", "off"), default="on",
                            help="on (default): exit with the reason when the probes cannot load here; auto "
                                 "(the packaged service and DaemonSet): serve NVML's figures under the same "
                                 "metric names instead, the bpf component down saying why; off: NVML only")
        parser.add_argument("--off-switch", metavar="FILE", default=DEFAULT_OFF_SWITCH,
                            help="while FILE exists the probes are out and only NVML is read; remove it to "
                                 "trace again, no restart (default: %(default)s; '' disables)")
        parser.add_argument("--max-libraries", metavar="N", type=bounded_int(1, 4096), default=64,
                            help="libraries with probes in at once (default: %(default)s). Any user can make "
                                 "new ones (a copy of libcudart is one); beyond, a library waits, counted "
                                 "(kvtrace_libraries_refused_total) and named in doctor, and one nobody "
                                 "maps loses its probes after a minute")
        parser.add_argument("--nvml", action=argparse.BooleanOptionalAction, default=True,
                            help="sample GPU and per-process memory from NVML (default: on)")
        parser.add_argument("--leak-min-age", metavar="SECONDS", type=bounded(0, YEAR, "seconds"), default=60.0,
                            help="allocations this old are leak suspects (default: %(default)g)")
        parser.add_argument("--site-sample-interval", metavar="SECONDS", type=bounded(0.1, 3600, "seconds"),
                            default=10.0,
                            help="how often leak suspects and per-site growth are sampled; each sample "
                                 "reads every outstanding allocation (default: %(default)g)")
        parser.add_argument("--forecast-min-history", metavar="SECONDS", type=bounded(0, DAY, "seconds"), default=300.0,
                            help="forecast time-to-OOM only from this much history of a process "
                                 "(default: %(default)g; less reads the start-up as a leak)")
        parser.add_argument("--vllm-socket", metavar="PATH|off", default=vllm_protocol.DEFAULT_SOCKET,
                            help="where the kvtrace vLLM plugin (opt-in: KVTRACE_VLLM_PLUGIN=1 in vLLM's "
                                 "environment) sends its KV-cache, request and sleep reports (default: "
                                 "%(default)s; off: none)")
        parser.add_argument("--cupti-socket", metavar="PATH|off", default=cupti_protocol.DEFAULT_AGENT_SOCKET,
                            help="where processes run under `kvtrace run --agent` report what CUPTI sees inside "
                                 "them, compared with the probes' (default: %(default)s; off: none)")
        parser.add_argument("--vllm-metrics-url", metavar="URL", action="append", default=[],
                            help="also scrape this vLLM /metrics, e.g. http://127.0.0.1:8000/metrics "
                                 "(repeatable); vLLM API servers in the agent's network namespace are found "
                                 "without it")
        parser.add_argument("--no-vllm-discovery", action="store_true",
                            help="do not look for vLLM API servers in /proc (scrape --vllm-metrics-url only)")
        defaults = VllmOptions()
        parser.add_argument("--vllm-held-seconds", metavar="SECONDS", type=bounded(0, DAY, "seconds"),
                            default=defaults.held_after_finish_seconds,
                            help="finished or aborted requests still holding KV blocks this long are reported "
                                 "(the abort-path leak; default: %(default)g)")
        parser.add_argument("--vllm-stuck-seconds", metavar="SECONDS", type=bounded(0, DAY, "seconds"),
                            default=defaults.stuck_usage_seconds,
                            help="KV usage above zero with no request running or waiting this long is reported "
                                 "(default: %(default)g)")
        parser.add_argument("--vllm-idle-growth", metavar="BYTES_PER_SECOND",
                            type=bounded(0, 1e12, "bytes per second", above=True),
                            default=defaults.idle_growth_bytes_per_second,
                            help="an engine's GPU memory growing faster than this with no request running is "
                                 "reported (default: %(default)g)")
        parser.add_argument("--vllm-cold-start-seconds", metavar="SECONDS", type=bounded(0, DAY, "seconds"),
                            default=defaults.cold_start_seconds,
                            help="after an engine starts (model load, profiling), growth is not reported for "
                                 "this long (default: %(default)g)")
        parser.add_argument("--record", metavar="FILE", type=Path,
                            help="record every event, stack, process and NVML round to FILE, rotated into "
                                 "FILE.1, FILE.2, ... (`kvtrace leaks --input FILE` reads it)")
        parser.add_argument("--record-max-size", metavar="SIZE", type=bounded_size(1 << 20, 1 << 40), default=256 << 20,
                            help="rotate the recording at this size (default: 256MiB)")
        parser.add_argument("--record-keep", metavar="N", type=bounded_int(0, 1000), default=4,
                            help="rotated recordings kept besides FILE (default: %(default)s)")
        add_flight_flags(parser)
        add_api_flags(parser)
        add_metrics_flags(parser)
        from kvtrace.servers.otlp import add_otlp_flags

        add_otlp_flags(parser)
        parser.add_argument("-v", "--verbose", action="store_true", help="log attach/detach details")
        parser.add_argument("--ebpf", action="store_true", help=argparse.SUPPRESS)

    def run(self, args: argparse.Namespace) -> int:
        if args.ebpf:
            from kvtrace.sources.bpf import abi

            print(abi.program_text())
            return ExitCode.OK
        options = self._options(args)
        logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                            format="kvtrace: %(message)s", stream=sys.stderr)
        if options.tracing != "off":
            from kvtrace.sources.bpf.preflight import require_tracing

            try:
                require_tracing()
            except CommandError as error:
                if options.tracing == "on":
                    raise
                options.tracing_unavailable = str(error)  # "auto": NVML only, said in health
        from kvtrace.daemon import Daemon, tune_garbage_collector

        daemon = Daemon(options)
        signal.signal(signal.SIGTERM, lambda *_: daemon.request_stop())
        signal.signal(signal.SIGUSR1, lambda *_: daemon.request_flight_dump())
        try:
            daemon.start()  # Ctrl-C here raises KeyboardInterrupt: stop what started
            # From now on both signals ask the loop to end (within 0.1 s). An exception raised by
            # the signal instead could land in bcc's ring-buffer callback, which swallows it.
            signal.signal(signal.SIGINT, lambda *_: daemon.request_stop())
            daemon.announce()
            tune_garbage_collector()  # the agent's process only (not a Daemon run in another program)
            daemon.run()
        except KeyboardInterrupt:
            pass
        finally:
            daemon.stop()
        return ExitCode.OK

    @staticmethod
    def _options(args: argparse.Namespace) -> DaemonOptions:
        """The checks argparse cannot make (each flag's own range is its type's: cli/flags.py), each mistake one
        line naming the flag and what it takes: processes that must exist, a regular expression, paths and
        listeners, sockets apart from each other."""
        missing = [pid for pid in args.pid if not os.path.exists(f"/proc/{pid}")]
        if missing:
            raise CommandError(f"no process {', '.join(map(str, missing))} here: -p follows running processes "
                               f"(of this pid namespace); use --cmdline for ones yet to start", ExitCode.USAGE)
        try:
            cmdline = re.compile(args.cmdline) if args.cmdline else None
        except re.error as error:
            raise CommandError(f"--cmdline is not a valid regular expression: {error}", ExitCode.USAGE) from None
        try:
            api = None if args.no_api else check_served_paths(config_from_args(args))
        except ConfigError as error:
            raise CommandError(str(error), ExitCode.USAGE) from None
        if args.metrics_listen not in ("off", ""):
            from kvtrace.servers.prometheus import MetricsSetupError, check_listen

            try:
                check_listen(args.metrics_listen, args.metrics_allow_remote)
            except MetricsSetupError as error:
                raise CommandError(str(error), ExitCode.USAGE) from None
        otlp_endpoint = ""
        if args.otlp_endpoint not in (None, "", "off"):
            from kvtrace.servers.otlp import OtlpSetupError, check_endpoint, require_sdk

            try:
                otlp_endpoint = check_endpoint(args.otlp_endpoint)
                require_sdk()
            except OtlpSetupError as error:
                raise CommandError(str(error), ExitCode.USAGE) from None
        if not 1 <= args.otlp_interval_seconds <= 3600:  # servers/otlp.py's flag: a server cannot import cli/flags.py
            raise CommandError("--otlp-interval-seconds takes 1 to 3600 seconds", ExitCode.USAGE)
        vllm_socket, vllm_metrics_urls = AgentCommand._vllm_options(args, api)
        cupti_socket = AgentCommand._cupti_socket(args, api, vllm_socket)
        flight = flight_options_from_args(args)
        if args.record is not None and (args.record.is_dir() or not args.record.parent.is_dir()):
            raise CommandError(f"--record {args.record}: give a file in an existing directory", ExitCode.USAGE)
        from kvtrace.sources.bpf.source import BpfOptions

        blocks = BlocksMode.NEVER if args.no_torch_blocks else BlocksMode(args.blocks)

        return DaemonOptions(
            bpf=BpfOptions(pids=set(args.pid), cmdline=cmdline,
                           settings=ProbeSettings(max_ledger_entries=args.max_ledger_entries,
                                                  max_totals=args.max_totals,
                                                  wakeup_events=args.wakeup_events,
                                                  block_events_per_second=args.max_block_events_per_second,
                                                  task_storage=False if args.no_task_storage else None),
                           python_stacks=not args.no_python_stacks, blocks=blocks,
                           block_sample_bytes=args.block_sample_bytes,
                           max_libraries=args.max_libraries, max_read_entries=args.max_read_entries,
                           ledger_in_kernel=args.ledger_in_kernel,
                           per_process_probes_max=args.per_process_probes_max),
            api=api, json_events=args.json_events, nvml=args.nvml,
            depth=DepthOptions(mode=blocks, sample_bytes=args.block_sample_bytes, growth_bytes=args.deepen_growth,
                               quiet_seconds=args.deepen_quiet_seconds,
                               startup_grace_seconds=args.deepen_grace_seconds),
            analysis=AnalysisOptions(leak_min_age_seconds=args.leak_min_age,
                                     site_sample_seconds=args.site_sample_interval,
                                     forecast_min_history_seconds=args.forecast_min_history,
                                     vllm=VllmOptions(held_after_finish_seconds=args.vllm_held_seconds,
                                                      stuck_usage_seconds=args.vllm_stuck_seconds,
                                                      idle_growth_bytes_per_second=args.vllm_idle_growth,
                                                      cold_start_seconds=args.vllm_cold_start_seconds)),
            metrics_listen="" if args.metrics_listen in ("off", "") else args.metrics_listen,
            metrics_allow_remote=args.metrics_allow_remote,
            otlp_endpoint=otlp_endpoint, otlp_interval_seconds=args.otlp_interval_seconds,
            tracing=args.tracing, off_switch=args.off_switch,
            vllm_socket=vllm_socket, vllm_metrics_urls=vllm_metrics_urls, cupti_socket=cupti_socket,
            vllm_discover=not args.no_vllm_discovery, flight=flight, record=args.record,
            record_max_bytes=args.record_max_size, record_keep=args.record_keep)

    @staticmethod
    def _vllm_options(args: argparse.Namespace, api: ApiConfig | None) -> tuple[str, tuple[str, ...]]:
        """--vllm-socket ("" when off) and the --vllm-metrics-url list, checked."""
        from kvtrace.sources.vllm.listener import ListenerSetupError, check_socket_path
        from kvtrace.sources.vllm.metrics import MAX_URLS, MetricsSetupError, check_metrics_url

        vllm_socket = "" if args.vllm_socket in ("off", "") else args.vllm_socket
        try:
            if vllm_socket:
                check_socket_path(vllm_socket)
            urls = tuple(dict.fromkeys(check_metrics_url(url) for url in args.vllm_metrics_url))
        except (ListenerSetupError, MetricsSetupError) as error:
            raise CommandError(str(error), ExitCode.USAGE) from None
        if len(urls) > MAX_URLS:
            raise CommandError(f"--vllm-metrics-url given {len(urls)} times; at most {MAX_URLS}", ExitCode.USAGE)
        api_paths = () if api is None else (api.socket, api.admin_path)
        if vllm_socket and os.path.abspath(vllm_socket) in {os.path.abspath(path) for path in api_paths if path}:
            raise CommandError(f"--vllm-socket {vllm_socket} is the API's socket: choose another path "
                               f"(default: {vllm_protocol.DEFAULT_SOCKET})", ExitCode.USAGE)
        return vllm_socket, urls

    @staticmethod
    def _cupti_socket(args: argparse.Namespace, api: ApiConfig | None, vllm_socket: str) -> str:
        """--cupti-socket ("" when off), checked, and apart from the API's and the vLLM plugin's sockets."""
        from kvtrace.sources.cupti.listener import ListenerSetupError, check_socket_path

        path = "" if args.cupti_socket in ("off", "") else args.cupti_socket
        if not path:
            return ""
        try:
            check_socket_path(path)
        except ListenerSetupError as error:
            raise CommandError(str(error), ExitCode.USAGE) from None
        others = (vllm_socket, *(() if api is None else (api.socket, api.admin_path)))
        if os.path.abspath(path) in {os.path.abspath(other) for other in others if other}:
            raise CommandError(f"--cupti-socket {path} is another socket of the agent's: choose another path "
                               f"(default: {cupti_protocol.DEFAULT_AGENT_SOCKET})", ExitCode.USAGE)
        return path


def add_flight_flags(parser: argparse.ArgumentParser) -> None:
    """`kvtrace agent`'s flight recorder flags."""
    defaults = FlightOptions()
    parser.add_argument("--flight-dir", metavar="DIR", type=Path, default=defaults.directory,
                        help="where the flight recorder writes its dumps (default: %(default)s)")
    parser.add_argument("--flight-window", metavar="SECONDS", type=bounded(1, 3600, "seconds"),
                        default=defaults.window_seconds,
                        help="seconds of events the flight recorder keeps to dump (default: %(default)g)")
    parser.add_argument("--flight-max-records", metavar="N", type=bounded_int(1000, 50_000_000),
                        default=defaults.max_records,
                        help="records it keeps at most, whatever the window; ~110 bytes each, packed "
                             "(default: %(default)s)")
    parser.add_argument("--flight-max-dumps", metavar="N", type=bounded_int(1, 10_000), default=defaults.max_dumps,
                        help="dumps kept on disk, the oldest removed first (default: %(default)s)")
    parser.add_argument("--flight-max-size", metavar="SIZE", type=parse_size, default=defaults.max_total_bytes,
                        help="disk the dumps may use together (default: 2GiB)")
    parser.add_argument("--flight-time-to-oom", metavar="SECONDS", type=bounded(0, WEEK, "seconds"),
                        default=defaults.time_to_oom_seconds,
                        help="dump when a process's forecast time to out-of-memory falls under this "
                             "(default: %(default)g; 0: never)")
    parser.add_argument("--no-flight-recorder", action="store_true",
                        help="keep no ring of recent events and write no dumps (on out-of-memory, a process "
                             "dying with GPU memory, a near time-to-OOM, SIGUSR1)")


def add_metrics_flags(parser: argparse.ArgumentParser) -> None:
    """`kvtrace agent`'s Prometheus /metrics listener flags."""
    from kvtrace.servers.prometheus import DEFAULT_LISTEN

    parser.add_argument("--metrics-listen", metavar="HOST:PORT", default=DEFAULT_LISTEN,
                        help="serve Prometheus /metrics here (default: %(default)s; 'off': not at all)")
    parser.add_argument("--metrics-allow-remote", action="store_true",
                        help="allow a non-loopback --metrics-listen (the metrics carry process titles)")


def flight_options_from_args(args: argparse.Namespace) -> FlightOptions | None:
    """The flight recorder's options from its flags (argparse checked each); None when it is off."""
    if args.no_flight_recorder:
        return None
    max_bytes = args.flight_max_size
    return FlightOptions(directory=args.flight_dir, window_seconds=args.flight_window,
                         max_records=args.flight_max_records, max_dumps=args.flight_max_dumps,
                         max_total_bytes=max_bytes, time_to_oom_seconds=args.flight_time_to_oom)
