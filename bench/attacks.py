"""Issue 31's goals measured on the real agent, under one attack or two at once: the figures for bench/RESULTS.md §Q.

A `kvtrace agent` process (`--cmdline 'hog|workload' --no-nvml`, the kernel's maps at their defaults) runs for
--seconds under each chosen attack:

- storm: uid nobody forks short-lived CUDA children (`workload storm`, --rate a second, as bench/exit_storm.py;
  --exec: each child execs a new program), each exiting with one cudaMalloc held;
- filler: uid 61999 runs `hog alloc 0 0 --fill` (tests/integration/stubs/hog.c, as bench/share_attacks.py): its own
  cuMemAlloc_v2 at made-up addresses, held; when one is done the next starts, until the attack ends (its share of
  the kernel ledger stays full, the rest refused); at the attack's end they exit 0 (--kill-fillers: SIGKILL, deaths
  holding memory, which the flight recorder dumps);
- spin: uid nobody keeps --spinners busy loops running (a user who only burns CPU: the agent's loop then waits
  for a core); --spin-apart puts them in a cpu cgroup of their own, as systemd puts a user's session (user.slice)
  apart from the agent's service (system.slice), and Kubernetes each pod;
- storm+filler: two at once (any two, joined by +).

In the middle (--root-at, half the attack by default) root runs `workload hold` (13 cudaMalloc of 1 MiB, held).
Printed per run, each with the issue's goal and met/missed:

- root: its 26 ledger entries (13 runtime, 13 driver) in the agent's snapshot, address, size and GPU 0 each, and
  13 MiB of driver memory on GPU 0 in its ListProcesses row (what `kvtrace ps` prints);
- listed: seconds from its last call's return to that row (ListProcesses polled every 20 ms; goal ≤ 1 s);
- loop: the agent's event_loop_longest_gap_ms and event_loop_late_turns (GetAgentInfo) before the attack and
  after it: a longest gap that grew was the attack's; goal ≤ 1 000 ms, no late turn;
- RSS: the agent's, sampled every 0.2 s (psutil): before, peak, and the goal 256 MiB + the attacker's share (the
  filler's: its quarter of the kernel ledger at ≈ 440 bytes an entry read into the agent, RESULTS §C);
- phantoms: after the attack (every attacker's process gone), seconds until no gone pid holds objects in
  ListProcesses (goal 0 within 5 s).

Needs root and bcc (as `make test`).

    sudo PYTHONPATH=agent .venv/bin/python bench/attacks.py [storm filler storm+filler] [--seconds 60]
         [--rate 650] [--exec] [--fill 1100000] [--root-at S] [--kill-fillers]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests"), str(HERE.parent / "tests" / "integration")]

from agent_process import AgentProcess  # noqa: E402
from benchlib import CpuMeter, code_version, progress, require_bpf  # noqa: E402
from cuda_stubs import _CFLAGS, STUBS_DIR, StubBuild, Workload, WorkloadError, _gcc, build_stubs_for_anyone  # noqa: E402
from exit_storm import NOBODY, ROOT_CALLS  # noqa: E402
from kvtrace.sources.bpf.loader import ProbeSettings  # noqa: E402
from kvtrace.sources.bpf.shares import Share  # noqa: E402
from share_attacks import as_attacker  # noqa: E402

ATTACKS = ("storm", "filler", "spin")
SPIN_CGROUP = "kvtrace-bench-spinners"
LISTED_GOAL_S, GAP_GOAL_MS, RSS_GOAL_MIB, PHANTOM_GOAL_S = 1.0, 1000, 256, 5.0
MiB = 1 << 20
# The filler's share of the agent's memory: its share of the kernel ledger (a quarter of the default 2^20 entries)
# at what one entry read from the kernel costs the agent as a Python object (≈ 440 bytes, RESULTS §C).
FILLER_SHARE_MIB = Share(ProbeSettings().max_ledger_entries).user * 440 / MiB
FOLLOWED_S = 1.5  # an attacker's or root's process waits this long before its calls: the agent finds and follows it
LAYER_RUNTIME, LAYER_DRIVER, MEMORY_DEVICE = 1, 2, 1  # kvtrace.v1 enums


@dataclass
class Options:
    seconds: float = 60.0
    rate: float = 650.0
    exec_children: bool = False
    fill: int = 1_100_000
    root_at: float | None = None  # seconds into the attack; half of it by default
    phantom_wait: float = 30.0
    agent_args: tuple[str, ...] = ()  # more of `kvtrace agent`'s options
    kill_fillers: bool = False  # SIGKILL (a death holding memory: the flight recorder dumps) instead of stdin closed
    follow_all: bool = False  # the agent without --cmdline: every process's calls reach it (the storm's children too)
    spinners: int = 40  # the spin attack's busy loops
    spin_apart: bool = False  # in a cpu cgroup of their own


@dataclass
class Attackers:
    """The attacks' processes, started and stopped together."""
    build: StubBuild
    hog: Path
    attacks: tuple[str, ...]
    options: Options
    storm: Workload | None = None
    storm_children: int = 0
    fillers: list[Workload] = field(default_factory=list)
    filler_errors: list[str] = field(default_factory=list)
    spinners: list[subprocess.Popen] = field(default_factory=list)
    spin_cgroup: Path | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        if "storm" in self.attacks:
            env = dict(os.environ, KVT_STORM_PER_SECOND=str(self.options.rate),
                       **({"KVT_STORM_EXEC": "1"} if self.options.exec_children else {}))
            self.storm = Workload(as_nobody(self.build.workload, "storm", int(self.options.seconds)), env=env)
            self.storm.wait_ready()
            time.sleep(FOLLOWED_S)
            self.storm.go()
        if "filler" in self.attacks:
            self._thread = threading.Thread(target=self._fill, daemon=True)
            self._thread.start()
        if "spin" in self.attacks:
            if self.options.spin_apart:
                self.spin_cgroup = cpu_cgroup(SPIN_CGROUP)
            for _ in range(self.options.spinners):
                self.spinners.append(subprocess.Popen(as_nobody("sh", "-c", "while :; do :; done")))
                if self.spin_cgroup is not None:
                    (self.spin_cgroup / "cgroup.procs").write_text(f"{self.spinners[-1].pid}\n")

    def _fill(self) -> None:
        """One filler after another until stopped: each holds what it made."""
        while not self._stop.is_set():
            filler = Workload(as_attacker(self.hog, "alloc", 0, 0, self.options.fill))
            self.fillers.append(filler)
            try:
                filler.wait_ready()
                time.sleep(FOLLOWED_S)
                filler.go()
                while not self._stop.is_set():
                    try:
                        filler.expect_line("done", timeout_s=0.5)
                        break
                    except WorkloadError as error:
                        if filler.process.poll() is not None:
                            raise error
            except WorkloadError as error:
                if not self._stop.is_set():
                    self.filler_errors.append(str(error)[:300])
                    return

    def stop_spinners(self) -> None:
        """Kills the spin attack's loops (whatever else failed: they would go on burning the host's CPU)."""
        for spinner in self.spinners:
            spinner.kill()
            spinner.wait()
        self.spinners = []
        if self.spin_cgroup is not None:
            try:
                self.spin_cgroup.rmdir()
            except OSError as error:
                progress(f"WARNING: {self.spin_cgroup} left: {error}")
            self.spin_cgroup = None

    def stop(self) -> None:
        """Waits for the storm's end; ends the fillers (killed: they hold their allocations to the end)."""
        self.stop_spinners()
        if self.storm is not None:
            lines = self.storm.read_calls(timeout_s=self.options.seconds + 600)  # one: {"storm_children": N}
            self.storm_children = sum(line.get("storm_children", 0) for line in lines)
            self.storm.finish()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for filler in self.fillers:
            if self.options.kill_fillers:
                filler.kill()
            else:
                filler.finish(timeout_s=600)  # exits 0 (a filler still calling ends its calls first)


def cpu_cgroup(name: str) -> Path:
    """A new cpu cgroup under the root's, of the default weight (cgroup v1's cpu hierarchy, or v2's with the cpu
    controller); SystemExit where there is none."""
    for root in (Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup")):
        v2 = root == Path("/sys/fs/cgroup") and "cpu" in _read(root / "cgroup.subtree_control").split()
        if (root / "cpu.shares").exists() or v2:
            group = root / name
            group.mkdir(exist_ok=True)
            return group
    raise SystemExit("--spin-apart: no cpu cgroup hierarchy here (cgroup v1 cpu, or v2 with the cpu controller "
                     "in /sys/fs/cgroup/cgroup.subtree_control)")


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def as_nobody(*argv) -> list[str]:
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *map(str, argv)]


def build_attackers(work: Path) -> tuple[StubBuild, Path]:
    """The stub libraries and hog.c, where nobody and uid 61999 can run them."""
    work.chmod(0o755)
    build = build_stubs_for_anyone(work / "stubs")
    hog = work / "hog"
    _gcc(*_CFLAGS, "-o", hog, STUBS_DIR / "hog.c", "-ldl")
    hog.chmod(0o755)
    return build, hog


def _rss_mib(pid: int) -> float:
    try:
        return psutil.Process(pid).memory_info().rss / MiB
    except psutil.Error:
        return 0.0


def phantom_objects(processes) -> int:
    """Objects ListProcesses gives to pids that are gone (what `kvtrace ps` would list for them)."""
    return sum(total.object_count for process in processes if not psutil.pid_exists(process.pid)
               for total in process.totals)


def _root_gpu0_bytes(processes, pid: int) -> int:
    return sum(total.size_bytes for process in processes if process.pid == pid for total in process.totals
               if total.layer == LAYER_DRIVER and total.memory == MEMORY_DEVICE and total.device == 0)


def root_workload(build: StubBuild, client, result: dict) -> None:
    """Root's 13 cudaMalloc during the attack: how soon ListProcesses lists them, and whether the snapshot holds
    its 26 entries exactly."""
    with Workload([build.workload, "hold"]) as workload:
        pid = workload.wait_ready()
        time.sleep(FOLLOWED_S)
        workload.go()
        calls = workload.read_calls()
        called = time.monotonic()
        result.update(root_pid=pid, root_calls=len(calls))
        while time.monotonic() - called < 30:
            if _root_gpu0_bytes(client.processes(), pid) == ROOT_CALLS * MiB:
                result["root_listed_s"] = round(time.monotonic() - called, 3)
                break
            time.sleep(0.02)
        entries = list(client.snapshot(pids=[pid]))
        runtime = sorted((e.address, e.size_bytes, e.device) for e in entries if e.layer == LAYER_RUNTIME)
        driver = sorted((e.size_bytes, e.device) for e in entries if e.layer == LAYER_DRIVER)
        wanted = sorted((c["address"], c["size_bytes"], max(c["device"], 0)) for c in calls)
        result["root_entries"] = f"{len(entries)} of {2 * len(calls)}"
        result["root_exact"] = (len(calls) == ROOT_CALLS and runtime == wanted
                                and driver == [(MiB, 0)] * ROOT_CALLS and len(entries) == 2 * ROOT_CALLS)
        workload.kill()


def _counters(client) -> dict[str, int]:
    return dict(client.info().counters)


def measure(attacks: tuple[str, ...], build: StubBuild, hog: Path, work: Path, options: Options,
            env: dict[str, str] | None = None) -> dict:
    """One agent under `attacks` for options.seconds, root in the middle; the goals' figures (see above)."""
    from kvtrace.client import AgentClient

    socket = work / f"{'-'.join(attacks)}.sock"
    result: dict = {"attacks": "+".join(attacks), "seconds": options.seconds, "agent_args": options.agent_args,
                    **({"spinners": options.spinners, "spin_apart": options.spin_apart} if "spin" in attacks else {}),
                    "fillers_end": "killed" if options.kill_fillers else "exit 0"}
    selection = () if options.follow_all else ("--cmdline", "hog|workload")
    with AgentProcess(socket, *selection, "--no-nvml", *options.agent_args, env=env) as agent, \
            AgentClient.for_socket(socket, timeout_seconds=60) as client:
        time.sleep(2.0)  # past its first turns and report
        before = _counters(client)
        rss_before = _rss_mib(agent.process.pid)
        rss_peak = [rss_before]
        attackers = Attackers(build, hog, attacks, options)
        try:
            attackers.start()
            started = time.monotonic()
            agent_cpu = CpuMeter(agent.process.pid)
            agent_cpu.start()
            root_at = options.root_at if options.root_at is not None else options.seconds / 2
            root_thread = threading.Thread(target=root_workload, args=(build, client, result), daemon=True)
            gaps: list[tuple[float, int]] = []  # (seconds into the attack, the longest gap) where it grew

            def note_gap() -> None:
                gap = _counters(client).get("event_loop_longest_gap_ms", 0)
                if gap > (gaps[-1][1] if gaps else before.get("event_loop_longest_gap_ms", 0)):
                    gaps.append((round(time.monotonic() - started, 1), gap))

            turn = 0
            while time.monotonic() - started < options.seconds:
                if not root_thread.is_alive() and root_thread.ident is None and time.monotonic() - started >= root_at:
                    root_thread.start()
                rss_peak.append(_rss_mib(agent.process.pid))
                turn += 1
                if turn % 5 == 0:
                    note_gap()
                time.sleep(0.2)
            # The agent's CPU over the attack's seconds (not the attackers' start and stop).
            result["agent_cpu_share"] = round(agent_cpu.stop(), 3)
            attackers.stop()
        finally:
            attackers.stop_spinners()
        ended = time.monotonic()
        result["attack_ended_s"] = round(ended - started, 1)
        root_thread.join(timeout=60)
        phantoms = phantom_objects(client.processes())
        while phantoms and time.monotonic() - ended < options.phantom_wait:
            rss_peak.append(_rss_mib(agent.process.pid))
            time.sleep(0.1)
            phantoms = phantom_objects(client.processes())
        result["phantoms_gone_s"] = round(time.monotonic() - ended, 2) if not phantoms else None
        result["phantoms_left"] = phantoms
        time.sleep(1.5)  # a report: the counters of the last turns
        note_gap()
        after = _counters(client)
        result["gap_grew_at"] = gaps
        rss_peak.append(_rss_mib(agent.process.pid))
        result.update(
            storm_children=attackers.storm_children, fillers=len(attackers.fillers),
            filler_errors=attackers.filler_errors,
            gap_ms_before=before.get("event_loop_longest_gap_ms", 0),
            gap_ms=after.get("event_loop_longest_gap_ms", 0),
            late_turns=after.get("event_loop_late_turns", 0) - before.get("event_loop_late_turns", 0),
            events_lost=after.get("events_lost", 0) - before.get("events_lost", 0),
            share_full=after.get("share_full", 0), ledger_full=after.get("ledger_full", 0),
            totals_full=after.get("totals_full", 0),
            site_samples=after.get("site_samples", 0) - before.get("site_samples", 0),
            site_sample_entries=after.get("site_sample_entries", 0),
            site_sample_longest_ms=after.get("site_sample_longest_ms", 0),
            rss_before_mib=round(rss_before), rss_peak_mib=round(max(rss_peak)),
            load=" ".join(f"{x:.1f}" for x in os.getloadavg()))
        result["counters_grew"] = {name: value - before.get(name, 0) for name, value in sorted(after.items())
                                   if value != before.get(name, 0)}
        # What the flight recorder's ring held at the end (its part of the RSS): a dump of it, after the peak.
        try:
            result["flight_ring_events"] = client.dump_flight_recorder("bench: the ring at the end").event_count
        except Exception as error:  # the figure is an aside: the goals' figures are above
            result["flight_ring_events"] = f"no dump: {error}"
    return result


def verdicts(result: dict) -> list[tuple[str, str, str, bool]]:
    """(goal, figure, wanted, met) for each of the issue's goals."""
    listed = result.get("root_listed_s")
    gap_grew = result["gap_ms"] > result["gap_ms_before"]
    gap = f"{result['gap_ms']} ms" + ("" if gap_grew else f" (before the attack: {result['gap_ms_before']} ms)")
    gone = result.get("phantoms_gone_s")
    rss_goal = RSS_GOAL_MIB + (FILLER_SHARE_MIB if "filler" in result["attacks"] else 0)
    return [
        ("root traced exactly, GPU 0", f"{result.get('root_entries', 'none')} entries, "
         f"{'exact' if result.get('root_exact') else 'NOT exact'}", "26 of 26, exact", bool(result.get("root_exact"))),
        ("root listed after its calls", f"{listed} s" if listed is not None else "never (30 s)",
         f"≤ {LISTED_GOAL_S:g} s", listed is not None and listed <= LISTED_GOAL_S),
        ("loop's longest gap", f"{gap}; late turns {result['late_turns']}", f"≤ {GAP_GOAL_MS} ms, 0 late",
         result["gap_ms"] <= GAP_GOAL_MS and result["late_turns"] == 0),
        ("agent RSS", f"{result['rss_before_mib']} → peak {result['rss_peak_mib']} MiB",
         f"≤ {rss_goal:.0f} MiB (256 + the attacker's share)", result["rss_peak_mib"] <= rss_goal),
        ("phantom objects after", f"0 after {gone} s" if gone is not None else f"{result['phantoms_left']} left",
         f"0 within {PHANTOM_GOAL_S:g} s", gone is not None and gone <= PHANTOM_GOAL_S),
    ]


def measure_once(attacks: tuple[str, ...], options: Options, env: dict[str, str]) -> dict:
    """One run of `attacks` with attackers built in a scratch folder of its own, removed after (the regression
    tests' way: tests/integration/test_two_attacks.py, test_site_sample_turns.py)."""
    work = Path(tempfile.mkdtemp(prefix="kvtrace-attacks-"))
    try:
        build, hog = build_attackers(work)
        return measure(attacks, build, hog, work, options, env)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="*", default=["storm", "filler", "storm+filler"],
                        help="attacks, one run each; two at once joined by +")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--rate", type=float, default=650.0, help="the storm's children a second (0: no limit)")
    parser.add_argument("--exec", action="store_true", help="each storm child execs a new program")
    parser.add_argument("--fill", type=int, default=1_100_000, help="allocations of each filler process")
    parser.add_argument("--root-at", type=float, help="seconds into the attack (half of it by default)")
    parser.add_argument("--kill-fillers", action="store_true",
                        help="the fillers end killed (SIGKILL: deaths holding memory) instead of exiting 0")
    parser.add_argument("--follow-all", action="store_true",
                        help="the agent without --cmdline 'hog|workload': every process's calls reach it (with it, "
                             "the storm's forked children are filtered in the kernel and only their totals are kept)")
    parser.add_argument("--agent-arg", action="append", default=[], metavar="ARG",
                        help="one more argument of `kvtrace agent` (repeat it; --agent-arg=--flight-max-records ...)")
    parser.add_argument("--spinners", type=int, default=40, help="the spin attack's busy loops (default: %(default)s)")
    parser.add_argument("--spin-apart", action="store_true",
                        help="the spinners in a cpu cgroup of their own (as systemd's user.slice, a pod's cgroup)")
    args = parser.parse_args()
    runs = [tuple(run.split("+")) for run in args.runs]
    if any(attack not in ATTACKS for run in runs for attack in run):
        parser.error(f"attacks are {', '.join(ATTACKS)}, two at once joined by +")
    require_bpf()
    options = Options(seconds=args.seconds, rate=args.rate, exec_children=args.exec, fill=args.fill,
                      root_at=args.root_at, kill_fillers=args.kill_fillers, agent_args=tuple(args.agent_arg),
                      follow_all=args.follow_all, spinners=args.spinners, spin_apart=args.spin_apart)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent / "agent"), *sys.path]))
    work = Path(tempfile.mkdtemp(prefix="kvtrace-attacks-"))
    try:
        build, hog = build_attackers(work)
        print(json.dumps({"code": code_version(), "machine": f"{os.cpu_count()} cores, {os.uname().release}",
                          "date": time.strftime("%Y-%m-%d %H:%M %Z"), "load": os.getloadavg()}), flush=True)
        for run in runs:
            progress(f"{'+'.join(run)}: {args.seconds:g} s")
            result = measure(run, build, hog, work, options, env)
            print(json.dumps(result), flush=True)
            for goal, figure, wanted, met in verdicts(result):
                print(f"  {goal:30} {figure:55} goal {wanted:35} {'met' if met else 'MISSED'}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
