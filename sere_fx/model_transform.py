"""``sere_fx.transform``: rewrite every MoE router of a model to route with a policy, in place.

For each MoE layer the router module is traced (``torch.fx``), its routing site matched,
the policy's call inserted (``sere_fx.passes.rewrite``), and the rewritten graph installed
as the router's ``forward``. The router stays the same object (so hooks such as
transformers' ``output_router_logits`` recording keep working) with its class swapped for
a subclass; its similarity matrix becomes the buffer ``sere_similarity``, so ``.to()``,
``state_dict()`` and ``load_state_dict()`` carry it.
"""

from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from sere_fx.config import RoutingConfig, cache_policy, calibration_need, plan_for_layers, routing_spec
from sere_fx.discovery import check_identity, find_moe_layers
from sere_fx.errors import argument_error
from sere_fx.expert_cache import RESIDENT_BUFFER, offloaded_layers
from sere_fx.passes.rewrite import SiteAttrs, insert_policy
from sere_fx.placement import Placement
from sere_fx.passes.trace import graph_forward
from sere_fx.similarity import as_similarity, layer_predictors, layer_tensors, resolve
from sere_fx.stats import LayerStats

SIM_BUFFER = "sere_similarity"
PREDICTOR_BUFFER = "sere_predictor"
STATS_ATTR = "sere_stats"
GENERATOR_ATTR = "sere_generator"

# Calls with more tokens than this are treated as prefill and keep the model's routing.
# Decode batches in serving rarely exceed 256 sequences, and once T*S is large the union
# of top-S already covers almost every expert, so re-routing a long prefill would cost
# quality and save nothing (prefill is compute-bound anyway).
DEFAULT_MAX_TOKENS = 256


@dataclass(frozen=True)
class SereSettings:
    """What a transformed model records about itself (exporters write it into artifacts)."""

    layers: dict[int, RoutingConfig]
    max_tokens: int | None
    similarity_fingerprint: str | None

    @property
    def policy(self) -> str:
        policies = {lp.policy for lp in self.layers.values()}
        return policies.pop() if len(policies) == 1 else "mixed"

    def as_dict(self) -> dict:
        return {
            "policy": self.policy,
            "layers": {str(i): lp.as_dict() for i, lp in sorted(self.layers.items())},
            "max_tokens": self.max_tokens,
            "similarity_fingerprint": self.similarity_fingerprint,
        }


def _fingerprint(matrices: dict[int, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(matrices):
        h.update(str(k).encode())
        h.update(matrices[k].contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def check_max_tokens(max_tokens) -> None:
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise argument_error("max_tokens", f"max_tokens: expected a positive int or None, got {max_tokens!r}")


def transform(
    model: nn.Module,
    sim=None,
    config=None,
    rho=None,
    *,
    S=None,
    policy=None,
    N=None,
    max_tokens: int | None = DEFAULT_MAX_TOKENS,
    stats: "bool | Placement" = False,
    plan=None,
    experts_implementation: str | None = None,
) -> nn.Module:
    """Make every MoE layer of ``model`` route with a policy; returns ``model`` (changed in place).

    Three spellings of the routing settings, one per call:

        transform(model, sim, SereConfig(S=2, rho=0.5))                 # a config (sere_fx.config)
        transform(model, None, {3: OEAConfig(S=2), 5: TopKConfig(S=1)})  # one per MoE layer
        transform(model, sim, S=2, rho=0.5, policy="sere")              # keywords, parsed into configs
        transform(model, sim, plan="plan.json")                         # a plan from sere_fx.tune

    ``transform(model, sim, 2, 0.5)`` (S and rho by position) means the keyword spelling.

    Args:
        model: a transformers MoE model (or any module whose MoE blocks have an ``experts``
            child and a router child that ends in a top-k over the experts).
        sim: a ``Similarity``, a path to a saved one, ``{decoder_layer_index: Tensor[E, E]}``
            or a sequence of ``[E, E]`` tensors in MoE-layer order. Needed by the index
            policies (``sere``, ``least_similar``, ``random``); ``topk``, ``oea`` and ``weight`` need none.
        config: a ``RoutingConfig`` (``SereConfig``, ``OEAConfig``, ``WeightConfig``, ``TopKConfig``,
            ``LeastSimilarConfig``, ``RandomConfig``) for every MoE layer, or ``{layer: config}``.
        S: primary experts per token (``k0`` for ``oea``), in [1, K]; ``S = K`` leaves
            routing unchanged. One int, or ``{layer: int}``. Default 2.
        rho: critical threshold of the index policies (default 0.5): a finite float, a
            ``sere_fx.Quantile`` (per layer, from its similarities) or ``{layer: value}``.
            ``rho <= 0`` re-routes every secondary expert. For ``weight``: its ``min_importance``,
            the importance an expert needs to be loaded besides the top-S (None: no threshold).
            Must be None for ``topk``/``oea``.
        policy: ``sere`` (default), ``least_similar``, ``random``, ``topk``, ``oea`` or
            ``weight`` (rules in ``sere_fx.policies``); or ``{layer: policy}``.
        N: ``weight`` only: at most N distinct experts per layer per call: an int (a fixed
            expert budget) or a float in (0, 1) (that fraction of the experts the call's tokens
            picked, rounded down); one value or ``{layer: value}``. ``weight`` needs N, rho or both.
        max_tokens: calls with more tokens than this (prefill) keep the model's own routing;
            None re-routes every call. Default ``DEFAULT_MAX_TOKENS`` (256).
        stats: record per-layer routing statistics (``sere_fx.routing_stats``); costs a
            device sync per layer call, so leave it off when timing. A ``sere_fx.Placement``
            records them and the busiest expert-parallel rank's experts and token-slots too.
        plan: per-layer settings from ``sere_fx.tune`` (a JSON path or dict); replaces
            ``config`` and the keywords, which must then be left out.
        experts_implementation: switch a transformers model's experts implementation too,
            e.g. ``"sere_sparse"`` (``sere_fx.kernels.experts_cpu``) or ``"grouped_mm"``.
            Fewer experts only save time if the implementation reads active experts only:
            a warning says so when the model runs one that reads weights per token-slot.

    Every check (settings, similarity, every layer's routing site) runs before anything is
    installed: on an error the model is left as it was.
    """
    if is_transformed(model):
        raise argument_error("model", "model: already transformed by sere_fx; call sere_fx.restore(model) first")
    if experts_implementation is not None and not hasattr(model, "set_experts_implementation"):
        raise argument_error("experts_implementation", f"experts_implementation: {type(model).__name__} is not a "
                             "transformers model with selectable experts implementations, got "
                             f"experts_implementation={experts_implementation!r}")
    check_max_tokens(max_tokens)
    if not isinstance(stats, (bool, Placement)):
        raise argument_error("stats", f"stats: expected True, False or a sere_fx.Placement, got {stats!r}")
    spec = routing_spec(config, policy=policy, S=S, rho=rho, N=N, plan=plan, check=False)  # checked per layer below
    layers = find_moe_layers(model)
    matrices = None
    if sim is not None:
        sim = as_similarity(sim)
        matrices = resolve(sim, layers)
        check_identity(sim.metadata, model, layers)
    elif (need := calibration_need(spec)) is not None:
        raise argument_error("sim", f"sim: policy {need[0]!r} {need[1]}, got None")
    layer_plans = plan_for_layers(spec, layers, matrices)
    caches = offloaded_layers(model)  # offloaded layers route with their cache's resident set in view
    if not caches and (p := cache_policy(layer_plans)) is not None:
        raise argument_error("policy", f"policy: {p!r} biases routing toward an offload cache's resident experts; "
                                       "expected an offloaded model (call sere_fx.offload first), got one without")
    tensors = layer_tensors(sim, layers, layer_plans, matrices) if sim is not None else {}
    predictors = layer_predictors(sim, layers, layer_plans) if sim is not None else {}
    # Rewrite every router's graph first (the graphs are copies: the model is untouched), then install.
    prepared = []
    for layer in layers:
        lp = layer_plans[layer.index]
        attrs = SiteAttrs(
            similarity=SIM_BUFFER if lp.layer_tensor else None,
            predictor=PREDICTOR_BUFFER if lp.needs_similarity and lp.needs_predictor else None,
            stats=STATS_ATTR if stats else None,
            generator=GENERATOR_ATTR if lp.policy == "random" else None,
            free=RESIDENT_BUFFER if layer.index in caches else None,
        )
        insert_policy(layer.graph, layer.site, lp, max_tokens, attrs, where=layer.router_name)
        layer.graph.lint()
        for node in layer.graph.nodes:  # example values are not needed any more
            node.meta.pop("val", None)
        prepared.append((layer, attrs))
    try:
        for layer, attrs in prepared:
            _install(layer, attrs, tensors, predictors, stats if isinstance(stats, Placement) else None, caches)
        if experts_implementation is not None:
            model.set_experts_implementation(experts_implementation)
    except BaseException:
        for layer, _ in prepared:  # all or nothing: no half-transformed model
            _uninstall(layer.router)
        raise
    _warn_if_cannot_benefit(model)
    model.sere_settings = SereSettings(
        layers=layer_plans,
        max_tokens=max_tokens,
        similarity_fingerprint=_fingerprint(matrices) if matrices else None,
    )
    return model


def _install(layer, attrs: SiteAttrs, tensors, predictors, placement: Placement | None, caches) -> None:
    router = layer.router
    if attrs.free:  # the cache's own tensor, updated in place as experts come and go
        router.register_buffer(RESIDENT_BUFFER, caches[layer.index].resident, persistent=False)
    device = next((t.device for t in router.parameters()), torch.device("cpu"))
    if attrs.similarity:  # the layer's calibrated tensor: a similarity matrix or an output-size predictor
        router.register_buffer(SIM_BUFFER, tensors[layer.index].to(device))
    if attrs.predictor:  # beside a similarity: a layer whose ranges read both
        router.register_buffer(PREDICTOR_BUFFER, predictors[layer.index].to(device))
    if attrs.stats:
        setattr(router, STATS_ATTR, LayerStats(placement=placement, num_experts=layer.num_experts))
    if attrs.generator:
        setattr(router, GENERATOR_ATTR, torch.Generator().manual_seed(layer.index))
    _install_forward(router, layer.graph, layer.index)


# Experts implementations whose cost does not fall with the number of distinct experts.
_NO_BENEFIT = {"batched_mm": "gathers a weight copy per token-slot, so its traffic follows T*K, not distinct experts"}


def _warn_if_cannot_benefit(model: nn.Module) -> None:
    impl = getattr(getattr(model, "config", None), "_experts_implementation", None)
    if impl in _NO_BENEFIT:
        warnings.warn(
            f"model: runs the {impl!r} experts implementation, which {_NO_BENEFIT[impl]}; re-routing will not make "
            "it faster. Use experts_implementation='grouped_mm' or 'sere_sparse'",
            stacklevel=3,
        )


def _install_forward(router: nn.Module, graph, layer_index: int) -> None:
    cls = type(router)
    sub = type(
        f"Sere{cls.__name__}",
        (cls,),
        {
            "forward": graph_forward(graph),
            "__module__": __name__,
            "_sere_original_class": cls,
            "_sere_layer_index": layer_index,
        },
    )
    router.__class__ = sub


def _transformed_routers(model: nn.Module):
    for module in model.modules():
        if "_sere_original_class" in type(module).__dict__:
            yield module


def _uninstall(router: nn.Module) -> None:
    original = type(router).__dict__.get("_sere_original_class")
    if original is not None:
        router.__class__ = original
    router._buffers.pop(SIM_BUFFER, None)
    router._buffers.pop(PREDICTOR_BUFFER, None)
    router._buffers.pop(RESIDENT_BUFFER, None)
    router.__dict__.pop(STATS_ATTR, None)
    router.__dict__.pop(GENERATOR_ATTR, None)


def is_transformed(model: nn.Module) -> bool:
    return next(_transformed_routers(model), None) is not None


def restore(model: nn.Module) -> nn.Module:
    """Undo ``transform`` in place: original router classes, no similarity buffers."""
    for router in list(_transformed_routers(model)):
        _uninstall(router)
    model.__dict__.pop("sere_settings", None)
    return model


def routing_stats(model: nn.Module) -> dict[int, LayerStats]:
    """``{decoder_layer_index: LayerStats}`` of a model transformed with ``stats=True``."""
    out = {}
    for router in _transformed_routers(model):
        s = getattr(router, STATS_ATTR, None)
        if s is None:
            raise argument_error("model", "model: transformed with stats=False; pass stats=True to sere_fx.transform")
        out[type(router)._sere_layer_index] = s
    return out
