"""``SimEngine``: the Engine protocol on a timing model, for emulated fleets on a real bus.

It computes no tokens: response lengths come from the workload model (a pure function of the
request's group and sampling seed, so a request is as long wherever it runs), and time comes
from the cost model. ``time_scale=None`` runs in virtual time (each ``step()`` jumps to the
next event); ``time_scale=s`` paces virtual time at ``s`` x wall-clock, so dozens of engines
emulate an H200 fleet on two CPU cores. Migration snapshots carry tokens so far and the KV
*size* (counted, not materialized): zero re-prefill on import, as with real KV.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from dora.engines.base import CapacityError, EngineError, PartialOutput, VersionMismatch
from dora.engines.sim.core import SLOT_ADMIT_FRACTION, SimRequest, TimingCore
from dora.engines.sim.cost import CostModel, cost_preset
from dora.engines.sim.workload import RequestSpec, Workload, workload_preset
from dora.events import (
    EngineStatus,
    KVSnapshot,
    Migration,
    RolloutRequest,
    RunningRequest,
    Timings,
    Trajectory,
    Turn,
)

BLOCK = 16
VOCAB = 32000


def _key(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") >> 1


def _tokens(seed: int, start: int, count: int) -> tuple[int, ...]:
    """Deterministic fake token ids (position-dependent, like seeded sampling)."""
    m = VOCAB - 3
    steps = np.arange(start, start + count, dtype=np.int64) * 40503  # numpy: 4k-token
    return tuple(((seed * 2654435761 % m + steps) % m + 3).tolist())  # partials are hot


class SimEngine:
    """A replica that knows how long generation takes but generates placeholder tokens.

    ``cost`` / ``workload`` are presets or names (``dense-32b``, ``dapo-16k``...); ``seed`` is
    the workload seed; ``max_seqs`` caps running requests (None: the preset's vLLM default).
    """

    def __init__(
        self,
        engine_id: str,
        cost: CostModel | str = "dense-32b",
        workload: Workload | str = "dapo-16k",
        seed: int = 0,
        time_scale: float | None = None,
        max_seqs: int | None = None,
        max_sleep_s: float = 0.05,
        admit_fraction: float = SLOT_ADMIT_FRACTION,
    ) -> None:
        if time_scale is not None and time_scale <= 0:
            raise ValueError(f"time_scale must be > 0 or None, got {time_scale}")
        self.engine_id = engine_id
        self.cost = cost_preset(cost) if isinstance(cost, str) else cost
        self.workload = workload_preset(workload) if isinstance(workload, str) else workload
        self.seed = seed
        self.time_scale = time_scale
        self.max_sleep_s = max_sleep_s
        self.core = TimingCore(self.cost, max_seqs=max_seqs, admit_fraction=admit_fraction)
        self.fingerprint = f"sim:{self.cost.name}"
        self._t0 = time.monotonic()
        self._epoch = time.time()
        self._wake = threading.Event()
        self._next_rid = 0
        self._ids: dict[str, int] = {}
        self._meta: dict[int, tuple[RolloutRequest, list[Migration]]] = {}
        self._exported: dict[str, SimRequest] = {}
        self._names: dict[int, list[str]] = {}  # engines a migrated request ran on before

    # ------------------------------------------------------------------ clock
    @property
    def virtual_time(self) -> float:
        return self.core.clock

    def wake(self) -> None:
        """End the pacing sleep of a ``step()`` in progress now (thread-safe).

        A paced step sleeps up to ``max_sleep_s`` of wall time on the engine's thread, and
        every other engine call waits behind it; at 50x that is 1 emulated second, where a
        real engine takes new work at its next decode step (tens of ms). A caller that is
        about to hand the engine work (a request, a control command) wakes it first.
        """
        self._wake.set()

    def _wall(self, t: float) -> float:
        return self._epoch + t / (self.time_scale or 1.0)

    def _target(self) -> float:
        nxt = self.core.next_event_time()
        if self.time_scale is None:
            return nxt
        now = (time.monotonic() - self._t0) * self.time_scale
        if nxt > now:
            self._wake.wait(min((nxt - now) / self.time_scale, self.max_sleep_s))
            self._wake.clear()
            now = (time.monotonic() - self._t0) * self.time_scale
        return min(nxt, now)

    # ------------------------------------------------------------------ protocol
    @property
    def version(self) -> int | None:
        return self.core.version

    def add_request(self, request: RolloutRequest) -> None:
        if self.core.version is None or request.version != self.core.version:
            raise VersionMismatch(
                f"version: request {request.request_id} is v{request.version}, engine "
                f"{self.engine_id} serves v{self.core.version}"
            )
        if request.request_id in self._ids:
            raise EngineError(f"request_id: {request.request_id} is already on {self.engine_id}")
        req = self._build(request)
        if request.resume is not None and request.resume.token_ids:
            # partial rollout: a multi-turn request resumes at the start of its next turn
            # (the tool's remaining wait is not carried by a resume; see docs/performance.md)
            done = len(request.resume.token_ids)
            if not _seek(req, done):
                raise EngineError(f"resume: cannot resume {request.request_id} at token {done}")
            req.context = req.prefill = req.spec.prompt_len + done
            req.reprefilled = request.resume.reprefilled_tokens + req.context
        self.core.add(req)

    def _build(
        self, request: RolloutRequest, migrations: list[Migration] | None = None
    ) -> SimRequest:
        spec = self.workload.request(
            self.seed, _key(request.group_id), request.sampling.seed % (2**63)
        )
        if request.prompt_token_ids:
            spec = RequestSpec(
                len(request.prompt_token_ids), spec.segments, spec.tool_tokens, spec.tool_latency
            )
        spec = _clip(spec, request.sampling.max_tokens)
        rid = self._next_rid
        self._next_rid += 1
        self._ids[request.request_id] = rid
        self._meta[rid] = (request, migrations or [])
        return SimRequest(
            rid,
            request.version,
            0,
            request.group_index,
            spec,
            priority=request.priority,
            dispatched_at=request.dispatched_at,
        )

    def step(self) -> list[Trajectory]:
        t = self._target()
        if t == math.inf:
            return []
        return [self._trajectory(r) for r in self.core.advance_to(t)]

    def has_work(self) -> bool:
        return self.core.has_work()

    def num_requests(self) -> int:
        return self.core.num_requests() + len(self._exported)

    def _sim(self, request_id: str) -> SimRequest:
        rid = self._ids.get(request_id)
        if rid is None or request_id in self._exported:
            raise EngineError(f"request_id: {request_id!r} is not running on {self.engine_id}")
        return self.core.remove(rid, keep_kv=True)

    def abort(self, request_id: str) -> PartialOutput:
        self.core.advance_to(self.core.clock)
        req = self._sim(request_id)
        request, _ = self._meta.pop(req.rid)
        del self._ids[request_id]
        tokens = self._completion(req, request)
        return PartialOutput(request, tokens, (-1.0,) * len(tokens), tuple(self._engines(req)))

    def set_priority(self, request_id: str, priority: int) -> None:
        rid = self._ids.get(request_id)
        if rid is None:
            raise EngineError(f"request_id: {request_id!r} is not on {self.engine_id}")
        self.core.set_priority(rid, priority)

    def load_weights(self, version: int, weights: Mapping[str, Any] | Path | None = None) -> None:
        if version < 0:
            raise EngineError(f"version must be >= 0, got {version}")
        if any(r.version != version for r in self.core.requests()) or self._exported:
            raise VersionMismatch(f"version: {self.engine_id} holds requests of another version")
        self.core.load_weights(version, self.core.clock)

    # ------------------------------------------------------------------ migration
    def export_request(self, request_id: str) -> bytes:
        from dora.engines.snapshot import encode_snapshot

        req = self._sim(request_id)
        request, migrations = self._meta[req.rid]
        self._exported[request_id] = req
        parked = req.tool_ready_at >= 0  # waiting for its tool: it goes on waiting there
        lat = req.spec.tool_latency[req.seg - 1] if parked else 0.0
        header = KVSnapshot(
            request=request,
            version=req.version,
            model_fingerprint=self.fingerprint,
            dtype="bfloat16",
            block_size=BLOCK,
            num_layers=self.cost.num_layers,
            num_kv_heads=self.cost.num_kv_heads,
            head_dim=self.cost.head_dim,
            num_blocks=-(-(req.context - req.prefill) // BLOCK),
            num_cached_tokens=req.context - req.prefill,
            completion_token_ids=self._completion(req, request),
            logprobs=(-1.0,) * req.completion_tokens,
            engines=tuple(self._engines(req)),
            migrations=tuple(migrations),
            started_at=self._wall(req.started_at),
            first_token_at=self._wall(req.started_at),
            kv_bytes=0,
            reprefilled_tokens=req.reprefilled,
            parked=parked,
            parked_at=self._wall(req.tool_ready_at - lat) if parked else 0.0,
        )
        return encode_snapshot(header, b"")  # KV size is counted (kv_bytes()), not sent

    def release_exported(self, request_id: str) -> None:
        req = self._exported.pop(request_id, None)
        if req is None:
            raise EngineError(f"request_id: {request_id!r} is not exported from {self.engine_id}")
        self._meta.pop(req.rid, None)
        self._names.pop(req.rid, None)
        del self._ids[request_id]

    def restore_exported(self, request_id: str) -> None:
        req = self._exported.pop(request_id, None)
        if req is None:
            raise EngineError(f"request_id: {request_id!r} is not exported from {self.engine_id}")
        req.engines.pop()  # import_request appends this engine again
        self.core.import_request(req, self.core.clock)

    def import_request(self, snapshot: bytes) -> str:
        from dora.engines.snapshot import decode_snapshot

        header, _ = decode_snapshot(snapshot)
        if header.model_fingerprint != self.fingerprint:
            raise VersionMismatch(
                f"model_fingerprint: {header.model_fingerprint!r} is not {self.fingerprint!r}"
            )
        if header.version != self.core.version:
            raise VersionMismatch(
                f"version: snapshot v{header.version}, engine v{self.core.version}"
            )
        request = header.request
        if request.request_id in self._ids:
            raise EngineError(f"request_id: {request.request_id} is already on {self.engine_id}")
        tokens = header.num_cached_tokens
        if self.core.kv_used() + tokens > self.core.capacity:
            raise CapacityError(f"{self.engine_id}: no room for {tokens} KV tokens")
        src = header.engines[-1] if header.engines else "?"
        move = Migration(
            source=src,
            target=self.engine_id,
            at_token=len(header.completion_token_ids),
            kv_bytes=self.cost.kv_bytes(tokens),
            seconds=self.cost.migration_time(tokens),
            transport="sim",
        )
        req = self._build(request, [*header.migrations, move])
        done = len(header.completion_token_ids)
        if not _seek(req, done):
            raise EngineError(f"snapshot: {request.request_id} cannot be at token {done}")
        if header.parked:  # its tool answers when it would have on the source
            lat = req.spec.tool_latency[req.seg - 1]
            req.tool_ready_at = (header.parked_at - self._epoch) * (self.time_scale or 1.0) + lat
            req.context, req.prefill = tokens, 0
        else:  # the part of its context with no KV (a tool reply) is prefilled here
            req.context = req.spec.prompt_len + done
            req.prefill = req.context - tokens
        req.reprefilled = header.reprefilled_tokens
        req.migrations = len(header.migrations) + 1
        self.core.import_request(req, self.core.clock)
        self._names[req.rid] = list(header.engines)
        return request.request_id

    # ------------------------------------------------------------------ status
    def status(self) -> EngineStatus:
        core = self.core
        reqs = core.requests()
        preempted = core.preempted_ids() if core.num_waiting else set()
        n = core.num_running
        return EngineStatus(
            engine_id=self.engine_id,
            version=core.version,
            assigned_version=core.version,
            state="serving" if core.has_work() else "idle",
            running=n,
            waiting=core.num_waiting,
            parked=core.num_tool_waiting,
            kv_blocks_used=-(-core.kv_used() // BLOCK),
            kv_blocks_total=core.capacity // BLOCK,
            block_size=BLOCK,
            tokens_per_s=n / core.cost.step_time(n, core.context) if n else 0.0,
            max_running=core.max_seqs,
            requests=tuple(
                RunningRequest(
                    request_id=self._meta[r.rid][0].request_id,
                    version=r.version,
                    generated=r.generated,
                    max_tokens=self._meta[r.rid][0].sampling.max_tokens,
                    kv_blocks=-(-(r.context - r.prefill) // BLOCK),
                    dispatched_at=r.dispatched_at,
                    parked=r.tool_ready_at >= 0,
                    preempted=r.rid in preempted,
                )
                for r in reqs
            ),
        )

    # ------------------------------------------------------------------ helpers
    def _engines(self, req: SimRequest) -> list[str]:
        before = self._names.get(req.rid, [])
        return before if before and before[-1] == self.engine_id else [*before, self.engine_id]

    def _completion(self, req: SimRequest, request: RolloutRequest) -> tuple[int, ...]:
        return _tokens(request.sampling.seed, 0, req.completion_tokens)

    def _trajectory(self, req: SimRequest) -> Trajectory:
        request, migrations = self._meta.pop(req.rid)
        del self._ids[request.request_id]
        engines = tuple(self._engines(req))
        self._names.pop(req.rid, None)
        tokens = self._completion(req, request)
        mask = [1] * len(tokens)
        turns: list[Turn] = []
        pos = 0
        for i, seg in enumerate(req.spec.segments):
            turns.append(Turn(role="assistant", start=pos, end=pos + seg))
            pos += seg
            if i < len(req.spec.tool_tokens):
                tool = req.spec.tool_tokens[i]
                mask[pos : pos + tool] = [0] * tool
                turns.append(Turn(role="tool", start=pos, end=pos + tool, name="tool"))
                pos += tool
        hit_max = req.spec.decode_tokens >= request.sampling.max_tokens
        versions: tuple[int, ...] = ()
        resume = request.resume
        if resume is not None and resume.token_ids:  # partial rollout: which weights made each
            done = len(resume.token_ids)
            prior = resume.token_versions or (request.version,) * done
            versions = (*prior, *([req.version] * (len(tokens) - done)))
        started = self._wall(req.started_at)
        finished = self._wall(req.finished_at)
        return Trajectory(
            request=request,
            version=req.version,
            prompt_token_ids=request.prompt_token_ids
            or _tokens(_key(request.group_id), 0, req.spec.prompt_len),
            completion_token_ids=tokens,
            logprobs=(-1.0,) * len(tokens),
            loss_mask=tuple(mask),
            turns=tuple(turns) if len(turns) > 1 else (),
            token_versions=versions,
            finish_reason="length" if hit_max else "stop",
            engines=engines,
            migrations=tuple(migrations),
            reprefilled_tokens=req.reprefilled,
            timings=Timings(
                dispatched_at=request.dispatched_at,
                started_at=started,
                first_token_at=started,
                finished_at=finished,
                queue_s=0.0,
                decode_s=max(0.0, finished - started),
            ),
        )


def _seek(req: SimRequest, done: int) -> bool:
    """Place ``req`` at ``done`` completion tokens (turns and tool replies); False when no
    unfinished position of its spec has that many."""
    spec, left, generated = req.spec, done, 0
    for i, seg in enumerate(spec.segments):
        if left < seg:
            req.seg, req.seg_done, req.generated = i, left, generated + left
            return True
        left -= seg
        generated += seg
        if i < len(spec.tool_tokens):
            left -= spec.tool_tokens[i]
        if left < 0:
            return False  # inside a tool reply: never a stopping point
    return False


def _clip(spec: RequestSpec, max_tokens: int) -> RequestSpec:
    """Cut a spec to ``max_tokens`` decode tokens (the request's own limit)."""
    if spec.decode_tokens <= max_tokens:
        return spec
    segs: list[int] = []
    left = max(max_tokens, 1)
    for s in spec.segments:
        segs.append(min(s, left))
        left -= segs[-1]
        if left <= 0:
            break
    n = len(segs)
    return RequestSpec(
        spec.prompt_len, tuple(segs), spec.tool_tokens[: n - 1], spec.tool_latency[: n - 1]
    )
