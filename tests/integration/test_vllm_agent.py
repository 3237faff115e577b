"""The real agent on a stand-in vLLM engine: roles from the allocation stacks and the plugin's KV layout,
the plugin's reports through the agent's socket, the detectors, and every output that shows them.

GIVEN `kvtrace agent` and a Python process titled `VLLM::EngineCore` (as setproctitle titles vLLM's
engine) that, through the stub libcudart, allocates from functions named as vLLM's are (`load_model` 32 MiB,
`_allocate_kv_cache` 2 x 64 MiB, `_dummy_run` 16 MiB, `helper` 8 MiB, one more 4 MiB KV tensor from
`helper` whose address only the plugin's layout places) and then sends the plugin's datagrams (a
recorded KV layout and a scheduler report with an aborted request holding 6 blocks for 100 s and one
finished 2 s ago),
WHEN the outputs are read,
THEN the agent ties the reports to the engine by the kernel's sender pid; the roles are exact (kv_cache
128 + 4 MiB, weights 32, activations 16, other 8); `kvtrace vllm` names the engine, its blocks and the
aborted request (not the recent one) and says the usage is stuck; /metrics has the roles, the engine's
figures and the findings; a malformed datagram from another process is rejected and counted.
"""
import http.server
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from agent_process import AgentProcess, kvtrace
from stand_in_engine import ENGINE_PRELUDE

MiB = 1 << 20

TARGET = ENGINE_PRELUDE + textwrap.dedent("""
    def load_model():
        malloc(32 << 20)

    def _allocate_kv_cache():
        return [malloc(64 << 20), malloc(64 << 20)]

    def _dummy_run():
        malloc(16 << 20)

    def helper(size):
        return malloc(size)

    print("ready", flush=True)
    sys.stdin.readline()
    load_model()
    tensors = _allocate_kv_cache()
    _dummy_run()
    helper(8 << 20)
    tensors.append(helper(4 << 20))  # a KV tensor whose stack says nothing: the layout places it
    plugin = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    layout = {"v": 1, "type": "kv_cache", "device": 0, "num_blocks": 1001, "page_size_bytes": 65536,
              "block_size": 16, "tensors": [[address, 64 << 20] for address in tensors[:2]] + [[tensors[2], 4 << 20]]}
    report = {"v": 1, "type": "scheduler", "blocks_total": 1000, "blocks_free": 990, "running": 0, "waiting": 0,
              "allocated_total": 30, "freed_total": 20, "requests_omitted": 0,
              "requests": [["leak-0-1a2b3c4d", "aborted", 6, 100.0], ["done-1-5e6f7a8b", "finished", 4, 2.0]]}
    plugin.sendto(json.dumps(layout).encode(), sys.argv[2])
    for _ in range(30):  # once a second, as the plugin's reporter does
        plugin.sendto(json.dumps(report).encode(), sys.argv[2])
        print("sent", flush=True)
        if sys.stdin.readline().strip() == "exit":
            break
""")


@pytest.fixture
def vllm_metrics_server():
    """vLLM's /metrics as its API server serves it (vLLM 0.24's names, one engine), from this process: the
    stand-in engine's parent, as `vllm serve` is EngineCore's."""
    recorded = (Path(__file__).parents[1] / "unit" / "data" / "vllm_0_24_metrics.txt").read_text()
    body = "\n".join(line for line in recorded.splitlines() if 'engine="1"' not in line).encode() + b"\n"

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    server.shutdown()
    server.server_close()


def _metrics(text: str) -> dict[tuple[str, frozenset], float]:
    """(sample name, its labels) -> value, for every sample of the exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_a_vllm_engines_roles_reports_and_findings(tmp_path, bpf_here, stub_build, vllm_metrics_server):
    script = tmp_path / "engine.py"
    script.write_text(TARGET)
    socket_path = tmp_path / "kvtrace.sock"
    plugin_socket = tmp_path / "vllm.sock"
    target = subprocess.Popen([sys.executable, str(script), str(stub_build.libcudart), str(plugin_socket)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert target.stdout.readline().strip() == "ready"
        with AgentProcess(socket_path, "-p", str(target.pid), "--no-nvml", "--vllm-socket", str(plugin_socket),
                          "--vllm-stuck-seconds", "1", "--site-sample-interval", "1",
                          "--vllm-metrics-url", vllm_metrics_server, "--no-vllm-discovery") as agent:
            time.sleep(1.0)  # the agent reads the target's Python runtime before it allocates
            target.stdin.write("go\n")
            target.stdin.flush()
            assert target.stdout.readline().strip() == "sent", agent.stderr_text()

            # Another process sends garbage: rejected, counted, nothing else changes.
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as stranger:
                stranger.sendto(b'{"v": 1, "type": "scheduler", "blocks_total": "many"}', str(plugin_socket))

            deadline = time.monotonic() + 20
            while True:  # one report a second until the findings hold (the stuck usage needs 1 s)
                report = json.loads(kvtrace("vllm", "--socket", str(socket_path), "--json").stdout or "{}")
                findings = {finding["kind"] for finding in report.get("findings", ())}
                engines = report.get("engines", [])
                if ({"blocks_held_after_finish", "stuck_kv_usage"} <= findings and engines
                        and engines[0]["role_bytes"].get("kv_cache") == 132 * MiB
                        and engines[0]["metrics_kv_cache_usage_ratio"] is not None) or time.monotonic() > deadline:
                    break
                target.stdin.write("again\n")
                target.stdin.flush()
                target.stdout.readline()
            human = kvtrace("vllm", "--socket", str(socket_path))
            ps = kvtrace("ps", "--socket", str(socket_path))
            metrics_url = next(line.split()[-1] for line in agent.stderr_text().splitlines()
                               if line.startswith("Prometheus metrics on "))
            metrics = _metrics(urllib.request.urlopen(metrics_url, timeout=5).read().decode())
            target.stdin.write("exit\n")
            target.stdin.flush()
        print(json.dumps(report, indent=1))
        print(human.stdout)

        [engine] = report["engines"]
        assert (engine["engine_pid"], engine["title"], engine["plugin"]) == (target.pid, "VLLM::EngineCore", True)
        assert (engine["blocks_total"], engine["blocks_free"], engine["page_size_bytes"]) == (1000, 990, 65536)
        assert engine["kv_tensor_bytes"] == 132 * MiB
        assert engine["kv_cache_usage_ratio"] == pytest.approx(0.01)  # the plugin's, beside vLLM's own figure:
        assert (engine["api_server_pid"], engine["metrics_url"]) == (os.getpid(), vllm_metrics_server)
        assert engine["metrics_kv_cache_usage_ratio"] == 0.4375
        assert engine["role_bytes"] == {"kv_cache": 132 * MiB, "weights": 32 * MiB, "activations": 16 * MiB,
                                        "other": 8 * MiB}
        assert engine["traced_bytes"] == 188 * MiB
        held = next(finding for finding in report["findings"] if finding["kind"] == "blocks_held_after_finish")
        assert [(request["request_id"], request["blocks"]) for request in held["requests"]] == [
            ("leak-0-1a2b3c4d", 6)]  # the request finished 2 s ago is not (yet) a leak
        assert held["engine_pid"] == target.pid and held["value"] == 6

        assert human.returncode == 0, human.stderr
        assert "VLLM::EngineCore" in human.stdout and "leak-0-1a2b3c4d" in human.stdout
        assert ps.returncode == 0, ps.stderr
        assert "kv 132M w 32M act 16M other 8M" in ps.stdout, ps.stdout  # the ROLES column

        engine_labels = {"pid": str(target.pid), "title": "VLLM::EngineCore"}

        def value(name: str, **labels: str) -> float:
            return metrics[(name, frozenset({**engine_labels, **labels}.items()))]

        assert value("kvtrace_role_bytes", gpu="0", role="kv_cache") == 132 * MiB
        assert value("kvtrace_role_bytes", gpu="0", role="weights") == 32 * MiB
        assert value("kvtrace_vllm_kv_blocks", state="free") == 990
        assert value("kvtrace_vllm_blocks_held_after_finish") == 6
        assert value("kvtrace_vllm_finding", kind="blocks_held_after_finish") == 1
        assert value("kvtrace_vllm_finding", kind="stuck_kv_usage") == 1
        assert value("kvtrace_vllm_finding", kind="idle_growth") == 0
        assert metrics[("kvtrace_vllm_messages_rejected_total", frozenset())] == 1
        assert metrics[("kvtrace_vllm_messages_received_total", frozenset())] >= 2
    finally:
        target.kill()
        target.wait()
