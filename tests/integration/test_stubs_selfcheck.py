"""The CUDA stubs build and the workloads do what their manifests say: no BPF, no root.

The tracer tests trust these manifests as ground truth, so this checks them against the scenario
definitions, and checks through the driver stub's log (KVT_STUB_LOG=1) which driver calls the
runtime stub made underneath.
"""
import os
import shutil
import signal
import subprocess
from collections import Counter

import pytest

from cuda_stubs import (
    EXPECTED_CALLS,
    EXPECTED_DRIVER_CALLS,
    Workload,
)

KiB, MiB, TiB = 1 << 10, 1 << 20, 1 << 40
GRANULE_BYTES = 2 * MiB
DEVICE_BASE, HOST_BASE, RESERVE_BASE = 0x7F1000000000, 0x7E1000000000, 0x7D1000000000
INVALID_ADDRESS = 0xDEAD

DRIVER_APIS = {
    "cuMemAlloc_v2", "cuMemFree_v2", "cuMemAllocAsync", "cuMemFreeAsync", "cuMemAllocManaged",
    "cuMemAllocPitch_v2", "cuMemAllocHost_v2", "cuMemHostAlloc", "cuMemFreeHost",
    "cuCtxSetCurrent", "cuCtxDestroy_v2", "cuDevicePrimaryCtxRetain", "cuCtxCreate_v2",
    "cuMemCreate", "cuMemRelease", "cuMemMap", "cuMemUnmap", "cuMemAddressReserve",
    "cuMemAddressFree",
}
RUNTIME_APIS = {
    "cudaMalloc", "cudaFree", "cudaMallocAsync", "cudaFreeAsync", "cudaMallocManaged",
    "cudaMallocHost", "cudaHostAlloc", "cudaFreeHost", "cudaMallocPitch", "cudaSetDevice",
}


def run(argv):
    """Runs a workload to the end; returns (manifest, driver calls as (api, rc) -> count)."""
    with Workload(argv, env={**os.environ, "KVT_STUB_LOG": "1"}) as workload:
        workload.wait_ready()
        workload.go()
        calls = workload.read_calls()
        assert workload.finish() == 0, workload.stderr_text()
        driver = Counter()
        for line in workload.stderr_text().splitlines():
            _, api, rc = line.split()
            driver[(api, int(rc))] += 1
        return calls, driver


def by_api(calls, api, rc=None):
    return [c for c in calls if c["api"] == api and (rc is None or c["rc"] == rc)]


def manifest_counts(calls):
    return Counter((c["api"], c["rc"]) for c in calls)


def mapped_paths(pid):
    with open(f"/proc/{pid}/maps") as maps:
        return {line.split()[-1] for line in maps if "/" in line}


@pytest.fixture(params=["workload", "workload_static"])
def workload_program(request, stub_build):
    return getattr(stub_build, request.param)


def defined_functions(path, dynamic):
    result = subprocess.run(["nm", "--defined-only", *(["-D"] if dynamic else []), str(path)],
                            capture_output=True, text=True, check=True)
    return {line.split()[2] for line in result.stdout.splitlines() if line.split()[1] == "T"}


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs nm (binutils)")
def test_api_symbols_are_exported_functions(stub_build):
    assert DRIVER_APIS <= defined_functions(stub_build.libcuda, dynamic=True)
    assert RUNTIME_APIS <= defined_functions(stub_build.libcudart, dynamic=True)
    # The runtime reaches the driver through libcuda's exports (so both layers' probes fire) ...
    imported = subprocess.run(["nm", "-D", "--undefined-only", str(stub_build.libcudart)],
                              capture_output=True, text=True, check=True).stdout
    assert {"cuMemAlloc_v2", "cuMemFree_v2", "cuDevicePrimaryCtxRetain"} <= set(imported.split())
    # ... and the static workload carries both APIs in its own symbol table.
    assert DRIVER_APIS | RUNTIME_APIS <= defined_functions(stub_build.workload_static, dynamic=False)


def test_counts(workload_program):
    calls, driver = run([workload_program, "counts"])
    assert manifest_counts(calls) == EXPECTED_CALLS["counts"]
    assert driver == EXPECTED_DRIVER_CALLS["counts"]
    assert {c["device"] for c in calls} == {-1}  # no cudaSetDevice in this scenario
    assert len({c["tid"] for c in calls}) == 1

    mallocs = by_api(calls, "cudaMalloc", rc=0)
    assert [c["size_bytes"] for c in mallocs] == [(i + 1) * MiB for i in range(23)]
    frees = by_api(calls, "cudaFree", rc=0)
    assert [(c["address"], c["size_bytes"]) for c in frees[:19]] == [
        (c["address"], c["size_bytes"]) for c in mallocs[:19]]
    assert [(c["address"], c["size_bytes"]) for c in frees[19:]] == [(0, 0)]  # cudaFree(NULL)
    assert [(c["address"], c["size_bytes"]) for c in by_api(calls, "cudaFree", rc=1)] == [
        (INVALID_ADDRESS, 0)] * 2
    assert [(c["size_bytes"], c["address"]) for c in by_api(calls, "cudaMalloc", rc=2)] == [
        (2 * TiB, 0)] * 3

    async_allocs = by_api(calls, "cudaMallocAsync")
    assert [c["address"] for c in by_api(calls, "cudaFreeAsync")] == [
        c["address"] for c in async_allocs]
    driver_allocs = by_api(calls, "cuMemAlloc_v2")
    assert [c["size_bytes"] for c in driver_allocs] == [(i + 1) * 4 * KiB for i in range(11)]
    assert [c["address"] for c in by_api(calls, "cuMemFree_v2")] == [
        c["address"] for c in driver_allocs[:5]]
    host_allocs = by_api(calls, "cudaMallocHost")
    assert [c["size_bytes"] for c in host_allocs] == [(i + 1) * 4 * KiB for i in range(5)]
    assert [c["address"] for c in by_api(calls, "cudaFreeHost")] == [
        c["address"] for c in host_allocs[:3]]
    assert [c["size_bytes"] for c in by_api(calls, "cudaMallocManaged")] == [1 * MiB, 2 * MiB,
                                                                            3 * MiB]
    # 1000-byte rows pitched to 1024, 7 rows.
    assert [c["size_bytes"] for c in by_api(calls, "cudaMallocPitch")] == [1024 * 7] * 2

    # Successful allocations: unique, 2 MiB aligned, from the pool of their kind of memory.
    allocations = [c for c in calls
                   if c["rc"] == 0 and ("Malloc" in c["api"] or c["api"] == "cuMemAlloc_v2")]
    addresses = [c["address"] for c in allocations]
    assert len(set(addresses)) == len(addresses) == 23 + 7 + 11 + 5 + 3 + 2
    assert all(address % GRANULE_BYTES == 0 for address in addresses)
    for call in allocations:
        base = HOST_BASE if call["api"] == "cudaMallocHost" else DEVICE_BASE
        assert base <= call["address"] < base + TiB, call


def test_devices(workload_program):
    calls, driver = run([workload_program, "devices"])
    assert manifest_counts(calls) == EXPECTED_CALLS["devices"]
    assert driver == EXPECTED_DRIVER_CALLS["devices"]
    assert [(c["device"], c["rc"]) for c in by_api(calls, "cudaSetDevice")] == [
        (1, 0), (2, 0), (9, 101)]
    mallocs = by_api(calls, "cudaMalloc")
    assert Counter((c["device"], c["size_bytes"]) for c in mallocs) == {
        (1, MiB): 5, (2, 2 * MiB): 5}
    # Device 2 was set and used on its own thread, device 1 on the main thread.
    tid_of_device = {c["device"]: c["tid"] for c in mallocs}
    assert tid_of_device[1] != tid_of_device[2]
    assert all(c["tid"] == tid_of_device[c["device"]] for c in mallocs)
    assert by_api(calls, "cudaSetDevice")[1]["tid"] == tid_of_device[2]


def test_vmm(workload_program):
    calls, driver = run([workload_program, "vmm"])
    assert manifest_counts(calls) == EXPECTED_CALLS["vmm"]
    assert driver == EXPECTED_DRIVER_CALLS["vmm"]
    # Fresh process: the stub's allocators start at their bases, so every value is known.
    base, chunk = RESERVE_BASE, 2 * MiB
    handles = [0x1000 + i for i in range(5)]
    expected = (
        [("cuMemAddressReserve", base, 64 * MiB, 0)]
        + [("cuMemCreate", handle, chunk, 0) for handle in handles]
        + [("cuMemMap", base + i * chunk, chunk, 0) for i in range(5)]
        + [("cuMemRelease", handles[0], chunk, 0), ("cuMemRelease", handles[1], chunk, 0)]
        + [("cuMemUnmap", base, 2 * chunk, 0), ("cuMemUnmap", base + 2 * chunk, chunk, 0)]
        + [("cuMemRelease", handles[2], chunk, 0)]
        + [("cuMemCreate", 0, 2 * TiB, 2)]
    )
    assert [(c["api"], c["address"], c["size_bytes"], c["rc"]) for c in calls] == expected
    assert [c["handle"] for c in by_api(calls, "cuMemMap")] == handles
    assert {c["device"] for c in by_api(calls, "cuMemCreate")} == {3}  # prop.location.id


def test_context(workload_program):
    calls, driver = run([workload_program, "context"])
    assert manifest_counts(calls) == EXPECTED_CALLS["context"]
    assert driver == EXPECTED_DRIVER_CALLS["context"]
    context = 0xD0000 + 1 * 0x100
    assert [(c["api"], c["device"], c["size_bytes"]) for c in calls] == (
        [("cudaSetDevice", 0, 0)] + [("cudaMalloc", 0, MiB)] * 7 + [("cuCtxCreate_v2", 1, 0)]
        + [("cuMemAlloc_v2", 1, 3 * MiB)] * 3 + [("cuCtxDestroy_v2", 1, 0)])
    assert by_api(calls, "cuCtxCreate_v2")[0]["address"] == context
    assert by_api(calls, "cuCtxDestroy_v2")[0]["address"] == context


def test_loop(workload_program):
    calls, driver = run([workload_program, "loop", "1000"])
    assert len(calls) == 1 and calls[0]["loop_pairs"] == 1000 and calls[0]["ns_per_pair"] > 0
    assert driver == {("cuMemAlloc_v2", 0): 1000, ("cuMemFree_v2", 0): 1000}


def test_leak(stub_build):
    calls, _ = run([stub_build.workload, "leak", "37"])
    assert manifest_counts(calls) == {("cudaMalloc", 0): 37}
    assert len({c["address"] for c in calls}) == 37


def test_hold_waits_until_killed(stub_build):
    with Workload([stub_build.workload, "hold"]) as workload:
        workload.wait_ready()
        workload.go()
        assert manifest_counts(workload.read_calls()) == EXPECTED_CALLS["hold"]
        assert workload.process.poll() is None  # still there after `done`
        assert workload.kill() == -signal.SIGKILL


def test_dlopen_loads_the_runtime_only_after_go(stub_build):
    with Workload([stub_build.dlopen_workload, stub_build.libcudart]) as workload:
        workload.wait_ready()
        assert not {str(stub_build.libcudart), str(stub_build.libcuda)} & mapped_paths(workload.pid)
        workload.go()
        workload.expect_line("loaded")
        assert {str(stub_build.libcudart), str(stub_build.libcuda)} <= mapped_paths(workload.pid)
        workload.go()
        calls = workload.read_calls()
        assert workload.finish() == 0
    assert manifest_counts(calls) == EXPECTED_CALLS["dlopen"]
    assert [c["size_bytes"] for c in calls] == [(i + 1) * 65536 for i in range(17)]


def test_static_workload_maps_no_cuda_library(stub_build):
    with Workload([stub_build.workload_static, "hold"]) as workload:
        workload.wait_ready()
        paths = mapped_paths(workload.pid)
        assert str(stub_build.workload_static) in paths
        assert not any("libcuda" in path for path in paths)
        if stub_build.static_libc:
            assert not any(".so" in path for path in paths)


def test_closed_stdin_before_go_makes_no_call(stub_build):
    with Workload([stub_build.workload, "counts"], env={**os.environ, "KVT_STUB_LOG": "1"}) as w:
        w.wait_ready()
        assert w.finish() == 1
        assert w.stderr_text() == "stdin closed before go: no CUDA call made\n"


@pytest.mark.parametrize("argv", [[], ["bogus"], ["leak"], ["leak", "x"], ["counts", "3"]])
def test_bad_arguments_are_refused(stub_build, argv):
    assert subprocess.run([stub_build.workload, *argv], capture_output=True).returncode == 2
