// The --weights gguf-q8act tile kernels for CPUs with AVX-512 VNNI (Zen 4/5, Ice Lake and later Xeons):
// the same results as int8_dot.cpp's AVX2 kernels, bit for bit, in about a third of the instructions.
//
// - `vpdpbusd` adds 4 unsigned x signed byte products into each 32-bit lane, exactly: one instruction
//   where AVX2 needs `maddubs` + a 16-bit add (and a `madd` per block). The integer sums are the same
//   numbers (neither path overflows), and the per-block float ops then run in the same order per
//   output lane, so y is the AVX2 kernels' y (tests/test_int8_vnni.py compares the two in one build).
// - Two tiles side by side: tile t in the low 256 bits of a zmm, tile t + 1 in the high, so each
//   broadcast activation dword meets 16 outputs; up to 8 rows share every widened weight vector
//   (their 8 integer and 8 float accumulators fit the 32 registers). A lone last tile is paired with
//   itself and its high half is not stored. Both tiles are prefetched 8 blocks ahead (see PF).
// - int8_dot.cpp calls these from 5 rows on, and at 1-4 rows where kvgate.models.q8act_rows's probe at
//   load found them faster than its AVX2 tiles (Zen 4: the tiles; an AMX Xeon: these).
// - Q8_0 tiles (the LM head) are signed x signed: |w| times x with w's sign moved onto x (a masked
//   negate: AVX-512 has no `sign_epi8`), as the AVX2 kernel does with `sign_epi8`.
#include "int8_layout.h"

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && \
    defined(__F16C__)
#include <immintrin.h>
#define KVGATE_VNNI512 1
#endif

namespace kvgate_int8 {

bool vnni_built() {
#ifdef KVGATE_VNNI512
  return true;
#else
  return false;
#endif
}

bool& vnni_enabled() {
  static bool on = vnni_built();
  return on;
}

#ifdef KVGATE_VNNI512
namespace {

constexpr int MR = 8;  // activation rows per register tile
// Each tile of a pair is its own stream, and the hardware prefetchers alone kept up poorly with two per
// thread: the LM head at 1 row, cold, ran at 16 GB/s on one thread (the AVX2 kernel's one stream: 38).
// Prefetching both 8 blocks ahead: 31 GB/s (4 blocks: 28).
constexpr int64_t PF = 8;

inline __m512i pair_bytes(const uint8_t* p0, const uint8_t* p1) {  // 32 bytes of each tile
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p0))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p1)), 1);
}

inline __m512 pair_fp16(const uint8_t* p0, const uint8_t* p1) {  // 8 fp16 of each tile as 16 floats
  const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p0));
  const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p1));
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
}

inline __m512i bcast4(const int8_t* p) {  // the 4 bytes at p in every 32-bit lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// Asks for both tiles' block PF blocks ahead of block p0 / p1 (BLOCK bytes each).
template <int64_t BLOCK>
inline void prefetch_pair(const uint8_t* p0, const uint8_t* p1) {
  for (int64_t o = 0; o < BLOCK; o += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(p0 + PF * BLOCK + o), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p1 + PF * BLOCK + o), _MM_HINT_T0);
  }
}

template <int R, int C>
inline void zero_sums(__m512i (&s)[R][C]) {
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) s[r][c] = _mm512_setzero_si512();
}

template <int C>
inline __m512i chain_sum(const __m512i (&s)[C]) {  // the chains added in order: exact integers
  __m512i sum = s[0];
#pragma GCC unroll 4
  for (int c = 1; c < C; ++c) sum = _mm512_add_epi32(sum, s[c]);
  return sum;
}

// Few rows leave few independent `vpdpbusd` chains (one row: 8 in a row per block, each waiting on the
// last); so 1 row sums into 4 chains and 2-3 rows into 2, added at the block's end (exact integers).
template <int R>
constexpr int chains() {
  return R == 1 ? 4 : (R < 4 ? 2 : 1);
}

// R rows against tiles w0 (outputs 0-7) and w1 (8-15) of Q4_1: per block, 4 groups of 4 k per lane
// for the low nibbles (k = 8g + j) and the high ones (k = 8g + 4 + j), then per row
// acc = fma(dot, d_w * d_x, acc), acc = fma(m_w, s_x, acc) as int8_dot.cpp's tile_rows.
template <int R>
void q4_pair(const Rounded& x, int64_t r0, const uint8_t* w0, const uint8_t* w1, float* y, int64_t ldy,
             __mmask16 keep) {
  constexpr int C = chains<R>();
  const int64_t K = x.K, nb = K / QB;
  const int8_t* xq = x.q + r0 * K;
  const float *xd = x.d + r0 * nb, *xs = x.s + r0 * nb;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t *p0 = w0 + b * TILE_BLOCK, *p1 = w1 + b * TILE_BLOCK;
    prefetch_pair<TILE_BLOCK>(p0, p1);
    __m512i s[R][C];
    zero_sums(s);
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) {
      const __m512i v = pair_bytes(p0 + 32 * g, p1 + 32 * g);
      const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int8_t* xb = xq + r * K + b * QB + 8 * g;
        s[r][(2 * g) % C] = _mm512_dpbusd_epi32(s[r][(2 * g) % C], lo, bcast4(xb));
        s[r][(2 * g + 1) % C] = _mm512_dpbusd_epi32(s[r][(2 * g + 1) % C], hi, bcast4(xb + 4));
      }
    }
    const __m512 dw = pair_fp16(p0 + NIBBLES, p1 + NIBBLES);
    const __m512 mw = pair_fp16(p0 + NIBBLES + 16, p1 + NIBBLES + 16);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 dot = _mm512_cvtepi32_ps(chain_sum(s[r]));
      acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dw, _mm512_set1_ps(xd[r * nb + b])), acc[r]);
      acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xs[r * nb + b]), acc[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy, keep, acc[r]);
}

// The same for Q8_0 tiles: 8 groups of 4 k per lane, acc = fma(dot, d_w * d_x, acc) per block.
template <int R>
void q8_pair(const Rounded& x, int64_t r0, const uint8_t* w0, const uint8_t* w1, float* y, int64_t ldy,
             __mmask16 keep) {
  const int64_t K = x.K, nb = K / QB;
  const int8_t* xq = x.q + r0 * K;
  const float* xd = x.d + r0 * nb;
  constexpr int C = chains<R>();
  const __m512i zero = _mm512_setzero_si512();
  __m512 acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t *p0 = w0 + b * Q8_BLOCK, *p1 = w1 + b * Q8_BLOCK;
    prefetch_pair<Q8_BLOCK>(p0, p1);
    __m512i s[R][C];
    zero_sums(s);
#pragma GCC unroll 4
    for (int g = 0; g < 8; ++g) {
      const __m512i v = pair_bytes(p0 + 32 * g, p1 + 32 * g);
      const __m512i mag = _mm512_abs_epi8(v);
      const __mmask64 neg = _mm512_movepi8_mask(v);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512i xb = bcast4(xq + r * K + b * QB + 4 * g);
        s[r][g % C] = _mm512_dpbusd_epi32(s[r][g % C], mag, _mm512_mask_sub_epi8(xb, neg, zero, xb));
      }
    }
    const __m512 dw = _mm512_castsi512_ps(pair_bytes(p0 + Q8_CODES, p1 + Q8_CODES));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(chain_sum(s[r])), _mm512_mul_ps(dw, _mm512_set1_ps(xd[r * nb + b])),
                               acc[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy, keep, acc[r]);
}

using PairFn = void (*)(const Rounded&, int64_t, const uint8_t*, const uint8_t*, float*, int64_t, __mmask16);

constexpr PairFn Q4_BY_ROWS[MR + 1] = {nullptr,     q4_pair<1>, q4_pair<2>, q4_pair<3>, q4_pair<4>,
                                       q4_pair<5>, q4_pair<6>, q4_pair<7>, q4_pair<8>};
constexpr PairFn Q8_BY_ROWS[MR + 1] = {nullptr,     q8_pair<1>, q8_pair<2>, q8_pair<3>, q8_pair<4>,
                                       q8_pair<5>, q8_pair<6>, q8_pair<7>, q8_pair<8>};

// Pairs [p0, p1) of tiles, each against every group of up to MR rows
void pair_range(const PairFn* by_rows, const Rounded& x, const uint8_t* w, int64_t block_bytes, int64_t T, int64_t N,
                float* y, int64_t p0, int64_t p1) {
  const int64_t tile_bytes = x.K / QB * block_bytes;
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t t = 2 * p, width = std::min<int64_t>(2 * NT, N - t * NT);
    const uint8_t* w0 = w + t * tile_bytes;
    const uint8_t* w1 = t + 1 < T ? w0 + tile_bytes : w0;  // a lone last tile: its own pair, high half dropped
    const __mmask16 keep = static_cast<__mmask16>((1u << width) - 1u);
    for (int64_t r = 0; r < x.M; r += MR) {
      const int rows = static_cast<int>(std::min<int64_t>(MR, x.M - r));
      by_rows[rows](x, r, w0, w1, y + r * N + t * NT, N, keep);
    }
  }
}

// Every (pair of tiles, group of up to MR rows); threads split the pairs.
void run_pairs(const PairFn* by_rows, const Rounded& x, const uint8_t* w, int64_t block_bytes, int64_t T, int64_t N,
               float* y, int64_t grain) {
  at::parallel_for(0, (T + 1) / 2, grain,
                   [&](int64_t p0, int64_t p1) { pair_range(by_rows, x, w, block_bytes, T, N, y, p0, p1); });
}

}  // namespace

void q4_1_dot8_vnni(const Rounded& x, const uint8_t* w, int64_t T, int64_t N, float* y) {
  run_pairs(Q4_BY_ROWS, x, w, TILE_BLOCK, T, N, y, 2);
}

void q8_dot8_vnni(const Rounded& x, const uint8_t* w, int64_t T, int64_t N, float* y) {
  run_pairs(Q8_BY_ROWS, x, w, Q8_BLOCK, T, N, y, 8);
}

void q4_1_dot8_vnni_pairs(const Rounded& x, const uint8_t* w, int64_t T, int64_t N, float* y, int64_t p0, int64_t p1) {
  pair_range(Q4_BY_ROWS, x, w, TILE_BLOCK, T, N, y, p0, p1);
}
#else
void q4_1_dot8_vnni(const Rounded&, const uint8_t*, int64_t, int64_t, float*) {
  TORCH_CHECK(false, "q4_1_dot8: this build has no AVX-512 VNNI kernels");
}
void q8_dot8_vnni(const Rounded&, const uint8_t*, int64_t, int64_t, float*) {
  TORCH_CHECK(false, "q8_dot8: this build has no AVX-512 VNNI kernels");
}
void q4_1_dot8_vnni_pairs(const Rounded&, const uint8_t*, int64_t, int64_t, float*, int64_t, int64_t) {
  TORCH_CHECK(false, "q4_1_dot8: this build has no AVX-512 VNNI kernels");
}
#endif

}  // namespace kvgate_int8
