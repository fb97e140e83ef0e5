"""Weight publication through the JetStream object store of a real nats-server."""

from __future__ import annotations

import pytest
import torch

from dora.bus import NatsBus
from dora.learner.weights import ChecksumMismatch, WeightFetcher, WeightPublisher
from dora.models import build_model, hf_state_dict

pytestmark = pytest.mark.nats


async def test_object_store_round_trip_and_tamper_detection(nats_bus: NatsBus) -> None:
    model, _ = build_model(
        "tiny", num_hidden_layers=2, hidden_size=64, intermediate_size=128, head_dim=16
    )
    event = await WeightPublisher(nats_bus).publish(model, 1, step=0, step_end=0.0)
    assert event.blob.store == "objectstore" and event.blob.size > 0
    fetcher = WeightFetcher(nats_bus)  # a fresh engine: finds v1 through the KV store
    state = await fetcher.fetch(1)
    want = hf_state_dict(model)
    assert state.keys() == want.keys()
    assert all(torch.equal(state[k], want[k]) for k in want)

    await nats_bus.put_blob(event.blob.name, b"corrupted bytes")
    with pytest.raises(ChecksumMismatch, match="not loaded"):
        await WeightFetcher(nats_bus).fetch(1)
