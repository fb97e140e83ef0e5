"""LearnerConfig validation and construction from plain data."""

from __future__ import annotations

import pytest

from dora.learner import LearnerConfig


def test_from_dict_builds_nested_configs() -> None:
    cfg = LearnerConfig.from_dict(
        {
            "batch_groups": 4,
            "staleness_bound": 1,
            "grpo": {"eps_high": 0.3, "aggregation": "seq-mean-token-mean"},
            "optim": {"lr": 1e-4, "betas": [0.9, 0.95], "schedule": "cosine"},
            "weight_dir": "/tmp/w",
            "weight_store": "broadcast",
            "weight_broadcast": {"host": "10.0.0.5", "port": 29600, "bucket_mb": 8},
        }
    )
    assert cfg.weight_store == "broadcast" and cfg.weight_broadcast.port == 29600
    assert cfg.weight_broadcast.host == "10.0.0.5" and cfg.weight_broadcast.bucket_mb == 8
    assert cfg.batch_groups == 4 and cfg.staleness_bound == 1
    assert cfg.grpo.eps_high == 0.3 and cfg.grpo.aggregation == "seq-mean-token-mean"
    assert cfg.optim.betas == (0.9, 0.95) and cfg.optim.schedule == "cosine"
    assert str(cfg.weight_dir) == "/tmp/w"


def test_bad_fields_are_named() -> None:
    with pytest.raises(ValueError, match="epsx"):
        LearnerConfig.from_dict({"grpo": {"epsx": 1}})
    with pytest.raises(ValueError, match="batch_groups"):
        LearnerConfig(batch_groups=0)
    with pytest.raises(ValueError, match="schedule"):
        LearnerConfig.from_dict({"optim": {"schedule": "linear"}})
    with pytest.raises(ValueError, match="bucket_mib"):
        LearnerConfig.from_dict({"weight_broadcast": {"bucket_mib": 8}})


def test_ack_pending_room_covers_held_messages() -> None:
    cfg = LearnerConfig(batch_groups=64, checkpoint_every=10)
    assert cfg.ack_pending_limit >= 12 * 64 * 16
    assert LearnerConfig(max_ack_pending=50).ack_pending_limit == 50


def test_weight_store_keeps_what_the_staleness_bound_needs_by_default() -> None:
    assert LearnerConfig(staleness_bound=2).weight_versions_kept == 4  # K + 2
    assert LearnerConfig(staleness_bound=0).weight_versions_kept == 2
    assert LearnerConfig(keep_weight_versions="all").weight_versions_kept is None
    assert LearnerConfig(keep_weight_versions=7).weight_versions_kept == 7
    with pytest.raises(ValueError, match="keep_weight_versions"):
        LearnerConfig(keep_weight_versions=0)
