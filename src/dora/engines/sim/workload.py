"""Workload models: how long prompts and responses are, drawn deterministically from seeds.

Reasoning RL has a long-tailed response length: most answers are a few thousand tokens, a few
run into the maximum. Samples of one prompt are correlated (a hard problem makes every sample
long), so a response's log-length is a per-prompt effect plus a per-sample effect:

    log L = log(median) + sigma_prompt * z_prompt + sigma_sample * z_sample,   clipped to max

``dapo-16k`` uses median 3,000 and total sigma 1.0 (mean ~4.5k after the clip, ~5% of samples
truncated at 16,384). Sources: DAPO (arXiv 2503.14476, Qwen2.5-32B on DAPO-Math-17K) trains
with a 16,384-token limit plus a 4,096-token overlong buffer and reports mean response length
rising to several thousand tokens; public RL notes model per-rollout lengths as log-normal
with a heavy tail (p99 ~10x the median). These are fits by eye, not a published table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RequestSpec:
    """What one sample will do: decode ``segments[i]`` tokens per turn; between turns a tool
    answers after ``tool_latency[i]`` seconds with ``tool_tokens[i]`` tokens to prefill."""

    prompt_len: int
    segments: tuple[int, ...]
    tool_tokens: tuple[int, ...] = ()
    tool_latency: tuple[float, ...] = ()

    @property
    def decode_tokens(self) -> int:
        return sum(self.segments)

    @property
    def total_tokens(self) -> int:
        """Completion tokens including tool outputs (what ends up in the trajectory)."""
        return sum(self.segments) + sum(self.tool_tokens)


@dataclass(frozen=True)
class Workload:
    """A long-tailed single- or multi-turn response length model."""

    name: str
    prompt_median: float = 160.0
    prompt_sigma: float = 0.35
    prompt_min: int = 40
    prompt_max: int = 600
    response_median: float = 3000.0
    sigma_prompt: float = 0.6
    sigma_sample: float = 0.8
    min_tokens: int = 16
    max_tokens: int = 16384
    turns_min: int = 1
    turns_max: int = 1
    tool_latency_median: float = 0.0
    tool_latency_sigma: float = 1.0
    tool_latency_max: float = 60.0
    tool_tokens_median: float = 0.0
    tool_tokens_max: int = 2000

    @property
    def sigma(self) -> float:
        return math.hypot(self.sigma_prompt, self.sigma_sample)

    @property
    def multi_turn(self) -> bool:
        return self.turns_max > 1

    def group(self, seed: int, group: int, size: int) -> list[RequestSpec]:
        """The ``size`` samples of prompt ``group``; a pure function of (seed, group, size)."""
        rng = np.random.default_rng((seed, group))
        prompt = int(
            np.clip(
                round(self.prompt_median * math.exp(self.prompt_sigma * rng.standard_normal())),
                self.prompt_min,
                self.prompt_max,
            )
        )
        z_prompt = rng.standard_normal()
        if not self.multi_turn:  # vectorized: the simulator draws millions of these
            logs = math.log(self.response_median) + self.sigma_prompt * z_prompt
            lengths = np.exp(logs + self.sigma_sample * rng.standard_normal(size))
            lengths = np.clip(np.rint(lengths), self.min_tokens, self.max_tokens).astype(int)
            return [RequestSpec(prompt, (int(n),)) for n in lengths]
        return [self._sample(rng, prompt, z_prompt) for _ in range(size)]

    def request(self, seed: int, prompt_key: int, sample_seed: int) -> RequestSpec:
        """One sample from its own seed (used by the timing engine per RolloutRequest)."""
        prng = np.random.default_rng((seed, prompt_key))
        prompt = int(
            np.clip(
                round(self.prompt_median * math.exp(self.prompt_sigma * prng.standard_normal())),
                self.prompt_min,
                self.prompt_max,
            )
        )
        z_prompt = prng.standard_normal()
        return self._sample(
            np.random.default_rng((seed, prompt_key, sample_seed)), prompt, z_prompt
        )

    def _length(self, rng: np.random.Generator, median: float, z_prompt: float) -> int:
        log_len = math.log(median) + self.sigma_prompt * z_prompt
        log_len += self.sigma_sample * rng.standard_normal()
        return int(min(max(round(math.exp(log_len)), self.min_tokens), self.max_tokens))

    def _sample(self, rng: np.random.Generator, prompt: int, z_prompt: float) -> RequestSpec:
        if not self.multi_turn:
            return RequestSpec(prompt, (self._length(rng, self.response_median, z_prompt),))
        turns = int(rng.integers(self.turns_min, self.turns_max + 1))
        segments: list[int] = []
        tools: list[int] = []
        latency: list[float] = []
        budget = self.max_tokens
        for turn in range(turns):
            seg = min(self._length(rng, self.response_median, z_prompt), budget)
            segments.append(max(seg, 1))
            budget -= seg
            if turn == turns - 1 or budget <= self.min_tokens:
                break
            tool = int(
                min(
                    self.tool_tokens_median * math.exp(rng.standard_normal() * 0.7),
                    self.tool_tokens_max,
                    budget,
                )
            )
            lat = float(
                min(
                    self.tool_latency_median
                    * math.exp(self.tool_latency_sigma * rng.standard_normal()),
                    self.tool_latency_max,
                )
            )
            tools.append(max(tool, 0))
            latency.append(lat)
            budget -= tool
            if budget <= self.min_tokens:
                break
        return RequestSpec(prompt, tuple(segments), tuple(tools), tuple(latency))


DAPO_16K = Workload(name="dapo-16k")
"""DAPO-Math-like: prompts ~160 tokens (40-600), responses log-normal, median 3k, cap 16,384."""

DAPO_32K = Workload(name="dapo-32k", response_median=3500.0, max_tokens=32768)
"""Same shape with a 32K cap (longer-thinking models): the tail that 16K truncates remains."""

AGENTIC = Workload(
    name="agentic",
    prompt_median=900.0,
    prompt_sigma=0.3,
    prompt_min=300,
    prompt_max=3000,
    response_median=350.0,
    sigma_prompt=0.5,
    sigma_sample=0.7,
    max_tokens=32768,
    turns_min=2,
    turns_max=10,
    tool_latency_median=1.5,
    tool_latency_sigma=1.0,
    tool_tokens_median=250.0,
)
"""Agentic multi-turn (Tau2-bench-like): 2-10 turns of ~350 model tokens, a tool call of
~1.5 s median (log-normal, capped 60 s) returning ~250 tokens between turns."""

WORKLOADS: dict[str, Workload] = {w.name: w for w in (DAPO_16K, DAPO_32K, AGENTIC)}


def workload_preset(name: str) -> Workload:
    """A workload preset by name; the error lists the known ones."""
    try:
        return WORKLOADS[name]
    except KeyError:
        raise ValueError(f"workload: unknown preset {name!r}; known: {sorted(WORKLOADS)}") from None
