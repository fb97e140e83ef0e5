"""The engine's inference-only forward: fused weights, optional prepacked linears, fused ops.

Why: ``LlamaModel.forward_tokens`` is the training model's code path (module calls, separate
q/k/v and gate/up projections, RMSNorm and RoPE as chains of small torch ops). For decoding
on CPU those per-op costs are a large part of a step on the small presets. This forward
computes the same function from the same parameters with

- one q|k|v and one gate|up projection per layer (weights concatenated once),
- the linears' weights optionally packed for the engine's AVX2 matmul (``linear="avx2"``,
  ``gemm_kernel``) or prepacked for oneDNN (``linear="mkldnn"``), each when it runs here and
  matches ``F.linear`` on a probe,
- RMSNorm (with the residual add), RoPE and SiLU-gate as single compiled row-wise ops
  (``cpu_ops``).

The packed copies are derived state: they are rebuilt whenever a parameter of the model
changes (``load_weights`` writes parameters in place, which bumps their version counters;
every call compares them), so they never serve stale weights. Training (``dora.models``) is
untouched. fp32 on CPU only; anything else uses the model's own forward.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import structlog
import torch
import torch.nn.functional as F
from torch import Tensor

from dora.engines.torch import cpu_ops, gemm_kernel
from dora.models import LlamaModel
from dora.models.layers import AttentionBackend

log = structlog.get_logger(__name__)

LINEARS = ("torch", "mkldnn", "avx2")


@dataclass
class _Linear:
    """A weight ``[out, in]`` (and bias) ready for the chosen matmul."""

    weight: Tensor  # plain, contiguous
    bias: Tensor | None
    packed: Tensor | None = None  # oneDNN-packed copy of weight
    panels: Tensor | None = None  # the same weight packed for gemm_kernel
    gemm: gemm_kernel.GemmOps | None = None

    def __call__(self, x: Tensor) -> Tensor:
        if self.panels is not None:
            assert self.gemm is not None
            return self.gemm.linear(x, self.panels, self.weight.shape[0], self.bias)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


@dataclass
class _Layer:
    norm_in: Tensor
    qkv: _Linear
    o: _Linear
    norm_post: Tensor
    gate_up: _Linear
    down: _Linear


def supported(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> bool:
    """True when the fast forward can run here (fp32 on CPU, fused ops built)."""
    return (
        torch.device(device).type == "cpu" and dtype == torch.float32 and cpu_ops.load() is not None
    )


def best_linear() -> str:
    """The fastest matmul that runs here and matches ``F.linear``: the AVX2 kernel, then
    oneDNN, then torch."""
    if gemm_kernel.works():
        return "avx2"
    return "mkldnn" if mkldnn_linear_works() else "torch"


@functools.cache
def mkldnn_linear_works() -> bool:
    """True when oneDNN's packed linear runs here and matches ``F.linear`` on a probe (probed
    once per process, not once per engine)."""
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(48, 32, generator=gen)
        x = torch.randn(5, 32, generator=gen)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return bool(torch.allclose(got, F.linear(x, w), atol=1e-4))
    except Exception as exc:  # op missing, no oneDNN in this build
        log.info("mkldnn_linear_unavailable", error=f"{type(exc).__name__}: {exc}"[:200])
        return False


class FastForward:
    """``forward_tokens`` of a ``LlamaModel`` on fused (and maybe packed) weights."""

    def __init__(self, model: LlamaModel, linear: str = "torch", pack_batch: int = 64) -> None:
        if linear not in LINEARS:
            raise ValueError(f"linear must be one of {LINEARS}, got {linear!r}")
        ops = cpu_ops.load()
        if ops is None:
            raise RuntimeError("fast forward needs the compiled cpu_ops")
        self.ops = ops
        self.gemm = gemm_kernel.load() if linear == "avx2" else None
        if linear == "avx2" and self.gemm is None:
            raise RuntimeError("linear='avx2' needs the compiled gemm_kernel (AVX2 + FMA)")
        self.model = model
        self.linear = linear
        self.pack_batch = pack_batch
        self.repacks = 0
        self._params: list[Tensor] = []
        self._key: tuple[int, ...] = ()
        self._layers: list[_Layer] = []
        self.sync(force=True)

    def _weights_key(self) -> tuple[int, ...]:
        return tuple(p._version for p in self._params)

    def _make(self, weight: Tensor, bias: Tensor | None) -> _Linear:
        w = weight.detach().contiguous()
        b = None if bias is None else bias.detach().contiguous()
        if self.gemm is not None:
            return _Linear(w, b, panels=self.gemm.pack(w), gemm=self.gemm)
        packed = None
        if self.linear == "mkldnn":
            packed = torch.ops.mkldnn._reorder_linear_weight(w, self.pack_batch)
        return _Linear(w, b, packed)

    def sync(self, force: bool = False) -> bool:
        """Rebuild the fused/packed weights if any parameter changed (an in-place write bumps
        its version counter) or ``force``; True when rebuilt."""
        if not force and self._weights_key() == self._key:
            return False
        self._params = list(self.model.parameters())
        with torch.no_grad():
            layers = []
            for layer in self.model.model.layers:
                att, mlp = layer.self_attn, layer.mlp
                qkv_b = None
                if att.q_proj.bias is not None:
                    qkv_b = torch.cat([att.q_proj.bias, att.k_proj.bias, att.v_proj.bias])
                layers.append(
                    _Layer(
                        norm_in=layer.input_layernorm.weight.detach().contiguous(),
                        qkv=self._make(
                            torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight]),
                            qkv_b,
                        ),
                        o=self._make(att.o_proj.weight, att.o_proj.bias),
                        norm_post=layer.post_attention_layernorm.weight.detach().contiguous(),
                        gate_up=self._make(
                            torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), None
                        ),
                        down=self._make(mlp.down_proj.weight, None),
                    )
                )
            self._layers = layers
            self._head = self._make(self.model.lm_head.weight, None)
            self._norm = self.model.model.norm.weight.detach().contiguous()
        self._key = self._weights_key()
        self.repacks += 1
        return True

    def __call__(
        self,
        input_ids: Tensor,
        positions: Tensor,
        backend: AttentionBackend,
        logits_indices: Tensor | None = None,
    ) -> Tensor:
        """Logits of the rows in ``logits_indices`` (all rows when None), like
        ``LlamaModel.forward_tokens``."""
        self.sync()
        cfg = self.model.config
        ops = self.ops
        eps = cfg.rms_norm_eps
        h, kvh, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        n = input_ids.shape[0]
        rot = self.model.rotary
        pos = positions.contiguous()
        x = F.embedding(input_ids, self.model.model.embed_tokens.weight)
        delta: Tensor | None = None
        for i, layer in enumerate(self._layers):
            if delta is None:
                hn = ops.rms_norm(x, layer.norm_in, eps)
            else:
                hn = ops.add_rms_norm(x, delta, layer.norm_in, eps)
            qkv = layer.qkv(hn)
            ops.rope_(qkv, rot.cos, rot.sin, pos, h + kvh)
            q = qkv[:, : h * d].view(n, h, d)
            k = qkv[:, h * d : (h + kvh) * d].view(n, kvh, d)
            v = qkv[:, (h + kvh) * d :].view(n, kvh, d)
            att = backend(i, q, k, v).reshape(n, h * d)
            hn = ops.add_rms_norm(x, layer.o(att), layer.norm_post, eps)
            delta = layer.down(ops.silu_mul(layer.gate_up(hn)))
        assert delta is not None
        x = x + delta
        if logits_indices is not None:
            x = x.index_select(0, logits_indices)
        return self._head(ops.rms_norm(x, self._norm, eps))
