"""ControlClient: every command's reply is read and checked."""

from __future__ import annotations

import pytest

from dora.bus import MemoryBus
from dora.events import AssignVersion, ControlReply
from dora.rollout.control_client import ControlClient, ControlFailed
from dora.subjects import Subjects

COMMAND = AssignVersion(engine_id="e0", version=3)


async def _client(reply: bytes | None) -> ControlClient:
    bus = MemoryBus(Subjects("cc"))
    await bus.connect()
    if reply is not None:

        async def handle(data: bytes) -> bytes:
            assert AssignVersion.model_validate_json(data) == COMMAND
            return reply

        await bus.serve(bus.subjects.control("e0"), handle)
    return ControlClient(bus, timeout_s=1.0)


async def test_an_accepted_command_returns_the_reply() -> None:
    client = await _client(ControlReply(ok=True, kv_bytes=7).model_dump_json().encode())
    assert (await client.send("e0", COMMAND)).kv_bytes == 7


@pytest.mark.parametrize(
    ("reply", "reason"),
    [
        (ControlReply(ok=False, error="busy").model_dump_json().encode(), "refused: busy"),
        (b"{not json", "unreadable reply"),
        (None, "NoResponders"),
    ],
    ids=["refused", "unreadable", "nobody"],
)
async def test_anything_but_an_accepting_reply_raises(reply: bytes | None, reason: str) -> None:
    client = await _client(reply)
    with pytest.raises(ControlFailed, match=reason) as caught:
        await client.send("e0", COMMAND)
    assert caught.value.engine_id == "e0"
