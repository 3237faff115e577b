"""A recording from anywhere: a hostile or damaged file is refused at its header or read up to the damage,
which `damage` places (a chunk's start; a frame's index in its chunk), and never costs more than a
chunk's cap of memory or a crash."""
import io
import math
import struct
import time
import tracemalloc
import zlib
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvtrace._proto.kvtrace.v1 import agent_service_pb2 as service_pb2
from kvtrace._proto.kvtrace.v1 import events_pb2
from kvtrace.reports import recording
from kvtrace.reports.recording import (
    FORMAT_VERSION,
    MAGIC,
    MAX_CHUNK_BYTES,
    MAX_CHUNK_FRAMES_BYTES,
    RecordingError,
    RecordingReader,
    RecordingWriter,
)

YEAR_SECONDS = 365 * 24 * 3600
# The project's fuzz profile ("kvtrace-ci", tests/unit/test_fuzz.py): fixed examples, bounded time.
FUZZ = settings(max_examples=50, deadline=timedelta(milliseconds=500), derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])


def header(**fields) -> service_pb2.RecordingHeader:
    return service_pb2.RecordingHeader(**{"agent_version": "test", "host": "h", "start_time_ns": 1, **fields})


def frame(timestamp_ns: int, title: str = "") -> service_pb2.RecordingFrame:
    return service_pb2.RecordingFrame(event=events_pb2.Event(timestamp_ns=timestamp_ns, pid=7, title=title))


def framed(*frames: service_pb2.RecordingFrame) -> bytes:
    """Frames as a chunk holds them, before compression."""
    return b"".join(struct.pack("<I", len(encoded)) + encoded
                    for encoded in (each.SerializeToString() for each in frames))


def chunk(compressed: bytes) -> bytes:
    """A chunk with a correct checksum around any bytes."""
    return struct.pack("<II", len(compressed), zlib.crc32(compressed)) + compressed


def good_file(path: Path, *timestamps_ns: int) -> int:
    """A recording whose first chunk holds frames at `timestamps_ns`; its size in bytes."""
    writer = RecordingWriter.create(path, header())
    for timestamp_ns in timestamps_ns:
        writer.write(frame(timestamp_ns))
    writer.close()
    return path.stat().st_size


def append(path: Path, data: bytes) -> None:
    with path.open("ab") as file:
        file.write(data)


def read(path: Path) -> tuple[list[int], RecordingReader]:
    with RecordingReader.open(path) as reader:
        return [each.event.timestamp_ns for each in reader.frames()], reader


def damaged(path: Path, offset: int, what: str) -> str:
    return f"{path} is damaged at byte {offset}: {what}; read up to there"


# ---- chunks ----

def test_a_decompression_bomb_is_damage_without_inflating_it_and_the_frames_before_it_are_read(tmp_path):
    path = tmp_path / "bomb.kvtrace"
    whole = good_file(path, 1, 2, 3)
    append(path, chunk(zlib.compress(b"\0" * (MAX_CHUNK_FRAMES_BYTES + 1), 9)))
    assert path.stat().st_size - whole < 100_000  # a small file: the bomb is in the inflating
    tracemalloc.start()
    try:
        began = time.monotonic()
        timestamps, reader = read(path)
        elapsed = time.monotonic() - began
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert timestamps == [1, 2, 3]
    assert reader.damage == damaged(path, whole, f"a chunk inflates to more than {MAX_CHUNK_FRAMES_BYTES} "
                                                 "bytes, more than any kvtrace writes in one")
    assert peak < 1.5 * MAX_CHUNK_FRAMES_BYTES  # one cap of it at most, not the inflated whole nor twice
    assert elapsed < 10


def test_a_chunk_of_exactly_the_cap_is_read_and_one_byte_over_it_is_damage(tmp_path, monkeypatch):
    path = tmp_path / "cap.kvtrace"
    whole = good_file(path, 1)
    frames = framed(frame(2, title="x" * 300), frame(3))
    append(path, chunk(zlib.compress(frames)))
    # Small pieces: the inflating loop runs many times, over the cap's boundary.
    monkeypatch.setattr(recording, "_INFLATE_INPUT_BYTES", 7)
    monkeypatch.setattr(recording, "_INFLATE_OUTPUT_BYTES", 5)
    monkeypatch.setattr(recording, "MAX_CHUNK_FRAMES_BYTES", len(frames))
    timestamps, reader = read(path)
    assert (timestamps, reader.damage) == ([1, 2, 3], None)
    monkeypatch.setattr(recording, "MAX_CHUNK_FRAMES_BYTES", len(frames) - 1)
    timestamps, reader = read(path)
    assert timestamps == [1]
    assert reader.damage == damaged(path, whole, f"a chunk inflates to more than {len(frames) - 1} bytes, "
                                                 "more than any kvtrace writes in one")


def test_a_zlib_stream_that_does_not_end_in_its_chunk_is_damage(tmp_path):
    path = tmp_path / "open.kvtrace"
    whole = good_file(path, 1)
    append(path, chunk(zlib.compress(framed(frame(2)))[:-5]))  # a correct checksum over a cut stream
    timestamps, reader = read(path)
    assert timestamps == [1]
    assert reader.damage == damaged(path, whole, "a chunk's zlib stream does not end within the chunk")


def test_bytes_after_a_chunks_zlib_stream_are_damage(tmp_path):
    path = tmp_path / "after.kvtrace"
    whole = good_file(path, 1)
    append(path, chunk(zlib.compress(framed(frame(2))) + b"xyz"))
    timestamps, reader = read(path)
    assert timestamps == [1]
    assert reader.damage == damaged(path, whole, "a chunk has 3 bytes after its zlib stream")


def test_a_chunk_that_is_not_zlib_is_damage(tmp_path):
    path = tmp_path / "notzlib.kvtrace"
    whole = good_file(path, 1)
    append(path, chunk(b"not zlib at all"))
    timestamps, reader = read(path)
    assert timestamps == [1]
    assert reader.damage == damaged(path, whole, "a chunk does not decompress "
                                                 "(Error -3 while decompressing data: incorrect header check)")


def test_a_chunk_claiming_more_than_max_chunk_bytes_is_damage_without_reading_it(tmp_path):
    path = tmp_path / "huge.kvtrace"
    whole = good_file(path, 1)
    append(path, struct.pack("<II", MAX_CHUNK_BYTES + 1, 0) + b"x" * 100)
    timestamps, reader = read(path)
    assert timestamps == [1]
    assert reader.damage == damaged(path, whole, f"a chunk claims {MAX_CHUNK_BYTES + 1} bytes, more than "
                                                 f"the {MAX_CHUNK_BYTES} a chunk may hold")


# ---- frames ----

def test_a_frame_running_past_its_chunk_is_damage_at_the_chunks_start_and_its_index(tmp_path):
    path = tmp_path / "long.kvtrace"
    first = good_file(path, 1)
    second = frame(3).SerializeToString()
    append(path, chunk(zlib.compress(framed(frame(2)) + struct.pack("<I", len(second) + 10) + second)))
    timestamps, reader = read(path)
    assert timestamps == [1, 2]
    assert reader.damage == damaged(path, first, f"frame 1 of the chunk there claims {len(second) + 10} "
                                                 f"bytes, past the chunk's end ({len(second)} bytes left)")


def test_a_frame_that_does_not_decode_is_named_by_its_index(tmp_path):
    path = tmp_path / "undecodable.kvtrace"
    first = good_file(path, 1)
    append(path, chunk(zlib.compress(framed(frame(2), frame(3)) + struct.pack("<I", 3) + b"\xff\xff\xff")))
    timestamps, reader = read(path)
    assert timestamps == [1, 2, 3]
    assert reader.damage == damaged(path, first, "frame 2 of the chunk there does not decode")


def test_a_chunk_ending_inside_a_frames_length_is_damage(tmp_path):
    path = tmp_path / "short.kvtrace"
    first = good_file(path, 1)
    append(path, chunk(zlib.compress(framed(frame(2)) + b"\x01\x00")))
    timestamps, reader = read(path)
    assert timestamps == [1, 2]
    assert reader.damage == damaged(path, first, "the chunk there ends inside the length of its frame 1")


def test_empty_frames_are_unknown_records_counted_in_one_step(tmp_path):
    path = tmp_path / "empty.kvtrace"
    good_file(path, 1)
    padded = frame(3, title="p" * 246)
    assert len(padded.SerializeToString()) == 256  # its length starts with a zero byte: not an empty frame
    append(path, chunk(zlib.compress(b"\0" * 4 * 23 + framed(frame(2)) + b"\0" * 4 + framed(padded))))
    many = 4 << 20  # empty frames filling 16 MiB: counted at C speed, not parsed one by one
    append(path, chunk(zlib.compress(b"\0" * 4 * many)))
    began = time.monotonic()
    timestamps, reader = read(path)
    assert time.monotonic() - began < 3
    assert (timestamps, reader.damage) == ([1, 2, 3], None)
    assert reader.unknown_frames == 23 + 1 + many


# ---- the header ----

@pytest.mark.parametrize(("fields", "said"), [
    ({"leak_min_age_seconds": math.nan}, f"leak_min_age_seconds is nan (expected 0 to {YEAR_SECONDS} seconds)"),
    ({"leak_min_age_seconds": -1.0}, "leak_min_age_seconds is -1.0 (expected 0 to"),
    ({"leak_min_age_seconds": math.inf}, "leak_min_age_seconds is inf (expected"),
    ({"leak_min_age_seconds": 1e300}, "leak_min_age_seconds is 1e+300 (expected"),
    ({"leak_min_age_seconds": YEAR_SECONDS + 1.0}, f"leak_min_age_seconds is {YEAR_SECONDS + 1.0} (expected"),
    ({"start_time_ns": 2**63 - 1}, f"start_time_ns is {2**63 - 1} (expected below {2**62}, the year 2116)"),
    ({"start_time_ns": 2**62}, f"start_time_ns is {2**62} (expected below"),
    ({"agent_start_time_ns": 2**64 - 1}, f"agent_start_time_ns is {2**64 - 1} (expected below"),
    ({"trigger": service_pb2.FlightTrigger(timestamp_ns=2**62)}, f"trigger.timestamp_ns is {2**62} (expected"),
    ({"trigger": service_pb2.FlightTrigger(window_seconds=math.nan)}, "trigger.window_seconds is nan (expected"),
])
def test_a_header_no_kvtrace_writes_is_refused(tmp_path, fields, said):
    path = tmp_path / "header.kvtrace"
    RecordingWriter.create(path, header(**fields)).close()
    with pytest.raises(RecordingError) as refused:
        RecordingReader.open(path)
    assert str(refused.value).startswith(f"{path} is damaged or was not written by kvtrace: its header's {said}")
    assert str(refused.value).endswith("; not readable")


@pytest.mark.parametrize("fields", [
    {"agent_start_time_ns": 0, "leak_min_age_seconds": 0.0},
    {"start_time_ns": 2**62 - 1, "agent_start_time_ns": 2**62 - 1, "leak_min_age_seconds": float(YEAR_SECONDS)},
    {"trigger": service_pb2.FlightTrigger(timestamp_ns=2**62 - 1, window_seconds=120.0, reason="\x1b[2J")},
])
def test_a_header_at_the_limits_is_read(tmp_path, fields):
    path = tmp_path / "limits.kvtrace"
    RecordingWriter.create(path, header(**fields)).close()
    with RecordingReader.open(path) as reader:
        assert reader.header == header(**fields)


# ---- anything at all ----

def _first_chunk() -> bytes:
    """A whole recording of frames 1..3 in one chunk."""
    encoded = header().SerializeToString()
    return (MAGIC + struct.pack("<HI", FORMAT_VERSION, len(encoded)) + encoded
            + chunk(zlib.compress(framed(frame(1), frame(2), frame(3)))))


FIRST = _first_chunk()


@FUZZ
@given(st.binary(max_size=512))
@example(struct.pack("<II", 0xFFFFFFFF, 0))
@example(chunk(zlib.compress(b"\0" * 4096)))
@example(chunk(zlib.compress(b"\xff\xff\xff\xff")))
@example(chunk(zlib.compress(struct.pack("<I", 0xFFFFFFFF) + b"\x08")))
def test_garbage_after_a_good_chunk_never_crashes_the_reader(garbage):
    reader = RecordingReader(io.BytesIO(FIRST + garbage), Path("garbage.kvtrace"))
    frames = list(reader.frames())
    assert [each.event.timestamp_ns for each in frames[:3]] == [1, 2, 3]
    assert reader.damage is None or reader.damage.startswith("garbage.kvtrace is damaged at byte ")


@FUZZ
@given(st.binary(max_size=512))
@example(struct.pack("<HI", FORMAT_VERSION, 3) + b"\x31\xff\xff")
@example(struct.pack("<HI", FORMAT_VERSION, 9) + b"\x31" + struct.pack("<d", math.nan))
def test_garbage_after_the_magic_is_refused_or_read_never_crashes(garbage):
    try:
        reader = RecordingReader(io.BytesIO(MAGIC + garbage), Path("garbage.kvtrace"))
    except RecordingError as error:
        assert str(error).startswith("garbage.kvtrace ")
        return
    for _ in reader.frames():
        pass
    assert reader.damage is None or reader.damage.startswith("garbage.kvtrace is damaged at byte ")
