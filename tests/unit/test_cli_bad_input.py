"""Bad input to every command ends in one line on stderr that names the fix and a non-zero exit,
never a traceback: bad flag values (out-of-range numbers, non-numbers, bytes that are not UTF-8),
paths of the wrong kind (a directory, a regular file where the socket should be, a path through a
file), config files that are binary, too large, not TOML or of the wrong shape, and `kvtrace doctor`
run without root. Each case here failed before the fix: a traceback, usage text over several lines,
or a line that did not say what was wrong. The agent cases never reach BPF."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

from fake_agent import FakeAgent, event, served
from kvtrace.cli.main import main
from kvtrace.errors import ExitCode

NOT_UTF8 = os.fsdecode(b"\xff\xfe")  # what Python makes of argv bytes that are not UTF-8
LONG_NAME = "x" * 120  # a Unix socket path has at most 107 bytes
REPO = Path(__file__).resolve().parents[2]


class _ReachedTracing(Exception):
    """The agent got past its flag checks: a bad flag was not refused."""


@pytest.fixture(scope="module")
def agent_socket():
    """A served fake agent, so that client requests are really built and sent."""
    backend = FakeAgent()
    backend.apply(event())
    with served(backend) as (server, _):
        yield str(server.config.socket)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    directory = tmp_path_factory.mktemp("bad_input")
    paths = {
        "binary": (directory / "binary.toml", Path(sys.executable).read_bytes()[:4096]),
        "invalid": (directory / "invalid.toml", b"[api\nsocket = "),
        "unknown": (directory / "unknown.toml", b'[api]\nsockett = "/run/x.sock"\n'),
        "wrong_type": (directory / "wrong_type.toml", b"[api]\nsocket = 5\n"),
        "deep": (directory / "deep.toml", b"a = " + b"[" * 100_000 + b"]" * 100_000 + b"\n"),
        "regular": (directory / "regular", b"not a socket"),
    }
    for path, content in paths.values():
        path.write_bytes(content)
    (directory / "adir").mkdir()
    found = {name: str(path) for name, (path, _) in paths.items()}
    found["dir"] = str(directory / "adir")
    found["long"] = f"/tmp/{LONG_NAME}"
    return found


def run_cli(argv: list[str], capfd) -> tuple[int | None, str]:
    """(exit code, stderr) of `kvtrace ARGV` run here; an escaping exception is its traceback."""
    escaped = ""
    try:
        code = main(argv)
    except SystemExit as exit_info:
        code = exit_info.code if isinstance(exit_info.code, int) else 1
    except BaseException:  # noqa: BLE001 - the point of the test
        code, escaped = None, traceback.format_exc()
    return code, capfd.readouterr().err + escaped


def assert_one_clear_line(code: int | None, stderr: str, exit_code: ExitCode, says: str) -> None:
    assert "Traceback" not in stderr, stderr
    assert len(stderr.splitlines()) == 1, stderr
    assert code == exit_code, stderr
    assert says in stderr, stderr


# (argv; {placeholders} are files' keys; exit code; what the line says)
CLIENT_CASES = [
    # -p beyond 32 bits: ValueError from the protobuf request, a traceback (all four commands)
    (["tail", "-p", "99999999999"], ExitCode.USAGE, "not a process id (1 to 4194304)"),
    (["snapshot", "-p", "4294967296"], ExitCode.USAGE, "not a process id"),
    (["leaks", "-p", "99999999999"], ExitCode.USAGE, "not a process id"),
    (["top", "--once", "-p", "99999999999"], ExitCode.USAGE, "not a process id"),
    (["tail", "-p", "²"], ExitCode.USAGE, "not a process id"),  # isdigit() but not int()
    # --min-size beyond 64 bits: the same ValueError; 400 digits: OverflowError from int(inf)
    (["tail", "--min-size", "99999999999T"], ExitCode.USAGE, "more than 1 PiB"),
    (["tail", "--min-size", "9" * 400], ExitCode.USAGE, "more than 1 PiB"),
    # argv bytes that are not UTF-8: UnicodeEncodeError from protobuf / gRPC
    (["tail", "--cmdline", NOT_UTF8], ExitCode.USAGE, "--cmdline is not UTF-8 text"),
    (["ps", "--socket", f"/tmp/{NOT_UTF8}"], ExitCode.USAGE, "is not UTF-8 text"),
    # socket paths of the wrong kind
    (["ps", "--socket", "{regular}/x"], ExitCode.USAGE, "Not a directory"),  # NotADirectoryError
    (["ps", "--socket", "{regular}"], ExitCode.USAGE, "is not a socket"),  # "does not answer"
    (["leaks", "--socket", "{dir}"], ExitCode.USAGE, "is not a socket"),
    (["ps", "--socket", "{long}"], ExitCode.USAGE, "choose a shorter one"),  # gRPC's log lines
    # config files (there was no --config; $KVTRACE_CONFIG below)
    (["ps", "--config", "{binary}"], ExitCode.USAGE, "not a TOML text file"),
    (["ps", "--config", "{invalid}"], ExitCode.USAGE, "not valid TOML"),
    (["ps", "--config", "{unknown}"], ExitCode.USAGE, "[api] sockett is not a setting"),
    (["top", "--once", "--config", "{wrong_type}"], ExitCode.USAGE, "[api] socket must be a string"),
    (["ps", "--config", "{deep}"], ExitCode.USAGE, "not valid TOML"),  # RecursionError
    (["ps", "--config", "/dev/zero"], ExitCode.USAGE, "larger than 1 MiB"),  # read forever
    (["ps", "--config", "{dir}"], ExitCode.USAGE, "Is a directory"),
    (["ps", "--config", "/nonexistent/kvtrace.toml"], ExitCode.USAGE, "there is no file"),
    # argparse's own errors: usage over several lines, then the error
    (["ps", "--bogus"], ExitCode.USAGE, "unrecognized arguments: --bogus"),
    (["tail", "--layer", "nope"], ExitCode.USAGE, "invalid choice: 'nope'"),
    (["leaks", "-n", "0"], ExitCode.USAGE, "not a count from 1 to 10000"),
    (["top", "--interval", "nan"], ExitCode.USAGE, "not an interval"),
    (["doctor", "-p", "99999999999999999999"], ExitCode.USAGE, "not a process id"),
    (["nonsense"], ExitCode.USAGE, "invalid choice: 'nonsense'"),
]


@pytest.mark.parametrize("argv, exit_code, says", CLIENT_CASES, ids=lambda value: repr(value)[:60])
def test_client_bad_input_is_one_line(argv, exit_code, says, files, agent_socket, capfd, monkeypatch):
    monkeypatch.delenv("KVTRACE_SOCKET", raising=False)
    monkeypatch.delenv("KVTRACE_CONFIG", raising=False)
    argv = [arg.format(**files) for arg in argv]
    if argv[0] in ("ps", "tail", "snapshot", "leaks", "top") and "--socket" not in argv:
        argv += ["--socket", agent_socket]
    assert_one_clear_line(*run_cli(argv, capfd), exit_code, says)


@pytest.mark.parametrize("name, says", [("binary", "not a TOML text file"), ("unknown", "is not a setting")])
def test_config_from_the_environment_is_checked_too(name, says, files, capfd, monkeypatch):
    monkeypatch.setenv("KVTRACE_CONFIG", files[name])
    monkeypatch.delenv("KVTRACE_SOCKET", raising=False)
    assert_one_clear_line(*run_cli(["ps"], capfd), ExitCode.USAGE, says)


AGENT_CASES = [
    # passed the checks, then the kernel refused the map after 13 s of compiling: 22 lines
    (["--max-ledger-entries", "99999999999999"], "--max-ledger-entries: takes a whole number from 1024 to"),
    (["--max-ledger-entries", "x"], "takes a whole number from 1024 to 67108864, not 'x'"),  # was 14 lines
    (["--max-totals", "10"], "--max-totals: takes a whole number from 1024 to"),
    # refused by the server only after BPF was loaded, or a UnicodeEncodeError there
    (["--socket", "{regular}"], "is a file that is not a socket"),
    (["--socket", "{dir}"], "is a directory"),
    (["--socket", f"/tmp/{NOT_UTF8}/kvtrace.sock"], "is not UTF-8 text"),
    (["--socket", "{long}"], "choose a shorter one"),
    (["--admin-socket", "{regular}"], "is a file that is not a socket"),
    (["--tcp-listen", "127.0.0.1:0", "--tls-cert", "/nonexistent.crt", "--tls-key", "/nonexistent.key",
      "--tls-client-ca", "/nonexistent.ca"], "--tls-cert: cannot read /nonexistent.crt"),
    (["--tcp-listen", "127.0.0.1:0", "--tls-cert", "{dir}", "--tls-key", "{regular}", "--tls-client-ca",
      "{regular}"], "is not a file: give the PEM file"),
    (["--config", "{binary}"], "not a TOML text file"),
    (["--config", "{wrong_type}"], "must be a string, not int"),
]


@pytest.mark.parametrize("flags, says", AGENT_CASES, ids=lambda value: repr(value)[:60])
def test_agent_refuses_bad_flags_before_tracing(flags, says, files, capfd, monkeypatch):
    from kvtrace.sources.bpf import preflight

    def reached(*args, **kwargs):
        raise _ReachedTracing("the agent went on to load BPF with a bad flag")

    monkeypatch.setattr(preflight, "require_tracing", reached)
    monkeypatch.delenv("KVTRACE_CONFIG", raising=False)
    monkeypatch.delenv("KVTRACE_SOCKET", raising=False)
    argv = ["agent", "--metrics-listen", "off", *(flag.format(**files) for flag in flags)]
    assert_one_clear_line(*run_cli(argv, capfd), ExitCode.USAGE, says)


# ---- without root -------------------------------------------------------------------------------

def _unprivileged(argv: list[str]) -> subprocess.CompletedProcess:
    """`kvtrace ARGV` as nobody (as this user when it is not root)."""
    command = [sys.executable, "-m", "kvtrace.cli.main", *argv]
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("needs setpriv to drop root")
        command = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", *command]
    environment = {key: value for key, value in os.environ.items() if not key.startswith("KVTRACE_")}
    environment["PYTHONPATH"] = str(REPO / "agent")
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=environment, cwd="/")
    if "Permission denied" in result.stderr and "python" in result.stderr.split(":", 1)[0]:
        pytest.skip(f"nobody cannot run this interpreter: {result.stderr.strip()}")
    return result


def test_doctor_without_root_checks_what_it_can_and_names_the_rest():
    """Regression: tracefs is root's alone, and `kvtrace doctor` died with PermissionError from
    Path.exists(). Now every check prints a line; one it may not make says to run it with sudo."""
    result = _unprivileged(["doctor"])
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == ExitCode.PERMISSION, result.stdout + result.stderr
    names = [line[6:].split(":", 1)[0] for line in result.stdout.splitlines()]
    assert names == ["permissions", "kernel config", "btf", "tracefs", "kernel headers", "bcc",
                     "uretprobe seccomp"], result.stdout
    assert result.stdout.startswith("FAIL  permissions: cannot load BPF without privileges")
    for line in result.stdout.splitlines():
        if "not checked" in line:
            assert line.startswith("warn  ") and "sudo kvtrace doctor" in line


def test_doctor_pid_of_another_user_says_so():
    """A process whose maps are closed to us read as "maps no CUDA library": now it says why."""
    result = _unprivileged(["doctor", "--pid", "1"])
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode != 0
    assert "pid 1: cannot read /proc/1/maps" in result.stdout, result.stdout


@pytest.mark.parametrize("argv", [["ps"], ["tail"], ["snapshot"], ["leaks"], ["top", "--once"]])
def test_every_client_command_without_root_is_one_line(argv):
    result = _unprivileged(argv)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode not in (0, None)
    assert len(result.stderr.splitlines()) == 1, result.stderr


def test_agent_gives_the_probes_the_totals_map_it_was_asked_for():
    import argparse

    from kvtrace.cli.agent import AgentCommand

    parser = argparse.ArgumentParser()
    AgentCommand().prepare_parser(parser)
    assert AgentCommand._options(parser.parse_args([])).bpf.settings.max_totals == 16384
    assert AgentCommand._options(parser.parse_args(["--max-totals", "65536"])).bpf.settings.max_totals == 65536
