"""Issue 31, attacks 2, 3 and 6: what one unprivileged user can fill is its share, not everybody's, and the
figures its process chooses are bounded where they enter.

The attacker is a uid made for the test (no account: setpriv gives the process a uid nobody else uses on
this host, so that its share is its own) running tests/integration/stubs/hog.c: CUDA entry points of its own
that allocate nothing (made-up addresses, any device ordinal, 2^62-byte sizes), or dlopen of copies of the
stub libcudart. A root workload started during the attack must be traced exactly.
"""
from __future__ import annotations

import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from cuda_stubs import _CFLAGS, STUBS_DIR, Workload, _gcc
from harness import TracingHarness, require_tracing_here
from kvtrace.cli.doctor import process_findings
from kvtrace.model.events import Api, Kind, Layer, Memory
from kvtrace.servers.metrics import KvtraceCollector
from kvtrace.sources.bpf.loader import ProbeSettings
from kvtrace.sources.bpf.shares import (
    MAX_SHARED_UIDS,
    UID_USERS,
    RawShare,
    Share,
    decode_shares,
    max_object_bytes,
    share_batch,
)
from kvtrace.wire.agent import process_to_proto

ATTACKER_UID = 61_000 + os.getpid() % 1000  # a uid no account and no other test on this host uses
LEDGER_ENTRIES, TOTALS_KEYS = 4096, 1024  # small maps: a share (a quarter) is 1024 entries, 256 keys
DEVICES, HUGE, FILL = 100, 200, 3000  # the attacker's calls: 3 300 allocations, 37 ordinals out of range
MAX_LIBRARIES = 8  # a user's share: 2 libraries; the users' together: 4


@pytest.fixture(scope="module")
def hog(stub_build) -> Path:
    """hog.c built where the attacker's uid can run it, next to copies of the stub libraries."""
    directory = Path(tempfile.mkdtemp(prefix="kvtrace-hog-", dir="/tmp"))
    directory.chmod(0o755)
    program = directory / "hog"
    _gcc(*_CFLAGS, "-o", program, STUBS_DIR / "hog.c", "-ldl")
    for path in (program,):
        path.chmod(path.stat().st_mode | stat.S_IROTH | stat.S_IXOTH)
    yield program
    shutil.rmtree(directory, ignore_errors=True)


def as_attacker(*argv) -> list[str]:
    return ["setpriv", f"--reuid={ATTACKER_UID}", f"--regid={ATTACKER_UID}", "--clear-groups", *map(str, argv)]


@pytest.fixture
def tracer(stub_build):
    require_tracing_here()
    harness = TracingHarness(only_selected=True, preattach_globs=(str(stub_build.lib_dir / "*.so.*"),),
                             settings=ProbeSettings(max_ledger_entries=LEDGER_ENTRIES, max_totals=TOTALS_KEYS),
                             max_libraries=MAX_LIBRARIES)
    yield harness
    harness.close()


def _agent_libraries(harness) -> tuple[frozenset[tuple[int, int]], str]:
    """What doctor --pid reads from a running agent: its attached files, and why libraries wait."""
    return (frozenset((lib.device, lib.inode) for lib in harness.source.attached_libraries()),
            next((c.reason for c in harness.session.components() if c.name == "libraries" and not c.up), ""))


def _attached(harness, pid: int) -> bool:
    return any(pid in library.pids for library in harness.source.attached_libraries())


def test_a_user_filling_the_kernel_ledger_is_refused_alone_and_a_root_workload_is_traced_exactly(
        tracer, stub_build, hog):
    harness = tracer
    share = Share(LEDGER_ENTRIES).user
    with Workload(as_attacker(hog, "alloc", DEVICES, HUGE, FILL)) as attacker:
        attacker_pid = attacker.wait_ready()
        harness.source.follow(attacker_pid)
        assert harness.pump_until(lambda: _attached(harness, attacker_pid), timeout_seconds=10)
        # WHEN the attacker makes 3 300 allocations at made-up addresses: 100 on ordinals 0..99, 200 of 2^62 bytes
        attacker.go()
        attacker.expect_line("done")
        # AND a root workload starts during the attack
        with Workload([stub_build.workload, "hold"]) as workload:
            pid = workload.wait_ready()
            harness.source.follow(pid)
            workload.go()
            calls = workload.read_calls()
            assert harness.pump_until(lambda: len(harness.of(pid, Kind.ALLOC)) >= 2 * len(calls), 10)
            harness.pump(1.2)  # a report: counters and shares read
            counters = harness.source.counters()
            users = {user.uid: user for user in decode_shares(harness.source.probes.read_shares(False), False)}
            processes = {p.pid: p for p in decode_shares(harness.source.probes.read_shares(True), True)}
            held = [e for e in harness.session.outstanding([attacker_pid])]
            root_held = {(e.key.layer, e.key.address): e for e in harness.session.outstanding([pid])}
            totals = {(t.device, t.layer, t.memory): (t.size_bytes, t.object_count)
                      for process in harness.session.processes_holding_memory() if process.pid == pid
                      for t in process.totals}
            listed = {process.pid for process in harness.session.processes_holding_memory()}
            messages = [process_to_proto(process) for process in harness.session.processes_holding_memory()]
            components = {c.name: c for c in harness.session.components()}
            registry = CollectorRegistry()
            registry.register(KvtraceCollector(harness.session, _NoAnalysis()))
            scrape = generate_latest(registry)
            workload.finish()
        attacker.finish()
    harness.pump(0.5)  # its exit
    after_exit = {user.uid: user for user in decode_shares(harness.source.probes.read_shares(False), False)}
    records_after_exit = {p.pid for p in decode_shares(harness.source.probes.read_shares(True), True)}
    print(f"\nattacker: {len(held)} of {DEVICES + HUGE + FILL} allocations held, "
          f"{users[ATTACKER_UID].refused_entries} refused; share_full {counters['share_full']}, "
          f"devices_clamped {counters['devices_clamped']}, sizes_clamped {counters['sizes_clamped']}; "
          f"root: {len(root_held)} of 26 held; /metrics samples {len(scrape)} bytes")
    # THEN the root workload is traced exactly: every call, every byte, on device 0, and listed
    mallocs = harness.of(pid, Kind.ALLOC, Api.cudaMalloc)
    assert [(e.address, e.size_bytes, e.device) for e in mallocs] == [
        (c["address"], c["size_bytes"], 0) for c in calls]
    assert len(harness.of(pid, Kind.ALLOC, Api.cuMemAlloc_v2)) == 13 and len(root_held) == 26
    assert totals[(0, Layer.DRIVER, Memory.DEVICE)] == (13 << 20, 13) and pid in listed
    # AND the attacker holds exactly its share; the rest of its calls are counted, not stored, and it is named
    assert len(held) == share == users[ATTACKER_UID].ledger_entries == processes[attacker_pid].ledger_entries
    assert users[ATTACKER_UID].refused_entries == DEVICES + HUGE + FILL - share == counters["share_full"]
    assert processes[attacker_pid].refused_entries == DEVICES + HUGE + FILL - share
    assert not components["shares"].up and f"uid {ATTACKER_UID} holds 1024 of its 1024 ledger entries" in \
        components["shares"].reason and f"pid {attacker_pid}" in components["shares"].reason
    assert f'kvtrace_share_refused_total{{resource="ledger",user="{ATTACKER_UID}"}} 2276.0'.encode() in scrape
    assert len(scrape) < 64 << 10  # /metrics stays small: the attacker's 65 GPUs are 8 series and "other"
    # AND the figures it chose were bounded where they entered: 36 ordinals kept as unknown, sizes at the bound
    assert counters["devices_clamped"] == DEVICES + 1 - 64 and counters["sizes_clamped"] == HUGE
    assert {e.device for e in held} == {-1, *range(64)}
    assert max(e.size_bytes for e in held) == max_object_bytes(LEDGER_ENTRIES)
    # AND its exit gave its share back at once (its records released in the exit probe)
    assert after_exit[ATTACKER_UID].ledger_entries == 0 and after_exit[ATTACKER_UID].totals_keys == 0
    assert attacker_pid not in records_after_exit and pid not in records_after_exit
    # AND every process's report converts (no figure out of a field's range)
    assert {message.pid for message in messages} >= {pid, attacker_pid}


class _NoAnalysis:
    latest = None


def test_a_new_user_with_the_table_of_users_full_is_charged_to_every_users_record_not_refused(tracer, stub_build,
                                                                                              hog):
    """uid_shares is never freed: with it full, a new user's processes are charged to every user's record (counted),
    not refused; root's and that record were made when the probes loaded."""
    harness = tracer
    probes = harness.source.probes
    made = {uid for uid, _ in probes.read_shares(False)}
    table = probes._bpf[b"uid_shares"]
    # GIVEN the table full of other users' records
    for uid in range(100_000, 100_000 + MAX_SHARED_UIDS - len(made)):
        table[table.Key(uid)] = table.Leaf.from_buffer_copy(RawShare(uid=uid))
    # WHEN a new user allocates
    with Workload(as_attacker(hog, "alloc", 2, 0, 9)) as attacker:
        attacker_pid = attacker.wait_ready()
        harness.source.follow(attacker_pid)
        assert harness.pump_until(lambda: _attached(harness, attacker_pid), timeout_seconds=10)
        attacker.go()
        attacker.expect_line("done")
        harness.pump(0.5)
        counters = harness.source.counters()
        users = dict(probes.read_shares(False))
        process = dict(probes.read_shares(True))[attacker_pid]
        held = list(harness.session.outstanding([attacker_pid]))
        attacker.finish()
    # THEN root's and every user's records were there from the load, and its 11 allocations are held, charged there
    assert {0, UID_USERS} <= made and ATTACKER_UID not in users
    assert len(held) == 11 and process.ledger_entries == 11 and process.uid == UID_USERS
    assert users[UID_USERS].ledger_entries == share_batch(LEDGER_ENTRIES) and users[UID_USERS].pids == 1
    assert counters["share_uids_full"] == 1 and counters["share_full"] == 0


def test_entries_the_agent_deletes_of_a_live_process_go_back_to_its_share(tracer, stub_build):
    """A context destroy's entries (and the blocks of a process lowered to segments) are deleted by the agent, not
    by a probe: the process's share gets them back at once (shares.h kvt_share_return), or a long-lived root
    engine would stay charged for entries long gone and at last be refused."""
    harness = tracer
    with Workload([stub_build.workload, "hold"]) as workload:
        pid = workload.wait_ready()
        harness.source.follow(pid)
        workload.go()
        calls = workload.read_calls()
        assert harness.pump_until(lambda: len(harness.of(pid, Kind.ALLOC)) >= 2 * len(calls), 10)
        before = dict(harness.source.probes.read_shares(True))[pid]
        held = before.ledger_entries
        # WHEN the agent deletes its entries on device 0 itself (what a context destroy does)
        harness.source.kernel_store.drop(pid, harness.source.clock.wall_ns(time.monotonic_ns()), device=0)
        after = dict(harness.source.probes.read_shares(True))[pid]
        left = list(harness.source.probes.iter_ledger_items())
        workload.finish()
    # THEN its record holds none of them, and it keeps at most two batches charged above that
    assert held == 2 * len(calls) and not [key for key, _ in left if key.pid == pid]
    assert after.ledger_entries == 0 and 0 <= after.charged <= 2 * share_batch(LEDGER_ENTRIES)
    assert harness.source.probes.shares_not_given_total == 0


def test_one_users_library_copies_take_its_share_of_slots_and_root_is_still_traced(tracer, stub_build, hog):
    harness = tracer
    copies = Path(tempfile.mkdtemp(prefix="kvtrace-copies-", dir="/tmp"))
    copies.chmod(0o755)
    try:
        shutil.copy(stub_build.libcuda, copies / "libcuda.so.1")
        paths = []
        for number in range(10):
            path = copies / f"libcudart-{number}.so.12"
            shutil.copy(stub_build.libcudart, path)
            paths.append(path)
        for path in copies.iterdir():
            path.chmod(0o755)
        # GIVEN the attacker maps 11 libraries of its own (10 copies of libcudart and a libcuda)
        with Workload(as_attacker(hog, "libs", *paths)) as attacker:
            attacker_pid = attacker.wait_ready()
            harness.source.follow(attacker_pid)
            attacker.go()
            attacker.expect_line("done")
            harness.source.targets.scan_pid(attacker_pid)
            harness.pump(0.5)
            theirs = [lib for lib in harness.source.attached_libraries() if attacker_pid in lib.pids]
            # WHEN another of its processes (a program with no CUDA of its own) maps only a fresh copy of both
            late_dir = copies / "late"
            late_dir.mkdir(mode=0o755)
            late = late_dir / "libcudart.so.12"
            for source, target in ((stub_build.libcudart, late), (stub_build.libcuda, late_dir / "libcuda.so.1"),
                                   (stub_build.dlopen_workload, copies / "loader")):
                shutil.copy(source, target)
                target.chmod(0o755)
            with Workload(as_attacker(copies / "loader", late)) as second:
                second_pid = second.wait_ready()
                harness.source.follow(second_pid)
                second.go()
                second.expect_line("loaded")
                harness.source.targets.scan_pid(second_pid)
                harness.pump(1.2)
                second_findings = {f.name: f.message for f in process_findings(second_pid, _agent_libraries(harness))}
                # AND a root process loads a newly installed libcudart
                root_dir = Path(tempfile.mkdtemp(prefix="kvtrace-root-"))
                shutil.copy(stub_build.libcudart, root_dir / "libcudart.so.12")
                shutil.copy(stub_build.libcuda, root_dir / "libcuda.so.1")
                with Workload([stub_build.dlopen_workload, root_dir / "libcudart.so.12"]) as workload:
                    pid = workload.wait_ready()
                    harness.source.follow(pid)
                    workload.go()
                    workload.expect_line("loaded")
                    inode = os.stat(root_dir / "libcudart.so.12").st_ino
                    assert harness.pump_until(lambda: any(lib.inode == inode for lib in
                                                          harness.source.attached_libraries()), 10)
                    workload.go()
                    calls = workload.read_calls()
                    harness.pump_until(lambda: len(harness.of(pid, Kind.ALLOC, Api.cudaMalloc)) >= 17)
                    harness.pump(1.2)  # a report
                    root_findings = {f.name: f.message for f in process_findings(pid, _agent_libraries(harness))}
                shutil.rmtree(root_dir, ignore_errors=True)
                second.finish()
            attacker.finish()
    finally:
        shutil.rmtree(copies, ignore_errors=True)
    waiting = dict(harness.source.targets.waiting_why)
    print(f"\nattacker's libraries attached: {len(theirs)} of 11; waiting {len(waiting)}; "
          f"second: {second_findings[f'pid {second_pid} cuda']}")
    # THEN the attacker's processes hold exactly its share (2 of 8 slots), the rest wait, named with their user
    assert len(theirs) == 2
    assert waiting[str(late)] == f"uid {ATTACKER_UID} holds its share of library slots (2: a quarter of " \
                                 f"--max-libraries 8)"
    # AND doctor --pid says the truth: the process that maps only a waiting copy is not traced
    assert second_findings[f"pid {second_pid} cuda"].startswith(
        f"not traced: waiting for a library slot ({late.parent / 'libcuda.so.1'}, {late}: no probes in the running "
        f"agent, which says: 12 libraries wait for probes")
    assert f"(uid {ATTACKER_UID} holds its share of library slots" in second_findings[f"pid {second_pid} cuda"]
    assert "fix: stop the processes that hold the slots" in second_findings[f"pid {second_pid} cuda"]
    # AND root's process is traced exactly (17 of 17 cudaMalloc)
    mallocs = harness.of(pid, Kind.ALLOC, Api.cudaMalloc)
    assert [(e.address, e.size_bytes) for e in mallocs] == [(c["address"], c["size_bytes"]) for c in calls]
    assert root_findings[f"pid {pid} cuda"].startswith("traced: ")
