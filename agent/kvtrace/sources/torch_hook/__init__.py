"""The hook inside a PyTorch process (hook.cpp): built against that process's own torch, loaded, attached.

Why it exists: at depth `blocks` a uprobe trap on every pytorch:malloc/free costs more than issue 34's 3 % of a
generation loop on its own (bench/RESULTS.md §K). The hook hears the caching allocator's blocks from its trace
tracker and hands them to the kernel in batches, through one USDT site the agent's uprobe sits on
(`kvtrace:blocks`), so that a block costs a call, not two traps. hook.cpp says how.

Like bcc compiling the probes on the host against the host's kernel, the hook is compiled on the host against the
engine's torch (its headers and libc10_cuda.so), once per torch build and hook source, into a cache directory:
PyTorch's C++ classes have no stable ABI across versions. It needs a C++ compiler (g++) and the CUDA runtime
headers (torch's CUDA headers include cuda_runtime_api.h).

Standard library only: this runs inside the engine. The caller passes what it knows of torch (`TorchBuild`).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).with_name("hook.cpp")
LIBRARY_PREFIX = "libkvtrace_torch_hook"
# The symbol of the settings the hook reads at each event (hook.cpp). Its probe site, kvtrace:blocks, is the agent's
# to find (sources/bpf/hook_settings.py probe_site).
SETTINGS_SYMBOL = "kvtrace_hook_settings_now"
# A CUDA toolkit's headers where no CUDA_HOME says otherwise.
SYSTEM_CUDA_INCLUDE = Path("/usr/local/cuda/include")
BATCH_MAX = 32  # hook.cpp KVTRACE_HOOK_BATCH_MAX = probes/hook.h KVT_HOOK_BATCH


class HookBuildError(RuntimeError):
    """The hook could not be built or loaded; the message names the fix."""


@dataclass(frozen=True)
class TorchBuild:
    """What the compiler needs to know of the torch it builds against."""

    version: str  # torch.__version__, e.g. "2.11.0+cu130"
    directory: Path  # the torch package: include/ and lib/ under it
    cxx11_abi: bool  # torch.compiled_with_cxx11_abi()

    @classmethod
    def of_imported_torch(cls) -> TorchBuild:
        """The torch this interpreter imported (the caller has imported it; this only reads it)."""
        import sys

        torch = sys.modules.get("torch")
        if torch is None:
            raise HookBuildError("torch is not imported in this process: the hook is built for the torch it uses")
        return cls(str(torch.__version__), Path(str(torch.__file__)).parent, bool(torch.compiled_with_cxx11_abi()))


class HookSettings(ctypes.Structure):
    """hook.cpp's struct kvtrace_hook_settings (kvtrace_hook_settings_now)."""

    _fields_ = [("sample_bytes", ctypes.c_uint64), ("batch", ctypes.c_uint32), ("flush_interval_ms", ctypes.c_uint32)]


class HookCounts(ctypes.Structure):
    """hook.cpp's struct kvtrace_hook_counts."""

    _fields_ = [("events", ctypes.c_uint64), ("entries", ctypes.c_uint64), ("flushes", ctypes.c_uint64),
                ("walks", ctypes.c_uint64), ("dropped", ctypes.c_uint64)]

    def as_dict(self) -> dict[str, int]:
        return {field[0]: int(getattr(self, field[0])) for field in self._fields_}


def cuda_include_dirs(torch: TorchBuild) -> list[Path]:
    """Where cuda_runtime_api.h may be: $CUDA_HOME, /usr/local/cuda, and the NVIDIA wheels beside torch."""
    candidates = [Path(os.environ[name]) / "include" for name in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(name)]
    candidates.append(SYSTEM_CUDA_INCLUDE)
    nvidia = torch.directory.parent / "nvidia"
    if nvidia.is_dir():
        candidates += sorted(nvidia.glob("*/include"))
    return [path for path in candidates if (path / "cuda_runtime_api.h").is_file()]


def library_name(torch: TorchBuild) -> str:
    """The cached library's file name: one per torch build and hook source."""
    sources = b"".join(SOURCE.with_name(name).read_bytes() for name in (SOURCE.name, "sdt.h", "sdt-config.h"))
    digest = hashlib.sha256(sources + f"{torch.version} {torch.cxx11_abi}".encode()).hexdigest()[:16]
    return f"{LIBRARY_PREFIX}-{digest}.so"


def compile_command(torch: TorchBuild, output: Path, compiler: str = "g++") -> list[str]:
    cuda = cuda_include_dirs(torch)
    if not cuda:
        raise HookBuildError(
            "no cuda_runtime_api.h for the hook's build: set CUDA_HOME to a CUDA toolkit, or install the "
            f"nvidia-cuda-runtime wheel of torch {torch.version}'s CUDA beside torch")
    lib = torch.directory / "lib"
    return [compiler, "-O2", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.cxx11_abi)}", "-iquote", str(SOURCE.parent),
            "-isystem", str(torch.directory / "include"),
            *[arg for path in cuda for arg in ("-isystem", str(path))],
            str(SOURCE), "-o", str(output),
            f"-L{lib}", f"-Wl,-rpath,{lib}", "-lc10_cuda", "-lc10", "-pthread"]


def build(torch: TorchBuild, cache_dir: Path, compiler: str = "g++") -> Path:
    """The hook's library for `torch`, compiled into `cache_dir` unless it is there already (seconds once)."""
    target = cache_dir / library_name(torch)
    if target.is_file():
        return target
    if shutil.which(compiler) is None:
        raise HookBuildError(f"no C++ compiler {compiler!r} to build kvtrace's PyTorch hook: install g++ "
                             "(apt-get install g++), or leave depth blocks to the uprobes (no hook)")
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as scratch:
        output = Path(scratch) / target.name
        done = subprocess.run(compile_command(torch, output, compiler), capture_output=True, text=True)
        if done.returncode != 0:
            raise HookBuildError(f"building kvtrace's PyTorch hook against torch {torch.version} failed "
                                 f"({compiler} exit {done.returncode}):\n{done.stderr[-2000:]}")
        os.replace(output, target)  # whole or not at all: another process may be building the same
    return target


class Hook:
    """The hook loaded into this process (ctypes), attached to the caching allocator by attach()."""

    def __init__(self, path: Path) -> None:
        try:
            self.library = ctypes.CDLL(str(path))
        except OSError as error:
            raise HookBuildError(f"loading kvtrace's PyTorch hook {path} failed: {error} "
                                 "(built for another torch? remove it and build again)") from error
        self.path = path
        self.library.kvtrace_hook_attach.restype = ctypes.c_int
        self.library.kvtrace_hook_arm.restype = ctypes.c_int
        self.library.kvtrace_hook_attached.restype = ctypes.c_int
        self.library.kvtrace_hook_read_counts.argtypes = [ctypes.POINTER(HookCounts)]

    def attach(self) -> None:
        """Registers the tracker (for the life of the process: the allocator cannot detach one)."""
        if self.library.kvtrace_hook_attach() != 0:
            raise HookBuildError("PyTorch's CUDA caching allocator refused the trace tracker: initialise CUDA "
                                 "first (torch.cuda.init()), and use the native allocator (not cudaMallocAsync)")

    def arm(self) -> None:
        """Attaches the tracker once the agent first raises this process (and CUDA is initialised): a process
        never raised pays nothing (hook.cpp kvtrace_hook_arm)."""
        self.library.kvtrace_hook_arm()

    def arm_again_after_fork(self) -> None:
        """In a forked child: the parent's watcher thread did not come along; a new one, unless attached."""
        self.library.kvtrace_hook_rearm_after_fork()

    @property
    def attached(self) -> bool:
        return bool(self.library.kvtrace_hook_attached())

    def settings(self) -> HookSettings:
        """The settings the hook reads at each event, in place (writes take effect at the next event)."""
        return HookSettings.in_dll(self.library, SETTINGS_SYMBOL)

    def counts(self) -> dict[str, int]:
        counts = HookCounts()
        self.library.kvtrace_hook_read_counts(ctypes.byref(counts))
        return counts.as_dict()

    def flush_now(self) -> None:
        self.library.kvtrace_hook_flush_now()


# Where engines build the hook (one library per torch build and hook source), unless KVTRACE_TORCH_HOOK_CACHE says.
CACHE_ENV = "KVTRACE_TORCH_HOOK_CACHE"
DEFAULT_CACHE_DIR = Path("/var/cache/kvtrace/torch-hook")


def arm_in_this_process() -> Hook:
    """Builds the hook for the torch this process imported (or finds it built), loads it and arms it: what an
    in-process part of kvtrace (the vLLM plugin under KVTRACE_TORCH_HOOK=1) calls. Raises HookBuildError."""
    cache = Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE_DIR)
    hook = Hook(build(TorchBuild.of_imported_torch(), cache))
    hook.arm()
    return hook
