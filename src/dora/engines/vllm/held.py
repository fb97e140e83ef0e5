"""``HeldRequest``: a request as ``VllmEngine``'s front end knows it (what vLLM does not keep:
the dora request, its version, the tokens and logprobs received, its engines and moves)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dora.events import Migration, RolloutRequest


@dataclass
class HeldRequest:
    """A request as this front end knows it."""

    request: RolloutRequest
    prompt: list[int]
    tokens: list[int]  # the whole completion so far (earlier engines' tokens included)
    logprobs: list[float]
    token_versions: list[int]
    track_versions: bool
    engines: list[str]
    migrations: list[Migration] = field(default_factory=list)
    reprefilled: int = 0
    # context tokens vLLM must hold KV for before decoding; what it computes below this
    # mark that an earlier engine had computed is re-prefill
    recompute_mark: int = 0
    started_at: float = 0.0
    first_token_at: float = 0.0
    added_at: float = 0.0
    external_id: str = ""
    vllm_id: str = ""
    import_file: Path | None = None
    snapshot: bytes | None = None  # set while exported and unconfirmed
    exact: bool = True
    seen: bool = False  # an output of it came (its context's KV is in place)

    @property
    def context(self) -> int:
        return len(self.prompt) + len(self.tokens)
