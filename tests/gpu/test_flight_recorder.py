"""The flight recorder on a real OOM: a torch process leaks GPU memory from one function until CUDA
runs out; the agent's dump, replayed after the process is gone, names that function.

GIVEN `kvtrace agent` (the real one, flight recorder on, also recording to a file) and a torch process
that keeps a 1 GiB tensor per step from `leak_activations()` until torch raises OutOfMemoryError and
the process exits with status 1,
THEN the agent writes an `oom` dump at the failed cudaMalloc and a `died` dump at the exit; replayed,
the oom dump's `kvtrace leaks` puts leak_activations first with exactly the tensors the process kept;
its flame graph, Perfetto trace and PyTorch memory-viz file are written and read back by their own
readers (torch's _memory_viz for the pickle).

Figures are printed (run with -s); with $KVTRACE_GPU_OUT set, the files are copied there (the docs'
pictures are made from them).
"""
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from agent_process import AgentProcess, kvtrace
from conftest import check_all, source_line, wait_for
from kvtrace.client import AgentClient

WORKLOAD = Path(__file__).parent / "workloads" / "oom_leak.py"
GiB = 1 << 30


def _attached(socket: Path, pid: int) -> bool:
    with AgentClient.for_socket(socket) as client:
        return any(pid in library.pids for library in client.info().attached_libraries)


def _dumps(directory: Path, trigger: str) -> list[Path]:
    return sorted(directory.glob(f"flight-*-{trigger}-*.kvtrace"))


def test_a_real_oom_leaves_a_dump_whose_leaks_name_the_leaking_function(tmp_path):
    flight_dir = tmp_path / "flight"
    recording = tmp_path / "oom.kvtrace"
    socket = tmp_path / "kvtrace.sock"
    failures: list[str] = []
    target = subprocess.Popen([sys.executable, str(WORKLOAD), "1024"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = target.stdout.readline().split()
        assert ready[:1] == ["ready"], target.stderr.read()
        pid = int(ready[1])
        with AgentProcess(socket, "--flight-dir", str(flight_dir), "--record", str(recording),
                          "--flight-window", "120") as agent:
            assert wait_for(lambda: _attached(socket, pid), 60), agent.stderr_text()
            started = time.monotonic()
            target.stdin.write("go\n")
            target.stdin.flush()
            result = json.loads(target.stdout.readline())
            exit_status = target.wait(timeout=120)
            oom_seconds = time.monotonic() - started
            dumps = wait_for(lambda: _dumps(flight_dir, "oom") and _dumps(flight_dir, "died"), 30)
            listed = kvtrace("flight", "--json", "--socket", str(socket.with_name("kvtrace-admin.sock")))
            agent_log = agent.stderr_text()
            counters = agent.counters()
        print("\nagent counters: " + ", ".join(f"{name} {counters.get(name, 0)}" for name in (
            "events_submitted", "events_seen", "events_lost", "blocks_unsent", "events_undecodable", "resyncs")))
        print("agent log:\n" + "\n".join(line for line in agent_log.splitlines() if "WARNING" in line or "ERROR" in line
                                          or "flight" in line)[-3000:])
        leaked, step = result["leaked"], result["step_bytes"]
        print(f"\nworkload: kept {leaked} x {step >> 20} MiB from leak_activations, then OOM after "
              f"{oom_seconds:.1f} s; exit status {exit_status}")
        check_all([f"exit status {exit_status}, not 1"] if exit_status != 1 else [])
        assert dumps, f"no oom and died dumps in {flight_dir}: {list(flight_dir.iterdir())}\n{agent_log}"
        oom_dump, died_dump = _dumps(flight_dir, "oom")[0], _dumps(flight_dir, "died")[0]
        listing = [json.loads(line) for line in listed.stdout.splitlines()]
        for dump in listing:
            print(f"dump {dump['trigger']}: {dump['size_bytes']} bytes, {dump['event_count']} events, "
                  f"window {dump['window_seconds']:.1f} s: {dump['reason']}")
        triggers = {dump["trigger"]: dump for dump in listing}
        if set(triggers) != {"oom", "died"}:
            failures.append(f"kvtrace flight lists {sorted(triggers)}, not oom and died")
        if "died" in triggers and "exited with status 1" not in triggers["died"]["reason"]:
            failures.append(f"died reason: {triggers['died']['reason']}")

        # The dump, replayed after the process is gone, names the leaking function.
        leaks = kvtrace("leaks", "--input", str(oom_dump), "--min-age", "0", "--json")
        assert leaks.returncode == 0, leaks.stderr
        print(leaks.stderr.strip())
        report = json.loads(leaks.stdout)
        first = report["suspects"][0]
        frames = [frame["function"] for frame in first.get("stack", [])]
        print(f"replayed leaks, first suspect: {first['outstanding_bytes']} bytes in "
              f"{first['allocation_count']} allocations, stack {frames}")
        if not frames or frames[0] != "leak_activations" or first["stack"][0]["line"] != source_line(
                "# LEAK_LINE", WORKLOAD):
            failures.append(f"first suspect's stack: {first.get('stack')}")
        # The oom dump stands at the first failed cudaMalloc: what was kept before it. torch then empties
        # its cache and retries, so the last tensor kept may come after (the continuous recording says).
        recorded_tail = kvtrace("tail", "--input", str(recording), "--json")
        recorded = [json.loads(line) for line in recorded_tail.stdout.splitlines()]
        first_failure = next(index for index, event in enumerate(recorded) if event["kind"] == "alloc_failed")
        before = {event["address"] for event in recorded[:first_failure]
                  if event["kind"] == "alloc" and event["api"] == "cudaMalloc"}
        kept_before = len(set(result["leaked_ptrs"]) & before)
        print(f"kept before the first failed cudaMalloc: {kept_before} of {leaked} (recording: "
              f"{len(recorded)} events, the first failure at {first_failure})")
        if kept_before < leaked - 1:
            failures.append(f"only {kept_before} of {leaked} kept tensors came before the first failure")
        if (first["allocation_count"], first["outstanding_bytes"]) != (kept_before, kept_before * step):
            failures.append(f"oom dump: first suspect holds {first['allocation_count']} allocations, "
                            f"{first['outstanding_bytes']} bytes; the workload kept {kept_before} x {step} by then")
        # The died dump stands just before the exit: everything the process kept.
        died = kvtrace("leaks", "--input", str(died_dump), "--min-age", "0", "--json")
        died_first = json.loads(died.stdout)["suspects"][0] if died.returncode == 0 else {}
        print(f"replayed died dump, first suspect: {died_first.get('outstanding_bytes')} bytes in "
              f"{died_first.get('allocation_count')} allocations")
        if [f["function"] for f in died_first.get("stack", [])][:1] != ["leak_activations"] or (
                died_first["allocation_count"], died_first["outstanding_bytes"]) != (leaked, leaked * step):
            failures.append(f"the died dump's first suspect: {died_first or died.stderr}; kept {leaked} x {step}")

        # The views, from the dump and from the continuous recording.
        tail = kvtrace("tail", "--input", str(oom_dump), "--json")
        events = [json.loads(line) for line in tail.stdout.splitlines()]
        failed = [event for event in events if event["kind"] == "alloc_failed"]
        print(f"oom dump: {len(events)} events, {len(failed)} failed allocations, the first "
              f"{failed[0]['api'] if failed else None} of {failed[0]['size_bytes'] if failed else 0} bytes, "
              f"error {failed[0]['error_code'] if failed else None}")
        if events:  # where the dump's window starts and ends (a dump that starts at its trigger lost its past)
            print("oom dump spans: " + " ... ".join(f"{event['kind']} {event['api']} at {event.get('timestamp_ns')}"
                                                    for event in (events[0], events[-1])))
        if not failed or failed[0]["error_code"] != 2 or failed[0]["size_bytes"] < step:
            failures.append(f"the dump's failed allocations: {failed[:3]}")
        kept = {event["address"] for event in events if event["kind"] == "alloc" and event["api"] == "cudaMalloc"}
        if not set(result["leaked_ptrs"]) & before <= kept:
            failures.append(f"{len(set(result['leaked_ptrs']) & before - kept)} tensors kept before the failure "
                            "have no cudaMalloc in the dump")
        outputs = {"oom.speedscope.json": ("flamegraph", "--input", str(oom_dump), "-o"),
                   "oom.folded": ("flamegraph", "--input", str(oom_dump), "--format", "folded", "-o"),
                   "oom.blocks.speedscope.json": ("flamegraph", "--input", str(oom_dump), "--blocks", "-o"),
                   "oom.pickle": ("snapshot", "--input", str(oom_dump), "-p", str(pid), "--format", "memory-viz",
                                  "-o")}
        try:
            import perfetto  # noqa: F401
            outputs["oom.pftrace"] = ("perfetto", "--input", str(recording), "-o")
        except ImportError:
            print("perfetto is not importable here: no Perfetto trace (pip install 'kvtrace[perfetto]')")
        for name, argv in outputs.items():
            made = kvtrace(*argv, str(tmp_path / name), timeout=300)
            print(f"{name}: exit {made.returncode}, {made.stderr.strip().splitlines()[-1:]}")
            if made.returncode != 0:
                failures.append(f"kvtrace {' '.join(argv[:1])} -> {name}: {made.stderr}")
        if (tmp_path / "oom.pickle").exists():
            stats = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "stats",
                                    str(tmp_path / "oom.pickle")], capture_output=True, text=True, timeout=300)
            plot = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "trace_plot",
                                   str(tmp_path / "oom.pickle"), "-o", str(tmp_path / "oom.memory_viz.html")],
                                  capture_output=True, text=True, timeout=300)
            print(f"torch _memory_viz stats: exit {stats.returncode}, {stats.stdout.strip().splitlines()[:4]}")
            if stats.returncode != 0 or plot.returncode != 0:
                failures.append(f"torch's _memory_viz refused the pickle: {stats.stderr} {plot.stderr}")
        for view in (("leaks", "--min-age", "0"), ("ps",), ("top", "--once"), ("snapshot",)):
            shown = kvtrace(*view, "--input", str(oom_dump))
            (tmp_path / f"oom.{view[0]}.txt").write_text(shown.stdout)
        print(f"recording {recording.stat().st_size} bytes; oom dump {oom_dump.stat().st_size} bytes")
        out = os.environ.get("KVTRACE_GPU_OUT")
        if out:  # one archive: the files the docs' pictures are made from
            with tarfile.open(Path(out) / "flight-files.tar.gz", "w:gz") as archive:
                for path in [oom_dump, died_dump, recording, *tmp_path.glob("oom.*")]:
                    archive.add(path, arcname=path.name)
        check_all(failures)
    finally:
        if target.poll() is None:
            target.kill()
