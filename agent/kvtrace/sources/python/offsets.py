"""CPython internals kvtrace reads, per minor version (x86_64, glibc, default GIL build).

Checked against the prototype (FACTS.md) and, at attach time, against the target's own
PyCode_Type.tp_members / PyFrame_Type.tp_members and, on 3.13, _Py_DebugOffsets
(sources/python/runtime.py). Anything not in this table is refused with a reason, never guessed.
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
    # _PyRuntime.autoTSSkey (a Py_tss_t); the pthread key is at +4
    runtime_tss: int
    sizeof_ascii_object: int  # sizeof(PyASCIIObject): compact ASCII data follows it
    # 3.11+: PyThreadState.datastack_chunk, followed by datastack_top and datastack_limit: the
    # thread's frames are contiguous in [chunk, limit), so the probe reads many in one go;
    # NOT_PRESENT on 3.10 (heap frame objects)
    tstate_datastack: int = NOT_PRESENT

    @property
    def frame_read_bytes(self) -> int:
        """How much of a frame to read in one go to get code, previous, instruction and owner."""
        last = max(self.frame_code, self.frame_previous, self.frame_instr, self.frame_owner)
        return last + 8

    @property
    def instr_is_pointer(self) -> bool:
        return self.version >= (3, 11)


# Frame owner values (Include/internal/pycore_frame.h): a frame owned by the C stack is a shim
# (3.12+) and is not Python code.
FRAME_OWNED_BY_CSTACK = 3

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
}

# glibc: struct pthread.specific_1stblock, an array of {seq, data} pairs for keys < 32
GLIBC_SPECIFIC_1STBLOCK = 0x310
GLIBC_SPECIFIC_ENTRY_SIZE = 16
GLIBC_SPECIFIC_1STBLOCK_KEYS = 32
