"""Rewrite a matched routing site: re-route the indices on their way to the experts.

Only the *dispatch* uses of the top-k indices are redirected; uses that gather routing
weights from the scores (DeepSeek-V3) keep the router's own indices, so router weights
are never changed, as SERE prescribes. One node is inserted per site: a call to
``sere_fx.ops.reroute_topk`` (which calls ``torch.ops.sere.reroute``), reading the
similarity matrix through a ``get_attr`` on the module that owns the graph.
"""

from __future__ import annotations

import operator

from torch.fx import Graph, Node

from sere_fx.ops import reroute_topk
from sere_fx.passes.matcher import RoutingSite


def insert_reroute(
    graph: Graph,
    site: RoutingSite,
    similarity_attr: str,
    S: int,
    rho: float,
    max_tokens: int | None,
    stats_attr: str | None = None,
) -> Node:
    """Insert the re-routing call for ``site``; returns the new indices node."""
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
    with graph.inserting_after(anchor):
        sim = graph.get_attr(similarity_attr)
    with graph.inserting_after(sim):
        stats = graph.get_attr(stats_attr) if stats_attr else None
    with graph.inserting_after(stats if stats is not None else sim):
        new_ids = graph.call_function(
            reroute_topk,
            (site.indices, values, sim),
            {"S": S, "rho": rho, "max_tokens": max_tokens, "stats": stats},
        )
    if "val" in site.indices.meta:
        new_ids.meta["val"] = site.indices.meta["val"]
    for user in site.dispatch_uses:
        user.replace_input_with(site.indices, new_ids)
    return new_ids


def _position(graph: Graph, node: Node) -> int:
    for i, n in enumerate(graph.nodes):
        if n is node:
            return i
    raise ValueError(f"node {node.name} is not in the graph")
