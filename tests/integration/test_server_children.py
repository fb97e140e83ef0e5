"""The embedded nats-server is a well-behaved child: its own session (a terminal's Ctrl-C
reaches dora, not the server dora still has to drain against), gone when its parent is
SIGKILLed, and never started twice on one JetStream store."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dora.bus.server import NatsServer, NatsServerFailed, running_server_url

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="parent-death signal is Linux")

_PARENT = """
import sys
from pathlib import Path
from dora.bus.server import NatsServer
srv = NatsServer(Path(sys.argv[1])).start()
print("SERVER_PID", srv._proc.pid, flush=True)
sys.stdin.read()  # live until killed
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead but still has a pid until reaped by init; it has no store open
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pid: int, deadline_s: float) -> bool:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return not _alive(pid)


def test_server_dies_with_a_sigkilled_parent_and_runs_in_its_own_session(tmp_path: Path) -> None:
    store = tmp_path / "nats"
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, str(store)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert parent.stdout is not None
        line = ""
        while not line.startswith("SERVER_PID"):  # structlog's lines come first
            line = parent.stdout.readline()
            assert line, "the parent exited before starting its server"
        server_pid = int(line.split()[1])
        assert _alive(server_pid)
        assert os.getsid(server_pid) != os.getsid(parent.pid)  # Ctrl-C's group is not its own
        assert running_server_url(store) is not None
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        assert _wait_gone(server_pid, 20.0), "nats-server outlived its SIGKILLed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
    # the dead server's ports file is stale: nobody serves the store now, so a new one starts
    assert running_server_url(store) is None
    with NatsServer(store) as again:
        assert again.running


def test_a_store_served_by_a_live_server_is_refused(tmp_path: Path) -> None:
    with NatsServer(tmp_path / "nats") as first:
        with pytest.raises(NatsServerFailed, match="already serving"):
            NatsServer(tmp_path / "nats").start()
        assert first.running
