"""Depth per process on a real vLLM 0.24 engine: the agent as shipped finds a leak planted in a running engine.

GIVEN a running vLLM engine (random 8-layer Llama, enforce_eager, the kvtrace plugin inside) and `kvtrace agent`
as shipped started beside it (--blocks auto: every process at depth segments), WHEN a thread in the engine
starts keeping a 256 KiB clone every 20 ms (12.5 MiB/s, under the 512 KiB sample size: its bytes are
estimated from sampled stacks), THEN the agent raises the engine process to depth blocks within 60 s,
`kvtrace leaks` ranks the function that keeps the clones first within 120 s, and its estimated bytes are
within 25 % of the clones the engine says it made between the raise and the report.

Figures are printed first (run with -s), then every check is asserted at once.
Needs vLLM (tests/gpu/README.md: the offline bundle); skipped with the reason otherwise.
"""
from __future__ import annotations

import json
import os
import time

from test_vllm import _plugin_path, _require_vllm, _start_engine
from test_vllm_placement import ENGINE, _expect

from agent_process import AgentProcess
from conftest import check_all, source_line
from kvtrace.client import AgentClient
from kvtrace.model.depth import Depth

MiB = 1 << 20
CLONE_BYTES = 256 << 10
INTERVAL_SECONDS = 0.02


def test_a_leak_planted_in_a_running_vllm_engine_raises_depth_and_names_its_holder(agent_socket, tmp_path):
    _require_vllm()
    failures: list[str] = []
    plugin_socket = tmp_path / "vllm.sock"
    env = dict(os.environ, KVTRACE_VLLM_PLUGIN="1", KVTRACE_VLLM_SOCKET=str(plugin_socket), KVTRACE_TEST_SLEEP_MODE="0",
               PYTHONPATH=os.pathsep.join([str(_plugin_path(tmp_path / "site")), os.environ.get("PYTHONPATH", "")]))
    keep_line = source_line("# KEEP_CLONE_LINE", ENGINE)
    engine, lines, command = _start_engine(env)
    try:
        _expect(lines, "ready", 600)
        # The agent starts beside the running engine (its start-up, model and KV cache, is not growth to
        # it), with no start-up grace: the engine is settled, and the default (120 s) would make the test
        # wait two minutes before any evidence counts.
        with AgentProcess(agent_socket, "--vllm-socket", str(plugin_socket), "--no-nvml", "--deepen-grace-seconds",
                          "0", "--leak-min-age", "0", "--site-sample-interval", "2") as agent, \
                AgentClient.for_socket(agent_socket) as client:
            time.sleep(10)  # the agent's analysis of the engine at rest (its plugin reconnects meanwhile)
            depths = {process.pid: process.depth for process in client.processes() if process.HasField("depth")}
            print(f"\nat rest: {[(pid, Depth(d.depth).label, d.detail) for pid, d in depths.items()]}")
            # (an idle engine allocates nothing the agent saw: it may not be listed yet)
            if any(state.depth != Depth.SEGMENTS for state in depths.values()):
                failures.append(f"an engine at rest is deeper than segments: {depths}")
            pid = json.loads(command(f"clone_leak {CLONE_BYTES} {INTERVAL_SECONDS}", "cloning"))["pid"]
            started = time.monotonic()
            raised_after = first_after = raised_ns = None
            report = suspect = None
            while time.monotonic() - started < 120:
                state = next((p.depth for p in client.processes() if p.pid == pid and p.HasField("depth")), None)
                if raised_after is None and state is not None and state.depth >= Depth.BLOCKS:
                    raised_after, raised_ns = time.monotonic() - started, state.since_ns
                    print(f"engine {pid} raised to {Depth(state.depth).label} after {raised_after:.1f} s: "
                          f"{state.detail}")
                if raised_after is not None:
                    report = client.leak_suspects(pids=[pid], min_age_seconds=0)
                    frames = report.suspects[0].stack.frames if report.suspects else []
                    if frames and (frames[0].function, frames[0].line) == ("_keep_clone", keep_line):
                        first_after, suspect = time.monotonic() - started, report.suspects[0]
                        break
                time.sleep(1.0)
            counters = agent.counters()
            print(f"agent counters: { {k: v for k, v in counters.items() if v and 'block' in k} }")
        if raised_after is None or raised_after > 60:
            failures.append(f"depth raised after {raised_after} s, not within 60 s")
        if suspect is None or report is None:
            first = report.suspects[0] if report and report.suspects else None
            failures.append(f"_keep_clone not ranked first within 120 s (first: {first})")
        else:
            clones = json.loads(command(f"clones_since {raised_ns} {report.timestamp_ns}", "clones"))
            true_bytes = clones["since"] * CLONE_BYTES
            print(f"holder ranked first after {first_after:.1f} s: {suspect.outstanding_bytes / MiB:.1f} MiB in "
                  f"{suspect.allocation_count} blocks (estimated: {suspect.estimated}); the engine kept "
                  f"{clones['since']} clones since the raise ({true_bytes / MiB:.1f} MiB), {clones['kept']} in all")
            if abs(suspect.outstanding_bytes - true_bytes) > 0.25 * true_bytes + CLONE_BYTES:
                failures.append(f"estimate {suspect.outstanding_bytes} bytes, truth {true_bytes}")
    finally:
        if engine.poll() is None:
            engine.kill()
        engine.wait()
    check_all(failures)
