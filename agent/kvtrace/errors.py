"""Failures a command reports as one clear line and a distinct exit code, never a traceback."""
from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    OK = 0
    FAILURE = 1  # anything else that went wrong; the line says what
    USAGE = 2  # bad command-line input (argparse uses 2 as well)
    PERMISSION = 3  # not root / a capability is missing
    KERNEL = 4  # the kernel lacks BPF, uprobes, tracefs or headers/BTF
    BCC_MISSING = 5  # the bcc Python module cannot be imported
    AGENT_UNREACHABLE = 6  # the agent is not running or its socket is not readable


class CommandError(Exception):
    """Raised by a command; main() prints `kvtrace: <message>` and exits with `exit_code`."""

    def __init__(self, message: str, exit_code: ExitCode = ExitCode.FAILURE) -> None:
        super().__init__(message)
        self.exit_code = exit_code
