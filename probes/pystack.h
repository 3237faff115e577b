/* pystack.h — the calling thread's CPython frames, walked inside the probe (3.10-3.13).
 *
 * Per process, user space registers where its thread states are and how to walk its frames
 * (py_targets, from sources/python/offsets.py); the walk records (code object, instruction) per
 * frame and interns the stack in `stacks` by a hash, which the event carries. */
#ifndef KVT_PYSTACK_H
#define KVT_PYSTACK_H

BPF_HASH(py_targets, u32, struct kvt_py_target, 65536);
BPF_TABLE("lru_hash", u64, struct kvt_stack, stacks, KVT_MAX_STACKS);

/* Scratch space too big for the 512-byte BPF stack: one stack being built and one frame read. */
struct kvt_scratch {
    struct kvt_stack stack;
    u64 hash;
    u8 frame[KVT_FRAME_READ_MAX];
};
BPF_PERCPU_ARRAY(scratch, struct kvt_scratch, 1);


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

#endif
