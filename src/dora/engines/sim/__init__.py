"""Timing-model engine: an engine that computes nothing but knows how long everything takes.

``TimingCore`` is the event-driven replica the simulator runs by the thousand; ``SimEngine``
wraps one behind the Engine protocol (pydantic requests in, trajectories out) so an emulated
fleet can run the real stages on a real bus.
"""

from dora.engines.sim.core import SimRequest, TimingCore
from dora.engines.sim.cost import DENSE_7B, DENSE_32B, PRESETS, CostModel, cost_preset
from dora.engines.sim.engine import SimEngine
from dora.engines.sim.workload import (
    AGENTIC,
    DAPO_16K,
    DAPO_32K,
    WORKLOADS,
    RequestSpec,
    Workload,
    workload_preset,
)

__all__ = [
    "AGENTIC",
    "DAPO_16K",
    "DAPO_32K",
    "DENSE_7B",
    "DENSE_32B",
    "PRESETS",
    "WORKLOADS",
    "CostModel",
    "RequestSpec",
    "SimEngine",
    "SimRequest",
    "TimingCore",
    "Workload",
    "cost_preset",
    "workload_preset",
]
