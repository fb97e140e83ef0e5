"""``dora sim``: the rollout modes side by side on a simulated fleet (virtual time)."""

from __future__ import annotations

import time
from pathlib import Path

import typer


def _ints(text: str, name: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(
            f"{name}: expected comma-separated integers, got {text!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise typer.BadParameter(f"{name}: expected positive integers, got {text!r}")
    return values


def cli(
    engines: str = typer.Option("64,128,1024", help="Fleet sizes, comma-separated."),
    modes: str = typer.Option("all", help="Modes, comma-separated, or 'all'."),
    steps: int = typer.Option(20, min=1, help="Learner steps per run."),
    preset: str = typer.Option("dense-32b", help="Cost preset (dense-7b, dense-32b)."),
    workload: str = typer.Option("dapo-16k", help="Workload (dapo-16k, dapo-32k, agentic)."),
    batch_groups: int = typer.Option(512, min=1, help="B: groups per learner step."),
    group_size: int = typer.Option(16, min=1, help="G: samples per group."),
    staleness: int = typer.Option(1, min=0, help="K: staleness bound."),
    trainer_gpus: int = typer.Option(0, min=0, help="Trainer GPUs (0: as many as engines)."),
    train_flops: float = typer.Option(
        10.0,
        "--train-flops-per-token",
        min=1.0,
        help="Trainer FLOPs per parameter per token: 10 = forward + backward + old-policy and "
        "reference logprobs (GRPO); 6 = forward + backward only.",
    ),
    plan_tick: float = typer.Option(20.0, min=0.001, help="Seconds between plan calls (dora)."),
    plan_debounce: float = typer.Option(
        1.0, min=0.0, help="Plan this soon after an old-version engine runs dry (dora)."
    ),
    max_seqs: int = typer.Option(
        0, min=0, help="Sequences per engine (0: tuned to 85% of the KV over the mean context)."
    ),
    admission: str = typer.Option(
        "slots",
        help="Engine admission in every mode: slots (a cap tuned to the mean context; a "
        "preempted request waits on its engine) or kv (admit below --kv-watermark of the KV "
        "cache, up to --kv-max-seqs; a preempted request goes back to its queue).",
    ),
    kv_watermark: float = typer.Option(0.9, min=0.01, max=1.0, help="--admission kv."),
    kv_max_seqs: int = typer.Option(100, min=1, help="--admission kv: slot cap."),
    relief: bool = typer.Option(
        True,
        "--relief/--no-relief",
        help="dora: the planner moves requests an engine preempted (no KV left) to engines "
        "of their version with room (--no-relief: they wait on their engine).",
    ),
    fast_lane: bool = typer.Option(
        False,
        "--fast-lane/--no-fast-lane",
        help="dora: the planner moves the urgent version's critical requests (expected "
        "remaining time above --fast-lane-min-s) with their KV onto its engines running at "
        "most --fast-lane-batch requests.",
    ),
    fast_lane_batch: int = typer.Option(4, min=1, help="--fast-lane: a lane's batch."),
    fast_lane_min_s: float = typer.Option(60.0, min=0.0, help="--fast-lane: critical above."),
    start_order: str = typer.Option(
        "fifo",
        help="dora's queue order of admitted groups: fifo (the policy), or a yardstick that "
        "reads the drawn lengths: oracle_request (longest first), oracle_group (groups by "
        "difficulty, the most a per-prompt length history could know).",
    ),
    seed: int = typer.Option(0, min=0, help="Seed of prompts and lengths."),
    json_out: Path = typer.Option(Path("runs/sim/sim.json"), "--json", help="JSON output."),
    png_out: Path | None = typer.Option(None, "--png", help="PNG (default: next to JSON)."),
) -> None:
    """Simulate sync / one_step_off / partial / partial_sync / dora / dora_noreuse."""
    from rich.console import Console

    from dora.engines.sim import cost_preset, workload_preset
    from dora.sim import MODES, SimConfig, simulate
    from dora.sim.report import print_table, save_json, save_png

    sizes = _ints(engines, "engines")
    chosen = list(MODES) if modes == "all" else [m.strip() for m in modes.split(",") if m]
    for m in chosen:
        if m not in MODES:
            raise typer.BadParameter(f"modes: unknown mode {m!r}; known: {list(MODES)}")
    try:
        base = SimConfig(
            steps=steps,
            cost=cost_preset(preset),
            workload=workload_preset(workload),
            batch_groups=batch_groups,
            group_size=group_size,
            staleness=staleness,
            trainer_gpus=trainer_gpus or None,
            train_flops_per_token=train_flops,
            plan_tick_s=plan_tick,
            plan_debounce_s=plan_debounce,
            start_order=start_order,  # type: ignore[arg-type]
            max_seqs=max_seqs or None,
            admission=admission,  # type: ignore[arg-type]
            relieve_preempted=relief,
            fast_lane=fast_lane,
            fast_lane_batch=fast_lane_batch,
            fast_lane_min_s=fast_lane_min_s,
            kv_watermark=kv_watermark,
            kv_max_seqs=kv_max_seqs,
            seed=seed,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    console = Console(width=240)  # the table is wide; never truncate it in a pipe
    results = []
    t0 = time.perf_counter()
    from dataclasses import replace

    for n in sizes:
        for m in chosen:
            r = simulate(replace(base, engines=n, mode=m))  # type: ignore[arg-type]
            console.log(
                f"{n:>6} engines {m:<13} {r.tokens_per_s:>10,.0f} tok/s  "
                f"(simulated in {r.sim_seconds:.1f} s)"
            )
            results.append(r)
    wall = time.perf_counter() - t0
    print_table(base, results, console)
    console.print(f"wall time {wall:.1f} s")
    save_json(json_out, base, results, wall)
    png = png_out or json_out.with_suffix(".png")
    save_png(png, results)
    console.print(f"saved {json_out} and {png}")
