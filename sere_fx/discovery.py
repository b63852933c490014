"""Find the MoE layers of a model and the routing site of each.

An MoE block is a module with an ``experts`` child (the transformers 5 convention, fused
3-D expert weights or an ``nn.ModuleList``). Its router is whichever *other* child holds
a routing site: each is traced with ``torch.fx`` and handed to the one matcher. Blocks
without ``experts`` (dense MLPs) are not MoE layers and are left alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import re
import warnings
from dataclasses import dataclass

import torch
from torch import fx, nn

from sere_fx.errors import ArgumentValueError
from sere_fx.passes.matcher import RoutingMatchError, RoutingSite, describe_topks, match_router, op_kind
from sere_fx.passes.trace import annotate_shapes, trace_module

# ``model.layers.3.mlp`` (module names), ``L['self'].model.layers[3]`` / ``layers['3']`` (Dynamo's
# nn_module_stack paths)
_LAYER_INDEX = re.compile(r"(?:^|\.)layers(?:\.|\[['\"]?)(\d+)(?:['\"]?\]|\.|$)")


def layer_index(path: str) -> int | None:
    """The decoder-layer index in a module path, or None when it names none."""
    match = _LAYER_INDEX.search(path)
    return int(match.group(1)) if match else None


@dataclass
class MoELayer:
    index: int  # decoder-layer index (from the module path), or MoE order if the path has none
    name: str  # qualified name of the MoE block
    experts: nn.Module
    num_experts: int
    router_name: str  # qualified name of the router module
    router: nn.Module
    graph: fx.Graph  # the router's traced graph, shapes annotated
    site: RoutingSite

    @property
    def top_k(self) -> int:
        return self.site.k


def expert_count(experts: nn.Module, where: str) -> int:
    for attr in ("num_experts", "num_local_experts"):
        n = getattr(experts, attr, None)
        if isinstance(n, int):
            return n
    if isinstance(experts, nn.ModuleList):
        return len(experts)
    for p in experts.parameters(recurse=False):
        if p.dim() == 3:
            return int(p.shape[0])
    raise RoutingMatchError(f"{where}: cannot tell how many experts it holds (no num_experts, not a ModuleList, no 3-D weight)")


def _example_input(experts: nn.Module, hidden_size: int, allow_meta: bool) -> torch.Tensor:
    # an offloaded layer's weights are buffers (its cache's slots)
    p = next((t for t in (*experts.parameters(), *experts.buffers()) if t.is_floating_point()), None)
    dtype = p.dtype if p is not None and p.dtype.is_floating_point else torch.float32
    device = p.device if p is not None else torch.device("cpu")
    if device.type == "meta":
        if not allow_meta:
            raise ArgumentValueError("model", "model: its expert weights are on the 'meta' device; load real weights "
                                              "before transform")
        return torch.empty(3, hidden_size, dtype=dtype, device=device)  # shapes only
    gen = torch.Generator().manual_seed(0)
    return torch.randn(3, hidden_size, generator=gen).to(device=device, dtype=dtype)


def _router_of(block_name: str, block: nn.Module, experts: nn.Module, num_experts: int, hidden_size: int,
               allow_meta: bool = False):
    seen = []
    found = []
    for child_name, child in block.named_children():
        if child is experts:
            continue
        where = f"{block_name}.{child_name}"
        try:
            graph = trace_module(child)
        except Exception as exc:  # a child fx cannot trace cannot be a router we rewrite
            seen.append(f"{child_name} ({type(child).__name__}): not traceable by torch.fx ({type(exc).__name__}: {exc})")
            continue
        if not any(op_kind(n) == "topk" for n in graph.nodes):
            seen.append(f"{child_name} ({type(child).__name__}): no top-k")
            continue
        annotate_shapes(child, graph, _example_input(experts, hidden_size, allow_meta))
        site = match_router(graph, num_experts, where)
        if site is None:
            seen.append(f"{child_name} ({type(child).__name__}): top-ks {describe_topks(graph)} are not over {num_experts} experts")
            continue
        found.append((where, child, graph, site))
    if not found:
        raise RoutingMatchError(
            f"{block_name} ({type(block).__name__}): has {num_experts} experts but no child routes to them. "
            f"Seen: {'; '.join(seen) or 'no children besides experts'}. "
            "Routing written inline in the block's forward is not supported."
        )
    if len(found) > 1:
        raise RoutingMatchError(f"{block_name}: several children route to its experts: {[f[0] for f in found]}")
    return found[0]


@dataclass
class MoEBlock:
    index: int  # decoder-layer index (from the module path), or MoE order if the path has none
    name: str  # qualified name of the MoE block
    block: nn.Module
    experts: nn.Module
    num_experts: int


def find_moe_blocks(model: nn.Module) -> list[MoEBlock]:
    """Every module with an ``experts`` child, in module order (no tracing: cheap, and works on
    transformed models too)."""
    blocks = []
    for name, block in model.named_modules():
        experts = getattr(block, "experts", None)
        if not isinstance(experts, nn.Module) or experts not in block.children():
            continue
        index = layer_index(name)
        index = len(blocks) if index is None else index
        blocks.append(MoEBlock(index, name, block, experts, expert_count(experts, f"{name}.experts")))
    if not blocks:
        raise RoutingMatchError(
            f"model ({type(model).__name__}): no MoE layer found (no module has an 'experts' child)"
        )
    return blocks


# Per model (by id, the model kept to check it): the layers ``find_moe_layers`` hands out copies of inside
# ``reusing`` instead of tracing the routers again.
_REUSED: dict[int, tuple[nn.Module, list[MoELayer]]] = {}


@contextlib.contextmanager
def reusing(model: nn.Module, layers: list[MoELayer]):
    """Inside, ``find_moe_layers(model)`` returns copies of ``layers`` (what it found on ``model`` earlier), each
    with a graph of its own to rewrite, instead of tracing and shape-annotating every router again: for a
    caller that transforms and restores one model pass after pass (``tune``'s scorer), its routers unchanged
    in between. The test-bed's four routers take ~60 ms to find, their copies ~1.5 ms."""
    _REUSED[id(model)] = (model, layers)
    try:
        yield
    finally:
        _REUSED.pop(id(model), None)


def _copy(layer: MoELayer) -> MoELayer:
    """``layer`` with a copy of its router's graph and its routing site on the copy's nodes."""
    graph, nodes = fx.Graph(), {}
    output = graph.output(graph.graph_copy(layer.graph, nodes))  # graph_copy maps every node but the output
    nodes[next(n for n in reversed(layer.graph.nodes) if n.op == "output")] = output
    site = layer.site
    site = dataclasses.replace(site, topk=nodes[site.topk], scores=nodes[site.scores], indices=nodes[site.indices],
                               values=None if site.values is None else nodes[site.values],
                               dispatch_uses=[nodes[n] for n in site.dispatch_uses],
                               weight_uses=[nodes[n] for n in site.weight_uses])
    return dataclasses.replace(layer, graph=graph, site=site)


def find_moe_layers(model: nn.Module, *, allow_meta: bool = False) -> list[MoELayer]:
    """Every MoE layer of ``model`` in module order, each with its router's routing site.
    ``allow_meta``: the model may be built on the meta device (shapes only: the sites are found,
    nothing can be computed), as the vLLM plugin's start-up check builds the served model's config."""
    reused = _REUSED.get(id(model))
    if reused is not None and reused[0] is model:
        return [_copy(layer) for layer in reused[1]]
    hidden_size = getattr(getattr(model, "config", None), "hidden_size", None)
    layers = []
    for b in find_moe_blocks(model):
        if not isinstance(hidden_size, int):
            raise RoutingMatchError(f"model ({type(model).__name__}): needs config.hidden_size to trace its routers")
        router_name, router, graph, site = _router_of(b.name, b.block, b.experts, b.num_experts, hidden_size, allow_meta)
        layers.append(MoELayer(b.index, b.name, b.experts, b.num_experts, router_name, router, graph, site))
    return layers


def weights_fingerprint(layers) -> str:
    """Hash of every MoE router's weights: identifies the model a similarity was calibrated on."""
    h = hashlib.sha256()
    for layer in layers:
        for name, t in sorted(layer.router.state_dict().items()):
            if name.startswith("sere_"):
                continue
            h.update(name.encode())
            h.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def model_identity(model: nn.Module, layers) -> dict:
    config = getattr(model, "config", None)
    return {
        "architecture": (getattr(config, "architectures", None) or [type(model).__name__])[0],
        "model_type": getattr(config, "model_type", None),
        "num_hidden_layers": getattr(config, "num_hidden_layers", None),
        "moe_layers": [layer.index for layer in layers],
        "num_experts": {str(layer.index): layer.num_experts for layer in layers},
        "weights_fingerprint": weights_fingerprint(layers),
    }


def check_identity(metadata: dict, model: nn.Module, layers) -> None:
    """Warn when a similarity was calibrated on another model (same shapes, other weights)."""
    if not metadata:
        return
    here = model_identity(model, layers)
    for key in ("architecture", "weights_fingerprint"):
        if key in metadata and metadata[key] != here[key]:
            warnings.warn(
                f"sim: calibrated on a model with {key} {metadata[key]!r}, this model has {here[key]!r}; "
                "re-routing will use similarities of other weights",
                stacklevel=3,
            )
            return
