"""Command lines any user can give a process: not UTF-8, full of terminal escapes, a megabyte long.

GIVEN the real agent tracing a stub workload whose argv[0] is such a title,
WHEN every report is asked for (ps, snapshot, leaks, top, unfiltered tail, /metrics),
THEN each answers (no `surrogates not allowed`, no HTTP 500), the human output carries no control
character, and the title is cut to TITLE_MAX_CHARS everywhere.
"""
import json
import re
import subprocess
import urllib.request

from agent_process import KVTRACE, AgentProcess, kvtrace
from cuda_stubs import Workload
from kvtrace.model.processes import TITLE_MAX_CHARS

# Bytes that are not UTF-8 (kept by Python as surrogates), an OSC that sets the terminal's title,
# a clear-screen, a bell, a newline that would forge a line, and 100 000 more characters.
HOSTILE_TITLE = "\udcff\udcfeevil\x1b]0;pwned\x07\x1b[2J\x1b[H\nFAKE LINE " + "A" * 100_000
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _human_output_is_safe(text: str) -> None:
    assert not CONTROL.search(text), repr(CONTROL.search(text))
    assert "FAKE LINE" not in text.split("\n")[0:1] and not any(line.startswith("FAKE LINE")
                                                                for line in text.splitlines())


def test_every_report_survives_a_hostile_title(tmp_path, bpf_here, stub_build):
    socket = tmp_path / "kvtrace.sock"
    with Workload([HOSTILE_TITLE, "hold"], executable=stub_build.workload) as workload:
        pid = workload.wait_ready()
        with AgentProcess(socket, "-p", str(pid)) as agent:
            tail = subprocess.Popen([*KVTRACE, "tail", "--socket", str(socket)], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, errors="surrogateescape")
            try:
                import time
                time.sleep(2)  # the subscription is in place before the workload allocates
                workload.go()
                workload.read_calls()
                lines = [tail.stdout.readline() for _ in range(1 + 13)]  # the header, 13 cudaMalloc
            finally:
                tail.kill()
                tail.wait()
            assert all(line.endswith("\n") for line in lines), lines
            _human_output_is_safe("".join(lines))
            assert sum(f" {pid} " in line for line in lines) == 13
            assert "\\xff\\xfeevil\\x1b]0;pwned\\x07" in lines[1]

            for command in (["ps"], ["snapshot"], ["leaks", "--min-age", "0"], ["top", "--once"]):
                result = kvtrace(*command, "--socket", str(socket))
                assert result.returncode == 0, (command, result.stderr)
                _human_output_is_safe(result.stdout)
                assert "\\x1b]0;pwned" in result.stdout or command[0] in ("top", "leaks"), (command, result.stdout)

            ps = kvtrace("ps", "--socket", str(socket), "--json")
            assert ps.returncode == 0, ps.stderr
            (process,) = [json.loads(line) for line in ps.stdout.splitlines()]
            assert process["title"].startswith("\\xff\\xfeevil\x1b]0;pwned")  # JSON keeps it, escaped
            assert len(process["title"]) == TITLE_MAX_CHARS and process["title"].endswith("chars)")

            url = re.search(r"Prometheus metrics on (\S+)", agent.stderr_text()).group(1)
            with urllib.request.urlopen(url, timeout=10) as response:
                assert response.status == 200
                assert f'pid="{pid}"' in response.read().decode()
