"""vLLM's /metrics scraped: the exposition of vLLM 0.24 (names and labels of v1/metrics/loggers.py, two
engines, one asleep; tests/unit/data/vllm_0_24_metrics.txt) parsed exactly, served by a real local HTTP
server; every failure (404, timeout, garbage, redirect, too large, refused) a sample with a one-line
error and the component down; the API servers found in a fake /proc tree (cmdline, fd sockets,
net/tcp{,6}, network namespaces); a server that goes takes its figures with it; and the agent's
--vllm-metrics-url checks."""
from __future__ import annotations

import argparse
import http.server
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from kvtrace.cli.agent import AgentCommand
from kvtrace.errors import CommandError
from kvtrace.model.vllm import EngineMetrics, VllmMetricsSample
from kvtrace.session import Session
from kvtrace.sources.procfs import socket_inodes, start_ticks
from kvtrace.sources.vllm.metrics import (
    COMPONENT,
    MetricsSetupError,
    ScrapeError,
    VllmMetricsScraper,
    check_metrics_url,
    fetch,
    find_api_servers,
    is_api_server,
    listening_ports,
    metrics_urls,
    parse_metrics,
)

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
VLLM_METRICS = (Path(__file__).parent / "data" / "vllm_0_24_metrics.txt").read_text()
ENGINES = (
    EngineMetrics(engine="0", model_name=MODEL, kv_cache_usage_ratio=0.4375, requests_running=3.0,
                  requests_waiting=1.0, sleep_level=0, preemptions_total=2.0, num_gpu_blocks=55344,
                  block_size_tokens=16),
    EngineMetrics(engine="1", model_name=MODEL, kv_cache_usage_ratio=0.0, requests_running=0.0,
                  requests_waiting=0.0, sleep_level=1, preemptions_total=0.0, num_gpu_blocks=55344,
                  block_size_tokens=16),
)
OLD_NAMES = """\
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.25
vllm:num_requests_running{model_name="m"} 1.0
vllm:cache_config_info{block_size="32",num_gpu_blocks="None"} 1.0
"""


class _Handler(http.server.BaseHTTPRequestHandler):
    routes: dict[str, tuple[int, bytes]] = {}
    delay_seconds = 0.0

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path == "/slow":
            time.sleep(1.0)
        if self.path == "/drip":  # a byte at a time, each well within the socket's timeout
            self.send_response(200)
            self.end_headers()
            try:
                for _ in range(40):
                    self.wfile.write(b"#")
                    self.wfile.flush()
                    time.sleep(0.05)
            except OSError:
                pass
            return
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "http://127.0.0.1:1/metrics")
            self.end_headers()
            return
        status, body = self.routes.get(self.path, (404, b"not found\n"))
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except OSError:
            pass

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    """A real HTTP server on 127.0.0.1: /metrics serves vLLM's exposition; other paths as set."""
    handler = type("Handler", (_Handler,), {"routes": {
        "/metrics": (200, VLLM_METRICS.encode()),
        "/garbage": (200, b"<html><body>hello</body></html>\n"),
        "/malformed": (200, b'vllm:kv_cache_usage_perc{engine="0" 0.5\n'),
        "/old": (200, OLD_NAMES.encode()),
        "/error": (500, b"Internal Server Error\n"),
    }})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", httpd
    httpd.shutdown()
    httpd.server_close()


def components(session: Session) -> dict:
    return {c.name: c for c in session.components()}


# ---- parsing ----


def test_vllm_0_24_exposition_is_parsed_exactly():
    assert parse_metrics(VLLM_METRICS) == ENGINES


def test_older_names_and_a_cache_not_yet_profiled():
    assert parse_metrics(OLD_NAMES) == (EngineMetrics(
        engine="", model_name="m", kv_cache_usage_ratio=0.25, requests_running=1.0, requests_waiting=None,
        sleep_level=None, preemptions_total=None, num_gpu_blocks=None, block_size_tokens=32),)


def test_the_newer_usage_name_wins_when_both_are_there():
    text = ('vllm:kv_cache_usage_perc{engine="0"} 0.5\n'
            'vllm:gpu_cache_usage_perc{engine="0"} 0.9\n')
    assert parse_metrics(text)[0].kv_cache_usage_ratio == 0.5


def test_a_look_alike_series_is_not_taken_for_the_real_one():
    text = ('vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 7.0\n'
            'vllm:num_requests_running{engine="0"} 1.0\n')
    assert parse_metrics(text)[0].requests_waiting is None


@pytest.mark.parametrize("text, says", [
    ("<html>hello</html>\n", "no vllm: series"),
    ("", "no vllm: series"),
    ('vllm:kv_cache_usage_perc{engine="0" 0.5\n', "not Prometheus text"),
])
def test_text_that_is_not_vllms_metrics(text, says):
    with pytest.raises(ScrapeError, match=says):
        parse_metrics(text)


# ---- scraping over HTTP ----


def test_scraping_a_url_ingests_its_engines_and_reports_up(server):
    base, _ = server
    session = Session()
    scraper = VllmMetricsScraper(session, urls=(f"{base}/metrics",), discover=False)
    before_ns = time.time_ns()
    scraper.scrape_once()
    sample = session.vllm_view().metrics[f"{base}/metrics"]
    assert before_ns <= sample.timestamp_ns <= time.time_ns()
    # the process listening on the URL's port (this one) is taken for the API server
    assert sample == VllmMetricsSample(f"{base}/metrics", os.getpid(), sample.timestamp_ns, ENGINES, "")
    assert components(session)[COMPONENT].up


@pytest.mark.parametrize("path, says", [
    ("/nothing", "HTTP 404 Not Found (check the address, or give vLLM's /metrics with --vllm-metrics-url)"),
    ("/error", "HTTP 500"),
    ("/slow", "no answer within 0.3 s (the server may still be loading the model"),
    ("/garbage", "no vllm: series (is it vLLM's OpenAI server? give its /metrics with --vllm-metrics-url)"),
    ("/malformed", "not Prometheus text"),
    ("/redirect", "HTTP 302"),
    ("/drip", "the body took more than 0.75 s"),
])
def test_a_failed_scrape_is_a_sample_with_an_error_and_the_component_down(path, says, server):
    base, _ = server
    url = f"{base}{path}"
    session = Session()
    scraper = VllmMetricsScraper(session, urls=(url,), discover=False, timeout_seconds=0.3)
    started = time.monotonic()
    scraper.scrape_once()
    assert time.monotonic() - started < 1.5
    sample = session.vllm_view().metrics[url]
    assert sample.engines == () and says in sample.error, sample.error
    assert "\n" not in sample.error and url in sample.error
    component = components(session)[COMPONENT]
    assert not component.up and component.reason == sample.error


def test_a_refused_connection_names_the_fix():
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(ScrapeError, match=r"Connection refused \(check the address, or give vLLM's /metrics"):
        fetch(f"http://127.0.0.1:{port}/metrics", 0.5)


def test_a_response_too_large_is_refused(server):
    base, _ = server
    with pytest.raises(ScrapeError, match="more than 1000 B: not vLLM's /metrics"):
        fetch(f"{base}/metrics", max_bytes=1000)


def test_the_proxy_of_the_environment_is_not_used(server, monkeypatch):
    base, _ = server
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:1")
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:1")
    assert parse_metrics(fetch(f"{base}/metrics")) == ENGINES


def test_one_failing_url_of_two_names_it_and_counts_the_rest(server):
    base, _ = server
    session = Session()
    VllmMetricsScraper(session, urls=(f"{base}/metrics", f"{base}/a", f"{base}/b"), discover=False).scrape_once()
    component = components(session)[COMPONENT]
    assert not component.up and component.reason.endswith("(and 1 more)") and f"{base}/a" in component.reason


def test_nothing_to_scrape_reports_nothing(tmp_path):
    session = Session()
    (tmp_path / "self" / "ns").mkdir(parents=True)
    VllmMetricsScraper(session, discover=True, proc=tmp_path).scrape_once()
    assert COMPONENT not in components(session)
    assert session.vllm_view().metrics == {}


def test_the_thread_scrapes_once_per_interval_and_stops(server):
    base, httpd = server
    hits = []
    handler = httpd.RequestHandlerClass
    original = handler.do_GET

    def counting(self):
        hits.append(time.monotonic())
        original(self)

    handler.do_GET = counting
    scraper = VllmMetricsScraper(Session(), urls=(f"{base}/metrics",), discover=False, interval_seconds=0.2)
    scraper.start()
    time.sleep(0.5)
    started = time.monotonic()
    scraper.stop()
    assert time.monotonic() - started < 0.6
    assert 2 <= len(hits) <= 4
    assert all(b - a >= 0.15 for a, b in zip(hits, hits[1:], strict=False))


# ---- discovery over a fake /proc ----


def tcp_line(slot: int, address_hex: str, port: int, state: str, inode: int) -> str:
    return (f"{slot:4d}: {address_hex}:{port:04X} 00000000:0000 {state} 00000000:00000000 00:00000000 00000000"
            f"     0        0 {inode} 1 0000000000000000 100 0 0 10 0")


TCP_HEADER = ("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode")
TCP6_HEADER = ("  sl  local_address                         remote_address                        st tx_queue "
               "rx_queue tr tm->when retrnsmt   uid  timeout inode")


def make_process(proc: Path, pid: int, argv: list[str], namespace: str = "net:[4026531840]",
                 sockets: dict[int, int] | None = None, tcp: list[str] = (), tcp6: list[str] = (),
                 ticks: int = 12345) -> None:
    """/proc/PID with the files discovery reads; `sockets`: fd -> socket inode."""
    directory = proc / str(pid)
    (directory / "ns").mkdir(parents=True)
    (directory / "fd").mkdir()
    (directory / "net").mkdir()
    (directory / "cmdline").write_bytes(b"\0".join(arg.encode() for arg in argv) + b"\0")
    (directory / "stat").write_text(f"{pid} (python3) S 1 {pid} {pid} 0 -1 4194560 100 0 0 0 5 3 0 0 20 0 "
                                    f"12 0 {ticks} 1000000 100 18446744073709551615\n")
    os.symlink(namespace, directory / "ns" / "net")
    os.symlink("/dev/null", directory / "fd" / "0")
    os.symlink("pipe:[777]", directory / "fd" / "1")
    for fd, inode in (sockets or {}).items():
        os.symlink(f"socket:[{inode}]", directory / "fd" / str(fd))
    (directory / "net" / "tcp").write_text("\n".join([TCP_HEADER, *tcp]) + "\n")
    (directory / "net" / "tcp6").write_text("\n".join([TCP6_HEADER, *tcp6]) + "\n")


@pytest.fixture
def proc(tmp_path):
    (tmp_path / "self" / "ns").mkdir(parents=True)
    os.symlink("net:[4026531840]", tmp_path / "self" / "ns" / "net")
    return tmp_path


@pytest.mark.parametrize("argv, expected", [
    (["/usr/bin/python3", "/opt/venv/bin/vllm", "serve", "meta-llama/Llama-3.1-8B", "--port", "8000"], True),
    (["/opt/venv/bin/vllm", "serve", "model"], True),
    (["python3", "-u", "/opt/venv/bin/vllm", "serve", "model"], True),
    (["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "m"], True),
    (["python", "-m", "vllm.entrypoints.cli.main", "serve", "m"], True),
    (["VLLM::APIServer_0" + " " * 40], True),  # setproctitle: one element, padded
    (["VLLM::APIServer"], True),
    (["/opt/venv/bin/vllm", "serve", "model", "--headless"], False),  # engines only, no HTTP server
    (["VLLM::EngineCore"], False),
    (["VLLM::Worker_TP0"], False),
    (["python", "-m", "vllm.entrypoints.cli.main", "bench", "serve"], False),
    (["/opt/venv/bin/vllm", "bench", "serve"], False),
    (["bash", "-c", "vllm serve model"], False),
    (["grep", "vllm", "serve"], False),
    (["python3", "-c", "pass", "vllm", "serve"], False),
    (["python3", "-X", "dev", "/venv/bin/vllm", "serve", "m"], True),
    (["python3", "/venv/bin/other", "vllm", "serve"], False),
    (["python3"], False),
    ([], False),
])
def test_is_api_server(argv, expected):
    assert is_api_server(argv) is expected


def test_listening_ports_from_fd_inodes_and_tcp_tables(proc):
    make_process(proc, 100, ["vllm", "serve", "m"], sockets={5: 5000, 6: 5001, 7: 5002, 8: 5003, 9: 5004},
                 tcp=[tcp_line(0, "00000000", 8000, "0A", 5000),  # 0.0.0.0:8000 LISTEN
                      tcp_line(1, "0100007F", 8000, "01", 5001),  # an established connection: not a port
                      tcp_line(2, "0100007F", 9100, "0A", 5002),  # 127.0.0.1:9100
                      tcp_line(3, "00000000", 22, "0A", 999)],  # another process's
                 tcp6=[tcp_line(0, "00000000000000000000000000000000", 8001, "0A", 5003),  # [::]:8001
                       tcp_line(1, "0000000000000000FFFF00000500000A", 8002, "0A", 5004)])  # ::ffff:10.0.0.5
    inodes = socket_inodes(100, proc)
    assert inodes == {5000, 5001, 5002, 5003, 5004}
    ports = listening_ports(100, inodes, proc)
    assert ports == [("0.0.0.0", 8000), ("::", 8001), ("10.0.0.5", 8002), ("127.0.0.1", 9100)]
    assert metrics_urls(ports) == ["http://127.0.0.1:8000/metrics", "http://[::1]:8001/metrics",
                                   "http://127.0.0.1:8001/metrics", "http://10.0.0.5:8002/metrics",
                                   "http://127.0.0.1:9100/metrics"]
    assert start_ticks(100, proc) == 12345


def test_find_api_servers(proc):
    make_process(proc, 300, ["/bin/bash"])
    make_process(proc, 100, ["python3", "/venv/bin/vllm", "serve", "m"])
    make_process(proc, 200, ["VLLM::APIServer_1"])
    make_process(proc, 150, ["VLLM::EngineCore"])
    (proc / "cpuinfo").write_text("")
    assert find_api_servers(proc) == [100, 200]


def test_discovery_scrapes_the_port_that_serves_vllm_and_drops_it_when_the_process_goes(proc, server):
    base, _ = server
    good_port = int(base.rsplit(":", 1)[1])
    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)  # answers 404 to everything
    threading.Thread(target=other.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        other_port = other.server_address[1]
        make_process(proc, 100, ["python3", "/venv/bin/vllm", "serve", MODEL], sockets={10: 7001, 11: 7002},
                     tcp=[tcp_line(0, "00000000", other_port, "0A", 7001),
                          tcp_line(1, "0100007F", good_port, "0A", 7002)])
        make_process(proc, 200, ["VLLM::APIServer_0"], namespace="net:[4026532999]", sockets={3: 8000},
                     tcp=[tcp_line(0, "00000000", 8000, "0A", 8000)])
        make_process(proc, 300, ["/usr/sbin/sshd"])
        session = Session()
        scraper = VllmMetricsScraper(session, discover=True, proc=proc, timeout_seconds=1.0)
        scraper.scrape_once()
        url = f"http://127.0.0.1:{good_port}/metrics"
        view = session.vllm_view()
        assert list(view.metrics) == [url]
        sample = view.metrics[url]
        assert (sample.api_server_pid, sample.engines, sample.error) == (100, ENGINES, "")
        component = components(session)[COMPONENT]
        assert component.up  # unreachable by design (the plugin reports from inside): said, not down
        assert component.reason == ("vLLM API server pid 200 is in another network namespace (a container?): the "
                                    "agent cannot reach its port; give its /metrics with --vllm-metrics-url")

        # Cached: the next round goes straight to the port that answered, without reading the tables.
        (proc / "100" / "net" / "tcp").write_text(TCP_HEADER + "\n")
        scraper.scrape_once()
        assert session.vllm_view().metrics[url].timestamp_ns > sample.timestamp_ns

        # The container's server is given by flag now; pid 200 gone: all up.
        (proc / "200" / "cmdline").write_bytes(b"")
        scraper.urls = (f"{base}/metrics",)  # the same URL as discovered: scraped once, as pid 100's
        scraper.scrape_once()
        assert components(session)[COMPONENT].up
        assert session.vllm_view().metrics[url].api_server_pid == 100

        # The process goes: its figures go with it, and nothing is left to report on but the flag's.
        scraper.urls = ()
        for path in sorted((proc / "100").rglob("*"), reverse=True):
            path.unlink() if path.is_file() or path.is_symlink() else path.rmdir()
        (proc / "100").rmdir()
        scraper.scrape_once()
        assert session.vllm_view().metrics == {}
        component = components(session)[COMPONENT]
        assert component.up and component.reason == "no vLLM API server running now"
    finally:
        other.shutdown()
        other.server_close()


def test_a_pid_reused_by_another_server_is_discovered_afresh(proc, server):
    base, _ = server
    port = int(base.rsplit(":", 1)[1])
    make_process(proc, 100, ["vllm", "serve", "m"], sockets={3: 1}, tcp=[tcp_line(0, "0100007F", port, "0A", 1)])
    session = Session()
    scraper = VllmMetricsScraper(session, proc=proc)
    scraper.scrape_once()
    assert scraper._servers[100].url == f"{base}/metrics"
    (proc / "100" / "stat").write_text("100 (python3) S 1 100 100 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 99999 1 1\n")
    scraper.scrape_once()
    assert scraper._servers[100].start_ticks == 99999


def test_a_server_not_listening_yet_or_not_answering(proc, server):
    base, _ = server
    make_process(proc, 100, ["vllm", "serve", "m"])
    session = Session()
    scraper = VllmMetricsScraper(session, proc=proc, timeout_seconds=0.3)
    scraper.scrape_once()
    component = components(session)[COMPONENT]
    assert not component.up and component.reason == "vLLM API server pid 100 listens on no TCP port yet"
    assert session.vllm_view().metrics == {}

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead_port = closed.getsockname()[1]
    (proc / "100" / "net" / "tcp").write_text("\n".join([TCP_HEADER, tcp_line(0, "0100007F", dead_port, "0A", 42)]))
    os.symlink("socket:[42]", proc / "100" / "fd" / "9")
    scraper.scrape_once()
    url = f"http://127.0.0.1:{dead_port}/metrics"
    sample = session.vllm_view().metrics[url]
    assert sample.api_server_pid == 100 and "Connection refused" in sample.error
    assert components(session)[COMPONENT].reason == sample.error


def test_unreadable_fds_say_what_to_do(proc, monkeypatch):
    make_process(proc, 100, ["vllm", "serve", "m"])
    os.chmod(proc / "100" / "fd", 0)
    if os.access(proc / "100" / "fd", os.R_OK):  # root reads anyway
        (proc / "100" / "fd").chmod(0o755)
        for entry in (proc / "100" / "fd").iterdir():
            entry.unlink()
        (proc / "100" / "fd").rmdir()
        (proc / "100" / "fd").write_text("")  # not a directory: listdir fails as it would without access
    session = Session()
    VllmMetricsScraper(session, proc=proc).scrape_once()
    reason = components(session)[COMPONENT].reason
    assert reason.startswith("cannot read /proc/100/fd of vLLM API server pid 100: ")
    assert reason.endswith("(run the agent as root, or give --vllm-metrics-url)")


# ---- the agent's flag ----


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000/metrics", "https://vllm.internal/metrics",
                                 "http://[::1]:8000/metrics"])
def test_good_urls(url):
    assert check_metrics_url(url) == url


@pytest.mark.parametrize("url, says", [
    ("ftp://host/metrics", "is not an http(s) URL with a host"),
    ("127.0.0.1:8000/metrics", "is not an http(s) URL with a host"),
    ("http:///metrics", "is not an http(s) URL with a host"),
    ("http://host:99999/metrics", "Port out of range"),
    ("http://host:port/metrics", "Port could not be cast"),
    ("http://host/me trics", "is not a URL"),
    ("http://host/\x1b[2J", "is not a URL"),
    ("http://" + os.fsdecode(b"\xff") + "/metrics", "is not UTF-8 text"),
])
def test_bad_urls_are_one_line(url, says):
    with pytest.raises(MetricsSetupError) as raised:
        check_metrics_url(url)
    assert says in str(raised.value) and "\n" not in str(raised.value)
    assert str(raised.value).startswith("--vllm-metrics-url: ")


def agent_options(*flags: str):
    parser = argparse.ArgumentParser()
    AgentCommand().prepare_parser(parser)
    return AgentCommand._options(parser.parse_args(["--metrics-listen", "off", "--no-api", *flags]))


def test_agent_takes_repeated_urls_and_no_discovery(monkeypatch):
    monkeypatch.delenv("KVTRACE_CONFIG", raising=False)
    options = agent_options("--vllm-metrics-url", "http://a:1/metrics", "--vllm-metrics-url", "http://b:2/metrics",
                            "--vllm-metrics-url", "http://a:1/metrics", "--no-vllm-discovery")
    assert options.vllm_metrics_urls == ("http://a:1/metrics", "http://b:2/metrics")
    assert options.vllm_discover is False


def test_agent_refuses_a_bad_url_with_one_line(monkeypatch):
    monkeypatch.delenv("KVTRACE_CONFIG", raising=False)
    with pytest.raises(CommandError) as raised:
        agent_options("--vllm-metrics-url", "localhost:8000")
    assert str(raised.value) == ("--vllm-metrics-url: 'localhost:8000' is not an http(s) URL with a host "
                                 "(give e.g. http://127.0.0.1:8000/metrics)")


def test_a_flag_given_url_is_tied_to_the_process_listening_on_its_port(tmp_path):
    """--vllm-metrics-url http://127.0.0.1:PORT/metrics: the process that listens there is the API server
    (so that its figures go to the engines it runs); another port, another address or a remote host: 0."""
    from kvtrace.sources.vllm.metrics import port_owner

    proc = tmp_path / "proc"
    make_process(proc, 41, ["python3", "launcher.py"], sockets={5: 9001})
    make_process(proc, 42, ["/usr/sbin/sshd"], sockets={3: 9002})
    (proc / "net").mkdir()
    (proc / "net" / "tcp").write_text("\n".join([TCP_HEADER, tcp_line(0, "0100007F", 8000, "0A", 9001),
                                                 tcp_line(1, "00000000", 22, "0A", 9002),
                                                 tcp_line(2, "0100007F", 8001, "01", 9003)]) + "\n")
    assert port_owner("http://127.0.0.1:8000/metrics", proc) == 41
    assert port_owner("http://localhost:8000/metrics", proc) == 41
    assert port_owner("http://127.0.0.1:22/metrics", proc) == 42  # a wildcard listener takes loopback too
    assert port_owner("http://127.0.0.1:8001/metrics", proc) == 0  # established, not listening
    assert port_owner("http://10.1.2.3:8000/metrics", proc) == 0  # 127.0.0.1 only: not that address
    assert port_owner("http://10.1.2.3:22/metrics", proc) == 0  # a wildcard here, but maybe another machine
    assert port_owner("http://vllm.example:8000/metrics", proc) == 0  # no name lookups


def test_a_flag_given_url_that_comes_up_later_is_tied_to_its_process_at_once(server):
    """The agent usually starts before vLLM: the URL's process is looked for again as soon as the URL
    answers, not only every OWNER_RETRY_SECONDS."""
    base, _ = server
    url = f"{base}/metrics"
    session = Session()
    scraper = VllmMetricsScraper(session, urls=(url,), discover=False)
    scraper._url_owners[url] = (0, None, time.monotonic())  # looked for a moment ago, before it was up
    scraper.scrape_once()
    assert session.vllm_view().metrics[url].api_server_pid == os.getpid()
