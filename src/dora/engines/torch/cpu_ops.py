"""Fused row-wise CPU ops of the engine's fast forward: RMSNorm, residual add + RMSNorm, RoPE,
SiLU-gate.

Why: on the tiny model a decode step is dozens of small torch ops per layer (the RMSNorm alone
is a cast, a pow, a mean, an rsqrt and two multiplies, each a dispatch and a pass over the
rows); each op here is one pass in C++. Every op works row by row with a fixed reduction
order, so a token's result does not depend on the other rows of the batch.

Built like ``paged_kernel`` (``load_inline``, cached, ``-march=native`` keyed by the CPU);
``load()`` returns None when it cannot be built or ``DORA_CPU_OPS=0``, and the engine then
runs the model's own forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import structlog
import torch

from dora.engines.torch.cpp_build import load_extension

log = structlog.get_logger(__name__)

_SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
inline v8 ld(const float* p) { v8 r; std::memcpy(&r, p, sizeof(r)); return r; }
inline void st(float* p, v8 v) { std::memcpy(p, &v, sizeof(v)); }
inline float hsum(v8 v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

// exp of 8 floats <= 0 (Cephes polynomial, ~1.2e-7 relative error; 0 below -87).
inline v8 exp8(v8 x) {
  const v8i small = x < -87.0f;
  const v8 floor_ = v8{} - 87.0f;
  const v8 xc = (v8)(((v8i)x & ~small) | ((v8i)floor_ & small));
  const v8 n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
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

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 &&
                  x.size(1) % 8 == 0,
              name, " must be a float32 [N, C] tensor with unit column stride, C % 8 == 0");
}

void norm_row(const float* x, const float* w, float* o, int64_t C, float eps) {
  v8 a = {};
  for (int64_t c = 0; c < C; c += 8) { const v8 v = ld(x + c); a += v * v; }
  const float inv = 1.0f / std::sqrt(hsum(a) / float(C) + eps);
  for (int64_t c = 0; c < C; c += 8) st(o + c, ld(w + c) * (ld(x + c) * inv));
}

// RMSNorm of each row of x [N, C] with weight w [C].
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(w.is_contiguous() && w.numel() == x.size(1), "w must be [C] contiguous");
  const int64_t N = x.size(0), C = x.size(1), sx = x.stride(0);
  auto out = at::empty({N, C}, x.options());
  const float* xp = x.data_ptr<float>(); const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) norm_row(xp + i * sx, wp, op + i * C, C, float(eps));
  });
  return out;
}

// x += d (in place, the residual stream), then RMSNorm of the new x.
at::Tensor add_rms_norm(at::Tensor x, const at::Tensor& d, const at::Tensor& w, double eps) {
  check_rows(x, "x");
  check_rows(d, "d");
  TORCH_CHECK(x.is_contiguous() && d.sizes() == x.sizes(), "x contiguous, d same shape as x");
  TORCH_CHECK(w.is_contiguous() && w.numel() == x.size(1), "w must be [C] contiguous");
  const int64_t N = x.size(0), C = x.size(1), sd = d.stride(0);
  auto out = at::empty({N, C}, x.options());
  float* xp = x.data_ptr<float>(); const float* dp = d.data_ptr<float>();
  const float* wp = w.data_ptr<float>(); float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      float* xr = xp + i * C;
      for (int64_t c = 0; c < C; c += 8) st(xr + c, ld(xr + c) + ld(dp + i * sd + c));
      norm_row(xr, wp, op + i * C, C, float(eps));
    }
  });
  return out;
}

// Rotates (HF rotate-half convention) the first `heads` heads of each row of qkv [N, *]
// in place, with cos/sin tables [max_pos, D] looked up by positions [N] (int64).
void rope_(at::Tensor qkv, const at::Tensor& cos_t, const at::Tensor& sin_t,
           const at::Tensor& positions, int64_t heads) {
  check_rows(qkv, "qkv");
  TORCH_CHECK(cos_t.is_contiguous() && sin_t.sizes() == cos_t.sizes() && sin_t.is_contiguous() &&
                  cos_t.scalar_type() == at::kFloat && sin_t.scalar_type() == at::kFloat,
              "cos/sin must be contiguous float32 [max_pos, D]");
  TORCH_CHECK(positions.is_contiguous() && positions.scalar_type() == at::kLong &&
                  positions.numel() == qkv.size(0), "positions must be int64 [N]");
  const int64_t N = qkv.size(0), D = cos_t.size(1), half = D / 2, sq = qkv.stride(0);
  const int64_t P = cos_t.size(0);
  TORCH_CHECK(half % 8 == 0 && heads * D <= qkv.size(1), "head_dim % 16 == 0, heads fit");
  float* q = qkv.data_ptr<float>(); const int64_t* pos = positions.data_ptr<int64_t>();
  const float* ct = cos_t.data_ptr<float>(); const float* stt = sin_t.data_ptr<float>();
  for (int64_t i = 0; i < N; ++i) TORCH_CHECK(pos[i] >= 0 && pos[i] < P, "position out of range");
  at::parallel_for(0, N, 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float* c = ct + pos[i] * D; const float* s = stt + pos[i] * D;
      for (int64_t h = 0; h < heads; ++h) {
        float* x = q + i * sq + h * D;
        for (int64_t k = 0; k < half; k += 8) {
          const v8 x1 = ld(x + k), x2 = ld(x + half + k);
          st(x + k, x1 * ld(c + k) + (-x2) * ld(s + k));
          st(x + half + k, x2 * ld(c + half + k) + x1 * ld(s + half + k));
        }
      }
    }
  });
}

// gu [N, 2I] = [gate | up] -> silu(gate) * up, [N, I].
at::Tensor silu_mul(const at::Tensor& gu) {
  check_rows(gu, "gu");
  const int64_t N = gu.size(0), I = gu.size(1) / 2, sg = gu.stride(0);
  TORCH_CHECK(I % 8 == 0, "intermediate size must be a multiple of 8");
  auto out = at::empty({N, I}, gu.options());
  const float* gp = gu.data_ptr<float>(); float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float* g = gp + i * sg; const float* u = g + I;
      for (int64_t k = 0; k < I; k += 8) {
        const v8 x = ld(g + k);
        const v8i neg = x < 0.0f;
        const v8 ax = (v8)((v8i)x & 0x7fffffff);  // |x|
        const v8 t = exp8(-ax);                              // e^-|x| in (0, 1]
        const v8 one = v8{} + 1.0f;
        const v8 num = (v8)(((v8i)one & ~neg) | ((v8i)t & neg));
        st(op + i * I + k, x * (num / (one + t)) * ld(u + k));  // x * sigmoid(x) * up
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(dora_cpu_ops, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) x, Tensor d, Tensor w, float eps) -> Tensor");
  m.def("rope_(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor positions, int heads) -> ()");
  m.def("silu_mul(Tensor gu) -> Tensor");
}

TORCH_LIBRARY_IMPL(dora_cpu_ops, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope_", &rope_);
  m.impl("silu_mul", &silu_mul);
}
"""


@dataclass(frozen=True)
class CpuOps:
    """The compiled ops (``torch.ops.dora_cpu_ops``)."""

    rms_norm: Any
    add_rms_norm: Any
    rope_: Any
    silu_mul: Any


def load() -> CpuOps | None:
    """The compiled ops, or None when they cannot be built here."""

    def bind() -> CpuOps:
        ns = torch.ops.dora_cpu_ops
        return CpuOps(ns.rms_norm, ns.add_rms_norm, ns.rope_, ns.silu_mul)

    return load_extension("dora_cpu_ops_v2", _SOURCE, "DORA_CPU_OPS", bind)
