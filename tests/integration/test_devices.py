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


def test_a_default_device_set_while_a_thread_runs_applies_to_its_next_calls(trace, stub_build):
    """A thread remembers its process's default device (one lookup a thread, not one a call), so
    user space's change of it must reach threads that remember the old one. GIVEN a thread allocating
    in paced batches of 100 with no device selected (device 0), WHEN the process's default becomes 5
    between two batches, THEN every later allocation is on device 5 and none before it."""
    env = dict(os.environ, KVT_LOOP_PAUSE_EVERY="100", KVT_LOOP_PAUSE_MS="300")
    with Workload([stub_build.workload, "loop", "300"], env=env) as workload:
        pid = workload.wait_ready()
        harness = trace(pid)
        workload.go()
        assert harness.pump_until(lambda: len(harness.of(pid, Kind.ALLOC, Api.cudaMalloc)) >= 100)
        harness.source.probes.set_process_device(pid, 5)
        try:
            assert harness.pump_until(lambda: len(harness.of(pid, Kind.ALLOC, Api.cudaMalloc)) >= 300)
        finally:
            harness.source.probes.set_process_device(pid, None)
    devices = [e.device for e in sorted(harness.of(pid, Kind.ALLOC), key=lambda e: e.timestamp_ns)]
    first_new = devices.index(5)
    print(f"\nallocations on device 0, then 5: {first_new}, {len(devices) - first_new}")
    assert set(devices[:first_new]) == {0} and set(devices[first_new:]) == {5}
    assert first_new >= 200 and len(devices) - first_new >= 200  # runtime and driver calls, 100+ each
