// A decode-only step's layer stack in one call (kvgate.models.decode_stack): every layer of a Llama
// model whose matmuls are kvgate's Q4_1 kernels (--weights gguf or gguf-q8act), run in C++ with the
// same kernels, in the same order, as the Python loop in kvgate.models.llama.LlamaModel.forward:
//
//   h = rms_norm(x) (or x += pending; rms_norm)  ->  qkv  ->  rope_write_kv_  ->  paged attention
//   ->  o  ->  x += o; rms_norm  ->  gate_up  ->  silu_mul (SiLU(gate) * up)  ->  down = pending
//
// so its result is bit for bit the loop's. What it removes is the loop's per-layer cost outside the
// kernels: ~12 Python-level tensor ops and calls per layer (slices, views, SiLU * up, the argument
// conversions of 6 calls); a one-row gguf-q8act step went from 10.75 to 9.43 ms. It runs without the
// GIL, so the server's thread can stream tokens while a step computes.
//
// It takes only steps where every token is a decode row (verify positions are decode rows too); a step
// holding a prompt chunk keeps the Python loop.
#include <torch/extension.h>

#include <cmath>
#include <string>
#include <vector>

torch::Tensor q4_1_matmul(torch::Tensor x, torch::Tensor packed, int64_t N, int64_t decode_rows);
torch::Tensor q4_1_dot8(torch::Tensor x, torch::Tensor packed, int64_t N);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
torch::Tensor add_rms_norm_(torch::Tensor x, torch::Tensor y, torch::Tensor w, double eps);
torch::Tensor silu_mul(torch::Tensor gu);
void rope_write_kv_(torch::Tensor qkv, int64_t heads, int64_t kv_heads, torch::Tensor cos, torch::Tensor sin,
                    torch::Tensor slots, torch::Tensor k_pool, torch::Tensor v_pool);
at::Tensor paged_attention_rows(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                const at::Tensor& block_tables, const at::Tensor& context_lens, double scale);

namespace {

// One weight matrix: Q4_1 tiles, for the float kernel (kind "q4_1", q4_1_pack16) or the 8-bit-activation
// one ("q4_1_dot8", q4_1_pack8).
struct Mat {
  torch::Tensor packed;
  int64_t out_features;
  bool dot8;

  torch::Tensor operator()(const torch::Tensor& x) const {
    if (dot8) return q4_1_dot8(x, packed, out_features);
    return q4_1_matmul(x, packed, out_features, x.size(0));  // every row a decode row
  }
};

class DecodeStack {
 public:
  // norms: 2 per layer (input, post-attention); mats: 4 per layer (qkv, o, gate_up, down), each with its
  // out_features and kind ("q4_1" or "q4_1_dot8") alongside.
  DecodeStack(std::vector<torch::Tensor> norms, std::vector<torch::Tensor> mats, std::vector<int64_t> out_features,
              std::vector<std::string> kinds, int64_t heads, int64_t kv_heads, int64_t head_dim, double eps)
      : norms_(std::move(norms)), heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps) {
    TORCH_CHECK(mats.size() == out_features.size() && mats.size() == kinds.size() &&
                    mats.size() == 2 * norms_.size() && !mats.empty(),
                "DecodeStack: want 2 norms and 4 matrices (each with out_features and a kind) per layer; got ",
                norms_.size(), " norms, ", mats.size(), " matrices, ", out_features.size(), " out_features, ",
                kinds.size(), " kinds");
    for (size_t i = 0; i < mats.size(); ++i) {
      TORCH_CHECK(kinds[i] == "q4_1" || kinds[i] == "q4_1_dot8", "DecodeStack: matrix ", i, "'s kind must be ",
                  "'q4_1' or 'q4_1_dot8', got '", kinds[i], "'");
      mats_.push_back(Mat{std::move(mats[i]), out_features[i], kinds[i] == "q4_1_dot8"});
    }
  }

  int64_t layers() const { return static_cast<int64_t>(norms_.size() / 2); }

  // x [T, hidden] float32 (updated in place, as the loop's add_rms_norm_ updates it); returns the last
  // layer's output added to it, as `x + pending` makes it.
  // k_cache, v_cache: [layers, blocks, block_size, kv_heads, head_dim], each layer's pool a slice.
  // cos_table, sin_table: the model's [max positions, head_dim] tables, looked up here at `positions`
  // (the loop's `cos[positions]`: the same rows), two torch calls fewer from Python a step.
  torch::Tensor run(torch::Tensor x, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                    const torch::Tensor& cos_table, const torch::Tensor& sin_table, const torch::Tensor& positions,
                    const torch::Tensor& slots, const torch::Tensor& tables, const torch::Tensor& lens) const {
    const int64_t L = layers(), T = x.size(0), H = heads_, D = head_dim_;
    TORCH_CHECK(k_cache.dim() == 5 && k_cache.size(0) == L && v_cache.sizes() == k_cache.sizes(),
                "DecodeStack.run: want K and V caches [", L, " layers, blocks, block_size, kv_heads, head_dim], got ",
                k_cache.sizes(), " and ", v_cache.sizes());
    TORCH_CHECK(tables.size(0) == T && lens.size(0) == T, "DecodeStack.run: every one of the ", T,
                " tokens must be a decode row with a block table and a length");
    const double scale = std::pow(static_cast<double>(D), -0.5);  // Python's D**-0.5
    const auto cos = cos_table.index_select(0, positions), sin = sin_table.index_select(0, positions);
    torch::Tensor pending;
    for (int64_t li = 0; li < L; ++li) {
      const Mat* m = &mats_[4 * li];
      auto h = pending.defined() ? add_rms_norm_(x, pending, norms_[2 * li], eps_) : rms_norm(x, norms_[2 * li], eps_);
      auto qkv = m[0](h);
      const auto k_pool = k_cache.select(0, li), v_pool = v_cache.select(0, li);
      rope_write_kv_(qkv, H, kv_heads_, cos, sin, slots, k_pool, v_pool);
      auto q = qkv.narrow(1, 0, H * D).view({T, H, D});
      auto attn = paged_attention_rows(q, k_pool, v_pool, tables, lens, scale).view({T, H * D});
      h = add_rms_norm_(x, m[1](attn), norms_[2 * li + 1], eps_);
      pending = m[3](silu_mul(m[2](h)));
    }
    return x + pending;
  }

 private:
  std::vector<torch::Tensor> norms_;
  std::vector<Mat> mats_;
  int64_t heads_, kv_heads_, head_dim_;
  double eps_;
};

}  // namespace

void bind_decode_stack(pybind11::module& mod) {
  pybind11::class_<DecodeStack>(mod, "DecodeStack")
      .def(pybind11::init<std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<int64_t>,
                          std::vector<std::string>, int64_t, int64_t, int64_t, double>())
      .def("layers", &DecodeStack::layers)
      .def("run", &DecodeStack::run, pybind11::call_guard<pybind11::gil_scoped_release>(),
           "the layer stack of a decode-only step; x is updated in place, x + the last layer's output returned");
}
