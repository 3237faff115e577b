/* ledger.h — the exact set of outstanding objects, kept in the kernel where no event can be lost:
 * allocation returns insert (reading the out-parameter), frees delete, a process exit leaves the
 * dropping to user space (it can iterate the map; the event bounds which entries go). */
#ifndef KVT_LEDGER_H
#define KVT_LEDGER_H

#define KVT_EEXIST 17 /* what inserting a key the map holds returns, negated */

BPF_HASH(ledger, struct kvt_ledger_key, struct kvt_ledger_value, KVT_MAX_LEDGER_ENTRIES);
BPF_HASH(tracked_pids, u32, u64, 65536);
BPF_HASH(ledger_totals, struct kvt_totals_key, struct kvt_totals_value, KVT_MAX_TOTALS);

/* Allocations and blocks are summed in ledger_totals as they enter and leave the ledger; the other
 * objects (VMM handles, reservations, mappings: few) user space keeps one by one from the events. */
static __always_inline int counted_object(u8 object) {
    return object == KVT_OBJECT_ALLOCATION || object == KVT_OBJECT_BLOCK;
}

/* Adds one entry's change to its totals. Atomic: a process's threads change them on several CPUs at
 * once. A key the map has no room for is counted (the agent says its totals are off), never guessed. */
static __always_inline void totals_add(u32 pid, s32 device, u8 layer, u8 memory, s64 size_bytes, s64 count_delta) {
    struct kvt_totals_key key = {.pid = pid, .device = device, .layer = layer, .memory = memory};
    struct kvt_totals_value *totals = ledger_totals.lookup(&key);
    if (!totals) {
        /* A new key is the process's user's to hold (shares.h): refused over its share, like a full map. */
        struct kvt_parties parties;
        if (!share_take_key(pid, &parties)) {
            count(KVT_COUNTER_TOTALS_FULL);
            return;
        }
        struct kvt_totals_value zero = {};
        if (ledger_totals.insert(&key, &zero) != 0) /* another CPU made it meanwhile (or no room) */
            parties_add_keys(&parties, -1);
        totals = ledger_totals.lookup(&key);
        if (!totals) {
            count(KVT_COUNTER_TOTALS_FULL);
            return;
        }
    }
    __sync_fetch_and_add(&totals->size_bytes, size_bytes);
    __sync_fetch_and_add(&totals->count, count_delta);
}

/* Marks the calling process as holding ledger entries: its exit is then reported (or, lost, swept).
 * `known`, a flag in the calling thread's storage (NULL: none), saves the lookup on all of a thread's
 * inserts but the first: the probes take the mark away only when the process's last thread exits
 * (KVT_TRACKED_IN_THREAD), and user space only from a process that is gone, giving it back where a new
 * one took the pid meanwhile (BpfSource.sweep_exited), so a living thread's flag stays true. */
static __always_inline void mark_tracked(u32 pid, u32 *known) {
    if (known && *known)
        return;
    if (!tracked_pids.lookup(&pid)) { /* a lookup is cheaper than the update it saves */
        u64 one = 1;
        if (tracked_pids.update(&pid, &one) != 0)
            return; /* no room: the next insert tries again */
    }
    if (known)
        *known = 1;
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
 * about it must carry too (emit_at), or 0 where its user's share of the ledger is full (shares.h: counted
 * on the process's and user's records, not stored; the caller sends no event). `tracked`: the calling thread's mark_tracked flag, or NULL.
 * `sample_kib`, `sampled`: a PyTorch block's stack sampling (usdt.h block_walked); 0 for the rest. */
static __always_inline u64 ledger_insert_sampled(u8 layer, u8 object, u8 memory, u16 api, u64 address,
                                                 u64 size_bytes, s32 device, u64 caller, u64 aux, u64 stack_id,
                                                 u32 *tracked, u16 sample_kib, u8 sampled, u8 unsent) {
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
    value.sample_kib = sample_kib;
    value.sampled = sampled;
    value.unsent = unsent;
    struct kvt_share *share = share_take(key.pid);
    if (!share)
        return 0;
    /* Inserted only where the key is new: one map operation, where a lookup first was two. The same
     * key still there means its free was never seen: the old entry goes (and leaves the totals, if
     * this delete is the one that took it) and the new one goes in. */
    int error = ledger.insert(&key, &value);
    if (error == -KVT_EEXIST) {
        count(KVT_COUNTER_LEDGER_REPLACED);
        struct kvt_ledger_value *old = ledger.lookup(&key);
        if (old) {
            s32 old_device = old->device;
            u8 old_memory = old->memory;
            s64 old_size = old->size_bytes;
            if (ledger.delete(&key) == 0) {
                entry_give(share); /* the old entry's */
                if (counted_object(object))
                    totals_add(key.pid, old_device, layer, old_memory, -old_size, -1);
            }
        }
        error = ledger.insert(&key, &value);
    }
    if (error == 0) {
        if (counted_object(object))
            totals_add(key.pid, device, layer, memory, size_bytes, 1);
    } else if (error == -KVT_EEXIST) {
        count(KVT_COUNTER_LEDGER_REPLACED); /* again: another thread put this address back meanwhile */
        entry_give(share);
    } else {
        count(KVT_COUNTER_LEDGER_FULL);
        entry_give(share);
    }
    mark_tracked(key.pid, tracked);
    return value.timestamp_ns;
}

static __always_inline u64 ledger_insert(u8 layer, u8 object, u8 memory, u16 api, u64 address,
                                         u64 size_bytes, s32 device, u64 caller, u64 aux, u64 stack_id,
                                         u32 *tracked) {
    return ledger_insert_sampled(layer, object, memory, api, address, size_bytes, device, caller, aux, stack_id,
                                 tracked, 0, 0, 0);
}

/* Deletes a looked-up entry of the calling process, giving it back to its share; 0 where this delete
 * is the one that took it. */
static __always_inline int ledger_remove(struct kvt_ledger_key *key) {
    int error = ledger.delete(key);
    if (error == 0)
        share_give(key->pid);
    return error;
}

/* Deletes a looked-up entry; an allocation's or block's totals drop only where this delete is the
 * one that took it (two threads freeing one address: one of them). */
static __always_inline void ledger_delete(struct kvt_ledger_key *key, s32 device, u8 memory, u64 size_bytes) {
    if (ledger_remove(key) == 0 && counted_object(key->object))
        totals_add(key->pid, device, key->layer, memory, -(s64)size_bytes, -1);
}

/* Allocation return: reads *out_ptr and records the object. */
static __always_inline int alloc_return(struct pt_regs *ctx, u16 api, u8 layer, u8 object, u8 memory,
                                        int pitched) {
    struct kvt_args args;
    s32 device;
    u32 *tracked;
    if (!take_entry_on_device(ctx, api, &args, memory != KVT_MEMORY_HOST, &device, &tracked))
        return 0;
    s32 rc = (s32)PT_REGS_RC(ctx);
#if !KVT_TASK_STORAGE
    u32 tid = (u32)bpf_get_current_pid_tgid();
    if (is_runtime_api(api))
        outer_stack.delete(&tid); /* the runtime call is over: its driver calls are done */
#endif
    u64 size_bytes = bounded_size(args.arg[1]);
    if (pitched) {
        /* (out, size_t *pitch, width, height): the real size is pitch * height. */
        u64 pitch = 0;
        if (rc == 0)
            bpf_probe_read_user(&pitch, sizeof(pitch), (void *)args.arg[1]);
        size_bytes = bounded_product(rc == 0 ? pitch : args.arg[2], args.arg[3]);
    }
    if (rc != 0) {
        emit_stack(KVT_KIND_ALLOC_FAILED, api, layer, object, memory, 0, size_bytes, device, rc,
                   args.caller_address, 0, args.stack_id, args.stack_status);
        return 0;
    }
    u64 address = 0;
    bpf_probe_read_user(&address, sizeof(address), (void *)args.arg[0]);
    u64 now = ledger_insert(layer, object, memory, api, address, size_bytes, device, args.caller_address, 0,
                            args.stack_id, tracked);
    if (!now)
        return 0; /* over its user's share: counted there */
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
    ledger_delete(&key, device, value_memory, size_bytes);
    emit(KVT_KIND_FREE, api, layer, object, value_memory, address, size_bytes, device, 0,
         args.caller_address, 0);
    return 0;
}


#endif
