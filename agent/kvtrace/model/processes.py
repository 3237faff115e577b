"""Who a pid is: process title, comm, container. Cached per pid, refreshed on exec and by age.

vLLM renames its processes with setproctitle (`VLLM::Worker_TP0`); comm is cut at 15 characters,
so the title comes from /proc/PID/cmdline.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

# Container ids in cgroup paths: docker-<id>.scope, cri-containerd-<id>.scope, crio-<id>,
# /docker/<id>, /kubepods/.../<id>
_CONTAINER_ID = re.compile(r"(?:^|[/-])([0-9a-f]{64})(?:\.scope)?(?:/|$)")

TITLE_MAX_AGE_SECONDS = 5.0


@dataclass(slots=True)
class ProcessInfo:
    pid: int
    title: str
    comm: str
    container: str
    cgroup: str
    start_time: float  # seconds since the epoch (psutil create_time)
    read_at: float  # time.monotonic() when read


def container_id(cgroup_text: str) -> str:
    """The container id in /proc/PID/cgroup text, or "" for a host process."""
    for line in cgroup_text.splitlines():
        path = line.split(":", 2)[-1]
        match = _CONTAINER_ID.search(path)
        if match:
            return match.group(1)
    return ""


def read_process(pid: int, proc: Path = Path("/proc")) -> ProcessInfo | None:
    try:
        process = psutil.Process(pid)
        with process.oneshot():
            cmdline = process.cmdline()
            comm = process.name()
            start_time = process.create_time()
    except (psutil.Error, OSError):
        return None
    try:
        cgroup = (proc / str(pid) / "cgroup").read_text()
    except OSError:
        cgroup = ""
    # setproctitle may leave one argv element holding the whole title, padded with NULs/spaces.
    title = " ".join(part for part in cmdline if part).strip() or comm
    return ProcessInfo(pid, title, comm, container_id(cgroup), cgroup.strip().split(":")[-1],
                       start_time, time.monotonic())


class ProcessTable:
    """pid -> ProcessInfo with a short cache; forgets pids that exit."""

    def __init__(self, proc: Path = Path("/proc")) -> None:
        self._proc = proc
        self._cache: dict[int, ProcessInfo] = {}

    def get(self, pid: int) -> ProcessInfo | None:
        info = self._cache.get(pid)
        if info is None or time.monotonic() - info.read_at > TITLE_MAX_AGE_SECONDS:
            fresh = read_process(pid, self._proc)
            if fresh is not None:
                self._cache[pid] = info = fresh
        return info

    def refresh(self, pid: int) -> ProcessInfo | None:
        self._cache.pop(pid, None)
        return self.get(pid)

    def forget(self, pid: int) -> None:
        self._cache.pop(pid, None)

    def known(self) -> dict[int, ProcessInfo]:
        return dict(self._cache)
