"""Native return addresses as (module, symbol, offset): the code that called a CUDA API.

From /proc/PID/maps (procfs) and the modules' ELF symbol tables (elf: .symtab where not stripped,
else .dynsym), cached per file (device, inode).
"""
from __future__ import annotations

import bisect
from pathlib import Path

from kvtrace.model.stacks import NativeFrame
from kvtrace.sources import procfs
from kvtrace.sources.elf import READ_ERRORS, SymbolTable, load_symbol_table


class _MapsIndex:
    """A process's mappings with their start addresses, for bisection."""

    __slots__ = ("mappings", "starts")

    def __init__(self, mappings: list[procfs.Mapping]) -> None:
        self.mappings = mappings
        self.starts = [mapping.start for mapping in mappings]

    def at(self, address: int) -> procfs.Mapping | None:
        position = bisect.bisect_right(self.starts, address) - 1
        if position >= 0 and address < self.mappings[position].end:
            return self.mappings[position]
        return None


class NativeSymbolizer:
    """A process's maps are cached and read again when an address is in none of them, or in an anonymous
    one (a library loaded since); call `forget(pid)` when it exits or execs."""

    def __init__(self, proc: Path = procfs.PROC) -> None:
        self._proc = proc
        self._maps: dict[int, _MapsIndex] = {}
        self._tables: dict[tuple[int, int], SymbolTable | None] = {}

    def symbolize(self, pid: int, address: int) -> NativeFrame:
        mapping = self._find_mapping(pid, address)
        if mapping is None:
            return NativeFrame("", "", address)
        file_offset = address - mapping.start + mapping.file_offset
        if mapping.inode == 0:
            return NativeFrame(mapping.path, "", address - mapping.start)
        table = self._symbol_table(pid, mapping)
        if table is None:  # unreadable or not ELF: the file offset is the best we can say
            return NativeFrame(mapping.path, "", file_offset)
        vaddr = table.virtual_address(file_offset)
        found = table.lookup(vaddr)
        if found is None:
            return NativeFrame(mapping.path, "", vaddr)
        symbol, offset = found
        return NativeFrame(mapping.path, symbol, offset)

    def forget(self, pid: int) -> None:
        self._maps.pop(pid, None)

    def _find_mapping(self, pid: int, address: int) -> procfs.Mapping | None:
        cached = self._maps.get(pid)
        mapping = cached.at(address) if cached is not None else None
        # In no cached mapping, or in an anonymous one: a library loaded since may lie there now (the loader
        # reuses address space that was reserved or freed), so the maps are read again.
        if mapping is None or mapping.inode == 0:
            fresh = self._maps[pid] = _MapsIndex(procfs.read_maps(pid, self._proc))
            mapping = fresh.at(address)
        return mapping

    def _symbol_table(self, pid: int, mapping: procfs.Mapping) -> SymbolTable | None:
        key = (mapping.device, mapping.inode)
        if key not in self._tables:
            self._tables[key] = self._load(pid, mapping)
        return self._tables[key]

    def _load(self, pid: int, mapping: procfs.Mapping) -> SymbolTable | None:
        # map_files reaches the very file mapped, also in another mount namespace (containers)
        # or deleted since; the path as seen from the process's root is the fallback.
        for candidate in (procfs.mapped_file(pid, mapping, self._proc),
                          procfs.path_in_root(pid, mapping.path, self._proc)):
            try:
                with open(candidate, "rb") as file:
                    return load_symbol_table(file)
            except READ_ERRORS:
                continue
        return None
