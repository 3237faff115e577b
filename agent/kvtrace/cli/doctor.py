"""`kvtrace doctor`: one line per host check, with the fix for each problem."""
from __future__ import annotations

import argparse
import json

from kvtrace.cli.errors import ExitCode

EPILOG = """examples:
  sudo kvtrace doctor          # run it as the agent would run: root sees what the agent sees
  kvtrace doctor --json        # a list of {name, ok, warning, message, exit_code}

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

    def run(self, args: argparse.Namespace) -> int:
        from kvtrace.sources.bpf import preflight

        findings = preflight.run_checks()
        if args.json:
            print(json.dumps([finding.to_json_dict() for finding in findings], indent=2))
        else:
            for finding in findings:
                status = "FAIL" if not finding.ok else "warn" if finding.warning else "ok"
                print(f"{status:<6}{finding.name}: {finding.message}")
        problems = [finding for finding in findings if not finding.ok]
        return problems[0].exit_code if problems else ExitCode.OK
