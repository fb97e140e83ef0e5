"""The rich table ``dora report`` prints: the headline numbers of a run."""

from __future__ import annotations

from rich.table import Table

from dora.report.derive import Summary


def _num(value: float | None, fmt: str = "{:.3f}") -> str:
    return "-" if value is None else fmt.format(value)


def version_ranges(versions: tuple[int, ...] | list[int]) -> str:
    """``v0-v150`` rather than 151 names: consecutive versions collapse into one range."""
    if not versions:
        return "-"
    distinct = sorted(set(versions))
    runs: list[list[int]] = []
    for v in distinct:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    text = ", ".join(f"v{a}" if a == b else f"v{a}-v{b}" for a, b in runs)
    return text if len(distinct) < 2 else f"{text} ({len(distinct)})"


def summary_table(s: Summary, title: str = "run") -> Table:
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("what")
    table.add_column("value", justify="right")
    stale_note = {"groups": "per trajectory", "metrics": "learner's staleness/*"}.get(
        s.staleness_source, "no data"
    )
    versions = version_ranges(s.versions)
    rows = [
        ("duration (s)", f"{s.duration_s:.1f}"),
        ("engines", str(s.engines)),
        ("trajectories", str(s.trajectories)),
        ("versions", versions),
        ("migrations ok / failed", f"{s.migrations_ok} / {s.migrations_failed}"),
        ("migrated KV (MiB)", f"{s.migrated_kv_bytes / 2**20:.2f}"),
        ("re-prefilled tokens", str(s.reprefilled_tokens)),
        (
            "completion tokens median / p99 / max",
            "-"
            if s.completion_tokens is None
            else " / ".join(f"{x:.0f}" for x in s.completion_tokens),
        ),
        (f"staleness mean ({stale_note})", _num(s.staleness_mean, "{:.2f}")),
        (f"staleness max ({stale_note})", _num(s.staleness_max, "{:.0f}")),
        (
            "staleness bound K (ledger)",
            "-" if s.staleness_bound is None else str(s.staleness_bound),
        ),
        ("reward first -> last", f"{_num(s.reward_first)} -> {_num(s.reward_last)}"),
        ("learner steps", str(s.learner_steps)),
        ("dead letters", str(s.deadletters)),
        ("unreadable records", str(s.problems)),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table
