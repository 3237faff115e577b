"""CUPTI inside the target (`kvtrace run`) on the H200: the same events without root, and a second
witness that proves the uprobes exact on real hardware.

GIVEN the real agent (uprobes on every process) and `kvtrace run --agent` around a torch workload that
plants a leak (tests/gpu/workloads/cupti_torch.py), in each allocator mode (caching, expandable
segments, no caching),
THEN the agent matches every CUPTI record against the uprobe event of the same call (api, address,
size, device): none seen by one witness only or differently, and the ledger's physical bytes for the
process equal torch's own figure (memory_reserved; in no-caching mode each kept tensor is a live
allocation of its size).
GIVEN an unprivileged user, `kvtrace run --output FILE` writes a recording whose `kvtrace leaks`
names plant_leak() with exactly the tensors it kept.
GIVEN a torch process keeping 8 MiB clones among 32 MiB temporaries (the clones carved out of the cache the
temporaries grew), `kvtrace run --output FILE` (PyTorch's block recorder on, read at the exit) makes
`kvtrace leaks --input` rank keep_activation() first with exactly the clones kept; with --blocks never it
can only name scratch_temporary(), the function that grew the cache.
GIVEN torch.profiler holding CUPTI before CUDA starts, kvtrace run says who holds it, stays out of the
way (the profiler records its kernels), and the uprobes still trace the process.

Figures are printed (run with -s).
"""
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from agent_process import KVTRACE, AgentProcess
from conftest import check_all, source_line, wait_for
from kvtrace.client import AgentClient

WORKLOAD = Path(__file__).parent / "workloads" / "cupti_torch.py"
MODES = ("caching", "expandable", "nocache")
NOBODY = 65534
MiB = 1 << 20
PHYSICAL = ("LAYER_DRIVER", "LAYER_VMM")


class Run:
    """`kvtrace run ... -- python cupti_torch.py ARGS`, spoken to through its stdin and stdout."""

    def __init__(self, run_args: list[str], workload_args: list[str], user: int | None = None,
                 env: dict[str, str] | None = None, workload: Path = WORKLOAD) -> None:
        prefix = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups"] if user is not None else []
        self.process = subprocess.Popen(
            [*prefix, *KVTRACE, "run", *run_args, "--", sys.executable, str(workload), *workload_args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=env or dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))

    def line(self, timeout_seconds: float = 120) -> dict:
        ready, _, _ = select.select([self.process.stdout], [], [], timeout_seconds)
        text = self.process.stdout.readline() if ready else ""
        if not text:
            self.process.kill()
            raise AssertionError(f"the workload said nothing: {self.process.stderr.read()}")
        return json.loads(text)

    def go(self) -> None:
        self.process.stdin.write("\n")
        self.process.stdin.flush()

    def finish(self) -> tuple[int, str]:
        self.process.stdin.close()
        status = self.process.wait(timeout=120)
        return status, self.process.stderr.read()


def _attached(socket: Path, pid: int) -> bool:
    with AgentClient.for_socket(socket) as client:
        return any(pid in library.pids for library in client.info().attached_libraries)


def _cross_check(socket: Path, pid: int):
    with AgentClient.for_socket(socket) as client:
        found = client.cross_checks([pid]).processes
    return found[0] if found else None


def _rows(check) -> dict[str, tuple[int, int, int, int]]:
    return {row.api_name: (row.matched_count, row.uprobe_only_count, row.cupti_only_count, row.mismatched_count)
            for row in check.apis}


@pytest.mark.parametrize("mode", MODES)
def test_cupti_and_the_uprobes_see_every_call_alike_and_both_match_torch(mode, tmp_path):
    socket, cupti_socket = tmp_path / "kvtrace.sock", tmp_path / "cupti.sock"
    failures: list[str] = []
    with AgentProcess(socket, "--cupti-socket", str(cupti_socket)) as agent:
        run = Run(["--agent", str(cupti_socket)], [mode])
        pid = run.line()["ready"]
        assert wait_for(lambda: _attached(socket, pid), 60), agent.stderr_text()
        tracing = wait_for(lambda: (_cross_check(socket, pid) or None) and _cross_check(socket, pid).state == "tracing",
                           30)
        assert tracing, f"no tracing status from pid {pid}: {_cross_check(socket, pid)}\n{agent.stderr_text()}"
        run.go()
        truth = run.line()
        settled = wait_for(lambda: (lambda c: c if c and c.pending_count == 0 and sum(_rows(c).get(
            "cuMemAlloc_v2", (0,))[:1]) + sum(_rows(c).get("cuMemCreate", (0,))[:1]) else None)(
            _cross_check(socket, pid)), 30)
        with AgentClient.for_socket(socket) as client:
            held = [item for item in client.snapshot(pids=[pid])]
        run.go()
        status, run_log = run.finish()
        final = wait_for(lambda: (lambda c: c if c and c.finished else None)(_cross_check(socket, pid)), 40)
        final = final or _cross_check(socket, pid)
    physical = [item for item in held if item.memory == 1 and item.object in (1, 2)
                and item.layer in (2, 3)]  # DEVICE memory, allocations and VMM handles, driver/VMM layers
    physical_bytes = sum(item.size_bytes for item in physical)
    rows = _rows(final)
    matched = sum(row[0] for row in rows.values())
    disagreements = sum(sum(row[1:]) for row in rows.values())
    print(f"\n{mode}: pid {pid}, torch reserved {truth['reserved_bytes']} B, allocated {truth['allocated_bytes']} B, "
          f"device allocs/frees {truth['device_allocs']}/{truth['device_frees']}; uprobe ledger "
          f"{physical_bytes} B in {len(physical)} objects; CUPTI state {final.state}, counters "
          f"{dict(final.counters)}")
    for name, (ok, only_uprobe, only_cupti, differ) in sorted(rows.items()):
        print(f"  {name:<22} matched {ok:>6}  uprobes only {only_uprobe}  CUPTI only {only_cupti}  "
              f"differently {differ}")
    for example in final.disagreements:
        print(f"  disagreement: {example}")
    if status != 0:
        failures.append(f"kvtrace run exited {status}: {run_log[-2000:]}")
    if not settled:
        failures.append("the witnesses did not settle while the workload held its memory")
    if not final.compared or final.state != "gone" or not final.finished:
        failures.append(f"cross-check not finished: state {final.state}, compared {final.compared}")
    if disagreements:
        failures.append(f"{disagreements} calls not seen alike: {rows}")
    # The caching allocators keep what they got until empty_cache: only no-caching frees while it runs.
    expected = {"caching": {"cuMemAlloc_v2"}, "nocache": {"cuMemAlloc_v2", "cuMemFree_v2"},
                "expandable": {"cuMemAddressReserve", "cuMemCreate", "cuMemMap"}}[mode]
    missing = {name for name in expected if rows.get(name, (0,))[0] == 0}
    if missing:
        failures.append(f"no matched calls of {sorted(missing)}: {rows}")
    if mode == "nocache":
        live = {item.address: item.size_bytes for item in physical}
        wrong = [(hex(ptr), size) for ptr, size in truth["kept"] if live.get(ptr, 0) < size]
        if wrong or len(truth["kept"]) != 12:
            failures.append(f"kept tensors not live in the ledger at their size: {wrong}")
        if matched < (23 + 200 + 2) + (11 + 200 + 2):
            failures.append(f"{matched} calls matched: fewer than the workload's 225 allocations and 213 frees")
    elif physical_bytes != truth["reserved_bytes"]:
        failures.append(f"ledger {physical_bytes} B != torch.cuda.memory_reserved() {truth['reserved_bytes']} B")
    check_all(failures)


def test_without_root_a_recording_names_the_planted_leak(tmp_path):
    """kvtrace run as an unprivileged user (no BPF, no agent): the file replays into `kvtrace leaks`."""
    shared = Path(tempfile.mkdtemp(prefix="kvtrace-nobody-"))
    os.chmod(shared, 0o777)
    code = shared / "code"  # the checkout may sit where nobody cannot read (/root)
    shutil.copytree(Path(__file__).resolve().parents[2] / "agent", code / "agent")
    shutil.copytree(WORKLOAD.parent, code / "workloads")
    subprocess.run(["chmod", "-R", "a+rX", str(code)], check=True)
    site = [path for path in sys.path if path.startswith("/tmp/kvtrace-site")]  # run.sh's wheels (cupti-python)
    for path in site:
        subprocess.run(["chmod", "-R", "a+rX", path], check=False)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(code / "agent"), *site]), HOME=str(shared))
    recording = shared / "run.kvtrace"
    workload = code / "workloads" / WORKLOAD.name
    run = Run(["--output", str(recording)], ["nocache"], user=NOBODY, env=env,
              workload=workload)
    pid = run.line()["ready"]
    run.go()
    truth = run.line()
    time.sleep(2)  # the tracer flushes each second
    run.go()
    status, run_log = run.finish()
    print(f"\nunprivileged kvtrace run (uid {NOBODY}): exit {status}; {run_log.strip()[-600:]}")
    assert status == 0, run_log
    assert recording.exists(), run_log
    # The recording ends with its last record (the tracer's last flush, before Python frees the tensors
    # at shutdown): the tensors kept are what it holds there, however young.
    at = "end"
    leaks = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *KVTRACE,
                            "leaks", "--input", str(recording), "--at", at, "--min-age", "0", "--json"],
                           capture_output=True, text=True, timeout=120, env=env)
    assert leaks.returncode == 0, leaks.stderr
    report = json.loads(leaks.stdout)
    if not report["suspects"]:
        held = subprocess.run([*KVTRACE, "snapshot", "--input", str(recording), "--json"], capture_output=True,
                              text=True, timeout=120, env=env)
        raise AssertionError(f"no suspects at {at} (kept at {truth['time_ns']}): {report}\nrun: {run_log}\n"
                             f"snapshot at the end: {held.stdout[:3000]} {held.stderr[-1000:]}")
    first = report["suspects"][0]
    frames = first["stack"] or []
    line = source_line("LEAK_LINE", WORKLOAD)
    kept_bytes = sum(size for _, size in truth["kept"])
    print(f"leaks --input at {at}: first suspect {frames[:1]} {first['outstanding_bytes']} B in "
          f"{first['allocation_count']} allocations, pid {first['pid']}; {len(report['suspects'])} suspects")
    check_all([f"first suspect is not plant_leak at line {line}: {frames[:3]}"]
              * (not any(frame["function"] == "plant_leak" and frame["line"] == line for frame in frames))
              + [f"first suspect holds {first['outstanding_bytes']} B, not the {kept_bytes} B kept"]
              * (first["outstanding_bytes"] != kept_bytes)
              + [f"{first['allocation_count']} allocations, not 12"] * (first["allocation_count"] != 12)
              + [f"pid {first['pid']}, not {pid}"] * (first["pid"] != pid))


@pytest.mark.parametrize("when", ["--profiler-first", "--profiler-later"])
def test_a_profiler_holding_cupti_is_reported_and_left_alone(when, tmp_path):
    """first: torch.profiler holds CUPTI before CUDA starts; later: it starts while kvtrace traces, and
    kvtrace gives CUPTI up. Either way the profiler records its kernels and kvtrace says who holds CUPTI."""
    socket, cupti_socket = tmp_path / "kvtrace.sock", tmp_path / "cupti.sock"
    with AgentProcess(socket, "--cupti-socket", str(cupti_socket)) as agent:
        run = Run(["--agent", str(cupti_socket)], ["caching", when])
        pid = run.line()["ready"]
        assert wait_for(lambda: _attached(socket, pid), 60), agent.stderr_text()
        run.go()
        truth = run.line()
        check = wait_for(lambda: (lambda c: c if c is not None and c.state == "held" else None)(
            _cross_check(socket, pid)), 20) or _cross_check(socket, pid)
        def uprobe_objects_now() -> int:
            with AgentClient.for_socket(socket) as client:
                return len(list(client.snapshot(pids=[pid])))

        uprobe_objects = wait_for(uprobe_objects_now, 15)
        run.go()
        status, run_log = run.finish()
        final = wait_for(lambda: (lambda c: c if c and c.finished else None)(_cross_check(socket, pid)), 40)
    rows = _rows(final) if final else {}
    disagreements = sum(sum(row[1:]) for row in rows.values())
    print(f"\nprofiler {when[len('--profiler-'):]}: kvtrace run state {check.state if check else None}, holder "
          f"{check.holder if check else None!r}, reason {check.reason if check else None!r}; the profiler "
          f"recorded {truth['profiler_cuda_events']} CUDA events; the uprobes hold {uprobe_objects} objects "
          f"of the process; cross-check before it {rows}; exit {status}")
    check_all([f"exit {status}: {run_log[-1500:]}"] * (status != 0)
              + [f"no held status: {check}"] * (check is None or check.state != "held")
              + [f"holder not named: {check}"] * (check is not None and "profiler" not in check.holder.lower())
              + ["the profiler recorded no CUDA events"] * (truth["profiler_cuda_events"] == 0)
              + ["the uprobes stopped tracing the process"] * (uprobe_objects == 0)
              + [f"{disagreements} disagreements: {rows}"] * disagreements)


CLONE_LEAK = """
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
import torch_worker
torch.cuda.init()
print(json.dumps(torch_worker.clone_leak(150, 0.0, 8 << 20, 32 << 20)), flush=True)
"""


def test_a_recording_names_the_holder_of_blocks_not_the_code_that_grew_the_cache(tmp_path):
    workloads = Path(__file__).parent / "workloads"
    keep_line = source_line("# KEEP_CLONE_LINE", workloads / "torch_worker.py")
    failures: list[str] = []
    for blocks in ("always", "never"):
        recording = tmp_path / f"{blocks}.kvtrace"
        started = time.monotonic()
        run = subprocess.run([*KVTRACE, "run", "--blocks", blocks, "-o", str(recording), "--", sys.executable, "-c",
                              CLONE_LEAK, str(workloads)], capture_output=True, text=True, timeout=300,
                             env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
        seconds = time.monotonic() - started
        assert run.returncode == 0, run.stderr[-3000:]
        truth = json.loads(run.stdout.splitlines()[-1])
        leaks = subprocess.run([*KVTRACE, "leaks", "--input", str(recording), "--min-age", "0", "--json"],
                               capture_output=True, text=True, timeout=300)
        assert leaks.returncode == 0, leaks.stderr
        first = (json.loads(leaks.stdout)["suspects"] or [{"stack": [], "outstanding_bytes": 0,
                                                          "allocation_count": 0}])[0]
        top = (first["stack"] or [{}])[0]
        print(f"\nkvtrace run --blocks {blocks} ({seconds:.1f} s): kept {truth['kept']} clones, "
              f"{truth['kept_bytes'] >> 20} MiB; first suspect {top.get('function')}:{top.get('line')} "
              f"{first['outstanding_bytes'] >> 20} MiB in {first['allocation_count']} allocations; "
              f"{run.stderr.strip().splitlines()[-1:]}")
        if blocks == "always":
            if (top.get("function"), top.get("line")) != ("keep_activation", keep_line):
                failures.append(f"--blocks always: first suspect {top}, not keep_activation:{keep_line}")
            if (first["allocation_count"], first["outstanding_bytes"]) != (truth["kept"], truth["kept_bytes"]):
                failures.append(f"--blocks always: {first['allocation_count']} blocks, {first['outstanding_bytes']} "
                                f"bytes; kept {truth['kept']}, {truth['kept_bytes']}")
        elif top.get("function") != "scratch_temporary":
            failures.append(f"--blocks never: first suspect {top}, expected the cache's grower scratch_temporary")
    check_all(failures)
