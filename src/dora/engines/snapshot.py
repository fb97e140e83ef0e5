"""Bytes format of an exported request: a ``KVSnapshot`` JSON header, then raw KV bytes.

Layout: ``MAGIC`` (8 bytes), header length (uint64 little-endian), header JSON, payload.
The header carries the payload's length and sha256, so truncation and corruption are caught
before a single byte reaches the KV tensor.
"""

from __future__ import annotations

import hashlib
import struct
import time
from dataclasses import dataclass

import torch
from pydantic import ValidationError
from torch import Tensor

from dora.engines.base import SnapshotError
from dora.events import KVSnapshot, Migration

MAGIC = b"DORAKV01"
_LEN = struct.Struct("<Q")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (the header's spelling)."""
    for name, value in _DTYPES.items():
        if value == dtype:
            return name
    raise SnapshotError(f"unsupported KV dtype {dtype}")


def tensor_bytes(kv: Tensor) -> bytes:
    """Raw bytes of a tensor (any dtype, copied to CPU)."""
    return kv.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def encode_snapshot(header: KVSnapshot, payload: bytes) -> bytes:
    """Header (with payload length and sha256 filled in) + payload, as one bytes object."""
    header = header.model_copy(
        update={"kv_bytes": len(payload), "kv_sha256": hashlib.sha256(payload).hexdigest()}
    )
    head = header.model_dump_json().encode()
    return b"".join((MAGIC, _LEN.pack(len(head)), head, payload))


def read_header(data: bytes) -> KVSnapshot:
    """The header alone (request, version, sizes), without hashing the payload (cheap)."""
    return _parse(data)[0]


def decode_snapshot(data: bytes) -> tuple[KVSnapshot, memoryview]:
    """Parse and verify snapshot bytes; raise SnapshotError saying what is wrong."""
    header, payload = _parse(data)
    if hashlib.sha256(payload).hexdigest() != header.kv_sha256:
        raise SnapshotError("snapshot KV payload is corrupt (sha256 mismatch)")
    return header, payload


def _parse(data: bytes) -> tuple[KVSnapshot, memoryview]:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise SnapshotError(f"snapshot must be bytes, got {type(data).__name__}")
    view = memoryview(data)
    prefix = len(MAGIC) + _LEN.size
    if len(view) < prefix:
        raise SnapshotError(f"snapshot truncated: {len(view)} bytes, header needs {prefix}")
    if bytes(view[: len(MAGIC)]) != MAGIC:
        raise SnapshotError("not a dora KV snapshot (bad magic bytes)")
    (head_len,) = _LEN.unpack(view[len(MAGIC) : prefix])
    if prefix + head_len > len(view):
        raise SnapshotError(
            f"snapshot truncated: header of {head_len} bytes, only {len(view) - prefix} present"
        )
    try:
        header = KVSnapshot.model_validate_json(bytes(view[prefix : prefix + head_len]))
    except ValidationError as exc:
        raise SnapshotError(f"snapshot header is invalid: {exc}") from exc
    payload = view[prefix + head_len :]
    if len(payload) != header.kv_bytes:
        raise SnapshotError(
            f"snapshot truncated or padded: KV payload has {len(payload)} bytes, "
            f"header says {header.kv_bytes}"
        )
    return header, payload


def payload_tensor(header: KVSnapshot, payload: memoryview) -> Tensor:
    """The KV tensor ``[layers, 2, blocks, block_size, kv_heads, head_dim]`` of a payload."""
    if header.dtype not in _DTYPES:
        raise SnapshotError(f"snapshot dtype {header.dtype!r} is not one of {sorted(_DTYPES)}")
    dtype = _DTYPES[header.dtype]
    shape = (
        header.num_layers,
        2,
        header.num_blocks,
        header.block_size,
        header.num_kv_heads,
        header.head_dim,
    )
    expected = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if expected != len(payload):
        raise SnapshotError(f"KV payload has {len(payload)} bytes, shape {shape} needs {expected}")
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return raw.view(dtype).view(shape)


def snapshot_tokens(h: KVSnapshot, vocab: int) -> tuple[list[int], list[int]]:
    """The prompt and completion a snapshot carries, checked: a prompt, a logprob per
    completion token, every id in the model's vocabulary."""
    from dora.engines.admission import check_ids

    rid = h.request.request_id
    prompt = list(h.request.prompt_token_ids)
    completion = list(h.completion_token_ids)
    if not prompt or len(h.logprobs) != len(completion):
        raise SnapshotError(f"snapshot of {rid}: empty prompt or logprobs/tokens length differ")
    check_ids("prompt_token_ids", prompt, vocab)
    check_ids("completion_token_ids", completion, vocab)
    return prompt, completion


@dataclass(frozen=True)
class Arrival:
    """What an imported request carries on with on its new engine."""

    versions: list[int]  # the policy version of each completion token
    track_versions: bool  # it resumed tokens of another version (partial rollout)
    engines: list[str]  # engines that decoded it, the new one last
    migrations: list[Migration]  # with this move's record when it moved


def arrival(h: KVSnapshot, engine_id: str, kv_bytes: int, moved: bool = True) -> Arrival:
    """The bookkeeping of a snapshot arriving on ``engine_id`` (``moved``: a migration, not
    a failed one restored on its source)."""
    req = h.request
    completion = len(h.completion_token_ids)
    resume = req.resume
    n_resumed = len(resume.token_ids) if resume else 0
    versions = list(resume.token_versions) if resume and resume.token_versions else []
    versions = (versions or [req.version] * n_resumed) + [h.version] * (completion - n_resumed)
    engines = list(h.engines)
    source = engines[-1] if engines else "unknown"
    if not engines or engines[-1] != engine_id:
        engines.append(engine_id)
    migrations = list(h.migrations)
    if moved:
        migrations.append(
            Migration(
                source=source,
                target=engine_id,
                at_token=completion,
                kv_bytes=kv_bytes,
                seconds=max(0.0, time.time() - h.created_at),
            )
        )
    return Arrival(versions, n_resumed > 0, engines, migrations)
