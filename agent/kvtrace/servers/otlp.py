"""OTLP exporter: pushes the same metrics as `/metrics` to an OpenTelemetry collector over gRPC.

    kvtrace agent --otlp-endpoint http://otel-collector:4317      # plaintext
    kvtrace agent --otlp-endpoint https://otel-collector:4317     # TLS

Every `--otlp-interval-seconds` (default 15) the metrics collector (kvtrace.servers.metrics'
`KvtraceCollector`, plus the agent's own `process_*` metrics) is collected once, exactly as a scrape
would, and each family is mapped to one OTLP metric of the same name: gauges to gauges, counters to
monotonic cumulative sums (started when the agent process started), labels to attributes, values
unchanged. Nothing is computed twice and the two outputs cannot drift.

Why not the SDK's instruments (ObservableGauge, ObservableCounter)? Their callbacks run one per
instrument, so a collection would read the state once per metric, and the SDK's aggregation adds
what a scrape does not: a cardinality limit (2000 series per instrument, the rest folded into an
overflow series) and cumulative series that outlive an exited process. Instead the SDK's own metric
data types are built from the families and handed to the SDK's `OTLPMetricExporter`, which does the
encoding, gRPC, TLS, headers, compression and retries.

The resource says who sends: service.name=kvtrace, service.version, host.name, and k8s.pod.name,
k8s.namespace.name and k8s.node.name from POD_NAME, POD_NAMESPACE and NODE_NAME (the downward API,
see packaging/k8s/kvtrace-daemonset.yaml); OTEL_RESOURCE_ATTRIBUTES adds more. The SDK's other
OTEL_EXPORTER_OTLP_* variables (headers, certificates, compression) apply as usual.

A collector that is down never disturbs the agent: exports run in their own thread, a failure is
logged once per outage (and once more when exports work again) and reported as the `otlp`
component (kvtrace_component_up{component="otlp"}, `kvtrace doctor`). Stopping makes one last
export and takes at most STOP_SECONDS, a collector that hangs included.

opentelemetry is imported only when OTLP is switched on: the agent runs without it.
"""
from __future__ import annotations

import argparse
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import Metric as PrometheusFamily

from kvtrace import __version__
from kvtrace.servers.backend import AgentAnalysis, AgentState
from kvtrace.servers.metrics import METRICS, KvtraceCollector

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import MetricsData
    from opentelemetry.sdk.resources import Resource

log = logging.getLogger(__name__)

COMPONENT = "otlp"
DEFAULT_PORT = 4317
DEFAULT_INTERVAL_SECONDS = 15.0
# What stop() may take in all: the last export, and cutting off one that hangs.
STOP_SECONDS = 1.0
# One export, retries included, never takes longer than this (or the interval, if shorter).
EXPORT_TIMEOUT_SECONDS = 10.0
PIP_PACKAGE = "opentelemetry-exporter-otlp-proto-grpc"
# The SDK logs every failed export (and every retry) here; the agent logs once per outage instead.
SDK_EXPORTER_LOGGER = "opentelemetry.exporter.otlp.proto.grpc.exporter"

# Downward-API variable -> resource attribute (OpenTelemetry semantic conventions).
K8S_ENVIRONMENT = {
    "POD_NAME": "k8s.pod.name",
    "POD_NAMESPACE": "k8s.namespace.name",
    "NODE_NAME": "k8s.node.name",
}

# METRICS' units -> UCUM, as OTLP wants them; other units become annotations ({events}), which
# collectors drop when they turn OTLP back into Prometheus names (the names already carry the unit).
_UCUM = {"bytes": "By", "seconds": "s", "bytes per second": "By/s", "ratio": "1"}
_UNITS = {spec.name: _UCUM.get(spec.unit, "{" + spec.unit.replace(" ", "_") + "}") for spec in METRICS}


class OtlpSetupError(Exception):
    """OTLP cannot start; the message says what to change."""


# ---- what is sent ----

def resource_attributes(environ: Mapping[str, str] = os.environ, host_name: str | None = None) -> dict[str, str]:
    """Who sends: the service, the host and, in a pod, the pod, its namespace and its node."""
    attributes = {"service.name": "kvtrace", "service.version": __version__,
                  "host.name": host_name or socket.gethostname()}
    for variable, attribute in K8S_ENVIRONMENT.items():
        if environ.get(variable):
            attributes[attribute] = environ[variable]
    return attributes


def metric_unit(name: str) -> str:
    if name in _UNITS:
        return _UNITS[name]
    if name.endswith("_bytes"):  # process_resident_memory_bytes, ...
        return "By"
    if name.endswith(("_seconds", "_seconds_total")):
        return "s"
    return ""


def metrics_data(families: Iterable[PrometheusFamily], resource: Resource, start_time_ns: int,
                 time_ns: int) -> MetricsData:
    """One OTLP batch from one collection of Prometheus families: a metric per sample name, a data
    point per sample, every value a double as Prometheus has it (an int would be sent as as_int, and a
series could change type between exports). Counters are monotonic cumulative sums since `start_time_ns`; gauges (and
    untyped samples) gauges; other types (histograms, summaries: none is exported today) are left out."""
    from opentelemetry.sdk.metrics.export import (
        AggregationTemporality,
        Gauge,
        Metric,
        NumberDataPoint,
        ResourceMetrics,
        ScopeMetrics,
        Sum,
    )
    from opentelemetry.sdk.metrics.export import MetricsData as Batch
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    metrics = []
    for family in families:
        if family.type not in ("counter", "gauge", "unknown"):
            log.debug("otlp: %s is a %s, not sent", family.name, family.type)
            continue
        counter = family.type == "counter"
        by_name: dict[str, list[Any]] = {}
        for sample in family.samples:
            if counter and not sample.name.endswith("_total"):
                continue  # _created: OTLP says it with start_time_unix_nano
            by_name.setdefault(sample.name, []).append(NumberDataPoint(
                attributes=dict(sample.labels), start_time_unix_nano=start_time_ns if counter else 0,
                time_unix_nano=time_ns, value=float(sample.value)))  # a double, as in Prometheus
        for name, points in by_name.items():
            data: Sum | Gauge = Sum(points, AggregationTemporality.CUMULATIVE, is_monotonic=True) \
                if counter else Gauge(points)
            metrics.append(Metric(name=name, description=family.documentation, unit=metric_unit(name), data=data))
    scope = ScopeMetrics(scope=InstrumentationScope("kvtrace", __version__), metrics=metrics, schema_url="")
    return Batch(resource_metrics=[ResourceMetrics(resource=resource, scope_metrics=[scope], schema_url="")])


# ---- the exporter ----

class _LastError(logging.Filter):
    """Keeps the SDK's last word on a failed export (our reason) and keeps it out of the log."""

    def __init__(self) -> None:
        super().__init__()
        self.message = ""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            self.message = record.getMessage()
        return False


class OtlpExporter:
    """Collects the Prometheus families every `interval_seconds` and sends them over OTLP/gRPC.

    `report_component(name, up, reason)` (the Session's) is told how exports go. One export, retries
    included, ends after `export_timeout_seconds` (default: the interval, at most 10 s)."""

    def __init__(self, state: AgentState, analysis: AgentAnalysis, endpoint: str,
                 interval_seconds: float = DEFAULT_INTERVAL_SECONDS,
                 report_component: Callable[[str, bool, str], None] | None = None,
                 process_metrics: bool = True, environ: Mapping[str, str] = os.environ,
                 export_timeout_seconds: float | None = None) -> None:
        self.endpoint = check_endpoint(endpoint)
        sdk = require_sdk()
        self.interval_seconds = interval_seconds
        self.registry = CollectorRegistry()
        self.registry.register(KvtraceCollector(state, analysis))
        if process_metrics:  # the agent's own CPU, memory and file descriptors (process_*), as /metrics
            ProcessCollector(registry=self.registry)
        self._report = report_component
        self.resource: Resource = sdk["Resource"].create(resource_attributes(environ))
        # Counters (the Session's, the probes', process_cpu_seconds_total) count from the agent's start.
        self.start_time_ns = _process_start_ns()
        if export_timeout_seconds is None:
            export_timeout_seconds = min(EXPORT_TIMEOUT_SECONDS, interval_seconds)
        self._exporter = sdk["OTLPMetricExporter"](endpoint=self.endpoint, timeout=export_timeout_seconds)
        self._success = sdk["MetricExportResult"].SUCCESS
        self._last_error = _LastError()
        self._sdk_log = logging.getLogger(SDK_EXPORTER_LOGGER)
        # First, before the SDK's DuplicateFilter (which drops a repeated message for 20 s).
        self._sdk_log.filters.insert(0, self._last_error)
        self._lock = threading.Lock()  # one export at a time: the SDK's exporter is not reentrant
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False
        self._stopped = False

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvtrace-otlp", daemon=True)
        self._thread.start()
        log.info("otlp: metrics to %s every %g s", self.endpoint, self.interval_seconds)

    def collect(self) -> MetricsData:
        """What the next export sends: one collection of the same families as /metrics."""
        return metrics_data(self.registry.collect(), self.resource, self.start_time_ns, time.time_ns())

    def export_now(self) -> bool:
        """Collects and sends once (the thread does this every interval); True when the collector
        took it. Never raises."""
        with self._lock:
            if self._stopped:
                return False
            self._last_error.message = ""
            try:
                ok = self._exporter.export(self.collect()) is self._success
                reason = "" if ok else self._last_error.message or "the export failed"
            except Exception as error:  # whatever breaks, the agent goes on
                log.debug("otlp: export failed", exc_info=True)
                ok, reason = False, f"{type(error).__name__}: {error}"
        if not self._stopping.is_set():
            self._outcome(ok, reason)
        return ok

    def stop(self, timeout_seconds: float = STOP_SECONDS) -> None:
        """One last export, then the channel is closed: at most `timeout_seconds` in all."""
        deadline = time.monotonic() + timeout_seconds
        self._stopping.set()
        thread, self._thread = self._thread, None
        if thread is not None:  # the thread makes the last export; give it most of the time
            thread.join(max(0.0, timeout_seconds * 0.6))
        self._exporter.shutdown(timeout_millis=0)  # cuts a retry or an RPC still in flight short
        if thread is not None:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                log.warning("otlp: the last export to %s did not end in %g s; left behind", self.endpoint,
                            timeout_seconds)
        self._stopped = True
        self._sdk_log.removeFilter(self._last_error)

    def _run(self) -> None:
        while not self._stopping.wait(self.interval_seconds):
            self.export_now()
        self.export_now()  # the last values before the agent ends

    def _outcome(self, ok: bool, reason: str) -> None:
        if ok and self._failing:
            log.warning("otlp: exporting metrics to %s works again", self.endpoint)
        elif not ok and not self._failing:
            log.warning("otlp: cannot export metrics to %s: %s (logged once; retrying every %g s)",
                        self.endpoint, reason, self.interval_seconds)
        self._failing = not ok
        if self._report is not None:
            self._report(COMPONENT, ok, "" if ok else f"cannot export metrics to {self.endpoint}: {reason}")


def _process_start_ns() -> int:
    import psutil

    try:
        return int(psutil.Process().create_time() * 1e9)
    except psutil.Error:
        return time.time_ns()


def require_sdk() -> dict[str, Any]:
    """The OpenTelemetry classes OTLP needs, imported now; OtlpSetupError names the pip package."""
    try:
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
        from opentelemetry.sdk.metrics.export import MetricExportResult
        from opentelemetry.sdk.resources import Resource
    except ImportError as error:
        raise OtlpSetupError(f"--otlp-endpoint needs the OpenTelemetry exporter: pip install {PIP_PACKAGE} "
                             f"(or kvtrace[otlp]); importing it failed: {error}") from None
    return {"OTLPMetricExporter": OTLPMetricExporter, "MetricExportResult": MetricExportResult,
            "Resource": Resource}


# ---- command line (`kvtrace agent`) ----

def check_endpoint(endpoint: str) -> str:
    """'http://HOST[:PORT]' or 'https://HOST[:PORT]' -> the same with the port (4317 by default)."""
    usage = (f"--otlp-endpoint: expected http://HOST:PORT (plaintext) or https://HOST:PORT (TLS), "
             f"e.g. http://otel-collector:{DEFAULT_PORT}, not {endpoint!r}")
    try:
        url = urlsplit(endpoint)
        port = url.port
    except ValueError:
        raise OtlpSetupError(usage) from None
    if url.scheme not in ("http", "https") or not url.hostname or url.path not in ("", "/") \
            or url.query or url.fragment or url.username or url.password:
        raise OtlpSetupError(usage)
    host = f"[{url.hostname}]" if ":" in url.hostname else url.hostname
    return f"{url.scheme}://{host}:{port or DEFAULT_PORT}"


def add_otlp_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--otlp-endpoint", metavar="URL",
                        help="also push the /metrics metrics to this OpenTelemetry collector over OTLP/gRPC: "
                             f"http://HOST:PORT plaintext, https://HOST:PORT TLS (port default {DEFAULT_PORT}; "
                             "CA from $OTEL_EXPORTER_OTLP_CERTIFICATE, else the system's). Default: off. "
                             f"Needs pip install {PIP_PACKAGE}")
    parser.add_argument("--otlp-interval-seconds", metavar="SECONDS", type=float, default=DEFAULT_INTERVAL_SECONDS,
                        help="how often OTLP metrics are pushed (default: %(default)g)")
