"""The agent's memory and CPU with many live allocations (stub libraries, this machine, as root).

A Python process makes N cudaMalloc calls through the stub libcudart and keeps them all (each is a
runtime and a driver allocation: 2 N ledger entries in the kernel, and their totals; the agent keeps
neither and reads them from the kernel when a report asks). The real `kvtrace agent -p PID` follows it,
as configured by default. Printed: the
agent's RSS before and after and its high-water mark (a snapshot page and a leak report
are taken before it is read), its CPU while idle before and after (with N live allocations it
samples leak suspects now and then, which reads them all from the kernel), and whether its totals
hold exactly N allocations.

With --torch-blocks the allocations are PyTorch blocks instead: the stub caching allocator
(tests/integration/stubs/c10_cuda_stub.c) hands out N blocks of 512 B from 2 MiB segments and keeps
them, each a pytorch:malloc (USDT) the agent traces: N block entries plus two per segment.

Goals: RSS <= 256 MiB at 1 000 000 live allocations, and at 1 000 000 live PyTorch blocks; <= 1 % of
a core when idle.

Run: .venv/bin/python bench/agent_memory.py [--allocations 1000000] [--idle-seconds 30] [--torch-blocks]
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
sys.path.insert(0, str(ROOT / "tests" / "integration"))
from agent_process import AgentProcess  # noqa: E402
from cuda_stubs import Workload, build_stubs  # noqa: E402
from torch_stubs import build_torch_stub  # noqa: E402

RSS_GOAL_BYTES = 256 << 20
FLIGHT_WINDOW_SECONDS = 120  # the agent's default --flight-window
IDLE_GOAL_CORE_FRACTION = 0.01
SIZE_BYTES = 4096
BLOCK_BYTES = 512  # torch_workload hold: each block asks for 512 B

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


class CudaMallocTarget:
    """A Python process that makes N cudaMalloc calls through the stub libcudart and keeps them."""

    what = "cudaMalloc calls"

    def __init__(self, work: Path, allocations: int) -> None:
        build = build_stubs(work / "stubs")
        script = work / "target.py"
        script.write_text(TARGET)
        self.allocations = allocations
        self.entries = 2 * allocations  # runtime + driver
        self.expected_bytes = allocations * SIZE_BYTES
        self.process = subprocess.Popen([sys.executable, str(script), str(build.libcudart)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.process.stdout.readline().strip() == "ready"
        self.pid = self.process.pid

    def run(self) -> None:
        self.process.stdin.write(f"{self.allocations} {SIZE_BYTES}\n")
        self.process.stdin.flush()
        assert self.process.stdout.readline().strip() == "done", "the target failed"

    def traced(self, client, counters: dict[str, int]) -> int:
        """What the agent holds of it, comparable with expected_bytes."""
        return sum(row.outstanding_bytes for row in client.growth().processes if row.pid == self.pid)

    def kill(self) -> None:
        self.process.kill()


class TorchBlocksTarget:
    """torch_workload hold N: N PyTorch blocks of 512 B from the stub caching allocator, kept."""

    what = "PyTorch blocks (pytorch:malloc)"

    def __init__(self, work: Path, allocations: int) -> None:
        build = build_torch_stub(work / "stubs", build_stubs(work / "stubs"))
        self.allocations = allocations
        self.workload = Workload([build.workload, "hold", str(allocations)])
        self.pid = self.workload.wait_ready()
        self.entries = allocations  # and two per segment, known once it has run
        self.expected_bytes = allocations * BLOCK_BYTES

    def run(self) -> None:
        self.workload.go()
        lines = self.workload.read_calls(timeout_s=1800)
        held = next(line for line in lines if "held" in line)
        assert held["held"] == self.allocations, held
        self.entries = self.allocations + 2 * held["segments"]

    def traced(self, client, counters: dict[str, int]) -> int:
        """Bytes of the kernel ledger's entries the agent counted, beyond the segments' two each:
        the blocks' (every block is 512 B), when the counts match."""
        entries = counters.get("ledger_entries_in_kernel", 0)
        return BLOCK_BYTES * (entries - (self.entries - self.allocations))

    def kill(self) -> None:
        self.workload.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--allocations", type=int, default=1_000_000)
    parser.add_argument("--idle-seconds", type=float, default=30.0)
    parser.add_argument("--torch-blocks", action="store_true",
                        help="the allocations are PyTorch blocks of the stub caching allocator")
    parser.add_argument("--agent-arg", action="append", default=[], metavar="ARG",
                        help="one more argument for the agent (repeatable), e.g. --agent-arg=--no-flight-recorder")
    args = parser.parse_args()
    require_bpf()
    from kvtrace.client import AgentClient

    work = Path(tempfile.mkdtemp(prefix="kvtrace-bench-"))
    target = (TorchBlocksTarget if args.torch_blocks else CudaMallocTarget)(work, args.allocations)
    # (blocks: 1 M blocks of 512 B take 245 segments of 2 MiB, two entries each)
    max_entries = 2 * args.allocations + 65536
    with AgentProcess(work / "kvtrace.sock", "-p", str(target.pid), "--no-nvml",
                      "--max-ledger-entries", str(max_entries), *args.agent_arg) as agent:
        meter = CpuMeter(agent.process.pid)
        time.sleep(2)
        rss_before = meter.rss_bytes()
        progress(f"agent RSS {rss_before >> 20} MiB; idle for {args.idle_seconds:.0f} s")
        idle_before = meter.over(args.idle_seconds)
        progress(f"{args.allocations} {target.what}")
        started = time.monotonic()
        target.run()
        made_seconds = time.monotonic() - started
        with AgentClient.for_socket(work / "kvtrace.sock") as client:
            deadline = time.monotonic() + 600
            while True:
                counters = dict(client.info().counters)
                traced = target.traced(client, counters)
                if traced == target.expected_bytes or time.monotonic() > deadline:
                    break
                time.sleep(1)
        settled_seconds = time.monotonic() - started
        rss_after = meter.rss_bytes()
        progress(f"ledger settled after {settled_seconds:.0f} s; idle for {args.idle_seconds:.0f} s")
        idle_after = meter.over(args.idle_seconds)
        rss_peak = max(rss_after, meter.rss_bytes())
        # The flight recorder keeps the events of its last 120 s (at most --flight-max-records): the
        # burst that made the allocations is in it until then. What stays is what the allocations cost.
        wait = max(0.0, FLIGHT_WINDOW_SECONDS + 10 - (time.monotonic() - started))
        progress(f"waiting {wait:.0f} s for the flight recorder's window to pass the burst")
        time.sleep(wait)
        rss_after_window = meter.rss_bytes()
        progress(f"idle for {args.idle_seconds:.0f} s")
        idle_later = meter.over(args.idle_seconds)
        with AgentClient.for_socket(work / "kvtrace.sock", timeout_seconds=600) as client:
            snapshot_started = time.monotonic()
            listed = len(next(iter(client.snapshot_pages(pids=[target.pid], page_size=10_000))).allocations)
            snapshot_seconds = time.monotonic() - snapshot_started
            leaks_started = time.monotonic()
            report = client.leak_suspects(pids=[target.pid], min_age_seconds=0.0)
            leaks_seconds = time.monotonic() - leaks_started
        high_water = meter.peak_rss_bytes()
        target.kill()
    exact = traced == target.expected_bytes
    print(f"agent memory, {time.strftime('%Y-%m-%d %H:%M')}; measured: {code_version()}")
    print(f"  live {target.what}: {args.allocations} ({target.entries} kernel ledger entries), "
          f"made in {made_seconds:.1f} s, in the agent's ledger after {settled_seconds:.1f} s")
    print(f"  agent ledger exact           {'yes' if exact else 'NO'} ({traced} of {target.expected_bytes} bytes)")
    print(f"  agent RSS before             {rss_before / 2**20:.0f} MiB")
    print(f"  agent RSS with them live     {rss_peak / 2**20:.0f} MiB  goal <= {RSS_GOAL_BYTES >> 20} MiB "
          f"({'met' if rss_peak <= RSS_GOAL_BYTES else f'MISSED by {(rss_peak - RSS_GOAL_BYTES) / 2**20:.0f} MiB'}; "
          f"just after the burst, its events in the flight recorder)")
    print(f"  agent RSS, 130 s after       {rss_after_window / 2**20:.0f} MiB  goal <= {RSS_GOAL_BYTES >> 20} MiB "
          f"({'met' if rss_after_window <= RSS_GOAL_BYTES else 'MISSED'}; the flight recorder's 120 s window "
          f"no longer holds the allocations' events)")
    print(f"  agent RSS high-water mark    {high_water / 2**20:.0f} MiB (VmHWM over the whole run: every copy, "
          f"every report below included)")
    print(f"  snapshot, first page         {listed} entries in {snapshot_seconds:.1f} s (the kernel's entries gone "
          f"through once, the page kept)")
    print(f"  leak report                  {len(report.suspects)} suspects, first "
          f"{report.suspects[0].outstanding_bytes if report.suspects else 0} bytes in "
          f"{report.suspects[0].allocation_count if report.suspects else 0} allocations, {leaks_seconds:.1f} s")
    print(f"  agent CPU idle, before       {idle_before * 100:.2f} % of a core  "
          f"goal <= {IDLE_GOAL_CORE_FRACTION * 100:.0f} % "
          f"({'met' if idle_before <= IDLE_GOAL_CORE_FRACTION else 'MISSED'})")
    print(f"  agent CPU idle, with them    {idle_after * 100:.2f} % of a core (right after they settled: "
          f"stacks of lost events are named then; suspects sampled every 10 s)")
    print(f"  agent CPU idle, 130 s after  {idle_later * 100:.2f} % of a core  "
          f"goal <= {IDLE_GOAL_CORE_FRACTION * 100:.0f} % "
          f"({'met' if idle_later <= IDLE_GOAL_CORE_FRACTION else 'MISSED'}; with them all live)")
    print(f"  events                       submitted {counters.get('events_submitted')}, lost "
          f"{counters.get('events_lost')}, resyncs {counters.get('resyncs')}")
    print(f"  entries in the kernel        {counters.get('ledger_entries_in_kernel')} (counted by the agent, "
          f"not kept)")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
