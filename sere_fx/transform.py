"""``sere_fx.transform``: rewrite every MoE router of a model to re-route with SERE, in place.

For each MoE layer the router module is traced (``torch.fx``), its routing site matched,
the re-routing call inserted on the index path to the experts, and the rewritten graph
installed as the router's ``forward``. The router stays the same object (so hooks such as
transformers' ``output_router_logits`` recording keep working) with its class swapped for
a subclass; its similarity matrix becomes the buffer ``sere_similarity``, so ``.to()``,
``state_dict()`` and ``load_state_dict()`` carry it.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass

import torch
from torch import nn

from sere_fx.discovery import MoELayer, check_identity, find_moe_layers
from sere_fx.passes.rewrite import insert_reroute
from sere_fx.passes.trace import graph_forward
from sere_fx.similarity import as_similarity, check_finite_float, resolve
from sere_fx.stats import LayerStats

SIM_BUFFER = "sere_similarity"
STATS_ATTR = "sere_stats"

# Calls with more tokens than this are treated as prefill and keep the model's routing.
# Decode batches in serving rarely exceed 256 sequences, and once T*S is large the union
# of top-S already covers almost every expert, so re-routing a long prefill would cost
# quality and save nothing (prefill is compute-bound anyway).
DEFAULT_MAX_TOKENS = 256


@dataclass(frozen=True)
class SereSettings:
    """What a transformed model records about itself (exporters write it into artifacts)."""

    policy: str
    S: int
    rho: float
    max_tokens: int | None
    layers: tuple[int, ...]
    similarity_fingerprint: str

    def as_dict(self) -> dict:
        return asdict(self)


def _fingerprint(matrices: dict[int, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(matrices):
        h.update(str(k).encode())
        h.update(matrices[k].contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _check_settings(layers: list[MoELayer], S, rho, max_tokens) -> float:
    if isinstance(S, bool) or not isinstance(S, int):
        raise TypeError(f"S: expected an int, got {S!r} ({type(S).__name__})")
    for layer in layers:
        if not 1 <= S <= layer.top_k:
            raise ValueError(f"S: expected an integer in [1, {layer.top_k}] (top-k of {layer.name}), got {S}")
    rho = check_finite_float("rho", rho)
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise ValueError(f"max_tokens: expected a positive int or None, got {max_tokens!r}")
    return rho


def transform(
    model: nn.Module,
    sim,
    S: int = 2,
    rho: float = 0.5,
    *,
    max_tokens: int | None = DEFAULT_MAX_TOKENS,
    stats: bool = False,
) -> nn.Module:
    """Make every MoE layer of ``model`` re-route with SERE; returns ``model`` (changed in place).

    Args:
        model: a transformers MoE model (or any module whose MoE blocks have an ``experts``
            child and a router child that ends in a top-k over the experts).
        sim: a ``Similarity``, a path to a saved one, ``{decoder_layer_index: Tensor[E, E]}``
            or a sequence of ``[E, E]`` tensors in MoE-layer order.
        S: primary experts per token, in [1, K]; ``S = K`` leaves routing unchanged.
        rho: critical threshold; a secondary expert whose best primary match has similarity
            below ``rho`` is kept. ``rho <= 0`` re-routes every secondary expert.
        max_tokens: calls with more tokens than this (prefill) keep the model's own routing;
            None re-routes every call. Default ``DEFAULT_MAX_TOKENS`` (256).
        stats: record per-layer routing statistics (``sere_fx.routing_stats``); costs a
            device sync per layer call, so leave it off when timing.
    """
    if is_transformed(model):
        raise ValueError("model: already transformed by sere_fx; call sere_fx.restore(model) first")
    layers = find_moe_layers(model)
    rho = _check_settings(layers, S, rho, max_tokens)
    sim = as_similarity(sim)
    matrices = resolve(sim, layers)
    check_identity(sim.metadata, model, layers)
    for layer in layers:
        router = layer.router
        device = next((t.device for t in router.parameters()), layer.site.indices.meta["val"].device)
        router.register_buffer(SIM_BUFFER, matrices[layer.index].to(device))
        if stats:
            setattr(router, STATS_ATTR, LayerStats())
        insert_reroute(layer.graph, layer.site, SIM_BUFFER, S, rho, max_tokens, STATS_ATTR if stats else None)
        layer.graph.lint()
        for node in layer.graph.nodes:  # example values are not needed any more
            node.meta.pop("val", None)
        _install_forward(router, layer.graph, layer.index)
    model.sere_settings = SereSettings(
        policy="sere",
        S=S,
        rho=rho,
        max_tokens=max_tokens,
        layers=tuple(layer.index for layer in layers),
        similarity_fingerprint=_fingerprint(matrices),
    )
    return model


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


def is_transformed(model: nn.Module) -> bool:
    return next(_transformed_routers(model), None) is not None


def restore(model: nn.Module) -> nn.Module:
    """Undo ``transform`` in place: original router classes, no similarity buffers."""
    for router in list(_transformed_routers(model)):
        router.__class__ = type(router)._sere_original_class
        del router._buffers[SIM_BUFFER]
        router.__dict__.pop(STATS_ATTR, None)
    model.__dict__.pop("sere_settings", None)
    return model


def routing_stats(model: nn.Module) -> dict[int, LayerStats]:
    """``{decoder_layer_index: LayerStats}`` of a model transformed with ``stats=True``."""
    out = {}
    for router in _transformed_routers(model):
        s = getattr(router, STATS_ATTR, None)
        if s is None:
            raise ValueError("model: transformed with stats=False; pass stats=True to sere_fx.transform")
        out[type(router)._sere_layer_index] = s
    return out
