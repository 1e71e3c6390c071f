// layer_ops.cpp's row loops on raw pointers, for the decode stack's thread team (decode_stack.cpp): the
// same functions the tensor ops call, so a row's bits are the ops'. One row each; no allocation, no
// checks (the caller validated the tensors), no threads of their own.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>

namespace kvgate_rows {

void norm(const float* x, const float* w, int64_t n, double eps, float* h);  // RMSNorm of one row
// RMSNorm of each of `heads` consecutive D-value heads in place, every head by the same w [D] (Qwen3's q/k)
void head_norms(float* row, int64_t heads, const float* w, int64_t D, double eps);
void add(float* x, const float* y, int64_t n);                               // x += y
void silu_mul(const float* gu, int64_t inter, float* act);                   // SiLU(gate) * up of one fused row
void rope(float* row, int64_t heads, const float* cos, const float* sin, int64_t D);  // the first `heads` heads
// one token's k and v (kv floats each, k then v at kv_row) into the pools' slot, in the pools' dtype; an
// int8 pool (`--kv-dtype int8`) takes each head's D values as codes and writes the head's step and offset
// into k_scale / v_scale ([slots, kv / D, 2] float32) at 2 (slot * (kv / D) + head) (`quantize_head`)
void write_kv(const float* kv_row, int64_t kv, int64_t slot, at::ScalarType pool, void* k_pool, void* v_pool,
              float* k_scale, float* v_scale, int64_t head_dim);
bool distinct(const int64_t* slots, int64_t n);  // no slot twice among n (writes that threads may split)
// One head's D float32 values (lo = min, hi = max) as int8 codes, a step s = (hi - lo) / 255 and an
// offset z = lo + 128 s (written to scale[0], scale[1]): code = round((x - z) / s) to nearest even, within
// [-128, 127]; codes 0 and z = lo where s = 0 (codes 0 also where a value is NaN or infinite: s is then
// NaN or infinite). A code stands for code * s + z. PyTorch's `kvgate.models.kv_int8.quantize` is the
// same expressions: the same bits.
void quantize_head(const float* x, int64_t D, int8_t* codes, float* scale);

}  // namespace kvgate_rows
