"""The memory-viz export's pickle written directly, in one pass, from its blocks in columns: what
pickle.dump of snapshot_dict's structure reads back as (pickle.loads gives an equal structure), without
the two million dicts of a million blocks made first.

A block's dict, and its trace entry, are the same bytes but for a few numbers: a run of them is one
template repeated, each number column laid into its place by strided copies of its bytes (array,
bytearray), with no Python step per block. Numbers in a run are LONG1 of 8 bytes (little-endian two's
complement, so below 2**63); a key, a state, an action and a stack's frames are memo references (the
pickle stores each once, as pickle.dump does). What breaks a run is written one at a time: a gap (an
inactive block), the first block of a stack whose frames are not yet written, a number of 2**63 or more
(none in practice).

Only opcodes PyTorch's JavaScript viewer reads are written (MemoryViz.js `unpickle`: no FRAME needed, a
LONG1 of at most 8 bytes reads as a Number), and lists are filled 1000 items at a time as pickle.dump
does (the viewer spreads each batch into a call's arguments).
"""
from __future__ import annotations

import array
import struct
import sys
from collections.abc import Mapping, Sequence
from typing import Any, BinaryIO

PROTO_4, STOP, MARK, MEMOIZE = b"\x80\x04", b".", b"(", b"\x94"
EMPTY_DICT, EMPTY_LIST, SETITEMS, APPEND, APPENDS = b"}", b"]", b"u", b"a", b"e"
NEWTRUE, NEWFALSE, TUPLE2 = b"\x88", b"\x89", b"\x86"
LONG1_8 = b"\x8a\x08"  # LONG1 of 8 bytes
BATCH = 1000  # items per APPENDS, as pickle.dump
CHUNK = 16 * BATCH  # items a run fills at once (about 1 MB: a buffer that stays in the caches)
LIMIT = 1 << 63  # a run's numbers are below it (LONG1 of 8 bytes, signed)
_BIG_ENDIAN = sys.byteorder == "big"  # (arrays are in the machine's order; the pickle's numbers little-endian)


def encode_int(value: int) -> bytes:
    """An int as pickle.dump writes it (protocol 4)."""
    if 0 <= value < 0x100:
        return b"K" + bytes((value,))
    if 0 <= value < 0x10000:
        return b"M" + value.to_bytes(2, "little")
    if -0x80000000 <= value < 0x80000000:
        return b"J" + value.to_bytes(4, "little", signed=True)
    data = value.to_bytes((value.bit_length() >> 3) + 1, "little", signed=True)
    if value < 0 and len(data) > 1 and data[-1] == 0xFF and data[-2] & 0x80:
        data = data[:-1]
    return b"\x8a" + bytes((len(data),)) + data


def _get(index: int) -> bytes:
    return b"h" + bytes((index,)) if index < 0x100 else b"j" + struct.pack("<I", index)


class Template:
    """A dict of fixed keys whose values are numbers (LONG1 of 8 bytes), memo references (fixed) or a stack's
    frames (LONG_BINGET, 4 bytes): the str parts name the holes, in order. Filled for a run of items at once:
    the blank item (holes zero) repeated, then each hole's column laid in, a byte at a time, by strided copies
    (loops in C over the items: no Python step, nor call, per item)."""

    def __init__(self, parts: Sequence[bytes | str]) -> None:
        self.holes: list[str] = []
        self.offsets: list[tuple[int, str, int]] = []  # each hole's (byte offset, array type code, width)
        blank = bytearray(EMPTY_DICT + MARK)
        for part in [*parts, SETITEMS]:
            if isinstance(part, str):
                frames = part == "frames"
                blank += b"j" if frames else LONG1_8
                code, width = ("I", 4) if frames else ("Q", 8)
                self.offsets.append((len(blank), code, width))
                blank += bytes(width)
                self.holes.append(part)
            else:
                blank += part
        self.blank = bytes(blank)
        self.size = len(blank)

    def fill(self, columns: Mapping[str, Sequence[int]], count: int) -> bytearray:
        """`count` items, each hole from its column (numbers below 2**63: OverflowError for one not below
        2**64; frames: memo indexes)."""
        data = bytearray(self.blank * count)
        self.fill_into(data, self.numbers(columns, count), 0, count)
        return data

    def numbers(self, columns: Mapping[str, Sequence[int]], count: int) -> list[bytes]:
        """Each hole's column as the bytes fill_into copies from (little-endian numbers)."""
        raw = []
        for hole, (_, code, _) in zip(self.holes, self.offsets, strict=True):
            values = columns[hole]
            if len(values) != count:
                raise ValueError(f"{hole}: {len(values)} values for {count} items")
            numbers = array.array(code, values)
            if _BIG_ENDIAN:
                numbers.byteswap()
            raw.append(numbers.tobytes())
        return raw

    def fill_into(self, data: bytearray, numbers: list[bytes], first: int, count: int) -> None:
        """Items first..first+count of `numbers` (from numbers()) into the holes of the first `count` items of
        `data`, blank items (their fixed bytes are not written again): a strided copy per byte of a number
        (bytearray's, a plain C loop; a buffer of about a megabyte stays in the caches)."""
        stride = self.size
        end = count * stride
        for (offset, _, width), source in zip(self.offsets, numbers, strict=True):
            low, high = first * width, (first + count) * width
            for byte in range(width):
                data[offset + byte:end:stride] = source[low + byte:high:width]


class PickleWriter:
    """Writes one snapshot, in order, to a binary file: the caller says what comes (dicts, lists, runs)."""

    def __init__(self, file: BinaryIO, frame_lists: Sequence[list[dict[str, Any]]]) -> None:
        self.file, self.frame_lists = file, frame_lists
        self.memo = 0
        self.strings: dict[str, bytes] = {}  # text -> its memo reference
        self.frames: dict[int, int] = {}  # frame list number -> its memo index
        # id of a shared constant (a tuple) -> its memo reference. By identity, as pickle.dump memoizes: the
        # tuples written are module constants (viz_export's pools), alive for the writer's life, so no id is
        # reused by another tuple meanwhile.
        self.objects: dict[int, bytes] = {}
        self.write = file.write
        self.write(PROTO_4)

    def memoize(self) -> int:
        self.write(MEMOIZE)
        self.memo += 1
        return self.memo - 1

    def string(self, text: str) -> None:
        got = self.strings.get(text)
        if got is not None:
            self.write(got)
            return
        data = text.encode("utf-8", "surrogatepass")
        self.write((b"\x8c" + bytes((len(data),)) if len(data) < 0x100 else b"X" + struct.pack("<I", len(data)))
                   + data)
        self.strings[text] = _get(self.memoize())

    def reference(self, text: str) -> bytes:
        """The memo reference of a string written before (a template's fixed part)."""
        return self.strings[text]

    def frames_of(self, number: int) -> None:
        """A stack's frames: the list the first time, its memo reference after."""
        index = self.frames.get(number)
        if index is not None:
            self.write(b"j" + struct.pack("<I", index))
            return
        self.write(EMPTY_LIST)
        self.frames[number] = self.memoize()
        frames = self.frame_lists[number]
        if frames:
            self.write(MARK)
            for frame in frames:
                self.mapping(frame)
            self.write(APPENDS)

    def value(self, value: Any) -> None:
        if value is True or value is False:
            self.write(NEWTRUE if value else NEWFALSE)
        elif isinstance(value, int):
            self.write(encode_int(value))
        elif isinstance(value, str):
            self.string(value)
        elif isinstance(value, tuple) and len(value) == 2:  # shared, as pickle.dump memoizes a tuple
            got = self.objects.get(id(value))
            if got is None:
                self.value(value[0])
                self.value(value[1])
                self.write(TUPLE2)
                got = self.objects[id(value)] = _get(self.memoize())
                return
            self.write(got)
        elif value == []:
            self.write(EMPTY_LIST)
        else:
            raise TypeError(f"cannot write {type(value).__name__} here")

    def mapping(self, items: Mapping[str, Any]) -> None:
        self.write(EMPTY_DICT + MARK)
        for key, value in items.items():
            self.string(key)
            self.value(value)
        self.write(SETITEMS)

    def run(self, template: Template, columns: Mapping[str, Sequence[int]], count: int) -> None:
        """`count` items of a list being written, each `template` filled from `columns` (frames: frame list
        numbers, each written before), in batches."""
        if "frames" in columns:
            columns = dict(columns, frames=list(map(self.frames.__getitem__, columns["frames"])))
        numbers = template.numbers(columns, count)
        stride = template.size
        # A chunk at a time, in one buffer that stays in the caches: only its holes are written again.
        data = bytearray(template.blank * min(count, CHUNK))
        view = memoryview(data)
        for first in range(0, count, CHUNK):
            items = min(CHUNK, count - first)
            template.fill_into(data, numbers, first, items)
            for start in range(0, items, BATCH):
                self.write(MARK)
                self.write(view[start * stride:min(start + BATCH, items) * stride])
                self.write(APPENDS)

    def end(self) -> None:
        self.write(STOP)
