"""``TorchEngine``: the built-in paged-KV engine, a ``step()`` loop you can read top to bottom.

``step()`` = schedule (continuous batching, chunked prefill, preemption) -> one forward over
the paged KV tensor -> sample -> finish. Export/import move a running request between engines
of the same version with exactly its KV blocks, so the target continues with no prefill.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch

from dora.engines.base import EngineError, PartialOutput, TurnEnd, VersionMismatch
from dora.engines.rate import TokenRate
from dora.engines.torch.block_manager import BlockManager
from dora.engines.torch.config import EngineConfig
from dora.engines.torch.model_runner import ModelRunner, ScheduledSeq
from dora.engines.torch.sampler import sample
from dora.engines.torch.scheduler import Scheduler
from dora.engines.torch.sequence import SeqStatus, Sequence
from dora.engines.torch.stopping import finish_reason, turn_ended
from dora.events import EngineStatus, RolloutRequest, RunningRequest, Timings, Trajectory
from dora.models import (
    CharTokenizer,
    CheckpointError,
    LlamaModel,
    build_model,
    load_pretrained,
    load_state_dict_into,
    load_tokenizer,
    read_state_dict,
    resolve_dtype,
)

log = structlog.get_logger(__name__)


@dataclass
class EngineCounters:
    """Work done so far; tests use them to prove an import did no prefill."""

    prefill_tokens: int = 0  # tokens computed as prefill (prompt, resume, re-prefill)
    decode_tokens: int = 0  # tokens computed as decode (the last sampled token)
    reprefilled_tokens: int = 0  # of the prefill tokens, those computed before (honest count)
    # context tokens (prompt, or a preempted request's context) whose KV came from the prefix
    # cache at admission instead of being computed
    cached_tokens: int = 0
    generated_tokens: int = 0  # tokens sampled
    preemptions: int = 0
    parked_evictions: int = 0
    steps: int = 0
    finished: int = 0
    exported: int = 0
    imported: int = 0


class TorchEngine:
    """A paged-KV engine for ``LlamaModel`` implementing ``dora.engines.base.Engine``."""

    def __init__(
        self,
        model: LlamaModel,
        tokenizer: CharTokenizer | None = None,
        config: EngineConfig | None = None,
        engine_id: str = "engine-0",
        version: int | None = 0,
    ) -> None:
        self.config = config or EngineConfig()
        self.engine_id = engine_id
        self.tokenizer = tokenizer
        device = torch.device(self.config.device)
        dtype = resolve_dtype(self.config.dtype) if self.config.dtype else model.dtype
        self.model = model.to(device=device, dtype=dtype).eval()
        mc = model.config
        self.max_model_len = min(
            self.config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings
        )
        self.eos_token_id = None if self.config.ignore_eos else mc.eos_token_id
        self.blocks = BlockManager(
            self.config.num_blocks, self.config.block_size, self.config.enable_prefix_caching
        )
        self.scheduler = Scheduler(self.config, self.blocks)
        self.runner = ModelRunner(
            self.model,
            self.config.num_blocks,
            self.config.block_size,
            device,
            dtype,
            self.config.decode_bucket_waste,
            self.config.paged_kernel,
            self.config.fast_forward,
            self.config.linear,
        )
        self.counters = EngineCounters()
        self._version = version
        self._seqs: dict[str, Sequence] = {}
        self._exported: dict[str, Sequence] = {}
        self._turn_ends: list[TurnEnd] = []
        self._rate = TokenRate()

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_preset(
        cls,
        preset: str = "tiny",
        seed: int = 0,
        config: EngineConfig | None = None,
        engine_id: str = "engine-0",
        version: int = 0,
        **overrides: Any,
    ) -> TorchEngine:
        """An engine over a randomly initialised preset model (tests, benchmarks)."""
        device = (config or EngineConfig()).device
        model, tok = build_model(preset, seed=seed, device=device, **overrides)
        return cls(model, tok, config, engine_id, version)

    @classmethod
    def from_pretrained(
        cls,
        directory: Path,
        config: EngineConfig | None = None,
        engine_id: str = "engine-0",
        version: int = 0,
    ) -> TorchEngine:
        """An engine over a HF checkpoint directory (tokenizer loaded when present)."""
        cfg = config or EngineConfig()
        model = load_pretrained(Path(directory), device=cfg.device, dtype=cfg.dtype)
        try:
            tok: CharTokenizer | None = load_tokenizer(Path(directory))
        except Exception:  # a checkpoint without tokenizer files is still usable
            tok = None
        return cls(model, tok, cfg, engine_id, version)

    # ------------------------------------------------------------------ identity

    @property
    def version(self) -> int | None:
        return self._version

    @property
    def model_fingerprint(self) -> str:
        """Architecture + dtype + weights version: what a KV snapshot must match."""
        raw = f"{self.model.config.fingerprint()}:{self.runner.dtype}:{self._version}"
        return hashlib.sha256(raw.encode()).hexdigest()[:16]

    # ------------------------------------------------------------------ requests

    def add_request(self, request: RolloutRequest) -> None:
        """Validate and queue a request; EngineError (naming the field) on bad input."""
        from dora.engines.torch.admission import build_sequence

        if self._version is None:
            raise EngineError(f"engine {self.engine_id} has no weights loaded")
        if request.version != self._version:
            raise VersionMismatch(
                f"request {request.request_id} is for version {request.version}, "
                f"engine {self.engine_id} serves version {self._version}"
            )
        if request.request_id in self._seqs:
            raise EngineError(f"request_id {request.request_id!r} is already in this engine")
        seq = build_sequence(self, request)
        self._seqs[seq.request_id] = seq
        self.scheduler.add(seq)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def num_requests(self) -> int:
        return len(self._seqs)

    def _get(self, request_id: str) -> Sequence:
        seq = self._seqs.get(request_id)
        if seq is None:
            raise EngineError(f"unknown request_id {request_id!r} in engine {self.engine_id}")
        return seq

    def _drop(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        self._exported.pop(seq.request_id, None)
        self.blocks.free_blocks(seq.block_table)
        seq.block_table = []
        seq.status = SeqStatus.FINISHED
        del self._seqs[seq.request_id]

    def abort(self, request_id: str) -> PartialOutput:
        seq = self._get(request_id)
        self._drop(seq)
        return PartialOutput(
            request=seq.request,
            token_ids=tuple(seq.completion),
            logprobs=tuple(seq.logprobs),
            engines=tuple(seq.engines),
        )

    def set_priority(self, request_id: str, priority: int) -> None:
        self._get(request_id).priority = priority

    # ------------------------------------------------------------------ weights

    def load_weights(self, version: int, weights: Mapping[str, Any] | Path) -> None:
        others = [s.request_id for s in self._seqs.values() if s.version != version]
        if others:
            raise VersionMismatch(
                f"engine {self.engine_id} holds {len(others)} request(s) of version "
                f"{self._version} (e.g. {others[0]}); cannot load version {version}"
            )
        try:
            state = read_state_dict(Path(weights)) if isinstance(weights, str | Path) else weights
            load_state_dict_into(self.model, state)
        except CheckpointError as exc:
            raise EngineError(f"cannot load weights of version {version}: {exc}") from exc
        if self.runner.fast is not None:
            self.runner.fast.sync(force=True)  # fused/packed weights follow the new ones
        self.blocks.reset_prefix_cache()
        self._version = version
        log.info("weights_loaded", engine=self.engine_id, version=version)

    # ------------------------------------------------------------------ the loop

    def step(self) -> list[Trajectory]:
        """Schedule, run one forward, sample, and return the trajectories that finished."""
        batch = self.scheduler.schedule()
        self.counters.preemptions = self.scheduler.preemptions
        self.counters.parked_evictions = self.scheduler.evictions
        self.counters.cached_tokens = self.scheduler.cached_tokens
        if not batch:
            return []
        t0 = time.time()
        logits, order = self.runner.run(batch)
        dt = time.time() - t0
        self.counters.steps += 1
        for s in batch:
            self._account(s, t0, dt)
        positions = [seq.num_completion for seq in order]
        tokens, logprobs = sample(logits, [seq.request.sampling for seq in order], positions)
        now = time.time()
        finished: list[Trajectory] = []
        for seq, tok, lp in zip(order, tokens, logprobs, strict=True):
            seq.token_ids.append(tok)
            seq.logprobs.append(lp)
            seq.token_versions.append(seq.version)
            if not seq.first_token_at:
                seq.first_token_at = now
            reason = finish_reason(seq, self.eos_token_id, self.max_model_len, self.tokenizer)
            if reason == "stop" and seq.request.sampling.park_on_stop:
                self._park(seq)  # the environment decides whether the episode ends
            elif reason is not None:
                finished.append(self._finish(seq, reason, now))
            elif turn_ended(seq, self.tokenizer):
                self._park(seq)
        self.counters.generated_tokens += len(order)
        self._rate.add(now, len(order))
        return finished

    # ------------------------------------------------------------------ multi-turn episodes

    def _park(self, seq: Sequence) -> None:
        """End of an assistant turn: keep the KV, stop scheduling, wait for ``append``."""
        self.scheduler.park(seq)
        turn = tuple(seq.completion[seq.turn_start :])
        text = self.tokenizer.decode(turn) if self.tokenizer is not None else ""
        self._turn_ends.append(TurnEnd(seq.request_id, turn, text))

    def take_turn_ends(self) -> list[TurnEnd]:
        """The requests parked since the last call (at most once each per turn)."""
        ends, self._turn_ends = self._turn_ends, []
        return ends

    def end_episode(self, request_id: str) -> Trajectory:
        """The environment ended the episode after this parked turn: its trajectory."""
        seq = self._get(request_id)
        if seq.status is not SeqStatus.PARKED:
            raise EngineError(f"request {request_id!r} is not parked at a turn boundary")
        return self._finish(seq, "stop", time.time())

    def append(self, request_id: str, token_ids: list[int], role: str = "tool") -> None:
        """Append the environment's reply to a parked request and go on decoding it: only the
        reply (and the turn's last sampled token) is prefilled; earlier turns keep their KV.
        The reply's tokens are masked out of the loss."""
        from dora.engines.admission import check_ids

        seq = self._get(request_id)
        if seq.status is not SeqStatus.PARKED:
            raise EngineError(f"request {request_id!r} is not parked at a turn boundary")
        check_ids("token_ids", token_ids, self.model.config.vocab_size)
        if len(seq.token_ids) + len(token_ids) >= self.max_model_len:
            raise EngineError(
                f"request {request_id!r}: the reply ({len(token_ids)} tokens) does not fit in "
                f"the context ({len(seq.token_ids)} of {self.max_model_len} used)"
            )
        start = seq.num_completion
        seq.token_ids.extend(token_ids)
        seq.logprobs.extend([0.0] * len(token_ids))
        seq.token_versions.extend([seq.version] * len(token_ids))
        seq.appended.append((start, seq.num_completion, role))
        seq.turn_start = seq.num_completion
        self.scheduler.unpark(seq)

    def _account(self, s: ScheduledSeq, t0: float, dt: float) -> None:
        seq, n = s.seq, s.num_tokens
        if not seq.started_at:
            seq.started_at = t0
        c = seq.num_computed
        if seq.is_decode:
            self.counters.decode_tokens += n
            seq.decode_s += dt
        else:
            self.counters.prefill_tokens += n
            seq.prefill_s += dt
            again = max(0, min(c + n, seq.recompute_hw) - c)
            seq.reprefilled += again
            self.counters.reprefilled_tokens += again
        seq.num_computed = c + n
        self.blocks.register_full_blocks(
            seq.block_table, seq.token_ids, seq.num_computed, seq.block_hashes
        )

    def _finish(self, seq: Sequence, reason: str, now: float) -> Trajectory:
        self._drop(seq)
        self.counters.finished += 1
        completion = tuple(seq.completion)
        text = self.tokenizer.decode(completion) if self.tokenizer is not None else ""
        req = seq.request
        return Trajectory(
            request=req,
            version=seq.version,
            prompt_token_ids=tuple(seq.token_ids[: seq.num_prompt]),
            completion_token_ids=completion,
            logprobs=tuple(float(x) for x in seq.logprobs),
            loss_mask=seq.loss_mask(),
            turns=seq.turns(),
            token_versions=tuple(seq.token_versions) if seq.track_versions else (),
            text=text,
            finish_reason=reason,  # type: ignore[arg-type]
            engines=tuple(seq.engines),
            migrations=tuple(seq.migrations),
            reprefilled_tokens=seq.reprefilled,
            timings=Timings(
                dispatched_at=req.dispatched_at,
                started_at=seq.started_at,
                first_token_at=seq.first_token_at,
                finished_at=now,
                queue_s=max(0.0, seq.started_at - seq.added_at),
                prefill_s=seq.prefill_s,
                decode_s=seq.decode_s,
            ),
        )

    # ------------------------------------------------------------------ migration

    def export_request(self, request_id: str) -> bytes:
        from dora.engines.torch.migration import export_sequence

        seq = self._get(request_id)
        if seq.status is SeqStatus.EXPORTED:
            raise EngineError(f"request {request_id} is already exported")
        data = export_sequence(self, seq)
        self.scheduler.remove(seq)
        seq.parked_before_export = seq.status is SeqStatus.PARKED
        seq.status = SeqStatus.EXPORTED
        self._exported[request_id] = seq
        self.counters.exported += 1
        return data

    def _get_exported(self, request_id: str) -> Sequence:
        seq = self._exported.get(request_id)
        if seq is None:
            raise EngineError(f"request {request_id!r} is not exported from {self.engine_id}")
        return seq

    def release_exported(self, request_id: str) -> None:
        self._drop(self._get_exported(request_id))

    def restore_exported(self, request_id: str) -> None:
        seq = self._exported.pop(request_id, None)
        if seq is None:
            raise EngineError(f"request {request_id!r} is not exported from {self.engine_id}")
        self._resume(seq, parked=seq.parked_before_export)

    def _resume(self, seq: Sequence, parked: bool) -> None:
        """Schedule a restored or imported sequence; one parked at a turn boundary stays
        parked (its environment's reply is what it waits for)."""
        if parked:
            self.scheduler.park(seq)
        elif seq.num_computed:
            self.scheduler.add_running(seq)
        else:
            self.scheduler.add(seq)

    def episode_state(self, request_id: str) -> tuple[RolloutRequest, bool, int]:
        """A multi-turn request as held here: its request, whether it is parked waiting for
        its environment, and how many environment replies it holds."""
        seq = self._get(request_id)
        return seq.request, seq.status is SeqStatus.PARKED, len(seq.appended)

    def import_request(self, snapshot: bytes) -> str:
        from dora.engines.torch.migration import import_sequence

        seq, parked = import_sequence(self, snapshot)
        self._seqs[seq.request_id] = seq
        self._resume(seq, parked)
        self.counters.imported += 1
        return seq.request_id

    # ------------------------------------------------------------------ status

    def tokens_per_s(self) -> float:
        """Sampled tokens per second over the last 10 s of steps."""
        return self._rate.per_s()

    def status(self) -> EngineStatus:
        held = list(self._seqs.values())
        return EngineStatus(
            engine_id=self.engine_id,
            version=self._version,
            state="serving" if self.has_work() else "idle",
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            parked=len(self.scheduler.parked),
            kv_blocks_used=self.blocks.num_used,
            kv_blocks_total=self.blocks.num_blocks,
            block_size=self.blocks.block_size,
            tokens_per_s=self.tokens_per_s(),
            max_running=self.config.max_num_seqs,
            requests=tuple(
                RunningRequest(
                    request_id=s.request_id,
                    version=s.version,
                    generated=s.num_completion,
                    max_tokens=max(0, s.request.sampling.max_tokens),
                    kv_blocks=len(s.block_table),
                    dispatched_at=s.request.dispatched_at,
                    parked=s.status is SeqStatus.PARKED,
                    preempted=s.status is SeqStatus.WAITING and s.recompute_hw > 0,
                )
                for s in held
            ),
        )
