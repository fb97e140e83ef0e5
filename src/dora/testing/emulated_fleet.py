"""The emulated fleet: the real rollout stages on real NATS, with timing-model engines.

Everything a live run has is here (dispatcher, generators, orchestrator + migrator or the
baseline controller, a scorer, the learner's batching and staleness rules) except the compute:
each engine is a ``SimEngine`` whose virtual clock runs ``time_scale`` times faster than the
wall clock, and the learner stand-in sleeps for the step time of the simulator's trainer model.
So H200-class throughput of a whole fleet is measured on two CPU cores, in *emulated seconds*
(wall seconds x ``time_scale``), and can be checked against ``dora sim`` on the same setting.

What is aligned with the simulator so the two can be compared:

- response lengths: the n-th prompt is the simulator's group n (``Workload.group``), so both
  see the same lengths in the same dispatch order;
- engine limits: the simulator's tuned ``max_seqs`` caps each generator and engine;
- learner time: ``TrainerCost(gpus=engines).step_time(prompt + completion tokens, params)``,
  the simulator's model (6 FLOPs/param/token at 40% MFU on as many trainer GPUs as engines,
  plus 5 s per step), slept by the learner before it publishes the next version;
- orchestrator policy: the simulator's ``OrchestratorConfig`` with every duration divided by
  ``time_scale`` (the live service measures wall seconds) and engines reporting tokens per
  *wall* second;
- latency: orchestrator / controller ticks every ``tick_s`` and status reports every
  ``status_s`` emulated seconds (the simulator replans every 20 s, 1 s after an old-version
  engine runs dry, and at each publish).

What is not: every hop of the bus (dispatch, scoring, the learner's poll, control
round trips, a migration's export/import) takes real wall time, i.e. ``time_scale`` times as
much emulated time. ``loop_lag`` (how late a 10 ms timer fires on the event loop) is measured
during the run so a result distorted by an overloaded machine shows it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np
import structlog

from dora.bus import Bus, NatsBus
from dora.engines.sim import cost_preset, workload_preset
from dora.events import (
    BlobRef,
    Ledger,
    Prompt,
    ScoredTrajectory,
    WeightVersion,
)
from dora.rollout.baseline_controller import BaselineController
from dora.rollout.generator_config import RolloutMode
from dora.rollout.orchestrator import OrchestratorConfig
from dora.rollout.orchestrator_service import OrchestratorService, OrchestratorServiceConfig
from dora.sim import SimConfig
from dora.subjects import LEDGER_KEY, Subjects
from dora.testing.emulated_trace import Breakdown, breakdown
from dora.testing.emulated_workers import (
    EngineReport,
    FrontReport,
    WorkerProcesses,
    serve_engines,
    serve_front,
)
from dora.testing.learner_standin import LearnerStandin, StandinConfig
from dora.versions import announce

log = structlog.get_logger(__name__)

EMULATED_MODES: tuple[str, ...] = ("sync", "one_step_off", "partial", "dora")

_SCALED_DURATIONS = (
    "assign_cooldown_s",
    "migration_cooldown_s",
    "migration_s_per_request",
    "migration_s_per_block",
    "weight_load_s",
    "min_saving_s",
)


@dataclass(frozen=True)
class EmulatedConfig:
    """One emulated run. Sizes default to what two CPU cores emulate in about a minute."""

    mode: RolloutMode = "dora"
    engines: int = 16
    steps: int = 6
    batch_groups: int = 32
    group_size: int = 8
    staleness: int = 1
    seed: int = 0
    preset: str = "dense-32b"
    workload: str = "dapo-16k"
    time_scale: float = 50.0
    """Emulated seconds per wall-clock second."""
    tick_s: float = 2.0
    """Emulated seconds between orchestrator / controller ticks and learner polls."""
    status_s: float = 5.0
    """Emulated seconds between engine status reports (and idle pull polls)."""
    prompts: int | None = None
    """Prompts offered (None: enough that admission, not the supply, limits every mode)."""
    max_prompts: int | None = None
    """Stop dispatching after this many (tests: ``B * steps`` so every request finishes)."""
    timeout_s: float = 600.0
    """Wall-clock limit of the run."""
    processes: int = 2
    """OS processes the generators are spread over (0: all on the caller's event loop)."""
    pull_batch: int | None = 1
    """Most requests a generator takes per pull (None: as many as it has room for; see
    ``emulated_workers.PullCapBus``)."""
    admission: str = "slots"
    """Engine admission, as ``SimConfig.admission`` (the slot cap and KV watermark follow)."""
    relieve_preempted: bool = True
    """dora: the orchestrator relieves preempted requests (``plan``'s rule 6)."""

    def __post_init__(self) -> None:
        if self.mode not in EMULATED_MODES:
            raise ValueError(f"mode: unknown {self.mode!r}; known: {list(EMULATED_MODES)}")
        for name in ("engines", "steps", "batch_groups", "group_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {self.staleness}")
        if self.pull_batch is not None and self.pull_batch < 1:
            raise ValueError(f"pull_batch must be >= 1 or None, got {self.pull_batch}")
        for name in ("time_scale", "tick_s", "status_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        cost_preset(self.preset)  # clear errors naming the field
        workload_preset(self.workload)
        self.sim_config()  # admission and the rest, checked as the simulator checks them

    @property
    def prompt_count(self) -> int:
        return self.prompts or self.batch_groups * (self.steps + self.staleness + 2)

    def wall(self, emulated_s: float) -> float:
        """Wall-clock seconds of an emulated duration."""
        return emulated_s / self.time_scale

    def sim_config(self) -> SimConfig:
        """The simulator run this emulation is compared with."""
        return SimConfig(
            engines=self.engines,
            mode=self.mode,
            steps=self.steps,
            batch_groups=self.batch_groups,
            group_size=self.group_size,
            staleness=self.staleness,
            seed=self.seed,
            cost=cost_preset(self.preset),
            workload=workload_preset(self.workload),
            admission=self.admission,  # type: ignore[arg-type]
            relieve_preempted=self.relieve_preempted,
        )


def simulator_settings(cfg: EmulatedConfig) -> tuple[int, OrchestratorConfig]:
    """The simulator's tuned ``max_seqs`` and its dora-mode policy config (virtual seconds)."""
    from dora.sim.dora_mode import DoraDriver

    driver = DoraDriver(replace(cfg.sim_config(), mode="dora"))
    return driver.fleet.max_seqs, driver.plan_config


def scaled_policy(policy: OrchestratorConfig, time_scale: float) -> OrchestratorConfig:
    """``policy`` with durations in wall seconds and rates per wall second."""
    unknown = set(_SCALED_DURATIONS) - {f.name for f in fields(policy)}
    if unknown:
        raise ValueError(f"OrchestratorConfig has no field(s) {sorted(unknown)}")
    changes: dict[str, float] = {n: getattr(policy, n) / time_scale for n in _SCALED_DURATIONS}
    changes["decode_tokens_per_s"] = policy.decode_tokens_per_s * time_scale
    return replace(policy, **changes)


# --------------------------------------------------------------------------- run parts


@dataclass
class Sample:
    """What the scorer saw of one trajectory (times in wall seconds)."""

    version: int
    prompt_tokens: int
    completion_tokens: int
    dispatched_at: float
    finished_at: float
    migrations: int
    reprefilled: int

    @classmethod
    def of(cls, scored: ScoredTrajectory) -> Sample:
        traj, details = scored.trajectory, scored.details
        return cls(
            version=traj.version,
            prompt_tokens=int(details["prompt_tokens"]),
            completion_tokens=int(details["completion_tokens"]),
            dispatched_at=traj.request.dispatched_at,
            finished_at=traj.timings.finished_at,
            migrations=len(traj.migrations),
            reprefilled=traj.reprefilled_tokens,
        )


@dataclass
class StepTiming:
    """One learner step of the stand-in (wall seconds, ``time.time()``)."""

    step: int
    start: float
    end: float
    tokens: int
    completion_tokens: int
    request_ids: list[str]
    versions: list[int]


async def publish_weights(bus: Bus, version: int) -> None:
    """Announce ``version``: timing engines ignore weights, so the blob is a tiny inline ref."""
    name = f"sim-weights-v{version}"
    event = WeightVersion(
        event_id=f"weights-v{version}",
        version=version,
        blob=BlobRef(store="inline", name=name, size=0),
        checksum=hashlib.sha256(name.encode()).hexdigest(),
        step=max(version - 1, 0),
    )
    await announce(bus, event)


@dataclass
class TimedLearner:
    """The stand-in's ``publish_version``: sleeps the trainer model's step time, then publishes.

    The stand-in selects a batch (the learner's rules), records it, then calls this; sleeping
    here before the announcement is the step's training time.
    """

    bus: Bus
    cfg: EmulatedConfig
    samples: dict[str, Sample]
    standin: LearnerStandin | None = None
    steps: list[StepTiming] = field(default_factory=list)

    async def _samples(self, ids: list[str], timeout_s: float = 30.0) -> list[Sample]:
        """The batch's samples; ``collect`` reads the same stream as the stand-in, so it may
        lag the stand-in by a few milliseconds."""
        deadline = time.monotonic() + timeout_s
        while missing := [rid for rid in ids if rid not in self.samples]:
            if time.monotonic() > deadline:
                raise RuntimeError(f"samples never collected: {missing[:5]}")
            await asyncio.sleep(0.002)
        return [self.samples[rid] for rid in ids]

    async def publish(self, version: int) -> None:
        assert self.standin is not None
        record = self.standin.consumed[-1]
        start = time.time()
        got = await self._samples(record.request_ids)
        completion = sum(s.completion_tokens for s in got)
        tokens = completion + sum(s.prompt_tokens for s in got)
        sim = self.cfg.sim_config()
        await asyncio.sleep(self.cfg.wall(sim.learner.step_time(tokens, sim.cost.params)))
        end = time.time()
        self.steps.append(
            StepTiming(
                record.step, start, end, tokens, completion, record.request_ids, record.versions
            )
        )
        await publish_weights(self.bus, version)


async def loop_lag(out: list[float], period_s: float = 0.01) -> None:
    """Append how late each ``period_s`` timer fires: the event loop's responsiveness."""
    while True:
        t = time.perf_counter()
        await asyncio.sleep(period_s)
        out.append(max(time.perf_counter() - t - period_s, 0.0))


@dataclass
class EmulatedRun:
    """Raw outcome of one emulated run (wall seconds); ``summary`` reduces it."""

    cfg: EmulatedConfig
    steps: list[StepTiming]
    samples: dict[str, Sample]
    decode_s: float
    dispatched: int
    duplicates: int
    wall_s: float
    failures: list[str]
    loop_lag_s: list[float]
    engines: list[EngineReport]
    refusals: dict[str, int]


async def run_emulated(
    cfg: EmulatedConfig, nats_url: str, run_id: str | None = None
) -> EmulatedRun:
    """One mode on ``cfg.engines`` paced timing engines, on the nats-server at ``nats_url``."""
    run_id = run_id or f"emu-{cfg.mode}-{uuid.uuid4().hex[:8]}"
    bus = NatsBus(Subjects(run_id), nats_url)
    await bus.connect()
    try:
        return await _run(cfg, bus)
    finally:
        await bus.close()


async def _run(cfg: EmulatedConfig, bus: NatsBus) -> EmulatedRun:
    t_wall = time.perf_counter()
    max_seqs, policy = simulator_settings(cfg)
    await publish_weights(bus, 0)
    for i in range(cfg.prompt_count):
        prompt = Prompt(event_id=f"prompt-{i}", prompt_id=f"p{i}", text=f"problem {i}")
        await bus.publish_event(bus.subjects.prompts, prompt)

    tick = max(cfg.wall(cfg.tick_s), 0.005)
    controller: OrchestratorService | BaselineController
    if cfg.mode == "dora":
        service = OrchestratorServiceConfig(
            tick_s=tick, policy=scaled_policy(policy, cfg.time_scale)
        )
        controller = OrchestratorService(bus, service)
    else:
        controller = BaselineController(bus, cfg.mode, tick_s=tick)  # type: ignore[arg-type]
    samples: dict[str, Sample] = {}
    learner = TimedLearner(bus, cfg, samples)
    standin = LearnerStandin(
        bus,
        StandinConfig(cfg.batch_groups, cfg.staleness, cfg.steps, ledger_poll_s=tick),
        learner.publish,
    )
    learner.standin = standin
    lags: list[float] = []
    workers = _Workers()
    background = [asyncio.create_task(loop_lag(lags), name="loop_lag")]

    def seen(scored: ScoredTrajectory) -> None:
        samples[scored.trajectory.request.request_id] = Sample.of(scored)

    try:
        async with workers.run(cfg, max_seqs, bus, seen):
            control = asyncio.create_task(controller.run(), name="controller")
            try:
                if not await _within(standin.run(), cfg.timeout_s):
                    workers.failures.append(
                        f"stalled: the learner took {len(learner.steps)} of {cfg.steps} steps "
                        f"in {cfg.timeout_s:.0f} s wall ({len(samples)} samples scored; "
                        f"{await _ledger_line(bus)})"
                    )
                if (
                    cfg.max_prompts is not None and not workers.failures
                ):  # every request must come back: wait for them
                    expected = cfg.max_prompts * cfg.group_size
                    deadline = time.monotonic() + cfg.timeout_s
                    while len(samples) < expected:
                        if time.monotonic() > deadline:
                            raise TimeoutError(f"{len(samples)} of {expected} trajectories")
                        await asyncio.sleep(0.05)
            finally:
                controller.stop()
                done = await asyncio.gather(control, return_exceptions=True)
                workers.failures += [repr(r) for r in done if isinstance(r, BaseException)]
    finally:
        for task in background:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    front = workers.front or FrontReport()
    failures = workers.failures + front.failures
    return EmulatedRun(
        cfg=cfg,
        steps=learner.steps,
        samples=dict(samples),
        decode_s=sum(r.decode_s for r in workers.engines),
        dispatched=front.requests,
        duplicates=standin.duplicates,
        wall_s=time.perf_counter() - t_wall,
        failures=failures + [f for r in workers.engines for f in r.failures],
        loop_lag_s=lags,
        engines=workers.engines,
        refusals=front.refusals,
    )


async def _within(coro: Any, timeout_s: float, grace_s: float = 5.0) -> bool:
    """Run ``coro`` for at most ``timeout_s``; False when it had to be cancelled.

    Not ``asyncio.wait_for``: when the timeout and a nats-py fetch completing race, the
    cancellation can be swallowed inside the client (seen on a loaded machine), and
    ``wait_for`` then waits for the task forever; a stalled run must end as "stalled".
    """
    task = asyncio.ensure_future(coro)
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if done:
        task.result()  # raise what stopped it
        return True
    task.cancel()
    await asyncio.wait({task}, timeout=grace_s)
    return False


async def _ledger_line(bus: Bus) -> str:
    """The dispatcher's ledger in one line (what a stalled learner was waiting for)."""
    raw = await bus.kv_get(LEDGER_KEY)
    if not raw:
        return "no ledger"
    ledger = Ledger.model_validate_json(raw)
    counts = " ".join(
        f"v{c.version}:{c.dispatched}/{c.finished}/{c.consumed}" for c in ledger.versions
    )
    return f"ledger step {ledger.learner_step}, dispatched/finished/consumed {counts}"


@dataclass
class _Workers:
    """The engines in ``cfg.processes`` processes (0: on this loop); the front (dispatcher +
    scorer) on this loop, where the scorer records each sample before the learner can see it."""

    engines: list[EngineReport] = field(default_factory=list)
    front: FrontReport | None = None
    failures: list[str] = field(default_factory=list)

    @contextlib.asynccontextmanager
    async def run(
        self,
        cfg: EmulatedConfig,
        max_seqs: int,
        bus: NatsBus,
        seen: Callable[[ScoredTrajectory], None],
    ) -> AsyncIterator[None]:
        if cfg.processes > 0:
            procs = WorkerProcesses(cfg, max_seqs, bus.url, bus.subjects.run, cfg.processes)
            try:
                async with procs, self._front(cfg, bus, seen, asyncio.Event()):
                    yield
            finally:
                self.engines.extend(procs.reports)
                self.failures.extend(procs.errors)
            return
        stop = asyncio.Event()
        ids = [f"e{i}" for i in range(cfg.engines)]
        ready = asyncio.Event()
        engines = asyncio.create_task(serve_engines(cfg, max_seqs, ids, bus, stop.wait, ready.set))
        waiter = asyncio.create_task(ready.wait())
        await asyncio.wait([engines, waiter], return_when=asyncio.FIRST_COMPLETED)
        if engines.done():
            waiter.cancel()
            engines.result()  # raises what stopped the engines
        try:
            async with self._front(cfg, bus, seen, stop):
                yield
        finally:
            self.engines.append(await engines)

    @contextlib.asynccontextmanager
    async def _front(
        self,
        cfg: EmulatedConfig,
        bus: NatsBus,
        seen: Callable[[ScoredTrajectory], None],
        stop: asyncio.Event,
    ) -> AsyncIterator[None]:
        """The front on this loop until the block ends; then ``stop`` (shared with in-loop
        engines) is set and the front's report kept."""
        front = asyncio.create_task(serve_front(cfg, bus, stop.wait, seen=seen))
        try:
            yield
        finally:
            stop.set()
            self.front = await front


def summarize(run: EmulatedRun) -> dict[str, Any]:
    """The simulator's metrics (``SimResult``) from an emulated run, in emulated seconds.

    Time 0 is the first dispatch (as in the simulator); the run ends when the last step's
    training ends. Tokens are the completion tokens of the consumed samples.
    """
    cfg, scale = run.cfg, run.cfg.time_scale
    if not run.steps:
        raise RuntimeError(f"{cfg.mode}: the learner took no step")
    t0 = min(s.dispatched_at for s in run.samples.values())
    end = run.steps[-1].end
    span = (end - t0) * scale
    tokens = sum(st.completion_tokens for st in run.steps)
    rollout, waits, trains = [], [], []
    prev = t0
    for st in run.steps:
        got = [run.samples[r] for r in st.request_ids]
        rollout.append(
            (max(s.finished_at for s in got) - min(s.dispatched_at for s in got)) * scale
        )
        waits.append(max(st.start - prev, 0.0) * scale)
        trains.append((st.end - st.start) * scale)
        prev = st.end
    stale = [st.step - v for st in run.steps for v in st.versions]
    samples = run.samples.values()
    lags = run.loop_lag_s
    parts = engine_time(run, t0, end)
    return {
        "mode": cfg.mode,
        "engines": cfg.engines,
        "steps": len(run.steps),
        "emulated_s": span,
        "tokens_per_s": tokens / span if span > 0 else 0.0,
        "step_s": span / len(run.steps),
        "rollout_s": float(np.mean(rollout)),
        "wait_s": float(np.mean(waits)),
        "train_s": float(np.mean(trains)),
        "utilization": run.decode_s / (cfg.engines * span) if span > 0 else 0.0,
        "migrations": sum(s.migrations for s in samples),
        "reprefilled_tokens": sum(s.reprefilled for s in samples),
        "staleness_mean": float(np.mean(stale)) if stale else 0.0,
        "staleness_max": max(stale) if stale else 0,
        "dispatched": run.dispatched,
        "trajectories": len(run.samples),
        "consumed_tokens": tokens,
        "wall_s": run.wall_s,
        "loop_lag_mean_ms": 1000 * float(np.mean(lags)) if lags else 0.0,
        "loop_lag_p99_ms": 1000 * float(np.percentile(lags, 99)) if lags else 0.0,
        "idle_queued": parts.fractions()["idle_queued"] if parts else None,
        "idle_empty": parts.fractions()["idle_empty"] if parts else None,
        "held_spread": parts.held_spread if parts else None,
        "pickup_s_mean": parts.pickup_s_mean if parts else None,
    }


def engine_time(run: EmulatedRun, start: float, end: float) -> Breakdown | None:
    """Where the engines' time went between ``start`` and ``end`` (wall seconds), from their
    traces; None when the run kept none."""
    traces = {e: t for r in run.engines for e, t in r.traces.items()}
    busy = {e: b for r in run.engines for e, b in r.busy.items()}
    if not traces:
        return None
    return breakdown(traces, busy, start, end, run.cfg.time_scale)
