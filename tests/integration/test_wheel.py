"""The probes ship with the package: a wheel built from a clean checkout carries the BPF sources,
and `kvtrace agent` installed from it into a fresh virtualenv compiles and runs them.

The fresh venv sees the system's bcc (--system-site-packages, as `make setup` makes it) and takes
kvtrace's dependencies from the test's own environment through a .pth path entry, so the test
needs no network; kvtrace itself, code and probes, comes from the wheel alone."""
import os
import signal
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from agent_process import wait_until_tracing
from harness import require_tracing_here

ROOT = Path(__file__).resolve().parents[2]
PROBES = sorted(path.name for path in (ROOT / "probes").iterdir() if path.suffix in (".c", ".h"))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("wheel")
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the wheel is built from a clean clone of it")
    clone = work / "clone"
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(ROOT), str(clone)], check=True)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(work / "dist"), str(clone)], check=True, timeout=300)
    (built,) = (work / "dist").glob("kvtrace-*.whl")
    return built


def test_the_wheel_carries_every_probe_source(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert sorted(name.removeprefix("kvtrace/probes/") for name in names
                  if name.startswith("kvtrace/probes/")) == PROBES
    assert "kvtrace/py.typed" in names


@pytest.fixture(scope="module")
def fresh_venv(wheel, tmp_path_factory) -> Path:
    venv = tmp_path_factory.mktemp("venv") / "fresh"
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--system-site-packages", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)],
                   check=True, timeout=300)
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    # The dependencies (grpcio, protobuf, psutil, ...) from this test's environment, after the wheel.
    (Path(purelib) / "kvtrace-test-deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return venv


def run_fresh(venv: Path, *args: str, **kwargs) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "KVTRACE_PROBES_DIR")}
    return subprocess.run([str(venv / "bin" / "kvtrace"), *args], capture_output=True, text=True, env=env,
                          cwd="/", **kwargs)


def test_the_installed_package_is_the_wheels_and_prints_its_probes(fresh_venv):
    where = subprocess.run([str(fresh_venv / "bin" / "python"), "-c",
                            "import kvtrace.sources.bpf.abi as abi; print(abi.probes_dir())"],
                           capture_output=True, text=True, cwd="/", check=True,
                           env={"PATH": os.environ["PATH"]}).stdout.strip()
    assert where.startswith(str(fresh_venv)), where
    program = run_fresh(fresh_venv, "agent", "--ebpf")
    assert program.returncode == 0, program.stderr
    # the headers are in place in the one compile unit
    assert '#line 1 "ledger.h"' in program.stdout and "KVT_ALLOC_API(cudaMalloc" in program.stdout


def test_kvtrace_agent_from_the_wheel_loads_its_probes_and_stops(fresh_venv, tmp_path):
    require_tracing_here()
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "KVTRACE_PROBES_DIR")}
    agent = subprocess.Popen([str(fresh_venv / "bin" / "kvtrace"), "agent", "--socket", str(tmp_path / "k.sock"),
                              "--group", "root", "--metrics-listen", "off", "--no-nvml",
                              "--vllm-socket", "off", "--cupti-socket", "off"],
                             stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env, cwd="/")
    try:
        wait_until_tracing(agent)
        agent.send_signal(signal.SIGINT)
        assert agent.wait(timeout=30) == 0
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
