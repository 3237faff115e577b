"""NVML source over a fake backend (and pynvml itself where this machine allows): per-process
memory with and without a figure, a lost GPU that comes back, a call that hangs, no NVML, and the
CUDA ordinal -> NVML index mapping."""
import subprocess
import sys
import time

import pytest

from fake_nvml import FakeGpu, FakeNvml, GiB
from kvtrace.model.gpus import GpuMemory, NvmlProcessMemory, nvml_index_for_cuda_ordinal
from kvtrace.sources.nvml import NvmlSampler, PynvmlBackend, read_cuda_visible_devices

UUIDS = ["GPU-8e6f0a5c-0000-0000-0000-000000000000", "GPU-11aa22bb-0000-0000-0000-000000000000",
         "GPU-11ff0000-0000-0000-0000-000000000000", "GPU-c0ffee00-0000-0000-0000-000000000000"]
FAST = dict(call_timeout_seconds=0.2, init_timeout_seconds=0.2)


def test_a_round_reports_every_gpu_and_process_with_or_without_a_figure():
    # GIVEN two GPUs; on the second, NVML gives no figure for pid 300 (usedGpuMemory None)
    nvml = FakeNvml(FakeGpu(UUIDS[0], processes=[(200, 3 * GiB)]),
                    FakeGpu(UUIDS[1], used_bytes=5 * GiB, processes=[(300, None), (200, GiB)]))
    sampler = NvmlSampler(None, nvml, **FAST)
    # WHEN it samples once
    sampler.sample_once()
    # THEN the component is up and the figures are NVML's, None kept as None
    assert sampler.status.up and sampler.status.reason == ""
    assert sampler.latest.gpus == (
        GpuMemory(0, UUIDS[0], "NVIDIA H200", 140 * GiB, 20 * GiB, 119 * GiB, GiB),
        GpuMemory(1, UUIDS[1], "NVIDIA H200", 140 * GiB, 5 * GiB, 119 * GiB, GiB))
    assert sampler.latest.processes == (NvmlProcessMemory(0, 200, 3 * GiB), NvmlProcessMemory(1, 300, None),
                                        NvmlProcessMemory(1, 200, GiB))


def test_a_lost_gpu_is_down_with_the_reason_and_comes_back_on_its_own():
    # GIVEN two GPUs, and the second is lost
    nvml = FakeNvml(FakeGpu(UUIDS[0]), FakeGpu(UUIDS[1]))
    nvml.gpus[1].lost = True
    sampler = NvmlSampler(None, nvml, **FAST)
    # WHEN it samples
    sampler.sample_once()
    # THEN nvml is down, saying which GPU, and the other GPU is still reported
    assert not sampler.status.up
    assert sampler.status.reason == "GPU 1: GPU is lost (1 of 2 GPUs sampled)"
    assert [gpu.index for gpu in sampler.latest.gpus] == [0]
    # WHEN the GPU is back
    nvml.gpus[1].lost = False
    sampler.sample_once()
    # THEN nvml is up again with both
    assert sampler.status.up and [gpu.index for gpu in sampler.latest.gpus] == [0, 1]


def test_the_only_gpu_lost_leaves_no_figures_and_reinitialises_when_back():
    nvml = FakeNvml(FakeGpu(UUIDS[0]))
    sampler = NvmlSampler(None, nvml, **FAST)
    sampler.sample_once()
    nvml.gpus[0].lost = True
    sampler.sample_once()
    assert not sampler.status.up and sampler.status.reason == "GPU 0: GPU is lost"
    assert sampler.latest is None  # no stale figures to forecast from
    nvml.gpus[0].lost = False
    sampler.sample_once()
    assert sampler.status.up and sampler.latest.gpus[0].index == 0
    assert nvml.calls.count("init") == 2  # a failed round re-initialises NVML


def test_a_hung_call_times_out_marks_nvml_down_and_is_not_called_again_until_it_returns():
    # GIVEN a sampler that has sampled, and then NVML hangs in every call
    nvml = FakeNvml(FakeGpu(UUIDS[0]))
    sampler = NvmlSampler(None, nvml, **FAST)
    sampler.sample_once()
    nvml.hang()
    try:
        # WHEN it samples
        started = time.monotonic()
        sampler.sample_once()
        # THEN it returns within about its timeout, down, with no figures
        assert time.monotonic() - started < 1.0
        assert not sampler.status.up and sampler.status.reason == "nvml call timed out"
        assert sampler.latest is None
        # AND while the call stays hung, later rounds return at once without calling NVML again
        calls = len(nvml.calls)
        started = time.monotonic()
        sampler.sample_once()
        assert time.monotonic() - started < 0.1
        assert len(nvml.calls) == calls and sampler.status.reason.startswith("nvml call timed out (hung for")
    finally:
        nvml.release()
    # WHEN the call returns at last, THEN the next round re-initialises and nvml is back
    time.sleep(0.05)
    sampler.sample_once()
    assert sampler.status.up and sampler.latest is not None


def test_the_sampler_thread_keeps_sampling_and_stops():
    nvml = FakeNvml(FakeGpu(UUIDS[0]))
    sampler = NvmlSampler(None, nvml, interval_seconds=0.01, **FAST)
    sampler.start()
    try:
        deadline = time.monotonic() + 5
        while nvml.calls.count("memory") < 3:
            assert time.monotonic() < deadline, "the sampler did not sample"
            time.sleep(0.01)
    finally:
        sampler.stop()
    assert sampler.status.up


@pytest.mark.parametrize("setup, reason", [
    (lambda nvml: setattr(nvml, "init_error", "NVML library not found (libnvidia-ml.so.1: is the NVIDIA "
                                              "driver installed?)"),
     "NVML library not found (libnvidia-ml.so.1: is the NVIDIA driver installed?)"),
    (lambda nvml: nvml.gpus.clear(), "no NVIDIA GPU"),
])
def test_no_nvml_or_no_gpu_is_a_state_with_a_reason(setup, reason):
    nvml = FakeNvml(FakeGpu(UUIDS[0]))
    setup(nvml)
    sampler = NvmlSampler(None, nvml, **FAST)
    sampler.sample_once()
    assert not sampler.status.up and sampler.status.reason == reason and sampler.latest is None


def test_a_bug_in_the_backend_marks_nvml_down_rather_than_ending_the_thread():
    nvml = FakeNvml(FakeGpu(UUIDS[0]))
    nvml.device_count = lambda: 1 / 0
    sampler = NvmlSampler(None, nvml, **FAST)
    sampler.sample_once()
    assert not sampler.status.up and "division by zero" in sampler.status.reason


# ---- the real backend over pynvml ----

def test_pynvml_without_the_library_says_so():
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        pytest.skip("this machine has NVML")
    except pynvml.NVMLError_LibraryNotFound:
        pass
    sampler = NvmlSampler(None, PynvmlBackend(), **{**FAST, "init_timeout_seconds": 10})
    sampler.sample_once()
    assert not sampler.status.up
    assert sampler.status.reason == "NVML library not found (libnvidia-ml.so.1: is the NVIDIA driver installed?)"


@pytest.fixture
def fake_pynvml(monkeypatch):
    """pynvml with its C calls replaced: one GPU, one process whose figure NVML does not give."""
    pynvml = pytest.importorskip("pynvml")

    class Memory:
        def __init__(self, total, used, free, reserved=None):
            self.total, self.used, self.free = total, used, free
            if reserved is not None:
                self.reserved = reserved

    class Process:
        pid, usedGpuMemory = 4242, None

    state = {"v2": True, "lost": False}

    def memory_info(handle, version=None):
        if state["lost"]:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        if version is not None:
            if not state["v2"]:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
            return Memory(140 * GiB, 20 * GiB, 119 * GiB, GiB)
        return Memory(140 * GiB, 21 * GiB, 119 * GiB)

    for name, function in {
            "nvmlInit": lambda: None, "nvmlShutdown": lambda: None, "nvmlDeviceGetCount": lambda: 1,
            "nvmlDeviceGetHandleByIndex": lambda index: ("handle", index),
            "nvmlDeviceGetUUID": lambda handle: UUIDS[0], "nvmlDeviceGetName": lambda handle: b"NVIDIA H200",
            "nvmlDeviceGetMemoryInfo": memory_info,
            "nvmlDeviceGetComputeRunningProcesses": lambda handle: [Process()]}.items():
        monkeypatch.setattr(pynvml, name, function)
    return state


def test_pynvml_backend_reads_memory_v2_and_falls_back_to_v1(fake_pynvml):
    sampler = NvmlSampler(None, PynvmlBackend(), **FAST)
    sampler.sample_once()
    assert sampler.status.up
    assert sampler.latest.gpus == (GpuMemory(0, UUIDS[0], "NVIDIA H200", 140 * GiB, 20 * GiB, 119 * GiB, GiB),)
    assert sampler.latest.processes == (NvmlProcessMemory(0, 4242, None),)
    # An older driver without nvmlDeviceGetMemoryInfo_v2: v1, where used includes reserved.
    fake_pynvml["v2"] = False
    sampler.sample_once()
    assert sampler.latest.gpus[0].used_bytes == 21 * GiB and sampler.latest.gpus[0].reserved_bytes == 0


def test_pynvml_backend_names_a_lost_gpu(fake_pynvml):
    fake_pynvml["lost"] = True
    sampler = NvmlSampler(None, PynvmlBackend(), **FAST)
    sampler.sample_once()
    assert not sampler.status.up
    assert sampler.status.reason == "GPU 0: GPU is lost (NVML_ERROR_GPU_IS_LOST: fallen off the bus or needs a reset)"
    fake_pynvml["lost"] = False
    sampler.sample_once()
    assert sampler.status.up


# ---- CUDA ordinal -> NVML index ----

@pytest.mark.parametrize("ordinal, visible, expected", [
    (0, None, 0), (3, None, 3), (4, None, None),  # unset: identity, within the GPUs there are
    (0, "2,0", 2), (1, "2,0", 0), (2, "2,0", None),  # CUDA numbers the visible ones in order
    (0, " 3 , 1", 3), (1, " 3 , 1", 1),
    (0, "GPU-c0ffee00-0000-0000-0000-000000000000", 3),  # a full UUID
    (0, "GPU-8e6f", 0), (0, "c0ffee", 3),  # a unique prefix, with or without "GPU-"
    (0, "GPU-11", None),  # an ambiguous prefix names no GPU
    (1, "1,GPU-11ff", 2),
    (0, "", None), (0, "-1", None),  # nothing visible
    (1, "0,7,1", None), (0, "0,7,1", 0),  # the list ends at the first entry that names no GPU
    (1, "0,0", None),  # a repeated GPU ends it too
    (0, "MIG-1b2c3d4e-0000-0000-0000-000000000000", None),  # a MIG instance is not a whole GPU
    (-1, None, None), (-1, "0", None),  # the device was not traced
])
def test_nvml_index_for_cuda_ordinal(ordinal, visible, expected):
    assert nvml_index_for_cuda_ordinal(ordinal, visible, UUIDS) == expected


def test_read_cuda_visible_devices_of_a_process():
    # Read once the child runs: just after Popen returns, /proc/PID/environ reads empty now and
    # then (4 in 300 on the development VM).
    child = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(30)"],
                             env={"CUDA_VISIBLE_DEVICES": "2,GPU-8e6f"}, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        assert read_cuda_visible_devices(child.pid) == "2,GPU-8e6f"
    finally:
        child.kill()
        child.wait()
    assert read_cuda_visible_devices(2 ** 22 + 1) is None  # no such process


def test_cuda_visible_count_follows_cudas_list_rules():
    from kvtrace.model.gpus import cuda_visible_count

    assert cuda_visible_count(None, 8) == 8
    assert cuda_visible_count("0", 8) == 1
    assert cuda_visible_count("3,1", 8) == 2
    assert cuda_visible_count("0,9,1", 8) == 1  # the list ends at the first GPU that does not exist
    assert cuda_visible_count("1,1", 8) == 1
    assert cuda_visible_count("-1", 8) == 0 and cuda_visible_count("", 8) == 0
    assert cuda_visible_count("GPU-8e6f,GPU-1234", 0) == 2
    assert cuda_visible_count("MIG-8e6f", 1) == 0


def test_gpu_device_count_reads_the_processes_own_dev(tmp_path):
    from kvtrace.sources.procfs import gpu_device_count

    dev = tmp_path / "1234" / "root" / "dev"
    dev.mkdir(parents=True)
    for name in ("nvidia0", "nvidia3", "nvidiactl", "nvidia-uvm", "nvidia-caps"):
        (dev / name).touch()
    assert gpu_device_count(1234, proc=tmp_path) == 2
    assert gpu_device_count(999, proc=tmp_path) is None  # unreadable: not "no GPU"
