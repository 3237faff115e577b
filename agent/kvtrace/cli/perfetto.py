"""`kvtrace perfetto`: a recording as a Perfetto trace, memory over time beside the calls."""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from kvtrace.cli.flags import add_pid_flag, bounded
from kvtrace.cli.record import record_to
from kvtrace.client import AgentClient
from kvtrace.config import add_socket_flag
from kvtrace.errors import CommandError, ExitCode
from kvtrace.reports.recording import RecordingError, RecordingReader
from kvtrace.reports.replay import read_records

EPILOG = """examples:
  kvtrace perfetto --input gpu.kvtrace -o gpu.pftrace           # open it on https://ui.perfetto.dev
  kvtrace perfetto --duration 60 -p 1234 -o serve.pftrace       # record a minute from the agent first
  kvtrace perfetto --input /var/lib/kvtrace/flight/flight-20261202-073000-oom-1234.kvtrace -o oom.pftrace
"""


class PerfettoCommand:
    """Write a Perfetto trace of a recording: memory over time beside the calls that changed it.

    From a recording (--input), or the next --duration seconds of the running agent: per process
    and GPU, counter tracks of the traced bytes, PyTorch's block bytes and
    NVML's used bytes, NVML's used and free bytes per GPU, and each allocation, free and failed
    allocation as an instant on its thread with its size, address and Python stack.

    ui.perfetto.dev opens it (it stays in the browser), as does Perfetto's trace_processor.
    """

    EPILOG = EPILOG

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("-o", "--output", metavar="FILE", type=Path, required=True,
                            help="the trace to write (.pftrace)")
        parser.add_argument("--input", metavar="FILE", type=Path, help="the recording to draw")
        parser.add_argument("--duration", metavar="SECONDS", type=bounded(0, 24 * 3600, "seconds", above=True),
                            help="without --input: record this long from the agent, then draw it")
        add_pid_flag(parser)
        add_socket_flag(parser)

    def run(self, args: argparse.Namespace) -> int:
        if (args.input is None) == (args.duration is None):
            raise CommandError("give a recording with --input FILE, or --duration SECONDS to record one now",
                               ExitCode.USAGE)
        try:
            import perfetto  # noqa: F401  (the `perfetto` extra)
        except ImportError:
            raise CommandError("the Perfetto export needs the perfetto package: "
                               "pip install 'kvtrace[perfetto]'", ExitCode.FAILURE) from None
        if args.input is not None:
            return self._draw(args.input, args.output)
        with tempfile.TemporaryDirectory(prefix="kvtrace-perfetto-") as directory:
            recording = Path(directory) / "recording.kvtrace"
            with AgentClient.from_args(args) as agent:
                record_to(agent, recording, args.pid, "", args.duration)
            return self._draw(recording, args.output)

    @staticmethod
    def _draw(recording: Path, output: Path) -> int:
        from kvtrace.reports.perfetto import write_perfetto_trace

        try:
            with RecordingReader.open(recording) as reader:
                stream = read_records(reader)
                summary = write_perfetto_trace(output, stream.checkpoint, stream.records, stream.stacks.get,
                                               stream.titles)
                damage = reader.damage
        except RecordingError as error:
            raise CommandError(str(error), ExitCode.USAGE) from None
        except OSError as error:
            raise CommandError(f"cannot write {output}: {error.strerror or error}", ExitCode.USAGE) from None
        if damage:
            print(f"kvtrace: warning: {damage}", file=sys.stderr)
        replaced = f", the ledger replaced {summary.checkpoints} times (marked)" if summary.checkpoints else ""
        print(f"wrote {output}: {summary.events} events, {summary.instants} calls, {summary.counter_values} "
              f"counter values on {summary.tracks} tracks{replaced}; open it on https://ui.perfetto.dev",
              file=sys.stderr)
        return ExitCode.OK
