"""A storm of short-lived CUDA processes (issue 31, attack 1), measured where the agent's loop spends it.

An unprivileged user (nobody) forks children from a process that maps the stub libraries, for --seconds
(at most --rate a second: 650 by default, as in the issue's attack): each child makes one cudaMalloc (1 MiB:
a runtime and a driver allocation in the kernel's ledger) and exits holding it. The BPF source and its
Session run in a thread of this process (the agent's loop, less its analysis and servers), following every
process, probes on the stub libraries only. With --held N a
root process holds N allocations first (2 N ledger entries): the host's size that an exit's work must not
depend on. In the middle of the storm a root process makes 13 cudaMalloc and waits.

Printed: children forked, exits seen, the loop's longest gap between two turns and the turns over 1 s; for
the root process, its events against its calls and how long after its last call the Session listed it
with all 13 MiB (`kvtrace ps` reads the same); after the storm, how long until no gone pid holds objects
(phantoms); the kernel totals map's keys; this process's RSS before and after. --profile prints where the
loop's time went (cProfile, top 25 by cumulative time).

With --exec each child execs the workload first (a new program that loads the libraries: the agent rescans it).

Run as root: .venv/bin/python bench/exit_storm.py [--seconds 20] [--rate 650] [--exec] [--held 0]
                                                  [--drain-seconds 120] [--profile]
"""
from __future__ import annotations

import argparse
import atexit
import cProfile
import json
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import _scoped_probes_factory, code_version, progress, require_bpf  # noqa: E402
from cuda_stubs import Workload, build_stubs_for_anyone  # noqa: E402
from harness import CallSink  # noqa: E402
from kvtrace.model.events import Api, Kind, Layer, Memory  # noqa: E402
from kvtrace.model.processes import ProcessTable  # noqa: E402
from kvtrace.session import Session  # noqa: E402
from kvtrace.sources import procfs  # noqa: E402
from kvtrace.sources.bpf.source import BpfOptions, BpfSource  # noqa: E402

NOBODY = 65534
ROOT_CALLS = 13


def phantom_objects(session: Session) -> int:
    """Objects the Session lists for pids that are gone (what `kvtrace ps` would show for them)."""
    return sum(total.object_count for process in session.processes_holding_memory()
               if not psutil.pid_exists(process.pid) for total in process.totals)


def listed_bytes(session: Session, pid: int) -> int:
    return sum(total.size_bytes for process in session.processes_holding_memory() if process.pid == pid
               for total in process.totals if total.layer is Layer.DRIVER and total.memory is Memory.DEVICE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=20)
    parser.add_argument("--rate", type=float, default=650.0, help="children a second at most (0: as fast as it can)")
    parser.add_argument("--exec", action="store_true", help="each child execs the workload (a new program) first")
    parser.add_argument("--held", type=int, default=0, help="allocations a root process holds first")
    parser.add_argument("--drain-seconds", type=float, default=120.0)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    require_bpf()
    work = Path(tempfile.mkdtemp(prefix="kvtrace-storm-"))
    atexit.register(shutil.rmtree, work, True)
    build = build_stubs_for_anyone(work)  # nobody runs the storm from there
    session = Session(ProcessTable(procfs.read_process))
    exits = [0]
    root_events: list = []
    root_pid = [0]

    def seen(event) -> None:
        if event.kind is Kind.PROCESS_EXIT:
            exits[0] += 1
        elif event.pid == root_pid[0]:
            root_events.append(event)

    session.add_sink(CallSink(seen))
    source = BpfSource(session, BpfOptions(preattach_globs=(str(build.lib_dir / "*.so.*"),)),
                       probes_factory=_scoped_probes_factory(build.lib_dir))
    source.start()
    me = psutil.Process()
    gaps: list[float] = []
    last_turn = [time.monotonic()]
    profiler = cProfile.Profile() if args.profile else None

    def turn(timeout_ms: int = 20) -> None:
        now = time.monotonic()
        gaps.append(now - last_turn[0])
        last_turn[0] = now
        if profiler is not None:
            profiler.enable()
        source.run_once(timeout_ms)
        if profiler is not None:
            profiler.disable()

    holder = None
    if args.held:
        holder = Workload([build.workload, "leak", str(args.held)])
        holder.wait_ready()
        holder.go()
        holder.read_calls(timeout_s=600)
        deadline = time.monotonic() + 600
        while listed_bytes(session, holder.pid) < args.held << 20 and time.monotonic() < deadline:
            turn(100)
        progress(f"root pid {holder.pid} holds {args.held} allocations")
    rss_before = me.memory_info().rss
    storm = subprocess.Popen(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                              str(build.workload), "storm", str(args.seconds)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, KVT_STORM_PER_SECOND=str(args.rate),
                                      **({"KVT_STORM_EXEC": "1"} if args.exec else {})))
    assert storm.stdout is not None and storm.stdin is not None
    storm.stdout.readline()  # ready
    storm.stdin.write("go\n\n")  # go, and the line it waits for after its own
    storm.stdin.flush()
    storm_started = time.monotonic()
    gaps.clear()
    last_turn[0] = time.monotonic()
    root_result: dict[str, object] = {}

    def root_workload() -> None:
        with Workload([build.workload, "hold"]) as workload:
            pid = root_pid[0] = workload.wait_ready()
            workload.go()
            calls = workload.read_calls()
            root_result.update(pid=pid, calls=calls, called=time.monotonic())
            deadline = time.monotonic() + args.drain_seconds + args.seconds
            while listed_bytes(session, pid) < ROOT_CALLS << 20:
                if time.monotonic() > deadline:
                    return
                time.sleep(0.005)
            root_result["listed"] = time.monotonic()
            workload.kill()

    # The loop turns on a thread of its own; this one watches the clock, so that a loop stuck in one turn (as
    # before issue 31) is still measured: the turn in progress counts as a gap as long as it has lasted.
    state: dict[str, float | None] = {"storm_ended": None, "drained": None}
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            turn()
            if state["storm_ended"] is not None and state["drained"] is None and phantom_objects(session) == 0:
                state["drained"] = time.monotonic() - float(state["storm_ended"])

    loop_thread = threading.Thread(target=loop, daemon=True)
    loop_thread.start()
    root_thread = None
    while storm.poll() is None:
        if root_thread is None and time.monotonic() - storm_started >= args.seconds / 2:
            root_thread = threading.Thread(target=root_workload, daemon=True)
            root_thread.start()
        time.sleep(0.05)
    storm_ended = time.monotonic()
    children = json.loads(storm.stdout.readline())["storm_children"]
    progress(f"storm over: {children} children in {storm_ended - storm_started:.1f} s")
    state["storm_ended"] = storm_ended
    while state["drained"] is None and time.monotonic() - storm_ended < args.drain_seconds:
        time.sleep(0.05)
    ongoing = time.monotonic() - last_turn[0]
    longest = max([*gaps, ongoing])
    rss_after = me.memory_info().rss
    print(f"\n{code_version()}; {os.cpu_count()} CPUs; storm {args.seconds} s as uid {NOBODY}"
          f"{' (each child execs)' if args.exec else ''}, "
          f"root holding {args.held} allocations")
    print(f"children forked: {children} ({children / (storm_ended - storm_started):.0f}/s); exits seen {exits[0]}")
    print(f"loop: {len(gaps)} turns, longest gap {longest:.3f} s (the turn in progress: {ongoing:.3f} s), "
          f"turns over 1 s: {sum(g > 1 for g in gaps) + (ongoing > 1)}")
    if "called" in root_result:
        pid = root_result["pid"]
        calls = root_result["calls"]
        traced = sorted((e.address, e.size_bytes, e.device) for e in root_events
                        if e.kind is Kind.ALLOC and e.api is Api.cudaMalloc)
        wanted = sorted((c["address"], c["size_bytes"], max(c["device"], 0)) for c in calls)  # none chosen: 0
        listed = "never listed"
        if "listed" in root_result:
            after = float(root_result["listed"]) - float(root_result["called"])
            listed = f"listed with all {ROOT_CALLS} MiB {after:.3f} s after its last call"
        print(f"root pid {pid}: {len(traced)} of {len(calls)} cudaMalloc traced, "
              f"{'exactly' if traced == wanted else 'NOT exactly'}; {listed}")
    else:
        print("root process: its calls never returned")
    drained = state["drained"]
    if drained is not None:
        print(f"phantom objects of gone pids: 0 after {drained:.2f} s")
    else:
        phantoms = [(process.pid, [(total.layer.name, total.object_count) for total in process.totals])
                    for process in session.processes_holding_memory() if not psutil.pid_exists(process.pid)]
        print(f"phantom objects of gone pids: still after {args.drain_seconds:g} s: {len(phantoms)} pids, e.g. "
              f"{phantoms[:5]}")
    print(f"RSS {rss_before >> 20} -> {rss_after >> 20} MiB")
    if not loop_thread.is_alive() or drained is not None:
        stop.set()
        loop_thread.join(timeout=30)
        if not loop_thread.is_alive():
            counters = session.counters()
            print(f"events seen {counters['events_seen']}, lost {counters.get('events_lost', 0)}; totals map full "
                  f"{counters.get('totals_full', 0)}; ledger full {counters.get('ledger_full', 0)}; kernel totals keys "
                  f"{len(source.probes.read_totals()) if source.probes else -1}")
            store = source.kernel_store
            print("kept per pid: " + ", ".join(f"{name} {len(kept)}" for name, kept in (
                ("processes", session.processes.known()), ("kernel keys", store._kernel_keys if store else {}),
                ("adjustments", store._adjustments if store else {}), ("gone", store._gone if store else {}),
                ("allocation counters", session.ledger.allocations_total), ("python", source.python),
                ("late device", source.late_device), ("native frames", session._native_frames))))
            if profiler is not None:
                pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)
            if holder is not None:
                holder.kill()
            source.stop()
            return
    sys.stdout.flush()
    if holder is not None:
        holder.kill()
    os._exit(1)  # the loop is stuck in a turn: nothing else can stop it


if __name__ == "__main__":
    main()
