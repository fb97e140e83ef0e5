"""``dora bench modes``: the rollout modes side by side on the same workload and seed.

Two fleets, one command:

- ``--fleet emulated`` (default): the real dispatcher, orchestrator, migrator, generators and
  NATS, with timing-model engines (H200-class cost presets) and a learner stand-in whose step
  time comes from the cost model: throughput at cluster scale on two CPU cores.
- ``--task arithmetic``: real training on this machine (tiny model, built-in engines, GRPO
  learner), ``sync`` against ``dora`` from the same warm start: eval accuracy per trajectory
  consumed and per wall-clock second.
"""

from __future__ import annotations

from pathlib import Path

import typer


def cli(
    fleet: str = typer.Option("emulated", "--fleet", help="emulated | real."),
    task: str | None = typer.Option(
        None, "--task", help="Train on this task (real fleet), e.g. arithmetic."
    ),
    modes: str = typer.Option("sync,one_step_off,partial,dora", "--modes", help="Modes to run."),
    engines: int = typer.Option(16, "--engines", help="Engines in the fleet."),
    steps: int = typer.Option(6, "--steps", help="Learner steps per mode."),
    seeds: str = typer.Option("0", "--seeds", help="Comma-separated seeds."),
    preset: str = typer.Option("dense-32b", "--preset", help="Cost preset (emulated)."),
    workload: str = typer.Option("dapo-16k", "--workload", help="Workload preset (emulated)."),
    time_scale: float = typer.Option(
        50.0, "--time-scale", help="Emulated seconds per wall-clock second (keep <= 50)."
    ),
    staleness: int | None = typer.Option(
        None, "--staleness", min=0, help="K for --task runs (default: the quickstart's)."
    ),
    out: Path | None = typer.Option(None, "--out", help="Directory for JSON + PNG."),
    groups_per_engine: int = typer.Option(
        2, "--groups-per-engine", min=1, help="Emulated: B = this x engines (G = 8)."
    ),
    admission: str = typer.Option(
        "slots", "--admission", help="Emulated engines: slots | kv (as `dora sim --admission`)."
    ),
    relief: bool = typer.Option(
        True, "--relief/--no-relief", help="Emulated dora: relieve preempted requests."
    ),
) -> None:
    """Compare rollout modes on the same workload and seed (table + JSON + PNG)."""
    chosen = [m.strip() for m in modes.split(",") if m.strip()]
    seed_list = [int(s) for s in seeds.split(",") if s.strip()]
    if task is not None:
        from dora.bench.modes_task import run_task_comparison

        run_task_comparison(task, chosen, seed_list, steps, out, staleness)
        return
    if staleness is not None:
        raise typer.BadParameter("--staleness applies to --task runs (emulated: K=1)")
    if fleet != "emulated":
        raise typer.BadParameter("without --task only --fleet emulated is available")
    from dora.bench.modes_emulated import run_emulated_comparison

    try:
        run_emulated_comparison(
            chosen,
            engines,
            steps,
            seed_list,
            preset,
            workload,
            time_scale,
            out,
            groups_per_engine=groups_per_engine,
            admission=admission,
            relieve_preempted=relief,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
