"""Soak: the real agent (`kvtrace agent`, whole host) for N minutes under steady churn, its RSS, open
files and threads sampled every 30 s. Flat is the goal: what a day of this would leave behind.

    sudo .venv/bin/python bench/soak.py --minutes 10

Each second: one short process (3 malloc/free pairs, then exit), a new copy of the stub libraries
every 20 s (attached, then detached when unused), a `kvtrace ps` and a scrape of /metrics; one
process holds 13 MiB throughout. Prints one line per sample and the change from the first sample
after warm-up to the last.
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

from benchlib import Workload, build_stubs, code_version, progress, require_bpf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    args = parser.parse_args()
    require_bpf()
    from agent_process import AgentProcess, kvtrace  # tests/ is on the path once benchlib is imported

    work = Path(tempfile.mkdtemp(prefix="kvtrace-soak-"))
    build = build_stubs(work / "stubs")
    socket = work / "kvtrace.sock"
    samples = []
    with AgentProcess(socket) as agent, Workload([build.workload, "hold"]) as holder:
        holder.wait_ready()
        time.sleep(1.5)
        holder.go()
        holder.read_calls()
        url = re.search(r"Prometheus metrics on (\S+)", agent.stderr_text()).group(1)
        me = psutil.Process(agent.process.pid)
        started = time.monotonic()
        next_sample = started
        copy = 0
        while time.monotonic() - started < args.minutes * 60:
            subprocess.run([str(build.workload), "loop", "3"], input=b"go\n", stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=30, check=True)
            if int(time.monotonic() - started) // 20 >= copy:
                copy += 1
                directory = work / f"copy{copy}"
                directory.mkdir()
                for library in (build.libcudart, build.libcuda):
                    shutil.copy(library, directory / library.name)
                subprocess.run([str(build.dlopen_workload), str(directory / build.libcudart.name)],
                               input=b"go\ngo\ngo\n", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               timeout=30)
                shutil.rmtree(directory)
            kvtrace("ps", "--socket", str(socket))
            urllib.request.urlopen(url, timeout=10).read()
            if time.monotonic() >= next_sample:
                next_sample += 30
                info = {"t_s": round(time.monotonic() - started), "rss_mib": me.memory_info().rss >> 20,
                        "fds": me.num_fds(), "threads": me.num_threads(), "copies": copy}
                samples.append(info)
                progress(f"{info}")
            time.sleep(1.0)
    first, last = samples[1] if len(samples) > 1 else samples[0], samples[-1]
    print(f"soak {args.minutes:g} min, {code_version()}: RSS {first['rss_mib']} -> {last['rss_mib']} MiB, "
          f"fds {first['fds']} -> {last['fds']}, threads {first['threads']} -> {last['threads']}, "
          f"{last['copies']} library copies attached and detached")


if __name__ == "__main__":
    main()
