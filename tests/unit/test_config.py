"""Configuration: flags > environment > /etc/kvtrace/kvtrace.toml > defaults; clear errors."""
import argparse
from pathlib import Path

import pytest

from kvtrace.config import (
    DEFAULT_GROUP,
    DEFAULT_SOCKET,
    ApiConfig,
    ConfigError,
    add_api_flags,
    config_from_args,
    load_config,
)

TLS_ENV = {"KVTRACE_TLS_CERT": "/env/server.crt", "KVTRACE_TLS_KEY": "/env/server.key",
           "KVTRACE_TLS_CLIENT_CA": "/env/clients.crt"}


def write(tmp_path, text):
    path = tmp_path / "kvtrace.toml"
    path.write_text(text)
    return path


def test_defaults_without_file_or_environment(tmp_path):
    config = load_config({}, {}, tmp_path / "missing.toml")
    assert config == ApiConfig(socket=DEFAULT_SOCKET, group=DEFAULT_GROUP)
    assert not config.tcp_enabled


def test_each_source_overrides_the_next(tmp_path):
    path = write(tmp_path, '[api]\nsocket = "/file/kvtrace.sock"\ngroup = "filegroup"\n'
                           'tls_cert = "/file/server.crt"\n')
    assert load_config({}, {}, path) == ApiConfig(
        socket=Path("/file/kvtrace.sock"), group="filegroup", tls_cert=Path("/file/server.crt"))
    environ = {"KVTRACE_SOCKET": "/env/kvtrace.sock", "KVTRACE_GROUP": ""}  # empty: not set
    assert load_config({}, environ, path) == ApiConfig(
        socket=Path("/env/kvtrace.sock"), group="filegroup", tls_cert=Path("/file/server.crt"))
    flags = {"socket": Path("/flag/kvtrace.sock"), "group": None}  # None: flag not given
    assert load_config(flags, environ, path).socket == Path("/flag/kvtrace.sock")


def test_agent_flags_end_to_end(tmp_path):
    parser = argparse.ArgumentParser()
    add_api_flags(parser)
    args = parser.parse_args(["--tcp-listen", "0.0.0.0:7443", "--tls-cert", "/flag/server.crt"])
    config = config_from_args(args, TLS_ENV, tmp_path / "missing.toml")
    assert config.tcp_listen == "0.0.0.0:7443" and config.tcp_enabled
    assert config.tls_cert == Path("/flag/server.crt") and config.tls_key == Path("/env/server.key")


def test_tcp_needs_all_three_tls_files(tmp_path):
    with pytest.raises(ConfigError, match="mutual TLS only.*--tls-key .*KVTRACE_TLS_KEY.*--tls-client-ca"):
        load_config({"tcp_listen": "[::]:7443", "tls_cert": "/x.crt"}, {}, tmp_path / "missing.toml")


@pytest.mark.parametrize("address", ["7443", ":7443", "host:", "host:port", "host:70000"])
def test_bad_listen_address_names_its_source(tmp_path, address):
    with pytest.raises(ConfigError, match="^KVTRACE_TCP_LISTEN: expected HOST:PORT"):
        load_config({}, {"KVTRACE_TCP_LISTEN": address, **TLS_ENV}, tmp_path / "missing.toml")


def test_relative_socket_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="^--socket: the socket must be an absolute path"):
        load_config({"socket": "kvtrace.sock"}, {}, tmp_path / "missing.toml")


@pytest.mark.parametrize("text, message", [
    ("[api\nsocket = 1", "not valid TOML"),
    ('api = "x"', r"\[api\] must be a table"),
    ('[api]\nsockett = "/x"', r"\[api\] sockett is not a setting"),
    ("[api]\nsocket = 3", r"\[api\] socket must be a string, not int"),
    ('[api]\nsocket = "relative"', r"\[api\] socket: the socket must be an absolute path"),
])
def test_bad_file_names_the_file_and_key(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=message) as error:
        load_config({}, {}, path)
    assert str(error.value).startswith(str(path))


def test_other_tables_belong_to_other_components(tmp_path):
    path = write(tmp_path, '[prometheus]\nlisten = 9400\n[api]\ngroup = "gpu"\n')
    assert load_config({}, {}, path).group == "gpu"


def test_unreadable_file_is_an_error_not_a_default(tmp_path):
    path = tmp_path / "kvtrace.toml"
    path.mkdir()  # unreadable as a file, even for root
    with pytest.raises(ConfigError, match=f"cannot read {path}"):
        load_config({}, {}, path)
