"""The Llama-architecture causal LM, with parameter names equal to Hugging Face's.

Two entry points share all weights: ``forward`` (a padded or packed batch, for the learner
and for scoring) and ``forward_tokens`` (a flat list of tokens whose attention is delegated
to a backend, used by the paged-KV engine).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dora.models.config import ModelConfig
from dora.models.layers import AttentionBackend, DecoderLayer, RMSNorm, RotaryTable


class _Decoder(nn.Module):
    """Embeddings, blocks and final norm (``model.*`` in HF key names)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class _DenseBackend:
    """Attention over a ``[batch, seq]`` layout with an explicit boolean mask (True = attend)."""

    def __init__(self, mask: Tensor | None) -> None:
        self.mask = mask  # [B, 1, T, T] or None for plain causal

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, T, D]
        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        if self.mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)
        return out.transpose(1, 2)


def _right_padded(attention_mask: Tensor | None) -> bool:
    """Every row is real tokens then padding (or no padding at all)."""
    if attention_mask is None:
        return False
    mask = attention_mask.long()
    return bool((mask.cummin(dim=-1).values == mask).all())


class LlamaModel(nn.Module):
    """Decoder-only LM (RMSNorm, RoPE, GQA, SwiGLU); ``state_dict`` keys match HF Llama."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = _Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryTable(
            config.head_dim, config.max_position_embeddings, config.rope_theta
        )

    # ---------------------------------------------------------------- learner path

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        segment_ids: Tensor | None = None,
    ) -> Tensor:
        """Logits ``[B, T, vocab]`` of a batch.

        ``attention_mask`` (1 = real token) allows left or right padding; positions default to
        the count of real tokens before each one. ``segment_ids`` packs several sequences into
        one row: a token attends only to earlier tokens of its own segment, and positions restart
        at every segment unless ``position_ids`` is given.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        b, t = input_ids.shape
        device = input_ids.device
        if position_ids is None:
            if segment_ids is not None:
                position_ids = _segment_positions(segment_ids)
            elif attention_mask is not None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
            else:
                position_ids = torch.arange(t, device=device).expand(b, t)
        mask = None
        if segment_ids is None and _right_padded(attention_mask):
            # Real tokens never see the padding after them under a causal mask: SDPA's causal
            # kernel instead of a dense [B, T, T] mask (a third less time on 1,000+ tokens).
            attention_mask = None
        if attention_mask is not None or segment_ids is not None:
            causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
            allowed = causal.expand(b, t, t)
            if segment_ids is not None:
                allowed = allowed & (segment_ids[:, :, None] == segment_ids[:, None, :])
            if attention_mask is not None:
                keep = attention_mask.bool()
                allowed = allowed & keep[:, None, :]
                # A padded query row would attend to nothing (NaN): let it see itself.
                allowed = allowed | torch.eye(t, dtype=torch.bool, device=device)
            mask = allowed[:, None]
        self._check_positions(position_ids)
        return self.lm_head(self._run(input_ids, position_ids, _DenseBackend(mask)))

    # ---------------------------------------------------------------- engine path

    def forward_tokens(
        self,
        input_ids: Tensor,
        positions: Tensor,
        backend: AttentionBackend,
        logits_indices: Tensor | None = None,
    ) -> Tensor:
        """Logits of a flat list of tokens ``[N]`` whose attention ``backend`` computes.

        Only the rows in ``logits_indices`` go through the LM head (the last token of each
        sequence when decoding), which saves the head's cost on prefill tokens.
        """
        hidden = self._run(input_ids, positions, backend)
        if logits_indices is not None:
            hidden = hidden.index_select(0, logits_indices)
        return self.lm_head(hidden)

    # ---------------------------------------------------------------- shared

    def _run(self, input_ids: Tensor, positions: Tensor, backend: AttentionBackend) -> Tensor:
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, backend)
        return self.model.norm(x)

    def _check_positions(self, positions: Tensor) -> None:
        if positions.numel() and int(positions.max()) >= self.config.max_position_embeddings:
            raise ValueError(
                f"position {int(positions.max())} exceeds max_position_embeddings "
                f"{self.config.max_position_embeddings}"
            )

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def num_parameters(self) -> int:
        """Unique parameter count (tied weights once)."""
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())


def _segment_positions(segment_ids: Tensor) -> Tensor:
    """Position of each token inside its (contiguous) segment."""
    b, t = segment_ids.shape
    idx = torch.arange(t, device=segment_ids.device).expand(b, t)
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    start_idx = torch.where(starts, idx, torch.zeros_like(idx)).cummax(-1).values
    return idx - start_idx
