"""Flags and argument types more than one command takes, defined once."""
from __future__ import annotations

import argparse
import datetime
import decimal
import re
from collections.abc import Callable
from pathlib import Path

from kvtrace.errors import CommandError, ExitCode
from kvtrace.reports.recording import AtTime

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


_SPANS = ((7 * 24 * 3600, "week"), (24 * 3600, "day"), (3600, "hour"))


def _number_text(value: float) -> str:
    """1 -> "1", 0.1 -> "0.1", 1e12 -> "1e12": as a person would type it back."""
    return str(int(value)) if float(value).is_integer() and abs(value) < 1e9 else f"{value:g}".replace("e+", "e")


def _range_text(low: float, high: float, unit: str, above: bool, zero_means: str) -> str:
    """ "0 to 86400 seconds (1 day)", "more than 0 and at most 1e12 bytes per second", "0 (no limit) to 100"."""
    low_text = _number_text(low) + (f" ({zero_means})" if zero_means and low == 0 else "")
    text = f"more than {low_text} and at most {_number_text(high)}" if above else f"{low_text} to {_number_text(high)}"
    text += f" {unit}" if unit else ""
    if unit == "seconds":
        for span, name in _SPANS:
            if high >= span and high % span == 0:
                count = int(high // span)
                text += f" ({count} {name}{'s' if count > 1 else ''})"
                break
    return text


def bounded(low: float, high: float, unit: str = "", *, above: bool = False) -> Callable[[str], float]:
    """An argparse type: a number from `low` to `high` (more than `low` with `above`), in `unit`. argparse
    names the flag before the reason, so a mistake reads "argument --leak-min-age: takes 0 to 31536000
    seconds (365 days), not '-5'"; nan and inf are refused with the rest."""
    expected = _range_text(low, high, unit, above, "")

    def number(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not (low < value if above else low <= value) or not value <= high:
            raise argparse.ArgumentTypeError(f"takes {expected}, not {text!r}")
        return value

    return number


def bounded_int(low: int, high: int, unit: str = "", *, zero_means: str = "") -> Callable[[str], int]:
    """An argparse type: a whole number from `low` to `high` ("argument --wakeup-events: takes a whole number
    from 1 to 65536, not '0'"); `zero_means` says what 0 does when 0 is allowed ("no limit")."""
    expected = "a whole number from " + _range_text(low, high, unit, False, zero_means)

    def whole_number(text: str) -> int:
        stripped = text.strip()
        digits = stripped[1:] if stripped[:1] in "+-" else stripped
        # isascii: str.isdigit() takes "²" and other digits that int() refuses or reads differently.
        if not (digits.isascii() and digits.isdigit()) or not low <= int(stripped) <= high:
            raise argparse.ArgumentTypeError(f"takes {expected}, not {text!r}")
        return int(stripped)

    return whole_number


def _size_text(size: int) -> str:
    """1 << 20 -> "1MiB"; sizes that are not whole binary units as bytes."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size and size % (1 << shift) == 0:
            return f"{size >> shift}{unit}"
    return f"{size} bytes"


def bounded_size(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: a size as parse_size reads it, from `low` to `high` bytes ("argument
    --record-max-size: takes a size from 1MiB to 1TiB (examples: 512k, 64MiB, 2G), not '10'")."""
    expected = f"a size from {_size_text(low)} to {_size_text(high)} (examples: 512k, 64MiB, 2G)"

    def size(text: str) -> int:
        try:
            value = parse_size(text)
        except argparse.ArgumentTypeError:
            value = -1
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"takes {expected}, not {text!r}")
        return value

    return size


NS_PER_SECOND = 1_000_000_000
_SPAN_TEXT = r"(\d+(?:\.\d+)?)\s*(ms|s|m|h)?$"  # a number and its unit: "90s", "2.5m", "600"
_SPAN = re.compile("^" + _SPAN_TEXT)
_DURATION = re.compile(r"^\+" + _SPAN_TEXT)  # --at's "+90s": after the recording starts
_DURATION_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_duration(text: str, low_seconds: float = 1.0, high_seconds: float = 24 * 3600.0) -> float:
    """Seconds from "90s", "10m", "2h", "1.5h" or "600" (seconds), from `low_seconds` to `high_seconds`."""
    match = _SPAN.match(text.strip())
    seconds = float(match.group(1)) * _DURATION_SECONDS[match.group(2)] if match else -1.0
    if not low_seconds <= seconds <= high_seconds:
        raise argparse.ArgumentTypeError(
            f"not a duration from {low_seconds:g}s to {high_seconds / 3600:g}h: {text!r} (examples: 90s, 10m, 2h)")
    return seconds


def parse_at(text: str) -> AtTime:
    """`--at`: "end", "+90s" / "+2m" (after the recording starts), "@1764660000.5" (Unix seconds), or an
    ISO 8601 time ("2026-12-02T07:30:00", local unless it says its zone)."""
    text = text.strip()
    if text == "end":
        return AtTime(end=True)
    match = _DURATION.match(text)
    if match:
        return AtTime(after_start_ns=int(float(match.group(1)) * _DURATION_SECONDS[match.group(2)] * 1e9))
    try:
        if text.startswith("@"):  # exact to the nanosecond: a float of seconds is not
            return AtTime(wall_ns=int(decimal.Decimal(text[1:]) * NS_PER_SECOND))
        moment = datetime.datetime.fromisoformat(text)
    except (ValueError, decimal.InvalidOperation):
        raise argparse.ArgumentTypeError(
            f"not a time: {text!r} (examples: end, +90s, +2m, @1764660000, 2026-12-02T07:30:00)") from None
    return AtTime(wall_ns=int(moment.timestamp() * 1e9))


def add_input_flags(parser: argparse.ArgumentParser) -> None:
    """--input FILE and --at TIME: the command reads a recording instead of the agent."""
    parser.add_argument("--input", metavar="FILE", type=Path,
                        help="read a recording (`kvtrace record`, `kvtrace agent --record`, a flight recorder "
                             "dump) instead of the running agent")
    parser.add_argument("--at", metavar="TIME", type=parse_at,
                        help="with --input: the state at this time: end, +SECONDS after the start (+90s, +2m), "
                             "@UNIX_SECONDS or an ISO time (default: a dump's trigger, else the end)")


def check_cmdline(text: str | None) -> None:
    """--cmdline of a client command (the agent compiles it with RE2; Python's `re` catches most mistakes
    here, with a clear line): UTF-8 text and a valid regular expression."""
    if not text:
        return
    try:
        text.encode("utf-8")  # argv bytes that are not UTF-8 come as lone surrogates
    except UnicodeEncodeError:
        raise CommandError("--cmdline is not UTF-8 text (titles are matched as text)", ExitCode.USAGE) from None
    try:
        re.compile(text)
    except re.error as error:
        raise CommandError(f"--cmdline is not a valid regular expression: {error}", ExitCode.USAGE) from None
