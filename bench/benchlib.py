"""What the benchmarks share: paths, stub library copies, a tracer scoped to one copy, a pump.

Attaching or detaching uprobes costs seconds (the kernel waits for an RCU grace period per probe),
so the benchmarks never attach per round. Instead every mode gets its own copy of the stub
libraries (build_stubs into its own directory: different inodes), probes are attached once to the
copy of the mode that wants them, and a round runs the workload linked against each copy in turn.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT / "tests", ROOT / "tests" / "integration", ROOT / "agent"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from cuda_stubs import StubBuild, Workload, build_stubs  # noqa: E402
from harness import CallSink  # noqa: E402
from kvtrace.model.processes import ProcessTable  # noqa: E402
from kvtrace.session import Session  # noqa: E402
from kvtrace.sources import procfs  # noqa: E402
from kvtrace.sources.bpf.loader import BpfProbes, ProbeSettings  # noqa: E402
from kvtrace.sources.bpf.source import BpfOptions, BpfSource  # noqa: E402

__all__ = ["EMPTY_PROGRAM", "empty_probes", "ROOT", "StubBuild", "Workload", "build_copies", "scoped_tracer",
           "counters_of", "Pump", "median", "progress", "require_bpf", "counters_delta", "rotated", "CpuMeter",
           "foreign_uprobes", "Guard", "code_version",
           "bpf_stats", "program_ns", "body_ns_per_pair", "torch_traps", "NoTorchSites", "process_program_stats"]


# The baseline every probe cost is compared with: entry and return probes that do nothing.
EMPTY_PROGRAM = b"""
int empty_entry(struct pt_regs *ctx) { return 0; }
int empty_return(struct pt_regs *ctx) { return 0; }
"""


def empty_probes(points):
    """A loaded EMPTY_PROGRAM with an entry and a return probe on each (path, symbol, pid) of
    `points` (pid -1: every process)."""
    from bcc import BPF

    from kvtrace.sources.bpf.links import repair_bcc_attach_uprobe

    repair_bcc_attach_uprobe()  # as kvtrace's own: no semaphore, so both can probe one function
    bpf = BPF(text=EMPTY_PROGRAM)
    for path, symbol, pid in points:
        bpf.attach_uprobe(name=str(path).encode(), sym=symbol.encode(), fn_name=b"empty_entry", pid=pid)
        bpf.attach_uretprobe(name=str(path).encode(), sym=symbol.encode(), fn_name=b"empty_return", pid=pid)
    return bpf


class NoTorchSites(RuntimeError):
    """The process maps no file with usable PyTorch allocator probe sites (torch_traps)."""


@contextlib.contextmanager
def torch_traps(pid: int):
    """PyTorch's allocator probe sites (pytorch:malloc and pytorch:free, in the files `pid` maps that carry them,
    found as the agent finds them: kvtrace's Discovery) trapping into an empty program, for that process only,
    their semaphores raised as kvtrace raises them (one uprobe_multi link a file, ref_ctr_offsets): what every
    block costs before kvtrace's program does anything. Yields the number of sites; raises NoTorchSites first
    where there are none."""
    from bcc import BPF

    from kvtrace.sources.bpf import links
    from kvtrace.sources.bpf.discovery import Discovery

    files = [(target.path, sites) for target in Discovery().scan_pid(pid)
             if (sites := [probe for probe in target.torch_probes if probe.usable])]
    if not files:
        raise NoTorchSites(f"process {pid} maps no file with usable pytorch:malloc/free probe sites "
                           "(initialise CUDA in it first)")
    bpf = BPF(text=b"int empty_site(struct pt_regs *ctx) { return 0; }")
    with contextlib.ExitStack() as made:
        made.callback(bpf.cleanup)
        program = links.load_uprobe_multi(bpf, "empty_site")
        for path, sites in files:
            made.callback(links.attach_uprobe_multi(
                program, path, [site.pc_file_offset for site in sites],
                ref_ctr_offsets=[site.semaphore_file_offset for site in sites], pid=pid).close)
        yield sum(len(sites) for _, sites in files)


# A prototype of the kernel's side of kvtrace's PyTorch hook (agent/kvtrace/sources/torch_hook), for the benches:
# the batch read in one copy, a hash of live blocks kept exact.
HOOK_LEDGER_PROGRAM = r"""
#include <uapi/linux/ptrace.h>
#define BATCH_MAX 32 /* torch_hook.BATCH_MAX */
struct entry { u64 address; u64 size_bytes; u64 stream; u8 kind; s8 device; u8 walk; u8 reserved[5]; };
struct batch { struct entry entries[BATCH_MAX]; };
struct seen { u64 value[4]; }; /* entries, allocations, frees, frees of a block not in `live` */
BPF_PERCPU_ARRAY(scratch, struct batch, 1);
BPF_PERCPU_ARRAY(seen, struct seen, 1);
BPF_HASH(live, u64, u64, 1048576);

int empty_flush(struct pt_regs *ctx) { return 0; }

int ledger_flush(struct pt_regs *ctx) {
    u32 zero = 0;
    struct batch *batch = scratch.lookup(&zero);
    struct seen *seen_now = seen.lookup(&zero);
    if (!batch || !seen_now)
        return 0;
    u32 count = (u32)PT_REGS_PARM2(ctx);
    if (count > BATCH_MAX)
        count = BATCH_MAX;
    /* The hook's buffer holds BATCH_MAX entries: one copy of all of it (a constant size for the verifier). */
    if (count == 0 || bpf_probe_read_user(batch, sizeof(*batch), (void *)PT_REGS_PARM1(ctx)))
        return 0;
#pragma clang loop unroll(full)
    for (u32 i = 0; i < BATCH_MAX; i++) { /* unrolled: straight code the verifier walks once */
        if (i >= count)
            continue;
        struct entry *entry = &batch->entries[i];
        u64 address = entry->address;
        u64 size = entry->size_bytes;
        u8 allocation = entry->kind == 1;
        if (allocation)
            live.update(&address, &size);
        else
            seen_now->value[3] += live.delete(&address) != 0;
        seen_now->value[0] += 1;
        seen_now->value[1] += allocation;
        seen_now->value[2] += !allocation;
    }
    return 0;
}
"""


@contextlib.contextmanager
def hook_flush_probe(library: Path, pid: int, fn_name: str):
    """`fn_name` (empty_flush or ledger_flush) of HOOK_LEDGER_PROGRAM on the hook's kvtrace:blocks site in `pid`, the
    hook's semaphore raised by the kernel while it is in (the link's ref_ctr_offset, as kvtrace raises USDT
    semaphores). Yields the bcc module."""
    from bcc import BPF

    from kvtrace.sources.bpf import links
    from kvtrace.sources.bpf.hook_settings import probe_site

    site = probe_site(library)
    bpf = BPF(text=HOOK_LEDGER_PROGRAM.encode())
    with contextlib.ExitStack() as made:
        made.callback(bpf.cleanup)
        program = links.load_uprobe_multi(bpf, fn_name)
        made.callback(links.attach_uprobe_multi(program, library, [site.pc_file_offset],
                                                ref_ctr_offsets=[site.semaphore_file_offset], pid=pid).close)
        yield bpf


def hook_seen_counts(bpf) -> dict[str, int]:
    """What HOOK_LEDGER_PROGRAM's ledger_flush saw, over every CPU."""
    table = bpf[b"seen"]
    per_cpu = table[table.Key(0)]  # one struct seen a CPU
    return {name: sum(int(cpu.value[index]) for cpu in per_cpu)
            for index, name in enumerate(("entries", "allocations", "frees", "unknown_frees"))}


def _fdinfo(path: str) -> dict[str, str]:
    """The fields of one /proc/PID/fdinfo/FD file."""
    with open(path) as lines:
        return dict(line.split(":", 1) for line in lines if ":" in line)


def process_program_stats(pid: int) -> dict[int, tuple[int, int]]:
    """(run_time_ns, run_cnt) of every BPF program another process holds open, by program id (root; the
    counts move only under kernel.bpf_stats_enabled=1, see bpf_stats)."""
    stats = {}
    for fd in os.listdir(f"/proc/{pid}/fdinfo"):
        try:
            fields = _fdinfo(f"/proc/{pid}/fdinfo/{fd}")
        except OSError:
            continue  # closed meanwhile
        if "prog_id" in fields and "run_cnt" in fields:
            stats[int(fields["prog_id"])] = (int(fields["run_time_ns"]), int(fields["run_cnt"]))
    return stats


def code_version() -> str:
    """The commit measured, and whether the code on the tracing path had uncommitted changes."""
    import subprocess

    def git(*args):
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True).stdout.strip()

    measured = ("probes", "agent/kvtrace/session.py", "agent/kvtrace/sources", "agent/kvtrace/model")
    changed = git("status", "--porcelain", "--untracked-files=no", "--", *measured).splitlines()
    return f"commit {git('rev-parse', '--short', 'HEAD') or '?'}" + (
        f" + uncommitted changes in {len(changed)} files of the tracing path" if changed else
        " (tracing path: probes/, session.py, sources/, model/ as committed)")


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def require_bpf() -> None:
    """Exits with one line (no traceback) where BPF cannot be loaded here."""
    if os.geteuid() != 0:
        sys.exit("needs root for BPF: run as root, e.g. `sudo .venv/bin/python bench/...`")
    try:
        import bcc  # noqa: F401
    except Exception as error:
        sys.exit(f"bcc is not importable ({error}): `make setup` installs python3-bpfcc")
    if not os.path.exists("/sys/kernel/tracing/uprobe_events"):
        sys.exit("tracefs is not mounted: mount -t tracefs nodev /sys/kernel/tracing")


def build_copies(base: Path, names: list[str]) -> dict[str, StubBuild]:
    """One independent build of the stubs and workloads per name (own inodes, own RUNPATH)."""
    return {name: build_stubs(base / name) for name in names}


def _scoped_probes_factory(lib_dir: Path):
    """BpfProbes that attach only to libraries under lib_dir.

    The tracer discovers every process that execs or maps code (the pid filter acts in BPF, not at
    attach time), so without this it would also attach to the other modes' library copies.
    """
    prefix = str(lib_dir.resolve()) + os.sep

    class ScopedProbes(BpfProbes):
        def attach(self, path, symbols, pid=-1, key=None):
            if not os.path.realpath(path).startswith(prefix):
                return []
            return super().attach(path, symbols, pid, key=key)

    def factory(settings: ProbeSettings) -> BpfProbes:
        return ScopedProbes(settings)

    return factory


def scoped_tracer(build: StubBuild, python_stacks: bool = True, sinks=None) -> BpfSource:
    """A started BPF source (with its own Session) that follows only pids given to follow() and
    probes only build's libraries; `sinks` are callables given every event."""
    options = BpfOptions(only_selected=True, python_stacks=python_stacks,
                         preattach_globs=(str(build.lib_dir / "*.so.*"),))
    session = Session(ProcessTable(procfs.read_process))
    for sink in sinks or ():
        session.add_sink(CallSink(sink))
    tracer = BpfSource(session, options, probes_factory=_scoped_probes_factory(build.lib_dir))
    started = time.monotonic()
    tracer.start()
    progress(f"tracer (python_stacks={python_stacks}) started in {time.monotonic() - started:.1f} s, "
             f"attached: {sorted(map(str, tracer.probes.attached().values()))}")
    return tracer


def counters_of(tracer: BpfSource) -> dict[str, int]:
    """The probes' counters now, with what the Session counted (events_seen, resyncs)."""
    return {**tracer.counters(), "events_seen": tracer.session.events_total,
            "resyncs": tracer.session.resyncs_total}


class Pump:
    """Runs tracer.run_once() on a background thread. Hold `lock` around any other use of a tracer.

    An exception from run_once is counted and kept (errors) and the loop goes on, so that one
    tracer bug does not end a long benchmark; the scripts print what was caught.
    """

    def __init__(self, tracers: list[BpfSource], timeout_ms: int = 50) -> None:
        self.tracers = tracers
        self.timeout_ms = timeout_ms
        self.lock = threading.Lock()
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tracer-pump", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for tracer in self.tracers:
                with self.lock:
                    try:
                        tracer.run_once(self.timeout_ms // len(self.tracers))
                    except Exception as error:
                        self.errors.append(f"{type(error).__name__}: {error}")
                        progress(f"WARNING: tracer.run_once raised {self.errors[-1]}")

    def __enter__(self) -> Pump:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def drain(self, tracer: BpfSource, seconds: float = 0.5) -> None:
        """Lets the pump run until nothing arrived for `seconds`."""
        last = -1
        while True:
            with self.lock:
                seen = tracer.session.events_total
            if seen == last:
                return
            last = seen
            time.sleep(seconds)


@contextlib.contextmanager
def bpf_stats():
    """kernel.bpf_stats_enabled=1 for the block (every BPF program on the host then counts its run
    time, at a few tens of ns per run), restored afterwards."""
    sysctl = Path("/proc/sys/kernel/bpf_stats_enabled")
    previous = sysctl.read_text().strip()
    sysctl.write_text("1")
    try:
        yield
    finally:
        sysctl.write_text(previous)


def program_ns(bpf) -> dict[str, tuple[int, int]]:
    """(run_time_ns, run_cnt) per program of a bcc BPF object (kernel.bpf_stats_enabled=1)."""
    stats = {}
    for name, function in bpf.funcs.items():
        fields = _fdinfo(f"/proc/self/fdinfo/{function.fd}")
        stats[name.decode()] = (int(fields.get("run_time_ns", 0)), int(fields.get("run_cnt", 0)))
    return stats


def body_ns_per_pair(bpf, run, pairs: int) -> tuple[float, dict[str, float]]:
    """Runs run() with BPF run-time statistics on: program ns per pair, and ns per run by program."""
    before = program_ns(bpf)
    run()
    after = program_ns(bpf)
    per_run = {name: (after[name][0] - before[name][0]) / (after[name][1] - before[name][1])
               for name in after if after[name][1] - before[name][1] >= pairs}
    total = sum(after[name][0] - before[name][0] for name in per_run)
    return total / pairs, per_run


def parse_cpus(text: str) -> set[int]:
    """'0-3,8' -> {0, 1, 2, 3, 8} (the taskset list format)."""
    cpus: set[int] = set()
    for part in filter(None, text.split(",")):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def set_masks(pids: list[int], cpus: set[int]) -> None:
    """Every thread of each process on `cpus` (threads they make later inherit it; one that cannot be is an
    error, not a silent no-op)."""
    for pid in pids:
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                os.sched_setaffinity(int(task), cpus)
            except ProcessLookupError:  # a thread that ended meanwhile
                pass


def median(values) -> float:
    """The median; NaN for no values (a mode with no clean run), so reports print instead of fail."""
    return statistics.median(values) if values else float("nan")


def rotated(items, round_index: int) -> list:
    """The items in round `round_index`'s order: rotated by one each round, so that no mode always
    runs first (or right after the same other mode)."""
    items = list(items)
    shift = round_index % len(items)
    return items[shift:] + items[:shift]


class CpuMeter:
    """CPU seconds a process used between start() and stop(), as a fraction of one core; its RSS."""

    def __init__(self, pid: int) -> None:
        import psutil

        self.process = psutil.Process(pid)

    def start(self) -> None:
        times = self.process.cpu_times()
        self._cpu, self._wall = times.user + times.system, time.monotonic()

    def stop(self) -> float:
        times = self.process.cpu_times()
        return (times.user + times.system - self._cpu) / (time.monotonic() - self._wall)

    def over(self, seconds: float) -> float:
        """The fraction over the next `seconds` (sleeps that long)."""
        self.start()
        time.sleep(seconds)
        return self.stop()

    def rss_bytes(self) -> int:
        return self.process.memory_info().rss

    def peak_rss_bytes(self) -> int:
        """The most RSS the process ever had (VmHWM), transient copies included."""
        with open(f"/proc/{self.process.pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        return 0


def counters_delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {name: after[name] - before.get(name, 0) for name in after}


# ---- other tracers on our library copies ----
#
# Another kvtrace agent on this host (a test run, another session) attaches to every process that
# maps a CUDA library, whatever its pid filter, so it can put uprobes on our copies too and inflate
# every mode. foreign_uprobes() finds them the way `bpftool perf` does: BPF_TASK_FD_QUERY on every
# perf-event fd of every other process.

_SYS_BPF = 321  # x86_64
_BPF_TASK_FD_QUERY = 20
_BPF_FD_TYPE_UPROBE, _BPF_FD_TYPE_URETPROBE = 4, 5


class _TaskFdQuery(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_uint32), ("fd", ctypes.c_uint32), ("flags", ctypes.c_uint32),
                ("buf_len", ctypes.c_uint32), ("buf", ctypes.c_uint64), ("prog_id", ctypes.c_uint32),
                ("fd_type", ctypes.c_uint32), ("probe_offset", ctypes.c_uint64),
                ("probe_addr", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)


def _uprobe_file(pid: int, fd: int) -> str | None:
    buf = ctypes.create_string_buffer(4096)
    query = _TaskFdQuery(pid=pid, fd=fd, buf_len=len(buf), buf=ctypes.addressof(buf))
    if _libc.syscall(_SYS_BPF, _BPF_TASK_FD_QUERY, ctypes.byref(query), ctypes.sizeof(query)) != 0:
        return None
    if query.fd_type not in (_BPF_FD_TYPE_UPROBE, _BPF_FD_TYPE_URETPROBE):
        return None
    return buf.value.decode(errors="replace")


def foreign_uprobes(lib_dirs) -> list[str]:
    """'pid (comm): file' for each uprobe another process holds on a file under lib_dirs."""
    inodes = {}
    for lib_dir in lib_dirs:
        for path in Path(lib_dir).iterdir():
            st = path.stat()
            inodes[(st.st_dev, st.st_ino)] = str(path)
    found = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        pid = int(entry.name)
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") != "anon_inode:[perf_event]":
                    continue
            except OSError:
                continue
            file = _uprobe_file(pid, int(fd))
            if file is None:
                continue
            try:
                st = os.stat(file if file.startswith("/") else f"/proc/{pid}/root/{file}")
            except OSError:
                continue
            ours = inodes.get((st.st_dev, st.st_ino))
            if ours:
                try:
                    comm = Path(f"/proc/{pid}/comm").read_text().strip()
                except OSError:
                    comm = "?"
                found.add(f"{pid} ({comm}): {ours}")
    return sorted(found)


class Guard:
    """Remembers which (round, mode) runs had another process's uprobes on that mode's libraries.

    measure() looks before and after each run; a foreign probe on mode M's copy spoils only runs
    of M (and, through the subtraction, the added costs of that round when M is the baseline).
    """

    def __init__(self, builds: dict) -> None:
        self.lib_dirs = {mode: str(build.lib_dir) + os.sep for mode, build in builds.items()}
        self.dirty: set[tuple[int, str]] = set()
        self.seen: set[str] = set()

    def _dirty_modes(self) -> set[str]:
        found = foreign_uprobes([d.rstrip(os.sep) for d in self.lib_dirs.values()])
        new = set(found) - self.seen
        if new:
            self.seen.update(new)
            progress("WARNING: another process has uprobes on the bench's libraries (another "
                     "tracer: its pid filter does not stop it attaching); those runs are dropped: "
                     + "; ".join(sorted(new)))
        return {mode for mode, lib_dir in self.lib_dirs.items()
                if any(lib_dir in entry for entry in found)}

    def measure(self, round_index: int, mode: str, run):
        """run() -> value; marks (round_index, mode) dirty when foreign probes were on mode's copy."""
        before = self._dirty_modes()
        value = run()
        if mode in before | self._dirty_modes():
            self.dirty.add((round_index, mode))
        return value

    def ok(self, round_index: int, *modes: str) -> bool:
        return not any((round_index, mode) in self.dirty for mode in modes)

    def summary(self, runs: int) -> str:
        if not self.dirty:
            return f"all {runs} runs clean (no other uprobes on the bench's libraries)"
        return (f"{len(self.dirty)} of {runs} runs DROPPED: another process had uprobes on their "
                f"libraries ({len(self.seen)} probe files, first: {sorted(self.seen)[0]})")
