"""kvtrace's PyTorch hook inside a traced process (sources/torch_hook/hook.cpp) as the agent sees it: its probe
site, where its tracker is, and the settings the agent writes into it.

The hook keeps two things in its library's writable .probes section, at symbols the agent finds in the file:
`kvtrace_hook_state` (loaded, armed, attached, or refused by the allocator: a refused hook must not keep PyTorch's own
sites off) and `kvtrace_hook_settings_now`, which it reads at every allocator event: the mean S of its byte countdown
(which blocks' stacks are walked), its batch and its flush interval. The agent writes S where it links the hook's site
for a process: the same S the kernel and the decoder use for every other block (--block-sample-bytes; 0 at depth
FULL: every block's stack). Both go through /proc/PID/mem (root; the agent already raises the site's semaphore in
that memory through the kernel). The write is made only where the mapping is the hook's own file (device and inode)
and the settings read back as the hook's (a batch of 1..32): a wrong address must never be written. The hook also
hands its S over with every batch, so the kernel records what the hook really did where a write failed.
"""
from __future__ import annotations

import ctypes
import enum
import functools
import logging
from pathlib import Path

from kvtrace.sources import procfs
from kvtrace.sources.bpf.symbols import HOOK_PROBE
from kvtrace.sources.bpf.usdt import UsdtProbe, read_usdt_probes
from kvtrace.sources.elf import READ_ERRORS, find_symbols, first_load_vaddr

log = logging.getLogger(__name__)

# = torch_hook's names (that package runs inside the engine; the bpf wing does not import it)
SETTINGS_SYMBOL = "kvtrace_hook_settings_now"
STATE_SYMBOL = "kvtrace_hook_state"
BATCH_MAX = 32  # = hook.cpp KVTRACE_HOOK_BATCH_MAX = probes/hook.h KVT_HOOK_BATCH (tests/unit/test_hook_abi.py)


class HookState(enum.IntEnum):
    """hook.cpp's kvtrace_hook_state."""

    LOADED = 0
    ARMED = 1
    ATTACHED = 2
    REFUSED = 3


class HookSettings(ctypes.Structure):
    """hook.cpp's struct kvtrace_hook_settings."""

    _fields_ = [("sample_bytes", ctypes.c_uint64), ("batch", ctypes.c_uint32), ("flush_interval_ms", ctypes.c_uint32)]


def probe_site(library: str | Path) -> UsdtProbe:
    """The hook library's usable kvtrace:blocks site: where a uprobe goes, and its semaphore (benches and tests link
    it themselves; the agent finds it by Discovery). Raises ValueError for a file without one."""
    for probe in read_usdt_probes(library):
        if (probe.provider, probe.name) == HOOK_PROBE and probe.problem is None:
            return probe
    raise ValueError(f"{library} has no usable {':'.join(HOOK_PROBE)} probe site: not kvtrace's PyTorch hook")


@functools.lru_cache(maxsize=64)
def _symbol_offsets(library: str, file_id: tuple[int, int]) -> dict[str, int]:
    """{symbol: its offset from where the library's first page is loaded}, for the hook's state and settings: read
    from the file once (file_id, its device and inode, keys the cache: a new file at the same path is read anew)."""
    values = find_symbols(library, [SETTINGS_SYMBOL, STATE_SYMBOL])
    first_load = first_load_vaddr(library) if values else 0
    return {symbol: value - first_load for symbol, value in values.items()}


def _address(pid: int, library: str, file_id: tuple[int, int], symbol: str, proc: Path) -> int | None:
    """Where `symbol` of the hook's `library` (file_id: its device and inode) lies in `pid`'s memory."""
    offset = _symbol_offsets(library, file_id).get(symbol)
    if offset is None:
        return None
    base = next((mapping.start for mapping in procfs.read_maps(pid, proc)
                 if (mapping.device, mapping.inode) == file_id and mapping.file_offset == 0), None)
    return None if base is None else base + offset


def read_state(pid: int, library: str, file_id: tuple[int, int], proc: Path = procfs.PROC) -> HookState | None:
    """Where the hook's tracker is in `pid`; None where it cannot be read (the process gone, another file)."""
    try:
        address = _address(pid, library, file_id, STATE_SYMBOL, proc)
        if address is None:
            return None
        with procfs.ProcessMemory(pid, proc) as memory:
            value = memory.read_u8(address)
    except (*READ_ERRORS, procfs.MemoryReadError):
        return None
    return HookState(value) if value in HookState._value2member_map_ else None


def write_sample_bytes(pid: int, library: str, file_id: tuple[int, int], sample_bytes: int,
                       proc: Path = procfs.PROC) -> str:
    """Sets the hook's S in `pid`; "" when written, else why not (the caller says so where health is read)."""
    try:
        address = _address(pid, library, file_id, SETTINGS_SYMBOL, proc)
        if address is None:
            return f"pid {pid} does not map {library} with its {SETTINGS_SYMBOL}"
        with procfs.ProcessMemory(pid, proc) as memory:
            now = HookSettings.from_buffer_copy(memory.read(address, ctypes.sizeof(HookSettings)))
        if not 1 <= now.batch <= BATCH_MAX:
            return f"the settings read in pid {pid} at {address:#x} are not the hook's (batch {now.batch})"
        procfs.write_memory(pid, address, bytes(ctypes.c_uint64(sample_bytes)), proc)  # the struct's first field
    except (*READ_ERRORS, procfs.MemoryReadError) as error:
        return f"writing the PyTorch hook's sample size in pid {pid} failed: {error}"
    return ""
