"""GPUs as NVML sees them, and how CUDA numbers them.

NVML numbers GPUs by PCI order (its index) and names them by UUID; a process numbers the GPUs it
can see from 0 (CUDA ordinals), in the order CUDA_VISIBLE_DEVICES lists them. sources/nvml.py
samples NVML into these shapes; analysis matches a traced ordinal to an NVML GPU with
`nvml_index_for_cuda_ordinal`.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class GpuMemory:
    """One GPU as NVML sees it (NVML index order, not CUDA ordinals)."""

    index: int
    uuid: str
    name: str
    total_bytes: int
    used_bytes: int
    free_bytes: int
    reserved_bytes: int


@dataclass(frozen=True)
class NvmlProcessMemory:
    """One compute process on one GPU, as NVML reports it. `used_bytes` includes the CUDA context
    and memory the process's allocator caches; None when NVML does not say (some drivers, vGPU)."""

    gpu_index: int  # NVML index
    pid: int  # in the host's pid namespace
    used_bytes: int | None


@dataclass(frozen=True)
class NvmlSample:
    """One round of sampling: the GPUs that answered and their compute processes."""

    timestamp_ns: int  # wall clock, when the round ended
    gpus: tuple[GpuMemory, ...]
    processes: tuple[NvmlProcessMemory, ...]



def nvml_index_for_cuda_ordinal(ordinal: int, visible_devices: str | None,
                                gpu_uuids: Sequence[str]) -> int | None:
    """The NVML index of CUDA device `ordinal` in a process started with this CUDA_VISIBLE_DEVICES.

    CUDA numbers only the visible GPUs, in the order listed: with "2,0" ordinal 0 is NVML's GPU 2.
    Entries are NVML indices or UUIDs ("GPU-8e6f…"; a unique prefix is enough, "GPU-" may be left
    out). Like CUDA, the list ends at the first entry that names no GPU (so "-1" hides them all); a
    MIG instance is not a whole GPU, so it ends the list too. Unset (None): ordinal = NVML index.
    `gpu_uuids` are NVML's, in index order. None: the ordinal names no GPU.

    Assumes CUDA's device order equals NVML's (PCI bus order): true with CUDA_DEVICE_ORDER=PCI_BUS_ID
    and on hosts of identical GPUs, where CUDA's default "fastest first" falls back to PCI order.
    """
    if ordinal < 0:
        return None
    if visible_devices is None:
        return ordinal if ordinal < len(gpu_uuids) else None
    visible: list[int] = []
    for entry in visible_devices.split(","):
        index = _visible_entry_index(entry.strip(), gpu_uuids)
        if index is None or index in visible:
            break
        visible.append(index)
    return visible[ordinal] if ordinal < len(visible) else None


def cuda_visible_count(visible_devices: str | None, host_gpu_count: int) -> int:
    """How many GPUs a process started with this CUDA_VISIBLE_DEVICES sees, on a host (or in a
    container) with `host_gpu_count` GPUs: the list up to its first entry that names no GPU. A UUID
    entry counts as one GPU (whether it names one needs NVML)."""
    if visible_devices is None:
        return host_gpu_count
    seen: list[str] = []
    for entry in (entry.strip() for entry in visible_devices.split(",")):
        valid = (int(entry) < host_gpu_count if entry.isdigit()
                 else bool(entry) and not entry.upper().startswith("MIG-") and not entry.startswith("-"))
        if not valid or entry in seen:
            break
        seen.append(entry)
    return len(seen)


def _visible_entry_index(entry: str, gpu_uuids: Sequence[str]) -> int | None:
    if entry.isdigit():
        index = int(entry)
        return index if index < len(gpu_uuids) else None
    if not entry or entry.upper().startswith("MIG-"):
        return None
    wanted = entry.lower().removeprefix("gpu-")
    matches = [index for index, uuid in enumerate(gpu_uuids)
               if uuid.lower().removeprefix("gpu-").startswith(wanted)]
    return matches[0] if len(matches) == 1 else None
