"""The ledger: every outstanding allocation, VMM handle, reservation and mapping, with totals.

It applies the events of one stream in order. The same rules run in the BPF probes on the kernel's
copy (probes/kvtrace.bpf.c), which is exact even when events are lost; `resync` replaces this copy
with the kernel's after a loss, so both converge.

Rules:
- allocations live from a successful alloc to a successful free (keyed by pid, layer, address);
  the runtime and driver layers are kept apart, so cudaMalloc -> cuMemAlloc_v2 is never summed
- VMM physical memory lives from cuMemCreate until it is both released and unmapped
- a context destroy frees what that process held on the context's device; a process exit frees all
  it held (only entries older than the event: a reused pid or a new context keeps its own)
- a free of an address never seen is counted, not an error: the memory predates the agent
- a PyTorch block's stack sampling goes from its event into its entry (Event.sample_bytes and its
  stack status), so a ledger built from events weighs blocks as the kernel's does (model/blocks.py)
"""
from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from kvtrace.model.events import (
    DEVICE_UNKNOWN,
    MEMORY_OBJECTS,
    PHYSICAL_LAYERS,
    Api,
    Event,
    Kind,
    Layer,
    Memory,
    ObjectKind,
    StackStatus,
)

_MEMORY_OBJECTS = MEMORY_OBJECTS  # a local name: these run per ledger entry


class LedgerKey(NamedTuple):  # a tuple: hashed in C, on the hot path of every event
    pid: int
    layer: Layer
    object: ObjectKind
    address: int


@dataclass(slots=True)
class Outstanding:
    """One live object."""

    key: LedgerKey
    size_bytes: int
    timestamp_ns: int
    device: int
    api: Api
    memory: Memory
    tid: int = 0
    caller_address: int = 0
    mapped_count: int = 0  # VMM handle: live mappings
    released: bool = False  # VMM handle: released while mapped
    handle: int = 0  # VMM mapping: the handle it maps
    stack_id: int = 0
    stream: int = 0  # PyTorch block: the CUDA stream it was allocated on
    # PyTorch block under stack sampling: the mean S in bytes it was sampled at (0: every block's stack
    # walked, exact: weight 1), and whether sampling chose it (model/blocks.py estimated_bytes)
    sample_bytes: int = 0
    sampled: bool = False


# tuple.__new__(LedgerKey, (...)) makes the same key as LedgerKey(...) at half the cost (no Python-level
# __new__): used where a key is made for every event.
_new_tuple = tuple.__new__


class TotalsKey(NamedTuple):
    pid: int
    device: int
    layer: Layer
    memory: Memory


class LedgerReadRefused(Exception):
    """Reading the entries would copy more of them than the agent is configured to hold at once."""

    def __init__(self, entries: int, limit: int) -> None:
        super().__init__(
            f"the ledger holds {entries:,} allocations, more than --max-read-entries {limit:,} copied at once "
            f"(about 450 bytes of agent memory each): raise --max-read-entries, or record fewer processes")
        self.entries = entries
        self.limit = limit


# Objects that come in millions (allocations, PyTorch's blocks): where the kernel keeps them and their totals (the
# agent's BPF source), the ledger keeps neither and reads them from there when asked (Ledger.count_only).
COUNTED_OBJECTS = frozenset({ObjectKind.ALLOCATION, ObjectKind.BLOCK})
# A report may copy this many of them from the kernel at once (--max-read-entries): about 450 bytes of agent
# memory each, 110 MB at most.
DEFAULT_MAX_READ_ENTRIES = 250_000
# Counted totals read from the kernel are read again after a counted event, an uncount, or this long.
COUNTED_TOTALS_MAX_AGE_NS = 1_000_000_000
_COUNTED_LAYERS = frozenset({Layer.RUNTIME, Layer.DRIVER, Layer.TORCH})  # where those live (VMM's are kept)


class Ledger:
    """Outstanding objects and their totals, built from events.

    By default every object is kept here (a replay, `kvtrace run`). Where the kernel keeps the exact
    ledger (the agent's BPF source), `count_only` makes it keep neither the entries of allocations and
    blocks, which come in millions, nor their totals: the probes keep both, and both are read from the
    kernel when a report asks. The agent's memory then grows with processes and VMM objects, not with
    allocations, and the totals are exact whatever events are lost."""

    def __init__(self) -> None:
        self._entries: dict[LedgerKey, Outstanding] = {}
        self._counted: frozenset[ObjectKind] = frozenset()
        self._read_counted: Callable[[Collection[int]], Iterable[Outstanding]] | None = None
        self.find_counted: Callable[[LedgerKey], Outstanding | None] | None = None
        self.max_read_entries = 0
        self.reads_refused_total = 0
        # Where the ledger counts: the kernel's totals of the counted objects (read_totals), what the agent
        # took out of the kernel's ledger or totals itself (_adjustments), and the last sum of the two.
        self._read_totals: Callable[[], Mapping[TotalsKey, tuple[int, int]]] | None = None
        self._adjustments: dict[TotalsKey, list[int]] = {}
        self._counted_cache: dict[TotalsKey, tuple[int, int]] = {}
        self._counted_read_ns: int | None = None  # monotonic; None: read again at the next use
        # The kept objects' totals (every object's unless count_only).
        self._bytes: dict[TotalsKey, int] = defaultdict(int)
        self._counts: dict[TotalsKey, int] = defaultdict(int)
        self.allocations_total: Counter[tuple[int, Layer]] = Counter()
        self.frees_total: Counter[tuple[int, Layer]] = Counter()
        self.implicit_frees_total: Counter[int] = Counter()  # per pid: objects dropped by exit/destroy
        self.unknown_frees_total: Counter[tuple[int, Api]] = Counter()
        self.failures_total: Counter[tuple[Api, int]] = Counter()  # (api, error code)

    def count_only(self, read: Callable[[Collection[int]], Iterable[Outstanding]],
                   find: Callable[[LedgerKey], Outstanding | None],
                   read_totals: Callable[[], Mapping[TotalsKey, tuple[int, int]]], max_read_entries: int,
                   objects: frozenset[ObjectKind] = COUNTED_OBJECTS) -> None:
        """Keeps neither entries nor totals of `objects` from now on: the kernel keeps both, changed by the
        probes as objects come and go, so they are exact whatever events are lost. `read_totals()` gives
        the kernel's (bytes, count) per (pid, device, layer, memory); `read(pids)` yields the entries of
        `pids` (empty: all) when a report asks, `find(key)` one of them; a report that copies them all at
        once (a checkpoint) copies at most `max_read_entries`. Call it before the first event."""
        if self._entries:
            raise RuntimeError("count_only on a ledger that already keeps entries")
        self._counted, self._read_counted, self.max_read_entries = objects, read, max_read_entries
        self.find_counted, self._read_totals = find, read_totals

    def stop_counting(self) -> None:
        """The kernel's ledger is going (the source stops): what count_only read from it goes too, and the
        ledger keeps every object again. count_only may be called anew once the kept entries are gone too
        (the daemon resyncs to nothing when tracing stops)."""
        self._counted, self._read_counted, self.find_counted, self._read_totals = frozenset(), None, None, None
        self.max_read_entries = 0
        self._adjustments, self._counted_cache, self._counted_read_ns = {}, {}, None

    @property
    def counting(self) -> bool:
        return bool(self._counted)

    # ---- applying events ----

    def apply(self, event: Event) -> None:
        kind = event.kind
        if kind is Kind.ALLOC:
            self._on_alloc(event)
        elif kind is Kind.FREE:
            self._on_free(event)
        elif kind is Kind.MAP:
            self._on_map(event)
        elif kind is Kind.UNMAP:
            self._on_unmap(event)
        elif kind is Kind.RELEASE:
            handle = self._entries.get(self._key(event))
            if handle is not None:
                handle.released = True
        elif kind is Kind.FREE_UNKNOWN:
            self.unknown_frees_total[(event.pid, event.api)] += 1
        elif kind in (Kind.ALLOC_FAILED, Kind.FREE_FAILED):
            self.failures_total[(event.api, event.error_code)] += 1
        elif kind is Kind.CONTEXT_DESTROY:
            if event.error_code == 0:
                device = None if event.device == DEVICE_UNKNOWN else event.device
                self.drop_process(event.pid, before_ns=event.timestamp_ns, device=device)
        elif kind is Kind.PROCESS_EXIT:
            self.drop_process(event.pid, before_ns=event.timestamp_ns)

    def apply_many(self, events: Iterable[Event]) -> None:
        """apply() of each event, in order, at less cost where the kernel keeps the objects (count_only):
        an allocation or free of a counted object only adds to the pid's calls here, in one pass."""
        counted = self._counted
        if not counted:
            for event in events:
                self.apply(event)
            return
        allocations, frees = self.allocations_total, self.frees_total
        alloc, free = Kind.ALLOC, Kind.FREE
        self._counted_read_ns = None  # first: a run that stops at a bad event has changed the totals too
        for event in events:
            kind = event.kind
            if (kind is alloc or kind is free) and event.object in counted and event.memory is not None \
                    and event.layer is not None:
                (allocations if kind is alloc else frees)[event.pid, event.layer] += 1
            else:
                self.apply(event)

    @staticmethod
    def _key(event: Event) -> LedgerKey:
        layer, object_kind, _ = _placed(event)
        return _new_tuple(LedgerKey, (event.pid, layer, object_kind, event.address))

    def _insert(self, entry: Outstanding) -> None:
        if entry.key.object in self._counted:  # the kernel keeps the entry and its totals
            return
        old = self._entries.get(entry.key)
        if old is not None:  # the same address again: the free was not seen (lost or predates us)
            self._remove(old)
        self._entries[entry.key] = entry
        pid, layer, object_kind, _ = entry.key
        if object_kind in _MEMORY_OBJECTS:
            totals = _new_tuple(TotalsKey, (pid, entry.device, layer, entry.memory))
            self._bytes[totals] += entry.size_bytes
            self._counts[totals] += 1

    def _remove(self, entry: Outstanding) -> None:
        del self._entries[entry.key]
        pid, layer, object_kind, _ = entry.key
        if object_kind in _MEMORY_OBJECTS:
            totals = _new_tuple(TotalsKey, (pid, entry.device, layer, entry.memory))
            self._bytes[totals] -= entry.size_bytes
            self._counts[totals] -= 1
            if self._counts[totals] == 0:
                del self._bytes[totals], self._counts[totals]

    def _on_alloc(self, event: Event) -> None:
        layer, object_kind, memory = _placed(event)
        self.allocations_total[(event.pid, layer)] += 1
        if object_kind in self._counted:  # the kernel keeps the entry and its totals
            self._counted_read_ns = None
            return
        # Positional, in Outstanding's field order (keywords cost twice as much, on every allocation):
        # key, size, time, device, api, memory, tid, caller, mapped_count, released, handle, stack, stream,
        # and a block's stack sampling as the kernel's entry has it: chosen unless its event says passed over.
        sample_bytes = event.sample_bytes
        self._insert(Outstanding(
            _new_tuple(LedgerKey, (event.pid, layer, object_kind, event.address)), event.size_bytes,
            event.timestamp_ns, event.device, event.api, memory, event.tid, event.caller_address, 0, False, 0,
            event.stack_id, event.stream, sample_bytes,
            sample_bytes != 0 and event.stack_status is not StackStatus.NOT_SAMPLED))

    def _on_free(self, event: Event) -> None:
        key = self._key(event)
        if key.object in self._counted:  # the probe sends FREE only for an entry its ledger held
            self.frees_total[(event.pid, key.layer)] += 1
            self._counted_read_ns = None
            return
        entry = self._entries.get(key)
        if entry is None:
            self.unknown_frees_total[(event.pid, event.api)] += 1
            return
        self.frees_total[(event.pid, key.layer)] += 1
        self._remove(entry)

    def _on_map(self, event: Event) -> None:
        handle = self._entries.get(LedgerKey(event.pid, Layer.VMM, ObjectKind.VMM_HANDLE, event.handle))
        if handle is not None:
            handle.mapped_count += 1
        self._insert(Outstanding(
            key=self._key(event), size_bytes=event.size_bytes, timestamp_ns=event.timestamp_ns,
            device=event.device, api=event.api, memory=Memory.NONE, tid=event.tid,
            caller_address=event.caller_address, handle=event.handle))

    def _on_unmap(self, event: Event) -> None:
        # One cuMemUnmap may cover several consecutive mappings.
        address, end = event.address, event.address + event.size_bytes
        while address < end:
            mapping = self._entries.get(LedgerKey(event.pid, Layer.VMM, ObjectKind.VMM_MAPPING, address))
            if mapping is None:
                break
            self._remove(mapping)
            handle = self._entries.get(
                LedgerKey(event.pid, Layer.VMM, ObjectKind.VMM_HANDLE, mapping.handle))
            if handle is not None:
                handle.mapped_count -= 1
                if handle.mapped_count <= 0 and handle.released:
                    self.frees_total[(event.pid, Layer.VMM)] += 1
                    self._remove(handle)
            if mapping.size_bytes == 0:
                break
            address += mapping.size_bytes

    def drop_process(self, pid: int, before_ns: int, device: int | None = None) -> int:
        """Implicit frees: drops the pid's entries older than `before_ns` (on `device` if given)."""
        doomed = [e for e in self._entries.values()
                  if e.key.pid == pid and e.timestamp_ns <= before_ns
                  and (device is None or e.device == device)]
        for entry in doomed:
            self._remove(entry)
        # Counted objects: the source deletes the kernel's entries and says what went (uncount).
        self.implicit_frees_total[pid] += len(doomed)
        return len(doomed)

    def uncount(self, dropped: Mapping[TotalsKey, tuple[int, int]], implicit: bool = True) -> None:
        """Counted objects the agent deleted from the kernel's ledger (an exit, a context destroy): (bytes,
        count) each, which the kernel's totals still hold (the probes did not delete them); `implicit`: counted
        as implicit frees of their process (not after an exit: its counters are gone). Only where the ledger
        counts: a kept ledger dropped the entries themselves (drop_process)."""
        if not self._counted:
            return
        self._adjust(dropped, -1)
        if implicit:
            for totals, (_, count) in dropped.items():
                self.implicit_frees_total[totals.pid] += count

    def retire_totals(self, taken: Mapping[TotalsKey, tuple[int, int]]) -> None:
        """The kernel's totals of an exited process, which the agent took out of the kernel (read and
        deleted at once): after uncount, what they held beyond what was dropped (normally nothing; a process
        that reused the pid meanwhile, its allocations) is kept here."""
        if self._counted:
            self._adjust(taken, 1)

    def adjusted(self) -> bool:
        """Whether the agent's totals differ from the kernel's (what it took out of the kernel's ledger or
        totals itself: a context destroy's entries, a retired process's leftovers). Safe without the lock."""
        return bool(self._adjustments)

    def _adjust(self, totals: Mapping[TotalsKey, tuple[int, int]], sign: int) -> None:
        adjustments = self._adjustments
        for key, (size_bytes, count) in totals.items():
            adjusted = adjustments.setdefault(key, [0, 0])
            adjusted[0] += sign * size_bytes
            adjusted[1] += sign * count
            if adjusted == [0, 0]:
                del adjustments[key]
        self._counted_read_ns = None

    def _counted_totals(self) -> dict[TotalsKey, tuple[int, int]]:
        """(bytes, count) of the counted objects per (pid, device, layer, memory): the kernel's totals, with
        what the agent took out of the kernel itself; read again after a counted event or an uncount, or
        COUNTED_TOTALS_MAX_AGE_NS after the last read (events lost change the kernel's too). Under steady
        traffic each report reads the map again (a few keys per process, under the Session's lock)."""
        now = time.monotonic_ns()
        if (self._counted_read_ns is not None and now - self._counted_read_ns < COUNTED_TOTALS_MAX_AGE_NS) \
                or self._read_totals is None:
            return self._counted_cache
        sums = {key: [size_bytes, count] for key, (size_bytes, count) in self._read_totals().items()}
        for key, (size_bytes, count) in self._adjustments.items():
            total = sums.setdefault(key, [0, 0])
            total[0] += size_bytes
            total[1] += count
        # Never below zero: a probe's two adds (bytes, count) are apart by an instant, and a free racing an
        # allocation at the same address can take the old size out of the new entry's totals (ledger.h).
        self._counted_cache = {key: (max(size_bytes, 0), max(count, 0)) for key, (size_bytes, count) in sums.items()
                               if size_bytes > 0 or count > 0}
        self._counted_read_ns = now
        return self._counted_cache

    def forget_counters(self, pid: int) -> None:
        """After the process is gone: its per-pid counters go too, or a host that runs many short
        CUDA processes would grow the agent without end. Its entries are dropped by drop_process."""
        for counter in (self.allocations_total, self.frees_total, self.unknown_frees_total):  # (pid, ...)
            for key in [key for key in counter if key[0] == pid]:
                del counter[key]
        self.implicit_frees_total.pop(pid, None)

    def resync(self, entries: Iterable[Outstanding]) -> None:
        """Replaces the outstanding set with an exact copy (the kernel's), keeping known stacks."""
        old = self._entries
        self._entries, self._bytes, self._counts = {}, defaultdict(int), defaultdict(int)
        for entry in entries:
            previous = old.pop(entry.key, None)  # dropped as it is replaced: one copy at a time
            if previous is not None and previous.timestamp_ns == entry.timestamp_ns and not entry.stack_id:
                entry.stack_id = previous.stack_id
            self._insert(entry)

    # ---- views ----

    def __len__(self) -> int:
        return len(self._entries) + self.counted_entries()

    def __iter__(self) -> Iterator[Outstanding]:
        return iter(self.entries())

    def counted_entries(self, pids: Collection[int] = ()) -> int:
        """Allocations and blocks of `pids` (empty: all) the kernel keeps, from its totals (0 unless count_only)."""
        if not self._counted:
            return 0
        return sum(count for totals, (_, count) in self._counted_totals().items()
                   if totals.layer in _COUNTED_LAYERS and (not pids or totals.pid in pids))

    def kept_entries(self, pids: Collection[int] = ()) -> list[Outstanding]:
        """The entries of `pids` (empty: all) kept here (every entry unless count_only), as a new list."""
        if not pids:
            return list(self._entries.values())
        return [entry for entry in self._entries.values() if entry.key.pid in pids]

    def check_read(self, pids: Collection[int] = ()) -> None:
        """Raises LedgerReadRefused (and counts it) where reading the counted entries of `pids` would copy
        more than max_read_entries."""
        counted = self.counted_entries(pids)
        if counted > self.max_read_entries:
            self.reads_refused_total += 1
            raise LedgerReadRefused(counted, self.max_read_entries)

    def read_counted(self, pids: Collection[int] = ()) -> list[Outstanding]:
        """The counted entries of `pids` (empty: all), read from where they are kept (check_read first; []
        unless count_only). Safe without the ledger's lock: it reads the kernel, not this object."""
        return list(self._read_counted(pids)) if self._read_counted is not None else []

    def stream(self, pids: Collection[int] = ()) -> Iterable[Outstanding]:
        """Every live entry of `pids` (empty: all), for a reader that goes through them once or a few times
        and keeps what it computes, not the entries: the kept ones are copied now; where the kernel keeps
        the allocations, each pass reads them from it then (outside any lock), without a limit."""
        kept = self.kept_entries(pids)
        if not self._counted or self._read_counted is None:
            return kept
        return LedgerEntries(kept, self._read_counted, frozenset(pids))

    def entries(self, pids: Collection[int] = ()) -> list[Outstanding]:
        """Every live entry of `pids` (empty: all), as a new list (safe to keep while the ledger changes).
        Where the kernel keeps the allocations, they are read from it: LedgerReadRefused over
        max_read_entries."""
        if not self._counted:
            return self.kept_entries(pids)
        self.check_read(pids)
        return self.kept_entries(pids) + self.read_counted(pids)

    def get(self, key: LedgerKey) -> Outstanding | None:
        return self._entries.get(key)

    def pids(self) -> set[int]:
        counted = self._counted_totals() if self._counted else {}
        return {key.pid for key in self._entries} | {key.pid for key in self._counts} | {key.pid for key in counted}

    def totals(self) -> dict[TotalsKey, tuple[int, int]]:
        """(bytes, count) of memory-holding objects per (pid, device, layer, memory)."""
        kept = {key: (self._bytes[key], self._counts[key]) for key in self._bytes}
        if not self._counted:
            return kept
        totals = dict(self._counted_totals())
        for key, (size_bytes, count) in kept.items():
            counted = totals.get(key)
            totals[key] = (size_bytes, count) if counted is None else (size_bytes + counted[0], count + counted[1])
        return totals

    def outstanding_bytes(self, pid: int | None = None, device: int | None = None,
                          layers: Iterable[Layer] | None = None,
                          memory: Memory | None = Memory.DEVICE) -> int:
        wanted = set(layers) if layers is not None else None
        return sum(size for key, (size, _) in self.totals().items()
                   if (pid is None or key.pid == pid) and (device is None or key.device == device)
                   and (wanted is None or key.layer in wanted)
                   and (memory is None or key.memory == memory))

    def bytes_by_stack(self, pid: int | None = None) -> dict[tuple[int, int], tuple[int, int]]:
        """(bytes, count) of physical device memory per (pid, Python stack id); stack 0 = none.

        Only the driver and VMM layers count: the runtime call above a driver call has the same
        stack, and adding both would count its bytes twice."""
        totals: dict[tuple[int, int], list[int]] = {}
        for entry in self.stream():
            key = entry.key
            if not holds_device_memory(entry) or (pid is not None and key.pid != pid):
                continue
            total = totals.setdefault((key.pid, entry.stack_id), [0, 0])
            total[0] += entry.size_bytes
            total[1] += 1
        return {group: (size, count) for group, (size, count) in totals.items()}

    def physical_device_bytes(self, pid: int | None = None, device: int | None = None) -> int:
        """Device memory actually held: the driver and VMM layers (the runtime sits on top)."""
        return self.outstanding_bytes(pid, device, layers=PHYSICAL_LAYERS)


class LedgerEntries:
    """A ledger's entries where the kernel keeps the allocations: the kept ones as copied, then the kernel's
    read afresh at every pass (each pass is a moment's view of a map the probes go on changing)."""

    def __init__(self, kept: list[Outstanding], read: Callable[[Collection[int]], Iterable[Outstanding]],
                 pids: frozenset[int]) -> None:
        self._kept, self._read, self._pids = kept, read, pids

    def __iter__(self) -> Iterator[Outstanding]:
        yield from self._kept
        yield from self._read(self._pids)


def _placed(event: Event) -> tuple[Layer, ObjectKind, Memory]:
    """Layer, object and memory of an event about an object; every source sets all three."""
    if event.layer is None or event.object is None or event.memory is None:
        raise ValueError(f"a {event.kind.name.lower()} event of {event.api.name} without layer, object or memory")
    return event.layer, event.object, event.memory


def holds_device_memory(entry: Outstanding) -> bool:
    """Physical device memory: a driver allocation or a VMM handle (the runtime layer is the same
    bytes seen from cudaMalloc's side, reservations and mappings are address space only)."""
    key = entry.key
    return key.layer in PHYSICAL_LAYERS and key.object in _MEMORY_OBJECTS and entry.memory is Memory.DEVICE


@dataclass(frozen=True)
class LedgerResynced:
    """The ledger was replaced by an exact copy (after lost events): what came before no longer adds up
    to it, so a recording writes the new state."""

    timestamp_ns: int


@dataclass(frozen=True)
class LedgerCounts:
    """A consistent copy of the ledger's totals and counters (what /metrics exports)."""

    totals: Mapping[TotalsKey, tuple[int, int]]  # (pid, device, layer, memory) -> (bytes, count)
    allocations_total: Mapping[tuple[int, Layer], int]
    frees_total: Mapping[tuple[int, Layer], int]
    failures_total: Mapping[tuple[Api, int], int]  # (api, CUDA error code)

    @classmethod
    def of(cls, ledger: Ledger) -> LedgerCounts:
        return cls(ledger.totals(), dict(ledger.allocations_total), dict(ledger.frees_total),
                   dict(ledger.failures_total))


@dataclass(frozen=True)
class LedgerView:
    """What one analysis copies out of the ledger (or a test builds by hand)."""

    wall_ns: int  # time.time_ns() of the copy: allocation ages are wall-clock
    monotonic_ns: int  # time.monotonic_ns() of the copy: series are immune to clock steps
    totals: dict[TotalsKey, tuple[int, int]]  # Ledger.totals(): (bytes, count)
    # Every outstanding entry (Ledger.stream: go through it, do not keep it); None: not copied this time.
    entries: Iterable[Outstanding] | None
    allocations_total: dict[int, int]  # per pid, physical layers (as outstanding bytes)
    frees_total: dict[int, int]
    titles: dict[int, str] = field(default_factory=dict)
    traced_only: bool = False  # the agent follows chosen processes only: leave NVML's others out
    # Processes started before the agent: memory they allocated before it is not in the ledger.
    predates_agent: frozenset[int] = frozenset()
    # The entry of a key where the kernel keeps the allocations (Ledger.find_counted); None: look in `entries`.
    find: Callable[[LedgerKey], Outstanding | None] | None = None
    # Where `find` is set: entries an analysis may hold at once (--max-read-entries); 0: no limit.
    max_read_entries: int = 0

    def pids_with_blocks(self) -> set[int]:
        """Processes holding PyTorch blocks (traced), from the totals."""
        return pids_with_blocks(self.totals)


def pids_with_blocks(totals: Mapping[TotalsKey, tuple[int, int]]) -> set[int]:
    """Processes holding PyTorch blocks (traced), from a ledger's totals."""
    return {key.pid for key, (_, count) in totals.items() if key.layer is Layer.TORCH and count}


def ledger_view(ledger: Ledger, wall_ns: int, monotonic_ns: int, with_entries: bool = True,
                titles: dict[int, str] | None = None, traced_only: bool = False,
                predates_agent: frozenset[int] = frozenset()) -> LedgerView:
    """A view of `ledger`; call it under the lock that guards the ledger."""
    allocations: dict[int, int] = defaultdict(int)
    frees: dict[int, int] = defaultdict(int)
    for (pid, layer), count in ledger.allocations_total.items():
        if layer in PHYSICAL_LAYERS:  # the runtime call and the driver call inside it are one
            allocations[pid] += count
    for (pid, layer), count in ledger.frees_total.items():
        if layer in PHYSICAL_LAYERS:
            frees[pid] += count
    return LedgerView(wall_ns, monotonic_ns, ledger.totals(), ledger.stream() if with_entries else None,
                      dict(allocations), dict(frees), titles or {}, traced_only, predates_agent, ledger.find_counted,
                      ledger.max_read_entries if ledger.counting else 0)
