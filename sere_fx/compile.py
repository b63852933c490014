"""torch.compile integration.

- ``sere_fx.backend(sim, SereConfig(S=2, rho=0.5))`` (or ``backend(sim, S=2, rho=0.5)``): a
  backend for an *untransformed* model. It runs the same matcher and rewrite on each Dynamo
  graph it receives (routing sites are mapped to decoder layers through ``nn_module_stack``),
  bakes the similarity matrices into the graph module as buffers, then hands the graph to
  Inductor. Routing top-ks it leaves alone are reported, never passed on silently.
- ``"sere"``: a named backend (registered on import, and through the
  ``torch_dynamo_backends`` entry point) for a model already passed through
  ``sere_fx.transform``: the re-routing op is already in its graph; it checks that and
  hands over to Inductor.
"""

from __future__ import annotations

import warnings

import torch
from torch import fx
from torch._dynamo.utils import counters

from sere_fx.config import LayerInfo, cache_policy, calibration_need, plan_for_layers, restrict, routing_spec
from sere_fx.discovery import layer_index
from sere_fx.errors import ArgumentValueError
from sere_fx.model_transform import DEFAULT_MAX_TOKENS, check_max_tokens
from sere_fx.passes.matcher import RoutingMatchError, find_routing_sites, node_shape, op_kind
from sere_fx.passes.rewrite import SiteAttrs, insert_policy
from sere_fx.similarity import as_similarity, layer_predictors, layer_tensors


def _layer_of(node: fx.Node) -> tuple[int, str] | None:
    stack = node.meta.get("nn_module_stack") or {}
    for path, _ in reversed(list(stack.values())):
        index = layer_index(str(path))
        if index is not None:
            return index, str(path)
    return None


def _n_experts(node: fx.Node):
    shape = node_shape(node.args[0]) if node.args else None
    return shape[-1] if shape else None


def _inductor(gm, example_inputs):
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs)


def _bake(gm: fx.GraphModule, name: str, tensor: torch.Tensor, device) -> str:
    """``tensor`` as a float32 buffer ``name`` of ``gm``. AOT lifts a Dynamo graph's buffers by the
    source Dynamo recorded for each, so the new buffer is given a constant source."""
    gm.register_buffer(name, tensor.to(torch.float32).to(device))
    sources = getattr(gm, "_param_name_to_source", None)
    if sources is not None:
        from torch._dynamo.source import ConstantSource

        sources[name] = ConstantSource(name)
    return name


class SereBackend:
    """``torch.compile(model, backend=SereBackend(sim, ...))``; see ``sere_fx.backend``.

    Counts what it does as Inductor's passes do (``torch._dynamo.utils.counters["sere"]``:
    ``sites_rewritten``, ``graphs_rewritten``, ``graphs_unrewritten``) and on itself
    (``sites_rewritten``, ``layers_rewritten``). A routing top-k it leaves alone (a layer the
    similarity or the per-layer settings do not cover, a matrix of another size) and a graph
    with top-ks in decoder layers but no rewrite are reported: a warning, or an error with
    ``strict=True``. ``check()`` reports configured layers no graph has shown.
    """

    def __init__(self, sim=None, config=None, rho=None, *, S=None, policy=None, N=None,
                 max_tokens=DEFAULT_MAX_TOKENS, plan=None, strict: bool = False, inner=_inductor):
        check_max_tokens(max_tokens)
        self.spec = routing_spec(config, policy=policy, S=S, rho=rho, N=N, plan=plan)
        self.sim = as_similarity(sim) if sim is not None else None
        if self.sim is None and (need := calibration_need(self.spec)) is not None:
            raise ArgumentValueError("sim", f"sim: policy {need[0]!r} {need[1]}, got None")
        if (p := cache_policy(self.spec)) is not None:
            raise ArgumentValueError("policy", f"policy: {p!r} reads an offload cache's resident set, which a compiled "
                                               "graph does not carry; use it on a model from sere_fx.offload, eagerly")
        self.max_tokens, self.strict, self.inner = max_tokens, strict, inner
        self.sites_rewritten = 0
        self.layers_rewritten: set[int] = set()

    @property
    def configured_layers(self) -> set[int] | None:
        """The layers the similarity or the per-layer settings name (None: whatever the graphs show)."""
        if self.sim is not None:
            return set(self.sim)
        if isinstance(self.spec, dict):
            return set(self.spec)
        return None

    def _report(self, problems: list[str]) -> None:
        if not problems:
            return
        message = "sere_fx.backend: " + "; ".join(problems)
        if self.strict:
            raise RoutingMatchError(message)
        warnings.warn(message + " (strict=True makes this an error)", stacklevel=3)

    def check(self) -> None:
        """Call after the compiled model has run: reports configured layers that no graph rewrote."""
        missing = sorted((self.configured_layers or set()) - self.layers_rewritten)
        if missing:
            self._report([f"configured MoE decoder layers {missing} never appeared in a compiled graph "
                          f"(rewritten: {sorted(self.layers_rewritten)})"])

    def rewrite(self, gm: fx.GraphModule) -> int:
        """Rewrite every routing site of ``gm`` in place; returns how many.

        The similarity matrices become buffers of ``gm``. AOT lifts a Dynamo graph's buffers
        by the source Dynamo recorded for each, so each new buffer is given a constant source.
        """
        topks = [n for n in gm.graph.nodes if op_kind(n) == "topk"]
        if self.sim is not None:
            sizes = sorted({int(m.shape[0]) for m in self.sim.values()})
        else:
            # Policies without similarity: the expert dimension is the widest top-k input in
            # the graph (group top-ks, as in DeepSeek, run over fewer entries).
            widths = {_n_experts(n) for n in topks} - {None}
            sizes = [max(widths)] if widths else []
        configured = self.configured_layers
        found, problems = {}, []
        for e in sizes:
            for site in find_routing_sites(gm.graph, e, where="compiled graph"):
                where = _layer_of(site.topk)
                if where is None:
                    raise RoutingMatchError(f"compiled graph: routing top-k {site.topk.name!r} has no decoder-layer "
                                            "path in its nn_module_stack")
                index, path = where
                if configured is not None and index not in configured:
                    problems.append(f"routing top-k {site.topk.name!r} of decoder layer {index} ({e} experts) left "
                                    f"as it is: the settings cover layers {sorted(configured)}")
                elif self.sim is not None and self.sim[index].shape[0] != e:
                    problems.append(f"routing top-k {site.topk.name!r} of decoder layer {index} left as it is: "
                                    f"{e} experts, but sim[{index}] is {list(self.sim[index].shape)}")
                else:
                    found[index] = (site, LayerInfo(index, path, e, site.k))
        if not found:
            in_layers = sorted({_n_experts(n) for n in topks if _layer_of(n) is not None} - {None})
            if in_layers and not problems:
                problems.append(f"this graph has top-ks over {in_layers} entries in decoder layers, but none is a "
                                f"routing site over the similarity's expert counts {sizes}")
            if problems:
                counters["sere"]["graphs_unrewritten"] += 1
            self._report(problems)
            return 0
        layers = [found[i][1] for i in sorted(found)]
        matrices = {i: self.sim[i] for i in found} if self.sim is not None else None
        plan = plan_for_layers(restrict(self.spec, found), layers, matrices)
        tensors = layer_tensors(self.sim, layers, plan, matrices) if self.sim is not None else {}
        predictors = layer_predictors(self.sim, layers, plan) if self.sim is not None else {}
        for index, (site, layer) in sorted(found.items()):
            lp = plan[index]
            if lp.policy == "random":
                raise ArgumentValueError("policy", f"policy[{index}]: 'random' is an evaluation ablation; the compile "
                                                   "backend does not support it (use sere_fx.transform for it)")
            value = site.scores.meta.get("example_value", site.scores.meta.get("val"))
            # a similarity matrix or an output-size predictor, baked in as a buffer (and a predictor
            # beside a similarity for a layer whose ranges read both)
            name = _bake(gm, f"sere_similarity_{index}", tensors[index], value.device) if lp.layer_tensor else None
            predictor = (_bake(gm, f"sere_predictor_{index}", predictors[index], value.device)
                         if lp.needs_similarity and lp.needs_predictor else None)
            insert_policy(gm.graph, site, lp, self.max_tokens, SiteAttrs(similarity=name, predictor=predictor),
                          where=layer.name)
        gm.graph.lint()
        gm.recompile()
        self.layers_rewritten |= set(found)
        self.sites_rewritten += len(found)
        counters["sere"]["sites_rewritten"] += len(found)
        counters["sere"]["graphs_rewritten"] += 1
        self._report(problems)
        return len(found)

    def __call__(self, gm: fx.GraphModule, example_inputs):
        self.rewrite(gm)
        return self.inner(gm, example_inputs)


def backend(sim=None, config=None, rho=None, *, S=None, policy=None, N=None, max_tokens=DEFAULT_MAX_TOKENS,
            plan=None, strict: bool = False) -> SereBackend:
    """A ``torch.compile`` backend applying the SERE pass, with ``transform``'s settings
    (``backend(sim, SereConfig(S=2, rho=0.5))`` or ``backend(sim, S=2, rho=0.5)``). ``strict``: a
    routing top-k left alone is an error, not a warning."""
    return SereBackend(sim, config, rho, S=S, policy=policy, N=N, max_tokens=max_tokens, plan=plan, strict=strict)


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
