"""`kvtrace run --agent` against the real agent: the in-process tracer (on the fake cupti-python of
tests/fake_cupti) reports to the agent's --cupti-socket, and the agent matches its events one for one
with its own uprobes' on the stub libcuda.

GIVEN the agent (uprobes on every process) and a Python program run under `kvtrace run --agent --eager`
that calls the stub libcuda's cuMemAlloc_v2/cuMemFree_v2 (the uprobes see them) and tells the fake CUPTI
of the same calls at the same addresses (the tracer sees them): 23 allocations, 11 frees, plus one call
only the driver made and one only CUPTI reported,
THEN GetCrossCheck has exactly 23 + 11 matched, one seen by the uprobes only and one by CUPTI only
(with its address), the agent's ledger holds the uprobes' allocations once, `kvtrace doctor --pid` says
so, and after the exit the check is finished with the tracer gone.
"""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

from agent_process import KVTRACE, AgentProcess
from kvtrace.client import AgentClient

ROOT = Path(__file__).resolve().parents[2]
FAKE_CUPTI_DIR = ROOT / "tests" / "fake_cupti"
MiB = 1 << 20

# Both witnesses of each call: the stub library does it (uprobes), then the fake CUPTI reports it at the
# address the library returned.
PROGRAM = r"""
import ctypes, json, os, sys
from cupti import cupti as fake

lib = ctypes.CDLL(sys.argv[1])
print(json.dumps({"ready": os.getpid()}), flush=True)
sys.stdin.readline()

def driver_alloc(size):
    address = ctypes.c_uint64(0)
    assert lib.cuMemAlloc_v2(ctypes.byref(address), ctypes.c_size_t(size)) == 0
    return address.value

def both_alloc(size):
    address = driver_alloc(size)
    fake._STATE.next_device_address = address  # CUPTI reports the driver's own address
    assert fake.fake_mem_alloc(size) == address
    return address

def both_free(address):
    assert lib.cuMemFree_v2(ctypes.c_uint64(address)) == 0
    fake.fake_free(address)

kept = [both_alloc((n + 1) * (1 << 20)) for n in range(23)]
for address in kept[:11]:
    both_free(address)
only_driver = driver_alloc(5 << 20)             # CUPTI never hears of this one
fake._STATE.next_device_address = 0x6a00_0000_0000
only_cupti = fake.fake_mem_alloc(7 << 20)       # nor the driver of this one
print(json.dumps({"kept": kept[11:], "only_driver": only_driver, "only_cupti": only_cupti}), flush=True)
sys.stdin.readline()
"""


def _line(process: subprocess.Popen, timeout_seconds: float = 60) -> dict:
    ready, _, _ = select.select([process.stdout], [], [], timeout_seconds)
    text = process.stdout.readline() if ready else ""
    assert text, process.stderr.read() if process.poll() is not None else "no line from the program"
    return json.loads(text)


def _check(socket: Path, pid: int):
    with AgentClient.for_socket(socket) as client:
        found = client.cross_checks([pid]).processes
    return found[0] if found else None


def _wait(predicate, timeout_seconds: float):
    deadline = time.monotonic() + timeout_seconds
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


def test_the_agent_matches_cupti_with_its_uprobes_call_for_call(tmp_path, stub_build):
    socket, cupti_socket = tmp_path / "kvtrace.sock", tmp_path / "cupti.sock"
    program = tmp_path / "both_witnesses.py"
    program.write_text(PROGRAM)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(FAKE_CUPTI_DIR), *sys.path]))
    with AgentProcess(socket, "--cupti-socket", str(cupti_socket), "--no-nvml") as agent:
        run = subprocess.Popen([*KVTRACE, "run", "--agent", str(cupti_socket), "--eager", "--", sys.executable,
                                str(program), str(stub_build.libcuda)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=env)
        try:
            pid = _line(run)["ready"]
            attached = _wait(lambda: any(pid in library.pids for library in AgentClient.for_socket(socket).info()
                                         .attached_libraries), 30)
            assert attached, agent.stderr_text()
            assert _wait(lambda: (_check(socket, pid) or None) and _check(socket, pid).state == "tracing", 10)
            time.sleep(0.2)  # past the cross-check's start margin
            run.stdin.write("\n")
            run.stdin.flush()
            made = _line(run)
            # One flush (1 s) brings CUPTI's records; the two lone calls settle after the 10 s grace.
            live = _wait(lambda: (lambda c: c if c is not None and c.pending_count == 0 and c.apis else None)(
                _check(socket, pid)), 25)
            with AgentClient.for_socket(socket) as client:
                ledger = [item for item in client.snapshot(pids=[pid]) if item.layer == 2]  # driver layer
            doctor = subprocess.run([*KVTRACE, "doctor", "--pid", str(pid), "--json", "--socket", str(socket)],
                                    capture_output=True, text=True, timeout=60)
            run.stdin.write("\n")
            run.stdin.flush()
            assert run.wait(timeout=60) == 0, run.stderr.read()
            final = _wait(lambda: (lambda c: c if c is not None and c.finished else None)(_check(socket, pid)), 20)
        finally:
            if run.poll() is None:
                run.kill()
    assert live is not None, _check(socket, pid)
    rows = {row.api_name: (row.matched_count, row.uprobe_only_count, row.cupti_only_count, row.mismatched_count)
            for row in live.apis}
    assert rows == {"cuMemAlloc_v2": (23, 1, 1, 0), "cuMemFree_v2": (11, 0, 0, 0)}
    lone = {(example.seen_by, example.address, example.size_bytes) for example in live.disagreements}
    assert lone == {(1, made["only_driver"], 5 * MiB), (2, made["only_cupti"], 7 * MiB)}
    # The ledger is the uprobes': each kept allocation once, the CUPTI-only one not at all.
    assert sorted(item.address for item in ledger) == sorted([*made["kept"], made["only_driver"]])
    findings = {finding["name"]: finding for finding in json.loads(doctor.stdout)}
    check = findings[f"pid {pid} cupti cross-check"]
    assert check["warning"] and "cuMemAlloc_v2: 1 by the uprobes only, 1 by CUPTI only" in check["message"]
    assert final is not None and final.state == "gone" and final.compared
