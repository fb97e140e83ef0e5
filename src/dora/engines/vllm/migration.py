"""Export and import on ``VllmEngine``: a running request out of vLLM with its KV blocks (the
dora KV connector hands them over), and a snapshot back into vLLM with its context supplied as
cached KV, so the target computes only the last token. Where the KV cannot come along, the
snapshot carries the tokens only and the target's re-prefill is counted, never hidden."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from dora.engines.base import EngineError, SnapshotError, VersionMismatch
from dora.engines.snapshot import arrival, decode_snapshot, encode_snapshot, snapshot_tokens
from dora.engines.vllm.config import KIND
from dora.engines.vllm.exchange import read_json, write_json
from dora.engines.vllm.held import HeldRequest
from dora.events import KVSnapshot

if TYPE_CHECKING:
    from dora.engines.vllm.engine import VllmEngine

log = structlog.get_logger(__name__)


def export_held(engine: VllmEngine, held: HeldRequest) -> bytes:
    """Abort ``held`` in vLLM with its blocks kept by the connector; its snapshot bytes (the
    KV of every token the front end has received but the last, or none: counted re-prefill)."""
    request_id = held.request.request_id
    wanted = held.context - 1
    vid = held.vllm_id
    if not engine.config.kv_connector:  # tokens only: the target re-prefills (counted)
        engine.llm.abort_request([vid], internal=True)
        return snapshot_bytes(engine, held, b"", (), 0, wanted, "no KV connector")
    write_json(engine.exchange.export_order(vid), {"num_tokens": wanted})
    engine.llm.engine_core.abort_requests([vid])
    # a barrier: the engine core handles its inputs in order, so once this call returns
    # the abort has reached the scheduler (and the connector said whether it took it)
    engine.llm.collective_rpc("dora_ping")
    accepted = read_json(engine.exchange.accepted(vid))
    if accepted is None:  # it finished on its own first: its output is on its way
        engine.exchange.clear(vid)
        raise EngineError(f"request {request_id} finished before it could be exported")
    payload, shape, cached = b"", (), 0
    reason = accepted.get("reason", "")
    meta = wait_for(engine, engine.exchange.kv_meta(vid)) if accepted.get("ok") else None
    if meta is not None:
        payload = engine.exchange.kv_data(vid).read_bytes()
        shape, cached = tuple(meta["shape"]), int(meta["num_tokens"])
    else:  # the tokens go without their KV: the target re-prefills and counts it
        reason = reason or f"no blocks from the worker in {engine.config.export_timeout_s} s"
    engine.llm.output_processor.abort_requests([vid], internal=True)
    engine.exchange.clear(vid)
    return snapshot_bytes(engine, held, payload, shape, cached, wanted, reason)


def snapshot_bytes(
    engine: VllmEngine,
    held: HeldRequest,
    payload: bytes,
    shape: tuple[int, ...],
    cached: int,
    wanted: int,
    reason: str,
) -> bytes:
    """Snapshot bytes of an exported request (its KV, or none: ``cached`` 0)."""
    if not cached:
        engine.counters["fallback_exports"] += 1
        log.warning("export_without_kv", request=held.request.request_id, reason=reason)
    header = KVSnapshot(
        request=held.request,
        version=held.request.version,
        model_fingerprint=engine.model_fingerprint,
        dtype=engine.dtype,
        block_size=engine.block_size,
        num_layers=engine.num_layers,
        num_kv_heads=int(
            engine.model_config.get("num_key_value_heads")
            or engine.model_config["num_attention_heads"]
        ),
        head_dim=int(
            engine.model_config.get("head_dim")
            or engine.model_config["hidden_size"] // engine.model_config["num_attention_heads"]
        ),
        num_blocks=-(-cached // engine.block_size),
        num_cached_tokens=cached,
        completion_token_ids=tuple(held.tokens),
        logprobs=tuple(held.logprobs),
        engines=tuple(held.engines),
        migrations=tuple(held.migrations),
        started_at=held.started_at,
        first_token_at=held.first_token_at,
        kv_bytes=len(payload),
        reprefilled_tokens=held.reprefilled,
        # every token before the last received one had KV here (none if none came yet)
        recompute_tokens=max(held.recompute_mark, wanted if held.seen else 0),
        layout=engine.layout,
        kv_shape=shape,
    )
    held.snapshot = encode_snapshot(header, payload)
    engine.counters["exported"] += 1
    return held.snapshot


def wait_for(engine: VllmEngine, path: Path) -> dict[str, Any] | None:
    """The JSON the worker writes once the blocks are out, or None after the timeout."""
    deadline = time.monotonic() + engine.config.export_timeout_s
    while True:
        data = read_json(path)
        if data is not None or time.monotonic() > deadline:
            return data
        time.sleep(0.0005)


def held_from_snapshot(
    engine: VllmEngine, snapshot: bytes, moved: bool
) -> tuple[HeldRequest, dict[str, Any] | None]:
    """The request a snapshot carries, checked against ``engine``, and the KV its connector
    loads (None: no KV, or no connector: the context is re-prefilled and counted)."""
    h, payload = decode_snapshot(snapshot)
    check_compatible(engine, h)
    req = h.request
    rid = req.request_id
    if rid in engine._held:
        raise EngineError(f"request_id {rid!r} is already in engine {engine.engine_id}")
    prompt, completion = snapshot_tokens(h, int(engine.model_config["vocab_size"]))
    context = len(prompt) + len(completion)
    if h.num_cached_tokens > context - 1:
        raise SnapshotError(
            f"snapshot of {rid}: {h.num_cached_tokens} cached tokens for a context of "
            f"{context} (at most {context - 1})"
        )
    came = arrival(h, engine.engine_id, len(payload), moved=moved)
    held = HeldRequest(
        request=req,
        prompt=prompt,
        tokens=completion,
        logprobs=list(h.logprobs),
        token_versions=came.versions,
        track_versions=came.track_versions,
        engines=came.engines,
        migrations=came.migrations,
        reprefilled=h.reprefilled_tokens,
        recompute_mark=h.recompute_tokens,
        started_at=h.started_at,
        first_token_at=h.first_token_at,
        added_at=time.time(),
    )
    kv = None
    if h.num_cached_tokens and engine.config.kv_connector:  # else re-prefilled, counted
        held.import_file = engine.exchange.root / "import" / f"{uuid.uuid4().hex}.bin"
        held.import_file.write_bytes(payload)
        kv = {
            "path": str(held.import_file),
            "shape": list(h.kv_shape),
            "dtype": h.dtype,
            "num_tokens": h.num_cached_tokens,
        }
    return held, kv


def check_compatible(engine: VllmEngine, h: KVSnapshot) -> None:
    """Refuse a snapshot this engine cannot continue, saying why."""
    rid = h.request.request_id
    if h.layout != engine.layout:
        raise SnapshotError(
            f"snapshot of request {rid} holds KV in the {h.layout!r} layout; engine "
            f"{engine.engine_id} ({KIND}) loads only {engine.layout!r}"
        )
    if engine.version is None or h.version != engine.version:
        raise VersionMismatch(
            f"snapshot of request {rid} is version {h.version}; engine {engine.engine_id} "
            f"serves version {engine.version}"
        )
    if h.request.version != h.version:
        raise SnapshotError(f"snapshot version {h.version} != request version {h.request.version}")
    if h.model_fingerprint != engine.model_fingerprint:
        raise SnapshotError(
            f"snapshot of request {rid} was made for another model or dtype (fingerprint "
            f"{h.model_fingerprint}); this engine is {engine.model_fingerprint}"
        )
    if h.block_size != engine.block_size or h.dtype != engine.dtype:
        raise SnapshotError(
            f"snapshot block_size/dtype {h.block_size}/{h.dtype} != engine "
            f"{engine.block_size}/{engine.dtype}"
        )
    if h.num_cached_tokens:
        expected = [engine.num_layers, *engine.layer_shape]
        expected[1 + engine.block_dim] = h.num_blocks
        if list(h.kv_shape) != expected:
            raise SnapshotError(
                f"snapshot of request {rid}: KV shape {list(h.kv_shape)} != {expected}"
            )
