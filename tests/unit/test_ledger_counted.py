"""A ledger that counts allocations and blocks instead of keeping them (the agent, where the kernel keeps
the exact ledger): totals exact from the events alone, entries read from the kernel when asked, memory
that does not grow with allocations, and reads bounded by --max-read-entries."""
import tracemalloc

import pytest

from kvtrace.model.events import Api, Event, Kind, Layer, Memory, ObjectKind
from kvtrace.model.ledger import COUNTED_OBJECTS, Ledger, LedgerKey, LedgerReadRefused
from kvtrace.session import Session

MiB = 1 << 20


class Kernel:
    """The kernel's side: the exact ledger (a ledger that keeps everything) and what the probes send,
    free events carrying the freed entry's size, device and memory as free_return does."""

    def __init__(self) -> None:
        self.ledger = Ledger()
        self.reads = 0

    def alloc(self, pid, layer, address, size, device=0, obj=ObjectKind.ALLOCATION, api=Api.cuMemAlloc_v2,
              ts=0, stack_id=0) -> Event:
        event = Event(kind=Kind.ALLOC, api=api, pid=pid, tid=pid, timestamp_ns=ts, layer=layer, object=obj,
                      memory=Memory.DEVICE, size_bytes=size, address=address, device=device, stack_id=stack_id)
        self.ledger.apply(event)
        return event

    def free(self, pid, layer, address, obj=ObjectKind.ALLOCATION, api=Api.cuMemFree_v2, ts=0) -> Event:
        entry = self.ledger.get(LedgerKey(pid, layer, obj, address))
        assert entry is not None
        event = Event(kind=Kind.FREE, api=api, pid=pid, tid=pid, timestamp_ns=ts, layer=layer, object=obj,
                      memory=entry.memory, size_bytes=entry.size_bytes, address=address, device=entry.device)
        self.ledger.apply(event)
        return event

    def find(self, key):
        entry = self.ledger.get(key)
        return entry if entry is not None and entry.key.object in COUNTED_OBJECTS else None

    def read(self, pids):
        self.reads += 1
        return [entry for entry in self.ledger.entries()
                if entry.key.object in COUNTED_OBJECTS and (not pids or entry.key.pid in pids)]


def counted(kernel: Kernel, max_read_entries: int = 1000) -> Ledger:
    ledger = Ledger()
    ledger.count_only(kernel.read, kernel.find, max_read_entries)
    return ledger


def test_totals_are_exact_from_events_alone_and_no_allocation_is_kept():
    kernel = Kernel()
    ledger = counted(kernel)
    for i in range(23):
        ledger.apply(kernel.alloc(1, Layer.DRIVER, 0x1000 + i * MiB, MiB, device=i % 2))
        ledger.apply(kernel.alloc(1, Layer.TORCH, 0x1000 + i * MiB, 4096, obj=ObjectKind.BLOCK,
                                  api=Api.pytorch_malloc))
    for i in range(0, 23, 2):
        ledger.apply(kernel.free(1, Layer.DRIVER, 0x1000 + i * MiB))
    assert ledger.kept_entries() == []
    assert ledger.totals() == kernel.ledger.totals()
    assert ledger.physical_device_bytes(1) == 11 * MiB
    assert ledger.physical_device_bytes(1, device=1) == 11 * MiB  # the odd ones, all on device 1
    assert ledger.counted_entries() == 11 + 23
    assert ledger.frees_total[(1, Layer.DRIVER)] == 12
    assert ledger.allocations_total[(1, Layer.TORCH)] == 23


def test_entries_are_the_kernels_and_vmm_objects_stay_kept():
    kernel = Kernel()
    ledger = counted(kernel)
    ledger.apply(kernel.alloc(1, Layer.DRIVER, 0xA000, 2 * MiB))
    handle = kernel.alloc(1, Layer.VMM, 0x77, 4 * MiB, obj=ObjectKind.VMM_HANDLE, api=Api.cuMemCreate)
    ledger.apply(handle)
    assert [entry.key.object for entry in ledger.kept_entries()] == [ObjectKind.VMM_HANDLE]
    assert sorted(entry.key.address for entry in ledger.entries()) == [0x77, 0xA000]
    assert ledger.physical_device_bytes(1) == 6 * MiB


def test_a_read_over_the_limit_is_refused_counted_and_reads_nothing():
    kernel = Kernel()
    ledger = counted(kernel, max_read_entries=10)
    for i in range(11):
        ledger.apply(kernel.alloc(1, Layer.DRIVER, 0x1000 + i, 1))
    ledger.apply(kernel.alloc(2, Layer.DRIVER, 0x9000, 1))
    with pytest.raises(LedgerReadRefused, match="raise --max-read-entries"):
        ledger.entries()
    assert ledger.reads_refused_total == 1 and kernel.reads == 0
    assert [entry.key.pid for entry in ledger.entries(pids={2})] == [2]  # one process fits


def test_exit_and_context_destroy_leave_the_counted_totals_to_what_the_kernel_dropped():
    """The source deletes the kernel's entries after the Session saw the event and says exactly what went
    (uncount): only entries as old as the event go, so a reused pid's allocation stays counted."""
    from kvtrace.model.ledger import TotalsKey

    kernel = Kernel()
    ledger = counted(kernel)
    ledger.apply(kernel.alloc(1, Layer.DRIVER, 0x1000, MiB, device=0))
    ledger.apply(kernel.alloc(1, Layer.DRIVER, 0x2000, MiB, device=1))
    ledger.apply(kernel.alloc(2, Layer.DRIVER, 0x3000, MiB))
    ledger.apply(Event(kind=Kind.CONTEXT_DESTROY, api=Api.cuCtxDestroy_v2, pid=1, tid=1, timestamp_ns=5, device=1))
    assert ledger.physical_device_bytes(1) == 2 * MiB  # until the source says what the kernel dropped
    ledger.uncount({TotalsKey(1, 1, Layer.DRIVER, Memory.DEVICE): (MiB, 1)})
    assert ledger.physical_device_bytes(1) == MiB
    ledger.apply(Event(kind=Kind.PROCESS_EXIT, api=Api.process_exit, pid=1, tid=1, timestamp_ns=6))
    ledger.apply(kernel.alloc(1, Layer.DRIVER, 0x4000, MiB, ts=7))  # a new process with that pid, at once
    ledger.uncount({TotalsKey(1, 0, Layer.DRIVER, Memory.DEVICE): (MiB, 1)})  # the exit's, older than 6
    assert ledger.physical_device_bytes(1) == MiB and ledger.physical_device_bytes(2) == MiB


def test_resync_counts_the_kernels_copy_again():
    kernel = Kernel()
    ledger = counted(kernel)
    for i in range(5):
        kernel.alloc(1, Layer.DRIVER, 0x1000 + i, MiB)  # events lost: the ledger never saw them
    ledger.apply(kernel.alloc(1, Layer.DRIVER, 0x9000, MiB))
    ledger.resync(kernel.ledger.entries())
    assert ledger.totals() == kernel.ledger.totals()
    assert ledger.kept_entries() == []


def test_a_million_counted_allocations_take_no_memory_per_allocation():
    kernel_reads = []
    ledger = Ledger()
    ledger.count_only(lambda pids: kernel_reads, lambda key: None, 1000)
    event = Event(kind=Kind.ALLOC, api=Api.cuMemAlloc_v2, pid=1, tid=1, timestamp_ns=0, layer=Layer.DRIVER,
                  object=ObjectKind.ALLOCATION, memory=Memory.DEVICE, size_bytes=4096, device=0)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for address in range(1_000_000):
        event.address = address
        ledger.apply(event)
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    print(f"ledger growth over 1 000 000 counted allocations: {grown} bytes")
    assert ledger.counted_entries() == 1_000_000
    assert grown < 64 * 1024


def test_session_streams_what_reports_go_through_and_refuses_only_a_copy_too_large():
    kernel = Kernel()
    session = Session()
    session.count_only(kernel.read, kernel.find, 3)
    for i in range(4):
        session.ingest(kernel.alloc(7, Layer.DRIVER, 0x1000 + i, MiB))
    assert sorted(entry.key.address for entry in session.outstanding()) == [0x1000, 0x1001, 0x1002, 0x1003]
    view = session.ledger_view(with_entries=True)
    assert view.find is not None and view.max_read_entries == 3
    assert len(list(view.entries or ())) == 4 and kernel.reads == 2  # each pass reads the kernel afresh
    with pytest.raises(LedgerReadRefused):
        session.subscribe(_NullSink())  # a recording's checkpoint is a copy of them all
    counters = session.counters()
    assert counters["ledger_entries_in_kernel"] == 4 and counters["ledger_reads_refused"] == 1
    session.ingest(kernel.free(7, Layer.DRIVER, 0x1000))
    checkpoint = session.subscribe(_NullSink())
    assert sorted(entry.key.address for entry in checkpoint.entries) == [0x1001, 0x1002, 0x1003]


def test_leak_survey_and_roles_over_a_stream_match_the_kept_ledger():
    """The same suspects, sites and roles from a pass over the kernel's entries (with lookups) as from
    entries held in memory, including a stackless driver allocation named by the cudaMalloc above it."""
    from kvtrace.analysis.leaks import survey_sites
    from kvtrace.analysis.roles import role_bytes

    kernel = Kernel()
    for i in range(6):
        stack = 11 if i % 2 else 0
        kernel.alloc(3, Layer.RUNTIME, 0x5000 + i, MiB, api=Api.cudaMalloc, ts=i, stack_id=stack)
        kernel.alloc(3, Layer.DRIVER, 0x5000 + i, MiB, ts=i, stack_id=stack)
    kernel.ledger.get(LedgerKey(3, Layer.RUNTIME, ObjectKind.ALLOCATION, 0x5000)).caller_address = 0xC0DE
    kept = kernel.ledger.entries()
    streamed = list(kernel.read(()))
    assert streamed and len(streamed) == len(kept)
    held = survey_sites(kept, 10**12, 0)
    passed = survey_sites(iter(streamed), 10**12, 0, find=kernel.find, with_blocks=set())
    assert passed == held
    assert any(site.stack_id == 0 and site.caller_address == 0xC0DE for site in held.site_bytes)
    roles = role_bytes(kept, lambda stack_id: None, {})
    assert role_bytes(iter(streamed), lambda stack_id: None, {}, find=kernel.find) == roles


class _NullSink:
    def publish(self, event):
        pass

    def publish_loss(self, lost_count):
        pass

    def publish_state(self, record):
        pass


def test_the_kernels_entries_decoded_in_bulk_are_those_decoded_one_by_one():
    import ctypes

    from kvtrace.sources.bpf import abi
    from kvtrace.sources.bpf.decode import (
        _LEDGER_KEY,
        _LEDGER_VALUE,
        Clock,
        decode_ledger_chunk,
        decode_ledger_entry,
    )

    assert _LEDGER_KEY.size == ctypes.sizeof(abi.RawLedgerKey)
    assert _LEDGER_VALUE.size == ctypes.sizeof(abi.RawLedgerValue)
    rows = [((7, Layer.DRIVER, ObjectKind.ALLOCATION, 0, 0xA000),
             (MiB, 5, 0xC0, 0, 8, 1, Api.cuMemAlloc_v2, 1, 0, 0, 99)),
            ((7, Layer.TORCH, ObjectKind.BLOCK, 0, 0xA100), (512, 6, 0, 3, 8, 1, Api.pytorch_malloc, 1, 0, 0, 0)),
            ((8, Layer.VMM, ObjectKind.VMM_HANDLE, 0, 0x55), (2 * MiB, 7, 0xC1, 2, 9, 0, Api.cuMemCreate, 1, 1, 0, 4)),
            ((8, Layer.VMM, ObjectKind.VMM_MAPPING, 0, 0xB000), (2 * MiB, 8, 0, 0x55, 9, 0, Api.cuMemMap, 4, 0, 0, 0))]
    keys = b"".join(_LEDGER_KEY.pack(*key) for key, _ in rows)
    values = b"".join(_LEDGER_VALUE.pack(*value) for _, value in rows)
    clock = Clock(1000)
    one_by_one = [decode_ledger_entry(abi.RawLedgerKey.from_buffer_copy(_LEDGER_KEY.pack(*key)),
                                      abi.RawLedgerValue.from_buffer_copy(_LEDGER_VALUE.pack(*value)), clock)
                  for key, value in rows]
    assert [entry for entry, _ in decode_ledger_chunk(keys, values, clock)] == one_by_one
    assert [stack for _, stack in decode_ledger_chunk(keys, values, clock)] == [99, 0, 4, 0]
    counted = frozenset(kind.value for kind in COUNTED_OBJECTS)
    assert [entry.key.address for entry, _ in decode_ledger_chunk(keys, values, clock, counted)] == [0xA000, 0xA100]
    assert [entry.key.address for entry, _ in decode_ledger_chunk(keys, values, clock, None, {8})] == [0x55, 0xB000]


def test_a_recount_takes_the_kernels_totals_and_counts_no_event_twice():
    from kvtrace.model.ledger import RECOUNT_MARGIN_NS, TotalsKey

    kernel = Kernel()
    ledger = counted(kernel)
    second = 1_000_000_000
    for i in range(5):  # their events are lost; then some arrive late, after the recount read the kernel
        kernel.alloc(1, Layer.DRIVER, 0x1000 + i, MiB, ts=i)
    late_free = kernel.free(1, Layer.DRIVER, 0x1000, ts=10)
    counted_totals = {TotalsKey(1, 0, Layer.DRIVER, Memory.DEVICE): (4 * MiB, 4)}
    ledger.recount(counted_totals, [], read_from_ns=second, read_until_ns=2 * second)
    ledger.apply(late_free)  # older than the read: the kernel's count has it already
    ledger.apply(kernel.alloc(1, Layer.DRIVER, 0x9000, MiB, ts=3 * second))  # after the read: counted
    assert ledger.physical_device_bytes(1) == 5 * MiB and ledger.recount_overlaps == 0
    ledger.apply(kernel.alloc(1, Layer.DRIVER, 0x9100, MiB, ts=second - RECOUNT_MARGIN_NS // 2))  # during it
    assert ledger.recount_overlaps == 1  # counted, and the source reads again
    assert ledger.physical_device_bytes(1) == 6 * MiB
    assert ledger.allocations_total[(1, Layer.DRIVER)] == 2 and ledger.frees_total[(1, Layer.DRIVER)] == 1


def test_count_ledger_chunk_adds_raw_entries_by_totals_key():
    from kvtrace.model.ledger import TotalsKey
    from kvtrace.sources.bpf.decode import _LEDGER_KEY, _LEDGER_VALUE, count_ledger_chunk

    raw = [((7, 2, 1, 0, 0xA000 + i), (MiB, 5, 0, 0, 8, i % 2, 20, 1, 0, 0, 0)) for i in range(5)]
    raw.append(((7, 3, 2, 0, 0x55), (MiB, 5, 0, 0, 8, 0, 40, 1, 0, 0, 0)))  # a VMM handle: not counted
    totals: dict = {}
    count_ledger_chunk(b"".join(_LEDGER_KEY.pack(*k) for k, _ in raw), b"".join(_LEDGER_VALUE.pack(*v) for _, v in raw),
                       totals, frozenset(kind.value for kind in COUNTED_OBJECTS))
    assert totals == {TotalsKey(7, 0, Layer.DRIVER, Memory.DEVICE): [3 * MiB, 3],
                      TotalsKey(7, 1, Layer.DRIVER, Memory.DEVICE): [2 * MiB, 2]}
