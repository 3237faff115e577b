"""User-space symbolization of the stacks the probes record.

The probe walks a thread's CPython frames inside the uprobe and records, per frame, the raw pair
(code object address, instruction value): on 3.10 the frame's `f_lasti` (an index in 2-byte code
units), on 3.11+ the address of the current instruction (`prev_instr`, `instr_ptr` on 3.13).
Here those pairs become (qualified name, file, line) by reading the code objects out of the live
process through /proc/PID/mem, and a native return address becomes (module, symbol, offset)
through /proc/PID/maps and the module's ELF symbol tables.

Code objects are long-lived, so each is read once per process and cached; see `Symbolizer` for
how a cache entry is checked against the address being reused by another code object.
"""
from __future__ import annotations

import array
import bisect
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile

from kvtrace.model.stacks import UNKNOWN_FRAME, Frame, NativeFrame
from kvtrace.sources.python.offsets import NOT_PRESENT, PyOffsets

SUPPORTED_VERSIONS = ((3, 10), (3, 11), (3, 12), (3, 13))

# x86_64 user space ends below 2**47 (4-level paging) or 2**56 (5-level); anything above is a
# kernel address or garbage, and /proc/PID/mem offsets are signed.
USER_ADDRESS_LIMIT = 1 << 56

# Bounds on what is read for one name or line table, so that a garbage pointer cannot make us read
# megabytes. Real names are short; the largest line tables are a few KiB.
MAX_STRING_CHARS = 1 << 16
MAX_LINETABLE_BYTES = 1 << 20

# Lines cached per code object: bounded because the instruction value comes from the probe and a
# torn read could give any number.
MAX_CACHED_OFFSETS_PER_CODE = 4096

# PyObject / PyVarObject header: ob_refcnt, ob_type, ob_size (3.10–3.13, default GIL build).
OB_TYPE = 8
OB_SIZE = 16
# PyBytesObject: the header, ob_shash, then the bytes.
BYTES_DATA = 32

# PyASCIIObject (Include/cpython/unicodeobject.h): header, length, hash, then `state`, a 32-bit
# bitfield whose low bits are the same on 3.10–3.13: interned:2, kind:3, compact:1, ascii:1.
# Bit 7 is `ready` on 3.10/3.11 and `statically_allocated` on 3.12+.
UNICODE_LENGTH = 16
UNICODE_STATE = 32
STATE_KIND_SHIFT = 2
STATE_KIND_MASK = 0b111
STATE_COMPACT = 1 << 5
STATE_ASCII = 1 << 6
STATE_READY_BEFORE_3_12 = 1 << 7


class MemoryReadError(Exception):
    """Another process's memory could not be read: unmapped, the process is gone (or exec'd, and
    the file was opened for its old image), or no permission."""


class UnsupportedPythonError(ValueError):
    """A CPython version or offsets table this module does not decode."""


def _check_version(version: tuple[int, ...]) -> tuple[int, int]:
    minor_version = (version[0], version[1])
    if minor_version not in SUPPORTED_VERSIONS:
        raise UnsupportedPythonError(
            f"CPython {version[0]}.{version[1]} is not supported (3.10 to 3.13 are)")
    return minor_version


class ProcessMemory:
    """Reads another process's memory with pread on /proc/PID/mem, opened once.

    The open file stays bound to the address space the process had when it was opened: after the
    process exits or execs, reads fail (they never read the new image or a new process that got
    the same pid), so open a new ProcessMemory after an exec.
    """

    def __init__(self, pid: int, proc: Path = Path("/proc")) -> None:
        self.pid = pid
        path = proc / str(pid) / "mem"
        try:
            self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as error:
            raise MemoryReadError(f"cannot open {path}: {error.strerror}") from error

    def read(self, address: int, size: int) -> bytes:
        if not 0 < address < USER_ADDRESS_LIMIT - size or size < 0:
            raise MemoryReadError(f"pid {self.pid}: bad address {address:#x} (+{size} bytes)")
        try:
            data = os.pread(self._fd, size, address)
        except OSError as error:
            raise MemoryReadError(
                f"pid {self.pid}: cannot read {size} bytes at {address:#x}: {error.strerror}"
            ) from error
        if len(data) != size:
            # The kernel returns 0 bytes once the address space is gone.
            raise MemoryReadError(f"pid {self.pid}: read {len(data)} of {size} bytes at "
                                  f"{address:#x} (process exited or exec'd)")
        return data

    def read_u64(self, address: int) -> int:
        return int.from_bytes(self.read(address, 8), "little")

    def read_i64(self, address: int) -> int:
        return int.from_bytes(self.read(address, 8), "little", signed=True)

    def read_u32(self, address: int) -> int:
        return int.from_bytes(self.read(address, 4), "little")

    def read_i32(self, address: int) -> int:
        return int.from_bytes(self.read(address, 4), "little", signed=True)

    def read_u8(self, address: int) -> int:
        return self.read(address, 1)[0]

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> ProcessMemory:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _sizeof_compact_unicode(offsets: PyOffsets) -> int:
    """sizeof(PyCompactUnicodeObject): PyASCIIObject + utf8_length + utf8, and wstr_length on
    3.10/3.11 (3.12 removed the wstr fields). Non-ASCII compact data, and the data pointer of a
    non-compact PyUnicodeObject, follow it."""
    wstr_length_bytes = 8 if offsets.version < (3, 12) else 0
    return offsets.sizeof_ascii_object + 16 + wstr_length_bytes


def read_unicode(mem: ProcessMemory, address: int, offsets: PyOffsets) -> str:
    """Decode the str object at `address` in `mem`'s process.

    Handles the three layouts of a ready string: compact ASCII (the characters right after
    PyASCIIObject), compact non-ASCII (after PyCompactUnicodeObject, 1, 2 or 4 bytes a character),
    and non-compact (str subclasses, legacy API: a pointer to the characters). A 3.10/3.11 string
    that is not ready (wchar_t only) is refused: code objects never hold one.
    """
    header = mem.read(address, UNICODE_STATE + 4)
    length_chars = int.from_bytes(header[UNICODE_LENGTH:UNICODE_LENGTH + 8], "little")
    state = int.from_bytes(header[UNICODE_STATE:UNICODE_STATE + 4], "little")
    kind_bytes = (state >> STATE_KIND_SHIFT) & STATE_KIND_MASK
    is_compact = bool(state & STATE_COMPACT)
    is_ascii = bool(state & STATE_ASCII)
    if kind_bytes not in (1, 2, 4) or (is_ascii and kind_bytes != 1):
        raise MemoryReadError(f"not a ready str at {address:#x} (state {state:#x})")
    if offsets.version < (3, 12) and not state & STATE_READY_BEFORE_3_12:
        raise MemoryReadError(f"str at {address:#x} is not ready (wchar_t only)")
    if length_chars > MAX_STRING_CHARS:
        raise MemoryReadError(f"str at {address:#x}: implausible length {length_chars}")

    if is_compact and is_ascii:
        data_address = address + offsets.sizeof_ascii_object
    elif is_compact:
        data_address = address + _sizeof_compact_unicode(offsets)
    else:
        data_address = mem.read_u64(address + _sizeof_compact_unicode(offsets))
    if length_chars == 0:
        return ""
    data = mem.read(data_address, length_chars * kind_bytes)
    if kind_bytes == 1:
        return data.decode("ascii" if is_ascii else "latin-1")
    # Not decoded as UTF-16/32: these are arrays of code points, and a str may hold lone
    # surrogates that a codec would reject or pair up.
    code_points = array.array("H" if kind_bytes == 2 else "I", data)
    return "".join(map(chr, code_points))


def read_bytes_object(mem: ProcessMemory, address: int, max_bytes: int) -> bytes:
    """The contents of the bytes object at `address`."""
    size_bytes = mem.read_i64(address + OB_SIZE)
    if not 0 <= size_bytes <= max_bytes:
        raise MemoryReadError(f"bytes at {address:#x}: implausible size {size_bytes}")
    return mem.read(address + BYTES_DATA, size_bytes) if size_bytes else b""


# --- line tables -----------------------------------------------------------------------------

# 3.10 co_linetable: a line delta of -128 marks a range with no line.
NO_LINE_3_10 = -128

# 3.11+ location table entry codes (Objects/locations.md): bits 3-6 of an entry's first byte.
LOCATION_SHORT_MAX = 9  # 0-9: short form, same line, columns in one more byte
LOCATION_ONE_LINE_0 = 10  # 10-12: one-line form, line delta 0, 1 or 2, two column bytes
LOCATION_ONE_LINE_2 = 12
LOCATION_NO_COLUMNS = 13  # line delta as a signed varint
LOCATION_LONG = 14  # line delta as a signed varint, then end line and columns
LOCATION_NONE = 15  # no location


def line_for_offset(version: tuple[int, ...], linetable: bytes, firstlineno: int,
                    byte_offset: int) -> int:
    """The source line of the instruction at `byte_offset` bytes into the code, as CPython's
    PyCode_Addr2Line computes it; 0 when the table has no line for it.

    A negative offset is a frame that has not run its first instruction yet (lasti -1): CPython
    reports co_firstlineno for it, and so does this.
    """
    minor_version = _check_version(version)
    if byte_offset < 0:
        return firstlineno
    try:
        if minor_version == (3, 10):
            return _line_3_10(linetable, firstlineno, byte_offset)
        return _line_location_table(linetable, firstlineno, byte_offset)
    except IndexError:  # a table cut short: no line rather than a guess
        return 0


def _line_3_10(linetable: bytes, firstlineno: int, byte_offset: int) -> int:
    """3.10 co_linetable (Objects/lnotab_notes.txt): (start delta: unsigned byte, line delta:
    signed byte) pairs over byte offsets. A -128 line delta leaves the running line as it is and
    marks the range as having no line. Zero-length ranges only carry line deltas."""
    line = firstlineno
    start = 0
    for index in range(0, len(linetable) - 1, 2):
        end = start + linetable[index]
        line_delta = int.from_bytes(linetable[index + 1:index + 2], "little", signed=True)
        if line_delta != NO_LINE_3_10:
            line += line_delta
        if start <= byte_offset < end:
            return 0 if line_delta == NO_LINE_3_10 else line
        start = end
    return 0


def _read_varint(table: bytes, index: int) -> tuple[int, int]:
    """An unsigned varint of 6-bit chunks, least significant first, bit 6 = more follow.
    Returns (value, index after it)."""
    byte = table[index]
    value = byte & 63
    shift = 6
    while byte & 64:
        index += 1
        byte = table[index]
        value |= (byte & 63) << shift
        shift += 6
    return value, index + 1


def _line_location_table(table: bytes, firstlineno: int, byte_offset: int) -> int:
    """3.11+ location table (Objects/locations.md). Each entry starts with a byte with bit 7 set:
    bits 3-6 the form, bits 0-2 the length in code units minus one; the bytes after it (columns,
    varints) never have bit 7 set, which is how the next entry is found. Line deltas are relative
    to the previous entry's line; a no-location entry leaves the running line as it is."""
    line = firstlineno
    start = 0
    index = 0
    while index < len(table):
        first = table[index]
        form = (first >> 3) & 15
        end = start + ((first & 7) + 1) * 2
        if form == LOCATION_NONE:
            entry_line = 0
        else:
            if form in (LOCATION_NO_COLUMNS, LOCATION_LONG):
                zigzag, _ = _read_varint(table, index + 1)
                line += -(zigzag >> 1) if zigzag & 1 else zigzag >> 1
            elif LOCATION_ONE_LINE_0 <= form <= LOCATION_ONE_LINE_2:
                line += form - LOCATION_ONE_LINE_0
            entry_line = line  # short forms (0-9) stay on the line
        if start <= byte_offset < end:
            return entry_line
        start = end
        index += 1
        while index < len(table) and not table[index] & 0x80:
            index += 1
    return 0


# --- Python frames -----------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class _CodeFingerprint:
    """The code object fields that must be unchanged for a cached entry to still describe the
    object at that address: its type and the pointers to its names and line table (objects the
    code object owns, alive as long as it is), and its first line."""

    type_address: int
    firstlineno: int
    filename_address: int
    name_address: int  # co_qualname on 3.11+, co_name on 3.10
    linetable_address: int


def _fingerprint_span(offsets: PyOffsets) -> tuple[int, int]:
    """(start, size) of the one read that covers every fingerprint field."""
    fields = [OB_TYPE, offsets.code_firstlineno, offsets.code_filename, offsets.code_name,
              offsets.code_linetable]
    if offsets.code_qualname != NOT_PRESENT:
        fields.append(offsets.code_qualname)
    start = min(fields)
    return start, max(fields) + 8 - start


def _read_fingerprint(mem: ProcessMemory, offsets: PyOffsets,
                      code_address: int) -> _CodeFingerprint:
    start, size = _fingerprint_span(offsets)
    block = mem.read(code_address + start, size)

    def field_at(offset: int, width: int = 8) -> int:
        return int.from_bytes(block[offset - start:offset - start + width], "little",
                              signed=width == 4)

    has_qualname = offsets.code_qualname != NOT_PRESENT
    name_offset = offsets.code_qualname if has_qualname else offsets.code_name
    return _CodeFingerprint(field_at(OB_TYPE), field_at(offsets.code_firstlineno, 4),
                            field_at(offsets.code_filename), field_at(name_offset),
                            field_at(offsets.code_linetable))


@dataclass(slots=True)
class _CodeEntry:
    fingerprint: _CodeFingerprint
    function: str
    file: str
    linetable: bytes
    frames_by_offset: dict[int, Frame] = field(default_factory=dict)


class Symbolizer:
    """Turns the probe's raw frames into `Frame`s, caching code objects per (pid, address).

    Address reuse: a code object can be freed and another allocated at its address (exec(),
    module reload, lambdas made at run time). Every lookup, hit or miss, re-reads the code
    object's fingerprint in one pread (its type, co_firstlineno, and the addresses of its file
    name, (qual)name and line table) and uses the cached entry only if all of them are unchanged.
    Those objects belong to the code object and die with it, so a new code object at the same
    address would also need new name, file name and line table objects at exactly the old ones'
    addresses, and the same first line, to pass for the old one. A frame whose code object cannot
    be read is `UNKNOWN_FRAME`, never a cached guess: after the process exits its frames are
    unknown.

    Call `forget(pid)` when a process exits or execs.
    """

    def __init__(self, proc: Path = Path("/proc")) -> None:
        self._proc = proc
        self._memories: dict[int, ProcessMemory] = {}
        self._codes: dict[int, dict[int, _CodeEntry]] = {}
        self.hits = 0
        self.misses = 0  # includes unreadable frames
        self.unreadable = 0  # frames given as UNKNOWN_FRAME
        self.replaced = 0  # cached entries whose fingerprint changed (address reuse)

    @property
    def hit_rate(self) -> float:
        lookups = self.hits + self.misses
        return self.hits / lookups if lookups else 0.0

    def symbolize(self, pid: int, version: tuple[int, ...], offsets: PyOffsets,
                  frames: list[tuple[int, int]], code_type: int = 0) -> list[Frame]:
        """`frames`: (code object address, instruction value) pairs as the probe recorded them.
        `code_type`: the target's PyCode_Type address where known; a pointer whose object has
        another type is then an unknown frame (the probe read a frame being torn down)."""
        minor_version = _check_version(version)
        if offsets.version != minor_version:
            raise UnsupportedPythonError(f"offsets for {offsets.version} given for {version}")
        try:
            mem = self._memory(pid)
        except MemoryReadError:
            self.misses += len(frames)
            self.unreadable += len(frames)
            return [UNKNOWN_FRAME] * len(frames)
        codes = self._codes.setdefault(pid, {})
        return [self._symbolize_frame(mem, codes, offsets, code_address, instruction, code_type)
                for code_address, instruction in frames]

    def forget(self, pid: int) -> None:
        """Drop what is cached for a process that exited or exec'd."""
        self._codes.pop(pid, None)
        mem = self._memories.pop(pid, None)
        if mem is not None:
            mem.close()

    def close(self) -> None:
        for pid in list(self._memories):
            self.forget(pid)

    def _memory(self, pid: int) -> ProcessMemory:
        mem = self._memories.get(pid)
        if mem is None:
            mem = self._memories[pid] = ProcessMemory(pid, self._proc)
        return mem

    def _symbolize_frame(self, mem: ProcessMemory, codes: dict[int, _CodeEntry],
                         offsets: PyOffsets, code_address: int, instruction: int,
                         code_type: int) -> Frame:
        try:
            fingerprint = _read_fingerprint(mem, offsets, code_address)
        except MemoryReadError:
            self.misses += 1
            self.unreadable += 1
            return UNKNOWN_FRAME
        entry = codes.get(code_address)
        if entry is not None and entry.fingerprint == fingerprint:
            self.hits += 1
        else:
            self.misses += 1
            if entry is not None:
                self.replaced += 1
                del codes[code_address]
            try:
                if code_type and fingerprint.type_address != code_type:
                    raise MemoryReadError(f"{code_address:#x} is not a code object")
                entry = codes[code_address] = _read_code(mem, offsets, fingerprint)
            except MemoryReadError:
                self.unreadable += 1
                return UNKNOWN_FRAME

        if offsets.instr_is_pointer:
            byte_offset = instruction - (code_address + offsets.code_bytecode)
        else:
            byte_offset = instruction * 2  # 3.10 f_lasti counts 2-byte code units
        frame = entry.frames_by_offset.get(byte_offset)
        if frame is None:
            line = line_for_offset(offsets.version, entry.linetable,
                                   entry.fingerprint.firstlineno, byte_offset)
            frame = Frame(entry.function, entry.file, line)
            if len(entry.frames_by_offset) < MAX_CACHED_OFFSETS_PER_CODE:
                entry.frames_by_offset[byte_offset] = frame
        return frame


def _read_code(mem: ProcessMemory, offsets: PyOffsets,
               fingerprint: _CodeFingerprint) -> _CodeEntry:
    function = read_unicode(mem, fingerprint.name_address, offsets)
    file = read_unicode(mem, fingerprint.filename_address, offsets)
    linetable = read_bytes_object(mem, fingerprint.linetable_address, MAX_LINETABLE_BYTES)
    return _CodeEntry(fingerprint, function, file, linetable)


# --- native frames -----------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class _Mapping:
    """One line of /proc/PID/maps."""

    start: int
    end: int
    file_offset: int
    device: str  # "major:minor" in hex, as maps gives it
    inode: int  # 0: not backed by a file ([heap], [vdso], anonymous)
    path: str


def read_maps(pid: int, proc: Path = Path("/proc")) -> list[_Mapping]:
    """The process's mappings in address order; [] if it is gone."""
    try:
        text = (proc / str(pid) / "maps").read_text(errors="surrogateescape")
    except OSError:
        return []
    mappings = []
    for line in text.splitlines():
        # start-end perms offset dev inode [path, which may contain spaces]
        parts = line.split(maxsplit=5)
        if len(parts) < 5:
            continue
        start, end = (int(value, 16) for value in parts[0].split("-"))
        mappings.append(_Mapping(start, end, int(parts[2], 16), parts[3], int(parts[4]),
                                 parts[5] if len(parts) > 5 else ""))
    return mappings


class _MapsIndex:
    """A process's mappings with their start addresses, for bisection."""

    __slots__ = ("mappings", "starts")

    def __init__(self, mappings: list[_Mapping]) -> None:
        self.mappings = mappings
        self.starts = [mapping.start for mapping in mappings]


def _mapping_at(index: _MapsIndex, address: int) -> _Mapping | None:
    position = bisect.bisect_right(index.starts, address) - 1
    if position >= 0 and address < index.mappings[position].end:
        return index.mappings[position]
    return None


@dataclass(slots=True)
class _SymbolTable:
    """A module's function symbols (from .symtab and .dynsym) sorted by start address, and its
    loadable segments to turn a file offset into an ELF virtual address."""

    starts: list[int]
    ends: list[int]
    names: list[str]
    segments: list[tuple[int, int, int]]  # (file offset, virtual address, size in the file)

    def virtual_address(self, file_offset: int) -> int:
        for segment_offset, segment_vaddr, segment_size in self.segments:
            if segment_offset <= file_offset < segment_offset + segment_size:
                return file_offset - segment_offset + segment_vaddr
        return file_offset

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


def load_symbol_table(file: BinaryIO) -> _SymbolTable:
    """Read an ELF file's function symbols; raises ELFError on a file that is not ELF."""
    elf = ELFFile(file)
    segments = [(segment["p_offset"], segment["p_vaddr"], segment["p_filesz"])
                for segment in elf.iter_segments() if segment["p_type"] == "PT_LOAD"]
    best: dict[int, tuple[tuple, str, int]] = {}  # start -> (preference, name, size)
    for section_name in (".symtab", ".dynsym"):
        section = elf.get_section_by_name(section_name)
        if section is None:
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
    return _SymbolTable(starts, ends, [best[start][1] for start in starts], segments)


class NativeSymbolizer:
    """Native return addresses as (module, symbol, offset), from /proc/PID/maps and the modules'
    ELF symbol tables (.symtab where not stripped, else .dynsym), cached per file (device, inode).

    A process's maps are cached and read again when an address is in none of them (a library
    loaded since); call `forget(pid)` when it exits or execs.
    """

    def __init__(self, proc: Path = Path("/proc")) -> None:
        self._proc = proc
        self._maps: dict[int, _MapsIndex] = {}
        self._tables: dict[tuple[str, int], _SymbolTable | None] = {}

    def symbolize(self, pid: int, address: int) -> NativeFrame:
        mapping = self._find_mapping(pid, address)
        if mapping is None:
            return NativeFrame("", "", address)
        file_offset = address - mapping.start + mapping.file_offset
        if mapping.inode == 0:
            return NativeFrame(mapping.path, "", address - mapping.start)
        table = self._symbol_table(pid, mapping)
        if table is None:  # unreadable or not ELF: the file offset is the best we can say
            return NativeFrame(mapping.path, "", file_offset)
        vaddr = table.virtual_address(file_offset)
        found = table.lookup(vaddr)
        if found is None:
            return NativeFrame(mapping.path, "", vaddr)
        symbol, offset = found
        return NativeFrame(mapping.path, symbol, offset)

    def forget(self, pid: int) -> None:
        self._maps.pop(pid, None)

    def _find_mapping(self, pid: int, address: int) -> _Mapping | None:
        cached = self._maps.get(pid)
        mapping = _mapping_at(cached, address) if cached is not None else None
        if mapping is None:
            fresh = self._maps[pid] = _MapsIndex(read_maps(pid, self._proc))
            mapping = _mapping_at(fresh, address)
        return mapping

    def _symbol_table(self, pid: int, mapping: _Mapping) -> _SymbolTable | None:
        key = (mapping.device, mapping.inode)
        if key not in self._tables:
            self._tables[key] = self._load(pid, mapping)
        return self._tables[key]

    def _load(self, pid: int, mapping: _Mapping) -> _SymbolTable | None:
        # map_files reaches the very file mapped, also in another mount namespace (containers)
        # or deleted since; the path as seen from the process's root is the fallback.
        candidates = [self._proc / str(pid) / "map_files" / f"{mapping.start:x}-{mapping.end:x}",
                      self._proc / str(pid) / "root" / mapping.path.lstrip("/")]
        for candidate in candidates:
            try:
                with open(candidate, "rb") as file:
                    return load_symbol_table(file)
            except (OSError, ELFError):
                continue
        return None
