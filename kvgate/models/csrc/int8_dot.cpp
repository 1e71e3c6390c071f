// Integer dot products for `--weights gguf-q8act`: Q4_1 weights times activations rounded to 8-bit
// blocks, the arithmetic llama.cpp uses on CPUs (kvgate.models.q4_1_dot8 says what it changes).
//
// - q8_rows(x) -> (codes int8 [M, K], d [M, K/32], s [M, K/32]): each block of 32 activations of a row
//   becomes d * code with d = max|x| / 127 and code = round-to-nearest-even(x * (127 / max|x|)), and
//   s = d * (sum of the block's codes). A row's blocks depend on that row only.
// - q4_1_dot8(x, packed, N) -> y [M, N]: y[r, n] = sum over blocks b, in order, of
//   fma(sum_k q_w q_x, d_w * d_x, .) then fma(m_w, s_x, .), with the integer sum exact. The weights
//   are repacked at load (q4_1_pack8 in Python): a tile of 8 output rows is one stream of 160 bytes
//   per block, 4 x 32 bytes whose byte n * 4 + j holds row n's code for k = 8g + j (low nibble) and
//   k = 8g + 4 + j (high nibble), then the 8 rows' d and the 8 rows' m as fp16 (the file's own
//   values: q4_1_blocks checks they are exact). So one `maddubs` multiplies 8 outputs x 4 k at once
//   (32 products in 8-bit lanes), a block's 16-bit partial sums add up without overflow (at most
//   8 x 2 x 15 x 127), and the per-block scale work is 4 vector ops per 8 outputs, not per output.
// - q8_dot8(x, packed, N): the same for a Q8_0 table (the LM head) in tiles of 8 rows: y[r, n] = sum
//   over blocks, in order, of fma(sum_k w x, d_w * d_x, .) (see the Q8_0 section below).
// Every output lane runs the same float ops in the same order, whatever the number of rows in the
// call or their kind (decode, prompt, draft): a row's result never depends on the rows beside it.
#include "int8_layout.h"

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KVGATE_AVX2 1
#endif

namespace {

using namespace kvgate_int8;  // QB, NT and the tile layouts (int8_layout.h)
constexpr int MR = 4;          // activation rows per register tile

// A block whose max|x| is not finite (a NaN or inf activation) gets d = s = NaN and zero codes, so
// its outputs are NaN, as a float matmul's would be (and the sampler's degenerate-row fallback sees
// them); a block too small for 127 / max|x| to be finite (max|x| < 4e-37) is a block of zeros.
// With AVX2 a block is 4 vectors: the same max, the same products, clamps and ties-to-even rounding
// (`round_ps` to nearest, which is `nearbyint` in the default mode) and the same integer sum, so the
// two builds give the same bits (tests/test_scalar_fallback.py); about 8x faster, which was 7-12% of
// a 256-row prefill matmul.
void quantize_row(const float* x, int64_t K, int8_t* q, float* d, float* s) {
  for (int64_t b = 0; b < K / QB; ++b) {
    const float* xb = x + b * QB;
    float amax = 0.f;
    bool finite = true;
#ifdef KVGATE_AVX2
    const __m256 sign = _mm256_set1_ps(-0.f), inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
    __m256 v[4], m = _mm256_setzero_ps();
    int ok = 0xFF;
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xb + 8 * i);
      const __m256 a = _mm256_andnot_ps(sign, v[i]);
      ok &= _mm256_movemask_ps(_mm256_cmp_ps(a, inf, _CMP_LT_OQ));  // false for inf and NaN
      m = _mm256_max_ps(m, a);
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    finite = ok == 0xFF;
#else
    for (int64_t j = 0; j < QB; ++j) {
      amax = std::max(amax, std::fabs(xb[j]));
      finite = finite && std::isfinite(xb[j]);
    }
#endif
    const float id = 127.f / amax;
    if (!finite || !std::isfinite(id)) {
      std::fill(q + b * QB, q + (b + 1) * QB, int8_t{0});
      d[b] = s[b] = finite ? 0.f : std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    const float db = amax / 127.f;
    int sum = 0;
#ifdef KVGATE_AVX2
    const __m256 vid = _mm256_set1_ps(id), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
    __m256i c[4];
    for (int i = 0; i < 4; ++i) {
      const __m256 t = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(v[i], vid), lo), hi);
      c[i] = _mm256_cvtps_epi32(_mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    // int32 -> int8 keeping the order: the packs interleave 128-bit halves, the permute undoes it
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * QB),
                        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    const __m256i t = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
    __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
    u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0x4E));
    sum = _mm_cvtsi128_si32(_mm_add_epi32(u, _mm_shuffle_epi32(u, 0xB1)));
#else
    for (int64_t j = 0; j < QB; ++j) {
      // the default rounding mode: nearest, ties to even; |x * id| <= 127 (+ an ulp), clamped as a float
      const float c = std::nearbyint(std::clamp(xb[j] * id, -127.f, 127.f));
      q[b * QB + j] = static_cast<int8_t>(c);
      sum += q[b * QB + j];
    }
#endif
    d[b] = db;
    s[b] = db * static_cast<float>(sum);
  }
}

#ifdef KVGATE_AVX2
inline __m256i bcast4(const int8_t* p) {  // the 4 bytes at p in every 32-bit lane (one broadcast load)
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

template <int R>
inline void store_rows(const __m256 acc[], float* y, int64_t ldy, int64_t width) {
  for (int r = 0; r < R; ++r) {
    if (width == NT) {
      _mm256_storeu_ps(y + r * ldy, acc[r]);
    } else {
      alignas(32) float out[NT];
      _mm256_store_ps(out, acc[r]);
      std::copy(out, out + width, y + r * ldy);
    }
  }
}

// R rows of x against one tile of 8 weight rows: per block, the tile's 128 nibble bytes are widened
// once into 8 vectors of codes (4 k per output lane), and each row's 16-bit sums of the 8
// `maddubs` are widened to 32 bits and scaled once. The group loop is not unrolled and the block's
// scales are loaded after it: unrolled, with the scales live across it, GCC 12 spilled the sums and
// accumulators to the stack (157 stack references in the kernel; now 23, outside the loop), and the
// reloads were the hottest instructions. Same arithmetic, same bits; one thread 57-62 -> 78-82 GMAC/s
// at 16 and 256 rows, 16-row q8act decode matmuls 26 -> 14 ms per step.
template <int R>
void tile_rows(const int8_t* xq, const float* xd, const float* xs, int64_t K, const uint8_t* w, float* y,
               int64_t ldy, int64_t width) {
  const int64_t nb = K / QB;
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;  // named: GCC spilled an array of them
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb = w + b * TILE_BLOCK;
    __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
#pragma GCC unroll 1
    for (int g = 0; g < 4; ++g) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * g));
      const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
#define KVGATE_ROW(r, S)                                                                        \
  if constexpr (R > r) {                                                                        \
    const int8_t* xb = xq + r * K + b * QB + 8 * g;                                             \
    S = _mm256_add_epi16(S, _mm256_maddubs_epi16(lo, bcast4(xb)));                               \
    S = _mm256_add_epi16(S, _mm256_maddubs_epi16(hi, bcast4(xb + 4)));                           \
  }
      KVGATE_ROW(0, s0) KVGATE_ROW(1, s1) KVGATE_ROW(2, s2) KVGATE_ROW(3, s3)
#undef KVGATE_ROW
    }
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + NIBBLES)));
    const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + NIBBLES + 16)));
#define KVGATE_SCALE(r, S, A)                                                                           \
  if constexpr (R > r) {                                                                                \
    const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(S, ones));                                  \
    A = _mm256_fmadd_ps(dot, _mm256_mul_ps(dw, _mm256_set1_ps(xd[r * nb + b])), A);                      \
    A = _mm256_fmadd_ps(mw, _mm256_set1_ps(xs[r * nb + b]), A);                                          \
  }
    KVGATE_SCALE(0, s0, a0) KVGATE_SCALE(1, s1, a1) KVGATE_SCALE(2, s2, a2) KVGATE_SCALE(3, s3, a3)
#undef KVGATE_SCALE
  }
  const __m256 acc[MR] = {a0, a1, a2, a3};
  store_rows<R>(acc, y, ldy, width);
}
#else
// Without AVX2: the same integer sums and the same float ops per output, in the same order.
template <int R>
void tile_rows(const int8_t* xq, const float* xd, const float* xs, int64_t K, const uint8_t* w, float* y,
               int64_t ldy, int64_t width) {
  const int64_t nb = K / QB;
  for (int r = 0; r < R; ++r)
    for (int64_t n = 0; n < width; ++n) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* wb = w + b * TILE_BLOCK;
        const int8_t* xb = xq + r * K + b * QB;
        c10::Half dh, mh;
        std::memcpy(&dh, wb + NIBBLES + 2 * n, 2);
        std::memcpy(&mh, wb + NIBBLES + 2 * NT + 2 * n, 2);
        int32_t dot = 0;
        for (int g = 0; g < 4; ++g)
          for (int j = 0; j < 4; ++j) {
            const uint8_t c = wb[32 * g + n * 4 + j];
            dot += int32_t(c & 0x0F) * xb[8 * g + j] + int32_t(c >> 4) * xb[8 * g + 4 + j];
          }
        acc = std::fma(static_cast<float>(dot), static_cast<float>(dh) * xd[r * nb + b], acc);
        acc = std::fma(static_cast<float>(mh), xs[r * nb + b], acc);
      }
      y[r * ldy + n] = acc;
    }
}
#endif

// ---- Q8_0 tables (the LM head): tiles of 8 rows, per block 8 x 32 bytes whose byte n * 4 + j of group g
// is row n's int8 code for k = 4g + j, then the 8 rows' scales as float32 (288 bytes). AVX2 has no
// signed x signed byte product, so each group multiplies |w| by x with w's sign (`sign`), as llama.cpp
// does; a pair of such products fits 16 bits (2 x 127 x 127: q8_blocks never makes a -128 code, and
// even one would fit), so each group is widened to 32 bits.

#ifdef KVGATE_AVX2
template <int R>
void q8_tile_rows(const int8_t* xq, const float* xd, int64_t K, const uint8_t* w, float* y, int64_t ldy,
                  int64_t width) {
  const int64_t nb = K / QB;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb = w + b * Q8_BLOCK;
    __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
#pragma GCC unroll 1
    for (int g = 0; g < 8; ++g) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * g));
      const __m256i mag = _mm256_abs_epi8(v);
#define KVGATE_ROW(r, S)                                                                              \
  if constexpr (R > r) {                                                                              \
    const __m256i xs = _mm256_sign_epi8(bcast4(xq + r * K + b * QB + 4 * g), v);                       \
    S = _mm256_add_epi32(S, _mm256_madd_epi16(_mm256_maddubs_epi16(mag, xs), ones));                   \
  }
      KVGATE_ROW(0, s0) KVGATE_ROW(1, s1) KVGATE_ROW(2, s2) KVGATE_ROW(3, s3)
#undef KVGATE_ROW
    }
    const __m256 dw = _mm256_loadu_ps(reinterpret_cast<const float*>(wb + Q8_CODES));
#define KVGATE_SCALE(r, S, A)                                                                           \
  if constexpr (R > r) {                                                                                \
    A = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S), _mm256_mul_ps(dw, _mm256_set1_ps(xd[r * nb + b])), A);    \
  }
    KVGATE_SCALE(0, s0, a0) KVGATE_SCALE(1, s1, a1) KVGATE_SCALE(2, s2, a2) KVGATE_SCALE(3, s3, a3)
#undef KVGATE_SCALE
  }
  const __m256 acc[MR] = {a0, a1, a2, a3};
  store_rows<R>(acc, y, ldy, width);
}
#else
template <int R>
void q8_tile_rows(const int8_t* xq, const float* xd, int64_t K, const uint8_t* w, float* y, int64_t ldy,
                  int64_t width) {
  const int64_t nb = K / QB;
  for (int r = 0; r < R; ++r)
    for (int64_t n = 0; n < width; ++n) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* wb = w + b * Q8_BLOCK;
        float dw;
        std::memcpy(&dw, wb + Q8_CODES + 4 * n, 4);
        int32_t dot = 0;
        for (int g = 0; g < 8; ++g)
          for (int j = 0; j < 4; ++j)
            dot += int32_t(static_cast<int8_t>(wb[32 * g + n * 4 + j])) * xq[r * K + b * QB + 4 * g + j];
        acc = std::fma(static_cast<float>(dot), dw * xd[r * nb + b], acc);
      }
      y[r * ldy + n] = acc;
    }
}
#endif

void q8_tile_group(int rows, const int8_t* xq, const float* xd, int64_t K, const uint8_t* w, float* y, int64_t ldy,
                   int64_t width) {
  switch (rows) {
    case 4: q8_tile_rows<4>(xq, xd, K, w, y, ldy, width); break;
    case 3: q8_tile_rows<3>(xq, xd, K, w, y, ldy, width); break;
    case 2: q8_tile_rows<2>(xq, xd, K, w, y, ldy, width); break;
    case 1: q8_tile_rows<1>(xq, xd, K, w, y, ldy, width); break;
    default: break;
  }
}

void tile_group(int rows, const int8_t* xq, const float* xd, const float* xs, int64_t K, const uint8_t* w,
                float* y, int64_t ldy, int64_t width) {
  switch (rows) {
    case 4: tile_rows<4>(xq, xd, xs, K, w, y, ldy, width); break;
    case 3: tile_rows<3>(xq, xd, xs, K, w, y, ldy, width); break;
    case 2: tile_rows<2>(xq, xd, xs, K, w, y, ldy, width); break;
    case 1: tile_rows<1>(xq, xd, xs, K, w, y, ldy, width); break;
    default: break;
  }
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> q8_rows(torch::Tensor x) {
  TORCH_CHECK(x.device().is_cpu(), "q8_rows: a CPU tensor only, got ", x.device());
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.size(1) % QB == 0,
              "q8_rows: x must be float32 [rows, K] with K a multiple of 32, got ", x.sizes(), " ", x.dtype());
  const int64_t M = x.size(0), K = x.size(1), nb = K / QB;
  auto xc = x.contiguous();
  auto q = torch::empty({M, K}, x.options().dtype(torch::kInt8));
  auto d = torch::empty({M, nb}, x.options());
  auto s = torch::empty({M, nb}, x.options());
  const float* xp = xc.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float *dp = d.data_ptr<float>(), *sp = s.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) { round_rows(xp, m0, m1, K, qp, dp, sp); });
  return {q, d, s};
}

namespace {

// The shared driver: checks the shapes, rounds x to 8-bit blocks, then runs every (tile, group of up
// to MR rows) through `group(rows, xq, xd, xs, K, tile, y, ldy, width)`. Threads split the tiles.
// With the VNNI kernels enabled (an AVX-512 VNNI build, set_int8_isa) and more than MR rows, `vnni` fills
// y instead; from 5 rows on the pairs win (Zen 4: 16 rows 9.2-9.5 -> 5.4-5.5 ms; the LM head 3.2-3.4 ->
// 1.9 ms). Up to 4 rows it depends on the CPU, so calls of R <= MR rows take the pairs where bit R of
// `small_pairs` is set (set_int8_small_rows; kvgate.models.q8act_rows probes it at load): on Zen 4 one
// row's weights streamed faster through the AVX2 tiles, one stream per thread (SmolLM2's 30 layers
// cold: 1.7-1.9 ms against 2.0 for the pairs, whose two streams per thread the prefetchers follow less
// well), on an AMX Xeon the pairs were faster at 1-4 rows. Both give the same bits, so which one a call
// takes never changes a row's result.
using VnniFn = void (*)(const Rounded&, const uint8_t*, int64_t, int64_t, float*);

// Tiles [t0, t1) of w against every group of up to MR rows of x, through `group`
template <class Group>
void tile_range(Group group, const Rounded& x, const uint8_t* w, int64_t block_bytes, int64_t N, float* y, int64_t t0,
                int64_t t1) {
  const int64_t M = x.M, K = x.K, nb = K / QB;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t width = std::min(NT, N - t * NT);
    for (int64_t r = 0; r < M; r += MR) {
      const int rows = static_cast<int>(std::min<int64_t>(MR, M - r));
      group(rows, x.q + r * K, x.d + r * nb, x.s + r * nb, K, w + t * nb * block_bytes, y + r * N + t * NT, N, width);
    }
  }
}

template <class Group>
torch::Tensor run_tiles(const char* name, torch::Tensor x, torch::Tensor packed, int64_t N, int64_t block_bytes,
                        int64_t grain, Group group, VnniFn vnni) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), name, ": CPU tensors only, got ", x.device(), " and ",
              packed.device());
  TORCH_CHECK(packed.dtype() == torch::kUInt8 && packed.dim() == 3 && packed.size(2) == block_bytes, name,
              ": packed must be uint8 [N/8, K/32, ", block_bytes, "], got ", packed.sizes());
  const int64_t T = packed.size(0), nb = packed.size(1), K = nb * QB, M = x.size(0);
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.size(1) == K, name, ": x must be float32 [rows, ",
              K, "], got ", x.sizes(), " ", x.dtype());
  TORCH_CHECK(N > 0 && N > (T - 1) * NT && N <= T * NT, name, ": N=", N, " does not fit ", T, " tiles of 8");
  auto [xq, xd, xs] = q8_rows(x);
  auto pc = packed.contiguous();
  auto y = torch::empty({M, N}, x.options());
  const int8_t* qp = xq.data_ptr<int8_t>();
  const float *xdp = xd.data_ptr<float>(), *xsp = xs.data_ptr<float>();
  const uint8_t* wp = pc.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  if (kvgate_int8::use_pairs(M)) {
    vnni(Rounded{qp, xdp, xsp, M, K}, wp, T, N, yp);
    return y;
  }
  const Rounded rx{qp, xdp, xsp, M, K};
  at::parallel_for(0, T, grain, [&](int64_t t0, int64_t t1) { tile_range(group, rx, wp, block_bytes, N, yp, t0, t1); });
  return y;
}

}  // namespace

namespace kvgate_int8 {

void round_rows(const float* x, int64_t r0, int64_t r1, int64_t K, int8_t* q, float* d, float* s) {
  const int64_t nb = K / QB;
  for (int64_t r = r0; r < r1; ++r) quantize_row(x + r * K, K, q + r * K, d + r * nb, s + r * nb);
}

unsigned& small_pairs() {
  static unsigned bits = 0;
  return bits;
}

bool use_pairs(int64_t M) { return vnni_enabled() && (M > MR || ((small_pairs() >> M) & 1u)); }

int64_t units(int64_t T, bool pairs) { return pairs ? (T + 1) / 2 : T; }

void run_units(const Rounded& x, const uint8_t* w, int64_t T, int64_t N, float* y, int64_t u0, int64_t u1,
               bool pairs) {
  if (pairs)
    q4_1_dot8_vnni_pairs(x, w, T, N, y, u0, u1);
  else
    tile_range(tile_group, x, w, TILE_BLOCK, N, y, u0, u1);
}

}  // namespace kvgate_int8

torch::Tensor q4_1_dot8(torch::Tensor x, torch::Tensor packed, int64_t N) {
  return run_tiles("q4_1_dot8", x, packed, N, TILE_BLOCK, 4, tile_group, q4_1_dot8_vnni);
}

torch::Tensor q8_dot8(torch::Tensor x, torch::Tensor packed, int64_t N) {
  return run_tiles("q8_dot8", x, packed, N, Q8_BLOCK, 16,
                   [](int rows, const int8_t* xq, const float* xd, const float*, int64_t K, const uint8_t* w, float* y,
                      int64_t ldy, int64_t width) { q8_tile_group(rows, xq, xd, K, w, y, ldy, width); },
                   q8_dot8_vnni);
}

std::string int8_isa() {
#ifdef KVGATE_AVX2
  return kvgate_int8::vnni_enabled() ? "avx512-vnni" : "avx2";
#else
  return "scalar";
#endif
}

int64_t int8_small_rows() { return kvgate_int8::small_pairs(); }

bool int8_uses_pairs(int64_t rows) { return kvgate_int8::use_pairs(rows); }

int64_t set_int8_small_rows(int64_t bits) {
  constexpr int64_t allowed = ((1 << (MR + 1)) - 1) & ~1;  // bits 1..MR: calls of that many rows
  TORCH_CHECK((bits & ~allowed) == 0, "set_int8_small_rows: bit R says whether calls of R rows take the VNNI "
              "pairs, for R = 1..", MR, " (a mask within ", allowed, "); got ", bits);
  TORCH_CHECK(bits == 0 || kvgate_int8::vnni_built(),
              "set_int8_small_rows: this build has no AVX-512 VNNI kernels to take them");
  kvgate_int8::small_pairs() = static_cast<unsigned>(bits);
  return int8_small_rows();
}

std::string set_int8_isa(const std::string& isa) {
  TORCH_CHECK(isa == "auto" || isa == "avx2" || isa == "avx512-vnni",
              "set_int8_isa: 'auto', 'avx2' or 'avx512-vnni', got '", isa, "'");
  TORCH_CHECK(isa != "avx512-vnni" || kvgate_int8::vnni_built(),
              "set_int8_isa: this build has no AVX-512 VNNI kernels (the CPU does not list avx512_vnni, or the "
              "compiler lacks it)");
  kvgate_int8::vnni_enabled() = isa != "avx2" && kvgate_int8::vnni_built();
  return int8_isa();
}
