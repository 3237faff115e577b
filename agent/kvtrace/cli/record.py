"""`kvtrace record`: write what the running agent sees to a recording file."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from kvtrace.cli.flags import add_pid_flag, bounded, check_cmdline
from kvtrace.client import AgentClient
from kvtrace.config import add_socket_flag
from kvtrace.errors import CommandError, ExitCode
from kvtrace.human import human_bytes
from kvtrace.reports.recorder import FLUSH_SECONDS
from kvtrace.reports.recording import RecordingWriter

EPILOG = """examples:
  kvtrace record -o gpu.kvtrace                     # everything, until Ctrl-C
  kvtrace record -o vllm.kvtrace --cmdline VLLM --duration 600
  kvtrace leaks --input gpu.kvtrace                 # any report, from the file
  kvtrace flamegraph --input gpu.kvtrace -o gpu.speedscope.json
"""

PROGRESS_SECONDS = 10.0


class RecordCommand:
    """Record what the running kvtrace agent sees to a file, for any report to read later.

    The file holds the memory held when recording starts, then every allocation, free, stack,
    process and NVML round, until Ctrl-C or --duration.

    Every report reads the file as it reads the agent (`kvtrace leaks|snapshot|ps|top|tail --input
    FILE [--at TIME]`), after the processes are gone. The file holds stacks, addresses and titles:
    it is created 0600, and recording needs the agent's admin socket (root, or --admin-group).
    """

    EPILOG = EPILOG

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("-o", "--output", metavar="FILE", type=Path, required=True,
                            help="the recording to write (replaced if it exists)")
        add_pid_flag(parser)
        parser.add_argument("--cmdline", metavar="REGEX", help="only processes whose title matches (RE2)")
        parser.add_argument("--duration", metavar="SECONDS", type=bounded(0, 7 * 24 * 3600, "seconds", above=True),
                            help="stop after this long (default: until Ctrl-C)")
        add_socket_flag(parser)

    def run(self, args: argparse.Namespace) -> int:
        check_cmdline(args.cmdline)
        if args.output.is_dir():
            raise CommandError(f"{args.output} is a directory: give a file name, e.g. {args.output / 'gpu.kvtrace'}",
                               ExitCode.USAGE)
        with AgentClient.from_args(args) as agent:
            progress = record_to(agent, args.output, args.pid, args.cmdline or "", args.duration)
        print(f"wrote {args.output}: {progress.summary()}; read it with "
              f"`kvtrace leaks --input {args.output}`", file=sys.stderr)
        return ExitCode.OK


def record_to(agent: AgentClient, output: Path, pids: list[int], title_regex: str,
              duration_seconds: float | None) -> Progress:
    """Writes the agent's recording to `output` until the duration passes (or Ctrl-C)."""
    progress = Progress(output)
    responses = agent.stream_recording(pids, title_regex, duration_seconds)
    writer: RecordingWriter | None = None
    try:
        for response in responses:
            if writer is None:
                if not response.HasField("header"):
                    raise CommandError("the agent's recording did not start with a header; upgrade the agent")
                try:
                    writer = RecordingWriter.create(output, response.header)
                except OSError as error:
                    raise CommandError(f"cannot write {output}: {error.strerror}", ExitCode.USAGE) from None
                until = f" for {duration_seconds:g} s" if duration_seconds else ""
                print(f"Recording to {output}{until}. Hit Ctrl-C to end.", file=sys.stderr, flush=True)
            for frame in response.frames:
                writer.write(frame)
                progress.count(frame)
            progress.tick(writer)
    except KeyboardInterrupt:
        pass
    except CommandError as error:
        if writer is None:
            raise
        # The agent stopped (or went away): what was written is a whole recording up to there.
        print(f"kvtrace: the recording ended early: {error}; {output} holds everything up to then",
              file=sys.stderr)
    finally:
        if writer is not None:
            writer.close()
    if writer is None:
        raise CommandError("the agent sent nothing to record")
    return progress


class Progress:
    """Counts what is written, and says so every PROGRESS_SECONDS on stderr."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.events = 0
        self.lost = 0
        self.started = time.monotonic()
        self._next_flush = self.started + FLUSH_SECONDS
        self._next_report = self.started + PROGRESS_SECONDS

    def count(self, frame) -> None:
        if frame.HasField("event"):
            if frame.event.HasField("events_lost"):
                self.lost += frame.event.events_lost.dropped_count + frame.event.events_lost.kernel_lost_count
            elif not frame.event.HasField("stack_definition"):
                self.events += 1

    def tick(self, writer: RecordingWriter) -> None:
        now = time.monotonic()
        if now >= self._next_flush:
            writer.flush()
            self._next_flush = now + FLUSH_SECONDS
        if now >= self._next_report:
            self._next_report = now + PROGRESS_SECONDS
            print(f"kvtrace: recording: {self.summary()} in {now - self.started:.0f} s", file=sys.stderr, flush=True)

    def summary(self) -> str:
        try:
            size = human_bytes(self.path.stat().st_size)
        except OSError:
            size = "?"
        lost = f", {self.lost} lost" if self.lost else ""
        return f"{self.events} events{lost}, {size}"
