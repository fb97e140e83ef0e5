"""ReferenceCheck: what the recorder refuses although the schema accepts it."""

from __future__ import annotations

import pytest

from dora import events
from dora.bus import MemoryBus
from dora.reference_check import ReferenceCheck
from dora.subjects import Subjects
from dora.versions import UnknownVersion, announce, check_published


def trajectory(request_id: str, version: int) -> events.Trajectory:
    prompt = events.Prompt(prompt_id="p", text="1+1=", answer="2")
    request = events.RolloutRequest(
        request_id=request_id,
        prompt=prompt,
        group_id="g",
        group_index=0,
        group_size=1,
        version=version,
    )
    return events.Trajectory(
        request=request,
        version=version,
        prompt_token_ids=(1,),
        completion_token_ids=(2,),
        logprobs=(-0.1,),
        loss_mask=(1,),
        finish_reason="stop",
    )


def weights(version: int) -> events.WeightVersion:
    blob = events.BlobRef(name=f"w{version}", size=1)
    return events.WeightVersion(version=version, blob=blob, checksum="", step=version)


async def test_without_published_versions_only_duplicates_are_refused() -> None:
    bus = MemoryBus(Subjects("unit"))
    await bus.connect()
    check = ReferenceCheck(bus)
    assert await check.refusal("trajectories", trajectory("r1", 999)) == ""  # an echo run
    again = await check.refusal("trajectories", trajectory("r1", 999))
    assert again.startswith("duplicate: trajectories already holds a result of request 'r1'")
    scored = events.ScoredTrajectory(trajectory=trajectory("r1", 0), reward=1.0)
    assert await check.refusal("scored", scored) == ""  # each family counts its own
    assert (await check.refusal("scored", scored)).startswith("duplicate: scored")


async def test_a_version_never_published_is_refused_wherever_it_is_named() -> None:
    bus = MemoryBus(Subjects("unit"))
    await bus.connect()
    for v in (0, 1, 2):
        await announce(bus, weights(v))
    check = ReferenceCheck(bus)
    assert await check.refusal("trajectories", trajectory("r1", 2)) == ""
    assert await check.refusal("weights", weights(1)) == ""
    assert await check.refusal("metrics", events.Metrics(step=1, values={})) == ""  # v2
    unknown = "unknown version: no policy version {} was published"
    assert await check.refusal("trajectories", trajectory("r2", 3)) == unknown.format(3)
    assert await check.refusal("weights", weights(999)) == unknown.format(999)
    assert await check.refusal("metrics", events.Metrics(step=500, values={})) == unknown.format(
        501
    )
    mixed = trajectory("r3", 2).model_copy(update={"token_versions": (2, 7)})
    assert await check.refusal("trajectories", mixed) == unknown.format(7)
    await announce(bus, weights(3))  # published later: now it is known
    assert await check.refusal("trajectories", trajectory("r2", 3)) == ""


async def test_an_announcement_must_match_the_published_checksum() -> None:
    bus = MemoryBus(Subjects("unit"))
    await bus.connect()
    real = weights(1).model_copy(update={"checksum": "a" * 64})
    await announce(bus, real)
    await check_published(bus, 1, "WeightVersion.version", checksum=real.checksum)
    with pytest.raises(UnknownVersion, match="checksum 'bbbbbbbbbbbbbbbb' is not the published"):
        await check_published(bus, 1, "WeightVersion.version", checksum="b" * 64)
    with pytest.raises(UnknownVersion, match="no policy version 2 was published"):
        await check_published(bus, 2, "WeightVersion.version")
