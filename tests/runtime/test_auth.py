"""Addresses, tokens, and the rule that a synchronizer beyond loopback needs a token."""

from __future__ import annotations

import pytest

from ddiloco import cli
from ddiloco.errors import ConfigError
from ddiloco.runtime.auth import (
    TOKEN_ENV,
    client_metadata,
    load_token,
    parse_address,
    require_token_beyond_loopback,
    token_matches,
)


def test_parse_address_and_loopback() -> None:
    assert parse_address("127.0.0.1:7000", option="x").is_loopback
    assert parse_address("localhost:1", option="x").is_loopback
    assert parse_address("[::1]:80", option="x").is_loopback
    assert not parse_address("0.0.0.0:7000", option="x").is_loopback
    assert not parse_address("sync.example.com:7000", option="x").is_loopback
    assert parse_address("127.0.0.1:0", option="x", allow_port_zero=True).port == 0
    for bad in ("7000", "host:", "host:port", "host:70000", ":7000"):
        with pytest.raises(ConfigError):
            parse_address(bad, option="--listen")


def test_token_from_file_then_environment(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert load_token(None) is None
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    assert load_token(None) == "from-env"
    f = tmp_path / "token"
    f.write_text("from-file\n")
    assert load_token(str(f)) == "from-file"  # an explicit file wins over the environment
    f.write_text("  \n")
    with pytest.raises(ConfigError, match="empty"):
        load_token(str(f))
    with pytest.raises(ConfigError, match="cannot read"):
        load_token(str(tmp_path / "missing"))


def test_token_matching() -> None:
    assert token_matches((), None)
    assert token_matches(client_metadata("t"), "t")
    assert not token_matches(client_metadata("u"), "t")
    assert not token_matches(client_metadata(None), "t")


def test_listening_beyond_loopback_without_token_is_refused(monkeypatch, capsys) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(ConfigError, match="token"):
        require_token_beyond_loopback(parse_address("0.0.0.0:7000", option="x"), None)
    require_token_beyond_loopback(parse_address("0.0.0.0:7000", option="x"), "t")
    code = cli.main(["sync", "--preset", "tiny", "--listen", "0.0.0.0:0"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("ddiloco: error:") and "--token-file" in err and err.count("\n") == 1
