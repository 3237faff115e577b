"""decode_events (a poll's ring records at once) gives what decode_event gives one record at a time,
and the ring reader's slow path takes committed records only."""
import struct

import pytest

from kvtrace.model.events import Api, Kind, Layer, Memory, ObjectKind, StackStatus
from kvtrace.sources.bpf import abi
from kvtrace.sources.bpf.decode import Clock, UndecodableRecord, decode_event, decode_events
from kvtrace.sources.bpf.ring import RingReader

CLOCK = Clock(offset_ns=1_000)


def record(timestamp_ns=5, address=0x7F00, size_bytes=4096, caller_address=0x401000, aux=0, stack_id=0,
           pid=4000, tid=4001, device=0, error_code=0, api=Api.cudaMalloc, kind=Kind.ALLOC, layer=Layer.RUNTIME,
           object_kind=ObjectKind.ALLOCATION, memory=Memory.DEVICE, stack_status=0, comm=b"python",
           sampling=0) -> bytes:
    return abi.EVENT_STRUCT.pack(timestamp_ns, address, size_bytes, caller_address, aux, stack_id, pid, tid, device,
                                 error_code, int(api), int(kind), int(layer), int(object_kind), int(memory),
                                 stack_status, sampling, comm)


RECORDS = [
    record(),
    record(kind=Kind.FREE, api=Api.cudaFree, comm=b"worker\0garbage", stack_id=77,
           stack_status=StackStatus.OK.value),
    record(kind=Kind.MAP, api=Api.cuMemMap, layer=Layer.VMM, object_kind=ObjectKind.VMM_MAPPING,
           memory=Memory.NONE, aux=0x55),
    record(kind=Kind.UNMAP, api=Api.cuMemUnmap, layer=Layer.VMM, object_kind=ObjectKind.VMM_MAPPING,
           memory=Memory.NONE, aux=1 << 21),
    record(kind=Kind.ALLOC, api=Api.pytorch_malloc, layer=Layer.TORCH, object_kind=ObjectKind.BLOCK, aux=7),
    record(kind=Kind.PROCESS_EXIT, api=Api.process_exit, layer=0, object_kind=0, memory=0, error_code=9,
           device=-1, comm=b"\xff\xfe"),
    record(stack_status=200),  # a status this agent does not know: not walked
]


def ring(records: list[bytes], header=b"\0" * 8) -> bytes:
    return b"".join(header + item for item in records)


def test_a_batch_decodes_as_one_record_at_a_time():
    events, stack_ids, undecodable = decode_events(b"".join(RECORDS), CLOCK)
    one_by_one = [decode_event(item, CLOCK) for item in RECORDS]
    assert events == [event for event, _ in one_by_one]
    assert stack_ids == [stack_id for _, stack_id in one_by_one]
    assert undecodable == 0


def test_a_blocks_stack_sampling_is_the_mean_the_agent_set_on_the_records_that_say_so():
    """struct kvt_event.sampling: 1 on a block whose stack was subject to sampling (chosen: walked, or passed over:
    NOT_SAMPLED); the event carries the mean S the agent set in the probes, one record at a time or in a batch."""
    S = 512 << 10
    block = dict(kind=Kind.ALLOC, api=Api.pytorch_malloc, layer=Layer.TORCH, object_kind=ObjectKind.BLOCK, aux=7)
    batch = [record(**block, sampling=1, stack_id=9, stack_status=StackStatus.OK.value),
             record(**block, sampling=1, stack_status=StackStatus.NOT_SAMPLED.value),
             record(**block, stack_id=9, stack_status=StackStatus.OK.value), RECORDS[0]]  # exact: not subject
    events, stack_ids, undecodable = decode_events(b"".join(batch), CLOCK, block_sample_bytes=S)
    assert [(event.sample_bytes, event.stack_status) for event in events] == [
        (S, StackStatus.OK), (S, StackStatus.NOT_SAMPLED), (0, StackStatus.OK), (0, StackStatus.NOT_WALKED)]
    assert events == [decode_event(item, CLOCK, S)[0] for item in batch] and stack_ids == [9, 0, 9, 0]
    # without sampling set in the probes, no record says so; and if one did, it would weigh exactly
    assert [event.sample_bytes for event in decode_events(b"".join(batch), CLOCK)[0]] == [0, 0, 0, 0]


def test_records_as_they_lie_in_the_ring():
    stride = RingReader.STRIDE
    assert stride == 96 and RingReader.HEADER_BYTES == 8
    events, _, _ = decode_events(ring(RECORDS), CLOCK, stride, RingReader.HEADER_BYTES)
    assert events == [decode_event(item, CLOCK)[0] for item in RECORDS]


def test_undecodable_records_are_left_out_and_counted():
    batch = [RECORDS[0], record(kind=200), RECORDS[1], record(api=0), record(layer=9)]
    events, stack_ids, undecodable = decode_events(b"".join(batch), CLOCK)
    assert events == [decode_event(RECORDS[0], CLOCK)[0], decode_event(RECORDS[1], CLOCK)[0]]
    assert stack_ids == [0, 77] and undecodable == 3


def test_a_batch_that_is_not_whole_records_is_refused():
    with pytest.raises(UndecodableRecord):
        decode_events(b"".join(RECORDS) + b"\0" * 5, CLOCK)


def walker() -> RingReader:
    return RingReader.__new__(RingReader)  # _walk reads no mapping


def header(length: int) -> bytes:
    return struct.pack("<II", length, 0)


def test_the_walk_stops_at_a_record_not_yet_committed_and_skips_discarded_ones():
    size = RingReader.RECORD_BYTES
    chunk = (header(size) + RECORDS[0] + header(size | RingReader.DISCARD_BIT) + RECORDS[1]
             + header(size) + RECORDS[2] + header(size | RingReader.BUSY_BIT) + RECORDS[3] + header(size) + RECORDS[4])
    records, consumed = walker()._walk(chunk, 100)
    assert consumed == 3 * RingReader.STRIDE  # up to the busy one, the discarded one included
    events, _, _ = decode_events(records, CLOCK, RingReader.STRIDE, RingReader.HEADER_BYTES)
    assert events == [decode_event(RECORDS[0], CLOCK)[0], decode_event(RECORDS[2], CLOCK)[0]]


def test_the_walk_takes_no_record_cut_by_the_copy_and_keeps_to_its_budget():
    size = RingReader.RECORD_BYTES
    chunk = header(size) + RECORDS[0] + header(size) + RECORDS[1][:40]
    records, consumed = walker()._walk(chunk, 100)
    assert consumed == RingReader.STRIDE and len(records) == RingReader.STRIDE
    records, consumed = walker()._walk((header(size) + RECORDS[0]) * 3, 2)
    assert consumed == 2 * RingReader.STRIDE


def test_committed_headers_are_read_in_bulk_up_to_the_first_busy_record():
    size = RingReader.RECORD_BYTES
    committed = [header(size) + RECORDS[0]] * 4
    reader = walker()
    reader._data = memoryview(b"".join(committed) + header(size | RingReader.BUSY_BIT) + RECORDS[1])
    stride = RingReader.STRIDE
    assert reader._committed(0, 4 * stride) == 4 * stride  # all committed: the bulk read
    assert reader._committed(stride, 3 * stride + 40) == 3 * stride  # a record cut by the limit is not taken
    assert reader._committed(0, 5 * stride) == 4 * stride  # the busy fifth ends the run
    discarded = [header(size) + RECORDS[0], header(size | RingReader.DISCARD_BIT) + RECORDS[1],
                 header(16) + RECORDS[2][:16], header(size | RingReader.BUSY_BIT) + RECORDS[3]]
    reader._data = memoryview(b"".join(discarded))
    assert reader._committed(0, len(reader._data)) == 2 * stride + 24  # discarded and short ones are whole records


def test_a_short_record_is_padded_and_then_undecodable():
    chunk = header(16) + RECORDS[0][:16]
    records, consumed = walker()._walk(chunk, 100)
    assert consumed == 24
    events, _, undecodable = decode_events(records, CLOCK, RingReader.STRIDE, RingReader.HEADER_BYTES)
    assert events == [] and undecodable == 1
