"""A Python target for the stack tests (tests/integration/test_python_stacks.py): calls the stub
cudaMalloc from known Python call sites and prints, for each call, the stack it expects the tracer
to report.

    python alloc_target.py LIBCUDART [--cases a,b,...] [--then c,d,...] [--exit]

Protocol (as the C workloads, stubs/manifest.h): loads LIBCUDART, prints `ready <pid>`, waits for
a line on stdin, makes its calls (every case of CASES, or those of --cases), printing one JSON line
per call:
    {"case", "via", "address", "size_bytes", "rc", "expected"}
then `done`. With --then it waits for another line and runs a second batch the same way (through
the same lines, so a case repeated there has the same stack), then `done` again. Then it waits for
stdin to close, or with --exit it exits at once.

`via` is "CDLL" (ctypes releases the GIL around the call) or "PyDLL" (the GIL stays held).
`expected` is the stack from sys._getframe, innermost first, as [function, file, line]: function is
co_qualname on 3.11+ and co_name on 3.10 (which has no qualname). It is taken on the same source
line as the cudaMalloc call, so the innermost line is the call's line. Every (case, via) has its
own size, and the stub gives every call its own address, so events can be matched to calls.

No imports beyond the standard library; runs on 3.6+ (3.9 is the unsupported-version target).
"""
import ctypes
import json
import os
import sys
import threading

QUALNAME = sys.version_info >= (3, 11)
KiB = 1024

DEEP_RECURSION = 80  # more than the probe's 64-frame limit
# deep(n) makes a stack of n + 4 frames (n + 1 deep, run_case, main, <module>): exactly the limit,
# and one frame more
AT_LIMIT = 60
OVER_LIMIT_BY_ONE = 61
RECURSION = 5
C_RECURSION = 40  # levels of Python -> C -> Python (each one an entry/shim frame on 3.12+)
STEADY_CALLS = 50

CASES = ("recursion", "method", "generator", "thread", "non_ascii", "deep", "c_recursion",
         "steady", "at_limit", "over_limit_by_one", "same_inner_frames")
VIAS = ("CDLL", "PyDLL")


def size_of(case, via):
    """A distinct size per (case, via): 4 KiB * (16 * case index + via index + 1)."""
    return 4 * KiB * (16 * CASES.index(case) + VIAS.index(via) + 1)


def snapshot(frame):
    stack = []
    while frame is not None:
        code = frame.f_code
        stack.append([code.co_qualname if QUALNAME else code.co_name, code.co_filename,
                      frame.f_lineno])
        frame = frame.f_back
    return stack


def record(case, via, pointer, size_bytes, rc, expected):
    print(json.dumps({"case": case, "via": via, "address": pointer.value or 0,
                      "size_bytes": size_bytes, "rc": rc, "expected": expected}), flush=True)


# ---- call sites: `expected = snapshot(...)` and the call share one line ----

def recurse(n, lib, case, via, size):
    if n == 0:
        p = ctypes.c_void_p(); expected = snapshot(sys._getframe()); rc = lib.cudaMalloc(ctypes.byref(p), size)  # noqa: E702,E501
        record(case, via, p, size, rc, expected)
        return
    recurse(n - 1, lib, case, via, size)


class Allocator:
    def method(self, lib, case, via, size):
        p = ctypes.c_void_p(); expected = snapshot(sys._getframe()); rc = lib.cudaMalloc(ctypes.byref(p), size)  # noqa: E702,E501
        record(case, via, p, size, rc, expected)


def generator(lib, case, via, size):
    p = ctypes.c_void_p(); expected = snapshot(sys._getframe()); rc = lib.cudaMalloc(ctypes.byref(p), size)  # noqa: E702,E501
    yield p, expected, rc


def run_generator(lib, case, via, size):
    for p, expected, rc in generator(lib, case, via, size):
        record(case, via, p, size, rc, expected)


def worker(lib, case, via, size):
    p = ctypes.c_void_p(); expected = snapshot(sys._getframe()); rc = lib.cudaMalloc(ctypes.byref(p), size)  # noqa: E702,E501
    record(case, via, p, size, rc, expected)


def run_thread(lib, case, via, size):
    thread = threading.Thread(target=worker, args=(lib, case, via, size), name="alloc-worker")
    thread.start()
    thread.join()


# Latin-1 (1 byte a character, not ASCII), BMP (2 bytes) and astral (4 bytes) names: the three
# non-ASCII layouts of a compact str.
def 分配(lib, case, via, size):
    p = ctypes.c_void_p(); expected = snapshot(sys._getframe()); rc = lib.cudaMalloc(ctypes.byref(p), size)  # noqa: E702,E501
    record(case, via, p, size, rc, expected)


def 𠀋(lib, case, via, size):
    分配(lib, case, via, size)


def größe(lib, case, via, size):
    𠀋(lib, case, via, size)


def deep(n, lib, case, via, size):
    if n == 0:
        p = ctypes.c_void_p(); expected = snapshot(sys._getframe()); rc = lib.cudaMalloc(ctypes.byref(p), size)  # noqa: E702,E501
        record(case, via, p, size, rc, expected)
        return
    deep(n - 1, lib, case, via, size)


class Layer:
    """Called as an object: every level goes Python -> C (tp_call) -> Python, like nn.Module."""

    def __call__(self, n, lib, case, via, size):
        if n == 0:
            p = ctypes.c_void_p(); expected = snapshot(sys._getframe()); rc = lib.cudaMalloc(ctypes.byref(p), size)  # noqa: E702,E501
            record(case, via, p, size, rc, expected)
            return
        self(n - 1, lib, case, via, size)


def steady(lib, case, via, size):
    for _ in range(STEADY_CALLS):
        p = ctypes.c_void_p(); expected = snapshot(sys._getframe()); rc = lib.cudaMalloc(ctypes.byref(p), size)  # noqa: E702,E501
        record(case, via, p, size, rc, expected)


# The same innermost frames under another outer line: on 3.11+ frames live in a per-thread data
# stack, so the second call puts alloc_inner and alloc_middle at the same addresses, with the same
# code and instruction, as the first; only alloc_outer's line tells the two stacks apart.
def alloc_inner(lib, case, via, size):
    p = ctypes.c_void_p(); expected = snapshot(sys._getframe()); rc = lib.cudaMalloc(ctypes.byref(p), size)  # noqa: E702,E501
    record(case, via, p, size, rc, expected)


def alloc_middle(lib, case, via, size):
    alloc_inner(lib, case, via, size)


def alloc_outer(lib, case, via, size):
    alloc_middle(lib, case, via, size)  # first line
    alloc_middle(lib, case, via, size)  # second line


def run_case(case, lib, via):
    size = size_of(case, via)
    if case == "recursion":
        recurse(RECURSION, lib, case, via, size)
    elif case == "method":
        Allocator().method(lib, case, via, size)
    elif case == "generator":
        run_generator(lib, case, via, size)
    elif case == "thread":
        run_thread(lib, case, via, size)
    elif case == "non_ascii":
        größe(lib, case, via, size)
    elif case == "deep":
        deep(DEEP_RECURSION, lib, case, via, size)
    elif case == "at_limit":
        deep(AT_LIMIT, lib, case, via, size)
    elif case == "over_limit_by_one":
        deep(OVER_LIMIT_BY_ONE, lib, case, via, size)
    elif case == "c_recursion":
        Layer()(C_RECURSION, lib, case, via, size)
    elif case == "steady":
        steady(lib, case, via, size)
    elif case == "same_inner_frames":
        alloc_outer(lib, case, via, size)
    else:
        raise SystemExit(f"unknown case {case!r}")


def load(path):
    libraries = {"CDLL": ctypes.CDLL(path), "PyDLL": ctypes.PyDLL(path)}
    for lib in libraries.values():
        lib.cudaMalloc.argtypes = (ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t)
        lib.cudaMalloc.restype = ctypes.c_int
    return libraries


def main(argv):
    path = argv[1]
    exit_after_done = "--exit" in argv
    batches = [list(CASES)]
    if "--cases" in argv:
        batches = [argv[argv.index("--cases") + 1].split(",")]
    if "--then" in argv:
        batches.append(argv[argv.index("--then") + 1].split(","))
    libraries = load(path)
    print(f"ready {os.getpid()}", flush=True)
    for batch in batches:  # every batch runs through the same lines: equal stacks for a case
        sys.stdin.readline()
        for case in batch:
            for via in VIAS:
                run_case(case, libraries[via], via)
        print("done", flush=True)
    if not exit_after_done:
        sys.stdin.read()


if __name__ == "__main__":
    main(sys.argv)
