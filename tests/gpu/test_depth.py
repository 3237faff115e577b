"""Depth per process on real CUDA: the agent as shipped (--blocks auto) finds a planted leak by itself.

GIVEN a torch worker traced by `kvtrace agent -p PID` as shipped (depth segments: its PyTorch semaphores at
zero), WHEN it starts keeping a 256 KiB clone of an activation every 0.05 s among 32 MiB temporaries (the
temporaries are what make the cache grow: a segment's stack names the wrong function; the clones are under the
sample size, 512 KiB, so their bytes are estimated from the sampled ones), THEN the agent raises it to depth
blocks within 60 s of the growth starting, and `kvtrace leaks` ranks the function that keeps the clones first
within 120 s, its estimated bytes within 25 % of the clones made since the raise."""
import time

from conftest import TorchWorker, source_line
from kvtrace.client import AgentClient
from kvtrace.model.depth import Depth

MiB = 1 << 20
CLONE_BYTES = 256 << 10
TEMPORARY_BYTES = 32 * MiB
INTERVAL_SECONDS = 0.05
STEPS = 2400  # 120 s


def depth_of(client: AgentClient, pid: int):
    for process in client.processes():
        if process.pid == pid and process.HasField("depth"):
            return process.depth
    return None


def test_a_planted_leak_raises_depth_and_names_its_holder(agent_socket):
    from agent_process import AgentProcess

    worker = TorchWorker({})
    try:
        worker.send(op="init")
        # The worker started seconds ago: no start-up grace, or the test would wait two minutes for it.
        with AgentProcess(agent_socket, "-p", str(worker.pid), "--no-nvml", "--deepen-grace-seconds", "0",
                          "--leak-min-age", "0", "--site-sample-interval", "2") as agent, \
                AgentClient.for_socket(agent_socket) as client:
            worker.send(op="alloc", count=1, step_bytes=MiB)  # holds memory: the policy follows it
            deadline = time.monotonic() + 10
            while (state := depth_of(client, worker.pid)) is None and time.monotonic() < deadline:
                time.sleep(0.2)
            assert state is not None and state.depth == Depth.SEGMENTS, state
            started = time.monotonic()
            worker.request(op="clone_leak", steps=STEPS, interval_seconds=INTERVAL_SECONDS, keep_bytes=CLONE_BYTES,
                           temporary_bytes=TEMPORARY_BYTES)
            raised_after = None
            first_after = None
            suspect = None
            while time.monotonic() - started < 120:
                state = depth_of(client, worker.pid)
                if raised_after is None and state is not None and state.depth >= Depth.BLOCKS:
                    raised_after = time.monotonic() - started
                    raised_wall_ns = state.since_ns
                    print(f"\nraised to {Depth(state.depth).label} after {raised_after:.1f} s: {state.detail}")
                if raised_after is not None:
                    report = client.leak_suspects(pids=[worker.pid], min_age_seconds=0)
                    if report.suspects and report.suspects[0].stack.frames:
                        top = report.suspects[0].stack.frames[0]
                        if (top.function, top.line) == ("keep_activation", source_line("# KEEP_CLONE_LINE")):
                            first_after = time.monotonic() - started
                            suspect = report.suspects[0]
                            break
                time.sleep(1.0)
            print(f"agent counters: { {k: v for k, v in agent.counters().items() if v} }")
    finally:
        worker.process.kill()
    assert raised_after is not None and raised_after <= 60, raised_after
    assert first_after is not None and first_after <= 120, first_after
    # The clones made since the raise (their blocks are known from then), estimated from the sampled ones.
    true_bytes = (report.timestamp_ns - raised_wall_ns) / 1e9 / INTERVAL_SECONDS * CLONE_BYTES
    print(f"holder ranked first after {first_after:.1f} s: {suspect.outstanding_bytes / MiB:.0f} MiB in "
          f"{suspect.allocation_count} blocks (estimated: {suspect.estimated}); clones made since the raise "
          f"about {true_bytes / MiB:.0f} MiB")
    assert abs(suspect.outstanding_bytes - true_bytes) <= 0.25 * true_bytes + CLONE_BYTES
