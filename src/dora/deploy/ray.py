"""``dora run --ray [ADDRESS]``: every stage replica as an async Ray actor.

Ray places the stages (each entry's ``resources`` and ``placement`` in the pipeline file);
NATS carries the data. An actor hosts exactly what ``dora stage serve`` hosts, loaded from
the same file and served by the same ``serve_until``: there is no second implementation of
any service, and nothing travels through Ray's object store but each replica's summary at
the end. A replica whose process dies is restarted by Ray (``max_restarts``) and its
``serve`` call retried; NATS redelivers what the dead one held, as under ``--processes``.
The driver starts the stages in the in-process order (consumers first), ends the run when
every finite stage (prompt source, learner) has finished, then drains the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from dora.bus.auth import NatsAuth, stage_login
from dora.files import write_atomically
from dora.pipeline.core import Pipeline, PipelineError
from dora.pipeline.processes import add_replica, merged_summary
from dora.pipeline.spec import StageEntry, read_pipeline_file

log = structlog.get_logger(__name__)

RAY_MISSING = "dora run --ray needs Ray: pip install 'dora-rl[ray]' (Ray 2.60)"
ACTORS_FILE = "actors.json"
"""Under the run folder: every stage actor with its node, pid and state, kept current."""
PROGRESS_EVERY_S = 1.0
PLACEMENT_TIMEOUT_S = 120.0


def require_ray() -> Any:
    """The ``ray`` module, or a PipelineError that names the extra to install."""
    try:
        import ray
    except ImportError as exc:
        raise PipelineError(RAY_MISSING) from exc
    return ray


def connect(address: str | None) -> None:
    """Join the Ray cluster at ``address``; none: start a local instance bound to loopback.
    Already connected (a test's cluster): nothing to do."""
    ray = require_ray()
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, logging_level="warning", log_to_driver=True)
    else:
        ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, logging_level="warning")


@dataclass(frozen=True)
class Launch:
    """What one actor needs to load its stage: the same arguments as ``dora stage serve``;
    the login travels inline (the actor may run on a node without the run folder's files)."""

    pipeline_file: str
    stage: str
    replica: int
    nats_url: str
    run_id: str
    run_dir: str
    auth: NatsAuth | None
    overrides: tuple[str, ...] = ()
    max_steps: int | None = None
    log_level: str = "warning"


class StageHost:
    """One stage replica inside a Ray actor (made remote by ``actor_class``)."""

    def __init__(self, launch: Launch) -> None:
        self.launch = launch
        self.pipeline: Pipeline | None = None
        self._started = asyncio.Event()
        self._stop = asyncio.Event()

    async def serve(self) -> dict[str, Any]:
        """Load the stage and serve it until it finishes or ``drain``; its summary."""
        from dora.cli.stage_cmd import serve_until
        from dora.logs import configure as configure_logs
        from dora.pipeline import load_pipeline

        launch = self.launch
        run_dir = Path(launch.run_dir)
        self.pipeline = pipeline = load_pipeline(
            Path(launch.pipeline_file),
            run_id=launch.run_id,
            nats_url=launch.nats_url,
            nats_auth=launch.auth,
            run_dir=run_dir,
            overrides=launch.overrides,
            max_steps=launch.max_steps,
        ).keep_only(launch.stage, 1, launch.replica)
        pipeline.stall_timeout = None  # the driver watches the run as a whole
        file_level = "debug" if launch.log_level == "debug" else "info"
        configure_logs(run_dir, launch.log_level, file_level=file_level)  # type: ignore[arg-type]
        structlog.contextvars.bind_contextvars(process=f"{launch.stage}-{launch.replica}")
        await serve_until(pipeline, self._stop, on_started=self._started.set)
        return pipeline.summary()

    async def ready(self) -> bool:
        """Returns once the stage has started (its consumers exist)."""
        await self._started.wait()
        return True

    def report(self) -> dict[str, Any]:
        """Its counters (once started) and where it runs, for the driver's live view."""
        started = self._started.is_set() and self.pipeline is not None
        progress = self.pipeline.progress() if started and self.pipeline else {}
        return {"progress": progress, "where": self.where()}

    def where(self) -> dict[str, Any]:
        """The node and process this replica runs in."""
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    async def drain(self) -> None:
        """Stop taking work, finish what is held, and let ``serve`` return (a coroutine, so
        the event is set on the actor's event loop, never from another thread)."""
        self._stop.set()


def actor_class() -> Any:
    return require_ray().remote(StageHost)


@dataclass
class Replica:
    """One stage replica's actor, as the driver sees it."""

    stage: str
    replica: int
    finite: bool
    entry: StageEntry
    actor: Any = None
    serving: asyncio.Future[Any] | None = None
    where: dict[str, Any] = field(default_factory=dict)
    progress: dict[str, Any] = field(default_factory=dict)
    finished: bool = False

    @property
    def name(self) -> str:
        return f"{self.stage}-{self.replica}"


class RayRun:
    """Run ``pipeline`` (loaded from ``pipeline_file``) with one Ray actor per stage replica;
    the same interface as ``ProcessRun`` for ``dora run``'s live view and summary."""

    def __init__(
        self,
        pipeline: Pipeline,
        pipeline_file: Path,
        *,
        overrides: list[str] | None = None,
        max_steps: int | None = None,
        log_level: str = "warning",
        max_restarts: int = 3,
    ) -> None:
        self.pipeline = pipeline
        self.pipeline_file = Path(pipeline_file).resolve()
        self.overrides = tuple(overrides or ())
        self.max_steps = max_steps
        self.log_level = log_level
        self.max_restarts = max_restarts
        self.children: list[Replica] = []
        self.completed = False
        self._stop = asyncio.Event()
        self._placement_groups: list[Any] = []
        self._started_at = 0.0
        self._finished_at = 0.0

    async def run(self) -> dict[str, Any]:
        """Until every finite stage finished (or ``stop()``); the merged summary."""
        require_ray()
        self._started_at = time.time()
        await self.pipeline.open()
        poller: asyncio.Task[None] | None = None
        try:
            self.children = self._plan()
            poller = asyncio.create_task(self._poll_progress())
            await self._start_in_order()
            await self._supervise()
        finally:
            if poller is not None:
                poller.cancel()
            await self._stop_actors()
            self.pipeline.left_in_streams = await self.pipeline.left_in_streams_now()
            await self.pipeline.stop()
            self._finished_at = time.time()
        return self.summary()

    def stop(self) -> None:
        """Drain every stage and end the run (Ctrl-C)."""
        self._stop.set()

    # ------------------------------------------------------------------ placement

    def _plan(self) -> list[Replica]:
        entries = read_pipeline_file(self.pipeline_file, self.overrides, self.max_steps).stages
        replicas = []
        for (stage, count), entry in zip(self.pipeline.entries, entries, strict=True):
            replicas += [Replica(stage.name, i, bool(stage.finite), entry) for i in range(count)]
        return replicas

    def _launch(self, replica: Replica) -> Launch:
        p = self.pipeline
        auth = None
        if p.credentials is not None:
            auth = NatsAuth.from_file(p.credentials.path(p.run_dir, stage_login(replica.stage)))
        return Launch(
            pipeline_file=str(self.pipeline_file),
            stage=replica.stage,
            replica=replica.replica,
            nats_url=p.connected_url or "",
            run_id=p.run_id,
            run_dir=str(p.run_dir.resolve()),
            auth=auth,
            overrides=self.overrides,
            max_steps=self.max_steps,
            log_level=self.log_level,
        )

    async def _options(self, group: list[Replica]) -> list[dict[str, Any]]:
        """``.options(...)`` per replica of one stage: its resources, and its bundle of the
        stage's placement group when the entry asks for one."""
        entry = group[0].entry
        res = entry.resources
        base: dict[str, Any] = {
            "num_cpus": res.num_cpus if res else 0,  # unstated: a light stage, placed anywhere
            "num_gpus": res.num_gpus if res else 0,
            "max_restarts": self.max_restarts,
            # a call is retried for as long as the actor comes back (a restarting actor fails
            # calls fast, which would spend any finite budget); max_restarts bounds it
            "max_task_retries": -1,
        }
        if res and res.custom:
            base["resources"] = dict(res.custom)
        if res and res.memory:
            base["memory"] = res.memory
        if entry.placement is None:
            return [dict(base) for _ in group]
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = {"CPU": base["num_cpus"], "GPU": base["num_gpus"], **base.get("resources", {})}
        bundle = {k: v for k, v in bundle.items() if v}
        if not bundle:
            raise PipelineError(
                f"stage {group[0].stage}: placement {entry.placement!r} needs resources "
                "(a bundle of nothing places nothing); give resources: {num_cpus: ...}"
            )
        pg = placement_group([bundle] * len(group), strategy=entry.placement.upper())
        self._placement_groups.append(pg)
        try:
            await asyncio.wait_for(asyncio.wrap_future(pg.ready().future()), PLACEMENT_TIMEOUT_S)
        except TimeoutError as exc:
            raise PipelineError(
                f"stage {group[0].stage}: the cluster cannot place {len(group)} x {bundle} "
                f"with strategy {entry.placement} (waited {PLACEMENT_TIMEOUT_S:g} s)"
            ) from exc
        return [
            {**base, "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, i)}
            for i in range(len(group))
        ]

    # ------------------------------------------------------------------ lifecycle

    async def _start_in_order(self) -> None:
        """Stage by stage, consumers first and sources last (as in one process): each stage's
        actors ready (consumers created) before the next stage starts."""
        host = actor_class()
        order = [s.name for s, _ in sorted(self.pipeline.entries, key=lambda e: e[0].is_source)]
        for stage in order:
            if self._stop.is_set():
                return
            group = [r for r in self.children if r.stage == stage]
            for replica, options in zip(group, await self._options(group), strict=True):
                name = f"dora-{self.pipeline.run_id}-{replica.name}"
                replica.actor = host.options(name=name, **options).remote(self._launch(replica))
                replica.serving = asyncio.wrap_future(replica.actor.serve.remote().future())
            for replica in group:
                await self._until_ready(replica)
            self._record()

    async def _until_ready(self, replica: Replica) -> None:
        assert replica.serving is not None
        ready = asyncio.wrap_future(replica.actor.ready.remote().future())
        stop = asyncio.create_task(self._stop.wait())
        try:
            await asyncio.wait({ready, replica.serving, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if replica.serving.done() and not ready.done():
            ready.cancel()
            raise PipelineError(f"stage actor {replica.name} ended while starting: "
                                f"{_failure(replica.serving)}")  # fmt: skip
        if ready.done():
            replica.where = await asyncio.wrap_future(replica.actor.where.remote().future())
            log.info("stage_actor_ready", actor=replica.name, **replica.where)

    async def _supervise(self) -> None:
        """Until every finite replica returned; a replica that fails after Ray's restarts
        fails the run."""
        stop = asyncio.create_task(self._stop.wait())
        try:
            pending = {r.serving: r for r in self.children if r.serving is not None}
            finite = [r for r in self.children if r.finite]
            while not (finite and all(r.finished for r in finite)):
                done, _ = await asyncio.wait({*pending, stop}, return_when=asyncio.FIRST_COMPLETED)
                if stop.done():
                    return
                for future in done:
                    replica = pending.pop(future)
                    if future.exception() is not None:
                        raise PipelineError(
                            f"stage actor {replica.name} failed after {self.max_restarts} "
                            f"restarts: {_failure(future)}"
                        )
                    replica.finished = True
                    final = future.result().get("stages", {}).get(replica.stage)
                    if final is not None:  # the live view's last word on it, not a poll's
                        replica.progress = {replica.stage: final}
                    log.info("stage_actor_finished", actor=replica.name)
                self._record()
            self.completed = True
        finally:
            stop.cancel()

    async def _stop_actors(self) -> None:
        """Drain every replica still serving, wait for it (bounded), then end the actors."""
        ray = require_ray()
        grace = self.pipeline.drain_timeout + 15
        serving = [r for r in self.children if r.serving is not None and not r.serving.done()]
        for replica in serving:
            with contextlib.suppress(Exception):
                replica.actor.drain.remote()
        if serving:  # they drain side by side, within one grace period
            await asyncio.wait([r.serving for r in serving if r.serving], timeout=grace)
        for replica in serving:
            assert replica.serving is not None
            if not replica.serving.done():
                log.warning("stage_actor_killed", actor=replica.name, after_s=grace)
            elif not replica.serving.cancelled() and replica.serving.exception() is not None:
                error = _failure(replica.serving)  # it failed while draining: logged, no summary
                log.warning("stage_actor_drain_failed", actor=replica.name, error=error)
        for replica in self.children:
            if replica.actor is not None:
                with contextlib.suppress(Exception):
                    ray.kill(replica.actor, no_restart=True)
        for pg in self._placement_groups:
            with contextlib.suppress(Exception):
                ray.util.remove_placement_group(pg)
        self._record()

    # ------------------------------------------------------------------ reports

    async def _poll_progress(self) -> None:
        """Each serving replica's counters and whereabouts (a restarted actor may have moved
        to another node), every second; ``actors.json`` kept current."""
        while True:
            for replica in self.children:
                if replica.actor is None or replica.finished:
                    continue
                with contextlib.suppress(Exception):
                    ref = replica.actor.report.remote()
                    report = await asyncio.wait_for(
                        asyncio.wrap_future(ref.future()), PROGRESS_EVERY_S * 5
                    )
                    replica.progress, replica.where = report["progress"], report["where"]
            self._record()
            await asyncio.sleep(PROGRESS_EVERY_S)

    def _record(self) -> None:
        """``RUN_DIR/actors.json``: which node runs which replica."""
        record = {
            r.name: {
                "stage": r.stage,
                **r.where,
                "running": r.serving is not None and not r.serving.done(),
                "finished": r.finished,
            }
            for r in self.children
        }
        write_atomically(self.pipeline.run_dir / ACTORS_FILE, json.dumps(record, indent=2) + "\n")

    def progress_line(self) -> str:
        up = sum(r.serving is not None and not r.serving.done() for r in self.children)
        nodes = len({r.where.get("node_id") for r in self.children if r.where})
        done = [r.name for r in self.children if r.finished]
        line = f"ray: {up}/{len(self.children)} actors serving on {nodes} nodes"
        return line + (f", finished: {', '.join(done)}" if done else "")

    def progress(self) -> dict[str, dict[str, Any]]:
        merged: dict[str, dict[str, Any]] = {}
        for replica in self.children:
            info = replica.progress.get(replica.stage)
            if info is not None:
                add_replica(merged, replica.stage, info)
        return merged

    def summary(self) -> dict[str, Any]:
        """The in-process summary's shape, merged from each replica's own summary."""
        reports = []
        for replica in self.children:
            future = replica.serving
            if future is None or not future.done() or future.exception() is not None:
                continue
            info = future.result().get("stages", {}).get(replica.stage)
            if info is not None:
                reports.append((replica.stage, info))
        return merged_summary(
            self.pipeline,
            reports,
            completed=self.completed,
            started_at=self._started_at,
            finished_at=self._finished_at,
            actors={r.name: dict(r.where) for r in self.children},
        )


def _failure(future: asyncio.Future[Any]) -> str:
    exc = future.exception() if future.done() and not future.cancelled() else None
    return "cancelled" if exc is None else f"{type(exc).__name__}: {str(exc)[-2000:]}"
