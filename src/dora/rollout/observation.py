"""Reading observations (events a service watches but does not own) into a service's state.

``parsed(model, handle)`` turns a handler of events into a handler of messages that raises
``InvalidEvent`` (with the validation reason) for a message that is not a ``model``; the
service dead-letters it. ``refused_request_id`` finds the request in a generator's dead letter
(the dispatcher abandons that request's group).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

from dora.bus import Message
from dora.events import DeadLetter, Event, RolloutRequest
from dora.stage.deadletter import original_payload, parse_event
from dora.subjects import Subjects

E = TypeVar("E", bound=Event)


class InvalidEvent(ValueError):
    """A message that is not a valid event of its subject's type (the reason says why)."""


def parsed(
    model: type[E], handle: Callable[[E], Awaitable[None]]
) -> Callable[[Message], Awaitable[None]]:
    """``handle`` applied to each message parsed as ``model`` (``InvalidEvent`` otherwise)."""

    async def apply(msg: Message) -> None:
        event, reason = parse_event(model, msg.data)
        if event is None:
            raise InvalidEvent(reason)
        await handle(event)

    return apply


def refused_request_id(data: bytes, subjects: Subjects) -> str | None:
    """The request id in a generator's dead letter of a request (None for any other)."""
    letter, _ = parse_event(DeadLetter, data)
    if letter is None or not letter.stage.startswith("generator:"):
        return None
    try:
        if subjects.family_of(letter.subject) != "requests":
            return None
        raw = original_payload(letter)
    except ValueError:
        return None
    request, _ = parse_event(RolloutRequest, raw)
    return None if request is None else request.request_id
