"""dora.report on synthetic run directories written with the real ``dora.events`` models."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from typer.testing import CliRunner

from dora import events
from dora.report import load_run, render_report, staleness, summarize
from dora.report.palette import IDLE, MAX_LEGEND_VERSIONS, VersionColors
from dora.report.plots import report_figure
from dora.report.summary import version_ranges

T0 = 1_000.0
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write(path: Path, items: list[events.Event]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        for item in items:
            fh.write(item.model_dump_json() + "\n")


def _status(
    engine: str, t: float, version: int | None, state: str, running: int = 0
) -> events.EngineStatus:
    reqs = tuple(
        events.RunningRequest(
            request_id=f"{engine}-{i}",
            version=version or 0,
            generated=5,
            max_tokens=64,
            kv_blocks=1,
        )
        for i in range(running if version is not None else 0)
    )
    return events.EngineStatus(
        engine_id=engine,
        version=version,
        assigned_version=version,
        state=state,  # type: ignore[arg-type]
        running=len(reqs),
        requests=reqs,
        tokens_per_s=100.0 * len(reqs),
        created_at=T0 + t,
    )


# engine -> [(from_t, to_t, version, state)]
SCHEDULE = {
    "e0": [(0, 6, 0, "serving"), (6, 7, None, "loading"), (7, 12, 1, "serving")],
    "e1": [(0, 5, 0, "serving"), (5, 6, None, "loading"), (6, 12, 1, "serving")],
    "e2": [(0, 9, 0, "serving"), (9, 12, 1, "serving")],
}
# group -> (version, learner step that consumed it); two samples per group
GROUPS = {"g0": (0, 0), "g1": (0, 0), "g2": (0, 1), "g4": (1, 1), "g3": (0, 2), "g5": (1, 2)}


def _trajectory(group: str, index: int, version: int, k: int) -> events.Trajectory:
    request_id = f"{group}-{index}"
    prompt = events.Prompt(prompt_id=group, text="1+1=", answer="2")
    request = events.RolloutRequest(
        request_id=request_id, prompt=prompt, group_id=group, group_index=index, group_size=2,
        version=version, dispatched_at=T0 + k,
    )  # fmt: skip
    migrated = request_id == "g1-1"
    return events.Trajectory(
        request=request,
        version=version,
        prompt_token_ids=(1, 2, 3),
        completion_token_ids=tuple(range(10 + k)),
        logprobs=tuple(-0.1 for _ in range(10 + k)),
        loss_mask=tuple(1 for _ in range(10 + k)),
        finish_reason="stop",
        engines=("e1", "e2") if migrated else (f"e{k % 3}",),
        migrations=(
            events.Migration(source="e1", target="e2", at_token=4, kv_bytes=4096, seconds=0.01),
        )
        if migrated
        else (),
        reprefilled_tokens=7 if request_id == "g5-0" else 0,
        timings=events.Timings(
            dispatched_at=T0 + k, started_at=T0 + k + 0.2, finished_at=T0 + k + 2
        ),
        created_at=T0 + k + 2,
    )


def make_run(run_dir: Path, *, learner: bool = True, steps: int = 3) -> Path:
    """3 engines, 2 versions, one migration, metrics for ``steps`` learner steps."""
    ev = run_dir / "events"
    status = []
    for engine, spans in SCHEDULE.items():
        for start, end, version, state in spans:
            t = float(start)
            while t < end:
                status.append(_status(engine, t, version, state, running=2 if version == 0 else 1))
                t += 0.5
    _write(ev / "status.jsonl", status)
    trajs, scored = [], []
    for k, (group, (version, _)) in enumerate(GROUPS.items()):
        for index in range(2):
            t = _trajectory(group, index, version, k)
            trajs.append(t)
            scored.append(
                events.ScoredTrajectory(
                    trajectory=t,
                    reward=float(index),
                    correct=bool(index),
                    created_at=t.created_at + 0.1,
                )
            )
    _write(ev / "trajectories.jsonl", trajs)
    _write(ev / "trajectories.jsonl", trajs[:2])  # at-least-once: a redelivered duplicate
    _write(ev / "scored.jsonl", scored)
    _write(
        ev / "migrations.jsonl",
        [
            events.MigrationRecord(
                request_id="g1-1", source="e1", target="e2", version=0, ok=True,
                kv_bytes=4096, seconds=0.01, created_at=T0 + 5.0,
            )
        ],
    )  # fmt: skip
    weights = events.WeightVersion(
        version=1, blob=events.BlobRef(name="w1", size=1), checksum="x", step=0, created_at=T0 + 4.5
    )
    _write(ev / "weights.jsonl", [weights])
    _write(ev / "ledger.jsonl", [events.Ledger(learner_step=0, staleness_bound=2, batch_groups=2)])
    if learner:
        consumed: list[str] = []
        records = []
        for step in range(steps):
            consumed += [g for g, (_, s) in GROUPS.items() if s == step]
            values = {"reward/mean": 0.2 * (step + 1), "throughput/tokens_per_s": 500.0 + step}
            _write(
                ev / "metrics.jsonl",
                [
                    events.Metrics(
                        step=step,
                        values=values,
                        consumed_groups=tuple(sorted(consumed)),
                        created_at=T0 + 4 + 3 * step,
                    )
                ],
            )
            records.append(
                {
                    "step": step,
                    "time": T0 + 4 + 3 * step,
                    "values": {**values, "staleness/mean": 0.5},
                }
            )
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run_dir


def test_summary_numbers(tmp_path: Path) -> None:
    run = load_run(make_run(tmp_path))
    s = summarize(run)
    assert s.trajectories == 12  # the duplicate line is deduplicated
    assert s.versions == (0, 1)
    assert s.engines == 3
    assert (s.migrations_ok, s.migrations_failed, s.migrated_kv_bytes) == (1, 0, 4096)
    assert s.reprefilled_tokens == 7
    # per trajectory: g0,g1 at step 0 (v0) -> 0; g2 (v0) step 1 -> 1; g4 (v1) -> 0;
    # g3 (v0) step 2 -> 2; g5 (v1) -> 1; two samples each
    stale = staleness(run)
    assert stale.source == "groups"
    assert sorted(stale.samples) == [0] * 6 + [1] * 4 + [2] * 2
    assert s.staleness_max == 2
    assert s.staleness_bound == 2  # from the ledger snapshot
    assert s.staleness_mean == pytest.approx(8 / 12)
    assert (s.reward_first, s.reward_last) == pytest.approx((0.2, 0.6))
    assert s.learner_steps == 3
    assert s.duration_s == pytest.approx(11.5)  # last status sample
    assert run.problems == []


def test_render_writes_png(tmp_path: Path) -> None:
    run = load_run(make_run(tmp_path / "run"))
    out = render_report(run, tmp_path / "out" / "report.png")
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000


@pytest.mark.parametrize("learner", [False, True])
def test_partial_runs_degrade(tmp_path: Path, learner: bool) -> None:
    """Rollout-only (no learner) and learner-only (only metrics.jsonl) runs still render."""
    if learner:
        (tmp_path / "metrics.jsonl").write_text(
            '{"step": 0, "time": 5.0, "values": {"reward/mean": 0.1, "staleness/mean": 1.0}}\n'
            '{"step": 1, "time": 6.0, "reward/mean": 0.3, "staleness/max": 2}\n'
        )
    else:
        make_run(tmp_path, learner=False)
    run = load_run(tmp_path)
    s = summarize(run)
    if learner:
        assert (s.trajectories, s.learner_steps, s.staleness_source) == (0, 2, "metrics")
        assert (s.staleness_mean, s.staleness_max) == (1.0, 2.0)
        assert (s.reward_first, s.reward_last) == (0.1, 0.3)
    else:
        assert (s.learner_steps, s.staleness_source, s.staleness_max) == (0, "", None)
        assert s.reward_first == pytest.approx(0.0) and s.reward_last == pytest.approx(1.0)
    assert render_report(run).read_bytes().startswith(PNG_MAGIC)


def test_empty_run_and_bad_lines(tmp_path: Path) -> None:
    assert render_report(load_run(tmp_path)).is_file()
    ev = tmp_path / "events"
    ev.mkdir()
    deep = "[" * 100_000 + "]" * 100_000  # a hostile payload recorded verbatim
    (ev / "migrations.jsonl").write_text('{"request_id": "r"}\nnot json\n' + deep + "\n")
    run = load_run(tmp_path)
    assert run.migrations == []
    assert len(run.problems) == 3
    assert any("nested too deeply" in p for p in run.problems)
    assert any("source" in p for p in run.problems) and any("not JSON" in p for p in run.problems)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_run(tmp_path / "missing")


def test_cli(tmp_path: Path) -> None:
    from dora.cli import app

    make_run(tmp_path / "run")
    out = tmp_path / "r.png"
    result = CliRunner().invoke(app, ["report", str(tmp_path / "run"), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "re-prefilled tokens" in result.output and out.read_bytes().startswith(PNG_MAGIC)
    numbers = json.loads(out.with_suffix(".json").read_text())
    assert (numbers["staleness_max"], numbers["migrations_ok"], numbers["reprefilled_tokens"]) == (
        2,
        1,
        7,
    )
    missing = CliRunner().invoke(app, ["report", str(tmp_path / "nope")])
    assert missing.exit_code == 2
    (tmp_path / "empty").mkdir()
    empty = CliRunner().invoke(app, ["report", str(tmp_path / "empty")])
    assert empty.exit_code == 2 and "holds no recorded run" in empty.output
    assert not (tmp_path / "empty" / "report.png").exists()


def make_long_run(run_dir: Path, versions: int = 40) -> Path:
    """2 engines stepping through ``versions`` versions, 2 s each: a long main-job run."""
    ev = run_dir / "events"
    _write(
        ev / "status.jsonl",
        [
            _status(engine, t / 2, int(t / 4), "serving", running=2)
            for t in range(4 * versions)
            for engine in ("e0", "e1")
        ],
    )
    trajs = [_trajectory(f"g{v}", i, v, 2 * v) for v in range(versions) for i in range(2)]
    _write(ev / "trajectories.jsonl", trajs)
    _write(
        ev / "scored.jsonl",
        [
            events.ScoredTrajectory(
                trajectory=t, reward=0.5, correct=True, created_at=t.created_at + 0.1
            )
            for t in trajs
        ],
    )
    _write(
        ev / "weights.jsonl",
        [
            events.WeightVersion(
                version=v, blob=events.BlobRef(name=f"w{v}", size=1), checksum="x",
                step=v - 1, created_at=T0 + 2 * v - 0.5,
            )
            for v in range(1, versions)
        ],
    )  # fmt: skip
    _write(
        ev / "metrics.jsonl",
        [
            events.Metrics(
                step=s,
                values={"reward/mean": 0.5, "throughput/tokens_per_s": 400.0},
                consumed_groups=(f"g{max(s - 1, 0)}",),
                created_at=T0 + 2 * s + 1,
            )
            for s in range(versions)
        ],
    )
    return run_dir


def _layout_problems(fig: Figure) -> list[str]:
    """Panels (with their titles, labels, legends) that leave the figure or overlap."""
    FigureCanvasAgg(fig)
    fig.draw_without_rendering()
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    boxes = [(ax, ax.get_tightbbox(renderer)) for ax in fig.axes]
    boxes.append((None, fig.get_suptitle() and fig._suptitle.get_window_extent(renderer)))
    problems = []
    for ax, box in boxes:
        name = "suptitle" if ax is None else ax.get_title(loc="left") or "axes"
        if not fig.bbox.padded(1).contains(box.x0, box.y0) or not fig.bbox.padded(1).contains(
            box.x1, box.y1
        ):
            problems.append(f"{name} leaves the figure")
    for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2):
        twins = (
            a is not None and b is not None and a.get_position().bounds == b.get_position().bounds
        )
        if not twins and box_a.overlaps(box_b):
            problems.append(
                f"{a and a.get_title(loc='left')} overlaps {b and b.get_title(loc='left')}"
            )
    return problems


def _legend_labels(fig: Figure) -> list[str]:
    return [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]


def test_small_run_layout_and_legends(tmp_path: Path) -> None:
    """A few versions: a legend entry per version, and no panel overlaps another."""
    fig = report_figure(load_run(make_run(tmp_path)))
    assert _layout_problems(fig) == []
    labels = _legend_labels(fig)
    assert {"v0", "v1", "v0 running", "v1 running"} <= set(labels)


def test_long_run_uses_a_colorbar(tmp_path: Path) -> None:
    """Many versions: one colorbar, no per-version legend entries or labels, no overlaps."""
    run = load_run(make_long_run(tmp_path, versions=40))
    assert len(summarize(run).versions) == 40
    fig = report_figure(run)
    assert _layout_problems(fig) == []
    assert not [label for label in _legend_labels(fig) if re.match(r"v\d+", label)]
    colorbars = [ax for ax in fig.axes if ax.get_label() == "<colorbar>"]
    assert len(colorbars) == 1
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert not [t for t in texts if t.startswith("+")]  # no per-version lag labels
    assert render_report(run).read_bytes().startswith(PNG_MAGIC)


def test_version_colors() -> None:
    few, many = VersionColors([3, 1, 1]), VersionColors(list(range(MAX_LEGEND_VERSIONS + 1)))
    assert [h.get_label() for h in few.handles()] == ["v1", "v3"] and not few.continuous
    assert many.continuous and many.handles() == []
    assert few(None) == many(None) == IDLE and few(1) != few(3)


def test_version_ranges() -> None:
    assert version_ranges(()) == "-"
    assert version_ranges((4,)) == "v4"
    assert version_ranges(tuple(range(151))) == "v0-v150 (151)"
    assert version_ranges((0, 1, 2, 5, 7, 8)) == "v0-v2, v5, v7-v8 (6)"
