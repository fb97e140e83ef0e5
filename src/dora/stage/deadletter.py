"""Turning a message a stage cannot use into a ``DeadLetter`` that keeps it and says why."""

from __future__ import annotations

import base64
import contextlib
import uuid
from typing import TypeVar

import structlog
from pydantic import ValidationError

from dora.bus import Bus, Message
from dora.events import DeadLetter, Event
from dora.stage.base import derived_id

E = TypeVar("E", bound=Event)
log = structlog.get_logger(__name__)

INLINE_PAYLOAD_MAX = 256 * 1024
"""Payloads above this go to the blob store; the dead letter keeps a prefix and the blob name."""
REASON_MAX = 4000
MAX_ERRORS_LISTED = 8


def validation_reason(model: type, exc: ValidationError) -> str:
    """``invalid Prompt: prompt_id: String should have at most 256 characters; ...``.

    Inputs are left out of the reason: they may be huge, and the payload is kept anyway.
    """
    errors = exc.errors(include_url=False, include_input=False, include_context=False)
    parts = [
        f"{'.'.join(str(p) for p in err['loc']) or '<payload>'}: {err['msg']}"
        for err in errors[:MAX_ERRORS_LISTED]
    ]
    more = len(errors) - MAX_ERRORS_LISTED
    if more > 0:
        parts.append(f"(and {more} more errors)")
    return f"invalid {model.__name__}: " + "; ".join(parts)


def parse_event(model: type[E], data: bytes) -> tuple[E | None, str]:
    """``(event, "")``, or ``(None, reason)`` when ``data`` is not a valid ``model``: the one
    way every stage reads a message it may have to dead-letter (a 100k-deep array included)."""
    try:
        return model.model_validate_json(data), ""
    except ValidationError as exc:
        return None, validation_reason(model, exc)
    except RecursionError:
        return None, f"invalid {model.__name__}: nested too deeply"


def _encode(data: bytes) -> tuple[str, str]:
    try:
        return data.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        return base64.b64encode(data).decode("ascii"), "base64"


def original_payload(letter: DeadLetter) -> bytes:
    """The bytes a dead letter carries (the inverse of how ``build_dead_letter`` encodes
    them); raises ``ValueError`` for a payload marked base64 that is not."""
    if letter.payload_encoding == "base64":
        return base64.b64decode(letter.payload, validate=True)
    return letter.payload.encode()


async def build_dead_letter(bus: Bus, msg: Message, stage: str, reason: str) -> DeadLetter:
    """A DeadLetter for ``msg`` whose id depends only on the message, so re-sending dedupes.

    A core-NATS message (``status``) has no stream sequence: its dead letter gets a fresh id.
    """
    data = msg.data
    if msg.stream_seq or msg.msg_id:
        event_id = derived_id("deadletter", stage, msg.subject, msg.stream_seq, msg.msg_id or "")
    else:
        event_id = uuid.uuid4().hex
    if len(data) > INLINE_PAYLOAD_MAX:
        blob = f"deadletter-{stage}-{event_id}"
        try:
            await bus.put_blob(blob, data)
            where = f"stored as blob {blob!r}"
        except Exception as exc:  # the dead letter itself must still go out
            where = f"NOT stored ({type(exc).__name__}: {exc})"
        reason = (
            f"{reason} [payload of {len(data)} bytes {where}; "
            f"the first {INLINE_PAYLOAD_MAX} bytes are kept here]"
        )
        data = data[:INLINE_PAYLOAD_MAX]
    payload, encoding = _encode(data)
    if len(reason) > REASON_MAX:
        reason = reason[: REASON_MAX - 20] + " ...(truncated)"
    return DeadLetter(
        event_id=event_id,
        subject=msg.subject,
        payload=payload,
        payload_encoding=encoding,  # type: ignore[arg-type]
        reason=reason,
        stage=stage,
        deliveries=msg.num_delivered,
    )


async def dead_letter(bus: Bus, msg: Message, stage: str, reason: str) -> bool:
    """Publish ``msg``'s dead letter, then terminate ``msg`` (never redelivered): the one way
    every stage gives up on a message. When the letter cannot be published, ``msg`` is naked
    instead (it must not vanish without its letter) and False is returned."""
    try:
        letter = await build_dead_letter(bus, msg, stage, reason)
        await bus.publish_event(bus.subjects.deadletter, letter)
    except Exception as exc:
        log.error("dead_letter_publish_failed", stage=stage, error=repr(exc), reason=reason[:300])
        with contextlib.suppress(Exception):
            await msg.nak(delay=min(2.0 ** max(msg.num_delivered, 1), 60.0))
        return False
    with contextlib.suppress(Exception):  # a lost term only means one redelivery, lettered again
        await msg.term()
    return True
