from kvtrace._proto.kvtrace.v1 import events_pb2 as _events_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EventEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVENT_ENCODING_UNSPECIFIED: _ClassVar[EventEncoding]
    EVENT_ENCODING_MESSAGES: _ClassVar[EventEncoding]
    EVENT_ENCODING_COLUMNS: _ClassVar[EventEncoding]
    EVENT_ENCODING_FIXED_COLUMNS: _ClassVar[EventEncoding]

class View(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VIEW_UNSPECIFIED: _ClassVar[View]
    VIEW_FULL: _ClassVar[View]
    VIEW_REDACTED: _ClassVar[View]

class SnapshotEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SNAPSHOT_ENCODING_UNSPECIFIED: _ClassVar[SnapshotEncoding]
    SNAPSHOT_ENCODING_MESSAGES: _ClassVar[SnapshotEncoding]
    SNAPSHOT_ENCODING_COLUMNS: _ClassVar[SnapshotEncoding]

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_KV_CACHE: _ClassVar[Role]
    ROLE_WEIGHTS: _ClassVar[Role]
    ROLE_CUDA_GRAPH: _ClassVar[Role]
    ROLE_ACTIVATIONS: _ClassVar[Role]
    ROLE_OTHER: _ClassVar[Role]

class RequestState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REQUEST_STATE_UNSPECIFIED: _ClassVar[RequestState]
    REQUEST_STATE_WAITING: _ClassVar[RequestState]
    REQUEST_STATE_RUNNING: _ClassVar[RequestState]
    REQUEST_STATE_PREEMPTED: _ClassVar[RequestState]
    REQUEST_STATE_FINISHED: _ClassVar[RequestState]
    REQUEST_STATE_ABORTED: _ClassVar[RequestState]

class VllmFindingKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VLLM_FINDING_KIND_UNSPECIFIED: _ClassVar[VllmFindingKind]
    VLLM_FINDING_KIND_BLOCKS_HELD_AFTER_FINISH: _ClassVar[VllmFindingKind]
    VLLM_FINDING_KIND_STUCK_KV_USAGE: _ClassVar[VllmFindingKind]
    VLLM_FINDING_KIND_FREE_BLOCKS_FALLING: _ClassVar[VllmFindingKind]
    VLLM_FINDING_KIND_LOW_FREE_RATIO: _ClassVar[VllmFindingKind]
    VLLM_FINDING_KIND_IDLE_GROWTH: _ClassVar[VllmFindingKind]
    VLLM_FINDING_KIND_SLEEP_RESIDUE: _ClassVar[VllmFindingKind]

class FlightTriggerKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FLIGHT_TRIGGER_KIND_UNSPECIFIED: _ClassVar[FlightTriggerKind]
    FLIGHT_TRIGGER_KIND_OUT_OF_MEMORY: _ClassVar[FlightTriggerKind]
    FLIGHT_TRIGGER_KIND_PROCESS_DIED: _ClassVar[FlightTriggerKind]
    FLIGHT_TRIGGER_KIND_TIME_TO_OOM: _ClassVar[FlightTriggerKind]
    FLIGHT_TRIGGER_KIND_SIGNAL: _ClassVar[FlightTriggerKind]
    FLIGHT_TRIGGER_KIND_REQUEST: _ClassVar[FlightTriggerKind]

class ProcessDepth(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROCESS_DEPTH_UNSPECIFIED: _ClassVar[ProcessDepth]
    PROCESS_DEPTH_SEGMENTS: _ClassVar[ProcessDepth]
    PROCESS_DEPTH_BLOCKS: _ClassVar[ProcessDepth]
    PROCESS_DEPTH_FULL: _ClassVar[ProcessDepth]

class DepthCause(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DEPTH_CAUSE_UNSPECIFIED: _ClassVar[DepthCause]
    DEPTH_CAUSE_DEFAULT: _ClassVar[DepthCause]
    DEPTH_CAUSE_CONFIGURED: _ClassVar[DepthCause]
    DEPTH_CAUSE_GROWTH: _ClassVar[DepthCause]
    DEPTH_CAUSE_TIME_TO_OOM: _ClassVar[DepthCause]
    DEPTH_CAUSE_UNEXPLAINED: _ClassVar[DepthCause]
    DEPTH_CAUSE_VLLM: _ClassVar[DepthCause]
    DEPTH_CAUSE_OPERATOR: _ClassVar[DepthCause]
    DEPTH_CAUSE_NO_BLOCKS: _ClassVar[DepthCause]
EVENT_ENCODING_UNSPECIFIED: EventEncoding
EVENT_ENCODING_MESSAGES: EventEncoding
EVENT_ENCODING_COLUMNS: EventEncoding
EVENT_ENCODING_FIXED_COLUMNS: EventEncoding
VIEW_UNSPECIFIED: View
VIEW_FULL: View
VIEW_REDACTED: View
SNAPSHOT_ENCODING_UNSPECIFIED: SnapshotEncoding
SNAPSHOT_ENCODING_MESSAGES: SnapshotEncoding
SNAPSHOT_ENCODING_COLUMNS: SnapshotEncoding
ROLE_UNSPECIFIED: Role
ROLE_KV_CACHE: Role
ROLE_WEIGHTS: Role
ROLE_CUDA_GRAPH: Role
ROLE_ACTIVATIONS: Role
ROLE_OTHER: Role
REQUEST_STATE_UNSPECIFIED: RequestState
REQUEST_STATE_WAITING: RequestState
REQUEST_STATE_RUNNING: RequestState
REQUEST_STATE_PREEMPTED: RequestState
REQUEST_STATE_FINISHED: RequestState
REQUEST_STATE_ABORTED: RequestState
VLLM_FINDING_KIND_UNSPECIFIED: VllmFindingKind
VLLM_FINDING_KIND_BLOCKS_HELD_AFTER_FINISH: VllmFindingKind
VLLM_FINDING_KIND_STUCK_KV_USAGE: VllmFindingKind
VLLM_FINDING_KIND_FREE_BLOCKS_FALLING: VllmFindingKind
VLLM_FINDING_KIND_LOW_FREE_RATIO: VllmFindingKind
VLLM_FINDING_KIND_IDLE_GROWTH: VllmFindingKind
VLLM_FINDING_KIND_SLEEP_RESIDUE: VllmFindingKind
FLIGHT_TRIGGER_KIND_UNSPECIFIED: FlightTriggerKind
FLIGHT_TRIGGER_KIND_OUT_OF_MEMORY: FlightTriggerKind
FLIGHT_TRIGGER_KIND_PROCESS_DIED: FlightTriggerKind
FLIGHT_TRIGGER_KIND_TIME_TO_OOM: FlightTriggerKind
FLIGHT_TRIGGER_KIND_SIGNAL: FlightTriggerKind
FLIGHT_TRIGGER_KIND_REQUEST: FlightTriggerKind
PROCESS_DEPTH_UNSPECIFIED: ProcessDepth
PROCESS_DEPTH_SEGMENTS: ProcessDepth
PROCESS_DEPTH_BLOCKS: ProcessDepth
PROCESS_DEPTH_FULL: ProcessDepth
DEPTH_CAUSE_UNSPECIFIED: DepthCause
DEPTH_CAUSE_DEFAULT: DepthCause
DEPTH_CAUSE_CONFIGURED: DepthCause
DEPTH_CAUSE_GROWTH: DepthCause
DEPTH_CAUSE_TIME_TO_OOM: DepthCause
DEPTH_CAUSE_UNEXPLAINED: DepthCause
DEPTH_CAUSE_VLLM: DepthCause
DEPTH_CAUSE_OPERATOR: DepthCause
DEPTH_CAUSE_NO_BLOCKS: DepthCause

class StreamEventsRequest(_message.Message):
    __slots__ = ("pids", "title_regex", "kinds", "layers", "min_size_bytes", "encoding")
    PIDS_FIELD_NUMBER: _ClassVar[int]
    TITLE_REGEX_FIELD_NUMBER: _ClassVar[int]
    KINDS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    MIN_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    pids: _containers.RepeatedScalarFieldContainer[int]
    title_regex: str
    kinds: _containers.RepeatedScalarFieldContainer[_events_pb2.EventKind]
    layers: _containers.RepeatedScalarFieldContainer[_events_pb2.Layer]
    min_size_bytes: int
    encoding: EventEncoding
    def __init__(self, pids: _Optional[_Iterable[int]] = ..., title_regex: _Optional[str] = ..., kinds: _Optional[_Iterable[_Union[_events_pb2.EventKind, str]]] = ..., layers: _Optional[_Iterable[_Union[_events_pb2.Layer, str]]] = ..., min_size_bytes: _Optional[int] = ..., encoding: _Optional[_Union[EventEncoding, str]] = ...) -> None: ...

class StreamEventsResponse(_message.Message):
    __slots__ = ("events", "view", "columns", "fixed_columns")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    VIEW_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    FIXED_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[_events_pb2.Event]
    view: View
    columns: _events_pb2.EventColumns
    fixed_columns: _events_pb2.FixedEventColumns
    def __init__(self, events: _Optional[_Iterable[_Union[_events_pb2.Event, _Mapping]]] = ..., view: _Optional[_Union[View, str]] = ..., columns: _Optional[_Union[_events_pb2.EventColumns, _Mapping]] = ..., fixed_columns: _Optional[_Union[_events_pb2.FixedEventColumns, _Mapping]] = ...) -> None: ...

class GetSnapshotRequest(_message.Message):
    __slots__ = ("pids", "layers", "page_size", "page_token", "encoding")
    PIDS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    pids: _containers.RepeatedScalarFieldContainer[int]
    layers: _containers.RepeatedScalarFieldContainer[_events_pb2.Layer]
    page_size: int
    page_token: str
    encoding: SnapshotEncoding
    def __init__(self, pids: _Optional[_Iterable[int]] = ..., layers: _Optional[_Iterable[_Union[_events_pb2.Layer, str]]] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., encoding: _Optional[_Union[SnapshotEncoding, str]] = ...) -> None: ...

class GetSnapshotResponse(_message.Message):
    __slots__ = ("allocations", "next_page_token", "timestamp_ns", "stacks", "view", "depths", "columns")
    ALLOCATIONS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_NS_FIELD_NUMBER: _ClassVar[int]
    STACKS_FIELD_NUMBER: _ClassVar[int]
    VIEW_FIELD_NUMBER: _ClassVar[int]
    DEPTHS_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    allocations: _containers.RepeatedCompositeFieldContainer[OutstandingAllocation]
    next_page_token: str
    timestamp_ns: int
    stacks: _containers.RepeatedCompositeFieldContainer[_events_pb2.Stack]
    view: View
    depths: _containers.RepeatedCompositeFieldContainer[ProcessDepthState]
    columns: OutstandingColumns
    def __init__(self, allocations: _Optional[_Iterable[_Union[OutstandingAllocation, _Mapping]]] = ..., next_page_token: _Optional[str] = ..., timestamp_ns: _Optional[int] = ..., stacks: _Optional[_Iterable[_Union[_events_pb2.Stack, _Mapping]]] = ..., view: _Optional[_Union[View, str]] = ..., depths: _Optional[_Iterable[_Union[ProcessDepthState, _Mapping]]] = ..., columns: _Optional[_Union[OutstandingColumns, _Mapping]] = ...) -> None: ...

class OutstandingColumns(_message.Message):
    __slots__ = ("pid", "tid", "layer", "object", "memory", "api", "size_bytes", "address", "device", "timestamp_ns", "caller_address", "stack_id", "mapped_count", "released", "handle", "stream", "sample_bytes", "sampled", "processes")
    PID_FIELD_NUMBER: _ClassVar[int]
    TID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    OBJECT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    API_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_NS_FIELD_NUMBER: _ClassVar[int]
    CALLER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STACK_ID_FIELD_NUMBER: _ClassVar[int]
    MAPPED_COUNT_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    pid: _containers.RepeatedScalarFieldContainer[int]
    tid: _containers.RepeatedScalarFieldContainer[int]
    layer: _containers.RepeatedScalarFieldContainer[_events_pb2.Layer]
    object: _containers.RepeatedScalarFieldContainer[_events_pb2.ObjectKind]
    memory: _containers.RepeatedScalarFieldContainer[_events_pb2.Memory]
    api: _containers.RepeatedScalarFieldContainer[_events_pb2.Api]
    size_bytes: _containers.RepeatedScalarFieldContainer[int]
    address: _containers.RepeatedScalarFieldContainer[int]
    device: _containers.RepeatedScalarFieldContainer[int]
    timestamp_ns: _containers.RepeatedScalarFieldContainer[int]
    caller_address: _containers.RepeatedScalarFieldContainer[int]
    stack_id: _containers.RepeatedScalarFieldContainer[int]
    mapped_count: _containers.RepeatedScalarFieldContainer[int]
    released: _containers.RepeatedScalarFieldContainer[bool]
    handle: _containers.RepeatedScalarFieldContainer[int]
    stream: _containers.RepeatedScalarFieldContainer[int]
    sample_bytes: _containers.RepeatedScalarFieldContainer[int]
    sampled: _containers.RepeatedScalarFieldContainer[bool]
    processes: _containers.RepeatedCompositeFieldContainer[_events_pb2.ProcessLabel]
    def __init__(self, pid: _Optional[_Iterable[int]] = ..., tid: _Optional[_Iterable[int]] = ..., layer: _Optional[_Iterable[_Union[_events_pb2.Layer, str]]] = ..., object: _Optional[_Iterable[_Union[_events_pb2.ObjectKind, str]]] = ..., memory: _Optional[_Iterable[_Union[_events_pb2.Memory, str]]] = ..., api: _Optional[_Iterable[_Union[_events_pb2.Api, str]]] = ..., size_bytes: _Optional[_Iterable[int]] = ..., address: _Optional[_Iterable[int]] = ..., device: _Optional[_Iterable[int]] = ..., timestamp_ns: _Optional[_Iterable[int]] = ..., caller_address: _Optional[_Iterable[int]] = ..., stack_id: _Optional[_Iterable[int]] = ..., mapped_count: _Optional[_Iterable[int]] = ..., released: _Optional[_Iterable[bool]] = ..., handle: _Optional[_Iterable[int]] = ..., stream: _Optional[_Iterable[int]] = ..., sample_bytes: _Optional[_Iterable[int]] = ..., sampled: _Optional[_Iterable[bool]] = ..., processes: _Optional[_Iterable[_Union[_events_pb2.ProcessLabel, _Mapping]]] = ...) -> None: ...

class OutstandingAllocation(_message.Message):
    __slots__ = ("pid", "tid", "comm", "title", "container", "layer", "object", "memory", "api", "api_name", "size_bytes", "address", "device", "timestamp_ns", "caller_address", "stack_id", "mapped_count", "released", "handle", "stream", "sample_bytes", "sampled")
    PID_FIELD_NUMBER: _ClassVar[int]
    TID_FIELD_NUMBER: _ClassVar[int]
    COMM_FIELD_NUMBER: _ClassVar[int]
    TITLE_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    OBJECT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    API_FIELD_NUMBER: _ClassVar[int]
    API_NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_NS_FIELD_NUMBER: _ClassVar[int]
    CALLER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STACK_ID_FIELD_NUMBER: _ClassVar[int]
    MAPPED_COUNT_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    pid: int
    tid: int
    comm: str
    title: str
    container: str
    layer: _events_pb2.Layer
    object: _events_pb2.ObjectKind
    memory: _events_pb2.Memory
    api: _events_pb2.Api
    api_name: str
    size_bytes: int
    address: int
    device: int
    timestamp_ns: int
    caller_address: int
    stack_id: int
    mapped_count: int
    released: bool
    handle: int
    stream: int
    sample_bytes: int
    sampled: bool
    def __init__(self, pid: _Optional[int] = ..., tid: _Optional[int] = ..., comm: _Optional[str] = ..., title: _Optional[str] = ..., container: _Optional[str] = ..., layer: _Optional[_Union[_events_pb2.Layer, str]] = ..., object: _Optional[_Union[_events_pb2.ObjectKind, str]] = ..., memory: _Optional[_Union[_events_pb2.Memory, str]] = ..., api: _Optional[_Union[_events_pb2.Api, str]] = ..., api_name: _Optional[str] = ..., size_bytes: _Optional[int] = ..., address: _Optional[int] = ..., device: _Optional[int] = ..., timestamp_ns: _Optional[int] = ..., caller_address: _Optional[int] = ..., stack_id: _Optional[int] = ..., mapped_count: _Optional[int] = ..., released: bool = ..., handle: _Optional[int] = ..., stream: _Optional[int] = ..., sample_bytes: _Optional[int] = ..., sampled: bool = ...) -> None: ...

class ListProcessesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListProcessesResponse(_message.Message):
    __slots__ = ("processes", "view")
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    VIEW_FIELD_NUMBER: _ClassVar[int]
    processes: _containers.RepeatedCompositeFieldContainer[Process]
    view: View
    def __init__(self, processes: _Optional[_Iterable[_Union[Process, _Mapping]]] = ..., view: _Optional[_Union[View, str]] = ...) -> None: ...

class Process(_message.Message):
    __slots__ = ("pid", "title", "comm", "container", "totals", "depth")
    PID_FIELD_NUMBER: _ClassVar[int]
    TITLE_FIELD_NUMBER: _ClassVar[int]
    COMM_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_FIELD_NUMBER: _ClassVar[int]
    TOTALS_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    pid: int
    title: str
    comm: str
    container: str
    totals: _containers.RepeatedCompositeFieldContainer[OutstandingTotal]
    depth: ProcessDepthState
    def __init__(self, pid: _Optional[int] = ..., title: _Optional[str] = ..., comm: _Optional[str] = ..., container: _Optional[str] = ..., totals: _Optional[_Iterable[_Union[OutstandingTotal, _Mapping]]] = ..., depth: _Optional[_Union[ProcessDepthState, _Mapping]] = ...) -> None: ...

class OutstandingTotal(_message.Message):
    __slots__ = ("device", "layer", "memory", "size_bytes", "object_count")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    OBJECT_COUNT_FIELD_NUMBER: _ClassVar[int]
    device: int
    layer: _events_pb2.Layer
    memory: _events_pb2.Memory
    size_bytes: int
    object_count: int
    def __init__(self, device: _Optional[int] = ..., layer: _Optional[_Union[_events_pb2.Layer, str]] = ..., memory: _Optional[_Union[_events_pb2.Memory, str]] = ..., size_bytes: _Optional[int] = ..., object_count: _Optional[int] = ...) -> None: ...

class GetAgentInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetAgentInfoResponse(_message.Message):
    __slots__ = ("version", "kernel_release", "attached_libraries", "components", "counters", "view")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    KERNEL_RELEASE_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_LIBRARIES_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    VIEW_FIELD_NUMBER: _ClassVar[int]
    version: str
    kernel_release: str
    attached_libraries: _containers.RepeatedCompositeFieldContainer[AttachedLibrary]
    components: _containers.RepeatedCompositeFieldContainer[ComponentHealth]
    counters: _containers.ScalarMap[str, int]
    view: View
    def __init__(self, version: _Optional[str] = ..., kernel_release: _Optional[str] = ..., attached_libraries: _Optional[_Iterable[_Union[AttachedLibrary, _Mapping]]] = ..., components: _Optional[_Iterable[_Union[ComponentHealth, _Mapping]]] = ..., counters: _Optional[_Mapping[str, int]] = ..., view: _Optional[_Union[View, str]] = ...) -> None: ...

class AttachedLibrary(_message.Message):
    __slots__ = ("path", "file_device", "inode", "symbols", "pids")
    PATH_FIELD_NUMBER: _ClassVar[int]
    FILE_DEVICE_FIELD_NUMBER: _ClassVar[int]
    INODE_FIELD_NUMBER: _ClassVar[int]
    SYMBOLS_FIELD_NUMBER: _ClassVar[int]
    PIDS_FIELD_NUMBER: _ClassVar[int]
    path: str
    file_device: int
    inode: int
    symbols: _containers.RepeatedScalarFieldContainer[str]
    pids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, path: _Optional[str] = ..., file_device: _Optional[int] = ..., inode: _Optional[int] = ..., symbols: _Optional[_Iterable[str]] = ..., pids: _Optional[_Iterable[int]] = ...) -> None: ...

class ComponentHealth(_message.Message):
    __slots__ = ("name", "up", "reason")
    NAME_FIELD_NUMBER: _ClassVar[int]
    UP_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    name: str
    up: bool
    reason: str
    def __init__(self, name: _Optional[str] = ..., up: bool = ..., reason: _Optional[str] = ...) -> None: ...

class ListLeakSuspectsRequest(_message.Message):
    __slots__ = ("pids", "min_age_seconds", "limit")
    PIDS_FIELD_NUMBER: _ClassVar[int]
    MIN_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    pids: _containers.RepeatedScalarFieldContainer[int]
    min_age_seconds: float
    limit: int
    def __init__(self, pids: _Optional[_Iterable[int]] = ..., min_age_seconds: _Optional[float] = ..., limit: _Optional[int] = ...) -> None: ...

class ListLeakSuspectsResponse(_message.Message):
    __slots__ = ("suspects", "suspect_count", "allocations_considered", "suspect_allocations", "min_age_seconds", "timestamp_ns", "view", "depths")
    SUSPECTS_FIELD_NUMBER: _ClassVar[int]
    SUSPECT_COUNT_FIELD_NUMBER: _ClassVar[int]
    ALLOCATIONS_CONSIDERED_FIELD_NUMBER: _ClassVar[int]
    SUSPECT_ALLOCATIONS_FIELD_NUMBER: _ClassVar[int]
    MIN_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_NS_FIELD_NUMBER: _ClassVar[int]
    VIEW_FIELD_NUMBER: _ClassVar[int]
    DEPTHS_FIELD_NUMBER: _ClassVar[int]
    suspects: _containers.RepeatedCompositeFieldContainer[LeakSuspect]
    suspect_count: int
    allocations_considered: int
    suspect_allocations: int
    min_age_seconds: float
    timestamp_ns: int
    view: View
    depths: _containers.RepeatedCompositeFieldContainer[ProcessDepthState]
    def __init__(self, suspects: _Optional[_Iterable[_Union[LeakSuspect, _Mapping]]] = ..., suspect_count: _Optional[int] = ..., allocations_considered: _Optional[int] = ..., suspect_allocations: _Optional[int] = ..., min_age_seconds: _Optional[float] = ..., timestamp_ns: _Optional[int] = ..., view: _Optional[_Union[View, str]] = ..., depths: _Optional[_Iterable[_Union[ProcessDepthState, _Mapping]]] = ...) -> None: ...

class LeakSuspect(_message.Message):
    __slots__ = ("rank", "pid", "title", "device", "stack_id", "stack", "caller_address", "native_caller", "outstanding_bytes", "allocation_count", "oldest_age_seconds", "growth_bytes_per_second", "estimated")
    RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    TITLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    STACK_ID_FIELD_NUMBER: _ClassVar[int]
    STACK_FIELD_NUMBER: _ClassVar[int]
    CALLER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NATIVE_CALLER_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_BYTES_FIELD_NUMBER: _ClassVar[int]
    ALLOCATION_COUNT_FIELD_NUMBER: _ClassVar[int]
    OLDEST_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GROWTH_BYTES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_FIELD_NUMBER: _ClassVar[int]
    rank: int
    pid: int
    title: str
    device: int
    stack_id: int
    stack: _events_pb2.Stack
    caller_address: int
    native_caller: NativeFrame
    outstanding_bytes: int
    allocation_count: int
    oldest_age_seconds: float
    growth_bytes_per_second: float
    estimated: bool
    def __init__(self, rank: _Optional[int] = ..., pid: _Optional[int] = ..., title: _Optional[str] = ..., device: _Optional[int] = ..., stack_id: _Optional[int] = ..., stack: _Optional[_Union[_events_pb2.Stack, _Mapping]] = ..., caller_address: _Optional[int] = ..., native_caller: _Optional[_Union[NativeFrame, _Mapping]] = ..., outstanding_bytes: _Optional[int] = ..., allocation_count: _Optional[int] = ..., oldest_age_seconds: _Optional[float] = ..., growth_bytes_per_second: _Optional[float] = ..., estimated: bool = ...) -> None: ...

class NativeFrame(_message.Message):
    __slots__ = ("module", "symbol", "offset")
    MODULE_FIELD_NUMBER: _ClassVar[int]
    SYMBOL_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    module: str
    symbol: str
    offset: int
    def __init__(self, module: _Optional[str] = ..., symbol: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class GetGrowthRequest(_message.Message):
    __slots__ = ("pids",)
    PIDS_FIELD_NUMBER: _ClassVar[int]
    pids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, pids: _Optional[_Iterable[int]] = ...) -> None: ...

class GetGrowthResponse(_message.Message):
    __slots__ = ("timestamp_ns", "nvml_timestamp_ns", "gpus", "processes", "view")
    TIMESTAMP_NS_FIELD_NUMBER: _ClassVar[int]
    NVML_TIMESTAMP_NS_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    VIEW_FIELD_NUMBER: _ClassVar[int]
    timestamp_ns: int
    nvml_timestamp_ns: int
    gpus: _containers.RepeatedCompositeFieldContainer[GpuMemory]
    processes: _containers.RepeatedCompositeFieldContainer[ProcessGrowth]
    view: View
    def __init__(self, timestamp_ns: _Optional[int] = ..., nvml_timestamp_ns: _Optional[int] = ..., gpus: _Optional[_Iterable[_Union[GpuMemory, _Mapping]]] = ..., processes: _Optional[_Iterable[_Union[ProcessGrowth, _Mapping]]] = ..., view: _Optional[_Union[View, str]] = ...) -> None: ...

class GpuMemory(_message.Message):
    __slots__ = ("index", "uuid", "name", "total_bytes", "used_bytes", "free_bytes", "reserved_bytes")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    index: int
    uuid: str
    name: str
    total_bytes: int
    used_bytes: int
    free_bytes: int
    reserved_bytes: int
    def __init__(self, index: _Optional[int] = ..., uuid: _Optional[str] = ..., name: _Optional[str] = ..., total_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., free_bytes: _Optional[int] = ..., reserved_bytes: _Optional[int] = ...) -> None: ...

class ProcessGrowth(_message.Message):
    __slots__ = ("pid", "title", "device", "nvml_index", "outstanding_bytes", "nvml_used_bytes", "unattributed_bytes", "growth_bytes_per_second_1m", "growth_bytes_per_second_15m", "history_seconds", "time_to_oom_seconds", "allocations_1m", "frees_1m", "free_ratio_1m", "fragmentation", "predates_agent", "role_bytes", "depth")
    PID_FIELD_NUMBER: _ClassVar[int]
    TITLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    NVML_INDEX_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_BYTES_FIELD_NUMBER: _ClassVar[int]
    NVML_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    UNATTRIBUTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    GROWTH_BYTES_PER_SECOND_1M_FIELD_NUMBER: _ClassVar[int]
    GROWTH_BYTES_PER_SECOND_15M_FIELD_NUMBER: _ClassVar[int]
    HISTORY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_OOM_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ALLOCATIONS_1M_FIELD_NUMBER: _ClassVar[int]
    FREES_1M_FIELD_NUMBER: _ClassVar[int]
    FREE_RATIO_1M_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTATION_FIELD_NUMBER: _ClassVar[int]
    PREDATES_AGENT_FIELD_NUMBER: _ClassVar[int]
    ROLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    pid: int
    title: str
    device: int
    nvml_index: int
    outstanding_bytes: int
    nvml_used_bytes: int
    unattributed_bytes: int
    growth_bytes_per_second_1m: float
    growth_bytes_per_second_15m: float
    history_seconds: float
    time_to_oom_seconds: float
    allocations_1m: int
    frees_1m: int
    free_ratio_1m: float
    fragmentation: Fragmentation
    predates_agent: bool
    role_bytes: _containers.RepeatedCompositeFieldContainer[RoleBytes]
    depth: ProcessDepthState
    def __init__(self, pid: _Optional[int] = ..., title: _Optional[str] = ..., device: _Optional[int] = ..., nvml_index: _Optional[int] = ..., outstanding_bytes: _Optional[int] = ..., nvml_used_bytes: _Optional[int] = ..., unattributed_bytes: _Optional[int] = ..., growth_bytes_per_second_1m: _Optional[float] = ..., growth_bytes_per_second_15m: _Optional[float] = ..., history_seconds: _Optional[float] = ..., time_to_oom_seconds: _Optional[float] = ..., allocations_1m: _Optional[int] = ..., frees_1m: _Optional[int] = ..., free_ratio_1m: _Optional[float] = ..., fragmentation: _Optional[_Union[Fragmentation, _Mapping]] = ..., predates_agent: bool = ..., role_bytes: _Optional[_Iterable[_Union[RoleBytes, _Mapping]]] = ..., depth: _Optional[_Union[ProcessDepthState, _Mapping]] = ...) -> None: ...

class Fragmentation(_message.Message):
    __slots__ = ("reserved_bytes", "allocated_bytes", "largest_free_bytes", "ratio", "segments", "blocks", "blocks_outside_segments")
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ALLOCATED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LARGEST_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    RATIO_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_OUTSIDE_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    reserved_bytes: int
    allocated_bytes: int
    largest_free_bytes: int
    ratio: float
    segments: int
    blocks: int
    blocks_outside_segments: int
    def __init__(self, reserved_bytes: _Optional[int] = ..., allocated_bytes: _Optional[int] = ..., largest_free_bytes: _Optional[int] = ..., ratio: _Optional[float] = ..., segments: _Optional[int] = ..., blocks: _Optional[int] = ..., blocks_outside_segments: _Optional[int] = ...) -> None: ...

class RoleBytes(_message.Message):
    __slots__ = ("role", "size_bytes")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    role: Role
    size_bytes: int
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class TagBytes(_message.Message):
    __slots__ = ("tag", "size_bytes")
    TAG_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    tag: str
    size_bytes: int
    def __init__(self, tag: _Optional[str] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class VllmRequest(_message.Message):
    __slots__ = ("request_id", "state", "blocks", "done_age_seconds")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DONE_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    state: RequestState
    blocks: int
    done_age_seconds: float
    def __init__(self, request_id: _Optional[str] = ..., state: _Optional[_Union[RequestState, str]] = ..., blocks: _Optional[int] = ..., done_age_seconds: _Optional[float] = ...) -> None: ...

class VllmEngine(_message.Message):
    __slots__ = ("engine_pid", "title", "worker_pids", "api_server_pid", "traced_bytes", "role_bytes", "plugin", "blocks_total", "blocks_free", "kv_cache_usage_ratio", "metrics_kv_cache_usage_ratio", "requests_running", "requests_waiting", "kv_tensor_bytes", "page_size_bytes", "block_allocations_per_second", "block_frees_per_second", "frees_per_allocation_1m", "sleep_level", "warming_up", "holders", "metrics_url", "metrics_error", "free_blocks_ratio", "idle_growth_bytes_per_second", "blocks_held_after_finish", "sleep_residual_bytes", "sleep_held_by_tag", "previous_sleep_residual_bytes", "depths")
    ENGINE_PID_FIELD_NUMBER: _ClassVar[int]
    TITLE_FIELD_NUMBER: _ClassVar[int]
    WORKER_PIDS_FIELD_NUMBER: _ClassVar[int]
    API_SERVER_PID_FIELD_NUMBER: _ClassVar[int]
    TRACED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ROLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PLUGIN_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_RATIO_FIELD_NUMBER: _ClassVar[int]
    METRICS_KV_CACHE_USAGE_RATIO_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_TENSOR_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ALLOCATIONS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FREES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    FREES_PER_ALLOCATION_1M_FIELD_NUMBER: _ClassVar[int]
    SLEEP_LEVEL_FIELD_NUMBER: _ClassVar[int]
    WARMING_UP_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    METRICS_URL_FIELD_NUMBER: _ClassVar[int]
    METRICS_ERROR_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_RATIO_FIELD_NUMBER: _ClassVar[int]
    IDLE_GROWTH_BYTES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_HELD_AFTER_FINISH_FIELD_NUMBER: _ClassVar[int]
    SLEEP_RESIDUAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLEEP_HELD_BY_TAG_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_SLEEP_RESIDUAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEPTHS_FIELD_NUMBER: _ClassVar[int]
    engine_pid: int
    title: str
    worker_pids: _containers.RepeatedScalarFieldContainer[int]
    api_server_pid: int
    traced_bytes: int
    role_bytes: _containers.RepeatedCompositeFieldContainer[RoleBytes]
    plugin: bool
    blocks_total: int
    blocks_free: int
    kv_cache_usage_ratio: float
    metrics_kv_cache_usage_ratio: float
    requests_running: int
    requests_waiting: int
    kv_tensor_bytes: int
    page_size_bytes: int
    block_allocations_per_second: float
    block_frees_per_second: float
    frees_per_allocation_1m: float
    sleep_level: int
    warming_up: bool
    holders: _containers.RepeatedCompositeFieldContainer[VllmRequest]
    metrics_url: str
    metrics_error: str
    free_blocks_ratio: float
    idle_growth_bytes_per_second: float
    blocks_held_after_finish: int
    sleep_residual_bytes: int
    sleep_held_by_tag: _containers.RepeatedCompositeFieldContainer[TagBytes]
    previous_sleep_residual_bytes: int
    depths: _containers.RepeatedCompositeFieldContainer[ProcessDepthState]
    def __init__(self, engine_pid: _Optional[int] = ..., title: _Optional[str] = ..., worker_pids: _Optional[_Iterable[int]] = ..., api_server_pid: _Optional[int] = ..., traced_bytes: _Optional[int] = ..., role_bytes: _Optional[_Iterable[_Union[RoleBytes, _Mapping]]] = ..., plugin: bool = ..., blocks_total: _Optional[int] = ..., blocks_free: _Optional[int] = ..., kv_cache_usage_ratio: _Optional[float] = ..., metrics_kv_cache_usage_ratio: _Optional[float] = ..., requests_running: _Optional[int] = ..., requests_waiting: _Optional[int] = ..., kv_tensor_bytes: _Optional[int] = ..., page_size_bytes: _Optional[int] = ..., block_allocations_per_second: _Optional[float] = ..., block_frees_per_second: _Optional[float] = ..., frees_per_allocation_1m: _Optional[float] = ..., sleep_level: _Optional[int] = ..., warming_up: bool = ..., holders: _Optional[_Iterable[_Union[VllmRequest, _Mapping]]] = ..., metrics_url: _Optional[str] = ..., metrics_error: _Optional[str] = ..., free_blocks_ratio: _Optional[float] = ..., idle_growth_bytes_per_second: _Optional[float] = ..., blocks_held_after_finish: _Optional[int] = ..., sleep_residual_bytes: _Optional[int] = ..., sleep_held_by_tag: _Optional[_Iterable[_Union[TagBytes, _Mapping]]] = ..., previous_sleep_residual_bytes: _Optional[int] = ..., depths: _Optional[_Iterable[_Union[ProcessDepthState, _Mapping]]] = ...) -> None: ...

class VllmFinding(_message.Message):
    __slots__ = ("kind", "engine_pid", "message", "value", "threshold", "since_ns", "requests", "held_by_role", "held_by_tag")
    KIND_FIELD_NUMBER: _ClassVar[int]
    ENGINE_PID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    SINCE_NS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    HELD_BY_ROLE_FIELD_NUMBER: _ClassVar[int]
    HELD_BY_TAG_FIELD_NUMBER: _ClassVar[int]
    kind: VllmFindingKind
    engine_pid: int
    message: str
    value: float
    threshold: float
    since_ns: int
    requests: _containers.RepeatedCompositeFieldContainer[VllmRequest]
    held_by_role: _containers.RepeatedCompositeFieldContainer[RoleBytes]
    held_by_tag: _containers.RepeatedCompositeFieldContainer[TagBytes]
    def __init__(self, kind: _Optional[_Union[VllmFindingKind, str]] = ..., engine_pid: _Optional[int] = ..., message: _Optional[str] = ..., value: _Optional[float] = ..., threshold: _Optional[float] = ..., since_ns: _Optional[int] = ..., requests: _Optional[_Iterable[_Union[VllmRequest, _Mapping]]] = ..., held_by_role: _Optional[_Iterable[_Union[RoleBytes, _Mapping]]] = ..., held_by_tag: _Optional[_Iterable[_Union[TagBytes, _Mapping]]] = ...) -> None: ...

class GetVllmEnginesRequest(_message.Message):
    __slots__ = ("pids",)
    PIDS_FIELD_NUMBER: _ClassVar[int]
    pids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, pids: _Optional[_Iterable[int]] = ...) -> None: ...

class GetVllmEnginesResponse(_message.Message):
    __slots__ = ("timestamp_ns", "engines", "findings", "view", "untrusted_senders")
    TIMESTAMP_NS_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    FINDINGS_FIELD_NUMBER: _ClassVar[int]
    VIEW_FIELD_NUMBER: _ClassVar[int]
    UNTRUSTED_SENDERS_FIELD_NUMBER: _ClassVar[int]
    timestamp_ns: int
    engines: _containers.RepeatedCompositeFieldContainer[VllmEngine]
    findings: _containers.RepeatedCompositeFieldContainer[VllmFinding]
    view: View
    untrusted_senders: _containers.RepeatedCompositeFieldContainer[VllmUntrustedSender]
    def __init__(self, timestamp_ns: _Optional[int] = ..., engines: _Optional[_Iterable[_Union[VllmEngine, _Mapping]]] = ..., findings: _Optional[_Iterable[_Union[VllmFinding, _Mapping]]] = ..., view: _Optional[_Union[View, str]] = ..., untrusted_senders: _Optional[_Iterable[_Union[VllmUntrustedSender, _Mapping]]] = ...) -> None: ...

class VllmUntrustedSender(_message.Message):
    __slots__ = ("pid", "title", "reason", "kv_tensor_bytes", "scheduler")
    PID_FIELD_NUMBER: _ClassVar[int]
    TITLE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    KV_TENSOR_BYTES_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    pid: int
    title: str
    reason: str
    kv_tensor_bytes: int
    scheduler: bool
    def __init__(self, pid: _Optional[int] = ..., title: _Optional[str] = ..., reason: _Optional[str] = ..., kv_tensor_bytes: _Optional[int] = ..., scheduler: bool = ...) -> None: ...

class StreamRecordingRequest(_message.Message):
    __slots__ = ("pids", "title_regex")
    PIDS_FIELD_NUMBER: _ClassVar[int]
    TITLE_REGEX_FIELD_NUMBER: _ClassVar[int]
    pids: _containers.RepeatedScalarFieldContainer[int]
    title_regex: str
    def __init__(self, pids: _Optional[_Iterable[int]] = ..., title_regex: _Optional[str] = ...) -> None: ...

class StreamRecordingResponse(_message.Message):
    __slots__ = ("header", "frames")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    header: RecordingHeader
    frames: _containers.RepeatedCompositeFieldContainer[RecordingFrame]
    def __init__(self, header: _Optional[_Union[RecordingHeader, _Mapping]] = ..., frames: _Optional[_Iterable[_Union[RecordingFrame, _Mapping]]] = ...) -> None: ...

class DumpFlightRecorderRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class DumpFlightRecorderResponse(_message.Message):
    __slots__ = ("dump",)
    DUMP_FIELD_NUMBER: _ClassVar[int]
    dump: FlightDump
    def __init__(self, dump: _Optional[_Union[FlightDump, _Mapping]] = ...) -> None: ...

class ListFlightDumpsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListFlightDumpsResponse(_message.Message):
    __slots__ = ("dumps", "directory")
    DUMPS_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    dumps: _containers.RepeatedCompositeFieldContainer[FlightDump]
    directory: str
    def __init__(self, dumps: _Optional[_Iterable[_Union[FlightDump, _Mapping]]] = ..., directory: _Optional[str] = ...) -> None: ...

class FlightDump(_message.Message):
    __slots__ = ("path", "trigger", "size_bytes", "event_count")
    PATH_FIELD_NUMBER: _ClassVar[int]
    TRIGGER_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVENT_COUNT_FIELD_NUMBER: _ClassVar[int]
    path: str
    trigger: FlightTrigger
    size_bytes: int
    event_count: int
    def __init__(self, path: _Optional[str] = ..., trigger: _Optional[_Union[FlightTrigger, _Mapping]] = ..., size_bytes: _Optional[int] = ..., event_count: _Optional[int] = ...) -> None: ...

class RecordingHeader(_message.Message):
    __slots__ = ("agent_version", "host", "kernel_release", "start_time_ns", "agent_start_time_ns", "leak_min_age_seconds", "filter_description", "trigger")
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    KERNEL_RELEASE_FIELD_NUMBER: _ClassVar[int]
    START_TIME_NS_FIELD_NUMBER: _ClassVar[int]
    AGENT_START_TIME_NS_FIELD_NUMBER: _ClassVar[int]
    LEAK_MIN_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FILTER_DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    TRIGGER_FIELD_NUMBER: _ClassVar[int]
    agent_version: str
    host: str
    kernel_release: str
    start_time_ns: int
    agent_start_time_ns: int
    leak_min_age_seconds: float
    filter_description: str
    trigger: FlightTrigger
    def __init__(self, agent_version: _Optional[str] = ..., host: _Optional[str] = ..., kernel_release: _Optional[str] = ..., start_time_ns: _Optional[int] = ..., agent_start_time_ns: _Optional[int] = ..., leak_min_age_seconds: _Optional[float] = ..., filter_description: _Optional[str] = ..., trigger: _Optional[_Union[FlightTrigger, _Mapping]] = ...) -> None: ...

class FlightTrigger(_message.Message):
    __slots__ = ("kind", "timestamp_ns", "pid", "device", "reason", "window_seconds", "left_out")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_NS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    WINDOW_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LEFT_OUT_FIELD_NUMBER: _ClassVar[int]
    kind: FlightTriggerKind
    timestamp_ns: int
    pid: int
    device: int
    reason: str
    window_seconds: float
    left_out: str
    def __init__(self, kind: _Optional[_Union[FlightTriggerKind, str]] = ..., timestamp_ns: _Optional[int] = ..., pid: _Optional[int] = ..., device: _Optional[int] = ..., reason: _Optional[str] = ..., window_seconds: _Optional[float] = ..., left_out: _Optional[str] = ...) -> None: ...

class RecordingFrame(_message.Message):
    __slots__ = ("event", "checkpoint", "nvml", "process", "native_caller")
    EVENT_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    NVML_FIELD_NUMBER: _ClassVar[int]
    PROCESS_FIELD_NUMBER: _ClassVar[int]
    NATIVE_CALLER_FIELD_NUMBER: _ClassVar[int]
    event: _events_pb2.Event
    checkpoint: RecordingCheckpoint
    nvml: NvmlRound
    process: RecordedProcess
    native_caller: NativeCallerName
    def __init__(self, event: _Optional[_Union[_events_pb2.Event, _Mapping]] = ..., checkpoint: _Optional[_Union[RecordingCheckpoint, _Mapping]] = ..., nvml: _Optional[_Union[NvmlRound, _Mapping]] = ..., process: _Optional[_Union[RecordedProcess, _Mapping]] = ..., native_caller: _Optional[_Union[NativeCallerName, _Mapping]] = ...) -> None: ...

class NativeCallerName(_message.Message):
    __slots__ = ("pid", "address", "frame")
    PID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FRAME_FIELD_NUMBER: _ClassVar[int]
    pid: int
    address: int
    frame: NativeFrame
    def __init__(self, pid: _Optional[int] = ..., address: _Optional[int] = ..., frame: _Optional[_Union[NativeFrame, _Mapping]] = ...) -> None: ...

class RecordingCheckpoint(_message.Message):
    __slots__ = ("timestamp_ns", "allocations", "last")
    TIMESTAMP_NS_FIELD_NUMBER: _ClassVar[int]
    ALLOCATIONS_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    timestamp_ns: int
    allocations: _containers.RepeatedCompositeFieldContainer[OutstandingAllocation]
    last: bool
    def __init__(self, timestamp_ns: _Optional[int] = ..., allocations: _Optional[_Iterable[_Union[OutstandingAllocation, _Mapping]]] = ..., last: bool = ...) -> None: ...

class NvmlRound(_message.Message):
    __slots__ = ("timestamp_ns", "gpus", "processes")
    TIMESTAMP_NS_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    timestamp_ns: int
    gpus: _containers.RepeatedCompositeFieldContainer[GpuMemory]
    processes: _containers.RepeatedCompositeFieldContainer[NvmlProcessUsage]
    def __init__(self, timestamp_ns: _Optional[int] = ..., gpus: _Optional[_Iterable[_Union[GpuMemory, _Mapping]]] = ..., processes: _Optional[_Iterable[_Union[NvmlProcessUsage, _Mapping]]] = ...) -> None: ...

class NvmlProcessUsage(_message.Message):
    __slots__ = ("gpu_index", "pid", "used_bytes")
    GPU_INDEX_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    gpu_index: int
    pid: int
    used_bytes: int
    def __init__(self, gpu_index: _Optional[int] = ..., pid: _Optional[int] = ..., used_bytes: _Optional[int] = ...) -> None: ...

class RecordedProcess(_message.Message):
    __slots__ = ("pid", "title", "comm", "container", "start_time_ns", "parent_pid", "depth")
    PID_FIELD_NUMBER: _ClassVar[int]
    TITLE_FIELD_NUMBER: _ClassVar[int]
    COMM_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_FIELD_NUMBER: _ClassVar[int]
    START_TIME_NS_FIELD_NUMBER: _ClassVar[int]
    PARENT_PID_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    pid: int
    title: str
    comm: str
    container: str
    start_time_ns: int
    parent_pid: int
    depth: ProcessDepthState
    def __init__(self, pid: _Optional[int] = ..., title: _Optional[str] = ..., comm: _Optional[str] = ..., container: _Optional[str] = ..., start_time_ns: _Optional[int] = ..., parent_pid: _Optional[int] = ..., depth: _Optional[_Union[ProcessDepthState, _Mapping]] = ...) -> None: ...

class GetCrossCheckRequest(_message.Message):
    __slots__ = ("pids",)
    PIDS_FIELD_NUMBER: _ClassVar[int]
    pids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, pids: _Optional[_Iterable[int]] = ...) -> None: ...

class GetCrossCheckResponse(_message.Message):
    __slots__ = ("processes",)
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    processes: _containers.RepeatedCompositeFieldContainer[ProcessCrossCheck]
    def __init__(self, processes: _Optional[_Iterable[_Union[ProcessCrossCheck, _Mapping]]] = ...) -> None: ...

class ProcessCrossCheck(_message.Message):
    __slots__ = ("pid", "state", "reason", "holder", "counters", "compared", "finished", "pending_count", "apis", "disagreements")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    PID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    COMPARED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    PENDING_COUNT_FIELD_NUMBER: _ClassVar[int]
    APIS_FIELD_NUMBER: _ClassVar[int]
    DISAGREEMENTS_FIELD_NUMBER: _ClassVar[int]
    pid: int
    state: str
    reason: str
    holder: str
    counters: _containers.ScalarMap[str, int]
    compared: bool
    finished: bool
    pending_count: int
    apis: _containers.RepeatedCompositeFieldContainer[ApiAgreement]
    disagreements: _containers.RepeatedCompositeFieldContainer[CrossCheckDisagreement]
    def __init__(self, pid: _Optional[int] = ..., state: _Optional[str] = ..., reason: _Optional[str] = ..., holder: _Optional[str] = ..., counters: _Optional[_Mapping[str, int]] = ..., compared: bool = ..., finished: bool = ..., pending_count: _Optional[int] = ..., apis: _Optional[_Iterable[_Union[ApiAgreement, _Mapping]]] = ..., disagreements: _Optional[_Iterable[_Union[CrossCheckDisagreement, _Mapping]]] = ...) -> None: ...

class ApiAgreement(_message.Message):
    __slots__ = ("api", "api_name", "matched_count", "uprobe_only_count", "cupti_only_count", "mismatched_count")
    API_FIELD_NUMBER: _ClassVar[int]
    API_NAME_FIELD_NUMBER: _ClassVar[int]
    MATCHED_COUNT_FIELD_NUMBER: _ClassVar[int]
    UPROBE_ONLY_COUNT_FIELD_NUMBER: _ClassVar[int]
    CUPTI_ONLY_COUNT_FIELD_NUMBER: _ClassVar[int]
    MISMATCHED_COUNT_FIELD_NUMBER: _ClassVar[int]
    api: _events_pb2.Api
    api_name: str
    matched_count: int
    uprobe_only_count: int
    cupti_only_count: int
    mismatched_count: int
    def __init__(self, api: _Optional[_Union[_events_pb2.Api, str]] = ..., api_name: _Optional[str] = ..., matched_count: _Optional[int] = ..., uprobe_only_count: _Optional[int] = ..., cupti_only_count: _Optional[int] = ..., mismatched_count: _Optional[int] = ...) -> None: ...

class CrossCheckDisagreement(_message.Message):
    __slots__ = ("seen_by", "api", "api_name", "failed", "address", "size_bytes", "device", "timestamp_ns", "detail")
    SEEN_BY_FIELD_NUMBER: _ClassVar[int]
    API_FIELD_NUMBER: _ClassVar[int]
    API_NAME_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_NS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    seen_by: _events_pb2.EventSource
    api: _events_pb2.Api
    api_name: str
    failed: bool
    address: int
    size_bytes: int
    device: int
    timestamp_ns: int
    detail: str
    def __init__(self, seen_by: _Optional[_Union[_events_pb2.EventSource, str]] = ..., api: _Optional[_Union[_events_pb2.Api, str]] = ..., api_name: _Optional[str] = ..., failed: bool = ..., address: _Optional[int] = ..., size_bytes: _Optional[int] = ..., device: _Optional[int] = ..., timestamp_ns: _Optional[int] = ..., detail: _Optional[str] = ...) -> None: ...

class ProcessDepthState(_message.Message):
    __slots__ = ("pid", "depth", "since_ns", "cause", "detail", "until_ns", "sample_bytes")
    PID_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    SINCE_NS_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    UNTIL_NS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    pid: int
    depth: ProcessDepth
    since_ns: int
    cause: DepthCause
    detail: str
    until_ns: int
    sample_bytes: int
    def __init__(self, pid: _Optional[int] = ..., depth: _Optional[_Union[ProcessDepth, str]] = ..., since_ns: _Optional[int] = ..., cause: _Optional[_Union[DepthCause, str]] = ..., detail: _Optional[str] = ..., until_ns: _Optional[int] = ..., sample_bytes: _Optional[int] = ...) -> None: ...

class SetProcessDepthRequest(_message.Message):
    __slots__ = ("pid", "depth", "duration_seconds")
    PID_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    DURATION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    pid: int
    depth: ProcessDepth
    duration_seconds: float
    def __init__(self, pid: _Optional[int] = ..., depth: _Optional[_Union[ProcessDepth, str]] = ..., duration_seconds: _Optional[float] = ...) -> None: ...

class SetProcessDepthResponse(_message.Message):
    __slots__ = ("requested", "current")
    REQUESTED_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    requested: ProcessDepthState
    current: ProcessDepthState
    def __init__(self, requested: _Optional[_Union[ProcessDepthState, _Mapping]] = ..., current: _Optional[_Union[ProcessDepthState, _Mapping]] = ...) -> None: ...
