"""The agent without its probes: `--tracing off` and the kill switch serve NVML's figures, and say so.

No BPF here: the daemon runs with tracing off, so everything but the probes is real.
"""
import io
import threading

from kvtrace.daemon import Daemon, DaemonOptions


def _components(daemon):
    return {c.name: c for c in daemon.session.components()}


def test_tracing_off_runs_without_probes_and_says_why(tmp_path):
    err = io.StringIO()
    daemon = Daemon(DaemonOptions(api=None, nvml=False, tracing="off", off_switch=str(tmp_path / "off"),
                                  vllm_socket="", vllm_discover=False),
                    out=io.StringIO(), err=err)
    daemon.start()
    daemon.announce()
    runner = threading.Thread(target=daemon.run)
    runner.start()
    try:
        assert daemon.source is None
        bpf = _components(daemon)["bpf"]
        assert not bpf.up and "--tracing off" in bpf.reason
        assert "Not tracing (tracing is off (--tracing off)" in err.getvalue()
        assert "Hit Ctrl-C to end." in err.getvalue()
    finally:
        daemon.request_stop()
        runner.join(5)
        daemon.stop()
    assert not runner.is_alive()


def test_probes_that_cannot_load_here_leave_nvml_only_in_auto_mode(tmp_path):
    daemon = Daemon(DaemonOptions(api=None, nvml=False, tracing="auto", vllm_socket="", vllm_discover=False,
                                  tracing_unavailable="cannot load BPF without privileges: run as root"),
                    out=io.StringIO(), err=io.StringIO())
    daemon.start()
    try:
        assert daemon.source is None
        bpf = _components(daemon)["bpf"]
        assert not bpf.up and bpf.reason == "cannot trace here: cannot load BPF without privileges: run as root"
        (tmp_path / "off").touch()
        daemon._check_off_switch()  # failed for good: the switch does not retry the load
        assert daemon.source is None
    finally:
        daemon.stop()
