"""Rewrite a matched routing site to call a routing policy (``sere_fx.policies``).

Index policies (``sere``, ``least_similar``, ``random``): one node is inserted after the
top-k and only the *dispatch* uses of the indices are redirected to it; uses that gather
routing weights from the scores (DeepSeek-V3) keep the router's own indices, so router
weights never change. Top-k policies (``topk``, ``oea``, ``weight``, ``output``): the top-k node itself is replaced
by a call with the same inputs and outputs, so the model's own weight computation runs on
the policy's selection. Per-layer data (similarity matrix or ``output``'s predictor, statistics, random generator)
is read through ``get_attr`` on the module that owns the graph.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from torch.fx import Graph, Node

from sere_fx.passes.matcher import RoutingMatchError, RoutingSite, _arg
from sere_fx.config import RoutingConfig
from sere_fx.policies import INDEX_POLICIES, REFILL_POLICIES, remap_ids, select_topk


@dataclass(frozen=True)
class SiteAttrs:
    """Per-layer data the inserted code reads: the name of an attribute of the module that
    owns the graph (read with ``get_attr``), or a node already in the graph (e.g. an extra
    graph input); None: absent."""

    similarity: str | Node | None = None  # the layer's calibrated tensor: similarity matrix or output-size predictor
    stats: str | Node | None = None
    generator: str | Node | None = None


def _get_attrs(graph: Graph, after: Node, attrs: SiteAttrs) -> tuple[Node, dict]:
    nodes = {}
    for key in ("similarity", "stats", "generator"):
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
                  where: str = "graph") -> Node:
    """Rewrite ``site`` in ``graph`` for the layer's ``plan``; returns the node that now feeds the experts."""
    if plan.policy in INDEX_POLICIES:
        return _insert_index_policy(graph, site, plan.policy, plan.S, plan.rho, max_tokens, attrs)
    if site.weight_uses and plan.policy in REFILL_POLICIES:
        raise RoutingMatchError(
            f"{where}: policy {plan.policy!r} needs routing weights computed from the top-k values, but this router "
            f"gathers them by index ({', '.join(u.name for u in site.weight_uses)})"
        )
    return _replace_topk(graph, site, plan, max_tokens, attrs)


def _insert_index_policy(graph, site, policy, S, rho, max_tokens, attrs) -> Node:
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
             "stats": nodes.get("stats"), "generator": nodes.get("generator")},
        )
    if "val" in site.indices.meta:
        new_ids.meta["val"] = site.indices.meta["val"]
    for user in site.dispatch_uses:
        user.replace_input_with(site.indices, new_ids)
    return new_ids


def _replace_topk(graph, site, plan, max_tokens, attrs) -> Node:
    topk = site.topk
    # The score that makes a slot weigh nothing downstream: 0 for probabilities, -inf for logits.
    neutral = float("-inf") if site.score_fn == "logits" else 0.0
    last, nodes = _get_attrs(graph, topk, attrs)
    with graph.inserting_after(last):
        new = graph.call_function(
            select_topk,
            (site.scores, site.k, _arg(topk, 2, "dim", -1), _arg(topk, 3, "largest", True), _arg(topk, 4, "sorted", True)),
            {"policy": plan.policy, "S": plan.S, "neutral": neutral, "rho": plan.rho, "N": plan.N,
             **_rank_budget(plan, site.num_experts), "max_tokens": max_tokens, "stats": nodes.get("stats"),
             **({"predictor": nodes["similarity"]} if plan.needs_predictor else {})},
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
