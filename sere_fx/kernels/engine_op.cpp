// The vLLM plugin's per-layer ops as native CPU kernels (see sere_fx/vllm/engine.py): SERE's
// step (sere_native::engine_reroute, the same C kernel as sere.reroute's CPU path, reroute.c)
// and the top-k policies' row lookup (sere_native::engine_rows), called by the dispatcher
// straight from vLLM's compiled graph, with no Python frame and no ctypes marshalling. Inside an
// engine every call starts with caches that the layers' matrix products flushed, and there each
// Python-level step costs several times its warm figure.
//
// The engine's persistent row buffers (bool [max_tokens]: re-routed rows, kept rows) are bound
// once with sere_native::engine_bind_rows; a call reads their first T entries.
//
// sere_native::fused_moe is vLLM's CPU fused-MoE kernel (_C::cpu_fused_moe, looked up in the
// dispatcher when first called, so this file builds without vLLM) with exact slot merging: see
// merge_slots below.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <tuple>
#include <vector>

extern "C" {
#include "reroute.c"
}

namespace {

at::Tensor g_rows, g_kept;

void bind_rows(const at::Tensor& rows, const at::Tensor& kept) {
  TORCH_CHECK(rows.dtype() == at::kBool && kept.dtype() == at::kBool && rows.is_contiguous() &&
                  kept.is_contiguous() && rows.numel() == kept.numel(),
              "engine_bind_rows: expected two contiguous bool buffers of one size");
  g_rows = rows;
  g_kept = kept;
}

at::Tensor engine_reroute(const at::Tensor& topk_ids, const at::Tensor& similarity, const at::Tensor& candidates,
                          int64_t S, double rho, const at::Tensor& rank_values) {
  const int64_t t = topk_ids.size(0), k = topk_ids.size(1), e = similarity.size(0);
  // Outside an engine step (no buffers, or more rows than they hold): no row is re-routed.
  if (!g_rows.defined() || t > g_rows.numel() || S >= k || t == 0) return topk_ids.clone();
  TORCH_CHECK(similarity.dtype() == at::kFloat && similarity.is_contiguous() && candidates.dtype() == at::kInt &&
                  candidates.is_contiguous() && candidates.size(0) == e && candidates.size(1) == e,
              "engine_reroute: expected a contiguous float32 similarity and its int32 [E, E] candidates");
  TORCH_CHECK(e <= sere_max_experts() && k <= sere_max_slots(), "engine_reroute: at most ", sere_max_experts(),
              " experts and ", sere_max_slots(), " slots, got ", e, " and ", k);
  at::Tensor ids = topk_ids.contiguous();
  at::Tensor rank = rank_values.to(at::kFloat).contiguous();
  at::Tensor out = at::empty_like(ids);
  const uint8_t* rows = reinterpret_cast<const uint8_t*>(g_rows.data_ptr<bool>());
  const uint8_t* kept = reinterpret_cast<const uint8_t*>(g_kept.data_ptr<bool>());
  bool any_kept = false;  // a pure decode step passes no free rows
  for (int64_t i = 0; i < t && !any_kept; ++i) any_kept = kept[i];
  const float* sim = similarity.data_ptr<float>();
  const int32_t* cand = candidates.data_ptr<int32_t>();
  if (ids.scalar_type() == at::kInt) {
    sere_reroute_i32(ids.data_ptr<int32_t>(), out.data_ptr<int32_t>(), t, k, e, S, sim, cand, (float)rho,
                     rank.data_ptr<float>(), rows, any_kept ? kept : nullptr);
  } else {
    TORCH_CHECK(ids.scalar_type() == at::kLong, "engine_reroute: topk_ids must be int32 or int64");
    sere_reroute_i64(ids.data_ptr<int64_t>(), out.data_ptr<int64_t>(), t, k, e, S, sim, cand, (float)rho,
                     rank.data_ptr<float>(), rows, any_kept ? kept : nullptr);
  }
  return out;
}

template <typename T>
void mark_experts(const T* ids, int64_t t, int64_t k, int64_t e, const uint8_t* kept, bool* free) {
  for (int64_t i = 0; i < t; ++i) {
    if (!kept[i]) continue;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t x = (int64_t)ids[i * k + j];
      if (x >= 0 && x < e) free[x] = true;
    }
  }
}

// The top-k policies' row lookup (sere::engine_rows' twin): this step's re-routed rows, and the
// experts the kept rows read anyway (every slot of them; ids outside [0, E) count for nothing).
std::tuple<at::Tensor, at::Tensor> engine_rows(const at::Tensor& topk_ids, int64_t num_experts) {
  const int64_t t = topk_ids.size(0), k = topk_ids.size(1);
  at::Tensor rows = at::zeros({t}, topk_ids.options().dtype(at::kBool));
  at::Tensor free = at::zeros({num_experts}, topk_ids.options().dtype(at::kBool));
  if (!g_rows.defined() || t > g_rows.numel()) return {rows, free};  // outside an engine step
  std::memcpy(rows.data_ptr<bool>(), g_rows.data_ptr<bool>(), (size_t)t);
  const uint8_t* kept = reinterpret_cast<const uint8_t*>(g_kept.data_ptr<bool>());
  at::Tensor ids = topk_ids.contiguous();
  if (ids.scalar_type() == at::kInt) {
    mark_experts(ids.data_ptr<int32_t>(), t, k, num_experts, kept, free.data_ptr<bool>());
  } else {
    TORCH_CHECK(ids.scalar_type() == at::kLong, "engine_rows: topk_ids must be int32 or int64");
    mark_experts(ids.data_ptr<int64_t>(), t, k, num_experts, kept, free.data_ptr<bool>());
  }
  return {rows, free};
}

// --- exact slot merging -----------------------------------------------------------------------
// A re-routed token often has two slots on one expert (its secondary expert went to a primary it
// already uses), and the top-k policies fill slots they cannot fill with weight-0 copies of the
// token's first expert. vLLM's CPU kernel computes every slot (an id of -1, how expert
// parallelism marks other ranks' experts, would index out of its bounds), so the merge happens
// here: each token's distinct experts with a non-zero summed weight become one slot each, and
// the kernel runs once over those (token, expert) pairs as pseudo-tokens of top-1.

// The pairs of ids / weights [T, K] (int32 / float32, contiguous): for each token in order, its
// distinct experts in the order of their first slot, each with the sum of its slots' weights; a
// pair whose sum is 0 is left out. Returns the number of pairs, or -1 for an id outside [0, E).
int64_t merge_slots(const int32_t* ids, const float* weights, int64_t t, int64_t k, int64_t e,
                    int64_t* pair_token, int32_t* pair_expert, float* pair_weight) {
  int64_t m = 0;
  for (int64_t i = 0; i < t; ++i) {
    const int64_t first = m;
    for (int64_t j = 0; j < k; ++j) {
      const int32_t x = ids[i * k + j];
      if (x < 0 || x >= e) return -1;
      int64_t p = first;
      while (p < m && pair_expert[p] != x) ++p;
      if (p == m) {
        pair_token[m] = i;
        pair_expert[m] = x;
        pair_weight[m] = 0.0f;
        ++m;
      }
      pair_weight[p] += weights[i * k + j];
    }
    int64_t kept = first;  // drop this token's pairs of weight 0, keeping the order
    for (int64_t p = first; p < m; ++p) {
      if (pair_weight[p] != 0.0f) {
        pair_token[kept] = pair_token[p];
        pair_expert[kept] = pair_expert[p];
        pair_weight[kept] = pair_weight[p];
        ++kept;
      }
    }
    m = kept;
  }
  return m;
}

// Whether merge_slots would leave a call as it is (it returns -1 for an id outside [0, E), or T * K
// when every token's K slots sit on K distinct experts with non-zero weights), decided before
// anything is allocated: a call with nothing to merge (an off step, the model's own routing)
// costs one pass over its slots on top of vLLM's kernel.
bool nothing_to_merge(const int32_t* ids, const float* weights, int64_t t, int64_t k, int64_t e) {
  for (int64_t i = 0; i < t * k; ++i) {
    if (ids[i] < 0 || ids[i] >= e) return true;
  }
  for (int64_t i = 0; i < t; ++i) {
    const int32_t* row = ids + i * k;
    for (int64_t j = 0; j < k; ++j) {
      if (weights[i * k + j] == 0.0f) return false;
      for (int64_t jj = 0; jj < j; ++jj) {
        if (row[jj] == row[j]) return false;
      }
    }
  }
  return true;
}

// A row of y added to a float32 accumulator; bfloat16 widened by a shift, which compilers vectorise
// (c10::BFloat16's conversion is not inlined into a loop they can vectorise).
template <typename scalar_t>
inline void add_row(float* acc, const scalar_t* row, int64_t h) {
  for (int64_t j = 0; j < h; ++j) acc[j] += static_cast<float>(row[j]);
}

template <>
inline void add_row<c10::BFloat16>(float* acc, const c10::BFloat16* row, int64_t h) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(row);
  for (int64_t j = 0; j < h; ++j) {
    const uint32_t wide = static_cast<uint32_t>(bits[j]) << 16;
    float value;
    std::memcpy(&value, &wide, sizeof(value));
    acc[j] += value;
  }
}

// output[t] = the sum of the rows of y [M, H] whose pair belongs to token t (pairs come in token
// order), accumulated in float32 and rounded once: one pass over y, no float32 copy of it.
template <typename scalar_t>
void sum_pairs_impl(const scalar_t* y, const int64_t* pair_token, int64_t m, scalar_t* out, int64_t t, int64_t h) {
  std::vector<int64_t> start(t + 1, m);
  for (int64_t p = m - 1; p >= 0; --p) start[pair_token[p]] = p;
  for (int64_t i = t - 1; i >= 0; --i) start[i] = std::min(start[i], start[i + 1]);
  at::parallel_for(0, t, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(h);
    for (int64_t i = begin; i < end; ++i) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t p = start[i]; p < start[i + 1]; ++p) add_row(acc.data(), y + p * h, h);
      scalar_t* dst = out + i * h;
      for (int64_t j = 0; j < h; ++j) dst[j] = static_cast<scalar_t>(acc[j]);
    }
  });
}

void sum_pairs(const at::Tensor& y, const int64_t* pair_token, int64_t m, at::Tensor& output) {
  at::Tensor out = output.is_contiguous() ? output : at::empty_like(output, at::MemoryFormat::Contiguous);
  const int64_t t = out.size(0), h = out.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "sum_pairs", [&] {
    sum_pairs_impl<scalar_t>(y.data_ptr<scalar_t>(), pair_token, m, out.data_ptr<scalar_t>(), t, h);
  });
  if (!output.is_same(out)) output.copy_(out);
}

bool step_has_kept_rows(int64_t t) {
  if (!g_kept.defined()) return false;
  const uint8_t* kept = reinterpret_cast<const uint8_t*>(g_kept.data_ptr<bool>());
  for (int64_t i = 0; i < t && i < g_kept.numel(); ++i)
    if (kept[i]) return true;
  return false;
}

void call_vllm_fused_moe(at::Tensor& output, const at::Tensor& input, const at::Tensor& w13, const at::Tensor& w2,
                         const std::optional<at::Tensor>& w13_bias, const std::optional<at::Tensor>& w2_bias,
                         const at::Tensor& topk_weights, const at::Tensor& topk_ids, bool skip_weighted,
                         c10::string_view act, c10::string_view isa) {
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("_C::cpu_fused_moe", "");
  std::vector<c10::IValue> stack{output, input, w13, w2, w13_bias, w2_bias, topk_weights, topk_ids, skip_weighted,
                                 std::string(act), std::string(isa)};
  op.callBoxed(&stack);
}

// _C::cpu_fused_moe with each token's duplicate slots merged and its weight-0 slots skipped.
// Steps whose rows keep the model's routing (prompt rows, opted-out requests) run vLLM's call
// unchanged, so those rows are computed exactly as plain vLLM computes them; so does a call with
// nothing to merge (bitwise the same output). The merged call rounds each pair's weighted output
// to the activation dtype before the per-token sum (vLLM sums a token's slots in float32 and
// rounds once): in bfloat16 the two differ in the last bits, in float32 by summation order only.
void fused_moe(at::Tensor& output, const at::Tensor& input, const at::Tensor& w13, const at::Tensor& w2,
               const std::optional<at::Tensor>& w13_bias, const std::optional<at::Tensor>& w2_bias,
               const at::Tensor& topk_weights, const at::Tensor& topk_ids, bool skip_weighted, c10::string_view act,
               c10::string_view isa) {
  const int64_t t = topk_ids.size(0), k = topk_ids.size(1), e = w13.size(0);
  const bool mergeable = !skip_weighted && t > 0 && topk_ids.scalar_type() == at::kInt &&
                         topk_weights.scalar_type() == at::kFloat && topk_ids.is_contiguous() &&
                         topk_weights.is_contiguous() && input.is_contiguous() && !step_has_kept_rows(t);
  if (!mergeable || nothing_to_merge(topk_ids.data_ptr<int32_t>(), topk_weights.data_ptr<float>(), t, k, e)) {
    call_vllm_fused_moe(output, input, w13, w2, w13_bias, w2_bias, topk_weights, topk_ids, skip_weighted, act, isa);
    return;
  }
  at::Tensor pair_token = at::empty({t * k}, topk_ids.options().dtype(at::kLong));
  at::Tensor pair_expert = at::empty({t * k, 1}, topk_ids.options());
  at::Tensor pair_weight = at::empty({t * k, 1}, topk_weights.options());
  const int64_t m = merge_slots(topk_ids.data_ptr<int32_t>(), topk_weights.data_ptr<float>(), t, k, e,
                                pair_token.data_ptr<int64_t>(), pair_expert.data_ptr<int32_t>(),
                                pair_weight.data_ptr<float>());
  if (m < 0 || m == t * k) {  // an id out of range: vLLM's kernel decides; nothing to merge: unchanged
    call_vllm_fused_moe(output, input, w13, w2, w13_bias, w2_bias, topk_weights, topk_ids, skip_weighted, act, isa);
    return;
  }
  at::Tensor tokens = pair_token.narrow(0, 0, m);
  at::Tensor x = input.index_select(0, tokens);
  at::Tensor y = at::empty({m, output.size(1)}, output.options().memory_format(at::MemoryFormat::Contiguous));
  if (m > 0) {
    call_vllm_fused_moe(y, x, w13, w2, w13_bias, w2_bias, pair_weight.narrow(0, 0, m), pair_expert.narrow(0, 0, m),
                        false, act, isa);
  }
  sum_pairs(y, pair_token.data_ptr<int64_t>(), m, output);
}

// The pairs merge_slots makes, as tensors (tests compare them with a plain loop): (token [M],
// expert [M], weight [M]) for int32 ids and float32 weights [T, K].
std::tuple<at::Tensor, at::Tensor, at::Tensor> slot_pairs(const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                                                          int64_t num_experts) {
  TORCH_CHECK(topk_ids.scalar_type() == at::kInt && topk_weights.scalar_type() == at::kFloat &&
                  topk_ids.sizes() == topk_weights.sizes() && topk_ids.dim() == 2,
              "slot_pairs: expected int32 ids and float32 weights of one shape [T, K]");
  at::Tensor ids = topk_ids.contiguous(), w = topk_weights.contiguous();
  const int64_t t = ids.size(0), k = ids.size(1);
  at::Tensor token = at::empty({t * k}, ids.options().dtype(at::kLong));
  at::Tensor expert = at::empty({t * k}, ids.options());
  at::Tensor weight = at::empty({t * k}, w.options());
  const int64_t m = merge_slots(ids.data_ptr<int32_t>(), w.data_ptr<float>(), t, k, num_experts,
                                token.data_ptr<int64_t>(), expert.data_ptr<int32_t>(), weight.data_ptr<float>());
  TORCH_CHECK(m >= 0, "slot_pairs: an id outside [0, ", num_experts, ")");
  return {token.narrow(0, 0, m).clone(), expert.narrow(0, 0, m).clone(), weight.narrow(0, 0, m).clone()};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sere_native, m) {
  m.def("engine_bind_rows(Tensor rows, Tensor kept) -> ()");
  m.def("engine_reroute(Tensor topk_ids, Tensor similarity, Tensor candidates, int S, float rho, "
        "Tensor rank_values) -> Tensor");
  m.def("engine_rows(Tensor topk_ids, int num_experts) -> (Tensor, Tensor)");
  m.def("fused_moe(Tensor(a!) output, Tensor input, Tensor w13, Tensor w2, Tensor? w13_bias, Tensor? w2_bias, "
        "Tensor topk_weights, Tensor topk_ids, bool skip_weighted, str act, str isa) -> ()");
  m.def("slot_pairs(Tensor topk_ids, Tensor topk_weights, int num_experts) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(sere_native, CPU, m) {
  m.impl("engine_bind_rows", bind_rows);
  m.impl("engine_reroute", engine_reroute);
  m.impl("engine_rows", engine_rows);
  m.impl("fused_moe", fused_moe);
  m.impl("slot_pairs", slot_pairs);
}
