// --weights gguf's decode rows on AMX's int8 tiles (amx_i24.cpp): the same bits as q4_1_int24.cpp's
// loops, with their own digit layout. A caller asks `takes(rows)` once per call and, where it is true,
// lays the rows out with `digits` (XDW dwords a block) and runs `decode_cols` on each thread's tiles.
#pragma once
#include <cstdint>

namespace kvgate_amx8 {

constexpr int64_t XDW = 32;  // digit dwords per row and block: four planes of 32 bytes

bool built();                     // compiled in (native.py's KVGATE_AMX_INT8)
bool takes(int64_t rows);         // whether a decode call of this many rows runs here
int64_t min_rows();               // the switch: calls of this many rows and more (0: none)
int64_t set_min_rows(int64_t rows);
// blocks [i0, i1) of x (32 values each) as four digit planes (xd: XDW dwords a block) and scale (sc)
void digits(const float* x, int64_t i0, int64_t i1, int32_t* xd, float* sc);
// decode rows [0, M) against tiles [t0, t1) of Q4_1 (or, f32_scales, Q4F) tiles; xs the rows' float block sums
void decode_cols(const int32_t* xd, const float* sc, const float* xs, int64_t M, int64_t N, int64_t nb,
                 const uint8_t* w, float* y, int64_t t0, int64_t t1, bool f32_scales);

}  // namespace kvgate_amx8
