"""Issue 31's attacks 2, 3 and 6 against a running agent, as one unprivileged user would make them, and what a
root workload started during each gets: the figures for bench/RESULTS.md §N (before and after, with --tree).

- ledger: the user's own cuMemAlloc_v2 (tests/integration/stubs/hog.c) makes FILL allocations at made-up
  addresses; then a root workload holds 13 cudaMalloc of 1 MiB (26 ledger entries): how many does the agent
  list, and what does it say of the attacker (counters, the shares component)?
- figures: the user's process selects 20 000 device ordinals (--devices; one 1 MiB allocation each: the totals
  map fills) and holds 2 000 allocations of 2^62 bytes on one more: do `kvtrace ps` and `kvtrace top --once`
  work, and how large is /metrics?
- slots: the user maps 80 renamed copies of libcudart; then a root process loads a newly installed one: is it
  traced (17 of 17 cudaMalloc), and what does `kvtrace doctor --pid` say of a process of the user's that maps
  only a fresh copy?

Needs root and bcc (as `make test`). One agent per attack, `--cmdline` choosing the attack's processes.

    sudo .venv/bin/python bench/share_attacks.py [--tree DIR] [--fill 1100000]

--tree DIR runs another commit's agent and clients: DIR holds its agent/ and probes/ (`git archive REV agent
probes | tar -x -C DIR`, REV written in DIR/COMMIT).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests"), str(HERE.parent / "tests" / "integration")]

from agent_process import KVTRACE, AgentProcess  # noqa: E402
from benchlib import code_version  # noqa: E402
from cuda_stubs import _CFLAGS, STUBS_DIR, Workload, _gcc, build_stubs  # noqa: E402

ATTACKER_UID = 61_999
METRICS = "127.0.0.1:19431"


def as_attacker(*argv) -> list[str]:
    return ["setpriv", f"--reuid={ATTACKER_UID}", f"--regid={ATTACKER_UID}", "--clear-groups", *map(str, argv)]


def client(env: dict[str, str], socket: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*KVTRACE, *args, "--socket", str(socket)], capture_output=True, text=True, env=env,
                          timeout=timeout)


def info(env: dict[str, str], socket: Path) -> dict:
    code = ("import json, sys; from kvtrace.client import AgentClient; "
            "from google.protobuf.json_format import MessageToDict; "
            f"c = AgentClient.for_socket(__import__('pathlib').Path({str(socket)!r})); "
            "print(json.dumps(MessageToDict(c.info())))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    return json.loads(result.stdout) if result.returncode == 0 else {"error": result.stderr[-300:]}


def shares_component(agent_info: dict) -> str:
    for component in agent_info.get("components", []):
        if component["name"] in ("shares", "libraries") and not component.get("up"):
            return f"{component['name']}: {component.get('reason', '')[:300]}"
    return "(no component down)"


def root_hold(build, env, socket) -> dict:
    """A root workload's 13 cudaMalloc of 1 MiB: what `kvtrace snapshot -p` lists of its 26 entries."""
    with Workload([build.workload, "hold"]) as workload:
        pid = workload.wait_ready()
        time.sleep(1.5)  # the agent finds and follows it (exec notification, --cmdline)
        workload.go()
        calls = workload.read_calls()
        started = time.monotonic()
        listed = 0
        while time.monotonic() - started < 10:
            result = client(env, socket, "snapshot", "-p", str(pid), "--json")
            listed = sum(1 for line in result.stdout.splitlines() if line.startswith("{"))
            if listed >= 2 * len(calls):
                break
            time.sleep(0.2)
        seconds = time.monotonic() - started
        workload.finish()
    return {"root_entries_listed": listed, "root_entries_made": 2 * len(calls),
            "root_listed_after_s": round(seconds, 2)}


def attack_ledger(build, hog, env, work, fill: int) -> dict:
    socket = work / "ledger.sock"
    with AgentProcess(socket, "--cmdline", "hog|workload", "--no-nvml", env=env) as agent:
        with Workload(as_attacker(hog, "alloc", 0, 0, fill)) as attacker:
            attacker.wait_ready()
            time.sleep(1.5)
            started = time.monotonic()
            attacker.go()
            attacker.expect_line("done", timeout_s=600)
            attack_seconds = time.monotonic() - started
            time.sleep(1.5)
            result = {"attack": "ledger", "fill": fill, "attack_s": round(attack_seconds, 1),
                      **root_hold(build, env, socket)}
            agent_info = info(env, socket)
            counters = agent_info.get("counters", {})
            result.update({name: int(counters.get(name, 0)) for name in (
                "ledger_full", "share_full", "ledger_entries_in_kernel")})
            result["said"] = shares_component(agent_info)
            rss = int(open(f"/proc/{agent.process.pid}/status").read().split("VmRSS:")[1].split()[0]) >> 10
            result["agent_rss_mib"] = rss
            attacker.finish()
    return result


def attack_figures(build, hog, env, work, devices: int) -> dict:
    socket = work / "figures.sock"
    with AgentProcess(socket, "--cmdline", "hog|workload", "--no-nvml", "--metrics-listen", METRICS, env=env):
        with Workload(as_attacker(hog, "alloc", devices, 2000, 0)) as attacker:
            attacker.wait_ready()
            time.sleep(1.5)
            attacker.go()
            attacker.expect_line("done", timeout_s=300)
            time.sleep(2.5)
            result: dict = {"attack": "figures", "devices": devices, **root_hold(build, env, socket)}
            for name, args in (("ps", ("ps",)), ("top", ("top", "--once"))):
                done = client(env, socket, *args)
                result[f"{name}_rc"] = done.returncode
                result[f"{name}_error"] = (done.stderr.strip().splitlines() or [""])[-1][:200]
                result[f"{name}_attacker_rows"] = [" ".join(line.split())[:160] for line in done.stdout.splitlines()
                                                   if "hog" in line][:3]
            started = time.monotonic()
            body = urllib.request.urlopen(f"http://{METRICS}/metrics", timeout=60).read()
            result.update(metrics_bytes=len(body), metrics_lines=body.count(b"\n"),
                          metrics_scrape_s=round(time.monotonic() - started, 2))
            counters = info(env, socket).get("counters", {})
            result.update({name: int(counters.get(name, 0)) for name in ("devices_clamped", "sizes_clamped",
                                                                           "totals_full")})
            attacker.finish()
    return result


def attack_slots(build, hog, env, work) -> dict:
    socket = work / "slots.sock"
    copies = Path(tempfile.mkdtemp(prefix="kvtrace-copies-", dir="/tmp"))
    copies.chmod(0o755)
    shutil.copy(build.libcuda, copies / "libcuda.so.1")
    paths = [copies / f"libcudart-{n}.so.12" for n in range(80)]
    for path in paths:
        shutil.copy(build.libcudart, path)
    late_dir = copies / "late"
    late_dir.mkdir()
    shutil.copy(build.libcudart, late_dir / "libcudart.so.12")
    shutil.copy(build.libcuda, late_dir / "libcuda.so.1")
    shutil.copy(build.dlopen_workload, copies / "loader")
    for path in [*copies.rglob("*"), late_dir]:
        path.chmod(0o755)
    root_dir = Path(tempfile.mkdtemp(prefix="kvtrace-root-"))
    shutil.copy(build.libcudart, root_dir / "libcudart.so.12")
    shutil.copy(build.libcuda, root_dir / "libcuda.so.1")
    result: dict = {"attack": "slots"}
    try:
        with AgentProcess(socket, "--cmdline", "hog|loader|dlopen_workload", "--no-nvml", env=env):
            with Workload(as_attacker(hog, "libs", *paths)) as attacker:
                attacker.wait_ready()
                attacker.go()
                attacker.expect_line("done", timeout_s=120)
                time.sleep(8)  # scans and attaches
                with Workload(as_attacker(copies / "loader", late_dir / "libcudart.so.12")) as second:
                    second_pid = second.wait_ready()
                    second.go()
                    second.expect_line("loaded")
                    with Workload([build.dlopen_workload, root_dir / "libcudart.so.12"]) as workload:
                        pid = workload.wait_ready()
                        workload.go()
                        workload.expect_line("loaded")
                        time.sleep(3)
                        workload.go()
                        calls = workload.read_calls()
                        time.sleep(2)
                        snapshot = client(env, socket, "snapshot", "-p", str(pid), "--json")
                        result["root_entries_listed"] = sum(1 for line in snapshot.stdout.splitlines()
                                                            if line.startswith("{"))
                        result["root_entries_made"] = 2 * len(calls)
                        doctor = client(env, socket, "doctor", "--pid", str(second_pid))
                        result["doctor_pid_says"] = next((line for line in doctor.stdout.splitlines()
                                                          if f"pid {second_pid} cuda" in line), "")[:400]
                        agent_info = info(env, socket)
                        counters = agent_info.get("counters", {})
                        result["libraries_attached"] = int(counters.get("libraries_attached", 0))
                        result["said"] = shares_component(agent_info)
                        workload.finish()
                    second.finish()
                attacker.finish()
    finally:
        shutil.rmtree(copies, ignore_errors=True)
        shutil.rmtree(root_dir, ignore_errors=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, help="another commit's agent/ and probes/ (see above)")
    parser.add_argument("--fill", type=int, default=1_100_000, help="the ledger attack's allocations")
    parser.add_argument("--devices", type=int, default=20_000, help="the figures attack's device ordinals")
    parser.add_argument("--only", choices=("ledger", "figures", "slots"), action="append")
    args = parser.parse_args()
    env = dict(os.environ)
    tree = args.tree.resolve() if args.tree else HERE.parent
    env["PYTHONPATH"] = os.pathsep.join([str(tree / "agent"), *sys.path])
    env["KVTRACE_PROBES_DIR"] = str(tree / "probes")
    commit = (tree / "COMMIT").read_text().strip() if (tree / "COMMIT").exists() else code_version()
    work = Path(tempfile.mkdtemp(prefix="kvtrace-share-attacks-"))
    build = build_stubs(work / "stubs")
    hog_dir = Path(tempfile.mkdtemp(prefix="kvtrace-hog-", dir="/tmp"))
    hog_dir.chmod(0o755)
    hog = hog_dir / "hog"
    _gcc(*_CFLAGS, "-o", hog, STUBS_DIR / "hog.c", "-ldl")
    hog.chmod(0o755)
    print(json.dumps({"code": commit, "machine": f"{os.cpu_count()} cores, {os.uname().release}",
                      "date": time.strftime("%Y-%m-%d %H:%M %Z")}), flush=True)
    try:
        for name in args.only or ("ledger", "figures", "slots"):
            if name == "ledger":
                result = attack_ledger(build, hog, env, work, args.fill)
            elif name == "figures":
                result = attack_figures(build, hog, env, work, args.devices)
            else:
                result = attack_slots(build, hog, env, work)
            print(json.dumps(result), flush=True)
    finally:
        shutil.rmtree(hog_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
