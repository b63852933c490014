"""Rewrite a matched routing site to call a routing policy (``sere_fx.policies``).

Index policies (``sere``, ``least_similar``, ``random``): one node is inserted after the
top-k and only the *dispatch* uses of the indices are redirected to it; uses that gather
routing weights from the scores (DeepSeek-V3) keep the router's own indices, so router
weights never change. Top-k policies (``topk``, ``oea``, ``weight``, ``output``): the top-k node itself is replaced
by a call with the same inputs and outputs, so the model's own weight computation runs on
the policy's selection. Per-layer data (similarity matrix or ``output``'s predictor, statistics, random generator)
is read through ``get_attr`` on the module that owns the graph, and so is an offloaded layer's resident
set (``free``: experts that cost nothing to read, ``sere_fx.expert_cache``).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from torch.fx import Graph, Node

from sere_fx.passes.matcher import RoutingMatchError, RoutingSite, _arg
from sere_fx.config import OffConfig, RoutingConfig, RowRanges
from sere_fx.policies import INDEX_POLICIES, REFILL_POLICIES, TOPK_POLICIES, remap_ids, select_topk


@dataclass(frozen=True)
class SiteAttrs:
    """Per-layer data the inserted code reads: the name of an attribute of the module that
    owns the graph (read with ``get_attr``), or a node already in the graph (e.g. an extra
    graph input); None: absent."""

    similarity: str | Node | None = None  # the layer's calibrated tensor: similarity matrix or output-size predictor
    stats: str | Node | None = None
    generator: str | Node | None = None
    predictor: str | Node | None = None  # ``output``'s predictor beside a similarity (a layer whose ranges read both)
    free: str | Node | None = None  # bool [E]: experts read anyway (an offload cache's resident set)


def _get_attrs(graph: Graph, after: Node, attrs: SiteAttrs) -> tuple[Node, dict]:
    nodes = {}
    for key in ("similarity", "stats", "generator", "predictor", "free"):
        source = getattr(attrs, key)
        if source is None:
            continue
        if isinstance(source, Node):
            nodes[key] = source
            continue
        with graph.inserting_after(after):
            after = nodes[key] = graph.get_attr(source)
    return after, nodes


def insert_policy(graph: Graph, site: RoutingSite, plan: RoutingConfig, max_tokens: int | None, attrs: SiteAttrs,
                  where: str = "graph") -> Node | None:
    """Rewrite ``site`` in ``graph`` for the layer's ``plan``; returns the node that now feeds the experts
    (None: ``plan`` is ``off`` in every range, and the site is left as it is)."""
    if isinstance(plan, RowRanges):
        return _insert_ranges(graph, site, plan, max_tokens, attrs, where)
    if isinstance(plan, OffConfig):
        return None
    if plan.policy in INDEX_POLICIES:
        return _insert_index_policy(graph, site, plan.policy, plan.S, plan.rho, max_tokens, attrs)
    if site.weight_uses and plan.policy in REFILL_POLICIES:
        raise RoutingMatchError(
            f"{where}: policy {plan.policy!r} needs routing weights computed from the top-k values, but this router "
            f"gathers them by index ({', '.join(u.name for u in site.weight_uses)})"
        )
    return _replace_topk(graph, site, plan, max_tokens, attrs)


def _insert_ranges(graph, site, plan: RowRanges, max_tokens, attrs, where) -> Node | None:
    """A layer whose settings follow the load: an index-policy node is inserted where some range runs an
    index policy, and the top-k node replaced where some range runs a top-k policy; each runs its own
    ranges' settings and routes the others as the model does (both read the same row count), so every
    call runs exactly one setting. The index node reads the top-k's outputs, so it reads the new top-k's
    once that replaces it. One node per layer counts the ranges taken."""
    topk = tuple((low, _topk_setting(c, site.num_experts) if c.policy in TOPK_POLICIES else None)
                 for low, c in plan.ranges)
    index = tuple((low, {"policy": c.policy, "S": c.S, "rho": c.rho} if c.policy in INDEX_POLICIES else None)
                  for low, c in plan.ranges)
    refill = sorted({s["policy"] for _, s in topk if s is not None and s["policy"] in REFILL_POLICIES})
    if site.weight_uses and refill:
        raise RoutingMatchError(
            f"{where}: policies {refill} need routing weights computed from the top-k values, but this router "
            f"gathers them by index ({', '.join(u.name for u in site.weight_uses)})"
        )
    out = None
    has_topk = any(s is not None for _, s in topk)
    if any(s is not None for _, s in index):
        out = _insert_index_policy(graph, site, None, None, None, max_tokens, attrs, ranges=index,
                                   count_ranges=not has_topk)
    if has_topk:
        new = _replace_topk(graph, site, None, max_tokens, attrs, ranges=topk)
        out = out if out is not None else new
    return out


def _topk_setting(plan: RoutingConfig, num_experts: int) -> dict:
    return {"policy": plan.policy, "S": plan.S, "rho": plan.rho, "N": plan.N, **_rank_budget(plan, num_experts)}


def _insert_index_policy(graph, site, policy, S, rho, max_tokens, attrs, ranges=None, count_ranges=True) -> Node:
    values = None
    if not site.sorted:
        # Rank order must come from the values the top-k selected on: read them.
        values = site.values
        if values is None:
            with graph.inserting_after(site.topk):
                values = graph.call_function(operator.getitem, (site.topk, 0))
            site.values = values
    anchor = site.indices
    if values is not None and _position(graph, values) > _position(graph, anchor):
        anchor = values
    last, nodes = _get_attrs(graph, anchor, attrs)
    with graph.inserting_after(last):
        new_ids = graph.call_function(
            remap_ids,
            (site.indices, values, nodes["similarity"]),
            {"policy": policy, "S": S, "rho": rho, "max_tokens": max_tokens,
             "stats": nodes.get("stats"), "generator": nodes.get("generator"),
             **({} if ranges is None else {"ranges": ranges, "count_ranges": count_ranges}),
             **({"free": nodes["free"]} if "free" in nodes else {})},
        )
    if "val" in site.indices.meta:
        new_ids.meta["val"] = site.indices.meta["val"]
    for user in site.dispatch_uses:
        user.replace_input_with(site.indices, new_ids)
    return new_ids


def _replace_topk(graph, site, plan, max_tokens, attrs, ranges=None) -> Node:
    """``plan``: the layer's one setting, or None with ``ranges`` (``((min_rows, setting or None), ...)``)."""
    topk = site.topk
    # The score that makes a slot weigh nothing downstream: 0 for probabilities, -inf for logits.
    neutral = float("-inf") if site.score_fn == "logits" else 0.0
    last, nodes = _get_attrs(graph, topk, attrs)
    if ranges is None:
        setting = _topk_setting(plan, site.num_experts)
        wants_predictor = plan.needs_predictor
    else:
        setting = {"ranges": ranges}
        wants_predictor = any(s is not None and s["policy"] == "output" for _, s in ranges)
    with graph.inserting_after(last):
        new = graph.call_function(
            select_topk,
            (site.scores, site.k, _arg(topk, 2, "dim", -1), _arg(topk, 3, "largest", True), _arg(topk, 4, "sorted", True)),
            {**setting, "neutral": neutral, "max_tokens": max_tokens, "stats": nodes.get("stats"),
             **({"predictor": nodes.get("predictor", nodes.get("similarity"))} if wants_predictor else {}),
             **({"free": nodes["free"]} if "free" in nodes else {})},
        )
    topk.replace_all_uses_with(new)
    graph.erase_node(topk)
    return new


def _rank_budget(plan: RoutingConfig, num_experts: int) -> dict:
    """``weight``'s per-rank budget as constants of the call: the budget and each expert's rank."""
    if getattr(plan, "rank_budget", None) is None:
        return {}
    return {"rank_budget": plan.rank_budget, "owners": tuple(plan.placement.owner(num_experts).tolist())}


def _position(graph: Graph, node: Node) -> int:
    for i, n in enumerate(graph.nodes):
        if n is node:
            return i
    raise ValueError(f"node {node.name} is not in the graph")
