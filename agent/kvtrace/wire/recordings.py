"""The payloads of a recording's frames that are not events: NVML rounds and recorded processes, as
kvtrace.v1 messages and back.

Only the conversions: the frame codec is kvtrace.reports.recorder's and the file around the frames
kvtrace.reports.recording's. Apart from kvtrace.wire.agent because only recordings and their replay
use these shapes.
"""
from __future__ import annotations

from kvtrace._proto.kvtrace.v1 import agent_service_pb2 as service_pb2
from kvtrace.model.depth import ProcessDepth
from kvtrace.model.findings import GpuMemory
from kvtrace.model.gpus import NvmlProcessMemory, NvmlSample
from kvtrace.model.processes import ProcessInfo
from kvtrace.wire.agent import gpu_to_proto
from kvtrace.wire.common import optional_field
from kvtrace.wire.depth import depth_to_proto


def nvml_to_proto(sample: NvmlSample) -> service_pb2.NvmlRound:
    return service_pb2.NvmlRound(
        timestamp_ns=sample.timestamp_ns, gpus=[gpu_to_proto(gpu) for gpu in sample.gpus],
        processes=[service_pb2.NvmlProcessUsage(gpu_index=process.gpu_index, pid=process.pid,
                                                used_bytes=process.used_bytes)
                   for process in sample.processes])


def nvml_from_proto(message: service_pb2.NvmlRound) -> NvmlSample:
    return NvmlSample(
        timestamp_ns=message.timestamp_ns,
        gpus=tuple(GpuMemory(index=gpu.index, uuid=gpu.uuid, name=gpu.name, total_bytes=gpu.total_bytes,
                             used_bytes=gpu.used_bytes, free_bytes=gpu.free_bytes, reserved_bytes=gpu.reserved_bytes)
                   for gpu in message.gpus),
        processes=tuple(NvmlProcessMemory(gpu_index=process.gpu_index, pid=process.pid,
                                          used_bytes=optional_field(process, "used_bytes"))
                        for process in message.processes))


def recorded_process_to_proto(info: ProcessInfo, depth: ProcessDepth | None = None) -> service_pb2.RecordedProcess:
    message = service_pb2.RecordedProcess(pid=info.pid, title=info.title, comm=info.comm, container=info.container,
                                          start_time_ns=int(info.start_time * 1e9), parent_pid=info.parent_pid)
    if depth is not None:
        message.depth.CopyFrom(depth_to_proto(depth))
    return message


def recorded_process_from_proto(message: service_pb2.RecordedProcess) -> ProcessInfo:
    return ProcessInfo(pid=message.pid, title=message.title, comm=message.comm, container=message.container,
                       cgroup="", start_time=message.start_time_ns / 1e9, read_at=0.0, parent_pid=message.parent_pid)
