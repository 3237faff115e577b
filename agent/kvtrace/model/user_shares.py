"""Shares per user of what local processes can fill: places no user may take from the others.

The listeners of the sockets any local process may reach (the vLLM plugin's, the CUPTI tracers') and the
API's group socket hold a bounded number of parties (senders, connections, streams). A common pool lets
one user fill it and lock everybody out; a share per user (the user is the kernel's: SO_PEERCRED or
SCM_CREDENTIALS, never a message's) keeps the rest for the others. When a user's share is full, that user
alone is refused, counted and named: `kvtrace doctor` (the component's reason), /metrics
(kvtrace_share_refused_total{resource, user}, at most MAX_NAMED_USERS users named and the rest as "other",
so the label set stays small whoever connects).
"""
from __future__ import annotations

import pwd
from collections import Counter
from dataclasses import dataclass

MAX_NAMED_USERS = 8  # users named in the refusals' label; the rest count as OTHER_USER
OTHER_USER = "other"
# Refusals because the whole pool was held while the user was within its share: no user's share is at fault,
# so none is named (counted apart, in no user's series).
POOL_FULL = "(pool full)"
# Session counters carry refusals as SHARE_COUNTER_PREFIX + "<resource>/<user>" (servers/metrics.py labels them).
SHARE_COUNTER_PREFIX = "share_refused/"


def user_name(uid: int) -> str:
    """The name of `uid` from the user database, else the number (a container's user, a deleted one)."""
    try:
        return pwd.getpwuid(uid).pw_name
    except (KeyError, OverflowError):
        return str(uid)


class UserLabels:
    """A user's name in a refusals' label, for good: its own for the first MAX_NAMED_USERS users refused,
    OTHER_USER for every later one. Stable, so each series of a counter only grows (a ranking that changes
    would drop series and let "other" go down)."""

    def __init__(self) -> None:
        self._labels: dict[int, str] = {}  # uid -> its label, once named
        self._named = 0

    def __call__(self, uid: int) -> str:
        known = self._labels.get(uid)
        if known is None:
            known = self._labels[uid] = user_name(uid) if self._named < MAX_NAMED_USERS else OTHER_USER
            self._named += known != OTHER_USER
        return known


@dataclass
class UserShares:
    """How many of `capacity` places each user holds, at most `per_user` each, and who was refused.

    A user at its share is refused whatever room is left: the other users' places (capacity - per_user at
    least) are their reserve. The caller counts holders in and out (`take`, `give_back`) and asks `admits`
    before taking; `refuse` counts a refusal against the user."""

    resource: str  # what the places are, in the metric's label and messages: "vllm_senders", "group_connections"
    capacity: int
    per_user: int
    noun: str = "places"  # "senders", "connections", "streams": how a message names one place

    def __post_init__(self) -> None:
        if not 0 < self.per_user <= self.capacity:
            raise ValueError(f"a user's share ({self.per_user}) must be from 1 to the capacity ({self.capacity})")
        self.held: Counter[int] = Counter()  # uid -> places held
        self.total = 0
        self.refused_total = 0
        self.refused: Counter[str] = Counter()  # user label -> refusals (MAX_NAMED_USERS, OTHER_USER, POOL_FULL)
        self.last_refused_uid: int | None = None
        self._labels = UserLabels()

    def admits(self, uid: int) -> bool:
        return self.held[uid] < self.per_user and self.total < self.capacity

    def full_for(self, uid: int) -> str:
        """Why `uid` is not admitted now, one line ("" when it is)."""
        if self.held[uid] >= self.per_user:
            return f"user {self.label(uid)} holds {self.held[uid]} {self.noun}, its share of {self.per_user}"
        if self.total >= self.capacity:
            return f"all {self.capacity} {self.noun} are held"
        return ""

    def take(self, uid: int) -> None:
        self.held[uid] += 1
        self.total += 1

    def give_back(self, uid: int) -> None:
        if self.held[uid] > 0:
            self.held[uid] -= 1
            self.total -= 1
            if not self.held[uid]:
                del self.held[uid]

    def refuse(self, uid: int) -> None:
        """Counts a refusal of `uid`: against the user when it holds its share, as POOL_FULL when it did not
        (every place was held: the user is not at its share)."""
        self.refused_total += 1
        self.refused[self.label(uid) if self.held[uid] >= self.per_user else POOL_FULL] += 1
        self.last_refused_uid = uid

    def label(self, uid: int) -> str:
        """The user's name in refusals: its own for the first MAX_NAMED_USERS users refused, OTHER_USER after."""
        return self._labels(uid)

    def counters(self) -> dict[str, int]:
        """Refusals by user as Session counters (SHARE_COUNTER_PREFIX + resource/user)."""
        return {f"{SHARE_COUNTER_PREFIX}{self.resource}/{user}": count for user, count in self.refused.items()}

    def describe(self) -> str:
        """The refusals in one line for a component's reason ("" when none): who, how many, why."""
        if not self.refused_total or self.last_refused_uid is None:
            return ""
        uid = self.last_refused_uid
        worst = ", ".join(f"{user} {count}" for user, count in self.refused.most_common(3))
        return (f"{self.refused_total} refused for want of a share ({worst}); last: user {self.label(uid)} "
                f"(uid {uid}), {self.full_for(uid) or 'since given back'}")
