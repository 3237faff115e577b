"""The attach policy of the BPF source: which libraries get probes, for whom, and when they lose them.

Discovery finds the CUDA and PyTorch libraries that processes map; `Targets` decides what to do with
them: the Python runtime of a process is found before any probe goes in (its first calls carry stacks),
the driver is probed before the runtime, a process whose CUDA started unseen is marked, libraries beyond
the limit (or bcc's probe quota) wait for a free place, and a library nobody maps loses its probes. It is
a part of its own (DataDog's UprobeAttacher shape) so that an attach bug is looked for here, not in the
source's loop: it is handed the probes, the selection and stack naming at construction, and calls back
into nothing.
"""
from __future__ import annotations

import glob
import logging
import os
import platform
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass

import psutil

from kvtrace.model.agent import AttachedLibrary
from kvtrace.model.depth import BlocksMode, Depth
from kvtrace.model.events import DEVICE_UNKNOWN
from kvtrace.model.gpus import cuda_visible_count
from kvtrace.session import Session
from kvtrace.sources import procfs
from kvtrace.sources.bpf.discovery import Discovery, FileId, Target, same_file
from kvtrace.sources.bpf.hook_settings import HookState, read_state, write_sample_bytes
from kvtrace.sources.bpf.loader import BpfProbes, ProbeQuotaFull, TorchProbesRefused
from kvtrace.sources.bpf.selection import Selection
from kvtrace.sources.bpf.shares import library_share
from kvtrace.sources.bpf.stack_names import StackNames
from kvtrace.sources.python.runtime import PythonTarget, inspect_python

log = logging.getLogger(__name__)

# Where CUDA libraries usually live: attached at start so that a late dlopen (the driver is loaded
# when CUDA initialises) is traced from its first call.
DEFAULT_PREATTACH_GLOBS = (
    "/usr/lib/x86_64-linux-gnu/libcuda.so.*",
    "/usr/lib64/libcuda.so.*",
    "/usr/local/nvidia/lib64/libcuda.so.*",
    "/usr/lib/wsl/lib/libcuda.so.*",
    "/usr/local/cuda*/lib64/libcudart.so.*",
)


@dataclass(frozen=True)
class AttachPolicy:
    """What the operator chose (BpfOptions) and what start found, as the attach policy reads it."""

    max_libraries: int = 64  # libraries with probes in at once (--max-libraries)
    detach_idle_seconds: float = 60.0  # a library nobody maps loses its probes after this
    # Probes in each chosen process (-p with few): one set per library and process; else one per library.
    per_pid: bool = False
    blocks: BlocksMode = BlocksMode.ALWAYS
    python_stacks: bool = True  # whether Python runtimes are looked for
    torch_blocks_down: str = ""  # why PyTorch's allocator probes are not traced, "" when they are
    block_sample_bytes: int = 0  # the S of block stacks (--block-sample-bytes), written into kvtrace's PyTorch hook


class Targets:
    def __init__(self, probes: BpfProbes, session: Session, discovery: Discovery, selection: Selection,
                 stack_names: StackNames, policy: AttachPolicy) -> None:
        self._probes = probes
        self._session = session
        self.discovery = discovery
        self._selection = selection
        self._stack_names = stack_names
        self.policy = policy
        self.refused: dict[str, str] = {}  # path -> why it was not attached
        self.probe_sets_attached = 0  # probes.attach calls: once per library, or per library and process (-p)
        self.attached: dict[FileId, Target] = {}  # the libraries with probes in
        self._preattached: set[FileId] = set()  # found by preattach globs, not by a process
        self._idle_since: dict[FileId, float] = {}  # attached libraries nobody maps: since when
        self.over_limit: dict[FileId, str] = {}  # libraries waiting for a free place: their paths
        self.waiting_why: dict[str, str] = {}  # path -> why it waits (the last refusal)
        self._holders: dict[FileId, frozenset[int]] = {}  # attached libraries: the users whose processes mapped them
        self.share_refusals = 0  # libraries refused because their users held their share of slots
        # Processes whose CUDA start the agent may have missed (running before their library had
        # probes): the device their threads use when never seen selecting one (None: device 0).
        self.late_device: dict[int, int | None] = {}
        self._starting = False
        self.libraries_refused = 0  # attach attempts refused by the limit or bcc's probe quota
        self.libraries_detached = 0
        self._partly_blind: set[str] = set()  # libraries some of whose functions the kernel refused
        # --blocks auto: the processes raised to BLOCKS or FULL, whose PyTorch probes are in (set_block_depths).
        self.deep: dict[int, Depth] = {}
        self.torch_refused: set[tuple[FileId, int]] = set()  # (library, pid) the kernel refused a PyTorch link

    # ---- scans ----

    def first_scan(self, preattach_globs: Iterable[str]) -> None:
        """At start: running processes first (each one's Python runtime is found before any probe goes into
        it, so that an allocation caught in the middle of attaching still has its stack), then the files
        where CUDA libraries usually live."""
        self._starting = True
        try:
            self.full_scan()
        finally:
            self._starting = False
        for pattern in preattach_globs:
            for path in sorted(glob.glob(pattern)):
                if os.path.islink(path):
                    continue  # the real file is matched too; attach by inode once
                target = self.discovery.add_file(path)
                if target is not None:
                    self._preattached.add(target.file_id)
                    self.attach(target)

    def full_scan(self) -> None:
        self.over_limit.clear()  # what still waits for a place is refused again below
        self.waiting_why.clear()
        pids: Collection[int]
        if self._selection.chosen_only:
            pids = sorted(self._selection.pids)  # following chosen processes: look at nobody else
        else:
            pids = psutil.pids()
        for pid in pids:
            self.scan_pid(pid)
        self.discovery.forget_other_pids(set(pids))

    def scan_pid(self, pid: int) -> None:
        try:
            self._scan_pid(pid)
        except (OSError, psutil.Error) as error:  # it exited or exec'd while we looked: next scan
            log.debug("pid %d: scan failed: %s", pid, error)
        except Exception:  # one odd process (a crafted or truncated file it maps) never stops the agent
            log.exception("pid %d: scan failed; it is looked at again at the next scan", pid)

    def _scan_pid(self, pid: int) -> None:
        new = self.discovery.scan_pid(pid)
        # The Python runtime first: a process already running (the agent attached late) calls
        # CUDA as soon as the first probe is in, and its calls should carry stacks from the start.
        if pid not in self._stack_names.python and self.policy.python_stacks and self._maps_cuda(pid):
            self._inspect_python(pid)
        # The driver first: while the runtime's probes go in, its calls are seen as the driver
        # allocations inside them (physical memory, counted); the other way round they would be
        # runtime entries only, and their bytes missing from the device totals.
        for target in sorted(new, key=lambda target: "cuMemAlloc_v2" not in target.symbols):
            self.attach(target)
        if pid not in self.late_device and (self._starting or any(target.symbols for target in new)):
            self._note_late_start(pid)  # its CUDA may have started before these probes were in
        cmdline = self._selection.cmdline
        if cmdline is not None and pid not in self._selection.pids and self._maps_cuda(pid):
            info = self._session.read_process(pid)
            if info is not None and cmdline.search(info.title):
                self._selection.select(pid)

    def _inspect_python(self, pid: int) -> None:
        found = inspect_python(pid)
        self._stack_names.add_python(pid, found)
        if isinstance(found, PythonTarget):
            log.info("pid %d: Python %s stacks from %s", pid, found.offsets.label, found.path)
        else:
            log.info("pid %d: no Python stacks: %s", pid, found.reason)

    def _note_late_start(self, pid: int) -> None:
        """A process that maps the CUDA driver before the agent's probes were in (the runtime loads
        it when CUDA starts) may have selected a device unseen: its threads that never select one
        in view are on device 0 only if it sees one GPU (CUDA_VISIBLE_DEVICES and the /dev/nvidiaN
        of its root); with several, their device is unknown."""
        if not any(pid in target.pids and "cuMemAlloc_v2" in target.symbols
                   for target in self.discovery.targets.values()):
            return
        host_gpus = procfs.gpu_device_count(pid)
        visible = (cuda_visible_count(procfs.environ_value(pid, "CUDA_VISIBLE_DEVICES"), host_gpus)
                   if host_gpus is not None else None)
        device = DEVICE_UNKNOWN if visible is None or visible > 1 else None
        self.late_device[pid] = device
        if device is not None:
            self._probes.set_process_device(pid, device)
            log.info("pid %d used CUDA before its probes were in and sees %s GPUs: the device of its "
                     "threads that never select one is unknown", pid, visible if visible is not None else "how many")

    def _maps_cuda(self, pid: int) -> bool:
        return any(pid in target.pids for target in self.discovery.targets.values())

    def forget_cuda_start(self, pid: int) -> None:
        """After exit or exec: its CUDA is gone (a new start is seen, or noted late again)."""
        if self.late_device.pop(pid, None) is not None:
            self._probes.set_process_device(pid, None)

    def forget_process(self, pid: int) -> None:
        """After exit: its PyTorch links, CUDA start and mappings go (its blocks went with its exit)."""
        self.torch_refused = {refused for refused in self.torch_refused if refused[1] != pid}
        if self.deep.pop(pid, None) is not None:
            # Its links go with it (the kernel's breakpoints went with its memory); its blocks went with its exit.
            self.detach_torch_of(pid)
        self.forget_cuda_start(pid)
        self.discovery.forget_pid(pid)

    # ---- attaching ----

    def attach_for_pid(self, pid: int) -> None:
        """A process chosen since start (follow()): where each chosen process has its own probes, it gets
        them in every library attached."""
        if self.policy.per_pid:
            for target in list(self.attached.values()):
                self._attach_guarded(target, pid)

    def attach(self, target: Target) -> None:
        from kvtrace.sources.bpf.preflight import (
            process_has_seccomp_filter,
            uretprobe_seccomp_risk,
        )

        if uretprobe_seccomp_risk(platform.release()):
            risky = [pid for pid in target.pids if process_has_seccomp_filter(pid)]
            if risky:
                self.refused[target.path] = (
                    f"kernel {platform.release()} can kill seccomp-filtered processes on uretprobe "
                    f"return (pids {sorted(risky)}); upgrade to 6.14+ to trace them")
                log.warning("not attaching to %s: %s", target.path, self.refused[target.path])
                self._session.report_component(f"attach:{target.path}", False, self.refused[target.path])
                return
        limit = self.policy.max_libraries
        if target.file_id not in self.attached:
            holders = self._uids_of(target.pids)
            why = self._share_refusal(holders)
            if why:
                self._wait_for_room(target, why)
                return
            self._holders[target.file_id] = holders
        if target.file_id not in self.attached and len(self.attached) >= limit:
            self.detach_unused(time.monotonic(), waited_for=True)
            if len(self.attached) >= limit:
                self._wait_for_room(target, f"{limit} libraries are attached (--max-libraries)")
                return
        self.attached[target.file_id] = target
        for pid in sorted(self._selection.pids) if self.policy.per_pid else [-1]:
            if not self._attach_guarded(target, pid):
                break

    @staticmethod
    def _uids_of(pids: Collection[int]) -> frozenset[int]:
        """The users of the processes that map a library (none: a file found by the preattach globs, root's)."""
        uids = set()
        for pid in pids:
            try:
                uids.add(psutil.Process(pid).uids().real)
            except psutil.Error:
                continue  # gone: it maps nothing now
        return frozenset(uids) if uids else frozenset({0})

    def _share_refusal(self, uids: frozenset[int]) -> str:
        """Why a library mapped by processes of `uids` waits for a slot ("" where it does not): each user's
        libraries (those only its processes map) take at most its share of --max-libraries, every user but
        root's together at most theirs (shares.py), so that one user's copies of libcudart leave slots to the
        others. A library mapped by several users is charged to none of them alone; one a root process maps
        waits only for --max-libraries."""
        if 0 in uids:
            return ""  # root's processes (the workloads) are bounded by --max-libraries alone
        share = library_share(self.policy.max_libraries)
        held: dict[int, int] = {}
        users_held = 0
        for file_id in self.attached:
            holders = self._holders.get(file_id, frozenset({0}))
            if len(holders) == 1:
                (uid,) = holders
                held[uid] = held.get(uid, 0) + 1
            users_held += 0 not in holders
        if users_held >= share.users:
            self.share_refusals += 1
            return (f"the users' libraries hold their share of slots ({users_held} of {share.users}: half of "
                    f"--max-libraries {self.policy.max_libraries})")
        if any(held.get(uid, 0) < share.of(uid) for uid in uids):
            return ""
        self.share_refusals += 1
        return (f"uid {', '.join(map(str, sorted(uids)))} holds its share of library slots ({share.user}: a "
                f"quarter of --max-libraries {self.policy.max_libraries})")

    def _wait_for_room(self, target: Target, why: str) -> None:
        """Refuses a library for now: counted, said once, and found again by a later scan (one that
        no longer fits may fit once an unused library is detached)."""
        self.libraries_refused += 1
        if target.file_id not in self.over_limit:
            log.warning("not attaching to %s: %s", target.path, why)
        self.over_limit[target.file_id] = target.path
        self.waiting_why[target.path] = why
        self.attached.pop(target.file_id, None)
        self._holders.pop(target.file_id, None)
        self.discovery.targets.pop(target.file_id, None)

    def _attach_guarded(self, target: Target, pid: int) -> bool:
        """_attach_for, where a library that fails (a file that cannot be read as it claimed, bcc
        refusing) is refused, said in doctor and the log, and not tried again: the agent goes on."""
        try:
            self._attach_for(target, pid)
            return True
        except ProbeQuotaFull as error:
            self._wait_for_room(target, str(error))
            return False
        except Exception as error:
            log.exception("cannot attach to %s", target.path)
            self.attached.pop(target.file_id, None)
            self._holders.pop(target.file_id, None)
            self.refused[target.path] = f"attaching failed: {error}"
            self._session.report_component(f"attach:{target.path}", False, self.refused[target.path])
            return False

    def _attach_for(self, target: Target, pid: int) -> None:
        """Probes on `target` for one process (pid) or all (-1), once."""
        probes = self._probes
        whom = "every process" if pid == -1 else f"pid {pid}"
        if target.symbols and pid not in probes.attached_pids(target.file_id):
            attached = probes.attach(target.path, target.symbols, pid, key=target.file_id)
            self.probe_sets_attached += 1
            log.info("attached %d probes to %s for %s (mapped by pids %s)", len(attached), target.path,
                     whom, sorted(target.pids))
            if probes.refused_symbols:  # part of the library is blind: say so where health is read
                symbol, why = next(iter(probes.refused_symbols.items()))
                self._partly_blind.add(target.path)
                self._session.report_component(
                    f"attach:{target.path}", False,
                    f"{len(probes.refused_symbols)} of {len(target.symbols)} functions not probed for {whom}, "
                    f"e.g. {symbol}: {why}")
            elif target.path in self._partly_blind:  # attached whole since (another pid, or again)
                self._partly_blind.discard(target.path)
                self._session.report_component(f"attach:{target.path}", True)
        if self.policy.blocks is BlocksMode.AUTO:
            for deep_pid in sorted(self.deep.keys() & target.pids if pid == -1 else self.deep.keys() & {pid}):
                self.attach_torch(target, deep_pid)
        else:
            self.attach_torch(target, pid)

    def attach_torch(self, target: Target, pid: int) -> None:
        """PyTorch's allocator probes on `target` for one process (pid) or all (-1), once.

        A process that maps kvtrace's own PyTorch hook (target.torch_hook), not refused by its allocator, is traced
        through the hook's batches alone: PyTorch's own sites are not linked for it, and are taken out when the hook
        comes later (the same blocks both ways would be counted twice; an armed hook attaches within 0.1 s of the
        link, and blocks of that moment are not known). Linked for every process (-1: --blocks always without -p),
        PyTorch's own sites serve every process, and the hook is not linked."""
        probes = self._probes
        if (not target.torch_probes or self.policy.torch_blocks_down
                or pid in probes.torch_attached_pids(target.file_id)):
            return
        if target.torch_hook and (pid == -1 or not self._hook_usable(target, pid)):
            return
        if not target.torch_hook and pid != -1 and self._hooked(pid):
            return
        if (target.file_id, pid) in self.torch_refused:
            return  # refused before: not tried at every analysis again
        whom = "every process" if pid == -1 else f"pid {pid}"
        if target.torch_hook:
            self.hook_depth_changed(pid, target)  # its S before its first batch
        try:
            sites = probes.attach_torch(target.path, target.torch_probes, pid, key=target.file_id)
        except TorchProbesRefused as error:
            self.torch_refused.add((target.file_id, pid))
            self.refused[target.path] = str(error)
            log.warning("not tracing PyTorch's allocator in %s: %s", target.path, error)
            self._session.report_component(f"attach:{target.path}", False, str(error))
            return
        log.info("attached PyTorch's allocator probes (%d sites) in %s for %s", len(sites), target.path, whom)
        if target.torch_hook:
            for key in probes.torch_keys_of(pid):  # PyTorch's own sites, linked before the hook was loaded
                if key != target.file_id:
                    try:
                        probes.detach_torch(key, pid)
                    except OSError:  # said; the kernel drops the link when the process exits
                        log.exception("taking PyTorch's own probes out of pid %d (now hooked) failed", pid)

    def hook_depth_changed(self, pid: int, target: Target | None = None) -> None:
        """The S of kvtrace's PyTorch hook in `pid` (if it maps one, linked): 0 at FULL, else --block-sample-bytes.
        A failed write is said where health is read (the hook's batches still say what it sampled at)."""
        hooks = [target] if target else [one for one in self.attached.values()
                                         if one.torch_hook and pid in self._probes.torch_attached_pids(one.file_id)]
        for hook in hooks:
            sample_bytes = 0 if self.deep.get(pid) is Depth.FULL else self.policy.block_sample_bytes
            why = write_sample_bytes(pid, hook.path, (hook.file_id.device, hook.file_id.inode), sample_bytes)
            if why:
                log.warning("%s", why)
            # One entry for every hooked process: the last write's outcome (a process's own would outlive it).
            self._session.report_component("torch_hook", not why, why)

    def _hook_usable(self, target: Target, pid: int) -> bool:
        """Whether `pid`'s hook (in `target`) can carry its blocks: armed or attached. Loaded and never armed (its
        tracker would never go in), refused by its allocator, or unreadable: PyTorch's own sites carry them."""
        state = read_state(pid, target.path, (target.file_id.device, target.file_id.inode))
        return state in (HookState.ARMED, HookState.ATTACHED)

    def _hooked(self, pid: int) -> bool:
        """Whether `pid` maps a usable kvtrace PyTorch hook whose site can be linked."""
        return any(target.torch_hook and pid in target.pids and (file_id, pid) not in self.torch_refused
                   and self._hook_usable(target, pid) for file_id, target in self.attached.items())

    def attach_torch_of(self, pids: Collection[int]) -> None:
        """(--blocks auto) PyTorch's allocator probes of their own for `pids`, in each PyTorch library they map."""
        for target in list(self.attached.values()):
            if target.torch_probes:
                for pid in sorted(target.pids & set(pids)):
                    self.attach_torch(target, pid)

    # ---- detaching ----

    def detach_unused(self, now: float, waited_for: bool = False) -> None:
        """Takes the probes out of libraries no traced process maps: after detach_idle_seconds, or
        at once when another library is waiting for the place (`waited_for`)."""
        for file_id, target in list(self.attached.items()):
            if file_id in self._preattached and same_file(target.path, file_id):
                continue
            target.pids = {pid for pid in target.pids if psutil.pid_exists(pid)}
            if target.pids:
                self._idle_since.pop(file_id, None)
                continue
            since = self._idle_since.setdefault(file_id, now)
            if waited_for or now - since >= self.policy.detach_idle_seconds:
                self._detach(file_id)

    def _detach(self, file_id: FileId) -> None:
        target = self.attached.pop(file_id)
        self._holders.pop(file_id, None)
        self._idle_since.pop(file_id, None)
        self._preattached.discard(file_id)
        self.discovery.targets.pop(file_id, None)  # a process that maps it later attaches it again
        try:
            seconds = self._probes.detach(file_id)
        except Exception:  # a link that would not close: said, and the agent goes on
            log.exception("detaching %s failed", target.path)
            return
        self.libraries_detached += 1
        log.info("detached %s (no traced process maps it) in %.3f s", target.path, seconds)

    def detach_torch_of(self, pid: int) -> None:
        """No FULL mark, and (--blocks auto) no PyTorch link of `pid`'s own left. --blocks always keeps its
        links: one for every process, or with -p one per chosen process, for as long as it is chosen."""
        probes = self._probes
        probes.set_block_full(pid, False)
        if self.policy.blocks is not BlocksMode.AUTO:
            return
        for key in probes.torch_keys_of(pid):
            try:
                probes.detach_torch(key, pid)
            except OSError:  # a link that would not close: said, and the agent goes on (the kernel drops it at exit)
                log.exception("taking PyTorch's allocator probes out of pid %d failed", pid)

    # ---- views ----

    def deepenable_pids(self) -> set[int]:
        """The processes whose PyTorch blocks can be traced here: followed ones that map a library with
        PyTorch's allocator probes, which the kernel did not refuse for them."""
        if self.policy.torch_blocks_down:
            return set()
        follows = self._selection.follows
        return {pid for file_id, target in self.attached.items()
                if target.torch_probes and (file_id, -1) not in self.torch_refused
                for pid in target.pids if follows(pid) and (file_id, pid) not in self.torch_refused}

    def pytorch_pids(self) -> set[int]:
        """The processes that map a library with PyTorch's allocator probes, traceable or not."""
        return {pid for target in self.discovery.targets.values() if target.torch_probes for pid in target.pids}

    def attached_libraries(self) -> list[AttachedLibrary]:
        """The files with probes in, each with what is probed there (functions, and pytorch:malloc /
        pytorch:free for PyTorch's allocator) and the traced processes that map it."""
        attached = self._probes.attached()
        libraries = []
        for target in self.discovery.targets.values():
            names = list(attached.get(target.file_id, []))
            if self._probes.torch_attached_pids(target.file_id):
                names += sorted({f"{probe.provider}:{probe.name}" for probe in target.torch_probes})
            if names:
                libraries.append(AttachedLibrary(target.path, target.file_id.device, target.file_id.inode,
                                                 tuple(names), frozenset(target.pids)))
        return libraries

    def counters(self) -> dict[str, int]:
        return {"libraries_attached": len(self.attached), "libraries_refused": self.libraries_refused,
                "libraries_refused_share": self.share_refusals,
                "libraries_detached": self.libraries_detached,
                # per library, or per library and process
                "probe_sets_attached": self.probe_sets_attached}
