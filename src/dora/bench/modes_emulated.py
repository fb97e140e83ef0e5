"""``dora bench modes --fleet emulated``: the four rollout modes on an emulated H200 fleet,
checked against the simulator on the same setting.

Each mode runs on the real stages and a real (embedded) nats-server with ``SimEngine``s paced
at ``time_scale`` emulated seconds per wall second (``dora.testing.emulated_fleet``); then the
same setting runs in ``dora.sim`` (virtual time, no bus). Both report end-to-end tokens/s:
completion tokens the learner consumed / time from the first dispatch to the end of the last
step. Emulated time is wall time x ``time_scale``: an engine's decode step of 30 ms is 0.6 ms
of wall time at 50x, and a learner step of 40 s is a 0.8 s sleep.

Defaults, sized for a few minutes on two loaded CPU cores: B = 2 groups per engine, G = 8,
K = 1, trainer GPUs = engines (the simulator's default). At 16 engines that is 256 samples
per step (the paper's 64-GPU runs use 8,192); both sides use the same B and G. Use
``--time-scale 50`` (or lower): every bus hop costs real milliseconds, i.e. ``time_scale``
times as many emulated ones.

Limits (what the emulation does not capture, or inflates):

- bus and Python overheads are scaled up by ``time_scale``: dispatching a group (~20-70 ms of
  wall time here), scoring, control round trips, a migration's export/import (partial
  rollout resumes interrupted requests on their own engine, no bus traffic);
- the scored events reaching the learner stand-in carry one token, not the whole sample
  (the scorer records the counts first), and the stand-in trains on nothing;
- a migration's KV transfer is not charged to the request (the import is instant on the
  engine's clock), only the protocol's wall-clock round trips are;
- request placement: each generator pulls one request per fetch (``pull_batch``; the live
  generator fetches as many as it has room for), so a burst goes round-robin over the
  engines with room, as the baselines' routers do; the simulator spreads it least-loaded
  first: close, not identical (requests held per engine spread 7-11 apart against 6);
- every request waits for the dispatcher's wall-clock rate (~1-6 emulated s per group at
  50x, more on a loaded machine) and a pull hop before an engine takes it; the simulator
  dispatches a batch at once (``idle_queued`` / ``idle_empty`` / ``pickup_s_mean`` in the
  JSON rows show where emulated engine time went);
- run-to-run noise from other load on the machine: the event loop's lag is reported
  (``loop-lag-p99-ms``); compare ratios within one run, and repeat seeds.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from dora.testing.emulated_fleet import (
    EMULATED_MODES,
    EmulatedConfig,
    run_emulated,
    summarize,
)

GROUPS_PER_ENGINE = 2
GROUP_SIZE = 8
STALENESS = 1


def default_config(
    engines: int,
    steps: int,
    seed: int,
    preset: str,
    workload: str,
    time_scale: float,
    groups_per_engine: int = GROUPS_PER_ENGINE,
    admission: str = "slots",
    relieve_preempted: bool = True,
) -> EmulatedConfig:
    """The documented defaults (see the module docstring)."""
    return EmulatedConfig(
        engines=engines,
        steps=steps,
        admission=admission,
        relieve_preempted=relieve_preempted,
        batch_groups=groups_per_engine * engines,
        group_size=GROUP_SIZE,
        staleness=STALENESS,
        seed=seed,
        preset=preset,
        workload=workload,
        time_scale=time_scale,
    )


def _with_ratios(rows: list[dict[str, Any]]) -> None:
    """Add ``vs_sync`` / ``vs_partial`` (tokens/s ratios within one seed and source)."""
    by = {(r["source"], r["seed"], r["mode"]): r for r in rows}
    for r in rows:
        for base in ("sync", "partial"):
            other = by.get((r["source"], r["seed"], base))
            ok = other is not None and other["tokens_per_s"] > 0
            r[f"vs_{base}"] = r["tokens_per_s"] / other["tokens_per_s"] if ok else None


def _sim_row(cfg: EmulatedConfig) -> dict[str, Any]:
    from dora.testing.emulated_trace import sim_breakdown

    r, parts = sim_breakdown(cfg.sim_config())
    return {
        "source": "sim",
        "seed": cfg.seed,
        "mode": cfg.mode,
        "tokens_per_s": r.tokens_per_s,
        "step_s": r.step_s,
        "rollout_s": r.rollout_s,
        "wait_s": r.wait_s,
        "train_s": r.train_s,
        "utilization": r.utilization,
        "migrations": r.migrations,
        "reprefilled_tokens": r.reprefilled_tokens,
        "staleness_mean": r.staleness_mean,
        "staleness_max": r.staleness_max,
        "wall_s": r.sim_seconds,
        "idle_queued": parts.fractions()["idle_queued"],
        "idle_empty": parts.fractions()["idle_empty"],
        "held_spread": parts.held_spread,
        "pickup_s_mean": parts.pickup_s_mean,
    }


def comparison(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """dora/sync and dora/partial, emulated vs simulated, per seed and averaged over seeds."""
    out = []
    by = {(r["source"], r["seed"], r["mode"]): r for r in rows}
    seeds = sorted({r["seed"] for r in rows})
    for ratio in ("vs_sync", "vs_partial"):
        pairs = []
        for seed in seeds:
            emu = by.get(("emulated", seed, "dora"), {}).get(ratio)
            sim = by.get(("sim", seed, "dora"), {}).get(ratio)
            if emu is None or sim is None:
                continue
            pairs.append((emu, sim))
            out.append(_cmp(f"dora {ratio.replace('vs_', '/ ')}", str(seed), emu, sim))
        if len(pairs) > 1:
            emu, sim = (float(np.mean(x)) for x in zip(*pairs, strict=True))
            out.append(_cmp(f"dora {ratio.replace('vs_', '/ ')}", "mean", emu, sim))
    return out


def _cmp(name: str, seed: str, emu: float, sim: float) -> dict[str, Any]:
    diff = emu / sim - 1.0
    return {
        "ratio": name,
        "seed": seed,
        "emulated": emu,
        "sim": sim,
        "difference": diff,
        "within_10pct": abs(diff) < 0.10,
    }


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def results_table(cfg: EmulatedConfig, rows: list[dict[str, Any]]) -> Table:
    t = Table(
        title=(
            f"dora bench modes (emulated fleet vs dora sim): {cfg.engines} x {cfg.preset} "
            f"(H200), {cfg.workload}, B={cfg.batch_groups}x{cfg.group_size}, "
            f"K={cfg.staleness}, {cfg.steps} steps, {cfg.time_scale:g}x; times in emulated s"
        )
    )
    columns = [
        "source",
        "seed",
        "mode",
        "tokens/s",
        "vs-sync",
        "vs-partial",
        "step-s",
        "rollout-s",
        "learner-wait-s",
        "util",
        "migr",
        "re-prefill-tok",
        "stale-mean/max",
        "loop-lag-p99-ms",
        "wall-s",
    ]
    for c in columns:
        t.add_column(c, justify="left" if c in ("source", "mode") else "right")
    for r in rows:
        lag = r.get("loop_lag_p99_ms")
        t.add_row(
            r["source"],
            str(r["seed"]),
            r["mode"],
            f"{r['tokens_per_s']:,.0f}",
            _x(r["vs_sync"]),
            _x(r["vs_partial"]),
            f"{r['step_s']:.0f}",
            f"{r['rollout_s']:.0f}",
            f"{r['wait_s']:.0f}",
            f"{r['utilization']:.2f}",
            f"{r['migrations']:,}",
            f"{r['reprefilled_tokens']:,}",
            f"{r['staleness_mean']:.2f}/{r['staleness_max']}",
            "-" if lag is None else f"{lag:.0f}",
            f"{r['wall_s']:.1f}",
        )
    return t


def comparison_table(cmp: list[dict[str, Any]]) -> Table:
    t = Table(title="acceptance: emulated vs simulated ratio (|difference| < 10%)")
    for c in ("ratio", "seed", "emulated", "sim", "difference", "within 10%"):
        t.add_column(c, justify="left" if c == "ratio" else "right")
    for c in cmp:
        t.add_row(
            c["ratio"],
            c["seed"],
            _x(c["emulated"]),
            _x(c["sim"]),
            f"{c['difference'] * 100:+.1f}%",
            "yes" if c["within_10pct"] else "NO",
        )
    return t


def save_png(path: Path, rows: list[dict[str, Any]], modes: list[str]) -> None:
    """Tokens/s by mode (mean over seeds), emulated next to simulated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.38
    for i, source in enumerate(("emulated", "sim")):
        values = [
            float(
                np.mean(
                    [r["tokens_per_s"] for r in rows if r["source"] == source and r["mode"] == m]
                    or [0.0]
                )
            )
            for m in modes
        ]
        ax.bar([j + i * width for j in range(len(modes))], values, width, label=source)
    ax.set_xticks([j + width / 2 for j in range(len(modes))])
    ax.set_xticklabels(modes)
    ax.set_ylabel("end-to-end tokens/s (emulated time)")
    ax.set_title("rollout modes: emulated fleet vs simulator")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


async def _run_all(configs: list[EmulatedConfig], console: Console) -> list[dict[str, Any]]:
    from dora.bus.server import NatsServer

    rows = []
    with tempfile.TemporaryDirectory(prefix="dora-emulated-") as tmp, NatsServer(Path(tmp)) as srv:
        for cfg in configs:
            sim = _sim_row(cfg)
            # a stall must not hang the bench: 3x the simulated duration, plus start-up
            budget = 3 * cfg.wall(sim["step_s"] * cfg.steps) + 60
            run = await run_emulated(replace(cfg, timeout_s=budget), srv.url)
            if run.failures:
                console.log(f"[red]emulated {cfg.mode} seed {cfg.seed}: {run.failures}")
            if not run.steps:
                rows.append(sim)
                continue
            row = {"source": "emulated", "seed": cfg.seed, **summarize(run)}
            row["failures"] = run.failures
            console.log(
                f"emulated {cfg.mode:<13} seed {cfg.seed}: {row['tokens_per_s']:>8,.0f} tok/s, "
                f"{row['step_s']:.0f} s/step ({row['wall_s']:.0f} s wall, loop lag p99 "
                f"{row['loop_lag_p99_ms']:.0f} ms)"
            )
            rows.append(row)
            rows.append(sim)
    return rows


def run_emulated_comparison(
    modes: list[str],
    engines: int,
    steps: int,
    seeds: list[int],
    preset: str,
    workload: str,
    time_scale: float,
    out: Path | None,
    console: Console | None = None,
    groups_per_engine: int = GROUPS_PER_ENGINE,
    admission: str = "slots",
    relieve_preempted: bool = True,
) -> dict[str, Any]:
    """Run every mode and seed emulated and simulated; print, save JSON + PNG, return both."""
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    console = console or Console(width=200)
    for m in modes:
        if m not in EMULATED_MODES:
            raise ValueError(f"modes: unknown mode {m!r}; known: {list(EMULATED_MODES)}")
    if not seeds:
        raise ValueError("seeds: at least one seed is needed")
    base = default_config(
        engines,
        steps,
        seeds[0],
        preset,
        workload,
        time_scale,
        groups_per_engine,
        admission,
        relieve_preempted,
    )
    configs = [replace(base, mode=m, seed=s) for s in seeds for m in modes]  # type: ignore[arg-type]
    t0 = time.perf_counter()
    rows = asyncio.run(_run_all(configs, console))
    wall = time.perf_counter() - t0
    _with_ratios(rows)
    cmp = comparison(rows)
    console.print(results_table(base, rows))
    if cmp:
        console.print(comparison_table(cmp))
    console.print(f"total wall time {wall:.0f} s")
    out = out or Path("runs/bench") / f"modes-emulated-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in asdict(base).items() if k not in ("mode", "seed")}
    payload = {
        "bench": "modes-emulated",
        "config": {**config, "modes": modes, "seeds": seeds},
        "time": "emulated seconds = wall seconds x time_scale",
        "wall_s": wall,
        "rows": rows,
        "comparison": cmp,
    }
    (out / "modes_emulated.json").write_text(json.dumps(payload, indent=2) + "\n")
    save_png(out / "modes_emulated.png", rows, modes)
    console.print(f"saved {out / 'modes_emulated.json'} and {out / 'modes_emulated.png'}")
    return payload
