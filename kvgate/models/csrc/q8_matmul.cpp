// y[m, n] = sum_k x[m, k] * (d[n, k / 32] * q[n, k]): a matrix held as blocks of 32 int8 codes with one
// float scale each (GGUF's Q8_0 layout, scales widened to float32), times float32 activations.
//
// A weight is widened as d * float(q) (one rounding, exactly the value the float model holds), then
// multiplied into 8 running sums per row in K order, which are added in one fixed order. Each output
// element is computed by one thread that way whatever else is in the call, so a row's result never
// depends on how many rows share it. Threads split the output features; up to 8 activation rows
// share each widened weight vector.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t QBLOCK = 32;
constexpr int64_t MROWS = 8;  // activation rows that share each widened weight vector
constexpr int64_t NTILE = 16;  // weight rows whose codes stay in L1 while every row group passes

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // lanes j + j+4
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                          // (0+2), (1+3)
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

template <int R>
void dot_rows(const float* x, int64_t K, const int8_t* q, const float* d, float* y, int64_t ldy) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < K / QBLOCK; ++b) {
    const __m256 s = _mm256_set1_ps(d[b]);
    for (int64_t j = 0; j < QBLOCK; j += 8) {
      const int64_t k = b * QBLOCK + j;
      const __m256i qi = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k)));
      const __m256 w = _mm256_mul_ps(s, _mm256_cvtepi32_ps(qi));
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k), w, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[r * ldy] = hsum(acc[r]);
}
#else
template <int R>
void dot_rows(const float* x, int64_t K, const int8_t* q, const float* d, float* y, int64_t ldy) {
  for (int r = 0; r < R; ++r) {
    float acc[8] = {0};
    for (int64_t k = 0; k < K; k += 8)
      for (int j = 0; j < 8; ++j) acc[j] = std::fma(x[r * K + k + j], d[k / QBLOCK] * float(q[k + j]), acc[j]);
    const float a0 = acc[0] + acc[4], a1 = acc[1] + acc[5], a2 = acc[2] + acc[6], a3 = acc[3] + acc[7];
    y[r * ldy] = (a0 + a2) + (a1 + a3);
  }
}
#endif

void dot_group(const float* x, int64_t rows, int64_t K, const int8_t* q, const float* d, float* y, int64_t N) {
  switch (rows) {
    case 8: dot_rows<8>(x, K, q, d, y, N); break;
    case 7: dot_rows<7>(x, K, q, d, y, N); break;
    case 6: dot_rows<6>(x, K, q, d, y, N); break;
    case 5: dot_rows<5>(x, K, q, d, y, N); break;
    case 4: dot_rows<4>(x, K, q, d, y, N); break;
    case 3: dot_rows<3>(x, K, q, d, y, N); break;
    case 2: dot_rows<2>(x, K, q, d, y, N); break;
    case 1: dot_rows<1>(x, K, q, d, y, N); break;
    default: break;
  }
}

// Output features [n0, n1) in tiles of NTILE weight rows; within a tile, activation rows in groups of
// MROWS, so both the tile's codes and the group's activations stay in L1.
void q8_cols(const float* x, const int8_t* q, const float* d, float* y, int64_t M, int64_t N, int64_t K,
             int64_t n0, int64_t n1) {
  const int64_t nb = K / QBLOCK;
  for (int64_t t = n0; t < n1; t += NTILE) {
    const int64_t t1 = std::min(t + NTILE, n1);
    for (int64_t m = 0; m < M; m += MROWS) {
      const int64_t rows = std::min(MROWS, M - m);
      for (int64_t n = t; n < t1; ++n) dot_group(x + m * K, rows, K, q + n * K, d + n * nb, y + m * N + n, N);
    }
  }
}

}  // namespace

torch::Tensor q8_matmul(torch::Tensor x, torch::Tensor q, torch::Tensor d) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && q.dtype() == torch::kInt8 && d.dtype() == torch::kFloat32,
              "q8_matmul wants float32 x, int8 codes, float32 scales");
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && d.dim() == 2, "q8_matmul wants 2-d tensors");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  TORCH_CHECK(q.size(1) == K && K % QBLOCK == 0 && d.size(0) == N && d.size(1) == K / QBLOCK,
              "q8_matmul: shapes do not match (x ", x.sizes(), ", q ", q.sizes(), ", d ", d.sizes(), ")");
  auto xc = x.contiguous();
  auto qc = q.contiguous();
  auto dc = d.contiguous();
  auto y = torch::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const int8_t* qp = qc.data_ptr<int8_t>();
  const float* dp = dc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) { q8_cols(xp, qp, dp, yp, M, N, K, n0, n1); });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("q8_matmul", &q8_matmul, "float32 x times Q8_0-style blocks"); }
