"""torch.cuda.memory binds `_lazy_init` by name when torch.cuda is imported, as the real one does. A fake
caching allocator's blocks (one segment each, from the fake driver) and PyTorch's recorder as kvtrace reads
it: `_record_memory_history` and `_snapshot()`, whose live blocks carry the Python frames (innermost first)
that allocated them while the recorder was on."""
import sys

from torch.cuda import _driver, _lazy_init

recording = None  # the recorder's settings while on: {"enabled", "context", "stacks"}
history_calls = []  # every _record_memory_history call's settings, in order
snapshot_subscribers = []  # the fake CUPTI's subscriber at each _snapshot() (None: given back)
_live = {}  # address -> [size_bytes, frames or None]
_carved = {}  # segment address -> bytes handed out of it so far


def caching_allocator_alloc(size_bytes: int) -> int:
    _lazy_init()
    return _driver().fake_mem_alloc(size_bytes)


def _record_memory_history(enabled="all", context="all", stacks="all", max_entries=0):
    global recording
    history_calls.append({"enabled": enabled, "context": context, "stacks": stacks})
    recording = None if enabled is None else {"enabled": enabled, "context": context, "stacks": stacks}


def block(size_bytes: int, inside: int = 0) -> int:
    """A tensor's block: carved out of the cached segment at `inside` (no driver call, as a cache hit), or
    its own new segment; with its frames if the recorder is on."""
    if inside:
        address = inside + _carved.get(inside, 0)
        _carved[inside] = _carved.get(inside, 0) + size_bytes + 512
    else:
        address = caching_allocator_alloc(size_bytes)
    frames = None
    if recording is not None:
        # stacks="all": C++ frames first, as PyTorch's recorder gives them (innermost first)
        frames = [{"name": "c10::cuda::CUDACachingAllocator::malloc", "filename": "CUDACachingAllocator.cpp",
                   "line": 1}] if recording["stacks"] == "all" else []
        frame = sys._getframe(1)
        while frame is not None:
            frames.append({"name": frame.f_code.co_name, "filename": frame.f_code.co_filename, "line": frame.f_lineno})
            frame = frame.f_back
    _live[address] = [size_bytes, frames]
    return address


def free_block(address: int) -> None:
    """The block back to the cache (its segment stays)."""
    _live.pop(address)


def _snapshot() -> dict:
    snapshot_subscribers.append(_driver().fake_subscriber())
    segments = []
    for address, (size_bytes, frames) in sorted(_live.items()):
        entry = {"address": address, "size": size_bytes + 512, "requested_size": size_bytes,
                 "state": "active_allocated"}
        if frames is not None:
            entry["frames"] = frames
        free = {"address": address + size_bytes + 512, "size": 512, "requested_size": 0, "state": "inactive"}
        segments.append({"device": 0, "address": address, "blocks": [entry, free]})
    return {"segments": segments, "device_traces": [[]]}


def fake_reset() -> None:
    global recording
    recording = None
    history_calls.clear()
    _live.clear()
    _carved.clear()
