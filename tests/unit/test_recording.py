"""The recording file: its format (versions, damage, appending), recording a Session (checkpoint,
rotation, StreamRecording and `kvtrace record`), and replay: the reports read from a file give what
they gave live."""
import io
import json
import os
import struct
import subprocess
import sys
import threading
import time
import zlib
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from fake_agent import FakeAgent, MiB, event, served
from kvtrace._proto.kvtrace.v1 import agent_service_pb2 as service_pb2
from kvtrace._proto.kvtrace.v1 import events_pb2
from kvtrace.cli.flags import parse_at
from kvtrace.cli.main import main
from kvtrace.model.events import Api, Event, Kind
from kvtrace.model.stacks import Frame, NativeFrame, Stack
from kvtrace.reports.recorder import FileRecorder
from kvtrace.reports.recording import FORMAT_VERSION, MAGIC, RecordingError, RecordingReader, RecordingWriter
from kvtrace.reports.replay import replay

NS = 1_000_000_000


def header(**fields) -> service_pb2.RecordingHeader:
    return service_pb2.RecordingHeader(**{"agent_version": "test", "host": "h", "start_time_ns": 1, **fields})


def frame(timestamp_ns: int) -> service_pb2.RecordingFrame:
    return service_pb2.RecordingFrame(event=events_pb2.Event(timestamp_ns=timestamp_ns, pid=7))


def ledger_of(session) -> list:
    return sorted((entry.key, entry.size_bytes, entry.device, entry.stack_id, entry.timestamp_ns, entry.tid)
                  for entry in session.outstanding())


def run_cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with redirect_stdout(out):
        code = main(list(argv))
    return code, out.getvalue()


# ---- the file ----

def test_frames_come_back_in_order_across_chunks(tmp_path):
    path = tmp_path / "r.kvtrace"
    writer = RecordingWriter.create(path, header(host="gpu-7"))
    for index in range(23):
        writer.write(frame(index + 1))
        if index % 5 == 4:
            writer.flush()  # several chunks
    writer.close()
    with RecordingReader.open(path) as reader:
        assert reader.header.host == "gpu-7"
        assert [f.event.timestamp_ns for f in reader.frames()] == list(range(1, 24))
        assert reader.damage is None


def test_a_newer_format_is_refused_with_what_to_do(tmp_path):
    path = tmp_path / "new.kvtrace"
    encoded = header().SerializeToString()
    path.write_bytes(MAGIC + struct.pack("<HI", FORMAT_VERSION + 1, len(encoded)) + encoded)
    with pytest.raises(RecordingError, match=f"format {FORMAT_VERSION + 1}, newer .* upgrade kvtrace"):
        RecordingReader.open(path)


def test_a_file_that_is_no_recording_is_refused(tmp_path):
    path = tmp_path / "x.json"
    path.write_text('{"not": "a recording"}')
    with pytest.raises(RecordingError, match="is not a kvtrace recording .*kvtrace record"):
        RecordingReader.open(path)
    path.write_bytes(MAGIC[:5])
    with pytest.raises(RecordingError, match="not a kvtrace recording"):
        RecordingReader.open(path)
    path.write_bytes(MAGIC + b"\x01")
    with pytest.raises(RecordingError, match="cut short inside its header"):
        RecordingReader.open(path)


def test_a_cut_file_is_read_up_to_the_damage_and_says_where(tmp_path):
    path = tmp_path / "cut.kvtrace"
    writer = RecordingWriter.create(path, header())
    for index in range(10):
        writer.write(frame(index + 1))
    writer.flush()
    whole = path.stat().st_size
    for index in range(10, 20):
        writer.write(frame(index + 1))
    writer.close()
    data = path.read_bytes()
    path.write_bytes(data[:-7])  # the writer died inside its second chunk
    with RecordingReader.open(path) as reader:
        assert [f.event.timestamp_ns for f in reader.frames()] == list(range(1, 11))
        assert reader.damage == (f"{path} is damaged at byte {whole}: cut short: the last chunk has "
                                 f"{len(data) - 7 - whole - 8} of its {len(data) - whole - 8} bytes "
                                 "(the writer stopped while writing it); read up to there")


def test_a_corrupt_chunk_fails_its_checksum(tmp_path):
    path = tmp_path / "bad.kvtrace"
    writer = RecordingWriter.create(path, header())
    writer.write(frame(1))
    writer.close()
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    with RecordingReader.open(path) as reader:
        assert list(reader.frames()) == []
        assert "fails its checksum" in reader.damage


def test_appending_cuts_a_damaged_tail_then_adds(tmp_path):
    path = tmp_path / "a.kvtrace"
    writer = RecordingWriter.create(path, header())
    writer.write(frame(1))
    writer.close()
    with path.open("ab") as file:
        file.write(struct.pack("<II", 1000, 0) + b"partial")
    writer = RecordingWriter.append(path)
    writer.write(frame(2))
    writer.close()
    with RecordingReader.open(path) as reader:
        assert [f.event.timestamp_ns for f in reader.frames()] == [1, 2]
        assert reader.damage is None


def test_a_record_of_a_newer_kvtrace_is_skipped_and_counted(tmp_path):
    path = tmp_path / "n.kvtrace"
    writer = RecordingWriter.create(path, header())
    writer.write(frame(1))
    writer.close()
    unknown = b"\xfa\x3f\x01\x00"  # field 1023, length 1: a record this reader does not know
    data = struct.pack("<I", len(unknown)) + unknown + struct.pack("<I", len(frame(2).SerializeToString())) + \
        frame(2).SerializeToString()
    compressed = zlib.compress(data)
    with path.open("ab") as file:
        file.write(struct.pack("<II", len(compressed), zlib.crc32(compressed)) + compressed)
    with RecordingReader.open(path) as reader:
        assert [f.event.timestamp_ns for f in reader.frames()] == [1, 2]
        assert reader.unknown_frames == 1


def test_recording_files_are_private(tmp_path):
    writer = RecordingWriter.create(tmp_path / "p.kvtrace", header())
    writer.close()
    assert (tmp_path / "p.kvtrace").stat().st_mode & 0o777 == 0o600


# ---- recording a Session, replaying it ----

def _leaky(agent: FakeAgent, start_ns: int, count: int = 23, address: int = 0x100000) -> int:
    leak = agent.stacks.intern(Stack((Frame("leak_kv", "/app/leak.py", 12), Frame("step", "/app/serve.py", 40))))
    agent.apply(*[event(address=address + index * MiB, ts=start_ns + index * NS, stack_id=leak)
                  for index in range(count)])
    return leak


def test_a_recording_replays_to_the_live_ledger_with_the_agents_stack_ids(tmp_path):
    agent = FakeAgent()
    start = time.time_ns() + NS  # after the recording's checkpoint
    agent.stacks.intern(Stack((Frame("unused", "/x.py", 1),)))  # ids in the file are the agent's, not renumbered
    _leaky(agent, start, count=5)  # held before the recording starts: in its checkpoint
    recorder = FileRecorder(agent.session, tmp_path / "r.kvtrace", 60.0)
    recorder.start()
    leak = _leaky(agent, start + 10 * NS, address=0x900000)
    agent.apply(event(kind=Kind.FREE, api=Api.cuMemFree_v2, address=0x100000, size=MiB, ts=start + 50 * NS))
    recorder.stop()
    replayed = replay(tmp_path / "r.kvtrace")
    assert ledger_of(replayed.session) == ledger_of(agent.session)
    assert len(replayed.session.outstanding()) == 5 - 1 + 23
    assert replayed.session.stack(leak) == agent.session.stack(leak) and leak == 2
    assert replayed.events_replayed == 23 + 1
    assert replayed.session.process(200).title == "VLLM::Worker_TP0"


def test_the_replay_at_a_time_holds_what_was_held_then(tmp_path):
    agent = FakeAgent()
    start = time.time_ns() + NS  # after the recording's checkpoint
    recorder = FileRecorder(agent.session, tmp_path / "r.kvtrace", 60.0)
    recorder.start()
    _leaky(agent, start)
    recorder.stop()
    at_ns = start + 10 * NS  # allocations 0..10
    replayed = replay(tmp_path / "r.kvtrace", at_ns=at_ns)
    assert len(replayed.session.outstanding()) == 11
    assert replayed.at_ns == at_ns and replayed.stopped_at_time


def test_a_rotated_recording_starts_each_file_with_a_checkpoint(tmp_path):
    agent = FakeAgent()
    start = time.time_ns() + NS
    path = tmp_path / "r.kvtrace"
    recorder = FileRecorder(agent.session, path, 60.0, max_bytes=600, keep=2)
    recorder.start()
    for round_number in range(6):
        _leaky(agent, start + round_number * 100 * NS, count=50, address=0x100000000 * (round_number + 1))
        time.sleep(1.1)  # the recorder checks the size once a flush
    recorder.stop()
    assert recorder.rotations_total >= 2
    assert path.with_name("r.kvtrace.1").exists() and path.with_name("r.kvtrace.2").exists()
    assert not path.with_name("r.kvtrace.3").exists()  # keep=2
    # Each file alone replays to the ledger of its time: the newest to the live one.
    assert ledger_of(replay(path).session) == ledger_of(agent.session)
    older = replay(path.with_name("r.kvtrace.1"))
    assert 0 < len(older.session.outstanding()) < 6 * 50


def test_a_resync_writes_a_checkpoint_so_the_replay_stays_exact(tmp_path):
    agent = FakeAgent()
    start = time.time_ns() + NS  # after the recording's checkpoint
    recorder = FileRecorder(agent.session, tmp_path / "r.kvtrace", 60.0)
    recorder.start()
    _leaky(agent, start)
    agent.lose(3)
    kept = [entry for entry in agent.session.outstanding() if entry.key.address % (2 * MiB) == 0]
    agent.session.resync(kept)  # the kernel's exact copy: some frees were in the lost events
    recorder.stop()
    assert ledger_of(replay(tmp_path / "r.kvtrace").session) == ledger_of(agent.session)


def test_record_then_every_report_reads_the_file_as_it_read_the_agent(tmp_path):
    """`kvtrace record` over the real API while events arrive; then snapshot, ps and leaks from the
    file equal what the agent answered at the same moment."""
    agent = FakeAgent()
    start = time.time_ns() + NS
    _leaky(agent, start, count=7)
    output = tmp_path / "gpu.kvtrace"
    with served(agent) as (server, _):
        socket = str(server.config.admin_path)

        def feed():
            time.sleep(0.5)
            _leaky(agent, start + 100 * NS, address=0x10000000)
            agent.apply(event(kind=Kind.FREE, api=Api.cuMemFree_v2, address=0x100000, size=MiB, ts=start + 150 * NS))

        feeder = threading.Thread(target=feed)
        feeder.start()
        assert run_cli("record", "-o", str(output), "--duration", "2", "--socket", socket)[0] == 0
        feeder.join()
        live = {name: run_cli(*argv, "--socket", socket)[1] for name, argv in (
            ("snapshot", ("snapshot", "--json")), ("ps", ("ps", "--json")))}
    replayed = {name: run_cli(*argv, "--input", str(output))[1] for name, argv in (
        ("snapshot", ("snapshot", "--json")), ("ps", ("ps", "--json")))}
    assert live["snapshot"].count("\n") == 7 - 1 + 23
    assert replayed == live


def test_leaks_from_a_recording_name_the_same_suspects(tmp_path):
    agent = FakeAgent()
    start = time.time_ns() + NS
    recorder = FileRecorder(agent.session, tmp_path / "r.kvtrace", 60.0)
    recorder.start()
    _leaky(agent, start)
    recorder.stop()
    at_ns = start + 22 * NS  # the last allocation: the end of the recording
    agent.freeze_clock(at_ns)
    with served(agent) as (server, _):
        _, live = run_cli("leaks", "--json", "--min-age", "0", "--socket", str(server.config.admin_path))
    _, replayed = run_cli("leaks", "--json", "--min-age", "0", "--input", str(tmp_path / "r.kvtrace"),
                          "--at", f"@{at_ns // NS}.{at_ns % NS:09d}")
    live_report, replayed_report = json.loads(live), json.loads(replayed)
    assert live_report["suspects"][0]["stack"][0]["function"] == "leak_kv"
    for report in (live_report, replayed_report):
        for suspect in report["suspects"]:
            suspect.pop("growth_bytes_per_second")  # sampled on the agent's clock, not the file's
    assert replayed_report == live_report


def test_tail_reads_the_recorded_events_through_the_servers_filter(tmp_path):
    agent = FakeAgent()
    start = time.time_ns() + NS  # after the recording's checkpoint
    recorder = FileRecorder(agent.session, tmp_path / "r.kvtrace", 60.0)
    recorder.start()
    _leaky(agent, start)
    agent.apply(event(pid=100, address=0x5, ts=start + 60 * NS))
    recorder.stop()
    code, out = run_cli("tail", "--json", "--input", str(tmp_path / "r.kvtrace"), "-p", "200")
    lines = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and len(lines) == 23 and {line["pid"] for line in lines} == {200}
    code, out = run_cli("tail", "--json", "--stacks", "--input", str(tmp_path / "r.kvtrace"))
    assert len(out.splitlines()) == 24 and json.loads(out.splitlines()[0])["stack"][0]["function"] == "leak_kv"


class WorkloadNames:
    """The live agent's symbolizer while the process lives: `forget` (its exit) makes it unreadable."""

    CALLER = 0x5652_0000_120F
    NAME = NativeFrame("/opt/app/workload", "main", 0x20F)

    def __init__(self) -> None:
        self.gone: set[int] = set()

    def symbolize(self, pid: int, address: int) -> NativeFrame:
        if pid in self.gone or address != self.CALLER:
            return NativeFrame("", "", address)
        return self.NAME

    def forget(self, pid: int) -> None:
        self.gone.add(pid)


def test_a_recording_keeps_the_names_of_native_callers(tmp_path):
    """A native caller is named in the file as the live agent named it (checkpoint and events alike),
    and read back where nothing could name it any more (no process, no /proc/PID/maps)."""
    names = WorkloadNames()
    agent = FakeAgent(native_names=names)
    start = time.time_ns() + NS
    caller = WorkloadNames.CALLER
    agent.apply(event(address=0x100000, ts=start, caller_address=caller))  # in the checkpoint
    recorder = FileRecorder(agent.session, tmp_path / "r.kvtrace", 60.0)
    recorder.start()
    agent.apply(*[event(address=0x200000 + index * MiB, ts=start + (index + 1) * NS, caller_address=caller)
                  for index in range(3)],
                event(pid=100, address=0x900000, ts=start + 5 * NS, caller_address=0x7777))  # nothing names it
    recorder.stop()
    agent.freeze_clock(start + 5 * NS)
    with served(agent) as (server, _):
        _, live = run_cli("leaks", "--min-age", "0", "--socket", str(server.config.admin_path))
    assert "called CUDA from /opt/app/workload main+0x20f" in live
    replayed = replay(tmp_path / "r.kvtrace")
    assert replayed.session.native_caller(200, caller) == WorkloadNames.NAME
    assert replayed.session.native_caller(100, 0x7777) == NativeFrame("", "", 0x7777)
    _, out = run_cli("leaks", "--min-age", "0", "--input", str(tmp_path / "r.kvtrace"))
    assert "called CUDA from /opt/app/workload main+0x20f" in out and "0x5652" not in out
    frames = [frame for frame in RecordingReader.open(tmp_path / "r.kvtrace").frames()
              if frame.WhichOneof("record") == "native_caller"]
    assert [(frame.native_caller.pid, frame.native_caller.address) for frame in frames] == [(200, caller)]


def test_a_flight_recorder_dump_names_native_callers(tmp_path):
    from kvtrace.reports.flight import FlightOptions, FlightRecorder

    agent = FakeAgent(native_names=WorkloadNames())
    flight = FlightRecorder(agent.session, FlightOptions(directory=tmp_path), 60.0)
    flight.start()
    try:
        start = time.time_ns() + NS
        agent.apply(event(address=0x100000, ts=start, caller_address=WorkloadNames.CALLER))
        agent.apply(*[event(address=0x200000 + index * MiB, ts=start + (index + 1) * NS,
                            caller_address=WorkloadNames.CALLER) for index in range(3)])
        dump = flight.request(service_pb2.FLIGHT_TRIGGER_KIND_REQUEST, "test")
    finally:
        flight.stop()
    _, out = run_cli("leaks", "--min-age", "0", "--input", dump.path)
    assert "called CUDA from /opt/app/workload main+0x20f" in out and "0x5652" not in out


def test_reading_a_recording_prints_nothing_of_grpcs_own(tmp_path):
    """A fresh process, as an operator runs it, with a path relative to its directory: stderr holds
    kvtrace's lines only (no "authority-based URIs not supported", no "Got goaway"), even where
    GRPC_VERBOSITY is set but empty, so that what is asserted is not only the quieter default."""
    agent = FakeAgent()
    recorder = FileRecorder(agent.session, tmp_path / "rel.kvtrace", 60.0)
    recorder.start()
    _leaky(agent, time.time_ns() + NS, count=3)
    recorder.stop()
    environ = {**os.environ, "GRPC_VERBOSITY": "", "PYTHONPATH": os.pathsep.join(sys.path)}
    for command in ("tail", "ps", "leaks", "top", "ps"):  # ps twice: stop(0)'s GOAWAY was logged 1 time in 3
        result = subprocess.run([sys.executable, "-m", "kvtrace.cli.main", command, "--input", "rel.kvtrace"],
                                cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip()
        assert all(line.startswith("kvtrace: ") for line in result.stderr.splitlines()), (command, result.stderr)


def test_a_bad_recording_is_one_clear_line(tmp_path, capsys):
    path = tmp_path / "notes.txt"
    path.write_text("hello")
    assert main(["leaks", "--input", str(path)]) == 2
    assert "is not a kvtrace recording" in capsys.readouterr().err
    assert main(["ps", "--input", str(tmp_path / "missing.kvtrace")]) == 2
    assert "cannot read" in capsys.readouterr().err


@pytest.mark.parametrize(("text", "field", "value"), [
    ("end", "end", True), ("+90s", "after_start_ns", 90 * NS), ("+2m", "after_start_ns", 120 * NS),
    ("@1764660000.5", "wall_ns", 1764660000_500_000_000),
])
def test_at_takes_times_people_write(text, field, value):
    assert getattr(parse_at(text), field) == value


def test_at_refuses_what_is_not_a_time():
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match="not a time: 'yesterday'"):
        parse_at("yesterday")


def test_an_exit_says_how_much_memory_it_freed():
    agent = FakeAgent()
    agent.apply(event(address=0x1, size=3 * MiB), event(address=0x2, size=MiB))
    exit_event = Event(kind=Kind.PROCESS_EXIT, api=Api.process_exit, pid=200, tid=200,
                       timestamp_ns=time.time_ns(), error_code=9)
    agent.apply(exit_event)
    assert exit_event.freed_bytes == 4 * MiB


# ---- exports from a recording ----

def _recorded(tmp_path) -> tuple[FakeAgent, Path]:
    agent = FakeAgent()
    start = time.time_ns() + NS
    recorder = FileRecorder(agent.session, tmp_path / "r.kvtrace", 60.0)
    recorder.start()
    _leaky(agent, start)
    agent.apply(event(pid=100, address=0x5, size=3 * MiB, ts=start + 60 * NS))
    agent.apply(event(kind=Kind.FREE, api=Api.cuMemFree_v2, address=0x100000, size=MiB, ts=start + 61 * NS))
    recorder.stop()
    return agent, tmp_path / "r.kvtrace"


def test_a_flame_graph_from_a_recording_is_the_live_one(tmp_path):
    agent, path = _recorded(tmp_path)
    with served(agent) as (server, _):
        _, live = run_cli("flamegraph", "--socket", str(server.config.admin_path))
    code, replayed = run_cli("flamegraph", "--input", str(path))
    assert code == 0 and replayed == live
    assert replayed.splitlines() == [
        "pid 100 VLLM::EngineCore;GPU 0;[no Python stack];[cuMemAlloc_v2] 3145728",
        f"pid 200 VLLM::Worker_TP0;GPU 0;step (/app/serve.py:40);leak_kv (/app/leak.py:12);[cuMemAlloc_v2] {22 * MiB}",
    ]
    code, _ = run_cli("flamegraph", "--input", str(path), "-o", str(tmp_path / "held.json"))
    document = json.loads((tmp_path / "held.json").read_text())
    assert code == 0 and [sum(profile["weights"]) for profile in document["profiles"]] == [3 * MiB, 22 * MiB]


def test_a_perfetto_trace_of_a_recording_has_every_call(tmp_path, capsys):
    _, path = _recorded(tmp_path)
    assert main(["perfetto", "--input", str(path), "-o", str(tmp_path / "r.pftrace")]) == 0
    err = capsys.readouterr().err
    assert "wrote" in err and "25 events, 25 calls" in err  # 23 + 1 allocations and 1 free
    assert (tmp_path / "r.pftrace").stat().st_size > 0
    assert main(["perfetto", "-o", str(tmp_path / "x.pftrace")]) == 2
    assert "--input FILE, or --duration" in capsys.readouterr().err


# ---- what the review asked for ----

def test_a_recording_that_could_not_keep_up_is_exact_again_after_its_checkpoint(tmp_path):
    """A queue of 5 and a burst of 20 allocations: 15 are dropped (a `dropped_count` marker, not the
    kernel's), and the first event that finds room brings a checkpoint, so the replay ends exact."""
    from kvtrace.reports.recorder import FrameEncoder, RecordQueue, recording_header

    agent = FakeAgent()
    queue = RecordQueue(agent.session, max_records=5)
    checkpoint = agent.session.subscribe(queue)
    start = time.time_ns() + NS
    _leaky(agent, start, count=20)
    assert queue.dropped_total == 15
    taken = queue.take(100, 0)  # the reader catches up
    agent.apply(*[event(kind=Kind.FREE, api=Api.cuMemFree_v2, address=0x100000 + index * MiB, size=MiB,
                        ts=start + (30 + index) * NS) for index in range(3)])
    taken += queue.take(100, 0)
    encoder = FrameEncoder(agent.session.stack, agent.session.process)
    writer = RecordingWriter.create(tmp_path / "r.kvtrace", recording_header(0.0, 60.0, checkpoint.timestamp_ns))
    for frame in [*encoder.checkpoint(checkpoint), *(f for record in taken for f in encoder.record(record))]:
        writer.write(frame)
    writer.close()
    replayed = replay(tmp_path / "r.kvtrace")
    assert ledger_of(replayed.session) == ledger_of(agent.session) and len(agent.session.outstanding()) == 17
    losses = [f.event.events_lost for f in RecordingReader.open(tmp_path / "r.kvtrace").frames()
              if f.HasField("event") and f.event.HasField("events_lost")]
    assert [(lost.dropped_count, lost.kernel_lost_count) for lost in losses] == [(15, 0)]


def test_a_time_outside_the_recording_is_read_at_its_edge_and_said(tmp_path, capsys):
    agent = FakeAgent()
    start = time.time_ns() + NS
    recorder = FileRecorder(agent.session, tmp_path / "r.kvtrace", 60.0)
    recorder.start()
    _leaky(agent, start)
    recorder.stop()
    code, out = run_cli("ps", "--json", "--input", str(tmp_path / "r.kvtrace"), "--at", "+3h")
    err = capsys.readouterr().err
    assert code == 0 and "is after the recording ends" in err and "read at its end" in err
    assert json.loads(out)["totals"][0]["object_count"] == 23
    replayed = replay(tmp_path / "r.kvtrace", at_ns=start + 3 * 3600 * NS)
    assert replayed.at_ns == start + 22 * NS  # its last event, not three hours on
    assert main(["ps", "--at", "+3h"]) == 2
    assert "--at reads a recording at a time: give the recording with --input FILE" in capsys.readouterr().err


def test_a_restarted_agent_keeps_the_recording_it_finds_as_file_1(tmp_path):
    agent = FakeAgent()
    path = tmp_path / "r.kvtrace"
    first = FileRecorder(agent.session, path, 60.0)
    first.start()
    _leaky(agent, time.time_ns() + NS)
    first.stop()
    second = FileRecorder(FakeAgent().session, path, 60.0)
    second.start()
    second.stop()
    assert len(replay(path.with_name("r.kvtrace.1")).session.outstanding()) == 23
    assert len(replay(path).session.outstanding()) == 0


def test_a_dump_holding_a_record_stamped_after_its_trigger_still_replays_to_the_trigger(tmp_path):
    """Events come a little out of order across CPUs: a record stamped after the failing call is in
    the ring when the dump is copied. The dump is read to its end: the ledger at the trigger."""
    from kvtrace.reports.flight import FlightOptions, FlightRecorder

    agent = FakeAgent()
    recorder = FlightRecorder(agent.session, FlightOptions(directory=tmp_path), 60.0)
    recorder.start()
    start = time.time_ns() - 10 * NS
    agent.apply(event(address=0x1, ts=start + NS), event(address=0x2, ts=start + 3 * NS),
                event(address=0x3, ts=start + 2 * NS - 1),
                event(kind=Kind.ALLOC_FAILED, address=0, size=1 << 40, error_code=2, ts=start + 2 * NS))
    recorder.stop()
    (path,) = tmp_path.glob("flight-*.kvtrace")
    replayed = replay(path)
    assert ledger_of(replayed.session) == ledger_of(agent.session) and len(agent.session.outstanding()) == 3


def test_the_group_socket_gets_no_recording():
    from kvtrace.client import AgentClient
    from kvtrace.errors import CommandError

    with served() as (server, _):
        with AgentClient(f"unix://{server.config.socket}") as client:
            with pytest.raises(CommandError, match="a recording holds stacks and addresses: use the admin socket"):
                next(iter(client.stream_recording()))


def test_tail_of_a_recording_reads_the_events_without_replaying_it(tmp_path, capsys):
    agent = FakeAgent()
    recorder = FileRecorder(agent.session, tmp_path / "r.kvtrace", 60.0)
    recorder.start()
    _leaky(agent, time.time_ns() + NS)
    recorder.stop()
    code, out = run_cli("tail", "--json", "--input", str(tmp_path / "r.kvtrace"))
    assert code == 0 and len(out.splitlines()) == 23
    assert "state at" not in capsys.readouterr().err  # no replay, no description of one


def test_a_process_stopped_with_sigterm_holding_memory_is_no_death_to_dump(tmp_path):
    from kvtrace.reports.flight import FlightOptions, FlightRecorder

    agent = FakeAgent()
    recorder = FlightRecorder(agent.session, FlightOptions(directory=tmp_path), 60.0)
    recorder.start()
    agent.apply(event(address=0x1), Event(kind=Kind.PROCESS_EXIT, api=Api.process_exit, pid=200, tid=200,
                                          timestamp_ns=time.time_ns(), error_code=15))
    agent.apply(event(pid=300, address=0x1), Event(kind=Kind.PROCESS_EXIT, api=Api.process_exit, pid=300,
                                                   tid=300, timestamp_ns=time.time_ns(), error_code=9))
    recorder.stop()
    assert [path.name.split("-")[3] for path in tmp_path.glob("flight-*.kvtrace")] == ["died"]


def test_events_stamped_before_the_recording_started_still_replay_exactly(tmp_path):
    """The probes stamp a call when it returns; the agent ingests it a little later, so the first events
    a recording gets can be older than its checkpoint. They apply after it, as the agent applied them."""
    agent = FakeAgent()
    recorder = FileRecorder(agent.session, tmp_path / "r.kvtrace", 60.0)
    recorder.start()
    _leaky(agent, time.time_ns() - 30 * NS)  # stamped up to 30 s before the checkpoint
    recorder.stop()
    replayed = replay(tmp_path / "r.kvtrace")
    assert ledger_of(replayed.session) == ledger_of(agent.session) and len(agent.session.outstanding()) == 23
