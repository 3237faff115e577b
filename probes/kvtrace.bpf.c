/* kvtrace.bpf.c — uprobes on the CUDA runtime, driver and VMM allocation functions.
 *
 * Entry probes save the arguments per (thread, API); return probes read the out-parameters, keep the
 * in-kernel ledger of outstanding objects exact and emit one event per call. The ledger lives here,
 * not in user space, so that it stays exact when the ring buffer overflows: a lost event is only a
 * lost notification, counted in KVT_COUNTER_EVENTS_LOST.
 *
 * Compile-time settings (bcc cflags): KVT_MAX_LEDGER_ENTRIES, KVT_RINGBUF_PAGES, KVT_MAX_THREADS.
 */
#include <uapi/linux/ptrace.h>
#include "kvtrace.h"

#ifndef KVT_MAX_LEDGER_ENTRIES
#define KVT_MAX_LEDGER_ENTRIES 1048576
#endif
#ifndef KVT_RINGBUF_PAGES
#define KVT_RINGBUF_PAGES 1024
#endif
#ifndef KVT_MAX_THREADS
#define KVT_MAX_THREADS 65536
#endif
#ifndef KVT_MAX_STACKS
#define KVT_MAX_STACKS 16384
#endif
/* Offset of thread.fsbase in task_struct, from this kernel's BTF (sources/bpf/btf.py); the
 * headers bcc compiles with may describe another kernel. -1: no Python stacks. */
#ifndef KVT_TASK_FSBASE_OFFSET
#define KVT_TASK_FSBASE_OFFSET -1
#endif
/* Events submitted on a CPU before the reader is woken; the rest the reader takes on its timer
 * (Tracer.run_once). Every wakeup costs the traced thread an interrupt on the spot (on a virtual
 * machine, an exit to the hypervisor): one per event was a large part of a probe's cost. */
#ifndef KVT_WAKEUP_EVENTS
#define KVT_WAKEUP_EVENTS 512
#endif
/* glibc struct pthread: specific_1stblock[32] of {seq, data} (see sources/pyoffsets.py) */
#define KVT_GLIBC_SPECIFIC_1STBLOCK 0x310
/* cuMemUnmap may cover several mappings; this bounds the loop the verifier must accept. */
#define KVT_MAX_UNMAP_SPAN 32

struct kvt_args_key {
    u32 tid;
    u32 api;
};

struct kvt_args {
    u64 arg[4];
    u64 caller_address;
    u64 stack_id;
    u64 stack_status;
};

struct kvt_ctx_key {
    u32 pid;
    u32 reserved;
    u64 ctx;
};

BPF_RINGBUF_OUTPUT(events, KVT_RINGBUF_PAGES);
BPF_RINGBUF_OUTPUT(notify, 16);
BPF_TABLE("lru_hash", struct kvt_args_key, struct kvt_args, saved_args, KVT_MAX_THREADS);
BPF_TABLE("lru_hash", u32, s32, thread_device, KVT_MAX_THREADS);
BPF_TABLE("lru_hash", struct kvt_ctx_key, s32, context_device, 4096);
BPF_HASH(ledger, struct kvt_ledger_key, struct kvt_ledger_value, KVT_MAX_LEDGER_ENTRIES);
BPF_HASH(tracked_pids, u32, u64, 65536);
BPF_HASH(pid_filter, u32, u8, 65536);
BPF_ARRAY(config, u64, KVT_CONFIG_COUNT);
BPF_HASH(py_targets, u32, struct kvt_py_target, 65536);
BPF_TABLE("lru_hash", u64, struct kvt_stack, stacks, KVT_MAX_STACKS);

/* Scratch space too big for the 512-byte BPF stack: one stack being built and one frame read. */
struct kvt_scratch {
    struct kvt_stack stack;
    u64 hash;
    u8 frame[KVT_FRAME_READ_MAX];
};
BPF_PERCPU_ARRAY(scratch, struct kvt_scratch, 1);
BPF_PERCPU_ARRAY(counters, u64, KVT_COUNTER_COUNT);
BPF_PERCPU_ARRAY(unwoken_events, u64, 1);  /* events since this CPU last woke the reader */

static __always_inline u64 wakeup_flag(void) {
    u32 zero = 0;
    u64 *unwoken = unwoken_events.lookup(&zero);
    if (!unwoken || ++*unwoken >= KVT_WAKEUP_EVENTS) {
        if (unwoken)
            *unwoken = 0;
        return BPF_RB_FORCE_WAKEUP;
    }
    return BPF_RB_NO_WAKEUP;
}

static __always_inline void count(u32 index) {
    u64 *value = counters.lookup(&index);
    if (value)
        *value += 1;
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

static __always_inline u64 walk_python_stack(u32 pid, u64 *status);

/* The stack of a runtime allocation in progress on this thread: the driver allocation it makes
 * (cudaMalloc -> cuMemAlloc_v2) has the same Python stack, so it is walked once, not twice. */
struct kvt_outer_stack {
    u64 stack_id;
    u64 stack_status;
    u64 timestamp_ns;
};
BPF_TABLE("lru_hash", u32, struct kvt_outer_stack, outer_stack, KVT_MAX_THREADS);
/* Older than this, an outer entry is stale (its return was never seen) and is not reused. */
#define KVT_OUTER_STACK_MAX_AGE_NS 1000000000ULL

static __always_inline int is_runtime_api(u32 api) { return api < 20; }

static __always_inline void python_stack_for_call(u32 api, u32 tid, struct kvt_args *args) {
    u64 now = bpf_ktime_get_ns();
    if (!is_runtime_api(api)) {
        struct kvt_outer_stack *outer = outer_stack.lookup(&tid);
        if (outer && now - outer->timestamp_ns < KVT_OUTER_STACK_MAX_AGE_NS) {
            args->stack_id = outer->stack_id;
            args->stack_status = outer->stack_status;
            return;
        }
    }
    args->stack_id = walk_python_stack(bpf_get_current_pid_tgid() >> 32, &args->stack_status);
    if (is_runtime_api(api)) {
        struct kvt_outer_stack outer = {args->stack_id, args->stack_status, now};
        outer_stack.update(&tid, &outer);
    }
}

static __always_inline int save_entry_common(struct pt_regs *ctx, u32 api, int with_stack) {
    u64 pid_tgid = bpf_get_current_pid_tgid();
    if (filtered_out(pid_tgid >> 32))
        return 0;
    struct kvt_args_key key = {.tid = (u32)pid_tgid, .api = api};
    struct kvt_args args = {};
    if (with_stack)
        python_stack_for_call(api, (u32)pid_tgid, &args);
    args.arg[0] = PT_REGS_PARM1(ctx);
    args.arg[1] = PT_REGS_PARM2(ctx);
    args.arg[2] = PT_REGS_PARM3(ctx);
    args.arg[3] = PT_REGS_PARM4(ctx);
    /* At function entry the return address is on top of the stack. */
    bpf_probe_read_user(&args.caller_address, sizeof(args.caller_address), (void *)PT_REGS_SP(ctx));
    saved_args.update(&key, &args);
    return 0;
}

static __always_inline int save_entry(struct pt_regs *ctx, u32 api) {
    return save_entry_common(ctx, api, 0);
}

/* Entry of an allocation call: also walks the Python stack of the calling thread. */
static __always_inline int save_alloc_entry(struct pt_regs *ctx, u32 api) {
    return save_entry_common(ctx, api, 1);
}

/* Takes the saved entry of this (thread, API) into *out; 0 when there was none. */
static __always_inline int take_entry(u32 api, struct kvt_args *out) {
    u64 pid_tgid = bpf_get_current_pid_tgid();
    struct kvt_args_key key = {.tid = (u32)pid_tgid, .api = api};
    struct kvt_args *args = saved_args.lookup(&key);
    if (!args) {
        if (selected(pid_tgid >> 32))
            count(KVT_COUNTER_RETURNS_UNPAIRED);
        return 0;
    }
    __builtin_memcpy(out, args, sizeof(*out));
    saved_args.delete(&key);
    return 1;
}

static __always_inline s32 current_device(u32 tid) {
    s32 *device = thread_device.lookup(&tid);
    return device ? *device : KVT_DEVICE_UNKNOWN;
}

static __always_inline void emit_stack(u8 kind, u16 api, u8 layer, u8 object, u8 memory, u64 address,
                                       u64 size_bytes, s32 device, s32 error_code, u64 caller, u64 aux,
                                       u64 stack_id, u8 stack_status) {
    struct kvt_event *e = events.ringbuf_reserve(sizeof(struct kvt_event));
    if (!e) {
        count(KVT_COUNTER_EVENTS_LOST);
        return;
    }
    u64 pid_tgid = bpf_get_current_pid_tgid();
    e->timestamp_ns = bpf_ktime_get_ns();
    e->address = address;
    e->size_bytes = size_bytes;
    e->caller_address = caller;
    e->aux = aux;
    e->pid = pid_tgid >> 32;
    e->tid = (u32)pid_tgid;
    e->device = device;
    e->error_code = error_code;
    e->api = api;
    e->kind = kind;
    e->layer = layer;
    e->object = object;
    e->memory = memory;
    e->stack_id = stack_id;
    e->stack_status = stack_status;
    e->reserved = 0;
    bpf_get_current_comm(&e->comm, sizeof(e->comm));
    events.ringbuf_submit(e, wakeup_flag());
    count(KVT_COUNTER_EVENTS_SUBMITTED);
}

static __always_inline void emit(u8 kind, u16 api, u8 layer, u8 object, u8 memory, u64 address,
                                 u64 size_bytes, s32 device, s32 error_code, u64 caller, u64 aux) {
    emit_stack(kind, api, layer, object, memory, address, size_bytes, device, error_code, caller, aux,
               0, KVT_STACK_NOT_WALKED);
}

static __always_inline void mark_tracked(u32 pid) {
    u64 one = 1;
    tracked_pids.update(&pid, &one);
}

/* Inserts an outstanding object into the in-kernel ledger. */
static __always_inline void ledger_insert(u8 layer, u8 object, u8 memory, u16 api, u64 address,
                                          u64 size_bytes, s32 device, u64 caller, u64 aux) {
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
    if (ledger.update(&key, &value) != 0)
        count(KVT_COUNTER_LEDGER_FULL);
    mark_tracked(key.pid);
}

/* Allocation return: reads *out_ptr and records the object. */
static __always_inline int alloc_return(struct pt_regs *ctx, u16 api, u8 layer, u8 object, u8 memory,
                                        int pitched) {
    struct kvt_args args;
    if (!take_entry(api, &args))
        return 0;
    s32 rc = (s32)PT_REGS_RC(ctx);
    u32 tid = (u32)bpf_get_current_pid_tgid();
    if (is_runtime_api(api))
        outer_stack.delete(&tid); /* the runtime call is over: its driver calls are done */
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
    ledger_insert(layer, object, memory, api, address, size_bytes, device, args.caller_address, 0);
    emit_stack(KVT_KIND_ALLOC, api, layer, object, memory, address, size_bytes, device, 0,
               args.caller_address, 0, args.stack_id, args.stack_status);
    return 0;
}

/* Free return: the address is the first argument. */
static __always_inline int free_return(struct pt_regs *ctx, u16 api, u8 layer, u8 object, u8 memory) {
    struct kvt_args args;
    if (!take_entry(api, &args))
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
    struct kvt_ledger_key key = {.pid = bpf_get_current_pid_tgid() >> 32, .layer = layer,
                                 .object = object, .address = address};
    struct kvt_ledger_value *value = ledger.lookup(&key);
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

/* Generates the entry and return probe of one API. */
#define KVT_ALLOC_API(name, layer, memory)                                                        \
    int entry_##name(struct pt_regs *ctx) { return save_alloc_entry(ctx, KVT_API_##name); }       \
    int return_##name(struct pt_regs *ctx) {                                                      \
        return alloc_return(ctx, KVT_API_##name, layer, KVT_OBJECT_ALLOCATION, memory, 0);        \
    }
#define KVT_PITCH_API(name, layer)                                                                \
    int entry_##name(struct pt_regs *ctx) { return save_alloc_entry(ctx, KVT_API_##name); }       \
    int return_##name(struct pt_regs *ctx) {                                                      \
        return alloc_return(ctx, KVT_API_##name, layer, KVT_OBJECT_ALLOCATION, KVT_MEMORY_DEVICE, 1); \
    }
#define KVT_FREE_API(name, layer, memory)                                                         \
    int entry_##name(struct pt_regs *ctx) { return save_entry(ctx, KVT_API_##name); }             \
    int return_##name(struct pt_regs *ctx) {                                                      \
        return free_return(ctx, KVT_API_##name, layer, KVT_OBJECT_ALLOCATION, memory);            \
    }

KVT_ALLOC_API(cudaMalloc, KVT_LAYER_RUNTIME, KVT_MEMORY_DEVICE)
KVT_ALLOC_API(cudaMallocAsync, KVT_LAYER_RUNTIME, KVT_MEMORY_DEVICE)
KVT_ALLOC_API(cudaMallocManaged, KVT_LAYER_RUNTIME, KVT_MEMORY_MANAGED)
KVT_ALLOC_API(cudaMallocHost, KVT_LAYER_RUNTIME, KVT_MEMORY_HOST)
KVT_ALLOC_API(cudaHostAlloc, KVT_LAYER_RUNTIME, KVT_MEMORY_HOST)
KVT_PITCH_API(cudaMallocPitch, KVT_LAYER_RUNTIME)
KVT_FREE_API(cudaFree, KVT_LAYER_RUNTIME, KVT_MEMORY_DEVICE)
KVT_FREE_API(cudaFreeAsync, KVT_LAYER_RUNTIME, KVT_MEMORY_DEVICE)
KVT_FREE_API(cudaFreeHost, KVT_LAYER_RUNTIME, KVT_MEMORY_HOST)

KVT_ALLOC_API(cuMemAlloc_v2, KVT_LAYER_DRIVER, KVT_MEMORY_DEVICE)
KVT_ALLOC_API(cuMemAllocAsync, KVT_LAYER_DRIVER, KVT_MEMORY_DEVICE)
KVT_ALLOC_API(cuMemAllocManaged, KVT_LAYER_DRIVER, KVT_MEMORY_MANAGED)
KVT_ALLOC_API(cuMemAllocHost_v2, KVT_LAYER_DRIVER, KVT_MEMORY_HOST)
KVT_ALLOC_API(cuMemHostAlloc, KVT_LAYER_DRIVER, KVT_MEMORY_HOST)
KVT_PITCH_API(cuMemAllocPitch_v2, KVT_LAYER_DRIVER)
KVT_FREE_API(cuMemFree_v2, KVT_LAYER_DRIVER, KVT_MEMORY_DEVICE)
KVT_FREE_API(cuMemFreeAsync, KVT_LAYER_DRIVER, KVT_MEMORY_DEVICE)
KVT_FREE_API(cuMemFreeHost, KVT_LAYER_DRIVER, KVT_MEMORY_HOST)

/* ---- current device per thread ---- */

static __always_inline void set_thread_device(u32 tid, s32 device) {
    thread_device.update(&tid, &device);
}

int entry_cudaSetDevice(struct pt_regs *ctx) { return save_entry(ctx, KVT_API_cudaSetDevice); }
int return_cudaSetDevice(struct pt_regs *ctx) {
    struct kvt_args args;
    if (!take_entry(KVT_API_cudaSetDevice, &args))
        return 0;
    s32 rc = (s32)PT_REGS_RC(ctx);
    s32 device = (s32)args.arg[0];
    if (rc == 0)
        set_thread_device((u32)bpf_get_current_pid_tgid(), device);
    emit(KVT_KIND_SET_DEVICE, KVT_API_cudaSetDevice, KVT_LAYER_RUNTIME, 0, 0, 0, 0, device, rc,
         args.caller_address, 0);
    return 0;
}

/* (CUcontext *pctx, ..., CUdevice dev): remember which device a context belongs to. */
static __always_inline void remember_context(u64 pctx, s32 device) {
    u64 context = 0;
    bpf_probe_read_user(&context, sizeof(context), (void *)pctx);
    struct kvt_ctx_key key = {.pid = bpf_get_current_pid_tgid() >> 32, .ctx = context};
    context_device.update(&key, &device);
}

int entry_cuDevicePrimaryCtxRetain(struct pt_regs *ctx) {
    return save_entry(ctx, KVT_API_cuDevicePrimaryCtxRetain);
}
int return_cuDevicePrimaryCtxRetain(struct pt_regs *ctx) {
    struct kvt_args args;
    if (!take_entry(KVT_API_cuDevicePrimaryCtxRetain, &args))
        return 0;
    if ((s32)PT_REGS_RC(ctx) == 0)
        remember_context(args.arg[0], (s32)args.arg[1]);
    return 0;
}

int entry_cuCtxCreate_v2(struct pt_regs *ctx) { return save_entry(ctx, KVT_API_cuCtxCreate_v2); }
int return_cuCtxCreate_v2(struct pt_regs *ctx) {
    struct kvt_args args;
    if (!take_entry(KVT_API_cuCtxCreate_v2, &args))
        return 0;
    if ((s32)PT_REGS_RC(ctx) != 0)
        return 0;
    /* cuCtxCreate(CUcontext *pctx, unsigned flags, CUdevice dev) also makes it current. */
    remember_context(args.arg[0], (s32)args.arg[2]);
    set_thread_device((u32)bpf_get_current_pid_tgid(), (s32)args.arg[2]);
    return 0;
}

static __always_inline s32 context_to_device(u64 context) {
    struct kvt_ctx_key key = {.pid = bpf_get_current_pid_tgid() >> 32, .ctx = context};
    s32 *device = context_device.lookup(&key);
    return device ? *device : KVT_DEVICE_UNKNOWN;
}

int entry_cuCtxSetCurrent(struct pt_regs *ctx) { return save_entry(ctx, KVT_API_cuCtxSetCurrent); }
int return_cuCtxSetCurrent(struct pt_regs *ctx) {
    struct kvt_args args;
    if (!take_entry(KVT_API_cuCtxSetCurrent, &args))
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
    if (!take_entry(KVT_API_cuCtxDestroy_v2, &args))
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

/* ---- VMM: physical handles, reservations, mappings ---- */

static __always_inline struct kvt_ledger_value *vmm_lookup(u8 object, u64 address,
                                                          struct kvt_ledger_key *key) {
    key->pid = bpf_get_current_pid_tgid() >> 32;
    key->layer = KVT_LAYER_VMM;
    key->object = object;
    key->reserved = 0;
    key->address = address;
    return ledger.lookup(key);
}

/* cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
 * flags). prop->location is {type, id} at offset 8; type 1 = CU_MEM_LOCATION_TYPE_DEVICE. */
int entry_cuMemCreate(struct pt_regs *ctx) { return save_alloc_entry(ctx, KVT_API_cuMemCreate); }
int return_cuMemCreate(struct pt_regs *ctx) {
    struct kvt_args args;
    if (!take_entry(KVT_API_cuMemCreate, &args))
        return 0;
    s32 rc = (s32)PT_REGS_RC(ctx);
    s32 location[2] = {0, 0};
    bpf_probe_read_user(&location, sizeof(location), (void *)(args.arg[2] + 8));
    s32 device = location[0] == 1 ? location[1] : KVT_DEVICE_UNKNOWN;
    if (rc != 0) {
        emit_stack(KVT_KIND_ALLOC_FAILED, KVT_API_cuMemCreate, KVT_LAYER_VMM, KVT_OBJECT_VMM_HANDLE,
                   KVT_MEMORY_DEVICE, 0, args.arg[1], device, rc, args.caller_address, 0,
                   args.stack_id, args.stack_status);
        return 0;
    }
    u64 handle = 0;
    bpf_probe_read_user(&handle, sizeof(handle), (void *)args.arg[0]);
    ledger_insert(KVT_LAYER_VMM, KVT_OBJECT_VMM_HANDLE, KVT_MEMORY_DEVICE, KVT_API_cuMemCreate, handle,
                  args.arg[1], device, args.caller_address, 0);
    emit_stack(KVT_KIND_ALLOC, KVT_API_cuMemCreate, KVT_LAYER_VMM, KVT_OBJECT_VMM_HANDLE,
               KVT_MEMORY_DEVICE, handle, args.arg[1], device, 0, args.caller_address, 0,
               args.stack_id, args.stack_status);
    return 0;
}

/* cuMemRelease(handle): physical memory goes now, or at the last unmap if still mapped. */
int entry_cuMemRelease(struct pt_regs *ctx) { return save_entry(ctx, KVT_API_cuMemRelease); }
int return_cuMemRelease(struct pt_regs *ctx) {
    struct kvt_args args;
    if (!take_entry(KVT_API_cuMemRelease, &args))
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
    ledger.delete(&key);
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
    if (!take_entry(KVT_API_cuMemMap, &args))
        return 0;
    s32 rc = (s32)PT_REGS_RC(ctx);
    u64 va = args.arg[0], size_bytes = args.arg[1], handle = args.arg[3];
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
    ledger_insert(KVT_LAYER_VMM, KVT_OBJECT_VMM_MAPPING, KVT_MEMORY_NONE, KVT_API_cuMemMap, va,
                  size_bytes, device, args.caller_address, handle);
    emit(KVT_KIND_MAP, KVT_API_cuMemMap, KVT_LAYER_VMM, KVT_OBJECT_VMM_MAPPING, KVT_MEMORY_NONE, va,
         size_bytes, device, 0, args.caller_address, handle);
    return 0;
}

/* cuMemUnmap(CUdeviceptr ptr, size): drops every mapping in [ptr, ptr + size); a handle that was
 * released while mapped is freed at its last unmap. aux of the event = physical bytes freed. */
int entry_cuMemUnmap(struct pt_regs *ctx) { return save_entry(ctx, KVT_API_cuMemUnmap); }
int return_cuMemUnmap(struct pt_regs *ctx) {
    struct kvt_args args;
    if (!take_entry(KVT_API_cuMemUnmap, &args))
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
        ledger.delete(&mkey);
        struct kvt_ledger_key hkey;
        struct kvt_ledger_value *physical = vmm_lookup(KVT_OBJECT_VMM_HANDLE, handle, &hkey);
        if (physical) {
            u64 left = __sync_fetch_and_add(&physical->aux, -1) - 1;
            if (left == 0 && physical->released) {
                freed_bytes += physical->size_bytes;
                ledger.delete(&hkey);
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

/* ---- process exit: user space drops the ledger entries of the pid (older than this event) ---- */
TRACEPOINT_PROBE(sched, sched_process_exit) {
    u64 pid_tgid = bpf_get_current_pid_tgid();
    u32 pid = pid_tgid >> 32;
    if ((u32)pid_tgid != pid)
        return 0; /* a thread, not the process */
    if (!tracked_pids.lookup(&pid))
        return 0;
    tracked_pids.delete(&pid);
    emit(KVT_KIND_PROCESS_EXIT, KVT_API_PROCESS_EXIT, 0, 0, 0, 0, 0, KVT_DEVICE_UNKNOWN, 0, 0, 0);
    return 0;
}


/* ---- Python stacks ---- */

/* The calling thread's PyThreadState: glibc keeps pthread_getspecific(key) for keys < 32 in the
 * thread descriptor, which fs points to. The GIL is usually released around CUDA calls, so
 * "the current thread state" of the runtime would be NULL; the TSS slot is not. */
static __always_inline u64 python_thread_state(struct kvt_py_target *target) {
    if (KVT_TASK_FSBASE_OFFSET < 0)
        return 0;
    s32 key = -1;
    bpf_probe_read_user(&key, sizeof(key), (void *)target->tss_key_address);
    if (key < 0 || key >= 32)
        return 0;
    struct task_struct *task = (struct task_struct *)bpf_get_current_task();
    u64 fsbase = 0;
    bpf_probe_read_kernel(&fsbase, sizeof(fsbase), (void *)task + KVT_TASK_FSBASE_OFFSET);
    if (fsbase == 0)
        return 0;
    u64 tstate = 0;
    bpf_probe_read_user(&tstate, sizeof(tstate),
                        (void *)(fsbase + KVT_GLIBC_SPECIFIC_1STBLOCK + key * 16 + 8));
    return tstate;
}

static __always_inline u64 read_u64_at(u8 *base, s16 offset) {
    u64 value = 0;
    if (offset >= 0 && offset <= KVT_FRAME_READ_MAX - 8)
        __builtin_memcpy(&value, base + (offset & (KVT_FRAME_READ_MAX - 1)), sizeof(value));
    return value;
}

/* Frames read per walk: 3.12+ put an entry frame owned by the C stack (skipped, not counted) under
 * the first Python frame of every C -> Python call, so up to one per Python frame, plus one read
 * to see whether a frame is left beyond KVT_MAX_FRAMES. */
#define KVT_MAX_WALK_STEPS (2 * KVT_MAX_FRAMES + 1)

/* Walks up to KVT_MAX_FRAMES Python frames; returns the interned stack id (0 if none). */
static __always_inline u64 walk_python_stack(u32 pid, u64 *status) {
    struct kvt_py_target *target = py_targets.lookup(&pid);
    if (!target) {
        *status = KVT_STACK_NOT_PYTHON;
        return 0;
    }
    u64 tstate = python_thread_state(target);
    if (tstate == 0) {
        *status = KVT_STACK_NO_THREAD_STATE;
        return 0;
    }
    u64 frame = 0;
    if (bpf_probe_read_user(&frame, sizeof(frame), (void *)(tstate + target->tstate_frame)) != 0) {
        *status = KVT_STACK_READ_ERROR;
        return 0;
    }
    if (target->cframe_frame >= 0 && frame != 0)
        bpf_probe_read_user(&frame, sizeof(frame), (void *)(frame + target->cframe_frame));
    u32 zero = 0;
    struct kvt_scratch *s = scratch.lookup(&zero);
    if (!s) {
        *status = KVT_STACK_READ_ERROR;
        return 0;
    }
    u32 read_bytes = target->frame_read_bytes;
    if (read_bytes > KVT_FRAME_READ_MAX)
        read_bytes = KVT_FRAME_READ_MAX;
    /* depth and hash live in map memory, not registers: the verifier then sees one state per
     * iteration instead of one per path through it (a register counter blows up its search). */
    s->hash = 0xcbf29ce484222325ULL ^ pid;
    s->stack.depth = 0;
    for (int i = 0; i < KVT_MAX_WALK_STEPS && frame != 0; i++) {
        if (bpf_probe_read_user(s->frame, read_bytes, (void *)frame) != 0)
            break;
        u64 code = read_u64_at(s->frame, target->frame_code);
        u64 previous = read_u64_at(s->frame, target->frame_previous);
        u64 instr = read_u64_at(s->frame, target->frame_instr);
        if (target->instr_is_lasti)
            instr = (u32)instr;
        u8 owner = 0;
        if (target->frame_owner >= 0 && target->frame_owner < KVT_FRAME_READ_MAX)
            owner = s->frame[target->frame_owner & (KVT_FRAME_READ_MAX - 1)];
        if (owner == 3 || code == 0) { /* FRAME_OWNED_BY_CSTACK: an entry shim, not Python code */
            frame = previous;
            continue;
        }
        u32 depth = s->stack.depth;
        if (depth >= KVT_MAX_FRAMES)
            break; /* frame stays on this Python frame, which is left out: truncated */
        frame = previous;
        s->stack.frames[depth & (KVT_MAX_FRAMES - 1)].code = code;
        s->stack.frames[depth & (KVT_MAX_FRAMES - 1)].instr = instr;
        s->hash = (s->hash ^ code) * 0x100000001b3ULL;
        s->hash = (s->hash ^ instr) * 0x100000001b3ULL;
        s->stack.depth = depth + 1;
    }
    u32 depth = s->stack.depth;
    u64 hash = s->hash;
    if (depth == 0) {
        *status = KVT_STACK_EMPTY;
        return 0;
    }
    s->stack.pid = pid;
    s->stack.truncated = frame != 0;
    hash = (hash ^ depth ^ ((u64)s->stack.truncated << 32)) * 0x100000001b3ULL;
    if (hash == 0)
        hash = 1;
    if (!stacks.lookup(&hash))
        stacks.update(&hash, &s->stack);
    *status = KVT_STACK_OK;
    return hash;
}

/* ---- discovery: tell user space when a process may have new CUDA code to attach to ---- */
static __always_inline void notify_user(u32 reason) {
    struct kvt_notify *n = notify.ringbuf_reserve(sizeof(struct kvt_notify));
    if (!n)
        return; /* user space also rescans periodically */
    n->pid = bpf_get_current_pid_tgid() >> 32;
    n->reason = reason;
    notify.ringbuf_submit(n, 0);
}

TRACEPOINT_PROBE(sched, sched_process_exec) {
    notify_user(KVT_NOTIFY_EXEC);
    return 0;
}

/* dlopen maps a library's code with PROT_EXEC (0x4) from a file descriptor. */
TRACEPOINT_PROBE(syscalls, sys_enter_mmap) {
    if ((args->prot & 0x4) && (long)args->fd >= 0)
        notify_user(KVT_NOTIFY_MMAP_EXEC);
    return 0;
}
