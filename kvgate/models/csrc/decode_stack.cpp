// A decode-only step's layer stack in one call (kvgate.models.decode_stack): every layer of a Llama
// model whose matmuls are kvgate's Q4_1 kernels (--weights gguf or gguf-q8act), run in C++ with the
// same kernels, in the same order, as the Python loop in kvgate.models.llama.LlamaModel.forward:
//
//   h = rms_norm(x) (or x += pending; rms_norm)  ->  qkv  (->  qk_norm_: Qwen3)  ->  rope_write_kv_  ->  paged attention
//   ->  o  ->  x += o; rms_norm  ->  gate_up  ->  silu_mul (SiLU(gate) * up)  ->  down = pending
//
// so its result is bit for bit the loop's. What it removes is the loop's per-layer cost outside the
// kernels: ~12 Python-level tensor ops and calls per layer (slices, views, SiLU * up, the argument
// conversions of 6 calls); a one-row gguf-q8act step went from 10.75 to 9.43 ms. It runs without the
// GIL, so the server's thread can stream tokens while a step computes.
//
// It takes only steps where every token is a decode row (verify positions are decode rows too); a step
// holding a prompt chunk keeps the Python loop.
//
// `run` takes the thread team (`run_team`, one parallel region for all layers; see there) for stacks of
// "q4_1" and "block" matrices (Q4_1 and Q4F under the int24 decode rows, the other block formats on their
// float loop), and for stacks of "q4_1_dot8" matrices (gguf-q8act), and `run_ops` (one op after another,
// each with its own threads) otherwise: Q4_1 or Q4F under the float decode loop, or set_team(false). Both give the same bits. Stack at context 300 (Zen 4, 2 vCPUs), op by op -> team:
// gguf 1 row 3.73 -> 2.93 ms; gguf-q8act 1 row 3.09 -> 2.30 ms, 16 rows 21.7 -> 18.7 ms.
#include <torch/extension.h>

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "int8_layout.h"
#include "layer_rows.h"
#include "amx_i24.h"
#include "q4_1_int24.h"

torch::Tensor q4_1_matmul(torch::Tensor x, torch::Tensor packed, int64_t N, int64_t decode_rows);
torch::Tensor q4_1_dot8(torch::Tensor x, torch::Tensor packed, int64_t N);
torch::Tensor block_matmul(torch::Tensor x, torch::Tensor packed, int64_t N, int64_t decode_rows);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
torch::Tensor add_rms_norm_(torch::Tensor x, torch::Tensor y, torch::Tensor w, double eps);
torch::Tensor silu_mul(torch::Tensor gu);
void qk_norm_(torch::Tensor qkv, int64_t heads, int64_t kv_heads, torch::Tensor q_w, torch::Tensor k_w, double eps);
void rope_write_kv_(torch::Tensor qkv, int64_t heads, int64_t kv_heads, torch::Tensor cos, torch::Tensor sin,
                    torch::Tensor slots, torch::Tensor k_pool, torch::Tensor v_pool,
                    const c10::optional<torch::Tensor>& k_scale, const c10::optional<torch::Tensor>& v_scale);
at::Tensor paged_attention_rows(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                                const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale);

int64_t paged_attention_team_floats(const int64_t* lens, int64_t R, int64_t H, int64_t D, int64_t threads);
void paged_attention_check_tables(const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t R,
                                  int64_t N, int64_t bs);
void paged_attention_team(const float* q, int64_t q_row_stride, int64_t q_head_stride, at::ScalarType pool,
                          const void* k, const void* v, bool tables64, const void* tables, int64_t maxblk,
                          const int64_t* lens, float* out, int64_t R, int64_t H, int64_t KVH, int64_t D, int64_t bs,
                          double scale, float* parts, void* scratch, const float* k_scale, const float* v_scale);
void* paged_attention_team_scratch(int64_t R, int64_t H, int64_t D, int64_t max_len);
void paged_attention_team_scratch_free(void* scratch);
namespace kvgate_team {
bool int24();
void prepare(const float* x, int64_t i0, int64_t i1, float* xs, int32_t* xd, float* sc, bool amx);
void tiles(const int32_t* xd, const float* sc, const float* xs, int64_t M, int64_t N, int64_t nb,
           const uint8_t* w, float* y, int64_t t0, int64_t t1, const uint8_t* nx, int64_t nx_bytes, bool q4f, bool amx);
void block_sums(int64_t bytes, const float* x, int64_t i0, int64_t i1, float* xs);
void block_tiles(int64_t bytes, const float* x, const float* xs, int64_t M, int64_t N, int64_t nb, const uint8_t* w,
                 float* y, int64_t t0, int64_t t1);
}  // namespace kvgate_team

namespace {

constexpr int64_t QB = 32;           // values per Q4_1 block
constexpr int64_t TILE_BLOCK = 320;  // q4_1_pack16: a tile's bytes per block (16 outputs' codes, d and m)
constexpr int64_t Q4F_BLOCK = 384;   // block_pack16's Q4F (Q4_K, Q4_0): Q4_1's codes, float32 d and m
// block_pack16's other formats' tile-blocks (tile_matmul.cpp): Q5F, Q8_0, Q8D, Q8S
constexpr int64_t FLOAT_BLOCKS[] = {448, 576, 640, 768};

// [begin, end) of n items for thread `tid` of `nt`: ceil(n / nt) each, the last ones short or empty
inline std::pair<int64_t, int64_t> share(int64_t n, int64_t tid, int64_t nt) {
  const int64_t per = (n + nt - 1) / nt, b = std::min(n, tid * per);
  return {b, std::min(n, b + per)};
}

// One weight matrix: Q4_1 tiles, for the float kernel (kind "q4_1", q4_1_pack16) or the 8-bit-activation
// one ("q4_1_dot8", q4_1_pack8); or another GGUF block format's tiles ("block", block_pack16 in
// kvgate/models/block_formats.py). On the team, Q4_1 and Q4F tiles take the 24-bit integer decode rows
// (`i24`), the other block formats their float loop on the float rows.
struct Mat {
  torch::Tensor packed;
  int64_t out_features;
  bool dot8;
  bool block = false;
  const uint8_t* w = nullptr;  // the tiles, [T, nb, per bytes]
  int64_t T = 0, nb = 0, per = 0;
  int64_t bytes = 0;  // a tile-block's bytes (the format)
  bool i24 = false;   // Q4_1 or Q4F: digits in, kvgate_team::tiles

  torch::Tensor operator()(const torch::Tensor& x) const {
    if (dot8) return q4_1_dot8(x, packed, out_features);
    if (block) return block_matmul(x, packed, out_features, x.size(0));
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
      TORCH_CHECK(kinds[i] == "q4_1" || kinds[i] == "q4_1_dot8" || kinds[i] == "block", "DecodeStack: matrix ", i,
                  "'s kind must be 'q4_1', 'q4_1_dot8' or 'block', got '", kinds[i], "'");
      mats_.push_back(Mat{std::move(mats[i]), out_features[i], kinds[i] == "q4_1_dot8", kinds[i] == "block"});
    }
    team_ok_ = team_shapes();
  }

  // Runs decode-only steps on the thread team (`run_team`) where it can: the default. False: every step
  // on `run_ops` (A/B runs and the tests that compare the two).
  void set_team(bool on) { team_on_ = on; }
  // Qwen3: each layer's q and k head norm weights ([head_dim] each, 2 per layer), run after the qkv matmul
  void set_qk_norms(std::vector<torch::Tensor> qk) {
    TORCH_CHECK(qk.size() == norms_.size(), "DecodeStack.set_qk_norms: want 2 per layer (", norms_.size(), "), got ",
                qk.size());
    for (const auto& w : qk)
      TORCH_CHECK(w.scalar_type() == torch::kFloat32 && w.dim() == 1 && w.size(0) == head_dim_ && w.is_contiguous(),
                  "DecodeStack.set_qk_norms: each weight must be contiguous float32 [", head_dim_, "]");
    qk_ = std::move(qk);
  }
  bool team() const { return team_on_ && team_ok_; }
  // how many steps run_team has run (the tests check that the team, not run_ops, took a step)
  int64_t team_steps() const { return team_steps_.load(std::memory_order_relaxed); }

  int64_t layers() const { return static_cast<int64_t>(norms_.size() / 2); }

  // x [T, hidden] float32 (updated in place, as the loop's add_rms_norm_ updates it); returns the last
  // layer's output added to it, as `x + pending` makes it.
  // k_cache, v_cache: [layers, blocks, block_size, kv_heads, head_dim], each layer's pool a slice; int8
  // caches (`--kv-dtype int8`) come with k_scales, v_scales: [layers, blocks, block_size, kv_heads, 2]
  // float32 (a step and an offset each).
  // cos_table, sin_table: the model's [max positions, head_dim] tables, looked up here at `positions`
  // (the loop's `cos[positions]`: the same rows), two torch calls fewer from Python a step.
  torch::Tensor run(torch::Tensor x, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                    const torch::Tensor& cos_table, const torch::Tensor& sin_table, const torch::Tensor& positions,
                    const torch::Tensor& slots, const torch::Tensor& tables, const torch::Tensor& lens,
                    const c10::optional<torch::Tensor>& k_scales, const c10::optional<torch::Tensor>& v_scales) const {
    const bool q8 = k_cache.scalar_type() == at::kChar;
    TORCH_CHECK(q8 == k_scales.has_value() && q8 == v_scales.has_value(),
                "DecodeStack.run: k_scales and v_scales come with int8 caches, and only with them");
    if (q8)
      TORCH_CHECK(k_scales->scalar_type() == at::kFloat && v_scales->scalar_type() == at::kFloat &&
                      k_scales->is_contiguous() && v_scales->is_contiguous() && k_scales->dim() == 5 &&
                      k_scales->sizes().slice(0, 4) == k_cache.sizes().slice(0, 4) && k_scales->size(4) == 2 &&
                      v_scales->sizes() == k_scales->sizes(),
                  "DecodeStack.run: the scales of int8 caches ", k_cache.sizes(),
                  " must be contiguous float32 [layers, blocks, block_size, kv_heads, 2]");
    if (team() && (dot8_ || !has_i24_ || kvgate_team::int24()) && k_cache.is_contiguous() && v_cache.is_contiguous() && x.is_contiguous() &&
        x.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu() && cos_table.device().is_cpu() &&
        sin_table.device().is_cpu() && positions.device().is_cpu() && slots.device().is_cpu() &&
        tables.device().is_cpu() && lens.device().is_cpu() && distinct_slots(slots))
      return run_team(x, k_cache, v_cache, cos_table, sin_table, positions, slots, tables, lens, k_scales, v_scales);
    return run_ops(x, k_cache, v_cache, cos_table, sin_table, positions, slots, tables, lens, k_scales, v_scales);
  }

  // The layers as one tensor op after another (each kernel with its own threads)
  torch::Tensor run_ops(torch::Tensor x, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                        const torch::Tensor& cos_table, const torch::Tensor& sin_table, const torch::Tensor& positions,
                        const torch::Tensor& slots, const torch::Tensor& tables, const torch::Tensor& lens,
                        const c10::optional<torch::Tensor>& k_scales, const c10::optional<torch::Tensor>& v_scales) const {
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
      if (!qk_.empty()) qk_norm_(qkv, H, kv_heads_, qk_[2 * li], qk_[2 * li + 1], eps_);
      const auto k_pool = k_cache.select(0, li), v_pool = v_cache.select(0, li);
      c10::optional<torch::Tensor> ks, vs;
      if (k_scales) ks = k_scales->select(0, li), vs = v_scales->select(0, li);
      rope_write_kv_(qkv, H, kv_heads_, cos, sin, slots, k_pool, v_pool, ks, vs);
      auto q = qkv.narrow(1, 0, H * D).view({T, H, D});
      auto attn = paged_attention_rows(q, k_pool, v_pool, tables, lens, scale, ks, vs).view({T, H * D});
      h = add_rms_norm_(x, m[1](attn), norms_[2 * li + 1], eps_);
      pending = m[3](silu_mul(m[2](h)));
    }
    return x + pending;
  }

  // The same layers, kernels and order as `run_ops`, so the same bits, in one parallel region: the
  // threads split each matmul's tiles and the attention's tasks as the ops split them, and meet at a
  // barrier where a result is needed whole. The row work between (residual add, RMSNorm, the 24-bit
  // digits, SiLU * up) is done by every thread on its own copy when there are fewer rows than threads
  // (no barrier, no idle thread), else split by rows. What it removes is each op's fork and join,
  // allocations and dispatch, and the idle thread during the serial row work; each thread also asks for
  // its first tiles of the next matrix while it finishes the current one.
  torch::Tensor run_team(torch::Tensor x, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                         const torch::Tensor& cos_table, const torch::Tensor& sin_table, const torch::Tensor& positions,
                         const torch::Tensor& slots, const torch::Tensor& tables, const torch::Tensor& lens,
                         const c10::optional<torch::Tensor>& k_scales,
                         const c10::optional<torch::Tensor>& v_scales) const {
    const int64_t L = layers(), R = x.size(0), hid = x.size(1), H = heads_, KVH = kv_heads_, D = head_dim_;
    const int64_t HD = H * D, KV = KVH * D, NQ = mats_[0].out_features, I2 = mats_[2].out_features, I = I2 / 2;
    TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && hid == mats_[0].nb * QB,
                "DecodeStack.run: x must be float32 [rows, ", mats_[0].nb * QB, "], got ", x.sizes(), " ",
                x.scalar_type());
    TORCH_CHECK(k_cache.dim() == 5 && k_cache.size(0) == L && v_cache.sizes() == k_cache.sizes() &&
                    k_cache.size(3) == KVH && k_cache.size(4) == D && v_cache.scalar_type() == k_cache.scalar_type(),
                "DecodeStack.run: want K and V caches [", L, " layers, blocks, block_size, ", KVH, ", ", D,
                "] of one dtype, got ", k_cache.sizes(), " and ", v_cache.sizes());
    const auto pool = k_cache.scalar_type();
    TORCH_CHECK(pool == at::kFloat || pool == at::kHalf || pool == at::kBFloat16 || pool == at::kChar,
                "DecodeStack.run: the K/V caches must be float32, float16, bfloat16 or int8, got ", pool);
    const int64_t N = k_cache.size(1), bs = k_cache.size(2);
    TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.dim() == 1 && slots.size(0) == R && slots.is_contiguous(),
                "DecodeStack.run: slots must be a contiguous int64 [", R, "] tensor");
    paged_attention_check_tables(tables, lens, R, N, bs);
    const int64_t maxblk = tables.size(1);
    const int64_t *sp = slots.data_ptr<int64_t>(), *lp = lens.data_ptr<int64_t>();
    const bool t64 = tables.scalar_type() == at::kLong;
    for (int64_t r = 0; r < R; ++r)
      TORCH_CHECK(sp[r] >= 0 && sp[r] < N * bs, "DecodeStack.run: slot ", sp[r], " of row ", r,
                  " is outside the pool's ", N * bs, " slots");
    const auto cos = cos_table.index_select(0, positions).contiguous();
    const auto sin = sin_table.index_select(0, positions).contiguous();
    TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && cos.dim() == 2 && cos.size(1) == D && cos.size(0) == R &&
                    sin.sizes() == cos.sizes() && sin.scalar_type() == torch::kFloat32,
                "DecodeStack.run: the cos/sin tables must be float32 [positions, ", D, "]");
    const double scale = std::pow(static_cast<double>(D), -0.5);  // Python's D**-0.5
    const int64_t wide = std::max({hid, HD, I}), nbw = wide / QB, nbh = hid / QB, nba = HD / QB, nbi = I / QB;

    // Row buffers: x (the residual), the row work's output, its digits, scales and block sums
    // (gguf-q8act: its 8-bit codes in q8, their scales d in sc and sums s in xs; no 24-bit digits)
    struct Rows {
      float *x, *act, *xs, *sc;
      int32_t* xd;
      int8_t* q8;
    };
    auto f32 = x.options();
    auto rows_of = [&](float* xp, std::vector<torch::Tensor>& keep) {
      keep.push_back(torch::empty({R * (wide + 2 * nbw)}, f32));
      float* a = keep.back().data_ptr<float>();
      if (dot8_) {
        keep.push_back(torch::empty({R * wide}, f32.dtype(torch::kInt8)));
        return Rows{xp, a, a + R * wide, a + R * wide + R * nbw, nullptr, keep.back().data_ptr<int8_t>()};
      }
      keep.push_back(torch::empty({R * nbw * std::max(kvgate_i24::XDW, kvgate_amx8::XDW)}, f32.dtype(torch::kInt32)));
      return Rows{xp, a, a + R * wide, a + R * wide + R * nbw, keep.back().data_ptr<int32_t>(), nullptr};
    };
    std::vector<torch::Tensor> keep;
    const int64_t most = std::max<int64_t>(1, omp_get_max_threads());
    const Rows shared_rows = rows_of(x.data_ptr<float>(), keep);
    std::vector<Rows> own;  // one per thread while rows < threads (each thread does every row)
    if (R < most) {
      keep.push_back(torch::empty({most, R * hid}, f32));
      float* xs0 = keep.back().data_ptr<float>();
      for (int64_t t = 0; t < most; ++t) own.push_back(rows_of(xs0 + t * R * hid, keep));
    }
    auto qkv = torch::empty({R, NQ}, f32), attn = torch::empty({R, HD}, f32), o = torch::empty({R, hid}, f32);
    auto gu = torch::empty({R, I2}, f32), out = torch::empty({R, hid}, f32);
    auto parts = torch::empty({paged_attention_team_floats(lp, R, H, D, R + 1)}, f32);  // every row split: the most
    // each thread's attention scratch, reserved here: nothing inside the region allocates
    using ScratchPtr = std::unique_ptr<void, void (*)(void*)>;
    std::vector<ScratchPtr> scratch;
    const int64_t longest = R > 0 ? *std::max_element(lp, lp + R) : 0;
    for (int64_t t = 0; t < most; ++t)
      scratch.emplace_back(paged_attention_team_scratch(R, H, D, longest), paged_attention_team_scratch_free);
    float *qp = qkv.data_ptr<float>(), *ap = attn.data_ptr<float>(), *op = o.data_ptr<float>();
    float *gp = gu.data_ptr<float>(), *outp = out.data_ptr<float>(), *pp = parts.data_ptr<float>();
    const float *cp = cos.data_ptr<float>(), *snp = sin.data_ptr<float>();
    float* xp = x.data_ptr<float>();
    const void* tp = tables.data_ptr();
    char *kb = static_cast<char*>(k_cache.data_ptr()), *vb = static_cast<char*>(v_cache.data_ptr());
    const int64_t layer_bytes = k_cache.stride(0) * k_cache.element_size();
    float* ksb = k_scales ? k_scales->data_ptr<float>() : nullptr;  // int8 caches: [layer][slot][KV head]
    float* vsb = v_scales ? v_scales->data_ptr<float>() : nullptr;
    const int64_t layer_scales = 2 * N * bs * KVH;
    const bool pairs = dot8_ && kvgate_int8::use_pairs(R);  // read once: every thread, every matrix the same
    const bool amx8 = !dot8_ && kvgate_amx8::takes(R);  // the same: digits and tiles agree on the layout
    team_steps_.fetch_add(1, std::memory_order_relaxed);

#pragma omp parallel
    {
      const int64_t m = omp_get_num_threads(), tid = omp_get_thread_num();
      const bool every = R < m;  // this thread does every row, on its own copy
      const Rows& b = every ? own[tid] : shared_rows;
      const auto mine = every ? std::pair<int64_t, int64_t>{0, R} : share(R, tid, m);
      const auto split = share(R, tid, m);  // rows whose shared results this thread writes
      const int64_t r0 = mine.first, r1 = mine.second;
      if (every) std::copy(xp, xp + R * hid, b.x);
      // this thread's tiles of M against rows src (their digits or sums made by inputs_of), then the
      // first of the next matrix's asked for
      auto mm = [&](const Mat& M, const float* src, float* y, const Mat* next) {
        if (dot8_) {
          const kvgate_int8::Rounded rx{b.q8, b.sc, b.xs, R, M.nb * QB};
          const auto u = share(kvgate_int8::units(M.T, pairs), tid, m);
          if (u.first < u.second) kvgate_int8::run_units(rx, M.w, M.T, M.out_features, y, u.first, u.second, pairs);
          return;
        }
        const auto t = share(M.T, tid, m);
        if (!M.i24) {  // a block format's float loop reads the rows themselves
          if (t.first < t.second)
            kvgate_team::block_tiles(M.bytes, src, b.xs, R, M.out_features, M.nb, M.w, y, t.first, t.second);
          return;
        }
        const uint8_t* nx = nullptr;
        int64_t nxb = 0;
        if (next) {
          const auto u = share(next->T, tid, m);
          nx = next->w + u.first * next->per;
          nxb = std::min<int64_t>(4, u.second - u.first) * next->per;
        }
        if (t.first < t.second)
          kvgate_team::tiles(b.xd, b.sc, b.xs, R, M.out_features, M.nb, M.w, y, t.first, t.second, nx, nxb, M.block,
                             amx8);
      };
      // this thread's rows of src (nbk blocks a row) as matrix M's input; with rows split, the others'
      // too before it runs (a float format's sums: xs, up to 2 a block, runs on into sc's floats)
      auto inputs_of = [&](const float* src, int64_t nbk, const Mat& M) {
        if (dot8_)
          kvgate_int8::round_rows(src, r0, r1, nbk * QB, b.q8, b.sc, b.xs);
        else if (M.i24)
          kvgate_team::prepare(src, r0 * nbk, r1 * nbk, b.xs, b.xd, b.sc, amx8);
        else
          kvgate_team::block_sums(M.bytes, src, r0 * nbk, r1 * nbk, b.xs);
        if (!every) {
#pragma omp barrier
        }
      };
      for (int64_t li = 0; li < L; ++li) {
        const Mat* mt = &mats_[4 * li];
        const float *n1 = norms_[2 * li].data_ptr<float>(), *n2 = norms_[2 * li + 1].data_ptr<float>();
        for (int64_t r = r0; r < r1; ++r) {
          if (li > 0) kvgate_rows::add(b.x + r * hid, op + r * hid, hid);  // the last layer's down output
          kvgate_rows::norm(b.x + r * hid, n1, hid, eps_, b.act + r * hid);
        }
        inputs_of(b.act, nbh, mt[0]);
        mm(mt[0], b.act, qp, &mt[1]);
#pragma omp barrier
        char *kl = kb + li * layer_bytes, *vl = vb + li * layer_bytes;
        float* ksl = ksb ? ksb + li * layer_scales : nullptr;
        float* vsl = vsb ? vsb + li * layer_scales : nullptr;
        const float* qn = qk_.empty() ? nullptr : qk_[2 * li].data_ptr<float>();
        const float* kn = qk_.empty() ? nullptr : qk_[2 * li + 1].data_ptr<float>();
        for (int64_t r = split.first; r < split.second; ++r) {
          if (qn != nullptr) {  // Qwen3: qk_norm_'s row function, so the bits of run_ops
            kvgate_rows::head_norms(qp + r * NQ, H, qn, D, eps_);
            kvgate_rows::head_norms(qp + r * NQ + HD, KVH, kn, D, eps_);
          }
          kvgate_rows::rope(qp + r * NQ, H + KVH, cp + r * D, snp + r * D, D);
          kvgate_rows::write_kv(qp + r * NQ + HD, KV, sp[r], pool, kl, vl, ksl, vsl, D);
        }
#pragma omp barrier
        paged_attention_team(qp, NQ, D, pool, kl, vl, t64, tp, maxblk, lp, ap, R, H, KVH, D, bs, scale, pp,
                             scratch[tid].get(), ksl, vsl);
        inputs_of(ap, nba, mt[1]);
        mm(mt[1], ap, op, &mt[2]);
#pragma omp barrier
        for (int64_t r = r0; r < r1; ++r) {
          kvgate_rows::add(b.x + r * hid, op + r * hid, hid);
          kvgate_rows::norm(b.x + r * hid, n2, hid, eps_, b.act + r * hid);
        }
        inputs_of(b.act, nbh, mt[2]);
        mm(mt[2], b.act, gp, &mt[3]);
#pragma omp barrier
        for (int64_t r = r0; r < r1; ++r) kvgate_rows::silu_mul(gp + r * I2, I, b.act + r * I);
        inputs_of(b.act, nbi, mt[3]);
        mm(mt[3], b.act, op, li + 1 < L ? &mats_[4 * (li + 1)] : nullptr);
#pragma omp barrier
      }
      for (int64_t r = split.first; r < split.second; ++r) {
        if (every) std::copy(b.x + r * hid, b.x + (r + 1) * hid, xp + r * hid);
        for (int64_t i = 0; i < hid; ++i) outp[r * hid + i] = xp[r * hid + i] + op[r * hid + i];
      }
    }
    return out;
  }

 private:
  // Rows writing the same K/V slot (never in the engine's steps) keep run_ops, whose writes go in row
  // order (the last row's stays); the team's threads would race on it.
  static bool distinct_slots(const torch::Tensor& slots) {
    if (slots.scalar_type() != torch::kLong || slots.dim() != 1 || !slots.is_contiguous()) return false;
    return kvgate_rows::distinct(slots.data_ptr<int64_t>(), slots.numel());
  }

  // Whether run_team can take this stack: every matrix "q4_1" or "block" (any mix: a k-quant file's), or every
  // one "q4_1_dot8", each layer's shapes the first layer's and
  // chained (hidden -> qkv, heads x head_dim -> hidden, hidden -> 2 x inter, inter -> hidden), every
  // in-feature count a whole number of blocks, the norms contiguous float32. Fills the matrices' pointers.
  bool team_shapes() {
    const int64_t H = heads_, KVH = kv_heads_, D = head_dim_;
    if (norms_.empty() || norms_.size() % 2 != 0 || mats_.size() != 2 * norms_.size()) return false;
    if (KVH <= 0 || H % KVH != 0 || D % 2 != 0) return false;  // run_ops' kernels say what is wrong
    dot8_ = mats_[0].dot8;
    const int64_t outs = dot8_ ? kvgate_int8::NT : 16;
    for (auto& m : mats_) {
      if (m.dot8 != dot8_ || m.packed.dtype() != torch::kUInt8 || m.packed.dim() != 3 || !m.packed.is_contiguous() ||
          !m.packed.device().is_cpu() || m.packed.size(0) != (m.out_features + outs - 1) / outs)
        return false;  // not gguf-q8act's tiles everywhere or nowhere: run_ops' checks name the problem
      m.bytes = m.packed.size(2);
      const bool floats = std::find(std::begin(FLOAT_BLOCKS), std::end(FLOAT_BLOCKS), m.bytes) != std::end(FLOAT_BLOCKS);
      if (dot8_ ? m.bytes != kvgate_int8::TILE_BLOCK
                : m.block ? m.bytes != Q4F_BLOCK && !floats : m.bytes != TILE_BLOCK)
        return false;
      m.i24 = !dot8_ && (!m.block || m.bytes == Q4F_BLOCK);
      has_i24_ = has_i24_ || m.i24;
      m.w = m.packed.data_ptr<uint8_t>();
      m.T = m.packed.size(0), m.nb = m.packed.size(1), m.per = m.packed.size(1) * m.packed.size(2);
    }
    for (const auto& n : norms_)
      if (n.scalar_type() != torch::kFloat32 || n.dim() != 1 || !n.is_contiguous() || !n.device().is_cpu()) return false;
    const int64_t hid = mats_[0].nb * QB, I2 = mats_[2].out_features;
    if (I2 % 2 != 0 || (H * D) % QB != 0 || (I2 / 2) % QB != 0 || mats_[0].out_features != (H + 2 * KVH) * D)
      return false;
    for (size_t li = 0; li < norms_.size() / 2; ++li) {
      const Mat* m = &mats_[4 * li];
      if (m[0].nb * QB != hid || m[0].out_features != mats_[0].out_features || m[1].nb * QB != H * D ||
          m[1].out_features != hid || m[2].nb * QB != hid || m[2].out_features != I2 || m[3].nb * QB != I2 / 2 ||
          m[3].out_features != hid || norms_[2 * li].size(0) != hid || norms_[2 * li + 1].size(0) != hid)
        return false;
    }
    return true;
  }

  std::vector<torch::Tensor> norms_;
  std::vector<torch::Tensor> qk_;  // Qwen3's q and k head norms, 2 per layer; empty for other models
  std::vector<Mat> mats_;
  int64_t heads_, kv_heads_, head_dim_;
  double eps_;
  bool team_ok_ = false, team_on_ = true;
  mutable std::atomic<int64_t> team_steps_{0};
  bool dot8_ = false;  // the team's matrices are gguf-q8act's (q4_1_pack8 tiles, 8-bit activations)
  bool has_i24_ = false;  // some matrix takes the 24-bit integer decode rows (Q4_1, Q4F): the team needs them on
};

}  // namespace

void bind_decode_stack(pybind11::module& mod) {
  pybind11::class_<DecodeStack>(mod, "DecodeStack")
      .def(pybind11::init<std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<int64_t>,
                          std::vector<std::string>, int64_t, int64_t, int64_t, double>())
      .def("layers", &DecodeStack::layers)
      .def("set_qk_norms", &DecodeStack::set_qk_norms, "each layer's q and k head norm weights (Qwen3), 2 per layer")
      .def("set_team", &DecodeStack::set_team, "False: run every decode step as one op after another (A/B, tests)")
      .def("team", &DecodeStack::team, "whether decode steps run on the thread team")
      .def("team_steps", &DecodeStack::team_steps, "how many steps ran on the thread team")
      .def("run", &DecodeStack::run, pybind11::call_guard<pybind11::gil_scoped_release>(), pybind11::arg("x"),
           pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("cos_table"), pybind11::arg("sin_table"),
           pybind11::arg("positions"), pybind11::arg("slots"), pybind11::arg("tables"), pybind11::arg("lens"),
           pybind11::arg("k_scales") = pybind11::none(), pybind11::arg("v_scales") = pybind11::none(),
           "the layer stack of a decode-only step; x is updated in place, x + the last layer's output returned");
}
