"""A torch process driven line by line over stdin/stdout (JSON), for the GPU tests.

Each command is one JSON object on stdin; each answer is one JSON object on stdout. The allocating
functions have fixed names and lines so that tests can check the Python stacks kvtrace records.
"""
import json
import sys

import torch

kept = []


def allocate_tensors(count, step_bytes):
    tensors = []
    for index in range(count):
        tensors.append(torch.empty((index + 1) * step_bytes, dtype=torch.uint8, device="cuda"))  # ALLOC_LINE
    return tensors


def leak_one_per_step(steps, size_bytes):
    for _ in range(steps):
        kept.append(torch.empty(size_bytes, dtype=torch.uint8, device="cuda"))  # LEAK_LINE


def churn(steps, size_bytes):
    for _ in range(steps):
        scratch = torch.empty(size_bytes, dtype=torch.uint8, device="cuda")
        del scratch


def stats():
    torch.cuda.synchronize()
    return {"memory_reserved": torch.cuda.memory_reserved(),
            "memory_allocated": torch.cuda.memory_allocated()}


def main():
    print(json.dumps({"ready": True, "pid": __import__("os").getpid()}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        if op == "init":
            torch.cuda.init()
            torch.cuda.set_device(command.get("device", 0))
            answer = {"device_count": torch.cuda.device_count()}
        elif op == "alloc":
            tensors = allocate_tensors(command["count"], command["step_bytes"])
            kept.extend(tensors)
            answer = {"tensors": [{"data_ptr": t.data_ptr(),
                                   "nbytes": t.untyped_storage().nbytes()} for t in tensors]}
            del tensors  # only `kept` holds them, so "free" really frees them
        elif op == "leak":
            leak_one_per_step(command["steps"], command["size_bytes"])
            answer = {"kept": len(kept)}
        elif op == "churn":
            churn(command["steps"], command["size_bytes"])
            answer = {}
        elif op == "free":
            kept.clear()
            torch.cuda.synchronize()
            if command.get("empty_cache"):
                torch.cuda.empty_cache()
            answer = {}
        elif op == "oom":
            try:
                torch.empty(command["size_bytes"], dtype=torch.uint8, device="cuda")
                answer = {"oom": False}
            except torch.OutOfMemoryError:
                answer = {"oom": True}
        elif op == "exit":
            print(json.dumps({"bye": True}), flush=True)
            return
        else:
            answer = {"error": f"unknown op {op}"}
        answer.update(stats() if op != "init" else {})
        answer["op"] = op
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
