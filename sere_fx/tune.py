"""``tune``: per-layer routing settings that read the fewest experts within a quality budget.

The paper leaves S and rho per deployment (and per layer) open, and a raw rho does not carry
over between models or similarity methods. ``tune`` searches, on a tuning text:

1. *Probe*: every candidate setting (policy x S x rho-quantile) is applied to one MoE layer
   at a time, the others left as they are; each probe is one batched-decode pass that
   measures that layer's distinct experts and the quality loss it causes.
2. *Choose*: a multiple-choice knapsack over layers (dynamic programming on the loss)
   picks one candidate per layer minimising the summed distinct experts subject to the
   summed loss <= ``max_loss``. Losses are clamped at 0, so noise cannot buy experts.
3. *Verify*: the chosen plan is evaluated as a whole. Per-layer losses do not add up
   exactly (layers interact), so the budget given to step 2 is searched (secant steps on
   the measured loss, a few rounds) for the largest one whose plan, measured as a whole,
   stays within ``max_loss``; the best such plan is kept.
4. *Uniform plans*: every candidate applied to all layers at once is measured too, so the
   result is never worse on the tuning text than the best single setting within budget
   (the per-layer model can miss it when its loss estimate is pessimistic).

The loss is the mean NLL increase in nats per scored token (``metric="nll"``, default:
smooth, so small budgets are measurable) or the relative top-1 accuracy drop
(``metric="accuracy"``, i.e. 1 - retention).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from sere_fx.discovery import find_moe_layers
from sere_fx.evaluate import DecodeScores, decode_scores
from sere_fx.plan import LayerPlan, Quantile
from sere_fx.similarity import as_similarity, resolve
from sere_fx.transform import restore, transform

METRICS = ("nll", "accuracy")
DEFAULT_QUANTILES = (0.5, 0.75)


def default_candidates(top_k: int, quantiles=DEFAULT_QUANTILES) -> list[tuple[str, int, object]]:
    """(policy, S, rho) candidates for a layer with top-``top_k`` routing: OEA at S in
    {1, 2, 3, K/2}; SERE at S in {1, 2, 3} with rho 0 and the given similarity quantiles."""
    sizes = sorted({s for s in (1, 2, 3, top_k // 2) if 1 <= s < top_k})
    out = [("oea", s, None) for s in sizes]
    for s in sizes[:3]:
        out.append(("sere", s, 0.0))
        out.extend(("sere", s, Quantile(q)) for q in quantiles)
    return out


def _loss(base: DecodeScores, s: DecodeScores, metric: str) -> float:
    if metric == "nll":
        return s.mean_nll - base.mean_nll
    return 1.0 - s.accuracy / base.accuracy if base.accuracy else math.inf


@dataclass
class Probe:
    layer: int
    plan: LayerPlan
    loss: float
    distinct: float


@dataclass
class TuneResult:
    plan: dict[int, LayerPlan]
    loss: float  # of the whole plan on the tuning text
    distinct: float  # mean distinct experts per layer per step, whole plan
    baseline_distinct: float
    metric: str
    max_loss: float
    probes: list[Probe] = field(default_factory=list)
    rounds: int = 1

    def summary(self) -> str:
        lines = [f"tuned plan ({self.metric} loss {self.loss:+.4f} <= {self.max_loss}; "
                 f"experts/layer {self.distinct:.1f} vs {self.baseline_distinct:.1f}, "
                 f"{100 * (self.distinct / self.baseline_distinct - 1):+.1f}%):"]
        for i, lp in sorted(self.plan.items()):
            rho = "" if lp.rho is None else f", rho={lp.rho:.3f}"
            lines.append(f"  layer {i}: {lp.policy} S={lp.S}{rho}")
        return "\n".join(lines)


def _choose(options: dict[int, list[Probe]], budget: float, resolution: int = 400) -> dict[int, Probe]:
    """Multiple-choice knapsack: one probe per layer, min sum(distinct) s.t. sum(loss) <= budget."""
    step = budget / resolution if budget > 0 else 1.0
    best: dict[int, tuple[float, list[Probe]]] = {0: (0.0, [])}  # loss bin -> (distinct, picks)
    for layer in sorted(options):
        nxt: dict[int, tuple[float, list[Probe]]] = {}
        for used, (dist, picks) in best.items():
            for p in options[layer]:
                cost = math.ceil(max(p.loss, 0.0) / step - 1e-9) if budget > 0 else (0 if p.loss <= 0 else 1)
                total = used + cost
                if total > resolution:
                    continue
                cand = (dist + p.distinct, picks + [p])
                if total not in nxt or cand[0] < nxt[total][0]:
                    nxt[total] = cand
        best = nxt
    _, picks = min(best.values(), key=lambda v: v[0])
    return {p.layer: p for p in picks}


def _uniform_plans(jobs, layers) -> list[dict[int, LayerPlan]]:
    """One plan per candidate, applied to every layer (rho resolved per layer)."""
    per_layer = {}
    for index, lp in jobs:
        per_layer.setdefault(index, []).append(lp)
    counts = {len(v) for v in per_layer.values()}
    if len(per_layer) != len(layers) or len(counts) != 1:
        return []
    return [{i: per_layer[i][j] for i in per_layer} for j in range(counts.pop())]


def tune(model: nn.Module, sim, windows: torch.Tensor, *, max_loss: float = 0.02, metric: str = "nll",
         candidates=None, batch_size: int = 32, prefill: int = 4, max_tokens: int | None = None,
         verify_rounds: int = 8, progress: bool = True) -> TuneResult:
    """Per-layer (policy, S, rho) for ``model`` on tuning ``windows``; see the module doc.

    ``candidates``: ``[(policy, S, rho), ...]`` tried on every layer (default
    ``default_candidates``). The untouched setting is always a choice. ``verify_rounds``:
    whole-plan evaluations in the budget search (step 3).
    """
    if metric not in METRICS:
        raise ValueError(f"metric: expected one of {list(METRICS)}, got {metric!r}")
    if not (isinstance(max_loss, (int, float)) and math.isfinite(max_loss) and max_loss >= 0):
        raise ValueError(f"max_loss: expected a finite number >= 0, got {max_loss!r}")
    layers = find_moe_layers(model)
    sim = as_similarity(sim)
    matrices = resolve(sim, layers)
    kw = dict(batch_size=batch_size, prefill=prefill, progress=False)
    base = decode_scores(model, windows, **kw)
    untouched = {layer.index: LayerPlan("sere", layer.top_k, 0.0) for layer in layers}  # S = K: identity

    def run(plan: dict[int, LayerPlan]) -> DecodeScores:
        transform(model, sim, plan=plan, max_tokens=max_tokens)
        try:
            return decode_scores(model, windows, **kw)
        finally:
            restore(model)

    options: dict[int, list[Probe]] = {}
    jobs = []
    for layer in layers:
        options[layer.index] = [Probe(layer.index, untouched[layer.index], 0.0, base.distinct[layer.index])]
        for policy, S, rho in candidates or default_candidates(layer.top_k):
            if not 1 <= S <= layer.top_k:
                raise ValueError(f"candidates: S={S} is outside [1, {layer.top_k}] for layer {layer.index}")
            if isinstance(rho, Quantile):
                rho = rho.resolve(matrices[layer.index])
            jobs.append((layer.index, LayerPlan(policy, S, rho)))
    uniform = _uniform_plans(jobs, layers)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(jobs) + len(uniform) + verify_rounds, desc="tune", unit="pass")
    for index, lp in jobs:
        s = run({**untouched, index: lp})
        options[index].append(Probe(index, lp, _loss(base, s, metric), s.distinct[index]))
        if bar is not None:
            bar.update(1)
    best = (untouched, 0.0, base)  # the untouched model is always within budget
    tried = {}
    for plan in uniform:
        s = tried[tuple(sorted(plan.items()))] = run(plan)
        loss = _loss(base, s, metric)
        if loss <= max_loss and s.mean_distinct < best[2].mean_distinct:
            best = (plan, loss, s)
        if bar is not None:
            bar.update(1)
    budget, rounds = max_loss, 0
    while rounds < verify_rounds:
        rounds += 1
        plan = {i: p.plan for i, p in _choose(options, budget).items()}
        key = tuple(sorted(plan.items()))
        if key in tried:
            break  # the search settled on a plan already measured
        s = tried[key] = run(plan)
        loss = _loss(base, s, metric)
        if loss <= max_loss and s.mean_distinct < best[2].mean_distinct:
            best = (plan, loss, s)
        if bar is not None:
            bar.update(1)
        # secant step: the internal budget at which the whole plan would cost exactly max_loss
        scale = max_loss / loss if loss > 0 else 2.0
        budget = budget * min(max(scale, 0.5), 2.0) * (0.98 if loss > max_loss else 1.0)
    if bar is not None:
        bar.close()
    plan, loss, s = best
    base_distinct = float(sum(base.distinct.values()) / len(base.distinct))
    return TuneResult(plan, loss, s.mean_distinct, base_distinct, metric, max_loss,
                      [p for ps in options.values() for p in ps], rounds)
