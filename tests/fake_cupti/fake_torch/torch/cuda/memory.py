"""torch.cuda.memory binds `_lazy_init` by name when torch.cuda is imported, as the real one does."""
from torch.cuda import _driver, _lazy_init


def caching_allocator_alloc(size_bytes: int) -> int:
    _lazy_init()
    return _driver().fake_mem_alloc(size_bytes)
