"""The embedded nats-server: found, started with JetStream on a free loopback port, stopped."""

from __future__ import annotations

import socket
from pathlib import Path

import nats
import pytest

from dora.bus import server as server_mod
from dora.bus.server import (
    ENV_VAR,
    NatsServer,
    NatsServerFailed,
    NatsServerNotFound,
    find_nats_server,
)


def _accepts(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


async def test_starts_with_jetstream_in_its_dir_and_stops_cleanly(tmp_path: Path) -> None:
    store = tmp_path / "run" / "nats"
    srv = NatsServer(store)
    assert srv.url == f"nats://127.0.0.1:{srv.port}"
    assert not srv.running
    with srv:
        assert srv.running
        nc = await nats.connect(srv.url)
        js = nc.jetstream()
        await js.add_stream(name="T", subjects=["t.>"])
        ack = await js.publish("t.x", b"kept")
        assert ack.seq == 1
        assert (await js.account_info()).streams == 1
        await nc.close()
        proc = srv._proc
        assert proc is not None
    assert not srv.running
    assert proc.returncode is not None  # the child was reaped, nothing left running
    assert not _accepts(srv.port)
    assert (store / "jetstream").is_dir()  # JetStream stored under the given dir
    srv.stop()  # idempotent


async def test_listens_on_the_address_it_is_given_and_names_it(tmp_path: Path) -> None:
    """``--nats-host``: the address other machines reach (here another loopback address)."""
    srv = NatsServer(tmp_path / "nats", host="127.0.0.2")
    assert srv.url == f"nats://127.0.0.2:{srv.port}"
    with srv:
        assert _accepts(srv.port, "127.0.0.2")
        assert not _accepts(srv.port, "127.0.0.1")  # only where it was told to listen
        nc = await nats.connect(srv.url)
        assert nc.is_connected
        await nc.close()


def test_free_port_is_a_bindable_loopback_port() -> None:
    port = server_mod.free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_port_in_use_fails_with_a_clear_error(tmp_path: Path) -> None:
    with NatsServer(tmp_path / "a") as first:
        second = NatsServer(tmp_path / "b", port=first.port)
        with pytest.raises(NatsServerFailed, match="nats-server"):
            second.start(timeout=5.0)
        assert not second.running


def test_missing_binary_names_the_three_places(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.setattr(server_mod.sysconfig, "get_path", lambda name, *a, **k: str(empty))
    monkeypatch.setattr(server_mod.sys, "executable", str(empty / "python"))
    with pytest.raises(NatsServerNotFound) as err:
        find_nats_server()
    message = str(err.value)
    assert ENV_VAR in message
    assert str(empty) in message  # the scripts folder it looked in
    assert "PATH" in message
    with pytest.raises(NatsServerNotFound):
        NatsServer(tmp_path / "store")


def test_env_var_must_point_to_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "nope"))
    with pytest.raises(NatsServerNotFound, match=ENV_VAR):
        find_nats_server()
    real = tmp_path / "nats-server"
    real.write_bytes(b"")
    monkeypatch.setenv(ENV_VAR, str(real))
    assert find_nats_server() == real
