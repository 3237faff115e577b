"""`kvtrace` entry point: builds the parser from the command classes and runs one."""
from __future__ import annotations

import argparse
import importlib
import inspect
import sys
from typing import NoReturn, Protocol

from kvtrace import __version__
from kvtrace.errors import CommandError, ExitCode

# name -> module under kvtrace.cli; the module defines <Name>Command.
COMMANDS = ("agent", "doctor", "tail", "snapshot", "ps", "top", "leaks", "deep", "vllm", "record", "run", "flight",
            "flamegraph", "perfetto")


class Command(Protocol):
    """A subcommand. The class docstring is its help text."""

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage mistake as one line on stderr that names the command and its --help
    (argparse prints the whole usage first, many lines for `kvtrace agent`)."""

    def error(self, message: str) -> NoReturn:
        message = " ".join(message.split())
        self.exit(ExitCode.USAGE, f"{self.prog}: {message} (see `{self.prog} --help`)\n")


def _load(name: str) -> Command:
    module = importlib.import_module(f"kvtrace.cli.{name}")
    return getattr(module, f"{name.capitalize()}Command")()


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, Command]]:
    parser = _Parser(
        prog="kvtrace", description="Trace GPU memory: which process, GPU and stack holds each byte.")
    parser.add_argument("--version", action="version", version=f"kvtrace {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands = {}
    for name in COMMANDS:
        command = _load(name)
        doc = inspect.cleandoc(type(command).__doc__ or "")
        sub = subparsers.add_parser(
            name, help=doc.splitlines()[0] if doc else None, description=doc,
            formatter_class=argparse.RawDescriptionHelpFormatter,
            epilog=getattr(command, "EPILOG", None))
        command.prepare_parser(sub)
        commands[name] = command
    return parser, commands


def main(argv: list[str] | None = None) -> int:
    parser, commands = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return ExitCode.USAGE
    try:
        return commands[args.command].run(args)
    except CommandError as error:
        print(f"kvtrace: {error}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        return ExitCode.OK
    except BrokenPipeError:  # `kvtrace ... | head`
        return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
