"""Two witnesses of one process: the Session matches CUPTI's events (`kvtrace run`) against the uprobes'
one for one where both trace it, and keeps CUPTI's in the ledger where it is the only witness."""
from kvtrace.cli.doctor import describe_cross_check
from kvtrace.model.crosscheck import MATCH_GRACE_NS, Side, TracerStatus
from kvtrace.model.events import Api, Event, Kind, Layer, Memory, ObjectKind, Source
from kvtrace.model.processes import ProcessTable
from kvtrace.session import Session
from kvtrace.wire import cross_checks_to_proto

PID = 4242
MiB = 1 << 20
START_NS = 1_800_000_000_000_000_000
CALL_NS = START_NS + 1_000_000_000  # the calls come a second after the tracer said "tracing"


class Clock:
    def __init__(self) -> None:
        self.now_ns = START_NS

    def __call__(self) -> int:
        return self.now_ns


def session(witness: bool = True) -> tuple[Session, Clock]:
    clock = Clock()
    result = Session(ProcessTable(reader=lambda pid: None))
    result.wall_clock_ns = clock
    result.set_cupti_witness(witness)
    return result, clock


def alloc(address: int, size: int = 3 * MiB, source: Source = Source.UPROBE, api: Api = Api.cuMemAlloc_v2,
          layer: Layer = Layer.DRIVER, device: int = 0) -> Event:
    return Event(Kind.ALLOC, api, PID, PID, CALL_NS, layer=layer, object=ObjectKind.ALLOCATION,
                 memory=Memory.DEVICE, size_bytes=size, address=address, device=device, source=source)


def free(address: int, size: int = 3 * MiB, source: Source = Source.UPROBE) -> Event:
    return Event(Kind.FREE, Api.cuMemFree_v2, PID, PID, CALL_NS, layer=Layer.DRIVER, object=ObjectKind.ALLOCATION,
                 memory=Memory.DEVICE, size_bytes=size, address=address, device=0, source=source)


def workload(source: Source) -> list[Event]:
    """23 allocations, 11 freed: what both witnesses see of one torch loop (no caching)."""
    addresses = [0x7F00_0000_0000 + n * 4 * MiB for n in range(23)]
    return [alloc(a, source=source) for a in addresses] + [free(a, source=source) for a in addresses[:11]]


def test_both_witnesses_agree_one_for_one_and_the_ledger_counts_once():
    state, _ = session()
    state.report_tracer(TracerStatus(PID, "tracing"))
    runtime = [alloc(0x7F00_0000_0000 + n * 4 * MiB, api=Api.cudaMalloc, layer=Layer.RUNTIME) for n in range(23)]
    state.ingest_many(runtime + workload(Source.UPROBE))
    state.ingest_many(workload(Source.CUPTI))
    [check] = state.cross_checks(PID)
    assert check.compared and not check.finished and check.pending == 0
    assert {api: (row.matched, row.disagreements) for api, row in check.apis.items()} == {
        Api.cuMemAlloc_v2: (23, 0), Api.cuMemFree_v2: (11, 0)}
    driver = [entry for entry in state.outstanding() if entry.key.layer is Layer.DRIVER]
    assert len(driver) == 12 and sum(entry.size_bytes for entry in driver) == 12 * 3 * MiB
    assert state.counters()["cupti_events_witnessed"] == 34
    assert state.counters()["crosscheck_disagreements"] == 0
    assert state.cross_check_totals() == {(Api.cuMemAlloc_v2, "matched"): 23, (Api.cuMemFree_v2, "matched"): 11}


def test_a_call_one_witness_never_saw_counts_after_the_grace_with_its_address():
    state, clock = session()
    state.report_tracer(TracerStatus(PID, "tracing"))
    state.ingest_many([alloc(0x1000, source=Source.CUPTI), alloc(0x2000), alloc(0x3000, source=Source.CUPTI)])
    state.ingest(alloc(0x3000))
    clock.now_ns += MATCH_GRACE_NS - 1
    [check] = state.cross_checks(PID)
    assert check.pending == 2 and check.disagreements == 0  # still within the grace
    clock.now_ns += 2
    [check] = state.cross_checks(PID)
    row = check.apis[Api.cuMemAlloc_v2]
    assert (row.matched, row.uprobe_only, row.cupti_only) == (1, 1, 1)
    assert {(example.side, example.address) for example in check.examples} == {(Side.CUPTI, 0x1000),
                                                                             (Side.UPROBE, 0x2000)}
    assert state.counters()["crosscheck_disagreements"] == 2


def test_a_different_size_or_device_is_a_mismatch_not_a_match():
    state, _ = session()
    state.report_tracer(TracerStatus(PID, "tracing"))
    state.ingest_many([alloc(0x1000), alloc(0x1000, size=2 * MiB, source=Source.CUPTI),
                       alloc(0x2000, device=1), alloc(0x2000, source=Source.CUPTI, device=0)])
    [check] = state.cross_checks(PID)
    assert check.apis[Api.cuMemAlloc_v2].mismatched == 2
    assert "uprobes: 3145728 B on device 0; CUPTI: 2097152 B on device 0" in check.examples[0].detail


def test_an_address_reused_matches_in_order_whatever_the_interleaving():
    state, _ = session()
    state.report_tracer(TracerStatus(PID, "tracing"))
    loop = [event for _ in range(100) for event in (alloc(0x5000), free(0x5000))]
    cupti = [event for _ in range(100) for event in (alloc(0x5000, source=Source.CUPTI),
                                                     free(0x5000, source=Source.CUPTI))]
    state.ingest_many(loop[:150])
    state.ingest_many(cupti)
    state.ingest_many(loop[150:])
    [check] = state.cross_checks(PID)
    assert (check.apis[Api.cuMemAlloc_v2].matched, check.apis[Api.cuMemFree_v2].matched) == (100, 100)
    assert check.disagreements == 0 and check.pending == 0


def test_a_held_tracer_is_reported_and_nothing_is_compared():
    state, _ = session()
    state.report_tracer(TracerStatus(PID, "held", "CUPTI is taken", "torch.profiler (Kineto)"))
    state.ingest_many(workload(Source.UPROBE))
    [check] = state.cross_checks(PID)
    assert not check.compared and check.apis == {}
    findings = describe_cross_check(cross_checks_to_proto([check]).processes[0])
    assert findings[0].warning and "held by torch.profiler (Kineto)" in findings[0].message


def test_an_exited_process_keeps_its_result_once_nothing_waits():
    state, clock = session()
    state.report_tracer(TracerStatus(PID, "tracing"))
    state.ingest_many(workload(Source.UPROBE) + workload(Source.CUPTI))
    state.ingest(Event(Kind.PROCESS_EXIT, Api.process_exit, PID, PID, CALL_NS))
    state.report_tracer(TracerStatus(PID, "gone"))
    clock.now_ns += 1
    [check] = state.cross_checks(PID)
    assert check.finished and check.matched == 34
    assert state.cross_checks() == [check]
    message = cross_checks_to_proto([check]).processes[0]
    [_, agreement] = describe_cross_check(message)
    assert not agreement.warning
    assert agreement.message == ("CUPTI and the uprobes agree: 34 calls seen alike "
                                 "(cuMemAlloc_v2 23, cuMemFree_v2 11)")


def test_the_group_socket_answer_has_no_addresses():
    state, clock = session()
    state.report_tracer(TracerStatus(PID, "tracing"))
    state.ingest(alloc(0x7F00_DEAD_0000, source=Source.CUPTI))
    clock.now_ns += MATCH_GRACE_NS + 1
    checks = state.cross_checks()
    assert cross_checks_to_proto(checks).processes[0].disagreements[0].address == 0x7F00_DEAD_0000
    assert cross_checks_to_proto(checks, with_addresses=False).processes[0].disagreements[0].address == 0


def test_where_cupti_is_the_only_witness_its_events_are_the_ledger():
    state, _ = session(witness=False)
    state.report_tracer(TracerStatus(PID, "tracing"))
    state.ingest_many(workload(Source.CUPTI))
    entries = state.outstanding()
    assert len(entries) == 12 and all(entry.key.layer is Layer.DRIVER for entry in entries)
    assert state.cross_checks(PID)[0].apis == {}


def test_calls_before_both_watched_or_after_the_tracer_stopped_are_not_compared():
    state, clock = session()
    state.report_tracer(TracerStatus(PID, "tracing"))
    early = alloc(0x1000, source=Source.CUPTI)
    early.timestamp_ns = START_NS  # made as the tracer subscribed: the uprobes' event of it was not followed
    state.ingest_many([early, alloc(0x2000), alloc(0x2000, source=Source.CUPTI)])
    state.report_tracer(TracerStatus(PID, "gone", stopped_ns=CALL_NS + 5))
    late = free(0x2000)  # Python freeing tensors at shutdown, after the tracer's last flush
    late.timestamp_ns = CALL_NS + 10
    state.ingest(late)
    clock.now_ns += MATCH_GRACE_NS + 1
    [check] = state.cross_checks(PID)
    assert check.finished and check.matched == 1 and check.disagreements == 0


def test_the_tracers_clock_is_tied_to_the_agents_by_its_statuses():
    """CUPTI's clock runs 5 s behind the agent's here: the start and the stop are still placed right."""
    state, clock = session()
    behind_ns = 5_000_000_000
    state.report_tracer(TracerStatus(PID, "tracing", sent_ns=START_NS - behind_ns))
    cupti = alloc(0x1000, source=Source.CUPTI)
    cupti.timestamp_ns -= behind_ns  # the same call, on CUPTI's clock
    state.ingest_many([cupti, alloc(0x1000)])
    state.report_tracer(TracerStatus(PID, "tracing", stopped_ns=CALL_NS - behind_ns + 5, sent_ns=CALL_NS - behind_ns))
    late = free(0x1000)  # at shutdown, after the tracer stopped: the uprobes' alone
    late.timestamp_ns = CALL_NS + 10
    state.ingest(late)
    state.report_tracer(TracerStatus(PID, "gone"))
    clock.now_ns += MATCH_GRACE_NS + 1
    [check] = state.cross_checks(PID)
    assert check.matched == 1 and check.disagreements == 0 and check.status.stopped_ns == CALL_NS - behind_ns + 5


def test_after_the_tracer_stops_or_gives_up_neither_witness_is_compared():
    state, clock = session()
    state.report_tracer(TracerStatus(PID, "tracing"))
    state.ingest_many([alloc(0x1000), alloc(0x1000, source=Source.CUPTI)])
    state.report_tracer(TracerStatus(PID, "held", holder="torch.profiler (Kineto)"))  # gave CUPTI up, now
    later = [alloc(0x2000), alloc(0x3000, source=Source.CUPTI)]
    for event in later:
        event.timestamp_ns = clock.now_ns + 1
    state.ingest_many(later)
    clock.now_ns += MATCH_GRACE_NS + 1
    [check] = state.cross_checks(PID)
    assert check.matched == 1 and check.disagreements == 0


def test_a_free_is_a_free_whichever_function_made_it():
    """CUPTI names a release after its allocation (cuMemFreeAsync); the program may free it with cudaFree."""
    state, _ = session()
    state.report_tracer(TracerStatus(PID, "tracing"))
    cupti_free = free(0x1000, source=Source.CUPTI)
    cupti_free.api = Api.cuMemFreeAsync
    state.ingest_many([free(0x1000), cupti_free])
    [check] = state.cross_checks(PID)
    assert check.matched == 1 and check.disagreements == 0
