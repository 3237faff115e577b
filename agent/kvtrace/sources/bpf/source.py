"""The BPF source: CUDA uprobes + discovery -> model events -> the Session.

One thread runs it: `run_once()` polls the rings (records are decoded, their Python stacks
symbolized, and the batch handed to `Session.ingest_many` in order) and does the housekeeping that
keeps attach targets and the ledger right: rescans processes that exec'd or mapped code, drops
processes that exited, and resyncs the Session's ledger from the kernel's exact copy after events
were lost. It reports its health, counters and attached libraries to the Session as it goes.

Its parts are handed the probes at start: which pids are followed (selection.py), stack naming
(stack_names.py) and the attach policy (targets.py); what is left here is the loop, the intake, the
pacing of housekeeping, the exit sweeps and the reports.

Why this module is long (about 690 lines): the loop and everything it paces (intake, exit sweeps, resyncs,
lowering a process's depth, reports) share the loop's thread and lock; the parts that need neither are apart.
"""
from __future__ import annotations

import logging
import mmap
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace

import psutil

from kvtrace.model.agent import AttachedLibrary
from kvtrace.model.depth import BlocksMode, Depth
from kvtrace.model.events import DEVICE_UNKNOWN, Event, EventRun, EventsLost, Kind, ObjectKind, StackStatus
from kvtrace.model.ledger import DEFAULT_MAX_READ_ENTRIES, Outstanding
from kvtrace.session import Session
from kvtrace.sources.bpf import abi
from kvtrace.sources.bpf.decode import (
    Clock,
    chunk_objects,
    chunk_stack_ids,
    decode_events,
    decode_ledger_chunk,
    decode_ledger_entry,
    event_run,
    stacks_in_chunk,
)
from kvtrace.sources.bpf.discovery import Discovery
from kvtrace.sources.bpf.kernel_ledger import COUNTED_OBJECT_VALUES, KernelLedger, delete_entries
from kvtrace.sources.bpf.loader import (
    POLL_BUDGET_EVENTS,
    BpfProbes,
    ProbeSettings,
    return_freed_heap,
)
from kvtrace.sources.bpf.ring import RingReader
from kvtrace.sources.bpf.selection import Selection
from kvtrace.sources.bpf.shares import ShareWatch
from kvtrace.sources.bpf.stack_names import StackNames
from kvtrace.sources.bpf.targets import DEFAULT_PREATTACH_GLOBS, AttachPolicy, Targets
from kvtrace.sources.python.runtime import NoPython, PythonTarget
from kvtrace.sources.python.symbolize import Symbolizer

log = logging.getLogger(__name__)

# A notified pid is rescanned now and once more a little later: the mmap that told us may not have
# returned yet when we read /proc/PID/maps.
RESCAN_DELAYS_SECONDS = (0.0, 0.25)
_KEPT_OBJECT_VALUES = frozenset(kind.value for kind in ObjectKind) - COUNTED_OBJECT_VALUES

# Events the BPF source acts on as they are read (the kernel's ledger drops what they freed).
_LIFECYCLE_KIND_NUMBERS = frozenset({int(Kind.PROCESS_EXIT), int(Kind.CONTEXT_DESTROY)})

# The loop reports (counters, libraries, a heartbeat) every BUSY_REPORT_SECONDS while events come and
# once a second when idle (IDLE_REPORT_SECONDS); silent this long, it is stalled. It reads the probes'
# counters at every turn that took events (one system call), so that a loss marker lands where the loss is,
# and at the turns after, until what it read is reported.
STALLED_AFTER_SECONDS = 5.0
IDLE_REPORT_SECONDS = 1.0
BUSY_REPORT_SECONDS = 0.1
# A turn that read events starts the next at least this much later: a steady stream is taken in batches
# of thousands, not in the hundreds each CPU's wakeup brings (every turn costs the same few hundred
# microseconds besides its events: 500 turns a second took a third of the agent's time on the H200).
# A turn that read its budget, or half the ring, is behind: the next starts at once.
BUSY_TURN_SECONDS = 0.01
# Records read since the C heap last gave back what was freed: at the first idle turn after this many
# (one malloc_trim call), the burst's freed memory leaves the agent's RSS.
TRIM_AFTER_RECORDS = 100_000
# Each turn gives deleting exited processes' entries from the kernel's ledger this long at most (a scan of it a
# chunk at a time, KernelLedger.collect): a storm of exits never holds the loop up, whatever the ledger's size.
COLLECT_SECONDS_PER_TURN = 0.02
# A turn that starts this long after the one before is late: counted (event_loop_late_turns), the longest kept.
LATE_TURN_SECONDS = 1.0


@dataclass
class BpfOptions:
    pids: set[int] = field(default_factory=set)  # empty: every process (unless only_selected)
    only_selected: bool = False  # trace only pids added later with BpfSource.follow()
    cmdline: re.Pattern | None = None  # trace only processes whose title matches
    settings: ProbeSettings = field(default_factory=ProbeSettings)
    python_stacks: bool = True
    # PyTorch's allocator probes (blocks inside segments). ALWAYS: in every process (one link per library);
    # AUTO: only in the processes raised to depth BLOCKS or FULL (set_block_depths), one link per library and
    # process, so that the others' semaphores stay at zero and torch skips its probes there; NEVER: nowhere.
    # (The agent's --blocks defaults to auto; tests and benches that build a source get every block.)
    blocks: BlocksMode = BlocksMode.ALWAYS
    # Mean bytes between PyTorch blocks whose stacks are walked (stack sampling, probes/usdt.h); 0: every block's.
    block_sample_bytes: int = 0
    preattach_globs: tuple[str, ...] = DEFAULT_PREATTACH_GLOBS
    full_rescan_seconds: float = 10.0
    sweep_seconds: float = 1.0
    # The kernel's tracked processes (a scan of all 65 536 buckets of their map) are read by a sweep after
    # events were lost (an exit among them), else this often; between reads the sweep looks for the ones
    # last read among the living. An exit the probes never report (the main thread that ended first, on a
    # kernel without group_dead) is dropped within this and a sweep.
    tracked_read_seconds: float = 30.0
    resync_min_seconds: float = 1.0
    # Libraries with probes in at once. Any user can make new ones (a copy of libcudart is one):
    # beyond the limit a library is refused, said and counted, and tried again once one is free.
    max_libraries: int = 64
    # A library no traced process has mapped for this long loses its probes (preattached files
    # that are still where they were found keep theirs).
    detach_idle_seconds: float = 60.0
    # -p with at most this many processes: probes in those processes only; more: one set per library for
    # every process, filtered in the kernel by pid (--per-process-probes-max).
    per_process_probes_max: int = 8
    # The Session keeps no entry and no total of allocations and blocks: the kernel's ledger and totals
    # are read when a report asks (kernel_ledger.py), and the agent's memory does not grow with them.
    # --no-ledger-in-kernel: every entry is also kept in the agent (about 440 bytes each).
    ledger_in_kernel: bool = True
    # Where the kernel keeps the ledger, a report copies at most this many allocations and blocks from it
    # at once (KernelLedger.read_limit).
    max_read_entries: int = DEFAULT_MAX_READ_ENTRIES


class BpfSource:
    def __init__(self, session: Session, options: BpfOptions | None = None,
                 probes_factory: Callable[[ProbeSettings], BpfProbes] = BpfProbes) -> None:
        self.session = session
        self.options = options or BpfOptions()
        self.discovery = Discovery()
        self.clock = Clock(session.clock_offset_ns)
        self._probes_factory = probes_factory
        self._loaded: BpfProbes | None = None
        self.python_stacks_down = ""  # why there are no Python stacks at all, "" when up
        self.torch_blocks_down = ""  # why PyTorch's allocator probes are not traced, "" when they are
        # The parts that use the probes, made when the probes are set (see `probes`).
        self.selection: Selection
        self.stack_names: StackNames
        self.targets: Targets
        self.shares: ShareWatch
        self._batch: list[Event | EventRun] = []  # decoded in this poll, ingested after it
        # Held while the loop polls and keeps house; follow() takes it from other threads.
        self._lock = threading.Lock()
        self._pending: dict[int, list[float]] = {}  # pid -> monotonic times to rescan at
        self._swept_exited: set[int] = set()  # selected pids whose exit sweep_exited has handled
        self._missed_seen = 0  # events lost + block events unsent, as last seen
        self._records_since_trim = 0
        self._totals_ever_full = False  # the probes counted a change the totals map had no room for
        # The Session's ledger while the probes are loaded, where the kernel keeps it (--ledger-in-kernel).
        self.kernel_store: KernelLedger | None = None
        self._tracked_read_at_missed = -1  # _missed_seen when the sweep last read the tracked processes
        self._next_tracked_read = 0.0
        self._tracked: set[int] = set()  # those it read, less the ones whose exit came or that it swept since
        self._resync_due = False
        self._resync_pace_seconds = self.options.resync_min_seconds  # see resync
        self._undecodable = 0  # events that could not be decoded (each one triggers a resync)
        self._next_full_scan = 0.0
        self._next_sweep = 0.0
        self._next_report = 0.0
        self._next_busy_report = 0.0
        self._next_turn_monotonic = 0.0  # run_once: not before (a busy stream's turns are spaced)
        # How steadily the loop turns: the start of the last turn, the longest gap between two, the late ones.
        self._last_turn_monotonic: float | None = None
        self.longest_turn_gap_seconds = 0.0
        self.late_turns_total = 0
        self._records_this_turn = 0
        # A turn that takes this many records is behind: the poll budget, or half the ring if that is less.
        self._behind_records = min(POLL_BUDGET_EVENTS,
                                   self.options.settings.ringbuf_pages * mmap.PAGESIZE // RingReader.STRIDE // 2)
        self._events_since_report = False
        self._next_resync_allowed = 0.0
        self._quiet_blocks = False  # as the probes were told (KVT_CONFIG_QUIET_BLOCKS)
        self._undropped: set[int] = set()  # lowered processes whose blocks are still to leave the kernel's ledger

    @property
    def probes(self) -> BpfProbes | None:
        """The loaded probes: None before start and after stop."""
        return self._loaded

    @probes.setter
    def probes(self, probes: BpfProbes | None) -> None:
        """Setting them (start, or a test's stand-in) hands them to the parts that use them, made here."""
        self._loaded = probes
        if probes is None:
            return  # (the parts stay readable after stop, as what they found)
        options = self.options
        self.selection = Selection(probes, options)
        self.stack_names = StackNames(probes, self.session)
        # Following pids chosen at start (-p): probes go on those processes only, so that the others
        # pay nothing (with inode-wide probes every process traps, and BPF drops what is filtered).
        # A few chosen processes get probes of their own; more share one set per library, filtered in the
        # kernel: attaching and detaching then cost per library, not per library and process (a link per
        # process and library, each a grace period to take down).
        per_pid = (bool(options.pids) and not options.only_selected and options.cmdline is None
                   and len(options.pids) <= options.per_process_probes_max)
        self.targets = Targets(probes, self.session, self.discovery, self.selection, self.stack_names, AttachPolicy(
            max_libraries=options.max_libraries, detach_idle_seconds=options.detach_idle_seconds, per_pid=per_pid,
            blocks=options.blocks, python_stacks=not self.python_stacks_down,
            torch_blocks_down=self.torch_blocks_down, block_sample_bytes=options.block_sample_bytes))
        self.shares = ShareWatch(probes, self.session, options.settings.max_ledger_entries, options.settings.max_totals)

    # What the parts hold, read where it was read before (the kernel ledger's readers, tests, benches).

    @property
    def filtering(self) -> bool:
        return self.selection.filtering

    @property
    def _selected(self) -> set[int]:
        return self.selection.pids

    @property
    def _stack_ids(self) -> dict[int, int]:
        return self.stack_names.stack_ids

    def _resolve_stack(self, pid: int, kernel_stack_id: int) -> int:
        return self.stack_names.resolve(pid, kernel_stack_id)

    @property
    def python(self) -> dict[int, PythonTarget | NoPython]:
        return self.stack_names.python

    @property
    def symbolizer(self) -> Symbolizer:
        return self.stack_names.symbolizer

    @property
    def refused(self) -> dict[str, str]:
        """path -> why it was not attached"""
        return self.targets.refused

    @property
    def late_device(self) -> dict[int, int | None]:
        return self.targets.late_device

    def _probes(self) -> BpfProbes:
        if self.probes is None:
            raise RuntimeError("the BPF source is not started")
        return self.probes

    # ---- lifecycle ----

    def start(self) -> None:
        from kvtrace.sources.bpf.btf import TASK_COMM, TASK_EXIT_CODE, TASK_FSBASE, BtfError, task_offsets

        settings = self.options.settings
        wanted_fsbase = settings.task_fsbase_offset if self.options.python_stacks else 0  # 0: not wanted
        missing = [member for member, offset in ((TASK_FSBASE, wanted_fsbase),
                                                 (TASK_EXIT_CODE, settings.task_exit_code_offset),
                                                 (TASK_COMM, settings.task_comm_offset)) if offset < 0]
        offsets = task_offsets(missing) if missing else {}  # the kernel's BTF, read once
        fsbase, exit_code, comm = (offsets.get(member) for member in (TASK_FSBASE, TASK_EXIT_CODE, TASK_COMM))
        if not self.options.python_stacks:
            self.python_stacks_down = "Python stacks disabled by configuration"
        elif isinstance(fsbase, BtfError):
            self.python_stacks_down = f"no Python stacks: {fsbase}"
            log.warning("%s", self.python_stacks_down)
        if isinstance(exit_code, BtfError):  # exits then say nothing of how the process ended
            log.warning("process exits carry no exit status: %s", exit_code)
        if isinstance(comm, BtfError):  # the same names, through bpf_get_current_comm (slower)
            log.info("events' thread names through a helper call: %s", comm)
        if isinstance(fsbase, int):
            settings = replace(settings, task_fsbase_offset=fsbase)
        if isinstance(exit_code, int):
            settings = replace(settings, task_exit_code_offset=exit_code)
        if isinstance(comm, int):
            settings = replace(settings, task_comm_offset=comm)
        self.options.settings = settings
        self.session.report_component("python_stacks", not self.python_stacks_down, self.python_stacks_down)
        probes = self._probes_factory(settings)
        if self.options.blocks is BlocksMode.NEVER:
            self.torch_blocks_down = "PyTorch blocks disabled by configuration (--blocks never)"
        elif not probes.uprobe_links:
            self.torch_blocks_down = "PyTorch's allocator probes need uprobe_multi links (Linux 6.6+)"
        if self.options.blocks is BlocksMode.AUTO and not self.options.ledger_in_kernel:
            # Lowering a process's depth drops its blocks from the kernel's ledger and totals; a kept ledger has
            # no such drop, so every process has its blocks traced.
            log.warning("--blocks auto needs the ledger in the kernel: PyTorch blocks traced in every process")
            self.options.blocks = BlocksMode.ALWAYS
        self.probes = probes  # the parts are made with what was found above
        self.session.traced_only = self.filtering
        self.session.report_component("torch_blocks", not self.torch_blocks_down, self.torch_blocks_down)
        probes.set_filter(self.filtering)
        probes.set_block_sample_bytes(self.options.block_sample_bytes)
        for pid in self.options.pids:
            self.selection.select(pid)
        if self.options.ledger_in_kernel:
            self._keep_ledger_in_kernel(probes)
        self.session.set_block_readers_hook(self._on_block_readers)
        probes.open_rings(self._on_raw_events, self._on_notify)
        self._next_full_scan = time.monotonic() + self.options.full_rescan_seconds
        self.targets.first_scan(self.options.preattach_globs)
        self._report()

    def _keep_ledger_in_kernel(self, probes: BpfProbes) -> None:
        """The Session's ledger is the kernel's from now on (before the first event)."""
        self.kernel_store = KernelLedger(probes, self.clock, self._stack_ids, self._followed,
                                         lambda: self._totals_ever_full, self.options.max_read_entries)
        self.session.replace_ledger(self.kernel_store)

    def hurry_readers(self) -> None:
        """The probes go soon: readers of the kernel's ledger on other threads (the site sample) stop giving way
        to clients' reads, so that the wait for them before stop() is short."""
        if self.kernel_store is not None:
            self.kernel_store.stop_giving_way()

    def stop(self) -> None:
        if self.probes is not None:
            self.session.set_block_readers_hook(None)
            # First: the Session's totals and entries are the kernel's, and go with the probes.
            if self.kernel_store is not None:
                self.session.replace_ledger(self.kernel_store.detached())
                self.kernel_store = None
            try:
                self.probes.close()
            finally:
                self.probes = None
                self.stack_names.close()

    def run_once(self, timeout_ms: int = 100) -> None:
        probes = self._probes()
        pause = self._next_turn_monotonic - time.monotonic()
        if pause > 0:
            time.sleep(pause)  # a busy stream: its next batch gathers meanwhile
        probes.wait(timeout_ms)  # sleeps without the lock
        started = time.monotonic()
        if self._last_turn_monotonic is not None:
            gap = started - self._last_turn_monotonic
            self.longest_turn_gap_seconds = max(self.longest_turn_gap_seconds, gap)
            self.late_turns_total += gap > LATE_TURN_SECONDS + timeout_ms / 1000
        self._last_turn_monotonic = started
        with self._lock:
            self._records_this_turn = 0
            probes.poll(0)
            self._flush()
            self.housekeeping()
            busy = 0 < self._records_this_turn < self._behind_records
            self._records_since_trim += self._records_this_turn
        self._next_turn_monotonic = started + BUSY_TURN_SECONDS if busy else 0.0
        if not self._records_this_turn and self._records_since_trim >= TRIM_AFTER_RECORDS:
            # A burst is over: what it freed goes back to the system, not kept by the C heap for the next
            # (its batches, rings' copies and decoded runs: megabytes that would stay resident).
            self._records_since_trim = 0
            return_freed_heap()

    def _on_block_readers(self, wants_every_block: bool) -> None:
        """(The Session's block-readers hook, under its lock.) While no sink reads every block's event, the probes
        send only those of blocks whose stacks they walk (fewer records by the sampling's ratio at depth blocks):
        the kernel keeps the ledger and totals exact. A kept ledger (--no-ledger-in-kernel) is made of the
        events: it needs them all."""
        if self.probes is None:
            return
        quiet = self.options.ledger_in_kernel and not wants_every_block
        if quiet is not self._quiet_blocks:
            self._probes().set_quiet_blocks(quiet)
            self._quiet_blocks = quiet
            log.info("PyTorch block events: %s", "only of blocks with a stack (nobody reads the others)" if quiet
                     else "every one (a reader wants them)")

    def _flush(self) -> None:
        batch, self._batch = self._batch, []
        if batch:
            self.session.ingest_many(batch)

    def _report(self, counters: dict[str, int] | None = None) -> None:
        """Counters, attached libraries and a heartbeat to the Session (every BUSY_REPORT_SECONDS while
        events come, once a second when idle)."""
        counters = dict(counters if counters is not None else self._probes().counters())
        counters["events_undecodable"] = self._undecodable
        counters["event_loop_late_turns"] = self.late_turns_total
        counters["event_loop_longest_gap_ms"] = round(self.longest_turn_gap_seconds * 1000)
        counters.update(self.targets.counters())
        self.session.report_counters(counters)
        self.session.report_libraries(self.attached_libraries())
        waiting = sorted(self.targets.over_limit.values())
        why = self.targets.waiting_why.get(waiting[0], "") if waiting else ""
        self.session.report_component(
            "libraries", not waiting,
            f"{len(waiting)} libraries wait for probes: {len(self.targets.attached)} attached, the limit "
            f"(--max-libraries {self.options.max_libraries}), a user's share of it or bcc's probe quota is "
            f"reached; e.g. {waiting[0]}" + (f" ({why})" if why else "") if waiting else "")
        try:
            self.shares.report(time.monotonic())
        except Exception:  # who was refused is told where it can be; the loop goes on
            log.exception("reading the probes' shares failed")
        self.session.report_component("bpf", True, stale_after_seconds=STALLED_AFTER_SECONDS,
                                      stale_reason="the event loop is stalled")

    # ---- events ----

    def _on_raw_events(self, records: bytes, stride: int, offset: int) -> None:
        """A poll's records at once (loader.open_rings): decoded in one go; events that need no
        more than the pid filter (no kernel stack, not an exit or context destroy) join the batch
        without a Python call each, as one EventRun with their records where all are wanted."""
        self._events_since_report = True
        self._records_this_turn += len(records) // stride
        try:
            events, kernel_stack_ids, undecodable = decode_events(records, self.clock, stride, offset,
                                                                  self.options.block_sample_bytes)
        except ValueError as error:  # not whole records: probes of another build?
            self._count_undecodable(max(1, len(records) // stride), error)
            return
        if undecodable:
            self._count_undecodable(undecodable, "a kind, API or enum value this agent does not know")
        stacked = any(kernel_stack_ids)  # then each event is admitted alone: no run is made
        run = None if stacked else event_run(events, records, self.clock, stride, offset,
                                             self.options.block_sample_bytes)
        if stacked or not _LIFECYCLE_KIND_NUMBERS.isdisjoint(
                run.kinds if run is not None else {int(event.kind) for event in events}):
            for event, kernel_stack_id in zip(events, kernel_stack_ids, strict=True):
                self._admit(event, kernel_stack_id)
        elif run is not None and (not self.filtering or run.pids <= self._selected):
            self._batch.append(run)
        elif self.filtering:
            selected = self._selected
            self._batch.extend([event for event in events if event.pid in selected])
        else:
            self._batch.extend(events)

    def _count_undecodable(self, count: int, error: object) -> None:
        self._undecodable += count
        if self._undecodable == count:
            log.error("an event could not be decoded (%s): the ledger is resynced from the kernel's; "
                      "kvtrace_events_undecodable_total counts them", error)
        # housekeeping sees the count go up: subscribers are told, the ledger resyncs

    def _admit(self, event: Event, kernel_stack_id: int) -> None:
        if self.filtering and event.pid not in self._selected:
            return
        if kernel_stack_id:
            event.stack_id = self._resolve_stack(event.pid, kernel_stack_id)
            if not event.stack_id:
                event.stack_status = StackStatus.UNRESOLVED
        self._batch.append(event)
        if event.kind is Kind.PROCESS_EXIT:
            # The Session first: what watches exits (the flight recorder) copies what the process held, and
            # where the kernel keeps the allocations, that copy is read from the kernel's entries.
            self._flush()
            self._drop_in_kernel(event.pid, event.timestamp_ns)
            self._tracked.discard(event.pid)  # the probes untracked it: nothing for the sweep
            self._forget_process(event.pid)
            if event.pid in self._selected:
                self._swept_exited.add(event.pid)  # seen exiting: the sweep has nothing to add
        elif event.kind is Kind.CONTEXT_DESTROY and event.error_code == 0:
            self._flush()
            device = None if event.device == DEVICE_UNKNOWN else event.device
            self._drop_in_kernel(event.pid, event.timestamp_ns, device)

    def _on_notify(self, raw: abi.RawNotify) -> None:
        if self.filtering and self.options.cmdline is None and raw.pid not in self._selected:
            return  # following chosen pids only: other processes' new code does not matter
        now = time.monotonic()
        if raw.reason == abi.NOTIFY_EXEC:
            self.session.process_execed(raw.pid)
            self.targets.forget_cuda_start(raw.pid)  # its code objects, runtime, mappings and CUDA are gone
            self.stack_names.forget(raw.pid)
        self._pending[raw.pid] = [now + delay for delay in RESCAN_DELAYS_SECONDS]

    # ---- housekeeping ----

    def housekeeping(self) -> None:
        now = time.monotonic()
        for pid, due in list(self._pending.items()):
            if due and due[0] <= now:
                due.pop(0)
                self.targets.scan_pid(pid)
            if not due:
                del self._pending[pid]
        if now >= self._next_full_scan:
            self._next_full_scan = now + self.options.full_rescan_seconds
            self.targets.full_scan()
        if now >= self._next_sweep:
            self._next_sweep = now + self.options.sweep_seconds
            self.sweep_exited()
            self.targets.detach_unused(now)
        if self._events_since_report or now >= self._next_report:
            # (counters read since the last report are reported at the busy pace even where no event
            # follows: a burst's last counts are out within BUSY_REPORT_SECONDS of its end, not a second)
            report = now >= self._next_report or now >= self._next_busy_report
            if report:
                self._events_since_report = False
                self._next_report = now + IDLE_REPORT_SECONDS
                self._next_busy_report = now + BUSY_REPORT_SECONDS
            self._check_counters(report)
        if self._resync_due and now >= self._next_resync_allowed:
            self._next_resync_allowed = now + self._resync_pace_seconds
            self._resync_due = False
            self.resync()
        if self.kernel_store is not None:
            self.kernel_store.collect(COLLECT_SECONDS_PER_TURN)

    def _check_counters(self, report: bool = True) -> None:
        counters = self._probes().counters()
        self._totals_ever_full = self._totals_ever_full or counters["totals_full"] > 0
        if report:
            self._report(counters)
        # Events that never reached user space: lost when the ring was full, or a block event over
        # its process's rate. Subscribers are told in-band; the ledger comes back from the kernel's.
        missed = counters["events_lost"] + counters["blocks_unsent"] + self._undecodable
        if missed > self._missed_seen:
            self.session.ingest(EventsLost(missed - self._missed_seen, self.session.wall_clock_ns()))
            self._missed_seen = missed
            self._resync_due = True
            if self.kernel_store is not None:
                self.kernel_store.note_events_lost()

    def follow(self, pid: int) -> None:
        """Adds a process to the filter (and traces it now); used by tests and the API."""
        with self._lock:
            probes = self._probes()
            self.selection.choose(pid)  # (in the options' pids too)
            self.targets.attach_for_pid(pid)
            # Take in what the rings hold first: an exec notification of this pid still queued
            # would otherwise be handled after scan_pid and forget the Python runtime just found.
            probes.poll(0)
            self._flush()
            self.targets.scan_pid(pid)
            self._report()  # reads the targets the event loop changes: under the lock too

    # ---- depth per process (--blocks auto) ----

    @property
    def blocks_mode(self) -> BlocksMode:
        """What the probes really do with PyTorch's blocks (NEVER where they cannot trace them at all)."""
        return BlocksMode.NEVER if self.torch_blocks_down else self.options.blocks

    def follows(self, pid: int) -> bool:
        """Whether the probes trace `pid` (every process, or one of those chosen)."""
        return self.selection.follows(pid)

    def deepenable_pids(self) -> set[int]:
        """The processes whose PyTorch blocks can be traced here (Targets.deepenable_pids)."""
        return self.targets.deepenable_pids()

    def pytorch_pids(self) -> set[int]:
        """The processes that map a library with PyTorch's allocator probes, traceable or not."""
        return self.targets.pytorch_pids()

    def set_block_depths(self, depths: Mapping[int, Depth]) -> None:
        """Makes the processes at BLOCKS or FULL in `depths` exactly the ones whose PyTorch probes are in
        (--blocks auto; elsewhere only FULL is applied). A process raised gets its own link on each PyTorch
        library it maps (its semaphores only: no other process pays); its blocks are known from now. A process
        lowered loses its links, and its blocks leave the kernel's ledger and the agent's totals (no free of
        theirs will be seen again): its memory is its segments again. Idempotent: called at every analysis,
        it also attaches libraries a raised process mapped since."""
        with self._lock:
            probes = self._probes()
            deep = self.targets.deep
            wanted = {pid: depth for pid, depth in depths.items() if depth >= Depth.BLOCKS and self.follows(pid)}
            self._lower(sorted(deep.keys() - wanted.keys()))  # (and any lowering left to finish)
            for pid, depth in sorted(wanted.items()):
                if deep.get(pid) is not depth:
                    probes.set_block_full(pid, depth is Depth.FULL)
                    deep[pid] = depth
                    self.targets.hook_depth_changed(pid)
            if self.torch_blocks_down:
                return
            if self.options.blocks is not BlocksMode.AUTO:
                if self.targets.policy.per_pid:  # a hook refused since its link: PyTorch's own sites, now
                    self.targets.attach_torch_of(self.selection.pids)
                return
            self.targets.attach_torch_of(wanted.keys())

    def _lower(self, pids: list[int]) -> None:
        """Back to SEGMENTS: their PyTorch links out first (no block of theirs can enter the ledger after), then
        every block of theirs out of the kernel's ledger and its totals (KernelLedger.drop_blocks, one pass for all)."""
        for pid in pids:
            if self.options.blocks is BlocksMode.AUTO:
                self._undropped.add(pid)  # first: whatever fails below, its blocks are dropped at a later call
            del self.targets.deep[pid]
            self.targets.detach_torch_of(pid)
        if self._undropped:
            # Their events still in the rings first, all of them (blocks allocated before the links closed): after
            # the drop they would add blocks whose frees never come.
            while True:
                taken = self._records_this_turn
                self._probes().poll(0)
                self._flush()
                if self._records_this_turn - taken < POLL_BUDGET_EVENTS:
                    break
            dropping = frozenset(self._undropped)
            self._drop_blocks_in_kernel(dropping)
            self._undropped -= dropping  # only once dropped: a pass that failed is made again at the next call

    def _drop_blocks_in_kernel(self, pids: frozenset[int]) -> None:
        """Deletes the PyTorch blocks of `pids` from the kernel's ledger; the agent stops counting them, and
        recordings start again from a checkpoint (no free of those blocks will ever come)."""
        if self.kernel_store is None:
            return  # (--blocks auto needs the ledger in the kernel: start() made it always without)
        sums = self.kernel_store.drop_blocks(pids)
        if sums:
            self.session.request_checkpoints()
        log.info("pids %s back to segments: %d PyTorch blocks (%d bytes) no longer followed", sorted(pids),
                 sum(count for _, count in sums.values()), sum(size for size, _ in sums.values()))

    def sweep_exited(self) -> None:
        """Drops processes that exited without us seeing the event (lost, or before we started).

        A pid chosen with -p stays selected after its process is gone (a new process with that pid
        is followed too), so it is dropped once, not at every sweep: dropping reads the whole
        kernel ledger."""
        # (one that is alive again is a new process with that pid: swept again when it exits)
        self._swept_exited = {pid for pid in self._swept_exited & self._selected if not psutil.pid_exists(pid)}
        probes = self._probes()
        now = time.monotonic()
        if self._missed_seen != self._tracked_read_at_missed or now >= self._next_tracked_read:
            self._tracked_read_at_missed = self._missed_seen
            self._next_tracked_read = now + self.options.tracked_read_seconds
            self._tracked = probes.tracked_pids()
        # (a process whose exit was lost may still be a zombie at the read after the loss: it is looked for
        # at every sweep until it is gone)
        for pid in self._tracked | (self._selected - self._swept_exited):
            if psutil.pid_exists(pid):
                continue
            # The probes untrack a process whose exit they report; one they could not report (the ring was
            # full) is untracked here, and then looked for again: a process that took the pid before that
            # may have seen the mark (a thread remembers it), so it gets it back, and its exit drops what
            # both held. One that takes the pid after marks itself, and holds nothing older than `before`.
            before_wall_ns = self.session.wall_clock_ns()
            was_tracked = probes.forget_tracked(pid)
            if psutil.pid_exists(pid):
                if was_tracked:
                    probes.mark_tracked(pid)
                continue
            if pid in self._tracked:
                self._tracked.discard(pid)
                if not was_tracked:
                    continue  # the probes reported its exit since the read: that event is on its way
            if pid in self._selected:
                self._swept_exited.add(pid)
            self._flush()
            self.session.forget_process(pid)  # before the kernel's entries go: an exit watcher reads them
            self._drop_in_kernel(pid, before_wall_ns)
            self._forget_process(pid)
            log.info("process %d exited: what it held is dropped", pid)
        # Processes that exited holding nothing traced send no exit event: forget them here too.
        for pid in [pid for pid in {*self.late_device, *self.python} if not psutil.pid_exists(pid)]:
            self._forget_process(pid)

    def _forget_process(self, pid: int) -> None:
        self._undropped.discard(pid)  # its exit dropped everything it held
        self.targets.forget_process(pid)
        self.stack_names.forget(pid)
        if pid in self._selected and not self.options.pids:
            self._selected.discard(pid)
            self._probes().unselect_pid(pid)

    def _drop_in_kernel(self, pid: int, before_wall_ns: int, device: int | None = None) -> None:
        """What an exit or context destroy freed leaves the kernel's ledger, after the Session saw the event
        (KernelLedger.drop). A kept ledger dropped its own entries at the event; the kernel's entries and the
        totals of an exited pid go all the same."""
        if self.kernel_store is not None:
            self.kernel_store.drop(pid, before_wall_ns, device)
            return
        probes = self._probes()
        delete_entries(probes, frozenset((pid,)), self.clock.monotonic_ns(before_wall_ns), device,
                       give_back=device is not None)  # (a context destroy's process lives on)
        if device is None:  # (a kept ledger, --no-ledger-in-kernel, reads the whole ledger at each exit still)
            probes.take_totals([key for key, _ in probes.read_totals() if key.pid == pid])

    def resync(self) -> None:
        """Replaces the Session's kept entries with the kernel's exact copy (after lost events). Where the
        kernel keeps the allocations and blocks (KernelLedger), their totals are exact already: only the other
        objects are decoded, and the stacks of allocations whose events were lost are named."""
        if self.kernel_store is None:
            self.session.resync(self._kernel_entries())
            log.warning("events were lost: ledger resynced from the kernel")
            return
        wanted = frozenset(self._selected) if self.filtering else frozenset()
        kept: list[Outstanding] = []
        unnamed: dict[int, int] = {}  # kernel stack id -> a pid: allocations whose events were lost
        started = time.monotonic()
        for keys, values in self._probes().iter_ledger_chunks():
            # Only chunks with a stack not named yet, or an object kept here, are unpacked entry by entry: a
            # resync of millions of named allocations costs their system calls and a few C calls a chunk.
            if not (chunk_stack_ids(values) - self._stack_ids.keys()).issubset({0}):
                for pid, kernel_stack_id in stacks_in_chunk(keys, values, COUNTED_OBJECT_VALUES, wanted):
                    if kernel_stack_id not in self._stack_ids:
                        unnamed.setdefault(kernel_stack_id, pid)
            if _KEPT_OBJECT_VALUES.isdisjoint(chunk_objects(keys)):
                continue
            for entry, kernel_stack_id in decode_ledger_chunk(keys, values, self.clock, _KEPT_OBJECT_VALUES, wanted):
                if kernel_stack_id:
                    entry.stack_id = self._resolve_stack(entry.key.pid, kernel_stack_id)
                kept.append(entry)
        self.session.resync(kept)
        for kernel_stack_id, pid in unnamed.items():  # reports read these entries with their stacks now
            self._resolve_stack(pid, kernel_stack_id)
        seconds = time.monotonic() - started
        # The read goes through every entry on this thread: under a steady flood of losses it is made again
        # at most once per ten times its own length.
        self._resync_pace_seconds = max(self.options.resync_min_seconds, 10 * seconds)
        log.warning("events were lost: %d VMM objects read again from the kernel, %d stacks named, in %.2f s",
                    len(kept), len(unnamed), seconds)

    def _kernel_entries(self) -> Iterator[Outstanding]:
        """The kernel ledger one entry at a time (millions of entries must not be held twice)."""
        for key, value in self._probes().iter_ledger_items():
            try:
                entry = decode_ledger_entry(key, value, self.clock)
            except ValueError as error:  # an entry this agent cannot read: left out, not fatal
                log.warning("ledger entry of pid %d left out of the resync: %s", key.pid, error)
                continue
            if not self.filtering or entry.key.pid in self._selected:
                # Stacks as already named (naming one takes the Session's lock, held by the resync).
                if value.stack_id:
                    entry.stack_id = self._stack_ids.get(value.stack_id, 0)
                yield entry

    def _followed(self) -> frozenset[int]:
        """The pids followed where the agent follows chosen ones; empty: every process."""
        return frozenset(self._selected) if self.filtering else frozenset()

    # ---- views (tests, benchmarks, doctor) ----

    def kernel_ledger(self) -> list[Outstanding]:
        return [decode_ledger_entry(k, v, self.clock) for k, v in self._probes().ledger_items()]

    def attached_libraries(self) -> list[AttachedLibrary]:
        """The files with probes in, each with what is probed there (functions, and pytorch:malloc /
        pytorch:free for PyTorch's allocator) and the traced processes that map it."""
        return [] if self.probes is None else self.targets.attached_libraries()

    def counters(self) -> dict[str, int]:
        return self._probes().counters()
