"""`kvtrace vllm`: the vLLM engines on the host: memory by role, KV-cache blocks, requests, sleep
mode, and what the vLLM detectors found."""
from __future__ import annotations

import argparse
import json
import sys

from kvtrace.cli.deep import cause_words, clock_time
from kvtrace.cli.flags import add_pid_flag
from kvtrace.cli.ps import roles_cell
from kvtrace.client import AgentClient
from kvtrace.config import add_socket_flag
from kvtrace.errors import ExitCode
from kvtrace.human import human_bytes, human_duration, printable, signed_bytes
from kvtrace.model.depth import ProcessDepth
from kvtrace.model.vllm import KvRequest, UntrustedSender, VllmEngine, VllmFinding
from kvtrace.sources.vllm.protocol import ENABLE_ENV
from kvtrace.wire import (
    depths_by_pid,
    untrusted_sender_from_proto,
    vllm_engine_from_proto,
    vllm_engines_to_json_dict,
    vllm_finding_from_proto,
)

EPILOG = f"""examples:
  kvtrace vllm                          # every vLLM engine on the host
  kvtrace vllm -p 4242                  # the engine of this process (EngineCore or a worker)
  kvtrace vllm --json | jq '.findings'

Block and request figures come from kvtrace's plugin inside the engine: start vLLM with
{ENABLE_ENV}=1 in its environment and kvtrace installed in vLLM's Python. Without it, KV usage
and request counts come from the engine's /metrics (found from the process tree, or
`kvtrace agent --vllm-metrics-url URL`).
"""

# Requests holding blocks listed per engine; the rest are counted.
MAX_HOLDERS_SHOWN = 20
_SLEEP_LEVELS = {0: "awake", 1: "asleep, level 1 (weights offloaded, KV cache discarded)",
                 2: "asleep, level 2 (weights and KV cache discarded)"}


def no_engine_line(pids: list[int]) -> str:
    where = f" with pid {', '.join(map(str, pids))}" if pids else ""
    return (f"no vLLM engine{where} found: kvtrace knows engines by their process title (VLLM::EngineCore); "
            f"for KV-cache blocks and requests start vLLM with {ENABLE_ENV}=1 in its environment and kvtrace "
            "installed in vLLM's Python, or point the agent at the API server with "
            "`kvtrace agent --vllm-metrics-url http://HOST:PORT/metrics`")


def _percent(ratio: float) -> str:
    return f"{ratio * 100:.1f}%"


def _count(value: int | None) -> str:
    return "?" if value is None else str(value)


def _kv_line(engine: VllmEngine) -> str:
    """Blocks used/free/total and usage, the plugin's beside vLLM's own /metrics figure."""
    parts = []
    if engine.blocks_total is not None and engine.blocks_free is not None:
        used = max(0, engine.blocks_total - engine.blocks_free)
        parts.append(f"{used} of {engine.blocks_total} blocks used, {engine.blocks_free} free")
    usage, metrics_usage = engine.kv_cache_usage_ratio, engine.metrics_kv_cache_usage_ratio
    if engine.plugin and usage is not None:
        parts.append(f"usage {_percent(usage)}" + (f" (/metrics {_percent(metrics_usage)})"
                                                     if metrics_usage is not None else ""))
    elif metrics_usage is not None:
        parts.append(f"usage {_percent(metrics_usage)} (from /metrics)")
    if engine.kv_tensor_bytes:
        parts.append(f"tensors {human_bytes(engine.kv_tensor_bytes)}")
    if not parts:
        return "  KV cache: not known (no plugin in the engine, no /metrics; see `kvtrace vllm --help`)"
    return "  KV cache: " + ", ".join(parts)


def _engine_lines(engine: VllmEngine) -> list[str]:
    workers = ", ".join(str(pid) for pid in engine.worker_pids if pid != engine.engine_pid)
    lines = [f"vLLM engine pid {engine.engine_pid} {printable(engine.title) or '?'}"
             + (f" (workers {workers})" if workers else "")
             + (f", API server pid {engine.api_server_pid}" if engine.api_server_pid else "")
             + ("" if engine.plugin else ", no plugin"),
             f"  GPU memory traced {human_bytes(engine.traced_bytes)}: "
             f"{roles_cell(engine.role_bytes, engine.traced_bytes)}",
             _kv_line(engine)]
    if engine.requests_running is not None or engine.requests_waiting is not None:
        lines.append(f"  requests: {_count(engine.requests_running)} running, "
                     f"{_count(engine.requests_waiting)} waiting")
    if engine.plugin:
        ratio = engine.frees_per_allocation_1m
        lines.append(f"  blocks per second (1 min): {engine.block_allocations_per_second:.1f} allocated, "
                     f"{engine.block_frees_per_second:.1f} freed, "
                     + (f"{ratio:.2f} frees per allocation" if ratio is not None else "no allocations"))
    lines.append(f"  sleep: {_sleep_text(engine)}")
    if engine.warming_up:
        lines.append("  warming up: inside the cold-start window (model load, profiling), growth findings silent")
    if engine.metrics_error:
        lines.append(f"  /metrics {printable(engine.metrics_url)}: {printable(engine.metrics_error)}")
    return lines


def _sleep_text(engine: VllmEngine) -> str:
    """The level, and while asleep what is still held, by pool tag, against the sleep before."""
    text = _SLEEP_LEVELS.get(engine.sleep_level, f"asleep, level {engine.sleep_level}")
    residual = engine.sleep_residual_bytes
    if residual is None:
        return text
    text += f"; {human_bytes(residual)} still held"
    if engine.sleep_held_by_tag:
        text += " (" + ", ".join(f"{printable(tag)} {human_bytes(size)}"
                                 for tag, size in sorted(engine.sleep_held_by_tag.items())) + ")"
    if engine.previous_sleep_residual_bytes is not None:
        text += f", {signed_bytes(residual - engine.previous_sleep_residual_bytes)} since the sleep before"
    return text


def _holder_lines(holders: tuple[KvRequest, ...]) -> list[str]:
    if not holders:
        return []
    shown = holders[:MAX_HOLDERS_SHOWN]
    width = max(len("REQUEST"), *(len(printable(request.request_id) or "-") for request in shown))
    lines = [f"  requests holding blocks ({len(holders)}):",
             f"    {'REQUEST':<{width}} {'STATE':<9} {'BLOCKS':>7} DONE"]
    for request in shown:
        done = f"{human_duration(request.done_age_seconds)} ago" if request.done_age_seconds is not None else "-"
        lines.append(f"    {printable(request.request_id) or '-':<{width}} {request.state.name.lower():<9} "
                     f"{request.blocks:>7} {done}")
    if len(holders) > len(shown):
        lines.append(f"    and {len(holders) - len(shown)} more")
    return lines


def _depth_line(depths: dict[int, ProcessDepth]) -> list[str]:
    """`  depth: 4242 segments, 4243 blocks since 14:20:01 (vllm)`: its processes' depths, where known."""
    if not depths:
        return []
    parts = []
    for pid, depth in sorted(depths.items()):
        text = f"{pid} {depth.depth.label}"
        if depth.knows_holders:
            text += f" since {clock_time(depth.since_ns)} ({cause_words(depth, with_detail=False)})"
        parts.append(text)
    return ["  depth: " + ", ".join(parts)]


def format_engines(engines: list[VllmEngine], findings: list[VllmFinding],
                   depths: dict[int, dict[int, ProcessDepth]] | None = None) -> str:
    """Per engine: what it is and holds, its processes' depths, its findings (one line each), then the
    requests holding blocks. Findings about an engine not listed come last. `depths`: engine pid -> its
    processes' depths."""
    by_engine: dict[int, list[VllmFinding]] = {}
    for finding in findings:
        by_engine.setdefault(finding.engine_pid, []).append(finding)
    sections = []
    for engine in engines:
        lines = _engine_lines(engine)
        lines[2:2] = _depth_line((depths or {}).get(engine.engine_pid, {}))
        engine_findings = by_engine.pop(engine.engine_pid, [])
        lines.append(f"  findings: {'none' if not engine_findings else ''}".rstrip())
        lines += [f"    {finding.kind.label}: {printable(finding.message)}" for finding in engine_findings]
        lines += _holder_lines(engine.holders)
        sections.append("\n".join(lines))
    for pid, orphans in sorted(by_engine.items()):
        sections.append("\n".join([f"findings of engine pid {pid} (no longer listed):",
                                   *(f"    {f.kind.label}: {printable(f.message)}" for f in orphans)]))
    return "\n\n".join(sections)


def format_untrusted(senders: list[UntrustedSender]) -> str:
    """The processes whose plugin reports are kept apart, one line each, with why (issue 31: anyone on the host can
    send reports; only a process kvtrace ties to vLLM makes an engine or a finding)."""
    if not senders:
        return ""
    lines = [f"not tied to vLLM, their plugin reports kept apart (no engine, no finding): {len(senders)}"]
    for sender in senders:
        claims = [f"claims {human_bytes(sender.kv_tensor_bytes)} of KV tensors"] if sender.kv_tensor_bytes else []
        claims += ["sends scheduler reports"] if sender.scheduler else []
        lines.append(f"  pid {sender.pid} {printable(sender.label)}: {printable(sender.reason)}"
                     + (f"; {', '.join(claims)}" if claims else ""))
    return "\n".join(lines)


class VllmCommand:
    """Show the vLLM engines on the host, from the running kvtrace agent.

    Per engine (its EngineCore pid): GPU memory traced and what it is for (kv KV cache, w weights,
    graph CUDA graphs, act activations, other, unknown: no Python stack; "unsampled": traced after the
    agent's last site sample), KV-cache blocks used and free
    with the usage beside vLLM's own /metrics figure, requests running and waiting, blocks
    allocated and freed per second, sleep mode, and whether it is still warming up; then what the
    vLLM detectors found, and the requests holding blocks (done ones first). The depth line says how
    closely each of its processes is traced (`kvtrace ps` explains depths). Last, the processes that send
    plugin reports kvtrace cannot tie to vLLM (no traced GPU memory, no vLLM title or parent): kept apart,
    never an engine or a finding, each with why.
    """

    EPILOG = EPILOG

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        add_pid_flag(parser)
        parser.add_argument("--json", action="store_true", help="print the engines and findings as one JSON object")
        add_socket_flag(parser)

    def run(self, args: argparse.Namespace) -> int:
        with AgentClient.from_args(args) as agent:
            response = agent.vllm_engines(pids=args.pid)
        if args.json:
            print(json.dumps(vllm_engines_to_json_dict(response), ensure_ascii=False), file=sys.stdout)
            return ExitCode.OK
        if not response.timestamp_ns:
            print("the agent has not analysed anything yet (it has just started): try again in a few seconds",
                  file=sys.stdout)
        elif not response.engines and not response.findings:
            print(no_engine_line(args.pid), file=sys.stdout)
        else:
            print(format_engines([vllm_engine_from_proto(engine) for engine in response.engines],
                                 [vllm_finding_from_proto(finding) for finding in response.findings],
                                 {engine.engine_pid: depths_by_pid(engine.depths) for engine in response.engines}),
                  file=sys.stdout)
        untrusted = format_untrusted([untrusted_sender_from_proto(sender) for sender in response.untrusted_senders])
        if untrusted:
            print(f"\n{untrusted}", file=sys.stdout)
        return ExitCode.OK
