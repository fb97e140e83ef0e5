"""``DoraSampling``: dora's per-request deterministic sampling as a vLLM logits processor.

vLLM seeds a per-request random generator once, so a request re-added on another engine
would restart its random stream. dora's sampler draws token ``t`` of a request from a
uniform derived from ``(seed, t)`` only (``dora.engines.torch.sampler``), so a migrated
request continues with exactly the tokens it would have produced. This processor runs that
sampler on each dora row and leaves only the chosen token possible; vLLM's own (random)
sampling then has one choice.

A row is a dora row when its ``SamplingParams.extra_args`` has ``"dora"``: the request's
temperature, top-k, top-p, seed and ``offset`` (tokens generated before it was added here:
an imported request's draws continue at its position, not at 0). Greedy requests
(temperature 0) are left to vLLM's argmax.

Logprobs: vLLM reports them from the raw logits (``logprobs_mode="raw_logprobs"``), before
this processor. At temperature 1 without top-k/top-p that is exactly the distribution dora
samples from; at other settings the tokens are still dora's but the logprob is the raw one,
and the engine marks such trajectories (``Trajectory.logprobs_exact``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from dora.engines.torch.sampler import sample
from dora.events import SamplingParams

if TYPE_CHECKING:
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.config import VllmConfig

EXTRA_KEY = "dora"


def dora_args(params: SamplingParams, offset: int) -> dict[str, Any]:
    """What a dora row carries in ``extra_args`` (JSON-safe, crosses vLLM's process edge)."""
    return {
        "temperature": params.temperature,
        "top_k": params.top_k,
        "top_p": params.top_p,
        "seed": params.seed,
        "offset": offset,
    }


class DoraSampling(LogitsProcessor):
    """Pick each dora row's token with dora's sampler; mask every other token."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, tuple[SamplingParams, int, Sequence[int]]] = {}

    @staticmethod
    def _row(
        params: VllmSamplingParams, _prompt: list[int] | None, output: list[int]
    ) -> tuple[SamplingParams, int, Sequence[int]] | None:
        args = (params.extra_args or {}).get(EXTRA_KEY)
        if args is None:
            return None
        sp = SamplingParams(
            temperature=args["temperature"],
            top_k=args["top_k"],
            top_p=args["top_p"],
            seed=args["seed"],
        )
        return sp, int(args["offset"]), output

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.rows, batch_update, self._row)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        index = sorted(i for i in self.rows if i < logits.shape[0])
        params = [self.rows[i][0] for i in index]
        positions = [self.rows[i][1] + len(self.rows[i][2]) for i in index]
        tokens, _ = sample(logits[index], params, positions)
        rows = torch.tensor(index, device=logits.device)
        chosen = torch.tensor(tokens, device=logits.device)
        logits[rows] = float("-inf")
        logits[rows, chosen] = 0.0
        return logits
