"""`kvtrace snapshot`: every outstanding allocation now, read from the running agent."""
from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import TextIO

from kvtrace.cli.deep import clock_time
from kvtrace.cli.flags import add_input_flags, add_pid_flag
from kvtrace.cli.recorded import connect
from kvtrace.config import add_socket_flag
from kvtrace.errors import CommandError, ExitCode
from kvtrace.human import device_label, human_age, human_bytes, printable
from kvtrace.model.blocks import Segment, segments_of
from kvtrace.model.depth import ProcessDepth
from kvtrace.model.events import Layer
from kvtrace.model.ledger import Outstanding, holds_device_memory
from kvtrace.wire import depths_by_pid, outstanding_from_proto, outstanding_json_line

EPILOG = """examples:
  kvtrace snapshot               # every process, largest objects first; blocks inside their segments
  kvtrace snapshot -p 1234
  kvtrace snapshot --json        # one JSON object per outstanding object
  kvtrace snapshot -p 1234 --format memory-viz -o 1234.pickle
      # PyTorch's own snapshot format: python -m torch.cuda._memory_viz trace_plot 1234.pickle -o 1234.html,
      # or open it at https://pytorch.org/memory_viz
"""

HEADER = f"  {'DEV':>3} {'LAYER':<7} {'OBJECT':<11} {'MEMORY':<7} {'SIZE':>10} {'AGE':>8} {'ADDRESS':<14} API"
FORMATS = ("table", "json", "memory-viz")


class SnapshotCommand:
    """List every outstanding (allocated, not yet freed) CUDA object, from the running kvtrace agent.

    Grouped by process, largest first. Physical device memory is the driver and VMM layers; the
    runtime layer shows the same bytes as the program asked for them (cudaMalloc), so the totals
    never add the two. Where PyTorch's blocks are traced, each segment of its caching allocator
    lists the blocks (tensors) inside it, with the segment's free bytes and its largest free stretch.
    --format memory-viz writes the file PyTorch's memory viewer reads, taken from outside.
    """

    EPILOG = EPILOG

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        add_pid_flag(parser)
        parser.add_argument("--format", choices=FORMATS, default="table",
                            help="table for people (default), json (one object per line), or memory-viz: "
                                 "PyTorch's memory snapshot pickle of one process's blocks (needs -p and -o)")
        parser.add_argument("--json", action="store_true", help="the same as --format json")
        parser.add_argument("-o", "--output", metavar="FILE", type=Path,
                            help="where --format memory-viz writes (a .pickle file)")
        add_socket_flag(parser)
        add_input_flags(parser)

    def run(self, args: argparse.Namespace) -> int:
        output_format = "json" if args.json else args.format
        if output_format == "memory-viz":
            with _collector_paused():
                return self._memory_viz(args)
        if args.output is not None:
            raise CommandError("-o/--output goes with --format memory-viz; the table and JSON go to stdout",
                               ExitCode.USAGE)
        out = sys.stdout
        with connect(args) as agent, _collector_paused():
            if output_format == "json":
                for page in agent.snapshot_pages(pids=args.pid):  # a page's lines in one write
                    out.write("".join([outstanding_json_line(entry) + "\n" for entry in page.allocations]))
                return ExitCode.OK
            by_pid = defaultdict(list)
            titles: dict[int, tuple[str, str]] = {}
            depths: dict[int, ProcessDepth] = {}
            for page in agent.snapshot_pages(pids=args.pid):
                for message in page.allocations:
                    by_pid[message.pid].append(outstanding_from_proto(message))
                    titles.setdefault(message.pid, (message.title, message.container))
                depths.update(depths_by_pid(page.depths))
            now_ns = agent.now_ns()
        print_table(out, by_pid, titles, now_ns, depths)
        return ExitCode.OK

    def _memory_viz(self, args: argparse.Namespace) -> int:
        from kvtrace.reports.memory_viz import NOT_SAMPLED_FRAME, SEGMENT_HOLDER_FRAME
        from kvtrace.reports.viz_export import ExportBuilder

        if len(args.pid) != 1 or args.output is None:
            raise CommandError("--format memory-viz takes one process and a file: -p PID -o FILE.pickle",
                               ExitCode.USAGE)
        pid = args.pid[0]
        builder = ExportBuilder(pid)
        depths: dict[int, ProcessDepth] = {}
        with connect(args) as agent:  # each page into the export as it comes, while the agent reads the next
            for columns, stacks in agent.snapshot_columns(pids=args.pid, fields=ExportBuilder.FIELDS, depths=depths):
                builder.add(columns, stacks)
        depth = depths.get(pid)
        export = builder.finish(blocks_traced=depth is not None and depth.knows_holders)
        if not export.segments:
            raise CommandError(f"no GPU memory is traced in pid {pid} (is it a CUDA process, traced since "
                               "it allocated? `kvtrace doctor --pid` says what is traced)", ExitCode.FAILURE)
        try:
            export.write(args.output)
        except ValueError as error:  # what the viewer would draw wrong; nothing is written
            raise CommandError(f"cannot write a memory-viz file of pid {args.pid[0]}: {error}; "
                               f"`kvtrace snapshot -p {args.pid[0]} --format json` shows the blocks as traced",
                               ExitCode.FAILURE) from None
        except OSError as error:
            raise CommandError(f"cannot write {args.output}: {error.strerror or error}", ExitCode.FAILURE) from None
        note = f"; {export.outside} blocks outside any traced segment left out" if export.outside else ""
        blocks = "no block traced" if export.segments_as_blocks else f"{export.blocks} blocks"
        print(f"wrote {args.output}: {export.segments} segments, {blocks}{note}. "
              f"View it: python -m torch.cuda._memory_viz trace_plot {args.output} -o {args.output.stem}.html, "
              "or at https://pytorch.org/memory_viz", file=sys.stderr)
        if export.segments_as_blocks:
            how = "" if args.input else f"; `kvtrace deep --pid {pid}` traces its blocks from now on"
            print(f"kvtrace: no PyTorch block of pid {pid} is traced ({_depth_said(depth)}, or it does not use "
                  f"PyTorch's caching allocator): each segment (each mapping of an expandable one) shows as one "
                  f"block under {SEGMENT_HOLDER_FRAME}, held by the stack that allocated it{how}", file=sys.stderr)
        older = builder.segments_before(depth.since_ns) if depth is not None and depth.knows_holders else 0
        if older and depth is not None:
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(depth.since_ns / 1e9))
            print(f"kvtrace: pid {pid}'s blocks are traced since {since} (its depth was raised then): {older} of its "
                  "segments are older, and what PyTorch placed in them before then is not known and shows as free",
                  file=sys.stderr)
        if export.passed:
            print(f"kvtrace: block stacks are sampled (--block-sample-bytes): {export.passed} blocks' stacks were "
                  f"passed over and show as {NOT_SAMPLED_FRAME}, so the viewer's bytes per stack are the sampled "
                  f"blocks' only; `kvtrace flamegraph --blocks -p {args.pid[0]}` estimates each stack's",
                  file=sys.stderr)
        return ExitCode.OK


def _depth_said(depth: ProcessDepth | None) -> str:
    return f"its depth is {depth.depth.label}" if depth is not None else "the agent does not say its depth"


def _line(entry: Outstanding, now_ns: int, indent: str = "  ") -> str:
    key = entry.key
    device = device_label(entry.device)
    return (f"{indent}{device:>3} {key.layer.name.lower():<7} {key.object.name.lower():<11} "
            f"{entry.memory.name.lower():<7} {human_bytes(entry.size_bytes):>10} "
            f"{human_age((now_ns - entry.timestamp_ns) / 1e9):>8} {key.address:#014x} {entry.api.name}")


def _segment_line(segment: Segment) -> str:
    kind = "expandable segment" if segment.expandable else "segment"
    return (f"      {kind} {segment.address:#x}: {len(segment.blocks)} blocks, "
            f"{human_bytes(segment.allocated_bytes)} allocated, {human_bytes(segment.free_bytes)} free, "
            f"largest free {human_bytes(segment.largest_free_bytes)}")


def _depth_text(depth: ProcessDepth | None) -> str:
    """`  depth blocks since 14:20:01`: from then on its blocks are listed (before, its segments only)."""
    if depth is None:
        return ""
    return f"  depth {depth.depth.label}" + (f" since {clock_time(depth.since_ns)}" if depth.knows_holders else "")


def print_table(out: TextIO, by_pid: dict[int, list[Outstanding]], titles: dict[int, tuple[str, str]],
                now_ns: int, depths: dict[int, ProcessDepth] | None = None) -> None:
    """Per process (with its depth, where known) its objects, largest first; a segment holding PyTorch
    blocks is followed by a line that sums it up and by its blocks, indented."""
    physical_bytes = 0
    for pid in sorted(by_pid):
        title, container = titles.get(pid, ("", ""))
        suffix = f"  container {container[:12]}" if container else ""
        print(f"pid {pid}  {printable(title) or '(exited)'}{suffix}{_depth_text((depths or {}).get(pid))}",
              file=out)
        print(HEADER, file=out)
        segments, outside = segments_of(by_pid[pid])
        holding = {segment.address: segment for segment in segments if segment.blocks}
        blocks_in_segments = {id(block) for segment in segments for block in segment.blocks}
        for entry in sorted(by_pid[pid], key=lambda entry: -entry.size_bytes):
            if id(entry) in blocks_in_segments:
                continue  # listed under its segment
            key = entry.key
            if holds_device_memory(entry):
                physical_bytes += entry.size_bytes
            print(_line(entry, now_ns), file=out)
            segment = holding.get(key.address) if key.layer is Layer.RUNTIME else None
            if segment is not None:
                print(_segment_line(segment), file=out)
                for block in segment.blocks:
                    print(_line(block, now_ns, indent="      "), file=out)
        for segment in segments:  # runs of VMM mappings are no single ledger entry: listed here
            if segment.expandable and segment.blocks:
                print(_segment_line(segment), file=out)
                for block in segment.blocks:
                    print(_line(block, now_ns, indent="      "), file=out)
        if outside:
            print(f"      {len(outside)} blocks in no traced segment (allocated before the agent attached)",
                  file=out)
    count = sum(len(entries) for entries in by_pid.values())
    print(f"{count} outstanding objects in {len(by_pid)} processes; "
          f"device memory held (driver + VMM): {human_bytes(physical_bytes)}", file=out)


@contextlib.contextmanager
def _collector_paused():
    """Python's cycle collector off while a listing is held: a million entries (and the export built of them)
    are objects without cycles, and each full collection would go through all of them again (half the time of
    a memory-viz export of a million blocks)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
