"""Events per second the agent delivers to one gRPC subscriber, with every loss accounted for,
and probe-to-client latency (p50/p99).

Runs the real `kvtrace agent` (BPF + gRPC on a temporary Unix socket) as a subprocess, a stub
workload making cudaMalloc+cudaFree pairs (4 traced calls each), and one subscriber in this
process. Needs root and bcc (as `make test`).

    sudo .venv/bin/python bench/api_throughput.py [--pairs 200000] [--latency-pairs 2000]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "tests"), str(HERE.parent / "tests" / "integration")]

from agent_process import AgentProcess  # noqa: E402
from cuda_stubs import Workload, build_stubs  # noqa: E402
from kvtrace.client import AgentClient  # noqa: E402


def subscribe(socket: Path, pid: int, expected: int, out: dict, ready: threading.Event) -> None:
    """Reads until every expected event is either received or reported lost."""
    received, dropped, kernel_lost, latencies_ns = 0, 0, 0, []
    first = last = None
    with AgentClient.for_socket(socket, timeout_seconds=600) as client:
        batches = client.stream_batches(pids=[pid])
        ready.set()
        for batch in batches:
            now_ns = time.time_ns()
            for message in batch:
                if message.HasField("events_lost"):
                    dropped += message.events_lost.dropped_count
                    kernel_lost += message.events_lost.kernel_lost_count
                elif message.HasField("allocation"):
                    received += 1
                    latencies_ns.append(now_ns - message.timestamp_ns)
            first = first or time.monotonic()
            last = time.monotonic()
            if received + dropped + kernel_lost >= expected:
                break
    out.update(received=received, dropped=dropped, kernel_lost=kernel_lost,
               seconds=(last - first) if first else 0.0, latencies_ns=latencies_ns)


def run(stubs, socket: Path, pairs: int, env: dict | None) -> dict:
    with Workload([stubs.workload, "loop", str(pairs)], env=env) as workload:
        pid = workload.wait_ready()
        with AgentProcess(socket, "-p", str(pid), "--no-python-stacks"):
            result, ready = {}, threading.Event()
            reader = threading.Thread(target=subscribe, args=(socket, pid, 4 * pairs, result, ready))
            reader.start()
            ready.wait(30)
            time.sleep(0.5)  # the stream is registered with the hub before the workload starts
            workload.go()
            workload.read_calls(timeout_s=600)
            reader.join(600)
    return result


def percentile(values: list[int], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] if ordered else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=200_000, help="pairs in the throughput run")
    parser.add_argument("--latency-pairs", type=int, default=2_000, help="pairs in the paced run")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("run as root: the agent loads BPF", file=sys.stderr)
        return 3
    work = Path(tempfile.mkdtemp(prefix="kvtrace-bench-"))
    stubs = build_stubs(work / "stubs")

    print(f"throughput: {args.pairs} pairs = {4 * args.pairs} events, unpaced", file=sys.stderr)
    burst = run(stubs, work / "a.sock", args.pairs, None)
    accounted = burst["received"] + burst["dropped"] + burst["kernel_lost"]
    rate = burst["received"] / burst["seconds"] if burst["seconds"] else 0.0

    print(f"latency: {args.latency_pairs} pairs paced at 20 pairs / 10 ms", file=sys.stderr)
    paced_env = dict(os.environ, KVT_LOOP_PAUSE_EVERY="20", KVT_LOOP_PAUSE_MS="10")
    paced = run(stubs, work / "b.sock", args.latency_pairs, paced_env)
    latencies_ms = [ns / 1e6 for ns in paced["latencies_ns"]]

    print(f"{'events sent':<40}{4 * args.pairs:>14}")
    print(f"{'received by the subscriber':<40}{burst['received']:>14}")
    print(f"{'lost, subscriber queue (reported)':<40}{burst['dropped']:>14}")
    print(f"{'lost, kernel ring buffer (reported)':<40}{burst['kernel_lost']:>14}")
    print(f"{'unaccounted':<40}{4 * args.pairs - accounted:>14}")
    print(f"{'delivered events/s (goal >= 100 000)':<40}{rate:>14.0f}")
    print(f"{'latency p50 ms (paced)':<40}{statistics.median(latencies_ms):>14.2f}")
    print(f"{'latency p99 ms (paced)':<40}{percentile(latencies_ms, 0.99):>14.2f}")
    print(f"{'paced events received / lost':<40}{paced['received']:>7} / "
          f"{paced['dropped'] + paced['kernel_lost']}")
    return 0 if accounted == 4 * args.pairs else 1


if __name__ == "__main__":
    sys.exit(main())
