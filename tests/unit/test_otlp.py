"""The OTLP exporter sends what /metrics serves: received by an in-process collector built from the
official opentelemetry-proto service (MetricsService on 127.0.0.1, ephemeral port), compared sample
by sample with the Prometheus collector over the same state; resource attributes; counters as
monotonic cumulative sums; a collector that is down or hangs never reaches the agent."""
from __future__ import annotations

import logging
import socket
import subprocess
import sys
import threading
import time
from concurrent import futures
from contextlib import contextmanager

import grpc
import pytest
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.metrics.v1 import metrics_pb2

from fake_agent import FakeAgent, MiB, event
from kvtrace import __version__
from kvtrace.errors import ExitCode
from kvtrace.servers.metrics import _SESSION_COUNTERS, METRIC_NAMES, KvtraceCollector
from kvtrace.servers.otlp import (
    COMPONENT,
    STOP_SECONDS,
    OtlpExporter,
    OtlpSetupError,
    check_endpoint,
    require_sdk,
    resource_attributes,
)
from test_prometheus import TRACER_COUNTERS, WORKER, FakeSource

POD = {"POD_NAME": "kvtrace-x7k2p", "POD_NAMESPACE": "kube-system", "NODE_NAME": "gpu-node-17"}


class Receiver(metrics_service_pb2_grpc.MetricsServiceServicer):
    """An OTLP metrics collector that keeps every request (or holds each call until released)."""

    def __init__(self, hang: bool = False) -> None:
        self.requests: list[metrics_service_pb2.ExportMetricsServiceRequest] = []
        self.hang = hang
        self.called = threading.Event()
        self.release = threading.Event()

    def Export(self, request, context):  # noqa: N802 - the proto's name
        self.called.set()
        if self.hang:
            self.release.wait(30)
        self.requests.append(request)
        return metrics_service_pb2.ExportMetricsServiceResponse()


@contextmanager
def receiving(hang: bool = False):
    """(receiver, "http://127.0.0.1:PORT") of a running in-process collector."""
    receiver = Receiver(hang)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield receiver, f"http://127.0.0.1:{port}"
    finally:
        receiver.release.set()
        server.stop(0)


def dead_endpoint() -> str:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


def received_samples(request) -> dict[str, set]:
    """{metric name: {(attributes, value)}} of one OTLP request."""
    (resource_metrics,) = request.resource_metrics
    samples: dict[str, set] = {}
    for scope in resource_metrics.scope_metrics:
        for metric in scope.metrics:
            points = metric.sum.data_points if metric.HasField("sum") else metric.gauge.data_points
            assert {point.WhichOneof("value") for point in points} <= {"as_double"}, metric.name
            samples[metric.name] = {(frozenset((kv.key, kv.value.string_value) for kv in point.attributes),
                                     point.as_double) for point in points}
    return samples


def scraped_samples(collector) -> dict[str, set]:
    """The same, from the Prometheus collector (what /metrics serves)."""
    samples: dict[str, set] = {}
    for family in collector.collect():
        for sample in family.samples:
            samples.setdefault(sample.name, set()).add((frozenset(sample.labels.items()), sample.value))
    return samples


def metrics_by_name(request) -> dict[str, metrics_pb2.Metric]:
    return {m.name: m for rm in request.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}


def resource(request) -> dict[str, str]:
    return {kv.key: kv.value.string_value for kv in request.resource_metrics[0].resource.attributes}


def exporter(state, analysis, endpoint, **options) -> OtlpExporter:
    options.setdefault("process_metrics", False)
    return OtlpExporter(state, analysis, endpoint, **options)


# ---- what is sent ----

def test_every_sample_of_a_scrape_arrives_with_the_same_name_attributes_and_value():
    # GIVEN the Prometheus tests' synthetic state, with every Session counter set: every metric present
    source = FakeSource(counters_value={**{key: 3 for key in _SESSION_COUNTERS.values()}, **TRACER_COUNTERS})
    with receiving() as (receiver, endpoint):
        otlp = exporter(source, source, endpoint, environ=POD)
        # WHEN it exports once
        assert otlp.export_now() is True
        otlp.stop()
    # THEN what the collector received is exactly what /metrics yields for the same state
    (request,) = receiver.requests
    received = received_samples(request)
    scraped = scraped_samples(KvtraceCollector(source, source))
    assert set(received) == set(scraped) == METRIC_NAMES
    assert received == scraped
    outstanding = {dict(labels)["layer"]: value for labels, value in received["kvtrace_outstanding_bytes"]
                   if dict(labels)["pid"] == str(WORKER) and dict(labels)["memory"] == "device"}
    assert outstanding == {"driver": 100 * (1 << 30), "runtime": 100 * (1 << 30)}


def test_counters_are_monotonic_cumulative_sums_and_gauges_gauges():
    source = FakeSource()
    with receiving() as (receiver, endpoint):
        otlp = exporter(source, source, endpoint)
        otlp.export_now()
        otlp.stop()
    metrics = metrics_by_name(receiver.requests[0])
    for name, metric in metrics.items():
        if name.endswith("_total"):
            assert metric.WhichOneof("data") == "sum", name
            assert metric.sum.is_monotonic, name
            assert metric.sum.aggregation_temporality == metrics_pb2.AGGREGATION_TEMPORALITY_CUMULATIVE, name
            for point in metric.sum.data_points:
                assert 0 < point.start_time_unix_nano <= point.time_unix_nano, name
        else:
            assert metric.WhichOneof("data") == "gauge", name
    assert metrics["kvtrace_outstanding_bytes"].unit == "By"
    assert metrics["kvtrace_time_to_oom_seconds"].unit == "s"
    assert metrics["kvtrace_outstanding_bytes"].description.startswith("Traced memory allocated")


def test_counters_grow_between_exports_from_the_same_start():
    # GIVEN the real Session with 23 allocations seen
    agent = FakeAgent()
    agent.apply(*(event(address=0x7F00_0000_0000 + i * MiB) for i in range(23)))
    with receiving() as (receiver, endpoint):
        otlp = exporter(agent.session, agent.analyzer, endpoint)
        otlp.export_now()
        # WHEN 23 more are seen before the next export
        agent.apply(*(event(address=0x7F10_0000_0000 + i * MiB) for i in range(23)))
        otlp.export_now()
        otlp.stop()
    first, second = (metrics_by_name(r)["kvtrace_allocations_total"].sum.data_points for r in receiver.requests)
    # THEN the sum counts on from the same start
    assert [p.as_double for p in first] == [23.0]
    assert [p.as_double for p in second] == [46.0]
    assert first[0].start_time_unix_nano == second[0].start_time_unix_nano
    assert second[0].time_unix_nano > first[0].time_unix_nano


def test_the_agents_own_process_metrics_go_too():
    source = FakeSource()
    with receiving() as (receiver, endpoint):
        otlp = OtlpExporter(source, source, endpoint)
        otlp.export_now()
        otlp.stop()
    metrics = metrics_by_name(receiver.requests[0])
    assert metrics["process_resident_memory_bytes"].gauge.data_points[0].as_double > 0
    assert metrics["process_cpu_seconds_total"].sum.is_monotonic


def test_the_resource_names_service_host_and_pod():
    source = FakeSource()
    with receiving() as (receiver, endpoint):
        for environ in (POD, {}):
            otlp = exporter(source, source, endpoint, environ=environ)
            otlp.export_now()
            otlp.stop()
    in_pod, on_host = (resource(request) for request in receiver.requests)
    expected = {"service.name": "kvtrace", "service.version": __version__, "host.name": socket.gethostname()}
    assert in_pod.items() >= {**expected, "k8s.pod.name": "kvtrace-x7k2p", "k8s.namespace.name": "kube-system",
                              "k8s.node.name": "gpu-node-17"}.items()
    assert on_host.items() >= expected.items()
    assert not {key for key in on_host if key.startswith("k8s.")}


def test_resource_attributes_leave_out_empty_variables():
    attributes = resource_attributes({"POD_NAME": "p", "POD_NAMESPACE": ""}, host_name="h")
    assert attributes == {"service.name": "kvtrace", "service.version": __version__, "host.name": "h",
                          "k8s.pod.name": "p"}


# ---- health and failure ----

def test_export_health_is_the_otlp_component():
    agent = FakeAgent()
    with receiving() as (receiver, endpoint):
        otlp = exporter(agent.session, agent.analyzer, endpoint, report_component=agent.session.report_component)
        otlp.export_now()
        otlp.export_now()
        otlp.stop()
    status = {c.name: c for c in agent.session.components()}[COMPONENT]
    assert status.up and status.reason == ""
    # the second export carries the first one's outcome, as a scrape would
    up = {dict(labels)["component"]: value
          for labels, value in received_samples(receiver.requests[1])["kvtrace_component_up"]}
    assert up[COMPONENT] == 1.0


def test_a_dead_collector_is_logged_once_reported_down_and_never_raises(caplog):
    agent = FakeAgent()
    endpoint = dead_endpoint()
    otlp = exporter(agent.session, agent.analyzer, endpoint, interval_seconds=1,
                    report_component=agent.session.report_component)
    with caplog.at_level(logging.WARNING):
        assert otlp.export_now() is False
        assert otlp.export_now() is False
    otlp.stop()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "cannot export metrics to" in warnings[0].getMessage()
    assert endpoint.removeprefix("http://") in warnings[0].getMessage()
    status = {c.name: c for c in agent.session.components()}[COMPONENT]
    assert not status.up
    assert "UNAVAILABLE" in status.reason
    assert agent.session.healthy()  # the agent itself stays SERVING


def test_it_works_again_after_an_outage_and_says_so(caplog):
    agent = FakeAgent()
    with receiving() as (receiver, endpoint):
        otlp = exporter(agent.session, agent.analyzer, endpoint, interval_seconds=1,
                        report_component=agent.session.report_component)
        otlp._failing = True  # as after a failed export
        with caplog.at_level(logging.WARNING):
            assert otlp.export_now()
        otlp.stop()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == \
        [f"otlp: exporting metrics to {endpoint} works again"]


@pytest.mark.parametrize("hang", [False, True], ids=["collector-down", "collector-hangs"])
def test_stop_returns_within_a_second(hang):
    agent = FakeAgent()
    with receiving(hang=True) as (receiver, endpoint):
        # GIVEN a running exporter whose export fails with retries, or never gets an answer
        otlp = exporter(agent.session, agent.analyzer, endpoint if hang else dead_endpoint(),
                        interval_seconds=0.2, export_timeout_seconds=30)
        otlp.start()
        if hang:
            assert receiver.called.wait(5)
        else:
            time.sleep(0.5)  # in the SDK's retry back-off
        # WHEN the agent stops
        thread = otlp._thread
        started = time.monotonic()
        otlp.stop()
        # THEN it is back within STOP_SECONDS, the export cut short rather than left behind
        assert time.monotonic() - started < STOP_SECONDS + 0.1
        assert thread is not None and not thread.is_alive()
    assert otlp.export_now() is False  # stopped: nothing more is sent, nothing raised


def test_a_stop_sends_the_last_values():
    agent = FakeAgent()
    with receiving() as (receiver, endpoint):
        otlp = exporter(agent.session, agent.analyzer, endpoint, interval_seconds=3600)
        otlp.start()
        agent.apply(event())
        otlp.stop()
    (request,) = receiver.requests
    assert [p.as_double for p in metrics_by_name(request)["kvtrace_allocations_total"].sum.data_points] == [1.0]


# ---- set-up and flags ----

@pytest.mark.parametrize("given, expected", [
    ("http://collector:4317", "http://collector:4317"),
    ("https://otel.example.com", "https://otel.example.com:4317"),
    ("http://[::1]:4317/", "http://[::1]:4317"),
])
def test_endpoints_are_checked_and_get_the_default_port(given, expected):
    assert check_endpoint(given) == expected


@pytest.mark.parametrize("given", ["collector:4317", "grpc://collector:4317", "http://collector:43a17",
                                   "http://collector:4317/v1/metrics", "http://user:pw@collector:4317", "http://"])
def test_bad_endpoints_are_refused_with_an_example(given):
    with pytest.raises(OtlpSetupError, match="expected http://HOST:PORT .* e.g. http://otel-collector:4317"):
        check_endpoint(given)


def test_without_opentelemetry_one_line_names_the_pip_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.metric_exporter", None)
    with pytest.raises(OtlpSetupError, match="pip install opentelemetry-exporter-otlp-proto-grpc"):
        require_sdk()


def test_the_agent_does_not_import_opentelemetry_unless_asked():
    code = ("import sys, kvtrace.cli.main, kvtrace.cli.agent, kvtrace.daemon, kvtrace.servers.otlp; "
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# Blocks opentelemetry the way a host without the package would, then runs `kvtrace agent`.
_NO_OTEL = ("import sys; sys.modules['opentelemetry'] = None; sys.argv = ['kvtrace'] + sys.argv[1:]; "
            "from kvtrace.cli.main import main; sys.exit(main())")


@pytest.mark.parametrize("flags, says, block", [
    (["--otlp-endpoint", "collector:4317"], "--otlp-endpoint: expected http://HOST:PORT", False),
    (["--otlp-endpoint", "http://collector:4317", "--otlp-interval-seconds", "0"],
     "--otlp-interval-seconds takes 1 to 3600 seconds", False),
    (["--otlp-endpoint", "http://collector:4317"], "pip install opentelemetry-exporter-otlp-proto-grpc", True),
])
def test_bad_otlp_flags_are_refused_with_the_fix(flags, says, block):
    command = [sys.executable, "-c", _NO_OTEL] if block else [sys.executable, "-m", "kvtrace.cli.main"]
    result = subprocess.run([*command, "agent", *flags], capture_output=True, text=True, timeout=60)
    assert result.returncode == ExitCode.USAGE, result.stderr
    assert says in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
