"""sere-fx: training-free, batch-aware expert re-routing for MoE models, as a graph pass.

    model = sere_fx.transform(model, sim, sere_fx.SereConfig(S=2, rho=0.5))
    model = sere_fx.transform(model, sim, S=2, rho=0.5)  # the same, as keywords
"""

import importlib.abc as _abc
import importlib.util as _util
import os as _os
import sys as _sys


class _SourceTreeFinder(_abc.MetaPathFinder):
    """Run from a plain source checkout (no install): ``calibration/`` and ``exporters/`` sit
    beside ``sere_fx/`` and an install maps them to ``sere_fx.calibration`` / ``sere_fx.exporters``
    (pyproject ``package-dir``). Consulted only after every other finder failed."""

    _root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))

    def find_spec(self, name, path=None, target=None):
        head, _, tail = name.partition(".")
        sub, _, rest = tail.partition(".")
        if head != "sere_fx" or sub not in ("calibration", "exporters"):
            return None
        folder = _os.path.join(self._root, sub, *rest.split(".")) if rest else _os.path.join(self._root, sub)
        init = _os.path.join(folder, "__init__.py")
        if _os.path.isfile(init):
            return _util.spec_from_file_location(name, init, submodule_search_locations=[folder])
        if _os.path.isfile(folder + ".py"):
            return _util.spec_from_file_location(name, folder + ".py")
        return None


if not any(isinstance(f, _SourceTreeFinder) for f in _sys.meta_path):
    _sys.meta_path.append(_SourceTreeFinder())

from sere_fx import ops  # noqa: E402,F401  (registers torch.ops.sere.reroute)
from sere_fx.config import (
    OFF,
    LeastSimilarConfig,
    OEAConfig,
    OffConfig,
    OutputConfig,
    PriorConfig,
    Quantile,
    RandomConfig,
    RoutingConfig,
    RowRanges,
    SereConfig,
    TopKConfig,
    WeightConfig,
)
from sere_fx.errors import ArgumentError
from sere_fx.placement import Placement
from sere_fx.passes.matcher import RoutingMatchError
from sere_fx.plan import LayerPlan, load_plan, save_plan
from sere_fx.policies import POLICIES, batch_groups, bypass
from sere_fx.similarity import Similarity
from sere_fx.stats import LayerStats
from sere_fx.tuning import tune
from sere_fx.model_transform import DEFAULT_MAX_TOKENS, SereSettings, is_transformed, restore, routing_stats, transform
from sere_fx.expert_cache import CacheCounters, cache_stats, is_offloaded, offload, reset_caches

from sere_fx.compile import backend, register as _register_backend

_register_backend()  # torch.compile(..., backend="sere")

from sere_fx.kernels.experts_cpu import register as _register_experts

_register_experts()  # model.set_experts_implementation("sere_sparse")

__version__ = "0.1.0"

__all__ = [
    "transform",
    "RoutingConfig",
    "SereConfig",
    "OEAConfig",
    "WeightConfig",
    "OutputConfig",
    "TopKConfig",
    "LeastSimilarConfig",
    "RandomConfig",
    "RowRanges",
    "OffConfig",
    "OFF",
    "PriorConfig",
    "offload",
    "cache_stats",
    "reset_caches",
    "is_offloaded",
    "CacheCounters",
    "ArgumentError",
    "Placement",
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
    "batch_groups",
    "Quantile",
    "LayerPlan",
    "load_plan",
    "save_plan",
]


def __getattr__(name):
    # ``sere_fx.calibration`` / ``sere_fx.exporters`` without importing them first (they pull
    # in more than ``transform`` needs, so they load on first use).
    if name in ("calibration", "exporters"):
        import importlib

        return importlib.import_module(f"sere_fx.{name}")
    raise AttributeError(f"module 'sere_fx' has no attribute {name!r}")
