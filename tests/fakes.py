"""A deterministic, dependency-free Engine double for testing the stages around engines.

Token t of a request is ``(seed + t) % 97``; one token per request per ``step()``. Snapshots
are JSON, so export/import/restore/release semantics can be tested without torch.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dora.engines.base import (
    CapacityError,
    EngineError,
    PartialOutput,
    SnapshotError,
    VersionMismatch,
)
from dora.events import (
    EngineStatus,
    Migration,
    Prompt,
    RolloutRequest,
    RunningRequest,
    SamplingParams,
    Trajectory,
)


@dataclass
class _Seq:
    request: RolloutRequest
    tokens: list[int] = field(default_factory=list)
    engines: list[str] = field(default_factory=list)
    migrations: list[Migration] = field(default_factory=list)
    priority: int = 0


class FakeEngine:
    """Implements ``dora.engines.base.Engine`` with arithmetic instead of a model."""

    def __init__(self, engine_id: str, capacity: int = 64, tokens_per_step: int = 1) -> None:
        self.engine_id = engine_id
        self.capacity = capacity
        self.tokens_per_step = tokens_per_step
        self._version: int | None = None
        self.running: dict[str, _Seq] = {}
        self.exported: dict[str, _Seq] = {}
        self.prefill_tokens = 0
        self.loads: list[int] = []
        self.freeze_at: int | None = None
        """While set, requests stop generating at this many tokens (to catch them mid-way)."""

    @property
    def version(self) -> int | None:
        return self._version

    def add_request(self, request: RolloutRequest) -> None:
        if request.sampling.max_tokens <= 0:
            raise EngineError(f"max_tokens must be > 0, got {request.sampling.max_tokens}")
        if request.version != self._version:
            raise VersionMismatch(f"request v{request.version} on engine v{self._version}")
        if len(self.running) >= self.capacity:
            raise CapacityError("full")
        seq = _Seq(request, engines=[self.engine_id], priority=request.priority)
        if request.resume is not None:
            seq.tokens = list(request.resume.token_ids)
        self.prefill_tokens += len(request.prompt_token_ids) + len(seq.tokens)
        self.running[request.request_id] = seq

    def step(self) -> list[Trajectory]:
        done: list[Trajectory] = []
        for rid, seq in list(self.running.items()):
            for _ in range(self.tokens_per_step):
                if not self._can_progress(seq):
                    break
                if len(seq.tokens) < seq.request.sampling.max_tokens:
                    seq.tokens.append((seq.request.sampling.seed + len(seq.tokens)) % 97)
            if len(seq.tokens) >= seq.request.sampling.max_tokens:
                del self.running[rid]
                done.append(self._trajectory(seq))
        return done

    def _trajectory(self, seq: _Seq) -> Trajectory:
        resume = seq.request.resume
        n = len(seq.tokens)
        versions: tuple[int, ...] = ()
        if resume is not None:
            versions = (*resume.token_versions, *[self._version or 0] * (n - len(resume.token_ids)))
        return Trajectory(
            request=seq.request,
            version=seq.request.version,
            prompt_token_ids=seq.request.prompt_token_ids,
            completion_token_ids=tuple(seq.tokens),
            logprobs=tuple(-1.0 for _ in seq.tokens),
            loss_mask=tuple(1 for _ in seq.tokens),
            token_versions=versions,
            finish_reason="length",
            engines=tuple(seq.engines),
            migrations=tuple(seq.migrations),
            reprefilled_tokens=len(resume.token_ids) if resume else 0,
        )

    def _can_progress(self, seq: _Seq) -> bool:
        return self.freeze_at is None or len(seq.tokens) < self.freeze_at

    def has_work(self) -> bool:
        return any(self._can_progress(s) for s in self.running.values())

    def num_requests(self) -> int:
        return len(self.running) + len(self.exported)

    def abort(self, request_id: str) -> PartialOutput:
        seq = self.running.pop(request_id)
        return PartialOutput(
            seq.request,
            tuple(seq.tokens),
            tuple(-1.0 for _ in seq.tokens),
            tuple(seq.engines),
        )

    def set_priority(self, request_id: str, priority: int) -> None:
        self.running[request_id].priority = priority

    def load_weights(self, version: int, weights: Mapping[str, Any] | Path) -> None:
        if any(s.request.version != version for s in self.running.values()):
            raise VersionMismatch("holding requests of another version")
        self._version = version
        self.loads.append(version)

    def export_request(self, request_id: str) -> bytes:
        seq = self.running.pop(request_id)
        self.exported[request_id] = seq
        return json.dumps(
            {
                "request": seq.request.model_dump_json(),
                "tokens": seq.tokens,
                "engines": seq.engines,
                "migrations": [m.model_dump_json() for m in seq.migrations],
                "version": seq.request.version,
            }
        ).encode()

    def release_exported(self, request_id: str) -> None:
        del self.exported[request_id]

    def restore_exported(self, request_id: str) -> None:
        self.running[request_id] = self.exported.pop(request_id)

    def import_request(self, snapshot: bytes) -> str:
        try:
            data = json.loads(snapshot)
            request = RolloutRequest.model_validate_json(data["request"])
        except (ValueError, KeyError) as exc:
            raise SnapshotError(f"corrupt snapshot: {exc}") from exc
        if data["version"] != self._version:
            raise VersionMismatch(f"snapshot v{data['version']} on engine v{self._version}")
        seq = _Seq(request, tokens=list(data["tokens"]), engines=[*data["engines"], self.engine_id])
        seq.migrations = [Migration.model_validate_json(m) for m in data["migrations"]]
        seq.migrations.append(
            Migration(
                source=data["engines"][-1],
                target=self.engine_id,
                at_token=len(seq.tokens),
                kv_bytes=len(snapshot),
                seconds=0.0,
            )
        )
        self.running[request.request_id] = seq
        return request.request_id

    def status(self) -> EngineStatus:
        return EngineStatus(
            engine_id=self.engine_id,
            version=self._version,
            state="serving" if self._version is not None else "idle",
            running=len(self.running),
            kv_blocks_used=len(self.running),
            kv_blocks_total=self.capacity,
            requests=tuple(
                RunningRequest(
                    request_id=rid,
                    version=s.request.version,
                    generated=len(s.tokens),
                    max_tokens=s.request.sampling.max_tokens,
                    kv_blocks=1,
                    dispatched_at=s.request.dispatched_at,
                )
                for rid, s in self.running.items()
            ),
            created_at=time.time(),
        )


def fake_request(i: int, version: int = 0, max_tokens: int = 12) -> RolloutRequest:
    """Request ``r<i>`` of a one-sample group; FakeEngine's tokens are ``(i + t) % 97``."""
    prompt = Prompt(prompt_id=f"p{i}", text="1+1=", answer="2")
    return RolloutRequest(
        event_id=f"req-{i}",
        request_id=f"r{i}",
        prompt=prompt,
        prompt_token_ids=(5, 6, 7),
        group_id=f"g{i}",
        group_index=0,
        sampling=SamplingParams(seed=i, max_tokens=max_tokens),
        version=version,
    )
