"""A CPython target for kvtrace's PyTorch hook: loads the fake torch's libc10_cuda.so (argv[1]) and the hook built
against it (argv[2]) with ctypes, attaches the hook, and makes BLOCKS blocks of SIZE_BYTES from one line, several
frames deep, keeping them (tests/integration/test_torch_hook.py). With argv[3], the stub allocator's libc10_cuda.so
(tests/integration/stubs/c10_cuda_stub.c, with PyTorch's own pytorch:malloc/free probe sites) is loaded too and makes
5 blocks of its own; the last JSON line then says its malloc semaphore: whether anything linked PyTorch's own sites.

Protocol: `ready <pid>`, waits for a line, then one JSON line per block ({"address", "size_bytes", "expected":
[[function, file, line], ...] innermost first}), `done`, and waits for a line (or EOF) before it exits."""
import ctypes
import json
import os
import sys

from block_target import stack_here  # beside this file: the same frames, the same way

BLOCKS = 20
SIZE_BYTES = 4096
ALLOC = 0  # TraceEntry::ALLOC


def allocate(allocator, first_address):
    made = []
    for index in range(BLOCKS):
        address = first_address + index * SIZE_BYTES
        expected = stack_here(sys._getframe()); allocator.fake_allocator_event(ALLOC, address, SIZE_BYTES, 1, 7)  # noqa: E702
        made.append({"address": address, "size_bytes": SIZE_BYTES, "expected": expected})
    return made


def middle(allocator):
    return allocate(allocator, 0x7e0000000000)


def main():
    allocator = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
    allocator.fake_allocator_event.argtypes = [ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int,
                                               ctypes.c_uint64]
    hook = ctypes.CDLL(sys.argv[2])  # its libc10_cuda.so is the fake one, loaded first (by soname)
    if hook.kvtrace_hook_attach() != 0:
        sys.exit("the hook did not attach")
    stub = None
    if len(sys.argv) > 3:  # mapped before `ready`: the agent sees both libraries from its first scan
        stub = ctypes.CDLL(sys.argv[3])
        stub.c10_stub_malloc.restype = ctypes.c_void_p
        stub.c10_stub_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_long]
    print(f"ready {os.getpid()}", flush=True)
    sys.stdin.readline()
    for block in middle(allocator):
        print(json.dumps(block))
    if stub is not None:
        for _ in range(5):
            stub.c10_stub_malloc(SIZE_BYTES, 0, 0)
        print(json.dumps({"stub_semaphore": stub.c10_stub_semaphore_value()}))
    print("done", flush=True)
    sys.stdin.readline()


if __name__ == "__main__":
    main()
