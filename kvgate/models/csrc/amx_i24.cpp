// --weights gguf's decode rows on AMX's int8 tiles: q4_1_int24.cpp's exact integer products computed by
// the tile unit instead of VNNI dot products, for CPUs that list amx_int8. The same bits for every row,
// so which kernel takes a call may depend on its row count alone (`takes`, set by a probe at load:
// kvgate/models/amx_rows.py).
//
// Why the bits agree. A decode row's block b is an exact integer until its last float steps: with q_k the
// row's 24-bit fixed point values and c_k the codes (0..15), Q = sum_k c_k q_k, and the VNNI loop's
// S = fma(I2, 65536, I1 * 256 + I0) (its three base-256 digit sums) is Q rounded once to float32. Here q
// is split otherwise, q = G0 + 16 G1 + 4096 (G2 + 16 G3) with G0, G2 in 0..15 and G1, G3 signed bytes
// (`digits`), and one TDPBSUD over K = 64 bytes, [G0 | G1] against [c | 16 c], gives the exact
// L = sum c (G0 + 16 G1); another gives H from G2, G3 (|L|, |H| < 2^20). S = fma(H, 4096, L) is Q rounded
// once again: the same float. Then acc = fma(d, S * sc, acc), acc = fma(m, xs, acc), blocks in order, as
// the VNNI loop does (tests/test_amx_i24.py compares every row count, formats and hard blocks bit for bit).
//
// - **A operands** (`digits`): per row and block 128 bytes, planes G0, G1, G2, G3 of 32 bytes, each in the
//   VNNI loop's k order (dword 2g + h holds the bytes for k = 8g + h + 2i, i = 0..3); a tile loads
//   16 rows' [G0 | G1] or [G2 | G3] in place, rows nb * XDW dwords apart.
// - **B operand** (`codes_b`): 16 rows of 16 dwords. Row 2g + h holds, for output j, its codes for the
//   same four k (the VNNI loop's byte permute of the block's 64-byte group g, low nibbles for h = 0,
//   high for h = 1); rows 8-15 the same times 16 (the nibble masked in place: c * 16 <= 240).
// - **Two tiles of 16 outputs a pass** share the A operands: four independent TDPBSUDs a block keep the
//   tile unit busy through its latency. The sums leave through memory; their float steps run one block
//   behind, and the codes are laid out AHEAD blocks ahead (a tile load right after the stores that
//   wrote its bytes waits for them: one block ahead cost 1.5x at one row).
//
// Measured on the AMX Xeon (2 threads, SmolLM2's four layer shapes x 30, cache-warm): 16 rows 10.6 ->
// 5.7 ms, 8 rows 5.4 -> 3.5, 1 row 0.93 -> 2.6 (the VNNI loop keeps the few-row calls).
//
// Built (KVGATE_AMX_INT8 from kvgate/models/native.py) where /proc/cpuinfo lists amx_int8 and AVX-512
// VBMI besides what amx_q4_1.cpp needs (amx_tile, amx_bf16, avx512_bf16, AVX-512 F/BW/VL): the tile
// state is amx_q4_1.cpp's grant. The functions carry their own target attributes.
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cfloat>
#include <cstring>

#include "amx_i24.h"
#include "q4_1_int24.h"

#if defined(KVGATE_AMX_INT8)
#include <immintrin.h>
#define KVGATE_AMX8_FN __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512vbmi,f16c,fma")))
#endif

namespace kvgate_amx {
bool available();  // amx_q4_1.cpp: whether this process was granted the tile state
}

namespace kvgate_amx8 {

namespace {
std::atomic<int64_t> g_min_rows{0};  // decode calls of this many rows and more take the tiles; 0: none
}  // namespace

bool built() {
#if defined(KVGATE_AMX_INT8)
  return true;
#else
  return false;
#endif
}

bool takes(int64_t rows) {
  const int64_t from = g_min_rows.load(std::memory_order_relaxed);
  return from > 0 && rows >= from;
}

int64_t min_rows() { return g_min_rows.load(); }

int64_t set_min_rows(int64_t rows) {
  TORCH_CHECK(rows >= 0, "set_q4_1_amx_rows: a row count >= 1, or 0 for never; got ", rows);
  TORCH_CHECK(rows == 0 || (built() && kvgate_amx::available()),
              "set_q4_1_amx_rows: this build or process has no AMX int8 tiles (the CPU must list amx_tile, "
              "amx_int8, amx_bf16, avx512_bf16 and avx512vbmi, and Linux must grant the tile state)");
  g_min_rows.store(rows);
  return rows;
}

#if defined(KVGATE_AMX_INT8)
namespace {

constexpr int64_t QBLOCK = 32, TILE = 16, AHEAD = 3, RING = 4;
template <bool F32>
constexpr int64_t TBYTES = F32 ? 384 : 320;
template <bool F32>
constexpr int64_t MOFF = F32 ? 320 : 288;

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0, tmm1: the first tile's low and high sums (R rows x 16 outputs, int32), tmm5, tmm6 the second's;
// tmm2, tmm3: the rows' [G0 | G1] and [G2 | G3] (R rows x 64 bytes); tmm4, tmm7: the two tiles' codes
// (16 rows x 64 bytes)
KVGATE_AMX8_FN void load_config(int64_t R) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = static_cast<uint8_t>(t == 4 || t == 7 ? 16 : R);
  }
  asm volatile("" : : "r"(&cfg) : "memory");  // GCC 12 would drop the stores as dead (amx_q4_1.cpp)
  _tile_loadconfig(&cfg);
}

template <bool F32>
KVGATE_AMX8_FN inline __m512 scales16(const uint8_t* p) {
  if constexpr (F32) return _mm512_loadu_ps(p);
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// a tile block's 256 code bytes as the B operand (see the opening)
KVGATE_AMX8_FN inline void codes_b(const uint8_t* wb, uint8_t* bt, __m512i idx) {
  const __m512i low = _mm512_set1_epi8(15), high = _mm512_set1_epi8(-16);
  for (int g = 0; g < 4; ++g) {
    const __m512i v = _mm512_permutexvar_epi8(idx, _mm512_loadu_si512(wb + 64 * g));
    _mm512_store_si512(bt + 128 * g, _mm512_and_si512(v, low));
    _mm512_store_si512(bt + 128 * g + 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
    _mm512_store_si512(bt + 512 + 128 * g, _mm512_and_si512(_mm512_slli_epi16(v, 4), high));
    _mm512_store_si512(bt + 512 + 128 * g + 64, _mm512_and_si512(v, high));
  }
}

// block b's float steps for rows [0, R): s holds its low sums, then its high ones; acc the rows' sums
template <bool F32>
KVGATE_AMX8_FN inline void finish_block(__m512* acc, const int32_t* s, const uint8_t* wb, const float* sc,
                                        const float* xs, int64_t nb, int64_t b, int64_t R) {
  const __m512 d = scales16<F32>(wb + 256), m = scales16<F32>(wb + MOFF<F32>), base = _mm512_set1_ps(4096.f);
  for (int64_t r = 0; r < R; ++r) {
    const __m512 S = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(s + TILE * TILE + TILE * r)), base,
                                     _mm512_cvtepi32_ps(_mm512_load_si512(s + TILE * r)));
    acc[r] = _mm512_fmadd_ps(d, _mm512_mul_ps(S, _mm512_set1_ps(sc[r * nb + b])), acc[r]);
    acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[r * nb + b]), acc[r]);
  }
}

// rows [0, R) (at most 16) against tiles [t, t + NT) (NT = 1 or 2); y: the rows' first output
template <bool F32, int NT>
KVGATE_AMX8_FN void tiles(const int32_t* xd, const float* sc, const float* xs, int64_t R, int64_t N, int64_t nb,
                          const uint8_t* w, float* y, int64_t t) {
  constexpr int64_t TB = TBYTES<F32>;
  const int64_t tstride = nb * TB, lda = nb * XDW * 4;
  alignas(64) uint8_t ix[64];
  for (int n = 0; n < 16; ++n)
    for (int q = 0; q < 4; ++q) ix[4 * n + q] = static_cast<uint8_t>(16 * q + n);
  const __m512i idx = _mm512_load_si512(ix);
  alignas(64) uint8_t bt[RING][NT][1024];
  alignas(64) int32_t s[RING][NT][2 * TILE * TILE];
  __m512 acc[NT][TILE];
  const uint8_t* wt[NT];
  for (int u = 0; u < NT; ++u) {
    wt[u] = w + (t + u) * tstride;
    for (int64_t r = 0; r < R; ++r) acc[u][r] = _mm512_setzero_ps();
  }
  for (int64_t a = 0; a < AHEAD && a < nb; ++a)
    for (int u = 0; u < NT; ++u) codes_b(wt[u] + a * TB, bt[a % RING][u], idx);
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t at = b % RING;
    _tile_loadd(2, xd + b * XDW, lda);
    _tile_loadd(3, xd + b * XDW + 16, lda);
    _tile_loadd(4, bt[at][0], 64);
    if (NT == 2) _tile_loadd(7, bt[at][NT - 1], 64);
    _tile_zero(0);
    _tile_zero(1);
    if (NT == 2) {
      _tile_zero(5);
      _tile_zero(6);
    }
    _tile_dpbsud(0, 2, 4);
    _tile_dpbsud(1, 3, 4);
    if (NT == 2) {
      _tile_dpbsud(5, 2, 7);
      _tile_dpbsud(6, 3, 7);
    }
    _tile_stored(0, s[at][0], 64);
    _tile_stored(1, s[at][0] + TILE * TILE, 64);
    if (NT == 2) {
      _tile_stored(5, s[at][NT - 1], 64);
      _tile_stored(6, s[at][NT - 1] + TILE * TILE, 64);
    }
    if (b + AHEAD < nb)
      for (int u = 0; u < NT; ++u) codes_b(wt[u] + (b + AHEAD) * TB, bt[(b + AHEAD) % RING][u], idx);
    if (b > 0)
      for (int u = 0; u < NT; ++u) finish_block<F32>(acc[u], s[(b - 1) % RING][u], wt[u] + (b - 1) * TB, sc, xs, nb, b - 1, R);
  }
  for (int u = 0; u < NT; ++u) {
    finish_block<F32>(acc[u], s[(nb - 1) % RING][u], wt[u] + (nb - 1) * TB, sc, xs, nb, nb - 1, R);
    const int64_t width = std::min(TILE, N - (t + u) * TILE);  // the last tile's padding outputs stay out
    const auto keep = static_cast<__mmask16>((1u << width) - 1);
    for (int64_t r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * N + (t + u) * TILE, keep, acc[u][r]);
  }
}

template <bool F32>
KVGATE_AMX8_FN void cols(const int32_t* xd, const float* sc, const float* xs, int64_t M, int64_t N, int64_t nb,
                         const uint8_t* w, float* y, int64_t t0, int64_t t1) {
  int64_t configured = 0;
  for (int64_t m0 = 0; m0 < M; m0 += TILE) {
    const int64_t R = std::min(TILE, M - m0);
    if (R != configured) load_config(R), configured = R;
    const int32_t* xdr = xd + m0 * nb * XDW;
    const float *scr = sc + m0 * nb, *xsr = xs + m0 * nb;
    int64_t t = t0;
    for (; t + 2 <= t1; t += 2) tiles<F32, 2>(xdr, scr, xsr, R, N, nb, w, y + m0 * N, t);
    if (t < t1) tiles<F32, 1>(xdr, scr, xsr, R, N, nb, w, y + m0 * N, t);
  }
  _tile_release();
}

}  // namespace

// Blocks [i0, i1) of x as q4_1_int24.cpp's q_k, in four digit planes (XDW dwords a block, see the opening)
KVGATE_AMX8_FN void digits(const float* x, int64_t i0, int64_t i1, int32_t* xd, float* sc) {
  alignas(64) uint8_t lk[16];
  for (int t = 0; t < 16; ++t) lk[t] = static_cast<uint8_t>(8 * (t / 8) + (t / 4) % 2 + 2 * (t % 4));
  const __m512i perm = _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(lk)));
  const __m512i c15 = _mm512_set1_epi32(15), c128 = _mm512_set1_epi32(128), c255 = _mm512_set1_epi32(255);
  const __m512 big = _mm512_set1_ps(FLT_MAX);
  for (int64_t i = i0; i < i1; ++i) {
    const float* xb = x + i * QBLOCK;
    int8_t* out = reinterpret_cast<int8_t*>(xd + i * XDW);
    const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
    const __m512 a0 = _mm512_abs_ps(x0), a1 = _mm512_abs_ps(x1);
    const bool finite = (_mm512_cmp_ps_mask(a0, big, _CMP_LE_OQ) & _mm512_cmp_ps_mask(a1, big, _CMP_LE_OQ)) == 0xFFFF;
    float inv = 0.f;
    if (!kvgate_i24::block_scale(finite ? _mm512_reduce_max_ps(_mm512_max_ps(a0, a1)) : 0.f, finite, sc[i], inv)) {
      std::memset(out, 0, XDW * 4);
      continue;
    }
    const __m512 vinv = _mm512_set1_ps(inv);
    for (int half = 0; half < 2; ++half) {
      const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_permutexvar_ps(perm, half ? x1 : x0), vinv));
      const __m512i g0 = _mm512_and_si512(q, c15), r = _mm512_srai_epi32(q, 4);
      const __m512i g1 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(r, c128), c255), c128);
      const __m512i r2 = _mm512_srai_epi32(_mm512_sub_epi32(r, g1), 8);
      const __m512i g2 = _mm512_and_si512(r2, c15), g3 = _mm512_srai_epi32(r2, 4);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16 * half), _mm512_cvtepi32_epi8(g0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 32 + 16 * half), _mm512_cvtepi32_epi8(g1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 64 + 16 * half), _mm512_cvtepi32_epi8(g2));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 96 + 16 * half), _mm512_cvtepi32_epi8(g3));
    }
  }
}

void decode_cols(const int32_t* xd, const float* sc, const float* xs, int64_t M, int64_t N, int64_t nb,
                 const uint8_t* w, float* y, int64_t t0, int64_t t1, bool f32_scales) {
  if (f32_scales)
    cols<true>(xd, sc, xs, M, N, nb, w, y, t0, t1);
  else
    cols<false>(xd, sc, xs, M, N, nb, w, y, t0, t1);
}
#else
void digits(const float*, int64_t, int64_t, int32_t*, float*) {
  TORCH_CHECK(false, "kvgate_amx8::digits: this build has no AMX int8 tiles");
}
void decode_cols(const int32_t*, const float*, const float*, int64_t, int64_t, int64_t, const uint8_t*, float*,
                 int64_t, int64_t, bool) {
  TORCH_CHECK(false, "kvgate_amx8::decode_cols: this build has no AMX int8 tiles");
}
#endif

}  // namespace kvgate_amx8
