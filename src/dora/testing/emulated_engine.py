"""Timing-model engines for the emulated fleet, aligned with the simulator's draws.

``PacedSimEngine`` is a ``SimEngine`` that behaves in a live fleet as the simulator's engine
does in virtual time: same response lengths, idle time not credited back, throughput reported
per wall second (what the live orchestrator measures).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from dora.engines.base import PartialOutput
from dora.engines.sim import RequestSpec, SimEngine, Workload
from dora.engines.sim.core import SLOT_ADMIT_FRACTION
from dora.events import EngineStatus, RolloutRequest, Trajectory


class TraceEvent(NamedTuple):
    """One thing that happened on an engine (``at``: wall seconds, ``time.time()``).

    ``kind``: add (a queued request taken), resume (an interrupted one re-added), finish,
    abort, export, import, load (``request_id`` is the version, ``extra`` when it is ready).
    ``extra`` of an add / resume is the request's ``dispatched_at``; ``requests`` is how many
    the engine holds after the event; ``decode_s`` its decode seconds so far (virtual).
    """

    kind: str
    at: float
    request_id: str
    extra: float
    requests: int
    decode_s: float


class GroupSpecs:
    """Lengths as the simulator draws them: prompt ``p<n>`` is the simulator's group ``n``.

    Both dispatch prompts in order, so sample ``i`` of the n-th group has the same prompt and
    response length in the simulator and in the emulated fleet, whatever engine runs it.
    """

    def __init__(self, workload: Workload, seed: int, group_size: int) -> None:
        self.workload = workload
        self.seed = seed
        self.group_size = group_size
        self._cache: dict[int, list[RequestSpec]] = {}

    def __call__(self, request: RolloutRequest) -> RequestSpec:
        gid = request.group_id
        if not gid.startswith("p") or not gid[1:].isdigit():
            raise ValueError(f"group_id: expected 'p<n>' (an emulated prompt), got {gid!r}")
        n = int(gid[1:])
        specs = self._cache.get(n)
        if specs is None:
            specs = self._cache[n] = self.workload.group(self.seed, n, self.group_size)
        return specs[request.group_index]


class PacedSimEngine(SimEngine):
    """``SimEngine`` fit for a live fleet.

    - An idle engine's clock catches up with the paced clock before it takes work (a request,
      a weight load, an import): otherwise idle time would be credited back as instant
      decoding, and a weight load after idling would cost nothing.
    - Lengths come from ``spec_of`` (the simulator's draw) instead of a per-request draw.
    - Status reports tokens per wall second: the live orchestrator measures wall time.
    """

    def __init__(
        self,
        engine_id: str,
        cost: Any,
        workload: Any,
        seed: int,
        time_scale: float,
        max_seqs: int,
        spec_of: GroupSpecs,
        max_sleep_s: float = 0.02,
        admit_fraction: float = SLOT_ADMIT_FRACTION,
    ) -> None:
        super().__init__(
            engine_id, cost, workload, seed, time_scale, max_seqs, max_sleep_s, admit_fraction
        )
        self.spec_of = spec_of
        self.scale = time_scale
        self.trace: list[TraceEvent] = []
        """What happened on this engine, in wall seconds (``time.time()``): where its idle
        time went (``dora.testing.emulated_trace`` reduces it)."""

    def restart_clock(self) -> None:
        """Virtual time 0 is now (call on idle engines, just before the run starts)."""
        self._t0 = time.monotonic()
        self._epoch = time.time()
        self.core.clock = 0.0

    def paced_now(self) -> float:
        return (time.monotonic() - self._t0) * self.scale

    def _catch_up(self) -> None:
        if not self.core.has_work() and not self._exported:
            self.core.clock = max(self.core.clock, self.paced_now())

    def add_request(self, request: RolloutRequest) -> None:
        self._catch_up()
        super().add_request(request)
        resumed = request.resume is not None and bool(request.resume.token_ids)
        kind = "resume" if resumed else "add"
        self._note(kind, time.time(), request.request_id, request.dispatched_at)

    def load_weights(self, version: int, weights: Mapping[str, Any] | Path | None = None) -> None:
        self._catch_up()
        at = time.time()
        super().load_weights(version, weights)
        self._note("load", at, str(version), self._wall(self.core.clock))

    def import_request(self, snapshot: bytes) -> str:
        self._catch_up()
        rid = super().import_request(snapshot)
        self._note("import", time.time(), rid, 0.0)
        return rid

    def export_request(self, request_id: str) -> bytes:
        out = super().export_request(request_id)
        self._note("export", self._wall(self.core.clock), request_id, 0.0)
        return out

    def restore_exported(self, request_id: str) -> None:
        super().restore_exported(request_id)
        self._note("import", self._wall(self.core.clock), request_id, 0.0)

    def abort(self, request_id: str) -> PartialOutput:
        out = super().abort(request_id)
        self._note("abort", self._wall(self.core.clock), request_id, 0.0)
        return out

    def step(self) -> list[Trajectory]:
        done = super().step()
        for traj in done:
            self._note("finish", traj.timings.finished_at, traj.request.request_id, 0.0)
        return done

    def _note(self, kind: str, at: float, request_id: str, extra: float) -> None:
        self.trace.append(
            TraceEvent(kind, at, request_id, extra, self.core.num_requests(), self.core.decode_s)
        )

    def _build(self, request: RolloutRequest, migrations: Any = None) -> Any:
        req = super()._build(request, migrations)
        spec = self.spec_of(request)
        if spec.decode_tokens > request.sampling.max_tokens:
            raise ValueError(
                f"sampling.max_tokens: {request.sampling.max_tokens} is below the workload's "
                f"{spec.decode_tokens}-token response"
            )
        req.spec = spec
        return req

    def status(self) -> EngineStatus:
        status = super().status()
        return status.model_copy(update={"tokens_per_s": status.tokens_per_s * self.scale})
