"""What attaching and detaching kvtrace's uprobes costs: bcc perf-event probes against uprobe_multi
links (kvtrace.sources.bpf.links), side by side, on this machine.

Goal: the agent stops within 2 s of SIGINT/SIGTERM whatever it has attached. Per library kvtrace
probes 29 functions, entry and return: 58 probes. Probes are per inode, so N = 580 is ten copies of
libcudart.so.12 (from the nvidia-cuda-runtime-cu12 wheel) in a temporary directory. One idle helper
process maps every copy (as an inference process maps its libraries), so each probe also plants
and removes a breakpoint in a live process. libcudart has 10 of the 29 functions; 19 more of its
exported cuda* functions (alphabetical) make up the 29.

Variants, each timed from the first attach to the last and from the first detach to the last:
  (a) bcc attach_uprobe + attach_uretprobe per probe, detached by BPF.cleanup() (one by one);
  (b) one uprobe_multi link per probe ("multi" in the table), closed one after another;
  (c) the same links closed from parallel threads (links.close_links, DEFAULT_CLOSE_THREADS);
  (d) one entry link and one return link per library (29 offsets each, a cookie per offset),
      closed from parallel threads;
  (e) the links of (d) closed one after another.
If (a) at N = 580 would take longer than --max-bcc-seconds (judged from N = 58), it is measured on
fewer copies and scaled up, and the table says so.

Run as root: .venv/bin/python bench/detach_cost.py [--copies 10] [--max-bcc-seconds 150]
Takes about 2 minutes here. Progress goes to stderr, the table to stdout.
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchlib import progress, require_bpf
from cuda_stubs import LIBCUDART_MISSING, library_holder, real_libcudart
from kvtrace.sources import elf
from kvtrace.sources.bpf import links
from kvtrace.sources.bpf.symbols import RUNTIME_SYMBOLS

PROBES_PER_LIBRARY = 58
FUNCTIONS_PER_LIBRARY = PROBES_PER_LIBRARY // 2
STOP_GOAL_SECONDS = 2.0

PROGRAM = b"""
int bcc_entry(struct pt_regs *ctx) { return 0; }
int bcc_return(struct pt_regs *ctx) { return 0; }
int multi_entry(struct pt_regs *ctx) { return 0; }
int multi_return(struct pt_regs *ctx) { return 0; }
"""

@dataclass(frozen=True)
class Row:
    probes: int
    variant: str
    links: int
    attach_seconds: float
    detach_seconds: float
    note: str = ""


def choose_functions(library: Path) -> list[str]:
    """RUNTIME_SYMBOLS (what kvtrace probes), then other exported cuda* functions in name order,
    29 in all."""
    from elftools.elf.elffile import ELFFile
    from elftools.elf.sections import SymbolTableSection

    with open(library, "rb") as file:
        dynsym = ELFFile(file).get_section_by_name(".dynsym")
        assert isinstance(dynsym, SymbolTableSection), f"{library} has no .dynsym"
        exported = sorted({symbol.name for symbol in dynsym.iter_symbols()
                           if symbol.name.startswith("cuda") and symbol["st_info"]["type"] == "STT_FUNC"
                           and symbol["st_shndx"] != "SHN_UNDEF"})
    extra = [name for name in exported if name not in RUNTIME_SYMBOLS]
    return list(RUNTIME_SYMBOLS) + extra[:FUNCTIONS_PER_LIBRARY - len(RUNTIME_SYMBOLS)]


def bcc_variant(copies: list[Path], functions: list[str]) -> tuple[float, float]:
    """(a): returns (attach seconds, detach seconds)."""
    from bcc import BPF

    bpf = BPF(text=PROGRAM)
    try:
        started = time.monotonic()
        for path in copies:
            for function in functions:
                bpf.attach_uprobe(name=bytes(path), sym=function.encode(), fn_name=b"bcc_entry")
                bpf.attach_uretprobe(name=bytes(path), sym=function.encode(), fn_name=b"bcc_return")
        attach_seconds = time.monotonic() - started
        assert len(bpf.uprobe_fds) == len(copies) * PROBES_PER_LIBRARY, len(bpf.uprobe_fds)
    finally:
        started = time.monotonic()
        bpf.cleanup()
        detach_seconds = time.monotonic() - started
    return attach_seconds, detach_seconds


def link_variant(programs: tuple[int, int], offsets: dict[Path, list[int]], *, per_library: bool,
                 close_threads: int) -> tuple[int, float, float]:
    """(b) to (e): returns (links, attach seconds, detach seconds)."""
    entry_fd, return_fd = programs
    made: list[links.Link] = []
    try:
        started = time.monotonic()
        for path, library_offsets in offsets.items():
            cookies = list(range(len(library_offsets)))
            for prog_fd, retprobe in ((entry_fd, False), (return_fd, True)):
                if per_library:
                    made.append(links.attach_uprobe_multi(prog_fd, path, library_offsets,
                                                          retprobe=retprobe, cookies=cookies))
                else:
                    made.extend(links.attach_uprobe_multi(prog_fd, path, [offset], retprobe=retprobe)
                                for offset in library_offsets)
        attach_seconds = time.monotonic() - started
    finally:
        detach_seconds = links.close_links(made, max_threads=close_threads)
    return len(made), attach_seconds, detach_seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--copies", type=int, default=10, help="library copies for the large N")
    parser.add_argument("--max-bcc-seconds", type=float, default=150.0,
                        help="measure (a) at the large N on fewer copies if it would take longer")
    arguments = parser.parse_args()
    require_bpf()
    reason = links.uprobe_multi_supported()
    if reason:
        sys.exit(f"no uprobe_multi links here: {reason}")
    import bcc

    library = real_libcudart()
    if library is None:
        sys.exit(LIBCUDART_MISSING)
    functions = choose_functions(library)
    with tempfile.TemporaryDirectory(prefix="kvtrace-detach-") as temporary:
        copies = []
        for index in range(arguments.copies):
            copy = Path(temporary) / str(index) / library.name
            copy.parent.mkdir()
            shutil.copyfile(library, copy)
            copies.append(copy)
        library_offsets = elf.function_file_offsets(copies[0], functions)
        assert len(library_offsets) == FUNCTIONS_PER_LIBRARY, sorted(set(functions) - set(library_offsets))
        offsets = [library_offsets[name] for name in functions]
        with library_holder(copies) as holder:
            holder.wait_ready()
            rows = measure(copies, functions, offsets, arguments.max_bcc_seconds)

    uname = platform.uname()
    print(f"detach cost on {uname.node}: Linux {uname.release}, {len(os.sched_getaffinity(0))} CPUs "
          f"(nproc), bcc {bcc.__version__}, Python {platform.python_version()}")
    print(f"library: {library} ({len(copies)} copies, all mapped by one idle process)")
    extra = functions[len(RUNTIME_SYMBOLS):]
    print(f"functions per copy: {len(RUNTIME_SYMBOLS)} kvtrace ones (cudaMalloc ... cudaSetDevice) "
          f"+ {len(extra)} more ({extra[0]} ... {extra[-1]})")
    print(f"close threads for (c) and (d): {links.DEFAULT_CLOSE_THREADS}; goal: detach within "
          f"{STOP_GOAL_SECONDS:g} s")
    print()
    print(f"{'probes':>6}  {'variant':<37} {'links':>5} {'attach s':>8} {'detach s':>8} "
          f"{'ms/probe':>8}")
    for row in rows:
        print(f"{row.probes:>6}  {row.variant:<37} {row.links:>5} {row.attach_seconds:>8.3f} "
              f"{row.detach_seconds:>8.3f} {1000 * row.detach_seconds / row.probes:>8.2f}"
              f"{'  ' + row.note if row.note else ''}")
    return 0


VARIANTS = {
    "b": "(b) multi, 1 probe/link, serial",
    "c": "(c) multi, 1 probe/link, threads",
    "d": "(d) multi, 1 link/lib+dir, threads",
    "e": "(e) multi, 1 link/lib+dir, serial",
}


def measure(copies: list[Path], functions: list[str], offsets: list[int],
            max_bcc_seconds: float) -> list[Row]:
    from bcc import BPF

    bpf = BPF(text=PROGRAM)  # the uprobe_multi programs; variant (a) compiles its own
    programs = (links.load_uprobe_multi(bpf, "multi_entry"), links.load_uprobe_multi(bpf, "multi_return"))
    rows: list[Row] = []
    small_bcc_detach_seconds = 0.0
    try:
        for library_count in (1, len(copies)):
            probes = library_count * PROBES_PER_LIBRARY
            chosen = {path: offsets for path in copies[:library_count]}
            for key, per_library, threads in (("b", False, 1), ("c", False, links.DEFAULT_CLOSE_THREADS),
                                              ("d", True, links.DEFAULT_CLOSE_THREADS),
                                              ("e", True, 1)):
                progress(f"N={probes}: {VARIANTS[key]} ...")
                link_count, attach_seconds, detach_seconds = link_variant(
                    programs, chosen, per_library=per_library, close_threads=threads)
                rows.append(Row(probes, VARIANTS[key], link_count, attach_seconds, detach_seconds))
            # (a) last: it is the slow one.
            measured_count, note = library_count, ""
            if library_count > 1 and small_bcc_detach_seconds * library_count > max_bcc_seconds:
                measured_count = max(1, min(library_count - 1,
                                            math.floor(max_bcc_seconds / small_bcc_detach_seconds)))
                note = (f"EXTRAPOLATED: measured {measured_count * PROBES_PER_LIBRARY} probes "
                        f"({measured_count} copies), scaled x{library_count / measured_count:g}")
            progress(f"N={probes}: (a) bcc on {measured_count * PROBES_PER_LIBRARY} probes ...")
            attach_seconds, detach_seconds = bcc_variant(copies[:measured_count], functions)
            if library_count == 1:
                small_bcc_detach_seconds = detach_seconds
            scale = library_count / measured_count
            rows.append(Row(probes, "(a) bcc uprobe+uretprobe, cleanup()", probes,
                            attach_seconds * scale, detach_seconds * scale, note))
    finally:
        bpf.cleanup()
    order = {"(a": 0, "(b": 1, "(c": 2, "(d": 3, "(e": 4}
    return sorted(rows, key=lambda row: (row.probes, order[row.variant[:2]]))


if __name__ == "__main__":
    sys.exit(main())
