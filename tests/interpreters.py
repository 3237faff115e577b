"""The CPython interpreters the stack tests run targets under, by label: pyenv's 3.10-3.13 (on the image),
and 3.14 and 3.15 with their free-threaded builds ("3.14t"), which `make pythons` (tests/pythons/build.sh)
builds where they are missing. A test asks for one by label and is skipped, with the reason and the fix,
where it is not on this machine; under `make test` (KVTRACE_REQUIRE_PYTHONS=1, after `make pythons`) a
missing build of ours fails instead, so that a broken build cannot pass as skipped tests.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtrace.sources.python.offsets import PyOffsets, offsets_for

PYENV_VERSIONS = Path("/root/.pyenv/versions")
BUILT = Path(os.environ.get("KVTRACE_PYTHONS", "/var/cache/kvtrace/pythons"))

# Every build whose stacks kvtrace walks; the exactness tests run on each.
LABELS = ("3.10", "3.11", "3.12", "3.13", "3.14", "3.14t", "3.15", "3.15t")
# What tests/pythons/build.sh builds for the labels pyenv does not have.
BUILT_RELEASES = {"3.14": "3.14.7", "3.14t": "3.14.7t", "3.15": "3.15.0rc1", "3.15t": "3.15.0rc1t"}
REQUIRED = os.environ.get("KVTRACE_REQUIRE_PYTHONS") == "1"


def _missing(reason: str) -> None:
    """Skips the test, or fails it where `make pythons` was to have built what is missing."""
    if REQUIRED:
        pytest.fail(f"{reason} (KVTRACE_REQUIRE_PYTHONS=1: make test builds it first)")
    pytest.skip(reason)


def version_of(label: str) -> tuple[int, int]:
    major, minor = label.rstrip("t").split(".")
    return int(major), int(minor)


def is_free_threaded(label: str) -> bool:
    return label.endswith("t")


def offsets_of(label: str) -> PyOffsets:
    offsets = offsets_for(version_of(label), is_free_threaded(label))
    assert offsets is not None, f"kvtrace has no offsets for CPython {label}"
    return offsets


def pytest_for_builds() -> Path:
    """pytest (the version this one is) installed for every interpreter here; skips where it is not."""
    path = BUILT / f"pytest-{pytest.__version__}"
    if not (path / ".kvtrace-built").exists():
        _missing(f"no pytest {pytest.__version__} for the interpreters (no {path}): `make pythons` installs it")
    return path


def find_interpreter(label: str) -> Path | str:
    """The interpreter of this label, or why this machine has none (with the fix)."""
    if label in BUILT_RELEASES:
        path = BUILT / BUILT_RELEASES[label] / "python"
        if not (path.parent / ".kvtrace-built").exists():
            return f"CPython {label} is not built here (no {path}): `make pythons` builds it"
        return path
    found = []
    for candidate in PYENV_VERSIONS.glob(f"{label}.*/bin/python3"):
        patch = candidate.parent.parent.name[len(label) + 1:]
        if patch.isdigit():  # 3.13.0, not 3.13.0t (free-threaded) or 3.13-dev
            found.append((int(patch), candidate))
    if not found:
        return f"CPython {label} is not installed here (no {PYENV_VERSIONS}/{label}.N/bin/python3)"
    return max(found)[1]


def interpreter(label: str) -> Path:
    """The interpreter of this label; skips the calling test where this machine has none."""
    found = find_interpreter(label)
    if isinstance(found, str):
        if label in BUILT_RELEASES:
            _missing(found)
        pytest.skip(found)
    return found
