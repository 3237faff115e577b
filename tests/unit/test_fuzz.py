"""Fuzzing (hypothesis) of everything that reads untrusted bytes: the ring-record decoder, the API's
request -> filter parsing, /proc parsing, ELF and USDT note parsing, and Python frame decoding.

Each property says what the parser promises for *any* input: an answer of the documented shape, or
the module's documented error, never another exception and never a hang. Each crash the fuzzer
found is pinned as an explicit `@example` (or a plain test) next to the property that found it.

Time bound: the profile "kvtrace-ci" (loaded by default) runs a fixed, derandomized set of
examples per property with a per-example deadline, no example database, so the file takes a few
seconds on 2 cores and CI is reproducible. To hunt for new crashes locally:

    KVTRACE_FUZZ_PROFILE=kvtrace-explore .venv/bin/python -m pytest tests/unit/test_fuzz.py

("kvtrace-explore": random, 20x the examples, no deadline). A failure prints the falsifying input
to add as an `@example`.
"""
from __future__ import annotations

import ctypes
import io
import os
import re
import shutil
import struct
import subprocess
import tempfile
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from elftools.elf.elffile import ELFFile
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fake_agent import FakeAgent, event
from kvtrace._proto.kvtrace.v1 import agent_service_pb2 as service_pb2
from kvtrace.model.events import Api, Event, Kind, Layer, Memory, ObjectKind, StackStatus
from kvtrace.model.processes import container_id
from kvtrace.model.stacks import UNKNOWN_FRAME, Frame
from kvtrace.servers.api.requests import (
    InvalidArgument,
    ServerLimits,
    stream_filter,
)
from kvtrace.servers.api.servicer import AgentServicer
from kvtrace.servers.hub import EventFilter, EventHub, Subscription
from kvtrace.sources import elf, procfs
from kvtrace.sources.bpf import abi, usdt
from kvtrace.sources.bpf.decode import Clock, UndecodableRecord, decode_event, decode_ledger_entry
from kvtrace.sources.procfs import MemoryReadError, ProcessMemory
from kvtrace.sources.python import runtime, symbolize
from kvtrace.sources.python.offsets import FREE_THREADED_OFFSETS, OFFSETS

settings.register_profile(
    "kvtrace-ci", max_examples=150, deadline=timedelta(milliseconds=500), derandomize=True,
    database=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(
    "kvtrace-explore", max_examples=3000, deadline=None, derandomize=False,
    suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("KVTRACE_FUZZ_PROFILE", "kvtrace-ci"))
# Properties whose examples each write and parse a file: fewer of them in CI.
SLOW = settings(max_examples=max(1, settings.default.max_examples // 3))

U8, U16, U32 = st.integers(0, 0xFF), st.integers(0, 0xFFFF), st.integers(0, 0xFFFFFFFF)
U64 = st.integers(0, (1 << 64) - 1)
I32 = st.integers(-(1 << 31), (1 << 31) - 1)


# ---- ring records ---------------------------------------------------------------------------

CLOCK = Clock()


def _record(timestamp_ns=0, address=0, size_bytes=0, caller_address=0, aux=0, stack_id=0, pid=1, tid=1,
            device=0, error_code=0, api=int(Api.cudaMalloc), kind=int(Kind.ALLOC), layer=int(Layer.RUNTIME),
            object_kind=int(ObjectKind.ALLOCATION), memory=int(Memory.DEVICE), stack_status=0,
            comm=b"python") -> bytes:
    return abi.EVENT_STRUCT.pack(timestamp_ns, address, size_bytes, caller_address, aux, stack_id, pid, tid,
                                 device, error_code, api, kind, layer, object_kind, memory, stack_status, 0, comm)


@given(st.binary(max_size=3 * abi.EVENT_STRUCT.size))
@example(b"")  # shorter than a record
@example(_record(kind=0))  # the probes never emit kind 0: decoded once as an Event whose kind is None
@example(_record(api=0))  # nor api 0: decoded once as an Event whose api is None
@example(_record(kind=200))  # a kind of a newer probe build
@example(_record(comm=b"\xff\xfe\x00garbage"))  # comm is not UTF-8
def test_any_record_decodes_or_is_undecodable(record: bytes) -> None:
    """A record is an Event with a Kind and an Api, or UndecodableRecord (a ValueError: what the BPF
    source counts as kvtrace_events_undecodable_total)."""
    try:
        event, stack_id = decode_event(record, CLOCK)
    except UndecodableRecord:
        return
    assert isinstance(event.kind, Kind) and isinstance(event.api, Api)
    assert event.layer is None or isinstance(event.layer, Layer)
    assert isinstance(event.stack_status, StackStatus)
    assert isinstance(event.comm, str) and isinstance(stack_id, int)


@given(timestamp_ns=U64, address=U64, size_bytes=U64, aux=U64, pid=U32, device=I32,
       kind=st.sampled_from(list(Kind)), api=st.sampled_from(list(Api)), layer=st.sampled_from([0, *Layer]),
       memory=st.sampled_from([0, *Memory]), stack_status=U8, comm=st.binary(max_size=16))
def test_well_formed_records_keep_their_fields(timestamp_ns, address, size_bytes, aux, pid, device, kind, api,
                                                layer, memory, stack_status, comm) -> None:
    record = _record(timestamp_ns=timestamp_ns, address=address, size_bytes=size_bytes, aux=aux, pid=pid,
                     device=device, kind=kind, api=api, layer=layer, memory=memory, stack_status=stack_status,
                     comm=comm)
    event, _ = decode_event(record + b"\0" * 4, CLOCK)  # the ring pads records to 8 bytes
    assert (event.kind, event.api, event.pid, event.address, event.size_bytes, event.device) == \
        (kind, api, pid, address, size_bytes, device)
    assert event.layer == (Layer(layer) if layer else None)
    assert event.comm == comm.split(b"\0", 1)[0].decode("utf-8", "replace")


@given(st.binary(min_size=ctypes.sizeof(abi.RawLedgerKey), max_size=ctypes.sizeof(abi.RawLedgerKey)),
       st.binary(min_size=ctypes.sizeof(abi.RawLedgerValue), max_size=ctypes.sizeof(abi.RawLedgerValue)))
def test_any_ledger_entry_decodes_or_raises_value_error(key_bytes: bytes, value_bytes: bytes) -> None:
    """The resync leaves out (and logs) an entry that raises ValueError; nothing else may escape."""
    key = abi.RawLedgerKey.from_buffer_copy(key_bytes)
    value = abi.RawLedgerValue.from_buffer_copy(value_bytes)
    try:
        entry = decode_ledger_entry(key, value, CLOCK)
    except ValueError:
        return
    assert entry.key.pid == key.pid and entry.size_bytes == value.size_bytes


# ---- API requests -> filters ----------------------------------------------------------------

_ENUM_NUMBERS = st.integers(-(1 << 31), (1 << 31) - 1)


@given(pids=st.lists(U32, max_size=1100), title_regex=st.text(max_size=1100) | st.sampled_from(
    ["(", "a{99999999999999999999}", "(?P<x", "[z-a]", "\\", "(?<=a+)b", "x" * 1025]),
    kinds=st.lists(_ENUM_NUMBERS | st.sampled_from(list(Kind)), max_size=5),
    layers=st.lists(_ENUM_NUMBERS | st.sampled_from(list(Layer)), max_size=5), min_size_bytes=U64,
    title=st.text(max_size=40), event_kind=st.sampled_from(list(Kind)), layer=st.none() | st.sampled_from(list(Layer)),
    pid=U32, size_bytes=U64)
def test_stream_request_gives_a_filter_or_invalid_argument(pids, title_regex, kinds, layers, min_size_bytes,
                                                           title, event_kind, layer, pid, size_bytes) -> None:
    request = service_pb2.StreamEventsRequest(pids=pids, title_regex=title_regex, kinds=kinds, layers=layers,
                                              min_size_bytes=min_size_bytes)
    try:
        event_filter = stream_filter(request)
    except InvalidArgument:
        return
    assert isinstance(event_filter, EventFilter)
    # The filter then judges events on the publishing thread: a bool, whatever the event.
    subscription = Subscription(event_filter, max_queued_events=10)
    event = Event(kind=event_kind, api=Api.cudaMalloc, pid=pid, tid=pid, timestamp_ns=0, layer=layer,
                  size_bytes=size_bytes, title=title)
    assert subscription.wants(event) in (True, False)


class _Aborted(Exception):
    pass


class _Context:
    """The part of grpc.ServicerContext the unary handlers use: abort() ends the call."""

    def __init__(self) -> None:
        self.code = None

    def abort(self, code, details) -> None:
        self.code = code
        raise _Aborted(details)


@pytest.fixture(scope="module")
def servicer():
    agent = FakeAgent()
    agent.apply(*(event(address=0x7F0000000000 + index * 0x100000, pid=pid)
                  for index, pid in enumerate((100, 200, 200, 300))))
    return AgentServicer(agent.session, agent.analyzer, EventHub(), ServerLimits())


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(pids=st.lists(U32, max_size=1100), layers=st.lists(_ENUM_NUMBERS, max_size=3), page_size=I32,
       page_token=st.text(max_size=40) | st.builds(lambda n: f"{n:016x}.{n % 7}", st.integers(0, (1 << 64) - 1)),
       min_age_seconds=st.none() | st.floats(allow_nan=True, allow_infinity=True), limit=I32)
def test_unary_requests_answer_or_abort_invalid_argument(servicer, pids, layers, page_size, page_token,
                                                         min_age_seconds, limit) -> None:
    import grpc

    calls = [
        (servicer.GetSnapshot, service_pb2.GetSnapshotRequest(pids=pids, layers=layers, page_size=page_size,
                                                              page_token=page_token)),
        (servicer.ListLeakSuspects, service_pb2.ListLeakSuspectsRequest(pids=pids, min_age_seconds=min_age_seconds,
                                                                        limit=limit)),
        (servicer.GetGrowth, service_pb2.GetGrowthRequest(pids=pids)),
    ]
    for method, request in calls:
        context = _Context()
        try:
            method(request, context)
        except _Aborted:
            assert context.code is grpc.StatusCode.INVALID_ARGUMENT


# ---- /proc ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def proc_root() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="kvt-fuzz-proc"))
    (directory / "42").mkdir()
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


_HEX = st.integers(0, 1 << 70).map(lambda value: f"{value:x}") | st.sampled_from(["-1", "0x10", "", "zz", "1_0"])
_MAPS_LINE = st.builds(
    lambda start, end, perms, offset, major, minor, inode, path: f"{start}-{end} {perms} {offset} {major}:{minor} "
                                                                  f"{inode} {path}",
    _HEX, _HEX, st.sampled_from(["r-xp", "rw-p", "---s", "x"]), _HEX, _HEX, _HEX,
    st.integers(-5, 1 << 70).map(str), st.text(max_size=20) | st.just("/lib/x.so (deleted)"))


@given(st.binary(max_size=400) | st.lists(_MAPS_LINE, max_size=6).map(lambda lines: "\n".join(lines).encode()))
@example(b"7f00-7f01 r-xp 0 fffffffffff:0 1 /x")  # a device major beyond 32 bits
@example(b"7f00-7f01 r-xp 0 -1:0 1 /x")  # a negative device number
@example(b"7f00-7f01 r-xp 0 8:1 1 /lib/\xff\xfe.so")  # a path that is not UTF-8
def test_any_maps_text_gives_mappings(proc_root: Path, text: bytes) -> None:
    (proc_root / "42" / "maps").write_bytes(text)
    for mapping in procfs.read_maps(42, proc_root):
        assert isinstance(mapping, procfs.Mapping)
        assert all(isinstance(value, int) for value in (mapping.start, mapping.end, mapping.file_offset,
                                                        mapping.device, mapping.inode))


@given(st.binary(max_size=300) | st.lists(st.tuples(st.sampled_from(["CapEff", "Seccomp", "Name", "x"]),
                                                    st.binary(max_size=30)), max_size=5).map(
    lambda fields: b"\n".join(name.encode() + b":\t" + value for name, value in fields)),
       st.sampled_from(["CapEff", "Seccomp", "Name", "(", "a.b"]))
@example(b"Name:\t\xff\xfe\nCapEff:\t000001ffffffffff\n", "CapEff")  # a comm that is not UTF-8
def test_any_status_text_gives_a_field_or_none(proc_root: Path, text: bytes, field: str) -> None:
    (proc_root / "42" / "status").write_bytes(text)
    value = procfs.status_field(42, field, proc_root)
    assert value is None or (isinstance(value, str) and value and not value.isspace())


def test_status_of_another_process_with_a_binary_comm_is_read(proc_root: Path) -> None:
    """Regression: status_field decoded /proc/PID/status as strict UTF-8, and a process named with
    arbitrary bytes (prctl(PR_SET_NAME)) made it raise UnicodeDecodeError."""
    (proc_root / "42" / "status").write_bytes(b"Name:\t\xff\xfe\nSeccomp:\t2\n")
    assert procfs.status_field(42, "Seccomp", proc_root) == "2"


@given(st.text(max_size=300) | st.lists(st.tuples(st.integers(0, 20).map(str), st.text(max_size=10),
                                                  st.text(alphabet="0123456789abcdef/-.:", max_size=90)),
                                        max_size=4).map(lambda lines: "\n".join(":".join(line) for line in lines)))
@example("0::/system.slice/docker-" + "a" * 64 + ".scope")
def test_any_cgroup_text_gives_an_id_or_nothing(text: str) -> None:
    found = container_id(text)
    assert found == "" or re.fullmatch(r"[0-9a-f]{64}", found)


# ---- ELF and USDT notes -----------------------------------------------------------------------

def _elf_answers(path: Path) -> None:
    """Every ELF entry point on one file: the documented answer, or READ_ERRORS."""
    assert isinstance(elf.find_symbols(path, ["main", "_start", "counter"]), dict)
    assert isinstance(elf.find_symbols(path, ["main"], types=elf.FUNCTION_TYPES, triggers=["main"]), dict)
    assert isinstance(elf.symbol_file_offsets(path, ["main", "counter"], (elf.STT_FUNC, elf.STT_OBJECT)), dict)
    for reader in (elf.first_load_vaddr, elf.entry_point_file_offset):
        try:
            reader(path)
        except elf.READ_ERRORS:
            pass
    try:
        with open(path, "rb") as file:
            table = elf.load_symbol_table(file)
        table.lookup(0x1000)
        table.virtual_address(0x1000)
    except elf.READ_ERRORS:
        pass
    try:
        probes = usdt.read_usdt_probes(path)
    except elf.READ_ERRORS:
        return
    assert all(isinstance(probe, usdt.UsdtProbe) for probe in probes)


SDT_PROGRAM = r"""
#define _SDT_HAS_SEMAPHORES 1
#include "sdt.h"
unsigned short prov_probe_semaphore __attribute__((section(".probes"))) = 0;
unsigned short prov_other_semaphore __attribute__((section(".probes"))) = 0;
long counter;
int main(int argc, char **argv) {
    long x = argc; char c = (char)argc;
    if (prov_probe_semaphore) DTRACE_PROBE3(prov, probe, x, c, counter);
    DTRACE_PROBE1(prov, other, argv);
    return 0;
}
"""


@pytest.fixture(scope="module")
def sample_elf() -> Iterator[bytes]:
    """A 16 KiB executable with symbols and two SDT notes (gcc and the vendored sdt.h); /bin/true
    (no notes) without gcc."""
    stubs = Path(__file__).resolve().parents[2] / "agent" / "kvtrace" / "sources" / "torch_hook"  # the vendored sdt.h
    gcc = shutil.which("gcc")
    if gcc is None:
        yield Path("/bin/true").read_bytes()
        return
    with tempfile.TemporaryDirectory(prefix="kvt-fuzz-elf") as directory:
        (Path(directory) / "sdt-config.h").write_text("#define _SDT_ASM_SECTION_AUTOGROUP_SUPPORT 1\n")
        (Path(directory) / "p.c").write_text(SDT_PROGRAM)
        subprocess.run([gcc, "-O1", "-o", f"{directory}/p", f"{directory}/p.c", f"-I{directory}", f"-I{stubs}"],
                       check=True, capture_output=True, timeout=60)
        assert [probe.name for probe in usdt.read_usdt_probes(f"{directory}/p")] == ["probe", "other"]
        data = (Path(directory) / "p").read_bytes()
    yield data


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="kvt-fuzz-file") as directory:
        yield Path(directory) / "file"


@SLOW
@given(st.binary(max_size=600) | st.just(b"\x7fELF") | st.binary(max_size=200).map(
    lambda tail: b"\x7fELF\x02\x01\x01" + b"\0" * 9 + tail))
def test_any_bytes_as_elf(scratch: Path, data: bytes) -> None:
    scratch.write_bytes(data)
    _elf_answers(scratch)


# Mutations of the sample: (offset, new bytes). Most offsets land in the headers and notes, where
# a flipped byte changes how the rest is read.
_MUTATIONS = st.lists(st.tuples(st.integers(0, 1 << 14) | st.integers(0, 128), st.binary(min_size=1, max_size=8)),
                      min_size=1, max_size=6)


@SLOW
@given(_MUTATIONS, st.none() | st.integers(0, 1 << 14))
def test_mutated_elf(sample_elf: bytes, scratch: Path, mutations, truncate_at) -> None:
    data = bytearray(sample_elf)
    for offset, replacement in mutations:
        offset %= len(data)
        data[offset:offset + len(replacement)] = replacement
    scratch.write_bytes(bytes(data[:truncate_at]))
    _elf_answers(scratch)


def _with_section_size(data: bytes, name: str, size_bytes: int) -> bytes:
    """`data` with the sh_size of section `name` set (Elf64_Shdr.sh_size is at +32)."""
    elf_file = ELFFile(io.BytesIO(data))
    index = next(i for i, section in enumerate(elf_file.iter_sections()) if section.name == name)
    patched = bytearray(data)
    struct.pack_into("<Q", patched, elf_file["e_shoff"] + index * elf_file["e_shentsize"] + 32, size_bytes)
    return bytes(patched)


@pytest.mark.parametrize("section", [".strtab", ".symtab", ".note.stapsdt", ".shstrtab"])
def test_a_section_claiming_exabytes_is_unreadable(sample_elf: bytes, scratch: Path, section: str) -> None:
    """Regression (found by test_mutated_elf): a string table whose sh_size said 2**62 bytes made
    pyelftools read() that much at once: find_symbols raised MemoryError, outside READ_ERRORS, in
    discovery's scan of every mapped file. Reads are now bounded by the file's size."""
    scratch.write_bytes(_with_section_size(sample_elf, section, 1 << 62))
    _elf_answers(scratch)


@given(st.text(max_size=60) | st.builds(
    lambda size, location: f"{size}@{location}", st.integers(-20, 20),
    st.text(alphabet="%$()+-,0123456789abcdefghlprsx", max_size=24)))
@example("8@$99999999999999999999999999")
@example("-8@0x7fffffffffffffffff(%rax,%rbx,8)")
def test_any_operand_parses_or_is_refused(text: str) -> None:
    try:
        arguments = usdt.parse_arguments(text)
    except ValueError:
        return
    assert all(argument.size_bytes in (1, 2, 4, 8) for argument in arguments)


@given(st.binary(max_size=80), st.sampled_from([4, 8]), st.booleans())
def test_any_note_descriptor_decodes_or_is_malformed(descriptor: bytes, address_size: int,
                                                     little_endian: bool) -> None:
    try:
        decoded = usdt._decode_descriptor(descriptor, address_size, little_endian)
    except ValueError:
        return
    assert decoded[3] and decoded[4]


# ---- Python frames ---------------------------------------------------------------------------

VERSIONS = sorted(OFFSETS)
# Every build's offsets (default and free-threaded): what the readers are given.
BUILDS = [*OFFSETS.values(), *FREE_THREADED_OFFSETS.values()]


@given(st.sampled_from(VERSIONS), st.binary(max_size=300), I32, st.integers(-10, 1 << 20))
@example((3, 12), b"\xf0", 1, 0)  # a no-location entry
@example((3, 11), b"\xe8", 1, 0)  # a long entry cut before its varint
def test_any_line_table_gives_a_line(version, linetable: bytes, firstlineno: int, byte_offset: int) -> None:
    line = symbolize.line_for_offset(version, linetable, firstlineno, byte_offset)
    assert isinstance(line, int)


BASE = 0x10000  # where the fake process memory starts
MEMORY_BYTES = 0x400


class _Memory:
    """ProcessMemory's reads over one buffer at BASE; MemoryReadError outside it."""

    pid = 42

    def __init__(self, data: bytes) -> None:
        self.data = data

    def read(self, address: int, size: int) -> bytes:
        if not BASE <= address <= address + size <= BASE + len(self.data) or size < 0:
            raise MemoryReadError(f"{address:#x}+{size} unmapped")
        return self.data[address - BASE:address - BASE + size]

    def read_u64(self, address: int) -> int:
        return int.from_bytes(self.read(address, 8), "little")

    def read_i64(self, address: int) -> int:
        return int.from_bytes(self.read(address, 8), "little", signed=True)

    def read_cstring(self, address: int, limit: int = 64) -> str:
        return self.read(address, limit).split(b"\0", 1)[0].decode("ascii", "replace")


def _unicode_object(offsets, length: int, state: int, payload: bytes) -> bytes:
    header = bytearray(offsets.sizeof_ascii_object + 32)
    struct.pack_into("<q", header, offsets.object_type + symbolize.UNICODE_LENGTH_AFTER_TYPE, length)
    struct.pack_into("<I", header, offsets.object_type + symbolize.UNICODE_STATE_AFTER_TYPE, state)
    return bytes(header[:offsets.sizeof_ascii_object]) + payload


_KIND_STATES = st.builds(lambda kind, compact, ascii_, ready: kind << 2 | compact << 5 | ascii_ << 6 | ready << 7,
                         st.integers(0, 7), st.integers(0, 1), st.integers(0, 1), st.integers(0, 1))


@given(st.sampled_from(BUILDS), st.integers(0, 300), _KIND_STATES | _KIND_STATES.map(lambda state: state << 6),
       st.binary(max_size=600) | st.binary(max_size=MEMORY_BYTES))
@example(OFFSETS[(3, 12)], 2, 1 << 2 | 1 << 5 | 1 << 6, b"\xff\xfe")  # "ASCII" flagged, bytes are not ASCII
@example(OFFSETS[(3, 12)], 1, 4 << 2 | 1 << 5, b"\xff\xff\xff\xff")  # a 4-byte code point beyond U+10FFFF
def test_any_str_object_decodes_or_is_unreadable(offsets, length: int, state: int, payload: bytes) -> None:
    memory = _Memory(_unicode_object(offsets, length, state, payload))
    try:
        text = symbolize.read_unicode(memory, BASE, offsets)  # type: ignore[arg-type]
    except MemoryReadError:
        return
    assert isinstance(text, str) and len(text) == length


@given(st.binary(min_size=8, max_size=MEMORY_BYTES), st.integers(0, 1 << 22))
def test_any_bytes_object_reads_or_is_unreadable(data: bytes, max_bytes: int) -> None:
    try:
        contents = symbolize.read_bytes_object(_Memory(data), BASE, max_bytes,  # type: ignore[arg-type]
                                               OFFSETS[(3, 12)])
    except MemoryReadError:
        return
    assert len(contents) <= max_bytes


@pytest.fixture(scope="module")
def fake_process() -> Iterator[tuple[Path, Path]]:
    """A proc tree whose pid 42 has a regular file as `mem`: ProcessMemory preads it as it would
    the process's memory."""
    with tempfile.TemporaryDirectory(prefix="kvt-fuzz-mem") as directory:
        (Path(directory) / "42").mkdir()
        yield Path(directory), Path(directory) / "42" / "mem"


@given(st.sampled_from(BUILDS), st.binary(min_size=0, max_size=MEMORY_BYTES),
       st.lists(st.integers(0, MEMORY_BYTES // 8 - 1), max_size=6),
       st.lists(st.tuples(st.integers(0, MEMORY_BYTES) | U64, st.integers(0, MEMORY_BYTES) | U64), max_size=5),
       st.sampled_from([0, BASE]))
def test_any_process_memory_symbolizes_to_frames(fake_process, offsets, data: bytes, pointer_slots,
                                                 frames, code_type: int) -> None:
    proc, mem_file = fake_process
    memory = bytearray(data.ljust(MEMORY_BYTES, b"\0"))
    for slot in pointer_slots:  # pointers back into the buffer, so that reads chain into it
        struct.pack_into("<Q", memory, slot * 8, BASE + (slot * 40) % MEMORY_BYTES)
    with open(mem_file, "wb") as file:
        file.seek(BASE)
        file.write(memory)
    symbolizer = symbolize.Symbolizer(proc)
    raw = [(BASE + code if code < MEMORY_BYTES else code, BASE + instr if instr < MEMORY_BYTES else instr)
           for code, instr in frames]
    try:
        result = symbolizer.symbolize(42, offsets.version, offsets, raw, code_type)
        result += symbolizer.symbolize(42, offsets.version, offsets, raw, code_type)  # the cached path
    finally:
        symbolizer.close()
    assert len(result) == 2 * len(raw)
    assert all(frame is UNKNOWN_FRAME or isinstance(frame, Frame) for frame in result)


@given(st.sampled_from(BUILDS), st.binary(min_size=0, max_size=MEMORY_BYTES), st.integers(0, MEMORY_BYTES) | U64)
def test_any_type_object_gives_members_or_unreadable(offsets, data: bytes, type_offset: int) -> None:
    address = BASE + type_offset if type_offset < MEMORY_BYTES else type_offset
    try:
        members = runtime._members(_Memory(data), address, offsets)  # type: ignore[arg-type]
    except MemoryReadError:
        return
    assert all(isinstance(name, str) and isinstance(offset, int) for name, offset in members.items())


@given(st.sampled_from([offsets for offsets in BUILDS if offsets.version >= (3, 13)]),
       st.binary(max_size=MEMORY_BYTES) | st.binary(max_size=1040).map(lambda words: b"xdebugpy" + words))
def test_any_debug_offsets_check_or_unreadable(offsets, data: bytes) -> None:
    try:
        words = runtime._debug_offsets(_Memory(data), BASE)  # type: ignore[arg-type]
    except MemoryReadError:
        return
    problem = runtime._check_debug_offsets(words, offsets) if words is not None else "no cookie"
    assert problem is None or isinstance(problem, str)


def test_process_memory_refuses_absurd_reads(fake_process) -> None:
    proc, mem_file = fake_process
    mem_file.write_bytes(b"\0" * 16)
    with ProcessMemory(42, proc) as memory:
        for address, size in ((0, 8), (procfs.USER_ADDRESS_LIMIT, 8), (8, -1), (BASE, 1 << 60)):
            with pytest.raises(MemoryReadError):
                memory.read(address, size)
