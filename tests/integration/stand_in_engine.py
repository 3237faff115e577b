"""The start of a stand-in vLLM engine for the integration tests that run one (test_vllm_agent.py,
test_shares_senders.py): a Python program titled `VLLM::EngineCore` as setproctitle titles vLLM's engine, with
`malloc(size)` through the stub libcudart given as its first argument. Each test adds what its engine does."""
import textwrap

ENGINE_PRELUDE = textwrap.dedent("""
    import ctypes, json, socket, sys

    def set_title(title):  # what setproctitle does on Linux: the argv area and comm
        fields = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
        arg_start, arg_end = int(fields[45]), int(fields[46])
        data = title.encode()[:arg_end - arg_start - 1]
        ctypes.memmove(arg_start, data.ljust(arg_end - arg_start, b"\\0"), arg_end - arg_start)
        ctypes.CDLL(None).prctl(15, ctypes.c_char_p(title.encode()[:15]), 0, 0, 0)

    set_title("VLLM::EngineCore")
    cudart = ctypes.CDLL(sys.argv[1])
    kept = []

    def malloc(size):
        pointer = ctypes.c_void_p()
        assert cudart.cudaMalloc(ctypes.byref(pointer), ctypes.c_size_t(size)) == 0
        kept.append(pointer)
        return pointer.value
""")
