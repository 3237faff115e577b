"""The tracing pipeline: BPF probes + discovery -> events -> ledger -> sinks.

One thread runs it: `run_once()` polls the rings (events are decoded, applied to the ledger and
handed to the sinks in order) and does the housekeeping that keeps attach targets and the ledger
right: rescans processes that exec'd or mapped code, drops processes that exited, and resyncs the
ledger from the kernel's exact copy after events were lost.
"""
from __future__ import annotations

import glob
import logging
import os
import platform
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import psutil

from kvtrace.model.events import DEVICE_UNKNOWN, Event, Kind
from kvtrace.model.ledger import Ledger
from kvtrace.model.processes import ProcessTable
from kvtrace.model.stacks import NativeFrame, Stack, StackTable
from kvtrace.sources.bpf import abi
from kvtrace.sources.bpf.decode import Clock, decode_event, decode_ledger_entry
from kvtrace.sources.bpf.loader import BpfProbes, ProbeSettings
from kvtrace.sources.discovery import Discovery, Target
from kvtrace.sources.python.runtime import NoPython, PythonTarget, inspect_python
from kvtrace.sources.python.symbolize import NativeSymbolizer, Symbolizer

log = logging.getLogger(__name__)

EventSink = Callable[[Event], None]

# A notified pid is rescanned now and once more a little later: the mmap that told us may not have
# returned yet when we read /proc/PID/maps.
RESCAN_DELAYS_SECONDS = (0.0, 0.25)

# Where CUDA libraries usually live: attached at start so that a late dlopen (the driver is loaded
# when CUDA initialises) is traced from its first call.
DEFAULT_PREATTACH_GLOBS = (
    "/usr/lib/x86_64-linux-gnu/libcuda.so.*",
    "/usr/lib64/libcuda.so.*",
    "/usr/local/nvidia/lib64/libcuda.so.*",
    "/usr/lib/wsl/lib/libcuda.so.*",
    "/usr/local/cuda*/lib64/libcudart.so.*",
)


@dataclass
class TracerOptions:
    pids: set[int] = field(default_factory=set)  # empty: every process (unless only_selected)
    only_selected: bool = False  # trace only pids added later with Tracer.follow()
    cmdline: re.Pattern | None = None  # trace only processes whose title matches
    settings: ProbeSettings = field(default_factory=ProbeSettings)
    python_stacks: bool = True
    preattach_globs: tuple[str, ...] = DEFAULT_PREATTACH_GLOBS
    full_rescan_seconds: float = 10.0
    sweep_seconds: float = 1.0
    resync_min_seconds: float = 1.0


@dataclass
class AttachedLibrary:
    path: str
    device: int
    inode: int
    symbols: list[str]
    pids: set[int]


class Tracer:
    def __init__(self, options: TracerOptions | None = None, sinks: list[EventSink] | None = None,
                 probes_factory: Callable[[ProbeSettings], BpfProbes] = BpfProbes) -> None:
        self.options = options or TracerOptions()
        self.sinks: list[EventSink] = list(sinks or [])
        self.ledger = Ledger()
        self.processes = ProcessTable()
        self.discovery = Discovery()
        self.clock = Clock()
        self._probes_factory = probes_factory
        self.probes: BpfProbes | None = None
        self.refused: dict[str, str] = {}  # path -> why it was not attached
        self.python: dict[int, PythonTarget | NoPython] = {}  # per traced pid
        self.python_stacks_down = ""  # why there are no Python stacks at all, "" when up
        self.stacks = StackTable()
        self.symbolizer = Symbolizer()
        self.native_symbolizer = NativeSymbolizer()
        self._native_frames: dict[tuple[int, int], NativeFrame] = {}
        self._stack_ids: dict[int, int] = {}  # kernel stack hash -> interned stack id
        self._stack_ids_by_pid: dict[int, set[int]] = {}
        self.events_seen = 0
        # Held while events are applied; API threads take it to copy the ledger consistently.
        self.lock = threading.Lock()
        self.last_loop_monotonic = time.monotonic()
        self.resyncs = 0
        self._pending: dict[int, list[float]] = {}  # pid -> monotonic times to rescan at
        self._selected: set[int] = set()
        self._swept_exited: set[int] = set()  # selected pids whose exit sweep_exited has handled
        # Following pids chosen at start (-p): probes go on those processes only, so that the others
        # pay nothing (with inode-wide probes every process traps, and BPF drops what is filtered).
        self._per_pid_attach = False
        self._attached_targets: dict[str, Target] = {}  # path -> what was attached there
        self._lost_seen = 0
        self._next_full_scan = 0.0
        self._next_sweep = 0.0
        self._next_resync_allowed = 0.0

    @property
    def filtering(self) -> bool:
        return bool(self.options.pids) or self.options.cmdline is not None or self.options.only_selected

    # ---- lifecycle ----

    def start(self) -> None:
        settings = self.options.settings
        if self.options.python_stacks and settings.task_fsbase_offset < 0:
            from dataclasses import replace

            from kvtrace.sources.bpf.btf import BtfError, task_fsbase_offset

            try:
                settings = replace(settings, task_fsbase_offset=task_fsbase_offset())
            except BtfError as error:
                self.python_stacks_down = f"no Python stacks: {error}"
                log.warning("%s", self.python_stacks_down)
        elif not self.options.python_stacks:
            self.python_stacks_down = "Python stacks disabled by configuration"
        self.options.settings = settings
        self.probes = self._probes_factory(settings)
        self.probes.set_filter(self.filtering)
        self._per_pid_attach = (bool(self.options.pids) and not self.options.only_selected
                                and self.options.cmdline is None)
        for pid in self.options.pids:
            self._select(pid)
        self.probes.open_rings(self._on_raw_event, self._on_notify)
        # Running processes first: each one's Python runtime is found before any probe goes into
        # it, so that an allocation caught in the middle of attaching still has its stack.
        self.full_scan()
        for pattern in self.options.preattach_globs:
            for path in sorted(glob.glob(pattern)):
                if os.path.islink(path):
                    continue  # the real file is matched too; attach by inode once
                target = self.discovery.add_file(path)
                if target is not None:
                    self._attach(target)

    def stop(self) -> None:
        if self.probes is not None:
            self.probes.close()
            self.probes = None

    def run_once(self, timeout_ms: int = 100) -> None:
        self.probes.wait(timeout_ms)  # sleeps without the lock
        with self.lock:
            self.probes.poll(0)
            self.housekeeping()
        self.last_loop_monotonic = time.monotonic()

    # ---- events ----

    def _on_raw_event(self, record: bytes) -> None:
        event, kernel_stack_id = decode_event(record, self.clock, self.processes)
        if self.filtering and event.pid not in self._selected:
            return
        if kernel_stack_id:
            event.stack_id = self._resolve_stack(event.pid, kernel_stack_id)
            if not event.stack_id:
                event.stack_status = "unresolved"  # walked, but gone before it could be read
        self.events_seen += 1
        self.ledger.apply(event)
        if event.kind is Kind.PROCESS_EXIT:
            self._drop_in_kernel(event.pid, event.timestamp_ns)
            self._forget_process(event.pid)
        elif event.kind is Kind.CONTEXT_DESTROY and event.error_code == 0:
            device = None if event.device == DEVICE_UNKNOWN else event.device
            self._drop_in_kernel(event.pid, event.timestamp_ns, device)
        for sink in self.sinks:
            sink(event)

    def _on_notify(self, raw: abi.RawNotify) -> None:
        if self.filtering and self.options.cmdline is None and raw.pid not in self._selected:
            return  # following chosen pids only: other processes' new code does not matter
        now = time.monotonic()
        if raw.reason == abi.NOTIFY_EXEC:
            self.processes.forget(raw.pid)
            self._forget_python(raw.pid)
        self._pending[raw.pid] = [now + delay for delay in RESCAN_DELAYS_SECONDS]

    def _resolve_stack(self, pid: int, kernel_stack_id: int) -> int:
        """Kernel stack (raw frames) -> interned, symbolized stack id; 0 if it cannot be read."""
        stack_id = self._stack_ids.get(kernel_stack_id)
        if stack_id is not None:
            return stack_id
        raw = self.probes.read_stack(kernel_stack_id)
        target = self.python.get(pid)
        if raw is None or not isinstance(target, PythonTarget):
            return 0
        frames = self.symbolizer.symbolize(
            pid, target.version, target.offsets,
            [(frame.code, frame.instr) for frame in raw.frames[:raw.depth]],
            code_type=target.code_type_address)
        stack_id = self.stacks.intern(Stack(tuple(frames), bool(raw.truncated)))
        self._stack_ids[kernel_stack_id] = stack_id
        self._stack_ids_by_pid.setdefault(pid, set()).add(kernel_stack_id)
        return stack_id

    def stack_of(self, event: Event) -> Stack | None:
        return self.stacks.get(event.stack_id) if event.stack_id else None

    def native_caller(self, event: Event) -> NativeFrame | None:
        """(module, symbol, offset) of the code that called the CUDA API; cached per address."""
        if not event.caller_address:
            return None
        key = (event.pid, event.caller_address)
        frame = self._native_frames.get(key)
        if frame is None:
            frame = self._native_frames[key] = self.native_symbolizer.symbolize(*key)
        return frame

    # ---- housekeeping ----

    def housekeeping(self) -> None:
        now = time.monotonic()
        for pid, due in list(self._pending.items()):
            if due and due[0] <= now:
                due.pop(0)
                self.scan_pid(pid)
            if not due:
                del self._pending[pid]
        if now >= self._next_full_scan:
            self.full_scan()
        if now >= self._next_sweep:
            self._next_sweep = now + self.options.sweep_seconds
            self.sweep_exited()
        lost = self.probes.counters()["events_lost"]
        if lost != self._lost_seen and now >= self._next_resync_allowed:
            self._lost_seen = lost
            self._next_resync_allowed = now + self.options.resync_min_seconds
            self.resync()

    def full_scan(self) -> None:
        self._next_full_scan = time.monotonic() + self.options.full_rescan_seconds
        if self.options.only_selected or self.options.pids:
            pids = sorted(self._selected)  # following chosen processes: look at nobody else
        else:
            pids = psutil.pids()
        for pid in pids:
            self.scan_pid(pid)

    def scan_pid(self, pid: int) -> None:
        try:
            self._scan_pid(pid)
        except (OSError, psutil.Error) as error:  # it exited or exec'd while we looked: next scan
            log.debug("pid %d: scan failed: %s", pid, error)

    def _scan_pid(self, pid: int) -> None:
        new = self.discovery.scan_pid(pid)
        # The Python runtime first: a process already running (the agent attached late) calls
        # CUDA as soon as the first probe is in, and its calls should carry stacks from the start.
        if pid not in self.python and not self.python_stacks_down and self._maps_cuda(pid):
            self._inspect_python(pid)
        # The driver first: while the runtime's probes go in, its calls are seen as the driver
        # allocations inside them (physical memory, counted); the other way round they would be
        # runtime entries only, and their bytes missing from the device totals.
        for target in sorted(new, key=lambda target: "cuMemAlloc_v2" not in target.symbols):
            self._attach(target)
        if self.options.cmdline is not None and pid not in self._selected and self._maps_cuda(pid):
            info = self.processes.get(pid)
            if info is not None and self.options.cmdline.search(info.title):
                self._select(pid)

    def _inspect_python(self, pid: int) -> None:
        found = inspect_python(pid)
        self.python[pid] = found
        if isinstance(found, PythonTarget):
            o = found.offsets
            self.probes.set_python_target(pid, abi.RawPyTarget(
                tss_key_address=found.tss_key_address, tstate_frame=o.tstate_frame,
                cframe_frame=o.cframe_frame, frame_code=o.frame_code,
                frame_previous=o.frame_previous, frame_instr=o.frame_instr,
                frame_owner=o.frame_owner, frame_read_bytes=o.frame_read_bytes,
                instr_is_lasti=0 if o.instr_is_pointer else 1))
            log.info("pid %d: Python %d.%d stacks from %s", pid, *found.version, found.path)
        else:
            log.info("pid %d: no Python stacks: %s", pid, found.reason)

    def _maps_cuda(self, pid: int) -> bool:
        return any(pid in target.pids for target in self.discovery.targets.values())

    def follow(self, pid: int) -> None:
        """Adds a process to the filter (and traces it now); used by tests and the API."""
        with self.lock:
            self.options.pids.add(pid)
            if self.probes is not None:
                self.probes.set_filter(True)
                self._select(pid)
                if self._per_pid_attach:
                    for target in list(self._attached_targets.values()):
                        self._attach_for(target, pid)
                # Take in what the rings hold first: an exec notification of this pid still queued
                # would otherwise be handled after scan_pid and forget the Python runtime just found.
                self.probes.poll(0)
                self.scan_pid(pid)

    def _select(self, pid: int) -> None:
        self._selected.add(pid)
        self.probes.select_pid(pid)

    def _attach(self, target: Target) -> None:
        from kvtrace.sources.bpf.preflight import process_has_seccomp_filter, uretprobe_seccomp_risk

        if uretprobe_seccomp_risk(platform.release()):
            risky = [pid for pid in target.pids if process_has_seccomp_filter(pid)]
            if risky:
                self.refused[target.path] = (
                    f"kernel {platform.release()} can kill seccomp-filtered processes on uretprobe "
                    f"return (pids {sorted(risky)}); upgrade to 6.14+ to trace them")
                log.warning("not attaching to %s: %s", target.path, self.refused[target.path])
                return
        self._attached_targets[target.path] = target
        for pid in sorted(self._selected) if self._per_pid_attach else [-1]:
            self._attach_for(target, pid)

    def _attach_for(self, target: Target, pid: int) -> None:
        """Probes on `target` for one process (pid) or all (-1), once."""
        if pid in self.probes.attached_pids(target.path):
            return
        attached = self.probes.attach(target.path, target.symbols, pid)
        log.info("attached %d probes to %s for %s (mapped by pids %s)", len(attached), target.path,
                 "every process" if pid == -1 else f"pid {pid}", sorted(target.pids))

    def sweep_exited(self) -> None:
        """Drops processes that exited without us seeing the event (lost, or before we started).

        A pid chosen with -p stays selected after its process is gone (a new process with that pid
        is followed too), so it is dropped once, not at every sweep: dropping reads the whole
        kernel ledger."""
        # (one that is alive again is a new process with that pid: swept again when it exits)
        self._swept_exited = {pid for pid in self._swept_exited & self._selected if not psutil.pid_exists(pid)}
        for pid in self.ledger.pids() | (self._selected - self._swept_exited):
            if not psutil.pid_exists(pid):
                if pid in self._selected:
                    self._swept_exited.add(pid)
                now_ns = time.time_ns()
                dropped = self.ledger.drop_process(pid, before_ns=now_ns)
                self._drop_in_kernel(pid, now_ns)
                self._forget_process(pid)
                if dropped:
                    log.info("process %d exited: %d outstanding objects dropped", pid, dropped)

    def _forget_python(self, pid: int) -> None:
        """After exit or exec: its code objects, runtime and mappings are gone."""
        self.symbolizer.forget(pid)
        self.native_symbolizer.forget(pid)
        for key in [key for key in self._native_frames if key[0] == pid]:
            del self._native_frames[key]
        for kernel_stack_id in self._stack_ids_by_pid.pop(pid, ()):
            self._stack_ids.pop(kernel_stack_id, None)
        if self.python.pop(pid, None) is not None:
            self.probes.set_python_target(pid, None)

    def _forget_process(self, pid: int) -> None:
        self.ledger.forget_counters(pid)
        self.processes.forget(pid)
        self._forget_python(pid)
        self.discovery.forget_pid(pid)
        if pid in self._selected and not self.options.pids:
            self._selected.discard(pid)
            self.probes.unselect_pid(pid)

    def _drop_in_kernel(self, pid: int, before_wall_ns: int, device: int | None = None) -> None:
        before = self.clock.monotonic_ns(before_wall_ns)
        doomed = [key for key, value in self.probes.ledger_items()
                  if key.pid == pid and value.timestamp_ns <= before
                  and (device is None or value.device == device)]
        self.probes.delete_ledger_keys(doomed)
        if device is None:
            self.probes.forget_tracked(pid)

    def resync(self) -> None:
        """Replaces the ledger with the kernel's exact copy (after lost events)."""
        def entries():  # one at a time: millions of entries must not be held twice
            for key, value in self.probes.iter_ledger_items():
                entry = decode_ledger_entry(key, value, self.clock)
                if not self.filtering or entry.key.pid in self._selected:
                    yield entry

        self.ledger.resync(entries())
        self.resyncs += 1
        log.warning("events were lost: ledger resynced from the kernel (%d entries)", len(self.ledger))

    # ---- views ----

    def kernel_ledger(self):
        return [decode_ledger_entry(k, v, self.clock) for k, v in self.probes.ledger_items()]

    def attached_libraries(self) -> list[AttachedLibrary]:
        attached = self.probes.attached() if self.probes else {}
        return [AttachedLibrary(t.path, t.file_id.device, t.file_id.inode, attached.get(t.path, []),
                                set(t.pids))
                for t in self.discovery.targets.values() if t.path in attached]

    def counters(self) -> dict[str, int]:
        counters = self.probes.counters()
        counters["events_seen"] = self.events_seen
        counters["resyncs"] = self.resyncs
        return counters
