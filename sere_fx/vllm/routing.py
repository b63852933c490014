"""One MoE layer's routing step inside vLLM: the engine's router output in, the policy's out.

vLLM routes every MoE family through ``BaseRouter._compute_routing`` (logical expert ids,
before EPLB's logical-to-physical map). ``install`` swaps a router's class for a subclass
whose ``_compute_routing`` calls the original and hands ``(weights, ids)`` to a
``LayerRouting``, which applies the layer's policy with the project's own op and rules:

- index policies (``sere``, ``least_similar``, ``random``) re-route ids with
  ``torch.ops.sere.reroute`` / ``policies.ablation_reroute``; weights stay the router's.
  vLLM's top-k is unsorted, so slots are ranked by the router's *selection* score: the
  returned weight where it is monotone in it, the biased score for biased routers.
- top-k policies (``oea``, ``topk``, ``weight``, ``output``) choose slots with ``policies.oea_select`` /
  ``policies.keep_top_s`` / ``policies.weight_select`` over the router's selection scores
  (``weight`` and ``output`` take their shares, and ``output`` its predictor's inputs, from the
  router's probabilities); the weights then come from
  the router's own probabilities for the chosen experts (0 for unfilled slots), normalised
  and scaled as that router does.

Rows that are not re-routed this step (``sere_fx.vllm.engine``: prompt rows, opted-out
requests, padding) keep the router's output; the experts of the real ones among them are read
anyway, so they are free for the re-routed rows (extra primaries for SERE, members of the
loaded set outside ``N`` for OEA / ``weight``). Ids outside ``[0, E)`` (padding written as -1)
are never gathered unclamped. Every step is tensor ops or opaque custom ops, so it traces
into vLLM's compiled graph without freezing a data-dependent decision.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sere_fx.kernels import reroute_cpu
from sere_fx.config import RoutingConfig
from sere_fx.policies import (INDEX_POLICIES, ablation_reroute, cond_chain, keep_top_s, oea_select, reroute_agreed,
                              weight_select)


@dataclass(frozen=True)
class RouterScores:
    """How one vLLM router scores experts: enough to rank slots and to recompute its weights."""

    router: str  # class name, for messages
    scoring_func: str | None  # "softmax" / "sigmoid"; None: not reproducible (custom routing)
    renormalize: bool
    bias: torch.Tensor | None  # e_score_correction_bias: steers selection, not weights
    groups: tuple[int, int] | None  # (num_expert_group, topk_group) for grouped top-k
    scale: float  # routed_scaling_factor the router applies to its weights
    unsupported: str | None = None  # why top-k policies cannot reproduce this router

    @classmethod
    def of(cls, router) -> "RouterScores":
        name = getattr(type(router), "_sere_base", type(router)).__name__
        scoring = getattr(router, "scoring_func", "softmax")
        renorm = bool(getattr(router, "renormalize", True))
        bias = getattr(router, "e_score_correction_bias", None)
        grouped = name == "GroupedTopKRouter" or bool(getattr(router, "use_grouped_topk", False))
        groups = (router.num_expert_group, router.topk_group) if grouped else None
        scale = float(getattr(router, "routed_scaling_factor", 1.0))
        why = None
        if getattr(router, "custom_routing_function", None) is not None:
            why = "it uses a model-specific custom routing function"
        elif getattr(router, "_hash_indices_table", None) is not None or scoring not in ("softmax", "sigmoid"):
            why = f"its scoring function {scoring!r} is not softmax or sigmoid"
        elif getattr(router, "num_fused_shared_experts", 0):
            why = "it fuses shared experts into the routed slots"
        if name == "CPURouter" and not grouped:
            bias, scale = None, 1.0  # vLLM's CPU softmax top-k ignores both
        elif name in ("FusedTopKRouter", "CustomRoutingRouter"):
            bias, scale = None, 1.0
        if why is None and name not in ("CPURouter", "FusedTopKRouter", "FusedTopKBiasRouter", "GroupedTopKRouter"):
            why = f"sere-fx does not know how {name} computes its weights"
        return cls(name, None if why else scoring, renorm, bias, groups, scale, why)

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        return logits.softmax(dim=-1) if self.scoring_func == "softmax" else logits.sigmoid()

    def selection(self, logits: torch.Tensor, probs: torch.Tensor | None = None) -> torch.Tensor:
        """``[T, E]`` scores the router takes its top-k over (-inf outside the chosen groups).
        ``probs``: ``probabilities(logits)`` when the caller has it already."""
        scores = self.probabilities(logits) if probs is None else probs
        if self.bias is not None:
            scores = scores + self.bias.float().unsqueeze(0)
        if self.groups is None:
            return scores
        n_group, top_group = self.groups
        grouped = scores.view(scores.shape[0], n_group, -1)
        group_score = grouped.topk(2, dim=-1).values.sum(-1) if self.bias is not None else grouped.amax(-1)
        chosen = torch.zeros_like(group_score, dtype=torch.bool)
        chosen = chosen.scatter(1, group_score.topk(top_group, dim=-1).indices, True)
        return scores.masked_fill(~chosen.repeat_interleave(grouped.shape[-1], dim=1), float("-inf"))

    def weights(self, logits: torch.Tensor, ids: torch.Tensor, filled: torch.Tensor,
                probs: torch.Tensor | None = None) -> torch.Tensor:
        """The router's weights for the experts ``ids [T, K]``; unfilled slots get 0. ``probs`` as
        for ``selection``."""
        probs = self.probabilities(logits) if probs is None else probs
        w = probs.gather(1, ids.long()).masked_fill(~filled, 0.0)
        if self.renormalize:
            w = w / w.sum(dim=-1, keepdim=True)
        return w * self.scale if self.scale != 1.0 else w


def predictor_refusal(plan: RoutingConfig, scores: RouterScores) -> str | None:
    """Why ``plan`` (``output``) cannot run on this router, or None. Its predictor was fitted on the
    log-probabilities a plain top-k router ranks by (calibration reads them at the routing site of
    the transformers model); a biased or group-limited router ranks by something else."""
    if not plan.needs_predictor or (scores.bias is None and scores.groups is None):
        return None
    return (f"{plan.policy!r} predicts output sizes from the probabilities of a plain top-k router, but "
            f"{scores.router} selects by {'a biased score' if scores.bias is not None else 'expert groups'}; "
            "use policy 'weight'")


class LayerRouting:
    """The policy of one MoE layer, applied to its router's output (see module doc)."""

    def __init__(self, layer: int, plan: RoutingConfig, scores: RouterScores, similarity: torch.Tensor | None,
                 num_experts: int, stats: bool, reduce=None, native_rows: bool = False):
        """``similarity``: the layer's calibrated tensor (``sere_fx.similarity.layer_tensors``): its
        similarity matrix, or ``output``'s predictor. ``reduce``: a sum all-reduce over the data-parallel group (``dp_loaded_set``): the ranks
        agree on one primary / loaded set per layer call (``sere_fx.policies``). ``native_rows``: the
        engine's row buffers are bound to the native CPU ops (``engine.ENGINE.native``, known once the
        buffers are allocated), so those ops are called."""
        self.layer = layer
        self.reduce = reduce
        self.native_rows = native_rows
        # weight's per-rank budget (expert parallelism): each expert's rank
        self.owner = None if getattr(plan, "rank_budget", None) is None else plan.placement.owner(num_experts)
        self.num_experts = num_experts
        self.plan = plan
        self.scores = scores
        self.similarity = similarity
        self.stats = stats
        self.rank_by_weight = scores.bias is None  # weights are monotone in the selection score
        # SERE on the CPU: the native op's tables (float32 similarity, sorted candidates)
        self.native = None
        # (``fits`` loads the C kernel here, eagerly: the call below is traced by Dynamo)
        if (plan.policy == "sere" and similarity is not None and similarity.device.type == "cpu"
                and reroute_cpu.fits(num_experts, 1)):
            self.native = reroute_cpu.candidates(similarity)

    def __call__(self, router_logits: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
        plan = self.plan
        if plan.S >= ids.shape[1]:  # S = K: the model's own routing, only counted (installed with stats)
            if not self.stats:
                return weights, ids
            rows, _ = self._engine_rows(ids)
            return weights, torch.ops.sere.record_routing(ids, ids, weights, rows, self.layer, plan.S, self.num_experts)
        if self.rank_by_weight:
            rank = weights
        else:  # padding rows may hold id -1: gather within range (those rows are never re-routed)
            rank = self.scores.selection(router_logits).gather(1, ids.long().clamp(0, self.num_experts - 1))
        new_weights = weights
        if plan.policy == "sere" and self.reduce is not None:  # agreed across data-parallel ranks
            rows, free = self._engine_rows(ids)
            new_ids = reroute_agreed(ids, self.similarity, plan.S, plan.rho, self.reduce, rank, rows, free)
        elif plan.policy == "sere":
            # The hot path: one opaque op, which looks this step's rows up itself; on the CPU a
            # native one, called from vLLM's compiled graph without a Python frame.
            if self.native is not None and self.native_rows and reroute_cpu.fits(self.num_experts, ids.shape[1]):
                new_ids = torch.ops.sere_native.engine_reroute(ids, *self.native, plan.S, plan.rho, rank)
            else:
                new_ids = torch.ops.sere.engine_reroute(ids, self.similarity, plan.S, plan.rho, rank)
            if not self.stats:
                return weights, new_ids
            rows, _ = self._engine_rows(ids)
        else:
            # free: experts the kept rows read anyway (``topk`` keeps each token's own top-S, uses none)
            rows, free = self._engine_rows(ids)
            if plan.policy in INDEX_POLICIES:  # the ablations
                new_ids = ablation_reroute(ids, self.similarity, plan.S, plan.rho, plan.policy,
                                           rank_values=rank, valid_rows=rows, free=free)
            else:
                new_weights, new_ids = self._topk_policy(router_logits, weights, ids, rows, free)
        if self.stats:
            new_ids = torch.ops.sere.record_routing(ids, new_ids, rank, rows, self.layer, plan.S, self.num_experts)
        return new_weights, new_ids

    def _engine_rows(self, ids):
        # the native op in a CPU engine (vLLM's graph calls it without a Python frame), else the Python one
        if self.native_rows:
            return torch.ops.sere_native.engine_rows(ids, self.num_experts)
        return torch.ops.sere.engine_rows(ids, self.num_experts)

    def _topk_policy(self, router_logits, weights, ids, rows, free):
        """``oea`` / ``weight`` / ``topk`` over the router's selection scores, with the router's own
        weights recomputed for the chosen experts (re-routed rows only)."""
        plan = self.plan
        neutral = float("-inf")
        probs = self.scores.probabilities(router_logits)  # once: selection, shares and weights read it
        selection = self.scores.selection(router_logits, probs)
        if plan.policy in ("weight", "output"):
            owner = None if self.owner is None else self.owner.to(selection.device)
            values, chosen, _ = weight_select(selection, ids.shape[1], plan.S, neutral, rho=plan.rho, N=plan.N,
                                              probs=probs, valid_rows=rows, free=free, rank_budget=plan.rank_budget,
                                              owner=owner, reduce=self.reduce,
                                              predictor=self.similarity if plan.needs_predictor else None)
        elif plan.policy == "oea":
            values, chosen, _ = oea_select(selection, ids.shape[1], plan.S, neutral, rows, free, reduce=self.reduce)
        else:  # topk: each token's own top-S, nothing else
            values, chosen, _ = keep_top_s(selection, ids.shape[1], plan.S, neutral, rows)
        keep = rows.unsqueeze(1)
        recomputed = self.scores.weights(router_logits, chosen, values != neutral, probs).to(weights.dtype)
        return torch.where(keep, recomputed, weights), torch.where(keep, chosen.to(ids.dtype), ids)


class RangeRouting:
    """A layer whose settings follow the load (``RowRanges``): one ``LayerRouting`` per range (None:
    ``off``, the router's output as it is). vLLM's graph is traced once and the re-routed row count
    is not one of its shapes, so the choice is a ``torch.cond`` chain in the graph: every range's
    routing is compiled with the rest of the layer, and each step runs only its own range's, chosen
    by ``torch.ops.sere.engine_range`` (the range this step's re-routed row count falls in, decided
    once per step on the host, ``sere_fx.vllm.engine``).

    A call of fewer token rows than the second range's bound is in the first range whatever the
    step's mix: the re-routed rows are some of its rows (the row masks are the call's rows). That
    test is on the call's size, a symbolic one in the graph, which Inductor's wrapper evaluates as
    a Python comparison: the small steps, where a plan is most often ``off``, skip the range op and
    the chain (an off step costs one branch call and two small copies)."""

    def __init__(self, layer: int, bounds: tuple[int, ...], routings: tuple):
        self.layer, self.bounds, self.routings = layer, bounds, routings
        branches = [self._branch(routing) for routing in routings]
        # built once: the range index is an operand, so each call only evaluates the chain
        chain = cond_chain(branches, lambda i, index, *_: index <= i)
        self._first = lambda *operands: branches[0](None, *operands)
        self._by_index = lambda *operands: chain(torch.ops.sere.engine_range(operands[-1]), *operands)

    @staticmethod
    def _branch(routing):
        def run(_index, router_logits, weights, ids):  # the chain's operands: the index picks the branch
            if routing is None:  # off: the router's output (cond's outputs may not alias its operands)
                return weights.clone(), ids.clone()
            new_weights, new_ids = routing(router_logits, weights, ids)
            return new_weights.clone(), new_ids.clone()

        return run

    def __call__(self, router_logits: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
        operands = (router_logits, weights, ids)
        if len(self.bounds) == 1:
            return self._by_index(*operands)
        first = ids.shape[0] < self.bounds[1]
        if not torch.compiler.is_compiling():  # eager: a plain branch (no cond, no copies for off)
            if not first:
                return self._by_index(*operands)
            return (weights, ids) if self.routings[0] is None else self.routings[0](*operands)
        return torch.cond(first, self._first, self._by_index, operands)


_SUBCLASSES: dict[type, type] = {}


def _routing_subclass(cls: type) -> type:
    if cls not in _SUBCLASSES:

        def _compute_routing(self, hidden_states, router_logits, indices_type, *, input_ids=None):
            weights, ids = cls._compute_routing(self, hidden_states, router_logits, indices_type, input_ids=input_ids)
            return self.sere_routing(router_logits, weights, ids)

        _SUBCLASSES[cls] = type(f"Sere{cls.__name__}", (cls,), {"_compute_routing": _compute_routing,
                                                                 "_sere_base": cls, "__module__": __name__})
    return _SUBCLASSES[cls]


def uninstall(router) -> None:
    """Give ``router`` back its own class (no-op for a router never installed)."""
    base = getattr(type(router), "_sere_base", None)
    if base is not None:
        router.__class__ = base
        del router.sere_routing


def install(router, routing: LayerRouting) -> None:
    """Make ``router`` apply ``routing`` after its own routing (idempotent per router)."""
    base = getattr(type(router), "_sere_base", type(router))
    router.sere_routing = routing
    router.__class__ = _routing_subclass(base)
