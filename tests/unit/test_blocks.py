"""PyTorch blocks on synthetic events: nesting in segments (cudaMalloc and runs of VMM mappings),
free stretches and fragmentation, leak suspects by the block's stack, and what `kvtrace ps`,
`kvtrace snapshot` (table and memory-viz) and GetGrowth show of them."""
import pickle

import pytest

from fake_agent import FakeAgent, MiB, event, served
from kvtrace.cli.main import main
from kvtrace.client import AgentClient
from kvtrace.model.blocks import fragmentation, segments_of
from kvtrace.model.depth import Depth, DepthCause, ProcessDepth
from kvtrace.model.events import Api, Kind, Layer, Memory, ObjectKind
from kvtrace.model.ledger import Ledger
from kvtrace.model.stacks import Frame, Stack

T0 = 1_700_000_000_000_000_000
SEGMENT = 0x7F00_0000_0000  # a 20 MiB cudaMalloc segment
VMM = 0x7E00_0000_0000  # an expandable segment: two 2 MiB mappings back to back


def segment(address=SEGMENT, size=20 * MiB, pid=200, device=0, stack_id=0):
    """cudaMalloc as the probes see it: the runtime call and the driver allocation inside it."""
    return [event(api=Api.cuMemAlloc_v2, pid=pid, address=address, size=size, device=device, ts=T0,
                  stack_id=stack_id),
            event(api=Api.cudaMalloc, layer=Layer.RUNTIME, pid=pid, address=address, size=size, device=device,
                  ts=T0, stack_id=stack_id)]


def block(address, size, pid=200, device=0, stack_id=0, ts=T0, stream=0):
    return event(api=Api.pytorch_malloc, layer=Layer.TORCH, obj=ObjectKind.BLOCK, pid=pid, address=address,
                 size=size, device=device, stack_id=stack_id, ts=ts, stream=stream)


def mapping(address, size, handle, pid=200, device=0):
    return [event(api=Api.cuMemCreate, layer=Layer.VMM, obj=ObjectKind.VMM_HANDLE, pid=pid, address=handle,
                  size=size, device=device, ts=T0),
            event(kind=Kind.MAP, api=Api.cuMemMap, layer=Layer.VMM, obj=ObjectKind.VMM_MAPPING,
                  memory=Memory.NONE, pid=pid, address=address, size=size, device=device, handle=handle, ts=T0)]


def ledger_of(*events):
    ledger = Ledger()
    for item in events:
        ledger.apply(item)
    return ledger


def test_blocks_nest_in_their_segment_with_free_stretches_and_fragmentation():
    # GIVEN a 20 MiB segment holding blocks at 0-1, 4-6 and 10-11 MiB, and a block in no segment
    ledger = ledger_of(*segment(), block(SEGMENT, MiB), block(SEGMENT + 4 * MiB, 2 * MiB),
                       block(SEGMENT + 10 * MiB, MiB), block(0x6000_0000_0000, MiB))
    segments, outside = segments_of(ledger)
    (only,) = segments
    assert (only.address, only.size_bytes, only.device, only.expandable) == (SEGMENT, 20 * MiB, 0, False)
    assert [b.key.address - SEGMENT for b in only.blocks] == [0, 4 * MiB, 10 * MiB]
    assert only.free_runs() == [(SEGMENT + MiB, 3 * MiB), (SEGMENT + 6 * MiB, 4 * MiB), (SEGMENT + 11 * MiB, 9 * MiB)]
    assert (only.allocated_bytes, only.free_bytes, only.largest_free_bytes) == (4 * MiB, 16 * MiB, 9 * MiB)
    assert [b.key.address for b in outside] == [0x6000_0000_0000]
    (row,) = fragmentation(segments, outside)
    assert (row.reserved_bytes, row.allocated_bytes, row.largest_free_bytes) == (20 * MiB, 4 * MiB, 9 * MiB)
    assert (row.segments, row.blocks, row.blocks_outside_segments) == (1, 3, 1)
    assert row.ratio == pytest.approx(1 - 9 / 16)


def test_contiguous_vmm_mappings_are_one_expandable_segment_a_block_may_straddle():
    ledger = ledger_of(*mapping(VMM, 2 * MiB, 0x11), *mapping(VMM + 2 * MiB, 2 * MiB, 0x12),
                       *mapping(VMM + 8 * MiB, 2 * MiB, 0x13),  # not contiguous: its own segment
                       block(VMM + MiB, 2 * MiB))  # spans the two first mappings
    segments, outside = segments_of(ledger)
    assert [(s.address, s.size_bytes, s.expandable) for s in segments] == [
        (VMM, 4 * MiB, True), (VMM + 8 * MiB, 2 * MiB, True)]
    assert [len(s.blocks) for s in segments] == [1, 0] and outside == []


def test_processes_without_blocks_have_no_segments_and_no_fragmentation():
    segments, outside = segments_of(ledger_of(*segment(pid=300)))
    assert segments == [] and outside == [] and fragmentation(segments, outside) == []


def test_all_free_and_all_full_segments():
    empty, _ = segments_of(ledger_of(*segment(), *segment(address=SEGMENT + 64 * MiB), block(SEGMENT, 20 * MiB)))
    rows = fragmentation(empty, [])
    (row,) = rows
    # One segment full, one empty: the free memory is one stretch, no fragmentation.
    assert (row.free_bytes, row.largest_free_bytes, row.ratio) == (20 * MiB, 20 * MiB, 0.0)
    full, _ = segments_of(ledger_of(*segment(), block(SEGMENT, 20 * MiB)))
    assert fragmentation(full, [])[0].ratio == 0.0  # nothing free: 0, not a division by zero


def leaky_agent() -> tuple[FakeAgent, int, int]:
    """Pid 200: a segment its temporaries made the cache grow with (stack `grow_cache`), and blocks
    kept by `keep_activation` over a minute, 1 MiB a second."""
    agent = FakeAgent()
    temporaries = agent.stacks.intern(Stack((Frame("grow_cache", "/app/step.py", 9),)))
    keeper = agent.stacks.intern(Stack((Frame("keep_activation", "/app/leak.py", 3),
                                        Frame("step", "/app/step.py", 12))))
    agent.apply(*segment(size=128 * MiB, stack_id=temporaries))  # the temporaries made the cache grow
    for second in range(61):
        agent.apply(block(SEGMENT + second * MiB, MiB, stack_id=keeper, ts=T0 + second * 10**9, stream=7))
        agent.analyze(T0 + second * 10**9, second * 10**9)
    agent.freeze_clock(T0 + 60 * 10**9)
    return agent, temporaries, keeper


def test_leak_suspects_name_the_stack_that_holds_the_blocks():
    agent, temporaries, keeper = leaky_agent()
    report = agent.analyzer.leak_report(min_age_seconds=0)
    assert report.allocations_considered == 61  # the blocks, not the segment
    assert report.suspects[0].stack.frames[0].function == "keep_activation"
    assert report.suspects[0].outstanding_bytes == 61 * MiB
    assert all(suspect.stack_id != temporaries for suspect in report.suspects)


def test_growth_ps_snapshot_and_memory_viz_show_the_blocks(tmp_path, capsys):
    agent, _, _ = leaky_agent()
    with served(agent) as (server, _):
        socket = str(server.config.socket)
        with AgentClient.for_socket(server.config.socket) as client:
            (row,) = [row for row in client.growth().processes if row.pid == 200]
        assert row.HasField("fragmentation")
        assert (row.fragmentation.reserved_bytes, row.fragmentation.allocated_bytes,
                row.fragmentation.largest_free_bytes, row.fragmentation.blocks) == (128 * MiB, 61 * MiB, 67 * MiB, 61)
        assert main(["ps", "--socket", socket]) == 0
        ps = capsys.readouterr().out.splitlines()
        assert ps[0].split()[5:7] == ["TENSORS", "FRAG"]
        assert ps[1].split()[:2] == ["200", "0"] and ps[1].split()[8:10] == ["61.0", "MiB"] and "0%" in ps[1]
        assert main(["snapshot", "-p", "200", "--socket", socket]) == 0
        table = capsys.readouterr().out
        assert "segment 0x7f0000000000: 61 blocks, 61.0 MiB allocated, 67.0 MiB free, largest free 67.0 MiB" in table
        assert table.count(" torch   block ") == 61
        pickle_path = tmp_path / "200.pickle"
        assert main(["snapshot", "-p", "200", "--format", "memory-viz", "-o", str(pickle_path),
                     "--socket", socket]) == 0
        assert "wrote" in capsys.readouterr().err
        # Without blocks traced (depth segments): each segment as one block, held by the stack that grew it,
        # and a line that says so.
        agent.apply(*segment(pid=300, stack_id=agent.stacks.intern(Stack((Frame("load", "/app/load.py", 4),)))))
        agent.session.set_process_depth(ProcessDepth(300, Depth.SEGMENTS, T0, DepthCause.DEFAULT))
        segments_only = tmp_path / "300.pickle"
        assert main(["snapshot", "-p", "300", "--format", "memory-viz", "-o", str(segments_only),
                     "--socket", socket]) == 0
        said = capsys.readouterr().err
        assert "1 segments, no block traced" in said and "kvtrace deep --pid 300" in said
        assert "no PyTorch block of pid 300 is traced (its depth is segments" in said
        (shown,) = pickle.loads(segments_only.read_bytes())["segments"]
        assert [(block["size"], [frame["name"] for frame in block["frames"]]) for block in shown["blocks"]] == [
            (20 * MiB, ["[blocks not traced: the stack that allocated this segment]", "load"])]
        # A process whose blocks are traced but that holds no tensor: its segments are free cache, not held.
        agent.apply(*segment(pid=500, address=SEGMENT + 256 * MiB))
        agent.session.set_process_depth(ProcessDepth(500, Depth.BLOCKS, T0 + 10**9, DepthCause.OPERATOR))
        empty = tmp_path / "500.pickle"
        assert main(["snapshot", "-p", "500", "--format", "memory-viz", "-o", str(empty), "--socket", socket]) == 0
        said = capsys.readouterr().err  # (raised after its segment came: what PyTorch put there before is unknown)
        assert "1 segments, 0 blocks" in said and "1 of its segments are older" in said
        (shown,) = pickle.loads(empty.read_bytes())["segments"]
        assert [block["state"] for block in shown["blocks"]] == ["inactive"]
        # Without GPU memory, or without -p / -o: one clear line, no file.
        assert main(["snapshot", "-p", "100", "--format", "memory-viz", "-o", str(tmp_path / "x"),
                     "--socket", socket]) == 1
        assert "no GPU memory is traced in pid 100" in capsys.readouterr().err and not (tmp_path / "x").exists()
        assert main(["snapshot", "--format", "memory-viz", "--socket", socket]) == 2
        assert "-p PID -o FILE.pickle" in capsys.readouterr().err
        # Segments the viewer would draw wrong (overlapping): said in one line, no file.
        agent.apply(*segment(pid=400), *segment(pid=400, address=SEGMENT + MiB), block(SEGMENT, MiB, pid=400))
        overlapping = tmp_path / "400.pickle"
        assert main(["snapshot", "-p", "400", "--format", "memory-viz", "-o", str(overlapping),
                     "--socket", socket]) == 1
        error = capsys.readouterr().err
        assert "overlaps" in error and "--format json" in error and not overlapping.exists()
    snapshot = pickle.loads(pickle_path.read_bytes())
    (viz,) = snapshot["segments"]
    assert (viz["address"], viz["total_size"], viz["allocated_size"]) == (SEGMENT, 128 * MiB, 61 * MiB)
    assert sum(block["size"] for block in viz["blocks"]) == 128 * MiB
    active = [block for block in viz["blocks"] if block["state"] == "active_allocated"]
    assert len(active) == 61 and active[0]["frames"][0]["name"] == "keep_activation"
    assert len(snapshot["device_traces"][0]) == 61
