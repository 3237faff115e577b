"""`kvtrace agent` refuses bad flags with one line that names the fix, before it needs root or bcc."""
import subprocess
import sys

import pytest

from kvtrace.errors import ExitCode

NO_SUCH_PID = "4194304"  # the largest pid_max Linux allows: pids stay below it, and -p takes it


@pytest.mark.parametrize("flags, says", [
    (["-p", NO_SUCH_PID], f"no process {NO_SUCH_PID} here: -p follows running processes"),
    (["-p", "0"], "argument -p/--pid: not a process id (1 to 4194304): '0'"),
    (["--wakeup-events", "0"], "--wakeup-events: takes a whole number from 1 to 65536, not '0'"),
    (["--forecast-min-history", "-5"], "--forecast-min-history: takes 0 to 86400 seconds (1 day), not '-5'"),
    (["--site-sample-interval", "0"], "--site-sample-interval: takes 0.1 to 3600 seconds (1 hour), not '0'"),
    (["--vllm-held-seconds", "nan"], "--vllm-held-seconds: takes 0 to 86400 seconds (1 day), not 'nan'"),
    (["--vllm-idle-growth", "0"], "--vllm-idle-growth: takes more than 0 and at most 1e12 bytes per second"),
    (["--max-block-events-per-second", "-1"], "takes a whole number from 0 (no limit) to 100000000, not '-1'"),
    (["--deepen-growth", "10"], "--deepen-growth: takes a size from 1MiB to 1TiB"),
    (["--block-sample-bytes", "1000"], "--block-sample-bytes: it takes 0 (every block's stack) or a whole number"),
    # checked even with the recorder off: a bad value is a mistake either way
    (["--no-flight-recorder", "--flight-window", "0"], "--flight-window: takes 1 to 3600 seconds (1 hour), not '0'"),
])
def test_bad_flags_are_refused_with_the_fix(flags, says):
    result = subprocess.run([sys.executable, "-m", "kvtrace.cli.main", "agent", *flags],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == ExitCode.USAGE, result.stderr
    assert says in result.stderr
    assert "Traceback" not in result.stderr
