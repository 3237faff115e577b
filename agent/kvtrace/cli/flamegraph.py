"""`kvtrace flamegraph`: who holds device memory, by Python stack, as a flame graph."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvtrace.cli.flags import add_input_flags, add_pid_flag
from kvtrace.cli.recorded import connect
from kvtrace.config import add_socket_flag
from kvtrace.errors import CommandError, ExitCode
from kvtrace.model.events import PHYSICAL_LAYERS, Layer
from kvtrace.reports.flamegraph import estimated, folded_stacks, speedscope_document
from kvtrace.reports.output import write_whole

EPILOG = """examples:
  kvtrace flamegraph -o held.speedscope.json          # open on https://www.speedscope.app
  kvtrace flamegraph --format folded | flamegraph.pl --countname bytes > held.svg
  kvtrace flamegraph --blocks -p 1234 -o tensors.json # PyTorch's tensors, not its cached segments
  kvtrace flamegraph --input flight-20261202-oom-1234.kvtrace -o oom.json
"""

FORMATS = ("folded", "speedscope")


class FlamegraphCommand:
    """Write who holds device memory, by Python stack, as a flame graph (folded or speedscope).

    From the running agent or a recording (--input): folded stacks (flamegraph.pl, inferno) or
    speedscope JSON.

    Each path is the process, the GPU, the Python frames (outermost first) and the CUDA call; its
    width is the bytes held now. By default the physical memory (driver and VMM layers): under
    PyTorch's caching allocator that is who made the cache grow; --blocks weighs PyTorch's blocks
    instead, the tensors that hold the memory now (where its allocator probes are traced).
    """

    EPILOG = EPILOG

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        add_pid_flag(parser)
        parser.add_argument("--format", choices=FORMATS,
                            help="folded (one line per stack) or speedscope (JSON); default: speedscope for "
                                 "an -o ending in .json, else folded")
        parser.add_argument("-o", "--output", metavar="FILE", type=Path, help="write here (default: stdout)")
        parser.add_argument("--blocks", action="store_true",
                            help="weigh PyTorch's blocks (tensors) instead of the driver's segments")
        add_socket_flag(parser)
        add_input_flags(parser)

    def run(self, args: argparse.Namespace) -> int:
        output_format = args.format or ("speedscope" if args.output and args.output.suffix == ".json" else "folded")
        if args.output is not None and args.output.is_dir():
            raise CommandError(f"{args.output} is a directory: give a file name", ExitCode.USAGE)
        with connect(args) as agent:
            held = agent.held(pids=args.pid)
        entries, stacks, titles = held.entries, held.stacks, held.titles
        layers = (Layer.TORCH,) if args.blocks else PHYSICAL_LAYERS
        if output_format == "folded":
            text = "".join(line + "\n" for line in folded_stacks(entries, stacks.get, titles, layers))
        else:
            text = json.dumps(speedscope_document(entries, stacks.get, titles, layers), separators=(",", ":"))
        if not text.strip() or (output_format == "speedscope" and '"profiles":[]' in text):
            what = "PyTorch blocks" if args.blocks else "device memory"
            print(f"kvtrace: no {what} is held{' by pid ' + ','.join(map(str, args.pid)) if args.pid else ''}: "
                  "the flame graph is empty", file=sys.stderr)
        elif estimated(entries, layers):
            print("kvtrace: PyTorch blocks' stacks are sampled (--block-sample-bytes): bytes per stack are "
                  "estimates; the totals held stay exact", file=sys.stderr)
        if args.output is None:
            sys.stdout.write(text)
            return ExitCode.OK
        _write(args.output, text)
        print(f"wrote {args.output}" + (": open it on https://www.speedscope.app" if output_format == "speedscope"
                                         else ": `flamegraph.pl --countname bytes` draws it"), file=sys.stderr)
        return ExitCode.OK


def _write(path: Path, text: str) -> None:
    try:  # stacks and titles: private to the user who asked
        write_whole(path, lambda file: file.write(text.encode()), "flame graph", "held.speedscope.json", 0o600)
    except OSError as error:
        raise CommandError(f"cannot write {path}: {error.strerror}", ExitCode.USAGE) from None
