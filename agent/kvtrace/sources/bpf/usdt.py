"""USDT probes (SystemTap SDT v3 notes) of an ELF file: where each probe site is, which semaphore
guards it, and where its arguments are at the probe, for BPF to read from `struct pt_regs`.

kvtrace attaches to these itself (uprobe_multi links, kernel >= 6.6) instead of through bcc's
USDT support: one link per library and probe name with every site's file offset, and the
semaphore's file offset as the uprobe ref_ctr_offset, so that the kernel raises the semaphore
while the link exists (a guarded site such as PyTorch's `if (semaphore) probe` fires only then)
and lowers it when the link goes, even if kvtrace dies.

The note (section .note.stapsdt, owner "stapsdt", type 3) holds three address-sized words (the
probe's pc, the link-time address of the .stapsdt.base section, the semaphore's address or 0)
and then provider\\0 name\\0 arguments\\0. The arguments are GNU assembler operands as the
compiler chose them, e.g. `-8@%rax -1@%dl -8@%r14 -8@-56(%rbp)` (size in bytes, negative when
signed, @ location). pyelftools (0.33) walks the notes but does not decode this descriptor
(it even names type 3 NT_GNU_BUILD_ID, that being its number for owner "GNU"), so it is decoded
here.

Nothing here needs root: it only reads the file.
"""
from __future__ import annotations

import enum
import logging
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from elftools.elf.sections import NoteSection

from kvtrace.sources.elf import Segment, elf_file, load_segments, segment_at

log = logging.getLogger(__name__)

NOTE_SECTION = ".note.stapsdt"
BASE_SECTION = ".stapsdt.base"
NOTE_OWNER = "stapsdt"
NOTE_TYPE = 3
# pyelftools maps a non-core file's note type 3 to this name whatever the owner.
_NOTE_TYPE_NAMES = (NOTE_TYPE, "NT_GNU_BUILD_ID")

_PF_X, _PF_W = 0x1, 0x2


# ---- arguments ----

@dataclass(frozen=True, slots=True)
class Register:
    """An x86-64 general register as an operand names it.

    The kernel saves each register as one 8-byte slot of `struct pt_regs`; `%dl`, `%dx`, `%edx`
    and `%rdx` all live in the rdx slot and differ only in how many low bytes they cover.
    """

    name: str              # as written, without the '%': "dl"
    pt_regs_offset: int    # byte offset of its 8-byte slot in the kernel's struct pt_regs (x86-64)
    width_bytes: int       # low bytes of that slot the name covers: 1 for %dl, 8 for %rdx


class ArgumentKind(enum.Enum):
    CONSTANT = "constant"  # N@$imm: the value is `constant`
    REGISTER = "register"  # N@%reg: the value is the low size_bytes of the register
    MEMORY = "memory"      # N@disp(%base[,%index,scale]): size_bytes read at base + disp + index*scale


@dataclass(frozen=True, slots=True)
class UsdtArgument:
    """One probe argument: where its value is at the probe site, and how wide it is.

    To read it (what kvtrace's BPF side does): CONSTANT is `constant`; REGISTER reads the
    8-byte slot at `base.pt_regs_offset` and keeps the low `size_bytes`; MEMORY reads
    `size_bytes` from user memory at base + displacement_bytes (+ index * scale). Then,
    when `signed`, sign-extend from size_bytes * 8 bits.
    """

    text: str                     # the operand as the note has it, for messages
    kind: ArgumentKind
    size_bytes: int               # 1, 2, 4 or 8
    signed: bool
    constant: int = 0             # CONSTANT only
    base: Register | None = None  # REGISTER: the register; MEMORY: the base register
    displacement_bytes: int = 0   # MEMORY only
    index: Register | None = None  # MEMORY with an index register only
    scale: int = 1                # multiplier of the index: 1, 2, 4 or 8


# Byte offsets of the 8-byte slots in x86-64 `struct pt_regs` (arch/x86/include/asm/ptrace.h):
# r15 r14 r13 r12 bp bx r11 r10 r9 r8 ax cx dx si di orig_ax ip cs flags sp ss.
_PT_REGS_OFFSETS = {
    "r15": 0, "r14": 8, "r13": 16, "r12": 24, "rbp": 32, "rbx": 40, "r11": 48, "r10": 56,
    "r9": 64, "r8": 72, "rax": 80, "rcx": 88, "rdx": 96, "rsi": 104, "rdi": 112, "rip": 128,
    "rsp": 152,
}


def _register_names() -> dict[str, Register]:
    """Every name gas can print for a general register, 8/4/2/1 bytes wide."""
    names: dict[str, Register] = {}
    legacy = {  # 64, 32, 16, 8-bit (low byte) names
        "rax": ("eax", "ax", "al"), "rbx": ("ebx", "bx", "bl"), "rcx": ("ecx", "cx", "cl"),
        "rdx": ("edx", "dx", "dl"), "rsi": ("esi", "si", "sil"), "rdi": ("edi", "di", "dil"),
        "rbp": ("ebp", "bp", "bpl"), "rsp": ("esp", "sp", "spl"),
    }
    for full, (name32, name16, name8) in legacy.items():
        for name, width in ((full, 8), (name32, 4), (name16, 2), (name8, 1)):
            names[name] = Register(name, _PT_REGS_OFFSETS[full], width)
    for number in range(8, 16):
        full = f"r{number}"
        for name, width in ((full, 8), (f"{full}d", 4), (f"{full}w", 2), (f"{full}b", 1)):
            names[name] = Register(name, _PT_REGS_OFFSETS[full], width)
    names["rip"] = Register("rip", _PT_REGS_OFFSETS["rip"], 8)
    return names


REGISTERS: dict[str, Register] = _register_names()

# Names gas knows that an argument cannot be read from: the high-byte registers (bits 8-15, no
# slot of their own; compilers do not pick them for SDT operands) and registers pt_regs lacks.
_UNREADABLE_REGISTER = re.compile(r"^(?:[abcd]h|xmm\d+|ymm\d+|zmm\d+|st(?:\(\d\))?|[cdefgs]s|k\d)$")

_INTEGER = r"[-+]?(?:0[xX][0-9a-fA-F]+|\d+)"
_OPERAND = re.compile(r"^(?P<size>-?\d+)@(?P<location>.+)$")
_CONSTANT = re.compile(rf"^\$(?P<value>{_INTEGER})$")
_REGISTER = re.compile(r"^%(?P<name>[a-z0-9]+)$")
_MEMORY = re.compile(
    rf"^(?P<displacement>{_INTEGER})?\(\s*%(?P<base>[a-z0-9]+)\s*"
    rf"(?:,\s*%(?P<index>[a-z0-9]+)\s*(?:,\s*(?P<scale>[1248])\s*)?)?\)$")
# gcc's form for a global: `counter(%rip)`, `counter+8(%rip)`.
_SYMBOL_RELATIVE = re.compile(r"^[A-Za-z_.][\w.$@]*(?:[-+]\d+)?\(")
_SIZES_BYTES = (1, 2, 4, 8)


def _register(name: str, operand: str) -> Register:
    register = REGISTERS.get(name)
    if register is not None:
        return register
    if _UNREADABLE_REGISTER.match(name):
        raise ValueError(f"USDT operand {operand!r}: register %{name} is not readable from pt_regs")
    raise ValueError(f"USDT operand {operand!r}: unknown register %{name}")


def parse_argument(text: str) -> UsdtArgument:
    """One x86-64 SDT operand: `N@%reg`, `N@$imm`, `N@disp(%reg)` or `N@disp(%base,%index,scale)`.

    Raises ValueError naming the operand for anything else (symbol- or %rip-relative memory,
    floating-point `Nf@`, segment overrides, a register narrower than the size), so that the
    caller refuses the probe with a reason rather than read garbage.
    """
    operand = text.strip()
    match = _OPERAND.match(operand)
    if match is None:
        raise ValueError(f"USDT operand {operand!r}: not SIZE@LOCATION (sizeless, old-format or "
                         f"floating-point operands are not supported)")
    size = int(match["size"])
    size_bytes, signed = abs(size), size < 0
    if size_bytes not in _SIZES_BYTES:
        raise ValueError(f"USDT operand {operand!r}: size {size_bytes} bytes is not 1, 2, 4 or 8")
    location = match["location"].strip()

    if constant := _CONSTANT.match(location):
        return UsdtArgument(operand, ArgumentKind.CONSTANT, size_bytes, signed,
                            constant=int(constant["value"], 0))

    if register_match := _REGISTER.match(location):
        register = _register(register_match["name"], operand)
        if register.name == "rip":
            # At a uprobe, regs->ip is the probe address, not what the instruction would see.
            raise ValueError(f"USDT operand {operand!r}: %rip as a value is not supported")
        if size_bytes > register.width_bytes:
            # The bytes above the named part are whatever was there before: not the value.
            raise ValueError(f"USDT operand {operand!r}: {size_bytes} bytes from the "
                             f"{register.width_bytes}-byte register %{register.name}")
        return UsdtArgument(operand, ArgumentKind.REGISTER, size_bytes, signed, base=register)

    if memory := _MEMORY.match(location):
        base = _register(memory["base"], operand)
        if base.name == "rip":
            # gcc writes these as `symbol(%rip)`; a bare number relative to %rip would need the
            # length of the (replaced) nop instruction, so neither is supported.
            raise ValueError(f"USDT operand {operand!r}: %rip-relative memory is not supported")
        index = _register(memory["index"], operand) if memory["index"] else None
        for address_register in (base, index):
            if address_register is not None and address_register.width_bytes != 8:
                raise ValueError(f"USDT operand {operand!r}: 32-bit addressing through "
                                 f"%{address_register.name} is not supported")
        if index is not None and index.name == "rsp":
            raise ValueError(f"USDT operand {operand!r}: %rsp cannot be an index register")
        displacement = int(memory["displacement"], 0) if memory["displacement"] else 0
        return UsdtArgument(operand, ArgumentKind.MEMORY, size_bytes, signed, base=base,
                            displacement_bytes=displacement, index=index,
                            scale=int(memory["scale"] or 1))

    if _SYMBOL_RELATIVE.match(location):
        raise ValueError(f"USDT operand {operand!r}: symbol-relative memory is not supported")
    raise ValueError(f"USDT operand {operand!r}: unknown location form {location!r}")


def parse_arguments(text: str) -> tuple[UsdtArgument, ...]:
    """The note's argument string: operands separated by spaces (none inside an operand)."""
    return tuple(parse_argument(operand) for operand in text.split())


# ---- probes ----

@dataclass(frozen=True, slots=True)
class UsdtProbe:
    """One probe site of an ELF file (a probe written twice, or inlined twice, has two).

    The three addresses are the note's own, link-time virtual addresses (what `readelf -n`
    shows). The file offsets are what the kernel takes (uprobe offset, ref_ctr_offset): the
    note's addresses corrected for prelinking, then placed through the PT_LOAD segments.
    `problem` says why the probe cannot be used as read (an argument form we do not read, an
    address outside the file's segments); kvtrace refuses such a probe with that reason.
    """

    provider: str
    name: str
    pc_address: int
    base_address: int           # the note's idea of where .stapsdt.base was linked; 0 if none
    semaphore_address: int      # 0: no semaphore, the site always fires
    arguments_text: str         # as in the note, e.g. "-8@%rax -1@%dl -8@%r14 -8@-56(%rbp)"
    arguments: tuple[UsdtArgument, ...]
    pc_file_offset: int         # 0 when `problem` says the pc is outside an executable segment
    semaphore_file_offset: int  # 0: no semaphore, or `problem` says where it failed
    problem: str | None = None

    @property
    def usable(self) -> bool:
        return self.problem is None


def _file_offset(segments: list[Segment], vaddr: int, needed_flag: int, what: str) -> tuple[int, str | None]:
    """(file offset, None) or (0, why not). Only the file-backed part of a segment counts: a
    semaphore in .bss has no file offset, so the kernel could not count on it."""
    segment = segment_at(segments, vaddr)
    if segment is None:
        return 0, f"{what} 0x{vaddr:x} is outside the file-backed part of every PT_LOAD segment"
    if not segment.flags & needed_flag:
        kind = "executable" if needed_flag == _PF_X else "writable"
        return 0, f"{what} 0x{vaddr:x} is in a segment that is not {kind}"
    return vaddr - segment.vaddr + segment.file_offset, None


def _decode_descriptor(descriptor: bytes, address_size: int,
                       little_endian: bool) -> tuple[int, int, int, str, str, str]:
    """(pc, base, semaphore, provider, name, arguments); ValueError when malformed."""
    word = struct.Struct(("<" if little_endian else ">") + ("Q" if address_size == 8 else "I"))
    header_size = 3 * word.size
    if len(descriptor) < header_size + 2:
        raise ValueError(f"descriptor of {len(descriptor)} bytes is too short")
    pc, base, semaphore = (word.unpack_from(descriptor, i * word.size)[0] for i in range(3))
    strings = descriptor[header_size:].split(b"\0")
    if len(strings) < 3:  # provider\0 name\0 at least; the argument string may be missing
        raise ValueError("provider and name are not NUL-terminated")
    provider, name = strings[0].decode("ascii", "replace"), strings[1].decode("ascii", "replace")
    arguments = strings[2].decode("ascii", "replace")  # "" when the note has none
    if not provider or not name:
        raise ValueError("empty provider or name")
    return pc, base, semaphore, provider, name, arguments


def read_usdt_probes(path: str | Path) -> list[UsdtProbe]:
    """Every SDT probe site in the file, in note order; [] when it has none.

    Raises READ_ERRORS (kvtrace.sources.elf) when the file cannot be read as ELF. A malformed note is
    skipped with a warning (its provider and name may be unknown); a probe that can be named but
    not used comes back with `problem` set.
    """
    with open(path, "rb") as stream:
        elf = elf_file(stream)
        # One section in a linked file; a relocatable object can have several (COMDAT groups).
        note_sections = [section for section in elf.iter_sections()
                         if isinstance(section, NoteSection) and section.name == NOTE_SECTION]
        if not note_sections:
            return []
        address_size = 8 if elf.elfclass == 64 else 4
        segments = load_segments(elf)
        base_section = elf.get_section_by_name(BASE_SECTION)
        base_section_address = base_section["sh_addr"] if base_section is not None else 0
        machine = elf["e_machine"]
        probes = []
        notes = (note for section in note_sections for note in section.iter_notes())
        for note in notes:
            if note["n_name"] != NOTE_OWNER or note["n_type"] not in _NOTE_TYPE_NAMES:
                continue
            try:
                pc, base, semaphore, provider, name, arguments_text = _decode_descriptor(
                    bytes(note["n_descdata"]), address_size, elf.little_endian)
            except ValueError as error:
                log.warning("%s: skipping a malformed %s note at file offset %d: %s",
                            path, NOTE_SECTION, note["n_offset"], error)
                continue
            probes.append(_probe(provider, name, pc, base, semaphore, arguments_text, segments,
                                 base_section_address, machine))
        return probes


def _probe(provider: str, name: str, pc: int, base: int, semaphore: int, arguments_text: str,
           segments: list[Segment], base_section_address: int, machine: str) -> UsdtProbe:
    problems = []
    # Prelink moves a library's sections after linking without rewriting the (unallocated) note:
    # the note's base then differs from where .stapsdt.base is now. libbpf (usdt.c) corrects the
    # pc by that difference and leaves the semaphore as the note has it; but prelink moved
    # .probes with everything else, so the semaphore gets the same correction here.
    delta_bytes = base_section_address - base if base and base_section_address else 0
    pc_file_offset, problem = _file_offset(segments, pc + delta_bytes, _PF_X, "pc")
    if problem:
        problems.append(problem)
    semaphore_file_offset = 0
    if semaphore:
        semaphore_file_offset, problem = _file_offset(segments, semaphore + delta_bytes, _PF_W,
                                                      "semaphore")
        if problem:
            problems.append(problem)
    arguments: tuple[UsdtArgument, ...] = ()
    if machine != "EM_X86_64":
        problems.append(f"arguments are read for x86-64 only, this file is {machine}")
    else:
        try:
            arguments = parse_arguments(arguments_text)
        except ValueError as error:
            problems.append(str(error))
    return UsdtProbe(provider=provider, name=name, pc_address=pc, base_address=base,
                     semaphore_address=semaphore, arguments_text=arguments_text,
                     arguments=arguments, pc_file_offset=pc_file_offset,
                     semaphore_file_offset=semaphore_file_offset,
                     problem="; ".join(problems) or None)
