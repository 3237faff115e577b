"""A PyTorch memory snapshot taken from outside the process.

`snapshot_dict` builds the structure that ``torch.cuda.memory._snapshot()`` returns, from the CUDA
segments of PyTorch's caching allocator and the live blocks (tensors) in them, so that PyTorch's own
viewers render it: ``python -m torch.cuda._memory_viz trace_plot FILE -o out.html``, ``segment_plot``,
``stats``, ``trace`` and the memory viewer on pytorch.org. `write_pickle` writes it as the file those
tools read. `kvtrace snapshot --format memory-viz` writes the same file (read back, element for element)
from a listing's pages as they come, without this structure in memory: reports/viz_export.py.

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
- A process none of whose blocks are traced (depth `segments`: `kvtrace deep --pid` raises it) has each
  segment (each VMM mapping of an expandable one) shown as one live block of its size, its frames
  ``[blocks not traced: ...]`` and then the stack that allocated it (reports/viz_export.py; the CLI says so).
  A process whose blocks are traced but which holds no tensor shows its segments free.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtrace.model.blocks import Segment
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
# The first frame of a whole segment shown as one block because none of its process's blocks are traced (its
# depth is `segments`): the frames after it are the stack that allocated the segment (grew the cache), which
# need not be the one holding its tensors.
SEGMENT_HOLDER_FRAME = "[blocks not traced: the stack that allocated this segment]"

# The pytorch.org viewer reads the pickle with its own JavaScript reader, which refuses any protocol
# outside 2-4; 4 is also what Python 3.8-3.13 writes by default.
PICKLE_PROTOCOL = 4


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
