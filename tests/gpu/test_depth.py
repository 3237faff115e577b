"""Depth per process on real CUDA: the agent as shipped (--blocks auto) finds a planted leak by itself.

GIVEN a torch worker traced by `kvtrace agent -p PID` as shipped (depth segments: its PyTorch semaphores at
zero), WHEN it starts keeping a 256 KiB clone of an activation every 0.05 s among 32 MiB temporaries (the
clones are under the sample size, 512 KiB, so their bytes are estimated from the sampled ones), THEN the agent
raises it to depth blocks within 60 s of the growth starting, and `kvtrace leaks` ranks the function that keeps
the clones first within 120 s, its estimated bytes within 25 % of the clones made since the raise.
AND WHEN another process then takes all but 96 MiB of the GPU, so that the leak runs the worker out of memory,
THEN the flight recorder's `oom` dump, replayed, ranks the same function first.
Twice: with PyTorch's own probe sites (a trap per pytorch:malloc/free), and with kvtrace's PyTorch hook in the
worker (agent/kvtrace/sources/torch_hook: blocks in batches through kvtrace:blocks), which the agent then links
instead.

Figures are printed first (run with -s), then every check is asserted at once."""
import json
import re
import subprocess
import sys
import time

import pytest

from agent_process import AgentProcess, kvtrace
from conftest import TorchWorker, check_all, source_line, wait_for
from kvtrace.client import AgentClient
from kvtrace.model.depth import Depth

MiB = 1 << 20
CLONE_BYTES = 256 << 10
TEMPORARY_BYTES = 32 * MiB
INTERVAL_SECONDS = 0.05
STEPS = 4800  # 240 s: the ranking (120 s at most), then the OOM
HEADROOM_BYTES = 96 * MiB  # what the ballast leaves free: about 20 s of clones and their 2 MiB segments

BALLAST = """
import sys, time, torch
free, _ = torch.cuda.mem_get_info()
ballast = torch.empty(free - int(sys.argv[1]), dtype=torch.uint8, device="cuda")
print("ready", ballast.numel(), flush=True)
time.sleep(600)
"""


def depth_of(client: AgentClient, pid: int):
    for process in client.processes():
        if process.pid == pid and process.HasField("depth"):
            return process.depth
    return None


def keeps_the_clones(frame: dict) -> bool:
    return (frame.get("function"), frame.get("line")) == ("keep_activation", source_line("# KEEP_CLONE_LINE"))


@pytest.mark.parametrize("hooked", [False, True], ids=["pytorch-sites", "kvtrace-hook"])
def test_a_planted_leak_raises_depth_and_names_its_holder(agent_socket, hooked):
    flight_dir = agent_socket.parent / "flight"
    failures: list[str] = []
    worker = TorchWorker({})
    ballast = None
    report = suspect = None
    try:
        worker.send(op="init")
        if hooked:
            built = worker.send(timeout_seconds=300, op="torch_hook")
            print(f"\nkvtrace's PyTorch hook attached: {built['library']} (built in {built['build_seconds']:.1f} s)")
        # The worker started seconds ago: no start-up grace, or the test would wait two minutes for it.
        # -v: the agent logs which library it linked PyTorch's blocks through (checked below).
        with AgentProcess(agent_socket, "-v", "-p", str(worker.pid), "--no-nvml", "--deepen-grace-seconds", "0",
                          "--leak-min-age", "0", "--site-sample-interval", "2",
                          "--flight-dir", str(flight_dir)) as agent, \
                AgentClient.for_socket(agent_socket) as client:
            worker.send(op="alloc", count=1, step_bytes=MiB)  # holds memory: the policy follows it
            assert wait_for(lambda: depth_of(client, worker.pid), 10), "the agent reports no depth"
            state = depth_of(client, worker.pid)
            print(f"\nbefore the leak: depth {Depth(state.depth).label} ({state.detail})")
            if state.depth != Depth.SEGMENTS:
                failures.append(f"a healthy worker starts at {Depth(state.depth).label}, not segments")
            started = time.monotonic()
            worker.request(op="clone_leak", steps=STEPS, interval_seconds=INTERVAL_SECONDS, keep_bytes=CLONE_BYTES,
                           temporary_bytes=TEMPORARY_BYTES)
            raised_after = first_after = raised_wall_ns = None
            while time.monotonic() - started < 120:
                state = depth_of(client, worker.pid)
                if raised_after is None and state is not None and state.depth >= Depth.BLOCKS:
                    raised_after = time.monotonic() - started
                    raised_wall_ns = state.since_ns
                    print(f"raised to {Depth(state.depth).label} after {raised_after:.1f} s: {state.detail}")
                if raised_after is not None:
                    report = client.leak_suspects(pids=[worker.pid], min_age_seconds=0)
                    if report.suspects and report.suspects[0].stack.frames:
                        top = report.suspects[0].stack.frames[0]
                        if keeps_the_clones({"function": top.function, "line": top.line}):
                            first_after = time.monotonic() - started
                            suspect = report.suspects[0]
                            break
                time.sleep(1.0)
            if raised_after is None or raised_after > 60:
                failures.append(f"depth raised after {raised_after} s, not within 60 s")
            if first_after is None or first_after > 120:
                first = report.suspects[0] if report and report.suspects else None
                failures.append(f"keep_activation not ranked first within 120 s (first: {first})")
            else:
                # The clones made since the raise (their blocks are known from then), estimated from the sampled.
                true_bytes = (report.timestamp_ns - raised_wall_ns) / 1e9 / INTERVAL_SECONDS * CLONE_BYTES
                print(f"holder ranked first after {first_after:.1f} s: {suspect.outstanding_bytes / MiB:.1f} MiB in "
                      f"{suspect.allocation_count} blocks (estimated: {suspect.estimated}); clones made since the "
                      f"raise about {true_bytes / MiB:.1f} MiB")
                if abs(suspect.outstanding_bytes - true_bytes) > 0.25 * true_bytes + CLONE_BYTES:
                    failures.append(f"estimate {suspect.outstanding_bytes} bytes, truth about {true_bytes:.0f}")

            # The OOM: a ballast process (not followed) leaves 96 MiB; the leak runs the worker out of it.
            ballast = subprocess.Popen([sys.executable, "-c", BALLAST, str(HEADROOM_BYTES)], stdout=subprocess.PIPE,
                                       text=True)
            print(f"ballast: {ballast.stdout.readline().strip()}")
            oom_started = time.monotonic()
            dumps = wait_for(lambda: sorted(path for path in flight_dir.glob("flight-*-oom-*.kvtrace")
                                            if "-time-to-oom-" not in path.name), 120)
            print(f"oom dump after {time.monotonic() - oom_started:.1f} s: {[path.name for path in dumps or []]}")
            counters = agent.counters()
            print(f"agent counters: { {k: v for k, v in counters.items() if v} }")
            links = sorted(set(re.findall(r"attached PyTorch's allocator probes \(\d+ sites\) in (\S+)",
                                          agent.stderr_text())))
            print(f"PyTorch links: {links}")
            through_hook = any("kvtrace_torch_hook" in link for link in links)
            if hooked and (not through_hook or len(links) != 1):
                failures.append(f"the hooked worker was linked through {links}, not the hook alone")
            if not hooked and through_hook:
                failures.append(f"a worker without the hook was linked through {links}")
            if counters.get("hook_entries_lost") or counters.get("usdt_unreadable"):
                failures.append(f"hook_entries_lost {counters.get('hook_entries_lost')}, usdt_unreadable "
                                f"{counters.get('usdt_unreadable')}")
        if not dumps:
            failures.append(f"no oom dump in {flight_dir}: {sorted(p.name for p in flight_dir.glob('*'))}")
        else:
            leaks = kvtrace("leaks", "--input", str(dumps[0]), "--min-age", "0", "--json", timeout=120)
            first = (json.loads(leaks.stdout)["suspects"] or [{}])[0] if leaks.returncode == 0 else {}
            print(f"oom dump replayed, first suspect: {first.get('outstanding_bytes')} bytes in "
                  f"{first.get('allocation_count')} blocks, estimated {first.get('estimated')}, stack "
                  f"{[frame['function'] for frame in first.get('stack') or []][:4]}")
            if not first.get("stack") or not keeps_the_clones(first["stack"][0]):
                failures.append(f"the oom dump's first suspect: {first or leaks.stderr}")
            shown = kvtrace("leaks", "--input", str(dumps[0]), "--min-age", "0", timeout=120)
            print("\n".join(shown.stdout.splitlines()[:12]))
    finally:
        worker.process.kill()
        if ballast is not None:
            ballast.kill()
    check_all(failures)

