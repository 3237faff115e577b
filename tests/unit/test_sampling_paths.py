"""Stack sampling of PyTorch blocks survives every path a ledger entry or a leak suspect takes: the ring's
records into events and a ledger built from them (replay, --no-ledger-in-kernel) as the kernel's entries have
it, the wire both ways (GetSnapshot, ListLeakSuspects, JSON), a recording and its replay, and the reports that
weigh bytes per stack over gRPC (flame graph) or mark estimates (leaks, memory-viz)."""
import io
import json
import math
import time
from contextlib import redirect_stdout

import pytest

from fake_agent import TITLES, FakeAgent, MiB, event, served
from kvtrace._proto.kvtrace.v1 import agent_service_pb2 as service_pb2
from kvtrace.cli.main import main
from kvtrace.client import AgentClient
from kvtrace.model.blocks import estimated_bytes, segments_of
from kvtrace.model.events import Api, Kind, Layer, Memory, ObjectKind, StackStatus
from kvtrace.model.findings import LeakSuspect
from kvtrace.model.ledger import Ledger, LedgerKey, Outstanding
from kvtrace.model.stacks import Frame, Stack
from kvtrace.reports.flamegraph import folded_stacks
from kvtrace.reports.memory_viz import NOT_SAMPLED_FRAME, snapshot_dict, viz_segments
from kvtrace.reports.recorder import FileRecorder
from kvtrace.reports.replay import replay
from kvtrace.sources.bpf import abi
from kvtrace.sources.bpf.decode import Clock, decode_event, decode_ledger_entry
from kvtrace.wire import (
    leak_report_to_json_dict,
    outstanding_from_proto,
    outstanding_to_json_dict,
    outstanding_to_proto,
    suspect_to_proto,
)

KiB = 1 << 10
S = 512 * KiB
NS = 1_000_000_000
T0 = 1_700_000_000 * NS
TORCH = (Layer.TORCH,)
CLOCK = Clock(offset_ns=T0)


def block_event(address, size=16 * KiB, status=StackStatus.OK, sample_bytes=S, pid=200, ts=T0, **fields):
    return event(kind=Kind.ALLOC, api=Api.pytorch_malloc, layer=Layer.TORCH, obj=ObjectKind.BLOCK, pid=pid,
                 address=address, size=size, stack_status=status, sample_bytes=sample_bytes, stream=7, ts=ts, **fields)


# ---- records -> events -> a ledger of events, as the kernel's entries ----

# (size, struct kvt_event.sampling, stack status as user space has it, the kernel's entry: sample_kib, sampled)
KERNEL_CASES = [
    (16 * KiB, 1, StackStatus.OK, S // KiB, 1),            # chosen: walked
    (16 * KiB, 1, StackStatus.NOT_SAMPLED, S // KiB, 0),   # passed over: no walk
    (16 * KiB, 1, StackStatus.UNRESOLVED, S // KiB, 1),    # chosen, its frames gone before user space read them
    (16 * KiB, 1, StackStatus.READ_ERROR, S // KiB, 1),    # chosen, the walk failed
    (MiB, 0, StackStatus.OK, 0, 0),                        # at least S: always walked, exact
    (16 * KiB, 0, StackStatus.OK, 0, 0),                   # a process walked in full (depth FULL): exact
    (16 * KiB, 0, StackStatus.NOT_PYTHON, 0, 0),           # no Python: nothing to sample, exact
]


@pytest.mark.parametrize("size, sampling, status, sample_kib, sampled", KERNEL_CASES,
                         ids=[f"{case[0] // KiB}KiB-{case[2].name}-{case[1]}" for case in KERNEL_CASES])
def test_a_ledger_built_from_events_weighs_a_block_as_the_kernels_entry_does(size, sampling, status, sample_kib,
                                                                              sampled):
    raw_status = StackStatus.OK if status is StackStatus.UNRESOLVED else status  # user space's own verdict
    record = abi.EVENT_STRUCT.pack(5, 0x7F00, size, 0, 7, 0, 200, 201, 0, 0, int(Api.pytorch_malloc), int(Kind.ALLOC),
                                   int(Layer.TORCH), int(ObjectKind.BLOCK), int(Memory.DEVICE), raw_status.value,
                                   sampling, b"python")
    decoded, _ = decode_event(record, CLOCK, S)
    decoded.stack_status = status
    ledger = Ledger()
    ledger.apply(decoded)
    [built] = ledger.entries()
    kernel = decode_ledger_entry(
        abi.RawLedgerKey(pid=200, layer=int(Layer.TORCH), object=int(ObjectKind.BLOCK), address=0x7F00),
        abi.RawLedgerValue(size_bytes=size, timestamp_ns=5, aux=7, tid=201, device=0, api=int(Api.pytorch_malloc),
                           memory=int(Memory.DEVICE), sample_kib=sample_kib, sampled=sampled), CLOCK)
    assert (built.sample_bytes, built.sampled) == (kernel.sample_bytes, kernel.sampled)
    assert built == kernel
    assert estimated_bytes(built) == estimated_bytes(kernel)


# ---- the wire ----

def entry(address, size=16 * KiB, sample_bytes=S, sampled=True, stack_id=0, layer=Layer.TORCH,
          obj=ObjectKind.BLOCK) -> Outstanding:
    return Outstanding(LedgerKey(200, layer, obj, address), size, T0, 0,
                       Api.pytorch_malloc if obj is ObjectKind.BLOCK else Api.cuMemAlloc_v2, Memory.DEVICE, tid=201,
                       stack_id=stack_id, stream=7 if obj is ObjectKind.BLOCK else 0, sample_bytes=sample_bytes,
                       sampled=sampled)


def test_an_entrys_sampling_survives_the_wire_and_says_its_weight_in_json():
    chosen, passed = entry(0x1000, stack_id=3), entry(0x2000, sampled=False)
    exact, segment = entry(0x3000, size=MiB, sample_bytes=0, sampled=False), \
        entry(0x4000, size=2 * MiB, sample_bytes=0, sampled=False, layer=Layer.DRIVER, obj=ObjectKind.ALLOCATION)
    for original in (chosen, passed, exact, segment):
        message = service_pb2.OutstandingAllocation.FromString(outstanding_to_proto(original, None).SerializeToString())
        assert outstanding_from_proto(message) == original
    as_json = [outstanding_to_json_dict(outstanding_to_proto(e, None)) for e in (chosen, passed, exact, segment)]
    weight = 16 * KiB / -math.expm1(-16 * KiB / S)
    assert [(j["sample_bytes"], j["sampled"], j["estimated_bytes"]) for j in as_json[:3]] == \
        [(S, True, round(weight)), (S, False, 0), (0, False, MiB)]
    assert "sample_bytes" not in as_json[3]  # only blocks are sampled


def test_a_suspects_estimate_survives_the_wire_and_json():
    suspects = [LeakSuspect(1, 200, "VLLM::Worker_TP0", 0, 3, None, 0, 17 * MiB, 66, 600.0, 0.0, estimated=True),
                LeakSuspect(2, 200, "VLLM::Worker_TP0", 0, 4, None, 0, 2 * MiB, 2, 600.0, 0.0)]
    response = service_pb2.ListLeakSuspectsResponse(suspects=[suspect_to_proto(s) for s in suspects])
    response = service_pb2.ListLeakSuspectsResponse.FromString(response.SerializeToString())
    assert [suspect.estimated for suspect in response.suspects] == [True, False]
    assert [suspect["estimated"] for suspect in leak_report_to_json_dict(response)["suspects"]] == [True, False]


# ---- the reports, over gRPC ----

def sampled_agent(ts=T0) -> tuple[FakeAgent, list]:
    """Pid 200's blocks under sampling at 512 KiB: 5 chosen 16 KiB ones from `forward` and 40 passed over, two 1 MiB
    ones of `load` (at least S: exact); pid 300's walked in full (exact, `train`); and pid 200's segment."""
    agent = FakeAgent()
    forward = agent.stacks.intern(Stack((Frame("forward", "/app/model.py", 30),)))
    load = agent.stacks.intern(Stack((Frame("load", "/app/model.py", 7),)))
    train = agent.stacks.intern(Stack((Frame("train", "/app/train.py", 3),)))
    base = 0x7F00_0000_0000
    events = [event(api=Api.cudaMalloc, layer=Layer.RUNTIME, address=base, size=64 * MiB, ts=ts),
              event(address=base, size=64 * MiB, ts=ts)]
    events += [block_event(base + i * 16 * KiB, stack_id=forward, ts=ts + i) for i in range(5)]
    events += [block_event(base + (5 + i) * 16 * KiB, status=StackStatus.NOT_SAMPLED, ts=ts + i) for i in range(40)]
    events += [block_event(base + 8 * MiB + i * MiB, size=MiB, stack_id=load, sample_bytes=0, ts=ts) for i in range(2)]
    events += [block_event(0x6000 + i * 16 * KiB, pid=300, stack_id=train, sample_bytes=0, ts=ts) for i in range(3)]
    agent.apply(*events)
    return agent, events


def expected_folded_lines():
    weight = 16 * KiB / -math.expm1(-16 * KiB / S)
    return [f"pid 200 VLLM::Worker_TP0;GPU 0;forward (/app/model.py:30);[pytorch_malloc] {round(5 * weight)}",
            f"pid 200 VLLM::Worker_TP0;GPU 0;load (/app/model.py:7);[pytorch_malloc] {2 * MiB}",
            f"pid 300 python train.py;GPU 0;train (/app/train.py:3);[pytorch_malloc] {3 * 16 * KiB}"]


def test_a_snapshot_over_grpc_gives_the_flame_graph_estimates_of_the_agents_own_ledger(capsys):
    agent, _ = sampled_agent()
    in_process = folded_stacks(agent.session.outstanding(), agent.stacks.get, TITLES, TORCH)
    assert sorted(in_process) == expected_folded_lines()  # the 40 passed over make no stackless path
    with served(agent) as (server, _):
        with AgentClient.for_socket(server.config.admin_path) as client:
            held = client.held()
        assert main(["flamegraph", "--blocks", "--socket", str(server.config.admin_path)]) == 0
    assert sorted((e.key, e.sample_bytes, e.sampled) for e in held.entries) == \
        sorted((e.key, e.sample_bytes, e.sampled) for e in agent.session.outstanding())
    assert folded_stacks(held.entries, held.stacks.get, held.titles, TORCH) == in_process
    out, err = capsys.readouterr()
    assert out.splitlines() == in_process
    assert "bytes per stack are estimates" in err


def test_leaks_mark_the_estimated_suspects_and_say_what_the_mark_means(capsys):
    agent, _ = sampled_agent()
    agent.freeze_clock(T0 + 600 * NS)
    with served(agent) as (server, _):
        socket = str(server.config.admin_path)
        assert main(["leaks", "--socket", socket]) == 0
        text = capsys.readouterr().out
        assert main(["leaks", "--socket", socket, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
    heads = [line for line in text.splitlines() if line.startswith("[")]
    # by bytes: forward's ~2.5 MiB estimated (5 chosen blocks of 16 KiB at S 512 KiB stand for ~163), load's 2 MiB
    # (exact: at least S), train's 48 KiB (exact: walked in full)
    assert heads[0].startswith("[1] ~2.5 MiB in ~163 allocations, growth ~")
    assert heads[1].startswith("[2] 2.0 MiB in 2 allocations, growth 0 B/s")
    assert heads[2].startswith("[3] 48.0 KiB in 3 allocations, growth 0 B/s")
    assert "~ an estimate: the site's PyTorch blocks have their stacks sampled" in text
    assert [(s["estimated"], s["allocation_count"]) for s in report["suspects"]] == \
        [(True, 163), (False, 2), (False, 3)]
    # exact: every block considered (5 + 40 + 2 + 3), the passed over ones included
    assert report["allocations_considered"] == 50


def test_leaks_without_sampled_blocks_say_nothing_of_estimates(capsys):
    agent = FakeAgent()
    agent.apply(event(address=0x10, size=MiB, ts=T0))
    agent.freeze_clock(T0 + 600 * NS)
    with served(agent) as (server, _):
        assert main(["leaks", "--socket", str(server.config.admin_path)]) == 0
    text = capsys.readouterr().out
    assert "~" not in text and "estimate" not in text


def test_memory_viz_marks_the_blocks_sampling_passed_over():
    agent, _ = sampled_agent()
    segments, _ = segments_of([e for e in agent.session.outstanding() if e.key.pid == 200])
    [segment] = segments
    snapshot = snapshot_dict(viz_segments(segments, agent.stacks.get))
    live = [b for b in snapshot["segments"][0]["blocks"] if b["state"] == "active_allocated"]
    names = [tuple(frame["name"] for frame in b["frames"]) for b in live]
    assert names == [("forward",)] * 5 + [(NOT_SAMPLED_FRAME,)] * 40 + [("load",)] * 2
    # every block keeps its exact size and place
    assert sum(b["requested_size"] for b in live) == sum(block.size_bytes for block in segment.blocks) \
        == 45 * 16 * KiB + 2 * MiB


# ---- a recording ----

def test_a_replayed_recording_of_sampled_blocks_gives_the_live_estimates(tmp_path, capsys):
    """GIVEN an agent with sampled blocks before a recording starts (its checkpoint) and after (its events),
    WHEN the recording is replayed,
    THEN each block is weighed as live: the same entries with the same sampling, the same flame graph, the same
    suspects marked estimated."""
    start = time.time_ns()
    agent, _ = sampled_agent(ts=start - 100 * NS)  # in the checkpoint
    recorder = FileRecorder(agent.session, tmp_path / "r.kvtrace", 60.0)
    recorder.start()
    forward = agent.stacks.intern(Stack((Frame("forward", "/app/model.py", 30),)))
    later = [block_event(0x5000_0000 + i * 16 * KiB, stack_id=forward, ts=start + NS + i) for i in range(3)]
    later += [block_event(0x5100_0000 + i * 16 * KiB, status=StackStatus.NOT_SAMPLED, ts=start + NS + i)
              for i in range(30)]
    agent.apply(*later)  # in its events
    recorder.stop()
    replayed = replay(tmp_path / "r.kvtrace")

    def sampling(session):
        return sorted((e.key, e.size_bytes, e.stack_id, e.sample_bytes, e.sampled) for e in session.outstanding())

    assert sampling(replayed.session) == sampling(agent.session)
    assert sum(1 for e in replayed.session.outstanding() if e.sample_bytes and not e.sampled) == 40 + 30
    assert sum(estimated_bytes(e) for e in replayed.session.outstanding()) == \
        pytest.approx(sum(estimated_bytes(e) for e in agent.session.outstanding()))
    with served(agent) as (server, _):
        socket = str(server.config.admin_path)
        live = [_cli("flamegraph", "--blocks", "--socket", socket), _cli("leaks", "--json", "--socket", socket)]
    from_file = [_cli("flamegraph", "--blocks", "--input", str(tmp_path / "r.kvtrace")),
                 _cli("leaks", "--json", "--input", str(tmp_path / "r.kvtrace"))]
    assert from_file[0] == live[0] and "forward (/app/model.py:30)" in from_file[0]

    def suspects(text):
        return [(s["stack_id"], s["outstanding_bytes"], s["allocation_count"], s["estimated"])
                for s in json.loads(text)["suspects"]]

    assert suspects(from_file[1]) == suspects(live[1])
    assert any(estimated for *_, estimated in suspects(live[1]))


def _cli(*argv: str) -> str:
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(list(argv)) == 0
    return out.getvalue()
