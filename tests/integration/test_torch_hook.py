"""kvtrace's PyTorch hook (agent/kvtrace/sources/torch_hook/hook.cpp) over a fake caching allocator, with the
kernel's side as a test program on the hook's USDT site, kvtrace:blocks, its semaphore the link's reference counter
(and, further down, the agent's own program, probes/hook.h). The test program reads the site's arguments where the
note says they are (%rdi, %rsi: the site is the first instruction of kvtrace_hook_flush).

The hook is built by its own builder against a fake torch (stubs/fake_torch: torch 2.11's TraceEntry and
attachAllocatorTraceTracker, a libc10_cuda.so that calls the trackers), loaded by a driver process that fires
block events on command. A test BPF program reads each batch the hook hands over and counts what it sees; every
count is exact (or, for sampled walks, within 4 sigma of its expectation). The real torch is the GPU machine's:
bench/block_hook_cost.py.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cuda_stubs import STUBS_DIR
from harness import TracingHarness
from kvtrace.model.depth import BlocksMode, Depth
from kvtrace.model.events import Api, Kind, Layer
from kvtrace.sources import procfs
from kvtrace.sources.bpf.discovery import FileId
from kvtrace.sources.bpf.hook_settings import probe_site
from kvtrace.sources.torch_hook import (
    BATCH_MAX,
    HookBuildError,
    TorchBuild,
    build,
    library_name,
)

FAKE = STUBS_DIR / "fake_torch"

# What the kernel sees of each batch: entries by kind, walks, walks not last in their batch, frees of a block it
# never saw allocated (order), bytes allocated, and the live blocks it holds.
COUNTING_PROGRAM = r"""
#include <uapi/linux/ptrace.h>
#define BATCH_MAX %(batch_max)d
struct entry { u64 address; u64 size_bytes; u64 stream; u8 kind; s8 device; u8 walk; u8 reserved[5]; };
struct batch { struct entry entries[BATCH_MAX]; };
struct seen { u64 value[8]; };
BPF_PERCPU_ARRAY(scratch, struct batch, 1);
BPF_PERCPU_ARRAY(seen, struct seen, 1);
BPF_HASH(live, u64, u64, 65536);

int hook_flush(struct pt_regs *ctx) {
    u32 zero = 0;
    struct batch *batch = scratch.lookup(&zero);
    struct seen *seen_now = seen.lookup(&zero);
    if (!batch || !seen_now)
        return 0;
    u32 count = (u32)PT_REGS_PARM2(ctx);
    if (count > BATCH_MAX)
        count = BATCH_MAX;
    /* The hook's buffer holds BATCH_MAX entries: one copy of all of it (a constant size for the verifier). */
    if (count == 0 || bpf_probe_read_user(batch, sizeof(*batch), (void *)PT_REGS_PARM1(ctx)))
        return 0;
    seen_now->value[0] += 1;
#pragma clang loop unroll(full)
    for (u32 i = 0; i < BATCH_MAX; i++) { /* unrolled: straight code the verifier walks once */
        if (i >= count)
            continue;
        struct entry *entry = &batch->entries[i];
        u64 address = entry->address;
        u64 size = entry->size_bytes;
        u8 allocation = entry->kind == 1;
        if (allocation) {
            live.update(&address, &size);
        } else {
            seen_now->value[4] += live.delete(&address) != 0;
        }
        seen_now->value[1] += allocation;
        seen_now->value[2] += !allocation;
        seen_now->value[3] += entry->walk != 0;
        seen_now->value[5] += allocation ? size : 0;
        seen_now->value[6] += entry->walk != 0 && i + 1 != count;
        seen_now->value[7] += entry->device != 1 || entry->stream != 7;
    }
    return 0;
}
"""
SEEN = ("flushes", "allocations", "frees", "walks", "unknown_frees", "bytes", "walks_not_last", "wrong_fields")


@pytest.fixture(scope="module")
def fake_torch(tmp_path_factory) -> TorchBuild:
    """A torch directory the builder takes: include/c10/cuda/CUDACachingAllocator.h, lib/libc10_cuda.so and
    lib/libc10.so, and beside it nvidia/stub/include/cuda_runtime_api.h (as the NVIDIA wheels lay it out)."""
    if shutil.which("g++") is None:
        pytest.skip("no g++ here: the hook is C++ (apt-get install g++)")
    root = tmp_path_factory.mktemp("fake-site")
    torch = root / "torch"
    (torch / "include" / "c10" / "cuda").mkdir(parents=True)
    (torch / "lib").mkdir()
    (root / "nvidia" / "stub" / "include").mkdir(parents=True)
    (root / "nvidia" / "stub" / "include" / "cuda_runtime_api.h").write_text("/* the hook needs none of it */\n")
    shutil.copy(FAKE / "CUDACachingAllocator.h", torch / "include" / "c10" / "cuda")
    subprocess.run(["g++", "-O2", "-std=c++17", "-shared", "-fPIC", f"-I{torch / 'include'}",
                    FAKE / "fake_c10_cuda.cpp", "-o", torch / "lib" / "libc10_cuda.so"], check=True)
    subprocess.run(["g++", "-shared", "-fPIC", "-x", "c++", "/dev/null", "-o", torch / "lib" / "libc10.so"],
                   check=True)
    return TorchBuild("2.11.0+fake", torch, cxx11_abi=True)


@pytest.fixture(scope="module")
def hook_build(fake_torch, tmp_path_factory) -> tuple[Path, Path]:
    """(the hook library as the builder made it, the driver that loads it)."""
    library = build(fake_torch, tmp_path_factory.mktemp("hook-cache"))
    driver = library.parent / "hook_driver"
    subprocess.run(["g++", "-O2", "-std=c++17", f"-I{fake_torch.directory / 'include'}", FAKE / "hook_driver.cpp",
                    "-o", driver, f"-L{fake_torch.directory / 'lib'}", f"-Wl,-rpath,{fake_torch.directory / 'lib'}",
                    "-lc10_cuda", "-ldl", "-pthread"], check=True)
    return library, driver


class Driver:
    def __init__(self, driver: Path, library: Path) -> None:
        self.process = subprocess.Popen([str(driver), str(library)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True)
        self.pid = json.loads(self.process.stdout.readline())["pid"]

    def send(self, line: str) -> dict:
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())

    def close(self) -> None:
        self.process.kill()
        self.process.wait()


@pytest.fixture
def driver(hook_build):
    library, binary = hook_build
    running = Driver(binary, library)
    yield running
    running.close()


@contextlib.contextmanager
def flush_probe(library: Path, pid: int):
    """COUNTING_PROGRAM on the hook's kvtrace:blocks site in `pid`, its semaphore as the link's reference counter."""
    assert probe_site(library).arguments_text.startswith("8@%rdi 4@%esi"), "the program reads rdi and rsi"
    from bcc import BPF

    from kvtrace.sources.bpf import links

    site = probe_site(library)
    bpf = BPF(text=(COUNTING_PROGRAM % {"batch_max": BATCH_MAX}).encode())
    with contextlib.ExitStack() as made:
        made.callback(bpf.cleanup)
        program = links.load_uprobe_multi(bpf, "hook_flush")
        made.callback(links.attach_uprobe_multi(program, library, [site.pc_file_offset],
                                                ref_ctr_offsets=[site.semaphore_file_offset], pid=pid).close)
        yield bpf


def seen(bpf) -> dict[str, int]:
    table = bpf[b"seen"]
    per_cpu = table[table.Key(0)]  # one struct seen a CPU
    return {name: sum(int(cpu.value[index]) for cpu in per_cpu) for index, name in enumerate(SEEN)}


def test_the_builder_names_the_library_by_torch_and_source(fake_torch):
    other = TorchBuild("2.12.0+fake", fake_torch.directory, cxx11_abi=True)
    assert library_name(fake_torch) != library_name(other)
    assert library_name(fake_torch) == library_name(TorchBuild("2.11.0+fake", Path("/elsewhere"), True))


def test_the_builder_says_what_is_missing(fake_torch, tmp_path, monkeypatch):
    with pytest.raises(HookBuildError, match="install g\\+\\+"):
        build(fake_torch, tmp_path, compiler="no-such-compiler-kvtrace")
    bare = tmp_path / "site" / "torch"
    bare.mkdir(parents=True)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr("kvtrace.sources.torch_hook.SYSTEM_CUDA_INCLUDE", tmp_path / "no-cuda")
    with pytest.raises(HookBuildError, match="CUDA_HOME"):
        build(TorchBuild("x", bare, True), tmp_path)


def test_a_failed_build_shows_the_compiler(fake_torch, tmp_path):
    broken = TorchBuild("2.11.0+broken", tmp_path / "site" / "torch", True)
    (broken.directory / "include").mkdir(parents=True)  # no CUDACachingAllocator.h in it
    shutil.copytree(fake_torch.directory.parent / "nvidia", broken.directory.parent / "nvidia")
    with pytest.raises(HookBuildError, match="CUDACachingAllocator.h"):
        build(broken, tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("*.so")), "a failed build leaves no library behind"


@pytest.mark.usefixtures("bpf_here")
def test_an_armed_hook_attaches_when_first_raised_and_the_allocator_is_ready(driver, hook_build):
    """GIVEN an armed hook (kvtrace_hook_arm), WHEN nothing raises the process, THEN the tracker stays out (the
    allocator pays nothing); WHEN the semaphore goes up before the allocator is initialised, it still waits (a
    tracker attached then would be lost); once both hold, it attaches within 0.1 s and blocks flow."""
    library, _ = hook_build
    driver.send("initialized 0")
    assert driver.send("arm") == {"armed": 0}
    time.sleep(0.3)
    assert driver.send("attached") == {"attached": 0}
    with flush_probe(library, driver.pid) as bpf:
        time.sleep(0.3)
        assert driver.send("attached") == {"attached": 0}, "attached before the allocator was initialised"
        driver.send("initialized 1")
        deadline = time.monotonic() + 2
        while driver.send("attached") != {"attached": 1} and time.monotonic() < deadline:
            time.sleep(0.05)
        assert driver.send("attached") == {"attached": 1}
        driver.send(f"settings {1 << 30} {BATCH_MAX}")
        driver.send(f"blocks {BATCH_MAX} 4096 1")
        kernel = seen(bpf)
    assert kernel["allocations"] == BATCH_MAX and kernel["frees"] == BATCH_MAX


def test_without_the_probe_the_hook_hands_nothing_over(driver):
    assert driver.send("attach") == {"attached": 0}
    driver.send("blocks 100 4096")
    counts = driver.send("counts")
    assert driver.send("semaphore") == {"semaphore": 0}
    assert counts["events"] == 0 and counts["flushes"] == 0 and counts["entries"] == 0


@pytest.mark.usefixtures("bpf_here")
def test_every_block_reaches_the_kernel_in_order_in_batches(driver, hook_build):
    library, _ = hook_build
    driver.send("attach")
    with flush_probe(library, driver.pid) as bpf:
        assert driver.send("semaphore") == {"semaphore": 1}, "the kernel raises the semaphore while the probe is in"
        driver.send(f"settings {1 << 30} {BATCH_MAX}")  # a sample size no block reaches: full batches, no walk
        driver.send("blocks 23 4096 1")
        driver.send("blocks 1000 16384 1")
        counts = driver.send("counts")
        time.sleep(0.5)  # the hook's flusher hands over the partly full last batch within 100 ms
        kernel = seen(bpf)
        live = len(bpf[b"live"])
    assert counts["events"] == 2 * 1023
    assert kernel["allocations"] == 1023 and kernel["frees"] == 1023, kernel
    assert kernel["bytes"] == 23 * 4096 + 1000 * 16384
    assert kernel["unknown_frees"] == 0, "a free reached the kernel before its allocation"
    assert kernel["wrong_fields"] == 0, "device or stream read wrong"
    assert kernel["walks"] == 0
    # Full batches; the flusher may have handed over the first command's 46 events apart from the second's.
    assert math.ceil(2 * 1023 / BATCH_MAX) <= kernel["flushes"] <= math.ceil(2 * 1023 / BATCH_MAX) + 1, kernel
    assert live == 0, "every block freed: none left in the kernel's table"


@pytest.mark.usefixtures("bpf_here")
def test_a_walked_block_is_flushed_at_once_last_in_its_batch(driver, hook_build):
    library, _ = hook_build
    driver.send("attach")
    with flush_probe(library, driver.pid) as bpf:
        driver.send(f"settings 0 {BATCH_MAX}")  # sample size 0: every block's stack walked
        driver.send("blocks 23 4096 1")
        driver.send(f"settings 524288 {BATCH_MAX}")  # 512 KiB: a 16 KiB block walked with p = 1 - exp(-1/32)
        driver.send("blocks 4000 16384 1")
        driver.send("blocks 10 1048576 1")  # at least the sample size: always walked
        counts = driver.send("counts")
        time.sleep(0.5)
        kernel = seen(bpf)
    assert kernel["walks_not_last"] == 0, "a walked block must be the last of its batch (its stack is now)"
    assert kernel["walks"] == counts["walks"]
    sampled = kernel["walks"] - 23 - 10
    p = 1 - math.exp(-16384 / 524288)
    mean, sigma = 4000 * p, math.sqrt(4000 * p * (1 - p))
    assert abs(sampled - mean) < 4 * sigma, (sampled, mean, sigma)
    assert kernel["allocations"] == kernel["frees"] == 23 + 4000 + 10
    assert kernel["unknown_frees"] == 0


@pytest.mark.usefixtures("bpf_here")
def test_lowering_stops_the_hook_and_drops_what_waited(driver, hook_build):
    library, _ = hook_build
    driver.send("attach")
    with flush_probe(library, driver.pid) as bpf:
        driver.send(f"settings {1 << 30} {BATCH_MAX} 5000")  # the flusher waits 5 s: nothing goes before the unlink
        driver.send(f"blocks {BATCH_MAX} 4096 1")  # two full batches, handed over at once
        driver.send("blocks 5 4096 1")  # 10 events that wait for a full batch or the flusher
        during = seen(bpf)
    assert during["allocations"] == BATCH_MAX and during["frees"] == BATCH_MAX
    assert driver.send("semaphore") == {"semaphore": 0}, "the kernel lowers the semaphore with the probe"
    driver.send("blocks 1 4096 1")  # the first event after the lowering drops what waited for the link that went
    counts = driver.send("counts")
    assert counts["dropped"] == 10 and counts["entries"] == 2 * BATCH_MAX, counts
    before = counts
    driver.send("blocks 50 4096 1")
    after = driver.send("counts")
    assert after["events"] == before["events"], "at depth segments the hook returns at once"
    assert after["flushes"] == before["flushes"]


@pytest.mark.usefixtures("bpf_here")
def test_a_hook_the_allocator_refuses_leaves_pytorchs_own_sites_to_the_agent(driver, hook_build):
    """GIVEN an armed hook whose allocator refuses trackers (cudaMallocAsync's does), WHEN the agent raises the
    process, THEN the hook says REFUSED in its state byte and the agent no longer counts the process as hooked
    (PyTorch's own sites, where it has them, would be linked at the next analysis)."""
    from kvtrace.sources.bpf.hook_settings import HookState, read_state

    library, _ = hook_build
    driver.send("refuse 1")
    driver.send("arm")
    harness = TracingHarness([driver.pid], blocks=BlocksMode.AUTO)
    try:
        stat = os.stat(library)
        file_id = next((m.device, m.inode) for m in procfs.read_maps(driver.pid) if m.inode == stat.st_ino)
        assert read_state(driver.pid, str(library), file_id) is HookState.ARMED
        targets = harness.source.targets
        assert targets._hooked(driver.pid)
        harness.source.set_block_depths({driver.pid: Depth.BLOCKS})
        assert driver.send("semaphore") == {"semaphore": 1}
        deadline = time.monotonic() + 2
        while read_state(driver.pid, str(library), file_id) is not HookState.REFUSED and time.monotonic() < deadline:
            time.sleep(0.05)
        assert read_state(driver.pid, str(library), file_id) is HookState.REFUSED
        assert driver.send("attached") == {"attached": 0}
        assert not targets._hooked(driver.pid)
    finally:
        harness.close()

def hook_totals(harness, pid):
    """(bytes, count) of `pid`'s PyTorch blocks in the agent's totals."""
    totals = harness.session.ledger_counts().totals
    held = [value for key, value in totals.items() if key.pid == pid and key.layer is Layer.TORCH]
    return sum(size for size, _ in held), sum(count for _, count in held)


@pytest.mark.usefixtures("bpf_here")
def test_the_agent_traces_a_hooked_process_through_its_batches(driver, hook_build):
    """GIVEN a process with kvtrace's hook over its allocator, followed by an agent at --blocks auto, WHEN the agent
    raises it to BLOCKS, THEN it links the hook's site for that process alone (the semaphore goes up), writes its
    sample size into the hook, and every block the allocator reports reaches the agent exactly: 23 + 1000 blocks
    allocated and freed, 5 kept; WHEN it is lowered, the site is unlinked and its blocks leave the totals."""
    library, _ = hook_build
    driver.send("attach")
    harness = TracingHarness([driver.pid], blocks=BlocksMode.AUTO, block_sample_bytes=256 * 1024)
    try:
        probes = harness.source.probes
        assert probes is not None
        file_id = FileId(os.stat(library).st_dev, os.stat(library).st_ino)
        assert driver.send("semaphore") == {"semaphore": 0}
        harness.source.set_block_depths({driver.pid: Depth.BLOCKS})
        assert probes.torch_attached_pids(file_id) == {driver.pid}
        assert driver.send("semaphore") == {"semaphore": 1}
        assert driver.send("sample_bytes") == {"sample_bytes": 256 * 1024}, "the agent writes its S into the hook"
        driver.send("blocks 23 4096 1")
        driver.send("blocks 1000 16384 1")
        driver.send("keep 5 8192 1")
        assert harness.pump_until(lambda: len(harness.of(driver.pid, Kind.ALLOC, Api.pytorch_malloc)) >= 1028)
        harness.pump(0.3)
        assert len(harness.of(driver.pid, Kind.ALLOC, Api.pytorch_malloc)) == 1028
        assert len(harness.of(driver.pid, Kind.FREE, Api.pytorch_free)) == 1023
        assert hook_totals(harness, driver.pid) == (5 * 8192, 5)
        counters = harness.source.counters()
        assert counters["hook_entries_lost"] == 0 and counters["unknown_frees"] == 0, counters
        assert counters["usdt_unreadable"] == 0

        harness.source.set_block_depths({driver.pid: Depth.SEGMENTS})
        assert probes.torch_attached_pids(file_id) == set()
        assert driver.send("semaphore") == {"semaphore": 0}
        assert hook_totals(harness, driver.pid) == (0, 0)
    finally:
        harness.close()


@pytest.mark.usefixtures("bpf_here")
def test_at_full_every_block_carries_the_stack_that_allocates_it(fake_torch, hook_build):
    """GIVEN a CPython 3.12 process whose allocator reports 20 blocks through kvtrace's hook from one line, WHEN the
    agent raises it to FULL, THEN the agent sets the hook's S to 0 (every block walked), each block reaches the
    kernel last in its batch and carries the process's own stack, and the kernel's entry holds the same stack."""
    from cuda_stubs import Workload
    from test_python_stacks import pyenv_python
    from test_torch_blocks import each_block_has_its_stack

    python = pyenv_python("3.12")
    library, _ = hook_build
    target = Path(__file__).parent / "pytargets" / "hook_target.py"
    with Workload([python, target, fake_torch.directory / "lib" / "libc10_cuda.so", library]) as workload:
        pid = workload.wait_ready()
        harness = TracingHarness([pid], blocks=BlocksMode.AUTO, block_sample_bytes=256 * 1024)
        try:
            harness.source.set_block_depths({pid: Depth.FULL})
            before = harness.source.counters()
            workload.go()
            blocks = workload.read_calls()
            assert len(blocks) == 20
            assert harness.pump_until(lambda: len(harness.of(pid, Kind.ALLOC, Api.pytorch_malloc)) == 20, 10)
            harness.pump(0.3)
            _, kernel = each_block_has_its_stack(harness, pid, blocks)
            assert all(kernel.values())
            after = harness.source.counters()
            assert after["stack_walks"] - before["stack_walks"] == 20
            assert after["hook_entries_lost"] == before["hook_entries_lost"]
        finally:
            harness.close()


@pytest.mark.usefixtures("bpf_here")
def test_a_hooked_process_is_not_traced_twice(fake_torch, hook_build, stub_build, tmp_path):
    """GIVEN a process that maps kvtrace's hook and also a library with PyTorch's own pytorch:malloc/free sites
    (a fresh copy: another test's agent may hold a link for every process on the shared one), WHEN the agent raises
    it (--blocks auto), THEN it links the hook's site alone: PyTorch's own semaphore stays 0, and the process's blocks
    arrive once each, through the hook."""
    from cuda_stubs import Workload
    from torch_stubs import build_torch_stub

    torch_stub_build = build_torch_stub(tmp_path, stub_build)

    library, _ = hook_build
    target = Path(__file__).parent / "pytargets" / "hook_target.py"
    stub = os.stat(torch_stub_build.libc10_cuda)
    hook = os.stat(library)
    with Workload([sys.executable, target, fake_torch.directory / "lib" / "libc10_cuda.so", library,
                   torch_stub_build.libc10_cuda]) as workload:
        pid = workload.wait_ready()
        harness = TracingHarness([pid], blocks=BlocksMode.AUTO)
        try:
            stub_id = FileId(stub.st_dev, stub.st_ino)
            attached = harness.source.targets.attached
            assert stub_id in attached and attached[stub_id].torch_probes and pid in attached[stub_id].pids, \
                "the agent sees PyTorch's own sites in the process (else this test proves nothing)"
            harness.source.set_block_depths({pid: Depth.BLOCKS})
            probes = harness.source.probes
            assert probes.torch_attached_pids(FileId(hook.st_dev, hook.st_ino)) == {pid}
            workload.go()
            lines = workload.read_calls()
            assert lines[-1] == {"stub_semaphore": 0}, "PyTorch's own sites must not be linked for a hooked process"
            assert probes.torch_attached_pids(stub_id) == set()
            assert harness.pump_until(lambda: len(harness.of(pid, Kind.ALLOC, Api.pytorch_malloc)) >= 20, 10)
            harness.pump(0.3)
            assert len(harness.of(pid, Kind.ALLOC, Api.pytorch_malloc)) == 20
        finally:
            harness.close()
