"""A Python target for tests/integration/test_python_threads.py: allocations from threads whose Python
thread state comes and goes, each printed with the stack it expects (as pytargets/alloc_target.py does).

    python thread_target.py LIBCUDART NATIVE_THREADS_SO --cases native,callback,churn,main

Cases (CALLS allocations each, their own size per case):
- native: a C thread calls cudaMalloc itself: it has no Python thread state, so no stack (expected null);
- callback: a C thread calls a Python function through ctypes CALLS times; ctypes makes it a thread state
  for each call and deletes it after, so each call's state is a new one;
- churn: CALLS Python threads, one after another, each allocates once and ends;
- main: the main thread allocates CALLS times, after all of that;
- beside_subinterpreter (3.14+): a subinterpreter is made (the newest interpreter, whose thread list is looked
  at first), then the main thread and a new thread allocate CALLS times each.
Protocol: `ready <pid>`, a line on stdin, one JSON line per call, `done`, then waits for stdin to close.
"""
import ctypes
import json
import os
import sys
import threading

CALLS = 23
KiB = 1024
CASES = ("native", "callback", "churn", "main", "beside_subinterpreter")


def size_of(case):
    return 4 * KiB * (CASES.index(case) + 1)


def snapshot(frame):
    stack = []
    while frame is not None:
        code = frame.f_code
        stack.append([getattr(code, "co_qualname", code.co_name), code.co_filename, frame.f_lineno])
        frame = frame.f_back
    return stack


def record(case, address, rc, expected):
    print(json.dumps({"case": case, "via": "CDLL", "address": address or 0, "size_bytes": size_of(case),
                      "rc": rc, "expected": expected}), flush=True)


def allocate(lib, case):
    p = ctypes.c_void_p(); expected = snapshot(sys._getframe()); rc = lib.cudaMalloc(ctypes.byref(p), size_of(case))  # noqa: E702,E501
    record(case, p.value, rc, expected)


def native(lib, helper):
    pointers = (ctypes.c_void_p * CALLS)()
    results = (ctypes.c_int * CALLS)()
    alloc = ctypes.cast(lib.cudaMalloc, ctypes.c_void_p)
    assert helper.alloc_in_native_thread(alloc, CALLS, ctypes.c_size_t(size_of("native")), pointers, results) == 0
    for pointer, rc in zip(pointers, results, strict=True):
        record("native", pointer, rc, None)


CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_int)


def callback(lib, helper):
    def called_back(index):
        allocate(lib, "callback")
    keep = CALLBACK(called_back)
    assert helper.call_back_in_native_thread(keep, CALLS) == 0


def churned(lib):
    allocate(lib, "churn")


def churn(lib, helper):
    for _ in range(CALLS):
        thread = threading.Thread(target=churned, args=(lib,))
        thread.start()
        thread.join()


def main_thread(lib, helper):
    for _ in range(CALLS):
        allocate(lib, "main")


def beside_subinterpreter(lib, helper):
    from concurrent import interpreters  # 3.14+

    subinterpreter = interpreters.create()
    try:
        subinterpreter.exec("import ctypes")
        for _ in range(CALLS):
            allocate(lib, "beside_subinterpreter")
        thread = threading.Thread(target=lambda: [allocate(lib, "beside_subinterpreter") for _ in range(CALLS)])
        thread.start()
        thread.join()
    finally:
        subinterpreter.close()


def main(argv):
    lib = ctypes.CDLL(argv[1])
    helper = ctypes.CDLL(argv[2])
    helper.alloc_in_native_thread.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t,
                                              ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int)]
    cases = argv[argv.index("--cases") + 1].split(",") if "--cases" in argv else list(CASES)
    print(f"ready {os.getpid()}", flush=True)
    sys.stdin.readline()
    run = {"native": native, "callback": callback, "churn": churn, "main": main_thread,
           "beside_subinterpreter": beside_subinterpreter}
    for case in cases:
        run[case](lib, helper)
    print("done", flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    main(sys.argv)
