"""Ledger semantics on synthetic events: layers, VMM lifecycle, implicit and unknown frees."""
from kvtrace.model.events import Api, Event, Kind, Layer, Memory, ObjectKind
from kvtrace.model.ledger import Ledger, LedgerKey
from kvtrace.wire import event_to_json

MiB = 1 << 20
PID = 100


def ev(kind, api, layer, address=0, size=0, pid=PID, ts=0, device=0, obj=ObjectKind.ALLOCATION,
       memory=Memory.DEVICE, handle=0, error=0):
    return Event(kind=kind, api=api, pid=pid, tid=pid, timestamp_ns=ts, layer=layer, object=obj,
                 memory=memory, size_bytes=size, address=address, device=device, error_code=error,
                 handle=handle)


def malloc(ledger, address, size, ts=0, pid=PID, device=0):
    """cudaMalloc as the probes see it: the runtime call and the driver call inside it."""
    ledger.apply(ev(Kind.ALLOC, Api.cuMemAlloc_v2, Layer.DRIVER, address, size, pid, ts, device))
    ledger.apply(ev(Kind.ALLOC, Api.cudaMalloc, Layer.RUNTIME, address, size, pid, ts, device))


def free(ledger, address, ts=0, pid=PID):
    ledger.apply(ev(Kind.FREE, Api.cuMemFree_v2, Layer.DRIVER, address, pid=pid, ts=ts))
    ledger.apply(ev(Kind.FREE, Api.cudaFree, Layer.RUNTIME, address, pid=pid, ts=ts))


def test_runtime_over_driver_is_not_counted_twice():
    ledger = Ledger()
    for i in range(23):
        malloc(ledger, 0x1000 + i * MiB, MiB)
    for i in range(19):
        free(ledger, 0x1000 + i * MiB)
    assert ledger.physical_device_bytes() == 4 * MiB
    assert ledger.outstanding_bytes(layers=[Layer.RUNTIME]) == 4 * MiB
    assert ledger.allocations_total[(PID, Layer.DRIVER)] == 23
    assert ledger.frees_total[(PID, Layer.RUNTIME)] == 19
    assert len(ledger) == 8  # 4 runtime + 4 driver entries


def test_free_of_unknown_address_is_counted_not_applied():
    ledger = Ledger()
    malloc(ledger, 0xA000, MiB)
    ledger.apply(ev(Kind.FREE, Api.cuMemFree_v2, Layer.DRIVER, 0xB000))
    assert ledger.unknown_frees_total[(PID, Api.cuMemFree_v2)] == 1
    assert ledger.physical_device_bytes() == MiB


def test_failures_are_counted_per_api_and_error_code():
    ledger = Ledger()
    for _ in range(3):
        ledger.apply(ev(Kind.ALLOC_FAILED, Api.cudaMalloc, Layer.RUNTIME, size=1 << 41, error=2))
    assert ledger.failures_total[(Api.cudaMalloc, 2)] == 3
    assert len(ledger) == 0


def vmm(kind, api, address, size=0, handle=0, obj=ObjectKind.VMM_HANDLE, device=3, ts=0):
    memory = Memory.DEVICE if obj is ObjectKind.VMM_HANDLE else Memory.NONE
    return ev(kind, api, Layer.VMM, address, size, device=device, obj=obj, memory=memory, handle=handle, ts=ts)


def test_vmm_physical_memory_lives_until_released_and_unmapped():
    ledger = Ledger()
    base = 0x7D0000000000
    ledger.apply(vmm(Kind.ALLOC, Api.cuMemAddressReserve, base, 64 * MiB, obj=ObjectKind.VMM_RESERVE))
    for i in range(5):
        ledger.apply(vmm(Kind.ALLOC, Api.cuMemCreate, 0x1000 + i, 2 * MiB))
        ledger.apply(vmm(Kind.MAP, Api.cuMemMap, base + i * 2 * MiB, 2 * MiB, handle=0x1000 + i,
                         obj=ObjectKind.VMM_MAPPING))
    assert ledger.physical_device_bytes(device=3) == 10 * MiB
    # Released while mapped: still held.
    ledger.apply(vmm(Kind.RELEASE, Api.cuMemRelease, 0x1000, 2 * MiB))
    ledger.apply(vmm(Kind.RELEASE, Api.cuMemRelease, 0x1001, 2 * MiB))
    assert ledger.physical_device_bytes() == 10 * MiB
    # One unmap over two mappings frees both released handles.
    ledger.apply(vmm(Kind.UNMAP, Api.cuMemUnmap, base, 4 * MiB, obj=ObjectKind.VMM_MAPPING))
    assert ledger.physical_device_bytes() == 6 * MiB
    # Unmapped first, then released: freed at the release.
    ledger.apply(vmm(Kind.UNMAP, Api.cuMemUnmap, base + 4 * MiB, 2 * MiB, obj=ObjectKind.VMM_MAPPING))
    assert ledger.physical_device_bytes() == 6 * MiB
    ledger.apply(vmm(Kind.FREE, Api.cuMemRelease, 0x1002, 2 * MiB))
    assert ledger.physical_device_bytes() == 4 * MiB
    handle = ledger.get(LedgerKey(PID, Layer.VMM, ObjectKind.VMM_HANDLE, 0x1003))
    assert handle.mapped_count == 1 and not handle.released
    # The reservation is address space, not memory.
    assert ledger.outstanding_bytes(memory=None) == 4 * MiB


def test_context_destroy_frees_that_device_only_and_only_older_entries():
    ledger = Ledger()
    for i in range(7):
        malloc(ledger, 0x1000 + i * MiB, MiB, ts=10, device=0)
    for i in range(3):
        ledger.apply(ev(Kind.ALLOC, Api.cuMemAlloc_v2, Layer.DRIVER, 0x9000 + i * MiB, MiB, ts=20, device=1))
    ledger.apply(ev(Kind.ALLOC, Api.cuMemAlloc_v2, Layer.DRIVER, 0xF000, MiB, ts=40, device=1))
    ledger.apply(ev(Kind.CONTEXT_DESTROY, Api.cuCtxDestroy_v2, Layer.DRIVER, ts=30, device=1))
    assert ledger.physical_device_bytes(device=0) == 7 * MiB
    assert ledger.physical_device_bytes(device=1) == MiB  # the one made after the destroy stays
    assert ledger.implicit_frees_total[PID] == 3


def test_process_exit_empties_that_process_only():
    ledger = Ledger()
    for i in range(13):
        malloc(ledger, 0x1000 + i * MiB, MiB, pid=PID)
    malloc(ledger, 0x1000, 5 * MiB, pid=PID + 1)
    ledger.apply(ev(Kind.PROCESS_EXIT, Api.process_exit, None, ts=1, obj=None, memory=None))
    assert ledger.physical_device_bytes(pid=PID) == 0
    assert ledger.physical_device_bytes(pid=PID + 1) == 5 * MiB
    assert ledger.pids() == {PID + 1}


def test_resync_replaces_content_and_totals():
    ledger = Ledger()
    malloc(ledger, 0x1000, MiB)
    exact = Ledger()
    malloc(exact, 0x2000, 3 * MiB)
    ledger.resync(list(exact))
    assert ledger.physical_device_bytes() == 3 * MiB
    assert ledger.get(LedgerKey(PID, Layer.DRIVER, ObjectKind.ALLOCATION, 0x1000)) is None


def test_resync_keeps_the_stack_of_the_same_allocation_only():
    """The kernel's entry and the event about it carry one timestamp: an entry the resync brings
    back with that timestamp is the allocation whose stack is known; a different one (the address
    freed and allocated again while events were lost) has no stack."""
    ledger = Ledger()
    for address, ts in ((0x1000, 5), (0x2000, 6)):
        event = ev(Kind.ALLOC, Api.cuMemAlloc_v2, Layer.DRIVER, address, MiB, ts=ts)
        event.stack_id = 40 + ts
        ledger.apply(event)
    exact = Ledger()
    exact.apply(ev(Kind.ALLOC, Api.cuMemAlloc_v2, Layer.DRIVER, 0x1000, MiB, ts=5))
    exact.apply(ev(Kind.ALLOC, Api.cuMemAlloc_v2, Layer.DRIVER, 0x2000, MiB, ts=9))
    ledger.resync(list(exact))
    assert ledger.bytes_by_stack() == {(PID, 45): (MiB, 1), (PID, 0): (MiB, 1)}


def test_host_and_managed_memory_are_kept_apart_from_device():
    ledger = Ledger()
    ledger.apply(ev(Kind.ALLOC, Api.cuMemAllocHost_v2, Layer.DRIVER, 0x5000, 4096, device=-1,
                    memory=Memory.HOST))
    ledger.apply(ev(Kind.ALLOC, Api.cuMemAllocManaged, Layer.DRIVER, 0x6000, 8192, memory=Memory.MANAGED))
    assert ledger.physical_device_bytes() == 0
    assert ledger.outstanding_bytes(memory=Memory.HOST) == 4096
    assert ledger.outstanding_bytes(memory=Memory.MANAGED) == 8192


def test_json_shape_has_the_documented_keys():
    event = ev(Kind.ALLOC, Api.cudaMalloc, Layer.RUNTIME, 0x1000, MiB)
    data = event_to_json(event)
    for key in ("kind", "pid", "tid", "comm", "title", "api", "layer", "size_bytes", "address",
                "device", "error_code", "timestamp_ns"):
        assert key in data
    assert data["kind"] == "alloc" and data["api"] == "cudaMalloc" and data["layer"] == "runtime"


def test_bytes_by_stack_counts_physical_memory_once_per_allocation():
    ledger = Ledger()
    for i in range(5):
        for layer, api in ((Layer.DRIVER, Api.cuMemAlloc_v2), (Layer.RUNTIME, Api.cudaMalloc)):
            e = ev(Kind.ALLOC, api, layer, 0x1000 + i * MiB, MiB)
            e.stack_id = 7 if i < 3 else 9
            ledger.apply(e)
    host = ev(Kind.ALLOC, Api.cuMemAllocHost_v2, Layer.DRIVER, 0x9000, 4096, memory=Memory.HOST)
    host.stack_id = 7
    ledger.apply(host)
    assert ledger.bytes_by_stack() == {(PID, 7): (3 * MiB, 3), (PID, 9): (2 * MiB, 2)}
    assert ledger.bytes_by_stack(pid=PID + 1) == {}


def test_an_exited_process_leaves_no_counters():
    ledger = Ledger()
    malloc(ledger, 0x1000, MiB)
    free(ledger, 0x1000)
    malloc(ledger, 0x1000, MiB)
    free(ledger, 0x9000)  # never seen: an unknown free
    malloc(ledger, 0x1000, MiB, pid=PID + 1)
    ledger.drop_process(PID, before_ns=1 << 62)
    assert ledger.implicit_frees_total[PID] == 2 and ledger.unknown_frees_total
    ledger.forget_counters(PID)
    assert all(key[0] != PID for key in [*ledger.allocations_total, *ledger.frees_total,
                                         *ledger.unknown_frees_total])
    assert PID not in ledger.implicit_frees_total
    assert ledger.allocations_total[(PID + 1, Layer.DRIVER)] == 1  # the others keep theirs


def test_outstanding_fields_are_in_the_order_the_ledger_builds_them():
    """Ledger._on_alloc builds Outstanding positionally (keywords cost twice as much per allocation):
    a field added or moved must be added or moved there too."""
    import dataclasses

    from kvtrace.model.ledger import Outstanding

    assert [field.name for field in dataclasses.fields(Outstanding)] == [
        "key", "size_bytes", "timestamp_ns", "device", "api", "memory", "tid", "caller_address", "mapped_count",
        "released", "handle", "stack_id", "stream", "sample_bytes", "sampled"]


def test_an_exit_or_context_destroy_costs_what_its_process_held_not_the_ledger():
    """Issue 31 (--no-ledger-in-kernel: every entry kept here): one user's 100 000 entries are never gone
    through when another process exits or destroys a context."""

    class NoScan(dict):
        def values(self):
            raise AssertionError("went through the whole ledger")

    ledger = Ledger()
    for index in range(100_000):
        malloc(ledger, 0x10_0000 + index, 4096, ts=1, pid=61999)
    for index in range(3):
        malloc(ledger, 0x90_0000 + index, 4096, ts=1, pid=7, device=index % 2)
    ledger._entries = NoScan(ledger._entries)
    ledger.apply(ev(Kind.CONTEXT_DESTROY, Api.cuCtxDestroy_v2, Layer.DRIVER, ts=30, device=1, pid=7))
    assert len(ledger.kept([7])) == 2 * 2  # device 0's two cudaMalloc (runtime + driver) stay
    ledger.apply(ev(Kind.PROCESS_EXIT, Api.process_exit, None, ts=31, obj=None, memory=None, pid=7))
    assert ledger.kept([7]) == [] and 7 not in ledger.pids()
    assert len(ledger.kept([61999])) == 200_000 and ledger.implicit_frees_total[7] == 6
