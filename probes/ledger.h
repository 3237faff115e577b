/* ledger.h — the exact set of outstanding objects, kept in the kernel where no event can be lost:
 * allocation returns insert (reading the out-parameter), frees delete, a process exit leaves the
 * dropping to user space (it can iterate the map; the event bounds which entries go). */
#ifndef KVT_LEDGER_H
#define KVT_LEDGER_H

#define KVT_EEXIST 17 /* what inserting a key the map holds returns, negated */

BPF_HASH(ledger, struct kvt_ledger_key, struct kvt_ledger_value, KVT_MAX_LEDGER_ENTRIES);
BPF_HASH(tracked_pids, u32, u64, 65536);

static __always_inline void mark_tracked(u32 pid) {
    if (tracked_pids.lookup(&pid))
        return; /* a lookup is cheaper than the update it saves on every allocation but the first */
    u64 one = 1;
    tracked_pids.update(&pid, &one);
}

/* The calling process's ledger entry of an object (NULL if none); fills `key` for a delete. */
static __always_inline struct kvt_ledger_value *ledger_lookup(u8 layer, u8 object, u64 address,
                                                             struct kvt_ledger_key *key) {
    key->pid = bpf_get_current_pid_tgid() >> 32;
    key->layer = layer;
    key->object = object;
    key->reserved = 0;
    key->address = address;
    return ledger.lookup(key);
}

/* Inserts an outstanding object into the in-kernel ledger; returns its timestamp, which the event
 * about it must carry too (emit_at). */
static __always_inline u64 ledger_insert(u8 layer, u8 object, u8 memory, u16 api, u64 address,
                                         u64 size_bytes, s32 device, u64 caller, u64 aux, u64 stack_id) {
    u64 pid_tgid = bpf_get_current_pid_tgid();
    struct kvt_ledger_key key = {.pid = pid_tgid >> 32, .layer = layer, .object = object, .address = address};
    struct kvt_ledger_value value = {};
    value.size_bytes = size_bytes;
    value.timestamp_ns = bpf_ktime_get_ns();
    value.caller_address = caller;
    value.aux = aux;
    value.tid = (u32)pid_tgid;
    value.device = device;
    value.api = api;
    value.memory = memory;
    value.stack_id = stack_id;
    /* Inserted only where the key is new: one map operation, where a lookup first was two. The same
     * key still there means its free was never seen. The entry is replaced; the agent, which counts
     * entries from the events, counts again from the kernel's (the counter going up says so). */
    int error = ledger.insert(&key, &value);
    if (error == -KVT_EEXIST) {
        count(KVT_COUNTER_LEDGER_REPLACED);
        error = ledger.update(&key, &value);
    }
    if (error != 0)
        count(KVT_COUNTER_LEDGER_FULL);
    mark_tracked(key.pid);
    return value.timestamp_ns;
}

/* Allocation return: reads *out_ptr and records the object. */
static __always_inline int alloc_return(struct pt_regs *ctx, u16 api, u8 layer, u8 object, u8 memory,
                                        int pitched) {
    struct kvt_args args;
    if (!take_entry(ctx, api, &args))
        return 0;
    s32 rc = (s32)PT_REGS_RC(ctx);
    u32 tid = (u32)bpf_get_current_pid_tgid();
#if !KVT_TASK_STORAGE
    if (is_runtime_api(api))
        outer_stack.delete(&tid); /* the runtime call is over: its driver calls are done */
#endif
    s32 device = memory == KVT_MEMORY_HOST ? KVT_DEVICE_UNKNOWN : current_device(tid);
    u64 size_bytes = args.arg[1];
    if (pitched) {
        /* (out, size_t *pitch, width, height): the real size is pitch * height. */
        u64 pitch = 0;
        if (rc == 0)
            bpf_probe_read_user(&pitch, sizeof(pitch), (void *)args.arg[1]);
        size_bytes = (rc == 0 ? pitch : args.arg[2]) * args.arg[3];
    }
    if (rc != 0) {
        emit_stack(KVT_KIND_ALLOC_FAILED, api, layer, object, memory, 0, size_bytes, device, rc,
                   args.caller_address, 0, args.stack_id, args.stack_status);
        return 0;
    }
    u64 address = 0;
    bpf_probe_read_user(&address, sizeof(address), (void *)args.arg[0]);
    u64 now = ledger_insert(layer, object, memory, api, address, size_bytes, device, args.caller_address, 0,
                            args.stack_id);
    emit_at(now, KVT_KIND_ALLOC, api, layer, object, memory, address, size_bytes, device, 0,
            args.caller_address, 0, args.stack_id, args.stack_status);
    return 0;
}

/* Free return: the address is the first argument. */
static __always_inline int free_return(struct pt_regs *ctx, u16 api, u8 layer, u8 object, u8 memory) {
    struct kvt_args args;
    if (!take_entry(ctx, api, &args))
        return 0;
    s32 rc = (s32)PT_REGS_RC(ctx);
    u64 address = args.arg[0];
    if (rc != 0) {
        emit(KVT_KIND_FREE_FAILED, api, layer, object, memory, address, 0,
             current_device((u32)bpf_get_current_pid_tgid()), rc, args.caller_address, 0);
        return 0;
    }
    if (address == 0)
        return 0; /* cudaFree(NULL) is a no-op (often used to create the context) */
    struct kvt_ledger_key key;
    struct kvt_ledger_value *value = ledger_lookup(layer, object, address, &key);
    if (!value) {
        count(KVT_COUNTER_UNKNOWN_FREES);
        emit(KVT_KIND_FREE_UNKNOWN, api, layer, object, memory, address, 0,
             current_device((u32)bpf_get_current_pid_tgid()), 0, args.caller_address, 0);
        return 0;
    }
    u64 size_bytes = value->size_bytes;
    s32 device = value->device;
    u8 value_memory = value->memory;
    ledger.delete(&key);
    emit(KVT_KIND_FREE, api, layer, object, value_memory, address, size_bytes, device, 0,
         args.caller_address, 0);
    return 0;
}


#endif
