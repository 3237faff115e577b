"""model <-> kvtrace.v1 <-> JSON: every conversion, in one package, for the server, the client, the
CLI and recordings.

The wire enums carry the model enums' numbers (a unit test keeps them equal), so converting is a
number copy. JSON objects are what `kvtrace agent --json-events`, `kvtrace tail --json` and the
other `--json` outputs print; they are built from the model, so the agent and the client print
the same object for the same event.

Which module holds what (imports flow down this list, never up; tests/unit/test_import_layers.py):

    json        the JSON forms of events, stacks, depths, snapshots, processes, leaks and vLLM engines
    recordings  a recording's NVML rounds and processes (the frame codec is kvtrace.reports.recorder's)
    agent       agent info and health, processes, snapshot entries, leak suspects, growth, cross-check
    vllm        vLLM engines and findings, and the role breakdown growth rows share
    columns     batches of events as EventColumns and FixedEventColumns (the stream's hot path)
    events      one event as an Event message, stack definitions, loss notices
    depth       a process's tracing depth
    common      enums as numbers and back, optional fields, stack status names

Every public name is re-exported here: `from kvtrace import wire; wire.event_to_proto(...)` and
`from kvtrace.wire import event_to_proto` work as they did when this was one module.
"""
from __future__ import annotations

from kvtrace.wire.agent import (
    add_processes,
    batches_to_columns,
    columns_from_snapshot,
    cross_checks_to_proto,
    gpu_to_proto,
    growth_to_proto,
    info_to_proto,
    leak_report_to_proto,
    outstanding_from_proto,
    outstanding_to_columns,
    outstanding_to_proto,
    process_growth_to_proto,
    process_to_proto,
    suspect_to_proto,
)
from kvtrace.wire.columns import (
    FixedColumnsBatch,
    columns_event_count,
    event_messages_from_columns,
    events_from_columns,
    events_from_fixed_columns,
    events_to_columns,
    runs_to_fixed_columns,
)
from kvtrace.wire.common import (
    optional_field,
    wire_number,
    wire_numbers,
)
from kvtrace.wire.depth import (
    depth_from_proto,
    depth_to_proto,
    depths_by_pid,
    depths_to_proto,
)
from kvtrace.wire.events import (
    event_from_proto,
    event_to_proto,
    lost_to_proto,
    stack_from_proto,
    stack_message,
    stack_to_proto,
)
from kvtrace.wire.json import (
    depth_message_to_json,
    depth_to_json,
    event_to_json,
    frame_to_json,
    kv_request_to_json,
    leak_report_to_json_dict,
    message_to_json,
    native_frame_to_json,
    outstanding_json_line,
    outstanding_to_json_dict,
    process_to_json_dict,
    role_bytes_to_json,
    vllm_engine_to_json,
    vllm_engines_to_json_dict,
    vllm_finding_to_json,
    wire_enum_name,
)
from kvtrace.wire.recordings import (
    nvml_from_proto,
    nvml_to_proto,
    recorded_process_from_proto,
    recorded_process_to_proto,
)
from kvtrace.wire.vllm import (
    engine_matches,
    kv_request_from_proto,
    kv_request_to_proto,
    role_bytes_from_proto,
    role_bytes_to_proto,
    untrusted_sender_from_proto,
    untrusted_sender_to_proto,
    vllm_engine_from_proto,
    vllm_engine_to_proto,
    vllm_engines_to_proto,
    vllm_finding_from_proto,
    vllm_finding_to_proto,
)

__all__ = [
    "FixedColumnsBatch",
    "add_processes",
    "batches_to_columns",
    "columns_event_count",
    "columns_from_snapshot",
    "cross_checks_to_proto",
    "depth_from_proto",
    "depth_message_to_json",
    "depth_to_json",
    "depth_to_proto",
    "depths_by_pid",
    "depths_to_proto",
    "engine_matches",
    "event_from_proto",
    "event_messages_from_columns",
    "event_to_json",
    "event_to_proto",
    "events_from_columns",
    "events_from_fixed_columns",
    "events_to_columns",
    "frame_to_json",
    "gpu_to_proto",
    "growth_to_proto",
    "info_to_proto",
    "kv_request_from_proto",
    "kv_request_to_json",
    "kv_request_to_proto",
    "leak_report_to_json_dict",
    "leak_report_to_proto",
    "lost_to_proto",
    "message_to_json",
    "native_frame_to_json",
    "nvml_from_proto",
    "nvml_to_proto",
    "optional_field",
    "outstanding_from_proto",
    "outstanding_json_line",
    "outstanding_to_json_dict",
    "outstanding_to_columns",
    "outstanding_to_proto",
    "process_growth_to_proto",
    "process_to_json_dict",
    "process_to_proto",
    "recorded_process_from_proto",
    "recorded_process_to_proto",
    "role_bytes_from_proto",
    "role_bytes_to_json",
    "role_bytes_to_proto",
    "runs_to_fixed_columns",
    "stack_from_proto",
    "stack_message",
    "stack_to_proto",
    "suspect_to_proto",
    "untrusted_sender_from_proto",
    "untrusted_sender_to_proto",
    "vllm_engine_from_proto",
    "vllm_engine_to_json",
    "vllm_engine_to_proto",
    "vllm_engines_to_json_dict",
    "vllm_engines_to_proto",
    "vllm_finding_from_proto",
    "vllm_finding_to_json",
    "vllm_finding_to_proto",
    "wire_enum_name",
    "wire_number",
    "wire_numbers",
]
