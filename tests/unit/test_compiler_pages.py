"""The compiler's code let go of once the probes are compiled (issue 31: the idle agent's RSS): GIVEN a library's
code mapped and read in, THEN return_compiler_pages unmaps its pages (its RSS drops) and a later read finds the same
bytes (read in again from the file); a mapping with pages of its own, or of another library, is left alone."""
import ctypes
import mmap
import os

import pytest

from kvtrace.sources.bpf.loader import return_compiler_pages

SIZE = 64 * mmap.PAGESIZE


def resident_kib(path) -> int:
    """Rss of this process's mapping of `path`, from /proc/self/smaps."""
    found = False
    with open("/proc/self/smaps") as lines:
        for line in lines:
            parts = line.split()
            if len(parts) >= 5 and "-" in parts[0] and not parts[0].endswith(":"):
                found = parts[-1] == str(path)
            elif found and parts[0] == "Rss:":
                return int(parts[1])
    raise AssertionError(f"{path} is not mapped")


def start_of(path) -> int:
    with open("/proc/self/maps") as lines:
        for line in lines:
            parts = line.split()
            if parts[-1] == str(path):
                return int(parts[0].split("-")[0], 16)
    raise AssertionError(f"{path} is not mapped")


def mapped(path, data: bytes, prot: int) -> mmap.mmap:
    path.write_bytes(data)
    with open(path, "r+b") as file:
        try:
            return mmap.mmap(file.fileno(), len(data), flags=mmap.MAP_PRIVATE, prot=prot)
        except PermissionError:
            pytest.skip(f"{path.parent} cannot be mapped executable here (noexec)")


def test_the_compilers_code_is_let_go_of_and_reads_back_the_same(tmp_path):
    data = os.urandom(SIZE)
    code = mapped(tmp_path / "libLLVM-99.so.1", data, mmap.PROT_READ | mmap.PROT_EXEC)
    own = mapped(tmp_path / "libclang-cpp.so.99", data, mmap.PROT_READ | mmap.PROT_WRITE)  # copied on write below
    other = mapped(tmp_path / "libother.so.1", data, mmap.PROT_READ | mmap.PROT_EXEC)
    own[:4] = b"mine"  # a page copied on write; then code again (r-xp), as a relocated text page would be
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    assert libc.mprotect(start_of(tmp_path / "libclang-cpp.so.99"), SIZE, mmap.PROT_READ | mmap.PROT_EXEC) == 0
    assert code[:] == data and own[4:] == data[4:] and other[:] == data  # every page read in
    assert resident_kib(tmp_path / "libLLVM-99.so.1") == SIZE >> 10

    returned = return_compiler_pages()

    assert returned >= SIZE
    assert resident_kib(tmp_path / "libLLVM-99.so.1") == 0
    assert resident_kib(tmp_path / "libclang-cpp.so.99") == SIZE >> 10
    assert resident_kib(tmp_path / "libother.so.1") == SIZE >> 10
    assert code[:] == data and own[:4] == b"mine" and own[4:] == data[4:]
    for region in (code, own, other):
        region.close()
