"""End-to-end scenarios on real CUDA: a random-init Llama from transformers, generating.

Each test gathers its figures first, prints them (run with -s; they go into bench/RESULTS.md and the
issue notes), then asserts, so that one run on the GPU machine shows every figure even when a check
fails.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from agent_process import AgentProcess, kvtrace
from conftest import LLAMA, WORKER, check_all, quiesce, source_line, wait_for
from harness import TracingHarness
from kvtrace.model.events import Api, Kind, Layer, Memory, ObjectKind

MiB = 1 << 20
GiB = 1 << 30
LOAD_TIMEOUT_SECONDS = 300


def runtime_entries(harness: TracingHarness, pid: int) -> dict[int, object]:
    """Outstanding cudaMalloc'd blocks of `pid` by address."""
    return {e.key.address: e for e in harness.session.ledger
            if e.key.pid == pid and e.key.layer is Layer.RUNTIME and e.key.object is ObjectKind.ALLOCATION}


def files_of(harness: TracingHarness, stack_id: int) -> list[str]:
    if not stack_id:
        return []
    return [frame.file for frame in harness.session.stacks.get(stack_id).frames]


def through_cache_code(harness: TracingHarness, stack_id: int) -> bool:
    return any(Path(file).name == "cache_utils.py" for file in files_of(harness, stack_id))


def test_kv_cache_growth_is_attributed_to_transformers_cache_code(torch_worker):
    # GIVEN a Llama in a process without PyTorch's caching (every tensor is a cudaMalloc), warmed up
    worker = torch_worker({"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"})
    failures = []
    with TracingHarness([worker.pid]) as harness:
        worker.send(harness, op="init")
        worker.send(harness, LOAD_TIMEOUT_SECONDS, op="llama_load")
        worker.send(harness, op="decode", steps=8)
        worker.send(harness, op="drop_cache")
        quiesce(harness)
        ledger = harness.session.ledger
        baseline = ledger.physical_device_bytes(worker.pid)
        # WHEN it decodes 192 tokens for 4 sequences with transformers' dynamic KV cache
        kv = worker.send(harness, op="decode", steps=192)["kv"]
        quiesce(harness)
        grown = ledger.physical_device_bytes(worker.pid) - baseline
        blocks = runtime_entries(harness, worker.pid)
        kv_bytes = sum(size for _, size in kv)
        cache_code_bytes = sum(entry.size_bytes for entry in blocks.values()
                               if through_cache_code(harness, entry.stack_id))
        print(f"\nKV cache: {len(kv)} tensors, {kv_bytes} bytes; traced growth {grown} bytes; "
              f"held by stacks through cache_utils.py {cache_code_bytes} bytes")
        example = next((e for e in blocks.values() if e.key.address == kv[0][0]), None) if kv else None
        if example is not None and example.stack_id:
            print("a KV tensor's stack: " + " <- ".join(
                f"{f.function} ({Path(f.file).name}:{f.line})"
                for f in harness.session.stacks.get(example.stack_id).frames[:4]))
        # THEN every KV tensor is a traced block at its address, of its size, allocated in cache_utils.py
        for address, size in kv:
            entry = blocks.get(address)
            if entry is None or entry.size_bytes != size or not through_cache_code(harness, entry.stack_id):
                failures.append(f"KV tensor {address:#x} ({size} bytes): traced as {entry}")
        # AND the cache code's stacks hold exactly the KV cache, which is the process's growth
        if cache_code_bytes != kv_bytes:
            failures.append(f"stacks through cache_utils.py hold {cache_code_bytes}, the cache {kv_bytes}")
        if grown != kv_bytes:
            failures.append(f"the process grew {grown} bytes, the KV cache is {kv_bytes}")
        # WHEN the cache is dropped THEN outstanding memory is back at the baseline
        worker.send(harness, op="drop_cache")
        quiesce(harness)
        after = ledger.physical_device_bytes(worker.pid)
        print(f"after dropping the cache: {after} bytes (baseline {baseline})")
        if after != baseline:
            failures.append(f"after the drop {after} bytes, baseline {baseline}")
    check_all(failures)


MODES = {
    "caching": {},
    "no_caching": {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"},
    "expandable_segments": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
}


@pytest.mark.parametrize("mode", MODES)
def test_outstanding_equals_what_pytorch_holds_in_each_allocator_mode(torch_worker, mode):
    # GIVEN the Llama generating (batch 8, 256 + 32 tokens) in one of PyTorch's allocator modes
    worker = torch_worker(MODES[mode])
    failures = []
    with TracingHarness([worker.pid]) as harness:
        worker.send(harness, op="init")
        worker.send(harness, LOAD_TIMEOUT_SECONDS, op="llama_load")
        answer = worker.send(harness, op="generate", batch=8, prompt=256, new_tokens=32, calls=1)
        storages = worker.send(harness, op="live_storages")["storages"]
        quiesce(harness)
        ledger = harness.session.ledger
        reserved = answer["memory_reserved"]
        runtime = ledger.outstanding_bytes(worker.pid, layers=[Layer.RUNTIME])
        driver = ledger.outstanding_bytes(worker.pid, layers=[Layer.DRIVER])
        vmm = ledger.outstanding_bytes(worker.pid, layers=[Layer.VMM])
        kernel = harness.source.kernel_ledger()
        kernel_physical = sum(e.size_bytes for e in kernel if e.key.pid == worker.pid
                              and e.key.layer in (Layer.DRIVER, Layer.VMM) and e.memory is Memory.DEVICE
                              and e.key.object in (ObjectKind.ALLOCATION, ObjectKind.VMM_HANDLE))
        print(f"\n{mode}: memory_reserved={reserved} traced runtime={runtime} driver={driver} vmm={vmm} "
              f"kernel ledger physical={kernel_physical}")
        # THEN what PyTorch reserved is what kvtrace holds outstanding for it: cudaMalloc'd blocks
        # (caching), VMM handles (expandable segments); without caching PyTorch reports no reserve,
        # so every live tensor must be its own traced block instead
        if mode == "caching" and runtime != reserved:
            failures.append(f"cudaMalloc'd {runtime} != memory_reserved {reserved}")
        if mode == "expandable_segments" and vmm != reserved:
            failures.append(f"VMM handles {vmm} != memory_reserved {reserved}")
        if mode == "no_caching":
            blocks = runtime_entries(harness, worker.pid)
            live = [(address, size) for address, size in storages if size]
            missing = [(a, s) for a, s in live if a not in blocks or blocks[a].size_bytes != s]
            live_bytes = sum(size for _, size in live)
            print(f"no_caching: {len(live)} live storages, {live_bytes} bytes, all traced: {not missing}; "
                  f"cudaMalloc'd beyond them (workspaces): {runtime - live_bytes}")
            if missing:
                failures.append(f"{len(missing)} live storages not traced exactly, e.g. {missing[:3]}")
        # AND the user-space ledger equals the kernel's copy
        if driver + vmm != kernel_physical:
            failures.append(f"ledger physical {driver + vmm} != kernel ledger {kernel_physical}")
    check_all(failures)


def test_out_of_memory_is_reported_with_size_error_and_stack(torch_worker):
    # GIVEN a torch process with the default caching allocator
    worker = torch_worker()
    failures = []
    with TracingHarness([worker.pid]) as harness:
        worker.send(harness, op="init")
        # WHEN it asks for 1 TiB (the H200 has 141 GB)
        answer = worker.send(harness, op="oom", size_bytes=1 << 40)
        quiesce(harness)
        failed = harness.of(worker.pid, Kind.ALLOC_FAILED, Api.cudaMalloc)
        failed_driver = harness.of(worker.pid, Kind.ALLOC_FAILED, Api.cuMemAlloc_v2)
        print(f"\nOOM: torch raised OutOfMemoryError: {answer['oom']}; failed cudaMalloc calls "
              f"{[(e.size_bytes, e.error_code) for e in failed]}; failed cuMemAlloc_v2 "
              f"{[(e.size_bytes, e.error_code) for e in failed_driver]}")
        if failed and failed[0].stack_id:
            frame = harness.session.stacks.get(failed[0].stack_id).frames[0]
            print(f"failed call's innermost frame: {frame}")
        # THEN the failed call is reported with its size, the CUDA error and the Python stack
        if not answer["oom"]:
            failures.append("torch did not run out of memory")
        if not failed:
            failures.append("no failed cudaMalloc reported")
        for event in failed:
            frames = harness.session.stacks.get(event.stack_id).frames if event.stack_id else ()
            if (event.size_bytes, event.error_code) != (1 << 40, 2):  # cudaErrorMemoryAllocation
                failures.append(f"failed call reported as size {event.size_bytes}, error {event.error_code}")
            if not frames or (frames[0].function, frames[0].line) != ("allocate_too_much", source_line("# OOM_LINE")):
                failures.append(f"failed call's stack {frames[:2]}")
        # AND tracing goes on: the next allocation is traced
        answer = worker.send(harness, op="alloc", count=1, step_bytes=64 * MiB)
        address = answer["tensors"][0]["data_ptr"]
        if not harness.pump_until(lambda: any(e.address == address for e in harness.of(
                worker.pid, Kind.ALLOC, Api.cudaMalloc)), 10):
            failures.append("the allocation after the OOM was not traced")
        if harness.source.counters()["events_lost"]:
            failures.append(f"events lost: {harness.source.counters()['events_lost']}")
    check_all(failures)


def growth_rows(socket: Path) -> dict:
    from kvtrace.client import AgentClient

    with AgentClient.for_socket(socket) as client:
        response = client.growth()
    rows = {}
    for row in response.processes:  # one per process and GPU: keep the GPU it allocated on
        if row.pid not in rows or row.outstanding_bytes > rows[row.pid].outstanding_bytes:
            rows[row.pid] = row
    return response, rows


def nvml_processes() -> list[tuple[int, int | None]]:
    """(pid, used bytes) of every compute process on GPU 0, straight from NVML (for messages)."""
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    return [(p.pid, p.usedGpuMemory) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)]


def test_two_titled_workers_are_attributed_apart_and_nvml_agrees(torch_worker, agent_socket):
    # GIVEN the agent following processes titled like vLLM's tensor-parallel workers
    with AgentProcess(agent_socket, "--cmdline", "VLLM::Worker", "--site-sample-interval", "1") as agent:
        # WHEN two such workers allocate different amounts
        workers = {title: torch_worker(title=title) for title in ("VLLM::Worker_TP0", "VLLM::Worker_TP1")}
        reserved = {}
        for (_title, worker), (count, step) in zip(workers.items(), [(23, MiB), (10, 8 * MiB)], strict=True):
            worker.send(op="init")
            reserved[worker.pid] = worker.send(op="alloc", count=count, step_bytes=step)["memory_reserved"]

        def settled():
            _, rows = growth_rows(agent_socket)
            # NVML samples on its own interval: wait for a sample taken after the allocations
            return all(pid in rows and rows[pid].outstanding_bytes == reserved[pid]
                       and rows[pid].HasField("nvml_used_bytes")
                       and rows[pid].nvml_used_bytes >= reserved[pid] for pid in reserved) and rows

        rows = wait_for(settled, 30) or growth_rows(agent_socket)[1]
        response, _ = growth_rows(agent_socket)
        failures = []
        for title, worker in workers.items():
            row = rows.get(worker.pid)
            if row is None:
                failures.append(f"{title} (pid {worker.pid}) not in the analysis: {sorted(rows)}")
                continue
            used = row.nvml_used_bytes if row.HasField("nvml_used_bytes") else None
            unattributed = row.unattributed_bytes if row.HasField("unattributed_bytes") else None
            print(f"\n{title} pid {worker.pid}: title {row.title!r}, GPU {row.device} (NVML {row.nvml_index}), "
                  f"traced {row.outstanding_bytes}, memory_reserved {reserved[worker.pid]}, NVML used {used}, "
                  f"unattributed {unattributed} ({(unattributed or 0) / MiB:.0f} MiB)")
            # THEN each is attributed to its own pid and title, with what its PyTorch reserved
            if row.title != title:
                failures.append(f"pid {worker.pid} titled {row.title!r}, not {title!r}")
            # AND on the one GPU there is, by CUDA ordinal and NVML index (was "?": no cudaSetDevice)
            if (row.device, row.nvml_index) != (0, 0):
                failures.append(f"{title}: on GPU {row.device} (NVML {row.nvml_index}), not 0 (0)")
            if row.outstanding_bytes != reserved[worker.pid]:
                failures.append(f"{title}: traced {row.outstanding_bytes} != reserved {reserved[worker.pid]}")
            # AND NVML's figure for the pid minus the traced bytes is a CUDA context's size
            if unattributed is None or not 64 * MiB <= unattributed <= 2 * GiB:
                failures.append(f"{title}: unattributed {unattributed} is not a context's size "
                                f"(NVML sees {nvml_processes()})")
        if response.gpus:
            gpu = response.gpus[0]
            print(f"GPU 0 {gpu.name}: total {gpu.total_bytes}, used {gpu.used_bytes}, free {gpu.free_bytes}")
        print(f"agent log:\n{agent.stderr_text()[-2000:]}")
    check_all(failures)


def test_memory_held_before_the_agent_started_is_shown_from_nvml(torch_worker, agent_socket):
    # GIVEN a process holding 1.3 GiB before the agent starts (an agent restart on a busy host)
    worker = torch_worker()
    worker.send(op="init")
    before = worker.send(op="alloc", count=6, step_bytes=64 * MiB)["memory_reserved"]  # 1.3 GiB
    with AgentProcess(agent_socket, "--site-sample-interval", "1") as agent:
        # WHEN it allocates a little more, in view
        worker.send(op="alloc", count=1, step_bytes=16 * MiB)

        def settled():
            # the analysis runs on its own interval: wait for one that has the traced allocation
            row = growth_rows(agent_socket)[1].get(worker.pid)
            return row if row is not None and row.outstanding_bytes and row.HasField("nvml_used_bytes") else None

        row = wait_for(settled, 30) or growth_rows(agent_socket)[1].get(worker.pid)
        text = kvtrace("ps", "--socket", str(agent_socket)).stdout
        print(f"\nreserved before the agent {before}; kvtrace ps:\n{text}")
        if row is not None:
            print(f"row: traced {row.outstanding_bytes}, NVML {row.nvml_used_bytes}, predates {row.predates_agent}, "
                  f"GPU {row.device} (NVML {row.nvml_index})")
        print(f"agent log:\n{agent.stderr_text()[-1500:]}")
    # THEN ps says so, with NVML's figure beside the traced one, and the row is marked
    assert f"pid {worker.pid} predates the agent: NVML shows" in text
    assert row is not None and row.predates_agent and row.nvml_used_bytes >= before > row.outstanding_bytes
    assert (row.device, row.nvml_index) == (0, 0)


def test_planted_leak_is_ranked_first_with_its_true_rate_and_time_to_oom(torch_worker, agent_socket):
    # GIVEN a Llama decoding one token every 0.2 s, keeping 32 MiB per step in keep_activation()
    # (160 MiB/s), while its KV cache comes and goes
    worker = torch_worker(title="VLLM::EngineCore")
    worker.send(op="init")
    worker.send(timeout_seconds=LOAD_TIMEOUT_SECONDS, op="llama_load")
    worker.send(op="decode", steps=8)
    worker.send(op="drop_cache")
    steps, interval_seconds, leak_bytes = 200, 0.2, 32 * MiB
    true_rate = leak_bytes / interval_seconds
    worker.request(op="leaky_loop", steps=steps, interval_seconds=interval_seconds, leak_bytes=leak_bytes)
    started = time.monotonic()
    failures = []
    # WHEN the agent attaches to the running process (no restart) and watches for half a minute
    with AgentProcess(agent_socket, "-p", str(worker.pid), "--leak-min-age", "3",
                      "--site-sample-interval", "1", "--forecast-min-history", "10"):
        time.sleep(max(0.0, 34 - (time.monotonic() - started)))
        import pynvml

        response, rows = growth_rows(agent_socket)
        pynvml.nvmlInit()
        free_now = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).free
        result = kvtrace("leaks", "--socket", str(agent_socket), "--pid", str(worker.pid),
                         "--min-age", "3", "--json")
        text = kvtrace("leaks", "--socket", str(agent_socket), "--pid", str(worker.pid), "--min-age", "3",
                       "-n", "3").stdout
    loop = worker.answer(timeout_seconds=120)
    print(f"\nleaky loop: {loop}")
    print(text)
    row = rows.get(worker.pid)
    if result.returncode != 0 or row is None:
        pytest.fail(f"kvtrace leaks: {result.returncode} {result.stderr}; growth rows {sorted(rows)}")
    report = json.loads(result.stdout)
    first = report["suspects"][0] if report["suspects"] else None
    truth_oom = free_now / true_rate
    oom = row.time_to_oom_seconds if row.HasField("time_to_oom_seconds") else None
    print(f"truth: {true_rate / MiB:.1f} MiB/s, time-to-OOM {truth_oom:.0f} s (NVML free {free_now}); "
          f"agent: growth 1m {row.growth_bytes_per_second_1m / MiB:.1f} MiB/s, "
          f"15m {row.growth_bytes_per_second_15m / MiB:.1f} MiB/s over {row.history_seconds:.0f} s, "
          f"time-to-OOM {oom}; first suspect growth "
          f"{(first or {}).get('growth_bytes_per_second', 0) / MiB:.1f} MiB/s")
    # THEN `kvtrace leaks` names keep_activation first
    leak_line = source_line("# LEAK_ACTIVATION_LINE", LLAMA)
    top = first["stack"][0] if first and first["stack"] else None
    if not top or (top["function"], Path(top["file"]).name, top["line"]) != ("keep_activation", "llama.py", leak_line):
        failures.append(f"first suspect's stack {first and first['stack'][:3]}")
    # AND the process's growth, the suspect's growth and the time-to-OOM agree with the truth
    if loop["late_steps"] > steps // 20:
        failures.append(f"the loop missed its schedule {loop['late_steps']} times: the truth is off")
    for name, measured in [("growth 15m", row.growth_bytes_per_second_15m),
                           ("suspect growth", (first or {}).get("growth_bytes_per_second", 0))]:
        if abs(measured - true_rate) > 0.1 * true_rate:
            failures.append(f"{name} {measured:.0f} B/s, truth {true_rate:.0f} B/s")
    if oom is None or abs(oom - truth_oom) > 0.15 * truth_oom:
        failures.append(f"time-to-OOM {oom}, truth {truth_oom:.0f} s")
    worker.close()
    check_all(failures)


def test_worker_file_markers_exist():
    """The markers the scenarios look up are in the workload files (a cheap check that runs
    wherever torch imports)."""
    assert source_line("# OOM_LINE") > 0 and source_line("# ALLOC_LINE", WORKER) > 0
    assert source_line("# LEAK_ACTIVATION_LINE", LLAMA) > 0
