"""`kvtrace doctor --pid`: what the agent can trace in one process, or why not."""
import os
import subprocess

import pytest

from kvtrace.cli.doctor import headers_of_this_kernel, headers_release, process_findings
from kvtrace.errors import ExitCode


def test_missing_process_is_a_usage_problem():
    findings = process_findings(2 ** 22 + 7)
    assert [(f.ok, f.exit_code) for f in findings] == [(False, ExitCode.USAGE)]


def test_a_python_process_without_cuda_says_so_and_names_its_python():
    findings = {f.name.split()[-1]: f for f in process_findings(os.getpid())}
    assert findings["cuda"].warning and "no CUDA library" in findings["cuda"].message
    python = findings["python"]
    # This interpreter is 3.10-3.13 (supported) unless its memory cannot be read as this user.
    assert python.ok
    assert "Python 3." in python.message or "no Python stacks:" in python.message


def test_unsupported_python_gives_the_reason():
    old = "/root/.pyenv/versions/3.9.18/bin/python3"
    if not os.path.exists(old) or os.geteuid() != 0:
        pytest.skip("needs root and pyenv's CPython 3.9 to read an unsupported interpreter")
    child = subprocess.Popen([old, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        import time
        time.sleep(0.3)
        findings = {f.name.split()[-1]: f for f in process_findings(child.pid)}
        assert "Python 3.9 is not supported" in findings["python"].message
    finally:
        child.kill()
        child.wait()


RUNNING = "6.8.0-45-generic"


def headers_tree(root, release_dir: str, uts_release: str | None):
    """/usr/src/linux-headers-<release_dir>, linked from /lib/modules/RUNNING/build as Debian does."""
    headers = root / "usr/src" / f"linux-headers-{release_dir}"
    (headers / "include/generated").mkdir(parents=True)
    if uts_release is not None:
        (headers / "include/generated/utsrelease.h").write_text(f'#define UTS_RELEASE "{uts_release}"\n')
    (root / "lib/modules" / RUNNING).mkdir(parents=True)
    (root / "lib/modules" / RUNNING / "build").symlink_to(headers)
    return root / "lib/modules" / RUNNING / "build"


@pytest.mark.parametrize(("release_dir", "uts_release", "theirs"), [
    (RUNNING, RUNNING, RUNNING),
    ("6.1.0-57-amd64", "6.1.0-57-amd64", "6.1.0-57-amd64"),  # a kernel upgraded, its headers not
    ("6.1.0-57-amd64", None, "6.1.0-57-amd64"),  # no utsrelease.h: the directory's name says
    (RUNNING, "6.1.0-57-amd64", "6.1.0-57-amd64"),  # the file is believed over the name
])
def test_headers_release(tmp_path, release_dir, uts_release, theirs):
    assert headers_release(headers_tree(tmp_path, release_dir, uts_release)) == theirs


def test_headers_of_another_kernel_are_a_warning_naming_the_package(tmp_path):
    from kvtrace.sources.bpf.preflight import check_kernel_headers

    build = headers_tree(tmp_path, "6.1.0-57-amd64", "6.1.0-57-amd64")
    found = check_kernel_headers(RUNNING, tmp_path)
    assert found.ok and not found.warning  # preflight: they are there
    finding = headers_of_this_kernel(found, RUNNING, tmp_path)
    assert finding.ok and finding.warning and finding.name == "kernel headers"
    assert finding.message.startswith(f"{build} holds the headers of kernel 6.1.0-57-amd64, not of the running "
                                      f"{RUNNING}: ")
    assert f"install linux-headers-{RUNNING} (`apt-get install linux-headers-$(uname -r)`" in finding.message


def test_headers_of_this_kernel_pass_unremarked(tmp_path):
    from kvtrace.sources.bpf.preflight import check_kernel_headers

    headers_tree(tmp_path, RUNNING, RUNNING)
    found = check_kernel_headers(RUNNING, tmp_path)
    assert headers_of_this_kernel(found, RUNNING, tmp_path) is found


def test_a_library_without_probes_waits_for_a_slot_only_while_the_libraries_component_is_down(monkeypatch):
    from kvtrace.sources.bpf import discovery
    from kvtrace.sources.bpf.discovery import FileId, Target

    cudart = Target(FileId(1, 2), "/opt/libcudart.so.12", ("cudaMalloc",))
    monkeypatch.setattr(discovery.Discovery, "scan_pid", lambda self, pid: [cudart])

    def cuda_message(agent):
        return next(f.message for f in process_findings(os.getpid(), agent) if f.name.endswith(" cuda"))

    # the agent just loaded, or its -p filter leaves the process out: no shortage
    assert cuda_message((frozenset(), "")).startswith("not traced: not attached yet (/opt/libcudart.so.12")
    # the libraries component is down: a shortage of slots
    message = cuda_message((frozenset(), "64 of 64 library slots held"))
    assert message.startswith("not traced: waiting for a library slot (/opt/libcudart.so.12")
    assert "64 of 64 library slots held" in message
    assert cuda_message((frozenset({(1, 2)}), "")).startswith("traced: /opt/libcudart.so.12")
