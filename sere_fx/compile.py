"""torch.compile integration.

- ``sere_fx.backend(sim, S=2, rho=0.5, ...)``: a backend for an *untransformed* model. It runs
  the same matcher and rewrite on each Dynamo graph it receives (routing sites are mapped
  to decoder layers through ``nn_module_stack``), bakes the similarity matrices into the
  graph module as buffers, then hands the graph to Inductor.
- ``"sere"``: a named backend (registered on import, and through the
  ``torch_dynamo_backends`` entry point) for a model already passed through
  ``sere_fx.transform``: the re-routing op is already in its graph; it checks that and
  hands over to Inductor.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass

import torch
from torch import fx

from sere_fx.passes.matcher import RoutingMatchError, find_routing_sites, node_shape, op_kind
from sere_fx.passes.rewrite import SiteAttrs, insert_policy
from sere_fx.plan import build_plan, plan_settings
from sere_fx.policies import INDEX_POLICIES
from sere_fx.similarity import as_similarity
from sere_fx.transform import DEFAULT_MAX_TOKENS

_LAYER = re.compile(r"layers[\.\[]\'?(\d+)")


@dataclass(frozen=True)
class _GraphLayer:  # what ``build_plan`` needs to know about a layer seen in a graph
    index: int
    name: str
    num_experts: int
    top_k: int


def _layer_of(node: fx.Node) -> tuple[int, str] | None:
    stack = node.meta.get("nn_module_stack") or {}
    for path, _ in reversed(list(stack.values())):
        m = _LAYER.search(str(path))
        if m:
            return int(m.group(1)), str(path)
    return None


def _inductor(gm, example_inputs):
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs)


class SereBackend:
    """``torch.compile(model, backend=SereBackend(sim, ...))``; see ``sere_fx.backend``."""

    def __init__(self, sim, S=2, rho=None, *, policy="sere", N=None, max_tokens=DEFAULT_MAX_TOKENS, plan=None,
                 inner=_inductor):
        self.sim = as_similarity(sim) if sim is not None else None
        if plan is not None:
            policy, S, rho, N = plan_settings(plan, policy, S, rho, N)
        self.policy, self.S, self.rho, self.N, self.max_tokens = policy, S, rho, N, max_tokens
        self.inner = inner
        self.sites_rewritten = 0
        self.layers_seen: set[int] = set()

    def rewrite(self, gm: fx.GraphModule) -> int:
        """Rewrite every routing site of ``gm`` in place; returns how many.

        The similarity matrices become buffers of ``gm``. AOT lifts a Dynamo graph's buffers
        by the source Dynamo recorded for each, so each new buffer is given a constant source.
        """
        sizes = sorted({int(m.shape[0]) for m in self.sim.values()}) if self.sim is not None else None
        if sizes is None:
            # Policies without similarity: the expert dimension is the widest top-k input in
            # the graph (group top-ks, as in DeepSeek, run over fewer entries).
            widths = {_n_experts(n) for n in gm.graph.nodes if op_kind(n) == "topk"} - {None}
            sizes = [max(widths)] if widths else []
        found = {}
        for e in sizes:
            for site in find_routing_sites(gm.graph, e, where="compiled graph"):
                where = _layer_of(site.topk)
                if where is None:
                    raise RoutingMatchError(f"compiled graph: routing top-k {site.topk.name!r} has no decoder-layer "
                                            "path in its nn_module_stack")
                index, path = where
                if self.sim is not None and (index not in self.sim or self.sim[index].shape[0] != e):
                    continue  # a top-k over e experts in a layer whose matrix has another size
                found[index] = (site, _GraphLayer(index, path, e, site.k))
        if not found:
            return 0
        layers = [found[i][1] for i in sorted(found)]
        matrices = {i: self.sim[i] for i in found} if self.sim is not None else None
        plan = build_plan(layers, _restrict(self.policy, found), _restrict(self.S, found), _restrict(self.rho, found),
                          matrices, _restrict(self.N, found))
        for index, (site, layer) in sorted(found.items()):
            lp = plan[index]
            if lp.policy == "random":
                raise ValueError(f"policy[{index}]: 'random' is an evaluation ablation; the compile backend does not "
                                 "support it (use sere_fx.transform for it)")
            name = None
            if lp.policy in INDEX_POLICIES:
                name = f"sere_similarity_{index}"
                value = site.scores.meta.get("example_value", site.scores.meta.get("val"))
                gm.register_buffer(name, matrices[index].to(torch.float32).to(value.device))
                sources = getattr(gm, "_param_name_to_source", None)
                if sources is not None:
                    from torch._dynamo.source import ConstantSource

                    sources[name] = ConstantSource(name)
            insert_policy(gm.graph, site, lp, self.max_tokens, SiteAttrs(similarity=name), where=layer.name)
        gm.graph.lint()
        gm.recompile()
        self.layers_seen |= set(found)
        self.sites_rewritten += len(found)
        return len(found)

    def __call__(self, gm: fx.GraphModule, example_inputs):
        self.rewrite(gm)
        return self.inner(gm, example_inputs)


def _restrict(value, found):
    return {i: value[i] for i in found} if isinstance(value, dict) else value


def _n_experts(node: fx.Node):
    shape = node_shape(node.args[0]) if node.args else None
    return shape[-1] if shape else None


def backend(sim, S=2, rho=None, *, policy="sere", N=None, max_tokens=DEFAULT_MAX_TOKENS, plan=None) -> SereBackend:
    """A ``torch.compile`` backend applying the SERE pass (same arguments as ``transform``)."""
    return SereBackend(sim, S, rho, policy=policy, N=N, max_tokens=max_tokens, plan=plan)


def _contains_policy_calls(gm: fx.GraphModule) -> bool:
    from sere_fx.policies import remap_ids, select_topk

    targets = {torch.ops.sere.reroute.default, torch.ops.sere.reroute, remap_ids, select_topk}
    return any(n.op == "call_function" and n.target in targets for n in gm.graph.nodes)


def sere_backend(gm: fx.GraphModule, example_inputs):
    """The ``"sere"`` backend: for models already transformed by ``sere_fx.transform``."""
    if not _contains_policy_calls(gm) and any(op_kind(n) == "topk" for n in gm.graph.nodes):
        warnings.warn(
            "backend 'sere': this graph has a top-k but no sere_fx routing call; was the model passed through "
            "sere_fx.transform? (for an untransformed model use backend=sere_fx.backend(sim, ...))",
            stacklevel=2,
        )
    return _inductor(gm, example_inputs)


def register() -> None:
    from torch._dynamo import list_backends, register_backend

    if "sere" not in list_backends(exclude_tags=()):
        register_backend(name="sere")(sere_backend)
