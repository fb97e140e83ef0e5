"""One GRPO optimisation step over a ``LlamaModel``: logprobs, loss, AdamW, clipping, LR.

The batch is split into micro-batches by a padded-token budget
(``max_tokens_per_microbatch``) and gradients accumulate across them; the loss denominator is
computed over the whole batch first, so accumulation gives exactly the full-batch gradient.
With one optimiser step per batch the proximal policy of decoupled PPO is the model itself
before the step, so its logprobs are the detached logprobs of the same forward pass.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import structlog
import torch
from torch import Tensor

from dora.events import Trajectory
from dora.learner.batching import Group
from dora.learner.grpo import GRPOConfig, all_equal, group_advantages, grpo_loss, loss_denominator
from dora.models import LlamaModel

log = structlog.get_logger(__name__)

Schedule = Literal["constant", "warmup", "cosine"]


@dataclass(frozen=True)
class OptimConfig:
    """AdamW, gradient clipping, LR schedule and micro-batching."""

    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    max_grad_norm: float = 1.0
    schedule: Schedule = "constant"
    warmup_steps: int = 0
    total_steps: int = 1000
    min_lr_ratio: float = 0.0
    max_tokens_per_microbatch: int = 8192
    use_sampling_temperature: bool = True
    """Score tokens at the temperature they were sampled with (as the behaviour logprobs)."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.schedule not in ("constant", "warmup", "cosine"):
            raise ValueError(f"unknown schedule {self.schedule!r}")
        if self.max_tokens_per_microbatch < 1:
            raise ValueError("max_tokens_per_microbatch must be >= 1")
        if self.warmup_steps < 0 or self.total_steps < 1:
            raise ValueError("warmup_steps must be >= 0 and total_steps >= 1")


def lr_factor(config: OptimConfig, step: int) -> float:
    """Multiplier of the base LR at optimiser step ``step`` (0-based)."""
    if config.schedule == "constant":
        return 1.0
    if config.warmup_steps and step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.schedule == "warmup":
        return 1.0
    span = max(config.total_steps - config.warmup_steps, 1)
    progress = min(max(step - config.warmup_steps, 0) / span, 1.0)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * cosine


@dataclass
class _Sample:
    tokens: list[int]
    prompt_len: int
    behaviour: list[float]
    mask: list[int]
    advantage: float
    temperature: float

    @property
    def length(self) -> int:
        return len(self.tokens) - 1


@dataclass
class _Accumulator:
    sums: dict[str, float] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)

    def add(self, metrics: dict[str, float], weight: float) -> None:
        for k, v in metrics.items():
            if k == "tokens":
                continue
            if k.startswith("loss/"):  # already a share of the batch loss: sum
                self.sums[k] = self.sums.get(k, 0.0) + v
                self.weights[k] = 1.0
            elif k == "is/max":
                self.sums[k] = max(self.sums.get(k, 0.0), v)
                self.weights[k] = 1.0
            else:
                self.sums[k] = self.sums.get(k, 0.0) + v * weight
                self.weights[k] = self.weights.get(k, 0.0) + weight

    def result(self) -> dict[str, float]:
        return {k: self.sums[k] / self.weights[k] for k in self.sums if self.weights[k] > 0}


def token_logprobs(
    model: LlamaModel, input_ids: Tensor, attention_mask: Tensor, temperature: Tensor
) -> tuple[Tensor, Tensor]:
    """Logprob of each next token ``[B, T-1]`` and the entropy of each prediction."""
    logits = model(input_ids, attention_mask=attention_mask)[:, :-1].float()
    logits = logits / temperature[:, None, None]
    targets = input_ids[:, 1:]
    logz = torch.logsumexp(logits, dim=-1)
    chosen = logits.gather(-1, targets[..., None]).squeeze(-1) - logz
    with torch.no_grad():
        probs = torch.softmax(logits, dim=-1)
        entropy = logz - (probs * logits).sum(-1)
    return chosen, entropy


class Trainer:
    """Holds the policy (and optional frozen reference), the optimiser and the schedule."""

    def __init__(
        self,
        model: LlamaModel,
        grpo: GRPOConfig | None = None,
        optim: OptimConfig | None = None,
        ref_model: LlamaModel | None = None,
    ) -> None:
        self.model = model
        self.grpo = grpo or GRPOConfig()
        self.optim_config = optim or OptimConfig()
        self.ref_model = ref_model
        if self.grpo.kl_coef > 0 and ref_model is None:
            raise ValueError("grpo.kl_coef > 0 needs a ref_model")
        cfg = self.optim_config
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=cfg.lr,
            betas=cfg.betas,
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(cfg, s)
        )
        pad = model.config.pad_token_id
        self.pad_id = int(pad) if pad is not None else 0

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    # ------------------------------------------------------------------ step

    def _samples(self, groups: Sequence[Group]) -> tuple[list[_Sample], dict[str, float]]:
        samples: list[_Sample] = []
        skipped = masked = errored = 0
        for g in groups:
            # A member whose episode failed (its environment died twice) has no reward to
            # compare: the group's baseline is taken over the others, it is not trained on.
            members = [s for s in g.samples if not s.trajectory.error]
            errored += len(g.samples) - len(members)
            if not members:
                skipped += 1
                continue
            rewards = torch.tensor([s.reward for s in members], dtype=torch.float32)
            if self.grpo.skip_all_equal and all_equal(rewards):
                skipped += 1
                continue
            adv = group_advantages(
                rewards, scale_by_std=self.grpo.scale_by_std, eps=self.grpo.adv_eps
            )
            for s, a in zip(members, adv.tolist(), strict=True):
                t = s.trajectory
                if not t.completion_token_ids:
                    continue
                temp = t.request.sampling.temperature
                use = self.optim_config.use_sampling_temperature and temp > 0
                cut = self.grpo.mask_truncated and t.finish_reason == "length"
                masked += cut
                samples.append(
                    _Sample(
                        tokens=list(t.prompt_token_ids) + list(t.completion_token_ids),
                        prompt_len=len(t.prompt_token_ids),
                        behaviour=list(t.logprobs),
                        mask=[0] * len(t.loss_mask) if cut else list(t.loss_mask),
                        advantage=a,
                        temperature=temp if use else 1.0,
                    )
                )
        return samples, {
            "groups/skipped_all_equal": float(skipped),
            "samples/masked_truncated": float(masked),
            "samples/errored": float(errored),
        }

    def _microbatches(self, samples: list[_Sample]) -> list[list[_Sample]]:
        """Length-sorted micro-batches whose padded size fits the token budget."""
        budget = self.optim_config.max_tokens_per_microbatch
        out: list[list[_Sample]] = []
        current: list[_Sample] = []
        for s in sorted(samples, key=lambda x: x.length):
            if current and (len(current) + 1) * s.length > budget:
                out.append(current)
                current = []
            current.append(s)
        if current:
            out.append(current)
        return out

    def _tensors(self, mb: list[_Sample]) -> dict[str, Tensor]:
        device = self.model.device
        width = max(s.length for s in mb) + 1
        n = len(mb)
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((n, width), dtype=torch.long)
        behaviour = torch.zeros((n, width - 1))
        mask = torch.zeros((n, width - 1))
        for i, s in enumerate(mb):
            ids[i, : len(s.tokens)] = torch.tensor(s.tokens)
            attn[i, : len(s.tokens)] = 1
            start = s.prompt_len - 1  # logits at position p predict token p + 1
            end = start + len(s.behaviour)
            behaviour[i, start:end] = torch.tensor(s.behaviour)
            mask[i, start:end] = torch.tensor(s.mask, dtype=torch.float32)
        return {
            "ids": ids.to(device),
            "attn": attn.to(device),
            "behaviour": behaviour.to(device),
            "mask": mask.to(device),
            "adv": torch.tensor([s.advantage for s in mb], device=device),
            "temp": torch.tensor([s.temperature for s in mb], device=device),
        }

    def step(self, groups: Sequence[Group], *, step: int = 0) -> dict[str, float]:
        """Train on ``groups`` (one optimiser step); returns the step's metrics."""
        t0 = time.perf_counter()
        self.model.train()
        samples, metrics = self._samples(groups)
        metrics.update(batch_metrics(groups, step))
        metrics["groups/trained"] = float(len(groups) - metrics["groups/skipped_all_equal"])
        acc = _Accumulator()
        self.optimizer.zero_grad(set_to_none=True)
        total_tokens = 0
        if samples:
            full_mask = _full_mask(samples)
            denom = loss_denominator(full_mask, self.grpo.aggregation, self.grpo.norm_length)
            for mb in self._microbatches(samples):
                t = self._tensors(mb)
                logp, entropy = token_logprobs(self.model, t["ids"], t["attn"], t["temp"])
                ref = None
                if self.ref_model is not None and self.grpo.kl_coef > 0:
                    with torch.no_grad():
                        ref, _ = token_logprobs(self.ref_model, t["ids"], t["attn"], t["temp"])
                loss, m = grpo_loss(
                    logp, t["behaviour"], t["adv"], t["mask"], self.grpo,
                    ref_logprobs=ref, denominator=denom,
                )  # fmt: skip
                loss.backward()
                ntok = float(t["mask"].sum())
                m["entropy/mean"] = float((entropy * t["mask"]).sum() / max(ntok, 1.0))
                acc.add(m, ntok)
                total_tokens += int(t["attn"].sum())
            grad_norm = torch.nn.utils.clip_grad_norm_(
                self.model.parameters(), self.optim_config.max_grad_norm
            )
            metrics["grad/norm"] = float(grad_norm)
            if math.isfinite(metrics["grad/norm"]):
                self.optimizer.step()
            else:
                log.error("non_finite_grad_norm_step_skipped", step=step)
                metrics["grad/skipped_nonfinite"] = 1.0
        else:
            metrics["grad/norm"] = 0.0
            # every group all right or all wrong: GRPO has no advantage to follow. Ordinary on a
            # hard task (counted in groups/skipped_all_equal), so the log file, not the console
            log.info("no_trainable_samples", step=step, groups=len(groups))
        metrics["lr"] = float(self.optimizer.param_groups[0]["lr"])
        with warnings.catch_warnings():  # the schedule follows learner steps, even skipped ones
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.model.eval()
        metrics.update(acc.result())
        elapsed = time.perf_counter() - t0
        metrics["tokens/processed"] = float(total_tokens)
        metrics["time/step_s"] = elapsed
        metrics["throughput/tokens_per_s"] = total_tokens / elapsed if elapsed > 0 else 0.0
        return metrics


def _full_mask(samples: list[_Sample]) -> Tensor:
    width = max(len(s.mask) for s in samples)
    mask = torch.zeros((len(samples), width))
    for i, s in enumerate(samples):
        mask[i, : len(s.mask)] = torch.tensor(s.mask, dtype=torch.float32)
    return mask


def batch_metrics(groups: Sequence[Group], step: int) -> dict[str, float]:
    """Reward, staleness, length and rollout statistics of a batch (no model needed)."""
    samples = [s for g in groups for s in g.samples]
    if not samples:
        return {}
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    lengths = torch.tensor([len(s.trajectory.completion_token_ids) for s in samples], dtype=float)
    stale = torch.tensor([step - g.version for g in groups], dtype=torch.float64)
    traj = [s.trajectory for s in samples]
    return {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()) if len(samples) > 1 else 0.0,
        "reward/correct_frac": sum(s.correct for s in samples) / len(samples),
        "staleness/mean": float(stale.mean()),
        "staleness/max": float(stale.max()),
        "lengths/mean": float(lengths.mean()),
        "lengths/max": float(lengths.max()),
        "lengths/prompt_mean": sum(len(t.prompt_token_ids) for t in traj) / len(traj),
        "lengths/truncated_frac": sum(t.finish_reason == "length" for t in traj) / len(traj),
        "rollout/migrations_mean": sum(len(t.migrations) for t in traj) / len(traj),
        "rollout/reprefilled_tokens": float(sum(t.reprefilled_tokens for t in traj)),
        "groups/batch": float(len(groups)),
        "samples/batch": float(len(samples)),
        **episode_metrics(traj),
    }


def episode_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Multi-turn episodes of a batch: how often the model called a tool, how many turns and
    tool seconds an episode took, and how many episodes failed (none when no episode)."""
    episodes = [t.episode for t in trajectories if t.episode is not None]
    if not episodes:
        return {}
    n = len(episodes)
    return {
        "episodes/tool_call_rate": sum(e.tool_calls > 0 for e in episodes) / n,
        "episodes/tool_calls_mean": sum(e.tool_calls for e in episodes) / n,
        "episodes/tool_call_errors_mean": sum(e.tool_call_errors for e in episodes) / n,
        "episodes/turns_mean": sum(e.turns for e in episodes) / n,
        "episodes/tool_seconds_mean": sum(e.tool_seconds for e in episodes) / n,
        "episodes/errored_frac": sum(bool(e.error) for e in episodes) / n,
    }
