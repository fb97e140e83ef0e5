"""KV migration between TorchEngines is exact and needs no prefill on the target.

A request migrated once or several times mid-generation (through the serialized snapshot
bytes, and once through the real NATS object store) produces exactly the token ids and
logprobs of the same request never migrated.
"""

from __future__ import annotations

import pytest

from dora.bus import NatsBus
from dora.engines.torch import TorchEngine
from dora.events import RolloutRequest, Trajectory
from tests.unit.test_engine_support import make_engine as _make_engine
from tests.unit.test_engine_support import make_request, run_all


def make_engine(engine_id: str) -> TorchEngine:
    """eos ignored: every request runs to max_tokens, so the hops land mid-generation."""
    return _make_engine(engine_id, ignore_eos=True)


SAMPLINGS = {
    "greedy": dict(temperature=0.0),
    "seeded": dict(temperature=1.0, top_p=0.9, seed=1234),
}


def _reference(req: RolloutRequest) -> Trajectory:
    engine = make_engine("ref")
    engine.add_request(req)
    ref = run_all(engine)[req.request_id]
    assert len(ref.completion_token_ids) == req.sampling.max_tokens
    return ref


def _hop(src: TorchEngine, dst: TorchEngine, rid: str) -> int:
    """Move ``rid`` from src to dst through bytes; return dst's prefill tokens for it."""
    data = src.export_request(rid)
    before = dst.counters.prefill_tokens
    dst.import_request(data)
    src.release_exported(rid)
    dst.step()  # the first step after import: a decode, not a prefill
    return dst.counters.prefill_tokens - before


@pytest.mark.parametrize("kind", sorted(SAMPLINGS))
def test_migration_once_is_exact(kind: str) -> None:
    req = make_request("m", "Migrate me across engines, please.", max_tokens=40, **SAMPLINGS[kind])
    ref = _reference(req)
    a, b = make_engine("a"), make_engine("b")
    a.add_request(req)
    for _ in range(10):
        a.step()
    assert _hop(a, b, "m") == 0
    out = run_all(b)["m"]
    assert out.completion_token_ids == ref.completion_token_ids
    assert out.logprobs == ref.logprobs
    assert out.engines == ("a", "b") and out.reprefilled_tokens == 0
    assert len(out.migrations) == 1 and out.migrations[0].at_token == 10
    assert b.counters.prefill_tokens == 0
    assert a.blocks.num_used == 0 and b.blocks.num_used == 0


@pytest.mark.parametrize("kind", sorted(SAMPLINGS))
def test_migration_a_b_a_is_exact(kind: str) -> None:
    req = make_request("m", "Back and forth we go; count: 1 2 3", max_tokens=48, **SAMPLINGS[kind])
    ref = _reference(req)
    a, b = make_engine("a"), make_engine("b")
    a.add_request(req)
    for _ in range(7):
        a.step()
    prefill_a = a.counters.prefill_tokens
    assert _hop(a, b, "m") == 0
    for _ in range(9):
        b.step()
    assert _hop(b, a, "m") == 0
    for _ in range(5):
        a.step()
    assert _hop(a, b, "m") == 0
    out = run_all(b)["m"]
    assert out.completion_token_ids == ref.completion_token_ids
    assert out.logprobs == ref.logprobs
    assert out.engines == ("a", "b", "a", "b")
    assert [m.source for m in out.migrations] == ["a", "b", "a"]
    assert a.counters.prefill_tokens == prefill_a  # the prompt was prefilled once, on a
    assert b.counters.prefill_tokens == 0


def test_migration_in_a_busy_batch_keeps_tokens() -> None:
    """The target is busy with other requests; the migrated one still decodes identically."""
    req = make_request("m", "Busy target engine test.", max_tokens=30)
    ref = _reference(req)
    a, b = make_engine("a"), make_engine("b")
    for i in range(8):
        b.add_request(make_request(f"o{i}", f"other request {i}", max_tokens=25))
    b.step()
    a.add_request(req)
    for _ in range(5):
        a.step()
    data = a.export_request("m")
    before = b.counters.prefill_tokens
    b.import_request(data)
    a.release_exported("m")
    out = run_all(b)
    assert out["m"].completion_token_ids == ref.completion_token_ids
    assert out["m"].logprobs == pytest.approx(ref.logprobs, abs=1e-5)
    assert b.counters.prefill_tokens == before  # others were already prefilled
    assert len(out) == 9


async def test_migration_through_nats_object_store(nats_bus: NatsBus) -> None:
    req = make_request("m", "Through the object store.", max_tokens=24, **SAMPLINGS["seeded"])
    ref = _reference(req)
    a, b = make_engine("a"), make_engine("b")
    a.add_request(req)
    for _ in range(6):
        a.step()
    blob = await nats_bus.put_blob("kv-m", a.export_request("m"))
    b.import_request(await nats_bus.get_blob(blob.name))
    a.release_exported("m")
    out = run_all(b)["m"]
    assert out.completion_token_ids == ref.completion_token_ids
    assert out.logprobs == ref.logprobs
    assert out.migrations[0].kv_bytes > 0
    assert b.counters.prefill_tokens == 0
