"""`kvtrace run`: run a command with kvtrace's CUPTI tracer inside its Python processes (no root)."""
from __future__ import annotations

import argparse
import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import kvtrace
from kvtrace.errors import CommandError, ExitCode
from kvtrace.human import printable
from kvtrace.sources.cupti import protocol
from kvtrace.sources.cupti.listener import CuptiListener, TracedProcess, check_socket_path, socket_accepts
from kvtrace.sources.unix_socket import SOCKET_PATH_MAX_BYTES, ListenerSetupError

EPILOG = """examples:
  kvtrace run -o train.kvtrace -- python train.py   # no root, no agent: a recording of the run
  kvtrace leaks --input train.kvtrace --min-age 0     # then any report reads it
  kvtrace run --agent -- python serve.py            # report to the running agent (it compares with its probes)
  kvtrace run --eager -o out.kvtrace -- python cuda_without_torch.py
"""

# After COMMAND exits, its tracers' last flush (at their exit) may still be on its way.
FINAL_FLUSH_SECONDS = 3.0
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
# Typed at the terminal (Ctrl-C, Ctrl-\): the kernel sends these to the whole foreground process group,
# COMMAND included, so forwarding them too would deliver them twice.
TERMINAL_SIGNALS = frozenset({signal.SIGINT, signal.SIGQUIT})
# The recording's default for `kvtrace leaks`: everything still held where it ends. A run's recording is read
# after the run, and PyTorch's blocks, read at each process's exit, carry that time, not their allocation's.
LEAK_MIN_AGE_SECONDS = 0.0
BOOT_DIRECTORY = Path(protocol.__file__).resolve().parent / "boot"  # its sitecustomize.py loads the tracer


class RunCommand:
    """Run COMMAND with kvtrace's CUPTI tracer in each of its Python processes: no root needed.

    Every Python process of COMMAND (its children too) loads the tracer at start-up; a process that
    initialises CUDA through torch (or at once, with --eager) reports its driver allocations, VMM calls,
    frees and the Python stack of each. With --output FILE, `kvtrace run` writes them to a recording that
    every report reads (`kvtrace leaks --input FILE`); with --agent, the processes report to the running
    agent instead, which compares them with its probes'. With neither: the agent if one listens, else
    ./kvtrace-run-PID.kvtrace.

    CUPTI allows one subscriber per process: under torch.profiler or Nsight, kvtrace says so and leaves
    that process alone. Signals reach COMMAND as they would, and its exit status is kvtrace run's.
    """

    EPILOG = EPILOG

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        where = parser.add_mutually_exclusive_group()
        where.add_argument("-o", "--output", metavar="FILE", type=Path,
                           help="write a recording of the run to FILE (replaced if it exists)")
        where.add_argument("--agent", metavar="SOCKET", nargs="?", const=protocol.DEFAULT_AGENT_SOCKET,
                           help="report to the running agent at SOCKET (default: %(const)s, the agent's "
                                "--cupti-socket)")
        parser.add_argument("--no-cupti", action="store_true",
                            help="leave CUPTI alone (KVTRACE_CUPTI=0): the command runs as it would, untraced")
        parser.add_argument("--eager", action="store_true",
                            help="subscribe to CUPTI when each process starts, not when torch initialises CUDA "
                                 "(programs that use CUDA without torch)")
        parser.add_argument("--blocks", choices=("always", "never"), default=None,
                            help="who holds each PyTorch block: with --output, PyTorch's own recorder at its "
                                 "cheapest (live blocks' Python stacks) is on from CUDA's start and read at each "
                                 "process's exit, so `kvtrace leaks --input` names the holders, not the code that "
                                 "grew the cache (default always: about 15 %% of a torch loop's speed on an H100; "
                                 "never: segments only). Towards the agent: never, "
                                 "its probes see the blocks at the depth it decides")
        parser.add_argument("--stack-frames", metavar="N", type=int,
                            help="Python frames kept per stack, 0 for none (default: the tracer's, 48; at most 256)")
        parser.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- COMMAND [ARGS...]",
                            help="the command to run and its arguments")

    def run(self, args: argparse.Namespace) -> int:
        argv = list(args.argv)
        if argv and argv[0] == "--":
            argv = argv[1:]
        if not argv:
            raise CommandError("give the command to run after --, e.g. `kvtrace run -o run.kvtrace -- python "
                               "train.py`", ExitCode.USAGE)
        # Imported here: the tracer's module is for the traced processes; only this command names its settings.
        from kvtrace.sources.cupti.tracer import MAX_STACK_FRAMES

        if args.stack_frames is not None and not 0 <= args.stack_frames <= MAX_STACK_FRAMES:
            raise CommandError(f"--stack-frames takes 0 to {MAX_STACK_FRAMES}", ExitCode.USAGE)
        output: Path | None = args.output
        if output is None:
            agent = args.agent or protocol.DEFAULT_AGENT_SOCKET
            try:
                check_socket_path(agent, "--agent")
            except ListenerSetupError as error:
                raise CommandError(f"{error} (put COMMAND after --)", ExitCode.USAGE) from None
            if socket_accepts(agent):
                if args.blocks == "always":
                    raise CommandError(f"--blocks always is for a recording (--output FILE), not the agent at {agent}: "
                                       "it decides each process's depth itself (raise one with `sudo kvtrace deep "
                                       "--pid PID`)", ExitCode.USAGE)
                _say(f"tracing with CUPTI into the agent at {agent}")
                return _run_child(argv, _environment(args, agent, to_agent=True), lambda: None)
            if args.agent is not None:
                raise CommandError(f"no agent listens on {agent}: start it (`sudo kvtrace agent`; it takes CUPTI "
                                   "reports on --cupti-socket), or write a file with --output FILE",
                                   ExitCode.AGENT_UNREACHABLE)
            output = Path(f"kvtrace-run-{os.getpid()}.kvtrace")
            _say(f"no agent at {agent}; tracing with CUPTI into ./{output}")
        else:
            _check_output(output)
            _say(f"tracing with CUPTI into {output}")
        return _record(argv, args, output)


def _check_output(output: Path) -> None:
    if output.is_dir():
        raise CommandError(f"--output {output} is a directory: give a file name, e.g. {output / 'run.kvtrace'}",
                           ExitCode.USAGE)
    if not output.parent.is_dir():
        raise CommandError(f"--output {output}: the directory {output.parent} does not exist (create it, or "
                           "choose another --output)", ExitCode.USAGE)


def _record(argv: list[str], args: argparse.Namespace, output: Path) -> int:
    """Mode --output: this process collects the tracers' reports into a Session written to `output`."""
    from kvtrace.model.processes import ProcessTable
    from kvtrace.reports.recorder import FileRecorder
    from kvtrace.session import Session
    from kvtrace.sources import procfs

    session = Session(ProcessTable(procfs.read_process))
    private = _private_directory()
    listener = CuptiListener(session, os.path.join(private, "cupti.sock"), socket_mode=0o600,
                             flag="kvtrace run's socket")
    # One file, replaced if there: a run's recording is not rotated.
    recorder = FileRecorder(session, output, LEAK_MIN_AGE_SECONDS, max_bytes=1 << 62, keep=0)
    try:
        try:
            recorder.start()
        except OSError as error:
            raise CommandError(f"cannot write {output}: {error.strerror}", ExitCode.USAGE) from None
        try:
            if not listener.start():
                reason = next((c.reason for c in session.components() if c.name == "cupti"), "")
                raise CommandError(f"cannot listen for the tracers: {reason}")

            def finish() -> None:
                listener.wait_idle(FINAL_FLUSH_SECONDS)
                listener.stop()

            status = _run_child(argv, _environment(args, listener.path), finish)
        finally:
            listener.stop()
            recorder.stop()
    finally:
        shutil.rmtree(private, ignore_errors=True)
    if recorder.error:
        raise CommandError(recorder.error)
    _summary(output, listener)
    return status


def _private_directory() -> str:
    """A 0700 directory for the socket (only this user's processes reach it), with a path short enough for
    a Unix socket even under a long $TMPDIR."""
    directory = tempfile.mkdtemp(prefix="kvtrace-run-")
    if len(os.path.join(directory, "cupti.sock").encode()) > SOCKET_PATH_MAX_BYTES:
        os.rmdir(directory)
        directory = tempfile.mkdtemp(prefix="kvtrace-run-", dir="/tmp")
    return directory


def _environment(args: argparse.Namespace, socket_path: str, to_agent: bool = False) -> dict[str, str]:
    """COMMAND's environment: where to report, and the tracer first on PYTHONPATH (its sitecustomize runs the
    one it hides), then the directory holding this kvtrace package (the tracer imports it). PyTorch's block
    recorder is on by default only for a recording: the agent's probes see blocks themselves."""
    from kvtrace.sources.cupti.tracer import BLOCKS_ENV, EAGER_ENV, OPT_OUT_ENV, STACK_FRAMES_ENV, TELL_ENV

    env = dict(os.environ)
    env[protocol.SOCKET_ENV] = socket_path
    # Towards the agent, a process CUPTI cannot trace says why on its stderr too: nothing else would tell
    # the user (a recording's summary does).
    env[TELL_ENV] = "1" if to_agent else "0"
    existing = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = os.pathsep.join([str(BOOT_DIRECTORY), _package_only(),
                                         *([existing] if existing else [])])
    if args.no_cupti:
        env[OPT_OUT_ENV] = "0"
    if args.eager:
        env[EAGER_ENV] = "1"
    if args.stack_frames is not None:
        env[STACK_FRAMES_ENV] = str(args.stack_frames)
    blocks = args.blocks or ("never" if to_agent else "always")
    env[BLOCKS_ENV] = "1" if blocks == "always" else "0"
    return env


def _package_only() -> str:
    """A directory holding this kvtrace package and nothing else (a link to it), for COMMAND's PYTHONPATH: the
    package's own parent is, installed from a wheel, kvtrace's whole site-packages, whose grpc, protobuf and
    the rest would then come before the program's own. Removed when kvtrace run ends."""
    directory = tempfile.mkdtemp(prefix="kvtrace-run-path-")
    os.symlink(Path(kvtrace.__file__).resolve().parent, Path(directory) / "kvtrace")
    atexit.register(shutil.rmtree, directory, True)
    return directory


def _run_child(argv: list[str], env: dict[str, str], after_exit: Callable[[], None]) -> int:
    """Runs COMMAND with this process's stdin, stdout and stderr; forwards the signals a user or a service
    manager sends kvtrace run; returns COMMAND's exit status (128 + n when signal n ended it). `after_exit`
    runs once COMMAND is gone, the signals still forwarded (to no one), so a Ctrl-C cannot cut it short."""
    try:
        child = subprocess.Popen(argv, env=env)
    except OSError as error:
        # The shell's codes: 127 not found, 126 found but not runnable.
        code = 127 if isinstance(error, FileNotFoundError) else 126
        print(f"kvtrace: cannot run {printable(argv[0])}: {error.strerror}", file=sys.stderr)
        after_exit()
        return code

    def forward(signum: int, _frame: object) -> None:
        if signum in TERMINAL_SIGNALS and _terminal_sends_to_child():
            return
        try:
            child.send_signal(signum)  # nothing once it is reaped
        except ProcessLookupError:
            pass

    previous = {signum: signal.signal(signum, forward) for signum in FORWARDED_SIGNALS}
    try:
        returncode = child.wait()
        after_exit()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 128 - returncode if returncode < 0 else returncode


def _terminal_sends_to_child() -> bool:
    """Whether kvtrace run is in its terminal's foreground process group, which COMMAND shares: then a
    Ctrl-C there reached COMMAND already."""
    for fd in (0, 1, 2):
        try:
            if os.isatty(fd) and os.tcgetpgrp(fd) == os.getpgrp():
                return True
        except OSError:
            continue
    return False


def _summary(output: Path, listener: CuptiListener) -> None:
    processes = list(listener.processes.values())
    traced = [p for p in processes if p.status is not None and p.status.state == "tracing"]
    _say(f"wrote {output}: {len(traced)} process{'es' if len(traced) != 1 else ''} traced, {listener.events} "
         f"events{f', {listener.lost} lost' if listener.lost else ''}; read it with "
         f"`kvtrace leaks --input {output}`")
    for process in processes:
        line = _process_line(process)
        if line:
            _say(line)
    if not processes:
        _say("no process reported: none of COMMAND's Python processes initialised CUDA through torch (--eager "
             "traces programs that use CUDA without torch)")
    if listener.protocol_errors:
        _say(f"{listener.protocol_errors} connection{'s' if listener.protocol_errors != 1 else ''} closed on a "
             f"malformed message (tracer and kvtrace of different releases?)")


def _process_line(process: TracedProcess) -> str:
    """What one process's tracer said, when it is not plain tracing."""
    where = f"pid {process.pid}"
    if process.error:
        return f"{where}: {printable(process.error)}; its reports after that were not read"
    status = process.status
    if status is None:
        return f"{where}: its tracer connected and said nothing of its state" if not process.events else ""
    from kvtrace.sources.cupti.tracer import not_traced_line  # as the tracer says it towards the agent

    return not_traced_line(process.pid, status.state, status.reason, status.holder, printable)


def _say(message: str) -> None:
    print(f"kvtrace run: {message}", file=sys.stderr, flush=True)
