"""Reading a BPF ring buffer map through its own mappings, a poll's records in one copy.

loader.py opens the rings; this is what reads them, apart from bcc (which reads one record per callback): the
event loop's hot path, and the only code here that reasons about the kernel's memory ordering.
"""
from __future__ import annotations

import ctypes
import mmap
import struct

from kvtrace.sources.bpf import abi


class RingReader:
    """A BPF ring buffer map read through its own mappings, as libbpf reads it, but a poll's records
    in one copy: the consumer position (read-write page), then the producer position and the data,
    mapped twice in a row so that a run of records that wraps is contiguous.

    First the headers, from the mapping itself, up to the first record not yet committed (where all
    in reach are committed events, the usual case, in one C call; else one at a time); then one copy
    of that run. A record's header is read before any of its data, and the
    kernel clears the busy bit only after writing the data: sound where loads are not reordered with
    older loads (x86-64, which also stores the 8-byte consumer position at once), so other CPUs use
    bcc's callback. Discarded records and ones of another size are sorted out in the copy."""

    MACHINES = frozenset({"x86_64", "amd64"})
    HEADER_BYTES = 8  # BPF_RINGBUF_HDR_SZ: u32 len (busy and discard bits on top), u32 page offset
    BUSY_BIT = 1 << 31
    DISCARD_BIT = 1 << 30
    RECORD_BYTES = abi.EVENT_STRUCT.size
    STRIDE = (HEADER_BYTES + RECORD_BYTES + 7) // 8 * 8
    _POSITION = struct.Struct("<Q")  # the producer's position, first in its page
    _LENGTH = struct.Struct("<I")  # a record header's first word

    def __init__(self, map_fd: int, data_bytes: int) -> None:
        page = mmap.PAGESIZE
        if data_bytes <= 0 or data_bytes & (data_bytes - 1) or data_bytes % page:
            raise ValueError(f"a ring of {data_bytes} bytes: not a power-of-2 number of pages")
        self._data_bytes = data_bytes
        self._mask = data_bytes - 1
        self._consumer = mmap.mmap(map_fd, page, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            self._producer = mmap.mmap(map_fd, page + 2 * data_bytes, mmap.MAP_SHARED, mmap.PROT_READ,
                                       offset=page)
        except BaseException:
            self._consumer.close()
            raise
        # One aligned 8-byte store (the kernel reads it with an acquire load).
        self._consumer_pos = ctypes.c_uint64.from_buffer(self._consumer)
        self._data = memoryview(self._producer)[page:]

    def read(self, max_records: int) -> bytes:
        """Up to `max_records` committed records (STRIDE bytes each, header first), consumed."""
        consumed = self._consumer_pos.value
        available = self._POSITION.unpack_from(self._producer, 0)[0] - consumed
        if available <= 0:
            return b""
        start = consumed & self._mask
        limit = min(available, max_records * self.STRIDE, self._data_bytes)
        committed = self._committed(start, limit)
        if not committed:
            return b""
        chunk = bytes(self._data[start:start + committed])  # the data, after every header of it
        if self._all_events(memoryview(chunk)):
            records = chunk
        else:
            records, length = self._walk(chunk, max_records)
            chunk = chunk[:length]
        if chunk:
            self._consumer_pos.value = consumed + len(chunk)
        return records

    def _committed(self, start: int, limit: int) -> int:
        """Bytes from `start` (at most `limit`) that hold whole committed or discarded records, read header
        by header from the shared mapping: the first one still busy ends the run. Where every header in
        reach is an event's, committed (the bulk of a busy ring), they are read in one C call."""
        data = self._data
        whole = limit // self.STRIDE * self.STRIDE
        if whole and self._all_events(data[start:start + whole]):
            return whole
        unpack = self._LENGTH.unpack_from
        position = 0
        while position + self.HEADER_BYTES <= limit:
            length = unpack(data, start + position)[0]
            if length & self.BUSY_BIT:
                break
            total = (self.HEADER_BYTES + (length & ~(self.BUSY_BIT | self.DISCARD_BIT)) + 7) // 8 * 8
            if position + total > limit:
                break
            position += total
        return position

    @classmethod
    def _all_events(cls, view: memoryview) -> bool:
        """Whether `view` is whole records, each a committed event (its header, read in one C call per
        view, is the event's length: neither busy nor discarded nor of another size)."""
        count = len(view) // cls.STRIDE
        return len(view) == count * cls.STRIDE and \
            view.cast("I")[::cls.STRIDE // 4].tolist().count(cls.RECORD_BYTES) == count

    def _walk(self, chunk: bytes, max_records: int) -> tuple[bytes, int]:
        """(records, bytes consumed) one header at a time: stops at a record not yet committed (or
        cut by the copy), skips discarded ones, and brings others to the event's size (zeros past
        a short one, which then decodes as undecodable)."""
        records: list[bytes] = []
        position = 0
        padding = bytes(self.STRIDE - self.HEADER_BYTES - self.RECORD_BYTES)
        while position + self.HEADER_BYTES <= len(chunk) and len(records) < max_records:
            length = self._LENGTH.unpack_from(chunk, position)[0]
            if length & self.BUSY_BIT:
                break
            size = length & ~(self.BUSY_BIT | self.DISCARD_BIT)
            total = (self.HEADER_BYTES + size + 7) // 8 * 8
            if position + total > len(chunk):
                break
            if not length & self.DISCARD_BIT:
                body = chunk[position + self.HEADER_BYTES:position + self.HEADER_BYTES + min(size, self.RECORD_BYTES)]
                records.append(bytes(self.HEADER_BYTES) + body.ljust(self.RECORD_BYTES, b"\0") + padding)
            position += total
        return b"".join(records), position

    def close(self) -> None:
        del self._consumer_pos
        self._data.release()
        self._producer.close()
        self._consumer.close()
