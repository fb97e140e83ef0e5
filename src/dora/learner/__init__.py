"""GRPO learner: loss, batching under the staleness bound, trainer, weights, checkpoints.

Public API::

    from dora.learner import LearnerConfig, LearnerService, GRPOConfig, OptimConfig
    from dora.learner import WeightFetcher, WeightPublisher, ChecksumMismatch
"""

from dora.learner.batching import (
    AddOutcome,
    Batch,
    BatchSelector,
    Group,
    GroupBuffer,
    InvalidTrajectory,
)
from dora.learner.checkpoint import CheckpointManager, LearnerState
from dora.learner.config import LearnerConfig
from dora.learner.grpo import GRPOConfig, group_advantages, grpo_loss
from dora.learner.metrics import MetricsWriter, read_metrics
from dora.learner.service import LearnerService
from dora.learner.trainer import OptimConfig, Trainer
from dora.learner.weights import (
    ChecksumMismatch,
    DirectoryTransport,
    ObjectStoreTransport,
    WeightError,
    WeightFetcher,
    WeightPublisher,
    WeightTransport,
)

__all__ = [
    "AddOutcome",
    "Batch",
    "BatchSelector",
    "CheckpointManager",
    "ChecksumMismatch",
    "DirectoryTransport",
    "GRPOConfig",
    "Group",
    "GroupBuffer",
    "InvalidTrajectory",
    "LearnerConfig",
    "LearnerService",
    "LearnerState",
    "MetricsWriter",
    "ObjectStoreTransport",
    "OptimConfig",
    "Trainer",
    "WeightError",
    "WeightFetcher",
    "WeightPublisher",
    "WeightTransport",
    "group_advantages",
    "grpo_loss",
    "read_metrics",
]
