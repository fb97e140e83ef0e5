"""A CPU fp32 matmul for the engine's linears: weights packed once, an AVX2/FMA micro-kernel.

Why: a decode step of the small preset at batch 64 is ~80% linears, and on this class of CPU
(AVX2, one 256-bit FMA per cycle) oneDNN's prepacked linear reaches ~83% of the core's FMA
peak; MKL (``F.linear``) less. This kernel keeps a 6 x 16 tile of the output in registers,
streams the weight in 16-column panels packed at load time (``[k-block][panel][k][16]``, so
the whole weight is read front to back once per call) and prefetches the next panel while the
first rows of the current one are computed; it runs at ~90% of peak on the small preset's
shapes.

Every output element is one chain of FMAs over k in order (k-blocks only store and reload
the partial sum, which is exact), whatever the batch size, tile shape or thread count: a
token's result does not depend on the other rows of the batch.

Built like ``paged_kernel`` (``load_inline``, cached, ``-march=native`` keyed by the CPU).
It needs AVX2 and FMA; elsewhere, or with ``DORA_GEMM_KERNEL=0``, ``load()`` returns None and
the engine uses oneDNN or ``F.linear``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import structlog
import torch
import torch.nn.functional as F

from dora.engines.torch.cpp_build import load_extension

log = structlog.get_logger(__name__)

_SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#if !defined(__AVX2__) || !defined(__FMA__)
#error "dora_gemm needs AVX2 and FMA"
#endif
#include <immintrin.h>

namespace {

constexpr int64_t NR = 16;   // output columns per panel (two 8-float vectors)
constexpr int64_t MR = 6;    // rows per register tile (12 accumulators)
constexpr int64_t KC = 1024;  // k per block: a panel block is 64 KB, it stays in L2
constexpr int64_t MC = 96;  // rows per block: their k-block of x (384 KB) stays in L2

// out[0:R, 0:ncols] (+)= x[0:R, k-block] . panel, R <= MR rows; bias added when given.
template <int R>
inline void tile(const float* x, int64_t ldx, const float* panel, int64_t kc, float* out,
                 int64_t ldo, int64_t ncols, bool accumulate, const float* bias,
                 const float* prefetch) {
  __m256 c0[R], c1[R];
  if (accumulate && ncols == NR) {
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      c0[i] = _mm256_loadu_ps(out + i * ldo);
      c1[i] = _mm256_loadu_ps(out + i * ldo + 8);
    }
  } else if (accumulate) {
    float buf[NR] = {0};
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      std::memcpy(buf, out + i * ldo, ncols * sizeof(float));
      c0[i] = _mm256_loadu_ps(buf);
      c1[i] = _mm256_loadu_ps(buf + 8);
    }
  } else {
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) c0[i] = c1[i] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < kc; ++k) {
    if (prefetch != nullptr) {
      _mm_prefetch(reinterpret_cast<const char*>(prefetch + k * NR), _MM_HINT_T0);
    }
    const __m256 b0 = _mm256_load_ps(panel + k * NR);
    const __m256 b1 = _mm256_load_ps(panel + k * NR + 8);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const __m256 a = _mm256_broadcast_ss(x + i * ldx + k);
      c0[i] = _mm256_fmadd_ps(a, b0, c0[i]);
      c1[i] = _mm256_fmadd_ps(a, b1, c1[i]);
    }
  }
  if (bias != nullptr) {
    float buf[NR] = {0};
    std::memcpy(buf, bias, ncols * sizeof(float));
    const __m256 b0 = _mm256_loadu_ps(buf), b1 = _mm256_loadu_ps(buf + 8);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      c0[i] = _mm256_add_ps(c0[i], b0);
      c1[i] = _mm256_add_ps(c1[i], b1);
    }
  }
  if (ncols == NR) {
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      _mm256_storeu_ps(out + i * ldo, c0[i]);
      _mm256_storeu_ps(out + i * ldo + 8, c1[i]);
    }
  } else {
    float buf[NR];
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      _mm256_storeu_ps(buf, c0[i]);
      _mm256_storeu_ps(buf + 8, c1[i]);
      std::memcpy(out + i * ldo, buf, ncols * sizeof(float));
    }
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t,
                        bool, const float*, const float*);
constexpr TileFn kTiles[MR + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>};

int64_t panels_of(int64_t n) { return (n + NR - 1) / NR; }

// [ceil(K/KC)][panels][kc][16], zero-padded past the last column.
at::Tensor pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat, "pack: fp32 [out, in]");
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), P = panels_of(N);
  at::Tensor packed = at::zeros({P * NR * K}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t kc = std::min(KC, K - k0);
    for (int64_t p = 0; p < P; ++p, dst += kc * NR)
      for (int64_t j = 0; j < NR && p * NR + j < N; ++j)
        for (int64_t k = 0; k < kc; ++k) dst[k * NR + j] = src[(p * NR + j) * K + k0 + k];
  }
  return packed;
}

at::Tensor linear(const at::Tensor& input, const at::Tensor& packed, int64_t N,
                  const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(input.dim() == 2 && input.scalar_type() == at::kFloat, "linear: fp32 [rows, in]");
  const at::Tensor x = input.contiguous();
  const int64_t M = x.size(0), K = x.size(1), P = panels_of(N);
  TORCH_CHECK(packed.numel() == P * NR * K, "linear: packed weight does not match [", N, ", ",
              K, "]");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N && bias->is_contiguous(), "linear: bias of ", N, " floats");
    b = bias->data_ptr<float>();
  }
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  if (K == 0) return b == nullptr ? out.zero_() : out.copy_(bias->view({1, N}).expand({M, N}));
  const float* A = x.data_ptr<float>();
  const float* W = packed.data_ptr<float>();
  float* C = out.data_ptr<float>();
  at::parallel_for(0, P, 4, [&](int64_t p0, int64_t p1) {
    for (int64_t m0 = 0; m0 < M; m0 += MC) {
      const int64_t mc = std::min(MC, M - m0);
      for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kc = std::min(KC, K - k0);
        const float* block = W + k0 * P * NR;  // this k-block of every panel
        const bool last_k = k0 + kc >= K;
        for (int64_t p = p0; p < p1; ++p) {
          const float* panel = block + p * kc * NR;
          const float* next = (p + 1 < P || !last_k) ? panel + kc * NR : nullptr;
          const int64_t ncols = std::min(NR, N - p * NR);
          const float* pb = (b != nullptr && last_k) ? b + p * NR : nullptr;
          for (int64_t m = 0; m < mc; m += MR) {
            const int64_t r = std::min(MR, mc - m);
            kTiles[r](A + (m0 + m) * K + k0, K, panel, kc, C + (m0 + m) * N + p * NR, N, ncols,
                      k0 > 0, pb, m == 0 ? next : nullptr);
          }
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(dora_gemm, m) {
  m.def("pack(Tensor weight) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(dora_gemm, CPU, m) {
  m.impl("pack", &pack);
  m.impl("linear", &linear);
}
"""


@dataclass(frozen=True)
class GemmOps:
    """The compiled ops (``torch.ops.dora_gemm``)."""

    pack: Any
    linear: Any


def load() -> GemmOps | None:
    """The compiled ops, or None when they cannot be built here (no AVX2/FMA, no compiler)."""

    def bind() -> GemmOps:
        ns = torch.ops.dora_gemm
        return GemmOps(ns.pack, ns.linear)

    return load_extension("dora_gemm_v3", _SOURCE, "DORA_GEMM_KERNEL", bind)


@functools.cache
def works() -> bool:
    """True when the kernel builds here and matches ``F.linear`` on a probe with a ragged
    shape (edge rows, a partial panel, several k-blocks, a bias); probed once per process."""
    ops = load()
    if ops is None:
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(37, 300, generator=gen)
        b = torch.randn(37, generator=gen)
        x = torch.randn(13, 300, generator=gen)
        got = ops.linear(x, ops.pack(w), 37, b)
        return bool(torch.allclose(got, F.linear(x, w, b), atol=1e-4))
    except Exception as exc:  # a broken build must not take the engine down
        log.warning("gemm_kernel_probe_failed", error=f"{type(exc).__name__}: {exc}"[:200])
        return False
