"""The ledger where the kernel keeps it: allocations and PyTorch blocks live in the probes' maps, not here.

Allocations and blocks come in millions. The probes keep their entries (ledger.h) and their totals per
(pid, device, layer, memory) exactly, whatever events are lost; the agent keeps neither, and reads them from
the maps when a report asks. What this module owns:
- the agent's side of that bargain: a `Ledger` (model/ledger.py) for the objects that stay in the agent
  (VMM handles, reservations, mappings), the per-pid counters, and the kernel's maps read on demand, all
  behind the one `LedgerStore` interface the Session and every reader use;
- what the agent itself takes out of the kernel's ledger (an exit's or a context destroy's entries, the
  blocks of a process lowered to depth segments): deleted from the maps in one pass, and taken out of the
  totals the agent reports in the same breath (`_adjustments`, under this object's own lock, which every
  read of the totals takes: no reader sees the kernel's totals without what the agent deleted from them).

The BPF source makes one while its probes are loaded (BpfSource.start) and gives the Session a plain
`Ledger` again when they go (`detached`).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from typing import Protocol

from kvtrace.model.events import Event, Kind, Layer, ObjectKind
from kvtrace.model.ledger import (
    DEFAULT_MAX_READ_ENTRIES,
    Ledger,
    LedgerKey,
    LedgerReadRefused,
    Outstanding,
    TotalsKey,
    placed,
)
from kvtrace.sources.bpf import abi
from kvtrace.sources.bpf.decode import Clock, decode_ledger_chunk, decode_ledger_entry, decode_totals, doomed_in_chunk

log = logging.getLogger(__name__)

# The objects the kernel keeps (their entries and totals): those that come in millions.
COUNTED_OBJECTS = frozenset({ObjectKind.ALLOCATION, ObjectKind.BLOCK})
COUNTED_OBJECT_VALUES = frozenset(kind.value for kind in COUNTED_OBJECTS)
BLOCK_OBJECT_VALUES = frozenset({ObjectKind.BLOCK.value})
# The kernel's totals are read again after a counted event, a deletion by the agent, or this long.
TOTALS_MAX_AGE_NS = 1_000_000_000
_COUNTED_LAYERS = frozenset({Layer.RUNTIME, Layer.DRIVER, Layer.TORCH})  # where counted objects live
_ALL_TIME_NS = 2**64 - 1


class KernelMaps(Protocol):
    """The probes' maps this ledger reads and changes (sources/bpf/loader.py BpfProbes)."""

    def iter_ledger_chunks(self) -> Iterator[tuple[bytes, bytes]]: ...

    def find_ledger_entry(self, key: abi.RawLedgerKey) -> tuple[abi.RawLedgerKey, abi.RawLedgerValue] | None: ...

    def delete_ledger_keys(self, keys: list[abi.RawLedgerKey]) -> list[bool]: ...

    def read_totals(self) -> list[tuple[abi.RawTotalsKey, abi.RawTotalsValue]]: ...

    def take_totals(self, pid: int) -> list[tuple[abi.RawTotalsKey, abi.RawTotalsValue]]: ...


class KernelLedger(Ledger):
    """A LedgerStore whose allocations and blocks are the kernel's: `maps` are the probes', `clock` turns
    their times into the agent's, `stack_ids` maps a kernel stack id to the stack the agent named (read
    only), `followed()` the pids the agent follows (empty: every process), and `totals_ever_full()` whether
    the kernel's totals map ever refused a key (then an empty total no longer proves an empty ledger)."""

    def __init__(self, maps: KernelMaps, clock: Clock, stack_ids: Mapping[int, int],
                 followed: Callable[[], frozenset[int]], totals_ever_full: Callable[[], bool] = lambda: False,
                 read_limit: int = DEFAULT_MAX_READ_ENTRIES) -> None:
        super().__init__()
        self._maps, self._clock, self._stack_ids = maps, clock, stack_ids
        self._followed, self._totals_ever_full = followed, totals_ever_full
        self.read_limit = read_limit
        self.reads_refused_total = 0
        # What the agent took out of the kernel's ledger or totals itself, and the last sum of the kernel's
        # totals with it; guarded by _lock (a deletion runs on the source's thread, reports on theirs).
        self._lock = threading.Lock()
        self._adjustments: dict[TotalsKey, list[int]] = {}
        self._totals_cache: dict[TotalsKey, tuple[int, int]] = {}
        self._totals_read_ns: int | None = None  # monotonic; None: read again at the next use

    # ---- events: counted objects only count here ----

    def apply_many(self, events: Iterable[Event]) -> None:
        """apply() of each event, in order, at less cost: an allocation or free of an allocation or block only
        adds to its pid's calls here (the probes changed the kernel's entry and totals), in one pass."""
        allocations, frees = self.allocations_total, self.frees_total
        alloc, free, counted = Kind.ALLOC, Kind.FREE, COUNTED_OBJECTS
        self._totals_read_ns = None  # first: a run that stops at a bad event has changed the totals too
        for event in events:
            kind = event.kind
            if (kind is alloc or kind is free) and event.object in counted and event.memory is not None \
                    and event.layer is not None:
                (allocations if kind is alloc else frees)[event.pid, event.layer] += 1
            else:
                self.apply(event)

    def _on_alloc(self, event: Event) -> None:
        if event.object in COUNTED_OBJECTS:  # the kernel keeps the entry and its totals
            layer, _, _ = placed(event)
            self.allocations_total[(event.pid, layer)] += 1
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
        lose exactly those. After an exit the pid's totals leave the kernel too: what a process that reused
        the pid added meanwhile stays counted here. From the source's thread, outside the Session's lock."""
        dropped = delete_entries(self._maps, frozenset((pid,)), self._clock.monotonic_ns(before_wall_ns), device)
        with self._lock:
            taken = decode_totals(self._maps.take_totals(pid)) if device is None else {}
            self._adjust(dropped, -1)
            if device is not None:  # (after an exit, the pid's counters are gone)
                # (on the source's thread, not under the Session's lock: a Counter's += is one step; nothing
                # in the agent reads this one but tests, after the fact)
                for totals, (_, count) in dropped.items():
                    self.implicit_frees_total[totals.pid] += count
            self._adjust(taken, 1)

    def drop_blocks(self, pids: frozenset[int]) -> dict[TotalsKey, tuple[int, int]]:
        """Every PyTorch block of `pids` out of the kernel's ledger and of the totals (processes lowered to depth
        segments: no free of those blocks will come); (bytes, count) of what went, per totals key."""
        dropped = delete_entries(self._maps, pids, _ALL_TIME_NS, objects=BLOCK_OBJECT_VALUES)
        with self._lock:
            self._adjust(dropped, -1)
        return dropped

    def _adjust(self, totals: Mapping[TotalsKey, tuple[int, int]], sign: int) -> None:
        adjustments = self._adjustments
        for key, (size_bytes, count) in totals.items():
            adjusted = adjustments.setdefault(key, [0, 0])
            adjusted[0] += sign * size_bytes
            adjusted[1] += sign * count
            if adjusted == [0, 0]:
                del adjustments[key]
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
            sums = {key: [size_bytes, count] for key, (size_bytes, count) in self._kernel_totals().items()}
            for key, (size_bytes, count) in self._adjustments.items():
                total = sums.setdefault(key, [0, 0])
                total[0] += size_bytes
                total[1] += count
            # Never below zero: a probe's two adds (bytes, count) are apart by an instant, and a free racing an
            # allocation at the same address can take the old size out of the new entry's totals (ledger.h).
            self._totals_cache = {key: (max(size_bytes, 0), max(count, 0)) for key, (size_bytes, count)
                                  in sums.items() if size_bytes > 0 or count > 0}
            self._totals_read_ns = now
            return self._totals_cache

    def _kernel_totals(self) -> dict[TotalsKey, tuple[int, int]]:
        return decode_totals(self._maps.read_totals(), self._followed())

    def totals(self) -> dict[TotalsKey, tuple[int, int]]:
        totals = dict(self._counted_totals())
        for key, (size_bytes, count) in super().totals().items():
            counted = totals.get(key)
            totals[key] = (size_bytes, count) if counted is None else (size_bytes + counted[0], count + counted[1])
        return totals

    def pids(self) -> set[int]:
        return super().pids() | {key.pid for key in self._counted_totals()}

    def __len__(self) -> int:
        return super().__len__() + self.counted_entries()

    def counted_entries(self, pids: Collection[int] = ()) -> int:
        """Allocations and blocks of `pids` (empty: all) in the kernel's ledger, from its totals."""
        return sum(count for totals, (_, count) in self._counted_totals().items()
                   if totals.layer in _COUNTED_LAYERS and (not pids or totals.pid in pids))

    def stream(self, pids: Collection[int] = ()) -> Iterable[Outstanding]:
        """The kept entries copied now; the kernel's read afresh at every pass (outside any lock, without a
        limit): for a reader that goes through them and keeps what it computes, not the entries."""
        return _Entries(self.kept(pids), self.read_kernel, frozenset(pids))

    def entries(self, pids: Collection[int] = ()) -> list[Outstanding]:
        """Every entry of `pids` as a list: LedgerReadRefused (counted) over read_limit."""
        counted = self.counted_entries(pids)
        if counted > self.read_limit:
            self.reads_refused_total += 1
            raise LedgerReadRefused(counted, self.read_limit)
        return [*self.kept(pids), *self.read_kernel(pids)]

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
        if found[1].stack_id:
            entry.stack_id = self._stack_ids.get(found[1].stack_id, 0)
        return entry

    def read_kernel(self, pids: Collection[int] = ()) -> Iterator[Outstanding]:
        """The kernel's allocations and blocks of `pids` (empty: every followed process), from any thread,
        decoded a chunk at a time, with the stacks already named (each allocation's event named its stack; one
        whose event was lost is named at the resync that follows)."""
        wanted = frozenset(pids) or self._followed()
        stack_ids = self._stack_ids
        maps = self._maps
        if not self._totals_ever_full() and not self._adjustments and not any(
                value.count for key, value in maps.read_totals() if not wanted or key.pid in wanted):
            # None by the kernel's totals, while they count every entry (never full, nothing taken out of them
            # by the agent, as after an exit a process that reused the pid): no scan of an empty map's buckets.
            return
        for keys, values in maps.iter_ledger_chunks():
            for entry, kernel_stack_id in decode_ledger_chunk(keys, values, self._clock, COUNTED_OBJECT_VALUES,
                                                             wanted):
                if kernel_stack_id:
                    entry.stack_id = stack_ids.get(kernel_stack_id, 0)
                yield entry

    def counters(self) -> dict[str, int]:
        return {"ledger_entries_in_kernel": self.counted_entries(), "ledger_reads_refused": self.reads_refused_total}

    def detached(self) -> Ledger:
        """A plain Ledger with what is kept here (VMM objects, and the counters): the probes and their maps are
        going."""
        ledger = Ledger()
        ledger._entries, ledger._bytes, ledger._counts = self._entries, self._bytes, self._counts
        ledger.carry_counters(self)
        return ledger


def delete_entries(maps: KernelMaps, pids: frozenset[int], before_ns: int, device: int | None = None,
                   objects: frozenset[int] | None = None) -> dict[TotalsKey, tuple[int, int]]:
    """Deletes the kernel ledger's entries of `pids` at most `before_ns` old (kernel clock; on `device`, of
    `objects`, if given), in one pass; returns (bytes, count) per totals key of the counted ones it took. (The
    probes keep their ledger whether or not the agent reads it from there: an exit's entries go either way.)"""
    doomed = [found for keys, values in maps.iter_ledger_chunks()
              for found in doomed_in_chunk(keys, values, pids, before_ns, device, COUNTED_OBJECT_VALUES,
                                           objects=objects)]
    deleted = maps.delete_ledger_keys([abi.RawLedgerKey.from_buffer_copy(raw) for raw, _, _ in doomed])
    sums: dict[TotalsKey, tuple[int, int]] = {}
    for (_, totals, size_bytes), taken in zip(doomed, deleted, strict=True):
        if taken and totals is not None:  # not taken: a probe freed it meanwhile, and took its own out
            size, count = sums.get(totals, (0, 0))
            sums[totals] = (size + size_bytes, count + 1)
    return sums


class _Entries:
    """The entries of a KernelLedger's stream: the kept ones as copied, then the kernel's read afresh at every
    pass (each pass is a moment's view of maps the probes go on changing)."""

    def __init__(self, kept: list[Outstanding], read: Callable[[Collection[int]], Iterator[Outstanding]],
                 pids: frozenset[int]) -> None:
        self._kept, self._read, self._pids = kept, read, pids

    def __iter__(self) -> Iterator[Outstanding]:
        yield from self._kept
        yield from self._read(self._pids)

