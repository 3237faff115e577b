"""Blocks inside segments: PyTorch's caching allocator hands tensors blocks carved out of the
segments it got from CUDA. kvtrace sees both levels exactly, so it can say per segment what is
allocated, what is free and how scattered the free part is.

A segment is what the allocator reserved: a runtime-layer device allocation (cudaMalloc) or, under
expandable segments, a run of contiguous VMM mappings (one virtual range grown piece by piece; a
block may straddle two mappings). Blocks are the TORCH layer. Sizes of blocks are what the program
asked for (pytorch:malloc reports the requested size; the allocator rounds it up inside the block).
"""
from __future__ import annotations

import bisect
import math
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from kvtrace.model.events import Layer, Memory, ObjectKind
from kvtrace.model.ledger import Outstanding


@dataclass
class Segment:
    """One segment of one process and device, with the blocks that lie in it (address order)."""

    pid: int
    device: int
    address: int
    size_bytes: int
    expandable: bool = False  # a run of VMM mappings
    blocks: list[Outstanding] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.address + self.size_bytes

    @property
    def allocated_bytes(self) -> int:
        return sum(block.size_bytes for block in self.blocks)

    @property
    def free_bytes(self) -> int:
        return self.size_bytes - self.allocated_bytes

    def free_runs(self) -> list[tuple[int, int]]:
        """(address, bytes) of each stretch no block covers, in address order."""
        runs, position = [], self.address
        for block in self.blocks:
            start = block.key.address
            if start > position:
                runs.append((position, start - position))
            position = max(position, start + block.size_bytes)
        if position < self.end:
            runs.append((position, self.end - position))
        return runs

    @property
    def largest_free_bytes(self) -> int:
        return max((size for _, size in self.free_runs()), default=0)


@dataclass(frozen=True)
class Fragmentation:
    """One process on one device: its allocator's segments against the blocks in them."""

    pid: int
    device: int
    reserved_bytes: int  # sum of segments
    allocated_bytes: int  # sum of blocks (as requested)
    largest_free_bytes: int  # the largest stretch of any segment no block covers
    segments: int
    blocks: int
    blocks_outside_segments: int  # blocks in no traced segment (the segment predates the agent)

    @property
    def free_bytes(self) -> int:
        return self.reserved_bytes - self.allocated_bytes

    @property
    def ratio(self) -> float:
        """External fragmentation, 1 - largest free / free: 0 when the free memory is one stretch
        (any request up to it fits), near 1 when it is scattered in small pieces; 0 with none free."""
        return 1.0 - self.largest_free_bytes / self.free_bytes if self.free_bytes > 0 else 0.0


def is_block(entry: Outstanding) -> bool:
    return entry.key.object is ObjectKind.BLOCK


def estimated_bytes(entry: Outstanding) -> float:
    """The bytes an entry stands for in sums per stack: under stack sampling of blocks (probes/usdt.h), a
    block of s bytes was chosen for a stack with probability 1 - exp(-s/S), so a chosen one weighs its
    bytes by the inverse of that and one passed over weighs nothing (the chosen ones stand for it): per
    stack, the sum is an unbiased estimate of the bytes held. A block of at least S bytes is always
    chosen (weight 1), and an entry not sampled (sample_bytes 0: every other object, and every block
    where S is 0 or its process is walked in full) is its own size, exactly."""
    return estimated_size(entry.size_bytes, entry.sample_bytes, entry.sampled)


def estimated_size(size_bytes: int, sample_bytes: int, sampled: bool) -> float:
    """estimated_bytes of an entry of these fields (wherever they are: a wire entry, a JSON object)."""
    if not sample_bytes:
        return size_bytes
    if not sampled:
        return 0.0
    if size_bytes >= sample_bytes or size_bytes <= 0:
        return size_bytes
    return size_bytes / -math.expm1(-size_bytes / sample_bytes)


def is_estimated(entry: Outstanding) -> bool:
    """Whether estimated_bytes of the entry is an estimate, not its size: a block subject to stack sampling
    and smaller than the sampling's mean."""
    return bool(entry.sample_bytes) and entry.size_bytes < entry.sample_bytes


def segments_of(entries: Iterable[Outstanding], with_blocks: Collection[int] | None = None,
                ) -> tuple[list[Segment], list[Outstanding]]:
    """(segments with their blocks, blocks in no segment), from a ledger copy. Segments and blocks
    of processes with no block at all are left out: without blocks there is nothing to nest.
    `with_blocks`: those processes, if known (then one pass, keeping only their entries)."""
    if with_blocks is None:
        entries = list(entries)
        with_blocks = {entry.key.pid for entry in entries if is_block(entry)}
    pids = with_blocks
    blocks: list[Outstanding] = []
    segments: list[Segment] = []
    mappings: dict[int, list[Outstanding]] = {}
    for entry in entries:
        key = entry.key
        if key.pid not in pids:
            continue
        if key.object is ObjectKind.BLOCK:
            blocks.append(entry)
        elif key.layer is Layer.RUNTIME and key.object is ObjectKind.ALLOCATION and entry.memory is Memory.DEVICE:
            segments.append(Segment(key.pid, entry.device, key.address, entry.size_bytes))
        elif key.object is ObjectKind.VMM_MAPPING:
            mappings.setdefault(key.pid, []).append(entry)
    for pid, pid_mappings in mappings.items():
        segments.extend(_runs_of_mappings(pid, pid_mappings))
    segments.sort(key=lambda segment: (segment.pid, segment.address))
    outside = _nest(segments, blocks)
    return segments, outside


def _runs_of_mappings(pid: int, mappings: list[Outstanding]) -> list[Segment]:
    """Contiguous VMM mappings of one process on one device as one expandable segment each."""
    runs: list[Segment] = []
    for mapping in sorted(mappings, key=lambda entry: entry.key.address):
        last = runs[-1] if runs else None
        if last is not None and last.end == mapping.key.address and last.device == mapping.device:
            last.size_bytes += mapping.size_bytes
        else:
            runs.append(Segment(pid, mapping.device, mapping.key.address, mapping.size_bytes, expandable=True))
    return runs


def _nest(segments: list[Segment], blocks: list[Outstanding]) -> list[Outstanding]:
    """Puts each block into the segment of its process that holds it; returns those in none."""
    by_pid: dict[int, tuple[list[int], list[Segment]]] = {}
    for segment in segments:
        starts, owned = by_pid.setdefault(segment.pid, ([], []))
        starts.append(segment.address)
        owned.append(segment)
    outside = []
    for block in sorted(blocks, key=lambda entry: (entry.key.pid, entry.key.address)):
        starts, owned = by_pid.get(block.key.pid, ([], []))
        index = bisect.bisect_right(starts, block.key.address) - 1
        if index >= 0 and block.key.address + block.size_bytes <= owned[index].end:
            owned[index].blocks.append(block)
        else:
            outside.append(block)
    return outside


def fragmentation(segments: Iterable[Segment], outside: Iterable[Outstanding]) -> list[Fragmentation]:
    """Per process and device, in (pid, device) order."""
    rows: dict[tuple[int, int], list[int]] = {}
    for segment in segments:
        row = rows.setdefault((segment.pid, segment.device), [0, 0, 0, 0, 0, 0])
        row[0] += segment.size_bytes
        row[1] += segment.allocated_bytes
        row[2] = max(row[2], segment.largest_free_bytes)
        row[3] += 1
        row[4] += len(segment.blocks)
    for block in outside:
        row = rows.setdefault((block.key.pid, block.device), [0, 0, 0, 0, 0, 0])
        row[5] += 1
    return [Fragmentation(pid, device, *row) for (pid, device), row in sorted(rows.items())]
