"""Real CUDA through torch: exact allocations, the three allocator modes, Python stacks.

Outputs worth quoting are printed (run with -s).
"""
from conftest import source_line
from harness import TracingHarness
from kvtrace.model.events import Api, Kind, Layer

MiB = 1 << 20


def quiesce(harness, seconds=0.5):
    harness.pump(seconds)


def test_no_caching_23_tensors_are_23_exact_allocations_then_freed(torch_worker):
    worker = torch_worker({"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"})
    with TracingHarness([worker.pid]) as harness:
        worker.send(harness, op="init")
        quiesce(harness)
        before = len(harness.of(worker.pid, Kind.ALLOC, Api.cudaMalloc))
        answer = worker.send(harness, op="alloc", count=23, step_bytes=MiB)
        expected = {(t["data_ptr"], t["nbytes"]) for t in answer["tensors"]}
        harness.pump_until(lambda: len(harness.of(worker.pid, Kind.ALLOC, Api.cudaMalloc)) >= before + 23)
        runtime = harness.of(worker.pid, Kind.ALLOC, Api.cudaMalloc)[before:]
        driver = [e for e in harness.of(worker.pid, Kind.ALLOC, Api.cuMemAlloc_v2)
                  if (e.address, e.size_bytes) in expected]
        print(f"\n23 tensors: {len(runtime)} cudaMalloc, {len(driver)} matching cuMemAlloc_v2")
        assert {(e.address, e.size_bytes) for e in runtime} == expected
        assert len(driver) == 23
        # Python stacks name the allocating function and line.
        line = source_line("# ALLOC_LINE")
        frames = [harness.session.stacks.get(e.stack_id).frames[0] for e in runtime]
        print(f"innermost frame of the first: {frames[0]}")
        assert all(f.function == "allocate_tensors" and f.line == line for f in frames)

        addresses = {address for address, _ in expected}
        worker.send(harness, op="free")
        harness.pump_until(lambda: sum(e.address in addresses
                                       for e in harness.of(worker.pid, Kind.FREE, Api.cudaFree)) == 23)
        ledger = harness.session.ledger
        outstanding = [e for e in ledger if e.key.pid == worker.pid and e.key.address in addresses]
        assert outstanding == []


def _reserved_vs_traced(torch_worker, env, layers):
    worker = torch_worker(env)
    with TracingHarness([worker.pid]) as harness:
        worker.send(harness, op="init")
        answer = worker.send(harness, op="alloc", count=23, step_bytes=MiB)
        quiesce(harness)
        traced = harness.session.ledger.outstanding_bytes(pid=worker.pid, layers=layers)
        kernel = sum(e.size_bytes for e in harness.source.kernel_ledger()
                     if e.key.pid == worker.pid and e.key.layer in layers
                     and e.key.object.name in ("ALLOCATION", "VMM_HANDLE"))
        print(f"\n{env}: memory_reserved={answer['memory_reserved']} traced={traced} kernel={kernel}")
        return answer["memory_reserved"], traced, kernel


def test_caching_allocator_driver_bytes_equal_memory_reserved(torch_worker):
    reserved, traced, kernel = _reserved_vs_traced(torch_worker, {}, [Layer.DRIVER])
    assert traced == reserved == kernel


def test_expandable_segments_vmm_bytes_equal_memory_reserved(torch_worker):
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    reserved, traced, kernel = _reserved_vs_traced(torch_worker, env, [Layer.VMM])
    assert traced == reserved == kernel


def test_allocations_are_on_device_0_without_cudasetdevice_also_when_the_agent_came_late(torch_worker):
    # GIVEN torch on one GPU, which never calls cudaSetDevice(0), one worker started and CUDA
    # initialised before the agent (its driver mapped before any probe), one after
    late = torch_worker()
    late.send(op="init")
    with TracingHarness([late.pid]) as harness:
        early = torch_worker()
        harness.source.follow(early.pid)
        early.send(harness, op="init")
        devices = {}
        for worker in (late, early):
            # WHEN each allocates 23 tensors
            worker.send(harness, op="alloc", count=23, step_bytes=MiB)
            quiesce(harness)
            events = [e for e in harness.of(worker.pid, Kind.ALLOC)
                      if e.api in (Api.cudaMalloc, Api.cuMemAlloc_v2, Api.cuMemCreate)]
            devices[worker.pid] = sorted({e.device for e in events})
            print(f"\npid {worker.pid} ({'late' if worker is late else 'early'}): {len(events)} allocations "
                  f"on devices {devices[worker.pid]}; noted as started before its probes: "
                  f"{worker.pid in harness.source.late_device}")
            assert events
        # THEN every allocation is on device 0 (it was -1, shown as "?"), for both
        assert devices == {late.pid: [0], early.pid: [0]}
        assert late.pid in harness.source.late_device and early.pid not in harness.source.late_device
