"""``dora warmstart``: train (or reuse) the supervised warm start of the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import typer


def cli(
    preset: str = typer.Option("tiny", help="Model preset."),
    task: str = typer.Option("arithmetic", help="Task to learn (dora.tasks name)."),
    out: Path | None = typer.Option(None, help="Also copy the checkpoint directory here."),
    steps: int | None = typer.Option(None, help="Optimizer steps (default: the config's)."),
    seed: int = typer.Option(0, help="Seed of the model init and of the task."),
    eval_prompts: int | None = typer.Option(None, help="Eval-split prompts for accuracy."),
    force: bool = typer.Option(False, help="Retrain even when a cached result exists."),
    threads: int = typer.Option(2, help="torch CPU threads."),
) -> None:
    """Supervised warm start on task.solve demonstrations; cached by config hash."""
    from rich.console import Console
    from rich.table import Table

    from dora.training.warmstart import WarmstartConfig, read_result, warmstart

    fields: dict[str, object] = {"preset": preset, "task": task, "seed": seed, "threads": threads}
    if steps is not None:
        fields["steps"] = steps
    if eval_prompts is not None:
        fields["eval_prompts"] = eval_prompts
    try:
        config = WarmstartConfig(**fields)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    directory = warmstart(config, out=out, force=force)
    result = read_result(directory)
    table = Table(title=f"warm start {result['config_hash']}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = {
        "directory": str(directory),
        "steps": result["train"]["steps"],
        "train seconds": result["train"]["seconds"],
        "tokens/s": result["train"]["tokens_per_s"],
        "final loss": f"{result['train']['final_loss']:.3f}",
        **{f"eval {k}": v for k, v in result["eval"].items()},
        **{f"completion tokens {k}": v for k, v in result["lengths"].items()},
        "wall seconds": result["wall_seconds"],
        "load avg at start": result["loadavg_1m_at_start"],
    }
    for key, value in rows.items():
        table.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
    Console().print(table)
    typer.echo(json.dumps({"directory": str(directory), "eval": result["eval"]}))
