// The embedding lookup of a Q8_0 table held in matmul tiles (kvgate.models.q8_head): row `id` of the
// table, w_k = float(c_k) * d_b, gathered from the tile that holds it, as float32 [n, K].
//
// Two layouts, both uint8 [T, K/32, bytes per block], the tiles' padding rows past the vocabulary
// zero (ids there are refused, as ids past the table):
// - tiles of 16 rows (q8_pack16, the float LM head): per block, byte 16 k + j is row j's code at k, then
//   the 16 rows' d as float32 from byte 512;
// - tiles of 8 rows (q8_pack8, gguf-q8act's head): per block, byte 32 g + 4 j + q is row j's code at
//   k = 4 g + q, then the 8 rows' d as float32 from byte 256.
// One product per value, so these are the floats the ATen gather it replaced computed (codes widened,
// times the block's scale). That gather cost a one-row step ~0.14 ms in ~10 tensor ops; this is ~1 us.
#include <torch/extension.h>

#include <cstdint>
#include <cstring>

namespace {
constexpr int64_t QBLOCK = 32;
}

torch::Tensor q8_embed(torch::Tensor packed, torch::Tensor ids, int64_t rows, int64_t tile_rows) {
  TORCH_CHECK(tile_rows == 16 || tile_rows == 8, "q8_embed: tiles hold 16 (q8_pack16) or 8 (q8_pack8) rows, got ",
              tile_rows);
  const int64_t block_bytes = tile_rows * (QBLOCK + 4);
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == torch::kUInt8 && packed.dim() == 3 &&
                  packed.size(2) == block_bytes && packed.is_contiguous(),
              "q8_embed: want contiguous uint8 tiles [T, K/32, ", block_bytes, "], got ", packed.sizes(), " ",
              packed.scalar_type());
  TORCH_CHECK(rows >= 0 && rows <= packed.size(0) * tile_rows, "q8_embed: ", rows, " rows do not fit ",
              packed.size(0), " tiles of ", tile_rows);
  TORCH_CHECK(ids.device().is_cpu() && ids.dim() == 1 && at::isIntegralType(ids.scalar_type(), /*includeBool=*/false),
              "q8_embed: want a 1-D CPU tensor of integer token ids, got ", ids.sizes(), " ", ids.scalar_type());
  const auto idc = ids.to(torch::kInt64).contiguous();
  const int64_t n = idc.numel(), nb = packed.size(1), K = nb * QBLOCK;
  const int64_t* ip = idc.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)  // as index_select would refuse them
    TORCH_CHECK_INDEX(ip[i] >= 0 && ip[i] < rows, "token ids must be in [0, ", rows, "), got ", ip[i]);
  auto out = torch::empty({n, K}, torch::kFloat32);
  float* op = out.data_ptr<float>();
  const uint8_t* base = packed.data_ptr<uint8_t>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = ip[i] / tile_rows, j = ip[i] % tile_rows;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = base + (t * nb + b) * block_bytes;
      float d;
      std::memcpy(&d, blk + tile_rows * QBLOCK + 4 * j, 4);
      float* y = op + i * K + b * QBLOCK;
      for (int64_t k = 0; k < QBLOCK; ++k) {
        const int64_t at = tile_rows == 16 ? 16 * k + j : 32 * (k / 4) + 4 * j + k % 4;
        y[k] = static_cast<float>(static_cast<int8_t>(blk[at])) * d;
      }
    }
  }
  return out;
}
