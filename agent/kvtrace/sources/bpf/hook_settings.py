"""kvtrace's PyTorch hook inside a traced process (sources/torch_hook/hook.cpp) as the agent sees it: its probe
site, and the settings the agent writes into it.

The hook reads `kvtrace_hook_settings_now` (in its library's writable .probes section) at every allocator event:
the mean S of its byte countdown (which blocks' stacks are walked) and its batch. The agent writes S where it links
the hook's site for a process, the same S the kernel and the decoder use for every other block (--block-sample-bytes;
0 at depth FULL: every block's stack), through /proc/PID/mem (root; the agent already raises the site's semaphore in
that memory through the kernel). The hook also hands its S over with every batch, so the kernel records what the hook
really did even where this write failed.
"""
from __future__ import annotations

import ctypes
import logging
from pathlib import Path

from kvtrace.sources import procfs
from kvtrace.sources.bpf.symbols import HOOK_PROBE
from kvtrace.sources.bpf.usdt import UsdtProbe, read_usdt_probes
from kvtrace.sources.elf import find_symbols, first_load_vaddr

log = logging.getLogger(__name__)

SETTINGS_SYMBOL = "kvtrace_hook_settings_now"  # = torch_hook.SETTINGS_SYMBOL (that module runs in the engine)


def probe_site(library: str | Path) -> UsdtProbe:
    """The hook library's usable kvtrace:blocks site: where a uprobe goes, and its semaphore (benches and tests link
    it themselves; the agent finds it by Discovery). Raises ValueError for a file without one."""
    for probe in read_usdt_probes(library):
        if (probe.provider, probe.name) == HOOK_PROBE and probe.problem is None:
            return probe
    raise ValueError(f"{library} has no usable {':'.join(HOOK_PROBE)} probe site: not kvtrace's PyTorch hook")


def write_sample_bytes(pid: int, library: str, sample_bytes: int, proc: Path = procfs.PROC) -> bool:
    """Sets the hook's S in `pid` (which maps `library`); False, logged, where it could not be written."""
    symbol = find_symbols(library, [SETTINGS_SYMBOL]).get(SETTINGS_SYMBOL)
    if symbol is None:
        log.warning("%s has no %s: not kvtrace's PyTorch hook, its sampling is left as it is", library, SETTINGS_SYMBOL)
        return False
    try:
        library_id = Path(library).stat()
        base = next((mapping.start for mapping in procfs.read_maps(pid, proc)
                     if mapping.inode == library_id.st_ino and mapping.file_offset == 0), None)
        if base is None:
            log.warning("pid %d does not map %s at offset 0: the hook's sampling is left as it is", pid, library)
            return False
        address = base - first_load_vaddr(library) + symbol
        with open(proc / str(pid) / "mem", "r+b", buffering=0) as memory:
            memory.seek(address)
            memory.write(bytes(ctypes.c_uint64(sample_bytes)))  # the struct's first field
    except OSError as error:
        log.warning("writing the PyTorch hook's sample size in pid %d failed: %s (its batches still say what it "
                    "sampled at)", pid, error)
        return False
    return True
