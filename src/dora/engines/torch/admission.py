"""Validation of an incoming request and construction of its ``Sequence``.

Every refusal is an ``EngineError`` naming the field, raised before the engine holds any
state for the request, so the engine keeps serving the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dora.engines.base import CapacityError, EngineError
from dora.engines.torch.sequence import Sequence
from dora.events import RolloutRequest

if TYPE_CHECKING:
    from dora.engines.torch.engine import TorchEngine


def check_ids(field: str, ids: tuple[int, ...] | list[int], vocab: int) -> None:
    for i, t in enumerate(ids):
        if not 0 <= t < vocab:
            raise EngineError(f"{field}[{i}] = {t} is not a token id of the model [0, {vocab})")


def prompt_ids(engine: TorchEngine, request: RolloutRequest) -> list[int]:
    """The request's prompt token ids (tokenizing ``prompt.text`` with BOS when not given)."""
    if request.prompt_token_ids:
        return list(request.prompt_token_ids)
    if engine.tokenizer is None:
        raise EngineError(
            f"request {request.request_id}: prompt_token_ids is empty and the engine has no "
            "tokenizer to encode prompt.text"
        )
    return engine.tokenizer.encode(request.prompt.text, add_bos=True)


def build_sequence(engine: TorchEngine, request: RolloutRequest) -> Sequence:
    """A validated sequence for ``request`` (resume state included)."""
    rid = request.request_id
    sp = request.sampling
    if sp.max_tokens <= 0:
        raise EngineError(f"request {rid}: sampling.max_tokens must be > 0, got {sp.max_tokens}")
    prompt = prompt_ids(engine, request)
    if not prompt:
        raise EngineError(f"request {rid}: the prompt is empty")
    vocab = engine.model.config.vocab_size
    check_ids("prompt_token_ids", prompt, vocab)
    check_ids("sampling.stop_token_ids", sp.stop_token_ids, vocab)
    resume = request.resume
    resumed: list[int] = list(resume.token_ids) if resume else []
    versions: list[int] = []
    if resume is not None:
        check_ids("resume.token_ids", resumed, vocab)
        if len(resume.logprobs) != len(resumed):
            raise EngineError(
                f"request {rid}: resume.logprobs has {len(resume.logprobs)} entries for "
                f"{len(resumed)} resume.token_ids"
            )
        if resume.token_versions and len(resume.token_versions) != len(resumed):
            raise EngineError(
                f"request {rid}: resume.token_versions has {len(resume.token_versions)} "
                f"entries for {len(resumed)} resume.token_ids"
            )
        versions = list(resume.token_versions) or [request.version] * len(resumed)
    context = len(prompt) + len(resumed)
    if context >= engine.max_model_len:
        raise EngineError(
            f"request {rid}: prompt ({len(prompt)} tokens) + resumed ({len(resumed)}) leaves no "
            f"room in the model's context of {engine.max_model_len} tokens"
        )
    if len(resumed) >= sp.max_tokens:
        raise EngineError(
            f"request {rid}: {len(resumed)} resumed tokens already reach "
            f"sampling.max_tokens={sp.max_tokens}"
        )
    longest = min(len(prompt) + sp.max_tokens, engine.max_model_len)
    need = engine.blocks.blocks_needed(longest)
    if need > engine.blocks.num_blocks:
        raise CapacityError(
            f"request {rid}: needs up to {need} KV blocks, the engine has "
            f"{engine.blocks.num_blocks} in all"
        )
    if not request.prompt_token_ids:
        request = request.model_copy(update={"prompt_token_ids": tuple(prompt)})
    engines = list(resume.engines) if resume else []
    if not engines or engines[-1] != engine.engine_id:
        engines.append(engine.engine_id)
    return Sequence(
        request=request,
        token_ids=prompt + resumed,
        num_prompt=len(prompt),
        version=request.version,
        priority=request.priority,
        logprobs=list(resume.logprobs) if resume else [],
        token_versions=versions,
        track_versions=bool(resumed),
        recompute_hw=context if resume is not None else 0,
        reprefilled=resume.reprefilled_tokens if resume else 0,
        engines=engines,
    )
