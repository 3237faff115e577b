"""`kvtrace leaks`: old outstanding device memory grouped by allocation site, most suspicious first."""
from __future__ import annotations

import argparse
import json
import sys

from kvtrace.cli.agent import human_bytes
from kvtrace.errors import ExitCode
from kvtrace.cli.tail import add_pid_flag
from kvtrace.client import AgentClient, leak_report_to_json_dict
from kvtrace.config import add_socket_flag

EPILOG = """examples:
  kvtrace leaks                         # suspects of every process, 60 s and older
  kvtrace leaks -p 1234 --min-age 600   # one process, 10 min and older
  kvtrace leaks --json | jq '.suspects[0].stack'
"""


def human_duration(seconds: float) -> str:
    """42 s, 5m12s, 3h04m, 2d03h: two units at most, as an operator reads an age."""
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def signed_bytes(value: float) -> str:
    """+1.2 MiB, -512 B, 0 B: a change, rounded to whole bytes."""
    value = round(value)
    return f"-{human_bytes(-value)}" if value < 0 else f"+{human_bytes(value)}" if value else "0 B"


def human_rate(bytes_per_second: float) -> str:
    """+1.2 MiB/s, -512 B/s, 0 B/s."""
    return f"{signed_bytes(bytes_per_second)}/s"


def non_negative_seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds <= 365 * 24 * 3600:
        raise argparse.ArgumentTypeError(f"not a number of seconds from 0 to one year: {text!r}")
    return seconds


def positive_count(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) <= 10000:
        raise argparse.ArgumentTypeError(f"not a count from 1 to 10000: {text!r}")
    return int(text)


def format_report(response) -> str:
    """memleak's shape: a summary, then per suspect its size, count, growth and age, and its stack."""
    age = human_duration(response.min_age_seconds)
    lines = [f"Leak suspects: device memory held for at least {age}, by allocation site, growing first.",
             "A suspect is old and still held, not proven leaked: weights and the KV cache are old too.",
             f"{response.allocations_considered} outstanding allocations considered, "
             f"{response.suspect_allocations} at least {age} old, in {response.suspect_count} sites."]
    if len(response.suspects) < response.suspect_count:
        lines[-1] += f" The first {len(response.suspects)}:"
    for suspect in response.suspects:
        growth = f"growth {human_rate(suspect.growth_bytes_per_second)} (15 min)"
        device = "GPU ?" if suspect.device < 0 else f"GPU {suspect.device}"
        count = f"{suspect.allocation_count} allocation{'s' if suspect.allocation_count != 1 else ''}"
        lines += ["", f"[{suspect.rank}] {human_bytes(suspect.outstanding_bytes)} in {count}, {growth}, "
                      f"oldest {human_duration(suspect.oldest_age_seconds)}",
                  f"    pid {suspect.pid} {suspect.title or '?'}, {device}"]
        if suspect.HasField("stack"):
            lines += [f"        {frame.function} ({frame.file}:{frame.line})" for frame in suspect.stack.frames]
            if suspect.stack.truncated:
                lines.append("        ... (outer frames cut at the walk's limit)")
        else:
            lines.append("        (no Python stack)")
        if suspect.HasField("native_caller") and suspect.native_caller.module:
            caller = suspect.native_caller
            where = f"{caller.symbol}+{caller.offset:#x}" if caller.symbol else f"{caller.offset:#x}"
            lines.append(f"        called CUDA from {caller.module} {where}")
        elif suspect.caller_address:
            lines.append(f"        called CUDA from {suspect.caller_address:#x}")
    return "\n".join(lines)


class LeaksCommand:
    """List leak suspects from the running kvtrace agent: device memory held for a long time.

    Outstanding device allocations (driver + VMM layers) at least --min-age old are grouped by the
    Python stack that allocated them (by the native caller where there is no Python stack), and
    ranked: the site whose memory grew most over the last 15 min first, then the largest. Old is
    not leaked: model weights and the KV cache are old too; growth is what a leak adds.
    """

    EPILOG = EPILOG

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        add_pid_flag(parser)
        parser.add_argument("--min-age", metavar="SECONDS", type=non_negative_seconds,
                            help="only allocations at least this old (default: the agent's --leak-min-age, 60)")
        parser.add_argument("-n", "--limit", metavar="N", type=positive_count, default=10,
                            help="show the N most suspicious sites (default: %(default)s)")
        parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
        add_socket_flag(parser)

    def run(self, args: argparse.Namespace) -> int:
        with AgentClient.from_args(args) as agent:
            response = agent.leak_suspects(pids=args.pid, min_age_seconds=args.min_age, limit=args.limit)
        if args.json:
            print(json.dumps(leak_report_to_json_dict(response), ensure_ascii=False), file=sys.stdout)
        else:
            print(format_report(response), file=sys.stdout)
        return ExitCode.OK
