"""Target for stack_overhead.py: times stub cudaMalloc+cudaFree pairs at a given Python stack depth.

Runs under any CPython 3.10-3.15 (free-threaded too) with no imports beyond the standard library.
Usage: python3 stack_target.py /path/to/libcudart.so.12
Protocol (the manifest protocol of tests/integration/stubs/manifest.h, repeated): prints
`ready <pid>`; then for each stdin line `run FRAMES PAIRS` it calls cudaMalloc(1 MiB)+cudaFree
PAIRS times from a function FRAMES Python frames deep (counting every frame from <module> in),
timed with perf_counter_ns, and prints {"frames": F, "pairs": P, "ns_per_pair": X} then `done`.
Exits at EOF.
"""
import ctypes
import json
import os
import sys
import time

MiB = 1 << 20


def depth_here():
    """Python frames on this thread's stack, the caller's frame included."""
    frame, depth = sys._getframe(1), 0
    while frame is not None:
        depth += 1
        frame = frame.f_back
    return depth


def timed_pairs(runtime, pairs):
    pointer = ctypes.c_void_p()
    malloc, free = runtime.cudaMalloc, runtime.cudaFree
    start = time.perf_counter_ns()
    for _ in range(pairs):
        if malloc(ctypes.byref(pointer), MiB) != 0 or free(pointer) != 0:
            raise RuntimeError("a stub call failed")
    return time.perf_counter_ns() - start, depth_here()


def descend(runtime, frames, pairs):
    if depth_here() < frames:
        return descend(runtime, frames, pairs)
    return timed_pairs(runtime, pairs)


def main():
    runtime = ctypes.CDLL(sys.argv[1])  # loaded before `ready`: the tracer sees it mapped
    runtime.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
    runtime.cudaFree.argtypes = [ctypes.c_void_p]
    print(f"ready {os.getpid()}", flush=True)
    for line in sys.stdin:
        command, frames, pairs = line.split()
        assert command == "run", line
        # descend() runs at depth 2 (<module>, main); timed_pairs adds one frame at the bottom.
        elapsed_ns, depth = descend(runtime, int(frames) - 1, int(pairs))
        print(json.dumps({"frames": depth, "pairs": int(pairs),
                          "ns_per_pair": elapsed_ns / int(pairs)}), flush=True)
        print("done", flush=True)


if __name__ == "__main__":
    main()
