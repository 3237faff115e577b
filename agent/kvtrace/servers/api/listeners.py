"""Where the server listens, made safe before it opens: the Unix sockets and the TLS credentials.

A socket's path is checked and cleared (a stale socket only: anything else, or a live agent on it,
stops the start), its directory is made with our mode, its group looked up; TCP gets mutual TLS
credentials whose files are loaded here, so that a bad one stops the start. Each refusal is a
ServerSetupError with one line for the operator. Apart from server.py because these steps touch
the file system, the group database and the TLS files, never a grpc.Server: server.py calls them
before it opens a port.
"""
from __future__ import annotations

import errno
import grp
import logging
import os
import pwd
import socket
import ssl
import stat
from pathlib import Path

import grpc

from kvtrace.config import ApiConfig

log = logging.getLogger(__name__)

SOCKET_PATH_MAX_BYTES = 107  # sun_path is 108 bytes with the terminating NUL
SOCKET_MODE = 0o660
ADMIN_SOCKET_MODE = 0o600  # root only, unless an admin group is given (then SOCKET_MODE)
SOCKET_DIRECTORY_MODE = 0o750


class ServerSetupError(Exception):
    """The server cannot start safely. The message is one line for the operator."""


def socket_group_id(group: str) -> int:
    """The gid for the socket; root's group, with a warning, if the group does not exist."""
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        root_gid = pwd.getpwuid(0).pw_gid
        log.warning("group %r does not exist: the API socket gets root's group (gid %d), so only "
                    "root can use it; create the group with `groupadd --system %s`", group, root_gid, group)
        return root_gid


def _listener_on(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except OSError as error:
            if error.errno in (errno.ECONNREFUSED, errno.ENOENT):
                return False
            raise ServerSetupError(f"cannot tell whether {path} is in use: {error.strerror}") from None
        return True


def prepare_socket_path(path: Path, gid: int) -> None:
    """Makes the socket's directory if missing, and clears a stale socket; refuses anything else."""
    if len(os.fsencode(path)) > SOCKET_PATH_MAX_BYTES:
        raise ServerSetupError(f"socket path {path} is longer than {SOCKET_PATH_MAX_BYTES} bytes")
    directory = path.parent
    if not directory.exists():
        # Only a directory we create gets our mode: never chmod an existing one (it may be /tmp).
        try:
            directory.mkdir(parents=True, mode=SOCKET_DIRECTORY_MODE)
            os.chown(directory, -1, gid)
            os.chmod(directory, SOCKET_DIRECTORY_MODE)
        except OSError as error:
            raise ServerSetupError(f"cannot create {directory} (mode 0750, gid {gid}): {error.strerror}") from None
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ServerSetupError(f"{path} exists and is not a socket; refusing to replace it "
                               "(move it away, or choose another --socket)")
    if _listener_on(path):
        raise ServerSetupError(f"another process is already serving on {path} (is an agent running?)")
    log.info("removing stale socket %s", path)
    path.unlink()


def _secure_port_credentials(config: ApiConfig) -> grpc.ServerCredentials:
    """Mutual TLS credentials; the files are checked here so that a bad one stops the start."""
    contents = {}
    files: dict[str, Path] = {}
    for name in ("tls_cert", "tls_key", "tls_client_ca"):
        file = getattr(config, name)
        try:
            contents[name] = file.read_bytes()
        except (OSError, AttributeError) as error:
            raise ServerSetupError(f"cannot read {name} {file}: {getattr(error, 'strerror', error)}") from None
        files[name] = file
    try:
        check = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        check.load_cert_chain(files["tls_cert"], files["tls_key"])
        check.load_verify_locations(cafile=files["tls_client_ca"])
    except (ssl.SSLError, ValueError) as error:
        raise ServerSetupError(f"the TLS files do not load ({config.tls_cert}, {config.tls_key}, "
                               f"{config.tls_client_ca}): {error}") from None
    return grpc.ssl_server_credentials([(contents["tls_key"], contents["tls_cert"])],
                                       root_certificates=contents["tls_client_ca"],
                                       require_client_auth=True)
