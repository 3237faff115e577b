"""What traced bytes are for: the role of each allocation (KV cache, weights, CUDA graph pool,
activations), from its Python stack and the KV tensors the vLLM plugin reported.

A stack's role is the highest-precedence rule that any of its frames matches (ROLE_RULES, top
first): a CUDA-graph capture runs the model's forward, so `capture_model` must beat `forward`; the KV
cache is allocated under `Worker.initialize_from_config`, never under a weights loader. No rule: other;
no stack: unknown. An allocation overlapping one of its process's KV tensors (the plugin's
KvCacheLayout) is kv_cache whatever its stack: the addresses are the ground truth.

Rules match a frame's function name (the last part of its qualified name), never its line: they hold
across vLLM's releases as long as the names do (seen on 0.24.0: `_allocate_kv_cache (attn_utils.py)
<- init_kv_cache <- GPUModelRunner.initialize_kv_cache <- Worker.initialize_from_config`).

What is counted is what the analyzer counts as a process's outstanding bytes: physical device memory
(driver allocations and VMM handles, `holds_device_memory`), so a process's roles add up to exactly
its traced bytes. A segment of PyTorch's caching allocator takes the role of the stack that made the
cache grow; vLLM allocates each kind of memory in its own phase, so that stack says what it is for.
"""
from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from kvtrace.model.events import Layer, ObjectKind
from kvtrace.model.ledger import LedgerKey, Outstanding, holds_device_memory
from kvtrace.model.stacks import Frame, Stack
from kvtrace.model.vllm import Role

# (role, function names, substrings of a lower-cased function name, substrings of a lower-cased file),
# by precedence: the first rule any frame matches decides.
ROLE_RULES: tuple[tuple[Role, frozenset[str], tuple[str, ...], tuple[str, ...]], ...] = (
    (Role.KV_CACHE, frozenset({
        "_allocate_kv_cache", "init_kv_cache", "initialize_kv_cache",  # V2 model runner (attn_utils.py)
        "_allocate_kv_cache_tensors", "initialize_kv_cache_tensors", "_reshape_kv_cache_tensors",  # V1 runner
    }), (), ()),
    # Capture only: the file rule stops at graph *capture* code, because every piecewise forward at
    # run time passes through `CUDAGraphWrapper.__call__` (compilation/cuda_graph.py) and
    # `run_pw_graph` (cudagraph_utils.py), and those allocations are activations.
    (Role.CUDA_GRAPH, frozenset({"capture_model", "_capture_cudagraphs", "capture_graphs", "capture"}),
     ("cudagraph", "cuda_graph"), ("torch/cuda/graphs.py",)),
    (Role.WEIGHTS, frozenset({
        "create_weights", "load_model", "load_weights", "initialize_model", "process_weights_after_loading",
    }), (), ()),
    (Role.ACTIVATIONS, frozenset({
        "execute_model", "_dummy_run", "profile_run", "_dummy_sampler_run", "sample_tokens", "forward",
        "determine_available_memory", "kernel_warmup",
    }), (), ()),
)
# `capture` is a common word: it names a CUDA-graph capture only in a file about CUDA graphs
# (v1/worker/gpu/cudagraph_utils.py's CudaGraphManager.capture).
_NEEDS_GRAPH_FILE = frozenset({"capture"})
_GRAPH_FILE_WORDS = ("cudagraph", "cuda_graph", "graphs.py")

# CuMemAllocator.wake_up (device_allocator/cumem.py) maps every sleeping pool back at its old address:
# its stack says nothing of the tag, so the bytes take the role the address had before the sleep.
_WAKE_UP = ("wake_up", "cumem.py")

_DRIVER, _RUNTIME = Layer.DRIVER, Layer.RUNTIME
_ALLOCATION, _VMM_HANDLE = ObjectKind.ALLOCATION, ObjectKind.VMM_HANDLE
_VMM_MAPPING, _VMM_RESERVE = ObjectKind.VMM_MAPPING, ObjectKind.VMM_RESERVE


_RANK = {role: rank for rank, (role, _, _, _) in enumerate(ROLE_RULES)}


def _frame_role(frame: Frame) -> Role | None:
    name = frame.function.rpartition(".")[2]
    lowered = name.lower()
    file = frame.file.lower()
    for role, names, name_words, file_words in ROLE_RULES:
        if name in names:
            if name not in _NEEDS_GRAPH_FILE or any(word in file for word in _GRAPH_FILE_WORDS):
                return role
        elif any(word in lowered for word in name_words) or any(word in file for word in file_words):
            return role
    return None


def role_of_stack(stack: Stack | None) -> Role:
    """The role of an allocation made under `stack` (innermost frame first); see ROLE_RULES."""
    if stack is None or not stack.frames:
        return Role.UNKNOWN
    best: Role | None = None
    best_rank = len(ROLE_RULES)
    for frame in stack.frames:
        role = _frame_role(frame)
        if role is None:
            continue
        rank = _RANK[role]
        if rank < best_rank:
            best, best_rank = role, rank
            if rank == 0:
                break
    return best if best is not None else Role.OTHER


def _wakes_up(stack: Stack | None) -> bool:
    return stack is not None and any(
        frame.function.rpartition(".")[2] == _WAKE_UP[0] and frame.file.endswith(_WAKE_UP[1])
        for frame in stack.frames)


@dataclass
class RoleMemo:
    """What role_bytes keeps between calls, in one analyzer: a role per stack id (stacks are interned
    and never change, so each is read once) and the role each VMM mapping address had, for the
    memory CuMemAllocator maps back there when the engine wakes up."""

    by_stack: dict[int, Role] = field(default_factory=dict)
    wake_up_stacks: set[int] = field(default_factory=set)
    by_mapping: dict[tuple[int, int], Role] = field(default_factory=dict)  # (pid, address) -> role


def kv_ranges_of(tensors: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """(address, size_bytes) of KV tensors -> disjoint (start, end) ranges in address order (layers
    may be views of one packed backing tensor, so tensors may overlap)."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted((address, address + size) for address, size in tensors if size > 0):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _overlaps(ranges: tuple[list[int], list[tuple[int, int]]], address: int, size: int) -> bool:
    starts, spans = ranges
    index = bisect.bisect_right(starts, address + max(size, 1) - 1) - 1
    return index >= 0 and spans[index][1] > address


class RoleTally:
    """role_bytes() one entry at a time (`add`), for a pass over the ledger that computes other things from the
    same entries too (analyzer.sample_sites); `finish` gives the totals. Per VMM handle and stackless driver
    allocation it holds the entry until `finish` (their role needs what the pass has not seen yet), never
    per other entry."""

    def __init__(self, stack_of: Callable[[int], Stack | None], kv_ranges: Mapping[int, list[tuple[int, int]]],
                 memo: RoleMemo | None = None, keep_runtime: bool = True) -> None:
        """`keep_runtime`: remember the stacks of runtime allocations for `finish` (False where its
        `runtime_stack` looks them up elsewhere)."""
        self._memo = memo if memo is not None else RoleMemo()
        self._stack_of = stack_of
        self._ranges = {pid: ([start for start, _ in spans], spans) for pid, spans in kv_ranges.items() if spans}
        self._keep_runtime = keep_runtime
        self.totals: dict[tuple[int, int], dict[Role, int]] = {}
        self.runtime_stacks: dict[tuple[int, int], int] = {}
        self.unstacked: list[Outstanding] = []  # driver allocations whose stack is the runtime call's above
        self._handles: list[Outstanding] = []  # VMM handles: their role may depend on where they are mapped
        self._mapped_at: dict[tuple[int, int], int] = {}  # (pid, handle) -> the first address it is mapped at
        self._reserving: set[int] = set()  # pids with VMM address space: asleep, CuMemAllocator keeps its ranges

    def role_of_id(self, stack_id: int) -> Role:
        memo = self._memo
        role = memo.by_stack.get(stack_id)
        if role is None:
            stack = self._stack_of(stack_id)
            role = role_of_stack(stack)
            if stack is not None:  # an id not known yet is asked again next time
                memo.by_stack[stack_id] = role
                if _wakes_up(stack):
                    memo.wake_up_stacks.add(stack_id)
        return role

    def _add(self, entry: Outstanding, role: Role) -> None:
        series = self.totals.get((entry.key.pid, entry.device))
        if series is None:
            series = self.totals[(entry.key.pid, entry.device)] = {}
        series[role] = series.get(role, 0) + entry.size_bytes

    def add(self, entry: Outstanding) -> None:
        key = entry.key
        kind = key.object
        if kind is _VMM_MAPPING:
            self._mapped_at.setdefault((key.pid, entry.handle), key.address)
            return
        if kind is _VMM_RESERVE:
            self._reserving.add(key.pid)
            return
        if kind is _ALLOCATION and key.layer is _RUNTIME:
            if entry.stack_id and self._keep_runtime:
                self.runtime_stacks[(key.pid, key.address)] = entry.stack_id
            return
        if not holds_device_memory(entry):
            return
        ranges = self._ranges
        if kind is _VMM_HANDLE:
            self._handles.append(entry)
        elif key.pid in ranges and _overlaps(ranges[key.pid], key.address, entry.size_bytes):
            self._add(entry, Role.KV_CACHE)
        elif entry.stack_id or key.layer is not _DRIVER:
            self._add(entry, self.role_of_id(entry.stack_id) if entry.stack_id else Role.UNKNOWN)
        else:
            self.unstacked.append(entry)

    def finish(self, runtime_stack: Callable[[int, int], int] | None = None) -> dict[tuple[int, int], dict[Role, int]]:
        """The totals, once every entry was added. `runtime_stack(pid, address)`: the stack id of the runtime
        allocation above a stackless driver one (0: none); None: the stacks added (keep_runtime)."""
        stack_above = runtime_stack if runtime_stack is not None else \
            (lambda pid, address: self.runtime_stacks.get((pid, address), 0))
        for entry in self.unstacked:
            stack_id = stack_above(entry.key.pid, entry.key.address)
            self._add(entry, self.role_of_id(stack_id) if stack_id else Role.UNKNOWN)
        self.unstacked = []
        memo, ranges = self._memo, self._ranges
        remembered: dict[tuple[int, int], Role] = {}
        for entry in self._handles:
            pid = entry.key.pid
            address = self._mapped_at.get((pid, entry.key.address))
            role = self.role_of_id(entry.stack_id) if entry.stack_id else Role.UNKNOWN
            if address is not None:
                if pid in ranges and _overlaps(ranges[pid], address, entry.size_bytes):
                    role = Role.KV_CACHE
                elif entry.stack_id in memo.wake_up_stacks:
                    role = memo.by_mapping.get((pid, address), role)
                remembered[(pid, address)] = role
            self._add(entry, role)
        # Kept while the process holds VMM memory or address space: asleep, its pools have no handle at all.
        pids = self._reserving | {entry.key.pid for entry in self._handles}
        memo.by_mapping = {**{key: role for key, role in memo.by_mapping.items() if key[0] in pids}, **remembered}
        return self.totals


def role_bytes(entries: Iterable[Outstanding], stack_of: Callable[[int], Stack | None],
               kv_ranges: Mapping[int, list[tuple[int, int]]], memo: RoleMemo | None = None,
               find: Callable[[LedgerKey], Outstanding | None] | None = None,
               ) -> dict[tuple[int, int], dict[Role, int]]:
    """(pid, device) -> bytes by role of the physical device memory in `entries`: per (pid, device)
    the roles sum to exactly the analyzer's outstanding bytes. `kv_ranges`: pid -> disjoint
    (start, end) ranges of its KV tensors (kv_ranges_of). One pass; a stack is classified once per
    `memo` (0.1-0.15 s per 100 000 entries, tests/unit/test_roles.py). With `find` (the kernel's
    entries, by key) a driver allocation without a stack finds the runtime one above it there, and no
    runtime entry is kept meanwhile: memory per VMM handle and stackless allocation, not per entry.
    (RoleTally, one entry at a time.)"""
    tally = RoleTally(stack_of, kv_ranges, memo, keep_runtime=find is None)
    for entry in entries:
        tally.add(entry)
    if find is None:
        return tally.finish()

    def runtime_stack(pid: int, address: int) -> int:
        above = find(LedgerKey(pid, _RUNTIME, _ALLOCATION, address))
        return above.stack_id if above is not None else 0

    return tally.finish(runtime_stack)
