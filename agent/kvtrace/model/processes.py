"""Who a pid is: process title, comm, container. Cached per pid, refreshed on exec and by age.

vLLM renames its processes with setproctitle (`VLLM::Worker_TP0`); comm is cut at 15 characters,
so the title comes from /proc/PID/cmdline (sources/procfs.py reads it).
"""
from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

# Container ids in cgroup paths: docker-<id>.scope, cri-containerd-<id>.scope, crio-<id>,
# /docker/<id>, /kubepods/.../<id>
_CONTAINER_ID = re.compile(r"(?:^|[/-])([0-9a-f]{64})(?:\.scope)?(?:/|$)")

TITLE_MAX_AGE_SECONDS = 5.0
# A title rides on every event: a 1 MB command line must not become 1 MB per event.
TITLE_MAX_CHARS = 1024


def valid_text(raw: str) -> str:
    """`raw` as text every consumer takes: bytes that were not UTF-8 (kept by Python as lone
    surrogates, the surrogateescape way) become `\\xff` escapes. Protobuf and JSON refuse lone
    surrogates, so one process with such a command line would fail every report."""
    return raw.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def clean_title(raw: str, max_chars: int = TITLE_MAX_CHARS) -> str:
    """A process title as kvtrace keeps it: valid text, at most `max_chars` characters (the cut
    says how much went)."""
    title = valid_text(raw)
    if len(title) > max_chars:
        marker = f"... (+{len(title) - max_chars} chars)"
        title = title[:max_chars - len(marker)] + marker
    return title


@dataclass(slots=True)
class ProcessInfo:
    pid: int
    title: str
    comm: str
    container: str
    cgroup: str
    start_time: float  # seconds since the epoch (psutil create_time)
    read_at: float  # time.monotonic() when read
    parent_pid: int = 0  # 0: unknown (vLLM's engines are found by title and parentage)


def container_id(cgroup_text: str) -> str:
    """The container id in /proc/PID/cgroup text, or "" for a host process."""
    for line in cgroup_text.splitlines():
        path = line.split(":", 2)[-1]
        match = _CONTAINER_ID.search(path)
        if match:
            return match.group(1)
    return ""


ProcessReader = Callable[[int], "ProcessInfo | None"]


class TitlePattern(Protocol):
    """A compiled title regex (RE2's; Python's `re` only in tests of trusted patterns)."""

    def search(self, text: str): ...


# What a title regex sees of a title: its cost is linear in this (RE2), whatever the title.
TITLE_MATCH_MAX_CHARS = 4096
# Results are cached per title: titles are few, so the regex runs once per title instead of once per
# event. Bounded so an exec storm cannot grow it.
TITLE_CACHE_MAX_ENTRIES = 4096


class TitleMatcher:
    """A client's title regex as filters run it: on at most TITLE_MATCH_MAX_CHARS of a title, once per
    distinct title; with `redacted`, on the title as the redacted view shows it (so that the regex cannot
    probe for a secret the view hides)."""

    def __init__(self, pattern: TitlePattern, redacted: bool = False) -> None:
        self._pattern = pattern
        self._redacted = redacted
        self._matches: dict[str, bool] = {}

    def matches(self, title: str) -> bool:
        found = self._matches.get(title)
        if found is None:
            if len(self._matches) >= TITLE_CACHE_MAX_ENTRIES:
                self._matches.clear()
            shown = redact_title(title) if self._redacted else title
            found = self._matches[title] = self._pattern.search(shown[:TITLE_MATCH_MAX_CHARS]) is not None
        return found


def _unknown(pid: int) -> ProcessInfo | None:
    return None


class ProcessTable:
    """pid -> ProcessInfo with a short cache; forgets pids that exit.

    `reader` reads a live process (sources/procfs.read_process in the agent); without one the table
    knows only what was put in it (replayed recordings, tests)."""

    def __init__(self, reader: ProcessReader = _unknown) -> None:
        self._reader = reader
        self._cache: dict[int, ProcessInfo] = {}

    def get(self, pid: int) -> ProcessInfo | None:
        info = self._cache.get(pid)
        if info is None or time.monotonic() - info.read_at > TITLE_MAX_AGE_SECONDS:
            fresh = self._reader(pid)
            if fresh is not None:
                self._cache[pid] = info = fresh
        return info

    def cached(self, pid: int) -> ProcessInfo | None:
        """What is known of `pid` without reading the system."""
        return self._cache.get(pid)

    def forget(self, pid: int) -> None:
        self._cache.pop(pid, None)

    def remember(self, info: ProcessInfo) -> None:
        """What is known of a process from elsewhere (a recording): kept until forgotten (without a
        reader, never read again)."""
        self._cache[info.pid] = info

    def known(self) -> dict[int, ProcessInfo]:
        return dict(self._cache)


# C0 and C1 controls, DEL, and the Unicode characters that break lines or reorder text: what a
# terminal or a label must not get from another process's title.
CONTROL_CHARACTERS = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")

# `--api-key X`, `--hf-token=X`, `HF_TOKEN=X`: the value goes, the name stays. Matched word by word
# in linear time: a backtracking pattern took 0.5 s on a crafted 1024-character title.
_SECRET_WORDS = ("key", "token", "secret", "password", "passwd", "credential")
_NAME_CHARACTER = re.compile(r"[\w.-]")


def _secret_name(name: str) -> bool:
    lowered = name.lower()
    return any(word in lowered for word in _SECRET_WORDS)


def _name_before(text: str, end: int) -> str:
    """The run of name characters ([\\w.-]) that ends at `end` in `text`."""
    start = end
    while start > 0 and _NAME_CHARACTER.match(text[start - 1]):
        start -= 1
    return text[start:end]


def _redact_word(word: str) -> tuple[str, bool]:
    """(the word with a secret value masked, whether the next word is a secret flag's value)."""
    if word.startswith("-") and len(word) - len(word.lstrip("-")) <= 2:
        name, equals, _value = word.partition("=")
        if _secret_name(name):
            return (f"{name}=***", False) if equals else (word, True)
    at = word.find("=")
    while at > 0:
        if _secret_name(_name_before(word, at)):
            return word[:at + 1] + "***", False
        at = word.find("=", at + 1)
    return word, False


def redact_title(title: str) -> str:
    """A title for those who may not read the process's command line (/metrics labels, the API's
    group socket): control characters and runs of space become one space, secret values `***`."""
    words = []
    secret_follows = False
    for word in CONTROL_CHARACTERS.sub(" ", title).split():
        if secret_follows and not word.startswith("-"):
            words.append("***")
            secret_follows = False
            continue
        word, secret_follows = _redact_word(word)
        words.append(word)
    return " ".join(words)
