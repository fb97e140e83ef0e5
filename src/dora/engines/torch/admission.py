"""Admission to the built-in engine: the shared checks (``dora.engines.admission``), its KV
capacity, and the request's ``Sequence``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dora.engines.admission import admit
from dora.engines.base import CapacityError
from dora.engines.torch.sequence import Sequence
from dora.events import RolloutRequest

if TYPE_CHECKING:
    from dora.engines.torch.engine import TorchEngine


def build_sequence(engine: TorchEngine, request: RolloutRequest) -> Sequence:
    """A validated sequence for ``request`` (resume state included)."""
    a = admit(
        request,
        engine.tokenizer,
        engine.model.config.vocab_size,
        engine.max_model_len,
        engine.engine_id,
    )
    request, prompt, resumed = a.request, a.prompt, a.resumed
    longest = min(len(prompt) + request.sampling.max_tokens, engine.max_model_len)
    need = engine.blocks.blocks_needed(longest)
    if need > engine.blocks.num_blocks:
        raise CapacityError(
            f"request {request.request_id}: needs up to {need} KV blocks, the engine has "
            f"{engine.blocks.num_blocks} in all"
        )
    resume = request.resume
    return Sequence(
        request=request,
        token_ids=prompt + resumed,
        num_prompt=len(prompt),
        version=request.version,
        priority=request.priority,
        logprobs=a.resumed_logprobs,
        token_versions=a.versions,
        track_versions=bool(resumed),
        recompute_hw=a.context if resume is not None else 0,
        reprefilled=resume.reprefilled_tokens if resume else 0,
        engines=a.engines,
    )
