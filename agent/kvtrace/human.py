"""Quantities as an operator reads them: sizes in binary units, ages, durations, rates."""
from __future__ import annotations

from kvtrace.model.processes import CONTROL_CHARACTERS


def human_bytes(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size} B"


def human_age(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d{seconds % 86400 // 3600:02d}h"


def human_duration(seconds: float) -> str:
    """42 s, 5m12s, 3h04m, 2d03h: two units at most, as an operator reads an age."""
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def coarse_age(seconds: float) -> str:
    """45s, 3m, 2h, 1d: one unit, rounded down, for a column that must stay narrow."""
    seconds = max(0, int(seconds))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def signed_bytes(value: float) -> str:
    """+1.2 MiB, -512 B, 0 B: a change, rounded to whole bytes."""
    value = round(value)
    return f"-{human_bytes(-value)}" if value < 0 else f"+{human_bytes(value)}" if value else "0 B"


def human_rate(bytes_per_second: float) -> str:
    """+1.2 MiB/s, -512 B/s, 0 B/s."""
    return f"{signed_bytes(bytes_per_second)}/s"




def device_label(device: int) -> str:
    """A GPU as every report spells it: its index, "?" when the call did not say (one spelling everywhere)."""
    return str(device) if device >= 0 else "?"


def printable(text: str) -> str:
    """Text that came from another process (a title, a file name, a function name) as a terminal
    may show it: every control character escaped (`\\x1b`, `\\u202e`), so a crafted command line
    can neither clear the operator's screen, set the terminal's title nor forge a line."""
    return CONTROL_CHARACTERS.sub(lambda m: f"\\x{ord(m[0]):02x}" if ord(m[0]) < 0x100 else f"\\u{ord(m[0]):04x}", text)
