"""Configuration of the agent's API endpoints.

Each setting comes from the first place that sets it: command-line flag, then environment
variable, then the [api] table of /etc/kvtrace/kvtrace.toml, then the default:

    [api]
    socket = "/run/kvtrace/kvtrace.sock"   # KVTRACE_SOCKET, --socket
    group = "kvtrace"                      # KVTRACE_GROUP, --group: who may connect to the socket
    tcp_listen = "0.0.0.0:7443"            # KVTRACE_TCP_LISTEN, --tcp-listen: off unless set
    tls_cert = "/etc/kvtrace/tls/server.crt"       # KVTRACE_TLS_CERT, --tls-cert
    tls_key = "/etc/kvtrace/tls/server.key"        # KVTRACE_TLS_KEY, --tls-key
    tls_client_ca = "/etc/kvtrace/tls/clients.crt" # KVTRACE_TLS_CLIENT_CA, --tls-client-ca

TCP is served with mutual TLS only, so tcp_listen needs all three TLS files. Other tables of the
file belong to other components and are not read here.
"""
from __future__ import annotations

import argparse
import os
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

ENVIRONMENT = {
    "socket": "KVTRACE_SOCKET",
    "group": "KVTRACE_GROUP",
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
    tcp_listen: str = ""  # "host:port"; "" = no TCP listener
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None

    @property
    def tcp_enabled(self) -> bool:
        return bool(self.tcp_listen)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_socket_flag(parser: argparse.ArgumentParser) -> None:
    """The flag every client command takes."""
    parser.add_argument("--socket", metavar="PATH", type=Path,
                        help=f"the agent's Unix socket (default: ${ENVIRONMENT['socket']}, "
                             f"the config file, or {DEFAULT_SOCKET})")


def add_api_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of `kvtrace agent` that set where the API is served."""
    add_socket_flag(parser)
    parser.add_argument("--group", help=f"group allowed to use the socket (default: {DEFAULT_GROUP})")
    parser.add_argument("--tcp-listen", metavar="HOST:PORT",
                        help="also serve on TCP, with mutual TLS only (needs the three --tls-* files)")
    parser.add_argument("--tls-cert", metavar="PEM", type=Path, help="server certificate (chain) for TCP")
    parser.add_argument("--tls-key", metavar="PEM", type=Path, help="server private key for TCP")
    parser.add_argument("--tls-client-ca", metavar="PEM", type=Path,
                        help="CA that signs the client certificates accepted on TCP")


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str] = os.environ,
                     path: Path = DEFAULT_CONFIG_PATH) -> ApiConfig:
    """The configuration for a command whose parser has some of the flags above."""
    flags = {f.name: getattr(args, f.name, None) for f in fields(ApiConfig)}
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
            document = tomllib.load(file)
    except FileNotFoundError:
        return {}
    except OSError as error:
        raise ConfigError(f"cannot read {path}: {error.strerror}") from error
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: not valid TOML: {error}") from error
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
    group = values.get("group", DEFAULT_GROUP)
    if not group:
        raise ConfigError(f"{sources['group']}: the group must not be empty")
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
    return ApiConfig(socket=socket, group=group, tcp_listen=tcp_listen, **tls)


def _check_listen_address(address: str, source: str) -> None:
    host, separator, port = address.rpartition(":")
    if not separator or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{source}: expected HOST:PORT (e.g. 0.0.0.0:7443 or [::]:7443), not {address!r}")
