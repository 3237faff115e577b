"""The flight recorder when the ledger is larger than what a dump may copy (issue 31, attack 7).

GIVEN `kvtrace agent --max-read-entries 50` following a process that holds 40 allocations (80 ledger entries:
runtime and driver) and another that will fail out of memory
WHEN that second process's cudaMalloc of 2 TiB fails (error 2)
THEN the recorder's health said beforehand that a dump would leave objects out, with the figure; the dump is
written all the same with every event of its window, its trigger names what it left out, and `kvtrace flight`
lists that (before issue 31: no dump at all, and the recorder said it was up).
"""
from __future__ import annotations

import json
import re
import time

from agent_process import AgentProcess, kvtrace
from cuda_stubs import Workload
from harness import require_tracing_here
from kvtrace.client import AgentClient

HELD = 40
MAX_READ_ENTRIES = 50


def poll(check, what: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.2)
    return value


def flight_status(socket):
    with AgentClient.for_socket(socket) as client:
        return next((c for c in client.info().components if c.name == "flight_recorder"), None)


def test_an_oom_over_the_copy_limit_still_dumps_its_window_and_says_what_it_left_out(tmp_path, stub_build):
    require_tracing_here()
    socket = tmp_path / "kvtrace.sock"
    flight = tmp_path / "flight"
    with Workload([stub_build.workload, "leak", str(HELD)]) as holder, \
            Workload([stub_build.workload, "counts"]) as failing:
        holder_pid, failing_pid = holder.wait_ready(), failing.wait_ready()
        with AgentProcess(socket, "-p", str(holder_pid), "-p", str(failing_pid), "--no-nvml",
                          "--max-read-entries", str(MAX_READ_ENTRIES), "--flight-dir", str(flight)):
            holder.go()
            assert len(holder.read_calls()) == HELD
            # The recorder's health, after an analysis: down, with the figure, before any dump.
            status = poll(lambda: (s := flight_status(socket)) is not None and not s.up and s, "the recorder down")
            assert (f"the ledger's {2 * HELD} allocations and blocks are more than --max-read-entries "
                    f"{MAX_READ_ENTRIES}") in status.reason
            failing.go()
            calls = failing.read_calls()
            poll(lambda: sorted(flight.glob("flight-*-oom-*.kvtrace")), "a dump of the out-of-memory failure")
            listing = poll(lambda: [json.loads(line) for line in kvtrace(
                "flight", "--json", "--socket", str(socket)).stdout.splitlines()], "the dump listed")
    (dump,) = [dump for dump in listing if dump["trigger"] == "oom"]
    assert dump["pid"] == failing_pid
    failed_allocations = sum(1 for call in calls if call["rc"] == 2)
    # (the ledger as the dump copied it: the holder's 80 entries and what the failing process held then)
    left_out = re.fullmatch(
        rf"the ledger's (\d+) allocations and blocks are more than --max-read-entries {MAX_READ_ENTRIES}: the "
        rf"checkpoints hold pid {failing_pid}'s (\d+) objects only \(every event of the window is here; a free in "
        r"it of another process's older object replays as unknown\)", dump["left_out"])
    assert left_out is not None, dump["left_out"]
    assert int(left_out[1]) == 2 * HELD + int(left_out[2]) and int(left_out[2]) > 0
    # Every event of the window is in the dump: the holder's 40 cudaMalloc among them.
    tail = [json.loads(line) for line in kvtrace("tail", "--input", dump["path"], "--json").stdout.splitlines()]
    held = [event for event in tail if event.get("pid") == holder_pid and event.get("kind") == "alloc"
            and event.get("api") == "cudaMalloc"]
    assert len(held) == HELD and failed_allocations >= 1
