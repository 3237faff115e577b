/* settings.h — the values user space owns, passed as defines (sources/bpf/loader.py
 * ProbeSettings.cflags). Compiling without one is a mistake, not a default. */
#ifndef KVT_SETTINGS_H
#define KVT_SETTINGS_H

#ifndef KVT_MAX_LEDGER_ENTRIES
#error "KVT_MAX_LEDGER_ENTRIES: outstanding objects the in-kernel ledger holds"
#endif
#ifndef KVT_MAX_TOTALS
#error "KVT_MAX_TOTALS: (process, device, layer, memory) totals of allocations and blocks"
#endif
/* Shares (shares.h): what one user (USER), root (ROOT) and every user but root together (USERS) may hold
 * of the ledger's entries, the totals' keys and the process records (pid_shares, KVT_MAX_SHARED_PIDS of
 * them); sources/bpf/shares.py owns the rule. */
#if !defined(KVT_SHARE_USER_LEDGER) || !defined(KVT_SHARE_ROOT_LEDGER) || !defined(KVT_SHARE_USERS_LEDGER)
#error "KVT_SHARE_{USER,ROOT,USERS}_LEDGER: ledger entries one user, root, every user but root may hold"
#endif
#if !defined(KVT_SHARE_USER_TOTALS) || !defined(KVT_SHARE_ROOT_TOTALS) || !defined(KVT_SHARE_USERS_TOTALS)
#error "KVT_SHARE_{USER,ROOT,USERS}_TOTALS: totals keys one user, root, every user but root may hold"
#endif
#if !defined(KVT_SHARE_USER_PIDS) || !defined(KVT_SHARE_ROOT_PIDS) || !defined(KVT_SHARE_USERS_PIDS)
#error "KVT_SHARE_{USER,ROOT,USERS}_PIDS: process records one user, root, every user but root may hold"
#endif
#ifndef KVT_SHARE_BATCH
#error "KVT_SHARE_BATCH: ledger entries a process is charged to its user at a time"
#endif
#ifndef KVT_MAX_SHARED_PIDS
#error "KVT_MAX_SHARED_PIDS: processes with a share record at once"
#endif
#ifndef KVT_MAX_SHARED_UIDS
#error "KVT_MAX_SHARED_UIDS: users with a share record"
#endif
/* The largest size an object keeps (more is kept as this, and counted): the ledger's entries times it
 * stay below 2^62, so no total can wrap. */
#ifndef KVT_MAX_OBJECT_BYTES
#error "KVT_MAX_OBJECT_BYTES: the largest size a ledger entry keeps"
#endif
#ifndef KVT_RINGBUF_PAGES
#error "KVT_RINGBUF_PAGES: pages of the event ring buffer"
#endif
#ifndef KVT_MAX_THREADS
#error "KVT_MAX_THREADS: threads with a call in flight at once"
#endif
#ifndef KVT_MAX_STACKS
#error "KVT_MAX_STACKS: Python stacks kept for user space to read"
#endif
/* Offset of thread.fsbase in task_struct, from this kernel's BTF (sources/bpf/btf.py); the
 * headers bcc compiles with may describe another kernel. -1: no Python stacks. */
#ifndef KVT_TASK_FSBASE_OFFSET
#error "KVT_TASK_FSBASE_OFFSET: task_struct.thread.fsbase from BTF, or -1"
#endif
/* Offset of exit_code in task_struct, from BTF: a process exit carries its wait status. -1: none. */
#ifndef KVT_TASK_EXIT_CODE_OFFSET
#error "KVT_TASK_EXIT_CODE_OFFSET: task_struct.exit_code from BTF, or -1"
#endif
/* Offset of comm in task_struct, from BTF: with task storage (a kernel with BTF), an event's thread
 * name is two loads from the task instead of bpf_get_current_comm (~75 ns an event on the test VM, a
 * tenth of a return probe: bench/probe_overhead.py --bpf-stats). -1: the helper. */
#ifndef KVT_TASK_COMM_OFFSET
#error "KVT_TASK_COMM_OFFSET: task_struct.comm from BTF, or -1"
#endif
/* Events submitted on a CPU before the reader is woken; the rest the reader takes on its timer.
 * Every wakeup costs the traced thread an interrupt on the spot (on a virtual machine, an exit to
 * the hypervisor): one per event was a large part of a probe's cost. */
#ifndef KVT_WAKEUP_EVENTS
#error "KVT_WAKEUP_EVENTS: events a CPU submits before it wakes the reader"
#endif
/* 1: per-thread call state in task storage (Linux 6.2+); 0: in LRU hashes keyed by thread id. */
#ifndef KVT_TASK_STORAGE
#error "KVT_TASK_STORAGE: 1 where the kernel has task storage for tracing programs (6.2+), else 0"
#endif
/* 1 where sched_process_exit says whether the exiting thread is its process's last (group_dead): a
 * process's exit is then reported when it ends, and a thread may remember that its process is tracked
 * (KVT_TRACKED_IN_THREAD). 0: the exit is reported when the group leader exits. */
#ifndef KVT_EXIT_GROUP_DEAD
#error "KVT_EXIT_GROUP_DEAD: 1 where the sched_process_exit tracepoint has group_dead, else 0"
#endif
#define KVT_TRACKED_IN_THREAD (KVT_TASK_STORAGE && KVT_EXIT_GROUP_DEAD)
/* glibc struct pthread: specific_1stblock[32] of {seq, data} (sources/python/offsets.py). */
#ifndef KVT_GLIBC_SPECIFIC_1STBLOCK
#error "KVT_GLIBC_SPECIFIC_1STBLOCK: offset of specific_1stblock in glibc's struct pthread"
#endif

#endif
