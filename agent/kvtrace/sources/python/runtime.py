"""Per-process CPython discovery: which interpreter a process runs, where its runtime state is,
and whether kvtrace's offsets table fits it — checked against the target's own type objects.

The result configures the in-probe stack walker for that pid, or says why there is no stack.
Fail closed: an unknown version or build, or any mismatch, gives a reason, not a guess.
"""
from __future__ import annotations

import logging
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from kvtrace.sources import procfs
from kvtrace.sources.elf import READ_ERRORS, find_symbols, first_load_vaddr
from kvtrace.sources.procfs import MemoryReadError, ProcessMemory
from kvtrace.sources.python.offsets import (
    GLIBC_SPECIFIC_1STBLOCK_KEYS,
    NOT_PRESENT,
    SUPPORTED_BUILDS,
    PyOffsets,
    offsets_for,
)

log = logging.getLogger(__name__)

_SYMBOLS = ("_PyRuntime", "PyCode_Type", "PyFrame_Type", "Py_Version")
_VERSION_IN_NAME = re.compile(r"python(\d)\.(\d+)(t?)")

# PyTypeObject: tp_basicsize and tp_members (stable public layout on 3.10-3.15, x86_64, default build;
# a free-threaded build's larger object header moves them, _type_field)
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
    tss_key_address: int  # address of the pthread key (Py_tss_t._key) in the target; 0 on 3.15+
    code_type_address: int = 0  # PyCode_Type: the symbolizer checks each code object's type
    # 3.15+: &_PyRuntime.interpreters.head, where the probe starts looking for a thread's state
    interpreters_head_address: int = 0


@dataclass(frozen=True, slots=True)
class NoPython:
    """Why a process gets no Python stacks."""

    pid: int
    reason: str


def _load_bias(pid: int, path: str, first_load_vaddr: int, proc: Path) -> int | None:
    """Where the file is loaded: lowest mapping start of that file minus its first PT_LOAD vaddr."""
    starts = [mapping.start for mapping in procfs.read_maps(pid, proc)
              if mapping.path == path and mapping.file_offset == 0]
    return min(starts) - first_load_vaddr if starts else None


def _candidates(pid: int, proc: Path) -> list[str]:
    """The executable and any mapped libpython, as the process names them."""
    executable = procfs.executable_path(pid, proc)
    paths = [executable] if executable else []
    for mapping in procfs.read_maps(pid, proc):
        if "libpython" in os.path.basename(mapping.path) and mapping.path not in paths:
            paths.append(mapping.path)
    return paths


def _type_field(default_offset: int, offsets: PyOffsets) -> int:
    """Where a PyTypeObject field is in this build: the header before it is larger on free-threaded builds."""
    return default_offset + offsets.object_type - 8


def _members(mem: ProcessMemory, type_address: int, offsets: PyOffsets) -> dict[str, int]:
    """name -> offset from a type object's tp_members table (PyMemberDef[])."""
    table = mem.read_u64(type_address + _type_field(_TP_MEMBERS, offsets))
    members: dict[str, int] = {}
    for index in range(64):
        entry = mem.read(table + index * _MEMBERDEF_SIZE, _MEMBERDEF_SIZE)
        name_ptr, offset = struct.unpack_from("<Q", entry)[0], struct.unpack_from("<q", entry, 16)[0]
        if name_ptr == 0:
            break
        members[mem.read_cstring(name_ptr)] = offset
    return members


def _check(expected: dict[str, int], actual: dict[str, int], what: str) -> str | None:
    for name, offset in expected.items():
        if offset == NOT_PRESENT or name not in actual:
            continue
        if actual[name] != offset:
            return f"{what}.{name} is at {actual[name]}, kvtrace expects {offset}"
    return None


# _Py_DebugOffsets (3.13+): u64 words after the 8-byte cookie (version, free_threaded, then one block per
# structure); the index of each word kvtrace checks, per minor version (read off
# Include/internal/pycore_debug_offsets.h; 3.13: pycore_runtime.h). Each names the PyOffsets field it
# must equal.
_DEBUG_COOKIE = b"xdebugpy"
_DEBUG_FREE_THREADED = 1
_DEBUG_WORDS = 128
_DEBUG_CHECKED = {
    "thread_state.current_frame": "tstate_frame",
    "thread_state.datastack_chunk": "tstate_datastack",
    "interpreter_frame.previous": "frame_previous",
    "interpreter_frame.executable": "frame_code",
    "interpreter_frame.instr_ptr": "frame_instr",
    "interpreter_frame.owner": "frame_owner",
    "code_object.filename": "code_filename",
    "code_object.name": "code_name",
    "code_object.qualname": "code_qualname",
    "code_object.linetable": "code_linetable",
    "code_object.firstlineno": "code_firstlineno",
    "code_object.co_code_adaptive": "code_bytecode",
    "code_object.co_tlbc": "code_tlbc",
    "pyobject.ob_type": "object_type",
    "unicode_object.asciiobject_size": "sizeof_ascii_object",
    "runtime_state.interpreters_head": "runtime_interpreters_head",
    "interpreter_state.threads_head": "interp_threads_head",
    "interpreter_state.next": "interp_next",
    "thread_state.prev": "tstate_prev",
    "thread_state.next": "tstate_next",
    "thread_state.thread_id": "tstate_thread_id",
    "thread_state.interp": "tstate_interp",
    "thread_state.base_frame": "tstate_base_frame",
}
_DEBUG_INDEX = {
    (3, 13): {"thread_state.current_frame": 22, "thread_state.datastack_chunk": 25,
              "interpreter_frame.previous": 28, "interpreter_frame.executable": 29,
              "interpreter_frame.instr_ptr": 30, "interpreter_frame.owner": 32,
              "code_object.filename": 34, "code_object.name": 35, "code_object.qualname": 36,
              "code_object.linetable": 37, "code_object.firstlineno": 38,
              "code_object.co_code_adaptive": 42, "pyobject.ob_type": 44,
              "unicode_object.asciiobject_size": 69},
    (3, 14): {"thread_state.current_frame": 25, "thread_state.datastack_chunk": 28,
              "interpreter_frame.previous": 31, "interpreter_frame.executable": 32,
              "interpreter_frame.instr_ptr": 33, "interpreter_frame.owner": 35,
              "code_object.filename": 39, "code_object.name": 40, "code_object.qualname": 41,
              "code_object.linetable": 42, "code_object.firstlineno": 43,
              "code_object.co_code_adaptive": 47, "code_object.co_tlbc": 48, "pyobject.ob_type": 50,
              "unicode_object.asciiobject_size": 79},
    (3, 15): {"runtime_state.interpreters_head": 4, "interpreter_state.next": 7,
              "interpreter_state.threads_head": 8,
              "thread_state.prev": 22, "thread_state.next": 23, "thread_state.interp": 24,
              "thread_state.thread_id": 29,
              "thread_state.base_frame": 26,
              "thread_state.current_frame": 25, "thread_state.datastack_chunk": 31,
              "interpreter_frame.previous": 39, "interpreter_frame.executable": 40,
              "interpreter_frame.instr_ptr": 41, "interpreter_frame.owner": 43,
              "code_object.filename": 47, "code_object.name": 48, "code_object.qualname": 49,
              "code_object.linetable": 50, "code_object.firstlineno": 51,
              "code_object.co_code_adaptive": 55, "code_object.co_tlbc": 56, "pyobject.ob_type": 58,
              "unicode_object.asciiobject_size": 91},
}


def _debug_offsets(mem: ProcessMemory, runtime: int) -> tuple[int, ...] | None:
    """The words of the target's _Py_DebugOffsets (at the start of _PyRuntime), None without its cookie."""
    header = mem.read(runtime, 8 + 8 * _DEBUG_WORDS)
    if header[:8] != _DEBUG_COOKIE:
        return None
    return struct.unpack_from(f"<{_DEBUG_WORDS}Q", header, 8)


def _check_debug_offsets(words: tuple[int, ...], offsets: PyOffsets) -> str | None:
    """Whether every field kvtrace reads is where the target's own _Py_DebugOffsets says it is."""
    for name, index in _DEBUG_INDEX[offsets.version].items():
        expected = getattr(offsets, _DEBUG_CHECKED[name])
        if name == "code_object.co_tlbc" and not offsets.free_threaded:
            continue  # a default build has no co_tlbc (its word is 0)
        if words[index] != expected:
            return f"_Py_DebugOffsets {name} is {words[index]}, kvtrace expects {expected}"
    return None


def inspect_python(pid: int, proc: Path = procfs.PROC) -> PythonTarget | NoPython:
    """Finds and validates the CPython runtime of a process."""
    for path in _candidates(pid, proc):
        open_path = procfs.path_in_root(pid, path, proc)
        symbols = find_symbols(open_path, _SYMBOLS)
        if "_PyRuntime" not in symbols:
            continue
        try:
            first_load = first_load_vaddr(open_path)
        except READ_ERRORS:
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
        mem = ProcessMemory(pid, proc)
    except MemoryReadError as error:
        return NoPython(pid, f"{error} (needs root or CAP_SYS_PTRACE)")
    try:
        if "Py_Version" in symbols:
            hexversion = mem.read_u64(bias + symbols["Py_Version"]) & 0xFFFFFFFF
            version = (hexversion >> 24, (hexversion >> 16) & 0xFF)
        elif name_match:
            version = (int(name_match[1]), int(name_match[2]))
        else:
            return NoPython(pid, f"cannot tell the Python version of {path}")
        runtime = bias + symbols["_PyRuntime"]
        label = f"{version[0]}.{version[1]}"
        words = _debug_offsets(mem, runtime) if version >= (3, 13) else None
        if version >= (3, 13) and words is None:
            return NoPython(pid, f"Python {label}: _Py_DebugOffsets cookie not found at _PyRuntime "
                                 "(kvtrace checks its offsets against it)")
        free_threaded = bool(words[_DEBUG_FREE_THREADED]) if words else bool(name_match and name_match[3])
        offsets = offsets_for(version, free_threaded)
        if offsets is None:
            build = f"{label} free-threaded build" if free_threaded else label
            return NoPython(pid, f"Python {build} is not supported ({SUPPORTED_BUILDS} are)")
        if words is not None and words[0] >> 16 != version[0] << 8 | version[1]:
            return NoPython(pid, f"Python {label}: its _Py_DebugOffsets are of version {words[0]:#x}")
        problem = None
        if "PyCode_Type" in symbols:
            code_type = bias + symbols["PyCode_Type"]
            members = _members(mem, code_type, offsets)
            problem = _check({"co_firstlineno": offsets.code_firstlineno,
                              "co_filename": offsets.code_filename, "co_name": offsets.code_name,
                              "co_qualname": offsets.code_qualname,
                              "co_linetable": offsets.code_linetable}, members, "PyCodeObject")
            if problem is None and version >= (3, 11):
                basicsize = mem.read_u64(code_type + _type_field(_TP_BASICSIZE, offsets))
                if basicsize != offsets.code_bytecode:
                    problem = f"PyCode_Type.tp_basicsize is {basicsize}, kvtrace expects {offsets.code_bytecode}"
        else:
            problem = "PyCode_Type not found: cannot validate the offsets"
        if problem is None and version == (3, 10) and "PyFrame_Type" in symbols:
            problem = _check({"f_back": offsets.frame_previous, "f_code": offsets.frame_code,
                              "f_lasti": offsets.frame_instr},
                             _members(mem, bias + symbols["PyFrame_Type"], offsets), "PyFrameObject")
        if problem is None and words is not None:
            problem = _check_debug_offsets(words, offsets)
        if problem is not None:
            return NoPython(pid, f"offsets do not match this Python {offsets.label}: {problem}")
        code_type = bias + symbols["PyCode_Type"]
        if offsets.runtime_tss == NOT_PRESENT:  # 3.15+: the probe looks the thread up in the list
            return PythonTarget(pid, version, offsets, path, runtime, 0, code_type,
                                runtime + offsets.runtime_interpreters_head)
        tss = runtime + offsets.runtime_tss
        initialized, key = struct.unpack("<ii", mem.read(tss, 8))
        if initialized == 1 and not 0 <= key < GLIBC_SPECIFIC_1STBLOCK_KEYS:
            return NoPython(pid, f"pthread key {key} is beyond glibc's first block (< 32)")
        return PythonTarget(pid, version, offsets, path, runtime, tss + 4, code_type)
    except MemoryReadError as error:
        return NoPython(pid, f"cannot read the Python runtime of pid {pid}: {error}")
    finally:
        mem.close()
