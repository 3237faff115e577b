/* pystack.h — the calling thread's CPython frames, walked inside the probe (3.10-3.15, and the
 * free-threaded builds of 3.14 and 3.15).
 *
 * Per process, user space registers where its thread states are and how to walk its frames
 * (py_targets, from sources/python/offsets.py); the walk records (code object, instruction) per
 * frame and interns the stack in `stacks` by a hash, which the event carries.
 *
 * Exactness: every walk reads the whole chain of frames again, as it is at the probe. No earlier
 * walk's result is reused on the strength of a few frames looking unchanged: on 3.11+ frames live
 * in a per-thread data stack, so after f() returns, its caller h calling it again from another
 * line puts f at the same address with the same code and instruction while h's line differs; only
 * reading h (and every frame out to the last) tells the two stacks apart. What makes the walk
 * cheap instead is how frames are read (below). A runtime call's driver calls, which cannot run
 * Python in between, reuse its walk (context.h).
 *
 * Reads: on 3.11+ a thread's frames are contiguous in its data stack chunk [chunk, limit), the
 * innermost at the highest address, so one read of the chunk below the innermost frame (a
 * "window", up to KVT_WINDOW_BYTES) holds most of the chain; frames elsewhere (a generator's frame
 * is in the generator, 3.12+ entry frames are on the C stack, older chunks) are read one by one.
 * A frame is decoded from the window only when all its bytes lie inside it, and the window is a
 * copy of that memory made during this probe while the thread is stopped in it: the bytes are the
 * ones a read of that frame alone would give. So the data-stack offsets choose where to read from,
 * never what a frame says: were they wrong, the walk would only read more (or fall back to one read
 * per frame), not give another stack. 3.10 frame objects are on the heap: one read each. */
#ifndef KVT_PYSTACK_H
#define KVT_PYSTACK_H

BPF_HASH(py_targets, u32, struct kvt_py_target, 65536);
BPF_TABLE("lru_hash", u64, struct kvt_stack, stacks, KVT_MAX_STACKS);

/* Bytes of data stack read at once, a power of two: a thread's first chunk is 16 KiB (CPython's
 * _PY_DATA_STACK_CHUNK_SIZE), so a stack that fits in it is one read. Only [chunk, frame end) is
 * read, so a shallow stack reads little. */
#define KVT_WINDOW_BYTES 16384

/* PyThreadState.datastack_chunk, datastack_top, datastack_limit (3.11+). */
struct kvt_datastack {
    u64 chunk;
    u64 top;
    u64 limit;
};

/* Bytes of the thread state read at once: from its start to its data stack fields (3.11-3.15: 256 to 320
 * bytes), one read where several would do. */
#define KVT_TSTATE_READ_MAX 512

/* Frame owners from this one up are entry shims (FRAME_OWNED_BY_CSTACK on 3.12-3.13; _BY_INTERPRETER
 * and _BY_CSTACK on 3.14; _BY_INTERPRETER on 3.15), and the tag bits of a 3.14+ _PyStackRef
 * (sources/python/offsets.py says the same). */
#define KVT_PY_OWNER_SHIM_FROM 3
#define KVT_PY_REF_TAG_BITS 7

/* The walk is one program of its own, walk_stack (kvtrace.bpf.c), that the allocation probes
 * tail-call: the verifier then checks one copy of it, not one per probe (with the data-stack reads
 * a copy took it 1.5 s, a dozen of them 15 s before the first library was attached). A tail call
 * does not return, so the probe leaves in the request what is to be done with the stack. */
#define KVT_WALK_FOR_CALL  1 /* store it with the call's saved arguments (context.h) */
#define KVT_WALK_FOR_BLOCK 2 /* write it into the block's ledger entry and send its event (usdt.h) */

struct kvt_walk_request {
    u64 pid_tgid; /* whose request: the walker takes only the calling thread's own */
    u32 purpose;  /* KVT_WALK_FOR_* */
    u32 api;
    u64 address;  /* a block: what its event says (the probe put it into the ledger already) */
    u64 size_bytes;
    u64 stream;
    u64 inserted_ns;
    s32 device;
    u8 sampling;  /* a block: its stack subject to sampling (struct kvt_event.sampling) */
    u8 reserved;
    u16 reserved2;
};

BPF_PROG_ARRAY(stack_walker, 1); /* [0]: walk_stack, put in by user space before any probe */

/* Scratch space too big for the 512-byte BPF stack: the request of the probe that tail-called the
 * walk, the stack being built, one frame read alone, and the window with [window_start, window_end)
 * the user addresses it holds. The window has KVT_FRAME_READ_MAX bytes of slack so that a frame's
 * fields at any masked offset are in bounds.
 *
 * Per CPU, and uprobe programs run with migration, not preemption, disabled: on a preemptible kernel
 * another thread's probe on this CPU can use the scratch while one is halfway. So a request names its
 * thread (the walker drops one that is not the caller's), and a walk counts itself in walks_started
 * and gives up its stack (KVT_STACK_READ_ERROR, counted) when another walk started meanwhile. */
struct kvt_scratch {
    struct kvt_walk_request request;
    struct kvt_stack stack;
    u64 hash;
    u64 walks_started; /* a walk that finds it moved on was preempted by another's on this CPU */
    u64 window_start;
    u64 window_end;
    u8 frame[KVT_FRAME_READ_MAX];
    u8 tstate[KVT_TSTATE_READ_MAX + sizeof(struct kvt_datastack)];
    u8 window[KVT_WINDOW_BYTES + KVT_FRAME_READ_MAX];
};
BPF_PERCPU_ARRAY(scratch, struct kvt_scratch, 1);


/* The calling thread's fs base: glibc's thread descriptor (pthread_self()), 0 where unknown. */
static __always_inline u64 current_fsbase(void) {
    if (KVT_TASK_FSBASE_OFFSET < 0)
        return 0;
    struct task_struct *task = (struct task_struct *)bpf_get_current_task();
    u64 fsbase = 0;
    bpf_probe_read_kernel(&fsbase, sizeof(fsbase), (void *)task + KVT_TASK_FSBASE_OFFSET);
    return fsbase;
}

/* 3.15+: where each thread's state was found in its interpreter's list, by thread (pid_tgid). A thread
 * with none (a native thread, or one whose state was deleted) is kept with `missing_since`, what the
 * interpreters' thread counters were when their lists were looked through: every new thread state takes
 * the next number of its interpreter's threads.next_unique_id, so while those are unchanged no state was
 * made since and the thread still has none (a head's address would not do: a state freed and another
 * made at the same place leaves it as it was). */
struct kvt_py_thread {
    u64 tstate;
    u64 missing_since;
};
BPF_TABLE("lru_hash", u64, struct kvt_py_thread, py_threads, KVT_MAX_THREADS);

/* Interpreters, and Python threads of each, looked through for the calling thread. */
#define KVT_MAX_PY_INTERPRETERS 4
#define KVT_MAX_PY_THREADS 256

/* PyInterpreterState.threads is {u64 next_unique_id; PyThreadState *head; ...} (3.13-3.15): the counter is
 * the word before the head, whose place _Py_DebugOffsets checks. */
#define KVT_PY_THREADS_COUNTER_BEFORE_HEAD 8

/* The interpreters' thread counters, folded into one value that changes when a thread state is made in any. */
static __always_inline u64 py_threads_made(struct kvt_py_target *target) {
    u64 interp = 0, made = 0;
    bpf_probe_read_user(&interp, sizeof(interp), (void *)target->interpreters_head_address);
    for (int j = 0; j < KVT_MAX_PY_INTERPRETERS && interp; j++) {
        u64 counter = 0;
        bpf_probe_read_user(&counter, sizeof(counter),
                            (void *)(interp + target->interp_threads_head - KVT_PY_THREADS_COUNTER_BEFORE_HEAD));
        made = (made ^ counter) * 0x100000001b3ULL;
        if (bpf_probe_read_user(&interp, sizeof(interp), (void *)(interp + target->interp_next)) != 0)
            break;
    }
    return made;
}

/* 3.15+: the calling thread's state, looked up in the interpreters' lists (the newest few interpreters, the
 * newest KVT_MAX_PY_THREADS threads of each: a thread beyond those gets no stack, `no_thread_state`), and
 * kept for the thread (the walk checks it still holds each time, thread_state_holds). A thread that has a state in several interpreters (it ran
 * code in a subinterpreter) gets the oldest interpreter's, the main one's, as the GIL state API's pthread
 * key gives up to 3.14. */
static __always_inline u64 find_thread_state(struct kvt_py_target *target, u64 fsbase, u64 pid_tgid) {
    count(KVT_COUNTER_STACK_THREAD_LISTS);
    struct kvt_py_thread found = {.tstate = 0, .missing_since = 0};
    u64 interp = 0, made = 0;
    bpf_probe_read_user(&interp, sizeof(interp), (void *)target->interpreters_head_address);
    for (int j = 0; j < KVT_MAX_PY_INTERPRETERS && interp; j++) {
        u64 threads[2] = {}; /* next_unique_id, head */
        bpf_probe_read_user(threads, sizeof(threads),
                            (void *)(interp + target->interp_threads_head - KVT_PY_THREADS_COUNTER_BEFORE_HEAD));
        made = (made ^ threads[0]) * 0x100000001b3ULL;
        u64 tstate = threads[1];
        for (int i = 0; i < KVT_MAX_PY_THREADS && tstate; i++) {
            u64 thread_id = 0, next = 0;
            if (bpf_probe_read_user(&thread_id, sizeof(thread_id), (void *)(tstate + target->tstate_thread_id)) != 0 ||
                bpf_probe_read_user(&next, sizeof(next), (void *)(tstate + target->tstate_next)) != 0)
                break;
            if (thread_id == fsbase) {
                found.tstate = tstate; /* an older interpreter's, further on, replaces it */
                break;
            }
            tstate = next;
        }
        if (bpf_probe_read_user(&interp, sizeof(interp), (void *)(interp + target->interp_next)) != 0)
            break;
    }
    found.missing_since = made;
    py_threads.update(&pid_tgid, &found);
    return found.tstate;
}

/* The calling thread's PyThreadState. Up to 3.14 through the pthread key of the GIL state API: glibc keeps
 * pthread_getspecific(key) for keys < 32 in the thread descriptor, which fs points to; the GIL is usually
 * released around CUDA calls, so "the current thread state" of the runtime would be NULL, the TSS slot is
 * not. 3.15 keeps that state in a C thread-local instead (_Py_tss_gilstate, whose place no exported symbol
 * gives): the thread is found in its interpreter's list of thread states by its thread_id, once, and kept
 * (*kept is then set: the caller checks it still holds). */
static __always_inline u64 python_thread_state(struct kvt_py_target *target, u64 fsbase, u8 *kept) {
    *kept = 0;
    if (target->tss_key_address == 0) {
        if (!target->interpreters_head_address)
            return 0;
        u64 pid_tgid = bpf_get_current_pid_tgid();
        struct kvt_py_thread *known = py_threads.lookup(&pid_tgid);
        if (known && known->tstate) {
            *kept = 1;
            return known->tstate;
        }
        if (known && known->missing_since == py_threads_made(target))
            return 0; /* none when last looked, and no thread has been added since */
        return find_thread_state(target, fsbase, pid_tgid);
    }
    s32 key = -1;
    bpf_probe_read_user(&key, sizeof(key), (void *)target->tss_key_address);
    if (key < 0 || key >= 32)
        return 0;
    u64 tstate = 0;
    bpf_probe_read_user(&tstate, sizeof(tstate),
                        (void *)(fsbase + KVT_GLIBC_SPECIFIC_1STBLOCK + key * 16 + 8));
    return tstate;
}

/* One load, not eight byte loads (which a memcpy from an unknown offset compiles to): pointer
 * fields are 8-byte aligned in every layout (field_offset checks), and so are frames. */
static __always_inline u64 read_u64_at(u8 *base, u32 offset) {
    return *(u64 *)(base + (offset & (KVT_FRAME_READ_MAX - 8)));
}

/* A frame field's offset, for read_u64_at or a byte read: inside the bytes read of each frame and
 * aligned to its size (-1 where the layout has no such field, or it is not so). */
static __always_inline s32 field_offset(s16 offset, u32 size, u32 read_bytes) {
    return offset >= 0 && offset + size <= read_bytes && (offset & (size - 1)) == 0 ? offset : -1;
}

/* The first `read_bytes` bytes of the frame at user address `frame`, in scratch memory; NULL when
 * they cannot be read. From the window when it holds them all; else, for a frame in the thread's
 * data stack chunk [chunk, limit), a new window ending with this frame; else the frame alone. */
static __always_inline u8 *frame_bytes(struct kvt_scratch *s, u64 frame, u32 read_bytes, u64 chunk,
                                       u64 limit) {
    u64 held = s->window_end - s->window_start;
    u64 at = frame - s->window_start;
    if (frame >= s->window_start && at < held && held - at >= read_bytes)
        return s->window + (at & (KVT_WINDOW_BYTES - 1)); /* at < held <= KVT_WINDOW_BYTES */
    if (frame >= chunk && frame < limit && limit - frame >= read_bytes) {
        u64 end = frame + read_bytes;
        u64 size = end - chunk;
        if (size > KVT_WINDOW_BYTES)
            size = KVT_WINDOW_BYTES;
        u64 start = end - size;
        /* a failed read zeroes the window: it then holds nothing */
        s->window_start = s->window_end = 0;
        if (bpf_probe_read_user(s->window, size, (void *)start) == 0) {
            count(KVT_COUNTER_STACK_WINDOWS);
            s->window_start = start;
            s->window_end = end;
            return s->window + ((frame - start) & (KVT_WINDOW_BYTES - 1));
        }
    }
    count(KVT_COUNTER_STACK_FRAME_READS);
    if (bpf_probe_read_user(s->frame, read_bytes, (void *)frame) != 0)
        return 0;
    return s->frame;
}

/* A pointer-sized field of the thread state read into s->tstate (its first `span` bytes); 0 where the layout
 * has none (a negative offset) or it lies beyond. */
static __always_inline u64 tstate_field(struct kvt_scratch *s, s32 offset, s32 span) {
    if (offset < 0 || offset + 8 > span || (offset & 7) != 0)
        return 0;
    return *(u64 *)(s->tstate + (offset & (KVT_TSTATE_READ_MAX - 8)));
}

/* 3.15+: whether the kept state `tstate`, read into s->tstate, is still the calling thread's: its thread_id
 * is this thread, and it is still linked into its interpreter's list (a state is unlinked before it is
 * freed, so a freed one, or its memory reused by another thread's, fails here): one read. */
static __always_inline int thread_state_holds(struct kvt_py_target *target, struct kvt_scratch *s, u64 tstate,
                                              u64 fsbase, s32 span) {
    if (tstate_field(s, target->tstate_thread_id, span) != fsbase)
        return 0;
    u64 prev = tstate_field(s, target->tstate_prev, span);
    u64 link = 0;
    if (prev != 0)
        bpf_probe_read_user(&link, sizeof(link), (void *)(prev + target->tstate_next));
    else { /* the newest thread: the head of its interpreter's list */
        u64 interp = tstate_field(s, target->tstate_interp, span);
        if (interp)
            bpf_probe_read_user(&link, sizeof(link), (void *)(interp + target->interp_threads_head));
    }
    return link == tstate;
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
    u64 fsbase = current_fsbase();
    u8 kept = 0;
    u64 tstate = fsbase ? python_thread_state(target, fsbase, &kept) : 0;
    if (tstate == 0) {
        *status = KVT_STACK_NO_THREAD_STATE;
        return 0;
    }
    u32 zero = 0;
    struct kvt_scratch *s = scratch.lookup(&zero);
    if (!s) {
        *status = KVT_STACK_READ_ERROR;
        return 0;
    }
    u64 walk_number = ++s->walks_started;
    u64 frame = 0;
    u64 base_frame = 0; /* 3.15+: the chain's last frame, the interpreter's own: not read */
    struct kvt_datastack datastack = {};
    s32 datastack_at = target->tstate_datastack;
    if (datastack_at >= 0 && datastack_at < KVT_TSTATE_READ_MAX - (s32)sizeof(datastack) && (datastack_at & 7) == 0) {
        /* 3.11+: the thread state from its start to its data stack fields in one read, which holds the
         * frame pointer and, on 3.15, what tells whether a kept state still holds */
        u32 size = datastack_at + sizeof(datastack);
        if (bpf_probe_read_user(s->tstate, size & (KVT_TSTATE_READ_MAX - 1), (void *)tstate) != 0) {
            *status = KVT_STACK_READ_ERROR;
            return 0;
        }
        if (kept && !thread_state_holds(target, s, tstate, fsbase, datastack_at)) {
            /* not this thread's any more (deleted, or made again elsewhere): look again */
            u64 pid_tgid = bpf_get_current_pid_tgid();
            tstate = find_thread_state(target, fsbase, pid_tgid);
            if (tstate == 0 ||
                bpf_probe_read_user(s->tstate, size & (KVT_TSTATE_READ_MAX - 1), (void *)tstate) != 0) {
                *status = tstate ? KVT_STACK_READ_ERROR : KVT_STACK_NO_THREAD_STATE;
                return 0;
            }
        }
        frame = tstate_field(s, target->tstate_frame, datastack_at);
        u32 at = datastack_at & (KVT_TSTATE_READ_MAX - 8);
        datastack.chunk = *(u64 *)(s->tstate + at);
        datastack.limit = *(u64 *)(s->tstate + at + 16);
        base_frame = tstate_field(s, target->tstate_base_frame, datastack_at);
    } else if (bpf_probe_read_user(&frame, sizeof(frame), (void *)(tstate + target->tstate_frame)) != 0) {
        *status = KVT_STACK_READ_ERROR;
        return 0;
    }
    count(KVT_COUNTER_STACK_WALKS);
    if (target->cframe_frame >= 0 && frame != 0)
        bpf_probe_read_user(&frame, sizeof(frame), (void *)(frame + target->cframe_frame));
    u32 read_bytes = target->frame_read_bytes;
    if (read_bytes > KVT_FRAME_READ_MAX)
        read_bytes = KVT_FRAME_READ_MAX;
    s32 code_at = field_offset(target->frame_code, 8, read_bytes);
    s32 previous_at = field_offset(target->frame_previous, 8, read_bytes);
    s32 instr_at = field_offset(target->frame_instr, 8, read_bytes); /* 3.10: an int, read as 8 */
    s32 owner_at = field_offset(target->frame_owner, 1, read_bytes);
    u8 instr_is_lasti = target->instr_is_lasti;
    if (code_at < 0 || previous_at < 0 || instr_at < 0) {
        *status = KVT_STACK_READ_ERROR;
        return 0;
    }
    /* depth and hash live in map memory, not registers: the verifier then sees one state per
     * iteration instead of one per path through it (a register counter blows up its search). */
    s->hash = 0xcbf29ce484222325ULL ^ pid;
    s->stack.depth = 0;
    s->window_start = s->window_end = 0;
    for (int i = 0; i < KVT_MAX_WALK_STEPS && frame != 0; i++) {
        if (frame == base_frame) {
            frame = 0;
            break;
        }
        u8 *bytes = frame_bytes(s, frame, read_bytes, datastack.chunk, datastack.limit);
        if (!bytes)
            break;
        /* 3.14+: a tagged reference (_PyStackRef, the low bits say how it is counted); objects are 8-byte
         * aligned in every version, so masking them off leaves earlier versions' plain pointers as they are */
        u64 code = read_u64_at(bytes, code_at) & ~(u64)KVT_PY_REF_TAG_BITS;
        u64 previous = read_u64_at(bytes, previous_at);
        u64 instr = read_u64_at(bytes, instr_at);
        if (instr_is_lasti)
            instr = (u32)instr;
        u8 owner = owner_at >= 0 ? bytes[owner_at & (KVT_FRAME_READ_MAX - 1)] : 0;
        /* owned by the C stack (3.12+) or the interpreter (3.14+): an entry shim, not Python code */
        if (owner >= KVT_PY_OWNER_SHIM_FROM || code == 0) {
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
    if (s->walks_started != walk_number) { /* preempted by another walk on this CPU: its bytes, not ours */
        count(KVT_COUNTER_STACK_WALKS_PREEMPTED);
        *status = KVT_STACK_READ_ERROR;
        return 0;
    }
    if (!stacks.lookup(&hash))
        stacks.update(&hash, &s->stack);
    *status = KVT_STACK_OK;
    return hash;
}

/* Whether these probes walk Python stacks at all (not with the agent's --no-python-stacks, nor without
 * the fsbase offset): without, an allocation call asks nothing of the walker, and says NOT_PYTHON as
 * the call of a process with no registered runtime does. */
#define KVT_PYTHON_STACKS (KVT_TASK_FSBASE_OFFSET >= 0)

/* The stack status of an allocation call before (or without) its walk. */
static __always_inline u64 stack_status_unwalked(void) {
    return KVT_PYTHON_STACKS ? KVT_STACK_NOT_WALKED : KVT_STACK_NOT_PYTHON;
}

/* Whether the calling process is a Python whose stacks can be walked (a probe asks before it
 * hands itself to the walker). */
static __always_inline int python_target(u32 pid) {
    return py_targets.lookup(&pid) != 0;
}

/* Hands the rest of the probe to walk_stack with `request`. Returns only when the walker is not in
 * place (counted): the caller then goes on without a stack. */
static __always_inline void tail_call_walker(struct pt_regs *ctx, struct kvt_walk_request *request) {
    u32 zero = 0;
    struct kvt_scratch *s = scratch.lookup(&zero);
    if (s) {
        request->pid_tgid = bpf_get_current_pid_tgid();
        __builtin_memcpy(&s->request, request, sizeof(*request));
        stack_walker.call(ctx, 0);
    }
    count(KVT_COUNTER_STACK_WALKER_MISSING);
}

#endif
