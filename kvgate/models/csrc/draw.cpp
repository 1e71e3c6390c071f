// The sampler's draw in one call (kvgate.sampling): one token per row of float32 logits, from the
// distribution temperature, top-k, top-p and min-p leave, each row on one thread.
//
// Per row, with s = x / T and m = max(s):
//   w_i = exp(s_i - m)                       the unnormalized probabilities (float, exp8's lanes)
//   top-k (0 < k < V): the k largest w      (ties: the lower token id first); top-p is over their sum
//   top-p < 1: in the order of w, descending (same tie rule), the smallest prefix whose sum reaches
//              p x Z, Z the sum of every w (or of the k)
//   min-p:     drop the kept w below min_p x the largest (which is exp(0) = 1)
//   draw:      the first kept token, in vocabulary order, whose running sum exceeds u x (sum of the
//              kept), u the row's uniform
// A row with a NaN or no finite maximum gets its argmax (NaN read as -inf; the first of equal values).
// Temperature 0 is greedy: torch.argmax of the logits (the first NaN, else the first largest value).
// Sums are in double, in one fixed order (blocks of 16 tokens, then the blocks), so a row's token
// depends on its logits, parameters and u only: never on the rows beside it or the thread count. The
// ordering by (w, id) is total, so top-p needs no sort: the tokens with w >= level x Z (level 1e-4,
// then 1e-6, then all) are a prefix of that order, and when their sum reaches p x Z the nucleus ends
// inside them; its last token is found by bucketing them by the bits of w, descending into the bucket
// where the running sum reaches p x Z, and sorting only the few left (`boundary`). Every build (AVX-512, AVX2, scalar) computes the same w and so draws
// the same tokens (tests/test_scalar_fallback.py).
//
// draw_probs gives the same rows' kept distribution as dense float32 probabilities instead (the
// speculative sampler's rejection rule reads it, so it truncates exactly as a plain draw).
//
// Scratch per thread, at most `max_threads` threads: the row's w (4 B a token), its block sums (0.5 B)
// and two lists of at most V token ids (4 B each): 12.5 B a token, 3.1 rows of float32 logits
// (kvgate.memory.workspace's SAMPLING_TEMPS counts it); a task of greedy rows only needs none.
#pragma GCC optimize("fp-contract=off")

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "vec_exp.h"

namespace {

constexpr int64_t BLOCK = 16;               // tokens per partial sum
constexpr double LEVELS[] = {1e-4, 1e-6};  // candidate levels for top-p, then every token

// vec_exp.h's exp8 for one lane: the same constants and operations (fma where it fuses), so the same
// float for the same argument (x <= 0).
inline float exp_lane(float x) {
  if (x < -87.3f) return 0.0f;
  const float fx = std::nearbyint(x * 1.44269504088896341f);
  x = std::fma(-fx, 0.693359375f, x);
  x = std::fma(-fx, -2.12194440e-4f, x);
  float y = 1.9875691500e-4f;
  y = std::fma(y, x, 1.3981999507e-3f);
  y = std::fma(y, x, 8.3334519073e-3f);
  y = std::fma(y, x, 4.1665795894e-2f);
  y = std::fma(y, x, 1.6666665459e-1f);
  y = std::fma(y, x, 5.0000001201e-1f);
  const float x2 = x * x, x1 = x + 1.0f;
  y = std::fma(y, x2, x1);
  const int32_t bits = (static_cast<int32_t>(fx) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

// w = x / T into w (Store), or only read (a greedy row: T = 1, and x / 1 is x, so its argmax is read off
// x itself); returns max(w) over the non-NaN values and whether any value was NaN.
template <bool Store>
std::pair<float, bool> scale_and_max(const float* x, float T, int64_t V, float* w) {
  float m = -std::numeric_limits<float>::infinity();
  bool nan = false;
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 t = _mm512_set1_ps(T);
  __m512 mv = _mm512_set1_ps(m);
  __mmask16 bad = 0;
  for (; i + 16 <= V; i += 16) {
    const __m512 s = _mm512_div_ps(_mm512_loadu_ps(x + i), t);
    if constexpr (Store) _mm512_storeu_ps(w + i, s);
    bad |= _mm512_cmp_ps_mask(s, s, _CMP_UNORD_Q);
    mv = _mm512_max_ps(s, mv);  // a NaN lane of s keeps mv
  }
  m = _mm512_reduce_max_ps(mv);  // a max is exact in any order
  nan = bad != 0;
#elif defined(KVGATE_AVX2_EXP)
  const __m256 t = _mm256_set1_ps(T);
  __m256 mv = _mm256_set1_ps(m), bad = _mm256_setzero_ps();
  for (; i + 8 <= V; i += 8) {
    const __m256 s = _mm256_div_ps(_mm256_loadu_ps(x + i), t);
    if constexpr (Store) _mm256_storeu_ps(w + i, s);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(s, s, _CMP_UNORD_Q));
    mv = _mm256_max_ps(s, mv);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, mv);
  for (float v : lanes) m = std::max(m, v);
  nan = _mm256_movemask_ps(bad) != 0;
#endif
  for (; i < V; ++i) {
    const float s = x[i] / T;
    if constexpr (Store) w[i] = s;
    if (std::isnan(s)) nan = true;
    else m = std::max(m, s);
  }
  return {m, nan};
}

// w_i = exp(w_i - m) in place.
void exp_shifted(float* w, float m, int64_t V) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 mv = _mm512_set1_ps(m);
  for (; i + 16 <= V; i += 16) _mm512_storeu_ps(w + i, kvgate_vec::exp16(_mm512_sub_ps(_mm512_loadu_ps(w + i), mv)));
#elif defined(KVGATE_AVX2_EXP)
  const __m256 mv = _mm256_set1_ps(m);
  for (; i + 8 <= V; i += 8) _mm256_storeu_ps(w + i, kvgate_vec::exp8(_mm256_sub_ps(_mm256_loadu_ps(w + i), mv)));
#endif
  for (; i < V; ++i) w[i] = exp_lane(w[i] - m);
}

// The first index holding m (a row's maximum); 0 when m is -inf (torch.argmax of a row of -inf).
int64_t first_equal(const float* x, int64_t V, float m) {
  if (m == -std::numeric_limits<float>::infinity()) return 0;
  for (int64_t i = 0; i < V; ++i)
    if (x[i] == m) return i;
  return 0;
}

// Token ids in the order the cuts use: the larger w first, then the lower id (a total order).
struct Before {
  const float* w;
  bool operator()(int32_t a, int32_t b) const { return w[a] > w[b] || (w[a] == w[b] && a < b); }
};

struct Params {
  float temperature;
  int64_t top_k;
  float top_p, min_p;
};

// What a row draws from: the kept token ids in vocabulary order (when top-k or top-p cuts), or every
// token with w >= floor (when not).
struct Kept {
  bool cut = false;
  int64_t fallback = -1;  // >= 0: the row's token (greedy, or a degenerate row's argmax), nothing to draw
  float floor = 0.0f;
  std::vector<int32_t> ids;
};

// Sum of w over [0, V) in blocks of BLOCK (each summed in order), the blocks in order; w below floor
// count as 0. `blocks` receives each block's sum.
double block_sums(const float* w, int64_t V, float floor, std::vector<double>& blocks) {
  const int64_t nb = (V + BLOCK - 1) / BLOCK;
  blocks.resize(nb);
  double z = 0.0;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t e = std::min(V, (b + 1) * BLOCK);
    double s = 0.0;
    for (int64_t i = b * BLOCK; i < e; ++i) s += w[i] >= floor ? w[i] : 0.0f;
    blocks[b] = s;
    z += s;
  }
  return z;
}

inline uint32_t bits_of(float w) {
  uint32_t u;
  std::memcpy(&u, &w, sizeof u);
  return u;  // w >= 0: the bits order as the values do
}

// The last id, in `Before` order, of the smallest prefix of `c` (in that order) whose sum of w reaches
// `target`; false when the sum of all of `c` does not. Without sorting `c`: its ids go into 256
// buckets by the bits of w, and the bucket where the running sum (from the top) reaches the target is
// taken apart the same way, in `s` (scratch), down to a few ids or one value, which are sorted.
bool boundary(const float* w, const std::vector<int32_t>& c, double target, std::vector<int32_t>& s,
              int32_t& out) {
  constexpr int NB = 256;
  double sums[NB];
  const Before first{w};
  if (c.empty()) return false;
  if (target <= 0.0) return out = *std::min_element(c.begin(), c.end(), first), true;  // top_p rounded to 0
  const std::vector<int32_t>* src = &c;
  for (;;) {
    const std::vector<int32_t>& a = *src;
    // below the first level the parent's rounded sum put the boundary in this bucket: if this level's
    // own sum falls short by that rounding, the bucket's last id is the boundary
    const bool deeper = src != &c;
    uint32_t lo = UINT32_MAX, hi = 0;
    for (int32_t id : a) lo = std::min(lo, bits_of(w[id])), hi = std::max(hi, bits_of(w[id]));
    if (a.size() <= 64 || lo == hi) {
      if (!deeper) s.assign(c.begin(), c.end());
      std::sort(s.begin(), s.end(), first);
      double cum = 0.0;
      for (int32_t id : s) {
        cum += w[id];
        if (cum >= target) return out = id, true;
      }
      if (deeper && !s.empty()) return out = s.back(), true;
      return false;
    }
    const uint32_t width = (hi - lo) / NB + 1;
    auto bucket = [&](int32_t id) { return static_cast<int>((bits_of(w[id]) - lo) / width); };
    std::fill(sums, sums + NB, 0.0);
    for (int32_t id : a) sums[bucket(id)] += w[id];
    double cum = 0.0;
    int b = NB - 1;
    for (; b >= 0 && cum + sums[b] < target; --b) cum += sums[b];
    if (b < 0) {
      if (deeper) return out = *std::max_element(a.begin(), a.end(), first), true;
      return false;
    }
    size_t n = 0;  // the bucket's ids into s (in place once s is the source: n never passes j)
    if (src == &c) s.resize(c.size());
    for (size_t j = 0; j < a.size(); ++j)
      if (bucket(a[j]) == b) s[n++] = a[j];
    s.resize(n);
    target -= cum;
    src = &s;
  }
}

// The k ids first in `Before` order, in vocabulary order.
void top_k_ids(const float* w, int64_t V, int64_t k, std::vector<int32_t>& c) {
  c.clear();
  const Before first{w};  // as a heap's "less": the heap's top is the worst id kept
  for (int32_t i = 0; i < V; ++i) {
    if (static_cast<int64_t>(c.size()) < k) {
      c.push_back(i);
      std::push_heap(c.begin(), c.end(), first);
    } else if (first(i, c.front())) {
      std::pop_heap(c.begin(), c.end(), first);
      c.back() = i;
      std::push_heap(c.begin(), c.end(), first);
    }
  }
  std::sort(c.begin(), c.end());
}

// Keep the ids (vocabulary order) up to the nucleus boundary for mass `target`; all when their sum
// does not reach it (rounding).
void cut_nucleus(const float* w, std::vector<int32_t>& c, double target, std::vector<int32_t>& s) {
  int32_t last;
  if (!boundary(w, c, target, s, last)) return;
  const Before first{w};
  c.erase(std::remove_if(c.begin(), c.end(), [&](int32_t id) { return first(last, id); }), c.end());
}

void kept_of_row(const float* x, int64_t V, const Params& p, float* w, std::vector<double>& blocks, Kept& out,
                 std::vector<int32_t>& s) {
  out.cut = false;
  out.fallback = -1;
  out.floor = 0.0f;
  out.ids.clear();
  const bool greedy = p.temperature == 0.0f;
  if (greedy) {  // torch.argmax: the first NaN, else the first largest (read off x: no copy into w)
    const auto [m, nan] = scale_and_max<false>(x, 1.0f, V, nullptr);
    out.fallback = nan ? std::find_if(x, x + V, [](float v) { return std::isnan(v); }) - x : first_equal(x, V, m);
    return;
  }
  const auto [m, nan] = scale_and_max<true>(x, p.temperature, V, w);
  if (nan || !std::isfinite(m)) {  // degenerate: the argmax with NaN read as -inf
    out.fallback = first_equal(w, V, m);
    return;
  }
  exp_shifted(w, m, V);  // the largest w is exp(0) = 1
  const float floor = p.min_p > 0.0f ? p.min_p : 0.0f;
  const bool top_k = p.top_k > 0 && p.top_k < V, top_p = p.top_p < 1.0f;
  if (!top_k && !top_p) {
    out.floor = floor;
    return;
  }
  out.cut = true;
  auto& c = out.ids;
  if (top_k) {
    top_k_ids(w, V, p.top_k, c);
    if (top_p) {
      double z = 0.0;
      for (int32_t id : c) z += w[id];
      cut_nucleus(w, c, static_cast<double>(p.top_p) * z, s);
    }
  } else {
    // the tokens with w >= level x Z are a prefix of the `Before` order: when their sum reaches p x Z,
    // the nucleus ends among them
    const double z = block_sums(w, V, 0.0f, blocks), target = static_cast<double>(p.top_p) * z;
    for (size_t lv = 0; lv <= std::size(LEVELS); ++lv) {
      const float thr = lv < std::size(LEVELS) ? static_cast<float>(LEVELS[lv] * z) : 0.0f;
      c.clear();
      double held = 0.0;
      for (int32_t i = 0; i < V; ++i)
        if (w[i] >= thr && w[i] > 0.0f) c.push_back(i), held += w[i];
      if (held >= target) break;
    }
    cut_nucleus(w, c, target, s);
  }
  if (floor > 0.0f) {  // min-p, against the largest kept w (the row's largest: 1)
    float top = 0.0f;
    for (int32_t id : c) top = std::max(top, w[id]);
    const float f = floor * top;
    c.erase(std::remove_if(c.begin(), c.end(), [&](int32_t id) { return w[id] < f; }), c.end());
  }
}

int64_t draw_kept(const float* w, int64_t V, const Kept& k, double u, std::vector<double>& blocks) {
  if (k.fallback >= 0) return k.fallback;
  if (k.cut) {
    double z = 0.0;
    for (int32_t id : k.ids) z += w[id];
    const double target = u * z;
    double cum = 0.0;
    for (int32_t id : k.ids) {
      cum += w[id];
      if (cum > target) return id;
    }
    for (size_t j = k.ids.size(); j-- > 0;)  // u x z rounded up to z: the last token with w > 0
      if (w[k.ids[j]] > 0.0f) return k.ids[j];
    return k.ids.front();
  }
  const double z = block_sums(w, V, k.floor, blocks), target = u * z;
  double cum = 0.0;
  int64_t last = -1;
  for (size_t b = 0; b < blocks.size(); ++b) {
    if (blocks[b] > 0.0) last = static_cast<int64_t>(b);
    if (cum + blocks[b] > target) {
      double in = 0.0;
      const int64_t e = std::min<int64_t>(V, (b + 1) * BLOCK);
      for (int64_t i = b * BLOCK; i < e; ++i) {
        in += w[i] >= k.floor ? w[i] : 0.0f;
        if (cum + in > target) return i;
      }
    }
    cum += blocks[b];
  }
  for (int64_t i = std::min<int64_t>(V, (last + 1) * BLOCK); i-- > 0;)  // rounding: the last w kept
    if (w[i] >= k.floor && w[i] > 0.0f) return i;
  return 0;
}

struct Batch {
  const float* x;
  int64_t V;
  std::vector<int64_t> rows;
  std::vector<Params> params;
};

Batch check(const torch::Tensor& logits, const torch::Tensor& rows, const torch::Tensor& temps,
            const torch::Tensor& top_k, const torch::Tensor& top_p, const torch::Tensor& min_p, const char* what) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == torch::kFloat32 && logits.dim() == 2 &&
                  logits.is_contiguous(),
              what, ": logits must be a contiguous float32 CPU [rows, vocab] tensor, got ", logits.sizes(), " ",
              logits.scalar_type());
  TORCH_CHECK(logits.size(1) > 0 && logits.size(1) < (int64_t{1} << 31), what, ": vocabulary of ",
              logits.size(1), " tokens (want 1 to 2^31 - 1)");
  const int64_t n = rows.numel();
  for (const auto* t : {&temps, &top_k, &top_p, &min_p})
    TORCH_CHECK(t->numel() == n && t->dim() == 1, what, ": want one parameter per row (", n, "), got ", t->sizes());
  Batch b{logits.data_ptr<float>(), logits.size(1), {}, {}};
  const auto r = rows.to(torch::kInt64).contiguous();
  const auto T = temps.to(torch::kFloat32).contiguous(), K = top_k.to(torch::kInt64).contiguous();
  const auto P = top_p.to(torch::kFloat32).contiguous(), M = min_p.to(torch::kFloat32).contiguous();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = r.data_ptr<int64_t>()[i];
    TORCH_CHECK(row >= 0 && row < logits.size(0), what, ": row ", row, " is outside the ", logits.size(0),
                " rows of logits");
    const Params p{T.data_ptr<float>()[i], K.data_ptr<int64_t>()[i], P.data_ptr<float>()[i], M.data_ptr<float>()[i]};
    TORCH_CHECK(p.temperature >= 0.0f && std::isfinite(p.temperature), what, ": temperature ", p.temperature,
                " of row ", i, " must be finite and >= 0 (0: greedy, the argmax)");
    b.rows.push_back(row);
    b.params.push_back(p);
  }
  return b;
}

// A task's scratch (see the file's opening), allocated at its first row that is not greedy: a greedy
// row's token is read off its logits, so an all-greedy call allocates nothing. (Allocated for every
// call, the three vocabulary-sized lists, past malloc's mmap threshold at a 49,152-token vocabulary,
// cost a one-row greedy step ~60 us of fresh pages.) Per call, so the plan's sampling term holds it.
struct Scratch {
  std::vector<float> w;
  std::vector<double> blocks;
  std::vector<int32_t> s;
  Kept kept;

  float* ready(int64_t V) {
    if (w.empty()) {
      w.resize(V);
      s.reserve(V);  // neither list ever holds more than V ids: no regrowth past that
      kept.ids.reserve(V);
    }
    return w.data();
  }
};

// Each row's kept distribution, then f(row, w, blocks, kept), over at most max_threads threads, each
// with its own scratch.
template <class F>
void over_rows(const Batch& b, int64_t max_threads, F&& f) {
  const int64_t n = static_cast<int64_t>(b.rows.size()), V = b.V;
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>({n, max_threads, at::get_num_threads()}));
  at::parallel_for(0, n, (n + tasks - 1) / tasks, [&](int64_t r0, int64_t r1) {
    Scratch sc;
    for (int64_t r = r0; r < r1; ++r) {
      // a greedy row reads only x and leaves its token in kept.fallback, which is all f reads of it
      float* w = b.params[r].temperature == 0.0f ? sc.w.data() : sc.ready(V);
      kept_of_row(b.x + b.rows[r] * V, V, b.params[r], w, sc.blocks, sc.kept, sc.s);
      f(r, w, sc.blocks, sc.kept);
    }
  });
}

}  // namespace

torch::Tensor draw_tokens(const torch::Tensor& logits, const torch::Tensor& rows, const torch::Tensor& temps,
                          const torch::Tensor& top_k, const torch::Tensor& top_p, const torch::Tensor& min_p,
                          const torch::Tensor& u, int64_t max_threads) {
  const Batch b = check(logits, rows, temps, top_k, top_p, min_p, "draw_tokens");
  const int64_t n = static_cast<int64_t>(b.rows.size());
  TORCH_CHECK(u.numel() == n, "draw_tokens: want one uniform per row (", n, "), got ", u.numel());
  const auto uu = u.to(torch::kFloat64).contiguous();
  const double* up = uu.data_ptr<double>();
  auto out = torch::empty({n}, torch::kInt64);
  int64_t* op = out.data_ptr<int64_t>();
  over_rows(b, max_threads, [&](int64_t r, float* w, std::vector<double>& blocks, const Kept& kept) {
    op[r] = draw_kept(w, b.V, kept, up[r], blocks);
  });
  return out;
}

torch::Tensor draw_probs(const torch::Tensor& logits, const torch::Tensor& rows, const torch::Tensor& temps,
                         const torch::Tensor& top_k, const torch::Tensor& top_p, const torch::Tensor& min_p,
                         int64_t max_threads) {
  const Batch b = check(logits, rows, temps, top_k, top_p, min_p, "draw_probs");
  const int64_t n = static_cast<int64_t>(b.rows.size()), V = b.V;
  auto out = torch::zeros({n, V}, torch::kFloat32);
  float* op = out.data_ptr<float>();
  over_rows(b, max_threads, [&](int64_t r, float* w, std::vector<double>& blocks, const Kept& kept) {
    float* row = op + r * V;
    if (kept.fallback >= 0) {
      row[kept.fallback] = 1.0f;
    } else if (kept.cut) {
      double z = 0.0;
      for (int32_t id : kept.ids) z += w[id];
      for (int32_t id : kept.ids) row[id] = static_cast<float>(w[id] / z);
    } else {
      const double z = block_sums(w, V, kept.floor, blocks);
      for (int64_t i = 0; i < V; ++i) row[i] = w[i] >= kept.floor ? static_cast<float>(w[i] / z) : 0.0f;
    }
  });
  return out;
}
