// Sampling of the batch rows that are not plain greedy, each row on its own (rows run on both
// threads): Hugging Face's repetition penalty, temperature, top-k, top-p, then one draw that
// inverts the CDF with the row's uniform number. The same rules as the sampler's torch code,
// which stays the reference the tests compare against: per row that code sorted or top-k'd the
// whole vocabulary in a dozen small ops.
//
// Order: tokens rank by scaled logit, higher first, the lower id first among equals. Top-k
// keeps the first k; top-p then keeps the shortest prefix (of what top-k kept) whose mass
// reaches p. Only the tokens near the top are ever sorted: those within 8 nats of the
// largest logit are gathered first, and the window widens only when what it holds cannot
// decide the cut (a flat distribution). The draw walks the kept tokens in rank order, or
// every token in id order when nothing is cut, as the torch code does.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kWindows[] = {8.f, 16.f, 32.f, kInf};  // nats below the largest logit

struct RowParams {
  float temperature;  // 0: greedy (argmax of the penalized logits)
  int64_t top_k;      // 0: all
  double top_p;       // 1: all
  float penalty;      // 1: none
  const int64_t* seen;
  int64_t n_seen;
  double u;  // uniform in [0, 1)
};

// Whether token a ranks before token b.
inline bool before(const float* x, int32_t a, int32_t b) {
  return x[a] > x[b] || (x[a] == x[b] && a < b);
}

// w[i] = e^(x[i] - m), 0 for -inf and NaN; returns their sum (float within 256-token chunks,
// the chunks added in double).
inline double exponentials(const float* x, float* w, int64_t V, float m) {
  double total = 0.0;
  for (int64_t c = 0; c < V; c += 256) {
    const int64_t e = std::min<int64_t>(V, c + 256);
    float part = 0.f;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    int64_t i = c;
    for (; i < e; i += 16) {
      const __mmask16 tail = lanes(std::min<int64_t>(16, e - i));
      const __m512 v = _mm512_maskz_loadu_ps(tail, x + i);
      const __mmask16 live = _mm512_mask_cmp_ps_mask(tail, v, _mm512_set1_ps(-kInf), _CMP_GT_OQ);
      const __m512 y = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(v, _mm512_set1_ps(m))));
      _mm512_mask_storeu_ps(w + i, tail, y);
      acc = _mm512_add_ps(acc, y);
    }
    part = _mm512_reduce_add_ps(acc);
#else
    for (int64_t i = c; i < e; ++i) {
      w[i] = x[i] > -kInf ? fast_exp(x[i] - m) : 0.f;
      part += w[i];
    }
#endif
    total += part;
  }
  return total;
}

// The ids of the tokens with x >= floor, in id order.
inline void gather(const float* x, int64_t V, float floor, std::vector<int32_t>& out) {
  out.resize(V);
  int64_t n = 0;
#if defined(__AVX512F__)
  const __m512i step = _mm512_set1_epi32(16);
  __m512i ids = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t i = 0; i < V; i += 16, ids = _mm512_add_epi32(ids, step)) {
    const __mmask16 tail = lanes(std::min<int64_t>(16, V - i));
    const __mmask16 hit = _mm512_mask_cmp_ps_mask(tail, _mm512_maskz_loadu_ps(tail, x + i),
                                                  _mm512_set1_ps(floor), _CMP_GE_OQ);
    _mm512_mask_compressstoreu_epi32(out.data() + n, hit, ids);
    n += __builtin_popcount(hit);
  }
#else
  for (int64_t i = 0; i < V; ++i)
    if (x[i] >= floor) out[n++] = static_cast<int32_t>(i);
#endif
  out.resize(n);
}

int64_t sample_row(const float* logits, int64_t V, const RowParams& p, std::vector<float>& x,
                   std::vector<float>& w, std::vector<int32_t>& cand,
                   std::vector<uint8_t>& seen_mark) {
  x.assign(logits, logits + V);
  if (p.penalty != 1.f && p.n_seen > 0) {  // each seen id once, whatever its count
    seen_mark.assign(V, 0);
    for (int64_t j = 0; j < p.n_seen; ++j) {
      const int64_t id = p.seen[j];
      if (id < 0 || id >= V || seen_mark[id]) continue;
      seen_mark[id] = 1;
      x[id] = x[id] < 0 ? x[id] * p.penalty : x[id] / p.penalty;
    }
  }
  if (p.temperature == 0.f) return row_argmax(x.data(), V);  // torch.argmax's rule
  const float top = row_max(x.data(), V);
  if (std::isnan(top)) return 0;
  // Dividing by t > 0 keeps the order, so the largest scaled logit is top / t. When it is
  // infinite, every logit is -inf (nothing to draw: the first) or a temperature so small that
  // logit / t overflowed (its limit is greedy): the argmax of the penalized logits.
  const float t = p.temperature, m = top / t;
  if (std::isinf(m)) return row_argmax(x.data(), V);
#pragma omp simd
  for (int64_t i = 0; i < V; ++i) x[i] = x[i] / t;
  w.resize(V);
  const double total = exponentials(x.data(), w.data(), V, m);
  const int64_t k = p.top_k > 0 && p.top_k < V ? p.top_k : V;
  if (k == V && p.top_p >= 1.0) {  // no cut: the CDF over every token in id order
    const double goal = p.u * total;
    double acc = 0.0;
    int64_t pick = 0;
    for (int64_t i = 0; i < V; ++i) {
      if (w[i] <= 0.f) continue;
      acc += w[i];
      pick = i;
      if (acc > goal) break;
    }
    return pick;
  }
  // A cut: find the kept tokens (a prefix of the rank order) among those near the top,
  // putting candidates in rank order only as far as the walk goes.
  const auto rank = [&](int32_t a, int32_t b) { return before(x.data(), a, b); };
  int64_t kept = 0;
  for (const float window : kWindows) {
    const bool all = window == kInf;
    gather(x.data(), V, all ? -kInf : m - window, cand);
    // The window decides when it holds the top k and, for top-p, when the walk below ends
    // inside it: the tokens outside rank after all of its tokens.
    if (!all && k < V && static_cast<int64_t>(cand.size()) < k) continue;
    const int64_t n = std::min<int64_t>(k, static_cast<int64_t>(cand.size()));
    int64_t ranked = 0;  // cand[0, ranked) is in rank order and ranks before the rest
    auto rank_to = [&](int64_t upto) {
      upto = std::min<int64_t>(std::max<int64_t>(upto, 64), static_cast<int64_t>(cand.size()));
      if (upto <= ranked) return;
      if (upto < static_cast<int64_t>(cand.size()))
        std::nth_element(cand.begin() + ranked, cand.begin() + upto, cand.end(), rank);
      std::sort(cand.begin() + ranked, cand.begin() + upto, rank);
      ranked = upto;
    };
    if (k < V) rank_to(n);
    if (p.top_p >= 1.0) {
      kept = n;
      break;
    }
    double kept_total = total;  // the mass top-k keeps (all of it without top-k)
    if (k < V) {
      kept_total = 0.0;
      for (int64_t j = 0; j < n; ++j) kept_total += w[cand[j]];
    }
    const double target = p.top_p * kept_total;
    double mass = 0.0;
    int64_t j = 0;
    for (; j < n; ++j) {  // a token is kept while the mass before it is below p
      if (j > 0 && mass >= target) break;
      if (j == ranked) rank_to(2 * ranked);
      mass += w[cand[j]];
    }
    if (j < n || mass >= target || k < V || all) {
      kept = j;
      break;
    }
    // The window's tokens hold less than p of the mass: the cut lies beyond it; widen.
  }
  // The CDF over the kept tokens in rank order, as the torch sampler draws from them.
  double kept_mass = 0.0;
  for (int64_t j = 0; j < kept; ++j) kept_mass += w[cand[j]];
  const double goal = p.u * kept_mass;
  double acc = 0.0;
  int64_t pick = cand[0];
  for (int64_t j = 0; j < kept; ++j) {
    if (w[cand[j]] <= 0.f) continue;
    acc += w[cand[j]];
    pick = cand[j];
    if (acc > goal) break;
  }
  return pick;
}

}  // namespace

at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& rows,
                       const at::Tensor& temperature, const at::Tensor& top_k,
                       const at::Tensor& top_p, const at::Tensor& penalty,
                       const at::Tensor& seen, const at::Tensor& seen_offsets,
                       const at::Tensor& uniform) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "logits must be float32 [B, V] with contiguous rows");
  const int64_t n = rows.numel(), V = logits.size(1);
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous(), "rows must be int64");
  TORCH_CHECK(temperature.scalar_type() == at::kFloat && temperature.numel() == n &&
                  temperature.is_contiguous(),
              "temperature must be float32 [n]");
  TORCH_CHECK(top_k.scalar_type() == at::kLong && top_k.numel() == n && top_k.is_contiguous(),
              "top_k must be int64 [n]");
  TORCH_CHECK(top_p.scalar_type() == at::kDouble && top_p.numel() == n && top_p.is_contiguous(),
              "top_p must be float64 [n]");
  TORCH_CHECK(penalty.scalar_type() == at::kFloat && penalty.numel() == n &&
                  penalty.is_contiguous(),
              "penalty must be float32 [n]");
  TORCH_CHECK(uniform.scalar_type() == at::kDouble && uniform.numel() == n &&
                  uniform.is_contiguous(),
              "uniform must be float64 [n]");
  TORCH_CHECK(seen.scalar_type() == at::kLong && seen.is_contiguous() &&
                  seen_offsets.scalar_type() == at::kLong && seen_offsets.numel() == n + 1 &&
                  seen_offsets.is_contiguous(),
              "seen must be int64 and seen_offsets int64 [n + 1]");
  TORCH_CHECK(V > 0 && V < (int64_t{1} << 31), "the vocabulary must have 1 to 2^31 - 1 tokens");
  const auto* rp = rows.data_ptr<int64_t>();
  const auto* off = seen_offsets.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK(rp[r] >= 0 && rp[r] < logits.size(0), "row ", rp[r], " is outside the logits");
    TORCH_CHECK(off[r] >= 0 && off[r] <= off[r + 1] && off[r + 1] <= seen.numel(),
                "seen_offsets must be non-decreasing and within seen");
  }
  auto out = at::empty({n}, rows.options());
  auto* op = out.data_ptr<int64_t>();
  const float* lp = logits.data_ptr<float>();
  const int64_t ld = logits.stride(0);
  const auto* tp = temperature.data_ptr<float>();
  const auto* kp = top_k.data_ptr<int64_t>();
  const auto* pp = top_p.data_ptr<double>();
  const auto* pen = penalty.data_ptr<float>();
  const auto* sp = seen.data_ptr<int64_t>();
  const auto* up = uniform.data_ptr<double>();
  auto work = [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> x, w;
    thread_local std::vector<int32_t> cand;
    thread_local std::vector<uint8_t> mark;
    for (int64_t r = begin; r < end; ++r) {
      const RowParams p{tp[r], kp[r], pp[r], pen[r], sp + off[r], off[r + 1] - off[r], up[r]};
      op[r] = sample_row(lp + rp[r] * ld, V, p, x, w, cand, mark);
    }
  };
  if (n > 1) {
    parallel_chunks(n, 1, work);
  } else {
    work(0, n);
  }
  return out;
}
