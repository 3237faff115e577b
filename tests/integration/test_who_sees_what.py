"""Who sees what, with the real agent: the group socket serves a redacted view, the admin socket
full detail, and the kernel's file modes decide who reaches which.

GIVEN `kvtrace agent` tracing a workload whose command line carries a secret, WHEN a member of the
socket's group and root ask for the same things, THEN the member sees redacted titles and no
addresses or stacks, root on the admin socket sees everything, and a non-member of the admin
group cannot connect to the admin socket.
"""
import grp
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest

from agent_process import AgentProcess, kvtrace
from cuda_stubs import Workload

SECRET = "sk-kvtrace-integration-secret"
NOBODY = 65534  # kvtrace(..., user=NOBODY) runs with uid and gid 65534 and no other groups


@pytest.fixture
def reachable_socket():
    """A socket path every user may walk to: the sockets' own modes must decide."""
    directory = Path(tempfile.mkdtemp(prefix="kvt", dir="/tmp"))
    os.chmod(directory, 0o755)
    try:
        yield directory / "run" / "kvtrace.sock"
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def json_lines(result):
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def test_group_member_sees_redacted_root_sees_all_and_others_cannot_reach_the_admin_socket(
        reachable_socket, stub_build, bpf_here):
    group = grp.getgrgid(NOBODY).gr_name  # nobody's own group: nobody is a member, nothing more
    title = f"vllm-serve --api-key {SECRET}"
    with Workload([title, "hold"], executable=stub_build.workload) as workload:
        pid = workload.wait_ready()
        with AgentProcess(reachable_socket, "-p", str(pid), "--group", group):
            admin = reachable_socket.with_name("kvtrace-admin.sock")
            assert stat.S_IMODE(os.stat(reachable_socket).st_mode) == 0o660
            assert stat.S_IMODE(os.stat(admin).st_mode) == 0o600 and os.stat(admin).st_uid == 0
            workload.go()
            calls = workload.read_calls()
            socket = ("--socket", str(reachable_socket))

            member = json_lines(kvtrace("snapshot", *socket, "--json", "-p", str(pid), user=NOBODY))
            root = json_lines(kvtrace("snapshot", *socket, "--json", "-p", str(pid)))
            member_ps = kvtrace("ps", *socket, "--json", user=NOBODY)
            root_ps = json_lines(kvtrace("ps", *socket, "--json"))
            refused = kvtrace("ps", "--socket", str(admin), user=NOBODY)

    # The member: the same objects, titles redacted as /metrics redacts them, no addresses.
    assert len(member) == len(root) > 0
    assert sorted(e["size_bytes"] for e in member) == sorted(e["size_bytes"] for e in root)
    assert {e["title"] for e in member} == {"vllm-serve --api-key *** hold"}
    assert {(e["address"], e["caller_address"], e["stack_id"]) for e in member} == {(0, 0, 0)}
    assert [p["title"] for p in json_lines(member_ps)] == ["vllm-serve --api-key *** hold"]
    assert "connect to the admin socket for full detail" in member_ps.stderr
    assert SECRET not in member_ps.stdout + json.dumps(member)
    # Root, through the admin socket next to --socket: everything.
    assert {e["title"] for e in root} == {f"{title} hold"}
    runtime = sorted(e["address"] for e in root if e["layer"] == "runtime")
    assert runtime == sorted(c["address"] for c in calls)
    assert all(e["caller_address"] for e in root)
    assert [p["title"] for p in root_ps] == [f"{title} hold"]
    # Not in the admin group (there is none: root only): the kernel refuses the connection.
    assert refused.returncode == 6, refused
    assert "permission denied" in refused.stderr.lower() and "Traceback" not in refused.stderr
