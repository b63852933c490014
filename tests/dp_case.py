"""One MoE layer's routing step, as the vLLM plugin runs it, for the data-parallel test
(``test_vllm_dp.py``): the same batch split over ranks, or whole in one process."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from sere_fx import OEAConfig, Placement, SereConfig, WeightConfig
from sere_fx.vllm import engine
from sere_fx.vllm.routing import LayerRouting, RouterScores

E, K, H = 64, 4, 8  # prompt rows must not cover every expert: E well above their slots
PLANS = {"sere": SereConfig(S=1, rho=0.0), "oea": OEAConfig(S=1), "weight": WeightConfig(S=1, N=0.5),
         # expert parallelism too: at most half of what each of 4 EP ranks' share picked
         "weight_ep": WeightConfig(S=1, N=0.8, rank_budget=0.5, placement=Placement(4))}
# each rank's requests: (id, prefilling, query length); decode rows are re-routed, prompt rows kept
RANKS = [[("a", False, 1), ("b", True, 3), ("c", False, 1)],
         [("d", False, 1), ("e", False, 1), ("f", True, 2), ("g", False, 1)]]


def rows_of(requests) -> int:
    return sum(n for _, _, n in requests)


def batch():
    """Router logits of every rank's rows, in rank order, and the similarity."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(sum(rows_of(r) for r in RANKS), E, generator=g) * 2
    sim = torch.rand(E, E, generator=g)
    return logits, (sim + sim.T) / 2 + torch.eye(E)


def step(policy: str, requests, logits: torch.Tensor, sim: torch.Tensor, reduce=None):
    """The plugin's routing step on ``requests`` (rows ``logits``): (weights, ids)."""
    state = engine._Engine()
    engine.ENGINE = state
    state.allocate(64, 16, "cpu")
    qsl = torch.tensor([0, *np.cumsum([n for _, _, n in requests]).tolist()], dtype=torch.int32)
    out = SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id=r, sampling_params=None) for r, _, _ in requests],
                          finished_req_ids=set(), scheduled_spec_decode_tokens={})
    state.plan_step(out, [r for r, _, _ in requests], np.array([p for _, p, _ in requests]), qsl)
    state.refresh()
    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter

    router = CPURouter(top_k=K, global_num_experts=E, renormalize=True)
    weights, ids = router._compute_routing(torch.zeros(logits.shape[0], H), logits, None)
    routing = LayerRouting(0, PLANS[policy], RouterScores.of(router), sim, E, False, reduce, native_rows=state.native)
    new_weights, new_ids = routing(logits, weights, ids)
    return new_weights, new_ids, ids
