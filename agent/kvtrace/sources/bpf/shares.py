"""Shares: what one party may hold of what every process shares, and the bounds of figures a process chooses.

The kernel's ledger, its totals map and the records that count them are one pool for the whole host; a loop
in one user's program (a `cuMemAlloc_v2` of its own that returns made-up addresses) would fill them for
everybody. So each has a share per user, and a reserve the others keep (probes/shares.h enforces it):

- one user (any uid but 0) may hold a quarter of a map: a user filling its share leaves three quarters;
- every user but root together may hold half: root's workloads keep half whatever the users do;
- root may hold three quarters: a runaway root process leaves a quarter to the users.

A party whose share is full is refused, counted per process and per user (not stored, no event), and named
(`kvtrace doctor`, /metrics, the `shares` component); the others go on. Library slots (targets.py) have a
share per user too (`library_share`: a user's libraries a quarter of --max-libraries, every user's but root's
together half; a library a root process maps waits only for the limit).

Figures a process chooses are bounded where they enter: device ordinals to [0, MAX_DEVICES) (else unknown),
and sizes to `max_object_bytes` of the ledger (the ledger's size times it stays below 2^62, so no total can
wrap); both counted.
"""
from __future__ import annotations

import ctypes
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from kvtrace.model.agent import PartyShare
from kvtrace.session import Session

MAX_DEVICES = 64  # KVT_MAX_DEVICES (probes/kvtrace.h)
UID_USERS = 0xFFFF_FFFF  # KVT_UID_USERS: the record of every user but root together
MAX_SHARED_PIDS = 65536  # processes with a share record at once (KVT_MAX_SHARED_PIDS)
MAX_SHARED_UIDS = 4096  # users with a share record (KVT_MAX_SHARED_UIDS)
NAMED_PARTIES = 5  # refused parties named in health and labelled on /metrics; the rest are summed


@dataclass(frozen=True, slots=True)
class Share:
    """What one user, root, and every user but root together may hold of a map of `capacity` entries, each rounded
    down to a whole number of `batch`es (what the probes charge at a time: ledger_share)."""

    capacity: int
    batch: int = 1

    def _whole(self, entries: int) -> int:
        return entries // self.batch * self.batch

    @property
    def user(self) -> int:
        return self._whole(self.capacity // 4)

    @property
    def root(self) -> int:
        return self._whole(self.capacity * 3 // 4)

    @property
    def users(self) -> int:
        return self._whole(self.capacity // 2)

    def of(self, uid: int) -> int:
        return self.root if uid == 0 else self.user


def library_share(max_libraries: int) -> Share:
    """Library slots (--max-libraries) by the same rule: a user's libraries take at most a quarter."""
    return Share(max_libraries)


def max_object_bytes(max_ledger_entries: int) -> int:
    """The largest size a ledger entry keeps: the largest power of two whose product with the ledger's size
    stays at most 2^62 (4 TiB only at the default 1 048 576 entries: more than any device or host holds in one
    allocation; 64 GiB at 2^26 entries, the largest ledger, which a real allocation can pass)."""
    return 1 << ((1 << 62) // max(1, max_ledger_entries)).bit_length() - 1


def share_batch(max_ledger_entries: int) -> int:
    """Ledger entries a process is charged to its user at a time (probes/shares.h share_take): 64, or less for a
    small ledger (a power of two, at most a 64th of it; ledger_share rounds each share down to whole batches)."""
    return 1 << (min(64, max(1, max_ledger_entries // 64)).bit_length() - 1)


def ledger_share(max_ledger_entries: int) -> Share:
    """The shares of the kernel's ledger: whole numbers of batches (share_take charges a batch at a time and refuses
    one that would pass the share, so a share of 1000 entries in batches of 64 would hold 960 at most)."""
    return Share(max_ledger_entries, share_batch(max_ledger_entries))


def share_cflags(max_ledger_entries: int, max_totals: int) -> list[str]:
    """The -D flags of probes/settings.h's shares."""
    flags = []
    for name, share in (("LEDGER", ledger_share(max_ledger_entries)), ("TOTALS", Share(max_totals)),
                        ("PIDS", Share(MAX_SHARED_PIDS))):
        flags += [f"-DKVT_SHARE_USER_{name}={share.user}", f"-DKVT_SHARE_ROOT_{name}={share.root}",
                  f"-DKVT_SHARE_USERS_{name}={share.users}"]
    return flags + [f"-DKVT_SHARE_BATCH={share_batch(max_ledger_entries)}",
                    f"-DKVT_MAX_SHARED_PIDS={MAX_SHARED_PIDS}", f"-DKVT_MAX_SHARED_UIDS={MAX_SHARED_UIDS}",
                    f"-DKVT_MAX_OBJECT_BYTES={max_object_bytes(max_ledger_entries)}"]


class RawShare(ctypes.Structure):
    """struct kvt_share (probes/kvtrace.h)."""

    _fields_ = [
        ("ledger_entries", ctypes.c_int64),
        ("totals_keys", ctypes.c_int64),
        ("refused_entries", ctypes.c_uint64),
        ("refused_totals", ctypes.c_uint64),
        ("charged", ctypes.c_int64),
        ("uid", ctypes.c_uint32),
        ("pids", ctypes.c_uint32),
    ]


def decode_shares(items: Iterable[tuple[int, RawShare]], by_pid: bool) -> list[PartyShare]:
    """(key, struct kvt_share) pairs of pid_shares (`by_pid`) or uid_shares, without the all-users record."""
    return [PartyShare(uid=value.uid, pid=key if by_pid else 0, ledger_entries=max(0, value.ledger_entries),
                       totals_keys=max(0, value.totals_keys), refused_entries=value.refused_entries,
                       refused_totals=value.refused_totals)
            for key, value in items if by_pid or key != UID_USERS]


def refused_parties(users: list[PartyShare]) -> list[PartyShare]:
    """The users refused anything, most refused first."""
    return sorted((user for user in users if user.refused), key=lambda user: (-user.refused, user.uid))


def shares_reason(users: list[PartyShare], processes: list[PartyShare], ledger: Share, totals: Share,
                  titles: Mapping[int, str]) -> str:
    """The `shares` component's reason ("" while nobody was refused): the refused users, each with its
    holding and its most refused processes (NAMED_PARTIES of each at most)."""
    refused = refused_parties(users)
    if not refused:
        return ""
    parts = []
    for user in refused[:NAMED_PARTIES]:
        mine = sorted((process for process in processes if process.uid == user.uid and process.refused),
                      key=lambda process: (-process.refused, process.pid))
        named = ", ".join(f"pid {process.pid}" + (f" ({titles[process.pid]})" if titles.get(process.pid) else "")
                          for process in mine[:NAMED_PARTIES])
        parts.append(
            f"uid {user.uid} holds {user.ledger_entries} of its {ledger.of(user.uid)} ledger entries and "
            f"{user.totals_keys} of its {totals.of(user.uid)} totals keys: {user.refused_entries} allocations "
            f"counted, not stored" + (f", {user.refused_totals} totals refused" if user.refused_totals else "")
            + (f"; by {named}" if named else ""))
    more = len(refused) - NAMED_PARTIES
    return ("; ".join(parts) + (f"; and {more} more users" if more > 0 else "")
            + ": only they are degraded (their own allocations untraced); stop the process, or raise "
              "--max-ledger-entries / --max-totals if the load is real")


class ShareReader(Protocol):
    def read_shares(self, by_pid: bool) -> list[tuple[int, RawShare]]: ...


# The processes' records (up to MAX_SHARED_PIDS, one system call each) are read at most this often, and only
# while some user is refused: the event loop turns within a second during an attack.
PROCESS_READ_SECONDS = 5.0
# A refused user is degraded while it holds its share, and this long after its last refusal; its counts stay on
# /metrics (they only grow).
DEGRADED_SECONDS = 60.0


class ShareWatch:
    """Reads who the probes refused (uid_shares at every report, pid_shares now and then while a user is
    refused) and tells the Session: the refused parties (/metrics) and the `shares` component (doctor)."""

    def __init__(self, maps: ShareReader, session: Session, max_ledger_entries: int, max_totals: int) -> None:
        self._maps, self._session = maps, session
        self._ledger, self._totals = ledger_share(max_ledger_entries), Share(max_totals)
        self._processes: list[PartyShare] = []
        self._processes_read = -PROCESS_READ_SECONDS
        self._refused_seen = 0
        self._refused_at: dict[int, tuple[int, float]] = {}  # uid -> (its refusals, when they last grew)

    def report(self, now: float) -> None:
        users = refused_parties(decode_shares(self._maps.read_shares(False), by_pid=False))
        refused = sum(user.refused for user in users)
        for user in users:
            if self._refused_at.get(user.uid, (0, 0.0))[0] != user.refused:
                self._refused_at[user.uid] = (user.refused, now)
        degraded = [user for user in users if now - self._refused_at[user.uid][1] < DEGRADED_SECONDS
                    or user.ledger_entries >= self._ledger.of(user.uid)
                    or user.totals_keys >= self._totals.of(user.uid)]
        if not users:
            self._processes = []
        elif refused != self._refused_seen and now - self._processes_read >= PROCESS_READ_SECONDS:
            self._processes = [process for process in decode_shares(self._maps.read_shares(True), by_pid=True)
                               if process.refused]
            self._processes_read, self._refused_seen = now, refused
        titles = {}
        for process in self._processes:
            info = self._session.process(process.pid)
            if info is not None:
                titles[process.pid] = info.title
        self._session.report_shares([*users, *self._processes])
        reason = shares_reason(degraded, self._processes, self._ledger, self._totals, titles)
        self._session.report_component("shares", not reason, reason)
