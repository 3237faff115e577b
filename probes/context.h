/* context.h — the context of a traced call: whether its process is traced (the pid filter), the
 * arguments saved at entry for the return probe, the calling thread's current device (cudaSetDevice,
 * cuCtxSetCurrent) and each context's device, and the Python stack of the call (walked once per
 * cudaMalloc: the cuMemAlloc_v2 inside it reuses it). */
#ifndef KVT_CONTEXT_H
#define KVT_CONTEXT_H

struct kvt_args_key {
    u32 tid;
    u32 api;
};

struct kvt_args {
    u64 arg[4];
    u64 caller_address; /* not saved by the entry: take_entry fills it in at the return (PT_REGS_IP) */
    u64 stack_id;
    u64 stack_status;
    u64 in_flight; /* task storage: 1 from the entry until its return takes the arguments */
};

/* The stack of a runtime allocation in progress on this thread: the driver allocation it makes
 * (cudaMalloc -> cuMemAlloc_v2) has the same Python stack, so it is walked once, not twice. */
struct kvt_outer_stack {
    u64 stack_id;
    u64 stack_status;
    u64 timestamp_ns;
    u32 api; /* task storage: the runtime API whose call it is; 0: none in progress */
    u32 reserved;
};

struct kvt_ctx_key {
    u32 pid;
    u32 reserved;
    u64 ctx;
};

#if KVT_TASK_STORAGE
/* API ids that save arguments (runtime, driver, VMM) are below this: 48 slots keep a thread's
 * storage under 4 KiB with the kernel's header (one small allocation per thread). */
#define KVT_API_SLOTS 48
_Static_assert(KVT_API_cuMemAddressFree < KVT_API_SLOTS, "an API that saves arguments has no slot");
/* What a call keeps between its entry and its return, per thread, in task storage (Linux 6.2+): it
 * goes with the thread, is never evicted, is found from the task without hashing, and each API's slot
 * is written in place. The LRU hashes below did the same at two to three map operations per call,
 * most of what a probe cost beyond an empty one. */
struct kvt_thread {
    struct kvt_outer_stack outer;
    struct kvt_args args[KVT_API_SLOTS];
    s32 device;     /* the device this thread selected (cudaSetDevice, a context made current) */
    u32 device_set; /* 1 once it selected one */
    /* 1 + the process generation in which it read its process's settings: the process is selected, and
     * its default device is process_default_device (one hash lookup each, once a thread and change,
     * not once a call); 0: never */
    u64 checked_in;
    s32 process_default_device;
    u32 process_tracked; /* 1 once its process is in tracked_pids (mark_tracked, KVT_TRACKED_IN_THREAD) */
    /* PyTorch blocks' stack sampling (usdt.h block_walked): bytes of blocks left before the next one
     * whose stack is walked, once drawn */
    s64 block_countdown;
    u32 block_countdown_drawn;
    u32 reserved;
};
BPF_TASK_STORAGE(threads, struct kvt_thread);

/* The calling thread's storage, made when `create` (an entry); NULL when it has none. */
static __always_inline struct kvt_thread *this_thread(int create) {
    return threads.task_storage_get(bpf_get_current_task_btf(), 0, create ? BPF_LOCAL_STORAGE_GET_F_CREATE : 0);
}
#else
BPF_TABLE("lru_hash", struct kvt_args_key, struct kvt_args, saved_args, KVT_MAX_THREADS);
BPF_TABLE("lru_hash", u32, s32, thread_device, KVT_MAX_THREADS);
BPF_TABLE("lru_hash", u32, struct kvt_outer_stack, outer_stack, KVT_MAX_THREADS);
#endif
BPF_TABLE("lru_hash", struct kvt_ctx_key, s32, context_device, 4096);
/* The device of a thread that never selected one, for processes whose CUDA start the agent missed
 * (set by user space: KVT_DEVICE_UNKNOWN where the process sees several GPUs). */
BPF_HASH(process_device, u32, s32, 65536);
BPF_HASH(pid_filter, u32, u8, 65536);
BPF_ARRAY(config, u64, KVT_CONFIG_COUNT);

/* CUDA's rule: a thread works on the device it selected (cudaSetDevice, or a context made
 * current); one that never selected any works on device 0, the first GPU it can see. */
static __always_inline s32 default_device(void) {
    u32 pid = bpf_get_current_pid_tgid() >> 32;
    s32 *fallback = process_device.lookup(&pid);
    return fallback ? *fallback : 0;
}

static __always_inline int selected(u32 pid) {
    u32 index = KVT_CONFIG_FILTER_ENABLED;
    u64 *enabled = config.lookup(&index);
    if (!enabled || *enabled == 0)
        return 1;
    return pid_filter.lookup(&pid) != 0;
}

/* 1 when this process is not to be traced (filter mode and pid not selected). */
static __always_inline int filtered_out(u32 pid) {
    if (selected(pid))
        return 0;
    count(KVT_COUNTER_FILTERED);
    return 1;
}

/* Older than this, an outer entry is stale (its return was never seen) and is not reused. */
#define KVT_OUTER_STACK_MAX_AGE_NS 1000000000ULL

static __always_inline int is_runtime_api(u32 api) { return api < 20; }

#if KVT_TASK_STORAGE
/* A runtime call's stack, for the driver calls it makes (python_stack_for_call). */
static __always_inline void remember_outer(u32 api, struct kvt_thread *thread, u64 stack_id, u64 status) {
    if (!is_runtime_api(api))
        return;
    thread->outer.stack_id = stack_id;
    thread->outer.stack_status = status;
    thread->outer.timestamp_ns = bpf_ktime_get_ns();
    thread->outer.api = api;
}

/* 1 when this is a driver call inside a runtime call on this thread: it takes that call's stack. */
static __always_inline int reuse_outer(u32 api, struct kvt_thread *thread, struct kvt_args *args) {
    struct kvt_outer_stack *outer = &thread->outer;
    if (is_runtime_api(api) || outer->api == 0 ||
        bpf_ktime_get_ns() - outer->timestamp_ns >= KVT_OUTER_STACK_MAX_AGE_NS)
        return 0;
    args->stack_id = outer->stack_id;
    args->stack_status = outer->stack_status;
    return 1;
}

/* The Python stack of a call whose arguments are saved: the outer call's, or walked by walk_stack,
 * which this hands the rest of the probe to (call_stack_walked stores what it walked). */
static __always_inline void python_stack_for_call(struct pt_regs *ctx, u32 api, struct kvt_thread *thread,
                                                  struct kvt_args *args) {
    if (reuse_outer(api, thread, args))
        return;
    if (!python_target(bpf_get_current_pid_tgid() >> 32)) {
        args->stack_status = KVT_STACK_NOT_PYTHON;
        remember_outer(api, thread, 0, KVT_STACK_NOT_PYTHON);
        return;
    }
    struct kvt_walk_request request = {.purpose = KVT_WALK_FOR_CALL, .api = api};
    tail_call_walker(ctx, &request); /* returns only without the walker: the call goes without a stack */
}

/* walk_stack's end for an entry probe: the stack goes with the call's saved arguments. */
static __always_inline void call_stack_walked(u32 api, u64 stack_id, u64 status) {
    struct kvt_thread *thread = this_thread(0);
    if (!thread || api >= KVT_API_SLOTS)
        return;
    thread->args[api].stack_id = stack_id;
    thread->args[api].stack_status = status;
    remember_outer(api, thread, stack_id, status);
}

static __always_inline u64 process_generation(void) {
    u32 index = KVT_CONFIG_PROCESS_GENERATION;
    u64 *generation = config.lookup(&index);
    return generation ? *generation : 0;
}

static __always_inline int save_entry_common(struct pt_regs *ctx, u32 api, int with_stack) {
    if (api >= KVT_API_SLOTS)
        return 0; /* no slot: never the case for the APIs probed with it */
    /* A thread remembers its process's settings until user space changes any (kvt_thread.checked_in).
     * Unselected threads get no storage. */
    struct kvt_thread *thread = this_thread(0);
    u64 checked_in = process_generation() + 1;
    if (!thread || thread->checked_in != checked_in) {
        if (filtered_out(bpf_get_current_pid_tgid() >> 32))
            return 0;
        if (!thread)
            thread = this_thread(1);
        if (!thread)
            return 0; /* no memory for it: the return counts as unpaired */
        thread->process_default_device = default_device();
        thread->checked_in = checked_in;
    }
    struct kvt_args *args = &thread->args[api];
    args->arg[0] = PT_REGS_PARM1(ctx);
    args->arg[1] = PT_REGS_PARM2(ctx);
    args->arg[2] = PT_REGS_PARM3(ctx);
    args->arg[3] = PT_REGS_PARM4(ctx);
    args->stack_id = 0;
    args->stack_status = with_stack ? stack_status_unwalked() : KVT_STACK_NOT_WALKED;
    args->in_flight = 1;
    if (with_stack && KVT_PYTHON_STACKS)
        python_stack_for_call(ctx, api, thread, args); /* last: it may end in the walker */
    return 0;
}
#else
static __always_inline void remember_outer(u32 api, u32 tid, u64 stack_id, u64 status) {
    if (!is_runtime_api(api))
        return;
    struct kvt_outer_stack outer = {stack_id, status, bpf_ktime_get_ns(), api, 0};
    outer_stack.update(&tid, &outer);
}

static __always_inline int reuse_outer(u32 api, u32 tid, struct kvt_args *args) {
    if (is_runtime_api(api))
        return 0;
    struct kvt_outer_stack *outer = outer_stack.lookup(&tid);
    if (!outer || bpf_ktime_get_ns() - outer->timestamp_ns >= KVT_OUTER_STACK_MAX_AGE_NS)
        return 0;
    args->stack_id = outer->stack_id;
    args->stack_status = outer->stack_status;
    return 1;
}

static __always_inline void call_stack_walked(u32 api, u64 stack_id, u64 status) {
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct kvt_args_key key = {.tid = tid, .api = api};
    struct kvt_args *args = saved_args.lookup(&key);
    if (args) {
        args->stack_id = stack_id;
        args->stack_status = status;
    }
    remember_outer(api, tid, stack_id, status);
}

static __always_inline int save_entry_common(struct pt_regs *ctx, u32 api, int with_stack) {
    u64 pid_tgid = bpf_get_current_pid_tgid();
    u32 pid = pid_tgid >> 32, tid = (u32)pid_tgid;
    if (filtered_out(pid))
        return 0;
    struct kvt_args_key key = {.tid = tid, .api = api};
    struct kvt_args args = {};
    args.arg[0] = PT_REGS_PARM1(ctx);
    args.arg[1] = PT_REGS_PARM2(ctx);
    args.arg[2] = PT_REGS_PARM3(ctx);
    args.arg[3] = PT_REGS_PARM4(ctx);
    args.stack_status = with_stack ? stack_status_unwalked() : KVT_STACK_NOT_WALKED;
    int walk = with_stack && KVT_PYTHON_STACKS && !reuse_outer(api, tid, &args);
    if (walk && !python_target(pid)) {
        args.stack_status = KVT_STACK_NOT_PYTHON;
        remember_outer(api, tid, 0, KVT_STACK_NOT_PYTHON);
        walk = 0;
    }
    saved_args.update(&key, &args);
    if (walk) {
        struct kvt_walk_request request = {.purpose = KVT_WALK_FOR_CALL, .api = api};
        tail_call_walker(ctx, &request); /* returns only without the walker: no stack */
    }
    return 0;
}
#endif

static __always_inline int save_entry(struct pt_regs *ctx, u32 api) {
    return save_entry_common(ctx, api, 0);
}

/* Entry of an allocation call: also walks the Python stack of the calling thread. */
static __always_inline int save_alloc_entry(struct pt_regs *ctx, u32 api) {
    return save_entry_common(ctx, api, 1);
}

/* Takes the saved entry of this (thread, API) into *out; 0 when there was none. With task storage
 * the return of a runtime call also ends its outer stack (a driver call after it is the program's
 * own); without, alloc_return deletes it.
 *
 * The caller's address comes from the return probe, not the entry's: the kernel puts the return
 * address it took over back into the registers before return probes run, so reading it off the user
 * stack at entry (a bpf_probe_read_user per call) gave the same number at a cost. */
#if KVT_TASK_STORAGE
static __always_inline int take_thread_entry(struct kvt_thread *thread, struct pt_regs *ctx, u32 api,
                                             struct kvt_args *out) {
    struct kvt_args *args = thread && api < KVT_API_SLOTS ? &thread->args[api] : 0;
    if (!args || !args->in_flight) {
        if (selected(bpf_get_current_pid_tgid() >> 32))
            count(KVT_COUNTER_RETURNS_UNPAIRED);
        return 0;
    }
    __builtin_memcpy(out, args, sizeof(*out));
    out->caller_address = PT_REGS_IP(ctx);
    args->in_flight = 0;
    if (thread->outer.api == api)
        thread->outer.api = 0;
    return 1;
}

static __always_inline int take_entry(struct pt_regs *ctx, u32 api, struct kvt_args *out) {
    return take_thread_entry(this_thread(0), ctx, api, out);
}
#else
static __always_inline int take_entry(struct pt_regs *ctx, u32 api, struct kvt_args *out) {
    u64 pid_tgid = bpf_get_current_pid_tgid();
    struct kvt_args_key key = {.tid = (u32)pid_tgid, .api = api};
    struct kvt_args *args = saved_args.lookup(&key);
    if (!args) {
        if (selected(pid_tgid >> 32))
            count(KVT_COUNTER_RETURNS_UNPAIRED);
        return 0;
    }
    __builtin_memcpy(out, args, sizeof(*out));
    out->caller_address = PT_REGS_IP(ctx);
    saved_args.delete(&key);
    return 1;
}
#endif

#if KVT_TASK_STORAGE
/* current_device of the thread whose storage this is (NULL: none yet). The process's default as the
 * thread read it, while user space has changed no process's settings since (else the map's). */
static __always_inline s32 thread_device_of(struct kvt_thread *thread) {
    if (thread && thread->device_set)
        return thread->device;
    if (thread && thread->checked_in == process_generation() + 1)
        return thread->process_default_device;
    return default_device();
}
#endif

static __always_inline s32 current_device(u32 tid) {
#if KVT_TASK_STORAGE
    return thread_device_of(this_thread(0));
#else
    s32 *device = thread_device.lookup(&tid);
    return device ? *device : default_device();
#endif
}

/* take_entry, and then the calling thread's current_device where `on_device` (with task storage, from the
 * storage the entry came from: one lookup of it per return, not two); else KVT_DEVICE_UNKNOWN. `tracked`:
 * the thread's flag for mark_tracked, NULL where it has none (KVT_TRACKED_IN_THREAD 0). */
static __always_inline int take_entry_on_device(struct pt_regs *ctx, u32 api, struct kvt_args *out, int on_device,
                                                s32 *device, u32 **tracked) {
#if KVT_TASK_STORAGE
    struct kvt_thread *thread = this_thread(0);
    if (!take_thread_entry(thread, ctx, api, out))
        return 0;
    *device = on_device ? thread_device_of(thread) : KVT_DEVICE_UNKNOWN;
    *tracked = KVT_TRACKED_IN_THREAD ? &thread->process_tracked : 0;
#else
    if (!take_entry(ctx, api, out))
        return 0;
    *device = on_device ? current_device((u32)bpf_get_current_pid_tgid()) : KVT_DEVICE_UNKNOWN;
    *tracked = 0;
#endif
    return 1;
}

/* `tid` is the calling thread's (with task storage, its storage is where the device goes). */
static __always_inline void set_thread_device(u32 tid, s32 device) {
    device = bounded_device(device);
#if KVT_TASK_STORAGE
    struct kvt_thread *thread = this_thread(1);
    if (thread) {
        thread->device = device;
        thread->device_set = 1;
    }
#else
    thread_device.update(&tid, &device);
#endif
}

/* (CUcontext *pctx, ..., CUdevice dev): remember which device a context belongs to. */
static __always_inline void remember_context(u64 pctx, s32 device) {
    u64 context = 0;
    bpf_probe_read_user(&context, sizeof(context), (void *)pctx);
    struct kvt_ctx_key key = {.pid = bpf_get_current_pid_tgid() >> 32, .ctx = context};
    device = bounded_device(device);
    context_device.update(&key, &device);
}

static __always_inline s32 context_to_device(u64 context) {
    struct kvt_ctx_key key = {.pid = bpf_get_current_pid_tgid() >> 32, .ctx = context};
    s32 *device = context_device.lookup(&key);
    return device ? *device : KVT_DEVICE_UNKNOWN;
}

/* ---- probes: the current device of a thread, and the device of each context ---- */

int entry_cudaSetDevice(struct pt_regs *ctx) { return save_entry(ctx, KVT_API_cudaSetDevice); }
int return_cudaSetDevice(struct pt_regs *ctx) {
    struct kvt_args args;
    if (!take_entry(ctx, KVT_API_cudaSetDevice, &args))
        return 0;
    s32 rc = (s32)PT_REGS_RC(ctx);
    s32 device = bounded_device((s32)args.arg[0]);
    if (rc == 0)
        set_thread_device((u32)bpf_get_current_pid_tgid(), device);
    emit(KVT_KIND_SET_DEVICE, KVT_API_cudaSetDevice, KVT_LAYER_RUNTIME, 0, 0, 0, 0, device, rc,
         args.caller_address, 0);
    return 0;
}


int entry_cuDevicePrimaryCtxRetain(struct pt_regs *ctx) {
    return save_entry(ctx, KVT_API_cuDevicePrimaryCtxRetain);
}
int return_cuDevicePrimaryCtxRetain(struct pt_regs *ctx) {
    struct kvt_args args;
    if (!take_entry(ctx, KVT_API_cuDevicePrimaryCtxRetain, &args))
        return 0;
    if ((s32)PT_REGS_RC(ctx) == 0)
        remember_context(args.arg[0], (s32)args.arg[1]);
    return 0;
}

int entry_cuCtxCreate_v2(struct pt_regs *ctx) { return save_entry(ctx, KVT_API_cuCtxCreate_v2); }
int return_cuCtxCreate_v2(struct pt_regs *ctx) {
    struct kvt_args args;
    if (!take_entry(ctx, KVT_API_cuCtxCreate_v2, &args))
        return 0;
    if ((s32)PT_REGS_RC(ctx) != 0)
        return 0;
    /* cuCtxCreate(CUcontext *pctx, unsigned flags, CUdevice dev) also makes it current. */
    remember_context(args.arg[0], (s32)args.arg[2]);
    set_thread_device((u32)bpf_get_current_pid_tgid(), (s32)args.arg[2]);
    return 0;
}


int entry_cuCtxSetCurrent(struct pt_regs *ctx) { return save_entry(ctx, KVT_API_cuCtxSetCurrent); }
int return_cuCtxSetCurrent(struct pt_regs *ctx) {
    struct kvt_args args;
    if (!take_entry(ctx, KVT_API_cuCtxSetCurrent, &args))
        return 0;
    if ((s32)PT_REGS_RC(ctx) != 0 || args.arg[0] == 0)
        return 0;
    s32 device = context_to_device(args.arg[0]);
    u32 tid = (u32)bpf_get_current_pid_tgid();
    if (device != KVT_DEVICE_UNKNOWN && device != current_device(tid)) {
        set_thread_device(tid, device);
        emit(KVT_KIND_SET_DEVICE, KVT_API_cuCtxSetCurrent, KVT_LAYER_DRIVER, 0, 0, args.arg[0], 0,
             device, 0, args.caller_address, 0);
    }
    return 0;
}

/* The ledger entries of a destroyed context are dropped by user space (it can iterate the map);
 * the event carries the context's device and the timestamp that bounds which entries go. */
int entry_cuCtxDestroy_v2(struct pt_regs *ctx) { return save_entry(ctx, KVT_API_cuCtxDestroy_v2); }
int return_cuCtxDestroy_v2(struct pt_regs *ctx) {
    struct kvt_args args;
    if (!take_entry(ctx, KVT_API_cuCtxDestroy_v2, &args))
        return 0;
    s32 rc = (s32)PT_REGS_RC(ctx);
    s32 device = context_to_device(args.arg[0]);
    if (rc == 0) {
        struct kvt_ctx_key key = {.pid = bpf_get_current_pid_tgid() >> 32, .ctx = args.arg[0]};
        context_device.delete(&key);
    }
    emit(KVT_KIND_CONTEXT_DESTROY, KVT_API_cuCtxDestroy_v2, KVT_LAYER_DRIVER, 0, 0, args.arg[0], 0,
         device, rc, args.caller_address, 0);
    return 0;
}

#endif
