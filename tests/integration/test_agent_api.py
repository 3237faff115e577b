"""The real agent (BPF + gRPC) on a stub workload: tail, snapshot, ps, slow subscribers, access.

GIVEN `kvtrace agent` serving on a temporary socket and a stub workload with a known manifest,
WHEN clients connect, THEN they see exactly the workload's events and outstanding memory.
"""
import json
import os
import re
import subprocess
import threading
import time
import urllib.request

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent_process import KVTRACE, AgentProcess, kvtrace, wait_until_tracing
from cuda_stubs import Workload
from kvtrace.client import AgentClient

MiB = 1 << 20


@pytest.fixture
def agent_socket(tmp_path, bpf_here):
    return tmp_path / "kvtrace.sock"


def wait_for_subscribers(socket, count, timeout_seconds=20):
    deadline = time.monotonic() + timeout_seconds
    with AgentClient.for_socket(socket) as client:
        while time.monotonic() < deadline:
            if client.info().counters.get("subscribers", 0) >= count:
                return
            time.sleep(0.05)
    raise AssertionError(f"fewer than {count} subscribers after {timeout_seconds} s")


def test_tail_snapshot_and_ps_see_exactly_the_workload(agent_socket, stub_build):
    with Workload([stub_build.workload, "hold"]) as workload:
        pid = workload.wait_ready()
        with AgentProcess(agent_socket, "-p", str(pid)) as agent:
            tail = subprocess.Popen([*KVTRACE, "tail", "--socket", str(agent_socket), "--pid", str(pid),
                                     "--json"], stdout=subprocess.PIPE, text=True)
            try:
                wait_for_subscribers(agent_socket, 1)
                workload.go()
                calls = workload.read_calls()
                lines = []
                while len(lines) < 26:
                    lines.append(json.loads(tail.stdout.readline()))
            finally:
                tail.kill()
                tail.wait()
            mallocs = [(e["address"], e["size_bytes"]) for e in lines if e["api"] == "cudaMalloc"]
            assert mallocs == [(c["address"], c["size_bytes"]) for c in calls]
            assert sum(e["api"] == "cuMemAlloc_v2" for e in lines) == 13
            assert {e["kind"] for e in lines} == {"alloc"} and {e["pid"] for e in lines} == {pid}

            snapshot = kvtrace("snapshot", "--socket", str(agent_socket), "--json")
            assert snapshot.returncode == 0, snapshot.stderr
            entries = [json.loads(line) for line in snapshot.stdout.splitlines()]
            runtime = sorted(e["address"] for e in entries if e["layer"] == "runtime")
            assert runtime == sorted(c["address"] for c in calls)

            ps = kvtrace("ps", "--socket", str(agent_socket), "--json")
            assert ps.returncode == 0, ps.stderr
            processes = [json.loads(line) for line in ps.stdout.splitlines()]
            assert [p["pid"] for p in processes] == [pid]
            driver = [t for t in processes[0]["totals"] if t["layer"] == "driver"]
            assert sum(t["size_bytes"] for t in driver) == 13 * MiB

            # Prometheus /metrics says the same, parsed as Prometheus parses it.
            url = re.search(r"Prometheus metrics on (\S+)", agent.stderr_text()).group(1)
            text = urllib.request.urlopen(url, timeout=10).read().decode()
            samples = [sample for family in text_string_to_metric_families(text)
                       for sample in family.samples if sample.name == "kvtrace_outstanding_bytes"]
            driver_bytes = sum(s.value for s in samples
                               if s.labels["pid"] == str(pid) and s.labels["layer"] == "driver")
            assert driver_bytes == 13 * MiB


def test_slow_subscriber_loses_only_its_own_events(agent_socket, stub_build):
    pairs = 40_000  # 160 000 events: more than a subscriber queue holds (65 536)
    # In bursts of 20 000 events a reader keeps up with; the one that does not read loses.
    paced = dict(os.environ, KVT_LOOP_PAUSE_EVERY="5000", KVT_LOOP_PAUSE_MS="500")
    with Workload([stub_build.workload, "loop", str(pairs)], env=paced) as workload:
        pid = workload.wait_ready()
        # The agent's RSS measures the subscribers' queues: without the flight recorder, whose ring
        # (bounded, ~30 MiB at most: bench/RESULTS.md §H, §J) would hold these 160 000 events too.
        with AgentProcess(agent_socket, "-p", str(pid), "--no-flight-recorder") as agent:
            fast_events, fast_lost = [], [0]
            slow_started, release_slow = threading.Event(), threading.Event()
            slow_count, slow_lost = [0], [0]

            def fast():
                with AgentClient.for_socket(agent_socket) as client:
                    for batch in client.stream_batches(pids=[pid]):
                        for message in batch:
                            if message.HasField("events_lost"):
                                fast_lost[0] += message.events_lost.dropped_count
                            elif message.HasField("allocation"):
                                fast_events.append(message.allocation.api)
                        if len(fast_events) + fast_lost[0] >= 4 * pairs:
                            return

            def slow():
                with AgentClient.for_socket(agent_socket) as client:
                    batches = client.stream_batches(pids=[pid])
                    slow_started.set()
                    release_slow.wait()  # does not read: gRPC flow control backs up to its queue
                    for batch in batches:
                        for message in batch:
                            if message.HasField("events_lost"):
                                slow_lost[0] += message.events_lost.dropped_count
                            elif message.HasField("allocation"):
                                slow_count[0] += 1
                        if slow_count[0] + slow_lost[0] >= 4 * pairs:
                            return

            threads = [threading.Thread(target=fast), threading.Thread(target=slow)]
            for thread in threads:
                thread.start()
            slow_started.wait(10)
            wait_for_subscribers(agent_socket, 2)
            rss_before = psutil.Process(agent.process.pid).memory_info().rss
            workload.go()
            workload.read_calls(timeout_s=120)
            threads[0].join(120)
            rss_after = psutil.Process(agent.process.pid).memory_info().rss
            release_slow.set()
            threads[1].join(120)
            print(f"\nfast: {len(fast_events)} events, {fast_lost[0]} lost; slow: {slow_count[0]} "
                  f"events, {slow_lost[0]} lost; agent RSS {rss_before >> 20} -> {rss_after >> 20} MiB")
            kernel_lost = AgentClient.for_socket(agent_socket).info().counters["events_lost"]
            assert kernel_lost == 0
            assert len(fast_events) == 4 * pairs and fast_lost[0] == 0
            assert slow_lost[0] > 0 and slow_count[0] + slow_lost[0] == 4 * pairs
            assert rss_after - rss_before < 64 * MiB


def test_user_outside_the_group_is_refused(agent_socket, stub_build, tmp_path):
    os.chmod(tmp_path, 0o755)  # let the user reach the socket: the socket's own mode must refuse
    with AgentProcess(agent_socket):
        result = kvtrace("ps", "--socket", str(agent_socket), user=65534)
    assert result.returncode == 6, result
    assert "permission denied" in result.stderr.lower()
    assert "Traceback" not in result.stderr


def test_agent_json_events_carry_the_documented_keys(stub_build, bpf_here):
    with Workload([stub_build.workload, "hold"]) as workload:
        pid = workload.wait_ready()
        agent = subprocess.Popen([*KVTRACE, "agent", "--no-api", "--json-events", "-p", str(pid),
                                  "--metrics-listen", "off", "--vllm-socket", "off", "--cupti-socket", "off"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            wait_until_tracing(agent)
            workload.go()
            calls = workload.read_calls()
            events = [json.loads(agent.stdout.readline()) for _ in range(26)]
        finally:
            agent.terminate()
            assert agent.wait(90) == 0
    keys = {"kind", "pid", "tid", "comm", "title", "api", "layer", "size_bytes", "address", "device",
            "error_code", "timestamp_ns"}
    assert all(keys <= set(event) for event in events)
    assert [e["address"] for e in events if e["api"] == "cudaMalloc"] == [c["address"] for c in calls]
    # who called each: the workload called cudaMalloc, the stub runtime called cuMemAlloc_v2
    callers = {(e["api"], e["native_caller"]["module"].rsplit("/", 1)[-1]) for e in events}
    assert callers == {("cudaMalloc", "workload"), ("cuMemAlloc_v2", "libcudart.so.12")}, callers


def test_agent_without_root_exits_with_one_line(tmp_path):
    result = kvtrace("agent", "--no-api", user=65534)
    assert result.returncode == 3, result
    assert result.stderr.count("\n") == 1 and "run as root" in result.stderr


def test_column_streams_and_a_message_stream_get_the_same_events(agent_socket, stub_build):
    """EVENT_ENCODING_COLUMNS and EVENT_ENCODING_FIXED_COLUMNS carry exactly what Event messages carry,
    from the real ring reader; the fixed stream gets the bulk copied from the ring's records."""
    from kvtrace.wire import event_from_proto, events_from_columns, events_from_fixed_columns

    pairs = 5_000
    paced = dict(os.environ, KVT_LOOP_PAUSE_EVERY="1000", KVT_LOOP_PAUSE_MS="20")
    with Workload([stub_build.workload, "loop", str(pairs)], env=paced) as workload:
        pid = workload.wait_ready()
        with AgentProcess(agent_socket, "-p", str(pid), "--no-python-stacks"):
            got: dict[str, list] = {"columns": [], "messages": [], "fixed": []}
            lost: dict[str, int] = {"columns": 0, "messages": 0, "fixed": 0}
            copied = [0]  # events the fixed stream got in fixed_columns

            def read(encoding):
                with AgentClient.for_socket(agent_socket, timeout_seconds=120) as client:
                    for response in client.stream_responses(pids=[pid], columns=encoding != "messages",
                                                            fixed=encoding == "fixed"):
                        assert not (response.HasField("columns") and response.HasField("fixed_columns"))
                        fixed = events_from_fixed_columns(response.fixed_columns)
                        copied[0] += len(fixed)
                        for message in response.events:
                            if message.HasField("events_lost"):
                                lost[encoding] += (message.events_lost.dropped_count
                                                   + message.events_lost.kernel_lost_count)
                            else:
                                got[encoding].append(event_from_proto(message))
                        got[encoding].extend(events_from_columns(response.columns))
                        got[encoding].extend(fixed)
                        if len(got[encoding]) + lost[encoding] >= 4 * pairs:
                            return

            readers = [threading.Thread(target=read, args=(encoding,)) for encoding in got]
            for reader in readers:
                reader.start()
            wait_for_subscribers(agent_socket, 3)
            workload.go()
            workload.read_calls(timeout_s=120)
            for reader in readers:
                reader.join(120)
    assert lost == {"columns": 0, "messages": 0, "fixed": 0}
    assert len(got["columns"]) == 4 * pairs
    assert {event.pid for event in got["columns"]} == {pid}
    assert got["columns"] == got["messages"] == got["fixed"]
    print(f"fixed stream: {copied[0]} of {4 * pairs} events copied from the ring's records")
    assert copied[0] >= 0.9 * 4 * pairs  # the bulk: a poll with another kind (a set-device call) is not copied
