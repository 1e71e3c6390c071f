// The small float32 CPU ops between a layer's matmuls, one call each instead of the 5-9 ATen calls
// the PyTorch forward makes (kvgate.models.layer_ops; at one decode row each ATen call costs more
// in dispatch than in arithmetic).
//
// - rms_norm(x, w, eps) -> h and add_rms_norm_(x, y, w, eps) -> h (x += y first, in place): per row,
//   the sum of squares in 8 float32 lanes over the row in order, the lanes added in one fixed tree,
//   then h = (x * (1 / sqrt(mean + eps))) * w with the two roundings F.rms_norm makes. Only the sum's
//   order differs from ATen's (a row's inverse RMS may move by an ulp); it never depends on the
//   other rows in the call.
// - rope_write_kv_(qkv, heads, kv_heads, cos, sin, slots, k_pool, v_pool): rotate-half RoPE on the q
//   and k heads of the fused QKV rows in place, then the new k and v rows copied into the pools at
//   their slots. Each value is round(round(x * cos) + round(-/+x' * sin)), the three roundings of the
//   PyTorch expression `qk * cos + rotate_half(qk) * sin`: bit-identical to it. This file is compiled
//   without FMA contraction for that reason. Float16 or bfloat16 pools (`--kv-dtype`) get each value
//   rounded to nearest even, as `Tensor.to` rounds; int8 pools each head's codes, step and offset
//   (`kvgate_rows::quantize_head`, with k_scale and v_scale).
// - qk_norm_(qkv, heads, kv_heads, q_w, k_w, eps): each q head and each k head of the fused rows RMS-normed
//   in place (Qwen3), by the row norm above: the decode stack calls the same function, so their bits agree.
// - silu_mul(gu) -> act: the MLP's SiLU(gate) * up from the fused [rows, 2 inter] gate_up output, in
//   one pass, 8 columns at a time: with e = exp(-|g|) (never overflowing), SiLU(g) = g / (1 + e) for
//   g >= 0 and g e / (1 + e) below (the same value, stable at both ends). Within a few ulp of
//   F.silu(g) * u; a column's arithmetic depends on its index only, so a row's values never depend on
//   the other rows. The decode stack and the Python loop both call it, so their bits agree. One call
//   instead of ATen's silu, mul and their slices: ~8 us -> ~1 us a layer at one row.
#pragma GCC optimize("fp-contract=off")

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#define KVGATE_AVX2 1
#endif
#include "vec_exp.h"
#include "kv_scales.h"
#include "layer_rows.h"

namespace {

inline float row_sum_squares(const float* x, int64_t n) {
  float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
#ifdef KVGATE_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
  }
  _mm256_storeu_ps(lane, acc);
#else
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) lane[l] += x[i + l] * x[i + l];
#endif
  for (int64_t l = 0; i < n; ++i, ++l) lane[l] += x[i] * x[i];
  return ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
}

void check_rows(const torch::Tensor& x, const torch::Tensor& w, const char* what) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(),
              what, ": x must be a contiguous float32 CPU [rows, hidden] tensor, got ", x.sizes(), " ",
              x.scalar_type());
  TORCH_CHECK(w.scalar_type() == torch::kFloat32 && w.dim() == 1 && w.size(0) == x.size(1) && w.is_contiguous(),
              what, ": the norm weight must be float32 [", x.size(1), "], got ", w.sizes());
}

// Rows a thread takes at least: a prompt chunk's rows split over the threads, a decode step's few stay on
// the caller's (a row's arithmetic is its own either way, so its bits do not depend on the split).
constexpr int64_t ROW_GRAIN = 32;

// x += y in place (when y is given: add_rms_norm_), then h = RMSNorm(x) * w, row by row.
torch::Tensor norm_rows(const torch::Tensor& x, const torch::Tensor& w, double eps, const float* y = nullptr) {
  const int64_t R = x.size(0), n = x.size(1);
  auto h = torch::empty_like(x);
  float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* hp = h.data_ptr<float>();
  at::parallel_for(0, R, ROW_GRAIN, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      if (y != nullptr) kvgate_rows::add(xp + r * n, y + r * n, n);
      kvgate_rows::norm(xp + r * n, wp, n, eps, hp + r * n);
    }
  });
  return h;
}

inline float silu_one(float g) {
  const float e = std::exp(-std::fabs(g));
  return (g >= 0.f ? g : g * e) / (1.f + e);
}

}  // namespace

namespace kvgate_rows {

void norm(const float* x, const float* w, int64_t n, double eps, float* h) {
  const float mean = row_sum_squares(x, n) / static_cast<float>(n);
  const float inv = 1.0f / std::sqrt(mean + static_cast<float>(eps));
  for (int64_t i = 0; i < n; ++i) h[i] = (x[i] * inv) * w[i];
}

void head_norms(float* row, int64_t heads, const float* w, int64_t D, double eps) {
  for (int64_t h = 0; h < heads; ++h) norm(row + h * D, w, D, eps, row + h * D);  // norm reads x[i] before h[i]
}

void add(float* x, const float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] += y[i];
}

void silu_mul(const float* g, int64_t inter, float* a) {
  const float* u = g + inter;
  int64_t i = 0;
#ifdef KVGATE_AVX2_EXP
  const __m256 sign = _mm256_set1_ps(-0.f), one = _mm256_set1_ps(1.f);
  for (; i + 8 <= inter; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    const __m256 e = kvgate_vec::exp8(_mm256_or_ps(x, sign));  // exp(-|x|)
    const __m256 neg = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
    const __m256 num = _mm256_blendv_ps(x, _mm256_mul_ps(x, e), neg);
    _mm256_storeu_ps(a + i, _mm256_mul_ps(_mm256_div_ps(num, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
  }
#endif
  for (; i < inter; ++i) a[i] = silu_one(g[i]) * u[i];
}

void rope(float* row, int64_t heads, const float* c, const float* s, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* x = row + h * D;
    int64_t i = 0;
#ifdef KVGATE_AVX2
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (; i + 8 <= half; i += 8) {  // the scalar loop's products and sum, 8 at a time: the same bits
      const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + half);
      const __m256 lo = _mm256_add_ps(_mm256_mul_ps(a, _mm256_loadu_ps(c + i)),
                                      _mm256_mul_ps(_mm256_xor_ps(b, sign), _mm256_loadu_ps(s + i)));
      const __m256 hi = _mm256_add_ps(_mm256_mul_ps(b, _mm256_loadu_ps(c + i + half)),
                                      _mm256_mul_ps(a, _mm256_loadu_ps(s + i + half)));
      _mm256_storeu_ps(x + i, lo);
      _mm256_storeu_ps(x + i + half, hi);
    }
#endif
    for (; i < half; ++i) {
      const float a = x[i], b = x[i + half];
      const float lo = a * c[i] + (-b) * s[i];
      const float hi = b * c[i + half] + a * s[i + half];
      x[i] = lo;
      x[i + half] = hi;
    }
  }
}

template <typename P>
void write_kv_typed(const float* kv_row, int64_t kv, int64_t slot, P* kp, P* vp) {
  std::copy(kv_row, kv_row + kv, kp + slot * kv);  // converting, rounding to nearest even
  std::copy(kv_row + kv, kv_row + 2 * kv, vp + slot * kv);
}

bool distinct(const int64_t* slots, int64_t n) {
  std::vector<int64_t> sorted(slots, slots + n);
  std::sort(sorted.begin(), sorted.end());
  return std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end();
}

void quantize_head(const float* x, int64_t D, int8_t* codes, float* scale) {
  float lo = x[0], hi = x[0];
  for (int64_t d = 1; d < D && lo == lo; ++d) {
    if (x[d] != x[d]) lo = hi = x[d];  // a NaN makes step and offset NaN, as torch.amin / amax do
    else lo = std::min(lo, x[d]), hi = std::max(hi, x[d]);
  }
  const float s = (hi - lo) / 255.f;
  const float z = lo + 128.f * s;  // two roundings: this file is compiled without FMA contraction
  scale[0] = s, scale[1] = z;
  const bool coded = s > 0.f && std::isfinite(s);  // else every code 0 (NaN or infinite values too)
  for (int64_t d = 0; d < D; ++d)
    codes[d] = coded ? static_cast<int8_t>(std::clamp(std::nearbyint((x[d] - z) / s), -128.f, 127.f)) : int8_t{0};
}

void write_kv(const float* kv_row, int64_t kv, int64_t slot, at::ScalarType pool, void* k_pool, void* v_pool,
              float* k_scale, float* v_scale, int64_t head_dim) {
  if (pool == at::kFloat) {
    write_kv_typed(kv_row, kv, slot, static_cast<float*>(k_pool), static_cast<float*>(v_pool));
  } else if (pool == at::kHalf) {
    write_kv_typed(kv_row, kv, slot, static_cast<at::Half*>(k_pool), static_cast<at::Half*>(v_pool));
  } else if (pool == at::kChar) {
    const int64_t heads = kv / head_dim;
    auto* kc = static_cast<int8_t*>(k_pool) + slot * kv;
    auto* vc = static_cast<int8_t*>(v_pool) + slot * kv;
    for (int64_t h = 0; h < heads; ++h) {
      quantize_head(kv_row + h * head_dim, head_dim, kc + h * head_dim, k_scale + 2 * (slot * heads + h));
      quantize_head(kv_row + kv + h * head_dim, head_dim, vc + h * head_dim, v_scale + 2 * (slot * heads + h));
    }
  } else {
    write_kv_typed(kv_row, kv, slot, static_cast<at::BFloat16*>(k_pool), static_cast<at::BFloat16*>(v_pool));
  }
}

}  // namespace kvgate_rows

torch::Tensor silu_mul(torch::Tensor gu) {
  TORCH_CHECK(gu.device().is_cpu() && gu.scalar_type() == torch::kFloat32 && gu.dim() == 2 && gu.is_contiguous() &&
                  gu.size(1) % 2 == 0,
              "silu_mul: gu must be a contiguous float32 CPU [rows, 2 x intermediate] tensor, got ", gu.sizes(), " ",
              gu.scalar_type());
  const int64_t R = gu.size(0), inter = gu.size(1) / 2;
  auto act = torch::empty({R, inter}, gu.options());
  const float* src = gu.data_ptr<float>();
  float* dst = act.data_ptr<float>();
  at::parallel_for(0, R, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) kvgate_rows::silu_mul(src + r * 2 * inter, inter, dst + r * inter);
  });
  return act;
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check_rows(x, w, "rms_norm");
  return norm_rows(x, w, eps);
}

torch::Tensor add_rms_norm_(torch::Tensor x, torch::Tensor y, torch::Tensor w, double eps) {
  check_rows(x, w, "add_rms_norm_");
  TORCH_CHECK(y.scalar_type() == torch::kFloat32 && y.sizes() == x.sizes() && y.is_contiguous(),
              "add_rms_norm_: y must be a contiguous float32 tensor shaped like x ", x.sizes(), ", got ", y.sizes());
  return norm_rows(x, w, eps, y.data_ptr<float>());
}

void qk_norm_(torch::Tensor qkv, int64_t heads, int64_t kv_heads, torch::Tensor q_w, torch::Tensor k_w, double eps) {
  TORCH_CHECK(qkv.device().is_cpu() && qkv.scalar_type() == torch::kFloat32 && qkv.dim() == 2 && qkv.is_contiguous(),
              "qk_norm_: qkv must be a contiguous float32 CPU [tokens, (heads + 2 kv_heads) * head_dim] tensor");
  const int64_t D = q_w.numel();
  TORCH_CHECK(q_w.scalar_type() == torch::kFloat32 && k_w.scalar_type() == torch::kFloat32 && q_w.dim() == 1 &&
                  k_w.sizes() == q_w.sizes() && q_w.is_contiguous() && k_w.is_contiguous() &&
                  qkv.size(1) == (heads + 2 * kv_heads) * D,
              "qk_norm_: q and k norm weights must be float32 [head_dim] with qkv (", heads, " + 2 x ", kv_heads,
              ") x head_dim wide; got ", q_w.sizes(), ", ", k_w.sizes(), " and ", qkv.sizes());
  float* p = qkv.data_ptr<float>();
  const float *qw = q_w.data_ptr<float>(), *kw = k_w.data_ptr<float>();
  const int64_t width = qkv.size(1);
  at::parallel_for(0, qkv.size(0), ROW_GRAIN, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      kvgate_rows::head_norms(p + r * width, heads, qw, D, eps);
      kvgate_rows::head_norms(p + r * width + heads * D, kv_heads, kw, D, eps);
    }
  });
}

void rope_write_kv_(torch::Tensor qkv, int64_t heads, int64_t kv_heads, torch::Tensor cos, torch::Tensor sin,
                    torch::Tensor slots, torch::Tensor k_pool, torch::Tensor v_pool,
                    const c10::optional<torch::Tensor>& k_scale, const c10::optional<torch::Tensor>& v_scale) {
  TORCH_CHECK(qkv.device().is_cpu() && qkv.scalar_type() == torch::kFloat32 && qkv.dim() == 2 &&
                  qkv.is_contiguous(),
              "rope_write_kv_: qkv must be a contiguous float32 CPU [tokens, (heads + 2 kv_heads) * head_dim] tensor");
  const int64_t T = qkv.size(0);
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == T && cos.sizes() == sin.sizes() && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32,
              "rope_write_kv_: cos and sin must be contiguous float32 [tokens, head_dim]");
  const int64_t D = cos.size(1), width = (heads + 2 * kv_heads) * D;
  TORCH_CHECK(D % 2 == 0 && qkv.size(1) == width, "rope_write_kv_: qkv has ", qkv.size(1), " columns, expected (",
              heads, " + 2 x ", kv_heads, ") x ", D);
  const auto pool_type = k_pool.scalar_type();
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && v_pool.scalar_type() == pool_type &&
                  (pool_type == torch::kFloat32 || pool_type == torch::kFloat16 || pool_type == torch::kBFloat16 ||
                   pool_type == torch::kInt8) &&
                  k_pool.sizes() == v_pool.sizes() && k_pool.numel() % (kv_heads * D) == 0,
              "rope_write_kv_: the pools must be contiguous float32, float16, bfloat16 or int8 tensors (both the "
              "same) of whole [kv_heads, head_dim] slots; got ", k_pool.scalar_type(), " and ", v_pool.scalar_type());
  TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.dim() == 1 && slots.size(0) == T && slots.is_contiguous(),
              "rope_write_kv_: slots must be a contiguous int64 [tokens] tensor");
  const int64_t nslots = k_pool.numel() / (kv_heads * D);
  const auto scales = int8_pool_scales("rope_write_kv_", k_pool, D, k_scale, v_scale);
  float *ks = scales.first, *vs = scales.second;
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < nslots, "rope_write_kv_: slot ", sp[t], " of token ", t, " is outside the pool's ",
                nslots, " slots");
  float* qp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* snp = sin.data_ptr<float>();
  const int64_t kv = kv_heads * D;
  void *kp = k_pool.data_ptr(), *vp = v_pool.data_ptr();
  // Tokens writing one slot (never in the engine's steps) go in order on one thread, the last token's
  // write staying (the decode stack's run_ops promises that): threads would race on the slot. Up to
  // ROW_GRAIN tokens run on one thread anyway, so only a split call looks.
  const bool split = T > ROW_GRAIN && kvgate_rows::distinct(sp, T);
  at::parallel_for(0, T, split ? ROW_GRAIN : T, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      kvgate_rows::rope(qp + t * width, heads + kv_heads, cp + t * D, snp + t * D, D);
      kvgate_rows::write_kv(qp + t * width + heads * D, kv, sp[t], pool_type, kp, vp, ks, vs, D);
    }
  });
}
