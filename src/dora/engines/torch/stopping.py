"""When a sequence is finished: stop tokens, stop strings, max tokens, context length."""

from __future__ import annotations

from dora.engines.torch.sequence import Sequence
from dora.models import CharTokenizer


def finish_reason(
    seq: Sequence,
    eos_token_id: int | None,
    max_model_len: int,
    tokenizer: CharTokenizer | None,
) -> str | None:
    """``"stop"``, ``"length"`` or None (keep going), checked after each new token.

    A stop token or stop string stays in the completion (the learner trains on what was
    sampled); ``max_tokens`` bounds the whole completion, resumed tokens included.
    """
    sp = seq.request.sampling
    last = seq.token_ids[-1]
    if (eos_token_id is not None and last == eos_token_id) or last in sp.stop_token_ids:
        return "stop"
    if sp.stop_strings and tokenizer is not None:
        longest = max(len(s) for s in sp.stop_strings)
        tail = tokenizer.decode(seq.completion[-(longest + 8) :])
        if any(s in tail for s in sp.stop_strings):
            return "stop"
    if seq.num_completion >= sp.max_tokens or len(seq.token_ids) >= max_model_len:
        return "length"
    return None


def turn_ended(seq: Sequence, tokenizer: CharTokenizer | None) -> bool:
    """The current assistant turn's text now contains one of ``turn_stop_strings``."""
    stops = seq.request.sampling.turn_stop_strings
    if not stops or tokenizer is None:
        return False
    longest = max(len(s) for s in stops)
    start = max(seq.turn_start, seq.num_completion - longest - 8)
    tail = tokenizer.decode(seq.completion[start:])
    return any(s in tail for s in stops)
