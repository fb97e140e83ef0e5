"""Reference generator: the KV-cached batch equals greedy decoding by the dense forward."""

from __future__ import annotations

import torch

from dora.models import build_model
from dora.models.generate import generate


def _dense_greedy(model, prompt: list[int], steps: int) -> list[int]:  # type: ignore[no-untyped-def]
    seq, out = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            nxt = int(model(torch.tensor([seq]))[0, -1].argmax())
            out.append(nxt)
            seq.append(nxt)
    return out


def test_matches_dense_greedy_with_left_padding() -> None:
    model, tok = build_model("tiny", num_hidden_layers=2, seed=1)
    texts = ["Q: 1+2\nA:\n", "hi", "a much longer prompt, padded less"]
    prompts = [tok.encode(t, add_bos=True) for t in texts]
    batched = generate(model, tok, prompts, 8, eos_token_id=-1)
    for prompt, got in zip(prompts, batched, strict=True):
        assert got == _dense_greedy(model, prompt, 8)
    # a row's output does not depend on the rest of the batch
    assert generate(model, tok, prompts[1:2], 8, eos_token_id=-1)[0] == batched[1]


def test_stops_at_eos_and_sampling_is_seeded() -> None:
    model, tok = build_model("tiny", num_hidden_layers=1, seed=2)
    prompts = [tok.encode("x", add_bos=True), tok.encode("yz", add_bos=True)]
    first = generate(model, tok, prompts, 6, eos_token_id=-1)
    eos = first[0][2]
    stopped = generate(model, tok, prompts, 6, eos_token_id=eos)
    assert stopped[0] == first[0][: first[0].index(eos) + 1]
    a = generate(model, tok, prompts, 6, temperature=1.0, seed=5)
    assert a == generate(model, tok, prompts, 6, temperature=1.0, seed=5)
    assert generate(model, tok, [], 4) == []
