/* kvtrace.h — the structs and constants shared by the BPF probes and user space.
 *
 * agent/kvtrace/sources/bpf/abi.py mirrors this file with ctypes; a unit test compares the two
 * (sizes, offsets and constants), so change both together.
 */
#ifndef KVTRACE_H
#define KVTRACE_H

/* Layers: the runtime says which API the program used; driver + vmm are physical device memory. */
#define KVT_LAYER_RUNTIME 1
#define KVT_LAYER_DRIVER  2
#define KVT_LAYER_VMM     3
#define KVT_LAYER_TORCH   4 /* PyTorch's caching allocator: blocks (tensors) inside the segments */

/* What a ledger entry is. */
#define KVT_OBJECT_ALLOCATION  1 /* cudaMalloc*, cuMemAlloc*: an address with a size */
#define KVT_OBJECT_VMM_HANDLE  2 /* cuMemCreate: physical memory, keyed by handle */
#define KVT_OBJECT_VMM_RESERVE 3 /* cuMemAddressReserve: virtual address range, no memory */
#define KVT_OBJECT_VMM_MAPPING 4 /* cuMemMap: a VA range backed by a handle */
#define KVT_OBJECT_BLOCK       5 /* pytorch:malloc: a tensor's block inside a segment */

/* Where the memory lives. */
#define KVT_MEMORY_DEVICE  1
#define KVT_MEMORY_HOST    2 /* pinned host memory (cudaMallocHost, cuMemHostAlloc) */
#define KVT_MEMORY_MANAGED 3
#define KVT_MEMORY_NONE    4 /* address space only (reservations, mappings) */

/* Event kinds, one per traced call (plus process exit). */
#define KVT_KIND_ALLOC           1
#define KVT_KIND_FREE            2
#define KVT_KIND_ALLOC_FAILED    3
#define KVT_KIND_FREE_FAILED     4
#define KVT_KIND_FREE_UNKNOWN    5 /* freed an address the ledger never saw (predates the agent) */
#define KVT_KIND_MAP             6
#define KVT_KIND_UNMAP           7
#define KVT_KIND_RELEASE         8 /* cuMemRelease of a handle still mapped: freed at last unmap */
#define KVT_KIND_SET_DEVICE      9
#define KVT_KIND_CONTEXT_DESTROY 10
#define KVT_KIND_PROCESS_EXIT    11

/* API ids. Runtime 1..19, driver 20..39, vmm 40..59. */
#define KVT_API_cudaMalloc          1
#define KVT_API_cudaFree            2
#define KVT_API_cudaMallocAsync     3
#define KVT_API_cudaFreeAsync       4
#define KVT_API_cudaMallocManaged   5
#define KVT_API_cudaMallocHost      6
#define KVT_API_cudaHostAlloc       7
#define KVT_API_cudaFreeHost        8
#define KVT_API_cudaMallocPitch     9
#define KVT_API_cudaSetDevice       10
#define KVT_API_cuMemAlloc_v2       20
#define KVT_API_cuMemFree_v2        21
#define KVT_API_cuMemAllocAsync     22
#define KVT_API_cuMemFreeAsync      23
#define KVT_API_cuMemAllocManaged   24
#define KVT_API_cuMemAllocPitch_v2  25
#define KVT_API_cuMemAllocHost_v2   26
#define KVT_API_cuMemHostAlloc      27
#define KVT_API_cuMemFreeHost       28
#define KVT_API_cuCtxSetCurrent     29
#define KVT_API_cuCtxDestroy_v2     30
#define KVT_API_cuDevicePrimaryCtxRetain 31
#define KVT_API_cuCtxCreate_v2      32
#define KVT_API_cuMemCreate         40
#define KVT_API_cuMemRelease        41
#define KVT_API_cuMemMap            42
#define KVT_API_cuMemUnmap          43
#define KVT_API_cuMemAddressReserve 44
#define KVT_API_cuMemAddressFree    45
#define KVT_API_PROCESS_EXIT        60
/* USDT probes of PyTorch's caching allocator (libc10_cuda.so, provider `pytorch`). */
#define KVT_API_pytorch_malloc      70
#define KVT_API_pytorch_free        71

#define KVT_DEVICE_UNKNOWN (-1)
/* Device ordinals a probe keeps: a process chooses them (cudaSetDevice, cuMemCreate's location, a USDT
 * argument), and every one would be a totals key and a /metrics series; beyond, a device is unknown. */
#define KVT_MAX_DEVICES 64

/* Indexes of the per-CPU counters array. */
#define KVT_COUNTER_EVENTS_SUBMITTED 0
#define KVT_COUNTER_EVENTS_LOST      1 /* ring buffer full: the event never reached user space */
#define KVT_COUNTER_LEDGER_FULL      2 /* the in-kernel ledger had no room: exactness lost */
#define KVT_COUNTER_UNKNOWN_FREES    3
#define KVT_COUNTER_RETURNS_UNPAIRED 4 /* a return without its saved entry (LRU evicted) */
#define KVT_COUNTER_FILTERED         5
#define KVT_COUNTER_BLOCKS_UNSENT    6 /* block events over a process's rate: ledger kept, event not sent */
#define KVT_COUNTER_USDT_UNREADABLE  7 /* a USDT probe whose site or arguments could not be read */
#define KVT_COUNTER_LEDGER_REPLACED  8 /* an allocation at an address the ledger still held (a free unseen) */
#define KVT_COUNTER_STACK_WALKS      9 /* Python stacks walked (each reads the whole chain again) */
#define KVT_COUNTER_STACK_WINDOWS    10 /* data-stack windows read: many frames in one read (3.11+) */
#define KVT_COUNTER_STACK_FRAME_READS 11 /* frames read one by one (3.10; generator, entry frames) */
#define KVT_COUNTER_STACK_WALKER_MISSING 12 /* walks not made: the walker program was not in place */
#define KVT_COUNTER_STACK_WALKS_PREEMPTED 13 /* walks (or their requests) another thread's probe on the
                                               * same CPU overwrote halfway: no stack; a request also
                                               * counts as a lost event (it may have been a block's) */
#define KVT_COUNTER_TOTALS_FULL      14 /* a change of allocations or blocks the totals map had no room
                                         * for: the agent's totals are off until those processes exit */
#define KVT_COUNTER_BLOCKS_SAMPLED   15 /* blocks subject to stack sampling that it chose: their stacks walked */
#define KVT_COUNTER_BLOCKS_NOT_SAMPLED 16 /* blocks subject to stack sampling that it passed over: no walk,
                                           * their events say KVT_STACK_NOT_SAMPLED (ledger exact all the same) */
#define KVT_COUNTER_BLOCKS_QUIET     17 /* block events not sent because nobody reads them whole
                                         * (KVT_CONFIG_QUIET_BLOCKS): no loss, the ledger is exact */
#define KVT_COUNTER_SHARE_FULL       18 /* ledger entries refused: their user's share was full (shares.h);
                                         * counted per process and user, not stored, no event sent */
#define KVT_COUNTER_SIZES_CLAMPED    19 /* sizes above KVT_MAX_OBJECT_BYTES, kept as that bound */
#define KVT_COUNTER_DEVICES_CLAMPED  20 /* device ordinals outside [0, KVT_MAX_DEVICES), kept as unknown */
#define KVT_COUNTER_STACK_THREAD_LISTS 21 /* thread states looked up in the interpreters' lists (3.15+: no
                                            * pthread key): once per thread, and again when its state changed */
#define KVT_COUNTER_SHARE_UIDS_FULL  22 /* processes of a user with no record of its own (uid_shares full):
                                         * charged to every user's record, under the users' share (shares.h) */
#define KVT_COUNTER_HOOK_ENTRIES_LOST 23 /* block entries of kvtrace's PyTorch hook the kernel could not take (a
                                          * batch unreadable or too long, the entries program not in place; a
                                          * batch another thread overwrote counts 1, however many it had left):
                                          * the ledger misses them (hook.h) */
#define KVT_COUNTER_COUNT            24

/* Index of the filter switch in the config array: 1 = only pids in pid_filter are traced. */
#define KVT_CONFIG_FILTER_ENABLED 0
#define KVT_CONFIG_BLOCK_EVENTS_PER_SECOND 1 /* per process; 0: no limit */
/* Raised by user space after every change of what it tells the probes per process (the filter's switch,
 * pid_filter, process_device): what a thread remembers of its process (task storage: selected, its
 * default device) holds only for the generation it was read in. Sound where loads are not reordered with
 * older loads (x86-64, as RingReader): a probe that reads the new generation then finds the maps as
 * changed before it. (The probes themselves delete a process's process_device at its exit without raising
 * it: the threads that remember it have ended, or, without group_dead, outlive a main thread that ended
 * first and keep a default that was right for their process.) */
#define KVT_CONFIG_PROCESS_GENERATION 2
/* Its name before 0576bc2, for the probes of older commits that benches compile beside this header
 * (bench/stack_overhead.py --baseline). */
#define KVT_CONFIG_FILTER_GENERATION KVT_CONFIG_PROCESS_GENERATION
/* Mean bytes between the PyTorch blocks whose stacks are walked (usdt.h block_walked): S of the heap
 * profilers' sampling. 0: every block's stack is walked. */
#define KVT_CONFIG_BLOCK_SAMPLE_BYTES 3
/* 1: a PyTorch block's events (allocation and free) are sent only for a block whose stack was walked;
 * the others go into the ledger and its totals only. User space sets it while no reader wants every
 * block (no subscriber, no recording): the kernel keeps the ledger exact without the events. */
#define KVT_CONFIG_QUIET_BLOCKS 4
#define KVT_CONFIG_COUNT          5

#define KVT_COMM_LEN 16

/* One ring-buffer record per traced call. 88 bytes, no implicit padding. */
struct kvt_event {
    u64 timestamp_ns;   /* bpf_ktime_get_ns() (CLOCK_MONOTONIC) at the call's return, or at the
                         * pytorch:malloc/free hit; an allocation's ledger entry has the same */
    u64 address;        /* device/host pointer, VMM handle or VA; context for set-device/destroy */
    u64 size_bytes;
    u64 caller_address; /* return address of the traced call: who called the CUDA API */
    u64 aux;            /* cuMemMap: the handle; cuMemUnmap: bytes of physical memory it freed;
                         * pytorch:malloc/free: the CUDA stream */
    u64 stack_id;       /* Python stack in the stacks map; 0 = none (stack_status says why) */
    u32 pid;
    u32 tid;
    s32 device;         /* CUDA ordinal, KVT_DEVICE_UNKNOWN when not known */
    s32 error_code;     /* cudaError_t / CUresult of the call (0 = success) */
    u16 api;
    u8 kind;
    u8 layer;
    u8 object;
    u8 memory;
    u8 stack_status;    /* KVT_STACK_* */
    u8 sampling;        /* pytorch:malloc: 1 = its stack was subject to sampling at the mean
                         * KVT_CONFIG_BLOCK_SAMPLE_BYTES (stack_status OK or another walk's outcome:
                         * chosen; KVT_STACK_NOT_SAMPLED: passed over), as its ledger entry's sample_kib
                         * says; 0 = exact, and in every other event. User space knows the mean it set */
    char comm[KVT_COMM_LEN];
};

/* Discovery notification: this process exec'd or mapped executable code; user space rescans it. */
#define KVT_NOTIFY_EXEC 1
#define KVT_NOTIFY_MMAP_EXEC 2

struct kvt_notify {
    u32 pid;
    u32 reason;
};

/* Python stacks, walked in the probe of allocation calls. */
#define KVT_MAX_FRAMES 64
#define KVT_FRAME_READ_MAX 128 /* bytes of one frame read at once (code, previous, instr, owner) */

#define KVT_STACK_NOT_WALKED      0 /* not an allocation call (or walk_stack not in place) */
#define KVT_STACK_OK              1
#define KVT_STACK_NOT_PYTHON      2 /* no supported Python runtime registered for this process */
#define KVT_STACK_NO_THREAD_STATE 3 /* this thread has no Python thread state */
#define KVT_STACK_READ_ERROR      4 /* target memory could not be read */
#define KVT_STACK_EMPTY           5 /* a thread state with no Python frame */
/* (6 is user space's UNRESOLVED) */
#define KVT_STACK_NOT_SAMPLED     7 /* a PyTorch block that stack sampling passed over: no walk made */

/* Per process: where its thread states are and how to walk its frames (sources/python/offsets.py). */
struct kvt_py_target {
    u64 tss_key_address;  /* &_PyRuntime.autoTSSkey._key in the target */
    s16 tstate_frame;
    s16 cframe_frame;     /* -1: tstate_frame leads directly to the frame */
    s16 frame_code;
    s16 frame_previous;
    s16 frame_instr;
    s16 frame_owner;      /* -1: no owner field (3.10) */
    u16 frame_read_bytes;
    u8 instr_is_lasti;    /* 3.10: a 4-byte int f_lasti instead of a pointer */
    u8 reserved;
    s16 tstate_datastack; /* PyThreadState.datastack_chunk, _top, _limit (3.11+); -1: none (3.10) */
    s16 tstate_base_frame; /* 3.15+: PyThreadState.base_frame, the interpreter's own frame under every
                            * thread's chain, where the walk ends without reading it; -1: none */
    u32 reserved3;
    /* 3.15+, where no pthread key leads to a thread's state (tss_key_address 0): &_PyRuntime.interpreters.head
     * in the target, and the fields that find the calling thread's state in that interpreter's list */
    u64 interpreters_head_address;
    s16 interp_threads_head; /* PyInterpreterState.threads.head */
    s16 tstate_prev;
    s16 tstate_next;
    s16 tstate_thread_id;    /* PyThreadState.thread_id: pthread_self(), the thread's fs base on glibc */
    s16 tstate_interp;       /* PyThreadState.interp */
    s16 interp_next;         /* PyInterpreterState.next: subinterpreters' threads are looked for too */
    u32 reserved5;
};

struct kvt_frame {
    u64 code;   /* code object address */
    u64 instr;  /* 3.10: f_lasti (code units); 3.11+: address of the current instruction */
};

struct kvt_stack {
    u32 pid;
    u16 depth;
    u8 truncated;
    u8 reserved;
    struct kvt_frame frames[KVT_MAX_FRAMES];
};

/* A USDT probe site, registered by user space under the link cookie that reaches the probe: what the
 * site is and where each argument is (sources/bpf/usdt.py parses the note's operands). */
#define KVT_USDT_MAX_ARGS 4
#define KVT_USDT_ARG_NONE     0
#define KVT_USDT_ARG_CONSTANT 1 /* value = displacement */
#define KVT_USDT_ARG_REGISTER 2 /* the pt_regs slot at reg_offset */
#define KVT_USDT_ARG_MEMORY   3 /* user memory at (pt_regs slot at reg_offset) + displacement */

struct kvt_usdt_arg {
    s64 displacement;
    s16 reg_offset;  /* byte offset in struct pt_regs */
    u8 kind;         /* KVT_USDT_ARG_* */
    u8 size_bytes;   /* 1, 2, 4 or 8 */
    u8 is_signed;    /* sign-extend from size_bytes */
    u8 reserved;
    u16 reserved2;
};

struct kvt_usdt_site {
    u16 api;         /* KVT_API_pytorch_malloc or KVT_API_pytorch_free */
    u16 batch;       /* 1: kvtrace's hook's kvtrace:blocks(entries, count, sample_bytes), a batch of blocks (hook.h) */
    u32 arg_count;
    struct kvt_usdt_arg args[KVT_USDT_MAX_ARGS];
};

/* In-kernel ledger: the exact set of outstanding objects, maintained where no event can be lost. */
struct kvt_ledger_key {
    u32 pid;
    u8 layer;
    u8 object;
    u16 reserved;
    u64 address;
};

struct kvt_ledger_value {
    u64 size_bytes;
    u64 timestamp_ns;
    u64 caller_address;
    u64 aux;            /* VMM handle: live mappings; VMM mapping: the handle it maps */
    u32 tid;
    s32 device;
    u16 api;
    u8 memory;
    u8 released;        /* VMM handle: cuMemRelease seen while still mapped */
    u16 sample_kib;     /* PyTorch block whose stack was subject to sampling: the mean S (KiB) it was
                         * sampled at; 0: every block walked (exact), and for every other object */
    u8 sampled;         /* with sample_kib: 1 = sampling chose it (its stack walked), 0 = passed over */
    u8 unsent;          /* PyTorch block: its allocation's event was not sent (KVT_CONFIG_QUIET_BLOCKS), so
                         * neither is its free's */
    u64 stack_id;       /* the Python stack of the call that made it (stacks map); 0 = none. User space
                         * keeps no entry of its own: a snapshot or leak report reads it from here */
};

/* What the ledger's allocations and blocks add up to, per process, device, layer and memory: changed
 * with every insert and delete of such an entry, so user space reads exact totals without counting
 * events (which can be lost) or reading millions of entries. */
struct kvt_totals_key {
    u32 pid;
    s32 device;
    u8 layer;
    u8 memory;
    u16 reserved;
    u32 reserved2;
};

struct kvt_totals_value {
    s64 size_bytes;
    s64 count;
};

/* What one party holds of the maps everybody shares (probes/shares.h): per process (pid_shares) and per
 * user (uid_shares, also keyed KVT_UID_USERS for every user but root together). */
#define KVT_UID_USERS 0xffffffffu /* (uid_t)-1, no user's: the sum of every user but root */

struct kvt_share {
    s64 ledger_entries;  /* pid_shares: entries of the ledger it holds now; uid_shares: what its processes were
                          * charged for theirs (shares.h share_take: a batch at a time) */
    s64 totals_keys;     /* keys of ledger_totals it holds now */
    u64 refused_entries; /* ledger entries refused: its share was full (counted, not stored) */
    u64 refused_totals;  /* totals keys refused: its share was full (its totals are off) */
    s64 charged;         /* pid_shares: ledger entries its user was charged for it */
    u32 uid;             /* pid_shares: the process's user when it first inserted; uid_shares: the key */
    u32 pids;            /* uid_shares: processes with a record in pid_shares */
};

#endif
