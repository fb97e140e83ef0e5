"""Version colours shared by every panel of ``report.png``.

A few versions get distinct categorical colours and legend entries; a long run (hundreds of
versions) gets a continuous colormap and one colorbar, because a legend with an entry per
version no longer fits in a figure and nobody can tell 150 colours apart anyway.
"""

from __future__ import annotations

import matplotlib
from matplotlib.axes import Axes
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

IDLE = "#d9d9d9"
MAX_LEGEND_VERSIONS = 10
"""Above this many versions: continuous colours, a colorbar, no per-version labels."""


class VersionColors:
    """One colour per version, the same in every panel."""

    def __init__(self, versions: list[int]) -> None:
        self.versions = sorted(set(versions))
        self.continuous = len(self.versions) > MAX_LEGEND_VERSIONS
        if self.continuous:
            self._cmap = matplotlib.colormaps["viridis"]
            self._norm = Normalize(self.versions[0], self.versions[-1])
            self._colors = {v: self._cmap(self._norm(v)) for v in self.versions}
        else:
            tab = matplotlib.colormaps["tab10"]
            self._colors = {v: tab(i % 10) for i, v in enumerate(self.versions)}

    def __call__(self, version: int | None) -> tuple[float, ...] | str:
        return IDLE if version is None else self._colors.get(version, IDLE)

    def handles(self, suffix: str = "") -> list[Patch]:
        """Legend entries per version; none when the colorbar stands for the versions."""
        if self.continuous:
            return []
        return [Patch(color=self(v), label=f"v{v}{suffix}") for v in self.versions]

    def colorbar(self, fig: Figure, ax: Axes) -> None:
        """One horizontal colorbar above ``ax`` (the top panel) that names the colours of
        every panel; only in the continuous case. Horizontal so that it takes no width from
        the panels below (constrained layout shares a column's margins across rows)."""
        if not self.continuous:
            return
        mappable = ScalarMappable(norm=self._norm, cmap=self._cmap)
        bar = fig.colorbar(mappable, ax=ax, location="top", fraction=0.08, aspect=90, pad=0.02)
        bar.set_label("policy version (colour in every panel)")
        bar.locator = MaxNLocator(nbins=8, integer=True)
        bar.update_ticks()
