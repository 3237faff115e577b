"""A vLLM 0.24 engine with a random 8-layer Llama (no download, no tokenizer) under sleep mode, driven
over stdin for tests/gpu/test_vllm_placement.py: prints `ready` once it generated, then answers
`sleep` / `wake` / `exit` lines with `slept` / `woke`.
"""
import json
import os
import sys
import tempfile

os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # flashinfer is not in the offline bundle

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000,
          "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
          "num_attention_heads": 16, "num_key_value_heads": 16, "max_position_embeddings": 4096,
          "rms_norm_eps": 1e-5, "hidden_act": "silu", "torch_dtype": "bfloat16", "tie_word_embeddings": False}


def main() -> None:
    model = tempfile.mkdtemp(prefix="kvtrace-llama-")
    with open(os.path.join(model, "config.json"), "w") as file:
        json.dump(CONFIG, file)
    llm = LLM(model=model, load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
              gpu_memory_utilization=0.2, attention_config={"backend": "TRITON_ATTN"}, enable_sleep_mode=True)
    prompts = [TokensPrompt(prompt_token_ids=list(range(1, 65)))] * 4
    params = SamplingParams(max_tokens=16, ignore_eos=True, detokenize=False)
    llm.generate(prompts, params)
    print("ready", flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "sleep":
            llm.sleep(level=1)
            print("slept", flush=True)
        elif command == "wake":
            llm.wake_up()
            llm.generate(prompts, params)
            print("woke", flush=True)
        elif command == "exit":
            break


if __name__ == "__main__":
    main()
