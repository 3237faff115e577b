/* kvtrace.bpf.c — uprobes on the CUDA runtime, driver and VMM allocation functions: the one
 * compile unit.
 *
 * Entry probes save the arguments per (thread, API); return probes read the out-parameters, keep the
 * in-kernel ledger of outstanding objects exact and emit one event per call. The ledger lives here,
 * not in user space, so that it stays exact when the ring buffer overflows: a lost event is only a
 * lost notification, counted in KVT_COUNTER_EVENTS_LOST.
 *
 * Each concern lives in a header, included in dependency order: what reaches user space (emit.h),
 * the Python stack walk (pystack.h), what each user may hold of the shared maps and the bounds of
 * figures a process chooses (shares.h), the context of a call and the device probes (context.h), the
 * ledger with the allocation and free returns (ledger.h), VMM (vmm.h), PyTorch's allocator
 * through its USDT probes (usdt.h). This file lists the plain
 * allocation and free probes and the tracepoints. Settings Python owns arrive as defines
 * (sources/bpf/loader.py ProbeSettings.cflags); settings.h refuses to compile without them.
 */
#include <uapi/linux/ptrace.h>
#include "kvtrace.h"
#include "settings.h"
#include "emit.h"
#include "pystack.h"
#include "shares.h"
#include "context.h"
#include "ledger.h"
#include "vmm.h"
#include "usdt.h"

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

/* ---- the Python stack walk: one program, tail-called by the probes that want a stack (pystack.h) ---- */
int walk_stack(struct pt_regs *ctx) {
    u32 zero = 0;
    struct kvt_scratch *s = scratch.lookup(&zero);
    if (!s)
        return 0;
    struct kvt_walk_request request = s->request; /* the walk reuses the scratch */
    if (request.pid_tgid != bpf_get_current_pid_tgid()) {
        /* Another thread's probe on this CPU wrote its request over this one's (a preemptible kernel):
         * this probe's own purpose is gone with it. A call goes without a stack; a block, already in
         * the ledger, without its event. Not knowing which, it is counted as a lost event too, so that
         * the agent counts again from the kernel (needlessly, for a call). */
        count(KVT_COUNTER_STACK_WALKS_PREEMPTED);
        count(KVT_COUNTER_EVENTS_LOST);
        return 0;
    }
    u64 status = KVT_STACK_NOT_WALKED;
    u64 stack_id = walk_python_stack(bpf_get_current_pid_tgid() >> 32, &status);
    if (request.purpose == KVT_WALK_FOR_CALL)
        call_stack_walked(request.api, stack_id, status);
    else if (request.purpose == KVT_WALK_FOR_BLOCK)
        block_event(&request, stack_id, status);
    return 0;
}

/* ---- process exit: user space drops the ledger entries of the pid (older than this event) ---- */
TRACEPOINT_PROBE(sched, sched_process_exit) {
    u64 pid_tgid = bpf_get_current_pid_tgid();
    u32 pid = pid_tgid >> 32;
#if KVT_EXIT_GROUP_DEAD
    if (!args->group_dead)
        return 0; /* not the process's last thread */
#else
    if ((u32)pid_tgid != pid)
        return 0; /* a thread, not the group leader */
#endif
    process_device.delete(&pid); /* a later process with this pid starts on CUDA's default */
    shares_release(pid);         /* what it held goes back to its user */
    if (!tracked_pids.lookup(&pid))
        return 0;
    /* Forgotten only once user space is told: when the ring is full, the sweep after the loss (or every
     * tracked_read_seconds) finds the pid still tracked and drops what it held. */
    /* do_exit() stores the wait status before this tracepoint: (status << 8), or the signal; this thread's
     * (the last one's, with group_dead), which is the process's after exit() or a fatal signal (the group's
     * code), not where threads left one by one with codes of their own (SYS_exit, io_uring workers). */
    s32 wait_status = 0;
    if (KVT_TASK_EXIT_CODE_OFFSET >= 0) {
        struct task_struct *task = (struct task_struct *)bpf_get_current_task();
        bpf_probe_read_kernel(&wait_status, sizeof(wait_status), (void *)task + KVT_TASK_EXIT_CODE_OFFSET);
    }
    if (emit(KVT_KIND_PROCESS_EXIT, KVT_API_PROCESS_EXIT, 0, 0, 0, 0, 0, KVT_DEVICE_UNKNOWN, wait_status, 0, 0) == 0)
        tracked_pids.delete(&pid);
    return 0;
}


/* ---- discovery: exec and executable mmap ask user space to rescan the process ---- */

TRACEPOINT_PROBE(sched, sched_process_exec) {
    /* A new program has no CUDA state yet: no call in flight, no device selected. */
#if KVT_TASK_STORAGE
    threads.task_storage_delete(bpf_get_current_task_btf());
#else
    u32 tid = (u32)bpf_get_current_pid_tgid();
    thread_device.delete(&tid);
    outer_stack.delete(&tid);
#endif
    notify_user(KVT_NOTIFY_EXEC);
    return 0;
}

/* dlopen maps a library's code with PROT_EXEC (0x4) from a file descriptor. */
TRACEPOINT_PROBE(syscalls, sys_enter_mmap) {
    if ((args->prot & 0x4) && (long)args->fd >= 0)
        notify_user(KVT_NOTIFY_MMAP_EXEC);
    return 0;
}
