"""Snapshot bytes: round trip, and clear refusals of corrupt, truncated or foreign snapshots."""

from __future__ import annotations

import pytest
import torch

from dora.engines.base import CapacityError, EngineError, SnapshotError, VersionMismatch
from dora.engines.snapshot import decode_snapshot, encode_snapshot, payload_tensor, tensor_bytes
from dora.events import KVSnapshot
from tests.unit.test_engine_support import make_engine, make_request, run_all


def _header(kv: torch.Tensor) -> KVSnapshot:
    return KVSnapshot(
        request=make_request("r"),
        version=0,
        model_fingerprint="f",
        dtype="float32",
        block_size=kv.shape[3],
        num_layers=kv.shape[0],
        num_kv_heads=kv.shape[4],
        head_dim=kv.shape[5],
        num_blocks=kv.shape[2],
        num_cached_tokens=5,
        kv_bytes=0,
    )


def test_round_trip_is_bit_exact() -> None:
    kv = torch.randn(2, 2, 3, 4, 2, 8)
    data = encode_snapshot(_header(kv), tensor_bytes(kv))
    header, payload = decode_snapshot(data)
    assert header.kv_bytes == kv.numel() * 4 and len(header.kv_sha256) == 64
    assert torch.equal(payload_tensor(header, payload), kv)


@pytest.mark.parametrize(
    ("mangle", "message"),
    [
        (lambda d: d[:-10], "truncated"),
        (lambda d: d[:12], "truncated"),
        (lambda d: d[:40], "truncated"),
        (lambda d: d[:-1] + bytes([d[-1] ^ 1]), "corrupt"),
        (lambda d: b"XXXXXXXX" + d[8:], "magic"),
        (lambda d: d + b"\0", "padded"),
    ],
)
def test_bad_bytes_are_refused(mangle, message) -> None:  # type: ignore[no-untyped-def]
    kv = torch.randn(1, 2, 1, 4, 1, 2)
    data = encode_snapshot(_header(kv), tensor_bytes(kv))
    with pytest.raises(SnapshotError, match=message):
        decode_snapshot(mangle(data))


def _exported(engine_id: str = "a", **config: object) -> tuple[bytes, object]:
    src = make_engine(engine_id, **config)
    src.add_request(make_request("m", max_tokens=30))
    for _ in range(4):
        src.step()
    return src.export_request("m"), src


def test_engine_refuses_foreign_snapshots_and_keeps_serving() -> None:
    data, _ = _exported()
    target = make_engine("b")
    target.add_request(make_request("other", max_tokens=5))
    target.step()
    used = target.blocks.num_used
    with pytest.raises(SnapshotError, match="corrupt"):
        target.import_request(data[:-1] + bytes([data[-1] ^ 0xFF]))
    with pytest.raises(SnapshotError, match="truncated"):
        target.import_request(data[: len(data) // 2])
    with pytest.raises(SnapshotError, match="block_size"):
        make_engine("c", block_size=8).import_request(data)
    with pytest.raises(VersionMismatch, match="version 0"):
        make_engine("d", version=1).import_request(data)
    with pytest.raises(SnapshotError, match="another model"):
        from dora.engines.torch import EngineConfig, TorchEngine

        TorchEngine.from_preset(
            "tiny", config=EngineConfig(num_blocks=64), engine_id="e", num_hidden_layers=3
        ).import_request(data)
    with pytest.raises(CapacityError, match="free"):
        make_engine("f", num_blocks=1).import_request(data)
    assert target.blocks.num_used == used > 0  # nothing leaked by the refusals
    assert set(run_all(target)) == {"other"}
    target.import_request(data)
    with pytest.raises(EngineError, match="already"):
        target.import_request(data)
    assert run_all(target)["m"].engines == ("a", "b")


def test_restore_exported_resumes_intact() -> None:
    data, src = _exported()
    src.restore_exported("m")  # type: ignore[attr-defined]
    ref = make_engine("x")
    ref.add_request(make_request("m", max_tokens=30))
    assert run_all(src)["m"].completion_token_ids == run_all(ref)["m"].completion_token_ids  # type: ignore[arg-type]
    assert len(data) > 0


def test_release_exported_frees_blocks() -> None:
    _, src = _exported()
    assert src.num_requests() == 1 and not src.has_work()  # type: ignore[attr-defined]
    src.release_exported("m")  # type: ignore[attr-defined]
    assert src.num_requests() == 0 and src.blocks.num_used == 0  # type: ignore[attr-defined]


def test_read_header_is_cheap_and_checks_framing() -> None:
    from dora.engines.snapshot import read_header

    kv = torch.randn(1, 2, 1, 4, 1, 2)
    data = encode_snapshot(_header(kv), tensor_bytes(kv))
    assert read_header(data).request.request_id == "r"
    with pytest.raises(SnapshotError, match="truncated"):
        read_header(data[:-3])
