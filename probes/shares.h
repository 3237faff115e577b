/* shares.h — what one party may hold of the maps every process shares: ledger entries, totals keys, and the
 * process records that count them. A user's processes together hold at most its share (root's is larger: it
 * runs the workloads), every user but root together at most theirs; a party whose share is full is refused
 * (counted on its records: user space names it), never the others. The shares are user space's rule
 * (sources/bpf/shares.py), passed as defines; the records are released at the process's exit, in the probe.
 *
 * Two things a share is not (by design, not by accident):
 * - exact under concurrency: the check against a share and the charge of a batch are not one atomic step, so CPUs
 *   that check at the same moment may each charge a batch: a user's figure can pass its share by up to
 *   (CPUs - 1) x KVT_SHARE_BATCH (share_take);
 * - in step with the ledger at an exit: a dying process's share is released at sched_process_exit
 *   (shares_release), before its entries leave the ledger: the agent's scan (kernel_ledger.py collect) deletes
 *   them within seconds, and meanwhile the ledger holds them uncharged. */
#ifndef KVT_SHARES_H
#define KVT_SHARES_H

BPF_HASH(pid_shares, u32, struct kvt_share, KVT_MAX_SHARED_PIDS);
BPF_HASH(uid_shares, u32, struct kvt_share, KVT_MAX_SHARED_UIDS);

/* The records a change is charged to: the process's, its user's, and (not root) every user's together. */
struct kvt_parties {
    struct kvt_share *process;
    struct kvt_share *user;
    struct kvt_share *users; /* NULL for root */
};

/* What a party may hold of a map: root's share, every user's together (the record a user with none of its own is
 * charged to: see user_record), or one user's. */
#define KVT_SHARE_OF(uid, what) \
    ((uid) == 0 ? KVT_SHARE_ROOT_##what : (uid) == KVT_UID_USERS ? KVT_SHARE_USERS_##what : KVT_SHARE_USER_##what)

/* Whether a party's changes go to every user's record too: not root's, nor that record's own. */
static __always_inline int charged_to_users(u32 uid) {
    return uid != 0 && uid != KVT_UID_USERS;
}

/* The record of every user together, charged besides `uid`'s own (NULL where charged_to_users says not). */
static __always_inline struct kvt_share *users_record(u32 uid) {
    u32 users_key = KVT_UID_USERS;
    return charged_to_users(uid) ? uid_shares.lookup(&users_key) : 0;
}

/* The record `*uid` is charged to, made at its first process. Root's and every user's records are made when the
 * probes load (loader.py), so neither is ever refused; a user for whom the table has no room (KVT_MAX_SHARED_UIDS
 * users made records: they are never freed) is charged to every user's record alone, under the users' share
 * (counted, and `*uid` becomes KVT_UID_USERS: its processes' records name that record), never refused for it. */
static __always_inline struct kvt_share *user_record(u32 *uid) {
    struct kvt_share *user = uid_shares.lookup(uid);
    if (user)
        return user;
    struct kvt_share zero = {.uid = *uid};
    uid_shares.insert(uid, &zero); /* another CPU may have made it meanwhile: either is fine */
    user = uid_shares.lookup(uid);
    if (user)
        return user;
    count(KVT_COUNTER_SHARE_UIDS_FULL);
    *uid = KVT_UID_USERS;
    return uid_shares.lookup(uid);
}

/* The records of process `pid` (the caller's), made at its first insert within its user's share of records;
 * 0 when there is none (refused: counted on the user's record where there is one, as a refused ledger entry in
 * KVT_COUNTER_SHARE_FULL, or, `for_key`, as a refused totals key: the caller counts KVT_COUNTER_TOTALS_FULL). */
static __always_inline int parties_of(u32 pid, struct kvt_parties *parties, int for_key) {
    u32 uid;
    struct kvt_share *process = pid_shares.lookup(&pid);
    if (process) {
        uid = process->uid;
        parties->user = uid_shares.lookup(&uid);
        parties->users = users_record(uid);
        parties->process = process;
        return parties->user && (!charged_to_users(uid) || parties->users);
    }
    uid = (u32)bpf_get_current_uid_gid();
    struct kvt_share *user = user_record(&uid);
    struct kvt_share *users = users_record(uid);
    if (!user || (charged_to_users(uid) && !users)) {
        if (!for_key)
            count(KVT_COUNTER_SHARE_FULL);
        return 0;
    }
    if (user->pids >= KVT_SHARE_OF(uid, PIDS) || (users && users->pids >= KVT_SHARE_USERS_PIDS)) {
        if (for_key) {
            __sync_fetch_and_add(&user->refused_totals, 1);
            return 0;
        }
        __sync_fetch_and_add(&user->refused_entries, 1);
        count(KVT_COUNTER_SHARE_FULL);
        return 0;
    }
    struct kvt_share zero = {.uid = uid};
    if (pid_shares.insert(&pid, &zero) == 0) { /* this thread made it: the user holds one more */
        __sync_fetch_and_add(&user->pids, 1);
        if (users)
            __sync_fetch_and_add(&users->pids, 1);
    }
    process = pid_shares.lookup(&pid);
    if (!process) {
        if (!for_key)
            count(KVT_COUNTER_SHARE_FULL);
        return 0;
    }
    parties->process = process;
    parties->user = user;
    parties->users = users;
    return 1;
}

static __always_inline void parties_add_keys(struct kvt_parties *parties, s64 delta) {
    __sync_fetch_and_add(&parties->process->totals_keys, delta);
    __sync_fetch_and_add(&parties->user->totals_keys, delta);
    if (parties->users)
        __sync_fetch_and_add(&parties->users->totals_keys, delta);
}

/* Takes one totals key of the calling process's share: 1, or 0 where its user (or every user together) holds its
 * share of keys already, counted on the process's and user's records. (Keys are made seldom: a few a process.) */
static __always_inline int share_take_key(u32 pid, struct kvt_parties *parties) {
    if (!parties_of(pid, parties, 1))
        return 0;
    struct kvt_share *user = parties->user, *users = parties->users;
    if (user->totals_keys >= KVT_SHARE_OF(parties->process->uid, TOTALS) ||
        (users && users->totals_keys >= KVT_SHARE_USERS_TOTALS)) {
        __sync_fetch_and_add(&parties->process->refused_totals, 1);
        __sync_fetch_and_add(&user->refused_totals, 1);
        return 0;
    }
    parties_add_keys(parties, 1);
    return 1;
}

/* Ledger entries are charged to the user KVT_SHARE_BATCH at a time: a process takes a batch of its user's share
 * when its entries pass what it was charged, and gives one back when it holds two batches more than its entries,
 * so that an insert or a delete costs one lookup (its process's record) and one add, and its user's record is
 * touched once in a batch. A user's figure is what its processes were charged: at most a batch and a half a
 * process above their entries; a share is a whole number of batches (shares.py ledger_share). */
static __always_inline void charge(struct kvt_share *process, s64 delta) {
    u32 uid = process->uid;
    __sync_fetch_and_add(&process->charged, delta);
    struct kvt_share *user = uid_shares.lookup(&uid);
    if (user)
        __sync_fetch_and_add(&user->ledger_entries, delta);
    struct kvt_share *users = users_record(uid);
    if (users)
        __sync_fetch_and_add(&users->ledger_entries, delta);
}

/* Takes one ledger entry of the calling process's share: its record, or NULL where its user (or every user
 * together) holds its share already (counted on the process's and the user's records). The check and the charge
 * below are two steps: CPUs that pass the check at once all charge their batch, so a share can be passed by up to
 * (CPUs - 1) x KVT_SHARE_BATCH (an atomic compare-and-charge would cost a loop on the user's record). */
static __always_inline struct kvt_share *share_take(u32 pid) {
    struct kvt_share *process = pid_shares.lookup(&pid);
    if (!process) {
        struct kvt_parties parties;
        if (!parties_of(pid, &parties, 0))
            return 0;
        process = parties.process;
    }
    s64 entries = __sync_fetch_and_add(&process->ledger_entries, 1) + 1;
    if (entries <= process->charged)
        return process;
    u32 uid = process->uid;
    struct kvt_share *user = uid_shares.lookup(&uid);
    struct kvt_share *users = users_record(uid);
    if (!user || (charged_to_users(uid) && !users) ||
        user->ledger_entries + KVT_SHARE_BATCH > KVT_SHARE_OF(uid, LEDGER) ||
        (users && users->ledger_entries + KVT_SHARE_BATCH > KVT_SHARE_USERS_LEDGER)) {
        __sync_fetch_and_add(&process->ledger_entries, -1);
        __sync_fetch_and_add(&process->refused_entries, 1);
        if (user)
            __sync_fetch_and_add(&user->refused_entries, 1);
        count(KVT_COUNTER_SHARE_FULL);
        return 0;
    }
    charge(process, KVT_SHARE_BATCH);
    return process;
}

/* Gives back one ledger entry of a process's record (share_take's). */
static __always_inline void entry_give(struct kvt_share *process) {
    s64 entries = __sync_fetch_and_add(&process->ledger_entries, -1) - 1;
    if (process->charged - entries > 2 * KVT_SHARE_BATCH)
        charge(process, -KVT_SHARE_BATCH);
}

/* Gives back one ledger entry of process `pid` (the caller's: only a process deletes its entries in a probe). */
static __always_inline void share_give(u32 pid) {
    struct kvt_share *process = pid_shares.lookup(&pid);
    if (process) /* none: made before its record (refused) */
        entry_give(process);
}

/* What user space deleted of a live process's entries itself (a context destroy's, the blocks of a process lowered
 * to segments: kernel_ledger.py delete_entries) goes back to its share here: user space runs this program (never
 * attached; BPF_PROG_TEST_RUN, loader.py give_shares) with args[0] the pid and args[1] the entries its deletes took.
 * The same atomic adds as entry_give, so exact whatever the probes do meanwhile on other CPUs (user space cannot
 * add to a map's value atomically; a map of counts to fold in would wait for the process's next probe). The
 * process keeps at most two batches charged above its entries, as entry_give leaves it. A pid whose record is gone
 * (exited: shares_release gave back all it was charged) is left alone. */
int kvt_share_return(struct bpf_raw_tracepoint_args *ctx) {
    u32 pid = (u32)ctx->args[0];
    s64 given = (s64)ctx->args[1];
    struct kvt_share *process = pid_shares.lookup(&pid);
    if (!process || given <= 0)
        return 0;
    s64 entries = __sync_fetch_and_add(&process->ledger_entries, -given) - given;
    s64 excess = process->charged - entries;
    if (excess > 2 * KVT_SHARE_BATCH) /* whole batches, down to between one and two above its entries */
        charge(process, -(s64)((u64)(excess - KVT_SHARE_BATCH) / KVT_SHARE_BATCH * KVT_SHARE_BATCH));
    return 0;
}

/* At the process's exit (sched_process_exit): what it held goes back to its user, and its record goes. The
 * entries themselves leave the ledger later, when the agent's scan deletes them (kernel_ledger.py collect: within
 * seconds); until then the ledger holds more than the shares count. */
static __always_inline void shares_release(u32 pid) {
    struct kvt_share *process = pid_shares.lookup(&pid);
    if (!process)
        return;
    u32 uid = process->uid;
    s64 entries = process->charged, keys = process->totals_keys;
    if (pid_shares.delete(&pid) != 0)
        return; /* another CPU released it */
    struct kvt_share *user = uid_shares.lookup(&uid);
    if (user) {
        __sync_fetch_and_add(&user->ledger_entries, -entries);
        __sync_fetch_and_add(&user->totals_keys, -keys);
        __sync_fetch_and_add(&user->pids, -1);
    }
    struct kvt_share *users = users_record(uid);
    if (users) {
        __sync_fetch_and_add(&users->ledger_entries, -entries);
        __sync_fetch_and_add(&users->totals_keys, -keys);
        __sync_fetch_and_add(&users->pids, -1);
    }
}

/* ---- figures a process chooses, bounded where they enter ---- */

/* A device ordinal the probes keep: [0, KVT_MAX_DEVICES) or KVT_DEVICE_UNKNOWN (others counted). */
static __always_inline s32 bounded_device(s32 device) {
    if (device == KVT_DEVICE_UNKNOWN || (device >= 0 && device < KVT_MAX_DEVICES))
        return device;
    count(KVT_COUNTER_DEVICES_CLAMPED);
    return KVT_DEVICE_UNKNOWN;
}

/* A size the probes keep: at most KVT_MAX_OBJECT_BYTES (more counted), so that no sum of the ledger's
 * entries can wrap (user space sets it: 2^62 / --max-ledger-entries, rounded down to a power of two; 4 TiB only at
 * the default 1 048 576 entries, 64 GiB at the largest ledger, 2^26 entries). */
static __always_inline u64 bounded_size(u64 size_bytes) {
    if (size_bytes <= KVT_MAX_OBJECT_BYTES)
        return size_bytes;
    count(KVT_COUNTER_SIZES_CLAMPED);
    return KVT_MAX_OBJECT_BYTES;
}

/* pitch * height, bounded the same way without wrapping. */
static __always_inline u64 bounded_product(u64 a, u64 b) {
    if (a != 0 && b > KVT_MAX_OBJECT_BYTES / a) {
        count(KVT_COUNTER_SIZES_CLAMPED);
        return KVT_MAX_OBJECT_BYTES;
    }
    return a * b;
}

#endif
