"""The engine's own figures: vLLM's OpenAI API server serves /metrics (KV-cache usage, requests running
and waiting, sleep state, preemptions, the cache's block count); this scrapes it beside the traced bytes.

    /proc (vLLM API servers, the ports they listen on) ─┐
    --vllm-metrics-url ─────────────────────────────────┴─▶ GET /metrics ─▶ VllmMetricsSample ─▶ Session

Discovery: a process is a vLLM API server when its title is `VLLM::APIServer_N` (model/vllm.py's rule; several API
servers) or its command line runs vLLM's OpenAI server (`vllm serve`, `-m vllm.entrypoints.openai.api_server`,
`-m vllm.entrypoints.cli.main serve`). Its TCP ports are the LISTEN sockets among its descriptors
(/proc/PID/fd inodes matched with /proc/PID/net/tcp and tcp6); each is tried until one answers /metrics
with vllm: series. A process in another network namespace (a container with its own network) cannot be
reached at its listening address from here: it is skipped, and the component says to give its URL with
--vllm-metrics-url. The /proc readers (command lines, start ticks, sockets, TCP listeners) are procfs's,
which the plugin's listener shares; psutil is not used for sockets because it reads the agent's own
/proc/net, not the process's network namespace. A server in another network namespace is a note in the
component, not a failure: the plugin reports the same figures from inside the engine.

Cost: one round every `interval_seconds` reads every process's cmdline (a few ms on a busy host), and
GETs each URL once with a 2 s timeout and at most 4 MiB read. Only the lines of the few series used are
handed to prometheus_client's parser (a full vLLM exposition is mostly histograms).
"""
from __future__ import annotations

import http.client
import ipaddress
import logging
import math
import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvtrace.human import human_bytes
from kvtrace.model.vllm import API_SERVER, EngineMetrics, VllmMetricsSample, vllm_part
from kvtrace.session import Session
from kvtrace.sources.procfs import PROC, net_namespace, read_argv, socket_inodes, start_ticks, tcp_listeners

log = logging.getLogger(__name__)

COMPONENT = "vllm_metrics"
DEFAULT_INTERVAL_SECONDS = 5.0
TIMEOUT_SECONDS = 2.0
MAX_RESPONSE_BYTES = 4 << 20
MAX_SERVERS = 64  # API servers followed at once
MAX_PORTS_TRIED = 8  # per server and round, while none has answered
MAX_URLS = 64  # --vllm-metrics-url given at most this often
MAX_URL_CHARS = 2048
MAX_REASON_CHARS = 600  # the component's reason: one line
OWNER_RETRY_SECONDS = 30.0  # a flag-given URL whose process was not found is looked up again this often
READ_CHUNK_BYTES = 64 << 10
BODY_SECONDS_PER_TIMEOUT = 2.5  # the whole body within this many timeouts (vLLM's is tens of KiB)

# The series read (sample names as scraped; counters end in _total).
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # the second: vLLM before 0.10
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
SLEEP_STATE = "vllm:engine_sleep_state"
PREEMPTIONS = "vllm:num_preemptions_total"
CACHE_CONFIG = "vllm:cache_config_info"
_WANTED = frozenset((*KV_USAGE, RUNNING, WAITING, SLEEP_STATE, PREEMPTIONS, CACHE_CONFIG))
SLEEP_LEVELS = {"awake": 0, "weights_offloaded": 1, "discard_all": 2}

_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
_CLI_MODULE = "vllm.entrypoints.cli.main"


class MetricsSetupError(Exception):
    """A bad --vllm-metrics-url; the message is one line that names the fix."""


def check_metrics_url(url: str, flag: str = "--vllm-metrics-url") -> str:
    """An http(s) URL with a host, as given; MetricsSetupError with one line otherwise."""
    try:
        url.encode("utf-8")
    except UnicodeEncodeError:
        raise MetricsSetupError(f"{flag}: {url!r} is not UTF-8 text") from None
    if len(url) > MAX_URL_CHARS or any(char.isspace() or not char.isprintable() for char in url):
        raise MetricsSetupError(f"{flag}: {url[:80]!r} is not a URL (give e.g. http://127.0.0.1:8000/metrics)")
    parsed = urllib.parse.urlsplit(url)
    try:
        parsed.port  # noqa: B018 - raises ValueError for a port that is not a number or out of range
    except ValueError as error:
        raise MetricsSetupError(f"{flag}: {url!r}: {error} (give e.g. http://127.0.0.1:8000/metrics)") from None
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise MetricsSetupError(f"{flag}: {url!r} is not an http(s) URL with a host "
                                "(give e.g. http://127.0.0.1:8000/metrics)")
    return url


# ---- discovery over /proc (pure; `proc` is a path so tests give a fake tree) ----


def is_api_server(argv: list[str]) -> bool:
    """Whether a command line (argv, or one element holding a setproctitle title) is vLLM's OpenAI server:
    `vllm serve`, run directly or by a Python interpreter (a script's shebang), or `python -m` one of the
    server's modules."""
    if not argv:
        return False
    if vllm_part(argv[0]) == API_SERVER:
        return True
    if "--headless" in argv:  # `vllm serve --headless`: engines only, no HTTP server
        return False
    index = 0
    if os.path.basename(argv[0]).startswith("python"):
        index = 1
        while index < len(argv) and argv[index].startswith("-"):
            if argv[index] == "-m":
                module, rest = argv[index + 1:index + 2], argv[index + 2:index + 3]
                return module == [_SERVER_MODULE] or (module == [_CLI_MODULE] and rest == ["serve"])
            if argv[index] == "-c":
                return False
            index += 2 if argv[index] in ("-X", "-W") else 1
    if index >= len(argv):
        return False
    return os.path.basename(argv[index]) == "vllm" and argv[index + 1:index + 2] == ["serve"]


def listening_ports(pid: int, inodes: set[int], proc: Path = PROC) -> list[tuple[str, int]]:
    """(address, port) of the TCP sockets in LISTEN state whose inode is in `inodes`, as the process's
    network namespace has them."""
    found = {(address, port) for address, port, inode in tcp_listeners(proc / str(pid) / "net") if inode in inodes}
    return sorted(found, key=lambda item: (item[1], item[0]))


def metrics_urls(ports: Iterable[tuple[str, int]]) -> list[str]:
    """The /metrics URLs to try for listening (address, port)s: a wildcard address is reached over
    loopback (:: also over 127.0.0.1, which a dual-stack socket takes too)."""
    urls: list[str] = []
    for address, port in ports:
        hosts = {"0.0.0.0": ["127.0.0.1"], "::": ["::1", "127.0.0.1"]}.get(address, [address])
        for host in hosts:
            url = f"http://[{host}]:{port}/metrics" if ":" in host else f"http://{host}:{port}/metrics"
            if url not in urls:
                urls.append(url)
    return urls


def port_owner(url: str, proc: Path = PROC) -> int:
    """The pid of the local process listening on `url`'s port (0 when no process of the agent's network
    namespace is found): the API server behind a --vllm-metrics-url, so that its figures go to the engines
    it runs. Local means a loopback host, or the exact address a listener is bound to; a wildcard listener
    is matched from loopback only (another address may be another machine). Reads every process's
    descriptors: called once per URL and process, not per scrape."""
    parsed = urllib.parse.urlsplit(url)
    try:  # an address, or localhost: no name lookups from here
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        host = ipaddress.ip_address("127.0.0.1" if parsed.hostname == "localhost" else parsed.hostname or "")
    except ValueError:
        return 0
    inodes: set[int] = set()
    for text, listener_port, inode in tcp_listeners(proc / "net"):
        address = ipaddress.ip_address(text)
        # The URL's host is this listener: its own address, or loopback reaching a wildcard or loopback
        # listener. Any other host may be another machine with the same port open.
        if listener_port == port and (address == host or host.is_loopback
                                      and (address.is_unspecified or address.is_loopback)):
            inodes.add(inode)
    if not inodes:
        return 0
    for pid in sorted(int(name) for name in os.listdir(proc) if name.isdigit()):
        try:
            if socket_inodes(pid, proc) & inodes:
                return pid
        except OSError:
            continue
    return 0


def find_api_servers(proc: Path = PROC) -> list[int]:
    """Pids of the vLLM API servers running now, lowest first."""
    try:
        names = os.listdir(proc)
    except OSError:
        return []
    return sorted(int(name) for name in names if name.isdigit() and is_api_server(read_argv(int(name), proc)))


# ---- parsing (pure) ----


class ScrapeError(Exception):
    """A scrape that gave no figures; the message is one line: what failed and the fix."""


def parse_metrics(text: str) -> tuple[EngineMetrics, ...]:
    """vLLM's exposition as one EngineMetrics per `engine` label (sorted by engine); ScrapeError when
    it has no vllm: series or the lines read are not Prometheus text."""
    wanted_lines, vllm_series = [], False
    for line in text.splitlines():
        if line.startswith("vllm:"):
            vllm_series = True
            name = line[:_name_end(line)]
            if name in _WANTED:
                wanted_lines.append(line)
    if not vllm_series:
        raise ScrapeError("no vllm: series")
    try:
        families = list(text_string_to_metric_families("\n".join(wanted_lines) + "\n"))
    except Exception as error:  # the parser raises ValueError, and others on some malformed lines
        raise ScrapeError(f"not Prometheus text ({str(error)[:80]})") from None
    engines: dict[str, dict[str, object]] = {}
    for family in families:
        for sample in family.samples:
            labels = sample.labels
            engine = engines.setdefault(labels.get("engine", ""), {})
            if "model_name" in labels:
                engine["model_name"] = labels["model_name"]
            value = sample.value
            if sample.name in KV_USAGE:
                # The newer name wins when both are there.
                if sample.name == KV_USAGE[0] or "kv" not in engine:
                    engine["kv"] = _finite(value)
            elif sample.name == RUNNING:
                engine["running"] = _finite(value)
            elif sample.name == WAITING:
                engine["waiting"] = _finite(value)
            elif sample.name == PREEMPTIONS:
                engine["preemptions"] = _finite(value)
            elif sample.name == SLEEP_STATE:
                level = SLEEP_LEVELS.get(labels.get("sleep_state", ""))
                if level is not None and value == 1:
                    engine["sleep"] = level
            elif sample.name == CACHE_CONFIG:
                engine["num_gpu_blocks"] = _label_int(labels.get("num_gpu_blocks"))
                engine["block_size"] = _label_int(labels.get("block_size"))
    return tuple(EngineMetrics(
        engine=name, model_name=str(figures.get("model_name", "")),
        kv_cache_usage_ratio=_optional_float(figures.get("kv")),
        requests_running=_optional_float(figures.get("running")),
        requests_waiting=_optional_float(figures.get("waiting")),
        sleep_level=_optional_int(figures.get("sleep")),
        preemptions_total=_optional_float(figures.get("preemptions")),
        num_gpu_blocks=_optional_int(figures.get("num_gpu_blocks")),
        block_size_tokens=_optional_int(figures.get("block_size")))
        for name, figures in sorted(engines.items(), key=lambda item: _engine_order(item[0])))


def _name_end(line: str) -> int:
    for index, char in enumerate(line):
        if char in "{ \t":
            return index
    return len(line)


def _engine_order(engine: str) -> tuple[int, str]:
    return (int(engine), "") if engine.isdigit() else (1 << 31, engine)


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _label_int(value: str | None) -> int | None:
    """A label holding a count ("55344"; "None" before the engine profiled its memory)."""
    return int(value) if value is not None and value.isdigit() and len(value) < 19 else None


def _optional_float(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) else None


def _optional_int(value: object) -> int | None:
    return value if isinstance(value, int) else None


# ---- fetching ----


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is an error: /metrics never redirects, and a discovered process must not steer the
    agent's requests elsewhere."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # urllib's hook: None refuses it
        return None


# No proxy: http_proxy in the agent's environment must not carry requests meant for 127.0.0.1.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())


def fetch(url: str, timeout_seconds: float = TIMEOUT_SECONDS, max_bytes: int = MAX_RESPONSE_BYTES) -> str:
    """The body of GET `url`; ScrapeError with one line naming what failed and the fix."""
    hint = "check the address, or give vLLM's /metrics with --vllm-metrics-url"
    deadline = time.monotonic() + BODY_SECONDS_PER_TIMEOUT * timeout_seconds
    try:
        with _OPENER.open(urllib.request.Request(url, headers={"Accept": "text/plain"}),
                          timeout=timeout_seconds) as response:
            # In pieces against one deadline: the socket's timeout holds per read, and a server that
            # drips a byte at a time would otherwise hold the scraper (every URL after it) for hours.
            chunks, size = [], 0
            while size <= max_bytes:
                chunk = response.read1(READ_CHUNK_BYTES)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
                if time.monotonic() > deadline:
                    raise ScrapeError(f"GET {url}: the body took more than "
                                      f"{BODY_SECONDS_PER_TIMEOUT * timeout_seconds:g} s ({hint})")
            body = b"".join(chunks)
    except urllib.error.HTTPError as error:
        raise ScrapeError(f"GET {url}: HTTP {error.code} {error.reason} ({hint})") from None
    except urllib.error.URLError as error:
        reason = error.reason
        if isinstance(reason, TimeoutError) or "timed out" in str(reason):
            raise ScrapeError(f"GET {url}: no answer within {timeout_seconds:g} s (the server may still be "
                              "loading the model; else " + hint + ")") from None
        text = reason.strerror if isinstance(reason, OSError) and reason.strerror else str(reason)
        raise ScrapeError(f"GET {url}: {text} ({hint})") from None
    except TimeoutError:
        raise ScrapeError(f"GET {url}: no answer within {timeout_seconds:g} s (the server may still be "
                          "loading the model; else " + hint + ")") from None
    except (OSError, http.client.HTTPException, ValueError) as error:
        raise ScrapeError(f"GET {url}: {str(error)[:120] or type(error).__name__} ({hint})") from None
    if len(body) > max_bytes:
        raise ScrapeError(f"GET {url}: more than {human_bytes(max_bytes)}: not vLLM's /metrics? ({hint})")
    return body.decode("utf-8", "replace")


def scrape(url: str, timeout_seconds: float = TIMEOUT_SECONDS) -> tuple[EngineMetrics, ...]:
    """The engines' figures at `url`; ScrapeError with one line otherwise."""
    text = fetch(url, timeout_seconds)
    try:
        return parse_metrics(text)
    except ScrapeError as error:
        raise ScrapeError(f"{url}: {error} (is it vLLM's OpenAI server? give its /metrics with "
                          "--vllm-metrics-url)") from None


# ---- the scraper ----


@dataclass
class _ApiServer:
    """A discovered API server: which of its URLs answers, once one has."""

    pid: int
    start_ticks: int | None
    url: str = ""  # "" until one of its ports answered /metrics with vllm: series
    tried_url: str = ""  # the URL an error sample was last ingested under, while none answered


class VllmMetricsScraper:
    """Scrapes vLLM's /metrics every `interval_seconds` in its own thread (flag-given URLs, and the API
    servers found in /proc when `discover`) and hands each scrape to the Session, failed ones with their
    error. Component `vllm_metrics`: up when every URL answered; not reported while there is nothing to
    scrape."""

    def __init__(self, session: Session, urls: Iterable[str] = (), discover: bool = True,
                 interval_seconds: float = DEFAULT_INTERVAL_SECONDS, timeout_seconds: float = TIMEOUT_SECONDS,
                 proc: Path = PROC) -> None:
        self.session = session
        self.urls = tuple(dict.fromkeys(urls))[:MAX_URLS]
        self.discover = discover
        self.interval_seconds = interval_seconds
        self.timeout_seconds = timeout_seconds
        self.proc = proc
        self._servers: dict[int, _ApiServer] = {}
        self._ingested_urls: set[str] = set()  # discovered URLs in the Session: dropped when their process goes
        self._reported = False
        self._url_owners: dict[str, tuple[int, int | None, float]] = {}  # url -> (pid, start ticks, looked at)
        self._answered: set[str] = set()  # flag-given URLs looked up right after they first answered
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvtrace-vllm-metrics", daemon=True)
        self._thread.start()

    def stop(self, timeout_seconds: float = 0.5) -> None:
        """Stops scraping; never waits out a slow server (the thread is a daemon and ends after it)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_seconds)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.scrape_once()
            except Exception as error:  # a bug must not end the thread
                log.exception("scraping vLLM's /metrics failed")
                self.session.report_component(COMPONENT, False, f"scraping vLLM's /metrics failed: {error}")
            self._stop.wait(max(0.0, self.interval_seconds - (time.monotonic() - started)))

    def scrape_once(self) -> None:
        """One round: discover, scrape every URL once, ingest, report health."""
        problems: list[str] = []
        notes: list[str] = []  # servers the agent cannot reach by design: said, not counted as down
        scraped: set[str] = set()
        if self.discover:
            self._discover(problems, notes)
            for server in sorted(self._servers.values(), key=lambda server: server.pid):
                if self._stop.is_set():
                    return
                self._scrape_server(server, scraped, problems)
        for url in self.urls:
            if url in scraped or self._stop.is_set():
                continue
            scraped.add(url)
            owner = self._owner(url)
            error = self._scrape_url(url, owner)
            if error:
                problems.append(error)
            elif not owner and self._owner(url, answered=True):  # up now: its process is there to find
                self._scrape_url(url, self._owner(url))
        self._report(scraped, problems, notes)

    def _discover(self, problems: list[str], notes: list[str]) -> None:
        own_namespace = net_namespace("self", self.proc)
        alive = set()
        for pid in find_api_servers(self.proc):
            ticks = start_ticks(pid, self.proc)
            server = self._servers.get(pid)
            if server is None or server.start_ticks != ticks:
                if server is not None:
                    self._drop(server)
                namespace = net_namespace(pid, self.proc)
                if own_namespace is not None and namespace is not None and namespace != own_namespace:
                    # Usual in Kubernetes (the agent's pod has its own network): the plugin reports the
                    # same figures from inside the engine, so this is a note, not a component down.
                    notes.append(f"vLLM API server pid {pid} is in another network namespace (a container?): "
                                    "the agent cannot reach its port; give its /metrics with --vllm-metrics-url")
                    continue
                if len(self._servers) >= MAX_SERVERS:
                    problems.append(f"more than {MAX_SERVERS} vLLM API servers: pid {pid} is not scraped")
                    continue
                server = self._servers[pid] = _ApiServer(pid, ticks)
            alive.add(pid)
        for pid in [pid for pid in self._servers if pid not in alive]:
            self._drop(self._servers.pop(pid))

    def _owner(self, url: str, answered: bool = False) -> int:
        """The pid serving a flag-given URL (0: not found), looked up again when that process is gone
        and, while none is found, at most every OWNER_RETRY_SECONDS, or at once when the URL has just
        `answered` (a server that was not up yet when last looked for)."""
        pid, ticks, looked_at = self._url_owners.get(url, (0, None, -OWNER_RETRY_SECONDS))
        if pid and start_ticks(pid, self.proc) == ticks:
            return pid
        now = time.monotonic()
        if not pid and now - looked_at < OWNER_RETRY_SECONDS and not (answered and url not in self._answered):
            return 0
        if answered:
            self._answered.add(url)
        pid = port_owner(url, self.proc)
        self._url_owners[url] = (pid, start_ticks(pid, self.proc) if pid else None, now)
        return pid

    def _drop(self, server: _ApiServer) -> None:
        """The server is gone: its figures go too (a flag-given URL stays, scraped as such)."""
        for url in (server.url, server.tried_url):
            if url and url in self._ingested_urls and url not in self.urls:
                self._ingested_urls.discard(url)
                self.session.forget_vllm_metrics(url)

    def _scrape_server(self, server: _ApiServer, scraped: set[str], problems: list[str]) -> None:
        if server.url:
            if server.url not in scraped:
                scraped.add(server.url)
                error = self._scrape_url(server.url, server.pid)
                if error:
                    problems.append(error)
            return
        try:
            inodes = socket_inodes(server.pid, self.proc)
        except OSError as error:
            problems.append(f"cannot read /proc/{server.pid}/fd of vLLM API server pid {server.pid}: "
                            f"{error.strerror} (run the agent as root, or give --vllm-metrics-url)")
            return
        urls = [url for url in metrics_urls(listening_ports(server.pid, inodes, self.proc))
                if url not in scraped][:MAX_PORTS_TRIED]
        if not urls:
            problems.append(f"vLLM API server pid {server.pid} listens on no TCP port yet")
            return
        errors = []
        first_timestamp_ns = time.time_ns()
        for url in urls:
            timestamp_ns = time.time_ns()
            try:
                engines = scrape(url, self.timeout_seconds)
            except ScrapeError as error:
                errors.append(str(error))
                continue
            scraped.add(url)
            self._forget_tried(server, url)
            server.url = url
            self._ingest(VllmMetricsSample(url, server.pid, timestamp_ns, engines))
            return
        # None answered: one sample under the first URL says why (the first port's error).
        url = urls[0]
        scraped.add(url)
        self._forget_tried(server, url)
        server.tried_url = url
        failed = errors[0] if len(urls) == 1 else (f"vLLM API server pid {server.pid}: none of its {len(urls)} "
                                                   f"ports served vllm: series; {errors[0]}")
        self._ingest(VllmMetricsSample(url, server.pid, first_timestamp_ns, (), failed))
        problems.append(failed)

    def _forget_tried(self, server: _ApiServer, url: str) -> None:
        """The error sample under another URL of the same server goes: one sample per server."""
        if server.tried_url and server.tried_url != url:
            self._ingested_urls.discard(server.tried_url)
            self.session.forget_vllm_metrics(server.tried_url)
        server.tried_url = ""

    def _scrape_url(self, url: str, pid: int) -> str:
        """Scrapes and ingests `url`; the error ("" when it answered)."""
        timestamp_ns = time.time_ns()
        try:
            engines = scrape(url, self.timeout_seconds)
        except ScrapeError as error:
            self._ingest(VllmMetricsSample(url, pid, timestamp_ns, (), str(error)))
            return str(error)
        self._ingest(VllmMetricsSample(url, pid, timestamp_ns, engines))
        return ""

    def _ingest(self, sample: VllmMetricsSample) -> None:
        if sample.url not in self.urls:
            self._ingested_urls.add(sample.url)
        self.session.ingest(sample)

    def _report(self, scraped: set[str], problems: list[str], notes: Sequence[str] = ()) -> None:
        if not scraped and not problems and not notes:
            if self._reported:  # there were servers; none now
                self.session.report_component(COMPONENT, True, "no vLLM API server running now")
            return
        self._reported = True
        if not problems:
            self.session.report_component(COMPONENT, True, _one_reason(notes) if notes else "")
            return
        self.session.report_component(COMPONENT, False, _one_reason(problems))


def _one_reason(reasons: Sequence[str]) -> str:
    """The first reason, saying how many more, cut to MAX_REASON_CHARS."""
    reason = reasons[0] if len(reasons) == 1 else f"{reasons[0]} (and {len(reasons) - 1} more)"
    if len(reason) > MAX_REASON_CHARS:
        reason = reason[:MAX_REASON_CHARS - 3] + "..."
    return reason
