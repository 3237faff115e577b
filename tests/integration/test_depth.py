"""Depth per process (--blocks auto): PyTorch's allocator probes go into the processes raised to BLOCKS
only, and come out again when they are lowered, on a stub provider with torch's shapes.

GIVEN two processes of the stub allocator (tests/integration/stubs/torch_workload.c `blocks`: 28 blocks,
9 freed, in 3 segments), each on a fresh copy of the library (no probes anywhere before),
WHEN the agent raises one of them to BLOCKS and leaves the other at SEGMENTS,
THEN the raised one's semaphores are up and every block event of its arrives exactly, while the other's
semaphores stay at 0 (torch skips its probes: it pays nothing) and its segments are traced all the same;
and WHEN the raised one is lowered, its blocks leave the kernel's ledger and the agent's totals at once
and its link is gone, while its segments stay."""
import os
import time

import pytest

from cuda_stubs import Workload
from harness import TracingHarness, require_tracing_here
from kvtrace.model.depth import BlocksMode, Depth
from kvtrace.model.events import Api, Kind, Layer, ObjectKind
from kvtrace.sources.bpf.discovery import FileId
from test_torch_blocks import FREES, MALLOCS, manifest_parts
from torch_stubs import BLOCKS_SEGMENTS, build_torch_stub


def torch_totals(harness, pid):
    """(bytes, count) of `pid`'s PyTorch blocks in the agent's totals (the kernel's, less what it took out)."""
    totals = harness.session.ledger_counts().totals
    held = [value for key, value in totals.items() if key.pid == pid and key.layer is Layer.TORCH]
    return sum(size for size, _ in held), sum(count for _, count in held)


@pytest.mark.parametrize("per_process_probes_max", [8, 0], ids=["probes-per-process", "probes-per-library"])
def test_only_the_raised_process_pays_for_its_blocks(per_process_probes_max, tmp_path, stub_build):
    require_tracing_here()
    torch = build_torch_stub(tmp_path, stub_build)
    library = os.stat(torch.libc10_cuda)
    file_id = FileId(library.st_dev, library.st_ino)
    with Workload([torch.workload, "blocks"]) as raised, Workload([torch.workload, "blocks"]) as left:
        deep, shallow = raised.wait_ready(), left.wait_ready()
        harness = TracingHarness([deep, shallow], blocks=BlocksMode.AUTO,
                                 per_process_probes_max=per_process_probes_max,
                                 preattach_globs=(str(stub_build.lib_dir / "*.so.*"),))
        try:
            probes = harness.source.probes
            assert probes is not None
            assert probes.torch_attached_pids(file_id) == set()  # nobody raised yet: no PyTorch link at all
            harness.source.set_block_depths({deep: Depth.BLOCKS, shallow: Depth.SEGMENTS})
            assert probes.torch_attached_pids(file_id) == {deep}
            for workload in (raised, left):
                workload.go()
            (deep_semaphores, blocks, _), (shallow_semaphores, _, shallow_segments) = (
                manifest_parts(raised.read_calls()), manifest_parts(left.read_calls()))
            assert harness.pump_until(lambda: len(harness.of(deep, Kind.FREE, Api.pytorch_free)) >= FREES)
            assert harness.pump_until(lambda: len(harness.of(shallow, Kind.ALLOC, Api.cudaMalloc)) >= BLOCKS_SEGMENTS)
            harness.pump(0.3)

            assert deep_semaphores["malloc"] >= 1 and deep_semaphores["free"] >= 1
            assert (shallow_semaphores["malloc"], shallow_semaphores["free"]) == (0, 0)
            assert len(harness.of(deep, Kind.ALLOC, Api.pytorch_malloc)) == MALLOCS
            assert len(harness.of(deep, Kind.FREE, Api.pytorch_free)) == FREES
            assert harness.of(shallow, api=Api.pytorch_malloc) == [] == harness.of(shallow, api=Api.pytorch_free)
            # The left one's segments are traced exactly all the same.
            assert len(harness.of(shallow, Kind.ALLOC, Api.cudaMalloc)) == len(shallow_segments) == BLOCKS_SEGMENTS
            live = [b for b in blocks if not b["freed"]]
            assert torch_totals(harness, deep) == (sum(b["size_bytes"] for b in live), len(live))
            assert torch_totals(harness, shallow) == (0, 0)

            harness.source.set_block_depths({deep: Depth.SEGMENTS, shallow: Depth.SEGMENTS})
            assert probes.torch_attached_pids(file_id) == set()
            assert torch_totals(harness, deep) == (0, 0)
            kernel = harness.source.kernel_ledger()
            assert [e for e in kernel if e.key.pid == deep and e.key.object is ObjectKind.BLOCK] == []
            # Its segments are still held, exactly.
            assert len([e for e in kernel if e.key.pid == deep and e.api is Api.cuMemAlloc_v2]) == BLOCKS_SEGMENTS
        finally:
            harness.close()


def test_a_raised_process_that_exits_loses_its_link(tmp_path, stub_build):
    """Its link holds the process (the kernel keeps the task until the link closes): the exit closes it."""
    require_tracing_here()
    torch = build_torch_stub(tmp_path, stub_build)
    library = os.stat(torch.libc10_cuda)
    file_id = FileId(library.st_dev, library.st_ino)
    with Workload([torch.workload, "blocks"]) as workload:
        pid = workload.wait_ready()
        harness = TracingHarness([pid], blocks=BlocksMode.AUTO, preattach_globs=(str(stub_build.lib_dir / "*.so.*"),))
        try:
            probes = harness.source.probes
            assert probes is not None
            harness.source.set_block_depths({pid: Depth.FULL})
            assert probes.torch_attached_pids(file_id) == {pid}
            workload.go()
            workload.read_calls()
            assert harness.pump_until(lambda: len(harness.of(pid, Kind.FREE, Api.pytorch_free)) >= FREES)
        finally:
            workload.finish()
            try:
                assert harness.pump_until(lambda: harness.of(pid, Kind.PROCESS_EXIT) != [])
                harness.pump(0.2)
                assert probes.torch_attached_pids(file_id) == set()
            finally:
                harness.close()


def quiet(harness):
    """Nobody reads every block's event: the harness's sink says so (as the flight recorder does), and, its
    wish changed in place, tells the Session (as the API's hub does when a stream comes or goes)."""
    for sink in harness.session._sinks:
        sink.wants_every_block = False
    harness.session.refresh_block_readers()


def test_blocks_nobody_reads_are_not_sent_and_stay_exact(tmp_path, stub_build):
    """GIVEN the stub allocator's 28 blocks (9 freed) in a process without Python (no stack to walk), WHEN no
    sink wants every block, THEN none of its block events is sent (28 + 9 counted quiet, none lost) and the
    kernel's ledger and totals hold its 19 live blocks exactly; its segments are sent as ever."""
    require_tracing_here()
    torch = build_torch_stub(tmp_path, stub_build)
    with Workload([torch.workload, "blocks"]) as workload:
        pid = workload.wait_ready()
        harness = TracingHarness([pid], preattach_globs=(str(stub_build.lib_dir / "*.so.*"),))
        try:
            quiet(harness)
            harness.pump(0.1)
            before = harness.source.counters()
            workload.go()
            _, blocks, segments = manifest_parts(workload.read_calls())
            assert harness.pump_until(lambda: len(harness.of(pid, Kind.ALLOC, Api.cudaMalloc)) >= len(segments))
            harness.pump(0.3)
            after = harness.source.counters()
            assert harness.of(pid, api=Api.pytorch_malloc) == [] == harness.of(pid, api=Api.pytorch_free)
            assert after["blocks_quiet"] - before["blocks_quiet"] == MALLOCS + FREES
            assert after["events_lost"] == before["events_lost"] and after["blocks_unsent"] == before["blocks_unsent"]
            live = [b for b in blocks if not b["freed"]]
            assert torch_totals(harness, pid) == (sum(b["size_bytes"] for b in live), len(live))
            assert sorted((e.key.address, e.size_bytes) for e in harness.source.kernel_ledger()
                          if e.key.pid == pid and e.key.object is ObjectKind.BLOCK) == \
                sorted((b["address"], b["size_bytes"]) for b in live)
        finally:
            harness.close()


def test_quiet_blocks_send_the_sampled_ones_only(stub_build, torch_stub_build):
    """GIVEN a CPython 3.12 process making 4 000 blocks of 16 KiB and 10 of at least S = 256 KiB, sampled, WHEN
    no sink wants every block, THEN exactly the blocks whose stacks were walked are sent (each with its stack),
    the others are counted quiet, and the kernel holds all of them."""
    from kvtrace.model.events import StackStatus
    from test_python_stacks import TARGET as ALLOC_TARGET
    from test_python_stacks import pyenv_python
    from test_torch_blocks import LARGE_BLOCKS, SAMPLE_BYTES, SAMPLED_SPEC, SMALL_BLOCKS

    python = pyenv_python("3.12")
    target = ALLOC_TARGET.parent / "block_target.py"
    count = SMALL_BLOCKS + sum(LARGE_BLOCKS.values())
    with Workload([python, target, torch_stub_build.libc10_cuda, SAMPLED_SPEC]) as workload:
        pid = workload.wait_ready()
        harness = TracingHarness([pid], block_sample_bytes=SAMPLE_BYTES,
                                 preattach_globs=(str(torch_stub_build.lib_dir / "*.so"),
                                                  str(stub_build.lib_dir / "*.so.*")))
        try:
            quiet(harness)
            harness.pump(0.1)
            before = harness.source.counters()
            workload.go()
            assert len(workload.read_calls()) == count
            assert harness.pump_until(lambda: len([e for e in harness.source.kernel_ledger()
                                                   if e.key.pid == pid and e.key.object is ObjectKind.BLOCK]) == count)
            harness.pump(0.5)
            after = harness.source.counters()
            sampled = after["blocks_sampled"] - before["blocks_sampled"]
            passed_over = after["blocks_not_sampled"] - before["blocks_not_sampled"]
            events = harness.of(pid, Kind.ALLOC, Api.pytorch_malloc)
            assert sampled + passed_over == SMALL_BLOCKS and 0 < sampled < SMALL_BLOCKS
            assert len(events) == sampled + sum(LARGE_BLOCKS.values())
            assert all(e.stack_status is StackStatus.OK and e.stack_id for e in events)
            assert after["blocks_quiet"] - before["blocks_quiet"] == passed_over
        finally:
            harness.close()


def test_kvtrace_deep_raises_and_lowers_a_process_through_the_agent(tmp_path, stub_build):
    """GIVEN the agent as shipped (--blocks auto) following the stub allocator's process (at segments: no PyTorch
    link), WHEN `kvtrace deep --pid P --full` runs on the admin socket, THEN `kvtrace ps --json` says it is at
    full on the operator's request and its blocks are traced exactly (19 live after the scenario); and WHEN
    `kvtrace deep --pid P --off` runs, it is back at segments and its blocks leave the totals."""
    import json

    from agent_process import AgentProcess, kvtrace

    require_tracing_here()
    torch = build_torch_stub(tmp_path, stub_build)
    agent_socket = tmp_path / "kvtrace.sock"
    admin = agent_socket.with_name("kvtrace-admin.sock")

    def process(pid):
        ps = kvtrace("ps", "--socket", str(admin), "--json")
        assert ps.returncode == 0, ps.stderr
        return next((json.loads(line) for line in ps.stdout.splitlines() if json.loads(line)["pid"] == pid), None)

    def torch_held(row):
        return sum(total["size_bytes"] for total in row["totals"] if total["layer"] == "torch") if row else None

    def poll(predicate, what, timeout_seconds=30.0):
        deadline = time.monotonic() + timeout_seconds
        while True:
            value = predicate()
            if value or time.monotonic() > deadline:
                assert value, what
                return value
            time.sleep(0.3)

    with Workload([torch.workload, "blocks"]) as workload:
        pid = workload.wait_ready()
        with AgentProcess(agent_socket, "-p", str(pid), "--no-nvml"):
            asked = kvtrace("deep", "--pid", str(pid), "--full", "--for", "5m", "--socket", str(admin))
            assert asked.returncode == 0, asked.stderr
            assert "full" in asked.stdout

            def linked():  # the agent applies a request at its next analysis (within a second or so)
                from kvtrace.client import AgentClient

                with AgentClient.for_socket(admin) as client:
                    return any(library.path == str(torch.libc10_cuda) and "pytorch:malloc" in library.symbols
                               for library in client.info().attached_libraries)

            poll(linked, "PyTorch's allocator probes in")
            workload.go()
            semaphores, blocks, _ = manifest_parts(workload.read_calls())
            live = sum(b["size_bytes"] for b in blocks if not b["freed"])
            row = poll(lambda: (row := process(pid)) and torch_held(row) == live and row, "its blocks in ps")
            assert row["depth"]["depth"] == "full" and row["depth"]["cause"] == "operator", row["depth"]
            assert semaphores["malloc"] >= 1  # raised before the scenario began
            off = kvtrace("deep", "--pid", str(pid), "--off", "--socket", str(admin))
            assert off.returncode == 0, off.stderr
            row = poll(lambda: (row := process(pid)) and row["depth"]["depth"] == "segments" and row,
                       "back at segments")
            assert torch_held(row) in (0, None)


def test_the_agent_raises_a_growing_process_on_its_own(tmp_path, stub_build):
    """GIVEN the agent as shipped but with a 4 MiB growth threshold and no start-up grace, following a Python
    process that maps the stub PyTorch allocator and holds 1 MiB, WHEN it then cudaMallocs 8 MiB more, THEN the
    agent raises it to blocks by itself (cause growth, the evidence in words) and links PyTorch's allocator
    probes into it; a process that maps no PyTorch allocator and grows alike stays at segments (no_blocks)."""
    import json
    import sys
    import textwrap

    from agent_process import AgentProcess, kvtrace
    from kvtrace.client import AgentClient

    require_tracing_here()
    torch = build_torch_stub(tmp_path, stub_build)
    script = tmp_path / "grower.py"
    script.write_text(textwrap.dedent("""
        import ctypes, os, sys
        cudart = ctypes.CDLL(sys.argv[1])
        if len(sys.argv) > 2:
            ctypes.CDLL(sys.argv[2])  # maps PyTorch's allocator (its probes), allocates nothing through it
        kept = []
        print("ready", os.getpid(), flush=True)
        for line in sys.stdin:
            for _ in range(int(line)):
                pointer = ctypes.c_void_p()
                assert cudart.cudaMalloc(ctypes.byref(pointer), ctypes.c_size_t(1 << 20)) == 0
                kept.append(pointer)
            print("ok", flush=True)
    """))
    socket = tmp_path / "kvtrace.sock"

    def depth_of(pid):
        ps = kvtrace("ps", "--socket", str(socket), "--json")
        assert ps.returncode == 0, ps.stderr
        return next((json.loads(line)["depth"] for line in ps.stdout.splitlines()
                     if json.loads(line)["pid"] == pid), None)

    def grow(workload, count):
        workload.process.stdin.write(f"{count}\n")
        workload.process.stdin.flush()
        workload.expect_line("ok")

    with Workload([sys.executable, str(script), str(stub_build.libcudart), str(torch.libc10_cuda)]) as torch_user, \
            Workload([sys.executable, str(script), str(stub_build.libcudart)]) as plain:
        pids = torch_user.wait_ready(), plain.wait_ready()
        with AgentProcess(socket, "-p", str(pids[0]), "-p", str(pids[1]), "--no-nvml", "--deepen-growth", "4MiB",
                          "--deepen-grace-seconds", "0"):
            for workload in (torch_user, plain):
                grow(workload, 1)
            deadline = time.monotonic() + 30  # generous: a CLI call takes a second on a busy 2-core machine
            while any(depth_of(pid) is None for pid in pids) and time.monotonic() < deadline:
                time.sleep(0.3)  # both seen holding 1 MiB: their series start there
            assert [depth_of(pid)["depth"] for pid in pids] == ["segments", "segments"]
            for workload in (torch_user, plain):
                grow(workload, 8)
            deadline = time.monotonic() + 30
            while (depth := depth_of(pids[0]))["depth"] != "blocks" and time.monotonic() < deadline:
                time.sleep(0.3)
            assert depth["depth"] == "blocks" and depth["cause"] == "growth", depth
            assert "traced bytes +8 MiB" in depth["detail"] and depth["sample_bytes"] == 512 << 10, depth
            plain_depth = depth_of(pids[1])
            assert plain_depth["depth"] == "segments" and plain_depth["cause"] == "no_blocks", plain_depth
            # The attached libraries are reported to the Session once a second: wait for the report.
            deadline = time.monotonic() + 30
            while True:
                with AgentClient.for_socket(socket.with_name("kvtrace-admin.sock")) as client:
                    libraries = client.info().attached_libraries
                linked = any(library.path == str(torch.libc10_cuda) and "pytorch:malloc" in library.symbols
                             for library in libraries)
                if linked or time.monotonic() > deadline:
                    break
                time.sleep(0.3)
            assert linked
