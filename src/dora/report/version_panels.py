"""The version-coloured panels of ``report.png``: engines x time, load per version, version lives.

A run with many versions (``palette.MAX_LEGEND_VERSIONS``) is drawn without per-version legend
entries or text labels; the figure's colorbar (``VersionColors.colorbar``) names the colours.
"""

from __future__ import annotations

import re

import numpy as np
from matplotlib.axes import Axes
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, MaxNLocator

from dora.report.derive import (
    engine_spans,
    inflight_per_version,
    running_per_version,
    version_timeline,
)
from dora.report.load import RunData
from dora.report.palette import VersionColors

_QUEUE = re.compile(r"^queue/v(\d+)$")
TIME = "time since start (s)"
_OUTSIDE = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "fontsize": 8}


def no_data(ax: Axes, title: str, why: str = "no data") -> None:
    ax.set_title(title, loc="left", fontsize=11)
    ax.text(0.5, 0.5, why, ha="center", va="center", transform=ax.transAxes, color="grey")
    ax.set_xticks([])
    ax.set_yticks([])


def headroom(*axes: Axes, frac: float = 0.3) -> None:
    """Leave the top of the axes free so an in-axes legend does not cover the data."""
    for ax in axes:
        lo, hi = ax.get_ylim()
        ax.set_ylim(lo, hi + frac * (hi - lo))


def engines_panel(ax: Axes, run: RunData, pal: VersionColors, t0: float) -> None:
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
        no_data(ax, title)
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
    top = len(names) - 0.4
    if run.weights and pal.continuous:  # a line per version would hide the bars: ticks on top
        ax.scatter(
            [w.time - t0 for w in run.weights],
            np.full(len(run.weights), top + 0.1),
            c=[pal(w.version) for w in run.weights],
            marker="v",
            s=14,
            zorder=3,
        )
        top += 0.3
    else:
        for w in run.weights:
            ax.axvline(w.time - t0, color=pal(w.version), ls=":", lw=1)
    ax.set_yticks(range(len(names)), names)
    ax.set_ylim(-0.6, top)
    ax.set_xlabel(TIME)
    ax.set_title(title, loc="left", fontsize=11)
    handles: list[Patch | Line2D] = list(pal.handles())
    if any(s.state == "loading" for s in spans):
        handles.append(Patch(facecolor="white", edgecolor="grey", hatch="///", label="loading"))
    if run.migrations:
        handles.append(Line2D([], [], color="black", marker="^", ls="-", label="migration"))
    if run.weights:
        marker = {"marker": "v", "ls": ""} if pal.continuous else {"ls": ":"}
        handles.append(Line2D([], [], color="grey", label="weights published", **marker))
    if handles:  # in the title row, right of the (left-aligned) title: covers no bars
        ax.legend(
            handles=handles,
            loc="lower right",
            bbox_to_anchor=(1.0, 1.0),
            ncol=min(len(handles), 8),
            fontsize=8,
            frameon=False,
        )


def load_panel(ax: Axes, run: RunData, pal: VersionColors, t0: float) -> None:
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
        no_data(ax, title)
        return
    handles: list[Patch | Line2D] = []
    if per_version:
        versions = sorted(per_version)
        ax.stackplot(
            grid - t0,
            *[per_version[v] for v in versions],
            colors=[pal(v) for v in versions],
            alpha=0.85,
            lw=0,
        )
        handles += [Patch(color=pal(v), label=f"v{v} {label}") for v in versions]
    for v, points in sorted(queues.items()):
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, ys, ls="--", color=pal(v), lw=1)
        handles.append(Line2D([], [], ls="--", color=pal(v), label=f"v{v} queued"))
    if queues:
        title += " + queued (dashed)"
    ax.set_title(title, loc="left", fontsize=11)
    ax.set_xlabel(TIME)
    ax.set_ylabel("requests")
    if not pal.continuous:
        ax.legend(handles=handles, ncol=2 if len(handles) > 8 else 1, **_OUTSIDE)


def versions_panel(ax: Axes, run: RunData, pal: VersionColors, t0: float) -> None:
    title = "Versions: published ▼, served (bar)"
    lives = version_timeline(run)
    if not lives:
        no_data(ax, title)
        return
    many = pal.continuous  # the palette saw every version the timeline has
    bars = [  # (version, first served, last served), seconds since start
        (x.version, x.first_served - t0, max(x.last_served, x.first_served + 1e-3) - t0)
        for x in lives
        if x.first_served is not None and x.last_served is not None
    ]
    marks = [(x.version, x.published - t0) for x in lives if x.published is not None]
    lagged = [
        (x.version, x.published - t0, x.first_served - t0)
        for x in lives
        if x.published is not None and x.first_served is not None
    ]
    lags = [first - pub for _, pub, first in lagged]
    if many:  # one thick segment per version; per-version labels would only overlap
        ax.hlines(
            [b[0] for b in bars], [b[1] for b in bars], [b[2] for b in bars],
            colors=[pal(b[0]) for b in bars], lw=3,
        )  # fmt: skip
    else:
        for v, start, end in bars:
            ax.broken_barh([(start, end - start)], (v - 0.3, 0.6), facecolors=pal(v))
        for v, pub, first in lagged:
            ax.plot([pub, first], [v, v], ":", color="black")
            ax.annotate(f"+{first - pub:.1f}s", (first, v + 0.32), fontsize=7, color="grey")
    if marks:
        ax.plot(
            [m[1] for m in marks], [m[0] for m in marks], ls="", marker="v", color="black",
            ms=2.5 if many else 7,
        )  # fmt: skip
    if many:
        ax.yaxis.set_major_locator(MaxNLocator(nbins=10, integer=True))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"v{v:.0f}"))
        ax.set_ylim(lives[0].version - 1, lives[-1].version + 1)
    else:
        ax.set_yticks([x.version for x in lives], [f"v{x.version}" for x in lives])
        ax.set_ylim(lives[0].version - 0.6, lives[-1].version + 0.8)
    if lags:
        title += f"; lag median {np.median(lags):.1f}s, max {max(lags):.1f}s"
    ax.set_xlabel(TIME)
    ax.set_title(title, loc="left", fontsize=11)
