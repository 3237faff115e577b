"""The flight recorder's packed ring (issue 31): GIVEN records put in, THEN what it holds reads back equal to the last
`max_records` of them, in order, whatever their fields; and a full ring's dump holds exactly the events put in."""
import dataclasses
import time

from fake_agent import ALL_KINDS, FakeAgent, MiB, event
from kvtrace._proto.kvtrace.v1 import agent_service_pb2 as service_pb2
from kvtrace.model.events import Api, Event, EventsLost, Kind, Source, StackStatus
from kvtrace.model.gpus import GpuMemory, NvmlProcessMemory, NvmlSample
from kvtrace.reports.flight import FlightOptions, FlightRecorder
from kvtrace.reports.flight_ring import EVENT_FIELDS, RECORD_BYTES, PackedRing
from kvtrace.reports.recording import RecordingReader
from kvtrace.wire import event_to_proto

NS = 1_000_000_000
START = 1_700_000_000_000_000_000


def varied(count: int, start_ns: int = START, wire: bool = False) -> list:
    """`count` records of every shape: each kind's event, exits, every field at its widest, values no field holds
    (kept as themselves), a plain int where an enum goes, losses and NVML samples; titles of a few processes.
    `wire`: only what the wire carries (a dump's frames)."""
    unusual = [event(size=(1 << 64) - 1, address=(1 << 64) - 1, caller_address=(1 << 64) - 1,
                     handle=(1 << 64) - 1, stream=(1 << 64) - 1, sample_bytes=(1 << 64) - 1, stack_id=(1 << 64) - 1,
                     error_code=-(1 << 63), device=-(1 << 31), source=Source.CUPTI,
                     stack_status=StackStatus.NOT_SAMPLED, container="c0ffee"),
               event(size=1 << 64),  # wider than its field: kept as itself
               event(size=-1),
               event(pid=1 << 32),
               event(kind=Kind.ALLOC, layer=7)]  # a number Layer lacks
    shapes = [*ALL_KINDS,
              event(kind=Kind.PROCESS_EXIT, api=Api.process_exit, layer=None, obj=None, memory=None, size=0,
                    address=0, device=-1, error_code=9, freed_bytes=3 * MiB, title="python serve.py --port 1"),
              *([] if wire else unusual),
              dataclasses.replace(event(), comm="ü" * 5, title="\u2603 snow", source=Source.CUPTI),
              EventsLost(17, 0),
              NvmlSample(0, (GpuMemory(0, "GPU-1", "H100", 80 << 30, 1 << 30, 79 << 30, 0),),
                         (NvmlProcessMemory(0, 200, None),))]
    made = []
    for index in range(count):
        shape = shapes[index % len(shapes)]
        at = start_ns + index * 1000
        if type(shape) is Event:
            made.append(dataclasses.replace(shape, timestamp_ns=at, pid=shape.pid + index % 5,
                                            title=shape.title or f"python worker {index % 3}"))
        else:
            made.append(dataclasses.replace(shape, timestamp_ns=at))
    return made


def test_a_ring_over_its_bound_reads_back_its_last_records_equal_and_in_order():
    ring = PackedRing(500, chunk_records=64)
    records = varied(2000)
    for start in range(0, 1500, 7):  # runs of 7, as publish_many takes them, then one at a time
        ring.extend(records[start:start + 7])
    for record in records[1500:]:
        ring.append(record)
    assert len(ring) == 500
    assert list(ring) == records[-500:]
    assert [type(record) for record in ring] == [type(record) for record in records[-500:]]
    assert ring.first_timestamp_ns() == records[1500].timestamp_ns
    assert ring.extend(records[:3]) == records[1502].timestamp_ns  # let go of: the newest of the three oldest
    # Labels and records kept as themselves go with the chunks that held them: bounded by the chunks held.
    assert len(ring._labels) <= 40 and sum(len(chunk.objects) for chunk in ring._chunks) <= 5 * (500 + 64) // 23 + 5


def test_letting_go_of_the_oldest_one_by_one_and_a_copy_that_does_not_change_as_the_ring_goes_on():
    ring = PackedRing(100, chunk_records=16)
    records = varied(100)
    ring.extend(records)
    copy = ring.copy()
    assert [ring.popleft_timestamp_ns() for _ in range(40)] == [record.timestamp_ns for record in records[:40]]
    later = varied(150, START + NS)
    assert ring.extend(later) == later[49].timestamp_ns  # 60 + 150 = 100 + 110 let go: its 60 and 50 of `later`
    assert list(copy) == records and copy.oldest_timestamp_ns() == records[0].timestamp_ns
    assert list(copy.since(records[60].timestamp_ns)) == records[60:]
    assert list(ring) == later[-100:]
    while ring:
        ring.popleft_timestamp_ns()
    assert list(ring) == [] and not ring._labels
    ring.append(records[0])
    assert list(ring) == records[:1]


def test_a_packed_record_is_103_bytes_of_every_field_of_an_event():
    assert RECORD_BYTES == 103
    assert tuple(field.name for field in dataclasses.fields(Event)) == EVENT_FIELDS


def dumped_events(recorder: FlightRecorder, directory) -> list:
    """The events (no stack definitions) of the one dump an operator's request makes, the recorder stopped after."""
    recorder.request(service_pb2.FLIGHT_TRIGGER_KIND_REQUEST, "a test")
    recorder.stop()
    (path,) = sorted(directory.glob("flight-*.kvtrace"))
    with RecordingReader.open(path) as reader:
        return [frame.event for frame in reader.frames()
                if frame.WhichOneof("record") == "event" and not frame.event.HasField("stack_definition")]


def test_a_full_rings_dump_holds_exactly_the_events_put_in(tmp_path):
    """1 500 records into a ring of 1 000 (the smallest --flight-max-records): the dump of the full ring holds its
    1 000, each event's frame equal to that event's own encoding, the losses and samples where they were."""
    agent = FakeAgent()
    recorder = FlightRecorder(agent.session, FlightOptions(directory=tmp_path, max_records=1000,
                                                           window_seconds=3600), 60.0)
    recorder.start()
    start = time.time_ns() - 60 * NS
    records = [record for record in varied(1500, start, wire=True) if type(record) is not NvmlSample]
    for index in range(0, len(records), 5):
        part = records[index:index + 5]
        for record in part:  # each as the Session hands it over
            if type(record) is EventsLost:
                recorder._append(record)
            elif record.kind is Kind.ALLOC_FAILED or index % 2:  # (not an out-of-memory dump of its own)
                recorder.publish_many([record])
            else:
                recorder.publish(record)
    kept = records[-1000:]
    events = dumped_events(recorder, tmp_path)
    expected = []
    for record in kept:
        if type(record) is EventsLost:
            expected.append(("lost", record.timestamp_ns, record.count))
        else:
            expected.append(event_to_proto(record))
    got = [("lost", message.timestamp_ns, message.events_lost.kernel_lost_count)
           if message.HasField("events_lost") else message for message in events]
    assert got == expected


def test_a_dumps_window_starts_at_its_oldest_record_not_its_first(tmp_path):
    """Events come a little out of order (a run delivered after a newer one): the dump's window holds every record
    the ring holds, the late older ones too (from the first record's time they were left out)."""
    agent = FakeAgent()
    recorder = FlightRecorder(agent.session, FlightOptions(directory=tmp_path, window_seconds=3600), 60.0)
    recorder.start()
    start = time.time_ns() - 60 * NS
    records = [record for record in varied(40, start, wire=True) if type(record) is Event]
    recorder.publish_many(records[20:])  # the newer run first
    recorder.publish_many(records[:20])
    events = dumped_events(recorder, tmp_path)
    assert sorted(message.timestamp_ns for message in events) == sorted(record.timestamp_ns for record in records)
