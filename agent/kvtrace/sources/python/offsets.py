"""CPython internals kvtrace reads, per minor version and build (x86_64, glibc): the default (GIL)
builds of 3.10-3.15 and the free-threaded builds of 3.14 and 3.15.

Checked against the prototype (FACTS.md) and, at attach time, against the target's own
PyCode_Type.tp_members / PyFrame_Type.tp_members and, on 3.13+, _Py_DebugOffsets
(sources/python/runtime.py). Anything not in these tables is refused with a reason, never guessed.

3.14 made a frame's code object a tagged reference (_PyStackRef: the low bits say how it is counted, the
probe masks them off) and added a fifth frame owner (FRAME_OWNED_BY_INTERPRETER = 3, CSTACK = 4; 3.15
has no CSTACK): every owner from 3 up is an entry shim, not Python code. Free-threaded builds put 16 more
bytes in every object's header (ob_tid, flags, mutex, GC bits, a local and a shared reference count
before ob_type), so every object field moves; their frames carry `tlbc_index` and their code objects
`co_tlbc`, the per-thread copies of the bytecode an instruction pointer may point into.
"""
from __future__ import annotations

from dataclasses import dataclass

NOT_PRESENT = -1


@dataclass(frozen=True, slots=True)
class PyOffsets:
    version: tuple[int, int]
    # thread state -> top frame: tstate + tstate_frame; if cframe_frame is set, that is a pointer
    # to a _PyCFrame and the frame is at +cframe_frame
    tstate_frame: int
    cframe_frame: int
    # frame (3.10: PyFrameObject; 3.11+: _PyInterpreterFrame)
    frame_code: int
    frame_previous: int
    frame_instr: int  # 3.10: f_lasti (int, in 2-byte code units); 3.11+: pointer to the instruction
    frame_owner: int  # 3.11+: owner byte; NOT_PRESENT on 3.10
    # code object
    code_firstlineno: int
    code_filename: int
    code_name: int
    code_qualname: int  # NOT_PRESENT on 3.10
    code_linetable: int
    code_bytecode: int  # 3.10: offset of the co_code bytes-object pointer; 3.11+: inline bytecode
    # _PyRuntime.autoTSSkey (a Py_tss_t); the pthread key is at +4. NOT_PRESENT on 3.15+, which keeps a
    # thread's state in a C thread-local: the probe finds it in the interpreter's list (the fields below)
    runtime_tss: int
    sizeof_ascii_object: int  # sizeof(PyASCIIObject): compact ASCII data follows it
    # 3.11+: PyThreadState.datastack_chunk, followed by datastack_top and datastack_limit: the
    # thread's frames are contiguous in [chunk, limit), so the probe reads many in one go;
    # NOT_PRESENT on 3.10 (heap frame objects)
    tstate_datastack: int = NOT_PRESENT
    free_threaded: bool = False
    # PyObject.ob_type: 8, or 24 on a free-threaded build; PyVarObject.ob_size and str's length follow it
    object_type: int = 8
    # free-threaded: PyCodeObject.co_tlbc, a _PyCodeArray {Py_ssize_t size; char *entries[size]} of the
    # per-thread copies of the bytecode (entries[0] is co_code_adaptive itself)
    code_tlbc: int = NOT_PRESENT
    # 3.15+: _PyRuntime.interpreters.head, PyInterpreterState.threads.head and .next, and a PyThreadState's
    # links and thread_id (pthread_self()), by which the probe finds the calling thread's state
    runtime_interpreters_head: int = NOT_PRESENT
    interp_threads_head: int = NOT_PRESENT
    tstate_prev: int = NOT_PRESENT
    tstate_next: int = NOT_PRESENT
    tstate_thread_id: int = NOT_PRESENT
    tstate_interp: int = NOT_PRESENT
    interp_next: int = NOT_PRESENT
    # 3.15+: PyThreadState.base_frame, the frame under every thread's chain (the interpreter's, not code)
    tstate_base_frame: int = NOT_PRESENT

    @property
    def frame_read_bytes(self) -> int:
        """How much of a frame to read in one go to get code, previous, instruction and owner."""
        last = max(self.frame_code, self.frame_previous, self.frame_instr, self.frame_owner)
        return last + 8

    @property
    def instr_is_pointer(self) -> bool:
        return self.version >= (3, 11)

    @property
    def object_size(self) -> int:
        """PyVarObject.ob_size: the item count of a variable-size object (a code object's code units)."""
        return self.object_type + 8

    @property
    def label(self) -> str:
        """How kvtrace names the build: "3.14", "3.14t" (free-threaded)."""
        return f"{self.version[0]}.{self.version[1]}{'t' if self.free_threaded else ''}"


# Frame owner values (Include/internal/pycore_frame.h, pycore_interpframe_structs.h): from this one up
# (3.12-3.13: the C stack; 3.14: the interpreter, the C stack; 3.15: the interpreter) a frame is an entry
# shim and not Python code.
FRAME_OWNED_BY_SHIM_FROM = 3
# The low bits of a 3.14+ _PyStackRef that say how it is counted (Py_TAG_BITS: 1 or 3), masked off a frame's
# code reference; objects are 8-byte aligned, so masking three bits leaves 3.10-3.13's plain pointers as they are.
STACK_REF_TAG_BITS = 7

OFFSETS = {
    (3, 10): PyOffsets((3, 10), tstate_frame=24, cframe_frame=NOT_PRESENT, frame_code=32,
                       frame_previous=24, frame_instr=96, frame_owner=NOT_PRESENT,
                       code_firstlineno=40, code_filename=104, code_name=112,
                       code_qualname=NOT_PRESENT, code_linetable=120, code_bytecode=48,
                       runtime_tss=584, sizeof_ascii_object=48),
    (3, 11): PyOffsets((3, 11), tstate_frame=56, cframe_frame=8, frame_code=32, frame_previous=48,
                       frame_instr=56, frame_owner=69, code_firstlineno=72, code_filename=112,
                       code_name=120, code_qualname=128, code_linetable=136, code_bytecode=184,
                       runtime_tss=592, sizeof_ascii_object=48, tstate_datastack=296),
    (3, 12): PyOffsets((3, 12), tstate_frame=56, cframe_frame=0, frame_code=0, frame_previous=8,
                       frame_instr=56, frame_owner=70, code_firstlineno=68, code_filename=112,
                       code_name=120, code_qualname=128, code_linetable=136, code_bytecode=192,
                       runtime_tss=1544, sizeof_ascii_object=40, tstate_datastack=232),
    (3, 13): PyOffsets((3, 13), tstate_frame=72, cframe_frame=NOT_PRESENT, frame_code=0,
                       frame_previous=8, frame_instr=56, frame_owner=70, code_firstlineno=68,
                       code_filename=112, code_name=120, code_qualname=128, code_linetable=136,
                       code_bytecode=200, runtime_tss=2160, sizeof_ascii_object=40,
                       tstate_datastack=232),
    (3, 14): PyOffsets((3, 14), tstate_frame=72, cframe_frame=NOT_PRESENT, frame_code=0,
                       frame_previous=8, frame_instr=56, frame_owner=74, code_firstlineno=68,
                       code_filename=112, code_name=120, code_qualname=128, code_linetable=136,
                       code_bytecode=208, runtime_tss=2336, sizeof_ascii_object=40,
                       tstate_datastack=232),
    (3, 15): PyOffsets((3, 15), tstate_frame=72, cframe_frame=NOT_PRESENT, frame_code=0,
                       frame_previous=8, frame_instr=56, frame_owner=74, code_firstlineno=68,
                       code_filename=112, code_name=120, code_qualname=128, code_linetable=136,
                       code_bytecode=208, runtime_tss=NOT_PRESENT, sizeof_ascii_object=40,
                       tstate_datastack=256, runtime_interpreters_head=936, interp_threads_head=7336, interp_next=7264,
                       tstate_prev=0, tstate_next=8, tstate_thread_id=176, tstate_interp=16, tstate_base_frame=80),
}

# Free-threaded builds (3.14t, 3.15t), by minor version.
FREE_THREADED_OFFSETS: dict[tuple[int, int], PyOffsets] = {
    (3, 14): PyOffsets((3, 14), tstate_frame=72, cframe_frame=NOT_PRESENT, frame_code=0,
                       frame_previous=8, frame_instr=56, frame_owner=78, code_firstlineno=84,
                       code_filename=128, code_name=136, code_qualname=144, code_linetable=152,
                       code_bytecode=232, runtime_tss=2336, sizeof_ascii_object=56,
                       tstate_datastack=232, free_threaded=True, object_type=24, code_tlbc=224),
    (3, 15): PyOffsets((3, 15), tstate_frame=72, cframe_frame=NOT_PRESENT, frame_code=0,
                       frame_previous=8, frame_instr=56, frame_owner=78, code_firstlineno=84,
                       code_filename=128, code_name=136, code_qualname=144, code_linetable=152,
                       code_bytecode=232, runtime_tss=NOT_PRESENT, sizeof_ascii_object=56,
                       tstate_datastack=256, free_threaded=True, object_type=24, code_tlbc=224,
                       runtime_interpreters_head=936, interp_threads_head=7336, interp_next=7264, tstate_prev=0,
                       tstate_next=8, tstate_thread_id=176, tstate_interp=16, tstate_base_frame=80),
}


def offsets_for(version: tuple[int, int], free_threaded: bool) -> PyOffsets | None:
    """The offsets of this build of CPython, or None where kvtrace has none."""
    return (FREE_THREADED_OFFSETS if free_threaded else OFFSETS).get(version)


SUPPORTED_BUILDS = ", ".join([f"{major}.{minor}" for major, minor in sorted(OFFSETS)]
                             + [f"{major}.{minor}t" for major, minor in sorted(FREE_THREADED_OFFSETS)])

# glibc: struct pthread.specific_1stblock, an array of {seq, data} pairs for keys < 32
GLIBC_SPECIFIC_1STBLOCK = 0x310
GLIBC_SPECIFIC_ENTRY_SIZE = 16
GLIBC_SPECIFIC_1STBLOCK_KEYS = 32
