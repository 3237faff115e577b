"""What following many processes with `-p` costs to attach and detach: probes of their own per process
(`--per-process-probes-max` at or above N) against one set per library shared by every process and
filtered in the kernel (the default beyond 8 processes), side by side, on this machine.

N idle processes map the same stub libcudart and libcuda (as the workers of one inference server map
one copy of CUDA). For each variant the real `kvtrace agent -p PID ...` is started and stopped;
figures: seconds from start to "Hit Ctrl-C" (BPF compile and attaching; the compile is the same in
both), seconds from SIGTERM to exit (detaching), and the sets of probes attached (the agent's
probe_sets_attached counter: one per library, or one per library and process).

Goal (issue 16): attaching and detaching stay O(libraries), not O(processes x probes).

Run as root: .venv/bin/python bench/attach_scaling.py [--processes 16 64]
"""
from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import ROOT, code_version, progress, require_bpf  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))
from agent_process import AgentProcess  # noqa: E402
from cuda_stubs import build_stubs, library_holder  # noqa: E402


def measure(socket: Path, pids: list[int], per_process_max: int) -> dict:
    args = [arg for pid in pids for arg in ("-p", str(pid))]
    started = time.monotonic()
    agent = AgentProcess(socket, *args, "--no-nvml", "--per-process-probes-max", str(per_process_max))
    start_seconds = time.monotonic() - started
    time.sleep(1.0)
    counters = agent.counters()
    stopping = time.monotonic()
    agent.process.send_signal(signal.SIGTERM)
    status = agent.process.wait(timeout=600)
    stop_seconds = time.monotonic() - stopping
    return {"start_s": start_seconds, "stop_s": stop_seconds, "libraries": counters["libraries_attached"],
            "probe_sets": counters["probe_sets_attached"], "status": status}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[16, 64])
    args = parser.parse_args()
    require_bpf()
    work = Path(tempfile.mkdtemp(prefix="kvtrace-bench-"))
    stubs = build_stubs(work / "stubs")
    rows = []
    for count in args.processes:
        with ExitStack() as stack:
            holders = [stack.enter_context(library_holder([stubs.libcudart, stubs.libcuda]))
                       for _ in range(count)]
            pids = [holder.wait_ready() for holder in holders]
            for label, per_process_max in (("per process", count), ("per library", 0)):
                progress(f"{count} processes, probes {label}")
                result = measure(work / f"{count}-{per_process_max}.sock", pids, per_process_max)
                rows.append((count, label, result))
    print(f"attach scaling, {time.strftime('%Y-%m-%d %H:%M')}; measured: {code_version()}")
    print(f"{'processes':>10} {'probes':<12} {'libraries':>10} {'probe sets':>11} {'start s':>9} {'stop s':>8}")
    for count, label, result in rows:
        print(f"{count:>10} {label:<12} {result['libraries']:>10} {result['probe_sets']:>11} "
              f"{result['start_s']:>9.2f} {result['stop_s']:>8.2f}")
    return 0 if all(result["status"] == 0 for _, _, result in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
