"""Per-process CPython discovery: which interpreter a process runs, where its runtime state is,
and whether kvtrace's offsets table fits it — checked against the target's own type objects.

The result configures the in-probe stack walker for that pid, or says why there is no stack.
Fail closed: an unknown version, a free-threaded build or any mismatch gives a reason, not a guess.
"""
from __future__ import annotations

import logging
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile
from elftools.elf.sections import SymbolTableSection

from kvtrace.sources.python.offsets import (GLIBC_SPECIFIC_1STBLOCK_KEYS, NOT_PRESENT, OFFSETS,
                                       PyOffsets)

log = logging.getLogger(__name__)

_SYMBOLS = ("_PyRuntime", "PyCode_Type", "PyFrame_Type", "Py_Version")
_VERSION_IN_NAME = re.compile(r"python(\d)\.(\d+)(t?)")

# PyTypeObject: tp_basicsize and tp_members (stable public layout on 3.10-3.13, x86_64)
_TP_BASICSIZE = 32
_TP_MEMBERS = 240
_MEMBERDEF_SIZE = 40  # {char *name; int type; Py_ssize_t offset; int flags; char *doc}


@dataclass(frozen=True, slots=True)
class PythonTarget:
    """A process whose Python stacks the probes can walk."""

    pid: int
    version: tuple[int, int]
    offsets: PyOffsets
    path: str  # libpython or the executable that holds the runtime
    runtime_address: int
    tss_key_address: int  # address of the pthread key (Py_tss_t._key) in the target
    code_type_address: int = 0  # PyCode_Type: the symbolizer checks each code object's type


@dataclass(frozen=True, slots=True)
class NoPython:
    """Why a process gets no Python stacks."""

    pid: int
    reason: str


class _Memory:
    def __init__(self, pid: int) -> None:
        self._fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)

    def read(self, address: int, size: int) -> bytes:
        data = os.pread(self._fd, size, address)
        if len(data) != size:
            raise OSError(f"short read at {address:#x}")
        return data

    def u64(self, address: int) -> int:
        return struct.unpack("<Q", self.read(address, 8))[0]

    def cstring(self, address: int, limit: int = 64) -> str:
        return self.read(address, limit).split(b"\0", 1)[0].decode("ascii", "replace")

    def close(self) -> None:
        os.close(self._fd)


def _elf_symbols(path: str) -> tuple[dict[str, int], int]:
    """Wanted symbol values from .dynsym (else .symtab), and the first PT_LOAD vaddr."""
    values: dict[str, int] = {}
    with open(path, "rb") as stream:
        elf = ELFFile(stream)
        first_load = min(seg["p_vaddr"] for seg in elf.iter_segments() if seg["p_type"] == "PT_LOAD")
        for section_name in (".dynsym", ".symtab"):
            section = elf.get_section_by_name(section_name)
            if not isinstance(section, SymbolTableSection):
                continue
            for name in _SYMBOLS:
                if name in values:
                    continue
                found = section.get_symbol_by_name(name)
                if found and found[0]["st_shndx"] != "SHN_UNDEF":
                    values[name] = found[0]["st_value"]
    return values, first_load & ~0xFFF


def _load_bias(pid: int, path: str, first_load_vaddr: int, proc: Path) -> int | None:
    """Where the file is loaded: lowest mapping start of that file minus its first PT_LOAD vaddr."""
    starts = []
    try:
        maps = (proc / str(pid) / "maps").read_text()
    except OSError:  # the process exited meanwhile
        return None
    for line in maps.splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5] == path and int(parts[2], 16) == 0:
            starts.append(int(parts[0].split("-")[0], 16))
    return min(starts) - first_load_vaddr if starts else None


def _candidates(pid: int, proc: Path) -> list[str]:
    """The executable and any mapped libpython, as the process names them."""
    paths = []
    try:
        paths.append(os.readlink(proc / str(pid) / "exe"))
    except OSError:
        pass
    try:
        for line in (proc / str(pid) / "maps").read_text().splitlines():
            parts = line.split(None, 5)
            if len(parts) == 6 and "libpython" in os.path.basename(parts[5]) and parts[5] not in paths:
                paths.append(parts[5])
    except OSError:
        pass
    return paths


def _members(mem: _Memory, type_address: int) -> dict[str, int]:
    """name -> offset from a type object's tp_members table (PyMemberDef[])."""
    table = mem.u64(type_address + _TP_MEMBERS)
    members: dict[str, int] = {}
    for index in range(64):
        entry = mem.read(table + index * _MEMBERDEF_SIZE, _MEMBERDEF_SIZE)
        name_ptr, offset = struct.unpack_from("<Q", entry)[0], struct.unpack_from("<q", entry, 16)[0]
        if name_ptr == 0:
            break
        members[mem.cstring(name_ptr)] = offset
    return members


def _check(expected: dict[str, int], actual: dict[str, int], what: str) -> str | None:
    for name, offset in expected.items():
        if offset == NOT_PRESENT or name not in actual:
            continue
        if actual[name] != offset:
            return f"{what}.{name} is at {actual[name]}, kvtrace expects {offset}"
    return None


# _Py_DebugOffsets (3.13.0): u64 words after the 8-byte cookie; the index of each one we check
# (version, free_threaded, runtime_state[3], interpreter_state[13], thread_state[9], ...).
_DEBUG_COOKIE = b"xdebugpy"
_DEBUG_FREE_THREADED = 1
_DEBUG_313 = {
    "thread_state.current_frame": 22,
    "interpreter_frame.previous": 28,
    "interpreter_frame.executable": 29,
    "interpreter_frame.instr_ptr": 30,
    "interpreter_frame.owner": 32,
    "code_object.filename": 34,
    "code_object.name": 35,
    "code_object.qualname": 36,
    "code_object.linetable": 37,
    "code_object.firstlineno": 38,
    "code_object.co_code_adaptive": 42,
}


def _check_debug_offsets(mem: _Memory, runtime: int, offsets: PyOffsets) -> str | None:
    header = mem.read(runtime, 8 + 8 * 64)
    if header[:8] != _DEBUG_COOKIE:
        return "_Py_DebugOffsets cookie not found at _PyRuntime"
    words = struct.unpack_from("<64Q", header, 8)
    if words[_DEBUG_FREE_THREADED]:
        return "free-threaded build (not supported)"
    expected = {
        "thread_state.current_frame": offsets.tstate_frame,
        "interpreter_frame.previous": offsets.frame_previous,
        "interpreter_frame.executable": offsets.frame_code,
        "interpreter_frame.instr_ptr": offsets.frame_instr,
        "interpreter_frame.owner": offsets.frame_owner,
        "code_object.filename": offsets.code_filename,
        "code_object.name": offsets.code_name,
        "code_object.qualname": offsets.code_qualname,
        "code_object.linetable": offsets.code_linetable,
        "code_object.firstlineno": offsets.code_firstlineno,
        "code_object.co_code_adaptive": offsets.code_bytecode,
    }
    for name, index in _DEBUG_313.items():
        if words[index] != expected[name]:
            return f"_Py_DebugOffsets {name} is {words[index]}, kvtrace expects {expected[name]}"
    return None


def inspect_python(pid: int, proc: Path = Path("/proc")) -> PythonTarget | NoPython:
    """Finds and validates the CPython runtime of a process."""
    for path in _candidates(pid, proc):
        open_path = str(proc / str(pid) / "root" / path.lstrip("/"))
        try:
            symbols, first_load = _elf_symbols(open_path)
        except (OSError, ELFError, ValueError):
            continue
        if "_PyRuntime" not in symbols:
            continue
        return _validate(pid, path, symbols, first_load, proc)
    return NoPython(pid, "not a CPython process (no _PyRuntime in the executable or a libpython)")


def _validate(pid: int, path: str, symbols: dict[str, int], first_load: int,
              proc: Path) -> PythonTarget | NoPython:
    name_match = _VERSION_IN_NAME.search(os.path.basename(path))
    bias = _load_bias(pid, path, first_load, proc)
    if bias is None:
        return NoPython(pid, f"cannot find where {path} is loaded")
    try:
        mem = _Memory(pid)
    except OSError as error:
        return NoPython(pid, f"cannot read /proc/{pid}/mem: {error} (needs root or CAP_SYS_PTRACE)")
    try:
        if "Py_Version" in symbols:
            hexversion = mem.u64(bias + symbols["Py_Version"]) & 0xFFFFFFFF
            version = (hexversion >> 24, (hexversion >> 16) & 0xFF)
        elif name_match:
            version = (int(name_match[1]), int(name_match[2]))
        else:
            return NoPython(pid, f"cannot tell the Python version of {path}")
        if name_match and name_match[3] == "t":
            return NoPython(pid, f"Python {version[0]}.{version[1]} free-threaded build is not supported")
        offsets = OFFSETS.get(version)
        if offsets is None:
            return NoPython(pid, f"Python {version[0]}.{version[1]} is not supported (3.10-3.13 are)")
        runtime = bias + symbols["_PyRuntime"]
        problem = None
        if "PyCode_Type" in symbols:
            code_type = bias + symbols["PyCode_Type"]
            members = _members(mem, code_type)
            problem = _check({"co_firstlineno": offsets.code_firstlineno,
                              "co_filename": offsets.code_filename, "co_name": offsets.code_name,
                              "co_qualname": offsets.code_qualname,
                              "co_linetable": offsets.code_linetable}, members, "PyCodeObject")
            if problem is None and version >= (3, 11):
                basicsize = mem.u64(code_type + _TP_BASICSIZE)
                if basicsize != offsets.code_bytecode:
                    problem = f"PyCode_Type.tp_basicsize is {basicsize}, kvtrace expects {offsets.code_bytecode}"
        else:
            problem = "PyCode_Type not found: cannot validate the offsets"
        if problem is None and version == (3, 10) and "PyFrame_Type" in symbols:
            problem = _check({"f_back": offsets.frame_previous, "f_code": offsets.frame_code,
                              "f_lasti": offsets.frame_instr},
                             _members(mem, bias + symbols["PyFrame_Type"]), "PyFrameObject")
        if problem is None and version == (3, 13):
            problem = _check_debug_offsets(mem, runtime, offsets)
        if problem is not None:
            return NoPython(pid, f"offsets do not match this Python {version[0]}.{version[1]}: {problem}")
        tss = runtime + offsets.runtime_tss
        initialized, key = struct.unpack("<ii", mem.read(tss, 8))
        if initialized == 1 and not 0 <= key < GLIBC_SPECIFIC_1STBLOCK_KEYS:
            return NoPython(pid, f"pthread key {key} is beyond glibc's first block (< 32)")
        return PythonTarget(pid, version, offsets, path, runtime, tss + 4,
                            bias + symbols["PyCode_Type"])
    except OSError as error:
        return NoPython(pid, f"cannot read the Python runtime of pid {pid}: {error}")
    finally:
        mem.close()
