"""A vLLM 0.24 engine with a random 8-layer Llama (no download, no tokenizer) under sleep mode, driven
over stdin by tests/gpu/test_vllm_placement.py and test_vllm.py. Prints `ready` once it generated,
then answers one command per line:

    sleep [LEVEL]   llm.sleep(level)                       -> slept
    wake            llm.wake_up()                          -> woke
    generate        a small batch                          -> generated
    truth           what vLLM itself holds, from inside the engine process (KV tensors, weights,
                    CuMemAllocator pools by tag, torch's reserved bytes) -> truth {json}
    leak            plants an abort-path leak (aborted requests named leak-* keep their blocks), runs
                    4 leak-* and 2 abort-* requests a few steps, aborts all six, then one short request
                    so that vLLM's metrics are taken after the aborts -> leaked {json: request ids}
    grow BYTES      a thread in the engine allocates 8 MiB every 50 ms up to BYTES and keeps it -> growing
    ungrow          frees what grow allocated                -> ungrown
    clone_leak BYTES SECONDS  a thread in the engine keeps a BYTES clone every SECONDS (fixed schedule),
                    from _keep_clone(), for as long as the engine runs -> cloning {json: pid}
    clones_since NS UNTIL_NS  how many clones the thread made between the two times (time.time_ns()) -> clones {json}
    throughput N T  N prompts of 64 tokens, T new tokens each -> throughput {json: tokens_per_second}
    exit

KVTRACE_TEST_SLEEP_MODE=0 starts it without sleep mode (bench/vllm_overhead.py);
KVTRACE_TEST_ENFORCE_EAGER=0 with CUDA graphs (bench/depth_overhead.py --workload vllm --graphs). With
KVTRACE_TEST_METRICS_PORT set, vLLM's own Prometheus metrics (its PrometheusStatLogger, the figures
the OpenAI server's /metrics shows) are served on 127.0.0.1:PORT/metrics.
"""
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # flashinfer is not in the offline bundle
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with this file's functions

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000,
          "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
          "num_attention_heads": 16, "num_key_value_heads": 16, "max_position_embeddings": 4096,
          "rms_norm_eps": 1e-5, "hidden_act": "silu", "torch_dtype": "bfloat16", "tie_word_embeddings": False}
PROMPT = list(range(1, 65))
GROW_STEP_BYTES = 8 << 20


# ---- run inside the engine process through collective_rpc (self = vLLM's Worker) ----

def _truth(worker) -> dict:
    import torch
    from vllm.device_allocator.cumem import CuMemAllocator

    runner = worker.model_runner
    storages: dict[int, int] = {}
    tensors = list(runner.kv_caches)
    while tensors:
        tensor = tensors.pop()
        if isinstance(tensor, (list, tuple)):
            tensors.extend(tensor)
            continue
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    pools: dict[str, int] = {}
    for data in CuMemAllocator.get_instance().pointer_to_data.values():
        pools[data.tag] = pools.get(data.tag, 0) + data.handle[1]
    model = runner.model
    return {"pid": os.getpid(), "kv_tensor_bytes": sum(storages.values()), "kv_tensors": len(storages),
            "weights_param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "weights_buffer_bytes": sum(b.numel() * b.element_size() for b in model.buffers()),
            "pools": pools, "torch_reserved_bytes": torch.cuda.memory_reserved(),
            "torch_allocated_bytes": torch.cuda.memory_allocated(),
            "num_gpu_blocks": worker.cache_config.num_gpu_blocks}


def _plant_abort_leak(worker) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import RequestStatus

    original = Scheduler._free_request_blocks

    def leaky(self, request):
        if request.status == RequestStatus.FINISHED_ABORTED and request.request_id.startswith("leak-"):
            return  # the planted bug: an aborted request's blocks never go back to the pool
        return original(self, request)

    Scheduler._free_request_blocks = leaky


def _grow(worker, limit_bytes: int) -> None:
    import threading
    import time

    import torch

    held = worker.__dict__.setdefault("_kvtrace_grown", [])

    def loop() -> None:
        while len(held) * GROW_STEP_BYTES < limit_bytes:
            held.append(torch.empty(GROW_STEP_BYTES, dtype=torch.uint8, device="cuda"))
            time.sleep(0.05)

    threading.Thread(target=loop, daemon=True).start()


def _ungrow(worker) -> None:
    import torch

    worker.__dict__.pop("_kvtrace_grown", None)
    torch.cuda.empty_cache()


def _keep_clone(held: list, activation) -> None:
    """The planted leak of tests/gpu/test_vllm_depth.py: a clone kept for ever, with when it was made."""
    held.append((time.time_ns(), activation.clone()))  # KEEP_CLONE_LINE


def _clone_leak(worker, keep_bytes: int, interval_seconds: float) -> int:
    import threading

    import torch

    held = worker.__dict__.setdefault("_kvtrace_clones", [])
    activation = torch.ones(keep_bytes, dtype=torch.uint8, device="cuda")

    def loop() -> None:
        start = time.monotonic()
        step = 0
        while True:
            _keep_clone(held, activation)
            step += 1
            time.sleep(max(0.0, start + step * interval_seconds - time.monotonic()))

    threading.Thread(target=loop, daemon=True).start()
    return os.getpid()


def _clones_since(worker, since_ns: int, until_ns: int) -> dict:
    held = list(worker.__dict__.get("_kvtrace_clones", []))
    return {"since": sum(1 for made_ns, _ in held if since_ns <= made_ns <= until_ns), "kept": len(held)}


# ---- the driver ----

def _leak(llm: LLM, params: SamplingParams) -> dict:
    llm.collective_rpc(_plant_abort_leak)
    engine = llm.llm_engine
    long = SamplingParams(max_tokens=2000, ignore_eos=True, detokenize=False)
    names = [f"leak-{i}" for i in range(4)] + [f"abort-{i}" for i in range(2)]
    for name in names:
        engine.add_request(name, TokensPrompt(prompt_token_ids=PROMPT), long)
    for _ in range(4):
        engine.step()
    engine.abort_request(names)
    while engine.has_unfinished_requests():
        engine.step()
    llm.generate([TokensPrompt(prompt_token_ids=PROMPT[:8])], SamplingParams(max_tokens=1, detokenize=False))
    return {"leaked": names[:4], "aborted": names[4:]}


def main() -> None:
    model = tempfile.mkdtemp(prefix="kvtrace-llama-")
    with open(os.path.join(model, "config.json"), "w") as file:
        json.dump(CONFIG, file)
    port = os.environ.get("KVTRACE_TEST_METRICS_PORT")
    # KVTRACE_TEST_ENFORCE_EAGER=0: CUDA graphs (captured at start-up), as vLLM runs by default.
    eager = os.environ.get("KVTRACE_TEST_ENFORCE_EAGER", "1") == "1"
    llm = LLM(model=model, load_format="dummy", skip_tokenizer_init=True, enforce_eager=eager,
              gpu_memory_utilization=0.2, attention_config={"backend": "TRITON_ATTN"},
              enable_sleep_mode=os.environ.get("KVTRACE_TEST_SLEEP_MODE", "1") == "1",
              disable_log_stats=not port)
    if port:
        import prometheus_client

        prometheus_client.start_http_server(int(port), addr="127.0.0.1")
    prompts = [TokensPrompt(prompt_token_ids=PROMPT)] * 4
    params = SamplingParams(max_tokens=16, ignore_eos=True, detokenize=False)
    llm.generate(prompts, params)
    print("ready", flush=True)
    for line in sys.stdin:
        command, *args = line.split()
        if command == "sleep":
            llm.sleep(level=int(args[0]) if args else 1)
            print("slept", flush=True)
        elif command == "wake":
            llm.wake_up()
            print("woke", flush=True)
        elif command == "generate":
            llm.generate(prompts, params)
            print("generated", flush=True)
        elif command == "truth":
            print("truth " + json.dumps(llm.collective_rpc(_truth)[0]), flush=True)
        elif command == "leak":
            print("leaked " + json.dumps(_leak(llm, params)), flush=True)
        elif command == "grow":
            llm.collective_rpc(_grow, args=(int(args[0]),))
            print("growing", flush=True)
        elif command == "ungrow":
            llm.collective_rpc(_ungrow)
            print("ungrown", flush=True)
        elif command == "clone_leak":
            pid = llm.collective_rpc(_clone_leak, args=(int(args[0]), float(args[1])))[0]
            print("cloning " + json.dumps({"pid": pid}), flush=True)
        elif command == "clones_since":
            print("clones " + json.dumps(llm.collective_rpc(_clones_since, args=(int(args[0]), int(args[1])))[0]),
                  flush=True)
        elif command == "throughput":
            batch = [TokensPrompt(prompt_token_ids=PROMPT)] * int(args[0])
            started = time.perf_counter()
            outputs = llm.generate(batch, SamplingParams(max_tokens=int(args[1]), ignore_eos=True, detokenize=False),
                                   use_tqdm=False)
            seconds = time.perf_counter() - started
            tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
            print("throughput " + json.dumps({"tokens": tokens, "seconds": seconds,
                                              "tokens_per_second": tokens / seconds}), flush=True)
        elif command == "exit":
            break


if __name__ == "__main__":
    main()
