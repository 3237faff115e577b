"""A process's tracing depth (kvtrace.model.depth) as the wire's ProcessDepthState, and back.

Processes, leak reports, growth rows, vLLM engines and recordings all carry depths: one module
below them so that each reads it from here, not from one another.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvtrace._proto.kvtrace.v1 import agent_service_pb2 as service_pb2
from kvtrace.model.depth import Depth, DepthCause, ProcessDepth
from kvtrace.model.processes import valid_text
from kvtrace.wire.common import wire_number


def depth_to_proto(depth: ProcessDepth) -> service_pb2.ProcessDepthState:
    cause: Any = depth.cause.value  # DepthCause is a plain Enum of the wire's numbers
    return service_pb2.ProcessDepthState(
        pid=depth.pid, depth=wire_number(depth.depth), since_ns=depth.since_ns, cause=cause,
        detail=valid_text(depth.detail), until_ns=depth.until_ns, sample_bytes=depth.sample_bytes)


def depths_to_proto(depths: dict[int, ProcessDepth], pids: Iterable[int]) -> list[service_pb2.ProcessDepthState]:
    """The depths of `pids` the agent follows, by pid (each once)."""
    return [depth_to_proto(depths[pid]) for pid in sorted(set(pids)) if pid in depths]


def depth_from_proto(message: service_pb2.ProcessDepthState) -> ProcessDepth | None:
    """The model's depth; None when the message says none (an older agent) or one this client does not
    know (a newer agent's). A cause this client does not know is DEFAULT."""
    try:
        depth = Depth(message.depth)
    except ValueError:
        return None
    try:
        cause = DepthCause(message.cause)
    except ValueError:
        cause = DepthCause.DEFAULT
    return ProcessDepth(pid=message.pid, depth=depth, since_ns=message.since_ns, cause=cause, detail=message.detail,
                        until_ns=message.until_ns, sample_bytes=message.sample_bytes)


def depths_by_pid(messages: Iterable[service_pb2.ProcessDepthState]) -> dict[int, ProcessDepth]:
    """A response's depth list as pid -> the model's depth (those this client can read)."""
    depths = {}
    for message in messages:
        depth = depth_from_proto(message)
        if depth is not None:
            depths[depth.pid] = depth
    return depths
