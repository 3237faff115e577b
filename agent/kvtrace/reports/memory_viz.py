"""A PyTorch memory snapshot taken from outside the process.

`snapshot_dict` builds the structure that ``torch.cuda.memory._snapshot()`` returns, from the CUDA
segments of PyTorch's caching allocator and the live blocks (tensors) in them, so that PyTorch's own
viewers render it: ``python -m torch.cuda._memory_viz trace_plot FILE -o out.html``, ``segment_plot``,
``stats``, ``trace`` and the memory viewer on pytorch.org. `write_pickle` writes it as the file those
tools read.

What differs from a snapshot PyTorch takes of itself:

- The trace (``device_traces``) holds one ``alloc`` entry for each block still live at snapshot
  time, in time order: kvtrace keeps the outstanding blocks, not the history of every allocation
  and free, so frees and the allocations they undid are not in it.
- No ``segment_alloc`` / ``segment_map`` entries: kvtrace does not know when a segment was
  allocated, and the viewer does not need them to place blocks (it finds a block's segment in
  ``segments``); without them it shows each segment as present from the start of the trace. One
  cosmetic cost: the text command ``_memory_viz trace`` then looks blocks up within each segment's
  ``allocated_size`` (not ``total_size``) and labels a block beyond it ``MEM[address]`` instead of
  ``seg_N[offset]``, as it does for PyTorch's own snapshots of segments older than the trace.
- A block's ``size`` is its requested size rounded up to PyTorch's 512-byte granularity; PyTorch
  itself sometimes gives a block more (it does not split off a remainder too small to use, and
  ``roundup_power2_divisions`` rounds further). That memory shows here as an ``inactive`` block
  after the live one, so sizes still add up to the segment.
- Segment frames are empty (kvtrace records stacks of blocks, not of cudaMalloc calls), there is
  no ``allocator_settings`` (kvtrace cannot read PYTORCH_CUDA_ALLOC_CONF as the allocator parsed
  it), and every segment is said to belong to the default pool (0, 0): private pools (CUDA graphs)
  are not seen from outside.
- Under stack sampling of blocks (`kvtrace agent --block-sample-bytes`), a block whose stack sampling
  passed over has one frame, ``[stack not sampled]``, instead of none: every block keeps its exact
  size and place (a weighed size would not fit its segment), so the viewer's sums per stack are the
  sampled blocks' exact bytes, and the rest sit under that frame. `kvtrace flamegraph --blocks`
  weighs the sampled ones to estimate what each stack holds.
"""

from __future__ import annotations

import bisect
import operator
import os
import pickle
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvtrace.model.blocks import Segment
from kvtrace.model.events import Layer, Memory, ObjectKind
from kvtrace.model.ledger import EntryColumns
from kvtrace.model.stacks import Stack
from kvtrace.reports.output import write_whole

# PyTorch's caching allocator (c10/cuda/CUDACachingAllocator.cpp) constants this format leans on.
BLOCK_GRANULARITY_BYTES = 512  # kMinBlockSize: every block size is a multiple of it
SMALL_BLOCK_MAX_BYTES = 1024 * 1024  # kSmallSize: requests up to 1 MiB go to the small pool
SMALL_SEGMENT_BYTES = 2 * 1024 * 1024  # kSmallBuffer: the small pool's segment (and VMM page) size
LARGE_SEGMENT_BYTES = 20 * 1024 * 1024  # kLargeBuffer: the large pool's VMM page size

# The one frame of a block whose stack sampling passed over (no walk made): told apart from a block walked
# without a Python stack, which has no frame.
NOT_SAMPLED_FRAME = "[stack not sampled]"

# The pytorch.org viewer reads the pickle with its own JavaScript reader, which refuses any protocol
# outside 2-4; 4 is also what Python 3.8-3.13 writes by default.
PICKLE_PROTOCOL = 4

# The ledger's numbers (EntryColumns) an export looks for: blocks, and the entries that are segments.
_BLOCK, _ALLOCATION, _VMM_MAPPING = ObjectKind.BLOCK.value, ObjectKind.ALLOCATION.value, ObjectKind.VMM_MAPPING.value
_RUNTIME, _DEVICE_MEMORY = Layer.RUNTIME.value, Memory.DEVICE.value


@dataclass(frozen=True)
class VizFrame:
    """One Python frame of the stack that allocated a block."""

    function: str
    file: str
    line: int


@dataclass(frozen=True)
class VizBlock:
    """One live block (tensor storage) as the pytorch:malloc probe saw it.

    `requested_bytes` is what the program asked for, not the rounded block size. `frames` are
    innermost first, as torch lists them. `stream` 0 means "the segment's stream": PyTorch
    allocates a block only from a segment of its own stream.
    """

    address: int
    requested_bytes: int
    timestamp_ns: int
    frames: tuple[VizFrame, ...]
    stream: int = 0


@dataclass(frozen=True)
class VizSegment:
    """One CUDA segment of the caching allocator (a cudaMalloc, or the mapped part of an
    expandable segment) and the live blocks in it."""

    device: int
    address: int
    size_bytes: int
    stream: int
    blocks: tuple[VizBlock, ...]
    is_expandable: bool = False


def snapshot_dict(segments: Iterable[VizSegment]) -> dict[str, Any]:
    """The structure ``torch.cuda.memory._snapshot()`` returns, for these segments.

    ``{"segments": [...], "device_traces": [[...] for devices 0..max]}``, segments ordered by
    (device, address). Each segment's ``blocks`` cover it exactly, in address order: one
    ``active_allocated`` block per live block and an ``inactive`` block for every gap, because
    both the Python tools (which check that sizes add up) and the viewer (which computes each
    block's address by adding up the sizes before it) depend on that.

    ``device_traces[d]`` holds one ``alloc`` entry per block still live on device d at snapshot
    time, oldest first; it is not the history of every allocation (kvtrace keeps none).
    ``time_us`` is ``timestamp_ns // 1000`` on whatever clock the caller's timestamps use.

    Raises ValueError for input kvtrace should never produce: a block outside its segment,
    overlapping blocks, overlapping segments on one device, a size below one byte.
    """
    ordered = sorted(segments, key=lambda segment: (segment.device, segment.address))
    _check_segments(ordered)
    device_count = ordered[-1].device + 1 if ordered else 0
    # (timestamp_ns, address) orders entries of one device; the address only breaks ties so the
    # output is the same for the same input.
    pending: list[list[tuple[int, int, dict[str, Any]]]] = [[] for _ in range(device_count)]
    out_segments = []
    frames_of = _FramesCache()  # blocks of one stack share its frames (a million blocks, a few stacks)
    for segment in ordered:
        out_segments.append(_segment_dict(segment, frames_of))
        for block in segment.blocks:
            pending[segment.device].append((block.timestamp_ns, block.address,
                                            _alloc_entry(segment, block, frames_of)))
    device_traces = [[entry for _, _, entry in sorted(entries, key=lambda e: (e[0], e[1]))] for entries in pending]
    return {"segments": out_segments, "device_traces": device_traces}


def write_pickle(path: str | os.PathLike[str], snapshot: dict[str, Any]) -> None:
    """Write `snapshot` where PyTorch's tools read it: a pickle, protocol 4.

    It goes to a temporary file in the same directory, renamed over `path` only once complete, so a
    crash never leaves half a file where a viewer would find it. It is 0600, as every export of kvtrace's
    is: its stacks name files, functions and process titles (chmod or copy it for whoever opens the viewer).
    """
    write_whole(path, lambda file: pickle.dump(snapshot, file, protocol=PICKLE_PROTOCOL), "snapshot",
                "snapshot.pickle", 0o600)


def segment_type(segment: VizSegment) -> str:
    """Which of PyTorch's two pools the segment belongs to ("small" or "large"), judged by size
    because the probes do not report the pool.

    The small pool serves requests up to 1 MiB from 2 MiB segments; the large pool never makes a
    2 MiB segment (a request of 1-10 MiB gets 20 MiB, a larger one is rounded up to a multiple of
    2 MiB, so at least 10 MiB). An expandable segment maps pages of its pool's segment size, 2 MiB
    (small) or 20 MiB (large), so one that is not a whole number of 20 MiB pages is small, unless it
    holds a block too big for the small pool; a small one grown to a multiple of 20 MiB is
    indistinguishable and is called large.
    """
    return _pool(segment.size_bytes, segment.is_expandable,
                 max((block.requested_bytes for block in segment.blocks), default=0))


def _pool(size_bytes: int, is_expandable: bool, largest_request_bytes: int) -> str:
    """segment_type of a segment of this size whose largest block asks for `largest_request_bytes`."""
    if not is_expandable:
        return "small" if size_bytes == SMALL_SEGMENT_BYTES else "large"
    if size_bytes % LARGE_SEGMENT_BYTES == 0 or largest_request_bytes > SMALL_BLOCK_MAX_BYTES:
        return "large"
    return "small"


def block_size_bytes(requested_bytes: int) -> int:
    """The size PyTorch gives a block for a request: rounded up to 512 bytes (round_size)."""
    return max(BLOCK_GRANULARITY_BYTES, -(-requested_bytes // BLOCK_GRANULARITY_BYTES) * BLOCK_GRANULARITY_BYTES)


def _segment_dict(segment: VizSegment, frames_of: Callable[[tuple[VizFrame, ...]], list[dict[str, Any]]]
                  ) -> dict[str, Any]:
    """One entry of ``segments``: the blocks (live and gaps) and the totals PyTorch reports."""
    live = sorted(segment.blocks, key=lambda block: block.address)
    _check_blocks(segment, live)
    end = segment.address + segment.size_bytes
    blocks: list[dict[str, Any]] = []
    cursor = segment.address
    for index, block in enumerate(live):
        if block.address > cursor:
            blocks.append(_inactive_block(cursor, block.address - cursor))
        # Rounding up may not run into the next block or past the segment: blocks never overlap.
        limit = live[index + 1].address if index + 1 < len(live) else end
        size = min(block_size_bytes(block.requested_bytes), limit - block.address)
        blocks.append(
            {
                "address": block.address,
                "size": size,
                "requested_size": block.requested_bytes,
                "state": "active_allocated",
                "frames": frames_of(block.frames),
            }
        )
        cursor = block.address + size
    if cursor < end:
        blocks.append(_inactive_block(cursor, end - cursor))
    allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
    return _segment_entry(segment, allocated, sum(block.requested_bytes for block in live), segment_type(segment),
                          blocks)


_DEFAULT_POOL = (0, 0)  # one object: the pickle stores it once


def _segment_entry(segment: VizSegment, allocated: int, requested: int, pool: str,
                   blocks: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "device": segment.device,
        "address": segment.address,
        "total_size": segment.size_bytes,
        "allocated_size": allocated,
        # Active = allocated or freed but still in use by another stream; kvtrace sees a block
        # leave at free, so nothing is ever "active_pending_free" here.
        "active_size": allocated,
        "requested_size": requested,
        "stream": segment.stream,
        "segment_type": pool,
        "segment_pool_id": _DEFAULT_POOL,
        "is_expandable": segment.is_expandable,
        "frames": [],
        "blocks": blocks,
    }


def _inactive_block(address: int, size: int) -> dict[str, Any]:
    """Free memory in a segment; requested_size 0 because nothing asks for it (the flame graphs
    of _memory_viz then count all of it as a gap)."""
    return {"address": address, "size": size, "requested_size": 0, "state": "inactive", "frames": []}


def _alloc_entry(segment: VizSegment, block: VizBlock,
                 frames_of: Callable[[tuple[VizFrame, ...]], list[dict[str, Any]]]) -> dict[str, Any]:
    """The trace entry PyTorch records when it hands out a block; its size is the requested size,
    as PyTorch records it."""
    return {
        "action": "alloc",
        "addr": block.address,
        "size": block.requested_bytes,
        "stream": block.stream or segment.stream,
        "time_us": block.timestamp_ns // 1000,
        "frames": frames_of(block.frames),
    }


class _FramesCache(dict):
    """Frames in torch's shape, keeping the order given (innermost first), made once per stack: the blocks of one
    stack share the list (the pickle then stores it once; the viewer and PyTorch's tools only read it)."""

    def __call__(self, frames: tuple[VizFrame, ...]) -> list[dict[str, Any]]:
        found = self.get(frames)
        if found is None:
            found = self[frames] = [{"filename": frame.file, "line": frame.line, "name": frame.function}
                                    for frame in frames]
        return found


def _describe(segment: VizSegment) -> str:
    return f"segment {segment.address:#x}+{segment.size_bytes} on device {segment.device}"


def _check_segments(ordered: Sequence[VizSegment]) -> None:
    """Segments sorted by (device, address) must have a size and not overlap: the viewer looks a
    block's segment up by address, and two answers would draw it in the wrong one."""
    previous: VizSegment | None = None
    for segment in ordered:
        if segment.device < 0 or segment.size_bytes < 1:
            raise ValueError(f"{_describe(segment)}: device must be >= 0 and size >= 1 byte")
        if previous is not None and previous.device == segment.device:
            if segment.address < previous.address + previous.size_bytes:
                raise ValueError(f"{_describe(segment)} overlaps {_describe(previous)}")
        previous = segment


def _check_blocks(segment: VizSegment, live: Sequence[VizBlock]) -> None:
    """Each requested range must lie inside the segment and apart from the others: PyTorch never
    hands out such blocks, so one here is a bug in what kvtrace recorded."""
    end = segment.address + segment.size_bytes
    for index, block in enumerate(live):
        if block.requested_bytes < 1:
            raise ValueError(f"block at {block.address:#x} in {_describe(segment)} has size {block.requested_bytes}")
        if block.address < segment.address or block.address + block.requested_bytes > end:
            raise ValueError(
                f"block at {block.address:#x} ({block.requested_bytes} bytes) lies outside {_describe(segment)}"
            )
        if index > 0:
            before = live[index - 1]
            if block.address < before.address + before.requested_bytes:
                raise ValueError(
                    f"blocks at {before.address:#x} ({before.requested_bytes} bytes) and {block.address:#x} "
                    f"overlap in {_describe(segment)}"
                )


def viz_segments(segments: Iterable[Segment], stack_of: Callable[[int], Stack | None]) -> list[VizSegment]:
    """kvtrace's segments with their blocks (model/blocks.py) as this module's input.

    A segment traced on an unknown device (the agent attached after the thread chose it) takes the
    device PyTorch reported for the blocks in it; one with no block either is put on device 0."""
    converted = []
    not_sampled = (VizFrame(NOT_SAMPLED_FRAME, "", 0),)
    frames_by_stack: dict[int, tuple[VizFrame, ...]] = {0: ()}  # each stack's frames made once
    for segment in segments:
        device = segment.device
        if device < 0:
            device = next((block.device for block in segment.blocks if block.device >= 0), 0)
        blocks = []
        for block in segment.blocks:
            frames = frames_by_stack.get(block.stack_id)
            if frames is None:
                stack = stack_of(block.stack_id)
                frames = frames_by_stack[block.stack_id] = tuple(
                    VizFrame(frame.function, frame.file, frame.line) for frame in stack.frames) \
                    if stack is not None else ()
            if block.sample_bytes and not block.sampled:
                frames = not_sampled
            blocks.append(VizBlock(block.key.address, block.size_bytes, block.timestamp_ns, frames, block.stream))
        # A segment's stream is not traced (cudaMalloc has none): 0; each block has its own.
        converted.append(VizSegment(device, segment.address, segment.size_bytes, 0, tuple(blocks),
                                    segment.expandable))
    return converted


class ExportBuilder:
    """The memory-viz export of one process built from its ledger entries as a listing's pages come (columns,
    model.ledger.EntryColumns, each page with the stacks it refers to): the same snapshot as
    snapshot_dict(viz_segments(segments_of(entries), stacks.get)), without a model object per entry.

    What each page allows is done as it comes, while the agent reads the next one: each block's dict (at its
    rounded size) and trace entry, their frames, and the page's blocks put in address order and in time order.
    `finish` then merges the pages' orders (sorting runs already sorted), nests the blocks in their segments
    (a block in none is left out, as segments_of leaves it outside) and says how many; `VizExport.snapshot`
    lays each segment out (gaps, a rounding clipped by the next block) and checks it as snapshot_dict does."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        # Per block, in the order the pages gave them:
        self._addresses: list[int] = []
        self._requested: list[int] = []
        self._rounded: list[int] = []  # block_size_bytes of the request: the dict's size unless clipped
        self._devices: list[int] = []
        self._blocks: list[dict[str, Any]] = []  # its entry in its segment's `blocks`
        self._time_keys: list[int] = []  # timestamp_ns << 64 | address: the trace's order, one int
        self._passed: set[int] = set()  # blocks whose stack sampling passed over
        self._by_address: list[int] = []  # block indices, each page's in address order
        self._by_time: list[int] = []  # time keys, each page's in order
        self._entry_of_time_key: dict[int, dict[str, Any]] = {}  # the block's trace entry
        self._runtime: list[tuple[int, int, int]] = []  # (address, size, device) of each runtime allocation
        self._mappings: list[tuple[int, int, int]] = []  # (address, size, device) of each VMM mapping
        self._frames_of_stack: dict[int, list[dict[str, Any]]] = {}
        self._frames_of = _FramesCache()
        self._not_sampled = self._frames_of((VizFrame(NOT_SAMPLED_FRAME, "", 0),))

    def add(self, columns: EntryColumns, stacks: Mapping[int, Stack]) -> None:
        """One page's entries (of any process: only this one's are taken) and the stacks they refer to."""
        count, objects = len(columns.pid), columns.object
        picked: list[int] | None = None  # None: all, the columns as they are
        if columns.pid.count(self.pid) != count:
            pid = self.pid
            picked = [index for index, entry_pid in enumerate(columns.pid) if entry_pid == pid]
        if picked is not None or objects.count(_BLOCK) != count:  # segments among them, or other processes
            rows = range(count) if picked is None else picked
            for index in rows:
                if objects[index] != _BLOCK:
                    self._segment_part(columns, index)
            picked = [index for index in rows if objects[index] == _BLOCK]

        def column(values: list) -> list:
            return values if picked is None else [values[index] for index in picked]

        addresses, requested, timestamps = column(columns.address), column(columns.size_bytes), \
            column(columns.timestamp_ns)
        stack_ids = column(columns.stack_id)
        frames_of_stack = self._frames_of_stack
        for stack_id in set(stack_ids) - frames_of_stack.keys():
            frames_of_stack[stack_id] = self._stack_frames(stacks.get(stack_id) if stack_id else None)
        frames = list(map(frames_of_stack.__getitem__, stack_ids))
        base = len(self._addresses)
        if any(columns.sample_bytes):
            for index, (sample_bytes, sampled) in enumerate(zip(column(columns.sample_bytes),
                                                                column(columns.sampled), strict=True)):
                if sample_bytes and not sampled:
                    frames[index] = self._not_sampled
                    self._passed.add(base + index)
        # block_size_bytes of each (a request is at least 0: 0 is given the smallest block, as there)
        rounded = [-(-request // BLOCK_GRANULARITY_BYTES) * BLOCK_GRANULARITY_BYTES or BLOCK_GRANULARITY_BYTES
                   for request in requested]
        self._blocks += [{"address": address, "size": size, "requested_size": request, "state": "active_allocated",
                          "frames": shared} for address, size, request, shared in
                         zip(addresses, rounded, requested, frames, strict=True)]
        keys = [timestamp << 64 | address for timestamp, address in zip(timestamps, addresses, strict=True)]
        # The trace entry PyTorch records when it hands out a block (_alloc_entry: a segment's stream is 0).
        self._entry_of_time_key.update(zip(keys, [
            {"action": "alloc", "addr": address, "size": request, "stream": stream, "time_us": timestamp // 1000,
             "frames": shared} for address, request, stream, timestamp, shared in
            zip(addresses, requested, column(columns.stream), timestamps, frames, strict=True)], strict=True))
        self._addresses += addresses
        self._requested += requested
        self._rounded += rounded
        self._devices += column(columns.device)
        self._time_keys += keys
        self._by_address += sorted(range(base, base + len(addresses)), key=self._addresses.__getitem__)
        self._by_time += sorted(keys)

    def _segment_part(self, columns: EntryColumns, index: int) -> None:
        """A segment's entry (segments_of's: a runtime device allocation, or a VMM mapping, one of a run)."""
        kind, layer = columns.object[index], columns.layer[index]
        entry = (columns.address[index], columns.size_bytes[index], columns.device[index])
        if kind == _ALLOCATION and layer == _RUNTIME and columns.memory[index] == _DEVICE_MEMORY:
            self._runtime.append(entry)
        elif kind == _VMM_MAPPING:
            self._mappings.append(entry)

    def _stack_frames(self, stack: Stack | None) -> list[dict[str, Any]]:
        """The frames of a stack in torch's shape, one list for equal frames (as viz_segments and snapshot_dict
        share them); none for a block without a stack."""
        return self._frames_of(tuple(VizFrame(frame.function, frame.file, frame.line) for frame in stack.frames)
                               if stack is not None else ())

    def finish(self) -> VizExport:
        """The blocks nested in their segments (segments_of's rule: the segment that starts last at or before
        the block's address, if the block ends inside it)."""
        segments = [_Nested(address, size, device, False) for address, size, device in self._runtime]
        for address, size, device in sorted(self._mappings):  # contiguous mappings on one device: one segment
            last = segments[-1] if segments and segments[-1].expandable else None
            if last is not None and last.address + last.size == address and last.device == device:
                last.size += size
            else:
                segments.append(_Nested(address, size, device, True))
        segments.sort(key=lambda segment: segment.address)
        addresses, requested = self._addresses, self._requested
        order = sorted(self._by_address, key=addresses.__getitem__)  # the pages' runs merged
        in_order = [addresses[index] for index in order]
        starts = [segment.address for segment in segments] + [1 << 64]
        for number, segment in enumerate(segments):
            low, high = bisect.bisect_left(in_order, starts[number]), bisect.bisect_left(in_order, starts[number + 1])
            end = segment.address + segment.size
            segment.blocks = [index for index in order[low:high] if addresses[index] + requested[index] <= end]
        return VizExport(self, segments)


class _Nested:
    """A segment of the export and the indices of its blocks, in address order."""

    __slots__ = ("address", "size", "device", "expandable", "blocks")

    def __init__(self, address: int, size: int, device: int, expandable: bool) -> None:
        self.address, self.size, self.device, self.expandable = address, size, device, expandable
        self.blocks: list[int] = []


class VizExport:
    """An ExportBuilder's blocks in their segments: how many there are, and the snapshot."""

    def __init__(self, built: ExportBuilder, segments: list[_Nested]) -> None:
        self._built, self._segments = built, segments
        self.segments = len(segments)
        self.blocks = sum(len(segment.blocks) for segment in segments)
        self.outside = len(built._addresses) - self.blocks  # in no traced segment: left out
        self.passed = len(built._passed) and sum(index in built._passed for segment in segments
                                                 for index in segment.blocks)

    def snapshot(self) -> dict[str, Any]:
        """What snapshot_dict gives for these segments (the same structure, element for element); ValueError
        for what it refuses."""
        built = self._built
        devices = built._devices
        viz = []
        for segment in self._segments:
            device = segment.device
            if device < 0:  # viz_segments: the device PyTorch reported for a block in it, else 0
                device = next((devices[index] for index in segment.blocks if devices[index] >= 0), 0)
            viz.append((VizSegment(device, segment.address, segment.size, 0, (), segment.expandable), segment))
        viz.sort(key=lambda pair: (pair[0].device, pair[0].address))
        _check_segments([shape for shape, _ in viz])
        out_segments = [self._segment_dict(shape, segment.blocks) for shape, segment in viz]
        device_count = viz[-1][0].device + 1 if viz else 0
        keys, entry_of = sorted(built._by_time), built._entry_of_time_key  # the pages' runs merged
        if device_count == 1 and self.outside == 0:
            device_traces = [[entry_of[key] for key in keys]]
        else:
            device_of: dict[int, int] = {}
            for shape, segment in viz:
                device_of.update(dict.fromkeys([built._time_keys[index] for index in segment.blocks], shape.device))
            device_traces = [[] for _ in range(device_count)]
            for key in keys:
                device = device_of.get(key)
                if device is not None:
                    device_traces[device].append(entry_of[key])
        return {"segments": out_segments, "device_traces": device_traces}

    def _segment_dict(self, segment: VizSegment, indices: list[int]) -> dict[str, Any]:
        """_segment_dict's entry, from the blocks' dicts already made: only gaps and clipped roundings are
        looked at one by one."""
        built = self._built
        addresses = [built._addresses[index] for index in indices]
        requested = [built._requested[index] for index in indices]
        start, end = segment.address, segment.address + segment.size_bytes
        if (requested and min(requested) < 1) or any(map(operator.lt, addresses[1:],
                                                          map(operator.add, addresses, requested))):
            _check_blocks(segment, [VizBlock(address, request, 0, ()) for address, request in
                                    zip(addresses, requested, strict=True)])  # raises, saying which block
        blocks = [built._blocks[index] for index in indices]
        if not blocks:
            return _segment_entry(segment, 0, 0, _pool(segment.size_bytes, segment.is_expandable, 0),
                                  [_inactive_block(start, end - start)])
        ends = list(map(operator.add, addresses, [built._rounded[index] for index in indices]))
        limits = addresses[1:] + [end]
        allocated = sum(ends) - sum(addresses)
        out = [_inactive_block(start, addresses[0] - start)] if addresses[0] > start else []
        done = 0
        for index in [index for index, (stop, limit) in enumerate(zip(ends, limits, strict=True)) if stop != limit]:
            out += blocks[done:index + 1]
            stop, limit = ends[index], limits[index]
            if stop > limit:  # rounding up may not run into the next block or past the segment
                blocks[index]["size"] = limit - addresses[index]
                allocated -= stop - limit
            else:
                out.append(_inactive_block(stop, limit - stop))
            done = index + 1
        out += blocks[done:]
        return _segment_entry(segment, allocated, sum(requested),
                              _pool(segment.size_bytes, segment.is_expandable, max(requested)), out)
