"""User-space symbolization of the Python stacks the probes record.

The probe walks a thread's CPython frames inside the uprobe and records, per frame, the raw pair
(code object address, instruction value): on 3.10 the frame's `f_lasti` (an index in 2-byte code
units), on 3.11+ the address of the current instruction (`prev_instr`, `instr_ptr` on 3.13+; on a
free-threaded build in the running thread's own copy of the bytecode, found through `co_tlbc`).
Here those pairs become (qualified name, file, line) by reading the code objects out of the live
process through /proc/PID/mem (sources/native.py does the same for native return addresses).

Code objects are long-lived, so each is read once per process and cached; see `Symbolizer` for
how a cache entry is checked against the address being reused by another code object.
"""
from __future__ import annotations

import array
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kvtrace.model.stacks import UNKNOWN_FRAME, Frame
from kvtrace.sources.procfs import PROC, MemoryReadError, ProcessMemory
from kvtrace.sources.python.offsets import (
    FREE_THREADED_OFFSETS,
    NOT_PRESENT,
    OFFSETS,
    SUPPORTED_BUILDS,
    PyOffsets,
)

SUPPORTED_VERSIONS = tuple(sorted(set(OFFSETS) | set(FREE_THREADED_OFFSETS)))

# Bounds on what is read for one name or line table, so that a garbage pointer cannot make us read
# megabytes. Real names are short; the largest line tables are a few KiB.
MAX_STRING_CHARS = 1 << 16
MAX_LINETABLE_BYTES = 1 << 20

# Lines cached per code object: bounded because the instruction value comes from the probe and a
# torn read could give any number.
MAX_CACHED_OFFSETS_PER_CODE = 4096

# Object headers: ob_type at offsets.object_type (8; 24 on free-threaded builds), then a PyVarObject's
# ob_size (offsets.object_size). PyBytesObject: that header, ob_shash, then the bytes.
BYTES_DATA_AFTER_SIZE = 16

# Bytecode copies per code object looked through on a free-threaded build (one per thread that ran it).
MAX_BYTECODE_COPIES = 4096

# PyASCIIObject (Include/cpython/unicodeobject.h): header, length, hash, then `state`, a 32-bit
# bitfield: interned:2, kind:3, compact:1, ascii:1 on a default build (3.10–3.15); free-threaded builds
# make `interned` a whole byte, so the bits after it start at bit 8. Bit 7 is `ready` on 3.10/3.11 (and
# `statically_allocated` on 3.12+).
UNICODE_LENGTH_AFTER_TYPE = 8
UNICODE_STATE_AFTER_TYPE = 24
STATE_KIND_SHIFT = 2
STATE_KIND_SHIFT_FREE_THREADED = 8
STATE_KIND_MASK = 0b111
STATE_READY_BEFORE_3_12 = 1 << 7


class UnsupportedPythonError(ValueError):
    """A CPython version or offsets table this module does not decode."""


def _check_version(version: tuple[int, ...]) -> tuple[int, int]:
    minor_version = (version[0], version[1])
    if minor_version not in SUPPORTED_VERSIONS:
        raise UnsupportedPythonError(
            f"CPython {version[0]}.{version[1]} is not supported ({SUPPORTED_BUILDS} are)")
    return minor_version


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
    length_at = offsets.object_type + UNICODE_LENGTH_AFTER_TYPE
    state_at = offsets.object_type + UNICODE_STATE_AFTER_TYPE
    header = mem.read(address, state_at + 4)
    length_chars = int.from_bytes(header[length_at:length_at + 8], "little")
    state = int.from_bytes(header[state_at:state_at + 4], "little")
    kind_shift = STATE_KIND_SHIFT_FREE_THREADED if offsets.free_threaded else STATE_KIND_SHIFT
    kind_bytes = (state >> kind_shift) & STATE_KIND_MASK
    is_compact = bool(state & 1 << (kind_shift + 3))
    is_ascii = bool(state & 1 << (kind_shift + 4))
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
        if is_ascii and not data.isascii():  # a torn read or another object: not this str
            raise MemoryReadError(f"str at {address:#x} is flagged ASCII and is not")
        return data.decode("latin-1")
    # Not decoded as UTF-16/32: these are arrays of code points, and a str may hold lone
    # surrogates that a codec would reject or pair up.
    code_points = array.array("H" if kind_bytes == 2 else "I", data)
    if kind_bytes == 4 and max(code_points) > sys.maxunicode:
        raise MemoryReadError(f"str at {address:#x}: code point {max(code_points):#x} beyond U+10FFFF")
    return "".join(map(chr, code_points))


def read_bytes_object(mem: ProcessMemory, address: int, max_bytes: int, offsets: PyOffsets) -> bytes:
    """The contents of the bytes object at `address`."""
    size_bytes = mem.read_i64(address + offsets.object_size)
    if not 0 <= size_bytes <= max_bytes:
        raise MemoryReadError(f"bytes at {address:#x}: implausible size {size_bytes}")
    data_at = address + offsets.object_size + BYTES_DATA_AFTER_SIZE
    return mem.read(data_at, size_bytes) if size_bytes else b""


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
    code_units: int  # Py_SIZE(code): the bytecode's length in 2-byte units


def _fingerprint_span(offsets: PyOffsets) -> tuple[int, int]:
    """(start, size) of the one read that covers every fingerprint field."""
    fields = [offsets.object_type, offsets.object_size, offsets.code_firstlineno, offsets.code_filename,
              offsets.code_name, offsets.code_linetable]
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
    return _CodeFingerprint(field_at(offsets.object_type), field_at(offsets.code_firstlineno, 4),
                            field_at(offsets.code_filename), field_at(name_offset),
                            field_at(offsets.code_linetable), field_at(offsets.object_size))


@dataclass(slots=True)
class _CodeEntry:
    fingerprint: _CodeFingerprint
    function: str
    file: str
    linetable: bytes
    frames_by_offset: dict[int, Frame] = field(default_factory=dict)
    bytecode_copies: tuple[int, ...] = ()  # free-threaded: where each thread's copy of the bytecode is


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

    def __init__(self, proc: Path = PROC) -> None:
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
            if offsets.code_tlbc != NOT_PRESENT and not 0 <= byte_offset < entry.fingerprint.code_units * 2:
                in_copy = _offset_in_copy(mem, offsets, code_address, entry, instruction)
                if in_copy is None:  # in no copy of this code's bytecode: its line is not known
                    return Frame(entry.function, entry.file, 0)
                byte_offset = in_copy
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


def _offset_in_copy(mem: ProcessMemory, offsets: PyOffsets, code_address: int, entry: _CodeEntry,
                    instruction: int) -> int | None:
    """A free-threaded build's frame points into its thread's own copy of the bytecode (co_tlbc, the
    copies made when threads specialise it): the offset into whichever copy holds the instruction, read
    again when none of those known does (a new thread's copy). None when none holds it."""
    size_bytes = entry.fingerprint.code_units * 2
    for attempt in range(2):
        for base in entry.bytecode_copies:
            if 0 <= instruction - base < size_bytes:
                return instruction - base
        if attempt == 0:
            try:
                entry.bytecode_copies = _bytecode_copies(mem, offsets, code_address)
            except MemoryReadError:
                break
    return None


def _bytecode_copies(mem: ProcessMemory, offsets: PyOffsets, code_address: int) -> tuple[int, ...]:
    array_address = mem.read_u64(code_address + offsets.code_tlbc)
    count = mem.read_i64(array_address)
    if not 0 < count <= MAX_BYTECODE_COPIES:
        raise MemoryReadError(f"code object at {code_address:#x}: implausible co_tlbc size {count}")
    data = mem.read(array_address + 8, count * 8)
    return tuple(base for base in array.array("Q", data) if base)


def _read_code(mem: ProcessMemory, offsets: PyOffsets,
               fingerprint: _CodeFingerprint) -> _CodeEntry:
    function = read_unicode(mem, fingerprint.name_address, offsets)
    file = read_unicode(mem, fingerprint.filename_address, offsets)
    linetable = read_bytes_object(mem, fingerprint.linetable_address, MAX_LINETABLE_BYTES, offsets)
    return _CodeEntry(fingerprint, function, file, linetable)
