"""`kvtrace doctor --pid`: what the agent can trace in one process, or why not."""
import os
import subprocess

from kvtrace.cli.doctor import process_findings
from kvtrace.errors import ExitCode


def test_missing_process_is_a_usage_problem():
    findings = process_findings(2 ** 22 + 7)
    assert [(f.ok, f.exit_code) for f in findings] == [(False, ExitCode.USAGE)]


def test_a_python_process_without_cuda_says_so_and_names_its_python():
    findings = {f.name.split()[-1]: f for f in process_findings(os.getpid())}
    assert findings["cuda"].warning and "no CUDA library" in findings["cuda"].message
    python = findings["python"]
    # This interpreter is 3.10-3.13 (supported) unless its memory cannot be read as this user.
    assert python.ok
    assert "Python 3." in python.message or "no Python stacks:" in python.message


def test_unsupported_python_gives_the_reason():
    old = "/root/.pyenv/versions/3.9.18/bin/python3"
    if not os.path.exists(old) or os.geteuid() != 0:
        import pytest
        pytest.skip("needs root and pyenv's CPython 3.9 to read an unsupported interpreter")
    child = subprocess.Popen([old, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        import time
        time.sleep(0.3)
        findings = {f.name.split()[-1]: f for f in process_findings(child.pid)}
        assert "Python 3.9 is not supported" in findings["python"].message
    finally:
        child.kill()
        child.wait()
