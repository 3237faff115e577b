"""The Session: what it keeps of the records sources hand it."""
from kvtrace.session import Session


def test_a_resent_layout_or_sleep_report_is_no_new_record():
    """The vLLM plugin sends its KV layout and sleep state again every 30 s (for an agent that restarted):
    the Session keeps the first, with its time, so that analysis sees no new sleep and no memory move."""
    from kvtrace.model.vllm import KvCacheLayout, KvTensor, SleepPool, SleepReport

    session = Session()
    layout = KvCacheLayout(7, 1_000, 0, (KvTensor(1 << 32, 1 << 20),), 11, 65536, 16)
    asleep = SleepReport(7, 2_000, 1, (SleepPool("weights", 1 << 20, 0),))
    session.ingest_many([layout, asleep])
    session.ingest_many([KvCacheLayout(7, 31_000, 0, (KvTensor(1 << 32, 1 << 20),), 11, 65536, 16),
                         SleepReport(7, 32_000, 1, (SleepPool("weights", 1 << 20, 0),))])
    view = session.vllm_view()
    assert view.layouts[7].timestamp_ns == 1_000 and view.sleeps[7] == (asleep,)
    awake = SleepReport(7, 40_000, 0, (SleepPool("weights", 1 << 20, 1 << 20),))
    session.ingest(awake)
    assert session.vllm_view().sleeps[7] == (asleep, awake)


class _EachSink:
    """A sink that publishes one event at a time and reads the ledger as it does (a recording's
    checkpoint would): it must see the ledger exactly after each event."""

    def __init__(self, session: Session) -> None:
        self.session, self.seen = session, []

    def publish(self, event) -> None:
        self.seen.append((event, self.session.ledger.physical_device_bytes(event.pid)))

    def publish_loss(self, lost_count: int) -> None:
        self.seen.append(("lost", lost_count))

    def publish_state(self, record) -> None:
        pass


class _RunSink(_EachSink):
    def publish_many(self, events) -> None:
        self.seen.append(("run", list(events)))


def test_runs_of_allocation_events_reach_batch_sinks_at_once_and_the_others_one_by_one_in_order():
    from fake_agent import TITLES, MiB, _process, event
    from kvtrace.model.events import EventsLost, Kind, Layer
    from kvtrace.model.processes import ProcessTable

    # GIVEN a Session with a sink that takes runs and one that takes events one at a time
    session = Session(ProcessTable(_process))
    each, runs = _EachSink(session), _RunSink(session)
    session.add_sink(each)
    session.add_sink(runs)
    # WHEN two allocations, a failure, a loss and a free arrive in one batch
    first, second = event(address=0x1000), event(address=0x2000, pid=300, layer=Layer.DRIVER)
    failed = event(kind=Kind.ALLOC_FAILED, address=0, error_code=2)
    free = event(kind=Kind.FREE, address=0x1000)
    session.ingest_many([first, second, failed, EventsLost(3, 1), free])
    # THEN the one-by-one sink saw each event with the ledger just after it, in order
    assert [(item[0].kind, item[1]) if item[0] != "lost" else item for item in each.seen] == [
        (Kind.ALLOC, MiB), (Kind.ALLOC, MiB), (Kind.ALLOC_FAILED, MiB), ("lost", 3), (Kind.FREE, 0)]
    # AND the run sink got the two allocations as one run, the failure alone (a failure may dump the
    # flight recorder with a copy of the ledger), the loss where it was, then the free
    assert [(item[0], [e.kind for e in item[1]]) if item[0] == "run" else
            (item[0].kind if item[0] != "lost" else item) for item in runs.seen] == [
        ("run", [Kind.ALLOC, Kind.ALLOC]), Kind.ALLOC_FAILED, ("lost", 3), ("run", [Kind.FREE])]
    # AND every event was attributed to its process, the unknown one by its comm
    assert (first.title, second.title, second.container) == (TITLES[200], TITLES[300], "c0ffee")
    unknown = event(pid=999, address=0x3000)
    session.ingest_many([unknown])
    assert unknown.title == unknown.comm and session.events_total == 5


def test_with_cupti_witnessing_only_the_compared_processes_leave_the_run():
    """The daemon always has CUPTI witness the uprobes; the processes it does not compare (the bulk of a
    busy host) must still reach the sinks as runs, a compared one's events one by one, witnessed, and
    CUPTI's own events never reach the ledger (the uprobes' event of the same call does)."""
    from fake_agent import _process, event
    from kvtrace.model.crosscheck import TracerStatus
    from kvtrace.model.events import Kind, Source
    from kvtrace.model.processes import ProcessTable

    # GIVEN a Session whose CUPTI witness compares pid 300 only, since before the events
    session = Session(ProcessTable(_process))
    session.wall_clock_ns = lambda: 1_700_000_000_000_000_000 - 10**9
    session.set_cupti_witness(True)
    session.report_tracer(TracerStatus(300, "tracing"))
    runs = _RunSink(session)
    session.add_sink(runs)
    # WHEN two allocations of pid 200 arrive, then one of pid 300, then CUPTI's of pid 200, then a free
    session.ingest_many([event(address=0x1000), event(address=0x2000), event(address=0x3000, pid=300),
                         event(address=0x4000, source=Source.CUPTI), event(kind=Kind.FREE, address=0x1000)])
    # THEN pid 200's uprobe events came as runs around pid 300's single one; CUPTI's reached no sink
    assert [(item[0], [e.address for e in item[1]]) if item[0] == "run" else item[0].address
            for item in runs.seen] == [("run", [0x1000, 0x2000]), 0x3000, ("run", [0x1000])]
    # AND the uprobe events entered the ledger, CUPTI's was witnessed only
    assert session.events_total == 4 and session.counters()["cupti_events_witnessed"] == 1
    assert {entry.key.pid: entry.key.address for entry in session.outstanding()} == {200: 0x2000, 300: 0x3000}
    # AND pid 300's event went to the cross-check, waiting for CUPTI's side
    [check] = session.cross_checks(300)
    assert check.compared and check.pending == 1


def test_a_checkpoint_taken_inside_a_run_is_not_shared_as_the_runs_end():
    """A one-at-a-time sink (a recording) may copy the ledger at any event of a run; the Session
    shares a copy by stream position, so a later subscriber must not get that copy as its own."""
    from fake_agent import event

    session = Session()

    class CopiesAtFirst(_EachSink):
        copy = None

        def publish(self, published) -> None:
            if self.copy is None:
                self.copy = self.session.checkpoint_locked()

    copier = CopiesAtFirst(session)
    session.add_sink(copier)
    session.ingest_many([event(address=0x1000), event(address=0x2000), event(address=0x3000)])
    later = session.subscribe(_EachSink(session))
    assert len(copier.copy.entries) == 1
    assert sorted(entry.key.address for entry in later.entries) == [0x1000, 0x2000, 0x3000]
