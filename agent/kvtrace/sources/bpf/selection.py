"""Which processes the BPF source follows: every one, or only those chosen (-p, a title that matches
--cmdline, follow()), in the agent and in the probes' pid filter alike.

It is a part of its own because three read it: the attach targets (whom to scan, for whom to probe), the
ring intake (whose events are admitted) and the kernel's ledger (whose entries are read). Each is handed
it at construction, so none calls back into the source.
"""
from __future__ import annotations

import re

from kvtrace.sources.bpf.loader import BpfProbes


class Selection:
    def __init__(self, probes: BpfProbes, chosen: set[int], cmdline: re.Pattern | None = None,
                 only_selected: bool = False) -> None:
        self._probes = probes
        self.chosen = chosen  # -p's pids and follow()'s (the options' own set: they stay chosen after exit)
        self.cmdline = cmdline
        self.only_selected = only_selected  # only pids chosen later, with follow()
        self.pids: set[int] = set()  # followed now, as the probes' filter holds them

    @property
    def filtering(self) -> bool:
        return bool(self.chosen) or self.cmdline is not None or self.only_selected

    @property
    def chosen_only(self) -> bool:
        """Following chosen processes: nobody else is looked at (a --cmdline match is found by looking)."""
        return self.only_selected or bool(self.chosen)

    def follows(self, pid: int) -> bool:
        """Whether the probes trace `pid` (every process, or one of those chosen)."""
        return not self.filtering or pid in self.pids

    def choose(self, pid: int) -> None:
        """Chooses `pid` for good (follow()): the probes filter from now, if they did not."""
        self.chosen.add(pid)
        self._probes.set_filter(True)
        self.select(pid)

    def select(self, pid: int) -> None:
        self.pids.add(pid)
        self._probes.select_pid(pid)
