"""Scale (issue 16) on the real agent and the stub libraries: the kernel keeps the allocations and
their totals, the agent keeps neither, reading them from the kernel when a report asks; `-p` of many processes shares
one set of probes per library, filtered in the kernel.

GIVEN 11 stub workloads that each hold 13 cudaMalloc'd MiB and an agent following 10 of them (more than
--per-process-probes-max), WHEN they allocate, THEN the agent attached once per library, for every
process, traces exactly the 10, holds no entry of its own, and every report reads the kernel's.
"""
import json
import time

from agent_process import AgentProcess, kvtrace
from cuda_stubs import Workload
from kvtrace.client import AgentClient
from kvtrace.model.events import Layer

MiB = 1 << 20
FOLLOWED = 10
HELD_PER_PROCESS = 13  # the `hold` workload's cudaMalloc calls, 1 MiB each (tests/integration/stubs)


def test_many_followed_processes_share_probes_and_the_kernel_keeps_the_ledger(tmp_path, stub_build, bpf_here):
    socket = tmp_path / "kvtrace.sock"
    workloads = [Workload([stub_build.workload, "hold"]) for _ in range(FOLLOWED + 1)]
    try:
        pids = [workload.wait_ready() for workload in workloads]
        followed, other = pids[:FOLLOWED], pids[FOLLOWED]
        args = [arg for pid in followed for arg in ("-p", str(pid))]
        with AgentProcess(socket, *args, "--ledger-in-kernel", "--max-read-entries", "100") as agent:
            calls = {}
            for workload in workloads:
                workload.go()
                calls[workload.pid] = workload.read_calls()
            with AgentClient.for_socket(socket) as client:
                settled = None
                deadline = time.monotonic() + 20
                while settled is None and time.monotonic() < deadline:
                    rows = {process.pid: process for process in client.processes()}
                    if len(rows) == FOLLOWED and all(
                            sum(total.size_bytes for total in row.totals if total.layer == Layer.DRIVER) == 13 * MiB
                            for row in rows.values()):
                        settled = rows
                    time.sleep(0.1)
                assert settled is not None, "the followed processes' totals did not settle"
                assert sorted(settled) == sorted(followed) and other not in settled
                counters = dict(client.info().counters)
            # One set of probes per library (the stubs, and any CUDA library found on this host), not one per
            # library and process: 10 processes would make it 10 times as many.
            assert counters["probe_sets_attached"] == counters["libraries_attached"] >= 2, counters
            # Each followed process: 13 runtime and 13 driver entries, in the kernel, none in the agent.
            assert counters["ledger_entries_in_kernel"] == FOLLOWED * HELD_PER_PROCESS * 2, counters

            snapshot = kvtrace("snapshot", "--socket", str(socket), "--json")
            assert snapshot.returncode == 0, snapshot.stderr
            entries = [json.loads(line) for line in snapshot.stdout.splitlines()]
            assert len(entries) == FOLLOWED * HELD_PER_PROCESS * 2  # more than --max-read-entries: streamed
            for pid in followed:
                runtime = sorted(e["address"] for e in entries if e["pid"] == pid and e["layer"] == "runtime")
                assert runtime == sorted(call["address"] for call in calls[pid])
            leaks = kvtrace("leaks", "--socket", str(socket), "--min-age", "0", "--json")
            assert leaks.returncode == 0, leaks.stderr
            suspects = json.loads(leaks.stdout)["suspects"]
            assert sorted(s["pid"] for s in suspects) == sorted(followed)
            assert all(s["outstanding_bytes"] == 13 * MiB and s["allocation_count"] == 13 for s in suspects), suspects

            # A recording starts with a copy of them all: over --max-read-entries it is refused, saying so.
            record = kvtrace("record", "--socket", str(socket), "-o", str(tmp_path / "r.kvtrace"),
                             "--duration", "1")
            assert record.returncode != 0
            assert "--max-read-entries" in record.stderr, record.stderr
            assert agent.stop() == 0, agent.stderr_text()
    finally:
        for workload in workloads:
            workload.__exit__(None, None, None)
