"""ELF files: the one module that reads symbol tables and load segments of executables and
libraries (pyelftools for the structure; the hot symbol scans by hand, see `find_symbols`).

Used to find CUDA libraries by symbol (discovery), the CPython runtime's globals (python/runtime),
native return addresses (native), and the file offsets that uprobes take.
"""
from __future__ import annotations

import bisect
import logging
import os
import struct
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, cast

from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile
from elftools.elf.sections import SymbolTableSection

log = logging.getLogger(__name__)

_ELF64_SYM = struct.Struct("<IBBHQQ")  # st_name, st_info, st_other, st_shndx, st_value, st_size
STT_OBJECT, STT_FUNC, STT_GNU_IFUNC = 1, 2, 10
FUNCTION_TYPES = (STT_FUNC, STT_GNU_IFUNC)

# What reading a damaged or foreign file can raise; the callers treat all of it as "no symbols".
READ_ERRORS = (OSError, ELFError, ValueError, struct.error)

# Reads up to this size go straight to the file (pyelftools parses field by field: keep it fast).
_SMALL_READ_BYTES = 1 << 16


class _BoundedFile:
    """A file for ELFFile whose reads never ask for more than the file holds.

    pyelftools reads a section's or a note's data with one read() of the size its header states:
    a damaged or hostile file (any file a traced process maps) that says 2**63 bytes made it
    allocate that much (MemoryError, or gigabytes for a moment). Here such a read gets what the
    file has, and the parse then fails as a short file does (READ_ERRORS)."""

    def __init__(self, file: BinaryIO) -> None:
        position = file.tell()
        self._size_bytes = file.seek(0, os.SEEK_END)
        file.seek(position)
        self._file = file
        self.seek, self.tell, self.close = file.seek, file.tell, file.close

    def read(self, size: int = -1) -> bytes:
        if size > _SMALL_READ_BYTES:
            size = max(0, min(size, self._size_bytes - self._file.tell()))
        return self._file.read(size)


def elf_file(file: BinaryIO) -> ELFFile:
    """ELFFile over an open binary file, with reads bounded by the file's size (see _BoundedFile).
    Raises READ_ERRORS for what is not a readable ELF file."""
    return ELFFile(cast(BinaryIO, _BoundedFile(file)))  # what ELFFile uses of a file: read, seek, tell


def find_symbols(path: str | Path, wanted: Collection[str], *, types: Collection[int] = (),
                 triggers: Iterable[str] = ()) -> dict[str, int]:
    """{name: st_value} of the wanted symbols the file defines (.symtab or .dynsym), of the given
    symbol types (STT_*; empty: any); {} for a file that is not a 64-bit little-endian ELF or cannot
    be read.

    Discovery asks this of every executable file any process maps, so it must be fast: a symbol
    table whose string table contains none of `triggers` (when given) is skipped without parsing,
    and the rest is decoded with struct (pyelftools' per-symbol parsing takes seconds on a large
    library). Versioned names ("cudaMalloc@@libcudart.so.12", some tools) count as their base name.
    """
    try:
        with open(path, "rb") as stream:
            return _symbols_in(elf_file(stream), wanted, types, triggers)
    except READ_ERRORS as error:
        log.debug("not an ELF we can read: %s (%s)", path, error)
        return {}


def _symbols_in(elf: ELFFile, wanted: Collection[str], types: Collection[int],
                triggers: Iterable[str] = ()) -> dict[str, int]:
    """find_symbols on an open file."""
    if elf.elfclass != 64 or not elf.little_endian:
        return {}
    names = set(wanted)
    trigger_bytes = [name.encode() + b"\0" for name in triggers]
    found: dict[str, int] = {}
    for section in elf.iter_sections():
        if section["sh_type"] not in ("SHT_SYMTAB", "SHT_DYNSYM"):
            continue
        strtab = elf.get_section(section["sh_link"]).data()
        if trigger_bytes and not any(trigger in strtab for trigger in trigger_bytes):
            continue
        for st_name, st_info, _other, st_shndx, st_value, _size in _ELF64_SYM.iter_unpack(section.data()):
            if st_shndx == 0 or st_value == 0 or (types and st_info & 0xF not in types):
                continue
            end = strtab.find(b"\0", st_name)
            name = strtab[st_name:end].decode("ascii", "replace").split("@", 1)[0]
            if name in names:
                found.setdefault(name, st_value)
    return found


@dataclass(frozen=True, slots=True)
class Segment:
    """A PT_LOAD segment: where part of the file lands in the ELF's virtual address space."""

    file_offset: int
    vaddr: int
    file_size: int
    flags: int = 0  # PF_X (1), PF_W (2), PF_R (4)


def load_segments(elf: ELFFile) -> list[Segment]:
    return [Segment(segment["p_offset"], segment["p_vaddr"], segment["p_filesz"], segment["p_flags"])
            for segment in elf.iter_segments() if segment["p_type"] == "PT_LOAD"]


def segment_at(segments: Iterable[Segment], vaddr: int) -> Segment | None:
    """The segment whose file-backed part holds this ELF virtual address, None if none does."""
    for segment in segments:
        if segment.vaddr <= vaddr < segment.vaddr + segment.file_size:
            return segment
    return None


def vaddr_to_file_offset(segments: Iterable[Segment], vaddr: int) -> int | None:
    """The file offset of an ELF virtual address (what uprobes take), None outside every segment."""
    segment = segment_at(segments, vaddr)
    return None if segment is None else vaddr - segment.vaddr + segment.file_offset


def file_offset_to_vaddr(segments: Iterable[Segment], file_offset: int) -> int:
    """The ELF virtual address of a file offset; the offset itself outside every segment."""
    for segment in segments:
        if segment.file_offset <= file_offset < segment.file_offset + segment.file_size:
            return file_offset - segment.file_offset + segment.vaddr
    return file_offset


def first_load_vaddr(path: str | Path) -> int:
    """The page-aligned virtual address of the first PT_LOAD: a mapping at file offset 0 starts
    there, so its run-time start minus this is the load bias."""
    with open(path, "rb") as stream:
        return min(segment.vaddr for segment in load_segments(elf_file(stream))) & ~0xFFF


def function_file_offsets(path: str | Path, names: Collection[str]) -> dict[str, int]:
    """{name: file offset} of the functions the file defines: where a uprobe goes. An
    STT_GNU_IFUNC is left out on purpose: its value is the resolver, not the function a call
    reaches."""
    return symbol_file_offsets(path, names, (STT_FUNC,))


def symbol_file_offsets(path: str | Path, names: Collection[str], types: Collection[int]) -> dict[str, int]:
    """{name: file offset} of the symbols of these types the file defines: st_value through the
    PT_LOAD segment that holds it, as bcc does (a uprobe's offset, a USDT semaphore's ref_ctr)."""
    try:
        with open(path, "rb") as stream:
            elf = elf_file(stream)
            values = _symbols_in(elf, names, types)
            segments = load_segments(elf) if values else []
    except READ_ERRORS as error:
        log.warning("cannot read %s: %s", path, error)
        return {}
    offsets = {}
    for name, vaddr in values.items():
        offset = vaddr_to_file_offset(segments, vaddr)
        if offset is not None:
            offsets[name] = offset
    return offsets


def entry_point_file_offset(path: str | Path) -> int | None:
    """The file offset of the ELF entry point (_start): code that runs once, at process start."""
    with open(path, "rb") as stream:
        elf = elf_file(stream)
        return vaddr_to_file_offset(load_segments(elf), elf.header["e_entry"])


# ---- every function symbol, for symbolizing native addresses ----

@dataclass(slots=True)
class SymbolTable:
    """A module's function symbols (from .symtab and .dynsym) sorted by start address, and its
    loadable segments to turn a file offset into an ELF virtual address."""

    starts: list[int]
    ends: list[int]
    names: list[str]
    segments: list[Segment]

    def virtual_address(self, file_offset: int) -> int:
        return file_offset_to_vaddr(self.segments, file_offset)

    def lookup(self, vaddr: int) -> tuple[str, int] | None:
        """(symbol, offset into it) of the nearest preceding symbol that contains `vaddr`."""
        index = bisect.bisect_right(self.starts, vaddr) - 1
        # A symbol nested in a larger one can precede vaddr without containing it: look back a
        # little for the one that does.
        for candidate in range(index, max(index - 16, -1), -1):
            if vaddr < self.ends[candidate]:
                return self.names[candidate], vaddr - self.starts[candidate]
        return None


_BINDING_PREFERENCE = {"STB_GLOBAL": 0, "STB_WEAK": 1}


def _symbol_preference(name: str, binding: str) -> tuple:
    """Among aliases at one address, the name to show: the public one (`getpid` over `__getpid`,
    `malloc` over `__libc_malloc`), then global over weak over local, then the shortest."""
    return name.startswith("_"), _BINDING_PREFERENCE.get(binding, 2), len(name), name


def load_symbol_table(file: BinaryIO) -> SymbolTable:
    """Read an ELF file's function symbols; raises READ_ERRORS on a file that is not a readable ELF."""
    elf = elf_file(file)
    best: dict[int, tuple[tuple, str, int]] = {}  # start -> (preference, name, size)
    for section_name in (".symtab", ".dynsym"):
        section = elf.get_section_by_name(section_name)
        if not isinstance(section, SymbolTableSection):
            continue
        for symbol in section.iter_symbols():
            info = symbol["st_info"]
            if info["type"] not in ("STT_FUNC", "STT_GNU_IFUNC") or not symbol.name:
                continue
            if symbol["st_shndx"] == "SHN_UNDEF":
                continue
            start = symbol["st_value"]
            preference = _symbol_preference(symbol.name, info["bind"])
            current = best.get(start)
            if current is None or preference < current[0]:
                # Keep the largest size seen at this address: aliases may omit it.
                size = max(symbol["st_size"], current[2] if current else 0)
                best[start] = (preference, symbol.name, size)
            elif symbol["st_size"] > current[2]:
                best[start] = (current[0], current[1], symbol["st_size"])
    starts = sorted(best)
    ends = []
    for index, start in enumerate(starts):
        size = best[start][2]
        if size == 0:  # assembly without .size: assume it runs up to the next symbol
            size = (starts[index + 1] - start) if index + 1 < len(starts) else 1
        ends.append(start + size)
    return SymbolTable(starts, ends, [best[start][1] for start in starts], load_segments(elf))
