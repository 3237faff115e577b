"""kvtrace's plugin inside vLLM (0.24): tells the local agent what only vLLM knows — where the KV tensors
are, how many logical blocks are free, which requests hold blocks and in what state, block allocations
and frees, and what sleep mode released — as JSON datagrams (protocol.py) on the agent's Unix socket.

vLLM calls `register()` through the `vllm.general_plugins` entry point in every one of its processes,
possibly more than once. It does nothing at all unless KVTRACE_VLLM_PLUGIN=1 (opt-in). Then it patches
vLLM's classes when (and only when) their modules are imported: a meta-path finder wraps the module's
loader so that the patch runs right after the module executed; modules already imported are patched at
once. Which process does what follows from what it runs:

- the process that builds a `Scheduler` (EngineCore) sends a "scheduler" message every
  REPORT_INTERVAL_SECONDS from a daemon reporter thread, read without locks from the scheduler's own
  structures (vLLM's engine loop never waits for kvtrace);
- the process that allocates the KV cache (EngineCore with one GPU, each worker with several) sends a
  "kv_cache" message after the allocation;
- the process that owns the CuMemAllocator (the same) sends a "sleep" message after sleep()/wake_up().

While no agent is there (no socket at KVTRACE_VLLM_SOCKET) the reporter builds nothing: it looks for the
socket once a second (the one-off layout and sleep messages are built, and dropped). An agent that starts
later, or restarts (a new socket file), gets the KV layout and sleep state again at once, and every
RESEND_SECONDS in any case, so an engine started before the agent is still known.

Never harmful: every patch calls vLLM's original first and returns its result or raises its exception
unchanged; kvtrace's own part runs after, inside `try`, and a part that fails once logs one warning
(logger "kvtrace.vllm") and switches itself off. Sends never block (a non-blocking datagram socket):
with no agent or a full queue the message is dropped and counted. No network, no threads other than
the reporter, standard library only at import (this module is imported in every vLLM process).

KVTRACE_TORCH_HOOK=1 also loads kvtrace's PyTorch hook (kvtrace/sources/torch_hook) into each process that imported
torch, built for that torch on first use (g++; KVTRACE_TORCH_HOOK_CACHE, default /var/cache/kvtrace/torch-hook),
on a thread of its own, and arms it: the agent's depth blocks then take the process's blocks in batches instead of a
trap per tensor. A hook that cannot be built switches that part off with one warning.

Why this module is long (about 750 lines): it is imported into every vLLM process and may import only the
standard library (a test holds it); its helpers cannot live in the package's other rooms.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import socket
import sys
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

from kvtrace.sources.post_import import wrapped_spec
from kvtrace.sources.vllm import protocol

LOG = logging.getLogger("kvtrace.vllm")

# Request ids whose finish the plugin remembers (when, aborted or not): enough for the holders of any
# real engine; the oldest are dropped first.
FINISH_NOTES_MAX = 10_000
# The last "kv_cache" and "sleep" messages go again this often (an agent that restarted learns them).
RESEND_SECONDS = 30.0
_MARK = "_kvtrace_original"  # set on every wrapper: the function it wraps (idempotent patching)
_FINDER_MARK = "_kvtrace_vllm_finder"

# The parts that switch themselves off independently after an error.
PART_SCHEDULER = "scheduler report"
PART_FINISH = "request finish notes"
PART_BLOCKS = "block counters"
PART_KV_CACHE = "KV-cache layout"
PART_SLEEP = "sleep report"
PART_PATCH = "patching"
PART_TORCH_HOOK = "PyTorch hook"

# KVTRACE_TORCH_HOOK=1 (with KVTRACE_VLLM_PLUGIN=1): each vLLM process loads kvtrace's PyTorch hook
# (kvtrace/sources/torch_hook), built for its torch on first use, and arms it: depth blocks then reach the agent in
# batches, not a trap per tensor. Opt-in: it needs g++ and CUDA headers on the host, and a cache directory.
TORCH_HOOK_ENV = "KVTRACE_TORCH_HOOK"


class _State:
    """Everything the plugin keeps, per process. Written by vLLM's threads through the wrappers (plain
    attribute and dict stores, atomic under the GIL) and read by the reporter thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # register(), socket creation, the reporter's start
        self.report_lock = threading.Lock()  # one report built at a time (reporter vs. after a sleep)
        self.active = False
        self.socket_path = ""
        self.sock: socket.socket | None = None
        self.sock_pid = 0
        self.messages_sent = 0
        self.messages_dropped = 0
        self.off: set[str] = set()
        self.warned: set[str] = set()
        # The scheduler of this process and its GPU block pool (weak: never keep vLLM's objects alive).
        self.scheduler_ref: weakref.ref[Any] | None = None
        self.pool_id = 0  # id() of the tracked BlockPool (0: none): the counters count only its blocks
        self.allocated_total = 0
        self.freed_total = 0
        # request id -> (monotonic, aborted), oldest first: dropping the oldest is O(1) (a plain dict's
        # next(iter()) scans the slots of deleted keys: 5.6 µs per finished request, on vLLM's thread)
        self.finish_notes: OrderedDict[str, tuple[float, bool]] = OrderedDict()
        self.orphans_first_seen: dict[str, float] = {}  # holders gone from scheduler.requests, unnoted
        # The last "kv_cache" / "sleep" datagrams of this process, sent again to a new agent.
        self.kv_message: bytes | None = None
        self.sleep_message: bytes | None = None
        self.reporter: threading.Thread | None = None
        self.reporter_pid = 0
        self.stop = threading.Event()
        # Sleep mode: the level last entered and the CuMemAllocator tags still released.
        self.sleep_level = 0
        self.asleep_tags: set[str] = set()
        self.worker_level = threading.local()  # Worker.sleep(level) while its allocator.sleep runs
        self.torch_hook: Any = None  # kvtrace.sources.torch_hook.Hook, armed in this process
        self.torch_hook_started = False


_STATE = _State()


# ---- entry point ----


def register() -> None:
    """vLLM's `vllm.general_plugins` hook. Opt-in: returns having done nothing unless
    KVTRACE_VLLM_PLUGIN=1. Idempotent."""
    try:
        if os.environ.get(protocol.ENABLE_ENV) != "1":
            return
        path = os.environ.get(protocol.SOCKET_ENV) or protocol.DEFAULT_SOCKET
        with _STATE.lock:
            if not _STATE.active:
                os.register_at_fork(after_in_child=_after_fork_in_child)
            _STATE.socket_path = path
            _STATE.active = True
            if not any(getattr(finder, _FINDER_MARK, False) for finder in sys.meta_path):
                sys.meta_path.insert(0, _PatchingFinder())
        for name in _PATCHES:
            module = sys.modules.get(name)
            if module is not None:
                _apply_patch(name, module)
    except Exception as error:  # never into vLLM's start-up
        _switch_off(PART_PATCH, error)
    if os.environ.get(TORCH_HOOK_ENV) == "1":
        _start_torch_hook()


def _start_torch_hook() -> None:
    """Builds (or finds built), loads and arms kvtrace's PyTorch hook, on a thread of its own: a first build
    takes seconds, which vLLM's start must not wait for. Once per process."""
    with _STATE.lock:
        if _STATE.torch_hook_started or PART_TORCH_HOOK in _STATE.off:
            return
        _STATE.torch_hook_started = True
    if "torch" not in sys.modules:
        _warn_once("torch hook without torch", "kvtrace vLLM plugin: torch is not imported in this process: "
                   "no PyTorch hook here (its blocks are traced by PyTorch's own probes)")
        return
    threading.Thread(target=_arm_torch_hook, name="kvtrace-torch-hook", daemon=True).start()


def _arm_torch_hook() -> None:
    try:
        from kvtrace.sources.torch_hook import arm_in_this_process

        _STATE.torch_hook = arm_in_this_process()
        LOG.info("kvtrace vLLM plugin: PyTorch hook armed (%s)", _STATE.torch_hook.path)
    except Exception as error:  # HookBuildError names the fix; anything else: the part is off, vLLM goes on
        _switch_off(PART_TORCH_HOOK, error)


# ---- import hook ----


class _PatchingFinder:
    """Finds nothing itself: for a module kvtrace patches it asks the other finders for the spec and
    wraps its loader, so that the patch runs right after the module's code."""

    _kvtrace_vllm_finder = True

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in _PATCHES or not _STATE.active:
            return None
        try:
            return wrapped_spec(fullname, path, target, _FINDER_MARK, functools.partial(_apply_patch, fullname))
        except Exception as error:
            _switch_off(PART_PATCH, error)
            return None

    def invalidate_caches(self) -> None:
        pass


def _apply_patch(name: str, module: Any) -> None:
    try:
        _PATCHES[name](module)
    except Exception as error:
        _switch_off(PART_PATCH, error)


# ---- failure containment and wrapping ----


def _switch_off(part: str, error: BaseException) -> None:
    """The one place kvtrace's errors end: that part stops, one warning, vLLM goes on."""
    _STATE.off.add(part)
    if part not in _STATE.warned:
        _STATE.warned.add(part)
        LOG.warning("kvtrace vLLM plugin: %s switched off after an error (vLLM is unaffected): %r", part, error)
        LOG.debug("kvtrace vLLM plugin: %s failed", part, exc_info=error)


def _warn_once(key: str, message: str, *args: Any) -> None:
    if key not in _STATE.warned:
        _STATE.warned.add(key)
        LOG.warning(message, *args)


def _wrap(owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replaces owner.name (a class's own method or a module's function) with make(original), once:
    a second call finds the wrapper and leaves it. A name vLLM no longer has is reported, not fatal."""
    original = owner.__dict__.get(name)
    if original is None:
        _warn_once(f"missing {owner.__name__}.{name}",
                   "kvtrace vLLM plugin: %s.%s not found in this vLLM (kvtrace knows 0.24): its part is off",
                   owner.__name__, name)
        return
    if getattr(original, _MARK, None) is not None:
        return
    wrapper = functools.wraps(original)(make(original))
    setattr(wrapper, _MARK, original)
    setattr(owner, name, wrapper)


# ---- scheduler side ----


def _patch_scheduler(module: Any) -> None:
    scheduler_class = module.Scheduler

    def make_init(original: Callable[..., Any]) -> Callable[..., Any]:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            if _STATE.active and PART_SCHEDULER not in _STATE.off:
                try:
                    _track_scheduler(self)
                except Exception as error:
                    _switch_off(PART_SCHEDULER, error)
        return __init__

    def make_finish_requests(original: Callable[..., Any]) -> Callable[..., Any]:
        def finish_requests(self: Any, request_ids: Any, finished_status: Any) -> Any:
            result = original(self, request_ids, finished_status)
            if PART_FINISH not in _STATE.off:
                try:
                    aborted = getattr(finished_status, "name", "") == "FINISHED_ABORTED"
                    for request_id, _client in result or ():
                        _note_finish(request_id, aborted)
                except Exception as error:
                    _switch_off(PART_FINISH, error)
            return result
        return finish_requests

    def make_free_request(original: Callable[..., Any]) -> Callable[..., Any]:
        def _free_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, request, *args, **kwargs)
            if PART_FINISH not in _STATE.off:
                try:
                    _note_finish(request.request_id, getattr(request.status, "name", "") == "FINISHED_ABORTED")
                except Exception as error:
                    _switch_off(PART_FINISH, error)
            return result
        return _free_request

    _wrap(scheduler_class, "__init__", make_init)
    _wrap(scheduler_class, "finish_requests", make_finish_requests)
    _wrap(scheduler_class, "_free_request", make_free_request)


def _note_finish(request_id: str, aborted: bool) -> None:
    notes = _STATE.finish_notes
    if request_id in notes:
        return  # the first finish counts (finish_requests and _free_request both see it)
    notes[request_id] = (time.monotonic(), aborted)
    while len(notes) > FINISH_NOTES_MAX:
        notes.popitem(last=False)


def _track_scheduler(scheduler: Any) -> None:
    """The scheduler vLLM just built: remember it (weakly), count its GPU pool's blocks from zero and
    make sure this process has a reporter thread."""
    pool = scheduler.kv_cache_manager.block_pool
    with _STATE.lock:
        _STATE.scheduler_ref = weakref.ref(scheduler, _scheduler_gone)
        _STATE.pool_id = id(pool)
        _STATE.allocated_total = 0
        _STATE.freed_total = 0
        _STATE.finish_notes.clear()
        _STATE.orphans_first_seen.clear()
        started = _ensure_reporter()
    if not started:  # a new reporter sends at once; the one already waiting would not for a second
        send_scheduler_report(scheduler)


def _after_fork_in_child() -> None:
    """A fork copies the locks as they were: one held by another thread at the fork would never be let
    go in the child (vLLM forks its engine and workers). The child starts with fresh ones; its reporter
    and socket are its own anyway (both are per pid)."""
    _STATE.lock = threading.Lock()
    _STATE.report_lock = threading.Lock()
    if _STATE.torch_hook is not None:  # its watcher thread stayed in the parent: the child's own, if not attached
        try:
            _STATE.torch_hook.arm_again_after_fork()
        except Exception as error:
            _switch_off(PART_TORCH_HOOK, error)


def _ensure_reporter() -> bool:
    """This process's reporter thread, started if it has none (under _STATE.lock); True if it was
    started now. A fork copies no thread: a child with something to report starts its own."""
    pid = os.getpid()
    if _STATE.reporter is not None and _STATE.reporter.is_alive() and _STATE.reporter_pid == pid:
        return False
    _STATE.stop = threading.Event()
    _STATE.reporter = threading.Thread(target=_report_loop, args=(_STATE.stop,),
                                       name="kvtrace-vllm-reporter", daemon=True)
    _STATE.reporter_pid = pid
    _STATE.reporter.start()
    return True


def _scheduler_gone(ref: weakref.ref[Any]) -> None:
    if _STATE.scheduler_ref is ref:  # its pool goes with it: count no other pool that reuses the id
        _STATE.pool_id = 0


def _agent_socket() -> tuple[int, int, int] | None:
    """(device, inode, change time) of the agent's socket file, None while there is none: another value is
    another agent (a restarted agent may bind a file that gets the old inode number again)."""
    try:
        status = os.stat(_STATE.socket_path)
    except OSError:
        return None
    return status.st_dev, status.st_ino, status.st_ctime_ns


def _report_loop(stop: threading.Event) -> None:
    """Once a second while the process has something to report: the scheduler's figures (the first at
    once: blocks free at the start is a figure the detectors compare with), and the KV layout and sleep
    state again to an agent that is new or every RESEND_SECONDS. Builds nothing while no agent is there."""
    agent = _agent_socket()  # what the process sent so far went to this one
    resent = time.monotonic()
    while True:
        ref = _STATE.scheduler_ref
        scheduler = ref() if ref is not None and PART_SCHEDULER not in _STATE.off else None
        if scheduler is None and _STATE.kv_message is None and _STATE.sleep_message is None:
            return
        now_agent = _agent_socket()
        if now_agent is not None:
            if scheduler is not None:
                send_scheduler_report(scheduler)
            now = time.monotonic()
            if now_agent != agent or now - resent >= RESEND_SECONDS:
                for message in (_STATE.kv_message, _STATE.sleep_message):
                    if message is not None:
                        _send_bytes(message)
                resent = now
        agent = now_agent
        del scheduler
        if stop.wait(protocol.REPORT_INTERVAL_SECONDS):
            return


def send_scheduler_report(scheduler: Any) -> None:
    """Builds and sends one "scheduler" message; a failure switches the report off."""
    if PART_SCHEDULER in _STATE.off:
        return
    try:
        if not _STATE.report_lock.acquire(timeout=1.0):
            return
        try:
            message = build_scheduler_report(scheduler)
        finally:
            _STATE.report_lock.release()
        _send_bytes(message)
    except Exception as error:
        _switch_off(PART_SCHEDULER, error)


def _copy(make: Callable[[Any], Any], structure: Any) -> Any:
    """make(structure): a copy of a structure vLLM's engine thread may be changing, with one retry when
    it changed size during the copy."""
    try:
        return make(structure)
    except RuntimeError:
        return make(structure)


_STATE_OF_STATUS: dict[str, str] = {"RUNNING": "running", "PREEMPTED": "preempted", "FINISHED_ABORTED": "aborted"}
_DONE_STATES = frozenset(("finished", "aborted"))
# id(status) -> state: RequestStatus members are singletons, and an enum's own hash runs Python code.
_STATE_BY_STATUS_ID: dict[int, str] = {}


def _state_name(status: Any) -> str:
    """vLLM's RequestStatus (by name: no vLLM import here) as one of protocol.REQUEST_STATES."""
    state = _STATE_BY_STATUS_ID.get(id(status))
    if state is None:
        name = getattr(status, "name", None) or str(status)
        state = _STATE_OF_STATUS.get(name) or ("finished" if name.startswith("FINISHED") else "waiting")
        if len(_STATE_BY_STATUS_ID) < 64:
            _STATE_BY_STATUS_ID[id(status)] = state
    return state


def _holders(scheduler: Any) -> dict[str, int]:
    """Request id -> blocks held, summed over the coordinator's managers (one per KV-cache group).
    vLLM's req_to_blocks is a defaultdict: looking a request up creates an empty entry, left out here."""
    managers = _copy(tuple, scheduler.kv_cache_manager.coordinator.single_type_managers)
    if len(managers) == 1:
        return {request_id: len(blocks) for request_id, blocks in _copy(dict, managers[0].req_to_blocks).items()
                if blocks}
    held: dict[str, int] = {}
    for manager in managers:
        for request_id, blocks in _copy(dict, manager.req_to_blocks).items():
            if blocks:
                held[request_id] = held.get(request_id, 0) + len(blocks)
    return held


def build_scheduler_report(scheduler: Any) -> bytes:
    """One "scheduler" datagram (protocol.py): O(requests holding blocks), under MAX_DATAGRAM_BYTES.
    Done holders first, the longest done first; then the largest (ties: in vLLM's allocation order)."""
    now = time.monotonic()
    pool = scheduler.kv_cache_manager.block_pool
    held = _holders(scheduler)
    requests = _copy(dict, scheduler.requests)
    notes = _STATE.finish_notes
    orphans = _STATE.orphans_first_seen
    done: list[tuple[float, str, str, int]] = []
    live: list[str] = []
    live_states: dict[str, str] = {}
    still_orphans: dict[str, float] = {}
    for request_id, blocks in held.items():
        request = requests.get(request_id)
        if request is not None:
            state = _state_name(request.status)
            if state not in _DONE_STATES:
                live.append(request_id)
                live_states[request_id] = state
                continue
        note = notes.get(request_id)
        if note is not None:
            since = note[0]
            if request is None:
                state = "aborted" if note[1] else "finished"
        else:
            # Done without a finish kvtrace saw (its note dropped, or this report ran between vLLM's free
            # and the note): its age counts from when a report first saw it so.
            since = still_orphans[request_id] = orphans.get(request_id, now)
            if request is None:
                state = "finished"
        done.append((now - since, request_id, state, blocks))
    _STATE.orphans_first_seen = still_orphans
    done.sort(key=lambda row: (-row[0], row[1]))
    rows: list[list[Any]] = [[_cut(request_id), state, blocks, round(age, 3)]
                             for age, request_id, state, blocks in done[:protocol.MAX_REQUESTS_PER_REPORT]]
    room = max(protocol.MAX_REQUESTS_PER_REPORT - len(rows), 0)
    live.sort(key=held.__getitem__, reverse=True)  # C-level and stable: no tuple per holder
    rows += [[_cut(request_id), live_states[request_id], held[request_id], None]
             for request_id in live[:room]]
    waiting = len(scheduler.waiting) + len(getattr(scheduler, "skipped_waiting", ()))
    message: dict[str, Any] = {
        "v": protocol.VERSION, "type": protocol.TYPE_SCHEDULER,
        "blocks_total": pool.num_gpu_blocks - 1,  # block 0 is the null block, never handed out
        "blocks_free": pool.get_num_free_blocks(),
        "running": len(scheduler.running), "waiting": waiting,
        "allocated_total": _STATE.allocated_total, "freed_total": _STATE.freed_total,
        "requests": rows, "requests_omitted": len(held) - len(rows),
        "messages_dropped_total": _STATE.messages_dropped,
    }
    return _fit(message, "requests", "requests_omitted")


def _cut(text: Any) -> str:
    """A request id or tag as the agent takes it: text, at most MAX_REQUEST_ID_CHARS, never empty."""
    return str(text)[:protocol.MAX_REQUEST_ID_CHARS] or "?"


def _fit(message: dict[str, Any], list_key: str, omitted_key: str) -> bytes:
    """The message encoded under MAX_DATAGRAM_BYTES, dropping entries from the end of `list_key` (the
    least important) and counting them in `omitted_key`."""
    data = _encode(message)
    while len(data) > protocol.MAX_DATAGRAM_BYTES and message[list_key]:
        entries = message[list_key]
        keep = min(len(entries) - 1, int(len(entries) * protocol.MAX_DATAGRAM_BYTES / len(data) * 0.95))
        message[omitted_key] += len(entries) - keep
        message[list_key] = entries[:keep]
        data = _encode(message)
    return data


def _encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode()


# ---- block counters (BlockPool) ----


def _patch_block_pool(module: Any) -> None:
    """Counts blocks leaving and returning to the tracked pool's free queue, from the queue's own count
    before and after vLLM's call: exact whatever the argument (lists or one-shot iterators, untouched)."""
    pool_class = module.BlockPool

    def make_get_new_blocks(original: Callable[..., Any]) -> Callable[..., Any]:
        def get_new_blocks(self: Any, num_blocks: int) -> Any:
            result = original(self, num_blocks)
            if id(self) == _STATE.pool_id and PART_BLOCKS not in _STATE.off:
                try:
                    _STATE.allocated_total += len(result)
                except Exception as error:
                    _switch_off(PART_BLOCKS, error)
            return result
        return get_new_blocks

    def make_counted(original: Callable[..., Any], freed: bool) -> Callable[..., Any]:
        # free_blocks (ref_cnt reaching 0 returns a block) and touch (a prefix-cache hit takes a free
        # cached block back out): the free queue's size before and after says how many moved.
        def counted(self: Any, blocks: Iterable[Any]) -> Any:
            if id(self) != _STATE.pool_id or PART_BLOCKS in _STATE.off:
                return original(self, blocks)
            try:
                before = self.get_num_free_blocks()
            except Exception as error:
                _switch_off(PART_BLOCKS, error)
                return original(self, blocks)
            result = original(self, blocks)
            try:
                moved = self.get_num_free_blocks() - before
                if freed and moved > 0:
                    _STATE.freed_total += moved
                elif not freed and moved < 0:
                    _STATE.allocated_total -= moved
            except Exception as error:
                _switch_off(PART_BLOCKS, error)
            return result
        return counted

    _wrap(pool_class, "get_new_blocks", make_get_new_blocks)
    _wrap(pool_class, "free_blocks", lambda original: make_counted(original, freed=True))
    _wrap(pool_class, "touch", lambda original: make_counted(original, freed=False))


# ---- worker side: the KV tensors ----


def _patch_attn_utils(module: Any) -> None:
    """V2 model runner: init_kv_cache calls the module global _allocate_kv_cache(kv_cache_config,
    shared_layers, device) -> {layer: int8 tensor}."""
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def _allocate_kv_cache(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            _after_kv_allocation(result, args[0] if args else kwargs.get("kv_cache_config"))
            return result
        return _allocate_kv_cache

    _wrap(module, "_allocate_kv_cache", make)


def _patch_gpu_model_runner(module: Any) -> None:
    """V1 model runner: GPUModelRunner._allocate_kv_cache_tensors(kv_cache_config) -> {layer: tensor}."""
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def _allocate_kv_cache_tensors(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, *args, **kwargs)
            _after_kv_allocation(result, args[0] if args else kwargs.get("kv_cache_config"))
            return result
        return _allocate_kv_cache_tensors

    _wrap(module.GPUModelRunner, "_allocate_kv_cache_tensors", make)


def _after_kv_allocation(tensors: Any, kv_cache_config: Any) -> None:
    if not _STATE.active or PART_KV_CACHE in _STATE.off:
        return
    try:
        data = build_kv_cache_message(tensors, kv_cache_config)
        if data is not None:
            _STATE.kv_message = data
            _send_bytes(data)
            with _STATE.lock:
                _ensure_reporter()
    except Exception as error:
        _switch_off(PART_KV_CACHE, error)


def build_kv_cache_message(tensors: dict[str, Any], kv_cache_config: Any) -> bytes | None:
    """One "kv_cache" datagram: each distinct tensor once (layers may share one), by address. None for
    a model with no KV cache (no tensor or no KV-cache group: nothing the agent could place)."""
    unique: dict[int, Any] = {}
    for tensor in tensors.values():
        unique.setdefault(tensor.data_ptr(), tensor)
    rows: list[list[int]] = []
    device = 0
    for address, tensor in sorted(unique.items()):
        try:
            size_bytes = tensor.untyped_storage().nbytes()
        except Exception:
            size_bytes = tensor.numel() * tensor.element_size()
        rows.append([address, size_bytes])
        index = getattr(tensor.device, "index", None)
        if index is not None:
            device = index
    groups = kv_cache_config.kv_cache_groups
    if not rows or not groups:
        return None
    spec = groups[0].kv_cache_spec
    message: dict[str, Any] = {
        "v": protocol.VERSION, "type": protocol.TYPE_KV_CACHE, "device": device,
        "tensors": rows[:protocol.MAX_TENSORS], "tensors_omitted": max(len(rows) - protocol.MAX_TENSORS, 0),
        "num_blocks": kv_cache_config.num_blocks,
        "page_size_bytes": spec.page_size_bytes, "block_size": spec.block_size,
    }
    return _fit(message, "tensors", "tensors_omitted")


# ---- sleep mode ----


def _patch_cumem(module: Any) -> None:
    allocator_class = module.CuMemAllocator

    def make_sleep(original: Callable[..., Any]) -> Callable[..., Any]:
        def sleep(self: Any, offload_tags: Any = None) -> Any:
            result = original(self, offload_tags)
            if _STATE.active and PART_SLEEP not in _STATE.off:
                try:
                    level = getattr(_STATE.worker_level, "level", None)
                    if level is None:  # not through Worker.sleep: from what vLLM offloads (as Worker does)
                        tags = (offload_tags,) if isinstance(offload_tags, str) else offload_tags
                        level = 2 if tags is not None and len(tags) == 0 else 1
                    _after_sleep(self, level, woke=None)
                except Exception as error:
                    _switch_off(PART_SLEEP, error)
            return result
        return sleep

    def make_wake_up(original: Callable[..., Any]) -> Callable[..., Any]:
        def wake_up(self: Any, tags: Any = None) -> Any:
            result = original(self, tags)
            if _STATE.active and PART_SLEEP not in _STATE.off:
                try:
                    _after_sleep(self, 0, woke=tags)
                except Exception as error:
                    _switch_off(PART_SLEEP, error)
            return result
        return wake_up

    _wrap(allocator_class, "sleep", make_sleep)
    _wrap(allocator_class, "wake_up", make_wake_up)


def _patch_gpu_worker(module: Any) -> None:
    """Worker.sleep(level) knows the level the engine asked for; its allocator.sleep reads it."""
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def sleep(self: Any, level: int = 1, *args: Any, **kwargs: Any) -> Any:
            slot = _STATE.worker_level
            slot.level = level if isinstance(level, int) else None
            try:
                return original(self, level, *args, **kwargs)
            finally:
                slot.level = None
        return sleep

    _wrap(module.Worker, "sleep", make)


def _after_sleep(allocator: Any, level: int, woke: Any) -> None:
    """After sleep (woke is None) every allocation of every tag was released (vLLM unmaps them all, the
    offloaded tags having been copied out first); after wake_up(tags) those tags (None: all) are mapped
    again. The level stays until every tag is back."""
    pools: dict[str, int] = {}
    for data in _copy(list, allocator.pointer_to_data.values()):
        pools[data.tag] = pools.get(data.tag, 0) + int(data.handle[1])
    if level > 0:
        _STATE.sleep_level = level
        _STATE.asleep_tags = set(pools)
    else:
        _STATE.asleep_tags = set() if woke is None else _STATE.asleep_tags - set(woke)
        if not _STATE.asleep_tags:
            _STATE.sleep_level = 0
    rows = [[_cut(tag), size, 0 if tag in _STATE.asleep_tags else size] for tag, size in sorted(pools.items())]
    message: dict[str, Any] = {"v": protocol.VERSION, "type": protocol.TYPE_SLEEP, "level": _STATE.sleep_level,
                               "pools": rows[:protocol.MAX_POOLS]}
    _STATE.sleep_message = _encode(message)
    _send_bytes(_STATE.sleep_message)
    with _STATE.lock:
        _ensure_reporter()
    ref = _STATE.scheduler_ref
    scheduler = ref() if ref is not None and _STATE.reporter_pid == os.getpid() else None
    if scheduler is not None:  # the engine's figures right away, not up to a second later
        send_scheduler_report(scheduler)


# ---- sending ----


def _send_bytes(data: bytes) -> None:
    """One datagram to the agent, never blocking: any OSError (no agent, queue full, permission) drops
    it, counted, with one warning the first time."""
    try:
        sock = _STATE.sock
        if sock is None or _STATE.sock_pid != os.getpid():
            with _STATE.lock:
                sock = _STATE.sock
                if sock is None or _STATE.sock_pid != os.getpid():
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                    sock.setblocking(False)
                    _STATE.sock, _STATE.sock_pid = sock, os.getpid()
        sock.sendto(data, _STATE.socket_path)
        _STATE.messages_sent += 1
    except OSError as error:
        _STATE.messages_dropped += 1
        _warn_once("send", "kvtrace vLLM plugin: the agent at %s took no report (%s); dropping reports "
                   "while it does not (start the agent, or unset %s)", _STATE.socket_path, error,
                   protocol.ENABLE_ENV)


def stats() -> dict[str, Any]:
    """What the plugin did in this process (for tests and benchmarks)."""
    return {"active": _STATE.active, "sent": _STATE.messages_sent, "dropped": _STATE.messages_dropped,
            "off": sorted(_STATE.off), "allocated_total": _STATE.allocated_total,
            "freed_total": _STATE.freed_total}


def _reset() -> None:
    """Back to a process where register() never ran (tests and benchmarks only): the reporter stopped,
    the finder removed, the socket closed. Patched classes stay patched (their wrappers do nothing
    without a tracked scheduler or an active plugin)."""
    global _STATE
    state = _STATE
    state.active = False
    state.stop.set()
    if state.reporter is not None and state.reporter is not threading.current_thread():
        state.reporter.join(timeout=5)
    sys.meta_path[:] = [finder for finder in sys.meta_path if not getattr(finder, _FINDER_MARK, False)]
    if state.sock is not None:
        state.sock.close()
    _STATE = _State()


_PATCHES: dict[str, Callable[[Any], None]] = {
    "vllm.v1.core.sched.scheduler": _patch_scheduler,
    "vllm.v1.core.block_pool": _patch_block_pool,
    "vllm.v1.worker.gpu.attn_utils": _patch_attn_utils,
    "vllm.v1.worker.gpu_model_runner": _patch_gpu_model_runner,
    "vllm.device_allocator.cumem": _patch_cumem,
    "vllm.v1.worker.gpu_worker": _patch_gpu_worker,
}
