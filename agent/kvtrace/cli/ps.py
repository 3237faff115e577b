"""`kvtrace ps`: processes that hold CUDA memory, with totals per GPU, from the running agent."""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

from kvtrace.cli.deep import depth_cell
from kvtrace.cli.flags import add_input_flags
from kvtrace.cli.recorded import connect
from kvtrace.config import add_socket_flag
from kvtrace.errors import ExitCode
from kvtrace.human import device_label, human_bytes, printable
from kvtrace.model.events import PHYSICAL_LAYERS, Memory
from kvtrace.model.vllm import Role
from kvtrace.wire import process_to_json_dict, role_bytes_from_proto

HEADER = (f"{'PID':>7} {'GPU':>3} {'DEVICE':>10} {'MANAGED':>10} {'PINNED':>10} {'TENSORS':>10} {'FRAG':>5} "
          f"{'OBJECTS':>8} {'DEPTH':<10}")

_COLUMNS = {Memory.DEVICE: "device", Memory.MANAGED: "managed", Memory.HOST: "pinned"}

# Short names of the roles for one-line summaries (`kvtrace ps`, `top --roles`, `kvtrace vllm`).
ROLE_ABBREVIATIONS = {Role.KV_CACHE: "kv", Role.WEIGHTS: "w", Role.CUDA_GRAPH: "graph", Role.ACTIVATIONS: "act",
                      Role.OTHER: "other", Role.UNKNOWN: "unknown"}
ROLES_LEGEND = ("ROLES: kv KV cache, w weights, graph CUDA graphs, act activations, other (no rule knows the "
                "stack), unknown (no Python stack); unsampled: traced since the agent's last site sample "
                "(every --site-sample-interval, 10 s by default)")
_GiB, _MiB, _KiB = 1 << 30, 1 << 20, 1 << 10


def compact_bytes(size: int) -> str:
    """27.0G, 1.5G, 600M, 60M, 12K, 512B: a size in four or five characters, for a summary on one line."""
    if size >= _GiB:
        return f"{size / _GiB:.1f}G"
    if size >= _MiB:
        return f"{size / _MiB:.0f}M"
    if size >= _KiB:
        return f"{size / _KiB:.0f}K"
    return f"{size}B"


def roles_cell(role_bytes: dict[Role, int], traced_bytes: int) -> str:
    """ROLES of a process on a GPU, saying what is not known yet: roles are measured at the agent's site
    samples while `traced_bytes` is current, so what came since is "unsampled" (all of it: "not sampled
    yet") and what went is "freed since"; "-" when nothing is traced."""
    known = sum(size for size in role_bytes.values() if size > 0)
    if not known:
        return "not sampled yet" if traced_bytes > 0 else "-"
    cell = compact_roles(role_bytes)
    if traced_bytes > known:
        return f"{cell} +{compact_bytes(traced_bytes - known)} unsampled"
    if traced_bytes < known:
        return f"{cell}, {compact_bytes(known - traced_bytes)} freed since"
    return cell


def compact_roles(role_bytes: dict[Role, int]) -> str:
    """`kv 27.0G w 0.5G act 1.2G`: roles holding any bytes, largest first; "-" when none is known."""
    held = sorted(((size, role) for role, size in role_bytes.items() if size > 0), key=lambda item: (-item[0], item[1]))
    return " ".join(f"{ROLE_ABBREVIATIONS.get(role, role.label)} {compact_bytes(size)}" for size, role in held) or "-"


class PsCommand:
    """List the processes that hold CUDA memory, from the running kvtrace agent.

    One line per process and GPU: device memory, managed memory and pinned host memory held
    (driver + VMM layers, so runtime calls are not counted twice), and the number of objects. Where
    PyTorch's blocks are traced: TENSORS, the bytes its caching allocator has handed to tensors, and
    FRAG, how scattered the rest of its segments is (1 - largest free stretch / free bytes), as of
    the agent's last site sample. ROLES splits the device memory by what it is for, largest first:
    kv (vLLM's KV cache), w (weights), graph (CUDA graph pools), act (activations and workspace),
    other (a Python stack no rule knows), unknown (no Python stack), as of the agent's last site sample:
    bytes traced since are "unsampled"; `kvtrace vllm` has the engines.
    DEPTH is how closely the agent traces the process and for how long: segments (CUDA calls
    only: a stack there says who grew PyTorch's cache, not who holds it), blocks (PyTorch's blocks
    too, stacks sampled) or full (every block's stack); `kvtrace deep` raises it, --json has why.
    """

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--json", action="store_true", help="one JSON object per process and line")
        add_socket_flag(parser)
        add_input_flags(parser)

    def run(self, args: argparse.Namespace) -> int:
        with connect(args) as agent:
            processes = agent.processes()
            growth = agent.growth() if not args.json else None
            now_ns = agent.now_ns()
        out = sys.stdout
        if args.json:
            for process in processes:
                out.write(json.dumps(process_to_json_dict(process), separators=(",", ":")) + "\n")
            return ExitCode.OK
        allocator = {(row.pid, row.device): row.fragmentation for row in growth.processes
                     if row.HasField("fragmentation")} if growth is not None else {}
        roles = {(row.pid, row.device): roles_cell(role_bytes_from_proto(row.role_bytes), row.outstanding_bytes)
                 for row in growth.processes} if growth is not None else {}
        lines: list[tuple[str, str, str]] = []  # (the figures, ROLES, TITLE): ROLES is as wide as its widest
        for process in processes:
            per_device: defaultdict[int, dict[str, int]] = defaultdict(
                lambda: {"device": 0, "managed": 0, "pinned": 0, "objects": 0})
            for total in process.totals:
                column = _COLUMNS.get(Memory(total.memory)) if total.memory else None
                if total.layer in PHYSICAL_LAYERS and column:
                    row = per_device[total.device]
                    row[column] += total.size_bytes
                    row["objects"] += total.object_count
            if not per_device:  # only address space or runtime-layer entries: still list the process
                per_device[-1]["objects"] = 0
            depth = depth_cell(process.depth if process.HasField("depth") else None, now_ns)
            for device, row in sorted(per_device.items()):
                gpu = device_label(device)
                blocks = allocator.get((process.pid, device))
                tensors = human_bytes(blocks.allocated_bytes) if blocks is not None else "-"
                frag = f"{blocks.ratio * 100:.0f}%" if blocks is not None else "-"
                lines.append((f"{process.pid:>7} {gpu:>3} {human_bytes(row['device']):>10} "
                              f"{human_bytes(row['managed']):>10} {human_bytes(row['pinned']):>10} {tensors:>10} "
                              f"{frag:>5} {row['objects']:>8} {depth:<10}", roles.get((process.pid, device), "-"),
                              printable(process.title or process.comm)))
        width = max([len("ROLES"), *(len(line[1]) for line in lines)])
        print(f"{HEADER} {'ROLES':<{width}} TITLE", file=out)
        for figures, role_text, title in lines:
            print(f"{figures} {role_text:<{width}} {title}", file=out)
        for line in predates_agent_notes(growth):
            print(line, file=out)
        return ExitCode.OK


def predates_agent_notes(growth) -> list[str]:
    """A line for each process that started before the agent and holds more than it traced: what
    it allocated before is in NVML's figure only (after an agent restart, the bulk of it)."""
    notes = []
    for row in growth.processes if growth is not None else ():
        if row.predates_agent and row.HasField("nvml_used_bytes") and row.nvml_used_bytes > row.outstanding_bytes:
            where = f"GPU {row.nvml_index}" if row.HasField("nvml_index") else "its GPU"
            notes.append(f"pid {row.pid} predates the agent: NVML shows {human_bytes(row.nvml_used_bytes)} on "
                         f"{where}, {human_bytes(row.outstanding_bytes)} traced; what it allocated before the "
                         f"agent started is not traced")
    return notes
