"""cli/main.py's table of commands: every command module under kvtrace/cli is in it, each is reachable and
documented in `kvtrace --help`, and starting kvtrace imports none of what must stay lazy."""
from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvtrace.cli.main import COMMANDS, build_parser, main

CLI = Path(__file__).resolve().parents[2] / "agent" / "kvtrace" / "cli"


def _command_modules() -> set[str]:
    """The modules under cli/ that define a class named <Something>Command."""
    found = set()
    for path in CLI.glob("*.py"):
        tree = ast.parse(path.read_text())
        if any(isinstance(node, ast.ClassDef) and node.name.endswith("Command") and node.name != "Command"
               for node in tree.body) and path.stem != "main":
            found.add(path.stem)
    return found


def test_every_command_module_is_in_the_table():
    modules = {command.__module__.rsplit(".", 1)[1] for command in COMMANDS.values()}
    assert _command_modules() == modules


def test_every_command_is_listed_and_described_in_help(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    listing = capsys.readouterr().out
    words = " ".join(listing.split())  # argparse wraps the summaries
    for name, command in COMMANDS.items():
        summary = " ".join((command.__doc__ or "").strip().splitlines()[0].split())
        assert summary, f"{name}: its class has no docstring, so --help says nothing of it"
        assert re.search(rf"^    {name}\s", listing, re.MULTILINE), f"{name} is missing from `kvtrace --help`"
        assert f"{name} {summary}" in words, f"{name}'s summary is missing from `kvtrace --help`"


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_is_reachable(name, capsys):
    parser, commands = build_parser()
    assert set(commands) == set(COMMANDS)
    with pytest.raises(SystemExit) as exited:
        parser.parse_args([name, "--help"])
    assert exited.value.code == 0
    help_text = capsys.readouterr().out
    assert help_text.startswith(f"usage: kvtrace {name}")
    assert (COMMANDS[name].__doc__ or "").strip().splitlines()[0] in help_text


def test_starting_kvtrace_imports_nothing_that_must_stay_lazy():
    code = ("import json, sys; from kvtrace.cli.main import build_parser; build_parser(); "
            "print(json.dumps(sorted(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    modules = set(json.loads(result.stdout))
    lazy = {"bcc", "pynvml", "opentelemetry", "perfetto"}
    assert {module.split(".")[0] for module in modules} & lazy == set()
