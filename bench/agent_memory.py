"""The agent's memory and CPU with many live allocations (stub libraries, this machine, as root).

A Python process makes N cudaMalloc calls through the stub libcudart and keeps them all (each is a
runtime and a driver allocation: 2 N ledger entries, in the kernel and in the agent). The real
`kvtrace agent -p PID` follows it. Printed: the agent's RSS before and after, its CPU while idle
before and after (with N live allocations it samples leak suspects every 10 s, which reads them
all), and whether its ledger holds exactly N allocations.

Goals: RSS <= 256 MiB at 1 000 000 live allocations; <= 1 % of a core when idle.

Run: .venv/bin/python bench/agent_memory.py [--allocations 1000000] [--idle-seconds 30]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import ROOT, CpuMeter, code_version, progress, require_bpf  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))
from agent_process import AgentProcess  # noqa: E402
from cuda_stubs import build_stubs  # noqa: E402

RSS_GOAL_BYTES = 256 << 20
IDLE_GOAL_CORE_FRACTION = 0.01
SIZE_BYTES = 4096

TARGET = textwrap.dedent("""
    import ctypes, sys

    cudart = ctypes.CDLL(sys.argv[1])
    kept = []

    def allocate(count, size):
        pointer = ctypes.c_void_p()
        malloc = cudart.cudaMalloc
        for index in range(count):
            if malloc(ctypes.byref(pointer), ctypes.c_size_t(size)) != 0:
                sys.exit(f"cudaMalloc failed at {index}")
            kept.append(pointer.value)
        if len(set(kept)) != count:
            sys.exit("the stub returned an address twice")

    print("ready", flush=True)
    count, size = (int(word) for word in sys.stdin.readline().split())
    allocate(count, size)
    print("done", flush=True)
    sys.stdin.readline()
""")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--allocations", type=int, default=1_000_000)
    parser.add_argument("--idle-seconds", type=float, default=30.0)
    args = parser.parse_args()
    require_bpf()
    from kvtrace.client import AgentClient

    work = Path(tempfile.mkdtemp(prefix="kvtrace-bench-"))
    build = build_stubs(work / "stubs")
    script = work / "target.py"
    script.write_text(TARGET)
    target = subprocess.Popen([sys.executable, str(script), str(build.libcudart)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert target.stdout.readline().strip() == "ready"
    entries = 2 * args.allocations
    with AgentProcess(work / "kvtrace.sock", "-p", str(target.pid), "--no-nvml",
                      "--max-ledger-entries", str(entries + 65536)) as agent:
        meter = CpuMeter(agent.process.pid)
        time.sleep(2)
        rss_before = meter.rss_bytes()
        progress(f"agent RSS {rss_before >> 20} MiB; idle for {args.idle_seconds:.0f} s")
        idle_before = meter.over(args.idle_seconds)
        progress(f"{args.allocations} cudaMalloc calls")
        started = time.monotonic()
        target.stdin.write(f"{args.allocations} {SIZE_BYTES}\n")
        target.stdin.flush()
        assert target.stdout.readline().strip() == "done", "the target failed"
        made_seconds = time.monotonic() - started
        with AgentClient.for_socket(work / "kvtrace.sock") as client:
            deadline = time.monotonic() + 600
            while True:
                rows = [row for row in client.growth().processes if row.pid == target.pid]
                traced = sum(row.outstanding_bytes for row in rows)
                if traced == args.allocations * SIZE_BYTES or time.monotonic() > deadline:
                    break
                time.sleep(1)
            counters = dict(client.info().counters)
        settled_seconds = time.monotonic() - started
        rss_after = meter.rss_bytes()
        progress(f"ledger settled after {settled_seconds:.0f} s; idle for {args.idle_seconds:.0f} s")
        idle_after = meter.over(args.idle_seconds)
        rss_peak = max(rss_after, meter.rss_bytes())
        target.kill()
    exact = traced == args.allocations * SIZE_BYTES
    print(f"agent memory, {time.strftime('%Y-%m-%d %H:%M')}; measured: {code_version()}")
    print(f"  live allocations             {args.allocations} ({entries} ledger entries: runtime + driver), "
          f"made in {made_seconds:.1f} s, in the agent's ledger after {settled_seconds:.1f} s")
    expected_bytes = args.allocations * SIZE_BYTES
    print(f"  agent ledger exact           {'yes' if exact else 'NO'} ({traced} of {expected_bytes} bytes)")
    print(f"  agent RSS before             {rss_before / 2**20:.0f} MiB")
    print(f"  agent RSS with them live     {rss_peak / 2**20:.0f} MiB  goal <= {RSS_GOAL_BYTES >> 20} MiB "
          f"({'met' if rss_peak <= RSS_GOAL_BYTES else f'MISSED by {(rss_peak - RSS_GOAL_BYTES) / 2**20:.0f} MiB'})")
    print(f"  agent CPU idle, before       {idle_before * 100:.2f} % of a core  "
          f"goal <= {IDLE_GOAL_CORE_FRACTION * 100:.0f} % "
          f"({'met' if idle_before <= IDLE_GOAL_CORE_FRACTION else 'MISSED'})")
    print(f"  agent CPU idle, with them    {idle_after * 100:.2f} % of a core (suspects sampled every 10 s)")
    print(f"  events                       submitted {counters.get('events_submitted')}, lost "
          f"{counters.get('events_lost')}, resyncs {counters.get('resyncs')}")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
