"""The PyTorch memory snapshot export on synthetic segments: exact structure, the errors that catch
bad input, the file, and a render check with PyTorch's own _memory_viz (in this interpreter if it
has torch, else in KVTRACE_TORCH_PYTHON, else skipped with the reason)."""
import importlib.util
import inspect
import json
import os
import pickle
import pickletools
import subprocess

import pytest

from kvtrace.reports import memory_viz
from kvtrace.reports.memory_viz import (
    VizBlock,
    VizFrame,
    VizSegment,
    block_size_bytes,
    segment_type,
    snapshot_dict,
    write_pickle,
)

KiB = 1 << 10
MiB = 1 << 20
MS = 1_000_000  # ns

# GIVEN 3 segments on 2 devices holding 23 live blocks:
# A: device 0, small pool, 2 MiB; 13 blocks every 160 KiB, the first at the segment start, the 10th
#    filling its 160 KiB (no gap after it), the last ending at the segment end (no gap after it).
A_ADDRESS = 0x7F00_0000_0000
A_REQUESTED = (1, 512, 513, 4096, 100_000, 128 * KiB, 7, 64 * KiB, 1000, 160 * KiB, 2048, 99_999, 128 * KiB)
A_SIZES = (512, 512, 1024, 4096, 100_352, 128 * KiB, 512, 64 * KiB, 1024, 160 * KiB, 2048, 100_352, 128 * KiB)
# B: device 0, expandable, 40 MiB mapped, on a side stream; a 4 MiB gap first, the last block ends it.
B_ADDRESS = 0x7F10_0000_0000
B_STREAM = 0x5555_0000
B_OFFSETS = (4 * MiB, 8 * MiB, 12 * MiB + 512, 20 * MiB, 30 * MiB)
B_REQUESTED = (3 * MiB, 4 * MiB, MiB + 1, 10 * MiB - 100, 10 * MiB)
# C: device 1, large pool, 20 MiB; rounding clipped by the next block (700 B at 0, next at 768) and
#    by the segment end (600 B in the last 600 B).
C_ADDRESS = 0x7E00_0000_0000
C_OFFSETS = (0, 768, 2 * MiB, 5 * MiB, 20 * MiB - 600)
C_REQUESTED = (700, MiB + 1, 2 * MiB, 3 * MiB + 5, 600)


def stack(name, line):
    """Innermost first, as torch gives frames."""
    return (VizFrame(name, "/srv/model.py", line), VizFrame("forward", "/srv/model.py", 5),
            VizFrame("<module>", "serve.py", 1))


def synthetic():
    a = VizSegment(0, A_ADDRESS, 2 * MiB, 0, tuple(
        VizBlock(A_ADDRESS + k * 160 * KiB, size, (2 * k + 1) * MS + 123, stack(f"a{k}", 100 + k))
        for k, size in enumerate(A_REQUESTED)))
    # B's blocks come between A's in time (even milliseconds); the last one names its stream.
    b = VizSegment(0, B_ADDRESS, 40 * MiB, B_STREAM, tuple(
        VizBlock(B_ADDRESS + offset, size, 2 * j * MS, stack(f"b{j}", 200 + j), B_STREAM if j == 4 else 0)
        for j, (offset, size) in enumerate(zip(B_OFFSETS, B_REQUESTED, strict=True))), is_expandable=True)
    # Given out of time and address order: the export sorts.
    c = VizSegment(1, C_ADDRESS, 20 * MiB, 0, tuple(
        VizBlock(C_ADDRESS + offset, size, (50 - j) * MS, stack(f"c{j}", 300 + j))
        for j, (offset, size) in reversed(list(enumerate(zip(C_OFFSETS, C_REQUESTED, strict=True))))))
    return [c, b, a]


def layout(segment):
    """(state, offset in the segment, size, requested size) of each block."""
    return [(b["state"], b["address"] - segment["address"], b["size"], b["requested_size"]) for b in segment["blocks"]]


def test_synthetic_snapshot_has_the_exact_structure():
    # WHEN the snapshot is made
    snap = snapshot_dict(synthetic())
    segments = snap["segments"]
    # THEN segments come by (device, address) with torch's keys
    assert [(s["device"], s["address"]) for s in segments] == [(0, A_ADDRESS), (0, B_ADDRESS), (1, C_ADDRESS)]
    assert set(snap) == {"segments", "device_traces"}
    for s in segments:
        assert set(s) == {"device", "address", "total_size", "allocated_size", "active_size", "requested_size",
                          "stream", "segment_type", "segment_pool_id", "is_expandable", "frames", "blocks"}
        for b in s["blocks"]:
            assert set(b) == {"address", "size", "requested_size", "state", "frames"}
    a, b, c = segments
    assert sum(len(s["blocks"]) for s in segments) - sum(b["state"] == "inactive" for s in segments
                                                         for b in s["blocks"]) == 23

    # A: no leading gap, a gap after each block but the 10th and the last
    expected_a = []
    for k, (requested, size) in enumerate(zip(A_REQUESTED, A_SIZES, strict=True)):
        expected_a.append(("active_allocated", k * 160 * KiB, size, requested))
        if 160 * KiB - size and k < 12:
            expected_a.append(("inactive", k * 160 * KiB + size, 160 * KiB - size, 0))
    assert layout(a) == expected_a
    assert len(a["blocks"]) == 13 + 11
    assert (a["segment_type"], a["is_expandable"], a["stream"]) == ("small", False, 0)

    assert layout(b) == [
        ("inactive", 0, 4 * MiB, 0),
        ("active_allocated", 4 * MiB, 3 * MiB, 3 * MiB),
        ("inactive", 7 * MiB, MiB, 0),
        ("active_allocated", 8 * MiB, 4 * MiB, 4 * MiB),
        ("inactive", 12 * MiB, 512, 0),
        ("active_allocated", 12 * MiB + 512, MiB + 512, MiB + 1),
        ("inactive", 13 * MiB + 1024, 7 * MiB - 1024, 0),
        ("active_allocated", 20 * MiB, 10 * MiB, 10 * MiB - 100),
        ("active_allocated", 30 * MiB, 10 * MiB, 10 * MiB),
    ]
    assert (b["segment_type"], b["is_expandable"], b["stream"]) == ("large", True, B_STREAM)

    assert layout(c) == [
        ("active_allocated", 0, 768, 700),  # 1024 after rounding, clipped at the next block
        ("active_allocated", 768, MiB + 512, MiB + 1),
        ("inactive", MiB + 1280, MiB - 1280, 0),
        ("active_allocated", 2 * MiB, 2 * MiB, 2 * MiB),
        ("inactive", 4 * MiB, MiB, 0),
        ("active_allocated", 5 * MiB, 3 * MiB + 512, 3 * MiB + 5),
        ("inactive", 8 * MiB + 512, 12 * MiB - 600 - 512, 0),
        ("active_allocated", 20 * MiB - 600, 600, 600),  # clipped at the segment end
    ]
    assert c["segment_type"] == "large"

    for s in segments:
        active = [b for b in s["blocks"] if b["state"] == "active_allocated"]
        # sizes cover the segment exactly, addresses contiguous (the viewer recomputes each block's
        # address by adding up the sizes before it)
        assert sum(b["size"] for b in s["blocks"]) == s["total_size"]
        cursor = s["address"]
        for block in s["blocks"]:
            assert block["address"] == cursor and block["size"] > 0
            cursor += block["size"]
        assert s["allocated_size"] == s["active_size"] == sum(b["size"] for b in active)
        assert s["requested_size"] == sum(b["requested_size"] for b in active)
        assert s["frames"] == [] and s["segment_pool_id"] == (0, 0)
    assert a["allocated_size"] == sum(A_SIZES)
    assert b["requested_size"] == sum(B_REQUESTED)
    assert c["allocated_size"] == 768 + MiB + 512 + 2 * MiB + 3 * MiB + 512 + 600

    # frames: innermost first, torch's keys
    assert a["blocks"][0]["frames"] == [
        {"filename": "/srv/model.py", "line": 100, "name": "a0"},
        {"filename": "/srv/model.py", "line": 5, "name": "forward"},
        {"filename": "serve.py", "line": 1, "name": "<module>"},
    ]
    assert [b["frames"] for b in a["blocks"] if b["state"] == "inactive"] == [[]] * 11


def test_device_traces_hold_the_live_blocks_in_time_order():
    snap = snapshot_dict(synthetic())
    traces = snap["device_traces"]
    assert len(traces) == 2 and [len(t) for t in traces] == [18, 5]
    for device, trace in enumerate(traces):
        times = [e["time_us"] for e in trace]
        assert times == sorted(times)
        assert all(set(e) == {"action", "addr", "size", "stream", "time_us", "frames"} for e in trace)
        assert all(e["action"] == "alloc" for e in trace)
        # each entry is a live block of this device, with its requested size: the viewer skips a
        # snapshot block whose address has an alloc entry, so nothing is counted twice
        live = {b["address"]: b for s in snap["segments"] if s["device"] == device
                for b in s["blocks"] if b["state"] == "active_allocated"}
        assert sorted(e["addr"] for e in trace) == sorted(live)
        for e in trace:
            assert e["size"] == live[e["addr"]]["requested_size"] and e["frames"] == live[e["addr"]]["frames"]
    # device 0 interleaves B (even ms) and A (odd ms + 123 ns)
    assert [e["time_us"] for e in traces[0][:4]] == [0, 1000, 2000, 3000]
    assert [e["addr"] for e in traces[0][:3]] == [B_ADDRESS + B_OFFSETS[0], A_ADDRESS, B_ADDRESS + B_OFFSETS[1]]
    # a block without a stream of its own is on its segment's stream
    assert {e["stream"] for e in traces[0] if e["addr"] >= B_ADDRESS} == {B_STREAM}
    assert {e["stream"] for e in traces[0] if e["addr"] < B_ADDRESS} == {0}
    assert [e["addr"] - C_ADDRESS for e in traces[1]] == list(reversed(C_OFFSETS))


def test_no_segments_make_an_empty_snapshot():
    assert snapshot_dict([]) == {"segments": [], "device_traces": []}


def test_a_device_without_segments_gets_an_empty_trace():
    snap = snapshot_dict([VizSegment(2, 0x1000_0000, 2 * MiB, 0, ())])
    assert snap["device_traces"] == [[], [], []]
    assert layout(snap["segments"][0]) == [("inactive", 0, 2 * MiB, 0)]


@pytest.mark.parametrize(("size", "expandable", "block_bytes", "expected"), [
    (2 * MiB, False, 512, "small"),
    (20 * MiB, False, 512, "large"),
    (12 * MiB, False, 11 * MiB, "large"),
    (6 * MiB, True, 4096, "small"),
    (6 * MiB, True, 2 * MiB, "large"),
    (40 * MiB, True, 4096, "large"),
])
def test_segment_type_follows_the_pool_sizes(size, expandable, block_bytes, expected):
    segment = VizSegment(0, 0x10_0000_0000, size, 0, (VizBlock(0x10_0000_0000, block_bytes, 0, ()),), expandable)
    assert segment_type(segment) == expected


def test_block_sizes_round_to_512_bytes():
    assert [block_size_bytes(n) for n in (1, 511, 512, 513, 1024, 1025)] == [512, 512, 512, 1024, 1024, 1536]


def one_segment(*blocks):
    return [VizSegment(1, 0x7000_0000, 2 * MiB, 0, tuple(VizBlock(a, n, 0, ()) for a, n in blocks))]


@pytest.mark.parametrize("blocks", [
    [(0x7000_0000 - 512, 1024)],  # starts before the segment
    [(0x7000_0000 + 2 * MiB - 512, 1024)],  # runs past its end
    [(0x7000_0000 + 2 * MiB, 1)],  # starts at its end
])
def test_a_block_outside_its_segment_is_refused(blocks):
    address = blocks[0][0]
    with pytest.raises(ValueError, match=f"block at {address:#x} .* lies outside segment 0x70000000\\+2097152 "
                                         "on device 1"):
        snapshot_dict(one_segment(*blocks))


@pytest.mark.parametrize("blocks", [
    [(0x7000_0000, 1024), (0x7000_0000 + 1000, 512)],  # the second starts inside the first
    [(0x7000_0000 + 4096, 512), (0x7000_0000 + 4096, 512)],  # the same address twice
])
def test_overlapping_blocks_are_refused(blocks):
    first, second = sorted(blocks)
    with pytest.raises(ValueError, match=f"blocks at {first[0]:#x} .* and {second[0]:#x} overlap in segment "
                                         "0x70000000\\+2097152 on device 1"):
        snapshot_dict(one_segment(*blocks))


def test_overlapping_segments_and_empty_sizes_are_refused():
    with pytest.raises(ValueError, match="segment 0x70100000\\+2097152 on device 0 overlaps segment 0x70000000"):
        snapshot_dict([VizSegment(0, 0x7000_0000, 2 * MiB, 0, ()), VizSegment(0, 0x7010_0000, 2 * MiB, 0, ())])
    # the same addresses on two devices are two memories, not an overlap
    snapshot_dict([VizSegment(0, 0x7000_0000, 2 * MiB, 0, ()), VizSegment(1, 0x7000_0000, 2 * MiB, 0, ())])
    with pytest.raises(ValueError, match="has size 0"):
        snapshot_dict(one_segment((0x7000_0000, 0)))
    with pytest.raises(ValueError, match="size >= 1 byte"):
        snapshot_dict([VizSegment(0, 0x7000_0000, 0, 0, ())])


# What the pytorch.org viewer's own JavaScript unpickler (torch/utils/viz/MemoryViz.js) understands;
# any other opcode makes it throw "UNKNOWN OPCODE".
VIEWER_OPCODES = {
    "PROTO", "FRAME", "STOP", "MARK", "MEMOIZE", "BINPUT", "LONG_BINPUT", "BINGET", "LONG_BINGET",
    "EMPTY_DICT", "DICT", "SETITEM", "SETITEMS", "EMPTY_LIST", "LIST", "APPEND", "APPENDS",
    "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "NONE", "NEWTRUE", "NEWFALSE",
    "BININT", "BININT1", "BININT2", "LONG1", "BINFLOAT", "SHORT_BINUNICODE", "BINUNICODE",
}


def test_pickle_round_trips_in_a_form_the_viewer_reads(tmp_path):
    snap = snapshot_dict(synthetic())
    path = tmp_path / "snap.pickle"
    path.write_bytes(b"old")
    write_pickle(path, snap)  # replaces an existing file
    data = path.read_bytes()
    assert data[:2] == b"\x80\x04"  # protocol 4
    assert pickle.loads(data) == snap
    assert {op.name for op, _, _ in pickletools.genops(data)} <= VIEWER_OPCODES
    assert sorted(p.name for p in tmp_path.iterdir()) == ["snap.pickle"]  # no temporary left
    assert path.stat().st_mode & 0o777 == 0o600  # as every export: its stacks name files and processes


def test_write_pickle_refuses_a_directory_and_leaves_no_half_file(tmp_path, monkeypatch):
    with pytest.raises(IsADirectoryError, match=f"{tmp_path} is a directory"):
        write_pickle(tmp_path, {})
    path = tmp_path / "snap.pickle"
    path.write_bytes(b"previous snapshot")

    def crash(*_args, **_kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(memory_viz.pickle, "dump", crash)
    with pytest.raises(OSError, match="No space left"):
        write_pickle(path, snapshot_dict(synthetic()))
    assert path.read_bytes() == b"previous snapshot"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["snap.pickle"]


def torch_render_check(snapshot_path, out_dir, expected):
    """Runs in an interpreter that has torch (this one, or KVTRACE_TORCH_PYTHON through
    inspect.getsource), so it imports what it needs itself and returns only JSON values."""
    import base64
    import pickle
    import re
    import subprocess
    import sys

    import torch
    from torch.cuda import _memory_viz as viz

    with open(snapshot_path, "rb") as f:
        data = pickle.load(f)
    result = {"torch_version": torch.__version__, "plots": {}, "segsum": {}, "cli": {}}
    for name, html in (("trace_plot", viz.trace_plot(data)),
                       ("trace_plot_segments", viz.trace_plot(data, plot_segments=True)),
                       ("segment_plot", viz.segment_plot(data))):
        payload = re.search(r'"base64": "([A-Za-z0-9+/=]+)"', html)
        result["plots"][name] = {
            "html": html.lstrip().startswith("<!DOCTYPE html>") and "MemoryViz.js" in html,
            "same_snapshot": payload is not None and pickle.loads(base64.b64decode(payload.group(1))) == data,
        }
    # Totals as torch's own `stats` computes them, for all devices and each one.
    for key, numbers in expected.items():
        part = data if key == "all" else {**data, "segments": [s for s in data["segments"]
                                                                if s["device"] == int(key)]}
        text = viz.segsum(part)
        result["segsum"][key] = {
            "torch": [line for line in text.splitlines() if line.startswith(("total_allocated", "total_reserved"))],
            "ours": [f"total_reserved: {viz.Bytes(numbers['reserved'])}",
                     f"total_allocated: {viz.Bytes(numbers['requested'])}"],
        }
    result["calc_active"] = [[s["device"], s["address"], viz.calc_active(s)] for s in data["segments"]]
    result["memory_flamegraph"] = viz.memory(data, format_flamegraph=lambda lines: lines)
    result["segments_flamegraph"] = viz.segments(data, format_flamegraph=lambda lines: lines)
    result["trace_text"] = viz.trace(data)
    filtered = viz.filter_alloc_free_pairs(pickle.loads(pickle.dumps(data)))
    result["filter_freed_keeps"] = [len(t) for t in filtered["device_traces"]]
    # The command line an operator runs on the file.
    for action in ("trace_plot", "segment_plot", "stats", "trace"):
        args = [sys.executable, "-m", "torch.cuda._memory_viz", action, snapshot_path]
        if action.endswith("plot"):
            args += ["-o", f"{out_dir}/{action}.html"]
        run = subprocess.run(args, capture_output=True, text=True, timeout=300)
        result["cli"][action] = {"rc": run.returncode, "stderr": run.stderr[-2000:]}
        if action.endswith("plot") and run.returncode == 0:
            with open(f"{out_dir}/{action}.html") as f:
                result["cli"][action]["html_bytes"] = len(f.read())
    return result


def run_torch_render_check(snapshot_path, out_dir, expected):
    if importlib.util.find_spec("torch") is not None:
        return torch_render_check(str(snapshot_path), str(out_dir), expected)
    python = os.environ.get("KVTRACE_TORCH_PYTHON")
    if not python:
        pytest.skip("render check: torch is not importable in this interpreter and KVTRACE_TORCH_PYTHON is not set "
                    "(set it to a Python that has torch, e.g. one with `pip install torch==2.13.0`)")
    source = inspect.getsource(torch_render_check) + (
        "\nimport json, sys\n"
        "print(json.dumps(torch_render_check(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))))\n")
    run = subprocess.run([python, "-c", source, str(snapshot_path), str(out_dir), json.dumps(expected)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"{python} failed:\n{run.stderr[-4000:]}"
    return json.loads(run.stdout.splitlines()[-1])


def test_pytorch_memory_viz_renders_the_snapshot(tmp_path):
    segments = synthetic()
    snap = snapshot_dict(segments)
    path = tmp_path / "snap.pickle"
    write_pickle(path, snap)
    requested = {d: sum(b.requested_bytes for s in segments if s.device == d for b in s.blocks) for d in (0, 1)}
    reserved = {d: sum(s.size_bytes for s in segments if s.device == d) for d in (0, 1)}
    expected = {"all": {"requested": sum(requested.values()), "reserved": sum(reserved.values())}}
    expected |= {str(d): {"requested": requested[d], "reserved": reserved[d]} for d in (0, 1)}

    result = run_torch_render_check(path, tmp_path, expected)
    print(f"torch {result['torch_version']}")

    for name, plot in result["plots"].items():
        assert plot == {"html": True, "same_snapshot": True}, name
    for key, totals in result["segsum"].items():
        assert totals["torch"] == totals["ours"], key
    # per segment, torch's calc_active is our allocated_size; per device, the sum of our blocks
    assert result["calc_active"] == [[s["device"], s["address"], s["allocated_size"]] for s in snap["segments"]]
    for device in (0, 1):
        ours = sum(s["allocated_size"] for s in snap["segments"] if s["device"] == device)
        assert sum(v for d, _, v in result["calc_active"] if d == device) == ours
    # the flame graphs account for every byte: tensors at their requested size, the rest as gaps
    for name in ("memory_flamegraph", "segments_flamegraph"):
        text = result[name]
        total = sum(int(line.rsplit(" ", 1)[1]) for line in text.splitlines())
        assert total == sum(reserved.values()), name
        tensors = sum(int(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                      if ";active_allocated;" in line and not line.rsplit(" ", 1)[0].endswith("<gaps>"))
        assert tensors == sum(requested.values()), name
    # frames read innermost first: the flame graph puts the outermost first
    assert "serve.py:1:<module>;model.py:5:forward;model.py:100:a0 1\n" in result["memory_flamegraph"]
    assert "Device 0 ----------------\n18 entries" in result["trace_text"]
    assert "Device 1 ----------------\n5 entries" in result["trace_text"]
    assert result["filter_freed_keeps"] == [18, 5]
    for action, run in result["cli"].items():
        assert run["rc"] == 0, f"{action}: {run['stderr']}"
    assert result["cli"]["trace_plot"]["html_bytes"] > 1000 and result["cli"]["segment_plot"]["html_bytes"] > 1000
