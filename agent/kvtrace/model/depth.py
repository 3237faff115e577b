"""How closely each process is traced: its depth, since when, and why.

Segments (cudaMalloc, cuMemAlloc, VMM) are rare calls under a caching allocator and cost almost
nothing to trace, so every process is traced at SEGMENTS, always. PyTorch's blocks are where the
cost is (a trap per tensor), and they only matter for a process whose memory grows or is about to
run out: the agent raises such a process to BLOCKS on evidence (analysis/depth.py), or an operator
does (`kvtrace deep`), and lowers it again when the evidence is gone.

- SEGMENTS: runtime, driver and VMM probes. PyTorch's USDT semaphores stay at zero in the process,
  so torch skips its own probes entirely.
- BLOCKS: the process's PyTorch probes are on (its semaphores only: other processes pay nothing);
  block stacks are sampled (a block's stack stands for about --block-sample-bytes of blocks), and
  the ledger stays exact for every block.
- FULL: every block's stack, for a bounded time (what `--blocks always --block-sample-bytes 0` does
  for every process).

A process's blocks are known only from when it reached BLOCKS: what it allocated before is in its
segments, never in its blocks. Reports say the depth and since when, so nobody reads a holder off the
wrong level.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class Depth(enum.IntEnum):
    """The values of kvtrace.v1.ProcessDepth (0 is UNSPECIFIED there)."""

    SEGMENTS = 1
    BLOCKS = 2
    FULL = 3

    @property
    def label(self) -> str:
        return self.name.lower()


class BlocksMode(enum.Enum):
    """`kvtrace agent --blocks`: who decides each process's depth."""

    AUTO = "auto"      # the agent, on evidence (and operators, with `kvtrace deep`)
    ALWAYS = "always"  # every process at BLOCKS (FULL with --block-sample-bytes 0): the cost everywhere
    NEVER = "never"    # no PyTorch blocks at all (`--no-torch-blocks`)


class DepthCause(enum.Enum):
    """Why a process is at its depth (the values of kvtrace.v1.DepthCause, less UNSPECIFIED)."""

    DEFAULT = 1      # nothing asked for more
    CONFIGURED = 2   # --blocks always
    GROWTH = 3       # its traced bytes grew over the window
    TIME_TO_OOM = 4  # its GPU runs out of memory within the threshold at its growth rate
    UNEXPLAINED = 5  # NVML sees it gain memory that no traced layer explains
    VLLM = 6         # a vLLM detector fired for its engine
    OPERATOR = 7     # `kvtrace deep` (gRPC SetProcessDepth)
    NO_BLOCKS = 8    # it maps no PyTorch allocator with probes: its segments are its holders


@dataclass(frozen=True, slots=True)
class ProcessDepth:
    """One process's depth as the agent holds it now."""

    pid: int
    depth: Depth
    since_ns: int          # wall clock: when it reached this depth (its blocks are known from then)
    cause: DepthCause
    detail: str = ""       # the evidence in words, e.g. "traced bytes +96 MiB in 60 s"
    until_ns: int = 0      # wall clock: an operator's request ends then (0: no end set)
    # Block stacks are sampled at this mean interval of bytes (BLOCKS); 0: every block's stack (FULL, or
    # --block-sample-bytes 0), or no blocks at all (SEGMENTS).
    sample_bytes: int = 0

    @property
    def knows_holders(self) -> bool:
        """Its blocks (and so the stacks that hold its memory under a caching allocator) are traced."""
        return self.depth >= Depth.BLOCKS


def segments_only(pid: int, since_ns: int) -> ProcessDepth:
    """The depth of a process nothing has raised."""
    return ProcessDepth(pid, Depth.SEGMENTS, since_ns, DepthCause.DEFAULT)


# SetProcessDepth's `requested.detail` for a withdrawal (SEGMENTS), which `kvtrace deep --off` reads.
REQUEST_WITHDRAWN = "request withdrawn: the agent decides on its own evidence again"
NO_REQUEST = "no request to withdraw: the agent decides on its own evidence, as before"


@dataclass(frozen=True, slots=True)
class DepthRequest:
    """An operator's request (`kvtrace deep --pid P [--for 10m] [--full]`, gRPC SetProcessDepth)."""

    pid: int
    depth: Depth           # BLOCKS or FULL; SEGMENTS withdraws a request
    requested_ns: int      # wall clock
    until_ns: int          # wall clock: the request ends then
    # When the process asked for started (wall clock; 0: not known): a process that takes its pid later is
    # another one, and the request does not pass to it.
    process_started_ns: int = 0

