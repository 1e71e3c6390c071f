// y[m, n] = sum_k x[m, k] * w[n, k] for a weight matrix held as GGUF-style blocks of 32 values, times
// float32 activations:
//   Q8_0: int8 codes, w = d * code                  (q8_matmul: codes int8 [N, K], d [N, K/32])
//   Q4_1: 4-bit codes, w = d * code + m, one rounding (q4_1_matmul: codes uint8 [N, K/2], d and m
//         [N, K/32]; byte j of a block holds value j in its low nibble and value j + 16 in its high)
// Each weight is widened to exactly the float the dequantized checkpoint holds (d * code is exact in
// float32 for fp16 scales, so fma(d, code, m) rounds once, as gguf's own d * code + m does).
//
// Two kinds of rows, each always computed the same way, whatever else is in the call:
// - decode rows (the first `decode_rows` of x; every row for q8_matmul): each output is one thread's
//   running sums over K in order, added in one fixed order: 2 x 8 lanes in the AVX2 build, 4 x 16 in
//   the AVX-512 one (dot_rows16). Tiles of 16 weight rows meet the activations in groups of up to 4
//   rows, so the widened weights are reused for 4 rows in L1.
// - prefill rows (q4_1_matmul's rows from `decode_rows` on): a tile of 16 weight rows is widened once
//   into a float panel laid out k-major, then blocks of activation rows run a 6 x 16 register tile of
//   broadcast-FMAs over it (a GEMM's shape: 8 loads per 12 FMAs, where the decode loop needs one load
//   per FMA). Each output is one running sum over k = 0..K-1 in order.
// So a row's result never depends on how many rows share the call, and a decode row (or a speculative
// row verified as one) is computed as it would be alone; a prompt token's row is computed the same way
// however the prompt is chunked. Threads split the output features.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVGATE_AVX2 1
#if defined(__AVX512F__)
#define KVGATE_AVX512 1  // the prefill register tile: 12 rows x 16 outputs in zmm sums (see panel_tile)
#endif
#endif

namespace {

constexpr int64_t QBLOCK = 32;
// Measured on a 2-vCPU AVX2 EPYC, one thread (3072 x 576 Q4_1 / 49,152 x 576 Q8_0): two running sums
// per row and 4 rows per group: 0.16 ms at 1 row (the Q8 head 2.5 ms), 18 ms at 256; one sum and 8
// rows: 0.25 ms at 1 row (one FMA chain waits on its own latency), 14.7 ms at 256. Decode wins.
// Interleaving 4 weight rows instead (more chains at 1 row) broke the hardware prefetcher's streams:
// the Q8 head at 1 row went from 2.5 to 4.5 ms.
constexpr int ACC = 2;         // running sums per row (independent FMA chains: j even, j odd)
constexpr int64_t MROWS = 4;   // activation rows that share each widened weight vector
constexpr int64_t NTILE = 16;  // weight rows whose codes stay in L1 while every row group passes

#ifdef KVGATE_AVX2
using Vec = __m256;

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // lanes j + j+4
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                          // (0+2), (1+3)
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

#ifdef KVGATE_AVX512
inline __m128i load16(const void* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

inline __m512 iota16() { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }

#endif

struct Q8Row {
  const int8_t* q;
  const float* d;
  inline void widen(int64_t b, Vec w[4]) const {
    const __m256 s = _mm256_set1_ps(d[b]);
    for (int j = 0; j < 4; ++j) {
      const __m128i c = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + b * QBLOCK + 8 * j));
      w[j] = _mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)));
    }
  }
#ifdef KVGATE_AVX512
  // block b's values 0..15 in lo, 16..31 in hi: widen's values, four to a zmm op
  inline void widen16(int64_t b, __m512& lo, __m512& hi) const {
    const __m512 s = _mm512_set1_ps(d[b]);
    lo = _mm512_mul_ps(s, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load16(q + b * QBLOCK))));
    hi = _mm512_mul_ps(s, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load16(q + b * QBLOCK + 16))));
  }
#endif
};

struct Q41Row {
  const uint8_t* q;
  const float* d;
  const float* m;
  inline void widen(int64_t b, Vec w[4]) const {
    const __m256 s = _mm256_set1_ps(d[b]), o = _mm256_set1_ps(m[b]);
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * (QBLOCK / 2)));
    const __m256i nib = _mm256_set1_epi32(0x0F);
    const __m256i e0 = _mm256_cvtepu8_epi32(raw), e1 = _mm256_cvtepu8_epi32(_mm_srli_si128(raw, 8));
    const __m256i codes[4] = {_mm256_and_si256(e0, nib), _mm256_and_si256(e1, nib), _mm256_srli_epi32(e0, 4),
                              _mm256_srli_epi32(e1, 4)};  // values 0..7, 8..15, 16..23, 24..31
    for (int j = 0; j < 4; ++j) w[j] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(codes[j]), o);
  }
#ifdef KVGATE_AVX512
  // block b's values 0..15 in lo, 16..31 in hi, looked up in the block's 16 levels fma(d, c, m), c =
  // 0..15 (vpermps reads a lane's low 4 bits: the low nibble, or the high one after a shift): widen's
  // values in 6 ops per block instead of 17
  inline void widen16(int64_t b, __m512& lo, __m512& hi) const {
    const __m512 levels = _mm512_fmadd_ps(_mm512_set1_ps(d[b]), iota16(), _mm512_set1_ps(m[b]));
    const __m512i bytes = _mm512_cvtepu8_epi32(load16(q + b * (QBLOCK / 2)));
    lo = _mm512_permutexvar_ps(bytes, levels);
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), levels);
  }
#endif
};

template <int R, class Row>
void dot_rows(const float* x, int64_t K, const Row& row, float* y, int64_t ldy) {
  __m256 acc[R][ACC];
  for (int r = 0; r < R; ++r)
    for (int a = 0; a < ACC; ++a) acc[r][a] = _mm256_setzero_ps();
  Vec w[4];
  for (int64_t b = 0; b < K / QBLOCK; ++b) {
    row.widen(b, w);
    for (int j = 0; j < 4; ++j) {
      const int64_t k = b * QBLOCK + 8 * j;
      for (int r = 0; r < R; ++r)
        acc[r][j % ACC] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k), w[j], acc[r][j % ACC]);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m256 t = acc[r][0];
    if constexpr (ACC == 2) t = _mm256_add_ps(acc[r][0], acc[r][1]);
    y[r * ldy] = hsum(t);
  }
}
#ifdef KVGATE_AVX512
// The AVX-512 build's decode rows (every call, 1 row or 64): four zmm running sums per row, A_p over
// values 0..15 and B_p over values 16..31 of the blocks of parity p (even blocks p = 0, odd p = 1; an odd
// last block is an even one), folded as (A_0 + A_1) + (B_0 + B_1), then its two halves added and the 8
// lanes by `hsum`. The AVX2 loop keeps two 8-lane sums per row, and its FMAs
// wait on their own latency at one row (8 cycles a block): this one has four independent chains and
// a 6-op widening (`widen16`), so one row streams the weights at the memory's pace. So the two builds
// add in different orders (each within 1e-5 of the other); on one build a row's bits never depend on
// the rows beside it. Up to MROWS = 4 rows share each widened block (16 sums). It replaced the paired-rows
// loop (two weight rows per zmm, from 5 rows) and the AVX2 loop below 5 rows: Zen 5 EPYC, SmolLM2's 30
// gguf layers from DRAM, 2 threads: 1 row 3.9 -> 2.8-3.0 ms, 4 rows 6.3 -> 4.0-4.3, 8 rows 9.3-10.6 ->
// 8.4-8.5, 16 rows 16.9-17.1 -> 14.9-15.0. At one row a thread now waits on the codes' loads (software
// prefetch 4-16 rows ahead: within the noise, not kept).

template <int R, class Row>
void dot_rows16(const float* x, int64_t K, const Row& row, float* y, int64_t ldy) {
  __m512 a[R][4];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) a[r][c] = _mm512_setzero_ps();
  // block blk into sums p (values 0..15) and p + 1 (values 16..31)
  auto add_block = [&](int64_t blk, int p) {
    __m512 lo, hi;
    row.widen16(blk, lo, hi);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      a[r][p] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * K + blk * QBLOCK), lo, a[r][p]);
      a[r][p + 1] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * K + blk * QBLOCK + 16), hi, a[r][p + 1]);
    }
  };
  const int64_t nb = K / QBLOCK;
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) add_block(b, 0), add_block(b + 1, 2);
  if (b < nb) add_block(b, 0);  // an odd last block: the even sums
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const __m512 t = _mm512_add_ps(_mm512_add_ps(a[r][0], a[r][2]), _mm512_add_ps(a[r][1], a[r][3]));
    y[r * ldy] = hsum(_mm256_add_ps(_mm512_castps512_ps256(t),
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(t), 1))));
  }
}

#endif
#else
// Without AVX2: the same values and the same order (8 running sums over K, added as the AVX2 path adds).
struct Q8Row {
  const int8_t* q;
  const float* d;
  inline void widen(int64_t b, float w[QBLOCK]) const {
    for (int j = 0; j < QBLOCK; ++j) w[j] = d[b] * float(q[b * QBLOCK + j]);
  }
};

struct Q41Row {
  const uint8_t* q;
  const float* d;
  const float* m;
  inline void widen(int64_t b, float w[QBLOCK]) const {
    for (int j = 0; j < QBLOCK / 2; ++j) {
      const uint8_t c = q[b * (QBLOCK / 2) + j];
      w[j] = std::fma(d[b], float(c & 0x0F), m[b]);
      w[j + QBLOCK / 2] = std::fma(d[b], float(c >> 4), m[b]);
    }
  }
};

template <int R, class Row>
void dot_rows(const float* x, int64_t K, const Row& row, float* y, int64_t ldy) {
  float acc[R][ACC][8] = {};
  float w[QBLOCK];
  for (int64_t b = 0; b < K / QBLOCK; ++b) {
    row.widen(b, w);
    for (int64_t k = 0; k < QBLOCK; ++k)
      for (int r = 0; r < R; ++r) {
        float& a = acc[r][(k / 8) % ACC][k % 8];
        a = std::fma(x[r * K + b * QBLOCK + k], w[k], a);
      }
  }
  for (int r = 0; r < R; ++r) {
    float a[8];
    for (int l = 0; l < 8; ++l) a[l] = ACC == 2 ? acc[r][0][l] + acc[r][ACC - 1][l] : acc[r][0][l];
    const float s0 = a[0] + a[4], s1 = a[1] + a[5], s2 = a[2] + a[6], s3 = a[3] + a[7];
    y[r * ldy] = (s0 + s2) + (s1 + s3);
  }
}
#endif

// A group of up to MROWS decode rows against one weight row, by this build's loop.
template <int R, class Row>
inline void decode_rows(const float* x, int64_t K, const Row& row, float* y, int64_t ldy) {
#ifdef KVGATE_AVX512
  dot_rows16<R>(x, K, row, y, ldy);
#else
  dot_rows<R>(x, K, row, y, ldy);
#endif
}

template <class Row>
void dot_group(const float* x, int64_t rows, int64_t K, const Row& row, float* y, int64_t N) {
  switch (rows) {
    case 4: decode_rows<4>(x, K, row, y, N); break;
    case 3: decode_rows<3>(x, K, row, y, N); break;
    case 2: decode_rows<2>(x, K, row, y, N); break;
    case 1: decode_rows<1>(x, K, row, y, N); break;
    default: break;
  }
}

// Output features [n0, n1): `row_of(n)` gives weight row n.
template <class RowOf>
void cols(const float* x, float* y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1, RowOf row_of) {
  for (int64_t t = n0; t < n1; t += NTILE) {
    const int64_t t1 = std::min(t + NTILE, n1);
    for (int64_t m = 0; m < M; m += MROWS) {
      const int64_t rows = std::min(MROWS, M - m);
      for (int64_t n = t; n < t1; ++n) dot_group(x + m * K, rows, K, row_of(n), y + m * N + n, N);
    }
  }
}

// ---- prefill rows: widened panels and a broadcast-FMA register tile ----
constexpr int64_t PTILE = 16;   // weight rows per panel: two 8-lane vectors of outputs (one 16-lane)
#ifdef KVGATE_AVX512
constexpr int PROWS = 12;       // activation rows per register tile (12 zmm running sums)
#else
constexpr int PROWS = 6;        // activation rows per register tile (6 x 2 running sums)
#endif
constexpr int64_t PBLOCK_FLOATS = 128 * 1024;  // activations per pass over the panels (512 KiB: half an L2)

#ifdef KVGATE_AVX2
// The 8 x 8 block r[0..7] transposed in registers: r[i] becomes column i.
inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i)
    for (int h = 0; h < 2; ++h) {
      u[4 * i + 2 * h] = _mm256_shuffle_ps(t[4 * i + h], t[4 * i + 2 + h], _MM_SHUFFLE(1, 0, 1, 0));
      u[4 * i + 2 * h + 1] = _mm256_shuffle_ps(t[4 * i + h], t[4 * i + 2 + h], _MM_SHUFFLE(3, 2, 3, 2));
    }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

// panel[k * PTILE + c] = weight row t + c at k, widened; columns from `width` on are zero. Eight rows
// at a time: each block's 4 x 8 values per row are widened, then transposed 8 x 8 into k-major order.
template <class RowOf>
void widen_panel(RowOf row_of, int64_t K, int64_t t, int64_t width, float* panel) {
  for (int64_t half = 0; half < PTILE; half += 8) {
    const int64_t rows = std::max<int64_t>(0, std::min<int64_t>(8, width - half));
    if (rows == 0) {
      for (int64_t k = 0; k < K; ++k) _mm256_store_ps(panel + k * PTILE + half, _mm256_setzero_ps());
      continue;
    }
    for (int64_t b = 0; b < K / QBLOCK; ++b) {
      Vec w[8][4];
      for (int64_t c = 0; c < 8; ++c) {
        if (c < rows) {
          row_of(t + half + c).widen(b, w[c]);
        } else {
          for (int j = 0; j < 4; ++j) w[c][j] = _mm256_setzero_ps();
        }
      }
      for (int j = 0; j < 4; ++j) {
        __m256 blk[8];
        for (int c = 0; c < 8; ++c) blk[c] = w[c][j];
        transpose8(blk);
        for (int kk = 0; kk < 8; ++kk) _mm256_store_ps(panel + (b * QBLOCK + 8 * j + kk) * PTILE + half, blk[kk]);
      }
    }
  }
}

// y[r, 0..width) for R rows of x against one panel; every output is fma(x[k], w[k], sum) for k in order.
#ifdef KVGATE_AVX512
// With AVX-512 a panel row is one zmm and 12 activation rows share it: per k one load and 12 FMAs for
// 192 products, where the AVX2 tile needs 2 loads and 12 FMAs for 96. Each lane is still its own
// output's sum in k order, so the bits are the AVX2 tile's (and the scalar build's).
template <int R>
void panel_tile(const float* __restrict x, int64_t K, const float* __restrict panel, float* __restrict y,
                int64_t ldy, int64_t width) {
  __m512 a[R];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) a[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 w = _mm512_loadu_ps(panel + k * PTILE);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * K + k]), w, a[r]);
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << width) - 1u);
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy, keep, a[r]);
}
#else
template <int R>
void panel_tile(const float* __restrict x, int64_t K, const float* __restrict panel, float* __restrict y,
                int64_t ldy, int64_t width) {
  // named sums, not an array: GCC kept a 6 x 2 array on the stack, storing all 12 every k (2x slower)
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00,
         a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_load_ps(panel + k * PTILE), w1 = _mm256_load_ps(panel + k * PTILE + 8);
#define KVGATE_ROW(r, A0, A1)                                    \
  if constexpr (R > r) {                                         \
    const __m256 xb = _mm256_broadcast_ss(x + r * K + k);        \
    A0 = _mm256_fmadd_ps(xb, w0, A0);                            \
    A1 = _mm256_fmadd_ps(xb, w1, A1);                            \
  }
    KVGATE_ROW(0, a00, a01) KVGATE_ROW(1, a10, a11) KVGATE_ROW(2, a20, a21)
    KVGATE_ROW(3, a30, a31) KVGATE_ROW(4, a40, a41) KVGATE_ROW(5, a50, a51)
#undef KVGATE_ROW
  }
  const __m256 acc[PROWS][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}, {a40, a41}, {a50, a51}};
  for (int r = 0; r < R; ++r) {
    alignas(32) float out[PTILE];
    _mm256_store_ps(out, acc[r][0]);
    _mm256_store_ps(out + 8, acc[r][1]);
    std::copy(out, out + width, y + r * ldy);
  }
}
#endif
#else
template <int R>
void panel_tile(const float* x, int64_t K, const float* panel, float* y, int64_t ldy, int64_t width) {
  float acc[R][PTILE] = {};
  for (int64_t k = 0; k < K; ++k)
    for (int r = 0; r < R; ++r)
      for (int64_t c = 0; c < PTILE; ++c) acc[r][c] = std::fma(x[r * K + k], panel[k * PTILE + c], acc[r][c]);
  for (int r = 0; r < R; ++r) std::copy(acc[r], acc[r] + width, y + r * ldy);
}

// panel[k * PTILE + c] = weight row t + c at k, widened; columns from `width` on are zero.
template <class RowOf>
void widen_panel(RowOf row_of, int64_t K, int64_t t, int64_t width, float* panel) {
  std::fill(panel, panel + K * PTILE, 0.f);
  float w[QBLOCK];
  for (int64_t c = 0; c < width; ++c) {
    const auto row = row_of(t + c);
    for (int64_t b = 0; b < K / QBLOCK; ++b) {
      row.widen(b, w);
      for (int64_t k = 0; k < QBLOCK; ++k) panel[(b * QBLOCK + k) * PTILE + c] = w[k];
    }
  }
}
#endif

void panel_group(const float* x, int64_t rows, int64_t K, const float* panel, float* y, int64_t ldy,
                 int64_t width) {
  switch (rows) {
#ifdef KVGATE_AVX512
    case 12: panel_tile<12>(x, K, panel, y, ldy, width); break;
    case 11: panel_tile<11>(x, K, panel, y, ldy, width); break;
    case 10: panel_tile<10>(x, K, panel, y, ldy, width); break;
    case 9: panel_tile<9>(x, K, panel, y, ldy, width); break;
    case 8: panel_tile<8>(x, K, panel, y, ldy, width); break;
    case 7: panel_tile<7>(x, K, panel, y, ldy, width); break;
#endif
    case 6: panel_tile<6>(x, K, panel, y, ldy, width); break;
    case 5: panel_tile<5>(x, K, panel, y, ldy, width); break;
    case 4: panel_tile<4>(x, K, panel, y, ldy, width); break;
    case 3: panel_tile<3>(x, K, panel, y, ldy, width); break;
    case 2: panel_tile<2>(x, K, panel, y, ldy, width); break;
    case 1: panel_tile<1>(x, K, panel, y, ldy, width); break;
    default: break;
  }
}

// Prefill rows x[0, M) for output features [n0, n1).
template <class RowOf>
void prefill_cols(const float* x, float* y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1, RowOf row_of) {
  if (M <= 0 || n0 >= n1) return;
  std::vector<float> buf(K * PTILE + 16);
  float* panel = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t{63});
  const int64_t pblock = std::max<int64_t>(1, PBLOCK_FLOATS / K / PROWS) * PROWS;
  for (int64_t mb = 0; mb < M; mb += pblock) {
    const int64_t mb1 = std::min(mb + pblock, M);
    for (int64_t t = n0; t < n1; t += PTILE) {
      const int64_t width = std::min(PTILE, n1 - t);
      widen_panel(row_of, K, t, width, panel);
      for (int64_t m = mb; m < mb1; m += PROWS)
        panel_group(x + m * K, std::min<int64_t>(PROWS, mb1 - m), K, panel, y + m * N + t, N, width);
    }
  }
}

void check_x(const torch::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.size(1) == K,
              "block matmul: x must be float32 [rows, ", K, "], got ", x.sizes(), " ", x.dtype());
}

void check_scales(const torch::Tensor& s, int64_t N, int64_t K, const char* name) {
  TORCH_CHECK(s.dtype() == torch::kFloat32 && s.dim() == 2 && s.size(0) == N && s.size(1) == K / QBLOCK,
              "block matmul: ", name, " must be float32 [", N, ", ", K / QBLOCK, "], got ", s.sizes());
}

}  // namespace

torch::Tensor q8_matmul(torch::Tensor x, torch::Tensor q, torch::Tensor d) {
  TORCH_CHECK(q.dtype() == torch::kInt8 && q.dim() == 2 && q.size(1) % QBLOCK == 0, "q8_matmul: codes int8 [N, K]");
  const int64_t N = q.size(0), K = q.size(1), M = x.size(0);
  check_x(x, K);
  check_scales(d, N, K, "d");
  auto xc = x.contiguous(), qc = q.contiguous(), dc = d.contiguous();
  auto y = torch::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const int8_t* qp = qc.data_ptr<int8_t>();
  const float* dp = dc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t nb = K / QBLOCK;
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    cols(xp, yp, M, N, K, n0, n1, [&](int64_t n) { return Q8Row{qp + n * K, dp + n * nb}; });
  });
  return y;
}

torch::Tensor q4_1_matmul(torch::Tensor x, torch::Tensor q, torch::Tensor d, torch::Tensor m, int64_t decode_rows) {
  TORCH_CHECK(q.dtype() == torch::kUInt8 && q.dim() == 2 && q.size(1) % (QBLOCK / 2) == 0,
              "q4_1_matmul: codes uint8 [N, K/2]");
  const int64_t N = q.size(0), K = q.size(1) * 2, M = x.size(0);
  check_x(x, K);
  check_scales(d, N, K, "d");
  check_scales(m, N, K, "m");
  const int64_t Md = decode_rows < 0 ? M : std::min(decode_rows, M);  // rows [Md, M) are prefill rows
  auto xc = x.contiguous(), qc = q.contiguous(), dc = d.contiguous(), mc = m.contiguous();
  auto y = torch::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const uint8_t* qp = qc.data_ptr<uint8_t>();
  const float* dp = dc.data_ptr<float>();
  const float* mp = mc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t nb = K / QBLOCK;
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    auto row_of = [&](int64_t n) { return Q41Row{qp + n * (K / 2), dp + n * nb, mp + n * nb}; };
    cols(xp, yp, Md, N, K, n0, n1, row_of);
    prefill_cols(xp + Md * K, yp + Md * N, M - Md, N, K, n0, n1, row_of);
  });
  return y;
}
