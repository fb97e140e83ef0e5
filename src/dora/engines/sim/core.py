"""Event-driven timing core of one replica: no tokens are computed, only when things happen.

All running requests advance one token per decode step, so the core keeps one step counter
and stores, per request, the step at which its current segment ends. Between two events the
batch is fixed and the context grows by ``batch`` per step, so the time to the next event
(a request finishing, the KV cache filling up, a tool answer arriving) is a closed form from
the cost model: the core jumps there in O(log n) instead of stepping every token.

Scheduling mirrors vLLM's: waiting requests are admitted by priority while there is room
(``max_seqs`` and KV tokens), admission costs a prefill, and when the KV cache is full the
youngest running request is preempted (recompute: it re-prefills when readmitted). A core
given ``on_preempt`` hands a preempted request back instead of queueing it locally (a
generator that releases it to its version's queue, so any engine with room resumes it).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from dora.engines.sim.cost import CostModel
from dora.engines.sim.workload import RequestSpec

INF = math.inf
SLOT_ADMIT_FRACTION = 0.98
"""KV fraction below which an engine admits under slot admission (its slot cap binds first)."""
_KEYS = itertools.count()  # heap keys unique across cores: a migrated request's stale entry
# on its source must never match the key it gets on its target


@dataclass(eq=False, slots=True)
class SimRequest:
    """A request's spec and progress; the fields after ``spec`` are the core's bookkeeping."""

    rid: int
    version: int
    group: int
    index: int
    spec: RequestSpec
    priority: int = 0
    dispatched_at: float = 0.0
    queue: int = -1  # the fleet queue it was dispatched on (-1: its version's)
    seg: int = 0  # current segment (turn)
    seg_done: int = 0  # decoded tokens of the current segment
    generated: int = 0  # decoded tokens of finished segments + seg_done
    context: int = 0  # tokens whose KV this request holds (or would hold once prefilled)
    prefill: int = 0  # tokens to prefill when next admitted
    kv_held: int = 0  # tokens of KV resident on the engine while queued: context - prefill
    tool_ready_at: float = -1.0  # virtual time its pending tool call answers (-1: none)
    reprefilled: int = 0  # tokens prefilled again after an interruption (partial rollout)
    recomputed: int = 0  # tokens prefilled again after a KV-full preemption
    migrations: int = 0
    migrated_bytes: int = 0
    engines: list[int] = field(default_factory=list)
    version_tokens: list[tuple[int, int]] = field(default_factory=list)
    started_at: float = -1.0
    finished_at: float = -1.0
    # while running
    admit_step: int = 0
    admit_seg_done: int = 0
    admit_context: int = 0
    heap_key: int = -1

    @property
    def done(self) -> bool:
        return self.finished_at >= 0

    @property
    def remaining(self) -> int:
        """Decode tokens left (all segments)."""
        return self.spec.decode_tokens - self.generated

    @property
    def completion_tokens(self) -> int:
        return self.generated + sum(self.spec.tool_tokens[: self.seg])


class TimingCore:
    """One replica in virtual time. Not thread-safe; the simulator or SimEngine drives it."""

    def __init__(
        self,
        cost: CostModel,
        engine_id: int = 0,
        max_seqs: int | None = None,
        admit_fraction: float = SLOT_ADMIT_FRACTION,
        strict_versions: bool = True,
        on_preempt: Callable[[SimRequest], None] | None = None,
    ) -> None:
        if admit_fraction <= 0 or admit_fraction > 1:
            raise ValueError(f"admit_fraction must be in (0, 1], got {admit_fraction}")
        self.cost = cost
        self.engine_id = engine_id
        self.capacity = cost.kv_capacity_tokens
        self.max_seqs = max_seqs if max_seqs is not None else cost.max_num_seqs
        if self.max_seqs < 1:
            raise ValueError(f"max_seqs must be >= 1, got {self.max_seqs}")
        self.admit_cap = int(self.capacity * admit_fraction)
        self._a, self._b, self._c = cost.a, cost.b, cost.c
        self.strict_versions = strict_versions  # False: partial rollout mixes versions
        self.on_preempt = on_preempt
        self.version: int | None = None
        self._blocked = False  # after a preemption, admit nothing until something leaves
        self.clock = 0.0
        self.steps = 0
        self.context = 0  # KV tokens of running requests
        self.held = 0  # KV tokens of waiting requests that keep their KV (imports, tool waits)
        self.running: dict[int, SimRequest] = {}
        self._ends: list[tuple[int, int, SimRequest]] = []
        self._waiting: list[tuple[int, int, SimRequest]] = []
        self._waiting_ids: dict[int, SimRequest] = {}
        self._waiting_prefill = 0
        self._tools: list[tuple[float, int, SimRequest]] = []
        self._evicted: set[int] = set()  # tool waiters with no KV here (dropped or never had)
        self._seq = itertools.count()
        # accounting
        self.busy_s = 0.0
        self.decode_s = 0.0
        self.prefill_s = 0.0
        self.load_s = 0.0
        self.decoded_tokens = 0
        self.preemptions = 0
        self.changes = 0
        """Bumped whenever the set of requests or their states change (not on decode steps):
        a driver may reuse a view of this core while it is unchanged."""

    # ------------------------------------------------------------------ queries
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting_ids)

    @property
    def num_tool_waiting(self) -> int:
        return len(self._tools)

    def num_requests(self) -> int:
        return len(self.running) + len(self._waiting_ids) + len(self._tools)

    def has_work(self) -> bool:
        return self.num_requests() > 0

    def kv_used(self) -> int:
        return self.context + self.held

    def requests(self) -> list[SimRequest]:
        """Every request held, progress synced to the current step."""
        for req in self.running.values():
            self._sync(req)
        return (
            list(self.running.values())
            + list(self._waiting_ids.values())
            + [r for _, _, r in self._tools]
        )

    def preempted_ids(self) -> set[int]:
        """Queued requests that have generated tokens but hold no KV here (preempted, or
        woken from a tool wait whose KV was dropped): they recompute wherever they resume."""
        return {rid for rid, r in self._waiting_ids.items() if r.generated and not r.kv_held}

    def kv_holders(self) -> set[int]:
        """Requests whose KV is resident now: running, queued with resident KV, tool waiters
        not evicted (what a partial-rollout interrupt makes re-prefill)."""
        held = {rid for rid, r in self._waiting_ids.items() if r.kv_held}
        held.update(r.rid for _, _, r in self._tools if r.rid not in self._evicted)
        return held | set(self.running)

    def can_accept(self, prefill_tokens: int) -> bool:
        """Room for one more request now (the pull-consumer backpressure of a generator)."""
        if len(self.running) + len(self._waiting_ids) >= self.max_seqs:
            return False
        used = self.context + self.held + self._waiting_prefill
        return used + prefill_tokens <= self.admit_cap

    def next_event_time(self) -> float:
        """Virtual time of this core's next internal event (inf when idle)."""
        waiting = self._waiting
        while waiting and self._waiting_ids.get(waiting[0][2].rid) is not waiting[0][2]:
            heapq.heappop(waiting)  # stale entry (request removed or re-queued)
        if waiting and self._admissible(waiting[0][2]):
            return self.clock
        t = self._tools[0][0] if self._tools else INF
        n = len(self.running)
        if n:
            k_fin = self._top_end() - self.steps
            k_cap = (self.capacity - self.context - self.held) // n
            k = max(min(k_fin, k_cap), 0)
            c = self._c
            dt = k * (self._a + self._b * n + c * self.context) + c * n * k * (k - 1) * 0.5
            t = min(t, self.clock + dt)
        return t

    # ------------------------------------------------------------------ commands
    def add(self, req: SimRequest, now: float | None = None) -> None:
        """Queue a fresh (or resumed) request; it prefills ``req.prefill`` tokens on admission.
        One whose tool call is still pending waits for it first, with no KV here."""
        if self.strict_versions and self.version is not None and req.version != self.version:
            raise ValueError(
                f"version: request {req.rid} is v{req.version}, engine {self.engine_id} "
                f"serves v{self.version}"
            )
        if now is not None and now > self.clock and not self.has_work():
            self.clock = now
        if req.context == 0 and req.generated == 0:
            req.context = req.spec.prompt_len
            req.prefill = req.spec.prompt_len
        if not req.engines or req.engines[-1] != self.engine_id:
            req.engines.append(self.engine_id)
        if req.tool_ready_at >= 0:
            req.prefill = req.context
            self._push_tool_wait(req, kv=False)
            return
        self._push_waiting(req, front=bool(req.generated))

    def import_request(self, req: SimRequest, now: float) -> None:
        """Take a migrated request whose KV (``req.context - req.prefill`` tokens: all but
        a tool reply not yet prefilled) arrives with it; a pending tool call keeps waiting."""
        self.advance_to(now)
        req.engines.append(self.engine_id)
        if req.tool_ready_at >= 0:
            self._push_tool_wait(req, kv=req.prefill < req.context)
            return
        req.kv_held = req.context - req.prefill
        self.held += req.kv_held
        self._push_waiting(req, front=True)

    def remove(self, rid: int, keep_kv: bool) -> SimRequest:
        """Take a request out (export when ``keep_kv``, abort otherwise), synced to now."""
        self.changes += 1
        req = self.running.pop(rid, None)
        if req is not None:
            self._sync(req)
            self.context -= req.context
            req.heap_key = -1
        else:
            req = self._waiting_ids.pop(rid, None)
            if req is not None:
                self._waiting_prefill -= req.prefill
                self.held -= req.kv_held
            else:
                for i, (_, _, r) in enumerate(self._tools):
                    if r.rid == rid:
                        req = r
                        self._tools.pop(i)
                        heapq.heapify(self._tools)
                        if r.rid in self._evicted:
                            self._evicted.discard(r.rid)  # prefill == context already
                        else:
                            self.held -= r.context
                            req.prefill = 0
                        break
                if req is None:
                    raise KeyError(f"request_id: {rid} is not on engine {self.engine_id}")
        req.kv_held = 0
        self._blocked = False
        if not keep_kv:
            req.prefill = req.context  # re-prefill prompt + everything generated
        return req

    def interrupt_all(self) -> list[SimRequest]:
        """Partial rollout: drop every request's KV and hand them back (to resume later)."""
        out = [self.remove(rid, keep_kv=False) for rid in list(self.running)]
        out += [self.remove(rid, keep_kv=False) for rid in list(self._waiting_ids)]
        out += [self.remove(r.rid, keep_kv=False) for _, _, r in list(self._tools)]
        return out

    def load_weights(self, version: int, now: float) -> float:
        """Swap weights (engine pauses for the load); returns when it is ready."""
        self.advance_to(now)
        if self.strict_versions and any(r.version != version for r in self.requests()):
            raise ValueError(f"version: engine {self.engine_id} holds requests of another version")
        self.clock = max(self.clock, now) + self.cost.weight_load_time
        self.changes += 1
        self.load_s += self.cost.weight_load_time
        self.busy_s += self.cost.weight_load_time
        self.version = version
        return self.clock

    def set_priority(self, rid: int, priority: int) -> None:
        req = self._waiting_ids.get(rid)
        if req is not None:
            self._waiting_ids.pop(rid)
            self._waiting_prefill -= req.prefill
            self._waiting = [e for e in self._waiting if e[2].rid != rid]
            heapq.heapify(self._waiting)
            req.priority = priority
            self._push_waiting(req, front=False)
            return
        req = self.running.get(rid)
        if req is None:
            req = next((r for _, _, r in self._tools if r.rid == rid), None)
        if req is None:
            raise KeyError(f"request_id: {rid} is not on engine {self.engine_id}")
        req.priority = priority  # running requests decode every step; tool waiters on wake

    # ------------------------------------------------------------------ time
    def advance_to(self, t: float) -> list[SimRequest]:
        """Run until virtual time ``t`` (finishing the step in flight); return finished ones."""
        finished: list[SimRequest] = []
        cost = self.cost
        while True:
            self._wake_tools()
            self._admit()
            n = len(self.running)
            if n and (self.capacity - self.context - self.held) // n <= 0:
                if not (self._evict_tool_waiter() or self._drop_queued_kv()):
                    if n == 1:  # nothing else holds KV: preempting it would re-admit it
                        req = next(iter(self.running.values()))
                        raise ValueError(
                            f"kv_capacity: request {req.rid} outgrows engine "
                            f"{self.engine_id}'s {self.capacity} KV tokens on its own"
                        )
                    self._preempt_youngest()
                continue
            if self.clock >= t:
                break
            t_evt = INF
            k_evt = 0
            if n:
                k_fin = self._top_end() - self.steps
                k_cap = (self.capacity - self.context - self.held) // n
                k_evt = min(k_fin, k_cap)
                c = self._c
                t_evt = self.clock + (
                    k_evt * (self._a + self._b * n + c * self.context)
                    + c * n * k_evt * (k_evt - 1) * 0.5
                )
            t_wake = self._tools[0][0] if self._tools else INF
            target = min(t_evt, t_wake, t)
            if target == INF:
                break
            if n == 0:
                self.clock = max(self.clock, target)
            else:
                if target == t_evt:
                    k = k_evt
                else:
                    k = cost.steps_within(target - self.clock, n, self.context)
                    if cost.steps_time(k, n, self.context) < target - self.clock:
                        k += 1  # finish the step in flight
                    k = min(k, k_evt)
                self._advance(k, n)
                if k == k_evt:
                    self._segment_ends(finished)
        return finished

    def _wake_tools(self) -> None:
        """Requests whose tool answered by now rejoin the queue (front)."""
        while self._tools and self._tools[0][0] <= self.clock:
            _, _, req = heapq.heappop(self._tools)
            req.tool_ready_at = -1.0
            tool = req.spec.tool_tokens[req.seg - 1]
            req.context += tool
            if req.rid in self._evicted:  # no KV here (evicted, or resumed without it)
                self._evicted.discard(req.rid)
                req.kv_held, req.prefill = 0, req.context
            else:
                req.kv_held = req.context - tool  # stays counted in self.held until admitted
                req.prefill = tool
            self._push_waiting(req, front=True)

    def run_until_idle(self) -> list[SimRequest]:
        return self.advance_to(INF)

    # ------------------------------------------------------------------ internals
    def _advance(self, k: int, n: int) -> None:
        c = self._c
        dt = k * (self._a + self._b * n + c * self.context) + c * n * k * (k - 1) * 0.5
        self.clock += dt
        self.busy_s += dt
        self.decode_s += dt
        self.context += n * k
        self.steps += k
        self.decoded_tokens += n * k

    def _top_end(self) -> int:
        ends = self._ends
        while ends and ends[0][2].heap_key != ends[0][1]:
            heapq.heappop(ends)
        return ends[0][0]

    def _sync(self, req: SimRequest) -> None:
        d = self.steps - req.admit_step
        gen_before = req.generated - req.seg_done
        req.seg_done = req.admit_seg_done + d
        req.generated = gen_before + req.seg_done
        req.context = req.admit_context + d

    def _segment_ends(self, finished: list[SimRequest]) -> None:
        ends = self._ends
        while ends:
            end, key, req = ends[0]
            if req.heap_key != key:
                heapq.heappop(ends)
                continue
            if end > self.steps:
                break
            heapq.heappop(ends)
            self.changes += 1
            self._sync(req)
            del self.running[req.rid]
            self.context -= req.context
            req.heap_key = -1
            req.seg += 1
            req.seg_done = 0
            if req.seg >= len(req.spec.segments):
                req.finished_at = self.clock
                finished.append(req)
            else:  # tool call: keep the KV, wake when the tool answers
                req.tool_ready_at = self.clock + req.spec.tool_latency[req.seg - 1]
                self._push_tool_wait(req, kv=True)
            self._blocked = False

    def _push_tool_wait(self, req: SimRequest, kv: bool) -> None:
        """Park a request until ``req.tool_ready_at``, holding its KV here or not."""
        self.changes += 1
        if kv:
            self.held += req.context
        else:
            self._evicted.add(req.rid)
        heapq.heappush(self._tools, (req.tool_ready_at, next(self._seq), req))

    def _push_waiting(self, req: SimRequest, front: bool) -> None:
        self.changes += 1
        order = -next(self._seq) - 10**12 if front else next(self._seq)
        heapq.heappush(self._waiting, (-req.priority, order, req))
        self._waiting_ids[req.rid] = req
        self._waiting_prefill += req.prefill

    def _admissible(self, req: SimRequest) -> bool:
        if len(self.running) >= self.max_seqs:
            return False
        if not self.running:
            return True  # never deadlock on an empty engine
        if self._blocked:
            return False
        return self.context + self.held + req.prefill <= self.admit_cap

    def _admit(self) -> None:
        waiting = self._waiting
        prefill_s = 0.0
        while waiting:
            req = waiting[0][2]
            if self._waiting_ids.get(req.rid) is not req:
                heapq.heappop(waiting)
                continue
            if not self._admissible(req):
                break
            heapq.heappop(waiting)
            self.changes += 1
            del self._waiting_ids[req.rid]
            self._waiting_prefill -= req.prefill
            self.held -= req.kv_held
            if req.prefill:
                prefill_s += self.cost.prefill_time(req.prefill, req.kv_held)
            req.kv_held = 0
            req.prefill = 0
            if req.started_at < 0:
                req.started_at = self.clock
            req.admit_step = self.steps
            req.admit_seg_done = req.seg_done
            req.admit_context = req.context
            self.context += req.context
            key = next(_KEYS)
            req.heap_key = key
            end = self.steps + req.spec.segments[req.seg] - req.seg_done
            heapq.heappush(self._ends, (end, key, req))
            self.running[req.rid] = req
        if prefill_s:
            self.clock += prefill_s
            self.busy_s += prefill_s
            self.prefill_s += prefill_s

    def _evict_tool_waiter(self) -> bool:
        """Drop the KV of the request whose tool answers last (it re-prefills on wake)."""
        best = None
        for entry in self._tools:
            req = entry[2]
            if req.rid not in self._evicted and (best is None or entry[0] > best[0]):
                best = entry
        if best is None:
            return False
        req = best[2]
        self._evicted.add(req.rid)
        self.held -= req.context
        req.recomputed += req.context  # it prefills this again when the tool answers
        req.prefill = req.context
        self.preemptions += 1
        return True

    def _drop_queued_kv(self) -> bool:
        """Drop the resident KV of the last queued request that has some (an import or a woken
        tool waiter): it recomputes when admitted. Without this, resident KV of queued requests
        that alone fills the cache would preempt and re-admit a lone running request forever."""
        queued = [
            e for e in self._waiting if e[2].kv_held and self._waiting_ids.get(e[2].rid) is e[2]
        ]
        if not queued:
            return False
        last = max(queued, key=lambda e: e[:2])
        req = last[2]
        self.changes += 1
        self.held -= req.kv_held
        self._waiting_prefill += req.kv_held
        req.recomputed += req.kv_held
        req.prefill = req.context
        req.kv_held = 0
        self.preemptions += 1
        return True

    def _preempt_youngest(self) -> None:
        rid = next(reversed(self.running))
        req = self.remove(rid, keep_kv=False)
        req.recomputed += req.context
        self.preemptions += 1
        if self.on_preempt is not None:
            self.on_preempt(req)
            return
        self._blocked = True
        self._push_waiting(req, front=True)
