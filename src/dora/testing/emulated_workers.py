"""The worker side of the emulated fleet: generators over paced timing engines, and the front
(dispatcher + scorer).

``serve_engines`` runs a slice of the fleet's generators on one event loop until told to stop,
``serve_front`` the dispatcher and the scorer; ``role_process`` runs either in a separate OS
process (its own NATS client, its own loop), as separate services would in production.
Splitting the fleet over processes matters here for a practical reason: every CPU second the
emulation spends is ``time_scale`` emulated seconds, and one Python process on a loaded
two-core machine gets less than one core.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import multiprocessing as mp
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from dora.bus import Bus, Consumer, ConsumerSpec, ConsumerState, Message, NatsBus
from dora.engines.sim import workload_preset
from dora.events import SamplingParams, ScoredTrajectory, Trajectory, WeightVersion
from dora.rollout.dispatch_service import DispatchService
from dora.rollout.dispatcher import Dispatcher, DispatcherConfig
from dora.rollout.generator import Generator
from dora.rollout.generator_config import GeneratorConfig
from dora.subjects import Subjects
from dora.testing.emulated_engine import GroupSpecs, PacedSimEngine, TraceEvent

log = structlog.get_logger(__name__)


@dataclass
class EngineReport:
    """What a slice of engines did (virtual seconds of decode, generator counters)."""

    decode_s: float = 0.0
    """Decode time of the slice when the learner published its last version."""
    decode_s_at_stop: float = 0.0
    pulled: int = 0
    finished: int = 0
    exported: int = 0
    imported: int = 0
    resubmitted: int = 0
    dead_lettered: int = 0
    failures: list[str] = field(default_factory=list)
    traces: dict[str, list[TraceEvent]] = field(default_factory=dict)
    """Per engine: what happened when (``PacedSimEngine.trace``)."""
    busy: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    """Per engine at the stop: virtual seconds of decode, prefill and weight loads."""


class _RequestConsumer(Consumer):
    """A request-queue consumer that fetches at most ``cap`` messages (None: no cap) and
    wakes ``engine`` when it got some."""

    def __init__(self, inner: Consumer, engine: PacedSimEngine, cap: int | None) -> None:
        self.inner = inner
        self.spec = inner.spec
        self.engine = engine
        self.cap = cap

    async def fetch(self, batch: int = 1, timeout: float = 1.0) -> list[Message]:
        msgs = await self.inner.fetch(batch if self.cap is None else min(batch, self.cap), timeout)
        if msgs:
            self.engine.wake()
        return msgs

    async def state(self) -> ConsumerState:
        return await self.inner.state()

    async def close(self) -> None:
        await self.inner.close()


class GeneratorBus:
    """``bus`` as one emulated generator sees it: request-queue pulls capped at ``pull_batch``
    messages, and the engine's pacing sleep cut short when work arrives for it.

    Why the cap: a generator fetches as many requests as it has room for (``max_running``
    minus what it holds, ~40 here). With fewer requests than the fleet has slots (every mode
    at K=1 on this setting), the first engine to pull after a burst takes up to its whole
    room and the others get none; nats-py also keeps a fetch that got some messages open
    until it is full or times out, so an idle engine waits for more before starting any.
    Placement then follows who pulled first, not load. The baselines dora is compared with
    route each request to a server by load (AReaL round-robin, slime's sglang-router) and
    the simulator spreads a burst least-loaded first; with one request per pull, waiting
    pulls are served in arrival order, so a burst goes round-robin over the engines with
    room and each request starts as soon as it is delivered.

    Why the wake: every engine call queues behind a paced ``step()`` that may sleep
    ``max_sleep_s`` of wall time (``SimEngine.wake``); a delivered request or a control
    command wakes the engine first, as a real engine admits work at its next decode step.
    """

    def __init__(self, bus: Bus, engine: PacedSimEngine, pull_batch: int | None) -> None:
        if pull_batch is not None and pull_batch < 1:
            raise ValueError(f"pull_batch must be >= 1 or None, got {pull_batch}")
        self._bus = bus
        self.engine = engine
        self.pull_batch = pull_batch

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bus, name)

    async def consumer(self, spec: ConsumerSpec) -> Consumer:
        inner = await self._bus.consumer(spec)
        prefix = self._bus.subjects.requests_all.removesuffix("*")
        if spec.filter_subject.startswith(prefix):
            return _RequestConsumer(inner, self.engine, self.pull_batch)
        return inner

    async def serve(self, subject: str, handler: Callable[[bytes], Awaitable[bytes]]) -> Any:
        async def woken(data: bytes) -> bytes:
            self.engine.wake()
            return await handler(data)

        return await self._bus.serve(subject, woken)


async def _weights(version: int) -> dict[str, Any]:
    return {}  # timing engines ignore weights


async def _watch_final(
    bus: Bus, last: int, engines: list[PacedSimEngine], out: list[float]
) -> None:
    """Snapshot the slice's decode time when version ``last`` (the run's end) is announced."""
    sub = await bus.subscribe(bus.subjects.weights)
    try:
        async for msg in sub:
            with contextlib.suppress(ValueError):
                if WeightVersion.model_validate_json(msg.data).version >= last:
                    out.append(sum(e.core.decode_s for e in engines))
                    return
    finally:
        await sub.unsubscribe()


async def serve_engines(
    cfg: Any,
    max_seqs: int,
    engine_ids: list[str],
    bus: Bus,
    stop: Callable[[], Awaitable[None]],
    on_ready: Callable[[], None] = lambda: None,
) -> EngineReport:
    """Run generators for ``engine_ids`` (``cfg``: an ``EmulatedConfig``) until ``stop()``."""
    workload = workload_preset(cfg.workload)
    specs = GroupSpecs(workload, cfg.seed, cfg.group_size)
    admit = cfg.sim_config().admit_fraction  # as the simulator's cores
    engines = [
        PacedSimEngine(
            e, cfg.preset, workload, cfg.seed, cfg.time_scale, max_seqs, specs, admit_fraction=admit
        )
        for e in engine_ids
    ]
    status = max(cfg.wall(cfg.status_s), 0.005)
    generators = []
    for engine in engines:
        engine.core.version = 0  # the simulator starts with v0 loaded everywhere, too
        engine.restart_clock()
        config = GeneratorConfig(
            engine_id=engine.engine_id,
            mode=cfg.mode,
            max_running=max_seqs,
            fetch_timeout_s=status,
            status_interval_s=status,
            initial_version=0,
        )
        gen_bus = GeneratorBus(bus, engine, cfg.pull_batch)
        generators.append(Generator(engine, gen_bus, _weights, config))  # type: ignore[arg-type]
    tasks = [asyncio.create_task(g.run(), name=g.config.engine_id) for g in generators]
    final: list[float] = []
    watch = asyncio.create_task(_watch_final(bus, cfg.steps, engines, final))
    report = EngineReport()
    try:
        await asyncio.gather(*(g.ready.wait() for g in generators))
        on_ready()
        await stop()
    finally:
        for g in generators:
            g.stop()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch
    report.failures = [repr(r) for r in results if isinstance(r, BaseException)]
    report.decode_s_at_stop = sum(e.core.decode_s for e in engines)
    report.decode_s = final[0] if final else report.decode_s_at_stop
    for e in engines:
        report.traces[e.engine_id] = e.trace
        report.busy[e.engine_id] = (e.core.decode_s, e.core.prefill_s, e.core.load_s)
    for g in generators:
        s = g.stats
        report.pulled += s.pulled
        report.finished += s.finished
        report.exported += s.exported
        report.imported += s.imported
        report.resubmitted += s.resubmitted
        report.dead_lettered += s.dead_lettered
    return report


def trimmed(data: bytes) -> tuple[Trajectory, int, int]:
    """A ``Trajectory`` payload with one token left, and its completion and prompt token counts:
    what the learner stand-in needs (ids, group, version, and the oldest token's version,
    which a partial-rollout sample counts as).

    The stand-in trains on nothing, and validating ~60 KB of token JSON per sample costs the
    front's CPU ~2.5 ms (at 50x, one CPU second is 50 emulated seconds, and the dispatcher
    shares that loop), so the payload is decoded as plain JSON, cut, and only the cut one is
    validated; the scorer puts the counts in ``details``.
    """
    raw = json.loads(data)
    completion = raw.get("completion_token_ids") or []
    prompt = raw.get("prompt_token_ids") or []
    keep = 1 if completion else 0
    versions = raw.get("token_versions") or []
    if isinstance(raw.get("request"), dict):
        raw["request"]["resume"] = None
    raw.update(
        prompt_token_ids=prompt[:1],
        completion_token_ids=completion[:keep],
        logprobs=(raw.get("logprobs") or [])[:keep],
        loss_mask=(raw.get("loss_mask") or [])[:keep],
        # the learner counts a partial-rollout sample as its oldest token's version
        token_versions=[min(versions)] if versions and keep else [],
        turns=[],
    )
    return Trajectory.model_validate_json(json.dumps(raw)), len(completion), len(prompt)


async def scorer(bus: Bus, seen: Callable[[ScoredTrajectory], None] = lambda s: None) -> None:
    """A verifier stand-in: scores each trajectory (length parity) and forwards it trimmed;
    ``seen`` gets each scored sample before it is published."""
    consumer = await bus.consumer(ConsumerSpec("scorer", bus.subjects.trajectories))
    try:
        while True:
            for msg in await consumer.fetch(batch=64, timeout=0.2):
                traj, n, p = trimmed(msg.data)
                scored = ScoredTrajectory(
                    event_id=f"scored-{traj.request.request_id}",
                    trajectory=traj,
                    reward=float(n % 2),
                    details={"completion_tokens": n, "prompt_tokens": p},
                )
                seen(scored)
                await bus.publish_event(bus.subjects.scored, scored)
                await msg.ack()
    finally:
        await consumer.close()


@dataclass
class FrontReport:
    """What the dispatcher did."""

    requests: int = 0
    refusals: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


async def serve_front(
    cfg: Any,
    bus: Bus,
    stop: Callable[[], Awaitable[None]],
    on_ready: Callable[[], None] = lambda: None,
    seen: Callable[[ScoredTrajectory], None] = lambda s: None,
) -> FrontReport:
    """The dispatcher (prompts -> tagged requests) and the scorer, until ``stop()``."""
    workload = workload_preset(cfg.workload)
    dispatcher = Dispatcher(
        DispatcherConfig(
            group_size=cfg.group_size,
            batch_groups=cfg.batch_groups,
            staleness_bound=cfg.staleness,
            mode=cfg.mode,
            seed=cfg.seed,
            sampling=SamplingParams(temperature=1.0, max_tokens=workload.max_tokens),
        )
    )
    dispatch = DispatchService(bus, dispatcher, max_prompts=cfg.max_prompts)
    tasks = [
        asyncio.create_task(dispatch.run(), name="dispatcher"),
        asyncio.create_task(scorer(bus, seen), name="scorer"),
    ]
    on_ready()
    try:
        await stop()
    finally:
        dispatch.stop()
        tasks[1].cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
    failures = [
        repr(r)
        for r in results
        if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError)
    ]
    return FrontReport(dispatch.stats.requests, dict(dispatch.stats.refusals), failures)


def role_process(
    role: str,
    cfg: Any,
    max_seqs: int,
    engine_ids: list[str],
    url: str,
    run_id: str,
    stop_event: Any,
    results: Any,
    index: int,
) -> None:
    """Process entry: ``serve_engines`` (role "engines") or ``serve_front`` (role "front") on
    its own NATS client until ``stop_event`` is set.

    Puts ``("ready", index)`` once serving, then ``("done", index, report)`` (or
    ``("error", index, text)``) at the end.
    """
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))

    async def stop() -> None:
        while not stop_event.is_set():
            await asyncio.sleep(0.05)

    def ready() -> None:
        results.put(("ready", index))

    async def main() -> EngineReport | FrontReport:
        bus = NatsBus(Subjects(run_id), url)
        await bus.connect()
        try:
            if role == "front":
                return await serve_front(cfg, bus, stop, ready)
            return await serve_engines(cfg, max_seqs, engine_ids, bus, stop, ready)
        finally:
            await bus.close()

    try:
        results.put(("done", index, asyncio.run(main())))
    except BaseException as exc:  # report, never hang the parent
        results.put(("error", index, repr(exc)))


def split(items: list[str], parts: int) -> list[list[str]]:
    """``items`` in ``parts`` contiguous, near-equal slices (no empty slice)."""
    parts = max(1, min(parts, len(items)))
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        out.append(items[start:end])
        start = end
    return out


class WorkerProcesses:
    """``n`` engine slices in spawned processes;
    ``async with`` starts them and waits until each serves; the exit stops and joins them."""

    def __init__(self, cfg: Any, max_seqs: int, url: str, run_id: str, n: int) -> None:
        ids = [f"e{i}" for i in range(cfg.engines)]
        roles = [("engines", s) for s in split(ids, n)]
        ctx = mp.get_context("spawn")
        self.stop_event = ctx.Event()
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(
                target=role_process,
                args=(role, cfg, max_seqs, s, url, run_id, self.stop_event, self.results, i),
                name=f"dora-emulated-{role}-{i}",
                daemon=True,
            )
            for i, (role, s) in enumerate(roles)
        ]
        self.reports: list[EngineReport] = []
        self.front: FrontReport | None = None
        self.errors: list[str] = []

    async def _next(self, timeout: float) -> tuple[Any, ...]:
        return await asyncio.to_thread(self.results.get, True, timeout)

    async def __aenter__(self) -> WorkerProcesses:
        for p in self.procs:
            p.start()
        ready = 0
        deadline = time.monotonic() + 120
        while ready < len(self.procs):
            msg = await self._next(max(deadline - time.monotonic(), 0.1))
            if msg[0] == "ready":
                ready += 1
            else:
                raise RuntimeError(f"engine process {msg[1]} failed to start: {msg[2:]}")
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stop_event.set()
        try:
            for _ in self.procs:
                msg = await self._next(60)
                if msg[0] == "done" and isinstance(msg[2], FrontReport):
                    self.front = msg[2]
                elif msg[0] == "done":
                    self.reports.append(msg[2])
                else:
                    self.errors.append(f"engine process {msg[1]}: {msg[2]}")
        finally:
            for p in self.procs:
                await asyncio.to_thread(p.join, 10)
                if p.is_alive():
                    p.terminate()
                    await asyncio.to_thread(p.join, 5)
