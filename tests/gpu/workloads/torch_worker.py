"""A torch process driven line by line over stdin/stdout (JSON), for the GPU tests.

Each command is one JSON object on stdin; each answer is one JSON object on stdout. The allocating
functions have fixed names and lines so that tests can check the Python stacks kvtrace records.

KVTRACE_TEST_TITLE renames the process as setproctitle (and so vLLM) does, before torch loads CUDA.
KVTRACE_TEST_DEVICE=cpu runs the model commands on the CPU (to check this file off the GPU machine).

Commands for PyTorch's caching allocator block by block (tests/gpu/test_torch_blocks.py,
bench/torch_blocks_overhead.py): "blocks" (tensors of mixed sizes, a third freed again),
"memory_snapshot" (torch.cuda.memory_snapshot() without frames, with memory_reserved/allocated per
device), "clone_leak" (keep_activation() keeps a clone per step while scratch_temporary() makes the
cache grow) and "tensor_pairs" (torch.empty + del in a tight loop, timed).

"torch_hook" builds kvtrace's PyTorch hook (agent/kvtrace/sources/torch_hook) against this torch, or loads the
library named, and attaches it to the caching allocator (for the rest of the process); "torch_hook_settings" sets
its sample size and batch in this process; "torch_hook_counts" reads its counts.
"""
import ctypes
import json
import os
import sys
import time


def set_title(title: str) -> None:
    """What setproctitle does on Linux: the argv area (/proc/PID/cmdline) and comm take the title."""
    fields = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
    arg_start, arg_end = int(fields[45]), int(fields[46])  # stat fields 48 and 49
    data = title.encode()[:arg_end - arg_start - 1]
    ctypes.memmove(arg_start, data.ljust(arg_end - arg_start, b"\0"), arg_end - arg_start)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(15, ctypes.c_char_p(title.encode()[:15]), 0, 0, 0)  # PR_SET_NAME


if os.environ.get("KVTRACE_TEST_TITLE"):
    set_title(os.environ["KVTRACE_TEST_TITLE"])

import torch  # noqa: E402  (after the title: torch maps libcudart as it loads)

DEVICE = os.environ.get("KVTRACE_TEST_DEVICE", "cuda")
kept = []
clones = []  # the "clone_leak" command's planted leak
model_state = {}  # "model", "cache", "leaked": the Llama commands' state
llama = None  # tests/gpu/workloads/llama.py, imported by the first model command


def allocate_tensors(count, step_bytes):
    tensors = []
    for index in range(count):
        tensors.append(torch.empty((index + 1) * step_bytes, dtype=torch.uint8, device="cuda"))  # ALLOC_LINE
    return tensors


def leak_one_per_step(steps, size_bytes):
    for _ in range(steps):
        kept.append(torch.empty(size_bytes, dtype=torch.uint8, device="cuda"))  # LEAK_LINE


def churn(steps, size_bytes):
    for _ in range(steps):
        scratch = torch.empty(size_bytes, dtype=torch.uint8, device="cuda")
        del scratch


def allocate_too_much(size_bytes):
    return torch.empty(size_bytes, dtype=torch.uint8, device="cuda")  # OOM_LINE


# Sizes of the "blocks" command: both pools (small <= 1 MiB), sizes on and off PyTorch's 512-byte
# grid, large ones from 20 MiB segments (1-10 MiB) and from their own (> 10 MiB).
BLOCK_SIZES = (1, 511, 513, 4096, 100_000, 1 << 20, (1 << 20) + 1, 3 * (1 << 20) + 5, 9 << 20,
               (10 << 20) + 512, (25 << 20) + 1, 64 << 20)


def allocate_blocks(count):
    """`count` tensors, sizes from BLOCK_SIZES in turn."""
    tensors = []
    for index in range(count):
        size_bytes = BLOCK_SIZES[index % len(BLOCK_SIZES)]
        tensors.append(torch.empty(size_bytes, dtype=torch.uint8, device="cuda"))  # BLOCKS_LINE
    return tensors


def memory_snapshot():
    """torch.cuda.memory_snapshot() without frames (each block with its address), and what the
    allocator says it holds on each device."""
    torch.cuda.synchronize()
    segments = []
    for segment in torch.cuda.memory_snapshot():
        address, blocks = segment["address"], []
        for block in segment["blocks"]:  # in address order, covering the segment
            blocks.append({"address": block.get("address", address), "size": block["size"],
                           "requested_size": block["requested_size"], "state": block["state"]})
            address += block["size"]
        segments.append({"device": segment["device"], "address": segment["address"],
                         "total_size": segment["total_size"], "is_expandable": segment.get("is_expandable", False),
                         "segment_type": segment.get("segment_type", ""), "blocks": blocks})
    devices = range(torch.cuda.device_count())
    return {"segments": segments,
            "reserved_by_device": {str(device): torch.cuda.memory_reserved(device) for device in devices},
            "allocated_by_device": {str(device): torch.cuda.memory_allocated(device) for device in devices}}


def scratch_temporary(size_bytes, step):
    """Work space freed at once. It holds nothing, but it is what misses the allocator's cache, so
    the cudaMalloc calls (segments) that the leak below makes necessary happen here."""
    scratch = torch.empty(size_bytes, dtype=torch.uint8, device="cuda")  # TEMPORARY_LINE
    scratch.fill_(step % 251)
    del scratch


def keep_activation(kept_clones, activation):
    """The planted leak: a clone of the activation every step, never freed."""
    kept_clones.append(activation.clone())  # KEEP_CLONE_LINE


def clone_leak(steps, interval_seconds, keep_bytes, temporary_bytes):
    """One step every `interval_seconds` (fixed schedule): a temporary of `temporary_bytes`, then a
    kept clone of `keep_bytes`. With 8 MiB clones and 32 MiB temporaries the clones are carved out of
    the cached temporaries' segments, so the temporaries are what misses the cache: about every
    fourth one needs a new 32 MiB cudaMalloc, and the clones none."""
    activation = torch.ones(keep_bytes, dtype=torch.uint8, device="cuda")
    start = time.monotonic()
    late_steps = 0
    for step in range(steps):
        scratch_temporary(temporary_bytes, step)
        keep_activation(clones, activation)
        torch.cuda.synchronize()
        pause = start + (step + 1) * interval_seconds - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        else:
            late_steps += 1
    return {"kept": len(clones), "kept_bytes": len(clones) * keep_bytes, "late_steps": late_steps,
            "seconds": time.monotonic() - start}


def tensor_pairs(count, numel, depth):
    """`count` times `torch.empty(numel, device="cuda")` then its free, `depth` frames below this
    one; returns nanoseconds per pair. After the first, every one is a cache hit: one pytorch:malloc
    and one pytorch:free, no CUDA call."""
    if depth > 0:
        return tensor_pairs(count, numel, depth - 1)
    empty = torch.empty
    torch.cuda.synchronize()
    start = time.perf_counter_ns()
    for _ in range(count):
        tensor = empty(numel, device="cuda")
        del tensor
    return (time.perf_counter_ns() - start) / count


hook_state = {}  # "hook": kvtrace.sources.torch_hook.Hook once "torch_hook" ran


def torch_hook(command):
    """kvtrace's PyTorch hook, built (or the library given) and attached; the build's seconds."""
    from pathlib import Path

    from kvtrace.sources import torch_hook as hook_module

    start = time.perf_counter()
    path = command.get("library") or hook_module.build(hook_module.TorchBuild.of_imported_torch(),
                                                       Path(command.get("cache_dir", "/tmp/kvtrace-hook-cache")))
    built = time.perf_counter() - start
    hook = hook_module.Hook(Path(path))
    hook.attach()
    hook_state["hook"] = hook
    return {"library": str(path), "build_seconds": built}


def torch_hook_settings(command):
    """The hook's sample size and batch, written in this process (the agent writes the same fields from outside)."""
    settings = hook_state["hook"].settings()
    settings.sample_bytes = command.get("sample_bytes", settings.sample_bytes)
    settings.batch = command.get("batch", settings.batch)
    return {"sample_bytes": settings.sample_bytes, "batch": settings.batch}


def cudart():
    """torch's own libcudart (same file, so the same probes), for direct calls."""
    for line in open("/proc/self/maps"):
        path = line.split()[-1]
        if "/libcudart.so" in path:
            return ctypes.CDLL(path)
    raise RuntimeError("libcudart is not mapped: initialise CUDA first")


def malloc_free_pairs(count, depth):
    """`count` cudaMalloc(1 MiB) + cudaFree pairs, called `depth` frames below this one (a Python
    stack as deep as a serving framework's); returns nanoseconds per pair."""
    if depth > 0:
        return malloc_free_pairs(count, depth - 1)
    library = cudart()
    malloc, free = library.cudaMalloc, library.cudaFree
    pointer, size = ctypes.c_void_p(), ctypes.c_size_t(1 << 20)
    if malloc(ctypes.byref(pointer), size) != 0 or free(pointer) != 0:
        raise RuntimeError("cudaMalloc/cudaFree failed")
    start = time.perf_counter_ns()
    for _ in range(count):
        malloc(ctypes.byref(pointer), size)
        free(pointer)
    return (time.perf_counter_ns() - start) / count


def allocate_on_devices_from_threads(devices, count, step_bytes):
    """One thread per device: each sets its device (thread-local in CUDA and torch) and allocates."""
    import threading

    made = {}

    def allocate(device):
        torch.cuda.set_device(device)
        made[device] = allocate_tensors(count, step_bytes)

    threads = [threading.Thread(target=allocate, args=(device,)) for device in devices]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [tensor for device in devices for tensor in made[device]]


def stats():
    if DEVICE != "cuda":
        return {}
    torch.cuda.synchronize()
    return {"memory_reserved": torch.cuda.memory_reserved(),
            "memory_allocated": torch.cuda.memory_allocated()}


def live_storages():
    """(data_ptr, nbytes) of every tensor storage the model commands hold: parameters, buffers,
    the KV cache and the leaked tensors."""
    tensors = []
    if "model" in model_state:
        tensors += [*model_state["model"].parameters(), *model_state["model"].buffers()]
    if "cache" in model_state:
        tensors += llama.cache_tensors(model_state["cache"])
    tensors += model_state.get("leaked", [])
    storages = {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in tensors}
    return sorted(storages)


def model_command(op, command):
    global llama
    import llama  # noqa: F811  (transformers takes seconds to import: only for these commands)

    if op == "llama_load":
        model_state["model"] = llama.build_model(DEVICE, layers=command.get("layers", 8))
        return {}
    model = model_state["model"]
    if op == "generate":
        return llama.generate(model, batch=command.get("batch", 8), prompt_tokens=command.get("prompt", 256),
                              new_tokens=command.get("new_tokens", 128), calls=command.get("calls", 4))
    if op == "decode":
        model_state["cache"] = model_state.get("cache") or llama.new_cache()
        llama.decode(model, model_state["cache"], command.get("batch", 4), command.get("prompt", 64),
                     command["steps"])
        return {"kv": [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
                       for t in llama.cache_tensors(model_state["cache"])]}
    if op == "drop_cache":
        model_state.pop("cache", None)
        return {}
    if op == "leaky_loop":
        leaked = model_state.setdefault("leaked", [])
        return llama.leaky_decode_loop(model, leaked, command["steps"], command["interval_seconds"],
                                       command["leak_bytes"])
    if op == "live_storages":
        return {"storages": live_storages()}
    if op == "record_history":  # PyTorch's own tracer, for the benchmark's comparison
        # "all": every event with Python and C++ stacks (its default); "state": only the live blocks' Python
        # stacks (what holds memory now; no event history, no C++ unwinding)
        if not command["enabled"]:
            torch.cuda.memory._record_memory_history(enabled=None)
        elif command.get("mode", "all") == "state":
            torch.cuda.memory._record_memory_history(enabled="state", context="state", stacks="python")
        else:
            torch.cuda.memory._record_memory_history(enabled="all")
        return {}
    return {"error": f"unknown op {op}"}


MODEL_OPS = {"llama_load", "generate", "decode", "drop_cache", "leaky_loop", "live_storages", "record_history"}


def main():
    print(json.dumps({"ready": True, "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        if op == "init":
            torch.cuda.init()
            torch.cuda.set_device(command.get("device", 0))
            answer = {"device_count": torch.cuda.device_count()}
            if command.get("uuids"):  # the CUDA ordinals' GPUs, to match NVML's (multi-GPU tests)
                answer["uuids"] = [str(torch.cuda.get_device_properties(device).uuid)
                                   for device in range(torch.cuda.device_count())]
        elif op == "alloc":
            tensors = allocate_tensors(command["count"], command["step_bytes"])
            kept.extend(tensors)
            answer = {"tensors": [{"data_ptr": t.data_ptr(),
                                   "nbytes": t.untyped_storage().nbytes()} for t in tensors]}
            del tensors  # only `kept` holds them, so "free" really frees them
        elif op == "alloc_threads":
            kept.extend(allocate_on_devices_from_threads(command["devices"], command["count"],
                                                         command["step_bytes"]))
            torch.cuda.synchronize()
            answer = {"reserved_by_device": {str(device): torch.cuda.memory_reserved(device)
                                             for device in command["devices"]}}
        elif op == "leak":
            leak_one_per_step(command["steps"], command["size_bytes"])
            answer = {"kept": len(kept)}
        elif op == "churn":
            churn(command["steps"], command["size_bytes"])
            answer = {}
        elif op == "free":
            kept.clear()
            torch.cuda.synchronize()
            if command.get("empty_cache"):
                torch.cuda.empty_cache()
            answer = {}
        elif op == "oom":
            try:
                allocate_too_much(command["size_bytes"])
                answer = {"oom": False}
            except torch.OutOfMemoryError:
                answer = {"oom": True}
        elif op == "pairs":
            answer = {"ns_per_pair": malloc_free_pairs(command["count"], command.get("depth", 0))}
        elif op == "blocks":
            tensors = allocate_blocks(command["count"])
            # every third freed again: holes between live blocks, cached for reuse
            live = [tensor for index, tensor in enumerate(tensors) if index % 3 != 1]
            kept.extend(live)
            answer = {"live": [(t.data_ptr(), t.untyped_storage().nbytes()) for t in live],
                      "freed": len(tensors) - len(live)}
            del tensors, live
        elif op == "memory_snapshot":
            answer = memory_snapshot()
        elif op == "clone_leak":
            answer = clone_leak(command["steps"], command["interval_seconds"], command["keep_bytes"],
                                command["temporary_bytes"])
        elif op == "tensor_pairs":
            answer = {"ns_per_pair": tensor_pairs(command["count"], command.get("numel", 4096),
                                                  command.get("depth", 0))}
        elif op == "torch_hook":
            answer = torch_hook(command)
        elif op == "torch_hook_settings":
            answer = torch_hook_settings(command)
        elif op == "torch_hook_counts":
            hook_state["hook"].flush_now()
            answer = {"counts": hook_state["hook"].counts()}
        elif op in MODEL_OPS:
            answer = model_command(op, command)
        elif op == "exit":
            print(json.dumps({"bye": True}), flush=True)
            return
        else:
            answer = {"error": f"unknown op {op}"}
        answer.update(stats() if op != "init" else {})
        answer["op"] = op
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
