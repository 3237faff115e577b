"""`kvtrace agent` refuses bad flags with one line that names the fix, before it needs root or bcc."""
import subprocess
import sys

import pytest

from kvtrace.errors import ExitCode

NO_SUCH_PID = "4194999"  # above the largest pid_max Linux allows (4194304)


@pytest.mark.parametrize("flags, says", [
    (["-p", NO_SUCH_PID], f"no process {NO_SUCH_PID} here: -p follows running processes"),
    (["-p", "0"], "--pid takes a positive process id"),
    (["--wakeup-events", "0"], "--wakeup-events takes 1 to 65536"),
    (["--forecast-min-history", "-5"], "--forecast-min-history takes 0 to 86400 seconds"),
    (["--site-sample-interval", "0"], "--site-sample-interval takes 0.1 to 3600 seconds"),
])
def test_bad_flags_are_refused_with_the_fix(flags, says):
    result = subprocess.run([sys.executable, "-m", "kvtrace.cli.main", "agent", *flags],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == ExitCode.USAGE, result.stderr
    assert says in result.stderr
    assert "Traceback" not in result.stderr
