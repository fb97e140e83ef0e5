"""Where an emulated fleet's engine time went: decode, prefill, weight loads, and idle time
split by whether work was queued at that moment.

Utilization (decode time / engine time) alone cannot tell a fleet that had no work to take
(the staleness window or the dispatcher held it back) from one whose engines sat empty while
requests waited on the bus (pull delivery, placement). ``breakdown`` reduces the engines'
traces (``PacedSimEngine.trace``) to that split, in emulated seconds, so the emulated fleet
can be compared with the simulator term by term.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

from dora.testing.emulated_engine import TraceEvent

if TYPE_CHECKING:
    from dora.engines.sim.core import SimRequest, TimingCore
    from dora.sim import SimConfig
    from dora.sim.fleet import Fleet
    from dora.sim.metrics import SimResult


@dataclass(frozen=True)
class Breakdown:
    """Engine time of a run (emulated engine-seconds, summed over engines) by what it did.

    ``decode_s`` / ``prefill_s`` / ``load_s`` are the engines' own totals (up to their stop);
    the idle terms and the held-request statistics cover the window only."""

    engine_s: float
    decode_s: float
    prefill_s: float
    load_s: float
    idle_queued_s: float
    """No request on the engine while at least one dispatched request was not yet taken."""
    idle_empty_s: float
    """No request on the engine and none waiting anywhere: the fleet had no work."""
    pickup_s_mean: float
    """Dispatch -> taken by an engine, mean over fresh requests."""
    pickup_s_p90: float
    held_mean: float
    """Requests held per engine, time-weighted mean over engines and time."""
    held_spread: float
    """Time-weighted mean of (most - fewest) requests held across engines."""

    def fractions(self) -> dict[str, float]:
        """Each engine-time term over the engine time (they need not sum to 1: a request can
        be held while its engine's clock lags the wall clock)."""
        t = self.engine_s or 1.0
        return {
            "decode": self.decode_s / t,
            "prefill": self.prefill_s / t,
            "load": self.load_s / t,
            "idle_queued": self.idle_queued_s / t,
            "idle_empty": self.idle_empty_s / t,
        }

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), **{f"frac_{k}": v for k, v in self.fractions().items()}}


def _step_fn(points: Sequence[tuple[float, int]], start: float, end: float) -> list[tuple]:
    """(time, value) change points -> sorted segments (t0, t1, value) clipped to [start, end]."""
    out = []
    value = 0
    t_prev = start
    for t, v in sorted(points, key=lambda p: p[0]):
        if t > t_prev and t_prev < end:
            out.append((t_prev, min(t, end), value))
        t_prev = max(t_prev, t)
        value = v
    if t_prev < end:
        out.append((t_prev, end, value))
    return out


def queue_points(traces: Iterable[Sequence[TraceEvent]]) -> list[tuple[float, int]]:
    """Change points of the number of dispatched requests no engine has taken yet."""
    deltas: list[tuple[float, int]] = []
    for trace in traces:
        for ev in trace:
            if ev.kind == "add":
                deltas.append((ev.extra, 1))
                deltas.append((ev.at, -1))
    deltas.sort()
    points, n = [], 0
    for t, d in deltas:
        n += d
        points.append((t, n))
    return points


def breakdown(
    traces: Mapping[str, Sequence[TraceEvent]],
    busy: Mapping[str, tuple[float, float, float]],
    start: float,
    end: float,
    scale: float,
) -> Breakdown:
    """Reduce per-engine traces over the wall-clock window [start, end] (``scale``: emulated
    seconds per wall second). ``busy``: per engine (decode, prefill, load) virtual seconds."""
    queue = _step_fn(queue_points(traces.values()), start, end)
    qtimes = np.array([s[0] for s in queue])
    idle_q = idle_e = 0.0
    held: dict[str, list[tuple]] = {}
    for engine, trace in traces.items():
        segs = _step_fn([(ev.at, ev.requests) for ev in trace], start, end)
        held[engine] = segs
        for a, b, n in segs:
            if n:
                continue
            # split the idle segment [a, b) by the queue's state
            i = max(int(np.searchsorted(qtimes, a, side="right")) - 1, 0)
            t = a
            while t < b and i < len(queue):
                _, qb, qn = queue[i]
                hi = min(b, qb)
                if hi > t:
                    if qn > 0:
                        idle_q += hi - t
                    else:
                        idle_e += hi - t
                    t = hi
                i += 1
            if t < b:
                idle_e += b - t
    pickups = [
        (ev.at - ev.extra) * scale
        for tr in traces.values()
        for ev in tr
        if ev.kind == "add" and start <= ev.at <= end
    ]
    mean_held, spread = _held_stats(held, start, end)
    n = len(traces)
    return Breakdown(
        engine_s=n * (end - start) * scale,
        decode_s=sum(b[0] for b in busy.values()),
        prefill_s=sum(b[1] for b in busy.values()),
        load_s=sum(b[2] for b in busy.values()),
        idle_queued_s=idle_q * scale,
        idle_empty_s=idle_e * scale,
        pickup_s_mean=float(np.mean(pickups)) if pickups else 0.0,
        pickup_s_p90=float(np.percentile(pickups, 90)) if pickups else 0.0,
        held_mean=mean_held,
        held_spread=spread,
    )


def _held_stats(held: Mapping[str, list[tuple]], start: float, end: float) -> tuple[float, float]:
    """Time-weighted mean of requests held per engine, and of the max - min across engines."""
    cuts = sorted({start, end, *(a for segs in held.values() for a, _, _ in segs)})
    if len(cuts) < 2 or end <= start:
        return 0.0, 0.0
    idx = {e: 0 for e in held}
    mean = spread = 0.0
    for a, b in itertools.pairwise(cuts):
        values = []
        for e, segs in held.items():
            i = idx[e]
            while i + 1 < len(segs) and segs[i][1] <= a:
                i += 1
            idx[e] = i
            values.append(segs[i][2] if segs and segs[i][0] <= a < segs[i][1] else 0)
        mean += (b - a) * float(np.mean(values))
        spread += (b - a) * (max(values) - min(values))
    return mean / (end - start), spread / (end - start)


def sim_breakdown(cfg: SimConfig) -> tuple[SimResult, Breakdown]:
    """Run the simulator on ``cfg`` and reduce its engines' history the same way, so the
    emulated fleet's breakdown has a counterpart (virtual seconds; scale 1).

    The cores are wrapped for this one run (instance attributes, nothing global): every
    add, import, removal and finish is noted with the fleet's clock.
    """
    from dora.sim.metrics import summarize as sim_summarize
    from dora.sim.runner import _driver

    driver = _driver(cfg)
    fleet = driver.fleet
    traces: dict[str, list[TraceEvent]] = {str(i): [] for i in range(cfg.engines)}

    def note(core: TimingCore, kind: str, at: float, rid: int, extra: float = 0.0) -> None:
        ev = TraceEvent(kind, at, str(rid), extra, core.num_requests(), core.decode_s)
        traces[str(core.engine_id)].append(ev)

    for core in fleet.cores:
        _wrap(core, fleet, note)
    finished = fleet._finished

    def on_finished(req: SimRequest) -> None:
        note(fleet.cores[req.engines[-1]], "finish", req.finished_at, req.rid)
        finished(req)

    fleet._finished = on_finished  # type: ignore[method-assign]
    records = driver.run()
    result = sim_summarize(cfg, fleet, records, plan_calls=driver.plan_calls)
    busy = {str(i): (c.decode_s, c.prefill_s, c.load_s) for i, c in enumerate(fleet.cores)}
    end = records[-1].train_end if records else fleet.now
    return result, breakdown(traces, busy, 0.0, end, 1.0)


def _wrap(core: TimingCore, fleet: Fleet, note: Callable[..., None]) -> None:
    add, imp, remove = core.add, core.import_request, core.remove

    def add_(req: SimRequest, now: float | None = None) -> None:
        fresh = req.generated == 0 and req.context == 0
        add(req, now)
        note(core, "add" if fresh else "resume", fleet.now, req.rid, req.dispatched_at)

    def import_(req: SimRequest, now: float) -> None:
        imp(req, now)
        note(core, "import", fleet.now, req.rid)

    def remove_(rid: int, keep_kv: bool) -> SimRequest:
        req = remove(rid, keep_kv)
        note(core, "abort", fleet.now, rid)
        return req

    core.add = add_  # type: ignore[method-assign]
    core.import_request = import_  # type: ignore[method-assign]
    core.remove = remove_  # type: ignore[method-assign]
