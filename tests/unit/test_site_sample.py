"""The analyzer's site sample (analysis/analyzer.py sample_sites) and a flight dump's checkpoint read later
(LedgerStore.entries_later), issue 31: no whole-ledger read in a turn of the agent's loop.

- one pass over the kernel's ledger gives exactly what the three passes gave (roles, sites and suspects,
  fragmentation), with no lookup in the kernel's map per entry;
- the agent's tick runs it on a thread: a slow pass never makes a slow tick, and its result is the same;
- a dump's checkpoint read after the trigger still holds the dying process's entries, and none made since."""
import threading
import time

import pytest

from kvtrace.analysis.analyzer import AnalysisOptions, Analyzer, sample_sites
from kvtrace.analysis.leaks import survey_sites
from kvtrace.analysis.roles import RoleMemo, role_bytes
from kvtrace.model.blocks import fragmentation, segments_of
from kvtrace.model.events import Api, Layer, ObjectKind
from kvtrace.model.ledger import Ledger, LedgerKey, ledger_view
from kvtrace.model.stacks import Frame, Stack, StackTable
from kvtrace.session import Session
from kvtrace.sources.bpf import kernel_ledger
from kvtrace.sources.bpf.decode import Clock
from kvtrace.sources.bpf.kernel_ledger import KernelLedger
from test_ledger_counted import Kernel, counted

MiB = 1 << 20
NS = 1_000_000_000


def _stacks() -> tuple[StackTable, int, int]:
    stacks = StackTable()
    weights = stacks.intern(Stack((Frame("load_weights", "/v/loader.py", 1), Frame("<module>", "/v/x.py", 1))))
    kv = stacks.intern(Stack((Frame("initialize_kv_cache", "/v/runner.py", 1), Frame("<module>", "/v/x.py", 1))))
    return stacks, weights, kv


def _filled_kernel(weights: int, kv: int) -> Kernel:
    """A kernel ledger with what a sample meets: cudaMalloc pairs (the driver entry without a stack, the runtime
    one with a stack or only a caller), driver allocations of their own, and a PyTorch process's segments and
    blocks, some outside any segment; old and new."""
    kernel = Kernel()
    for index in range(400):
        pid, stack = (3, weights) if index % 3 else (4, 0)
        runtime = kernel.alloc(pid, Layer.RUNTIME, 0x10_0000 + index * MiB, MiB + index, api=Api.cudaMalloc,
                               ts=index * NS, stack_id=stack)
        kernel.ledger.get(LedgerKey(pid, Layer.RUNTIME, ObjectKind.ALLOCATION, runtime.address)).caller_address = \
            0xC0DE + index % 5
        kernel.alloc(pid, Layer.DRIVER, runtime.address, MiB + index, ts=index * NS + 1)
    for index in range(50):  # driver calls with no cudaMalloc above (a stack of their own, or none)
        kernel.alloc(5, Layer.DRIVER, 0x900_0000_0000 + index * MiB, 2 * MiB, ts=index * NS,
                     stack_id=kv if index % 2 else 0)
    for segment in range(8):  # PyTorch: segments (cudaMalloc) and their blocks
        base = 0x700_0000_0000 + segment * 64 * MiB
        kernel.alloc(6, Layer.RUNTIME, base, 64 * MiB, api=Api.cudaMalloc, ts=segment * NS, stack_id=weights)
        kernel.alloc(6, Layer.DRIVER, base, 64 * MiB, ts=segment * NS)
        for block in range(6):
            kernel.alloc(6, Layer.TORCH, base + block * 4 * MiB, 3 * MiB, obj=ObjectKind.BLOCK,
                         api=Api.pytorch_malloc, ts=(segment + block) * NS, stack_id=kv if block % 2 else weights)
    kernel.alloc(6, Layer.TORCH, 0x7ff0_0000_0000, MiB, obj=ObjectKind.BLOCK, api=Api.pytorch_malloc, ts=NS,
                 stack_id=kv)  # in no segment
    return kernel


def test_one_pass_gives_exactly_what_three_passes_with_lookups_gave(monkeypatch):
    # GIVEN the kernel's ledger as the agent reads it, and the three analyses as they were (three passes, a
    # lookup in the kernel's map for each driver allocation without a stack)
    stacks, weights, kv = _stacks()
    kernel = _filled_kernel(weights, kv)
    ledger = KernelLedger(kernel, Clock(0), {weights: weights, kv: kv}, frozenset, read_limit=10_000)
    view = ledger_view(ledger, 1000 * NS, 1000 * NS)
    with_blocks = view.pids_with_blocks()
    assert with_blocks == {6}
    roles = role_bytes(view.entries or (), stacks.get, {}, RoleMemo(), ledger.find)
    survey = survey_sites(view.entries or (), view.wall_ns, 60.0, find=ledger.find, with_blocks=with_blocks)
    segments, outside = segments_of(view.entries or (), with_blocks)
    rows = {(row.pid, row.device): row for row in fragmentation(segments, outside)}
    # WHEN one pass samples them, with no lookup in the kernel's map
    reads = kernel.chunk_reads
    monkeypatch.setattr(kernel, "find_ledger_entry", lambda key: (_ for _ in ()).throw(AssertionError(key)))
    sample = sample_sites(view, {}, stacks.get, RoleMemo(), 60.0)
    # THEN the kernel's ledger was read once, and every figure is the same
    assert kernel.chunk_reads == reads + 1
    assert sample.role_bytes == roles
    assert sample.survey == survey
    assert sample.fragmentation == rows and rows[(6, 0)].blocks == 48 and rows[(6, 0)].blocks_outside_segments == 1
    assert sample.blocks == 49
    # AND the stackless driver allocations were named by the runtime call above them (stack, or caller)
    assert any(site.pid == 3 and site.stack_id == weights for site in survey.site_bytes)
    assert {site.caller_address for site in survey.site_bytes if site.pid == 4} == {0xC0DE + k for k in range(5)}


def test_one_pass_over_entries_held_in_memory_matches_too():
    # GIVEN entries built by hand (a replay, a test: no lookup, processes with blocks found in the entries)
    stacks, weights, kv = _stacks()
    kernel = _filled_kernel(weights, kv)
    kept = kernel.ledger.entries()
    view = ledger_view(kernel.ledger, 1000 * NS, 1000 * NS)
    hand_built = type(view)(view.wall_ns, view.monotonic_ns, view.totals, kept, {}, {})
    # THEN the one pass gives what the three functions give over them
    sample = sample_sites(hand_built, {}, stacks.get, RoleMemo(), 60.0)
    assert sample.role_bytes == role_bytes(kept, stacks.get, {})
    assert sample.survey == survey_sites(kept, view.wall_ns, 60.0)
    segments, outside = segments_of(kept)
    assert sample.fragmentation == {(row.pid, row.device): row for row in fragmentation(segments, outside)}


class _SlowLedger(Ledger):
    """A ledger whose pass is slow (a large kernel ledger on a busy machine): `seconds` per pass."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.passes_on: list[str] = []

    def stream(self, pids=(), background=False):
        kept = self.kept(pids)

        def slow():
            self.passes_on.append(threading.current_thread().name)
            for entry in kept:
                time.sleep(self.seconds / max(len(kept), 1))
                yield entry

        return slow()


def test_the_agents_tick_samples_sites_on_a_thread_and_takes_the_same_result_later():
    # GIVEN an analyzer over a ledger whose pass takes 1.5 s
    stacks, weights, kv = _stacks()
    ledger = _SlowLedger(1.5)
    for entry in _filled_kernel(weights, kv).ledger.entries()[:300]:
        ledger._insert(entry)
    session = Session(ledger=ledger)
    session.stacks = stacks
    analyzer = Analyzer(session, AnalysisOptions(interval_seconds=0.0, leak_min_age_seconds=0.0))
    # WHEN the loop ticks while the sample is due
    started = time.monotonic()
    analyzer.tick()
    ticks = 1
    while not analyzer.site_growth and time.monotonic() - started < 30:
        began = time.monotonic()
        analyzer.tick()
        ticks += 1
        # THEN no tick waits for the pass
        assert time.monotonic() - began < 0.5
        time.sleep(0.01)
    assert time.monotonic() - started >= 1.0 and ticks > 10
    assert ledger.passes_on == ["kvtrace-sites"]
    # AND a later tick took its result: the same as a sample made in place
    ledger.seconds = 0.0
    in_place = Analyzer(session, AnalysisOptions(interval_seconds=0.0, leak_min_age_seconds=0.0))
    snapshot = in_place.update(session.ledger_view(True))
    assert analyzer.site_growth.keys() == in_place.site_growth.keys()
    assert analyzer.latest is not None and snapshot.suspects
    assert [(s.pid, s.stack_id, s.outstanding_bytes, s.count) for s in analyzer.latest.suspects] == \
        [(s.pid, s.stack_id, s.outstanding_bytes, s.count) for s in snapshot.suspects]
    assert {(r.pid, r.device): r.role_bytes for r in analyzer.latest.processes} == \
        {(r.pid, r.device): r.role_bytes for r in snapshot.processes}
    # AND the next sample waits: paced to its share of a core
    assert not analyzer.site_sample_due(time.monotonic_ns())


def test_a_checkpoint_read_after_an_exit_keeps_the_dying_process_and_nothing_made_since():
    # GIVEN pid 7 holding three allocations in the kernel's ledger, pid 8 one, and pid 9 gone before
    kernel = Kernel()
    ledger = counted(kernel)
    for index in range(3):
        ledger.apply(kernel.alloc(7, Layer.DRIVER, 0x7000 + index, MiB, ts=index + 1))
    ledger.apply(kernel.alloc(8, Layer.DRIVER, 0x8000, MiB, ts=5))
    ledger.apply(kernel.alloc(9, Layer.DRIVER, 0x9000, MiB, ts=5))
    ledger.drop(9, before_wall_ns=10)
    # WHEN a dump's checkpoint is taken at pid 7's death (before its exit drops what it held)
    read = ledger.entries_later()
    # AND its exit is dropped, the agent's collection runs, and pid 8 allocates again, before the read
    ledger.drop(7, before_wall_ns=20)
    ledger.collect(1.0)
    ledger.apply(kernel.alloc(8, Layer.DRIVER, 0x8001, MiB, ts=time.monotonic_ns() + 60 * NS))
    # THEN the read holds what was there at the death: pid 7's three and pid 8's first, not pid 9's (gone before)
    assert sorted(entry.key.address for entry in read()) == [0x7000, 0x7001, 0x7002, 0x8000]
    # AND the collection waited for it, and deletes pid 7's entries after
    assert len(kernel.counted()) == 6
    ledger.collect(1.0)
    assert sorted(entry.key.address for entry in kernel.counted()) == [0x8000, 0x8001]


def test_a_later_read_goes_through_the_processes_followed_at_the_trigger():
    # GIVEN an agent following pids 7 and 8 by their command lines (--cmdline), 7 holding three allocations
    followed = {7, 8}
    kernel = Kernel()
    ledger = KernelLedger(kernel, Clock(0), {11: 11, 99: 99}, lambda: frozenset(followed), read_limit=1000)
    for index in range(3):
        ledger.apply(kernel.alloc(7, Layer.DRIVER, 0x7000 + index, MiB, ts=index + 1))
    ledger.apply(kernel.alloc(8, Layer.DRIVER, 0x8000, MiB, ts=5))
    # WHEN pid 7's death readies a dump's checkpoint, and its exit takes it out of the followed set before the read
    read = ledger.entries_later()
    followed.discard(7)
    ledger.drop(7, before_wall_ns=20)
    # THEN the read still holds the dead process's entries
    assert sorted(entry.key.address for entry in read()) == [0x7000, 0x7001, 0x7002, 0x8000]


def test_a_read_that_never_comes_holds_collection_no_longer_than_its_time(monkeypatch):
    kernel = Kernel()
    ledger = counted(kernel)
    ledger.apply(kernel.alloc(7, Layer.DRIVER, 0x7000, MiB, ts=1))
    monkeypatch.setattr(kernel_ledger, "HOLD_SECONDS", 0.0)
    ledger.entries_later()  # (its dump never written: the read never called)
    ledger.drop(7, before_wall_ns=20)
    ledger.collect(1.0)
    assert kernel.counted() == []


def test_a_later_read_names_the_dead_processs_stacks_as_at_the_trigger_and_fails_once_the_maps_close():
    # GIVEN pid 7 holding an allocation whose stack the agent named (kernel stack 11 -> 11)
    stack_ids = {11: 11, 99: 99}
    kernel = Kernel()
    ledger = KernelLedger(kernel, Clock(0), stack_ids, frozenset, read_limit=1000)
    ledger.apply(kernel.alloc(7, Layer.DRIVER, 0x7000, MiB, ts=1, stack_id=11))
    # WHEN its death readies a checkpoint, and its exit forgets its stacks' names before the read
    read = ledger.entries_later()
    ledger.drop(7, before_wall_ns=20)
    del stack_ids[11]
    # THEN the read names its stack as at the trigger
    assert [(entry.key.address, entry.stack_id) for entry in read()] == [(0x7000, 11)]
    # AND a read that comes after the probes' maps closed fails, saying so, rather than read them
    later = ledger.entries_later()
    ledger.detached()
    with pytest.raises(kernel_ledger.LedgerClosed, match="maps closed. before the ledger was read"):
        later()


def test_the_runtime_index_of_a_pass_holds_under_a_hundred_bytes_an_allocation():
    """A site sample keeps every runtime allocation's stack and caller until its pass ends (RuntimeIndex): with
    1 000 000 cudaMalloc that was 260 MiB of agent RSS. Entries made one at a time as a pass decodes them (their
    numbers are the index's to keep or let go); found again by key, stack and caller exact."""
    import tracemalloc

    from kvtrace.analysis.leaks import RuntimeIndex
    from kvtrace.model.events import Memory
    from kvtrace.model.ledger import Outstanding

    count, base = 100_000, 0x7F00_0000_0000

    def entry(i: int) -> Outstanding:
        return Outstanding(LedgerKey(int(f"{4242 + i % 3}"), Layer.RUNTIME, ObjectKind.ALLOCATION, base + i * 4096),
                           4096, 1, 0, Api.cudaMalloc, Memory.DEVICE, tid=4242,
                           caller_address=0x5555_0000_0000 + i % 7, stack_id=int(f"{10 + i % 5}"))

    index = RuntimeIndex()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i in range(count):
        index.add(entry(i))
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    print(f"runtime index: {grown / count:.0f} bytes an allocation")
    assert grown / count < 100
    for i in (0, 1, 2, 99_999):
        key = entry(i).key
        above = index.find(key)
        assert above is not None and above.stack_id == 10 + i % 5 and above.caller_address == 0x5555_0000_0000 + i % 7
        assert index.stack(key.pid, key.address) == 10 + i % 5
    assert index.find(LedgerKey(4242, Layer.RUNTIME, ObjectKind.ALLOCATION, base + 1)) is None
    assert index.find(LedgerKey(4242, Layer.DRIVER, ObjectKind.ALLOCATION, base)) is None
