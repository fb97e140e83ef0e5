"""Model-written code under bubblewrap: each escape or runaway is stopped within its limit with
a clear result, no process is left behind, and the sandbox keeps serving."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from dora.envs.sandbox import Sandbox, SandboxLimits, bubblewrap_works, python_tool
from dora.envs.tools import ToolCall, ToolSet

pytestmark = pytest.mark.skipif(
    bool(bubblewrap_works()), reason=f"no isolation here: {bubblewrap_works()}"
)

LIMITS = SandboxLimits(cpu_s=2, memory_mb=256, processes=16, output_bytes=4096, wall_s=4)
FORK_BOMB = """
import os, time
born = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        born += 1
except OSError as exc:
    print("fork refused after", born, exc.errno)
"""


def sandbox_processes() -> int:
    """Processes still running sandboxed code (they run as nobody, or under bwrap)."""
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                cmd = Path(f"/proc/{entry.name}/cmdline").read_bytes()
            except OSError:
                continue
            count += b"main.py" in cmd and b"-I" in cmd
    return count


async def test_runaway_and_escaping_code_is_stopped_with_a_clear_result() -> None:
    sandbox = Sandbox(LIMITS)
    ok = await sandbox.run_python("print(sum(range(10)))")
    assert ok.ok and ok.stdout == "45\n"

    net = await sandbox.run_python("import socket; socket.create_connection(('1.1.1.1', 80), 2)")
    assert net.exit_code == 1 and "Network is unreachable" in net.stderr

    outside = await sandbox.run_python("print(open('/etc/hostname').read())")
    assert outside.exit_code == 1 and "No such file" in outside.stderr
    system = await sandbox.run_python("open('/usr/lib/x', 'w')")
    assert system.exit_code == 1 and "Read-only file system" in system.stderr
    home = await sandbox.run_python("import os; print(sorted(os.listdir('/')))")
    assert "root" not in home.stdout and "home" not in home.stdout and "work" in home.stdout

    bomb = await sandbox.run_python(FORK_BOMB)
    assert "fork refused after" in bomb.stdout
    assert int(bomb.stdout.split()[3]) < LIMITS.processes

    memory = await sandbox.run_python("x = bytearray(2 * 1024**3)")
    assert memory.out_of_memory and memory.exit_code == 1

    started = time.monotonic()
    chatty = await sandbox.run_python("while True: print('y' * 100)")
    assert chatty.truncated and len(chatty.stdout) <= LIMITS.output_bytes
    spin = await sandbox.run_python("while True: pass")
    assert spin.timed_out and not spin.ok
    sleeper = await sandbox.run_python("import time; time.sleep(60)")
    assert sleeper.timed_out
    assert time.monotonic() - started < 3 * LIMITS.wall_s

    big = await sandbox.run_python("open('f', 'wb').write(b'x' * (64 * 1024**2))")
    assert big.exit_code == 1 and "File too large" in big.stderr

    assert sandbox_processes() == 0  # the fork bomb's sleepers went with their group
    again = await asyncio.gather(*(sandbox.run_python(f"print({i} * 2)") for i in range(4)))
    assert [r.stdout for r in again] == ["0\n", "2\n", "4\n", "6\n"]


async def test_without_isolation_code_is_refused_unless_explicitly_allowed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("dora.envs.sandbox.bubblewrap_works", lambda: "no bwrap (test)")
    refused = await Sandbox(LIMITS).run_python("print('ran')")
    assert refused.exit_code is None and "refused: no sandbox (no bwrap (test))" in refused.error
    allowed = await Sandbox(LIMITS, allow_unsandboxed=True).run_python("print('ran')")
    assert allowed.ok and allowed.stdout == "ran\n"


async def test_the_python_tool_gives_the_model_a_structured_result() -> None:
    tools = ToolSet([python_tool(Sandbox(LIMITS))])
    ok = await tools.run(ToolCall("c1", "python", {"code": "print(6 * 7)"}))
    assert ok.ok and '"stdout": "42\\n"' in ok.content and '"exit_code": 0' in ok.content
    spin = await tools.run(ToolCall("c2", "python", {"code": "while True: pass"}))
    assert spin.ok and '"timed_out": true' in spin.content
