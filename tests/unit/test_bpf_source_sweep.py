"""BpfSource.sweep_exited with a stand-in for the BPF side: a gone -p process is dropped once."""
from kvtrace.session import Session
from kvtrace.sources.bpf.source import BpfOptions, BpfSource

GONE_PID = 4194999  # above the largest pid_max Linux allows: never a running process


class CountingProbes:
    """The part of BpfProbes sweep_exited uses; counts reads of the kernel ledger."""

    def __init__(self) -> None:
        self.ledger_reads = 0

    def ledger_items(self):
        self.ledger_reads += 1
        return []

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
