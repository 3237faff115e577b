"""PyTorch's caching allocator through its USDT probes, on a stub provider with torch's shapes.

GIVEN a program whose stub libc10_cuda.so hands out blocks from segments it cudaMalloc's, with
probes pytorch:malloc(pointer, device, size, stream) and pytorch:free(pointer) behind semaphores
(tests/integration/stubs/c10_cuda_stub.c, the `blocks` scenario of torch_workload.c),
WHEN the agent traces it, THEN every block event arrives exactly, the blocks are exact in the ledger
(kernel and user space), each lies in its segment, and fragmentation is what the manifest implies;
and nothing tracing leaves the semaphores at 0 (the probes cost nothing then)."""
import math
import os
from collections import Counter

import pytest

from cuda_stubs import Workload
from harness import TracingHarness, require_tracing_here
from kvtrace.model.blocks import fragmentation, segments_of
from kvtrace.model.events import Api, Kind, Layer, ObjectKind
from kvtrace.model.ledger import Ledger, TotalsKey
from kvtrace.sources.bpf.discovery import FileId
from torch_stubs import (
    BLOCKS_DEVICE0_FREES,
    BLOCKS_DEVICE0_MALLOCS,
    BLOCKS_DEVICE1_FREES,
    BLOCKS_DEVICE1_MALLOCS,
    BLOCKS_SEGMENTS,
    build_torch_stub,
)

MALLOCS = BLOCKS_DEVICE0_MALLOCS + BLOCKS_DEVICE1_MALLOCS  # 28
FREES = BLOCKS_DEVICE0_FREES + BLOCKS_DEVICE1_FREES  # 9


def manifest_parts(manifest):
    semaphores = next(line for line in manifest if line.get("kind") == "semaphores")
    blocks = [line for line in manifest if line.get("kind") == "block"]
    segments = [line for line in manifest if line.get("kind") == "segment"]
    return semaphores, blocks, segments


@pytest.fixture
def traced_blocks(trace, torch_stub_build):
    with Workload([torch_stub_build.workload, "blocks"]) as workload:
        pid = workload.wait_ready()
        harness = trace(pid)
        workload.go()
        manifest = workload.read_calls()
        arrived = harness.pump_until(lambda: len(harness.of(pid, Kind.FREE, Api.pytorch_free)) >= FREES)
        harness.pump(0.3)
        assert arrived, f"{len(harness.of(pid, api=Api.pytorch_malloc))} of {MALLOCS} block allocations"
        yield pid, harness, manifest


def test_every_block_event_exact(traced_blocks):
    pid, harness, manifest = traced_blocks
    semaphores, blocks, segments = manifest_parts(manifest)
    # The probes were in when the scenario started: the kernel raised both semaphores.
    assert semaphores["malloc"] >= 1 and semaphores["free"] >= 1
    mallocs = harness.of(pid, Kind.ALLOC, Api.pytorch_malloc)
    frees = harness.of(pid, Kind.FREE, Api.pytorch_free)
    assert len(mallocs) == MALLOCS and len(frees) == FREES
    assert [(e.address, e.size_bytes, e.device, e.stream) for e in mallocs] == \
        [(b["address"], b["size_bytes"], b["device"], b["stream"]) for b in blocks]
    assert all((e.layer, e.object) == (Layer.TORCH, ObjectKind.BLOCK) for e in mallocs + frees)
    assert Counter(e.device for e in mallocs) == {0: BLOCKS_DEVICE0_MALLOCS, 1: BLOCKS_DEVICE1_MALLOCS}
    # A free carries the size and device of the block it frees (from the kernel ledger).
    freed = sorted((b["address"], b["size_bytes"], b["device"]) for b in blocks if b["freed"])
    assert sorted((e.address, e.size_bytes, e.device) for e in frees) == freed
    # Nothing was lost or left unsent, and the probe read every site.
    counters = harness.source.counters()
    assert counters["usdt_unreadable"] == 0 and counters["blocks_unsent"] == 0
    assert len(segments) == BLOCKS_SEGMENTS


def test_blocks_are_exact_in_both_ledgers_and_nest_in_their_segments(traced_blocks):
    pid, harness, manifest = traced_blocks
    _, blocks, segments = manifest_parts(manifest)
    live = sorted((b["address"], b["size_bytes"], b["device"]) for b in blocks if not b["freed"])
    assert len(live) == MALLOCS - FREES
    for entries in (harness.session.ledger, harness.source.kernel_ledger()):
        held = sorted((e.key.address, e.size_bytes, e.device) for e in entries
                      if e.key.pid == pid and e.key.object is ObjectKind.BLOCK)
        assert held == live
    mine = [e for e in harness.session.ledger if e.key.pid == pid]
    nested, outside = segments_of(mine)
    assert outside == []
    assert sorted((s.address, s.size_bytes) for s in nested) == \
        sorted((s["address"], s["size_bytes"]) for s in segments)
    # Segments carry the device their cudaMalloc was traced on: device 1 after cudaSetDevice(1);
    # before it the thread had selected none (torch never calls cudaSetDevice(0)): CUDA's device 0.
    # (The agent came after the process started, but the stub process sees no /dev/nvidiaN, so no
    # second GPU it could have selected unseen.) Blocks carry the device torch says.
    traced_device = {0: 0, 1: 1}
    assert sorted((s.address, s.device) for s in nested) == \
        sorted((s["address"], traced_device[s["device"]]) for s in segments)
    by_address = {s.address: s for s in nested}
    for block in blocks:
        if not block["freed"]:
            assert block["address"] in {b.key.address for b in by_address[block["segment"]].blocks}
    # Per segment: the bytes no live block covers, as asked (the manifest's free_bytes counts the
    # rounded block sizes the stub's allocator carved; the probes report the requested sizes).
    for segment in segments:
        requested = sum(b["size_bytes"] for b in blocks if not b["freed"] and b["segment"] == segment["address"])
        assert by_address[segment["address"]].free_bytes == segment["size_bytes"] - requested
    # Fragmentation per device: reserved = segments, allocated = live blocks, largest free stretch.
    rows = {row.device: row for row in fragmentation(nested, outside)}
    assert sorted(rows) == [0, 1]
    for device in (0, 1):
        row = rows[traced_device[device]]
        on_device = [s for s in segments if s["device"] == device]
        assert row.reserved_bytes == sum(s["size_bytes"] for s in on_device)
        assert row.allocated_bytes == sum(size for _, size, d in live if d == device)
        assert row.largest_free_bytes == max(by_address[s["address"]].largest_free_bytes for s in on_device)
        assert (row.segments, row.blocks, row.blocks_outside_segments) == \
            (len(on_device), sum(1 for _, _, d in live if d == device), 0)
        assert 0.0 <= row.ratio < 1.0


def test_leak_suspects_are_the_blocks_not_the_segments(traced_blocks):
    pid, harness, manifest = traced_blocks
    from kvtrace.analysis.leaks import survey_sites

    survey = survey_sites(harness.session.ledger, 0, 0, pids=[pid])
    _, blocks, _ = manifest_parts(manifest)
    assert survey.allocations_considered == MALLOCS - FREES  # blocks, where blocks are traced
    assert sum(survey.site_bytes.values()) == sum(b["size_bytes"] for b in blocks if not b["freed"])


def test_nothing_tracing_leaves_the_semaphores_at_zero(tmp_path, stub_build):
    """A fresh copy of the stub (its own inode: no probes anywhere) run twice, untraced and traced."""
    require_tracing_here()
    torch = build_torch_stub(tmp_path, stub_build)
    with Workload([torch.workload, "blocks"]) as workload:
        workload.wait_ready()
        workload.go()
        semaphores, _, _ = manifest_parts(workload.read_calls())
    assert (semaphores["malloc"], semaphores["free"]) == (0, 0)
    with Workload([torch.workload, "blocks"]) as workload:
        pid = workload.wait_ready()
        harness = TracingHarness([pid], preattach_globs=(str(stub_build.lib_dir / "*.so.*"),))
        try:
            assert any(library.path == str(torch.libc10_cuda) and "pytorch:malloc" in library.symbols
                       for library in harness.source.attached_libraries())
            workload.go()
            semaphores, blocks, _ = manifest_parts(workload.read_calls())
            assert harness.pump_until(lambda: len(harness.of(pid, api=Api.pytorch_malloc)) >= MALLOCS)
        finally:
            harness.close()
    assert semaphores["malloc"] >= 1 and semaphores["free"] >= 1
    # Detached again: a new run of the same library sees 0.
    with Workload([torch.workload, "blocks"]) as workload:
        workload.wait_ready()
        workload.go()
        semaphores, _, _ = manifest_parts(workload.read_calls())
    assert (semaphores["malloc"], semaphores["free"]) == (0, 0)


def test_block_events_over_the_rate_stay_exact_in_the_ledger(tmp_path, stub_build):
    """With a rate of 10 block events a second, 37 events: 27 unsent and counted, the kernel's
    ledger exact all the same, and the Session's after the resync that the unsent ones trigger."""
    require_tracing_here()
    from kvtrace.sources.bpf.loader import ProbeSettings

    torch = build_torch_stub(tmp_path, stub_build)
    with Workload([torch.workload, "blocks"]) as workload:
        pid = workload.wait_ready()
        harness = TracingHarness([pid], settings=ProbeSettings(block_events_per_second=10),
                                 preattach_globs=(str(stub_build.lib_dir / "*.so.*"),))
        try:
            workload.go()
            _, blocks, _ = manifest_parts(workload.read_calls())
            live = sorted((b["address"], b["size_bytes"]) for b in blocks if not b["freed"])
            counters = {}

            def settled():
                counters.update(harness.source.counters())
                held = sorted((e.key.address, e.size_bytes) for e in harness.session.ledger
                              if e.key.pid == pid and e.key.object is ObjectKind.BLOCK)
                return counters["blocks_unsent"] > 0 and held == live and harness.session.resyncs_total >= 1

            assert harness.pump_until(settled, timeout_seconds=10), counters
            block_events = len(harness.of(pid, api=Api.pytorch_malloc)) + len(harness.of(pid, api=Api.pytorch_free))
            assert block_events + counters["blocks_unsent"] == MALLOCS + FREES
            kernel_entries = [e for e in harness.source.kernel_ledger()
                              if e.key.pid == pid and e.key.object is ObjectKind.BLOCK]
            assert sorted((e.key.address, e.size_bytes) for e in kernel_entries) == live
            # The event about a block and its kernel entry carry one timestamp, which is how a
            # resync knows the entry is that event's allocation and keeps its stack (this C
            # workload has none; tests/unit/test_ledger.py checks the keeping): the first 10
            # events (all sent) are small mallocs, 7 of them still live.
            sent = {(e.address, e.timestamp_ns) for e in harness.of(pid, api=Api.pytorch_malloc)}
            assert len([e for e in kernel_entries if (e.key.address, e.timestamp_ns) in sent]) >= 7
        finally:
            harness.close()


def test_two_chosen_processes_share_one_set_of_probe_sites(tmp_path, stub_build):
    """With -p for two processes the library gets one link per process, and both links use the
    same usdt_sites entries: 3 sites, not 3 per process."""
    require_tracing_here()
    torch = build_torch_stub(tmp_path, stub_build)
    with Workload([torch.workload, "blocks"]) as first, Workload([torch.workload, "blocks"]) as second:
        pids = first.wait_ready(), second.wait_ready()
        harness = TracingHarness(pids, preattach_globs=(str(stub_build.lib_dir / "*.so.*"),))
        try:
            probes = harness.source.probes
            assert probes is not None
            library = os.stat(torch.libc10_cuda)
            assert probes.torch_attached_pids(FileId(library.st_dev, library.st_ino)) == set(pids)
            assert len(list(probes._bpf[b"usdt_sites"].keys())) == 3
            for workload in (first, second):
                workload.go()
                workload.read_calls()
            assert harness.pump_until(lambda: all(len(harness.of(pid, Kind.FREE, Api.pytorch_free)) >= FREES
                                                  for pid in pids))
            harness.pump(0.3)
            assert [len(harness.of(pid, Kind.ALLOC, Api.pytorch_malloc)) for pid in pids] == [MALLOCS, MALLOCS]
        finally:
            harness.close()


def test_doctor_names_the_allocator_probes_of_a_process(torch_stub_build):
    require_tracing_here()
    from agent_process import kvtrace

    with Workload([torch_stub_build.workload, "blocks"]) as workload:
        pid = workload.wait_ready()
        doctor = kvtrace("doctor", "--pid", str(pid))
    line = next(line for line in doctor.stdout.splitlines() if f"pid {pid} torch" in line)
    assert "PyTorch allocator probes: 3 of 3 sites traceable in" in line
    assert str(torch_stub_build.libc10_cuda) in line


@pytest.mark.parametrize("task_storage", [True, False], ids=["task-storage", "lru-hashes"])
def test_blocks_made_from_python_carry_their_stack_in_the_event_and_the_kernel_entry(
        task_storage, tmp_path, stub_build, torch_stub_build):
    """GIVEN a CPython 3.12 process making 20 PyTorch blocks from one line through the stub allocator,
    WHEN traced (per-thread state in task storage, and in LRU hashes), THEN each block's event carries
    the stack the walker took for it (the probe hands the walk to walk_stack by a tail call), exactly
    the process's own, and the kernel's entry of the block holds the same stack."""
    from kvtrace.sources.bpf.loader import ProbeSettings
    from test_python_stacks import TARGET as ALLOC_TARGET
    from test_python_stacks import pyenv_python

    python = pyenv_python("3.12")
    target = ALLOC_TARGET.parent / "block_target.py"
    with Workload([python, target, torch_stub_build.libc10_cuda]) as workload:
        pid = workload.wait_ready()
        harness = TracingHarness([pid], settings=ProbeSettings(task_storage=task_storage),
                                 preattach_globs=(str(torch_stub_build.lib_dir / "*.so"),
                                                  str(stub_build.lib_dir / "*.so.*")))
        try:
            before = harness.source.counters()
            workload.go()
            blocks = workload.read_calls()
            assert len(blocks) == 20
            assert harness.pump_until(lambda: len(harness.of(pid, Kind.ALLOC, Api.pytorch_malloc)) == 20, 10)
            harness.pump(0.3)
            events, kernel = each_block_has_its_stack(harness, pid, blocks)
            assert len({e.stack_id for e in events.values()}) == 1
            (kernel_stack_id,) = set(kernel.values())
            assert harness.source._stack_ids[kernel_stack_id] == next(iter(events.values())).stack_id
            after = harness.source.counters()
            segments = len(harness.of(pid, Kind.ALLOC, Api.cudaMalloc))  # the allocator's, walked too
            assert segments == 1
            assert after["stack_walks"] - before["stack_walks"] == 20 + segments
            assert after["stack_walks_preempted"] == before["stack_walks_preempted"]
        finally:
            harness.close()


def each_block_has_its_stack(harness, pid, blocks):
    """Asserts that every block a Python target reported ({"address", "expected"}: its own stack, innermost first)
    came as one allocation event carrying that stack, and that the kernel's ledger holds exactly those blocks.
    Returns (events by address, the kernel's raw stack ids by address)."""
    from kvtrace.model.events import StackStatus
    from test_python_stacks import as_lists

    events = {e.address: e for e in harness.of(pid, Kind.ALLOC, Api.pytorch_malloc)}
    assert sorted(events) == sorted(b["address"] for b in blocks)
    for block in blocks:
        event = events[block["address"]]
        assert event.stack_status is StackStatus.OK, event
        assert as_lists(harness.session.stacks.get(event.stack_id)) == block["expected"]
    kernel = {key.address: value.stack_id for key, value in harness.source.probes.ledger_items()
              if key.pid == pid and key.layer == Layer.TORCH}  # raw: the kernel's stack ids
    assert sorted(kernel) == sorted(events)
    return events, kernel


SAMPLE_BYTES = 256 << 10  # S
SMALL_BLOCKS, SMALL_BYTES = 4000, 16 << 10  # under S: walked with probability 1 - exp(-1/16), about 6 %
LARGE_BLOCKS = {256 << 10: 5, 1 << 20: 3, 3 << 20: 2}  # at least S: always walked
SAMPLED_SPEC = ",".join([f"{SMALL_BLOCKS}x{SMALL_BYTES}"] + [f"{count}x{size}" for size, count in LARGE_BLOCKS.items()])


@pytest.mark.parametrize("task_storage", [True, False], ids=["task-storage", "lru-hashes"])
def test_sampled_block_stacks_keep_the_ledger_exact_and_estimate_the_bytes_of_a_stack(task_storage, stub_build,
                                                                                       torch_stub_build):
    """GIVEN two CPython 3.12 processes each making 4 000 blocks of 16 KiB and 10 of 256 KiB to 3 MiB (shuffled)
    from one line, traced with stack sampling at S = 256 KiB (each thread's countdown in task storage, and in an
    LRU hash), the second process in block_full_pids,
    WHEN both run,
    THEN the kernel's ledger and totals hold every block of both exactly (count and bytes); in the sampled
    process every block of at least S has its stack (the process's own), each block under S was either walked
    (OK, the entry marked sampled) or not (NOT_SAMPLED, no walk: the stack walks counted are exactly the stacks
    sent), the counters say how many of each, and the sum of the blocks' estimated bytes lies within 4 sigma of
    the true 62.5 MiB; in the full process every block has its stack and its entry is exact (S 0)."""
    from kvtrace.analysis.leaks import survey_sites
    from kvtrace.model.blocks import estimated_bytes
    from kvtrace.model.events import Memory, StackStatus
    from kvtrace.sources.bpf.decode import decode_totals
    from kvtrace.sources.bpf.loader import ProbeSettings
    from test_python_stacks import TARGET as ALLOC_TARGET
    from test_python_stacks import as_lists, pyenv_python

    python = pyenv_python("3.12")
    target = ALLOC_TARGET.parent / "block_target.py"
    count = SMALL_BLOCKS + sum(LARGE_BLOCKS.values())
    true_bytes = SMALL_BLOCKS * SMALL_BYTES + sum(size * n for size, n in LARGE_BLOCKS.items())
    with Workload([python, target, torch_stub_build.libc10_cuda, SAMPLED_SPEC]) as sampled_run, \
            Workload([python, target, torch_stub_build.libc10_cuda, SAMPLED_SPEC]) as full_run:
        sampled, full = sampled_run.wait_ready(), full_run.wait_ready()
        harness = TracingHarness([sampled, full], block_sample_bytes=SAMPLE_BYTES,
                                 settings=ProbeSettings(task_storage=task_storage),
                                 preattach_globs=(str(torch_stub_build.lib_dir / "*.so"),
                                                  str(stub_build.lib_dir / "*.so.*")))
        try:
            probes = harness.source.probes
            probes.set_block_full(full, True)
            before = harness.source.counters()
            sampled_run.go()
            full_run.go()
            made = {sampled: sampled_run.read_calls(), full: full_run.read_calls()}
            assert all(len(blocks) == count for blocks in made.values())
            assert harness.pump_until(lambda: all(len(harness.of(pid, Kind.ALLOC, Api.pytorch_malloc)) == count
                                                  for pid in made), 20)
            harness.pump(0.3)
            after = harness.source.counters()
            totals = decode_totals(probes.read_totals(), set(made))
            kernel = [e for e in harness.source.kernel_ledger() if e.key.object is ObjectKind.BLOCK]
            kernel_stacks = {(key.pid, key.address): value.stack_id for key, value in probes.ledger_items()
                             if key.layer == Layer.TORCH}  # raw: the kernel's stack ids
            for pid, blocks in made.items():
                # Exact whatever is sampled: every block in the kernel's ledger, and in its totals.
                entries = {e.key.address: e for e in kernel if e.key.pid == pid}
                assert sorted((a, e.size_bytes) for a, e in entries.items()) == \
                    sorted((b["address"], b["size_bytes"]) for b in blocks)
                assert totals[TotalsKey(pid, 0, Layer.TORCH, Memory.DEVICE)] == (true_bytes, count)
                events = {e.address: e for e in harness.of(pid, Kind.ALLOC, Api.pytorch_malloc)}
                assert sorted(events) == sorted(entries)
                for block in blocks:
                    event, entry = events[block["address"]], entries[block["address"]]
                    subject = pid == sampled and block["size_bytes"] < SAMPLE_BYTES
                    assert entry.sample_bytes == (SAMPLE_BYTES if subject else 0), entry
                    assert event.sample_bytes == entry.sample_bytes, event  # struct kvt_event.sampling
                    kernel_stack = kernel_stacks[(pid, block["address"])]
                    if event.stack_status is StackStatus.NOT_SAMPLED:
                        assert subject and not entry.sampled and kernel_stack == 0 and event.stack_id == 0
                    else:
                        assert event.stack_status is StackStatus.OK, event
                        assert entry.sampled == subject and kernel_stack != 0
                        assert as_lists(harness.session.stacks.get(event.stack_id)) == block["expected"]
            # A ledger built from the events (a replay, --no-ledger-in-kernel) weighs every block as the kernel's.
            built = Ledger()
            built.apply_many([e for pid in made for e in harness.of(pid, Kind.ALLOC, Api.pytorch_malloc)])
            assert sorted((e.key, e.size_bytes, e.sample_bytes, e.sampled) for e in built) == \
                sorted((e.key, e.size_bytes, e.sample_bytes, e.sampled) for e in kernel if e.key.pid in made)
            # The sampled process: how many of its small blocks were walked, told by the counters too.
            statuses = Counter((e.size_bytes < SAMPLE_BYTES, e.stack_status)
                               for e in harness.of(sampled, Kind.ALLOC, Api.pytorch_malloc))
            walked, passed = statuses[(True, StackStatus.OK)], statuses[(True, StackStatus.NOT_SAMPLED)]
            assert walked + passed == SMALL_BLOCKS and statuses[(False, StackStatus.OK)] == sum(LARGE_BLOCKS.values())
            assert (after["blocks_sampled"] - before["blocks_sampled"],
                    after["blocks_not_sampled"] - before["blocks_not_sampled"]) == (walked, passed)
            # Independent choices of p = 1 - exp(-s/S) (the countdown's exponential draws): 242 +- 15 walked.
            p = -math.expm1(-SMALL_BYTES / SAMPLE_BYTES)
            assert abs(walked - SMALL_BLOCKS * p) <= 4 * math.sqrt(SMALL_BLOCKS * p * (1 - p)), walked
            # No walk for a block passed over: walks are the stacks sent, of blocks and of the allocator's segments.
            stacks_sent = sum(1 for pid in made for e in harness.of(pid, Kind.ALLOC)
                              if e.stack_status is StackStatus.OK and e.api in (Api.pytorch_malloc, Api.cudaMalloc))
            assert after["stack_walks"] - before["stack_walks"] == stacks_sent
            assert after["stack_walks_preempted"] == before["stack_walks_preempted"]
            # The estimate: sum s / (1 - exp(-s/S)) over the walked small blocks, unbiased with variance
            # n s^2 (1 - p) / p (sigma 6.2 % of 62.5 MiB); the large blocks count exactly.
            small = [e for e in kernel if e.key.pid == sampled and e.size_bytes < SAMPLE_BYTES]
            estimate = sum(estimated_bytes(e) for e in small)
            sigma = math.sqrt(SMALL_BLOCKS * SMALL_BYTES ** 2 * (1 - p) / p)
            assert abs(estimate - SMALL_BLOCKS * SMALL_BYTES) <= 4 * sigma, (estimate, sigma)
            assert sum(estimated_bytes(e) for e in kernel if e.key.pid == sampled) == \
                pytest.approx(estimate + sum(size * n for size, n in LARGE_BLOCKS.items()))
            assert sum(estimated_bytes(e) for e in kernel if e.key.pid == full) == true_bytes
            # The leak survey: one site (the allocating line), no stackless one of the blocks passed over.
            survey = survey_sites(harness.session.ledger, 0, 0, pids=[sampled])
            assert survey.allocations_considered == count
            assert [site.stack_id != 0 for site in survey.site_bytes] == [True]
            assert sum(survey.site_bytes.values()) == pytest.approx(
                estimate + sum(size * n for size, n in LARGE_BLOCKS.items()))
        finally:
            harness.close()
