"""A faithful fake of cupti-python 13.0's `cupti.cupti` module, for the tests of kvtrace's in-process CUPTI
tracer (agent/kvtrace/sources/cupti/tracer.py) on machines without a GPU.

What is the real module's: the names, the enum values (read from cupti-python 13.0.1), the call shapes
(`subscribe_v2(callback, userdata, params_pointer)`, `enable_callback(enable, subscriber, domain, cbid)`,
`activity_register_callbacks(requested, completed)`, `cuptiError(status)` with `.status`), the callback's
arguments `(userdata, domain, cbid, callback_data)` where `callback_data.ptr` is the address of a real
CUpti_CallbackData struct whose functionParams point at the driver function's real params struct, and the
activity objects' attribute names (ActivityMemory4, ActivityMemoryPool3: `size_`, sic). Like CUPTI 13.0,
one subscriber at a time.

What stands in for the GPU: the `fake_*` functions. `fake_driver_call(name, ...)` is a driver call made on
the calling thread: the ENTER and EXIT callbacks fire for an enabled cbid (the out-pointers written and
the CUresult set before EXIT, as the driver does), then the MEMORY2 record CUPTI would write is queued:
allocations -> ALLOCATION with the call's correlation id, frees -> RELEASE, cuMemMap -> ALLOCATION of the
mapped range, cuMemUnmap -> RELEASE of it, cuMemCreate/Release/AddressReserve/AddressFree -> none, a
failed call -> none. Records reach the registered buffer_completed on activity_flush_all. Exceptions a
callback raises are kept (fake_callback_exceptions()) and not propagated, as a C library cannot.

FAKE_CUPTI_HOLDER=<name> in the environment makes subscribe_v2 fail as when another tool holds CUPTI
(ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED, with <name> written to the old-subscriber-name buffer).
"""
from __future__ import annotations

import ctypes
import enum
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

OLD_SUBSCRIBER_NAME_MIN_LEN = 64
SUBSCRIBER_NAME_MAX_LEN = 53
HOLDER_ENV = "FAKE_CUPTI_HOLDER"


class ActivityKind(enum.IntEnum):
    INVALID = 0
    MEMCPY = 1
    MEMSET = 2
    KERNEL = 3
    DRIVER = 4
    RUNTIME = 5
    CONCURRENT_KERNEL = 10
    MEMORY = 45
    MEMORY2 = 49
    MEMORY_POOL = 50


class ActivityMemoryKind(enum.IntEnum):
    UNKNOWN = 0
    PAGEABLE = 1
    PINNED = 2
    DEVICE = 3
    ARRAY = 4
    MANAGED = 5
    DEVICE_STATIC = 6
    MANAGED_STATIC = 7


class ActivityMemoryOperationType(enum.IntEnum):
    INVALID = 0
    ALLOCATION = 1
    RELEASE = 2


class ActivityMemoryPoolOperationType(enum.IntEnum):
    INVALID = 0
    CREATED = 1
    DESTROYED = 2
    TRIMMED = 3


class ActivityMemoryPoolType(enum.IntEnum):
    INVALID = 0
    LOCAL = 1
    IMPORTED = 2


class CallbackDomain(enum.IntEnum):
    INVALID = 0
    DRIVER_API = 1
    RUNTIME_API = 2
    RESOURCE = 3
    SYNCHRONIZE = 4
    NVTX = 5
    STATE = 6
    SIZE = 7


class ApiCallbackSite(enum.IntEnum):
    API_ENTER = 0
    API_EXIT = 1


class driver_api_trace_cbid(enum.IntEnum):  # (sic) the real module's name
    cuMemHostAlloc = 39
    cuMemAlloc_v2 = 243
    cuMemAllocPitch_v2 = 244
    cuMemFree_v2 = 245
    cuMemAllocHost_v2 = 294
    cuMemFreeHost = 113
    cuMemAllocManaged = 371
    cuMemAddressReserve = 547
    cuMemAddressFree = 548
    cuMemCreate = 549
    cuMemRelease = 550
    cuMemMap = 551
    cuMemUnmap = 552
    cuMemAllocAsync = 598
    cuMemAllocAsync_ptsz = 599
    cuMemFreeAsync = 596
    cuMemAllocFromPoolAsync = 611
    cuMemAllocFromPoolAsync_ptsz = 612


class Result(enum.IntEnum):
    SUCCESS = 0
    ERROR_INVALID_PARAMETER = 1
    ERROR_INVALID_DEVICE = 2
    ERROR_INVALID_CONTEXT = 3
    ERROR_INVALID_OPERATION = 7
    ERROR_OUT_OF_MEMORY = 8
    ERROR_NOT_INITIALIZED = 15
    ERROR_INVALID_KIND = 21
    ERROR_NOT_SUPPORTED = 27
    ERROR_INSUFFICIENT_PRIVILEGES = 35
    ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED = 39
    ERROR_UNKNOWN = 999


class cuptiError(Exception):  # (sic) the real module's name
    def __init__(self, status: int) -> None:
        self.status = status
        try:
            name = Result(status).name
        except ValueError:
            name = "UNKNOWN"
        super().__init__(f"{name} ({status})")


# ---- C structs, as CUPTI and the driver lay them out on x86_64 ----


class _SubscriberParamsStruct(ctypes.Structure):
    _fields_ = [("structSize", ctypes.c_size_t), ("subscriberName", ctypes.c_char_p),
                ("oldSubscriberName", ctypes.c_void_p), ("oldSubscriberSize", ctypes.c_size_t)]


SUBSCRIBER_PARAMS_SIZE = ctypes.sizeof(_SubscriberParamsStruct)  # 32, as in 13.0


class _CallbackDataStruct(ctypes.Structure):
    """CUpti_CallbackData."""

    _fields_ = [("callbackSite", ctypes.c_uint32), ("functionName", ctypes.c_char_p),
                ("functionParams", ctypes.c_void_p), ("functionReturnValue", ctypes.c_void_p),
                ("symbolName", ctypes.c_char_p), ("context", ctypes.c_void_p), ("contextUid", ctypes.c_uint32),
                ("correlationData", ctypes.c_void_p), ("correlationId", ctypes.c_uint32)]


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemAllocationProp(ctypes.Structure):
    """CUmemAllocationProp."""

    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _MemLocation),
                ("win32HandleMetaData", ctypes.c_void_p), ("compressionType", ctypes.c_ubyte),
                ("gpuDirectRDMACapable", ctypes.c_ubyte), ("usage", ctypes.c_ushort),
                ("reserved", ctypes.c_ubyte * 4)]


CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_LOCATION_TYPE_HOST = 2

_P = ctypes.c_void_p
_SIZE = ctypes.c_size_t
_U64 = ctypes.c_uint64


def _params_struct(name: str, fields: list[tuple[str, Any]]) -> type[ctypes.Structure]:
    return type(f"{name}_params", (ctypes.Structure,), {"_fields_": fields})


# The driver's <name>_params structs (cupti's generated_cuda_meta.h).
PARAMS: dict[str, type[ctypes.Structure]] = {
    "cuMemAlloc_v2": _params_struct("cuMemAlloc_v2", [("dptr", _P), ("bytesize", _SIZE)]),
    "cuMemAllocPitch_v2": _params_struct("cuMemAllocPitch_v2", [
        ("dptr", _P), ("pPitch", _P), ("WidthInBytes", _SIZE), ("Height", _SIZE), ("ElementSizeBytes", ctypes.c_uint)]),
    "cuMemAllocManaged": _params_struct("cuMemAllocManaged", [
        ("dptr", _P), ("bytesize", _SIZE), ("flags", ctypes.c_uint)]),
    "cuMemAllocHost_v2": _params_struct("cuMemAllocHost_v2", [("pp", _P), ("bytesize", _SIZE)]),
    "cuMemHostAlloc": _params_struct("cuMemHostAlloc", [("pp", _P), ("bytesize", _SIZE), ("Flags", ctypes.c_uint)]),
    "cuMemAllocAsync": _params_struct("cuMemAllocAsync", [("dptr", _P), ("bytesize", _SIZE), ("hStream", _P)]),
    "cuMemAllocAsync_ptsz": _params_struct("cuMemAllocAsync_ptsz", [
        ("dptr", _P), ("bytesize", _SIZE), ("hStream", _P)]),
    "cuMemAllocFromPoolAsync": _params_struct("cuMemAllocFromPoolAsync", [
        ("dptr", _P), ("bytesize", _SIZE), ("pool", _P), ("hStream", _P)]),
    "cuMemAllocFromPoolAsync_ptsz": _params_struct("cuMemAllocFromPoolAsync_ptsz", [
        ("dptr", _P), ("bytesize", _SIZE), ("pool", _P), ("hStream", _P)]),
    "cuMemFree_v2": _params_struct("cuMemFree_v2", [("dptr", _U64)]),
    "cuMemFreeHost": _params_struct("cuMemFreeHost", [("p", _P)]),
    "cuMemFreeAsync": _params_struct("cuMemFreeAsync", [("dptr", _U64), ("hStream", _P)]),
    "cuMemCreate": _params_struct("cuMemCreate", [
        ("handle", _P), ("size", _SIZE), ("prop", _P), ("flags", ctypes.c_ulonglong)]),
    "cuMemRelease": _params_struct("cuMemRelease", [("handle", ctypes.c_ulonglong)]),
    "cuMemMap": _params_struct("cuMemMap", [
        ("ptr", _U64), ("size", _SIZE), ("offset", _SIZE), ("handle", ctypes.c_ulonglong),
        ("flags", ctypes.c_ulonglong)]),
    "cuMemUnmap": _params_struct("cuMemUnmap", [("ptr", _U64), ("size", _SIZE)]),
    "cuMemAddressReserve": _params_struct("cuMemAddressReserve", [
        ("ptr", _P), ("size", _SIZE), ("alignment", _SIZE), ("addr", _U64), ("flags", ctypes.c_ulonglong)]),
    "cuMemAddressFree": _params_struct("cuMemAddressFree", [("ptr", _U64), ("size", _SIZE)]),
}

# Where each function returns what it made (an out-pointer in its params), and what memory it is.
_OUT_FIELD = {"cuMemAlloc_v2": "dptr", "cuMemAllocPitch_v2": "dptr", "cuMemAllocManaged": "dptr",
              "cuMemAllocHost_v2": "pp", "cuMemHostAlloc": "pp", "cuMemAllocAsync": "dptr",
              "cuMemAllocAsync_ptsz": "dptr", "cuMemAllocFromPoolAsync": "dptr",
              "cuMemAllocFromPoolAsync_ptsz": "dptr", "cuMemCreate": "handle", "cuMemAddressReserve": "ptr"}
_ALLOCATION_KIND = {"cuMemAlloc_v2": ActivityMemoryKind.DEVICE, "cuMemAllocPitch_v2": ActivityMemoryKind.DEVICE,
                    "cuMemAllocManaged": ActivityMemoryKind.MANAGED, "cuMemAllocHost_v2": ActivityMemoryKind.PINNED,
                    "cuMemHostAlloc": ActivityMemoryKind.PINNED, "cuMemAllocAsync": ActivityMemoryKind.DEVICE,
                    "cuMemAllocAsync_ptsz": ActivityMemoryKind.DEVICE,
                    "cuMemAllocFromPoolAsync": ActivityMemoryKind.DEVICE,
                    "cuMemAllocFromPoolAsync_ptsz": ActivityMemoryKind.DEVICE}
_FREE_ADDRESS_FIELD = {"cuMemFree_v2": "dptr", "cuMemFreeHost": "p", "cuMemFreeAsync": "dptr"}
PITCH_ALIGNMENT_BYTES = 512


# ---- the wrapper objects ----


class SubscriberParams:
    """CUpti_SubscriberParams with the old-subscriber-name buffer the binding provides."""

    def __init__(self) -> None:
        self._struct = _SubscriberParamsStruct()
        self._old_name = ctypes.create_string_buffer(OLD_SUBSCRIBER_NAME_MIN_LEN)
        self._name = b""
        self._struct.oldSubscriberName = ctypes.addressof(self._old_name)
        self._struct.oldSubscriberSize = OLD_SUBSCRIBER_NAME_MIN_LEN

    @property
    def ptr(self) -> int:
        return ctypes.addressof(self._struct)

    @property
    def struct_size(self) -> int:
        return int(self._struct.structSize)

    @struct_size.setter
    def struct_size(self, value: int) -> None:
        self._struct.structSize = value

    @property
    def subscriber_name(self) -> str:
        return self._name.decode()

    @subscriber_name.setter
    def subscriber_name(self, value: str) -> None:
        self._name = value.encode()
        self._struct.subscriberName = self._name

    @property
    def old_subscriber_name(self) -> str | None:
        return self._old_name.value.decode() or None


class CallbackData:
    """The binding's view of a CUpti_CallbackData: `.ptr` is the struct's address, the rest read from it."""

    def __init__(self, struct: _CallbackDataStruct) -> None:
        self._struct = struct

    @property
    def ptr(self) -> int:
        return ctypes.addressof(self._struct)

    @property
    def callback_site(self) -> int:
        return int(self._struct.callbackSite)

    @property
    def function_name(self) -> str:
        return (self._struct.functionName or b"").decode()

    @property
    def correlation_id(self) -> int:
        return int(self._struct.correlationId)

    @property
    def context(self) -> int:
        return int(self._struct.context or 0)

    @property
    def context_uid(self) -> int:
        return int(self._struct.contextUid)

    @property
    def symbol_name(self) -> str:
        return (self._struct.symbolName or b"").decode()

    @property
    def function_return_value(self) -> int:
        return int(self._struct.functionReturnValue or 0)


@dataclass
class ActivityMemory4:
    kind: int
    memory_operation_type: int
    memory_kind: int
    correlation_id: int
    address: int
    bytes: int
    timestamp: int
    device_id: int
    context_id: int = 1
    stream_id: int = 0
    process_id: int = 0
    is_async: int = 0
    pc: int = 0
    name: str = ""
    source: str = ""


@dataclass
class ActivityMemoryPool3:
    kind: int
    memory_pool_operation_type: int
    memory_pool_type: int
    correlation_id: int
    address: int
    size_: int  # sic: the binding's name
    utilized_size: int
    timestamp: int
    device_id: int
    release_threshold: int = 0
    min_bytes_to_keep: int = 0
    is_managed_pool: int = 0
    process_id: int = 0


# ---- the fake CUPTI and driver ----


@dataclass
class _State:
    api_calls: list[str] = field(default_factory=list)  # cupti functions called, in order
    subscriber: int | None = None
    subscriber_name: str = ""
    callback: Callable[..., Any] | None = None
    userdata: Any = None
    enabled_callbacks: set[tuple[int, int]] = field(default_factory=set)
    enabled_activities: set[int] = field(default_factory=set)
    buffer_requested: Callable[..., Any] | None = None
    buffer_completed: Callable[..., Any] | None = None
    records: list[Any] = field(default_factory=list)  # written by "the driver", not yet flushed
    callback_exceptions: list[BaseException] = field(default_factory=list)
    next_handle: int = 0x1000
    next_correlation_id: int = 1
    next_device_address: int = 0x7F00_0000_0000
    next_host_address: int = 0x7E00_0000_0000
    next_va: int = 0x7D00_0000_0000
    next_memory_handle: int = 1
    allocations: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # address -> bytes, kind, device
    memory_handles: dict[int, tuple[int, int]] = field(default_factory=dict)  # handle -> bytes, device
    subscribe_error: int | None = None  # a status subscribe_v2 fails with (besides FAKE_CUPTI_HOLDER)


_LOCK = threading.RLock()
_STATE = _State()


def _called(name: str) -> None:
    _STATE.api_calls.append(name)


def subscribe_v2(callback: Callable[..., Any], userdata: Any, p_params: int) -> int:
    _called("subscribe_v2")
    params = _SubscriberParamsStruct.from_address(p_params) if p_params else None
    if params is not None and params.structSize != SUBSCRIBER_PARAMS_SIZE:
        raise cuptiError(Result.ERROR_INVALID_PARAMETER)
    holder = os.environ.get(HOLDER_ENV) or (f"CUPTI for {_STATE.subscriber_name}" if _STATE.subscriber else "")
    if holder:
        if params is not None and params.oldSubscriberName:
            encoded = holder.encode()[:max(int(params.oldSubscriberSize) - 1, 0)]
            ctypes.memmove(params.oldSubscriberName, encoded + b"\0", len(encoded) + 1)
        raise cuptiError(Result.ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED)
    if _STATE.subscribe_error is not None:
        raise cuptiError(_STATE.subscribe_error)
    with _LOCK:
        _STATE.subscriber = _STATE.next_handle
        _STATE.next_handle += 1
        _STATE.subscriber_name = (params.subscriberName or b"").decode() if params is not None else ""
        _STATE.callback = callback
        _STATE.userdata = userdata
        return _STATE.subscriber


def subscribe(callback: Callable[..., Any], userdata: Any) -> int:
    return subscribe_v2(callback, userdata, 0)


def unsubscribe(subscriber: int) -> None:
    _called("unsubscribe")
    _check_subscriber(subscriber)
    with _LOCK:
        _STATE.subscriber = None
        _STATE.callback = None
        _STATE.enabled_callbacks.clear()


def _check_subscriber(subscriber: int) -> None:
    if _STATE.subscriber is None or subscriber != _STATE.subscriber:
        raise cuptiError(Result.ERROR_INVALID_PARAMETER)


def enable_callback(enable: int, subscriber: int, domain: int, cbid: int) -> None:
    _called("enable_callback")
    _check_subscriber(subscriber)
    key = (int(domain), int(cbid))
    if enable:
        _STATE.enabled_callbacks.add(key)
    else:
        _STATE.enabled_callbacks.discard(key)


def enable_domain(enable: int, subscriber: int, domain: int) -> None:
    _called("enable_domain")
    _check_subscriber(subscriber)
    if int(domain) == CallbackDomain.DRIVER_API:
        for cbid in driver_api_trace_cbid:
            key = (int(domain), int(cbid))
            if enable:
                _STATE.enabled_callbacks.add(key)
            else:
                _STATE.enabled_callbacks.discard(key)


def activity_enable(kind: int) -> None:
    _called("activity_enable")
    if int(kind) not in {int(member) for member in ActivityKind}:
        raise cuptiError(Result.ERROR_INVALID_KIND)
    _STATE.enabled_activities.add(int(kind))


def activity_disable(kind: int) -> None:
    _called("activity_disable")
    _STATE.enabled_activities.discard(int(kind))


def activity_register_callbacks(func_buffer_requested: Callable[..., Any],
                                func_buffer_completed: Callable[..., Any]) -> None:
    _called("activity_register_callbacks")
    _STATE.buffer_requested = func_buffer_requested
    _STATE.buffer_completed = func_buffer_completed


def activity_flush_period(time: int) -> None:  # the real parameter's name
    _called("activity_flush_period")


def activity_flush_all(flag: int) -> None:
    """Hands every record written so far to buffer_completed (on this thread), in one buffer."""
    _called("activity_flush_all")
    with _LOCK:
        records, _STATE.records = _STATE.records, []
    if not records or _STATE.buffer_completed is None or _STATE.buffer_requested is None:
        return
    size_bytes, max_records = _STATE.buffer_requested()
    if not isinstance(size_bytes, int) or size_bytes <= 0 or not isinstance(max_records, int):
        raise cuptiError(Result.ERROR_INVALID_PARAMETER)
    try:
        _STATE.buffer_completed(records)
    except BaseException as error:  # a C library cannot propagate it: kept for the tests to see
        _STATE.callback_exceptions.append(error)


def get_timestamp() -> int:
    return time.time_ns()


def finalize() -> None:
    _called("finalize")
    with _LOCK:
        _STATE.enabled_activities.clear()
        _STATE.buffer_requested = None
        _STATE.buffer_completed = None


def get_callback_name(domain: int, cbid: int) -> str:
    return driver_api_trace_cbid(cbid).name


# ---- the test driver ----


def fake_reset() -> None:
    """A process where CUPTI was never touched."""
    global _STATE
    _STATE = _State()


def fake_api_calls() -> list[str]:
    return list(_STATE.api_calls)


def fake_subscriber() -> int | None:
    return _STATE.subscriber


def fake_enabled_callbacks() -> set[tuple[int, int]]:
    return set(_STATE.enabled_callbacks)


def fake_enabled_activities() -> set[int]:
    return set(_STATE.enabled_activities)


def fake_callback_exceptions() -> list[BaseException]:
    return list(_STATE.callback_exceptions)


def fake_set_subscribe_error(status: int | None) -> None:
    _STATE.subscribe_error = status


def fake_driver_call(name: str, result: int = 0, device: int = 0, **fields: int) -> int:
    """Driver function `name` called on this thread with the params `fields` (out-pointers are made
    here) returning CUresult `result`: the callbacks fire, and on success the memory record is queued.
    Returns what the call made (address, VA or handle; 0 when it failed or makes nothing)."""
    params = PARAMS[name]()
    keep: list[Any] = []  # what the params point at lives until the call returns
    for key, value in fields.items():
        setattr(params, key, value)
    out = _U64(0)
    if name in _OUT_FIELD:
        setattr(params, _OUT_FIELD[name], ctypes.addressof(out))
    pitch = _U64(0)
    if name == "cuMemAllocPitch_v2":
        params.pPitch = ctypes.addressof(pitch)
    if name == "cuMemCreate" and not fields.get("prop"):
        prop = _MemAllocationProp(type=1, location=_MemLocation(CU_MEM_LOCATION_TYPE_DEVICE, device))
        keep.append(prop)
        params.prop = ctypes.addressof(prop)
    with _LOCK:
        correlation_id = _STATE.next_correlation_id
        _STATE.next_correlation_id += 1
    return_value = ctypes.c_int32(0)
    data = _CallbackDataStruct(functionName=name.encode(), functionParams=ctypes.addressof(params),
                               functionReturnValue=ctypes.addressof(return_value), context=0x5555_0000,
                               contextUid=1, correlationId=correlation_id)
    _fire(name, data, ApiCallbackSite.API_ENTER)
    made = _perform(name, params, result, device, correlation_id, out, pitch) if result == 0 else 0
    return_value.value = result
    _fire(name, data, ApiCallbackSite.API_EXIT)
    return made


def _fire(name: str, data: _CallbackDataStruct, site: ApiCallbackSite) -> None:
    callback = _STATE.callback
    cbid = int(driver_api_trace_cbid[name])
    if callback is None or (CallbackDomain.DRIVER_API, cbid) not in _STATE.enabled_callbacks:
        return
    data.callbackSite = site
    try:
        callback(_STATE.userdata, CallbackDomain.DRIVER_API, cbid, CallbackData(data))
    except BaseException as error:  # a C library cannot propagate it: kept for the tests to see
        _STATE.callback_exceptions.append(error)


def _perform(name: str, params: Any, result: int, device: int, correlation_id: int, out: Any, pitch: Any) -> int:
    """What the driver does for a successful call: writes the out-pointers, queues the record."""
    if name in _ALLOCATION_KIND:
        kind = _ALLOCATION_KIND[name]
        if name == "cuMemAllocPitch_v2":
            pitch.value = -(-params.WidthInBytes // PITCH_ALIGNMENT_BYTES) * PITCH_ALIGNMENT_BYTES
            size_bytes = pitch.value * params.Height
        else:
            size_bytes = params.bytesize
        address = _next_address(kind, size_bytes)
        out.value = address
        _STATE.allocations[address] = (size_bytes, kind, device)
        _record(ActivityMemoryOperationType.ALLOCATION, kind, correlation_id, address, size_bytes, device,
                is_async=int("Async" in name))
        return address
    if name in _FREE_ADDRESS_FIELD:
        address = int(getattr(params, _FREE_ADDRESS_FIELD[name]) or 0)
        size_bytes, kind, owner = _STATE.allocations.pop(address)
        _record(ActivityMemoryOperationType.RELEASE, kind, correlation_id, address, size_bytes, owner,
                is_async=int(name == "cuMemFreeAsync"))
        return 0
    if name == "cuMemCreate":
        handle = _STATE.next_memory_handle
        _STATE.next_memory_handle += 1
        prop = _MemAllocationProp.from_address(params.prop)
        _STATE.memory_handles[handle] = (params.size, prop.location.id)
        out.value = handle
        return handle
    if name == "cuMemAddressReserve":
        address = _STATE.next_va
        _STATE.next_va += params.size
        out.value = address
        return address
    if name == "cuMemMap":
        _size, owner = _STATE.memory_handles[params.handle]
        _STATE.allocations[params.ptr] = (params.size, ActivityMemoryKind.DEVICE, owner)
        _record(ActivityMemoryOperationType.ALLOCATION, ActivityMemoryKind.DEVICE, correlation_id, params.ptr,
                params.size, owner)
        return 0
    if name == "cuMemUnmap":
        size_bytes, kind, owner = _STATE.allocations.pop(params.ptr)
        _record(ActivityMemoryOperationType.RELEASE, kind, correlation_id, params.ptr, size_bytes, owner)
        return 0
    if name == "cuMemRelease":
        _STATE.memory_handles.pop(params.handle)
    return 0  # cuMemRelease, cuMemAddressFree: no record


def _next_address(kind: int, size_bytes: int) -> int:
    step = max(-(-size_bytes // (2 << 20)) * (2 << 20), 2 << 20)
    if kind == ActivityMemoryKind.PINNED:
        address, _STATE.next_host_address = _STATE.next_host_address, _STATE.next_host_address + step
    else:
        address, _STATE.next_device_address = _STATE.next_device_address, _STATE.next_device_address + step
    return address


def _record(operation: int, kind: int, correlation_id: int, address: int, size_bytes: int, device: int,
            is_async: int = 0) -> None:
    if ActivityKind.MEMORY2 not in _STATE.enabled_activities:
        return
    with _LOCK:
        _STATE.records.append(ActivityMemory4(
            kind=ActivityKind.MEMORY2, memory_operation_type=operation, memory_kind=kind,
            correlation_id=correlation_id, address=address, bytes=size_bytes, timestamp=time.time_ns(),
            device_id=device, is_async=is_async, process_id=os.getpid()))


# Shorthands for the tests' workloads.


def fake_mem_alloc(size_bytes: int, result: int = 0, device: int = 0) -> int:
    return fake_driver_call("cuMemAlloc_v2", result=result, device=device, bytesize=size_bytes)


def fake_free(address: int) -> None:
    """cuMemFree_v2 of an allocation: its RELEASE record (kvtrace enables no callback for frees)."""
    fake_driver_call("cuMemFree_v2", dptr=address)


def fake_static_memory(address: int, size_bytes: int, device: int = 0) -> None:
    """A module's static device memory, as CUPTI reports it at module load: DEVICE_STATIC, correlation 0."""
    _record(ActivityMemoryOperationType.ALLOCATION, ActivityMemoryKind.DEVICE_STATIC, 0, address, size_bytes, device)


def fake_pool_record(operation: int, address: int, size_bytes: int, utilized_bytes: int, device: int = 0,
                     pool_type: int = ActivityMemoryPoolType.LOCAL) -> None:
    if ActivityKind.MEMORY_POOL not in _STATE.enabled_activities:
        return
    with _LOCK:
        _STATE.records.append(ActivityMemoryPool3(
            kind=ActivityKind.MEMORY_POOL, memory_pool_operation_type=operation, memory_pool_type=pool_type,
            correlation_id=0, address=address, size_=size_bytes, utilized_size=utilized_bytes,
            timestamp=time.time_ns(), device_id=device, process_id=os.getpid()))
