"""Who is connected to a Unix socket the agent serves, by the kernel's word, and a share of connections per user.

gRPC cannot tell Unix peers apart (every call's peer is "unix:"), so the group socket's shares per user are
held underneath it: the agent's own accepted sockets for that path (psutil lists them with their descriptors)
carry the peer's credentials (SO_PEERCRED, the kernel's, as at connect). A user with more connections than its
share loses the newest ones (shut down under gRPC, which ends their calls), counted and named
(model/user_shares.py: kvtrace_share_refused_total{resource="group_connections"}). With the server's
per-connection limit on concurrent streams (ServerLimits.max_streams_per_connection), one user then holds at
most max_group_connections_per_user x max_streams_per_connection of the group socket's stream slots. Root is
not held to a share: it administers the host (and has the admin socket's slots besides).
"""
from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass

import psutil

from kvtrace.model.user_shares import UserShares

log = logging.getLogger(__name__)

_UCRED = struct.Struct("iII")  # struct ucred: pid, uid, gid (sources/unix_socket.UCRED: servers import no source)
SCAN_INTERVAL_SECONDS = 0.2  # at most this often: a burst of calls costs one scan
RESOURCE = "group_connections"


@dataclass(frozen=True)
class Peer:
    fd: int  # the agent's descriptor of the accepted socket (gRPC's)
    pid: int
    uid: int
    inode: int = 0  # the socket's: tells a connection from a later one on the same descriptor


def peers_of(path: str) -> list[Peer]:
    """The processes connected to the Unix socket the agent listens on at `path`, one per connection."""
    peers = []
    try:
        connections = psutil.Process().net_connections(kind="unix")
    except psutil.Error as error:
        log.debug("cannot list the agent's sockets: %s", error)
        return []
    for connection in connections:
        if connection.laddr != path or connection.fd < 0:
            continue
        try:
            with socket.fromfd(connection.fd, socket.AF_UNIX, socket.SOCK_STREAM) as sock:  # a duplicate
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    continue  # the listening socket itself
                pid, uid, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
                inode = os.fstat(sock.fileno()).st_ino
        except OSError:
            continue  # closed in between
        peers.append(Peer(connection.fd, pid, uid, inode))
    return peers


class ConnectionShares:
    """At most `per_user` connections per user on the socket at `path`; the newest beyond that are shut down."""

    def __init__(self, path: str, per_user: int) -> None:
        self.path = path
        self.shares = UserShares(RESOURCE, capacity=1 << 30, per_user=per_user, noun="connections")
        self._lock = threading.Lock()
        self._next_scan = 0.0
        self._ended: set[int] = set()  # inodes of connections shut down, until gRPC has closed them

    def enforce(self) -> int:
        """Shuts down each user's connections beyond its share; how many. At most once per SCAN_INTERVAL_SECONDS."""
        with self._lock:
            now = time.monotonic()
            if now < self._next_scan:
                return 0
            self._next_scan = now + SCAN_INTERVAL_SECONDS
            by_user: dict[int, list[Peer]] = {}
            found = peers_of(self.path)
            self._ended &= {peer.inode for peer in found}
            for peer in found:
                if peer.inode not in self._ended:
                    by_user.setdefault(peer.uid, []).append(peer)
            ended = 0
            self.shares.held.clear()
            for uid, peers in by_user.items():
                if uid == 0:
                    continue  # root: the host's administrator (and the admin socket is its own anyway)
                self.shares.held[uid] = min(len(peers), self.shares.per_user)
                # The oldest stay: a socket's inode is numbered as it is made, so the lowest were accepted first
                # (not the lowest descriptors: gRPC closes and reuses them).
                for peer in sorted(peers, key=lambda peer: peer.inode)[self.shares.per_user:]:
                    if not _shut_down(peer):
                        continue
                    self._ended.add(peer.inode)
                    self.shares.refuse(uid)
                    ended += 1
            if ended:
                log.warning("group socket: ended %d connections of users over their share of %d (%s)", ended,
                            self.shares.per_user, self.shares.describe())
            return ended


def _shut_down(peer: Peer) -> bool:
    """Shuts down the connection `peer` names, if its descriptor still holds that socket: since the scan gRPC
    may have closed the descriptor and given the number to another connection (another user's, root's)."""
    try:
        with socket.fromfd(peer.fd, socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            if os.fstat(sock.fileno()).st_ino != peer.inode:
                return False  # reused: not the connection found over its share
            sock.shutdown(socket.SHUT_RDWR)  # the connection, not only our duplicate
    except OSError:
        return False
    return True
