"""A CPU paged decode-attention kernel that reads K/V straight from the block-indexed cache.

Why: with one query token per sequence, attention is bound by reading the context's K/V.
The pure-torch path first gathers every sequence's blocks into a padded copy
(``index_select``) and then runs ``scaled_dot_product_attention`` over it: the KV bytes are
moved three times and padded contexts cost extra. This kernel walks each sequence's block
table and reads every K/V row once, with no padding, so decode attention costs about a third.
Its value pass runs from cache (this sequence's V rows are prefetched during its key pass),
so meanwhile it prefetches the next sequence's keys: memory works while the core computes.
``write_kv`` stores a step's new K/V rows with one memcpy per token (``index_copy_`` copies
a non-contiguous q|k|v view element by element).

It is compiled on first use with ``torch.utils.cpp_extension.load_inline`` (needs a C++
compiler and ``ninja``; the build is cached under ``~/.cache/torch_extensions``). When it
cannot be built, or ``DORA_PAGED_KERNEL=0`` is set, ``load()`` returns None and the engine
uses the torch path. Each sequence is computed on its own with a fixed reduction
order, so a sequence's output does not depend on the rest of the batch.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog
import torch
from torch import Tensor

from dora.engines.torch.cpp_build import load_extension

log = structlog.get_logger(__name__)

_SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// GCC/clang vector extensions: 8 floats, lowered to whatever SIMD the machine has.
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

inline v8 ld(const float* p) {
  v8 r;
  std::memcpy(&r, p, sizeof(r));
  return r;
}
inline void st(float* p, v8 v) { std::memcpy(p, &v, sizeof(v)); }
inline float hsum(v8 v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

// exp of 8 floats <= 0 (Cephes polynomial, ~1.2e-7 relative error; exactly 0 below -87).
inline v8 exp8(v8 x) {
  const v8i small = x < -87.0f;
  const v8 floor_ = v8{} - 87.0f;
  const v8 xc = (v8)(((v8i)x & ~small) | ((v8i)floor_ & small));
  const v8 n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  const v8 r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;
  v8 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const v8 y = p * r * r + r + 1.0f;
  const v8i bits = (__builtin_convertvector(n, v8i) + 127) << 23;
  return (v8)((v8i)(y * (v8)bits) & ~small);
}

// Walks the key rows (the part some heads read) of a sequence's context one cache line per
// step(), so that memory fetches the next sequence's keys while this one is computed from cache.
struct LinePrefetcher {
  const float* kp = nullptr;
  const int32_t* row = nullptr;
  int64_t L = 0, bs = 1, W = 0, first = 0, width = 0;
  int64_t t = 0, j = 0, r = 0, c = 0;  // next row (block j, row r of it), float offset
  void step() {
    if (t >= L) return;
    __builtin_prefetch(kp + (int64_t(row[j]) * bs + r) * W + first + c);
    c += 16;
    if (c >= width) {
      c = 0;
      ++t;
      if (++r == bs) {
        r = 0;
        ++j;
      }
    }
  }
};

// Both kernels read/write the caches as contiguous float32 [blocks, block_size, KVH, D].
void check_caches(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.scalar_type() == at::kFloat &&
                  k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.scalar_type() == at::kFloat && v_cache.is_contiguous(),
              "k_cache/v_cache must be contiguous float32 [blocks, block_size, KVH, D]");
}

// Attention of one sequence's query heads [q0, q1) (whole groups of kv heads) over its L
// context tokens (K/V rows read from the blocks of `row`). scores: H * Lp floats of scratch,
// Lp = L rounded up to 8. A head's result depends only on this sequence, not on [q0, q1).
void attend_one(const float* qb, const float* kp, const float* vp, const int32_t* row,
                int64_t L, int64_t H, int64_t KVH, int64_t D, int64_t bs, float scale,
                float* scores, float* ob, int64_t q0, int64_t q1, LinePrefetcher& next_keys) {
  const int64_t G = H / KVH, W = KVH * D, nb = (L + bs - 1) / bs, Lp = (L + 7) / 8 * 8;
  for (int64_t hq = q0; hq < q1; ++hq) {
    for (int64_t l = L; l < Lp; ++l) scores[hq * Lp + l] = -1e30f;  // exp -> 0
  }
  // While row t's scores are computed, the next block's key row t and this block's value
  // row t are prefetched, so the value pass below reads from cache (the parts these heads
  // read; keys of the first blocks usually arrived during the previous sequence).
  const int64_t first = (q0 / G) * D, width = (q1 - q0) / G * D;
  for (int64_t j = 0; j < nb; ++j) {  // scores = q . k
    const float* kb = kp + int64_t(row[j]) * bs * W;
    const float* vrows = vp + int64_t(row[j]) * bs * W + first;
    const float* next = j + 1 < nb ? kp + int64_t(row[j + 1]) * bs * W : nullptr;
    const int64_t rows = std::min(bs, L - j * bs);
    for (int64_t t = 0; t < rows; ++t) {
      if (next != nullptr) {
        for (int64_t c = 0; c < width; c += 16) __builtin_prefetch(next + t * W + first + c);
      }
      for (int64_t c = 0; c < width; c += 16) __builtin_prefetch(vrows + t * W + c);
      const float* kr = kb + t * W;
      float* st_ = scores + j * bs + t;
      for (int64_t hk = q0 / G; hk < q1 / G; ++hk) {  // no division in this loop
        const float* kh = kr + hk * D;
        for (int64_t hq = hk * G; hq < (hk + 1) * G; ++hq) {
          const float* qh = qb + hq * D;
          v8 a = ld(qh) * ld(kh), b = ld(qh + 8) * ld(kh + 8);
          for (int64_t d = 16; d < D; d += 16) {
            a += ld(qh + d) * ld(kh + d);
            b += ld(qh + d + 8) * ld(kh + d + 8);
          }
          st_[hq * Lp] = hsum(a + b) * scale;
        }
      }
    }
  }
  for (int64_t hq = q0; hq < q1; ++hq) {  // softmax
    float* s = scores + hq * Lp;
    v8 m = ld(s);
    for (int64_t l = 8; l < Lp; l += 8) {
      const v8 x = ld(s + l);
      m = x > m ? x : m;
    }
    float mx = m[0];
    for (int k = 1; k < 8; ++k) mx = m[k] > mx ? m[k] : mx;
    v8 acc = {};
    for (int64_t l = 0; l < Lp; l += 8) {
      const v8 e = exp8(ld(s + l) - mx);
      st(s + l, e);
      acc += e;
    }
    const v8 inv = v8{} + 1.0f / hsum(acc);
    for (int64_t l = 0; l < Lp; l += 8) st(s + l, ld(s + l) * inv);
  }
  for (int64_t hq = q0; hq < q1; ++hq) {  // out = p . v, 32 floats of the head at a time
    const float* s = scores + hq * Lp;
    const int64_t off = (hq / G) * D;
    for (int64_t c = 0; c < D; c += 32) {
      v8 a0 = {}, a1 = {}, a2 = {}, a3 = {};
      for (int64_t j = 0; j < nb; ++j) {
        const float* vb = vp + int64_t(row[j]) * bs * W + off + c;
        const float* next = j + 1 < nb ? vp + int64_t(row[j + 1]) * bs * W + off + c : nullptr;
        const float* sj = s + j * bs;
        const int64_t rows = std::min(bs, L - j * bs);
        for (int64_t t = 0; t < rows; ++t) {
          if (next != nullptr) __builtin_prefetch(next + t * W);
          next_keys.step();  // the value pass runs from cache: fetch the next sequence's keys
          const float p = sj[t];
          const float* v = vb + t * W;
          a0 += p * ld(v);
          a1 += p * ld(v + 8);
          a2 += p * ld(v + 16);
          a3 += p * ld(v + 24);
        }
      }
      float* o = ob + hq * D + c;
      st(o, a0);
      st(o + 8, a1);
      st(o + 16, a2);
      st(o + 24, a3);
    }
  }
}

// q [B, H, D]; k_cache, v_cache [num_blocks, block_size, KVH, D]; block_table [B, max_blocks]
// (int32); ctx_lens [B] (int32, >= 1). Query heads h*G .. h*G+G-1 share kv head h.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_table,
                            const at::Tensor& ctx_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(),
              "q must be a contiguous float32 [B, H, D] tensor");
  check_caches(k_cache, v_cache);
  TORCH_CHECK(block_table.dim() == 2 && block_table.scalar_type() == at::kInt &&
                  block_table.is_contiguous() && block_table.size(0) == q.size(0),
              "block_table must be a contiguous int32 [B, max_blocks] tensor");
  TORCH_CHECK(ctx_lens.dim() == 1 && ctx_lens.scalar_type() == at::kInt &&
                  ctx_lens.is_contiguous() && ctx_lens.size(0) == q.size(0),
              "ctx_lens must be a contiguous int32 [B] tensor");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), KVH = k_cache.size(2);
  const int64_t num_blocks = k_cache.size(0), MB = block_table.size(1);
  TORCH_CHECK(k_cache.size(3) == D && D % 32 == 0 && H % KVH == 0,
              "head_dim must match and be a multiple of 32; heads a multiple of kv heads");
  auto out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int32_t* lens = ctx_lens.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  int64_t longest = 1;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= MB * bs, "ctx_lens out of range for block_table");
    for (int64_t j = 0; j < (lens[b] + bs - 1) / bs; ++j) {
      TORCH_CHECK(bt[b * MB + j] >= 0 && bt[b * MB + j] < num_blocks, "block id out of range");
    }
    longest = std::max<int64_t>(longest, lens[b]);
  }
  const float sc = static_cast<float>(scale);
  // Work items: whole sequences (each K/V row read once, contiguously), or (sequence, kv
  // head) when there are too few sequences to keep every thread busy (the long tail).
  // Threads split items, never a reduction, so the result does not depend on them.
  const int64_t split = B < 2 * at::get_num_threads() ? KVH : 1;
  const int64_t per = H / split;  // query heads per item
  at::parallel_for(0, B * split, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(H * ((longest + 7) / 8 * 8));
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / split, q0 = (i % split) * per;
      LinePrefetcher next_keys;
      if (i + 1 < end) {
        const int64_t nb_ = (i + 1) / split, nq0 = ((i + 1) % split) * per;
        next_keys = LinePrefetcher{kp, bt + nb_ * MB, lens[nb_], bs, KVH * D,
                                   (nq0 / (H / KVH)) * D, per / (H / KVH) * D};
      }
      attend_one(qp + b * H * D, kp, vp, bt + b * MB, lens[b], H, KVH, D, bs, sc,
                 scores.data(), op + b * H * D, q0, q0 + per, next_keys);
    }
  });
  return out;
}

// k_cache[slots[i]] = k[i] (and v): one memcpy per token row. k, v [T, KVH, D] may be views
// into a wider q|k|v row (each token's KVH * D floats contiguous); caches as above.
void write_kv(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slots) {
  check_caches(k_cache, v_cache);
  const int64_t W = k_cache.size(2) * k_cache.size(3), rows = k_cache.size(0) * k_cache.size(1);
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.is_contiguous(),
              "slots must be a contiguous int64 [T] tensor");
  const int64_t T = slots.size(0);
  for (const at::Tensor* t : {&k, &v}) {
    TORCH_CHECK(t->dim() == 3 && t->scalar_type() == at::kFloat && t->size(0) == T &&
                    t->size(1) * t->size(2) == W && t->stride(2) == 1 &&
                    t->stride(1) == t->size(2),
                "k/v must be float32 [T, KVH, D] with each token's row contiguous");
  }
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < T; ++i) {
    TORCH_CHECK(sp[i] >= 0 && sp[i] < rows, "slot out of range of the KV cache");
  }
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t ks = k.stride(0), vs = v.stride(0);
  for (int64_t i = 0; i < T; ++i) {
    std::memcpy(kc + sp[i] * W, kp + i * ks, W * sizeof(float));
    std::memcpy(vc + sp[i] * W, vp + i * vs, W * sizeof(float));
  }
}

}  // namespace

TORCH_LIBRARY(dora_paged, m) {
  m.def("write_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slots) "
        "-> ()");
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
        "Tensor ctx_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(dora_paged, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("write_kv", &write_kv);
}
"""

DecodeAttention = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, float], Tensor]
WriteKV = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], None]


def load() -> DecodeAttention | None:
    """The compiled ``decode_attention`` op, or None when it cannot be built here."""
    return load_extension(
        "dora_paged_attention_v12",
        _SOURCE,
        "DORA_PAGED_KERNEL",
        lambda: torch.ops.dora_paged.decode_attention,
    )


def load_write_kv() -> WriteKV | None:
    """The compiled ``write_kv`` op (built with ``decode_attention``), or None."""
    return None if load() is None else torch.ops.dora_paged.write_kv
