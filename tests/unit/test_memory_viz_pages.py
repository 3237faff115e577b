"""The memory-viz export built from a listing's pages in columns (ExportBuilder, what `kvtrace snapshot --format
memory-viz` does) writes a file that reads back the same, element for element, as the export built from the
model's entries (segments_of, viz_segments, snapshot_dict and pickle.dump: the path it replaced), on a known
ledger with every case the layout has: gaps, roundings clipped by the next block and by the segment end, an
expandable run of mappings, a segment on an unknown device, blocks in no segment, stacks shared and missing,
sampled stacks passed over, equal times, two devices, other processes' entries; in pages in any order, in
columns or as rows (an older agent)."""
import pickle
import pickletools
import random

import pytest

from kvtrace._proto.kvtrace.v1 import agent_service_pb2 as service_pb2
from kvtrace.model.blocks import segments_of
from kvtrace.model.events import Api, Layer, Memory, ObjectKind
from kvtrace.model.ledger import LedgerKey, Outstanding
from kvtrace.model.processes import ProcessInfo
from kvtrace.model.stacks import Frame, Stack
from kvtrace.reports.memory_viz import snapshot_dict, viz_segments, write_pickle
from kvtrace.reports.viz_export import ExportBuilder
from kvtrace.wire import columns_from_snapshot, outstanding_to_columns, outstanding_to_proto, stack_message
from test_memory_viz import VIEWER_OPCODES

KiB, MiB = 1 << 10, 1 << 20
PID, OTHER = 4242, 77
T0 = 1_765_000_000_000_000_000
STACKS = {
    11: Stack((Frame("keep_activation", "/srv/model.py", 111), Frame("forward", "/srv/model.py", 5))),
    12: Stack((Frame("kv_cache", "/srv/cache.py", 12),)),
    13: Stack((Frame("keep_activation", "/srv/model.py", 111), Frame("forward", "/srv/model.py", 5))),  # = 11
}  # 14 is referred to but never defined


def entry(pid, layer, kind, address, size, timestamp_ns, device=0, api=Api.cudaMalloc, memory=Memory.DEVICE,
          stack_id=0, stream=0, sample_bytes=0, sampled=False, handle=0):
    return Outstanding(LedgerKey(pid, layer, kind, address), size, timestamp_ns, device, api, memory, 1, 0x5555,
                       0, False, handle, stack_id, stream, sample_bytes, sampled)


def segment(address, size, device=0, pid=PID):
    return [entry(pid, Layer.RUNTIME, ObjectKind.ALLOCATION, address, size, T0, device),
            entry(pid, Layer.DRIVER, ObjectKind.ALLOCATION, address, size, T0, device, Api.cuMemAlloc_v2)]


def block(address, size, timestamp_ns, device=0, pid=PID, **fields):
    return entry(pid, Layer.TORCH, ObjectKind.BLOCK, address, size, timestamp_ns, device, Api.pytorch_malloc,
                 **fields)


def known_ledger() -> list[Outstanding]:
    a, b, c, d = 0x7F00_0000_0000, 0x7F00_1000_0000, 0x7E00_0000_0000, 0x7F00_2000_0000
    vmm = 0x7F80_0000_0000
    entries = [
        *segment(a, 2 * MiB), *segment(b, 20 * MiB), *segment(c, 20 * MiB, device=1), *segment(d, 2 * MiB, -1),
        *segment(0x7F00_3000_0000, 2 * MiB),  # holds no block
        # an expandable segment: two contiguous mappings, and one apart
        entry(PID, Layer.VMM, ObjectKind.VMM_MAPPING, vmm, 20 * MiB, T0, 0, Api.cuMemMap, handle=1),
        entry(PID, Layer.VMM, ObjectKind.VMM_MAPPING, vmm + 20 * MiB, 20 * MiB, T0, 0, Api.cuMemMap, handle=2),
        entry(PID, Layer.VMM, ObjectKind.VMM_MAPPING, vmm + 100 * MiB, 2 * MiB, T0, 0, Api.cuMemMap, handle=3),
        # another process's segment and block: left out
        *segment(a, 2 * MiB, pid=OTHER), block(a, 512, T0, pid=OTHER, stack_id=12),
    ]
    # a: small blocks with gaps; one rounded into the next (700 B at +0, the next at +768); the last ends it
    entries += [block(a + offset, size, T0 + k * 1000, stack_id=11 + k % 4)
                for k, (offset, size) in enumerate([(0, 700), (768, 1), (4096, 4096), (64 * KiB, 100_000),
                                                    (2 * MiB - 600, 600)])]
    # b: contiguous blocks of 512 B, times out of address order, some at the same time (ties by address)
    entries += [block(b + 512 * k, 512, T0 + (37 * k) % 50 * 1000, stack_id=11, stream=0x99 if k % 7 == 0 else 0)
                for k in range(200)]
    # c (device 1): a block clipped by the segment's end, sampled stacks, one passed over
    entries += [block(c, 3 * MiB + 5, T0 + 5, 1, stack_id=12, sample_bytes=4 * MiB, sampled=True),
                block(c + 4 * MiB, 1000, T0 + 6, 1, sample_bytes=4 * MiB, sampled=False),
                block(c + 20 * MiB - 600, 600, T0 + 7, 1, stack_id=14)]
    # d (unknown device): its blocks say device 1
    entries += [block(d + 1024, 2048, T0 + 3, -1), block(d + 8192, 2048, T0 + 4, 1, stack_id=11)]
    # the expandable run: a large block; and the mapping apart: small ones
    entries += [block(vmm + 4 * MiB, 3 * MiB, T0 + 9, stack_id=12), block(vmm + 30 * MiB, 10 * MiB, T0 + 9)]
    entries += [block(vmm + 100 * MiB + 512 * k, 512, T0 + 10 + k) for k in range(8)]
    # blocks in no segment: before every segment, and one running past its segment's end
    entries += [block(0x1000, 512, T0), block(a + 2 * MiB - 100, 512, T0 + 1)]
    return entries


def old_file(entries, path) -> bytes:
    segments, _ = segments_of([e for e in entries if e.key.pid == PID])
    write_pickle(path, snapshot_dict(viz_segments(segments, STACKS.get)))
    return path.read_bytes()


def pages(entries, page_size, encoding):
    """The entries as GetSnapshot would send them: pages of `page_size`, each with its stacks."""
    process = ProcessInfo(PID, "python serve.py", "python", "", "", 0.0, 0.0)
    for start in range(0, len(entries), page_size):
        page = entries[start:start + page_size]
        response = service_pb2.GetSnapshotResponse(stacks=[
            stack_message(stack_id, STACKS[stack_id]) for stack_id in sorted({e.stack_id for e in page})
            if stack_id in STACKS])
        if encoding == service_pb2.SNAPSHOT_ENCODING_COLUMNS:
            outstanding_to_columns(page, {PID: process, OTHER: None}, response.columns)
        else:
            response.allocations.extend(outstanding_to_proto(e, process) for e in page)
        parsed = service_pb2.GetSnapshotResponse.FromString(response.SerializeToString())
        # (the columns the command asks for, as it does)
        yield (columns_from_snapshot(parsed, ExportBuilder.FIELDS),
               {stack.stack_id: STACKS[stack.stack_id] for stack in parsed.stacks})


def new_export(entries, page_size, encoding):
    builder = ExportBuilder(PID)
    for columns, stacks in pages(entries, page_size, encoding):
        builder.add(columns, stacks)
    return builder.finish()


@pytest.mark.parametrize("encoding", [service_pb2.SNAPSHOT_ENCODING_COLUMNS, service_pb2.SNAPSHOT_ENCODING_MESSAGES])
@pytest.mark.parametrize("seed,page_size", [(0, 10_000), (1, 7), (2, 1), (3, 64)])
def test_pages_give_the_same_file_as_the_model_path(tmp_path, encoding, seed, page_size):
    # GIVEN a known ledger, listed in some order (the kernel's map has none) in pages
    entries = known_ledger()
    random.Random(seed).shuffle(entries)
    expected = old_file(entries, tmp_path / "old.pickle")
    # WHEN the export is built from the pages as they come
    export = new_export(entries, page_size, encoding)
    export.write(tmp_path / "new.pickle")
    # THEN it reads back the same, element for element, and so do the counts the command prints
    written = (tmp_path / "new.pickle").read_bytes()
    snapshot = pickle.loads(expected)
    assert pickle.loads(written) == snapshot
    # in what the viewer reads: its opcodes, numbers it reads as Numbers (LONG1 of at most 8 bytes), lists in
    # batches it can spread into a call; and each stack's frames once
    ops = list(pickletools.genops(written))
    assert {op.name for op, _, _ in ops} <= VIEWER_OPCODES
    assert all(len(arg.to_bytes(16, "little", signed=True).rstrip(b"\0")) <= 8 for op, arg, _ in ops
               if op.name == "LONG1")
    assert written.count(b"keep_activation") == expected.count(b"keep_activation") == 1
    assert (tmp_path / "new.pickle").stat().st_mode & 0o777 == 0o600
    assert (export.segments, export.blocks, export.outside, export.passed) == (
        len(snapshot["segments"]), sum(len(trace) for trace in snapshot["device_traces"]), 2, 1)
    # (the ledger has what it claims: ties in time, a clipped rounding, two devices, frames shared)
    assert export.segments == 7 and len(snapshot["device_traces"]) == 2
    trace = snapshot["device_traces"][0]
    assert any(x["time_us"] == y["time_us"] and x["addr"] < y["addr"] for x, y in zip(trace, trace[1:], strict=False))
    sizes = {b["address"]: b["size"] for s in snapshot["segments"] for b in s["blocks"]}
    assert sizes[0x7F00_0000_0000] == 768 and sizes[0x7E00_0000_0000 + 20 * MiB - 600] == 600


@pytest.mark.parametrize("bad, message", [
    ([block(0x7F00_0000_0000 + 1024, 4096, T0 + 1)], "overlap"),  # into the block at +0 (8 KiB)
    ([block(0x7F00_0000_0000 + 64 * KiB, 0, T0 + 1)], "has size 0"),
    (segment(0x7F00_0000_0000 + MiB, 2 * MiB), "overlaps"),
])
def test_what_the_model_path_refuses_the_pages_refuse_with_the_same_words(tmp_path, bad, message):
    entries = [*segment(0x7F00_0000_0000, 2 * MiB), block(0x7F00_0000_0000, 8192, T0), *bad]
    segments, _ = segments_of(entries)
    with pytest.raises(ValueError, match=message) as old:
        snapshot_dict(viz_segments(segments, STACKS.get))
    export = new_export(entries, 2, service_pb2.SNAPSHOT_ENCODING_COLUMNS)
    with pytest.raises(ValueError) as new:
        export.write(tmp_path / "refused.pickle")
    assert str(new.value) == str(old.value) and not (tmp_path / "refused.pickle").exists()


def test_a_page_of_columns_of_different_lengths_is_refused():
    response = service_pb2.GetSnapshotResponse()
    response.columns.pid.extend([PID, PID])
    response.columns.address.extend([1])
    with pytest.raises(ValueError, match="address has 1 entries for 2 objects"):
        columns_from_snapshot(response)


def test_a_number_a_run_cannot_hold_is_written_alone(tmp_path):
    # a stream of 2**63 or more (none in practice) does not fit a run's LONG1 of 8 bytes: written as pickle.dump does
    entries = [*segment(0x7F00_0000_0000, 2 * MiB), *(block(0x7F00_0000_0000 + 512 * k, 512, T0 + k, stack_id=11,
                                                             stream=(1 << 63) + 5 if k == 2 else k) for k in range(5))]
    export = new_export(entries, 3, service_pb2.SNAPSHOT_ENCODING_COLUMNS)
    export.write(tmp_path / "new.pickle")
    snapshot = pickle.loads((tmp_path / "new.pickle").read_bytes())
    assert snapshot == pickle.loads(old_file(entries, tmp_path / "old.pickle"))
    assert [entry["stream"] for entry in snapshot["device_traces"][0]] == [0, 1, (1 << 63) + 5, 3, 4]


def test_a_process_without_traced_blocks_shows_each_segment_as_one_block_held_by_its_allocating_stack(tmp_path):
    # GIVEN a process at depth segments: two cudaMalloc segments (their stacks) and a run of two VMM mappings,
    # no block, listed in pages of 2 (another process's block left out)
    a, b, vmm = 0x7E00_0000_0000, 0x7F00_1000_0000, 0x7F80_0000_0000
    entries = [entry(PID, Layer.RUNTIME, ObjectKind.ALLOCATION, b, 20 * MiB, T0 + 5, stack_id=12),
               entry(PID, Layer.DRIVER, ObjectKind.ALLOCATION, b, 20 * MiB, T0 + 5, api=Api.cuMemAlloc_v2),
               entry(PID, Layer.RUNTIME, ObjectKind.ALLOCATION, a, 1 << 30, T0 + 9, stack_id=11),
               entry(PID, Layer.VMM, ObjectKind.VMM_MAPPING, vmm + 20 * MiB, 20 * MiB, T0 + 3, 0, Api.cuMemMap,
                     stack_id=14, handle=2),
               entry(PID, Layer.VMM, ObjectKind.VMM_MAPPING, vmm, 20 * MiB, T0 + 1, 0, Api.cuMemMap, stack_id=12,
                     handle=1),
               *segment(a, 2 * MiB, pid=OTHER), block(a, 512, T0, pid=OTHER, stack_id=12)]
    # WHEN it is exported
    export = new_export(entries, 2, service_pb2.SNAPSHOT_ENCODING_COLUMNS)
    export.write(tmp_path / "segments.pickle")
    written = (tmp_path / "segments.pickle").read_bytes()
    snapshot = pickle.loads(written)
    # THEN each runtime segment and each VMM mapping is one live block of its whole size, its frames the marker and
    # then its allocating stack, and the trace has one alloc each, in time order; no traced block is counted
    assert export.segments_as_blocks and (export.segments, export.blocks, export.outside) == (3, 0, 0)
    marker = {"name": "[blocks not traced: the stack that allocated this segment]", "filename": "", "line": 0}
    keeper = [marker, {"name": "keep_activation", "filename": "/srv/model.py", "line": 111},
              {"name": "forward", "filename": "/srv/model.py", "line": 5}]
    cache = [marker, {"name": "kv_cache", "filename": "/srv/cache.py", "line": 12}]
    shown = [(s["address"], s["total_size"], s["allocated_size"], s["segment_type"],
              [(block["address"], block["size"], block["state"], block["frames"]) for block in s["blocks"]])
             for s in snapshot["segments"]]
    assert shown == [
        (a, 1 << 30, 1 << 30, "large", [(a, 1 << 30, "active_allocated", keeper)]),
        (b, 20 * MiB, 20 * MiB, "large", [(b, 20 * MiB, "active_allocated", cache)]),
        (vmm, 40 * MiB, 40 * MiB, "large", [(vmm, 20 * MiB, "active_allocated", cache),
                                            (vmm + 20 * MiB, 20 * MiB, "active_allocated", [marker])])]
    (trace,) = snapshot["device_traces"]
    assert [(alloc["action"], alloc["addr"], alloc["size"], alloc["time_us"]) for alloc in trace] == [
        ("alloc", vmm, 20 * MiB, (T0 + 1) // 1000), ("alloc", vmm + 20 * MiB, 20 * MiB, (T0 + 3) // 1000),
        ("alloc", b, 20 * MiB, (T0 + 5) // 1000), ("alloc", a, 1 << 30, (T0 + 9) // 1000)]
    assert {op.name for op, _, _ in pickletools.genops(written)} <= VIEWER_OPCODES
    # and a process with blocks is shown as before: no marker; nor one whose blocks are traced but holds none
    with_blocks = new_export([*entries, block(a, 4096, T0 + 10, stack_id=11)], 3,
                             service_pb2.SNAPSHOT_ENCODING_COLUMNS)
    assert not with_blocks.segments_as_blocks and with_blocks.blocks == 1
    builder = ExportBuilder(PID)
    for columns, stacks in pages(entries, 2, service_pb2.SNAPSHOT_ENCODING_COLUMNS):
        builder.add(columns, stacks)
    traced_but_empty = builder.finish(blocks_traced=True)
    traced_but_empty.write(tmp_path / "empty.pickle")
    assert not traced_but_empty.segments_as_blocks and traced_but_empty.blocks == 0
    assert [[block["state"] for block in s["blocks"]] for s in pickle.loads(
        (tmp_path / "empty.pickle").read_bytes())["segments"]] == [["inactive"]] * 3
    with pytest.raises(RuntimeError, match="finished once"):
        builder.finish()
