"""The recording file: what an agent saw, for replay after the processes are gone.

    MAGIC ("KVTRACE-REC\\n", 12 bytes) | format version (u16) | header length (u32) | RecordingHeader
    then chunks:  compressed length (u32) | CRC-32 of the compressed bytes (u32) | zlib stream
    in a chunk:   frame length (u32) | RecordingFrame, repeated

Integers are little-endian. The header and frames are kvtrace.v1 messages (agent_service.proto), so
a newer agent's fields and records pass through an older reader (an unknown record is skipped and
counted). The format version changes only when this layout does; a newer one is refused.

Chunks are independent: a writer flushes one at least every second, so a crash loses at most that,
and a reader stops at the first chunk that is cut short or fails its checksum, having read everything
before it, and says where (`RecordingReader.damage`). Appending to a file first drops such a tail.

A file may come from anywhere, so the reader trusts nothing in it: a chunk is read only up to
MAX_CHUNK_BYTES and inflated only up to MAX_CHUNK_FRAMES_BYTES (a zlib bomb is damage, not gigabytes
of memory), a frame must fit in its chunk, and a header with times or ages no kvtrace writes is
refused. One chunk is in memory at a time.
"""
from __future__ import annotations

import math
import os
import re
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, NoReturn

from google.protobuf.message import DecodeError

from kvtrace import __version__
from kvtrace._proto.kvtrace.v1 import agent_service_pb2 as service_pb2
from kvtrace.model.ledger import Outstanding

MAGIC = b"KVTRACE-REC\n"
FORMAT_VERSION = 1
_PREAMBLE = struct.Struct("<HI")  # format version, header length
_CHUNK = struct.Struct("<II")  # compressed length, CRC-32
_FRAME = struct.Struct("<I")
MAX_HEADER_BYTES = 1 << 20
MAX_CHUNK_BYTES = 64 << 20  # compressed; a writer's chunks are far smaller (CHUNK_TARGET_BYTES of frames)
CHUNK_TARGET_BYTES = 256 << 10  # frames buffered before a chunk is compressed and written
COMPRESSION_LEVEL = 3  # zlib: ~4x smaller event streams at well over 50 MB/s
# Inflated; a writer's chunk holds CHUNK_TARGET_BYTES of frames plus at most one large frame (a checkpoint
# of up to 8192 allocations, ~1-2 MiB), so this is generous, and bounds what a hostile chunk costs.
MAX_CHUNK_FRAMES_BYTES = 64 << 20
MAX_HEADER_TIME_NS = 1 << 62  # year ~2116: a later time in a header is damage
MAX_HEADER_SECONDS = 365 * 24 * 3600.0  # one year: the longest age or window a header may give
_INFLATE_INPUT_BYTES = 64 << 10  # a chunk is inflated in pieces: a bomb is refused holding ~one cap of it
_INFLATE_OUTPUT_BYTES = 1 << 20
_ZEROS = re.compile(b"\0+")  # runs of zero-length (empty) frames are skipped at once, not one by one


@dataclass(frozen=True)
class RecordedCheckpoint:
    """A recording's checkpoint, read whole: the ledger the records after it apply to (at the start of a
    file, after a resync, at the end of a flight recorder's dump)."""

    timestamp_ns: int
    entries: tuple[Outstanding, ...]


@dataclass(frozen=True)
class AtTime:
    """When in a recording to read it (`--at`): a wall-clock time, a time after its start, or its end
    (unset: its end)."""

    wall_ns: int | None = None
    after_start_ns: int | None = None
    end: bool = False


class RecordingError(Exception):
    """The file is not a recording this kvtrace can read; the message says why and what to do."""


class _Damage(Exception):
    """A chunk that cannot be read; the message says how (for `RecordingReader.damage`)."""


def _inflate(compressed: bytes) -> bytes:
    """A chunk's frames: its zlib stream, which must end exactly at the chunk's end and inflate to at most
    MAX_CHUNK_FRAMES_BYTES. Fed and drained in pieces, so that a bomb is refused before it is held whole
    (zlib.decompress would inflate it all, and joining the pieces would hold it twice)."""
    limit = MAX_CHUNK_FRAMES_BYTES  # read at each call: tests lower it
    inflater = zlib.decompressobj()
    view = memoryview(compressed)
    pieces: list[bytes] = []
    size = 0
    fed = 0
    pending: bytes | memoryview = b""
    try:
        while not inflater.eof:
            if not pending and fed < len(view):
                pending = view[fed:fed + _INFLATE_INPUT_BYTES]
                fed += len(pending)
            piece = inflater.decompress(pending, min(_INFLATE_OUTPUT_BYTES, limit + 1 - size))
            pending = inflater.unconsumed_tail
            size += len(piece)
            if size > limit:
                raise _Damage(f"a chunk inflates to more than {limit} bytes, more than any kvtrace writes in one")
            if not piece and not pending and fed == len(view):
                break  # every byte fed, nothing more comes out: the stream does not end in the chunk
            pieces.append(piece)
    except zlib.error as error:
        raise _Damage(f"a chunk does not decompress ({error})") from None
    if not inflater.eof:
        raise _Damage("a chunk's zlib stream does not end within the chunk")
    trailing = len(inflater.unused_data) + len(view) - fed
    if trailing:
        raise _Damage(f"a chunk has {trailing} bytes after its zlib stream")
    return b"".join(pieces)


class RecordingWriter:
    """Writes one recording file: `write` frames, `flush` at least every second, `close` at the end."""

    def __init__(self, file: BinaryIO, path: Path) -> None:
        self._file = file
        self.path = path
        self._buffer: list[bytes] = []
        self._buffered_bytes = 0
        self.frames_written = 0

    @classmethod
    def create(cls, path: Path, header: service_pb2.RecordingHeader, exclusive: bool = False) -> RecordingWriter:
        """A new file at `path` (replacing one there unless `exclusive`), created 0600: it holds stacks,
        addresses and process titles."""
        # Never through a symbolic link: the agent writes as root, often in a directory others can write.
        flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC) | os.O_CLOEXEC | os.O_NOFOLLOW
        fd = os.open(path, flags, 0o600)
        file = os.fdopen(fd, "wb")
        encoded = header.SerializeToString()
        file.write(MAGIC + _PREAMBLE.pack(FORMAT_VERSION, len(encoded)) + encoded)
        file.flush()
        return cls(file, path)

    @classmethod
    def append(cls, path: Path) -> RecordingWriter:
        """The existing recording at `path`, to write more frames after its last whole chunk (a
        damaged tail, from a writer that stopped mid-chunk, is cut off first)."""
        with RecordingReader.open(path) as reader:
            end = reader.data_start
            for _ in reader.chunks():
                end = reader.position
        file = open(path, "r+b")  # noqa: SIM115 - owned by the writer, closed by close()
        file.truncate(end)
        file.seek(end)
        return cls(file, path)

    @property
    def size_bytes(self) -> int:
        """Bytes in the file so far (frames still buffered not counted)."""
        return self._file.tell()

    def write(self, frame: service_pb2.RecordingFrame) -> None:
        encoded = frame.SerializeToString()
        self._buffer.append(_FRAME.pack(len(encoded)))
        self._buffer.append(encoded)
        self._buffered_bytes += _FRAME.size + len(encoded)
        self.frames_written += 1
        if self._buffered_bytes >= CHUNK_TARGET_BYTES:
            self.flush()

    def flush(self) -> None:
        """Writes the buffered frames as one chunk (nothing when there are none)."""
        if not self._buffer:
            return
        compressed = zlib.compress(b"".join(self._buffer), COMPRESSION_LEVEL)
        self._buffer.clear()
        self._buffered_bytes = 0
        self._file.write(_CHUNK.pack(len(compressed), zlib.crc32(compressed)) + compressed)
        self._file.flush()

    def close(self) -> None:
        if self._file.closed:
            return
        try:
            self.flush()
        finally:
            self._file.close()


class RecordingReader:
    """Reads a recording: `header`, then `frames()`. Damage (a cut or corrupt chunk) ends the frames
    early and is described in `damage`; everything before it is read."""

    def __init__(self, file: BinaryIO, path: Path) -> None:
        self._file = file
        self.path = path
        self.damage: str | None = None
        self.unknown_frames = 0  # records of a newer kvtrace, skipped
        self.header = self._read_header()
        self.data_start = self._file.tell()
        self.position = self.data_start  # the end of the last whole chunk read
        self._chunk_start = self.data_start  # where the chunk last yielded by chunks() starts

    @classmethod
    def open(cls, path: Path) -> RecordingReader:
        try:
            file = open(path, "rb")  # noqa: SIM115 - owned by the reader, closed by close()
        except OSError as error:
            raise RecordingError(f"cannot read {path}: {error.strerror}") from None
        try:
            return cls(file, path)
        except BaseException:
            file.close()
            raise

    def __enter__(self) -> RecordingReader:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        self._file.close()

    def _read_header(self) -> service_pb2.RecordingHeader:
        start = self._file.read(len(MAGIC) + _PREAMBLE.size)
        if not start.startswith(MAGIC):
            raise RecordingError(f"{self.path} is not a kvtrace recording (it starts with {start[:12]!r}); "
                                 "record one with `kvtrace record -o FILE` or `kvtrace agent --record FILE`")
        if len(start) < len(MAGIC) + _PREAMBLE.size:
            raise RecordingError(f"{self.path} is cut short inside its header ({len(start)} bytes): "
                                 "nothing to read")
        version, header_length = _PREAMBLE.unpack_from(start, len(MAGIC))
        if version > FORMAT_VERSION:
            raise RecordingError(f"{self.path} is in recording format {version}, newer than this kvtrace "
                                 f"({__version__}) reads (format {FORMAT_VERSION}): upgrade kvtrace to read it")
        if version < 1 or header_length > MAX_HEADER_BYTES:
            raise RecordingError(f"{self.path} has a damaged header (format {version}, header of "
                                 f"{header_length} bytes): not readable")
        encoded = self._file.read(header_length)
        if len(encoded) < header_length:
            raise RecordingError(f"{self.path} is cut short inside its header: nothing to read")
        header = service_pb2.RecordingHeader()
        try:
            header.ParseFromString(encoded)
        except DecodeError:
            raise RecordingError(f"{self.path} has a damaged header: not readable") from None
        self._check_header(header)
        return header

    def _check_header(self, header: service_pb2.RecordingHeader) -> None:
        """Refuses values no kvtrace writes, which reports would otherwise turn into nonsense or errors
        (a NaN age, a time past what a datetime holds). Text fields are printed escaped elsewhere."""
        seconds = {"leak_min_age_seconds": header.leak_min_age_seconds,
                   "trigger.window_seconds": header.trigger.window_seconds}
        for name, value in seconds.items():
            if not (math.isfinite(value) and 0.0 <= value <= MAX_HEADER_SECONDS):
                self._refuse_header(name, repr(value), f"0 to {MAX_HEADER_SECONDS:.0f} seconds")
        times_ns = {"start_time_ns": header.start_time_ns, "agent_start_time_ns": header.agent_start_time_ns,
                    "trigger.timestamp_ns": header.trigger.timestamp_ns}
        for name, value_ns in times_ns.items():
            if value_ns >= MAX_HEADER_TIME_NS:
                self._refuse_header(name, str(value_ns), f"below {MAX_HEADER_TIME_NS}, the year 2116")

    def _refuse_header(self, name: str, value: str, expected: str) -> NoReturn:
        raise RecordingError(f"{self.path} is damaged or was not written by kvtrace: its header's {name} is "
                             f"{value} (expected {expected}); not readable")

    def chunks(self) -> Iterator[bytes]:
        """Each whole chunk's frames, decompressed; stops at the end or at damage."""
        while True:
            start = self.position
            head = self._file.read(_CHUNK.size)
            if not head:
                return
            if len(head) < _CHUNK.size:
                self._damaged(start, "cut short in a chunk's header")
                return
            length, crc = _CHUNK.unpack(head)
            if length > MAX_CHUNK_BYTES:
                self._damaged(start, f"a chunk claims {length} bytes, more than the {MAX_CHUNK_BYTES} a chunk may hold")
                return
            compressed = self._file.read(length)
            if len(compressed) < length:
                self._damaged(start, f"cut short: the last chunk has {len(compressed)} of its {length} bytes "
                                     "(the writer stopped while writing it)")
                return
            if zlib.crc32(compressed) != crc:
                self._damaged(start, "a chunk fails its checksum")
                return
            try:
                data = _inflate(compressed)
            except _Damage as damage:
                self._damaged(start, str(damage))
                return
            del compressed  # one chunk in memory at a time
            self.position = start + _CHUNK.size + length
            self._chunk_start = start
            yield data

    def frames(self) -> Iterator[service_pb2.RecordingFrame]:
        """Every frame in order, up to the end or the first damage (a bad frame is told by its chunk's
        start and its index in the chunk, from 0)."""
        for data in self.chunks():
            start = self._chunk_start
            offset = 0
            index = 0
            while offset < len(data):
                left = len(data) - offset
                if left < _FRAME.size:
                    self._damaged(start, f"the chunk there ends inside the length of its frame {index}")
                    return
                (length,) = _FRAME.unpack_from(data, offset)
                if length == 0:  # an empty RecordingFrame: a newer writer's empty record, unknown here
                    zeros = _ZEROS.match(data, offset)  # this frame's 4 zero bytes and any that follow
                    run = max(1, ((zeros.end() if zeros else 0) - offset) // _FRAME.size)  # always progresses
                    self.unknown_frames += run
                    index += run
                    offset += run * _FRAME.size
                    continue
                offset += _FRAME.size
                if length > left - _FRAME.size:
                    self._damaged(start, f"frame {index} of the chunk there claims {length} bytes, past the "
                                         f"chunk's end ({left - _FRAME.size} bytes left)")
                    return
                frame = service_pb2.RecordingFrame()
                try:
                    frame.ParseFromString(data[offset:offset + length])
                except DecodeError:
                    self._damaged(start, f"frame {index} of the chunk there does not decode")
                    return
                offset += length
                index += 1
                if frame.WhichOneof("record") is None:
                    self.unknown_frames += 1
                    continue
                yield frame

    def _damaged(self, offset: int, what: str) -> None:
        self.damage = f"{self.path} is damaged at byte {offset}: {what}; read up to there"
