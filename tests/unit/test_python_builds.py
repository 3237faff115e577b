"""Which CPython builds get stacks, against live interpreters (tests/interpreters.py): every supported
build is recognised with its own offsets, checked against its _Py_DebugOffsets (3.13+); and a build kvtrace
does not know fails closed with a reason, never with a guess. The unknown builds are made from real ones by
changing, in the running process, what kvtrace reads to tell them apart: Py_Version (a 3.16 alpha), one
word of _Py_DebugOffsets (a patch release that moved a frame field), the free-threaded flag (a 3.13t).
"""
from __future__ import annotations

import struct
import subprocess
from collections.abc import Iterator

import pytest

from interpreters import LABELS, interpreter, is_free_threaded, version_of
from kvtrace.cli.doctor import process_findings
from kvtrace.sources.elf import find_symbols
from kvtrace.sources.python import runtime
from kvtrace.sources.python.offsets import NOT_PRESENT
from kvtrace.sources.python.runtime import NoPython, PythonTarget, inspect_python

WAIT = "import sys; print('ready', flush=True); sys.stdin.readline()"


@pytest.fixture
def running(request) -> Iterator[tuple[str, subprocess.Popen]]:
    label = request.param
    process = subprocess.Popen([str(interpreter(label)), "-I", "-c", WAIT], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "ready"
        yield label, process
    finally:
        process.kill()
        process.wait(timeout=30)


def symbol_address(target: PythonTarget, name: str) -> int:
    """Where `name` is in the running process: in the file that holds its runtime (the executable, or
    pyenv's libpython)."""
    symbols = find_symbols(target.path, [name, "_PyRuntime"])
    return target.runtime_address - symbols["_PyRuntime"] + symbols[name]


def write_u64(pid: int, address: int, value: int) -> None:
    try:
        with open(f"/proc/{pid}/mem", "r+b", buffering=0) as mem:
            mem.seek(address)
            mem.write(struct.pack("<Q", value))
    except OSError as error:
        pytest.skip(f"cannot write /proc/{pid}/mem ({error}): needs root or ptrace access")


def inspected(pid: int) -> PythonTarget | NoPython:
    found = inspect_python(pid)
    if isinstance(found, NoPython) and "CAP_SYS_PTRACE" in found.reason:
        pytest.skip(found.reason)
    return found


def doctor_says(pid: int) -> str:
    """What `kvtrace doctor --pid` says of the process's Python."""
    [finding] = [f for f in process_findings(pid) if f.name.endswith(" python")]
    return finding.message


def supported(pid: int) -> PythonTarget:
    found = inspected(pid)
    assert isinstance(found, PythonTarget), found
    return found


@pytest.mark.parametrize("running", LABELS, indirect=True)
def test_each_supported_build_is_recognised_with_its_offsets(running):
    label, process = running
    found = inspected(process.pid)
    assert isinstance(found, PythonTarget), found
    assert found.offsets.label == label and found.version == version_of(label)
    assert found.offsets.free_threaded is is_free_threaded(label)
    if found.version >= (3, 15):  # no pthread key: the probe looks the thread up in the list
        assert found.tss_key_address == 0 and found.interpreters_head_address != 0
    else:
        assert found.tss_key_address != 0 and found.offsets.runtime_interpreters_head == NOT_PRESENT
    said = doctor_says(process.pid)
    build = " (free-threaded)" if is_free_threaded(label) else ""
    assert said == f"Python {label}{build} stacks from {found.path}", said


@pytest.mark.parametrize("running", ["3.15", "3.13"], indirect=True)
def test_an_unknown_version_fails_closed_with_a_reason(running):
    """Py_Version says 3.16.0a1: no offsets for it, and none guessed."""
    _, process = running
    write_u64(process.pid, symbol_address(supported(process.pid), "Py_Version"), 0x031000A1)
    found = inspected(process.pid)
    assert isinstance(found, NoPython), found
    assert "Python 3.16 is not supported (3.10, 3.11, 3.12, 3.13, 3.14, 3.15, 3.14t, 3.15t are)" in found.reason
    assert doctor_says(process.pid) == f"no Python stacks: {found.reason}"


@pytest.mark.parametrize("running", ["3.14", "3.14t", "3.15", "3.15t"], indirect=True)
def test_a_moved_field_fails_closed_with_a_reason(running):
    """A patch release that moved the frame's owner byte: its own _Py_DebugOffsets say so, and kvtrace,
    whose table says otherwise, gives no stacks rather than wrong ones."""
    label, process = running
    index = runtime._DEBUG_INDEX[version_of(label)]["interpreter_frame.owner"]
    expected = supported(process.pid)
    write_u64(process.pid, expected.runtime_address + 8 + 8 * index, expected.offsets.frame_owner + 1)
    found = inspected(process.pid)
    assert isinstance(found, NoPython), found
    assert found.reason == (f"offsets do not match this Python {label}: _Py_DebugOffsets "
                            f"interpreter_frame.owner is {expected.offsets.frame_owner + 1}, "
                            f"kvtrace expects {expected.offsets.frame_owner}")


@pytest.mark.parametrize("running", ["3.13"], indirect=True)
def test_an_unknown_free_threaded_build_fails_closed_with_a_reason(running):
    """A 3.13t: its _Py_DebugOffsets say free-threaded, and kvtrace has no 3.13t offsets."""
    _, process = running
    write_u64(process.pid, supported(process.pid).runtime_address + 8 + 8 * runtime._DEBUG_FREE_THREADED, 1)
    found = inspected(process.pid)
    assert isinstance(found, NoPython), found
    assert found.reason.startswith("Python 3.13 free-threaded build is not supported (3.10, ")
