"""What kvtrace runs inside a traced program, tested by each CPython build it supports (tests/interpreters.py):
the vLLM plugin (inside every vLLM process) and `kvtrace run`'s CUPTI tracer (inside every Python process of a
run). Their own test modules run under each interpreter, with the pytest `make pythons` installed for them.

Left out: the one plugin test that decodes the messages with the agent's listener, which is the agent's side
(it runs under the agent's own Python, with the rest of this suite).
"""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from interpreters import LABELS, interpreter, pytest_for_builds

ROOT = Path(__file__).resolve().parents[2]
MODULES = ("tests/unit/test_vllm_plugin.py", "tests/unit/test_cupti_tracer.py")
AGENTS_SIDE = "not test_the_agents_listener_takes_every_message_the_plugin_sends"


@pytest.mark.parametrize("label", LABELS)
def test_the_plugin_and_the_tracer_pass_their_tests_on_each_build(label, tmp_path):
    python = interpreter(label)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(pytest_for_builds()), str(ROOT / "agent")]),
           "PYTHONDONTWRITEBYTECODE": "1"}
    result = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", AGENTS_SIDE,
                             "--rootdir", str(ROOT), "--basetemp", str(tmp_path / "pytest"), *MODULES],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr[-2000:]
    print(f"\n{label}: {summary}")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 60, summary  # 29 plugin + 38 tracer tests when written
    assert "skipped" not in summary and "failed" not in summary, summary
