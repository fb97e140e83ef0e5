"""The checks every engine makes on an incoming request, before it holds any state for it.

Each refusal is an ``EngineError`` naming the field, so the engine keeps serving the others.
Engine-specific limits (the built-in engine's KV blocks) stay with the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from dora.engines.base import EngineError
from dora.events import RolloutRequest


class Encoder(Protocol):
    def encode(self, text: str, add_bos: bool = ...) -> list[int]: ...


def check_ids(field: str, ids: tuple[int, ...] | list[int], vocab: int) -> None:
    for i, t in enumerate(ids):
        if not 0 <= t < vocab:
            raise EngineError(f"{field}[{i}] = {t} is not a token id of the model [0, {vocab})")


def prompt_ids(request: RolloutRequest, tokenizer: Encoder | None) -> list[int]:
    """The request's prompt token ids (tokenizing ``prompt.text`` with BOS when not given)."""
    if request.prompt_token_ids:
        return list(request.prompt_token_ids)
    if tokenizer is None:
        raise EngineError(
            f"request {request.request_id}: prompt_token_ids is empty and the engine has no "
            "tokenizer to encode prompt.text"
        )
    return tokenizer.encode(request.prompt.text, add_bos=True)


@dataclass(frozen=True)
class Admitted:
    """A request that passed the checks: its prompt (filled in), and what it resumes with."""

    request: RolloutRequest
    prompt: list[int]
    resumed: list[int]
    resumed_logprobs: list[float]
    versions: list[int]  # the policy version of each resumed token
    engines: list[str]  # engines that decoded it so far, this one last

    @property
    def context(self) -> int:
        return len(self.prompt) + len(self.resumed)


def admit(
    request: RolloutRequest,
    tokenizer: Encoder | None,
    vocab: int,
    max_model_len: int,
    engine_id: str,
) -> Admitted:
    """Check a request (and a partial rollout's resume state) against the model."""
    rid = request.request_id
    sp = request.sampling
    if sp.max_tokens <= 0:
        raise EngineError(f"request {rid}: sampling.max_tokens must be > 0, got {sp.max_tokens}")
    prompt = prompt_ids(request, tokenizer)
    if not prompt:
        raise EngineError(f"request {rid}: the prompt is empty")
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
    if len(prompt) + len(resumed) >= max_model_len:
        raise EngineError(
            f"request {rid}: prompt ({len(prompt)} tokens) + resumed ({len(resumed)}) leaves no "
            f"room in the model's context of {max_model_len} tokens"
        )
    if len(resumed) >= sp.max_tokens:
        raise EngineError(
            f"request {rid}: {len(resumed)} resumed tokens already reach "
            f"sampling.max_tokens={sp.max_tokens}"
        )
    if not request.prompt_token_ids:
        request = request.model_copy(update={"prompt_token_ids": tuple(prompt)})
    engines = list(resume.engines) if resume else []
    if not engines or engines[-1] != engine_id:
        engines.append(engine_id)
    return Admitted(
        request=request,
        prompt=prompt,
        resumed=resumed,
        resumed_logprobs=list(resume.logprobs) if resume else [],
        versions=versions,
        engines=engines,
    )
