"""BpfSource with a stand-in for the BPF side: a gone -p process is dropped once, a record or
ledger entry it cannot decode costs a resync, never the agent."""
import math

from kvtrace.model.events import Api, Layer, Memory, ObjectKind
from kvtrace.session import Session
from kvtrace.sources.bpf import abi
from kvtrace.sources.bpf.loader import LibraryUnreadable
from kvtrace.sources.bpf.source import BpfOptions, BpfSource
from kvtrace.sources.discovery import FileId, Target

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

    def delete_ledger_keys(self, keys) -> None:
        pass

    def tracked_pids(self) -> set[int]:
        return set()

    def forget_tracked(self, pid: int) -> None:
        pass

    def set_python_target(self, pid: int, target) -> None:
        pass

    def unselect_pid(self, pid: int) -> None:
        pass

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


class Seen:
    def __init__(self) -> None:
        self.events: list = []

    def publish(self, event) -> None:
        self.events.append(event)

    def publish_loss(self, lost_count: int) -> None:
        self.events.append(lost_count)


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
    # WHEN it arrives and housekeeping runs
    tracer._on_raw_event(record)
    tracer.housekeeping()
    # THEN it is counted, subscribers hear of one lost event, and the ledger is read from the kernel
    assert session.counters()["events_undecodable"] == 1
    assert [item for item in seen.events if isinstance(item, int)] == [1]
    assert tracer.probes.ledger_reads == 1 and session.ledger.pids() == set()


class UnreadableProbes(CountingProbes):
    def attach(self, path: str, symbols, pid: int) -> list[str]:
        raise LibraryUnreadable(f"cannot read the function offsets of {path}")


def test_a_library_that_cannot_be_attached_is_refused_and_the_agent_goes_on():
    session = Session()
    tracer = BpfSource(session, BpfOptions())
    tracer.probes = UnreadableProbes()
    target = Target(FileId(1, 2), "/opt/lib/libcudart.so.12", ("cudaMalloc",))
    tracer._attach(target)
    assert tracer.refused[target.path] == "attaching failed: cannot read the function offsets of " + target.path
    assert target.path not in tracer._attached_targets  # not kept as attached, not tried per pid
    (status,) = [c for c in session.components() if c.name == f"attach:{target.path}"]
    assert not status.up


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
