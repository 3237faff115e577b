"""`kvtrace` entry point: the table of commands, the parser built from their classes, and one run.

Every command module is imported here, eagerly and by name, not looked up by a string: `kvtrace --help`
prints each command's first docstring line and argparse needs every subparser to parse any command, so a
run loads them all either way (it did as well when they were loaded through importlib). Measured on 2
shared cores (`python -X importtime -m kvtrace.cli.main --help`, and best of 7 runs of each import): the
whole table ~330 ms, `kvtrace ps`'s module alone ~200 ms, kvtrace.client alone (grpc and protobuf, which
every command that talks to the agent needs) ~130-170 ms; most of the rest is cli/agent.py's import of
kvtrace.daemon for its options' defaults, and rich for `kvtrace top`.

What must stay lazy stays lazy inside the commands, imported where they run, never by a module at import
time: bcc (it exists only where the agent runs; sources.bpf imports it when the probes load), pynvml (the
agent's NVML source), opentelemetry and perfetto (optional extras: a host without them still gets every
other command). tests/unit/test_cli_main.py holds both: every command is in `--help`, and importing this
module loads none of those.
"""
from __future__ import annotations

import argparse
import inspect
import sys
from typing import NoReturn, Protocol

from kvtrace import __version__
from kvtrace.cli.agent import AgentCommand
from kvtrace.cli.deep import DeepCommand
from kvtrace.cli.doctor import DoctorCommand
from kvtrace.cli.flamegraph import FlamegraphCommand
from kvtrace.cli.flight import FlightCommand
from kvtrace.cli.leaks import LeaksCommand
from kvtrace.cli.perfetto import PerfettoCommand
from kvtrace.cli.ps import PsCommand
from kvtrace.cli.record import RecordCommand
from kvtrace.cli.run import RunCommand
from kvtrace.cli.snapshot import SnapshotCommand
from kvtrace.cli.tail import TailCommand
from kvtrace.cli.top import TopCommand
from kvtrace.cli.vllm import VllmCommand
from kvtrace.errors import CommandError, ExitCode


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


# Each command's name -> its class, in the order `kvtrace --help` lists them. The class docstring is the
# command's help; prepare_parser adds its flags; run runs it.
COMMANDS: dict[str, type[Command]] = {
    "agent": AgentCommand,
    "doctor": DoctorCommand,
    "tail": TailCommand,
    "snapshot": SnapshotCommand,
    "ps": PsCommand,
    "top": TopCommand,
    "leaks": LeaksCommand,
    "deep": DeepCommand,
    "vllm": VllmCommand,
    "record": RecordCommand,
    "run": RunCommand,
    "flight": FlightCommand,
    "flamegraph": FlamegraphCommand,
    "perfetto": PerfettoCommand,
}


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, Command]]:
    parser = _Parser(
        prog="kvtrace", description="Trace GPU memory: which process, GPU and stack holds each byte.")
    parser.add_argument("--version", action="version", version=f"kvtrace {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands = {}
    for name, command_class in COMMANDS.items():
        command = command_class()
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
