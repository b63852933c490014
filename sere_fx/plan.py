"""Plans: one routing config per MoE layer, saved as JSON (``tune`` writes them, every front-end reads them).

A plan file holds ``{"layers": {"<decoder layer>": {"policy", "S", "rho"[, "N"]}}, ...}``:
``RoutingConfig.as_dict`` per layer (``weight``'s ``min_importance`` is stored as ``rho``, as
plans have always stored it), plus free-form keys (``tune`` records what it was tuned for).

A plan that follows the load holds ranges of the step's re-routed row count instead:
``{"ranges": [{"min_rows": 1, "layers": {...}}, {"min_rows": 8, "layers": {...}}, ...]}``, each
range's ``layers`` as above, where ``{"policy": "off"}`` is the model's own routing (a whole
range may say ``"layers": "off"``). A step with ``rows`` rows uses the last range whose
``min_rows`` is at most ``rows``. It loads as one ``RowRanges`` per layer; a plan of ``"layers"``
is one range for every batch.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

# load_plan lives with the configs (routing_spec reads plan files), and is public here too
from sere_fx.config import OFF, OffConfig, Quantile, RoutingConfig, RowRanges, config, load_plan  # noqa: F401  (Quantile: public here too)


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


def plan_dict(plan: Mapping[int, RoutingConfig]) -> dict:
    """A plan as its file holds it: ``{"layers": ...}``, or ``{"ranges": [...]}`` when some layer's
    settings follow the load (``RowRanges``); ranges are cut at every layer's bounds."""
    if not any(isinstance(c, RowRanges) for c in plan.values()):
        return {"layers": {str(i): c.as_dict() for i, c in sorted(plan.items())}}
    bounds = sorted({b for c in plan.values() if isinstance(c, RowRanges) for b in c.bounds})
    return {"ranges": [{"min_rows": low, "layers": {str(i): (c.select(low) if isinstance(c, RowRanges) else c).as_dict()
                                                    for i, c in sorted(plan.items())}} for low in bounds]}


def save_plan(path: str | os.PathLike, plan: Mapping[int, RoutingConfig], **extra) -> None:
    data = {**plan_dict(plan), **extra}
    with open(path, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
