"""Loads probes/kvtrace.bpf.c with bcc, attaches it to CUDA libraries and reads its maps and rings.

This is the only module that touches bcc. It hands raw records (ctypes structs) to callbacks;
decode.py turns them into model events.
"""
from __future__ import annotations

import ctypes
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

from kvtrace.sources.bpf import abi
from kvtrace.sources.bpf.symbols import entry_function, return_function

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ProbeSettings:
    """Compile-time sizes of the BPF maps (see the defines at the top of kvtrace.bpf.c)."""

    max_ledger_entries: int = 1 << 20
    ringbuf_pages: int = 4096  # 16 MiB: ~190 000 events of burst before any is lost
    max_threads: int = 65536
    max_stacks: int = 16384
    task_fsbase_offset: int = -1  # from BTF; -1 disables Python stacks
    wakeup_events: int = 512  # events a CPU submits before it wakes the reader; else its timer takes them

    def cflags(self) -> list[str]:
        return [
            f"-DKVT_MAX_STACKS={self.max_stacks}",
            f"-DKVT_TASK_FSBASE_OFFSET={self.task_fsbase_offset}",
            f"-I{abi.probes_dir()}",
            f"-DKVT_MAX_LEDGER_ENTRIES={self.max_ledger_entries}",
            f"-DKVT_RINGBUF_PAGES={self.ringbuf_pages}",
            f"-DKVT_MAX_THREADS={self.max_threads}",
            f"-DKVT_WAKEUP_EVENTS={self.wakeup_events}",
            "-Wno-macro-redefined",
        ]


# Events handled by one poll before it returns (about 0.2 s of work at the measured pace).
POLL_BUDGET_EVENTS = 16384


def _return_freed_heap() -> None:
    """Compiling frees most of what clang and LLVM took, but glibc keeps freed heap for reuse; hand
    it back to the system (about 20 MiB of the agent's resident memory)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


class BpfProbes:
    """The compiled probe program: attach/detach per library, ring buffers, maps."""

    def __init__(self, settings: ProbeSettings = ProbeSettings()) -> None:
        from bcc import BPF  # imported here so that everything else works without bcc

        self.settings = settings
        source = abi.probes_dir() / "kvtrace.bpf.c"
        started = time.monotonic()
        self._bpf = BPF(src_file=str(source).encode(), cflags=settings.cflags())
        self.compile_seconds = time.monotonic() - started
        _return_freed_heap()
        self._attached: dict[str, dict[int, list[str]]] = {}  # path -> pid (-1: all) -> symbols
        self._epoll = None
        self._polled = 0

    # ---- attach ----

    def attach(self, path: str, symbols: Iterable[str], pid: int = -1) -> list[str]:
        """Entry and return probes on each symbol of the file, for every process (pid -1) or for
        one process only (the kernel then plants no breakpoints in any other process).

        Returns the symbols attached; a symbol that fails is logged and skipped.
        """
        done = []
        for symbol in symbols:
            try:
                self._bpf.attach_uprobe(name=path.encode(), sym=symbol.encode(),
                                        fn_name=entry_function(symbol).encode(), pid=pid)
                self._bpf.attach_uretprobe(name=path.encode(), sym=symbol.encode(),
                                           fn_name=return_function(symbol).encode(), pid=pid)
            except Exception as error:  # bcc raises plain Exception
                log.warning("cannot attach to %s in %s%s: %s", symbol, path,
                            f" for pid {pid}" if pid != -1 else "", error)
                self._detach_symbol(path, symbol, pid)
                continue
            done.append(symbol)
        self._attached.setdefault(path, {})[pid] = done
        return done

    def _detach_symbol(self, path: str, symbol: str, pid: int) -> None:
        for detach in (self._bpf.detach_uprobe, self._bpf.detach_uretprobe):
            try:
                detach(name=path.encode(), sym=symbol.encode(), pid=pid)
            except Exception:
                pass

    def detach(self, path: str) -> None:
        for pid, symbols in self._attached.pop(path, {}).items():
            for symbol in symbols:
                self._detach_symbol(path, symbol, pid)

    def attached_pids(self, path: str) -> set[int]:
        """The pids `path` is attached for; {-1}: every process."""
        return set(self._attached.get(path, {}))

    def attached(self) -> dict[str, list[str]]:
        """path -> the symbols attached (in any process)."""
        return {path: sorted({symbol for symbols in by_pid.values() for symbol in symbols})
                for path, by_pid in self._attached.items()}

    # ---- filter ----

    def set_filter(self, enabled: bool) -> None:
        config = self._bpf[b"config"]
        config[ctypes.c_int(abi.CONFIG_FILTER_ENABLED)] = ctypes.c_uint64(1 if enabled else 0)

    def select_pid(self, pid: int) -> None:
        self._bpf[b"pid_filter"][ctypes.c_uint32(pid)] = ctypes.c_uint8(1)

    def unselect_pid(self, pid: int) -> None:
        try:
            del self._bpf[b"pid_filter"][ctypes.c_uint32(pid)]
        except KeyError:
            pass

    # ---- rings ----

    def open_rings(self, on_event: Callable[[bytes], None],
                   on_notify: Callable[[abi.RawNotify], None]) -> None:
        """on_event gets each event record as bytes (struct kvt_event, see abi.EVENT_STRUCT)."""
        record_bytes = abi.EVENT_STRUCT.size

        def events(_ctx, data, _size):
            on_event(ctypes.string_at(data, record_bytes))
            # Under a sustained flood one poll could run for seconds; stop after a budget so the
            # loop's housekeeping (attach, exits, resync) keeps its pace. libbpf has consumed this
            # record already; the rest waits for the next poll.
            self._polled += 1
            return -1 if self._polled >= POLL_BUDGET_EVENTS else 0

        def notify(_ctx, data, _size):
            on_notify(ctypes.cast(data, ctypes.POINTER(abi.RawNotify)).contents)

        # bcc keeps the callbacks alive; keep our own references too.
        self._callbacks = (events, notify)
        self._bpf[b"events"].open_ring_buffer(events)
        self._bpf[b"notify"].open_ring_buffer(notify)

    def poll(self, timeout_ms: int) -> None:
        """Reads what is in the rings now (after waiting up to timeout_ms for a wakeup), at most
        POLL_BUDGET_EVENTS events. The probes wake the reader only once a batch is waiting
        (KVT_WAKEUP_EVENTS), so what is below that is taken here whether or not a wakeup came."""
        self._polled = 0
        if timeout_ms > 0:
            self.wait(timeout_ms)
        self._bpf.ring_buffer_consume()

    def wait(self, timeout_ms: int) -> None:
        """Waits until a ring has data or timeout_ms passes, without consuming anything."""
        import select

        if self._epoll is None:
            self._epoll = select.epoll()
            for name in (b"events", b"notify"):
                self._epoll.register(self._bpf[name].map_fd, select.EPOLLIN)
        self._epoll.poll(timeout_ms / 1000)

    # ---- maps ----

    def counters(self) -> dict[str, int]:
        table = self._bpf[b"counters"]
        return {name: sum(table[ctypes.c_int(index)]) for index, name in enumerate(abi.COUNTERS)}

    def ledger_items(self) -> list[tuple[abi.RawLedgerKey, abi.RawLedgerValue]]:
        """A copy of the in-kernel ledger (batched reads where the kernel supports them)."""
        return list(self.iter_ledger_items())

    def iter_ledger_items(self) -> Iterator[tuple[abi.RawLedgerKey, abi.RawLedgerValue]]:
        """The in-kernel ledger one entry at a time: with millions of entries a list of them all
        would double the agent's memory for a moment."""
        table = self._bpf[b"ledger"]
        try:
            batch = table.items_lookup_batch()
            pairs = itertools.chain([next(batch)], batch)  # the first next() makes the batch calls
        except StopIteration:
            return
        except Exception:  # kernels without batched lookups
            pairs = table.items()
        for key, value in pairs:
            yield abi.RawLedgerKey.from_buffer_copy(key), abi.RawLedgerValue.from_buffer_copy(value)

    def delete_ledger_keys(self, keys: list[abi.RawLedgerKey]) -> None:
        table = self._bpf[b"ledger"]
        for key in keys:
            try:
                del table[table.Key.from_buffer_copy(key)]
            except KeyError:
                pass

    def set_python_target(self, pid: int, target: abi.RawPyTarget | None) -> None:
        table = self._bpf[b"py_targets"]
        if target is None:
            try:
                del table[ctypes.c_uint32(pid)]
            except KeyError:
                pass
        else:
            table[ctypes.c_uint32(pid)] = target

    def read_stack(self, stack_id: int) -> abi.RawStack | None:
        try:
            value = self._bpf[b"stacks"][ctypes.c_uint64(stack_id)]
        except KeyError:
            return None
        return abi.RawStack.from_buffer_copy(value)

    def tracked_pids(self) -> set[int]:
        """Processes the probes have put into the ledger and not yet seen exit."""
        return {key.value for key in self._bpf[b"tracked_pids"].keys()}

    def forget_tracked(self, pid: int) -> None:
        try:
            del self._bpf[b"tracked_pids"][ctypes.c_uint32(pid)]
        except KeyError:
            pass

    def close(self) -> None:
        self._bpf.cleanup()
