"""USDT notes: the x86-64 operand parser, table-driven (every form, torch 2.11's own strings), and
read_usdt_probes against the stub PyTorch allocator (libc10_cuda.so built from tests/integration/stubs with
the vendored sdt.h, which kvtrace's PyTorch hook ships), cross-checked with `readelf -n`. No root: the library is
only read, and the workload runs with nothing attached."""
from __future__ import annotations

import itertools
import re
import shutil
import struct
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from elftools.elf.elffile import ELFFile

from kvtrace.sources.bpf.usdt import (
    ArgumentKind,
    Register,
    UsdtArgument,
    parse_argument,
    parse_arguments,
    read_usdt_probes,
)

# torch_stubs builds on cuda_stubs, which the integration tests import from their own directory.
INTEGRATION_DIR = Path(__file__).resolve().parents[1] / "integration"
sys.path.insert(0, str(INTEGRATION_DIR))

from cuda_stubs import StubBuildError, build_stubs, run_workload
from torch_stubs import (
    BLOCKS_DEVICE0_FREES,
    BLOCKS_DEVICE0_MALLOCS,
    BLOCKS_DEVICE1_FREES,
    BLOCKS_DEVICE1_MALLOCS,
    BLOCKS_SEGMENTS,
    PROBE_SITES,
    TorchStubBuild,
    build_torch_stub,
)

# struct pt_regs (x86-64) slot offsets, written out independently of the module's table.
PT_REGS = {"r15": 0, "r14": 8, "r13": 16, "r12": 24, "rbp": 32, "rbx": 40, "r11": 48, "r10": 56,
           "r9": 64, "r8": 72, "rax": 80, "rcx": 88, "rdx": 96, "rsi": 104, "rdi": 112,
           "rsp": 152}


def reg(full: str, name: str | None = None, width_bytes: int = 8) -> Register:
    return Register(name or full, PT_REGS[full], width_bytes)


REG, MEM, CONST = ArgumentKind.REGISTER, ArgumentKind.MEMORY, ArgumentKind.CONSTANT

# (operand, kind, size_bytes, signed, constant, base, displacement_bytes, index, scale)
PARSE_CASES = [
    # torch 2.11 libc10_cuda.so, pytorch:malloc and pytorch:free
    ("-8@%rax", REG, 8, True, 0, reg("rax"), 0, None, 1),
    ("-1@%dl", REG, 1, True, 0, reg("rdx", "dl", 1), 0, None, 1),
    ("-8@%r14", REG, 8, True, 0, reg("r14"), 0, None, 1),
    ("-8@-56(%rbp)", MEM, 8, True, 0, reg("rbp"), -56, None, 1),
    ("-8@%rdi", REG, 8, True, 0, reg("rdi"), 0, None, 1),
    # registers of every width
    ("8@%rsi", REG, 8, False, 0, reg("rsi"), 0, None, 1),
    ("4@%eax", REG, 4, False, 0, reg("rax", "eax", 4), 0, None, 1),
    ("-4@%esp", REG, 4, True, 0, reg("rsp", "esp", 4), 0, None, 1),
    ("2@%ax", REG, 2, False, 0, reg("rax", "ax", 2), 0, None, 1),
    ("2@%bp", REG, 2, False, 0, reg("rbp", "bp", 2), 0, None, 1),
    ("1@%al", REG, 1, False, 0, reg("rax", "al", 1), 0, None, 1),
    ("1@%bl", REG, 1, False, 0, reg("rbx", "bl", 1), 0, None, 1),
    ("1@%cl", REG, 1, False, 0, reg("rcx", "cl", 1), 0, None, 1),
    ("-1@%sil", REG, 1, True, 0, reg("rsi", "sil", 1), 0, None, 1),
    ("1@%dil", REG, 1, False, 0, reg("rdi", "dil", 1), 0, None, 1),
    ("1@%bpl", REG, 1, False, 0, reg("rbp", "bpl", 1), 0, None, 1),
    ("1@%spl", REG, 1, False, 0, reg("rsp", "spl", 1), 0, None, 1),
    ("-4@%r14d", REG, 4, True, 0, reg("r14", "r14d", 4), 0, None, 1),
    ("2@%r8w", REG, 2, False, 0, reg("r8", "r8w", 2), 0, None, 1),
    ("1@%r9b", REG, 1, False, 0, reg("r9", "r9b", 1), 0, None, 1),
    ("8@%r15", REG, 8, False, 0, reg("r15"), 0, None, 1),
    ("-4@%r12d", REG, 4, True, 0, reg("r12", "r12d", 4), 0, None, 1),
    ("2@%r13w", REG, 2, False, 0, reg("r13", "r13w", 2), 0, None, 1),
    ("1@%r10b", REG, 1, False, 0, reg("r10", "r10b", 1), 0, None, 1),
    ("8@%r11", REG, 8, False, 0, reg("r11"), 0, None, 1),
    ("4@%ecx", REG, 4, False, 0, reg("rcx", "ecx", 4), 0, None, 1),
    ("1@%rdx", REG, 1, False, 0, reg("rdx"), 0, None, 1),  # fewer bytes than the register: low ones
    # constants
    ("4@$42", CONST, 4, False, 42, None, 0, None, 1),
    ("-4@$-5", CONST, 4, True, -5, None, 0, None, 1),
    ("8@$0x10", CONST, 8, False, 16, None, 0, None, 1),
    ("1@$0", CONST, 1, False, 0, None, 0, None, 1),
    # memory relative to a register
    ("-4@-20(%rbp)", MEM, 4, True, 0, reg("rbp"), -20, None, 1),
    ("8@(%rsp)", MEM, 8, False, 0, reg("rsp"), 0, None, 1),
    ("8@16(%rsp)", MEM, 8, False, 0, reg("rsp"), 16, None, 1),
    ("2@0x18(%rax)", MEM, 2, False, 0, reg("rax"), 24, None, 1),
    ("-8@+8(%r12)", MEM, 8, True, 0, reg("r12"), 8, None, 1),
    # memory with an index register
    ("8@8(%rax,%rbx,4)", MEM, 8, False, 0, reg("rax"), 8, reg("rbx"), 4),
    ("4@(%rdi,%rsi)", MEM, 4, False, 0, reg("rdi"), 0, reg("rsi"), 1),
    ("-8@-8(%rbp,%r12,8)", MEM, 8, True, 0, reg("rbp"), -8, reg("r12"), 8),
    ("1@(%r8,%r9,2)", MEM, 1, False, 0, reg("r8"), 0, reg("r9"), 2),
]


@pytest.mark.parametrize("case", PARSE_CASES, ids=[case[0] for case in PARSE_CASES])
def test_parse_argument(case):
    text, kind, size_bytes, signed, constant, base, displacement_bytes, index, scale = case
    assert parse_argument(text) == UsdtArgument(
        text=text, kind=kind, size_bytes=size_bytes, signed=signed, constant=constant, base=base,
        displacement_bytes=displacement_bytes, index=index, scale=scale)


@pytest.mark.parametrize("text, reason", [
    ("", "not SIZE@LOCATION"),
    ("%rax", "not SIZE@LOCATION"),            # sizeless (SDT v1/v2)
    ("8f@%xmm0", "not SIZE@LOCATION"),        # floating point
    ("3@%rax", "size 3 bytes"),
    ("16@%rax", "size 16 bytes"),
    ("0@%rax", "size 0 bytes"),
    ("8@%eax", "8 bytes from the 4-byte register"),
    ("-2@%dl", "2 bytes from the 1-byte register"),
    ("1@%ah", "not readable from pt_regs"),   # high byte: no slot of its own
    ("8@%xmm1", "not readable from pt_regs"),
    ("8@%fs", "not readable from pt_regs"),
    ("8@%foo", "unknown register %foo"),
    ("8@%rip", "%rip as a value"),
    ("8@counter(%rip)", "symbol-relative"),
    ("8@counter+8(%rip)", "symbol-relative"),
    ("8@16(%rip)", "%rip-relative memory"),
    ("4@(%eax)", "32-bit addressing"),
    ("4@(%rax,%ecx,2)", "32-bit addressing"),
    ("8@(%rax,%rsp,2)", "%rsp cannot be an index"),
    ("8@(%rax,%rbx,3)", "unknown location form"),
    ("8@%fs:16", "unknown location form"),
    ("8@1234", "unknown location form"),      # absolute memory
    ("8@$abc", "unknown location form"),
    ("8@(%rbx", "unknown location form"),
])
def test_parse_argument_refuses_with_the_operand_named(text, reason):
    with pytest.raises(ValueError) as raised:
        parse_argument(text)
    message = str(raised.value)
    assert repr(text.strip()) in message
    assert reason in message


def test_every_register_name_maps_to_its_pt_regs_slot():
    families = {
        "rax": ("eax", "ax", "al"), "rbx": ("ebx", "bx", "bl"), "rcx": ("ecx", "cx", "cl"),
        "rdx": ("edx", "dx", "dl"), "rsi": ("esi", "si", "sil"), "rdi": ("edi", "di", "dil"),
        "rbp": ("ebp", "bp", "bpl"), "rsp": ("esp", "sp", "spl"),
        **{f"r{n}": (f"r{n}d", f"r{n}w", f"r{n}b") for n in range(8, 16)},
    }
    for full, (name32, name16, name8) in families.items():
        for name, width_bytes in ((full, 8), (name32, 4), (name16, 2), (name8, 1)):
            argument = parse_argument(f"{width_bytes}@%{name}")
            assert argument.base == Register(name, PT_REGS[full], width_bytes), name


def test_parse_arguments_splits_the_note_string():
    arguments = parse_arguments("-8@%rax -1@%dl -8@%r14 -8@-56(%rbp)")
    assert [argument.text for argument in arguments] == ["-8@%rax", "-1@%dl", "-8@%r14",
                                                         "-8@-56(%rbp)"]
    assert parse_arguments("") == ()
    with pytest.raises(ValueError, match="'-8@%rxx'"):
        parse_arguments("-8@%rax -8@%rxx")


# ---- the stub library ----

@pytest.fixture(scope="module")
def torch_stub(tmp_path_factory) -> TorchStubBuild:
    if shutil.which("gcc") is None:
        pytest.skip("gcc not found on PATH: the stub PyTorch library cannot be built")
    out_dir = tmp_path_factory.mktemp("usdt")
    try:
        return build_torch_stub(out_dir, build_stubs(out_dir))
    except StubBuildError as error:
        pytest.fail(f"building the stubs failed:\n{error}")


def load_segments(path: Path) -> list[dict]:
    with open(path, "rb") as stream:
        return [{"vaddr": s["p_vaddr"], "offset": s["p_offset"], "filesz": s["p_filesz"],
                 "flags": s["p_flags"]}
                for s in ELFFile(stream).iter_segments() if s["p_type"] == "PT_LOAD"]


def segment_of_offset(segments: list[dict], offset: int) -> dict:
    (segment,) = [s for s in segments if s["offset"] <= offset < s["offset"] + s["filesz"]]
    return segment


def test_stub_library_has_torchs_probes(torch_stub):
    probes = read_usdt_probes(torch_stub.libc10_cuda)

    assert {probe.provider for probe in probes} == {"pytorch"}
    assert Counter(probe.name for probe in probes) == Counter(PROBE_SITES)
    assert all(probe.usable for probe in probes), [probe.problem for probe in probes]
    (malloc,) = [probe for probe in probes if probe.name == "malloc"]
    frees = [probe for probe in probes if probe.name == "free"]
    # (pointer, device as int8, size, stream id) and (pointer), all signed as torch declares them;
    # where gcc put them may vary, the parser must have read whatever it chose.
    assert [(a.size_bytes, a.signed) for a in malloc.arguments] == [(8, True), (1, True), (8, True),
                                                                      (8, True)]
    assert all([(a.size_bytes, a.signed) for a in free.arguments] == [(8, True)] for free in frees)
    assert ([a.text for a in malloc.arguments] ==
            malloc.arguments_text.split())
    # One semaphore per probe name, shared by the sites; two different sites.
    assert malloc.semaphore_address != 0
    assert len({free.semaphore_address for free in frees}) == 1
    assert frees[0].semaphore_address not in (0, malloc.semaphore_address)
    assert len({free.pc_file_offset for free in frees}) == len(frees)


def test_stub_semaphores_are_zero_in_the_file_and_pcs_are_nops_in_text(torch_stub):
    probes = read_usdt_probes(torch_stub.libc10_cuda)
    data = torch_stub.libc10_cuda.read_bytes()
    segments = load_segments(torch_stub.libc10_cuda)
    PF_X, PF_W = 1, 2
    for probe in probes:
        semaphore_segment = segment_of_offset(segments, probe.semaphore_file_offset)
        assert semaphore_segment["flags"] & PF_W
        # The note's address, placed through the segment by hand, is the same byte.
        assert (probe.semaphore_address - semaphore_segment["vaddr"] + semaphore_segment["offset"]
                == probe.semaphore_file_offset)
        assert struct.unpack_from("<H", data, probe.semaphore_file_offset) == (0,)

        text_segment = segment_of_offset(segments, probe.pc_file_offset)
        assert text_segment["flags"] & PF_X
        assert probe.pc_address - text_segment["vaddr"] + text_segment["offset"] == probe.pc_file_offset
        assert data[probe.pc_file_offset] == 0x90  # sdt.h's site is one nop


def test_stub_semaphore_file_offset_differs_from_its_address(torch_stub):
    """The data segment's file offset and address differ (by a page, usually): a reader that
    passed the address as ref_ctr_offset would make the kernel count on the wrong bytes."""
    (malloc,) = [p for p in read_usdt_probes(torch_stub.libc10_cuda) if p.name == "malloc"]
    assert malloc.semaphore_file_offset != malloc.semaphore_address


_READELF_PROBE = re.compile(
    r"Provider: (?P<provider>\S+)\s+Name: (?P<name>\S+)\s+"
    r"Location: 0x(?P<pc>[0-9a-f]+), Base: 0x(?P<base>[0-9a-f]+), "
    r"Semaphore: 0x(?P<semaphore>[0-9a-f]+)\s+Arguments: ?(?P<arguments>[^\n]*)")


def test_stub_probes_match_readelf(torch_stub):
    if shutil.which("readelf") is None:
        pytest.skip("readelf (binutils) not found on PATH")
    output = subprocess.run(["readelf", "-n", "--wide", str(torch_stub.libc10_cuda)],
                            capture_output=True, text=True, check=True).stdout
    expected = [(m["provider"], m["name"], int(m["pc"], 16), int(m["base"], 16),
                 int(m["semaphore"], 16), m["arguments"].strip())
                for m in _READELF_PROBE.finditer(output)]
    found = [(p.provider, p.name, p.pc_address, p.base_address, p.semaphore_address,
              p.arguments_text) for p in read_usdt_probes(torch_stub.libc10_cuda)]
    assert len(expected) == sum(PROBE_SITES.values())
    assert found == expected


def test_stub_base_matches_its_section(torch_stub):
    """Not prelinked: the note's base is where .stapsdt.base is, so no adjustment applies."""
    with open(torch_stub.libc10_cuda, "rb") as stream:
        base_section_address = ELFFile(stream).get_section_by_name(".stapsdt.base")["sh_addr"]
    assert {p.base_address for p in read_usdt_probes(torch_stub.libc10_cuda)} == {
        base_section_address}


# ---- notes rewritten in a copy of the library ----

def note_descriptor_offsets(path: Path) -> list[int]:
    """File offsets of each stapsdt note's descriptor (pc, base, semaphore, strings)."""
    with open(path, "rb") as stream:
        section = ELFFile(stream).get_section_by_name(".note.stapsdt")
        return [note["n_offset"] + 12 + (note["n_namesz"] + 3) // 4 * 4
                for note in section.iter_notes()]


def rewritten_copy(source: Path, destination: Path, edit) -> Path:
    """A copy of the library whose note descriptors `edit(bytearray, descriptor_offset)` changed."""
    data = bytearray(source.read_bytes())
    for offset in note_descriptor_offsets(source):
        edit(data, offset)
    destination.write_bytes(data)
    return destination


def test_prelinked_notes_are_adjusted_by_the_base_section(torch_stub, tmp_path):
    """Prelink moves sections but not the note: a note written when the library was linked 64 KiB
    higher (pc, base and semaphore all 64 KiB higher than the sections are now) must give the
    same file offsets."""
    shift_bytes = 0x10000

    def link_higher(data: bytearray, offset: int) -> None:
        pc, base, semaphore = struct.unpack_from("<QQQ", data, offset)
        struct.pack_into("<QQQ", data, offset, pc + shift_bytes, base + shift_bytes,
                         semaphore + shift_bytes if semaphore else 0)

    original = read_usdt_probes(torch_stub.libc10_cuda)
    moved = read_usdt_probes(rewritten_copy(torch_stub.libc10_cuda, tmp_path / "lib.so", link_higher))
    assert [p.pc_address for p in moved] == [p.pc_address + shift_bytes for p in original]
    assert [p.base_address for p in moved] == [p.base_address + shift_bytes for p in original]
    assert all(p.usable for p in moved)
    assert ([(p.pc_file_offset, p.semaphore_file_offset) for p in moved] ==
            [(p.pc_file_offset, p.semaphore_file_offset) for p in original])


def test_a_semaphore_outside_writable_data_is_a_problem(torch_stub, tmp_path):
    def semaphore_at_pc(data: bytearray, offset: int) -> None:
        (pc,) = struct.unpack_from("<Q", data, offset)
        struct.pack_into("<Q", data, offset + 16, pc)

    probes = read_usdt_probes(rewritten_copy(torch_stub.libc10_cuda, tmp_path / "lib.so",
                                             semaphore_at_pc))
    assert probes and all("not writable" in p.problem for p in probes)


def test_a_pc_outside_the_file_is_a_problem(torch_stub, tmp_path):
    def pc_far_away(data: bytearray, offset: int) -> None:
        struct.pack_into("<Q", data, offset, 0x7000_0000)

    probes = read_usdt_probes(rewritten_copy(torch_stub.libc10_cuda, tmp_path / "lib.so",
                                             pc_far_away))
    assert probes and all(p.pc_file_offset == 0 and "outside" in p.problem for p in probes)


def test_an_unreadable_argument_refuses_that_probe_only(torch_stub, tmp_path):
    def break_free_argument(data: bytearray, offset: int) -> None:
        strings_start = offset + 24  # after pc, base and semaphore
        free_at = data.find(b"free\0-8@%rdi\0", strings_start, strings_start + 64)
        if free_at >= 0:
            data[free_at:free_at + 13] = b"free\0-8@%rxx\0"

    probes = read_usdt_probes(rewritten_copy(torch_stub.libc10_cuda, tmp_path / "lib.so",
                                             break_free_argument))
    by_name = {p.name: p for p in probes}
    assert by_name["malloc"].usable
    broken = [p for p in probes if p.name == "free"]
    assert broken and all(not p.usable and "'-8@%rxx'" in p.problem and p.arguments == ()
                          for p in broken)
    assert all(p.pc_file_offset and p.semaphore_file_offset for p in broken)  # still located


def test_a_file_without_notes_has_no_probes(torch_stub):
    assert read_usdt_probes(torch_stub.cuda.libcudart) == []


# ---- the stub workload, untraced ----

def test_stub_workload_untraced(torch_stub):
    """What later tests count on: semaphores 0 when nothing traces, the documented counts, every
    block inside its segment, and each segment's free bytes = size - its live blocks."""
    manifest = run_workload([torch_stub.workload, "blocks"])
    (semaphores,) = [line for line in manifest if line["kind"] == "semaphores"]
    assert semaphores == {"kind": "semaphores", "malloc": 0, "free": 0}
    blocks = [line for line in manifest if line["kind"] == "block"]
    segments = {line["address"]: line for line in manifest if line["kind"] == "segment"}
    per_device = Counter((b["device"], b["freed"]) for b in blocks)
    assert per_device[(0, True)] == BLOCKS_DEVICE0_FREES
    assert per_device[(0, True)] + per_device[(0, False)] == BLOCKS_DEVICE0_MALLOCS
    assert per_device[(1, True)] == BLOCKS_DEVICE1_FREES
    assert per_device[(1, True)] + per_device[(1, False)] == BLOCKS_DEVICE1_MALLOCS
    assert len(segments) == BLOCKS_SEGMENTS
    assert {b["free_site"] for b in blocks if b["freed"]} == {"c10_stub_free", "c10_stub_raw_delete"}
    for block in blocks:
        segment = segments[block["segment"]]
        assert segment["address"] <= block["address"]
        assert block["address"] + block["block_size_bytes"] <= segment["address"] + segment["size_bytes"]
        assert (segment["device"], segment["stream"]) == (block["device"], block["stream"])
        assert block["block_size_bytes"] >= block["size_bytes"]
    live = [b for b in blocks if not b["freed"]]
    for address, segment in segments.items():
        live_bytes = sum(b["block_size_bytes"] for b in live if b["segment"] == address)
        assert segment["free_bytes"] == segment["size_bytes"] - live_bytes
    # Live blocks never overlap; three addresses are reused after a free.
    spans = sorted((b["address"], b["address"] + b["block_size_bytes"]) for b in live)
    assert all(end <= next_start for (_, end), (next_start, _) in itertools.pairwise(spans))
    assert sum(count - 1 for count in Counter(b["address"] for b in blocks).values()) == 3
