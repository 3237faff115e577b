"""Runs the real BPF source and Session in the test's own thread and collects what they emit.

Integration and GPU tests drive a workload process, then pump the source until the expected events
arrived (or a timeout says what did arrive).
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest

from kvtrace.model.events import Api, Event, Kind
from kvtrace.model.processes import ProcessTable
from kvtrace.session import Session
from kvtrace.sources import procfs
from kvtrace.sources.bpf.loader import BpfProbes, ProbeSettings
from kvtrace.sources.bpf.source import BpfOptions, BpfSource


def require_tracing_here() -> None:
    """Skips (with the reason printed by -ra) when this machine cannot load BPF."""
    if os.geteuid() != 0:
        pytest.skip("needs root for BPF (run `sudo make test`)")
    try:
        import bcc  # noqa: F401
    except Exception as error:  # bcc raises more than ImportError when half-installed
        pytest.skip(f"bcc is not importable ({error}); `make setup` installs python3-bpfcc")
    if not (os.path.exists("/sys/kernel/tracing/uprobe_events")
            or os.path.exists("/sys/kernel/debug/tracing/uprobe_events")):
        pytest.skip("tracefs is not mounted: mount -t tracefs nodev /sys/kernel/tracing")


class CallSink:
    """A Session sink from a plain callable given every event (losses are not passed on)."""

    def __init__(self, call: Callable[[Event], object]) -> None:
        self.call = call

    def publish(self, event: Event) -> None:
        self.call(event)

    def publish_loss(self, lost_count: int) -> None:
        pass

    def publish_state(self, record) -> None:
        pass


def probes_only_under(lib_dir: Path) -> Callable[[ProbeSettings], BpfProbes]:
    """BpfProbes that attach only to libraries under `lib_dir`: a whole-host tracer in a test that the
    processes of other tests on this machine (with stub libraries of their own) do not reach."""
    prefix = str(Path(lib_dir).resolve()) + os.sep

    class ProbesUnder(BpfProbes):
        def attach(self, path, symbols, pid=-1, key=None):
            if not os.path.realpath(path).startswith(prefix):
                return []
            return super().attach(path, symbols, pid, key=key)

    return ProbesUnder


class TracingHarness:
    def __init__(self, pids: Iterable[int] = (), probes_factory: Callable[[ProbeSettings], BpfProbes] = BpfProbes,
                 **options) -> None:
        self.events: list[Event] = []
        self.session = Session(ProcessTable(procfs.read_process))
        self.session.add_sink(CallSink(self.events.append))
        self.source = BpfSource(self.session, BpfOptions(pids=set(pids), **options), probes_factory=probes_factory)
        self.source.start()

    def pump(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.source.run_once(20)

    def pump_until(self, predicate: Callable[[], bool], timeout_seconds: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline:
            self.source.run_once(20)
            if predicate():
                return True
        return predicate()

    def of(self, pid: int | None = None, kind: Kind | None = None, api: Api | None = None) -> list[Event]:
        return [e for e in self.events
                if (pid is None or e.pid == pid) and (kind is None or e.kind is kind)
                and (api is None or e.api is api)]

    def close(self) -> None:
        self.source.stop()

    def __enter__(self) -> TracingHarness:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
