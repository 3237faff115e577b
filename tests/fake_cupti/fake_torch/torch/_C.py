"""torch._C: only what kvtrace's tracer asks of it."""


def _cuda_isHistoryEnabled() -> bool:  # noqa: N802 (torch's name)
    from torch.cuda import memory

    return memory.recording is not None
