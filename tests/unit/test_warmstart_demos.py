"""Warm-start demonstrations: the shortcut mixture and the packed rows built from it."""

from __future__ import annotations

import torch

from dora.models.tokenizer import CharTokenizer
from dora.tasks import make_task
from dora.training.warmstart import WarmstartConfig, demonstration, packed_batches


def test_shortcut_fraction_gives_answer_only_demonstrations_in_that_share() -> None:
    task = make_task("arithmetic", seed=0, min_terms=3, max_terms=6)
    prompts = list(task.prompts("train", 2000))
    demos = [demonstration(task, p, 0.3, seed=0) for p in prompts]
    pairs = list(zip(demos, prompts, strict=True))
    short = [d for d in demos if "\n" not in d]
    assert all(d == f"answer: {p.answer}" for d, p in pairs if "\n" not in d)
    assert 0.26 < len(short) / len(demos) < 0.34
    full = [(d, p) for d, p in pairs if "\n" in d]
    assert all(d == task.solve(p) for d, p in full)
    # deterministic by seed and prompt; no shortcut at fraction 0
    assert demos == [demonstration(task, p, 0.3, seed=0) for p in prompts]
    assert all(demonstration(task, p, 0.0, seed=0) == task.solve(p) for p in prompts[:200])


def test_packed_rows_carry_loss_on_completions_only() -> None:
    task = make_task("arithmetic", seed=0, min_terms=3, max_terms=5)
    tok = CharTokenizer.build()
    ids, seg, mask, pos = next(
        packed_batches(task, tok, rows=2, row_tokens=128, shortcut_fraction=0.5)
    )
    assert ids.shape == seg.shape == mask.shape == (2, 128)
    for r in range(2):
        for s in seg[r].unique().tolist():
            where = (seg[r] == s).nonzero().flatten()
            text = tok.decode(ids[r, where].tolist())
            if "Q:" not in text:  # row padding: no loss
                assert not mask[r, where].any()
                continue
            completion = tok.decode(ids[r, where][mask[r, where]].tolist())
            assert text.endswith(completion) and "Q:" not in completion
            assert completion.split("\n")[-1].startswith("answer: ")
            assert pos[r, where].tolist() == list(range(len(where)))  # whole: from 0
    assert mask.dtype == torch.bool


def test_long_examples_become_windows_at_their_true_positions() -> None:
    """With ``long_examples="windows"`` a demonstration longer than a row keeps its prompt and
    a run of whole lines from anywhere in it, the end included, at the positions they have in
    the whole demonstration; the window's first line (its previous line missing) has no loss."""
    task = make_task(
        "tally",
        seed=0,
        given_first_line=True,
        counter_width=3,
        max_steps=2,
        long_every=1,
        long_min_steps=150,
        long_max_steps=160,
    )
    tok = CharTokenizer.build()
    batches = packed_batches(task, tok, rows=4, row_tokens=256, long_examples="windows")
    prompts = task.prompts("train", 4 * 12)
    seen_end = seen_middle = 0
    for _ in range(12):
        ids, seg, mask, pos = next(batches)
        for r in range(4):
            prompt = next(prompts)
            head = tok.encode(prompt.text, add_bos=True)
            full, start = head + tok.encode(task.solve(prompt), add_eos=True), len(head)
            real = seg[r] == 0  # one example a row: each is longer than a row
            row, at = ids[r][real].tolist(), pos[r][real].tolist()
            assert len(full) > 256 and start < len(row) <= 256
            assert row[:start] == full[:start] and at[:start] == list(range(start))
            assert [full[p] for p in at] == row  # every token is where the whole one has it
            assert at[start:] == list(range(at[start], at[start] + len(row) - start))
            assert full[at[start] - 1] == tok.encode("\n")[0] or at[start] == start
            lossy = mask[r][real].nonzero().flatten().tolist()
            first = tok.decode(row[start:]).index("\n") + 1 if at[start] > start else 0
            assert lossy == list(range(start + first, len(row)))
            seen_end += at[-1] == len(full) - 1
            seen_middle += at[start] > start and at[-1] < len(full) - 1
    assert seen_end >= 4 and seen_middle >= 4
    assert WarmstartConfig(long_examples="windows").key() != WarmstartConfig().key()
    assert WarmstartConfig(long_examples="cut").key() == WarmstartConfig().key()


def test_shortcut_fraction_enters_the_cache_key_only_when_set() -> None:

    base = WarmstartConfig(steps=10)
    assert WarmstartConfig(steps=10, shortcut_fraction=0.0).key() == base.key()
    assert WarmstartConfig(steps=10, shortcut_fraction=0.5).key() != base.key()


def test_guess_shortcuts_state_a_made_up_answer_of_the_possible_size() -> None:
    task = make_task("arithmetic", seed=0, min_terms=2, max_terms=6)
    prompts = list(task.prompts("train", 2000))
    demos = [demonstration(task, p, 0.5, seed=0, shortcut="guess") for p in prompts]
    guesses = [(d, p) for d, p in zip(demos, prompts, strict=True) if "\n" not in d]
    assert 0.45 < len(guesses) / len(demos) < 0.55
    values = [int(d.removeprefix("answer: ")) for d, _ in guesses]
    sizes = [int(p.metadata["num_terms"]) for _, p in guesses]
    assert all(n <= v <= 9 * n for v, n in zip(values, sizes, strict=True))
    # a guess, not the answer: right only by chance (about 1 in 8n possible totals)
    right = sum(str(v) == p.answer for v, (_, p) in zip(values, guesses, strict=True))
    assert right / len(guesses) < 0.15
    assert len(set(values)) > 20
    # the same draw decides shortcut or not as with answer shortcuts; full demos unchanged
    answers = [demonstration(task, p, 0.5, seed=0) for p in prompts]
    assert ["\n" in d for d in demos] == ["\n" in d for d in answers]
    assert all(d == task.solve(p) for d, p in zip(demos, prompts, strict=True) if "\n" in d)


def test_guess_line_without_a_task_guess_redraws_the_digits() -> None:
    import random

    from dora.training.warmstart import guess_line

    task = make_task("countdown", seed=0)
    prompt = next(task.prompts("train", 1))
    lines = {guess_line(task, prompt, "answer: 407", random.Random(i)) for i in range(50)}
    assert all(
        x.startswith("answer: ") and len(x) == len("answer: 407") and x[8] != "0" for x in lines
    )
    assert len(lines) > 40


def test_guess_shortcut_enters_the_cache_key_only_when_set() -> None:

    base = WarmstartConfig(steps=10, shortcut_fraction=0.5)
    assert WarmstartConfig(steps=10, shortcut_fraction=0.5, shortcut="answer").key() == base.key()
    assert WarmstartConfig(steps=10, shortcut_fraction=0.5, shortcut="guess").key() != base.key()


def test_shortcut_start_keeps_the_early_batches_free_of_shortcuts() -> None:
    task = make_task("arithmetic", seed=0, min_terms=2, max_terms=4)
    tok = CharTokenizer.build()
    batches = packed_batches(
        task, tok, rows=2, row_tokens=256, shortcut_fraction=0.9, shortcut="guess",
        shortcut_start=3,
    )  # fmt: skip

    def completions(ids: torch.Tensor, seg: torch.Tensor, mask: torch.Tensor) -> list[str]:
        out = []
        for r in range(ids.shape[0]):
            for s in seg[r].unique().tolist():
                where = (seg[r] == s).nonzero().flatten()
                if mask[r, where].any():
                    out.append(tok.decode(ids[r, where][mask[r, where]].tolist()))
        return out

    early = [c for _ in range(3) for c in completions(*next(batches)[:3])]
    late = [c for _ in range(3) for c in completions(*next(batches)[:3])]
    assert early
    assert all("=" in c for c in early)  # every early demonstration works the problem out
    bare = [c for c in late if "=" not in c]
    assert len(bare) > len(late) // 2
    assert all(c.startswith("answer: ") for c in bare)


def test_curriculum_draws_the_first_batches_from_the_easy_task() -> None:
    hard = make_task("arithmetic", seed=0, min_terms=12, max_terms=14)
    easy = make_task("arithmetic", seed=0, min_terms=2, max_terms=3)
    tok = CharTokenizer.build()
    batches = packed_batches(hard, tok, rows=1, row_tokens=512, easy=(easy, 2))

    def lines(ids: torch.Tensor, mask: torch.Tensor) -> list[int]:
        """Scratchpad lines per demonstration (one line per addition, then the answer)."""
        text = tok.decode(ids[0][mask[0]].tolist())
        return [d.count("=") for d in text.split("answer:")[:-1]]

    first = [n for _ in range(2) for n in lines(*next(batches)[::2])]
    later = [n for _ in range(2) for n in lines(*next(batches)[::2])]
    assert first and all(n <= 2 for n in first)
    # the example that did not fit the last easy batch opens the next one; then only hard ones
    assert later[0] <= 2 and len(later) > 1 and all(n >= 11 for n in later[1:])
    assert WarmstartConfig(easy_task_config={"max_terms": 3}, easy_steps=2).key() != (
        WarmstartConfig().key()
    )


async def test_tool_demonstrations_are_what_a_live_episode_holds() -> None:
    """A tool demonstration is the calculator call (parsed and run as the environment would),
    the reply exactly as the generator appends it, then the answer: the same tokens."""
    from dora.envs import make_environment
    from dora.envs.base import AssistantTurn
    from dora.envs.chat import ChatFormat
    from dora.rewards import make_verifier

    task = make_task("arithmetic", seed=0, min_terms=2, max_terms=8)
    tok, chat = CharTokenizer.build(), ChatFormat(user="{content}")
    prompts = list(task.prompts("train", 400))
    demos = [demonstration(task, p, 0.0, seed=0, tool_fraction=0.2) for p in prompts]
    tools = [(d, p) for d, p in zip(demos, prompts, strict=True) if d.startswith("<tool_call>")]
    assert 0.15 < len(tools) / len(demos) < 0.25
    verifier = make_verifier("exact_match")
    for demo, prompt in tools[:20]:
        env = make_environment("calculator", list_tools=False)
        opening = await env.reset(prompt, seed=0)
        assert chat.render(opening) == prompt.text  # the prompt the warm start trained on
        call, rest = demo.split("</tool_call>", 1)
        result = await env.step(AssistantTurn(call + "</tool_call>"))
        reply = chat.render(result.messages)
        assert rest.startswith(reply)  # the reply, token for token
        assert tok.encode(demo) == tok.encode(call + "</tool_call>") + tok.encode(rest)
        final = await env.step(AssistantTurn(rest[len(reply) :]))
        assert final.done and final.reward == 1.0
        assert verifier.verify(demo, prompt).correct


def test_tool_replies_in_demonstrations_carry_no_loss() -> None:
    task = make_task("arithmetic", seed=0, min_terms=2, max_terms=4)
    tok = CharTokenizer.build()
    ids, _seg, mask, _pos = next(
        packed_batches(task, tok, rows=2, row_tokens=256, tool_fraction=1.0)
    )
    text = tok.decode([int(i) for i in ids[0][mask[0]]])
    assert "<tool_call>" in text and "answer:" in text
    assert "<tool>" not in text and "</tool>" not in text  # the environment's, not the model's
    start, end = tok.encode("<tool>")[0], tok.encode("</tool>")[0]
    row, m = ids[0].tolist(), mask[0].tolist()
    for i, t in enumerate(row):
        if t == start:
            j = row.index(end, i)
            assert not any(m[i : j + 2]) and m[j + 2]  # reply and its newline; the answer is
