"""`kvtrace top`: a live view of GPU memory per process and GPU, from the running agent."""
from __future__ import annotations

import argparse
import os
import select
import sys
import termios
import time
import tty

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from kvtrace.cli.deep import DEPTH_LEGEND, depth_code, raised_line
from kvtrace.cli.flags import add_input_flags, add_pid_flag, positive_seconds
from kvtrace.cli.ps import ROLES_LEGEND, roles_cell
from kvtrace.cli.recorded import connect
from kvtrace.client import AgentClient
from kvtrace.config import add_socket_flag
from kvtrace.errors import ExitCode
from kvtrace.human import device_label, human_bytes, human_duration, printable, signed_bytes
from kvtrace.wire import depth_from_proto, optional_field, role_bytes_from_proto

EPILOG = """examples:
  kvtrace top                           # every process on every GPU, fastest growing first
  kvtrace top --sort ttoom              # soonest out of memory first
  kvtrace top --once -p 1234            # one frame, for a script or a ticket
  kvtrace top --roles                   # what the memory is for: KV cache, weights, CUDA graphs, ...

keys: g, o, t sort by growth, outstanding, time-to-OOM; r shows or hides the roles; q quits.
"""

# Sort keys: each puts the row an operator should look at first on top; pid breaks ties.
SORTS = {
    "growth": lambda row: (-row.growth_bytes_per_second_15m, -row.growth_bytes_per_second_1m, row.pid),
    "outstanding": lambda row: (-row.outstanding_bytes, row.pid),
    "ttoom": lambda row: (not row.HasField("time_to_oom_seconds"), row.time_to_oom_seconds, row.pid),
}
SORT_KEYS = {"g": "growth", "o": "outstanding", "t": "ttoom"}


def _age(now_ns: int, timestamp_ns: int) -> str:
    return f"{max(0, now_ns - timestamp_ns) / 1e9:.1f} s old" if timestamp_ns else "none yet"


def _gpu(row) -> str:
    """NVML's index when known (as in the GPU lines above), else the CUDA ordinal the process saw."""
    if row.HasField("nvml_index"):
        return str(row.nvml_index)
    return f"cuda{row.device}" if row.device >= 0 else device_label(row.device)


def _unattributed(value: int | None) -> str:
    """Negative when NVML lags the trace; "-" when NVML has no figure."""
    return "-" if value is None else signed_bytes(value).lstrip("+")


def health_words(components) -> str:
    """The components up, then those down with why, apart: "up: bpf, nvml | DOWN: analysis (why)"."""
    up = [component.name for component in components if component.up]
    down = [f"{component.name} ({component.reason})" if component.reason else component.name
            for component in components if not component.up]
    return " | ".join(part for part in (f"up: {', '.join(up)}" if up else "",
                                        f"DOWN: {'; '.join(down)}" if down else "") if part)


def render_frame(info, growth, sort: str, now_ns: int, width: int = 80, interactive: bool = False,
                 roles: bool = False) -> Group:
    """One screen `width` columns wide: what to trust (age, loss, health), the GPUs, then the
    process x GPU table; with `roles`, a ROLES column (what the traced bytes are for) before the title."""
    counters = info.counters
    keys = " (g/o/t/r, q quits)" if interactive else ""
    health = printable(health_words(info.components))
    header = [
        f"kvtrace {info.version} | data {_age(now_ns, growth.timestamp_ns)}, "
        f"NVML {_age(now_ns, growth.nvml_timestamp_ns)} | sort: {sort}{keys}",
        f"lost events {counters.get('events_lost', 0)}, resyncs {counters.get('resyncs', 0)}"
        + (f" | {health}" if health else ""),
    ]
    for gpu in growth.gpus:
        header.append(f"GPU {gpu.index} {gpu.name}: used {human_bytes(gpu.used_bytes)} of "
                      f"{human_bytes(gpu.total_bytes)}, free {human_bytes(gpu.free_bytes)}")
    if not growth.gpus:
        header.append("no NVML figures: NVML used, unattributed and time-to-OOM are unknown")
    if not growth.processes:
        return Group(Text("\n".join(header)), Text(""), Text("no process holds GPU memory"))
    rows = []
    for row in sorted(growth.processes, key=SORTS[sort]):
        ttoom = optional_field(row, "time_to_oom_seconds")
        nvml_used = optional_field(row, "nvml_used_bytes")
        frag = f"{row.fragmentation.ratio * 100:.0f}%" if row.HasField("fragmentation") else "-"
        rows.append((
            str(row.pid), _gpu(row), human_bytes(row.outstanding_bytes),
            human_bytes(nvml_used) if nvml_used is not None else "-",
            _unattributed(optional_field(row, "unattributed_bytes")) + ("*" if row.predates_agent else ""),
            signed_bytes(row.growth_bytes_per_second_1m), signed_bytes(row.growth_bytes_per_second_15m),
            human_duration(ttoom) if ttoom is not None else "-", frag,
            depth_code(row.depth if row.HasField("depth") else None),
            *([roles_cell(role_bytes_from_proto(row.role_bytes), row.outstanding_bytes)] if roles else []),
            printable(row.title)))
    # Growth columns are per second; "OOM IN" is the time until the GPU's free memory is gone; FRAG
    # how scattered the free part of PyTorch's segments is, where its blocks are traced.
    # The numbers keep their width and the title gets the rest: given more than fits, rich would
    # drop whole columns, the PID among them.
    columns = ("PID", "GPU", "TRACED", "NVML", "UNATTRIB", "GROW/s 1m", "GROW/s 15m", "OOM IN", "FRAG", "DEPTH",
               *(("ROLES",) if roles else ()))
    widths = [max(len(name), *(len(cells[i]) for cells in rows)) for i, name in enumerate(columns)]
    table = Table(box=None, pad_edge=False, padding=(0, 0, 0, 1), header_style="bold")
    for name, column_width in zip(columns, widths, strict=True):
        table.add_column(name, justify="left" if name in ("ROLES", "DEPTH") else "right", no_wrap=True,
                         min_width=column_width)
    table.add_column("TITLE", no_wrap=True, overflow="ellipsis",
                     max_width=max(8, width - sum(widths) - len(columns) - 1))
    for cells in rows:
        table.add_row(*(Text(cell) for cell in cells))  # a title like "[bold]x" is text, not markup
    notes = [Text("* started before the agent: what it allocated before is in NVML only")] \
        if any(row.predates_agent for row in growth.processes) else []
    # Raised processes, each once: since when and why (few: the agent raises a bounded number).
    raised = {depth.pid: depth for depth in (depth_from_proto(row.depth) for row in growth.processes
                                             if row.HasField("depth")) if depth is not None and depth.knows_holders}
    if raised:
        notes.append(Text(DEPTH_LEGEND))
        notes.extend(Text(raised_line(raised[pid])) for pid in sorted(raised))
    if roles:
        notes.append(Text(ROLES_LEGEND))
    return Group(Text("\n".join(header)), Text(""), table, *notes)


class TopCommand:
    """Show a live view of GPU memory per process and GPU, from the running kvtrace agent.

    Per process and GPU: traced device memory (driver + VMM layers), what NVML says the process
    uses, the difference (CUDA context, NCCL, memory older than the agent), growth per second over
    1 and 15 minutes, and the time until the GPU's free memory runs out at the 15 min growth. The
    header says how far to trust it: the data's age, lost events and each component's health.
    With --roles (key r), what the traced bytes are for: KV cache, weights, CUDA graphs, activations.
    """

    EPILOG = EPILOG

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        add_pid_flag(parser)
        parser.add_argument("--sort", choices=list(SORTS), default="growth",
                            help="first the fastest growing (15 min), the largest, or the soonest "
                                 "out of memory (default: %(default)s)")
        parser.add_argument("--interval", metavar="SECONDS", type=positive_seconds, default=2.0,
                            help="refresh every SECONDS (default: %(default)s)")
        parser.add_argument("--once", action="store_true", help="print one frame and exit")
        parser.add_argument("--roles", action="store_true",
                            help="show what the traced bytes are for (KV cache, weights, ...); key r toggles it")
        add_socket_flag(parser)
        add_input_flags(parser)

    def run(self, args: argparse.Namespace) -> int:
        # A terminal (or $COLUMNS) sets the width; into a file or pipe, lines are not cut at 80.
        wide = not sys.stdout.isatty() and "COLUMNS" not in os.environ
        console = Console(file=sys.stdout, width=160 if wide else None)
        with connect(args) as agent:
            if args.once or args.input is not None:  # a recording is one moment: one frame
                console.print(render_frame(agent.info(), agent.growth(args.pid), args.sort, agent.now_ns(),
                                           console.width, roles=args.roles))
                return ExitCode.OK
            self._live(agent, args, console)
        return ExitCode.OK

    def _live(self, agent: AgentClient, args: argparse.Namespace, console: Console) -> None:
        sort, roles = args.sort, args.roles
        keys = _Keys()
        with keys, Live(console=console, screen=True, auto_refresh=False) as live:
            while True:
                frame = render_frame(agent.info(), agent.growth(args.pid), sort, time.time_ns(), console.width,
                                     keys.enabled, roles)
                live.update(frame, refresh=True)
                key = keys.read(args.interval)
                if key == "q":
                    return
                if key == "r":
                    roles = not roles
                sort = SORT_KEYS.get(key, sort)


class _Keys:
    """Single key presses from a terminal (cbreak mode, restored on exit); sleeps when there is none."""

    def __init__(self) -> None:
        self.enabled = sys.stdin.isatty()
        self._saved: list | None = None

    def __enter__(self) -> _Keys:
        if self.enabled:
            self._saved = termios.tcgetattr(sys.stdin.fileno())
            tty.setcbreak(sys.stdin.fileno())
        return self

    def __exit__(self, *exc_info) -> None:
        if self._saved is not None:
            termios.tcsetattr(sys.stdin.fileno(), termios.TCSADRAIN, self._saved)

    def read(self, timeout_seconds: float) -> str:
        """The key pressed within the timeout, "" if none."""
        if not self.enabled:
            time.sleep(timeout_seconds)
            return ""
        ready, _, _ = select.select([sys.stdin], [], [], timeout_seconds)
        return os.read(sys.stdin.fileno(), 1).decode(errors="replace").lower() if ready else ""
