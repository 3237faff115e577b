"""The flight recorder's ring under an exit storm's stream: its memory per record at its bound, what taking an
event costs, what a trigger's copy costs under the Session's lock, and that a dump reads back every event.

The stream is an exit storm's (bench/attacks.py storm): each short-lived child makes a runtime and a driver
allocation (a run, `publish_many`) and exits (`publish`), each event made as the BPF source makes it: fresh ints,
its comm decoded from the record's bytes, the title of its process shared with its other events. No root.

    PYTHONPATH=$PWD/agent .venv/bin/python bench/flight_ring.py [--records 100000]
"""
from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import code_version  # noqa: E402
from kvtrace._proto.kvtrace.v1 import agent_service_pb2 as service_pb2  # noqa: E402
from kvtrace.model.events import Api, Event, Kind, Layer, Memory, ObjectKind, StackStatus, comm_text  # noqa: E402
from kvtrace.model.processes import ProcessTable  # noqa: E402
from kvtrace.reports.flight import FlightOptions, FlightRecorder  # noqa: E402
from kvtrace.reports.recording import RecordingReader  # noqa: E402
from kvtrace.session import Session  # noqa: E402
from kvtrace.wire import event_to_proto  # noqa: E402


def storm(children: int, start_ns: int, first: int = 0) -> list[list[Event] | Event]:
    """Per child: a run of its two allocations, then its exit (wait status 0, 1 MiB held)."""
    made: list[list[Event] | Event] = []
    for child in range(first, first + children):
        pid = 100_000 + child
        title = f"workload once {child % 7}"  # one string per process, as the Session's labels are
        at = start_ns + (child - first) * 150_000
        comm_raw = b"workload\0\0\0\0\0\0\0\0"
        common = dict(pid=pid, tid=pid, size_bytes=1 << 20, device=0, title=title, caller_address=0x401000 + child,
                      memory=Memory.DEVICE, object=ObjectKind.ALLOCATION, stack_status=StackStatus.NOT_PYTHON)
        made.append([
            Event(kind=Kind.ALLOC, api=Api.cudaMalloc, timestamp_ns=at + 1, layer=Layer.RUNTIME,
                  address=0x7F0000000000 + child * 4096, comm=comm_text(comm_raw), **common),
            Event(kind=Kind.ALLOC, api=Api.cuMemAlloc_v2, timestamp_ns=at + 2, layer=Layer.DRIVER,
                  address=0x7F0000000000 + child * 4096, comm=comm_text(comm_raw), **common)])
        made.append(Event(kind=Kind.PROCESS_EXIT, api=Api.process_exit, pid=pid, tid=pid, timestamp_ns=at + 3,
                          comm=comm_text(comm_raw), title=title))
    return made


def feed(recorder: FlightRecorder, stream: list[list[Event] | Event]) -> None:
    for item in stream:
        if type(item) is list:
            recorder.publish_many(item)
        else:
            recorder.publish(item)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=FlightOptions().max_records)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvtrace-bench-flight-ring-"))
    children = args.records // 3 + 1000  # more than the ring holds: it is full, and has let go of some
    start_ns = time.time_ns() - 60 * 1_000_000_000
    options = FlightOptions(directory=work, max_records=args.records, window_seconds=3600)

    # Memory: what the ring keeps alive once full (the stream is made first, each event dropped by the
    # bench as the source drops it after ingest: only the ring's references keep it).
    session = Session(ProcessTable())
    recorder = FlightRecorder(session, options, 60.0)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for first in range(0, children, 1000):  # made and dropped a thousand children at a time
        feed(recorder, storm(min(1000, children - first), start_ns + first * 150_000, first))
    gc.collect()
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    ring_bytes = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    held = len(recorder._ring)

    # Time: taking the stream (publish_many + publish), and a trigger's copy under the lock. The events are made
    # a hundred children at a time just before the recorder takes them, as the source decodes them just before
    # (in the caches still: the ring reads every field of each, the deque of objects none).
    session = Session(ProcessTable())
    recorder = FlightRecorder(session, options, 60.0)
    stream = []
    events = 0
    taking = 0.0
    for first in range(0, children, 100):
        part = storm(min(100, children - first), start_ns + first * 150_000, first)
        started = time.perf_counter()
        feed(recorder, part)
        taking += time.perf_counter() - started
        events += sum(len(item) if type(item) is list else 1 for item in part)
        stream += part
    take_ns = taking * 1e9 / events
    recorder.start()
    with session.lock:
        started = time.perf_counter()
        pending = recorder._trigger_locked(service_pb2.FlightTrigger(
            kind=service_pb2.FLIGHT_TRIGGER_KIND_REQUEST, timestamp_ns=start_ns + children * 150_000 + 10,
            device=-1, reason="bench"))
        copy_seconds = time.perf_counter() - started
    assert pending is not None
    started = time.perf_counter()
    pending.done.wait(120)
    write_seconds = time.perf_counter() - started
    recorder.stop()
    assert pending.dump is not None, pending.error
    # Every event of the ring read back, in order: the last `args.records` of the stream's events.
    expected = [event for item in stream for event in (item if type(item) is list else (item,))][-args.records:]
    with RecordingReader.open(Path(pending.dump.path)) as reader:
        read = [frame.event for frame in reader.frames() if frame.HasField("event")]
    same = read == [event_to_proto(event) for event in expected]

    print(f"flight ring, {time.strftime('%Y-%m-%d %H:%M')}; measured: {code_version()}")
    print(f"  exit storm stream: {children} children, {events} events; ring bound {args.records} records, "
          f"{held} held at the end")
    print(f"  ring memory (tracemalloc)  {ring_bytes / held:.0f} bytes per record "
          f"({ring_bytes / 2**20:.1f} MiB for {held} records)")
    print(f"  taking an event            {take_ns:.0f} ns (publish_many of 2 + publish of the exit; made just before)")
    print(f"  a trigger's copy (locked)  {copy_seconds * 1e3:.1f} ms; the dump written in {write_seconds:.2f} s, "
          f"{pending.dump.event_count} events")
    print(f"  dump reads back the ring   {'yes' if same else 'NO'} ({len(read)} events read, {len(expected)} put)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
