/* usdt.h — PyTorch's caching allocator through its own USDT probes (provider `pytorch` in
 * libc10_cuda.so): `malloc` fires for every block the allocator hands to a tensor, `free` when it
 * takes one back. A block lies inside a segment (cudaMalloc, or a VMM mapping under expandable
 * segments) that the CUDA probes already see; the block's Python stack is the one that holds the
 * memory, where a segment's names whoever made the cache grow.
 *
 * User space attaches one uprobe_multi link per library, with the semaphores as ref_ctr_offsets
 * (the kernel raises them while attached, so the probes cost nothing otherwise) and one cookie per
 * probe site: usdt_sites[cookie] says which probe it is and where its arguments are. Blocks go into
 * the same in-kernel ledger as every other object (layer TORCH, object BLOCK), so they stay exact
 * when events are lost; above a process's rate the event is not sent (counted), the ledger still is.
 * With stack sampling (block_walked), only some blocks' stacks are walked; the ledger still takes all. */
#ifndef KVT_USDT_H
#define KVT_USDT_H

BPF_HASH(usdt_sites, u64, struct kvt_usdt_site, 4096);

struct kvt_block_rate {
    u64 window_start_ns;
    u64 events;
};
BPF_TABLE("lru_hash", u32, struct kvt_block_rate, block_rate, 65536);

#define KVT_NS_PER_SECOND 1000000000ULL

/* struct pt_regs (x86-64) as an array of its 8-byte slots, copied once per probe: a note names
 * registers by their offset in it, and the verifier refuses context reads at a variable offset. */
#define KVT_PT_REGS_SLOTS 21

/* One argument of a probe site as the note describes it, sign- or zero-extended from its size. */
static __always_inline int usdt_argument(u64 *regs, struct kvt_usdt_arg *arg, u64 *value) {
    u64 raw = 0;
    u8 width = arg->size_bytes;
    u8 is_signed = arg->is_signed;
    if (arg->kind == KVT_USDT_ARG_CONSTANT) {
        raw = arg->displacement;
    } else if (arg->kind == KVT_USDT_ARG_REGISTER || arg->kind == KVT_USDT_ARG_MEMORY) {
        if (arg->reg_offset < 0)
            return -1;
        u32 offset = (u16)arg->reg_offset;
        u32 slot = offset >> 3;
        if ((offset & 7) != 0 || slot >= KVT_PT_REGS_SLOTS)
            return -1;
        u64 base = regs[slot];
        if (arg->kind == KVT_USDT_ARG_REGISTER) {
            raw = base;
        } else {
            /* One read of the operand's own size (constant sizes: the verifier bounds the copy). */
            void *source = (void *)(base + arg->displacement);
            long failed;
            if (width == 8)
                failed = bpf_probe_read_user(&raw, 8, source);
            else if (width == 4)
                failed = bpf_probe_read_user(&raw, 4, source);
            else if (width == 2)
                failed = bpf_probe_read_user(&raw, 2, source);
            else if (width == 1)
                failed = bpf_probe_read_user(&raw, 1, source);
            else
                return -1;
            if (failed)
                return -1;
        }
    } else {
        return -1;
    }
    if (width == 1)
        raw = is_signed ? (u64)(s64)(s8)raw : (u8)raw;
    else if (width == 2)
        raw = is_signed ? (u64)(s64)(s16)raw : (u16)raw;
    else if (width == 4)
        raw = is_signed ? (u64)(s64)(s32)raw : (u32)raw;
    *value = raw;
    return 0;
}

/* 1 when this process's block events are over its rate for the second that `now` falls in. */
static __always_inline int over_block_rate(u32 pid, u64 now) {
    u32 index = KVT_CONFIG_BLOCK_EVENTS_PER_SECOND;
    u64 *limit = config.lookup(&index);
    if (!limit || *limit == 0)
        return 0;
    struct kvt_block_rate *rate = block_rate.lookup(&pid);
    if (!rate || now - rate->window_start_ns >= KVT_NS_PER_SECOND) {
        struct kvt_block_rate fresh = {now, 1};
        block_rate.update(&pid, &fresh);
        return 0;
    }
    /* Atomic: the threads of one process run on several CPUs at once. (A window restarted by two
     * CPUs together loses a few counts: the limit is approximate, the ledger stays exact.) */
    return __sync_fetch_and_add(&rate->events, 1) + 1 > *limit;
}

/* Stack sampling of blocks, the heap profilers' technique (tcmalloc's, jemalloc's): walking every
 * block's stack costs microseconds per tensor, so with a mean S (KVT_CONFIG_BLOCK_SAMPLE_BYTES) each
 * thread counts bytes of blocks down from a draw of an exponential distribution of mean S, and the block
 * whose bytes cross zero has its stack walked (and a fresh countdown is drawn). Exponential gaps make
 * the chosen points a Poisson process over the thread's bytes: a block of s bytes is chosen with
 * probability 1 - exp(-s/S), independently of the others, so its bytes weighed by the inverse of that
 * are an unbiased estimate per stack (user space: model/blocks.py estimated_bytes). A block of at least
 * S bytes is always walked and leaves the countdown alone (weight 1: exact). The ledger and its totals
 * take every block whatever is sampled; the entry says how it was sampled (sample_kib, sampled).
 *
 * Draws: user space fills block_sample_draws with the exponential's quantiles at (i + 0.5) / N times S
 * (loader.py set_block_sample_bytes), and a probe takes one at random; block_full_pids lists processes
 * whose every block is walked whatever S. */
#define KVT_BLOCK_SAMPLE_DRAWS 1024 /* a power of two */
BPF_ARRAY(block_sample_draws, u64, KVT_BLOCK_SAMPLE_DRAWS);
BPF_HASH(block_full_pids, u32, u8, 65536);
#if !KVT_TASK_STORAGE
BPF_TABLE("lru_hash", u32, s64, block_countdown, KVT_MAX_THREADS); /* by thread id: bytes left */
#endif

static __always_inline s64 block_sample_draw(void) {
    u32 index = bpf_get_prandom_u32() & (KVT_BLOCK_SAMPLE_DRAWS - 1);
    u64 *draw = block_sample_draws.lookup(&index);
    return draw ? (s64)*draw : 0;
}

/* Whether the stack of a block of `size_bytes` in process `pid` is walked; *sample_kib is the S it was
 * subject to (0: not subject to sampling, every block walked: exact). */
static __always_inline int block_walked(u32 pid, u64 size_bytes, u16 *sample_kib) {
    u32 index = KVT_CONFIG_BLOCK_SAMPLE_BYTES;
    u64 *mean = config.lookup(&index);
    *sample_kib = 0;
    if (!mean || *mean == 0 || size_bytes >= *mean || block_full_pids.lookup(&pid))
        return 1;
    u16 kib = *mean >> 10;
#if KVT_TASK_STORAGE
    struct kvt_thread *thread = this_thread(1);
    if (!thread)
        return 1; /* no storage for the countdown: walked, and exact for itself */
    if (!thread->block_countdown_drawn) {
        thread->block_countdown = block_sample_draw();
        thread->block_countdown_drawn = 1;
    }
    s64 *left = &thread->block_countdown;
#else
    u32 tid = (u32)bpf_get_current_pid_tgid();
    s64 *left = block_countdown.lookup(&tid);
    if (!left) {
        s64 first = block_sample_draw();
        block_countdown.update(&tid, &first);
        left = block_countdown.lookup(&tid);
        if (!left)
            return 1; /* no room for it: walked, and exact for itself */
    }
#endif
    /* Only this thread changes its countdown: no atomics needed. */
    *sample_kib = kib;
    *left -= (s64)size_bytes;
    if (*left >= 0)
        return 0;
    *left = block_sample_draw();
    return 1;
}

/* The event of a PyTorch block the probe put into the ledger (address, size_bytes, device, stream,
 * inserted_ns of `block`), with its stack: walk_stack's end for a block also writes the stack into
 * the block's entry, if it is still the one inserted. */
static __always_inline void block_event(struct kvt_walk_request *block, u64 stack_id, u64 status) {
    if (stack_id) {
        struct kvt_ledger_key key;
        struct kvt_ledger_value *value = ledger_lookup(KVT_LAYER_TORCH, KVT_OBJECT_BLOCK, block->address, &key);
        if (value && value->timestamp_ns == block->inserted_ns)
            value->stack_id = stack_id;
    }
    emit_sampled_at(block->inserted_ns, KVT_KIND_ALLOC, KVT_API_pytorch_malloc, KVT_LAYER_TORCH, KVT_OBJECT_BLOCK,
                    KVT_MEMORY_DEVICE, block->address, block->size_bytes, block->device, 0, 0, block->stream,
                    stack_id, status, block->sampling);
}

/* 1 while no reader wants every block's event (KVT_CONFIG_QUIET_BLOCKS). */
static __always_inline int quiet_blocks(void) {
    u32 index = KVT_CONFIG_QUIET_BLOCKS;
    u64 *quiet = config.lookup(&index);
    return quiet && *quiet;
}

/* A block the allocator handed out (address, device, size_bytes, stream) in process `pid`: into the ledger, then
 * its event, with its stack where `walk` (sample_kib: the S it was sampled at, 0: not subject to sampling).
 * Returns without a stack walked, or not at all: a walk is a tail call. */
static __always_inline void block_allocated(struct pt_regs *ctx, u32 pid, int python, u64 address, u64 device,
                                            u64 size_bytes, u64 stream, int walk, u16 sample_kib) {
    if (sample_kib)
        count(walk ? KVT_COUNTER_BLOCKS_SAMPLED : KVT_COUNTER_BLOCKS_NOT_SAMPLED);
    /* Quiet: only a block whose stack is walked is told (its stack must reach user space); the others are
     * in the ledger, exact, and their frees are not told either. */
    u8 unsent = !(python && walk) && quiet_blocks();
    /* Into the ledger first, whatever follows: the walk only adds the stack (and over the rate the
     * event is not sent and the stack not walked, which is what the rate saves). */
    size_bytes = bounded_size(size_bytes);
    s32 block_device = bounded_device((s32)device);
    struct kvt_walk_request block = {.purpose = KVT_WALK_FOR_BLOCK, .api = KVT_API_pytorch_malloc,
                                     .address = address, .size_bytes = size_bytes, .stream = stream,
                                     .device = block_device, .sampling = sample_kib != 0};
    block.inserted_ns = ledger_insert_sampled(KVT_LAYER_TORCH, KVT_OBJECT_BLOCK, KVT_MEMORY_DEVICE,
                                              KVT_API_pytorch_malloc, address, size_bytes, block_device, 0,
                                              stream, 0, 0, sample_kib, sample_kib && walk, unsent);
    if (!block.inserted_ns)
        return; /* over its user's share: counted there */
    if (unsent) {
        count(KVT_COUNTER_BLOCKS_QUIET);
        return;
    }
    if (over_block_rate(pid, block.inserted_ns)) {
        count(KVT_COUNTER_BLOCKS_UNSENT);
        return;
    }
    if (!python) {
        block_event(&block, 0, KVT_STACK_NOT_PYTHON);
        return;
    }
    if (!walk) {
        block_event(&block, 0, KVT_STACK_NOT_SAMPLED);
        return;
    }
    tail_call_walker(ctx, &block); /* returns only without the walker: no stack */
    block_event(&block, 0, KVT_STACK_NOT_WALKED);
}

/* A block the allocator took back in process `pid`: out of the ledger, and its event. */
static __always_inline void block_freed(u32 pid, u64 address) {
    u64 now = bpf_ktime_get_ns();
    struct kvt_ledger_key key;
    struct kvt_ledger_value *value = ledger_lookup(KVT_LAYER_TORCH, KVT_OBJECT_BLOCK, address, &key);
    if (!value) {
        count(KVT_COUNTER_UNKNOWN_FREES);
        if (!over_block_rate(pid, now))
            emit_at(now, KVT_KIND_FREE_UNKNOWN, KVT_API_pytorch_free, KVT_LAYER_TORCH, KVT_OBJECT_BLOCK,
                    KVT_MEMORY_DEVICE, address, 0, KVT_DEVICE_UNKNOWN, 0, 0, 0, 0, KVT_STACK_NOT_WALKED);
        return;
    }
    u64 size_bytes = value->size_bytes;
    s32 device = value->device;
    u64 stream = value->aux;
    u8 unsent = value->unsent;
    ledger_delete(&key, device, KVT_MEMORY_DEVICE, size_bytes);
    /* Its allocation was not told: its free is not either, while nobody reads every block. (A reader that came
     * since has the block from its checkpoint, and gets the free.) */
    if (unsent && quiet_blocks()) {
        count(KVT_COUNTER_BLOCKS_QUIET);
        return;
    }
    if (over_block_rate(pid, now)) {
        count(KVT_COUNTER_BLOCKS_UNSENT);
        return;
    }
    emit_at(now, KVT_KIND_FREE, KVT_API_pytorch_free, KVT_LAYER_TORCH, KVT_OBJECT_BLOCK, KVT_MEMORY_DEVICE,
            address, size_bytes, device, 0, 0, stream, 0, KVT_STACK_NOT_WALKED);
}

#include "hook.h"

/* Entry of every pytorch:malloc and pytorch:free site, and of kvtrace's own hook's kvtrace:blocks (hook.h); the
 * cookie tells which. */
int usdt_pytorch(struct pt_regs *ctx) {
    u32 pid = bpf_get_current_pid_tgid() >> 32;
    if (filtered_out(pid))
        return 0;
    u64 cookie = bpf_get_attach_cookie(ctx);
    struct kvt_usdt_site *site = usdt_sites.lookup(&cookie);
    u64 regs[KVT_PT_REGS_SLOTS] = {};
    bpf_probe_read_kernel(regs, sizeof(regs), (void *)ctx);
    u64 address = 0;
    if (!site || site->arg_count < 1 || usdt_argument(regs, &site->args[0], &address) != 0) {
        count(KVT_COUNTER_USDT_UNREADABLE);
        return 0;
    }
    if (address == 0)
        return 0; /* no block: allocate(0), or a free of nothing */
    if (site->batch) {
        hook_batch(ctx, regs, site, address);
        return 0;
    }
    if (site->api == KVT_API_pytorch_malloc) {
        u64 device = 0, size_bytes = 0, stream = 0;
        if (site->arg_count < 3 || usdt_argument(regs, &site->args[1], &device) != 0 ||
            usdt_argument(regs, &site->args[2], &size_bytes) != 0) {
            count(KVT_COUNTER_USDT_UNREADABLE);
            return 0;
        }
        if (site->arg_count >= 4)
            usdt_argument(regs, &site->args[3], &stream);
        /* Sampling only where a stack would be walked: a block of a process that is no Python has none
         * to sample, and stays exact. */
        int python = python_target(pid);
        u16 sample_kib = 0;
        int walk = python ? block_walked(pid, size_bytes, &sample_kib) : 0;
        block_allocated(ctx, pid, python, address, device, size_bytes, stream, walk, sample_kib);
        return 0;
    }
    block_freed(pid, address);
    return 0;
}

#endif
