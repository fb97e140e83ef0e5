"""Discrete-event simulator: the rollout modes on thousands of timing-model engines.

``simulate(SimConfig(...))`` runs one mode; ``grid`` runs fleet sizes x modes. The dora mode
drives the same orchestrator ``plan`` and dispatcher staleness logic as the live system.
"""

from dora.sim.config import MODES, Mode, SimConfig, TrainerCost
from dora.sim.metrics import SimResult, StepRecord
from dora.sim.runner import grid, simulate

__all__ = [
    "MODES",
    "Mode",
    "SimConfig",
    "SimResult",
    "StepRecord",
    "TrainerCost",
    "grid",
    "simulate",
]
