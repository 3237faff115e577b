"""Which GPU an allocation is on when the thread never selected one (torch on one GPU never calls
cudaSetDevice(0)): CUDA's rule says device 0, the first visible GPU. When the process's CUDA may
have started before its probes were in (the driver was mapped already), device 0 is certain only if
the process sees one GPU; with several, a device selected unseen is possible, and it stays unknown.

GIVEN a process that loads a fresh copy of the CUDA libraries (no probes in yet) and is followed
WHEN it allocates from a thread that never selected a device
THEN with one visible GPU the events are on device 0; with two, the device is unknown (-1).
"""
import os
import shutil

import pytest

from cuda_stubs import Workload
from kvtrace.model.events import DEVICE_UNKNOWN, Api, Kind


@pytest.mark.parametrize(("visible", "expected"), [("GPU-8e6f0001", 0),
                                                   ("GPU-8e6f0001,GPU-8e6f0002", DEVICE_UNKNOWN)])
def test_device_of_a_thread_that_never_selected_one(trace, stub_build, tmp_path, visible, expected):
    library = tmp_path / "libcudart.so.12"
    shutil.copy(stub_build.libcudart, library)
    shutil.copy(stub_build.libcuda, tmp_path / "libcuda.so.1")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=visible)
    with Workload([stub_build.dlopen_workload, library], env=env) as workload:
        pid = workload.wait_ready()
        harness = trace(pid)
        workload.go()
        workload.expect_line("loaded")
        assert harness.pump_until(lambda: pid in harness.source.late_device, timeout_seconds=5)
        workload.go()
        calls = workload.read_calls()
        assert harness.pump_until(lambda: len(harness.of(pid, Kind.ALLOC, Api.cudaMalloc)) >= len(calls))
    mallocs = harness.of(pid, Kind.ALLOC, Api.cudaMalloc)
    print(f"\nCUDA_VISIBLE_DEVICES={visible}: devices {sorted({e.device for e in mallocs})}")
    assert len(mallocs) == 17 and {e.device for e in mallocs} == {expected}
