"""The environment side of episodes (``EnvironmentHost``) and the append-only chat format."""

from __future__ import annotations

import asyncio

import pytest

from dora.envs import AssistantTurn, ChatMessage, StepResult
from dora.envs.chat import ChatFormat, NotAppendOnly, check_append_only
from dora.envs.host import EnvironmentHost
from dora.events import EnvStep, Prompt
from dora.models import CharTokenizer


class Counter:
    """A stateful tool: every step increments a counter (a tool run twice would show)."""

    instances: list[Counter] = []

    def __init__(self) -> None:
        self.count = 0
        self.closed = False
        Counter.instances.append(self)

    async def reset(self, prompt: Prompt, seed: int) -> list[ChatMessage]:
        if prompt.text == "explode":
            raise RuntimeError("cannot start")
        return [ChatMessage(role="user", content=prompt.text)]

    async def step(self, turn: AssistantTurn) -> StepResult:
        if turn.text == "hang":
            await asyncio.sleep(60)
        self.count += 1
        done = turn.text == "bye"
        return StepResult(
            messages=[] if done else [ChatMessage(role="tool", content=str(self.count))],
            done=done,
            reward=1.0 if done else None,
        )

    async def close(self) -> None:
        self.closed = True


def step(turn: int, text: str = "", attempt: int = 0, prompt: str = "hi", **kw: object) -> EnvStep:
    return EnvStep(
        episode_id="ep/1",
        attempt=attempt,
        turn=turn,
        environment="counter",
        prompt=Prompt(prompt_id="p", text=prompt),
        version=0,
        text=text,
        **kw,  # type: ignore[arg-type]
    )


@pytest.fixture
def host() -> EnvironmentHost:
    Counter.instances = []
    return EnvironmentHost("env-0", "counter", Counter, step_timeout_s=0.5)


async def test_a_redelivered_step_gets_the_same_reply_and_runs_no_tool_twice(
    host: EnvironmentHost,
) -> None:
    opening = await host.handle(step(0))
    assert [m.content for m in opening.messages] == ["hi"] and opening.owner == "env-0"
    first = await host.handle(step(1, "call"))
    again = await host.handle(step(1, "call"))
    assert again == first and Counter.instances[0].count == 1 and host.stats.replayed == 1
    assert [m.content for m in first.messages] == ["1"]
    done = await host.handle(step(2, "bye"))
    assert done.done and done.reward == 1.0 and Counter.instances[0].closed
    assert await host.handle(step(2, "bye")) == done  # after the episode ended, too
    assert host.live == {}


async def test_an_episode_it_does_not_hold_is_lost_not_waited_for(host: EnvironmentHost) -> None:
    reply = await host.handle(step(3, "call"))
    assert reply.lost and "does not hold" in reply.error and not reply.done
    await host.handle(step(0))
    skipped = await host.handle(step(2, "call"))  # turn 1 never came: not this instance's turn
    assert skipped.lost
    stale = await host.handle(step(1, "call", attempt=1))  # a retry must reset first
    assert stale.lost


async def test_failures_end_the_episode_with_the_reason(host: EnvironmentHost) -> None:
    bad = await host.handle(step(0, prompt="explode"))
    assert bad.done and "cannot start" in bad.error and host.live == {}
    await host.handle(step(0, attempt=1))
    hung = await host.handle(step(1, "hang", attempt=1))
    assert hung.done and "took longer" in hung.error and Counter.instances[-1].closed
    other = await host.handle(step(0, attempt=2).model_copy(update={"environment": "retail"}))
    assert other.done and "serves 'counter'" in other.error


async def test_a_truncated_turn_ends_the_episode(host: EnvironmentHost) -> None:
    await host.handle(step(0))
    reply = await host.handle(step(1, '<tool_call>{"name": "calc', truncated=True))
    assert reply.done and reply.messages == () and host.live == {}


async def test_idle_episodes_are_reaped(host: EnvironmentHost) -> None:
    await host.handle(step(0))
    assert await host.reap() == 0
    host.episode_timeout_s = 0.0
    assert await host.reap() == 1 and Counter.instances[0].closed and host.live == {}


def test_the_default_chat_format_is_append_only_with_the_char_tokenizer() -> None:
    tok = CharTokenizer.build()
    check_append_only(ChatFormat(), tok.encode)
    with pytest.raises(NotAppendOnly, match="drops the content"):
        check_append_only(ChatFormat(tool="<tool>result</tool>\n"), tok.encode)


def merging(text: str) -> list[int]:
    """A tokenizer that merges ">\n" into one token, as BPE merges pieces."""
    return [ord(c) for c in text.replace(">\n", "\x01")]


def test_a_format_whose_pieces_merge_across_turns_is_refused() -> None:
    check_append_only(ChatFormat(), merging)  # the default puts no ">" before a boundary
    # the turn ends "</tool_call>" and this reply starts with "\n": one token only when whole
    with pytest.raises(NotAppendOnly, match="differ at token"):
        check_append_only(ChatFormat(tool="\n<tool>{content}</tool>"), merging)


CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_a_chat_template_appends_its_difference_separators_included() -> None:
    from dora.envs.chat import TemplateFormat

    chat = TemplateFormat(template=CHATML, turn_end="<|im_end|>")
    check_append_only(chat, characters)
    opening = chat.opening([ChatMessage(role="user", content="2+2?")])
    assert opening == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    # the model sampled "...<|im_end|>": the newline the template writes after it comes with
    # the reply, not lost between the turns
    reply = chat.reply([ChatMessage(role="tool", content="4")])
    assert reply == "\n<|im_start|>tool\n4<|im_end|>\n<|im_start|>assistant\n"


def test_a_chat_template_that_rerenders_past_turns_is_refused() -> None:
    from dora.envs.chat import TemplateFormat

    lossy = CHATML.replace("message['content']", "message['content'] | replace('>{', '> {')")
    with pytest.raises(NotAppendOnly, match=r"differently|whole conversation"):
        check_append_only(TemplateFormat(template=lossy, turn_end="<|im_end|>"), characters)
    with pytest.raises(NotAppendOnly):  # the turn end is not what the template writes
        check_append_only(TemplateFormat(template=CHATML, turn_end="</s>"), characters)


def characters(text: str) -> list[int]:
    return [ord(c) for c in text]
