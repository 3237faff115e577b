"""PyTorch's caching allocator block by block (USDT pytorch:malloc / pytorch:free) on real CUDA.

- A planted leak under the default caching allocator is named by the stack of the blocks that hold
  it (keep_activation), not by the cudaMalloc calls, which the cache puts elsewhere.
- Blocks and segments equal what PyTorch reports of itself (torch.cuda.memory_snapshot(),
  memory_reserved()), with the caching allocator and with expandable segments.
- The snapshot kvtrace writes from outside renders in PyTorch's own _memory_viz, with the
  allocated total that the requested sizes imply.

The probe reports the size asked for; memory_allocated() and the snapshot's block `size` count what
the allocator gave (rounded up to 512 bytes, or more where it did not split off a remainder), so
blocks are compared by requested size, and the rounding is printed. Each test gathers its figures
first, prints them (run with -s), then asserts.
"""
from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from conftest import WORKER, check_all, quiesce, source_line
from harness import TracingHarness
from kvtrace.analysis.analyzer import AnalysisOptions, Analyzer
from kvtrace.model.blocks import segments_of
from kvtrace.model.events import Layer, ObjectKind
from kvtrace.reports.memory_viz import block_size_bytes, snapshot_dict, viz_segments, write_pickle

MiB = 1 << 20
MODES = {
    "caching": {},
    "expandable_segments": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
}
BLOCK_COUNT = 23  # tensors of the "blocks" command; a third of them freed again
LEAK_STEPS, LEAK_INTERVAL_SECONDS = 150, 0.1  # 15 s
CLONE_BYTES, TEMPORARY_BYTES = 8 * MiB, 32 * MiB


def frame_text(frame) -> str:
    return f"{frame.function} ({Path(frame.file).name}:{frame.line})"


def innermost(harness: TracingHarness, stack_id: int) -> str:
    stack = harness.session.stack(stack_id) if stack_id else None
    return frame_text(stack.frames[0]) if stack is not None and stack.frames else "(no Python stack)"


def torch_probes_attached(harness: TracingHarness) -> list[str]:
    """Libraries where pytorch:malloc is attached (libc10_cuda.so)."""
    return [library.path for library in harness.source.attached_libraries() if "pytorch:malloc" in library.symbols]


# ---- the two sides of a comparison: kvtrace's ledger and PyTorch's memory_snapshot() ----

def snapshot_blocks(snapshot: dict) -> set[tuple[int, int, int]]:
    """(device, address, requested size) of every block a tensor holds in the worker's snapshot."""
    return {(segment["device"], block["address"], block["requested_size"])
            for segment in snapshot["segments"] for block in segment["blocks"]
            if block["state"] == "active_allocated"}


def ledger_blocks(entries, pid: int) -> set[tuple[int, int, int]]:
    """(device, address, requested size) of every block of `pid` in a ledger (either copy)."""
    return {(entry.device, entry.key.address, entry.size_bytes) for entry in entries
            if entry.key.pid == pid and entry.key.object is ObjectKind.BLOCK}


def snapshot_segments(snapshot: dict) -> dict[int, tuple[int, int, frozenset[int]]]:
    """address -> (device, total size, addresses of its live blocks) of the worker's snapshot."""
    return {segment["address"]: (segment["device"], segment["total_size"], frozenset(
        block["address"] for block in segment["blocks"] if block["state"] == "active_allocated"))
        for segment in snapshot["segments"]}


def traced_segments(segments) -> dict[int, tuple[int, int, frozenset[int]]]:
    """The same of kvtrace's segments (model/blocks.py). A segment traced on an unknown device (-1:
    the thread never chose one while traced) takes its blocks' device, as the snapshot export does."""
    table = {}
    for segment in segments:
        device = segment.device
        if device < 0:
            device = next((block.device for block in segment.blocks if block.device >= 0), 0)
        table[segment.address] = (device, segment.size_bytes,
                                  frozenset(block.key.address for block in segment.blocks))
    return table


def by_device(table: dict[int, tuple[int, int, frozenset[int]]]) -> dict[int, int]:
    totals: Counter[int] = Counter()
    for device, size, _ in table.values():
        totals[device] += size
    return dict(totals)


def compare_with_snapshot(pid: int, entries, kernel_entries, snapshot: dict) -> tuple[list[str], list[str]]:
    """(figures to print, failures): kvtrace's blocks and segments of `pid` against the worker's
    memory_snapshot() and memory_reserved() per device."""
    figures, failures = [], []
    mine = [entry for entry in entries if entry.key.pid == pid]
    theirs = snapshot_blocks(snapshot)
    ours, kernel = ledger_blocks(mine, pid), ledger_blocks(kernel_entries, pid)
    allocated = {int(device): size for device, size in snapshot["allocated_by_device"].items()}
    reserved = {int(device): size for device, size in snapshot["reserved_by_device"].items()}
    requested: Counter[int] = Counter()
    for device, _, size in theirs:
        requested[device] += size
    figures.append(f"blocks: kvtrace {len(ours)} ({sum(size for _, _, size in ours)} bytes requested), "
                   f"kernel ledger {len(kernel)}, memory_snapshot() active {len(theirs)} "
                   f"({sum(requested.values())} bytes requested)")
    for device in sorted(allocated):
        asked = requested.get(device, 0)
        figures.append(f"device {device}: memory_allocated() {allocated[device]}, requested {asked}: "
                       f"the allocator's rounding {allocated[device] - asked} bytes")
    if ours != theirs:
        failures.append(f"blocks: {len(ours - theirs)} traced only, e.g. {sorted(ours - theirs)[:3]}; "
                        f"{len(theirs - ours)} in the snapshot only, e.g. {sorted(theirs - ours)[:3]}")
    if kernel != ours:
        failures.append(f"kernel ledger blocks differ from the Session's: {sorted(kernel ^ ours)[:3]}")

    segments, outside = segments_of(mine)
    traced, expected = traced_segments(segments), snapshot_segments(snapshot)
    figures.append(f"segments: kvtrace {len(traced)} (devices as traced {sorted({s.device for s in segments})}, "
                   f"expandable {sum(s.expandable for s in segments)}), {sum(s[1] for s in traced.values())} bytes; "
                   f"memory_snapshot() {len(expected)}, {sum(s[1] for s in expected.values())} bytes; "
                   f"blocks outside any segment {len(outside)}")
    for device in sorted(reserved):
        figures.append(f"device {device}: memory_reserved() {reserved[device]}, kvtrace's segments "
                       f"{by_device(traced).get(device, 0)}")
    if outside:
        failures.append(f"{len(outside)} blocks outside every traced segment, e.g. "
                        f"{[(b.key.address, b.size_bytes) for b in outside[:3]]}")
    sizes = {address: (device, size) for address, (device, size, _) in traced.items()}
    expected_sizes = {address: (device, size) for address, (device, size, _) in expected.items()}
    if sizes != expected_sizes:
        failures.append(f"segments (address: device, size) differ: traced only "
                        f"{sorted(set(sizes.items()) - set(expected_sizes.items()))[:4]}, snapshot only "
                        f"{sorted(set(expected_sizes.items()) - set(sizes.items()))[:4]}")
    else:
        nested_apart = [address for address in traced if traced[address][2] != expected[address][2]]
        if nested_apart:
            failures.append(f"segments holding other blocks than in the snapshot: {nested_apart[:4]}")
    for device, size in reserved.items():
        if by_device(traced).get(device, 0) != size:
            failures.append(f"device {device}: segments {by_device(traced).get(device, 0)} != memory_reserved() {size}")
    return figures, failures


@contextlib.contextmanager
def traced_blocks(torch_worker, env: dict[str, str]):
    """A torch worker traced from before CUDA starts, holding BLOCK_COUNT tensors of mixed sizes of
    which a third were freed again; yields (worker, harness, the "blocks" answer, its
    memory_snapshot() taken after them, nothing allocating in between)."""
    worker = torch_worker(env)
    with TracingHarness([worker.pid]) as harness:
        attached, down = torch_probes_attached(harness), harness.source.torch_blocks_down
        print(f"\n{env or 'caching allocator'}: pytorch:malloc attached in {attached}"
              f"{'; torch blocks down: ' + down if down else ''}")
        if not attached:
            pytest.fail(f"PyTorch's allocator probes are not attached: {down or '?'}; "
                        f"libraries: {[(lib.path, lib.symbols[:3]) for lib in harness.source.attached_libraries()]}")
        worker.send(harness, op="init")
        held = worker.send(harness, op="blocks", count=BLOCK_COUNT)
        snapshot = worker.send(harness, op="memory_snapshot")
        quiesce(harness)
        yield worker, harness, held, snapshot


def test_planted_leak_is_named_by_the_blocks_that_hold_it(torch_worker):
    # GIVEN a loop under the default caching allocator that, every 0.1 s, allocates and frees a
    # 32 MiB temporary in scratch_temporary() and keeps an 8 MiB clone in keep_activation()
    # (80 MiB/s); the clones are carved out of the temporaries' cached segments, so every cudaMalloc
    # happens in scratch_temporary()
    worker = torch_worker()
    failures = []
    with TracingHarness([worker.pid]) as harness:
        worker.send(harness, op="init")
        analyzer = Analyzer(harness.session, AnalysisOptions(site_sample_seconds=1, leak_min_age_seconds=0))
        started_ns = time.time_ns()
        worker.request(op="clone_leak", steps=LEAK_STEPS, interval_seconds=LEAK_INTERVAL_SECONDS,
                       keep_bytes=CLONE_BYTES, temporary_bytes=TEMPORARY_BYTES)
        # WHEN kvtrace samples the allocation sites once a second while it runs
        loop_end = time.monotonic() + LEAK_STEPS * LEAK_INTERVAL_SECONDS
        samples = 0
        while time.monotonic() + 1.0 < loop_end:
            harness.pump(1.0)
            analyzer.update(harness.session.ledger_view(True))
            samples += 1
        loop = worker.answer(harness, timeout_seconds=60)
        quiesce(harness)
        report = analyzer.leak_report(pids=[worker.pid], min_age_seconds=0)
        true_rate = CLONE_BYTES / LEAK_INTERVAL_SECONDS
        print(f"\nclone leak: {loop}; {samples} site samples; true growth {true_rate / MiB:.1f} MiB/s")
        for suspect in report.suspects[:4]:
            print(f"  #{suspect.rank} {innermost(harness, suspect.stack_id)}: growth "
                  f"{suspect.growth_bytes_per_second / MiB:.1f} MiB/s, {suspect.outstanding_bytes / MiB:.0f} MiB "
                  f"in {suspect.count} blocks")
        # What the segments alone would say: the cudaMalloc'd bytes of the loop, by allocating function.
        cudamalloc: Counter[str] = Counter()
        for entry in harness.session.ledger:
            if (entry.key.pid == worker.pid and entry.key.layer is Layer.RUNTIME
                    and entry.key.object is ObjectKind.ALLOCATION and entry.timestamp_ns >= started_ns):
                cudamalloc[innermost(harness, entry.stack_id)] += entry.size_bytes
        print("cudaMalloc'd during the loop, by innermost frame (the segment-only view): " + ", ".join(
            f"{where} {size / MiB:.0f} MiB" for where, size in cudamalloc.most_common()))
        counters = harness.source.counters()
        print(f"counters: {counters}")
        # THEN the first suspect is the kept clones, at the line that keeps them
        first = report.suspects[0] if report.suspects else None
        top = first.stack.frames[0] if first is not None and first.stack is not None and first.stack.frames else None
        expected = ("keep_activation", "torch_worker.py", source_line("# KEEP_CLONE_LINE"))
        if top is None or (top.function, Path(top.file).name, top.line) != expected:
            failures.append(f"first suspect's innermost frame {top}, expected {expected}")
        # AND its growth is the leak's
        if first is not None and abs(first.growth_bytes_per_second - true_rate) > 0.2 * true_rate:
            failures.append(f"first suspect's growth {first.growth_bytes_per_second:.0f} B/s, "
                            f"truth {true_rate:.0f} B/s")
        if loop["late_steps"] > LEAK_STEPS // 20:
            failures.append(f"the loop missed its schedule {loop['late_steps']} times: the truth is off")
        if counters["usdt_unreadable"]:
            failures.append(f"{counters['usdt_unreadable']} pytorch probe hits unreadable")
    check_all(failures)


@pytest.mark.parametrize("mode", MODES)
def test_blocks_and_segments_equal_pytorchs_memory_snapshot(torch_worker, mode):
    # GIVEN a torch process, traced from before CUDA started, holding 15 tensors of mixed sizes with
    # holes where 8 others were freed, in one of PyTorch's allocator modes
    with traced_blocks(torch_worker, MODES[mode]) as (worker, harness, held, snapshot):
        # WHEN kvtrace's ledger is compared with torch.cuda.memory_snapshot() taken in the process
        figures, failures = compare_with_snapshot(worker.pid, list(harness.session.ledger),
                                                  harness.source.kernel_ledger(), snapshot)
        counters = harness.source.counters()
        blocks = {entry.key.address: entry for entry in harness.session.ledger
                  if entry.key.pid == worker.pid and entry.key.object is ObjectKind.BLOCK}
        line = source_line("# BLOCKS_LINE")
        wrong_stack = [(address, innermost(harness, blocks[address].stack_id)) for address, _ in held["live"]
                       if address in blocks and innermost(harness, blocks[address].stack_id)
                       != f"allocate_blocks (torch_worker.py:{line})"]
        print(f"{mode}: {len(held['live'])} tensors live, {held['freed']} freed")
        print("\n".join(figures))
        if held["live"] and held["live"][0][0] in blocks:
            print(f"a block's stack: {innermost(harness, blocks[held['live'][0][0]].stack_id)}")
        print(f"counters: {counters}")
        # THEN (compare_with_snapshot) blocks, segments and reserved bytes are PyTorch's, exactly
        # AND every tensor's block has the allocating line as its innermost frame
        if wrong_stack:
            failures.append(f"{len(wrong_stack)} blocks with another innermost frame, e.g. {wrong_stack[:2]}")
        missing = [(address, size) for address, size in held["live"]
                   if address not in blocks or blocks[address].size_bytes != size]
        if missing:
            failures.append(f"tensors not traced as their block: {missing[:3]}")
        if counters["usdt_unreadable"]:
            failures.append(f"{counters['usdt_unreadable']} pytorch probe hits unreadable")
    check_all(failures)


def test_memory_viz_renders_kvtraces_snapshot_with_the_requested_totals(torch_worker, tmp_path):
    from torch.cuda import _memory_viz

    # GIVEN the blocks of a torch process traced by kvtrace, and the process's own memory_snapshot()
    with traced_blocks(torch_worker, {}) as (worker, harness, _, snapshot):
        mine = [entry for entry in harness.session.ledger if entry.key.pid == worker.pid]
        segments, _ = segments_of(mine)
        # WHEN kvtrace writes its snapshot and PyTorch's _memory_viz renders it
        ours = snapshot_dict(viz_segments(segments, harness.session.stack))
    path = tmp_path / "kvtrace.pickle"
    write_pickle(path, ours)
    plots = {}
    for action in ("trace_plot", "segment_plot"):  # at once: each imports torch (seconds)
        output = tmp_path / f"{action}.html"
        plots[action] = (output, subprocess.Popen(
            [sys.executable, "-m", "torch.cuda._memory_viz", action, str(path), "-o", str(output)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    results = {}
    for action, (output, process) in plots.items():
        text, _ = process.communicate(timeout=300)
        html = output.read_text() if output.exists() else ""
        results[action] = (process.returncode, len(html), "MemoryViz.js" in html, text[-2000:])
    active = [block for segment in snapshot["segments"] for block in segment["blocks"]
              if block["state"] == "active_allocated"]
    rounded = sum(block_size_bytes(block["requested_size"]) for block in active)
    torch_allocated = sum(block["size"] for block in active)
    viz_allocated = sum(_memory_viz.calc_active(segment) for segment in ours["segments"])
    failures = []
    try:
        stats = _memory_viz.segsum(ours)  # what `_memory_viz stats` prints; it checks that sizes add up
    except AssertionError as error:
        stats = ""
        failures.append(f"_memory_viz.segsum refused kvtrace's snapshot: {error}")
    print(f"\nkvtrace snapshot {path.stat().st_size} bytes: {len(ours['segments'])} segments, "
          f"{sum(len(trace) for trace in ours['device_traces'])} trace entries")
    for action, (rc, size, viewer, text) in results.items():
        print(f"_memory_viz {action}: exit {rc}, {size} bytes of HTML, viewer script {viewer} {text.strip()[-300:]}")
    print(" | ".join(line for line in stats.splitlines() if line.startswith(("segments:", "total_"))))
    print(f"allocated: kvtrace's snapshot {viz_allocated} (_memory_viz.calc_active); requested sizes of the "
          f"process's own snapshot rounded up to 512 bytes {rounded}; PyTorch's own block sizes {torch_allocated} "
          f"(memory_allocated() {sum(snapshot['allocated_by_device'].values())}), "
          f"{torch_allocated - viz_allocated} bytes more: remainders the allocator did not split off")
    # THEN both plots are written as HTML that loads the viewer
    for action, (rc, size, viewer, text) in results.items():
        if rc != 0 or size < 1000 or not viewer:
            failures.append(f"_memory_viz {action}: exit {rc}, {size} bytes, viewer {viewer}: {text}")
    # AND the allocated total is the requested sizes rounded as PyTorch rounds them, exactly
    if viz_allocated != rounded:
        failures.append(f"kvtrace's snapshot allocates {viz_allocated}, the requested sizes rounded {rounded}")
    # AND its segments are the process's own
    if sorted((s["address"], s["total_size"]) for s in ours["segments"]) != \
            sorted((s["address"], s["total_size"]) for s in snapshot["segments"]):
        failures.append("kvtrace's snapshot has other segments than the process's own")
    check_all(failures)


def test_worker_block_markers_exist():
    """The markers this file looks up are in the worker (a cheap check wherever torch imports)."""
    assert WORKER.exists()
    assert source_line("# KEEP_CLONE_LINE") > 0 and source_line("# BLOCKS_LINE") > 0
    assert source_line("# TEMPORARY_LINE") > 0
