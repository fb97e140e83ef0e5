"""``report.png``: one figure that shows how a run went.

Drawn on a bare ``Figure`` (Agg canvas, no pyplot): no global backend or figure state, so
the main job can render in-process next to anything else.

Rows: engines x time coloured by the version each serves (with migrations); load per version
and the life of each version; staleness and throughput; reward per step and over time. Every
panel says "no data" instead of failing when the run did not produce what it draws. The
version-coloured panels live in ``version_panels``; a long run (many versions) gets one
colorbar instead of per-version legends so the figure stays readable at any run length.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.layout_engine import ConstrainedLayoutEngine
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

from dora.report.derive import staleness, summarize
from dora.report.load import RunData
from dora.report.palette import VersionColors
from dora.report.version_panels import (
    TIME,
    engines_panel,
    headroom,
    load_panel,
    no_data,
    versions_panel,
)


def _staleness(ax: Axes, run: RunData) -> None:
    stale = staleness(run)
    if stale.source == "groups":
        lo, hi = min(stale.samples), max(stale.samples)
        bins = np.arange(lo - 0.5, hi + 1.5)
        ax.hist(stale.samples, bins=bins, color="#4c72b0", rwidth=0.85)
        bound = run.staleness_bound
        top = hi if bound is None else max(hi, bound)
        if top - lo <= 20:
            ax.set_xticks(range(lo, top + 1))
        else:
            ax.xaxis.set_major_locator(MaxNLocator(nbins=12, integer=True))
        ax.set_xlim(lo - 0.75, top + 0.75)
        if bound is not None:
            ax.axvline(bound + 0.5, color="red", ls="--", label=f"bound K={bound}")
            ax.legend(fontsize=8, loc="upper left")
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
        no_data(ax, "Staleness at consumption", "no data (no learner metrics)")


def _throughput(ax: Axes, run: RunData, t0: float) -> None:
    title = "Throughput"
    done = [(t.finished_at - t0, t.completion_tokens) for t in run.trajectories if t.finished_at]
    learner = [(t - t0, v) for _, t, v in run.series("throughput/tokens_per_s")]
    if not done and not learner:
        no_data(ax, title)
        return
    handles: list[Line2D] = []
    axes = [ax]
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
        handles += other.plot(xs, ys, "o-", color="#55a868", ms=2, lw=1, label="learner (trained)")
        other.set_ylabel("learner tokens/s")
        if other is not ax:
            axes.append(other)
    for a in axes:
        a.set_ylim(bottom=0)
    headroom(*axes)
    ax.legend(handles=handles, fontsize=8, loc="upper left", ncol=2)
    ax.set_xlabel(TIME)
    ax.set_title(title, loc="left", fontsize=11)


def _reward_step(ax: Axes, run: RunData) -> None:
    points = sorted(run.series("reward/mean"))
    if not points:
        no_data(ax, "Reward vs learner step", "no data (no learner metrics)")
        return
    ms = 3 if len(points) <= 60 else 0
    ax.plot([p[0] for p in points], [p[2] for p in points], "o-", ms=ms, lw=1, label="reward/mean")
    correct = sorted(run.series("reward/correct_frac"))
    if correct:
        ax.plot([p[0] for p in correct], [p[2] for p in correct], "--", lw=1, label="correct_frac")
    tools = sorted(run.series("episodes/tool_call_rate"))
    if tools:  # multi-turn episodes with tools: how often the policy calls one
        ax.plot([p[0] for p in tools], [p[2] for p in tools], ":", lw=1.5, label="tool_call_rate")
    ax.set_xlabel("learner step")
    ax.set_ylabel("reward")
    headroom(ax, frac=0.2)
    ax.legend(fontsize=8, loc="upper left", ncol=2)
    ax.set_title(
        "Reward vs learner step" + (" (and tool calls)" if tools else ""), loc="left", fontsize=11
    )


def _reward_time(ax: Axes, run: RunData, t0: float) -> None:
    points = run.series("reward/mean")
    if not points and not run.scored:
        no_data(ax, "Reward vs wall clock")
        return
    if points:
        ms = 3 if len(points) <= 60 else 0
        ax.plot(
            [p[1] - t0 for p in points], [p[2] for p in points], "o-", ms=ms, lw=1,
            color="#4c72b0", alpha=0.6, label="learner reward/mean",
        )  # fmt: skip
    if run.scored:
        times = np.array([s.time - t0 for s in run.scored])
        rewards = np.array([s.reward for s in run.scored])
        k = min(len(rewards), int(np.clip(len(rewards) // 20, 5, 200)))
        rolling = np.convolve(rewards, np.ones(k) / k, mode="valid")
        ax.plot(
            times[k - 1 :], rolling, color="#8172b3", lw=2, label=f"scored, rolling mean of {k}"
        )
    ax.set_xlabel(TIME)
    ax.set_ylabel("reward")
    headroom(ax, frac=0.2)
    ax.legend(fontsize=8, loc="upper left", ncol=2)
    ax.set_title("Reward vs wall clock", loc="left", fontsize=11)


def report_figure(run: RunData) -> Figure:
    """Every panel of the report on one laid-out ``Figure`` (what ``render_report`` saves)."""
    t0 = run.t0
    versions = [t.version for t in run.trajectories] + [w.version for w in run.weights]
    versions += [s.version for s in run.status if s.version is not None]
    versions += [v for s in run.status for v in s.running_by_version]
    pal = VersionColors(versions)
    n_engines = len(
        {s.engine_id for s in run.status} | {e for t in run.trajectories for e in t.engines}
    )
    top = float(np.clip(0.45 * n_engines + 1.6, 2.8, 8.0))
    layout = ConstrainedLayoutEngine(h_pad=0.08, w_pad=0.08, hspace=0.04, wspace=0.04)
    fig = Figure(figsize=(15, top + 3 * 3.6), layout=layout)
    grid = fig.add_gridspec(4, 2, height_ratios=[top, 3.6, 3.6, 3.6])
    engines_ax = fig.add_subplot(grid[0, :])
    engines_panel(engines_ax, run, pal, t0)
    load_panel(fig.add_subplot(grid[1, 0]), run, pal, t0)
    versions_panel(fig.add_subplot(grid[1, 1]), run, pal, t0)
    pal.colorbar(fig, engines_ax)
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
    return fig


def render_report(run: RunData, out: Path | str | None = None) -> Path:
    """Draw every panel into ``out`` (default ``<run_dir>/report.png``); returns the path."""
    out = Path(out) if out is not None else run.run_dir / "report.png"
    fig = report_figure(run)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out
