"""Configuration of the agent's API endpoints.

Each setting comes from the first place that sets it: command-line flag, then environment
variable, then the [api] table of /etc/kvtrace/kvtrace.toml, then the default:

    [api]
    socket = "/run/kvtrace/kvtrace.sock"   # KVTRACE_SOCKET, --socket
    group = "kvtrace"                      # KVTRACE_GROUP, --group: who may connect to the socket
    admin_socket = "/run/kvtrace/kvtrace-admin.sock" # KVTRACE_ADMIN_SOCKET, --admin-socket; "off": none
    admin_group = ""                       # KVTRACE_ADMIN_GROUP, --admin-group: "" = root only (0600)
    tcp_listen = "0.0.0.0:7443"            # KVTRACE_TCP_LISTEN, --tcp-listen: off unless set
    tls_cert = "/etc/kvtrace/tls/server.crt"       # KVTRACE_TLS_CERT, --tls-cert
    tls_key = "/etc/kvtrace/tls/server.key"        # KVTRACE_TLS_KEY, --tls-key
    tls_client_ca = "/etc/kvtrace/tls/clients.crt" # KVTRACE_TLS_CLIENT_CA, --tls-client-ca

Who sees what: the socket serves the group a redacted view (titles with secrets redacted, no
stacks, no addresses); the admin socket serves full detail, to root only unless admin_group names a
group; its default is the socket's name with "-admin". TCP is served with mutual TLS only, so
tcp_listen needs all three TLS files; it serves full detail (a client certificate is a credential). Other tables of the
file belong to other components and are not read here.
"""
from __future__ import annotations

import argparse
import os
import stat
import sys
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - python 3.10
    import tomli as tomllib

DEFAULT_CONFIG_PATH = Path("/etc/kvtrace/kvtrace.toml")
DEFAULT_SOCKET = Path("/run/kvtrace/kvtrace.sock")
DEFAULT_GROUP = "kvtrace"
CONFIG_ENVIRONMENT = "KVTRACE_CONFIG"  # another config file than DEFAULT_CONFIG_PATH (--config)
MAX_CONFIG_BYTES = 1 << 20  # a config file is a few lines; /dev/zero is not one
SOCKET_PATH_MAX_BYTES = 107  # sun_path is 108 bytes with the terminating NUL

ENVIRONMENT = {
    "socket": "KVTRACE_SOCKET",
    "group": "KVTRACE_GROUP",
    "admin_socket": "KVTRACE_ADMIN_SOCKET",
    "admin_group": "KVTRACE_ADMIN_GROUP",
    "tcp_listen": "KVTRACE_TCP_LISTEN",
    "tls_cert": "KVTRACE_TLS_CERT",
    "tls_key": "KVTRACE_TLS_KEY",
    "tls_client_ca": "KVTRACE_TLS_CLIENT_CA",
}


class ConfigError(Exception):
    """A setting is wrong; the message names where it came from (file and key, variable or flag)."""


@dataclass(frozen=True)
class ApiConfig:
    """Where and how the agent serves kvtrace.v1. Field names are the TOML keys and flag names."""

    socket: Path = DEFAULT_SOCKET
    group: str = DEFAULT_GROUP
    # Full detail (stacks, addresses, full titles) as set: "" = next to the socket (admin_path),
    # "off" = none, else an absolute path.
    admin_socket: str = ""
    admin_group: str = ""  # "": root only (0600); a group: 0660 with that group
    tcp_listen: str = ""  # "host:port"; "" = no TCP listener
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None

    @property
    def admin_path(self) -> Path | None:
        """Where full detail is served; None when it is not."""
        if self.admin_socket == "off":
            return None
        return Path(self.admin_socket) if self.admin_socket else admin_socket_for(self.socket)

    @property
    def tcp_enabled(self) -> bool:
        return bool(self.tcp_listen)


def admin_socket_for(socket: Path) -> Path:
    """The admin socket next to `socket`: /run/kvtrace/kvtrace.sock -> kvtrace-admin.sock."""
    return socket.with_name(f"{socket.stem}-admin{socket.suffix}")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_socket_flag(parser: argparse.ArgumentParser) -> None:
    """The flags every client command takes."""
    parser.add_argument("--socket", metavar="PATH", type=Path,
                        help=f"the agent's Unix socket (default: ${ENVIRONMENT['socket']}, "
                             f"the config file, or {DEFAULT_SOCKET})")
    parser.add_argument("--config", metavar="FILE", type=Path,
                        help=f"the configuration file (default: ${CONFIG_ENVIRONMENT}, else {DEFAULT_CONFIG_PATH} "
                             "if it exists)")


def add_api_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of `kvtrace agent` that set where the API is served."""
    add_socket_flag(parser)
    parser.add_argument("--group", help=f"group allowed to use the socket (default: {DEFAULT_GROUP}); it "
                                         "sees titles with secrets redacted, no stacks and no addresses")
    parser.add_argument("--admin-socket", metavar="PATH|off",
                        help="socket serving full detail (stacks, addresses, full titles), root only unless "
                             "--admin-group (default: the socket's name with -admin, e.g. "
                             "/run/kvtrace/kvtrace-admin.sock; off: none)")
    parser.add_argument("--admin-group", metavar="GROUP",
                        help="group allowed full detail on the admin socket (default: none, so 0600 root: "
                             "root reads every /proc/PID anyway, so it learns nothing new there)")
    parser.add_argument("--tcp-listen", metavar="HOST:PORT",
                        help="also serve on TCP, with mutual TLS only (needs the three --tls-* files)")
    parser.add_argument("--tls-cert", metavar="PEM", type=Path, help="server certificate (chain) for TCP")
    parser.add_argument("--tls-key", metavar="PEM", type=Path, help="server private key for TCP")
    parser.add_argument("--tls-client-ca", metavar="PEM", type=Path,
                        help="CA that signs the client certificates accepted on TCP")


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str] = os.environ,
                     path: Path = DEFAULT_CONFIG_PATH) -> ApiConfig:
    """The configuration for a command whose parser has some of the flags above. A file named by
    --config or $KVTRACE_CONFIG must exist; the default one may be missing."""
    flags = {f.name: getattr(args, f.name, None) for f in fields(ApiConfig)}
    named = getattr(args, "config", None) or environ.get(CONFIG_ENVIRONMENT)
    if named:
        if not os.path.lexists(named):
            source = "--config" if getattr(args, "config", None) else CONFIG_ENVIRONMENT
            raise ConfigError(f"{source}: there is no file {named}")
        path = Path(named)
    return load_config(flags, environ, path)


def load_config(flags: Mapping[str, object] | None = None, environ: Mapping[str, str] = os.environ,
                path: Path = DEFAULT_CONFIG_PATH) -> ApiConfig:
    """Merges flags (None: not given) > environment > file > defaults, and checks the result."""
    flags = flags or {}
    from_file = _read_file(path)
    values, sources = {}, {}
    for name in (f.name for f in fields(ApiConfig)):
        if flags.get(name) is not None:
            values[name], sources[name] = str(flags[name]), _flag(name)
        elif environ.get(ENVIRONMENT[name]):
            values[name], sources[name] = environ[ENVIRONMENT[name]], ENVIRONMENT[name]
        elif name in from_file:
            values[name], sources[name] = from_file[name], f"{path}: [api] {name}"
    return _checked(values, sources)


def _read_file(path: Path) -> dict[str, str]:
    try:
        with open(path, "rb") as file:
            data = file.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        return {}
    except OSError as error:
        raise ConfigError(f"cannot read {path}: {error.strerror}") from error
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_CONFIG_BYTES >> 20} MiB: not a kvtrace config file")
    try:
        document = tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path}: not a TOML text file (byte {error.start} is not UTF-8)") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: not valid TOML: {error}") from None
    except RecursionError:  # arrays nested thousands deep
        raise ConfigError(f"{path}: not valid TOML: nested too deep") from None
    table = document.get("api", {})
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [api] must be a table")
    known = {f.name for f in fields(ApiConfig)}
    for key, value in table.items():
        if key not in known:
            raise ConfigError(f"{path}: [api] {key} is not a setting (known: {', '.join(sorted(known))})")
        if not isinstance(value, str):
            raise ConfigError(f"{path}: [api] {key} must be a string, not {type(value).__name__}")
    return table


def _checked(values: dict[str, str], sources: dict[str, str]) -> ApiConfig:
    socket = Path(values.get("socket", DEFAULT_SOCKET))
    if not socket.is_absolute():
        raise ConfigError(f"{sources['socket']}: the socket must be an absolute path, not {socket}")
    _check_socket_path(socket, sources.get("socket", "the default socket"))
    group = values.get("group", DEFAULT_GROUP)
    if not group:
        raise ConfigError(f"{sources['group']}: the group must not be empty")
    admin_socket = values.get("admin_socket", "")
    if admin_socket not in ("", "off"):
        if not Path(admin_socket).is_absolute():
            raise ConfigError(f"{sources['admin_socket']}: the admin socket must be an absolute path or off, "
                              f"not {admin_socket}")
        if Path(admin_socket) == socket:
            raise ConfigError(f"{sources['admin_socket']}: the admin socket must differ from the socket")
        _check_socket_path(Path(admin_socket), sources["admin_socket"])
    tcp_listen = values.get("tcp_listen", "")
    if tcp_listen:
        _check_listen_address(tcp_listen, sources["tcp_listen"])
        missing = [name for name in ("tls_cert", "tls_key", "tls_client_ca") if not values.get(name)]
        if missing:
            raise ConfigError(
                f"{sources['tcp_listen']}: TCP is served with mutual TLS only; also set "
                + ", ".join(f"{_flag(name)} (or {ENVIRONMENT[name]})" for name in missing))
    tls = {name: Path(values[name]) if values.get(name) else None
           for name in ("tls_cert", "tls_key", "tls_client_ca")}
    return ApiConfig(socket=socket, group=group, admin_socket=admin_socket,
                     admin_group=values.get("admin_group", ""), tcp_listen=tcp_listen, **tls)


def _check_socket_path(path: Path, source: str) -> None:
    """A path gRPC can listen on and connect to: UTF-8 text, short enough for sun_path."""
    try:
        size_bytes = len(str(path).encode("utf-8"))
    except UnicodeEncodeError:  # bytes from argv or the environment that are not UTF-8
        raise ConfigError(f"{source}: the socket path {str(path)!r} is not UTF-8 text") from None
    if size_bytes > SOCKET_PATH_MAX_BYTES:
        raise ConfigError(f"{source}: the socket path is {size_bytes} bytes; a Unix socket's may have at most "
                          f"{SOCKET_PATH_MAX_BYTES}: choose a shorter one")


def check_served_paths(config: ApiConfig) -> ApiConfig:
    """For the agent, before it loads anything: each socket path holds nothing or a socket (the
    server never replaces anything else), and with TCP each TLS file can be read. Raises ConfigError."""
    for flag, path in (("--socket", config.socket), ("--admin-socket", config.admin_path)):
        try:
            mode = os.lstat(path).st_mode if path is not None else None
        except OSError:
            mode = None  # nothing there yet, or out of reach: the server says which when it starts
        if mode is not None and not stat.S_ISSOCK(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else "a file that is not a socket"
            raise ConfigError(f"{flag} {path} is {kind}; the agent will not replace it (move it away, or "
                              f"choose another {flag})")
    if config.tcp_enabled:
        for name in ("tls_cert", "tls_key", "tls_client_ca"):
            path = getattr(config, name)
            try:
                mode = os.stat(path).st_mode
            except OSError as error:
                raise ConfigError(f"{_flag(name)}: cannot read {path}: {error.strerror}") from None
            if not stat.S_ISREG(mode):
                raise ConfigError(f"{_flag(name)} {path} is not a file: give the PEM file")
            if not os.access(path, os.R_OK):
                raise ConfigError(f"{_flag(name)}: cannot read {path}: permission denied")
    return config


def _check_listen_address(address: str, source: str) -> None:
    host, separator, port = address.rpartition(":")
    if not separator or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{source}: expected HOST:PORT (e.g. 0.0.0.0:7443 or [::]:7443), not {address!r}")
