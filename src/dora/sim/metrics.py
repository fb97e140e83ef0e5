"""What a run measured, and the ideal bound it is compared with."""

from __future__ import annotations

import heapq
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from dora.sim.config import SimConfig
from dora.sim.fleet import Fleet, Group


@dataclass
class StepRecord:
    """One learner step: which groups it trained on and when."""

    step: int
    train_start: float
    train_end: float
    groups: int
    completion_tokens: int
    prompt_tokens: int
    rollout_s: float  # first dispatch of this batch -> its last trajectory finishing
    wait_s: float  # learner idle before this step (waiting for data)
    staleness: list[int] = field(default_factory=list)
    longest_tokens: int = 0
    longest_prompt: int = 0


@dataclass
class SimResult:
    """Per-run metrics (JSON-serializable through ``to_dict``)."""

    mode: str
    engines: int
    steps: int
    wall_s: float
    tokens_per_s: float
    step_s: float
    rollout_s: float
    wait_s: float
    utilization: float
    busy_fraction: float
    migrations: int
    migrated_gb: float
    reprefilled_tokens: int
    recomputed_tokens: int
    staleness_mean: float
    staleness_max: int
    staleness_hist: dict[int, int]
    ideal_step_s: float
    ideal_rollout_s: float
    train_s: float
    dispatched: int
    finished: int
    consumed_groups: int
    max_seqs: int
    sim_seconds: float = 0.0
    plan_calls: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def vs_ideal(self) -> float:
        """How far the mean step is above the ideal step (0.10 = 10% slower)."""
        return self.step_s / self.ideal_step_s - 1.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["vs_ideal"] = self.vs_ideal
        d["staleness_hist"] = {str(k): v for k, v in self.staleness_hist.items()}
        return d


def step_bounds(cfg: SimConfig, fleet: Fleet, record: StepRecord) -> tuple[float, float]:
    """(decode work / fleet capacity, longest trajectory at single-request speed) of a step."""
    cap = cfg.engines * cfg.cost.peak_throughput(fleet.stats.mean_context)
    alone = cfg.cost.single_request_time(record.longest_prompt, record.longest_tokens)
    return record.completion_tokens / cap, alone


def ideal_rollout_time(cfg: SimConfig, fleet: Fleet, records: list[StepRecord]) -> float:
    """Mean over steps of max(decode work / fleet capacity, longest trajectory alone)."""
    bounds = [max(step_bounds(cfg, fleet, r)) for r in records]
    return float(np.mean(bounds)) if bounds else 0.0


def ideal_step_time(
    cfg: SimConfig, fleet: Fleet, records: list[StepRecord], train: list[float]
) -> float:
    """The fastest step each mode could take, mean over steps.

    ``sync`` generates a batch, then trains on it: max(W/C, D) + T. ``partial_sync`` also
    stops to train but carries long trajectories across steps: W/C + T. A streaming mode
    overlaps the two, and a trajectory may span K+1 steps (its version is trained up to K
    steps after it was dispatched): max(W/C, T, (D + T)/(K + 1)). W/C: decode work over the
    fleet's capacity; D: the longest trajectory at single-request speed; T: the training step.
    """
    if not records:
        return 0.0
    k = max(cfg.staleness, 1)
    bounds = []
    for record, t in zip(records, train, strict=True):
        work, alone = step_bounds(cfg, fleet, record)
        if cfg.mode == "sync":
            bounds.append(max(work, alone) + t)
        elif cfg.mode == "partial_sync":
            bounds.append(work + t)
        else:
            bounds.append(max(work, t, (alone + t) / (k + 1)))
    return float(np.mean(bounds))


def summarize(
    cfg: SimConfig, fleet: Fleet, records: list[StepRecord], plan_calls: int = 0
) -> SimResult:
    """Reduce a finished run to its metrics."""
    wall = records[-1].train_end if records else fleet.now
    tokens = sum(r.completion_tokens for r in records)
    decode = sum(c.decode_s for c in fleet.cores)
    busy = sum(c.busy_s for c in fleet.cores)
    stale = [s for r in records for s in r.staleness]
    hist: dict[int, int] = {}
    for s in stale:
        hist[s] = hist.get(s, 0) + 1
    reqs = list(fleet.requests.values())
    params = cfg.cost.params
    train = [cfg.learner.step_time(r.completion_tokens + r.prompt_tokens, params) for r in records]
    ideal_roll = ideal_rollout_time(cfg, fleet, records)
    mean_train = float(np.mean(train)) if train else 0.0
    return SimResult(
        mode=cfg.mode,
        engines=cfg.engines,
        steps=len(records),
        wall_s=wall,
        tokens_per_s=tokens / wall if wall > 0 else 0.0,
        step_s=wall / max(len(records), 1),
        rollout_s=float(np.mean([r.rollout_s for r in records])) if records else 0.0,
        wait_s=float(np.mean([r.wait_s for r in records])) if records else 0.0,
        utilization=decode / (cfg.engines * wall) if wall > 0 else 0.0,
        busy_fraction=busy / (cfg.engines * wall) if wall > 0 else 0.0,
        migrations=sum(r.migrations for r in reqs),
        migrated_gb=sum(r.migrated_bytes for r in reqs) / 1e9,
        reprefilled_tokens=sum(r.reprefilled for r in reqs),
        recomputed_tokens=sum(r.recomputed for r in reqs),
        staleness_mean=float(np.mean(stale)) if stale else 0.0,
        staleness_max=max(stale) if stale else 0,
        staleness_hist=dict(sorted(hist.items())),
        ideal_step_s=ideal_step_time(cfg, fleet, records, train),
        ideal_rollout_s=ideal_roll,
        train_s=mean_train,
        dispatched=len(reqs),
        finished=sum(1 for r in reqs if r.done),
        consumed_groups=sum(r.groups for r in records),
        max_seqs=fleet.max_seqs,
        plan_calls=plan_calls,
        extra={"cohorts": cohort_tails(fleet)},
    )


def cohort_tails(fleet: Fleet, last: int = 20) -> list[dict[str, float]]:
    """Per version tag, what sets its cohort's makespan M (the critical path at K = 1): M
    from its first dispatch to its last finish, and its ``last`` finishers' mean start (from
    that dispatch), length and decode rate over their life."""
    by_version: dict[int, list[Any]] = {}
    for g in fleet.groups:
        by_version.setdefault(g.version, []).extend(r for r in g.requests if r.done)
    out = []
    for version in sorted(by_version):
        reqs = by_version[version]
        if len(reqs) < last:
            continue
        t0 = min(r.dispatched_at for r in reqs)
        tail = heapq.nlargest(last, reqs, key=lambda r: r.finished_at)
        out.append(
            {
                "version": version,
                "makespan_s": tail[0].finished_at - t0,
                "tail_start_s": float(np.mean([r.started_at - t0 for r in tail])),
                "tail_tokens": float(np.mean([r.spec.decode_tokens for r in tail])),
                "tail_tok_per_s": float(
                    np.mean([r.spec.decode_tokens / (r.finished_at - r.started_at) for r in tail])
                ),
            }
        )
    return out


def record_step(
    step: int, groups: list[Group], train_start: float, train_end: float, wait_s: float
) -> StepRecord:
    """The record of a learner step over ``groups`` (marks them consumed)."""
    longest = max((r for g in groups for r in g.requests), key=lambda r: r.completion_tokens)
    for g in groups:
        g.consumed_step = step
    return StepRecord(
        step=step,
        train_start=train_start,
        train_end=train_end,
        groups=len(groups),
        completion_tokens=sum(g.completion_tokens for g in groups),
        prompt_tokens=sum(g.prompt_tokens for g in groups),
        rollout_s=max(g.finished_at for g in groups) - min(g.dispatched_at for g in groups),
        wait_s=wait_s,
        staleness=[step - g.version for g in groups],
        longest_tokens=longest.completion_tokens,
        longest_prompt=longest.spec.prompt_len,
    )
