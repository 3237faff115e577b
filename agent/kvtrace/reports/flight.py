"""The flight recorder: the agent keeps its last seconds of records in memory and writes them to a
file when something goes wrong, so that what led to an OOM is there after the process is gone.

Triggers: an allocation that fails with out-of-memory, a process that dies (a signal, or a non-zero
exit) holding GPU memory, a forecast time-to-OOM under a threshold (checked after each analysis),
SIGUSR1, and the DumpFlightRecorder call. Each kind dumps at most once per cooldown (the signal and
the call always do); dumps are bounded in count and bytes, the oldest removed first.

A dump is a recording (reports/recording.py) that replays like any other:

    header (with the trigger) | checkpoint: what was held before the window | the window's records
    | checkpoint: the ledger at the trigger

The first checkpoint is the ledger at the trigger less what the window's events allocate, so a
replay rebuilds the window; the last one makes the state at the trigger exact, as the kernel's ledger
stood when it was read (below), whatever happened in between (an allocation from before the window freed
inside it, a VMM handle mapped inside it).
Reports read a dump at its trigger unless asked for another time. A death's dump (`died`) reads the kernel's
part of the ledger on its writer thread, not under the Session's lock in the loop (any user chooses how its
processes die, and a death holding a quarter of the ledger stalled the loop 1.9 s): what the agent keeps itself
is taken at the trigger, the kernel's entries as they are at the read, less those made since, of the processes
followed at the trigger; the dead process's entries wait for the read (LedgerStore.entries_later), and what
another process frees in between is not in the last checkpoint (the kernel keeps no past). Every other trigger
copies the ledger at the trigger: an OOM's process frees its cache right after the failed call.

A ledger larger than --max-read-entries is not copied whole (issue 31): the dump still holds every event of
the window, its checkpoints hold the trigger's process's objects only (or none), and its trigger's `left_out`
says so with the figures; the recorder's health says it before any dump (down, with the figure, while a dump
would leave objects out). Deaths come in storms (any user can start thousands of processes that exit
holding memory): one kind of trigger dumps at most MAX_DUMPS_PER_KIND times per cooldown, whichever processes.

The ring holds its records packed (reports/flight_ring.py: ~110 bytes each, not an object graph of ~390), not
encoded frames: appending packs the event's fields (this runs under the Session's lock for every event); a
trigger copies the packed chunks, and decoding and encoding happen only when a dump is written, on its own thread.
"""
from __future__ import annotations

import logging
import os
import queue
import secrets
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path

from kvtrace._proto.kvtrace.v1 import agent_service_pb2 as service_pb2
from kvtrace.human import human_bytes
from kvtrace.model.events import Event, EventsLost, Kind
from kvtrace.model.findings import AnalysisSnapshot
from kvtrace.model.gpus import NvmlSample
from kvtrace.model.ledger import LedgerClosed, LedgerReadRefused, LedgerResynced
from kvtrace.reports.flight_ring import PackedRing, RingCopy, RingRecord
from kvtrace.reports.recorder import FrameEncoder, recording_header
from kvtrace.reports.recording import RecordingError, RecordingReader, RecordingWriter
from kvtrace.session import Session, SessionCheckpoint

log = logging.getLogger(__name__)

# Dumps waiting for the writer, at most: each holds a copy of the ledger, or a death's holds its collection.
MAX_PENDING_DUMPS = 4
# Dumps of one trigger kind per cooldown, whatever their processes (the signal and the API call: no limit).
MAX_DUMPS_PER_KIND = 4
# (trigger kind, pid) cooldowns kept before the ones past their cooldown are forgotten.
MAX_COOLDOWNS_KEPT = 1024
# Signals that stop a process on purpose: its end with memory held is no death to dump.
STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT})
# cudaErrorMemoryAllocation and CUDA_ERROR_OUT_OF_MEMORY are both 2.
OUT_OF_MEMORY_ERRORS = frozenset({2})
DUMP_SUFFIX = ".kvtrace"
DUMP_PREFIX = "flight-"

TriggerKind = service_pb2.FlightTriggerKind
_TRIGGER_NAMES = {
    service_pb2.FLIGHT_TRIGGER_KIND_OUT_OF_MEMORY: "oom",
    service_pb2.FLIGHT_TRIGGER_KIND_PROCESS_DIED: "died",
    service_pb2.FLIGHT_TRIGGER_KIND_TIME_TO_OOM: "time-to-oom",
    service_pb2.FLIGHT_TRIGGER_KIND_SIGNAL: "signal",
    service_pb2.FLIGHT_TRIGGER_KIND_REQUEST: "request",
}
_ALWAYS = frozenset({service_pb2.FLIGHT_TRIGGER_KIND_SIGNAL, service_pb2.FLIGHT_TRIGGER_KIND_REQUEST})


def trigger_name(kind: int) -> str:
    return _TRIGGER_NAMES.get(kind, "unknown")  # type: ignore[call-overload]


@dataclass(frozen=True)
class FlightOptions:
    directory: Path = Path("/var/lib/kvtrace/flight")
    window_seconds: float = 120.0
    # Records kept at most, whatever the window: ~110 bytes each, packed (~11 MiB at the default:
    # bench/flight_ring.py; kept as objects they took ~390 by tracemalloc, 540-960 of the agent's RSS under an
    # exit storm, bench/RESULTS.md §Q). A busier host keeps fewer seconds; the dump's header says how many.
    max_records: int = 100_000
    max_dumps: int = 16
    max_total_bytes: int = 2 << 30
    time_to_oom_seconds: float = 300.0  # 0: no dump on the forecast
    cooldown_seconds: float = 60.0  # per trigger kind (the signal and the API call always dump)


@dataclass
class _Pending:
    trigger: service_pb2.FlightTrigger
    records: RingCopy  # the window's, decoded as the dump is written
    cutoff_ns: int  # the window's records are at least this new: the first checkpoint holds the older objects
    # The ledger at the trigger (a death's read on the writer thread, Session.checkpoint_later_locked: `reads_later`),
    # and, for a partial copy, the line that says what it left out, given the objects copied.
    copy: Callable[[], SessionCheckpoint]
    left_out: Callable[[int], str] | None = None
    reads_later: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    dump: service_pb2.FlightDump | None = None
    error: str | None = None

    def checkpoints(self) -> tuple[SessionCheckpoint, SessionCheckpoint]:
        """(held before the window, the ledger at the trigger): a death's read now, on the writer thread; any other
        trigger's copied at the trigger."""
        copied = self.copy()
        if self.left_out is not None:
            self.trigger.left_out = self.left_out(len(copied.entries))
            log.warning("flight recorder: %s: %s", self.trigger.reason, self.trigger.left_out)
        end = SessionCheckpoint(self.trigger.timestamp_ns, copied.entries, copied.processes)
        start = SessionCheckpoint(self.cutoff_ns - 1, [entry for entry in end.entries
                                                       if entry.timestamp_ns < self.cutoff_ns], end.processes)
        return start, end


class FlightDumpError(Exception):
    """A dump could not be written (the message says why)."""


class FlightRecorder:
    """A Session sink keeping the last `window_seconds` of records, and the dumps it writes."""

    # Its window needs no event of a PyTorch block whose stack was not walked (Session.wants_every_block): a
    # dump's checkpoint holds every block, exact, from the kernel's ledger; the window then has the sampled
    # blocks' allocations and frees, a consistent sample, beside every segment's.
    wants_every_block = False

    def __init__(self, session: Session, options: FlightOptions, leak_min_age_seconds: float) -> None:
        self.session = session
        self.options = options
        self._leak_min_age_seconds = leak_min_age_seconds
        # Full, it lets its oldest go as records come, and says the newest time it let go of.
        self._ring = PackedRing(options.max_records)
        self._window_ns = int(options.window_seconds * 1e9)  # read for every event: not recomputed
        # The newest time the ring let go of (evicted, or cleared at a resync); None while it holds all.
        self._let_go_ns: int | None = None
        self._last_dump_monotonic: dict[tuple[int, int], float] = {}  # (trigger kind, pid) -> last dump
        self._recent_by_kind: dict[int, deque[float]] = {}  # trigger kind -> its dumps within the cooldown
        self._pending: queue.Queue[_Pending | None] = queue.Queue()
        # Deaths' dumps queued whose checkpoints are not read yet (read from the kernel's maps on the writer thread):
        # the daemon waits for them before the probes and their maps go (wait_reads).
        self._reads_done = threading.Condition()
        self._reads_outstanding = 0
        self._thread: threading.Thread | None = None
        self._dumps_lock = threading.Lock()  # guards the counters below, read by servers
        self.dumps_total = 0
        self.dump_failures_total = 0
        self.dumps_partial_total = 0  # written with checkpoints that leave objects out (the ledger too large)
        self.dumps_suppressed_total = 0  # not made: their kind dumped MAX_DUMPS_PER_KIND times within the cooldown
        self._written: dict[str, service_pb2.FlightDump] = {}  # path -> dump, of this agent's dumps
        # The last dump failed (not written, or not even taken: the writer behind); down until one is written.
        self._failing = False

    def start(self) -> None:
        self.options.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        for partial in self.options.directory.glob(f".{DUMP_PREFIX}*{DUMP_SUFFIX}.partial"):
            partial.unlink(missing_ok=True)  # an agent killed while writing a dump (at an OOM, likely)
        self.session.add_sink(self)
        self.session.add_exit_watcher(self._on_exit)
        self._thread = threading.Thread(target=self._write_dumps, name="kvtrace-flight", daemon=True)
        self._thread.start()

    def wait_reads(self, timeout_seconds: float) -> bool:
        """Waits until every queued death's dump has read its checkpoints (before the probes' maps close); False
        if some had not after `timeout_seconds` (the writer behind a slow disk: those dumps then fail, saying
        so: kernel_ledger.LedgerClosed)."""
        with self._reads_done:
            return self._reads_done.wait_for(lambda: self._reads_outstanding == 0, timeout_seconds)

    def stop(self) -> None:
        self.session.remove_sink(self)
        self.session.remove_exit_watcher(self._on_exit)
        self._pending.put(None)
        if self._thread is not None:
            self._thread.join(timeout=30)

    # ---- the Session's side (under its lock) ----

    def publish(self, event: Event) -> None:
        self._append(event)
        if event.kind is Kind.ALLOC_FAILED and event.error_code in OUT_OF_MEMORY_ERRORS:
            self._trigger_locked(service_pb2.FlightTrigger(
                kind=service_pb2.FLIGHT_TRIGGER_KIND_OUT_OF_MEMORY, timestamp_ns=event.timestamp_ns,
                pid=event.pid, device=event.device,
                reason=f"{event.api.name} of {human_bytes(event.size_bytes)} failed with out of memory "
                       f"(error {event.error_code}) in pid {event.pid} {event.title or event.comm}"))

    def publish_many(self, events: list[Event]) -> None:
        """A run of allocation-type events (never a failure: those come to publish, which may dump)."""
        if not events:
            return
        let_go = self._ring.extend(events)  # full: its oldest go (more records than it holds: some of these too)
        if let_go is not None:
            self._note_let_go(let_go)
        self._let_go_before(events[-1].timestamp_ns - self._window_ns)

    def publish_loss(self, lost_count: int) -> None:
        self._append(EventsLost(lost_count, self.session.wall_clock_ns()))

    def publish_state(self, record: NvmlSample | LedgerResynced) -> None:
        if type(record) is NvmlSample:
            self._append(record)
        else:  # the ring's events no longer add up to the ledger: the window starts again here
            self._ring.clear()
            self._let_go_ns = record.timestamp_ns

    def _append(self, record: RingRecord) -> None:
        let_go = self._ring.append(record)
        if let_go is not None:
            self._note_let_go(let_go)
        self._let_go_before(record.timestamp_ns - self._window_ns)

    def _let_go_before(self, oldest_kept_ns: int) -> None:
        ring = self._ring
        while ring and ring.first_timestamp_ns() < oldest_kept_ns:
            self._note_let_go(ring.popleft_timestamp_ns())

    def _note_let_go(self, timestamp_ns: int) -> None:
        if self._let_go_ns is None or timestamp_ns > self._let_go_ns:
            self._let_go_ns = timestamp_ns

    def expire(self) -> None:
        """Lets go of what is older than the window now, also when no record comes to push it out: an
        idle agent does not hold a past burst's events (up to --flight-max-records of them, about 110
        bytes each) for ever."""
        with self.session.lock:
            self._let_go_before(self.session.wall_clock_ns() - self._window_ns)

    def _on_exit(self, exit_event: Event) -> None:
        """Before the exit drops what the process held: a death holding GPU memory dumps. SIGTERM and
        SIGINT are how processes are stopped on purpose (systemd, Kubernetes, Ctrl-C): no dump."""
        status = exit_event.error_code
        if status == 0 or exit_event.freed_bytes == 0 or status & 0x7f in STOP_SIGNALS:
            return
        how = f"killed by signal {status & 0x7f}" if status & 0x7f else f"exited with status {status >> 8}"
        self._trigger_locked(service_pb2.FlightTrigger(
            kind=service_pb2.FLIGHT_TRIGGER_KIND_PROCESS_DIED, timestamp_ns=exit_event.timestamp_ns,
            pid=exit_event.pid, device=-1,
            reason=f"pid {exit_event.pid} {exit_event.title or exit_event.comm} {how} holding "
                   f"{human_bytes(exit_event.freed_bytes)} of GPU memory"))

    def _trigger_locked(self, trigger: service_pb2.FlightTrigger) -> _Pending | None:
        """Copies the ring and the ledger (a death's: readies its later read) for a dump (the Session's lock is
        held); None when the trigger's kind dumped less than a cooldown ago."""
        now = time.monotonic()
        key = (trigger.kind, trigger.pid)
        last = self._last_dump_monotonic.get(key)
        if trigger.kind not in _ALWAYS and last is not None and now - last < self.options.cooldown_seconds:
            return None
        recent = self._recent_by_kind.setdefault(trigger.kind, deque())
        while recent and now - recent[0] >= self.options.cooldown_seconds:
            recent.popleft()
        if trigger.kind not in _ALWAYS and len(recent) >= MAX_DUMPS_PER_KIND:  # a storm of deaths: a few dumps
            with self._dumps_lock:
                self.dumps_suppressed_total += 1
            log.debug("flight recorder: %s: not dumped, %d %s dumps within %g s", trigger.reason, len(recent),
                      trigger_name(trigger.kind), self.options.cooldown_seconds)
            return None
        if self._pending.qsize() >= MAX_PENDING_DUMPS:  # the writer is behind: no more copies of the ledger
            with self._dumps_lock:
                self.dump_failures_total += 1
                self._failing = True
            log.warning("flight recorder: %s: not dumped, %d dumps are still being written", trigger.reason,
                        MAX_PENDING_DUMPS)
            return None
        if len(self._last_dump_monotonic) >= MAX_COOLDOWNS_KEPT:  # many processes over time: forget cold ones
            self._last_dump_monotonic = {kept: at for kept, at in self._last_dump_monotonic.items()
                                         if now - at < self.options.cooldown_seconds}
        self._last_dump_monotonic[key] = now
        recent.append(now)
        # Stamped at the trigger, not at the copy (later): a replay asked for the trigger's time (--at)
        # stops at the first record after it, and would leave out the very checkpoint that makes it exact.
        # A death's ledger is not copied here, under the Session's lock in the loop (issue 31: a death holding
        # 262 144 entries stalled it 1.9 s, and any user chooses how its processes die), but on the writer thread:
        # what the agent keeps is taken now, the kernel's entries are read there as they are then, less those made
        # since; the dead process frees nothing more, another process's object freed in between is not in the last
        # checkpoint (LedgerStore.entries_later). Other triggers copy now: an OOM's process frees its cache at once.
        later = trigger.kind == service_pb2.FLIGHT_TRIGGER_KIND_PROCESS_DIED
        left_out: Callable[[int], str] | None = None
        try:
            copy = self._checkpoint_locked(None, later)
        except LedgerReadRefused as refused:
            copy, left_out = self._partial_checkpoint_locked(trigger.pid, refused, later)
            with self._dumps_lock:
                self.dumps_partial_total += 1
        records = self._ring.copy()  # packed: decoded on the writer's thread
        # Everything the window's events allocate is replayed from them: the first checkpoint holds the
        # rest. Once the ring has let go of records, those of the same nanosecond as the newest it let go
        # of (or older: events come a little out of order across CPUs) go with the checkpoint too.
        # Never let go of: the window starts at the oldest record's time, not at the first one's (events come a
        # little out of order: one that came after newer ones would be left out of the window).
        if self._let_go_ns is not None:
            cutoff_ns = self._let_go_ns + 1
        else:
            cutoff_ns = min(records.oldest_timestamp_ns() if records else trigger.timestamp_ns, trigger.timestamp_ns)
        records = records.since(cutoff_ns)
        trigger.window_seconds = max(0.0, (trigger.timestamp_ns - cutoff_ns) / 1e9)
        pending = _Pending(trigger, records, cutoff_ns, copy, left_out, reads_later=later)
        if later:
            with self._reads_done:
                self._reads_outstanding += 1
        self._pending.put(pending)
        log.warning("flight recorder: %s: dumping the last %.0f s", trigger.reason, trigger.window_seconds)
        return pending

    def _checkpoint_locked(self, pids: Collection[int] | None, later: bool) -> Callable[[], SessionCheckpoint]:
        """The checkpoint of `pids` (None: all) at this point of the stream: copied when called (`later`), or now."""
        if later:
            return self.session.checkpoint_later_locked(pids)
        copied = self.session.checkpoint_locked(pids)
        return lambda: copied

    def _partial_checkpoint_locked(self, pid: int, refused: LedgerReadRefused, later: bool,
                                   ) -> tuple[Callable[[], SessionCheckpoint], Callable[[int], str]]:
        """The ledger is too large to copy whole: the trigger's process's objects if they fit (none else), and
        the line that says what is left out, with the figures (given the objects copied)."""
        why = (f"the ledger's {refused.entries:,} allocations and blocks are more than --max-read-entries "
               f"{refused.limit:,}")
        if pid:
            try:
                copy = self._checkpoint_locked((pid,), later)
                return copy, lambda count: (
                    f"{why}: the checkpoints hold pid {pid}'s {count:,} objects only (every event of the window is "
                    "here; a free in it of another process's older object replays as unknown)")
            except LedgerReadRefused as also:
                why = f"{why}, pid {pid}'s {also.entries:,} too"
        return self._checkpoint_locked((), later), lambda _: (
            f"{why}: the checkpoints hold no objects (every event of the window is here; a free in it of an "
            "older object replays as unknown)")

    # ---- the agent's side ----

    def report_health(self) -> None:
        """Up while a dump would be whole; down, with the figure, while the ledger is too large to copy (a dump
        then leaves objects out) or the last dump could not be written (down until a dump is written)."""
        refused = self.session.checkpoint_refused()
        with self._dumps_lock:
            failures, failing = self.dump_failures_total, self._failing
        if refused is not None:
            self.session.report_component("flight_recorder", False, (
                f"a dump now would leave objects out: the ledger's {refused.entries:,} allocations and blocks are "
                f"more than --max-read-entries {refused.limit:,} (its checkpoints would hold the trigger's process "
                "only; every event of the window is kept): raise --max-read-entries (about 450 bytes of agent "
                "memory each)"))
        elif failing:
            self.session.report_component("flight_recorder", False, (
                f"{failures} dumps could not be written in {self.options.directory} (the agent log says why)"))
        else:
            self.session.report_component("flight_recorder", True)

    def check(self, snapshot: AnalysisSnapshot | None) -> None:
        """After an analysis: the recorder's health, and a forecast time-to-OOM under the threshold dumps."""
        self.report_health()
        threshold = self.options.time_to_oom_seconds
        if snapshot is None or threshold <= 0:
            return
        for row in snapshot.processes:  # each process has its own cooldown
            if row.time_to_oom_seconds is not None and row.time_to_oom_seconds < threshold:
                with self.session.lock:
                    self._trigger_locked(service_pb2.FlightTrigger(
                        kind=service_pb2.FLIGHT_TRIGGER_KIND_TIME_TO_OOM, timestamp_ns=snapshot.timestamp_ns,
                        pid=row.pid, device=row.device,
                        reason=f"pid {row.pid} {row.title}: GPU {row.device} forecast out of memory in "
                               f"{row.time_to_oom_seconds:.0f} s (threshold {threshold:g} s)"))

    def request_soon(self, kind: service_pb2.FlightTriggerKind, reason: str) -> _Pending:
        """A dump now (SIGUSR1): copied at once, written on the recorder's thread (which logs it)."""
        with self.session.lock:
            pending = self._trigger_locked(service_pb2.FlightTrigger(
                kind=kind, timestamp_ns=self.session.wall_clock_ns(), device=-1, reason=reason))
        if pending is None:  # these kinds have no cooldown: the writer is behind
            raise FlightDumpError(f"{MAX_PENDING_DUMPS} dumps are still being written; ask again in a moment")
        return pending

    def request(self, kind: service_pb2.FlightTriggerKind, reason: str,
                wait_seconds: float = 60.0) -> service_pb2.FlightDump:
        """A dump now (DumpFlightRecorder): waits until it is written."""
        pending = self.request_soon(kind, reason)
        if not pending.done.wait(wait_seconds):
            raise FlightDumpError(f"the dump did not finish within {wait_seconds:g} s")
        if pending.dump is None:
            raise FlightDumpError(pending.error or "the dump failed")
        return pending.dump

    def dumps(self) -> list[service_pb2.FlightDump]:
        """The dumps on disk, newest first."""
        found = []
        with self._dumps_lock:
            written = dict(self._written)
        for path in self._dump_files():
            dump = written.get(str(path))
            if dump is None:  # an earlier agent's: the header says why, the events are not counted
                try:
                    with RecordingReader.open(path) as reader:
                        dump = service_pb2.FlightDump(path=str(path), trigger=reader.header.trigger,
                                                      size_bytes=path.stat().st_size)
                except (OSError, RecordingError):
                    continue
            found.append(dump)
        return sorted(found, key=lambda dump: dump.trigger.timestamp_ns, reverse=True)

    def _dump_files(self) -> list[Path]:
        try:
            return [path for path in self.options.directory.iterdir()
                    if path.name.startswith(DUMP_PREFIX) and path.name.endswith(DUMP_SUFFIX)]
        except OSError:
            return []

    # ---- the writer thread ----

    def _write_dumps(self) -> None:
        while True:
            pending = self._pending.get()
            if pending is None:
                return
            try:
                pending.dump = self._write(pending)
                with self._dumps_lock:
                    self.dumps_total += 1
                    self._written[pending.dump.path] = pending.dump
                    self._failing = False
                log.warning("flight recorder: wrote %s (%d events, %s)", pending.dump.path,
                            pending.dump.event_count, human_bytes(pending.dump.size_bytes))
                self._enforce_bounds(keep=Path(pending.dump.path))
            except Exception as error:  # the thread lives on: the next dump may well succeed
                if isinstance(error, LedgerClosed):  # (not the disk: the agent stopped before its death's read)
                    reason = f"{error}; the dump of {pending.trigger.reason} is not written"
                else:
                    reason = (error.strerror or str(error)) if isinstance(error, OSError) else repr(error)
                pending.error = f"cannot write a flight recorder dump in {self.options.directory}: {reason}"
                with self._dumps_lock:
                    self.dump_failures_total += 1
                    self._failing = True
                log.error("%s", pending.error, exc_info=not isinstance(error, (OSError, LedgerClosed)))
            finally:
                pending.done.set()
            self.session.report_counters({"flight_dumps": self.dumps_total,
                                          "flight_dump_failures": self.dump_failures_total,
                                          "flight_dumps_partial": self.dumps_partial_total,
                                          "flight_dumps_suppressed": self.dumps_suppressed_total})

    def _write(self, pending: _Pending) -> service_pb2.FlightDump:
        try:  # first: a death's read of the kernel's ledger holds its collection until done
            start, end = pending.checkpoints()
        finally:
            if pending.reads_later:
                with self._reads_done:
                    self._reads_outstanding -= 1
                    self._reads_done.notify_all()
        trigger = pending.trigger
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(trigger.timestamp_ns / 1e9))
        name = f"{DUMP_PREFIX}{stamp}-{trigger_name(trigger.kind)}" + (f"-{trigger.pid}" if trigger.pid else "")
        path = self.options.directory / f"{name}{DUMP_SUFFIX}"
        for number in range(1, 100):
            if not path.exists():
                break
            path = self.options.directory / f"{name}.{number}{DUMP_SUFFIX}"
        else:  # a hundred dumps of this name within a second: a name that cannot be taken
            path = self.options.directory / f"{name}.{secrets.token_hex(4)}{DUMP_SUFFIX}"
        header = recording_header(self.session.started_wall_seconds, self._leak_min_age_seconds, start.timestamp_ns,
                                  trigger=trigger)
        # Written under a hidden name, renamed whole: what lists or watches the directory never sees half.
        partial = path.with_name(f".{path.name}.partial")
        writer = RecordingWriter.create(partial, header, exclusive=True)
        # Depths as they stand at the dump (the ring keeps no history of them): what reports read it at.
        encoder = FrameEncoder(self.session.stack, lambda pid: end.processes.get(pid),
                               depths_of=self.session.process_depths, native_of=self.session.native_caller)
        try:
            for frame in encoder.checkpoint(start):
                writer.write(frame)
            for record in pending.records:
                for frame in encoder.record(record):
                    writer.write(frame)
            for frame in encoder.checkpoint(end):
                writer.write(frame)
            writer.close()
            os.rename(partial, path)
        finally:
            writer.close()
            partial.unlink(missing_ok=True)
        return service_pb2.FlightDump(path=str(path), trigger=trigger, size_bytes=path.stat().st_size,
                                      event_count=encoder.events_encoded)

    def _enforce_bounds(self, keep: Path) -> None:
        """The oldest dumps go until at most max_dumps and max_total_bytes are on disk; `keep`, the dump
        just written, stays even when it alone is over the bytes (it is the one wanted now)."""
        files = []
        kept_bytes = 0
        for path in self._dump_files():
            try:
                stat = path.stat()
            except OSError:
                continue
            if path == keep:
                kept_bytes = stat.st_size
            else:
                files.append((stat.st_mtime_ns, path.name, stat.st_size, path))
        files.sort()
        total = kept_bytes + sum(size for _, _, size, _ in files)
        while files and (len(files) + 1 > self.options.max_dumps or total > self.options.max_total_bytes):
            _, _, size, path = files.pop(0)
            try:
                os.unlink(path)
                total -= size
                log.info("flight recorder: removed %s (bounded to %d dumps, %s)", path, self.options.max_dumps,
                         human_bytes(self.options.max_total_bytes))
            except OSError:
                pass

