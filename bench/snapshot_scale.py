"""Reports over many live ledger entries (issue 33): `kvtrace snapshot --json`, `kvtrace leaks`, and
`kvtrace snapshot --format memory-viz`, timed against the real agent, with its peak RSS during each.

A Python process makes N cudaMalloc calls through the stub libcudart and keeps them (each is a runtime
and a driver allocation: 2 N entries in the kernel's ledger; --entries counts entries, so --entries
400000 makes 200 000 calls). With --torch-blocks the workload is instead the stub PyTorch caching
allocator holding --entries blocks of 512 B (plus two entries per 2 MiB segment): what memory-viz
exports (the agent then runs with --blocks always). The real `kvtrace agent -p PID` follows it
(tests/agent_process.py); once the agent counts
every entry in the kernel (GetAgentInfo's ledger_entries_in_kernel), each step runs the real CLI as a
subprocess, one after the other:

  snapshot    `kvtrace snapshot -p PID --json`: its rows are counted as they stream (progress on
              stderr every few seconds) and must equal the entries, exactly.
  leaks       `kvtrace leaks -p PID --json --min-age 0`: one JSON object at the end.
  memory-viz  `kvtrace snapshot -p PID --format memory-viz -o FILE`: it needs PyTorch blocks; over stub
              runtime allocations it reads every page and then refuses ("no PyTorch blocks"): that time
              is reported as what it is (the read, not an export).

A step not done in --timeout-seconds is stopped and reported as "not done in N s, M rows so far".
The agent's RSS is sampled from /proc every 0.1 s during each step (its peak) and its VmHWM read after.

Goals (issue 33): snapshot of 400 000 entries <= 5 s, of 2 000 000 <= 25 s (the same 80 000 rows/s);
leak report and memory-viz export of 1 000 000 live blocks <= 5 s each; agent RSS during each within
256 MiB plus what one page holds (--page-allowance-mib). At other sizes the goal is scaled linearly
("scaled" in the verdict).

With --py-spy BIN the agent is sampled (py-spy record --format raw) for --profile-seconds during the
snapshot step, and the functions it spent its time in are printed (self and inclusive).

Run (as root): .venv/bin/python bench/snapshot_scale.py [--entries 400000] [--torch-blocks]
               [--timeout-seconds 300] [--json-out FILE] [--py-spy /path/to/py-spy]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import ROOT, code_version, progress, require_bpf  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "integration"))
from agent_memory import CudaMallocTarget, TorchBlocksTarget  # noqa: E402
from agent_process import KVTRACE, AgentProcess  # noqa: E402

RSS_GOAL_MIB = 256
SNAPSHOT_GOAL = (400_000, 5.0)  # entries, seconds (2 000 000 in 25 s: the same rate)
BLOCKS_GOAL = (1_000_000, 5.0)  # leaks and memory-viz: blocks, seconds
PROGRESS_EVERY_SECONDS = 5.0


class RssSampler:
    """The peak VmRSS of a process while running (a thread reading /proc/PID/status)."""

    def __init__(self, pid: int, interval: float = 0.1) -> None:
        self.pid, self.interval = pid, interval
        self.peak_kib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def read(self, field: str = "VmRSS:") -> int:
        try:
            with open(f"/proc/{self.pid}/status") as status:
                for line in status:
                    if line.startswith(field):
                        return int(line.split()[1])
        except OSError:
            pass
        return 0

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_kib = max(self.peak_kib, self.read())
            self._stop.wait(self.interval)

    def __enter__(self) -> RssSampler:
        self.peak_kib = self.read()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_kib = max(self.peak_kib, self.read())


def run_step(name: str, cli_args: list[str], agent_pid: int, timeout: float, count_lines: bool,
             during=None) -> dict:
    """Runs a CLI command; counts stdout lines as they come (count_lines), or keeps stdout; stops it at
    `timeout`. `during(process)` is called once it runs (a profiler). Returns the step's figures."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "agent"), os.environ.get("PYTHONPATH", "")]))
    rows, kept, stderr_chunks = 0, [], []
    progress(f"[{name}] kvtrace {' '.join(cli_args)}")
    with RssSampler(agent_pid) as rss:
        started = time.monotonic()
        process = subprocess.Popen([*KVTRACE, *cli_args],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        if during is not None:
            during(process)
        selector = selectors.DefaultSelector()
        selector.register(process.stdout, selectors.EVENT_READ, "out")
        selector.register(process.stderr, selectors.EVENT_READ, "err")
        open_streams = 2
        next_report = started + PROGRESS_EVERY_SECONDS
        timed_out = False
        while open_streams:
            now = time.monotonic()
            if now - started > timeout:
                timed_out = True
                process.kill()
                break
            for key, _ in selector.select(timeout=0.5):
                data = os.read(key.fileobj.fileno(), 1 << 20)
                if not data:
                    selector.unregister(key.fileobj)
                    open_streams -= 1
                elif key.data == "err":
                    stderr_chunks.append(data)
                elif count_lines:
                    rows += data.count(b"\n")
                    if not kept:  # the first row, to check its shape
                        kept.append(data.split(b"\n", 1)[0])
                else:
                    kept.append(data)
            if time.monotonic() >= next_report:
                next_report += PROGRESS_EVERY_SECONDS
                elapsed = time.monotonic() - started
                counted = f"{rows} rows so far ({rows / elapsed:.0f} rows/s), " if count_lines else ""
                progress(f"[{name}] {elapsed:.0f} s: {counted}"
                         f"agent RSS {rss.read() >> 10} MiB")
        rc = process.wait()
        seconds = time.monotonic() - started
    stderr_text = b"".join(stderr_chunks).decode(errors="replace").strip()
    result = {"step": name, "command": "kvtrace " + " ".join(cli_args), "seconds": round(seconds, 3),
              "done": not timed_out and rc == 0, "timed_out": timed_out, "rc": None if timed_out else rc,
              "stderr": stderr_text[-600:], "agent_peak_rss_mib": round(rss.peak_kib / 1024, 1)}
    if count_lines:
        result["rows"] = rows
        result["rows_per_second"] = round(rows / seconds, 1) if seconds else None
        result["first_row"] = kept[0].decode(errors="replace")[:300] if kept else None
    else:
        result["stdout"] = b"".join(kept).decode(errors="replace")
    return result


def one_page(socket: Path, pid: int, agent_pid: int, entries: int) -> list[dict]:
    """One GetSnapshot page (the first) of 1000 (the CLI's) and of 10000 (the most) rows, timed through the
    client: what each page of a snapshot costs the agent, and the whole snapshot at that page size."""
    from kvtrace.client import AgentClient

    pages = []
    with AgentClient.for_socket(socket, timeout_seconds=600) as client:
        for page_size in (1000, 10000):
            with RssSampler(agent_pid) as rss:
                started = time.monotonic()
                page = next(iter(client.snapshot_pages(pids=[pid], page_size=page_size)))
                seconds = time.monotonic() - started
            count = -(-entries // page_size)
            pages.append({"page_size": page_size, "rows": len(page.allocations), "seconds": round(seconds, 3),
                          "agent_peak_rss_mib": round(rss.peak_kib / 1024, 1), "pages_for_all": count,
                          "projected_seconds_for_all": round(seconds * count, 1),
                          "projected_rows_per_second": round(page_size / seconds, 1)})
            progress(f"[page] one page of {page_size}: {seconds:.3f} s; {count} pages: ~{seconds * count:.0f} s")
    return pages


def verdict(seconds: float, done: bool, size: int, goal: tuple[int, float], rss_ok: bool) -> tuple[float, str]:
    goal_seconds = goal[1] * size / goal[0]
    scaled = "" if size == goal[0] else f" (goal scaled to {size}: {goal_seconds:.2f} s)"
    if not done:
        return goal_seconds, f"MISSED: not done{scaled}"
    time_ok = seconds <= goal_seconds
    text = "met" if time_ok and rss_ok else "MISSED" + ("" if time_ok else " (time)") + ("" if rss_ok else " (RSS)")
    return goal_seconds, text + scaled


class PySpy:
    """py-spy record of the agent for a while (raw collapsed stacks), summarized."""

    def __init__(self, binary: str, pid: int, seconds: float, out: Path, delay: float) -> None:
        self.binary, self.pid, self.seconds, self.out, self.delay = binary, pid, seconds, out, delay
        self.process: subprocess.Popen | None = None
        self._timer: threading.Timer | None = None

    def start(self, _step_process=None) -> None:
        def launch():
            self.process = subprocess.Popen(
                [self.binary, "record", "--pid", str(self.pid), "--duration", str(int(self.seconds)), "--rate", "100",
                 "--format", "raw", "--nonblocking", "-o", str(self.out)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._timer = threading.Timer(self.delay, launch)
        self._timer.start()

    def summary(self, top: int = 25) -> dict:
        if self._timer is not None:
            self._timer.join()
        if self.process is not None:
            self.process.wait(timeout=self.seconds + 60)
        if not self.out.exists():
            return {"error": "py-spy wrote nothing"}
        self_time, inclusive = collections.Counter(), collections.Counter()
        total = 0
        for line in self.out.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if not stack:
                continue
            count = int(count)
            frames = stack.split(";")
            if not any("GetSnapshot" in frame for frame in frames):
                continue  # other threads: the pump, the analyzer, idle gRPC workers
            total += count
            self_time[frames[-1]] += count
            for frame in set(frames):
                inclusive[frame] += count
        return {"samples_in_GetSnapshot": total,
                "self": [(frame, round(100 * count / total, 1)) for frame, count in self_time.most_common(top)]
                if total else [],
                "inclusive": [(frame, round(100 * count / total, 1)) for frame, count in inclusive.most_common(top)]
                if total else []}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=400_000,
                        help="live ledger entries (cudaMalloc: 2 per call, so an even number; blocks: that "
                             "many blocks, plus 2 per segment)")
    parser.add_argument("--torch-blocks", action="store_true",
                        help="PyTorch blocks of the stub caching allocator instead of cudaMalloc calls")
    parser.add_argument("--timeout-seconds", type=float, default=300.0, help="per step (default: %(default)s)")
    parser.add_argument("--steps", default="snapshot,leaks,memory-viz",
                        help="which steps, in order (default: %(default)s)")
    parser.add_argument("--page-allowance-mib", type=float, default=16.0,
                        help="what one page may add to the 256 MiB RSS goal (default: %(default)s)")
    parser.add_argument("--json-out", type=Path, help="also write the figures here as JSON")
    parser.add_argument("--py-spy", metavar="BIN", help="sample the agent with py-spy during the snapshot step")
    parser.add_argument("--profile-seconds", type=float, default=20.0)
    parser.add_argument("--agent-arg", action="append", default=[], metavar="ARG",
                        help="one more argument for the agent (repeatable)")
    args = parser.parse_args()
    require_bpf()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("stopped (SIGTERM)"))  # the agent and workload stop too
    import kvtrace
    from kvtrace.client import AgentClient

    if not kvtrace.__file__.startswith(str(ROOT)):
        progress(f"WARNING: kvtrace is imported from {kvtrace.__file__}, not from {ROOT}")
    work = Path(tempfile.mkdtemp(prefix="kvtrace-snapshot-scale-"))
    if args.torch_blocks:
        target = TorchBlocksTarget(work, args.entries)
    else:
        target = CudaMallocTarget(work, args.entries // 2)
    max_entries = max(1 << 20, (args.entries + 65536) * 4 // 3 + 4)  # root's share is three quarters (shares.py)
    socket = work / "kvtrace.sock"
    results: dict = {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "code": code_version(),
                     "kvtrace": kvtrace.__file__, "machine": f"{os.cpu_count()} cores, {os.uname().release}",
                     "workload": "torch blocks" if args.torch_blocks else "cudaMalloc (runtime + driver entries)",
                     "steps": []}
    try:
        # Blocks are traced at depth blocks only (--blocks auto deepens a process when its memory grows).
        blocks = ["--blocks", "always"] if args.torch_blocks else []
        with AgentProcess(socket, "-p", str(target.pid), "--no-nvml", "--max-ledger-entries", str(max_entries),
                          *blocks, *args.agent_arg) as agent:
            agent_pid = agent.process.pid
            progress(f"agent {agent_pid} up; making {target.allocations} {target.what} in {target.pid}")
            started = time.monotonic()
            target.run()
            made = time.monotonic() - started
            with AgentClient.for_socket(socket, timeout_seconds=120) as client:
                deadline = time.monotonic() + 900
                while True:
                    counters = dict(client.info().counters)
                    in_kernel = counters.get("ledger_entries_in_kernel", 0)
                    if in_kernel == target.entries or time.monotonic() > deadline:
                        break
                    progress(f"  the agent counts {in_kernel} of {target.entries} entries in the kernel")
                    time.sleep(2)
            settled = time.monotonic() - started
            entries = target.entries
            results.update(entries=entries, allocations=target.allocations, made_seconds=round(made, 1),
                           settled_seconds=round(settled, 1), ledger_entries_in_kernel=in_kernel,
                           events_submitted=counters.get("events_submitted"), events_lost=counters.get("events_lost"),
                           resyncs=counters.get("resyncs"), max_ledger_entries=max_entries)
            if in_kernel != entries:
                progress(f"WARNING: the agent counts {in_kernel} entries in the kernel, not {entries}")
            rss = RssSampler(agent_pid)
            results["agent_rss_before_mib"] = round(rss.read() / 1024, 1)
            progress(f"{entries} entries live after {settled:.0f} s; agent RSS {rss.read() >> 10} MiB")
            base: list[str] = []
            pid = str(target.pid)
            rss_limit_mib = RSS_GOAL_MIB + args.page_allowance_mib
            results["cli_floor"] = run_step("cli-floor", ["ps", "--socket", str(socket), "--json"], agent_pid,
                                            args.timeout_seconds, count_lines=False)
            results["cli_floor"].pop("stdout", None)
            for step in [s.strip() for s in args.steps.split(",") if s.strip()]:
                if step == "snapshot":
                    spy = None
                    if args.py_spy:
                        spy = PySpy(args.py_spy, agent_pid, min(args.profile_seconds, args.timeout_seconds - 5),
                                    work / "snapshot.pyspy.txt", delay=2.0)
                    result = run_step(step, [*base, "snapshot", "--socket", str(socket), "-p", pid, "--json"],
                                      agent_pid, args.timeout_seconds, count_lines=True,
                                      during=spy.start if spy else None)
                    result["exact"] = result["done"] and result["rows"] == entries
                    goal_size, goal = entries, SNAPSHOT_GOAL
                    if spy is not None:
                        result["profile"] = spy.summary()
                elif step == "leaks":
                    result = run_step(step, [*base, "leaks", "--socket", str(socket), "-p", pid, "--json",
                                             "--min-age", "0"], agent_pid, args.timeout_seconds, count_lines=False)
                    try:
                        report = json.loads(result.pop("stdout"))
                        result.update(allocations_considered=report["allocations_considered"],
                                      suspect_allocations=report["suspect_allocations"],
                                      suspect_count=report["suspect_count"])
                    except (ValueError, KeyError):
                        pass
                    goal_size, goal = target.allocations, BLOCKS_GOAL
                elif step == "memory-viz":
                    output = work / "viz.pickle"
                    result = run_step(step, [*base, "snapshot", "--socket", str(socket), "-p", pid, "--format",
                                             "memory-viz", "-o", str(output)],
                                      agent_pid, args.timeout_seconds, count_lines=False)
                    result.pop("stdout", None)
                    result["written_bytes"] = output.stat().st_size if output.exists() else 0
                    if not args.torch_blocks:
                        result["note"] = ("stub runtime allocations hold no PyTorch blocks: the CLI reads every "
                                          "page (client.held) and then refuses; the time is that read, not an export")
                    goal_size, goal = target.allocations, BLOCKS_GOAL
                else:
                    parser.error(f"unknown step {step}")
                rss_ok = result["agent_peak_rss_mib"] <= rss_limit_mib
                result["goal_seconds"], result["verdict"] = verdict(result["seconds"], result["done"], goal_size,
                                                                    goal, rss_ok)
                result["rss_verdict"] = (f"{'met' if rss_ok else 'MISSED'} (peak {result['agent_peak_rss_mib']:.0f} "
                                         f"MiB, goal <= {RSS_GOAL_MIB} + {args.page_allowance_mib:g} MiB)")
                results["steps"].append(result)
                progress(f"[{step}] {result['seconds']:.1f} s, {result['verdict']}")
            # After the steps: a page of 10 000 leaves the agent's RSS higher (Python keeps what it freed), which
            # would be counted against the steps that follow it.
            results["pages"] = one_page(socket, target.pid, agent_pid, entries)
            results["agent_vmhwm_mib"] = round(rss.read("VmHWM:") / 1024, 1)
    finally:
        target.kill()
    print_report(results, args)
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=2) + "\n")
    return 0 if all(step["verdict"].startswith("met") for step in results["steps"]) else 1


def print_report(results: dict, args: argparse.Namespace) -> None:
    print(f"snapshot scale, {results['date']}; measured: {results['code']}; {results['machine']}")
    print(f"  workload: {results['workload']}, {results.get('allocations')} allocations, "
          f"{results.get('entries')} ledger entries (agent counts {results.get('ledger_entries_in_kernel')} in the "
          f"kernel; made in {results.get('made_seconds')} s, settled after {results.get('settled_seconds')} s; events "
          f"submitted {results.get('events_submitted')}, lost {results.get('events_lost')}, resyncs "
          f"{results.get('resyncs')})")
    print(f"  agent RSS before the steps {results.get('agent_rss_before_mib')} MiB; VmHWM after them "
          f"{results.get('agent_vmhwm_mib')} MiB (the whole run, the allocation burst included)")
    floor = results.get("cli_floor")
    if floor:
        print(f"  CLI floor  {floor['seconds']:.2f} s: `kvtrace ps --json` (a client process's start, one small RPC)")
    for page in results.get("pages", []):
        print(f"  one page   {page['rows']} rows (page_size {page['page_size']}) in {page['seconds']:.3f} s, "
              f"agent peak RSS {page['agent_peak_rss_mib']:.0f} MiB; {page['pages_for_all']} such pages: ~"
              f"{page['projected_seconds_for_all']:.0f} s ({page['projected_rows_per_second']:.0f} rows/s)")
    for step in results["steps"]:
        if step["timed_out"]:
            what = f"not done in {args.timeout_seconds:.0f} s"
        elif step["rc"] != 0:
            what = f"exit {step['rc']} after {step['seconds']:.1f} s"
        else:
            what = f"{step['seconds']:.2f} s"
        print(f"  {step['step']:<10} {what}; goal {step['goal_seconds']:.2f} s: {step['verdict']}; "
              f"agent RSS {step['rss_verdict']}, "
              f"+{step['agent_peak_rss_mib'] - results['agent_rss_before_mib']:.0f} MiB over before the steps")
        print(f"             $ {step['command']}")
        if "rows" in step:
            print(f"             {step['rows']} rows{' so far' if not step['done'] else ''} of {results['entries']} "
                  f"({step['rows_per_second']} rows/s); exact: {'yes' if step.get('exact') else 'NO'}")
        if "allocations_considered" in step:
            print(f"             {step['allocations_considered']} allocations considered, "
                  f"{step['suspect_count']} sites")
        if "note" in step:
            print(f"             note: {step['note']}")
        if step["stderr"] and not step["done"]:
            print(f"             stderr: {step['stderr'][-300:]}")
        profile = step.get("profile")
        if profile and profile.get("samples_in_GetSnapshot"):
            print(f"             py-spy, {profile['samples_in_GetSnapshot']} samples in GetSnapshot; inclusive %:")
            for frame, share in profile["inclusive"][:18]:
                print(f"               {share:5.1f}  {frame}")
            print("             self %:")
            for frame, share in profile["self"][:12]:
                print(f"               {share:5.1f}  {frame}")


if __name__ == "__main__":
    sys.exit(main())
