"""Issue 13's proof on a real vLLM 0.24 engine (random 8-layer Llama, sleep mode, one H200), with the
kvtrace plugin loaded by vLLM through its `vllm.general_plugins` entry point:

- roles: the engine's traced bytes by role against what vLLM itself holds (its CuMemAllocator pools
  by tag, the KV tensors, the weights);
- the plugin's KV layout and blocks against vLLM's (num_gpu_blocks), its KV usage against vLLM's own
  `vllm:kv_cache_usage_perc` (vLLM's PrometheusStatLogger, served by the workload);
- a planted abort-path leak (aborted `leak-*` requests keep their blocks) found with exactly those
  request ids, while a normal abort (`abort-*`) is not; KV usage stuck with nothing running;
- a planted allocation loop with no request running reported as idle growth within 30 s;
- sleep level 1 and 2 drop exactly the tagged pools, wake brings them back; the residue reported.

Every figure is printed; one assertion at the end lists every failed check.
Needs vLLM (tests/gpu/README.md: the offline bundle); skipped with the reason otherwise.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from test_vllm_placement import ENGINE, _expect, _reader

from agent_process import AgentProcess
from conftest import check_all, wait_for
from kvtrace.client import AgentClient
from kvtrace.model.events import Layer, Memory
from kvtrace.model.vllm import FindingKind, Role
from kvtrace.wire import vllm_engine_from_proto, vllm_finding_from_proto

MiB = 1 << 20
GiB = 1 << 30
# 8 MiB tensors every 50 ms (less the time an allocation takes): PyTorch's caching allocator puts requests
# of 1-10 MiB in 20 MiB segments, two to a segment, so the traced (segment) bytes grow at most 200 MiB/s,
# for about 15 s.
GROW_BYTES = 3 * GiB


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _plugin_path(directory: Path) -> Path:
    """A dist-info that declares kvtrace's entry point, as installing kvtrace into vLLM's Python does
    (here kvtrace runs from the source tree on PYTHONPATH)."""
    info = directory / "kvtrace-0.0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvtrace\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nkvtrace = kvtrace.sources.vllm.plugin:register\n")
    return directory


def _state(agent_socket):
    with AgentClient.for_socket(agent_socket) as client:
        response = client.vllm_engines()
    return ([vllm_engine_from_proto(engine) for engine in response.engines],
            [vllm_finding_from_proto(finding) for finding in response.findings])


def _engine(agent_socket, predicate=lambda engine: True, timeout_seconds: float = 30):
    """The first engine that satisfies `predicate` within the timeout (None otherwise)."""
    def look():
        engines, _ = _state(agent_socket)
        return next((engine for engine in engines if predicate(engine)), None)
    return wait_for(look, timeout_seconds)


def _finding(agent_socket, kind: FindingKind, timeout_seconds: float):
    def look():
        _, findings = _state(agent_socket)
        return next((finding for finding in findings if finding.kind is kind), None)
    started = time.monotonic()
    finding = wait_for(look, timeout_seconds)
    return finding, time.monotonic() - started


def _metrics_usage(port: int) -> float | None:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith("vllm:kv_cache_usage_perc{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def _vmm_bytes(agent_socket, pid: int) -> int:
    """Device bytes `pid` holds at the VMM layer (cuMemCreate): CuMemAllocator's pools."""
    with AgentClient.for_socket(agent_socket) as client:
        processes = client.processes()
    return sum(total.size_bytes for process in processes if process.pid == pid for total in process.totals
               if total.layer == Layer.VMM and total.memory == Memory.DEVICE)


def _component(agent_socket, name: str) -> str:
    with AgentClient.for_socket(agent_socket) as client:
        info = client.info()
    return next((f"{'up' if c.up else 'DOWN'} {c.reason!r}" for c in info.components if c.name == name), "none")


def _keep(name: str, data: bytes) -> None:
    """A file for the record, in $OUT on the GPU machine (nowhere elsewhere)."""
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / name).write_bytes(data)


def _roles(engine) -> str:
    return ", ".join(f"{role.label} {size / MiB:.1f} MiB" for role, size in
                     sorted(engine.role_bytes.items(), key=lambda item: -item[1]))


def _require_vllm() -> None:
    try:
        import vllm  # noqa: F401
    except Exception as error:  # vLLM's import can fail in more ways than ImportError
        pytest.skip(f"vLLM is not importable here ({error}): see tests/gpu/README.md for the bundle")


def test_vllm_engine_roles_blocks_leaks_growth_and_sleep(agent_socket, tmp_path):
    _require_vllm()
    failures: list[str] = []
    plugin_socket = tmp_path / "vllm.sock"
    port = _free_port()
    env = dict(os.environ, KVTRACE_VLLM_PLUGIN="1", KVTRACE_VLLM_SOCKET=str(plugin_socket),
               KVTRACE_TEST_METRICS_PORT=str(port),
               PYTHONPATH=os.pathsep.join([str(_plugin_path(tmp_path / "site")), os.environ.get("PYTHONPATH", "")]))
    with AgentProcess(agent_socket, "--vllm-socket", str(plugin_socket),
                      "--vllm-metrics-url", f"http://127.0.0.1:{port}/metrics",
                      "--vllm-held-seconds", "5", "--vllm-stuck-seconds", "10",
                      "--vllm-cold-start-seconds", "30") as agent:
        engine_process, lines, command = _start_engine(env)
        try:
            _expect(lines, "ready")
            truth = json.loads(command("truth", "truth"))
            print(f"\nvLLM's own figures: {truth}")
            pools = truth["pools"]
            pool_bytes = sum(pools.values())

            # -- the plugin's layout and blocks, roles --
            engine = _engine(agent_socket, lambda e: e.plugin and e.blocks_total and e.kv_tensor_bytes
                             and e.role_bytes, 60)
            if engine is None:
                failures.append(f"no engine with plugin reports and roles: {_state(agent_socket)}")
                raise _Stop
            print(f"engine {engine.engine_pid} {engine.title!r}: traced {engine.traced_bytes / MiB:.1f} MiB "
                  f"({_roles(engine)}); blocks {engine.blocks_total} total, {engine.blocks_free} free; "
                  f"KV tensors {engine.kv_tensor_bytes} B, page {engine.page_size_bytes} B")
            if engine.engine_pid != truth["pid"]:
                failures.append(f"engine pid {engine.engine_pid}, vLLM's engine process {truth['pid']}")
            if not engine.title.startswith("VLLM::EngineCore"):
                failures.append(f"engine title {engine.title!r}")
            if engine.blocks_total != truth["num_gpu_blocks"] - 1:
                failures.append(f"plugin blocks_total {engine.blocks_total}, vLLM num_gpu_blocks - 1 = "
                                f"{truth['num_gpu_blocks'] - 1}")
            if engine.kv_tensor_bytes != truth["kv_tensor_bytes"]:
                failures.append(f"plugin KV tensors {engine.kv_tensor_bytes} B, vLLM's {truth['kv_tensor_bytes']} B")
            kv = engine.role_bytes.get(Role.KV_CACHE, 0)
            weights = engine.role_bytes.get(Role.WEIGHTS, 0)
            print(f"roles vs vLLM: kv_cache {kv} B vs pool 'kv_cache' {pools.get('kv_cache')} B and KV tensors "
                  f"{truth['kv_tensor_bytes']} B; weights {weights} B vs pool 'weights' {pools.get('weights')} B "
                  f"and parameters {truth['weights_param_bytes']} B")
            if kv != pools.get("kv_cache"):
                failures.append(f"kv_cache role {kv} B != vLLM's kv_cache pool {pools.get('kv_cache')} B")
            if weights != pools.get("weights"):
                failures.append(f"weights role {weights} B != vLLM's weights pool {pools.get('weights')} B")
            if not truth["kv_tensor_bytes"] <= kv <= truth["kv_tensor_bytes"] + 2 * MiB * truth["kv_tensors"]:
                failures.append(f"kv_cache role {kv} B not the KV tensors' {truth['kv_tensor_bytes']} B "
                                f"+ at most 2 MiB granularity each")

            # -- sleep level 1 and 2: the VMM layer is exactly CuMemAllocator's pools (before the planted leak:
            # blocks that never go back make vLLM's sleep() fail to reset the KV cache) --
            pid = truth["pid"]
            awake_vmm = wait_for(lambda: _vmm_bytes(agent_socket, pid) == pool_bytes or None, 10)
            print(f"VMM bytes awake: {_vmm_bytes(agent_socket, pid)} (pools {pool_bytes})")
            if not awake_vmm:
                failures.append(f"VMM bytes awake {_vmm_bytes(agent_socket, pid)} B != pools {pool_bytes} B")
            residues = []
            for level in (1, 2):
                command(f"sleep {level}", "slept")
                asleep = _engine(agent_socket, lambda e, level=level: e.sleep_level == level, 30)
                vmm = wait_for(lambda: _vmm_bytes(agent_socket, pid) == 0 or None, 10)
                print(f"sleep {level}: VMM bytes {_vmm_bytes(agent_socket, pid)} (awake {pool_bytes}); level "
                      f"{asleep and asleep.sleep_level}; traced {asleep and asleep.traced_bytes} B "
                      f"({asleep and _roles(asleep)})")
                if asleep is None:
                    failures.append(f"the engine never showed sleep level {level}")
                if not vmm:
                    failures.append(f"sleep {level}: VMM bytes {_vmm_bytes(agent_socket, pid)}, expected 0")
                _, findings = _state(agent_socket)
                residues.append(asleep.sleep_residual_bytes if asleep else None)
                previous = asleep.previous_sleep_residual_bytes if asleep else None
                print(f"  residue: {residues[-1]} B (previous sleep {previous}), "
                      f"pools mapped by tag {asleep and asleep.sleep_held_by_tag}; findings "
                      f"{[f.message for f in findings if f.kind is FindingKind.SLEEP_RESIDUE]}")
                if asleep is not None and (asleep.sleep_residual_bytes is None
                                           or set(asleep.sleep_held_by_tag) != set(pools)
                                           or any(asleep.sleep_held_by_tag.values())):
                    failures.append(f"sleep {level}: residue {asleep.sleep_residual_bytes}, pools mapped by tag "
                                    f"{asleep.sleep_held_by_tag} (expected every tag of {sorted(pools)} at 0)")
                command("wake", "woke")
                woke = wait_for(lambda: _vmm_bytes(agent_socket, pid) == pool_bytes or None, 10)
                print(f"wake: VMM bytes {_vmm_bytes(agent_socket, pid)} (pools {pool_bytes})")
                if not woke:
                    failures.append(f"wake after sleep {level}: VMM bytes {_vmm_bytes(agent_socket, pid)}, "
                                    f"pools {pool_bytes}")

            woke = _engine(agent_socket, lambda e: e.sleep_level == 0 and e.role_bytes.get(Role.KV_CACHE) ==
                           pools["kv_cache"] and e.role_bytes.get(Role.WEIGHTS) == pools["weights"], 20)
            print(f"roles after waking: {woke and _roles(woke)}")
            if woke is None:
                failures.append("after waking, the kv_cache and weights roles are not vLLM's pools again")

            # -- planted abort-path leak; usage against vLLM's own metric --
            leaked = json.loads(command("leak", "leaked"))
            finding, took = _finding(agent_socket, FindingKind.BLOCKS_HELD_AFTER_FINISH, 40)
            if finding is None:
                failures.append("no blocks_held_after_finish finding within 40 s")
            else:
                ids = sorted(request.request_id for request in finding.requests)
                print(f"held after finish ({took:.1f} s): {finding.message}; requests {ids} "
                      f"blocks {[request.blocks for request in finding.requests]}")
                expected = sorted(leaked["leaked"])
                if sorted(request_id.rsplit("-", 1)[0] for request_id in ids) != expected:
                    failures.append(f"held-after-finish requests {ids}, planted {expected} (vLLM adds a suffix)")
                if any(request.request_id.startswith("abort-") for request in finding.requests):
                    failures.append("a normally aborted request was reported as holding blocks")
            engine = _engine(agent_socket, lambda e: e.requests_running == 0 and e.kv_cache_usage_ratio, 20)
            usage_metric = _metrics_usage(port)
            print(f"KV usage: plugin {engine and engine.kv_cache_usage_ratio}, agent's scrape "
                  f"{engine and engine.metrics_kv_cache_usage_ratio}, vllm:kv_cache_usage_perc {usage_metric}")
            if engine is None or usage_metric is None or abs(engine.kv_cache_usage_ratio - usage_metric) > 1e-9:
                failures.append(f"plugin KV usage {engine and engine.kv_cache_usage_ratio} != "
                                f"vllm:kv_cache_usage_perc {usage_metric}")
            elif engine.metrics_kv_cache_usage_ratio is None or \
                    abs(engine.metrics_kv_cache_usage_ratio - usage_metric) > 1e-9:
                failures.append(f"the agent's scrape {engine.metrics_kv_cache_usage_ratio} != {usage_metric}")
            if engine is not None:
                print(f"  engine {engine.engine_pid}: API server {engine.api_server_pid} (vLLM's process "
                      f"{engine_process.pid}), metrics_url {engine.metrics_url!r}, error {engine.metrics_error!r}; "
                      f"component {_component(agent_socket, 'vllm_metrics')}")
                if engine.api_server_pid != engine_process.pid:
                    failures.append(f"the engine's API server {engine.api_server_pid}, the process serving "
                                    f"vLLM's metrics is {engine_process.pid}")
            _keep("vllm_metrics.txt", urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read())
            stuck, took = _finding(agent_socket, FindingKind.STUCK_KV_USAGE, 40)
            print(f"stuck usage ({took:.1f} s): {stuck and stuck.message}")
            if stuck is None:
                failures.append("no stuck_kv_usage finding within 40 s of the leak")

            # -- idle growth --
            command(f"grow {GROW_BYTES}", "growing")
            growth, took = _finding(agent_socket, FindingKind.IDLE_GROWTH, 30)
            print(f"idle growth ({took:.1f} s after the loop started): {growth and growth.message}")
            if growth is None:
                failures.append("no idle_growth finding within 30 s of an allocation loop with no request")
            elif not 100 * MiB <= growth.value <= 210 * MiB:
                failures.append(f"idle growth {growth.value / MiB:.1f} MiB/s, planted at most 200 MiB/s")
            time.sleep(max(0.0, GROW_BYTES / (160 * MiB) + 2 - took))  # the tensors' own rate: 160 MiB/s
            command("ungrow", "ungrown")

            command("exit", "")
        except _Stop:
            pass
        finally:
            engine_process.kill()
            engine_process.wait()
            print(f"agent log:\n{agent.stderr_text()[-3000:]}")
    check_all(failures)


class _Stop(Exception):
    """A check failed that the rest depends on."""


def _start_engine(env: dict[str, str]):
    """tests/gpu/workloads/vllm_engine.py started: its process, its output lines, and `command(text, answer,
    timeout_seconds=240)`, which sends one command and returns the rest of its answer's line."""
    engine = subprocess.Popen([sys.executable, str(ENGINE)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env)
    lines = _reader(engine)

    def command(text: str, answer: str, timeout_seconds: float = 240) -> str:
        engine.stdin.write(text + "\n")
        engine.stdin.flush()
        return _expect_value(lines, answer, timeout_seconds)

    return engine, lines, command


def _expect_value(lines, word: str, timeout_seconds: float) -> str:
    """The rest of the engine's first line starting with `word` ("" for an empty word: no answer)."""
    if not word:
        return ""
    deadline = time.monotonic() + timeout_seconds
    while True:
        remaining = deadline - time.monotonic()
        try:
            line = lines.get(timeout=max(0.0, remaining))
        except Exception:
            raise AssertionError(f"no {word!r} from the engine within {timeout_seconds} s") from None
        if line is None:
            raise AssertionError(f"the engine ended before {word!r}")
        print(line, end="")
        if line.split(" ", 1)[0].strip() == word:
            return line[len(word):].strip()

