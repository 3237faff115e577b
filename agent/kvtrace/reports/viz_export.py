"""The memory-viz export built from a listing's pages as they come (`kvtrace snapshot --format memory-viz`):
the file reports/memory_viz.py describes, for a million blocks in seconds.

memory_viz.snapshot_dict makes the structure from the model's segments and blocks, and pickle.dump writes it:
a model object per ledger entry, then two dicts per block, then the pickler's pass over them. Here the
entries come in columns (model.ledger.EntryColumns), the blocks' numbers are kept in arrays (no Python object
per block), and the pickle is written from those (reports/viz_pickle.py): what reads it back (pickle.loads,
PyTorch's tools, the viewer) finds the same structure, element for element
(tests/unit/test_memory_viz_pages.py holds it).
"""
from __future__ import annotations

import array
import bisect
import itertools
import operator
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, BinaryIO, NamedTuple

from kvtrace.model.events import Layer, Memory, ObjectKind
from kvtrace.model.ledger import EntryColumns
from kvtrace.model.stacks import Stack
from kvtrace.reports.memory_viz import (
    BLOCK_GRANULARITY_BYTES,
    NOT_SAMPLED_FRAME,
    SEGMENT_HOLDER_FRAME,
    VizBlock,
    VizFrame,
    VizSegment,
    _check_blocks,
    _check_segments,
    _FramesCache,
    _inactive_block,
    _pool,
    _segment_entry,
)
from kvtrace.reports.output import write_whole
from kvtrace.reports.viz_pickle import APPEND, EMPTY_DICT, EMPTY_LIST, LIMIT, MARK, SETITEMS, PickleWriter, Template

# The ledger's numbers (EntryColumns) an export looks for: blocks, and the entries that are segments.
_BLOCK, _ALLOCATION, _VMM_MAPPING = ObjectKind.BLOCK.value, ObjectKind.ALLOCATION.value, ObjectKind.VMM_MAPPING.value
_RUNTIME, _DEVICE_MEMORY = Layer.RUNTIME.value, Memory.DEVICE.value


class ExportBuilder:
    """The memory-viz export of one process built from its ledger entries as a listing's pages come (columns,
    model.ledger.EntryColumns, each page with the stacks it refers to): the file that write_pickle of
    snapshot_dict(viz_segments(segments_of(entries), stacks.get)) writes reads back the same, without a model
    object per entry or a dict per block.

    A page is taken as it comes, while the agent reads the next one: its blocks' numbers appended to two tables
    of arrays, in the page's address order to one and in its time order to the other. `finish` merges the
    pages' orders (a sort of runs already sorted, of block positions), nests the blocks in their segments (one
    in none is left out, as segments_of leaves it outside) and says how many; `VizExport.write` lays each
    segment out (gaps, a rounding clipped by the next block), checks it as snapshot_dict does, and writes the
    pickle in one pass (reports/viz_pickle.py)."""

    # The EntryColumns it reads (client.snapshot_columns need not make the others).
    FIELDS = frozenset({"pid", "layer", "object", "memory", "size_bytes", "address", "device", "timestamp_ns",
                        "stack_id", "stream", "sample_bytes", "sampled"})

    def __init__(self, pid: int) -> None:
        self.pid = pid
        # The blocks' numbers in two tables of columns (arrays: no object per block), each page's blocks in
        # address order in one and in (time, address) order in the other: the whole's orders are then the pages'
        # runs merged, and reading a column in either goes through each page's in order (what a read in an
        # order unlike the one the numbers were stored in costs: a cache miss each, 0.15 s a million).
        self._by_address = _Table(("address", "requested", "frames", "device", "passed"))
        self._by_time = _Table(("address", "requested", "stream", "timestamp", "frames"))
        self.large_numbers = False  # whether a number is 2**63 or more (written alone, not in a run)
        # (address, size, device, timestamp, frames as a segment's holder) of each runtime allocation, VMM mapping
        self._runtime: list[tuple[int, int, int, int, int]] = []
        self._mappings: list[tuple[int, int, int, int, int]] = []
        self._frames_of_stack: dict[int, int] = {}  # stack id -> its frame list's number
        self._frames_of = _FramesCache()
        self.frame_lists: list[list[dict[str, Any]]] = []  # by number: each distinct stack's frames, torch's shape
        self._number_of: dict[int, int] = {}  # id of a frame list -> its number
        self._not_sampled = self._number(self._frames_of((VizFrame(NOT_SAMPLED_FRAME, "", 0),)))
        self._segment_frames: dict[int, int] = {}  # a segment's stack id -> the frame list number shown for it
        self.segments_as_blocks = False  # finish(): no block traced, each segment shown as one
        self._finished = False

    def add(self, columns: EntryColumns, stacks: Mapping[int, Stack]) -> None:
        """One page's entries (of any process: only this one's are taken) and the stacks they refer to."""
        count, objects = len(columns.pid), columns.object
        picked: list[int] | None = None  # None: all, the columns as they are
        if columns.pid.count(self.pid) != count:
            picked = list(itertools.compress(range(count), map(operator.eq, columns.pid, itertools.repeat(self.pid))))
        if picked is not None or objects.count(_BLOCK) != count:  # segments among them, or other processes
            rows: Sequence[int] = range(count) if picked is None else picked
            blocks = list(map(operator.eq, objects if picked is None else _gather(objects, picked),
                              itertools.repeat(_BLOCK)))
            for index in itertools.compress(rows, map(operator.not_, blocks)):
                self._segment_part(columns, index, stacks)
            picked = list(itertools.compress(rows, blocks))

        if not self.large_numbers and max((max(values, default=0) for values in (
                columns.address, columns.size_bytes, columns.stream, columns.timestamp_ns)), default=0) >= LIMIT:
            self.large_numbers = True  # (none in practice) then the writer looks for them
        # The page's blocks in address order (their indexes in the page).
        by_address = _order(columns.address, picked)
        stack_ids = _gather(columns.stack_id, by_address)
        frames_of_stack = self._frames_of_stack
        for stack_id in set(stack_ids) - frames_of_stack.keys():
            frames_of_stack[stack_id] = self._number(self._stack_frames(stacks.get(stack_id) if stack_id else None))
        frames: Sequence[int] = list(map(frames_of_stack.__getitem__, stack_ids))
        passed: Sequence[bool] = [False] * len(frames)
        if any(columns.sample_bytes):
            passed = [bool(sample_bytes) and not sampled for sample_bytes, sampled in
                      zip(_gather(columns.sample_bytes, by_address), _gather(columns.sampled, by_address),
                          strict=True)]
            frames = [self._not_sampled if passed_over else number for number, passed_over in
                      zip(frames, passed, strict=True)]
        self._add_blocks(_gather(columns.address, by_address), _gather(columns.size_bytes, by_address), frames,
                         _gather(columns.device, by_address), passed, _gather(columns.stream, by_address),
                         _gather(columns.timestamp_ns, by_address))

    def _add_blocks(self, address: Sequence[int], requested: Sequence[int], frames: Sequence[int],
                    device: Sequence[int], passed: Sequence[bool], stream: Sequence[int],
                    timestamp: Sequence[int]) -> None:
        """Blocks' columns, in address order, into both tables: as they are, and in time order (stable: equal
        times in address order)."""
        by_time = _order(timestamp)
        self._by_address.add(address=address, requested=requested, frames=frames, device=device, passed=passed)
        self._by_time.add(address=_gather(address, by_time), requested=_gather(requested, by_time),
                          stream=_gather(stream, by_time), timestamp=_gather(timestamp, by_time),
                          frames=_gather(frames, by_time))

    def _segment_part(self, columns: EntryColumns, index: int, stacks: Mapping[int, Stack]) -> None:
        """A segment's entry (segments_of's: a runtime device allocation, or a VMM mapping, one of a run), with
        what `finish` shows for it where the process has no block traced: its allocating stack."""
        kind, layer = columns.object[index], columns.layer[index]
        if kind == _ALLOCATION and layer == _RUNTIME and columns.memory[index] == _DEVICE_MEMORY:
            kept = self._runtime
        elif kind == _VMM_MAPPING:
            kept = self._mappings
        else:
            return
        stack_id = columns.stack_id[index]
        frames = self._segment_frames.get(stack_id)
        if frames is None:
            stack = stacks.get(stack_id) if stack_id else None
            frames = self._segment_frames[stack_id] = self._number(self._frames_of(
                (VizFrame(SEGMENT_HOLDER_FRAME, "", 0),
                 *(VizFrame(frame.function, frame.file, frame.line) for frame in (stack.frames if stack else ())))))
        kept.append((columns.address[index], columns.size_bytes[index], columns.device[index],
                     columns.timestamp_ns[index], frames))

    def _stack_frames(self, stack: Stack | None) -> list[dict[str, Any]]:
        """The frames of a stack in torch's shape, one list for equal frames (as viz_segments and snapshot_dict
        share them); none for a block without a stack."""
        return self._frames_of(tuple(VizFrame(frame.function, frame.file, frame.line) for frame in stack.frames)
                               if stack is not None else ())

    def _number(self, frames: list[dict[str, Any]]) -> int:
        number = self._number_of.get(id(frames))
        if number is None:
            number = self._number_of[id(frames)] = len(self.frame_lists)
            self.frame_lists.append(frames)
        return number

    def _add_stand_ins(self) -> None:
        """Each runtime segment and VMM mapping (address, size, device, timestamp, frames) as one block."""
        address, requested, device, timestamp, frames = zip(*sorted(self._runtime + self._mappings), strict=True)
        self._add_blocks(address, requested, frames, device, [False] * len(address), [0] * len(address), timestamp)

    def segments_before(self, timestamp_ns: int) -> int:
        """How many of the process's runtime segments and VMM mappings were allocated before `timestamp_ns`."""
        return sum(1 for entry in (*self._runtime, *self._mappings) if entry[3] < timestamp_ns)

    def finish(self, blocks_traced: bool = False) -> VizExport:
        """The blocks nested in their segments (segments_of's rule: the segment that starts last at or before
        the block's address, if the block ends inside it); once. Where no block came and the process's blocks
        are not traced (`blocks_traced` False: its depth is segments), each runtime segment and each VMM mapping
        is shown as one block held by the stack that allocated it, under a first frame SEGMENT_HOLDER_FRAME
        (`segments_as_blocks` says so); where they are traced, no block means free segments."""
        if self._finished:
            raise RuntimeError("an ExportBuilder is finished once")
        self._finished = True
        segments = [_Nested(address, size, device, False) for address, size, device, _, _ in self._runtime]
        for address, size, device, _, _ in sorted(self._mappings):  # contiguous mappings on one device: one segment
            last = segments[-1] if segments and segments[-1].expandable else None
            if last is not None and last.address + last.size == address and last.device == device:
                last.size += size
            else:
                segments.append(_Nested(address, size, device, True))
        self.segments_as_blocks = not blocks_traced and not self._by_address.address and bool(segments)
        if self.segments_as_blocks:
            self._add_stand_ins()
        segments.sort(key=lambda segment: segment.address)
        table = self._by_address
        order = _order(table.address)  # the pages' runs merged: positions in the table
        addresses, requested = _gather(table.address, order), _gather(table.requested, order)
        frames = _gather(table.frames, order)
        starts = [segment.address for segment in segments] + [1 << 64]
        for number, segment in enumerate(segments):
            low, high = bisect.bisect_left(addresses, starts[number]), bisect.bisect_left(addresses, starts[number + 1])
            end = segment.address + segment.size
            fits = list(map(operator.le, map(operator.add, addresses[low:high], requested[low:high]),
                            itertools.repeat(end)))
            segment.blocks = order[low:high]
            segment.columns = (addresses[low:high], requested[low:high], frames[low:high])
            if not all(fits):
                segment.blocks = list(itertools.compress(segment.blocks, fits))
                segment.columns = tuple(tuple(itertools.compress(values, fits)) for values in segment.columns)
        return VizExport(self, segments, len(order))


def _order(values: Sequence[int], indexes: Sequence[int] | None = None) -> list[int]:
    """The indexes of `values`' items (`indexes`, or all) in their order (stable: equal values in the order
    they came). Compared as floats where all differences from the least are exact in one (they are, for
    addresses and times: a float's compare costs less than an int's of two digits or more), else as ints."""
    if not values or indexes is not None and not indexes:
        return []
    least = min(values)
    if max(values) - least < _EXACT_IN_FLOAT:
        keys: Sequence[float | int] = list(map(float, map(operator.sub, values, itertools.repeat(least))))
    else:
        keys = values.tolist() if isinstance(values, array.array) else values
    return sorted(range(len(values)) if indexes is None else indexes, key=keys.__getitem__)


def _gather(values: Sequence[int], order: Sequence[int]) -> Sequence[int]:
    """values[i] for each i in `order`, in one C call (a tuple; a list for fewer than two)."""
    return operator.itemgetter(*order)(values) if len(order) > 1 else [values[index] for index in order]


class _Table:
    """Columns of block numbers (arrays), each page's rows appended in an order; `names` are those kept."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = names
        self.address, self.requested, self.stream = array.array("Q"), array.array("Q"), array.array("Q")
        self.timestamp, self.device = array.array("Q"), array.array("q")
        self.frames = array.array("L")  # frame list numbers
        self.passed = array.array("B")  # whether the block's stack was passed over (sampled stacks)

    def add(self, **columns: Sequence[int]) -> None:
        """A page's rows, in the table's order."""
        for name in self.names:
            getattr(self, name).fromlist(list(columns[name]))


_EXACT_IN_FLOAT = 1 << 53
# A segment's block columns, in address order: address, requested bytes, frame list number.
_ADDRESS, _REQUESTED, _FRAMES = 0, 1, 2


class _Nested:
    """A segment of the export and its blocks (their numbers, and their columns), in address order."""

    __slots__ = ("address", "size", "device", "expandable", "blocks", "columns")

    def __init__(self, address: int, size: int, device: int, expandable: bool) -> None:
        self.address, self.size, self.device, self.expandable = address, size, device, expandable
        self.blocks: Sequence[int] = []
        self.columns: tuple[Sequence[int], ...] = ((), (), ())


class VizExport:
    """An ExportBuilder's blocks in their segments: how many there are, and the file."""

    def __init__(self, built: ExportBuilder, segments: list[_Nested], count: int) -> None:
        self._built, self._segments = built, segments
        self.segments = len(segments)
        nested = sum(len(segment.blocks) for segment in segments)
        self.blocks = 0 if built.segments_as_blocks else nested  # the traced blocks written
        self.outside = count - nested  # in no traced segment: left out
        self.segments_as_blocks = built.segments_as_blocks  # no block traced: each segment shown as one
        passed = built._by_address.passed
        self.passed = sum(sum(map(passed.__getitem__, segment.blocks)) for segment in segments) if any(passed) else 0

    def write(self, path: str | os.PathLike[str]) -> None:
        """The file write_pickle(path, snapshot_dict(...)) writes for these segments, as pickle.loads reads it
        (the same structure, element for element; 0600, whole or not at all); ValueError for what snapshot_dict
        refuses, before anything is written."""
        viz = []
        devices = self._built._by_address.device
        for segment in self._segments:
            device = segment.device
            if device < 0:  # viz_segments: the device PyTorch reported for a block in it, else 0
                device = next((device for device in map(devices.__getitem__, segment.blocks) if device >= 0), 0)
            viz.append((VizSegment(device, segment.address, segment.size, 0, (), segment.expandable), segment))
        viz.sort(key=lambda pair: (pair[0].device, pair[0].address))
        _check_segments([shape for shape, _ in viz])
        layouts = [_layout(shape, segment.columns) for shape, segment in viz]  # each checked before writing
        # A segment's stand-in block is no request: its pool is judged by its size alone (an expandable segment of a
        # whole number of 20 MiB pages is then called large, as segment_type calls it without a large block).
        if self.segments_as_blocks:
            layouts = [layout._replace(pool=_pool(shape.size_bytes, shape.is_expandable, 0))
                       for layout, (shape, _) in zip(layouts, viz, strict=True)]
        traces = self._device_traces(viz)
        write_whole(path, lambda file: self._write(file, viz, layouts, traces), "snapshot", "snapshot.pickle", 0o600)

    def _write(self, file: BinaryIO, viz: list[tuple[VizSegment, _Nested]], layouts: list[_Layout],
               traces: list[dict[str, Sequence[int]]]) -> None:
        out = PickleWriter(file, self._built.frame_lists)
        out.write(EMPTY_DICT + MARK)
        out.string("segments")
        out.write(EMPTY_LIST)
        for (shape, segment), layout in zip(viz, layouts, strict=True):
            _write_segment(out, shape, segment.columns, layout, self._built.large_numbers)
            out.write(APPEND)
        out.string("device_traces")
        out.write(EMPTY_LIST)
        for trace in traces:
            out.write(EMPTY_LIST)
            _write_runs(out, trace, _alloc_entry_template, _alloc_entry_first,
                        large_numbers=self._built.large_numbers)
            out.write(APPEND)
        out.write(SETITEMS)
        out.end()

    def _device_traces(self, viz: list[tuple[VizSegment, _Nested]]) -> list[dict[str, Sequence[int]]]:
        """Each device's alloc entries' columns by (timestamp_ns, address), as snapshot_dict orders them (equal
        times, rare, put in address order)."""
        table = self._built._by_time
        timestamps = table.timestamp
        order = _order(timestamps)  # the pages' runs merged: positions in the table
        times = _gather(timestamps, order)
        done = 0
        for tie in itertools.compress(range(len(times)), map(operator.eq, times, itertools.islice(times, 1, None))):
            if tie >= done:  # a run of equal times starts here (rare across pages: within one, in address order)
                done = tie + 1
                while done < len(times) and times[done] == times[tie]:
                    done += 1
                order[tie:done] = sorted(order[tie:done], key=table.address.__getitem__)
        device_count = viz[-1][0].device + 1 if viz else 0
        if device_count == 1 and not self.outside:
            orders = [order]
        else:  # each nested block's device is its segment's (a block is one of its process's by its address)
            device_of: dict[int, int] = {}
            for shape, segment in viz:
                device_of.update(dict.fromkeys(segment.columns[_ADDRESS], shape.device))
            devices = list(map(device_of.get, _gather(table.address, order), itertools.repeat(-1)))
            orders = [list(itertools.compress(order, map(operator.eq, devices, itertools.repeat(device))))
                      for device in range(device_count)]
        return [{"addr": _gather(table.address, each), "size": _gather(table.requested, each),
                 "stream": _gather(table.stream, each),
                 "time_us": list(map(operator.floordiv, times if each is order else _gather(timestamps, each),
                                     itertools.repeat(1000))),
                 "frames": _gather(table.frames, each)} for each in orders]


class _Layout(NamedTuple):
    """A segment's blocks as _segment_dict lays them out: each one's size (rounded, clipped by what follows),
    the gaps after blocks (block index -> (address, size)), a gap first, and the totals."""

    sizes: list[int]
    gaps: dict[int, tuple[int, int]]
    first_gap: tuple[int, int] | None
    allocated: int
    requested: int
    pool: str


def _layout(segment: VizSegment, columns: tuple[Sequence[int], ...]) -> _Layout:
    """_segment_dict's layout and _check_blocks' checks, a C loop per column and a step only per gap or clip."""
    start, end = segment.address, segment.address + segment.size_bytes
    addresses, requested = columns[_ADDRESS], columns[_REQUESTED]
    if not addresses:
        return _Layout([], {}, (start, end - start), 0, 0, _pool(segment.size_bytes, segment.is_expandable, 0))
    if min(requested) < 1 or any(map(operator.lt, addresses[1:], map(operator.add, addresses, requested))):
        _check_blocks(segment, [VizBlock(address, request, 0, ()) for address, request in
                                zip(addresses, requested, strict=True)])  # raises, saying which block
    granularity = BLOCK_GRANULARITY_BYTES
    sizes = [-(-request // granularity) * granularity or granularity for request in requested]
    ends = list(map(operator.add, addresses, sizes))
    limits = [*addresses[1:], end]
    allocated = sum(sizes)
    gaps = {}
    for index in itertools.compress(range(len(ends)), map(operator.ne, ends, limits)):
        stop, limit = ends[index], limits[index]
        if stop > limit:  # rounding up may not run into the next block or past the segment
            sizes[index] = limit - addresses[index]
            allocated -= stop - limit
        else:
            gaps[index] = (stop, limit - stop)
    first = (start, addresses[0] - start) if addresses[0] > start else None
    return _Layout(sizes, gaps, first, allocated, sum(requested),
                   _pool(segment.size_bytes, segment.is_expandable, max(requested)))


def _write_segment(out: PickleWriter, segment: VizSegment, columns: tuple[Sequence[int], ...], layout: _Layout,
                   large_numbers: bool) -> None:
    """One entry of ``segments``, as _segment_entry makes it, its blocks as runs."""
    entry = _segment_entry(segment, layout.allocated, layout.requested, layout.pool, [])
    del entry["blocks"]
    out.write(EMPTY_DICT + MARK)
    for key, value in entry.items():
        out.string(key)
        out.value(value)
    out.string("blocks")
    out.write(EMPTY_LIST)
    if layout.first_gap is not None:
        out.mapping(_inactive_block(*layout.first_gap))
        out.write(APPEND)
    _write_runs(out, {"address": columns[_ADDRESS], "size": layout.sizes, "requested_size": columns[_REQUESTED],
                      "frames": columns[_FRAMES]}, _block_template, _block_first, layout.gaps, large_numbers)
    out.write(SETITEMS)


def _block_first(out: PickleWriter, columns: Mapping[str, Sequence[int]], index: int) -> None:
    out.write(EMPTY_DICT + MARK)
    for key in ("address", "size", "requested_size"):
        out.string(key)
        out.value(columns[key][index])
    out.string("state")
    out.string("active_allocated")
    out.string("frames")
    out.frames_of(columns["frames"][index])
    out.write(SETITEMS)


def _block_template(out: PickleWriter) -> Template:
    get = out.reference
    return Template([get("address"), "address", get("size"), "size", get("requested_size"), "requested_size",
                     get("state"), get("active_allocated"), get("frames"), "frames"])


def _alloc_entry_first(out: PickleWriter, columns: Mapping[str, Sequence[int]], index: int) -> None:
    out.write(EMPTY_DICT + MARK)
    out.string("action")
    out.string("alloc")
    for key in ("addr", "size", "stream", "time_us"):
        out.string(key)
        out.value(columns[key][index])
    out.string("frames")
    out.frames_of(columns["frames"][index])
    out.write(SETITEMS)


def _alloc_entry_template(out: PickleWriter) -> Template:
    get = out.reference
    return Template([get("action"), get("alloc"), get("addr"), "addr", get("size"), "size", get("stream"), "stream",
                     get("time_us"), "time_us", get("frames"), "frames"])


def _write_runs(out: PickleWriter, columns: Mapping[str, Sequence[int]], template: Callable[[PickleWriter], Template],
                first: Callable[[PickleWriter, Mapping[str, Sequence[int]], int], None],
                gaps: Mapping[int, tuple[int, int]] | None = None, large_numbers: bool = True) -> None:
    """The items of a list being written, one per entry of the columns, and a gap after those `gaps` names:
    runs of a template, and one at a time where a run cannot go (the first of its kind or of a stack's frames,
    a number of 2**63 or more, looked for where `large_numbers` says there may be one)."""
    frames = columns["frames"]
    count = len(frames)
    if not count:
        return
    alone = set(gaps or ())  # written alone: then their gap
    unwritten = set(frames) - out.frames.keys()  # a stack's frames, written at its first block: one pass
    for index, number in enumerate(frames):
        if number in unwritten:
            alone.add(index)
            unwritten.discard(number)
            if not unwritten:
                break
    if "active_allocated" not in out.strings and template is _block_template or \
            "alloc" not in out.strings and template is _alloc_entry_template:
        alone.add(0)  # its keys are written with it
    for name, values in columns.items() if large_numbers else ():
        if name != "frames" and max(values) >= LIMIT:
            alone.update(index for index, value in enumerate(values) if value >= LIMIT)
    shape: Template | None = None
    done = 0
    for index in [*sorted(alone), count]:
        if index > done:
            shape = shape or template(out)
            out.run(shape, {name: values[done:index] for name, values in columns.items()}, index - done)
        if index < count:
            first(out, columns, index)
            out.write(APPEND)
            gap = gaps.get(index) if gaps else None
            if gap is not None:
                out.mapping(_inactive_block(*gap))
                out.write(APPEND)
        done = index + 1
