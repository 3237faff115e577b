"""Find the ELF files (shared libraries or executables) that define CUDA allocation symbols in the
address space of running processes: any path, renamed copies, container roots, static cudart.

Attach targets are identified by (device, inode), so two paths to one file attach once.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from kvtrace.sources import procfs
from kvtrace.sources.bpf.symbols import ALL_SYMBOLS, TORCH_PROBE_NAMES, TORCH_PROVIDER, TRIGGER_SYMBOLS
from kvtrace.sources.elf import FUNCTION_TYPES, READ_ERRORS, find_symbols
from kvtrace.sources.usdt import UsdtProbe, read_usdt_probes

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
    torch_probes: tuple[UsdtProbe, ...] = ()  # pytorch:malloc / pytorch:free sites (libc10_cuda)


def executable_mappings(pid: int, proc: Path = procfs.PROC) -> dict[FileId, procfs.Mapping]:
    """File-backed executable mappings of a process, as {file id: its first such mapping}."""
    found: dict[FileId, procfs.Mapping] = {}
    for mapping in procfs.read_maps(pid, proc, executable_only=True):
        if mapping.inode:
            found.setdefault(FileId(mapping.device, mapping.inode), mapping)
    return found


def torch_allocator_probes(path: str) -> tuple[UsdtProbe, ...]:
    """PyTorch's caching allocator probes (provider `pytorch`, `malloc` and `free`) in the file,
    usable or not (an unusable one says why); () for files without them. Looked for by content,
    not by name: libc10_cuda.so under any path, or a build that links the allocator elsewhere."""
    try:
        probes = read_usdt_probes(path)
    except READ_ERRORS as error:
        log.debug("cannot read the USDT notes of %s: %s", path, error)
        return ()
    return tuple(probe for probe in probes
                 if probe.provider == TORCH_PROVIDER and probe.name in TORCH_PROBE_NAMES)


def defined_symbols(path: str, wanted: tuple[str, ...] = ALL_SYMBOLS) -> tuple[str, ...]:
    """The wanted function symbols the file defines, in `wanted` order; () unless it defines one of
    the trigger symbols' string (a quick filter: most mapped files are not CUDA libraries)."""
    found = find_symbols(path, wanted, types=FUNCTION_TYPES, triggers=TRIGGER_SYMBOLS)
    return tuple(name for name in wanted if name in found)


class Discovery:
    """Scans processes and keeps the set of attach targets with the pids that map each.

    ELF verdicts are cached per (device, inode, size, mtime), so a rescan reads only /proc/PID/maps;
    a mapped file found to be no target is not looked at again while some scanned process maps it (most of
    what a process maps: libc, the interpreter's modules), so a rescan of a process costs its maps'
    executable lines and no stat.
    """

    def __init__(self, proc: Path = procfs.PROC) -> None:
        self._proc = proc
        self._verdicts: dict[tuple, tuple[tuple[str, ...], tuple[UsdtProbe, ...]]] = {}
        self.targets: dict[FileId, Target] = {}
        # Mapped files with nothing to probe, by (device, inode, path): a file replaced (pip, a package
        # manager) is a new inode. An inode is reused only once nothing maps it: prune_not_targets forgets
        # the ones no process scanned since the last prune mapped (and the path must match too).
        self._not_targets: set[tuple[FileId, str]] = set()
        self._mapped_since_prune: set[tuple[FileId, str]] = set()

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
        for file_id, mapping in mapped.items():
            path = mapping.path
            target = self.targets.get(file_id)
            if target is None:
                seen = (file_id, path)
                self._mapped_since_prune.add(seen)
                if seen in self._not_targets:
                    continue
                open_path = self._open_path(pid, file_id, mapping)
                if open_path is None:
                    continue
                verdict = self._verdict(file_id, open_path)
                if verdict is None:
                    continue  # gone meanwhile: the next scan looks again
                symbols, torch_probes = verdict
                if not symbols and not torch_probes:
                    self._not_targets.add(seen)
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

    def prune_not_targets(self) -> None:
        """After a scan of every process: forgets the files known to offer nothing that none of the scans
        since the last prune found mapped (a file nothing maps may go, and its inode come back as another)."""
        self._not_targets &= self._mapped_since_prune
        self._mapped_since_prune = set()

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

    def forget_pid(self, pid: int) -> None:
        """Drops a pid. Its targets stay until the BPF source detaches the ones nobody maps."""
        for target in self.targets.values():
            target.pids.discard(pid)


def same_file(path: str, file_id: FileId) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    return st.st_dev == file_id.device and st.st_ino == file_id.inode
