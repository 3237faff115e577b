"""BpfSource with a stand-in for the BPF side: a gone -p process is dropped once, a record or
ledger entry it cannot decode costs a resync, never the agent."""
import math
import os
import time

import pytest

from kvtrace.model.events import Api, Kind, Layer, Memory, ObjectKind
from kvtrace.model.ledger import TotalsKey
from kvtrace.session import Session
from kvtrace.sources.bpf import abi
from kvtrace.sources.bpf.discovery import Discovery, FileId, Target
from kvtrace.sources.bpf.kernel_ledger import KernelLedger
from kvtrace.sources.bpf.loader import LibraryUnreadable, ProbeQuotaFull, ProbeSettings
from kvtrace.sources.bpf.ring import RingReader
from kvtrace.sources.bpf.selection import Selection
from kvtrace.sources.bpf.source import BpfOptions, BpfSource
from kvtrace.sources.bpf.stack_names import StackNames
from kvtrace.sources.bpf.targets import AttachPolicy, Targets

GONE_PID = 4194999  # above the largest pid_max Linux allows: never a running process


class CountingProbes:
    """The part of BpfProbes sweep_exited uses; counts reads of the kernel ledger."""

    def __init__(self, items=()) -> None:
        self.ledger_reads = 0
        self.items = list(items)

    def ledger_items(self):
        self.ledger_reads += 1
        return list(self.items)

    def iter_ledger_items(self):
        return iter(self.ledger_items())

    def iter_ledger_chunks(self):
        """The items as the raw (keys, values) arrays the bulk readers take."""
        items = self.ledger_items()
        if items:
            yield b"".join(bytes(key) for key, _ in items), b"".join(bytes(value) for _, value in items)

    def delete_ledger_keys(self, keys) -> list[bool]:
        return [True] * len(keys)

    def read_totals(self) -> list:
        return []

    def totals_of(self, keys) -> list:
        return []

    def read_shares(self, by_pid: bool) -> list:
        return []

    def give_shares(self, entries) -> None:
        pass

    def take_totals(self, keys) -> list:
        return []

    def tracked_pids(self) -> set[int]:
        return set()

    def set_quiet_blocks(self, quiet: bool) -> None:
        self.quiet_blocks = quiet

    def forget_tracked(self, pid: int) -> bool:
        return False

    def mark_tracked(self, pid: int) -> None:
        pass

    def set_python_target(self, pid: int, target) -> None:
        pass

    def unselect_pid(self, pid: int) -> None:
        pass

    refused_symbols: dict[str, str] = {}

    def attached(self) -> dict:
        return {}

    def attached_pids(self, path: str) -> set[int]:
        return set()

    def counters(self) -> dict[str, int]:
        return dict.fromkeys(abi.COUNTERS, 0)


def test_a_chosen_process_that_is_gone_is_dropped_once_not_every_sweep():
    # GIVEN a source following -p GONE_PID, whose process is not running
    tracer = BpfSource(Session(), BpfOptions(pids={GONE_PID}))
    tracer.probes = CountingProbes()
    tracer._selected.add(GONE_PID)
    # WHEN it sweeps for exited processes ten times (once a second in the agent)
    for _ in range(10):
        tracer.sweep_exited()
    # THEN the kernel ledger was read once for it, and the pid is still followed (a new process
    # with that pid would be traced)
    assert tracer.probes.ledger_reads == 1
    assert GONE_PID in tracer._selected


class TrackedProbes(CountingProbes):
    """A kernel's tracked_pids: what the probes marked, what the sweep untracked and marked again."""

    def __init__(self, tracked) -> None:
        super().__init__()
        self.tracked = set(tracked)
        self.calls: list[tuple[str, int]] = []

    def tracked_pids(self) -> set[int]:
        self.calls.append(("read", 0))
        return set(self.tracked)

    def forget_tracked(self, pid: int) -> bool:
        self.calls.append(("forget", pid))
        if pid not in self.tracked:
            return False
        self.tracked.discard(pid)
        return True

    def mark_tracked(self, pid: int) -> None:
        self.calls.append(("mark", pid))
        self.tracked.add(pid)


def test_a_tracked_pid_taken_by_a_new_process_while_swept_is_tracked_again_and_not_dropped(monkeypatch):
    """GIVEN the kernel tracks a pid whose process ended unreported (its exit was lost to a full ring),
    WHEN a new process takes the pid just as the sweep untracks it, THEN the mark goes back (a thread of
    the new process may have seen it and remember it) and nothing is dropped: the new process's exit
    drops what both held. Where nothing takes it, it is untracked and dropped, once."""
    from kvtrace.sources.bpf import source as source_module

    for taken_meanwhile, calls, reads, tracked in ((True, [("read", 0), ("forget", GONE_PID), ("mark", GONE_PID)],
                                                    0, {GONE_PID}),
                                                   (False, [("read", 0), ("forget", GONE_PID)], 1, set())):
        answers = iter([False, taken_meanwhile])  # gone at the first look; the second as given
        monkeypatch.setattr(source_module.psutil, "pid_exists",
                            lambda pid, answers=answers, later=taken_meanwhile: next(answers, later))
        tracer = BpfSource(Session(), BpfOptions())
        probes = tracer.probes = TrackedProbes({GONE_PID})
        tracer.sweep_exited()
        assert (probes.calls, probes.ledger_reads, probes.tracked) == (calls, reads, tracked)


def test_sweeps_read_the_tracked_processes_after_losses_or_every_tracked_read_seconds(monkeypatch):
    """Reading the kernel's tracked processes scans their whole map: a sweep (every second) does it
    where an exit may have gone unreported, after events were lost, and else every
    tracked_read_seconds."""
    tracer = BpfSource(Session(), BpfOptions(tracked_read_seconds=0.2))
    probes = tracer.probes = TrackedProbes(set())
    tracer.sweep_exited()  # the first sweep reads
    tracer.sweep_exited()
    assert probes.calls == [("read", 0)]
    tracer._missed_seen += 3  # events lost (counted by _check_counters)
    tracer.sweep_exited()
    tracer.sweep_exited()
    assert probes.calls == [("read", 0)] * 2
    time.sleep(0.2)
    tracer.sweep_exited()
    assert probes.calls == [("read", 0)] * 3


def test_a_tracked_process_read_while_a_zombie_is_dropped_at_the_sweep_it_is_gone(monkeypatch):
    """GIVEN the read after a loss finds a tracked process still there (a zombie whose exit event was
    lost), THEN a later sweep drops it once it is gone, without reading the map again; one whose exit
    the probes reported since (no longer tracked) is left to its event."""
    from kvtrace.sources.bpf import source as source_module

    alive = {GONE_PID: True, GONE_PID - 1: True}
    monkeypatch.setattr(source_module.psutil, "pid_exists", lambda pid: alive.get(pid, False))
    tracer = BpfSource(Session(), BpfOptions(tracked_read_seconds=3600))
    probes = tracer.probes = TrackedProbes({GONE_PID, GONE_PID - 1})
    tracer.sweep_exited()
    assert probes.calls == [("read", 0)] and probes.ledger_reads == 0
    probes.tracked.discard(GONE_PID - 1)  # its exit was reported: the probes untracked it
    alive[GONE_PID] = alive[GONE_PID - 1] = False
    tracer.sweep_exited()
    tracer.sweep_exited()
    assert probes.calls == [("read", 0), ("forget", GONE_PID), ("forget", GONE_PID - 1)] or \
        probes.calls == [("read", 0), ("forget", GONE_PID - 1), ("forget", GONE_PID)]
    assert probes.ledger_reads == 1 and probes.tracked == set()  # GONE_PID's entries dropped, once


def test_a_chosen_process_whose_exit_the_probes_reported_is_left_to_that_event(monkeypatch):
    """A process chosen with -p, read as tracked, that the probes untracked since (they sent its exit
    event, not read yet: the agent is behind): the sweep does not make up an exit of its own (a second
    PROCESS_EXIT, without the real status, and no death dump)."""
    from kvtrace.sources.bpf import source as source_module

    alive = {GONE_PID: True}
    monkeypatch.setattr(source_module.psutil, "pid_exists", lambda pid: alive.get(pid, False))
    tracer = BpfSource(Session(), BpfOptions(pids={GONE_PID}, tracked_read_seconds=3600))
    probes = tracer.probes = TrackedProbes({GONE_PID})
    tracer._selected.add(GONE_PID)
    tracer.sweep_exited()
    probes.tracked.clear()  # the probes sent its exit and untracked it
    alive[GONE_PID] = False
    tracer.sweep_exited()
    assert probes.ledger_reads == 0 and GONE_PID not in tracer._tracked


def test_a_pass_over_the_kernels_allocations_reads_nothing_where_its_totals_count_none():
    """An empty ledger map still costs a scan of its million buckets: a pass reads it only where the
    kernel's totals (complete: never full) count an allocation or block of the wanted processes."""
    key, value = abi.RawTotalsKey(pid=7, device=0, layer=int(Layer.DRIVER), memory=int(Memory.DEVICE)), \
        abi.RawTotalsValue(size_bytes=4096, count=1)

    class TotalsProbes(CountingProbes):
        totals: list = []

        def read_totals(self) -> list:
            return self.totals

    tracer = BpfSource(Session(), BpfOptions())
    probes = tracer.probes = TotalsProbes()
    tracer._keep_ledger_in_kernel(probes)
    ledger = tracer.kernel_store
    assert list(ledger.read_kernel(())) == [] and probes.ledger_reads == 0
    probes.totals = [(key, value)]
    assert list(ledger.read_kernel([8])) == [] and probes.ledger_reads == 0  # not the wanted pid's
    list(ledger.read_kernel([7]))
    assert probes.ledger_reads == 1
    probes.totals = []
    tracer._totals_ever_full = True  # a change the totals had no room for: they may miss some
    list(ledger.read_kernel(()))
    assert probes.ledger_reads == 2
    tracer._totals_ever_full = False
    list(ledger.read_kernel(()))
    assert probes.ledger_reads == 2
    # the agent took what a process that reused an exited pid held out of the kernel's totals itself
    ledger._adjustments[TotalsKey(7, 0, Layer.DRIVER, Memory.DEVICE)] = [4096, 1]
    list(ledger.read_kernel(()))
    assert probes.ledger_reads == 3


class Seen:
    def __init__(self) -> None:
        self.events: list = []

    def publish(self, event) -> None:
        self.events.append(event)

    def publish_loss(self, lost_count: int) -> None:
        self.events.append(lost_count)

    def publish_state(self, record) -> None:
        pass


def test_an_event_that_cannot_be_decoded_is_counted_told_as_lost_and_resyncs():
    # GIVEN a full-size record of a kind this agent does not know (probes of another build)
    record = abi.EVENT_STRUCT.pack(1, 0x1000, 4096, 0, 0, 0, 4000, 4000, 0, 0, Api.cudaMalloc.value, 200,
                                   Layer.RUNTIME.value, ObjectKind.ALLOCATION.value, Memory.DEVICE.value,
                                   0, 0, b"python")
    session = Session()
    seen = Seen()
    session.add_sink(seen)
    tracer = BpfSource(session, BpfOptions())
    tracer.probes = CountingProbes()
    tracer._next_full_scan = tracer._next_sweep = math.inf
    # WHEN it arrives (one record, as the ring reader hands them over) and housekeeping runs
    tracer._on_raw_events(record, len(record), 0)
    tracer.housekeeping()
    # THEN it is counted, subscribers hear of one lost event, and the ledger is read from the kernel
    assert session.counters()["events_undecodable"] == 1
    assert [item for item in seen.events if isinstance(item, int)] == [1]
    assert tracer.probes.ledger_reads == 1 and session.ledger.pids() == set()


class LibraryProbes:
    """What the attach targets ask of BpfProbes: libraries attached and detached by key, `quota` at most."""

    refused_symbols: dict[str, str] = {}

    def __init__(self, quota: int | None = None) -> None:
        self.live: dict = {}
        self.detached: list = []
        self.quota = quota

    def attach(self, path: str, symbols, pid: int = -1, key=None) -> list[str]:
        if self.quota is not None and len(self.live) >= self.quota:
            raise ProbeQuotaFull("80 probes would pass bcc's quota of 1000 open probes")
        self.live.setdefault(key, set()).add(pid)
        return list(symbols)

    def attached_pids(self, key) -> set[int]:
        return set(self.live.get(key, ()))

    def attached(self) -> dict:
        return {key: ["cudaMalloc"] for key in self.live}

    def torch_attached_pids(self, key) -> set[int]:
        return set()

    def read_shares(self, by_pid: bool) -> list:
        return []

    def detach(self, key) -> float:
        del self.live[key]
        self.detached.append(key)
        return 0.0


class UnreadableProbes(LibraryProbes):
    def attach(self, path: str, symbols, pid: int = -1, key=None) -> list[str]:
        raise LibraryUnreadable(f"cannot read the function offsets of {path}")


def test_a_library_that_cannot_be_attached_is_refused_and_the_agent_goes_on():
    session, targets = _targets(UnreadableProbes())
    target = Target(FileId(1, 2), "/opt/lib/libcudart.so.12", ("cudaMalloc",))
    targets.attach(target)
    assert targets.refused[target.path] == "attaching failed: cannot read the function offsets of " + target.path
    assert target.file_id not in targets.attached  # not kept as attached, not tried per pid
    (status,) = [c for c in session.components() if c.name == f"attach:{target.path}"]
    assert not status.up


class HalfAttachingProbes(LibraryProbes):
    """The kernel refuses one function's probes (another tracer's probe there names a different
    semaphore: ref_ctr_offset mismatch, EINVAL) and takes the others."""

    def attach(self, path: str, symbols, pid: int = -1, key=None) -> list[str]:
        super().attach(path, symbols, pid, key)
        if pid != 4000:  # another process's probes go in whole
            self.refused_symbols = {}
            return list(symbols)
        self.refused_symbols = {"cudaMalloc": "cannot attach a uprobe_multi link: EINVAL"}
        return [symbol for symbol in symbols if symbol != "cudaMalloc"]


def test_functions_the_kernel_refused_make_the_library_unhealthy_by_name():
    # GIVEN a library whose cudaMalloc the kernel refuses to probe for pid 4000 (-p 4000: probes of its own)
    session, targets = _targets(HalfAttachingProbes(), pids={4000}, per_pid=True)
    target = Target(FileId(1, 2), "/opt/lib/libcudart.so.12", ("cudaMalloc", "cudaFree", "cudaMallocHost"))
    # WHEN it is attached
    targets.attach(target)
    # THEN the library stays attached (two of three functions are probed), and its health says which
    # function is blind, for whom and why, where `kvtrace doctor` and GetAgentInfo read it
    assert target.file_id in targets.attached
    (status,) = [c for c in session.components() if c.name == f"attach:{target.path}"]
    assert not status.up
    assert status.reason == ("1 of 3 functions not probed for pid 4000, e.g. cudaMalloc: "
                             "cannot attach a uprobe_multi link: EINVAL")
    # AND once the library goes in whole (for another process, or again), it is healthy again
    targets._attach_for(target, 4001)
    (status,) = [c for c in session.components() if c.name == f"attach:{target.path}"]
    assert status.up


def _entry(pid: int, obj: int, address: int, size_bytes: int):
    key = abi.RawLedgerKey(pid=pid, layer=Layer.DRIVER.value, object=obj, address=address)
    value = abi.RawLedgerValue(size_bytes=size_bytes, timestamp_ns=1, api=Api.cuMemAlloc_v2.value,
                               memory=Memory.DEVICE.value, device=0)
    return key, value


def test_a_ledger_entry_that_cannot_be_decoded_is_left_out_of_the_resync_alone():
    good = _entry(4000, ObjectKind.ALLOCATION.value, 0x1000, 4096)
    bad = _entry(4000, 200, 0x2000, 8192)  # no such object kind
    tracer = BpfSource(Session(), BpfOptions())
    tracer.probes = CountingProbes([bad, good])
    tracer.resync()
    assert [(e.key.address, e.size_bytes) for e in tracer.session.outstanding()] == [(0x1000, 4096)]


def _library(number: int, pid: int) -> Target:
    target = Target(FileId(1, number), f"/home/u/copy{number}/libcudart.so.12", ("cudaMalloc",))
    target.pids.add(pid)
    return target


def _targets(probes, pids=(), **policy) -> tuple[Session, Targets]:
    """Attach targets as BpfSource makes them, following every process or the chosen `pids`."""
    session = Session()
    selection = Selection(probes, BpfOptions(pids=set(pids)))
    selection.pids.update(pids)
    return session, Targets(probes, session, Discovery(), selection, StackNames(probes, session),
                            AttachPolicy(**policy))


def test_a_library_replaced_at_the_same_path_is_attached_again():
    # GIVEN libcudart attached, then replaced in place (pip install -U: a new inode at that path)
    probes = LibraryProbes()
    _, targets = _targets(probes)
    old, new = _library(7, GONE_PID), _library(7, GONE_PID)
    new.file_id = FileId(1, 8)
    targets.attach(old)
    # WHEN a process maps the new file
    targets.attach(new)
    # THEN both files have probes: attachments are per (device, inode), not per path
    assert set(probes.live) == {FileId(1, 7), FileId(1, 8)}


def test_libraries_beyond_the_limit_wait_and_unused_ones_make_room():
    # GIVEN a source with a limit of 3 libraries, all three mapped by a live process (this one)
    probes = LibraryProbes()
    session = Session()
    tracer = BpfSource(session, BpfOptions(max_libraries=3))
    tracer.probes = probes
    targets = tracer.targets
    me = os.getpid()
    for number in range(3):
        targets.attach(_library(number, me))
    # WHEN a fourth arrives
    waiting = _library(3, me)
    targets.discovery.targets[waiting.file_id] = waiting
    targets.attach(waiting)
    # THEN it is refused for now: counted, named by the libraries component, found again later
    assert FileId(1, 3) not in probes.live and targets.libraries_refused == 1
    assert waiting.file_id not in targets.discovery.targets  # the next scan finds it again
    tracer._report(dict.fromkeys(abi.COUNTERS, 0))
    (status,) = [c for c in session.components() if c.name == "libraries"]
    assert not status.up and "copy3" in status.reason
    assert session.counters()["libraries_refused"] == 1 and session.counters()["libraries_attached"] == 3
    # WHEN the process of library 0 exits, and the fourth is found again
    targets.attached[FileId(1, 0)].pids = {GONE_PID}
    targets.over_limit.clear()
    targets.attach(waiting)
    # THEN the unused library made room at once, and the fourth is attached
    assert probes.detached == [FileId(1, 0)] and FileId(1, 3) in probes.live
    tracer._report(dict.fromkeys(abi.COUNTERS, 0))
    (status,) = [c for c in session.components() if c.name == "libraries"]
    assert status.up


def test_a_library_nobody_maps_loses_its_probes_after_the_idle_time():
    probes = LibraryProbes()
    _, targets = _targets(probes, detach_idle_seconds=60)
    targets.attach(_library(1, GONE_PID))
    targets.detach_unused(now=1000.0)
    assert probes.detached == []  # idle from now on
    targets.detach_unused(now=1059.0)
    assert probes.detached == []
    targets.detach_unused(now=1060.0)
    assert probes.detached == [FileId(1, 1)] and targets.libraries_detached == 1
    assert FileId(1, 1) not in targets.discovery.targets  # mapped again later: attached again


def test_bccs_probe_quota_makes_a_library_wait_not_fail_for_good():
    # GIVEN perf-event uprobes whose quota takes one library
    probes = LibraryProbes(quota=1)
    _, targets = _targets(probes)
    me = os.getpid()
    targets.attach(_library(1, me))
    second = _library(2, me)
    targets.attach(second)
    # THEN the second waits (not refused for good, as a broken file is)
    assert second.path not in targets.refused and targets.libraries_refused == 1
    assert FileId(1, 2) in targets.over_limit


def test_task_storage_is_chosen_from_kernel_6_2_with_btf(tmp_path):
    from kvtrace.sources.bpf.loader import ProbeSettings, task_storage_supported

    btf = tmp_path / "vmlinux"
    btf.write_bytes(b"")
    assert [task_storage_supported(release, str(btf)) for release in
            ("6.18.44-fc-v973-gpu", "6.2.0", "6.1.0-57-amd64", "5.15.0-91-generic", "weird")] == \
        [True, True, False, False, False]
    assert task_storage_supported("6.18.44", str(tmp_path / "no-btf")) is False
    assert "-DKVT_TASK_STORAGE=0" in ProbeSettings(task_storage=False).cflags()
    assert "-DKVT_TASK_STORAGE=1" in ProbeSettings(task_storage=True).cflags()


def test_exit_of_the_last_thread_is_chosen_where_the_tracepoint_says_group_dead(tmp_path):
    from kvtrace.sources.bpf.loader import ProbeSettings, exit_reports_group_dead

    fields = ("\tfield:char comm[16];\toffset:8;\tsize:16;\tsigned:0;\n"
              "\tfield:pid_t pid;\toffset:24;\tsize:4;\tsigned:1;\n")
    new, old = tmp_path / "new", tmp_path / "old"
    new.write_text(fields + "\tfield:bool group_dead;\toffset:32;\tsize:1;\tsigned:0;\n")  # 6.18's
    old.write_text(fields)
    missing = tmp_path / "not-mounted"
    assert exit_reports_group_dead([missing, new]) is True  # the first format that reads
    assert exit_reports_group_dead([old, new]) is False
    assert exit_reports_group_dead([missing]) is False
    assert "-DKVT_EXIT_GROUP_DEAD=0" in ProbeSettings(exit_group_dead=False).cflags()
    assert "-DKVT_EXIT_GROUP_DEAD=1" in ProbeSettings(exit_group_dead=True).cflags()


def test_probes_that_refuse_task_storage_load_with_lru_hashes(monkeypatch, caplog):
    """Chosen by the kernel's version, task storage that the kernel still refuses (a backport, a
    locked-down build) is no reason to trace nothing: the probes compile again without it."""
    import sys
    import types

    import pytest

    from kvtrace.sources.bpf import loader

    compiled = []

    class _Table:  # the config map
        def __setitem__(self, key, value) -> None:
            pass

    class FakeBpf:
        def __init__(self, text, cflags):
            compiled.append(cflags)
            if "-DKVT_TASK_STORAGE=1" in cflags:
                raise Exception("Failed to load BPF program: invalid argument")  # as bcc raises

        def __getitem__(self, name):
            return _Table()

    bcc = types.ModuleType("bcc")
    bcc.BPF = FakeBpf  # type: ignore[attr-defined]
    bcc.libbcc = types.SimpleNamespace(lib=types.SimpleNamespace(  # type: ignore[attr-defined]
        bpf_attach_uprobe=types.SimpleNamespace(argtypes=[None] * 7)))
    monkeypatch.setitem(sys.modules, "bcc", bcc)
    monkeypatch.setattr(loader, "task_storage_supported", lambda: True)
    probes = loader.BpfProbes(loader.ProbeSettings(uprobe_links=True))
    assert [("-DKVT_TASK_STORAGE=1" in flags, "-DKVT_TASK_STORAGE=0" in flags) for flags in compiled] == \
        [(True, False), (False, True)]
    assert probes.settings.task_storage is False
    assert "per-thread state in LRU hashes" in caplog.text
    # chosen by the operator (ProbeSettings.task_storage=True), a refusal is an error
    compiled.clear()
    with pytest.raises(Exception, match="Failed to load"):
        loader.BpfProbes(loader.ProbeSettings(uprobe_links=True, task_storage=True))


def test_no_task_storage_flag_chooses_lru_hashes():
    import argparse

    from kvtrace.cli.agent import AgentCommand

    def settings(*flags):
        parser = argparse.ArgumentParser()
        AgentCommand().prepare_parser(parser)
        return AgentCommand._options(parser.parse_args(["--metrics-listen", "off", "--no-api", *flags])).bpf.settings

    assert settings().task_storage is None  # chosen by the kernel
    assert settings("--no-task-storage").task_storage is False
    assert "-DKVT_TASK_STORAGE=0" in settings("--no-task-storage").cflags()


class KernelTotalsProbes(CountingProbes):
    """The kernel's side where it keeps the totals: ledger entries, the totals the probes changed, and deletes
    a probe may have won (its free took the entry, and its own bytes out of the totals, first)."""

    def __init__(self, items, totals, freed_meanwhile=frozenset()) -> None:
        super().__init__(items)
        self.totals = dict(totals)  # (pid, device, layer, memory) -> (bytes, count)
        self.freed_meanwhile = freed_meanwhile  # addresses a probe freed between the agent's read and delete
        self.closed = False

    def delete_ledger_keys(self, keys) -> list[bool]:
        return [key.address not in self.freed_meanwhile for key in keys]

    def read_totals(self) -> list:
        return [(abi.RawTotalsKey(pid=pid, device=device, layer=layer, memory=memory),
                 abi.RawTotalsValue(size_bytes=size, count=count))
                for (pid, device, layer, memory), (size, count) in self.totals.items()]

    def totals_of(self, keys) -> list:
        wanted = {(key.pid, key.device, key.layer, key.memory) for key in keys}
        return [(key, value) for key, value in self.read_totals()
                if (key.pid, key.device, key.layer, key.memory) in wanted]

    def take_totals(self, keys) -> list:
        taken = self.totals_of(keys)
        for key, _ in taken:
            del self.totals[key.pid, key.device, key.layer, key.memory]
        return taken

    def close(self) -> float:
        self.closed = True
        return 0.0


def _driver_entry(pid, address, timestamp_ns, size=1 << 20, device=0):
    return (abi.RawLedgerKey(pid=pid, layer=Layer.DRIVER.value, object=ObjectKind.ALLOCATION.value, address=address),
            abi.RawLedgerValue(size_bytes=size, timestamp_ns=timestamp_ns, device=device, api=Api.cuMemAlloc_v2.value,
                               memory=Memory.DEVICE.value))


def _counting_source(probes, alive=frozenset({7, 8})) -> BpfSource:
    """A source whose Session keeps the ledger in the kernel, as start() sets it up."""
    session = Session()
    tracer = BpfSource(session, BpfOptions())
    tracer.probes = probes
    tracer._keep_ledger_in_kernel(probes)
    tracer.kernel_store._alive = lambda pid: pid in alive
    return tracer


def test_an_exit_takes_out_what_the_agent_deleted_and_the_pids_totals_and_keeps_a_reused_pids():
    MiB = 1 << 20
    driver = (Layer.DRIVER.value, Memory.DEVICE.value)
    # GIVEN pid 7's three allocations made before its exit (at 100), one freed by a probe while the agent
    # deleted (the kernel's totals no longer hold it), and one made after the exit by a process that reused
    # the pid (at 200)
    made = ((0xA, 50), (0xB, 60), (0xC, 70), (0xD, 200))
    entries = [_driver_entry(7, address, timestamp) for address, timestamp in made]
    probes = KernelTotalsProbes(entries, {(7, 0, *driver): (3 * MiB, 3), (8, 0, *driver): (MiB, 1)},
                                freed_meanwhile={0xC})
    tracer = _counting_source(probes)
    ledger = tracer.session.ledger
    assert ledger.physical_device_bytes(7) == 3 * MiB
    # WHEN the agent drops what the exit freed (its entries deleted by the scan the loop's next turn makes)
    tracer._drop_in_kernel(7, tracer.clock.wall_ns(100))
    tracer.kernel_store.collect(1.0)
    # THEN only the reused pid's allocation is left, the kernel has no totals of pid 7, and the agent keeps
    # the one it took with them; pid 8 is untouched
    assert ledger.physical_device_bytes(7) == MiB and tracer.kernel_store.counted_entries({7}) == 1
    assert all(key[0] != 7 for key in probes.totals) and ledger.physical_device_bytes(8) == MiB
    # AND when the reused pid exits too, nothing of pid 7 is left anywhere
    probes.items = [_driver_entry(7, 0xD, 200)]
    tracer._drop_in_kernel(7, tracer.clock.wall_ns(300))
    tracer.kernel_store.collect(1.0)
    assert ledger.physical_device_bytes(7) == 0 and 7 not in ledger.pids() and ledger._adjustments == {}


def test_a_context_destroy_takes_out_its_device_only_and_leaves_the_kernels_totals():
    MiB = 1 << 20
    driver = (Layer.DRIVER.value, Memory.DEVICE.value)
    probes = KernelTotalsProbes([_driver_entry(7, 0xA, 50, device=0), _driver_entry(7, 0xB, 60, device=1)],
                                {(7, 0, *driver): (MiB, 1), (7, 1, *driver): (MiB, 1)})
    tracer = _counting_source(probes)
    tracer._drop_in_kernel(7, tracer.clock.wall_ns(100), device=1)
    ledger = tracer.session.ledger
    assert ledger.physical_device_bytes(7, device=1) == 0 and ledger.physical_device_bytes(7, device=0) == MiB
    assert len(probes.totals) == 2 and ledger.implicit_frees_total[7] == 1  # the process lives on


def test_stopping_the_source_stops_the_sessions_counting_before_the_probes_close():
    seen_counting_at_close = []
    probes = KernelTotalsProbes([], {(7, 0, Layer.DRIVER.value, Memory.DEVICE.value): (4096, 1)})
    tracer = _counting_source(probes)
    original_close = probes.close

    def close() -> float:
        seen_counting_at_close.append(isinstance(tracer.session.ledger, KernelLedger))
        return original_close()

    probes.close = close
    assert tracer.session.ledger.physical_device_bytes(7) == 4096
    tracer.stop()
    assert seen_counting_at_close == [False] and probes.closed
    assert tracer.session.ledger.totals() == {}  # nothing read from probes that are gone


def test_task_offsets_read_btf_once_and_say_why_each_is_missing(tmp_path, monkeypatch):
    from kvtrace.sources.bpf import btf as btf_module

    reads = []
    real = btf_module.Btf.from_file

    def counted(path=btf_module.VMLINUX_BTF):
        reads.append(path)
        return real(path)

    monkeypatch.setattr(btf_module.Btf, "from_file", staticmethod(counted))
    missing = btf_module.task_offsets(["comm", "exit_code"], tmp_path / "no-btf")
    assert set(missing) == {"comm", "exit_code"}
    assert all(isinstance(error, btf_module.BtfError) and "cannot read" in str(error) for error in missing.values())
    if not btf_module.VMLINUX_BTF.exists():
        pytest.skip(f"{btf_module.VMLINUX_BTF} is not here: the kernel's own offsets cannot be read")
    found = btf_module.task_offsets([btf_module.TASK_COMM, btf_module.TASK_EXIT_CODE, "no_such_member"])
    assert isinstance(found[btf_module.TASK_COMM], int) and isinstance(found[btf_module.TASK_EXIT_CODE], int)
    assert found[btf_module.TASK_COMM] != found[btf_module.TASK_EXIT_CODE]
    assert isinstance(found["no_such_member"], btf_module.BtfError)
    assert len(reads) == 2  # one read per call, whatever the members


class PollingProbes(CountingProbes):
    """Rings that hold one given batch of records per poll; counts the counter reads."""

    def __init__(self, source: BpfSource, batches: list[bytes]) -> None:
        super().__init__()
        self.source, self.batches, self.counter_reads = source, list(batches), 0

    def wait(self, timeout_ms: int) -> None:
        pass

    def poll(self, timeout_ms: int) -> None:
        batch = self.batches.pop(0) if self.batches else b""
        if batch:
            self.source._on_raw_events(batch, RingReader.STRIDE, RingReader.HEADER_BYTES)

    def counters(self) -> dict[str, int]:
        self.counter_reads += 1
        return super().counters()


def test_a_busy_loop_spaces_its_turns_reads_counters_each_turn_and_reports_every_tenth_of_a_second():
    from test_fixed_columns import RECORDS

    # GIVEN a source whose rings hold a few records at two turns, nothing at the third, some at the fourth
    source = BpfSource(Session(), BpfOptions())
    source._next_full_scan = source._next_sweep = math.inf
    source.probes = probes = PollingProbes(source, [b"".join(RECORDS)] * 2 + [b"", b"".join(RECORDS)])
    reports = []
    source._report = lambda counters=None: reports.append(counters)
    # WHEN it turns twice at once
    source.run_once(0)
    started = time.monotonic()
    source.run_once(0)
    # THEN the second turn started 10 ms after the first (the stream's next batch gathered meanwhile)
    assert time.monotonic() - started >= 0.008
    # AND each turn read the counters (a loss marker lands where the loss is), but reported once
    assert probes.counter_reads == 2 and len(reports) == 1
    # AND a turn that took nothing leaves the next to start at once; it reads the counters again (the
    # second turn's are not reported yet); a busy one 0.1 s later reports again
    source.run_once(0)
    assert source._next_turn_monotonic == 0.0
    assert probes.counter_reads == 3 and len(reports) == 1
    time.sleep(0.1)
    source.run_once(0)
    assert len(reports) == 2 and probes.counter_reads == 4
    # AND once reported, idle turns read nothing until the idle report (a second later)
    source.run_once(0)
    assert len(reports) == 2 and probes.counter_reads == 4


def test_the_last_counts_of_a_burst_are_reported_within_a_tenth_of_a_second_of_its_end():
    from test_fixed_columns import RECORDS

    # GIVEN a source that reported at its first busy turn and then took more events at once
    source = BpfSource(Session(), BpfOptions())
    source._next_full_scan = source._next_sweep = math.inf
    source.probes = PollingProbes(source, [b"".join(RECORDS)] * 2)
    reports = []
    source._report = lambda counters=None: reports.append(counters)
    source.run_once(0)
    source.run_once(0)
    assert len(reports) == 1  # the second turn's counts wait for the busy pace
    # WHEN nothing more comes, THEN a turn 0.1 s later reports them (not the idle report, a second later)
    time.sleep(0.1)
    source.run_once(0)
    assert len(reports) == 2


def test_the_first_idle_turn_after_a_burst_gives_the_freed_heap_back_once(monkeypatch):
    from kvtrace.sources.bpf import source as source_module
    from test_fixed_columns import RECORDS

    trims = []
    monkeypatch.setattr(source_module, "return_freed_heap", lambda: trims.append(1))
    monkeypatch.setattr(source_module, "TRIM_AFTER_RECORDS", 2 * len(RECORDS))
    # GIVEN turns that take a burst of records, then turns that take nothing
    source = BpfSource(Session(), BpfOptions())
    source._next_full_scan = source._next_sweep = math.inf
    source.probes = PollingProbes(source, [b"".join(RECORDS)] * 2 + [b"", b"", b"".join(RECORDS), b""])
    source._report = lambda counters=None: None
    source.run_once(0)
    assert trims == []  # busy, and not yet enough
    source.run_once(0)
    assert trims == []  # enough, but still busy
    source.run_once(0)
    source.run_once(0)
    assert trims == [1]  # the first idle turn after the burst, once
    source.run_once(0)
    source.run_once(0)
    assert trims == [1]  # a small batch since: nothing to give back


def test_a_turn_that_took_half_the_ring_is_behind_and_the_next_starts_at_once():
    from test_fixed_columns import RECORDS

    small = BpfSource(Session(), BpfOptions(settings=ProbeSettings(ringbuf_pages=1)))  # 42 records fit
    assert small._behind_records == 4096 // RingReader.STRIDE // 2
    small._next_full_scan = small._next_sweep = math.inf
    small.probes = PollingProbes(small, [b"".join(RECORDS * 4)])  # 24 records: behind
    small.run_once(0)
    assert small._next_turn_monotonic == 0.0


def test_block_events_go_quiet_only_while_no_sink_reads_every_one():
    """The probes send only the blocks whose stacks they walk while every sink is content with that (the flight
    recorder's window); a subscriber or a recording (any sink that does not say so) wants every one; a kept
    ledger (--no-ledger-in-kernel) is made of the events and never goes quiet."""

    class Sampled:
        wants_every_block = False

        def publish(self, event) -> None:
            pass

    class Everything(Sampled):
        wants_every_block = True

    for ledger_in_kernel, expected in ((True, [True, False, True]), (False, [False, False, False])):
        session = Session()
        source = BpfSource(session, BpfOptions(ledger_in_kernel=ledger_in_kernel))
        source._next_full_scan = source._next_sweep = math.inf
        source.probes = probes = PollingProbes(source, [])
        probes.quiet_blocks = False
        session.set_block_readers_hook(source._on_block_readers)  # as start() does
        seen = []
        session.add_sink(Sampled())
        seen.append(probes.quiet_blocks)
        everything = Everything()
        # A sink that joins with a checkpoint has every block told before its copy is made.
        told_at_copy = []
        real_copy = session.checkpoint_locked
        session.checkpoint_locked = (lambda told=told_at_copy, probes=probes, copy=real_copy:
                                     told.append(probes.quiet_blocks) or copy())
        session.subscribe(everything)
        seen.append(probes.quiet_blocks)
        assert told_at_copy == [False]
        session.remove_sink(everything)
        seen.append(probes.quiet_blocks)
        assert seen == expected, ledger_in_kernel


def test_a_subscriber_wants_every_block_only_if_its_filter_takes_blocks():
    from kvtrace.servers.hub import EventFilter, EventHub

    hub = EventHub()
    assert not hub.wants_every_block
    driver_only = hub.subscribe(EventFilter(layers=frozenset({Layer.DRIVER})))
    exits_only = hub.subscribe(EventFilter(kinds=frozenset({Kind.PROCESS_EXIT})))
    assert not hub.wants_every_block
    torch = hub.subscribe(EventFilter(layers=frozenset({Layer.TORCH}), kinds=frozenset({Kind.FREE})))
    assert hub.wants_every_block
    for subscription in (driver_only, exits_only, torch):
        hub.unsubscribe(subscription)
    hub.subscribe(EventFilter())
    assert hub.wants_every_block


def test_the_probes_hear_of_a_block_reading_stream_as_it_comes_and_goes():
    """Wired as the agent wires it: no turn of the source's loop is needed for the probes to learn it."""
    from kvtrace.servers.hub import EventFilter, EventHub

    session = Session()
    hub = EventHub()
    session.add_sink(hub)
    hub.on_readers_changed = session.refresh_block_readers
    told: list[bool] = []
    session.set_block_readers_hook(told.append)
    driver_only = hub.subscribe(EventFilter(layers=frozenset({Layer.DRIVER})))
    blocks = hub.subscribe(EventFilter(layers=frozenset({Layer.TORCH})))
    hub.unsubscribe(blocks)
    hub.unsubscribe(driver_only)
    assert told == [False, False, True, False, False]  # at the hook, then at each subscribe and unsubscribe


class DepthProbes(CountingProbes):
    """What set_block_depths asks of the probes: PyTorch links per (library, pid), FULL marks, the ledger."""

    def __init__(self, items=(), refuse=()) -> None:
        super().__init__(items)
        self.links: dict[object, set[int]] = {}
        self.full: set[int] = set()
        self.refuse = set(refuse)
        self.deleted_passes = 0

    def attach_torch(self, path, probes, pid=-1, key=None):
        from kvtrace.sources.bpf.loader import TorchProbesRefused

        if (key, pid) in self.refuse:
            raise TorchProbesRefused("refused for the test")
        self.links.setdefault(key, set()).add(pid)
        return list(probes)

    def torch_attached_pids(self, key):
        return set(self.links.get(key, ()))

    def torch_keys_of(self, pid):
        return [key for key, pids in self.links.items() if pid in pids]

    def detach_torch(self, key, pid):
        self.links[key].discard(pid)

    def set_block_full(self, pid, full):
        (self.full.add if full else self.full.discard)(pid)

    def poll(self, timeout_ms):
        pass

    def delete_ledger_keys(self, keys):
        self.deleted_passes += 1
        return super().delete_ledger_keys(keys)


def _depth_source(probes, pids=()):
    from kvtrace.model.depth import BlocksMode

    source = BpfSource(Session(), BpfOptions(blocks=BlocksMode.AUTO, pids=set(pids)))
    source.probes = probes
    source.selection.pids.update(pids)  # as start() selects them
    import types

    malloc_site = types.SimpleNamespace(provider="pytorch", name="malloc")  # what Target reads of a UsdtProbe
    torch_library = Target(FileId(1, 10), "/lib/libc10_cuda.so", (), {7, 8, 9}, torch_probes=(malloc_site,))
    cuda_library = Target(FileId(1, 11), "/lib/libcudart.so", ("cudaMalloc",), {7, 8, 9, 12})
    source.targets.attached = {torch_library.file_id: torch_library, cuda_library.file_id: cuda_library}
    source.discovery.targets = dict(source.targets.attached)
    return source, torch_library.file_id


def test_who_can_be_raised_and_what_a_refusal_leaves():
    """Only followed processes that map PyTorch's allocator can be raised; a (library, pid) the kernel refused is
    not tried again (nor counted as raisable) until its process goes; one it refused for every process (--blocks
    always' shared link) raises nobody."""
    from kvtrace.model.depth import Depth

    probes = DepthProbes()
    source, library = _depth_source(probes, pids=(7, 8, 12))
    assert source.deepenable_pids() == {7, 8} and source.pytorch_pids() == {7, 8, 9}
    probes.refuse = {(library, 8)}
    source.set_block_depths({7: Depth.BLOCKS, 8: Depth.FULL, 9: Depth.BLOCKS, 12: Depth.BLOCKS})
    assert probes.links[library] == {7} and probes.full == {8}
    assert source.deepenable_pids() == {7}
    probes.refuse = set()
    source.set_block_depths({7: Depth.BLOCKS, 8: Depth.FULL})
    assert probes.links[library] == {7}  # not tried again while 8 lives
    source._forget_process(8)
    source.targets.attached[library].pids.add(8)  # a new process 8 maps it (a rescan found it)
    source.set_block_depths({7: Depth.BLOCKS, 8: Depth.FULL})
    assert probes.links[library] == {7, 8}
    source.targets.torch_refused.add((library, -1))
    assert source.deepenable_pids() == set()


def test_a_drop_that_failed_is_made_again():
    """Lowering marks the drop before anything can fail; a pass that failed is made at the next call."""
    from kvtrace.model.depth import Depth

    probes = DepthProbes()
    source, library = _depth_source(probes)
    source.set_block_depths({7: Depth.BLOCKS})
    failing = [True]
    real = source._drop_blocks_in_kernel

    def drop(pids):
        if failing.pop():
            raise OSError("the ledger could not be read")
        real(pids)

    source._drop_blocks_in_kernel = drop
    failing.append(False)
    failing.append(True)
    with pytest.raises(OSError):
        source.set_block_depths({})
    assert probes.links[library] == set() and source._undropped == {7}
    source.set_block_depths({})
    assert source._undropped == set()
