"""The real `kvtrace agent` as a subprocess, serving on a temporary socket."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KVTRACE = [sys.executable, "-m", "kvtrace.cli.main"]


class AgentProcess:
    def __init__(self, socket: Path, *args: str, env: dict[str, str] | None = None) -> None:
        """The vLLM plugin's and the CUPTI tracers' sockets and the flight recorder's dumps go next to
        `socket` unless `args` say where (never the host's /run/kvtrace-vllm, /run/kvtrace-cupti or
        /var/lib/kvtrace: tests run agents side by side, and must not write into the host's state)."""
        self.socket = socket
        if "--vllm-socket" not in args:
            args = (*args, "--vllm-socket", str(socket.parent / f"{socket.stem}-vllm.sock"))
        if "--cupti-socket" not in args:
            args = (*args, "--cupti-socket", str(socket.parent / f"{socket.stem}-cupti.sock"))
        if "--flight-dir" not in args:
            args = (*args, "--flight-dir", str(socket.parent / f"{socket.stem}-flight"))
        self._stderr = tempfile.TemporaryFile(mode="w+")
        self._stdout = tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen(
            [*KVTRACE, "agent", "--socket", str(socket), "--group", "root",
             "--metrics-listen", "127.0.0.1:0", *args],
            stdout=self._stdout, stderr=self._stderr, text=True, env=env)
        deadline = time.monotonic() + 60
        while "Hit Ctrl-C to end." not in self.stderr_text():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"agent did not start:\n{self.stderr_text()}")
            time.sleep(0.1)

    def stderr_text(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read()

    def counters(self) -> dict[str, int]:
        """The agent's counters, as GetAgentInfo gives them."""
        from kvtrace.client import AgentClient

        with AgentClient.for_socket(self.socket) as client:
            return dict(client.info().counters)

    def stdout_lines(self) -> list[str]:
        self._stdout.seek(0)
        return self._stdout.read().splitlines()

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(timeout=90)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait()

    def __enter__(self) -> AgentProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        self._stderr.close()
        self._stdout.close()


def wait_until_tracing(agent: subprocess.Popen) -> str:
    """Reads the agent's stderr (a text pipe) up to its "Hit Ctrl-C to end." line, which it returns;
    fails if the agent exits first."""
    assert agent.stderr is not None
    line = agent.stderr.readline()
    while "Hit Ctrl-C" not in line:
        assert line, "the agent exited before tracing"
        line = agent.stderr.readline()
    return line


def kvtrace(*args: str, user: int | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    """Runs a kvtrace client command; `user` drops to that uid/gid with no groups (setpriv)."""
    prefix = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups"] if user is not None else []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run([*prefix, *KVTRACE, *args], capture_output=True, text=True, timeout=timeout,
                          env=env)
