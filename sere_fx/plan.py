"""Plans: one routing config per MoE layer, saved as JSON (``tune`` writes them, every front-end reads them).

A plan file holds ``{"layers": {"<decoder layer>": {"policy", "S", "rho"[, "N"]}}, ...}``:
``RoutingConfig.as_dict`` per layer (``weight``'s ``min_importance`` is stored as ``rho``, as
plans have always stored it), plus free-form keys (``tune`` records what it was tuned for).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from sere_fx.config import Quantile, RoutingConfig, config, from_dict  # noqa: F401  (Quantile: public here too)
from sere_fx.errors import argument_error


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


def load_plan(plan) -> dict[int, RoutingConfig]:
    """A plan from a JSON path, a dict as ``save_plan`` writes it, or ``{layer: RoutingConfig}``;
    every entry checked (an error names ``plan[<layer>]``)."""
    path = None
    if isinstance(plan, (str, os.PathLike)):
        path = os.fspath(plan)
        if not os.path.isfile(path):
            raise argument_error("plan", f"plan: no plan file at {path!r}", FileNotFoundError)
        try:
            with open(path) as f:
                plan = json.load(f)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise argument_error("plan", f"plan: {path!r} is not a plan file (JSON from `sere-fx tune`): {exc}") from None
    if isinstance(plan, Mapping) and "layers" in plan:
        plan = plan["layers"]
    if not isinstance(plan, Mapping):
        raise argument_error("plan", "plan: expected a path, a dict with 'layers' or {layer: RoutingConfig}, "
                                     f"got {type(plan).__name__}", TypeError)
    out = {}
    for k, v in plan.items():
        if not (isinstance(k, int) and not isinstance(k, bool)) and not (isinstance(k, str) and k.strip().isdigit()):
            raise argument_error("plan", f"plan: expected decoder-layer indices as keys, got {k!r}")
        if isinstance(v, Mapping):
            v = from_dict(v, int(k))
        if not isinstance(v, RoutingConfig):
            raise argument_error("plan", f"plan[{k}]: expected a RoutingConfig or a dict, got {type(v).__name__}",
                                 TypeError)
        out[int(k)] = v
    return out
