"""`kvtrace flight`: the flight recorder's dumps, and a dump on demand."""
from __future__ import annotations

import argparse
import json
import sys

from kvtrace.client import AgentClient
from kvtrace.config import add_socket_flag
from kvtrace.errors import ExitCode
from kvtrace.human import human_bytes, printable
from kvtrace.reports.flight import trigger_name
from kvtrace.reports.replay import wall_time

EPILOG = """examples:
  kvtrace flight                          # the dumps on disk, newest first
  kvtrace flight --dump --reason "before the driver upgrade"
  kvtrace leaks --input /var/lib/kvtrace/flight/flight-20261202-073000-oom-1234.kvtrace
  sudo kill -USR1 $(pidof -s kvtrace)     # a dump, as --dump asks for one
"""


class FlightCommand:
    """List the flight recorder's dumps, or have the agent write one now.

    The agent keeps its last --flight-window seconds (120) of events in memory and writes them to
    --flight-dir when an allocation fails with out-of-memory, when a process dies holding GPU memory,
    when a process's time-to-OOM falls under --flight-time-to-oom, on SIGUSR1, or when asked here.
    A dump is a recording: `kvtrace leaks --input DUMP` reads it at its trigger.
    """

    EPILOG = EPILOG

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--dump", action="store_true", help="write a dump now and print its path")
        parser.add_argument("--reason", default="", help="with --dump: why, kept in the dump's header")
        parser.add_argument("--json", action="store_true", help="one JSON object per dump")
        add_socket_flag(parser)

    def run(self, args: argparse.Namespace) -> int:
        with AgentClient.from_args(args) as agent:
            if args.dump:
                dumps = [agent.dump_flight_recorder(args.reason)]
                directory = ""
            else:
                response = agent.flight_dumps()
                dumps, directory = list(response.dumps), response.directory
        out = sys.stdout
        if args.json:
            for dump in dumps:
                out.write(json.dumps(dump_to_json(dump), ensure_ascii=False) + "\n")
            return ExitCode.OK
        if not dumps:
            print(f"no flight recorder dumps in {directory or 'the dump directory'}", file=out)
            return ExitCode.OK
        for dump in dumps:
            trigger = dump.trigger
            print(f"{wall_time(trigger.timestamp_ns)}  {trigger_name(trigger.kind):<11} "
                  f"{human_bytes(dump.size_bytes):>10}  {printable(dump.path)}", file=out)
            print(f"    {printable(trigger.reason)}", file=out)
            if trigger.left_out:
                print(f"    left out: {printable(trigger.left_out)}", file=out)
        return ExitCode.OK


def dump_to_json(dump) -> dict:
    trigger = dump.trigger
    return {"path": dump.path, "size_bytes": dump.size_bytes, "event_count": dump.event_count,
            "trigger": trigger_name(trigger.kind), "timestamp_ns": trigger.timestamp_ns, "pid": trigger.pid,
            "device": trigger.device, "reason": trigger.reason, "window_seconds": trigger.window_seconds,
            "left_out": trigger.left_out}
