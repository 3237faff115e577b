"""What recording costs the agent: the Session's ingest rate with the flight recorder and a recording
file, side by side, and the size, dump and replay figures (in process, synthetic events; no root).

Each configuration is its own Session fed the same stream (allocation + free pairs from 16 Python
stacks, batches of 512 as the BPF source hands them over); rounds run the configurations in turn,
order rotated, and the medians are printed with the ratio to the bare Session of the same round.

    none       the Session alone (the agent with --no-flight-recorder)
    flight     + the flight recorder (the default: a ring of the last 120 s)
    record     + the flight recorder + `--record FILE` (encoded and compressed on its own thread)

Then: bytes per event on disk, the flight recorder's memory per ringed record (tracemalloc), the time
to write a dump of a full ring, and replay speed (`kvtrace leaks --input` reads at this rate).

Run: .venv/bin/python bench/recording_cost.py [--events 200000] [--rounds 5]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import code_version, progress  # noqa: E402
from kvtrace._proto.kvtrace.v1 import agent_service_pb2 as service_pb2  # noqa: E402
from kvtrace.model.events import Api, Event, Kind, Layer, Memory, ObjectKind, StackStatus  # noqa: E402
from kvtrace.model.processes import ProcessTable  # noqa: E402
from kvtrace.model.stacks import Frame, Stack  # noqa: E402
from kvtrace.reports.flight import FlightOptions, FlightRecorder  # noqa: E402
from kvtrace.reports.recorder import FileRecorder  # noqa: E402
from kvtrace.reports.replay import replay  # noqa: E402
from kvtrace.session import Session  # noqa: E402

BATCH = 512
STACKS = 16
MODES = ("none", "flight", "record")


def events(count: int, stack_ids: list[int], start_ns: int) -> list[Event]:
    """`count` events: pairs of cuMemAlloc_v2 and cuMemFree_v2 of 2 MiB, from rotating stacks."""
    made = []
    for index in range(count // 2):
        address = 0x7F0000000000 + (index % 4096) * (2 << 20)
        timestamp = start_ns + index * 1000
        common = dict(api=Api.cuMemAlloc_v2, pid=4242, tid=4242, layer=Layer.DRIVER, object=ObjectKind.ALLOCATION,
                      memory=Memory.DEVICE, size_bytes=2 << 20, address=address, device=0, comm="python",
                      title="python serve.py")
        made.append(Event(kind=Kind.ALLOC, timestamp_ns=timestamp, stack_id=stack_ids[index % len(stack_ids)],
                          stack_status=StackStatus.OK, **common))
        common["api"] = Api.cuMemFree_v2
        made.append(Event(kind=Kind.FREE, timestamp_ns=timestamp + 500, **common))
    return made


def session_with_stacks() -> tuple[Session, list[int]]:
    session = Session(ProcessTable())
    ids = [session.intern_stack(Stack(tuple(Frame(f"layer_{depth}_{n}", f"/app/model_{n}.py", 10 + depth)
                                            for depth in range(20)))) for n in range(STACKS)]
    return session, ids


def run_mode(mode: str, count: int, work: Path) -> tuple[float, FileRecorder | None]:
    """Seconds to ingest `count` events in this mode (recording flushed and closed after)."""
    session, ids = session_with_stacks()
    stream = events(count, ids, time.time_ns())
    flight = recorder = None
    if mode in ("flight", "record"):
        flight = FlightRecorder(session, FlightOptions(directory=work / f"flight-{mode}"), 60.0)
        flight.start()
    if mode == "record":
        recorder = FileRecorder(session, work / f"{mode}.kvtrace", 60.0)
        recorder.start()
    started = time.perf_counter()
    for offset in range(0, len(stream), BATCH):
        session.ingest_many(stream[offset:offset + BATCH])
    seconds = time.perf_counter() - started
    if recorder is not None:
        recorder.stop()
    if flight is not None:
        flight.stop()
    return seconds, recorder


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvtrace-bench-recording-"))
    rates: dict[str, list[float]] = {mode: [] for mode in MODES}
    slowdowns: dict[str, list[float]] = {mode: [] for mode in MODES}
    recording_bytes = 0
    for round_number in range(args.rounds):
        order = MODES[round_number % len(MODES):] + MODES[:round_number % len(MODES)]
        seconds = {}
        for mode in order:
            seconds[mode], recorder = run_mode(mode, args.events, work)
            rates[mode].append(args.events / seconds[mode])
            if recorder is not None:
                recording_bytes = (work / "record.kvtrace").stat().st_size
        for mode in MODES:
            slowdowns[mode].append(seconds[mode] / seconds["none"] - 1)
        progress(f"round {round_number + 1}: " + ", ".join(f"{mode} {args.events / seconds[mode]:,.0f}/s"
                                                           for mode in MODES))

    # The ring's memory per record: the events it keeps alive (decoded per batch, as the BPF source
    # decodes them, and dropped after ingest unless the ring holds them), and a dump of a full ring.
    ring_records = FlightOptions().max_records
    retained = {}
    for mode in ("none", "flight"):
        session, ids = session_with_stacks()
        flight = FlightRecorder(session, FlightOptions(directory=work / "flight-dump"), 60.0)
        if mode == "flight":
            flight.start()
        start_ns = time.time_ns()
        tracemalloc.start()
        before = tracemalloc.take_snapshot()
        for offset in range(0, ring_records, BATCH):
            session.ingest_many(events(BATCH, ids, start_ns + offset * 1000))
        after = tracemalloc.take_snapshot()
        tracemalloc.stop()
        retained[mode] = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    ring_bytes = retained["flight"] - retained["none"]
    started = time.perf_counter()
    dump = flight.request(service_pb2.FLIGHT_TRIGGER_KIND_REQUEST, "bench")
    dump_seconds = time.perf_counter() - started
    flight.stop()
    started = time.perf_counter()
    replayed = replay(Path(dump.path))
    replay_seconds = time.perf_counter() - started

    print(f"recording cost, {time.strftime('%Y-%m-%d %H:%M')}; measured: {code_version()}")
    print(f"  {args.events} events per round (alloc+free pairs, 16 stacks of 20 frames), {args.rounds} rounds, "
          "order rotated; medians")
    for mode in MODES:
        slowdown = "" if mode == "none" else f"  {statistics.median(slowdowns[mode]) * 100:+.1f} % time vs none"
        print(f"  ingest {mode:<8} {statistics.median(rates[mode]):>12,.0f} events/s{slowdown}")
    print(f"  recording on disk          {recording_bytes / args.events:.1f} bytes per event "
          f"({recording_bytes} bytes for {args.events} events, zlib level 3)")
    print(f"  flight ring memory         {ring_bytes / ring_records:.0f} bytes per record "
          f"({ring_bytes / 2**20:.1f} MiB for a full ring of {ring_records} records, tracemalloc)")
    print(f"  dump of a full ring        {dump_seconds:.2f} s, {dump.size_bytes} bytes, {dump.event_count} events")
    print(f"  replay of that dump        {replay_seconds:.2f} s ({replayed.events_replayed / replay_seconds:,.0f} "
          "events/s, analysis included)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
