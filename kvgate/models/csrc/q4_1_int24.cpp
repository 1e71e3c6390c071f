// --weights gguf's decode rows as exact integer products: each block of 32 activations of a row as
// 24-bit fixed point, three signed bytes per value, times the Q4_1 codes with byte dot products.
//
// Why: a float32 FMA multiplies 16 weights, and every Q4_1 code must first become a float (a zero
// extension, a shift and a lookup per 16 codes on AVX-512), so one decode row ran compute-bound at
// ~3.1 cycles per 32 weights on a Zen 4 core (~26 GMAC/s), below what the memory streams. `vpdpbusd`
// adds 4 byte products into each 32-bit lane: 64 products an instruction, with the codes used as
// bytes. Three of them per 64 codes (one per activation digit) and one byte permute per 128 codes
// ran the same row at ~1.35 cycles (~60 GMAC/s, a standalone probe; 1.2x the float loop at 8 rows).
//
// The numbers (every build computes them the same way, so AVX-512, AVX2 and scalar builds agree bit
// for bit; tests/test_q4_1_int24.py):
// - Activations (`digits`): per row and block b, a = max |x_k| (exact) and sc = 2^-s, the power of
//   two with s the largest integer for which a * 2^s <= M = 0x7F7F7F = 8,355,711; q_k =
//   round-half-even(x_k * 2^s) (the product is exact), written as three balanced base-256 digits
//   q = D2 * 65536 + D1 * 256 + D0, each in [-128, 127]. So x_k = sc * q_k to within sc / 2 <= a * 1.2e-7:
//   the block's largest value to 23-24 bits, float32 keeps 24. A block holding a NaN or an inf gets
//   sc = NaN (its row's outputs are NaN, as a float matmul's would be); a block of zeros, or one whose
//   largest value is below 2^-104 (~5e-32), counts as zeros.
// - Per output and block: I_j = sum_k c_k * Dj_k, exact 32-bit integer sums (|I_j| <= 32 * 15 * 128);
//   T = I1 * 256 + I0 (exact, |T| < 2^24, so exact as a float); S = fma(I2, 65536, T): the block's
//   sum_k c_k q_k rounded once; acc = fma(d, S * sc, acc) (S * sc exact), then acc = fma(m, xs_b, acc) with xs_b the
//   block's float sum of x (tile_matmul.cpp's block_sum), blocks in order.
// So y differs from the exact weights times x at float32 rounding, as the float loop it replaced did,
// and a row's numbers depend on that row alone: batching, chunking and drafts never change them.
// Prompt rows keep tile_matmul.cpp's float panels (there the widening is shared by many rows and the
// float FMA is as fast as three byte products).
//
// Q4F tiles (block_pack16 in kvgate/models/block_formats.py: a GGUF's Q4_K and Q4_0 layers) take the same
// loop: their codes are laid out as Q4_1's, and d and m are float32 (bytes 256 and 320, 384 a block)
// where Q4_1's are fp16; d and m enter only the two FMAs per block above (`F32` picks the layout).
//
// Tiles are q4_1_pack16's (kvgate/models/q4_1.py): per block of 32 k, byte 16p + j holds output j's
// codes for k = 2p (low nibble) and 2p + 1 (high); then the 16 outputs' d and m as fp16. A byte
// permute of rows p = 4g..4g+3 gives output j's dword (p = 4g, 4g+1, 4g+2, 4g+3): its low nibbles are
// the codes for k = 8g, 8g+2, 8g+4, 8g+6 and its high nibbles those for 8g+1, 8g+3, 8g+5, 8g+7, which is
// the order `digits` lays the activation bytes in.
#include "q4_1_int24.h"

#include <torch/extension.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KVGATE_I24_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KVGATE_I24_AVX512 1
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define KVGATE_I24_VNNI 1
#endif
#endif
#endif

namespace kvgate_i24 {
namespace {

constexpr int64_t QBLOCK = 32;
constexpr int64_t TILE = 16;
// A tile-block's bytes and where its scales sit: Q4_1's tiles (q4_1_pack16) hold d and m as fp16 at bytes
// 256 and 288 (320 a block); Q4F's (block_pack16: Q4_K, Q4_0) the same codes with d and m as float32 at
// bytes 256 and 320 (384 a block). `F32` picks the second.
template <bool F32>
constexpr int64_t TBYTES = F32 ? 384 : 320;
template <bool F32>
constexpr int64_t MOFF = F32 ? 320 : 288;
constexpr int32_t M24 = 0x7F7F7F;
constexpr int64_t AHEAD = 3;  // blocks ahead a tile is prefetched (tile_matmul.cpp's distance)
constexpr int PF_NEAR = 1, PF_NEXT = 2;  // the prefetch mode's bits (tile_matmul.cpp's switches)

// a tile block into L2: the next group's, tile_matmul.cpp's next-group prefetch under the same switches
template <bool F32>
inline void prefetch_next(const uint8_t* p) {
#if defined(KVGATE_I24_AVX2)
  for (int64_t l = 0; l < TBYTES<F32>; l += 64) _mm_prefetch(reinterpret_cast<const char*>(p + l), _MM_HINT_T1);
#else
  (void)p;
#endif
}

// block b's share (of nb) of a span of the next matrix, into L2
inline void prefetch_span(const uint8_t* p, int64_t bytes, int64_t b, int64_t nb) {
#if defined(KVGATE_I24_AVX2)
  const int64_t lines = (bytes + 63) / 64, l0 = lines * b / nb, l1 = lines * (b + 1) / nb;
  for (int64_t l = l0; l < l1; ++l)  // as asm: GCC may delete a loop of _mm_prefetch as one without effects
    asm volatile("prefetcht1 %0" : : "m"(*reinterpret_cast<const char*>(p + 64 * l)));
#else
  (void)p; (void)bytes; (void)b; (void)nb;
#endif
}

// the k of lane t (0..15) in a group pair's digit bytes: t = 4 (2g + h) + i holds k = 8g + h + 2i
constexpr int lane_k(int t) { return 8 * (t / 8) + (t / 4) % 2 + 2 * (t % 4); }

inline float half_bits(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// output j's d (m: at MOFF) in a tile block, as float32
template <bool F32>
inline float scale_at(const uint8_t* p, int64_t j) {
  if constexpr (F32) {
    float v;
    std::memcpy(&v, p + 4 * j, 4);
    return v;
  } else {
    return half_bits(p + 2 * j);
  }
}

// q's three balanced base-256 digits (q in [-M24, M24])
inline void split(int32_t q, int8_t& d0, int8_t& d1, int8_t& d2) {
  const int32_t a = ((q + 128) & 255) - 128;
  const int32_t r = (q - a) / 256;  // exact
  const int32_t b = ((r + 128) & 255) - 128;
  d0 = static_cast<int8_t>(a);
  d1 = static_cast<int8_t>(b);
  d2 = static_cast<int8_t>((r - b) / 256);
}

void digits_block(const float* x, int8_t* out, float& sc) {  // out: XDW * 4 bytes
#if defined(KVGATE_I24_AVX512)
  const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
  const __m512 a0 = _mm512_abs_ps(x0), a1 = _mm512_abs_ps(x1);
  const __m512 big = _mm512_set1_ps(FLT_MAX);
  const bool finite = (_mm512_cmp_ps_mask(a0, big, _CMP_LE_OQ) & _mm512_cmp_ps_mask(a1, big, _CMP_LE_OQ)) == 0xFFFF;
  float inv = 0.f;
  if (!block_scale(finite ? _mm512_reduce_max_ps(_mm512_max_ps(a0, a1)) : 0.f, finite, sc, inv)) {
    std::memset(out, 0, XDW * 4);
    return;
  }
  const __m512i perm = _mm512_setr_epi32(lane_k(0), lane_k(1), lane_k(2), lane_k(3), lane_k(4), lane_k(5),
                                         lane_k(6), lane_k(7), lane_k(8), lane_k(9), lane_k(10), lane_k(11),
                                         lane_k(12), lane_k(13), lane_k(14), lane_k(15));
  const __m512 vinv = _mm512_set1_ps(inv);
  const __m512i c128 = _mm512_set1_epi32(128), c255 = _mm512_set1_epi32(255);
  for (int half = 0; half < 2; ++half) {
    const __m512 xp = _mm512_permutexvar_ps(perm, half ? x1 : x0);
    // round half to even (MXCSR's default); |q| <= M by the scale's choice, so no clamp
    const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(xp, vinv));
    const __m512i d0 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(q, c128), c255), c128);
    const __m512i r = _mm512_srai_epi32(_mm512_sub_epi32(q, d0), 8);
    const __m512i d1 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(r, c128), c255), c128);
    const __m512i d2 = _mm512_srai_epi32(_mm512_sub_epi32(r, d1), 8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16 * half), _mm512_cvtepi32_epi8(d0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 32 + 16 * half), _mm512_cvtepi32_epi8(d1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 64 + 16 * half), _mm512_cvtepi32_epi8(d2));
  }
#elif defined(KVGATE_I24_AVX2)
  const __m256 sign = _mm256_set1_ps(-0.f), big = _mm256_set1_ps(FLT_MAX);
  __m256 xv[4], amax = _mm256_setzero_ps();
  bool finite = true;
  for (int g = 0; g < 4; ++g) {
    xv[g] = _mm256_loadu_ps(x + 8 * g);
    const __m256 a = _mm256_andnot_ps(sign, xv[g]);
    finite = finite && _mm256_movemask_ps(_mm256_cmp_ps(a, big, _CMP_LE_OQ)) == 0xFF;
    amax = _mm256_max_ps(amax, a);
  }
  float inv = 0.f, am = 0.f;
  if (finite) {
    const __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    const __m128 m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    am = _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)));
  }
  if (!block_scale(am, finite, sc, inv)) {
    std::memset(out, 0, XDW * 4);
    return;
  }
  const __m256i perm = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);  // lane_k within a group of 8
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m256 vinv = _mm256_set1_ps(inv);
  const __m256i c128 = _mm256_set1_epi32(128), c255 = _mm256_set1_epi32(255);
  __m256i dg[3][4];
  for (int g = 0; g < 4; ++g) {
    const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_permutevar8x32_ps(xv[g], perm), vinv));
    dg[0][g] = _mm256_sub_epi32(_mm256_and_si256(_mm256_add_epi32(q, c128), c255), c128);
    const __m256i r = _mm256_srai_epi32(_mm256_sub_epi32(q, dg[0][g]), 8);
    dg[1][g] = _mm256_sub_epi32(_mm256_and_si256(_mm256_add_epi32(r, c128), c255), c128);
    dg[2][g] = _mm256_srai_epi32(_mm256_sub_epi32(r, dg[1][g]), 8);
  }
  for (int j = 0; j < 3; ++j) {  // 32 int32 lanes to bytes in lane order (no value saturates)
    const __m256i p01 = _mm256_packs_epi32(dg[j][0], dg[j][1]), p23 = _mm256_packs_epi32(dg[j][2], dg[j][3]);
    const __m256i b = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * j), b);
  }
#else
  bool finite = true;
  float am = 0.f, inv = 0.f;
  for (int k = 0; k < QBLOCK; ++k) {
    const float a = std::fabs(x[k]);
    finite = finite && a <= FLT_MAX;
    am = std::max(am, a);
  }
  if (!block_scale(am, finite, sc, inv)) {
    std::memset(out, 0, XDW * 4);
    return;
  }
  for (int t = 0; t < QBLOCK; ++t) {
    const int k = lane_k(t % 16) + 16 * (t / 16);
    split(static_cast<int32_t>(std::nearbyint(x[k] * inv)), out[t], out[32 + t], out[64 + t]);
  }
#endif
}

// ---- R rows x NT tiles ----
#if defined(KVGATE_I24_VNNI)
template <bool F32>
inline void prefetch_tile_block(const uint8_t* p) {
  for (int64_t l = 0; l < TBYTES<F32>; l += 64) _mm_prefetch(reinterpret_cast<const char*>(p + l), _MM_HINT_T0);
}

// the 16 outputs' d (at byte 256) or m (at MOFF) of a tile block
template <bool F32>
inline __m512 scales16(const uint8_t* p) {
  if constexpr (F32) return _mm512_loadu_ps(p);
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <bool F32, int R, int NT>
void tiles(const int32_t* xd, const float* sc, const float* xs, int64_t nb, const uint8_t* w, int64_t tstride,
           float* y, int64_t ldy, int pf, const uint8_t* nx, int64_t nx_bytes) {
  constexpr int64_t TB = TBYTES<F32>;
  alignas(64) uint8_t ix[64];
  for (int n = 0; n < 16; ++n)
    for (int q = 0; q < 4; ++q) ix[4 * n + q] = static_cast<uint8_t>(16 * q + n);
  const __m512i idx = _mm512_load_si512(ix);
  const __m512i mask = _mm512_set1_epi8(15);
  __m512 acc[R][NT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    if ((pf & PF_NEAR) && b + AHEAD < nb)
      for (int t = 0; t < NT; ++t) prefetch_tile_block<F32>(w + t * tstride + (b + AHEAD) * TB);
    if (pf & PF_NEXT) {
      if (nx) prefetch_span(nx, nx_bytes, b, nb);
      else for (int t = 0; t < NT; ++t) prefetch_next<F32>(w + (t + NT) * tstride + b * TB);
    }
    __m512i i0[R][NT], i1[R][NT], i2[R][NT];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < NT; ++t) i0[r][t] = i1[r][t] = i2[r][t] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) {
#pragma GCC unroll 4
      for (int t = 0; t < NT; ++t) {
        const __m512i v = _mm512_permutexvar_epi8(
            idx, _mm512_loadu_si512(reinterpret_cast<const void*>(w + t * tstride + b * TB + 64 * g)));
        const __m512i lo = _mm512_and_si512(v, mask), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const int32_t* xb = xd + (r * nb + b) * XDW + 2 * g;
          i0[r][t] = _mm512_dpbusd_epi32(i0[r][t], lo, _mm512_set1_epi32(xb[0]));
          i0[r][t] = _mm512_dpbusd_epi32(i0[r][t], hi, _mm512_set1_epi32(xb[1]));
          i1[r][t] = _mm512_dpbusd_epi32(i1[r][t], lo, _mm512_set1_epi32(xb[8]));
          i1[r][t] = _mm512_dpbusd_epi32(i1[r][t], hi, _mm512_set1_epi32(xb[9]));
          i2[r][t] = _mm512_dpbusd_epi32(i2[r][t], lo, _mm512_set1_epi32(xb[16]));
          i2[r][t] = _mm512_dpbusd_epi32(i2[r][t], hi, _mm512_set1_epi32(xb[17]));
        }
      }
    }
    const __m512 base = _mm512_set1_ps(65536.f);
    for (int t = 0; t < NT; ++t) {
      const uint8_t* wb = w + t * tstride + b * TB;
      const __m512 d = scales16<F32>(wb + 256), m = scales16<F32>(wb + MOFF<F32>);
      for (int r = 0; r < R; ++r) {
        const __m512i T = _mm512_add_epi32(_mm512_slli_epi32(i1[r][t], 8), i0[r][t]);
        const __m512 S = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i2[r][t]), base, _mm512_cvtepi32_ps(T));
        acc[r][t] = _mm512_fmadd_ps(d, _mm512_mul_ps(S, _mm512_set1_ps(sc[r * nb + b])), acc[r][t]);
        acc[r][t] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[r * nb + b]), acc[r][t]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) _mm512_storeu_ps(y + r * ldy + TILE * t, acc[r][t]);
}
constexpr int64_t MAX_GROUP = 8;
inline int group_tiles(int64_t rows) { return rows >= 4 ? 1 : rows >= 2 ? 2 : 4; }
#elif defined(KVGATE_I24_AVX2)
// One tile as two halves of 8 outputs; per block the byte products add up in 16 bits (8 maddubs of at
// most 2 x 15 x 128 each: 30,720, no overflow), then one madd widens them: the same integers.
// outputs 8h .. 8h + 7's d (at byte 256) or m (at MOFF) of a tile block
template <bool F32>
inline __m256 scales8(const uint8_t* p, int h) {
  if constexpr (F32) return _mm256_loadu_ps(reinterpret_cast<const float*>(p) + 8 * h);
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * h)));
}

template <bool F32, int R, int NT>
void tiles(const int32_t* xd, const float* sc, const float* xs, int64_t nb, const uint8_t* w, int64_t tstride,
           float* y, int64_t ldy, int pf, const uint8_t* nx, int64_t nx_bytes) {
  constexpr int64_t TB = TBYTES<F32>;
  static_assert(NT == 1, "the AVX2 kernel runs one tile at a time");
  const __m256i mask = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  const __m256 base = _mm256_set1_ps(65536.f);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb = w + b * TB;
    if ((pf & PF_NEAR) && b + AHEAD < nb)
      for (int64_t l = 0; l < TB; l += 64) _mm_prefetch(reinterpret_cast<const char*>(wb + AHEAD * TB + l), _MM_HINT_T0);
    if (pf & PF_NEXT) {
      if (nx) prefetch_span(nx, nx_bytes, b, nb);
      else prefetch_next<F32>(wb + tstride);
    }
    for (int h = 0; h < 2; ++h) {
      __m256i s[R][3];
      for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = s[r][2] = _mm256_setzero_si256();
      for (int g = 0; g < 4; ++g) {
        const uint8_t* p = wb + 64 * g + 8 * h;
        const __m128i w01 = _mm_unpacklo_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)),
                                              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 16)));
        const __m128i w23 = _mm_unpacklo_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 32)),
                                              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 48)));
        const __m256i v = _mm256_set_m128i(_mm_unpackhi_epi16(w01, w23), _mm_unpacklo_epi16(w01, w23));
        const __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
        for (int r = 0; r < R; ++r) {
          const int32_t* xb = xd + (r * nb + b) * XDW + 2 * g;
          for (int j = 0; j < 3; ++j) {
            s[r][j] = _mm256_add_epi16(s[r][j], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(xb[8 * j])));
            s[r][j] = _mm256_add_epi16(s[r][j], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xb[8 * j + 1])));
          }
        }
      }
      const __m256 d = scales8<F32>(wb + 256, h), m = scales8<F32>(wb + MOFF<F32>, h);
      for (int r = 0; r < R; ++r) {
        const __m256i i0 = _mm256_madd_epi16(s[r][0], ones), i1 = _mm256_madd_epi16(s[r][1], ones);
        const __m256i T = _mm256_add_epi32(_mm256_slli_epi32(i1, 8), i0);
        const __m256 S =
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(s[r][2], ones)), base, _mm256_cvtepi32_ps(T));
        acc[r][h] = _mm256_fmadd_ps(d, _mm256_mul_ps(S, _mm256_set1_ps(sc[r * nb + b])), acc[r][h]);
        acc[r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[r * nb + b]), acc[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(y + r * ldy, acc[r][0]);
    _mm256_storeu_ps(y + r * ldy + 8, acc[r][1]);
  }
}
constexpr int64_t MAX_GROUP = 2;
inline int group_tiles(int64_t) { return 1; }
#else
// Without AVX2: the same integers and the same float operations, one output at a time.
template <bool F32, int R, int NT>
void tiles(const int32_t* xd, const float* sc, const float* xs, int64_t nb, const uint8_t* w, int64_t tstride,
           float* y, int64_t ldy, int, const uint8_t*, int64_t) {
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t)
      for (int64_t j = 0; j < TILE; ++j) {
        float acc = 0.f;
        for (int64_t b = 0; b < nb; ++b) {
          const uint8_t* wb = w + t * tstride + b * TBYTES<F32>;
          const int8_t* xb = reinterpret_cast<const int8_t*>(xd + (r * nb + b) * XDW);
          int32_t I[3] = {0, 0, 0};
          for (int u = 0; u < QBLOCK; ++u) {  // digit byte u holds k = lane_k(u % 16) + 16 (u / 16)
            const int k = lane_k(u % 16) + 16 * (u / 16);
            const uint8_t byte = wb[16 * (k / 2) + j];
            const int32_t c = k % 2 ? byte >> 4 : byte & 15;
            for (int q = 0; q < 3; ++q) I[q] += c * xb[32 * q + u];
          }
          const float S = std::fma(static_cast<float>(I[2]), 65536.f, static_cast<float>(I[1] * 256 + I[0]));
          acc = std::fma(scale_at<F32>(wb + 256, j), S * sc[r * nb + b], acc);
          acc = std::fma(scale_at<F32>(wb + MOFF<F32>, j), xs[r * nb + b], acc);
        }
        y[r * ldy + TILE * t + j] = acc;
      }
}
constexpr int64_t MAX_GROUP = 1;
inline int group_tiles(int64_t) { return 1; }
#endif

template <bool F32, int R>
void group(const int32_t* xd, const float* sc, const float* xs, int64_t nb, const uint8_t* w, int64_t tstride,
           int nt, float* y, int64_t ldy, int pf, const uint8_t* nx, int64_t nxb) {
  switch (nt) {
#if defined(KVGATE_I24_VNNI)
    case 4: tiles<F32, R, 4>(xd, sc, xs, nb, w, tstride, y, ldy, pf, nx, nxb); break;
    case 2: tiles<F32, R, 2>(xd, sc, xs, nb, w, tstride, y, ldy, pf, nx, nxb); break;
#endif
    default: tiles<F32, R, 1>(xd, sc, xs, nb, w, tstride, y, ldy, pf, nx, nxb); break;
  }
}

template <bool F32>
void rows_group(const int32_t* xd, const float* sc, const float* xs, int64_t nb, const uint8_t* w, int64_t tstride,
                int64_t rows, int nt, float* y, int64_t ldy, int pf, const uint8_t* nx = nullptr, int64_t nxb = 0) {
  switch (rows) {
#if defined(KVGATE_I24_VNNI)
    case 8: group<F32, 8>(xd, sc, xs, nb, w, tstride, nt, y, ldy, pf, nx, nxb); break;
    case 4: group<F32, 4>(xd, sc, xs, nb, w, tstride, nt, y, ldy, pf, nx, nxb); break;
#endif
#if defined(KVGATE_I24_AVX2)
    case 2: group<F32, 2>(xd, sc, xs, nb, w, tstride, nt, y, ldy, pf, nx, nxb); break;
#endif
    default: group<F32, 1>(xd, sc, xs, nb, w, tstride, nt, y, ldy, pf, nx, nxb); break;
  }
}

// decode_cols for one scale layout
template <bool F32>
void cols(const int32_t* xd, const float* sc, const float* xs, int64_t M, int64_t N, int64_t nb, const uint8_t* w,
          float* y, int64_t t0, int64_t t1, int pf_one, int pf_more, const uint8_t* nx, int64_t nx_bytes) {
  const int64_t tstride = nb * TBYTES<F32>, full = N / TILE;
  std::vector<float> spare;
  for (int64_t c0 = t0; c0 < t1; c0 += 8) {
    const int64_t c1 = std::min(c0 + 8, t1);
    for (int64_t m = 0; m < M;) {
      const int64_t avail = std::min(M - m, MAX_GROUP);
      int64_t rows = 1;
      while (rows * 2 <= avail) rows *= 2;
      const int pf = rows == 1 ? pf_one : pf_more;
      const int32_t* xdr = xd + m * nb * XDW;
      const float *scr = sc + m * nb, *xsr = xs + m * nb;
      int64_t t = c0;
      const int64_t end = std::min(c1, full);
      for (int nt = group_tiles(rows); nt >= 1; nt /= 2)
        for (; t + nt <= end; t += nt) {
          const bool last = nx && t + nt >= t1 && m + rows >= M;  // this thread's last group: the next matrix's first
          rows_group<F32>(xdr, scr, xsr, nb, w + t * tstride, tstride, rows, nt, y + m * N + t * TILE, N, pf,
                          last ? nx : nullptr, nx_bytes);
        }
      if (t < c1) {  // the last, partial tile (its padding outputs are zero codes and scales)
        spare.resize(static_cast<size_t>(rows * TILE));
        rows_group<F32>(xdr, scr, xsr, nb, w + t * tstride, tstride, rows, 1, spare.data(), TILE, pf);
        for (int64_t r = 0; r < rows; ++r)
          std::copy(spare.data() + r * TILE, spare.data() + r * TILE + (N - t * TILE), y + (m + r) * N + t * TILE);
      }
      m += rows;
    }
  }
}

}  // namespace

// A block's scale, or false (sc set) for a block written as zero digits. The scale is the power of two
// 2^-s with s the largest integer for which a * 2^s <= M, so x_k * 2^s is exact and only its rounding to
// an integer rounds (the largest value keeps 23-24 significant bits), and S * sc is exact.
bool block_scale(float amax, bool finite, float& sc, float& inv) {
  if (!finite) {
    sc = std::numeric_limits<float>::quiet_NaN();
    return false;
  }
  uint32_t bits;
  std::memcpy(&bits, &amax, 4);
  const int32_t e = static_cast<int32_t>(bits >> 23) - 127;  // amax >= 0: no sign bit
  if (e < -104) {  // zero, or below 2^-104 (~5e-32): 2^s would leave float32's normal range
    sc = 0.f;
    return false;
  }
  const uint32_t mant = (bits & 0x7FFFFF) | 0x800000;  // amax = mant * 2^(e - 23)
  const int32_t shift = (mant > 2u * M24 ? 21 : 22) - e;  // amax * 2^shift = mant * 2^(shift + e - 23) <= M
  const uint32_t ib = static_cast<uint32_t>(shift + 127) << 23, sb = static_cast<uint32_t>(127 - shift) << 23;
  std::memcpy(&inv, &ib, 4);
  std::memcpy(&sc, &sb, 4);
  return true;
}

const char* isa() {
#if defined(KVGATE_I24_VNNI)
  return "avx512-vnni";
#elif defined(KVGATE_I24_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

// Blocks [i0, i1) of x (32 values each, rows one after another) as digits and scale; a block's digits are
// its own, so the caller may split the blocks across threads without changing a bit.
void digits(const float* x, int64_t i0, int64_t i1, int32_t* xd, float* sc) {
  for (int64_t i = i0; i < i1; ++i) digits_block(x + i * QBLOCK, reinterpret_cast<int8_t*>(xd + i * XDW), sc[i]);
}

// Decode rows [0, M) against tiles [t0, t1) (see the file's opening and q4_1_int24.h).
void decode_cols(const int32_t* xd, const float* sc, const float* xs, int64_t M, int64_t N, int64_t nb,
                 const uint8_t* w, float* y, int64_t t0, int64_t t1, int pf_one, int pf_more, const uint8_t* nx,
                 int64_t nx_bytes, bool f32_scales) {
  if (f32_scales)
    cols<true>(xd, sc, xs, M, N, nb, w, y, t0, t1, pf_one, pf_more, nx, nx_bytes);
  else
    cols<false>(xd, sc, xs, M, N, nb, w, y, t0, t1, pf_one, pf_more, nx, nx_bytes);
}

}  // namespace kvgate_i24
