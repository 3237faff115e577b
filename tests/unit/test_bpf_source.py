"""BpfSource with a stand-in for the BPF side: a gone -p process is dropped once, a record or
ledger entry it cannot decode costs a resync, never the agent."""
from kvtrace.model.events import Api, Layer, Memory, ObjectKind
from kvtrace.session import Session
from kvtrace.sources.bpf import abi
from kvtrace.sources.bpf.source import BpfOptions, BpfSource

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


def test_an_event_that_cannot_be_decoded_is_counted_and_makes_the_ledger_resync():
    tracer = BpfSource(Session(), BpfOptions())
    tracer.probes = CountingProbes()
    tracer._on_raw_event(b"\x00" * 8)  # far shorter than struct kvt_event
    assert tracer._undecodable == 1 and tracer._resync_due
    tracer._report({"events_lost": 0})
    assert tracer.session.counters()["events_undecodable"] == 1


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
