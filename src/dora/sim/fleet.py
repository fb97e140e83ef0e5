"""The discrete-event loop: a heap of engine and timer events over a fleet of timing cores.

Each engine has at most one live entry in the heap (its next internal event: a request
finishing, its KV filling up, a tool answering); an epoch counter makes older entries stale
instead of searching the heap. Requests wait in one queue per policy version (the
``requests.v<N>`` subjects) and an engine pulls from its version's queue while it has room,
as a pull consumer with ``max_ack_pending`` does in the live system.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from dora.engines.sim.core import SimRequest, TimingCore
from dora.sim.config import SimConfig, StartOrder

INF = math.inf


@dataclass(eq=False, slots=True)
class Group:
    """One GRPO group: ``size`` samples of one prompt, all tagged with one version."""

    gid: int
    version: int
    requests: list[SimRequest]
    dispatched_at: float
    done: int = 0
    finished_at: float = -1.0
    consumed_step: int = -1

    @property
    def finished(self) -> bool:
        return self.done == len(self.requests)

    @property
    def completion_tokens(self) -> int:
        return sum(r.completion_tokens for r in self.requests)

    @property
    def prompt_tokens(self) -> int:
        return sum(r.spec.prompt_len for r in self.requests)


@dataclass(frozen=True)
class WorkloadStats:
    """Moments of the workload used to tune the engines and to state the ideal bound."""

    mean_prompt: float
    mean_response: float
    mean_context: float  # token-weighted context a decode step sees: prompt + E[L^2] / 2E[L]

    @classmethod
    def of(cls, cfg: SimConfig, samples: int = 4096) -> WorkloadStats:
        specs = [
            s for g in range(samples // 16) for s in cfg.workload.group(cfg.seed + 7919, g, 16)
        ]
        lengths = np.array([s.total_tokens for s in specs], dtype=float)
        prompt = float(np.mean([s.prompt_len for s in specs]))
        return cls(
            mean_prompt=prompt,
            mean_response=float(lengths.mean()),
            mean_context=prompt + float((lengths**2).mean() / (2 * lengths.mean())),
        )


@dataclass
class Fleet:
    """Engines, queues, groups and the event heap of one run."""

    cfg: SimConfig
    strict_versions: bool = True
    cores: list[TimingCore] = field(init=False)
    stats: WorkloadStats = field(init=False)
    now: float = 0.0

    def __post_init__(self) -> None:
        cfg = self.cfg
        self.stats = WorkloadStats.of(cfg)
        cap = cfg.cost.kv_capacity_tokens
        # a tuned max_num_seqs: 85% of the KV capacity over the mean decode context (a sweep
        # on dense-32b/dapo-16k: 0.85 maximizes sync and partial; 1.0 thrashes on preemption)
        tuned = max(1, min(cfg.cost.max_num_seqs, int(0.85 * cap / self.stats.mean_context)))
        kv = cfg.admission == "kv"
        self.max_seqs = cfg.max_seqs or (cfg.kv_max_seqs if kv else tuned)
        self.cores = [
            TimingCore(
                cfg.cost,
                i,
                self.max_seqs,
                admit_fraction=cfg.admit_fraction,
                strict_versions=self.strict_versions,
                # dora's orchestrator moves preempted requests itself (``plan``'s relief)
                on_preempt=self._preempted if kv and not cfg.mode.startswith("dora") else None,
            )
            for i in range(cfg.engines)
        ]
        self._released: list[SimRequest] = []
        self._heap: list[tuple[float, int, int, object]] = []
        self._seq = itertools.count()
        self._epoch = [0] * cfg.engines
        self.queues: dict[int, deque[SimRequest]] = defaultdict(deque)
        self.hungry: dict[int, set[int]] = defaultdict(set)  # version -> engines with room
        self.groups: list[Group] = []
        self.requests: dict[int, SimRequest] = {}
        self._rid = itertools.count()
        self.on_group_done: Callable[[Group], None] = lambda g: None
        self.on_engine_event: Callable[[int], None] = lambda e: None
        self.finished_count = 0
        self.done_ids: set[int] = set()
        self.stopped = False

    # ------------------------------------------------------------------ dispatch
    def dispatch_group(self, version: int, queue: int | None = None) -> Group:
        """Tag a new group with ``version`` and queue its samples (on ``queue``, default the
        version's own queue)."""
        group = self._new_group(version)
        key = version if queue is None else queue
        for req in group.requests:
            req.queue = key
        self.queues[key].extend(group.requests)
        return group

    def dispatch_groups(self, version: int, n: int, order: StartOrder = "fifo") -> list[Group]:
        """Tag ``n`` new groups with ``version`` and queue their samples in ``order`` (the
        oracle orders are yardsticks: they read the drawn lengths; see ``START_ORDERS``)."""
        groups = [self._new_group(version) for _ in range(n)]
        reqs = [r for g in groups for r in g.requests]
        if order == "oracle_request":
            reqs.sort(key=lambda r: -r.spec.decode_tokens)  # stable: ties keep FIFO order
        elif order == "oracle_group":
            mean_log = {g.gid: _mean_log_length(g) for g in groups}
            reqs.sort(key=lambda r: -mean_log[r.group])
        self.queues[version].extend(reqs)
        return groups

    def _new_group(self, version: int) -> Group:
        gid = len(self.groups)
        specs = self.cfg.workload.group(self.cfg.seed, gid, self.cfg.group_size)
        reqs = []
        for i, spec in enumerate(specs):
            rid = next(self._rid)
            req = SimRequest(rid, version, gid, i, spec, dispatched_at=self.now)
            reqs.append(req)
            self.requests[rid] = req
        group = Group(gid, version, reqs, self.now)
        self.groups.append(group)
        return group

    def _preempted(self, req: SimRequest) -> None:
        """A core released a preempted request (inside its time step): requeue it at once."""
        if not self._released:
            self.at(self.now, self._requeue_released)
        self._released.append(req)

    def _requeue_released(self) -> None:
        """Released requests go to the front of their queue, for any engine with room."""
        keys = []
        while self._released:
            req = self._released.pop()
            key = req.version if req.queue < 0 else req.queue
            self.queues[key].appendleft(req)
            if key not in keys:
                keys.append(key)
        for key in keys:
            self.feed(key)

    def fill(self, e: int, queue: int | None = None) -> None:
        """Let engine ``e`` pull from its queue while it has room (engine must be current)."""
        core = self.cores[e]
        key = core.version if queue is None else queue
        if key is None:
            return
        q = self.queues[key]
        while q and core.can_accept(q[0].prefill or q[0].spec.prompt_len):
            core.add(q.popleft())
        if q:
            self.hungry[key].discard(e)
        else:
            self.hungry[key].add(e)

    def feed(self, key: int) -> None:
        """New requests on queue ``key``: spread them over the engines that had room, one at a
        time to the least-loaded (as NATS pull delivery and a DP router do: every engine with
        room fetches). Filling one engine to ``max_seqs`` before the next would leave engines
        idle whenever a batch is smaller than the fleet's slots (sync at 1,024 engines)."""
        q = self.queues[key]
        hungry = self.hungry[key]
        if not q or not hungry:
            return
        touched: list[int] = []
        heap = []
        for e in sorted(hungry):
            self.touch(e)
            touched.append(e)
            heap.append((self.cores[e].num_requests(), e))
        heapq.heapify(heap)
        while q and heap:
            load, e = heapq.heappop(heap)
            core = self.cores[e]
            if core.can_accept(q[0].prefill or q[0].spec.prompt_len):
                core.add(q.popleft())
                heapq.heappush(heap, (load + 1, e))
            else:
                hungry.discard(e)
        for e in touched:
            self.schedule(e)

    # ------------------------------------------------------------------ time
    def touch(self, e: int) -> None:
        """Bring engine ``e`` to ``now``, handling what finished on the way."""
        for req in self.cores[e].advance_to(self.now):
            self._finished(req)

    def schedule(self, e: int) -> None:
        self._epoch[e] += 1
        t = self.cores[e].next_event_time()
        if t < INF:
            heapq.heappush(self._heap, (max(t, self.now), next(self._seq), e, self._epoch[e]))

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), -1, fn))

    def run(self) -> None:
        heap = self._heap
        while heap and not self.stopped:
            t, _, e, payload = heapq.heappop(heap)
            self.now = t
            if e < 0:
                payload()  # type: ignore[operator]
                continue
            if payload != self._epoch[e]:
                continue
            self.touch(e)
            self.on_engine_event(e)
            self.schedule(e)

    def _finished(self, req: SimRequest) -> None:
        if req.rid in self.done_ids:
            raise AssertionError(f"request {req.rid} finished twice")
        self.done_ids.add(req.rid)
        self.finished_count += 1
        group = self.groups[req.group]
        group.done += 1
        if group.finished:
            group.finished_at = req.finished_at
            self.on_group_done(group)


def _mean_log_length(group: Group) -> float:
    """The group's mean log decode length: its prompt's difficulty as drawn."""
    return sum(math.log(max(r.spec.decode_tokens, 1)) for r in group.requests) / len(group.requests)
