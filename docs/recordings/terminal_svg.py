"""Run a command and draw what it printed as a terminal window, in SVG, with rich.

    python terminal_svg.py OUT.svg --title "kvtrace top --input F" [--width 150] [--head 30] -- CMD...

The command's stderr (kvtrace's one-line "reading FILE: ..." note) is drawn first and dim,
then its stdout. The text goes in as `rich.text.Text`, so nothing in it (process titles,
paths, brackets) is read as rich markup. --head keeps the first lines of stdout and says how
many were left out, so a picture of a long listing does not pass for all of it.
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys

from rich.console import Console
from rich.text import Text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", help="the SVG to write")
    parser.add_argument("--title", required=True, help="the window's title: the command as typed")
    parser.add_argument("--width", type=int, default=100, help="terminal columns")
    parser.add_argument("--head", type=int, help="keep only this many lines of stdout")
    parser.add_argument("command", nargs="+", help="the command to run (after --)")
    args = parser.parse_args()

    done = subprocess.run(args.command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        print(f"{' '.join(args.command)}: exit status {done.returncode}\n{done.stderr}", file=sys.stderr)
        return 1
    lines = done.stdout.rstrip("\n").split("\n")
    left_out = 0
    if args.head is not None and len(lines) > args.head:
        left_out = len(lines) - args.head
        lines = lines[: args.head]

    console = Console(record=True, width=args.width, file=io.StringIO(), force_terminal=True)
    if done.stderr.strip():
        console.print(Text(done.stderr.rstrip("\n"), style="dim"))
    console.print(Text("\n".join(lines)))
    if left_out:
        console.print(Text(f"… {left_out} more lines", style="dim italic"))
    console.save_svg(args.output, title=args.title)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
