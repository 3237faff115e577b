from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Layer(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LAYER_UNSPECIFIED: _ClassVar[Layer]
    LAYER_RUNTIME: _ClassVar[Layer]
    LAYER_DRIVER: _ClassVar[Layer]
    LAYER_VMM: _ClassVar[Layer]
    LAYER_TORCH: _ClassVar[Layer]

class ObjectKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OBJECT_KIND_UNSPECIFIED: _ClassVar[ObjectKind]
    OBJECT_KIND_ALLOCATION: _ClassVar[ObjectKind]
    OBJECT_KIND_VMM_HANDLE: _ClassVar[ObjectKind]
    OBJECT_KIND_VMM_RESERVE: _ClassVar[ObjectKind]
    OBJECT_KIND_VMM_MAPPING: _ClassVar[ObjectKind]
    OBJECT_KIND_BLOCK: _ClassVar[ObjectKind]

class Memory(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMORY_UNSPECIFIED: _ClassVar[Memory]
    MEMORY_DEVICE: _ClassVar[Memory]
    MEMORY_HOST: _ClassVar[Memory]
    MEMORY_MANAGED: _ClassVar[Memory]
    MEMORY_NONE: _ClassVar[Memory]

class EventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVENT_KIND_UNSPECIFIED: _ClassVar[EventKind]
    EVENT_KIND_ALLOC: _ClassVar[EventKind]
    EVENT_KIND_FREE: _ClassVar[EventKind]
    EVENT_KIND_ALLOC_FAILED: _ClassVar[EventKind]
    EVENT_KIND_FREE_FAILED: _ClassVar[EventKind]
    EVENT_KIND_FREE_UNKNOWN: _ClassVar[EventKind]
    EVENT_KIND_MAP: _ClassVar[EventKind]
    EVENT_KIND_UNMAP: _ClassVar[EventKind]
    EVENT_KIND_RELEASE: _ClassVar[EventKind]
    EVENT_KIND_SET_DEVICE: _ClassVar[EventKind]
    EVENT_KIND_CONTEXT_DESTROY: _ClassVar[EventKind]
    EVENT_KIND_PROCESS_EXIT: _ClassVar[EventKind]

class Api(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    API_UNSPECIFIED: _ClassVar[Api]
    API_CUDA_MALLOC: _ClassVar[Api]
    API_CUDA_FREE: _ClassVar[Api]
    API_CUDA_MALLOC_ASYNC: _ClassVar[Api]
    API_CUDA_FREE_ASYNC: _ClassVar[Api]
    API_CUDA_MALLOC_MANAGED: _ClassVar[Api]
    API_CUDA_MALLOC_HOST: _ClassVar[Api]
    API_CUDA_HOST_ALLOC: _ClassVar[Api]
    API_CUDA_FREE_HOST: _ClassVar[Api]
    API_CUDA_MALLOC_PITCH: _ClassVar[Api]
    API_CUDA_SET_DEVICE: _ClassVar[Api]
    API_CU_MEM_ALLOC_V2: _ClassVar[Api]
    API_CU_MEM_FREE_V2: _ClassVar[Api]
    API_CU_MEM_ALLOC_ASYNC: _ClassVar[Api]
    API_CU_MEM_FREE_ASYNC: _ClassVar[Api]
    API_CU_MEM_ALLOC_MANAGED: _ClassVar[Api]
    API_CU_MEM_ALLOC_PITCH_V2: _ClassVar[Api]
    API_CU_MEM_ALLOC_HOST_V2: _ClassVar[Api]
    API_CU_MEM_HOST_ALLOC: _ClassVar[Api]
    API_CU_MEM_FREE_HOST: _ClassVar[Api]
    API_CU_CTX_SET_CURRENT: _ClassVar[Api]
    API_CU_CTX_DESTROY_V2: _ClassVar[Api]
    API_CU_DEVICE_PRIMARY_CTX_RETAIN: _ClassVar[Api]
    API_CU_CTX_CREATE_V2: _ClassVar[Api]
    API_CU_MEM_CREATE: _ClassVar[Api]
    API_CU_MEM_RELEASE: _ClassVar[Api]
    API_CU_MEM_MAP: _ClassVar[Api]
    API_CU_MEM_UNMAP: _ClassVar[Api]
    API_CU_MEM_ADDRESS_RESERVE: _ClassVar[Api]
    API_CU_MEM_ADDRESS_FREE: _ClassVar[Api]
    API_PROCESS_EXIT: _ClassVar[Api]
    API_PYTORCH_MALLOC: _ClassVar[Api]
    API_PYTORCH_FREE: _ClassVar[Api]

class EventSource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVENT_SOURCE_UNSPECIFIED: _ClassVar[EventSource]
    EVENT_SOURCE_UPROBE: _ClassVar[EventSource]
    EVENT_SOURCE_CUPTI: _ClassVar[EventSource]

class StackStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STACK_STATUS_UNSPECIFIED: _ClassVar[StackStatus]
    STACK_STATUS_OK: _ClassVar[StackStatus]
    STACK_STATUS_NOT_PYTHON: _ClassVar[StackStatus]
    STACK_STATUS_NO_THREAD_STATE: _ClassVar[StackStatus]
    STACK_STATUS_READ_ERROR: _ClassVar[StackStatus]
    STACK_STATUS_EMPTY: _ClassVar[StackStatus]
    STACK_STATUS_UNRESOLVED: _ClassVar[StackStatus]
    STACK_STATUS_NOT_SAMPLED: _ClassVar[StackStatus]
LAYER_UNSPECIFIED: Layer
LAYER_RUNTIME: Layer
LAYER_DRIVER: Layer
LAYER_VMM: Layer
LAYER_TORCH: Layer
OBJECT_KIND_UNSPECIFIED: ObjectKind
OBJECT_KIND_ALLOCATION: ObjectKind
OBJECT_KIND_VMM_HANDLE: ObjectKind
OBJECT_KIND_VMM_RESERVE: ObjectKind
OBJECT_KIND_VMM_MAPPING: ObjectKind
OBJECT_KIND_BLOCK: ObjectKind
MEMORY_UNSPECIFIED: Memory
MEMORY_DEVICE: Memory
MEMORY_HOST: Memory
MEMORY_MANAGED: Memory
MEMORY_NONE: Memory
EVENT_KIND_UNSPECIFIED: EventKind
EVENT_KIND_ALLOC: EventKind
EVENT_KIND_FREE: EventKind
EVENT_KIND_ALLOC_FAILED: EventKind
EVENT_KIND_FREE_FAILED: EventKind
EVENT_KIND_FREE_UNKNOWN: EventKind
EVENT_KIND_MAP: EventKind
EVENT_KIND_UNMAP: EventKind
EVENT_KIND_RELEASE: EventKind
EVENT_KIND_SET_DEVICE: EventKind
EVENT_KIND_CONTEXT_DESTROY: EventKind
EVENT_KIND_PROCESS_EXIT: EventKind
API_UNSPECIFIED: Api
API_CUDA_MALLOC: Api
API_CUDA_FREE: Api
API_CUDA_MALLOC_ASYNC: Api
API_CUDA_FREE_ASYNC: Api
API_CUDA_MALLOC_MANAGED: Api
API_CUDA_MALLOC_HOST: Api
API_CUDA_HOST_ALLOC: Api
API_CUDA_FREE_HOST: Api
API_CUDA_MALLOC_PITCH: Api
API_CUDA_SET_DEVICE: Api
API_CU_MEM_ALLOC_V2: Api
API_CU_MEM_FREE_V2: Api
API_CU_MEM_ALLOC_ASYNC: Api
API_CU_MEM_FREE_ASYNC: Api
API_CU_MEM_ALLOC_MANAGED: Api
API_CU_MEM_ALLOC_PITCH_V2: Api
API_CU_MEM_ALLOC_HOST_V2: Api
API_CU_MEM_HOST_ALLOC: Api
API_CU_MEM_FREE_HOST: Api
API_CU_CTX_SET_CURRENT: Api
API_CU_CTX_DESTROY_V2: Api
API_CU_DEVICE_PRIMARY_CTX_RETAIN: Api
API_CU_CTX_CREATE_V2: Api
API_CU_MEM_CREATE: Api
API_CU_MEM_RELEASE: Api
API_CU_MEM_MAP: Api
API_CU_MEM_UNMAP: Api
API_CU_MEM_ADDRESS_RESERVE: Api
API_CU_MEM_ADDRESS_FREE: Api
API_PROCESS_EXIT: Api
API_PYTORCH_MALLOC: Api
API_PYTORCH_FREE: Api
EVENT_SOURCE_UNSPECIFIED: EventSource
EVENT_SOURCE_UPROBE: EventSource
EVENT_SOURCE_CUPTI: EventSource
STACK_STATUS_UNSPECIFIED: StackStatus
STACK_STATUS_OK: StackStatus
STACK_STATUS_NOT_PYTHON: StackStatus
STACK_STATUS_NO_THREAD_STATE: StackStatus
STACK_STATUS_READ_ERROR: StackStatus
STACK_STATUS_EMPTY: StackStatus
STACK_STATUS_UNRESOLVED: StackStatus
STACK_STATUS_NOT_SAMPLED: StackStatus

class Event(_message.Message):
    __slots__ = ("timestamp_ns", "pid", "tid", "comm", "title", "container", "source", "allocation", "device_change", "context_destroy", "process_exit", "events_lost", "stack_definition")
    TIMESTAMP_NS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    TID_FIELD_NUMBER: _ClassVar[int]
    COMM_FIELD_NUMBER: _ClassVar[int]
    TITLE_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    ALLOCATION_FIELD_NUMBER: _ClassVar[int]
    DEVICE_CHANGE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_DESTROY_FIELD_NUMBER: _ClassVar[int]
    PROCESS_EXIT_FIELD_NUMBER: _ClassVar[int]
    EVENTS_LOST_FIELD_NUMBER: _ClassVar[int]
    STACK_DEFINITION_FIELD_NUMBER: _ClassVar[int]
    timestamp_ns: int
    pid: int
    tid: int
    comm: str
    title: str
    container: str
    source: EventSource
    allocation: Allocation
    device_change: DeviceChange
    context_destroy: ContextDestroy
    process_exit: ProcessExit
    events_lost: EventsLost
    stack_definition: Stack
    def __init__(self, timestamp_ns: _Optional[int] = ..., pid: _Optional[int] = ..., tid: _Optional[int] = ..., comm: _Optional[str] = ..., title: _Optional[str] = ..., container: _Optional[str] = ..., source: _Optional[_Union[EventSource, str]] = ..., allocation: _Optional[_Union[Allocation, _Mapping]] = ..., device_change: _Optional[_Union[DeviceChange, _Mapping]] = ..., context_destroy: _Optional[_Union[ContextDestroy, _Mapping]] = ..., process_exit: _Optional[_Union[ProcessExit, _Mapping]] = ..., events_lost: _Optional[_Union[EventsLost, _Mapping]] = ..., stack_definition: _Optional[_Union[Stack, _Mapping]] = ...) -> None: ...

class Allocation(_message.Message):
    __slots__ = ("kind", "api", "api_name", "layer", "object", "memory", "size_bytes", "address", "device", "error_code", "caller_address", "handle", "freed_bytes", "stack_id", "stack_status", "stack_status_code", "stream", "sample_bytes")
    KIND_FIELD_NUMBER: _ClassVar[int]
    API_FIELD_NUMBER: _ClassVar[int]
    API_NAME_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    OBJECT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    CALLER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    STACK_ID_FIELD_NUMBER: _ClassVar[int]
    STACK_STATUS_FIELD_NUMBER: _ClassVar[int]
    STACK_STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    kind: EventKind
    api: Api
    api_name: str
    layer: Layer
    object: ObjectKind
    memory: Memory
    size_bytes: int
    address: int
    device: int
    error_code: int
    caller_address: int
    handle: int
    freed_bytes: int
    stack_id: int
    stack_status: str
    stack_status_code: StackStatus
    stream: int
    sample_bytes: int
    def __init__(self, kind: _Optional[_Union[EventKind, str]] = ..., api: _Optional[_Union[Api, str]] = ..., api_name: _Optional[str] = ..., layer: _Optional[_Union[Layer, str]] = ..., object: _Optional[_Union[ObjectKind, str]] = ..., memory: _Optional[_Union[Memory, str]] = ..., size_bytes: _Optional[int] = ..., address: _Optional[int] = ..., device: _Optional[int] = ..., error_code: _Optional[int] = ..., caller_address: _Optional[int] = ..., handle: _Optional[int] = ..., freed_bytes: _Optional[int] = ..., stack_id: _Optional[int] = ..., stack_status: _Optional[str] = ..., stack_status_code: _Optional[_Union[StackStatus, str]] = ..., stream: _Optional[int] = ..., sample_bytes: _Optional[int] = ...) -> None: ...

class DeviceChange(_message.Message):
    __slots__ = ("api", "api_name", "layer", "device", "error_code", "context", "caller_address")
    API_FIELD_NUMBER: _ClassVar[int]
    API_NAME_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    CALLER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    api: Api
    api_name: str
    layer: Layer
    device: int
    error_code: int
    context: int
    caller_address: int
    def __init__(self, api: _Optional[_Union[Api, str]] = ..., api_name: _Optional[str] = ..., layer: _Optional[_Union[Layer, str]] = ..., device: _Optional[int] = ..., error_code: _Optional[int] = ..., context: _Optional[int] = ..., caller_address: _Optional[int] = ...) -> None: ...

class ContextDestroy(_message.Message):
    __slots__ = ("api", "api_name", "layer", "context", "device", "error_code", "caller_address")
    API_FIELD_NUMBER: _ClassVar[int]
    API_NAME_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    CALLER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    api: Api
    api_name: str
    layer: Layer
    context: int
    device: int
    error_code: int
    caller_address: int
    def __init__(self, api: _Optional[_Union[Api, str]] = ..., api_name: _Optional[str] = ..., layer: _Optional[_Union[Layer, str]] = ..., context: _Optional[int] = ..., device: _Optional[int] = ..., error_code: _Optional[int] = ..., caller_address: _Optional[int] = ...) -> None: ...

class ProcessExit(_message.Message):
    __slots__ = ("wait_status", "freed_bytes")
    WAIT_STATUS_FIELD_NUMBER: _ClassVar[int]
    FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    wait_status: int
    freed_bytes: int
    def __init__(self, wait_status: _Optional[int] = ..., freed_bytes: _Optional[int] = ...) -> None: ...

class EventsLost(_message.Message):
    __slots__ = ("dropped_count", "kernel_lost_count")
    DROPPED_COUNT_FIELD_NUMBER: _ClassVar[int]
    KERNEL_LOST_COUNT_FIELD_NUMBER: _ClassVar[int]
    dropped_count: int
    kernel_lost_count: int
    def __init__(self, dropped_count: _Optional[int] = ..., kernel_lost_count: _Optional[int] = ...) -> None: ...

class Stack(_message.Message):
    __slots__ = ("stack_id", "frames", "truncated")
    STACK_ID_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    stack_id: int
    frames: _containers.RepeatedCompositeFieldContainer[StackFrame]
    truncated: bool
    def __init__(self, stack_id: _Optional[int] = ..., frames: _Optional[_Iterable[_Union[StackFrame, _Mapping]]] = ..., truncated: bool = ...) -> None: ...

class StackFrame(_message.Message):
    __slots__ = ("function", "file", "line")
    FUNCTION_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    LINE_FIELD_NUMBER: _ClassVar[int]
    function: str
    file: str
    line: int
    def __init__(self, function: _Optional[str] = ..., file: _Optional[str] = ..., line: _Optional[int] = ...) -> None: ...

class EventColumns(_message.Message):
    __slots__ = ("kind", "timestamp_ns", "pid", "tid", "process", "api", "layer", "object", "memory", "size_bytes", "address", "device", "error_code", "caller_address", "handle", "freed_bytes", "stack_id", "stack_status", "stream", "source", "processes", "sample_bytes")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_NS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    TID_FIELD_NUMBER: _ClassVar[int]
    PROCESS_FIELD_NUMBER: _ClassVar[int]
    API_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    OBJECT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    CALLER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    STACK_ID_FIELD_NUMBER: _ClassVar[int]
    STACK_STATUS_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    kind: _containers.RepeatedScalarFieldContainer[EventKind]
    timestamp_ns: _containers.RepeatedScalarFieldContainer[int]
    pid: _containers.RepeatedScalarFieldContainer[int]
    tid: _containers.RepeatedScalarFieldContainer[int]
    process: _containers.RepeatedScalarFieldContainer[int]
    api: _containers.RepeatedScalarFieldContainer[Api]
    layer: _containers.RepeatedScalarFieldContainer[Layer]
    object: _containers.RepeatedScalarFieldContainer[ObjectKind]
    memory: _containers.RepeatedScalarFieldContainer[Memory]
    size_bytes: _containers.RepeatedScalarFieldContainer[int]
    address: _containers.RepeatedScalarFieldContainer[int]
    device: _containers.RepeatedScalarFieldContainer[int]
    error_code: _containers.RepeatedScalarFieldContainer[int]
    caller_address: _containers.RepeatedScalarFieldContainer[int]
    handle: _containers.RepeatedScalarFieldContainer[int]
    freed_bytes: _containers.RepeatedScalarFieldContainer[int]
    stack_id: _containers.RepeatedScalarFieldContainer[int]
    stack_status: _containers.RepeatedScalarFieldContainer[StackStatus]
    stream: _containers.RepeatedScalarFieldContainer[int]
    source: _containers.RepeatedScalarFieldContainer[EventSource]
    processes: _containers.RepeatedCompositeFieldContainer[ProcessLabel]
    sample_bytes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, kind: _Optional[_Iterable[_Union[EventKind, str]]] = ..., timestamp_ns: _Optional[_Iterable[int]] = ..., pid: _Optional[_Iterable[int]] = ..., tid: _Optional[_Iterable[int]] = ..., process: _Optional[_Iterable[int]] = ..., api: _Optional[_Iterable[_Union[Api, str]]] = ..., layer: _Optional[_Iterable[_Union[Layer, str]]] = ..., object: _Optional[_Iterable[_Union[ObjectKind, str]]] = ..., memory: _Optional[_Iterable[_Union[Memory, str]]] = ..., size_bytes: _Optional[_Iterable[int]] = ..., address: _Optional[_Iterable[int]] = ..., device: _Optional[_Iterable[int]] = ..., error_code: _Optional[_Iterable[int]] = ..., caller_address: _Optional[_Iterable[int]] = ..., handle: _Optional[_Iterable[int]] = ..., freed_bytes: _Optional[_Iterable[int]] = ..., stack_id: _Optional[_Iterable[int]] = ..., stack_status: _Optional[_Iterable[_Union[StackStatus, str]]] = ..., stream: _Optional[_Iterable[int]] = ..., source: _Optional[_Iterable[_Union[EventSource, str]]] = ..., processes: _Optional[_Iterable[_Union[ProcessLabel, _Mapping]]] = ..., sample_bytes: _Optional[_Iterable[int]] = ...) -> None: ...

class ProcessLabel(_message.Message):
    __slots__ = ("comm", "title", "container", "pid")
    COMM_FIELD_NUMBER: _ClassVar[int]
    TITLE_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    comm: str
    title: str
    container: str
    pid: int
    def __init__(self, comm: _Optional[str] = ..., title: _Optional[str] = ..., container: _Optional[str] = ..., pid: _Optional[int] = ...) -> None: ...

class FixedEventColumns(_message.Message):
    __slots__ = ("timestamp_offset_ns", "timestamp_ns", "pid", "tid", "size_bytes", "address", "caller_address", "aux", "device", "error_code", "api", "kind", "layer", "object", "memory", "stack_status", "comm", "processes", "sampling", "block_sample_bytes")
    TIMESTAMP_OFFSET_NS_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_NS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    TID_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CALLER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    AUX_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    API_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    OBJECT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    STACK_STATUS_FIELD_NUMBER: _ClassVar[int]
    COMM_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SAMPLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    timestamp_offset_ns: int
    timestamp_ns: _containers.RepeatedScalarFieldContainer[int]
    pid: _containers.RepeatedScalarFieldContainer[int]
    tid: _containers.RepeatedScalarFieldContainer[int]
    size_bytes: _containers.RepeatedScalarFieldContainer[int]
    address: _containers.RepeatedScalarFieldContainer[int]
    caller_address: _containers.RepeatedScalarFieldContainer[int]
    aux: _containers.RepeatedScalarFieldContainer[int]
    device: _containers.RepeatedScalarFieldContainer[int]
    error_code: _containers.RepeatedScalarFieldContainer[int]
    api: bytes
    kind: bytes
    layer: bytes
    object: bytes
    memory: bytes
    stack_status: bytes
    comm: bytes
    processes: _containers.RepeatedCompositeFieldContainer[ProcessLabel]
    sampling: bytes
    block_sample_bytes: int
    def __init__(self, timestamp_offset_ns: _Optional[int] = ..., timestamp_ns: _Optional[_Iterable[int]] = ..., pid: _Optional[_Iterable[int]] = ..., tid: _Optional[_Iterable[int]] = ..., size_bytes: _Optional[_Iterable[int]] = ..., address: _Optional[_Iterable[int]] = ..., caller_address: _Optional[_Iterable[int]] = ..., aux: _Optional[_Iterable[int]] = ..., device: _Optional[_Iterable[int]] = ..., error_code: _Optional[_Iterable[int]] = ..., api: _Optional[bytes] = ..., kind: _Optional[bytes] = ..., layer: _Optional[bytes] = ..., object: _Optional[bytes] = ..., memory: _Optional[bytes] = ..., stack_status: _Optional[bytes] = ..., comm: _Optional[bytes] = ..., processes: _Optional[_Iterable[_Union[ProcessLabel, _Mapping]]] = ..., sampling: _Optional[bytes] = ..., block_sample_bytes: _Optional[int] = ...) -> None: ...
