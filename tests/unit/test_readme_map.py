"""README.md's map of agent/kvtrace ("Where each concern lives") names every room: each package directory,
and each module of each package, so a new module cannot land without a line that says what it is for.

The map is a tree: an entry is `name/` or `name.py` indented two spaces per level, its description after;
a package's modules are named as `module.py` in its description (or as entries of their own). Only what
exists is checked, so the map may already name what another branch is adding."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "agent" / "kvtrace"
SKIPPED = {"_proto", "probes", "__pycache__"}  # generated code; the probes' C (a link to /probes)
# Modules on their way to a new place, named in the map where they will be: old path -> new path.
# Remove each once the branch that moves it has landed.
MOVING: dict[str, str] = {}
_ENTRY = re.compile(r"^(?P<indent>(?:  )+)(?P<name>[A-Za-z_][\w]*(?:/|\.py))(?:\s|$)")


def readme_map() -> dict[str, str]:
    """Each entry's path relative to agent/kvtrace ("sources/bpf/", "session.py") -> its text (the entry
    line and the lines that continue it, not those of the entries nested in it)."""
    lines = (ROOT / "README.md").read_text().splitlines()
    start = lines.index("agent/kvtrace/")
    entries: dict[str, str] = {"": ""}
    stack: list[tuple[int, str]] = []  # (depth, path) of the packages the current line is inside
    current = ""
    for line in lines[start + 1:]:
        if not line.startswith(" "):  # back at the repository's root (probes/, proto/) or out of the block
            break
        match = _ENTRY.match(line)
        if match and len(match["indent"]) <= 8:  # descriptions continue at a deeper column
            depth = len(match["indent"]) // 2
            stack = [(level, path) for level, path in stack if level < depth]
            current = (stack[-1][1] if stack else "") + match["name"]
            if current.endswith("/"):
                stack.append((depth, current))
            entries[current] = line
        else:
            entries[current] += "\n" + line
    return entries


def rooms() -> tuple[list[str], list[str]]:
    """The package directories ("sources/bpf/") and their modules ("sources/bpf/loader.py") under
    agent/kvtrace, __init__.py left out (its package's entry names it)."""
    packages, modules = [], []
    for directory in sorted(path for path in PACKAGE.rglob("*") if path.is_dir()):
        relative = directory.relative_to(PACKAGE)
        if SKIPPED & set(relative.parts) or not any(directory.glob("*.py")):
            continue
        packages.append(relative.as_posix() + "/")
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if SKIPPED & set(relative.parts) or path.name == "__init__.py":
            continue
        modules.append(relative.as_posix())
    return packages, modules


def named(entries: dict[str, str], module: str) -> bool:
    """An entry of its own, or `name.py` in its package's description."""
    package, _, name = module.rpartition("/")
    package_entry = package + "/" if package else ""
    mentioned = re.search(rf"(?<![\w/.]){re.escape(name)}\b", entries.get(package_entry, ""))
    return module in entries or mentioned is not None


def test_the_map_parses_as_a_tree():
    entries = readme_map()
    assert {"model/", "session.py", "sources/", "sources/bpf/", "sources/cupti/boot/", "cli/"} <= set(entries)
    assert "loader.py" in entries["sources/bpf/"] and "loader.py" not in entries["sources/"]


def test_every_package_is_in_the_map():
    entries = readme_map()
    packages, _ = rooms()
    assert "sources/cupti/" in packages  # the walk sees the tree
    missing = [package for package in packages if package not in entries and MOVING.get(package) not in entries]
    assert missing == [], f"README.md's map of agent/kvtrace does not name these packages: {missing}"


def test_every_module_is_in_the_map():
    entries = readme_map()
    _, modules = rooms()
    assert "session.py" in modules and "cli/main.py" in modules
    missing = [module for module in modules
               if not named(entries, module) and not (module in MOVING and named(entries, MOVING[module]))]
    assert missing == [], f"README.md's map of agent/kvtrace does not name these modules: {missing}"


def test_the_map_names_only_what_exists():
    """The other way round: no entry, and no `module.py` in a package's description, names a room that is gone."""
    entries = readme_map()
    gone = [path for path in entries if path and not (PACKAGE / path).exists()]
    for package, text in entries.items():
        if package.endswith("/") or package == "":
            gone += [f"{package}{name}" for name in re.findall(r"(?<![\w/.])(\w+\.py)\b", text)
                     if not (PACKAGE / package / name).exists()]
    assert gone == []
