"""Leak suspects: outstanding device memory at least a given age, grouped by allocation site
(the PyTorch block's stack where blocks are traced).

"Suspect" is the honest word (memleak says "outstanding", not "leaked"): model weights and the KV
cache are old and outstanding too. What separates a leak is growth, so the ranking puts it first:

1. growth of the site's outstanding bytes over the last 15 min, largest first (a site whose memory
   keeps piling up is the classic leak; flat old memory such as weights reads 0);
2. then outstanding bytes of the suspect allocations, largest first;
3. then their count, then the oldest age (older first), then pid, device and site (a stable order).

A site is, in one process and on one GPU, the Python stack of the allocation; without one (no
Python, or the walk failed), the native code that called CUDA. What counts: in a process whose
PyTorch blocks are traced, its blocks (the tensors that hold memory); elsewhere physical device
memory, the driver and VMM layers as in the ledger's totals, so that a cudaMalloc and the
cuMemAlloc_v2 inside it are one allocation.

Under stack sampling of blocks (--block-sample-bytes S: only some blocks' stacks are walked), a site's
bytes and count are estimates (model/blocks.py estimated_bytes: each chosen block weighed by the inverse
of its chance to be chosen), and its oldest age is its oldest chosen block's; a block passed over has no
stack and stands for nothing of its own (the chosen ones stand for it), so it never makes a site of
unknown stack. Such a suspect says so (LeakSuspect.estimated). How many blocks were considered and how
many are old enough stay exact counts.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from kvtrace.model.blocks import estimated_bytes
from kvtrace.model.events import Layer, ObjectKind
from kvtrace.model.findings import LeakReport, LeakSuspect
from kvtrace.model.ledger import LedgerKey, Outstanding, holds_device_memory
from kvtrace.model.stacks import Stack

NS_PER_SECOND = 1_000_000_000
# Looked up once: these run per ledger entry, and an enum attribute costs a lookup each time.
_RUNTIME, _DRIVER, _ALLOCATION, _BLOCK = Layer.RUNTIME, Layer.DRIVER, ObjectKind.ALLOCATION, ObjectKind.BLOCK


class SiteKey(NamedTuple):
    """Where allocations come from: (pid, device, Python stack) or, with no stack (stack_id 0),
    (pid, device, native caller address)."""

    pid: int
    device: int
    stack_id: int
    caller_address: int  # 0 when stack_id is set: the stack alone names the site


class RuntimeCall(Protocol):
    """What a site needs of the runtime allocation above a driver one: an Outstanding, or less."""

    @property
    def stack_id(self) -> int: ...

    @property
    def caller_address(self) -> int: ...


class Above(NamedTuple):
    """A runtime allocation's stack and caller, as a pass over the ledger keeps them (RuntimeIndex)."""

    stack_id: int
    caller_address: int


Find = Callable[[LedgerKey], RuntimeCall | None]  # one ledger entry by key (None: not there)


class RuntimeIndex:
    """The runtime allocations (cudaMalloc) of one pass over the ledger, by (pid, pointer): their stack and
    caller only, for the driver allocations of the same pass without a stack (a dict built from the pass's
    own entries, where a lookup in the kernel's map was a system call per entry). `find` is a Find.

    Kept small, for it holds every runtime allocation until the pass ends: keyed by one int (pid << 64 |
    pointer), each distinct (stack, caller) one shared Above; about 90 bytes an allocation instead of 270 (a
    site sample over 1 000 000 cudaMalloc grew the agent by 260 MiB)."""

    def __init__(self) -> None:
        self.above: dict[int, Above] = {}
        self._shared: dict[Above, Above] = {}

    def add(self, entry: Outstanding) -> None:
        key = entry.key
        if key.layer is _RUNTIME and key.object is _ALLOCATION:
            above = Above(entry.stack_id, entry.caller_address)
            self.above[key.pid << 64 | key.address] = self._shared.setdefault(above, above)

    def find(self, key: LedgerKey) -> Above | None:
        return self.above.get(key.pid << 64 | key.address) if key.layer is _RUNTIME else None

    def stack(self, pid: int, address: int) -> int:
        above = self.above.get(pid << 64 | address)
        return above.stack_id if above is not None else 0


def runtime_allocations(entries: Iterable[Outstanding]) -> dict[tuple[int, int], Outstanding]:
    """Runtime-layer allocations by (pid, address): cudaMalloc returns the pointer of the
    cuMemAlloc_v2 inside it, so this finds the runtime call above a driver allocation."""
    return {(entry.key.pid, entry.key.address): entry for entry in entries
            if entry.key.layer is _RUNTIME and entry.key.object is _ALLOCATION}


def find_in(entries: Iterable[Outstanding]) -> Find:
    """A lookup over entries held in memory (a replay, a test): the runtime allocations, by key."""
    runtime = runtime_allocations(entries)
    return lambda key: runtime.get((key.pid, key.address)) if key.layer is _RUNTIME else None


def runtime_above(entry: Outstanding, find: Find) -> RuntimeCall | None:
    """The runtime allocation (cudaMalloc) around a driver allocation (its cuMemAlloc_v2: same pid and
    pointer), None for other entries or where there is none."""
    if entry.key.layer is not _DRIVER:
        return None
    return find(LedgerKey(entry.key.pid, _RUNTIME, _ALLOCATION, entry.key.address))


def site_of(entry: Outstanding, find: Find) -> tuple[SiteKey, int]:
    """(site, native caller address) of a device-memory entry.

    The driver call's caller is libcudart for every cudaMalloc, which says nothing; the runtime
    entry above it (same pid and pointer) has the caller that matters, and its stack if the driver
    entry has none."""
    stack_id, caller = entry.stack_id, entry.caller_address
    above = runtime_above(entry, find)
    if above is not None:
        stack_id = stack_id or above.stack_id
        caller = above.caller_address or caller
    return SiteKey(entry.key.pid, entry.device, stack_id, 0 if stack_id else caller), caller


@dataclass(frozen=True)
class SiteSurvey:
    """One pass over the ledger: every site's outstanding device bytes, and the allocations old
    enough to be suspects, grouped by site (not ranked yet: that needs the growth)."""

    timestamp_ns: int
    min_age_seconds: float
    # all ages: the series whose growth ranks suspects (estimates, rounded, where blocks' stacks are sampled)
    site_bytes: dict[SiteKey, int]
    # site -> [bytes, count, oldest timestamp_ns, that entry's caller, estimated]: bytes and count are
    # estimates where `estimated` (stack sampling), else exact
    old: dict[SiteKey, list]
    allocations_considered: int
    suspect_allocations: int


class SiteTally:
    """survey_sites() one entry at a time (`add`), for a pass over the ledger that computes other things from
    the same entries too (analyzer.sample_sites); `finish(find)` gives the survey. A driver allocation without
    a stack is held until `finish` (the runtime call above it names its site, and the pass may not have seen it
    yet); nothing else is kept per entry."""

    def __init__(self, now_ns: int, min_age_seconds: float, with_blocks: Collection[int],
                 pids: Collection[int] = ()) -> None:
        self._now_ns, self._min_age_seconds = now_ns, min_age_seconds
        self._min_age_ns = int(min_age_seconds * NS_PER_SECOND)
        self._with_blocks, self._pids = with_blocks, pids
        self._totals: dict[SiteKey, float] = {}
        self._old: dict[SiteKey, list] = {}
        self._considered = self._old_count = 0
        self.unstacked: list[Outstanding] = []  # driver allocations without a stack: sited at finish

    def add(self, entry: Outstanding) -> None:
        pid = entry.key.pid
        if self._pids and pid not in self._pids:
            return
        if not (entry.key.object is _BLOCK if pid in self._with_blocks else holds_device_memory(entry)):
            return
        if not entry.stack_id and entry.key.layer is _DRIVER:
            self.unstacked.append(entry)  # the runtime call above names the site (finish)
            return
        self._count(entry, SiteKey(pid, entry.device, entry.stack_id, 0 if entry.stack_id else entry.caller_address),
                    -1)  # the caller shown is looked up once per site, for its oldest entry only (finish)

    def _count(self, entry: Outstanding, site: SiteKey, caller: int) -> None:
        self._considered += 1
        is_old = self._now_ns - entry.timestamp_ns >= self._min_age_ns
        self._old_count += is_old
        size_bytes: float = entry.size_bytes
        weight, estimated = 1.0, False
        if entry.sample_bytes:  # a block under stack sampling: its weight, or none if passed over
            if not entry.sampled:
                return
            size_bytes = estimated_bytes(entry)
            if entry.size_bytes:
                weight = size_bytes / entry.size_bytes
            estimated = entry.size_bytes < entry.sample_bytes
        totals = self._totals
        totals[site] = totals.get(site, 0) + size_bytes
        if not is_old:
            return
        group = self._old.get(site)
        if group is None:
            self._old[site] = [size_bytes, weight, entry.timestamp_ns, caller, estimated, entry]
        else:
            group[0] += size_bytes
            group[1] += weight
            group[4] = group[4] or estimated
            if entry.timestamp_ns < group[2]:
                group[2], group[3], group[5] = entry.timestamp_ns, caller, entry

    def finish(self, find: Find) -> SiteSurvey:
        """The survey, once every entry was added; `find`: the runtime allocation above a driver one."""
        for entry in self.unstacked:
            site, caller = site_of(entry, find)
            self._count(entry, site, caller)
        self.unstacked = []
        for group in self._old.values():
            oldest = group.pop()
            if group[3] == -1:
                group[3] = site_of(oldest, find)[1]
        site_bytes = {site: round(size_bytes) for site, size_bytes in self._totals.items()}
        return SiteSurvey(self._now_ns, self._min_age_seconds, site_bytes, self._old, self._considered,
                          self._old_count)


def survey_sites(entries: Iterable[Outstanding], now_ns: int, min_age_seconds: float,
                 pids: Collection[int] = (), find: Find | None = None,
                 with_blocks: Collection[int] | None = None) -> SiteSurvey:
    """What holds device memory in `pids` (empty: all), by site; what is at least `min_age_seconds`
    old apart. In a process whose PyTorch blocks are traced, the blocks: their stacks hold the
    memory, where a segment's names whoever made the allocator's cache grow. Elsewhere (no PyTorch,
    or blocks not traced) the physical allocations.

    One pass, keeping per site (and per stackless driver allocation), not per entry, where `find` (the runtime
    allocation above a driver one) and `with_blocks` (the pids with blocks) are given: the agent goes through
    millions of the kernel's entries so. Without them they are found in `entries`, which are then held in
    memory. (SiteTally, one entry at a time.)"""
    if find is None or with_blocks is None:
        entries = list(entries)
        find = find or find_in(entries)
        with_blocks = {entry.key.pid for entry in entries if entry.key.object is _BLOCK} \
            if with_blocks is None else with_blocks
    tally = SiteTally(now_ns, min_age_seconds, with_blocks, pids)
    for entry in entries:
        tally.add(entry)
    return tally.finish(find)


def rank_suspects(survey: SiteSurvey, growth: Mapping[SiteKey, float], titles: Mapping[int, str],
                  stack_of: Callable[[int], Stack | None]) -> LeakReport:
    """The survey's old groups as ranked suspects (see the module docstring for the order);
    `growth`: bytes per second of each site's outstanding bytes over 15 min."""
    def rank_key(item):
        site, (size_bytes, count, oldest_ns, _, _) = item
        return (-growth.get(site, 0.0), -round(size_bytes), -round(count), oldest_ns, site)

    now_ns = survey.timestamp_ns
    suspects = tuple(
        LeakSuspect(rank=rank, pid=site.pid, title=titles.get(site.pid, ""), device=site.device,
                    stack_id=site.stack_id, stack=stack_of(site.stack_id) if site.stack_id else None,
                    native_caller_address=caller, outstanding_bytes=round(size_bytes), count=round(count),
                    oldest_age_seconds=(now_ns - oldest_ns) / NS_PER_SECOND,
                    growth_bytes_per_second=growth.get(site, 0.0), estimated=estimated)
        for rank, (site, (size_bytes, count, oldest_ns, caller, estimated))
        in enumerate(sorted(survey.old.items(), key=rank_key), start=1))
    return LeakReport(now_ns, survey.min_age_seconds, survey.allocations_considered,
                      survey.suspect_allocations, suspects, len(suspects))


def find_suspects(entries: Iterable[Outstanding], now_ns: int, min_age_seconds: float,
                  growth: Mapping[SiteKey, float], titles: Mapping[int, str],
                  stack_of: Callable[[int], Stack | None], pids: Collection[int] = (),
                  find: Find | None = None, with_blocks: Collection[int] | None = None) -> LeakReport:
    """Survey and rank in one call (ListLeakSuspects, at any age)."""
    return rank_suspects(survey_sites(entries, now_ns, min_age_seconds, pids, find, with_blocks), growth, titles,
                         stack_of)
