// layer_ops.cpp's row loops on raw pointers, for the decode stack's thread team (decode_stack.cpp): the
// same functions the tensor ops call, so a row's bits are the ops'. One row each; no allocation, no
// checks (the caller validated the tensors), no threads of their own.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>

namespace kvgate_rows {

void norm(const float* x, const float* w, int64_t n, double eps, float* h);  // RMSNorm of one row
void add(float* x, const float* y, int64_t n);                               // x += y
void silu_mul(const float* gu, int64_t inter, float* act);                   // SiLU(gate) * up of one fused row
void rope(float* row, int64_t heads, const float* cos, const float* sin, int64_t D);  // the first `heads` heads
// one token's k and v (kv floats each, k then v at kv_row) into the pools' slot, in the pools' dtype
void write_kv(const float* kv_row, int64_t kv, int64_t slot, at::ScalarType pool, void* k_pool, void* v_pool);

}  // namespace kvgate_rows
