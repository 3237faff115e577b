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

Two stores keep a ledger, and readers see both through `LedgerStore`: this module's `Ledger` keeps every
object in the agent (a replay, `kvtrace run`, `--no-ledger-in-kernel`); the BPF source's `KernelLedger`
(sources/bpf/kernel_ledger.py) leaves allocations and blocks, which come in millions, in the kernel's maps
and reads them from there when a report asks.
"""
from __future__ import annotations

import copy
import itertools
import operator
from collections import Counter, defaultdict
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

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


class EntryColumns(NamedTuple):
    """Outstanding entries in columns, as a snapshot's page of columns carries them (kvtrace.v1
    OutstandingColumns): entry i is item i of every list, each field Outstanding's of that name (`layer`,
    `object`, `memory` and `api` as numbers: the enums' values, and a newer agent's unknown value stays a
    number). `labels`: (comm, title, container) of each process, by pid. A listing of a million entries is
    read so without an object per entry."""

    pid: list[int]
    tid: list[int]
    layer: list[int]
    object: list[int]
    memory: list[int]
    api: list[int]
    size_bytes: list[int]
    address: list[int]
    device: list[int]
    timestamp_ns: list[int]
    caller_address: list[int]
    stack_id: list[int]
    mapped_count: list[int]
    released: list[bool]
    handle: list[int]
    stream: list[int]
    sample_bytes: list[int]
    sampled: list[bool]
    labels: dict[int, tuple[str, str, str]]


# An entry as a row: its fields in EntryColumns' order (enums as their numbers), one tuple. A listing in columns
# goes through batches of rows in columns (RowBatch, Ledger.stream_batches): the kernel's entries are made columns
# straight from its maps' bytes, without an Outstanding, or a tuple, each.
ENTRY_ROW_FIELDS = ("key.pid", "tid", "key.layer", "key.object", "memory", "api", "size_bytes", "key.address",
                    "device", "timestamp_ns", "caller_address", "stack_id", "mapped_count", "released", "handle",
                    "stream", "sample_bytes", "sampled")
entry_row: Callable[[Outstanding], tuple] = operator.attrgetter(*ENTRY_ROW_FIELDS)  # one C call an entry
ROW_PID, ROW_LAYER, ROW_STACK_ID = 0, 2, 11  # where those fields are in a row


class RowBatch:
    """`count` entries as columns (ENTRY_ROW_FIELDS' order): row i is item i of each."""

    __slots__ = ("columns", "count")

    def __init__(self, columns: Sequence[Sequence], count: int) -> None:
        self.columns, self.count = columns, count

    @classmethod
    def of_rows(cls, rows: Iterable[tuple]) -> RowBatch:
        columns = list(zip(*rows, strict=True))
        return cls(columns or [()] * len(ENTRY_ROW_FIELDS), len(columns[0]) if columns else 0)

    def rows(self) -> Iterator[tuple]:
        return zip(*self.columns, strict=True)

    def split(self, at: int) -> tuple[RowBatch, RowBatch]:
        """The first `at` rows, and the rest."""
        return (RowBatch([column[:at] for column in self.columns], at),
                RowBatch([column[at:] for column in self.columns], self.count - at))

    def where(self, taken: Sequence[bool]) -> RowBatch:
        """The rows `taken` says (one bool a row)."""
        columns = [list(itertools.compress(column, taken)) for column in self.columns]
        return RowBatch(columns, len(columns[0]))


ROW_BATCH_ENTRIES = 4096  # entries a batch of kept ones holds (a chunk of the kernel's holds as many)


class EntryBatches:
    """`entries` in batches of rows in columns, each made as it is reached, at every pass (a listing of a million
    kept entries holds their references, and one batch, at a time: not all their rows at once)."""

    def __init__(self, entries: list[Outstanding]) -> None:
        self._entries = entries

    def __iter__(self) -> Iterator[RowBatch]:
        entries = self._entries
        return (RowBatch.of_rows(map(entry_row, entries[start:start + ROW_BATCH_ENTRIES]))
                for start in range(0, len(entries), ROW_BATCH_ENTRIES))


def entry_from_row(row: tuple) -> Outstanding:
    """The entry a row is (ValueError for an enum value this build does not know)."""
    (pid, tid, layer, kind, memory, api, size_bytes, address, device, timestamp_ns, caller_address, stack_id,
     mapped_count, released, handle, stream, sample_bytes, sampled) = row
    return Outstanding(LedgerKey(pid, Layer(layer), ObjectKind(kind), address), size_bytes, timestamp_ns, device,
                       Api(api), Memory(memory), tid, caller_address, mapped_count, bool(released), handle, stack_id,
                       stream, sample_bytes, bool(sampled))


# tuple.__new__(LedgerKey, (...)) makes the same key as LedgerKey(...) at half the cost (no Python-level
# __new__): used where a key is made for every event.
_new_tuple = tuple.__new__


class TotalsKey(NamedTuple):
    pid: int
    device: int
    layer: Layer
    memory: Memory


class LedgerClosed(RuntimeError):
    """A read from another thread (LedgerStore.entries_later) came after the probes' maps closed: it fails."""


class LedgerReadRefused(Exception):
    """Reading the entries would copy more of them than the agent is configured to hold at once."""

    def __init__(self, entries: int, limit: int) -> None:
        super().__init__(
            f"the ledger holds {entries:,} allocations, more than --max-read-entries {limit:,} copied at once "
            f"(about 450 bytes of agent memory each): raise --max-read-entries, or record fewer processes")
        self.entries = entries
        self.limit = limit


# A report may copy this many allocations and blocks from where they are kept at once (--max-read-entries,
# LedgerStore.read_limit): about 450 bytes of agent memory each, 110 MB at most.
DEFAULT_MAX_READ_ENTRIES = 250_000


class LedgerStore(Protocol):
    """What the Session and every reader need of a ledger, wherever its entries are kept (`Ledger` here,
    `KernelLedger` in the BPF source). Reads are made under the Session's lock except where said."""

    allocations_total: Counter[tuple[int, Layer]]  # (pid, layer)
    frees_total: Counter[tuple[int, Layer]]
    failures_total: Counter[tuple[Api, int]]  # (api, CUDA error code)
    # Entries a report may copy at once (LedgerReadRefused beyond); 0: no limit (they are kept in the agent).
    read_limit: int

    def apply(self, event: Event) -> None: ...

    def apply_many(self, events: Iterable[Event]) -> None: ...

    def resync(self, entries: Iterable[Outstanding]) -> None: ...

    def forget_counters(self, pid: int) -> None: ...

    def totals(self) -> dict[TotalsKey, tuple[int, int]]: ...

    def pids(self) -> set[int]: ...

    def physical_device_bytes(self, pid: int | None = None, device: int | None = None) -> int: ...

    def stream(self, pids: Collection[int] = (), background: bool = False) -> Iterable[Outstanding]:
        """Every live entry of `pids` (empty: all), to go through outside the lock (copies or reads afresh); a
        `background` pass (the site sample) may wait while a foreground one (a client's) reads the same store."""
        ...

    def stream_batches(self, pids: Collection[int] = ()) -> Iterable[RowBatch]:
        """stream(pids) in batches of rows in columns (RowBatch), the same entries, of `pids` only."""
        ...

    def entries(self, pids: Collection[int] = ()) -> list[Outstanding]:
        """Every live entry of `pids`, as a list (LedgerReadRefused over read_limit)."""
        ...

    def copy_refused(self, pids: Collection[int] = ()) -> LedgerReadRefused | None:
        """What entries(pids) would raise now (None: it would copy them): health that tells before a copy fails."""
        ...

    def entries_later(self, pids: Collection[int] = ()) -> Callable[[], list[Outstanding]]:
        """entries(pids) as at this point of the stream, copied when the function returned is called (on any thread,
        once; LedgerReadRefused now): what must be taken now is, without going through every kernel entry."""
        ...

    def find(self, key: LedgerKey) -> Outstanding | None:
        """One live entry, from any thread; None if it is not there."""
        ...

    def counters(self) -> dict[str, int]:
        """What the store counts of itself (for `kvtrace doctor` and /metrics), by name."""
        ...

    def carry_counters(self, previous: LedgerStore) -> None:
        """Goes on counting where `previous` (the store this one replaces) left off: calls, frees, failures."""
        ...


class Ledger:
    """Outstanding objects and their totals, built from events, every object kept here (a replay, `kvtrace
    run`, the agent with --no-ledger-in-kernel; the kernel ledger's VMM objects)."""

    read_limit = 0  # every entry is in the agent already: a copy of them never needs a limit

    def __init__(self) -> None:
        self._entries: dict[LedgerKey, Outstanding] = {}
        self._bytes: dict[TotalsKey, int] = defaultdict(int)
        self._counts: dict[TotalsKey, int] = defaultdict(int)
        # Per pid: its totals keys and its entries, so that an exit or a context destroy costs what its process
        # held, not the size of the ledger (issue 31: one user may hold a quarter of it).
        self._keys_of: dict[int, set[TotalsKey]] = {}
        self._held: dict[int, dict[LedgerKey, Outstanding]] = {}
        self.allocations_total: Counter[tuple[int, Layer]] = Counter()
        self.frees_total: Counter[tuple[int, Layer]] = Counter()
        self.implicit_frees_total: Counter[int] = Counter()  # per pid: objects dropped by exit/destroy
        self.unknown_frees_total: Counter[tuple[int, Api]] = Counter()
        self.failures_total: Counter[tuple[Api, int]] = Counter()  # (api, error code)

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
        """apply() of each event, in order."""
        for event in events:
            self.apply(event)

    @staticmethod
    def _key(event: Event) -> LedgerKey:
        layer, object_kind, _ = placed(event)
        return _new_tuple(LedgerKey, (event.pid, layer, object_kind, event.address))

    def _insert(self, entry: Outstanding) -> None:
        old = self._entries.get(entry.key)
        if old is not None:  # the same address again: the free was not seen (lost or predates us)
            self._remove(old)
        self._entries[entry.key] = entry
        pid, layer, object_kind, _ = entry.key
        held = self._held.get(pid)
        if held is None:
            held = self._held[pid] = {}
        held[entry.key] = entry
        if object_kind in _MEMORY_OBJECTS:
            totals = _new_tuple(TotalsKey, (pid, entry.device, layer, entry.memory))
            if totals not in self._counts:
                self._keys_of.setdefault(pid, set()).add(totals)
            self._bytes[totals] += entry.size_bytes
            self._counts[totals] += 1

    def _remove(self, entry: Outstanding) -> None:
        del self._entries[entry.key]
        pid, layer, object_kind, _ = entry.key
        held = self._held[pid]
        del held[entry.key]
        if not held:
            del self._held[pid]
        if object_kind in _MEMORY_OBJECTS:
            totals = _new_tuple(TotalsKey, (pid, entry.device, layer, entry.memory))
            self._bytes[totals] -= entry.size_bytes
            self._counts[totals] -= 1
            if self._counts[totals] == 0:
                del self._bytes[totals], self._counts[totals]
                keys = self._keys_of[pid]
                keys.discard(totals)
                if not keys:
                    del self._keys_of[pid]

    def _on_alloc(self, event: Event) -> None:
        layer, object_kind, memory = placed(event)
        self.allocations_total[(event.pid, layer)] += 1
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
        held = self._held.get(pid)
        if held is None:  # (most exits, where the kernel keeps the allocations)
            return 0
        doomed = [e for e in held.values()  # its own entries only: no look at the others'
                  if e.timestamp_ns <= before_ns and (device is None or e.device == device)]
        for entry in doomed:
            self._remove(entry)
        self.implicit_frees_total[pid] += len(doomed)
        return len(doomed)

    def forget_counters(self, pid: int) -> None:
        """After the process is gone: its per-pid counters go too, or a host that runs many short
        CUDA processes would grow the agent without end. Its entries are dropped by drop_process."""
        for layer in Layer:  # each (pid, ...) key by name: an exit costs the same however many processes there are
            self.allocations_total.pop((pid, layer), None)
            self.frees_total.pop((pid, layer), None)
        for api in Api:
            self.unknown_frees_total.pop((pid, api), None)
        self.implicit_frees_total.pop(pid, None)

    def resync(self, entries: Iterable[Outstanding]) -> None:
        """Replaces the outstanding set with an exact copy (the kernel's), keeping known stacks."""
        old = self._entries
        self._entries, self._bytes, self._counts = {}, defaultdict(int), defaultdict(int)
        self._keys_of, self._held = {}, {}
        for entry in entries:
            previous = old.pop(entry.key, None)  # dropped as it is replaced: one copy at a time
            if previous is not None and previous.timestamp_ns == entry.timestamp_ns and not entry.stack_id:
                entry.stack_id = previous.stack_id
            self._insert(entry)

    # ---- views ----

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Outstanding]:
        return iter(self.entries())

    def kept(self, pids: Collection[int] = ()) -> list[Outstanding]:
        """The entries of `pids` (empty: all) kept here, copied now into a new list (safe to keep)."""
        if not pids:
            return list(self._entries.values())
        if len(pids) == 1:  # one process's (a dump's trigger, a report of one pid): its own, not all scanned
            (pid,) = pids
            return list(self._held.get(pid, {}).values())
        return [entry for entry in self._entries.values() if entry.key.pid in pids]

    def stream(self, pids: Collection[int] = (), background: bool = False) -> Iterable[Outstanding]:
        """Every live entry of `pids` (empty: all): here, a copy of the kept ones (none to wait for)."""
        return self.kept(pids)

    def stream_batches(self, pids: Collection[int] = ()) -> Iterable[RowBatch]:
        return EntryBatches(self.kept(pids))

    def entries(self, pids: Collection[int] = ()) -> list[Outstanding]:
        """Every live entry of `pids`, as a new list: here every entry is kept, and a copy needs no limit."""
        return self.kept(pids)

    def copy_refused(self, pids: Collection[int] = ()) -> LedgerReadRefused | None:
        return None

    def entries_later(self, pids: Collection[int] = ()) -> Callable[[], list[Outstanding]]:
        """The entries kept now (a list of them: C speed) with the VMM handles copied now (the only entries
        later events change in place: mapped, released); the others are copied when it is called."""
        refused = self.copy_refused(pids)  # (none here; a subclass that keeps fewer may refuse)
        if refused is not None:
            raise refused
        kept = self.kept(pids)
        changing = [(index, copy.copy(entry)) for index, entry in enumerate(kept)
                    if entry.key.object is ObjectKind.VMM_HANDLE]

        def copied() -> list[Outstanding]:
            entries = [copy.copy(entry) for entry in kept]
            for index, entry in changing:
                entries[index] = entry
            return entries

        return copied

    def find(self, key: LedgerKey) -> Outstanding | None:
        return self._entries.get(key)

    def get(self, key: LedgerKey) -> Outstanding | None:
        """An entry kept here (find, in a KernelLedger, looks in the kernel too)."""
        return self._entries.get(key)

    def counters(self) -> dict[str, int]:
        return {}

    def carry_counters(self, previous: LedgerStore) -> None:
        self.allocations_total, self.frees_total = previous.allocations_total, previous.frees_total
        self.failures_total = previous.failures_total
        if isinstance(previous, Ledger):
            self.implicit_frees_total, self.unknown_frees_total = \
                previous.implicit_frees_total, previous.unknown_frees_total

    def pids(self) -> set[int]:
        return {key.pid for key in self._entries} | {key.pid for key in self._counts}

    def totals(self) -> dict[TotalsKey, tuple[int, int]]:
        """(bytes, count) of memory-holding objects per (pid, device, layer, memory)."""
        return {key: (self._bytes[key], self._counts[key]) for key in self._bytes}

    def totals_of(self, pid: int) -> dict[TotalsKey, tuple[int, int]]:
        """totals() of one process, read without going through the others'."""
        return {key: (self._bytes[key], self._counts[key]) for key in self._keys_of.get(pid, ())}

    def outstanding_bytes(self, pid: int | None = None, device: int | None = None,
                          layers: Iterable[Layer] | None = None,
                          memory: Memory | None = Memory.DEVICE) -> int:
        wanted = set(layers) if layers is not None else None
        return sum(size for key, (size, _) in (self.totals() if pid is None else self.totals_of(pid)).items()
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


def placed(event: Event) -> tuple[Layer, ObjectKind, Memory]:
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
    def of(cls, ledger: LedgerStore) -> LedgerCounts:
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
    # The entry of a key (LedgerStore.find); None: look in `entries` (a view a test built by hand).
    find: Callable[[LedgerKey], Outstanding | None] | None = None
    # Entries an analysis may hold at once (LedgerStore.read_limit: --max-read-entries); 0: no limit.
    read_limit: int = 0

    def pids_with_blocks(self) -> set[int]:
        """Processes holding PyTorch blocks (traced), from the totals."""
        return pids_with_blocks(self.totals)


def pids_with_blocks(totals: Mapping[TotalsKey, tuple[int, int]]) -> set[int]:
    """Processes holding PyTorch blocks (traced), from a ledger's totals."""
    return {key.pid for key, (_, count) in totals.items() if key.layer is Layer.TORCH and count}


def ledger_view(ledger: LedgerStore, wall_ns: int, monotonic_ns: int, with_entries: bool = True,
                titles: dict[int, str] | None = None, traced_only: bool = False,
                predates_agent: frozenset[int] = frozenset()) -> LedgerView:
    """A view of `ledger`, its lock held by the caller; its entries (the site sample's) a background pass."""
    allocations, frees = defaultdict[int, int](int), defaultdict[int, int](int)
    for (pid, layer), count in ledger.allocations_total.items():
        if layer in PHYSICAL_LAYERS:  # the runtime call and the driver call inside it are one
            allocations[pid] += count
    for (pid, layer), count in ledger.frees_total.items():
        if layer in PHYSICAL_LAYERS:
            frees[pid] += count
    entries = ledger.stream(background=True) if with_entries else None
    return LedgerView(wall_ns, monotonic_ns, ledger.totals(), entries, dict(allocations), dict(frees), titles or {},
                      traced_only, predates_agent, ledger.find, ledger.read_limit)
