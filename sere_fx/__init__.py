"""sere-fx: training-free, batch-aware expert re-routing for MoE models, as a graph pass.

    model = sere_fx.transform(model, sim, S=2, rho=0.5)
"""

from sere_fx import ops  # noqa: F401  (registers torch.ops.sere.reroute)
from sere_fx.passes.matcher import RoutingMatchError
from sere_fx.plan import LayerPlan, Quantile, load_plan, save_plan
from sere_fx.policies import POLICIES, bypass
from sere_fx.similarity import Similarity
from sere_fx.stats import LayerStats
from sere_fx.tune import tune
from sere_fx.transform import DEFAULT_MAX_TOKENS, SereSettings, is_transformed, restore, routing_stats, transform

from sere_fx.compile import backend, register as _register_backend

_register_backend()  # torch.compile(..., backend="sere")

from sere_fx.kernels.experts_cpu import register as _register_experts

_register_experts()  # model.set_experts_implementation("sere_sparse")

__version__ = "0.1.0"

__all__ = [
    "transform",
    "tune",
    "backend",
    "restore",
    "is_transformed",
    "routing_stats",
    "Similarity",
    "SereSettings",
    "LayerStats",
    "RoutingMatchError",
    "DEFAULT_MAX_TOKENS",
    "POLICIES",
    "bypass",
    "Quantile",
    "LayerPlan",
    "load_plan",
    "save_plan",
]
