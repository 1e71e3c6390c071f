// y[m, n] = sum_k x[m, k] * w[n, k] for a weight matrix held as GGUF-style blocks of 32 values, times
// float32 activations:
//   Q8_0: int8 codes, w = d * code                  (q8_matmul: codes int8 [N, K], d [N, K/32])
//   Q4_1: 4-bit codes, w = d * code + m, one rounding (q4_1_matmul: codes uint8 [N, K/2], d and m
//         [N, K/32]; byte j of a block holds value j in its low nibble and value j + 16 in its high)
// Each weight is widened to exactly the float the dequantized checkpoint holds (d * code is exact in
// float32 for fp16 scales, so fma(d, code, m) rounds once, as gguf's own d * code + m does). Every
// output element is one thread's 2 x 8 running sums over K in order, added in one fixed order, whatever
// else is in the call: a row's result never depends on how many rows share it. Threads split the
// output features; tiles of 16 weight rows meet the activations in groups of up to 4 rows, so the
// widened weights are reused for 4 rows and both stay in L1.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVGATE_AVX2 1
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
};

struct Q41Row {
  const uint8_t* q;
  const float* d;
  const float* m;
  inline void widen(int64_t b, Vec w[4]) const {
    const __m256 s = _mm256_set1_ps(d[b]), o = _mm256_set1_ps(m[b]);
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * (QBLOCK / 2)));
    const __m128i nib = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(raw, nib);                     // values 0..15
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), nib);  // values 16..31
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int j = 0; j < 4; ++j) w[j] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[j])), o);
  }
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

template <class Row>
void dot_group(const float* x, int64_t rows, int64_t K, const Row& row, float* y, int64_t N) {
  switch (rows) {
    case 4: dot_rows<4>(x, K, row, y, N); break;
    case 3: dot_rows<3>(x, K, row, y, N); break;
    case 2: dot_rows<2>(x, K, row, y, N); break;
    case 1: dot_rows<1>(x, K, row, y, N); break;
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

torch::Tensor q4_1_matmul(torch::Tensor x, torch::Tensor q, torch::Tensor d, torch::Tensor m) {
  TORCH_CHECK(q.dtype() == torch::kUInt8 && q.dim() == 2 && q.size(1) % (QBLOCK / 2) == 0,
              "q4_1_matmul: codes uint8 [N, K/2]");
  const int64_t N = q.size(0), K = q.size(1) * 2, M = x.size(0);
  check_x(x, K);
  check_scales(d, N, K, "d");
  check_scales(m, N, K, "m");
  auto xc = x.contiguous(), qc = q.contiguous(), dc = d.contiguous(), mc = m.contiguous();
  auto y = torch::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const uint8_t* qp = qc.data_ptr<uint8_t>();
  const float* dp = dc.data_ptr<float>();
  const float* mp = mc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t nb = K / QBLOCK;
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    cols(xp, yp, M, N, K, n0, n1, [&](int64_t n) { return Q41Row{qp + n * (K / 2), dp + n * nb, mp + n * nb}; });
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("q8_matmul", &q8_matmul, "float32 x times Q8_0 blocks (codes int8, scales float32)");
  mod.def("q4_1_matmul", &q4_1_matmul, "float32 x times Q4_1 blocks (nibbles, scales and mins float32)");
}
