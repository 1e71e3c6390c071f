// An int8 KV pool's steps and offsets (`--kv-dtype int8`, kvgate.models.kv_int8), checked once for every
// kernel that takes them: the K/V write (layer_ops.cpp), paged decode attention and prefill attention.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <utility>

// (k_scale, v_scale) data for an int8 `pool` of D-value heads: contiguous float32 CPU tensors of a step and
// an offset per (slot, KV head), 2 * pool.numel() / D floats each. (null, null) for a float pool, which
// takes no scales. `op` names the caller in the errors.
inline std::pair<float*, float*> int8_pool_scales(const char* op, const at::Tensor& pool, int64_t D,
                                                 const c10::optional<at::Tensor>& k_scale,
                                                 const c10::optional<at::Tensor>& v_scale) {
  if (pool.scalar_type() != at::kChar) {
    TORCH_CHECK(!k_scale && !v_scale, op, ": k_scale and v_scale are for int8 pools; these pools are ",
                pool.scalar_type());
    return {nullptr, nullptr};
  }
  const int64_t want = 2 * (pool.numel() / D);
  auto fits = [&](const c10::optional<at::Tensor>& s) {
    return s && s->device().is_cpu() && s->scalar_type() == at::kFloat && s->is_contiguous() && s->numel() == want;
  };
  TORCH_CHECK(fits(k_scale) && fits(v_scale), op, ": int8 pools need contiguous float32 k_scale and v_scale of ",
              want, " values (a step and an offset per slot and KV head)");
  return {k_scale->data_ptr<float>(), v_scale->data_ptr<float>()};
}
