"""``report.png``: one figure that shows how a run went.

Drawn on a bare ``Figure`` (Agg canvas, no pyplot): no global backend or figure state, so
the main job can render in-process next to anything else.

Rows: engines x time coloured by the version each serves (with migrations); load per version
and the life of each version; staleness and throughput; reward per step and over time. Every
panel says "no data" instead of failing when the run did not produce what it draws.
"""

from __future__ import annotations

import re
from pathlib import Path

import matplotlib
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from dora.report.derive import (
    engine_spans,
    inflight_per_version,
    running_per_version,
    staleness,
    summarize,
    version_timeline,
)
from dora.report.load import RunData

_QUEUE = re.compile(r"^queue/v(\d+)$")
_IDLE = "#d9d9d9"


class _Palette:
    """One colour per version, the same in every panel."""

    def __init__(self, versions: list[int]) -> None:
        self.versions = sorted(set(versions))
        cmap = matplotlib.colormaps["tab10" if len(self.versions) <= 10 else "viridis"]
        n = max(len(self.versions) - 1, 1)
        self._colors = {
            v: cmap(i % 10) if len(self.versions) <= 10 else cmap(i / n)
            for i, v in enumerate(self.versions)
        }

    def __call__(self, version: int | None) -> tuple[float, ...] | str:
        return _IDLE if version is None else self._colors.get(version, _IDLE)


def _no_data(ax: Axes, title: str, why: str = "no data") -> None:
    ax.set_title(title, loc="left", fontsize=11)
    ax.text(0.5, 0.5, why, ha="center", va="center", transform=ax.transAxes, color="grey")
    ax.set_xticks([])
    ax.set_yticks([])


def _engines(ax: Axes, run: RunData, pal: _Palette, t0: float) -> None:
    title = "Engines: version served over time"
    rows: dict[str, list[tuple[float, float, int | None, str]]] = {}
    spans = engine_spans(run)
    for s in spans:
        rows.setdefault(s.engine, []).append((s.start - t0, s.length, s.version, s.state))
    if not spans:  # no status recorded: what the trajectories say each engine generated
        for t in run.trajectories:
            if t.engines and t.started_at > 0 and t.finished_at > t.started_at:
                rows.setdefault(t.engines[0], []).append(
                    (t.started_at - t0, t.finished_at - t.started_at, t.version, "serving")
                )
        if rows:
            title += " (from trajectories; no status recorded)"
    for m in run.migrations:
        rows.setdefault(m.source, [])
        rows.setdefault(m.target, [])
    if not rows:
        _no_data(ax, title)
        return
    names = sorted(rows)
    y = {name: i for i, name in enumerate(names)}
    for name, bars in rows.items():
        for version in {b[2] for b in bars}:
            sel = [b for b in bars if b[2] == version]
            ax.broken_barh(
                [(b[0], b[1]) for b in sel if b[3] != "loading"],
                (y[name] - 0.35, 0.7),
                facecolors=pal(version),
                alpha=0.9 if spans else 0.35,
            )
            ax.broken_barh(
                [(b[0], b[1]) for b in sel if b[3] == "loading"],
                (y[name] - 0.35, 0.7),
                facecolors="white",
                edgecolors=pal(version),
                hatch="///",
            )
    for m in run.migrations:
        x = m.time - t0
        ax.annotate(
            "",
            xy=(x, y[m.target]),
            xytext=(x, y[m.source]),
            arrowprops={"arrowstyle": "-|>", "color": "black" if m.ok else "red", "lw": 1.2},
        )
    for w in run.weights:
        ax.axvline(w.time - t0, color=pal(w.version), ls=":", lw=1)
    ax.set_yticks(range(len(names)), names)
    ax.set_ylim(-0.6, len(names) - 0.4)
    ax.set_xlabel("time since start (s)")
    ax.set_title(title, loc="left", fontsize=11)
    handles: list[Patch | Line2D] = [Patch(color=pal(v), label=f"v{v}") for v in pal.versions]
    if any(s.state == "loading" for s in spans):
        handles.append(Patch(facecolor="white", edgecolor="grey", hatch="///", label="loading"))
    if run.migrations:
        handles.append(Line2D([], [], color="black", marker="^", ls="-", label="migration"))
    if run.weights:
        handles.append(Line2D([], [], color="grey", ls=":", label="weights published"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)


def _load(ax: Axes, run: RunData, pal: _Palette, t0: float) -> None:
    title = "Running requests per version (stacked)"
    grid, per_version = running_per_version(run)
    label = "running"
    if not per_version:
        grid, per_version = inflight_per_version(run)
        if per_version:
            title = "Trajectories in flight per version (stacked; no status recorded)"
            label = "in flight"
    queues: dict[int, list[tuple[float, float]]] = {}
    for name in run.metric_names():
        match = _QUEUE.match(name)
        if match:
            queues[int(match.group(1))] = [(t - t0, v) for _, t, v in run.series(name)]
    if not per_version and not queues:
        _no_data(ax, title)
        return
    if per_version:
        versions = sorted(per_version)
        ax.stackplot(
            grid - t0,
            *[per_version[v] for v in versions],
            colors=[pal(v) for v in versions],
            labels=[f"v{v} {label}" for v in versions],
            alpha=0.85,
        )
    for v, points in sorted(queues.items()):
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, ls="--", color=pal(v), label=f"v{v} queued")
    if queues:
        title += " + queued (dashed)"
    ax.set_title(title, loc="left", fontsize=11)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("requests")
    ax.legend(fontsize=7, loc="upper right", ncol=2 if len(pal.versions) > 3 else 1)


def _versions(ax: Axes, run: RunData, pal: _Palette, t0: float) -> None:
    title = "Versions: published (▼) and served (bar)"
    lives = version_timeline(run)
    if not lives:
        _no_data(ax, title)
        return
    for life in lives:
        y, color = life.version, pal(life.version)
        if life.first_served is not None and life.last_served is not None:
            ax.broken_barh(
                [(life.first_served - t0, max(life.last_served - life.first_served, 1e-3))],
                (y - 0.3, 0.6),
                facecolors=color,
            )
        if life.published is not None:
            ax.plot(life.published - t0, y, "v", color="black", ms=7)
            if life.first_served is not None:
                ax.plot([life.published - t0, life.first_served - t0], [y, y], ":", color="black")
                lag = life.first_served - life.published
                ax.annotate(
                    f"+{lag:.1f}s", (life.first_served - t0, y + 0.32), fontsize=7, color="grey"
                )
    ax.set_yticks([life.version for life in lives], [f"v{life.version}" for life in lives])
    ax.set_ylim(
        min(life.version for life in lives) - 0.6, max(life.version for life in lives) + 0.8
    )
    ax.set_xlabel("time since start (s)")
    ax.set_title(title, loc="left", fontsize=11)


def _staleness(ax: Axes, run: RunData) -> None:
    stale = staleness(run)
    if stale.source == "groups":
        bins = np.arange(min(stale.samples) - 0.5, max(stale.samples) + 1.5)
        ax.hist(stale.samples, bins=bins, color="#4c72b0", rwidth=0.85)
        ax.set_xticks(range(min(stale.samples), max(stale.samples) + 1))
        bound = run.staleness_bound
        hi = max(stale.samples) if bound is None else max(*stale.samples, bound)
        ax.set_xlim(min(stale.samples) - 1, hi + 1)
        if bound is not None:
            ax.axvline(bound + 0.5, color="red", ls="--", label=f"bound K={bound}")
            ax.legend(fontsize=8)
        ax.set_xlabel("learner step - trajectory version")
        ax.set_ylabel("consumed trajectories")
        note = f"mean {stale.mean:.2f}, max {stale.max:.0f}"
        if stale.unknown_groups:
            note += f", {stale.unknown_groups} groups without trajectories"
        ax.set_title(f"Staleness at consumption ({note})", loc="left", fontsize=11)
    elif stale.source == "metrics":
        means = [v for _, _, v in run.series("staleness/mean")]
        ax.hist(means, bins=min(20, max(len(means), 1)), color="#4c72b0", rwidth=0.85)
        ax.set_xlabel("staleness/mean of a learner step")
        ax.set_ylabel("steps")
        ax.set_title("Staleness per step (learner's staleness/mean)", loc="left", fontsize=11)
    else:
        _no_data(ax, "Staleness at consumption", "no data (no learner metrics)")


def _throughput(ax: Axes, run: RunData, t0: float) -> None:
    title = "Throughput"
    done = [(t.finished_at - t0, t.completion_tokens) for t in run.trajectories if t.finished_at]
    learner = [(t - t0, v) for _, t, v in run.series("throughput/tokens_per_s")]
    if not done and not learner:
        _no_data(ax, title)
        return
    handles: list[Line2D] = []
    if done:
        times = np.array([d[0] for d in done])
        span = max(float(times.max() - min(times.min(), 0.0)), 1e-6)
        nbins = int(np.clip(len(done) // 4, 5, 60))
        counts, edges = np.histogram(
            times, bins=nbins, range=(0.0, span), weights=[d[1] for d in done]
        )
        width = edges[1] - edges[0]
        ax.stairs(counts / width, edges, color="#dd8452", lw=1.5)
        handles.append(Line2D([], [], color="#dd8452", label="generated (finished trajectories)"))
        ax.set_ylabel("generated tokens/s")
    if learner:
        other = ax.twinx() if done else ax
        xs, ys = zip(*learner, strict=True)
        handles += other.plot(xs, ys, "o-", color="#55a868", ms=3, label="learner (trained)")
        other.set_ylabel("learner tokens/s")
    ax.legend(handles=handles, fontsize=8, loc="upper left")
    ax.set_xlabel("time since start (s)")
    ax.set_title(title, loc="left", fontsize=11)


def _reward_step(ax: Axes, run: RunData) -> None:
    points = sorted(run.series("reward/mean"))
    if not points:
        _no_data(ax, "Reward vs learner step", "no data (no learner metrics)")
        return
    ax.plot([p[0] for p in points], [p[2] for p in points], "o-", ms=3, label="reward/mean")
    correct = sorted(run.series("reward/correct_frac"))
    if correct:
        ax.plot([p[0] for p in correct], [p[2] for p in correct], "--", label="correct_frac")
    ax.set_xlabel("learner step")
    ax.set_ylabel("reward")
    ax.legend(fontsize=8)
    ax.set_title("Reward vs learner step", loc="left", fontsize=11)


def _reward_time(ax: Axes, run: RunData, t0: float) -> None:
    points = run.series("reward/mean")
    if not points and not run.scored:
        _no_data(ax, "Reward vs wall clock")
        return
    if run.scored:
        times = np.array([s.time - t0 for s in run.scored])
        rewards = np.array([s.reward for s in run.scored])
        k = min(len(rewards), int(np.clip(len(rewards) // 20, 5, 200)))
        rolling = np.convolve(rewards, np.ones(k) / k, mode="valid")
        ax.plot(times[k - 1 :], rolling, color="#8172b3", label=f"scored, rolling mean of {k}")
    if points:
        ax.plot([p[1] - t0 for p in points], [p[2] for p in points], "o-", ms=3, label="learner")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("reward")
    ax.legend(fontsize=8)
    ax.set_title("Reward vs wall clock", loc="left", fontsize=11)


def render_report(run: RunData, out: Path | str | None = None) -> Path:
    """Draw every panel into ``out`` (default ``<run_dir>/report.png``); returns the path."""
    out = Path(out) if out is not None else run.run_dir / "report.png"
    t0 = run.t0
    versions = [t.version for t in run.trajectories] + [w.version for w in run.weights]
    versions += [s.version for s in run.status if s.version is not None]
    versions += [v for s in run.status for v in s.running_by_version]
    pal = _Palette(versions)
    n_engines = len(
        {s.engine_id for s in run.status} | {e for t in run.trajectories for e in t.engines}
    )
    top = float(np.clip(0.45 * n_engines + 1.2, 2.5, 8.0))
    fig = Figure(figsize=(15, top + 3 * 3.6), layout="constrained")
    grid = fig.add_gridspec(4, 2, height_ratios=[top, 3.6, 3.6, 3.6])
    _engines(fig.add_subplot(grid[0, :]), run, pal, t0)
    _load(fig.add_subplot(grid[1, 0]), run, pal, t0)
    _versions(fig.add_subplot(grid[1, 1]), run, pal, t0)
    _staleness(fig.add_subplot(grid[2, 0]), run)
    _throughput(fig.add_subplot(grid[2, 1]), run, t0)
    _reward_step(fig.add_subplot(grid[3, 0]), run)
    _reward_time(fig.add_subplot(grid[3, 1]), run, t0)
    s = summarize(run)
    fig.suptitle(
        f"dora run {run.run_dir.name}: {s.trajectories} trajectories, "
        f"{len(s.versions)} versions, {s.migrations_ok} migrations, "
        f"{s.reprefilled_tokens} re-prefilled tokens, {s.learner_steps} learner steps",
        fontsize=13,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out
