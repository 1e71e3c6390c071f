// y[m, n] = sum_k x[m, k] * w[n, k] for a weight matrix held as GGUF blocks of 32 values, times float32
// activations, from tiles of 16 output rows:
//   Q4_1 (--weights gguf's layers; q4_1_matmul, tiles from q4_1_pack16 in kvgate/models/q4_1.py):
//     w = d * c + m, c in 0..15, d and m fp16 (the file's own). uint8 [T, K/32, 320]: per block of 32 k,
//     bytes 16p + j (p = 0..15) hold output j's codes at k = 2p (low nibble) and k = 2p + 1 (high), then
//     the 16 outputs' d and m as fp16 (bytes 256 and 288).
//   Q8_0 (the LM head GGUF files keep as Q8_0; q8_matmul, tiles from q8_pack16 in kvgate/models/q8_head.py):
//     w = d * c, c int8. uint8 [T, K/32, 576]: per block, bytes 16k + j hold output j's code at k, then
//     the 16 outputs' d as float32 (bytes 512..575).
//   Q4F (a GGUF's Q4_K and Q4_0 layers, and Q4_1 whose scales are not fp16 values; block_matmul, tiles
//     from block_pack16 in kvgate/models/block_formats.py): Q4_1's codes, then the 16 outputs' d and m
//     as float32 (bytes 256 and 320): uint8 [T, K/32, 384]. d * c is exact in float32 for every 4-bit
//     GGUF type (Q4_K's d is an fp16 times a 6-bit scale: 17 bits, times a 4-bit code: 21).
//   Q5F (a GGUF's Q5_0, Q5_1 and Q5_K layers; block_matmul): Q4_1's low 4 bits of each code, then each
//     code's fifth bit as one 16-bit mask per k over the 16 outputs (bytes 256 + 2k, bit j: output j),
//     then d and m as float32 (bytes 320 and 384): uint8 [T, K/32, 448], 0.875 B a weight where Q8S took
//     1.5 (Q5_K's d is an fp16 times a 6-bit scale: 17 bits, times a 5-bit code: 22, exact).
//   Q8D (a GGUF's Q6_K and Q3_K layers, w = d * c with d per 16 and no m; block_matmul): Q8_0's int8
//     codes, then d per half block as float32 (bytes 512 and 576): uint8 [T, K/32, 640], 1.25 B a weight
//     where Q8S took 1.5, and two FMAs fewer a block and row. (Planes of 6-bit codes, at 1 B, measured
//     1.25-1.5x slower at 1-4 rows than Q8S: widening them costs more than the bytes they save.)
//   Q8S (every other GGUF block type: Q2_K, and a fused matrix whose parts differ; block_matmul): Q8_0's int8
//     codes, then d and m per half block of 16 k as float32, d(k < 16), d(k >= 16), m(k < 16),
//     m(k >= 16), 16 outputs each (bytes 512, 576, 640, 704): uint8 [T, K/32, 768]. The k-quants' scales
//     are per 16 values (Q6_K: an fp16 times an int8, 18 bits, times a 6-bit code: 24, still exact).
// Output rows past N are zero codes and scales. So 16 (Q4_1: 32) weights of 16 outputs widen from one
// 16-byte load, one output per lane: a GEMM's shape, where rows laid out one after another each needed
// their own widening per k and a horizontal sum.
//
// Two kinds of rows, each always computed the same way, whatever else is in the call:
// - Q4_1 and Q4F decode rows (the first `decode_rows` of x) run q4_1_int24.cpp's exact integer products
//   on 24-bit activation blocks by default (its opening says how and why); the float loop below is what
//   they ran before, kept behind set_q4_1_decode("float") for A/B runs and the tests that compare.
// - decode rows (q8_matmul's every row; Q4_1's under set_q4_1_decode("float")): per output and block, one FMA
//   chain s = sum_k c_k x_k over the block's k in order (Q8_0: two, over the even and the odd k, then
//   added, so one row needs only 4 tiles in flight), then acc = fma(d, s, acc) (Q4_1: then also
//   acc = fma(m, xs_b, acc), xs_b the block's sum of x by a fixed tree, `block_sum`), blocks in order.
//   That is d * sum(c x) + m * sum(x), the factoring llama.cpp's block dots use: the codes need no
//   scaling per weight, so a 16-byte load widens 32 Q4_1 weights in 4 ops (vpermps looks a nibble up
//   in the floats 0..15). Against the exact widened weights it differs at float32 rounding (2-3e-7 of
//   the largest output on random matrices). Every build (AVX-512, AVX2, scalar) does these operations
//   lane for lane: the same bits.
// - prefill rows (q4_1_matmul's rows from `decode_rows` on): a tile is widened once into a float panel
//   of the exact weights fma(d, c, m) (d * c is exact in float32: one rounding, as gguf's own
//   d * c + m), k-major, then blocks of activation rows run a 12 x 16 (AVX2: 6 x 16) register tile of
//   broadcast-FMAs over it. Each output is one running sum over k = 0..K-1 in order: the same bits in
//   every build.
// So a row's result never depends on how many rows share the call: a decode row (or a speculative row
// verified as one) is computed as it would be alone, a prompt token's row the same way however the
// prompt is chunked. Threads split the tiles.
//
// Measured against the row layouts these replaced (Q4_1 at 0.75 B a weight, rows widened one at a time,
// 4 x 16 lane sums per row; Zen 5 EPYC, 2 threads, SmolLM2's 30 layers from DRAM, random weights): 1 row
// 2.16-2.48 -> 1.89-2.39 ms, 4 rows 3.7-4.1 -> 3.0-3.96, 8 rows 8.1-8.4 -> 5.3-5.4, 16 rows 15.4-16.3 ->
// 10.0-11.5; at 0.625 B a weight. Without the software prefetch the tiles' 8 streams ran at 23 GB/s (1
// row 2.9 ms).
#include "amx_i24.h"     // the same products on AMX's int8 tiles, for calls of many rows
#include "q4_1_int24.h"  // the decode rows as exact integer products (the default)

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <tuple>
#include <type_traits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KVGATE_T_AVX2 1
#if defined(__AVX512F__)
#define KVGATE_T_AVX512 1
#endif
#endif

namespace {

constexpr int64_t QBLOCK = 32;
constexpr int64_t TILE = 16;  // output rows per tile
// Blocks ahead of its use a tile's bytes are asked for (into L1): a thread reads up to 8 tiles side by
// side, more streams than the hardware prefetcher follows. On Zen 5 (session 13) 2-4 blocks measured
// alike, 8 slower, and with no prefetch one row took 1.45x as long; on Zen 4 (session 16) the same
// loop over cold memory ran at 11-18 GB/s with it and 20-22 without, and SmolLM2's 30 layers at one
// row took 4.3 ms with it against 3.7 without, while at 16 rows it still paid (18.5 against 19.8).
// The other prefetch asks for the next group's tiles, block for block as the current group reads
// them, into L2: one group ahead (23-60 KB for SmolLM2's layers at one row, well inside L2). At a
// thread's last group that is the next thread's first tiles or the bytes after the matrix (a prefetch
// never faults). The L1 one runs a few hundred ns ahead: too short to cover DRAM at a call's start and
// at each new group. Zen 4 (session 21), paired in one process, from memory, against no prefetch: the
// Q8_0 head 0.72x the time at one row, 0.73x at 2, 0.70x at 4, 0.84x at 16; the int24 layer loop
// (q4_1_int24.cpp) 0.78x at one row, 0.63x at 2, 0.88-0.95x at 4-16; both prefetches together 0.85x
// (layers) and 0.80x (head) at one row, L1 alone 1.08x and 1.25x. A fixed 16 or 32 blocks ahead
// (mostly landing in the group's own next tile) gained 3-10%. So each of the two switches, for groups
// of one row and of more (set_decode_prefetch), is a mode: none, L1, next group, or both, chosen at
// load by a measured probe (kvgate.models.decode_prefetch.choose); no mode changes a bit.
constexpr int64_t AHEAD = 3;
// Each switch is a mode: bit PF_NEAR the L1 prefetch AHEAD blocks ahead, bit PF_NEXT the next group's
// tiles into L2 (0 none, 3 both).
constexpr int PF_NEAR = 1, PF_NEXT = 2;
std::atomic<int> g_prefetch_one{PF_NEAR | PF_NEXT}, g_prefetch_more{PF_NEAR | PF_NEXT};
// q4_1_matmul's decode rows: q4_1_int24.cpp's integer products (true), or this file's float loop
// (set_q4_1_decode("float"): for A/B runs and the tests that compare the two)
std::atomic<bool> g_decode_int24{true};

// an fp16 scale as float32 (the scalar build's; F16C converts in the vector ones)
inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

inline float float_at(const uint8_t* p) {
  float f;
  std::memcpy(&f, p, 4);
  return f;
}

// sum of x[0, 16) as a fixed tree (every build: scalar)
inline float half_sum(const float* x) {
  float t[8], u[4];
  for (int j = 0; j < 8; ++j) t[j] = x[j] + x[j + 8];
  for (int j = 0; j < 4; ++j) u[j] = t[j] + t[j + 4];
  return (u[0] + u[2]) + (u[1] + u[3]);
}

// sum of x[0, 32) as a fixed tree: v_j = x_j + x_{j+16}, then halves added down to one (every build).
inline float block_sum(const float* x) {
#if defined(KVGATE_T_AVX2)
  const __m256 t = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(x + 16)),
                                 _mm256_add_ps(_mm256_loadu_ps(x + 8), _mm256_loadu_ps(x + 24)));
  const __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  const __m128 w = _mm_add_ps(u, _mm_movehl_ps(u, u));
  return _mm_cvtss_f32(_mm_add_ss(w, _mm_movehdup_ps(w)));
#else
  float t[8], u[4];
  for (int j = 0; j < 8; ++j) t[j] = (x[j] + x[j + 16]) + (x[j + 8] + x[j + 24]);
  for (int j = 0; j < 4; ++j) u[j] = t[j] + t[j + 4];
  return (u[0] + u[2]) + (u[1] + u[3]);
#endif
}

// The two block formats' tiles: a tile-block's bytes, its codes as floats, its scales.
struct Q41 {
  static constexpr int64_t BYTES = 320;  // 256 B of codes, 16 fp16 d, 16 fp16 m
  static constexpr bool HAS_M = true;
  static constexpr int CHAINS = 1;  // a block's sum in one chain over k
  static float code(const uint8_t* wb, int64_t k, int64_t j) {
    const uint8_t c = wb[16 * (k / 2) + j];
    return float(k % 2 ? c >> 4 : c & 15);
  }
  static constexpr bool HALVES = false;  // one d and m per block
  static float d(const uint8_t* wb, int64_t j, int = 0) { return half_at(wb + 256 + 2 * j); }
  static float m(const uint8_t* wb, int64_t j, int = 0) { return half_at(wb + 288 + 2 * j); }
#if defined(KVGATE_T_AVX512)
  // the 16 outputs' codes at k = 2p (c0) and 2p + 1 (c1)
  static void widen(const uint8_t* wb, int p, __m512& c0, __m512& c1) {
    const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + 16 * p)));
    c0 = _mm512_permutexvar_ps(c, levels);  // reads each lane's low 4 bits
    c1 = _mm512_permutexvar_ps(_mm512_srli_epi32(c, 4), levels);
  }
  static __m512 d16(const uint8_t* wb, int = 0) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 256))); }
  static __m512 m16(const uint8_t* wb, int = 0) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 288))); }
#endif
#if defined(KVGATE_T_AVX2)
  // outputs 8h .. 8h + 7 (AVX2's vpermps indexes 8 lanes only: a mask, a shift and a convert)
  static void widen8(const uint8_t* wb, int p, int h, __m256& c0, __m256& c1) {
    const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wb + 16 * p + 8 * h)));
    c0 = _mm256_cvtepi32_ps(_mm256_and_si256(c, _mm256_set1_epi32(15)));
    c1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(c, 4));
  }
  static __m256 d8(const uint8_t* wb, int h, int = 0) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + 256 + 16 * h))); }
  static __m256 m8(const uint8_t* wb, int h, int = 0) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + 288 + 16 * h))); }
#endif
};

struct Q80 {
  static constexpr int64_t BYTES = 576;  // 512 B of int8 codes, 16 float32 d
  static constexpr bool HAS_M = false;
  static constexpr bool HALVES = false;
  static constexpr int CHAINS = 2;  // a block's sum in two chains, even and odd k, then added
  static float code(const uint8_t* wb, int64_t k, int64_t j) { return float(static_cast<int8_t>(wb[16 * k + j])); }
  static float d(const uint8_t* wb, int64_t j, int = 0) { return float_at(wb + 512 + 4 * j); }
  static float m(const uint8_t*, int64_t, int = 0) { return 0.f; }
#if defined(KVGATE_T_AVX512)
  static void widen(const uint8_t* wb, int p, __m512& c0, __m512& c1) {
    c0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + 32 * p))));
    c1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + 32 * p + 16))));
  }
  static __m512 d16(const uint8_t* wb, int = 0) { return _mm512_loadu_ps(reinterpret_cast<const float*>(wb + 512)); }
  static __m512 m16(const uint8_t*, int = 0) { return _mm512_setzero_ps(); }
#endif
#if defined(KVGATE_T_AVX2)
  static void widen8(const uint8_t* wb, int p, int h, __m256& c0, __m256& c1) {
    c0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wb + 32 * p + 8 * h))));
    c1 = _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wb + 32 * p + 16 + 8 * h))));
  }
  static __m256 d8(const uint8_t* wb, int h, int = 0) { return _mm256_loadu_ps(reinterpret_cast<const float*>(wb + 512) + 8 * h); }
  static __m256 m8(const uint8_t*, int, int = 0) { return _mm256_setzero_ps(); }
#endif
};

// Q4_1's codes with float32 d (bytes 256..319) and m (320..383): a block d * c + m whose scales are not
// fp16 values (Q4_K's d * sc and dmin * m, Q4_0's d and -8 d)
struct Q4F {
  static constexpr int64_t BYTES = 384;
  static constexpr bool HAS_M = true;
  static constexpr bool HALVES = false;
  static constexpr int CHAINS = 1;
  static float code(const uint8_t* wb, int64_t k, int64_t j) { return Q41::code(wb, k, j); }
  static float d(const uint8_t* wb, int64_t j, int = 0) { return float_at(wb + 256 + 4 * j); }
  static float m(const uint8_t* wb, int64_t j, int = 0) { return float_at(wb + 320 + 4 * j); }
#if defined(KVGATE_T_AVX512)
  static void widen(const uint8_t* wb, int p, __m512& c0, __m512& c1) { Q41::widen(wb, p, c0, c1); }
  static __m512 d16(const uint8_t* wb, int = 0) { return _mm512_loadu_ps(reinterpret_cast<const float*>(wb + 256)); }
  static __m512 m16(const uint8_t* wb, int = 0) { return _mm512_loadu_ps(reinterpret_cast<const float*>(wb + 320)); }
#endif
#if defined(KVGATE_T_AVX2)
  static void widen8(const uint8_t* wb, int p, int h, __m256& c0, __m256& c1) { Q41::widen8(wb, p, h, c0, c1); }
  static __m256 d8(const uint8_t* wb, int h, int = 0) { return _mm256_loadu_ps(reinterpret_cast<const float*>(wb + 256) + 8 * h); }
  static __m256 m8(const uint8_t* wb, int h, int = 0) { return _mm256_loadu_ps(reinterpret_cast<const float*>(wb + 320) + 8 * h); }
#endif
};

#if defined(KVGATE_T_AVX2)
// `v` in the lanes of outputs 8h .. 8h + 7 whose bit is set in byte `bits` (a bit plane's byte h), else 0
inline __m256 bit_lanes(uint8_t bits, float v) {
  const __m256i lane = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i set = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(bits), lane), lane);
  return _mm256_and_ps(_mm256_castsi256_ps(set), _mm256_set1_ps(v));
}
#endif

// Q4F's layout with each code's fifth bit in a 16-bit mask per k (bytes 256 + 2k), d and m as float32
// (bytes 320..383, 384..447): a block d * c + m with c in 0..31 (Q5_0: m = -16 d; Q5_1; Q5_K's d * sc and
// dmin * m). The bit adds exactly 16 to the code's float, so every build widens to the same values.
struct Q5F {
  static constexpr int64_t BYTES = 448;
  static constexpr bool HAS_M = true;
  static constexpr bool HALVES = false;
  static constexpr int CHAINS = 1;
  static int high(const uint8_t* wb, int64_t k, int64_t j) {
    uint16_t bits;
    std::memcpy(&bits, wb + 256 + 2 * k, 2);
    return (bits >> j) & 1;
  }
  static float code(const uint8_t* wb, int64_t k, int64_t j) { return Q41::code(wb, k, j) + float(16 * high(wb, k, j)); }
  static float d(const uint8_t* wb, int64_t j, int = 0) { return float_at(wb + 320 + 4 * j); }
  static float m(const uint8_t* wb, int64_t j, int = 0) { return float_at(wb + 384 + 4 * j); }
#if defined(KVGATE_T_AVX512)
  static void widen(const uint8_t* wb, int p, __m512& c0, __m512& c1) {
    Q41::widen(wb, p, c0, c1);
    uint16_t h0, h1;
    std::memcpy(&h0, wb + 256 + 4 * p, 2);
    std::memcpy(&h1, wb + 258 + 4 * p, 2);
    const __m512 sixteen = _mm512_set1_ps(16.f);
    c0 = _mm512_mask_add_ps(c0, static_cast<__mmask16>(h0), c0, sixteen);
    c1 = _mm512_mask_add_ps(c1, static_cast<__mmask16>(h1), c1, sixteen);
  }
  static __m512 d16(const uint8_t* wb, int = 0) { return _mm512_loadu_ps(reinterpret_cast<const float*>(wb + 320)); }
  static __m512 m16(const uint8_t* wb, int = 0) { return _mm512_loadu_ps(reinterpret_cast<const float*>(wb + 384)); }
#endif
#if defined(KVGATE_T_AVX2)
  static void widen8(const uint8_t* wb, int p, int h, __m256& c0, __m256& c1) {
    Q41::widen8(wb, p, h, c0, c1);
    c0 = _mm256_add_ps(c0, bit_lanes(wb[256 + 4 * p + h], 16.f));
    c1 = _mm256_add_ps(c1, bit_lanes(wb[258 + 4 * p + h], 16.f));
  }
  static __m256 d8(const uint8_t* wb, int h, int = 0) { return _mm256_loadu_ps(reinterpret_cast<const float*>(wb + 320) + 8 * h); }
  static __m256 m8(const uint8_t* wb, int h, int = 0) { return _mm256_loadu_ps(reinterpret_cast<const float*>(wb + 384) + 8 * h); }
#endif
};

// Q8_0's int8 codes with a float32 d per half block (bytes 512 + 64 kh) and no m: Q6_K's
// d * sc * (q - 32) and Q3_K's d * sc * (q - 4), whose m is zero. Q8S without its m bytes and terms.
struct Q8D {
  static constexpr int64_t BYTES = 640;
  static constexpr bool HAS_M = false;
  static constexpr bool HALVES = true;
  static constexpr int CHAINS = 2;  // one per half block
  static float code(const uint8_t* wb, int64_t k, int64_t j) { return Q80::code(wb, k, j); }
  static float d(const uint8_t* wb, int64_t j, int kh = 0) { return float_at(wb + 512 + 64 * kh + 4 * j); }
  static float m(const uint8_t*, int64_t, int = 0) { return 0.f; }
#if defined(KVGATE_T_AVX512)
  static void widen(const uint8_t* wb, int p, __m512& c0, __m512& c1) { Q80::widen(wb, p, c0, c1); }
  static __m512 d16(const uint8_t* wb, int kh = 0) { return _mm512_loadu_ps(reinterpret_cast<const float*>(wb + 512 + 64 * kh)); }
  static __m512 m16(const uint8_t*, int = 0) { return _mm512_setzero_ps(); }
#endif
#if defined(KVGATE_T_AVX2)
  static void widen8(const uint8_t* wb, int p, int h, __m256& c0, __m256& c1) { Q80::widen8(wb, p, h, c0, c1); }
  static __m256 d8(const uint8_t* wb, int h, int kh = 0) { return _mm256_loadu_ps(reinterpret_cast<const float*>(wb + 512 + 64 * kh) + 8 * h); }
  static __m256 m8(const uint8_t*, int, int = 0) { return _mm256_setzero_ps(); }
#endif
};

// Q8D with an m per half block after its d (kh = 0: k < 16, 1: k >= 16): m at bytes 640 + 64 kh, 16
// outputs each. A half block's sum is one chain over its 16 k.
struct Q8S : Q8D {
  static constexpr int64_t BYTES = 768;
  static constexpr bool HAS_M = true;
  static float m(const uint8_t* wb, int64_t j, int kh = 0) { return float_at(wb + 640 + 64 * kh + 4 * j); }
#if defined(KVGATE_T_AVX512)
  static __m512 m16(const uint8_t* wb, int kh = 0) { return _mm512_loadu_ps(reinterpret_cast<const float*>(wb + 640 + 64 * kh)); }
#endif
#if defined(KVGATE_T_AVX2)
  static __m256 m8(const uint8_t* wb, int h, int kh = 0) { return _mm256_loadu_ps(reinterpret_cast<const float*>(wb + 640 + 64 * kh) + 8 * h); }
#endif
};

// the chain a k = 2p (first) or 2p + 1 (second) product joins: Q8S a half block's, Q8_0 even or odd k,
// Q4_1 / Q4F the one chain
template <class F>
constexpr int chain_of(int p, bool second) {
  return F::HALVES ? (p >= 8 ? 1 : 0) : (second ? F::CHAINS - 1 : 0);
}
// block sums per row of x: one per block (xs[b]), or per half block (xs[2b + kh]) for a HALVES format
template <class F>
constexpr int64_t sums_per_block() {
  return F::HALVES ? 2 : 1;
}

// tile block p into L2 (the next group's: at a thread's last group, the next thread's first tiles or the
// bytes after the matrix, which a prefetch may ask for: it never faults)
template <class F>
inline void prefetch_next(const uint8_t* p) {
#if defined(KVGATE_T_AVX2)
  for (int64_t l = 0; l < F::BYTES; l += 64) _mm_prefetch(reinterpret_cast<const char*>(p + l), _MM_HINT_T1);
#else
  (void)p;
#endif
}

template <class F>
inline void prefetch_block(const uint8_t* p) {
#if defined(KVGATE_T_AVX2)
  for (int64_t l = 0; l < F::BYTES; l += 64) _mm_prefetch(reinterpret_cast<const char*>(p + l), _MM_HINT_T0);
#else
  (void)p;
#endif
}

// ---- decode rows: R rows x NT tiles side by side (see the file's opening for the arithmetic) ----
#if defined(KVGATE_T_AVX512)
template <class F, int R, int NT>
void decode_tiles(const float* x, const float* xs, int64_t nb, const uint8_t* w, int64_t tstride, float* y,
                  int64_t ldy) {
  const int64_t K = nb * QBLOCK;
  const int pf = (R == 1 ? g_prefetch_one : g_prefetch_more).load(std::memory_order_relaxed);
  __m512 acc[R][NT];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    if ((pf & PF_NEAR) && b + AHEAD < nb)
      for (int t = 0; t < NT; ++t) prefetch_block<F>(w + t * tstride + (b + AHEAD) * F::BYTES);
    if (pf & PF_NEXT)
      for (int t = 0; t < NT; ++t) prefetch_next<F>(w + (t + NT) * tstride + b * F::BYTES);
    constexpr int C = F::CHAINS;
    __m512 s[R][NT][C];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int t = 0; t < NT; ++t)
        for (int c = 0; c < C; ++c) s[r][t][c] = _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int p = 0; p < 16; ++p) {
#pragma GCC unroll 8
      for (int t = 0; t < NT; ++t) {
        __m512 c0, c1;
        F::widen(w + t * tstride + b * F::BYTES, p, c0, c1);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const float* xr = x + r * K + b * QBLOCK + 2 * p;
          const int a0 = chain_of<F>(p, false), a1 = chain_of<F>(p, true);
          s[r][t][a0] = _mm512_fmadd_ps(_mm512_set1_ps(xr[0]), c0, s[r][t][a0]);
          s[r][t][a1] = _mm512_fmadd_ps(_mm512_set1_ps(xr[1]), c1, s[r][t][a1]);
        }
      }
    }
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) {
      const uint8_t* wb = w + t * tstride + b * F::BYTES;
      if constexpr (F::HALVES) {  // d and m per half block: four FMAs, halves in order
        for (int kh = 0; kh < 2; ++kh) {
          const __m512 d = F::d16(wb, kh);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) acc[r][t] = _mm512_fmadd_ps(d, s[r][t][kh], acc[r][t]);
        }
        if constexpr (F::HAS_M)  // Q8D has none
          for (int kh = 0; kh < 2; ++kh) {
            const __m512 m = F::m16(wb, kh);
#pragma GCC unroll 8
            for (int r = 0; r < R; ++r) acc[r][t] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[(r * nb + b) * 2 + kh]), acc[r][t]);
          }
        continue;
      }
      const __m512 d = F::d16(wb);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        acc[r][t] = _mm512_fmadd_ps(d, C == 2 ? _mm512_add_ps(s[r][t][0], s[r][t][C - 1]) : s[r][t][0], acc[r][t]);
      if constexpr (F::HAS_M) {
        const __m512 m = F::m16(wb);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) acc[r][t] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[r * nb + b]), acc[r][t]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) _mm512_storeu_ps(y + r * ldy + TILE * t, acc[r][t]);
}
// rows per group and the tiles each group takes side by side: 8 FMA chains in flight (one row of Q8_0
// runs 4 tiles of 2 chains: fewer streams)
constexpr int64_t MAX_GROUP = 8;
template <class F>
inline int group_tiles(int64_t rows) {
  return rows >= 8 ? 1 : rows >= 4 ? 2 : rows >= 2 ? 4 : 8 / F::CHAINS;
}
#elif defined(KVGATE_T_AVX2)
// The same per lane in two 8-lane halves (outputs 0..7, 8..15).
template <class F, int R, int NT>
void decode_tiles(const float* x, const float* xs, int64_t nb, const uint8_t* w, int64_t tstride, float* y,
                  int64_t ldy) {
  const int64_t K = nb * QBLOCK;
  const int pf = (R == 1 ? g_prefetch_one : g_prefetch_more).load(std::memory_order_relaxed);
  __m256 acc[R][NT][2];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t][0] = acc[r][t][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    if ((pf & PF_NEAR) && b + AHEAD < nb)
      for (int t = 0; t < NT; ++t) prefetch_block<F>(w + t * tstride + (b + AHEAD) * F::BYTES);
    if (pf & PF_NEXT)
      for (int t = 0; t < NT; ++t) prefetch_next<F>(w + (t + NT) * tstride + b * F::BYTES);
    constexpr int C = F::CHAINS;
    __m256 s[R][NT][2][C];
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < NT; ++t)
        for (int h = 0; h < 2; ++h)
          for (int c = 0; c < C; ++c) s[r][t][h][c] = _mm256_setzero_ps();
    for (int p = 0; p < 16; ++p) {
      for (int t = 0; t < NT; ++t) {
        for (int h = 0; h < 2; ++h) {
          __m256 c0, c1;
          F::widen8(w + t * tstride + b * F::BYTES, p, h, c0, c1);
          for (int r = 0; r < R; ++r) {
            const float* xr = x + r * K + b * QBLOCK + 2 * p;
            const int a0 = chain_of<F>(p, false), a1 = chain_of<F>(p, true);
            s[r][t][h][a0] = _mm256_fmadd_ps(_mm256_set1_ps(xr[0]), c0, s[r][t][h][a0]);
            s[r][t][h][a1] = _mm256_fmadd_ps(_mm256_set1_ps(xr[1]), c1, s[r][t][h][a1]);
          }
        }
      }
    }
    for (int t = 0; t < NT; ++t) {
      const uint8_t* wb = w + t * tstride + b * F::BYTES;
      for (int h = 0; h < 2; ++h) {
        if constexpr (F::HALVES) {  // as the AVX-512 loop: d and m per half block
          for (int kh = 0; kh < 2; ++kh) {
            const __m256 d = F::d8(wb, h, kh);
            for (int r = 0; r < R; ++r) acc[r][t][h] = _mm256_fmadd_ps(d, s[r][t][h][kh], acc[r][t][h]);
          }
          if constexpr (F::HAS_M)
            for (int kh = 0; kh < 2; ++kh) {
              const __m256 m = F::m8(wb, h, kh);
              for (int r = 0; r < R; ++r)
                acc[r][t][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[(r * nb + b) * 2 + kh]), acc[r][t][h]);
            }
          continue;
        }
        const __m256 d = F::d8(wb, h);
        for (int r = 0; r < R; ++r) {
          const __m256 sum = C == 2 ? _mm256_add_ps(s[r][t][h][0], s[r][t][h][C - 1]) : s[r][t][h][0];
          acc[r][t][h] = _mm256_fmadd_ps(d, sum, acc[r][t][h]);
        }
        if constexpr (F::HAS_M) {
          const __m256 m = F::m8(wb, h);
          for (int r = 0; r < R; ++r) acc[r][t][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[r * nb + b]), acc[r][t][h]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t) {
      _mm256_storeu_ps(y + r * ldy + TILE * t, acc[r][t][0]);
      _mm256_storeu_ps(y + r * ldy + TILE * t + 8, acc[r][t][1]);
    }
}
constexpr int64_t MAX_GROUP = 2;  // 16 ymm registers: 2 rows x 1 tile, or 1 row x 2 tiles (Q8_0: 1)
template <class F>
inline int group_tiles(int64_t rows) {
  return rows >= 2 ? 1 : 2 / F::CHAINS;
}
#else
// Without AVX2: the same operations per output, one at a time.
template <class F, int R, int NT>
void decode_tiles(const float* x, const float* xs, int64_t nb, const uint8_t* w, int64_t tstride, float* y,
                  int64_t ldy) {
  const int64_t K = nb * QBLOCK;
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < NT; ++t)
      for (int64_t j = 0; j < TILE; ++j) {
        float acc = 0.f;
        for (int64_t b = 0; b < nb; ++b) {
          const uint8_t* wb = w + t * tstride + b * F::BYTES;
          const float* xr = x + r * K + b * QBLOCK;
          float s[2] = {0.f, 0.f};  // Q8_0: even and odd k apart; Q8S: the half blocks; Q4_1: one chain
          for (int64_t k = 0; k < QBLOCK; ++k) {
            float& sk = s[chain_of<F>(static_cast<int>(k / 2), k % 2 == 1)];
            sk = std::fma(xr[k], F::code(wb, k, j), sk);
          }
          if constexpr (F::HALVES) {
            for (int kh = 0; kh < 2; ++kh) acc = std::fma(F::d(wb, j, kh), s[kh], acc);
            if constexpr (F::HAS_M)
              for (int kh = 0; kh < 2; ++kh) acc = std::fma(F::m(wb, j, kh), xs[(r * nb + b) * 2 + kh], acc);
            continue;
          }
          acc = std::fma(F::d(wb, j), F::CHAINS == 2 ? s[0] + s[1] : s[0], acc);
          if constexpr (F::HAS_M) acc = std::fma(F::m(wb, j), xs[r * nb + b], acc);
        }
        y[r * ldy + TILE * t + j] = acc;
      }
}
constexpr int64_t MAX_GROUP = 1;
template <class F>
inline int group_tiles(int64_t) {
  return 1;
}
#endif

template <class F, int R>
void decode_group(const float* x, const float* xs, int64_t nb, const uint8_t* w, int64_t tstride, int nt,
                  float* y, int64_t ldy) {
  switch (nt) {
    case 8: decode_tiles<F, R, 8>(x, xs, nb, w, tstride, y, ldy); break;
    case 4: decode_tiles<F, R, 4>(x, xs, nb, w, tstride, y, ldy); break;
    case 2: decode_tiles<F, R, 2>(x, xs, nb, w, tstride, y, ldy); break;
    default: decode_tiles<F, R, 1>(x, xs, nb, w, tstride, y, ldy); break;
  }
}

// `rows` (1..MAX_GROUP, a power of two below it or MAX_GROUP) decode rows against `nt` tiles.
template <class F>
void decode_rows(const float* x, const float* xs, int64_t nb, const uint8_t* w, int64_t tstride, int64_t rows,
                 int nt, float* y, int64_t ldy) {
  switch (rows) {
#if defined(KVGATE_T_AVX512)
    case 8: decode_group<F, 8>(x, xs, nb, w, tstride, nt, y, ldy); break;
    case 4: decode_group<F, 4>(x, xs, nb, w, tstride, nt, y, ldy); break;
#endif
#if defined(KVGATE_T_AVX2)
    case 2: decode_group<F, 2>(x, xs, nb, w, tstride, nt, y, ldy); break;
#endif
    default: decode_group<F, 1>(x, xs, nb, w, tstride, nt, y, ldy); break;
  }
}

// Decode rows [0, M) against tiles [t0, t1): 8 tiles at a time, every row group over them while they
// are in cache; a tile past N's last full one goes through a 16-wide buffer. `xs`: each row's block sums
// (Q4_1 only).
template <class F>
void decode_cols(const float* x, const float* xs, int64_t M, int64_t N, int64_t nb, const uint8_t* w, float* y,
                 int64_t t0, int64_t t1) {
  const int64_t K = nb * QBLOCK, tstride = nb * F::BYTES, full = N / TILE;
  std::vector<float> spare;
  for (int64_t c0 = t0; c0 < t1; c0 += 8) {
    const int64_t c1 = std::min(c0 + 8, t1);
    for (int64_t m = 0; m < M;) {
      const int64_t avail = std::min(M - m, MAX_GROUP);
      int64_t rows = 1;
      while (rows * 2 <= avail) rows *= 2;
      const float* xsr = F::HAS_M ? xs + m * nb * sums_per_block<F>() : nullptr;
      int64_t t = c0;
      const int64_t end = std::min(c1, full);
      for (int nt = group_tiles<F>(rows); nt >= 1; nt /= 2)  // fewer tiles side by side only at a range's end
        for (; t + nt <= end; t += nt)
          decode_rows<F>(x + m * K, xsr, nb, w + t * tstride, tstride, rows, nt, y + m * N + t * TILE, N);
      if (t < c1) {  // the last, partial tile
        spare.resize(static_cast<size_t>(rows * TILE));
        decode_rows<F>(x + m * K, xsr, nb, w + t * tstride, tstride, rows, 1, spare.data(), TILE);
        for (int64_t r = 0; r < rows; ++r)
          std::copy(spare.data() + r * TILE, spare.data() + r * TILE + (N - t * TILE), y + (m + r) * N + t * TILE);
      }
      m += rows;
    }
  }
}

// ---- prefill rows: a tile's exact weights as a k-major panel, and a broadcast-FMA register tile ----
#if defined(KVGATE_T_AVX512)
constexpr int PROWS = 12;  // activation rows per register tile (12 zmm running sums)
#else
constexpr int PROWS = 6;   // activation rows per register tile (6 x 2 running sums)
#endif
constexpr int64_t PBLOCK_FLOATS = 128 * 1024;  // activations per pass over the panels (512 KiB: half an L2)

// panel[k * TILE + j] = fma(d_j, c_j(k), m_j) for tile `w` (nb blocks): the file's own values (d * c is
// exact in float32 for every format here, so one rounding, as gguf's d * c + m; Q8_0: m = 0, d * c).
// A HALVES format takes k's half block's d and m.
template <class F>
void widen_panel(const uint8_t* w, int64_t nb, float* panel) {
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb = w + b * F::BYTES;
    float* pb = panel + b * QBLOCK * TILE;
#if defined(KVGATE_T_AVX512)
    for (int p = 0; p < 16; ++p) {
      const int kh = F::HALVES && p >= 8 ? 1 : 0;
      const __m512 d = F::d16(wb, kh), m = F::m16(wb, kh);
      __m512 c0, c1;
      F::widen(wb, p, c0, c1);
      _mm512_store_ps(pb + 2 * p * TILE, _mm512_fmadd_ps(d, c0, m));
      _mm512_store_ps(pb + (2 * p + 1) * TILE, _mm512_fmadd_ps(d, c1, m));
    }
#elif defined(KVGATE_T_AVX2)
    for (int h = 0; h < 2; ++h) {
      for (int p = 0; p < 16; ++p) {
        const int kh = F::HALVES && p >= 8 ? 1 : 0;
        const __m256 d = F::d8(wb, h, kh), m = F::m8(wb, h, kh);
        __m256 c0, c1;
        F::widen8(wb, p, h, c0, c1);
        _mm256_store_ps(pb + 2 * p * TILE + 8 * h, _mm256_fmadd_ps(d, c0, m));
        _mm256_store_ps(pb + (2 * p + 1) * TILE + 8 * h, _mm256_fmadd_ps(d, c1, m));
      }
    }
#else
    for (int64_t j = 0; j < TILE; ++j)
      for (int64_t k = 0; k < QBLOCK; ++k) {
        const int kh = F::HALVES && k >= 16 ? 1 : 0;
        pb[k * TILE + j] = std::fma(F::d(wb, j, kh), F::code(wb, k, j), F::m(wb, j, kh));
      }
#endif
  }
}

// y[r, 0..width) for R rows of x against one panel; every output is fma(x[k], w[k], sum) for k in order.
#if defined(KVGATE_T_AVX512)
// A panel row is one zmm and 12 activation rows share it: per k one load and 12 FMAs for 192 products,
// where the AVX2 tile needs 2 loads and 12 FMAs for 96. Each lane is still its own output's sum in k
// order, so the bits are the AVX2 tile's (and the scalar build's).
template <int R>
void panel_tile(const float* __restrict x, int64_t K, const float* __restrict panel, float* __restrict y,
                int64_t ldy, int64_t width) {
  __m512 a[R];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) a[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 w = _mm512_loadu_ps(panel + k * TILE);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * K + k]), w, a[r]);
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << width) - 1u);
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy, keep, a[r]);
}
#elif defined(KVGATE_T_AVX2)
template <int R>
void panel_tile(const float* __restrict x, int64_t K, const float* __restrict panel, float* __restrict y,
                int64_t ldy, int64_t width) {
  // named sums, not an array: GCC kept a 6 x 2 array on the stack, storing all 12 every k (2x slower)
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00,
         a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = _mm256_load_ps(panel + k * TILE), w1 = _mm256_load_ps(panel + k * TILE + 8);
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
    alignas(32) float out[TILE];
    _mm256_store_ps(out, acc[r][0]);
    _mm256_store_ps(out + 8, acc[r][1]);
    std::copy(out, out + width, y + r * ldy);
  }
}
#else
template <int R>
void panel_tile(const float* x, int64_t K, const float* panel, float* y, int64_t ldy, int64_t width) {
  float acc[R][TILE] = {};
  for (int64_t k = 0; k < K; ++k)
    for (int r = 0; r < R; ++r)
      for (int64_t c = 0; c < TILE; ++c) acc[r][c] = std::fma(x[r * K + k], panel[k * TILE + c], acc[r][c]);
  for (int r = 0; r < R; ++r) std::copy(acc[r], acc[r] + width, y + r * ldy);
}
#endif

void panel_group(const float* x, int64_t rows, int64_t K, const float* panel, float* y, int64_t ldy,
                 int64_t width) {
  switch (rows) {
#if defined(KVGATE_T_AVX512)
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

// Prefill rows x[0, M) against tiles [t0, t1).
template <class F>
void prefill_cols(const float* x, float* y, int64_t M, int64_t N, int64_t nb, const uint8_t* w, int64_t t0,
                  int64_t t1) {
  if (M <= 0 || t0 >= t1) return;
  const int64_t K = nb * QBLOCK;
  std::vector<float> buf(K * TILE + 16);
  float* panel = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t{63});
  const int64_t pblock = std::max<int64_t>(1, PBLOCK_FLOATS / K / PROWS) * PROWS;
  for (int64_t mb = 0; mb < M; mb += pblock) {
    const int64_t mb1 = std::min(mb + pblock, M);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t width = std::min(TILE, N - t * TILE);
      widen_panel<F>(w + t * nb * F::BYTES, nb, panel);
      for (int64_t m = mb; m < mb1; m += PROWS)
        panel_group(x + m * K, std::min<int64_t>(PROWS, mb1 - m), K, panel, y + m * N + t * TILE, N, width);
    }
  }
}

void check_tiles(const char* fn, const char* pack, const torch::Tensor& packed, int64_t N, int64_t bytes) {
  TORCH_CHECK(packed.dtype() == torch::kUInt8 && packed.dim() == 3 && packed.size(2) == bytes &&
                  packed.size(0) == (N + TILE - 1) / TILE,
              fn, ": want tiles uint8 [", (N + TILE - 1) / TILE, ", K/32, ", bytes, "] for ", N, " outputs (", pack,
              "), got ", packed.sizes(), " ", packed.dtype());
}

void check_x(const char* fn, const torch::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.size(1) == K, fn, ": x must be float32 [rows, ",
              K, "], got ", x.sizes(), " ", x.dtype());
}

// blocks [i0, i1) of x: their float sums (a HALVES format: per half block) where format F has an m
template <class F>
void sums_of(const float* x, int64_t i0, int64_t i1, float* xs) {
  if constexpr (F::HAS_M)
    for (int64_t i = i0; i < i1; ++i)
      if constexpr (F::HALVES) {
        xs[2 * i] = half_sum(x + i * QBLOCK);
        xs[2 * i + 1] = half_sum(x + i * QBLOCK + 16);
      } else {
        xs[i] = block_sum(x + i * QBLOCK);
      }
}

// fn(F{}) for the block format whose tile-blocks are `bytes` long (block_pack16's; Q4_1 is not one)
template <class Fn>
void by_format(int64_t bytes, Fn&& fn) {
  switch (bytes) {
    case Q4F::BYTES: fn(Q4F{}); break;
    case Q5F::BYTES: fn(Q5F{}); break;
    case Q8D::BYTES: fn(Q8D{}); break;
    case Q80::BYTES: fn(Q80{}); break;
    default: fn(Q8S{}); break;
  }
}

}  // namespace

namespace kvgate_amx {  // amx_q4_1.cpp: prompt rows on AMX's bf16 tiles, where built and granted
bool active();
void q4_1_prefill(const float* x, float* y, int64_t M, int64_t N, int64_t nb, const uint8_t* w);
}  // namespace kvgate_amx

namespace kvgate_team {  // q4_1_matmul's decode rows in pieces, for decode_stack.cpp's thread team

bool int24() { return g_decode_int24.load(std::memory_order_relaxed); }

// blocks [i0, i1) of x: their float sums and 24-bit digits, as q4_1_matmul's first pass makes them (amx:
// in amx_i24.cpp's layout, for a call that kvgate_amx8::takes)
void prepare(const float* x, int64_t i0, int64_t i1, float* xs, int32_t* xd, float* sc, bool amx) {
  for (int64_t i = i0; i < i1; ++i) xs[i] = block_sum(x + i * QBLOCK);
  if (amx)
    kvgate_amx8::digits(x, i0, i1, xd, sc);
  else
    kvgate_i24::digits(x, i0, i1, xd, sc);
}

// the digit dwords per row and block that `prepare` writes for such a call
int64_t digit_dwords(bool amx) { return amx ? kvgate_amx8::XDW : kvgate_i24::XDW; }

// decode rows [0, M) against tiles [t0, t1): q4_1_matmul's second pass on one thread's share; nx: the
// span of the next matrix this thread reads first, asked for during its last group
void tiles(const int32_t* xd, const float* sc, const float* xs, int64_t M, int64_t N, int64_t nb,
           const uint8_t* w, float* y, int64_t t0, int64_t t1, const uint8_t* nx, int64_t nx_bytes, bool q4f,
           bool amx) {
  if (amx) return kvgate_amx8::decode_cols(xd, sc, xs, M, N, nb, w, y, t0, t1, q4f);
  kvgate_i24::decode_cols(xd, sc, xs, M, N, nb, w, y, t0, t1, g_prefetch_one.load(std::memory_order_relaxed),
                          g_prefetch_more.load(std::memory_order_relaxed), nx, nx_bytes, q4f);
}

// block_matmul's decode rows in the same pieces, for a block format's float loop (not Q4F under int24,
// which takes `prepare` and `tiles` above): the rows' block sums where the format has an m (xs: 2 a block
// for Q8S), then its tiles [t0, t1) against float rows x
void block_sums(int64_t bytes, const float* x, int64_t i0, int64_t i1, float* xs) {
  by_format(bytes, [&](auto f) { sums_of<decltype(f)>(x, i0, i1, xs); });
}
void block_tiles(int64_t bytes, const float* x, const float* xs, int64_t M, int64_t N, int64_t nb, const uint8_t* w,
                 float* y, int64_t t0, int64_t t1) {
  by_format(bytes, [&](auto f) { decode_cols<decltype(f)>(x, xs, M, N, nb, w, y, t0, t1); });
}

}  // namespace kvgate_team

torch::Tensor q4_1_matmul(torch::Tensor x, torch::Tensor packed, int64_t N, int64_t decode_rows) {
  check_tiles("q4_1_matmul", "q4_1_pack16", packed, N, Q41::BYTES);
  const int64_t T = packed.size(0), nb = packed.size(1), K = nb * QBLOCK, M = x.size(0);
  check_x("q4_1_matmul", x, K);
  const int64_t Md = decode_rows < 0 ? M : std::min(decode_rows, M);  // rows [Md, M) are prefill rows
  auto xc = x.contiguous(), pc = packed.contiguous();
  auto y = torch::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const uint8_t* wp = pc.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const bool int24 = g_decode_int24.load(std::memory_order_relaxed);
  const bool amx8 = int24 && Md > 0 && kvgate_amx8::takes(Md);  // read once: digits and tiles agree
  std::vector<float> xs(static_cast<size_t>(Md * nb));  // each decode row's block sums
  std::vector<int32_t> xd(int24 ? static_cast<size_t>(Md * nb * kvgate_team::digit_dwords(amx8)) : 0);
  std::vector<float> sc(int24 ? static_cast<size_t>(Md * nb) : 0);
  // one pass over the decode rows' blocks, split across threads (each block's numbers are its own); on
  // one thread it ran 2-12 us a call at 8-16 rows while the other waited for the tiles' parallel_for
  at::parallel_for(0, Md * nb, 96, [&](int64_t i0, int64_t i1) {
    if (int24)
      kvgate_team::prepare(xp, i0, i1, xs.data(), xd.data(), sc.data(), amx8);
    else
      for (int64_t i = i0; i < i1; ++i) xs[i] = block_sum(xp + i * QBLOCK);
  });
  const bool amx = M > Md && kvgate_amx::active();
  if (Md > 0 || !amx)
    at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
      if (int24)
        kvgate_team::tiles(xd.data(), sc.data(), xs.data(), Md, N, nb, wp, yp, t0, t1, nullptr, 0, false, amx8);
      else
        decode_cols<Q41>(xp, xs.data(), Md, N, nb, wp, yp, t0, t1);
      if (!amx) prefill_cols<Q41>(xp + Md * K, yp + Md * N, M - Md, N, nb, wp, t0, t1);
    });
  if (amx) kvgate_amx::q4_1_prefill(xp + Md * K, yp + Md * N, M - Md, N, nb, wp);
  return y;
}

std::tuple<int64_t, int64_t> decode_prefetch() {
  return {g_prefetch_one.load(std::memory_order_relaxed), g_prefetch_more.load(std::memory_order_relaxed)};
}
std::tuple<int64_t, int64_t> set_decode_prefetch(int64_t one_row, int64_t more_rows) {
  TORCH_CHECK(one_row >= 0 && one_row <= 3 && more_rows >= 0 && more_rows <= 3, "set_decode_prefetch: each mode ",
              "is 0 (none), 1 (L1, a few blocks ahead), 2 (the next group into L2) or 3 (both); got ", one_row,
              " and ", more_rows);
  g_prefetch_one.store(static_cast<int>(one_row), std::memory_order_relaxed);
  g_prefetch_more.store(static_cast<int>(more_rows), std::memory_order_relaxed);
  return decode_prefetch();
}

std::string q4_1_decode() { return g_decode_int24.load() ? std::string("int24-") + kvgate_i24::isa() : "float"; }
std::string set_q4_1_decode(const std::string& how) {
  TORCH_CHECK(how == "int24" || how == "float", "set_q4_1_decode: 'int24' or 'float', got '", how, "'");
  g_decode_int24.store(how == "int24");
  return q4_1_decode();
}

torch::Tensor q8_matmul(torch::Tensor x, torch::Tensor packed, int64_t N) {
  check_tiles("q8_matmul", "q8_pack16", packed, N, Q80::BYTES);
  const int64_t T = packed.size(0), nb = packed.size(1), K = nb * QBLOCK, M = x.size(0);
  check_x("q8_matmul", x, K);
  auto xc = x.contiguous(), pc = packed.contiguous();
  auto y = torch::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const uint8_t* wp = pc.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) { decode_cols<Q80>(xp, nullptr, M, N, nb, wp, yp, t0, t1); });
  return y;
}

namespace {
// decode rows [0, Md) on the float loop and prompt rows [Md, M) on the panels, for one block format
template <class F>
void block_rows(const float* xp, float* yp, int64_t M, int64_t Md, int64_t N, int64_t nb, int64_t T,
                const uint8_t* wp) {
  const int64_t K = nb * QBLOCK, per = sums_per_block<F>();
  if constexpr (std::is_same_v<F, Q4F>) {
    if (Md > 0 && g_decode_int24.load(std::memory_order_relaxed)) {  // Q4_1's integer decode rows, then panels
      const bool amx8 = kvgate_amx8::takes(Md);
      std::vector<float> xs(static_cast<size_t>(Md * nb)), sc(static_cast<size_t>(Md * nb));
      std::vector<int32_t> xd(static_cast<size_t>(Md * nb * kvgate_team::digit_dwords(amx8)));
      at::parallel_for(0, Md * nb, 96, [&](int64_t i0, int64_t i1) {
        kvgate_team::prepare(xp, i0, i1, xs.data(), xd.data(), sc.data(), amx8);
      });
      at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
        kvgate_team::tiles(xd.data(), sc.data(), xs.data(), Md, N, nb, wp, yp, t0, t1, nullptr, 0, true, amx8);
        prefill_cols<F>(xp + Md * K, yp + Md * N, M - Md, N, nb, wp, t0, t1);
      });
      return;
    }
  }
  std::vector<float> xs(F::HAS_M ? static_cast<size_t>(Md * nb * per) : 0);
  if constexpr (F::HAS_M)
    at::parallel_for(0, Md * nb, 96, [&](int64_t i0, int64_t i1) { sums_of<F>(xp, i0, i1, xs.data()); });
  at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
    decode_cols<F>(xp, xs.data(), Md, N, nb, wp, yp, t0, t1);
    prefill_cols<F>(xp + Md * K, yp + Md * N, M - Md, N, nb, wp, t0, t1);
  });
}
}  // namespace

torch::Tensor block_matmul(torch::Tensor x, torch::Tensor packed, int64_t N, int64_t decode_rows) {
  const int64_t bytes = packed.dim() == 3 ? packed.size(2) : -1;
  TORCH_CHECK(bytes == Q4F::BYTES || bytes == Q5F::BYTES || bytes == Q8D::BYTES || bytes == Q80::BYTES ||
                  bytes == Q8S::BYTES,
              "block_matmul: tiles of ", Q4F::BYTES, " (Q4F), ", Q5F::BYTES, " (Q5F), ", Q8D::BYTES, " (Q8D), ",
              Q80::BYTES, " (Q8_0) or ", Q8S::BYTES, " (Q8S) bytes a block, got ",
              packed.sizes(), " (Q4_1's tiles go to q4_1_matmul)");
  check_tiles("block_matmul", "block_pack16", packed, N, bytes);
  const int64_t T = packed.size(0), nb = packed.size(1), K = nb * QBLOCK, M = x.size(0);
  check_x("block_matmul", x, K);
  const int64_t Md = decode_rows < 0 ? M : std::min(decode_rows, M);
  auto xc = x.contiguous(), pc = packed.contiguous();
  auto y = torch::empty({M, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const uint8_t* wp = pc.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  by_format(bytes, [&](auto f) { block_rows<decltype(f)>(xp, yp, M, Md, N, nb, T, wp); });
  return y;
}
