"""Attaching bcc-loaded BPF programs with uprobe_multi links instead of one perf event per probe.

Why: a perf-event uprobe (what bcc's attach_uprobe makes) costs the kernel a grace period to take
down, waited for under the global event_mutex, so detaches run strictly one after another: stopping
the agent took 8.5-62 s with three libraries and minutes with ~1000 probes. A uprobe_multi link
(BPF_LINK_CREATE with attach type BPF_TRACE_UPROBE_MULTI, Linux >= 6.6) carries any number of probes
on one file; closing its fd unregisters them all and then waits for a single grace period, outside
event_mutex, so links closed from parallel threads wait together (close_links).

libbpf 1.1 (Debian 12) has no uprobe_multi options, so this module calls bpf(2) through ctypes with
the `union bpf_attr` members it needs written out below, with the kernel's names and offsets
(include/uapi/linux/bpf.h).

A Link holds its probes until close(): there is deliberately no finalizer, since closing waits for
a grace period and must not happen wherever the garbage collector runs. A link the agent forgets is
taken down by the kernel when the process exits.
"""
from __future__ import annotations

import ctypes
import errno
import functools
import os
import platform
import time
import weakref
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from kvtrace.sources.elf import entry_point_file_offset

if TYPE_CHECKING:
    from bcc import BPF

# enum bpf_cmd and enum bpf_attach_type / bpf_prog_type values (include/uapi/linux/bpf.h).
BPF_PROG_LOAD = 5
BPF_LINK_CREATE = 28
BPF_PROG_TYPE_KPROBE = 2
BPF_TRACE_UPROBE_MULTI = 48
BPF_F_UPROBE_MULTI_RETURN = 1 << 0  # link_create.uprobe_multi.flags: a return probe

# __NR_bpf: x86_64 has its own table; arm64 and riscv64 use the generic one.
_SYS_BPF_BY_MACHINE = {"x86_64": 321, "aarch64": 280, "riscv64": 280}

# Closing links from this many threads at once: each close waits in the kernel for a grace period
# and waits that overlap end together, so the time falls about linearly with threads (580 one-probe
# links on 2 cores: 27 s from 1 thread, 1.1 s from 32, 0.33 s from 128). A parked thread costs
# little; bench/detach_cost.py measures this default.
DEFAULT_CLOSE_THREADS = 128


class _LinkCreateUprobeMultiAttr(ctypes.Structure):
    """`union bpf_attr`, member `link_create` with its `uprobe_multi` arm (64 bytes; the kernel
    zero-fills the rest of the union, and rejects non-zero bytes past the fields it knows)."""

    _fields_ = [
        ("prog_fd", ctypes.c_uint32),  # 0   link_create.prog_fd
        ("target_fd", ctypes.c_uint32),  # 4   link_create.target_fd: must be 0 for uprobe_multi
        ("attach_type", ctypes.c_uint32),  # 8   link_create.attach_type = BPF_TRACE_UPROBE_MULTI
        ("flags", ctypes.c_uint32),  # 12  link_create.flags: must be 0 for uprobe_multi
        ("path", ctypes.c_uint64),  # 16  link_create.uprobe_multi.path (const char *)
        ("offsets", ctypes.c_uint64),  # 24  .uprobe_multi.offsets (__u64[cnt], file offsets)
        ("ref_ctr_offsets", ctypes.c_uint64),  # 32  .uprobe_multi.ref_ctr_offsets (__u64[cnt] or 0)
        ("cookies", ctypes.c_uint64),  # 40  .uprobe_multi.cookies (__u64[cnt] or 0)
        ("cnt", ctypes.c_uint32),  # 48  .uprobe_multi.cnt
        ("uprobe_multi_flags", ctypes.c_uint32),  # 52  .uprobe_multi.flags (BPF_F_UPROBE_MULTI_RETURN)
        ("pid", ctypes.c_uint32),  # 56  .uprobe_multi.pid: 0 = every process, else a tgid
    ]


class _ProgLoadAttr(ctypes.Structure):
    """`union bpf_attr`, member for BPF_PROG_LOAD up to expected_attach_type (72 bytes)."""

    _fields_ = [
        ("prog_type", ctypes.c_uint32),  # 0
        ("insn_cnt", ctypes.c_uint32),  # 4
        ("insns", ctypes.c_uint64),  # 8   const struct bpf_insn *
        ("license", ctypes.c_uint64),  # 16  const char *
        ("log_level", ctypes.c_uint32),  # 24
        ("log_size", ctypes.c_uint32),  # 28
        ("log_buf", ctypes.c_uint64),  # 32
        ("kern_version", ctypes.c_uint32),  # 40
        ("prog_flags", ctypes.c_uint32),  # 44
        ("prog_name", ctypes.c_char * 16),  # 48
        ("prog_ifindex", ctypes.c_uint32),  # 64
        ("expected_attach_type", ctypes.c_uint32),  # 68
    ]


# The layouts above are the ABI: fail at import rather than hand the kernel shifted fields.
assert _LinkCreateUprobeMultiAttr.path.offset == 16 and _LinkCreateUprobeMultiAttr.cnt.offset == 48
assert _LinkCreateUprobeMultiAttr.pid.offset == 56 and ctypes.sizeof(_LinkCreateUprobeMultiAttr) == 64
assert _ProgLoadAttr.prog_name.offset == 48 and _ProgLoadAttr.expected_attach_type.offset == 68

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _bpf(command: int, attr: ctypes.Structure) -> int:
    """bpf(2); raises OSError with the kernel's errno. ctypes drops the GIL for the call."""
    number = _SYS_BPF_BY_MACHINE.get(platform.machine())
    if number is None:
        raise OSError(errno.ENOSYS, f"bpf(2) syscall number unknown for {platform.machine()}")
    result = _libc.syscall(ctypes.c_long(number), ctypes.c_int(command), ctypes.byref(attr),
                           ctypes.c_uint(ctypes.sizeof(attr)))
    if result < 0:
        error_number = ctypes.get_errno()
        raise OSError(error_number, os.strerror(error_number))
    return int(result)


BPF_PROG_TEST_RUN = 10


class _TestRunAttr(ctypes.Structure):
    """union bpf_attr for BPF_PROG_TEST_RUN (include/uapi/linux/bpf.h), as far as a raw tracepoint's run uses it."""

    _fields_ = [
        ("prog_fd", ctypes.c_uint32), ("retval", ctypes.c_uint32),  # 0
        ("data_size_in", ctypes.c_uint32), ("data_size_out", ctypes.c_uint32),  # 8
        ("data_in", ctypes.c_uint64), ("data_out", ctypes.c_uint64),  # 16
        ("repeat", ctypes.c_uint32), ("duration", ctypes.c_uint32),  # 32
        ("ctx_size_in", ctypes.c_uint32), ("ctx_size_out", ctypes.c_uint32),  # 40
        ("ctx_in", ctypes.c_uint64), ("ctx_out", ctypes.c_uint64),  # 48
        ("flags", ctypes.c_uint32), ("cpu", ctypes.c_uint32), ("batch_size", ctypes.c_uint32),  # 64
    ]


assert _TestRunAttr.ctx_in.offset == 48 and _TestRunAttr.batch_size.offset == 72


def run_raw_tracepoint(fd: int, *args: int) -> int:
    """Runs a loaded raw tracepoint program once, on this CPU, with `args` as its ctx->args (BPF_PROG_TEST_RUN,
    Linux 5.10+); its return value. Raises OSError as the kernel refuses."""
    values = (ctypes.c_uint64 * len(args))(*(arg & 0xFFFF_FFFF_FFFF_FFFF for arg in args))
    attr = _TestRunAttr(prog_fd=fd, ctx_size_in=ctypes.sizeof(values), ctx_in=ctypes.addressof(values))
    _bpf(BPF_PROG_TEST_RUN, attr)
    return int(attr.retval)


# What BPF_LINK_CREATE's errno means for a uprobe_multi link (kernel/trace/bpf_trace.c,
# bpf_uprobe_multi_link_attach, and kernel/events/uprobes.c).
_LINK_ERRNO_HINTS = {
    errno.ENOENT: "no such file",
    errno.ENOTDIR: "a directory in the path does not exist",
    errno.EBADF: "not a regular file (or prog_fd is not an open BPF program)",
    errno.EINVAL: ("the program was not loaded with expected_attach_type BPF_TRACE_UPROBE_MULTI "
                   "(use load_uprobe_multi), an offset lies past the end of the file, a USDT "
                   "semaphore offset is odd, another probe at the same offset names a different "
                   "semaphore (or none: the kernel logs `ref_ctr_offset mismatch`), or the kernel "
                   "predates uprobe_multi links (Linux 6.6)"),
    errno.ESRCH: "no such process (pid must be a process id, not a thread id)",
    errno.EPERM: "run as root, or grant CAP_BPF and CAP_PERFMON",
    errno.EACCES: "run as root, or grant CAP_BPF and CAP_PERFMON",
    errno.EOPNOTSUPP: "kernel built without CONFIG_UPROBES",
    errno.E2BIG: "more than 2**20 offsets in one link (MAX_UPROBE_MULTI_CNT)",
    errno.ENOMEM: "too many offsets for one link (kernel memory)",
}


class LinkError(OSError):
    """The kernel refused a uprobe_multi link; str() names the errno, the file and the likely cause."""

    def __init__(self, error_number: int, path: str, probe_count: int, retprobe: bool) -> None:
        super().__init__(error_number, os.strerror(error_number), path)
        self.probe_count = probe_count
        self.retprobe = retprobe

    def __str__(self) -> str:
        error_number = self.errno or errno.EIO
        name = errno.errorcode.get(error_number, str(error_number))
        kind = "return probe" if self.retprobe else "entry probe"
        hint = _LINK_ERRNO_HINTS.get(error_number, "")
        return (f"cannot attach a uprobe_multi link ({self.probe_count} {kind}"
                f"{'s' if self.probe_count != 1 else ''}) to {self.filename}: "
                f"{name} ({self.strerror}){': ' + hint if hint else ''}")


class Link:
    """One uprobe_multi link: its probes fire while the fd is open; close() takes them all down
    (the calling thread waits in the kernel for one grace period). close() is idempotent."""

    __slots__ = ("fd", "path", "probe_count", "retprobe")

    def __init__(self, fd: int, path: str, probe_count: int, retprobe: bool) -> None:
        self.fd = fd
        self.path = path
        self.probe_count = probe_count
        self.retprobe = retprobe

    @property
    def closed(self) -> bool:
        return self.fd < 0

    def close(self) -> None:
        if self.fd < 0:
            return
        fd, self.fd = self.fd, -1
        os.close(fd)

    def __repr__(self) -> str:
        kind = "return" if self.retprobe else "entry"
        state = "closed" if self.closed else f"fd={self.fd}"
        return f"<Link {kind} x{self.probe_count} {self.path} {state}>"


# bcc caches programs by name; these were loaded here, with the uprobe_multi attach type.
_UPROBE_MULTI_FUNCTIONS: weakref.WeakSet[object] = weakref.WeakSet()


def repair_bcc_attach_uprobe() -> bool:
    """Makes bcc's Python attach_uprobe/attach_uretprobe register their probes with no USDT
    semaphore (ref_ctr_offset 0). Returns whether bcc needed it.

    bcc's Python binding declares bpf_attach_uprobe with six arguments where libbcc (since 0.17)
    takes seven: the seventh, ref_ctr_offset, is whatever lies in its place on the stack (x86-64
    passes it there; iovisor/bcc#5236; 0x6 on the development VM). The kernel then (1) increments a "semaphore" at
    that offset of the probed file in the traced process, and (2) refuses any other probe at the
    same function whose ref_ctr_offset differs (`ref_ctr_offset mismatch`, EINVAL): kvtrace's
    uprobe_multi links and another bcc tool's perf-event probes shut each other out. Applied by the
    loader before its first attach and by the benchmarks' empty probes; idempotent.
    """
    from bcc import libbcc  # only here: the rest of this module works without bcc

    declared = libbcc.lib.bpf_attach_uprobe
    if getattr(declared, "_kvtrace_repaired", False) or len(getattr(declared, "argtypes", None) or ()) != 6:
        return False
    full = libbcc.lib["bpf_attach_uprobe"]  # a new function object: bcc's own stays as declared
    full.restype = ctypes.c_int
    full.argtypes = [*declared.argtypes, ctypes.c_uint32]

    def bpf_attach_uprobe(prog_fd, attach_type, event_name, binary_path, offset, pid, ref_ctr_offset=0):
        # (a bcc that passes the seventh itself, still declaring six types, is taken at its word)
        return full(prog_fd, attach_type, event_name, binary_path, offset, pid, ref_ctr_offset)

    bpf_attach_uprobe._kvtrace_repaired = True  # type: ignore[attr-defined]
    libbcc.lib.bpf_attach_uprobe = bpf_attach_uprobe
    return True


def load_uprobe_multi(bpf: BPF, fn_name: str) -> int:
    """Loads a function of a bcc module as a kprobe-type program with expected_attach_type
    BPF_TRACE_UPROBE_MULTI (the kernel refuses uprobe_multi links to any other) and returns its fd.

    bcc 0.26 hands attach_type to libbpf as bpf_prog_load_opts.expected_attach_type (checked by
    tests/integration/test_links.py). bcc keeps one program per name, so a function already loaded
    for bcc's own attach_uprobe cannot serve a link, nor the other way round: give each path its own
    function name. bcc owns the fd (BPF.cleanup() closes it); links keep their own reference.
    """
    from bcc import BPF  # only here: the rest of this module works without bcc

    name = fn_name.encode()
    cached = bpf.funcs.get(name)
    if cached is not None and cached not in _UPROBE_MULTI_FUNCTIONS:
        raise ValueError(f"{fn_name} is already loaded as a plain kprobe program (bcc caches "
                         "programs by name); a uprobe_multi link needs its own function name")
    function = bpf.load_func(name, BPF.KPROBE, attach_type=BPF_TRACE_UPROBE_MULTI)
    _UPROBE_MULTI_FUNCTIONS.add(function)
    return int(function.fd)


def attach_uprobe_multi(prog_fd: int, path: str | os.PathLike[str], offsets: Sequence[int], *,
                        retprobe: bool = False, pid: int = -1,
                        ref_ctr_offsets: Sequence[int] | None = None,
                        cookies: Sequence[int] | None = None) -> Link:
    """One link with a probe at each file offset of `path` (see elf.function_file_offsets).

    pid -1 probes every process that maps the file; a process id (not a thread id: ESRCH) limits
    the breakpoints to that process. ref_ctr_offsets are USDT semaphore file offsets (0 = none), one
    per offset; the kernel
    increments each semaphore while the probe is in. cookies (u64, one per offset) reach the program
    through bpf_get_attach_cookie(ctx), so one program can tell its attach points apart.
    """
    probe_count = len(offsets)
    if probe_count == 0:
        raise ValueError("a uprobe_multi link needs at least one offset")
    for label, values in (("ref_ctr_offsets", ref_ctr_offsets), ("cookies", cookies)):
        if values is not None and len(values) != probe_count:
            raise ValueError(f"{label} has {len(values)} entries for {probe_count} offsets")
    if pid == 0 or pid < -1:
        raise ValueError(f"pid {pid}: use -1 for every process or a process id")
    path_text = os.fspath(path)
    u64_array = ctypes.c_uint64 * probe_count
    # These buffers must live until the syscall returns: the kernel copies them during the call.
    path_buffer = ctypes.create_string_buffer(os.fsencode(path_text))
    offset_array = u64_array(*offsets)
    ref_ctr_array = u64_array(*ref_ctr_offsets) if ref_ctr_offsets is not None else None
    cookie_array = u64_array(*cookies) if cookies is not None else None
    attr = _LinkCreateUprobeMultiAttr(
        prog_fd=prog_fd, attach_type=BPF_TRACE_UPROBE_MULTI,
        path=ctypes.addressof(path_buffer), offsets=ctypes.addressof(offset_array),
        ref_ctr_offsets=ctypes.addressof(ref_ctr_array) if ref_ctr_array is not None else 0,
        cookies=ctypes.addressof(cookie_array) if cookie_array is not None else 0,
        cnt=probe_count, uprobe_multi_flags=BPF_F_UPROBE_MULTI_RETURN if retprobe else 0,
        pid=0 if pid == -1 else pid)
    try:
        fd = _bpf(BPF_LINK_CREATE, attr)
    except OSError as error:
        raise LinkError(error.errno or errno.EIO, path_text, probe_count, retprobe) from None
    return Link(fd, path_text, probe_count, retprobe)


def close_links(links: Iterable[Link], max_threads: int = DEFAULT_CLOSE_THREADS) -> float:
    """Closes every link, up to max_threads at a time, and returns the seconds it took.

    Each close blocks its thread for a grace period; os.close releases the GIL, and waits that
    overlap in the kernel end together, so N links take about one grace period, not N. All links
    are closed even if one fails; the first OSError is raised afterwards.
    """
    pending = [link for link in links if not link.closed]
    started_seconds = time.monotonic()
    if len(pending) <= 1 or max_threads <= 1:
        first_error: OSError | None = None
        for link in pending:
            try:
                link.close()
            except OSError as error:  # close the rest anyway
                first_error = first_error or error
        if first_error is not None:
            raise first_error
    else:
        with ThreadPoolExecutor(max_workers=min(max_threads, len(pending)),
                                thread_name_prefix="kvtrace-unlink") as pool:
            futures = [pool.submit(link.close) for link in pending]
        for future in futures:
            future.result()  # re-raises a close's OSError, after all of them ran
    return time.monotonic() - started_seconds


# mov r0, 0; exit: the smallest program the verifier accepts.
_RETURN_ZERO_INSNS = bytes.fromhex("b700000000000000" "9500000000000000")


@functools.lru_cache(maxsize=1)
def uprobe_multi_supported() -> str:
    """"" when this process can attach uprobe_multi links, else one line saying why not.

    The probe is a trial: a two-instruction program loaded with the uprobe_multi attach type, linked
    to this process's own executable at its ELF entry point (_start, which never runs again) for
    this pid only, then closed. Looking for `bpf_uprobe_multi_link` in /sys/kernel/btf/vmlinux would
    only say the kernel was built with the code; the trial also sees a missing capability, lockdown,
    an LSM or seccomp refusing bpf(2), or CONFIG_UPROBES off, and costs less than reading 5 MiB of
    BTF (about a millisecond plus one grace period on close). Cached: the answer holds per process.
    """
    insns = ctypes.create_string_buffer(_RETURN_ZERO_INSNS, len(_RETURN_ZERO_INSNS))
    license_text = ctypes.create_string_buffer(b"GPL")
    load = _ProgLoadAttr(prog_type=BPF_PROG_TYPE_KPROBE, insn_cnt=len(_RETURN_ZERO_INSNS) // 8,
                         insns=ctypes.addressof(insns), license=ctypes.addressof(license_text),
                         prog_name=b"kvt_um_probe", expected_attach_type=BPF_TRACE_UPROBE_MULTI)
    try:
        prog_fd = _bpf(BPF_PROG_LOAD, load)
    except OSError as error:
        error_number = error.errno or errno.EIO
        name = errno.errorcode.get(error_number, str(error_number))
        if error_number in (errno.EPERM, errno.EACCES):
            return f"cannot load BPF programs ({name}): run as root, or grant CAP_BPF and CAP_PERFMON"
        return f"kernel refused a uprobe_multi program ({name}: {error.strerror}); needs Linux >= 6.6"
    try:
        executable = "/proc/self/exe"
        entry_offset = entry_point_file_offset(executable)
        if entry_offset is None:
            return f"cannot find the entry point of {os.path.realpath(executable)} to test a link on"
        try:
            link = attach_uprobe_multi(prog_fd, executable, [entry_offset], pid=os.getpid())
        except LinkError as error:
            if error.errno == errno.EINVAL:
                return "kernel refused a uprobe_multi link (EINVAL); needs Linux >= 6.6"
            return str(error)
        link.close()
        return ""
    finally:
        os.close(prog_fd)
