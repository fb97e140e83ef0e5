"""How a conversation becomes tokens, append-only: each message is rendered on its own.

The trajectory of an episode is the rendered opening followed, turn by turn, by exactly the
sampled tokens and the rendered environment reply; nothing already in the context is ever
decoded and encoded again. That holds only if rendering the conversation so far and then the
reply gives the same tokens as rendering both at once (no separator dropped, no pieces merged
across the boundary): ``check_append_only`` proves it for the format and tokenizer at start-up,
and the generator refuses to start otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from pydantic import BaseModel, ConfigDict, Field

from dora.events import ChatMessage

Encode = Callable[[str], list[int]]


class ChatFormat(BaseModel):
    """A template per role (``{content}`` is replaced) and the header that opens each
    assistant turn (where generation starts)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    system: str = Field(default="{content}\n", description="Template of a system message.")
    user: str = Field(default="{content}\n", description="Template of a user message.")
    tool: str = Field(default="<tool>{content}</tool>\n", description="A tool result.")
    assistant: str = Field(default="", description="Opens every assistant turn.")
    assistant_message: str = Field(
        default="{content}\n", description="An assistant message the environment supplies."
    )

    def render(self, messages: Iterable[ChatMessage]) -> str:
        """The messages, each rendered alone, then the next assistant turn's header."""
        templates = {
            "system": self.system,
            "user": self.user,
            "tool": self.tool,
            "assistant": self.assistant_message,
        }
        body = "".join(templates[m.role].replace("{content}", m.content) for m in messages)
        return body + self.assistant


class NotAppendOnly(ValueError):
    """The format and tokenizer would re-tokenize history differently between turns."""


PROBE: tuple[tuple[ChatMessage, ...], ...] = (
    (
        ChatMessage(role="system", content="You may call tools."),
        ChatMessage(role="user", content="What is 12*7 + 3?"),
    ),
    (ChatMessage(role="tool", content="result: 87", name="calculator", tool_call_id="call_1"),),
    (ChatMessage(role="user", content="And then?\n"),),
)
"""A conversation of an opening and two replies, used by ``check_append_only``."""
PROBE_TURNS = ('<tool_call>{"name": "calculator"}</tool_call>', "The answer is 87.")


def check_append_only(chat: ChatFormat, encode: Encode) -> None:
    """Raise ``NotAppendOnly`` unless encoding the probe conversation piece by piece (opening,
    sampled turn, reply, ...) gives exactly the tokens of encoding it whole, with every
    message's content still in it."""
    pieces = [chat.render(PROBE[0])]
    for turn, reply in zip(PROBE_TURNS, PROBE[1:], strict=True):
        pieces += [turn, chat.render(reply)]
    whole = encode("".join(pieces))
    split = [tok for piece in pieces for tok in encode(piece)]
    if whole != split:
        at = next(i for i, (a, b) in enumerate(zip(whole, split, strict=False)) if a != b)
        raise NotAppendOnly(
            f"chat format is not append-only with this tokenizer: encoding the conversation "
            f"whole and turn by turn differ at token {at} (a separator merges across turns)"
        )
    for message in (m for part in PROBE for m in part):
        if message.content.strip() and message.content.strip() not in "".join(pieces):
            raise NotAppendOnly(f"chat format drops the content of a {message.role} message")
