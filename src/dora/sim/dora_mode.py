"""dora mode: multi-version streaming, driven by the live orchestrator's ``plan``.

Groups are tagged with the newest version as the staleness window admits them; engines serve
one version each; every ``plan_tick_s`` (and whenever a version is published) the simulator
builds the same ``ClusterState`` the live service builds from ``EngineStatus`` events, calls
``dora.rollout.orchestrator.plan`` and applies its actions with the live semantics:

- ``AssignEngine``: stop pulling other versions, finish the loaded version's requests, load
  the new weights when empty, then pull the new version's queue;
- ``DrainEngine``: stop pulling;
- ``MigrateRequests``: export, move the KV (``kv_bytes / migration_bw``, transfers from one
  source in series), import on the target: no re-prefill. ``dora_noreuse`` replaces the KV
  transfer by a re-prefill of prompt + generated on the target (the ablation);
- ``PrioritizeRequests``: raise the requests' priority in the engine's queue.
"""

from __future__ import annotations

import contextlib
from typing import Any

import structlog

from dora.engines.sim.core import SimRequest
from dora.rollout import orchestrator
from dora.rollout.actions import AssignEngine, DrainEngine, MigrateRequests, PrioritizeRequests
from dora.rollout.estimates import LengthRecorder
from dora.rollout.state import ClusterState, EngineView, RequestView
from dora.sim.baselines import StalenessWindow, StreamingDriver
from dora.sim.fleet import Group

log = structlog.get_logger(__name__)

BLOCK = 16
STATUS_S = 5.0
"""A busy engine's view is rebuilt at least this often (virtual s), like the live service's
status reports; in between it is reused while the engine's requests are unchanged."""
SCALE_ENGINES = 1024
"""Above this fleet size the status period and the debounce of event-driven plans grow in
proportion (10,000 engines: status every ~50 s, plans at most every ~10 s apart besides the
ticks), as a live service of that size would batch status reports; below, they are as stated."""


class DoraDriver(StreamingDriver):
    """Streaming multi-version rollout with KV migration (or re-prefill, for the ablation)."""

    def __init__(self, cfg: Any, plan_config: Any = None) -> None:
        super().__init__(cfg)
        self.reuse_kv = cfg.mode != "dora_noreuse"
        bw = cfg.migration_bw
        self.migration_bw = bw if bw is not None else cfg.cost.migration_bw
        # The action budget per call scales with the fleet: with 64 actions a 1,024-engine fleet
        # moved its freed engines to the newest version over many calls (measured: 118k vs
        # 172k tokens/s at 1,024 engines, K = 1); at <= 128 engines it is the live default.
        self.plan_config = plan_config or orchestrator.OrchestratorConfig(
            max_actions=max(64, cfg.engines // 2),
            max_migrated_requests=max(256, 2 * cfg.engines),
            migrate_urgent=cfg.migrate_urgent,
            relieve_preempted=cfg.relieve_preempted,
            fast_lane=cfg.fast_lane,
            fast_lane_batch=cfg.fast_lane_batch,
            fast_lane_min_s=cfg.fast_lane_min_s,
            weight_load_s=cfg.cost.weight_load_time,
            migration_s_per_block=cfg.cost.kv_bytes(BLOCK) / self.migration_bw,
            migration_s_per_request=cfg.cost.migration_fixed_s,
        )
        n = cfg.engines
        self.assigned: list[int | None] = [0] * n
        self.draining = [False] * n
        self.loading_until = [0.0] * n
        self.assigned_at: list[float | None] = [None] * n
        self.preemptions_seen = [0] * n
        self.last_migrated: dict[int, float] = {}
        self.lengths = LengthRecorder()
        self.migration_fallbacks = 0
        self._plan_pending = False
        self.scale = max(1.0, cfg.engines / SCALE_ENGINES)
        self._views: dict[int, tuple[tuple[object, ...], EngineView, float]] = {}
        self.actions: dict[str, int] = {}

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self.window = StalenessWindow(self.cfg.batch_groups, self.cfg.staleness, "dora")
        for e, core in enumerate(self.fleet.cores):
            core.version = 0
            self.fleet.hungry[0].add(e)
        self.top_up()
        self.tick()

    def top_up(self) -> None:
        """Admit groups tagged with the newest version that has an engine (dispatcher rule)."""
        fleet = self.fleet
        version = self.window.dispatcher.tag_version(self.assigned)
        if version is None:
            return
        n = self.window.admit(version)
        for group in fleet.dispatch_groups(version, n, self.cfg.start_order):
            self.window.dispatched_group(group)
        if n:
            fleet.feed(version)

    def tick(self) -> None:
        if self.fleet.stopped:
            return
        self.replan()
        self.fleet.at(self.fleet.now + self.cfg.plan_tick_s, self.tick)

    def on_group_done(self, group: Group) -> None:
        for req in group.requests:
            self.lengths.add(req.completion_tokens)
        self.window.finished_group(group)
        self.try_train()

    def after_train(self, step: int) -> None:
        self.window.published(step + 1)
        self.replan()
        self.top_up()
        self.try_train()

    def on_engine_event(self, e: int) -> None:
        core = self.fleet.cores[e]
        if self.plan_config.relieve_preempted and core.preemptions > self.preemptions_seen[e]:
            self.preemptions_seen[e] = core.preemptions
            self.request_plan()  # a preempted request waits: relief may move it
        if self.pulls(e):
            self.fleet.fill(e)
            if not core.has_work() and core.version != self.window.dispatcher.newest_version:
                self.request_plan()  # an old version's engine ran dry: it is free now
        elif not core.has_work():
            self.maybe_load(e)

    def request_plan(self) -> None:
        """Plan soon (debounced): the live orchestrator also reacts to status changes."""
        if self._plan_pending:
            return
        self._plan_pending = True

        def run() -> None:
            self._plan_pending = False
            if not self.fleet.stopped:
                self.replan()

        self.fleet.at(self.fleet.now + self.cfg.plan_debounce_s * self.scale, run)

    # ------------------------------------------------------------------ engine state
    def pulls(self, e: int) -> bool:
        core = self.fleet.cores[e]
        return (
            not self.draining[e]
            and self.assigned[e] is not None
            and self.assigned[e] == core.version
        )

    def maybe_load(self, e: int) -> None:
        """An empty engine whose assignment differs from its weights loads the new ones."""
        core = self.fleet.cores[e]
        target = self.assigned[e]
        if target is None or self.draining[e] or core.has_work() or core.version == target:
            return
        self.fleet.touch(e)
        self.loading_until[e] = core.load_weights(target, self.fleet.now)
        self.fleet.fill(e)
        self.fleet.schedule(e)

    # ------------------------------------------------------------------ plan
    def state(self) -> ClusterState:
        fleet = self.fleet
        now = fleet.now
        views = []
        max_tokens = self.cfg.workload.max_tokens
        migrated = self.last_migrated
        cache = self._views
        status_s = STATUS_S * self.scale
        assigned, draining, assigned_at = self.assigned, self.draining, self.assigned_at
        loading_until = self.loading_until
        for e, core in enumerate(fleet.cores):
            loading = loading_until[e] > now
            busy = core.has_work()
            hit = cache.get(e)
            if hit is not None and not loading and (not busy or now - hit[2] < status_s):
                k = hit[0]  # compared field by field: building a key tuple per engine is slow
                if (
                    k[4] == core.changes
                    and k[0] == core.version
                    and k[1] == assigned[e]
                    and k[2] == draining[e]
                    and k[3] == assigned_at[e]
                ):
                    views.append(hit[1])
                    continue
            if busy:
                fleet.touch(e)
            key = (core.version, assigned[e], draining[e], assigned_at[e], core.changes, loading)
            preempted = core.preempted_ids() if core.num_waiting else ()
            reqs = tuple(
                RequestView(
                    str(r.rid),
                    r.version,
                    r.generated,
                    max_tokens,
                    -(-r.context // BLOCK),
                    r.priority,
                    r.dispatched_at,
                    migrated.get(r.rid),
                    r.rid in preempted,
                )
                for r in core.requests()
            )
            if self.loading_until[e] > now:
                state = "loading"
            elif self.draining[e] or (core.version != self.assigned[e] and core.has_work()):
                state = "draining"
            elif core.version is None or self.assigned[e] is None:
                state = "idle"
            else:
                state = "serving"
            n = core.num_running
            views.append(
                EngineView(
                    engine_id=str(e),
                    state=state,
                    version=core.version,
                    assigned_version=self.assigned[e],
                    kv_blocks_total=core.capacity // BLOCK,
                    kv_blocks_used=-(-core.kv_used() // BLOCK),
                    block_size=BLOCK,
                    max_running=core.max_seqs,
                    tokens_per_s=n / core.cost.step_time(n, core.context) if n else 0.0,
                    waiting=core.num_waiting,
                    requests=reqs,
                    assigned_at=self.assigned_at[e],
                )
            )
            if state != "loading":
                cache[e] = (key, views[-1], now)
        return ClusterState(
            now=now,
            engines=tuple(views),
            queue_depths={v: len(q) for v, q in fleet.queues.items() if q},
            newest_version=self.step,
            learner_step=self.step,
            staleness_bound=self.cfg.staleness,
            lengths=self.lengths.model(),
        )

    def replan(self) -> None:
        self.plan_calls += 1
        for action in orchestrator.plan(self.state(), self.plan_config):
            name = f"{type(action).__name__}:{getattr(action, 'reason', '')}"
            self.actions[name] = self.actions.get(name, 0) + 1
            if isinstance(action, AssignEngine):
                self.assign(int(action.engine_id), action.version)
            elif isinstance(action, DrainEngine):
                self.drain(int(action.engine_id))
            elif isinstance(action, MigrateRequests):
                self.migrate(int(action.source), int(action.target), action.request_ids)
            elif isinstance(action, PrioritizeRequests):
                self.prioritize(int(action.engine_id), action.request_ids, action.priority)
            else:  # pragma: no cover - a new action type the simulator does not know
                raise TypeError(f"plan returned an unknown action {action!r}")

    # ------------------------------------------------------------------ actions
    def assign(self, e: int, version: int) -> None:
        fleet = self.fleet
        core = fleet.cores[e]
        if core.version is not None:
            fleet.hungry[core.version].discard(e)
        self.assigned[e] = version
        self.assigned_at[e] = fleet.now
        self.draining[e] = False
        fleet.touch(e)
        if core.version == version:
            fleet.fill(e)
            fleet.schedule(e)
        else:
            self.maybe_load(e)

    def drain(self, e: int) -> None:
        core = self.fleet.cores[e]
        self.draining[e] = True
        if core.version is not None:
            self.fleet.hungry[core.version].discard(e)

    def prioritize(self, e: int, rids: tuple[str, ...], priority: int) -> None:
        fleet = self.fleet
        fleet.touch(e)
        for rid in rids:
            with contextlib.suppress(KeyError):  # finished since the view was built
                fleet.cores[e].set_priority(int(rid), priority)
        fleet.schedule(e)

    def migrate(self, src: int, dst: int, rids: tuple[str, ...]) -> None:
        fleet = self.fleet
        source = fleet.cores[src]
        fleet.touch(src)
        delay = 0.0
        preempted = source.preempted_ids() if source.num_waiting else set()
        for rid in rids:
            try:
                req = source.remove(int(rid), keep_kv=self.reuse_kv)
            except KeyError:  # finished since the view was built
                continue
            req.migrations += 1
            self.last_migrated[req.rid] = fleet.now
            had_kv = req.rid not in preempted  # a preempted request moves as tokens only
            if self.reuse_kv:
                resident = req.context - req.prefill if had_kv else 0
                delay += source.cost.migration_time(resident, self.migration_bw)
                req.migrated_bytes += source.cost.kv_bytes(resident)
            fleet.at(fleet.now + delay, lambda req=req, kv=had_kv: self.arrive(dst, req, kv))
        fleet.schedule(src)
        if not source.has_work():
            self.maybe_load(src)

    def arrive(self, dst: int, req: SimRequest, had_kv: bool = True) -> None:
        """A moved request reaches its target; ``had_kv``: it held KV when it left (a
        preempted one did not, and its recompute was counted at the preemption)."""
        fleet = self.fleet
        target = fleet.cores[dst]
        fleet.touch(dst)
        lost = req.context if had_kv else 0
        if target.version != req.version:
            # the target changed version while the KV was in flight: re-prefill elsewhere
            self.migration_fallbacks += 1
            req.reprefilled += lost
            req.prefill = req.context
            fleet.queues[req.version].appendleft(req)
            fleet.feed(req.version)
            return
        if self.reuse_kv:
            target.import_request(req, fleet.now)
        else:
            req.reprefilled += lost
            target.add(req)
        fleet.schedule(dst)
