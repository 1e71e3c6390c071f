// The Python module of kvgate's C++ kernels: the Q8_0 and Q4_1 float matmuls (tile_matmul.cpp), the
// Q8_0 table's row lookup (q8_embed.cpp), the integer-dot kernels of --weights gguf-q8act
// (int8_dot.cpp), the small layer ops (layer_ops.cpp) and the decode-only layer stack
// (decode_stack.cpp), prompt-chunk attention (prefill_attention.cpp), the sampler's draw (draw.cpp).
// The paged decode attention kernel registers itself as torch.ops.kvgate (paged_attention.cpp).
#include <torch/extension.h>

#include <string>
#include <tuple>

torch::Tensor q8_matmul(torch::Tensor x, torch::Tensor packed, int64_t N);
torch::Tensor q4_1_matmul(torch::Tensor x, torch::Tensor packed, int64_t N, int64_t decode_rows);
torch::Tensor block_matmul(torch::Tensor x, torch::Tensor packed, int64_t N, int64_t decode_rows);
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> q8_rows(torch::Tensor x);
torch::Tensor q4_1_dot8(torch::Tensor x, torch::Tensor packed, int64_t N);
torch::Tensor q8_dot8(torch::Tensor x, torch::Tensor packed, int64_t N);
torch::Tensor q8_embed(torch::Tensor packed, torch::Tensor ids, int64_t rows, int64_t tile_rows);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
torch::Tensor add_rms_norm_(torch::Tensor x, torch::Tensor y, torch::Tensor w, double eps);
torch::Tensor silu_mul(torch::Tensor gu);
void qk_norm_(torch::Tensor qkv, int64_t heads, int64_t kv_heads, torch::Tensor q_w, torch::Tensor k_w, double eps);
void rope_write_kv_(torch::Tensor qkv, int64_t heads, int64_t kv_heads, torch::Tensor cos, torch::Tensor sin,
                    torch::Tensor slots, torch::Tensor k_pool, torch::Tensor v_pool,
                    const c10::optional<torch::Tensor>& k_scale, const c10::optional<torch::Tensor>& v_scale);
void bind_decode_stack(pybind11::module& mod);
torch::Tensor draw_tokens(const torch::Tensor& logits, const torch::Tensor& rows, const torch::Tensor& temps,
                          const torch::Tensor& top_k, const torch::Tensor& top_p, const torch::Tensor& min_p,
                          const torch::Tensor& u, int64_t max_threads);
torch::Tensor draw_probs(const torch::Tensor& logits, const torch::Tensor& rows, const torch::Tensor& temps,
                         const torch::Tensor& top_k, const torch::Tensor& top_p, const torch::Tensor& min_p,
                         int64_t max_threads);
int64_t prefill_attention_lanes();
void prefill_attention_(torch::Tensor out, const torch::Tensor& q, const torch::Tensor& k_pool,
                        const torch::Tensor& v_pool, const torch::Tensor& block_table, int64_t start, int64_t n,
                        int64_t ctx, double scale, const c10::optional<torch::Tensor>& k_scale,
                        const c10::optional<torch::Tensor>& v_scale, int64_t window);
std::string int8_isa();
namespace kvgate_amx {
std::string isa();
std::string set_isa(const std::string& name);
std::string unavailable();
}  // namespace kvgate_amx
std::string set_int8_isa(const std::string& isa);
int64_t int8_small_rows();
int64_t set_int8_small_rows(int64_t bits);
bool int8_uses_pairs(int64_t rows);
std::tuple<int64_t, int64_t> decode_prefetch();
std::tuple<int64_t, int64_t> set_decode_prefetch(int64_t one_row, int64_t more_rows);
std::string q4_1_decode();
std::string set_q4_1_decode(const std::string& how);
namespace kvgate_amx8 {
bool built();
int64_t min_rows();
int64_t set_min_rows(int64_t rows);
}  // namespace kvgate_amx8

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("q8_matmul", &q8_matmul, "float32 x times a Q8_0 table in tiles of 16 rows (q8_pack16) for N outputs");
  mod.def("block_matmul", &block_matmul,
          "float32 x times a GGUF block matrix in tiles of 16 rows (block_pack16: Q4F, Q5F, Q8_0, Q8D or Q8S tiles) for N "
          "outputs; the first decode_rows rows (-1: all) as decode rows, the rest on the exact widened weights");
  mod.def("q4_1_matmul", &q4_1_matmul,
          "float32 x times Q4_1 weights in tiles of 16 rows (q4_1_pack16) for N outputs; rows from decode_rows "
          "on take the prefill loop (-1: every row is a decode row)",
          pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("N"), pybind11::arg("decode_rows") = -1);
  mod.def("q4_1_decode", &q4_1_decode,
          "what q4_1_matmul's decode rows run: int24-<isa> (exact integer products on 24-bit activation blocks, "
          "q4_1_int24.cpp) or float");
  mod.def("set_q4_1_decode", &set_q4_1_decode,
          "'float' runs q4_1_matmul's decode rows on the float loop instead of int24 (other bits: tests and A/B runs)");
  mod.def("q4_1_amx_built", &kvgate_amx8::built,
          "whether this build has amx_i24.cpp's AMX int8 tiles for --weights gguf's decode rows");
  mod.def("q4_1_amx_rows", &kvgate_amx8::min_rows,
          "decode calls of this many rows and more (q4_1_matmul, block_matmul's Q4F, the decode stack) run their "
          "integer products on AMX's int8 tiles: the same bits as the VNNI loop; 0: never");
  mod.def("set_q4_1_amx_rows", &kvgate_amx8::set_min_rows,
          "set that row count (kvgate.models.amx_rows measures it at load; refused where the tiles are not built "
          "or granted); returns q4_1_amx_rows()");
  mod.def("q8_rows", &q8_rows, "float32 rows as 8-bit blocks of 32: (codes int8, d, s = d * sum of codes)");
  mod.def("q4_1_dot8", &q4_1_dot8,
          "float32 x, rounded to 8-bit blocks, times Q4_1 weights repacked in tiles of 8 rows (q4_1_pack8)");
  mod.def("q8_dot8", &q8_dot8, "float32 x, rounded to 8-bit blocks, times a Q8_0 table in tiles of 8 rows (q8_pack8)");
  mod.def("q8_embed", &q8_embed,
          "rows ids of a Q8_0 table held in tiles of tile_rows rows (16: q8_pack16, 8: q8_pack8) as float32");
  mod.def("rms_norm", &rms_norm, "RMSNorm of each row of a float32 [rows, hidden] tensor times w");
  mod.def("add_rms_norm_", &add_rms_norm_, "x += y in place, then RMSNorm of each row times w");
  mod.def("qk_norm_", &qk_norm_, "RMSNorm of each q and k head of fused [rows, qkv] rows in place (Qwen3)");
  mod.def("silu_mul", &silu_mul, "SiLU(gate) * up of fused [rows, 2 x intermediate] gate_up rows");
  mod.def("rope_write_kv_", &rope_write_kv_,
          "rotate-half RoPE on the q and k heads of fused QKV rows in place, then k and v into the pools at slots "
          "(int8 pools: each head's codes, and its scale into k_scale / v_scale)",
          pybind11::arg("qkv"), pybind11::arg("heads"), pybind11::arg("kv_heads"), pybind11::arg("cos"),
          pybind11::arg("sin"), pybind11::arg("slots"), pybind11::arg("k_pool"), pybind11::arg("v_pool"),
          pybind11::arg("k_scale") = pybind11::none(), pybind11::arg("v_scale") = pybind11::none());
  mod.def("int8_isa", &int8_isa, "the instruction set the gguf-q8act tile kernels run: avx512-vnni, avx2 or scalar");
  mod.def("set_int8_isa", &set_int8_isa,
          "'avx2' runs the AVX2 tile kernels in an AVX-512 VNNI build (same bits; tests and A/B benchmarks), "
          "'auto' the fastest built; returns int8_isa()");
  mod.def("int8_small_rows", &int8_small_rows,
          "a mask: bit R set where gguf-q8act calls of R rows (1-4) take the VNNI pairs instead of the AVX2 tiles");
  mod.def("set_int8_small_rows", &set_int8_small_rows,
          "set that mask (the same bits either way; kvgate.models.q8act_rows measures which is faster at load); "
          "returns int8_small_rows()");
  mod.def("int8_uses_pairs", &int8_uses_pairs, "whether a gguf-q8act call of this many rows takes the VNNI pairs now");
  mod.def("prefill_isa", &kvgate_amx::isa,
          "what q4_1_matmul's prompt rows run on: amx-bf16 (amx_q4_1.cpp) or float32 (tile_matmul.cpp's loop)");
  mod.def("set_prefill_isa", &kvgate_amx::set_isa,
          "'float32' runs q4_1_matmul's prompt rows on the float32 loop in an AMX build (other bits, same "
          "numbers to float32 rounding: tests and A/B benchmarks), 'auto' on AMX where granted; returns prefill_isa()");
  mod.def("decode_prefetch", &decode_prefetch,
          "(one row, more rows): how the decode rows of q4_1_matmul and q8_matmul prefetch their tiles, for "
          "groups of one row and of 2-8 rows: 0 none, 1 into L1 a few blocks ahead, 2 the next group's into L2, 3 both");
  mod.def("set_decode_prefetch", &set_decode_prefetch,
          "set that software prefetch's mode per kind of group (the same bits in every mode; "
          "kvgate.models.decode_prefetch.choose measures which is faster at load); returns decode_prefetch()",
          pybind11::arg("one_row"), pybind11::arg("more_rows"));
  mod.def("amx_unavailable", &kvgate_amx::unavailable, "why prompt rows cannot run on AMX here ('' when they can)");
  mod.def("prefill_attention_lanes", &prefill_attention_lanes,
          "the vector lanes of prefill_attention_ in this build (head_dim must be a multiple); 0: not built");
  mod.def("prefill_attention_", &prefill_attention_,
          "a prompt chunk's causal attention over the paged pool, written into out [n, heads * head_dim] (int8 "
          "pools with k_scale and v_scale)",
          pybind11::call_guard<pybind11::gil_scoped_release>(), pybind11::arg("out"), pybind11::arg("q"),
          pybind11::arg("k_pool"), pybind11::arg("v_pool"), pybind11::arg("block_table"), pybind11::arg("start"),
          pybind11::arg("n"), pybind11::arg("ctx"), pybind11::arg("scale"), pybind11::arg("k_scale") = pybind11::none(),
          pybind11::arg("v_scale") = pybind11::none(), pybind11::arg("window") = 0);
  mod.def("draw_tokens", &draw_tokens,
          "one token per row of float32 logits[rows] (temperature, top-k, top-p, min-p per row; u: each row's "
          "uniform), at most max_threads rows at a time",
          pybind11::call_guard<pybind11::gil_scoped_release>());
  mod.def("draw_probs", &draw_probs,
          "the distribution draw_tokens draws each row's token from, as dense float32 probabilities",
          pybind11::call_guard<pybind11::gil_scoped_release>());
  bind_decode_stack(mod);
}
