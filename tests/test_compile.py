"""torch.compile: the SERE backend on untransformed models, and the "sere" backend."""

import copy

import pytest
import torch
from torch._dynamo.backends.debugging import aot_eager
from transformers import StaticCache

import sere_fx
from sere_fx.compile import SereBackend
from sere_fx.discovery import find_moe_layers
from sere_fx.evaluate import cache_kwarg
from tiny_models import FAMILIES, calibration_file, random_similarity, tiny_model


def _pair(family, **kwargs):
    model = tiny_model(family, experts_implementation="grouped_mm")
    sim = random_similarity(find_moe_layers(model), seed=5)
    ref = sere_fx.transform(copy.deepcopy(model), sim, S=1, rho=0.0, **kwargs)
    return model, sim, ref


@pytest.mark.parametrize("family", FAMILIES)
def test_fullgraph_decode_step_of_every_family(family):
    """A single-token decode step with a static cache compiles with fullgraph=True (no graph
    break at the op) and matches the eagerly transformed model."""
    torch._dynamo.reset()
    model, sim, ref = _pair(family)
    backend = SereBackend(sim, S=1, rho=0.0, inner=aot_eager)  # AOT tracing without Inductor codegen: fast
    step = torch.compile(model, backend=backend, fullgraph=True)
    prompt = torch.randint(3, 90, (3, 5), generator=torch.Generator().manual_seed(0))
    nxt = torch.randint(3, 90, (3, 1), generator=torch.Generator().manual_seed(1))
    caches = [StaticCache(config=model.config, max_cache_len=16) for _ in range(3)]
    kw = cache_kwarg(model)
    with torch.no_grad(), sere_fx.bypass():  # the same prefill for all three
        model(prompt, **{kw: caches[0]}, use_cache=True)
        ref(prompt, **{kw: caches[1]}, use_cache=True)
        original_model = sere_fx.restore(copy.deepcopy(ref))
        original_model(prompt, **{kw: caches[2]}, use_cache=True)
    pos = torch.tensor([5])
    with torch.no_grad():
        got = step(nxt, **{kw: caches[0]}, use_cache=True, cache_position=pos).logits
        expected = ref(nxt, **{kw: caches[1]}, use_cache=True, cache_position=pos).logits
        original = original_model(nxt, **{kw: caches[2]}, use_cache=True, cache_position=pos).logits
    assert backend.sites_rewritten == len(find_moe_layers(model))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    assert (got - original).abs().max() > 1e-3, "routing must really differ from the untransformed model"


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2"])  # sorted and unsorted top-k routers
def test_inductor_backend_matches_eager_at_two_batch_sizes(family):
    torch._dynamo.reset()
    model, sim, ref = _pair(family, max_tokens=None)
    backend = sere_fx.backend(sim, S=1, rho=0.0, max_tokens=None)
    compiled = torch.compile(model, backend=backend)
    compiled_transformed = torch.compile(ref, backend="sere")
    for batch in (2, 5):
        ids = torch.randint(3, 90, (batch, 4), generator=torch.Generator().manual_seed(batch))
        with torch.no_grad():
            expected = ref(ids, use_cache=False).logits
            original = sere_fx.restore(copy.deepcopy(ref))(ids, use_cache=False).logits
            for c in (compiled, compiled_transformed):
                got = c(ids, use_cache=False).logits
                torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
        assert (expected - original).abs().max() > 1e-3
    assert backend.sites_rewritten >= 2


def test_static_cache_generate_under_compile():
    """The usual fast-decode recipe: static cache + compiled forward, with the "sere" backend."""
    torch._dynamo.reset()
    model, sim, ref = _pair("qwen3_moe")
    prompt = torch.randint(3, 90, (2, 5), generator=torch.Generator().manual_seed(3))
    kwargs = dict(max_new_tokens=4, do_sample=False, cache_implementation="static", pad_token_id=0,
                  return_dict_in_generate=True, output_logits=True)
    expected = ref.generate(prompt, **kwargs)
    ref.forward = torch.compile(ref.forward, backend="sere")
    got = ref.generate(prompt, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    for a, b in zip(got.logits, expected.logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_sere_backend_is_registered_and_warns_on_untransformed_graphs():
    from torch._dynamo import list_backends

    assert "sere" in list_backends(exclude_tags=())
    torch._dynamo.reset()
    model = tiny_model("olmoe", experts_implementation="grouped_mm")
    ids = torch.randint(3, 90, (2, 3))
    with pytest.warns(UserWarning, match="backend 'sere': this graph has a top-k but no sere_fx routing call"):
        with torch.no_grad():
            torch.compile(model, backend="sere")(ids, use_cache=False)


@pytest.mark.parametrize("family,settings", [("deepseek_v2_group", dict(policy="oea", S=1)),
                                             ("qwen2_moe", dict(policy="weight", S=1, rho=0.5, N=5))])
def test_backend_with_a_policy_that_needs_no_similarity(family, settings):
    """OEA / weight through the backend: no similarity, so the expert dimension comes from the
    graph (the widest top-k; DeepSeek's group top-k must not be taken for a routing site)."""
    torch._dynamo.reset()
    model = tiny_model(family, experts_implementation="grouped_mm")
    ref = sere_fx.transform(copy.deepcopy(model), None, max_tokens=None, **settings)
    backend = SereBackend(None, max_tokens=None, inner=aot_eager, **settings)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    ids = torch.randint(3, 90, (4, 3), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids, use_cache=False).logits, ref(ids, use_cache=False).logits,
                                   atol=1e-4, rtol=0)
    assert backend.sites_rewritten == len(find_moe_layers(model))


def test_backend_with_the_output_policy():
    """``output`` through the backend: its predictor baked in as a buffer, compiled == eager."""
    torch._dynamo.reset()
    model = tiny_model("qwen3_moe", experts_implementation="grouped_mm")
    sim = calibration_file(find_moe_layers(model), seed=6)
    config = sere_fx.OutputConfig(S=1, N=0.5)
    ref = sere_fx.transform(copy.deepcopy(model), sim, config, max_tokens=None)
    as_weight = sere_fx.transform(copy.deepcopy(model), None, sere_fx.WeightConfig(S=1, N=0.5), max_tokens=None)
    backend = SereBackend(sim, config, max_tokens=None, inner=aot_eager)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    ids = torch.randint(3, 90, (6, 1), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = compiled(ids, use_cache=False).logits
        torch.testing.assert_close(got, ref(ids, use_cache=False).logits, atol=1e-4, rtol=0)
        assert not torch.allclose(got, as_weight(ids, use_cache=False).logits, atol=1e-4)
    assert backend.sites_rewritten == len(find_moe_layers(model))
    with pytest.raises(ValueError, match=r"sim: policy 'output' needs the output-size predictors"):
        SereBackend(None, config)


def test_backend_refuses_settings_beside_a_plan():
    with pytest.raises(ValueError, match=r"S: a plan sets it per layer; got S=3 as well"):
        SereBackend(None, S=3, plan={"layers": {"0": {"policy": "oea", "S": 1, "rho": None}}})
