"""`kvtrace deep`: trace one process more closely for a while; and how every report shows a depth."""
from __future__ import annotations

import argparse
import json
import sys
import time

from kvtrace._proto.kvtrace.v1 import agent_service_pb2 as service_pb2
from kvtrace.cli.flags import parse_duration, positive_pid
from kvtrace.client import AgentClient
from kvtrace.config import add_socket_flag
from kvtrace.errors import CommandError, ExitCode
from kvtrace.human import coarse_age, human_duration, printable
from kvtrace.model.depth import NO_REQUEST, REQUEST_WITHDRAWN, Depth, DepthCause, ProcessDepth
from kvtrace.wire import depth_from_proto, depth_message_to_json

EPILOG = """examples:
  sudo kvtrace deep --pid 1234              # its PyTorch blocks, stacks sampled, for 10 min
  sudo kvtrace deep --pid 1234 --for 1h     # ... for an hour
  sudo kvtrace deep --pid 1234 --full --for 5m   # every block's stack, for 5 min (costs more)
  sudo kvtrace deep --pid 1234 --off        # withdraw the request: the agent decides on its evidence again
  kvtrace ps                                # DEPTH: each process's depth and for how long
"""

NS_PER_SECOND = 1_000_000_000
TICK_NOTE = "the agent applies it at its next analysis tick (≤ 1 s)"


def clock_time(timestamp_ns: int) -> str:
    """14:32:10, local time."""
    return time.strftime("%H:%M:%S", time.localtime(timestamp_ns / NS_PER_SECOND))


def depth_cell(message: service_pb2.ProcessDepthState | None, now_ns: int) -> str:
    """`blocks 3m`, `full 45s`, `segments`: the depth, and for how long where it was raised; "-" when the
    agent did not say (an agent older than depths, or a process it does not follow)."""
    depth = depth_from_proto(message) if message is not None else None
    if depth is None:
        return "-"
    if depth.depth is Depth.SEGMENTS:
        return depth.depth.label
    return f"{depth.depth.label} {coarse_age((now_ns - depth.since_ns) / NS_PER_SECOND)}"


# `kvtrace top`'s DEPTH column: 80 columns leave no room for the words (ps has them).
DEPTH_CODES = {Depth.SEGMENTS: "seg", Depth.BLOCKS: "blk", Depth.FULL: "full"}
DEPTH_LEGEND = "DEPTH: seg CUDA calls, blk + PyTorch blocks (sampled stacks), full + every stack"


def depth_code(message: service_pb2.ProcessDepthState | None) -> str:
    depth = depth_from_proto(message) if message is not None else None
    return DEPTH_CODES.get(depth.depth, "-") if depth is not None else "-"


def cause_words(depth: ProcessDepth, with_detail: bool = True) -> str:
    """`growth: traced bytes +96 MiB in 60 s`, or `growth` without the detail: why a process is at its depth."""
    cause = depth.cause.name.lower().replace("_", "-")
    return f"{cause}: {printable(depth.detail)}" if with_detail and depth.detail else cause


def raised_line(depth: ProcessDepth) -> str:
    """`pid 200: blocks since 14:20:01 (growth: traced bytes +96 MiB in 60 s), until 14:30:01`."""
    until = f", until {clock_time(depth.until_ns)}" if depth.until_ns else ""
    return f"pid {depth.pid}: {depth.depth.label} since {clock_time(depth.since_ns)} ({cause_words(depth)}){until}"


def holder_notes(depths: dict[int, ProcessDepth], titles: dict[int, str]) -> list[str]:
    """What a leak report must say of each of its processes about who holds its memory, whatever it holds
    now: at SEGMENTS, nobody is known (blocks are not traced); at BLOCKS or FULL, blocks are known only since
    the depth was raised, and what the process allocated before then is in its segments, with no holder."""
    notes = []
    for pid, depth in sorted(depths.items()):
        who = f"pid {pid}" + (f" {printable(titles[pid])}" if titles.get(pid) else "")
        if depth.cause is DepthCause.NO_BLOCKS:
            notes.append(f"{who} has no PyTorch allocator kvtrace can trace: its segments' stacks are its holders")
        elif not depth.knows_holders:
            notes.append(f"{who} is traced at segments: its holders are not known yet. Blocks are not traced at "
                         "this depth, so a caching allocator's stack names who grew the cache, not who holds it; "
                         f"raise it: sudo kvtrace deep --pid {pid}")
        else:
            notes.append(f"{who}: blocks known since {clock_time(depth.since_ns)} ({cause_words(depth)}); memory "
                         "allocated before that is counted in its segments but has no holder")
    return notes


class DeepCommand:
    """Trace one process more closely for a while: its PyTorch blocks, and who holds them.

    Every process is traced at depth segments (CUDA runtime, driver and VMM calls: cheap). Under
    PyTorch's caching allocator a segment's stack only says who made the cache grow; who holds the
    memory is in the blocks. `--pid P` raises P to depth blocks (PyTorch's block probes on in P
    alone, block stacks sampled) for --for (default 10 min); --full records every block's stack
    (costs more). The agent raises processes on its own evidence too (growth, time to OOM); this
    asks for it. Blocks are known only from when the depth is raised: `kvtrace leaks` says so.
    Needs the agent's admin socket (root, or the agent's --admin-group).
    """

    EPILOG = EPILOG

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("-p", "--pid", type=positive_pid, required=True, help="the process to trace more closely")
        parser.add_argument("--for", dest="duration", metavar="DURATION", type=parse_duration,
                            help="how long: 90s, 10m, 2h, from 1s to 24h (default: the agent's, 10m)")
        which = parser.add_mutually_exclusive_group()
        which.add_argument("--full", action="store_true", help="every block's stack, not a sample (costs more)")
        which.add_argument("--off", action="store_true",
                           help="withdraw an earlier request: the agent decides on its own evidence again")
        parser.add_argument("--json", action="store_true", help="print the agent's answer as one JSON object")
        add_socket_flag(parser)

    def run(self, args: argparse.Namespace) -> int:
        if args.off and args.duration is not None:
            raise CommandError("--for has no meaning with --off (a withdrawal has no duration)", ExitCode.USAGE)
        depth = Depth.SEGMENTS if args.off else Depth.FULL if args.full else Depth.BLOCKS
        with AgentClient.from_args(args) as agent:
            response = agent.set_process_depth(args.pid, depth, args.duration or 0.0)
        if args.json:
            print(json.dumps({"requested": depth_message_to_json(response.requested),
                              "current": depth_message_to_json(response.current)
                              if response.HasField("current") else None}), file=sys.stdout)
            return ExitCode.OK
        print(request_line(response), file=sys.stdout)
        return ExitCode.OK


def request_line(response: service_pb2.SetProcessDepthResponse) -> str:
    """One line: what was asked, until when, where the process is now, and when it takes effect."""
    requested = depth_from_proto(response.requested)
    current = depth_from_proto(response.current) if response.HasField("current") else None
    if requested is None:  # a newer agent's depth: say what can be said
        return f"pid {response.requested.pid}: asked; {TICK_NOTE}"
    pid = requested.pid
    now = ""
    if current is not None:
        now = f"now {current.depth.label}" + (f" since {clock_time(current.since_ns)}"
                                              if current.cause is not DepthCause.DEFAULT else "")
    if requested.depth is Depth.SEGMENTS:
        where = f" ({now})" if now else ""
        if requested.detail == NO_REQUEST:
            return f"pid {pid}: no request to withdraw{where}; the agent decides on its own evidence, as before"
        # An agent that does not say whether there was a request: there was one if the process is at depth for it.
        had = requested.detail == REQUEST_WITHDRAWN or (current is not None and current.cause is DepthCause.OPERATOR)
        return (f"pid {pid}: {'request' if had else 'any request'} withdrawn{where}; the agent decides on its own "
                f"evidence again at its next analysis tick (≤ 1 s)")
    seconds = (requested.until_ns - requested.since_ns) / NS_PER_SECOND
    what = "every block's stack" if requested.depth is Depth.FULL else "PyTorch blocks, stacks sampled"
    return (f"pid {pid}: depth {requested.depth.label} ({what}) asked until {clock_time(requested.until_ns)} "
            f"({human_duration(seconds)}{f'; {now}' if now else ''}); {TICK_NOTE}")
