"""Library churn any user can cause: new copies of libcudart (venvs, temp copies, images) and files
replaced in place (`pip install -U`).

GIVEN an agent allowed 6 libraries at once,
WHEN 30 processes each load their own libcudart (15 directories, each file replaced in place once),
THEN every process is traced exactly (17 of 17 cudaMalloc), the agent never holds more than 6
libraries, and the unused ones were detached.
"""
import os
import shutil

import pytest

from cuda_stubs import Workload
from harness import TracingHarness, require_tracing_here
from kvtrace.model.events import Api, Kind

MAX_LIBRARIES = 6
RUNS = 30


def _install(build, directory):
    """Copies the stub libraries into `directory` as new files (new inodes at the same paths)."""
    directory.mkdir(exist_ok=True)
    for source, name in ((build.libcudart, "libcudart.so.12"), (build.libcuda, "libcuda.so.1")):
        staged = directory / f".{name}.new"
        shutil.copy(source, staged)
        os.replace(staged, directory / name)  # what pip does: the old inode lives on in old mappings


@pytest.fixture
def churn_tracer():
    require_tracing_here()
    harness = TracingHarness(only_selected=True, preattach_globs=(), max_libraries=MAX_LIBRARIES,
                             detach_idle_seconds=0, sweep_seconds=0.1)
    yield harness
    harness.close()


def test_thirty_copies_and_replacements_are_each_traced_within_the_limit(churn_tracer, stub_build, tmp_path):
    harness = churn_tracer
    most_attached = 0
    inodes = set()
    for run in range(RUNS):
        directory = tmp_path / f"venv{run // 2}"
        _install(stub_build, directory)  # run 2k: a new directory; run 2k+1: the same paths, replaced
        library = directory / "libcudart.so.12"
        inodes.add(os.stat(library).st_ino)
        with Workload([stub_build.dlopen_workload, library]) as workload:
            pid = workload.wait_ready()
            harness.source.follow(pid)
            workload.go()
            workload.expect_line("loaded")
            inode = os.stat(library).st_ino
            attached = harness.pump_until(
                lambda inode=inode: any(lib.inode == inode and lib.symbols
                                        for lib in harness.source.attached_libraries()), timeout_seconds=5)
            assert attached, f"run {run}: {library} not attached; {harness.source.refused}"
            workload.go()
            calls = workload.read_calls()
            harness.pump_until(lambda pid=pid: len(harness.of(pid, Kind.ALLOC, Api.cudaMalloc)) >= 17)
            mallocs = harness.of(pid, Kind.ALLOC, Api.cudaMalloc)
            assert [(e.address, e.size_bytes) for e in mallocs] == [
                (c["address"], c["size_bytes"]) for c in calls], f"run {run}"
            most_attached = max(most_attached, len(harness.source.attached_libraries()))
        harness.pump(0.3)  # the exit is seen, the sweep detaches what nobody maps
    counters = harness.session.counters()
    print(f"\n{RUNS} runs, {len(inodes)} distinct libcudart files; at most {most_attached} libraries "
          f"attached; {counters['libraries_detached']} detached, {counters['libraries_refused']} refused")
    assert len(inodes) >= RUNS // 2  # a freed inode number may come back for a later copy
    assert most_attached <= MAX_LIBRARIES
    assert counters["libraries_detached"] >= 2 * RUNS - MAX_LIBRARIES


def test_a_library_replaced_under_a_running_process_is_traced_in_that_process(churn_tracer, stub_build, tmp_path):
    # GIVEN a process that loaded libcudart, then the file replaced at its path (pip install -U)
    # before the agent attached to it: the path now names another file than the one it runs
    harness = churn_tracer
    directory = tmp_path / "venv"
    _install(stub_build, directory)
    library = directory / "libcudart.so.12"
    with Workload([stub_build.dlopen_workload, library]) as workload:
        pid = workload.wait_ready()
        workload.go()
        workload.expect_line("loaded")
        mapped_inode = os.stat(library).st_ino
        _install(stub_build, directory)  # replaced in place while mapped
        assert os.stat(library).st_ino != mapped_inode
        # WHEN the agent follows it
        harness.source.follow(pid)
        assert harness.pump_until(lambda: any(lib.inode == mapped_inode and lib.symbols
                                              for lib in harness.source.attached_libraries()), timeout_seconds=5)
        workload.go()
        calls = workload.read_calls()
        harness.pump_until(lambda: len(harness.of(pid, Kind.ALLOC, Api.cudaMalloc)) >= 17)
        # THEN the probes went into the file it maps (not the new one at the path): every call traced
        mallocs = harness.of(pid, Kind.ALLOC, Api.cudaMalloc)
        paths = [lib.path for lib in harness.source.attached_libraries() if lib.inode == mapped_inode]
        print(f"\nattached through {paths}: {len(mallocs)} of {len(calls)} cudaMalloc")
        assert [(e.address, e.size_bytes) for e in mallocs] == [(c["address"], c["size_bytes"]) for c in calls]
