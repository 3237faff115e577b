"""The flight recorder: GIVEN the agent's Session with a FlightRecorder as a sink, WHEN something goes
wrong (an out-of-memory failure, a death holding GPU memory, a near time-to-OOM, a request), THEN one
dump holds exactly the last window of records, replays to the ledger at the trigger, and the dumps on
disk stay private and bounded."""
import dataclasses
import io
import json
import threading
import time
from contextlib import redirect_stdout
from pathlib import Path

import grpc
import pytest

from fake_agent import FakeAgent, MiB, event, own_group, served, short_directory
from kvtrace._proto.kvtrace.v1 import agent_service_pb2 as service_pb2
from kvtrace._proto.kvtrace.v1 import agent_service_pb2_grpc as service_grpc
from kvtrace.cli.main import main
from kvtrace.config import ApiConfig
from kvtrace.model.depth import Depth, DepthCause, ProcessDepth
from kvtrace.model.events import Api, Event, Kind, Layer, Memory, ObjectKind
from kvtrace.model.findings import AnalysisSnapshot, ProcessGpu
from kvtrace.model.ledger import Ledger, LedgerReadRefused
from kvtrace.model.stacks import Frame, Stack
from kvtrace.reports.flight import FlightDumpError, FlightOptions, FlightRecorder, _Pending
from kvtrace.reports.recording import RecordingReader
from kvtrace.reports.replay import replay
from kvtrace.servers.api.server import AgentServer

NS = 1_000_000_000
OOM = service_pb2.FLIGHT_TRIGGER_KIND_OUT_OF_MEMORY
DIED = service_pb2.FLIGHT_TRIGGER_KIND_PROCESS_DIED
TIME_TO_OOM = service_pb2.FLIGHT_TRIGGER_KIND_TIME_TO_OOM
REQUEST = service_pb2.FLIGHT_TRIGGER_KIND_REQUEST


@pytest.fixture
def recorders():
    """Makes FlightRecorders on a FakeAgent's Session; each is stopped (its writer joined) at the end."""
    started: list[FlightRecorder] = []

    def make(agent: FakeAgent, directory: Path, **options) -> FlightRecorder:
        recorder = FlightRecorder(agent.session, FlightOptions(directory=directory, **options), 60.0)
        recorder.start()
        started.append(recorder)
        return recorder

    yield make
    for recorder in started:
        recorder.stop()


def dump_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("flight-*.kvtrace"))


def written(recorder: FlightRecorder) -> list[Path]:
    """The dumps once the writer is done: stop() joins it after every dump already triggered."""
    recorder.stop()
    return dump_files(recorder.options.directory)


def wait_for_dumps(recorder: FlightRecorder, count: int, timeout_seconds: float = 5.0) -> list[Path]:
    """The dumps once `count` are written, the recorder running on. A file appears when its writing
    starts: the recorder's count, not the directory, says when it is whole."""
    deadline = time.monotonic() + timeout_seconds
    while recorder.dumps_total < count:
        assert time.monotonic() < deadline, f"no {count} dumps written within {timeout_seconds} s"
        time.sleep(0.01)
    return dump_files(recorder.options.directory)


def ledger_of(session, mapped: bool = False) -> list:
    return sorted((entry.key, entry.size_bytes, entry.stack_id, entry.timestamp_ns)
                  + ((entry.mapped_count,) if mapped else ()) for entry in session.outstanding())


def leaky(agent: FakeAgent, start_ns: int, count: int = 23, spacing_ns: int = NS,
          address: int = 0x100000) -> int:
    """`count` allocations of 1 MiB by pid 200, `spacing_ns` apart, from `leak_kv`."""
    leak = agent.session.intern_stack(Stack((Frame("leak_kv", "/app/leak.py", 12),
                                             Frame("step", "/app/serve.py", 40))))
    agent.apply(*[event(address=address + index * MiB, ts=start_ns + index * spacing_ns, stack_id=leak)
                  for index in range(count)])
    return leak


def out_of_memory(ts: int, error_code: int = 2, pid: int = 200) -> Event:
    return event(kind=Kind.ALLOC_FAILED, pid=pid, address=0, size=64 * MiB, ts=ts, error_code=error_code)


def process_exit(pid: int, ts: int, status: int) -> Event:
    return Event(kind=Kind.PROCESS_EXIT, api=Api.process_exit, pid=pid, tid=pid, timestamp_ns=ts,
                 error_code=status)


def frames_of(path: Path) -> list[service_pb2.RecordingFrame]:
    with RecordingReader.open(path) as reader:
        return list(reader.frames())


def header_of(path: Path) -> service_pb2.RecordingHeader:
    with RecordingReader.open(path) as reader:
        return reader.header


def allocation_events(path: Path, kind: Kind = Kind.ALLOC) -> list:
    return [frame.event for frame in frames_of(path)
            if frame.WhichOneof("record") == "event" and frame.event.HasField("allocation")
            and frame.event.allocation.kind == kind.value]


def checkpoints_of(path: Path) -> list[service_pb2.RecordingCheckpoint]:
    return [frame.checkpoint for frame in frames_of(path) if frame.WhichOneof("record") == "checkpoint"]


# ---- 1: an out-of-memory failure ----

def test_given_23_leaking_allocations_when_one_fails_out_of_memory_then_one_dump_replays_to_the_trigger(
        tmp_path, recorders):
    agent = FakeAgent()
    recorder = recorders(agent, tmp_path)
    start = time.time_ns() - 60 * NS
    leaky(agent, start)
    agent.apply(out_of_memory(start + 23 * NS))
    live = ledger_of(agent.session)
    (path,) = written(recorder)

    trigger = header_of(path).trigger
    assert trigger.kind == OOM and trigger.pid == 200 and trigger.device == 0
    assert trigger.timestamp_ns == start + 23 * NS
    assert trigger.reason == ("cuMemAlloc_v2 of 64.0 MiB failed with out of memory (error 2) in pid 200 "
                              "VLLM::Worker_TP0")
    assert path.name.endswith("-oom-200.kvtrace")
    replayed = replay(path)
    assert replayed.at_ns == trigger.timestamp_ns
    assert ledger_of(replayed.session) == live and len(live) == 23
    (suspect,) = replayed.analyzer.leak_report(min_age_seconds=0).suspects
    assert suspect.stack is not None and suspect.stack.frames[0].function == "leak_kv"
    assert (suspect.pid, suspect.count, suspect.outstanding_bytes) == (200, 23, 23 * MiB)
    assert recorder.dumps_total == 1 and agent.session.counters()["flight_dumps"] == 1


def test_a_failure_that_is_not_out_of_memory_writes_no_dump(tmp_path, recorders):
    agent = FakeAgent()
    recorder = recorders(agent, tmp_path)
    start = time.time_ns() - 60 * NS
    leaky(agent, start)
    agent.apply(out_of_memory(start + 23 * NS, error_code=1))  # cudaErrorInvalidValue
    assert written(recorder) == []


def test_the_dump_holds_exactly_the_last_window_and_what_came_before_through_its_first_checkpoint(
        tmp_path, recorders):
    """31 allocations 1 s apart (t = 0..30 s), the failure at 31 s, a 10 s window: the ring keeps the
    records of 21..31 s and let go of those of 0..20 s, which the first checkpoint holds; the dump's
    events are the allocations of 21..30 s and the failure."""
    agent = FakeAgent()
    recorder = recorders(agent, tmp_path, window_seconds=10)
    start = time.time_ns() - 60 * NS
    leaky(agent, start, count=31)
    agent.apply(out_of_memory(start + 31 * NS))
    live = ledger_of(agent.session)
    (path,) = written(recorder)

    allocations = allocation_events(path)
    assert [message.timestamp_ns for message in allocations] == [start + second * NS for second in range(21, 31)]
    assert len(allocation_events(path, Kind.ALLOC_FAILED)) == 1
    first, last = checkpoints_of(path)
    assert sorted(entry.timestamp_ns for entry in first.allocations) == [start + second * NS for second in range(21)]
    assert first.timestamp_ns == start + 20 * NS and header_of(path).start_time_ns == start + 20 * NS
    assert len(last.allocations) == 31 and last.timestamp_ns == start + 31 * NS
    assert header_of(path).trigger.window_seconds == pytest.approx(11.0)  # from just after the last let go
    assert recorder.dumps()[0].event_count == 10 + 1
    replayed = replay(path)
    assert ledger_of(replayed.session) == live and len(live) == 31  # 21 from the checkpoint, 10 replayed
    assert replayed.events_replayed == 10 + 1


def test_a_vmm_handle_mapped_inside_the_window_replays_exactly_at_the_trigger(tmp_path, recorders):
    """The first checkpoint holds the handle as it is at the trigger (mapped once) and the window
    maps it again: only the last checkpoint, read at the trigger, makes the count right."""
    agent = FakeAgent()
    recorder = recorders(agent, tmp_path, window_seconds=10)
    start = time.time_ns() - 60 * NS
    agent.apply(event(kind=Kind.ALLOC, api=Api.cuMemCreate, layer=Layer.VMM, obj=ObjectKind.VMM_HANDLE,
                      address=0x77, size=2 * MiB, ts=start))
    leaky(agent, start + NS, count=29)
    agent.apply(event(kind=Kind.MAP, api=Api.cuMemMap, layer=Layer.VMM, obj=ObjectKind.VMM_MAPPING,
                      memory=Memory.NONE, address=0x7000000000, handle=0x77, size=2 * MiB, ts=start + 31 * NS),
                out_of_memory(start + 37 * NS))
    live = ledger_of(agent.session, mapped=True)
    (path,) = written(recorder)
    replayed = replay(path)
    assert not replayed.stopped_at_time
    assert ledger_of(replayed.session, mapped=True) == live
    assert [entry for entry in live if entry[4]] == [entry for entry in live if entry[0].address == 0x77]


# ---- 2: the ring's bound ----

def test_the_ring_keeps_at_most_max_records_and_the_dump_still_replays_exactly(tmp_path, recorders):
    agent = FakeAgent()
    recorder = recorders(agent, tmp_path, max_records=1000)
    start = time.time_ns() - 60 * NS
    leaky(agent, start, count=1009, spacing_ns=1_000_000)  # all within the 120 s window
    dump = recorder.request(REQUEST, "test")
    assert dump.event_count == 1000  # the ring held 1000; the 9 it let go of are in the first checkpoint
    first, last = checkpoints_of(Path(dump.path))
    assert len(first.allocations) == 1009 - 1000 and len(last.allocations) == 1009
    assert ledger_of(replay(Path(dump.path)).session) == ledger_of(agent.session)


def test_a_full_ring_lets_its_oldest_go_as_runs_come_and_the_dump_still_replays_exactly(tmp_path, recorders):
    agent = FakeAgent()
    recorder = recorders(agent, tmp_path, max_records=1000)
    start = time.time_ns() - 60 * NS
    leaky(agent, start, count=600, spacing_ns=1_000_000)
    leaky(agent, start + 600 * 1_000_000, count=409, spacing_ns=1_000_000, address=0x100000 + 600 * MiB)
    dump = recorder.request(REQUEST, "test")
    assert dump.event_count == 1000
    first, last = checkpoints_of(Path(dump.path))
    assert len(first.allocations) == 9 and len(last.allocations) == 1009
    assert ledger_of(replay(Path(dump.path)).session) == ledger_of(agent.session)


# ---- 3: cooldown ----

def test_a_second_out_of_memory_within_the_cooldown_writes_no_second_dump(tmp_path, recorders):
    agent = FakeAgent()
    recorder = recorders(agent, tmp_path)  # cooldown 60 s
    start = time.time_ns() - 60 * NS
    leaky(agent, start)
    agent.apply(out_of_memory(start + 23 * NS), out_of_memory(start + 24 * NS))
    agent.apply(process_exit(200, start + 25 * NS, 9))  # another kind: its own cooldown
    files = written(recorder)
    assert [header_of(path).trigger.kind for path in files] == [OOM, DIED]  # named by their trigger's time
    assert header_of(files[0]).trigger.timestamp_ns == start + 23 * NS


def test_without_a_cooldown_each_out_of_memory_dumps(tmp_path, recorders):
    agent = FakeAgent()
    recorder = recorders(agent, tmp_path, cooldown_seconds=0)
    start = time.time_ns() - 60 * NS
    leaky(agent, start)
    agent.apply(out_of_memory(start + 23 * NS), out_of_memory(start + 24 * NS))
    files = written(recorder)
    assert len(files) == 2  # same second, same pid: the second is named .1
    assert sorted(header_of(path).trigger.timestamp_ns for path in files) == [start + 23 * NS, start + 24 * NS]


# ---- 4: a process that dies holding memory ----

@pytest.mark.parametrize(("status", "how"), [(9, "killed by signal 9"), (1 << 8, "exited with status 1")])
def test_a_process_that_dies_holding_memory_dumps_what_it_held(tmp_path, recorders, status, how):
    agent = FakeAgent()
    recorder = recorders(agent, tmp_path)
    start = time.time_ns() - 60 * NS
    leaky(agent, start)
    held = ledger_of(agent.session)
    agent.apply(process_exit(200, start + 23 * NS, status))
    assert ledger_of(agent.session) == []  # the exit dropped it all
    (path,) = wait_for_dumps(recorder, 1)

    trigger = header_of(path).trigger
    assert (trigger.kind, trigger.pid, trigger.device) == (DIED, 200, -1)
    assert trigger.reason == f"pid 200 VLLM::Worker_TP0 {how} holding 23.0 MiB of GPU memory"
    assert path.name.endswith("-died-200.kvtrace")
    replayed = replay(path)  # at its trigger: just before the exit took effect
    assert ledger_of(replayed.session) == held and len(held) == 23
    assert len(written(recorder)) == 1


def test_the_daemon_can_wait_for_a_deaths_checkpoint_to_be_read_before_the_probes_go(tmp_path, recorders,
                                                                                   monkeypatch):
    # GIVEN a writer held back before it reads a death's checkpoint (on its own thread, from the kernel's maps)
    let_read = threading.Event()
    read_checkpoints = _Pending.checkpoints

    def held_back(pending):
        let_read.wait(10)
        return read_checkpoints(pending)

    monkeypatch.setattr(_Pending, "checkpoints", held_back)
    agent = FakeAgent()
    recorder = recorders(agent, tmp_path)
    start = time.time_ns() - 60 * NS
    leaky(agent, start)
    assert recorder.wait_reads(0)  # nothing queued
    agent.apply(process_exit(200, start + 23 * NS, 9))
    # THEN waiting for its reads times out while it has not read, and returns once it has
    assert not recorder.wait_reads(0.2)
    let_read.set()
    assert recorder.wait_reads(10)
    assert len(wait_for_dumps(recorder, 1)) == 1


def test_a_clean_exit_or_a_death_holding_nothing_writes_no_dump(tmp_path, recorders):
    agent = FakeAgent()
    recorder = recorders(agent, tmp_path, cooldown_seconds=0)
    start = time.time_ns() - 60 * NS
    leaky(agent, start)
    agent.apply(event(pid=100, address=0x5, ts=start), process_exit(100, start + NS, 0))  # held, status 0
    agent.apply(process_exit(300, start + 2 * NS, 1 << 8))  # held nothing
    agent.session.forget_process(400)  # found gone: status 0, held nothing
    assert written(recorder) == []


# ---- 5: a dump on request ----

def test_a_request_dumps_even_within_the_cooldown_and_lists_newest_first(tmp_path, recorders):
    agent = FakeAgent()
    recorder = recorders(agent, tmp_path)
    start = time.time_ns() - 60 * NS
    leaky(agent, start)
    agent.apply(out_of_memory(start + 23 * NS))
    wait_for_dumps(recorder, 1)
    dump = recorder.request(REQUEST, "before the driver upgrade")
    path = Path(dump.path)
    assert path.parent == tmp_path and path.exists() and path.name.endswith("-request.kvtrace")
    assert dump.size_bytes == path.stat().st_size
    assert dump.event_count == 24  # 23 allocations and the failure: the ring let go of nothing
    assert dump.trigger.kind == REQUEST and dump.trigger.reason == "before the driver upgrade"
    second = recorder.request(REQUEST, "again")
    assert [listed.path for listed in recorder.dumps()] == [second.path, dump.path, str(dump_files(tmp_path)[0])]
    assert [listed.trigger.kind for listed in recorder.dumps()] == [REQUEST, REQUEST, OOM]
    assert ledger_of(replay(path).session) == ledger_of(agent.session)


def test_a_restarted_agent_lists_the_dumps_it_finds_from_their_headers(tmp_path, recorders):
    agent = FakeAgent()
    dump = recorders(agent, tmp_path).request(REQUEST, "first agent")
    (listed,) = recorders(FakeAgent(), tmp_path).dumps()
    assert (listed.path, listed.size_bytes, listed.trigger.reason) == (dump.path, dump.size_bytes, "first agent")


# ---- 6: bounds on disk ----

def test_at_most_max_dumps_stay_the_oldest_removed(tmp_path, recorders):
    agent = FakeAgent()
    recorder = recorders(agent, tmp_path, max_dumps=2)
    dumps = []
    for number in range(3):
        dumps.append(recorder.request(REQUEST, f"dump {number}"))
        time.sleep(0.05)  # distinct mtimes, whatever the file system's clock granularity
    assert [str(path) for path in dump_files(tmp_path)] == sorted(dump.path for dump in dumps[1:])
    assert [listed.trigger.reason for listed in recorder.dumps()] == ["dump 2", "dump 1"]


def test_at_most_max_total_bytes_stay_the_oldest_removed(tmp_path, recorders):
    agent = FakeAgent()
    leaky(agent, time.time_ns() - 60 * NS)
    size = recorders(agent, tmp_path / "probe").request(REQUEST, "dump 0").size_bytes
    recorder = recorders(agent, tmp_path / "bounded", max_total_bytes=2 * size + size // 2)
    dumps = []
    for number in range(3):
        dumps.append(recorder.request(REQUEST, f"dump {number}"))
        assert abs(dumps[-1].size_bytes - size) < size // 10  # compression varies by a byte or two
        time.sleep(0.05)
    assert [str(path) for path in dump_files(tmp_path / "bounded")] == sorted(dump.path for dump in dumps[1:])


# ---- 7: a forecast out of memory ----

def snapshot_with(time_to_oom_seconds: float | None) -> AnalysisSnapshot:
    row = ProcessGpu(pid=200, title="VLLM::Worker_TP0", device=3, outstanding_bytes=23 * MiB, nvml_used_bytes=None,
                     unattributed_bytes=None, growth_bytes_per_second_1m=MiB, growth_bytes_per_second_15m=MiB,
                     time_to_oom_seconds=time_to_oom_seconds, allocations_1m=23, frees_1m=0, free_ratio_1m=0.0)
    quiet = ProcessGpu(pid=100, title="VLLM::EngineCore", device=0, outstanding_bytes=MiB, nvml_used_bytes=None,
                       unattributed_bytes=None, growth_bytes_per_second_1m=0.0, growth_bytes_per_second_15m=0.0,
                       time_to_oom_seconds=None, allocations_1m=1, frees_1m=0, free_ratio_1m=0.0)
    return AnalysisSnapshot(timestamp_ns=time.time_ns(), processes=(quiet, row))


def test_a_time_to_oom_under_the_threshold_dumps(tmp_path, recorders):
    agent = FakeAgent()
    recorder = recorders(agent, tmp_path)  # threshold 300 s
    leaky(agent, time.time_ns() - 60 * NS)
    snapshot = snapshot_with(120.0)
    recorder.check(snapshot)
    recorder.check(snapshot_with(60.0))  # within the cooldown
    (path,) = written(recorder)
    trigger = header_of(path).trigger
    assert (trigger.kind, trigger.pid, trigger.device, trigger.timestamp_ns) == (
        TIME_TO_OOM, 200, 3, snapshot.timestamp_ns)
    assert trigger.reason == "pid 200 VLLM::Worker_TP0: GPU 3 forecast out of memory in 120 s (threshold 300 s)"
    assert ledger_of(replay(path).session) == ledger_of(agent.session)


@pytest.mark.parametrize(("threshold", "time_to_oom"), [(300.0, 301.0), (300.0, None), (0.0, 1.0)])
def test_a_time_to_oom_above_the_threshold_or_with_no_threshold_writes_no_dump(
        tmp_path, recorders, threshold, time_to_oom):
    recorder = recorders(FakeAgent(), tmp_path, time_to_oom_seconds=threshold)
    recorder.check(snapshot_with(time_to_oom))
    recorder.check(None)
    assert written(recorder) == []


# ---- 8: a resync restarts the window ----

def test_a_resync_restarts_the_window_and_a_dump_after_it_replays_exactly(tmp_path, recorders):
    agent = FakeAgent()
    recorder = recorders(agent, tmp_path)
    start = time.time_ns() - 60 * NS
    leaky(agent, start)
    agent.lose(3)
    kept = [entry for entry in agent.session.outstanding() if entry.key.address % (2 * MiB) == 0]
    agent.session.resync(kept)  # the kernel's exact copy: some frees were in the lost events
    after = time.time_ns()  # events after the resync are stamped after it, before the request
    leaky(agent, after, count=7, address=0x10000000, spacing_ns=1)
    dump = recorder.request(REQUEST, "after the resync")
    assert dump.event_count == 7  # only what came after the resync
    first, _ = checkpoints_of(Path(dump.path))
    assert len(first.allocations) == len(kept) and len(kept) == 11
    assert header_of(Path(dump.path)).start_time_ns < after
    assert ledger_of(replay(Path(dump.path)).session) == ledger_of(agent.session)


# ---- 9: the API and `kvtrace flight` ----

def run_cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with redirect_stdout(out):
        code = main(list(argv))
    return code, out.getvalue()


def test_kvtrace_flight_dumps_and_lists_through_the_admin_socket_only(tmp_path, recorders):
    agent = FakeAgent()
    recorder = recorders(agent, tmp_path / "flight")
    leaky(agent, time.time_ns() - 60 * NS)
    with short_directory() as directory:
        config = ApiConfig(socket=directory / "run" / "kvtrace.sock", group=own_group())
        server = AgentServer(agent.session, agent.analyzer, config, flight=recorder)
        server.start()
        try:
            admin = str(config.admin_path)
            code, out = run_cli("flight", "--dump", "--reason", "x", "--socket", admin)
            (path,) = dump_files(tmp_path / "flight")
            assert code == 0 and str(path) in out and "asked through the API: x" in out
            code, out = run_cli("flight", "--json", "--socket", admin)
            (listed,) = [json.loads(line) for line in out.splitlines()]
            assert code == 0 and listed["path"] == str(path) and listed["trigger"] == "request"
            assert listed["reason"] == "asked through the API: x" and listed["event_count"] == 23

            group = service_grpc.AgentServiceStub(grpc.insecure_channel(f"unix:{config.socket}"))
            for call, request in ((group.DumpFlightRecorder, service_pb2.DumpFlightRecorderRequest(reason="x")),
                                  (group.ListFlightDumps, service_pb2.ListFlightDumpsRequest())):
                with pytest.raises(grpc.RpcError) as refused:
                    call(request, timeout=10)
                assert refused.value.code() is grpc.StatusCode.PERMISSION_DENIED
                assert "use the admin socket" in refused.value.details()
            assert dump_files(tmp_path / "flight") == [path]
        finally:
            server.stop(grace_seconds=0)


def test_an_agent_without_a_flight_recorder_refuses_a_dump(capsys):
    with served() as (server, _):
        admin = service_grpc.AgentServiceStub(grpc.insecure_channel(f"unix:{server.config.admin_path}"))
        with pytest.raises(grpc.RpcError) as refused:
            admin.DumpFlightRecorder(service_pb2.DumpFlightRecorderRequest(), timeout=10)
        assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert main(["flight", "--dump", "--socket", str(server.config.admin_path)]) == 1
        assert "without a flight recorder" in capsys.readouterr().err
        assert admin.ListFlightDumps(service_pb2.ListFlightDumpsRequest(), timeout=10).dumps == []


# ---- 10: private files ----

def test_the_dump_directory_is_made_0700_and_dumps_are_0600(tmp_path, recorders):
    directory = tmp_path / "var" / "flight"
    recorder = recorders(FakeAgent(), directory)
    assert directory.stat().st_mode & 0o777 == 0o700
    dump = recorder.request(REQUEST, "private")
    assert Path(dump.path).stat().st_mode & 0o777 == 0o600


# ---- bounded work ----

def test_a_near_oom_of_each_process_dumps_for_each(tmp_path, recorders):
    agent = FakeAgent()
    recorder = recorders(agent, tmp_path)
    leaky(agent, time.time_ns() - 60 * NS)
    snapshot = snapshot_with(120.0)
    other = dataclasses.replace(snapshot.processes[1], pid=300, title="python train.py")
    recorder.check(dataclasses.replace(snapshot, processes=(*snapshot.processes, other)))
    assert sorted(path.name.rsplit("-", 1)[1] for path in written(recorder)) == ["200.kvtrace", "300.kvtrace"]


def test_while_the_writer_is_behind_no_more_ledger_copies_are_queued(tmp_path):
    """The writer thread is not started: 4 dumps wait; the 5th trigger copies nothing, is counted as a
    failure, and a request says to ask again."""
    from kvtrace.reports.flight import MAX_PENDING_DUMPS

    agent = FakeAgent()
    recorder = FlightRecorder(agent.session, FlightOptions(directory=tmp_path), 60.0)
    agent.session.add_sink(recorder)  # a sink, without its writer
    leaky(agent, time.time_ns() - 60 * NS)
    for _ in range(MAX_PENDING_DUMPS):
        recorder.request_soon(REQUEST, "queued")
    with pytest.raises(FlightDumpError, match="4 dumps are still being written; ask again in a moment"):
        recorder.request_soon(REQUEST, "one too many")
    agent.apply(out_of_memory(time.time_ns()))
    assert recorder.dump_failures_total == 2 and recorder._pending.qsize() == MAX_PENDING_DUMPS



def test_an_idle_agent_lets_go_of_a_past_burst_when_its_window_has_passed(tmp_path, recorders):
    """31 allocations at t = 0..30 s and then nothing: the ring lets go of what is older than the
    window at each expire (the agent calls it after every analysis), not only when a record comes, and
    a dump after that holds the allocations through its first checkpoint alone."""
    agent = FakeAgent()
    recorder = recorders(agent, tmp_path, window_seconds=10)
    start = time.time_ns() - 60 * NS
    leaky(agent, start, count=31)
    agent.session.wall_clock_ns = lambda: start + 35 * NS
    recorder.expire()
    assert [record.timestamp_ns for record in recorder._ring] == [start + second * NS for second in range(25, 31)]
    agent.session.wall_clock_ns = lambda: start + 45 * NS
    recorder.expire()
    assert not recorder._ring and recorder._let_go_ns == start + 30 * NS
    recorder.request(service_pb2.FLIGHT_TRIGGER_KIND_REQUEST, "a test")
    (path,) = written(recorder)
    assert allocation_events(path) == []
    first, _ = checkpoints_of(path)
    assert len(first.allocations) == 31


def test_a_dump_keeps_each_process_depth_as_it_stood_at_the_dump(tmp_path, recorders):
    # GIVEN pid 200 raised to blocks before the window (the ring keeps no history of depths)
    agent = FakeAgent()
    recorder = recorders(agent, tmp_path)
    start = time.time_ns() - 60 * NS
    depth = ProcessDepth(200, Depth.BLOCKS, start - 10 * NS, DepthCause.GROWTH, "traced bytes +96 MiB in 60 s")
    agent.session.set_process_depths({200: depth})
    leaky(agent, start)
    agent.apply(out_of_memory(start + 23 * NS))
    (path,) = written(recorder)
    # THEN its replay at the trigger says so, for `kvtrace leaks --input DUMP` to tell
    assert replay(path).session.process_depths() == {200: depth}


# ---- 6: a ledger too large to copy, a storm of deaths (issue 31) ----

class CappedLedger(Ledger):
    """A ledger that refuses to copy more than `read_limit` entries at once, as the kernel's does (KernelLedger,
    --max-read-entries)."""

    read_limit = 30

    def copy_refused(self, pids=()):
        count = len(self.kept(pids))
        return LedgerReadRefused(count, self.read_limit) if count > self.read_limit else None

    def entries(self, pids=()):
        refused = self.copy_refused(pids)
        if refused is not None:
            raise refused
        return self.kept(pids)


def flight_status(agent: FakeAgent):
    (status,) = [status for status in agent.session.components() if status.name == "flight_recorder"]
    return status


def test_a_ledger_too_large_to_copy_still_dumps_every_event_of_the_window_and_says_what_it_left_out(
        tmp_path, recorders):
    # GIVEN a ledger over what may be copied at once: pid 200's 23 allocations and pid 300's 11 (34 > 30)
    agent = FakeAgent()
    agent.session.replace_ledger(CappedLedger())
    recorder = recorders(agent, tmp_path)
    start = time.time_ns() - 60 * NS
    leaky(agent, start)
    agent.apply(*[event(pid=300, address=0x900000000 + index * MiB, ts=start + index * NS) for index in range(11)])
    # THEN the recorder's health says, before any dump, that a dump would leave objects out, with the figures
    recorder.report_health()
    status = flight_status(agent)
    assert not status.up
    assert "the ledger's 34 allocations and blocks are more than --max-read-entries 30" in status.reason
    # WHEN pid 200 fails out of memory, and an operator asks for a dump
    agent.apply(out_of_memory(start + 40 * NS))
    recorder.request(REQUEST, "look")
    oom, request = sorted(written(recorder), key=lambda path: header_of(path).trigger.kind)
    # THEN both are written with every event of the window (34 allocations, the failure), and say what they left out
    for path in (oom, request):
        assert len(allocation_events(path)) == 34 and len(allocation_events(path, Kind.ALLOC_FAILED)) == 1
    assert header_of(oom).trigger.left_out == (
        "the ledger's 34 allocations and blocks are more than --max-read-entries 30: the checkpoints hold pid 200's "
        "23 objects only (every event of the window is here; a free in it of another process's older object "
        "replays as unknown)")
    assert header_of(request).trigger.left_out.endswith(": the checkpoints hold no objects (every event of the "
                                                         "window is here; a free in it of an older object replays "
                                                         "as unknown)")
    # AND the OOM's dump replays to what pid 200 held at the trigger; nothing failed, two dumps left objects out
    assert [len(checkpoint.allocations) for checkpoint in checkpoints_of(oom)] == [0, 23]
    assert {entry[0].pid for entry in ledger_of(replay(oom).session)} == {200}
    assert len(ledger_of(replay(oom).session)) == 23
    assert (recorder.dumps_total, recorder.dumps_partial_total, recorder.dump_failures_total) == (2, 2, 0)
    assert agent.session.counters()["flight_dumps_partial"] == 2
    # AND once the ledger fits again, the recorder is up
    agent.apply(*[event(kind=Kind.FREE, pid=300, address=0x900000000 + index * MiB, ts=start + 50 * NS)
                  for index in range(11)])
    recorder.report_health()
    assert flight_status(agent).up


def test_a_storm_of_deaths_holding_memory_dumps_a_few_times_not_once_each(tmp_path, recorders):
    from kvtrace.reports.flight import MAX_DUMPS_PER_KIND

    # GIVEN 13 processes, each holding 1 MiB
    agent = FakeAgent()
    recorder = recorders(agent, tmp_path)
    start = time.time_ns() - 60 * NS
    agent.apply(*[event(pid=1000 + index, address=0x100000 + index * MiB, ts=start) for index in range(13)])
    # WHEN each dies with status 1 within the cooldown
    agent.apply(*[process_exit(1000 + index, start + NS + index, 1 << 8) for index in range(13)])
    # THEN only MAX_DUMPS_PER_KIND of them dump (each copies the ledger), the others are counted
    assert len(written(recorder)) == MAX_DUMPS_PER_KIND == 4
    assert recorder.dumps_suppressed_total == 13 - 4


def test_after_a_failed_dump_the_recorder_stays_down_until_a_dump_is_written(tmp_path, recorders, monkeypatch):
    agent = FakeAgent()
    recorder = recorders(agent, tmp_path)
    leaky(agent, time.time_ns() - 60 * NS)
    real_write = recorder._write

    def failing(pending):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(recorder, "_write", failing)
    with pytest.raises(FlightDumpError):
        recorder.request(REQUEST, "look")
    for _ in range(3):  # analysis ticks with nothing written since: still down
        recorder.report_health()
        assert not flight_status(agent).up
        assert "1 dumps could not be written" in flight_status(agent).reason
    monkeypatch.setattr(recorder, "_write", real_write)
    recorder.request(REQUEST, "look again")
    recorder.report_health()
    assert flight_status(agent).up
