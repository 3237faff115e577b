"""What `kvtrace run`'s in-process CUPTI tracer sends to whoever collects it (the agent, or `kvtrace run`
writing a recording), over a Unix stream socket. Standard library only: the tracer imports this inside the
traced process, whose Python environment is the user's.

A connection is a sequence of messages, each `<B type><I body length>` (little-endian) then the body:

    HELLO   JSON {"v": 1, "python": "3.12.3", "cupti": "13.0.1", "cuda_driver": 13000, "argv0": "..."}  (first)
    STATUS  JSON {"state": one of STATES, "reason": "...", "holder": "...", "counters": {name: int},
                  "now_ns": CUPTI's clock at sending, "stopped_ns": at exit, when the last records were taken}
    STACK   JSON {"id": 7, "frames": [[function, filename, line], ...], "truncated": false}  innermost first,
            sent before the first CALL that refers to it (ids are the process's own)
    CALLS   packed CALL_RECORDs: an API callback at the call's exit (allocations, VMM calls, failures)
    MEMORY  packed MEMORY_RECORDs: CUPTI_ACTIVITY_KIND_MEMORY2 (allocations and releases)
    POOLS   packed POOL_RECORDs: CUPTI_ACTIVITY_KIND_MEMORY_POOL
    LOST    JSON {"count": n, "what": "..."}: records the tracer could not deliver, where the gap is
    BLOCKS  JSON {"taken_ns": t, "since_ns": s, "recorder": "kvtrace"|"program", "blocks": [[device, address,
            requested_bytes, stack_id], ...]}: PyTorch's live blocks as its own recorder knew them at t (at the
            process's exit), each with the stack that allocated it (0: none recorded), the recorder on since
            s; a long list comes in several messages, at most MAX_BLOCKS blocks in all

The sender's pid comes from the kernel (SO_PEERCRED at accept), never from a message. Timestamps are
CUPTI's (nanoseconds, the wall clock on Linux). A CALL and the MEMORY record it made share a
`correlation_id`, which is how a release is told from an unmap and an allocation gets its stack.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass

VERSION = 1
SOCKET_ENV = "KVTRACE_CUPTI_SOCKET"  # where the tracer connects; set by `kvtrace run`
DEFAULT_AGENT_SOCKET = "/run/kvtrace-cupti/cupti.sock"  # the agent's, apart from its API sockets
MAX_BODY_BYTES = 1 << 20
HEADER = struct.Struct("<BI")

HELLO, STATUS, STACK, CALLS, MEMORY, POOLS, LOST, BLOCKS = 1, 2, 3, 4, 5, 6, 7, 8
JSON_TYPES = frozenset({HELLO, STATUS, STACK, LOST, BLOCKS})
TYPES = frozenset({HELLO, STATUS, STACK, CALLS, MEMORY, POOLS, LOST, BLOCKS})
BLOCKS_PER_MESSAGE = 16384  # [device, address, bytes, stack id] lists: far below MAX_BODY_BYTES
MAX_BLOCKS = 1 << 20  # blocks one process reports at most (the tracer counts the rest as blocks_left_out)
# BLOCKS' recorder, and what it is in words: PyTorch's, turned on by kvtrace at CUDA's start (live blocks' Python
# stacks only), or the program's own (it records its history itself: kvtrace reads it, never turns it off)
RECORDERS = {"kvtrace": "PyTorch's recorder, turned on by kvtrace run at CUDA's start",
             "program": "the program's own PyTorch recorder"}

# STATUS states: tracing (subscribed, records flow); held (another CUPTI subscriber holds the process:
# torch.profiler/Kineto, Nsight; `holder` names it); unavailable (no cupti-python for this CUDA, or it
# failed: `reason` says why and what to install); off (the user opted out).
STATES = ("tracing", "held", "unavailable", "off")

# api (kvtrace.model.events.Api value), result (CUresult), correlation_id, tid, stack_id, stack_status,
# device (-1 unknown), address (pointer or VA), size_bytes, handle (cuMemCreate/cuMemMap/cuMemRelease),
# timestamp_ns
CALL_RECORD = struct.Struct("<HiIIIBxxxiQQQQ")
# operation (1 allocation, 2 release), memory_kind (CUpti_ActivityMemoryKind), device, correlation_id,
# is_async, address, size_bytes, timestamp_ns
MEMORY_RECORD = struct.Struct("<BBxxiIIQQQ")
# operation (CUpti_ActivityMemoryPoolOperationType), pool_type, device, address, size_bytes,
# utilized_bytes, timestamp_ns
POOL_RECORD = struct.Struct("<BBxxiQQQQ")

MEMORY_ALLOCATION, MEMORY_RELEASE = 1, 2
# CUpti_ActivityMemoryKind values the ledger keeps (static module memory and the rest are no allocation)
MEMORY_KIND_PAGEABLE, MEMORY_KIND_PINNED, MEMORY_KIND_DEVICE, MEMORY_KIND_MANAGED = 1, 2, 3, 5


class ProtocolError(ValueError):
    """A message that is not this protocol's: the connection is closed."""


@dataclass(frozen=True, slots=True)
class Call:
    api: int
    result: int
    correlation_id: int
    tid: int
    stack_id: int
    stack_status: int
    device: int
    address: int
    size_bytes: int
    handle: int
    timestamp_ns: int


@dataclass(frozen=True, slots=True)
class MemoryRecord:
    operation: int
    memory_kind: int
    device: int
    correlation_id: int
    is_async: int
    address: int
    size_bytes: int
    timestamp_ns: int


@dataclass(frozen=True, slots=True)
class PoolRecord:
    operation: int
    pool_type: int
    device: int
    address: int
    size_bytes: int
    utilized_bytes: int
    timestamp_ns: int


def message(kind: int, body: bytes) -> bytes:
    if len(body) > MAX_BODY_BYTES:
        raise ProtocolError(f"message of {len(body)} bytes is over {MAX_BODY_BYTES}")
    return HEADER.pack(kind, len(body)) + body


def json_message(kind: int, value: dict) -> bytes:
    return message(kind, json.dumps(value, separators=(",", ":")).encode())


def packed_messages(kind: int, layout: struct.Struct, records: list[bytes]) -> list[bytes]:
    """Packed records (each `layout.size` bytes) as messages under the size limit."""
    per_message = MAX_BODY_BYTES // layout.size
    return [message(kind, b"".join(records[start:start + per_message]))
            for start in range(0, len(records), per_message)]


def unpack(layout: struct.Struct, body: bytes) -> list[tuple]:
    if len(body) % layout.size:
        raise ProtocolError(f"{len(body)} bytes is no whole number of {layout.size}-byte records")
    return list(layout.iter_unpack(body))


def decode_json(body: bytes) -> dict:
    try:
        value = json.loads(body)
    except (ValueError, RecursionError) as error:  # bad UTF-8 or JSON, huge integers, deep nesting
        raise ProtocolError(f"not JSON: {str(error)[:80]}") from None
    if not isinstance(value, dict):
        raise ProtocolError("a JSON message must be an object")
    return value


class Decoder:
    """Bytes in any pieces -> (type, body) messages; raises ProtocolError on a malformed stream."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        self._buffer += data
        messages = []
        offset = 0
        while len(self._buffer) - offset >= HEADER.size:
            kind, length = HEADER.unpack_from(self._buffer, offset)
            if kind not in TYPES:
                raise ProtocolError(f"unknown message type {kind}")
            if length > MAX_BODY_BYTES:
                raise ProtocolError(f"message of {length} bytes is over {MAX_BODY_BYTES}")
            end = offset + HEADER.size + length
            if end > len(self._buffer):
                break
            messages.append((kind, bytes(self._buffer[offset + HEADER.size:end])))
            offset = end
        del self._buffer[:offset]
        return messages

    @property
    def pending_bytes(self) -> int:
        return len(self._buffer)
