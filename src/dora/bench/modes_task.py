"""``dora bench modes --task arithmetic``: real training, ``sync`` vs ``dora``, same warm start.

Each (mode, seed) runs the quickstart pipeline (built-in engines, verifier, GRPO learner on
an embedded nats-server) with the mode switched and a fixed number of learner steps, keeping
a checkpoint every few steps. Afterwards every checkpoint is evaluated greedily on the same
held-out prompts, giving eval accuracy per trajectory consumed (steps x B x G) and per
wall-clock second (from the learner's step times). dora should match sync per trajectory and
be ahead per second.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

QUICKSTART = Path("pipelines/quickstart.yaml")


def pipeline_for(task: str) -> Path:
    """The quickstart when it trains ``task``, else ``pipelines/<task>.yaml``."""
    if _source_task(QUICKSTART) == task:
        return QUICKSTART
    path = QUICKSTART.with_name(f"{task}.yaml")
    if not path.is_file() or _source_task(path) != task:
        raise FileNotFoundError(f"no pipeline trains {task!r}: neither {QUICKSTART} nor {path}")
    return path


def _source_task(path: Path) -> str | None:
    from dora.pipeline.spec import load_raw

    spec = load_raw(path)
    source = next((e for e in spec["stages"] if e["type"] == "prompt_source"), None)
    return None if source is None else source.get("config", {}).get("task")


def _read(task: str) -> dict[str, Any]:
    from dora.pipeline.spec import load_raw

    return load_raw(pipeline_for(task))


def _spec(
    mode: str, seed: int, steps: int, task: str, every: int, staleness: int | None = None
) -> dict[str, Any]:
    spec = _read(task)
    for entry in spec["stages"]:
        config = entry.setdefault("config", {})
        if entry["type"] in ("generator", "orchestrator"):
            config["mode"] = mode
        elif entry["type"] in ("rollout", "dispatcher"):  # the one that tags and admits
            config.update(mode=mode, seed=seed)
            if staleness is not None:
                config["staleness_bound"] = staleness
        elif entry["type"] == "learner":
            learner = config.setdefault("learner", {})
            learner.update(
                max_steps=steps, checkpoint_every=every, keep_checkpoints=steps // every + 2
            )
            optim = learner.get("optim", {})
            if "total_steps" in optim:  # the LR schedule spans the run, however long it is
                learner["optim"] = {**optim, "total_steps": steps}
            if staleness is not None:
                learner["staleness_bound"] = staleness
            # checkpoints are evaluated afterwards, all on the same frozen set (_eval_set_spec)
            config["eval"] = {**config.get("eval", {}), "set": {"per_stratum": 0}}
    return spec


def _eval_set_spec(task: str) -> dict[str, Any]:
    """The pipeline learner's frozen eval set (``eval.set``), for every checkpoint."""
    spec = _read(task)
    learner = next(e["config"] for e in spec["stages"] if e["type"] == "learner")
    return dict(learner.get("eval", {}).get("set", {}))


def _checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    out = []
    for path in sorted((run_dir / "checkpoints").glob("step_*")):
        if (path / "model" / "model.safetensors").is_file():
            out.append((int(path.name.split("_")[1]), path / "model"))
    return out


def _evaluate(
    models: dict[str, Path], task: str, task_config: dict[str, Any], spec: dict[str, Any]
) -> dict[str, tuple[float, float]]:
    """Greedy accuracy of each checkpoint on the frozen eval set, with its SE clustered by
    problem; the passes run on the eval pool (one core each)."""
    from dora.tasks.evalset import EvalSetSpec
    from dora.training.eval_pool import score_policies
    from dora.training.evaluate import clustered_mean

    scores = score_policies(models, task, task_config, EvalSetSpec(**spec), samples=0)
    return {name: clustered_mean(np.asarray(s["greedy"])) for name, s in scores.items()}


def _run_one(
    mode: str, seed: int, steps: int, task: str, out: Path, staleness: int | None
) -> dict[str, Any]:
    from dora.learner.metrics import read_metrics
    from dora.pipeline import load_pipeline

    every = max(1, steps // 4)
    run_dir = out / f"{mode}-s{seed}"
    path = out / f"{mode}-s{seed}.yaml"
    spec = _spec(mode, seed, steps, task, every, staleness)
    path.write_text(yaml.safe_dump(spec))
    pipeline = load_pipeline(path, run_id=f"bench-{mode}-s{seed}", run_dir=run_dir)
    started = time.time()
    asyncio.run(pipeline.run())
    metrics = read_metrics(run_dir)
    step_time = {m["step"] + 1: m["time"] - started for m in metrics}
    rollout = next(e["config"] for e in spec["stages"] if e["type"] in ("rollout", "dispatcher"))
    per_step = rollout["batch_groups"] * rollout["group_size"]
    return {
        "mode": mode,
        "seed": seed,
        "run_dir": str(run_dir),
        "wall_s": time.time() - started,
        "per_step": per_step,
        "step_time": step_time,
        "checkpoints": _checkpoints(run_dir),
    }


def run_task_comparison(
    task: str,
    modes: list[str],
    seeds: list[int],
    steps: int,
    out: Path | None,
    staleness: int | None = None,
) -> None:
    """Train each mode per seed, evaluate the checkpoints, print + save table and PNG."""
    from dora.bench.report import print_table, save_rows

    out = out or Path("runs/bench") / f"modes-{task}-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    runs = [_run_one(mode, seed, steps, task, out, staleness) for seed in seeds for mode in modes]
    rows = []
    start_dir = _start_model(out, modes[0], seeds[0], task)
    source = next(
        e for e in _spec(modes[0], 0, steps, task, 1)["stages"] if e["type"] == "prompt_source"
    )
    task_config = (
        source["config"].get("task_config", {}) if source["config"]["task"] == task else {}
    )
    # one task and one frozen set (the quickstart learner's ``eval.set``) for every checkpoint
    models = {"start": start_dir}
    for run in runs:
        for step, model_dir in run["checkpoints"]:
            models[f"{run['mode']}-s{run['seed']}-{step}"] = model_dir
    scored = _evaluate(models, task, task_config, _eval_set_spec(task))
    start_acc, start_se = scored["start"]
    for run in runs:
        for step, _ in run["checkpoints"]:
            accuracy, se = scored[f"{run['mode']}-s{run['seed']}-{step}"]
            rows.append(
                {
                    "mode": run["mode"],
                    "seed": run["seed"],
                    "step": step,
                    "trajectories": step * run["per_step"],
                    "seconds": round(run["step_time"].get(step, float("nan")), 1),
                    "eval_accuracy": round(accuracy, 4),
                    "eval_se": round(se, 4),
                }
            )
    title = f"dora bench modes --task {task} (warm start {start_acc:.3f} ± {start_se:.3f})"
    print_table(title, rows)
    live = mode_table(runs, rows)
    print_table(f"dora bench modes --task {task}: each mode live (mean over seeds)", live)
    saved = save_rows(
        f"modes-{task}",
        rows + [{"table": "modes", **r} for r in live],
        meta={
            "start_accuracy": start_acc,
            "start_se": start_se,
            "steps": steps,
            "seeds": seeds,
            "staleness": staleness,
        },
    )
    (out / "rows.json").write_text(json.dumps(rows, indent=2))
    _plot(rows, start_acc, out / "modes-task.png")
    print(f"saved {saved} and {out / 'modes-task.png'}")


def mode_table(runs: list[dict[str, Any]], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per mode: the run stats (mean and spread over seeds), final eval accuracy, and
    trained tokens/s as a ratio to sync and to partial of the same seed, where those ran."""
    from dora.bench.run_stats import run_stats

    stats = {(r["mode"], r["seed"]): run_stats(Path(r["run_dir"])) for r in runs}
    final = {}
    for r in rows:
        key = (r["mode"], r["seed"])
        if r["step"] >= final.get(key, (-1, 0.0))[0]:
            final[key] = (r["step"], r["eval_accuracy"])
    out = []
    for mode in dict.fromkeys(r["mode"] for r in runs):
        seeds = [s for m, s in stats if m == mode]
        row: dict[str, Any] = {"mode": mode, "seeds": len(seeds)}
        for name in ("trained_tok_s", "generated_tok_s", "step_s", "learner_wait_frac",
                     "utilization", "migrations", "reprefilled_tokens"):  # fmt: skip
            values = np.array([stats[mode, s][name] for s in seeds], dtype=float)
            row[name] = round(float(values.mean()), 3)
            if name == "trained_tok_s" and len(values) > 1:
                row["trained_tok_s_std"] = round(float(values.std(ddof=1)), 3)
        accuracy = [final[mode, s][1] for s in seeds if (mode, s) in final]
        row["final_accuracy"] = round(float(np.mean(accuracy)), 4) if accuracy else None
        for base in ("sync", "partial"):
            ratios = [
                stats[mode, s]["trained_tok_s"] / stats[base, s]["trained_tok_s"]
                for s in seeds
                if (base, s) in stats
            ]
            row[f"vs_{base}"] = round(float(np.mean(ratios)), 3) if ratios else None
        out.append(row)
    return out


def _start_model(out: Path, mode: str, seed: int, task: str) -> Path:
    from dora.stages.model_source import ModelSource

    spec = yaml.safe_load((out / f"{mode}-s{seed}.yaml").read_text())
    learner = next(e["config"] for e in spec["stages"] if e["type"] == "learner")
    return ModelSource(**learner["model"]).resolve(progress=False)


def _plot(rows: list[dict[str, Any]], start: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    styles = ("-", "--", ":", "-.")
    for m, mode in enumerate(sorted({r["mode"] for r in rows})):
        color = f"C{m}"  # one colour per mode, one line style per seed
        for k, seed in enumerate(sorted({r["seed"] for r in rows if r["mode"] == mode})):
            mine = sorted(
                (r for r in rows if r["mode"] == mode and r["seed"] == seed),
                key=lambda r: r["step"],
            )
            xs_t = [0] + [r["trajectories"] for r in mine]
            xs_s = [0.0] + [r["seconds"] for r in mine]
            ys = [start] + [r["eval_accuracy"] for r in mine]
            label = f"{mode} seed {seed}"
            style = {"color": color, "linestyle": styles[k % len(styles)], "marker": "o"}
            axes[0].plot(xs_t, ys, label=label, **style)
            axes[1].plot(xs_s, ys, label=label, **style)
    axes[0].set_xlabel("trajectories consumed")
    axes[1].set_xlabel("wall-clock seconds")
    for ax in axes:
        ax.set_ylabel("eval accuracy (greedy)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
