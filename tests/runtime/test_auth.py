"""Addresses, tokens, and the rule that a synchronizer beyond loopback needs a token."""

from __future__ import annotations

import pytest

from ddiloco import cli
from ddiloco.core.shared.errors import ConfigError
from ddiloco.runtime.auth import (
    TOKEN_ENV,
    Authenticator,
    Identity,
    client_metadata,
    load_credentials,
    load_token,
    parse_address,
    require_token_beyond_loopback,
)
from ddiloco.testing import sync_argv


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
    assert Authenticator().identify(()) == Identity()
    assert Authenticator("t").identify(client_metadata("t")) == Identity()
    assert Authenticator("t").identify(client_metadata("u")) is None
    assert Authenticator("t").identify(client_metadata(None)) is None


def test_per_learner_credentials_identify_one_learner_and_the_token_only_an_operator() -> None:
    auth = Authenticator("shared", {"learner-0": "s0", "learner-1": "s1"})
    assert auth.identify(client_metadata("s0", "learner-0")) == Identity("learner-0")
    assert auth.identify(client_metadata("s1", "learner-0")) is None  # another learner's secret
    assert auth.identify(client_metadata("s0", "learner-9")) is None  # an id without credentials
    assert auth.identify(client_metadata("shared", "learner-0")) is None  # the token is no learner's secret
    assert auth.identify(client_metadata("shared")) == Identity(operator=True)
    assert Authenticator(None, {"learner-0": "s0"}).identify(client_metadata("s0")) is None


@pytest.mark.parametrize("text, problem", [
    ("learner-0 s0\n", "line 1: expected 'learner-id: secret'"),
    ("learner-0:\n", "line 1: expected"),
    ("# the run's learners\nlearner-0: a\nlearner-0: b\n", "line 3: learner 'learner-0' is listed twice"),
    ("has space: a\n", "line 1: learner id must be"),
    ("# nobody\n", "lists no learner"),
    ("", "is empty"),
])
def test_a_bad_credentials_file_is_one_line_naming_it(tmp_path, text, problem) -> None:
    f = tmp_path / "creds"
    f.write_text(text)
    with pytest.raises(ConfigError, match=problem.replace("(", r"\(")):
        load_credentials(str(f))
    with pytest.raises(ConfigError, match="cannot read"):
        load_credentials(str(tmp_path / "missing"))
    assert load_credentials(None) is None


def test_a_bad_credentials_file_stops_ddiloco_sync_with_exit_2_and_nothing_created(tmp_path, capsys) -> None:
    f = tmp_path / "creds"
    f.write_text("learner-0: a\nlearner-0: b\n")
    state = tmp_path / "state"
    code = cli.main(sync_argv("--credentials", str(f), state_dir=state))
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "listed twice" in err and str(f) in err
    assert not state.exists()


def test_listening_beyond_loopback_without_token_is_refused(monkeypatch, capsys) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(ConfigError, match="token"):
        require_token_beyond_loopback(parse_address("0.0.0.0:7000", option="x"), None)
    require_token_beyond_loopback(parse_address("0.0.0.0:7000", option="x"), "t")
    code = cli.main(sync_argv(listen="0.0.0.0:0"))
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("ddiloco: error:") and "--token-file" in err and err.count("\n") == 1
