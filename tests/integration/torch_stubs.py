"""Builds the stub PyTorch caching allocator (stubs/c10_cuda_stub.c as libc10_cuda.so, with
USDT probes pytorch:malloc and pytorch:free guarded by semaphores, as torch 2.11 has them) and
the torch workload (stubs/torch_workload.c) on top of the stub CUDA libraries from cuda_stubs:

    cuda = build_stubs(tmp_path)
    torch = build_torch_stub(tmp_path, cuda)
    with Workload([torch.workload, "blocks"]) as workload:
        workload.wait_ready()
        ...attach to torch.libc10_cuda's USDT probes, follow workload.pid...
        workload.go()
        manifest = workload.read_calls()   # semaphores, blocks, segments (torch_workload.c)

The probes come from the vendored <sys/sdt.h> (agent/kvtrace/sources/torch_hook/sdt.h, systemtap 4.8, CC0, with
its sdt-config.h; kvtrace's PyTorch hook is built with it too), so no systemtap-sdt-dev package is needed here or in
CI.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from cuda_stubs import _CFLAGS, STUBS_DIR, StubBuild, _gcc

# The vendored <sys/sdt.h> and its sdt-config.h, shipped with kvtrace's PyTorch hook.
SDT_DIR = Path(__file__).resolve().parents[2] / "agent" / "kvtrace" / "sources" / "torch_hook"

# The library: -O2 -fno-omit-frame-pointer gives the probe arguments torch's shapes (registers,
# and the stream id in %rbp-relative memory; at -O0 gcc loads it into a register). -fno-ipa-icf:
# c10_stub_free and c10_stub_raw_delete are identical functions, and folding one into the other
# would leave one free site where torch has two.
_LIBRARY_CFLAGS = ("-std=gnu11", "-O2", "-fno-omit-frame-pointer", "-fno-ipa-icf", "-g", "-Wall",
                   "-Wextra", "-pthread", f"-I{STUBS_DIR}", f"-I{SDT_DIR}")


# What the `blocks` scenario does (torch_workload.c): exact counts for the tests.
BLOCKS_DEVICE0_MALLOCS, BLOCKS_DEVICE0_FREES = 23, 7
BLOCKS_DEVICE1_MALLOCS, BLOCKS_DEVICE1_FREES = 5, 2
BLOCKS_SEGMENTS = 9  # cudaMalloc calls the allocator makes; it never frees one
# Probe sites in libc10_cuda.so: malloc in c10_stub_malloc, free in c10_stub_free and
# c10_stub_raw_delete (torch 2.11 has the same counts).
PROBE_SITES = {"malloc": 1, "free": 2}


@dataclass(frozen=True)
class TorchStubBuild:
    lib_dir: Path       # libc10_cuda.so
    libc10_cuda: Path
    workload: Path      # links libc10_cuda.so and the CUDA stubs (RUNPATH both lib dirs)
    cuda: StubBuild


def build_torch_stub(out_dir: Path, cuda_build: StubBuild) -> TorchStubBuild:
    """Compiles libc10_cuda.so into out_dir/torch/lib and torch_workload into out_dir/torch/bin."""
    root = Path(out_dir) / "torch"
    lib_dir, bin_dir, include_dir = root / "lib", root / "bin", root / "include"
    for directory in (lib_dir, bin_dir, include_dir):
        directory.mkdir(parents=True, exist_ok=True)

    libc10_cuda = lib_dir / "libc10_cuda.so"
    _gcc(*_LIBRARY_CFLAGS, f"-I{include_dir}", "-shared", "-fPIC", "-Wl,-soname,libc10_cuda.so",
         "-o", libc10_cuda, STUBS_DIR / "c10_cuda_stub.c", f"-L{cuda_build.lib_dir}",
         "-l:libcudart.so.12", f"-Wl,-rpath,{cuda_build.lib_dir}")

    workload = bin_dir / "torch_workload"  # built as cuda_stubs builds its programs (-O0: real calls)
    _gcc(*_CFLAGS, "-o", workload, STUBS_DIR / "torch_workload.c", f"-L{lib_dir}",
         "-l:libc10_cuda.so", f"-L{cuda_build.lib_dir}", "-l:libcudart.so.12", "-l:libcuda.so.1",
         f"-Wl,-rpath,{lib_dir}:{cuda_build.lib_dir}")
    return TorchStubBuild(lib_dir=lib_dir, libc10_cuda=libc10_cuda, workload=workload,
                          cuda=cuda_build)


@pytest.fixture(scope="session")
def torch_stub_build(stub_build: StubBuild,
                     tmp_path_factory: pytest.TempPathFactory) -> TorchStubBuild:
    """The PyTorch stub, built once per session on the session's CUDA stubs (import this fixture
    together with cuda_stubs.stub_build)."""
    return build_torch_stub(tmp_path_factory.mktemp("torch_stub"), stub_build)
