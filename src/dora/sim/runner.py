"""Run one configuration, or a grid of fleet sizes x modes, and collect the metrics."""

from __future__ import annotations

import time
from dataclasses import replace

from dora.sim.baselines import (
    Driver,
    OneStepOffDriver,
    PartialDriver,
    PartialSyncDriver,
    SyncDriver,
)
from dora.sim.config import MODES, Mode, SimConfig
from dora.sim.metrics import SimResult, summarize


def _driver(cfg: SimConfig) -> Driver:
    if cfg.mode == "sync":
        return SyncDriver(cfg)
    if cfg.mode == "one_step_off":
        return OneStepOffDriver(cfg)
    if cfg.mode == "partial":
        return PartialDriver(cfg)
    if cfg.mode == "partial_sync":
        return PartialSyncDriver(cfg)
    from dora.sim.dora_mode import DoraDriver

    return DoraDriver(cfg)


def simulate(cfg: SimConfig) -> SimResult:
    """Run one configuration to ``cfg.steps`` learner steps."""
    t0 = time.perf_counter()
    driver = _driver(cfg)
    records = driver.run()
    result = summarize(cfg, driver.fleet, records, plan_calls=driver.plan_calls)
    actions = getattr(driver, "actions", None)
    if actions:  # the planner's actions by type and reason (dora modes)
        result.extra["plan_actions"] = dict(sorted(actions.items()))
    result.sim_seconds = time.perf_counter() - t0
    return result


def grid(base: SimConfig, engines: list[int], modes: list[Mode] | None = None) -> list[SimResult]:
    """Every mode at every fleet size (same seed, so the same prompts and lengths)."""
    out = []
    for n in engines:
        for mode in modes or list(MODES):
            out.append(simulate(replace(base, engines=n, mode=mode)))
    return out
