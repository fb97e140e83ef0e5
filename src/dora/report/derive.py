"""Numbers derived from a loaded run: staleness, engine/version spans, per-version load, summary.

Pure functions of ``RunData`` so the plots, the summary table and the tests agree on them.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from dora.report.load import RunData, StatusRecord

GAP_FACTOR = 4.0
"""A status sample stands until the next one, but at most this many typical intervals."""


@dataclass(frozen=True)
class Staleness:
    """Staleness of consumed trajectories: learner step at consumption minus version."""

    samples: list[int]
    source: str  # "groups" (exact, per trajectory), "metrics" (learner's staleness/*), or ""
    unknown_groups: int = 0
    mean: float | None = None
    max: float | None = None


def staleness(run: RunData) -> Staleness:
    """Per consumed trajectory from ``Metrics.consumed_groups``; else the learner's values.

    ``consumed_groups`` may list only the step's groups or every group consumed so far (the
    learner publishes the running set): a group counts at the first step that lists it.
    """
    members: dict[str, list[int]] = defaultdict(list)
    seen_requests: set[str] = set()
    sources = [(s.request_id, s.group_id, s.version) for s in run.scored]
    sources += [(t.request_id, t.group_id, t.version) for t in run.trajectories]
    for request_id, group_id, version in sources:
        if request_id not in seen_requests and group_id:
            seen_requests.add(request_id)
            members[group_id].append(version)
    samples: list[int] = []
    counted: set[str] = set()
    unknown = 0
    for m in sorted(run.bus_metrics, key=lambda m: (m.step, m.time)):
        for group in m.consumed_groups:
            if group in counted:
                continue
            counted.add(group)
            if group not in members:
                unknown += 1
            samples += [m.step - v for v in members.get(group, ())]
    if samples:
        return Staleness(samples, "groups", unknown, float(np.mean(samples)), float(max(samples)))
    means = [v for _, _, v in run.series("staleness/mean")]
    maxes = [v for _, _, v in run.series("staleness/max")]
    if means or maxes:
        return Staleness(
            [],
            "metrics",
            unknown,
            float(np.mean(means)) if means else None,
            float(max(maxes)) if maxes else None,
        )
    return Staleness([], "", unknown)


def _by_engine(status: list[StatusRecord]) -> dict[str, list[StatusRecord]]:
    out: dict[str, list[StatusRecord]] = defaultdict(list)
    for s in status:
        out[s.engine_id].append(s)
    return dict(sorted(out.items()))


def typical_interval(status: list[StatusRecord]) -> float:
    gaps = [
        b.time - a.time
        for rows in _by_engine(status).values()
        for a, b in itertools.pairwise(rows)
        if b.time > a.time
    ]
    return float(np.median(gaps)) if gaps else 0.5


@dataclass(frozen=True)
class Span:
    """An engine serving (or loading) one version from ``start`` for ``length`` seconds."""

    engine: str
    version: int | None
    state: str
    start: float
    length: float


def engine_spans(run: RunData) -> list[Span]:
    """Runs of equal (version, state) per engine, from the status samples."""
    interval = typical_interval(run.status)
    spans: list[Span] = []
    for engine, rows in _by_engine(run.status).items():
        start = rows[0]
        for prev, cur in zip(rows, [*rows[1:], None], strict=True):
            end = (
                prev.time + interval
                if cur is None
                else min(cur.time, prev.time + interval * GAP_FACTOR)
            )
            boundary = cur is None or cur.time - prev.time > interval * GAP_FACTOR
            if boundary or (cur.version, cur.state) != (start.version, start.state):
                spans.append(Span(engine, start.version, start.state, start.time, end - start.time))
                if cur is not None:
                    start = cur
    return spans


def running_per_version(run: RunData, bins: int = 300) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """Requests running per version on a time grid (each engine's latest sample, summed)."""
    if not run.status:
        return np.array([]), {}
    interval = typical_interval(run.status)
    lo, hi = run.status[0].time, run.status[-1].time + interval
    grid = np.linspace(lo, hi, max(2, bins))
    versions = sorted({v for s in run.status for v in s.running_by_version})
    out = {v: np.zeros_like(grid) for v in versions}
    for rows in _by_engine(run.status).values():
        times = np.array([r.time for r in rows])
        idx = np.searchsorted(times, grid, side="right") - 1
        for g, i in enumerate(idx):
            if i < 0 or grid[g] - times[i] > interval * GAP_FACTOR:
                continue
            for v, n in rows[i].running_by_version.items():
                out[v][g] += n
    return grid, out


def inflight_per_version(run: RunData, bins: int = 300) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """Trajectories in flight (started, not finished) per version: the load without status."""
    spans = [(t.started_at, t.finished_at, t.version) for t in run.trajectories if t.started_at]
    spans = [s for s in spans if s[1] >= s[0]]
    if not spans:
        return np.array([]), {}
    grid = np.linspace(min(s[0] for s in spans), max(s[1] for s in spans), max(2, bins))
    out: dict[int, np.ndarray] = {}
    for start, end, version in spans:
        row = out.setdefault(version, np.zeros_like(grid))
        row += (grid >= start) & (grid < end)
    return grid, dict(sorted(out.items()))


@dataclass(frozen=True)
class VersionLife:
    version: int
    published: float | None  # WeightVersion event
    first_served: float | None  # first status (or trajectory start) with that version
    last_served: float | None


def version_timeline(run: RunData) -> list[VersionLife]:
    published = {w.version: w.time for w in run.weights}
    served: dict[int, list[float]] = defaultdict(list)
    interval = typical_interval(run.status)
    for s in run.status:
        if s.version is not None and s.state in ("serving", "draining"):
            served[s.version] += [s.time, s.time + interval]  # a sample stands one interval
    if not served:  # no status recorded: trajectories say when a version generated
        for t in run.trajectories:
            served[t.version] += [x for x in (t.started_at, t.finished_at) if x > 0]
    versions = sorted(set(published) | set(served))
    return [
        VersionLife(
            v,
            published.get(v),
            min(served[v]) if served.get(v) else None,
            max(served[v]) if served.get(v) else None,
        )
        for v in versions
    ]


@dataclass(frozen=True)
class Summary:
    """The headline numbers of a run (the table ``dora report`` prints)."""

    duration_s: float
    engines: int
    trajectories: int
    versions: tuple[int, ...]
    migrations_ok: int
    migrations_failed: int
    migrated_kv_bytes: int
    reprefilled_tokens: int
    completion_tokens: tuple[float, float, float] | None
    """Median, 99th percentile and longest completion (tokens): the run's long tail."""
    staleness_mean: float | None
    staleness_max: float | None
    staleness_source: str
    staleness_bound: int | None
    reward_first: float | None
    reward_last: float | None
    learner_steps: int
    deadletters: int
    problems: int


def _reward_ends(run: RunData) -> tuple[float | None, float | None]:
    points = sorted(run.series("reward/mean"))
    if points:
        return points[0][2], points[-1][2]
    rewards = [s.reward for s in run.scored]
    if not rewards:
        return None, None
    k = max(1, len(rewards) // 10)
    return float(np.mean(rewards[:k])), float(np.mean(rewards[-k:]))


def _length_tail(run: RunData) -> tuple[float, float, float] | None:
    lengths = np.array([t.completion_tokens for t in run.trajectories])
    if not len(lengths):
        return None
    p50, p99 = np.percentile(lengths, [50, 99])
    return float(p50), float(p99), float(lengths.max())


def summarize(run: RunData) -> Summary:
    t0 = run.t0
    ends = [t.finished_at for t in run.trajectories] + [s.time for s in run.status]
    ends += [m.time for m in (*run.file_metrics, *run.bus_metrics)] + [w.time for w in run.weights]
    stale = staleness(run)
    if run.migrations:
        ok = sum(m.ok for m in run.migrations)
        failed = len(run.migrations) - ok
        kv = sum(m.kv_bytes for m in run.migrations if m.ok)
    else:  # no records: count the moves the trajectories carry
        ok, failed, kv = sum(t.migrations for t in run.trajectories), 0, 0
    versions = {t.version for t in run.trajectories} | {w.version for w in run.weights}
    versions |= {s.version for s in run.status if s.version is not None}
    steps = {m.step for m in run.file_metrics} or {m.step for m in run.bus_metrics if m.values}
    first, last = _reward_ends(run)
    return Summary(
        duration_s=max(ends) - t0 if ends and t0 else 0.0,
        engines=len(
            {s.engine_id for s in run.status} | {e for t in run.trajectories for e in t.engines}
        ),
        trajectories=len(run.trajectories),
        versions=tuple(sorted(versions)),
        migrations_ok=ok,
        migrations_failed=failed,
        migrated_kv_bytes=kv,
        reprefilled_tokens=sum(t.reprefilled_tokens for t in run.trajectories),
        completion_tokens=_length_tail(run),
        staleness_mean=stale.mean,
        staleness_max=stale.max,
        staleness_source=stale.source,
        staleness_bound=run.staleness_bound,
        reward_first=first,
        reward_last=last,
        learner_steps=len(steps),
        deadletters=run.deadletters,
        problems=len(run.problems),
    )
