// The vLLM plugin's per-layer ops as native CPU kernels (see sere_fx/vllm/engine.py): SERE's
// step (sere_native::engine_reroute, the same C kernel as sere.reroute's CPU path, reroute.c)
// and the top-k policies' row lookup (sere_native::engine_rows), called by the dispatcher
// straight from vLLM's compiled graph, with no Python frame and no ctypes marshalling. Inside an
// engine every call starts with caches that the layers' matrix products flushed, and there each
// Python-level step costs several times its warm figure.
//
// The engine's persistent row buffers (bool [max_tokens]: re-routed rows, kept rows) are bound
// once with sere_native::engine_bind_rows; a call reads their first T entries.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstring>
#include <tuple>

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

}  // namespace

TORCH_LIBRARY_FRAGMENT(sere_native, m) {
  m.def("engine_bind_rows(Tensor rows, Tensor kept) -> ()");
  m.def("engine_reroute(Tensor topk_ids, Tensor similarity, Tensor candidates, int S, float rho, "
        "Tensor rank_values) -> Tensor");
  m.def("engine_rows(Tensor topk_ids, int num_experts) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(sere_native, CPU, m) {
  m.impl("engine_bind_rows", bind_rows);
  m.impl("engine_reroute", engine_reroute);
  m.impl("engine_rows", engine_rows);
}
