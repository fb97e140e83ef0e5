"""NatsAuth: what --nats-creds / --nats-ca turn into, and the errors for bad files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dora.bus.auth import NatsAuth


def test_options_become_one_login(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    creds = tmp_path / "reader.json"
    creds.write_text(json.dumps({"user": "reader", "password": "pw", "inbox_prefix": "_I"}))
    assert NatsAuth.from_options(None, None) is None
    assert NatsAuth.from_options(None, ca) == NatsAuth(ca_file=ca)
    login = NatsAuth.from_options(creds, ca)
    assert login == NatsAuth(user="reader", password="pw", inbox_prefix="_I", ca_file=ca)
    assert "tls" not in login.connect_options("nats://127.0.0.1:4222")
    jwt = tmp_path / "site.creds"
    jwt.write_text("-----BEGIN NATS USER JWT-----\n")
    assert NatsAuth.from_options(jwt, None) == NatsAuth(creds_file=jwt)


def test_a_bad_credentials_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such file"):
        NatsAuth.from_options(tmp_path / "missing.json", None)
    bad = tmp_path / "bad.json"
    bad.write_text('{"user": "x"}')
    with pytest.raises(ValueError, match=r"bad\.json: expected JSON with `user` and `password`"):
        NatsAuth.from_options(bad, None)
