"""Weight publication and fetching on the in-process bus."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dora.bus import MemoryBroker, MemoryBus
from dora.events import WeightVersion
from dora.learner.weights import (
    ChecksumMismatch,
    DirectoryTransport,
    WeightError,
    WeightFetcher,
    WeightPublisher,
    serialize_state_dict,
    sha256,
)
from dora.models import LlamaModel, build_model, hf_state_dict, load_state_dict_into
from dora.subjects import Subjects


def tiny(seed: int = 0) -> LlamaModel:
    model, _ = build_model(
        "tiny", seed=seed, num_hidden_layers=2, hidden_size=64, intermediate_size=128, head_dim=16
    )
    return model


@pytest.fixture
async def mbus() -> MemoryBus:
    bus = MemoryBus(Subjects("wtest"), broker=MemoryBroker())
    await bus.connect()
    yield bus
    await bus.close()


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


async def test_publish_then_fetch_round_trip(mbus: MemoryBus) -> None:
    model = tiny()
    sub = await mbus.subscribe(mbus.subjects.weights)
    consumer_events: list[WeightVersion] = []
    publisher = WeightPublisher(mbus)
    event = await publisher.publish(model, 1, step=0, metrics={"loss/pg": 0.5}, step_end=0.0)
    assert event.version == 1 and event.step == 0
    assert event.checksum == event.blob.sha256 == sha256(serialize_state_dict(hf_state_dict(model)))
    assert event.metrics["loss/pg"] == 0.5 and event.metrics["weights/publish_s"] > 0
    async for msg in sub:  # the event is announced on the weights subject
        consumer_events.append(WeightVersion.model_validate_json(msg.data))
        break
    assert consumer_events[0].checksum == event.checksum

    fetcher = WeightFetcher(mbus)
    state = await fetcher.fetch(1)
    assert same_weights(state, hf_state_dict(model))
    other = tiny(seed=1)
    load_state_dict_into(other, state)
    assert same_weights(hf_state_dict(other), hf_state_dict(model))
    assert fetcher.latest is not None and fetcher.latest.version == 1
    assert await fetcher.fetch(1) is state  # cached


async def test_latest_and_versions_from_kv(mbus: MemoryBus) -> None:
    publisher = WeightPublisher(mbus)
    await publisher.publish(tiny(0), 0, step=0)
    e1 = await publisher.publish(tiny(1), 1, step=0)
    fetcher = WeightFetcher(mbus)
    assert (await fetcher.describe()).checksum == e1.checksum
    assert same_weights(await fetcher.fetch(), hf_state_dict(tiny(1)))
    assert same_weights(await fetcher.fetch(0), hf_state_dict(tiny(0)))
    with pytest.raises(WeightError, match="version 7"):
        await fetcher.fetch(7)


async def test_checksum_mismatch_is_refused(mbus: MemoryBus) -> None:
    event = await WeightPublisher(mbus).publish(tiny(), 1, step=0)
    data = bytearray(mbus.broker.blobs[event.blob.name])
    data[-1] ^= 0xFF
    mbus.broker.blobs[event.blob.name] = bytes(data)
    fetcher = WeightFetcher(mbus)
    with pytest.raises(ChecksumMismatch, match="v1"):
        await fetcher.fetch(1)
    assert fetcher.latest is None


async def test_directory_transport(mbus: MemoryBus, tmp_path: Path) -> None:
    transport = DirectoryTransport(tmp_path / "w")
    event = await WeightPublisher(mbus, transport).publish(tiny(), 3, step=2)
    assert event.blob.store == "directory" and Path(event.blob.name).is_file()
    assert same_weights(await WeightFetcher(mbus).fetch(3), hf_state_dict(tiny()))


async def test_keep_versions_prunes_old_blobs(mbus: MemoryBus) -> None:
    publisher = WeightPublisher(mbus, keep_versions=2)
    events = [await publisher.publish(tiny(), v, step=v) for v in range(4)]
    assert sorted(mbus.broker.blobs) == sorted(e.blob.name for e in events[2:])


async def test_a_resumed_publisher_prunes_what_its_predecessor_published(
    mbus: MemoryBus,
) -> None:
    """The versions already deleted live in the KV store, not in the process that deleted
    them: a learner resumed after a crash goes on pruning the versions published before."""
    first = WeightPublisher(mbus, keep_versions=2)
    before = [await first.publish(tiny(), v, step=v) for v in range(4)]
    resumed = WeightPublisher(mbus, keep_versions=2)
    after = [await resumed.publish(tiny(), v, step=v) for v in (4, 5)]
    assert sorted(mbus.broker.blobs) == sorted(e.blob.name for e in after)
    assert before[3].blob.name not in mbus.broker.blobs


async def test_republished_version_wins(mbus: MemoryBus) -> None:
    """After a learner resumes it republishes versions past its checkpoint."""
    publisher = WeightPublisher(mbus)
    fetcher = WeightFetcher(mbus)
    old = await publisher.publish(tiny(0), 1, step=0)
    fetcher.remember(old)
    await publisher.publish(tiny(1), 1, step=0)
    assert same_weights(await fetcher.fetch(1), hf_state_dict(tiny(1)))
