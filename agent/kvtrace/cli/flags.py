"""Flags and argument types more than one command takes, defined once."""
from __future__ import annotations

import argparse
import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)
_UNIT_SHIFT = {"": 0, "k": 10, "m": 20, "g": 30, "t": 40}
MAX_SIZE_BYTES = 1 << 50  # 1 PiB: no GPU allocation is larger (the agent refuses more as well)
PID_MAX_LIMIT = 1 << 22  # the kernel's largest pid_max (64-bit); the API's pids are 32-bit


def parse_size(text: str) -> int:
    """Bytes from "123", "512k", "1MiB", "1.5GB": units are binary (1k = 1024), as GPU memory is."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 123, 512k, 1MiB, 2G)")
    number, unit = match.groups()
    size = float(number) * (1 << _UNIT_SHIFT[unit.lower()])  # inf for 400 digits
    if not size <= MAX_SIZE_BYTES:
        raise argparse.ArgumentTypeError(f"{text!r} is more than 1 PiB, larger than any GPU allocation")
    return int(size)


def positive_pid(text: str) -> int:
    # isascii: str.isdigit() takes "²" and other digits that int() refuses or reads differently.
    if not (text.isascii() and text.isdigit()) or not 0 < int(text) <= PID_MAX_LIMIT:
        raise argparse.ArgumentTypeError(f"not a process id (1 to {PID_MAX_LIMIT}): {text!r}")
    return int(text)


def add_pid_flag(parser: argparse.ArgumentParser) -> None:
    """-p/--pid, repeatable, as every reading command takes it."""
    parser.add_argument("-p", "--pid", type=positive_pid, action="append", default=[],
                        help="only this process id (repeatable)")


def non_negative_seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds <= 365 * 24 * 3600:
        raise argparse.ArgumentTypeError(f"not a number of seconds from 0 to one year: {text!r}")
    return seconds


def positive_count(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or not 0 < int(text) <= 10000:
        raise argparse.ArgumentTypeError(f"not a count from 1 to 10000: {text!r}")
    return int(text)


def positive_seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not 0.1 <= seconds <= 3600:
        raise argparse.ArgumentTypeError(f"not an interval from 0.1 to 3600 seconds: {text!r}")
    return seconds
