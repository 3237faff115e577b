"""The AgentBackend the server uses in `kvtrace agent`: an adapter over the running Tracer.

The tracer thread holds `tracer.lock` while it applies events; the gRPC threads take it to copy.
A poll applies at most one ring-buffer batch, so a copy waits milliseconds, never long.
"""
from __future__ import annotations

import dataclasses
import platform
import time

from kvtrace import __version__
from kvtrace.analysis.analyzer import Analyzer
from kvtrace.analysis.leaks import LeakReport
from kvtrace.model.findings import AnalysisSnapshot
from kvtrace.servers.backend import AgentInfo, ComponentHealth, OutstandingTotal, TrackedProcess
from kvtrace.servers.hub import EventHub
from kvtrace.model.ledger import Outstanding
from kvtrace.model.processes import ProcessInfo
from kvtrace.model.stacks import Stack
from kvtrace.tracer import Tracer

# The pipeline is stalled when the tracer loop has not come round for this long.
STALLED_AFTER_SECONDS = 5.0


class TracerBackend:
    def __init__(self, tracer: Tracer, hub: EventHub, analyzer: Analyzer | None = None) -> None:
        self.tracer = tracer
        self.hub = hub
        # The agent loop ticks the analyzer; without one, suspects are ranked with no growth.
        self.analyzer = analyzer if analyzer is not None else Analyzer(stacks=tracer.stacks)
        tracer.sinks.append(hub.publish)

    def after_poll(self) -> None:
        """Called by the tracer loop after each poll (in the tracer thread)."""
        self.hub.publish_kernel_loss(self.tracer.counters()["events_lost"])

    def outstanding(self) -> list[Outstanding]:
        with self.tracer.lock:
            return list(self.tracer.ledger)

    def process(self, pid: int) -> ProcessInfo | None:
        with self.tracer.lock:
            return self.tracer.processes.known().get(pid)

    def stack(self, stack_id: int) -> Stack | None:
        try:
            return self.tracer.stacks.get(stack_id)
        except KeyError:
            return None

    def processes(self) -> list[TrackedProcess]:
        with self.tracer.lock:
            totals = self.tracer.ledger.totals()
            known = self.tracer.processes.known()
        processes: dict[int, TrackedProcess] = {}
        for key, (size_bytes, count) in sorted(totals.items(), key=lambda item: (
                item[0].pid, item[0].device, item[0].layer, item[0].memory)):
            info = known.get(key.pid)
            process = processes.get(key.pid)
            if process is None:
                process = processes[key.pid] = TrackedProcess(
                    key.pid, info.title if info else "", info.comm if info else "",
                    info.container if info else "")
            process.totals.append(OutstandingTotal(key.device, key.layer, key.memory, size_bytes, count))
        return list(processes.values())

    def info(self) -> AgentInfo:
        with self.tracer.lock:
            libraries = self.tracer.attached_libraries()
            counters = self.tracer.counters()
            refused = dict(self.tracer.refused)
        counters["subscribers"] = self.hub.subscriber_count()
        counters["events_published"] = self.hub.published_total
        components = [
            ComponentHealth("bpf", self.healthy(), "" if self.healthy() else "the event loop is stalled"),
            ComponentHealth("python_stacks", not self.tracer.python_stacks_down,
                            self.tracer.python_stacks_down),
        ]
        components += [ComponentHealth(c.name, c.up, c.reason) for c in self.analyzer.components()]
        components += [ComponentHealth(f"attach:{path}", False, why) for path, why in refused.items()]
        return AgentInfo(__version__, platform.release(), libraries, components, counters)

    def analysis(self) -> AnalysisSnapshot | None:
        return self.analyzer.latest

    def leak_suspects(self, pids: frozenset[int], min_age_seconds: float | None, limit: int) -> LeakReport:
        with self.tracer.lock:
            entries = list(self.tracer.ledger)
            titles = {pid: info.title for pid, info in self.tracer.processes.known().items()}
        report = self.analyzer.leak_report(entries, time.time_ns(), titles, min_age_seconds, pids)
        # Only the suspects returned are resolved: the first lookup in a library reads its symbols.
        # Outside the lock: the symbolizer's caches are plain dicts, and racing the tracer thread
        # costs at most a second read of /proc/PID/maps.
        symbolize = self.tracer.native_symbolizer.symbolize
        suspects = tuple(
            dataclasses.replace(suspect, native_caller=symbolize(suspect.pid, suspect.native_caller_address))
            if suspect.native_caller_address else suspect
            for suspect in report.suspects[:limit])
        return dataclasses.replace(report, suspects=suspects)

    def healthy(self) -> bool:
        return time.monotonic() - self.tracer.last_loop_monotonic < STALLED_AFTER_SECONDS
