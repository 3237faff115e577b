"""The ledger where the kernel keeps it: allocations and PyTorch blocks live in the probes' maps, not here.

Allocations and blocks come in millions. The probes keep their entries (ledger.h) and their totals per
(pid, device, layer, memory) exactly, whatever events are lost; the agent keeps neither, and reads them from
the maps when a report asks. What this module owns:
- the agent's side of that bargain: a `Ledger` (model/ledger.py) for the objects that stay in the agent
  (VMM handles, reservations, mappings), the per-pid counters, and the kernel's maps read on demand, all
  behind the one `LedgerStore` interface the Session and every reader use;
- what the agent itself takes out of the kernel's ledger (a context destroy's entries, the blocks of a
  process lowered to depth segments): deleted from the maps in one pass, and taken out of the totals the
  agent reports in the same breath (`_adjustments`, under this object's own lock, which every read of the
  totals takes: no reader sees the kernel's totals without what the agent deleted from them);
- exits, which come in storms (issue 31): an exit costs what its process held, not the size of the maps.
  Its totals leave the kernel at once, found by the keys its events named (`_kernel_keys`; a key no event named,
  its event lost or a quiet PyTorch block's, is taken at the next read of all the totals); its entries are
  hidden from every read at once and deleted by `collect`, a scan of the ledger that the source's loop
  advances a few chunks a turn, for every process gone since it began (`_Gone`);
- who goes first when two read the maps at once: a background reader (the site sample) waits between chunks
  while a foreground one (a listing, a report, a recording's or dump's checkpoint) has a pass open.

Why this module is long: the four are one bargain over the same maps; cut apart, each would reach into the
others' state.

The BPF source makes one while its probes are loaded (BpfSource.start) and gives the Session a plain
`Ledger` again when they go (`detached`).
"""
from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import psutil

from kvtrace.model.events import Event, Kind, Layer, Memory, ObjectKind
from kvtrace.model.ledger import (
    DEFAULT_MAX_READ_ENTRIES,
    EntryBatches,
    Ledger,
    LedgerClosed,
    LedgerKey,
    LedgerReadRefused,
    Outstanding,
    RowBatch,
    TotalsKey,
    placed,
)
from kvtrace.sources.bpf import abi
from kvtrace.sources.bpf.decode import (
    Clock,
    decode_ledger_chunk,
    decode_ledger_entry,
    decode_totals,
    doomed_in_chunk,
    gone_in_chunk,
    ledger_batch_in_chunk,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

# The objects the kernel keeps (their entries and totals): those that come in millions.
COUNTED_OBJECTS = frozenset({ObjectKind.ALLOCATION, ObjectKind.BLOCK})
COUNTED_OBJECT_VALUES = frozenset(kind.value for kind in COUNTED_OBJECTS)
BLOCK_OBJECT_VALUES = frozenset({ObjectKind.BLOCK.value})
# The kernel's totals are read again after a counted event, a deletion by the agent, or this long.
TOTALS_MAX_AGE_NS = 1_000_000_000
# How long a later read (entries_later) may hold the collection of gone processes' entries: a flight dump queued
# behind slow writes is read well within it; one whose read never comes (its writer stopped) holds no longer.
HOLD_SECONDS = 30.0
# What a background pass (the site sample) waits for foreground ones, in all: on a host of few cores two passes at
# once each take twice as long, and a foreground one has someone waiting (a client's listing or report, a dump;
# issue 33: a memory-viz export of 1 000 000 blocks took 4.9–6.2 s instead of 3.1 s in the rounds where a site
# sample began during it).
BACKGROUND_WAIT_SECONDS = 10.0
_COUNTED_LAYERS = frozenset({Layer.RUNTIME, Layer.DRIVER, Layer.TORCH})  # where counted objects live
_ALL_TIME_NS = 2**64 - 1
_new_tuple = tuple.__new__  # a TotalsKey at half a NamedTuple call's cost (each key a run of events names)


class KernelMaps(Protocol):
    """The probes' maps this ledger reads and changes (sources/bpf/loader.py BpfProbes)."""

    def iter_ledger_chunks(self) -> Iterator[tuple[bytes, bytes]]: ...

    def find_ledger_entry(self, key: abi.RawLedgerKey) -> tuple[abi.RawLedgerKey, abi.RawLedgerValue] | None: ...

    def delete_ledger_keys(self, keys: list[abi.RawLedgerKey]) -> list[bool]: ...

    def read_totals(self) -> list[tuple[abi.RawTotalsKey, abi.RawTotalsValue]]: ...

    def totals_of(self, keys: Iterable[abi.RawTotalsKey]) -> list[tuple[abi.RawTotalsKey, abi.RawTotalsValue]]: ...

    def take_totals(self, keys: Iterable[abi.RawTotalsKey]) -> list[tuple[abi.RawTotalsKey, abi.RawTotalsValue]]: ...

    def give_shares(self, entries: Mapping[int, int]) -> None: ...


@dataclass
class _Gone:
    """A process that exited, whose entries still wait in the kernel's ledger for `collect` to delete them."""

    before_ns: int  # kernel clock: its entries are those at most this old (a process that took the pid keeps its own)
    before_wall_ns: int  # the same, on the agent's clock (entries as decoded)
    until_scan: int  # the scan of the ledger that must end before every one of its entries is known deleted
    taken: dict[TotalsKey, list[int]] = field(default_factory=dict)  # its totals as they left the kernel
    adjusted: dict[TotalsKey, list[int]] = field(default_factory=dict)  # what the agent had taken out of them
    dropped: dict[TotalsKey, list[int]] = field(default_factory=dict)  # its entries deleted so far


def _add(sums: dict[TotalsKey, list[int]], totals: Mapping[TotalsKey, tuple[int, int] | list[int]],
         sign: int = 1) -> None:
    for key, (size_bytes, count) in totals.items():
        total = sums.setdefault(key, [0, 0])
        total[0] += sign * size_bytes
        total[1] += sign * count


def raw_totals_key(key: TotalsKey) -> abi.RawTotalsKey:
    return abi.RawTotalsKey(pid=key.pid, device=key.device, layer=int(key.layer), memory=int(key.memory))


class KernelLedger(Ledger):
    """A LedgerStore whose allocations and blocks are the kernel's: `maps` are the probes', `clock` turns
    their times into the agent's, `stack_ids` maps a kernel stack id to the stack the agent named (read
    only), `followed()` the pids the agent follows (empty: every process), and `totals_ever_full()` whether
    the kernel's totals map ever refused a key (then an empty total no longer proves an empty ledger), and
    `alive(pid)` whether a process holds the pid now."""

    def __init__(self, maps: KernelMaps, clock: Clock, stack_ids: Mapping[int, int],
                 followed: Callable[[], frozenset[int]], totals_ever_full: Callable[[], bool] = lambda: False,
                 read_limit: int = DEFAULT_MAX_READ_ENTRIES, alive: Callable[[int], bool] = psutil.pid_exists) -> None:
        super().__init__()
        self._alive = alive
        self._maps, self._clock, self._stack_ids = maps, clock, stack_ids
        self._followed, self._totals_ever_full = followed, totals_ever_full
        self.read_limit = read_limit
        self.reads_refused_total = 0
        # What the agent took out of the kernel's ledger or totals itself (per pid), and the last sum of the
        # kernel's totals with it; guarded by _lock (a deletion runs on the source's thread, reports on theirs).
        self._lock = threading.Lock()
        self._adjustments: dict[int, dict[TotalsKey, list[int]]] = {}
        # The kernel's totals keys of each live process, as its events and the reads of all the totals named
        # them: an exit takes its own without reading everyone's. Filled on the source's thread (events) and
        # under _lock (reads); False in _keys_complete: events were lost since the last read of all.
        self._kernel_keys: dict[int, set[TotalsKey]] = {}
        self._keys_complete = False  # (until the first read of all: the maps may hold what no event named yet)
        # Processes gone whose entries `collect` is deleting; the scan it advances, and the scans begun.
        self._gone: dict[int, _Gone] = {}
        self._gone_befores: dict[int, int] | None = None  # pid -> before_ns, as the scan reads them (None: stale)
        self._scan: Iterator[tuple[bytes, bytes]] | None = None
        self._scans_begun = 0
        self.gone_entries_deleted_total = 0
        self._totals_cache: dict[TotalsKey, tuple[int, int]] = {}
        # Reads of the ledger as at a past moment (entries_later) not done yet, each by its number: `collect` waits
        # for them (the entries of a process gone since must still be there to be read), each until its deadline
        # (monotonic: a read that never comes, its dump not written, holds no longer).
        self._holds: dict[int, float] = {}
        self._hold_numbers = itertools.count()
        self._closed = False  # detached: the probes' maps are closed (a read that comes later must not use them)
        self._totals_read_ns: int | None = None  # monotonic; None: read again at the next use
        # Foreground passes over the kernel's ledger open now (background_waits: a background pass waits for none).
        self._foreground = threading.Condition(threading.RLock())
        self._foreground_passes = 0
        self._giving_way = True  # False once the probes are about to go (stop_giving_way)
        self.background_wait_ns_total = 0

    # ---- events: counted objects only count here ----

    def apply_many(self, events: Iterable[Event]) -> None:
        """apply() of each event, in order, at less cost: an allocation or free of an allocation or block only
        adds to its pid's calls here (the probes changed the kernel's entry and totals), in one pass."""
        allocations, frees = self.allocations_total, self.frees_total
        alloc, free, counted = Kind.ALLOC, Kind.FREE, COUNTED_OBJECTS
        named: set[tuple[int, int, Layer, Memory]] = set()  # the totals keys the run's allocations name
        self._totals_read_ns = None  # first: a run that stops at a bad event has changed the totals too
        try:
            for event in events:
                kind = event.kind
                if kind is alloc and event.object in counted and event.memory is not None and event.layer is not None:
                    allocations[event.pid, event.layer] += 1
                    named.add((event.pid, event.device, event.layer, event.memory))
                elif kind is free and event.object in counted and event.memory is not None \
                        and event.layer is not None:
                    frees[event.pid, event.layer] += 1
                else:
                    self.apply(event)
        finally:
            self._name_keys(named)

    def _name_keys(self, named: Iterable[tuple[int, int, Layer, Memory]]) -> None:
        """The kernel's totals keys these (pid, device, layer, memory) name, known from now (an exit takes them)."""
        kernel_keys = self._kernel_keys
        for key in named:
            keys = kernel_keys.get(key[0])
            if keys is None:
                keys = kernel_keys.setdefault(key[0], set())
            keys.add(_new_tuple(TotalsKey, key))

    def _on_alloc(self, event: Event) -> None:
        if event.object in COUNTED_OBJECTS:  # the kernel keeps the entry and its totals
            layer, _, memory = placed(event)
            self.allocations_total[(event.pid, layer)] += 1
            self._name_keys(((event.pid, event.device, layer, memory),))
            self._totals_read_ns = None
            return
        super()._on_alloc(event)

    def _on_free(self, event: Event) -> None:
        if event.object in COUNTED_OBJECTS:  # the probe sends FREE only for an entry its ledger held
            layer, _, _ = placed(event)
            self.frees_total[(event.pid, layer)] += 1
            self._totals_read_ns = None
            return
        super()._on_free(event)

    # ---- what the agent deletes from the kernel's ledger ----

    def drop(self, pid: int, before_wall_ns: int, device: int | None = None) -> None:
        """What an exit (device None) or a context destroy on `device` freed, after the Session saw the event:
        the pid's entries at most as old as the event leave the kernel's ledger (a reused pid's or a new
        context's stay), and the kernel's totals, which still hold them (the probes did not delete them),
        lose exactly those. From the source's thread, outside the Session's lock.

        A context destroy deletes its entries now, in one pass over the ledger. An exit costs what its process
        held: its totals leave the kernel now (by the keys its events named), its entries are hidden from every
        read now and deleted by `collect`; once a whole scan of the ledger has passed, what a process that took
        the pid meanwhile added is counted again (_resolve)."""
        before_ns = self._clock.monotonic_ns(before_wall_ns)
        if device is not None:
            dropped = delete_entries(self._maps, frozenset((pid,)), before_ns, device, give_back=True)
            with self._lock:
                self._adjust(dropped, -1)
                # (on the source's thread, not under the Session's lock: a Counter's += is one step; nothing
                # in the agent reads this one but tests, after the fact)
                for totals, (_, count) in dropped.items():
                    self.implicit_frees_total[totals.pid] += count
            return
        with self._lock:
            gone = self._gone.get(pid)  # (a process that took the pid exited too, before the scan was over)
            if gone is None:
                gone = self._gone[pid] = _Gone(before_ns, before_wall_ns, self._scans_begun + 1)
            gone.before_ns = max(gone.before_ns, before_ns)
            gone.before_wall_ns = max(gone.before_wall_ns, before_wall_ns)
            gone.until_scan = self._scans_begun + 1
            self._gone_befores = None
            keys = self._kernel_keys.pop(pid, set())
            _add(gone.taken, decode_totals(self._maps.take_totals([raw_totals_key(key) for key in keys])))
            _add(gone.adjusted, self._adjustments.pop(pid, {}))
            self._totals_read_ns = None

    def collect(self, budget_seconds: float) -> None:
        """Deletes the entries of processes gone from the kernel's ledger, reading it a chunk at a time for
        about `budget_seconds` (the source's loop calls it every turn: a storm of exits costs a scan of the
        ledger now and then, whatever its size, never a scan each). Nothing to do while no process is gone."""
        if not self._gone or self._reads_waiting():
            return
        deadline = time.monotonic() + budget_seconds
        while True:
            if self._scan is None:
                self._scan = iter(self._maps.iter_ledger_chunks())
                self._scans_begun += 1
            with self._lock:
                if self._gone_befores is None:
                    self._gone_befores = {pid: gone.before_ns for pid, gone in self._gone.items()}
                befores = self._gone_befores
            chunk = next(self._scan, None)
            if chunk is None:  # a whole scan: every process gone before it began has no entry left
                self._scan = None
                self._resolve(self._scans_begun)
                if not self._gone or time.monotonic() >= deadline:
                    return
                continue
            found = gone_in_chunk(chunk[0], chunk[1], befores, COUNTED_OBJECT_VALUES)
            if found:
                deleted = self._maps.delete_ledger_keys([abi.RawLedgerKey.from_buffer_copy(raw) for raw, *_ in found])
                with self._lock:
                    for (_, pid, totals, size_bytes), taken in zip(found, deleted, strict=True):
                        gone = self._gone.get(pid)
                        if taken and totals is not None and gone is not None:
                            _add(gone.dropped, {totals: (size_bytes, 1)})
                    self.gone_entries_deleted_total += sum(deleted)
            if time.monotonic() >= deadline:
                return

    def _resolve(self, scan: int) -> None:
        """The processes gone before `scan` began have no entry left: they are forgotten. A process that took the
        pid meanwhile (alive now) keeps what it added before the exit's totals were taken (what was taken, less
        the dead one's entries deleted and what the agent had taken out itself)."""
        with self._lock:
            for pid, gone in list(self._gone.items()):
                if gone.until_scan > scan:
                    continue
                del self._gone[pid]
                self._gone_befores = None
                # Keys no event named (lost, or a quiet PyTorch block's) and no read of all found since: known now,
                # from the entries deleted and what the agent had taken out of them (a key a reused pid's free made
                # again), and taken as the exit took the others (or they would count for ever).
                unnamed = [raw_totals_key(key) for key in {*gone.dropped, *gone.adjusted} if key not in gone.taken]
                if unnamed:
                    _add(gone.taken, decode_totals(self._maps.take_totals(unnamed)))
                left: dict[TotalsKey, list[int]] = {}
                _add(left, gone.taken)
                _add(left, gone.adjusted)
                _add(left, gone.dropped, -1)
                left = {key: total for key, total in left.items() if total != [0, 0]}
                if left and self._alive(pid):
                    self._adjust(left, 1)
            self._totals_read_ns = None

    def gone_pending(self) -> int:
        """Processes gone whose entries are still being deleted from the kernel's ledger."""
        return len(self._gone)

    def note_events_lost(self) -> None:
        """Events were lost: some totals keys may have been named by none (the next read of all names them)."""
        self._keys_complete = False

    def drop_blocks(self, pids: frozenset[int]) -> dict[TotalsKey, tuple[int, int]]:
        """Every PyTorch block of `pids` out of the kernel's ledger and of the totals (processes lowered to depth
        segments: no free of those blocks will come); (bytes, count) of what went, per totals key."""
        dropped = delete_entries(self._maps, pids, _ALL_TIME_NS, objects=BLOCK_OBJECT_VALUES, give_back=True)
        with self._lock:
            self._adjust(dropped, -1)
        return dropped

    def _adjust(self, totals: Mapping[TotalsKey, tuple[int, int] | list[int]], sign: int) -> None:
        for key, (size_bytes, count) in totals.items():
            adjustments = self._adjustments.setdefault(key.pid, {})
            adjusted = adjustments.setdefault(key, [0, 0])
            adjusted[0] += sign * size_bytes
            adjusted[1] += sign * count
            if adjusted == [0, 0]:
                del adjustments[key]
                if not adjustments:
                    del self._adjustments[key.pid]
        self._totals_read_ns = None

    # ---- reads ----

    def _counted_totals(self) -> dict[TotalsKey, tuple[int, int]]:
        """(bytes, count) of allocations and blocks per (pid, device, layer, memory): the kernel's totals, less
        what the agent took out of the kernel itself; read again after a counted event or a deletion, or
        TOTALS_MAX_AGE_NS after the last read (events lost change the kernel's too)."""
        with self._lock:
            now = time.monotonic_ns()
            if self._totals_read_ns is not None and now - self._totals_read_ns < TOTALS_MAX_AGE_NS:
                return self._totals_cache
            kernel = self._kernel_totals()
            self._learn_keys(kernel)
            sums = {key: [size_bytes, count] for key, (size_bytes, count) in kernel.items()}
            for adjustments in self._adjustments.values():
                _add(sums, adjustments)
            self._totals_cache = _at_least_zero(sums)
            self._totals_read_ns = now
            return self._totals_cache

    def _learn_keys(self, kernel: dict[TotalsKey, tuple[int, int]]) -> None:
        """(Under _lock, after a read of all the kernel's totals.) Every key read is known from now; the keys of a
        process gone (no event named them: lost, or a quiet PyTorch block's) leave the kernel now, taken as its exit
        took the others, and leave `kernel` (the read) too."""
        gone = self._gone
        late = [key for key in kernel if key.pid in gone] if gone else []
        if late:
            ended = {pid for pid in {key.pid for key in late} if not self._alive(pid)}
            late = [key for key in late if key.pid in ended]
            for key, total in decode_totals(self._maps.take_totals([raw_totals_key(key) for key in late])).items():
                _add(self._gone[key.pid].taken, {key: total})
            for key in late:
                del kernel[key]
        kernel_keys = self._kernel_keys
        for key in kernel:
            if key.pid not in gone:
                keys = kernel_keys.get(key.pid)
                if keys is None:
                    keys = kernel_keys[key.pid] = set()
                keys.add(key)
        self._keys_complete = True

    def _counted_totals_of(self, pid: int) -> dict[TotalsKey, tuple[int, int]]:
        """_counted_totals() of one process, read by its own keys (one lookup each) where every key is known."""
        if not self._keys_complete:
            return {key: total for key, total in self._counted_totals().items() if key.pid == pid}
        with self._lock:
            keys = self._kernel_keys.get(pid, ())
            sums = {key: [size_bytes, count] for key, (size_bytes, count) in
                    decode_totals(self._maps.totals_of([raw_totals_key(key) for key in keys])).items()}
            _add(sums, self._adjustments.get(pid, {}))
            return _at_least_zero(sums)

    def _kernel_totals(self) -> dict[TotalsKey, tuple[int, int]]:
        return decode_totals(self._maps.read_totals(), self._followed())

    def totals(self) -> dict[TotalsKey, tuple[int, int]]:
        return _summed(self._counted_totals(), super().totals())

    def totals_of(self, pid: int) -> dict[TotalsKey, tuple[int, int]]:
        """totals() of one process (an exit's freed bytes, physical_device_bytes(pid)): its own keys read, not
        everyone's."""
        return _summed(self._counted_totals_of(pid), super().totals_of(pid))

    def pids(self) -> set[int]:
        return super().pids() | {key.pid for key in self._counted_totals()}

    def __len__(self) -> int:
        return super().__len__() + self.counted_entries()

    def counted_entries(self, pids: Collection[int] = ()) -> int:
        """Allocations and blocks of `pids` (empty: all) in the kernel's ledger, from its totals."""
        return sum(count for totals, (_, count) in self._counted_totals().items()
                   if totals.layer in _COUNTED_LAYERS and (not pids or totals.pid in pids))

    def stream(self, pids: Collection[int] = (), background: bool = False) -> Iterable[Outstanding]:
        """The kept entries copied now; the kernel's read afresh at every pass (outside any lock, without a
        limit): for a reader that goes through them and keeps what it computes, not the entries. A `background`
        pass yields to foreground ones (_ledger_chunks)."""
        return _Entries(self.kept(pids), functools.partial(self.read_kernel, background=background), frozenset(pids))

    def stream_batches(self, pids: Collection[int] = ()) -> Iterable[RowBatch]:
        """stream(pids) in batches of rows in columns (model.ledger.RowBatch): the kernel's a chunk at a time, made
        from its maps' bytes, without an Outstanding, or a tuple, each (a listing in columns of millions)."""
        return _Entries(EntryBatches(self.kept(pids)), self.read_kernel_batches, frozenset(pids))

    def entries(self, pids: Collection[int] = ()) -> list[Outstanding]:
        """Every entry of `pids` as a list: LedgerReadRefused (counted) over read_limit."""
        refused = self.copy_refused(pids)
        if refused is not None:
            self.reads_refused_total += 1
            raise refused
        return [*self.kept(pids), *self.read_kernel(pids)]

    def copy_refused(self, pids: Collection[int] = ()) -> LedgerReadRefused | None:
        counted = self.counted_entries(pids)
        return LedgerReadRefused(counted, self.read_limit) if counted > self.read_limit else None

    def entries_later(self, pids: Collection[int] = ()) -> Callable[[], list[Outstanding]]:
        """Every entry of `pids` as at now, read when the function returned is called, on any thread, once
        (LedgerReadRefused now, counted, over read_limit): a flight dump's checkpoint, read off the loop and
        outside the Session's lock (issue 31: a copy of 262 144 entries under it stalled the loop 1.9 s).

        The kept objects are taken now (Ledger.entries_later), the kernel's are read then: those of processes
        gone before now are left out as a read now would; those of processes gone since are still there, for
        `collect` waits until the read is done (HOLD_SECONDS at most: a read that never comes holds no longer);
        those made since are left out (by their time); the processes are those followed now. What a process
        frees in between (or a context destroy drops) is not in the read: the kernel keeps no past."""
        try:
            kept = super().entries_later(pids)
        except LedgerReadRefused:
            self.reads_refused_total += 1
            raise
        as_of_ns = self._clock.wall_ns(time.monotonic_ns())
        # Now: a process that exits leaves the followed set, and its stacks' names are forgotten.
        wanted = frozenset(pids) or self._followed()
        stack_ids = dict(self._stack_ids)
        gone = self._gone_wall_befores()
        with self._lock:
            number = next(self._hold_numbers)
            self._holds[number] = time.monotonic() + HOLD_SECONDS

        def read() -> list[Outstanding]:
            try:
                with self._lock:
                    late = number not in self._holds
                if late:  # (its deadline passed: the dead process's entries may be collected already)
                    log.warning("a flight dump's checkpoint is read more than %g s after its trigger: the dead "
                                "process's objects may be missing from it", HOLD_SECONDS)
                entries = kept()
                entries.extend(entry for entry in self.read_kernel(wanted, gone, stack_ids)
                               if entry.timestamp_ns <= as_of_ns)
                return entries
            finally:
                with self._lock:
                    self._holds.pop(number, None)

        return read

    def find(self, key: LedgerKey) -> Outstanding | None:
        if key.object not in COUNTED_OBJECTS:
            return super().find(key)
        found = self._maps.find_ledger_entry(abi.RawLedgerKey(
            pid=key.pid, layer=key.layer.value, object=key.object.value, address=key.address))
        if found is None:
            return None
        try:
            entry = decode_ledger_entry(found[0], found[1], self._clock)
        except ValueError:
            return None
        gone = self._gone.get(key.pid)
        if gone is not None and entry.timestamp_ns <= gone.before_wall_ns:
            return None  # its process is gone: the entry waits for collect
        if found[1].stack_id:
            entry.stack_id = self._stack_ids.get(found[1].stack_id, 0)
        return entry

    def read_kernel_batches(self, pids: Collection[int] = ()) -> Iterator[RowBatch]:
        """read_kernel(pids) a chunk at a time, as batches of rows in columns (model.ledger.RowBatch); the maps
        read as they are gone through."""
        wanted = frozenset(pids) or self._followed()
        if self._none_counted(wanted):
            return iter(())
        gone = self._gone_wall_befores()
        clock, stack_ids = self._clock, self._stack_ids
        return (ledger_batch_in_chunk(keys, values, clock, stack_ids, COUNTED_OBJECT_VALUES, wanted, gone)
                for keys, values in self._ledger_chunks())

    def _gone_wall_befores(self) -> Mapping[int, int]:
        """pid -> wall time, of the processes gone now: their entries as old or older wait for `collect`."""
        with self._lock:
            return {pid: gone.before_wall_ns for pid, gone in self._gone.items()}

    def _ledger_chunks(self, background: bool = False) -> Iterator[tuple[bytes, bytes]]:
        """The kernel's ledger a chunk at a time, for a reader on any thread: LedgerClosed once the probes' maps
        are closed (checked at each chunk: they may close while a read goes through them).

        A foreground pass counts as open from its first chunk until it ends or is dropped (a listing's, across
        its pages). A `background` pass, before it reads each chunk, waits while one is open, at most
        BACKGROUND_WAIT_SECONDS of waiting in all (a listing whose client went away stays open until a later
        listing finds it idle, or it is crowded out)."""
        if background:
            chunks = iter(self._maps.iter_ledger_chunks())
            budget_ns = int(BACKGROUND_WAIT_SECONDS * 1e9)
            while True:
                if budget_ns > 0:
                    budget_ns -= self._wait_for_foreground(budget_ns)
                chunk = next(chunks, None)
                if chunk is None:
                    return
                self._check_open()
                yield chunk
        with self._foreground:
            self._foreground_passes += 1
        try:
            for chunk in self._maps.iter_ledger_chunks():
                self._check_open()
                yield chunk
        finally:  # (also where the collector finalizes a dropped pass, on any thread: the lock is re-entrant)
            with self._foreground:
                self._foreground_passes -= 1
                self._foreground.notify_all()

    def _check_open(self) -> None:
        if self._closed:
            raise LedgerClosed("the probes stopped (their maps closed) before the ledger was read")

    def stop_giving_way(self) -> None:
        """The probes go soon: background passes read on without waiting (a stop waits for them, and a listing
        left open by the servers' stop must not hold it)."""
        with self._foreground:
            self._giving_way = False
            self._foreground.notify_all()

    def _wait_for_foreground(self, budget_ns: int) -> int:
        """Waits until no foreground pass is open, `budget_ns` at most; the nanoseconds it waited."""
        with self._foreground:
            if not self._foreground_passes or not self._giving_way:
                return 0
            started = time.monotonic_ns()
            self._foreground.wait_for(lambda: not self._foreground_passes or not self._giving_way, budget_ns / 1e9)
            waited = time.monotonic_ns() - started
            self.background_wait_ns_total += waited
            return waited

    def _none_counted(self, wanted: frozenset[int]) -> bool:
        """None by the kernel's totals, while they count every entry (never full, nothing taken out of them by the
        agent, no exit's totals taken while a process that reused the pid may hold entries): no scan of an empty
        map's buckets."""
        return not self._totals_ever_full() and not self._adjustments and not self._gone and not any(
            value.count for key, value in self._maps.read_totals() if not wanted or key.pid in wanted)

    def read_kernel(self, pids: Collection[int] = (), gone_before: Mapping[int, int] | None = None,
                    stack_ids: Mapping[int, int] | None = None, background: bool = False) -> Iterator[Outstanding]:
        """The kernel's allocations and blocks of `pids` (empty: every followed process), from any thread,
        decoded a chunk at a time, with the stacks already named (each allocation's event named its stack; one
        whose event was lost is named at the resync that follows). `gone_before`: pid -> wall time, the
        processes gone whose entries are left out (None: those gone now); `stack_ids`: the names of stacks to
        use (None: those known now); `background`: it yields to foreground reads (_ledger_chunks)."""
        wanted = frozenset(pids) or self._followed()
        if stack_ids is None:
            stack_ids = self._stack_ids
        if self._none_counted(wanted):
            return
        gone = self._gone_wall_befores() if gone_before is None else gone_before
        for keys, values in self._ledger_chunks(background):
            for entry, kernel_stack_id in decode_ledger_chunk(keys, values, self._clock, COUNTED_OBJECT_VALUES,
                                                             wanted):
                if gone and entry.timestamp_ns <= gone.get(entry.key.pid, -1):
                    continue  # its process is gone: the entry waits for collect
                if kernel_stack_id:
                    entry.stack_id = stack_ids.get(kernel_stack_id, 0)
                yield entry

    def counters(self) -> dict[str, int]:
        return {"ledger_entries_in_kernel": self.counted_entries(), "ledger_reads_refused": self.reads_refused_total,
                "exits_collecting": len(self._gone), "exit_entries_collected": self.gone_entries_deleted_total,
                "ledger_background_wait_ms": self.background_wait_ns_total // 1_000_000}

    def _reads_waiting(self) -> bool:
        """Whether a later read waits (its deadline not passed); those past theirs are let go."""
        now = time.monotonic()
        with self._lock:
            for number in [number for number, until in self._holds.items() if until <= now]:
                del self._holds[number]
            return bool(self._holds)

    def detached(self) -> Ledger:
        """A plain Ledger with what is kept here (VMM objects, and the counters): the probes and their maps are
        going (a later read not done yet fails, LedgerClosed, rather than read them)."""
        self._closed = True
        ledger = Ledger()
        ledger._entries, ledger._bytes, ledger._counts = self._entries, self._bytes, self._counts
        ledger._keys_of, ledger._held = self._keys_of, self._held
        ledger.carry_counters(self)
        return ledger


def _at_least_zero(sums: Mapping[TotalsKey, list[int]]) -> dict[TotalsKey, tuple[int, int]]:
    """Never below zero: a probe's two adds (bytes, count) are apart by an instant, and a free racing an allocation
    at the same address can take the old size out of the new entry's totals (ledger.h)."""
    return {key: (max(size_bytes, 0), max(count, 0)) for key, (size_bytes, count) in sums.items()
            if size_bytes > 0 or count > 0}


def _summed(*totals: Mapping[TotalsKey, tuple[int, int]]) -> dict[TotalsKey, tuple[int, int]]:
    sums: dict[TotalsKey, list[int]] = {}
    for each in totals:
        _add(sums, each)
    return {key: (size_bytes, count) for key, (size_bytes, count) in sums.items()}


def delete_entries(maps: KernelMaps, pids: frozenset[int], before_ns: int, device: int | None = None,
                   objects: frozenset[int] | None = None, give_back: bool = False) -> dict[TotalsKey, tuple[int, int]]:
    """Deletes the kernel ledger's entries of `pids` at most `before_ns` old (kernel clock; on `device`, of
    `objects`, if given), in one pass; returns (bytes, count) per totals key of the counted ones it took. (The
    probes keep their ledger whether or not the agent reads it from there: an exit's entries go either way.)

    `give_back`: the processes are alive (a context destroy, blocks lowered to segments), and every entry taken
    goes back to its process's share of the ledger (shares.h kvt_share_return), as a probe's delete gives it
    back: else a long-lived process would stay charged for entries long gone, and be refused. (An exit's need
    not: its share was released whole at its exit.)"""
    doomed = [found for keys, values in maps.iter_ledger_chunks()
              for found in doomed_in_chunk(keys, values, pids, before_ns, device, COUNTED_OBJECT_VALUES,
                                           objects=objects)]
    raw_keys = [abi.RawLedgerKey.from_buffer_copy(raw) for raw, _, _ in doomed]
    deleted = maps.delete_ledger_keys(raw_keys)
    if give_back:
        given: dict[int, int] = {}
        for raw_key, taken in zip(raw_keys, deleted, strict=True):
            if taken:  # not taken: a probe freed it meanwhile, and gave it back itself
                given[raw_key.pid] = given.get(raw_key.pid, 0) + 1
        if given:
            maps.give_shares(given)
    sums: dict[TotalsKey, tuple[int, int]] = {}
    for (_, totals, size_bytes), taken in zip(doomed, deleted, strict=True):
        if taken and totals is not None:  # not taken: a probe freed it meanwhile, and took its own out
            size, count = sums.get(totals, (0, 0))
            sums[totals] = (size + size_bytes, count + 1)
    return sums


class _Entries(Generic[T]):
    """The entries (or rows) of a KernelLedger's stream: the kept ones as copied, then the kernel's read afresh at
    every pass (each pass is a moment's view of maps the probes go on changing)."""

    def __init__(self, kept: Iterable[T], read: Callable[[Collection[int]], Iterator[T]], pids: frozenset[int]) -> None:
        self._kept, self._read, self._pids = kept, read, pids

    def __iter__(self) -> Iterator[T]:
        return itertools.chain(self._kept, self._read(self._pids))  # (the kernel's read when iteration starts)

