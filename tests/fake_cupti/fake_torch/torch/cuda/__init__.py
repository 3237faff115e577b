"""torch.cuda: `_lazy_init` initialises CUDA once (here: one driver allocation through the fake CUPTI,
as a context's start-up makes). torch's C++ calls it through this module's attribute before anything
touches the GPU; `empty` does what `torch.empty(n, device="cuda")` does."""
import sys

_initialized = False
init_count = 0  # how many times the real initialisation ran


def is_initialized() -> bool:
    return _initialized


def _lazy_init() -> None:
    global _initialized, init_count
    if _initialized:
        return
    _initialized = True
    init_count += 1
    _driver().fake_mem_alloc(2 << 20)


def empty(size_bytes: int) -> int:
    """An allocation as torch's C++ makes it: `torch.cuda._lazy_init` looked up on the module, then the driver."""
    sys.modules["torch.cuda"]._lazy_init()
    return _driver().fake_mem_alloc(size_bytes)


def _driver():
    from cupti import cupti

    return cupti


from torch.cuda import memory  # noqa: E402,F401  (as torch does: its submodules bind _lazy_init by name)
