"""``Pipeline``: stages composed over one bus, started together, finished together.

Without a bus, a pipeline opens its own: the embedded nats-server (JetStream stored in the
run directory) when no NATS URL is given, else a connection to that URL. Consumers of every
stage are created before any stage starts, so no event published by an early stage is lost
on an interest-retention stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

import nats.errors
import structlog

from dora.bus import Bus, BusError, NatsBus, default_streams
from dora.bus.auth import NatsAuth, RunCredentials, StageGrant, stage_login
from dora.bus.server import NatsServer
from dora.stage import Stage, StageError, StageRunner
from dora.stages.replay_writer import ReplaySettings
from dora.subjects import LEDGER_KEY, Subjects

log = structlog.get_logger(__name__)

SUMMARY_FILE = "summary.json"
SERVER_POLL_S = 0.5
MAX_SERVER_RESTARTS = 3
"""An embedded nats-server that keeps dying is a problem to look at, not to hide."""


class PipelineError(RuntimeError):
    """A stage of the pipeline failed; the pipeline was stopped."""


def new_run_id(prefix: str = "run") -> str:
    """``<prefix>-<utc time>-<4 hex>``: sortable, unique, a valid NATS token."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return f"{prefix}-{stamp}-{uuid.uuid4().hex[:4]}"


class Pipeline:
    """Stages over one bus: ``await p.run()``, or ``async with p: await p.wait()``."""

    def __init__(
        self,
        run_id: str | None = None,
        bus: Bus | None = None,
        *,
        name: str = "pipeline",
        nats_url: str | None = None,
        nats_auth: NatsAuth | None = None,
        nats_host: str = "127.0.0.1",
        run_dir: Path | None = None,
        stream_max_msgs: int = 100_000,
        drain_timeout: float = 30.0,
        connect_timeout: float = 15.0,
        stall_timeout: float | None = None,
        replay: ReplaySettings | None = None,
    ) -> None:
        """``stall_timeout``: seconds without progress in any stage after which the run fails
        with each stage's state and the dispatcher's ledger (None: wait forever).
        ``replay``: keep a copy of these fan-out streams for late readers (replay writers).
        ``nats_auth``: how to log in to ``nats_url`` (the embedded server needs none: it gets
        per-run credentials, see ``dora.bus.auth``). ``nats_host``: where the embedded server
        listens (loopback unless stages on other machines must reach it)."""
        if bus is not None and run_id is not None and bus.subjects.run != run_id:
            raise StageError(f"run_id {run_id!r} differs from the bus's {bus.subjects.run!r}")
        self.run_id = bus.subjects.run if bus is not None else (run_id or new_run_id(name))
        self.subjects = Subjects(self.run_id)
        self.name = name
        self.nats_url = nats_url
        self.nats_auth = nats_auth
        self.nats_host = nats_host
        self.credentials: RunCredentials | None = None
        """The embedded server's per-role credentials (None on an outside server)."""
        self._stage_buses: list[NatsBus] = []
        self.summary_file: Path | None = None
        """Where ``write_summary`` writes (default ``RUN_DIR/summary.json``)."""
        self.left_in_streams: dict[str, int] = {}
        """What the work and fan-out streams still held when the run stopped."""
        self.run_dir = Path(run_dir) if run_dir is not None else Path("runs") / self.run_id
        self.stream_max_msgs = stream_max_msgs
        self.drain_timeout = drain_timeout
        self.connect_timeout = connect_timeout
        self.stall_timeout = stall_timeout
        self._bus = bus
        self._owns_bus = bus is None
        self._server: NatsServer | None = None
        self.server_restarts = 0
        self.connected_url: str | None = None
        """The NATS URL the run's bus uses (the embedded server's random port included)."""
        self._entries: list[tuple[Stage, int]] = []
        self.runners: list[StageRunner] = []
        self._stop_requested = asyncio.Event()
        self._started_at = 0.0
        self._finished_at = 0.0
        self._completed = False
        self._running = False
        self.replay = replay
        for writer in replay.writers() if replay else ():
            self.add(writer)

    # ----------------------------------------------------------------- composition

    def add(self, stage: Stage, replicas: int = 1) -> Pipeline:
        """Add a stage (``replicas`` pull loops sharing one durable consumer)."""
        if self._running:
            raise StageError("cannot add a stage to a running pipeline")
        if any(s.name == stage.name for s, _ in self._entries):
            raise StageError(f"two stages named {stage.name!r}; give one a `name=`")
        one = stage.is_source and not stage.hosts_replicas
        if replicas < 1 or (one and replicas != 1):
            raise StageError(f"stage {stage.name}: replicas must be >= 1 (exactly 1 for a source)")
        if stage.hosts_replicas:
            stage.replica_ids = tuple(range(replicas))
        self._entries.append((stage, replicas))
        return self

    def keep_only(self, name: str, replicas: int | None = None, replica: int = 0) -> Pipeline:
        """This pipeline reduced to the stage ``name`` (``dora stage serve``: the others run in
        other processes), with ``replicas`` pull loops if given; a stage that hosts its
        replicas hosts ``replicas`` of them from index ``replica``."""
        kept = [(s, replicas or n) for s, n in self._entries if s.name == name]
        if not kept:
            known = ", ".join(s.name for s, _ in self._entries)
            raise StageError(f"no stage named {name!r}; the pipeline has: {known}")
        stage, count = kept[0]
        if stage.hosts_replicas:
            stage.replica_ids = tuple(range(replica, replica + (replicas or 1)))
            count = len(stage.replica_ids)
        self._entries = [(stage, count)]
        return self

    @property
    def stages(self) -> list[Stage]:
        return [s for s, _ in self._entries]

    @property
    def entries(self) -> list[tuple[Stage, int]]:
        """Each stage with its replica count, in the order added."""
        return list(self._entries)

    @property
    def bus(self) -> Bus:
        if self._bus is None:
            raise StageError("the pipeline is not started")
        return self._bus

    # ----------------------------------------------------------------- lifecycle

    async def _open_bus(self) -> None:
        if self._bus is not None:
            return
        url, auth = self.nats_url, self.nats_auth
        if url is None:
            names = [s.name for s in self.stages]
            self.credentials = RunCredentials.load_or_create(self.run_dir, self.run_id, names)
            auth = self.credentials.auth("pipeline")
            grants = {
                s.name: StageGrant(frozenset(s.published_families()), s.written_kv_keys())
                for s in self.stages
            }
            authorization = self.credentials.server_authorization(grants)
            # spawned on the loop's thread (it lives as long as the run), so the server's
            # parent-death signal fires only when the run's process dies
            self._server = NatsServer(
                self.run_dir / "nats", authorization=authorization, host=self.nats_host
            ).spawn()
            await asyncio.to_thread(self._server.wait_ready)
            url = self._server.url
        limits = self.replay.limits if self.replay else None
        streams = default_streams(max_msgs=self.stream_max_msgs, replay=limits)
        self._bus = await self._connect(NatsBus(self.subjects, url, streams=streams, auth=auth))
        self.connected_url = url

    async def _connect(self, bus: NatsBus) -> NatsBus:
        try:
            await asyncio.wait_for(bus.connect(), timeout=self.connect_timeout)
        except (TimeoutError, OSError, nats.errors.Error, BusError) as exc:
            with contextlib.suppress(Exception):
                await bus.close()
            raise PipelineError(f"cannot connect to NATS at {bus.url}: {exc or repr(exc)}") from exc
        return bus

    async def _stage_bus(self, stage: Stage) -> Bus:
        """The bus a stage works on: on the embedded server, a connection with the stage's
        own login (the server lets it publish only what it declares); else the run's bus."""
        if self.credentials is None or not isinstance(self.bus, NatsBus):
            return self.bus
        admin = self.bus
        bus = NatsBus(
            self.subjects,
            admin.url,
            streams=admin.streams,
            create_streams=False,
            auth=self.credentials.auth(stage_login(stage.name)),
        )
        self._stage_buses.append(await self._connect(bus))
        return bus

    def _check_replay_stream(self) -> None:
        """A replay writer on a bus without the replay stream would publish into the void."""
        if self.replay and not self.bus.is_durable(self.subjects.replay("trajectories")):
            raise StageError(
                "replay is set but the bus has no replay stream: build it with "
                "streams=default_streams(replay=settings.limits)"
            )

    async def start(self) -> None:
        if self._running:
            return
        if not self._entries:
            raise StageError("the pipeline has no stages")
        self._running = True
        self._started_at = time.time()
        try:
            await self._open_bus()
            self._check_replay_stream()
            self.runners = [
                StageRunner(
                    stage, await self._stage_bus(stage), replicas, drain_timeout=self.drain_timeout
                )
                for stage, replicas in self._entries
            ]
            for runner in self.runners:
                runner.ctx.run_dir = self.run_dir
                await runner.prepare()
            # downstream first, sources last: every consumer is ready before data flows
            for runner in sorted(self.runners, key=lambda r: r.stage.is_source):
                await runner.start()
        except BaseException:
            await self.stop()
            raise
        log.info("pipeline started", run=self.run_id, stages=[s.name for s in self.stages])

    async def wait(self) -> None:
        """Until every finite stage is complete (or ``stop()``); raise if a stage fails."""
        finite = [r.ctx.completed for r in self.runners if r.stage.finite]
        waiters = {asyncio.create_task(ev.wait()) for ev in finite}
        stop = asyncio.create_task(self._stop_requested.wait())
        pending: set[asyncio.Task[Any]] = {t for r in self.runners for t in r.tasks}
        pending |= waiters | {stop}
        if self.stall_timeout is not None:
            pending.add(asyncio.create_task(self._watch_stall(self.stall_timeout), name="stall"))
        if self._server is not None:
            pending.add(asyncio.create_task(self._watch_server(self._server), name="server"))
        try:
            while True:
                if finite and all(ev.is_set() for ev in finite):
                    self._completed = True
                    return
                if stop.done():
                    return
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task in waiters or task is stop or task.cancelled():
                        continue
                    exc = task.exception()
                    if isinstance(exc, PipelineError):  # the stall watch: its own message
                        raise exc
                    if exc is not None:
                        raise PipelineError(
                            f"stage task {task.get_name()} failed: {exc!r}"
                        ) from exc
        finally:
            watchers = (t for t in pending if t.get_name() in ("stall", "server"))
            for task in (*waiters, stop, *watchers):
                task.cancel()

    def _progress_mark(self) -> tuple[Any, ...]:
        return tuple(
            (
                r.stats.received,
                r.stats.processed,
                r.stats.published,
                r.stats.dead_lettered,
                r.stage.progress_done(),
            )
            for r in self.runners
        )

    async def _watch_stall(self, timeout: float) -> None:
        """Raise ``PipelineError`` once no stage has moved for ``timeout`` seconds."""
        mark, since = self._progress_mark(), time.monotonic()
        while True:
            await asyncio.sleep(min(5.0, timeout / 4))
            now_mark = self._progress_mark()
            if now_mark != mark:
                mark, since = now_mark, time.monotonic()
            elif time.monotonic() - since >= timeout:
                raise PipelineError(await self._stall_report(timeout))

    async def _watch_server(self, server: NatsServer) -> None:
        """Restart the embedded nats-server if it dies mid-run (same port, same JetStream
        store, so streams and consumers survive and the clients reconnect to the same URL);
        fail with the server's log named after ``MAX_SERVER_RESTARTS``."""
        while True:
            await asyncio.sleep(SERVER_POLL_S)
            code = server.exit_code
            if code is None or self._stop_requested.is_set():
                continue
            self.server_restarts += 1
            log_file = server.store_dir / "nats-server.log"
            if self.server_restarts > MAX_SERVER_RESTARTS:
                raise PipelineError(
                    f"the embedded nats-server at {server.url} exited (code {code}) "
                    f"{self.server_restarts} times; see {log_file}"
                )
            log.warning(
                "embedded nats-server exited; restarting it",
                code=code,
                url=server.url,
                restart=self.server_restarts,
                log=str(log_file),
            )
            server.spawn()  # on the loop's thread, as at start: it dies with this process
            await asyncio.to_thread(server.wait_ready)

    async def _stall_report(self, timeout: float) -> str:
        parts = []
        for r in self.runners:
            done = r.stage.progress_done()
            count = r.stats.processed if done is None else done
            total = r.stage.progress_total()
            parts.append(f"{r.stage.name} {count}{'' if total is None else f'/{total}'}")
        lines = [f"no stage made progress for {timeout:.0f} s: " + ", ".join(parts)]
        with contextlib.suppress(Exception):
            raw = await asyncio.wait_for(self.bus.kv_get(LEDGER_KEY), timeout=5)
            if raw:
                lines.append(f"dispatcher ledger: {raw.decode()[:1500]}")
        left = await self.left_in_streams_now()
        if left:
            lines.append("stored, not taken by any consumer: " + left_in_streams_text(left))
        return "\n".join(lines)

    async def open(self) -> None:
        """Open the run's bus (and its embedded server) without starting any stage: a
        supervisor whose stages run in other processes (``dora.pipeline.processes``)."""
        self._started_at = self._started_at or time.time()
        await self._open_bus()

    async def left_in_streams_now(self) -> dict[str, int]:
        """Messages still stored in the work and fan-out streams (``requests.v3``: 12): work no
        consumer took, e.g. a version's queue no engine serves, or prompts past the run's end.
        Empty when the bus cannot tell (it is gone)."""
        if self._bus is None:
            return {}
        left: dict[str, int] = {}
        prefix = self.subjects.root + "."
        try:
            for family in LEFTOVER_FAMILIES:
                subject = self.subjects.family(family)
                if not self._bus.is_durable(subject):
                    continue
                stored = await asyncio.wait_for(self._bus.stored_by_subject(subject), 5.0)
                left.update({k.removeprefix(prefix): n for k, n in sorted(stored.items()) if n})
        except Exception as exc:  # a report, not a reason to fail the shutdown
            log.debug("left_in_streams_unknown", error=f"{type(exc).__name__}: {exc}")
            return {}
        return left

    async def stop(self) -> None:
        """Drain and stop every stage, upstream first (the reverse of the order given), then
        close what the pipeline opened: what is in flight reaches the stages still running."""
        self._stop_requested.set()
        for runner in reversed(self.runners):
            try:
                await runner.stop()
            except Exception:
                log.exception("stage stop failed", stage=runner.stage.name)
        if self.runners:
            self.left_in_streams = await self.left_in_streams_now()
        for bus in self._stage_buses:
            with contextlib.suppress(Exception):
                await bus.close()
        self._stage_buses.clear()
        if self._owns_bus and self._bus is not None:
            with contextlib.suppress(Exception):
                await self._bus.close()
            self._bus = None
        if self._server is not None:
            await asyncio.to_thread(self._server.stop)
            self._server = None
        if self._running:
            self._finished_at = time.time()
        self._running = False

    async def run(self) -> dict[str, Any]:
        """Start, wait until finished, stop; returns the summary (also written to the run dir
        when the pipeline owns its bus)."""
        async with self:
            await self.wait()
        summary = self.summary()
        if self._owns_bus:
            self.write_summary(summary)
        return summary

    async def __aenter__(self) -> Pipeline:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ----------------------------------------------------------------- results

    @property
    def completed(self) -> bool:
        """Every finite stage finished (as opposed to a stop or a failure)."""
        return self._completed

    def summary(self) -> dict[str, Any]:
        end = self._finished_at or time.time()
        progress = self.progress()
        return {
            "pipeline": self.name,
            "run_id": self.run_id,
            "completed": self._completed,
            "started_at": self._started_at,
            "seconds": round(end - self._started_at, 3) if self._started_at else 0.0,
            "run_dir_bytes": folder_bytes(self.run_dir),
            "left_in_streams": self.left_in_streams,
            "stages": {
                r.stage.name: {**progress[r.stage.name], **r.stage.summary()} for r in self.runners
            },
        }

    def progress(self) -> dict[str, dict[str, Any]]:
        """Per stage: replicas, counters, and its own ``done``/``total`` where it counts
        them (cheap: the live view reads it several times a second)."""
        return {
            r.stage.name: {
                "replicas": r.replicas,
                "stats": r.stats.as_dict(),
                **_own_progress(r.stage),
            }
            for r in self.runners
        }

    def write_summary(self, summary: dict[str, Any] | None = None) -> Path:
        path = self.summary_file or self.run_dir / SUMMARY_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary or self.summary(), indent=2, sort_keys=True) + "\n")
        return path


LEFTOVER_FAMILIES = ("prompts", "requests", "trajectories", "scored")
"""Streams whose messages exist to be consumed (the others keep theirs as a record)."""


def left_in_streams_text(left: dict[str, int]) -> str:
    """``prompts 1,236, requests.v49 12``."""
    return ", ".join(f"{subject} {n:,}" for subject, n in left.items())


def folder_bytes(path: Path) -> int:
    """Bytes under ``path`` (0 when it does not exist): the run folder's size on disk, which
    the summary reports so a growing store is seen before it fills the disk."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def _own_progress(stage: Stage) -> dict[str, int]:
    """``{"done": n, "total": t}`` where the stage counts its own work (``progress_done``) or
    knows how much there is (``progress_total``)."""
    done, total = stage.progress_done(), stage.progress_total()
    return {
        **({} if done is None else {"done": done}),
        **({} if total is None else {"total": total}),
    }
