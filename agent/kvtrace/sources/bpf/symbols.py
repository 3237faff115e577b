"""The attach table: which symbols kvtrace probes, and which BPF functions handle them.

Every traced function has an entry probe (saves arguments) and a return probe (reads results);
both are named after the symbol in probes/kvtrace.bpf.c: entry_<symbol>, return_<symbol>.
"""
from __future__ import annotations

from kvtrace.model.events import Api

RUNTIME_SYMBOLS = (
    "cudaMalloc", "cudaFree", "cudaMallocAsync", "cudaFreeAsync", "cudaMallocManaged",
    "cudaMallocHost", "cudaHostAlloc", "cudaFreeHost", "cudaMallocPitch", "cudaSetDevice",
)
DRIVER_SYMBOLS = (
    "cuMemAlloc_v2", "cuMemFree_v2", "cuMemAllocAsync", "cuMemFreeAsync", "cuMemAllocManaged",
    "cuMemAllocPitch_v2", "cuMemAllocHost_v2", "cuMemHostAlloc", "cuMemFreeHost",
    "cuCtxSetCurrent", "cuCtxDestroy_v2", "cuDevicePrimaryCtxRetain", "cuCtxCreate_v2",
)
VMM_SYMBOLS = (
    "cuMemCreate", "cuMemRelease", "cuMemMap", "cuMemUnmap", "cuMemAddressReserve",
    "cuMemAddressFree",
)
ALL_SYMBOLS = RUNTIME_SYMBOLS + DRIVER_SYMBOLS + VMM_SYMBOLS

# PyTorch's caching allocator: USDT probes of provider `pytorch` (libc10_cuda.so), and kvtrace's own hook inside a
# PyTorch process, which hands the same blocks over in batches (kvtrace:blocks, sources/torch_hook, probes/hook.h);
# one program for all, and the one its batches' entries go through.
TORCH_PROBES = (("pytorch", "malloc"), ("pytorch", "free"), ("kvtrace", "blocks"))
HOOK_PROBE = ("kvtrace", "blocks")
TORCH_PROGRAM = "usdt_pytorch"
HOOK_ENTRIES_PROGRAM = "usdt_hook_entries"

# A library is worth attaching to when it defines one of these (the allocation entry points).
TRIGGER_SYMBOLS = frozenset(("cudaMalloc", "cuMemAlloc_v2", "cuMemCreate"))

assert all(hasattr(Api, name) for name in ALL_SYMBOLS)


def entry_function(symbol: str) -> str:
    return f"entry_{symbol}"


def return_function(symbol: str) -> str:
    return f"return_{symbol}"
