"""Growth of outstanding memory over sliding windows, counts over a window, and time-to-OOM.

Growth is the least-squares slope of the samples in the window, not (last - first) / window.
Allocators grow in steps (PyTorch's caching allocator takes a new segment, vLLM allocates the KV
cache once), and the endpoints method turns one step at the edge of the window into a steep rate
for the whole window: a model loaded 2 minutes ago would read as "70 GiB in 15 min" and forecast an
OOM that never comes. The fit weighs every sample, so a step long past counts little and a steady
leak reads at its true rate. On exactly linear samples both give the same, exact, answer.
"""
from __future__ import annotations

from collections import deque

NS_PER_SECOND = 1_000_000_000
SHORT_WINDOW_SECONDS = 60
LONG_WINDOW_SECONDS = 15 * 60
# A forecast from less history than this is mostly the process's start-up (model load, KV cache).
MIN_FORECAST_HISTORY_SECONDS = 5 * 60


class SlidingFit:
    """Least-squares slope of (time, value) samples no older than `window_seconds` before the last.

    The sums are Python ints (nanoseconds, bytes), kept as samples come and go: O(1) per sample,
    and adding and removing never drifts, so exactly linear samples give an exact slope (the one
    rounding is the final division)."""

    def __init__(self, window_seconds: float) -> None:
        self.window_ns = int(window_seconds * NS_PER_SECOND)
        self._samples: deque[tuple[int, int]] = deque()
        self._origin_ns: int | None = None  # times are kept relative to the first sample: smaller ints
        self._t = self._y = self._tt = self._ty = 0

    def add(self, time_ns: int, value: int) -> None:
        if self._origin_ns is None:
            self._origin_ns = time_ns
        t = time_ns - self._origin_ns
        self._samples.append((t, value))
        self._t, self._y, self._tt, self._ty = self._t + t, self._y + value, self._tt + t * t, self._ty + t * value
        while self._samples[0][0] < t - self.window_ns:
            old_t, old_value = self._samples.popleft()
            self._t -= old_t
            self._y -= old_value
            self._tt -= old_t * old_t
            self._ty -= old_t * old_value

    def slope_per_second(self) -> float:
        """Units of value per second; 0.0 with fewer than two samples."""
        n = len(self._samples)
        denominator = n * self._tt - self._t * self._t
        if n < 2 or denominator == 0:
            return 0.0
        return (n * self._ty - self._t * self._y) * NS_PER_SECOND / denominator

    def span_seconds(self) -> float:
        """Time between the oldest and the newest sample in the window."""
        if not self._samples:
            return 0.0
        return (self._samples[-1][0] - self._samples[0][0]) / NS_PER_SECOND


class Growth:
    """One series (e.g. a process's outstanding bytes on one GPU) fitted over 1 and 15 minutes."""

    def __init__(self) -> None:
        self.short = SlidingFit(SHORT_WINDOW_SECONDS)
        self.long = SlidingFit(LONG_WINDOW_SECONDS)

    def add(self, time_ns: int, value: int) -> None:
        self.short.add(time_ns, value)
        self.long.add(time_ns, value)


class WindowIncrease:
    """How much values (monotonic counters, or levels) rose over the last `window_seconds`: the newest sample
    minus the newest one at least a window older (or the oldest there is, with less history)."""

    def __init__(self, window_seconds: float = SHORT_WINDOW_SECONDS) -> None:
        self.window_ns = int(window_seconds * NS_PER_SECOND)
        self._samples: deque[tuple[int, tuple[int, ...]]] = deque()

    def add(self, time_ns: int, values: tuple[int, ...]) -> None:
        self._samples.append((time_ns, values))
        while len(self._samples) > 1 and self._samples[1][0] <= time_ns - self.window_ns:
            self._samples.popleft()

    def increase(self) -> tuple[int, ...]:
        (_, first), (_, last) = self._samples[0], self._samples[-1]
        return tuple(new - old for new, old in zip(last, first, strict=True))


def time_to_oom_seconds(free_bytes: int | None, growth_bytes_per_second: float, history_seconds: float,
                        min_history_seconds: float = MIN_FORECAST_HISTORY_SECONDS) -> float | None:
    """Seconds until `free_bytes` are used up at this growth; None when not growing, with no free
    figure (no NVML), or from less than `min_history_seconds` of history."""
    if free_bytes is None or growth_bytes_per_second <= 0 or history_seconds < min_history_seconds:
        return None
    return free_bytes / growth_bytes_per_second


def free_ratio(allocations: int, frees: int) -> float | None:
    """frees / allocations (about 0.95 is a healthy steady state; below 0.7 suggests a leak; the
    alerts judge). None without allocations."""
    return frees / allocations if allocations else None
