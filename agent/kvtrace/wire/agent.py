"""What the agent answers about itself and its processes, as kvtrace.v1's responses: agent info and
health, processes and their totals, snapshot entries (outstanding allocations), leak suspects,
growth, the CUPTI cross-check.

The request/response side of the API, apart from the event stream (kvtrace.wire.events,
kvtrace.wire.columns) and vLLM's (kvtrace.wire.vllm).
"""
from __future__ import annotations

import operator
from collections.abc import Collection, Iterable, Mapping, Sequence

from kvtrace._proto.kvtrace.v1 import agent_service_pb2 as service_pb2
from kvtrace._proto.kvtrace.v1 import events_pb2
from kvtrace.model.agent import AgentInfo, TrackedProcess
from kvtrace.model.crosscheck import ProcessCrossCheck, Side
from kvtrace.model.depth import ProcessDepth
from kvtrace.model.events import Api, Layer, Memory, ObjectKind
from kvtrace.model.findings import AnalysisSnapshot, GpuMemory, LeakReport, LeakSuspect, ProcessGpu
from kvtrace.model.ledger import ENTRY_ROW_FIELDS, EntryColumns, LedgerKey, Outstanding, RowBatch, entry_row
from kvtrace.model.processes import ProcessInfo, valid_text
from kvtrace.wire.common import saturated_s64, saturated_u64, wire_number
from kvtrace.wire.depth import depth_to_proto, depths_to_proto
from kvtrace.wire.events import stack_message
from kvtrace.wire.vllm import role_bytes_to_proto


def info_to_proto(info: AgentInfo) -> service_pb2.GetAgentInfoResponse:
    return service_pb2.GetAgentInfoResponse(
        version=info.version, kernel_release=info.kernel_release,
        attached_libraries=[service_pb2.AttachedLibrary(
            path=valid_text(library.path), file_device=library.device, inode=library.inode,
            symbols=sorted(library.symbols), pids=sorted(library.pids)) for library in info.libraries],
        components=[service_pb2.ComponentHealth(name=valid_text(c.name), up=c.up, reason=valid_text(c.reason))
                    for c in info.components],
        counters={name: saturated_u64(value) for name, value in info.counters.items()})


def process_to_proto(process: TrackedProcess, depth: ProcessDepth | None = None) -> service_pb2.Process:
    message = service_pb2.Process(
        pid=process.pid, title=process.title, comm=process.comm, container=process.container,
        totals=[service_pb2.OutstandingTotal(device=t.device, layer=wire_number(t.layer), memory=wire_number(t.memory),
                                             size_bytes=saturated_u64(t.size_bytes),
                                             object_count=saturated_u64(t.object_count))
                for t in process.totals])
    if depth is not None:
        message.depth.CopyFrom(depth_to_proto(depth))
    return message


def outstanding_to_proto(entry: Outstanding, process: ProcessInfo | None) -> service_pb2.OutstandingAllocation:
    key = entry.key
    return service_pb2.OutstandingAllocation(
        pid=key.pid, tid=entry.tid, comm=process.comm if process else "",
        title=process.title if process else "", container=process.container if process else "",
        layer=wire_number(key.layer), object=wire_number(key.object), memory=wire_number(entry.memory),
        api=wire_number(entry.api),
        api_name=entry.api.name, size_bytes=entry.size_bytes, address=key.address,
        device=entry.device, timestamp_ns=entry.timestamp_ns, caller_address=entry.caller_address,
        stack_id=entry.stack_id, mapped_count=entry.mapped_count, released=entry.released,
        handle=entry.handle, stream=entry.stream, sample_bytes=entry.sample_bytes,
        sampled=entry.sampled and entry.sample_bytes != 0)


def outstanding_from_proto(entry: service_pb2.OutstandingAllocation) -> Outstanding:
    """The model entry of a snapshot's wire entry (raises ValueError for an enum this client does
    not know: a newer agent). A memory-viz export reads a million of these: enums by table, fields
    positional, in Outstanding's order."""
    try:
        key = LedgerKey(entry.pid, _LAYERS[entry.layer], _OBJECTS[entry.object], entry.address)
        api, memory = _APIS[entry.api], _MEMORIES[entry.memory]
    except KeyError as unknown:
        raise ValueError(f"an enum value this client does not know: {unknown}") from None
    sample_bytes = entry.sample_bytes
    return Outstanding(key, entry.size_bytes, entry.timestamp_ns, entry.device, api, memory, entry.tid,
                       entry.caller_address, entry.mapped_count, entry.released, entry.handle, entry.stack_id,
                       entry.stream, sample_bytes, entry.sampled and sample_bytes != 0)


_LAYERS = {int(member): member for member in Layer}
_OBJECTS = {int(member): member for member in ObjectKind}
_APIS = {int(member): member for member in Api}
_MEMORIES = {int(member): member for member in Memory}


# OutstandingColumns' number columns in its field order: a row's fields (model.ledger.entry_row), in order.
_COLUMN_NAMES = tuple(name.rpartition(".")[2] for name in ENTRY_ROW_FIELDS)
_PID, _STACK_ID, _SAMPLE_BYTES = (_COLUMN_NAMES.index(name) for name in ("pid", "stack_id", "sample_bytes"))


def outstanding_to_columns(entries: Sequence[Outstanding], processes: Mapping[int, ProcessInfo | None],
                           message: service_pb2.OutstandingColumns) -> None:
    """A snapshot page's entries into `message` (SNAPSHOT_ENCODING_COLUMNS): one C call per entry to read its
    fields, then batches_to_columns. `processes`: the known ones of the page's pids (None: no longer readable,
    no label)."""
    batches_to_columns([RowBatch.of_rows(map(entry_row, entries))], message)
    add_processes(processes, message)


def batches_to_columns(batches: Sequence[RowBatch],
                       message: service_pb2.OutstandingColumns) -> tuple[set[int], set[int]]:
    """A snapshot page's entries, batches of rows in columns (model.ledger.RowBatch), into `message`'s columns: a
    packed extend per column and batch; a column that is all defaults stays empty. The page's pids and stack ids
    (0: none)."""
    pids: set[int] = set()
    stack_ids: set[int] = set()
    for index, name in enumerate(_COLUMN_NAMES):
        columns = [batch.columns[index] for batch in batches]
        if name == "sampled" and any(map(any, columns)):  # meant only with a sampling mean (outstanding_to_proto)
            columns = [list(map(bool, map(operator.and_, map(bool, column), map(bool, batch.columns[_SAMPLE_BYTES]))))
                       for column, batch in zip(columns, batches, strict=True)]
        if name == "pid" or any(map(any, columns)):
            field = getattr(message, name)
            for column in columns:
                field.extend(column)
    for batch in batches:
        pids.update(batch.columns[_PID])
        stack_ids.update(batch.columns[_STACK_ID])
    return pids, stack_ids


def add_processes(processes: Mapping[int, ProcessInfo | None], message: service_pb2.OutstandingColumns) -> None:
    """Each known process's labels, once (None: no longer readable, no label)."""
    add = message.processes.add
    for pid, process in processes.items():
        if process is not None:
            add(pid=pid, comm=process.comm, title=process.title, container=process.container)


def columns_from_snapshot(response: service_pb2.GetSnapshotResponse,
                          fields: Collection[str] | None = None) -> EntryColumns:
    """A snapshot page's entries in columns, whichever way it carried them: `columns`, or `allocations` (an agent
    older than SNAPSHOT_ENCODING_COLUMNS, which sends those whatever was asked). ValueError for columns of
    different lengths. `fields`: the EntryColumns a reader uses (None: all); the others are left empty (a
    million entries' columns cost what their numbers do)."""
    names = _COLUMN_NAMES if fields is None else [name for name in _COLUMN_NAMES if name in fields]
    if len(response.allocations):
        rows = response.allocations
        labels: dict[int, tuple[str, str, str]] = {}
        for row in rows:
            labels.setdefault(row.pid, (row.comm, row.title, row.container))
        lists = {name: [getattr(row, name) for row in rows] for name in names}
    else:
        columns = response.columns
        count = len(columns.pid)
        lists = {}
        for name in _COLUMN_NAMES:
            values = getattr(columns, name)
            if len(values) not in (0, count):
                raise ValueError(f"OutstandingColumns.{name} has {len(values)} entries for {count} objects")
            if name in names:
                lists[name] = list(values) if len(values) else [False if name in ("released", "sampled") else 0] * count
        labels = {label.pid: (label.comm, label.title, label.container) for label in columns.processes}
    return EntryColumns._make([*(lists.get(name, []) for name in _COLUMN_NAMES), labels])


def suspect_to_proto(suspect: LeakSuspect) -> service_pb2.LeakSuspect:
    message = service_pb2.LeakSuspect(
        rank=suspect.rank, pid=suspect.pid, title=suspect.title, device=suspect.device,
        stack_id=suspect.stack_id, caller_address=suspect.native_caller_address,
        outstanding_bytes=saturated_u64(suspect.outstanding_bytes), allocation_count=saturated_u64(suspect.count),
        oldest_age_seconds=suspect.oldest_age_seconds, growth_bytes_per_second=suspect.growth_bytes_per_second,
        estimated=suspect.estimated)
    if suspect.stack is not None:
        message.stack.CopyFrom(stack_message(suspect.stack_id, suspect.stack))
    if suspect.native_caller is not None:
        caller = suspect.native_caller
        message.native_caller.CopyFrom(
            service_pb2.NativeFrame(module=valid_text(caller.module), symbol=valid_text(caller.symbol),
                                   offset=caller.offset))
    return message


def leak_report_to_proto(report: LeakReport, depths: dict[int, ProcessDepth] | None = None,
                         pids: Iterable[int] = ()) -> service_pb2.ListLeakSuspectsResponse:
    """The report, with the depth of each process that has a suspect or is among `pids` (the request's)."""
    return service_pb2.ListLeakSuspectsResponse(
        suspects=[suspect_to_proto(suspect) for suspect in report.suspects],
        suspect_count=report.suspect_count, allocations_considered=report.allocations_considered,
        suspect_allocations=report.suspect_allocations, min_age_seconds=report.min_age_seconds,
        timestamp_ns=report.timestamp_ns,
        depths=depths_to_proto(depths or {}, [*pids, *(suspect.pid for suspect in report.suspects)]))


def gpu_to_proto(gpu: GpuMemory) -> service_pb2.GpuMemory:
    return service_pb2.GpuMemory(index=gpu.index, uuid=gpu.uuid, name=gpu.name, total_bytes=gpu.total_bytes,
                                 used_bytes=gpu.used_bytes, free_bytes=gpu.free_bytes,
                                 reserved_bytes=gpu.reserved_bytes)


def process_growth_to_proto(row: ProcessGpu, depth: ProcessDepth | None = None) -> service_pb2.ProcessGrowth:
    message = service_pb2.ProcessGrowth(
        pid=row.pid, title=row.title, device=row.device, outstanding_bytes=saturated_u64(row.outstanding_bytes),
        growth_bytes_per_second_1m=row.growth_bytes_per_second_1m,
        growth_bytes_per_second_15m=row.growth_bytes_per_second_15m, history_seconds=row.history_seconds,
        allocations_1m=row.allocations_1m, frees_1m=row.frees_1m, predates_agent=row.predates_agent)
    if row.fragmentation is not None:
        row_fragmentation = row.fragmentation
        message.fragmentation.CopyFrom(service_pb2.Fragmentation(
            reserved_bytes=row_fragmentation.reserved_bytes, allocated_bytes=row_fragmentation.allocated_bytes,
            largest_free_bytes=row_fragmentation.largest_free_bytes, ratio=row_fragmentation.ratio,
            segments=row_fragmentation.segments, blocks=row_fragmentation.blocks,
            blocks_outside_segments=row_fragmentation.blocks_outside_segments))
    message.role_bytes.extend(role_bytes_to_proto(row.role_bytes))
    if depth is not None:
        message.depth.CopyFrom(depth_to_proto(depth))
    # None leaves an optional field unset: "not known" stays apart from 0.
    for name, value in (("nvml_index", row.nvml_index), ("nvml_used_bytes", row.nvml_used_bytes),
                        ("unattributed_bytes", None if row.unattributed_bytes is None
                         else saturated_s64(row.unattributed_bytes)),
                        ("time_to_oom_seconds", row.time_to_oom_seconds), ("free_ratio_1m", row.free_ratio_1m)):
        if value is not None:
            setattr(message, name, value)
    return message


def growth_to_proto(snapshot: AnalysisSnapshot | None, pids: frozenset[int],
                    depths: dict[int, ProcessDepth] | None = None) -> service_pb2.GetGrowthResponse:
    if snapshot is None:
        return service_pb2.GetGrowthResponse()
    depths = depths or {}
    return service_pb2.GetGrowthResponse(
        timestamp_ns=snapshot.timestamp_ns, nvml_timestamp_ns=snapshot.nvml_timestamp_ns,
        gpus=[gpu_to_proto(gpu) for gpu in snapshot.gpus],
        processes=[process_growth_to_proto(row, depths.get(row.pid)) for row in snapshot.processes
                   if not pids or row.pid in pids])


_SEEN_BY = {Side.UPROBE: events_pb2.EVENT_SOURCE_UPROBE, Side.CUPTI: events_pb2.EVENT_SOURCE_CUPTI, None: 0}


def cross_checks_to_proto(checks: Iterable[ProcessCrossCheck],
                          with_addresses: bool = True) -> service_pb2.GetCrossCheckResponse:
    """The CUPTI tracers and their agreement with the uprobes; `with_addresses` False (the group
    socket) leaves the disagreements' addresses out."""
    response = service_pb2.GetCrossCheckResponse()
    for check in checks:
        status = check.status
        message = response.processes.add(
            pid=check.pid, state=status.state, reason=status.reason, holder=status.holder,
            compared=check.compared, finished=check.finished, pending_count=check.pending)
        message.counters.update({name: value for name, value in status.counters.items() if value >= 0})
        for api, row in sorted(check.apis.items()):
            message.apis.add(api=wire_number(api), api_name=api.name, matched_count=row.matched,
                             uprobe_only_count=row.uprobe_only, cupti_only_count=row.cupti_only,
                             mismatched_count=row.mismatched)
        for example in check.examples:
            message.disagreements.add(
                seen_by=_SEEN_BY[example.side], api=wire_number(example.api), api_name=example.api.name,
                failed=example.failed, address=example.address if with_addresses else 0,
                size_bytes=example.size_bytes, device=example.device, timestamp_ns=example.timestamp_ns,
                detail=example.detail)
    return response
