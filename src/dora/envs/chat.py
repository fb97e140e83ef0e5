"""How a conversation becomes tokens, append-only.

The trajectory of an episode is the rendered opening followed, turn by turn, by exactly the
sampled tokens and the rendered environment reply; nothing already in the context is ever
decoded and encoded again. That holds only if rendering the conversation so far and then the
reply gives the same tokens as rendering both at once (no separator dropped, no pieces merged
across the boundary): ``check_append_only`` proves it for the format and tokenizer at start-up,
and the generator refuses to start otherwise.

Two formats: ``ChatFormat``, a template per role, each message rendered on its own; and
``TemplateFormat``, a Hugging Face chat template (Jinja), whose reply text is the template's
difference: the whole conversation rendered with the reply, minus what the context already
holds (the opening and the sampled turns). A template that renders earlier turns differently
once later ones exist (one that drops past reasoning, say) is refused at start-up.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import cached_property
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from dora.events import ChatMessage

Encode = Callable[[str], list[int]]


class ChatFormat(BaseModel):
    """A template per role (``{content}`` is replaced) and the header that opens each
    assistant turn (where generation starts)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["roles"] = "roles"

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

    def opening(self, messages: Sequence[ChatMessage]) -> str:
        """The prompt: the environment's opening messages and the first turn's header."""
        return self.render(messages)

    def reply(self, messages: Sequence[ChatMessage]) -> str:
        """What is appended after a sampled turn: the reply and the next turn's header."""
        return self.render(messages)

    def whole(self, conversation: Sequence[ChatMessage]) -> str | None:
        """The conversation rendered at once (None: only piece by piece, as here)."""
        return None


class TemplateFormat(BaseModel):
    """A Hugging Face chat template (Jinja source, as in ``tokenizer_config.json``).

    ``turn_end`` is what the template writes after an assistant message's content and what
    the model samples to end its turn (e.g. ``<|im_end|>``): the context holds the sampled
    text, so the reply is the template's rendering of the conversation with the reply, minus
    the opening, every sampled turn and every earlier reply. Rendered in Jinja's sandbox.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["template"] = "template"
    template: str = Field(min_length=1, description="The chat template (Jinja).")
    turn_end: str = Field(default="", description="Sampled at the end of an assistant turn.")
    bos_token: str = ""
    eos_token: str = ""

    @cached_property
    def _compiled(self) -> Any:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.template)

    def _render(self, messages: Sequence[ChatMessage], generation: bool) -> str:
        return str(
            self._compiled.render(
                messages=[m.model_dump(exclude_none=True) for m in messages],
                add_generation_prompt=generation,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        )

    def opening(self, messages: Sequence[ChatMessage]) -> str:
        return self._render(messages, generation=True)

    def reply(self, messages: Sequence[ChatMessage]) -> str:
        """The template's difference after a probe context: templates render each message on
        its own once past the opening (checked by ``check_append_only`` for this one)."""
        context = [*PROBE[0], ChatMessage(role="assistant", content=PROBE_TURNS[0])]
        before = self._render(PROBE[0], generation=True) + PROBE_TURNS[0] + self.turn_end
        after = self._render([*context, *messages], generation=True)
        if not after.startswith(before):
            raise NotAppendOnly(
                "chat template renders an assistant turn differently from what was sampled "
                f"(expected the context to continue {before[-40:]!r})"
            )
        return after[len(before) :]

    def whole(self, conversation: Sequence[ChatMessage]) -> str | None:
        return self._render(conversation, generation=True)


def _chat_kind(value: Any) -> str:
    if isinstance(value, dict):
        return "template" if "template" in value else "roles"
    return str(getattr(value, "kind", "roles"))


Chat = Annotated[
    Annotated[ChatFormat, Tag("roles")] | Annotated[TemplateFormat, Tag("template")],
    Discriminator(_chat_kind),
]
"""Per-role templates, or (with a ``template`` key) a Hugging Face chat template."""


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


def check_append_only(chat: Chat, encode: Encode) -> None:
    """Raise ``NotAppendOnly`` unless encoding the probe conversation piece by piece (opening,
    sampled turn, reply, ...) gives exactly the tokens of encoding it whole, with every
    message's content still in it; for a chat template, also unless the pieces are exactly
    the template's rendering of the whole conversation (no earlier turn re-rendered)."""
    end = chat.turn_end if isinstance(chat, TemplateFormat) else ""
    pieces = [chat.opening(PROBE[0])]
    conversation = list(PROBE[0])
    for turn, reply in zip(PROBE_TURNS, PROBE[1:], strict=True):
        pieces += [turn + end, chat.reply(reply)]
        conversation += [ChatMessage(role="assistant", content=turn), *reply]
    rendered = chat.whole(conversation)
    if rendered is not None and rendered != "".join(pieces):
        at = next(
            (i for i, (a, b) in enumerate(zip(rendered, "".join(pieces), strict=False)) if a != b),
            min(len(rendered), len("".join(pieces))),
        )
        raise NotAppendOnly(
            "chat template is not append-only: rendering the whole conversation differs from "
            f"rendering it turn by turn at character {at} ({rendered[at : at + 30]!r})"
        )
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
