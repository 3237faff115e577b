/* hook.h — kvtrace's own hook inside a PyTorch process (agent/kvtrace/sources/torch_hook/hook.cpp): the caching
 * allocator's blocks arrive in batches through one USDT site, kvtrace:blocks(entries, count, sample_bytes), instead
 * of a trap for every pytorch:malloc and pytorch:free. A trap costs 0.5-0.7 us on the H100 before any program runs
 * (bench/RESULTS.md §K); a batch of up to KVT_HOOK_BATCH blocks costs one.
 *
 * The site is linked as PyTorch's are (usdt_sites, its semaphore as the link's reference counter: the hook hands
 * nothing over while it is zero); usdt_pytorch sees site->batch, copies the batch into hook_batches and tail-calls
 * usdt_hook_entries, which takes one entry and tail-calls itself for the next: each entry goes through the same
 * block_allocated / block_freed as a pytorch:malloc / free would, so the ledger, totals, events, quiet blocks and
 * rates are the same. The hook chose which blocks' stacks are walked (its byte countdown, sample_bytes its mean S)
 * and put such a block last in its batch, flushed at once: its stack is the one allocating it now, and the walk
 * (a tail call too) ends the chain. The kernel allows 33 tail calls in a chain: KVT_HOOK_BATCH entries and the
 * walker fit.
 *
 * The batch lives in a per-CPU map between tail calls, as the walker's request does: another thread's probe on the
 * same CPU could overwrite it halfway only where BPF programs are preempted. Each step checks that the batch is
 * still its thread's; if not, the rest of its entries are counted lost (hook_entries_lost), never taken from the
 * other thread's batch. */
#ifndef KVT_HOOK_H
#define KVT_HOOK_H

#define KVT_HOOK_BATCH 32 /* entries a batch carries at most (torch_hook BATCH_MAX): one tail call each */
#define KVT_HOOK_ALLOC 1
#define KVT_HOOK_FREE  2

/* One block event as hook.cpp writes it (struct kvtrace_hook_entry: 32 bytes). */
struct kvt_hook_entry {
    u64 address;
    u64 size_bytes;
    u64 stream;
    u8 kind;   /* KVT_HOOK_ALLOC or KVT_HOOK_FREE */
    s8 device;
    u8 walk;   /* 1: walk this block's stack (only ever the last entry of its batch) */
    u8 reserved[5];
};

struct kvt_hook_batch {
    u64 pid_tgid;     /* the thread whose batch this is: another's probe on this CPU may have overwritten it */
    u64 sample_bytes; /* the hook's S: the mean its walked blocks were drawn at (0: every block walked) */
    u32 count;
    u32 next;
    u32 python;       /* the process is a Python whose stacks can be walked: asked once a batch, not per entry */
    u32 reserved;
    struct kvt_hook_entry entries[KVT_HOOK_BATCH];
};
BPF_PERCPU_ARRAY(hook_batches, struct kvt_hook_batch, 1);
BPF_PROG_ARRAY(hook_entries_next, 1); /* [0]: usdt_hook_entries, put in by user space with the walker */

/* A kvtrace:blocks hit: the batch at `entries` into hook_batches, then its entries one tail call each. */
static __always_inline void hook_batch(struct pt_regs *ctx, u64 *regs, struct kvt_usdt_site *site, u64 entries) {
    u64 count_entries = 0, sample_bytes = 0;
    if (site->arg_count < 3 || usdt_argument(regs, &site->args[1], &count_entries) != 0 ||
        usdt_argument(regs, &site->args[2], &sample_bytes) != 0) {
        count(KVT_COUNTER_USDT_UNREADABLE);
        return;
    }
    if (count_entries == 0)
        return;
    u32 zero = 0;
    struct kvt_hook_batch *batch = hook_batches.lookup(&zero);
    if (!batch || count_entries > KVT_HOOK_BATCH) {
        counter_add(KVT_COUNTER_HOOK_ENTRIES_LOST, count_entries);
        return;
    }
    /* Stamped before the copy: a chain this one preempted must not take these entries for its own. */
    batch->pid_tgid = bpf_get_current_pid_tgid();
    if (bpf_probe_read_user(batch->entries, sizeof(batch->entries), (void *)entries) != 0) {
        batch->count = 0;
        counter_add(KVT_COUNTER_HOOK_ENTRIES_LOST, count_entries);
        return;
    }
    batch->sample_bytes = sample_bytes;
    batch->python = python_target(bpf_get_current_pid_tgid() >> 32);
    batch->count = (u32)count_entries;
    batch->next = 0;
    hook_entries_next.call(ctx, 0);
    counter_add(KVT_COUNTER_HOOK_ENTRIES_LOST, count_entries); /* only without the entries program */
}

/* One entry of the batch in hook_batches, then the next (a tail call to itself). */
int usdt_hook_entries(struct pt_regs *ctx) {
    u32 zero = 0;
    struct kvt_hook_batch *batch = hook_batches.lookup(&zero);
    if (!batch)
        return 0;
    if (batch->pid_tgid != bpf_get_current_pid_tgid()) {
        count(KVT_COUNTER_HOOK_ENTRIES_LOST); /* at least this thread's next entry; how many more is gone too */
        return 0;
    }
    u32 index = batch->next;
    u32 total = batch->count;
    if (index >= total || index >= KVT_HOOK_BATCH)
        return 0;
    batch->next = index + 1;
    struct kvt_hook_entry *entry = &batch->entries[index];
    u32 pid = bpf_get_current_pid_tgid() >> 32;
    if (entry->kind == KVT_HOOK_ALLOC) {
        int python = batch->python;
        u64 size_bytes = entry->size_bytes;
        u64 mean = batch->sample_bytes;
        /* As block_walked says it: 0 where every block is walked (S = 0, a block of at least S, no Python). */
        u16 sample_kib = (!python || mean == 0 || size_bytes >= mean) ? 0 : (u16)(mean >> 10);
        /* A walk is a tail call that does not come back: only the last entry may have one. */
        int walk = python && entry->walk && index + 1 >= total;
        block_allocated(ctx, pid, python, entry->address, (u64)(s64)entry->device, size_bytes, entry->stream, walk,
                        sample_kib);
    } else if (entry->kind == KVT_HOOK_FREE) {
        block_freed(pid, entry->address);
    }
    if (index + 1 < total) {
        hook_entries_next.call(ctx, 0);
        counter_add(KVT_COUNTER_HOOK_ENTRIES_LOST, total - index - 1); /* only without the program */
    }
    return 0;
}

#endif
