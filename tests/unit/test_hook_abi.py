"""kvtrace's PyTorch hook and its readers agree on their shared shapes: hook.cpp (inside the engine), probes/hook.h
(the kernel), kvtrace/sources/torch_hook (the engine's Python side), sources/bpf/hook_settings.py (the agent) and the
benches' prototype program each write the batch size, the entry, the settings and the states down; one changed alone
would make the kernel read garbage or the agent write the wrong field."""
from __future__ import annotations

import ctypes
import re
from pathlib import Path

from kvtrace.sources import torch_hook
from kvtrace.sources.bpf import hook_settings

ROOT = Path(__file__).resolve().parents[2]
HOOK_CPP = (ROOT / "agent" / "kvtrace" / "sources" / "torch_hook" / "hook.cpp").read_text()
HOOK_H = (ROOT / "probes" / "hook.h").read_text()
TAIL_CALLS_MAX = 33  # the kernel's MAX_TAIL_CALL_CNT: a batch's entries and the stack walker's one


def _fields(text: str, struct: str) -> list[tuple[str, str]]:
    """(type, name) of each member of `struct NAME { ... };` in C or C++ text, arrays as name[N]."""
    body = re.search(rf"struct {struct} \{{(.*?)\n\}};", text, re.S)
    assert body, f"struct {struct} not found"
    members = []
    for line in body.group(1).splitlines():
        code = line.split("//")[0].split("/*")[0].strip()
        if code:
            kind, name = code.rstrip(";").rsplit(" ", 1)
            members.append((kind.strip(), name.strip()))
    return members


def test_one_batch_size_everywhere_and_within_the_tail_call_limit():
    cpp = int(re.search(r"KVTRACE_HOOK_BATCH_MAX = (\d+)", HOOK_CPP).group(1))
    kernel = int(re.search(r"#define KVT_HOOK_BATCH (\d+)", HOOK_H).group(1))
    bench = int(re.search(r"#define BATCH_MAX (\d+)", (ROOT / "bench" / "benchlib.py").read_text()).group(1))
    assert cpp == kernel == torch_hook.BATCH_MAX == hook_settings.BATCH_MAX == bench
    assert kernel + 1 <= TAIL_CALLS_MAX


def test_the_entry_is_the_same_32_bytes_on_both_sides():
    sizes = {"uint64_t": 8, "u64": 8, "uint8_t": 1, "u8": 1, "int8_t": 1, "s8": 1}
    cpp = _fields(HOOK_CPP, "kvtrace_hook_entry")
    kernel = _fields(HOOK_H, "kvt_hook_entry")
    assert [name for _, name in cpp] == [name for _, name in kernel]
    assert [sizes[kind] for kind, _ in cpp] == [sizes[kind] for kind, _ in kernel]
    assert sum(sizes[kind] * (int(re.search(r"\[(\d+)\]", name).group(1)) if "[" in name else 1)
               for kind, name in cpp) == 32


def test_the_settings_and_states_the_agent_reads_are_the_hooks():
    cpp = _fields(HOOK_CPP, "kvtrace_hook_settings")
    sizes = {"uint64_t": 8, "uint32_t": 4}
    for python in (torch_hook.HookSettings, hook_settings.HookSettings):
        assert [name for name, _ in python._fields_] == [name for _, name in cpp]
        assert [ctypes.sizeof(kind) for _, kind in python._fields_] == [sizes[kind] for kind, _ in cpp]
    enum = re.search(r"enum \{ (KVTRACE_HOOK_LOADED[^}]*)\}", HOOK_CPP)
    assert enum, "the state enum"
    states = dict(re.findall(r"KVTRACE_HOOK_([A-Z]+) = (\d+)", enum.group(1)))
    assert {name: int(value) for name, value in states.items()} == {state.name: state.value
                                                                   for state in hook_settings.HookState}


def test_the_kinds_of_an_entry_are_the_same_numbers():
    cpp = dict(re.findall(r"KVTRACE_HOOK_(ALLOC|FREE) = (\d+)", HOOK_CPP))
    kernel = dict(re.findall(r"#define KVT_HOOK_(ALLOC|FREE) +(\d+)", HOOK_H))
    assert cpp == kernel == {"ALLOC": "1", "FREE": "2"}
    assert torch_hook.SETTINGS_SYMBOL == hook_settings.SETTINGS_SYMBOL
    assert f"kvtrace_hook_settings {hook_settings.SETTINGS_SYMBOL}" in HOOK_CPP
    assert f"char {hook_settings.STATE_SYMBOL} " in HOOK_CPP
