"""torch.autograd.profiler: the flag torch sets while a profiler (Kineto, holding CUPTI) runs."""
_is_profiler_enabled: bool = False


def _set_is_profiler_enabled(enable: bool) -> None:
    global _is_profiler_enabled
    _is_profiler_enabled = enable


class profile:  # noqa: N801 (torch's name)
    """torch.autograd.profiler.profile: Kineto takes CUPTI in _prepare_trace (fake: records that it ran)."""

    prepared = 0
    starts_cuda = False  # Kineto may initialise CUDA while it takes CUPTI

    def _prepare_trace(self) -> None:
        type(self).prepared += 1
        if self.starts_cuda:
            from torch import cuda

            cuda._lazy_init()
