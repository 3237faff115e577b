"""`kvtrace doctor`: one line per host check, with the fix for each problem."""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
from pathlib import Path

from kvtrace.cli.flags import positive_pid
from kvtrace.config import add_socket_flag
from kvtrace.errors import ExitCode
from kvtrace.human import printable
from kvtrace.model.user_shares import POOL_FULL, SHARE_COUNTER_PREFIX

EPILOG = """examples:
  sudo kvtrace doctor          # run it as the agent would run: root sees what the agent sees
  kvtrace doctor --json        # a list of {name, ok, warning, message, exit_code}
  sudo kvtrace doctor --pid 4242   # also: what kvtrace can trace in that process, or why not

exit status: 0 when the agent can run here, else the exit code of the first problem
(3 permission, 4 kernel, 5 bcc missing).
"""


class DoctorCommand:
    """Check that this host can run the kvtrace agent.

    Checks privileges, kernel options, BTF, tracefs, kernel headers (of the running kernel), bcc and the
    uretprobe/seccomp kernel bug, and prints one actionable line for each problem. Changes nothing on the
    host.
    """

    EPILOG = EPILOG

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--json", action="store_true", help="print the findings as JSON")
        parser.add_argument("-p", "--pid", type=positive_pid,
                            help="also check one process: its CUDA libraries and its Python stacks")
        add_socket_flag(parser)

    def run(self, args: argparse.Namespace) -> int:
        from kvtrace.sources.bpf import preflight

        findings = [headers_of_this_kernel(finding) if finding.name == "kernel headers" and finding.ok else finding
                    for finding in preflight.run_checks()]
        findings += agent_findings(args)
        if args.pid is not None:
            findings += process_findings(args.pid, agent_libraries(args))
            findings += cross_check_findings(args, args.pid)
        if args.json:
            print(json.dumps([finding.to_json_dict() for finding in findings], indent=2))
        else:
            for finding in findings:
                status = "FAIL" if not finding.ok else "warn" if finding.warning else "ok"
                print(f"{status:<6}{finding.name}: {printable(finding.message)}")
        problems = [finding for finding in findings if not finding.ok]
        return problems[0].exit_code if problems else ExitCode.OK


_UTS_RELEASE = re.compile(r'^#define UTS_RELEASE "([^"]+)"', re.MULTILINE)


def headers_release(build: Path) -> str | None:
    """The kernel release the headers at `build` are of: include/generated/utsrelease.h's UTS_RELEASE,
    else the name of the directory it links to (/usr/src/linux-headers-RELEASE); None if neither says."""
    try:
        found = _UTS_RELEASE.search((build / "include/generated/utsrelease.h").read_text(errors="replace"))
    except OSError:
        found = None
    if found:
        return found.group(1)
    name = build.resolve().name
    return name.removeprefix("linux-headers-") if name.startswith("linux-headers-") else None


def headers_of_this_kernel(finding, release: str | None = None, root: Path = Path("/")):
    """preflight's "kernel headers" finding (the headers are there), made a warning when they are another
    kernel's: /lib/modules/RELEASE/build linked to the headers of an older release (a kernel upgraded
    without its headers package). bcc compiles the probes against them: it may still work, or fail, or
    misread the kernel's structures."""
    from kvtrace.sources.bpf.preflight import Finding

    release = release or platform.release()
    build = root / "lib/modules" / release / "build"
    theirs = headers_release(build)
    if theirs is None or theirs == release:
        return finding
    return Finding(finding.name, True,
                   f"{build} holds the headers of kernel {theirs}, not of the running {release}: bcc compiles "
                   f"the probes against them (they may fail to load, or misread the kernel): install "
                   f"linux-headers-{release} (`apt-get install linux-headers-$(uname -r)`; elsewhere, the "
                   f"kernel's headers package), which links {build} to them", warning=True)


# Counters of a running agent that mean something was not traced, with what to do about it.
_AGENT_COUNTERS = {
    "libraries_refused": "library attachments refused for want of a place (--max-libraries, or bcc's "
                         "probe quota): processes using them were not traced meanwhile",
    "events_lost": "events lost with the ring buffer full (the ledger was resynced; stacks and rates "
                   "of those events are missing)",
    "crosscheck_disagreements": "calls the uprobes and CUPTI (`kvtrace run`) did not see alike: "
                                "`kvtrace doctor --pid PID` names them",
    "ledger_full": "allocations the in-kernel ledger had no room for: restart with a larger "
                   "--max-ledger-entries",
    "totals_full": "allocation changes the kernel's totals map had no room for: those processes' totals are "
                   "off until they exit; restart with a larger --max-totals",
    "share_full": "allocations refused because their user held its share of the kernel's ledger: counted, not "
                  "stored; the shares component names the users and processes",
    "sizes_clamped": "allocation sizes above 2^62 / --max-ledger-entries (4 TiB at the default size), kept as "
                     "the bound (a process making up sizes, or a ledger so large that real sizes pass it?)",
    "devices_clamped": "device ordinals outside 0-63, kept as unknown (a process making up ordinals?)",
    "stack_walker_missing": "allocations traced without their Python stack: the stack walker program "
                            "was not loaded (the agent log says why); restart the agent",
    "vllm_untrusted_senders": "processes send vLLM plugin reports kvtrace cannot tie to vLLM (no traced GPU "
                              "memory): kept apart, no finding; the vllm_trust component names them",
    "event_loop_late_turns": "turns of the agent's event loop came more than a second late (events waited; "
                             "`kvtrace ps` lagged): the agent counts the longest gap (event_loop_longest_gap_ms)",
    "flight_dumps_partial": "flight recorder dumps that left objects out (the ledger was larger than "
                            "--max-read-entries): `kvtrace flight` says what each left out",
}


# What a user at its share was refused (model/user_shares.py's resources).
_SHARES = {"vllm_senders": "its vLLM plugin reports were dropped unread",
           "cupti_connections": "its `kvtrace run` tracers' connections were closed",
           "group_connections": "its connections to the group socket were closed"}


def agent_findings(args: argparse.Namespace) -> list:
    """The running agent's own health: each part that is down and why, and what it refused or lost.
    Warnings only: the host checks decide the exit status."""
    from kvtrace.client import AgentClient
    from kvtrace.config import ConfigError, config_from_args
    from kvtrace.errors import CommandError
    from kvtrace.sources.bpf.preflight import Finding

    try:
        config = config_from_args(args)
    except ConfigError:
        return []  # said by the client commands; doctor checks the host
    if not config.socket.exists():
        return []  # no agent here to ask (not installed, or elsewhere: --socket)
    try:
        with AgentClient.for_config(config) as agent:
            info = agent.info()
    except CommandError as error:
        return [Finding("agent", True, f"no running agent answers: {error}", warning=True)]
    findings = [Finding(f"agent {component.name}", True,
                        (f"up: {component.reason}" if component.reason else "up") if component.up
                        else f"DOWN: {component.reason}", warning=not component.up)
                for component in sorted(info.components, key=lambda component: component.name)]
    for name, meaning in _AGENT_COUNTERS.items():
        if info.counters.get(name, 0):
            findings.append(Finding(f"agent {name}", True, f"{info.counters[name]} {meaning}", warning=True))
    for name, count in sorted(info.counters.items()):
        if name.startswith(SHARE_COUNTER_PREFIX) and count:  # a user at its share: that user alone was refused
            resource, user = name[len(SHARE_COUNTER_PREFIX):].split("/", 1)
            meaning = _SHARES.get(resource, resource).replace("its ", "their ")
            if user == POOL_FULL:  # every place was held: no user was at its share
                findings.append(Finding(f"agent {resource} share", True, f"{count} refused because all places were "
                                        f"held, to users within their share ({meaning})", warning=True))
                continue
            findings.append(Finding(f"agent {resource} share", True, f"{count} refused to user {user} at its share "
                                    f"({_SHARES.get(resource, resource)}); the others kept theirs", warning=True))
    return findings


def cross_check_findings(args: argparse.Namespace, pid: int) -> list:
    """What the running agent heard from `pid`'s CUPTI tracer (`kvtrace run`), and whether CUPTI and the
    uprobes saw its calls alike. Warnings only."""
    from kvtrace.client import AgentClient
    from kvtrace.config import ConfigError, config_from_args
    from kvtrace.errors import CommandError
    from kvtrace.sources.bpf.preflight import Finding

    try:
        config = config_from_args(args)
    except ConfigError:
        return []
    if not config.socket.exists():
        return []
    try:
        with AgentClient.for_config(config) as agent:
            response = agent.cross_checks([pid])
    except CommandError as error:
        return [Finding(f"pid {pid} cupti", True, f"the agent did not answer: {error}", warning=True)]
    return [finding for check in response.processes for finding in describe_cross_check(check)]


def describe_cross_check(check) -> list:
    """A ProcessCrossCheck (kvtrace.v1) as doctor's findings."""
    from kvtrace.sources.bpf.preflight import Finding

    name = f"pid {check.pid} cupti"
    state = {"tracing": "traced by CUPTI (kvtrace run)", "gone": "its CUPTI tracer has gone",
             "held": f"CUPTI is held by {check.holder or 'another subscriber'}: kvtrace run traced nothing here "
                     "(the uprobes still do)",
             "unavailable": "CUPTI unavailable", "off": "CUPTI tracing opted out"}.get(check.state, check.state)
    if check.reason:
        state += f": {check.reason}"
    findings = [Finding(name, True, state, warning=check.state in ("held", "unavailable"))]
    if not check.compared:
        return findings
    matched = sum(row.matched_count for row in check.apis)
    rows = [row for row in check.apis if row.uprobe_only_count or row.cupti_only_count or row.mismatched_count]
    per_api = ", ".join(f"{row.api_name} {row.matched_count}" for row in check.apis if row.matched_count)
    pending = f"; {check.pending_count} still waiting for the other witness (up to 10 s)" if check.pending_count else ""
    if not rows:
        findings.append(Finding(f"{name} cross-check", True, f"CUPTI and the uprobes agree: {matched} calls seen "
                                f"alike ({per_api or 'none yet'}){pending}"))
        return findings
    disagreements = "; ".join(
        f"{row.api_name}: {row.uprobe_only_count} by the uprobes only, {row.cupti_only_count} by CUPTI only, "
        f"{row.mismatched_count} seen differently" for row in rows)
    examples = "; ".join(
        f"{'uprobes' if d.seen_by == 1 else 'CUPTI' if d.seen_by == 2 else 'both'}: {d.api_name}"
        f"{' (failed)' if d.failed else ''} {d.size_bytes} B at {d.address:#x}{' — ' + d.detail if d.detail else ''}"
        for d in list(check.disagreements)[-3:])
    findings.append(Finding(f"{name} cross-check", True, f"{matched} calls seen alike, but {disagreements}"
                            f"{pending}. Latest: {examples}", warning=True))
    return findings


def agent_libraries(args: argparse.Namespace) -> tuple[frozenset[tuple[int, int]], str] | None:
    """The (device, inode) of the files the running agent has probes in, and why libraries wait for a slot
    ("" : none waits); None where no agent answers."""
    from kvtrace.client import AgentClient
    from kvtrace.config import ConfigError, config_from_args
    from kvtrace.errors import CommandError

    try:
        config = config_from_args(args)
        if not config.socket.exists():
            return None
        with AgentClient.for_config(config) as agent:
            info = agent.info()
    except (ConfigError, CommandError):
        return None
    waiting = next((c.reason for c in info.components if c.name == "libraries" and not c.up), "")
    return frozenset((library.file_device, library.inode) for library in info.attached_libraries), waiting


def process_findings(pid: int, agent: tuple[frozenset[tuple[int, int]], str] | None = None) -> list:
    """What the agent would attach to in `pid`, and whether it gets Python stacks (and why not); with the
    running agent's attached libraries (`agent`), whether it does."""
    import platform

    from kvtrace.sources.bpf.discovery import Discovery
    from kvtrace.sources.bpf.loader import torch_site
    from kvtrace.sources.bpf.preflight import (
        Finding,
        process_has_seccomp_filter,
        uretprobe_seccomp_risk,
    )
    from kvtrace.sources.python.runtime import NoPython, inspect_python

    name = f"pid {pid}"
    if not os.path.exists(f"/proc/{pid}"):
        return [Finding(name, False, f"no process {pid}", ExitCode.USAGE)]
    try:  # its maps closed to us would read as "no CUDA library": say so instead
        with open(f"/proc/{pid}/maps", "rb"):
            pass
    except PermissionError:
        fix = ("it is not dumpable or in a user namespace closed to us" if os.geteuid() == 0
               else f"another user's process: run `sudo kvtrace doctor --pid {pid}`")
        return [Finding(name, False, f"cannot read /proc/{pid}/maps ({fix})", ExitCode.PERMISSION)]
    except OSError:
        return [Finding(name, False, f"no process {pid}", ExitCode.USAGE)]
    findings = []
    targets = Discovery().scan_pid(pid)
    cuda = [target for target in targets if target.symbols]
    waiting = [t for t in cuda if (t.file_id.device, t.file_id.inode) not in agent[0]] if agent else []
    # A library slot is short only while the agent's libraries component is down (agent[1], its reason); else a
    # library with no probes yet is one the agent has not attached (just loaded, or a -p filter leaves it out).
    short = bool(agent and agent[1])
    if waiting and len(waiting) == len(cuda):
        paths = ", ".join(sorted(t.path for t in waiting))
        if short and agent:
            findings.append(Finding(
                f"{name} cuda", True, f"not traced: waiting for a library slot ({paths}: no probes in the running "
                f"agent, which says: {agent[1]}); fix: stop the processes that hold the slots (`kvtrace doctor` "
                "names the libraries component), or restart the agent with a larger --max-libraries", warning=True))
        else:
            findings.append(Finding(
                f"{name} cuda", True, f"not traced: not attached yet ({paths}: no probes in the running agent, "
                "whose libraries are all attached; it attaches a library as it finds it loaded, unless its -p "
                "filter leaves this process out)", warning=True))
    elif cuda:
        libraries = ", ".join(f"{t.path} ({len(t.symbols)} functions)" for t in cuda)
        blind = (f"; but {', '.join(t.path for t in waiting)} "
                 + (f"waits for a library slot: {agent[1]}" if short and agent else "is not attached yet")
                 ) if waiting else ""
        findings.append(Finding(f"{name} cuda", True, f"{'traced' if agent else 'traceable'}: {libraries}{blind}",
                                warning=bool(waiting)))
    else:
        findings.append(Finding(f"{name} cuda", True, "maps no CUDA library yet (nothing to trace "
                                "until it loads libcudart or libcuda)", warning=True))
    for target in targets:
        if not target.torch_probes:
            continue
        sites = [torch_site(probe) for probe in target.torch_probes]
        problems = sorted({site for site in sites if isinstance(site, str)})
        usable = len(sites) - sum(isinstance(site, str) for site in sites)
        if usable:
            findings.append(Finding(f"{name} torch", True, f"PyTorch allocator probes: {usable} of {len(sites)} "
                                    f"sites traceable in {target.path}"
                                    + (f" ({'; '.join(problems)})" if problems else "")))
        else:
            findings.append(Finding(f"{name} torch", True, f"PyTorch allocator probes in {target.path} cannot "
                                    f"be read: {'; '.join(problems)}", warning=True))
    python = inspect_python(pid)
    if isinstance(python, NoPython):
        findings.append(Finding(f"{name} python", True, f"no Python stacks: {python.reason}",
                                warning=True))
    else:
        build = " (free-threaded)" if python.offsets.free_threaded else ""
        findings.append(Finding(f"{name} python", True,
                                f"Python {python.offsets.label}{build} stacks from {python.path}"))
    if uretprobe_seccomp_risk(platform.release()) and process_has_seccomp_filter(pid):
        findings.append(Finding(f"{name} seccomp", True, "seccomp-filtered on a kernel whose "
                                "uretprobes can kill it: the agent will not attach here", warning=True))
    return findings
