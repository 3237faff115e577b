"""Two witnesses of one process's calls: the agent's uprobes and CUPTI inside the process (`kvtrace run`).

A CUPTI tracer reports its state (TracerStatus). When both witnesses trace a process, every CUPTI
event is matched against the uprobe event for the same call (CrossCheck): what only one side saw is a
disagreement, counted per API and shown by `kvtrace doctor --pid`.
"""
from __future__ import annotations

import enum
from collections import deque
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from kvtrace.model.events import DEVICE_UNKNOWN, Api, Event, Kind, Source


@dataclass(frozen=True)
class TracerStatus:
    """What a process's in-process CUPTI tracer last said of itself (the protocol's STATUS)."""

    pid: int
    state: str  # tracing, held, unavailable, off (kvtrace.sources.cupti.protocol.STATES), or gone
    reason: str = ""
    holder: str = ""  # held: who holds CUPTI in the process (torch.profiler/Kineto, Nsight)
    counters: dict[str, int] = field(default_factory=dict)
    timestamp_ns: int = 0
    # When the tracer stopped watching (its last flush, at the process's exit), on the tracer's clock;
    # calls after it (tensors Python frees while it shuts down) are the uprobes' alone. 0: not yet.
    stopped_ns: int = 0
    # The tracer's clock (CUPTI's) when it sent this status; with the time it arrived, it ties the two
    # witnesses' clocks together. 0: not the tracer's (the agent's own "gone").
    sent_ns: int = 0


# Calls this close to the moment the agent heard "tracing" are not compared: the two witnesses' clocks
# (CUPTI's and the agent's) and paths (a socket, a ring buffer) differ by that much at most.
START_MARGIN_NS = 50_000_000
# How long an event waits for its other witness before it counts as seen by one side only. CUPTI's
# records reach the agent a second or two after the call (its buffers are flushed each second).
MATCH_GRACE_NS = 10_000_000_000
EXAMPLES_KEPT = 16  # disagreements kept per process, newest last
FINISHED_KEPT = 64  # processes whose cross-check ended (exited, tracer gone), kept for doctor --pid
PENDING_MAX = 262_144  # events waiting for their other witness, per process; past it the oldest settle

# Calls both witnesses see (the tracer's callbacks and CUPTI's MEMORY2 records): the driver and VMM
# functions. Frees are compared by their success only (CUPTI reports no failed free).
_COMPARED_APIS = frozenset({
    Api.cuMemAlloc_v2, Api.cuMemAllocPitch_v2, Api.cuMemAllocManaged, Api.cuMemAllocHost_v2,
    Api.cuMemHostAlloc, Api.cuMemAllocAsync, Api.cuMemFree_v2, Api.cuMemFreeHost, Api.cuMemFreeAsync,
    Api.cuMemCreate, Api.cuMemRelease, Api.cuMemMap, Api.cuMemUnmap, Api.cuMemAddressReserve,
    Api.cuMemAddressFree,
})
_FREE_APIS = frozenset({Api.cuMemFree_v2, Api.cuMemFreeHost, Api.cuMemFreeAsync, Api.cuMemUnmap})
_COMPARED_KINDS = frozenset({Kind.ALLOC, Kind.FREE, Kind.FREE_UNKNOWN, Kind.MAP, Kind.UNMAP, Kind.RELEASE,
                             Kind.ALLOC_FAILED, Kind.FREE_FAILED})
_FAILED = frozenset({Kind.ALLOC_FAILED, Kind.FREE_FAILED})


class Side(enum.Enum):
    UPROBE = "uprobe"
    CUPTI = "cupti"


@dataclass
class ApiAgreement:
    """One API's calls in one process: seen by both witnesses alike, or not."""

    matched: int = 0
    uprobe_only: int = 0
    cupti_only: int = 0
    mismatched: int = 0  # seen by both, with a different size or device

    @property
    def disagreements(self) -> int:
        return self.uprobe_only + self.cupti_only + self.mismatched


@dataclass(frozen=True)
class Disagreement:
    """A call one witness saw and the other did not (side), or saw differently (side None)."""

    side: Side | None
    api: Api
    failed: bool
    address: int
    size_bytes: int
    device: int
    timestamp_ns: int
    detail: str = ""


@dataclass
class ProcessCrossCheck:
    """Both witnesses of one process, compared."""

    pid: int
    status: TracerStatus
    apis: dict[Api, ApiAgreement] = field(default_factory=dict)
    examples: deque[Disagreement] = field(default_factory=lambda: deque(maxlen=EXAMPLES_KEPT))
    compared: bool = False  # the tracer traced while the uprobes did: calls were matched
    compared_since_ns: int = 0  # calls from then on are compared (the agent heard "tracing" then)
    compared_until_ns: int = 0  # and up to then (the tracer stopped or left "tracing"), on the agent's clock; 0: open
    # Added to the tracer's timestamps to put them on the agent's clock: arrival - sending of its
    # statuses, the least seen (a message's delivery only ever adds to it). None: not known yet.
    clock_offset_ns: int | None = None
    finished: bool = False  # the process exited or its tracer went away; nothing waits any more
    pending: int = 0

    def agreement(self, api: Api) -> ApiAgreement:
        row = self.apis.get(api)
        if row is None:
            row = self.apis[api] = ApiAgreement()
        return row

    @property
    def disagreements(self) -> int:
        return sum(row.disagreements for row in self.apis.values())

    @property
    def matched(self) -> int:
        return sum(row.matched for row in self.apis.values())


_Key = tuple[Api, bool, int]  # (api, failed, address): a failed call has no address


@dataclass(slots=True)
class _Waiting:
    event: Event
    arrived_ns: int


class _Matching:
    """One process's events waiting for their other witness, oldest first per key."""

    def __init__(self) -> None:
        self.waiting: dict[Side, dict[_Key, deque[_Waiting]]] = {Side.UPROBE: {}, Side.CUPTI: {}}
        self.count = 0


def compared(event: Event) -> bool:
    """Whether both witnesses report this call (the rest is compared by neither)."""
    if event.kind not in _COMPARED_KINDS or event.api not in _COMPARED_APIS:
        return False
    return not (event.kind is Kind.FREE_FAILED and event.api in _FREE_APIS)


# A free is keyed as a free whichever function did it: CUPTI names it after the allocating call (its records
# say "release", not which function), while a program may free cudaMallocAsync memory with cudaFree.
_FREE_KEY = {Api.cuMemFreeHost: Api.cuMemFree_v2, Api.cuMemFreeAsync: Api.cuMemFree_v2}


def _key(event: Event) -> _Key:
    failed = event.kind in _FAILED
    return (_FREE_KEY.get(event.api, event.api), failed, 0 if failed else event.address)


class CrossCheck:
    """Matches the CUPTI events of a process against the uprobe events of the same calls.

    Each witnessed call is keyed (api, failed, address): the n-th call at an address on one side
    matches the n-th on the other (an address is reused in order: freed, then allocated again). An
    event whose match has not come within MATCH_GRACE_NS of its arrival counts as one side's only.
    Only processes whose tracer said "tracing" are compared, from that moment on.
    """

    def __init__(self) -> None:
        self.processes: dict[int, ProcessCrossCheck] = {}
        self.finished: dict[int, ProcessCrossCheck] = {}
        self._matching: dict[int, _Matching] = {}
        self.totals: dict[tuple[Api, str], int] = {}  # (api, matched/uprobe_only/cupti_only/mismatched)

    def tracer(self, status: TracerStatus, now_ns: int) -> None:
        check = self.processes.get(status.pid)
        if check is None:
            if status.state == "gone":
                return
            check = self.processes[status.pid] = ProcessCrossCheck(status.pid, status)
            self.finished.pop(status.pid, None)
        if status.sent_ns:
            offset = now_ns - status.sent_ns
            if check.clock_offset_ns is None or offset < check.clock_offset_ns:
                check.clock_offset_ns = offset
        if not status.stopped_ns and check.status.stopped_ns:  # the agent's "gone" keeps the tracer's stop
            status = TracerStatus(status.pid, status.state, status.reason, status.holder, status.counters,
                                  status.timestamp_ns, check.status.stopped_ns, status.sent_ns)
        check.status = status
        if status.state == "tracing" and not check.compared:
            check.compared = True
            check.compared_since_ns = now_ns + START_MARGIN_NS
            self._matching.setdefault(status.pid, _Matching())
        if check.compared and not check.compared_until_ns:
            if status.stopped_ns:
                check.compared_until_ns = status.stopped_ns + (check.clock_offset_ns or 0)
            elif status.state not in ("tracing", "gone"):  # it left tracing (gave CUPTI up, failed): from now
                check.compared_until_ns = now_ns
        if status.state == "gone":
            check.finished = True

    def follows(self, pid: int) -> bool:
        return pid in self._matching

    def followed(self) -> AbstractSet[int]:
        """The pids whose calls are compared, as a live view (a membership test per event, no call)."""
        return self._matching.keys()

    def witness(self, event: Event, side: Side, now_ns: int) -> None:
        """An event from one witness, in arrival order (`now_ns` is the Session's clock)."""
        matching = self._matching.get(event.pid)
        if matching is None or not compared(event):
            return
        check = self.processes[event.pid]
        agent_time_ns = event.timestamp_ns + ((check.clock_offset_ns or 0) if side is Side.CUPTI else 0)
        if agent_time_ns < check.compared_since_ns:
            return  # made before both witnesses watched
        if check.compared_until_ns and agent_time_ns > check.compared_until_ns:
            return  # made after the tracer's last look (the process shutting down, or CUPTI given up)
        key = _key(event)
        other = Side.CUPTI if side is Side.UPROBE else Side.UPROBE
        waiting_other = matching.waiting[other].get(key)
        if waiting_other:
            found = waiting_other.popleft()
            if not waiting_other:
                del matching.waiting[other][key]
            matching.count -= 1
            self._matched(check, found.event, event)
        else:
            matching.waiting[side].setdefault(key, deque()).append(_Waiting(event, now_ns))
            matching.count += 1
            if matching.count > PENDING_MAX:
                self._settle(check, matching, None)
        check.pending = matching.count

    def _matched(self, check: ProcessCrossCheck, first: Event, second: Event) -> None:
        row = check.agreement(first.api)
        size_differs = first.size_bytes != second.size_bytes and first.size_bytes and second.size_bytes
        device_differs = (first.device != second.device and first.device != DEVICE_UNKNOWN
                          and second.device != DEVICE_UNKNOWN)
        if size_differs or device_differs:
            row.mismatched += 1
            self._count(first.api, "mismatched")
            uprobe, cupti = (first, second) if first.source is Source.UPROBE else (second, first)
            check.examples.append(Disagreement(
                None, first.api, first.kind in _FAILED, first.address, uprobe.size_bytes, uprobe.device,
                uprobe.timestamp_ns, f"uprobes: {uprobe.size_bytes} B on device {uprobe.device}; "
                f"CUPTI: {cupti.size_bytes} B on device {cupti.device}"))
        else:
            row.matched += 1
            self._count(first.api, "matched")

    def _count(self, api: Api, result: str) -> None:
        self.totals[(api, result)] = self.totals.get((api, result), 0) + 1

    def settle(self, now_ns: int) -> None:
        """Events that waited past the grace count as one side's only; finished processes move to
        `finished` once nothing of theirs waits."""
        for pid, check in list(self.processes.items()):
            matching = self._matching.get(pid)
            if matching is not None and matching.count:
                self._settle(check, matching, now_ns - MATCH_GRACE_NS)
                check.pending = matching.count
            if check.finished and (matching is None or not matching.count):
                self._finish(pid)

    def _settle(self, check: ProcessCrossCheck, matching: _Matching, before_ns: int | None) -> None:
        """Counts as unmatched what arrived before `before_ns` (None: the oldest half, when over bounds)."""
        if before_ns is None:
            arrivals = sorted(item.arrived_ns for queues in matching.waiting.values()
                              for queue in queues.values() for item in queue)
            before_ns = arrivals[len(arrivals) // 2] + 1
        for side, queues in matching.waiting.items():
            for key in list(queues):
                queue = queues[key]
                while queue and queue[0].arrived_ns < before_ns:
                    event = queue.popleft().event
                    matching.count -= 1
                    row = check.agreement(event.api)
                    if side is Side.UPROBE:
                        row.uprobe_only += 1
                        self._count(event.api, "uprobe_only")
                    else:
                        row.cupti_only += 1
                        self._count(event.api, "cupti_only")
                    check.examples.append(Disagreement(side, event.api, event.kind in _FAILED, event.address,
                                                       event.size_bytes, event.device, event.timestamp_ns))
                if not queue:
                    del queues[key]

    def process_exited(self, pid: int) -> None:
        check = self.processes.get(pid)
        if check is not None:
            check.finished = True

    def _finish(self, pid: int) -> None:
        check = self.processes.pop(pid)
        self._matching.pop(pid, None)
        check.finished = True
        self.finished[pid] = check
        while len(self.finished) > FINISHED_KEPT:
            del self.finished[next(iter(self.finished))]

    def get(self, pid: int) -> ProcessCrossCheck | None:
        return self.processes.get(pid) or self.finished.get(pid)

    def all(self) -> list[ProcessCrossCheck]:
        return [*self.finished.values(), *self.processes.values()]
