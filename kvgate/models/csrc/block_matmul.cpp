// y[m, n] = sum_k x[m, k] * w[n, k] for a Q8_0 weight matrix (the LM head and embedding table that
// GGUF files keep as Q8_0, kvgate.models.q8_head) times float32 activations: blocks of 32 int8 codes
// with one scale, w = d * code (q8_matmul: codes int8 [N, K], d float32 [N, K/32]). Each weight is
// widened to exactly the float the dequantized checkpoint holds (d * code is exact in float32 for an
// fp16 d). The Q4_1 layers have their own tiles and loops (q4_1_matmul.cpp).
//
// Every row is computed the same way, whatever else is in the call: each output is one thread's
// running sums over K in order, added in one fixed order: 2 x 8 lanes in the AVX2 build, 4 x 16 in the
// AVX-512 one (dot_rows16). Tiles of 16 weight rows meet the activations in groups of up to 4 rows, so
// the widened weights are reused for 4 rows in L1. So a row's result never depends on how many rows
// share the call. Threads split the output features.
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
#define KVGATE_AVX512 1  // dot_rows16: four 16-lane sums per row
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
// a widening to zmm (`widen16`), so one row streams the weights at the memory's pace. So the two builds
// add in different orders (each within 1e-5 of the other); on one build a row's bits never depend on
// the rows beside it. Up to MROWS = 4 rows share each widened block (16 sums). It replaced the paired-rows
// loop (two weight rows per zmm, from 5 rows) and the AVX2 loop below 5 rows. Measured when the Q4_1
// layers still ran it (Zen 5 EPYC, SmolLM2's 30 gguf layers from DRAM, 2 threads): 1 row 3.9 -> 2.8-3.0
// ms, 4 rows 6.3 -> 4.0-4.3, 8 rows 9.3-10.6 -> 8.4-8.5, 16 rows 16.9-17.1 -> 14.9-15.0 (software
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
