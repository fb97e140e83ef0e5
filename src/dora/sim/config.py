"""What one simulated run is: fleet, mode, batch, staleness bound, cost and workload models."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dora.engines.sim.core import SLOT_ADMIT_FRACTION
from dora.engines.sim.cost import DENSE_32B, CostModel
from dora.engines.sim.workload import DAPO_16K, Workload

StartOrder = Literal["fifo", "oracle_request", "oracle_group"]
START_ORDERS: tuple[StartOrder, ...] = ("fifo", "oracle_request", "oracle_group")
"""How dora mode queues a batch of admitted groups. ``fifo`` is the policy; the two oracle
orders are yardsticks of critical-path scheduling, not policies: they read the lengths the
workload drew (longest request first; or groups by their mean log-length, the most a
per-prompt length history could know)."""

Admission = Literal["slots", "kv"]
ADMISSIONS: tuple[Admission, ...] = ("slots", "kv")
"""How an engine admits requests, in every mode alike. ``slots``: at most ``max_seqs``
(tuned to 85% of the KV over the mean context), a preempted request waits on its engine.
``kv``: while the KV cache is below ``kv_watermark``, up to ``kv_max_seqs``, and a preempted
request goes back to the front of its queue, so any engine with room resumes it."""

Mode = Literal["sync", "one_step_off", "partial", "partial_sync", "dora", "dora_noreuse"]
MODES: tuple[Mode, ...] = (
    "sync",
    "one_step_off",
    "partial",
    "partial_sync",
    "dora",
    "dora_noreuse",
)


@dataclass(frozen=True)
class TrainerCost:
    """The learner stand-in: a separate pool of trainer GPUs running GRPO steps.

    Assumption (stated, not measured): training costs ``flops_per_param_token`` FLOPs per
    parameter per token of prompt + completion (10, what a GRPO step does: forward + backward
    6, the old policy's logprobs 2, the reference model's 2; 6 is forward + backward alone), at
    ``mfu`` of the
    trainer GPUs' peak, plus a fixed ``step_overhead_s`` (optimizer step, publishing weights).
    Trainer GPUs are disjoint from the rollout engines (a disaggregated layout, so async modes
    can overlap training with rollout; sync pays both in series on the same hardware budget).
    """

    gpus: int
    peak_flops: float = 989.4e12
    mfu: float = 0.40
    flops_per_param_token: float = 10.0
    step_overhead_s: float = 5.0

    def step_time(self, tokens: int, params: float) -> float:
        flops = self.flops_per_param_token * params * tokens
        return self.step_overhead_s + flops / (self.gpus * self.peak_flops * self.mfu)


@dataclass(frozen=True)
class SimConfig:
    """One simulated run. ``trainer_gpus=None`` means as many trainer GPUs as engines."""

    engines: int = 64
    mode: Mode = "dora"
    steps: int = 20
    batch_groups: int = 512  # B: GRPO groups (prompts) per learner step (DAPO: 512)
    group_size: int = 16  # G: samples per prompt (DAPO: 16)
    staleness: int = 1  # K: a group of version u is trained at step <= u + K
    seed: int = 0
    cost: CostModel = DENSE_32B
    workload: Workload = DAPO_16K
    trainer_gpus: int | None = None
    trainer: TrainerCost | None = field(default=None)
    train_flops_per_token: float = 10.0  # per parameter (see TrainerCost)
    max_seqs: int | None = None  # per engine; None: tuned to the KV capacity (see fleet)
    plan_tick_s: float = 20.0  # dora: plan runs this often (virtual s) and at each publish
    plan_debounce_s: float = 1.0  # ... and this soon after an engine of an old version runs dry
    migration_bw: float | None = None  # bytes/s; None: the cost model's
    migrate_urgent: bool = True  # plan may consolidate urgent requests (with K=1 all are)
    start_order: StartOrder = "fifo"  # dora mode only; see START_ORDERS
    admission: Admission = "slots"  # every mode; see ADMISSIONS
    relieve_preempted: bool = True  # dora: plan moves preempted requests to engines with room
    fast_lane: bool = False  # dora: plan moves critical requests onto lightly loaded engines
    fast_lane_batch: int = 4  # ... running at most this many
    fast_lane_min_s: float = 60.0  # ... when their expected remaining time exceeds this
    kv_watermark: float = 0.9  # admission="kv": admit while KV use is below this fraction
    kv_max_seqs: int = 100  # admission="kv": the slot cap (max_seqs overrides it)

    def __post_init__(self) -> None:
        if self.engines < 1:
            raise ValueError(f"engines must be >= 1, got {self.engines}")
        if self.mode not in MODES:
            raise ValueError(f"mode: unknown {self.mode!r}; known: {list(MODES)}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.batch_groups < 1 or self.group_size < 1:
            raise ValueError("batch_groups and group_size must be >= 1")
        if self.staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {self.staleness}")
        if self.start_order not in START_ORDERS:
            raise ValueError(
                f"start_order: unknown {self.start_order!r}; known: {list(START_ORDERS)}"
            )
        if self.admission not in ADMISSIONS:
            raise ValueError(f"admission: unknown {self.admission!r}; known: {list(ADMISSIONS)}")
        if not 0.0 < self.kv_watermark <= 1.0:
            raise ValueError(f"kv_watermark must be in (0, 1], got {self.kv_watermark}")
        if self.kv_max_seqs < 1:
            raise ValueError(f"kv_max_seqs must be >= 1, got {self.kv_max_seqs}")
        if self.plan_tick_s <= 0:
            raise ValueError(f"plan_tick_s must be > 0, got {self.plan_tick_s}")

    @property
    def admit_fraction(self) -> float:
        """The KV fraction below which an engine admits (the slot cap binds first under
        ``slots``): one rule for the simulator's cores and the emulated engines."""
        return self.kv_watermark if self.admission == "kv" else SLOT_ADMIT_FRACTION

    @property
    def learner(self) -> TrainerCost:
        if self.trainer is not None:
            return self.trainer
        return TrainerCost(
            gpus=self.trainer_gpus or self.engines,
            flops_per_param_token=self.train_flops_per_token,
        )
