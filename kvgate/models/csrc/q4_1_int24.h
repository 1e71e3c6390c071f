// --weights gguf's decode rows as exact integer products (q4_1_int24.cpp), as tile_matmul.cpp's
// q4_1_matmul calls them: `digits` first, on each thread's share of the blocks, then `decode_cols` on
// each thread's tiles.
#pragma once
#include <cstdint>

namespace kvgate_i24 {

constexpr int64_t XDW = 24;  // activation dwords per row and block: 3 digits x (4 groups x low, high)

const char* isa();  // "avx512-vnni", "avx2" or "scalar": which loop this build runs
// A block's scale: false (sc set to NaN or 0) for a block written as zero digits, else sc = 2^-s and
// inv = 2^s with s the largest integer for which amax * 2^s <= 0x7F7F7F (q4_1_int24.cpp's opening)
bool block_scale(float amax, bool finite, float& sc, float& inv);
// blocks [i0, i1) of x (32 values each) as each block's three digit bytes per value (xd: XDW dwords a
// block) and scale (sc: one a block)
void digits(const float* x, int64_t i0, int64_t i1, int32_t* xd, float* sc);
// decode rows [0, M) against tiles [t0, t1); xs the rows' float block sums; pf_one / pf_more the prefetch
// modes (tile_matmul.cpp's switches: bit 1 L1 ahead, bit 2 the next group into L2) for one row / more;
// f32_scales: Q4F tiles (float32 d and m, 384 bytes a block) instead of Q4_1's (fp16, 320)
void decode_cols(const int32_t* xd, const float* sc, const float* xs, int64_t M, int64_t N, int64_t nb,
                 const uint8_t* w, float* y, int64_t t0, int64_t t1, int pf_one, int pf_more,
                 const uint8_t* nx = nullptr, int64_t nx_bytes = 0, bool f32_scales = false);

}  // namespace kvgate_i24
