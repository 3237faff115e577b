"""A torch process that leaks GPU memory from one function until a real out-of-memory kills it.

    python oom_leak.py STEP_MIB
    -> "ready <pid>" once CUDA is up; waits for a line on stdin
    -> loads 256 MiB of "weights", then keeps one STEP_MIB tensor per step from leak_activations()
       while churn() allocates and frees, until torch raises OutOfMemoryError
    -> prints one JSON line {"leaked": N, "step_bytes": ..., "leaked_ptrs": [...]} and re-raises:
       the process exits with status 1, holding its memory, as a server dies of an OOM.
"""
import json
import os
import sys

import torch

MiB = 1 << 20
kept = []


def load_weights():
    kept.append(torch.empty(256 * MiB, dtype=torch.uint8, device="cuda"))


def leak_activations(step_bytes):
    kept.append(torch.empty(step_bytes, dtype=torch.uint8, device="cuda"))  # LEAK_LINE


def churn():
    scratch = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    del scratch


def main():
    step_bytes = int(sys.argv[1]) * MiB
    torch.cuda.init()
    torch.empty(1, device="cuda")  # the CUDA context and libcudart are up: the agent can attach
    print(f"ready {os.getpid()}", flush=True)
    sys.stdin.readline()
    load_weights()
    leaked = []
    try:
        while True:
            leak_activations(step_bytes)
            leaked.append(kept[-1].data_ptr())
            churn()
    except torch.OutOfMemoryError:
        print(json.dumps({"leaked": len(leaked), "step_bytes": step_bytes, "leaked_ptrs": leaked}), flush=True)
        raise


if __name__ == "__main__":
    main()
