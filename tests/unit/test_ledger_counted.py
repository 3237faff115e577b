"""The kernel's ledger as the agent sees it (sources/bpf/kernel_ledger.py KernelLedger): it keeps neither the
entries nor the totals of allocations and blocks, which the kernel keeps; totals exact whatever events are lost,
entries read from the kernel's maps when asked, memory that does not grow with allocations, reads bounded by
--max-read-entries, and what the agent deletes from the kernel taken out of the totals at once."""
import tracemalloc

import pytest

from kvtrace.model.events import Api, Event, Kind, Layer, Memory, ObjectKind
from kvtrace.model.ledger import Ledger, LedgerKey, LedgerReadRefused, TotalsKey
from kvtrace.session import Session
from kvtrace.sources.bpf import abi
from kvtrace.sources.bpf import kernel_ledger as kernel_ledger_module
from kvtrace.sources.bpf.decode import _LEDGER_KEY, _LEDGER_VALUE, Clock
from kvtrace.sources.bpf.kernel_ledger import COUNTED_OBJECTS, KernelLedger

MiB = 1 << 20


class Kernel:
    """The kernel's side, as raw maps (sources/bpf/kernel_ledger.py KernelMaps): the exact ledger (a ledger that
    keeps everything), the totals the probes change with each insert and delete of an allocation or block
    (ledger_totals), and what the probes send: free events carrying the freed entry's size, device and memory
    as free_return does. Times are the kernel's = the agent's (Clock(0)); kernel stack ids are the stack ids."""

    def __init__(self) -> None:
        self.ledger = Ledger()
        self.totals_map: dict[TotalsKey, list[int]] = {}
        self.chunk_reads = 0
        self.totals_reads = 0
        self.key_lookups = 0
        self.given: dict[int, int] = {}  # pid -> entries the agent deleted and gave back to its share

    def _probe_changes(self, pid, device, layer, memory, size, count) -> None:
        total = self.totals_map.setdefault(TotalsKey(pid, device, layer, memory), [0, 0])
        total[0] += size
        total[1] += count

    def alloc(self, pid, layer, address, size, device=0, obj=ObjectKind.ALLOCATION, api=Api.cuMemAlloc_v2,
              ts=0, stack_id=0) -> Event:
        event = Event(kind=Kind.ALLOC, api=api, pid=pid, tid=pid, timestamp_ns=ts, layer=layer, object=obj,
                      memory=Memory.DEVICE, size_bytes=size, address=address, device=device, stack_id=stack_id)
        self.ledger.apply(event)
        if obj in COUNTED_OBJECTS:
            self._probe_changes(pid, device, layer, Memory.DEVICE, size, 1)
        return event

    def free(self, pid, layer, address, obj=ObjectKind.ALLOCATION, api=Api.cuMemFree_v2, ts=0) -> Event:
        entry = self.ledger.get(LedgerKey(pid, layer, obj, address))
        assert entry is not None
        event = Event(kind=Kind.FREE, api=api, pid=pid, tid=pid, timestamp_ns=ts, layer=layer, object=obj,
                      memory=entry.memory, size_bytes=entry.size_bytes, address=address, device=entry.device)
        self.ledger.apply(event)
        self._probe_changes(pid, entry.device, layer, entry.memory, -entry.size_bytes, -1)
        return event

    def counted(self) -> list:
        return [entry for entry in self.ledger.entries() if entry.key.object in COUNTED_OBJECTS]

    @staticmethod
    def _raw(entry) -> tuple[bytes, bytes]:
        key = _LEDGER_KEY.pack(entry.key.pid, entry.key.layer.value, entry.key.object.value, 0, entry.key.address)
        value = _LEDGER_VALUE.pack(entry.size_bytes, entry.timestamp_ns, entry.caller_address, entry.stream,
                                   entry.tid, entry.device, entry.api.value, entry.memory.value, 0, 0, 0, 0,
                                   entry.stack_id)
        return key, value

    # ---- KernelMaps ----

    def iter_ledger_chunks(self):
        self.chunk_reads += 1
        raws = [self._raw(entry) for entry in self.ledger.entries()]
        yield b"".join(key for key, _ in raws), b"".join(value for _, value in raws)

    def find_ledger_entry(self, raw_key):
        entry = self.ledger.get(LedgerKey(raw_key.pid, Layer(raw_key.layer), ObjectKind(raw_key.object),
                                          raw_key.address))
        if entry is None:
            return None
        key, value = self._raw(entry)
        return abi.RawLedgerKey.from_buffer_copy(key), abi.RawLedgerValue.from_buffer_copy(value)

    def delete_ledger_keys(self, raw_keys):
        """The agent's deletions: not through the probes, so the totals keep what went."""
        deleted = []
        for raw_key in raw_keys:
            entry = self.ledger.get(LedgerKey(raw_key.pid, Layer(raw_key.layer), ObjectKind(raw_key.object),
                                              raw_key.address))
            if entry is not None:
                self.ledger._remove(entry)
            deleted.append(entry is not None)
        return deleted

    def _raw_totals(self, items):
        return [(abi.RawTotalsKey(pid=key.pid, device=key.device, layer=key.layer.value, memory=key.memory.value),
                 abi.RawTotalsValue(size_bytes=size, count=count)) for key, (size, count) in items]

    def read_totals(self):
        self.totals_reads += 1
        return self._raw_totals(self.totals_map.items())

    @staticmethod
    def _key(raw) -> TotalsKey:
        return TotalsKey(raw.pid, raw.device, Layer(raw.layer), Memory(raw.memory))

    def totals_of(self, raw_keys):
        self.key_lookups += len(raw_keys)
        return self._raw_totals([(self._key(raw), self.totals_map[self._key(raw)]) for raw in raw_keys
                                 if self._key(raw) in self.totals_map])

    def take_totals(self, raw_keys):
        self.key_lookups += len(raw_keys)
        taken = {self._key(raw): self.totals_map.pop(self._key(raw)) for raw in raw_keys
                 if self._key(raw) in self.totals_map}
        return self._raw_totals(taken.items())

    def give_shares(self, entries):
        for pid, count in entries.items():
            self.given[pid] = self.given.get(pid, 0) + count

    def kernel_totals(self) -> dict:
        """The exact totals of what the kernel's ledger holds now (counted objects)."""
        return {key: total for key, total in self.ledger.totals().items() if key.layer is not Layer.VMM}


def counted(kernel: Kernel, max_read_entries: int = 1000) -> KernelLedger:
    return KernelLedger(kernel, Clock(0), {11: 11, 99: 99}, frozenset, read_limit=max_read_entries)


def test_totals_are_the_kernels_and_no_allocation_is_kept():
    kernel = Kernel()
    ledger = counted(kernel)
    for i in range(23):
        ledger.apply(kernel.alloc(1, Layer.DRIVER, 0x1000 + i * MiB, MiB, device=i % 2))
        ledger.apply(kernel.alloc(1, Layer.TORCH, 0x1000 + i * MiB, 4096, obj=ObjectKind.BLOCK,
                                  api=Api.pytorch_malloc))
    for i in range(0, 23, 2):
        ledger.apply(kernel.free(1, Layer.DRIVER, 0x1000 + i * MiB))
    assert ledger.kept() == []
    assert ledger.totals() == kernel.ledger.totals()
    assert ledger.physical_device_bytes(1) == 11 * MiB
    assert ledger.physical_device_bytes(1, device=1) == 11 * MiB  # the odd ones, all on device 1
    assert ledger.counted_entries() == 11 + 23
    assert ledger.frees_total[(1, Layer.DRIVER)] == 12
    assert ledger.allocations_total[(1, Layer.TORCH)] == 23


@pytest.mark.parametrize("counting", [True, False], ids=["counting", "kept"])
def test_apply_many_leaves_the_ledger_as_apply_one_at_a_time(counting, monkeypatch):
    """The Session hands runs of events to apply_many (its fast path where the kernel keeps allocations):
    every total, counter and kept object must end as applying them one by one leaves them."""
    monkeypatch.setattr(kernel_ledger_module, "TOTALS_MAX_AGE_NS", 10**15)  # only a change makes a read
    kernel = Kernel()
    events = []
    for i in range(23):
        events.append(kernel.alloc(1 + i % 2, Layer.DRIVER, 0x1000 + i * MiB, MiB, device=i % 2))
        events.append(kernel.alloc(1, Layer.TORCH, 0x1000 + i * MiB, 4096, obj=ObjectKind.BLOCK,
                                   api=Api.pytorch_malloc))
    events.append(kernel.alloc(1, Layer.VMM, 0x77, 4 * MiB, obj=ObjectKind.VMM_HANDLE, api=Api.cuMemCreate))
    events += [kernel.free(1 + i % 2, Layer.DRIVER, 0x1000 + i * MiB) for i in range(0, 23, 2)]
    events.append(Event(kind=Kind.FREE_UNKNOWN, api=Api.cuMemFree_v2, pid=1, tid=1, timestamp_ns=0,
                        layer=Layer.DRIVER, object=ObjectKind.ALLOCATION, memory=Memory.DEVICE, address=0x5))
    events.append(Event(kind=Kind.ALLOC_FAILED, api=Api.cuMemAlloc_v2, pid=2, tid=2, timestamp_ns=0,
                        layer=Layer.DRIVER, object=ObjectKind.ALLOCATION, memory=Memory.DEVICE, error_code=2))
    one, many = (counted(kernel), counted(kernel)) if counting else (Ledger(), Ledger())
    for event in events:
        one.apply(event)
    many.totals()
    reads = kernel.totals_reads
    many.apply_many(events)
    assert many.totals() == one.totals() == kernel.ledger.totals()
    assert kernel.totals_reads == reads + (2 if counting else 0)  # the run made the next use read again
    assert (many.allocations_total, many.frees_total, many.unknown_frees_total, many.failures_total) == \
        (one.allocations_total, one.frees_total, one.unknown_frees_total, one.failures_total)
    assert many.allocations_total[(1, Layer.TORCH)] == 23 and many.frees_total[(1, Layer.DRIVER)] == 12
    assert [entry.key for entry in many.kept()] == [entry.key for entry in one.kept()]
    with pytest.raises(ValueError, match="without layer"):  # a source's bug is still refused, not counted
        many.apply_many([Event(kind=Kind.ALLOC, api=Api.cuMemAlloc_v2, pid=1, tid=1, timestamp_ns=0,
                               object=ObjectKind.ALLOCATION, memory=Memory.DEVICE)])


def test_lost_events_leave_the_totals_exact_and_a_read_is_reused_until_something_changes(monkeypatch):
    monkeypatch.setattr(kernel_ledger_module, "TOTALS_MAX_AGE_NS", 10**15)  # no read gets old meanwhile
    kernel = Kernel()
    ledger = counted(kernel)
    assert ledger.physical_device_bytes(1) == 0 and kernel.totals_reads == 1  # the first read: of all (keys unknown)
    ledger.apply(kernel.alloc(1, Layer.DRIVER, 0x9000, MiB))
    reads = kernel.totals_reads
    assert ledger.physical_device_bytes(1) == MiB  # one process's, by the one key its event named
    assert kernel.totals_reads == reads and kernel.key_lookups == 1
    assert ledger.counted_entries() == 1 and ledger.counted_entries() == 1
    assert kernel.totals_reads == reads + 1  # nothing changed since: the last read of all serves
    for i in range(5):
        kernel.alloc(1, Layer.DRIVER, 0x1000 + i, MiB)  # events lost: the ledger never saw them
    kernel.free(1, Layer.DRIVER, 0x9000)  # and this free's too
    ledger.apply(kernel.alloc(1, Layer.DRIVER, 0xA000, MiB))  # an event read again after
    assert ledger.physical_device_bytes(1) == 6 * MiB
    kernel.alloc(1, Layer.DRIVER, 0xB000, MiB, device=1)  # lost, on a device no event of pid 1 named
    ledger.note_events_lost()  # (the source, as the probes' loss counter goes up)
    assert ledger.physical_device_bytes(1) == 7 * MiB  # a read of all names that key
    assert ledger.physical_device_bytes(1, device=1) == MiB
    kernel.alloc(1, Layer.DRIVER, 0xC000, MiB)  # lost, and no event after it
    monkeypatch.setattr(kernel_ledger_module, "TOTALS_MAX_AGE_NS", 0)
    assert ledger.counted_entries() == 8  # read again once the last read is too old
    assert ledger.totals() == kernel.ledger.totals()


def test_entries_are_the_kernels_and_vmm_objects_stay_kept():
    kernel = Kernel()
    ledger = counted(kernel)
    ledger.apply(kernel.alloc(1, Layer.DRIVER, 0xA000, 2 * MiB))
    handle = kernel.alloc(1, Layer.VMM, 0x77, 4 * MiB, obj=ObjectKind.VMM_HANDLE, api=Api.cuMemCreate)
    ledger.apply(handle)
    assert [entry.key.object for entry in ledger.kept()] == [ObjectKind.VMM_HANDLE]
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
    assert ledger.reads_refused_total == 1 and kernel.chunk_reads == 0
    assert [entry.key.pid for entry in ledger.entries(pids={2})] == [2]  # one process fits


def test_exit_and_context_destroy_take_out_exactly_what_the_agent_deleted():
    """The source has the kernel ledger delete an exit's or context destroy's entries after the Session saw the
    event (not through the probes, so the kernel's totals still hold them), and exactly what went leaves the
    totals at once: only entries as old as the event go, so a reused pid's allocation stays counted; after the
    exit the pid's totals are taken out of the kernel, and what a process that reused the pid added stays."""
    kernel = Kernel()
    ledger = counted(kernel)
    ledger.apply(kernel.alloc(1, Layer.DRIVER, 0x1000, MiB, device=0))
    ledger.apply(kernel.alloc(1, Layer.DRIVER, 0x2000, MiB, device=1))
    ledger.apply(kernel.alloc(2, Layer.DRIVER, 0x3000, MiB))
    ledger.apply(Event(kind=Kind.CONTEXT_DESTROY, api=Api.cuCtxDestroy_v2, pid=1, tid=1, timestamp_ns=5, device=1))
    assert ledger.physical_device_bytes(1) == 2 * MiB  # until the source has the kernel's entries deleted
    ledger.drop(1, before_wall_ns=5, device=1)
    assert ledger.physical_device_bytes(1) == MiB and ledger.implicit_frees_total[1] == 1
    ledger.apply(Event(kind=Kind.PROCESS_EXIT, api=Api.process_exit, pid=1, tid=1, timestamp_ns=6))
    ledger.apply(kernel.alloc(1, Layer.DRIVER, 0x4000, MiB, ts=7))  # a new process with that pid, at once
    lookups, reads = kernel.key_lookups, kernel.totals_reads
    ledger.drop(1, before_wall_ns=6)  # the exit's: the pid's totals leave the kernel at once, its entries wait
    assert kernel.totals_map.get(TotalsKey(1, 0, Layer.DRIVER, Memory.DEVICE)) is None
    assert kernel.key_lookups - lookups == 2 and kernel.totals_reads == reads  # its two keys, not everyone's
    # The dead process's bytes and entries never show (the new one's earlier ones wait for the scan to end).
    assert ledger.physical_device_bytes(1) == 0 and ledger.physical_device_bytes(2) == MiB
    assert [entry.key.address for entry in ledger.entries({1})] == [0x4000]
    assert ledger.find(LedgerKey(1, Layer.DRIVER, ObjectKind.ALLOCATION, 0x1000)) is None
    reads = kernel.chunk_reads
    assert ledger.gone_pending() == 1
    ledger.collect(1.0)  # a whole scan of the ledger: the dead process's entries are deleted
    assert ledger.gone_pending() == 0 and kernel.chunk_reads == reads + 1
    assert kernel.ledger.get(LedgerKey(1, Layer.DRIVER, ObjectKind.ALLOCATION, 0x1000)) is None
    assert ledger.physical_device_bytes(1) == MiB and ledger.physical_device_bytes(2) == MiB
    assert ledger.totals() == kernel.ledger.totals()
    ledger.apply(kernel.free(1, Layer.DRIVER, 0x4000))  # the new process frees it: the probe's change
    ledger.apply(Event(kind=Kind.PROCESS_EXIT, api=Api.process_exit, pid=1, tid=1, timestamp_ns=9))
    ledger.drop(1, before_wall_ns=9)
    ledger.collect(1.0)
    assert ledger.physical_device_bytes(1) == 0 and 1 not in ledger.pids()
    assert ledger._adjustments == {} and kernel.totals_map.keys() == {TotalsKey(2, 0, Layer.DRIVER, Memory.DEVICE)}
    reads = kernel.chunk_reads
    ledger.collect(1.0)  # nothing gone: no scan
    assert kernel.chunk_reads == reads


def test_an_exit_whose_keys_no_event_named_leaves_nothing_behind():
    """A process's allocation whose event was lost, and its quiet PyTorch blocks (no event), on keys no event named:
    its exit cannot take those totals by name; the scan that deletes its entries names them, and they go too."""
    kernel = Kernel()
    ledger = counted(kernel)
    ledger._alive = lambda pid: False  # (pid 5 is gone, and no process takes the pid)
    assert ledger.counted_entries() == 0  # the first read of all, before anything happened
    ledger.apply(kernel.alloc(5, Layer.DRIVER, 0x1000, MiB))
    kernel.alloc(5, Layer.DRIVER, 0x2000, MiB, device=3)  # lost
    for i in range(7):
        kernel.alloc(5, Layer.TORCH, 0x1000 + i * 512, 512, obj=ObjectKind.BLOCK, api=Api.pytorch_malloc)  # quiet
    ledger.apply(Event(kind=Kind.PROCESS_EXIT, api=Api.process_exit, pid=5, tid=5, timestamp_ns=10))
    ledger.drop(5, before_wall_ns=10)
    assert len(kernel.totals_map) == 2  # the two keys no event named are still there ...
    ledger.collect(1.0)
    assert kernel.totals_map == {} and kernel.ledger.entries() == []  # ... until the scan named them
    assert ledger.totals() == {} and ledger._adjustments == {} and ledger.gone_pending() == 0
    # AND where a read of all the totals comes first (a report), the keys go at that read
    ledger.apply(kernel.alloc(6, Layer.DRIVER, 0x1000, MiB))
    kernel.alloc(6, Layer.TORCH, 0x1000, 512, obj=ObjectKind.BLOCK, api=Api.pytorch_malloc)  # quiet
    ledger.drop(6, before_wall_ns=10)
    assert ledger.pids() == set() and kernel.totals_map == {}  # taken by that read, and not shown
    ledger.collect(1.0)
    assert kernel.ledger.entries() == [] and ledger._adjustments == {} and ledger.gone_pending() == 0


def test_blocks_of_lowered_processes_leave_the_kernel_and_the_totals():
    kernel = Kernel()
    ledger = counted(kernel)
    for i in range(5):
        ledger.apply(kernel.alloc(3, Layer.TORCH, 0x100 + i, 4096, obj=ObjectKind.BLOCK, api=Api.pytorch_malloc))
    ledger.apply(kernel.alloc(3, Layer.DRIVER, 0x9000, MiB))
    ledger.apply(kernel.alloc(4, Layer.TORCH, 0x100, 512, obj=ObjectKind.BLOCK, api=Api.pytorch_malloc))
    assert ledger.drop_blocks(frozenset({3})) == {TotalsKey(3, 0, Layer.TORCH, Memory.DEVICE): (5 * 4096, 5)}
    assert ledger.counted_entries({3}) == 1 and ledger.counted_entries({4}) == 1
    assert sorted((e.key.pid, e.key.layer) for e in ledger.entries()) == [(3, Layer.DRIVER), (4, Layer.TORCH)]


def test_what_the_agent_deletes_of_a_live_process_goes_back_to_its_share():
    """Blocks lowered to segments and a context destroy's entries are deleted by the agent, not by a probe: every
    entry taken goes back to its process's share (shares.h kvt_share_return), or a long-lived process raised and
    lowered again and again would be charged for entries long gone, and refused. An exit's are not given back: its
    share was released whole in the exit probe (and the pid may be a new process's by then)."""
    kernel = Kernel()
    ledger = counted(kernel)
    for i in range(5):
        ledger.apply(kernel.alloc(3, Layer.TORCH, 0x100 + i, 4096, obj=ObjectKind.BLOCK, api=Api.pytorch_malloc))
    ledger.apply(kernel.alloc(3, Layer.DRIVER, 0x9000, MiB, device=1))
    ledger.apply(kernel.alloc(3, Layer.RUNTIME, 0xa000, MiB, device=1))
    ledger.apply(kernel.alloc(4, Layer.TORCH, 0x100, 512, obj=ObjectKind.BLOCK, api=Api.pytorch_malloc))
    ledger.drop_blocks(frozenset({3, 4}))
    assert kernel.given == {3: 5, 4: 1}
    ledger.drop(3, before_wall_ns=10, device=1)
    assert kernel.given == {3: 7, 4: 1}
    ledger.drop_blocks(frozenset({3}))  # nothing left to take: nothing given
    assert kernel.given == {3: 7, 4: 1}
    ledger.apply(kernel.alloc(5, Layer.DRIVER, 0x9000, MiB))
    ledger.drop(5, before_wall_ns=10)
    ledger.collect(1.0)
    assert kernel.ledger.entries() == [] and 5 not in kernel.given


def test_resync_replaces_the_kept_objects_and_leaves_the_kernels_totals():
    kernel = Kernel()
    ledger = counted(kernel)
    ledger.apply(kernel.alloc(1, Layer.DRIVER, 0x9000, MiB))
    for i in range(5):
        kernel.alloc(1, Layer.VMM, 0x70 + i, MiB, obj=ObjectKind.VMM_HANDLE, api=Api.cuMemCreate)  # events lost
    ledger.resync([entry for entry in kernel.ledger.entries() if entry.key.object not in COUNTED_OBJECTS])
    assert ledger.totals() == kernel.ledger.totals()
    assert len(ledger.kept()) == 5


def test_a_million_counted_allocations_take_no_memory_per_allocation():
    kernel = Kernel()
    kernel.totals_map[TotalsKey(1, 0, Layer.DRIVER, Memory.DEVICE)] = [4096 * 1_000_000, 1_000_000]
    ledger = counted(kernel)
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
    assert ledger.allocations_total[(1, Layer.DRIVER)] == 1_000_000 and ledger.kept() == []
    assert grown < 64 * 1024


def test_session_streams_what_reports_go_through_and_refuses_only_a_copy_too_large():
    kernel = Kernel()
    session = Session(ledger=counted(kernel, max_read_entries=3))
    for i in range(4):
        session.ingest(kernel.alloc(7, Layer.DRIVER, 0x1000 + i, MiB))
    assert sorted(entry.key.address for entry in session.outstanding()) == [0x1000, 0x1001, 0x1002, 0x1003]
    view = session.ledger_view(with_entries=True)
    assert view.find is not None and view.read_limit == 3
    reads = kernel.chunk_reads
    assert len(list(view.entries or ())) == 4 and len(list(view.entries or ())) == 4
    assert kernel.chunk_reads == reads + 2  # each pass reads the kernel afresh
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
    ledger = counted(kernel)
    streamed = list(ledger.stream())
    assert streamed and sorted(e.key for e in streamed) == sorted(e.key for e in kept)
    held = survey_sites(kept, 10**12, 0)
    passed = survey_sites(iter(streamed), 10**12, 0, find=ledger.find, with_blocks=set())
    assert passed == held
    assert any(site.stack_id == 0 and site.caller_address == 0xC0DE for site in held.site_bytes)
    roles = role_bytes(kept, lambda stack_id: None, {})
    assert role_bytes(iter(streamed), lambda stack_id: None, {}, find=ledger.find) == roles


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
    # value: size, time, caller, aux, tid, device, api, memory, released, sample_kib, sampled, reserved, stack
    rows = [((7, Layer.DRIVER, ObjectKind.ALLOCATION, 0, 0xA000),
             (MiB, 5, 0xC0, 0, 8, 1, Api.cuMemAlloc_v2, 1, 0, 0, 0, 0, 99)),
            ((7, Layer.TORCH, ObjectKind.BLOCK, 0, 0xA100), (512, 6, 0, 3, 8, 1, Api.pytorch_malloc, 1, 0, 0, 0, 0, 0)),
            ((7, Layer.TORCH, ObjectKind.BLOCK, 0, 0xA200),  # stack sampling at 256 KiB: chosen, and passed over
             (4096, 6, 0, 3, 8, 1, Api.pytorch_malloc, 1, 0, 256, 1, 0, 5)),
            ((7, Layer.TORCH, ObjectKind.BLOCK, 0, 0xA300),
             (4096, 6, 0, 3, 8, 1, Api.pytorch_malloc, 1, 0, 256, 0, 0, 0)),
            ((8, Layer.VMM, ObjectKind.VMM_HANDLE, 0, 0x55),
             (2 * MiB, 7, 0xC1, 2, 9, 0, Api.cuMemCreate, 1, 1, 0, 0, 0, 4)),
            ((8, Layer.VMM, ObjectKind.VMM_MAPPING, 0, 0xB000),
             (2 * MiB, 8, 0, 0x55, 9, 0, Api.cuMemMap, 4, 0, 0, 0, 0, 0))]
    keys = b"".join(_LEDGER_KEY.pack(*key) for key, _ in rows)
    values = b"".join(_LEDGER_VALUE.pack(*value) for _, value in rows)
    clock = Clock(1000)
    one_by_one = [decode_ledger_entry(abi.RawLedgerKey.from_buffer_copy(_LEDGER_KEY.pack(*key)),
                                      abi.RawLedgerValue.from_buffer_copy(_LEDGER_VALUE.pack(*value)), clock)
                  for key, value in rows]
    assert [entry for entry, _ in decode_ledger_chunk(keys, values, clock)] == one_by_one
    assert [stack for _, stack in decode_ledger_chunk(keys, values, clock)] == [99, 0, 5, 0, 4, 0]
    assert [(entry.sample_bytes, entry.sampled) for entry in one_by_one] == \
        [(0, False), (0, False), (256 * 1024, True), (256 * 1024, False), (0, False), (0, False)]
    counted = frozenset(kind.value for kind in COUNTED_OBJECTS)
    assert [entry.key.address for entry, _ in decode_ledger_chunk(keys, values, clock, counted)] == \
        [0xA000, 0xA100, 0xA200, 0xA300]
    assert [entry.key.address for entry, _ in decode_ledger_chunk(keys, values, clock, None, {8})] == [0x55, 0xB000]


def test_the_kernels_totals_and_what_an_exit_drops_are_decoded_from_raw_entries():
    import ctypes

    from kvtrace.sources.bpf import abi
    from kvtrace.sources.bpf.decode import (
        _LEDGER_KEY,
        _LEDGER_VALUE,
        chunk_objects,
        chunk_stack_ids,
        decode_totals,
        doomed_in_chunk,
        gone_in_chunk,
        stacks_in_chunk,
    )

    raw = [((7, 2, 1, 0, 0xA000 + i), (MiB, 5 + i, 0, 0, 8, i % 2, 20, 1, 0, 0, 0, 0, 30 + i)) for i in range(5)]
    raw.append(((7, 3, 2, 0, 0x55), (MiB, 5, 0, 0, 8, 0, 40, 1, 0, 0, 0, 0, 0)))  # a VMM handle: not counted
    raw.append(((8, 2, 1, 0, 0xB000), (MiB, 5, 0, 0, 9, 0, 20, 1, 0, 0, 0, 0, 0)))  # another process
    keys = b"".join(_LEDGER_KEY.pack(*k) for k, _ in raw)
    values = b"".join(_LEDGER_VALUE.pack(*v) for _, v in raw)
    counted_values = frozenset(kind.value for kind in COUNTED_OBJECTS)
    doomed = doomed_in_chunk(keys, values, frozenset({7}), before_ns=8, device=0, counted=counted_values)
    assert [(raw_key, totals, size) for raw_key, totals, size in doomed] == [
        (_LEDGER_KEY.pack(*raw[0][0]), TotalsKey(7, 0, Layer.DRIVER, Memory.DEVICE), MiB),
        (_LEDGER_KEY.pack(*raw[2][0]), TotalsKey(7, 0, Layer.DRIVER, Memory.DEVICE), MiB),
        (_LEDGER_KEY.pack(*raw[5][0]), None, MiB)]  # 0xA004 is newer than the event; odd ones on device 1
    assert list(stacks_in_chunk(keys, values, counted_values, {7})) == [(7, 30 + i) for i in range(5)]
    # Gone processes, each with its own exit time: pid 7's entries at most 7 old, pid 8's at most 5 old
    gone = gone_in_chunk(keys, values, {7: 7, 8: 5, 9: 100}, counted_values)
    assert [(raw_key, pid, totals, size) for raw_key, pid, totals, size in gone] == [
        (_LEDGER_KEY.pack(*raw[index][0]), pid, TotalsKey(pid, device, Layer.DRIVER, Memory.DEVICE), MiB)
        for index, pid, device in ((0, 7, 0), (1, 7, 1), (2, 7, 0))] + [
        (_LEDGER_KEY.pack(*raw[5][0]), 7, None, MiB), (_LEDGER_KEY.pack(*raw[6][0]), 8,
                                                      TotalsKey(8, 0, Layer.DRIVER, Memory.DEVICE), MiB)]
    assert gone_in_chunk(keys, values, {9: 100}, counted_values) == []  # no gone pid here: nothing unpacked
    assert chunk_objects(keys) == {1, 2} and chunk_stack_ids(values) == {0, 30, 31, 32, 33, 34}
    assert ctypes.sizeof(abi.RawTotalsKey) == 16 and ctypes.sizeof(abi.RawTotalsValue) == 16
    totals = [(abi.RawTotalsKey(pid=7, device=1, layer=2, memory=1), abi.RawTotalsValue(size_bytes=3 * MiB, count=3)),
              (abi.RawTotalsKey(pid=8, device=0, layer=4, memory=1), abi.RawTotalsValue(size_bytes=-512, count=-1)),
              (abi.RawTotalsKey(pid=8, device=0, layer=99, memory=1), abi.RawTotalsValue(size_bytes=1, count=1))]
    assert decode_totals(totals) == {TotalsKey(7, 1, Layer.DRIVER, Memory.DEVICE): (3 * MiB, 3),
                                     TotalsKey(8, 0, Layer.TORCH, Memory.DEVICE): (-512, -1)}
    assert decode_totals(totals, {7}) == {TotalsKey(7, 1, Layer.DRIVER, Memory.DEVICE): (3 * MiB, 3)}


def test_the_ledger_left_when_the_probes_go_keeps_the_agents_objects_and_none_of_the_kernels():
    kernel = Kernel()
    ledger = counted(kernel)
    ledger.apply(kernel.alloc(1, Layer.DRIVER, 0x1000, MiB))
    ledger.apply(kernel.alloc(1, Layer.VMM, 0x77, 4 * MiB, obj=ObjectKind.VMM_HANDLE, api=Api.cuMemCreate))
    ledger.drop(1, before_wall_ns=10, device=0)
    assert ledger.counted_entries() == 0 and ledger._adjustments
    plain = ledger.detached()  # the probes were taken out (the off switch)
    assert type(plain) is Ledger and plain.read_limit == 0
    assert [entry.key.object for entry in plain.entries()] == [ObjectKind.VMM_HANDLE]
    assert plain.totals() == {TotalsKey(1, 0, Layer.VMM, Memory.DEVICE): (4 * MiB, 1)}
    assert plain.allocations_total[(1, Layer.DRIVER)] == 1


def test_counters_go_on_across_tracing_switched_off_and_on_again():
    """The off switch gives the Session a plain Ledger (detached) and tracing on again a new KernelLedger: the
    counters of calls, frees and failures (/metrics counters, never reset) go on from where they were."""
    failed = Event(kind=Kind.ALLOC_FAILED, api=Api.cuMemAlloc_v2, pid=2, tid=2, timestamp_ns=0,
                   layer=Layer.DRIVER, object=ObjectKind.ALLOCATION, memory=Memory.DEVICE, error_code=2)
    kernel = Kernel()
    session = Session()
    session.ingest(failed)
    session.replace_ledger(counted(kernel))  # tracing on
    session.ingest(kernel.alloc(1, Layer.DRIVER, 0x1000, MiB))
    session.ingest(failed)
    first = session.ledger
    assert isinstance(first, KernelLedger)
    session.replace_ledger(first.detached())  # off
    session.replace_ledger(counted(Kernel()))  # on again
    counts = session.ledger_counts()
    assert counts.failures_total == {(Api.cuMemAlloc_v2, 2): 2}
    assert counts.allocations_total == {(1, Layer.DRIVER): 1}


def test_the_kernels_entries_in_columns_are_the_entries_decoded_one_by_one():
    """A listing in columns reads the kernel's entries in columns, straight from the chunk's bytes (decode.py
    ledger_batch_in_chunk): each row is entry_row of the entry decode_ledger_chunk makes, its stack named, with
    the same entries left out (other objects, other pids, values this build does not know, a gone process's)."""
    from kvtrace.model.ledger import entry_from_row, entry_row
    from kvtrace.sources.bpf.decode import decode_ledger_chunk, ledger_batch_in_chunk

    def ledger_rows_in_chunk(*arguments):
        batch = ledger_batch_in_chunk(*arguments)
        assert {len(column) for column in batch.columns} == {batch.count}
        return list(batch.rows())

    # value: size, time, caller, aux, tid, device, api, memory, released, sample_kib, sampled, reserved, stack
    rows = [((7, Layer.DRIVER, ObjectKind.ALLOCATION, 0, 0xA000),
             (MiB, 5, 0xC0, 0, 8, 1, Api.cuMemAlloc_v2, 1, 0, 0, 0, 0, 99)),
            ((7, Layer.TORCH, ObjectKind.BLOCK, 0, 0xA100),
             (512, 6, 0, 3, 8, -1, Api.pytorch_malloc, 1, 0, 0, 0, 0, 0)),
            ((7, Layer.TORCH, ObjectKind.BLOCK, 0, 0xA200),  # stack sampling at 256 KiB: chosen, and passed over
             (4096, 6, 0, 3, 2**32 - 1, 1, Api.pytorch_malloc, 1, 0, 256, 1, 0, 5)),
            ((7, Layer.TORCH, ObjectKind.BLOCK, 0, 2**64 - 4096),
             (2**64 - 1, 2**62, 0, 2**64 - 1, 8, 1, Api.pytorch_malloc, 1, 1, 256, 0, 0, 11)),
            ((8, Layer.VMM, ObjectKind.VMM_HANDLE, 0, 0x55),
             (2 * MiB, 7, 0xC1, 2, 9, 0, Api.cuMemCreate, 1, 1, 0, 0, 0, 4)),
            ((8, Layer.RUNTIME, ObjectKind.ALLOCATION, 0, 0xB000),
             (2 * MiB, 8, 0, 0x55, 9, 0, Api.cudaMalloc, 2, 0, 0, 0, 0, 0)),
            ((9, Layer.RUNTIME, ObjectKind.ALLOCATION, 0, 0xC000),  # an API this build does not know
             (2 * MiB, 9, 0, 0, 9, 0, 0xFFFF, 1, 0, 0, 0, 0, 0)),
            ((9, 0xEE, ObjectKind.ALLOCATION, 0, 0xC100),  # a layer this build does not know
             (2 * MiB, 9, 0, 0, 9, 0, Api.cudaMalloc, 1, 0, 0, 0, 0, 0)),
            ((9, Layer.RUNTIME, ObjectKind.ALLOCATION, 0, 0xC200),  # a memory this build does not know
             (2 * MiB, 9, 0, 0, 9, 0, Api.cudaMalloc, 0xEE, 0, 0, 0, 0, 0))]
    keys = b"".join(_LEDGER_KEY.pack(*key) for key, _ in rows)
    values = b"".join(_LEDGER_VALUE.pack(*value) for _, value in rows)
    clock, stack_ids = Clock(1000), {99: 3, 5: 6}
    counted = frozenset(kind.value for kind in COUNTED_OBJECTS)

    def expected(objects, pids=(), gone=None):
        found = []
        for entry, kernel_stack in decode_ledger_chunk(keys, values, clock, objects, pids):
            if gone and entry.timestamp_ns <= gone.get(entry.key.pid, -1):
                continue
            entry.stack_id = stack_ids.get(kernel_stack, 0) if kernel_stack else 0
            found.append(entry_row(entry))
        return found

    for pids, gone in [((), None), ((7,), None), ((8, 9), None), ((), {7: 1006}), ((), {7: 1005, 8: 0}),
                       ((), {4: 10**6})]:
        got = list(ledger_rows_in_chunk(keys, values, clock, stack_ids, counted, frozenset(pids), gone))
        assert got == expected(counted, pids, gone), (pids, gone)
        assert [entry_row(entry_from_row(row)) for row in got] == got
    assert [row[7] for row in ledger_rows_in_chunk(keys, values, clock, stack_ids, counted)] == \
        [0xA000, 0xA100, 0xA200, 2**64 - 4096, 0xB000]
    only_blocks = frozenset({ObjectKind.BLOCK.value})
    assert list(ledger_rows_in_chunk(keys[16:64], values[56:224], clock, stack_ids, only_blocks)) == \
        expected(only_blocks)[:3]
    assert list(ledger_rows_in_chunk(b"", b"", clock, stack_ids, counted)) == []


def test_a_stream_of_batches_is_the_stream_of_entries():
    """KernelLedger.stream_batches (a listing in columns) goes through the same entries as stream, in batches of
    rows in columns: the kept ones and the kernel's, of the pids asked for."""
    from kvtrace.model.ledger import entry_row

    kernel = Kernel()
    ledger = counted(kernel)
    for index in range(40):
        event = kernel.alloc(100 + index % 3, Layer.DRIVER if index % 2 else Layer.RUNTIME, 0x1000 * (index + 1),
                             MiB, stack_id=11 if index % 5 else 0, ts=index)
        ledger.apply(event)
    ledger.apply(kernel.alloc(100, Layer.VMM, 0x99000, MiB, obj=ObjectKind.VMM_MAPPING, api=Api.cuMemMap))
    for pids in [(), (100,), (101, 102), (7,)]:
        rows = [row for batch in ledger.stream_batches(pids) for row in batch.rows()]
        assert sorted(rows) == sorted(map(entry_row, ledger.stream(pids))), pids
        assert len(rows) == len(list(ledger.stream(pids)))


def test_kept_entries_come_in_batches_made_as_they_are_reached():
    """A plain Ledger's entries (a replay, --no-ledger-in-kernel) in batches of ROW_BATCH_ENTRIES, each made when
    reached, at every pass: a listing in columns holds one batch at a time, not every row at once."""
    from kvtrace.model.ledger import ROW_BATCH_ENTRIES, entry_row

    ledger = Ledger()
    count = 2 * ROW_BATCH_ENTRIES + 5
    for index in range(count):
        ledger.apply(Event(kind=Kind.ALLOC, api=Api.cudaMalloc, pid=100 + index % 2, tid=1, timestamp_ns=index,
                           layer=Layer.RUNTIME, object=ObjectKind.ALLOCATION, memory=Memory.DEVICE, size_bytes=MiB,
                           address=0x1000 * (index + 1), device=0))
    batches = ledger.stream_batches()
    for _ in range(2):  # each pass the same
        counts = [batch.count for batch in batches]
        assert counts == [ROW_BATCH_ENTRIES, ROW_BATCH_ENTRIES, 5]
        assert [row for batch in batches for row in batch.rows()] == list(map(entry_row, ledger.stream()))
    assert sum(batch.count for batch in ledger.stream_batches((101,))) == count // 2


class ChunkedKernel(Kernel):
    """A kernel whose ledger is read one entry a chunk (a pass has a point between each two)."""

    def iter_ledger_chunks(self):
        self.chunk_reads += 1
        for entry in self.ledger.entries():
            yield self._raw(entry)


def test_the_site_samples_pass_waits_while_a_clients_listing_is_open_and_no_longer_than_its_bound(monkeypatch):
    import threading
    import time

    kernel = ChunkedKernel()
    session = Session(ledger=counted(kernel))
    for i in range(4):
        session.ingest(kernel.alloc(7, Layer.DRIVER, 0x1000 + i, MiB))

    def background_pass() -> tuple[threading.Thread, list]:
        read: list = []
        view = session.ledger_view(with_entries=True)  # the site sample's entries
        thread = threading.Thread(target=lambda: read.extend(view.entries or ()), daemon=True)
        thread.start()
        return thread, read

    listing = iter(session.outstanding())  # a client's listing, open across its pages
    first = next(listing)
    sample, read = background_pass()
    sample.join(0.3)
    assert sample.is_alive() and read == []  # it waits before its first chunk
    assert len([first, *listing]) == 4  # the listing ends: its pass closes
    sample.join(5)
    assert not sample.is_alive() and len(read) == 4
    assert session.counters()["ledger_background_wait_ms"] >= 250

    # A listing dropped half-way (its client went) closes its pass too.
    listing = iter(session.outstanding())
    next(listing)
    del listing
    sample, read = background_pass()
    sample.join(5)
    assert not sample.is_alive() and len(read) == 4

    # A listing left open (a client that stopped asking for pages) holds the sample back BACKGROUND_WAIT_SECONDS
    # of waiting at most, however many chunks are left.
    monkeypatch.setattr(kernel_ledger_module, "BACKGROUND_WAIT_SECONDS", 0.3)
    listing = iter(session.outstanding())
    next(listing)
    started = time.monotonic()
    sample, read = background_pass()
    sample.join(5)
    assert not sample.is_alive() and len(read) == 4 and 0.25 <= time.monotonic() - started < 3
    assert len(list(session.outstanding())) == 4  # foreground passes never wait for each other
    assert len(list(listing)) == 3  # and the listing still reads on


def test_a_pass_giving_way_reads_on_at_once_when_the_probes_are_about_to_go(monkeypatch):
    """A stop waits for the site sample before the probes go; a listing the servers' stop left open must not make
    it wait BACKGROUND_WAIT_SECONDS (systemd kills a stop after 10 s)."""
    import threading
    import time

    monkeypatch.setattr(kernel_ledger_module, "BACKGROUND_WAIT_SECONDS", 30.0)
    kernel = ChunkedKernel()
    ledger = counted(kernel)
    session = Session(ledger=ledger)
    for i in range(4):
        session.ingest(kernel.alloc(7, Layer.DRIVER, 0x1000 + i, MiB))
    listing = iter(session.outstanding())
    next(listing)  # left open
    read: list = []
    view = session.ledger_view(with_entries=True)
    sample = threading.Thread(target=lambda: read.extend(view.entries or ()), daemon=True)
    sample.start()
    sample.join(0.3)
    assert sample.is_alive() and read == []
    started = time.monotonic()
    ledger.stop_giving_way()
    sample.join(5)
    assert not sample.is_alive() and len(read) == 4 and time.monotonic() - started < 1.0
