"""The routing-site matcher: one matcher for fx, and ATen (torch.export) graphs; clear errors."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sere_fx
from sere_fx.discovery import find_moe_layers
from sere_fx.passes import RoutingMatchError, SiteAttrs, find_routing_sites, insert_policy
from sere_fx.passes.matcher import op_kind
from sere_fx.plan import LayerPlan
from tiny_models import FAMILIES, random_similarity, tiny_model


@pytest.mark.parametrize("family", FAMILIES)
def test_aten_graph_gives_the_same_site(family):
    model = tiny_model(family)
    for layer in find_moe_layers(model):
        x = torch.randn(5, model.config.hidden_size)
        ep = torch.export.export(layer.router, (x,))
        (site,) = find_routing_sites(ep.graph, layer.num_experts, where=layer.router_name)
        assert site.topk.target == torch.ops.aten.topk.default
        fx_site = layer.site
        assert (site.k, site.sorted, site.score_fn) == (fx_site.k, fx_site.sorted, fx_site.score_fn)
        assert len(site.weight_uses) == len(fx_site.weight_uses)


def test_rewrite_on_an_aten_graph_runs_the_op():
    model = tiny_model("deepseek_v3")
    layer = find_moe_layers(model)[0]
    x = torch.randn(6, model.config.hidden_size)
    ep = torch.export.export(layer.router, (x,))
    gm = ep.module()
    (site,) = find_routing_sites(gm.graph, layer.num_experts, where="exported")
    gm.register_buffer("sim", torch.rand(layer.num_experts, layer.num_experts))
    insert_policy(gm.graph, site, LayerPlan("sere", 1, 0.0), max_tokens=None, attrs=SiteAttrs(similarity="sim"))
    gm.recompile()
    logits, weights, ids = gm(x)
    ref_logits, ref_weights, ref_ids = layer.router(x)
    assert torch.equal(weights, ref_weights), "router weights must not change"
    # S=1, rho=0: each token's experts all come from the batch's primary set
    primary = set()
    values = ref_logits.sigmoid() + layer.router.e_score_correction_bias
    for t in range(ids.shape[0]):
        ranked = sorted(ref_ids[t].tolist(), key=lambda e: -values[t, e].item())
        primary.add(ranked[0])
    assert set(ids.flatten().tolist()) <= primary


def test_op_kinds_cover_every_level():
    gm = torch.fx.symbolic_trace(lambda x: torch.topk(F.softmax(x, dim=-1), 2))
    kinds = [op_kind(n) for n in gm.graph.nodes if n.op == "call_function"]
    assert kinds[:2] == ["softmax", "topk"]


# --- models the matcher must refuse, loudly -------------------------------------------------


class Experts(nn.Module):
    def __init__(self, e=8, h=16):
        super().__init__()
        self.num_experts = e
        self.w = nn.Parameter(torch.randn(e, h, h))

    def forward(self, x, ids, weights):
        return x


class Block(nn.Module):
    def __init__(self, router):
        super().__init__()
        self.gate = router
        self.experts = Experts()

    def forward(self, x):
        _, w, ids = self.gate(x)
        return self.experts(x, ids, w)


class Model(nn.Module):
    def __init__(self, router):
        super().__init__()
        self.config = type("C", (), {"hidden_size": 16})()
        self.layers = nn.ModuleList([Block(router)])

    def forward(self, x):
        return self.layers[0](x)


class Router(nn.Module):
    def __init__(self, body):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 16))
        self.body = body

    def forward(self, x):
        return self.body(self, x)


def _largest_false(self, x):
    logits = F.linear(x, self.weight)
    w, i = torch.topk(logits.softmax(-1), 2, dim=-1, largest=False)
    return logits, w, i


def _unknown_source(self, x):
    logits = F.linear(x, self.weight)
    w, i = torch.topk(torch.cumsum(logits, dim=-1), 2, dim=-1)
    return logits, w, i


def _two_sites(self, x):
    logits = F.linear(x, self.weight)
    w, i = torch.topk(logits.softmax(-1), 2, dim=-1)
    w2, i2 = torch.topk(logits.sigmoid(), 2, dim=-1)
    return logits, w + w2, i + i2


def _group_only(self, x):
    logits = F.linear(x, self.weight)
    w, i = torch.topk(logits.view(-1, 4, 2).amax(-1), 2, dim=-1)
    return logits, w, i


def _weights_only(self, x):
    logits = F.linear(x, self.weight)
    w, i = torch.topk(logits.softmax(-1), 2, dim=-1)
    return logits, logits.gather(1, i), None


@pytest.mark.parametrize(
    "body,message",
    [
        (_largest_false, r"layers\.0\.gate: top-k 'topk' over 8 experts .*largest=False"),
        (_unknown_source, r"layers\.0\.gate: .*does not come from softmax, sigmoid or a router matmul.*cumsum"),
        (_two_sites, r"layers\.0\.gate: found 2 routing top-ks"),
        (_group_only, r"layers\.0 \(Block\): has 8 experts but no child routes to them.*gate \(Router\): top-ks .*not over 8"),
        (_weights_only, r"layers\.0\.gate: .*only used to gather weights"),
    ],
)
def test_half_recognised_sites_are_errors(body, message):
    with pytest.raises(RoutingMatchError, match=message):
        find_moe_layers(Model(Router(body)))


def test_untraceable_router_is_reported():
    class Dynamic(nn.Module):
        def forward(self, x):
            if x.sum() > 0:  # data-dependent control flow: fx cannot trace it
                return x
            return x

    with pytest.raises(RoutingMatchError, match=r"gate \(Dynamic\): not traceable by torch.fx"):
        find_moe_layers(Model(Dynamic()))


def test_model_without_moe_layers():
    with pytest.raises(RoutingMatchError, match=r"model \(Linear\): no MoE layer found"):
        sere_fx.transform(nn.Linear(4, 4), {}, S=1)


def test_transformed_router_source_is_readable():
    model = tiny_model("qwen3_moe")
    layers = find_moe_layers(model)
    sere_fx.transform(model, random_similarity(layers), S=2)
    src = type(layers[0].router).forward.__sere_source__
    assert "remap_ids" in src and "self.sere_similarity" in src
