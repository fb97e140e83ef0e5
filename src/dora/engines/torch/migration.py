"""Export a sequence with exactly its KV blocks, and import one into fresh blocks.

Export gathers the request's blocks from the engine's KV tensor (one ``index_select``);
import scatters them into newly allocated blocks (one ``index_copy_``) and the request
continues decoding with no prefill. Everything that could make the KV invalid on the target
(version, model, dtype, block size, corrupt bytes) is refused with a clear error.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dora.engines.base import CapacityError, EngineError, SnapshotError, VersionMismatch
from dora.engines.snapshot import (
    arrival,
    decode_snapshot,
    dtype_name,
    encode_snapshot,
    payload_tensor,
    snapshot_tokens,
    tensor_bytes,
)
from dora.engines.torch.sequence import SeqStatus, Sequence
from dora.events import KVSnapshot, Turn

if TYPE_CHECKING:
    from dora.engines.torch.engine import TorchEngine


def export_sequence(engine: TorchEngine, seq: Sequence) -> bytes:
    """Snapshot bytes of ``seq``: header + KV of its computed tokens' blocks."""
    cfg = engine.model.config
    used = engine.blocks.blocks_needed(seq.num_computed)
    blocks = seq.block_table[:used]
    kv = engine.runner.gather_blocks(blocks) if blocks else None
    payload = tensor_bytes(kv) if kv is not None else b""
    header = KVSnapshot(
        request=seq.request,
        version=seq.version,
        model_fingerprint=engine.model_fingerprint,
        dtype=dtype_name(engine.runner.dtype),
        block_size=engine.blocks.block_size,
        num_layers=cfg.num_hidden_layers,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        num_blocks=len(blocks),
        num_cached_tokens=seq.num_computed,
        completion_token_ids=tuple(seq.completion),
        logprobs=tuple(float(x) for x in seq.logprobs),
        engines=tuple(seq.engines),
        migrations=tuple(seq.migrations),
        started_at=seq.started_at,
        first_token_at=seq.first_token_at,
        kv_bytes=len(payload),
        reprefilled_tokens=seq.reprefilled,
        appended=tuple(
            Turn(role=role, start=start, end=end)  # type: ignore[arg-type]
            for start, end, role in seq.appended
        ),
        turn_start=seq.turn_start,
        recompute_tokens=max(seq.recompute_hw, seq.num_computed),  # had KV: honest count
        parked=seq.status is SeqStatus.PARKED,
        parked_at=seq.parked_at if seq.status is SeqStatus.PARKED else 0.0,
    )
    return encode_snapshot(header, payload)


def _check_compatible(engine: TorchEngine, h: KVSnapshot) -> None:
    cfg = engine.model.config
    rid = h.request.request_id
    if h.layout != "dora":
        raise SnapshotError(
            f"snapshot of request {rid} holds KV in the {h.layout!r} layout (another kind of "
            "engine); the built-in engine loads only its own ('dora')"
        )
    if engine.version is None or h.version != engine.version:
        raise VersionMismatch(
            f"snapshot of request {rid} is version {h.version}; engine {engine.engine_id} "
            f"serves version {engine.version}"
        )
    if h.request.version != h.version:
        raise SnapshotError(f"snapshot version {h.version} != request version {h.request.version}")
    mine = dtype_name(engine.runner.dtype)
    if h.dtype != mine:
        raise SnapshotError(f"snapshot KV dtype {h.dtype} != engine dtype {mine}")
    if h.block_size != engine.blocks.block_size:
        raise SnapshotError(
            f"snapshot block_size {h.block_size} != engine block_size {engine.blocks.block_size}"
        )
    geometry = (h.num_layers, h.num_kv_heads, h.head_dim)
    expected = (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
    if geometry != expected or h.model_fingerprint != engine.model_fingerprint:
        raise SnapshotError(
            f"snapshot of request {rid} was made for another model (fingerprint "
            f"{h.model_fingerprint}, layers/kv_heads/head_dim {geometry}); this engine is "
            f"{engine.model_fingerprint} {expected}"
        )


def import_sequence(engine: TorchEngine, data: bytes) -> tuple[Sequence, bool]:
    """A sequence rebuilt from snapshot bytes with its KV scattered into fresh blocks, and
    whether it was parked at a turn boundary (a multi-turn episode waiting for its
    environment: it stays parked here)."""
    h, payload = decode_snapshot(data)
    _check_compatible(engine, h)
    req = h.request
    rid = req.request_id
    if rid in engine._seqs:
        raise EngineError(f"request_id {rid!r} is already in engine {engine.engine_id}")
    prompt, completion = snapshot_tokens(h, engine.model.config.vocab_size)
    total = len(prompt) + len(completion)
    spans = [(t.start, t.end, t.role) for t in h.appended]
    if any(not 0 <= a < b <= len(completion) for a, b, _ in spans) or h.turn_start > len(
        completion
    ):
        raise SnapshotError(f"snapshot of {rid}: episode spans outside its completion")
    if h.num_cached_tokens > total or engine.blocks.blocks_needed(h.num_cached_tokens) != (
        h.num_blocks
    ):
        raise SnapshotError(
            f"snapshot of {rid}: {h.num_cached_tokens} cached tokens do not match "
            f"{h.num_blocks} blocks of {h.block_size} for {total} tokens"
        )
    kv = payload_tensor(h, payload)
    if h.num_blocks > engine.blocks.num_free:
        raise CapacityError(
            f"import of {rid} needs {h.num_blocks} KV blocks, engine {engine.engine_id} has "
            f"{engine.blocks.num_free} free"
        )
    if engine.blocks.blocks_needed(min(total + 1, engine.max_model_len)) > engine.blocks.num_blocks:
        raise CapacityError(f"request {rid} does not fit engine {engine.engine_id} at all")
    blocks = engine.blocks.allocate(h.num_blocks)
    if blocks:
        engine.runner.scatter_blocks(blocks, kv)
    moved = arrival(h, engine.engine_id, len(payload))
    seq = Sequence(
        request=req,
        token_ids=prompt + completion,
        num_prompt=len(prompt),
        version=h.version,
        priority=req.priority,
        logprobs=list(h.logprobs),
        token_versions=moved.versions,
        track_versions=moved.track_versions,
        num_computed=h.num_cached_tokens,
        block_table=blocks,
        recompute_hw=max(h.num_cached_tokens, h.recompute_tokens),
        reprefilled=h.reprefilled_tokens,
        engines=moved.engines,
        migrations=moved.migrations,
        started_at=h.started_at,
        first_token_at=h.first_token_at,
        appended=spans,
        turn_start=h.turn_start,
        parked_at=h.parked_at if h.parked else 0.0,
    )
    return seq, h.parked
