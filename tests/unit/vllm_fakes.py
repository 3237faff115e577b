"""Faithful fakes of the vLLM 0.24.0 classes the kvtrace plugin patches, for a machine without torch
(vLLM does not import here). `install(root)` writes them as a `vllm` package under `root`, with the
real module names, so that the plugin's import hook meets them through Python's own import system, and
every test gets fresh classes (patches never leak from one test to the next).

Each fake keeps the real signatures, attributes and the bodies that matter to the plugin, copied from
vLLM 0.24.0 (site-packages/vllm; the file is named above each module): Scheduler.__init__ /
finish_requests / _free_request / _free_blocks / _free_request_blocks, BlockPool.get_new_blocks /
touch / free_blocks / get_num_free_blocks (with the null block 0), the single-type managers'
`req_to_blocks` defaultdict, the coordinator's `single_type_managers`, RequestStatus verbatim,
attn_utils._allocate_kv_cache called as a module global from init_kv_cache (V2 runner),
GPUModelRunner._allocate_kv_cache_tensors (V1), CuMemAllocator.sleep / wake_up / pointer_to_data and
gpu_worker.Worker.sleep(level). What needs a GPU (torch tensors, cuMem calls) is a small stand-in:
`FakeTensor` (data_ptr, untyped_storage().nbytes(), numel, element_size, device.index) and a
`mapped` flag per CuMem allocation. The fakes add test drivers vLLM does not have (`allocate`,
`step_finish`, `preempt`), each doing what the real engine step does to the same structures.
"""
from __future__ import annotations

import sys
import textwrap
from pathlib import Path

MODULES: dict[str, str] = {}

MODULES["vllm/__init__.py"] = '"""Fake vLLM 0.24.0 (tests/unit/vllm_fakes.py)."""\n'
for _package in ("v1", "v1/core", "v1/core/sched", "v1/worker", "v1/worker/gpu"):
    MODULES[f"vllm/{_package}/__init__.py"] = ""

MODULES["vllm/_fake_torch.py"] = '''
"""Stand-ins for the torch pieces the plugin reads: tensors with an address and a size."""
import itertools

_addresses = itertools.count(0x7F0000000000, 0x100000000)


class Device:
    def __init__(self, kind="cuda", index=0):
        self.type, self.index = kind, index


class UntypedStorage:
    def __init__(self, nbytes):
        self._nbytes = nbytes

    def nbytes(self):
        return self._nbytes


class FakeTensor:
    def __init__(self, size, element_size=1, device=None):
        self._numel, self._element_size = size, element_size
        self._address = next(_addresses)
        self.device = device if device is not None else Device()
        self._storage = UntypedStorage(size * element_size)

    def data_ptr(self):
        return self._address

    def numel(self):
        return self._numel

    def element_size(self):
        return self._element_size

    def untyped_storage(self):
        return self._storage


def zeros(size, dtype=None, device=None):
    return FakeTensor(size, 1, device)
'''

# vllm/v1/request.py: RequestStatus verbatim; Request with the attributes the scheduler touches.
MODULES["vllm/v1/request.py"] = '''
import enum


class RequestStatus(enum.IntEnum):
    """Status of a request."""

    WAITING = enum.auto()
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    WAITING_FOR_STREAMING_REQ = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Note: anything after PREEMPTED will be considered
    # as a finished status.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()
    FINISHED_REPETITION = enum.auto()

    def __str__(self) -> str:
        return self.name

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED


class Request:
    def __init__(self, request_id, prompt_token_ids=None, sampling_params=None, pooling_params=None,
                 client_index=0, arrival_time=None, priority=0):
        self.request_id = request_id
        self.client_index = client_index
        self.priority = priority
        self.prompt_token_ids = prompt_token_ids or []
        self.status = RequestStatus.WAITING
        self.last_sched_seq = 0

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def __lt__(self, other):
        return self.request_id < other.request_id
'''

# vllm/v1/kv_cache_interface.py
MODULES["vllm/v1/kv_cache_interface.py"] = '''
from dataclasses import dataclass


@dataclass(frozen=True)
class FullAttentionSpec:
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype_size: int = 2  # the real spec holds a torch.dtype; get_dtype_size(dtype) of bfloat16

    @property
    def page_size_bytes(self) -> int:
        # AttentionSpec.real_page_size_bytes: 2 (K and V) * block_size * num_kv_heads * head_size * dtype
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype_size


@dataclass
class KVCacheTensor:
    size: int  # size of the KV cache tensor in bytes
    shared_by: list  # layer names that share the same KV cache tensor
    offset: int = 0
    block_stride: int = 0


@dataclass
class KVCacheGroupSpec:
    layer_names: list
    kv_cache_spec: object
    is_eagle_group: bool = False


@dataclass
class KVCacheConfig:
    num_blocks: int
    kv_cache_tensors: list
    kv_cache_groups: list
'''

# vllm/v1/core/kv_cache_utils.py: KVCacheBlock and the free queue (an ordered dict here, the real one
# a doubly linked list; the same operations and num_free_blocks).
MODULES["vllm/v1/core/kv_cache_utils.py"] = '''
from collections import OrderedDict


class KVCacheBlock:
    def __init__(self, block_id):
        self.block_id = block_id
        self.ref_cnt = 0
        self._block_hash = None
        self.is_null = False

    @property
    def block_hash(self):
        return self._block_hash

    def set_block_hash(self, block_hash):
        assert self._block_hash is None
        self._block_hash = block_hash

    def reset_hash(self):
        self._block_hash = None


class FreeKVCacheBlockQueue:
    def __init__(self, blocks):
        self._queue = OrderedDict((block.block_id, block) for block in blocks)
        self.num_free_blocks = len(blocks)

    def popleft(self):
        if not self._queue:
            raise ValueError("No free blocks available")
        _, block = self._queue.popitem(last=False)
        self.num_free_blocks -= 1
        return block

    def popleft_n(self, n):
        return [self.popleft() for _ in range(n)]

    def remove(self, block):
        del self._queue[block.block_id]
        self.num_free_blocks -= 1

    def append(self, block):
        self._queue[block.block_id] = block
        self.num_free_blocks += 1

    def prepend_n(self, blocks):
        for block in reversed(blocks):
            self._queue[block.block_id] = block
            self._queue.move_to_end(block.block_id, last=False)
        self.num_free_blocks += len(blocks)

    def append_n(self, blocks):
        for block in blocks:
            self._queue[block.block_id] = block
        self.num_free_blocks += len(blocks)
'''

# vllm/v1/core/block_pool.py: get_new_blocks / touch / free_blocks / get_num_free_blocks / get_usage
# as in 0.24.0 (events and metrics left out).
MODULES["vllm/v1/core/block_pool.py"] = '''
from collections.abc import Iterable, Sequence

from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock


class BlockPool:
    def __init__(self, num_gpu_blocks, enable_caching, hash_block_size, enable_kv_cache_events=False,
                 metrics_collector=None):
        assert isinstance(num_gpu_blocks, int) and num_gpu_blocks > 0
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.blocks = [KVCacheBlock(idx) for idx in range(num_gpu_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block = {}
        # To represent a placeholder block with block_id=0.
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True

    def get_new_blocks(self, num_blocks: int) -> list:
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        ret = self.free_block_queue.popleft_n(num_blocks)
        for block in ret:
            if self.enable_caching and block.block_hash is not None:
                self.cached_block_hash_to_block.pop(block.block_hash, None)
                block.reset_hash()
            assert block.ref_cnt == 0
            block.ref_cnt += 1
        return ret

    def touch(self, blocks: Sequence) -> None:
        for block in blocks:
            # ref_cnt=0 means this block is in the free list (i.e. eviction
            # candidate), so remove it.
            if block.ref_cnt == 0 and not block.is_null:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable) -> None:
        blocks_with_hash = []
        blocks_without_hash = []
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0 and not block.is_null:
                if block.block_hash is None:
                    blocks_without_hash.append(block)
                else:
                    blocks_with_hash.append(block)
        self.free_block_queue.prepend_n(blocks_without_hash)
        self.free_block_queue.append_n(blocks_with_hash)

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        total_gpu_blocks = self.num_gpu_blocks - 1
        if not total_gpu_blocks:
            return 0
        return 1.0 - (self.get_num_free_blocks() / total_gpu_blocks)
'''

# vllm/v1/core/single_type_kv_cache_manager.py: req_to_blocks, pop_blocks_for_free, free.
MODULES["vllm/v1/core/single_type_kv_cache_manager.py"] = '''
from collections import defaultdict


class SingleTypeKVCacheManager:
    def __init__(self, kv_cache_spec, block_pool, kv_cache_group_id=0, **kwargs):
        self.block_size = kv_cache_spec.block_size
        self.kv_cache_spec = kv_cache_spec
        self.block_pool = block_pool
        self.req_to_blocks = defaultdict(list)
        self.num_cached_block = {}
        self.kv_cache_group_id = kv_cache_group_id

    def get_num_blocks_to_allocate(self, request_id, num_blocks):
        # The real one reads self.req_to_blocks[request_id]: the defaultdict grows an empty entry.
        return max(num_blocks - len(self.req_to_blocks[request_id]), 0)

    def allocate_new_blocks(self, request_id, num_blocks):
        req_blocks = self.req_to_blocks[request_id]
        new_blocks = self.block_pool.get_new_blocks(num_blocks)
        req_blocks.extend(new_blocks)
        return new_blocks

    def share_cached_blocks(self, request_id, blocks):
        """allocate_new_computed_blocks for a prefix-cache hit: touch, then hold."""
        self.block_pool.touch(blocks)
        self.req_to_blocks[request_id].extend(blocks)

    def pop_blocks_for_free(self, request_id):
        req_blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_block.pop(request_id, None)
        return req_blocks

    def free(self, request_id: str) -> None:
        # Free blocks in reverse order so that the tail blocks are freed first.
        self.block_pool.free_blocks(reversed(self.pop_blocks_for_free(request_id)))


class FullAttentionManager(SingleTypeKVCacheManager):
    pass
'''

# vllm/v1/core/kv_cache_coordinator.py
MODULES["vllm/v1/core/kv_cache_coordinator.py"] = '''
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager


class KVCacheCoordinator:
    def __init__(self, kv_cache_config, max_model_len, enable_caching, hash_block_size=16, **kwargs):
        self.kv_cache_config = kv_cache_config
        self.block_pool = BlockPool(kv_cache_config.num_blocks, enable_caching, hash_block_size)
        self.single_type_managers = tuple(
            FullAttentionManager(kv_cache_spec=group.kv_cache_spec, block_pool=self.block_pool,
                                 kv_cache_group_id=i)
            for i, group in enumerate(kv_cache_config.kv_cache_groups))

    def allocate_new_blocks(self, request_id, num_blocks):
        return tuple(manager.allocate_new_blocks(request_id, num_blocks)
                     for manager in self.single_type_managers)

    def free(self, request_id: str) -> None:
        for manager in self.single_type_managers:
            manager.free(request_id)

    def pop_blocks_for_free(self, request_id):
        blocks = []
        for manager in self.single_type_managers:
            blocks.extend(manager.pop_blocks_for_free(request_id))
        return blocks


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    pass
'''

# vllm/v1/core/kv_cache_manager.py
MODULES["vllm/v1/core/kv_cache_manager.py"] = '''
from vllm.v1.core.kv_cache_coordinator import UnitaryKVCacheCoordinator


class KVCacheManager:
    def __init__(self, kv_cache_config, max_model_len, max_num_batched_tokens=8192, enable_caching=True,
                 **kwargs):
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.coordinator = UnitaryKVCacheCoordinator(kv_cache_config=kv_cache_config,
                                                     max_model_len=max_model_len,
                                                     enable_caching=enable_caching)
        self.num_kv_cache_groups = len(kv_cache_config.kv_cache_groups)
        self.block_pool = self.coordinator.block_pool
        self.kv_cache_config = kv_cache_config

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def allocate_slots(self, request, num_new_blocks):
        """Much reduced: num_new_blocks more blocks for the request in every group (None: no room)."""
        if num_new_blocks * self.num_kv_cache_groups > self.block_pool.get_num_free_blocks():
            return None
        return self.coordinator.allocate_new_blocks(request.request_id, num_new_blocks)

    def free(self, request) -> None:
        self.coordinator.free(request.request_id)

    def pop_blocks_for_free(self, request):
        return self.coordinator.pop_blocks_for_free(request.request_id)
'''

# vllm/v1/core/sched/request_queue.py (FCFS)
MODULES["vllm/v1/core/sched/request_queue.py"] = '''
from collections import deque


class FCFSRequestQueue(deque):
    def add_request(self, request) -> None:
        self.append(request)

    def prepend_request(self, request) -> None:
        self.appendleft(request)

    def remove_requests(self, requests) -> None:
        requests_to_remove = set(requests)
        filtered_requests = [req for req in self if req not in requests_to_remove]
        self.clear()
        self.extend(filtered_requests)

    def __len__(self) -> int:
        return super().__len__()


def create_request_queue(policy):
    return FCFSRequestQueue()
'''

# vllm/v1/core/sched/scheduler.py: __init__ (the attributes the plugin reads), add_request,
# finish_requests / _free_request / _free_blocks / _free_request_blocks as in 0.24.0.
MODULES["vllm/v1/core/sched/scheduler.py"] = '''
from collections import deque
from collections.abc import Iterable

from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched.request_queue import create_request_queue
from vllm.v1.request import Request, RequestStatus


def remove_all(lst, items_to_remove):
    return [item for item in lst if item not in items_to_remove]


class SchedulerInterface:
    pass


class Scheduler(SchedulerInterface):
    def __init__(self, vllm_config, kv_cache_config, structured_output_manager, block_size,
                 hash_block_size=None, mm_registry=None, include_finished_set=False, log_stats=False):
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.finished_req_ids_dict = None
        self.max_num_running_reqs = 1024
        self.block_size = block_size
        # req_id -> Request
        self.requests: dict = {}
        self.policy = "fcfs"
        self.waiting = create_request_queue(self.policy)
        self.skipped_waiting = create_request_queue(self.policy)
        self.running: list = []
        self.finished_req_ids: set = set()
        self.num_waiting_for_streaming_input = 0
        self.finished_recving_kv_req_ids: set = set()
        self.failed_recving_kv_req_ids: set = set()
        self.defer_block_free = False
        self.processed_step_seq = 0
        self.sched_step_seq = 0
        self.deferred_frees = deque()
        self._inflight_prefills: set = set()
        self.kv_cache_manager = KVCacheManager(kv_cache_config=kv_cache_config, max_model_len=4096,
                                               enable_caching=True)

    def get_request_counts(self):
        return len(self.running), len(self.waiting) + len(self.skipped_waiting)

    def add_request(self, request: Request) -> None:
        self.waiting.add_request(request)
        self.requests[request.request_id] = request

    # ---- test drivers: what one engine step does to these structures ----

    def allocate(self, request_id, num_blocks):
        """schedule(): the request gets blocks and runs (from waiting or preempted)."""
        request = self.requests[request_id]
        if self.kv_cache_manager.allocate_slots(request, num_blocks) is None:
            return False
        if request.status != RequestStatus.RUNNING:
            self.waiting.remove_requests([request])
            request.status = RequestStatus.RUNNING
            self.running.append(request)
        return True

    def preempt(self, request_id):
        """_preempt_request: blocks back to the pool, the request waits again."""
        request = self.requests[request_id]
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        self.waiting.prepend_request(request)

    def step_finish(self, request_id, status=RequestStatus.FINISHED_STOPPED):
        """update_from_output(): a request that stopped (or hit its length) is freed."""
        request = self.requests[request_id]
        request.status = status
        self.running = remove_all(self.running, {request})
        self._free_request(request)

    # ---- as in 0.24.0 ----

    def finish_requests(self, request_ids, finished_status):
        assert RequestStatus.is_finished(finished_status)
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        elif request_ids is not None:
            request_ids = set(request_ids)
        else:
            request_ids = self.requests.keys()

        running_requests_to_remove = set()
        waiting_requests_to_remove = []
        valid_requests = []

        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            valid_requests.append(request)
            if request.status == RequestStatus.RUNNING:
                running_requests_to_remove.add(request)
            else:
                if request.status == RequestStatus.WAITING_FOR_STREAMING_REQ:
                    self.num_waiting_for_streaming_input -= 1
                waiting_requests_to_remove.append(request)

        if running_requests_to_remove:
            self.running = remove_all(self.running, running_requests_to_remove)
        if waiting_requests_to_remove:
            self.waiting.remove_requests(waiting_requests_to_remove)
            self.skipped_waiting.remove_requests(waiting_requests_to_remove)

        for request in valid_requests:
            delay_free_blocks = False
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                delay_free_blocks = request.request_id not in self.finished_recving_kv_req_ids
                self.finished_recving_kv_req_ids.discard(request.request_id)
                self.failed_recving_kv_req_ids.discard(request.request_id)
            request.status = finished_status
            self._free_request(request, delay_free_blocks=delay_free_blocks)

        return [(r.request_id, r.client_index) for r in valid_requests]

    def _connector_finished(self, request):
        return False, None

    def _free_request(self, request, delay_free_blocks=False):
        assert request.is_finished()
        self._inflight_prefills.discard(request)
        connector_delay_free_blocks, kv_xfer_params = self._connector_finished(request)
        request_id = request.request_id
        self.finished_req_ids.add(request_id)
        if self.finished_req_ids_dict is not None:
            self.finished_req_ids_dict[request.client_index].add(request_id)
        delay_free_blocks |= connector_delay_free_blocks
        if not delay_free_blocks:
            self._free_blocks(request)
        return kv_xfer_params

    def _free_blocks(self, request):
        assert request.is_finished()
        self._free_request_blocks(request)
        del self.requests[request.request_id]

    def _free_request_blocks(self, request):
        if not self.defer_block_free or request.last_sched_seq <= self.processed_step_seq:
            self.kv_cache_manager.free(request)
            return
        blocks = self.kv_cache_manager.pop_blocks_for_free(request)
        if blocks:
            self.deferred_frees.append((self.sched_step_seq, blocks))

    def _drain_deferred_frees(self):
        while self.deferred_frees:
            fence, _ = self.deferred_frees[0]
            if fence > self.processed_step_seq:
                break
            _, blocks = self.deferred_frees.popleft()
            self.kv_cache_manager.block_pool.free_blocks(reversed(blocks))
'''

# vllm/v1/worker/gpu/attn_utils.py: _allocate_kv_cache verbatim (torch.zeros -> the stand-in), called
# as a module global from init_kv_cache.
MODULES["vllm/v1/worker/gpu/attn_utils.py"] = '''
from vllm import _fake_torch as torch


def get_shared_kv_cache_layers(vllm_config):
    return {}


def _allocate_kv_cache(kv_cache_config, shared_layers, device):
    kv_cache_raw_tensors = {}
    packed_backing = None
    for kv_cache_tensor in kv_cache_config.kv_cache_tensors:
        if kv_cache_tensor.block_stride > 0:
            # Allocate once; all packed tensors alias the same backing.
            if packed_backing is None:
                packed_backing = torch.zeros(kv_cache_tensor.size, dtype="int8", device=device)
            tensor = packed_backing
        else:
            tensor = torch.zeros(kv_cache_tensor.size, dtype="int8", device=device)
        for layer_name in kv_cache_tensor.shared_by:
            kv_cache_raw_tensors[layer_name] = tensor

    layer_names = set()
    for group in kv_cache_config.kv_cache_groups:
        for layer_name in group.layer_names:
            layer_names.add(layer_name)
    assert layer_names == (kv_cache_raw_tensors.keys() | shared_layers.keys()), (
        "Some layers are not correctly initialized"
    )
    return kv_cache_raw_tensors


def init_kv_cache(runner_kv_caches, forward_context, kv_cache_config, attn_groups, device, cache_dtype,
                  kernel_block_sizes, vllm_config):
    shared_kv_cache_layers = get_shared_kv_cache_layers(vllm_config)
    kv_cache_raw_tensors = _allocate_kv_cache(kv_cache_config, shared_kv_cache_layers, device)
    runner_kv_caches.extend(kv_cache_raw_tensors.values())
    return kv_cache_raw_tensors
'''

# vllm/v1/worker/gpu/model_runner.py: imports init_kv_cache by name, as the real one does.
MODULES["vllm/v1/worker/gpu/model_runner.py"] = '''
from vllm.v1.worker.gpu.attn_utils import init_kv_cache


class GPUModelRunner:
    def __init__(self, device):
        self.device = device

    def initialize_kv_cache(self, kv_cache_config):
        self.kv_cache_config = kv_cache_config
        self.kv_caches = []
        return init_kv_cache(self.kv_caches, {}, kv_cache_config, [], self.device, "auto", [], None)
'''

# vllm/v1/worker/gpu_model_runner.py (V1 runner): _allocate_kv_cache_tensors verbatim.
MODULES["vllm/v1/worker/gpu_model_runner.py"] = '''
from vllm import _fake_torch as torch


class GPUModelRunner:
    def __init__(self, device):
        self.device = device
        self.runner_only_attn_layers = set()

    def _allocate_kv_cache_tensors(self, kv_cache_config):
        kv_cache_raw_tensors = {}
        packed_backing = None
        for kv_cache_tensor in kv_cache_config.kv_cache_tensors:
            if kv_cache_tensor.block_stride > 0:
                if packed_backing is None:
                    packed_backing = torch.zeros(kv_cache_tensor.size, dtype="int8", device=self.device)
                tensor = packed_backing
            else:
                tensor = torch.zeros(kv_cache_tensor.size, dtype="int8", device=self.device)
            for layer_name in kv_cache_tensor.shared_by:
                kv_cache_raw_tensors[layer_name] = tensor

        layer_names = set()
        for group in kv_cache_config.kv_cache_groups:
            for layer_name in group.layer_names:
                if layer_name in self.runner_only_attn_layers:
                    continue
                layer_names.add(layer_name)
        assert layer_names == set(kv_cache_raw_tensors.keys()), "Some layers are not correctly initialized"
        return kv_cache_raw_tensors

    def initialize_kv_cache_tensors(self, kv_cache_config, kernel_block_sizes=None):
        return self._allocate_kv_cache_tensors(kv_cache_config)
'''

# vllm/device_allocator/__init__.py and cumem.py: pointer_to_data of AllocationData(handle, tag);
# handle = (py_device, py_size_or_aligned_size, py_ptr, py_handle). sleep() releases every allocation
# (copying the offloaded tags out first); wake_up(tags) maps the tags back.
MODULES["vllm/device_allocator/__init__.py"] = '''
import dataclasses

HandleType = tuple


@dataclasses.dataclass
class AllocationData:
    handle: HandleType
    tag: str
    cpu_backup_tensor: object = None
    mapped: bool = True  # the stand-in for cuMemMap / cuMemRelease


def get_mem_allocator_instance():
    from vllm.device_allocator.cumem import CuMemAllocator

    return CuMemAllocator.get_instance()
'''

MODULES["vllm/device_allocator/cumem.py"] = '''
from contextlib import contextmanager

from vllm.device_allocator import AllocationData


def create_and_map(allocation_handle):
    pass


def unmap_and_release(allocation_handle):
    pass


class CuMemAllocator:
    instance = None
    default_tag: str = "default"

    @staticmethod
    def get_instance():
        if CuMemAllocator.instance is None:
            CuMemAllocator.instance = CuMemAllocator()
        return CuMemAllocator.instance

    def __init__(self):
        self.pointer_to_data = {}
        self.current_tag = CuMemAllocator.default_tag
        self._next_ptr = 0x7E0000000000

    def _python_malloc_callback(self, allocation_handle):
        py_d_mem = allocation_handle[2]
        self.pointer_to_data[py_d_mem] = AllocationData(allocation_handle, self.current_tag)

    def allocate(self, size_bytes, device=0):
        """What torch does inside use_memory_pool(tag): the C extension calls the malloc callback."""
        ptr = self._next_ptr
        self._next_ptr += size_bytes
        self._python_malloc_callback((device, size_bytes, ptr, ptr + 1))
        return ptr

    def sleep(self, offload_tags=None):
        if offload_tags is None:
            offload_tags = (CuMemAllocator.default_tag,)
        elif isinstance(offload_tags, str):
            offload_tags = (offload_tags,)
        assert isinstance(offload_tags, tuple)
        for ptr, data in self.pointer_to_data.items():
            handle = data.handle
            if data.tag in offload_tags:
                data.cpu_backup_tensor = ("host copy", handle[1])
            unmap_and_release(handle)
            data.mapped = False

    def wake_up(self, tags=None):
        for ptr, data in self.pointer_to_data.items():
            if tags is None or data.tag in tags:
                create_and_map(data.handle)
                data.mapped = True
                data.cpu_backup_tensor = None

    @contextmanager
    def use_memory_pool(self, tag=None):
        if tag is None:
            tag = CuMemAllocator.default_tag
        old_tag = self.current_tag
        self.current_tag = tag
        try:
            yield
        finally:
            self.current_tag = old_tag

    def get_current_usage(self):
        return sum(data.handle[1] for data in self.pointer_to_data.values())
'''

# vllm/v1/worker/gpu_worker.py: Worker.sleep(level) / wake_up(tags) as in 0.24.0 (minus mem_get_info).
MODULES["vllm/v1/worker/gpu_worker.py"] = '''
from vllm.device_allocator import get_mem_allocator_instance


class Worker:
    def __init__(self):
        self._sleep_saved_buffers = {}

    def sleep(self, level: int = 1) -> None:
        allocator = get_mem_allocator_instance()
        allocator.sleep(offload_tags=("weights",) if level == 1 else tuple())

    def wake_up(self, tags=None) -> None:
        allocator = get_mem_allocator_instance()
        allocator.wake_up(tags)
'''

SCHEDULER_MODULES = ("vllm.v1.core.sched.scheduler", "vllm.v1.core.block_pool")


def install(root: Path) -> Path:
    """Writes the fake `vllm` package under root (a sys.path entry to add) and returns root."""
    for relative, source in MODULES.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source).lstrip("\n"))
    return root


def forget() -> None:
    """Drops every fake vllm module from sys.modules (the next import runs the files again)."""
    for name in [name for name in sys.modules if name == "vllm" or name.startswith("vllm.")]:
        del sys.modules[name]


def kv_cache_config(num_blocks: int = 1001, layers: int = 4, shared: int = 0, packed: bool = False,
                    block_size: int = 16, num_kv_heads: int = 8, head_size: int = 128, groups: int = 1):
    """A KVCacheConfig as vLLM builds it: one tensor per layer (num_blocks pages each), except that the
    first `shared` tensors are each shared by two layers (shared_by with two names), and with `packed`
    every KVCacheTensor has a block_stride, so _allocate_kv_cache backs them all with one tensor."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    tensors = []
    index = 0
    while index < layers:
        width = 2 if shared > len(tensors) and index + 1 < layers else 1
        stride = spec.page_size_bytes * layers if packed else 0
        size = num_blocks * (stride or spec.page_size_bytes)
        tensors.append(KVCacheTensor(size=size, shared_by=names[index:index + width],
                                     offset=index * spec.page_size_bytes if packed else 0, block_stride=stride))
        index += width
    per_group = [names[i::groups] for i in range(groups)]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors,
                         kv_cache_groups=[KVCacheGroupSpec(layer_names=group, kv_cache_spec=spec)
                                          for group in per_group])


def new_scheduler(num_blocks: int = 1001, groups: int = 1):
    """A Scheduler built the way EngineCore builds it (through the real constructor's signature)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    return Scheduler(vllm_config=object(), kv_cache_config=kv_cache_config(num_blocks, groups=groups),
                     structured_output_manager=None, block_size=16)
