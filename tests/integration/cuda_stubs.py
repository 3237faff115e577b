"""Builds the stub CUDA libraries and workloads in tests/integration/stubs, and drives a workload.

No GPU here: libcuda.so.1 and libcudart.so.12 are small C stubs with the real signatures, and the
workloads make a known set of calls and print it (the manifest, format in stubs/manifest.h), so a
test can attach the tracer between `ready` and go and compare what it saw with what was done:

    build = build_stubs(tmp_path)
    with Workload([build.workload, "counts"]) as workload:
        workload.wait_ready()
        ...attach to workload.pid...
        workload.go()
        calls = workload.read_calls()
        ...
        assert workload.finish() == 0
"""
from __future__ import annotations

import importlib.util
import json
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

STUBS_DIR = Path(__file__).resolve().parent / "stubs"

# -O0 -fno-inline -fno-optimize-sibling-calls: every API stays a real function entered by a call
# (no inlining, no tail jump), so entry and return probes fire once per call. -g: tests may
# symbolize caller addresses.
_CFLAGS = ("-std=gnu11", "-O0", "-fno-inline", "-fno-optimize-sibling-calls", "-g", "-Wall",
           "-Wextra", "-pthread", f"-I{STUBS_DIR}")

# What each fixed scenario's manifest holds: (api, rc) -> number of calls.
EXPECTED_CALLS: dict[str, Counter] = {
    "counts": Counter({
        ("cudaMalloc", 0): 23, ("cudaMalloc", 2): 3,
        ("cudaFree", 0): 19 + 1, ("cudaFree", 1): 2,  # 19 frees + cudaFree(NULL); 2 of 0xdead
        ("cudaMallocAsync", 0): 7, ("cudaFreeAsync", 0): 7,
        ("cuMemAlloc_v2", 0): 11, ("cuMemFree_v2", 0): 5,
        ("cudaMallocHost", 0): 5, ("cudaFreeHost", 0): 3,
        ("cudaMallocManaged", 0): 3, ("cudaMallocPitch", 0): 2,
    }),
    "devices": Counter({("cudaSetDevice", 0): 2, ("cudaSetDevice", 101): 1, ("cudaMalloc", 0): 10}),
    "vmm": Counter({
        ("cuMemAddressReserve", 0): 1, ("cuMemCreate", 0): 5, ("cuMemCreate", 2): 1,
        ("cuMemMap", 0): 5, ("cuMemRelease", 0): 3, ("cuMemUnmap", 0): 2,
    }),
    "context": Counter({
        ("cudaSetDevice", 0): 1, ("cudaMalloc", 0): 7, ("cuCtxCreate_v2", 0): 1,
        ("cuMemAlloc_v2", 0): 3, ("cuCtxDestroy_v2", 0): 1,
    }),
    "hold": Counter({("cudaMalloc", 0): 13}),
    "dlopen": Counter({("cudaMalloc", 0): 17}),
}

# What the driver stub sees for each scenario, the workload's own driver calls plus those the
# runtime stub makes inside runtime calls: (api, rc) -> number of calls. cudaFree(NULL) and
# cudaSetDevice(9) never reach the driver.
EXPECTED_DRIVER_CALLS: dict[str, Counter] = {
    "counts": Counter({
        ("cuMemAlloc_v2", 0): 23 + 11, ("cuMemAlloc_v2", 2): 3,
        ("cuMemFree_v2", 0): 19 + 5, ("cuMemFree_v2", 1): 2,
        ("cuMemAllocAsync", 0): 7, ("cuMemFreeAsync", 0): 7,
        ("cuMemAllocHost_v2", 0): 5, ("cuMemFreeHost", 0): 3,
        ("cuMemAllocManaged", 0): 3, ("cuMemAllocPitch_v2", 0): 2,
    }),
    "devices": Counter({
        ("cuDevicePrimaryCtxRetain", 0): 2, ("cuCtxSetCurrent", 0): 2, ("cuMemAlloc_v2", 0): 10,
    }),
    "vmm": EXPECTED_CALLS["vmm"],
    "context": Counter({
        ("cuDevicePrimaryCtxRetain", 0): 1, ("cuCtxSetCurrent", 0): 1,
        ("cuMemAlloc_v2", 0): 7 + 3, ("cuCtxCreate_v2", 0): 1, ("cuCtxDestroy_v2", 0): 1,
    }),
    "hold": Counter({("cuMemAlloc_v2", 0): 13}),
    "dlopen": Counter({("cuMemAlloc_v2", 0): 17}),
}


class StubBuildError(RuntimeError):
    """gcc failed; the message holds its command line and stderr."""


@dataclass(frozen=True)
class StubBuild:
    lib_dir: Path          # libcuda.so.1 and libcudart.so.12
    libcuda: Path
    libcudart: Path
    workload: Path         # links both libraries (DT_RPATH lib_dir)
    workload_static: Path  # both stubs compiled into the executable
    dlopen_workload: Path
    static_libc: bool      # False: no static libc here, workload_static links libc dynamically


_OLD_DTAGS = "-Wl,--disable-new-dtags"


def _gcc(*args: str | Path) -> None:
    command = ["gcc", *map(str, args)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise StubBuildError(f"{' '.join(command)}\nexited {result.returncode}:\n{result.stderr}")


def build_stubs(out_dir: Path) -> StubBuild:
    """Compiles the stubs and workloads into out_dir/lib and out_dir/bin."""
    if shutil.which("gcc") is None:
        raise StubBuildError("gcc not found on PATH: it is needed to build the CUDA stubs")
    lib_dir, bin_dir = Path(out_dir) / "lib", Path(out_dir) / "bin"
    lib_dir.mkdir(parents=True, exist_ok=True)
    bin_dir.mkdir(parents=True, exist_ok=True)
    src = STUBS_DIR
    libcuda, libcudart = lib_dir / "libcuda.so.1", lib_dir / "libcudart.so.12"

    _gcc(*_CFLAGS, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", libcuda, src / "cuda_stub.c")
    # -l:NAME links the versioned file itself, so no libcuda.so symlink is needed; $ORIGIN lets a
    # dlopen of libcudart by path find libcuda next to it. The search paths are DT_RPATH (old
    # dtags), which come before LD_LIBRARY_PATH: on a GPU host that names the real driver's
    # directory, DT_RUNPATH would load the real libcuda.so.1 under the stub runtime, and its
    # cuMemAlloc fails without a context.
    _gcc(*_CFLAGS, "-shared", "-fPIC", "-Wl,-soname,libcudart.so.12", "-o", libcudart,
         src / "cudart_stub.c", f"-L{lib_dir}", "-l:libcuda.so.1", "-Wl,-rpath,$ORIGIN", _OLD_DTAGS)

    workload = bin_dir / "workload"
    _gcc(*_CFLAGS, "-o", workload, src / "workload.c", f"-L{lib_dir}", "-l:libcudart.so.12",
         "-l:libcuda.so.1", f"-Wl,-rpath,{lib_dir}", _OLD_DTAGS)

    workload_static = bin_dir / "workload_static"
    static_sources = (src / "workload.c", src / "cudart_stub.c", src / "cuda_stub.c")
    try:
        _gcc(*_CFLAGS, "-static", "-o", workload_static, *static_sources)
        static_libc = True
    except StubBuildError:
        # Without a static libc the CUDA symbols still live in the executable, which is the point.
        _gcc(*_CFLAGS, "-o", workload_static, *static_sources)
        static_libc = False

    dlopen_workload = bin_dir / "dlopen_workload"
    _gcc(*_CFLAGS, "-o", dlopen_workload, src / "dlopen_workload.c", "-ldl")
    return StubBuild(lib_dir=lib_dir, libcuda=libcuda, libcudart=libcudart, workload=workload,
                     workload_static=workload_static, dlopen_workload=dlopen_workload,
                     static_libc=static_libc)


def build_stubs_for_anyone(out_dir: Path) -> StubBuild:
    """build_stubs into `out_dir`, readable and runnable by every user (an unprivileged attacker's
    processes load them: tests run them as nobody with setpriv)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    build = build_stubs(out_dir)
    for path in (out_dir, *out_dir.rglob("*")):
        path.chmod(0o755)
    return build


@pytest.fixture(scope="session")
def stub_build(tmp_path_factory: pytest.TempPathFactory) -> StubBuild:
    """The stubs, built once per session (import this fixture into a test module or conftest)."""
    return build_stubs(tmp_path_factory.mktemp("cuda_stubs"))


class WorkloadError(RuntimeError):
    """The workload broke the protocol, exited early or was too slow; says what it had printed."""


class Workload:
    """A running workload program (protocol in stubs/manifest.h). Use as a context manager: the
    process is killed on exit if it is still running."""

    def __init__(self, argv: Sequence[str | Path], env: Mapping[str, str] | None = None,
                 executable: str | Path | None = None):
        """`executable`: the program to run when argv[0] is not its path (a crafted title)."""
        self.argv = [str(arg) for arg in argv]
        self._stderr = tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen(self.argv, executable=executable, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self._stderr, text=True, env=env)
        # A reader thread, so that waiting for a line can time out (a plain readline cannot).
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._seen: list[str] = []
        self._reader = threading.Thread(target=self._read_stdout, daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.process.pid

    def _read_stdout(self) -> None:
        for line in self.process.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)  # EOF

    def stderr_text(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read()

    def _error(self, what: str) -> WorkloadError:
        seen = "\n".join(self._seen[-50:]) or "(nothing)"
        return WorkloadError(f"{' '.join(self.argv)} (pid {self.pid}, exit status "
                             f"{self.process.poll()}): {what}\nstdout so far:\n{seen}\n"
                             f"stderr:\n{self.stderr_text()}")

    def _next_line(self, deadline: float, timeout_s: float) -> str:
        try:
            line = self._lines.get(timeout=max(deadline - time.monotonic(), 0))
        except queue.Empty:
            raise self._error(f"no line within {timeout_s} s") from None
        if line is None:
            self._lines.put(None)  # later reads see EOF too
            raise self._error("stdout closed")
        self._seen.append(line)
        return line

    def wait_ready(self, timeout_s: float = 30.0) -> int:
        """Waits for `ready <pid>`; returns the pid."""
        line = self._next_line(time.monotonic() + timeout_s, timeout_s)
        if line != f"ready {self.pid}":
            raise self._error(f"expected 'ready {self.pid}', got {line!r}")
        return self.pid

    def expect_line(self, expected: str, timeout_s: float = 30.0) -> None:
        """Waits for one exact line (e.g. `loaded` from dlopen_workload)."""
        line = self._next_line(time.monotonic() + timeout_s, timeout_s)
        if line != expected:
            raise self._error(f"expected {expected!r}, got {line!r}")

    def go(self) -> None:
        """Lets the workload run its scenario."""
        self.process.stdin.write("go\n")
        self.process.stdin.flush()

    def read_calls(self, timeout_s: float = 30.0) -> list[dict]:
        """The manifest: one dict per line until `done`."""
        deadline = time.monotonic() + timeout_s
        calls = []
        while (line := self._next_line(deadline, timeout_s)) != "done":
            try:
                calls.append(json.loads(line))
            except json.JSONDecodeError:
                raise self._error(f"not a JSON manifest line: {line!r}") from None
        return calls

    def finish(self, timeout_s: float = 30.0) -> int:
        """Closes stdin (the workload exits) and returns its exit status."""
        try:
            self.process.stdin.close()
        except BrokenPipeError:  # it exited already
            pass
        return self.process.wait(timeout=timeout_s)

    def kill(self) -> int:
        """SIGKILL, then reaps it; returns the exit status (-9 unless it had exited)."""
        if self.process.poll() is None:
            self.process.kill()
        return self.process.wait()

    def __enter__(self) -> Workload:
        return self

    def __exit__(self, *exc_info) -> None:
        self.kill()
        # The reader ends at the EOF the dead process leaves; stdout is closed only after it.
        self._reader.join(timeout=5)
        for stream in (self.process.stdin, self.process.stdout):
            try:
                stream.close()
            except OSError:  # BrokenPipeError flushing stdin included
                pass
        self._stderr.close()


# Keeps libraries dlopen'ed (as an inference process maps its CUDA libraries) until stdin closes.
_HOLD_LIBRARIES = ("import ctypes, os, sys\n"
                   "libraries = [ctypes.CDLL(path) for path in sys.argv[1:]]\n"
                   "print('ready', os.getpid(), flush=True)\n"
                   "sys.stdin.read()\n")

LIBCUDART_MISSING = "the nvidia-cuda-runtime-cu12 wheel is not installed (`make setup` installs it)"


def real_libcudart() -> Path | None:
    """libcudart.so.12 of the nvidia-cuda-runtime-cu12 wheel (a test dependency); None without it."""
    spec = importlib.util.find_spec("nvidia.cuda_runtime")
    for directory in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(directory) / "lib" / "libcudart.so.12"
        if path.exists():
            return path
    return None


def library_holder(paths: Sequence[str | Path]) -> Workload:
    """A process that has dlopen'ed each of `paths` and waits (wait_ready(), then use as a
    Workload: it is killed on exit)."""
    return Workload([sys.executable, "-c", _HOLD_LIBRARIES, *map(str, paths)])


def run_workload(argv: Sequence[str | Path], timeout_s: float = 30.0,
                 env: Mapping[str, str] | None = None) -> list[dict]:
    """Runs a workload through the whole protocol with nothing attached; returns its manifest."""
    with Workload(argv, env=env) as workload:
        workload.wait_ready(timeout_s)
        workload.go()
        calls = workload.read_calls(timeout_s)
        status = workload.finish(timeout_s)
        if status != 0:
            raise workload._error(f"exited {status}")
        return calls
