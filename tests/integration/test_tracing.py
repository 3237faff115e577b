"""The tracing core against stub CUDA libraries: exact counts, sizes, pointers and ledger.

GIVEN a workload that makes a known set of CUDA calls (its manifest), WHEN the tracer follows it,
THEN every call is an event with the manifest's values and the ledger holds exactly what the
manifest leaves outstanding — in user space and in the kernel.
"""
import contextlib
import shutil
import time
from collections import Counter
from pathlib import Path

from cuda_stubs import LIBCUDART_MISSING, Workload, real_libcudart
from kvtrace.model.events import Api, Kind, Layer, Memory, ObjectKind

MiB = 1 << 20

_ALLOC_APIS = {"cudaMalloc", "cudaMallocAsync", "cudaMallocManaged", "cudaMallocHost",
               "cudaMallocPitch", "cuMemAlloc_v2"}
_FREE_APIS = {"cudaFree", "cudaFreeAsync", "cudaFreeHost", "cuMemFree_v2"}
# What the runtime stub calls in the driver stub (same address and size).
_DRIVER_OF = {"cudaMalloc": "cuMemAlloc_v2", "cudaMallocAsync": "cuMemAllocAsync",
              "cudaMallocManaged": "cuMemAllocManaged", "cudaMallocHost": "cuMemAllocHost_v2",
              "cudaMallocPitch": "cuMemAllocPitch_v2", "cudaFree": "cuMemFree_v2",
              "cudaFreeAsync": "cuMemFreeAsync", "cudaFreeHost": "cuMemFreeHost"}


def outstanding_from_manifest(calls, layer):
    """{address: size} the manifest leaves allocated at the runtime or driver layer."""
    live = {}
    for call in calls:
        api = call["api"]
        if call["rc"] != 0:
            continue
        runtime = api.startswith("cuda")
        if layer is Layer.RUNTIME and not runtime:
            continue
        if api in _ALLOC_APIS:
            live[call["address"]] = call["size_bytes"]
        elif api in _FREE_APIS and call["address"]:
            live.pop(call["address"], None)
    return live


def ledger_view(entries, pid, layer, objects=(ObjectKind.ALLOCATION,)):
    return {e.key.address: e.size_bytes for e in entries
            if e.key.pid == pid and e.key.layer is layer and e.key.object in objects}


@contextlib.contextmanager
def scenario(trace, argv, expected_events):
    """Runs a workload to `done` under the tracer; the process stays alive inside the block."""
    with Workload(argv) as workload:
        pid = workload.wait_ready()
        harness = trace(pid)
        workload.go()
        calls = workload.read_calls()
        arrived = harness.pump_until(lambda: len(harness.of(pid)) >= expected_events)
        harness.pump(0.2)  # nothing more may come
        assert arrived, f"{len(harness.of(pid))} of {expected_events} events"
        yield pid, harness, calls


def test_counts_scenario_exact_events_and_ledger(trace, stub_build):
    # 23+3 cudaMalloc, 21 cudaFree with an address, 7+7 async, 11+5 driver, 5+3 host, 3 managed,
    # 2 pitch: runtime events, and the driver calls the runtime makes (cudaFree(NULL) makes none).
    runtime_events = 26 + 21 + 14 + 16 + 8 + 3 + 2
    driver_events = 26 + 21 + 14 + 8 + 3 + 2
    with scenario(trace, [stub_build.workload, "counts"],
                                       runtime_events + driver_events) as (pid, harness, calls):
        events = harness.of(pid)
        assert len(events) == runtime_events + driver_events
        # CUDA's rule: a thread that never selected a device works on device 0 (it was "unknown")
        device_memory = [e for e in events if e.kind is Kind.ALLOC and e.memory is Memory.DEVICE]
        assert device_memory and {e.device for e in device_memory} == {0}

        mallocs = harness.of(pid, Kind.ALLOC, Api.cudaMalloc)
        manifest_mallocs = [(c["address"], c["size_bytes"]) for c in calls
                            if c["api"] == "cudaMalloc" and c["rc"] == 0]
        assert [(e.address, e.size_bytes) for e in mallocs] == manifest_mallocs
        assert all(e.layer is Layer.RUNTIME and e.memory is Memory.DEVICE for e in mallocs)

        failed = harness.of(pid, Kind.ALLOC_FAILED, Api.cudaMalloc)
        assert [(e.size_bytes, e.error_code) for e in failed] == [(1 << 41, 2)] * 3
        assert len(harness.of(pid, Kind.ALLOC_FAILED, Api.cuMemAlloc_v2)) == 3
        assert [(e.address, e.error_code) for e in harness.of(pid, Kind.FREE_FAILED, Api.cudaFree)] == \
            [(0xDEAD, 1)] * 2
        assert len(harness.of(pid, Kind.FREE, Api.cudaFree)) == 19
        assert len(harness.of(pid, Kind.ALLOC, Api.cuMemAlloc_v2)) == 23 + 11
        pitch = harness.of(pid, Kind.ALLOC, Api.cudaMallocPitch)
        assert [e.size_bytes for e in pitch] == [1024 * 7] * 2
        host = harness.of(pid, Kind.ALLOC, Api.cudaMallocHost)
        assert all(e.memory is Memory.HOST for e in host) and len(host) == 5

        tracer = harness.source
        for layer in (Layer.RUNTIME, Layer.DRIVER):
            expected = outstanding_from_manifest(calls, layer)
            if layer is Layer.DRIVER:  # the runtime's allocations are the driver's too
                expected.update(outstanding_from_manifest(calls, Layer.RUNTIME))
            assert ledger_view(tracer.session.ledger, pid, layer) == expected, layer
            assert ledger_view(tracer.kernel_ledger(), pid, layer) == expected, layer
        # 4 cudaMalloc of 20..23 MiB + 6 direct driver allocations of (i+1)*4 KiB, i = 5..10
        device_driver = sum(range(20, 24)) * MiB + sum((i + 1) * 4096 for i in range(5, 11)) + \
            2 * 7168 + 3 * 0  # pitch allocations are device memory; managed are not
        managed = sum(c["size_bytes"] for c in calls if c["api"] == "cudaMallocManaged")
        assert tracer.session.ledger.physical_device_bytes(pid) == device_driver
        assert tracer.session.ledger.outstanding_bytes(pid, memory=Memory.MANAGED, layers=[Layer.DRIVER]) == managed
        counters = tracer.counters()
        assert counters["events_lost"] == 0 and counters["returns_unpaired"] == 0


def test_device_follows_cudaSetDevice_per_thread(trace, stub_build):
    with scenario(trace, [stub_build.workload, "devices"], 3 + 2 * 10) as (pid, harness, calls):
        mallocs = harness.of(pid, Kind.ALLOC, Api.cudaMalloc)
        assert sorted((e.address, e.device) for e in mallocs) == \
            sorted((c["address"], c["device"]) for c in calls if c["api"] == "cudaMalloc")
        assert Counter(e.device for e in mallocs) == {1: 5, 2: 5}
        set_device = harness.of(pid, Kind.SET_DEVICE, Api.cudaSetDevice)
        assert [(e.device, e.error_code) for e in set_device] == [(1, 0), (2, 0), (9, 101)]
        driver = harness.of(pid, Kind.ALLOC, Api.cuMemAlloc_v2)
        assert Counter(e.device for e in driver) == {1: 5, 2: 5}
        # Each event carries the name of the thread that made the call, as it was then.
        main_name = Path(f"/proc/{pid}/comm").read_text().strip()
        assert main_name == "short"
        assert [(e.tid == pid, e.comm) for e in sorted(mallocs, key=lambda e: e.timestamp_ns)] == \
            [(True, Path(stub_build.workload).name[:15])] * 3 + [(False, "kvt-dev-thread")] * 5 + [(True, "short")] * 2


def test_per_thread_state_in_lru_hashes_where_the_kernel_has_no_task_storage(bpf_here_unshared, stub_build):
    """Before Linux 6.2 the probes keep a call's arguments, the outer stack and each thread's device
    in LRU hashes (ProbeSettings.task_storage False): the same events and ledger as with task storage."""
    from harness import TracingHarness
    from kvtrace.sources.bpf.loader import ProbeSettings

    harness = TracingHarness(only_selected=True, preattach_globs=(str(stub_build.lib_dir / "*.so.*"),),
                             settings=ProbeSettings(task_storage=False))

    def follow(*pids):
        for pid in pids:
            harness.source.follow(pid)
        return harness

    try:
        with scenario(follow, [stub_build.workload, "devices"], 3 + 2 * 10) as (pid, _, calls):
            mallocs = harness.of(pid, Kind.ALLOC, Api.cudaMalloc)
            assert sorted((e.address, e.device) for e in mallocs) == \
                sorted((c["address"], c["device"]) for c in calls if c["api"] == "cudaMalloc")
            assert Counter(e.device for e in harness.of(pid, Kind.ALLOC, Api.cuMemAlloc_v2)) == {1: 5, 2: 5}
        runtime_events, driver_events = 26 + 21 + 14 + 16 + 8 + 3 + 2, 26 + 21 + 14 + 8 + 3 + 2
        with scenario(follow, [stub_build.workload, "counts"], runtime_events + driver_events) as (pid, _, calls):
            assert len(harness.of(pid)) == runtime_events + driver_events
            for layer in (Layer.RUNTIME, Layer.DRIVER):
                expected = outstanding_from_manifest(calls, layer)
                if layer is Layer.DRIVER:
                    expected.update(outstanding_from_manifest(calls, Layer.RUNTIME))
                assert ledger_view(harness.session.ledger, pid, layer) == expected, layer
            counters = harness.source.counters()
            assert counters["events_lost"] == 0 and counters["returns_unpaired"] == 0
    finally:
        harness.close()


def test_vmm_lifecycle_physical_memory_until_released_and_unmapped(trace, stub_build):
    # reserve 1, create 5+1 failed, map 5, release 3, unmap 2
    with scenario(trace, [stub_build.workload, "vmm"], 1 + 6 + 5 + 3 + 2) as (pid, harness, calls):
        assert len(harness.of(pid, Kind.ALLOC, Api.cuMemCreate)) == 5
        assert [e.error_code for e in harness.of(pid, Kind.ALLOC_FAILED, Api.cuMemCreate)] == [2]
        assert len(harness.of(pid, Kind.RELEASE)) == 2  # released while mapped
        unmaps = harness.of(pid, Kind.UNMAP)
        assert [e.freed_bytes for e in unmaps] == [4 * MiB, 0]  # the first unmap freed handles 0 and 1
        for entries in (harness.session.ledger, harness.source.kernel_ledger()):
            handles = ledger_view(entries, pid, Layer.VMM, (ObjectKind.VMM_HANDLE,))
            assert handles == {0x1003: 2 * MiB, 0x1004: 2 * MiB}
            assert len(ledger_view(entries, pid, Layer.VMM, (ObjectKind.VMM_MAPPING,))) == 2
            assert ledger_view(entries, pid, Layer.VMM, (ObjectKind.VMM_RESERVE,)) == {0x7D1000000000: 64 * MiB}
        assert harness.session.ledger.physical_device_bytes(pid, device=3) == 4 * MiB


def test_context_destroy_frees_what_the_context_held(trace, stub_build):
    # setdevice 1, 7 cudaMalloc (14 events), create ctx (no event), 3 cuMemAlloc, destroy 1
    with scenario(trace, [stub_build.workload, "context"], 1 + 14 + 3 + 1) as (pid, harness, calls):
        destroy = harness.of(pid, Kind.CONTEXT_DESTROY)
        assert [(e.device, e.error_code) for e in destroy] == [(1, 0)]
        for entries in (harness.session.ledger, harness.source.kernel_ledger()):
            driver = ledger_view(entries, pid, Layer.DRIVER)
            assert len(driver) == 7  # the device-0 allocations stay
            assert all(e.device == 0 for e in entries if e.key.pid == pid)
        assert harness.session.ledger.physical_device_bytes(pid, device=1) == 0
        assert harness.session.ledger.implicit_frees_total[pid] == 3


def test_a_device_selected_before_exec_is_not_the_new_programs(trace, stub_build):
    """CUDA state does not survive execve: the program a process execs starts on device 0 however its
    thread had selected another (the probes forget the thread's state at exec)."""
    import sys

    script = (f"import ctypes, os, sys\n"
              f"print('before', flush=True); sys.stdin.readline()\n"
              f"assert ctypes.CDLL({str(stub_build.libcudart)!r}).cudaSetDevice(2) == 0\n"
              f"print('selected', flush=True); sys.stdin.readline()\n"
              f"os.execv({str(stub_build.workload)!r}, [{str(stub_build.workload)!r}, 'hold'])\n")
    with Workload([sys.executable, "-c", script]) as workload:
        workload.expect_line("before")
        harness = trace(workload.pid)
        workload.go()
        workload.expect_line("selected")
        assert harness.pump_until(lambda: harness.of(workload.pid, Kind.SET_DEVICE)), "no cudaSetDevice seen"
        assert {e.device for e in harness.of(workload.pid, Kind.SET_DEVICE)} == {2}
        workload.go()  # exec
        pid = workload.wait_ready()
        workload.go()
        workload.read_calls()
        arrived = harness.pump_until(lambda: len(harness.of(pid, Kind.ALLOC, Api.cudaMalloc)) >= 13)
        mallocs = harness.of(pid, Kind.ALLOC, Api.cudaMalloc)
        assert arrived, f"{len(mallocs)} of 13 cudaMalloc"
        assert {e.device for e in mallocs} == {0}


def test_statically_linked_executable_is_traced(trace, stub_build):
    with scenario(trace, [stub_build.workload_static, "hold"], 26) as (pid, harness, calls):
        libraries = [lib for lib in harness.source.attached_libraries() if pid in lib.pids]
        assert [lib.path for lib in libraries] == [str(stub_build.workload_static)]
        assert len(harness.of(pid, Kind.ALLOC, Api.cudaMalloc)) == 13
        assert len(harness.of(pid, Kind.ALLOC, Api.cuMemAlloc_v2)) == 13


def test_library_dlopened_later_under_another_name_is_attached_within_a_second(trace, stub_build, tmp_path):
    renamed = tmp_path / "libcudart-1a2b3c4d.so.12"
    shutil.copy(stub_build.libcudart, renamed)
    shutil.copy(stub_build.libcuda, tmp_path / "libcuda.so.1")  # found through $ORIGIN
    with Workload([stub_build.dlopen_workload, renamed]) as workload:
        pid = workload.wait_ready()
        harness = trace(pid)
        assert str(renamed) not in {lib.path for lib in harness.source.attached_libraries()}
        workload.go()
        workload.expect_line("loaded")
        mapped_at = time.monotonic()
        attached = harness.pump_until(
            lambda: {str(renamed), str(tmp_path / "libcuda.so.1")}
            <= {lib.path for lib in harness.source.attached_libraries()}, timeout_seconds=5)
        attach_seconds = time.monotonic() - mapped_at
        print(f"\nlate dlopen attached in {attach_seconds * 1000:.0f} ms")
        assert attached and attach_seconds < 1.0
        workload.go()
        calls = workload.read_calls()
        harness.pump_until(lambda: len(harness.of(pid, Kind.ALLOC, Api.cudaMalloc)) >= 17)
    mallocs = harness.of(pid, Kind.ALLOC, Api.cudaMalloc)
    assert [(e.address, e.size_bytes) for e in mallocs] == [(c["address"], c["size_bytes"]) for c in calls]


def test_killed_process_ledger_empties(trace, stub_build):
    with Workload([stub_build.workload, "hold"]) as workload:
        pid = workload.wait_ready()
        harness = trace(pid)
        workload.go()
        workload.read_calls()
        assert harness.pump_until(lambda: harness.session.ledger.physical_device_bytes(pid) == 13 * MiB)
        workload.kill()
        assert harness.pump_until(lambda: pid not in harness.session.ledger.pids(), timeout_seconds=3)
    assert [e for e in harness.source.kernel_ledger() if e.key.pid == pid] == []
    assert len(harness.of(pid, Kind.PROCESS_EXIT)) == 1


def test_real_libcudart_wheel_attach_size_and_error_35(trace, tmp_path):
    libcudart = real_libcudart()
    assert libcudart is not None, LIBCUDART_MISSING
    script = tmp_path / "real.py"
    script.write_text(
        "import ctypes, sys\n"
        f"lib = ctypes.CDLL({str(libcudart)!r})\n"
        "print('ready', flush=True); sys.stdin.readline()\n"
        "p = ctypes.c_void_p()\n"
        "rcs = [lib.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(4096 * (i + 1))) for i in range(23)]\n"
        "print(sorted(set(rcs)), flush=True); sys.stdin.readline()\n")
    import subprocess
    import sys

    process = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "ready"
        harness = trace(process.pid)
        assert any(lib.path.endswith("libcudart.so.12") for lib in harness.source.attached_libraries())
        process.stdin.write("\n")
        process.stdin.flush()
        assert process.stdout.readline().strip() == "[35]"  # cudaErrorInsufficientDriver: no GPU
        harness.pump_until(lambda: len(harness.of(process.pid)) >= 23)
        failed = harness.of(process.pid, Kind.ALLOC_FAILED, Api.cudaMalloc)
        assert [(e.size_bytes, e.error_code) for e in failed] == [(4096 * (i + 1), 35) for i in range(23)]
        assert harness.session.ledger.failures_total[(Api.cudaMalloc, 35)] == 23
    finally:
        process.kill()
        process.wait()
