"""``dora bench plan``: time one ``orchestrator.plan`` call on synthetic fleets, 8..10,000 engines.

The fleets look like a dora run in the middle of a version change: most engines serve the
newest version near full occupancy with a deep queue, an older version's long tail is spread
thin over a fifth of the fleet (consolidation candidates), a few engines hold an urgent
version, a few are idle or loading. The goal is < 10 ms per call at 1,024 engines (the live
service replans every second or so; the simulator calls it at 10,000 engines). The baseline
row of each size is one bare pass over the same engines (reading the fields ``plan`` needs):
``x_scan`` says how many such passes one ``plan`` call costs.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from typing import Any

import typer

from dora.rollout.estimates import LengthModel
from dora.rollout.state import ClusterState, EngineView, RequestView

SIZES = (8, 64, 128, 1024, 10_000)
TARGET_MS = 10.0


def long_tail_lengths(rnd: random.Random, n: int = 2000, max_tokens: int = 8192) -> list[int]:
    """Log-normal response lengths, capped: most short, a few very long."""
    return [min(max_tokens, max(1, int(rnd.lognormvariate(6.0, 1.0)))) for _ in range(n)]


def synthetic_fleet(
    engines: int,
    seed: int = 0,
    newest: int = 5,
    staleness_bound: int = 2,
    max_running: int = 64,
    kv_blocks: int = 4096,
    block_size: int = 16,
    max_tokens: int = 8192,
    now: float = 10_000.0,
) -> ClusterState:
    """A fleet mid version change (see the module docstring); deterministic by ``seed``."""
    rnd = random.Random(seed)
    views = []
    for i in range(engines):
        eid = f"engine-{i:05d}"
        roll = rnd.random()
        if roll < 0.03:
            views.append(EngineView(eid, "idle", None, None, kv_blocks, block_size=block_size))
            continue
        if roll < 0.06:
            views.append(
                EngineView(
                    eid,
                    "loading",
                    newest - 1,
                    newest,
                    kv_blocks,
                    block_size=block_size,
                    max_running=max_running,
                    assigned_at=now - 2.0,
                )
            )
            continue
        if roll < 0.70:
            version, count, gen_hi = newest, rnd.randint(max_running // 2, max_running), 1500
        elif roll < 0.95:
            version, count, gen_hi = newest - 1, rnd.randint(1, 12), 6000
        else:
            version, count, gen_hi = newest - staleness_bound, rnd.randint(1, 4), 7000
        requests = []
        used = 0
        for j in range(count):
            generated = rnd.randint(0, gen_hi)
            blocks = (300 + generated) // block_size + 1
            if used + blocks > kv_blocks:
                break
            used += blocks
            requests.append(
                RequestView(
                    f"{eid}-r{j}",
                    version,
                    generated,
                    max_tokens,
                    blocks,
                    last_migrated_at=now - 100.0 if rnd.random() < 0.05 else None,
                )
            )
        views.append(
            EngineView(
                eid,
                "serving",
                version,
                version,
                kv_blocks,
                used,
                block_size=block_size,
                max_running=max_running,
                tokens_per_s=40.0 * len(requests),
                requests=tuple(requests),
                assigned_at=now - rnd.uniform(0, 300),
            )
        )
    return ClusterState(
        now=now,
        engines=tuple(views),
        queue_depths={newest: engines * 16},
        newest_version=newest,
        learner_step=newest,
        staleness_bound=staleness_bound,
        lengths=LengthModel.from_lengths(long_tail_lengths(rnd, max_tokens=max_tokens)),
    )


def _scan(state: ClusterState) -> int:
    """Baseline: one bare pass reading what ``plan`` reads per engine."""
    n = 0
    for e in state.engines:
        if e.state != "stopped" and e.pulls is not None:
            n += len(e.requests) + e.waiting + e.kv_blocks_used
    return n


def _time(fn: Any, arg: Any, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(arg)
        out.append((time.perf_counter() - t0) * 1000.0)
    return out


def measure(
    sizes: tuple[int, ...], repeats: int, seed: int = 0, fast_lane: bool = False
) -> list[dict[str, Any]]:
    from dora.rollout.actions import AssignEngine, MigrateRequests, PrioritizeRequests
    from dora.rollout.orchestrator import OrchestratorConfig, plan

    config = OrchestratorConfig(fast_lane=fast_lane)
    rows = []
    for n in sizes:
        state = synthetic_fleet(n, seed=seed)
        gc.collect()
        gc.freeze()  # the fleet's objects are the harness's heap, not plan's garbage
        actions = plan(state, config)
        reps = max(3, repeats if n <= 1024 else repeats // 4)
        plan_ms = _time(lambda s: plan(s, config), state, reps)
        scan_ms = _time(_scan, state, reps)
        median = statistics.median(plan_ms)
        rows.append(
            {
                "engines": n,
                "requests": sum(e.running for e in state.engines),
                "min_ms": min(plan_ms),
                "median_ms": median,
                "p95_ms": sorted(plan_ms)[int(0.95 * (len(plan_ms) - 1))],
                "scan_ms": statistics.median(scan_ms),
                "x_scan": median / max(statistics.median(scan_ms), 1e-9),
                "median/10ms": median / TARGET_MS,
                "actions": len(actions),
                "assign": sum(isinstance(a, AssignEngine) for a in actions),
                "migrate": sum(isinstance(a, MigrateRequests) for a in actions),
                "moved": sum(len(a.request_ids) for a in actions if isinstance(a, MigrateRequests)),
                "prio": sum(isinstance(a, PrioritizeRequests) for a in actions),
            }
        )
        del state
        gc.unfreeze()
    return rows


def cli(
    sizes: str = typer.Option(
        ",".join(map(str, SIZES)), "--sizes", help="Comma-separated fleet sizes (engines)."
    ),
    repeats: int = typer.Option(50, "--repeats", help="Timed calls per size (1/4 above 1,024)."),
    seed: int = typer.Option(0, "--seed", help="Synthetic fleet seed."),
    fast_lane: bool = typer.Option(False, "--fast-lane", help="Time plan with rule 7 on."),
) -> None:
    """Time ``orchestrator.plan`` per call on synthetic fleets (goal: < 10 ms at 1,024)."""
    from dora.bench.report import print_table, save_rows

    chosen = tuple(int(s) for s in sizes.split(",") if s.strip())
    if not chosen or min(chosen) < 1:
        raise typer.BadParameter("--sizes needs positive integers", param_hint="--sizes")
    rows = measure(chosen, repeats, seed, fast_lane)
    print_table("dora bench plan (goal: median_ms < 10 at 1,024 engines)", rows)
    meta = {"repeats": repeats, "seed": seed, "target_ms": TARGET_MS, "fast_lane": fast_lane}
    path = save_rows("plan", rows, meta=meta)
    typer.echo(f"saved {path}")
