"""Just enough of a BTF reader to find kernel struct member offsets (task_struct.thread.fsbase).

The kernel headers bcc compiles against may describe another kernel (FACTS.md), so offsets of
kernel structs come from the running kernel's own BTF, never from headers.
"""
from __future__ import annotations

import struct
from collections.abc import Iterable
from pathlib import Path

VMLINUX_BTF = Path("/sys/kernel/btf/vmlinux")

_KIND_STRUCT, _KIND_UNION = 4, 5
_KIND_TYPEDEF, _KIND_VOLATILE, _KIND_CONST, _KIND_RESTRICT, _KIND_TYPE_TAG = 8, 9, 10, 11, 18
# Bytes of kind-specific data after the 12-byte type header: fixed, or per vlen entry.
_FIXED_EXTRA = {1: 4, 3: 12, 14: 4, 17: 4}
_PER_VLEN = {4: 12, 5: 12, 6: 8, 13: 8, 15: 12, 19: 12}


class BtfError(Exception):
    pass


class Btf:
    def __init__(self, data: bytes) -> None:
        magic, _version, _flags, hdr_len, type_off, type_len, str_off, str_len = struct.unpack_from(
            "<HBBIIIII", data, 0)
        if magic != 0xEB9F:
            raise BtfError("not BTF data (bad magic)")
        self._strings = data[hdr_len + str_off:hdr_len + str_off + str_len]
        self._types: list[tuple[int, int, int, list[tuple[int, int, int]]]] = [(0, 0, 0, [])]
        position, end = hdr_len + type_off, hdr_len + type_off + type_len
        while position < end:
            name_off, info, size_or_type = struct.unpack_from("<III", data, position)
            position += 12
            kind, vlen = (info >> 24) & 0x1F, info & 0xFFFF
            members = []
            if kind in (_KIND_STRUCT, _KIND_UNION):
                kind_flag = info >> 31
                for _ in range(vlen):
                    m_name, m_type, m_offset = struct.unpack_from("<III", data, position)
                    position += 12
                    bit_offset = m_offset & 0xFFFFFF if kind_flag else m_offset
                    members.append((m_name, m_type, bit_offset))
            else:
                position += _FIXED_EXTRA.get(kind, 0) + _PER_VLEN.get(kind, 0) * vlen
            self._types.append((kind, name_off, size_or_type, members))

    @classmethod
    def from_file(cls, path: Path = VMLINUX_BTF) -> Btf:
        try:
            return cls(path.read_bytes())
        except OSError as error:
            raise BtfError(f"cannot read {path}: {error} (kernel built without CONFIG_DEBUG_INFO_BTF?)") from error

    def _name(self, offset: int) -> str:
        end = self._strings.index(b"\0", offset)
        return self._strings[offset:end].decode()

    def _resolve(self, type_id: int) -> int:
        while self._types[type_id][0] in (_KIND_TYPEDEF, _KIND_VOLATILE, _KIND_CONST,
                                          _KIND_RESTRICT, _KIND_TYPE_TAG):
            type_id = self._types[type_id][2]
        return type_id

    def _struct_id(self, name: str) -> int:
        for type_id, (kind, name_off, _, _) in enumerate(self._types):
            if kind == _KIND_STRUCT and name_off and self._name(name_off) == name:
                return type_id
        raise BtfError(f"struct {name} not in BTF")

    def _member(self, struct_id: int, name: str) -> tuple[int, int] | None:
        """(byte offset, type id) of a member, looking through anonymous structs and unions."""
        for m_name, m_type, bit_offset in self._types[struct_id][3]:
            if m_name and self._name(m_name) == name:
                return bit_offset // 8, m_type
            if not m_name:
                inner_id = self._resolve(m_type)
                if self._types[inner_id][0] in (_KIND_STRUCT, _KIND_UNION):
                    found = self._member(inner_id, name)
                    if found is not None:
                        return bit_offset // 8 + found[0], found[1]
        return None

    def offset_of(self, struct_name: str, path: str) -> int:
        """Byte offset of a dotted member path, e.g. offset_of("task_struct", "thread.fsbase")."""
        type_id = self._struct_id(struct_name)
        total = 0
        for part in path.split("."):
            found = self._member(self._resolve(type_id), part)
            if found is None:
                raise BtfError(f"{struct_name}.{path}: no member {part!r}")
            total += found[0]
            type_id = found[1]
        return total


# task_struct members the probes read: the user fs base (x86_64 TLS pointer: Python stacks), the wait
# status do_exit sets before sched_process_exit, and the thread's name (16 bytes).
TASK_FSBASE, TASK_EXIT_CODE, TASK_COMM = "thread.fsbase", "exit_code", "comm"


def task_offsets(members: Iterable[str], path: Path = VMLINUX_BTF) -> dict[str, int | BtfError]:
    """Offsets of `members` in task_struct for this kernel, from its BTF read once; a member that cannot
    be found (or BTF that cannot be read) maps to the error that says why."""
    try:
        btf = Btf.from_file(path)
    except BtfError as error:
        return {member: error for member in members}
    offsets: dict[str, int | BtfError] = {}
    for member in members:
        try:
            offsets[member] = btf.offset_of("task_struct", member)
        except BtfError as error:
            offsets[member] = error
    return offsets
