// Prompt-chunk attention that reads the paged K/V pool in place (kvgate.models.prefill_attention).
//
// prefill_attention_(out [n, H * D], q [T, H, D], k_pool, v_pool [N, bs, KVH, D], block_table [blocks],
// start, n, ctx, scale, k_scale?, v_scale?): the chunk's queries are q's rows [start, start + n), at positions
// [ctx - n, ctx); query i attends keys [0, ctx - n + i] (causal by position, over a cached prefix or
// earlier chunks too), or with `window` > 0 only the last `window` of them (Gemma 3's sliding layers). float32 q and out; float32, float16 or bfloat16 pools, or int8 ones with a float32
// step s and offset z per (slot, KV head) in k_scale / v_scale, read as code * s + z (one fused multiply-
// add: within an ulp of the PyTorch paths' two roundings). What it replaces: a gather
// of the context's blocks and SDPA's CPU flash kernel, which with is_causal still scores every key of
// its 256-key split (n = 256: as slow as no mask) and repeats K/V per query head.
//
// - **Queries in lanes.** A task is (KV head, a tile of W consecutive query positions, up to 3 query
//   heads of that KV head): its NV <= 3 heads x W positions sit in NV vectors, so the scores of a key
//   are NV vectors (s = sum_d k[d] * qT[d], k[d] broadcast), and the softmax's max, exp and sums, the
//   causal mask and the output's rescaling are all lane-wise: no horizontal sums anywhere. Each key
//   and value is read once for the tile's NV x W queries.
// - **Online softmax over fixed key blocks** of KB = 32: per block, the scores, the block max, the
//   rescale exp(m - m') of the running sums, then the values. Blocks start at multiples of KB from
//   key 0, and a key past a lane's position scores -inf: it adds exp(-inf) = 0 and leaves the max
//   alone, and a block with no key for a lane rescales it by exp(0) = 1 exactly. So a query's output
//   depends on its context only: not on the chunk, the tile or the other lanes (bit for bit).
// - Tasks go heaviest first (the last tiles see the most keys), dynamically over the threads.
// - Built with AVX2 + FMA (8 lanes) or AVX-512 (16 lanes), for head_dim a multiple of the lanes;
//   `prefill_attention_lanes()` is 0 where it is not built, and the caller keeps SDPA.
#include <torch/extension.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <omp.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kv_scales.h"
#include "vec_exp.h"

namespace {

#if defined(KVGATE_AVX2_EXP) && defined(__F16C__)
#define KVGATE_PREFILL 1

#if defined(__AVX512F__)
struct Vec {
  using R = __m512;
  static constexpr int W = 16;
  static R zero() { return _mm512_setzero_ps(); }
  static R set1(float x) { return _mm512_set1_ps(x); }
  static R load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, R v) { _mm512_storeu_ps(p, v); }
  static R fma(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
  static R mul(R a, R b) { return _mm512_mul_ps(a, b); }
  static R add(R a, R b) { return _mm512_add_ps(a, b); }
  static R sub(R a, R b) { return _mm512_sub_ps(a, b); }
  static R max(R a, R b) { return _mm512_max_ps(a, b); }
  static R exp(R x) { return kvgate_vec::exp16(x); }
  static R div(R a, R b) { return _mm512_div_ps(a, b); }
  // s where key <= pos, else -inf
  static R causal(R s, R key, R pos) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(key, pos, _CMP_GT_OQ), s, set1(-INFINITY));
  }
  // s where key > lim, else -inf (a sliding window's lower edge: lim = pos - window)
  static R above(R s, R key, R lim) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(key, lim, _CMP_LE_OQ), s, set1(-INFINITY));
  }
};
#else
struct Vec {
  using R = __m256;
  static constexpr int W = 8;
  static R zero() { return _mm256_setzero_ps(); }
  static R set1(float x) { return _mm256_set1_ps(x); }
  static R load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, R v) { _mm256_storeu_ps(p, v); }
  static R fma(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
  static R mul(R a, R b) { return _mm256_mul_ps(a, b); }
  static R add(R a, R b) { return _mm256_add_ps(a, b); }
  static R sub(R a, R b) { return _mm256_sub_ps(a, b); }
  static R max(R a, R b) { return _mm256_max_ps(a, b); }
  static R exp(R x) { return kvgate_vec::exp8(x); }
  static R div(R a, R b) { return _mm256_div_ps(a, b); }
  static R causal(R s, R key, R pos) {
    return _mm256_blendv_ps(s, set1(-INFINITY), _mm256_cmp_ps(key, pos, _CMP_GT_OQ));
  }
  static R above(R s, R key, R lim) {
    return _mm256_blendv_ps(s, set1(-INFINITY), _mm256_cmp_ps(key, lim, _CMP_LE_OQ));
  }
};
#endif

constexpr int W = Vec::W;
constexpr int64_t KB = 32;  // keys per online-softmax block
// keys (scores) or output columns (values) per register block: 8 x NV <= 24 accumulators need
// AVX-512's 32 registers; plain AVX2 has 16
#if defined(__AVX512F__) || defined(__AVX512VL__)
constexpr int KJ = 8;
#else
constexpr int KJ = 4;
#endif

// One key's D values as float32: float pools are read in place, others widened into `buf`; an int8
// pool's codes under their step and offset sz = {s, z} (c * s + z: kvgate.models.kv_int8).
template <typename T>
inline const float* widen(const T* src, float* buf, int64_t D, const float* sz) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else if constexpr (std::is_same_v<T, int8_t>) {
    const __m256 sv = _mm256_set1_ps(sz[0]), zv = _mm256_set1_ps(sz[1]);
    for (int64_t d = 0; d < D; d += 8) {
      const __m128i c = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + d));
      _mm256_storeu_ps(buf + d, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)), sv, zv));
    }
    return buf;
  } else {
    for (int64_t d = 0; d < D; d += 8) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + d));
      __m256 f;
      if constexpr (std::is_same_v<T, c10::Half>)
        f = _mm256_cvtph_ps(h);
      else
        f = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
      _mm256_storeu_ps(buf + d, f);
    }
    return buf;
  }
}

struct Scratch {
  std::vector<float> qt, ot, st, kv;
};

template <typename T>
struct Chunk {
  const float* q;
  int64_t q_row, q_head;  // q's strides (elements)
  const T *k, *v;
  const int64_t* table;
  float* out;  // [n, H * D]
  int64_t start, n, ctx, H, KVH, D, bs;
  float scale;
  const float *ks, *vs;  // int8 pools: a step and an offset per (slot, KV head); null for float pools
  int64_t window;        // > 0: query at position p attends keys (p - window, p] only (Gemma's sliding layers)

  // key j's KV head kvh: its index among the pool's [slot][KV head] vectors
  int64_t at(int64_t j, int64_t kvh) const { return (table[j / bs] * bs + j % bs) * KVH + kvh; }

  // Tile `tile` (positions [tile W, tile W + W) of the chunk) of query heads [h0, h0 + NV) of KV head kvh.
  template <int NV>
  void run(int64_t kvh, int64_t tile, int64_t h0, Scratch& s) const {
    using R = Vec::R;
    constexpr int L = NV * W;  // lanes of the tile: head v's position i is lane v W + i
    const int64_t q0 = tile * W, valid = std::min<int64_t>(W, n - q0);
    const int64_t first = ctx - n + q0;  // lane i's position: first + min(i, valid - 1)
    const int64_t keys = first + valid;  // the tile's keys [0, keys)
    s.qt.resize(D * L), s.ot.assign(D * L, 0.f), s.st.resize(KB * L), s.kv.resize(2 * KB * D);
    float *qt = s.qt.data(), *ot = s.ot.data(), *st = s.st.data();
    for (int v = 0; v < NV; ++v)
      for (int i = 0; i < W; ++i) {
        const float* src = q + (start + q0 + std::min<int64_t>(i, valid - 1)) * q_row + (h0 + v) * q_head;
        for (int64_t d = 0; d < D; ++d) qt[d * L + v * W + i] = src[d] * scale;
      }
    alignas(64) float lane_pos[W];
    for (int i = 0; i < W; ++i) lane_pos[i] = static_cast<float>(first + std::min<int64_t>(i, valid - 1));
    const R pos = Vec::load(lane_pos);
    // A window: key blocks still start at multiples of KB from key 0 (the first one holding the lowest
    // lane's first key), and a key below a lane's window scores -inf. The running max starts at the
    // lowest finite float, not -inf, so a block with no key for a lane (every score -inf) rescales it by
    // exp(0) = 1 and adds 0: whatever blocks a lane's tile-mates bring, its output is its own.
    const int64_t lo = window > 0 ? std::max<int64_t>(0, first - window + 1) : 0;
    const int64_t below = window > 0 ? first + valid - 1 - window : -1;  // keys <= below: some lane masks them
    const R lim = Vec::sub(pos, Vec::set1(static_cast<float>(window)));
    R m[NV], l[NV];
    for (int v = 0; v < NV; ++v) m[v] = Vec::set1(window > 0 ? -FLT_MAX : -INFINITY), l[v] = Vec::zero();
    const float* kr[KB];
    const float* vr[KB];
    for (int64_t j0 = lo / KB * KB; j0 < keys; j0 += KB) {
      const int64_t kb = std::min(KB, keys - j0);
      for (int64_t jj = 0; jj < kb; ++jj) {
        const int64_t a = at(j0 + jj, kvh);
        kr[jj] = widen(k + a * D, s.kv.data() + jj * D, D, ks ? ks + 2 * a : nullptr);
        vr[jj] = widen(v + a * D, s.kv.data() + (KB + jj) * D, D, vs ? vs + 2 * a : nullptr);
      }
      for (int64_t jj = kb; jj < KB; ++jj) kr[jj] = kr[0];  // a last group's spare keys: never read back
      // scores: st[jj][lanes] = sum_d k_jj[d] * qt[d][lanes], KJ keys at a time
      for (int64_t jj = 0; jj < kb; jj += KJ) {
        R a[KJ][NV];
        for (int u = 0; u < KJ; ++u)
          for (int v = 0; v < NV; ++v) a[u][v] = Vec::zero();
        for (int64_t d = 0; d < D; ++d) {
          R x[NV];
          for (int v = 0; v < NV; ++v) x[v] = Vec::load(qt + d * L + v * W);
          for (int u = 0; u < KJ; ++u) {
            const R kd = Vec::set1(kr[jj + u][d]);
            for (int v = 0; v < NV; ++v) a[u][v] = Vec::fma(kd, x[v], a[u][v]);
          }
        }
        for (int u = 0; u < KJ && jj + u < kb; ++u) {
          const R key_pos = Vec::set1(static_cast<float>(j0 + jj + u));
          for (int v = 0; v < NV; ++v) {
            R sc = a[u][v];
            if (j0 + jj + u > first) sc = Vec::causal(sc, key_pos, pos);
            if (j0 + jj + u <= below) sc = Vec::above(sc, key_pos, lim);
            Vec::store(st + (jj + u) * L + v * W, sc);
          }
        }
      }
      // the block's softmax step, lane-wise: new max, rescale of the running sums, numerators in place
      R corr[NV];
      for (int v = 0; v < NV; ++v) {
        R top = m[v];
        for (int64_t jj = 0; jj < kb; ++jj) top = Vec::max(Vec::load(st + jj * L + v * W), top);
        corr[v] = Vec::exp(Vec::sub(m[v], top));
        R sum = Vec::zero();
        for (int64_t jj = 0; jj < kb; ++jj) {
          const R p = Vec::exp(Vec::sub(Vec::load(st + jj * L + v * W), top));
          Vec::store(st + jj * L + v * W, p);
          sum = Vec::add(sum, p);
        }
        l[v] = Vec::fma(l[v], corr[v], sum);
        m[v] = top;
      }
      // values: ot[d][lanes] = corr * ot[d][lanes] + sum_jj v_jj[d] * p[jj][lanes], KJ columns at a time
      for (int64_t d0 = 0; d0 < D; d0 += KJ) {
        R a[KJ][NV];
        for (int u = 0; u < KJ; ++u)
          for (int v = 0; v < NV; ++v) a[u][v] = Vec::mul(Vec::load(ot + (d0 + u) * L + v * W), corr[v]);
        for (int64_t jj = 0; jj < kb; ++jj) {
          R p[NV];
          for (int v = 0; v < NV; ++v) p[v] = Vec::load(st + jj * L + v * W);
          for (int u = 0; u < KJ; ++u) {
            const R vd = Vec::set1(vr[jj][d0 + u]);
            for (int v = 0; v < NV; ++v) a[u][v] = Vec::fma(vd, p[v], a[u][v]);
          }
        }
        for (int u = 0; u < KJ; ++u)
          for (int v = 0; v < NV; ++v) Vec::store(ot + (d0 + u) * L + v * W, a[u][v]);
      }
    }
    // out = ot / l, transposed back to rows
    for (int v = 0; v < NV; ++v) {
      const R inv = Vec::div(Vec::set1(1.f), l[v]);
      for (int64_t d = 0; d < D; ++d) Vec::store(ot + d * L + v * W, Vec::mul(Vec::load(ot + d * L + v * W), inv));
    }
    for (int64_t i = 0; i < valid; ++i)
      for (int v = 0; v < NV; ++v) {
        float* dst = out + (q0 + i) * H * D + (h0 + v) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = ot[d * L + v * W + i];
      }
  }
};

template <typename T>
void run_chunk(const Chunk<T>& c) {
  const int64_t g = c.H / c.KVH, slices = (g + 2) / 3, tiles = (c.n + W - 1) / W;
  const int64_t tasks = c.KVH * tiles * slices;
#pragma omp parallel
  {
    Scratch s;
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t tile = tiles - 1 - t / (c.KVH * slices);  // the last (heaviest) tiles first
      const int64_t rest = t % (c.KVH * slices), kvh = rest / slices, slice = rest % slices;
      const int64_t h0 = kvh * g + 3 * slice, nv = std::min<int64_t>(3, g - 3 * slice);
      if (nv == 3)
        c.template run<3>(kvh, tile, h0, s);
      else if (nv == 2)
        c.template run<2>(kvh, tile, h0, s);
      else
        c.template run<1>(kvh, tile, h0, s);
    }
  }
}
#endif

}  // namespace

int64_t prefill_attention_lanes() {
#ifdef KVGATE_PREFILL
  return W;
#else
  return 0;
#endif
}

void prefill_attention_(torch::Tensor out, const torch::Tensor& q, const torch::Tensor& k_pool,
                        const torch::Tensor& v_pool, const torch::Tensor& block_table, int64_t start, int64_t n,
                        int64_t ctx, double scale, const c10::optional<torch::Tensor>& k_scale,
                        const c10::optional<torch::Tensor>& v_scale, int64_t window) {
#ifndef KVGATE_PREFILL
  TORCH_CHECK(false, "prefill_attention_: this build has no vector prefill attention (it needs AVX2, FMA and F16C)");
#else
  TORCH_CHECK(q.device().is_cpu() && k_pool.device().is_cpu() && v_pool.device().is_cpu() && out.device().is_cpu(),
              "prefill_attention_ is a CPU kernel");
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 3 && q.stride(2) == 1,
              "prefill_attention_: q must be float32 [tokens, heads, head_dim] with contiguous heads; got ", q.sizes(),
              " ", q.scalar_type());
  TORCH_CHECK(k_pool.dim() == 4 && v_pool.sizes() == k_pool.sizes() && k_pool.is_contiguous() && v_pool.is_contiguous() &&
                  k_pool.scalar_type() == v_pool.scalar_type(),
              "prefill_attention_: the K and V pools must be contiguous [blocks, block_size, kv_heads, head_dim] of "
              "one dtype; got ",
              k_pool.sizes(), " and ", v_pool.sizes());
  const int64_t H = q.size(1), D = q.size(2), N = k_pool.size(0), bs = k_pool.size(1), KVH = k_pool.size(2);
  TORCH_CHECK(k_pool.size(3) == D && KVH > 0 && H % KVH == 0, "prefill_attention_: ", H, " query heads of ", D,
              " over pools of ", KVH, " KV heads of ", k_pool.size(3));
  TORCH_CHECK(D % W == 0, "prefill_attention_: head_dim ", D, " is not a multiple of ", W,
              " (the build's vector lanes); use SDPA");
  TORCH_CHECK(n >= 1 && start >= 0 && start + n <= q.size(0) && ctx >= n, "prefill_attention_: rows [", start, ", ",
              start + n, ") of ", q.size(0), " queries at context ", ctx);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 && out.size(0) == n &&
                  out.size(1) == H * D,
              "prefill_attention_: out must be contiguous float32 [", n, ", ", H * D, "]; got ", out.sizes());
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.dim() == 1 && block_table.is_contiguous() &&
                  block_table.size(0) * bs >= ctx,
              "prefill_attention_: block_table must be contiguous int64 covering ", ctx, " positions in blocks of ", bs);
  const auto scales = int8_pool_scales("prefill_attention_", k_pool, D, k_scale, v_scale);
  float *ks = scales.first, *vs = scales.second;
  const int64_t* table = block_table.data_ptr<int64_t>();
  for (int64_t b = 0; b < (ctx + bs - 1) / bs; ++b)
    TORCH_CHECK(table[b] >= 0 && table[b] < N, "prefill_attention_: block table entry ", b, " is ", table[b],
                ", outside the pool's ", N, " blocks");
  auto go = [&](auto tag) {
    using T = decltype(tag);
    run_chunk(Chunk<T>{q.data_ptr<float>(), q.stride(0), q.stride(1), reinterpret_cast<const T*>(k_pool.data_ptr()),
                       reinterpret_cast<const T*>(v_pool.data_ptr()), table, out.data_ptr<float>(), start, n, ctx, H,
                       KVH, D, bs, static_cast<float>(scale), ks, vs, window});
  };
  if (k_pool.scalar_type() == at::kFloat)
    go(float{});
  else if (k_pool.scalar_type() == at::kHalf)
    go(c10::Half{});
  else if (k_pool.scalar_type() == at::kBFloat16)
    go(c10::BFloat16{});
  else if (k_pool.scalar_type() == at::kChar)
    go(int8_t{});
  else
    TORCH_CHECK(false, "prefill_attention_: pools of float32, float16, bfloat16 or int8, not ", k_pool.scalar_type());
#endif
}
