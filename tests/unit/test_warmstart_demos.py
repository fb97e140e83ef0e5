"""Warm-start demonstrations: the shortcut mixture and the packed rows built from it."""

from __future__ import annotations

import torch

from dora.models.tokenizer import CharTokenizer
from dora.models.warmstart import demonstration, packed_batches
from dora.tasks import make_task


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
    ids, seg, mask = next(packed_batches(task, tok, rows=2, row_tokens=128, shortcut_fraction=0.5))
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
    assert mask.dtype == torch.bool


def test_shortcut_fraction_enters_the_cache_key_only_when_set() -> None:
    from dora.models.warmstart import WarmstartConfig

    base = WarmstartConfig(steps=10)
    assert WarmstartConfig(steps=10, shortcut_fraction=0.0).key() == base.key()
    assert WarmstartConfig(steps=10, shortcut_fraction=0.5).key() != base.key()
