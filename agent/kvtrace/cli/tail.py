"""`kvtrace tail`: CUDA memory events as they happen, read from the running agent."""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import dataclass, replace
from typing import TextIO

from kvtrace.cli.flags import add_input_flags, add_pid_flag, check_cmdline, parse_size
from kvtrace.cli.recorded import connect
from kvtrace.config import add_socket_flag
from kvtrace.errors import ExitCode
from kvtrace.human import device_label, human_bytes, printable
from kvtrace.model.events import Api, Event, Kind, Layer
from kvtrace.model.stacks import Stack
from kvtrace.wire import event_from_proto, event_to_json, stack_from_proto

EPILOG = """examples:
  kvtrace tail                          # every event on this host
  kvtrace tail -p 1234                  # one process
  kvtrace tail --cmdline 'VLLM::Worker' --min-size 1MiB
  kvtrace tail --json | jq .            # the JSON of `kvtrace agent --json-events`
"""

# The API column is as wide as the longest name an event can carry. cuDevicePrimaryCtxRetain and
# cuCtxCreate_v2 are traced only to learn a context's device: no event names them.
_NEVER_AN_EVENT = frozenset({Api.cuDevicePrimaryCtxRetain, Api.cuCtxCreate_v2})
API_WIDTH = max(len(api.name) for api in Api if api not in _NEVER_AN_EVENT)
MIN_TITLE = 12  # "VLLM::Worke…": below this a title says nothing, and the line is let run past the terminal
ELLIPSIS = "…"


@dataclass(frozen=True)
class Layout:
    """Which columns a line has and how wide its title may be (None: whole)."""

    layer: bool = True
    device: bool = True
    title_width: int | None = None

    @property
    def header(self) -> str:
        return self.row("TIME", "PID", "API", "LAYER", "SIZE", "DEV", "ADDRESS", "TITLE")

    def row(self, when: str, pid: str, api: str, layer: str, size: str, device: str, address: str,
              title: str) -> str:
        parts = [f"{when:<12}", f"{pid:>7}", f"{api:<{API_WIDTH}}"]
        if self.layer:
            parts.append(f"{layer:<7}")
        parts.append(f"{size:>10}")
        if self.device:
            parts.append(f"{device:>3}")
        parts.append(f"{address:<14}")
        parts.append(cut(title, self.title_width))
        return " ".join(parts)

    @property
    def fixed_width(self) -> int:
        """Columns before the title, with the space after them."""
        return len(self.row("", "", "", "", "", "", "", ""))

    @classmethod
    def for_width(cls, columns: int | None) -> Layout:
        """Every column and the whole title when `columns` is None (not a terminal); else the most
        columns that leave the title MIN_TITLE characters, dropping LAYER first (the API's name says
        it: cuda* runtime, cuMem* driver or VMM, pytorch_* torch), then DEV; the title gets the rest."""
        if columns is None:
            return cls()
        choices = [cls(), cls(layer=False), cls(layer=False, device=False)]
        layout = next((choice for choice in choices if choice.fixed_width + MIN_TITLE <= columns), choices[-1])
        return replace(layout, title_width=max(MIN_TITLE, columns - layout.fixed_width))


def cut(text: str, width: int | None) -> str:
    """`text` as printable, at most `width` characters, its end replaced by an ellipsis when cut."""
    text = printable(text)
    if width is None or len(text) <= width:
        return text
    return text[:max(0, width - len(ELLIPSIS))] + ELLIPSIS


HEADER = Layout().header


def terminal_columns(out: TextIO) -> int | None:
    """The terminal's width when `out` is one; None (whole lines) when it is a pipe or a file: what is
    piped goes to grep, a file or a log collector, and a cut there would lose the title for good."""
    try:
        if not out.isatty():
            return None
    except (AttributeError, ValueError):
        return None
    return shutil.get_terminal_size().columns


def format_event(event: Event, layout: Layout = Layout()) -> str:
    """One line for people: time, pid, API, layer, size, device, address, title (see Layout)."""
    seconds, nanoseconds = divmod(event.timestamp_ns, 1_000_000_000)
    when = time.strftime("%H:%M:%S", time.localtime(seconds)) + f".{nanoseconds // 1_000_000:03d}"
    size = human_bytes(event.size_bytes) if event.size_bytes else ""
    address = f"{event.address:#x}" if event.address else ""
    if event.kind in (Kind.ALLOC_FAILED, Kind.FREE_FAILED):
        address = f"error {event.error_code}"
    elif event.kind is Kind.FREE_UNKNOWN:
        size = "unknown"  # freed memory allocated before the agent started
    layer = event.layer.name.lower() if event.layer else ""
    return layout.row(when, str(event.pid), event.api.name, layer, size, device_label(event.device), address,
                        event.title)


class TailCommand:
    """Print CUDA memory events as they happen, from the running kvtrace agent.

    One line per event: time, pid, API, layer, size, device, address, process title. On a terminal a
    line fits its width: the title is cut with an ellipsis, and a narrow one drops LAYER, then DEV
    (--wide keeps whole lines; a pipe or a file always gets them). With --json,
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
        parser.add_argument("-w", "--wide", action="store_true",
                            help="whole lines with every column even on a narrow terminal (a pipe gets them anyway)")
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
            layout = Layout.for_width(None if args.wide else terminal_columns(out))
            if not args.json:
                print(layout.header, file=out, flush=True)
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
                    out.write(format_event(event, layout) + "\n")
                    if args.stacks and event_stack is not None:
                        frame_width = None if layout.title_width is None else layout.fixed_width + layout.title_width
                        for frame in event_stack.frames:
                            out.write(cut(f"    {frame.function} ({frame.file}:{frame.line})", frame_width) + "\n")
                out.flush()  # once per batch: `kvtrace tail | grep` sees events promptly
        return ExitCode.OK


def _lost_line(lost) -> str:
    parts = []
    if lost.dropped_count:
        parts.append(f"{lost.dropped_count} events lost (slow reader)")
    if lost.kernel_lost_count:
        parts.append(f"{lost.kernel_lost_count} events lost in the kernel ring buffer")
    return f"-- {', '.join(parts)} --"
