"""The routing-site matcher.

A *routing site* is a top-k over the expert dimension whose indices reach expert dispatch:

    router matmul -> [softmax | sigmoid] -> [casts, bias add, masked_fill, ...] -> topk -> indices

Graphs come at different levels: ``torch.fx.symbolic_trace`` and Dynamo graphs spell ops
as ``torch.topk`` / ``Tensor.topk`` / ``F.softmax``..., ATen graphs as ``aten.topk.default``
/ ``aten._softmax.default``... Every node is first mapped to a canonical *kind* by one
table (``op_kind``), and the matcher reads kinds only, so one matcher serves all levels.

Shapes come from ``node.meta["val"]`` (a real or fake tensor), which torch.export, AOT
and ``sere_fx.passes.trace.annotate_shapes`` provide.
"""

from __future__ import annotations

import builtins
import operator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.fx import Graph, Node

aten = torch.ops.aten

# canonical kind -> spellings (call_function targets, ATen overload packets, Tensor method names)
_SPELLINGS: dict[str, tuple] = {
    "topk": (torch.topk, aten.topk, "topk"),
    "softmax": (F.softmax, torch.softmax, aten.softmax, aten._softmax, aten._safe_softmax, "softmax"),
    "sigmoid": (torch.sigmoid, F.sigmoid, aten.sigmoid, "sigmoid"),
    "linear": (
        F.linear,
        torch._C._nn.linear,
        aten.linear,
        aten.mm,
        aten.addmm,
        aten.matmul,
        torch.matmul,
        operator.matmul,
        "matmul",
    ),
    "getitem": (operator.getitem,),
    "getattr": (builtins.getattr,),
    "gather": (torch.gather, aten.gather, "gather"),
    "index": (aten.index, aten.index_select, torch.index_select, "index_select"),
    # Ops a score may pass through between the score function and the top-k.
    "passthrough": (
        "to", "float", "type", "type_as", "contiguous", "view", "reshape", "clone", "detach",
        aten._to_copy, aten.to, aten.clone, aten.view, aten.reshape, aten._unsafe_view, aten.alias,
        aten.detach, torch.ops.prims.convert_element_type,
        operator.add, torch.add, aten.add, "add",
        operator.mul, torch.mul, aten.mul, "mul",
        operator.truediv, torch.div, aten.div, "div",
        torch.masked_fill, aten.masked_fill, "masked_fill",
        torch.where, aten.where,
    ),
}
_KIND_OF: dict = {}
for _kind, _spellings in _SPELLINGS.items():
    for _s in _spellings:
        _KIND_OF[_s] = _kind


def op_kind(node: Node) -> str | None:
    """Canonical kind of a node (``"topk"``, ``"softmax"``, ...) or None."""
    if node.op == "call_method":
        return _KIND_OF.get(node.target)
    if node.op != "call_function":
        return None
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        target = target.overloadpacket
    try:
        return _KIND_OF.get(target)
    except TypeError:  # unhashable target
        return None


def node_shape(node) -> tuple[int, ...] | None:
    """Static shape of a node's tensor value, if known (``meta["val"]``: ATen/annotated graphs,
    ``meta["example_value"]``: Dynamo graphs, ``meta["tensor_meta"]``: ShapeProp)."""
    if not isinstance(node, Node):
        return None
    val = node.meta.get("val", node.meta.get("example_value", node.meta.get("tensor_meta")))
    shape = getattr(val, "shape", None)
    if shape is None:
        return None
    # Symbolic sizes are -1: int() of a SymInt would specialise it, and the compiled graph would then
    # be recompiled for every batch size.
    return tuple(int(s) if isinstance(s, int) else -1 for s in shape)


class RoutingMatchError(ValueError):
    """A module has no recognisable routing site, or one the matcher only half recognises."""


@dataclass
class RoutingSite:
    """One top-k routing decision in a graph, as the rewrite needs it."""

    topk: Node
    scores: Node  # the tensor the top-k selected on
    score_fn: str  # "softmax" | "sigmoid" | "logits": how the scores came from the router matmul
    k: int
    num_experts: int
    sorted: bool  # False: slot order is not rank order (``topk(..., sorted=False)``)
    indices: Node  # the indices output of the top-k
    values: Node | None  # the values output, if the graph reads it
    dispatch_uses: list[Node] = field(default_factory=list)  # index uses on the way to the experts
    weight_uses: list[Node] = field(default_factory=list)  # index uses that gather routing weights


def _arg(node: Node, pos: int, name: str, default):
    if len(node.args) > pos:
        return node.args[pos]
    return node.kwargs.get(name, default)


def _tuple_item(topk: Node, which: int) -> Node | None:
    """The node reading output ``which`` (0 = values, 1 = indices) of a top-k."""
    names = ("values", "indices")
    for user in topk.users:
        kind = op_kind(user)
        if kind == "getitem" and user.args[1] == which:
            return user
        if kind == "getattr" and user.args[1] == names[which]:
            return user
    return None


def _score_source(scores: Node, max_steps: int = 16) -> tuple[str, Node] | None:
    """Walk back from the top-k input through pass-through ops to the score function."""
    node = scores
    for _ in range(max_steps):
        if not isinstance(node, Node):
            return None
        kind = op_kind(node)
        if kind in ("softmax", "sigmoid"):
            return kind, node
        if kind == "linear":
            return "logits", node
        if kind != "passthrough":
            return None
        # Follow the first tensor-valued input (for where(): the value taken when true).
        inputs = [a for a in node.args if isinstance(a, Node)]
        if node.target in (torch.where, aten.where.self) and len(inputs) >= 2:
            inputs = inputs[1:]
        if not inputs:
            return None
        node = inputs[0]
    return None


def _ancestors(node: Node, limit: int = 64) -> set[Node]:
    seen, stack = set(), [node]
    while stack and len(seen) < limit:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(a for a in n.all_input_nodes)
    return seen


def _is_weight_use(user: Node, score_nodes: set[Node]) -> bool:
    """True when ``user`` gathers routing weights from the router scores (by the top-k indices)."""
    kind = op_kind(user)
    if kind == "gather":
        source = user.args[0] if user.args else user.kwargs.get("input")
        return isinstance(source, Node) and bool(_ancestors(source) & score_nodes)
    return False


def describe_topks(graph: Graph) -> list[str]:
    """A short description of every top-k in a graph, for error messages."""
    out = []
    for node in graph.nodes:
        if op_kind(node) == "topk":
            src = node.args[0] if node.args else None
            out.append(f"{node.name}(k={_arg(node, 1, 'k', '?')}, input shape {node_shape(src)})")
    return out


def find_routing_sites(graph: Graph, num_experts: int, where: str = "graph") -> list[RoutingSite]:
    """Every routing site over ``num_experts`` experts in ``graph``.

    A top-k over another dimension (e.g. DeepSeek's group top-k) or whose indices are
    never read is not a site. A top-k over the expert dimension that breaks an assumption
    the rewrite relies on raises ``RoutingMatchError`` naming ``where`` and what was seen.
    """
    sites = []
    for node in graph.nodes:
        if op_kind(node) != "topk":
            continue
        scores = node.args[0] if node.args else node.kwargs.get("input")
        shape = node_shape(scores)
        if shape is None:
            raise RoutingMatchError(
                f"{where}: top-k node {node.name!r} has no shape information; annotate the graph "
                "(sere_fx.passes.trace.annotate_shapes) or use an exported/AOT graph"
            )
        dim = _arg(node, 2, "dim", -1)
        if not shape or shape[-1] != num_experts or dim not in (-1, len(shape) - 1):
            continue  # not over the expert dimension
        indices = _tuple_item(node, 1)
        if indices is None:
            continue  # values-only top-k (e.g. group scoring): routes nothing
        k = _arg(node, 1, "k", None)
        seen = f"top-k {node.name!r} over {num_experts} experts (k={k}, input shape {shape})"
        if not isinstance(k, int) or not 1 <= k <= num_experts:
            raise RoutingMatchError(f"{where}: {seen}: k is not a constant in [1, {num_experts}]")
        if _arg(node, 3, "largest", True) is not True:
            raise RoutingMatchError(f"{where}: {seen}: largest=False is not a routing decision the rewrite knows")
        source = _score_source(scores)
        if source is None:
            raise RoutingMatchError(
                f"{where}: {seen}: its input does not come from softmax, sigmoid or a router matmul "
                f"through casts/bias/masking (input is {scores.name!r} = {scores.format_node()})"
            )
        score_fn, score_node = source
        score_nodes = _ancestors(score_node, limit=8) | {score_node, scores}
        site = RoutingSite(
            topk=node,
            scores=scores,
            score_fn=score_fn,
            k=k,
            num_experts=num_experts,
            sorted=bool(_arg(node, 4, "sorted", True)),
            indices=indices,
            values=_tuple_item(node, 0),
        )
        for user in indices.users:
            if _is_weight_use(user, score_nodes):
                site.weight_uses.append(user)
            else:
                site.dispatch_uses.append(user)
        if not site.dispatch_uses:
            raise RoutingMatchError(f"{where}: {seen}: its indices are only used to gather weights, never dispatched")
        sites.append(site)
    return sites


def match_router(graph: Graph, num_experts: int, where: str) -> RoutingSite | None:
    """The single routing site of a router module's graph, None if it has none."""
    sites = find_routing_sites(graph, num_experts, where)
    if len(sites) > 1:
        names = ", ".join(s.topk.name for s in sites)
        raise RoutingMatchError(f"{where}: found {len(sites)} routing top-ks ({names}); expected one per router")
    return sites[0] if sites else None
