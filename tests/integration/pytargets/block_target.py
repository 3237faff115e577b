"""A CPython target for the block walk: loads the stub libc10_cuda.so (argv[1]) with ctypes and makes
BLOCKS PyTorch blocks from one line, several frames deep, keeping them. With argv[2], a list such as
"4000x16384,5x262144", it makes those blocks instead (COUNT of SIZE bytes each, in an order shuffled
with a fixed seed), from the same line.

Protocol (tests/integration/stubs/manifest.h): `ready <pid>`, waits for a line, then one JSON line per
block ({"address", "size_bytes", "expected": [[function, file, line], ...] innermost first}), `done`,
and waits for a line (or EOF) before it exits."""
import ctypes
import json
import random
import sys

BLOCKS = 20
SIZE_BYTES = 4096


def stack_here(frame):
    stack = []
    while frame is not None:
        stack.append([frame.f_code.co_qualname if hasattr(frame.f_code, "co_qualname") else frame.f_code.co_name,
                      frame.f_code.co_filename, frame.f_lineno])
        frame = frame.f_back
    return stack


def allocate(lib, sizes):
    made = []
    for size in sizes:
        expected = stack_here(sys._getframe()); address = lib.c10_stub_malloc(size, 0, 0)  # noqa: E702
        made.append({"address": address, "size_bytes": size, "expected": expected})
    return made


def middle(lib, sizes):
    return allocate(lib, sizes)


def sizes_wanted():
    if len(sys.argv) < 3:
        return [SIZE_BYTES] * BLOCKS
    sizes = []
    for part in sys.argv[2].split(","):
        count, size = part.split("x")
        sizes += [int(size)] * int(count)
    random.Random(7).shuffle(sizes)
    return sizes


def main():
    lib = ctypes.CDLL(sys.argv[1])
    lib.c10_stub_malloc.restype = ctypes.c_void_p
    lib.c10_stub_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_long]
    print(f"ready {__import__('os').getpid()}", flush=True)
    sys.stdin.readline()
    sizes = sizes_wanted()
    for block in middle(lib, sizes):
        print(json.dumps(block))
    print("done", flush=True)
    sys.stdin.readline()


if __name__ == "__main__":
    main()
