"""Integration tests: the real probes (root + bcc) against C stub CUDA libraries and the real
libcudart wheel. Skipped, with the reason, where this machine cannot load BPF.

One tracer serves the whole session (compiling and attaching cost seconds); each test follows its
own workload's pid and looks only at that pid.
"""
import pytest

from cuda_stubs import stub_build  # noqa: F401  (session fixture)
from harness import TracingHarness, require_tracing_here
from torch_stubs import torch_stub_build  # noqa: F401  (session fixture)


@pytest.fixture(scope="session")
def session_tracer(stub_build):
    require_tracing_here()
    harness = TracingHarness(only_selected=True, preattach_globs=(str(stub_build.lib_dir / "*.so.*"),))
    yield harness
    harness.close()


@pytest.fixture
def trace(session_tracer):
    """trace(pid) -> the session's TracingHarness, now also following that pid."""

    def follow(*pids):
        for pid in pids:
            session_tracer.source.follow(pid)
        return session_tracer

    return follow


@pytest.fixture
def bpf_here():
    """For the tests that run an agent process of their own: BPF and bcc here, or skipped with the reason."""
    require_tracing_here()


@pytest.fixture
def bpf_here_unshared():
    """For the few tests that need a tracer of their own (other map sizes)."""
    require_tracing_here()
