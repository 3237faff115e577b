"""Stack symbolization against live interpreters: CPython 3.10–3.15 targets, 3.14 and 3.15 also
free-threaded (tests/interpreters.py), record their own
frames, the test reads them back through /proc/PID/mem and must get exactly the same (function,
file, line). Line tables are checked instruction by instruction against co_positions / co_lines,
the native symbolizer against libc's own symbols."""
from __future__ import annotations

import ctypes
import ctypes.util
import dis
import inspect
import json
import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest

from interpreters import LABELS, interpreter, offsets_of, version_of
from kvtrace.model.stacks import UNKNOWN_FRAME, Frame, NativeFrame, Stack, StackTable
from kvtrace.sources.native import NativeSymbolizer
from kvtrace.sources.procfs import MemoryReadError, ProcessMemory
from kvtrace.sources.python import symbolize
from kvtrace.sources.python.offsets import (
    FRAME_OWNED_BY_SHIM_FROM,
    GLIBC_SPECIFIC_1STBLOCK,
    GLIBC_SPECIFIC_ENTRY_SIZE,
    OFFSETS,
    STACK_REF_TAG_BITS,
)
from kvtrace.sources.python.symbolize import Symbolizer, UnsupportedPythonError, line_for_offset, read_unicode
from kvtrace.wire import frame_to_json

TARGET_VERSIONS = sorted({version_of(label) for label in LABELS})
CHILD_TIMEOUT_SECONDS = 60

# The probe-like target. It walks its own thread's frames from the thread state exactly as the BPF
# side does (offsets from argv), and also from sys._getframe with the expected (function, file,
# line) of each frame. Frames live on: it records several stacks, prints them as one JSON line and
# waits on stdin, so their code objects are still there when the test reads them.
TARGET_SCRIPT = r'''
import ctypes, json, sys, threading

O = json.loads(sys.argv[1])
IS_3_10 = sys.version_info[:2] == (3, 10)
FREE_THREADED = O["code_tlbc"] >= 0
U64 = ctypes.c_uint64.from_address
I32 = ctypes.c_int32.from_address
U8 = ctypes.c_uint8.from_address
ctypes.pythonapi.PyThreadState_Get.restype = ctypes.c_void_p
LIBC = ctypes.CDLL(None)
LIBC.pthread_getspecific.restype = ctypes.c_void_p
LIBC.pthread_self.restype = ctypes.c_void_p
STACKS = []


def probe_walk():
    """(code, instruction) from the thread state down, as the probe reads them, from record()'s
    caller on."""
    frame = U64(ctypes.pythonapi.PyThreadState_Get() + O["tstate_frame"]).value
    if O["cframe_frame"] >= 0:
        frame = U64(frame + O["cframe_frame"]).value
    walked = []
    while frame:
        # 3.14+: the code object is a tagged reference; owners from 3 up are entry shims
        code = U64(frame + O["frame_code"]).value & ~O["tag_bits"]
        if O["frame_owner"] < 0 or U8(frame + O["frame_owner"]).value < O["shim_from"] and code:
            read_instr = I32 if IS_3_10 else U64
            walked.append([code, read_instr(frame + O["frame_instr"]).value])
        frame = U64(frame + O["frame_previous"]).value
    return walked[2:]  # less probe_walk() and record()


def in_copy(code, instr):
    """Free-threaded builds: an instruction pointer is into its thread's copy of the bytecode
    (co_tlbc); as an offset into whichever copy holds it, to compare with f_lasti."""
    size = U64(code + O["object_size"]).value * 2
    copies = U64(code + O["code_tlbc"]).value
    for index in range(U64(copies).value):
        base = U64(copies + 8 + 8 * index).value
        if base and base <= instr < base + size:
            return instr - base
    return None


def record():
    walked = probe_walk()
    expected, raw = [], []
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        # The C field f_lasti counts 2-byte code units on 3.10; frame.f_lasti is in bytes on all.
        instr = frame.f_lasti // 2 if IS_3_10 else id(code) + O["code_bytecode"] + frame.f_lasti
        raw.append([id(code), frame.f_lasti if FREE_THREADED else instr])
        expected.append([getattr(code, "co_qualname", code.co_name), code.co_filename,
                         frame.f_lineno])
        frame = frame.f_back
    offsets = [[code, in_copy(code, instr)] for code, instr in walked] if FREE_THREADED else walked
    # frames whose instruction is in another copy than co_code_adaptive (a thread's own, co_tlbc)
    elsewhere = sum(offset != instr - code - O["code_bytecode"]
                    for (code, instr), (_, offset) in zip(walked, offsets)) if FREE_THREADED else 0
    STACKS.append({"walked": walked, "walked_offsets": offsets, "raw": raw, "expected": expected,
                   "in_thread_copies": elsewhere})


def thread_state_checks():
    """The path the probe takes to this thread's state: the TSS key, or (3.15+) the interpreter's list."""
    tstate = ctypes.pythonapi.PyThreadState_Get()
    runtime = ctypes.addressof(ctypes.c_char.in_dll(ctypes.pythonapi, "_PyRuntime"))
    if O["runtime_tss"] < 0:
        listed = U64(U64(runtime + O["runtime_interpreters_head"]).value + O["interp_threads_head"])
        found = []
        while listed.value:
            state = listed.value
            if U64(state + O["tstate_thread_id"]).value == LIBC.pthread_self():
                found.append(state)
            listed = U64(state + O["tstate_next"])
        return {"list": found == [tstate]}
    key = ctypes.c_uint32.from_address(runtime + O["runtime_tss"] + 4).value
    specific = U64(LIBC.pthread_self() + O["glibc_specific"] + key * O["glibc_entry"] + 8).value
    return {"tss": LIBC.pthread_getspecific(key) == tstate, "glibc": specific == tstate}


def größe(depth):
    if depth:
        return größe(depth - 1)
    record()
    record()  # a second stack from another line of the same function


def 分配():
    größe(2)


def 𠀋():
    分配()


class Cls:
    def method(self):
        𠀋()


def gen():
    Cls().method()
    yield 1


def outer():
    def inner():
        return sorted([1], key=lambda item: next(gen()) + item)
    return inner()


exec(compile("def generated():\n    outer()\n", "/virtual/模块_𠀋.py", "exec"))
generated()
worker = threading.Thread(target=outer)
worker.start()
worker.join()


class S(str):
    pass


# Code point lists, not strings: JSON would pair up the lone surrogates.
STRINGS = ["plain", "größe", "分配", "a𠀋", "", S("abc"), S("a分𠀋"), "\ud800x", "\ud83d\ude00"]
print(json.dumps({"stacks": STACKS, "checks": thread_state_checks(),
                  "strings": [[id(s), [ord(c) for c in s]] for s in STRINGS]}), flush=True)
sys.stdin.readline()
'''

# Prints, for every code object of a sample module and of a few stdlib modules, the line table
# and the line CPython gives each instruction: co_positions (one per code unit) on 3.11+,
# co_lines ranges on 3.10. Exec'd in-process too.
LINE_TABLE_SCRIPT = r'''
import json, sys

LONG_LINE = "x = " + " + ".join(["value"] * 150)  # > 254 bytes of bytecode on one line
SAMPLE = """
import contextlib

@contextlib.contextmanager
def decorated(a,
              b):
    try:
        yield a
    except (ValueError,
            KeyError) as error:
        print(error)
    finally:
        b.close()

def gap(value):
    first = value
""" + "\n" * 300 + """    second = (first +
              value)
""" + "\n" * 40 + """    return [item
            for item in range(second)
            if item % 3]

def wide(value):
    """ + LONG_LINE + """
    for index in range(3):
        while value:
            value -= 1
    return lambda y: (y,
                      x)

class Klass:
    attr = {k: v for k, v in zip("ab", range(2))}

    async def coroutine(self):
        async with self as context:
            return await context

def big(a):
""" + "".join(f"    a = a + {i} if a else a - {i}\n" for i in range(120)) + """    return a
"""


def code_objects(code):
    yield code
    for const in code.co_consts:
        if hasattr(const, "co_code"):
            yield from code_objects(const)


def expected_lines(code):
    lines = [0] * (len(code.co_code) // 2)
    if sys.version_info >= (3, 11):
        for unit, position in enumerate(code.co_positions()):
            lines[unit] = position[0] or 0
    else:
        for start, end, line in code.co_lines():
            for unit in range(start // 2, end // 2):
                lines[unit] = line or 0
    return lines


def collect():
    import dis, inspect, json as json_module
    roots = [compile(SAMPLE, "sample.py", "exec")]
    for module in (dis, inspect, json_module.decoder):
        roots.append(compile(open(module.__file__).read(), module.__file__, "exec"))
    tables = []
    for root in roots:
        for code in code_objects(root):
            tables.append({"name": code.co_name, "firstlineno": code.co_firstlineno,
                           "linetable": code.co_linetable.hex(),
                           "lines": expected_lines(code)})
    return tables


if __name__ == "__main__":
    print(json.dumps(collect()))
'''


def require_readable_memory(pid: int, address: int) -> None:
    try:
        with ProcessMemory(pid) as mem:
            mem.read(address, 8)
    except MemoryReadError as error:
        pytest.skip(f"cannot read /proc/{pid}/mem ({error}); needs root or ptrace access")


def offsets_argument(offsets) -> str:
    fields = ("tstate_frame", "cframe_frame", "frame_code", "frame_previous", "frame_instr",
              "frame_owner", "code_bytecode", "runtime_tss", "code_tlbc", "object_size",
              "runtime_interpreters_head", "interp_threads_head", "tstate_next", "tstate_thread_id")
    values = {name: getattr(offsets, name) for name in fields}
    values["tag_bits"], values["shim_from"] = STACK_REF_TAG_BITS, FRAME_OWNED_BY_SHIM_FROM
    values["glibc_specific"] = GLIBC_SPECIFIC_1STBLOCK
    values["glibc_entry"] = GLIBC_SPECIFIC_ENTRY_SIZE
    return json.dumps(values)


@pytest.fixture(params=LABELS)
def label(request) -> str:
    return request.param


@pytest.fixture
def version(label) -> tuple[int, int]:
    return version_of(label)


@pytest.fixture
def offsets(label):
    return offsets_of(label)


@pytest.fixture
def target(label, offsets, tmp_path):
    """A live target (see TARGET_SCRIPT) in a directory with a non-ASCII name: (process, its
    report)."""
    python = interpreter(label)
    script = tmp_path / "träger_分配" / "target.py"
    script.parent.mkdir()
    script.write_text(TARGET_SCRIPT, encoding="utf-8")
    process = subprocess.Popen([str(python), "-I", str(script), offsets_argument(offsets)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        if not line:
            pytest.fail(f"target failed: {process.communicate(timeout=CHILD_TIMEOUT_SECONDS)[1]}")
        report = json.loads(line)
        require_readable_memory(process.pid, report["strings"][0][0])
        yield process, report
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=CHILD_TIMEOUT_SECONDS)


def test_probe_walk_matches_the_interpreter(target, label, version):
    """The offsets table walks the same frames, with the same instruction values, as
    sys._getframe shows; the TSS key leads to this thread's state. (Checks pyoffsets.py.)"""
    _, report = target
    assert report["checks"] == ({"list": True} if version >= (3, 15) else {"tss": True, "glibc": True})
    for stack in report["stacks"]:
        assert stack["walked_offsets"] == stack["raw"]
    in_copies = [stack["in_thread_copies"] for stack in report["stacks"]]
    print(f"frames in a thread's own copy of the bytecode, per stack: {in_copies}")
    if label.endswith("t"):  # the worker thread runs its own copies: the walk must find them
        assert in_copies[2] > 0 and in_copies[3] > 0, in_copies
    else:
        assert in_copies == [0] * 4


def test_symbolized_stacks_equal_the_targets_own(target, version, offsets):
    process, report = target
    symbolizer = Symbolizer()
    stacks = report["stacks"]
    # main thread: two records from größe, then the worker thread's two
    assert len(stacks) == 4
    for stack in stacks:
        frames = symbolizer.symbolize(process.pid, version, offsets,
                                      [tuple(pair) for pair in stack["walked"]])
        assert [[frame.function, frame.file, frame.line] for frame in frames] == stack["expected"]
    functions = [frame[0] for frame in stacks[0]["expected"]]
    method = "method" if version == (3, 10) else "Cls.method"
    inner = "inner" if version == (3, 10) else "outer.<locals>.inner"
    lambda_name = "<lambda>" if version == (3, 10) else "outer.<locals>.inner.<locals>.<lambda>"
    assert functions[:6] == ["größe", "größe", "größe", "分配", "𠀋", method]
    assert {"gen", inner, lambda_name, "generated", "<module>"} <= set(functions)
    assert stacks[0]["expected"][0][2] + 1 == stacks[1]["expected"][0][2]
    assert any(frame[1] == "/virtual/模块_𠀋.py" for frame in stacks[0]["expected"])
    assert "träger_分配" in stacks[0]["expected"][0][1]
    # the later stacks share code objects with the first
    assert symbolizer.hits > 0 and symbolizer.misses > 0
    assert symbolizer.unreadable == 0 and symbolizer.replaced == 0


def test_read_unicode_every_layout(target, offsets):
    """Compact ASCII, latin-1, UCS-2, UCS-4, empty, str subclasses (non-compact), lone and paired
    surrogates."""
    process, report = target
    with ProcessMemory(process.pid) as mem:
        for address, code_points in report["strings"]:
            assert read_unicode(mem, address, offsets) == "".join(map(chr, code_points))


def test_exited_process_gives_unknown_frames(target, version, offsets):
    process, report = target
    symbolizer = Symbolizer()
    raw = [tuple(pair) for pair in report["stacks"][0]["walked"]]
    assert UNKNOWN_FRAME not in symbolizer.symbolize(process.pid, version, offsets, raw)
    process.kill()
    process.wait()
    # Cached, but the fingerprints cannot be checked any more: unknown, not a stale guess.
    assert symbolizer.symbolize(process.pid, version, offsets, raw) == \
        [UNKNOWN_FRAME] * len(raw)
    symbolizer.forget(process.pid)
    assert symbolizer.symbolize(process.pid, version, offsets, raw) == \
        [UNKNOWN_FRAME] * len(raw)


def check_line_tables(version: tuple[int, int], tables: list[dict]) -> None:
    checked_offsets = 0
    for table in tables:
        linetable = bytes.fromhex(table["linetable"])
        decoded = [line_for_offset(version, linetable, table["firstlineno"], unit * 2)
                   for unit in range(len(table["lines"]))]
        assert decoded == table["lines"], table["name"]
        checked_offsets += len(decoded)
    assert checked_offsets > 10_000


def test_line_tables_of_each_version(label, version, tmp_path):
    python = interpreter(label)
    script = tmp_path / "line_tables.py"
    script.write_text(LINE_TABLE_SCRIPT, encoding="utf-8")
    result = subprocess.run([str(python), "-I", str(script)], capture_output=True, text=True,
                            timeout=CHILD_TIMEOUT_SECONDS, check=True)
    check_line_tables(version, json.loads(result.stdout))


@pytest.mark.skipif(sys.version_info[:2] not in TARGET_VERSIONS, reason="unsupported Python")
def test_line_tables_in_process():
    namespace = {"__name__": "line_tables"}
    exec(LINE_TABLE_SCRIPT, namespace)
    check_line_tables(sys.version_info[:2], namespace["collect"]())


@pytest.mark.skipif(sys.version_info < (3, 11), reason="co_positions is 3.11+")
@pytest.mark.parametrize("function", [line_for_offset, Symbolizer.symbolize, inspect.getsource,
                                      dis.dis, symbolize._line_location_table])
def test_line_for_offset_every_instruction(function):
    code = function.__code__
    for unit, position in enumerate(code.co_positions()):
        line = line_for_offset(sys.version_info, code.co_linetable, code.co_firstlineno, unit * 2)
        assert line == (position[0] or 0), unit


def test_line_before_first_instruction_is_firstlineno():
    for version in TARGET_VERSIONS:
        assert line_for_offset(version, b"", 42, -2) == 42
        assert line_for_offset(version, b"", 42, 0) == 0  # empty table: no line


def test_unsupported_versions_are_refused():
    with pytest.raises(UnsupportedPythonError):
        line_for_offset((3, 9), b"", 1, 0)
    with pytest.raises(UnsupportedPythonError):
        line_for_offset((3, 16), b"", 1, 0)
    with pytest.raises(UnsupportedPythonError):
        Symbolizer().symbolize(os.getpid(), (3, 9), OFFSETS[(3, 10)], [])
    with pytest.raises(UnsupportedPythonError):  # offsets of another version
        Symbolizer().symbolize(os.getpid(), (3, 12), OFFSETS[(3, 11)], [])


def own_offsets():
    version = sys.version_info[:2]
    if version not in OFFSETS:
        pytest.skip(f"this interpreter ({version}) is not in the offsets table")
    require_readable_memory(os.getpid(), id(own_offsets))
    return OFFSETS[version]


def own_frame(code) -> tuple[int, int]:
    """The raw pair the probe would record for a frame of `code` stopped at byte offset 0."""
    offsets = OFFSETS[sys.version_info[:2]]
    return (id(code), id(code) + offsets.code_bytecode if offsets.instr_is_pointer else 0)


def test_address_reuse_is_detected():
    """A code object freed and another allocated at its address: the cache must not answer with
    the first one's name."""
    offsets = own_offsets()
    symbolizer = Symbolizer()

    # code.replace() allocates just the new code object, of the template's size: the allocator
    # hands it the block just freed.
    template = compile("def template():\n    return 1\n", "reuse.py", "exec").co_consts[0]

    def renamed(name: str):
        qualname = {"co_qualname": name} if sys.version_info >= (3, 11) else {}
        return template.replace(co_name=name, **qualname)

    first = renamed("first_function")
    address = id(first)
    [frame] = symbolizer.symbolize(os.getpid(), sys.version_info, offsets, [own_frame(first)])
    assert frame.function == "first_function"
    del first
    for attempt in range(100):
        name = f"second_{attempt}"
        second = renamed(name)
        if id(second) == address:
            break
        del second
    else:
        pytest.skip("the allocator did not reuse the code object's address")
    [frame] = symbolizer.symbolize(os.getpid(), sys.version_info, offsets,
                                   [own_frame(second)])  # noqa: F821 (bound when the loop broke)
    assert frame.function == name
    assert symbolizer.replaced == 1


def test_unreadable_code_objects_are_unknown():
    offsets = own_offsets()
    symbolizer = Symbolizer()
    not_a_code_object = "just a string"
    frames = symbolizer.symbolize(os.getpid(), sys.version_info, offsets,
                                  [(8, 0), (1 << 60, 0), own_frame(own_offsets.__code__)])
    assert frames[:2] == [UNKNOWN_FRAME, UNKNOWN_FRAME]
    assert frames[2].function == "own_offsets"
    # With the code type known, an object of another type is refused before it is decoded.
    code_type = id(type(own_offsets.__code__))
    [frame] = symbolizer.symbolize(os.getpid(), sys.version_info, offsets,
                                   [(id(not_a_code_object), 0)], code_type=code_type)
    assert frame == UNKNOWN_FRAME
    assert symbolizer.unreadable == 3
    assert symbolizer.symbolize(os.getpid(), sys.version_info, offsets,
                                [own_frame(own_offsets.__code__)]) == [frames[2]]
    assert symbolizer.hits == 1 and symbolizer.hit_rate == 1 / 5


def test_process_memory_errors():
    require_readable_memory(os.getpid(), id(test_process_memory_errors))
    with ProcessMemory(os.getpid()) as mem:
        value = ctypes.c_uint64(0x1122334455667788)
        assert mem.read_u64(ctypes.addressof(value)) == 0x1122334455667788
        assert mem.read_i32(ctypes.addressof(value)) == 0x55667788
        for address in (0, 8, 1 << 60):
            with pytest.raises(MemoryReadError):
                mem.read(address, 8)
    with pytest.raises(MemoryReadError):
        ProcessMemory(2 ** 22 + 12345)  # above the default pid_max: no such process


def function_address(library: ctypes.CDLL, name: str) -> int:
    return ctypes.cast(getattr(library, name), ctypes.c_void_p).value


def test_native_symbol_of_libc_functions():
    symbolizer = NativeSymbolizer()
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    for name in ("getpid", "qsort", "fopen"):
        address = function_address(libc, name)
        module, symbol, offset = symbolizer.symbolize(os.getpid(), address)
        assert (Path(module).name.startswith("libc"), symbol, offset) == (True, name, 0)
        # a return address inside the function
        assert symbolizer.symbolize(os.getpid(), address + 5) == NativeFrame(module, name, 5)


def test_native_addresses_without_symbols():
    symbolizer = NativeSymbolizer()
    assert symbolizer.symbolize(os.getpid(), 8) == NativeFrame("", "", 8)
    with mmap.mmap(-1, mmap.PAGESIZE) as anonymous:
        address = ctypes.addressof(ctypes.c_char.from_buffer(anonymous)) + 16
        module, symbol, offset = symbolizer.symbolize(os.getpid(), address)
        assert (symbol, offset) == ("", 16)


def test_native_maps_are_reread_for_a_library_loaded_later(tmp_path):
    symbolizer = NativeSymbolizer()
    zlib_name = ctypes.util.find_library("z")
    if zlib_name is None:
        pytest.skip("no zlib to load")
    zlib = ctypes.CDLL(zlib_name)
    zlib_module = symbolizer.symbolize(os.getpid(), function_address(zlib, "zlibVersion")).module
    # maps are cached now; a copy of zlib under a new name is a library never loaded before
    copy = tmp_path / "libkvtrace_zlib_copy.so"
    copy.write_bytes(Path(zlib_module).read_bytes())
    address = function_address(ctypes.CDLL(str(copy)), "zlibVersion")
    assert symbolizer.symbolize(os.getpid(), address) == NativeFrame(str(copy), "zlibVersion", 0)


def test_stack_table_interns_by_content():
    table = StackTable()
    inner = Frame("Cls.method", "/a.py", 3)
    stack = Stack((inner, Frame("<module>", "/a.py", 10)))
    same = Stack((Frame("Cls.method", "/a.py", 3), Frame("<module>", "/a.py", 10)))
    truncated = Stack(stack.frames, truncated=True)
    assert table.intern(stack) == 1
    assert table.intern(same) == 1
    assert table.intern(truncated) == 2
    assert table.intern(Stack(())) == 3
    assert table.get(1) == stack and table.get(2).truncated
    assert len(table) == 3 and same in table
    with pytest.raises(KeyError):
        table.get(0)
    with pytest.raises(KeyError):
        table.get(4)
    assert frame_to_json(inner) == {"function": "Cls.method", "file": "/a.py", "line": 3}


def test_an_address_in_a_cached_anonymous_mapping_reads_the_maps_again(tmp_path):
    """The loader may map a new library over address space the cached maps show anonymous (reserved or
    freed): the caller is named from the maps as they are now, not as the stale anonymous region."""
    (tmp_path / "42").mkdir()
    maps = tmp_path / "42" / "maps"
    maps.write_text("7f0000000000-7f0000100000 rw-p 00000000 00:00 0 \n")
    symbolizer = NativeSymbolizer(proc=tmp_path)
    assert symbolizer.symbolize(42, 0x7f0000000100) == NativeFrame("", "", 0x100)
    maps.write_text("7f0000000000-7f0000100000 r-xp 00001000 08:01 1234 /opt/lib/libnew.so\n")
    frame = symbolizer.symbolize(42, 0x7f0000000100)
    assert frame.module == "/opt/lib/libnew.so" and frame.offset == 0x1100  # its file offset: no table to read
