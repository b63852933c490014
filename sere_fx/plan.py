"""Plans: one routing config per MoE layer, saved as JSON (``tune`` writes them, every front-end reads them).

A plan file holds ``{"layers": {"<decoder layer>": {"policy", "S", "rho"[, "N"]}}, ...}``:
``RoutingConfig.as_dict`` per layer (``weight``'s ``min_importance`` is stored as ``rho``, as
plans have always stored it), plus free-form keys (``tune`` records what it was tuned for).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

# load_plan lives with the configs (routing_spec reads plan files), and is public here too
from sere_fx.config import Quantile, RoutingConfig, config, load_plan  # noqa: F401  (Quantile: public here too)


def LayerPlan(policy: str, S: int, rho=None, N=None) -> RoutingConfig:  # noqa: N802  (the name plans had)
    """One layer's config from the keyword spelling: ``LayerPlan("sere", 2, 0.5)`` is
    ``SereConfig(S=2, rho=0.5)``, ``LayerPlan("weight", 1, None, 0.6)`` is ``WeightConfig(S=1, N=0.6)``."""
    return config(policy, S, rho, N)


def parse_budget(text: str) -> int | float:
    """``N`` as typed (``--N``, ``weight:N=...``): an int literal is a count, anything else a
    float (a fraction); the config checks the range. Raises ValueError for neither."""
    try:
        return int(text)
    except ValueError:
        return float(text)


def save_plan(path: str | os.PathLike, plan: Mapping[int, RoutingConfig], **extra) -> None:
    data = {"layers": {str(i): c.as_dict() for i, c in sorted(plan.items())}, **extra}
    with open(path, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
