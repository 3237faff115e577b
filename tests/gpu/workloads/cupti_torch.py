"""A torch workload for `kvtrace run` (CUPTI inside the process) with a planted leak and known truth.

    python cupti_torch.py MODE [--profiler-first] [--pairs N]
    MODE: caching | expandable | nocache (the allocator mode, set before torch is imported)
    -> initialises CUDA (kvtrace run's tracer subscribes then), prints {"ready": pid}, waits for a
       line on stdin (the agent attaches meanwhile), then
    -> plants a leak from plant_leak() (23 tensors of 3 MiB, 11 freed again: 12 kept), churns 200
       temporaries of 5 MiB from churn() and two of 1 GiB, then prints one JSON line of truth:
       {"pid", "mode", "kept": [[data_ptr, nbytes], ...], "reserved_bytes", "time_ns", ...}
    -> waits for a line on stdin, then exits normally (the tracer flushes at exit)
    --profiler-first: torch.profiler (Kineto, holding CUPTI) runs around all of it, started before
       CUDA is initialised; the truth line then has "profiler_cuda_events" (kernels it recorded).
    --profiler-later: torch.profiler runs after the work (kvtrace run traces by then), around more churn.
    --pairs N: instead, N torch.empty(1 MiB) + del pairs timed; prints {"ns_per_pair"} (bench/).
    --generate N: instead, N generate() calls of the random 8-layer Llama (llama.py; batch 8, 256 prompt
       + 128 new tokens); prints {"tokens_per_second"} (bench/).
    Both print {"ready": pid} after warming up and wait for a line on stdin before measuring.
"""
import json
import os
import sys
import time

MODE = sys.argv[1]
if MODE == "expandable":
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
elif MODE == "nocache":
    os.environ["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
elif MODE != "caching":
    raise SystemExit(f"unknown mode {MODE}: caching, expandable or nocache")

import torch  # noqa: E402

MiB = 1 << 20
kept = []


def plant_leak(count, nbytes):
    for _ in range(count):
        kept.append(torch.empty(nbytes, dtype=torch.uint8, device="cuda"))  # LEAK_LINE


def churn(rounds, nbytes):
    for _ in range(rounds):
        scratch = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        scratch.fill_(1)
        del scratch


def big_temporaries():
    for _ in range(2):
        scratch = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        del scratch


def work():
    plant_leak(23, 3 * MiB)
    churn(200, 5 * MiB)
    del kept[:11]
    big_temporaries()
    torch.cuda.synchronize()


def pairs(count):
    torch.empty(1, device="cuda")
    for _ in range(500):
        del_me = torch.empty(MiB, dtype=torch.uint8, device="cuda")
        del del_me
    print(json.dumps({"ready": os.getpid()}), flush=True)
    sys.stdin.readline()
    started = time.perf_counter_ns()
    for _ in range(count):
        del_me = torch.empty(MiB, dtype=torch.uint8, device="cuda")
        del del_me
    torch.cuda.synchronize()
    return (time.perf_counter_ns() - started) / count


def ready():
    torch.cuda.init()
    print(json.dumps({"ready": os.getpid()}), flush=True)
    sys.stdin.readline()


def main():
    if "--pairs" in sys.argv:
        count = int(sys.argv[sys.argv.index("--pairs") + 1])
        print(json.dumps({"ns_per_pair": pairs(count)}), flush=True)
        return
    if "--generate" in sys.argv:
        from llama import build_model, generate

        model = build_model()
        generate(model, calls=1)
        print(json.dumps({"ready": os.getpid()}), flush=True)
        sys.stdin.readline()
        result = generate(model, calls=int(sys.argv[sys.argv.index("--generate") + 1]))
        print(json.dumps({"tokens_per_second": result["tokens"] / result["seconds"]}), flush=True)
        return
    truth = {"pid": os.getpid(), "mode": MODE}
    if "--profiler-first" in sys.argv:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
            ready()
            work()
        truth["profiler_cuda_events"] = sum(1 for event in profiler.events()
                                            if event.device_type == torch.autograd.DeviceType.CUDA)
    else:
        ready()
        work()
    if "--profiler-later" in sys.argv:  # kvtrace traces already: it must give CUPTI to the profiler
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
            churn(20, 5 * MiB)
            torch.cuda.synchronize()
        truth["profiler_cuda_events"] = sum(1 for event in profiler.events()
                                            if event.device_type == torch.autograd.DeviceType.CUDA)
    truth.update(kept=[[tensor.data_ptr(), tensor.numel()] for tensor in kept],
                 reserved_bytes=torch.cuda.memory_reserved(), allocated_bytes=torch.cuda.memory_allocated(),
                 device_allocs=torch.cuda.memory_stats().get("num_device_alloc", -1),
                 device_frees=torch.cuda.memory_stats().get("num_device_free", -1),
                 time_ns=time.time_ns())
    print(json.dumps(truth), flush=True)
    sys.stdin.readline()


if __name__ == "__main__":
    main()
