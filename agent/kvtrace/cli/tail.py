"""`kvtrace tail`: CUDA memory events as they happen, read from the running agent."""
from __future__ import annotations

import argparse
import json
import sys
import time

from kvtrace.cli.flags import add_input_flags, add_pid_flag, check_cmdline, parse_size
from kvtrace.cli.recorded import connect
from kvtrace.config import add_socket_flag
from kvtrace.errors import ExitCode
from kvtrace.human import device_label, human_bytes, printable
from kvtrace.model.events import Event, Kind, Layer
from kvtrace.model.stacks import Stack
from kvtrace.wire import event_from_proto, event_to_json, stack_from_proto

EPILOG = """examples:
  kvtrace tail                          # every event on this host
  kvtrace tail -p 1234                  # one process
  kvtrace tail --cmdline 'VLLM::Worker' --min-size 1MiB
  kvtrace tail --json | jq .            # the JSON of `kvtrace agent --json-events`
"""

HEADER = f"{'TIME':<12} {'PID':>7} {'API':<18} {'LAYER':<7} {'SIZE':>10} {'DEV':>3} {'ADDRESS':<14} TITLE"

def format_event(event: Event) -> str:
    """One line for people: time, pid, API, layer, size, device, address, title."""
    seconds, nanoseconds = divmod(event.timestamp_ns, 1_000_000_000)
    when = time.strftime("%H:%M:%S", time.localtime(seconds)) + f".{nanoseconds // 1_000_000:03d}"
    size = human_bytes(event.size_bytes) if event.size_bytes else ""
    address = f"{event.address:#x}" if event.address else ""
    if event.kind in (Kind.ALLOC_FAILED, Kind.FREE_FAILED):
        address = f"error {event.error_code}"
    elif event.kind is Kind.FREE_UNKNOWN:
        size = "unknown"  # freed memory allocated before the agent started
    layer = event.layer.name.lower() if event.layer else ""
    device = device_label(event.device)
    return (f"{when:<12} {event.pid:>7} {event.api.name:<18} {layer:<7} {size:>10} {device:>3} "
            f"{address:<14} {printable(event.title)}")


class TailCommand:
    """Print CUDA memory events as they happen, from the running kvtrace agent.

    One line per event: time, pid, API, layer, size, device, address, process title. With --json,
    one JSON object per line, the same as `kvtrace agent --json-events`. If this reader falls
    behind, the agent drops events for it alone and a line on stderr says how many.
    """

    EPILOG = EPILOG

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        add_pid_flag(parser)
        parser.add_argument("--cmdline", metavar="REGEX",
                            help="only processes whose title (/proc/PID/cmdline) matches")
        parser.add_argument("--min-size", metavar="SIZE", type=parse_size, default=0,
                            help="only allocation events of at least SIZE (123, 512k, 1MiB; 1k = 1024)")
        parser.add_argument("--layer", action="append", default=[],
                            choices=[layer.name.lower() for layer in Layer],
                            help="only this CUDA layer (repeatable)")
        parser.add_argument("--json", action="store_true", help="one JSON object per line")
        parser.add_argument("--stacks", action="store_true",
                            help="print the Python stack under each allocation (innermost first)")
        add_socket_flag(parser)
        add_input_flags(parser)

    def run(self, args: argparse.Namespace) -> int:
        check_cmdline(args.cmdline)
        layers = [Layer[name.upper()] for name in args.layer]
        out = sys.stdout
        with connect(args, events_only=True) as agent:
            batches = agent.stream_batches(pids=args.pid, title_regex=args.cmdline or "", layers=layers,
                                           min_size_bytes=args.min_size)
            if not args.json:
                print(HEADER, file=out, flush=True)
            stacks: dict[int, Stack] = {}  # each stack is sent once per stream, before its events
            for batch in batches:
                for message in batch:
                    if message.HasField("events_lost"):
                        print(_lost_line(message.events_lost), file=sys.stderr, flush=True)
                        continue
                    if message.HasField("stack_definition"):
                        stack_id, stack = stack_from_proto(message.stack_definition)
                        stacks[stack_id] = stack
                        continue
                    event = event_from_proto(message)
                    if event is None:
                        continue
                    event_stack = stacks.get(event.stack_id)
                    if args.json:
                        out.write(json.dumps(event_to_json(event, event_stack), separators=(",", ":"),
                                             ensure_ascii=False) + "\n")
                        continue
                    out.write(format_event(event) + "\n")
                    if args.stacks and event_stack is not None:
                        for frame in event_stack.frames:
                            out.write(f"    {printable(frame.function)} ({printable(frame.file)}:{frame.line})\n")
                out.flush()  # once per batch: `kvtrace tail | grep` sees events promptly
        return ExitCode.OK


def _lost_line(lost) -> str:
    parts = []
    if lost.dropped_count:
        parts.append(f"{lost.dropped_count} events lost (slow reader)")
    if lost.kernel_lost_count:
        parts.append(f"{lost.kernel_lost_count} events lost in the kernel ring buffer")
    return f"-- {', '.join(parts)} --"
