"""The vLLM plugin's listener under one user's flood (issue 31, attack 4): CPU per flood message, and whether a
real engine's sender state and KV layout survive.

    sudo PYTHONPATH=agent .venv/bin/python bench/plugin_flood.py [--processes 300] [--messages 40]

Live processes (`sleep`) stand for the flood's senders so the listener's sweeps see them alive; their reports go
straight into VllmListener.handle_datagram (the kernel's pid and uid as the socket would give them), round robin,
`--messages` each, while an engine (this process, root) sent its layout once and reports once per round. The
datagram path itself (the kernel's queue, recvmsg) is left out: on a loaded 2-core VM the senders' scheduling, not
the listener, decides how many datagrams arrive, and this measures what the listener does with each one. Runs with
the code on PYTHONPATH: point it at an older tree (`git archive`) for the figure before.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import tempfile
import time

from kvtrace.session import Session
from kvtrace.sources.vllm.listener import VllmListener

NOBODY = 65534


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=300)
    parser.add_argument("--messages", type=int, default=40, help="reports per flooding process")
    args = parser.parse_args()
    report = json.dumps({"v": 1, "type": "scheduler", "blocks_total": 1000, "blocks_free": 900, "running": 0,
                         "waiting": 0, "allocated_total": 30, "freed_total": 20,
                         "requests": [[f"fake-{index}", "aborted", 1, 100.0] for index in range(64)]}).encode()
    layout = json.dumps({"v": 1, "type": "kv_cache", "device": 0, "tensors": [[1 << 40, 64 << 20]],
                         "num_blocks": 1001, "page_size_bytes": 65536, "block_size": 16}).encode()
    engine_report = json.dumps({"v": 1, "type": "scheduler", "blocks_total": 1000, "blocks_free": 990,
                                "running": 0, "waiting": 0, "allocated_total": 30, "freed_total": 20,
                                "requests": []}).encode()
    directory = tempfile.mkdtemp(prefix="kvf", dir="/tmp")
    session = Session()
    listener = VllmListener(session, os.path.join(directory, "v.sock"))
    with_uid = "uid" in inspect.signature(listener.handle_datagram).parameters

    def send(data: bytes, pid: int, uid: int) -> None:
        if with_uid:
            listener.handle_datagram(data, pid, uid=uid)
        else:
            listener.handle_datagram(data, pid)

    flood = [subprocess.Popen(["sleep", "600"]) for _ in range(args.processes)]
    engine = os.getpid()
    try:
        send(layout, engine, 0)
        send(engine_report, engine, 0)
        cpu = time.process_time()
        wall = time.monotonic()
        for _ in range(args.messages):
            for process in flood:
                send(report, process.pid, NOBODY)
            send(engine_report, engine, 0)
        cpu = time.process_time() - cpu
        wall = time.monotonic() - wall
        view = session.vllm_view()
        messages = args.processes * args.messages
        print(f"{args.processes} processes x {args.messages} reports ({messages}): {cpu / messages * 1e6:.1f} µs of "
              f"CPU a flood message, {messages / cpu:,.0f} messages a CPU-second; wall {wall:.2f} s")
        print(f"engine followed: {engine in listener._senders}; its scheduler report kept: "
              f"{engine in view.schedulers}; its layout kept: {engine in view.layouts}")
        print(f"senders followed {len(listener._senders)}, nobody's records kept {len(view.schedulers) - 1}; "
              f"rejected {listener.rejected}")
    finally:
        for process in flood:
            process.kill()
            process.wait()
        os.rmdir(directory)


if __name__ == "__main__":
    main()
