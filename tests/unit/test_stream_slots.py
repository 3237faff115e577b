"""Issue 31, attack 5: stream slots per socket, shares per user on the group socket, and streams that do not
read found on a quiet host (servers/api/slots.py, peers.py).

GIVEN the real gRPC server on a fake agent with no events at all (a quiet host: nothing fills gRPC's windows),
WHEN the group socket's slots are taken by streams that never read, THEN root's stream on the admin socket
starts at once; a new group stream probes the quiet ones and takes the place of one that does not read
(ended with RESOURCE_EXHAUSTED, why), while streams that read pass their probe and stay; a user's connections
beyond its share end, counted and named."""
import os
import socket
import threading
import time

import grpc

from fake_agent import served
from kvtrace._proto.kvtrace.v1 import agent_service_pb2 as service_pb2
from kvtrace._proto.kvtrace.v1 import agent_service_pb2_grpc as service_grpc
from kvtrace.servers.api import peers as peers_module
from kvtrace.servers.api.peers import ConnectionShares, Peer
from kvtrace.servers.api.requests import ServerLimits
from kvtrace.servers.api.slots import PROBE_MESSAGE_BYTES, probe_response

QUIET = ServerLimits(max_streams=3, probe_quiet_seconds=0.5, probe_stall_seconds=1.0, probe_wait_seconds=5.0)


def wait_for(condition, timeout_seconds=10.0):
    deadline = time.monotonic() + timeout_seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def stream(path, **options):
    """A stream on its own connection (a local subchannel pool), and its channel."""
    channel = grpc.insecure_channel(f"unix:{path}", [("grpc.use_local_subchannel_pool", 1), *options.items()])
    return channel, service_grpc.AgentServiceStub(channel).StreamEvents(service_pb2.StreamEventsRequest(), timeout=60)


def read_in_background(call, ended):
    def read():
        try:
            for _ in call:
                pass
        except grpc.RpcError as error:
            ended.append((error.code(), error.details()))
    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def test_the_probe_is_an_empty_response_to_any_reader():
    response = probe_response(service_pb2.VIEW_REDACTED)
    data = response.SerializeToString()
    assert PROBE_MESSAGE_BYTES < len(data) < PROBE_MESSAGE_BYTES + 16
    parsed = service_pb2.StreamEventsResponse.FromString(data)
    assert (list(parsed.events), parsed.view) == ([], service_pb2.VIEW_REDACTED)


def test_root_gets_its_stream_on_the_admin_socket_while_the_group_socket_is_full():
    with served(limits=QUIET) as (server, backend):
        idle = [stream(server.config.socket) for _ in range(3)]
        wait_for(lambda: len(server.group_slots) == 3)
        started = time.monotonic()
        channel, call = stream(server.config.admin_path)
        wait_for(lambda: len(server.slots) == 1)
        elapsed = time.monotonic() - started
        print(f"\nroot's stream on the admin socket with the group socket full: {elapsed * 1000:.0f} ms")
        assert elapsed < 1.0 and server.group_slots.evicted_total == 0
        for each in [*idle, (channel, call)]:
            each[0].close()


def test_a_quiet_stream_that_does_not_read_is_found_by_its_probe_and_gives_way():
    """Three group streams on a host with no events: two never read, one reads. A fourth comes: the quiet ones
    are probed, the reader passes, a non-reader blocks and is ended for the newcomer."""
    with served(limits=QUIET) as (server, backend):
        silent = [stream(server.config.socket) for _ in range(2)]
        reader_channel, reader = stream(server.config.socket)
        reader_ended: list = []
        read_in_background(reader, reader_ended)
        wait_for(lambda: len(server.group_slots) == 3)
        time.sleep(QUIET.probe_quiet_seconds)
        started = time.monotonic()
        channel, newcomer = stream(server.config.socket)
        newcomer_ended: list = []
        read_in_background(newcomer, newcomer_ended)
        wait_for(lambda: server.group_slots.evicted_total == 1, timeout_seconds=QUIET.probe_wait_seconds + 2)
        wait_for(lambda: len(server.group_slots) == 3)
        elapsed = time.monotonic() - started
        print(f"\na quiet stream that does not read found and ended in {elapsed:.2f} s")
        assert elapsed < QUIET.probe_wait_seconds
        assert server.group_slots.probes_total == 3 and server.group_slots.refused_total == 0
        assert reader_ended == [] and newcomer_ended == []  # the reader passed its probe; the newcomer is served
        ended: list = []
        for _, call in silent:  # only now do the silent clients read: one was ended, and why
            read_in_background(call, ended)
        wait_for(lambda: ended)
        [(code, details)] = ended
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and "you did not read for" in details
        for each in [*silent, (reader_channel, reader), (channel, newcomer)]:
            each[0].close()


def test_streams_that_read_pass_their_probe_and_the_newcomer_is_refused():
    with served(limits=QUIET) as (server, backend):
        readers = [stream(server.config.socket) for _ in range(3)]
        ended: list = []
        for _, call in readers:
            read_in_background(call, ended)
        wait_for(lambda: len(server.group_slots) == 3)
        time.sleep(QUIET.probe_quiet_seconds)
        channel, newcomer = stream(server.config.socket)
        refused: list = []
        read_in_background(newcomer, refused).join(QUIET.probe_wait_seconds + 3)
        assert [code for code, _ in refused] == [grpc.StatusCode.RESOURCE_EXHAUSTED]
        assert "all of them reading (root: the admin socket has slots of its own)" in refused[0][1]
        assert (server.group_slots.probes_total, server.group_slots.evicted_total) == (3, 0) and ended == []
        for each in [*readers, (channel, newcomer)]:
            each[0].close()


def test_a_users_connections_beyond_its_share_are_shut_down_counted_and_named(tmp_path, monkeypatch):
    path = str(tmp_path / "g.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    clients = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(7)]
    for client in clients:
        client.connect(path)
    accepted = [listener.accept()[0] for _ in clients]
    real = peers_module.peers_of
    found = real(path)
    assert sorted(peer.fd for peer in found) == sorted(sock.fileno() for sock in accepted)
    assert {peer.pid for peer in found} == {os.getpid()}
    # As if 5 of them were user 4242's (this test may not run as another user) and 2 root's:
    uid_of = {sock.fileno(): 4242 if index < 5 else 0 for index, sock in enumerate(accepted)}
    monkeypatch.setattr(peers_module, "peers_of", lambda p: [Peer(peer.fd, peer.pid, uid_of[peer.fd], peer.inode)
                                                              for peer in real(p)])
    shares = ConnectionShares(path, per_user=2)
    assert shares.enforce() == 3
    ended = []
    for index, client in enumerate(clients):
        client.settimeout(0.2)
        try:
            if client.recv(1) == b"":
                ended.append(index)
        except TimeoutError:
            pass
    assert ended == [2, 3, 4]  # the newest 3 of user 4242's; root's are not held to a share
    assert shares.shares.counters() == {"share_refused/group_connections/4242": 3}
    assert shares.shares.describe() == ("3 refused for want of a share (4242 3); last: user 4242 (uid 4242), "
                                        "user 4242 holds 2 connections, its share of 2")
    time.sleep(peers_module.SCAN_INTERVAL_SECONDS)
    assert shares.enforce() == 0  # those shut down are not counted again while gRPC has yet to close them
    for sock in [*clients, *accepted, listener]:
        sock.close()


def test_a_descriptor_reused_since_the_scan_is_not_shut_down(tmp_path):
    """gRPC may close a connection found over its share and give its descriptor to another (root's): the
    connection shut down must be the one scanned, by its inode, never what now holds the number."""
    first, other = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    scanned = Peer(first.fileno(), os.getpid(), 4242, os.fstat(first.fileno()).st_ino)
    reused = Peer(first.fileno(), os.getpid(), 4242, scanned.inode + 1)
    assert not peers_module._shut_down(reused)
    other.settimeout(0.2)
    try:
        other.recv(1)
        raise AssertionError("shut down the connection that reused the descriptor")
    except TimeoutError:
        pass
    assert peers_module._shut_down(scanned)
    assert other.recv(1) == b""
    first.close()
    other.close()
