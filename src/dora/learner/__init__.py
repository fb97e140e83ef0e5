"""GRPO learner: loss, batching under the staleness bound, trainer, weights, checkpoints.

Learner side::

    from dora.learner import LearnerConfig, LearnerService
    model, tok = dora.models.build_model("tiny")          # or load_pretrained(warm_start_dir)
    config = LearnerConfig(batch_groups=8, staleness_bound=2, checkpoint_every=10)
    service = LearnerService(bus, model, config, run_dir, tokenizer=tok)
    await service.run(stop_event)    # resumes from run_dir/checkpoints when one exists

It consumes ``subjects.scored`` (durable ``learner``), reads the ``ledger`` KV key, steps
every B complete groups, publishes ``WeightVersion`` (version s+1 after step s; version 0 at a
fresh start) and ``Metrics`` (with ``consumed_groups``), writes ``run_dir/metrics.jsonl`` and
TensorBoard, and checkpoints. Engine side::

    fetcher = WeightFetcher(bus)
    state = await fetcher.fetch(version)     # verified sha256; ChecksumMismatch otherwise
    load_state_dict_into(model, state)
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
