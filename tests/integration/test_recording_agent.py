"""Recording, replay and the flight recorder with the real agent, on Python workloads calling the stub
libcudart (each cudaMalloc is a runtime event and, inside it, a driver cuMemAlloc_v2 event).

GIVEN `kvtrace agent` following workloads that allocate known amounts from known functions,
WHEN an allocation fails with out-of-memory, a process holding memory is killed, the agent gets
SIGUSR1, or the agent's events are recorded (`kvtrace agent --record`, `kvtrace record`),
THEN the dump or recording replays (`--input FILE`) to exactly what happened: the leaking function,
the last calls before the OOM, the process's death, and the snapshot and process list the agent
itself answered.
"""
from __future__ import annotations

import grp
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent_process import KVTRACE, AgentProcess, kvtrace
from cuda_stubs import Workload

MiB = 1 << 20
LEAKS = 23
FREES = 5
NOBODY = 65534  # kvtrace(..., user=NOBODY): uid and gid 65534, no other groups

# One command a line on stdin, one answer a line on stdout; stdin closed: exit status 0, holding
# what is kept (the stub never frees at exit: the agent's ledger drops it with the process).
TARGET = textwrap.dedent("""
    import ctypes, os, sys

    cudart = ctypes.CDLL(sys.argv[1])
    kept = []

    def leak_kv():  # calls cudaMalloc itself: the innermost Python frame of its allocations
        pointer = ctypes.c_void_p()
        assert cudart.cudaMalloc(ctypes.byref(pointer), ctypes.c_size_t(1 << 20)) == 0
        kept.append(pointer)

    def grow_kv():  # the stub driver fails 1 TiB with CUDA_ERROR_OUT_OF_MEMORY
        pointer = ctypes.c_void_p()
        return cudart.cudaMalloc(ctypes.byref(pointer), ctypes.c_size_t(1 << 40))

    def ping():
        pointer = ctypes.c_void_p()
        assert cudart.cudaMalloc(ctypes.byref(pointer), ctypes.c_size_t(4096)) == 0
        assert cudart.cudaFree(pointer) == 0

    def release(count):
        for _ in range(count):
            assert cudart.cudaFree(kept.pop(0)) == 0

    print("ready", os.getpid(), flush=True)
    for line in sys.stdin:
        command, *arguments = line.split()
        if command == "leak":
            for _ in range(int(arguments[0])):
                leak_kv()
            print("ok", flush=True)
        elif command == "free":
            release(int(arguments[0]))
            print("ok", flush=True)
        elif command == "oom":
            print("oom", grow_kv(), flush=True)
        elif command == "ping":
            ping()
            print("ok", flush=True)
        elif command == "exit":
            sys.exit(int(arguments[0]))  # holding what is kept
""")


def python_workload(directory: Path, libcudart: Path) -> Workload:
    script = directory / "workload.py"
    script.write_text(TARGET)
    return Workload([sys.executable, str(script), str(libcudart)])


def ask(workload: Workload, command: str, answer: str = "ok") -> None:
    workload.process.stdin.write(command + "\n")
    workload.process.stdin.flush()
    workload.expect_line(answer)


def json_lines(result: subprocess.CompletedProcess) -> list[dict]:
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def poll(check: Callable[[], object], what: str, timeout_s: float = 20.0, every_s: float = 0.2):
    """check()'s first true value, polled until the deadline."""
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(every_s)
    return value


def dumps_in(directory: Path) -> list[Path]:
    return sorted(directory.glob("flight-*.kvtrace")) if directory.is_dir() else []


def settled_snapshot(socket: Path, objects: int, *pids: int) -> str:
    """`kvtrace snapshot --json -p PID...` once the agent holds `objects` objects of those processes."""
    flags = [flag for pid in pids for flag in ("-p", str(pid))]

    def check():
        result = kvtrace("snapshot", "--json", *flags, "--socket", str(socket))
        assert result.returncode == 0, result.stderr
        return result.stdout if result.stdout.count("\n") == objects else None
    return poll(check, f"the agent holding {objects} objects of pids {pids}", every_s=0.3)


def layer_counts(events: list[dict]) -> Counter:
    return Counter((event["kind"], event["api"], event["layer"]) for event in events)


class LiveTail:
    """`kvtrace tail --json ARGS` against the running agent, its lines read on a thread."""

    def __init__(self, *args: str) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        self._stderr = tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen([*KVTRACE, "tail", "--json", *args], stdout=subprocess.PIPE,
                                        stderr=self._stderr, text=True, env=env)
        self.events: list[dict] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.events.append(json.loads(line))

    def first(self, wanted: Callable[[dict], bool], timeout_s: float = 20.0) -> dict:
        def check():
            assert self.process.poll() is None, self.stderr_text()
            return next((event for event in list(self.events) if wanted(event)), None)
        return poll(check, "kvtrace tail showing the event", timeout_s, every_s=0.1)

    def stderr_text(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read()

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)
        self._reader.join(timeout=5)
        self.process.stdout.close()
        self._stderr.close()


# ---- 1. a planted OOM ----

@dataclass(frozen=True)
class PlantedOom:
    pid: int
    dumps: list[Path]  # after the agent stopped
    listing: list[dict]  # `kvtrace flight --json`, live
    leaks: dict  # `kvtrace leaks --input DUMP --min-age 0 --json`
    tail: list[dict]  # `kvtrace tail --input DUMP --json`


@pytest.fixture(scope="module")
def planted_oom(tmp_path_factory, stub_build) -> PlantedOom:
    """A workload keeps 23 x 1 MiB from leak_kv(), then asks cudaMalloc for 1 TiB (error 2) and waits;
    the agent follows it with --flight-dir, and is stopped once it saw an allocation made after."""
    from harness import require_tracing_here

    require_tracing_here()
    directory = tmp_path_factory.mktemp("oom")
    flight = directory / "flight"
    socket = directory / "kvtrace.sock"
    with python_workload(directory, stub_build.libcudart) as workload:
        pid = workload.wait_ready()
        with AgentProcess(socket, "-p", str(pid), "--no-nvml", "--flight-dir", str(flight)) as agent:
            ask(workload, f"leak {LEAKS}")
            ask(workload, "oom", answer="oom 2")  # cudaErrorMemoryAllocation
            poll(lambda: dumps_in(flight), "a flight recorder dump")
            # The runtime's failure comes after the driver's, within the OOM trigger's cooldown: once the
            # agent holds an allocation made after both, a second dump would have been asked for.
            ask(workload, "leak 1")
            settled_snapshot(socket, 2 * (LEAKS + 1), pid)
            listing = json_lines(kvtrace("flight", "--json", "--socket", str(socket)))
            assert agent.stop() == 0, agent.stderr_text()
        dumps = dumps_in(flight)
    assert len(dumps) == 1, dumps
    leaks = kvtrace("leaks", "--input", str(dumps[0]), "--min-age", "0", "--json")
    assert leaks.returncode == 0, leaks.stderr
    tail = json_lines(kvtrace("tail", "--input", str(dumps[0]), "--json", "--stacks"))
    return PlantedOom(pid, dumps, listing, json.loads(leaks.stdout), tail)


def test_an_oom_dumps_once_and_the_dump_names_the_leaking_function(planted_oom):
    """GIVEN a workload that kept 23 x 1 MiB from leak_kv(), then failed a 1 TiB cudaMalloc with error 2,
    WHEN the flight recorder dumps and `kvtrace leaks --input DUMP` reads the dump at its trigger,
    THEN there is exactly one dump, triggered by the OOM of that pid, and leak_kv is the first suspect
    with exactly 23 allocations and 23 MiB."""
    (dump,) = planted_oom.dumps
    pid = planted_oom.pid
    assert dump.name.startswith("flight-") and dump.name.endswith(f"-oom-{pid}.kvtrace")
    assert dump.stat().st_mode & 0o777 == 0o600
    (listed,) = planted_oom.listing
    assert (listed["path"], listed["trigger"], listed["pid"], listed["device"]) == (str(dump), "oom", pid, 0)
    assert listed["reason"].startswith("cuMemAlloc_v2 of 1.0 TiB failed with out of memory (error 2) "
                                       f"in pid {pid} ")
    report = planted_oom.leaks
    first = report["suspects"][0]
    assert first["stack"][0]["function"] == "leak_kv"
    assert (first["pid"], first["allocation_count"], first["outstanding_bytes"]) == (pid, LEAKS, LEAKS * MiB)
    assert report["suspect_count"] == 1 and report["suspect_allocations"] == LEAKS  # the 24th came after


def test_the_oom_dump_ends_with_the_failure_after_the_leaking_calls(planted_oom):
    """GIVEN the dump of the planted OOM,
    WHEN `kvtrace tail --input DUMP --json` lists its events,
    THEN they are 1 MiB allocations from leak_kv alternating driver cuMemAlloc_v2 then runtime cudaMalloc
    (the driver call returns inside the runtime's), then the driver's cuMemAlloc_v2 of 1 TiB as
    alloc_failed with error_code 2, last: the trigger (the runtime's own failure returns after it)."""
    events = planted_oom.tail
    *allocations, failure = events
    assert (failure["kind"], failure["api"], failure["layer"], failure["error_code"], failure["size_bytes"],
            failure["pid"]) == ("alloc_failed", "cuMemAlloc_v2", "driver", 2, 1 << 40, planted_oom.pid)
    assert failure["stack"][0]["function"] == "grow_kv"
    assert {(event["kind"], event["size_bytes"], event["error_code"], event["stack"][0]["function"])
            for event in allocations} == {("alloc", MiB, 0, "leak_kv")}
    runtime = [event["address"] for event in allocations if event["layer"] == "runtime"]
    assert len(set(runtime)) == LEAKS
    expected = [(api, address) for address in runtime for api in ("cuMemAlloc_v2", "cudaMalloc")]
    calls = [(event["api"], event["address"]) for event in allocations]
    assert calls == expected
    assert [event["timestamp_ns"] for event in events] == sorted(event["timestamp_ns"] for event in events)


def test_the_oom_dump_holds_every_call_of_its_window(planted_oom):
    """GIVEN the dump of the planted OOM, whose window (120 s) holds everything the workload did,
    WHEN `kvtrace tail --input DUMP --json` lists its events,
    THEN all of them are there: 23 runtime cudaMalloc, 23 driver cuMemAlloc_v2, then the failure."""
    assert layer_counts(planted_oom.tail) == Counter({
        ("alloc", "cudaMalloc", "runtime"): LEAKS, ("alloc", "cuMemAlloc_v2", "driver"): LEAKS,
        ("alloc_failed", "cuMemAlloc_v2", "driver"): 1})


# ---- 2. a process dying holding memory ----

def test_a_process_killed_holding_memory_dumps_and_a_clean_exit_does_not(tmp_path, bpf_here, stub_build):
    """GIVEN three workloads that each allocate 23 x 1 MiB and free 5 (18 MiB held), followed by the agent,
    WHEN one exits with status 0, then one is killed with SIGKILL, then one exits with status 3, each
    still holding its memory,
    THEN `kvtrace tail` shows their process_exit events with the wait status in error_code (0, 9,
    3 << 8) and freed_bytes 18 MiB; the clean exit writes no dump; the kill writes exactly one, trigger
    "died", named and listed by `kvtrace flight` as "killed by signal 9 holding 18.0 MiB", which
    replays to the 18 runtime and 18 driver objects the process held when it died; the exit with
    status 3 writes its own (the cooldown is per process), "exited with status 3"."""
    flight = tmp_path / "flight"
    socket = tmp_path / "kvtrace.sock"
    held = LEAKS - FREES
    with python_workload(tmp_path, stub_build.libcudart) as clean, Workload(clean.argv) as killed, \
            Workload(clean.argv) as failing:
        workloads = (clean, killed, failing)
        pids = [workload.wait_ready() for workload in workloads]
        with AgentProcess(socket, *(flag for pid in pids for flag in ("-p", str(pid))), "--no-nvml",
                          "--flight-dir", str(flight)) as agent:
            tail = LiveTail("--socket", str(socket))
            try:
                def tail_reads():  # once it shows a ping (an allocation freed at once: nothing held)
                    ask(clean, "ping")
                    return any(event["pid"] == clean.pid for event in list(tail.events))

                poll(tail_reads, "kvtrace tail reading", every_s=0.5)
                for workload in workloads:
                    ask(workload, f"leak {LEAKS}")
                    ask(workload, f"free {FREES}")
                settled_snapshot(socket, 3 * 2 * held, *pids)

                def exit_of(pid: int) -> dict:
                    return tail.first(lambda event: event["kind"] == "process_exit" and event["pid"] == pid)

                assert clean.finish() == 0
                clean_exit = exit_of(clean.pid)
                assert killed.kill() == -signal.SIGKILL
                killed_exit = exit_of(killed.pid)
                failing.process.stdin.write("exit 3\n")
                failing.process.stdin.flush()
                assert failing.process.wait(timeout=30) == 3
                failing_exit = exit_of(failing.pid)
            finally:
                tail.close()
            poll(lambda: len(dumps_in(flight)) == 2, "the dumps of the killed and the failed process")
            listing = json_lines(kvtrace("flight", "--json", "--socket", str(socket)))
            assert agent.stop() == 0, agent.stderr_text()
    assert [(event["error_code"], event["freed_bytes"]) for event in (clean_exit, killed_exit, failing_exit)] \
        == [(0, held * MiB), (signal.SIGKILL, held * MiB), (3 << 8, held * MiB)]
    dumps = {int(path.name.rsplit("-", 1)[1].split(".")[0]): path for path in dumps_in(flight)}
    assert sorted(dumps) == sorted([killed.pid, failing.pid])  # none for the clean exit
    dump = dumps[killed.pid]
    listed = next(entry for entry in listing if entry["pid"] == killed.pid)
    failed = next(entry for entry in listing if entry["pid"] == failing.pid)
    assert failed["trigger"] == "died"
    assert failed["reason"].endswith(" exited with status 3 holding 18.0 MiB of GPU memory")
    assert (listed["path"], listed["trigger"], listed["pid"]) == (str(dump), "died", killed.pid)
    assert listed["reason"].startswith(f"pid {killed.pid} ")
    assert listed["reason"].endswith(" killed by signal 9 holding 18.0 MiB of GPU memory")
    replayed = json_lines(kvtrace("snapshot", "--json", "--input", str(dump), "-p", str(killed.pid)))
    assert Counter(entry["layer"] for entry in replayed) == Counter({"runtime": held, "driver": held})
    assert {entry["size_bytes"] for entry in replayed} == {MiB}


@pytest.mark.parametrize("follow", ["pid", "cmdline"])
def test_an_oom_and_the_death_right_after_it_each_dump_everything_the_process_held(tmp_path, bpf_here, stub_build,
                                                                                  follow):
    """What a real OOM does (tests/gpu/test_flight_recorder.py): GIVEN a workload followed by the agent that keeps
    78 x 1 MiB, WHEN its next cudaMalloc fails out of memory and it exits with status 1 at once, THEN the oom dump
    (its ledger copied at the trigger) and the died dump (read after the trigger on the recorder's thread, the dead
    process's entries held for the read) each replay to the 78 runtime and 78 driver objects it held, and each
    window holds every cudaMalloc the process made in it; followed by pid (-p) or by command line (--cmdline; the
    race of a dead process leaving the followed set before the read is held by tests/unit/test_site_sample.py).

    (Not asserted: the kernel keeps no past, so a copy "at the trigger" is the kernel's ledger when the agent's
    loop reads the failure, milliseconds later; a process that frees right after its failed call, as PyTorch
    empties its cache, shows without those objects, tried here: 38 of 78 after 40 frees sent with the failure.)"""
    kept = 78
    flight = tmp_path / "flight"
    socket = tmp_path / "kvtrace.sock"
    with python_workload(tmp_path, stub_build.libcudart) as workload:
        pid = workload.wait_ready()
        selection = ["-p", str(pid)] if follow == "pid" else ["--cmdline", "workload[.]py"]
        with AgentProcess(socket, *selection, "--no-nvml", "--flight-dir", str(flight),
                          "--flight-window", "120") as agent:
            poll(lambda: kvtrace("ps", "--json", "--socket", str(socket)).returncode == 0, "the agent answering")
            ask(workload, f"leak {kept}")
            settled_snapshot(socket, 2 * kept, pid)
            workload.process.stdin.write("oom\nexit 1\n")
            workload.process.stdin.flush()
            assert workload.process.wait(timeout=30) == 1
            poll(lambda: len(dumps_in(flight)) == 2, "the oom and the died dump")
            assert agent.stop() == 0, agent.stderr_text()
    by_trigger = {path.name.split("-")[3]: path for path in dumps_in(flight)}
    assert sorted(by_trigger) == ["died", "oom"]
    for trigger, dump in sorted(by_trigger.items()):
        replayed = json_lines(kvtrace("snapshot", "--json", "--input", str(dump), "-p", str(pid)))
        assert Counter(entry["layer"] for entry in replayed) == Counter({"runtime": kept, "driver": kept}), trigger
        events = json_lines(kvtrace("tail", "--input", str(dump), "--json"))
        allocations = [event for event in events if event["kind"] == "alloc" and event["api"] == "cudaMalloc"]
        assert len(allocations) == kept, (trigger, len(allocations), len(events))


# ---- 3. kvtrace agent --record ----

def test_agent_record_replays_to_the_snapshot_and_processes_the_agent_answered(tmp_path, bpf_here,
                                                                                stub_build):
    """GIVEN `kvtrace agent --record FILE` following a workload that allocates 23 x 1 MiB and frees 5,
    WHEN the agent stops and `kvtrace snapshot|ps --json --input FILE` read the file,
    THEN they print exactly the lines `kvtrace snapshot|ps --json --socket` printed just before the stop
    (36 objects: 18 runtime, 18 driver)."""
    socket = tmp_path / "kvtrace.sock"
    recording = tmp_path / "agent.kvtrace"
    held = LEAKS - FREES
    with python_workload(tmp_path, stub_build.libcudart) as workload:
        pid = workload.wait_ready()
        with AgentProcess(socket, "-p", str(pid), "--no-nvml", "--record", str(recording)) as agent:
            ask(workload, f"leak {LEAKS}")
            ask(workload, f"free {FREES}")
            settled_snapshot(socket, 2 * held, pid)
            live_snapshot = kvtrace("snapshot", "--json", "--socket", str(socket))
            # The agent decides the process's depth at its first analysis after its events (within a second): the
            # recording holds it, and so must the live answer compared with it.
            live_ps = poll(lambda: (ps := kvtrace("ps", "--json", "--socket", str(socket))) and all(
                row["depth"] is not None for row in json_lines(ps)) and ps, "the process's depth")
            assert agent.stop() == 0, agent.stderr_text()
    replayed_snapshot = kvtrace("snapshot", "--json", "--input", str(recording))
    replayed_ps = kvtrace("ps", "--json", "--input", str(recording))
    snapshot = json_lines(live_snapshot)
    assert Counter(entry["layer"] for entry in snapshot) == Counter({"runtime": held, "driver": held})
    # (the same lines: a listing comes in the order its ledger is read, the kernel's map live, the replay's after)
    assert sorted(replayed_snapshot.stdout.splitlines()) == sorted(live_snapshot.stdout.splitlines())
    assert [process["pid"] for process in json_lines(live_ps)] == [pid]
    assert replayed_ps.stdout == live_ps.stdout, replayed_ps.stderr


def test_agent_record_keeps_the_names_of_native_callers(tmp_path, bpf_here, stub_build):
    """GIVEN `kvtrace agent --record FILE` following the C workload, whose 13 cudaMalloc calls come from
    its own code (no Python stack: the native caller names the site),
    WHEN the workload is gone and `kvtrace leaks --input FILE` reads the file,
    THEN each suspect's native caller is the module, symbol and offset the live agent named (the
    workload's own function), not a bare address."""
    socket = tmp_path / "kvtrace.sock"
    recording = tmp_path / "agent.kvtrace"
    with Workload([stub_build.workload, "hold"]) as workload:
        pid = workload.wait_ready()
        with AgentProcess(socket, "-p", str(pid), "--no-nvml", "--record", str(recording)) as agent:
            workload.go()
            workload.read_calls()
            settled_snapshot(socket, 2 * 13, pid)
            live = json.loads(kvtrace("leaks", "--json", "--min-age", "0", "--socket", str(socket)).stdout)
            assert agent.stop() == 0, agent.stderr_text()
    replayed = kvtrace("leaks", "--json", "--min-age", "0", "--input", str(recording))
    assert replayed.returncode == 0, replayed.stderr
    live_callers = [suspect["native_caller"] for suspect in live["suspects"]]
    assert live_callers and all(caller["module"].endswith("/workload") and caller["symbol"]
                                for caller in live_callers), live_callers
    assert [suspect["native_caller"] for suspect in json.loads(replayed.stdout)["suspects"]] == live_callers
    text = kvtrace("leaks", "--min-age", "0", "--input", str(recording)).stdout
    assert f"called CUDA from {live_callers[0]['module']} {live_callers[0]['symbol']}+" in text, text


# ---- 4. kvtrace record ----

@pytest.fixture
def reachable_socket():
    """A socket path every user may walk to: the sockets' own modes decide who connects."""
    directory = Path(tempfile.mkdtemp(prefix="kvt", dir="/tmp"))
    os.chmod(directory, 0o755)
    try:
        yield directory / "run" / "kvtrace.sock"
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_kvtrace_record_on_the_admin_socket_replays_to_the_live_snapshot(reachable_socket, tmp_path, bpf_here,
                                                                          stub_build):
    """GIVEN the agent following a workload that holds 7 x 1 MiB,
    WHEN `kvtrace record -o FILE --duration 3` runs on the admin socket while the workload allocates 23
    more and frees 5, and a member of the socket's group runs the same command on the group socket,
    THEN the file replays to the snapshot the agent answers live (50 objects: 25 runtime, 25 driver),
    and the member is refused in one line saying to use the admin socket, with no file written."""
    group = grp.getgrgid(NOBODY).gr_name  # nobody's own group: nobody may use the group socket only
    socket = reachable_socket
    admin = socket.with_name("kvtrace-admin.sock")
    recording = tmp_path / "cli.kvtrace"
    held = 7 + LEAKS - FREES
    with python_workload(tmp_path, stub_build.libcudart) as workload:
        pid = workload.wait_ready()
        with AgentProcess(socket, "-p", str(pid), "--no-nvml", "--group", group) as agent:
            ask(workload, "leak 7")
            settled_snapshot(socket, 2 * 7, pid)
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
            record = subprocess.Popen([*KVTRACE, "record", "-o", str(recording), "--duration", "3",
                                       "--socket", str(admin)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            started = record.stderr.readline()  # once the agent sent the recording's header
            assert started.startswith(f"Recording to {recording}"), started + record.stderr.read()
            ask(workload, f"leak {LEAKS}")
            ask(workload, f"free {FREES}")
            live = settled_snapshot(socket, 2 * held, pid)
            _, rest = record.communicate(timeout=30)
            assert record.returncode == 0, rest
            refused = kvtrace("record", "-o", str(socket.parent.parent / "member.kvtrace"), "--duration", "3",
                              "--socket", str(socket), user=NOBODY)
            assert agent.stop() == 0, agent.stderr_text()
    replayed = kvtrace("snapshot", "--json", "-p", str(pid), "--input", str(recording))
    assert replayed.returncode == 0, replayed.stderr
    assert Counter(entry["layer"] for entry in json_lines(replayed)) == Counter({"runtime": held, "driver": held})
    assert sorted(replayed.stdout.splitlines()) == sorted(live.splitlines())  # (each in its ledger's order)
    assert refused.returncode != 0 and refused.stdout == ""
    assert refused.stderr.strip().splitlines() == [
        f"kvtrace: the agent at unix://{socket} refused: a recording holds stacks and addresses: use the admin "
        "socket (run as root, or ask for the agent's --admin-group)"], refused.stderr
    assert not (socket.parent.parent / "member.kvtrace").exists()


# ---- 5. SIGUSR1 ----

def test_sigusr1_to_the_agent_dumps_what_it_holds(tmp_path, bpf_here, stub_build):
    """GIVEN the agent following a workload that holds 23 x 1 MiB,
    WHEN the agent gets SIGUSR1,
    THEN within seconds a dump with trigger "signal" appears in --flight-dir, and it replays to the
    snapshot the agent answered live (46 objects)."""
    flight = tmp_path / "flight"
    socket = tmp_path / "kvtrace.sock"
    with python_workload(tmp_path, stub_build.libcudart) as workload:
        pid = workload.wait_ready()
        with AgentProcess(socket, "-p", str(pid), "--no-nvml", "--flight-dir", str(flight)) as agent:
            ask(workload, f"leak {LEAKS}")
            live = settled_snapshot(socket, 2 * LEAKS, pid)
            assert dumps_in(flight) == []
            os.kill(agent.process.pid, signal.SIGUSR1)
            (dump,) = poll(lambda: dumps_in(flight), "a dump after SIGUSR1", timeout_s=10)
            listing = json_lines(kvtrace("flight", "--json", "--socket", str(socket)))
            assert agent.stop() == 0, agent.stderr_text()
    assert dump.name.startswith("flight-") and dump.name.endswith("-signal.kvtrace")
    (listed,) = listing
    assert (listed["path"], listed["trigger"], listed["pid"]) == (str(dump), "signal", 0)
    assert "SIGUSR1" in listed["reason"]
    replayed = kvtrace("snapshot", "--json", "-p", str(pid), "--input", str(dump))
    assert replayed.returncode == 0, replayed.stderr
    assert replayed.stdout == live
