"""Per-layer routing settings: which policy, S, rho and N each MoE layer uses.

``transform`` takes ``policy``, ``S`` and ``rho`` either as one value for every MoE layer or
as ``{decoder_layer_index: value}``; ``rho`` may also be a ``Quantile``, resolved per layer
against that layer's similarity matrix (a raw rho does not carry over between models or
similarity methods; a quantile does). ``tune`` writes plans as JSON; ``transform(plan=...)``
reads them back.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import torch

from sere_fx.policies import INDEX_POLICIES, POLICIES
from sere_fx.similarity import check_finite_float

DEFAULT_RHO = 0.5


@dataclass(frozen=True)
class Quantile:
    """``rho`` as the q-quantile of a layer's off-diagonal similarities (q in [0, 1])."""

    q: float

    def __post_init__(self):
        if not (isinstance(self.q, (int, float)) and 0 <= self.q <= 1):
            raise ValueError(f"Quantile.q: expected a number in [0, 1], got {self.q!r}")

    def resolve(self, matrix: torch.Tensor) -> float:
        e = matrix.shape[0]
        off = matrix[~torch.eye(e, dtype=torch.bool, device=matrix.device)].double()
        return float(torch.quantile(off, self.q)) if off.numel() else 0.0


@dataclass(frozen=True)
class LayerPlan:
    policy: str
    S: int
    rho: float | None = None  # index policies: a similarity; ``weight``: an importance threshold
    N: int | float | None = None  # ``weight`` only: at most N experts per call (a float: a fraction)

    def as_dict(self) -> dict:
        d = asdict(self)
        if d["N"] is None:  # only ``weight`` has a budget; plans of the other policies stay as they were
            del d["N"]
        return d


def parse_budget(text: str) -> int | float:
    """``N`` as typed (``--N``, ``weight:N=...``): an int literal is a count, anything else a
    float (a fraction); ``build_plan`` checks the range. Raises ValueError for neither."""
    try:
        return int(text)
    except ValueError:
        return float(text)


def _per_layer(name: str, value, layers):
    if isinstance(value, Mapping):
        keys = sorted(value)
        want = [layer.index for layer in layers]
        if keys != want:
            raise ValueError(f"{name}: expected values for the MoE decoder layers {want}, got layers {keys}")
        return {layer.index: value[layer.index] for layer in layers}
    return {layer.index: value for layer in layers}


def _layer_plan(p, s, r, n, where: dict, layer=None, matrix=None) -> LayerPlan:
    """One layer's settings checked; ``where`` holds each argument's ``[layer]`` suffix for messages.

    Without ``layer`` (model-independent checks) S is checked only for >= 1 and a ``Quantile``
    is kept as it is; with it, S against the layer's top-k and a quantile resolved on ``matrix``.
    """
    if p not in POLICIES:
        raise ValueError(f"policy{where['policy']}: expected one of {list(POLICIES)}, got {p!r}")
    if isinstance(s, bool) or not isinstance(s, int):
        raise TypeError(f"S{where['S']}: expected an int, got {s!r} ({type(s).__name__})")
    if layer is not None and not 1 <= s <= layer.top_k:
        raise ValueError(f"S{where['S']}: expected an integer in [1, {layer.top_k}] (top-k of {layer.name}), got {s}")
    if s < 1:
        raise ValueError(f"S{where['S']}: expected an integer >= 1, got {s}")
    w = where["rho"]
    if p in INDEX_POLICIES:
        if r is None:
            r = DEFAULT_RHO
        if isinstance(r, Quantile) and layer is not None:
            r = r.resolve(matrix)
        if not isinstance(r, Quantile):  # a model-independent check keeps the quantile as given
            r = check_finite_float(f"rho{w}", r)
    elif p == "weight":
        if isinstance(r, Quantile):
            raise ValueError(f"rho{w}: policy 'weight' takes an importance threshold (a float >= 0), "
                             f"not a similarity quantile; got {r!r}")
        if r is not None:
            r = check_finite_float(f"rho{w}", r)
            if r < 0:
                raise ValueError(f"rho{w}: expected an importance threshold >= 0 for policy 'weight', got {r}")
    elif r is not None:
        raise ValueError(f"rho{w}: policy {p!r} does not use rho (leave it None), got {r!r}")
    w = where["N"]
    if p == "weight":
        if n is None and r is None:
            raise ValueError(f"N{w}: policy 'weight' needs N (experts per call), rho (an importance "
                             "threshold) or both; got neither")
        count = isinstance(n, int) and not isinstance(n, bool) and n >= 1
        fraction = isinstance(n, float) and 0 < n < 1
        if n is not None and not (count or fraction):
            raise ValueError(f"N{w}: expected a positive int (experts per call), a float in (0, 1) (a fraction "
                             f"of the experts the call's tokens picked) or None, got {n!r}")
    elif n is not None:
        raise ValueError(f"N{w}: only policy 'weight' takes an expert budget (leave it None for {p!r}), got {n!r}")
    return LayerPlan(p, s, r, n)


_NAMES = ("policy", "S", "rho", "N")


def build_plan(layers, policy, S, rho, matrices: Mapping[int, torch.Tensor] | None, N=None) -> dict[int, LayerPlan]:
    """Validate settings against the model's MoE layers; every error names the argument."""
    values = dict(zip(_NAMES, (policy, S, rho, N)))
    per_layer = {name: _per_layer(name, value, layers) for name, value in values.items()}
    plan = {}
    for layer in layers:
        i = layer.index
        where = {name: f"[{i}]" if isinstance(value, Mapping) else "" for name, value in values.items()}
        plan[i] = _layer_plan(*(per_layer[name][i] for name in _NAMES), where, layer,
                              None if matrices is None else matrices.get(i))
    return plan


def check_settings(policy, S, rho, N=None) -> None:
    """The model-independent part of ``build_plan``: each value's type and range, for every layer
    a mapping names (``{layer: value}`` mappings may name different layers; ``build_plan`` checks
    them against the model)."""
    values = dict(zip(_NAMES, (policy, S, rho, N)))
    keys = sorted({k for v in values.values() if isinstance(v, Mapping) for k in v}) or [None]
    for key in keys:
        where = {name: f"[{key}]" if isinstance(value, Mapping) else "" for name, value in values.items()}
        picked = [value.get(key) if isinstance(value, Mapping) else value for value in values.values()]
        if picked[0] is None or picked[1] is None:
            continue  # a layer a mapping leaves out: build_plan names it against the model
        _layer_plan(*picked, where)


def save_plan(path: str | os.PathLike, plan: Mapping[int, LayerPlan], **extra) -> None:
    data = {"layers": {str(i): lp.as_dict() for i, lp in sorted(plan.items())}, **extra}
    with open(path, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)


def load_plan(plan) -> dict[int, LayerPlan]:
    """A plan from a JSON path, a dict as ``save_plan`` writes it, or ``{layer: LayerPlan}``."""
    if isinstance(plan, (str, os.PathLike)):
        if not os.path.isfile(plan):
            raise FileNotFoundError(f"plan: no plan file at {os.fspath(plan)!r}")
        with open(plan) as f:
            plan = json.load(f)
    if isinstance(plan, Mapping) and "layers" in plan:
        plan = plan["layers"]
    if not isinstance(plan, Mapping):
        raise TypeError(f"plan: expected a path, a dict with 'layers' or {{layer: LayerPlan}}, got {type(plan).__name__}")
    out = {}
    for k, v in plan.items():
        if isinstance(v, Mapping):
            unknown = sorted(set(v) - {"policy", "S", "rho", "N"})
            if unknown or not {"policy", "S"} <= set(v):
                raise ValueError(f"plan[{k}]: expected keys policy, S, rho and N, got {sorted(v)}")
            v = LayerPlan(**v)
        if not isinstance(v, LayerPlan):
            raise TypeError(f"plan[{k}]: expected a LayerPlan or a dict, got {type(v).__name__}")
        if v.rho is not None and not math.isfinite(v.rho):
            raise ValueError(f"plan[{k}].rho: expected a finite float, got {v.rho}")
        out[int(k)] = v
    return out


def plan_settings(plan, policy="sere", S=2, rho=None, N=None) -> tuple[dict, dict, dict, dict]:
    """A plan (anything ``load_plan`` takes) as per-layer ``policy``, ``S``, ``rho``, ``N`` mappings.

    ``policy``, ``S``, ``rho`` and ``N`` are what the caller was given besides the plan: anything
    but their defaults would be overridden, so it is an error rather than ignored.
    """
    for name, value, default in (("policy", policy, "sere"), ("S", S, 2), ("rho", rho, None), ("N", N, None)):
        if value != default:
            raise ValueError(f"{name}: a plan sets it per layer; got {name}={value!r} as well")
    layers = load_plan(plan)
    return tuple({i: getattr(lp, key) for i, lp in layers.items()} for key in ("policy", "S", "rho", "N"))
