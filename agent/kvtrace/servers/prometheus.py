"""Prometheus exporter: `/metrics` on 127.0.0.1:9464, served over HTTP.

Only the exposition: the listener and the rules for its address. What is exported and how each
sample is built (the catalog, the labels, KvtraceCollector) is kvtrace.servers.metrics', which the
OTLP exporter reads as well; a scrape collects it once, at scrape time, next to prometheus-client's
`process_*` metrics of the agent itself.

The listener refuses a non-loopback address unless asked (`--metrics-allow-remote`): process titles
are command lines, and anyone who can reach the port can read them.
"""
from __future__ import annotations

import ipaddress
import logging
import socket
import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, ProcessCollector, start_wsgi_server

from kvtrace.servers.backend import AgentAnalysis, AgentState
from kvtrace.servers.metrics import KvtraceCollector

log = logging.getLogger(__name__)

DEFAULT_LISTEN = "127.0.0.1:9464"


class MetricsSetupError(Exception):
    """The listener cannot start; the message says what to change."""


def parse_listen(listen: str) -> tuple[str, int]:
    """'HOST:PORT' or '[V6]:PORT' -> (host, port)."""
    host, separator, port = listen.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not separator or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise MetricsSetupError(f"--metrics-listen: expected HOST:PORT (e.g. {DEFAULT_LISTEN}), "
                                f"not {listen!r}")
    return host, int(port)


def is_loopback(host: str) -> bool:
    """True when every address the host name resolves to is a loopback address."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback
                               for info in infos)


def check_listen(listen: str, allow_remote: bool) -> tuple[str, int]:
    """(host, port) of a --metrics-listen value, refused unless loopback or allowed remote."""
    host, port = parse_listen(listen)
    if not allow_remote and not is_loopback(host):
        raise MetricsSetupError(
            f"refusing to serve metrics on {listen}: it is not a loopback address and the metrics "
            "carry process command lines; add --metrics-allow-remote if that is intended")
    return host, port


class MetricsServer:
    """Serves /metrics over HTTP in a daemon thread; stoppable (tests start and stop many)."""

    def __init__(self, state: AgentState, analysis: AgentAnalysis, listen: str = DEFAULT_LISTEN,
                 allow_remote: bool = False, process_metrics: bool = True) -> None:
        self.host, self.port = check_listen(listen, allow_remote)
        self.registry = CollectorRegistry()
        self.collector = KvtraceCollector(state, analysis)
        self.registry.register(self.collector)
        if process_metrics:  # the agent's own CPU, memory and file descriptors (process_*)
            ProcessCollector(registry=self.registry)
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) actually bound: the real port when 0 was asked for."""
        if self._server is None:
            return self.host, self.port
        return self.host, self._server.server_address[1]

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://[{host}]:{port}/metrics" if ":" in host else f"http://{host}:{port}/metrics"

    def start(self) -> None:
        try:
            self._server, self._thread = start_wsgi_server(self.port, self.host, self.registry)
        except OSError as error:
            hint = " (another kvtrace agent? choose a port with --metrics-listen)" \
                if error.errno == 98 else ""
            raise MetricsSetupError(f"cannot serve metrics on {self.host}:{self.port}: "
                                    f"{error.strerror or error}{hint}") from error
        log.info("metrics on %s", self.url)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
