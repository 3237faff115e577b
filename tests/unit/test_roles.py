"""Roles of traced bytes: the rules on stacks as vLLM 0.24 makes them, KV tensors' addresses over any
stack, sleep-mode memory mapped back at wake-up, and role bytes that add up to exactly what the
analyzer counts as a process's outstanding bytes."""
import time
from collections import defaultdict

import pytest

from fake_agent import event
from kvtrace.analysis.analyzer import Analyzer
from kvtrace.analysis.roles import RoleMemo, kv_ranges_of, role_bytes, role_of_stack
from kvtrace.model.events import PHYSICAL_LAYERS, Api, Kind, Layer, Memory, ObjectKind
from kvtrace.model.ledger import ledger_view
from kvtrace.model.stacks import Frame, Stack
from kvtrace.model.vllm import KvCacheLayout, KvTensor, Role, SleepPool, SleepReport
from kvtrace.session import Session

MiB = 1 << 20
NS = 1_000_000_000
T0_NS = 1_700_000_000 * NS
V = "/usr/lib/python3/site-packages/vllm/"


def stack(*frames: tuple[str, str]) -> Stack:
    """Innermost first: (qualified function, file under vllm/ or an absolute path)."""
    return Stack(tuple(Frame(function, file if file.startswith("/") else V + file, 10) for function, file in frames))


KV_V2 = stack(("_allocate_kv_cache", "v1/worker/gpu/attn_utils.py"), ("init_kv_cache", "v1/worker/gpu/attn_utils.py"),
              ("GPUModelRunner.initialize_kv_cache", "v1/worker/gpu/model_runner.py"),
              ("Worker.initialize_from_config", "v1/worker/gpu_worker.py"),
              ("WorkerWrapperBase.initialize_from_config", "v1/worker/worker_base.py"),
              ("EngineCore._initialize_kv_caches", "v1/engine/core.py"), ("EngineCore.__init__", "v1/engine/core.py"))
KV_V1 = stack(("GPUModelRunner._allocate_kv_cache_tensors", "v1/worker/gpu_model_runner.py"),
              ("GPUModelRunner.initialize_kv_cache_tensors", "v1/worker/gpu_model_runner.py"),
              ("GPUModelRunner.initialize_kv_cache", "v1/worker/gpu_model_runner.py"))
# Capture runs the model's forward under a dummy run: capture_model must win over both.
GRAPH_CAPTURE_V1 = stack(("LlamaAttention.forward", "model_executor/models/llama.py"),
                         ("CUDAGraphWrapper.__call__", "compilation/cuda_graph.py"),
                         ("GPUModelRunner._dummy_run", "v1/worker/gpu_model_runner.py"),
                         ("GPUModelRunner._capture_cudagraphs", "v1/worker/gpu_model_runner.py"),
                         ("GPUModelRunner.capture_model", "v1/worker/gpu_model_runner.py"),
                         ("Worker.compile_or_warm_up_model", "v1/worker/gpu_worker.py"))
GRAPH_CAPTURE_V2 = stack(("LlamaModel.forward", "model_executor/models/llama.py"),
                         ("ModelCudaGraphManager.capture.<locals>.forward_fn", "v1/worker/gpu/cudagraph_utils.py"),
                         ("CudaGraphManager.capture", "v1/worker/gpu/cudagraph_utils.py"))
# At run time every piecewise forward passes through the graph wrapper and run_pw_graph: activations.
PIECEWISE_FORWARD = stack(("SiluAndMul.forward", "model_executor/layers/activation.py"),
                          ("CUDAGraphWrapper.__call__", "compilation/cuda_graph.py"),
                          ("CudaGraphManager.run_pw_graph", "v1/worker/gpu/cudagraph_utils.py"),
                          ("GPUModelRunner.execute_model", "v1/worker/gpu/model_runner.py"))
# Weights with sleep mode: allocated inside CuMemAllocator.use_memory_pool(tag="weights").
WEIGHTS_IN_POOL = stack(("UnquantizedLinearMethod.create_weights", "model_executor/layers/linear.py"),
                        ("QKVParallelLinear.__init__", "model_executor/layers/linear.py"),
                        ("initialize_model", "model_executor/model_loader/utils.py"),
                        ("DefaultModelLoader.load_model", "model_executor/model_loader/base_loader.py"),
                        ("GPUModelRunner.load_model", "v1/worker/gpu/model_runner.py"),
                        ("Worker.load_model", "v1/worker/gpu_worker.py"))
PROFILE = stack(("Sampler.forward", "v1/sample/sampler.py"), ("GPUModelRunner._dummy_sampler_run",
                "v1/worker/gpu/model_runner.py"), ("GPUModelRunner.profile_run", "v1/worker/gpu/model_runner.py"),
                ("Worker.determine_available_memory", "v1/worker/gpu_worker.py"),
                ("EngineCore._initialize_kv_caches", "v1/engine/core.py"))  # profiling: not the KV cache
WAKE_UP = stack(("create_and_map", "device_allocator/cumem.py"),
                ("CuMemAllocator.wake_up", "device_allocator/cumem.py"), ("Worker.wake_up", "v1/worker/gpu_worker.py"))
APP = stack(("Recorder.capture", "/app/serve.py"), ("<module>", "/app/serve.py"))


@pytest.mark.parametrize("name, frames, role", [
    ("kv cache, V2 runner", KV_V2, Role.KV_CACHE),
    ("kv cache, V1 runner", KV_V1, Role.KV_CACHE),
    ("graph capture, V1 runner", GRAPH_CAPTURE_V1, Role.CUDA_GRAPH),
    ("graph capture, V2 runner", GRAPH_CAPTURE_V2, Role.CUDA_GRAPH),
    ("torch.cuda.graph", stack(("graph.capture_begin", "/usr/lib/python3/site-packages/torch/cuda/graphs.py")),
     Role.CUDA_GRAPH),
    ("piecewise forward at run time", PIECEWISE_FORWARD, Role.ACTIVATIONS),
    ("weights in use_memory_pool", WEIGHTS_IN_POOL, Role.WEIGHTS),
    ("profile run", PROFILE, Role.ACTIVATIONS),
    ("sampling", stack(("GPUModelRunner.sample_tokens", "v1/worker/gpu/model_runner.py")), Role.ACTIVATIONS),
    ("no rule: a word in another file", APP, Role.OTHER),
    ("no frames", Stack(()), Role.UNKNOWN),
    ("no stack", None, Role.UNKNOWN),
])
def test_role_rules_on_vllm_stacks(name, frames, role):
    assert role_of_stack(frames) is role, name


def test_precedence_kv_cache_over_everything():
    mixed = Stack(KV_V2.frames + GRAPH_CAPTURE_V1.frames + WEIGHTS_IN_POOL.frames)
    assert role_of_stack(mixed) is Role.KV_CACHE
    assert role_of_stack(Stack(PROFILE.frames + WEIGHTS_IN_POOL.frames)) is Role.WEIGHTS


class Ledger:
    """A Session whose ledger is written directly, with addresses handed out in order."""

    def __init__(self) -> None:
        self.session = Session()
        self.ledger = self.session.ledger
        self.next_address = 0x7F0000000000

    def stack_id(self, frames: Stack) -> int:
        return self.session.stacks.intern(frames)

    def driver(self, size: int, frames: Stack | None = None, pid: int = 100, device: int = 0,
               runtime_frames: Stack | None = None, address: int | None = None, memory=Memory.DEVICE) -> int:
        """cuMemAlloc_v2 with its stack, or without one under a cudaMalloc that has `runtime_frames`."""
        if address is None:
            address, self.next_address = self.next_address, self.next_address + (1 << 32)
        self.ledger.apply(event(pid=pid, address=address, size=size, device=device, memory=memory,
                                stack_id=self.stack_id(frames) if frames else 0))
        if runtime_frames is not None:
            self.ledger.apply(event(pid=pid, api=Api.cudaMalloc, layer=Layer.RUNTIME, address=address, size=size,
                                    device=device, stack_id=self.stack_id(runtime_frames)))
        return address

    def vmm(self, kind, api, address, size, obj=ObjectKind.VMM_HANDLE, handle=0, frames=None, pid=100, device=0):
        memory = Memory.DEVICE if obj is ObjectKind.VMM_HANDLE else Memory.NONE
        self.ledger.apply(event(kind=kind, api=api, pid=pid, address=address, size=size, layer=Layer.VMM, obj=obj,
                                memory=memory, handle=handle, device=device,
                                stack_id=self.stack_id(frames) if frames else 0))

    def pool(self, handle: int, address: int, size: int, frames: Stack, pid: int = 100) -> None:
        """CuMemAllocator's malloc: cuMemCreate, then cuMemMap into its reserved range."""
        self.vmm(Kind.ALLOC, Api.cuMemCreate, handle, size, frames=frames, pid=pid)
        self.vmm(Kind.MAP, Api.cuMemMap, address, size, obj=ObjectKind.VMM_MAPPING, handle=handle, pid=pid)

    def unmap_and_release(self, handle: int, address: int, size: int, pid: int = 100) -> None:
        self.vmm(Kind.UNMAP, Api.cuMemUnmap, address, size, obj=ObjectKind.VMM_MAPPING, pid=pid)
        self.vmm(Kind.FREE, Api.cuMemRelease, handle, size, pid=pid)

    def outstanding(self) -> dict[tuple[int, int], int]:
        """What the analyzer counts per (pid, device): physical layers, device memory."""
        traced: dict[tuple[int, int], int] = defaultdict(int)
        for key, (size_bytes, _) in self.ledger.totals().items():
            if key.layer in PHYSICAL_LAYERS and key.memory is Memory.DEVICE:
                traced[(key.pid, key.device)] += size_bytes
        return dict(traced)

    def roles(self, kv_ranges=None, memo=None):
        return role_bytes(self.ledger.entries(), self.session.stack, kv_ranges or {}, memo)


def test_role_bytes_add_up_to_outstanding_bytes_exactly():
    book = Ledger()
    book.driver(3 * MiB, KV_V2)
    book.driver(5 * MiB, WEIGHTS_IN_POOL, device=1)
    book.driver(7 * MiB, runtime_frames=PROFILE)  # the cudaMalloc above has the stack
    book.driver(11 * MiB)  # no stack anywhere
    book.driver(13 * MiB, APP, pid=300)
    book.driver(17 * MiB, WEIGHTS_IN_POOL, memory=Memory.HOST)  # pinned host memory: not device bytes
    book.ledger.apply(event(pid=100, api=Api.cudaMalloc, layer=Layer.RUNTIME, address=0x1000, size=19 * MiB,
                            stack_id=book.stack_id(PROFILE)))  # runtime only: the same bytes seen from above
    book.ledger.apply(event(pid=100, api=Api.pytorch_malloc, layer=Layer.TORCH, obj=ObjectKind.BLOCK,
                            address=0x7F0000000000, size=MiB, stack_id=book.stack_id(PROFILE)))  # inside a segment
    book.vmm(Kind.ALLOC, Api.cuMemAddressReserve, 0x7E0000000000, 64 * MiB, obj=ObjectKind.VMM_RESERVE)
    book.pool(0x10, 0x7E0000000000, 23 * MiB, GRAPH_CAPTURE_V2)
    roles = book.roles()
    assert roles == {(100, 0): {Role.KV_CACHE: 3 * MiB, Role.ACTIVATIONS: 7 * MiB, Role.UNKNOWN: 11 * MiB,
                                Role.CUDA_GRAPH: 23 * MiB},
                     (100, 1): {Role.WEIGHTS: 5 * MiB},
                     (300, 0): {Role.OTHER: 13 * MiB}}
    assert {series: sum(by_role.values()) for series, by_role in roles.items()} == book.outstanding()


def test_kv_tensors_override_the_stack_for_allocations_and_mapped_handles():
    book = Ledger()
    segment = book.driver(4 * MiB, PIECEWISE_FORWARD)  # a stack that says activations
    other = book.driver(4 * MiB, PIECEWISE_FORWARD)
    book.pool(0x20, 0x7E0000000000, 8 * MiB, APP)
    book.pool(0x21, 0x7E0000800000, 8 * MiB, APP)
    # The plugin's tensors: one inside the segment (past its start), one inside the first mapping.
    ranges = {100: kv_ranges_of([(segment + MiB, 2 * MiB), (0x7E0000000000, 8 * MiB), (0x7E0000000000, MiB)])}
    assert ranges[100] == [(0x7E0000000000, 0x7E0000800000), (segment + MiB, segment + 3 * MiB)]
    assert other > segment
    assert book.roles(ranges) == {(100, 0): {Role.KV_CACHE: 12 * MiB, Role.ACTIVATIONS: 4 * MiB, Role.OTHER: 8 * MiB}}
    assert book.roles({300: ranges[100]}) == {(100, 0): {Role.ACTIVATIONS: 8 * MiB, Role.OTHER: 16 * MiB}}


def test_memory_mapped_back_at_wake_up_keeps_the_role_it_had_before_the_sleep():
    book = Ledger()
    memo = RoleMemo()
    book.vmm(Kind.ALLOC, Api.cuMemAddressReserve, 0x7E0000000000, 64 * MiB, obj=ObjectKind.VMM_RESERVE)
    book.pool(0x30, 0x7E0000000000, 6 * MiB, WEIGHTS_IN_POOL)
    book.pool(0x31, 0x7E0000600000, 10 * MiB, KV_V2)
    assert book.roles(memo=memo) == {(100, 0): {Role.WEIGHTS: 6 * MiB, Role.KV_CACHE: 10 * MiB}}
    book.unmap_and_release(0x30, 0x7E0000000000, 6 * MiB)
    book.unmap_and_release(0x31, 0x7E0000600000, 10 * MiB)
    assert book.roles(memo=memo) == {}  # asleep: the reservation is kept, and so are its roles
    book.pool(0x40, 0x7E0000000000, 6 * MiB, WAKE_UP)
    book.pool(0x41, 0x7E0000600000, 10 * MiB, WAKE_UP)
    assert book.roles(memo=memo) == {(100, 0): {Role.WEIGHTS: 6 * MiB, Role.KV_CACHE: 10 * MiB}}
    assert book.roles() == {(100, 0): {Role.OTHER: 16 * MiB}}  # with no memory of before: what the stack says


def test_analyzer_rows_carry_roles_and_a_new_layout_samples_them_at_once():
    book = Ledger()
    session = book.session
    analyzer = Analyzer(session)
    kv = book.driver(8 * MiB, PIECEWISE_FORWARD)
    book.driver(2 * MiB, WEIGHTS_IN_POOL)

    def row(second: int):
        view = ledger_view(book.ledger, T0_NS + second * NS, second * NS, with_entries=True)
        (found,) = analyzer.update(view).processes
        return found

    first = row(0)
    assert first.role_bytes == {Role.ACTIVATIONS: 8 * MiB, Role.WEIGHTS: 2 * MiB}
    assert sum(first.role_bytes.values()) == first.outstanding_bytes
    assert row(1).role_bytes == first.role_bytes  # the next site sample is 10 s away
    session.ingest(KvCacheLayout(100, T0_NS + 2 * NS, 0, (KvTensor(kv, 8 * MiB),), 16, MiB // 2, 16))
    assert row(2).role_bytes == {Role.KV_CACHE: 8 * MiB, Role.WEIGHTS: 2 * MiB}
    book.driver(4 * MiB, PROFILE)
    assert row(3).role_bytes == {Role.KV_CACHE: 8 * MiB, Role.WEIGHTS: 2 * MiB}  # not due, nothing moved
    session.ingest(SleepReport(100, T0_NS + 4 * NS, 1, (SleepPool("weights", 2 * MiB, 0),)))
    sampled = row(4)
    assert sampled.role_bytes == {Role.KV_CACHE: 8 * MiB, Role.WEIGHTS: 2 * MiB, Role.ACTIVATIONS: 4 * MiB}
    assert sum(sampled.role_bytes.values()) == sampled.outstanding_bytes


def test_without_entries_a_moved_view_samples_at_the_next_tick():
    book = Ledger()
    analyzer = Analyzer(book.session)
    book.driver(8 * MiB, PROFILE)
    analyzer.update(ledger_view(book.ledger, T0_NS, 0, with_entries=True))
    analyzer.update(ledger_view(book.ledger, T0_NS + NS, NS, with_entries=False))
    book.session.ingest(SleepReport(100, T0_NS + 2 * NS, 1, ()))
    analyzer.update(ledger_view(book.ledger, T0_NS + 2 * NS, 2 * NS, with_entries=False))
    assert analyzer._next_site_sample_ns == 0  # tick() copies the entries next time


def test_role_bytes_of_100_000_entries_take_one_cheap_pass():
    # Measured on the development machine: 0.10-0.15 s for 100 000 driver allocations of 4 pids with
    # 1 000 distinct stacks and a KV range per pid, 0.10-0.13 s with the stacks already memoised; the
    # site sample's survey_sites of the same entries takes 0.19-0.22 s.
    book = Ledger()
    stacks = [book.stack_id(Stack(PROFILE.frames + (Frame(f"layer_{index}", "/app/model.py", index),)))
              for index in range(1000)]
    for index in range(100_000):
        book.ledger.apply(event(pid=100 + index % 4, address=0x7F0000000000 + index * 2 * MiB, size=2 * MiB,
                                stack_id=stacks[index % 1000]))
    entries = book.ledger.entries()
    ranges = {100 + pid: [(0x7F0000000000, 0x7F0000000000 + 2 * MiB)] for pid in range(4)}
    memo = RoleMemo()
    started = time.perf_counter()
    roles = role_bytes(entries, book.session.stack, ranges, memo)
    first_seconds = time.perf_counter() - started
    started = time.perf_counter()
    role_bytes(entries, book.session.stack, ranges, memo)
    second_seconds = time.perf_counter() - started
    print(f"role_bytes of 100 000 entries: {first_seconds:.3f} s, memoised {second_seconds:.3f} s")
    assert sum(sum(by_role.values()) for by_role in roles.values()) == 100_000 * 2 * MiB
    assert roles[(100, 0)][Role.KV_CACHE] == 2 * MiB
    assert first_seconds < 2.0 and second_seconds < 2.0  # generous: shared CI machines
