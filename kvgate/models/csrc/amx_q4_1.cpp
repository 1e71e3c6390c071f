// Prompt rows of a Q4_1 matmul (--weights gguf) on AMX's bf16 tiles, for CPUs that list amx_bf16:
// the same numbers as the float32 prompt loop in tile_matmul.cpp, to float32 rounding.
//
// A Q4_1 weight is d * c + m with c in 0..15, so per output and block of 32 k the dot product is
// d * sum(c x) + m * sum(x) (the factoring tile_matmul.cpp's decode rows use). The codes c are exact in
// bfloat16, and every float32 x is exactly x1 + x2 + x3 with each part a bfloat16 (8 bits of mantissa
// each, by round-to-nearest of what the previous parts leave). So sum(c x) is three bf16 dot products
// whose products are exact in float32, accumulated by the tile unit in float32: one 16 x 16 x 32
// TDPBF16PS per part is one block of 16 activation rows against 16 outputs. Each block's sums leave
// the tile unit through memory and are scaled in zmm registers, acc = fma(d, s, acc) and then
// acc = fma(m, xs, acc), blocks in order. Against the exact weights' float32 sum the result differs at
// float32 rounding (tests/test_amx_q4_1.py holds it to 2e-6 of the largest output).
//
// Every output is computed from its own row of x and its own output's weights in an order fixed by K
// alone, so a prompt row's bits never depend on the rows beside it or on how the prompt is chunked;
// the tile count of a call only pads rows with zeros. The bits differ from the float32 prompt loop's
// (a different summation), so one build uses one of the two for every prompt row: `set_prefill_isa`.
//
// Built only where /proc/cpuinfo lists amx_tile, amx_bf16 and avx512_bf16 (KVGATE_AMX from
// kvgate/models/native.py); the functions carry their own target attributes, so nothing else in the
// module is compiled for AMX. Linux hands a process the tile state only on request
// (arch_prctl ARCH_REQ_XCOMP_PERM); when that fails the float32 loop stays and amx_unavailable() says
// why.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>

#if defined(KVGATE_AMX)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define KVGATE_AMX_FN __attribute__((target("amx-tile,amx-bf16,avx512bf16,avx512f,avx512bw,avx512vl")))
#endif

namespace kvgate_amx {

constexpr int64_t QBLOCK = 32, TILE = 16, TBYTES = 320;  // tile_matmul.cpp's Q4_1 tile-block
constexpr int64_t PANEL = TILE * QBLOCK * 2;              // bytes of one tile-block as bf16 codes: 1 KiB
constexpr int64_t TILE_A = TILE * QBLOCK;                 // bf16 values of one A operand (16 rows x 32 k)

namespace {
std::once_flag perm_once;
std::string why_not =
#if defined(KVGATE_AMX)
    "";
#else
    "this build has no AMX kernels (the CPU does not list amx_tile, amx_bf16 and avx512_bf16)";
#endif
bool granted = false;
bool wanted = true;  // set_prefill_isa("float32") turns the AMX loop off

void request_tiles() {
#if defined(KVGATE_AMX)
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0) {
    granted = true;
  } else {
    why_not = std::string("the kernel refused this process AMX's tile state (arch_prctl ARCH_REQ_XCOMP_PERM: ") +
              std::strerror(errno) + ")";
  }
#endif
}
}  // namespace

bool available() {
  std::call_once(perm_once, request_tiles);
  return granted;
}

bool active() { return wanted && available(); }

std::string unavailable() {
  available();
  return why_not;
}

std::string isa() { return active() ? "amx-bf16" : "float32"; }

std::string set_isa(const std::string& name) {
  if (name == "float32") {
    wanted = false;
  } else if (name == "amx-bf16" || name == "auto") {
    TORCH_CHECK(name == "auto" || available(), "set_prefill_isa('amx-bf16'): ", unavailable());
    wanted = true;
  } else {
    TORCH_CHECK(false, "set_prefill_isa: want 'auto', 'amx-bf16' or 'float32', got '", name, "'");
  }
  return isa();
}

#if defined(KVGATE_AMX)
namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0, tmm1: two output tiles' block sums; tmm2-4: the activations' three parts; tmm5, tmm6: codes
KVGATE_AMX_FN void load_config() {
  TileConfig cfg;
  for (int t = 0; t < 7; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  // GCC 12 does not see ldtilecfg's read of the struct and drops these stores as dead without this
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// Row r of x [M, K] float32 as three bf16 parts and each block's sum of x, xs [nb]. The parts lie as
// whole tiles, [row tile][block][part][16 rows][32 values] (`TILE_A` values per tile): each
// TDPBF16PS A operand is one contiguous 1 KiB and a block's three are 3 KiB together. Against rows of
// K values (16 lines K * 2 bytes apart per tile): 3,072 x 576 at 256 rows 1.77 -> 1.59-1.66 ms, 30
// layers' worth of SmolLM2's four shapes 110.6 -> 102.6-107.8 ms (AMX Xeon, 2 threads); the same
// bits. `r16` is r's place in its tile; a row from M on is zeros.
KVGATE_AMX_FN void split_row(const float* xr, bool zero, int64_t K, uint16_t* tile, int64_t r16, float* xs) {
  const int64_t nb = K / QBLOCK;
  for (int64_t b = 0; b < nb; ++b) {
    uint16_t* dst = tile + b * 3 * TILE_A + r16 * QBLOCK;
    if (zero) {
      for (int i = 0; i < 3; ++i) std::memset(dst + i * TILE_A, 0, QBLOCK * 2);
      xs[b] = 0.f;
      continue;
    }
    __m512 sum = _mm512_setzero_ps();
    for (int h = 0; h < 2; ++h) {
      const int64_t k = b * QBLOCK + 16 * h;
      const __m512 v = _mm512_loadu_ps(xr + k);
      sum = _mm512_add_ps(sum, v);
      const __m256bh a = _mm512_cvtneps_pbh(v);
      const __m512 r1 = _mm512_sub_ps(v, _mm512_cvtpbh_ps(a));
      const __m256bh bb = _mm512_cvtneps_pbh(r1);
      const __m512 r2 = _mm512_sub_ps(r1, _mm512_cvtpbh_ps(bb));
      const __m256bh c = _mm512_cvtneps_pbh(r2);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * h), reinterpret_cast<const __m256i&>(a));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + TILE_A + 16 * h), reinterpret_cast<const __m256i&>(bb));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 2 * TILE_A + 16 * h), reinterpret_cast<const __m256i&>(c));
    }
    xs[b] = _mm512_reduce_add_ps(sum);
  }
}

KVGATE_AMX_FN void release_tiles() { _tile_release(); }

// A tile's nb blocks as TDPBF16PS's B operand: per block 16 rows p (k = 2p, 2p + 1), each the 16
// outputs' pair of codes as bf16, output j at words 2j and 2j + 1.
KVGATE_AMX_FN void widen_tile(const uint8_t* w, int64_t nb, uint16_t* panel) {
  // word c (and c + 16) = the bf16 bits of the float c, for c = 0..15 (0x3f80 is 1.0; exact, short mantissas)
  alignas(64) static constexpr uint16_t lv[32] = {
      0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0, 0x4100, 0x4110, 0x4120,
      0x4130, 0x4140, 0x4150, 0x4160, 0x4170, 0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0,
      0x40c0, 0x40e0, 0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};
  const __m512i levels = _mm512_load_si512(lv);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb = w + b * TBYTES;
    uint16_t* pb = panel + b * (PANEL / 2);
    for (int p = 0; p < 16; ++p) {
      const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + 16 * p)));
      const __m512i pair = _mm512_or_si512(_mm512_and_si512(c, _mm512_set1_epi32(15)),
                                           _mm512_slli_epi32(_mm512_srli_epi32(c, 4), 16));
      _mm512_store_si512(pb + 32 * p, _mm512_permutexvar_epi16(pair, levels));
    }
  }
}

// acc[r][16 t ..) = fma(m_t, xs[r], fma(d_t, s[t][r], acc)) for block b of NT tiles (w: their blocks)
template <int NT>
KVGATE_AMX_FN inline void scale_block(float (*acc)[NT * TILE], const float (*s)[TILE * TILE], const uint8_t* const* w,
                                      int64_t b, const float* xsr, int64_t nb) {
  for (int t = 0; t < NT; ++t) {
    const uint8_t* wb = w[t] + b * TBYTES;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 256)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 288)));
    for (int r = 0; r < TILE; ++r) {
      __m512 v = _mm512_load_ps(acc[r] + t * TILE);
      v = _mm512_fmadd_ps(d, _mm512_load_ps(s[t] + r * TILE), v);
      v = _mm512_fmadd_ps(m, _mm512_set1_ps(xsr[r * nb + b]), v);
      _mm512_store_ps(acc[r] + t * TILE, v);
    }
  }
}

// Rows [16 rt, 16 rt + 16) of the split x against NT tiles' panels; writes y[rows < M, outputs < N].
// Block b's sums are scaled while the tile unit computes block b + 1's (they go through memory, and a
// load right after the tile store that wrote it would wait for it).
template <int NT>
KVGATE_AMX_FN void row_tile(const uint16_t* parts, const float* xs, int64_t rt, int64_t M, int64_t K,
                            const uint8_t* const* w, const uint16_t* const* panel, float* y, int64_t N, int64_t col0) {
  const int64_t nb = K / QBLOCK;
  alignas(64) float acc[TILE][NT * TILE];
  alignas(64) float s[2][NT][TILE * TILE];
  std::memset(acc, 0, sizeof acc);
  const uint16_t* a = parts + rt * nb * 3 * TILE_A;
  const float* xsr = xs + rt * TILE * nb;
  for (int64_t b = 0; b < nb; ++b) {
    _tile_zero(0);
    if (NT == 2) _tile_zero(1);
    const uint16_t* ab = a + b * 3 * TILE_A;
    _tile_loadd(2, ab, 64);
    _tile_loadd(3, ab + TILE_A, 64);
    _tile_loadd(4, ab + 2 * TILE_A, 64);
    _tile_loadd(5, panel[0] + b * (PANEL / 2), 64);
    if (NT == 2) _tile_loadd(6, panel[1] + b * (PANEL / 2), 64);
    _tile_dpbf16ps(0, 2, 5);
    if (NT == 2) _tile_dpbf16ps(1, 2, 6);
    _tile_dpbf16ps(0, 3, 5);
    if (NT == 2) _tile_dpbf16ps(1, 3, 6);
    _tile_dpbf16ps(0, 4, 5);
    if (NT == 2) _tile_dpbf16ps(1, 4, 6);
    _tile_stored(0, s[b & 1][0], 64);
    if (NT == 2) _tile_stored(1, s[b & 1][NT - 1], 64);
    if (b > 0) scale_block<NT>(acc, s[(b - 1) & 1], w, b - 1, xsr, nb);
  }
  scale_block<NT>(acc, s[(nb - 1) & 1], w, nb - 1, xsr, nb);
  const int64_t rows = std::min<int64_t>(TILE, M - rt * TILE), width = std::min<int64_t>(NT * TILE, N - col0);
  for (int64_t r = 0; r < rows; ++r) std::memcpy(y + (rt * TILE + r) * N + col0, acc[r], width * 4);
}

}  // namespace

// y [M, N] (row stride N) = prompt rows x [M, K] times Q4_1 tiles w [T, nb, 320] (q4_1_pack16).
KVGATE_AMX_FN void q4_1_prefill(const float* x, float* y, int64_t M, int64_t N, int64_t nb, const uint8_t* w) {
  const int64_t K = nb * QBLOCK, T = (N + TILE - 1) / TILE, Mp = (M + TILE - 1) / TILE * TILE;
  auto parts_t = torch::empty({3 * Mp * K}, torch::kInt16);
  auto xs_t = torch::empty({Mp * nb}, torch::kFloat32);
  auto panels_t = torch::empty({T * nb * PANEL / 2}, torch::kInt16);
  uint16_t* parts = reinterpret_cast<uint16_t*>(parts_t.data_ptr<int16_t>());
  uint16_t* panels = reinterpret_cast<uint16_t*>(panels_t.data_ptr<int16_t>());
  float* xs = xs_t.data_ptr<float>();
  at::parallel_for(0, Mp, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      split_row(x + r * K, r >= M, K, parts + (r / TILE) * nb * 3 * TILE_A, r % TILE, xs + r * nb);
  });
  at::parallel_for(0, T, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) widen_tile(w + t * nb * TBYTES, nb, panels + t * nb * (PANEL / 2));
  });
  // activations per pass over the panels: about 512 KiB of the three parts
  const int64_t group = std::max<int64_t>(1, (512 * 1024) / (6 * K * TILE));
  const int64_t pairs = (T + 1) / 2;
  at::parallel_for(0, pairs, 1, [&](int64_t q0, int64_t q1) {
    load_config();
    for (int64_t g0 = 0; g0 < Mp / TILE; g0 += group) {
      const int64_t g1 = std::min(g0 + group, Mp / TILE);
      for (int64_t q = q0; q < q1; ++q) {
        const int64_t t = 2 * q;
        const uint8_t* wt[2] = {w + t * nb * TBYTES, w + (t + 1) * nb * TBYTES};
        const uint16_t* pt[2] = {panels + t * nb * (PANEL / 2), panels + (t + 1) * nb * (PANEL / 2)};
        for (int64_t rt = g0; rt < g1; ++rt) {
          if (t + 1 < T)
            row_tile<2>(parts, xs, rt, M, K, wt, pt, y, N, t * TILE);
          else
            row_tile<1>(parts, xs, rt, M, K, wt, pt, y, N, t * TILE);
        }
      }
    }
    release_tiles();
  });
}
#else
void q4_1_prefill(const float*, float*, int64_t, int64_t, int64_t, const uint8_t*) {
  TORCH_CHECK(false, "q4_1_prefill: ", why_not);
}
#endif

}  // namespace kvgate_amx
