"""Stream slots under idle streams that never read, on a quiet host (issue 31, attack 5), with the default limits.

    PYTHONPATH=agent .venv/bin/python bench/stream_slots.py [--streams 64]

The real AgentServer on a Session with no source and no events (a quiet host: nothing fills gRPC's windows).
`--streams` streams on the group socket, a connection each, that never read, take every group slot. Then:
root's stream on the admin socket (the time until the agent serves it); and, once they have been quiet for
probe_quiet_seconds, a new group stream (the time until a stream that does not read is found, ended and its
slot handed over). Runs as root (uid 0 is held to no connection share: the idle streams all stay).
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import grpc

from kvtrace._proto.kvtrace.v1 import agent_service_pb2 as service_pb2
from kvtrace._proto.kvtrace.v1 import agent_service_pb2_grpc as service_grpc
from kvtrace.analysis.analyzer import Analyzer
from kvtrace.config import ApiConfig
from kvtrace.servers.api.requests import ServerLimits
from kvtrace.servers.api.server import AgentServer
from kvtrace.session import Session


def stream(path: Path) -> tuple[grpc.Channel, grpc.Future]:
    channel = grpc.insecure_channel(f"unix:{path}", [("grpc.use_local_subchannel_pool", 1)])
    return channel, service_grpc.AgentServiceStub(channel).StreamEvents(service_pb2.StreamEventsRequest(), timeout=300)


def wait_for(condition, timeout_seconds: float) -> float:
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout_seconds:
            raise SystemExit("timed out")
        time.sleep(0.005)
    return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=64)
    args = parser.parse_args()
    limits = ServerLimits()
    directory = Path(tempfile.mkdtemp(prefix="kvb", dir="/tmp"))
    session = Session()
    server = AgentServer(session, Analyzer(session), ApiConfig(socket=directory / "run" / "kvtrace.sock",
                                                               group="root"), limits)
    session.add_sink(server.hub)
    server.start()
    opened = []
    try:
        opened = [stream(server.config.socket) for _ in range(args.streams)]
        wait_for(lambda: len(server.group_slots) == min(args.streams, limits.max_streams), 60)
        admin_path = server.config.admin_path
        assert admin_path is not None
        channel, call = stream(admin_path)
        opened.append((channel, call))
        admin = wait_for(lambda: len(server.slots) == 1, 30)
        print(f"{args.streams} idle group streams: root's stream on the admin socket served in {admin * 1000:.0f} ms")
        time.sleep(limits.probe_quiet_seconds)
        cpu = time.process_time()
        channel, newcomer = stream(server.config.socket)
        opened.append((channel, newcomer))
        ended: list = []

        def read() -> None:
            try:
                for _ in newcomer:
                    pass
            except grpc.RpcError as error:
                ended.append(error.code())

        threading.Thread(target=read, daemon=True).start()
        found = wait_for(lambda: server.group_slots.evicted_total == 1 or ended, 60)
        cpu = time.process_time() - cpu
        print(f"after {limits.probe_quiet_seconds:g} s quiet, a new group stream: a stream that does not read "
              f"found and ended in {found:.2f} s (probes {server.group_slots.probes_total}, agent CPU {cpu:.2f} s); "
              f"the newcomer refused: {ended}")
    finally:
        for channel, _ in opened:
            channel.close()
        server.stop(grace_seconds=0)
        shutil.rmtree(directory, ignore_errors=True)
        os.sync()


if __name__ == "__main__":
    main()
