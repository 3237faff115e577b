"""ctypes mirrors of the structs in probes/kvtrace.h (a unit test checks sizes and offsets)."""
from __future__ import annotations

import ctypes
import os
import re
import struct
from pathlib import Path

from kvtrace.model.events import COMM_BYTES

COMM_LEN = COMM_BYTES


class RawEvent(ctypes.Structure):
    _fields_ = [
        ("timestamp_ns", ctypes.c_uint64),
        ("address", ctypes.c_uint64),
        ("size_bytes", ctypes.c_uint64),
        ("caller_address", ctypes.c_uint64),
        ("aux", ctypes.c_uint64),
        ("stack_id", ctypes.c_uint64),
        ("pid", ctypes.c_uint32),
        ("tid", ctypes.c_uint32),
        ("device", ctypes.c_int32),
        ("error_code", ctypes.c_int32),
        ("api", ctypes.c_uint16),
        ("kind", ctypes.c_uint8),
        ("layer", ctypes.c_uint8),
        ("object", ctypes.c_uint8),
        ("memory", ctypes.c_uint8),
        ("stack_status", ctypes.c_uint8),
        ("sampling", ctypes.c_uint8),
        ("comm", ctypes.c_char * COMM_LEN),
    ]


# The same record for struct.unpack_from: one C call per event instead of a ctypes attribute each.
EVENT_STRUCT = struct.Struct("<QQQQQQIIiiHBBBBBB16s")


class RawNotify(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_uint32), ("reason", ctypes.c_uint32)]


class RawLedgerKey(ctypes.Structure):
    _fields_ = [
        ("pid", ctypes.c_uint32),
        ("layer", ctypes.c_uint8),
        ("object", ctypes.c_uint8),
        ("reserved", ctypes.c_uint16),
        ("address", ctypes.c_uint64),
    ]


class RawLedgerValue(ctypes.Structure):
    _fields_ = [
        ("size_bytes", ctypes.c_uint64),
        ("timestamp_ns", ctypes.c_uint64),
        ("caller_address", ctypes.c_uint64),
        ("aux", ctypes.c_uint64),
        ("tid", ctypes.c_uint32),
        ("device", ctypes.c_int32),
        ("api", ctypes.c_uint16),
        ("memory", ctypes.c_uint8),
        ("released", ctypes.c_uint8),
        ("sample_kib", ctypes.c_uint16),
        ("sampled", ctypes.c_uint8),
        ("unsent", ctypes.c_uint8),
        ("stack_id", ctypes.c_uint64),
    ]


class RawTotalsKey(ctypes.Structure):
    _fields_ = [
        ("pid", ctypes.c_uint32),
        ("device", ctypes.c_int32),
        ("layer", ctypes.c_uint8),
        ("memory", ctypes.c_uint8),
        ("reserved", ctypes.c_uint16),
        ("reserved2", ctypes.c_uint32),
    ]


class RawTotalsValue(ctypes.Structure):
    _fields_ = [("size_bytes", ctypes.c_int64), ("count", ctypes.c_int64)]


MAX_FRAMES = 64


class RawPyTarget(ctypes.Structure):
    _fields_ = [
        ("tss_key_address", ctypes.c_uint64),
        ("tstate_frame", ctypes.c_int16),
        ("cframe_frame", ctypes.c_int16),
        ("frame_code", ctypes.c_int16),
        ("frame_previous", ctypes.c_int16),
        ("frame_instr", ctypes.c_int16),
        ("frame_owner", ctypes.c_int16),
        ("frame_read_bytes", ctypes.c_uint16),
        ("instr_is_lasti", ctypes.c_uint8),
        ("reserved", ctypes.c_uint8),
        ("tstate_datastack", ctypes.c_int16),
        ("tstate_base_frame", ctypes.c_int16),
        ("reserved3", ctypes.c_uint32),
        ("interpreters_head_address", ctypes.c_uint64),
        ("interp_threads_head", ctypes.c_int16),
        ("tstate_prev", ctypes.c_int16),
        ("tstate_next", ctypes.c_int16),
        ("tstate_thread_id", ctypes.c_int16),
        ("tstate_interp", ctypes.c_int16),
        ("interp_next", ctypes.c_int16),
        ("reserved5", ctypes.c_uint32),
    ]


class RawFrame(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint64), ("instr", ctypes.c_uint64)]


class RawStack(ctypes.Structure):
    _fields_ = [
        ("pid", ctypes.c_uint32),
        ("depth", ctypes.c_uint16),
        ("truncated", ctypes.c_uint8),
        ("reserved", ctypes.c_uint8),
        ("frames", RawFrame * MAX_FRAMES),
    ]


# Per-CPU counter indexes (KVT_COUNTER_*).
COUNTERS = ("events_submitted", "events_lost", "ledger_full", "unknown_frees", "returns_unpaired",
            "filtered", "blocks_unsent", "usdt_unreadable", "ledger_replaced", "stack_walks",
            "stack_windows", "stack_frame_reads", "stack_walker_missing", "stack_walks_preempted",
            "totals_full", "blocks_sampled", "blocks_not_sampled", "blocks_quiet", "share_full",
            "sizes_clamped", "devices_clamped", "stack_thread_lists", "share_uids_full", "hook_entries_lost")
CONFIG_FILTER_ENABLED = 0
CONFIG_BLOCK_EVENTS_PER_SECOND = 1
CONFIG_PROCESS_GENERATION = 2
CONFIG_BLOCK_SAMPLE_BYTES = 3
CONFIG_QUIET_BLOCKS = 4

BLOCK_SAMPLE_DRAWS = 1024  # KVT_BLOCK_SAMPLE_DRAWS (probes/usdt.h): quantiles of the exponential

DEFAULT_MAX_TOTALS = 16384  # keys of ledger_totals (KVT_MAX_TOTALS); kvtrace agent --max-totals

USDT_MAX_ARGS = 4
USDT_ARG_NONE, USDT_ARG_CONSTANT, USDT_ARG_REGISTER, USDT_ARG_MEMORY = 0, 1, 2, 3


class RawUsdtArg(ctypes.Structure):
    _fields_ = [
        ("displacement", ctypes.c_int64),
        ("reg_offset", ctypes.c_int16),
        ("kind", ctypes.c_uint8),
        ("size_bytes", ctypes.c_uint8),
        ("is_signed", ctypes.c_uint8),
        ("reserved", ctypes.c_uint8),
        ("reserved2", ctypes.c_uint16),
    ]


class RawUsdtSite(ctypes.Structure):
    _fields_ = [
        ("api", ctypes.c_uint16),
        ("batch", ctypes.c_uint16),
        ("arg_count", ctypes.c_uint32),
        ("args", RawUsdtArg * USDT_MAX_ARGS),
    ]

NOTIFY_EXEC = 1
NOTIFY_MMAP_EXEC = 2


PROGRAM = "kvtrace.bpf.c"
_OWN_INCLUDE = re.compile(r'^#include "([\w.]+)"[ \t]*$', re.MULTILINE)


def program_text(directory: Path | None = None) -> str:
    """The one compile unit: kvtrace.bpf.c with its own headers (`#include "x.h"` of a file in
    probes/) expanded in place, each once, between #line markers so that compiler messages name the
    right file and line.

    Why not let clang include them: bcc rewrites its map syntax (`ledger.lookup(&key)`) in the main
    file only, so code that uses a map must reach bcc as main-file text. Nothing is substituted:
    the text is the files', in order; what changes per host comes as -D flags (ProbeSettings).
    """
    directory = directory or probes_dir()
    expanded: set[str] = set()

    def expand(name: str) -> str:
        text = (directory / name).read_text()
        parts, position = [f'#line 1 "{name}"\n'], 0
        for match in _OWN_INCLUDE.finditer(text):
            header = match.group(1)
            if not (directory / header).is_file():
                continue  # a system or bcc header: clang finds it
            parts.append(text[position:match.start()])
            line_after = text.count("\n", 0, match.end()) + 2
            if header not in expanded:
                expanded.add(header)
                parts.append(expand(header))
            parts.append(f'\n#line {line_after} "{name}"\n')
            position = match.end() + 1
        parts.append(text[position:])
        return "".join(parts)

    return expand(PROGRAM)


def probes_dir() -> Path:
    """Where kvtrace.bpf.c and its headers are: $KVTRACE_PROBES_DIR, else the package's probes/
    (in a checkout a link to the top-level probes/, in a wheel a copy)."""
    override = os.environ.get("KVTRACE_PROBES_DIR")
    return Path(override) if override else Path(__file__).resolve().parents[2] / "probes"
