"""The orchestrator policy: ``plan(state, config) -> list[Action]``, a pure function.

The live service, the simulator and the tests call the same function. It decides from one
``ClusterState`` snapshot, in this order (earlier rules win the action budget):

1. **Serve every queue.** A version with requests waiting in its queue and no engine pulling it
   gets one: un-drain a draining engine holding it, else a free engine (one already holding
   its weights first), else an engine switching away from it, else the least-loaded engine of
   a version that keeps another puller. A version is never left without a puller while its
   queue has work, and running requests always finish where they are (or migrate).
2. **Newest version present.** If no engine pulls the newest version, one is assigned, so the
   dispatcher can start tagging it (it tags the newest version with an assigned engine).
3. **Urgency.** Running requests of a version whose deadline step ``u + K`` is within
   ``urgency_horizon_steps`` of the learner's next step get ``urgent_priority``.
4. **No idle engine.** Free engines (idle, drained, or serving an old version with nothing left
   to pull) go where queued work exceeds the pullers' free slots (largest need first, engines
   already holding the weights first); with no such need, to the newest version.
5. **Proportional share.** Each version's share of the fleet is proportional to its
   outstanding requests (queued + running) divided by the learner steps left before its
   deadline (``steps_left + 1``: the rate it must be served at). A version with queued work
   and fewer pullers than its share takes engines from queued (or the newest) versions pulling
   more than theirs (nearly empty engines only, least-loaded first, outside cooldown, never a
   queue's last puller nor the newest's), when its queue outlasts a weight load. With several
   versions queued (K >= 2) a version otherwise got one engine from rule 1 and starved until
   engines ran dry (measured in ``dora sim`` at K = 3: 0.42 engine utilization without it).
6. **Relief.** A request an engine preempted when its KV filled holds no KV and waits
   behind the full cache; it moves (tokens only) to an engine serving its version with an
   open slot and KV headroom, where it resumes at once. Engines can then admit by KV
   headroom with a high slot cap: a preemption costs a recompute, not a stall.
7. **Fast lane** (off by default: measured in ``dora sim``, it does not pay on the
   dense-32B workload; see docs/performance.md). The cohort the learner waits for ends with
   its slowest request, which a full batch slows. Its critical requests (expected remaining
   time above ``fast_lane_min_s`` at their engine's rate, from the length history) move
   with their KV from crowded engines onto its engines running at most
   ``fast_lane_batch``, and onto idle engines holding its weights when no queue needs them.
8. **Consolidation.** For an old version whose queue is empty, engines with low occupancy are
   evacuated by migrating their requests (with KV) onto the fullest same-version engines that
   have room for the blocks plus their expected growth (first-fit decreasing), when the freed
   engine-time pays for the migration and some queue needs the freed engine; the evacuated
   engine is assigned the newest version. A target may itself be switching away (assigned a
   newer version, finishing this one's tail): it then takes only tails no longer than its
   own, so short tails are packed into long ones and its own switch is not delayed. An
   engine finishing another version's tail offers its assigned queue no slots until then.

Hysteresis: an engine assigned within ``assign_cooldown_s`` is not taken from a busy version
(free engines always move: idling is never useful); a request migrated within
``migration_cooldown_s`` is not migrated again; a migration must save more engine-time than
it costs. Work is O(engines + requests of consolidation candidates) per call.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from dataclasses import dataclass, fields
from typing import Any

from dora.rollout.actions import (
    Action,
    AssignEngine,
    DrainEngine,
    MigrateRequests,
    PrioritizeRequests,
)
from dora.rollout.packing import FirstFit
from dora.rollout.state import ClusterState, EngineView, RequestView

__all__ = ["DEFAULT_CONFIG", "Action", "OrchestratorConfig", "plan", "slots"]


@dataclass(frozen=True)
class OrchestratorConfig:
    """Thresholds, cooldowns and costs of the policy (seconds unless stated)."""

    max_actions: int = 64
    """Most actions per call (a migration of several requests to one target is one action)."""
    max_migrated_requests: int = 256
    """Most requests moved per call."""
    assign_cooldown_s: float = 10.0
    """An engine assigned more recently than this is not taken away from busy work."""
    migration_cooldown_s: float = 30.0
    """A request migrated more recently than this is not migrated again."""
    consolidate_below: float = 0.5
    """Engines of an old version whose occupancy is below this are evacuation candidates."""
    target_fill: float = 0.9
    """A migration target is filled to at most this fraction of its KV blocks and slots."""
    reserve_growth: bool = True
    """Reserve KV blocks for the expected remaining tokens of migrated requests."""
    migration_s_per_request: float = 0.05
    """Fixed cost of moving one request (export, import, control round trips)."""
    migration_s_per_block: float = 0.002
    """Transfer cost per KV block."""
    weight_load_s: float = 5.0
    """Time to load a version's weights; an engine is loaded with an old version only when
    that version's queue would take longer than this to drain with its current pullers."""
    min_saving_s: float = 1.0
    """A consolidation must free the source this much earlier than its tail would, beyond
    the migration cost counted twice (the stall of the moved requests and the transfer)."""
    decode_tokens_per_s: float = 30.0
    """Per-request decode rate assumed when an engine reports no throughput."""
    default_slots: int = 64
    """Concurrent requests of an engine that reports ``max_running == 0``."""
    urgent_priority: int = 10
    max_prioritize_actions: int = 16
    """Most Prioritize actions per call (one per engine), so urgency never starves placement
    and consolidation; the service remembers raised priorities, so the rest follow next call."""
    urgency_horizon_steps: int = 0
    """A version is urgent when ``u + K - learner_step <= this`` (0: the next step needs it)."""
    migrate_urgent: bool = True
    """Allow migrating urgent requests. A move stalls them ``mig_s`` (the learner waits for
    them), but with K = 1 the previous version is always urgent and its long tail is exactly
    what consolidation is for; the pays-for-itself test bounds the stall."""
    min_newest_engines: int = 1
    consolidate_without_demand: bool = False
    """Consolidate even when no queue needs the freed engines (default: do not)."""
    migrate: bool = True
    """Consolidate by KV migration (False: the no-migration ablation)."""
    relieve_preempted: bool = True
    """Rule 6: move preempted requests (no KV held) to same-version engines with room."""
    fast_lane: bool = False
    """Rule 7: move an urgent version's critical requests, with their KV, off crowded engines
    onto its engines running at most ``fast_lane_batch`` requests, where they decode faster."""
    fast_lane_batch: int = 4
    """A lane engine runs at most this many requests."""
    fast_lane_min_s: float = 60.0
    """A request is critical when its expected remaining time at its engine's current
    per-request rate exceeds this."""
    rebalance: bool = True
    """Rule 5 (proportional share); False restores first-come placement only."""
    reassign_busy_to_newest: bool = False
    """Partial-rollout baseline: assign every engine the newest version at once (its running
    requests are resumed under the new weights by the generator, with re-prefill)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, int | float) and not isinstance(value, bool) and value < 0:
                raise ValueError(f"OrchestratorConfig.{f.name} must be >= 0, got {value}")
        if not 0.0 < self.target_fill <= 1.0:
            raise ValueError(
                f"OrchestratorConfig.target_fill must be in (0, 1], got {self.target_fill}"
            )
        if self.max_actions < 1:
            raise ValueError("OrchestratorConfig.max_actions must be >= 1")


DEFAULT_CONFIG = OrchestratorConfig()


def plan(state: ClusterState, config: OrchestratorConfig = DEFAULT_CONFIG) -> list[Action]:
    """Decide this round's actions; pure and deterministic (see the module docstring)."""
    return _Planner(state, config).run()


def slots(engine: EngineView, config: OrchestratorConfig) -> int:
    """Concurrent request slots of an engine."""
    return engine.max_running or config.default_slots


class _Planner:
    """One call's scratch state. Engines are visited in ``engine_id`` order (determinism)."""

    def __init__(self, state: ClusterState, config: OrchestratorConfig) -> None:
        self.state = state
        self.config = config
        self.newest = state.newest_version
        self.now = state.now
        self.actions: list[Action] = []
        self.migrated = 0
        self.taken: set[str] = set()
        self.worth: dict[int, bool] = {}
        self.queues = {v: d for v, d in state.queue_depths.items() if d > 0}
        self.pullers: dict[int, dict[str, EngineView]] = defaultdict(dict)
        self.free_slots: dict[int, int] = defaultdict(int)
        self.holders: dict[int, list[EngineView]] = defaultdict(list)
        self.draining: dict[int, list[EngineView]] = defaultdict(list)
        self.free: list[EngineView] = []
        self.parked: list[EngineView] = []
        """Busy engines that pull nothing (draining, or unassigned with requests left)."""
        self.usable: list[EngineView] = []
        newest, queues = self.newest, self.queues
        for e in sorted(state.engines, key=_engine_id):
            st = e.state
            if st == "stopped":
                continue
            self.usable.append(e)
            reqs = e.requests
            run = len(reqs)
            if run:
                self.holders[e.version if e.version is not None else reqs[0].version].append(e)
            pv = e.assigned_version if st == "serving" or st == "loading" else None
            if pv is not None:
                self.pullers[pv][e.engine_id] = e
                self.free_slots[pv] += self.open_slots(e)
            elif st == "draining" and e.version is not None:
                self.draining[e.version].append(e)
            if pv is None or (pv != newest and pv not in queues):
                if run == 0 and e.waiting == 0 and st != "loading":
                    self.free.append(e)
                elif pv is None:
                    self.parked.append(e)

    # ------------------------------------------------------------------ helpers

    def room(self, n: int = 1) -> bool:
        return len(self.actions) + n <= self.config.max_actions

    def cooling(self, e: EngineView) -> bool:
        at = e.assigned_at
        return at is not None and self.now - at < self.config.assign_cooldown_s

    def open_slots(self, e: EngineView, version: int | None = None) -> int:
        """Slots of ``e`` that requests of ``version`` (default: the one it pulls) can fill
        now: none while it still runs another version's requests (it takes the queue only
        after they finish or move and the weights load). Counting those slots hid a queue's
        need behind engines that could not serve it, and consolidation never ran."""
        version = e.pulls if version is None else version
        if e.requests and e.version is not None and e.version != version:
            return 0
        return max(0, slots(e, self.config) - e.running - e.waiting)

    def assign(self, e: EngineView, version: int, reason: str) -> None:
        """Record an assignment and keep the pullers/slots bookkeeping in step."""
        old = e.pulls
        if old is not None and self.pullers[old].pop(e.engine_id, None) is not None:
            self.free_slots[old] -= self.open_slots(e)
        self.pullers[version][e.engine_id] = e
        self.free_slots[version] += self.open_slots(e, version)
        self.taken.add(e.engine_id)
        if not (e.state in ("serving", "loading") and e.assigned_version == version):
            self.actions.append(AssignEngine(e.engine_id, version, reason))

    def need(self, version: int) -> int:
        return self.queues.get(version, 0) - self.free_slots[version]

    def take_free(self, prefer_loaded: int | None) -> EngineView | None:
        best = None
        for e in self.free:
            if e.engine_id in self.taken:
                continue
            if prefer_loaded is None or e.version == prefer_loaded:
                return e
            if best is None:
                best = e
        return best

    def take_parked(self) -> EngineView | None:
        """Least-loaded busy engine that pulls nothing: taking it costs no queue a puller."""
        best: EngineView | None = None
        for e in self.parked:
            if e.engine_id not in self.taken and (
                best is None or (e.running, e.engine_id) < (best.running, best.engine_id)
            ):
                best = e
        return best

    def take_busy(
        self, version: int, respect_cooldown: bool, keep_newest: bool = True
    ) -> EngineView | None:
        """Least-loaded engine pulling a version that keeps another puller (or needs none);
        with ``keep_newest`` the newest version's last puller is kept too."""
        best: EngineView | None = None
        for v in sorted(self.pullers):
            if v == version:
                continue
            live = [e for e in self.pullers[v].values() if e.engine_id not in self.taken]
            if len(live) < 2 and (v in self.queues or (keep_newest and v == self.newest)):
                continue
            for e in live:
                if respect_cooldown and self.cooling(e):
                    continue
                if best is None or (e.running, e.kv_blocks_used, e.engine_id) < (
                    best.running,
                    best.kv_blocks_used,
                    best.engine_id,
                ):
                    best = e
        return best

    # ------------------------------------------------------------------ rules

    def run(self) -> list[Action]:
        self.serve_queues()
        self.newest_present()
        if self.config.fast_lane and self.config.migrate:
            self.fast_lane()
        self.place_free()
        if self.config.rebalance:
            self.rebalance()
        self.prioritize_urgent()
        if self.config.relieve_preempted:
            self.relieve()
        if self.config.reassign_busy_to_newest:
            self.all_to_newest()
        elif self.config.migrate:
            self.consolidate()
        return self.actions

    def all_to_newest(self) -> None:
        for e in self.usable:
            if e.engine_id in self.taken or e.pulls == self.newest or not self.room():
                continue
            if e.state in ("serving", "loading", "draining", "idle"):
                self.assign(e, self.newest, "partial-rollout")

    def serve_queues(self) -> None:
        for v in sorted(self.queues):
            if self.pullers[v]:
                continue
            if not self.room():
                return
            pick = next(
                (e for e in self.draining.get(v, ()) if e.engine_id not in self.taken), None
            )
            if pick is None:
                pick = self.take_free(prefer_loaded=v)
            if pick is None:
                pick = next(
                    (
                        e
                        for e in self.holders.get(v, ())
                        if e.engine_id not in self.taken
                        and e.pulls not in (v, None)
                        and (len(self.pullers[e.pulls]) > 1 or e.pulls not in self.queues)
                    ),
                    None,
                )
            if pick is None:
                pick = self.take_parked()
            for cooldown, keep in ((True, True), (False, True), (False, False)):
                if pick is None:
                    pick = self.take_busy(v, respect_cooldown=cooldown, keep_newest=keep)
            if pick is not None:
                self.assign(pick, v, "serve-queue")

    def newest_present(self) -> None:
        want = min(self.config.min_newest_engines, len(self.usable))
        while len(self.pullers[self.newest]) < want and self.room():
            pick = (
                self.take_free(prefer_loaded=self.newest)
                or self.take_parked()
                or self.take_busy(self.newest, respect_cooldown=True)
            )
            if pick is None:
                return
            self.assign(pick, self.newest, "newest-present")

    def prioritize_urgent(self) -> None:
        horizon = self.config.urgency_horizon_steps
        prio = self.config.urgent_priority
        cap = len(self.actions) + self.config.max_prioritize_actions
        for v in sorted(self.holders):
            if self.state.steps_left(v) > horizon:
                continue
            for e in self.holders[v]:
                ids = tuple(r.request_id for r in e.requests if r.priority < prio)
                if ids:
                    if not self.room() or len(self.actions) >= cap:
                        return
                    self.actions.append(PrioritizeRequests(e.engine_id, ids, prio, "urgent"))

    def place_free(self) -> None:
        lengths = self.state.lengths
        for e in self.free:
            if e.engine_id in self.taken:
                continue
            if not self.room():
                return
            choice = None
            if e.version is not None and self.need(e.version) > 0:
                choice = e.version
            else:
                best_need = 0
                for v in sorted(self.queues):
                    need = self.need(v)
                    if need <= best_need:
                        continue
                    if v != self.newest and not self.worth_loading(v, lengths.mean):
                        continue
                    choice, best_need = v, need
            self.assign(e, self.newest if choice is None else choice, "place-free")

    def shares(self) -> dict[int, float]:
        """Engines each version should pull for: fleet x weighted outstanding work."""
        work: dict[int, int] = defaultdict(int)
        for v, d in self.queues.items():
            work[v] += d
        for v, engines in self.holders.items():
            for e in engines:
                work[v] += len(e.requests) + e.waiting
        weights = {
            v: n / (max(0, self.state.steps_left(v)) + 1.0) for v, n in work.items() if n > 0
        }
        total = sum(weights.values())
        if total <= 0:
            return {}
        pulling = sum(len(p) for p in self.pullers.values())
        return {v: pulling * w / total for v, w in weights.items()}

    def rebalance(self) -> None:
        """Rule 5: move pullers from over-served versions to under-served queued ones."""
        if not self.queues:
            return
        share = self.shares()
        lengths = self.state.lengths
        # most under-served first (largest shortfall relative to its share), then oldest
        order = sorted(self.queues, key=lambda v: (len(self.pullers[v]) - share.get(v, 0.0), v))
        donors: list[tuple[int, int, str, EngineView]] | None = None
        for v in order:
            want = math.floor(share.get(v, 0.0))
            if len(self.pullers[v]) >= want:
                continue
            if v != self.newest and not self.worth_loading(v, lengths.mean):
                continue
            if donors is None:  # lazily: most calls have nothing to rebalance
                # Donors pull real work (one pulling an old version with an empty queue is
                # freed by consolidation or when it runs dry, rule 4) and are nearly empty: a
                # moved engine must finish its requests before it loads, and a full one would
                # decode its long tail at a small batch for minutes (measured: K = 2 lost 23%
                # of tokens/s when full engines were moved).
                donors = sorted(
                    (e.running + e.waiting, e.kv_blocks_used, e.engine_id, e)
                    for x, engines in self.pullers.items()
                    if x in self.queues or x == self.newest
                    for e in engines.values()
                    if e.engine_id not in self.taken
                    and not self.cooling(e)
                    and e.occupancy < self.config.consolidate_below
                )
            for _, _, eid, e in donors:
                if len(self.pullers[v]) >= want or not self.room():
                    break
                x = e.pulls
                if eid in self.taken or x is None or x == v:
                    continue
                keep = math.ceil(share.get(x, 0.0))
                if x in self.queues or x == self.newest:
                    keep = max(keep, 1)
                if len(self.pullers[x]) <= keep:
                    continue
                self.assign(e, v, "rebalance")
            donors = [d for d in donors if d[2] not in self.taken]

    def worth_loading(self, version: int, mean_length: float) -> bool:
        """An old version's queue must outlast a weight load to justify loading it."""
        if version not in self.worth:
            self.worth[version] = self._worth_loading(version, mean_length)
        return self.worth[version]

    def _worth_loading(self, version: int, mean_length: float) -> bool:
        pullers = self.pullers[version]
        if not pullers:
            return True
        per_req = self.config.decode_tokens_per_s
        rate = sum(slots(e, self.config) for e in pullers.values()) * per_req
        tokens = self.queues.get(version, 0) * max(mean_length, 1.0)
        return tokens / rate > self.config.weight_load_s

    # ------------------------------------------------------------------ relief

    def relieve(self) -> None:
        """Rule 6: preempted requests to same-version engines with open slots and KV room,
        most room first; oldest dispatched first (they are nearest their deadline)."""
        cfg = self.config
        # a preempted request is a waiting one: only engines with a queue can hold one
        stuck = [e for e in self.usable if e.waiting and any(r.preempted for r in e.requests)]
        if not stuck:
            return
        held = {e.engine_id for e in stuck}
        room: dict[tuple[int, str], list[list[Any]]] = defaultdict(list)  # [blocks, slots, e]
        for e in self.usable:
            if e.state != "serving" or e.version is None or e.pulls != e.version:
                continue
            if e.engine_id in self.taken or e.engine_id in held:
                continue
            open_slots = self.open_slots(e)
            blocks = math.floor(cfg.target_fill * e.kv_blocks_total) - e.kv_blocks_used
            if open_slots > 0 and blocks > 0:
                room[(e.version, e.kind)].append([blocks, open_slots, e])
        for src in stuck:
            targets = room.get((src.version, src.kind)) if src.version is not None else None
            if not targets:
                continue
            moves: dict[str, list[str]] = defaultdict(list)
            for r in sorted(
                (r for r in src.requests if r.preempted),
                key=lambda r: (r.dispatched_at, r.request_id),
            ):
                if self.migrated >= cfg.max_migrated_requests:
                    break
                need = r.kv_blocks or math.ceil((r.generated + 1) / src.block_size)
                best = max(
                    (t for t in targets if t[1] > 0 and t[0] >= need),
                    key=lambda t: (t[0], t[2].engine_id),
                    default=None,
                )
                if best is None:
                    break
                best[0] -= need
                best[1] -= 1
                moves[best[2].engine_id].append(r.request_id)
                self.migrated += 1
            for target in sorted(moves):
                if not self.room():
                    return
                self.actions.append(
                    MigrateRequests(
                        src.engine_id, target, src.version, tuple(moves[target]), 0, "relieve"
                    )
                )

    # ------------------------------------------------------------------ fast lane

    def rate(self, e: EngineView) -> float:
        """Decode tokens/s one of the engine's requests gets now."""
        if e.tokens_per_s > 0 and e.running > 0:
            return e.tokens_per_s / e.running
        return self.config.decode_tokens_per_s

    def fast_lane(self) -> None:
        """Rule 7: the cohort the learner waits for ends with its slowest request, which a
        full batch slows (on dense-32B on H200, 26-31 tok/s in a KV-full batch against 48.5
        alone). Critical requests (expected remaining time above ``fast_lane_min_s``) move
        with their KV from crowded engines onto the version's engines running at most
        ``fast_lane_batch``, longest first, where the move saves more than it costs. Engines
        left holding a critical request at lane size are kept from consolidation, which
        would pack it back into a full batch."""
        cfg = self.config
        lengths = self.state.lengths
        horizon = cfg.urgency_horizon_steps
        for v in sorted(self.holders):
            if v >= self.newest or v in self.queues or self.state.steps_left(v) > horizon:
                continue
            engines = [
                e
                for e in self.holders[v]
                if e.state in ("serving", "draining")
                and e.version == v
                and e.engine_id not in self.taken
            ]
            lanes: list[list[Any]] = []  # [spots, blocks, engine, per-request rate]
            critical: list[tuple[float, float, RequestView, EngineView]] = []  # s, tokens left
            for e in engines:
                rate = self.rate(e)
                crowded = e.running > cfg.fast_lane_batch
                for r in e.requests:
                    if r.preempted or r.kv_blocks == 0:
                        continue
                    tokens = lengths.remaining(r.generated, r.max_tokens)
                    left = tokens / rate
                    if left <= cfg.fast_lane_min_s:
                        continue
                    if crowded and not self.cooling_request(r):
                        critical.append((left, tokens, r, e))
                    elif not crowded:
                        self.taken.add(e.engine_id)  # a lane at work: not consolidated
                if not crowded:
                    self.open_lane(e, lanes)
            if not critical:
                continue
            if self.demand() <= 0:  # no queue wants an engine: idle ones holding v are lanes
                for e in self.free:
                    if e.engine_id not in self.taken and e.state == "serving" and e.version == v:
                        self.open_lane(e, lanes)
            if not lanes:
                continue
            critical.sort(key=lambda c: (-c[0], c[2].request_id))
            moves: dict[tuple[str, str], list[RequestView]] = defaultdict(list)
            for left, tokens, r, src in critical:
                if self.migrated >= cfg.max_migrated_requests:
                    break
                need = r.kv_blocks + math.ceil(tokens / src.block_size)
                lane = max(
                    (t for t in lanes if t[0] > 0 and t[1] >= need),
                    key=lambda t: (t[3], t[2].engine_id),
                    default=None,
                )
                if lane is None:
                    break
                mig_s = cfg.migration_s_per_request + cfg.migration_s_per_block * r.kv_blocks
                if left - tokens / lane[3] <= 2 * mig_s + cfg.min_saving_s:
                    continue
                lane[0] -= 1
                lane[1] -= need
                moves[(src.engine_id, lane[2].engine_id)].append(r)
                self.migrated += 1
                self.taken.add(lane[2].engine_id)
            for (source, target), reqs in sorted(moves.items()):
                if not self.room():
                    return
                self.actions.append(
                    MigrateRequests(
                        source,
                        target,
                        v,
                        tuple(r.request_id for r in reqs),
                        sum(r.kv_blocks for r in reqs),
                        "fast-lane",
                    )
                )

    def open_lane(self, e: EngineView, lanes: list[list[Any]]) -> None:
        spots = self.config.fast_lane_batch - e.running - e.waiting
        blocks = math.floor(self.config.target_fill * e.kv_blocks_total) - e.kv_blocks_used
        if spots > 0 and blocks > 0:
            lanes.append([spots, blocks, e, self.rate(e)])

    def cooling_request(self, r: RequestView) -> bool:
        at = r.last_migrated_at
        return at is not None and self.now - at < self.config.migration_cooldown_s

    # ------------------------------------------------------------------ consolidation

    def demand(self) -> int:
        return sum(max(0, self.need(v)) for v in self.queues)

    def consolidate(self) -> None:
        cfg = self.config
        for v in sorted(self.holders):
            if v >= self.newest or v in self.queues:
                continue
            if not cfg.consolidate_without_demand and self.demand() <= 0:
                return
            if not cfg.migrate_urgent and self.state.steps_left(v) <= cfg.urgency_horizon_steps:
                continue  # a move stalls them, and the learner is waiting for them
            holders = [e for e in self.holders[v] if e.state != "loading"]
            # KV moves only between engines of one kind (their layouts differ)
            for kind in sorted({e.kind for e in holders}):
                engines = [e for e in holders if e.kind == kind]
                if len(engines) >= 2 and not self.consolidate_kind(v, engines):
                    return

    def consolidate_kind(self, v: int, engines: list[EngineView]) -> bool:
        """Consolidate version ``v`` over engines of one kind; False once the budget is spent."""
        cfg = self.config
        # Targets: engines serving v, and engines finishing v's tail before they switch
        # (a move onto one of those must not outlast its own tail: see ``pack``).
        targets = [
            e
            for e in engines
            if e.state == "serving" and e.version == v and e.engine_id not in self.taken
        ]
        sources = [
            e
            for e in engines
            if e.occupancy < cfg.consolidate_below
            and e.engine_id not in self.taken
            and not (e.assigned_version == v and self.cooling(e))
        ]
        if not targets or not sources:
            return True
        # Only the emptiest sources and the fullest targets can matter within one call's
        # budget; selecting them is O(n log k) instead of sorting whole fleets.
        budget = max(1, cfg.max_actions - len(self.actions))
        targets = heapq.nsmallest(
            4 * budget, targets, key=lambda e: (-e.kv_blocks_used, e.engine_id)
        )
        sources = heapq.nsmallest(
            2 * budget, sources, key=lambda e: (e.kv_blocks_used, e.running, e.engine_id)
        )
        return self.pack(v, sources, targets)

    def pack(self, v: int, sources: list[EngineView], targets: list[EngineView]) -> bool:
        """Evacuate sources into targets (first-fit, fullest first); False once the call's
        budget is spent."""
        cfg = self.config
        index = {t.engine_id: i for i, t in enumerate(targets)}
        # A target that is switching away from v takes only tails no longer than its own,
        # so the move does not delay its switch: shorter tails are packed into longer ones.
        switching = [(i, self.tail_tokens(t)) for i, t in enumerate(targets) if t.pulls != v]
        bins = FirstFit(
            [math.floor(cfg.target_fill * t.kv_blocks_total) - t.kv_blocks_used for t in targets],
            [math.floor(cfg.target_fill * slots(t, cfg)) - t.running - t.waiting for t in targets],
        )
        receivers: set[str] = set()
        emptied: set[int] = set()  # bins of evacuated sources: closed for good
        for src in sources:
            if src.engine_id in receivers:
                continue
            if not cfg.consolidate_without_demand and self.demand() <= 0:
                return False
            if self.migrated + src.running > cfg.max_migrated_requests:
                return False
            own = index.get(src.engine_id)
            if own is not None:
                bins.set_enabled(own, False)
            tail = self.tail_tokens(src)
            shorter = [i for i, t in switching if t < tail and i != own and i not in emptied]
            for i in shorter:
                bins.set_enabled(i, False)
            placed = self.place_requests(src, bins)
            for i in shorter:
                bins.set_enabled(i, True)
            if placed is None:
                if own is not None:
                    bins.set_enabled(own, True)
                continue
            by_target: dict[int, list[RequestView]] = defaultdict(list)
            for i, _, r in placed:
                by_target[i].append(r)
            reassign = src.assigned_version != self.newest or src.state != "serving"
            if not self.room(len(by_target) + int(reassign)):
                for i, size, _ in placed:
                    bins.give(i, size)
                return False
            for i in sorted(by_target, key=lambda i: targets[i].engine_id):
                reqs = by_target[i]
                self.actions.append(
                    MigrateRequests(
                        src.engine_id,
                        targets[i].engine_id,
                        v,
                        tuple(r.request_id for r in reqs),
                        sum(r.kv_blocks for r in reqs),
                        "consolidate",
                    )
                )
                receivers.add(targets[i].engine_id)
            self.migrated += len(placed)
            if own is not None:
                emptied.add(own)
            if reassign:
                self.assign(src, self.newest, "consolidated")
            else:  # already assigned the newest: emptied, it loads it and pulls
                self.taken.add(src.engine_id)
                self.free_slots[self.newest] += max(0, slots(src, cfg) - src.waiting)
        return True

    def tail_tokens(self, e: EngineView) -> float:
        """Expected tokens left to the longest of the engine's requests."""
        lengths = self.state.lengths
        return max((lengths.remaining(r.generated, r.max_tokens) for r in e.requests), default=0)

    def place_requests(
        self, src: EngineView, bins: FirstFit
    ) -> list[tuple[int, int, RequestView]] | None:
        """Place every request of ``src`` (largest first) or none: (bin, blocks, request)."""
        cfg = self.config
        lengths = self.state.lengths
        need: list[tuple[int, RequestView]] = []
        tail_tokens = 0.0
        moved_blocks = 0
        for r in src.requests:
            if self.cooling_request(r):
                return None
            remaining = lengths.remaining(r.generated, r.max_tokens)
            tail_tokens = max(tail_tokens, remaining)
            growth = math.ceil(remaining / src.block_size) if cfg.reserve_growth else 0
            need.append((r.kv_blocks + growth, r))
            moved_blocks += r.kv_blocks
        # Pays for itself: the source is freed ``tail_s - mig_s`` earlier; the moved requests
        # stall ``mig_s`` and the transfer occupies both engines, so ask for more than 2x.
        rate = self.rate(src)
        tail_s = tail_tokens / max(rate, 1e-9)
        mig_s = cfg.migration_s_per_request * src.running + cfg.migration_s_per_block * moved_blocks
        if tail_s - mig_s <= mig_s + cfg.min_saving_s:
            return None
        need.sort(key=lambda x: (-x[0], x[1].request_id))
        placed: list[tuple[int, int, RequestView]] = []
        for size, r in need:
            i = bins.find(size)
            if i is None:
                for j, back, _ in placed:
                    bins.give(j, back)
                return None
            bins.take(i, size)
            placed.append((i, size, r))
        return placed


def _engine_id(e: EngineView) -> str:
    return e.engine_id


# DrainEngine is part of the action vocabulary for the service (scale-down, stop); the policy
# moves engines with AssignEngine, which already stops pulling the old version.
_ = DrainEngine
