"""Find the ELF files (shared libraries or executables) that define CUDA allocation symbols in the
address space of running processes: any path, renamed copies, container roots, static cudart.

Attach targets are identified by (device, inode), so two paths to one file attach once.
"""
from __future__ import annotations

import logging
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile

from kvtrace.sources.bpf.symbols import ALL_SYMBOLS, TRIGGER_SYMBOLS

log = logging.getLogger(__name__)

# "7f..-7f.. r-xp 00000000 fd:01 1234  /usr/lib/libcudart.so.12" (the path may contain spaces)
_MAPS_LINE = re.compile(
    r"^[0-9a-f]+-[0-9a-f]+ (?P<perms>\S{4}) [0-9a-f]+ (?P<major>[0-9a-f]+):(?P<minor>[0-9a-f]+) "
    r"(?P<inode>\d+)\s+(?P<path>/.*)$")


@dataclass(frozen=True, slots=True)
class FileId:
    """A file as the kernel knows it: uprobes are per inode."""

    device: int
    inode: int


@dataclass(slots=True)
class Target:
    """An ELF file defining some of the traced symbols."""

    file_id: FileId
    path: str  # a path that opens it from the agent's mount namespace
    symbols: tuple[str, ...]
    pids: set[int] = field(default_factory=set)


def executable_mappings(pid: int, proc: Path = Path("/proc")) -> dict[FileId, str]:
    """File-backed executable mappings of a process, as {file id: path as the process sees it}."""
    found: dict[FileId, str] = {}
    try:
        text = (proc / str(pid) / "maps").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return found
    for line in text.splitlines():
        match = _MAPS_LINE.match(line)
        if not match or "x" not in match["perms"] or match["inode"] == "0":
            continue
        file_id = FileId(os.makedev(int(match["major"], 16), int(match["minor"], 16)),
                         int(match["inode"]))
        found.setdefault(file_id, match["path"].removesuffix(" (deleted)"))
    return found


_ELF64_SYM = struct.Struct("<IBBHQQ")  # st_name, st_info, st_other, st_shndx, st_value, st_size
_STT_FUNC, _STT_GNU_IFUNC = 2, 10


def defined_symbols(path: str, wanted=ALL_SYMBOLS) -> tuple[str, ...]:
    """The wanted function symbols the ELF file defines (.dynsym or .symtab), in `wanted` order.

    Discovery asks this of every executable file any process maps, so it must be fast: a symbol
    table whose string table does not even contain a trigger name is skipped without parsing, and
    the rest is decoded with struct (pyelftools' per-symbol parsing takes seconds on a large
    library).
    """
    names = set(wanted)
    triggers = [name.encode() + b"\0" for name in TRIGGER_SYMBOLS]
    found: set[str] = set()
    try:
        with open(path, "rb") as stream:
            elf = ELFFile(stream)
            if elf.elfclass != 64 or not elf.little_endian:
                return ()
            for section in elf.iter_sections():
                if section["sh_type"] not in ("SHT_SYMTAB", "SHT_DYNSYM"):
                    continue
                strtab = elf.get_section(section["sh_link"]).data()
                if not any(trigger in strtab for trigger in triggers):
                    continue
                for st_name, st_info, _other, st_shndx, st_value, _size in \
                        _ELF64_SYM.iter_unpack(section.data()):
                    if st_shndx == 0 or st_value == 0 or (st_info & 0xF) not in (_STT_FUNC, _STT_GNU_IFUNC):
                        continue
                    end = strtab.find(b"\0", st_name)
                    # Versioned names ("cudaMalloc@@libcudart.so.12") only appear in some tools.
                    name = strtab[st_name:end].decode("ascii", "replace").split("@", 1)[0]
                    if name in names:
                        found.add(name)
    except (OSError, ELFError, ValueError, struct.error) as error:
        log.debug("not an ELF we can read: %s (%s)", path, error)
        return ()
    return tuple(name for name in wanted if name in found)


class Discovery:
    """Scans processes and keeps the set of attach targets with the pids that map each.

    ELF verdicts are cached per (device, inode, size, mtime), so a rescan reads only /proc/PID/maps.
    """

    def __init__(self, proc: Path = Path("/proc")) -> None:
        self._proc = proc
        self._verdicts: dict[tuple, tuple[str, ...]] = {}
        self.targets: dict[FileId, Target] = {}

    def _open_path(self, pid: int, path: str) -> str | None:
        # Through the process's root, so files inside containers resolve from the host.
        candidate = self._proc / str(pid) / "root" / path.lstrip("/")
        try:
            os.stat(candidate)
            return str(candidate)
        except OSError:
            return None

    def _symbols_of(self, file_id: FileId, path: str) -> tuple[str, ...]:
        try:
            st = os.stat(path)
        except OSError:
            return ()
        cache_key = (file_id.device, file_id.inode, st.st_size, st.st_mtime_ns)
        verdict = self._verdicts.get(cache_key)
        if verdict is None:
            symbols = defined_symbols(path)
            verdict = symbols if TRIGGER_SYMBOLS.intersection(symbols) else ()
            self._verdicts[cache_key] = verdict
        return verdict

    def scan_pid(self, pid: int) -> list[Target]:
        """Records which targets `pid` maps now; returns the targets that are new to the agent."""
        new: list[Target] = []
        mapped = executable_mappings(pid, self._proc)
        for file_id, path in mapped.items():
            target = self.targets.get(file_id)
            if target is None:
                open_path = self._open_path(pid, path)
                if open_path is None:
                    continue
                symbols = self._symbols_of(file_id, open_path)
                if not symbols:
                    continue
                # Prefer the plain path when it is the same file (nicer in reports).
                if os.path.exists(path) and _same_file(path, file_id):
                    open_path = path
                target = self.targets[file_id] = Target(file_id, open_path, symbols)
                new.append(target)
            target.pids.add(pid)
        for file_id, target in self.targets.items():
            if file_id not in mapped:
                target.pids.discard(pid)
        return new

    def scan_all(self) -> list[Target]:
        new: list[Target] = []
        for entry in os.scandir(self._proc):
            if entry.name.isdigit():
                new.extend(self.scan_pid(int(entry.name)))
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
        symbols = self._symbols_of(file_id, path)
        if not symbols:
            return None
        target = self.targets[file_id] = Target(file_id, path, symbols)
        return target

    def forget_pid(self, pid: int) -> None:
        """Drops a pid. Targets stay attached: uprobes on a file nobody maps cost nothing, while
        detaching costs the kernel an RCU grace period per probe (seconds for a library)."""
        for target in self.targets.values():
            target.pids.discard(pid)


def _same_file(path: str, file_id: FileId) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    return st.st_dev == file_id.device and st.st_ino == file_id.inode
