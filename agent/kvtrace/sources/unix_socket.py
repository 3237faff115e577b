"""The Unix sockets the agent opens to the processes it traces (the vLLM plugin's, the CUPTI tracers'): a
path checked before anything is touched, a stale socket told from a live one, and a socket bound so that
no one who may write in its directory can turn the agent's chmod onto another file."""
from __future__ import annotations

import errno
import logging
import os
import shutil
import socket
import stat
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

SOCKET_PATH_MAX_BYTES = 107  # sun_path is 108 bytes with the terminating NUL
# struct ucred: pid, uid, gid (SO_PEERCRED, SCM_CREDENTIALS). servers/api/peers.py keeps its own copy: the
# servers import no source (tests/unit/test_import_layers.py).
UCRED = struct.Struct("iII")


class ListenerSetupError(Exception):
    """The socket cannot be bound; the message is one line that names the fix."""


def check_socket_path(path: str, flag: str, finder: str, owner: str) -> None:
    """Refuses, with one line, a path that could never be bound or would replace something else: not UTF-8,
    relative, too long for a Unix socket, or an existing directory or file that is not a socket. `finder`
    says who finds the socket by name ("the plugin finds"), `owner` who would replace it ("the agent")."""
    try:
        size_bytes = len(path.encode("utf-8"))
    except UnicodeEncodeError:  # bytes from argv that are not UTF-8
        raise ListenerSetupError(f"{flag}: the socket path {path!r} is not UTF-8 text") from None
    if not os.path.isabs(path):
        raise ListenerSetupError(f"{flag}: give an absolute path ({finder} it by name), not {path!r}")
    if size_bytes > SOCKET_PATH_MAX_BYTES:
        raise ListenerSetupError(f"{flag}: the socket path is {size_bytes} bytes; a Unix socket's may have at "
                                 f"most {SOCKET_PATH_MAX_BYTES}: choose a shorter one")
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return  # nothing there yet, or out of reach: binding says which
    if not stat.S_ISSOCK(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "a file that is not a socket"
        raise ListenerSetupError(f"{flag} {path} is {kind}; {owner} will not replace it (move it away, or "
                                 f"choose another {flag})")


def bind_socket(path: str, kind: int, socket_mode: int, directory_mode: int, flag: str, what: str,
                configure: Callable[[socket.socket], None] = lambda sock: None,
                backlog: int = 0, off_hint: bool = True) -> tuple[socket.socket, int]:
    """A socket of `kind` (SOCK_STREAM listening with `backlog`, or SOCK_DGRAM) bound at `path` with
    `socket_mode`, and the inode of its file (closing removes only that one: `remove_own`). The directory is
    made with `directory_mode` if missing; a stale socket there is removed, a live one refused. `what` names
    the socket in errors ("the vLLM plugin's socket"); `configure` sets options before the bind; `off_hint`:
    the error may suggest `FLAG off`."""
    target = Path(path)
    directory = target.parent
    if not directory.exists():
        # Only a directory we create gets our mode: never chmod an existing one (it may be /tmp).
        try:
            directory.mkdir(parents=True, mode=directory_mode)
            os.chmod(directory, directory_mode)
        except OSError as error:
            raise ListenerSetupError(f"cannot create {directory} for {what}: {error.strerror} (run the agent as "
                                     f"root, or choose another {flag})") from None
    if os.path.lexists(target):
        _remove_stale(target, kind, flag)
    sock = socket.socket(socket.AF_UNIX, kind | socket.SOCK_CLOEXEC)
    private = None
    try:
        configure(sock)
        # Bound and given its mode in a directory of our own, then renamed into place: in the shared
        # directory itself, someone who may write there could swap the new file for a symlink between
        # bind and chmod, and the agent (root) would chmod the link's target.
        private = tempfile.mkdtemp(prefix=".k", dir=directory)  # short: a socket path has 107 bytes
        staged = os.path.join(private, "s")
        sock.bind(staged)
        os.chmod(staged, socket_mode)
        if kind == socket.SOCK_STREAM:
            sock.listen(backlog)
        os.rename(staged, path)
        inode = os.lstat(path).st_ino
    except OSError as error:
        sock.close()
        off = f", or {flag} off" if off_hint else ""
        raise ListenerSetupError(f"cannot bind {target}: {error.strerror} (choose another {flag}{off})") from None
    finally:
        if private is not None:
            shutil.rmtree(private, ignore_errors=True)
    return sock, inode


def _remove_stale(path: Path, kind: int, flag: str) -> None:
    """A socket file nothing is bound to any more (an agent that died) goes; a live one is refused."""
    with socket.socket(socket.AF_UNIX, kind) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except OSError as error:
            if error.errno not in (errno.ECONNREFUSED, errno.ENOENT):
                raise ListenerSetupError(f"cannot tell whether {path} is in use: {error.strerror}") from None
        else:
            verb = "listens on" if kind == socket.SOCK_STREAM else "is bound to"
            raise ListenerSetupError(f"another process {verb} {path} (is another agent running? stop it, or "
                                     f"choose another {flag})")
    log.info("removing stale socket %s", path)
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as error:
        raise ListenerSetupError(f"cannot remove the stale socket {path}: {error.strerror}") from None


def remove_own(path: str, inode: int) -> None:
    """Removes the socket file at `path` if it is still the one bound (`inode`), not a successor's."""
    try:
        if os.lstat(path).st_ino == inode:
            os.unlink(path)
    except OSError:
        pass


def unsearchable_directory(path: str) -> tuple[Path, int] | None:
    """The first directory on the way to `path` that others may not search, with its mode: processes of
    users other than root and its group cannot reach the socket. None when they can."""
    directory = Path(path).parent
    for part in (directory, *directory.parents):
        try:
            mode = os.stat(part).st_mode
        except OSError:
            continue
        if not mode & stat.S_IXOTH:
            return part, stat.S_IMODE(mode)
    return None
