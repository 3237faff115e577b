/* emit.h — what the probes hand to user space: the event and discovery rings, per-CPU counters
 * (lost events among them), and when a CPU wakes the reader. */
#ifndef KVT_EMIT_H
#define KVT_EMIT_H

BPF_RINGBUF_OUTPUT(events, KVT_RINGBUF_PAGES);
BPF_RINGBUF_OUTPUT(notify, 16);
BPF_PERCPU_ARRAY(counters, u64, KVT_COUNTER_COUNT);

/* Counts a submitted event on this CPU and says whether it wakes the reader: every KVT_WAKEUP_EVENTS-th
 * event of a CPU does (one map lookup for both). */
static __always_inline u64 count_submitted(void) {
    u32 index = KVT_COUNTER_EVENTS_SUBMITTED;
    u64 *submitted = counters.lookup(&index);
    if (!submitted)
        return BPF_RB_FORCE_WAKEUP;
    *submitted += 1;
    return *submitted % KVT_WAKEUP_EVENTS == 0 ? BPF_RB_FORCE_WAKEUP : BPF_RB_NO_WAKEUP;
}

static __always_inline void counter_add(u32 index, u64 amount) {
    u64 *value = counters.lookup(&index);
    if (value)
        *value += amount;
}

static __always_inline void count(u32 index) {
    counter_add(index, 1);
}

/* The calling thread's name into `comm` (16 bytes, NUL-terminated: bytes after the NUL may be left from an
 * older name, where bpf_get_current_comm pads with zeros; user space reads up to the NUL). Where the
 * kernel has BTF, two loads from the task_struct the verifier checks against it, not a helper call. */
_Static_assert(KVT_COMM_LEN == 16, "current_comm copies a 16-byte comm in two words");
static __always_inline void current_comm(char comm[KVT_COMM_LEN]) {
#if KVT_TASK_STORAGE && KVT_TASK_COMM_OFFSET >= 0
    const char *task = (const char *)bpf_get_current_task_btf();
    *(u64 *)&comm[0] = *(const u64 *)(task + KVT_TASK_COMM_OFFSET);
    *(u64 *)&comm[8] = *(const u64 *)(task + KVT_TASK_COMM_OFFSET + 8);
#else
    bpf_get_current_comm(comm, KVT_COMM_LEN);
#endif
}

/* One event into the ring, stamped `timestamp_ns` (the ledger entry it describes carries the same
 * stamp, which is how user space keeps its stack across a resync). 0 when sent, -1 when lost.
 * `sampling`: a PyTorch block's, whose stack was subject to sampling (struct kvt_event.sampling). */
static __always_inline int emit_sampled_at(u64 timestamp_ns, u8 kind, u16 api, u8 layer, u8 object, u8 memory,
                                           u64 address, u64 size_bytes, s32 device, s32 error_code, u64 caller,
                                           u64 aux, u64 stack_id, u8 stack_status, u8 sampling) {
    struct kvt_event *e = events.ringbuf_reserve(sizeof(struct kvt_event));
    if (!e) {
        count(KVT_COUNTER_EVENTS_LOST);
        return -1;
    }
    u64 pid_tgid = bpf_get_current_pid_tgid();
    e->timestamp_ns = timestamp_ns;
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
    e->sampling = sampling;
    current_comm(e->comm);
    events.ringbuf_submit(e, count_submitted());
    return 0;
}

static __always_inline int emit_at(u64 timestamp_ns, u8 kind, u16 api, u8 layer, u8 object, u8 memory,
                                   u64 address, u64 size_bytes, s32 device, s32 error_code, u64 caller,
                                   u64 aux, u64 stack_id, u8 stack_status) {
    return emit_sampled_at(timestamp_ns, kind, api, layer, object, memory, address, size_bytes, device, error_code,
                           caller, aux, stack_id, stack_status, 0);
}

static __always_inline int emit_stack(u8 kind, u16 api, u8 layer, u8 object, u8 memory, u64 address,
                                      u64 size_bytes, s32 device, s32 error_code, u64 caller, u64 aux,
                                      u64 stack_id, u8 stack_status) {
    return emit_at(bpf_ktime_get_ns(), kind, api, layer, object, memory, address, size_bytes, device,
                   error_code, caller, aux, stack_id, stack_status);
}

static __always_inline int emit(u8 kind, u16 api, u8 layer, u8 object, u8 memory, u64 address,
                                u64 size_bytes, s32 device, s32 error_code, u64 caller, u64 aux) {
    return emit_stack(kind, api, layer, object, memory, address, size_bytes, device, error_code, caller,
                      aux, 0, KVT_STACK_NOT_WALKED);
}

/* Discovery: tell user space when a process may have new CUDA code to attach to. */
static __always_inline void notify_user(u32 reason) {
    struct kvt_notify *n = notify.ringbuf_reserve(sizeof(struct kvt_notify));
    if (!n)
        return; /* user space also rescans periodically */
    n->pid = bpf_get_current_pid_tgid() >> 32;
    n->reason = reason;
    notify.ringbuf_submit(n, 0);
}

#endif
