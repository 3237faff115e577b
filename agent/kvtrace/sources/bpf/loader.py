"""Loads probes/kvtrace.bpf.c with bcc, attaches it to CUDA libraries and reads its maps and rings.

With links.py (uprobe_multi links on bcc's programs) and preflight.py (what the kernel offers), the
only code that touches bcc. It hands raw records (ctypes structs) to callbacks; decode.py turns them
into model events.

Why this module is long (about 800 lines): BpfProbes owns the loaded program, and compiling, attaching,
the maps and the rings all go through its one bcc handle; cut further, each part would reach into the others'
handle. What stands apart without it is apart: ring.py, links.py, preflight.py, kernel_ledger.py.
"""
from __future__ import annotations

import ctypes
import errno
import logging
import math
import os
import platform
import re
import select
import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from kvtrace.model.events import Api
from kvtrace.sources.bpf import abi, links
from kvtrace.sources.bpf.btf import VMLINUX_BTF
from kvtrace.sources.bpf.ring import RingReader
from kvtrace.sources.bpf.shares import UID_USERS, RawShare, share_cflags
from kvtrace.sources.bpf.symbols import (
    HOOK_ENTRIES_PROGRAM,
    HOOK_PROBE,
    TORCH_PROGRAM,
    entry_function,
    return_function,
)
from kvtrace.sources.bpf.usdt import ArgumentKind, UsdtProbe
from kvtrace.sources.elf import function_file_offsets
from kvtrace.sources.python.offsets import GLIBC_SPECIFIC_1STBLOCK

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ProbeSettings:
    """Compile-time sizes of the BPF maps and run-time limits (probes/settings.h lists the defines)."""

    max_ledger_entries: int = 1 << 20
    # (process, device, layer, memory) sums of the ledger's allocations and blocks: ~100 bytes of kernel
    # memory each; a process holds a few (one per device, layer and kind of memory it uses).
    max_totals: int = abi.DEFAULT_MAX_TOTALS
    ringbuf_pages: int = 4096  # 16 MiB: ~190 000 events of burst before any is lost
    max_threads: int = 65536
    max_stacks: int = 16384
    task_fsbase_offset: int = -1  # from BTF; -1 disables Python stacks
    task_exit_code_offset: int = -1  # from BTF; -1: process exits carry no wait status
    task_comm_offset: int = -1  # from BTF; -1: events copy the thread's name through a helper call
    wakeup_events: int = 512  # events a CPU submits before it wakes the reader; else its timer takes them
    # How probes go in: uprobe_multi links (Linux 6.6+: detaching waits for one grace period per
    # link, in parallel, where a perf-event uprobe waits for its own, one after another, under a
    # global lock: minutes to stop with a few hundred probes), or bcc's perf-event uprobes.
    # None: links where the kernel takes them.
    uprobe_links: bool | None = None
    # PyTorch block events a process may send per second (0: no limit); beyond, the block still
    # goes into the ledger and the event is counted as unsent (blocks_unsent), not sent.
    block_events_per_second: int = 100_000
    # Per-thread call state (saved arguments, the outer stack, the selected device) in task storage,
    # or in LRU hashes keyed by thread id. None: task storage where the kernel has it for these
    # programs (task_storage_supported).
    task_storage: bool | None = None
    # Whether sched_process_exit says which thread is its process's last (group_dead): an exit is then
    # reported when the process ends, not when its main thread (the group leader) does, and with task
    # storage each thread remembers that its process is tracked (one hash lookup a thread, not one an
    # allocation). None: read from tracefs (BpfProbes resolves it once and logs which).
    exit_group_dead: bool | None = None

    def cflags(self) -> list[str]:
        task_storage = task_storage_supported() if self.task_storage is None else self.task_storage
        group_dead = exit_reports_group_dead() if self.exit_group_dead is None else self.exit_group_dead
        return [
            f"-DKVT_TASK_STORAGE={int(task_storage)}",
            f"-DKVT_EXIT_GROUP_DEAD={int(group_dead)}",
            f"-DKVT_MAX_STACKS={self.max_stacks}",
            f"-DKVT_TASK_FSBASE_OFFSET={self.task_fsbase_offset}",
            f"-DKVT_TASK_EXIT_CODE_OFFSET={self.task_exit_code_offset}",
            f"-DKVT_TASK_COMM_OFFSET={self.task_comm_offset}",
            f"-DKVT_MAX_LEDGER_ENTRIES={self.max_ledger_entries}",
            f"-DKVT_MAX_TOTALS={self.max_totals}",
            f"-DKVT_RINGBUF_PAGES={self.ringbuf_pages}",
            f"-DKVT_MAX_THREADS={self.max_threads}",
            f"-DKVT_WAKEUP_EVENTS={self.wakeup_events}",
            f"-DKVT_GLIBC_SPECIFIC_1STBLOCK={GLIBC_SPECIFIC_1STBLOCK:#x}",
            *share_cflags(self.max_ledger_entries, self.max_totals),
        ]


# bpf_task_storage_get for kprobe-type programs (what uprobes run) without the deadlock check that
# refused it in tracing contexts: Linux 6.2. It needs BTF (bpf_get_current_task_btf) too.
TASK_STORAGE_KERNEL = (6, 2)


def task_storage_supported(release: str | None = None, btf: str | os.PathLike[str] = VMLINUX_BTF) -> bool:
    """Whether this kernel (uname -r, or `release`) gives uprobe programs task storage."""
    numbers = re.match(r"(\d+)\.(\d+)", release if release is not None else platform.release())
    if numbers is None:
        return False
    return (int(numbers[1]), int(numbers[2])) >= TASK_STORAGE_KERNEL and os.path.exists(btf)


# The process exit tracepoint's fields, as bcc reads them to compile TRACEPOINT_PROBE (tracefs, either mount).
EXIT_TRACEPOINT_FORMATS = tuple(Path(root) / "events/sched/sched_process_exit/format"
                                for root in ("/sys/kernel/tracing", "/sys/kernel/debug/tracing"))


def exit_reports_group_dead(formats: Iterable[Path] = EXIT_TRACEPOINT_FORMATS) -> bool:
    """Whether this kernel's sched_process_exit has the group_dead field (checked on 6.18; older kernels'
    tracepoints lack it)."""
    for path in formats:
        try:
            return "field:bool group_dead;" in path.read_text()
        except OSError:
            continue
    return False


# The program the allocation probes tail-call for the Python stack walk (probes/pystack.h).
STACK_WALKER = "walk_stack"
SHARE_RETURN = "kvt_share_return"  # shares.h: what the agent deleted of a live process, back to its share

# Mean bytes between sampled PyTorch block stacks (BpfProbes.set_block_sample_bytes): a ledger entry
# keeps it in KiB in 16 bits (struct kvt_ledger_value.sample_kib).
BLOCK_SAMPLE_BYTES_MIN = 4 << 10
BLOCK_SAMPLE_BYTES_MAX = 0xFFFF << 10


def exponential_quantiles(mean: int, count: int = abi.BLOCK_SAMPLE_DRAWS) -> list[int]:
    """The exponential distribution of `mean` at the middle of `count` equal slices of probability, as the
    probes draw from it (one at random: block_sample_draws): -ln((i + 0.5) / count) * mean, largest first.
    Their mean is within 0.04 % of `mean` at 1024 (the tail beyond 7.6 means is cut)."""
    return [round(-math.log((index + 0.5) / count) * mean) for index in range(count)]

# Events handled by one poll before it returns (about 0.2 s of work at the measured pace).
POLL_BUDGET_EVENTS = 16384


def return_freed_heap() -> None:
    """Compiling frees most of what clang and LLVM took, but glibc keeps freed heap for reuse; hand
    it back to the system (about 20 MiB of the agent's resident memory)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


# The compiler's libraries, whose code bcc runs only to compile (the agent compiles once, at start).
COMPILER_LIBRARIES = re.compile(r"/lib(LLVM|clang-cpp)[-.][^/]*$")
_MADV_DONTNEED = 4


def return_compiler_pages(smaps: Path = Path("/proc/self/smaps")) -> int:
    """Once the probes are compiled, the pages of clang's and LLVM's code that compiling read in stay mapped in
    the agent: ~72 MiB of its resident memory (RSS; shared, clean: the page cache's) that nothing runs again. They
    are unmapped here (madvise MADV_DONTNEED): only code mappings (r-xp) of those libraries with no page of their
    own (no anonymous page: none copied on write), whose pages are the file's, in the page cache; a later call
    into the library reads them in again, unchanged. Their data and relocated pages stay. The bytes let go."""
    if not smaps.exists():
        return 0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    candidates: list[tuple[int, int, dict[str, int]]] = []
    fields: dict[str, int] = {}
    try:
        with open(smaps) as lines:
            for line in lines:
                parts = line.split()
                if len(parts) >= 5 and "-" in parts[0] and not parts[0].endswith(":"):
                    fields = {}
                    if parts[1] == "r-xp" and len(parts) >= 6 and COMPILER_LIBRARIES.search(parts[5]):
                        start, end = (int(bound, 16) for bound in parts[0].split("-"))
                        candidates.append((start, end, fields))
                elif len(parts) >= 2 and parts[0].endswith(":") and parts[1].isdigit():
                    fields[parts[0][:-1]] = int(parts[1])
    except OSError:
        return 0
    returned = 0
    for start, end, seen in candidates:
        if seen.get("Anonymous", 1) or not seen.get("Rss"):
            continue
        if madvise(start, end - start, _MADV_DONTNEED) == 0:
            returned += seen["Rss"] << 10
    return returned


LEDGER_READ_CHUNK = 4096  # entries per batched read of the ledger map (72 bytes each: ~300 KB of buffers)
TRACKED_READ_CHUNK = 1024  # of tracked_pids (12 bytes each)
TOTALS_READ_CHUNK = 1024  # of ledger_totals (32 bytes each)


_KERNEL_ENOTSUPP = 524  # the kernel's "operation not supported" (no name in Python's errno)


class _NoBatchedLookup(Exception):
    pass


def _lookup_in_chunks(map_fd: int, key_size: int = ctypes.sizeof(abi.RawLedgerKey),
                      value_size: int = ctypes.sizeof(abi.RawLedgerValue), chunk: int = LEDGER_READ_CHUNK,
                      what: str = "the ledger") -> Iterator[tuple[bytes, bytes]]:
    """BPF_MAP_LOOKUP_BATCH over a map, `chunk` entries at a time: (keys, values) as raw bytes (by default
    of the ledger map: struct kvt_ledger_key and kvt_ledger_value arrays; a per-CPU map's value is every
    CPU's, 8-byte aligned). A map changing meanwhile (probes run on) may give an entry twice or miss one
    moved between buckets: readers treat it as a moment's view."""
    from bcc.libbcc import lib

    keys = (ctypes.c_char * (key_size * chunk))()
    values = (ctypes.c_char * (value_size * chunk))()
    token, next_token, count = ctypes.c_uint32(0), ctypes.c_uint32(0), ctypes.c_uint32(0)
    first = True
    while True:
        count.value = chunk
        result = lib.bpf_lookup_batch(map_fd, None if first else ctypes.byref(token), ctypes.byref(next_token),
                                      ctypes.byref(keys), ctypes.byref(values), ctypes.byref(count))
        error = ctypes.get_errno() if result != 0 else 0
        if result != 0 and error not in (errno.ENOENT, 0):
            if first and error in (errno.EINVAL, errno.EOPNOTSUPP, _KERNEL_ENOTSUPP):
                raise _NoBatchedLookup()
            raise OSError(error, f"BPF_MAP_LOOKUP_BATCH of {what} failed: {os.strerror(error)}")
        if count.value:
            yield (ctypes.string_at(keys, key_size * count.value),
                   ctypes.string_at(values, value_size * count.value))
        if result != 0:  # ENOENT: the last chunk (possibly empty) has been read
            return
        first = False
        token.value = next_token.value


def _per_cpu_sums(table, count: int) -> dict[str, int]:
    """abi.COUNTERS by name, each summed over the CPUs, from a BPF per-CPU array of u64 (bcc's PerCpuArray)
    in one BPF_MAP_LOOKUP_BATCH."""
    cpus = ctypes.sizeof(table.Leaf) // 8  # bcc sizes a per-CPU u64 leaf for every possible CPU
    sums = dict.fromkeys(range(count), 0)
    # a chunk one longer than the array: the kernel says ENOENT in the first call, no second one
    for keys, values in _lookup_in_chunks(table.map_fd, 4, 8 * cpus, count + 1, "the counters"):
        per_cpu = memoryview(values).cast("Q")
        for index, key in enumerate(memoryview(keys).cast("I")):
            sums[key] = sum(per_cpu[index * cpus:(index + 1) * cpus])
    return {name: sums[index] for index, name in enumerate(abi.COUNTERS)}


class BpfProbes:
    """The compiled probe program: attach/detach per library, ring buffers, maps."""

    def __init__(self, settings: ProbeSettings = ProbeSettings()) -> None:
        from bcc import BPF  # imported here so that everything else works without bcc

        if settings.exit_group_dead is None:
            settings = replace(settings, exit_group_dead=exit_reports_group_dead())
        self.settings = settings
        self._counters_batched = True  # until the kernel refuses a batched read of an array
        self._hashes_batched = True  # until the kernel refuses a batched read of a hash (_map_chunks)
        links.repair_bcc_attach_uprobe()  # before any perf-event probe (kernels before 6.6)
        started = time.monotonic()
        text = abi.program_text()
        self._walker_in_program = f"int {STACK_WALKER}(" in text
        self._hook_in_program = f"int {HOOK_ENTRIES_PROGRAM}(" in text
        try:
            self._bpf = BPF(text=text.encode(), cflags=settings.cflags())
        except Exception as error:  # bcc raises plain Exception
            if settings.task_storage is not None or not task_storage_supported():
                raise
            # chosen by the kernel's version: where its task storage is refused, the LRU hashes serve
            log.warning("the probes with task storage did not load (%s): per-thread state in LRU hashes", error)
            settings = self.settings = replace(settings, task_storage=False)
            self._bpf = BPF(text=text.encode(), cflags=settings.cflags())
        log.info("probes compiled in %.1f s; per-thread state in %s; a process's exit reported at the end of its %s",
                 time.monotonic() - started,
                 "task storage" if "-DKVT_TASK_STORAGE=1" in settings.cflags() else "LRU hashes",
                 "last thread" if settings.exit_group_dead else
                 "main thread (this kernel's tracepoint has no group_dead)")
        self.compile_seconds = time.monotonic() - started
        self._make_share_records()
        self.set_block_rate(settings.block_events_per_second)
        return_freed_heap()
        returned = return_compiler_pages()
        if returned:
            log.info("the compiler's code let go of: %.0f MiB resident", returned / 2**20)
        # Attachments are per library, named by the caller's key (the agent's: the file's device and
        # inode, so that a file replaced at the same path is a new library; the path by default).
        self._paths: dict[Hashable, str] = {}  # key -> the path attached through
        self.refused_symbols: dict[str, str] = {}  # the last attach(): symbol -> why it was refused
        self._attached: dict[Hashable, dict[int, list[str]]] = {}  # key -> pid (-1: all) -> symbols
        self._links: dict[Hashable, list[links.Link]] = {}  # key -> its links (uprobe_multi mode)
        self._programs: dict[str, int] = {}  # function name -> fd, loaded for uprobe_multi links
        self._share_return_fd: int | None = None  # kvt_share_return, loaded at its first use
        self._share_return_failed = False
        self.shares_not_given_total = 0  # entries the agent deleted whose share could not be given back
        self._torch_links: dict[Hashable, dict[int, links.Link]] = {}  # key -> pid (-1: all) -> its PyTorch link
        # key -> (its usable sites, their cookies): usdt_sites entries made once per library and
        # shared by its links (one per pid under -p)
        self._torch_sites: dict[Hashable, tuple[list[UsdtProbe], list[int]]] = {}
        self._next_cookie = 0  # usdt_sites keys: one per probe site
        self._process_generation = 0  # config's KVT_CONFIG_PROCESS_GENERATION: raised at each change per process
        self.uprobe_links = settings.uprobe_links
        if self.uprobe_links is None:
            why_not = links.uprobe_multi_supported()
            self.uprobe_links = not why_not
            if why_not:
                log.warning("probes go in as perf-event uprobes (stopping takes ~0.1 s per probe): %s", why_not)
        self._put_in_stack_walker()
        self._put_in_hook_entries()
        self._epoll: select.epoll | None = None
        self._ring_reader: RingReader | None = None
        self._callback_records: list[bytes] = []  # bcc's callback path: records of this poll
        self._on_events: Callable[[bytes, int, int], None] = lambda records, stride, offset: None

    # ---- attach ----

    def attach(self, path: str, symbols: Iterable[str], pid: int = -1, key: Hashable = None) -> list[str]:
        """Entry and return probes on each symbol of the file, for every process (pid -1) or for
        one process only (the kernel then plants no breakpoints in any other process).

        Returns the symbols attached; a symbol that fails is logged and skipped. Raises
        ProbeQuotaFull, attaching nothing, when bcc's probe quota (perf-event uprobes) cannot take
        the library whole.
        """
        key = path if key is None else key
        symbols = list(symbols)
        self._paths[key] = path
        self.refused_symbols = {}
        if self.uprobe_links:
            done = self._attach_links(key, path, symbols, pid)
            self._attached.setdefault(key, {})[pid] = done
            return done
        from bcc import BPF

        # bcc counts perf-event probes against one quota for the process (1000 unless
        # BCC_PROBE_LIMIT): a library that does not fit whole is refused, not half attached.
        needed, limit = 2 * len(symbols), BPF.get_probe_limit()
        if self._bpf.num_open_uprobes() + needed > limit:
            raise ProbeQuotaFull(f"{needed} probes would pass bcc's quota of {limit} open probes "
                                 f"({self._bpf.num_open_uprobes()} open; BCC_PROBE_LIMIT raises it)")
        done = []
        for symbol in symbols:
            try:
                self._bpf.attach_uprobe(name=path.encode(), sym=symbol.encode(),
                                        fn_name=entry_function(symbol).encode(), pid=pid)
                self._bpf.attach_uretprobe(name=path.encode(), sym=symbol.encode(),
                                           fn_name=return_function(symbol).encode(), pid=pid)
            except Exception as error:  # bcc raises plain Exception
                self._refuse(symbol, path, pid, error)
                self._detach_symbol(path, symbol, pid)
                continue
            done.append(symbol)
        self._attached.setdefault(key, {})[pid] = done
        return done

    def _refuse(self, symbol: str, path: str, pid: int, error: object) -> None:
        log.warning("cannot attach to %s in %s%s: %s", symbol, path, f" for pid {pid}" if pid != -1 else "", error)
        self.refused_symbols[symbol] = str(error)

    def _attach_links(self, key: Hashable, path: str, symbols: list[str], pid: int) -> list[str]:
        """One entry and one return link per symbol (each program handles one API)."""
        offsets = function_file_offsets(path, symbols)
        if not offsets:  # discovery read these symbols; the file cannot be read (or was replaced) since
            raise LibraryUnreadable(f"cannot read the function offsets of {path}")
        done = []
        for symbol in symbols:
            offset = offsets.get(symbol)
            if offset is None:
                self._refuse(symbol, path, pid, "no function symbol with a file offset")
                continue
            made: list[links.Link] = []
            try:
                for function, retprobe in ((entry_function(symbol), False), (return_function(symbol), True)):
                    made.append(links.attach_uprobe_multi(self._program(function), path, [offset],
                                                          retprobe=retprobe, pid=pid))
            except Exception as error:  # LinkError; bcc raises plain Exception when a load fails
                self._refuse(symbol, path, pid, error)
                links.close_links(made)
                continue
            self._links.setdefault(key, []).extend(made)
            done.append(symbol)
        return done

    def attach_torch(self, path: str, probes: Sequence[UsdtProbe], pid: int = -1,
                     key: Hashable = None) -> list[UsdtProbe]:
        """One uprobe_multi link on PyTorch's allocator probes in `path`, for every process (-1) or
        one: their semaphores are its ref_ctr_offsets (the kernel raises them while the link is in,
        so the probes cost nothing otherwise), each site's cookie names its entry in usdt_sites.
        Returns the probes attached; raises TorchProbesRefused with the reason when none can be."""
        if not self.uprobe_links:
            raise TorchProbesRefused("PyTorch's allocator probes need uprobe_multi links (Linux 6.6+)")
        key = path if key is None else key
        self._paths[key] = path
        fresh = key not in self._torch_sites
        if fresh:
            self._torch_sites[key] = self._add_torch_sites(path, probes)
        attached, cookies = self._torch_sites[key]
        try:
            link = links.attach_uprobe_multi(
                self._program(TORCH_PROGRAM), path, [probe.pc_file_offset for probe in attached],
                ref_ctr_offsets=[probe.semaphore_file_offset for probe in attached], cookies=cookies, pid=pid)
        except Exception as error:  # LinkError; bcc raises plain Exception when a load fails
            if fresh:
                del self._torch_sites[key]
                self._delete_sites(cookies)
            raise TorchProbesRefused(str(error)) from error
        self._torch_links.setdefault(key, {})[pid] = link
        return attached

    def torch_keys_of(self, pid: int) -> list[Hashable]:
        """The libraries with a PyTorch link of `pid`'s own."""
        return [key for key, pid_links in self._torch_links.items() if pid in pid_links]

    def detach_torch(self, key: Hashable, pid: int) -> None:
        """Takes PyTorch's allocator probes in library `key` out for one process (its depth was lowered,
        or it exited); the library's sites stay registered for the others."""
        link = self._torch_links.get(key, {}).pop(pid, None)
        if link is not None:
            links.close_links([link])

    def detach(self, key: Hashable) -> float:
        """Takes every probe of one library down (all its processes); returns the seconds it took.

        A library nobody maps any more costs nothing in the kernel, but the agent's attachments
        are bounded (bcc's probe quota, fds, usdt_sites): unused ones must go."""
        started = time.monotonic()
        path = self._paths.pop(key, None)
        try:
            links.close_links([*self._links.pop(key, []), *self._torch_links.pop(key, {}).values()])
        finally:
            if path is not None and not self.uprobe_links:
                for pid, symbols in self._attached.get(key, {}).items():
                    for symbol in symbols:
                        self._detach_symbol(path, symbol, pid)
            self._attached.pop(key, None)
            sites = self._torch_sites.pop(key, None)
            if sites is not None:
                self._delete_sites(sites[1])
        return time.monotonic() - started

    def _add_torch_sites(self, path: str, probes: Sequence[UsdtProbe]) -> tuple[list[UsdtProbe], list[int]]:
        """The usable probes of `path` with the usdt_sites entries made for them (cookies)."""
        usable: list[UsdtProbe] = []
        cookies: list[int] = []
        table = self._bpf[b"usdt_sites"]
        try:
            for probe in probes:
                site = torch_site(probe)
                if isinstance(site, str):
                    log.warning("not tracing %s:%s at %#x in %s: %s", probe.provider, probe.name,
                                probe.pc_address, path, site)
                    continue
                self._next_cookie += 1
                table[ctypes.c_uint64(self._next_cookie)] = site  # raises when usdt_sites is full
                usable.append(probe)
                cookies.append(self._next_cookie)
        except Exception as error:  # bcc's plain Exception from a full map
            self._delete_sites(cookies)
            raise TorchProbesRefused(str(error)) from error
        if not usable:
            raise TorchProbesRefused(f"no usable pytorch:malloc/free probe in {path}")
        return usable, cookies

    def _delete_sites(self, cookies: list[int]) -> None:
        table = self._bpf[b"usdt_sites"]
        for cookie in cookies:
            try:
                del table[ctypes.c_uint64(cookie)]
            except KeyError:
                pass

    def torch_attached_pids(self, key: Hashable) -> set[int]:
        """The pids PyTorch's probes in library `key` are attached for; {-1}: every process."""
        return set(self._torch_links.get(key, {}))

    def _put_in_stack_walker(self) -> None:
        """Loads walk_stack, the program the allocation probes tail-call for a Python stack, and puts
        it where they find it. Loaded as they are (a tail call only goes to a program of the same
        type and expected attach type); without it they trace on, without stacks, and count it."""
        from bcc import BPF

        if not self._walker_in_program:
            return  # probes built from older sources (bench --baseline): they walk inline
        started = time.monotonic()
        try:
            fd = (self._program(STACK_WALKER) if self.uprobe_links
                  else self._bpf.load_func(STACK_WALKER.encode(), BPF.KPROBE).fd)
        except Exception as error:  # bcc raises plain Exception when the kernel refuses a program
            log.error("no Python stacks: the stack walker program did not load (%s); allocations are "
                      "traced without them (counted in stack_walker_missing)", error)
            return
        self._bpf[b"stack_walker"][ctypes.c_int(0)] = ctypes.c_int(fd)
        log.info("stack walker loaded in %.2f s", time.monotonic() - started)

    def _put_in_hook_entries(self) -> None:
        """Loads usdt_hook_entries, the program a batch of kvtrace's PyTorch hook goes through entry by entry
        (probes/hook.h), and puts it where usdt_pytorch finds it. Only with uprobe_multi links (the hook's site
        is linked as PyTorch's are); without it, batches are counted in hook_entries_lost."""
        if not self.uprobe_links or not self._hook_in_program:
            return  # no PyTorch links at all; or probes built from older sources (bench --baseline)
        try:
            fd = self._program(HOOK_ENTRIES_PROGRAM)
        except Exception as error:  # bcc raises plain Exception when the kernel refuses a program
            log.error("kvtrace's PyTorch hook cannot be read: its entries program did not load (%s); its "
                      "batches are counted in hook_entries_lost", error)
            return
        self._bpf[b"hook_entries_next"][ctypes.c_int(0)] = ctypes.c_int(fd)

    def _program(self, function: str) -> int:
        fd = self._programs.get(function)
        if fd is None:
            fd = self._programs[function] = links.load_uprobe_multi(self._bpf, function)
        return fd

    def _detach_symbol(self, path: str, symbol: str, pid: int) -> None:
        for detach in (self._bpf.detach_uprobe, self._bpf.detach_uretprobe):
            try:
                detach(name=path.encode(), sym=symbol.encode(), pid=pid)
            except Exception:
                pass

    def attached_pids(self, key: Hashable) -> set[int]:
        """The pids library `key` is attached for; {-1}: every process."""
        return set(self._attached.get(key, {}))

    def attached(self) -> dict[Hashable, list[str]]:
        """library key -> the symbols attached (in any process)."""
        return {key: sorted({symbol for symbols in by_pid.values() for symbol in symbols})
                for key, by_pid in self._attached.items()}

    def path_of(self, key: Hashable) -> str | None:
        """The path library `key` was attached through."""
        return self._paths.get(key)

    # ---- filter ----

    def set_filter(self, enabled: bool) -> None:
        config = self._bpf[b"config"]
        config[ctypes.c_int(abi.CONFIG_FILTER_ENABLED)] = ctypes.c_uint64(1 if enabled else 0)
        self._process_settings_changed()

    def set_block_rate(self, events_per_second: int) -> None:
        config = self._bpf[b"config"]
        config[ctypes.c_int(abi.CONFIG_BLOCK_EVENTS_PER_SECOND)] = ctypes.c_uint64(events_per_second)

    def set_block_sample_bytes(self, sample_bytes: int) -> None:
        """Stack sampling of PyTorch blocks (probes/usdt.h block_walked): a block's stack is walked once
        every `sample_bytes` bytes of a thread's blocks on average (exponential gaps), and always for one of
        at least that size; 0: every block's (exact). The ledger holds every block either way."""
        problem = block_sample_bytes_problem(sample_bytes)
        if problem:
            raise ValueError(f"block sample bytes {sample_bytes}: {problem}")
        if sample_bytes:  # the draws first: a probe that sees the new mean draws from its distribution
            draws = self._bpf[b"block_sample_draws"]
            for index, draw in enumerate(exponential_quantiles(sample_bytes)):
                draws[ctypes.c_int(index)] = ctypes.c_uint64(draw)
        self._bpf[b"config"][ctypes.c_int(abi.CONFIG_BLOCK_SAMPLE_BYTES)] = ctypes.c_uint64(sample_bytes)

    def set_quiet_blocks(self, quiet: bool) -> None:
        """Whether a PyTorch block's events are sent only where its stack was walked (KVT_CONFIG_QUIET_BLOCKS)."""
        self._bpf[b"config"][ctypes.c_int(abi.CONFIG_QUIET_BLOCKS)] = ctypes.c_uint64(1 if quiet else 0)

    def set_block_full(self, pid: int, full: bool) -> None:
        """Whether every block of the process has its stack walked whatever the sampling (its depth FULL)."""
        self._set_for_pid(b"block_full_pids", pid, ctypes.c_uint8(1) if full else None)

    def select_pid(self, pid: int) -> None:
        self._bpf[b"pid_filter"][ctypes.c_uint32(pid)] = ctypes.c_uint8(1)
        self._process_settings_changed()

    def unselect_pid(self, pid: int) -> None:
        try:
            del self._bpf[b"pid_filter"][ctypes.c_uint32(pid)]
        except KeyError:
            pass
        self._process_settings_changed()

    def _process_settings_changed(self) -> None:
        """After the filter or a process's default device changed: threads read their process's settings
        again (context.h), not what they remember."""
        self._process_generation += 1
        self._bpf[b"config"][ctypes.c_int(abi.CONFIG_PROCESS_GENERATION)] = ctypes.c_uint64(self._process_generation)

    # ---- rings ----

    def open_rings(self, on_events: Callable[[bytes, int, int], None],
                   on_notify: Callable[[abi.RawNotify], None]) -> None:
        """on_events gets the event records in batches: (records, stride, offset), a struct kvt_event
        (abi.EVENT_STRUCT) at `offset` in every `stride` bytes of `records` (decode.decode_events).

        The event ring is read through its own mapping (RingReader): a poll copies what is there
        and hands it over at once, no Python call per record. Where that mapping cannot be made, or
        the CPU orders memory more weakly than x86 (RingReader reads without barriers), bcc's
        callback takes the records one by one and hands them over in batches all the same."""
        self._on_events = on_events
        record_bytes = abi.EVENT_STRUCT.size
        ring = self._bpf[b"events"]
        if platform.machine() in RingReader.MACHINES:
            try:
                self._ring_reader = RingReader(ring.map_fd, int(ring.max_entries))
            except (OSError, ValueError) as error:
                log.warning("reading the event ring through bcc's callback, one record at a time: %s", error)
        events = None
        if self._ring_reader is None:
            def events(_ctx, data, _size):
                self._callback_records.append(ctypes.string_at(data, record_bytes))
                # Under a sustained flood one poll could run for seconds; stop after a budget so the
                # loop's housekeeping (attach, exits, resync) keeps its pace. libbpf has consumed this
                # record already; the rest waits for the next poll.
                return -1 if len(self._callback_records) >= POLL_BUDGET_EVENTS else 0

            ring.open_ring_buffer(events)

        def notify(_ctx, data, _size):
            on_notify(ctypes.cast(data, ctypes.POINTER(abi.RawNotify)).contents)

        # bcc keeps the callbacks alive; keep our own references too.
        self._callbacks = (events, notify)
        self._bpf[b"notify"].open_ring_buffer(notify)

    def poll(self, timeout_ms: int) -> None:
        """Reads what is in the rings now (after waiting up to timeout_ms for a wakeup), at most
        POLL_BUDGET_EVENTS events. The probes wake the reader only once a batch is waiting
        (KVT_WAKEUP_EVENTS), so what is below that is taken here whether or not a wakeup came."""
        if timeout_ms > 0:
            self.wait(timeout_ms)
        reader = self._ring_reader
        if reader is not None:
            records = reader.read(POLL_BUDGET_EVENTS)
            if records:
                self._on_events(records, RingReader.STRIDE, RingReader.HEADER_BYTES)
            self._bpf.ring_buffer_consume()  # the notify ring
            return
        self._bpf.ring_buffer_consume()
        taken, self._callback_records = self._callback_records, []
        if taken:
            self._on_events(b"".join(taken), abi.EVENT_STRUCT.size, 0)

    def wait(self, timeout_ms: int) -> None:
        """Waits until a ring has data or timeout_ms passes, without consuming anything."""
        if self._epoll is None:
            self._epoll = select.epoll()
            for name in (b"events", b"notify"):
                self._epoll.register(self._bpf[name].map_fd, select.EPOLLIN)
        self._epoll.poll(timeout_ms / 1000)

    # ---- maps ----

    def counters(self) -> dict[str, int]:
        """The probes' counters, each summed over the CPUs: one batched read of the per-CPU array (the agent
        reads them at every turn that took events; one lookup per counter took ~10 % of its main thread in
        a flood)."""
        table = self._bpf[b"counters"]
        if self._counters_batched:
            try:
                return _per_cpu_sums(table, len(abi.COUNTERS))
            except _NoBatchedLookup:  # kernels without batched lookups of arrays (before 5.7)
                self._counters_batched = False
        return {name: sum(table[ctypes.c_int(index)]) for index, name in enumerate(abi.COUNTERS)}

    def ledger_items(self) -> list[tuple[abi.RawLedgerKey, abi.RawLedgerValue]]:
        """A copy of the in-kernel ledger (batched reads where the kernel supports them)."""
        return list(self.iter_ledger_items())

    def iter_ledger_items(self) -> Iterator[tuple[abi.RawLedgerKey, abi.RawLedgerValue]]:
        """The in-kernel ledger one entry at a time, read LEDGER_READ_CHUNK entries per system call into
        buffers of that size: the agent's memory does not grow with the ledger (bcc's own batched read
        sizes its buffers to the whole map: 300 MB at 4 M entries)."""
        for keys, values in self.iter_ledger_chunks():
            for index in range(len(keys) // ctypes.sizeof(abi.RawLedgerKey)):
                yield (abi.RawLedgerKey.from_buffer_copy(keys, index * ctypes.sizeof(abi.RawLedgerKey)),
                       abi.RawLedgerValue.from_buffer_copy(values, index * ctypes.sizeof(abi.RawLedgerValue)))

    def _map_chunks(self, name: bytes, key_size: int, value_size: int, chunk: int,
                    what: str) -> Iterator[tuple[bytes, bytes]]:
        """A hash map's entries as (keys, values) raw arrays of up to `chunk` entries, in batched lookups
        (one system call per chunk; either way the kernel scans every bucket); on kernels without them
        (before 5.6: remembered) one entry per chunk, through bcc's iteration."""
        table = self._bpf[name]
        if self._hashes_batched:
            try:
                yield from _lookup_in_chunks(table.map_fd, key_size, value_size, chunk, what)
                return
            except _NoBatchedLookup:
                self._hashes_batched = False
        for key, value in table.items():
            yield bytes(key), bytes(value)

    def iter_ledger_chunks(self) -> Iterator[tuple[bytes, bytes]]:
        """The in-kernel ledger as (keys, values) raw arrays of up to LEDGER_READ_CHUNK entries, for a
        reader that decodes them in bulk (decode.decode_ledger_chunk)."""
        return self._map_chunks(b"ledger", ctypes.sizeof(abi.RawLedgerKey), ctypes.sizeof(abi.RawLedgerValue),
                                LEDGER_READ_CHUNK, "the ledger")

    def find_ledger_entry(self, key: abi.RawLedgerKey) -> tuple[abi.RawLedgerKey, abi.RawLedgerValue] | None:
        """One entry of the in-kernel ledger by key (one system call), None if it is not there."""
        table = self._bpf[b"ledger"]
        try:
            value = table[table.Key.from_buffer_copy(key)]
        except KeyError:
            return None
        return key, abi.RawLedgerValue.from_buffer_copy(value)

    def delete_ledger_keys(self, keys: list[abi.RawLedgerKey]) -> list[bool]:
        """Deletes entries; for each key, whether this delete took it (a probe may have freed it meanwhile,
        and then the probe took it out of the totals)."""
        table = self._bpf[b"ledger"]
        deleted = []
        for key in keys:
            try:
                del table[table.Key.from_buffer_copy(key)]
            except KeyError:
                deleted.append(False)
            else:
                deleted.append(True)
        return deleted

    def read_totals(self) -> list[tuple[abi.RawTotalsKey, abi.RawTotalsValue]]:
        """The kernel's totals of allocations and blocks (struct kvt_totals_key/value pairs): a few per
        process, in one batched lookup where the kernel has it (each value is exact when read; the probes
        go on changing others). Every analysis reads them."""
        key_size, value_size = ctypes.sizeof(abi.RawTotalsKey), ctypes.sizeof(abi.RawTotalsValue)
        return [(abi.RawTotalsKey.from_buffer_copy(keys, index * key_size),
                 abi.RawTotalsValue.from_buffer_copy(values, index * value_size))
                for keys, values in self._map_chunks(b"ledger_totals", key_size, value_size, TOTALS_READ_CHUNK,
                                                     "the totals")
                for index in range(len(keys) // key_size)]

    def totals_of(self, keys: Iterable[abi.RawTotalsKey]) -> list[tuple[abi.RawTotalsKey, abi.RawTotalsValue]]:
        """The kernel's totals of these keys, one lookup each (a key not in the map is left out): a process's few,
        without reading everyone's."""
        table = self._bpf[b"ledger_totals"]
        found = []
        for key in keys:
            try:
                value = table[table.Key.from_buffer_copy(key)]
            except KeyError:
                continue
            found.append((key, abi.RawTotalsValue.from_buffer_copy(value)))
        return found

    def take_totals(self, keys: Iterable[abi.RawTotalsKey]) -> list[tuple[abi.RawTotalsKey, abi.RawTotalsValue]]:
        """Deletes these totals keys (after their process exited), each read in the same system call that deletes
        it (BPF_MAP_LOOKUP_AND_DELETE_ELEM, Linux 5.14+; before, read then deleted): what a process that reused
        the pid added meanwhile is in the value, not lost. A key not in the map is left out. One or two system
        calls a key: an exit costs what its process held, not the size of the map."""
        from bcc.libbcc import lib

        table = self._bpf[b"ledger_totals"]
        taken = []
        for raw in keys:
            key = table.Key.from_buffer_copy(raw)
            value = abi.RawTotalsValue()
            if lib.bpf_lookup_and_delete(table.map_fd, ctypes.byref(key), ctypes.byref(value)) != 0:
                try:
                    value = abi.RawTotalsValue.from_buffer_copy(table[key])
                    del table[key]
                except KeyError:
                    continue
            taken.append((abi.RawTotalsKey.from_buffer_copy(key), value))
        return taken

    def _make_share_records(self) -> None:
        """Root's and every user's records in uid_shares, made before any probe runs: however many users' records
        fill the table (they are never freed), neither is refused (shares.h user_record)."""
        table = self._bpf[b"uid_shares"]
        for uid in (0, UID_USERS):
            table[ctypes.c_uint32(uid)] = RawShare(uid=uid)

    def give_shares(self, entries: Mapping[int, int]) -> None:
        """Gives back to each pid's share the ledger entries the agent deleted of it (shares.h kvt_share_return,
        run once a pid): a live process's, whose deletes no probe saw. Where the kernel refuses the program, the
        process stays charged for them until it exits (logged once)."""
        from bcc import BPF

        try:
            if self._share_return_fd is None:
                self._share_return_fd = self._bpf.load_func(SHARE_RETURN.encode(), BPF.RAW_TRACEPOINT).fd
            for pid, count in entries.items():
                if count > 0:
                    links.run_raw_tracepoint(self._share_return_fd, pid, count)
        except Exception as error:  # bcc's plain Exception, or OSError from bpf(2)
            self.shares_not_given_total += sum(entries.values())
            if not self._share_return_failed:
                self._share_return_failed = True
                log.warning("ledger entries the agent deleted stay charged to their process's share until it "
                            "exits: %s did not run (%s)", SHARE_RETURN, error)

    def read_shares(self, by_pid: bool) -> list[tuple[int, RawShare]]:
        """What each process (`by_pid`: pid_shares) or user (uid_shares) holds of the maps and was refused."""
        table = self._bpf[b"pid_shares" if by_pid else b"uid_shares"]
        return [(key.value, RawShare.from_buffer_copy(value)) for key, value in table.items()]

    def set_process_device(self, pid: int, device: int | None) -> None:
        """The device of the process's threads that never selected one (None: CUDA's device 0)."""
        self._set_for_pid(b"process_device", pid, None if device is None else ctypes.c_int32(device))
        self._process_settings_changed()

    def set_python_target(self, pid: int, target: abi.RawPyTarget | None) -> None:
        self._set_for_pid(b"py_targets", pid, target)

    def _set_for_pid(self, map_name: bytes, pid: int, value: ctypes._CData | None) -> None:
        """Sets a per-process map's entry, or deletes it (None)."""
        table = self._bpf[map_name]
        if value is None:
            try:
                del table[ctypes.c_uint32(pid)]
            except KeyError:
                pass
        else:
            table[ctypes.c_uint32(pid)] = value

    def read_stack(self, stack_id: int) -> abi.RawStack | None:
        try:
            value = self._bpf[b"stacks"][ctypes.c_uint64(stack_id)]
        except KeyError:
            return None
        return abi.RawStack.from_buffer_copy(value)

    def tracked_pids(self) -> set[int]:
        """Processes the probes have put into the ledger and not yet seen exit (one batched lookup, where
        bcc's iteration made two system calls and Python objects per key; either scans the whole map)."""
        return {pid for keys, _ in self._map_chunks(b"tracked_pids", 4, 8, TRACKED_READ_CHUNK, "the tracked processes")
                for pid in memoryview(keys).cast("I")}

    def forget_tracked(self, pid: int) -> bool:
        """Untracks a process; False where it was not tracked. Only for a pid whose process is gone, and the
        mark goes back (mark_tracked) if a process holds the pid after: its threads may remember the mark and
        not set it again (BpfSource.sweep_exited)."""
        try:
            del self._bpf[b"tracked_pids"][ctypes.c_uint32(pid)]
        except KeyError:
            return False
        return True

    def mark_tracked(self, pid: int) -> None:
        """Tracks a process again, as its probes' first ledger insert does (ledger.h mark_tracked)."""
        self._bpf[b"tracked_pids"][ctypes.c_uint32(pid)] = ctypes.c_uint64(1)

    def close(self) -> float:
        """Takes every probe down and frees the program; returns the seconds detaching took.

        Links close in parallel (their grace periods overlap): well under a second for hundreds of
        probes, where perf-event uprobes take ~0.1 s each."""
        started = time.monotonic()
        all_links = [link for path_links in self._links.values() for link in path_links]
        all_links += [link for pid_links in self._torch_links.values() for link in pid_links.values()]
        self._links.clear()
        self._torch_links.clear()
        try:
            links.close_links(all_links)
        finally:
            if self._epoll is not None:
                self._epoll.close()
                self._epoll = None
            if self._ring_reader is not None:
                self._ring_reader.close()
                self._ring_reader = None
            self._bpf.cleanup()
        return time.monotonic() - started


def block_sample_bytes_problem(sample_bytes: int) -> str:
    """Why the probes cannot sample block stacks at this mean ("" when they can): the ledger keeps it in KiB,
    in 16 bits."""
    if sample_bytes == 0 or (BLOCK_SAMPLE_BYTES_MIN <= sample_bytes <= BLOCK_SAMPLE_BYTES_MAX
                             and sample_bytes % 1024 == 0):
        return ""
    return "it takes 0 (every block's stack) or a whole number of KiB from 4KiB to 65535KiB"


class LibraryUnreadable(Exception):
    """A library discovery found cannot be read now (replaced, truncated, malformed)."""


class ProbeQuotaFull(Exception):
    """bcc's quota of open perf-event probes cannot take a library; the message says how to raise it."""


class TorchProbesRefused(Exception):
    """PyTorch's allocator probes cannot be traced in a library; the message says why."""


# By (provider, name): the API its blocks are, whether its hits are batches (kvtrace's hook), its arguments.
_TORCH_APIS = {("pytorch", "malloc"): Api.pytorch_malloc, ("pytorch", "free"): Api.pytorch_free,
               HOOK_PROBE: Api.pytorch_malloc}
_ARGUMENT_KINDS = {ArgumentKind.CONSTANT: abi.USDT_ARG_CONSTANT, ArgumentKind.REGISTER: abi.USDT_ARG_REGISTER,
                   ArgumentKind.MEMORY: abi.USDT_ARG_MEMORY}
# What each probe must give: malloc (pointer, device, size[, stream]), free (pointer), the hook's blocks (entries,
# count, sample_bytes).
_TORCH_ARGUMENTS = {("pytorch", "malloc"): 3, ("pytorch", "free"): 1, HOOK_PROBE: 3}


def torch_site(probe: UsdtProbe) -> abi.RawUsdtSite | str:
    """The probe's entry in usdt_sites, or why the probes cannot read it (never a guess)."""
    if not probe.usable:
        return probe.problem or "unusable"
    kind = (probe.provider, probe.name)
    if kind not in _TORCH_APIS:
        return f"not an allocator probe: {probe.provider}:{probe.name}"
    if len(probe.arguments) < _TORCH_ARGUMENTS[kind]:
        return (f"{len(probe.arguments)} arguments ({probe.arguments_text!r}); {probe.name} needs "
                f"{_TORCH_ARGUMENTS[kind]}")
    site = abi.RawUsdtSite(api=_TORCH_APIS[kind], batch=int(kind == HOOK_PROBE),
                           arg_count=min(len(probe.arguments), abi.USDT_MAX_ARGS))
    for index, argument in enumerate(probe.arguments[:abi.USDT_MAX_ARGS]):
        if argument.index is not None:
            return f"argument {argument.text!r}: an index register is not read by the probes"
        raw = site.args[index]
        raw.kind = _ARGUMENT_KINDS[argument.kind]
        raw.size_bytes = argument.size_bytes
        raw.is_signed = 1 if argument.signed else 0
        if argument.kind is ArgumentKind.CONSTANT:
            raw.displacement = argument.constant
        else:
            assert argument.base is not None  # a register or memory operand has a base register
            raw.reg_offset = argument.base.pt_regs_offset
            raw.displacement = argument.displacement_bytes
    return site
