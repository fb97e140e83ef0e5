"""Reading a run directory: the recorder's ``events/*.jsonl`` and the learner's ``metrics.jsonl``.

Records are read as plain JSON and reduced to the few fields a report needs, so a report works
on partial runs (no learner, no status, an older schema) and on files cut short by a crash. A
line that cannot be read is not dropped silently: it is listed in ``RunData.problems`` with its
file and line number. Events are deduplicated by ``event_id`` (the recorder is at-least-once).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dora.audit import EVENTS_DIR

METRICS_FILE = "metrics.jsonl"


@dataclass(frozen=True)
class TrajRecord:
    """One finished trajectory (from ``trajectories`` or nested in ``scored``)."""

    event_id: str
    request_id: str
    group_id: str
    version: int
    engines: tuple[str, ...]
    migrations: int
    reprefilled_tokens: int
    completion_tokens: int
    dispatched_at: float
    started_at: float
    finished_at: float
    created_at: float


@dataclass(frozen=True)
class ScoredRecord:
    request_id: str
    group_id: str
    version: int
    reward: float
    correct: bool
    time: float


@dataclass(frozen=True)
class StatusRecord:
    engine_id: str
    time: float
    version: int | None
    state: str
    running: int
    waiting: int
    tokens_per_s: float
    running_by_version: dict[int, int]


@dataclass(frozen=True)
class MigrationRec:
    request_id: str
    source: str
    target: str
    version: int
    ok: bool
    seconds: float
    kv_bytes: int
    time: float


@dataclass(frozen=True)
class WeightRec:
    version: int
    step: int
    time: float


@dataclass(frozen=True)
class MetricsRec:
    """One metrics record: a learner step (file or bus) or a rollout-side sample (bus)."""

    step: int
    time: float
    values: dict[str, float]
    consumed_groups: tuple[str, ...] = ()


@dataclass
class RunData:
    """Everything a report draws from; each list may be empty."""

    run_dir: Path
    trajectories: list[TrajRecord] = field(default_factory=list)
    scored: list[ScoredRecord] = field(default_factory=list)
    status: list[StatusRecord] = field(default_factory=list)
    migrations: list[MigrationRec] = field(default_factory=list)
    weights: list[WeightRec] = field(default_factory=list)
    bus_metrics: list[MetricsRec] = field(default_factory=list)
    file_metrics: list[MetricsRec] = field(default_factory=list)
    deadletters: int = 0
    staleness_bound: int | None = None  # K, from the dispatcher's ledger snapshots
    problems: list[str] = field(default_factory=list)

    @property
    def t0(self) -> float:
        """The earliest timestamp of the run: the origin of every time axis."""
        times = [t.dispatched_at or t.created_at for t in self.trajectories]
        times += [s.time for s in self.status] + [w.time for w in self.weights]
        times += [m.time for m in self.migrations] + [s.time for s in self.scored]
        times += [m.time for m in (*self.bus_metrics, *self.file_metrics)]
        times = [t for t in times if t > 0]
        return min(times) if times else 0.0

    def series(self, name: str) -> list[tuple[int, float, float]]:
        """``(step, time, value)`` of one slash-named metric; the learner's file wins."""
        for source in (self.file_metrics, self.bus_metrics):
            points = [(m.step, m.time, m.values[name]) for m in source if name in m.values]
            if points:
                return sorted(points, key=lambda p: (p[1], p[0]))
        return []

    def metric_names(self) -> set[str]:
        return {k for m in (*self.file_metrics, *self.bus_metrics) for k in m.values}


def _lines(path: Path, problems: list[str]) -> Iterator[dict[str, Any]]:
    if not path.is_file():
        return
    with path.open(encoding="utf-8", errors="replace") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as exc:
                problems.append(f"{path.name}:{number}: not JSON ({exc})")
                continue
            except RecursionError:  # a hostile, deeply nested payload recorded verbatim
                problems.append(f"{path.name}:{number}: nested too deeply to read")
                continue
            if isinstance(obj, dict):
                yield obj
            else:
                problems.append(f"{path.name}:{number}: not a JSON object")


def _num(value: Any, default: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return default
    return float(value) if math.isfinite(value) else default


def _traj(obj: dict[str, Any]) -> TrajRecord:
    request = obj.get("request") or {}
    timings = obj.get("timings") or {}
    return TrajRecord(
        event_id=str(obj.get("event_id", "")),
        request_id=str(request.get("request_id", obj.get("event_id", ""))),
        group_id=str(request.get("group_id", "")),
        version=int(obj["version"]),
        engines=tuple(str(e) for e in obj.get("engines") or ()),
        migrations=len(obj.get("migrations") or ()),
        reprefilled_tokens=int(_num(obj.get("reprefilled_tokens"))),
        completion_tokens=len(obj.get("completion_token_ids") or ()),
        dispatched_at=_num(timings.get("dispatched_at")) or _num(request.get("dispatched_at")),
        started_at=_num(timings.get("started_at")),
        finished_at=_num(timings.get("finished_at")) or _num(obj.get("created_at")),
        created_at=_num(obj.get("created_at")),
    )


def _status(obj: dict[str, Any]) -> StatusRecord:
    by_version: dict[int, int] = {}
    for req in obj.get("requests") or ():
        if isinstance(req, dict) and isinstance(req.get("version"), int):
            by_version[req["version"]] = by_version.get(req["version"], 0) + 1
    version = obj.get("version")
    return StatusRecord(
        engine_id=str(obj["engine_id"]),
        time=_num(obj.get("created_at")),
        version=version if isinstance(version, int) else None,
        state=str(obj.get("state", "")),
        running=int(_num(obj.get("running"))),
        waiting=int(_num(obj.get("waiting"))),
        tokens_per_s=_num(obj.get("tokens_per_s")),
        running_by_version=by_version,
    )


def _values(obj: dict[str, Any]) -> dict[str, float]:
    raw = obj.get("values")
    if not isinstance(raw, dict):  # flat records: every numeric key but step/time
        raw = {k: v for k, v in obj.items() if k not in ("step", "time", "created_at")}
    return {
        k: float(v)
        for k, v in raw.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }


def _read(path: Path, problems: list[str], parse: Any, dedupe: bool = True) -> list[Any]:
    out: list[Any] = []
    seen: set[str] = set()
    for number, obj in enumerate(_lines(path, problems), 1):
        event_id = obj.get("event_id")
        if dedupe and isinstance(event_id, str):
            if event_id in seen:
                continue
            seen.add(event_id)
        try:
            out.append(parse(obj))
        except (KeyError, TypeError, ValueError) as exc:
            problems.append(f"{path.name}: record {number}: missing or bad field {exc}")
    return out


def load_run(run_dir: Path | str) -> RunData:
    """Read a run directory; missing files mean empty lists, unreadable lines ``problems``."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist")
    events = run_dir / EVENTS_DIR
    run = RunData(run_dir=run_dir)
    p = run.problems

    trajs: dict[str, TrajRecord] = {}
    for obj in _read(events / "trajectories.jsonl", p, lambda o: o):
        _add_traj(trajs, obj, p, "trajectories.jsonl")
    scored_objs = _read(events / "scored.jsonl", p, lambda o: o)
    for obj in scored_objs:
        _add_traj(trajs, obj.get("trajectory"), p, "scored.jsonl")
        try:
            t = _traj(obj["trajectory"])
            reward = obj["reward"]
            run.scored.append(
                ScoredRecord(
                    t.request_id,
                    t.group_id,
                    t.version,
                    _num(reward),
                    bool(obj.get("correct")),
                    _num(obj.get("created_at")),
                )
            )
        except (KeyError, TypeError, ValueError) as exc:
            p.append(f"scored.jsonl: missing or bad field {exc}")
    run.trajectories = sorted(trajs.values(), key=lambda t: t.finished_at)
    run.scored.sort(key=lambda s: s.time)

    run.status = sorted(_read(events / "status.jsonl", p, _status), key=lambda s: s.time)
    run.migrations = _read(
        events / "migrations.jsonl",
        p,
        lambda o: MigrationRec(
            str(o["request_id"]),
            str(o["source"]),
            str(o["target"]),
            int(o.get("version", 0)),
            bool(o.get("ok", True)),
            _num(o.get("seconds")),
            int(_num(o.get("kv_bytes"))),
            _num(o.get("created_at")),
        ),
    )
    run.weights = _read(
        events / "weights.jsonl",
        p,
        lambda o: WeightRec(int(o["version"]), int(o.get("step", 0)), _num(o.get("created_at"))),
    )
    run.bus_metrics = _read(
        events / "metrics.jsonl",
        p,
        lambda o: MetricsRec(
            int(o["step"]),
            _num(o.get("created_at")),
            _values(o),
            tuple(str(g) for g in o.get("consumed_groups") or ()),
        ),
    )
    run.file_metrics = _read(
        run_dir / METRICS_FILE,
        p,
        lambda o: MetricsRec(int(o["step"]), _num(o.get("time")), _values(o)),
        dedupe=False,
    )
    run.deadletters = len(_read(events / "deadletter.jsonl", p, lambda o: o))
    bounds = _read(events / "ledger.jsonl", p, lambda o: int(o["staleness_bound"]), dedupe=False)
    run.staleness_bound = bounds[-1] if bounds else None
    return run


def _add_traj(trajs: dict[str, TrajRecord], obj: Any, problems: list[str], where: str) -> None:
    if not isinstance(obj, dict):
        problems.append(f"{where}: a record without a trajectory")
        return
    try:
        t = _traj(obj)
    except (KeyError, TypeError, ValueError) as exc:
        problems.append(f"{where}: trajectory with missing or bad field {exc}")
        return
    trajs.setdefault(t.event_id or t.request_id, t)
