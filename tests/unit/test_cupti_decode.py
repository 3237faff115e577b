"""CUPTI's messages of one process -> the model's events, the same ones the uprobes make (probes/*.h): every
mapping rule with the exact events, joins of a CALL and its MEMORY record in both orders, the order a VMM
release and the unmap before it are applied in (the unmap's record comes a second later), stale halves,
every bound, and malformed input refused with protocol.ProtocolError."""
from __future__ import annotations

import json

import pytest

from kvtrace.model.crosscheck import TracerStatus
from kvtrace.model.events import (
    DEVICE_UNKNOWN,
    Api,
    Event,
    EventsLost,
    Kind,
    Layer,
    Memory,
    ObjectKind,
    Source,
    StackStatus,
)
from kvtrace.model.ledger import Ledger
from kvtrace.model.stacks import Frame, Stack
from kvtrace.sources.cupti import decode, protocol
from kvtrace.sources.cupti.decode import CuptiDecoder, StackDefinition
from kvtrace.sources.cupti.protocol import ProtocolError

PID = 4242
TID = 4250
NS = 1_000_000_000
T0 = 1_760_000_000 * NS
MiB = 1 << 20
DEVICE, PINNED, MANAGED, PAGEABLE = (protocol.MEMORY_KIND_DEVICE, protocol.MEMORY_KIND_PINNED,
                                     protocol.MEMORY_KIND_MANAGED, protocol.MEMORY_KIND_PAGEABLE)
ALLOCATION, RELEASE = protocol.MEMORY_ALLOCATION, protocol.MEMORY_RELEASE


def call(api: Api, *, result: int = 0, correlation_id: int = 1, tid: int = TID, stack_id: int = 0,
         stack_status: StackStatus = StackStatus.NOT_WALKED, device: int = DEVICE_UNKNOWN, address: int = 0,
         size_bytes: int = 0, handle: int = 0, ts: int = T0) -> bytes:
    return protocol.CALL_RECORD.pack(api.value, result, correlation_id, tid, stack_id, stack_status.value, device,
                                     address, size_bytes, handle, ts)


def memory(operation: int, *, kind: int = DEVICE, device: int = 0, correlation_id: int = 1, address: int = 0,
           size_bytes: int = 0, ts: int = T0, is_async: int = 0) -> bytes:
    return protocol.MEMORY_RECORD.pack(operation, kind, device, correlation_id, is_async, address, size_bytes, ts)


def event(kind: Kind, api: Api, layer: Layer, object_kind: ObjectKind, memory_: Memory, *, ts: int = T0,
          tid: int = PID, size_bytes: int = 0, address: int = 0, device: int = DEVICE_UNKNOWN, error_code: int = 0,
          handle: int = 0, freed_bytes: int = 0, stack_id: int = 0,
          stack_status: StackStatus = StackStatus.NOT_WALKED) -> Event:
    return Event(kind=kind, api=api, pid=PID, tid=tid, timestamp_ns=ts, layer=layer, object=object_kind,
                 memory=memory_, size_bytes=size_bytes, address=address, device=device, error_code=error_code,
                 handle=handle, freed_bytes=freed_bytes, stack_id=stack_id, stack_status=stack_status,
                 source=Source.CUPTI)


class Tracer:
    """A decoder fed as the listener feeds it, on a clock the test moves."""

    def __init__(self, hello: bool = True) -> None:
        self.now = 100.0
        self.decoder = CuptiDecoder(PID, clock=lambda: self.now)
        self.out: list = []
        if hello:
            self.send(protocol.HELLO, {"v": 1, "python": "3.12.3", "cupti": "13.0.1", "cuda_driver": 13000,
                                       "argv0": "python3"})

    def send(self, kind: int, body: bytes | dict) -> list:
        new = self.decoder.feed(kind, json.dumps(body).encode() if isinstance(body, dict) else body)
        self.out += new
        return new

    def calls(self, *records: bytes) -> list:
        return self.send(protocol.CALLS, b"".join(records))

    def memory(self, *records: bytes) -> list:
        return self.send(protocol.MEMORY, b"".join(records))

    def stack(self, stack_id: int, *functions: str, truncated: bool = False) -> list:
        return self.send(protocol.STACK, {"id": stack_id, "frames": [[name, "w.py", 10 + index]
                                                                      for index, name in enumerate(functions)],
                                          "truncated": truncated})

    def wait(self, seconds: float) -> list:
        self.now += seconds
        new = self.decoder.expire()
        self.out += new
        return new

    def finish(self) -> list:
        new = self.decoder.finish()
        self.out += new
        return new

    def events(self) -> list[Event]:
        return [record for record in self.out if type(record) is Event]


def only_events(records: list) -> list[Event]:
    return [record for record in records if type(record) is Event]


# ---- HELLO, STATUS, STACK, LOST ----


def test_hello_comes_first_and_says_the_versions():
    tracer = Tracer(hello=False)
    with pytest.raises(ProtocolError, match="first message must be HELLO"):
        tracer.send(protocol.STATUS, {"state": "tracing"})
    tracer = Tracer()
    status = tracer.out[0]
    assert type(status) is TracerStatus and status.pid == PID and status.state == "connected"
    assert status.reason == "CUPTI 13.0.1, CUDA driver 13000, Python 3.12.3"
    assert tracer.decoder.hello == {"python": "3.12.3", "cupti": "13.0.1", "cuda_driver": "13000", "argv0": "python3"}
    with pytest.raises(ProtocolError, match="a second HELLO"):
        tracer.send(protocol.HELLO, {"v": 1})


def test_another_protocol_version_is_refused_naming_the_fix():
    with pytest.raises(ProtocolError, match="different kvtrace releases"):
        CuptiDecoder(PID).feed(protocol.HELLO, json.dumps({"v": 2}).encode())


def test_status_becomes_a_tracer_status_of_the_connections_pid():
    tracer = Tracer()
    [status] = tracer.send(protocol.STATUS, {"state": "held", "reason": "another subscriber",
                                             "holder": "torch.profiler (Kineto)", "counters": {"calls": 3},
                                             "pid": 1})
    assert (status.pid, status.state, status.reason, status.holder, status.counters) == (
        PID, "held", "another subscriber", "torch.profiler (Kineto)", {"calls": 3})
    assert tracer.decoder.status == status


@pytest.mark.parametrize("body", [{"state": "dancing"}, {"state": "tracing", "counters": []},
                                  {"state": "tracing", "counters": {"x": -1}},
                                  {"state": "tracing", "counters": {"x": True}},
                                  {"state": "tracing", "reason": 5}])
def test_a_bad_status_is_refused(body):
    with pytest.raises(ProtocolError):
        Tracer().send(protocol.STATUS, body)


def test_text_from_the_process_is_escaped_and_cut():
    tracer = Tracer()
    [status] = tracer.send(protocol.STATUS, {"state": "unavailable", "reason": "bad\x1b[31m\ud800" + "x" * 5000})
    assert status.reason.startswith("bad\\x1b[31m\\ud800x") and len(status.reason) <= decode.MAX_TEXT_CHARS


def test_stacks_are_defined_once_and_events_carry_the_processes_id():
    tracer = Tracer()
    [definition] = tracer.stack(7, "leak", "main", truncated=True)
    assert definition == StackDefinition(7, Stack((Frame("leak", "w.py", 10), Frame("main", "w.py", 11)), True))
    assert tracer.stack(7, "leak", "main", truncated=True) == []  # the same again: nothing new
    with pytest.raises(ProtocolError, match="defined twice"):
        tracer.stack(7, "other")


def test_a_call_naming_an_undefined_stack_has_none():
    tracer = Tracer()
    tracer.calls(call(Api.cuMemAlloc_v2, stack_id=99, stack_status=StackStatus.OK, address=0x1000, size_bytes=MiB))
    tracer.memory(memory(ALLOCATION, address=0x1000, size_bytes=MiB))
    [alloc] = tracer.events()
    assert (alloc.stack_id, alloc.stack_status) == (0, StackStatus.UNRESOLVED)


def test_lost_is_told_where_the_gap_is():
    tracer = Tracer()
    tracer.memory(memory(ALLOCATION, address=0x1000, size_bytes=MiB, ts=T0))  # waits for its CALL
    tracer.send(protocol.LOST, {"count": 23, "what": "activity buffers"})
    tracer.memory(memory(RELEASE, address=0x9000, size_bytes=MiB, ts=T0 + 1))
    tracer.finish()
    kinds = [type(record).__name__ for record in tracer.out[1:]]
    assert kinds == ["Event", "EventsLost", "Event"]
    assert tracer.out[2] == EventsLost(23, T0 + 1) and tracer.decoder.counters.lost == 23


# ---- allocations: a CALL joined with its ALLOCATION record ----


def test_an_allocation_joins_its_call_and_record_in_either_order():
    expected = event(Kind.ALLOC, Api.cuMemAlloc_v2, Layer.DRIVER, ObjectKind.ALLOCATION, Memory.DEVICE,
                     ts=T0 + 5, tid=TID, size_bytes=2 * MiB, address=0x7F0000, device=1, stack_id=3,
                     stack_status=StackStatus.OK)
    call_first = Tracer()
    call_first.stack(3, "alloc")
    assert call_first.calls(call(Api.cuMemAlloc_v2, correlation_id=11, stack_id=3, stack_status=StackStatus.OK,
                                 address=0x7F0000, size_bytes=2 * MiB, ts=T0 + 9)) == []
    assert call_first.memory(memory(ALLOCATION, device=1, correlation_id=11, address=0x7F0000,
                                    size_bytes=2 * MiB, ts=T0 + 5)) == [expected]
    record_first = Tracer()
    record_first.stack(3, "alloc")
    assert record_first.memory(memory(ALLOCATION, device=1, correlation_id=11, address=0x7F0000,
                                      size_bytes=2 * MiB, ts=T0 + 5)) == []
    assert record_first.calls(call(Api.cuMemAlloc_v2, correlation_id=11, stack_id=3, stack_status=StackStatus.OK,
                                   address=0x7F0000, size_bytes=2 * MiB, ts=T0 + 9)) == [expected]


@pytest.mark.parametrize(("api", "kind", "memory_", "device", "free_api"), [
    (Api.cuMemAlloc_v2, DEVICE, Memory.DEVICE, 0, Api.cuMemFree_v2),
    (Api.cuMemAllocPitch_v2, DEVICE, Memory.DEVICE, 0, Api.cuMemFree_v2),
    (Api.cuMemAllocManaged, MANAGED, Memory.MANAGED, 0, Api.cuMemFree_v2),
    (Api.cuMemAllocAsync, DEVICE, Memory.DEVICE, 0, Api.cuMemFreeAsync),
    (Api.cuMemAllocHost_v2, PINNED, Memory.HOST, DEVICE_UNKNOWN, Api.cuMemFreeHost),  # host memory: no GPU
    (Api.cuMemHostAlloc, PINNED, Memory.HOST, DEVICE_UNKNOWN, Api.cuMemFreeHost),
])
def test_each_allocation_api_and_its_free(api, kind, memory_, device, free_api):
    tracer = Tracer()
    tracer.calls(call(api, correlation_id=5, address=0x5000, size_bytes=3 * MiB, ts=T0 + 2))
    tracer.memory(memory(ALLOCATION, kind=kind, correlation_id=5, address=0x5000, size_bytes=4 * MiB, ts=T0 + 1),
                  memory(RELEASE, kind=kind, correlation_id=6, address=0x5000, size_bytes=4 * MiB, ts=T0 + 3))
    assert tracer.events() == [
        event(Kind.ALLOC, api, Layer.DRIVER, ObjectKind.ALLOCATION, memory_, ts=T0 + 1, tid=TID, size_bytes=4 * MiB,
              address=0x5000, device=device),
        event(Kind.FREE, free_api, Layer.DRIVER, ObjectKind.ALLOCATION, memory_, ts=T0 + 3, size_bytes=4 * MiB,
              address=0x5000, device=device),
    ]


@pytest.mark.parametrize(("kind", "memory_", "api", "free_api", "device"), [
    (DEVICE, Memory.DEVICE, Api.cuMemAlloc_v2, Api.cuMemFree_v2, 2),
    (PINNED, Memory.HOST, Api.cuMemAllocHost_v2, Api.cuMemFreeHost, DEVICE_UNKNOWN),
    (MANAGED, Memory.MANAGED, Api.cuMemAllocManaged, Api.cuMemFree_v2, 2),
])
def test_a_record_with_no_call_stands_for_the_call_of_its_memory_kind(kind, memory_, api, free_api, device):
    tracer = Tracer()
    tracer.memory(memory(ALLOCATION, kind=kind, device=2, correlation_id=40, address=0xA000, size_bytes=MiB, ts=T0))
    assert tracer.events() == []
    tracer.memory(memory(RELEASE, kind=kind, device=2, correlation_id=41, address=0xA000, size_bytes=MiB,
                         ts=T0 + 6 * NS))  # 6 s later in record time: the first waited past JOIN_TIMEOUT_NS
    assert tracer.events() == [
        event(Kind.ALLOC, api, Layer.DRIVER, ObjectKind.ALLOCATION, memory_, ts=T0, size_bytes=MiB, address=0xA000,
              device=device),
        event(Kind.FREE, free_api, Layer.DRIVER, ObjectKind.ALLOCATION, memory_, ts=T0 + 6 * NS, size_bytes=MiB,
              address=0xA000, device=device),
    ]
    assert tracer.decoder.counters.stale == 1
    tracer.calls(call(Api.cuMemAlloc_v2, correlation_id=40, address=0xA000, size_bytes=MiB, ts=T0 + 1))
    assert len(tracer.events()) == 2 and tracer.decoder.counters.late == 1  # its CALL, too late: dropped


def test_a_call_whose_record_never_comes_is_taken_alone_after_the_timeout():
    tracer = Tracer()
    tracer.stack(1, "f")
    tracer.calls(call(Api.cuMemAlloc_v2, correlation_id=3, stack_id=1, stack_status=StackStatus.OK, device=0,
                      address=0xB000, size_bytes=MiB, ts=T0))
    assert tracer.wait(decode.JOIN_TIMEOUT_SECONDS - 0.1) == []
    assert only_events(tracer.wait(0.2)) == [
        event(Kind.ALLOC, Api.cuMemAlloc_v2, Layer.DRIVER, ObjectKind.ALLOCATION, Memory.DEVICE, ts=T0, tid=TID,
              size_bytes=MiB, address=0xB000, device=0, stack_id=1, stack_status=StackStatus.OK)]
    assert tracer.decoder.counters.stale == 1
    tracer.memory(memory(ALLOCATION, correlation_id=3, address=0xB000, size_bytes=MiB, ts=T0))
    assert len(tracer.events()) == 1 and tracer.decoder.counters.late == 1


def test_a_call_is_also_taken_alone_when_the_records_have_moved_5_seconds_past_it():
    tracer = Tracer()
    tracer.calls(call(Api.cuMemAllocAsync, correlation_id=3, address=0xB000, size_bytes=MiB, ts=T0))
    tracer.memory(memory(RELEASE, correlation_id=9, address=0xFFFF, size_bytes=1, ts=T0 + 5 * NS + 1))
    assert [(e.kind, e.api) for e in tracer.events()] == [(Kind.ALLOC, Api.cuMemAllocAsync),
                                                          (Kind.FREE_UNKNOWN, Api.cuMemFree_v2)]


def test_free_of_an_unknown_address():
    tracer = Tracer()
    tracer.memory(memory(RELEASE, device=0, address=0xC000, size_bytes=MiB, ts=T0),
                  memory(RELEASE, kind=PINNED, device=0, address=0xD000, size_bytes=MiB, ts=T0 + 1),
                  memory(RELEASE, kind=PAGEABLE, device=0, address=0xE000, size_bytes=MiB, ts=T0 + 2))
    assert tracer.events() == [
        event(Kind.FREE_UNKNOWN, Api.cuMemFree_v2, Layer.DRIVER, ObjectKind.ALLOCATION, Memory.DEVICE, ts=T0,
              size_bytes=MiB, address=0xC000, device=0),
        event(Kind.FREE_UNKNOWN, Api.cuMemFreeHost, Layer.DRIVER, ObjectKind.ALLOCATION, Memory.HOST, ts=T0 + 1,
              size_bytes=MiB, address=0xD000),
    ]  # pageable memory is no allocation the ledger keeps
    assert tracer.decoder.counters.ignored == 1


def test_records_of_memory_the_ledger_does_not_keep_are_ignored():
    tracer = Tracer()
    tracer.memory(memory(ALLOCATION, kind=PAGEABLE, correlation_id=70, address=0xE000, size_bytes=MiB, ts=T0))
    assert tracer.finish() == [] and tracer.decoder.counters.ignored == 1


# ---- VMM ----

HANDLE, VA, GRANULE = 0x55, 0x7F00_0000_0000, 2 * MiB


def vmm_sleep_cycle(tracer: Tracer) -> None:
    """vLLM's CuMemAllocator: reserve, create, map; then unmap, release, address free. CALLs arrive at once;
    the map's and unmap's records a flush (a second) later, after the release's CALL."""
    tracer.stack(1, "create_weights")
    tracer.calls(call(Api.cuMemAddressReserve, correlation_id=1, device=0, address=VA, size_bytes=2 * GRANULE, ts=T0),
                 call(Api.cuMemCreate, correlation_id=2, stack_id=1, stack_status=StackStatus.OK, device=0,
                      size_bytes=GRANULE, handle=HANDLE, ts=T0 + 10),
                 call(Api.cuMemMap, correlation_id=3, address=VA, size_bytes=GRANULE, handle=HANDLE, ts=T0 + 20))
    tracer.memory(memory(ALLOCATION, correlation_id=3, address=VA, size_bytes=GRANULE, ts=T0 + 19))
    tracer.calls(call(Api.cuMemRelease, correlation_id=5, handle=HANDLE, ts=T0 + 40),
                 call(Api.cuMemAddressFree, correlation_id=6, address=VA, size_bytes=2 * GRANULE, ts=T0 + 50))
    tracer.memory(memory(RELEASE, correlation_id=4, address=VA, size_bytes=GRANULE, ts=T0 + 30))


def test_a_release_after_its_unmap_frees_the_handle_as_the_uprobes_say_though_the_unmap_comes_later():
    tracer = Tracer()
    vmm_sleep_cycle(tracer)
    tracer.wait(decode.HOLD_SECONDS)  # the release waited for the records before it; none newer came
    stacked = {"stack_id": 1, "stack_status": StackStatus.OK, "tid": TID}
    assert tracer.events() == [
        event(Kind.ALLOC, Api.cuMemAddressReserve, Layer.VMM, ObjectKind.VMM_RESERVE, Memory.NONE, ts=T0, tid=TID,
              size_bytes=2 * GRANULE, address=VA, device=0),
        event(Kind.ALLOC, Api.cuMemCreate, Layer.VMM, ObjectKind.VMM_HANDLE, Memory.DEVICE, ts=T0 + 10,
              size_bytes=GRANULE, address=HANDLE, device=0, **stacked),
        event(Kind.MAP, Api.cuMemMap, Layer.VMM, ObjectKind.VMM_MAPPING, Memory.NONE, ts=T0 + 20, tid=TID,
              size_bytes=GRANULE, address=VA, device=0, handle=HANDLE),
        event(Kind.UNMAP, Api.cuMemUnmap, Layer.VMM, ObjectKind.VMM_MAPPING, Memory.NONE, ts=T0 + 30,
              size_bytes=GRANULE, address=VA, device=0),
        event(Kind.FREE, Api.cuMemRelease, Layer.VMM, ObjectKind.VMM_HANDLE, Memory.DEVICE, ts=T0 + 40, tid=TID,
              size_bytes=GRANULE, address=HANDLE, device=0),
        event(Kind.FREE, Api.cuMemAddressFree, Layer.VMM, ObjectKind.VMM_RESERVE, Memory.NONE, ts=T0 + 50, tid=TID,
              size_bytes=2 * GRANULE, address=VA, device=0),
    ]
    ledger = Ledger()
    for each in tracer.events():
        ledger.apply(each)
    assert len(ledger) == 0 and tracer.decoder.live_objects == 0


def test_a_newer_memory_record_lets_held_calls_go_at_once():
    tracer = Tracer()
    vmm_sleep_cycle(tracer)
    assert [e.kind for e in tracer.events()][-1] is Kind.UNMAP  # the release waits for records up to its time
    tracer.memory(memory(RELEASE, correlation_id=9, address=0x1, size_bytes=1, ts=T0 + 60))
    assert [(e.kind, e.api) for e in tracer.events()][-3:] == [
        (Kind.FREE, Api.cuMemRelease), (Kind.FREE, Api.cuMemAddressFree), (Kind.FREE_UNKNOWN, Api.cuMemFree_v2)]


def test_a_handle_released_while_mapped_goes_at_its_last_unmap():
    tracer = Tracer()
    tracer.calls(call(Api.cuMemCreate, correlation_id=2, device=1, size_bytes=GRANULE, handle=HANDLE, ts=T0),
                 call(Api.cuMemMap, correlation_id=3, address=VA, size_bytes=GRANULE, handle=HANDLE, ts=T0 + 20),
                 call(Api.cuMemMap, correlation_id=4, address=VA + GRANULE, size_bytes=GRANULE, handle=HANDLE,
                      ts=T0 + 30),
                 call(Api.cuMemRelease, correlation_id=5, handle=HANDLE, ts=T0 + 40))
    tracer.memory(memory(ALLOCATION, device=1, correlation_id=3, address=VA, size_bytes=GRANULE, ts=T0 + 19),
                  memory(ALLOCATION, device=1, correlation_id=4, address=VA + GRANULE, size_bytes=GRANULE,
                         ts=T0 + 29),
                  memory(RELEASE, device=1, correlation_id=6, address=VA, size_bytes=2 * GRANULE, ts=T0 + 50))
    assert [(e.kind, e.api, e.address, e.size_bytes, e.freed_bytes, e.device) for e in tracer.events()] == [
        (Kind.ALLOC, Api.cuMemCreate, HANDLE, GRANULE, 0, 1),
        (Kind.MAP, Api.cuMemMap, VA, GRANULE, 0, 1),
        (Kind.MAP, Api.cuMemMap, VA + GRANULE, GRANULE, 0, 1),
        (Kind.RELEASE, Api.cuMemRelease, HANDLE, GRANULE, 0, 1),
        (Kind.UNMAP, Api.cuMemUnmap, VA, 2 * GRANULE, GRANULE, 1),  # one unmap over both mappings
    ]
    ledger = Ledger()
    for each in tracer.events():
        ledger.apply(each)
    assert len(ledger) == 0 and tracer.decoder.live_objects == 0


def test_maps_and_unmaps_come_from_their_calls_and_their_records_are_dropped():
    """On the H200 the VMM mappings' MEMORY2 records came only at exit: the CALLs (with the handle) say it all."""
    tracer = Tracer()
    tracer.calls(call(Api.cuMemCreate, correlation_id=2, device=3, size_bytes=GRANULE, handle=HANDLE, ts=T0),
                 call(Api.cuMemMap, correlation_id=3, address=VA, size_bytes=GRANULE, handle=HANDLE, ts=T0 + 20),
                 call(Api.cuMemUnmap, correlation_id=4, address=VA, size_bytes=GRANULE, ts=T0 + 30),
                 call(Api.cuMemRelease, correlation_id=5, handle=HANDLE, ts=T0 + 40))
    tracer.wait(decode.HOLD_SECONDS)
    tracer.memory(memory(ALLOCATION, device=-1, correlation_id=3, address=VA + 1, size_bytes=GRANULE, ts=T0 + 19),
                  memory(RELEASE, correlation_id=4, address=VA, size_bytes=GRANULE, ts=T0 + 29))
    tracer.finish()
    events = tracer.events()
    assert [(e.kind, e.api, e.address, e.device) for e in events] == [
        (Kind.ALLOC, Api.cuMemCreate, HANDLE, 3), (Kind.MAP, Api.cuMemMap, VA, 3),
        (Kind.UNMAP, Api.cuMemUnmap, VA, 3), (Kind.FREE, Api.cuMemRelease, HANDLE, 3)]
    assert tracer.decoder.counters.vmm_records == 2 and tracer.decoder.live_objects == 0


def test_vmm_frees_of_unknown_handles_and_ranges():
    tracer = Tracer()
    tracer.calls(call(Api.cuMemRelease, correlation_id=1, handle=0x99, ts=T0),
                 call(Api.cuMemAddressFree, correlation_id=2, device=0, address=VA, size_bytes=GRANULE, ts=T0 + 1))
    tracer.finish()
    assert tracer.events() == [
        event(Kind.FREE_UNKNOWN, Api.cuMemRelease, Layer.VMM, ObjectKind.VMM_HANDLE, Memory.DEVICE, ts=T0, tid=TID,
              address=0x99),
        event(Kind.FREE_UNKNOWN, Api.cuMemAddressFree, Layer.VMM, ObjectKind.VMM_RESERVE, Memory.NONE, ts=T0 + 1,
              tid=TID, address=VA, device=0),
    ]


def test_a_map_whose_record_never_comes_is_made_from_its_call():
    tracer = Tracer()
    tracer.calls(call(Api.cuMemCreate, correlation_id=2, device=0, size_bytes=GRANULE, handle=HANDLE, ts=T0),
                 call(Api.cuMemMap, correlation_id=3, address=VA, size_bytes=GRANULE, handle=HANDLE, ts=T0 + 20))
    tracer.finish()
    assert tracer.events()[1] == event(Kind.MAP, Api.cuMemMap, Layer.VMM, ObjectKind.VMM_MAPPING, Memory.NONE,
                                       ts=T0 + 20, tid=TID, size_bytes=GRANULE, address=VA, device=0, handle=HANDLE)


# ---- failures ----


@pytest.mark.parametrize(("api", "kind", "layer", "object_kind", "memory_", "address", "size_bytes", "device",
                          "handle"), [
    (Api.cuMemAlloc_v2, Kind.ALLOC_FAILED, Layer.DRIVER, ObjectKind.ALLOCATION, Memory.DEVICE, 0, MiB, 0, 0),
    (Api.cuMemAllocHost_v2, Kind.ALLOC_FAILED, Layer.DRIVER, ObjectKind.ALLOCATION, Memory.HOST, 0, MiB, -1, 0),
    (Api.cuMemCreate, Kind.ALLOC_FAILED, Layer.VMM, ObjectKind.VMM_HANDLE, Memory.DEVICE, 0, MiB, 0, 0),
    (Api.cuMemMap, Kind.ALLOC_FAILED, Layer.VMM, ObjectKind.VMM_MAPPING, Memory.NONE, VA, MiB, -1, HANDLE),
    (Api.cuMemAddressReserve, Kind.ALLOC_FAILED, Layer.VMM, ObjectKind.VMM_RESERVE, Memory.NONE, 0, MiB, 0, 0),
    (Api.cuMemRelease, Kind.FREE_FAILED, Layer.VMM, ObjectKind.VMM_HANDLE, Memory.DEVICE, HANDLE, 0, -1, 0),
    (Api.cuMemAddressFree, Kind.FREE_FAILED, Layer.VMM, ObjectKind.VMM_RESERVE, Memory.NONE, VA, 0, 0, 0),
])
def test_a_failed_call_is_counted_with_its_error_and_expects_no_record(api, kind, layer, object_kind, memory_,
                                                                      address, size_bytes, device, handle):
    tracer = Tracer()
    tracer.stack(2, "oom")
    tracer.calls(call(api, result=2, correlation_id=8, stack_id=2, stack_status=StackStatus.OK, device=0,
                      address=VA, size_bytes=MiB, handle=HANDLE, ts=T0))
    tracer.wait(decode.HOLD_SECONDS)
    assert tracer.events() == [event(kind, api, layer, object_kind, memory_, ts=T0, tid=TID, size_bytes=size_bytes,
                                     address=address, device=device, error_code=2, handle=handle, stack_id=2,
                                     stack_status=StackStatus.OK)]
    assert tracer.decoder.waiting == 0


def test_a_call_without_a_result_counts_only_where_its_record_says_it_allocated():
    tracer = Tracer()  # the tracer sends result -1 when the callback carried no return value
    tracer.calls(call(Api.cuMemAlloc_v2, result=-1, correlation_id=1, ts=T0 + 3),
                 call(Api.cuMemAlloc_v2, result=-1, correlation_id=2, size_bytes=MiB, ts=T0 + 4),
                 call(Api.cuMemCreate, result=-1, correlation_id=3, handle=9, size_bytes=MiB, ts=T0 + 5))
    tracer.memory(memory(ALLOCATION, correlation_id=1, address=0x1000, size_bytes=MiB, ts=T0))
    tracer.finish()
    assert [(e.kind, e.api, e.address, e.size_bytes) for e in tracer.events()] == [
        (Kind.ALLOC, Api.cuMemAlloc_v2, 0x1000, MiB)]
    assert tracer.decoder.counters.ignored == 2


# ---- order ----


def test_a_batch_comes_out_in_timestamp_order():
    tracer = Tracer()
    records = [(0x1000 * (index + 1), T0 + (index * 7919) % 23) for index in range(23)]
    tracer.calls(*(call(Api.cuMemAlloc_v2, correlation_id=index + 1, address=address, size_bytes=MiB, ts=ts)
                   for index, (address, ts) in enumerate(records)))
    tracer.memory(*(memory(ALLOCATION, correlation_id=index + 1, address=address, size_bytes=MiB, ts=ts)
                    for index, (address, ts) in enumerate(records)))
    stamps = [e.timestamp_ns for e in tracer.events()]
    assert len(stamps) == 23 and stamps == sorted(stamps)


def test_finish_applies_everything_held_and_forgets_the_process():
    tracer = Tracer()
    tracer.calls(call(Api.cuMemCreate, correlation_id=1, device=0, size_bytes=GRANULE, handle=HANDLE, ts=T0),
                 call(Api.cuMemAlloc_v2, correlation_id=2, device=0, address=0x1000, size_bytes=MiB, ts=T0 + 1))
    tracer.memory(memory(ALLOCATION, correlation_id=77, address=0x2000, size_bytes=MiB, ts=T0 + 2))
    assert [e.api for e in tracer.events()] == [Api.cuMemCreate]  # before the first half-join: it may go
    tracer.finish()
    assert [(e.api, e.address) for e in tracer.events()] == [
        (Api.cuMemCreate, HANDLE), (Api.cuMemAlloc_v2, 0x1000), (Api.cuMemAlloc_v2, 0x2000)]
    assert tracer.decoder.waiting == 0 and tracer.decoder.live_objects == 0


# ---- bounds ----


def test_pending_joins_are_bounded_the_oldest_taken_alone(monkeypatch):
    monkeypatch.setattr(decode, "MAX_PENDING", 4)
    tracer = Tracer()
    tracer.calls(*(call(Api.cuMemAlloc_v2, correlation_id=n, address=0x1000 * n, size_bytes=MiB, ts=T0 + n)
                   for n in range(1, 7)))
    assert tracer.decoder.counters.unjoined == 2
    tracer.memory(*(memory(ALLOCATION, correlation_id=n, address=0x1000 * n, size_bytes=MiB, ts=T0 + n)
                    for n in range(1, 7)))
    assert [e.address for e in tracer.events()] == [0x1000 * n for n in range(1, 7)]
    assert tracer.decoder.counters.late == 2  # the records of the two taken alone


def test_held_records_are_bounded(monkeypatch):
    monkeypatch.setattr(decode, "MAX_HELD", 5)
    tracer = Tracer()
    tracer.calls(*(call(Api.cuMemRelease, correlation_id=n, handle=n, ts=T0 + n) for n in range(1, 9)))
    assert len(tracer.events()) == 3 and tracer.decoder.counters.forced == 3
    assert [e.address for e in tracer.events()] == [1, 2, 3]


def test_stacks_past_the_bound_are_refused_and_their_events_say_unresolved(monkeypatch):
    monkeypatch.setattr(decode, "MAX_STACKS", 2)
    tracer = Tracer()
    for stack_id in (1, 2, 3):
        tracer.stack(stack_id, f"f{stack_id}")
    assert [r.stack_id for r in tracer.out if type(r) is StackDefinition] == [1, 2]
    assert tracer.decoder.counters.stacks_refused == 1
    tracer.calls(call(Api.cuMemCreate, stack_id=3, stack_status=StackStatus.OK, size_bytes=1, handle=1, ts=T0))
    tracer.finish()
    assert (tracer.events()[0].stack_id, tracer.events()[0].stack_status) == (0, StackStatus.UNRESOLVED)


def test_a_process_holding_more_than_the_bound_is_refused_keeping_what_came_before(monkeypatch):
    monkeypatch.setattr(decode, "MAX_LIVE_OBJECTS", 3)
    tracer = Tracer()
    with pytest.raises(ProtocolError, match="holds more than 3"):
        tracer.memory(*(memory(ALLOCATION, correlation_id=n, address=0x1000 * n, size_bytes=MiB, ts=T0 + n)
                        for n in range(1, 6)), memory(RELEASE, correlation_id=99, address=1, ts=T0 + 6 * NS))
    assert [e.address for e in only_events(tracer.decoder.finish()) if e.kind is Kind.ALLOC] == [
        0x1000, 0x2000, 0x3000]
    assert tracer.decoder.counters.untracked == 2


# ---- malformed input ----


@pytest.mark.parametrize(("kind", "body", "says"), [
    (protocol.CALLS, call(Api.cuMemFree_v2), "not one the tracer reports"),
    (protocol.CALLS, call(Api.cudaMalloc), "not one the tracer reports"),
    (protocol.CALLS, call(Api.cuMemAlloc_v2, size_bytes=1 << 62), "size"),
    (protocol.CALLS, call(Api.cuMemAlloc_v2, device=1024), "device"),
    (protocol.CALLS, call(Api.cuMemAlloc_v2, device=-2), "device"),
    (protocol.CALLS, call(Api.cuMemAlloc_v2, ts=0), "timestamp"),
    (protocol.CALLS, protocol.CALL_RECORD.pack(20, 0, 1, 1, 0, 9, 0, 0, 0, 0, T0), "stack status"),
    (protocol.CALLS, call(Api.cuMemAlloc_v2)[:-1], "no whole number"),
    (protocol.MEMORY, memory(3), "operation"),
    (protocol.MEMORY, memory(ALLOCATION, size_bytes=1 << 63), "size"),
    (protocol.MEMORY, memory(ALLOCATION, device=5000), "device"),
    (protocol.POOLS, protocol.POOL_RECORD.pack(1, 1, 0, 0, 1 << 62, 0, T0), "size"),
    (protocol.STACK, b"[" * 100_000, "not JSON"),
    (protocol.STACK, b"\xff", "not JSON"),
    (protocol.STACK, json.dumps({"id": 0, "frames": []}).encode(), "id"),
    (protocol.STACK, json.dumps({"id": 1, "frames": [["f", "x.py"]]}).encode(), "frame 0"),
    (protocol.STACK, json.dumps({"id": 1, "frames": [["", "x.py", 1]]}).encode(), "function"),
    (protocol.STACK, json.dumps({"id": 1, "frames": [["f", "x.py", -1]]}).encode(), "line"),
    (protocol.STACK, json.dumps({"id": 1, "frames": [["f", "x.py", 1]] * 257}).encode(), "at most 256"),
    (protocol.LOST, json.dumps({"count": -1}).encode(), "LOST count"),
    (protocol.LOST, b'{"count": 1' + b"0" * 5000 + b"}", "not JSON"),  # past Python's 4300 digits
])
def test_malformed_input_is_a_protocol_error(kind, body, says):
    with pytest.raises(ProtocolError, match=says):
        Tracer().send(kind, body)


def test_pools_are_checked_and_counted_not_ledgered():
    tracer = Tracer()
    tracer.send(protocol.POOLS, protocol.POOL_RECORD.pack(1, 1, 0, 0x1000, 64 * MiB, 0, T0))
    assert tracer.finish() == [] and tracer.decoder.counters.ignored == 1


# ---- BLOCKS: PyTorch's live blocks at the exit (kvtrace run's recorder) ----


def test_blocks_come_after_everything_held_and_put_the_process_at_depth_full():
    from kvtrace.model.depth import Depth, DepthCause, ProcessDepth

    tracer = Tracer()
    tracer.stack(1, "keep_activation", "main")
    tracer.calls(call(Api.cuMemAlloc_v2, correlation_id=1, address=0x1000, size_bytes=64 << 20))  # waits: no record
    new = tracer.send(protocol.BLOCKS, {"taken_ns": T0 + 50, "since_ns": T0 - 10, "recorder": "kvtrace",
                                        "blocks": [[0, 0x1000, 1 << 20, 1], [0, 0x101000, 512, 0]]})
    depth = next(record for record in new if type(record) is ProcessDepth)
    assert (depth.pid, depth.depth, depth.since_ns, depth.cause) == (PID, Depth.FULL, T0 - 10, DepthCause.CONFIGURED)
    blocks = [event for event in only_events(new) if event.api is Api.pytorch_malloc]
    assert [(e.address, e.size_bytes, e.stack_id, e.stack_status, e.timestamp_ns, e.layer, e.object, e.source)
            for e in blocks] == [
        (0x1000, 1 << 20, 1, StackStatus.OK, T0 + 50, Layer.TORCH, ObjectKind.BLOCK, Source.CUPTI),
        (0x101000, 512, 0, StackStatus.NOT_WALKED, T0 + 50, Layer.TORCH, ObjectKind.BLOCK, Source.CUPTI)]
    assert tracer.decoder.counters.blocks == 2
    assert [e.api for e in only_events(new)] == [Api.cuMemAlloc_v2, Api.pytorch_malloc, Api.pytorch_malloc]


@pytest.mark.parametrize(("body", "says"), [
    ({"taken_ns": T0, "since_ns": 0, "recorder": "nvidia", "blocks": []}, "recorder 'nvidia' is not one of"),
    ({"taken_ns": T0, "since_ns": T0 + 1, "recorder": "kvtrace", "blocks": []}, "since_ns must be"),
    ({"taken_ns": T0, "since_ns": 0, "recorder": "kvtrace", "blocks": [[0, 0x1000, 5]]}, "a block must be"),
    ({"taken_ns": T0, "since_ns": 0, "recorder": "kvtrace", "blocks": [[0, 0, 5, 0]]}, "a block's address"),
    ({"taken_ns": T0, "since_ns": 0, "recorder": "kvtrace", "blocks": "all"}, "BLOCKS must list"),
])
def test_malformed_blocks_are_refused(body, says):
    with pytest.raises(ProtocolError, match=says):
        Tracer().send(protocol.BLOCKS, body)
