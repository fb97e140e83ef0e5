"""``dora run --processes``: one OS process per stage replica, supervised.

The supervisor starts the run's embedded nats-server (with a login per stage), creates the
streams, then starts ``dora stage serve`` once per stage replica, each in its own session
(a terminal's Ctrl-C reaches the supervisor only) and dying with it (no orphans). It prefixes
each child's output with its stage, restarts a child that dies (``max_restarts`` per child,
with backoff; NATS redelivers what the dead one held, the stages resume from their own
state), and ends the run when every finite stage (prompt source, learner, a counting sink)
has exited by itself: the others are then drained with SIGTERM, and killed if they overrun.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from dora.bus.auth import stage_login
from dora.bus.server import die_with_parent
from dora.files import write_atomically
from dora.pipeline.core import Pipeline, PipelineError, folder_bytes

log = structlog.get_logger(__name__)

PROCESSES_FILE = "processes.json"
"""Under the run folder: every stage process with its pid and restarts, kept current."""
BACKOFF_S = (1.0, 2.0, 4.0, 8.0)
STAGES_DIR = "stages"
"""Under the run folder: each stage process's own summary (``<stage>-<replica>.json``)."""


def summary_path(run_dir: Path, stage: str, replica: int) -> Path:
    return Path(run_dir) / STAGES_DIR / f"{stage}-{replica}.json"


def progress_path(run_dir: Path, stage: str, replica: int) -> Path:
    """Its counters while it runs (``Pipeline.progress``), for the supervisor's live view."""
    return Path(run_dir) / STAGES_DIR / f"{stage}-{replica}.progress.json"


def ready_path(run_dir: Path, stage: str, replica: int) -> Path:
    """Written by a stage process once its stage has started (consumers exist)."""
    return Path(run_dir) / STAGES_DIR / f"{stage}-{replica}.ready"


@dataclass
class Child:
    """One stage replica's process."""

    stage: str
    replica: int
    finite: bool
    command: list[str]
    proc: asyncio.subprocess.Process | None = None
    restarts: int = 0
    finished: bool = False
    """Exited 0 by itself: a finite stage that completed."""
    last_lines: list[str] = field(default_factory=list)
    pump: asyncio.Task[None] | None = None

    @property
    def name(self) -> str:
        return f"{self.stage}-{self.replica}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None


class ProcessRun:
    """Supervise the stage processes of ``pipeline`` (loaded from ``pipeline_file``)."""

    def __init__(
        self,
        pipeline: Pipeline,
        pipeline_file: Path,
        *,
        overrides: list[str] | None = None,
        max_steps: int | None = None,
        log_level: str = "warning",
        max_restarts: int = 3,
        echo: Callable[[str], None] = print,
    ) -> None:
        self.pipeline = pipeline
        self.pipeline_file = Path(pipeline_file).resolve()
        self.overrides = list(overrides or ())
        self.max_steps = max_steps
        self.log_level = log_level
        self.max_restarts = max_restarts
        self.echo = echo
        self.children: list[Child] = []
        self.completed = False
        self._stop = asyncio.Event()
        self._exited: asyncio.Queue[Child] = asyncio.Queue()
        self._started_at = 0.0
        self._finished_at = 0.0
        self._start_order: list[str] = []

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> dict[str, Any]:
        """Until every finite stage finished (or ``stop()``); the merged summary."""
        self._started_at = time.time()
        await self.pipeline.open()
        try:
            self.children = self._plan()
            await self._start_in_order()
            await self._supervise()
        finally:
            await self._stop_children()
            self.pipeline.left_in_streams = await self.pipeline.left_in_streams_now()
            await self.pipeline.stop()
            self._finished_at = time.time()
        return self.summary()

    def stop(self) -> None:
        """Drain every stage and end the run (Ctrl-C)."""
        self._stop.set()

    async def _start_in_order(self) -> None:
        """Stage by stage, as in one process: consumers first, sources last, each stage's
        processes ready (consumers created, set up) before the next starts, so nothing is
        published to a fan-out stream before every reader of it exists."""
        for stage in self._start_order:
            if self._stop.is_set():  # Ctrl-C while starting: start nothing more
                return
            group = [c for c in self.children if c.stage == stage]
            for child in group:
                await self._spawn(child)
            for child in group:
                await self._until_ready(child)

    async def _until_ready(self, child: Child) -> None:
        ready = ready_path(self.pipeline.run_dir, child.stage, child.replica)
        while not ready.exists():
            if self._stop.is_set():
                return
            if not child.running:
                await asyncio.sleep(0.2)  # let the pump echo its last lines
                tail = "\n".join(child.last_lines[-10:])
                raise PipelineError(f"stage process {child.name} exited while starting:\n{tail}")
            await asyncio.sleep(0.1)
        log.info("stage_process_ready", process=child.name)

    def _plan(self) -> list[Child]:
        p = self.pipeline
        creds = p.credentials
        url = p.connected_url or ""
        children = []
        self._start_order = [s.name for s, _ in sorted(p.entries, key=lambda e: e[0].is_source)]
        for stage, replicas in p.entries:
            for replica in range(replicas):
                command = [
                    sys.executable,
                    "-c",
                    "from dora.cli import app; app()",
                    "stage",
                    "serve",
                    str(self.pipeline_file),
                    "--stage",
                    stage.name,
                    "--replica",
                    str(replica),
                    "--nats",
                    url,
                    "--run-id",
                    p.run_id,
                    "--run-dir",
                    str(p.run_dir.resolve()),
                    "--log-level",
                    self.log_level,
                ]
                if creds is not None:
                    login = creds.path(p.run_dir, stage_login(stage.name)).resolve()
                    command += ["--nats-creds", str(login)]
                for override in self.overrides:
                    command += ["--set", override]
                if self.max_steps is not None:
                    command += ["--max-steps", str(self.max_steps)]
                children.append(Child(stage.name, replica, bool(stage.finite), command))
        return children

    async def _spawn(self, child: Child) -> None:
        ready_path(self.pipeline.run_dir, child.stage, child.replica).unlink(missing_ok=True)
        child.proc = await asyncio.create_subprocess_exec(
            *child.command,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches the supervisor, which drains them
            # the supervisor killed: its stages die as it did (their work is redelivered on
            # resume); a drain would only wait on the server, which goes with it
            preexec_fn=kill_with_parent if sys.platform == "linux" else None,
        )
        child.pump = asyncio.create_task(self._pump(child, child.proc))
        self._record()
        log.info("stage_process_started", process=child.name, pid=child.proc.pid)

    async def _pump(self, child: Child, proc: asyncio.subprocess.Process) -> None:
        """Echo the child's output, prefixed; report its exit."""
        assert proc.stdout is not None
        async for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            child.last_lines = [*child.last_lines[-19:], line]
            self.echo(f"[{child.name}] {line}")
        await proc.wait()
        await self._exited.put(child)

    async def _supervise(self) -> None:
        finite = [c for c in self.children if c.finite]
        stop = asyncio.create_task(self._stop.wait())
        try:
            while not (finite and all(c.finished for c in finite)):
                exited = asyncio.create_task(self._exited.get())
                await asyncio.wait({exited, stop}, return_when=asyncio.FIRST_COMPLETED)
                if stop.done():
                    exited.cancel()
                    return
                await self._on_exit(exited.result())
            self.completed = True
        finally:
            stop.cancel()

    async def _on_exit(self, child: Child) -> None:
        assert child.proc is not None
        code = child.proc.returncode
        if code == 0 and child.finite:
            child.finished = True
            log.info("stage_process_finished", process=child.name)
            self._record()
            return
        if child.restarts >= self.max_restarts:
            tail = "\n".join(child.last_lines[-10:])
            raise PipelineError(
                f"stage process {child.name} exited with {code} "
                f"{child.restarts + 1} times; its last lines:\n{tail}"
            )
        delay = BACKOFF_S[min(child.restarts, len(BACKOFF_S) - 1)]
        child.restarts += 1
        self.echo(f"[{child.name}] exited with {code}; restarting in {delay:g} s")
        log.warning("stage_process_restarting", process=child.name, code=code, delay_s=delay)
        await asyncio.sleep(delay)
        await self._spawn(child)

    async def _stop_children(self, grace_s: float | None = None) -> None:
        """SIGTERM every running child (each drains its stage), SIGKILL what overruns."""
        grace = self.pipeline.drain_timeout + 15 if grace_s is None else grace_s
        running = [c for c in self.children if c.running]
        for child in running:
            assert child.proc is not None
            with contextlib.suppress(ProcessLookupError):
                child.proc.send_signal(signal.SIGTERM)
        for child in running:
            assert child.proc is not None
            try:
                await asyncio.wait_for(child.proc.wait(), grace)
            except TimeoutError:
                log.warning("stage_process_killed", process=child.name, after_s=grace)
                with contextlib.suppress(ProcessLookupError):
                    child.proc.kill()
                await child.proc.wait()
        for child in self.children:
            if child.pump is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await asyncio.wait_for(child.pump, 5)
        self._record()

    # ------------------------------------------------------------------ reports

    def _record(self) -> None:
        """``RUN_DIR/processes.json``: who runs where (``ps`` by another name)."""
        record = {
            c.name: {
                "stage": c.stage,
                "pid": c.proc.pid if c.proc else None,
                "running": c.running,
                "restarts": c.restarts,
                "finished": c.finished,
            }
            for c in self.children
        }
        write_atomically(
            self.pipeline.run_dir / PROCESSES_FILE, json.dumps(record, indent=2) + "\n"
        )

    def progress_line(self) -> str:
        up = sum(c.running for c in self.children)
        restarts = sum(c.restarts for c in self.children)
        done = [c.name for c in self.children if c.finished]
        line = f"processes {up}/{len(self.children)} running, {restarts} restarts"
        return line + (f", finished: {', '.join(done)}" if done else "")

    def progress(self) -> dict[str, dict[str, Any]]:
        """``Pipeline.progress``'s shape, merged from the processes' progress files (the
        stages that have started; replicas add their counts)."""
        merged: dict[str, dict[str, Any]] = {}
        for child in self.children:
            path = progress_path(self.pipeline.run_dir, child.stage, child.replica)
            try:
                info = json.loads(path.read_text())[child.stage]
            except (OSError, ValueError, KeyError):
                continue
            add_replica(merged, child.stage, info)
        return merged

    def summary(self) -> dict[str, Any]:
        """The in-process summary's shape, merged from each process's own summary."""
        reports = []
        for child in self.children:
            path = summary_path(self.pipeline.run_dir, child.stage, child.replica)
            try:
                reports.append((child.stage, json.loads(path.read_text())["stages"][child.stage]))
            except (OSError, ValueError, KeyError):
                continue
        return merged_summary(
            self.pipeline,
            reports,
            completed=self.completed,
            started_at=self._started_at,
            finished_at=self._finished_at,
            processes={c.name: {"restarts": c.restarts} for c in self.children},
        )


def merged_summary(
    pipeline: Pipeline,
    reports: list[tuple[str, dict[str, Any]]],
    *,
    completed: bool,
    started_at: float,
    finished_at: float,
    **extra: Any,
) -> dict[str, Any]:
    """A run of separate stage replicas summarized in the in-process shape: ``reports`` are
    (stage, that replica's own stage summary); ``extra``: the deployment's own table."""
    stages: dict[str, dict[str, Any]] = {}
    for stage, info in reports:
        add_replica(stages, stage, info)
    end = finished_at or time.time()
    return {
        "pipeline": pipeline.name,
        "run_id": pipeline.run_id,
        "completed": completed,
        "started_at": started_at,
        "seconds": round(end - started_at, 3),
        "run_dir_bytes": folder_bytes(pipeline.run_dir),
        "left_in_streams": pipeline.left_in_streams,
        **extra,
        "stages": stages,
    }


def add_replica(merged: dict[str, dict[str, Any]], stage: str, info: dict[str, Any]) -> None:
    """Fold one replica's process report into ``merged[stage]``: the first is taken as it is,
    the others add their counters and counts (a generator's ``finished``); ``total`` is the
    stage's, not a sum."""
    into = merged.get(stage)
    if into is None:
        merged[stage] = {**info, "stats": dict(info.get("stats", {})), "replicas": 1}
        return
    into["replicas"] += 1
    for key, value in info.get("stats", {}).items():
        if isinstance(value, int | float) and key in into["stats"]:
            into["stats"][key] += value
    for key, value in info.items():
        counted = isinstance(value, int | float) and isinstance(into.get(key), int | float)
        if counted and key not in ("replicas", "total"):
            into[key] += value


def kill_with_parent() -> None:
    """In a stage process before exec: SIGKILL when the supervisor dies."""
    die_with_parent(signal.SIGKILL)
