"""``dora eval RUN_DIR...``: score finished runs' final policies against their start on the
frozen held-out set, on the split asked for, and pool the runs (seeds) into one table.

Why a command: tuning belongs on the dev split and the headline on the test split, and a
claim is a mean over seeds with its spread; a run scores only the split its pipeline names,
once. Each run's summary is saved beside its own (``eval-<split>.json``, per-problem scores in
``eval_scores-<split>.json``); the pooled table can be saved with ``--out``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

import typer


class EvalCommandError(Exception):
    """A run directory that cannot be evaluated, with the reason."""


def _run_eval_config(run_dir: Path) -> tuple[Any, Path]:
    """The run's eval config (its pipeline file with its ``--set`` overrides) and the start
    policy it trained from (recorded by the run, else resolved from the pipeline)."""
    from dora.pipeline.spec import PipelineConfigError, read_pipeline_file
    from dora.stages.learner import LearnerStageConfig

    record = run_dir / "run.json"
    if not (run_dir / "final" / "config.json").is_file() or not record.is_file():
        raise EvalCommandError(
            f"{run_dir}: no finished run (needs run.json and final/, which a run writes when "
            "its learner reaches max_steps)"
        )
    run = json.loads(record.read_text())
    try:
        spec = read_pipeline_file(Path(run["pipeline"]), run.get("overrides") or ())
    except PipelineConfigError as exc:
        raise EvalCommandError(f"{run_dir}: its pipeline no longer loads: {exc}") from exc
    learners = [entry for entry in spec.stages if entry.type == "learner"]
    if len(learners) != 1:
        raise EvalCommandError(f"{run_dir}: its pipeline has {len(learners)} learner stages, not 1")
    config = LearnerStageConfig.model_validate(learners[0].config)
    recorded = run_dir / "eval.json"
    start = json.loads(recorded.read_text()).get("start_policy") if recorded.is_file() else None
    return config.eval, Path(start) if start else config.model.resolve()


def _spread(values: list[float]) -> tuple[float, float]:
    import numpy as np

    arr = np.asarray(values, dtype=float)
    return float(arr.mean()), float(arr.std(ddof=1)) if len(arr) > 1 else float("nan")


def pool(summaries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Across runs: each gain's mean and standard deviation (the spread over seeds), pooled
    and per stratum."""
    first = next(iter(summaries.values()))
    out: dict[str, Any] = {"runs": len(summaries), "metrics": {}}
    for metric, gain in first["gain"].items():
        if not isinstance(gain, dict):
            continue
        pooled = _spread([s["gain"][metric]["mean"] for s in summaries.values()])
        strata = {
            label: dict(
                zip(
                    ("mean", "sd"),
                    _spread(
                        [s["gain"][metric]["strata"][label]["mean"] for s in summaries.values()]
                    ),
                    strict=True,
                )
            )
            for label in gain["strata"]
        }
        out["metrics"][metric] = {
            "start": first["start"][metric]["mean"],
            "gain_mean": pooled[0],
            "gain_sd": pooled[1],
            "strata": strata,
        }
    return out


def _tables(summaries: dict[str, dict[str, Any]], pooled: dict[str, Any], title: str) -> list[Any]:
    from rich.table import Table

    metrics = list(pooled["metrics"])
    runs = Table(title=title)
    runs.add_column("run")
    for metric in metrics:
        runs.add_column(f"{metric} final", justify="right")
        runs.add_column(f"{metric} gain ± se", justify="right")
    for name, s in summaries.items():
        cells = []
        for metric in metrics:
            cells.append(f"{100 * s['final'][metric]['mean']:.1f}%")
            cells.append(
                f"{100 * s['gain'][metric]['mean']:+.1f} ± {100 * s['gain'][metric]['se']:.1f}"
            )
        runs.add_row(name, *cells)
    cells = []
    for metric in metrics:
        m = pooled["metrics"][metric]
        cells += [
            f"start {100 * m['start']:.1f}%",
            f"{100 * m['gain_mean']:+.1f} (sd {100 * m['gain_sd']:.1f})",
        ]
    runs.add_row(f"mean of {len(summaries)}", *cells, style="bold")

    strata = Table(title="gain per stratum: mean (sd) over runs")
    strata.add_column("stratum")
    for metric in metrics:
        strata.add_column(f"{metric} start", justify="right")
        strata.add_column(f"{metric} gain", justify="right")
    first = next(iter(summaries.values()))
    for label in pooled["metrics"][metrics[0]]["strata"]:
        cells = []
        for metric in metrics:
            g = pooled["metrics"][metric]["strata"][label]
            cells.append(f"{100 * first['start'][metric]['strata'][label]['mean']:.1f}%")
            cells.append(f"{100 * g['mean']:+.1f} ({100 * g['sd']:.1f})")
        strata.add_row(f"{label} (n={first['start'][metrics[0]]['strata'][label]['n']})", *cells)
    return [runs, strata]


def cli(
    runs: Annotated[
        list[Path],
        typer.Argument(help="Finished run directories (runs/<run_id>), e.g. one per seed."),
    ],
    split: Annotated[
        Literal["eval", "dev"] | None,
        typer.Option(help="dev (for tuning) or eval (the test split); default: each run's own."),
    ] = None,
    samples: Annotated[
        int | None, typer.Option(min=0, help="avg@k samples (default: the run's).")
    ] = None,
    workers: Annotated[
        int | None, typer.Option(min=1, help="Scoring processes (default: the run's).")
    ] = None,
    out: Annotated[
        Path | None, typer.Option("--out", help="Save the pooled table as JSON here.")
    ] = None,
) -> None:
    """Score runs' final policies against their start on a held-out split; pool the runs."""
    from rich.console import Console

    from dora.logs import configure
    from dora.training.heldout import score_against_start

    configure(None)  # the console shows warnings and the scoring notice, as `dora run` does
    console = Console()
    try:
        configs = {run: _run_eval_config(run) for run in runs}
    except EvalCommandError as exc:
        console.print(f"[red]{exc}[/red]", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    changes: dict[str, Any] = {
        k: v for k, v in (("samples", samples), ("workers", workers)) if v is not None
    }
    resolved = {}
    for run, (cfg, start) in configs.items():
        spec = cfg.set if split is None else cfg.set.model_copy(update={"split": split})
        resolved[run] = (cfg.model_copy(update={**changes, "set": spec}), start)
    first_cfg, first_start = next(iter(resolved.values()))
    for run, (cfg, start) in resolved.items():
        if start != first_start:
            reason = f"it was trained from {start}, {runs[0]} from {first_start}"
        elif cfg.model_dump(exclude={"workers"}) != first_cfg.model_dump(exclude={"workers"}):
            reason = f"its eval config differs from {runs[0]}'s (task, eval set or samples)"
        else:
            continue
        message = f"{run}: {reason}; pool only runs of one start and eval config"
        console.print(f"[red]{message}[/red]", highlight=False, soft_wrap=True)
        raise typer.Exit(2)
    scored = score_against_start(first_cfg, first_start, {str(run): run / "final" for run in runs})
    which = first_cfg.set.split
    summaries = {}
    for run in runs:
        result = scored[str(run)]
        (run / f"eval-{which}.json").write_text(json.dumps(result.summary, indent=2) + "\n")
        (run / f"eval_scores-{which}.json").write_text(json.dumps(result.scores) + "\n")
        summaries[str(run)] = result.summary
    pooled = pool(summaries)
    size = next(iter(summaries.values()))["eval_set"]["n"]
    title = f"{len(runs)} runs against their start, {which} split ({size} problems)"
    for table in _tables(summaries, pooled, title):
        console.print(table)
    if out is not None:
        out.write_text(
            json.dumps({"split": which, "runs": summaries, "pooled": pooled}, indent=2) + "\n"
        )
        console.print(f"saved: {out}")
