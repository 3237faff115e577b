"""Python stacks from threads whose thread state comes and goes, on every supported build
(tests/interpreters.py): real probes, stub libcudart, pytargets/thread_target.py.

GIVEN a target whose allocations come from a C thread with no Python state, a C thread that calls back
into Python (a new thread state for each call, deleted after it), 23 short-lived Python threads one after
another, and the main thread after all of them,
THEN every allocation is traced, each Python one with exactly the stack the target saw and the native
thread's with none (`no_thread_state`), never another thread's. On 3.15, where the probe finds a thread's
state in the interpreter's list (no pthread key), a thread is looked up there once and then kept: 23
allocations of the main thread, or of a thread with no state, cost one look each.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from cuda_stubs import Workload
from interpreters import LABELS, interpreter, version_of
from kvtrace.model.events import Api, Kind, StackStatus

TARGET = Path(__file__).resolve().parent / "pytargets" / "thread_target.py"
HELPER_SOURCE = TARGET.parent / "native_threads.c"
CALLS = 23  # thread_target.CALLS


@pytest.fixture(scope="module")
def native_threads(tmp_path_factory) -> Path:
    library = tmp_path_factory.mktemp("native_threads") / "libnative_threads.so"
    subprocess.run(["gcc", "-O1", "-shared", "-fPIC", "-pthread", "-o", str(library), str(HELPER_SOURCE)],
                   check=True)
    return library


def run_target(harness, python: Path, stub_build, helper: Path, cases: str):
    """Runs the cases under the tracer: (pid, the target's calls, its cudaMalloc events, counter deltas)."""
    harness.pump(0.05)
    before = harness.source.counters()
    with Workload([python, TARGET, stub_build.libcudart, helper, "--cases", cases]) as workload:
        pid = workload.wait_ready()
        harness.source.follow(pid)
        workload.go()
        calls = workload.read_calls()
        assert calls and all(call["rc"] == 0 for call in calls), calls
        assert harness.pump_until(lambda: len(harness.of(pid, Kind.ALLOC, Api.cudaMalloc)) >= len(calls))
        harness.pump(0.2)  # nothing more may come
        events = harness.of(pid, Kind.ALLOC, Api.cudaMalloc)
        after = harness.source.counters()
        stacks = {event.address: harness.session.stacks.get(event.stack_id) if event.stack_id else None
                  for event in events}
    deltas = {name: after[name] - before[name] for name in ("stack_walks", "stack_thread_lists")}
    return pid, calls, events, stacks, deltas


@pytest.mark.parametrize("label", LABELS)
def test_threads_whose_state_comes_and_goes_get_exactly_their_own_stacks(label, session_tracer, stub_build,
                                                                        native_threads):
    pid, calls, events, stacks, deltas = run_target(session_tracer, interpreter(label), stub_build,
                                                    native_threads, "native,callback,churn,main")
    assert len(calls) == 4 * CALLS
    assert sorted((e.address, e.size_bytes) for e in events) == sorted((c["address"], c["size_bytes"]) for c in calls)
    by_address = {event.address: event for event in events}
    for call in calls:
        event = by_address[call["address"]]
        if call["expected"] is None:  # the C thread that never had a Python state
            assert (event.stack_status, event.stack_id) == (StackStatus.NO_THREAD_STATE, 0), event
        else:
            assert event.stack_status is StackStatus.OK, (call["case"], event)
            stack = stacks[call["address"]]
            assert [[f.function, f.file, f.line] for f in stack.frames] == call["expected"], call["case"]
    assert deltas["stack_walks"] == 3 * CALLS
    print(f"\n{label}: {deltas['stack_thread_lists']} thread-list lookups for {len(calls)} allocations")
    if version_of(label) < (3, 15):
        assert deltas["stack_thread_lists"] == 0  # the pthread key, no list
    else:  # once per thread (the native one, the callbacks' one, 23 churned, main), and again for a
        # callback whose new state is not where the last one was (ctypes deletes each after its call)
        assert CALLS + 3 <= deltas["stack_thread_lists"] <= 2 * CALLS + 3


@pytest.mark.parametrize("label", [label for label in LABELS if version_of(label) >= (3, 14)])
def test_threads_beside_a_subinterpreter_get_exactly_their_own_stacks(label, session_tracer, stub_build,
                                                                      native_threads):
    """A subinterpreter made first (3.14+): the newest interpreter, whose list 3.15 looks at first. The main
    thread (which has a state in both: it ran code in the subinterpreter) and a new thread get their own
    stacks, the main interpreter's."""
    _, calls, events, stacks, deltas = run_target(session_tracer, interpreter(label), stub_build, native_threads,
                                                  "beside_subinterpreter")
    assert len(calls) == len(events) == 2 * CALLS
    for call in calls:
        stack = stacks[call["address"]]
        assert stack is not None and [[f.function, f.file, f.line] for f in stack.frames] == call["expected"]
    assert deltas["stack_walks"] == 2 * CALLS


@pytest.mark.parametrize("label", [label for label in LABELS if version_of(label) >= (3, 15)])
@pytest.mark.parametrize("case", ["native", "main"])
def test_a_thread_is_looked_up_in_the_list_once(label, case, session_tracer, stub_build, native_threads):
    """23 allocations of one thread: one look through the interpreter's list, whether the thread has a
    state (main: kept, and checked still linked at each walk) or none (native: kept while the list's head
    is unchanged)."""
    _, calls, events, _, deltas = run_target(session_tracer, interpreter(label), stub_build, native_threads, case)
    assert len(calls) == len(events) == CALLS
    assert deltas["stack_thread_lists"] == 1
    assert deltas["stack_walks"] == (CALLS if case == "main" else 0)
