"""links.repair_bcc_attach_uprobe against a stand-in for bcc's libbcc (no bcc or root needed)."""
from __future__ import annotations

import ctypes
import sys
import types

from kvtrace.sources.bpf import links

SIX = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulonglong, ctypes.c_int]


class _Function:
    def __init__(self, calls: list, argtypes=None) -> None:
        self.calls, self.argtypes, self.restype = calls, argtypes, None

    def __call__(self, *args):
        self.calls.append((args, list(self.argtypes)))
        return 7


class _Library:
    """Like ctypes.CDLL: attribute access gives the declared function; lib[name] a new one."""

    def __init__(self, argtypes) -> None:
        self.calls: list = []
        self.bpf_attach_uprobe = _Function(self.calls, argtypes)

    def __getitem__(self, name: str) -> _Function:
        return _Function(self.calls)


def _with_libbcc(monkeypatch, argtypes) -> _Library:
    library = _Library(argtypes)
    bcc = types.ModuleType("bcc")
    bcc.libbcc = types.SimpleNamespace(lib=library)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "bcc", bcc)
    return library


def test_bccs_six_argument_declaration_is_called_with_a_seventh_zero(monkeypatch):
    library = _with_libbcc(monkeypatch, SIX)
    assert links.repair_bcc_attach_uprobe() is True
    assert links.repair_bcc_attach_uprobe() is False  # once
    assert library.bpf_attach_uprobe(3, 0, b"ev", b"/lib/x.so", 0x1149, -1) == 7
    (args, argtypes), = library.calls
    assert args == (3, 0, b"ev", b"/lib/x.so", 0x1149, -1, 0)  # ref_ctr_offset 0: no semaphore
    assert argtypes == [*SIX, ctypes.c_uint32]


def test_a_bcc_that_declares_seven_arguments_is_left_alone(monkeypatch):
    library = _with_libbcc(monkeypatch, [*SIX, ctypes.c_uint32])
    declared = library.bpf_attach_uprobe
    assert links.repair_bcc_attach_uprobe() is False
    assert library.bpf_attach_uprobe is declared
