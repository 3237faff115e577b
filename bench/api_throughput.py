"""Events per second the agent delivers to gRPC subscribers (separate processes), with every loss
accounted for, the agent's CPU, and probe-to-client latency (p50/p99).

Runs the real `kvtrace agent` (BPF + gRPC on a temporary Unix socket) as a subprocess, a stub
workload making cudaMalloc+cudaFree pairs (4 traced calls each), and subscriber processes (this
script with --subscriber) reading StreamEvents with EVENT_ENCODING_FIXED_COLUMNS (--encoding columns:
EVENT_ENCODING_COLUMNS, as clients before fixed columns; --encoding messages: one Event message each,
as clients before columns). Four runs:

  1. one subscriber, the workload unpaced;
  2. four subscribers at once, one of them slow (after every response it sleeps --slow-us per event
     received, so it reads at most 1e6 / slow-us events/s whatever the batch size): the
     others must be unaffected, and the slow one's losses reported as dropped_count markers;
  3. one subscriber, the workload paced (20 pairs / 10 ms): latency;
  4. one subscriber, the workload offering a steady load (--offered events/s, for --offered-seconds
     each): the highest offered rate delivered whole (nothing lost) and kept up with (received at
     >= 95 % of its rate) is the sustained throughput.

A subscriber's rate is the events it received over the time events arrived (first to last response
that carried events); when the ring overflowed, the marker that reports the loss comes later, and the
time to it is shown apart ("until accounted").

Each subscriber accounts for every event the workload made: received + dropped (its queue was full)
+ kernel-lost (the ring buffer was full) = sent, "unaccounted" must be 0. Needs root and bcc (as
`make test`); runs unchanged on any such host.

    sudo .venv/bin/python bench/api_throughput.py [--pairs 200000] [--workloads 1] [--latency-pairs 2000]
                                                  [--subscribers 4] [--slow-us 100]
                                                  [--encoding fixed|columns|messages]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "tests"), str(HERE.parent / "tests" / "integration")]

# Run 4: an offered load counts as sustained when nothing was lost and the subscriber received it at
# this fraction of its rate or more (the ring can hide a backlog for a few seconds, not a rate).
KEPT_UP = 0.95
LATENCY_SAMPLES = 200_000  # a subscriber keeps at most this many latencies (an even spread)


# ---- the subscriber process ----

def subscribe(socket: Path, pids: list[int], expected: int, slow_us: float, encoding: str,
              latencies: bool, deadline_s: float) -> dict:
    """Reads until every expected event is received or reported lost; the figures as a dict."""
    from kvtrace.client import AgentClient

    received = dropped = kernel_lost = foreign = responses = 0
    kinds: dict[int, int] = {}
    latencies_ns: list[int] = []
    first = last = first_event = last_event = None
    deadline = time.monotonic() + deadline_s
    cpu = time.process_time()
    with AgentClient.for_socket(socket, timeout_seconds=deadline_s) as client:
        stream = client.stream_responses(pids=pids, columns=encoding != "messages", fixed=encoding == "fixed")
        print("subscribed", flush=True)
        for response in stream:
            now_ns = time.time_ns()
            responses += 1
            for message in response.events:
                payload = message.WhichOneof("payload")
                if payload == "events_lost":
                    dropped += message.events_lost.dropped_count
                    kernel_lost += message.events_lost.kernel_lost_count
                elif payload == "allocation":  # an agent (or a request) without columns
                    received += 1
                    kinds[message.allocation.kind] = kinds.get(message.allocation.kind, 0) + 1
                    foreign += message.pid not in pids
                    if latencies:
                        latencies_ns.append(now_ns - message.timestamp_ns)
            columns = response.columns
            fixed = response.fixed_columns
            count = len(columns.kind) + len(fixed.timestamp_ns)
            if count:
                received += count
                column = list(columns.kind) if len(columns.kind) else fixed.kind  # bytes: one number each
                for kind in set(column):
                    kinds[kind] = kinds.get(kind, 0) + column.count(kind)
                column = list(columns.pid) + list(fixed.pid)
                foreign += count - sum(column.count(pid) for pid in pids)
                if latencies:
                    latencies_ns.extend(now_ns - timestamp for timestamp in columns.timestamp_ns)
                    latencies_ns.extend(now_ns - timestamp - fixed.timestamp_offset_ns
                                        for timestamp in fixed.timestamp_ns)
            first = first or time.monotonic()
            last = time.monotonic()
            if count or any(message.WhichOneof("payload") == "allocation" for message in response.events):
                first_event = first_event or last
                last_event = last
            if received + dropped + kernel_lost >= expected or last > deadline:
                break
            if slow_us:
                time.sleep(slow_us * (count + len(response.events)) / 1e6)
    if len(latencies_ns) > LATENCY_SAMPLES:
        latencies_ns = latencies_ns[::len(latencies_ns) // LATENCY_SAMPLES + 1]
    return dict(received=received, dropped=dropped, kernel_lost=kernel_lost, foreign=foreign,
                responses=responses, kinds={str(k): v for k, v in sorted(kinds.items())},
                seconds=(last - first) if first and last else 0.0,
                event_seconds=(last_event - first_event) if first_event and last_event else 0.0,
                cpu_seconds=time.process_time() - cpu,
                latencies_ns=latencies_ns, slow_us=slow_us)


def subscriber_main(args: argparse.Namespace) -> int:
    pids = [int(pid) for pid in args.pids.split(",")]
    result = subscribe(Path(args.subscriber), pids, args.expected, args.slow_us, args.encoding, args.latencies,
                       args.deadline_s)
    print(json.dumps(result), flush=True)
    return 0


# ---- the bench ----

class Subscriber:
    def __init__(self, socket: Path, pids: list[int], expected: int, slow_us: float, encoding: str,
                 latencies: bool) -> None:
        argv = [sys.executable, __file__, "--subscriber", str(socket), "--pids", ",".join(map(str, pids)), "--expected",
                str(expected), "--slow-us", str(slow_us)]
        argv += ["--encoding", encoding]
        argv += ["--latencies"] if latencies else []
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)

    def wait_subscribed(self) -> None:
        line = self.process.stdout.readline()
        if line.strip() != "subscribed":
            raise RuntimeError(f"subscriber failed to start: {line!r}")

    def result(self, timeout_s: float) -> dict:
        out, _ = self.process.communicate(timeout=timeout_s)
        return json.loads(out.strip().splitlines()[-1])


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(stubs, socket: Path, pairs: int, slow: list[float], encoding: str, env: dict | None = None,
        latencies: bool = False, workloads: int = 1) -> dict:
    """`pairs` pairs made by `workloads` processes at once (a share each), one subscriber process per entry
    of `slow` (its sleep per event received, µs; 0: reads as fast as it can) following all of them."""
    from agent_process import AgentProcess
    from cuda_stubs import Workload
    from kvtrace.client import AgentClient

    shares = [pairs // workloads + (index < pairs % workloads) for index in range(workloads)]
    expected = 4 * pairs
    with contextlib.ExitStack() as stack:
        makers = [stack.enter_context(Workload([stubs.workload, "loop", str(share)], env=env)) for share in shares]
        pids = [workload.wait_ready() for workload in makers]
        agent = stack.enter_context(AgentProcess(socket, *(arg for pid in pids for arg in ("-p", str(pid))),
                                                 "--no-python-stacks"))
        subscribers = [Subscriber(socket, pids, expected, slow_us, encoding, latencies) for slow_us in slow]
        for subscriber in subscribers:
            subscriber.wait_subscribed()
        with AgentClient.for_socket(socket) as client:  # every stream is registered with the hub
            deadline = time.monotonic() + 30
            while client.info().counters["subscribers"] < len(subscribers) and time.monotonic() < deadline:
                time.sleep(0.05)
        agent_pid = agent.process.pid
        cpu_before, started = cpu_seconds(agent_pid), time.monotonic()
        for workload in makers:
            workload.go()
        loops = [loop for workload in makers for loop in workload.read_calls(timeout_s=600)]
        if len(loops) != len(makers):
            raise RuntimeError(f"{len(makers)} workloads reported {len(loops)} loops: {loops}")
        workload_seconds = time.monotonic() - started
        results = [subscriber.result(600) for subscriber in subscribers]
        wall = time.monotonic() - started
        agent_cpu = cpu_seconds(agent_pid) - cpu_before
    # Each process's rate while it ran, summed: they start at one `go` and make equal shares.
    made = sum(4 * 1e9 / loop["ns_per_pair"] for loop in loops)
    return dict(subscribers=results, agent_cpu_seconds=agent_cpu, wall_seconds=wall, expected=expected,
                workload_seconds=workload_seconds, made_per_second=made, workloads=workloads)


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] if ordered else float("nan")


def report(title: str, outcome: dict) -> bool:
    """Prints a run's table; True when every subscriber accounted for every event."""
    expected = outcome["expected"]
    print(f"\n{title}")
    print(f"  events sent {expected}; workload {outcome['workload_seconds']:.2f} s "
          f"({outcome['made_per_second']:.0f} events/s made by {outcome['workloads']} process"
          f"{'es' if outcome['workloads'] > 1 else ''}); agent CPU "
          f"{outcome['agent_cpu_seconds']:.2f} s over {outcome['wall_seconds']:.2f} s "
          f"({100 * outcome['agent_cpu_seconds'] / outcome['wall_seconds']:.0f}% of a core)")
    print(f"  {'subscriber':<14}{'events/s':>10}{'received':>10}{'dropped':>10}{'kernel-lost':>12}"
          f"{'unaccounted':>12}{'foreign':>8}{'CPU s':>7}{'until accounted s':>19}")
    ok = True
    for index, result in enumerate(outcome["subscribers"]):
        unaccounted = expected - result["received"] - result["dropped"] - result["kernel_lost"]
        ok = ok and unaccounted == 0 and result["foreign"] == 0
        rate = result["received"] / result["event_seconds"] if result["event_seconds"] else 0.0
        name = f"#{index + 1}" + (f" slow {result['slow_us']:g}us" if result["slow_us"] else "")
        print(f"  {name:<14}{rate:>10.0f}{result['received']:>10}{result['dropped']:>10}"
              f"{result['kernel_lost']:>12}{unaccounted:>12}{result['foreign']:>8}{result['cpu_seconds']:>7.2f}"
              f"{result['seconds']:>19.2f}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=200_000, help="pairs in each throughput run")
    parser.add_argument("--latency-pairs", type=int, default=2_000, help="pairs in the paced run")
    parser.add_argument("--subscribers", type=int, default=4, help="subscribers in the second run")
    parser.add_argument("--slow-us", type=float, default=100.0,
                        help="the slow subscriber's sleep per event received (after each response)")
    parser.add_argument("--offered", default="50000,100000,150000,200000",
                        help="run 4: offered loads, events/s, comma-separated")
    parser.add_argument("--offered-seconds", type=float, default=4.0, help="run 4: seconds of each offered load")
    parser.add_argument("--workloads", type=int, default=1,
                        help="runs 1 and 4: processes making the pairs at once (a share each; one stub process "
                             "makes ~120-180k events/s on the H200, less than the agent takes in)")
    parser.add_argument("--encoding", choices=("fixed", "columns", "messages"), default="fixed",
                        help="how subscribers ask for events: fixed columns (default), columns (clients before "
                             "fixed columns) or one Event message each (clients before columns)")
    parser.add_argument("--subscriber", help=argparse.SUPPRESS)  # SOCKET: run as a subscriber process
    parser.add_argument("--pids", help=argparse.SUPPRESS)
    parser.add_argument("--expected", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--latencies", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--deadline-s", type=float, default=600.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.subscriber:
        return subscriber_main(args)
    if not 1 <= args.workloads <= args.pairs:
        parser.error("--workloads takes 1 to --pairs")
    if os.geteuid() != 0:
        print("run as root: the agent loads BPF", file=sys.stderr)
        return 3
    from cuda_stubs import build_stubs

    work = Path(tempfile.mkdtemp(prefix="kvtrace-bench-"))
    stubs = build_stubs(work / "stubs")
    encoding = args.encoding

    print(f"1: {args.pairs} pairs = {4 * args.pairs} events, unpaced, {args.workloads} workload process(es), "
          f"one subscriber ({encoding})", file=sys.stderr)
    single = run(stubs, work / "a.sock", args.pairs, [0.0], args.encoding, workloads=args.workloads)
    slow = [0.0] * (args.subscribers - 1) + [args.slow_us]
    print(f"2: the same, {args.subscribers} subscribers, one slow", file=sys.stderr)
    several = run(stubs, work / "b.sock", args.pairs, slow, args.encoding)
    print(f"3: {args.latency_pairs} pairs paced at 20 pairs / 10 ms, one subscriber", file=sys.stderr)
    paced_env = dict(os.environ, KVT_LOOP_PAUSE_EVERY="20", KVT_LOOP_PAUSE_MS="10")
    paced = run(stubs, work / "c.sock", args.latency_pairs, [0.0], args.encoding, paced_env, latencies=True)

    ok = report(f"1: one subscriber ({encoding}; goal >= 100 000 events/s)", single)
    ok = report(f"2: {args.subscribers} subscribers at once, one slow ({encoding}; the others unaffected)",
                several) and ok
    ok = report("3: paced, one subscriber", paced) and ok
    latencies_ms = [ns / 1e6 for ns in paced["subscribers"][0]["latencies_ns"]]
    print(f"  latency p50 / p99 ms: {statistics.median(latencies_ms) if latencies_ms else float('nan'):.2f} / "
          f"{percentile(latencies_ms, 0.99):.2f}")
    ok = sustained(stubs, work, args) and ok
    return 0 if ok else 1


def sustained(stubs, work: Path, args) -> bool:
    """Run 4: steady offered loads, one subscriber; the highest delivered whole is the figure."""
    print("\n4: one subscriber, steady offered load (goal: >= 100 000 events/s delivered whole)")
    print(f"  {'offered/s':>10}{'made/s':>10}{'received':>10}{'lost':>8}{'delivered/s':>13}{'agent CPU':>11}")
    ok, whole = True, []
    for index, offered in enumerate(int(rate) for rate in args.offered.split(",")):
        pairs = int(offered / 4 * args.offered_seconds)
        env = dict(os.environ, KVT_LOOP_PAIRS_PER_SECOND=str(offered / 4 / args.workloads))
        outcome = run(stubs, work / f"d{index}.sock", pairs, [0.0], args.encoding, env, workloads=args.workloads)
        (result,) = outcome["subscribers"]
        lost = result["dropped"] + result["kernel_lost"]
        ok = ok and outcome["expected"] == result["received"] + lost and result["foreign"] == 0
        delivered = result["received"] / result["event_seconds"] if result["event_seconds"] else 0.0
        print(f"  {offered:>10}{outcome['made_per_second']:>10.0f}{result['received']:>10}{lost:>8}"
              f"{delivered:>13.0f}{100 * outcome['agent_cpu_seconds'] / outcome['wall_seconds']:>10.0f}%",
              flush=True)
        if lost == 0 and delivered >= KEPT_UP * offered:
            whole.append(offered)
    best = max(whole, default=0)
    print(f"  sustained (the highest offered load delivered whole, at >= {KEPT_UP:.0%} of its rate): {best} events/s "
          f"({'met' if best >= 100_000 else 'MISSED'})")
    return ok


if __name__ == "__main__":
    sys.exit(main())
