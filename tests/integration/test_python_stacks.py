"""Python stacks walked in the allocation probes, end to end: real probes, stub libcudart, and CPython
3.10-3.15 targets, 3.14 and 3.15 also free-threaded (tests/interpreters.py), running
pytargets/alloc_target.py, which records their own stacks.

GIVEN a target that calls cudaMalloc from known Python call sites, through ctypes.CDLL (GIL
released) and ctypes.PyDLL (GIL held), and prints the stack sys._getframe gives at each call,
WHEN the session tracer follows it,
THEN every allocation event's interned stack is exactly that (function, file, line) list, innermost
first; deeper than 64 frames it is the innermost 64 and flagged truncated. A Python the probes do
not support gives no stack and says why, and its allocations are still traced; a process that is
gone before its stacks are symbolized gives "<unknown>" frames, never wrong ones.

Each build is skipped, with the reason, where this machine does not have it (`make pythons` builds 3.14+).
"""
from __future__ import annotations

import ctypes
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from cuda_stubs import Workload
from interpreters import LABELS, interpreter, offsets_of
from kvtrace.model.events import Api, Event, Kind, Layer, StackStatus
from kvtrace.model.stacks import UNKNOWN_FUNCTION
from kvtrace.sources.python.runtime import NoPython, PythonTarget

TARGET = Path(__file__).resolve().parent / "pytargets" / "alloc_target.py"
SUPPORTED = list(LABELS)
MAX_FRAMES = 64  # KVT_MAX_FRAMES in probes/kvtrace.h
VIAS = ("CDLL", "PyDLL")
STEADY_CALLS = 50  # alloc_target.STEADY_CALLS


def pyenv_python(label: str) -> Path:
    """The interpreter of `label` (e.g. "3.12", "3.14t"); skips the test where there is none."""
    return interpreter(label)


@dataclass
class TracedRun:
    """One target run to `done` under the session tracer; the process is still alive."""

    version: str
    pid: int
    calls: list[dict]
    harness: object  # tests/harness.TracingHarness

    def allocs(self, api: Api = Api.cudaMalloc) -> list[Event]:
        return self.harness.of(self.pid, Kind.ALLOC, api)

    def calls_of(self, case: str, via: str) -> list[dict]:
        return [c for c in self.calls if c["case"] == case and c["via"] == via]

    def event_of(self, call: dict, api: Api = Api.cudaMalloc) -> Event:
        matching = [e for e in self.allocs(api) if e.address == call["address"]]
        assert len(matching) == 1, f"{api.name} events at {call['address']:#x}: {matching}"
        assert matching[0].size_bytes == call["size_bytes"]
        return matching[0]

    def stack_of(self, event: Event):
        assert event.stack_status is StackStatus.OK, event
        assert event.stack_id != 0, event
        return self.harness.session.stacks.get(event.stack_id)


def as_lists(stack) -> list[list]:
    return [[frame.function, frame.file, frame.line] for frame in stack.frames]


def run_to_done(harness, python: Path, stub_build, *args: str):
    """Starts the target, lets the tracer follow it, runs it to `done`: (workload, pid, calls)."""
    # A running agent drains its rings all the time; a session tracer that idled through other
    # tests may hold a backlog, or a full notification ring that drops the target's exec
    # notification (which hid a bug in follow()). Start from drained rings: the same sequence
    # every run.
    harness.pump(0.05)
    workload = Workload([python, TARGET, stub_build.libcudart, *args])
    try:
        pid = workload.wait_ready()
        harness.source.follow(pid)
        workload.go()
        calls = workload.read_calls()
    except BaseException:
        workload.__exit__(None, None, None)
        raise
    assert calls and all(c["rc"] == 0 for c in calls), calls
    return workload, pid, calls


@pytest.fixture(scope="module", params=SUPPORTED)
def traced(request, session_tracer, stub_build):
    """Every case of alloc_target.py, for one Python version, traced to its last event."""
    python = pyenv_python(request.param)
    harness = session_tracer
    workload, pid, calls = run_to_done(harness, python, stub_build)
    with workload:
        # every cudaMalloc is also a cuMemAlloc_v2 (the runtime stub calls the driver stub)
        arrived = harness.pump_until(lambda: len(harness.of(pid, Kind.ALLOC)) >= 2 * len(calls))
        harness.pump(0.2)  # nothing more may come
        assert arrived, f"{len(harness.of(pid, Kind.ALLOC))} of {2 * len(calls)} events"
        yield TracedRun(request.param, pid, calls, harness)


# ---- supported versions: exact stacks ----

def test_target_is_recognized_and_every_call_traced(traced):
    target = traced.harness.source.python[traced.pid]
    assert isinstance(target, PythonTarget), target
    assert target.offsets.label == traced.version
    assert [(e.address, e.size_bytes) for e in traced.allocs()] == \
        [(c["address"], c["size_bytes"]) for c in traced.calls]
    assert len(traced.allocs(Api.cuMemAlloc_v2)) == len(traced.calls)
    assert len(traced.harness.of(traced.pid)) == 2 * len(traced.calls)
    assert Counter(e.stack_status for e in traced.harness.of(traced.pid)) == \
        {StackStatus.OK: 2 * len(traced.calls)}


@pytest.mark.parametrize("via", VIAS)
@pytest.mark.parametrize("case", ["recursion", "method", "generator", "thread", "non_ascii"])
def test_stack_equals_the_targets_own(traced, case, via):
    (call,) = traced.calls_of(case, via)
    event = traced.event_of(call)
    stack = traced.stack_of(event)
    assert as_lists(stack) == call["expected"]
    assert stack.truncated is False
    # The driver call the runtime stub makes underneath has the same Python stack.
    assert traced.event_of(call, Api.cuMemAlloc_v2).stack_id == event.stack_id


def test_names_are_qualified_and_non_ascii(traced):
    """Spot checks of what the exact comparisons above cover: co_qualname on 3.11+, and names in
    the three non-ASCII str layouts (1, 2 and 4 bytes a character)."""
    method = traced.stack_of(traced.event_of(traced.calls_of("method", "CDLL")[0]))
    qualified = "method" if traced.version == "3.10" else "Allocator.method"  # no qualname on 3.10
    assert method.frames[0].function == qualified
    non_ascii = traced.stack_of(traced.event_of(traced.calls_of("non_ascii", "PyDLL")[0]))
    assert [f.function for f in non_ascii.frames[:3]] == ["分配", "\U0002000b", "größe"]
    thread = traced.stack_of(traced.event_of(traced.calls_of("thread", "CDLL")[0]))
    assert thread.frames[0].function == "worker"
    assert thread.frames[-1].function.endswith("_bootstrap")  # the worker thread's own stack


@pytest.mark.parametrize("via", VIAS)
def test_deep_recursion_is_cut_at_64_frames_and_flagged(traced, via):
    (call,) = traced.calls_of("deep", via)
    stack = traced.stack_of(traced.event_of(call))
    assert len(call["expected"]) > MAX_FRAMES
    assert as_lists(stack) == call["expected"][:MAX_FRAMES]
    assert stack.truncated is True


@pytest.mark.parametrize("via", VIAS)
def test_stack_of_exactly_64_frames_is_whole_and_not_truncated(traced, via):
    (call,) = traced.calls_of("at_limit", via)
    assert len(call["expected"]) == MAX_FRAMES
    stack = traced.stack_of(traced.event_of(call))
    assert as_lists(stack) == call["expected"]
    assert stack.truncated is False


@pytest.mark.parametrize("via", VIAS)
def test_stack_of_65_frames_is_flagged_truncated(traced, via):
    """The 65th frame is the outermost one: dropping it must still set the flag."""
    (call,) = traced.calls_of("over_limit_by_one", via)
    assert len(call["expected"]) == MAX_FRAMES + 1
    stack = traced.stack_of(traced.event_of(call))
    assert as_lists(stack) == call["expected"][:MAX_FRAMES]
    assert stack.truncated is True


@pytest.mark.parametrize("via", VIAS)
def test_stack_through_c_calls_is_complete(traced, via):
    """40 levels of Python -> C (tp_call) -> Python, as every nn.Module call is: 44 Python frames,
    under the limit, so the whole stack and no truncation. On 3.12+ every level also has an entry
    frame owned by the C stack, which the probe skips; those must not eat into the 64 frames."""
    (call,) = traced.calls_of("c_recursion", via)
    assert len(call["expected"]) < MAX_FRAMES
    stack = traced.stack_of(traced.event_of(call))
    assert as_lists(stack) == call["expected"]
    assert stack.truncated is False


@pytest.mark.parametrize("via", VIAS)
def test_steady_call_site_is_one_interned_stack(traced, via):
    calls = traced.calls_of("steady", via)
    assert len(calls) == STEADY_CALLS
    assert len({tuple(map(tuple, c["expected"])) for c in calls}) == 1  # one call site
    events = [traced.event_of(call) for call in calls]
    assert {e.stack_status for e in events} == {StackStatus.OK}
    stack_ids = {e.stack_id for e in events}
    assert len(stack_ids) == 1 and 0 not in stack_ids, stack_ids
    assert as_lists(traced.harness.session.stacks.get(stack_ids.pop())) == calls[0]["expected"]


@pytest.mark.parametrize("via", VIAS)
def test_same_innermost_frames_under_another_line_give_its_own_stack(traced, via):
    """alloc_outer calls alloc_middle -> alloc_inner from two lines. On 3.11+ the second call puts
    the two inner frames at the addresses of the first, with the same code and instruction: a walk
    that trusted unchanged innermost frames would give the first stack twice."""
    first, second = traced.calls_of("same_inner_frames", via)
    assert first["expected"][:2] == second["expected"][:2]
    assert first["expected"][2] != second["expected"][2]  # alloc_outer's line
    assert first["expected"][3:] == second["expected"][3:]
    events = [traced.event_of(call) for call in (first, second)]
    assert [as_lists(traced.stack_of(e)) for e in events] == [first["expected"], second["expected"]]
    assert events[0].stack_id != events[1].stack_id
    for call, event in zip((first, second), events, strict=True):
        assert traced.event_of(call, Api.cuMemAlloc_v2).stack_id == event.stack_id


@pytest.mark.parametrize("version", SUPPORTED)
def test_each_allocation_walks_once_and_reads_its_data_stack_at_once(version, session_tracer, stub_build):
    """An allocation in a loop from one line: one walk per cudaMalloc (its cuMemAlloc_v2 reuses
    it), one interned stack; on 3.11+ the frames are read from the thread's data stack in one read
    per walk (3.12+ add one read of the entry frame under <module>, which is on the C stack), on
    3.10 one read per frame."""
    python = pyenv_python(version)
    harness = session_tracer
    harness.pump(0.05)
    before = harness.source.counters()
    workload, pid, calls = run_to_done(harness, python, stub_build, "--cases", "steady")
    with workload:
        assert harness.pump_until(lambda: len(harness.of(pid, Kind.ALLOC)) >= 2 * len(calls))
        harness.pump(0.2)
        after = harness.source.counters()
        events = [harness.of(pid, Kind.ALLOC, api) for api in (Api.cudaMalloc, Api.cuMemAlloc_v2)]
    walks, windows, frame_reads = (after[name] - before[name]
                                   for name in ("stack_walks", "stack_windows", "stack_frame_reads"))
    assert len(calls) == 2 * STEADY_CALLS
    assert walks == len(calls)
    for via in VIAS:
        ids = {e.stack_id for e in harness.of(pid, Kind.ALLOC)
               if e.size_bytes == calls[[c["via"] for c in calls].index(via)]["size_bytes"]}
        assert len(ids) == 1 and 0 not in ids
    assert [e.stack_id for e in events[0]] == [e.stack_id for e in events[1]]
    depth = len(calls[0]["expected"])
    if version == "3.10":
        assert (windows, frame_reads) == (0, walks * depth)
    else:
        assert windows == walks
        # 3.15's base frame, the last of every chain, is known from the thread state and not read
        assert frame_reads == (0 if version == "3.11" else walks)


def test_without_the_walker_program_allocations_are_traced_without_stacks_and_counted(
        session_tracer, stub_build):
    """The probes hand the walk to walk_stack by a tail call. Taken out of their program array, every
    allocation is still traced exactly, with no stack (not walked), and each walk not made is
    counted (stack_walker_missing): the runtime call and its driver call each asked for one."""
    python = pyenv_python("3.12")
    harness = session_tracer
    harness.pump(0.05)
    probes = harness.source._probes()
    before = harness.source.counters()
    del probes._bpf[b"stack_walker"][ctypes.c_int(0)]
    try:
        workload, pid, calls = run_to_done(harness, python, stub_build, "--cases", "steady")
        with workload:
            assert harness.pump_until(lambda: len(harness.of(pid, Kind.ALLOC)) >= 2 * len(calls))
            harness.pump(0.2)
            after = harness.source.counters()
            events = harness.of(pid, Kind.ALLOC)
    finally:
        probes._put_in_stack_walker()
    assert len(calls) == 2 * STEADY_CALLS
    assert sorted((e.address, e.size_bytes) for e in events if e.api is Api.cudaMalloc) == \
        sorted((c["address"], c["size_bytes"]) for c in calls)
    assert len(events) == 2 * len(calls)
    assert {(e.stack_id, e.stack_status) for e in events} == {(0, StackStatus.NOT_WALKED)}
    assert after["stack_walker_missing"] - before["stack_walker_missing"] == 2 * len(calls)
    assert after["stack_walks"] == before["stack_walks"]


# Run inside the target Python: its own thread state, read through offsets.py's numbers.
_DATASTACK_CHECK = """
import ctypes, sys
offset = int(sys.argv[1])
tstate = ctypes.pythonapi.PyThreadState_Get
tstate.restype = ctypes.c_void_p
chunk, top, limit = (ctypes.c_uint64 * 3).from_address(tstate() + offset)
previous, size = (ctypes.c_uint64 * 2).from_address(chunk)  # _PyStackChunk: previous, size, top
print(int(chunk < top <= limit and limit == chunk + size))
"""


@pytest.mark.parametrize("version", SUPPORTED)
def test_data_stack_offset_matches_the_python(version):
    """offsets.py's PyThreadState.datastack_chunk/_top/_limit: checked against the running
    interpreter (its current chunk's own size ends at the limit); 3.10 has no data stack."""
    import subprocess

    from kvtrace.sources.python.offsets import NOT_PRESENT
    offsets = offsets_of(version)
    python = pyenv_python(version)
    if version == "3.10":
        assert offsets.tstate_datastack == NOT_PRESENT
        return
    result = subprocess.run([python, "-c", _DATASTACK_CHECK, str(offsets.tstate_datastack)],
                            capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "1", result


# ---- a process gone before its stacks are symbolized ----

@pytest.mark.parametrize("version", SUPPORTED)
def test_process_exiting_before_symbolization_gives_unknown_never_wrong_frames(
        version, session_tracer, stub_build):
    """First batch traced and symbolized while the target lives; then a second batch (two call
    sites seen before, three new ones), after which the target exits at once and is reaped before
    the tracer is pumped. Its events all arrive and its ledger empties; every frame is the right
    one (a stack interned while it lived) or "<unknown>", never a wrong one."""
    python = pyenv_python(version)
    harness = session_tracer
    seen_before = ["recursion", "method"]
    workload, pid, first = run_to_done(harness, python, stub_build, "--exit",
                                       "--cases", ",".join(seen_before),
                                       "--then", "recursion,method,non_ascii,thread,deep")
    with workload:
        assert harness.pump_until(lambda: len(harness.of(pid, Kind.ALLOC)) >= 2 * len(first))
        interned = {}
        for call, event in zip(first, harness.of(pid, Kind.ALLOC, Api.cudaMalloc), strict=True):
            stack = harness.session.stacks.get(event.stack_id)
            assert as_lists(stack) == call["expected"]  # symbolized while alive
            interned[call["case"], call["via"]] = event.stack_id

        workload.go()  # not pumped from here until the target is gone
        second = workload.read_calls()
        assert workload.process.wait(timeout=30) == 0  # exited and reaped: /proc/PID is gone
        assert not Path(f"/proc/{pid}").exists()
        assert harness.pump_until(lambda: harness.of(pid, Kind.PROCESS_EXIT), timeout_seconds=10)
        harness.pump(0.2)
    tracer = harness.source
    calls = first + second
    mallocs = harness.of(pid, Kind.ALLOC, Api.cudaMalloc)
    assert [(e.address, e.size_bytes) for e in mallocs] == \
        [(c["address"], c["size_bytes"]) for c in calls]
    assert len(harness.of(pid, Kind.ALLOC, Api.cuMemAlloc_v2)) == len(calls)
    assert pid not in tracer.session.ledger.pids()
    assert [e for e in tracer.kernel_ledger() if e.key.pid == pid] == []
    assert pid not in tracer.python  # forgotten at its exit
    known = unknown = 0
    for call, event in zip(second, mallocs[len(first):], strict=True):
        assert event.stack_status is StackStatus.OK
        assert event.stack_id != 0
        if call["case"] in seen_before:  # the same stack as in the first batch
            assert event.stack_id == interned[call["case"], call["via"]]
        stack = tracer.session.stacks.get(event.stack_id)
        expected = call["expected"][:MAX_FRAMES]
        assert len(stack.frames) == len(expected)
        for frame, (function, file, line) in zip(stack.frames, expected, strict=True):
            if frame.function == UNKNOWN_FUNCTION:
                unknown += 1
            else:
                assert (frame.function, frame.file, frame.line) == (function, file, line)
                known += 1
    print(f"\n{version}: after exit {known} frames right, {unknown} unknown")


# ---- unsupported Python ----

def test_unsupported_python_39_no_stack_reason_given_allocations_traced(session_tracer, stub_build):
    python = pyenv_python("3.9")
    harness = session_tracer
    workload, pid, calls = run_to_done(harness, python, stub_build,
                                       "--cases", "recursion,method,thread,deep")
    with workload:
        assert harness.pump_until(lambda: len(harness.of(pid)) >= 2 * len(calls))
        harness.pump(0.2)
        found = harness.source.python[pid]
        assert isinstance(found, NoPython), found
        assert re.search(r"\b3\.9\b", found.reason), found.reason
        events = harness.of(pid)
        assert len(events) == 2 * len(calls)
        mallocs = harness.of(pid, Kind.ALLOC, Api.cudaMalloc)
        assert [(e.address, e.size_bytes) for e in mallocs] == \
            [(c["address"], c["size_bytes"]) for c in calls]
        assert all(e.layer is Layer.RUNTIME for e in mallocs)
        assert {(e.stack_id, e.stack_status) for e in events} == {(0, StackStatus.NOT_PYTHON)}


def test_without_python_stacks_a_python_process_is_traced_and_no_walk_is_asked(bpf_here_unshared, stub_build):
    """GIVEN the agent's --no-python-stacks (probes built without the walk), THEN a supported Python's
    allocations are traced exactly and say NOT_PYTHON, as the calls of a process with no registered
    runtime do; the frees (no walk asked) NOT_WALKED; and the kernel walked nothing, even for a process
    registered as a Python (which probes that asked the walker would have walked: NO_THREAD_STATE)."""
    from harness import TracingHarness
    from kvtrace.sources.bpf import abi

    python = pyenv_python("3.12")
    harness = TracingHarness(only_selected=True, python_stacks=False,
                             preattach_globs=(str(stub_build.lib_dir / "*.so.*"),))
    try:
        assert "-DKVT_TASK_FSBASE_OFFSET=-1" in harness.source.options.settings.cflags()
        harness.pump(0.05)
        workload = Workload([python, TARGET, stub_build.libcudart, "--cases", "recursion,thread"])
        try:
            pid = workload.wait_ready()
            harness.source.follow(pid)
            harness.source.probes.set_python_target(pid, abi.RawPyTarget())  # registered all the same
            workload.go()
            calls = workload.read_calls()
        except BaseException:
            workload.__exit__(None, None, None)
            raise
        with workload:
            assert harness.pump_until(lambda: len(harness.of(pid)) >= 2 * len(calls))
            harness.pump(0.2)
            assert pid not in harness.source.python  # the agent registered no runtime (the test did)
            allocs = [e for e in harness.of(pid) if e.kind is Kind.ALLOC]
            assert sorted((e.address, e.size_bytes) for e in allocs if e.api is Api.cudaMalloc) == \
                sorted((c["address"], c["size_bytes"]) for c in calls)
            assert len(allocs) == 2 * len(calls)  # the runtime's and the driver's
            assert {(e.stack_id, e.stack_status) for e in allocs} == {(0, StackStatus.NOT_PYTHON)}
            others = [e for e in harness.of(pid) if e.kind is not Kind.ALLOC]
            assert {e.stack_status for e in others} <= {StackStatus.NOT_WALKED}
            counters = harness.source.counters()
            assert counters["stack_walks"] == 0 and counters["stack_walker_missing"] == 0
    finally:
        harness.close()
