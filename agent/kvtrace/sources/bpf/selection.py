"""Which processes the BPF source follows: every one, or only those chosen (-p, a title that matches
--cmdline, follow()), in the agent and in the probes' pid filter alike.

It is a part of its own because three read it: the attach targets (whom to scan, for whom to probe), the
ring intake (whose events are admitted) and the kernel's ledger (whose entries are read). Each is handed
it at construction, so none calls back into the source.
"""
from __future__ import annotations

import re
from typing import Protocol

from kvtrace.sources.bpf.loader import BpfProbes


class Choice(Protocol):
    """What the operator chose (BpfOptions' fields), read as it is now: a test may change --cmdline on a
    running source."""

    pids: set[int]  # -p's pids and follow()'s: they stay chosen after exit
    cmdline: re.Pattern | None
    only_selected: bool  # only pids chosen later, with follow()


class Selection:
    def __init__(self, probes: BpfProbes, choice: Choice) -> None:
        self._probes = probes
        self._choice = choice
        self.pids: set[int] = set()  # followed now, as the probes' filter holds them

    @property
    def cmdline(self) -> re.Pattern | None:
        return self._choice.cmdline

    @property
    def filtering(self) -> bool:
        choice = self._choice
        return bool(choice.pids) or choice.cmdline is not None or choice.only_selected

    @property
    def chosen_only(self) -> bool:
        """Following chosen processes: nobody else is looked at (a --cmdline match is found by looking)."""
        return self._choice.only_selected or bool(self._choice.pids)

    def follows(self, pid: int) -> bool:
        """Whether the probes trace `pid` (every process, or one of those chosen)."""
        return not self.filtering or pid in self.pids

    def choose(self, pid: int) -> None:
        """Chooses `pid` for good (follow()): the probes filter from now, if they did not."""
        self._choice.pids.add(pid)
        self._probes.set_filter(True)
        self.select(pid)

    def select(self, pid: int) -> None:
        self.pids.add(pid)
        self._probes.select_pid(pid)
