"""EVENT_ENCODING_FIXED_COLUMNS: a poll's records reach a stream copied, as an EventRun, with exactly the events
decode_events made of them; the hub keeps a run whole (or cuts it with its records) and counts every event;
the Session takes a run whole only where no event of it needs more."""
import time

import grpc
import pytest

from fake_agent import served
from kvtrace._proto.kvtrace.v1 import agent_service_pb2 as service_pb2
from kvtrace._proto.kvtrace.v1 import agent_service_pb2_grpc as service_grpc
from kvtrace._proto.kvtrace.v1 import events_pb2
from kvtrace.model.crosscheck import TracerStatus
from kvtrace.model.events import Api, Event, EventRun, Kind, Layer, Memory, ObjectKind, Source, StackStatus
from kvtrace.model.processes import ProcessInfo, ProcessTable
from kvtrace.servers.hub import EventFilter, EventHub, Lost
from kvtrace.session import Session
from kvtrace.sources.bpf import abi
from kvtrace.sources.bpf.decode import Clock, RawEvents, decode_events, event_run
from kvtrace.sources.bpf.ring import RingReader
from kvtrace.wire import FixedColumnsBatch, events_from_columns, events_from_fixed_columns, runs_to_fixed_columns

CLOCK = Clock(offset_ns=1_700_000_000_000_000_000)
FIXED = service_pb2.EVENT_ENCODING_FIXED_COLUMNS
STRIDE, HEADER = RingReader.STRIDE, RingReader.HEADER_BYTES


def record(timestamp_ns=5, address=0x7F00, size_bytes=4096, caller_address=0x401000, aux=0, stack_id=0,
           pid=4000, tid=4001, device=0, error_code=0, api=Api.cudaMalloc, kind=Kind.ALLOC, layer=Layer.RUNTIME,
           object_kind=ObjectKind.ALLOCATION, memory=Memory.DEVICE, stack_status=0, comm=b"python",
           sampling=0) -> bytes:
    event = abi.EVENT_STRUCT.pack(timestamp_ns, address, size_bytes, caller_address, aux, stack_id, pid, tid, device,
                                  error_code, int(api), int(kind), int(layer), int(object_kind), int(memory),
                                  stack_status, sampling, comm)
    return b"\xaa" * HEADER + event + b"\xbb" * (STRIDE - HEADER - len(event))  # as the ring holds it


# Every field in use: each aux meaning, a device unknown, an error, a 16-byte name, one with bytes after its NUL.
RECORDS = [
    record(timestamp_ns=10, address=(1 << 64) - 4096, size_bytes=(1 << 40) + 3),
    record(timestamp_ns=11, kind=Kind.FREE, api=Api.cudaFree, comm=b"worker\0garbage!", tid=4002),
    record(timestamp_ns=12, kind=Kind.MAP, api=Api.cuMemMap, layer=Layer.VMM, object_kind=ObjectKind.VMM_MAPPING,
           memory=Memory.NONE, aux=0x55, pid=4100, comm=b"sixteen-bytes-ok"),
    record(timestamp_ns=13, kind=Kind.UNMAP, api=Api.cuMemUnmap, layer=Layer.VMM,
           object_kind=ObjectKind.VMM_MAPPING, memory=Memory.NONE, aux=1 << 21, device=-1, error_code=-7),
    record(timestamp_ns=14, kind=Kind.ALLOC, api=Api.pytorch_malloc, layer=Layer.TORCH, object_kind=ObjectKind.BLOCK,
           aux=7, caller_address=0, stack_status=StackStatus.NOT_PYTHON.value, device=3),
    record(timestamp_ns=15, kind=Kind.FREE_UNKNOWN, api=Api.cuMemFree_v2, layer=Layer.DRIVER, pid=4200,
           comm=b"\xff\xfe"),
]
LABELS = {4000: ("python3 serve.py --model x", "c0ffee"), 4100: ("/usr/bin/other", ""), 4200: None}


def decoded_run(records=RECORDS, labels=LABELS, labelled=True) -> EventRun:
    """The run the BPF source makes of `records`; `labelled`: as the Session then labels it."""
    data = b"".join(records)
    events, _, undecodable = decode_events(data, CLOCK, STRIDE, HEADER)
    assert not undecodable
    run = event_run(events, data, CLOCK, STRIDE, HEADER)
    assert run is not None and run.labels is None
    if labelled:
        for event in run:
            label = labels[event.pid]
            event.title, event.container = label if label is not None else (event.comm, "")
        run.labels = labels
    return run


def over_the_wire(*runs: EventRun) -> events_pb2.FixedEventColumns:
    message = events_pb2.FixedEventColumns()
    runs_to_fixed_columns(runs, message)
    return events_pb2.FixedEventColumns.FromString(message.SerializeToString())


# ---- the records, copied ----

def test_a_run_over_the_wire_is_exactly_the_events_decoded():
    run = decoded_run()
    assert events_from_fixed_columns(over_the_wire(run)) == list(run)
    assert [event.comm for event in run][1:3] == ["worker", "sixteen-bytes-ok"]
    assert (run[2].handle, run[3].freed_bytes, run[4].stream) == (0x55, 1 << 21, 7)  # aux, by api


def test_runs_join_in_one_batch_and_a_slice_keeps_its_records():
    run = decoded_run()
    part = run.sliced(2, 5)
    assert type(part) is EventRun and len(part.raw) == 3 and part.labels is run.labels
    assert events_from_fixed_columns(over_the_wire(part)) == run[2:5]
    assert events_from_fixed_columns(over_the_wire(run.sliced(4, 100), run.sliced(0, 1))) == [*run[4:], run[0]]
    assert len(run.sliced(3, 3)) == 0


SAMPLE_BYTES = 512 << 10
SAMPLED_BLOCKS = [  # under stack sampling: passed over (no stack: a run's), and one of at least S (exact)
    record(timestamp_ns=20 + i, kind=Kind.ALLOC, api=Api.pytorch_malloc, layer=Layer.TORCH,
           object_kind=ObjectKind.BLOCK, aux=7, caller_address=0, size_bytes=16 << 10, address=0x7F00 + i * 0x4000,
           stack_status=StackStatus.NOT_SAMPLED.value, sampling=1) for i in range(3)] + [
    record(timestamp_ns=30, kind=Kind.ALLOC, api=Api.pytorch_malloc, layer=Layer.TORCH,
           object_kind=ObjectKind.BLOCK, aux=7, caller_address=0, size_bytes=1 << 20, address=0x9F00,
           stack_status=StackStatus.NOT_PYTHON.value)]


def sampled_run(block_sample_bytes=SAMPLE_BYTES) -> EventRun:
    data = b"".join(SAMPLED_BLOCKS)
    events, _, _ = decode_events(data, CLOCK, STRIDE, HEADER, block_sample_bytes)
    run = event_run(events, data, CLOCK, STRIDE, HEADER, block_sample_bytes)
    assert run is not None
    run.labels = {4000: LABELS[4000]}
    for event in run:
        event.title, event.container = LABELS[4000]
    return run


def test_blocks_stack_sampling_crosses_the_wire_as_the_records_said():
    run = sampled_run()
    message = over_the_wire(run)
    assert message.block_sample_bytes == SAMPLE_BYTES and message.sampling == b"\1\1\1\0"
    got = events_from_fixed_columns(message)
    assert got == list(run)
    assert [(event.sample_bytes, event.stack_status) for event in got] == \
        [(SAMPLE_BYTES, StackStatus.NOT_SAMPLED)] * 3 + [(0, StackStatus.NOT_PYTHON)]
    # an agent that predates sampling sends no column: no block was subject to it
    message.ClearField("sampling")
    message.block_sample_bytes = 0
    assert [event.sample_bytes for event in events_from_fixed_columns(message)] == [0] * 4
    message.sampling = b"\1"
    with pytest.raises(ValueError, match="sampling has 1 bytes for 4 events"):
        events_from_fixed_columns(message)


def test_runs_of_two_sampling_means_do_not_join():
    with pytest.raises(ValueError, match="another clock or sampling mean"):
        over_the_wire(sampled_run(), sampled_run(256 << 10))


def test_labels_go_by_pid_and_an_unknown_process_is_titled_by_its_comm():
    message = over_the_wire(decoded_run())
    assert {label.pid: (label.title, label.container) for label in message.processes} == {
        4000: LABELS[4000], 4100: LABELS[4100]}
    assert message.timestamp_offset_ns == CLOCK.offset_ns and list(message.timestamp_ns)[:2] == [10, 11]
    last = events_from_fixed_columns(message)[-1]
    assert last.title == last.comm == "\ufffd\ufffd" and last.container == ""


def test_runs_of_two_clocks_do_not_join():
    other = decoded_run()
    other.raw = RawEvents(other.raw.records, STRIDE, HEADER, CLOCK.offset_ns + 1)
    with pytest.raises(ValueError, match="another clock"):
        over_the_wire(decoded_run(), other)


def test_records_that_are_not_their_events_copied_make_no_run():
    data = b"".join(RECORDS)
    events, _, _ = decode_events(data, CLOCK, STRIDE, HEADER)
    assert event_run(events[1:], data, CLOCK, STRIDE, HEADER) is None  # one left out (undecodable)
    odd = b"".join([RECORDS[0], record(stack_status=200)])  # a status decoded as "not walked"
    assert event_run(decode_events(odd, CLOCK, STRIDE, HEADER)[0], odd, CLOCK, STRIDE, HEADER) is None
    packed = b"".join(item[HEADER:HEADER + abi.EVENT_STRUCT.size] + b"\0" * 4 for item in RECORDS)  # 92-byte stride
    assert event_run(decode_events(packed, CLOCK, 92, 0)[0], packed, CLOCK, 92, 0) is None
    with pytest.raises(ValueError, match="aligned"):
        RawEvents(packed, 92, 0, 0)


def test_a_damaged_batch_is_refused_with_what_is_wrong():
    message = over_the_wire(decoded_run())
    message.kind = message.kind[:-1]
    with pytest.raises(ValueError, match="kind has 5 bytes for 6 events"):
        events_from_fixed_columns(message)
    message = over_the_wire(decoded_run())
    del message.pid[0]
    with pytest.raises(ValueError, match="different lengths"):
        events_from_fixed_columns(message)


def test_a_value_of_a_newer_agent_reads_as_none():
    message = over_the_wire(decoded_run())
    message.api = b"\xff\x7f" + message.api[2:]
    got = events_from_fixed_columns(message)
    assert got[0] is None and got[1:] == list(decoded_run())[1:]


# ---- the hub ----

def test_a_run_reaches_an_unfiltered_subscriber_and_one_that_wants_all_its_processes_whole():
    hub = EventHub()
    everything, chosen = hub.subscribe(), hub.subscribe(EventFilter(pids=frozenset({4000, 4100, 4200, 9})))
    fewer = hub.subscribe(EventFilter(pids=frozenset({4000})))
    big = hub.subscribe(EventFilter(min_size_bytes=1 << 30))
    run = decoded_run()
    hub.publish_many(run)
    assert everything.read_batches(100, 0) == [run] and everything.read_batches(100, 0) == []
    (whole,) = chosen.read_batches(100, 0)
    assert whole is run
    (some,) = fewer.read_batches(100, 0)
    assert type(some) is not EventRun and some == [event for event in run if event.pid == 4000]
    assert big.read(100, 0) == [run[0]]
    assert hub.published_total == len(run) == everything.delivered_total


def test_a_full_queue_cuts_a_run_with_its_records_and_counts_the_gap_exactly():
    hub = EventHub()
    subscription = hub.subscribe(max_queued_events=4)
    run = decoded_run()
    hub.publish_many(run)  # 6 events: 4 fit
    (head,) = subscription.read_batches(100, 0)
    assert type(head) is EventRun and head == run[:4] and len(head.raw) == 4
    (gap,) = subscription.read_batches(100, 0)
    assert gap == Lost(dropped_count=2)
    hub.publish_many(run)
    assert subscription.read(100, 0)[0] is run[0]  # it rejoined


def test_a_read_cuts_a_run_where_its_room_ends_and_keeps_the_rest_in_order():
    hub = EventHub()
    subscription = hub.subscribe()
    run = decoded_run()
    hub.publish_many(run)
    hub.publish_loss(3)
    first = subscription.read_batches(4, 0)
    assert [list(item) for item in first] == [run[:4]] and type(first[0]) is EventRun
    rest = subscription.read_batches(4, 0)
    assert rest[0] == run[4:] and len(rest[0].raw) == 2 and rest[1] == Lost(kernel_lost_count=3)
    assert subscription.delivered_total == 6


# ---- the Session ----

class Runs:
    """A sink that takes runs: what it was handed, as handed."""

    def __init__(self):
        self.runs = []
        self.events = []

    def publish(self, event):
        self.events.append(event)

    def publish_many(self, events):
        self.runs.append(events)

    def publish_loss(self, lost_count):
        pass

    def publish_state(self, record):
        pass


def session_with(sink, titles):
    session = Session(ProcessTable(lambda pid: ProcessInfo(pid, titles[pid], "c", "", "", 0.0, time.monotonic())
                                   if pid in titles else None))
    session.add_sink(sink)
    return session


def test_the_session_takes_a_run_whole_and_labels_it_for_the_stream():
    sink = Runs()
    session = session_with(sink, {4000: "serve", 4100: "other"})
    run = decoded_run(labelled=False)
    session.ingest_many([run])
    assert sink.runs == [run] and sink.runs[0] is run and not sink.events
    assert run.labels == {4000: ("serve", ""), 4100: ("other", ""), 4200: None}
    assert [event.title for event in run] == ["serve", "serve", "other", "serve", "serve", run[5].comm]
    assert session.events_total == len(run)


def test_a_run_a_source_labelled_in_part_is_not_copied():
    sink = Runs()
    session = session_with(sink, {})
    run = decoded_run(labelled=False)
    run[0].title = "a recording's title"  # the Session leaves it, and so knows no label of pid 4000
    session.ingest_many([run])
    assert sink.runs[0] is run and run.labels is None


def test_a_run_with_an_event_that_needs_more_goes_one_by_one():
    sink = Runs()
    session = session_with(sink, {})
    failed = record(kind=Kind.ALLOC_FAILED, error_code=2)
    session.ingest_many([decoded_run([RECORDS[0], failed, RECORDS[1]], labelled=False)])
    assert [type(batch) for batch in sink.runs] == [list, list] and len(sink.events) == 1
    assert sink.events[0].kind is Kind.ALLOC_FAILED and session.events_total == 3


def test_under_a_witness_a_run_of_a_compared_process_goes_one_by_one():
    sink = Runs()
    session = session_with(sink, {})
    session.wall_clock_ns = lambda: CLOCK.offset_ns - 10**9
    session.set_cupti_witness(True)
    session.report_tracer(TracerStatus(4000, "tracing"))
    session.ingest_many([decoded_run(labelled=False)])
    assert all(type(batch) is not EventRun for batch in sink.runs) and session.events_total == len(RECORDS)
    [check] = session.cross_checks(4000)
    assert check.compared and check.pending >= 1  # its calls wait for CUPTI's side
    session.ingest_many([decoded_run([RECORDS[2]], labelled=False)])  # pid 4100, not compared: whole
    assert type(sink.runs[-1]) is EventRun


# ---- the stream ----

def fixed_stream(socket, backend):
    """A StreamEvents call asking for fixed columns, once the hub has it as a subscriber."""
    agent = service_grpc.AgentServiceStub(grpc.insecure_channel(f"unix:{socket}"))
    responses = agent.StreamEvents(service_pb2.StreamEventsRequest(encoding=FIXED), timeout=10)
    deadline_wait(lambda: backend.hub.subscriber_count() == 1)
    return responses


def test_a_fixed_stream_copies_runs_and_keeps_every_other_event_and_loss_in_order():
    with served() as (server, backend):
        responses = fixed_stream(server.config.admin_path, backend)
        first, second = decoded_run(labelled=False), decoded_run(labelled=False)
        alone = decoded_run([record(kind=Kind.ALLOC_FAILED, error_code=2)], labelled=False)[0]
        backend.apply(first, alone)
        backend.lose(4)
        backend.apply(second)
        got, kinds = [], []
        for response in responses:
            assert not (response.HasField("columns") and response.HasField("fixed_columns"))
            kinds.extend(["lost"] * len(response.events))
            if response.HasField("fixed_columns"):
                kinds.append("fixed")
                got.extend(events_from_fixed_columns(response.fixed_columns))
            if response.HasField("columns"):
                kinds.append("columns")
                got.extend(events_from_columns(response.columns))
            if len(got) == 13:
                break
        responses.cancel()
    assert kinds == ["fixed", "columns", "lost", "fixed"]
    assert got == [*first, alone, *second]  # titles the Session gave them


def test_the_redacted_view_never_copies_records():
    with served() as (server, backend):
        responses = fixed_stream(server.config.socket, backend)  # the group's socket: the redacted view
        backend.apply(decoded_run(labelled=False))
        response = next(responses)
        responses.cancel()
    assert response.view == service_pb2.VIEW_REDACTED and not response.HasField("fixed_columns")
    assert [event.address for event in events_from_columns(response.columns)] == [0] * len(RECORDS)


def deadline_wait(condition, timeout_seconds=5.0):
    deadline = time.monotonic() + timeout_seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_sources_are_the_uprobes():
    assert {event.source for event in decoded_run()} == {Source.UPROBE}


# ---- one label per process in a batch ----

def labelled(records, labels) -> EventRun:
    return decoded_run(records, {pid: labels.get(pid) for pid in (4000, 4100, 4200)})


def test_a_title_that_changed_between_runs_ends_the_batch_even_with_a_run_between():
    """pid 4000 known as "old", then 4100 alone, then 4000 as "new" (it exec'd): the third run cannot join
    the first's batch, or the first's events would read the new title."""
    first = labelled([RECORDS[0]], {4000: ("old", "")})
    between = labelled([RECORDS[2]], {4100: ("other", "")})
    then = labelled([RECORDS[1]], {4000: ("new", "")})
    unknown = labelled([RECORDS[1]], {})  # 4000 no longer known: its events' title is their comm
    batch = FixedColumnsBatch()
    batch.add(first)
    assert batch.takes(between) and batch.add(between) is None
    assert not batch.takes(then) and not batch.takes(unknown)
    assert batch.takes(labelled([RECORDS[1]], {4000: ("old", "")}))
    with pytest.raises(ValueError, match="labelled otherwise"):
        batch.add(then)


def test_a_stream_sends_runs_of_one_process_relabelled_in_two_batches_with_their_own_titles():
    """Read at once, as a busy stream reads: the runs before and after the relabelling go in two batches."""
    with served() as (server, _):
        first = labelled([RECORDS[0]], {4000: ("old", "")})
        between = labelled([RECORDS[2]], {4100: ("other", "")})
        then = labelled([RECORDS[1]], {4000: ("new", "")})
        responses = server.servicer._column_responses([first, between, then], set(), None, fixed=True)
    assert [len(response.fixed_columns.timestamp_ns) for response in responses] == [2, 1]
    got = [event for response in responses for event in events_from_fixed_columns(response.fixed_columns)]
    assert [event.title for event in got] == ["old", "other", "new"] and got == [*first, *between, *then]


# ---- the BPF source makes runs ----

def source_with(selected=None):
    from kvtrace.sources.bpf.source import BpfOptions, BpfSource
    from test_bpf_source import CountingProbes
    source = BpfSource(Session(), BpfOptions(only_selected=selected is not None))
    source.probes = CountingProbes()
    source._selected.update(selected or ())
    return source


def test_the_source_hands_a_poll_over_as_one_run_where_nothing_needs_an_event_alone():
    source = source_with()
    data = b"".join(RECORDS)
    source._on_raw_events(data, STRIDE, HEADER)
    (run,) = source._batch
    assert type(run) is EventRun and run.raw.records == data and run.pids == {4000, 4100, 4200}
    assert run == decode_events(data, source.clock, STRIDE, HEADER)[0]


def test_the_source_filters_a_run_of_other_processes_and_admits_stacks_one_by_one():
    chosen = source_with(selected={4000, 4100, 4200})
    chosen._on_raw_events(b"".join(RECORDS), STRIDE, HEADER)
    assert type(chosen._batch[0]) is EventRun  # every process chosen: whole
    fewer = source_with(selected={4000})
    fewer._on_raw_events(b"".join(RECORDS), STRIDE, HEADER)
    assert all(type(item) is not EventRun for item in fewer._batch) and {e.pid for e in fewer._batch} == {4000}
    stacked = source_with()
    stacked._resolve_stack = lambda pid, kernel_stack_id: 0
    stacked._on_raw_events(b"".join([RECORDS[0], record(stack_id=77)]), STRIDE, HEADER)
    assert [type(item) for item in stacked._batch] == [Event, Event]
    assert stacked._batch[1].stack_status is StackStatus.UNRESOLVED


def test_a_client_asks_for_fixed_columns_only_with_columns():
    from kvtrace.client import AgentClient
    with served() as (server, _):
        client = AgentClient.for_socket(server.config.socket)
        with pytest.raises(ValueError, match="fixed=True needs columns=True"):
            client.stream_responses(columns=False, fixed=True)
        client.close()
