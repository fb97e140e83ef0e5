"""1,000 hostile payloads interleaved with valid events, on the real nats-server.

The stage must stay up, dead-letter every bad payload with a reason that names the problem,
and process every valid event.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re

from dora.bus import ConsumerSpec, NatsBus
from dora.events import DeadLetter, Prompt
from dora.stage import Context, StageRunner, stage
from dora.stage.deadletter import INLINE_PAYLOAD_MAX

BAD = 1000
GOOD = 200
HUGE_EVERY = 100  # 1 MB payloads: enough to prove the point without flooding the disk


def hostile(i: int) -> tuple[bytes, str]:
    """Bad payload number ``i`` (it carries the marker ``#i#``) and what its reason must say."""
    m = f"#{i}#"
    kind = i % 10
    if kind == 0 and i % HUGE_EVERY == 0:
        text = m + "x" * 1_000_001
        return json.dumps({"prompt_id": "huge", "text": text}).encode(), "at most 1000000"
    cases: list[tuple[bytes, str]] = [
        (json.dumps({"prompt_id": "a" * 5000 + m, "text": "x"}).encode(), "prompt_id"),
        (json.dumps({"prompt_id": 123, "text": m}).encode(), "prompt_id: Input should be a valid"),
        (("{oops " + m).encode(), "Invalid JSON"),
        (b"\xff\xfe\x80" + m.encode() + bytes(range(128, 256)), "Invalid JSON"),
        (json.dumps({"prompt_id": "a", "text": m, "hack": True}).encode(), "hack: Extra inputs"),
        (json.dumps({"prompt_id": "a", "text": m, "schema_version": 2}).encode(), "schema_version"),
        (json.dumps([m]).encode(), "Input should be an object"),
        (json.dumps({"prompt_id": "a", "text": m, "metadata": {"k": [1]}}).encode(), "metadata"),
        (json.dumps({"prompt_id": "a", "text": m, "split": "test"}).encode(), "split"),
        (json.dumps({"text": m}).encode(), "prompt_id: Field required"),
    ]
    return cases[kind]


def valid(i: int) -> Prompt:
    return Prompt(event_id=f"good-{i}", prompt_id=f"g{i}", text=f"{i}+1", answer=str(i + 1))


async def test_hostile_payloads_are_dead_lettered_and_valid_events_processed(
    nats_bus: NatsBus,
) -> None:
    s = nats_bus.subjects
    seen: list[str] = []

    @stage(consumes="prompts", concurrency=16)
    async def record(p: Prompt, ctx: Context) -> None:
        seen.append(p.event_id)

    letters_in = await nats_bus.consumer(ConsumerSpec("audit", s.deadletter, max_ack_pending=512))
    runner = StageRunner(record, nats_bus)
    await runner.start()  # running while the garbage arrives
    expected: dict[int, str] = {}
    good = 0
    for i in range(BAD):
        payload, needle = hostile(i)
        expected[i] = needle
        await nats_bus.publish(s.prompts, payload, msg_id=f"bad-{i}")
        if i % (BAD // GOOD) == 0:
            await nats_bus.publish_event(s.prompts, valid(good))
            good += 1
    assert good == GOOD

    letters: list[DeadLetter] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while (len(letters) < BAD or len(seen) < GOOD) and loop.time() < deadline:
        try:
            msgs = await letters_in.fetch(batch=256, timeout=0.5)
        except TimeoutError:  # nats-py may raise instead of returning []
            continue
        for msg in msgs:
            letters.append(DeadLetter.model_validate_json(msg.data))
            await msg.ack()
        assert all(not t.done() for t in runner.tasks), "the stage must stay up"
    await runner.stop()

    assert sorted(seen) == sorted(f"good-{i}" for i in range(GOOD))
    assert runner.stats.processed == GOOD
    assert runner.stats.dead_lettered == BAD == len(letters)
    found: set[int] = set()
    for letter in letters:
        raw = (
            base64.b64decode(letter.payload)
            if letter.payload_encoding == "base64"
            else letter.payload.encode()
        )
        match = re.search(rb"#(\d+)#", raw)
        assert match, f"dead letter lost its payload: {letter.reason}"
        i = int(match.group(1))
        assert i not in found, f"payload {i} dead-lettered twice"
        found.add(i)
        assert letter.stage == "record" and letter.subject == s.prompts
        assert letter.reason.startswith("invalid Prompt: ")
        assert expected[i] in letter.reason, (i, letter.reason)
        if i % HUGE_EVERY == 0:
            assert "stored as blob" in letter.reason and len(raw) == INLINE_PAYLOAD_MAX
            blob = re.search(r"blob '([^']+)'", letter.reason)
            assert blob is not None
            assert await nats_bus.get_blob(blob.group(1)) == hostile(i)[0]
        else:
            assert raw == hostile(i)[0]
        if i % 10 == 3:
            assert letter.payload_encoding == "base64"
    assert found == set(range(BAD))
