"""`kvtrace snapshot`: every outstanding allocation now, read from the running agent."""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict

from kvtrace.cli.flags import add_pid_flag
from kvtrace.client import AgentClient
from kvtrace.config import add_socket_flag
from kvtrace.errors import ExitCode
from kvtrace.human import human_age, human_bytes
from kvtrace.model.events import Layer, Memory, ObjectKind
from kvtrace.wire import outstanding_to_json_dict, wire_enum_name

EPILOG = """examples:
  kvtrace snapshot               # every process, largest objects first
  kvtrace snapshot -p 1234
  kvtrace snapshot --json        # one JSON object per outstanding object
"""

HEADER = f"  {'DEV':>3} {'LAYER':<7} {'OBJECT':<11} {'MEMORY':<7} {'SIZE':>10} {'AGE':>8} {'ADDRESS':<14} API"


def _column(enum_type, value: int) -> str:
    return wire_enum_name(enum_type, value) or "-"


class SnapshotCommand:
    """List every outstanding (allocated, not yet freed) CUDA object, from the running kvtrace agent.

    Grouped by process, largest first. Physical device memory is the driver and VMM layers; the
    runtime layer shows the same bytes as the program asked for them (cudaMalloc), so the totals
    never add the two.
    """

    EPILOG = EPILOG

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        add_pid_flag(parser)
        parser.add_argument("--json", action="store_true", help="one JSON object per line")
        add_socket_flag(parser)

    def run(self, args: argparse.Namespace) -> int:
        out = sys.stdout
        with AgentClient.from_args(args) as agent:
            if args.json:
                for entry in agent.snapshot(pids=args.pid):
                    out.write(json.dumps(outstanding_to_json_dict(entry), separators=(",", ":")) + "\n")
                return ExitCode.OK
            by_pid = defaultdict(list)
            for entry in agent.snapshot(pids=args.pid):
                by_pid[entry.pid].append(entry)
        now_ns = time.time_ns()
        physical_bytes = 0
        for pid in sorted(by_pid):
            entries = sorted(by_pid[pid], key=lambda entry: -entry.size_bytes)
            first = entries[0]
            container = f"  container {first.container[:12]}" if first.container else ""
            print(f"pid {pid}  {first.title or '(exited)'}{container}", file=out)
            print(HEADER, file=out)
            for entry in entries:
                if entry.layer in (Layer.DRIVER, Layer.VMM) and entry.memory == Memory.DEVICE \
                        and entry.object in (ObjectKind.ALLOCATION, ObjectKind.VMM_HANDLE):
                    physical_bytes += entry.size_bytes
                device = "" if entry.device < 0 else str(entry.device)
                print(f"  {device:>3} {_column(Layer, entry.layer):<7} "
                      f"{_column(ObjectKind, entry.object):<11} {_column(Memory, entry.memory):<7} "
                      f"{human_bytes(entry.size_bytes):>10} {human_age((now_ns - entry.timestamp_ns) / 1e9):>8} "
                      f"{entry.address:#014x} {entry.api_name}", file=out)
        count = sum(len(entries) for entries in by_pid.values())
        print(f"{count} outstanding objects in {len(by_pid)} processes; "
              f"device memory held (driver + VMM): {human_bytes(physical_bytes)}", file=out)
        return ExitCode.OK
