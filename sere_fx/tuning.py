"""``tune``: per-layer routing settings that read the fewest experts within a quality budget.

The paper leaves S and rho per deployment (and per layer) open, and a raw rho does not carry
over between models or similarity methods. ``tune`` searches, on a tuning text:

1. *Probe*: every candidate setting (policy x S x rho-quantile, and ``weight`` budgets as
   fractions of the experts a call picks) is applied to one MoE layer
   at a time, the others left as they are; each probe is one batched-decode pass that
   measures that layer's distinct experts and the quality loss it causes. The layers before
   the probed one compute what the baseline pass computed, so a probe's forwards start at the
   probed layer from the baseline's recorded input (``ModelScorer``, ``sere_fx.prefix``).
2. *Choose*: a multiple-choice knapsack over layers (dynamic programming on the loss)
   picks one candidate per layer minimising the summed distinct experts subject to the
   summed loss <= ``max_loss``. Losses are clamped at 0, so noise cannot buy experts.
3. *Verify*: the chosen plan is evaluated as a whole. Per-layer losses do not add up
   exactly (layers interact), so the budget given to step 2 is searched (secant steps on
   the measured loss, a few rounds) for the largest one whose plan, measured as a whole,
   stays within ``max_loss``; the best such plan is kept.
4. *Uniform plans*: every candidate applied to all layers at once is measured too, so the
   result is never worse on the tuning text than the best single setting within budget
   (the per-layer model can miss it when its loss estimate is pessimistic); one with a layer
   whose probe was stopped early (alone out of the whole budget) is not run. With an expert
   budget, a per-layer plan is kept only if it beats the best uniform plan by more than one
   standard error of their paired per-sequence difference; smaller gains are noise of the
   tuning text, and have not carried over to held-out text.

The loss is the mean NLL increase in nats per scored token (``metric="nll"``, default:
smooth, so small budgets are measurable) or the relative top-1 accuracy drop
(``metric="accuracy"``, i.e. 1 - retention).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from sere_fx.config import OFF, OEAConfig, OutputConfig, Quantile, RoutingConfig, SereConfig, WeightConfig, config, is_exact
from sere_fx.discovery import find_moe_layers, reusing
from sere_fx.errors import ArgumentValueError
from sere_fx.evaluate import DecodeScores, decode_scores
from sere_fx.expert_cache import is_offloaded
from sere_fx.model_transform import restore, transform
from sere_fx.placement import Placement, check_layers
from sere_fx.prefix import PrefixRecord
from sere_fx.similarity import as_similarity, resolve

METRICS = ("nll", "accuracy")
DEFAULT_QUANTILES = (0.5, 0.75)
# ``weight`` budgets as fractions of the experts each call's tokens pick: the unit of
# ``max_experts``, so a uniform plan at the asked fraction is a candidate for the usual
# targets, and a plan's saving carries over to other text and batch sizes.
DEFAULT_BUDGETS = (0.4, 0.5, 0.6, 0.7, 0.8)
# ``output``'s budgets, finer around half the experts: it is the policy for that target (bench/RESULTS.md)
OUTPUT_BUDGETS = (0.4, 0.45, 0.5, 0.55, 0.6, 0.7, 0.8)


def default_candidates(top_k: int, quantiles=DEFAULT_QUANTILES, budgets=DEFAULT_BUDGETS,
                       placement: Placement | None = None, predictors: bool = False) -> list:
    """(policy, S, rho[, N]) candidates for a layer with top-``top_k`` routing: OEA at S in
    {1, 2, 3, K/2}; SERE at S in {1, 2, 3} with rho 0 and the given similarity quantiles;
    ``weight`` at S=1 with the given budget fractions; with a ``placement``, also ``weight`` at
    S=1 with those fractions as per-rank budgets (``WeightConfig``). With ``predictors`` (the
    similarity file has output-size predictors), ``output`` at ``OUTPUT_BUDGETS`` takes ``weight``'s
    place: the same budget rule with a better importance, ahead of ``weight`` at every budget
    measured on held-out text, so probing both would double the budget probes for nothing."""
    sizes = sorted({s for s in (1, 2, 3, top_k // 2) if 1 <= s < top_k})
    out: list[tuple] = [("oea", s, None) for s in sizes]
    for s in sizes[:3]:
        out.append(("sere", s, 0.0))
        out.extend(("sere", s, Quantile(q)) for q in quantiles)
    if predictors:
        out.extend(("output", 1, None, f) for f in (OUTPUT_BUDGETS if budgets is DEFAULT_BUDGETS else budgets))
    else:
        out.extend(("weight", 1, None, f) for f in budgets)
    if placement is not None:
        cls = OutputConfig if predictors else WeightConfig
        out.extend(cls(S=1, rank_budget=f, placement=placement) for f in budgets)
    return out


# On an offloaded model (``sere_fx.offload``) the cost is experts fetched per token, and the candidates
# are the cache-aware rules: SERE toward what is resident, the importance rule, the Cache-Prior rule.
# The importance rule by predicted output size (``output``) replaces the one by share (``weight``) where
# the similarity file has output-size predictors: it fetches fewer at the same loss (bench/RESULTS.md).
OFFLOAD_CANDIDATES = (("sere", 1, 0.5), ("sere", 2, 0.5), ("prior", 1, 0.1), ("prior", 1, 0.2), ("prior", 1, 0.5))
OFFLOAD_WEIGHT = (("weight", 1, 0.002), ("weight", 1, 0.005), ("weight", 1, 0.01), ("weight", 1, 0.02))
OFFLOAD_OUTPUT = (("output", 1, 1.0), ("output", 1, 2.0), ("output", 1, 5.0), ("output", 1, 10.0))


def offload_candidates(predictors: bool) -> tuple:
    """``tune``'s default candidates on an offloaded model (``OFFLOAD_CANDIDATES`` and an importance rule)."""
    return OFFLOAD_CANDIDATES + (OFFLOAD_OUTPUT if predictors else OFFLOAD_WEIGHT)


def _fetches(s: DecodeScores, index: int) -> float:
    """One layer's experts fetched per decode token (an offloaded model's cache misses)."""
    c = s.cache[index]
    return c["misses"] / c["tokens"] if c["tokens"] else 0.0


def _loss(base: DecodeScores, s: DecodeScores, metric: str) -> float:
    if metric == "nll":
        return s.mean_nll - base.mean_nll
    return 1.0 - s.accuracy / base.accuracy if base.accuracy else math.inf


def _paired_se(base: DecodeScores, a: DecodeScores, b: DecodeScores, metric: str) -> float:
    """Standard error of ``_loss(base, a) - _loss(base, b)`` from the per-sequence differences."""
    if metric == "nll":
        per_seq, scale = a.nll - b.nll, float(base.tokens.sum())
    else:
        per_seq, scale = (b.correct - a.correct).astype(float), float(base.correct.sum())
    n = per_seq.shape[0]
    if n < 2 or scale == 0:
        return 0.0
    return float(per_seq.std(ddof=1) * math.sqrt(n) / scale)


# A candidate whose loss on the sequences scored so far is above the budget by more than this many
# standard errors (of its paired per-sequence difference from the baseline) is stopped there: it
# could only come back within the budget on the rest of the text by a 3-sigma swing.
STOP_Z = 3.0


def _out_of_budget(base: DecodeScores, metric: str, budget: float):
    """``decode_scores``' ``stop`` for a candidate scored against ``base`` on the same windows: True once its
    loss on the first ``done`` sequences exceeds ``budget`` by more than ``STOP_Z`` standard errors."""
    def stop(correct, nll, done) -> bool:
        head = DecodeScores(base.correct[:done], base.nll[:done], base.tokens[:done], {})
        if metric == "accuracy" and not head.correct.sum():
            return False
        part = DecodeScores(correct, nll, head.tokens, {})
        return _loss(head, part, metric) - STOP_Z * _paired_se(head, part, head, metric) > budget
    return stop


def _nested(c: RoutingConfig):
    """``(family, size)``: on one layer's input, the settings of a family read nested sets of experts, the
    larger ``size`` the more (a superset): ``oea`` by S (its loaded set is the batch's top-S union), ``sere`` at
    one S by rho (more experts fall below a higher threshold and stay critical), ``weight`` / ``output`` at one S
    and importance threshold by the fraction ``N`` (one fill order, cut later). None: no such family."""
    if type(c) is OEAConfig:
        return ("oea",), c.S
    if type(c) is SereConfig and isinstance(c.rho, float):
        return ("sere", c.S), c.rho
    if type(c) in (WeightConfig, OutputConfig) and isinstance(c.N, float) and c.rank_budget is None:
        return (c.policy, c.S, c.min_importance), c.N
    return None


def _dominated(c: RoutingConfig, free: list[tuple[tuple, float, float]]) -> float | None:
    """The experts ``c`` reads at least, where it reads a superset of a setting in ``free`` (``(family, size,
    experts)`` of the layer's settings probed at no loss), else None. Such a pick costs the knapsack no less
    loss and no fewer experts than the one it contains, so it need not be probed."""
    nest = _nested(c)
    bounds = [] if nest is None else [d for family, size, d in free if family == nest[0] and size <= nest[1]]
    return max(bounds) if bounds else None


# A uniform plan is not run when the probes of its settings already read this much more than the best plan
# found (whole plans read within 0.6% of their probes' sum on the test-bed: bench/RESULTS.md).
UNIFORM_MARGIN = 1.05


@dataclass
class Probe:
    layer: int
    plan: RoutingConfig
    loss: float
    distinct: float


@dataclass
class TuneResult:
    plan: dict[int, RoutingConfig]
    loss: float  # of the whole plan on the tuning text
    distinct: float  # mean distinct experts per layer per step, whole plan
    baseline_distinct: float
    metric: str
    max_loss: float | None  # the quality budget, or None when tuned for an expert budget
    probes: list[Probe] = field(default_factory=list)
    rounds: int = 1
    max_experts: float | None = None  # the expert budget (fraction of the baseline's), or None
    placement: Placement | None = None  # counts are the busiest EP rank's, or None: all experts
    offloaded: bool = False  # counts are experts fetched per token (an offloaded model's misses)
    passes: int = 0  # candidate passes run (the baseline passes not counted)
    stopped: int = 0  # of them, stopped early out of budget (``STOP_Z``)
    skipped: int = 0  # candidate passes not run: they could not change the choice (``prune``)

    def summary(self) -> str:
        if self.max_experts is None:
            head = f"{self.metric} loss {self.loss:+.4f} <= {self.max_loss}"
        else:
            head = f"experts <= {self.max_experts:g} x baseline; {self.metric} loss {self.loss:+.4f}"
        what = ("fetches/token/layer" if self.offloaded else "experts/layer" if self.placement is None
                else f"busiest-rank experts/layer ({self.placement.describe()})")
        stopped = f"; {self.stopped} of {self.passes} passes stopped early, out of budget" if self.stopped else ""
        if self.skipped:
            stopped += f"; {self.skipped} passes skipped, unable to change the choice"
        lines = [f"tuned plan ({head}; {what} {self.distinct:.1f} vs {self.baseline_distinct:.1f}, "
                 f"{100 * (self.distinct / self.baseline_distinct - 1):+.1f}%{stopped}):"]
        for i, lp in sorted(self.plan.items()):
            rho = "" if lp.rho is None else f", rho={lp.rho:.3f}"
            n = "" if lp.N is None else f", N={lp.N:g}"
            rank = "" if getattr(lp, "rank_budget", None) is None else f", Nrank={lp.rank_budget:g}"
            lines.append(f"  layer {i}: {lp.policy} S={lp.S}{rho}{n}{rank}")
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


def _choose_within(options: dict[int, list[Probe]], max_distinct: float, resolution: int = 2000) -> dict[int, Probe] | None:
    """The dual knapsack: one probe per layer, min sum(loss) s.t. sum(distinct) <= max_distinct.

    Losses are clamped at 0 as in ``_choose``; among equal losses the fewer experts win.
    None when no choice fits.
    """
    step = max_distinct / resolution
    best: dict[int, tuple[float, float, list[Probe]]] = {0: (0.0, 0.0, [])}  # distinct bin -> (loss, distinct, picks)
    for layer in sorted(options):
        nxt: dict[int, tuple[float, float, list[Probe]]] = {}
        for used, (loss, dist, picks) in best.items():
            for p in options[layer]:
                total = used + math.ceil(p.distinct / step - 1e-9)
                if total > resolution:
                    continue
                cand = (loss + max(p.loss, 0.0), dist + p.distinct, picks + [p])
                if total not in nxt or cand[:2] < nxt[total][:2]:
                    nxt[total] = cand
        best = nxt
    if not best:
        return None
    _, _, picks = min(best.values(), key=lambda v: v[:2])
    return {p.layer: p for p in picks}


def _uniform_plans(jobs, layers) -> list[dict[int, RoutingConfig]]:
    """One plan per candidate, applied to every layer (rho resolved per layer)."""
    per_layer = {}
    for index, lp in jobs:
        per_layer.setdefault(index, []).append(lp)
    counts = {len(v) for v in per_layer.values()}
    if len(per_layer) != len(layers) or len(counts) != 1:
        return []
    return [{i: per_layer[i][j] for i in per_layer} for j in range(counts.pop())]


class ModelScorer:
    """Scores plans on a transformers model: ``transform`` with the plan, teacher-forced decode, every step
    of ``batch_size * pack`` sequences in one forward (``decode_scores(parallel=True)``: the step-by-step
    scores up to float rounding, several times faster); an offloaded model's caches decode step by step.
    A baseline pass records the MoE decoder layers' inputs (``sere_fx.prefix``): a later plan on the same
    windows that routes its first layers as the model does starts its forwards at the first layer it changes
    (``reuse_prefix``; a probe of the last of four layers runs one layer's experts and the head: that
    layer's attention output is the baseline's, recorded too). Each pass's ``transform`` rewrites copies of
    the routers found when the scorer was made (``discovery.reusing``): the model's routers must not change
    while the scorer is in use. ``nll=False``: top-1 counts only, the NLL NaN (``decode_scores``: what
    ``tune`` scores with ``metric="accuracy"``)."""

    def __init__(self, model: nn.Module, sim, *, batch_size: int, prefill: int, max_tokens: int | None,
                 placement: Placement | None, pack: int = 1, reuse_prefix: bool = True, nll: bool = True):
        self.model, self.sim, self.max_tokens = model, sim, max_tokens
        self.layers = find_moe_layers(model)
        self._top_k = {layer.index: layer.top_k for layer in self.layers}
        parallel = not is_offloaded(model)
        self.kw = dict(batch_size=batch_size, prefill=prefill, progress=False, placement=placement, pack=pack,
                       parallel=parallel, nll=nll)
        self.reuse_prefix = reuse_prefix and parallel
        self._recorded: list[tuple[torch.Tensor, PrefixRecord, DecodeScores]] = []  # per baseline's windows

    stops_early = True  # takes ``stop`` (``decode_scores``): a pass can end after any forward

    def __call__(self, plan: dict[int, RoutingConfig] | None, windows: torch.Tensor, stop=None) -> DecodeScores | None:
        """``plan`` on every layer (None: the model's own routing), scored on ``windows``; None when ``stop``
        ended the pass early."""
        if plan is None:
            if not self.reuse_prefix:
                return decode_scores(self.model, windows, stop=stop, **self.kw)
            record = PrefixRecord(self.model, *windows.shape)
            with record.record():
                s = decode_scores(self.model, windows, stop=stop, **self.kw)
            if s is not None:
                self._recorded.append((windows, record, s))
            return s
        # a layer that keeps every token's experts is scored off: the same routing without the op's work
        # (a third of a pass on the test-bed when three of four layers are untouched)
        plan = {i: OFF if is_exact(c, self._top_k[i]) else c for i, c in plan.items()}
        with reusing(self.model, self.layers):  # the routers as found when the scorer was made: not traced again
            transform(self.model, self.sim, plan=plan, max_tokens=self.max_tokens)
        try:
            # ``topk`` leaves fewer slots than prompt rows have: those plans decode step by step
            parallel = self.kw["parallel"] and all(getattr(c, "policy", None) != "topk" for c in plan.values())
            found = self._baseline(windows) if parallel else None
            if found is None:
                return decode_scores(self.model, windows, stop=stop, **{**self.kw, "parallel": parallel})
            record, base = found
            start = record.start_for(min((i for i, c in plan.items() if c is not OFF), default=None))
            with record.replay(start):
                s = decode_scores(self.model, windows, stop=stop, **self.kw)
            if s is not None:  # the skipped layers routed as the baseline did: its counts are theirs
                for i, position in record.moe_position.items():
                    if position < start:
                        for counts in ("distinct", "rank_distinct", "rank_slots", "slots"):
                            if getattr(s, counts) is not None:
                                getattr(s, counts)[i] = getattr(base, counts)[i]
            return s
        finally:
            restore(self.model)

    def _baseline(self, windows: torch.Tensor):
        """The recorded baseline pass of these windows (record, scores), or None."""
        for w, record, base in self._recorded:
            if w.shape == windows.shape and torch.equal(w, windows):
                return record, base
        return None


def _checked_budget(metric: str, max_loss, max_experts):
    """``tune``'s metric and budgets checked; returns ``max_loss`` (0.02 when neither budget is given)."""
    if metric not in METRICS:
        raise ArgumentValueError("metric", f"metric: expected one of {list(METRICS)}, got {metric!r}")
    if max_loss is not None and max_experts is not None:
        raise ArgumentValueError("max_experts", f"max_experts: give a quality budget (max_loss) or an expert budget (max_experts), not both; "
                         f"got max_loss={max_loss!r} and max_experts={max_experts!r}")
    if max_experts is not None:
        if not (isinstance(max_experts, (int, float)) and not isinstance(max_experts, bool)
                and math.isfinite(max_experts) and 0 < max_experts <= 1):
            raise ArgumentValueError("max_experts", f"max_experts: expected a fraction of the baseline's experts in (0, 1], got {max_experts!r}")
    elif max_loss is None:
        max_loss = 0.02
    if max_loss is not None and not (isinstance(max_loss, (int, float)) and math.isfinite(max_loss) and max_loss >= 0):
        raise ArgumentValueError("max_loss", f"max_loss: expected a finite number >= 0, got {max_loss!r}")
    return max_loss


def _candidate_jobs(layers, candidates, matrices, defaults) -> list[tuple[int, RoutingConfig]]:
    """``(layer, config)`` for every candidate on every layer (``defaults(layer)`` where ``candidates`` is
    None): tuples checked against the layer's top-k, quantile rhos resolved on its similarity matrix."""
    jobs = []
    for layer in layers:
        for candidate in candidates or defaults(layer):
            if isinstance(candidate, RoutingConfig):
                jobs.append((layer.index, candidate.for_layer(layer, matrices[layer.index])))
                continue
            policy, S, rho, *N = candidate
            if not 1 <= S <= layer.top_k:
                raise ArgumentValueError("candidates", f"candidates: S={S} is outside [1, {layer.top_k}] for layer {layer.index}")
            if isinstance(rho, Quantile):
                rho = rho.resolve(matrices[layer.index])
            jobs.append((layer.index, config(policy, S, rho, *N)))
    return jobs


class _Search:
    """What the steps of ``tune`` share: the scorer and its baseline, how a plan's experts are counted and
    its loss judged against the budget, every whole plan measured so far, and the pass counts."""

    def __init__(self, scorer, windows: torch.Tensor, base: DecodeScores, *, metric: str, max_loss: float | None,
                 max_experts: float | None, margin: float, placement: Placement | None, early_stop: bool, prune: bool,
                 bar):
        self.scorer, self.windows, self.base, self.metric = scorer, windows, base, metric
        self.max_loss, self.margin, self.placement, self.bar = max_loss, margin, placement, bar
        self.offloaded = base.cache is not None  # the cost is what the cache fetches, not what the batch reads
        self.stops = early_stop and max_experts is None and getattr(scorer, "stops_early", False)
        self.pruning = prune and max_experts is None and not self.offloaded
        self.base_distinct = self.mean_count(base)
        self.target = None if max_experts is None else max_experts * self.base_distinct  # mean distinct per layer
        # Every plan measured, by its place in the exhaustive order (the untouched model, the uniform plans, then
        # the search's rounds): the best is the first ``better`` one in that order whatever order they ran in, so
        # uniform plans run after the search (``prune``) still win the ties they win when run first.
        self.measured: list[tuple[int, tuple]] = []
        self.tried: dict[tuple, DecodeScores] = {}  # whole plans scored, by their sorted items
        self.passes = [0, 0, 0]  # run, stopped early, skipped

    def count(self, s: DecodeScores, index: int) -> float:
        """One layer's experts: all, the busiest rank's, or fetched."""
        if self.offloaded:
            return _fetches(s, index)
        return s.distinct[index] if self.placement is None else s.rank_distinct[index]

    def mean_count(self, s: DecodeScores) -> float:
        if self.offloaded:
            return sum(_fetches(s, layer.index) for layer in self.scorer.layers) / len(self.scorer.layers)
        return s.mean_distinct if self.placement is None else s.mean_rank_distinct

    def run(self, plan: dict[int, RoutingConfig], on: torch.Tensor | None = None,
            against: DecodeScores | None = None) -> DecodeScores | None:
        """``plan`` scored on ``on`` (default the windows); with ``against`` (the baseline on ``on``), None once
        out of budget."""
        on = self.windows if on is None else on
        self.passes[0] += 1
        if against is None or not self.stops:
            return self.scorer(plan, on)
        s = self.scorer(plan, on, stop=_out_of_budget(against, self.metric, self.max_loss))
        self.passes[1] += s is None
        return s

    def loss(self, s: DecodeScores) -> float:
        return _loss(self.base, s, self.metric)

    def bound(self, loss: float, s: DecodeScores) -> float:
        """The loss a plan is held to: its measured loss plus ``margin`` standard errors."""
        return loss + self.margin * _paired_se(self.base, s, self.base, self.metric) if self.margin else loss

    def better(self, loss: float, s: DecodeScores, than) -> bool:
        """Within the budget, and better than ``than`` (None: nothing yet) at the tuned goal."""
        if self.target is None:
            return self.bound(loss, s) <= self.max_loss and (than is None or self.mean_count(s) < self.mean_count(than[2]))
        return (self.mean_count(s) <= self.target + 1e-9
                and (than is None or (loss, self.mean_count(s)) < (than[1], self.mean_count(than[2]))))

    def keep(self, rank: int, plan, s: DecodeScores, loss: float | None = None) -> None:
        """Record a measured whole plan at ``rank`` (its place in the exhaustive order)."""
        self.measured.append((rank, (plan, self.loss(s) if loss is None else loss, s)))

    def best_so_far(self):
        """``(plan, loss, scores)`` of the best plan measured, or None."""
        found = None
        for _, entry in sorted(self.measured, key=lambda m: m[0]):
            if self.better(entry[1], entry[2], found):
                found = entry
        return found


@dataclass
class _Probed:
    """Step 1's findings: per layer the probes kept (the untouched setting first), the (layer, setting)
    pairs stopped early, and the experts each probed or skipped setting reads (at least)."""
    options: dict[int, list[Probe]]
    dropped: set
    reads: dict


def _probe_layers(search: _Search, jobs, untouched: dict[int, RoutingConfig], windows: torch.Tensor) -> _Probed:
    """Step 1: every candidate on one layer at a time, the other layers untouched, on ``windows`` (the
    probe windows) against a baseline of the same windows."""
    base = search.base if windows is search.windows else search.scorer(None, windows)
    options = {layer.index: [Probe(layer.index, untouched[layer.index], 0.0, search.count(base, layer.index))]
               for layer in search.scorer.layers}
    found = _Probed(options, set(), {})
    free = {layer.index: [] for layer in search.scorer.layers}  # ``_dominated``'s settings: probed at no loss
    for index, lp in jobs:
        search.bar.update(1)
        least = _dominated(lp, free[index]) if search.pruning else None
        if least is not None:
            found.reads[(index, lp)] = least
            search.passes[2] += 1
            continue
        s = search.run({**untouched, index: lp}, windows, against=base)
        if s is None:  # alone out of the whole budget
            found.dropped.add((index, lp))
            continue
        probe = Probe(index, lp, _loss(base, s, search.metric), search.count(s, index))
        options[index].append(probe)
        found.reads[(index, lp)] = probe.distinct
        if probe.loss <= 0 and _nested(lp) is not None:
            free[index].append((*_nested(lp), probe.distinct))
    return found


class _UniformPlans:
    """Step 4's plans, one candidate on every layer, each run once: all before the search, or with
    ``prune`` when the search picks one and after the search the rest that could still be chosen."""

    def __init__(self, search: _Search, plans: list[dict[int, RoutingConfig]], probed: _Probed):
        if search.target is not None:
            # A uniform plan whose probes already read more than the budget allows (summed over the
            # layers, with a margin for layers interacting) cannot fit it: not worth a pass.
            reads = {(p.layer, p.plan): p.distinct for ps in probed.options.values() for p in ps}
            layers = len(search.scorer.layers)
            fits = [plan for plan in plans if sum(reads[(i, lp)] for i, lp in plan.items()) <= 1.05 * search.target * layers]
            search.bar.total -= len(plans) - len(fits)
            plans = fits
        self.search, self.probed = search, probed
        self.count = len(plans)
        self.plans = {tuple(sorted(plan.items())): (rank, plan) for rank, plan in enumerate(plans)}
        self.done = set()  # keys run, or ruled out by a stopped probe

    def run(self, key) -> None:
        search = self.search
        rank, plan = self.plans[key]
        search.bar.update(1)
        self.done.add(key)
        # a layer's probe alone was out of the whole budget: the plan cannot be within it
        s = None if search.stops and any(item in self.probed.dropped for item in plan.items()) else search.run(
            plan, against=search.base)
        if s is not None:
            search.tried[key] = s
            search.keep(rank, plan, s)

    def run_all(self) -> None:
        for key in self.plans:
            self.run(key)

    def run_rest(self) -> None:
        """After the search (``prune``): the plans not run yet, but those whose probes already read more
        than ``UNIFORM_MARGIN`` times the best plan found (a uniform plan is kept only when it reads fewer)."""
        search = self.search
        for key, (_, plan) in self.plans.items():
            if key in self.done:
                continue
            least = sum(self.probed.reads[item] for item in plan.items() if item in self.probed.reads) / len(plan)
            best = search.best_so_far()
            if best is not None and least > UNIFORM_MARGIN * search.mean_count(best[2]):
                search.bar.update(1)  # reads more than the best plan found: cannot be chosen
                search.passes[2] += 1
                continue
            self.run(key)


def _search_budget(search: _Search, options: dict[int, list[Probe]], uniform: _UniformPlans, verify_rounds: int) -> int:
    """Steps 2 and 3: the knapsack's plan at an internal budget, measured whole, the budget moved toward the
    one whose whole plan just meets the real budget; ``verify_rounds`` at most. Returns the rounds run."""
    layers = len(search.scorer.layers)
    budget = search.max_loss if search.target is None else search.target * layers
    rounds = 0
    while rounds < verify_rounds:
        rounds += 1
        picks = _choose(options, budget) if search.target is None else _choose_within(options, budget)
        if picks is None:
            break
        plan = {i: p.plan for i, p in picks.items()}
        key = tuple(sorted(plan.items()))
        if key in uniform.plans and key not in uniform.done:  # pruning: scored as the uniform plans are
            uniform.run(key)
        if key in search.tried:
            break  # the search settled on a plan already measured
        s = search.tried[key] = search.run(plan)
        search.keep(uniform.count + rounds, plan, s)
        search.bar.update(1)
        if search.target is None:
            # secant step: the internal budget at which the whole plan would cost exactly max_loss
            held = search.bound(search.loss(s), s)
            scale = search.max_loss / held if held > 0 else 2.0
            budget = budget * min(max(scale, 0.5), 2.0) * (0.98 if held > search.max_loss else 1.0)
        else:
            # layers interact: scale the summed per-layer budget by how far the whole plan missed
            count = search.mean_count(s)
            budget = budget * min(search.target / count, 1.05) * (0.99 if count > search.target else 1.0)
    return rounds


def _best_plan(search: _Search, best_uniform, max_experts: float | None):
    """The plan ``tune`` returns, ``(plan, loss, scores)``: the best measured; for an expert budget the best
    uniform plan instead where the per-layer plan is not better by more than the text can tell apart."""
    best = search.best_so_far()
    if best is None:
        smallest = min(search.mean_count(s) for s in search.tried.values()) if search.tried else search.base_distinct
        raise ArgumentValueError("max_experts", f"max_experts: no plan of these candidates reads at most {max_experts:g} of the baseline's "
                         f"{search.base_distinct:.1f} experts per layer (the fewest measured: {smallest:.1f}); allow more "
                         f"experts or add candidates that read fewer, e.g. ('oea', 1, None)")
    if search.target is not None and best is not best_uniform and best_uniform is not None:
        # A per-layer plan must beat the best uniform plan by more than the tuning text can
        # tell apart (one standard error of the paired per-sequence difference): per-layer
        # gains below that have not carried over to held-out text (bench/RESULTS.md).
        if best_uniform[1] - best[1] <= _paired_se(search.base, best[2], best_uniform[2], search.metric):
            return best_uniform
    return best


def tune(model: nn.Module, sim, windows: torch.Tensor, *, max_loss: float | None = None,
         max_experts: float | None = None, metric: str = "nll", candidates=None, batch_size: int = 32,
         prefill: int = 4, max_tokens: int | None = None, verify_rounds: int = 8, progress: bool = True,
         placement: Placement | None = None, probe_sequences: int | None = None, scorer=None,
         pack: int = 1, early_stop: bool = True, margin: float = 0.0, prune: bool = True) -> TuneResult:
    """Per-layer (policy, S, rho) for ``model`` on tuning ``windows``; see the module doc.

    Two budgets, give one: ``max_loss`` (default 0.02 when neither is given): the fewest experts
    whose loss stays within it; ``max_experts`` (a fraction of the baseline's distinct experts
    per layer per decode step, in (0, 1]): the lowest loss whose measured distinct experts stay
    within it (a speed target: the dual knapsack ``_choose_within`` in step 2).
    ``candidates``: ``[(policy, S, rho), ...]``, ``(policy, S, rho, N)`` or ``RoutingConfig`` objects
    tried on every layer (default ``default_candidates``). The untouched setting is always a
    choice. ``verify_rounds``: whole-plan evaluations in the budget search (step 3).
    ``placement``: count the busiest expert-parallel rank's experts instead of all (what an EP
    layer waits for): ``max_experts`` is then a fraction of the baseline's busiest-rank count, and
    the default candidates add ``weight`` per-rank budgets on this placement.
    ``probe_sequences``: run the per-layer probes (step 1, most of the passes) on the first this
    many windows only, against a baseline of the same windows; uniform plans and whole-plan checks
    still run on all of them (None: probes on all).
    ``pack``: decode this many batches of ``batch_size`` per forward, each routed as its own
    (``evaluate.decode_scores``): the same scores in fewer forwards where ``batch_size`` is small.
    On an offloaded ``model`` (``sere_fx.offload``) the cost is experts *fetched* per token per layer
    (cache misses) instead of distinct experts, ``max_experts`` a fraction of exact LRU's fetches, and the
    default candidates the cache-aware rules (``offload_candidates``): the fewest fetches within the budget.
    ``margin`` (with ``max_loss``): a plan is within the budget when its loss plus ``margin`` standard errors of
    its paired per-sequence difference from the baseline is at most ``max_loss`` (0: its loss alone). The
    knapsack buys settings whose measured loss is noise in their favour; a margin of 1-2 asks the
    tuning text for evidence that the plan holds on other text.
    ``early_stop`` (with ``max_loss``): a per-layer probe or a uniform plan whose loss on the windows scored
    so far is out of the budget by more than ``STOP_Z`` standard errors is stopped after that forward and
    dropped (a probe that alone loses more than the whole budget is no use to the knapsack); whole-plan
    checks always run to the end. The choice is the exhaustive search's unless a candidate swings back by
    more than that; it saves the passes' rest only where ``windows`` span several forwards.
    ``prune`` (with ``max_loss``, not on an offloaded model): passes that cannot change the choice are not run.
    A probe is skipped where a setting of its family (``_nested``: the same policy reading a subset of its
    experts on the same input) was probed on that layer at no loss: the knapsack never needs the larger one.
    Uniform plans run after the whole-plan search, and one whose probes already read ``UNIFORM_MARGIN`` times
    the best plan's experts is skipped (a uniform plan is kept only when it reads fewer).
    ``scorer``: how a plan is scored (``ModelScorer`` on ``model`` by default; the vLLM engine's is
    ``sere_fx.vllm.evaluate.EngineScorer``, with ``model`` None): ``scorer(plan or None, windows)``
    gives ``DecodeScores``, ``scorer.layers`` the MoE layers.
    """
    max_loss = _checked_budget(metric, max_loss, max_experts)
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin) or margin < 0:
        raise ArgumentValueError("margin", f"margin: expected a number of standard errors >= 0, got {margin!r}")
    if margin and max_experts is not None:
        raise ArgumentValueError("margin", f"margin: applies to a quality budget (max_loss); got margin={margin!r} with "
                                           f"max_experts={max_experts!r}")
    n = int(windows.shape[0])
    if probe_sequences is not None and (isinstance(probe_sequences, bool) or not isinstance(probe_sequences, int)
                                        or not batch_size <= probe_sequences <= n):
        raise ArgumentValueError("probe_sequences", f"probe_sequences: expected an int in [{batch_size}, {n}] (at "
                                                    f"least one batch, at most the windows), got {probe_sequences!r}")
    sim = as_similarity(sim)
    if scorer is None:
        scorer = ModelScorer(model, sim, batch_size=batch_size, prefill=prefill, max_tokens=max_tokens,
                             placement=placement, pack=pack, nll=metric == "nll")  # accuracy reads top-1 only
    layers = scorer.layers
    check_layers(placement, layers)
    matrices = resolve(sim, layers)
    base = scorer(None, windows)
    offloaded = base.cache is not None
    jobs = _candidate_jobs(layers, candidates, matrices,
                           lambda layer: (offload_candidates(bool(sim.predictors)) if offloaded else default_candidates(
                               layer.top_k, placement=placement, predictors=bool(sim.predictors))))
    uniform = _uniform_plans(jobs, layers)
    bar = tqdm(total=len(jobs) + len(uniform) + verify_rounds, desc="tune", unit="pass", disable=not progress)
    search = _Search(scorer, windows, base, metric=metric, max_loss=max_loss, max_experts=max_experts, margin=margin,
                     placement=placement, early_stop=early_stop, prune=prune, bar=bar)
    untouched = {layer.index: SereConfig(S=layer.top_k, rho=0.0) for layer in layers}  # S = K: identity
    # step 1: every candidate on one layer at a time
    probed = _probe_layers(search, jobs, untouched, windows if probe_sequences in (None, n) else windows[:probe_sequences])
    search.keep(-1, untouched, base, loss=0.0)  # within any quality budget, never within an expert budget < 1
    # step 4 (uniform plans) first, or with ``prune`` as the search meets them and after it; steps 2 and 3
    plans = _UniformPlans(search, uniform, probed)
    if not search.pruning:
        plans.run_all()
    best_uniform = search.best_so_far()
    rounds = _search_budget(search, probed.options, plans, verify_rounds)
    plans.run_rest()
    bar.close()
    plan, loss, s = _best_plan(search, best_uniform, max_experts)
    return TuneResult(plan, loss, search.mean_count(s), search.base_distinct, metric, max_loss,
                      [p for ps in probed.options.values() for p in ps], rounds, max_experts, placement, offloaded,
                      *search.passes)


# --- plans that follow the load --------------------------------------------------------------

DEFAULT_BATCH_SIZES = (1, 8, 16, 32, 64, 128)
# A range of small batches scores this many sequences per forward (``pack``): batch 1 as 16 batches of 1.
# Small forwards: a 16-window forward of 101 tokens costs ~55% per token of a 128-window one on the
# 2-core CI machine (its logits stay in cache), and early stopping acts after every forward.
PACK_ROWS = 16


@dataclass(frozen=True)
class CostModel:
    """What one MoE layer call costs on the deployment's kernel: ``expert_us`` per distinct expert read,
    ``slot_us`` per token-slot computed, ``op_us`` for the re-routing op itself (what bench/vllm_step_profile.py
    measures). The default is the fit on the Qwen3-30B-A3B shape in vLLM's CPU kernel (bench/RESULTS.md,
    "Budgets at 30B": ~0.28 ms per expert, ~0.02 ms per token-slot; the merged op ~0.17 ms at batch 32)."""

    expert_us: float = 280.0
    slot_us: float = 20.0
    op_us: float = 170.0

    def __post_init__(self):
        for name in ("expert_us", "slot_us", "op_us"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ArgumentValueError("cost", f"cost: expected {name} a finite number >= 0 (microseconds), got {value!r}")

    def speedup(self, experts_before: float, experts_after: float, slots: float) -> float:
        """The layer call's predicted speed-up when re-routing reads ``experts_after`` instead of
        ``experts_before`` for ``slots`` token-slots (slot merging is left out: a lower bound)."""
        plain = self.expert_us * experts_before + self.slot_us * slots
        rerouted = self.expert_us * experts_after + self.slot_us * slots + self.op_us
        return plain / rerouted if rerouted > 0 else 1.0


@dataclass
class RangeResult:
    """One range of a tuned plan that follows the load: tuned at ``batch_size`` rows."""

    min_rows: int
    batch_size: int
    plan: dict[int, RoutingConfig] | None  # None: off (the model's own routing)
    why_off: str | None
    loss: float
    distinct: float
    baseline_distinct: float
    predicted_speedup: float
    tuned: TuneResult | None

    @classmethod
    def off(cls, min_rows: int, batch_size: int, why: str, baseline_distinct: float, tuned: TuneResult | None):
        """A range left to the model's own routing: no loss, the baseline's experts, no speed-up."""
        return cls(min_rows, batch_size, None, why, 0.0, baseline_distinct, baseline_distinct, 1.0, tuned)


@dataclass
class RangeTuneResult:
    ranges: list[RangeResult]
    metric: str
    max_loss: float | None
    max_experts: float | None
    cost: CostModel
    seconds: float = 0.0

    @property
    def plan(self) -> dict[int, RoutingConfig]:
        """``{layer: RowRanges}``: what ``save_plan`` writes and every front-end reads."""
        from sere_fx.config import OFF, RowRanges

        layers = sorted({i for r in self.ranges if r.plan for i in r.plan})
        return {i: RowRanges(tuple((r.min_rows, OFF if r.plan is None else r.plan[i]) for r in self.ranges))
                for i in layers}

    def summary(self) -> str:
        budget = (f"{self.metric} loss <= {self.max_loss}" if self.max_experts is None
                  else f"experts <= {self.max_experts:g} x baseline")
        lines = [f"tuned plan that follows the load ({budget} in every range; {self.seconds:.0f} s):",
                 f"  {'rows':>8}  {'batch':>5}  {'loss':>8}  {'experts/layer':>15}  {'predicted':>9}  settings"]
        for r in self.ranges:
            settings = (f"off ({r.why_off})" if r.plan is None else
                        "; ".join(f"{i}: {_describe(c)}" for i, c in sorted(r.plan.items())))
            rows = f">= {r.min_rows}"
            lines.append(f"  {rows:>8}  {r.batch_size:>5}  {r.loss:+8.4f}  {r.baseline_distinct:6.1f} -> "
                         f"{r.distinct:5.1f}  {'x%.2f' % r.predicted_speedup:>9}  {settings}")
        return "\n".join(lines)


def _describe(c: RoutingConfig) -> str:
    rho = "" if c.rho is None else f" rho={c.rho:.3f}"
    n = "" if c.N is None else f" N={c.N:g}"
    return f"{c.policy} S={c.S}{rho}{n}"


def tune_ranges(model: nn.Module, sim, windows: torch.Tensor, *, batch_sizes=DEFAULT_BATCH_SIZES,
                cost: CostModel | None = None, min_speedup: float = 1.0, progress: bool = True, **kwargs) -> RangeTuneResult:
    """A plan that follows the load: one range per batch size in ``batch_sizes`` (ascending; the range
    of ``b`` holds the steps of ``b`` rows up to the next size, the first starts at 1 row), each tuned
    by ``tune`` at its batch size within the same budget (``kwargs``: ``tune``'s). A range is ``off``
    where no plan meets the budget, where the tuned plan is the model's own routing, or where
    ``cost`` (``CostModel``) predicts a layer speed-up below ``min_speedup``. ``windows`` must hold at
    least the largest batch; each range scores the largest multiple of its batch size that fits."""
    import time

    sizes = list(batch_sizes)
    if not sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in sizes) or sizes != sorted(set(sizes)):
        raise ArgumentValueError("batch_sizes", f"batch_sizes: expected ascending distinct positive ints, got {batch_sizes!r}")
    n = int(windows.shape[0])
    if sizes[-1] > n:
        raise ArgumentValueError("batch_sizes", f"batch_sizes: the largest ({sizes[-1]}) is more than the {n} sequences "
                                                f"to tune on; give more sequences or smaller sizes")
    if not (isinstance(min_speedup, (int, float)) and not isinstance(min_speedup, bool) and math.isfinite(min_speedup)
            and min_speedup > 0):
        raise ArgumentValueError("min_speedup", f"min_speedup: expected a number > 0, got {min_speedup!r}")
    cost = cost or CostModel()
    if kwargs.get("scorer") is not None:
        raise ArgumentValueError("scorer", "scorer: plans that follow the load are tuned on a transformers model (each "
                                           "range decodes at its own batch size); got a scorer")
    k = max(layer.top_k for layer in find_moe_layers(model))
    start = time.perf_counter()
    out = []
    for i, b in enumerate(sizes):
        on = windows[: n - n % b]
        if progress:
            print(f"tune: range {i + 1}/{len(sizes)}: batch {b}, {on.shape[0]} sequences", flush=True)
        try:
            r = tune(model, sim, on, batch_size=b, progress=progress, pack=max(1, PACK_ROWS // b), **kwargs)
        except ArgumentValueError as exc:
            if exc.arg != "max_experts":
                raise
            out.append(RangeResult.off(1 if i == 0 else b, b, "no plan within the expert budget", math.nan, None))
            continue
        speedup = cost.speedup(r.baseline_distinct, r.distinct, b * k)
        why = None
        if all(c.S >= k and c.policy in ("sere", "oea") for c in r.plan.values()) or r.distinct >= r.baseline_distinct:
            why = "nothing to re-route within the budget"
        elif speedup < min_speedup:
            why = f"predicted x{speedup:.2f} < x{min_speedup:g}"
        out.append(RangeResult.off(1 if i == 0 else b, b, why, r.baseline_distinct, r) if why else
                   RangeResult(1 if i == 0 else b, b, r.plan, None, r.loss, r.distinct, r.baseline_distinct, speedup, r))
    tuned = next((r.tuned for r in out if r.tuned is not None), None)
    result = RangeTuneResult(out, kwargs.get("metric", "nll"), tuned.max_loss if tuned else kwargs.get("max_loss"),
                             kwargs.get("max_experts"), cost, time.perf_counter() - start)
    return result
