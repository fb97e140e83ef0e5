"""The engine contract, run against the built-in engine and the vLLM engine alike.

Every engine must: sample a request's tokens independently of its batch and equal to the
built-in engine's on the same checkpoint; load a new version in place (and refuse while it
holds a request of another); move a running request to another engine of its kind with its
KV (no re-prefill, the same continuation at temperature 1) and count any re-prefill it cannot
avoid. The vLLM side needs the ``vllm`` extra (marked ``vllm``; skipped without it) and starts
two vLLM engines once for the module (~15 s each on 2 cores).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dora.engines import EngineError, SnapshotError, VersionMismatch
from dora.engines.snapshot import decode_snapshot, encode_snapshot
from dora.engines.torch import EngineConfig, TorchEngine
from dora.events import Trajectory
from dora.models import build_model, save_pretrained
from tests.unit.test_engine_support import make_request, run_all

KINDS = [
    "dora",
    pytest.param("vllm", marks=[pytest.mark.vllm, pytest.mark.timeout(900)]),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model, tok = build_model("tiny", seed=0, num_hidden_layers=2)
    return save_pretrained(model, tmp_path_factory.mktemp("ckpt") / "tiny", tok)


def _engine(kind: str, directory: Path, engine_id: str) -> Any:
    if kind == "dora":
        return TorchEngine.from_pretrained(directory, EngineConfig(num_blocks=512), engine_id)
    pytest.importorskip("vllm", reason="the vllm extra is not installed")
    from dora.engines.vllm.config import VllmEngineConfig
    from dora.engines.vllm.engine import VllmEngine

    config = VllmEngineConfig(kv_cache_gib=0.25, max_model_len=4096, block_size=32)
    return VllmEngine(directory, config, engine_id)


_PAIRS: dict[str, tuple[Any, Any]] = {}


@pytest.fixture(scope="module", autouse=True)
def _close_engines() -> Iterator[None]:
    yield
    for a, b in _PAIRS.values():
        for engine in (a, b):
            if hasattr(engine, "close"):
                engine.close()
    _PAIRS.clear()


@pytest.fixture(params=KINDS)
def pair(request: pytest.FixtureRequest, checkpoint: Path) -> tuple[Any, Any]:
    """Two engines of one kind serving version 0 (started once per module)."""
    kind = request.param
    if kind not in _PAIRS:
        _PAIRS[kind] = (
            _engine(kind, checkpoint, f"{kind}-a"),
            _engine(kind, checkpoint, f"{kind}-b"),
        )
    a, b = _PAIRS[kind]
    for engine in (a, b):
        assert not engine.has_work() and engine.num_requests() == 0
        if engine.version != 0:
            engine.load_weights(0, checkpoint)
    return a, b


def requests(tag: str, n: int = 3, **sampling: Any) -> list[Any]:
    return [
        make_request(
            f"{tag}{i}", text=f"What is {i} + {sum(map(ord, tag))}? Answer:", seed=i, **sampling
        )
        for i in range(n)
    ]


def reference(checkpoint: Path, reqs: list[Any], weights: Any = None) -> dict[str, Trajectory]:
    """What the built-in engine generates for ``reqs``, each request alone."""
    out = {}
    for r in reqs:
        engine = TorchEngine.from_pretrained(checkpoint, EngineConfig(num_blocks=512), "ref")
        if weights is not None:
            engine.load_weights(r.version, weights)
        engine.add_request(r)
        out.update(run_all(engine))
    return out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tokens_equal_the_built_in_engine_alone_or_batched(
    pair: tuple[Any, Any], checkpoint: Path, temperature: float
) -> None:
    engine, _ = pair
    reqs = requests("t", 4, temperature=temperature, max_tokens=40)
    for r in reqs:
        engine.add_request(r)
    got = run_all(engine)
    want = reference(checkpoint, reqs)
    for r in reqs:
        a, b = got[r.request_id], want[r.request_id]
        assert a.completion_token_ids[:32] == b.completion_token_ids[:32], r.request_id
        # fp32 on both sides; the logprob is of the distribution sampled from (T=0: raw)
        assert a.logprobs[:32] == pytest.approx(b.logprobs[:32], abs=1e-3)
        assert a.logprobs_exact and a.reprefilled_tokens == 0


def test_filtered_sampling_keeps_the_tokens_and_says_when_logprobs_are_raw(
    pair: tuple[Any, Any], checkpoint: Path
) -> None:
    """Temperature 0.7 with top-k and top-p: the same tokens as the built-in engine. Where the
    engine reports raw logprobs instead of the filtered distribution's (vLLM), the trajectory
    says so."""
    engine, _ = pair
    reqs = requests("p", 3, temperature=0.7, top_k=5, top_p=0.9, max_tokens=40)
    for r in reqs:
        engine.add_request(r)
    got = run_all(engine)
    want = reference(checkpoint, reqs)
    for r in reqs:
        a, b = got[r.request_id], want[r.request_id]
        assert a.completion_token_ids == b.completion_token_ids
        assert a.logprobs_exact == isinstance(engine, TorchEngine)
        if a.logprobs_exact:
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-3)


def test_a_prompt_longer_than_one_forward_is_prefilled_in_chunks(
    pair: tuple[Any, Any], checkpoint: Path
) -> None:
    engine, _ = pair
    prompt = tuple((i * 7919) % 60 + 8 for i in range(2500))  # > 2,048 tokens per forward
    reqs = [
        make_request(f"long{i}", prompt_token_ids=prompt, temperature=1.0, seed=i, max_tokens=16)
        for i in range(2)
    ]
    for r in reqs:
        engine.add_request(r)
    got = run_all(engine)
    want = reference(checkpoint, reqs)
    for r in reqs:
        assert got[r.request_id].completion_token_ids == want[r.request_id].completion_token_ids


def test_weights_load_in_place_and_not_over_another_versions_request(
    pair: tuple[Any, Any], checkpoint: Path
) -> None:
    engine, _ = pair
    model, _tok = build_model("tiny", seed=7, num_hidden_layers=2)  # other weights, same shape
    new = {k: v.detach().clone() for k, v in model.state_dict().items()}
    held = requests("h", 1, max_tokens=400)[0]
    engine.add_request(held)
    engine.step()
    with pytest.raises(VersionMismatch):
        engine.load_weights(1, new)
    engine.abort(held.request_id)
    assert engine.num_requests() == 0
    engine.load_weights(1, new)
    assert engine.version == 1
    reqs = [r.model_copy(update={"version": 1}) for r in requests("w", 3, max_tokens=24)]
    with pytest.raises(VersionMismatch):
        engine.add_request(reqs[0].model_copy(update={"version": 0}))
    for r in reqs:
        engine.add_request(r)
    got = run_all(engine)
    want = reference(checkpoint, reqs, weights=new)
    old = reference(checkpoint, [r.model_copy(update={"version": 0}) for r in reqs])
    for r in reqs:
        assert got[r.request_id].completion_token_ids == want[r.request_id].completion_token_ids
    assert any(
        got[r.request_id].completion_token_ids != old[r.request_id].completion_token_ids
        for r in reqs
    ), "the new weights changed nothing"


def _migrate_after(source: Any, target: Any, request: Any, steps: int) -> bytes:
    source.add_request(request)
    for _ in range(steps):
        source.step()
    return source.export_request(request.request_id)


def test_a_migrated_request_continues_with_its_kv_and_the_same_tokens(
    pair: tuple[Any, Any],
) -> None:
    a, b = pair
    request = requests("m", 1, temperature=1.0, max_tokens=160)[0]
    a.add_request(request)
    alone = run_all(a)[request.request_id]

    moved = request.model_copy(update={"request_id": "m-moved"})
    snapshot = _migrate_after(a, b, moved, 8)
    header, _ = decode_snapshot(snapshot)
    context = len(header.request.prompt_token_ids) + len(header.completion_token_ids)
    assert header.num_cached_tokens == context - 1  # all but the last sampled token
    assert b.import_request(snapshot) == "m-moved"
    a.release_exported("m-moved")
    assert a.num_requests() == 0
    out = run_all(b)["m-moved"]
    assert out.completion_token_ids == alone.completion_token_ids
    assert out.logprobs == pytest.approx(alone.logprobs, abs=1e-4)
    assert out.reprefilled_tokens == 0
    assert [(m.source, m.target) for m in out.migrations] == [(a.engine_id, b.engine_id)]
    assert out.engines == (a.engine_id, b.engine_id)


def test_the_target_uses_the_snapshots_kv(pair: tuple[Any, Any]) -> None:
    """Zeroed KV (a valid snapshot otherwise) changes what the target samples: the KV the
    connector supplies is what the target attends to, not a recomputation."""
    a, b = pair
    request = requests("z", 1, temperature=0.0, max_tokens=120)[0]
    a.add_request(request)
    alone = run_all(a)[request.request_id]
    snapshot = _migrate_after(a, b, request.model_copy(update={"request_id": "z-moved"}), 8)
    a.release_exported("z-moved")
    header, payload = decode_snapshot(snapshot)
    zeroed = encode_snapshot(header, bytes(len(payload)))
    b.import_request(zeroed)
    out = run_all(b)["z-moved"]
    n = len(header.completion_token_ids)
    assert out.completion_token_ids[:n] == alone.completion_token_ids[:n]
    assert out.completion_token_ids != alone.completion_token_ids
    assert out.reprefilled_tokens == 0


def test_a_snapshot_without_its_kv_is_re_prefilled_and_counted(pair: tuple[Any, Any]) -> None:
    """The fallback (the KV could not be handed over): the target computes the context again
    and the trajectory says how many tokens that was."""
    a, b = pair
    request = requests("f", 1, temperature=1.0, max_tokens=120)[0]
    a.add_request(request)
    alone = run_all(a)[request.request_id]
    snapshot = _migrate_after(a, b, request.model_copy(update={"request_id": "f-moved"}), 8)
    a.release_exported("f-moved")
    header, _ = decode_snapshot(snapshot)
    had = header.num_cached_tokens
    bare = header.model_copy(update={"num_cached_tokens": 0, "num_blocks": 0, "kv_shape": ()})
    b.import_request(encode_snapshot(bare, b""))
    out = run_all(b)["f-moved"]
    assert out.completion_token_ids == alone.completion_token_ids
    assert out.reprefilled_tokens == had > 0


def test_a_failed_migration_resumes_on_the_source(pair: tuple[Any, Any]) -> None:
    a, _ = pair
    request = requests("r", 1, temperature=1.0, max_tokens=120)[0]
    a.add_request(request)
    alone = run_all(a)[request.request_id]
    moved = request.model_copy(update={"request_id": "r-moved"})
    a.add_request(moved)
    for _ in range(8):
        a.step()
    a.export_request("r-moved")
    with pytest.raises(EngineError):
        a.export_request("r-moved")
    a.restore_exported("r-moved")
    out = run_all(a)["r-moved"]
    assert out.completion_token_ids == alone.completion_token_ids
    assert out.reprefilled_tokens == 0 and out.migrations == ()


def test_snapshots_of_another_kind_or_version_are_refused(
    pair: tuple[Any, Any], checkpoint: Path
) -> None:
    a, b = pair
    other = TorchEngine.from_pretrained(checkpoint, EngineConfig(num_blocks=512), "other")
    kind_of_a = "dora" if isinstance(a, TorchEngine) else "vllm"
    request = requests("k", 1, max_tokens=200)[0]
    snapshot = _migrate_after(a, b, request, 4)
    a.restore_exported(request.request_id)
    a.abort(request.request_id)
    if kind_of_a == "vllm":
        with pytest.raises(SnapshotError, match="layout"):
            other.import_request(snapshot)
        other.add_request(request)
        other.step()
        with pytest.raises(SnapshotError, match="layout"):
            b.import_request(other.export_request(request.request_id))
    header, payload = decode_snapshot(snapshot)
    stale = header.model_copy(
        update={"version": 3, "request": header.request.model_copy(update={"version": 3})}
    )
    with pytest.raises(VersionMismatch):
        b.import_request(encode_snapshot(stale, bytes(payload)))
    assert b.num_requests() == 0


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_vllm_without_its_kv_connector_re_prefills_and_counts(checkpoint: Path) -> None:
    """The connector is off (``kv_connector: false``, as on a vLLM build without KV
    connectors): an export carries the tokens only and the target re-prefills them, counted."""
    pytest.importorskip("vllm", reason="the vllm extra is not installed")
    from dora.engines.vllm.config import VllmEngineConfig
    from dora.engines.vllm.engine import VllmEngine

    config = VllmEngineConfig(
        kv_cache_gib=0.25, max_model_len=4096, block_size=32, kv_connector=False
    )
    a = VllmEngine(checkpoint, config, "plain-a")
    b = VllmEngine(checkpoint, config, "plain-b")
    try:
        request = requests("nokv", 1, temperature=1.0, max_tokens=120)[0]
        a.add_request(request)
        alone = run_all(a)[request.request_id]
        snapshot = _migrate_after(a, b, request.model_copy(update={"request_id": "n-moved"}), 8)
        header, payload = decode_snapshot(snapshot)
        assert header.num_cached_tokens == 0 and payload.nbytes == 0
        b.import_request(snapshot)
        a.release_exported("n-moved")
        out = run_all(b)["n-moved"]
        context = len(header.request.prompt_token_ids) + len(header.completion_token_ids)
        assert out.completion_token_ids == alone.completion_token_ids
        assert out.reprefilled_tokens == context - 1
    finally:
        a.close()
        b.close()
