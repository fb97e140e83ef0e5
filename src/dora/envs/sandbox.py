"""Running model-written Python in a separate process isolated by bubblewrap.

What the code gets: the system's ``/usr`` read-only (the interpreter and its standard
library), a private empty working directory (``/work``, the only writable place besides a
private ``/tmp``), its own PID, network, IPC and UTS namespaces (no network at all), no
environment variables but ``PATH`` and ``HOME``. Limits: CPU seconds, address space, open
processes, file size, output bytes, and a wall-clock deadline after which the whole process
group is killed. When dora runs as root, the sandbox runs as ``nobody`` so the process limit
counts the sandbox's processes only. Every run ends in a ``SandboxResult``; nothing raises.

Where bubblewrap is missing (``apt-get install bubblewrap``) or cannot create namespaces, a
run is refused with the reason unless ``allow_unsandboxed=True`` says, explicitly, to run the
code as a plain child process with the same resource limits and no isolation.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from dora.envs.tools import Tool

NOBODY = 65534
SYSTEM_PYTHON = ("/usr/bin/python3", "/usr/local/bin/python3")


@dataclass(frozen=True)
class SandboxLimits:
    cpu_s: int = 5
    memory_mb: int = 512
    processes: int = 16
    file_size_mb: int = 16
    output_bytes: int = 64 * 1024
    wall_s: float = 10.0


@dataclass(frozen=True)
class SandboxResult:
    exit_code: int | None
    """The process's exit status; negative: killed by that signal; None: refused, not run."""
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False
    out_of_memory: bool = False
    truncated: bool = False
    """The output passed ``output_bytes``: the process was killed and its output cut."""
    error: str = ""
    """Why the code was not run, or what went wrong around it."""

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not (self.timed_out or self.truncated)


@functools.cache
def bubblewrap_works() -> str:
    """ "" when bubblewrap can isolate here; otherwise why not."""
    if shutil.which("bwrap") is None:
        return "bubblewrap is not installed (apt-get install bubblewrap)"
    with tempfile.TemporaryDirectory(prefix="dora-sandbox-probe-") as tmp:
        argv = [*_bwrap_args(Path(tmp))[:-1], _python(), "-c", "pass"]
        probe = subprocess.run(argv, capture_output=True, timeout=30)
    if probe.returncode != 0:
        return f"bubblewrap cannot isolate here: {probe.stderr.decode(errors='replace')[:200]}"
    return ""


def _python() -> str:
    for path in SYSTEM_PYTHON:
        if os.path.exists(path):
            return path
    raise FileNotFoundError(f"no system python3 in {SYSTEM_PYTHON}")


def _bwrap_args(workdir: Path) -> list[str]:
    """bubblewrap's command line up to (and including) the ``--`` before the program."""
    args = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session"]
    args += ["--ro-bind", "/usr", "/usr"]
    for link in ("bin", "lib", "lib64", "sbin"):
        target = Path("/") / link
        if target.is_symlink():
            args += ["--symlink", os.readlink(target), f"/{link}"]
        elif target.is_dir():
            args += ["--ro-bind", str(target), f"/{link}"]
    args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    args += ["--bind", str(workdir), "/work", "--chdir", "/work"]
    args += ["--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/work"]
    return [*args, "--"]


class Sandbox:
    """``await Sandbox(limits).run_python(code)`` (see module docstring)."""

    def __init__(self, limits: SandboxLimits | None = None, allow_unsandboxed: bool = False):
        self.limits = limits or SandboxLimits()
        self.allow_unsandboxed = allow_unsandboxed

    async def run_python(self, code: str) -> SandboxResult:
        why = bubblewrap_works()
        if why and not self.allow_unsandboxed:
            return SandboxResult(None, error=f"refused: no sandbox ({why})")
        with tempfile.TemporaryDirectory(prefix="dora-sandbox-") as tmp:
            workdir = Path(tmp)
            (workdir / "main.py").write_text(code, encoding="utf-8")
            as_nobody = os.geteuid() == 0
            if as_nobody:
                os.chown(workdir, NOBODY, NOBODY)
                os.chown(workdir / "main.py", NOBODY, NOBODY)
            if why:
                argv, cwd = [_python(), "-I", "-B", "main.py"], str(workdir)
            else:
                argv, cwd = [*_bwrap_args(workdir), _python(), "-I", "-B", "main.py"], None
            return await self._run(argv, cwd, as_nobody)

    async def _run(self, argv: list[str], cwd: str | None, as_nobody: bool) -> SandboxResult:
        limits = self.limits
        proc = await asyncio.create_subprocess_exec(
            *_limited(argv, limits, as_nobody),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # one process group: the deadline kills all of it
        )
        output = _Output(proc.pid, limits.output_bytes)
        reads = asyncio.gather(output.read(proc.stdout, 0), output.read(proc.stderr, 1))
        timed_out = False
        try:
            await asyncio.wait_for(reads, limits.wall_s)
        except TimeoutError:
            timed_out = True
            _kill_group(proc.pid)
        code = await proc.wait()
        _kill_group(proc.pid)  # a daemonized grandchild of the code, if any
        if argv[0] == "bwrap" and code > 128:  # bwrap reports a signal as 128 + its number
            code = -(code - 128)
        stdout, stderr = (b"".join(chunks).decode(errors="replace") for chunks in output.chunks)
        killed = code in (-signal.SIGXCPU, -signal.SIGKILL) and not output.cut
        return SandboxResult(
            exit_code=code,
            stdout=stdout,
            stderr=stderr,
            timed_out=timed_out or killed,
            out_of_memory="MemoryError" in stderr,
            truncated=output.cut,
        )


class _Output:
    """stdout and stderr under one byte budget; spending it kills the process group."""

    def __init__(self, pid: int, budget: int) -> None:
        self.pid, self.budget, self.cut = pid, budget, False
        self.chunks: tuple[list[bytes], list[bytes]] = ([], [])

    async def read(self, stream: asyncio.StreamReader | None, which: int) -> None:
        assert stream is not None
        while chunk := await stream.read(4096):
            take = chunk[: self.budget]
            self.budget -= len(take)
            self.chunks[which].append(take)
            if len(take) < len(chunk) or self.budget <= 0:
                self.cut = True
                _kill_group(self.pid)


def _limited(argv: list[str], limits: SandboxLimits, as_nobody: bool) -> list[str]:
    """``argv`` under the resource limits (``prlimit``) and, as root, as nobody (``setpriv``):
    set by programs exec'd before it rather than in a forked child of this threaded process,
    where Python code before ``exec`` can deadlock."""
    mb = 1024 * 1024
    # as another user the limit counts every process of that user: leave room for those
    others = 0 if as_nobody else _processes_of(os.getuid())
    nproc = limits.processes + others
    wrapped = [
        "prlimit",
        f"--cpu={limits.cpu_s}:{limits.cpu_s + 1}",
        f"--as={limits.memory_mb * mb}",
        f"--fsize={limits.file_size_mb * mb}",
        "--core=0",
        f"--nproc={nproc}",
        "--",
    ]
    if as_nobody:
        wrapped += ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--"]
    return [*wrapped, *argv]


def _processes_of(uid: int) -> int:
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                count += entry.stat().st_uid == uid
    return count


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def python_tool(sandbox: Sandbox | None = None) -> Tool:
    """A ``python`` tool for an environment: runs the model's code in ``sandbox`` and gives
    back the structured result (exit code, output, timed out, out of memory, truncated)."""
    box = sandbox or Sandbox()

    async def python(code: str) -> dict[str, object]:
        """Run a Python program in an isolated sandbox and return its output.

        Args:
            code: The whole program; print what you want to see.
        """
        result = await box.run_python(code)
        if result.exit_code is None:
            raise RuntimeError(result.error)
        return {
            "exit_code": result.exit_code,
            "stdout": result.stdout,
            "stderr": result.stderr[-2000:],
            "timed_out": result.timed_out,
            "out_of_memory": result.out_of_memory,
            "truncated": result.truncated,
        }

    return Tool.from_function(python, timeout_s=box.limits.wall_s + 5)
