"""Depth on the wire and in every report: SetProcessDepth (admin only, validated, reaching the Session),
the depth of each process in ListProcesses, GetGrowth, GetSnapshot, ListLeakSuspects and GetVllmEngines,
`kvtrace deep`, `kvtrace ps` / `top` / `leaks` / `snapshot`, and recordings that keep it."""
import io
import json
import math
import os
import time

import grpc
import psutil
import pytest
from rich.console import Console

from fake_agent import FakeAgent, MiB, event, served
from kvtrace._proto.kvtrace.v1 import agent_service_pb2 as service_pb2
from kvtrace._proto.kvtrace.v1 import agent_service_pb2_grpc as service_grpc
from kvtrace.cli.deep import request_line
from kvtrace.cli.main import main
from kvtrace.cli.top import render_frame
from kvtrace.client import AgentClient
from kvtrace.model.depth import Depth, DepthCause, ProcessDepth, segments_only
from kvtrace.model.events import Api, Kind, Layer, ObjectKind, StackStatus
from kvtrace.reports.recorder import FrameEncoder, recording_header
from kvtrace.reports.recording import RecordingWriter
from kvtrace.reports.replay import replay
from kvtrace.servers.api.requests import DEFAULT_DEPTH_SECONDS
from kvtrace.wire import depth_from_proto, depth_to_json, depth_to_proto

NS = 1_000_000_000
SECRET = "sk-kvtrace-secret-0123"


def admin_stub(server):
    return service_grpc.AgentServiceStub(grpc.insecure_channel(f"unix:{server.config.admin_path}"))


def group_stub(server):
    return service_grpc.AgentServiceStub(grpc.insecure_channel(f"unix:{server.config.socket}"))


def raised(pid: int, since_ns: int, cause=DepthCause.GROWTH, detail="traced bytes +96 MiB in 60 s",
           depth=Depth.BLOCKS) -> ProcessDepth:
    return ProcessDepth(pid, depth, since_ns, cause, detail, sample_bytes=512 << 10 if depth is Depth.BLOCKS else 0)


def backend_with_depths(now_ns: int) -> FakeAgent:
    """pid 200 raised to blocks 200 s ago on growth; pid 100 at segments; both hold memory."""
    backend = FakeAgent()
    backend.apply(event(pid=200, address=0x10, size=4 * MiB, ts=now_ns - 300 * NS),
                  event(pid=100, address=0x20, size=MiB, ts=now_ns - 300 * NS))
    backend.analyze(now_ns, 300 * NS)
    backend.session.set_process_depths({200: raised(200, now_ns - 200 * NS),
                                        100: segments_only(100, now_ns - 300 * NS)})
    return backend


# ---- the wire mirrors the model ----

@pytest.mark.parametrize("model, wire, prefix", [(Depth, service_pb2.ProcessDepth, "PROCESS_DEPTH_"),
                                                 (DepthCause, service_pb2.DepthCause, "DEPTH_CAUSE_")])
def test_wire_depth_enums_have_the_model_numbers(model, wire, prefix):
    assert {prefix + member.name: member.value for member in model} == \
        {name: number for name, number in wire.items() if number != 0}


def test_a_depth_survives_the_wire_and_reads_as_json():
    depth = ProcessDepth(200, Depth.FULL, 17 * NS, DepthCause.OPERATOR, "asked for 300 s", until_ns=317 * NS)
    message = service_pb2.ProcessDepthState.FromString(depth_to_proto(depth).SerializeToString())
    assert depth_from_proto(message) == depth
    assert depth_to_json(depth) == {"pid": 200, "depth": "full", "since_ns": 17 * NS, "cause": "operator",
                                    "detail": "asked for 300 s", "until_ns": 317 * NS, "sample_bytes": 0}
    # From an older agent (unset) or a newer one (an unknown depth): not known; an unknown cause is DEFAULT.
    assert depth_from_proto(service_pb2.ProcessDepthState()) is None
    assert depth_from_proto(service_pb2.ProcessDepthState(pid=1, depth=9)) is None
    newer = service_pb2.ProcessDepthState(pid=1, depth=2)
    newer.cause = 42  # type: ignore[assignment]
    assert depth_from_proto(newer).cause is DepthCause.DEFAULT


# ---- SetProcessDepth ----

def test_set_process_depth_reaches_the_session_with_its_end():
    with served() as (server, backend):
        stub = admin_stub(server)
        before = time.time_ns()
        response = stub.SetProcessDepth(service_pb2.SetProcessDepthRequest(
            pid=os.getpid(), depth=service_pb2.PROCESS_DEPTH_BLOCKS), timeout=10)
        (request,) = backend.session.depth_requests().values()
        assert request.pid == os.getpid() and request.depth is Depth.BLOCKS
        assert before <= request.requested_ns <= time.time_ns()
        assert request.until_ns == request.requested_ns + int(DEFAULT_DEPTH_SECONDS * NS)  # 10 min by default
        # for this process, not one that takes its pid later
        assert request.process_started_ns == int(psutil.Process(os.getpid()).create_time() * 1e9) > 0
        assert response.requested == depth_to_proto(ProcessDepth(
            os.getpid(), Depth.BLOCKS, request.requested_ns, DepthCause.OPERATOR, "asked for 600 s",
            until_ns=request.until_ns))
        assert not response.HasField("current")  # the policy did not follow it yet

        # FULL for 90 s replaces it; the answer says where the process is now
        backend.session.set_process_depths({os.getpid(): raised(os.getpid(), 5 * NS)})
        response = stub.SetProcessDepth(service_pb2.SetProcessDepthRequest(
            pid=os.getpid(), depth=service_pb2.PROCESS_DEPTH_FULL, duration_seconds=90), timeout=10)
        (request,) = backend.session.depth_requests().values()
        assert request.depth is Depth.FULL and request.until_ns - request.requested_ns == 90 * NS
        assert depth_from_proto(response.current) == raised(os.getpid(), 5 * NS)

        # SEGMENTS withdraws it
        response = stub.SetProcessDepth(service_pb2.SetProcessDepthRequest(
            pid=os.getpid(), depth=service_pb2.PROCESS_DEPTH_SEGMENTS), timeout=10)
        assert backend.session.depth_requests() == {}
        assert (response.requested.depth, response.requested.until_ns) == (service_pb2.PROCESS_DEPTH_SEGMENTS, 0)
        assert response.requested.detail.startswith("request withdrawn: ")
        # ... and says so when there was none
        backend.session.set_process_depths({})
        response = stub.SetProcessDepth(service_pb2.SetProcessDepthRequest(
            pid=os.getpid(), depth=service_pb2.PROCESS_DEPTH_SEGMENTS), timeout=10)
        assert response.requested.detail.startswith("no request to withdraw: ")


@pytest.mark.parametrize("depth", [service_pb2.PROCESS_DEPTH_BLOCKS, service_pb2.PROCESS_DEPTH_SEGMENTS])
def test_set_process_depth_is_refused_while_the_agent_takes_no_requests(depth):
    with served() as (server, backend):
        backend.session.set_depth_refusal("--blocks never")
        with pytest.raises(grpc.RpcError) as error:
            admin_stub(server).SetProcessDepth(service_pb2.SetProcessDepthRequest(pid=os.getpid(), depth=depth),
                                               timeout=10)
        assert backend.session.depth_requests() == {}
    assert error.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert error.value.details() == "the agent does not take depth requests now: --blocks never"


def test_set_process_depth_is_refused_for_a_process_without_pytorch_probes():
    """A process the probes do not follow, or that maps no PyTorch allocator, cannot be raised: said, not
    accepted and then quietly ignored; withdrawing stays possible."""
    with served() as (server, backend):
        backend.session.set_depth_refusal("", deepenable={os.getpid() + 1})
        with pytest.raises(grpc.RpcError) as error:
            admin_stub(server).SetProcessDepth(service_pb2.SetProcessDepthRequest(
                pid=os.getpid(), depth=service_pb2.PROCESS_DEPTH_BLOCKS), timeout=10)
        assert backend.session.depth_requests() == {}
        admin_stub(server).SetProcessDepth(service_pb2.SetProcessDepthRequest(
            pid=os.getpid(), depth=service_pb2.PROCESS_DEPTH_SEGMENTS), timeout=10)
    assert error.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert f"pid {os.getpid()} has no PyTorch allocator probes the agent can turn on" in error.value.details()


def test_set_process_depth_for_a_process_gone_in_between(monkeypatch):
    def gone(pid):
        raise psutil.NoSuchProcess(pid)
    monkeypatch.setattr(psutil, "Process", gone)
    with served() as (server, backend):
        with pytest.raises(grpc.RpcError) as error:
            admin_stub(server).SetProcessDepth(service_pb2.SetProcessDepthRequest(
                pid=os.getpid(), depth=service_pb2.PROCESS_DEPTH_BLOCKS), timeout=10)
        assert backend.session.depth_requests() == {}
    assert error.value.code() is grpc.StatusCode.NOT_FOUND
    assert f"no process {os.getpid()} runs on the agent's host" in error.value.details()


def test_set_process_depth_is_for_the_admin_socket_only():
    with served() as (server, backend):
        with pytest.raises(grpc.RpcError) as error:
            group_stub(server).SetProcessDepth(service_pb2.SetProcessDepthRequest(
                pid=os.getpid(), depth=service_pb2.PROCESS_DEPTH_BLOCKS), timeout=10)
        assert backend.session.depth_requests() == {}
    assert error.value.code() is grpc.StatusCode.PERMISSION_DENIED
    assert "use the admin socket" in error.value.details()


@pytest.mark.parametrize("fields, code, says", [
    ({"pid": 0}, grpc.StatusCode.INVALID_ARGUMENT, "pid: 0 is not a process id"),
    ({"pid": 1 << 30}, grpc.StatusCode.INVALID_ARGUMENT, "is not a process id (1 to 4194304)"),
    ({"depth": 0}, grpc.StatusCode.INVALID_ARGUMENT, "depth: unknown or unspecified value 0"),
    ({"depth": 9}, grpc.StatusCode.INVALID_ARGUMENT, "depth: unknown or unspecified value 9"),
    ({"duration_seconds": 0.5}, grpc.StatusCode.INVALID_ARGUMENT, "duration_seconds: 0.5 is not in 1..86400"),
    ({"duration_seconds": 86401}, grpc.StatusCode.INVALID_ARGUMENT, "(1 s to 24 h; 0: the default, 600)"),
    ({"duration_seconds": -5}, grpc.StatusCode.INVALID_ARGUMENT, "duration_seconds: -5 is not in"),
    ({"duration_seconds": math.nan}, grpc.StatusCode.INVALID_ARGUMENT, "duration_seconds: nan is not in"),
    ({"pid": 4194303}, grpc.StatusCode.NOT_FOUND, "no process 4194303 runs on the agent's host"),
])
def test_set_process_depth_refuses_bad_requests(fields, code, says):
    request = service_pb2.SetProcessDepthRequest(**{"pid": os.getpid(), "depth": service_pb2.PROCESS_DEPTH_BLOCKS,
                                                    **fields})
    with served() as (server, backend):
        with pytest.raises(grpc.RpcError) as error:
            admin_stub(server).SetProcessDepth(request, timeout=10)
        assert backend.session.depth_requests() == {}
    assert error.value.code() is code and says in error.value.details(), error.value.details()


# ---- every answer says the depth ----

def test_processes_growth_snapshot_and_leaks_carry_each_process_depth():
    now_ns = time.time_ns()
    with served(backend_with_depths(now_ns)) as (server, _):
        with AgentClient.for_socket(server.config.socket) as agent:  # the admin socket: full detail
            processes = {p.pid: depth_from_proto(p.depth) for p in agent.processes()}
            growth = {row.pid: depth_from_proto(row.depth) for row in agent.growth().processes}
            pages = list(agent.snapshot_pages())
            leaks = agent.leak_suspects(min_age_seconds=0)
            asked = agent.leak_suspects(pids=[100, 300], min_age_seconds=0)
    expected = {200: raised(200, now_ns - 200 * NS), 100: segments_only(100, now_ns - 300 * NS)}
    assert processes == growth == expected
    assert {state.pid: depth_from_proto(state) for page in pages for state in page.depths} == expected
    # The suspects' processes and those asked for, each once (300 is not followed: no depth)
    assert [depth_from_proto(state) for state in leaks.depths] == [expected[100], expected[200]]
    assert [depth_from_proto(state) for state in asked.depths] == [expected[100]]


def test_the_group_socket_sees_depths_with_secrets_redacted():
    now_ns = time.time_ns()
    backend = backend_with_depths(now_ns)
    backend.session.set_process_depths({200: raised(200, now_ns, DepthCause.VLLM, f"engine --api-key {SECRET}")})
    with served(backend) as (server, _):
        response = group_stub(server).ListProcesses(service_pb2.ListProcessesRequest(), timeout=10)
        growth = group_stub(server).GetGrowth(service_pb2.GetGrowthRequest(), timeout=10)
    (worker,) = [process for process in response.processes if process.pid == 200]
    assert worker.depth.depth == service_pb2.PROCESS_DEPTH_BLOCKS and worker.depth.detail == "engine --api-key ***"
    assert SECRET not in str(response) and SECRET not in str(growth)


# ---- kvtrace deep ----

def test_deep_asks_and_says_until_when(capsys):
    with served() as (server, backend):
        socket = str(server.config.socket)
        assert main(["deep", "--pid", str(os.getpid()), "--for", "90s", "--socket", socket]) == 0
        (line,) = capsys.readouterr().out.splitlines()
        (request,) = backend.session.depth_requests().values()
        assert request.depth is Depth.BLOCKS and request.until_ns - request.requested_ns == 90 * NS
        until = time.strftime("%H:%M:%S", time.localtime(request.until_ns / NS))
        assert line == (f"pid {os.getpid()}: depth blocks (PyTorch blocks, stacks sampled) asked until {until} "
                        "(1m30s); the agent applies it at its next analysis tick (≤ 1 s)")

        backend.session.set_process_depths({os.getpid(): raised(os.getpid(), request.requested_ns)})
        assert main(["deep", "-p", str(os.getpid()), "--full", "--socket", socket, "--json"]) == 0
        answer = json.loads(capsys.readouterr().out)
        assert (answer["requested"]["depth"], answer["requested"]["cause"], answer["current"]["depth"]) == \
            ("full", "operator", "blocks")
        assert answer["requested"]["until_ns"] - answer["requested"]["since_ns"] == 600 * NS

        assert main(["deep", "--pid", str(os.getpid()), "--off", "--socket", socket]) == 0
        assert capsys.readouterr().out.startswith(f"pid {os.getpid()}: request withdrawn (now blocks since ")
        assert backend.session.depth_requests() == {}

        # --off again: there is nothing to withdraw, and the line says so
        assert main(["deep", "--pid", str(os.getpid()), "--off", "--socket", socket]) == 0
        assert capsys.readouterr().out.startswith(f"pid {os.getpid()}: no request to withdraw (now blocks since ")
        backend.session.set_process_depths({})
        assert main(["deep", "--pid", str(os.getpid()), "--off", "--socket", socket]) == 0
        assert capsys.readouterr().out == (f"pid {os.getpid()}: no request to withdraw; the agent decides on its own "
                                           "evidence, as before\n")


def test_deep_off_from_an_agent_that_does_not_say_whether_there_was_a_request():
    pid = os.getpid()
    withdrawal = service_pb2.SetProcessDepthResponse(requested=depth_to_proto(ProcessDepth(
        pid, Depth.SEGMENTS, 5 * NS, DepthCause.OPERATOR)))
    assert request_line(withdrawal).startswith(f"pid {pid}: any request withdrawn; the agent decides")
    withdrawal.current.CopyFrom(depth_to_proto(raised(pid, 5 * NS, DepthCause.OPERATOR, "asked for 600 s")))
    assert request_line(withdrawal).startswith(f"pid {pid}: request withdrawn (now blocks since ")


def test_deep_says_in_one_line_when_the_agent_takes_no_requests(capsys):
    with served() as (server, backend):
        backend.session.set_depth_refusal("--blocks never")
        assert main(["deep", "--pid", str(os.getpid()), "--socket", str(server.config.socket)]) == 1
        assert backend.session.depth_requests() == {}
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 1, captured.err
    assert captured.err.rstrip().endswith("refused: the agent does not take depth requests now: --blocks never")


@pytest.mark.parametrize("argv, says", [
    (["--for", "0s"], "not a duration from 1s to 24h: '0s' (examples: 90s, 10m, 2h)"),
    (["--for", "25h"], "not a duration from 1s to 24h"),
    (["--full", "--off"], "not allowed with argument"),
    (["--off", "--for", "10m"], "--for has no meaning with --off"),
])
def test_deep_refuses_bad_flags_in_one_line(argv, says, capsys):
    with served() as (server, backend):
        try:
            code = main(["deep", "--pid", str(os.getpid()), *argv, "--socket", str(server.config.socket)])
        except SystemExit as exit_info:
            code = exit_info.code
        assert backend.session.depth_requests() == {}
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1 and says in err, err


def test_deep_for_a_process_that_is_not_there(capsys):
    with served() as (server, _):
        assert main(["deep", "--pid", "4194303", "--socket", str(server.config.socket)]) == 1
    assert "no process 4194303 runs on the agent's host" in capsys.readouterr().err


# ---- the reports ----

def test_ps_has_a_depth_column_and_json_the_whole_state(capsys):
    now_ns = time.time_ns()
    with served(backend_with_depths(now_ns)) as (server, _):
        assert main(["ps", "--socket", str(server.config.socket)]) == 0
        table = capsys.readouterr().out.splitlines()
        assert main(["ps", "--json", "--socket", str(server.config.socket)]) == 0
        objects = {line["pid"]: line for line in map(json.loads, capsys.readouterr().out.splitlines())}
    header = table[0]
    assert header.split()[8] == "DEPTH"
    rows = {line.split()[0]: line for line in table[1:]}
    start = header.index("DEPTH")
    assert rows["200"][start:start + 10].rstrip() == "blocks 3m"
    assert rows["100"][start:start + 10].rstrip() == "segments"
    assert objects[200]["depth"] == depth_to_json(raised(200, now_ns - 200 * NS))
    assert objects[100]["depth"]["depth"] == "segments"


def test_top_shows_each_rows_depth_and_when_a_process_was_raised():
    now_ns = time.time_ns()
    growth = service_pb2.GetGrowthResponse(timestamp_ns=now_ns, processes=[
        service_pb2.ProcessGrowth(pid=200, title="VLLM::Worker_TP0", outstanding_bytes=MiB,
                                  depth=depth_to_proto(raised(200, now_ns - 200 * NS))),
        service_pb2.ProcessGrowth(pid=100, title="VLLM::EngineCore", outstanding_bytes=MiB,
                                  depth=depth_to_proto(segments_only(100, now_ns)))])
    console = Console(width=120, file=io.StringIO())
    console.print(render_frame(service_pb2.GetAgentInfoResponse(version="0.1.0"), growth, "outstanding", now_ns, 120))
    lines = console.file.getvalue().splitlines()
    assert lines[4].split()[-2:] == ["DEPTH", "TITLE"]
    assert [line.split()[-2] for line in lines[5:7]] == ["seg", "blk"]  # pid order: equal sizes
    assert lines[-2] == "DEPTH: seg CUDA calls, blk + PyTorch blocks (sampled stacks), full + every stack"
    since = time.strftime("%H:%M:%S", time.localtime((now_ns - 200 * NS) / NS))
    assert lines[-1] == f"pid 200: blocks since {since} (growth: traced bytes +96 MiB in 60 s)"


def test_leaks_says_whose_holders_are_known_and_since_when(capsys):
    # GIVEN pid 100 at segments and pid 200 raised to blocks after its memory was allocated
    now_ns = time.time_ns()
    backend = backend_with_depths(now_ns)
    with served(backend) as (server, _):
        assert main(["leaks", "--min-age", "0", "--socket", str(server.config.socket)]) == 0
    out = capsys.readouterr().out.splitlines()
    since = time.strftime("%H:%M:%S", time.localtime((now_ns - 200 * NS) / NS))
    # THEN before any stack, a line for each: how to raise 100, since when 200's holders are known
    assert out[4:6] == [
        "pid 100 VLLM::EngineCore is traced at segments: its holders are not known yet. Blocks are not traced "
        "at this depth, so a caching allocator's stack names who grew the cache, not who holds it; raise it: "
        "sudo kvtrace deep --pid 100",
        f"pid 200 VLLM::Worker_TP0: blocks known since {since} (growth: traced bytes +96 MiB in 60 s); memory "
        "allocated before that is counted in its segments but has no holder"]
    assert "    pid 200 VLLM::Worker_TP0, GPU 0, depth blocks" in out


def test_leaks_says_since_when_blocks_are_known_once_a_raised_process_holds_blocks(capsys):
    # GIVEN pid 200 raised 200 s ago, holding a segment from before then and a block from after
    now_ns = time.time_ns()
    backend = backend_with_depths(now_ns)
    backend.apply(event(kind=Kind.ALLOC, api=Api.pytorch_malloc, layer=Layer.TORCH, obj=ObjectKind.BLOCK, pid=200,
                        address=0x10, size=2 * MiB, ts=now_ns - 100 * NS, stack_id=3,
                        stack_status=StackStatus.OK, sample_bytes=512 << 10))
    backend.analyze(now_ns, 300 * NS)
    with served(backend) as (server, _):
        assert main(["leaks", "-p", "200", "--min-age", "0", "--socket", str(server.config.socket)]) == 0
    out = capsys.readouterr().out.splitlines()
    since = time.strftime("%H:%M:%S", time.localtime((now_ns - 200 * NS) / NS))
    # THEN its suspect is the block, allocated after the raise, and the note stays: what 200 allocated before
    # the raise still has no holder
    assert out[2] == "1 outstanding allocations considered, 1 at least 0 s old, in 1 sites."
    assert "[1] 2.0 MiB in 1 allocation, growth 0 B/s (15 min), oldest 1m40s" in out
    assert f"pid 200 VLLM::Worker_TP0: blocks known since {since} (growth: traced bytes +96 MiB in 60 s); memory " \
        "allocated before that is counted in its segments but has no holder" in out
    assert "    pid 200 VLLM::Worker_TP0, GPU 0, depth blocks" in out


def test_leaks_says_since_when_blocks_are_known_even_when_traced_all_along(capsys):
    now_ns = time.time_ns()
    backend = backend_with_depths(now_ns)
    backend.session.set_process_depths({200: raised(200, now_ns - 400 * NS, DepthCause.CONFIGURED, "")})
    with served(backend) as (server, _):
        assert main(["leaks", "-p", "200", "--min-age", "0", "--socket", str(server.config.socket)]) == 0
    out = capsys.readouterr().out
    since = time.strftime("%H:%M:%S", time.localtime((now_ns - 400 * NS) / NS))
    assert f"pid 200 VLLM::Worker_TP0: blocks known since {since} (configured); memory allocated" in out
    assert "depth blocks" in out and "traced at segments" not in out


def test_snapshot_header_says_the_depth(capsys):
    now_ns = time.time_ns()
    with served(backend_with_depths(now_ns)) as (server, _):
        assert main(["snapshot", "--socket", str(server.config.socket)]) == 0
    out = capsys.readouterr().out
    since = time.strftime("%H:%M:%S", time.localtime((now_ns - 200 * NS) / NS))
    assert f"pid 200  VLLM::Worker_TP0  depth blocks since {since}" in out
    assert "pid 100  VLLM::EngineCore  depth segments\n" in out


# ---- recordings keep the depth as it changes ----

def test_a_recording_writes_a_process_again_when_its_depth_changes(tmp_path):
    agent = FakeAgent()
    start_ns = time.time_ns()
    depths = {200: segments_only(200, start_ns)}
    encoder = FrameEncoder(agent.session.stack, agent.session.process, depths_of=lambda: dict(depths))
    with agent.session.lock:
        checkpoint = agent.session.checkpoint_locked()
    frames = list(encoder.checkpoint(checkpoint))
    frames += encoder.record(event(pid=200, address=0x10, ts=start_ns))
    frames += encoder.record(event(pid=200, address=0x20, ts=start_ns + NS // 2))  # no look within the second
    depths[200] = raised(200, start_ns + NS)
    frames += encoder.record(event(pid=200, address=0x30, ts=start_ns + 2 * NS))
    processes = [frame.process for frame in frames if frame.HasField("process")]
    assert [depth_from_proto(process.depth) for process in processes] == [segments_only(200, start_ns),
                                                                            raised(200, start_ns + NS)]
    writer = RecordingWriter.create(tmp_path / "r.kvtrace", recording_header(0.0, 60.0, checkpoint.timestamp_ns))
    for frame in frames:
        writer.write(frame)
    writer.close()
    # WHEN it is replayed, at its end and before the change
    assert replay(tmp_path / "r.kvtrace").session.process_depths() == {200: raised(200, start_ns + NS)}
    early = replay(tmp_path / "r.kvtrace", at_ns=start_ns + NS - 1)
    assert early.session.process_depths() == {200: segments_only(200, start_ns)}



def test_a_streamed_recording_writes_a_depth_decided_after_the_last_event():
    """StreamRecording (kvtrace record): a process lowered (or raised) after its last event still has its new
    depth written, on a take that brought nothing."""
    from kvtrace.reports.recorder import RecordQueue, encode_stream

    agent = FakeAgent()
    start_ns = time.time_ns()
    depths = {200: raised(200, start_ns)}
    encoder = FrameEncoder(agent.session.stack, agent.session.process, depths_of=lambda: dict(depths))
    queue = RecordQueue(agent.session)
    checkpoint = agent.session.subscribe(queue)
    agent.session.ingest(event(pid=200, address=0x10, ts=start_ns))
    turns = iter(range(3))
    batches = encode_stream(queue, encoder, checkpoint, 100, lambda: next(turns, None) is not None, wait_seconds=0.01)
    frames = [frame for batch in [next(batches), next(batches)] for frame in batch]  # checkpoint, then the event
    depths[200] = segments_only(200, start_ns + NS)
    frames += next(batches)  # nothing came: the change goes all the same
    processes = [depth_from_proto(frame.process.depth) for frame in frames if frame.HasField("process")]
    assert processes == [raised(200, start_ns), segments_only(200, start_ns + NS)]
