"""`kvtrace agent -p PID` on real CUDA: a torch process that was running before the agent is traced,
alone and beside the other probes the overhead benchmark plants (bench/gpu_overhead.py: empty bcc
probes on the same functions for another process, and more agents, each following its own process).

The benchmark's agents once recorded no event at all on the GPU machine while the in-process
scenario tests traced the same kind of worker; these tests print each agent's counters and log, then
assert that every pair was seen.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from agent_process import AgentProcess

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

PAIRS = 2000
EVENTS_PER_PAIR = 4  # cudaMalloc and the cuMemAlloc inside it, cudaFree and its cuMemFree


def traced_events(agent: AgentProcess, worker, label: str) -> int:
    """Events the agent's probes submitted or lost while `worker` made PAIRS pairs; prints the figures."""
    before = agent.counters()
    worker.send(op="pairs", count=PAIRS, depth=4)
    time.sleep(1.0)
    after = agent.counters()
    delta = {name: after.get(name, 0) - before.get(name, 0) for name in after}
    seen = delta.get("events_submitted", 0) + delta.get("events_lost", 0)
    print(f"\n{label}: pid {worker.pid}, {PAIRS} pairs: submitted+lost {seen}; changed counters "
          f"{ {name: value for name, value in delta.items() if value} }; "
          f"attached {after.get('probe_sets_attached')} probe sets, {after.get('libraries_attached')} libraries")
    if seen < EVENTS_PER_PAIR * PAIRS:
        print(f"{label}: agent log:\n{agent.stderr_text()[-6000:]}")
        maps = sorted({line.split()[-1] for line in open(f"/proc/{worker.pid}/maps")
                       if "libcud" in line or "libnvidia" in line})
        print(f"{label}: the worker maps {maps}")
    return seen


def test_an_agent_following_a_running_torch_process_sees_every_pair(torch_worker, agent_socket):
    # GIVEN a torch process that initialised CUDA before any agent ran
    worker = torch_worker()
    worker.send(op="init")
    worker.send(op="pairs", count=10, depth=0)
    # WHEN an agent follows it by pid and it makes PAIRS cudaMalloc+cudaFree pairs
    with AgentProcess(agent_socket, "-p", str(worker.pid), "--no-nvml", "-v") as agent:
        seen = traced_events(agent, worker, "alone")
    # THEN the probes saw every call of them
    assert seen >= EVENTS_PER_PAIR * PAIRS


def test_agents_beside_empty_probes_and_each_other_see_every_pair(torch_worker, agent_socket):
    # GIVEN three running torch processes, the first with empty bcc probes (perf-event uprobes, for
    # its pid) on every function kvtrace probes, as in the overhead benchmark
    from benchlib import empty_probes
    from kvtrace.sources.bpf.discovery import Discovery

    workers = [torch_worker() for _ in range(3)]
    for worker in workers:
        worker.send(op="init")
        worker.send(op="pairs", count=10, depth=0)
    points = [(target.path, symbol, workers[0].pid) for target in Discovery().scan_pid(workers[0].pid)
              for symbol in target.symbols]
    empty = empty_probes(points)
    print(f"\nempty probes: {2 * len(points)} for pid {workers[0].pid}")
    # WHEN two agents each follow one of the others, one with stacks and one without
    second_socket = agent_socket.parent / "second.sock"
    try:
        with AgentProcess(agent_socket, "-p", str(workers[1].pid), "-v") as first, \
                AgentProcess(second_socket, "--no-nvml", "--no-python-stacks",
                             "-p", str(workers[2].pid), "-v") as second:
            seen = {"with stacks": traced_events(first, workers[1], "beside empty probes, stacks"),
                    "without stacks": traced_events(second, workers[2], "beside empty probes, no stacks")}
    finally:
        empty.cleanup()
    # THEN each saw every call its process made
    assert all(value >= EVENTS_PER_PAIR * PAIRS for value in seen.values()), seen
