"""The ledger stays exact when the event stream overflows, and --cmdline selects processes.

GIVEN a ring buffer far too small for the workload's burst, WHEN events are lost, THEN the loss is
counted in BPF and the agent's ledger, resynced from the kernel's, holds exactly the workload's
outstanding allocations.
"""
import ctypes
import re

import pytest

from cuda_stubs import Workload
from harness import TracingHarness
from kvtrace.model.events import Api, Kind, Layer
from kvtrace.sources.bpf import abi
from kvtrace.sources.bpf.loader import ProbeSettings, exit_reports_group_dead


def assert_ledgers_hold(tracer, pid: int, calls: list[dict]) -> None:
    """The kernel's ledger and the agent's hold exactly the workload's allocations (address -> size),
    at the runtime and the driver layer, and its physical bytes are theirs."""
    expected = {c["address"]: c["size_bytes"] for c in calls}
    for layer in (Layer.RUNTIME, Layer.DRIVER):
        for entries in (tracer.kernel_ledger(), tracer.session.ledger):
            got = {e.key.address: e.size_bytes for e in entries if e.key.pid == pid and e.key.layer is layer}
            assert got == expected, layer
    assert tracer.session.ledger.physical_device_bytes(pid) == sum(expected.values())


def test_overflowing_ring_buffer_keeps_the_ledger_exact(bpf_here_unshared, stub_build, tmp_path):
    leaks = 5000  # 10 000 events (runtime + driver) into a 4 KiB ring: most are lost
    with Workload([stub_build.workload, "leak", str(leaks)]) as workload:
        pid = workload.wait_ready()
        harness = TracingHarness([pid], settings=ProbeSettings(ringbuf_pages=1),
                                preattach_globs=(str(stub_build.lib_dir / "*.so.*"),))
        try:
            workload.go()
            calls = workload.read_calls(timeout_s=120)
            harness.pump(1.5)  # past resync_min_seconds: the resync runs
            tracer = harness.source
            counters = tracer.counters()
            print(f"\n{leaks} leaks: {counters['events_submitted']} events submitted, "
                  f"{counters['events_lost']} lost, {tracer.session.resyncs_total} resyncs")
            assert counters["events_lost"] > 0
            assert counters["events_submitted"] + counters["events_lost"] == 2 * leaks
            assert tracer.session.resyncs_total >= 1
            # the counters came in one batched read of the per-CPU array, the same as one lookup each
            probes = tracer.probes
            table = probes._bpf[b"counters"]
            assert probes._counters_batched and probes.counters() == {
                name: sum(table[ctypes.c_int(index)]) for index, name in enumerate(abi.COUNTERS)}
            # and the totals in one batched lookup, the same as bcc's key by key
            totals = probes.read_totals()
            assert probes._hashes_batched and any(key.pid == pid for key, _ in totals)
            assert sorted((bytes(key), bytes(value)) for key, value in totals) == sorted(
                (bytes(key), bytes(value)) for key, value in probes._bpf[b"ledger_totals"].items())
            # and where the kernel has no batched lookups, bcc's iteration gives the same
            probes._hashes_batched = False
            assert sorted((bytes(key), bytes(value)) for key, value in probes.read_totals()) == sorted(
                (bytes(key), bytes(value)) for key, value in totals)
            probes._hashes_batched = True
            assert_ledgers_hold(tracer, pid, calls)
        finally:
            harness.close()


def test_totals_stay_exact_while_events_are_lost_under_a_steady_flood(bpf_here_unshared, stub_build):
    """GIVEN a ring far too small, one process making 20 000 cudaMalloc+cudaFree pairs (a steady flood) while
    another makes 500 leaks, WHEN most events are lost (frees among them), THEN the agent's totals are the
    leaks exactly and nothing of the flood: the probes keep the totals with the entries, so no count of
    the events and no recount is involved (a recount read while the flood went on was off)."""
    with Workload([stub_build.workload, "loop", "200000"]) as flood, \
            Workload([stub_build.workload, "leak", "500"]) as leaker:
        flood_pid, leak_pid = flood.wait_ready(), leaker.wait_ready()
        harness = TracingHarness([flood_pid, leak_pid], settings=ProbeSettings(ringbuf_pages=1),
                                 preattach_globs=(str(stub_build.lib_dir / "*.so.*"),))
        try:
            flood.go()
            leaker.go()
            calls = leaker.read_calls(timeout_s=120)
            harness.pump(1.0)  # the agent reads, loses and resyncs while the flood goes on
            flooding = flood.process.poll() is None
            assert flooding, "the flood ended before the check: make it longer"
            assert_ledgers_hold(harness.source, leak_pid, calls)  # exact in the middle of it
            (loop,) = flood.read_calls(timeout_s=300)
            harness.pump(1.5)
            tracer = harness.source
            counters = tracer.counters()
            ledger = tracer.session.ledger
            print(f"\n{loop['loop_pairs']} pairs and 500 leaks: {counters['events_submitted']} events submitted, "
                  f"{counters['events_lost']} lost; flood holds {ledger.physical_device_bytes(flood_pid)} B, "
                  f"leaker {ledger.physical_device_bytes(leak_pid)} B")
            assert counters["events_lost"] > 0 and counters["totals_full"] == 0
            assert ledger is tracer.kernel_store and ledger.kept() == []
            assert ledger.physical_device_bytes(flood_pid) == 0
            assert tracer.kernel_store.counted_entries({flood_pid}) == 0
            assert_ledgers_hold(tracer, leak_pid, calls)
        finally:
            harness.close()


def test_an_exit_lost_to_a_full_ring_is_swept(bpf_here_unshared, stub_build):
    """GIVEN a process whose exit event cannot be sent (the ring is full: nobody reads it), THEN
    the kernel keeps it tracked and the sweep drops what it held, in both ledgers. Every process is
    traced (no -p): the sweep knows of the process only because the kernel still tracks it."""
    with Workload([stub_build.workload, "leak", "500"]) as workload:
        pid = workload.wait_ready()
        harness = TracingHarness((), settings=ProbeSettings(ringbuf_pages=1), sweep_seconds=0.2,
                                 preattach_globs=(str(stub_build.lib_dir / "*.so.*"),))
        try:
            workload.go()
            assert len(workload.read_calls()) == 500
            assert workload.finish() == 0  # exits while the ring is still full
            probes = harness.source.probes
            assert probes is not None and probes.counters()["events_lost"] > 0
            assert pid in probes.tracked_pids()  # its exit event was lost: still tracked

            def swept():
                return (pid not in probes.tracked_pids() and pid not in harness.session.ledger.pids()
                        and all(e.key.pid != pid for e in harness.source.kernel_ledger())
                        and all(key.pid != pid for key, _ in probes.read_totals()))  # its totals went too

            assert harness.pump_until(swept, timeout_seconds=10)
            assert len(harness.of(pid, Kind.PROCESS_EXIT)) == 1  # the sweep's, once
        finally:
            harness.close()


@pytest.mark.parametrize("group_dead", [True, False], ids=["exit-of-last-thread", "exit-of-leader"])
def test_a_process_whose_main_thread_ends_first_is_dropped_when_its_last_thread_ends(
        bpf_here_unshared, stub_build, group_dead):
    """GIVEN a process whose main thread ends while another thread goes on allocating, THEN what it
    held leaves both ledgers once its last thread ends. Where sched_process_exit has group_dead, the
    exit event says so, once, after the last allocation (the sweep is not what drops it: after the one at
    the start, the next is an hour away); on kernels without, the event comes at the main thread's end
    (and drops what the process held then), and the allocations made after it keep the process tracked
    (no thread may remember it tracked) for the sweep to drop."""
    if group_dead and not exit_reports_group_dead():
        pytest.skip("this kernel's sched_process_exit has no group_dead field")
    with Workload([stub_build.workload, "leader_exits"]) as workload:
        pid = workload.wait_ready()
        harness = TracingHarness((), settings=ProbeSettings(exit_group_dead=group_dead),
                                 sweep_seconds=3600 if group_dead else 0.2, tracked_read_seconds=0.2,
                                 preattach_globs=(str(stub_build.lib_dir / "*.so.*"),))
        try:
            workload.go()
            calls = workload.read_calls()
            assert [c["api"] for c in calls] == ["cudaMalloc"] * 5
            assert harness.pump_until(lambda: len(harness.of(pid, Kind.ALLOC)) == 10)
            probes = harness.source.probes
            assert probes is not None and pid in probes.tracked_pids()
            # read in one batched lookup, the same as bcc's key by key
            assert probes._hashes_batched and probes.tracked_pids() == {
                key.value for key in probes._bpf[b"tracked_pids"].keys()}
            # (without group_dead, the main thread's end dropped its 2 as if the process had ended: hidden from every
            # read at once, deleted from the kernel's map by the loop's scan within a turn or two)
            held = {e.key.address for e in harness.session.outstanding([pid])}
            assert len(held) == (5 if group_dead else 3)
            assert workload.finish() == 7

            def dropped():
                return (pid not in probes.tracked_pids() and pid not in harness.session.ledger.pids()
                        and all(e.key.pid != pid for e in harness.source.kernel_ledger())
                        and all(key.pid != pid for key, _ in probes.read_totals()))

            assert harness.pump_until(dropped, timeout_seconds=10)
            exits = harness.of(pid, Kind.PROCESS_EXIT)
            if group_dead:
                assert len(exits) == 1
                assert exits[0].timestamp_ns > max(e.timestamp_ns for e in harness.of(pid, Kind.ALLOC))
                assert exits[0].error_code == 7 << 8  # the wait status of exit(7)
            else:
                assert exits[0].timestamp_ns < max(e.timestamp_ns for e in harness.of(pid, Kind.ALLOC))
            assert probes.counters()["events_lost"] == 0
        finally:
            harness.close()


def test_cmdline_filter_selects_matching_processes_only(session_tracer, stub_build):
    tracer = session_tracer.source
    tracer.options.cmdline = re.compile(r"workload hold$")
    try:
        with Workload([stub_build.workload, "hold"]) as wanted, \
                Workload([stub_build.workload, "leak", "7"]) as unwanted:
            wanted_pid, unwanted_pid = wanted.wait_ready(), unwanted.wait_ready()
            # The exec notifications make the tracer look at both; only one title matches.
            assert session_tracer.pump_until(lambda: wanted_pid in tracer._selected, 5)
            session_tracer.pump(0.3)
            wanted.go()
            unwanted.go()
            wanted.read_calls()
            unwanted.read_calls()
            session_tracer.pump_until(lambda: len(session_tracer.of(wanted_pid, Kind.ALLOC)) >= 26)
            session_tracer.pump(0.3)
            assert len(session_tracer.of(wanted_pid, Kind.ALLOC, Api.cudaMalloc)) == 13
            assert session_tracer.of(unwanted_pid) == []
            assert unwanted_pid not in tracer.session.ledger.pids()
    finally:
        tracer.options.cmdline = None


def test_a_thread_that_found_its_process_selected_looks_again_after_the_filter_changes(session_tracer, stub_build):
    """Threads remember in task storage that their process is selected (the pid filter's lookup once per
    thread, not per call); every change of the filter makes them look again."""
    import sys
    from pathlib import Path

    target = Path(__file__).resolve().parent / "pytargets" / "alloc_target.py"
    harness, probes = session_tracer, session_tracer.source.probes
    harness.pump(0.05)
    with Workload([sys.executable, target, stub_build.libcudart, "--cases", "steady", "--then", "steady"]) as workload:
        pid = workload.wait_ready()
        harness.source.follow(pid)
        workload.go()
        first = workload.read_calls()
        # GIVEN its threads traced a first batch, so they remember the process selected
        assert harness.pump_until(lambda: len(harness.of(pid, Kind.ALLOC, Api.cudaMalloc)) == len(first), 10)
        filtered = harness.source.counters()["filtered"]
        # WHEN the process leaves the filter and makes a second batch
        probes.unselect_pid(pid)
        workload.go()
        second = workload.read_calls()
        harness.pump(0.3)
        # THEN none of the second batch is traced: each entry was filtered in BPF
        assert len(harness.of(pid, Kind.ALLOC, Api.cudaMalloc)) == len(first) and len(second) == len(first)
        assert harness.source.counters()["filtered"] - filtered >= 2 * len(second)  # cudaMalloc, cuMemAlloc_v2
        probes.select_pid(pid)  # as the source has it, until the process exits


def test_pid_option_puts_probes_on_that_process_only(bpf_here_unshared, stub_build):
    # GIVEN two processes on the same libraries, and a tracer told to follow one of them (-p)
    with Workload([stub_build.workload, "devices"]) as chosen, \
            Workload([stub_build.workload, "leak", "40"]) as other:
        pid = chosen.wait_ready()
        other_pid = other.wait_ready()
        harness = TracingHarness([pid], preattach_globs=(str(stub_build.lib_dir / "*.so.*"),))
        try:
            tracer = harness.source
            # THEN the probes are planted for that pid only
            attached = {path: tracer.probes.attached_pids(path) for path in tracer.probes.attached()}
            assert attached and all(pids == {pid} for pids in attached.values()), attached
            # WHEN both run (the chosen one from two threads)
            other.go()
            other.read_calls(timeout_s=60)
            chosen.go()
            calls = chosen.read_calls(timeout_s=60)
            # 3 cudaSetDevice (2 succeed, each with a cuCtxSetCurrent), 10 cudaMalloc + cuMemAlloc_v2
            expected_events = 3 + 2 + 2 * 10
            assert harness.pump_until(lambda: len(harness.of(pid)) == expected_events, 10)
            harness.pump(0.2)
            # THEN every call of the chosen process is traced, on both threads
            mallocs = harness.of(pid, Kind.ALLOC, Api.cudaMalloc)
            assert sorted((e.address, e.device) for e in mallocs) == \
                sorted((c["address"], c["device"]) for c in calls if c["api"] == "cudaMalloc")
            assert len(harness.of(pid)) == expected_events
            # AND the other process never entered a probe: nothing of it was even filtered in BPF
            counters = tracer.counters()
            assert harness.of(other_pid) == [] and counters["filtered"] == 0, counters
            assert counters["events_submitted"] == expected_events
        finally:
            harness.close()


def test_an_allocation_at_an_address_the_kernel_ledger_holds_replaces_it_and_is_counted(
        bpf_here_unshared, stub_build):
    """GIVEN kernel ledger entries at the address the workload's first cudaMalloc (and its
    cuMemAlloc_v2) will get, as a free the probes never saw would leave them, WHEN it allocates there,
    THEN each is replaced, not kept twice, and counted (ledger_replaced), and the kernel's totals, which
    held the planted entries as the probes would have, take the old out and the new in: the agent's
    totals are the workload's own."""
    from kvtrace.sources.bpf import abi

    first_address = 0x7F1000000000  # the stub driver's first device address (cuda_stub.c)
    with Workload([stub_build.workload, "hold"]) as workload:
        pid = workload.wait_ready()
        harness = TracingHarness([pid], preattach_globs=(str(stub_build.lib_dir / "*.so.*"),))
        try:
            probes = harness.source.probes
            assert probes is not None
            for layer in (Layer.RUNTIME, Layer.DRIVER):
                key = abi.RawLedgerKey(pid=pid, layer=int(layer), object=1, address=first_address)
                probes._bpf[b"ledger"][key] = abi.RawLedgerValue(size_bytes=7, device=0, api=1, memory=1)
                totals = abi.RawTotalsKey(pid=pid, device=0, layer=int(layer), memory=1)
                probes._bpf[b"ledger_totals"][totals] = abi.RawTotalsValue(size_bytes=7, count=1)
            workload.go()
            calls = workload.read_calls()
            assert calls[0]["address"] == first_address and len(calls) == 13
            assert harness.pump_until(lambda: len(harness.of(pid, Kind.ALLOC)) == 26, 10)
            assert harness.source.counters()["ledger_replaced"] == 2
            assert_ledgers_hold(harness.source, pid, calls)
        finally:
            harness.close()


def test_allocations_the_kernel_ledger_has_no_room_for_are_counted(bpf_here_unshared, stub_build):
    """GIVEN a kernel ledger of 16 entries, 8 of them taken (written by user space, so within nobody's
    share: root's alone is 12, shares.py), WHEN a process makes 20 allocations (40 entries: runtime and
    driver), THEN 8 are kept, the other 32 are counted as ledger_full, and every event is sent."""
    from kvtrace.sources.bpf import abi

    with Workload([stub_build.workload, "leak", "20"]) as workload:
        pid = workload.wait_ready()
        harness = TracingHarness([pid], settings=ProbeSettings(max_ledger_entries=16),
                                 preattach_globs=(str(stub_build.lib_dir / "*.so.*"),))
        try:
            ledger = harness.source.probes._bpf[b"ledger"]
            for number in range(8):
                key = abi.RawLedgerKey(pid=4194999, layer=2, object=1, address=0x1000 * (number + 1))
                ledger[key] = abi.RawLedgerValue(size_bytes=7, device=0, api=20, memory=1)
            workload.go()
            assert len(workload.read_calls()) == 20
            assert harness.pump_until(lambda: len(harness.of(pid, Kind.ALLOC)) == 40, 10)
            counters = harness.source.counters()
            assert counters["ledger_full"] == 32 and counters["share_full"] == 0
            assert len([e for e in harness.source.kernel_ledger() if e.key.pid == pid]) == 8
        finally:
            harness.close()
