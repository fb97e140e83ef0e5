"""A ``tls://`` NATS URL: verified TLS or no connection (real nats-server, real certificates)."""

from __future__ import annotations

import shutil
import ssl
import subprocess
from pathlib import Path

import pytest

from dora.bus import BusError, NatsBus
from dora.bus.auth import NatsAuth
from dora.bus.server import NatsServer, find_nats_server, free_port
from dora.subjects import Subjects

pytestmark = [
    pytest.mark.nats,
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command"),
]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture
def certificates(tmp_path: Path) -> Path:
    """A private CA and a server certificate for 127.0.0.1 signed by it."""
    days = ("-days", "2")
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        *days,
        "-subj",
        "/CN=dora-test-ca",
        cwd=tmp_path,
    )
    _openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=127.0.0.1",
        cwd=tmp_path,
    )
    (tmp_path / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    _openssl(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.pem",
        *days,
        "-extfile",
        "ext.cnf",
        cwd=tmp_path,
    )
    return tmp_path


@pytest.fixture
def tls_server(certificates: Path):
    port = free_port()
    proc = subprocess.Popen(
        [
            str(find_nats_server()),
            "-a",
            "127.0.0.1",
            "-p",
            str(port),
            "-js",
            "-sd",
            str(certificates / "js"),
            "--tls",
            "--tlscert",
            str(certificates / "server.pem"),
            "--tlskey",
            str(certificates / "server.key"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield f"tls://127.0.0.1:{port}", certificates / "ca.pem"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


async def test_tls_url_connects_verified_with_the_given_ca(tls_server: tuple[str, Path]) -> None:
    url, ca = tls_server
    subjects = Subjects("tls1")
    bus = NatsBus(subjects, url, auth=NatsAuth(ca_file=ca), reconnect_attempts=0)
    await bus.connect()
    try:
        await bus.publish(subjects.prompts, b"{}", msg_id="p1")
        assert (await bus.stream_info(subjects.prompts)).messages == 1
        ssl_object = bus.nc._transport._io_writer.get_extra_info("ssl_object")
        assert ssl_object is not None and ssl_object.version() in ("TLSv1.2", "TLSv1.3")
    finally:
        await bus.close()


async def test_an_unknown_certificate_is_refused(tls_server: tuple[str, Path]) -> None:
    url, _ = tls_server  # no CA given: the system's CAs do not know this server
    bus = NatsBus(Subjects("tls2"), url, reconnect_attempts=0)
    with pytest.raises(BusError, match="certificate verify failed") as caught:
        await bus.connect()
    assert isinstance(caught.value.__cause__.__cause__, ssl.SSLCertVerificationError)


async def test_tls_url_to_a_plain_server_is_refused(tmp_path: Path) -> None:
    with NatsServer(tmp_path / "nats") as server:
        url = server.url.replace("nats://", "tls://")
        bus = NatsBus(Subjects("tls3"), url, reconnect_attempts=0)
        with pytest.raises(BusError, match="asks for TLS but the server there does not offer"):
            await bus.connect()
