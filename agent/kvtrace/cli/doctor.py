"""`kvtrace doctor`: one line per host check, with the fix for each problem."""
from __future__ import annotations

import argparse
import json
import os

from kvtrace.errors import ExitCode
from kvtrace.human import printable

EPILOG = """examples:
  sudo kvtrace doctor          # run it as the agent would run: root sees what the agent sees
  kvtrace doctor --json        # a list of {name, ok, warning, message, exit_code}
  sudo kvtrace doctor --pid 4242   # also: what kvtrace can trace in that process, or why not

exit status: 0 when the agent can run here, else the exit code of the first problem
(3 permission, 4 kernel, 5 bcc missing).
"""


class DoctorCommand:
    """Check that this host can run the kvtrace agent.

    Checks privileges, kernel options, BTF, tracefs, kernel headers, bcc and the uretprobe/seccomp
    kernel bug, and prints one actionable line for each problem. Changes nothing on the host.
    """

    EPILOG = EPILOG

    def prepare_parser(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--json", action="store_true", help="print the findings as JSON")
        parser.add_argument("-p", "--pid", type=int,
                            help="also check one process: its CUDA libraries and its Python stacks")

    def run(self, args: argparse.Namespace) -> int:
        from kvtrace.sources.bpf import preflight

        findings = preflight.run_checks()
        if args.pid is not None:
            findings += process_findings(args.pid)
        if args.json:
            print(json.dumps([finding.to_json_dict() for finding in findings], indent=2))
        else:
            for finding in findings:
                status = "FAIL" if not finding.ok else "warn" if finding.warning else "ok"
                print(f"{status:<6}{finding.name}: {printable(finding.message)}")
        problems = [finding for finding in findings if not finding.ok]
        return problems[0].exit_code if problems else ExitCode.OK


def process_findings(pid: int) -> list:
    """What the agent would attach to in `pid`, and whether it gets Python stacks (and why not)."""
    import platform

    from kvtrace.sources.bpf.loader import torch_site
    from kvtrace.sources.bpf.preflight import (
        Finding,
        process_has_seccomp_filter,
        uretprobe_seccomp_risk,
    )
    from kvtrace.sources.discovery import Discovery
    from kvtrace.sources.python.runtime import NoPython, inspect_python

    name = f"pid {pid}"
    if not os.path.exists(f"/proc/{pid}"):
        return [Finding(name, False, f"no process {pid}", ExitCode.USAGE)]
    findings = []
    targets = Discovery().scan_pid(pid)
    cuda = [target for target in targets if target.symbols]
    if cuda:
        libraries = ", ".join(f"{t.path} ({len(t.symbols)} functions)" for t in cuda)
        findings.append(Finding(f"{name} cuda", True, f"traceable: {libraries}"))
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
        findings.append(Finding(f"{name} python", True, f"Python {python.version[0]}."
                                f"{python.version[1]} stacks from {python.path}"))
    if uretprobe_seccomp_risk(platform.release()) and process_has_seccomp_filter(pid):
        findings.append(Finding(f"{name} seccomp", True, "seccomp-filtered on a kernel whose "
                                "uretprobes can kill it: the agent will not attach here", warning=True))
    return findings
