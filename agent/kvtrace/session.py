"""The Session: the one entrance for what sources see, and the one place everything else reads.

    sources ──ingest()──▶ Session (ledger, stacks, processes, health) ──reads──▶ analysis, servers
                              └──▶ sinks (the API's event hub, --json-events, recordings)

Sources (the BPF probes with PyTorch's allocator probes, NVML; later vLLM, CUPTI, a recording) turn what they
see into model records and call `ingest`. Ingesting applies an event to the ledger, fills in the
process's title and container (attribution written once, for every source), and hands it to every
sink in order. Sources also report their health, counters and attached libraries here, so that
`kvtrace doctor`, the gRPC API and /metrics all tell the same story.

Readers (analysis, the gRPC server, /metrics) run on other threads: every read method returns a
consistent copy taken under `lock`, never a live view. Writers hold the lock for a whole batch
(`ingest_many`), so a copy waits at most one batch.

Why this module is long (about 700 lines): it is the one entrance and the one place readers read; what is here
is what must happen under its lock (the stores it holds live in model/: Ledger or KernelLedger, VllmStore,
StackTable, ProcessTable, CrossCheck).
"""
from __future__ import annotations

import copy
import logging
import platform
import threading
import time
import weakref
from collections.abc import Callable, Collection, Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any, Protocol

from kvtrace import __version__
from kvtrace.model.agent import (
    AgentInfo,
    AttachedLibrary,
    ComponentStatus,
    OutstandingTotal,
    PartyShare,
    TrackedProcess,
)
from kvtrace.model.crosscheck import CrossCheck, ProcessCrossCheck, Side, TracerStatus
from kvtrace.model.depth import Depth, DepthRequest, ProcessDepth
from kvtrace.model.events import Api, Event, EventRun, EventsLost, Kind, Source
from kvtrace.model.gpus import NvmlSample
from kvtrace.model.ledger import (
    Ledger,
    LedgerCounts,
    LedgerKey,
    LedgerReadRefused,
    LedgerResynced,
    LedgerStore,
    LedgerView,
    Outstanding,
    RowBatch,
    ledger_view,
)
from kvtrace.model.processes import ProcessInfo, ProcessTable
from kvtrace.model.stacks import NativeFrame, Stack, StackTable
from kvtrace.model.vllm import (
    KvCacheLayout,
    SchedulerReport,
    SleepReport,
    VllmMetricsSample,
    VllmRecord,
    VllmStore,
    VllmView,
)

Record = Event | EventRun | EventsLost | NvmlSample | VllmRecord

log = logging.getLogger(__name__)

# Kinds the ledger takes as a run and batch sinks get at once (Session._ingest_run); every other kind
# (failures, which may trigger a flight dump with a copy of the ledger, exits, context destroys) is
# taken alone, in order, after the run before it.
_UNSEEN: Any = object()  # _ingest_run: a pid not yet looked up
_RUN_KINDS = frozenset({Kind.ALLOC, Kind.FREE, Kind.MAP, Kind.UNMAP, Kind.RELEASE, Kind.FREE_UNKNOWN})
_RUN_KIND_NUMBERS = frozenset(int(kind) for kind in _RUN_KINDS)  # EventRun.kinds are raw numbers


class NativeNames(Protocol):
    """Names native code addresses (kvtrace.sources.native.NativeSymbolizer in the agent)."""

    def symbolize(self, pid: int, address: int) -> NativeFrame: ...

    def forget(self, pid: int) -> None: ...


class Sink(Protocol):
    """Receives every event in order (called under the Session's lock: never block).

    A sink may also have `publish_many(events)`: the same as publish for each of a run of consecutive
    allocation-type events, called once after the ledger took the whole run (a sink that reads the
    ledger as it publishes, a recording's checkpoint, must not have it). The run (a list, or an EventRun
    as a source read it) is every such sink's to keep: no one changes it, or its events, afterwards."""

    def publish(self, event: Event) -> None: ...

    def publish_loss(self, lost_count: int) -> None:
        """`lost_count` events never reached the agent at this point of the stream."""
        ...

    def publish_state(self, record: NvmlSample | LedgerResynced) -> None:
        """What is not an event, in the stream's order: an NVML round, or the ledger replaced by an
        exact copy (recordings write it as a new checkpoint)."""
        ...


class ExitWatcher(Protocol):
    def __call__(self, exit_event: Event) -> None:
        """Called under the Session's lock just before a process's exit drops what it held from the
        ledger (`exit_event.freed_bytes` is set): the flight recorder readies a dump's checkpoint for a
        process that died holding memory (read later, its entries held until then)."""
        ...


@dataclass(frozen=True)
class SessionCheckpoint:
    """The Session's state when a sink joined: the events it gets next apply to these entries."""

    timestamp_ns: int
    entries: list[Outstanding]
    processes: dict[int, ProcessInfo]


@dataclass
class _Component:
    status: ComponentStatus
    reported_monotonic: float
    stale_after_seconds: float | None  # None: holds until reported again
    stale_reason: str


class Session:
    def __init__(self, processes: ProcessTable | None = None, native_names: NativeNames | None = None,
                 ledger: LedgerStore | None = None) -> None:
        """`processes` reads titles of live processes (the agent passes one over procfs);
        `native_names` names native callers for reports; `ledger` keeps the outstanding objects (a plain
        Ledger unless given; the BPF source puts its KernelLedger in with replace_ledger)."""
        self.lock = threading.Lock()
        self.ledger: LedgerStore = ledger if ledger is not None else Ledger()
        self.stacks = StackTable()
        self.processes = processes if processes is not None else ProcessTable()
        self.traced_only = False  # a source follows chosen processes only (NVML's others are left out)
        self.started_wall_seconds = time.time()  # processes started before hold memory it never saw
        self._native_names = native_names
        self._native_frames: dict[int, dict[int, NativeFrame]] = {}  # pid -> address -> frame
        # Guards _native_frames only: servers name callers from their threads while the event loop
        # forgets exited processes. Symbolizing (reading a library) happens outside it.
        self._native_lock = threading.Lock()
        self._native_forgets = 0  # a name found across a forget may be the old process's: not kept
        self._sinks: list[Sink] = []
        # The sinks again, as the run path calls them: each event alone, or a run at once.
        self._run_sinks: tuple[list[Callable[[Event], None]], list[Callable[[list[Event]], None]]] = ([], [])
        self._exit_watchers: list[ExitWatcher] = []
        # The last checkpoint copied (weakly: it lives as long as a recording holds it) and where.
        self._checkpoint_position: tuple[int, int, int] | None = None
        self._checkpoint_shared: Callable[[], SessionCheckpoint | None] = lambda: None
        # One clock for every record: wall-clock nanoseconds as CLOCK_MONOTONIC plus the offset fixed now
        # (the probes' events are stamped so), so that a step of the system clock (chrony at boot)
        # never puts records out of order. A replay sets both to the recording's time (reports/replay.py).
        self.clock_offset_ns = time.time_ns() - time.monotonic_ns()
        self.wall_clock_ns: Callable[[], int] = lambda: time.monotonic_ns() + self.clock_offset_ns
        self.monotonic_clock_ns: Callable[[], int] = time.monotonic_ns
        self._components: dict[str, _Component] = {}
        self._counters: dict[str, int] = {}
        self._libraries: tuple[AttachedLibrary, ...] = ()
        self._shares: tuple[PartyShare, ...] = ()  # parties refused for a full share (report_shares)
        self._nvml: NvmlSample | None = None
        # vLLM: the plugin's latest reports per process, and the latest scrape of each /metrics URL.
        self._vllm = VllmStore()
        self.events_total = 0
        self.lost_total = 0
        self.resyncs_total = 0
        # CUPTI (`kvtrace run`) is a second witness where the uprobes trace too (the agent with BPF): its
        # events are matched against theirs, never added to the ledger twice. Elsewhere (`kvtrace run
        # --output`, a replay) CUPTI's events are the ledger's.
        self.cupti_witness = False
        self._crosscheck = CrossCheck()
        self._crosscheck_settled_ns = 0
        self.witnessed_total = 0
        # Depth per process (model/depth.py): what the agent's depth policy decided, replaced whole at each
        # decision; and operators' requests (`kvtrace deep`), which the policy reads at its next turn.
        self._depths: dict[int, ProcessDepth] = {}
        self._depth_requests: dict[int, DepthRequest] = {}
        self._block_readers_hook: Callable[[bool], None] | None = None  # set_block_readers_hook
        # Why an operator's request would not be honoured now ("" : it would): --blocks always|never, PyTorch's
        # allocator probes down, tracing off. Set by the daemon, read by the API before it takes a request.
        self._depth_refusal = "depth is not decided here (no agent)"
        self._deepenable: frozenset[int] | None = None
        # What each kind of record other than an event does (events take the path below: the hot one).
        self._handlers: dict[type, Callable[[Any], None]] = {
            EventsLost: self._take_loss, NvmlSample: self._take_nvml, SchedulerReport: self._vllm.take,
            KvCacheLayout: self._vllm.take, SleepReport: self._vllm.take, VllmMetricsSample: self._vllm.take}

    # ---- writing: sources ----

    def add_sink(self, sink: Sink) -> None:
        with self.lock:
            self._set_sinks([*self._sinks, sink])

    def _set_sinks(self, sinks: list[Sink]) -> None:
        self._sinks = sinks
        self._tell_block_readers(sinks)
        many: list[Callable[[list[Event]], None]] = [
            publish for publish in (getattr(sink, "publish_many", None) for sink in sinks) if publish is not None]
        each: list[Callable[[Event], None]] = [
            sink.publish for sink in sinks if getattr(sink, "publish_many", None) is None]
        self._run_sinks = (each, many)

    def subscribe(self, sink: Sink) -> SessionCheckpoint:
        """Adds `sink` and copies the ledger at the same moment: the sink's events apply to exactly
        these entries (a recording starts with them). LedgerReadRefused where the kernel's entries are more
        than --max-read-entries (the sink is not added)."""
        with self.lock:
            sinks = [*self._sinks, sink]
            self._tell_block_readers(sinks)  # before the copy: no block it wants goes untold after it
            checkpoint = self.checkpoint_locked()
            self._set_sinks(sinks)
            return checkpoint

    def checkpoint_locked(self, pids: Collection[int] | None = None) -> SessionCheckpoint:
        """A copy of the ledger and the processes known, now; call it holding `lock` (sinks do). Sinks
        asking at the same point of the stream (several recordings after a resync) share one copy. Where the
        kernel keeps the allocations they are read from it, here under the lock (the copy must be of this
        point of the stream), at most --max-read-entries: LedgerReadRefused over it. With `pids`, only their
        entries (none for no pids): the part a flight dump keeps of a ledger too large to copy whole."""
        if pids is not None:
            entries = [copy.copy(entry) for entry in self.ledger.entries(pids)] if pids else []
            return SessionCheckpoint(self.wall_clock_ns(), entries, dict(self.processes.known()))
        position = (self.events_total, self.resyncs_total, len(self._sinks))
        shared = self._checkpoint_shared() if self._checkpoint_position == position else None
        if shared is not None:
            return shared
        entries = [copy.copy(entry) for entry in self.ledger.entries()]  # later maps change the live ones
        checkpoint = SessionCheckpoint(self.wall_clock_ns(), entries, dict(self.processes.known()))
        self._checkpoint_position, self._checkpoint_shared = position, weakref.ref(checkpoint)
        return checkpoint

    def checkpoint_later_locked(self, pids: Collection[int] | None = None) -> Callable[[], SessionCheckpoint]:
        """checkpoint_locked(pids), copied when the function returned is called: on another thread, outside
        the lock, once. Call this holding `lock` (LedgerReadRefused now, as checkpoint_locked): what must be
        taken at this point of the stream is taken now (the processes known, the objects kept in the agent),
        but no whole-ledger read is made under the lock (LedgerStore.entries_later: where the kernel keeps the
        allocations they are read then, as they are then, less those made since)."""
        timestamp_ns = self.wall_clock_ns()
        processes = dict(self.processes.known())
        if pids is not None and not pids:
            return lambda: SessionCheckpoint(timestamp_ns, [], processes)
        read = self.ledger.entries_later(pids or ())
        return lambda: SessionCheckpoint(timestamp_ns, read(), processes)

    def checkpoint_refused(self) -> LedgerReadRefused | None:
        """What a checkpoint copied now would meet (None: it would be made): for health that tells before."""
        with self.lock:
            return self.ledger.copy_refused()

    def remove_sink(self, sink: Sink) -> None:
        with self.lock:
            self._set_sinks([existing for existing in self._sinks if existing is not sink])

    def set_block_readers_hook(self, hook: Callable[[bool], None] | None) -> None:
        """`hook(wants)` is told, under the lock, whether some sink reads the event of every PyTorch block (a
        subscriber, a recording, --json-events), whenever that may have changed: at once, as sinks come and go
        (before a new one's checkpoint is copied), and at refresh_block_readers. While none does, the BPF
        source has the probes tell only the blocks whose stacks they walk (the kernel's ledger is exact
        without the others). A sink says what it wants with a `wants_every_block` attribute; one without it
        wants every block."""
        with self.lock:
            self._block_readers_hook = hook
            self._tell_block_readers(self._sinks)

    def refresh_block_readers(self) -> None:
        """For sinks whose wish changes without their coming or going (the API's hub calls it as its
        subscribers come and go: EventHub.on_readers_changed)."""
        with self.lock:
            self._tell_block_readers(self._sinks)

    def _tell_block_readers(self, sinks: list[Sink]) -> None:
        if self._block_readers_hook is None:
            return
        try:
            self._block_readers_hook(any(getattr(sink, "wants_every_block", True) for sink in sinks))
        except Exception:  # a map the probes would not take: blocks stay as they were, sinks come and go all the same
            log.exception("telling the probes who reads PyTorch blocks failed")

    def request_checkpoints(self) -> None:
        """Recordings start again from a copy of the ledger, now: the ledger changed in a way no event tells (a
        process lowered to depth segments: its blocks left without frees)."""
        with self.lock:
            for sink in self._sinks:
                checkpoint_now = getattr(sink, "checkpoint_now", None)
                if checkpoint_now is not None:
                    checkpoint_now()

    def add_exit_watcher(self, watcher: ExitWatcher) -> None:
        with self.lock:
            self._exit_watchers = [*self._exit_watchers, watcher]

    def remove_exit_watcher(self, watcher: ExitWatcher) -> None:
        with self.lock:
            self._exit_watchers = [existing for existing in self._exit_watchers if existing != watcher]

    def ingest(self, record: Record) -> None:
        self.ingest_many((record,))

    def ingest_many(self, records: Iterable[Record]) -> None:
        """The one entrance: events go to the ledger and the sinks, in order; a loss report goes to
        the sinks where the gap is; an NVML sample replaces the last one."""
        with self.lock:
            witness = self.cupti_witness
            if witness:
                now_ns = self.wall_clock_ns()
                if now_ns - self._crosscheck_settled_ns > 1_000_000_000:
                    self._crosscheck_settled_ns = now_ns
                    self._crosscheck.settle(now_ns)
            # Where CUPTI witnesses the uprobes (the daemon), only its events and those of the processes it
            # traces are compared: the rest (the bulk of a busy host) take the run as without a witness.
            self._ingest_locked(records, witness, self._crosscheck.followed() if witness else frozenset())

    def _ingest_locked(self, records: Iterable[Record], witness: bool, compared: AbstractSet[int]) -> None:
        """ingest_many's work, under the lock: consecutive allocation-type events that need nothing
        else go in runs (an EventRun as it came), the rest one by one."""
        sinks = self._sinks
        run: list[Event] = []
        run_kinds = _RUN_KINDS
        for record in records:
            if type(record) is Event and record.kind in run_kinds and (
                    not witness or (record.source is Source.UPROBE and record.pid not in compared)):
                run.append(record)
                continue
            if run:
                self._ingest_run(run)
                run = []
            if type(record) is EventRun:
                if record.kinds <= _RUN_KIND_NUMBERS and compared.isdisjoint(record.pids):
                    self._ingest_run(record)
                else:  # some of its events need more than a run's work
                    self._ingest_locked(list(record), witness, compared)
                continue
            if type(record) is Event:
                if not witness or self._witness(record):
                    self._ingest_event(record, sinks)
                continue
            handler = self._handlers.get(type(record))
            if handler is None:
                raise TypeError(f"not a record a Session takes: {type(record).__name__}")
            handler(record)
        if run:
            self._ingest_run(run)

    def _witness(self, event: Event) -> bool:
        """Where CUPTI witnesses the uprobes: CUPTI's event is compared with theirs (False: the ledger has the
        uprobes' own event of that call), and the uprobes' event of a process CUPTI traces is noted for the
        comparison (True: the ledger takes it)."""
        if event.source is Source.CUPTI:
            self._crosscheck.witness(event, Side.CUPTI, self.wall_clock_ns())
            self.witnessed_total += 1
            return False
        if self._crosscheck.follows(event.pid):
            self._crosscheck.witness(event, Side.UPROBE, self.wall_clock_ns())
        return True

    def _ingest_event(self, event: Event, sinks: list[Sink]) -> None:
        """One event that is not part of a run: attributed, and a process exit watched before its drop."""
        if event.kind is Kind.PROCESS_EXIT:
            if not event.title:  # as last read: the process is gone (a zombie's cmdline is empty), and exits come
                _label(event, self.processes.cached(event.pid))  # in storms: no /proc read for each
        else:
            self._attribute(event)
        self.events_total += 1
        if event.kind is Kind.PROCESS_EXIT:
            event.freed_bytes = self.ledger.physical_device_bytes(event.pid)
            for watcher in self._exit_watchers:
                watcher(event)
            self._checkpoint_position = None  # a watcher's copy is of the ledger before the exit
        self.ledger.apply(event)
        if event.kind is Kind.PROCESS_EXIT:
            self._forget_process(event.pid)
            self._crosscheck.process_exited(event.pid)
        for sink in sinks:
            sink.publish(event)

    def _take_loss(self, record: EventsLost) -> None:
        self.lost_total += record.count
        for sink in self._sinks:
            sink.publish_loss(record.count)

    def _take_nvml(self, record: NvmlSample) -> None:
        self._nvml = record
        for sink in self._sinks:
            sink.publish_state(record)

    def _ingest_run(self, events: list[Event]) -> None:
        """Consecutive allocation-type events (the bulk of a busy stream), as ingest_many takes each
        alone, at less cost: each pid's title is looked up once, the ledger takes them one by one with
        each sink that publishes one at a time, and then the sinks that take a run get it at once."""
        labels: dict[int, tuple[str, str] | None] = {}  # pid -> (title, container); None: not known
        labelled_before = False
        get_process = self.processes.get
        for event in events:  # _label's work, inline: it runs for every event of a busy stream
            if event.title:
                labelled_before = True
                continue  # a source that knows better (a recording) already said
            pid = event.pid
            label = labels.get(pid, _UNSEEN)
            if label is _UNSEEN:
                info = get_process(pid)
                label = labels[pid] = (info.title, info.container) if info is not None else None
            if label is None:
                event.title = event.comm
            else:
                event.title, event.container = label
        if type(events) is EventRun:  # for a stream that copies its records (servers/api/servicer.py)
            events.labels = None if labelled_before else labels
        each, many = self._run_sinks
        if each:
            apply = self.ledger.apply
            for event in events:
                self.events_total += 1  # before the sinks: a checkpoint one takes is of this point (shared by position)
                apply(event)
                for publish in each:
                    publish(event)
        else:
            self.events_total += len(events)
            self.ledger.apply_many(events)
        for publish_many in many:
            publish_many(events)

    def _attribute(self, event: Event) -> None:
        if not event.title:  # else a source that knows better (a recording) already said
            _label(event, self.processes.get(event.pid))

    def _forget_process(self, pid: int) -> None:
        self.ledger.forget_counters(pid)
        self.processes.forget(pid)
        self._vllm.forget(pid)
        with self._native_lock:
            self._native_forgets += 1
            self._native_frames.pop(pid, None)
        if self._native_names is not None:
            self._native_names.forget(pid)

    def set_cupti_witness(self, witness: bool) -> None:
        """The uprobes trace every process here: CUPTI's events are compared with theirs instead of
        entering the ledger (the daemon with its BPF source)."""
        with self.lock:
            self.cupti_witness = witness

    def report_tracer(self, status: TracerStatus) -> None:
        """What a process's CUPTI tracer said of itself (tracing, held by another profiler, ...)."""
        with self.lock:
            self._crosscheck.tracer(status, self.wall_clock_ns())

    def cross_checks(self, pid: int | None = None) -> list[ProcessCrossCheck]:
        """The CUPTI tracers known and, where the uprobes traced the same process, how the two
        witnesses agree (copies; `pid` for one process, exited ones included)."""
        with self.lock:
            self._crosscheck.settle(self.wall_clock_ns())
            checks = self._crosscheck.all() if pid is None else [
                check for check in (self._crosscheck.get(pid),) if check is not None]
            return [copy.deepcopy(check) for check in checks]

    def cross_check_totals(self) -> dict[tuple[Api, str], int]:
        """(api, matched|uprobe_only|cupti_only|mismatched) -> calls, over every process so far."""
        with self.lock:
            self._crosscheck.settle(self.wall_clock_ns())
            return dict(self._crosscheck.totals)

    def process_execed(self, pid: int) -> None:
        """The process exec'd: its title is read afresh at its next event."""
        with self.lock:
            self.processes.forget(pid)

    def read_process(self, pid: int) -> ProcessInfo | None:
        """Who `pid` is, read from the system if not known or no longer fresh."""
        with self.lock:
            return self.processes.get(pid)

    def intern_stack(self, stack: Stack) -> int:
        """The id of a symbolized stack (interned: equal stacks, one id). Ids never change."""
        with self.lock:
            return self.stacks.intern(stack)

    def define_stack(self, stack_id: int, stack: Stack) -> None:
        """A stack under the id another Session gave it (a recording's: replay keeps its ids)."""
        with self.lock:
            self.stacks.define(stack_id, stack)

    def remember_process(self, info: ProcessInfo) -> None:
        """Who a process was, as a recording says: kept unless what is known came from a later record that had
        its start time and this one has none."""
        with self.lock:
            if info.start_time or self.processes.cached(info.pid) is None:
                self.processes.remember(info)

    def resync(self, entries: Iterable[Outstanding], counted: bool = True) -> None:
        """Replaces the outstanding set with an exact copy (a source's kernel ledger, after loss; a
        recording's checkpoint, which is no resync of this Session's: not `counted`)."""
        with self.lock:
            self.ledger.resync(entries)
            self.resyncs_total += counted
            resynced = LedgerResynced(self.wall_clock_ns())
            for sink in self._sinks:
                sink.publish_state(resynced)

    def replace_ledger(self, ledger: LedgerStore) -> None:
        """Another store keeps the ledger from now on (the BPF source's KernelLedger while its probes are loaded,
        a plain Ledger again when they go); give it before the first event it must see. The counters of calls,
        frees and failures go on from the store it replaces (they are /metrics counters: never reset)."""
        with self.lock:
            if ledger is not self.ledger:
                ledger.carry_counters(self.ledger)
            self.ledger = ledger

    def forget_process(self, pid: int) -> None:
        """A process found gone without an exit event: drop what it held and what is known of it."""
        self.ingest(Event(kind=Kind.PROCESS_EXIT, api=Api.process_exit, pid=pid, tid=pid,
                          timestamp_ns=self.wall_clock_ns()))

    def report_component(self, name: str, up: bool, reason: str = "",
                         stale_after_seconds: float | None = None, stale_reason: str = "") -> None:
        """A component's health. With `stale_after_seconds` the report is a heartbeat: unrepeated
        for that long, the component is down with `stale_reason`."""
        with self.lock:
            self._components[name] = _Component(ComponentStatus(name, up, reason), time.monotonic(),
                                                stale_after_seconds, stale_reason or f"{name} stopped reporting")

    def request_depth(self, request: DepthRequest) -> None:
        """An operator's request for one process (`kvtrace deep`): the depth policy applies it at its next
        turn and until `request.until_ns`. A request for SEGMENTS withdraws any earlier one (the policy
        decides again on its evidence)."""
        with self.lock:
            if request.depth is Depth.SEGMENTS:
                self._depth_requests.pop(request.pid, None)
            else:
                self._depth_requests[request.pid] = request

    def set_depth_refusal(self, reason: str, deepenable: AbstractSet[int] | None = None) -> None:
        """Why operators' requests are not honoured here ("" : they are), and which processes can be raised at
        all (None: any; else the processes the probes follow that map a PyTorch library they can trace)."""
        with self.lock:
            self._depth_refusal = reason
            self._deepenable = frozenset(deepenable) if deepenable is not None else None
            if reason:
                self._depth_requests.clear()

    def depth_refusal(self, pid: int | None = None) -> str:
        """Why `request_depth` (for `pid`, if given) would not be honoured now; "" when it would."""
        with self.lock:
            if self._depth_refusal or pid is None or self._deepenable is None or pid in self._deepenable:
                return self._depth_refusal
            return (f"pid {pid} has no PyTorch allocator probes the agent can turn on (a process it does not follow, "
                    "or one that maps no libc10_cuda with its pytorch:malloc/free probes; `kvtrace doctor --pid "
                    f"{pid}` says which): its segments are all there is to trace")

    def depth_requests(self) -> dict[int, DepthRequest]:
        with self.lock:
            return dict(self._depth_requests)

    def forget_depth_request(self, pid: int) -> None:
        """The request ended (its time ran out, or its process exited)."""
        with self.lock:
            self._depth_requests.pop(pid, None)

    def set_process_depths(self, depths: Mapping[int, ProcessDepth]) -> None:
        """The depth of every process the policy follows, replaced whole (what reports show)."""
        with self.lock:
            self._depths = dict(depths)

    def set_process_depth(self, depth: ProcessDepth) -> None:
        """One process's depth, the others' as they are (kvtrace run's tracer tells its own)."""
        with self.lock:
            self._depths[depth.pid] = depth

    def process_depths(self) -> dict[int, ProcessDepth]:
        with self.lock:
            return dict(self._depths)

    def report_counters(self, counters: dict[str, int]) -> None:
        """A source's counters (the probes' events_submitted, events_lost, ...), merged by name."""
        with self.lock:
            self._counters.update(counters)

    def report_shares(self, refused: Iterable[PartyShare]) -> None:
        """The users (and processes) the probes refused because their share of a shared map was full."""
        with self.lock:
            self._shares = tuple(refused)

    def shares(self) -> list[PartyShare]:
        with self.lock:
            return list(self._shares)

    def report_libraries(self, libraries: Iterable[AttachedLibrary]) -> None:
        with self.lock:
            self._libraries = tuple(libraries)

    # ---- reading: analysis and servers ----

    def outstanding(self, pids: Collection[int] = ()) -> Iterable[Outstanding]:
        """Every live ledger entry of `pids` (empty: all), to go through (Ledger.stream): where the kernel
        keeps the allocations they are read from it at each pass, outside the lock."""
        with self.lock:
            return self.ledger.stream(pids)

    def outstanding_batches(self, pids: Collection[int] = ()) -> Iterable[RowBatch]:
        """outstanding(pids) in batches of rows in columns (model.ledger.RowBatch), of `pids` only, for a listing
        in columns: the kernel's entries made columns from its maps without an object each."""
        with self.lock:
            return self.ledger.stream_batches(pids)

    def entry_lookup(self) -> Callable[[LedgerKey], Outstanding | None]:
        """The lookup of one live entry by its key (LedgerStore.find), safe from any thread."""
        return self.ledger.find

    def process(self, pid: int) -> ProcessInfo | None:
        """Title, comm and container of `pid` as last read (no /proc read here), None if unknown."""
        with self.lock:
            return self.processes.cached(pid)

    def process_titles(self) -> dict[int, str]:
        """pid -> full title of the processes the Session knows (alive)."""
        with self.lock:
            known = self.processes.known()
        return {pid: info.title for pid, info in known.items()}

    def stack(self, stack_id: int) -> Stack | None:
        """The interned stack with this id, None if unknown. The table only grows: no lock."""
        try:
            return self.stacks.get(stack_id)
        except KeyError:
            return None

    def native_caller(self, pid: int, address: int) -> NativeFrame | None:
        """(module, symbol, offset) of the native code at `address` in `pid`; cached."""
        if not address or self._native_names is None:
            return None
        with self._native_lock:
            frame = self._native_frames.get(pid, {}).get(address)
            forgets = self._native_forgets
        if frame is None:
            frame = self._native_names.symbolize(pid, address)
            with self._native_lock:
                if self._native_forgets == forgets:
                    self._native_frames.setdefault(pid, {})[address] = frame
        return frame

    def processes_holding_memory(self) -> list[TrackedProcess]:
        """Processes holding traced objects, with their totals per (device, layer, memory)."""
        with self.lock:
            totals = self.ledger.totals()
            known = self.processes.known()
        processes: dict[int, TrackedProcess] = {}
        for key, (size_bytes, count) in sorted(totals.items(), key=lambda item: (
                item[0].pid, item[0].device, item[0].layer, item[0].memory)):
            process = processes.get(key.pid)
            if process is None:
                info = known.get(key.pid)
                process = processes[key.pid] = TrackedProcess(
                    key.pid, info.title if info else "", info.comm if info else "",
                    info.container if info else "")
            process.totals.append(OutstandingTotal(key.device, key.layer, key.memory, size_bytes, count))
        return list(processes.values())

    def ledger_counts(self) -> LedgerCounts:
        with self.lock:
            return LedgerCounts.of(self.ledger)

    def ledger_view(self, with_entries: bool, extra_pids: Iterable[int] = ()) -> LedgerView:
        """What an analysis needs, copied at once: totals, counts, titles of the processes holding
        memory and of `extra_pids` (NVML's), and every entry when `with_entries`."""
        with self.lock:
            titles = {}
            predates = set()
            for pid in {key.pid for key in self.ledger.totals()} | set(extra_pids):
                info = self.processes.get(pid)  # cached; /proc is read at most every few seconds
                if info is not None:
                    titles[pid] = info.title
                    if info.start_time < self.started_wall_seconds:
                        predates.add(pid)
            return ledger_view(self.ledger, self.wall_clock_ns(), self.monotonic_clock_ns(), with_entries, titles,
                               self.traced_only, frozenset(predates))

    def nvml_sample(self) -> NvmlSample | None:
        return self._nvml

    def vllm_view(self) -> VllmView:
        """The latest vLLM reports and scrapes, copied at once."""
        with self.lock:
            return self._vllm.view()

    def forget_vllm(self, pid: int, keep_layout: bool = False) -> bool:
        """The vLLM plugin's records of `pid` go (the listener no longer follows it); its traced memory stays.
        `keep_layout`: its KV-cache layout stays (sent once: it outlives the sender's place). True when one is kept."""
        with self.lock:
            return self._vllm.forget(pid, keep_layout)

    def forget_vllm_metrics(self, url: str) -> None:
        """A /metrics URL no longer scraped (its API server is gone)."""
        with self.lock:
            self._vllm.forget_metrics(url)

    def known_processes(self) -> dict[int, ProcessInfo]:
        """pid -> what is known of every live process the Session has seen (no /proc read here)."""
        with self.lock:
            return dict(self.processes.known())

    def counters(self) -> dict[str, int]:
        with self.lock:
            counters = dict(self._counters)
            counters["events_seen"] = self.events_total
            counters["resyncs"] = self.resyncs_total
            counters.update(self.ledger.counters())
            if self.witnessed_total or self._crosscheck.processes or self._crosscheck.finished:
                counters["cupti_events_witnessed"] = self.witnessed_total
                counters["crosscheck_disagreements"] = sum(
                    count for (_, result), count in self._crosscheck.totals.items() if result != "matched")
        return counters

    def components(self) -> list[ComponentStatus]:
        """Every component's health, in report order; a heartbeat not repeated in time is down."""
        now = time.monotonic()
        with self.lock:
            components = list(self._components.values())
        statuses = []
        for component in components:
            status = component.status
            if (component.stale_after_seconds is not None and status.up
                    and now - component.reported_monotonic > component.stale_after_seconds):
                status = ComponentStatus(status.name, False, component.stale_reason)
            statuses.append(status)
        return statuses

    def healthy(self) -> bool:
        """False while the BPF event loop is stalled (gRPC health then says NOT_SERVING)."""
        return all(status.up for status in self.components() if status.name == "bpf")

    def info(self) -> AgentInfo:
        with self.lock:
            libraries = list(self._libraries)
        return AgentInfo(__version__, platform.release(), libraries, self.components(), self.counters())


def _label(event: Event, info: ProcessInfo | None) -> None:
    """The process's title and container on its event; its comm where the process is not known."""
    if info is not None:
        event.title = info.title
        event.container = info.container
    else:
        event.title = event.comm
