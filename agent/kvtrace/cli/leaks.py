"""`kvtrace leaks`: old outstanding device memory grouped by allocation site, most suspicious first."""
from __future__ import annotations

import argparse
import json
import sys

from kvtrace.cli.deep import holder_notes
from kvtrace.cli.flags import add_input_flags, add_pid_flag, non_negative_seconds, positive_count
from kvtrace.cli.recorded import connect
from kvtrace.config import add_socket_flag
from kvtrace.errors import ExitCode
from kvtrace.human import device_label, human_bytes, human_duration, human_rate, printable
from kvtrace.wire import depths_by_pid, leak_report_to_json_dict

EPILOG = """examples:
  kvtrace leaks                         # suspects of every process, 60 s and older
  kvtrace leaks -p 1234 --min-age 600   # one process, 10 min and older
  kvtrace leaks --json | jq '.suspects[0].stack'
"""
# Before a suspect's bytes, count and growth that are estimates from sampled block stacks (LeakSuspect.estimated).
ESTIMATE_MARK = "~"


def format_report(response) -> str:
    """memleak's shape: a summary, then per suspect its size, count, growth and age, and its stack."""
    age = human_duration(response.min_age_seconds)
    lines = [f"Leak suspects: device memory held for at least {age}, by allocation site, growing first.",
             "A suspect is old and still held, not proven leaked: weights and the KV cache are old too.",
             f"{response.allocations_considered} outstanding allocations considered, "
             f"{response.suspect_allocations} at least {age} old, in {response.suspect_count} sites."]
    if len(response.suspects) < response.suspect_count:
        lines[-1] += f" The first {len(response.suspects)}:"
    if any(suspect.estimated for suspect in response.suspects):
        lines.append(f"{ESTIMATE_MARK} an estimate: the site's PyTorch blocks have their stacks sampled "
                     "(--block-sample-bytes); what the process holds in all stays exact.")
    depths = depths_by_pid(response.depths)
    # Before any stack: who holds each process's memory is known only from when its blocks were traced.
    titles: dict[int, str] = {}
    for suspect in response.suspects:
        titles.setdefault(suspect.pid, suspect.title)
    notes = holder_notes(depths, titles)
    if notes:
        lines += ["", *notes]
    for suspect in response.suspects:
        about = ESTIMATE_MARK if suspect.estimated else ""
        growth = f"growth {about}{human_rate(suspect.growth_bytes_per_second)} (15 min)"
        device = f"GPU {device_label(suspect.device)}"
        count = f"{about}{suspect.allocation_count} allocation{'s' if suspect.allocation_count != 1 else ''}"
        depth = depths.get(suspect.pid)
        lines += ["", f"[{suspect.rank}] {about}{human_bytes(suspect.outstanding_bytes)} in {count}, {growth}, "
                      f"oldest {human_duration(suspect.oldest_age_seconds)}",
                  f"    pid {suspect.pid} {printable(suspect.title) or '?'}, {device}"
                  + (f", depth {depth.depth.label}" if depth is not None else "")]
        if suspect.HasField("stack"):
            lines += [f"        {printable(frame.function)} ({printable(frame.file)}:{frame.line})"
                      for frame in suspect.stack.frames]
            if suspect.stack.truncated:
                lines.append("        ... (outer frames cut at the walk's limit)")
        else:
            lines.append("        (no Python stack)")
        if suspect.HasField("native_caller") and suspect.native_caller.module:
            caller = suspect.native_caller
            where = f"{caller.symbol}+{caller.offset:#x}" if caller.symbol else f"{caller.offset:#x}"
            lines.append(f"        called CUDA from {printable(caller.module)} {printable(where)}")
        elif suspect.caller_address:
            lines.append(f"        called CUDA from {suspect.caller_address:#x}")
    return "\n".join(lines)


class LeaksCommand:
    """List leak suspects from the running kvtrace agent: device memory held for a long time.

    Outstanding device allocations (driver + VMM layers) at least --min-age old are grouped by the
    Python stack that allocated them (by the native caller where there is no Python stack), and
    ranked: the site whose memory grew most over the last 15 min first, then the largest. Old is
    not leaked: model weights and the KV cache are old too; growth is what a leak adds.
    A process traced at depth segments has no traced blocks: under PyTorch's caching allocator its
    stacks name who made the cache grow, not who holds the memory; the report says so, and how to
    raise the depth (`kvtrace deep`). Where PyTorch blocks' stacks are sampled (--block-sample-bytes),
    a site's bytes, count and growth are estimates, marked "~" ("estimated" in --json).
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
        add_input_flags(parser)

    def run(self, args: argparse.Namespace) -> int:
        with connect(args) as agent:
            response = agent.leak_suspects(pids=args.pid, min_age_seconds=args.min_age, limit=args.limit)
        if args.json:
            print(json.dumps(leak_report_to_json_dict(response), ensure_ascii=False), file=sys.stdout)
        else:
            print(format_report(response), file=sys.stdout)
        return ExitCode.OK
