"""/proc: the one module that reads other processes — their mappings, memory, root, title,
environment and status. Everything else asks here.

Every function takes `proc` so tests can point it at a fake tree, and treats a process that is gone
(or exec'd, or out of reach) as a normal answer (`[]`, None), never an exception, except where a
caller must tell "gone" from "empty" (`ProcessMemory` raises MemoryReadError).
"""
from __future__ import annotations

import ipaddress
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil

from kvtrace.model.processes import ProcessInfo, clean_title, container_id, valid_text

PROC = Path("/proc")

# x86_64 user space ends below 2**47 (4-level paging) or 2**56 (5-level); anything above is a
# kernel address or garbage, and /proc/PID/mem offsets are signed.
USER_ADDRESS_LIMIT = 1 << 56

_DELETED = " (deleted)"


@dataclass(frozen=True, slots=True)
class Mapping:
    """One line of /proc/PID/maps."""

    start: int
    end: int
    perms: str  # "r-xp"
    file_offset: int
    device: int  # os.makedev(major, minor): with `inode`, the file as the kernel knows it
    inode: int  # 0: not backed by a file ([heap], [vdso], anonymous)
    path: str  # as the process sees it; " (deleted)" removed (see `deleted`)
    deleted: bool = False

    @property
    def executable(self) -> bool:
        return "x" in self.perms


def read_maps(pid: int, proc: Path = PROC, executable_only: bool = False) -> list[Mapping]:
    """The process's mappings in address order (only those that may execute, where asked: the rest go
    unparsed); [] if it is gone or unreadable."""
    try:
        text = (proc / str(pid) / "maps").read_text(errors="surrogateescape")
    except OSError:
        return []
    mappings = []
    for line in text.splitlines():
        # start-end perms offset major:minor inode [path, which may contain spaces]
        if executable_only:
            perms = line.find(" ") + 1
            if line[perms + 2:perms + 3] != "x":
                continue
        parts = line.split(maxsplit=5)
        if len(parts) < 5:
            continue
        try:
            start, end = (int(value, 16) for value in parts[0].split("-"))
            major, minor = (int(value, 16) for value in parts[3].split(":"))
            offset, inode = int(parts[2], 16), int(parts[4])
            device = os.makedev(major, minor)
        except (ValueError, OverflowError):  # OverflowError: a device number beyond 32 bits
            continue
        path = parts[5] if len(parts) > 5 else ""
        deleted = path.endswith(_DELETED)
        mappings.append(Mapping(start, end, parts[1], offset, device, inode,
                                path.removesuffix(_DELETED), deleted))
    return mappings


def path_in_root(pid: int, path: str, proc: Path = PROC) -> Path:
    """`path` as the process sees it, opened from here: through its root, so files inside a
    container (another mount namespace) resolve from the host."""
    return proc / str(pid) / "root" / path.lstrip("/")


def mapped_file(pid: int, mapping: Mapping, proc: Path = PROC) -> Path:
    """The very file behind a mapping, also when deleted since or in another mount namespace."""
    return proc / str(pid) / "map_files" / f"{mapping.start:x}-{mapping.end:x}"


def executable_path(pid: int, proc: Path = PROC) -> str | None:
    """The executable as the process names it (/proc/PID/exe), None if gone."""
    try:
        return os.readlink(proc / str(pid) / "exe")
    except OSError:
        return None


def status_field(pid: int | str, field: str, proc: Path = PROC) -> str | None:
    """One field of /proc/PID/status ("Seccomp" -> "2"; pid "self" for this process); None if
    gone or absent."""
    try:
        # Not strict UTF-8: Name is the comm, which a process sets to any bytes (PR_SET_NAME).
        text = (proc / str(pid) / "status").read_text(errors="surrogateescape")
    except OSError:
        return None
    match = re.search(rf"^{re.escape(field)}:\s*(\S+)", text, re.MULTILINE)
    return match.group(1) if match else None


def environ_value(pid: int, name: str) -> str | None:
    """An environment variable as the process was started with (/proc/PID/environ); None when
    unset or unreadable. A value set later inside the process is not visible here."""
    try:
        return psutil.Process(pid).environ().get(name)
    except (psutil.Error, OSError):
        return None


_GPU_DEVICE_FILE = re.compile(r"nvidia\d+")


def gpu_device_count(pid: int, proc: Path = PROC) -> int | None:
    """The NVIDIA GPUs the process can open: /dev/nvidiaN as its root shows them (a container sees
    the GPUs it was given); None when that cannot be read."""
    try:
        return sum(1 for name in os.listdir(path_in_root(pid, "/dev", proc)) if _GPU_DEVICE_FILE.fullmatch(name))
    except OSError:
        return None


def read_process(pid: int, proc: Path = PROC) -> ProcessInfo | None:
    """Title, comm, container and start time of a process; None if it is gone."""
    try:
        process = psutil.Process(pid)
        with process.oneshot():
            cmdline = process.cmdline()
            comm = process.name()
            start_time = process.create_time()
            parent_pid = process.ppid()
    except (psutil.Error, OSError):
        return None
    try:
        cgroup = (proc / str(pid) / "cgroup").read_text(errors="surrogateescape")
    except OSError:
        cgroup = ""
    # setproctitle may leave one argv element holding the whole title, padded with NULs/spaces.
    comm = valid_text(comm)
    title = clean_title(" ".join(part for part in cmdline if part).strip() or comm)
    return ProcessInfo(pid, title, comm, container_id(cgroup), valid_text(cgroup.strip().split(":")[-1]),
                       start_time, time.monotonic(), parent_pid)


class MemoryReadError(Exception):
    """Another process's memory could not be read: unmapped, the process is gone (or exec'd, and
    the file was opened for its old image), or no permission."""


class ProcessMemory:
    """Reads another process's memory with pread on /proc/PID/mem, opened once.

    The open file stays bound to the address space the process had when it was opened: after the
    process exits or execs, reads fail (they never read the new image or a new process that got
    the same pid), so open a new ProcessMemory after an exec.
    """

    def __init__(self, pid: int, proc: Path = PROC) -> None:
        self.pid = pid
        path = proc / str(pid) / "mem"
        try:
            self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as error:
            raise MemoryReadError(f"cannot open {path}: {error.strerror}") from error

    def read(self, address: int, size: int) -> bytes:
        if not 0 < address < USER_ADDRESS_LIMIT - size or size < 0:
            raise MemoryReadError(f"pid {self.pid}: bad address {address:#x} (+{size} bytes)")
        try:
            data = os.pread(self._fd, size, address)
        except OSError as error:
            raise MemoryReadError(
                f"pid {self.pid}: cannot read {size} bytes at {address:#x}: {error.strerror}"
            ) from error
        if len(data) != size:
            # The kernel returns 0 bytes once the address space is gone.
            raise MemoryReadError(f"pid {self.pid}: read {len(data)} of {size} bytes at "
                                  f"{address:#x} (process exited or exec'd)")
        return data

    def read_u64(self, address: int) -> int:
        return int.from_bytes(self.read(address, 8), "little")

    def read_i64(self, address: int) -> int:
        return int.from_bytes(self.read(address, 8), "little", signed=True)

    def read_u32(self, address: int) -> int:
        return int.from_bytes(self.read(address, 4), "little")

    def read_i32(self, address: int) -> int:
        return int.from_bytes(self.read(address, 4), "little", signed=True)

    def read_u8(self, address: int) -> int:
        return self.read(address, 1)[0]

    def read_cstring(self, address: int, limit: int = 64) -> str:
        return self.read(address, limit).split(b"\0", 1)[0].decode("ascii", "replace")

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> ProcessMemory:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def write_memory(pid: int, address: int, data: bytes, proc: Path = PROC) -> None:
    """Writes `data` into another process's memory (/proc/PID/mem, root): the one place kvtrace writes into a
    traced process, for the settings of its own PyTorch hook (sources/bpf/hook_settings.py), which checks what it
    overwrites first. Raises MemoryReadError (the same reasons as a read)."""
    if not 0 < address < USER_ADDRESS_LIMIT - len(data):
        raise MemoryReadError(f"pid {pid}: bad address {address:#x} (+{len(data)} bytes)")
    path = proc / str(pid) / "mem"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    except OSError as error:
        raise MemoryReadError(f"cannot open {path} to write: {error.strerror}") from error
    try:
        written = os.pwrite(fd, data, address)
    except OSError as error:
        raise MemoryReadError(f"pid {pid}: cannot write {len(data)} bytes at {address:#x}: {error.strerror}") \
            from error
    finally:
        os.close(fd)
    if written != len(data):
        raise MemoryReadError(f"pid {pid}: wrote {written} of {len(data)} bytes at {address:#x}")


# ---- processes' identity, command lines, sockets (discovery of vLLM's API servers) ----

_TCP_LISTEN = "0A"  # the state column of /proc/net/tcp{,6}


def read_argv(pid: int, proc: Path = PROC) -> list[str]:
    """The process's command line as it is now ([] when gone); a setproctitle title is one element."""
    try:
        raw = (proc / str(pid) / "cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode("utf-8", "replace") for part in raw.rstrip(b"\0").split(b"\0")] if raw else []


def net_namespace(pid: int | str, proc: Path = PROC) -> str | None:
    """The process's network namespace ("net:[4026531840]"); None when it cannot be read."""
    try:
        return os.readlink(proc / str(pid) / "ns" / "net")
    except OSError:
        return None


def start_ticks(pid: int, proc: Path = PROC) -> int | None:
    """The process's start time in clock ticks (/proc/PID/stat field 22): with the pid, its identity."""
    try:
        text = (proc / str(pid) / "stat").read_text(errors="replace")
        return int(text[text.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def socket_inodes(pid: int, proc: Path = PROC) -> set[int]:
    """Inodes of the sockets among the process's descriptors. OSError when /proc/PID/fd cannot be read."""
    directory = proc / str(pid) / "fd"
    inodes = set()
    for name in os.listdir(directory):
        try:
            target = os.readlink(directory / name)
        except OSError:
            continue  # closed since
        if target.startswith("socket:[") and target.endswith("]"):
            try:
                inodes.add(int(target[8:-1]))
            except ValueError:
                pass
    return inodes


def _tcp_address(hex_address: str) -> str:
    """An address of /proc/net/tcp{,6} (32-bit words in host order, i.e. little-endian) as text."""
    raw = bytes.fromhex(hex_address)
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(raw)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address)


def tcp_listeners(net: Path) -> Iterator[tuple[str, int, int]]:
    """(address, port, inode) of each TCP socket in LISTEN state in one network namespace's tables (`net`:
    /proc/PID/net for that process's namespace, /proc/net for the agent's own)."""
    for table in ("tcp", "tcp6"):
        try:
            lines = (net / table).read_text(errors="replace").splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            # sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid timeout inode ...
            fields = line.split()
            if len(fields) < 10 or fields[3] != _TCP_LISTEN:
                continue
            try:
                hex_address, hex_port = fields[1].split(":")
                listener = (_tcp_address(hex_address), int(hex_port, 16), int(fields[9]))
            except ValueError:
                continue
            yield listener
