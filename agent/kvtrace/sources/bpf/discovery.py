"""Find the ELF files (shared libraries or executables) that define CUDA allocation symbols in the
address space of running processes: any path, renamed copies, container roots, static cudart.

Attach targets are identified by (device, inode), so two paths to one file attach once.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

from kvtrace.sources import procfs
from kvtrace.sources.bpf.symbols import ALL_SYMBOLS, HOOK_PROBE, TORCH_PROBES, TRIGGER_SYMBOLS
from kvtrace.sources.bpf.usdt import UsdtProbe, read_usdt_probes
from kvtrace.sources.elf import FUNCTION_TYPES, READ_ERRORS, find_symbols

log = logging.getLogger(__name__)

@dataclass(frozen=True, slots=True)
class FileId:
    """A file as the kernel knows it: uprobes are per inode."""

    device: int
    inode: int


@dataclass(slots=True)
class Target:
    """An ELF file defining some of the traced symbols, or carrying PyTorch's allocator probes."""

    file_id: FileId
    path: str  # a path that opens it from the agent's mount namespace
    symbols: tuple[str, ...]
    pids: set[int] = field(default_factory=set)
    torch_probes: tuple[UsdtProbe, ...] = ()  # pytorch:malloc / pytorch:free sites (libc10_cuda), or kvtrace:blocks

    @property
    def torch_hook(self) -> bool:
        """kvtrace's own PyTorch hook (sources/torch_hook): its kvtrace:blocks site hands over the blocks that
        pytorch:malloc/free would, in batches; a process that maps it is traced through it instead."""
        return any((probe.provider, probe.name) == HOOK_PROBE for probe in self.torch_probes)


def executable_mappings(pid: int, proc: Path = procfs.PROC) -> dict[FileId, procfs.Mapping]:
    """File-backed executable mappings of a process, as {file id: its first such mapping}."""
    found: dict[FileId, procfs.Mapping] = {}
    for mapping in procfs.read_maps(pid, proc, executable_only=True):
        if mapping.inode:
            found.setdefault(FileId(mapping.device, mapping.inode), mapping)
    return found


def torch_allocator_probes(path: str) -> tuple[UsdtProbe, ...]:
    """PyTorch's caching allocator probes (provider `pytorch`, `malloc` and `free`; or kvtrace's own hook's
    `kvtrace:blocks`) in the file, usable or not (an unusable one says why); () for files without them. Looked for
    by content, not by name: libc10_cuda.so under any path, or a build that links the allocator elsewhere."""
    try:
        probes = read_usdt_probes(path)
    except READ_ERRORS as error:
        log.debug("cannot read the USDT notes of %s: %s", path, error)
        return ()
    return tuple(probe for probe in probes if (probe.provider, probe.name) in TORCH_PROBES)


def defined_symbols(path: str, wanted: tuple[str, ...] = ALL_SYMBOLS) -> tuple[str, ...]:
    """The wanted function symbols the file defines, in `wanted` order; () unless it defines one of
    the trigger symbols' string (a quick filter: most mapped files are not CUDA libraries)."""
    found = find_symbols(path, wanted, types=FUNCTION_TYPES, triggers=TRIGGER_SYMBOLS)
    return tuple(name for name in wanted if name in found)


class Discovery:
    """Scans processes and keeps the set of attach targets with the pids that map each.

    ELF verdicts are cached per (device, inode, size, mtime), so a rescan reads only /proc/PID/maps;
    a file a process maps and that offers nothing (most of what it maps: libc, the interpreter's modules)
    is not looked at again in that process while it keeps it mapped, so a rescan of a known process
    costs its maps' executable lines and no stat. (A file rewritten in place under the processes that
    map it, same inode and path, is not looked at again in those: they would crash first.)
    """

    def __init__(self, proc: Path = procfs.PROC) -> None:
        self._proc = proc
        self._verdicts: dict[tuple, tuple[tuple[str, ...], tuple[UsdtProbe, ...]]] = {}
        self.targets: dict[FileId, Target] = {}
        # pid -> the (device, inode, path) of files it maps that offer nothing, kept while it maps them: a
        # new process (a new pid) looks at what it maps once, so a file replaced by another that got its
        # inode number back is looked at in the processes that map the new one.
        self._not_targets: dict[int, set[tuple[FileId, str]]] = {}

    def _open_path(self, pid: int, file_id: FileId, mapping: procfs.Mapping) -> str | None:
        """A path that opens this very file: through the process's root, or, when that path now
        holds another file (replaced in place since the process mapped it: `pip install -U`) or
        none (deleted), through the mapping itself (/proc/PID/map_files, the mapped inode)."""
        for candidate in (procfs.path_in_root(pid, mapping.path, self._proc),
                          procfs.mapped_file(pid, mapping, self._proc)):
            if same_file(str(candidate), file_id):
                return str(candidate)
        return None

    def _verdict(self, file_id: FileId, path: str) -> tuple[tuple[str, ...], tuple[UsdtProbe, ...]] | None:
        """(CUDA symbols, PyTorch allocator probes) the file offers, both () for most files; None where it
        cannot be looked at now."""
        try:
            st = os.stat(path)
        except OSError:
            return None
        cache_key = (file_id.device, file_id.inode, st.st_size, st.st_mtime_ns)
        verdict = self._verdicts.get(cache_key)
        if verdict is None:
            symbols = defined_symbols(path)
            verdict = (symbols if TRIGGER_SYMBOLS.intersection(symbols) else (), torch_allocator_probes(path))
            self._verdicts[cache_key] = verdict
        return verdict

    def scan_pid(self, pid: int) -> list[Target]:
        """Records which targets `pid` maps now; returns the targets that are new to the agent."""
        new: list[Target] = []
        mapped = executable_mappings(pid, self._proc)
        known = self._not_targets.get(pid, set())
        not_targets = self._not_targets[pid] = set()  # what it still maps of those, and new ones
        for file_id, mapping in mapped.items():
            path = mapping.path
            target = self.targets.get(file_id)
            if target is None:
                seen = (file_id, path)
                if seen in known:
                    not_targets.add(seen)
                    continue
                open_path = self._open_path(pid, file_id, mapping)
                if open_path is None:
                    continue
                verdict = self._verdict(file_id, open_path)
                if verdict is None:
                    continue  # gone meanwhile: the next scan looks again
                symbols, torch_probes = verdict
                if not symbols and not torch_probes:
                    not_targets.add(seen)
                    continue
                # Prefer the plain path when it is the same file (nicer in reports).
                if os.path.exists(path) and same_file(path, file_id):
                    open_path = path
                target = self.targets[file_id] = Target(file_id, open_path, symbols, torch_probes=torch_probes)
                new.append(target)
            target.pids.add(pid)
        for file_id, target in self.targets.items():
            if file_id not in mapped:
                target.pids.discard(pid)
        return new

    def add_file(self, path: str) -> Target | None:
        """A library at a known location, attached before any process maps it: a process that
        dlopens it later is traced from its first call (uprobes are installed at mmap time)."""
        try:
            st = os.stat(path)
        except OSError:
            return None
        file_id = FileId(st.st_dev, st.st_ino)
        if file_id in self.targets:
            return None
        verdict = self._verdict(file_id, path)
        if verdict is None or not any(verdict):
            return None
        symbols, torch_probes = verdict
        target = self.targets[file_id] = Target(file_id, path, symbols, torch_probes=torch_probes)
        return target

    def forget_other_pids(self, pids: Collection[int]) -> None:
        """After a scan of `pids`: what was remembered of any other process goes (most processes that end
        held nothing traced and are never forgotten one by one)."""
        for pid in [pid for pid in self._not_targets if pid not in pids]:
            del self._not_targets[pid]

    def forget_pid(self, pid: int) -> None:
        """Drops a pid. Its targets stay until the BPF source detaches the ones nobody maps."""
        self._not_targets.pop(pid, None)
        for target in self.targets.values():
            target.pids.discard(pid)


def same_file(path: str, file_id: FileId) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    return st.st_dev == file_id.device and st.st_ino == file_id.inode
