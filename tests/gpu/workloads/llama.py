"""A small Llama-architecture model from transformers with random weights (no downloads), and the
loops the GPU tests and benchmarks run on it.

Functions keep fixed names so that tests can find them in the Python stacks kvtrace records:
`keep_activation` is the planted leak; transformers' own cache code (cache_utils.py) allocates the
KV cache.
"""
from __future__ import annotations

import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

try:
    from transformers import DynamicCache
except ImportError:  # older transformers
    from transformers.cache_utils import DynamicCache

VOCAB = 32000


def build_model(device: str = "cuda", layers: int = 8, hidden: int = 1024, seed: int = 0) -> LlamaForCausalLM:
    """An 8-layer, 1024-wide Llama (about 165 M parameters) in bfloat16 on `device`."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64,
                         num_key_value_heads=hidden // 64, max_position_embeddings=4096)
    model = LlamaForCausalLM(config).to(dtype=torch.bfloat16).to(device).eval()
    # Random weights never produce the end-of-sequence token on purpose; take it away so that every
    # generate call makes exactly max_new_tokens.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def prompt(batch: int, length: int, device: str, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (batch, length), generator=generator).to(device)


def generate(model, batch: int = 8, prompt_tokens: int = 256, new_tokens: int = 128, calls: int = 4) -> dict:
    """`calls` generate() calls (dynamic KV cache, greedy); returns tokens made and seconds taken."""
    device = next(model.parameters()).device
    ids = prompt(batch, prompt_tokens, device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.inference_mode():
        for _ in range(calls):
            model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {"tokens": batch * new_tokens * calls, "seconds": seconds}


def new_cache() -> DynamicCache:
    return DynamicCache()


def decode(model, cache: DynamicCache, batch: int, prompt_tokens: int, steps: int) -> None:
    """A prompt, then `steps` greedy tokens one at a time, all through `cache` (which keeps growing)."""
    device = next(model.parameters()).device
    ids = prompt(batch, prompt_tokens, device)
    with torch.inference_mode():
        for _ in range(steps + 1):
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
            ids = logits[:, -1:].argmax(-1)
            del logits


def cache_tensors(cache: DynamicCache) -> list[torch.Tensor]:
    """The key and value tensors the cache holds (transformers >= 4.56 keeps them per layer)."""
    if hasattr(cache, "layers"):
        return [t for layer in cache.layers for t in (layer.keys, layer.values) if t is not None and t.numel()]
    return [t for t in (*cache.key_cache, *cache.value_cache) if t.numel()]


def keep_activation(kept: list, size_bytes: int, device) -> None:
    """The planted leak: one tensor per step that nothing ever frees."""
    kept.append(torch.empty(size_bytes, dtype=torch.uint8, device=device))  # LEAK_ACTIVATION_LINE


def leaky_decode_loop(model, kept: list, steps: int, interval_seconds: float, leak_bytes: int,
                      cache_reset_every: int = 32) -> dict:
    """One decode step every `interval_seconds` (on a fixed schedule), each keeping `leak_bytes`;
    the KV cache is dropped every `cache_reset_every` steps, as finished requests would be."""
    device = next(model.parameters()).device
    cache, ids = new_cache(), prompt(1, 16, device)
    start = time.monotonic()
    late_steps = 0
    with torch.inference_mode():
        for step in range(steps):
            if step % cache_reset_every == 0:
                cache, ids = new_cache(), prompt(1, 16, device, seed=step)
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
            ids = logits[:, -1:].argmax(-1)
            del logits
            keep_activation(kept, leak_bytes, device)
            if device.type == "cuda":
                torch.cuda.synchronize()
            pause = start + (step + 1) * interval_seconds - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            else:
                late_steps += 1
    return {"leak_bytes_per_second": leak_bytes / interval_seconds, "late_steps": late_steps,
            "seconds": time.monotonic() - start}
