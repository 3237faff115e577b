/* vmm.h — CUDA virtual memory management: physical handles (cuMemCreate/cuMemRelease), address
 * reservations and mappings. Physical memory lives from create until it is both released and
 * unmapped (a handle released while mapped goes at its last unmap). */
#ifndef KVT_VMM_H
#define KVT_VMM_H

/* cuMemUnmap may cover several mappings; this bounds the loop the verifier must accept. */
#define KVT_MAX_UNMAP_SPAN 32

static __always_inline struct kvt_ledger_value *vmm_lookup(u8 object, u64 address,
                                                          struct kvt_ledger_key *key) {
    return ledger_lookup(KVT_LAYER_VMM, object, address, key);
}

/* cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
 * flags). prop->location is {type, id} at offset 8; type 1 = CU_MEM_LOCATION_TYPE_DEVICE. */
int entry_cuMemCreate(struct pt_regs *ctx) { return save_alloc_entry(ctx, KVT_API_cuMemCreate); }
int return_cuMemCreate(struct pt_regs *ctx) {
    struct kvt_args args;
    if (!take_entry(ctx, KVT_API_cuMemCreate, &args))
        return 0;
    s32 rc = (s32)PT_REGS_RC(ctx);
    s32 location[2] = {0, 0};
    bpf_probe_read_user(&location, sizeof(location), (void *)(args.arg[2] + 8));
    s32 device = location[0] == 1 ? bounded_device(location[1]) : KVT_DEVICE_UNKNOWN;
    u64 size_bytes = bounded_size(args.arg[1]);
    if (rc != 0) {
        emit_stack(KVT_KIND_ALLOC_FAILED, KVT_API_cuMemCreate, KVT_LAYER_VMM, KVT_OBJECT_VMM_HANDLE,
                   KVT_MEMORY_DEVICE, 0, size_bytes, device, rc, args.caller_address, 0,
                   args.stack_id, args.stack_status);
        return 0;
    }
    u64 handle = 0;
    bpf_probe_read_user(&handle, sizeof(handle), (void *)args.arg[0]);
    u64 now = ledger_insert(KVT_LAYER_VMM, KVT_OBJECT_VMM_HANDLE, KVT_MEMORY_DEVICE, KVT_API_cuMemCreate,
                            handle, size_bytes, device, args.caller_address, 0, args.stack_id, 0);
    if (!now)
        return 0; /* over its user's share: counted there */
    emit_at(now, KVT_KIND_ALLOC, KVT_API_cuMemCreate, KVT_LAYER_VMM, KVT_OBJECT_VMM_HANDLE,
            KVT_MEMORY_DEVICE, handle, size_bytes, device, 0, args.caller_address, 0,
            args.stack_id, args.stack_status);
    return 0;
}

/* cuMemRelease(handle): physical memory goes now, or at the last unmap if still mapped. */
int entry_cuMemRelease(struct pt_regs *ctx) { return save_entry(ctx, KVT_API_cuMemRelease); }
int return_cuMemRelease(struct pt_regs *ctx) {
    struct kvt_args args;
    if (!take_entry(ctx, KVT_API_cuMemRelease, &args))
        return 0;
    s32 rc = (s32)PT_REGS_RC(ctx);
    u64 handle = args.arg[0];
    if (rc != 0) {
        emit(KVT_KIND_FREE_FAILED, KVT_API_cuMemRelease, KVT_LAYER_VMM, KVT_OBJECT_VMM_HANDLE,
             KVT_MEMORY_DEVICE, handle, 0, KVT_DEVICE_UNKNOWN, rc, args.caller_address, 0);
        return 0;
    }
    struct kvt_ledger_key key;
    struct kvt_ledger_value *value = vmm_lookup(KVT_OBJECT_VMM_HANDLE, handle, &key);
    if (!value) {
        count(KVT_COUNTER_UNKNOWN_FREES);
        emit(KVT_KIND_FREE_UNKNOWN, KVT_API_cuMemRelease, KVT_LAYER_VMM, KVT_OBJECT_VMM_HANDLE,
             KVT_MEMORY_DEVICE, handle, 0, KVT_DEVICE_UNKNOWN, 0, args.caller_address, 0);
        return 0;
    }
    u64 size_bytes = value->size_bytes;
    s32 device = value->device;
    if (value->aux > 0) {
        value->released = 1;
        emit(KVT_KIND_RELEASE, KVT_API_cuMemRelease, KVT_LAYER_VMM, KVT_OBJECT_VMM_HANDLE,
             KVT_MEMORY_DEVICE, handle, size_bytes, device, 0, args.caller_address, 0);
        return 0;
    }
    ledger_remove(&key);
    emit(KVT_KIND_FREE, KVT_API_cuMemRelease, KVT_LAYER_VMM, KVT_OBJECT_VMM_HANDLE, KVT_MEMORY_DEVICE,
         handle, size_bytes, device, 0, args.caller_address, 0);
    return 0;
}

/* cuMemAddressReserve(CUdeviceptr *ptr, size, alignment, addr, flags) */
int entry_cuMemAddressReserve(struct pt_regs *ctx) { return save_entry(ctx, KVT_API_cuMemAddressReserve); }
int return_cuMemAddressReserve(struct pt_regs *ctx) {
    return alloc_return(ctx, KVT_API_cuMemAddressReserve, KVT_LAYER_VMM, KVT_OBJECT_VMM_RESERVE,
                        KVT_MEMORY_NONE, 0);
}

/* cuMemAddressFree(CUdeviceptr ptr, size) */
int entry_cuMemAddressFree(struct pt_regs *ctx) { return save_entry(ctx, KVT_API_cuMemAddressFree); }
int return_cuMemAddressFree(struct pt_regs *ctx) {
    return free_return(ctx, KVT_API_cuMemAddressFree, KVT_LAYER_VMM, KVT_OBJECT_VMM_RESERVE,
                       KVT_MEMORY_NONE);
}

/* cuMemMap(CUdeviceptr ptr, size, offset, handle, flags) */
int entry_cuMemMap(struct pt_regs *ctx) { return save_entry(ctx, KVT_API_cuMemMap); }
int return_cuMemMap(struct pt_regs *ctx) {
    struct kvt_args args;
    if (!take_entry(ctx, KVT_API_cuMemMap, &args))
        return 0;
    s32 rc = (s32)PT_REGS_RC(ctx);
    u64 va = args.arg[0], size_bytes = bounded_size(args.arg[1]), handle = args.arg[3];
    struct kvt_ledger_key key;
    struct kvt_ledger_value *physical = vmm_lookup(KVT_OBJECT_VMM_HANDLE, handle, &key);
    s32 device = physical ? physical->device : KVT_DEVICE_UNKNOWN;
    if (rc != 0) {
        emit(KVT_KIND_ALLOC_FAILED, KVT_API_cuMemMap, KVT_LAYER_VMM, KVT_OBJECT_VMM_MAPPING,
             KVT_MEMORY_NONE, va, size_bytes, device, rc, args.caller_address, handle);
        return 0;
    }
    if (physical)
        __sync_fetch_and_add(&physical->aux, 1);
    u64 now = ledger_insert(KVT_LAYER_VMM, KVT_OBJECT_VMM_MAPPING, KVT_MEMORY_NONE, KVT_API_cuMemMap, va,
                            size_bytes, device, args.caller_address, handle, 0, 0);
    if (!now) { /* over its user's share: counted there; the handle is not held by this mapping */
        if (physical)
            __sync_fetch_and_add(&physical->aux, -1);
        return 0;
    }
    emit_at(now, KVT_KIND_MAP, KVT_API_cuMemMap, KVT_LAYER_VMM, KVT_OBJECT_VMM_MAPPING, KVT_MEMORY_NONE, va,
            size_bytes, device, 0, args.caller_address, handle, 0, KVT_STACK_NOT_WALKED);
    return 0;
}

/* cuMemUnmap(CUdeviceptr ptr, size): drops every mapping in [ptr, ptr + size); a handle that was
 * released while mapped is freed at its last unmap. aux of the event = physical bytes freed. */
int entry_cuMemUnmap(struct pt_regs *ctx) { return save_entry(ctx, KVT_API_cuMemUnmap); }
int return_cuMemUnmap(struct pt_regs *ctx) {
    struct kvt_args args;
    if (!take_entry(ctx, KVT_API_cuMemUnmap, &args))
        return 0;
    s32 rc = (s32)PT_REGS_RC(ctx);
    u64 va = args.arg[0], end = args.arg[0] + args.arg[1];
    if (rc != 0) {
        emit(KVT_KIND_FREE_FAILED, KVT_API_cuMemUnmap, KVT_LAYER_VMM, KVT_OBJECT_VMM_MAPPING,
             KVT_MEMORY_NONE, va, args.arg[1], KVT_DEVICE_UNKNOWN, rc, args.caller_address, 0);
        return 0;
    }
    u64 freed_bytes = 0;
    s32 device = KVT_DEVICE_UNKNOWN;
    int found = 0;
    for (int i = 0; i < KVT_MAX_UNMAP_SPAN; i++) {
        if (va >= end)
            break;
        struct kvt_ledger_key mkey;
        struct kvt_ledger_value *mapping = vmm_lookup(KVT_OBJECT_VMM_MAPPING, va, &mkey);
        if (!mapping)
            break;
        found = 1;
        u64 handle = mapping->aux;
        u64 mapped_bytes = mapping->size_bytes;
        device = mapping->device;
        ledger_remove(&mkey);
        struct kvt_ledger_key hkey;
        struct kvt_ledger_value *physical = vmm_lookup(KVT_OBJECT_VMM_HANDLE, handle, &hkey);
        if (physical) {
            u64 left = __sync_fetch_and_add(&physical->aux, -1) - 1;
            if (left == 0 && physical->released) {
                freed_bytes += physical->size_bytes;
                ledger_remove(&hkey);
            }
        }
        if (mapped_bytes == 0)
            break;
        va += mapped_bytes;
    }
    if (!found) {
        count(KVT_COUNTER_UNKNOWN_FREES);
        emit(KVT_KIND_FREE_UNKNOWN, KVT_API_cuMemUnmap, KVT_LAYER_VMM, KVT_OBJECT_VMM_MAPPING,
             KVT_MEMORY_NONE, args.arg[0], args.arg[1], KVT_DEVICE_UNKNOWN, 0, args.caller_address, 0);
        return 0;
    }
    emit(KVT_KIND_UNMAP, KVT_API_cuMemUnmap, KVT_LAYER_VMM, KVT_OBJECT_VMM_MAPPING, KVT_MEMORY_NONE,
         args.arg[0], args.arg[1], device, 0, args.caller_address, freed_bytes);
    return 0;
}

#endif
