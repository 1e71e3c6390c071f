// Decode attention that reads the paged K/V pool in place (kvgate.models.paged_attention).
//
// kvgate::paged_decode_attention(q [R, H, D], k_pool [N, bs, KVH, D], v_pool, block_tables [R, maxblk]
// int64/int32, context_lens [R] int64, scale, k_scale?, v_scale?, window) -> out [R, H, D] in q's dtype
// (window > 0: each row attends over only its last `window` positions, Gemma 3's sliding layers). The pools
// are in q's dtype, or float16 / bfloat16 / int8 under float32 q (a narrower KV cache, `--kv-dtype`). An
// int8 pool (kvgate.models.kv_int8) holds codes and, in k_scale / v_scale [N, bs, KVH, 2], a step s and
// offset z per (slot, KV head): a code c stands for c s + z. The loops read the codes as float32 integers;
// a score is (scale q.c) s + (scale sum(q)) z, and the weighted V sum is sum (p s) c + sum p z, the step
// and offset applied to whole rows of scores and weights in vector passes (`gather_scales`). Measured
// on the AMX Xeon (cold, 30 layers, 2 threads): 16 rows x 300 positions 9.2-9.4 ms (float16) -> 7.6-7.9
// (int8), x 1,000 29.4-30.0 -> 23.7-23.8. The reads shrink by 44%, the time by a sixth: hot in cache
// the two took the same time (4.4-5.1 ms), so the rest is arithmetic, which int8 does not shorten (a
// symmetric scale without offsets, 7.0-7.2 ms, was measured and dropped for its error: kv_int8.py).
//
// Each (row, kv head) pair's `group = H / KVH` queries are scored against the row's first
// context_lens[r] positions, found through its block table, in chunks of 128 positions: a two-pass
// softmax accumulated in float32 per chunk, the chunks merged in order (rescaled to the largest max, as
// flash-decoding merges its splits). An OpenMP task is a whole row (all its KV heads and chunks, so
// each position's K or V is read as one contiguous stretch, each block as one) or, for the last
// R % threads rows, one (row, chunk, kv head), so a lone row longer than a chunk spreads evenly over
// the threads (one of up to 128 positions splits by KV head only: 2:1 for SmolLM2's 3); tasks prefetch
// the positions ahead of them across the scattered blocks. A (row, kv head, chunk)'s arithmetic and the merge are the same fixed loops whichever task, thread or other rows share
// the call: a row's output is bit-identical whether it is computed alone or among other rows (on one
// machine and build). Chunks instead of one (row, kv head) task per head for a lone row (SmolLM2's 3
// KV heads put 2 on one thread, 1 on the other): Zen 5 EPYC, cold, 30 layers, one row at 4,000
// positions 9.3-9.6 -> 8.3 ms; at 300 positions and for 2 or 16 rows within the noise (0.6-0.8 ms,
// 1.2-1.4, 9-11): there every thread already reads at the ~22 GB/s this access pattern gets.
//
// With AVX2 and head_dim % 8 == 0 (float32, float16, bfloat16 and int8 pools) the loops are vector code:
// scores of 8 positions at once with one accumulator each, summed across lanes together (`sum8`),
// and the weighted V sums of up to 3 queries of a head held in registers 32 columns at a time, so a
// V value is loaded once for the three (`wsum32`). Against the plain loops' per-dot horizontal sums
// and memory accumulators: 1.39 -> 1.10 ms for one row x 300 positions x 30 layers from DRAM (AVX2
// EPYC), 5.4 -> 3.4 ms at 1,000 positions; 16 rows x 300 from cache 7.8 -> 6.2 ms, from DRAM they
// stay at ~14 ms, bound by the reads (15 GB/s; 48 positions of prefetch or huge pages: no change).
// With AVX-512 (same bits as the AVX2 loops, checked against that build on fixed inputs): the scores
// of a head's 3 queries come from one pass over K (`dot8xq`, 24 accumulators in AVX-512VL's 32 ymm
// registers, each K vector loaded and widened once, not three times), and the V pass covers 64
// columns in zmm (`wsum64`). Zen 5 EPYC, cold, 30 layers x 300 positions: 16 rows 11.96 -> 9.56 ms
// (float32 pools), 8.28 -> 5.52 ms (float16), 1 row 0.75 -> 0.64 ms; so at 16 rows the float16 pool
// was bound by the widening and the loads from L1, not by DRAM.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "kv_scales.h"
#include "vec_exp.h"  // defines KVGATE_AVX2_EXP and exp8 where AVX2 and FMA are on

void paged_attention_check_tables(const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t R,
                                  int64_t N, int64_t bs);

namespace {

#ifdef KVGATE_AVX2_EXP
using kvgate_vec::exp8;

// Eight pool values as float32 lanes: float read as is, float16 by F16C, bfloat16 by a 16-bit shift.
template <typename T>
inline __m256 load8(const T* p);
template <>
inline __m256 load8<float>(const float* p) {
  return _mm256_loadu_ps(p);
}
template <>
inline __m256 load8<c10::Half>(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
template <>
inline __m256 load8<c10::BFloat16>(const c10::BFloat16* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
// int8 codes as the float32 integers they are (steps and offsets go to the scores and weights instead)
template <>
inline __m256 load8<int8_t>(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
template <typename T>
constexpr bool kVectorPool = std::is_same_v<T, float> || std::is_same_v<T, c10::Half> ||
                             std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, int8_t>;

// The eight lane sums of a0..a7, as the lanes of one vector: s[j] = sum of a_j's lanes.
inline __m256 sum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

inline float sum1(__m256 a) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

// Scores of query `qi` (D float32) against eight positions k0..k7 (D pool values each), D % 8 == 0:
// one accumulator per position, summed across lanes by `sum8`.
template <typename T>
inline __m256 dot8x(const float* qi, const T* const* kp, int64_t off, int64_t D) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (int64_t c = 0; c < D; c += 8) {
    const __m256 x = _mm256_loadu_ps(qi + c);
    a0 = _mm256_fmadd_ps(x, load8(kp[0] + off + c), a0);
    a1 = _mm256_fmadd_ps(x, load8(kp[1] + off + c), a1);
    a2 = _mm256_fmadd_ps(x, load8(kp[2] + off + c), a2);
    a3 = _mm256_fmadd_ps(x, load8(kp[3] + off + c), a3);
    a4 = _mm256_fmadd_ps(x, load8(kp[4] + off + c), a4);
    a5 = _mm256_fmadd_ps(x, load8(kp[5] + off + c), a5);
    a6 = _mm256_fmadd_ps(x, load8(kp[6] + off + c), a6);
    a7 = _mm256_fmadd_ps(x, load8(kp[7] + off + c), a7);
  }
  return sum8(a0, a1, a2, a3, a4, a5, a6, a7);
}

template <typename T>
inline float dot1x(const float* qi, const T* k, int64_t D) {
  __m256 a = _mm256_setzero_ps();
  for (int64_t c = 0; c < D; c += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(qi + c), load8(k + c), a);
  return sum1(a);
}

#if defined(__AVX512VL__)
// With AVX-512VL's 32 vector registers: the scores of NQ <= 3 queries of one head against 8 positions in
// one pass over their K, each K vector loaded (and widened) once for the NQ queries instead of once per
// query (8 NQ accumulators: 24 ymm). Each query's sums are dot8x's, in dot8x's order: the same bits.
template <int NQ, typename T>
inline void dot8xq(const float* q0, int64_t D, const T* const* kp, int64_t off, __m256 sc, float* out,
                   int64_t ostride) {
  __m256 a[NQ][8];
#pragma GCC unroll 3
  for (int i = 0; i < NQ; ++i)
#pragma GCC unroll 8
    for (int u = 0; u < 8; ++u) a[i][u] = _mm256_setzero_ps();
  for (int64_t c = 0; c < D; c += 8) {
    __m256 x[NQ];
#pragma GCC unroll 3
    for (int i = 0; i < NQ; ++i) x[i] = _mm256_loadu_ps(q0 + i * D + c);
#pragma GCC unroll 8
    for (int u = 0; u < 8; ++u) {
      const __m256 kv = load8(kp[u] + off + c);
#pragma GCC unroll 3
      for (int i = 0; i < NQ; ++i) a[i][u] = _mm256_fmadd_ps(x[i], kv, a[i][u]);
    }
  }
#pragma GCC unroll 3
  for (int i = 0; i < NQ; ++i)
    _mm256_storeu_ps(out + i * ostride,
                     _mm256_mul_ps(sc, sum8(a[i][0], a[i][1], a[i][2], a[i][3], a[i][4], a[i][5], a[i][6], a[i][7])));
}
#endif

#if defined(__AVX512F__)
// Sixteen pool values as float32 lanes (as load8, twice as wide).
template <typename T>
inline __m512 load16(const T* p);
template <>
inline __m512 load16<float>(const float* p) {
  return _mm512_loadu_ps(p);
}
template <>
inline __m512 load16<c10::Half>(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
template <>
inline __m512 load16<c10::BFloat16>(const c10::BFloat16* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
template <>
inline __m512 load16<int8_t>(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// wsum32 over 64 columns in zmm: out[q][0, 64) = sum_t p[q][t] * at(t)[0, 64), t in order. Per column the
// same FMAs in the same order as wsum32's, so the same bits, in half the instructions.
template <int NQ, class At>
inline void wsum64(const float* p, int64_t L, At at, float* out, int64_t D) {
  __m512 a[NQ][4];
#pragma GCC unroll 3
  for (int i = 0; i < NQ; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) a[i][j] = _mm512_setzero_ps();
  for (int64_t t = 0; t < L; ++t) {
    const auto* x = at(t);
    __m512 w[NQ];
#pragma GCC unroll 3
    for (int i = 0; i < NQ; ++i) w[i] = _mm512_set1_ps(p[i * L + t]);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512 xj = load16(x + 16 * j);
#pragma GCC unroll 3
      for (int i = 0; i < NQ; ++i) a[i][j] = _mm512_fmadd_ps(w[i], xj, a[i][j]);
    }
  }
#pragma GCC unroll 3
  for (int i = 0; i < NQ; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(out + i * D + 16 * j, a[i][j]);
}
#endif

// For NQ <= 3 queries q (scores p + q L, sums out + q D): out[q][0, 32) = sum_t p[q][t] * at(t)[0, 32),
// t = 0..L-1 in order, the 4 NQ sums in registers.
template <int NQ, class At>
inline void wsum32(const float* p, int64_t L, At at, float* out, int64_t D) {
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00;
  __m256 a10 = a00, a11 = a00, a12 = a00, a13 = a00, a20 = a00, a21 = a00, a22 = a00, a23 = a00;
  for (int64_t t = 0; t < L; ++t) {
    const auto* x = at(t);
    const __m256 w0 = _mm256_set1_ps(p[t]);
    const __m256 w1 = NQ > 1 ? _mm256_set1_ps(p[L + t]) : w0;
    const __m256 w2 = NQ > 2 ? _mm256_set1_ps(p[2 * L + t]) : w0;
#define KVGATE_COL(j, A0, A1, A2)                  \
  {                                               \
    const __m256 xj = load8(x + 8 * j);           \
    A0 = _mm256_fmadd_ps(w0, xj, A0);             \
    if constexpr (NQ > 1) A1 = _mm256_fmadd_ps(w1, xj, A1); \
    if constexpr (NQ > 2) A2 = _mm256_fmadd_ps(w2, xj, A2); \
  }
    KVGATE_COL(0, a00, a10, a20) KVGATE_COL(1, a01, a11, a21) KVGATE_COL(2, a02, a12, a22)
    KVGATE_COL(3, a03, a13, a23)
#undef KVGATE_COL
  }
  _mm256_storeu_ps(out, a00), _mm256_storeu_ps(out + 8, a01), _mm256_storeu_ps(out + 16, a02);
  _mm256_storeu_ps(out + 24, a03);
  if constexpr (NQ > 1) {
    _mm256_storeu_ps(out + D, a10), _mm256_storeu_ps(out + D + 8, a11), _mm256_storeu_ps(out + D + 16, a12);
    _mm256_storeu_ps(out + D + 24, a13);
  }
  if constexpr (NQ > 2) {
    _mm256_storeu_ps(out + 2 * D, a20), _mm256_storeu_ps(out + 2 * D + 8, a21);
    _mm256_storeu_ps(out + 2 * D + 16, a22), _mm256_storeu_ps(out + 2 * D + 24, a23);
  }
}

// The same for the last n < 8 vectors of a row (head_dim not a multiple of 64), summed in `out`.
template <class At>
inline void wsum(const float* p, int64_t L, At at, float* out, int64_t n) {
  for (int64_t t = 0; t < L; ++t) {
    const __m256 w = _mm256_set1_ps(p[t]);
    const auto* x = at(t);
    for (int64_t j = 0; j < n; ++j)
      _mm256_storeu_ps(out + 8 * j, _mm256_fmadd_ps(w, load8(x + 8 * j), _mm256_loadu_ps(out + 8 * j)));
  }
}
#endif

// One position's D values as float32: float pools are read in place, others converted into `buf`.
template <typename T>
inline const float* as_float(const T* src, float* buf, int64_t D) {
  for (int64_t d = 0; d < D; ++d) buf[d] = static_cast<float>(src[d]);
  return buf;
}

template <>
inline const float* as_float<float>(const float* src, float*, int64_t) {
  return src;
}

inline float dot(const float* __restrict a, const float* __restrict b, int64_t D) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t d = 0; d < D; ++d) s += a[d] * b[d];
  return s;
}

// Four dot products against one query: four independent accumulator chains keep the FMA units busy.
inline void dot4(const float* __restrict a, const float* __restrict b0, const float* __restrict b1,
                 const float* __restrict b2, const float* __restrict b3, int64_t D, float* out) {
  float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
  for (int64_t d = 0; d < D; ++d) {
    s0 += a[d] * b0[d];
    s1 += a[d] * b1[d];
    s2 += a[d] * b2[d];
    s3 += a[d] * b3[d];
  }
  out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
}

// y += p0 x0 + p1 x1 + p2 x2 + p3 x3, one pass over y.
inline void axpy4(float* __restrict y, const float* p, const float* __restrict x0, const float* __restrict x1,
                  const float* __restrict x2, const float* __restrict x3, int64_t D) {
  const float p0 = p[0], p1 = p[1], p2 = p[2], p3 = p[3];
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) y[d] += ((p0 * x0[d] + p1 * x1[d]) + p2 * x2[d]) + p3 * x3[d];
}

inline void axpy(float* __restrict y, float p, const float* __restrict x, int64_t D) {
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) y[d] += p * x[d];
}

// sum_t a[t] (b == nullptr) or sum_t a[t] b[t], t < n, in eight partial sums (t % 8) added in a fixed tree:
// the same bits in every build (an `omp simd` reduction's order follows the vector width the compiler
// picks, so an AVX-512 build and an AVX2 one would differ), and eight chains instead of one.
inline float sum_fixed(const float* a, const float* b, int64_t n) {
  float p[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (int64_t t = 0; t < n; ++t) p[t % 8] += b != nullptr ? a[t] * b[t] : a[t];
  return ((p[0] + p[4]) + (p[2] + p[6])) + ((p[1] + p[5]) + (p[3] + p[7]));
}

// How many positions ahead of its use a task asks for K/V: a row's blocks are scattered by its table,
// so the hardware prefetcher loses the stream at every block (and 4 KiB page) boundary.
constexpr int64_t kAhead = 16;

// Ask for the cache lines of [p, p + n) into L2. Into L2, not L1 (prefetcht0): L1's few miss buffers
// capped a thread at about half the rate (measured on AVX2 EPYC: 45 -> 23 ms for 16 rows x 300
// positions x 30 layers from DRAM, one thread; t0 gained nothing there).
inline void prefetch(const void* p, int64_t n) {
  const uintptr_t end = reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(n);
  for (uintptr_t a = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63}; a < end; a += 64) {
#if defined(__x86_64__) || defined(__i386__)
    // as asm: GCC deletes a loop of __builtin_prefetch (or _mm_prefetch) as a loop without effects
    asm volatile("prefetcht1 %0" : : "m"(*reinterpret_cast<const char*>(a)));
#else
    __builtin_prefetch(reinterpret_cast<const void*>(a), 0, 2);
#endif
  }
}

// A row's positions are taken in fixed chunks of kChunk (the last one shorter): each chunk gets its own
// two-pass softmax, and the chunks' partial results are merged in chunk order (`merge`). The chunks
// depend on the context length only, so they let a lone row spread over every thread (by chunk and
// KV head) without its bits depending on the split. 128 positions: a one-row step at 256-384
// positions splits into 6-9 pieces, enough to balance 2 threads (measured in the file's opening).
constexpr int64_t kChunk = 128;

inline int64_t chunks_of(int64_t L) { return (L + kChunk - 1) / kChunk; }

// A row's first position: 0, or with a sliding window (Gemma's local layers) the first of its last
// `window` positions. Its chunks start there, so they depend on the row's own length and window only.
inline int64_t first_of(const int64_t* lens, int64_t r, int64_t window) {
  return window > 0 && lens[r] > window ? lens[r] - window : 0;
}
inline int64_t row_chunks(const int64_t* lens, int64_t r, int64_t window) {
  return chunks_of(lens[r] - first_of(lens, r, window));
}

// One chunk's partial result per query: the V sum under unnormalized weights (D floats), the chunk's
// max score and the sum of its weights.
inline int64_t part_floats(int64_t D) { return D + 2; }

// A thread's working memory for its tasks: the task's (qf .. offs), a whole row's partials (own) and a
// merge's sums (sum). `reserve` sizes it up front for rows of up to max_len positions, so a thread team
// that reserved it before its parallel region allocates nothing inside it (decode_stack.cpp; an
// allocation failing inside the region could not be reported, only terminate the process).
struct Scratch {
  std::vector<float> qf, acc, buf, scores, denom, top, own, sum, fold, zsum;
  std::vector<int64_t> offs, sidx, first;
  void reserve(int64_t R, int64_t H, int64_t D, int64_t max_len);
};

// One task: chunk c of row r for KV heads [kh0, kh1), each with its `g` queries. Per position the heads
// of a task are adjacent in the pool, so a task covering all heads reads each block as one contiguous
// stretch. Each (row, head, chunk)'s arithmetic is the same fixed sequence whichever heads share its
// task.
template <typename Q, typename T, typename I>
struct Attend {
  const Q* q;
  const T *k, *v;
  int64_t q_row_stride, q_head_stride;
  const I* tables;
  int64_t maxblk;
  const int64_t* lens;
  Q* out;
  int64_t H, KVH, D, bs;
  float scale;
  // int8 pools (`--kv-dtype int8`): a step and an offset per (slot, KV head), [N * bs * KVH * 2]; null for
  // float pools
  const float *ks = nullptr, *vs = nullptr;
  int64_t window = 0;  // > 0: a row attends over only its last `window` positions

  // Writes the chunk's partial result of query j of the row (j = kh0 * g ..) at part + j * part_floats(D).
  void operator()(int64_t r, int64_t c, int64_t kh0, int64_t kh1, Scratch& s, float* part) const {
    const int64_t g = H / KVH, nh = kh1 - kh0, gq = nh * g;  // gq queries in this task
    const int64_t t0 = first_of(lens, r, window) + c * kChunk;
    const int64_t L = std::min(lens[r], t0 + kChunk) - t0;  // positions [t0, t0 + L)
    const I* table = tables + r * maxblk;
    const int64_t pos_stride = KVH * D;  // between consecutive positions of the pool
    s.qf.resize(gq * D), s.acc.assign(gq * D, 0.f), s.buf.resize(4 * D), s.denom.resize(gq), s.top.resize(gq);
    s.scores.resize(static_cast<size_t>(gq * L));
    float *qf = s.qf.data(), *acc = s.acc.data(), *buf = s.buf.data(), *scores = s.scores.data();
    for (int64_t i = 0; i < gq; ++i) {
      const Q* src = q + r * q_row_stride + (kh0 * g + i) * q_head_stride;
      for (int64_t d = 0; d < D; ++d) qf[i * D + d] = static_cast<float>(src[d]);
    }
    bool vec = false;  // the AVX2 loops: float32, float16, bfloat16 or int8 pools with head_dim % 8 == 0
#ifdef KVGATE_AVX2_EXP
    vec = kVectorPool<T> && D % 8 == 0;
#endif
    // position t's heads [kh0, kh1) in `pool`, from offsets walked once per task instead of a division by
    // the block size per position and query (measured: no change in speed; the loops read simpler)
    s.offs.resize(L);
    int64_t* offs = s.offs.data();
    for (int64_t t = 0, blk = t0 / bs, j = t0 % bs; t < L; ++t) {
      offs[t] = (static_cast<int64_t>(table[blk]) * bs + j) * pos_stride + kh0 * D;
      if (++j == bs) j = 0, ++blk;
    }
    auto pos = [offs](const T* pool, int64_t t) { return pool + offs[t]; };
    // an int8 pool's scales: position t's head kh0 + h has its step and offset at 2 (sidx[t] + h)
    int64_t* sidx = nullptr;
    if (ks != nullptr) {
      s.sidx.resize(L);
      sidx = s.sidx.data();
      for (int64_t t = 0; t < L; ++t) sidx[t] = offs[t] / D;
    }
    const int64_t span = nh * D * static_cast<int64_t>(sizeof(T));
    auto ahead = [&](const T* pool, int64_t t, int64_t n) {
      for (int64_t u = t; u < t + n && u < L; ++u) {
        prefetch(pos(pool, u), span);
        if (sidx != nullptr)
          prefetch((pool == k ? ks : vs) + 2 * sidx[u], 2 * nh * static_cast<int64_t>(sizeof(float)));
      }
    };
    // Pass 1: scores[i][t] = scale * q_i . k_t, i = (head - kh0) * g + j.
    // Positions go eight (vector path) or four at a time, then one at a time for the rest: the order
    // depends on L only.
    const int64_t L4 = L - L % 4;
    // V is asked for alongside K, so it streams in during the score pass instead of after it: twice the
    // misses in flight, and the weighted sums read V from L2 (a task's V is at most kChunk positions)
    ahead(k, 0, kAhead);
    ahead(v, 0, kAhead);
    float s4[4];
    if (vec) {
#ifdef KVGATE_AVX2_EXP
      if constexpr (kVectorPool<T>) {
        const int64_t L8 = L - L % 8;
        const __m256 sc = _mm256_set1_ps(scale);
        const T* kp[8];
        for (int64_t t = 0; t < L8; t += 8) {
          ahead(k, t + kAhead, 8);
          ahead(v, t + kAhead, 8);
          for (int u = 0; u < 8; ++u) kp[u] = pos(k, t + u);
#if defined(__AVX512VL__)
          for (int64_t h = 0; h < nh; ++h)
            for (int64_t i0 = h * g; i0 < (h + 1) * g; i0 += 3) {
              const int64_t nq = std::min<int64_t>(3, (h + 1) * g - i0);
              float* o = scores + i0 * L + t;
              if (nq == 3)
                dot8xq<3>(qf + i0 * D, D, kp, h * D, sc, o, L);
              else if (nq == 2)
                dot8xq<2>(qf + i0 * D, D, kp, h * D, sc, o, L);
              else
                dot8xq<1>(qf + i0 * D, D, kp, h * D, sc, o, L);
            }
#else
          for (int64_t h = 0; h < nh; ++h)
            for (int64_t i = h * g; i < (h + 1) * g; ++i)
              _mm256_storeu_ps(scores + i * L + t, _mm256_mul_ps(sc, dot8x(qf + i * D, kp, h * D, D)));
#endif
        }
        for (int64_t t = L8; t < L; ++t) {
          const T* pt = pos(k, t);
          for (int64_t h = 0; h < nh; ++h)
            for (int64_t i = h * g; i < (h + 1) * g; ++i)
              scores[i * L + t] = scale * dot1x(qf + i * D, pt + h * D, D);
        }
      }
#endif
    }
    for (int64_t t = 0; !vec && t < L4; t += 4) {
      ahead(k, t + kAhead, 4);
      ahead(v, t + kAhead, 4);
      const T *p0 = pos(k, t), *p1 = pos(k, t + 1), *p2 = pos(k, t + 2), *p3 = pos(k, t + 3);
      for (int64_t h = 0; h < nh; ++h) {
        const float *k0 = as_float(p0 + h * D, buf, D), *k1 = as_float(p1 + h * D, buf + D, D),
                    *k2 = as_float(p2 + h * D, buf + 2 * D, D), *k3 = as_float(p3 + h * D, buf + 3 * D, D);
        for (int64_t i = h * g; i < (h + 1) * g; ++i) {
          dot4(qf + i * D, k0, k1, k2, k3, D, s4);
          for (int64_t u = 0; u < 4; ++u) scores[i * L + t + u] = scale * s4[u];
        }
      }
    }
    for (int64_t t = L4; !vec && t < L; ++t) {
      const T* pt = pos(k, t);
      for (int64_t h = 0; h < nh; ++h) {
        const float* kt = as_float(pt + h * D, buf, D);
        for (int64_t i = h * g; i < (h + 1) * g; ++i) scores[i * L + t] = scale * dot(qf + i * D, kt, D);
      }
    }
    // int8 pools (value = code * s + z, a step s and offset z per position and KV head): each head's
    // steps (rows [0, nh)) and offsets (rows [nh, 2 nh)) of the chunk gathered once, then applied in
    // vector passes. Keys: score = (scale * q . codes) * s + (scale * sum(q)) * z.
    auto gather_scales = [&](const float* ps) {
      s.fold.resize(2 * nh * L);
      float* f = s.fold.data();
      for (int64_t h = 0; h < nh; ++h)
        for (int64_t t = 0; t < L; ++t) {
          f[h * L + t] = ps[2 * (sidx[t] + h)];
          f[(nh + h) * L + t] = ps[2 * (sidx[t] + h) + 1];
        }
      return f;
    };
    if (ks != nullptr) {
      const float* f = gather_scales(ks);
      for (int64_t i = 0; i < gq; ++i) {
        const float qz = scale * sum_fixed(qf + i * D, nullptr, D);
        float* si = scores + i * L;
        const float *step = f + (i / g) * L, *off = f + (nh + i / g) * L;
#pragma omp simd
        for (int64_t t = 0; t < L; ++t) si[t] = si[t] * step[t] + qz * off[t];
      }
    }
    // Softmax numerators in place, and their sums.
    for (int64_t i = 0; i < gq; ++i) {
      float* si = scores + i * L;
      float m = -INFINITY;
      int64_t t = 0;
#ifdef KVGATE_AVX2_EXP
      // the max 8 lanes at a time: a max is exact in any order, and vmaxps(s, m) keeps m where s is NaN,
      // as the scalar test does, so m is the scalar loop's value (a zero's sign aside, which no
      // exp(s - m) sees); the scalar loop's one dependent vmaxss per score was a tenth of the kernel
      __m256 top8 = _mm256_set1_ps(-INFINITY);
      for (; t + 8 <= L; t += 8) top8 = _mm256_max_ps(_mm256_loadu_ps(si + t), top8);
      alignas(32) float tops[8];
      _mm256_store_ps(tops, top8);
      for (int u = 0; u < 8; ++u) m = tops[u] > m ? tops[u] : m;
#endif
      for (; t < L; ++t) m = si[t] > m ? si[t] : m;
      float l = 0.f;
      t = 0;
#ifdef KVGATE_AVX2_EXP
      // 8 lanes at a time (the scalar std::exp was a fifth of a 16-row decode step), summed in a
      // fixed order; the tail as before: the result depends on L only
      const __m256 mv = _mm256_set1_ps(m);
      __m256 lv = _mm256_setzero_ps();
      for (; t + 8 <= L; t += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(si + t), mv));
        _mm256_storeu_ps(si + t, e);
        lv = _mm256_add_ps(lv, e);
      }
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, lv);
      l = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
#endif
      for (; t < L; ++t) {
        si[t] = std::exp(si[t] - m);
        l += si[t];
      }
      s.denom[i] = l, s.top[i] = m;
    }
    // int8 pools: sum_t p v_t = sum_t (p s_t) codes_t + sum_t p z_t; the weights become p s here, and
    // each query's sum_t p z_t (zsum) is added to all its columns after pass 2
    if (vs != nullptr) {
      const float* f = gather_scales(vs);
      s.zsum.resize(gq);
      for (int64_t i = 0; i < gq; ++i) {
        float* si = scores + i * L;
        const float *step = f + (i / g) * L, *off = f + (nh + i / g) * L;
        s.zsum[i] = sum_fixed(si, off, L);
#pragma omp simd
        for (int64_t t = 0; t < L; ++t) si[t] *= step[t];
      }
    }
    // Pass 2: acc_i = sum_t p[i][t] * v_t
    if (vec) {
#ifdef KVGATE_AVX2_EXP
      // up to 3 queries of a head together, 32 columns at a time in registers, positions in order: each
      // V value is loaded once for the three (and 12 independent sums keep the FMA units busy); the
      // score pass asked for every V position (the prefetches next to K's), so V is read from cache
      if constexpr (kVectorPool<T>) {
        for (int64_t h = 0; h < nh; ++h)
          for (int64_t i0 = h * g; i0 < (h + 1) * g; i0 += 3) {
            const int64_t nq = std::min<int64_t>(3, (h + 1) * g - i0);
            const float* pi = scores + i0 * L;
#if defined(__AVX512F__)
            if (D % 64 == 0) {
              for (int64_t c = 0; c < D; c += 64) {
                auto at = [&](int64_t t) { return pos(v, t) + h * D + c; };
                float* ai = acc + i0 * D + c;
                if (nq == 3)
                  wsum64<3>(pi, L, at, ai, D);
                else if (nq == 2)
                  wsum64<2>(pi, L, at, ai, D);
                else
                  wsum64<1>(pi, L, at, ai, D);
              }
              continue;
            }
#endif
            for (int64_t c = 0; c + 32 <= D; c += 32) {
              auto at = [&](int64_t t) { return pos(v, t) + h * D + c; };
              float* ai = acc + i0 * D + c;
              if (nq == 3)
                wsum32<3>(pi, L, at, ai, D);
              else if (nq == 2)
                wsum32<2>(pi, L, at, ai, D);
              else
                wsum32<1>(pi, L, at, ai, D);
            }
            if (const int64_t c = D - D % 32; c < D) {  // the last D % 32 columns, query by query
              auto at = [&](int64_t t) { return pos(v, t) + h * D + c; };
              for (int64_t i = i0; i < i0 + nq; ++i) wsum(scores + i * L, L, at, acc + i * D + c, (D - c) / 8);
            }
          }
      }
#endif
    }
    float p4[4];
    for (int64_t t = 0; !vec && t < L4; t += 4) {
      const T *p0 = pos(v, t), *p1 = pos(v, t + 1), *p2 = pos(v, t + 2), *p3 = pos(v, t + 3);
      for (int64_t h = 0; h < nh; ++h) {
        const float *v0 = as_float(p0 + h * D, buf, D), *v1 = as_float(p1 + h * D, buf + D, D),
                    *v2 = as_float(p2 + h * D, buf + 2 * D, D), *v3 = as_float(p3 + h * D, buf + 3 * D, D);
        for (int64_t i = h * g; i < (h + 1) * g; ++i) {
          for (int64_t u = 0; u < 4; ++u) p4[u] = scores[i * L + t + u];
          axpy4(acc + i * D, p4, v0, v1, v2, v3, D);
        }
      }
    }
    for (int64_t t = L4; !vec && t < L; ++t) {
      const T* pt = pos(v, t);
      for (int64_t h = 0; h < nh; ++h) {
        const float* vt = as_float(pt + h * D, buf, D);
        for (int64_t i = h * g; i < (h + 1) * g; ++i) axpy(acc + i * D, scores[i * L + t], vt, D);
      }
    }
    if (vs != nullptr)
      for (int64_t i = 0; i < gq; ++i)
        for (int64_t d = 0; d < D; ++d) acc[i * D + d] += s.zsum[i];
    for (int64_t i = 0; i < gq; ++i) {
      float* dst = part + (kh0 * g + i) * part_floats(D);
      std::copy(acc + i * D, acc + (i + 1) * D, dst);
      dst[D] = s.top[i], dst[D + 1] = s.denom[i];
    }
  }

  // Row r's output for KV heads [kh0, kh1) from its n chunks' partials (parts: [n][H][part_floats(D)]):
  // the chunks' sums rescaled to the largest max, w_c = exp(max_c - max), added in chunk order. A lone
  // chunk gets w = 1 exactly, so a context of up to kChunk positions is one softmax, as before chunks.
  void merge(int64_t r, int64_t n, const float* parts, int64_t kh0, int64_t kh1, float* acc) const {
    const int64_t g = H / KVH, stride = H * part_floats(D);
    for (int64_t i = kh0 * g; i < kh1 * g; ++i) {
      const float* first = parts + i * part_floats(D);
      float top = first[D];
      for (int64_t c = 1; c < n; ++c) top = std::max(top, first[c * stride + D]);
      float denom = 0.f;
      std::fill(acc, acc + D, 0.f);
      for (int64_t c = 0; c < n; ++c) {
        const float* p = first + c * stride;
        const float w = std::exp(p[D] - top);
        denom += w * p[D + 1];
        for (int64_t d = 0; d < D; ++d) acc[d] += w * p[d];
      }
      Q* dst = out + (r * H + i) * D;
      const float inv = denom > 0.f ? 1.f / denom : 0.f;
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<Q>(acc[d] * inv);
    }
  }
};

void Scratch::reserve(int64_t R, int64_t H, int64_t D, int64_t max_len) {
  qf.reserve(H * D), acc.reserve(H * D), buf.reserve(4 * D), scores.reserve(H * kChunk);
  denom.reserve(H), top.reserve(H), own.reserve(chunks_of(max_len) * H * part_floats(D)), sum.reserve(D);
  offs.reserve(kChunk), sidx.reserve(kChunk), fold.reserve(2 * H * kChunk), zsum.reserve(H), first.reserve(R + 1);
}

// The split rows' first task / partial (see `run`): first[i] for split row whole + i, first.back() in all.
// Written into `first` (a reserved Scratch::first stays within its capacity).
inline void split_firsts(const int64_t* lens, int64_t R, int64_t whole, std::vector<int64_t>& first,
                         int64_t window = 0) {
  first.assign(R - whole + 1, 0);
  for (int64_t r = whole; r < R; ++r) first[r - whole + 1] = first[r - whole] + row_chunks(lens, r, window);
}

// Every thread of the current parallel region runs this (its worksharing loops bind to that region); it
// returns after a barrier, with every row's output written. parts: first.back() * H * part_floats(D) floats.
template <typename Q, typename T, typename I>
void team_body(const Attend<Q, T, I>& attend, int64_t R, int64_t whole, const std::vector<int64_t>& first,
               float* parts, Scratch& s) {
  const int64_t H = attend.H, KVH = attend.KVH, D = attend.D;
  const int64_t split = first.back() * KVH, pf = part_floats(D);
  s.sum.resize(D);
  float* acc = s.sum.data();
#pragma omp for schedule(static) nowait
  for (int64_t r = 0; r < whole; ++r) {
    const int64_t n = row_chunks(attend.lens, r, attend.window);
    s.own.resize(static_cast<size_t>(n * H * pf));
    for (int64_t c = 0; c < n; ++c) attend(r, c, 0, KVH, s, s.own.data() + c * H * pf);
    attend.merge(r, n, s.own.data(), 0, KVH, acc);
  }
#pragma omp for schedule(dynamic, 1)
  for (int64_t task = 0; task < split; ++task) {
    const int64_t piece = task / KVH, kh = task % KVH;
    const int64_t r = whole + (std::upper_bound(first.begin(), first.end(), piece) - first.begin()) - 1;
    attend(r, piece - first[r - whole], kh, kh + 1, s, parts + piece * H * pf);
  }
#pragma omp for schedule(static)
  for (int64_t task = 0; task < (R - whole) * KVH; ++task) {
    const int64_t r = whole + task / KVH, kh = task % KVH;
    attend.merge(r, first[r - whole + 1] - first[r - whole], parts + first[r - whole] * H * pf, kh, kh + 1, acc);
  }
}

template <typename Q, typename T, typename I>
void run(const Q* q, int64_t q_row_stride, int64_t q_head_stride, const T* k, const T* v, const I* tables,
         int64_t maxblk, const int64_t* lens, Q* out, int64_t R, int64_t H, int64_t KVH, int64_t D,
         int64_t bs, double scale, const float* ks, const float* vs, int64_t window) {
  const Attend<Q, T, I> attend{q,  k,  v,  q_row_stride, q_head_stride, tables, maxblk, lens, out, H, KVH, D, bs,
                               static_cast<float>(scale), ks, vs, window};
  // Whole rows (a task streams each block as one stretch, chunk after chunk) while every thread gets
  // one; the last R % threads rows split into (chunk, KV head) tasks, so that, e.g., a lone row still
  // uses every thread, and are merged after those tasks.
  const int64_t threads = omp_get_max_threads();
  const int64_t whole = R - R % threads;
  std::vector<int64_t> first;
  split_firsts(lens, R, whole, first, window);
  std::vector<float> parts(static_cast<size_t>(first.back() * H * part_floats(D)));
#pragma omp parallel
  {
    Scratch s;
    team_body(attend, R, whole, first, parts.data(), s);
  }
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                                  const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
                                  int64_t window) {
  TORCH_CHECK(q.device().is_cpu() && k_pool.device().is_cpu() && v_pool.device().is_cpu(),
              "paged_decode_attention is a CPU kernel; got q on ", q.device(), " and the pool on ",
              k_pool.device());
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 4 && v_pool.sizes() == k_pool.sizes(),
              "paged_decode_attention wants q [R, H, D] and k_pool = v_pool [N, bs, KVH, D]; got q ",
              q.sizes(), ", k_pool ", k_pool.sizes(), ", v_pool ", v_pool.sizes());
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous(), "the K/V pools must be contiguous");
  TORCH_CHECK(k_pool.scalar_type() == v_pool.scalar_type(), "the K and V pools must share a dtype; got ",
              k_pool.scalar_type(), " and ", v_pool.scalar_type());
  TORCH_CHECK(q.scalar_type() == k_pool.scalar_type() ||
                  (q.scalar_type() == at::kFloat && (k_pool.scalar_type() == at::kHalf ||
                                                     k_pool.scalar_type() == at::kBFloat16 ||
                                                     k_pool.scalar_type() == at::kChar)),
              "q and the pools must share a dtype, or q be float32 over float16/bfloat16/int8 pools; got q ",
              q.scalar_type(), " and pools ", k_pool.scalar_type());
  const int64_t R = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = k_pool.size(1), KVH = k_pool.size(2);
  TORCH_CHECK(k_pool.size(3) == D, "head_dim of q (", D, ") and of the pool (", k_pool.size(3), ") differ");
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "query heads (", H, ") must be a multiple of KV heads (", KVH, ")");
  TORCH_CHECK(q.stride(2) == 1, "q's last dimension must be contiguous");
  const auto scales = int8_pool_scales("paged_decode_attention", k_pool, D, k_scale, v_scale);
  float *ks = scales.first, *vs = scales.second;
  paged_attention_check_tables(block_tables, context_lens, R, k_pool.size(0), bs);
  const int64_t maxblk = block_tables.size(1);
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  auto out = at::empty({R, H, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  // q (and the output) in scalar_t; the pools in scalar_t too, or float16/bfloat16/int8 under float32 q
  auto with_pool = [&](auto qp, auto* op, auto pool_type) {
    using T = decltype(pool_type);
    const T* k = reinterpret_cast<const T*>(k_pool.data_ptr());
    const T* v = reinterpret_cast<const T*>(v_pool.data_ptr());
    if (block_tables.scalar_type() == at::kLong)
      run(qp, q.stride(0), q.stride(1), k, v, block_tables.data_ptr<int64_t>(), maxblk, lens, op, R, H, KVH, D, bs,
          scale, ks, vs, window);
    else
      run(qp, q.stride(0), q.stride(1), k, v, block_tables.data_ptr<int32_t>(), maxblk, lens, op, R, H, KVH, D, bs,
          scale, ks, vs, window);
  };
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    if (k_pool.scalar_type() == q.scalar_type()) {
      with_pool(qp, op, scalar_t{});
    } else if constexpr (std::is_same_v<scalar_t, float>) {
      if (k_pool.scalar_type() == at::kHalf)
        with_pool(qp, op, c10::Half{});
      else if (k_pool.scalar_type() == at::kChar)
        with_pool(qp, op, int8_t{});
      else
        with_pool(qp, op, c10::BFloat16{});
    }
  });
  return out;
}

}  // namespace

// The same kernel for C++ callers (decode_stack.cpp), without the dispatcher.
at::Tensor paged_attention_rows(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                                const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale) {
  return paged_decode_attention(q, k_pool, v_pool, block_tables, context_lens, scale, k_scale, v_scale, 0);
}

// The block tables and context lengths of R rows over a pool of N blocks of bs positions: shapes, dtypes,
// every length within its table and every entry it reaches within the pool (also decode_stack.cpp's).
void paged_attention_check_tables(const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t R,
                                  int64_t N, int64_t bs) {
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == R && block_tables.is_contiguous(),
              "block_tables must be a contiguous [R, max_blocks] tensor; got ", block_tables.sizes());
  TORCH_CHECK(block_tables.scalar_type() == at::kLong || block_tables.scalar_type() == at::kInt,
              "block_tables must be int64 or int32");
  TORCH_CHECK(context_lens.scalar_type() == at::kLong && context_lens.dim() == 1 &&
                  context_lens.size(0) == R && context_lens.is_contiguous(),
              "context_lens must be a contiguous int64 [R] tensor");
  const int64_t maxblk = block_tables.size(1);
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(lens[r] >= 1 && lens[r] <= maxblk * bs, "row ", r, ": context length ", lens[r],
                " is outside 1..", maxblk * bs, " (its block table's capacity)");
  AT_DISPATCH_INDEX_TYPES(block_tables.scalar_type(), "paged_decode_attention_tables", [&] {
    const index_t* t = block_tables.data_ptr<index_t>();
    for (int64_t r = 0; r < R; ++r)
      for (int64_t b = 0; b < (lens[r] + bs - 1) / bs; ++b)
        TORCH_CHECK(t[r * maxblk + b] >= 0 && t[r * maxblk + b] < N, "row ", r, ": block table entry ", b,
                    " is ", t[r * maxblk + b], ", outside the pool's ", N, " blocks");
  });
}

// The kernel inside a thread team the caller runs (decode_stack.cpp): every thread of the current
// parallel region calls this with the same arguments, checked beforehand as paged_decode_attention
// checks them; q float32 [R, H, D] at the strides given, out float32 [R, H, D] contiguous; the pools in
// float32, float16, bfloat16 or int8 (with k_scale and v_scale: [slots * KVH * 2] each, else null); tables
// int64 (tables64) or int32. Same tasks, same bits as the call.
int64_t paged_attention_team_floats(const int64_t* lens, int64_t R, int64_t H, int64_t D, int64_t threads) {
  std::vector<int64_t> first;
  split_firsts(lens, R, R - R % threads, first);
  return first.back() * H * part_floats(D);
}

// A thread's Scratch for paged_attention_team, reserved for R rows of up to max_len positions, H heads of D
void* paged_attention_team_scratch(int64_t R, int64_t H, int64_t D, int64_t max_len) {
  auto* s = new Scratch;
  s->reserve(R, H, D, max_len);
  return s;
}
void paged_attention_team_scratch_free(void* scratch) { delete static_cast<Scratch*>(scratch); }

void paged_attention_team(const float* q, int64_t q_row_stride, int64_t q_head_stride, at::ScalarType pool,
                          const void* k, const void* v, bool tables64, const void* tables, int64_t maxblk,
                          const int64_t* lens, float* out, int64_t R, int64_t H, int64_t KVH, int64_t D, int64_t bs,
                          double scale, float* parts, void* scratch, const float* k_scale, const float* v_scale) {
  const int64_t threads = omp_get_num_threads(), whole = R - R % threads;
  Scratch& s = *static_cast<Scratch*>(scratch);
  auto& first = s.first;
  split_firsts(lens, R, whole, first);
  auto go = [&](auto pool_type, auto* tab) {
    using T = decltype(pool_type);
    using I = std::remove_const_t<std::remove_pointer_t<decltype(tab)>>;
    const Attend<float, T, I> attend{q,      static_cast<const T*>(k), static_cast<const T*>(v), q_row_stride,
                                     q_head_stride, tab, maxblk, lens, out, H, KVH, D, bs, static_cast<float>(scale),
                                     k_scale, v_scale};
    team_body(attend, R, whole, first, parts, s);
  };
  auto with_tables = [&](auto pool_type) {
    if (tables64)
      go(pool_type, static_cast<const int64_t*>(tables));
    else
      go(pool_type, static_cast<const int32_t*>(tables));
  };
  if (pool == at::kFloat)
    with_tables(float{});
  else if (pool == at::kHalf)
    with_tables(c10::Half{});
  else if (pool == at::kChar)
    with_tables(int8_t{});
  else
    with_tables(c10::BFloat16{});
}

TORCH_LIBRARY(kvgate, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables, "
      "Tensor context_lens, float scale, Tensor? k_scale=None, Tensor? v_scale=None, int window=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvgate, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
