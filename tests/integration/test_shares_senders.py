"""Issue 31, attacks 4 and 5, on the real agent: an unprivileged user (nobody, made by setpriv) floods the vLLM
plugin's socket with 300 processes and poses as an engine; and fills the group socket with idle streams.

GIVEN `kvtrace agent` and a root process titled `VLLM::EngineCore` that allocates 2 x 64 MiB of KV tensors
through the stub libcudart and sends the plugin's layout once and a scheduler report a second (an aborted
request holding 6 blocks for 100 s),
WHEN nobody's 300 processes send reports as fast as they may and one more of nobody's (no CUDA, no GPU memory)
claims 1 TiB of KV tensors and the same aborted request,
THEN the engine keeps its layout (128 MiB) and its finding; the impostor is no engine, raises no finding, and
is named (untrusted) by doctor and by `kvtrace vllm` with why; nobody's refusals are counted in /metrics and
named by doctor.

GIVEN the agent with nobody in its group, WHEN nobody opens 64 idle event streams on the group socket,
THEN root's `tail` on the admin socket gets its events at once, nobody keeps at most its share of connections
(the rest shut down, counted and named).

GIVEN the agent's CUPTI socket (`kvtrace run`), WHEN nobody holds 80 connections, THEN nobody keeps its share of
64, the rest are refused, counted and named, and root still connects.

(Streams that do not read on a quiet host, found by their probe: tests/unit/test_stream_slots.py, real gRPC.)
"""
import grp
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from agent_process import AgentProcess, kvtrace
from stand_in_engine import ENGINE_PRELUDE

MiB = 1 << 20
NOBODY = 65534
FLOOD_PROCESSES = 300
FLOOD_SECONDS = 8.0

ENGINE = ENGINE_PRELUDE + textwrap.dedent("""
    print("ready", flush=True)
    sys.stdin.readline()
    tensors = [malloc(64 << 20), malloc(64 << 20)]
    plugin = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    layout = {"v": 1, "type": "kv_cache", "device": 0, "num_blocks": 1001, "page_size_bytes": 65536,
              "block_size": 16, "tensors": [[address, 64 << 20] for address in tensors]}
    report = {"v": 1, "type": "scheduler", "blocks_total": 1000, "blocks_free": 990, "running": 0, "waiting": 0,
              "allocated_total": 30, "freed_total": 20, "requests": [["leak-0-1a2b3c4d", "aborted", 6, 100.0]]}
    plugin.sendto(json.dumps(layout).encode(), sys.argv[2])  # once, as the plugin does
    print("sent", flush=True)
    while sys.stdin.readline().strip() != "exit":
        plugin.sendto(json.dumps(report).encode(), sys.argv[2])
        print("sent", flush=True)
""")

# nobody's: an impostor (no CUDA) reporting 1 TiB of KV tensors and a leak, and 300 processes flooding.
ATTACKER = textwrap.dedent("""
    import json, os, socket, sys, time

    path, processes, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    report = json.dumps({"v": 1, "type": "scheduler", "blocks_total": 1000, "blocks_free": 900, "running": 0,
                         "waiting": 0, "allocated_total": 30, "freed_total": 20,
                         "requests": [["fake-1", "aborted", 100, 100.0]]}).encode()
    layout = json.dumps({"v": 1, "type": "kv_cache", "device": 0, "num_blocks": 1001, "page_size_bytes": 65536,
                         "block_size": 16, "tensors": [[1 << 44, 1 << 40]]}).encode()
    children = []
    for index in range(processes + 1):
        pid = os.fork()
        if pid:
            children.append(pid)
            continue
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setblocking(False)
        impostor = index == 0  # first, alone: it has a place before the flood comes
        time.sleep(0 if impostor else 1.0)
        end = time.monotonic() + seconds + (3 if impostor else 0)  # the impostor outlives the flood
        sent = 0
        while time.monotonic() < end:
            for message in ((layout, report) if impostor else (report,)):
                try:
                    sock.sendto(message, path)
                    sent += 1
                except OSError:
                    pass
            time.sleep(1.0 if impostor else 0.002)
        os._exit(0)
    print(" ".join(map(str, children)), flush=True)  # the impostor first
    for pid in children:
        os.waitpid(pid, 0)
""")


@pytest.fixture
def reachable():
    """A directory every user may walk to: the sockets' own modes decide who connects."""
    directory = Path(tempfile.mkdtemp(prefix="kvq", dir="/tmp"))
    os.chmod(directory, 0o755)
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def as_nobody(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *args],
                            text=True, **kwargs)


def metrics_of(agent: AgentProcess) -> str:
    url = next(line.split()[-1] for line in agent.stderr_text().splitlines()
               if line.startswith("Prometheus metrics on "))
    return urllib.request.urlopen(url, timeout=5).read().decode()


def sample(metrics: str, prefix: str) -> list[str]:
    return [line for line in metrics.splitlines() if line.startswith(prefix)]


def test_a_flood_and_an_impostor_on_the_plugin_socket_leave_the_engine_its_layout_and_findings(
        reachable, bpf_here, stub_build):
    script = reachable / "engine.py"
    script.write_text(ENGINE)
    attacker_script = reachable / "attacker.py"
    attacker_script.write_text(ATTACKER)
    os.chmod(attacker_script, 0o644)
    plugin = reachable / "vllm.sock"
    engine = subprocess.Popen([sys.executable, str(script), str(stub_build.libcudart), str(plugin)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert engine.stdout.readline().strip() == "ready"
        with AgentProcess(reachable / "kvtrace.sock", "-p", str(engine.pid), "--no-nvml", "--vllm-socket",
                          str(plugin), "--no-vllm-discovery") as agent:
            time.sleep(1.0)
            engine.stdin.write("go\n")
            engine.stdin.flush()
            assert engine.stdout.readline().strip() == "sent", agent.stderr_text()
            cpu = psutil.Process(agent.process.pid).cpu_times()
            started = time.monotonic()
            attacker = as_nobody(sys.executable, str(attacker_script), str(plugin), str(FLOOD_PROCESSES),
                                 str(FLOOD_SECONDS), stdout=subprocess.PIPE)
            impostor = int(attacker.stdout.readline().split()[0])
            report = metrics = doctor = None
            while attacker.poll() is None:  # the engine reports once a second meanwhile
                engine.stdin.write("again\n")
                engine.stdin.flush()
                engine.stdout.readline()
                time.sleep(1.0)
                if report is None and time.monotonic() - started > 3.0:  # in the thick of it
                    report = json.loads(kvtrace("vllm", "--socket", str(agent.socket), "--json").stdout)
                    metrics = metrics_of(agent)
                    doctor = kvtrace("doctor", "--socket", str(agent.socket))
            elapsed = time.monotonic() - started
            after = psutil.Process(agent.process.pid).cpu_times()
            agent_cpu = (after.user + after.system - cpu.user - cpu.system) / elapsed
            counters = agent.counters()
            engine.stdin.write("exit\n")
            engine.stdin.flush()
        print(f"\nagent CPU during {FLOOD_PROCESSES} processes' flood: {agent_cpu:.0%} of a core over "
              f"{elapsed:.1f} s; messages received {counters.get('vllm_messages_received')}, refused at the "
              f"share {counters.get('share_refused/vllm_senders/nobody')}")
        print(doctor.stdout)
        [found] = report["engines"]
        assert (found["engine_pid"], found["kv_tensor_bytes"], found["plugin"]) == (engine.pid, 128 * MiB, True)
        assert [(finding["kind"], finding["engine_pid"]) for finding in report["findings"]] == [
            ("blocks_held_after_finish", engine.pid)]
        # `kvtrace vllm` (root: the admin socket) names the impostor apart, with why
        [untrusted] = [sender for sender in report["untrusted_senders"] if sender["pid"] == impostor]
        assert untrusted["reason"].startswith("it holds no traced GPU memory"), untrusted
        assert counters["share_refused/vllm_senders/nobody"] > 0
        assert 'kvtrace_share_refused_total{resource="vllm_senders",user="nobody"}' in metrics
        assert not [line for line in sample(metrics, "kvtrace_vllm_finding{") if f'pid="{impostor}"' in line]
        assert not [line for line in sample(metrics, "kvtrace_vllm_blocks_held_after_finish{")
                    if f'pid="{engine.pid}"' not in line]
        assert "refused to user nobody at its share" in doctor.stdout
        assert f"pid {impostor} (untrusted): it holds no traced GPU memory" in doctor.stdout
        assert agent_cpu < 0.6
    finally:
        engine.kill()
        engine.wait()


def test_root_tails_on_the_admin_socket_while_nobody_fills_the_group_socket(reachable, bpf_here, stub_build):
    group = grp.getgrgid(NOBODY).gr_name  # nobody's own group: nobody is a member of the agent's group
    hog = reachable / "hog.py"
    hog.write_text(textwrap.dedent("""
        import sys, time
        import grpc
        from kvtrace._proto.kvtrace.v1 import agent_service_pb2 as pb, agent_service_pb2_grpc as pbg
        calls = []
        for _ in range(int(sys.argv[2])):  # a connection each: nothing is ever read
            channel = grpc.insecure_channel("unix:" + sys.argv[1], [("grpc.use_local_subchannel_pool", 1)])
            calls.append((channel, pbg.AgentServiceStub(channel).StreamEvents(pb.StreamEventsRequest(),
                                                                              timeout=float(sys.argv[3]) + 4)))
        print("open", flush=True)
        time.sleep(float(sys.argv[3]))
        ended = 0
        for _, call in calls:
            try:
                for _ in call:
                    pass
            except grpc.RpcError as error:  # the ones kvtrace ended; its share's run out their deadline
                ended += error.code() is not grpc.StatusCode.DEADLINE_EXCEEDED
        print(ended, flush=True)
    """))
    socket = reachable / "run" / "kvtrace.sock"
    with AgentProcess(socket, "--group", group, "--no-nvml", "--tracing", "off") as agent:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        hogs = as_nobody(sys.executable, str(hog), str(socket), "64", "6", stdout=subprocess.PIPE, env=env)
        assert hogs.stdout.readline().strip() == "open"
        time.sleep(1.0)
        started = time.monotonic()
        tail = subprocess.Popen([*agent_command(), "tail", "--socket", str(socket), "--json"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        time.sleep(1.5)
        first_wait = time.monotonic() - started
        tail_alive = tail.poll() is None
        tail.terminate()
        _, tail_err = tail.communicate(timeout=10)
        ended = int(hogs.stdout.readline())
        hogs.wait(timeout=30)
        time.sleep(1.5)  # the API's figures reach the Session with its next health poll
        counters = agent.counters()
        metrics = metrics_of(agent)
        doctor = kvtrace("doctor", "--socket", str(socket))
    print(f"\nroot's tail alive {first_wait:.1f} s after it started; nobody's streams ended: {ended} of 64")
    assert tail_alive, tail_err
    assert "RESOURCE_EXHAUSTED" not in tail_err
    shut = counters.get("share_refused/group_connections/nobody", 0)
    # Exactly its share of 4 streams' connections remain; a channel that reconnects is shut again (counted).
    assert ended == 60 and shut >= 60, (shut, ended)
    assert f'kvtrace_share_refused_total{{resource="group_connections",user="nobody"}} {float(shut)}' in metrics
    assert "refused to user nobody at its share" in doctor.stdout


def agent_command() -> list[str]:
    from agent_process import KVTRACE

    return list(KVTRACE)


def test_nobodys_cupti_connections_take_its_share_and_root_still_connects(reachable):
    """`kvtrace run`'s socket (any local user may connect): nobody's 80 connections take its share of 64, the
    other 16 are refused, counted and named; root's connection is taken."""
    holder = reachable / "holder.py"
    holder.write_text(textwrap.dedent("""
        import socket, sys, time
        held = []
        for _ in range(int(sys.argv[2])):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(sys.argv[1])
            held.append(sock)
        print("connected", flush=True)
        time.sleep(float(sys.argv[3]))
    """))
    cupti = reachable / "cupti.sock"
    with AgentProcess(reachable / "kvtrace.sock", "--no-nvml", "--tracing", "off", "--cupti-socket",
                      str(cupti)) as agent:
        nobody = as_nobody(sys.executable, str(holder), str(cupti), "80", "8", stdout=subprocess.PIPE)
        assert nobody.stdout.readline().strip() == "connected"
        import socket as sockets

        with sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM) as root:
            root.connect(str(cupti))
            deadline = time.monotonic() + 10
            while True:
                counters = agent.counters()
                if counters.get("cupti_connections_open") == 65 or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            doctor = kvtrace("doctor", "--socket", str(agent.socket))
        nobody.kill()
        nobody.wait()
    assert counters["cupti_connections_open"] == 65  # nobody's 64 and root's
    assert counters["share_refused/cupti_connections/nobody"] == 16
    assert "16 refused to user nobody at its share" in doctor.stdout
