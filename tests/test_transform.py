"""``sere_fx.transform`` on every supported family, against hooked plain-loop references."""

import copy

import pytest
import torch

import sere_fx
from router_reference import hook_reference
from sere_fx.discovery import find_moe_layers
from tiny_models import FAMILIES, random_similarity, tiny_model

UNSORTED = {"deepseek_v2", "deepseek_v2_group", "deepseek_v3"}


def _inputs(model, batch=3, length=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.config.vocab_size, (batch, length), generator=g)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    model = tiny_model(request.param)
    layers = find_moe_layers(model)
    return request.param, model, layers


def _fresh(family):
    name, model, layers = family
    return name, copy.deepcopy(model), layers


def test_discovery_finds_every_moe_layer(family):
    name, model, layers = family
    cfg = model.config
    dense = getattr(cfg, "first_k_dense_replace", 0) or 0
    assert [layer.index for layer in layers] == list(range(dense, cfg.num_hidden_layers))
    for layer in layers:
        assert layer.site.k == cfg.num_experts_per_tok
        assert layer.site.sorted == (name not in UNSORTED)
        assert layer.site.score_fn == {"deepseek_v3": "sigmoid", "gpt_oss": "logits"}.get(name, "softmax")
        # DeepSeek-V3 gathers weights with the indices: that use must stay on the router's ids
        assert len(layer.site.weight_uses) == (1 if name == "deepseek_v3" else 0)


def test_S_equal_K_is_exactly_the_original(family):
    name, model, layers = _fresh(family)
    ids = _inputs(model)
    with torch.no_grad():
        before = model(ids).logits
        sere_fx.transform(model, random_similarity(layers), S=layers[0].top_k, rho=0.5, max_tokens=None)
        after = model(ids).logits
    assert torch.equal(before, after)


@pytest.mark.parametrize("S,rho", [(1, 0.0), (1, 0.55), (2, 0.4)])
def test_matches_hooked_loop_reference(family, S, rho):
    name, model, layers = _fresh(family)
    if S >= layers[0].top_k:
        pytest.skip("S >= K is the identity (covered above)")
    sim = random_similarity(layers, seed=S, quantize=8)  # quantised: ties happen
    reference = copy.deepcopy(model)
    record = {}
    hook_reference(reference, layers, sim, S, rho, unsorted=name in UNSORTED, record=record)
    ids = _inputs(model, batch=4, length=5)
    with torch.no_grad():
        original = model(ids).logits
        expected = reference(ids).logits
        sere_fx.transform(model, sim, S=S, rho=rho, max_tokens=None, stats=True)
        got = model(ids).logits
    assert torch.equal(got, expected)
    stats = sere_fx.routing_stats(model)
    rerouted = sum(int((before != after).sum()) for calls in record.values() for before, after in calls)
    assert sum(s.slots_rerouted for s in stats.values()) == rerouted
    assert rerouted > 0 and not torch.equal(got, original), "the test must exercise re-routing"


@pytest.mark.parametrize("max_tokens", [None, 3])
def test_generate_with_kv_cache_matches_reference(family, max_tokens):
    name, model, layers = _fresh(family)
    sim = random_similarity(layers, seed=7)
    S, rho = 1, 0.3
    reference = copy.deepcopy(model)
    record = {}
    hook_reference(reference, layers, sim, S, rho, max_tokens=max_tokens, unsorted=name in UNSORTED, record=record)
    prompt = _inputs(model, batch=3, length=5, seed=2)
    kwargs = dict(
        max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True, use_cache=True,
        pad_token_id=0,
    )
    expected = reference.generate(prompt, **kwargs)
    sere_fx.transform(model, sim, S=S, rho=rho, max_tokens=max_tokens, stats=True)
    got = model.generate(prompt, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    for a, b in zip(got.logits, expected.logits):
        assert torch.equal(a, b)
    stats = sere_fx.routing_stats(model)
    layer0 = stats[layers[0].index]
    # prefill (15 tokens) + 3 single-token decode steps (3 tokens each)
    if max_tokens is None:
        assert (layer0.calls, layer0.skipped_calls, layer0.tokens) == (4, 0, 24)
    else:
        assert (layer0.calls, layer0.skipped_calls, layer0.tokens, layer0.skipped_tokens) == (3, 1, 9, 15)
    assert sum(s.slots_rerouted for s in stats.values()) > 0


def test_grouped_mm_experts_match_reference():
    model = tiny_model("qwen3_moe", experts_implementation="grouped_mm")
    layers = find_moe_layers(model)
    sim = random_similarity(layers, seed=11)
    reference = copy.deepcopy(model)
    hook_reference(reference, layers, sim, 2, 0.2)
    ids = _inputs(model)
    with torch.no_grad():
        expected = reference(ids).logits
        got = sere_fx.transform(model, sim, S=2, rho=0.2, max_tokens=None)(ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_stats_count_what_the_reference_sees():
    model = tiny_model("olmoe")
    layers = find_moe_layers(model)
    sim = random_similarity(layers, seed=5)
    reference = copy.deepcopy(model)
    record = {}
    hook_reference(reference, layers, sim, 2, 0.5, record=record)
    ids = _inputs(model, batch=8, length=1)
    with torch.no_grad():
        reference(ids)
        sere_fx.transform(model, sim, S=2, rho=0.5, stats=True)(ids)
    for index, s in sere_fx.routing_stats(model).items():
        (before, after), = record[index]
        primary = set(before[:, :2].flatten().tolist())
        assert s.tokens == 8 and s.calls == 1
        assert s.distinct_before == len(set(before.flatten().tolist()))
        assert s.distinct_after == len(set(after.flatten().tolist()))
        assert s.critical_kept == len(set(after.flatten().tolist()) - primary)
        assert s.slots_rerouted == int((before != after).sum())
        assert s.distinct_after <= s.distinct_before
        assert s.slots_before == before.numel()  # each token's distinct experts: what a merging kernel computes
        assert s.slots_after == sum(len(set(row)) for row in after.tolist())
    assert sum(s.slots_after for s in sere_fx.routing_stats(model).values()) < sum(
        s.slots_before for s in sere_fx.routing_stats(model).values())


def test_buffers_follow_state_dict_and_to():
    model = tiny_model("qwen2_moe")
    layers = find_moe_layers(model)
    sim = random_similarity(layers, seed=1)
    sere_fx.transform(model, sim, S=1, rho=0.0)
    sd = model.state_dict()
    key = f"{layers[0].router_name}.sere_similarity"
    assert torch.equal(sd[key], sim[layers[0].index])
    # original parameter names are unchanged (checkpoints still load)
    original_keys = set(tiny_model("qwen2_moe").state_dict())
    assert original_keys <= set(sd) and {k for k in sd if k not in original_keys} == {
        f"{layer.router_name}.sere_similarity" for layer in layers
    }
    # a second transformed model loads the first one's similarity through load_state_dict
    other = sere_fx.transform(tiny_model("qwen2_moe"), random_similarity(layers, seed=2), S=1, rho=0.0)
    other.load_state_dict(sd)
    ids = _inputs(model)
    with torch.no_grad():
        assert torch.equal(other(ids).logits, model(ids).logits)
        model64 = copy.deepcopy(model).to(torch.float64)
        assert model64.get_submodule(layers[0].router_name).sere_similarity.dtype == torch.float64
        torch.testing.assert_close(model64(ids).logits.float(), model(ids).logits, atol=1e-4, rtol=1e-4)


def test_restore_gives_back_the_original_model():
    model = tiny_model("mixtral")
    ids = _inputs(model)
    with torch.no_grad():
        before = model(ids).logits
        layers = find_moe_layers(model)
        sere_fx.transform(model, random_similarity(layers), S=1, rho=0.0)
        assert sere_fx.is_transformed(model)
        with pytest.raises(ValueError, match="already transformed"):
            sere_fx.transform(model, random_similarity(layers), S=1, rho=0.0)
        sere_fx.restore(model)
        assert not sere_fx.is_transformed(model)
        assert "sere_similarity" not in "".join(model.state_dict())
        assert torch.equal(model(ids).logits, before)


def test_router_logits_recording_still_works():
    model = tiny_model("qwen3_moe")
    layers = find_moe_layers(model)
    ids = _inputs(model)
    with torch.no_grad():
        before = model(ids, output_router_logits=True).router_logits
        sere_fx.transform(model, random_similarity(layers), S=1, rho=0.0)
        after = model(ids, output_router_logits=True).router_logits
    # recorded for every layer; the first layer sees the same input, later ones a re-routed one
    assert len(after) == len(before) == len(layers)
    assert torch.equal(after[0], before[0]) and not torch.equal(after[1], before[1])


def test_settings_are_recorded():
    model = tiny_model("qwen3_moe")
    layers = find_moe_layers(model)
    sere_fx.transform(model, random_similarity(layers), S=2, rho=0.25, max_tokens=64)
    s = model.sere_settings
    assert (s.policy, s.max_tokens, sorted(s.layers)) == ("sere", 64, [0, 1])
    assert all((lp.policy, lp.S, lp.rho) == ("sere", 2, 0.25) for lp in s.layers.values())
    assert len(s.similarity_fingerprint) == 16
    assert s.as_dict()["layers"]["1"] == {"policy": "sere", "S": 2, "rho": 0.25}


def test_experts_implementation_switch_and_warning():
    model = tiny_model("qwen3_moe", experts_implementation="grouped_mm")
    layers = find_moe_layers(model)
    sim = random_similarity(layers)
    ids = _inputs(model)
    with torch.no_grad():
        expected = copy.deepcopy(model).eval()
        sere_fx.transform(expected, sim, S=1, rho=0.0)
        sere_fx.transform(model, sim, S=1, rho=0.0, experts_implementation="sere_sparse")
        assert model.config._experts_implementation == "sere_sparse"
        torch.testing.assert_close(model(ids).logits, expected(ids).logits, atol=1e-5, rtol=0)
    slow = tiny_model("olmoe", experts_implementation="batched_mm")
    with pytest.warns(UserWarning, match=r"model: runs the 'batched_mm' experts implementation, which gathers"):
        sere_fx.transform(slow, random_similarity(find_moe_layers(slow)), S=1)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_bfloat16_models(family):
    """The traced router keeps its dtype-dependent casts dynamic: a bf16 model transformed
    before or after .to(bfloat16) computes what the hooked reference computes."""
    model = tiny_model(family).to(torch.bfloat16)
    layers = find_moe_layers(model)
    sim = random_similarity(layers, seed=4)
    reference = copy.deepcopy(model)
    hook_reference(reference, layers, sim, 1, 0.2, unsorted=family in UNSORTED)
    ids = _inputs(model)
    with torch.no_grad():
        expected = reference(ids).logits
        got = sere_fx.transform(copy.deepcopy(model), sim, S=1, rho=0.2, max_tokens=None)(ids).logits
        late = sere_fx.transform(tiny_model(family), sim, S=1, rho=0.2, max_tokens=None).to(torch.bfloat16)(ids).logits
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, expected) and torch.equal(late, expected)


def test_ranges_route_each_call_as_its_range_alone(tmp_path):
    """A plan that follows the load: a call of T rows routes exactly as the model transformed with its
    range's setting alone (``off``: the plain model), eagerly and from an exported program with a
    dynamic batch; the ranges travel with the model's settings; calls per range are counted."""
    from sere_fx.config import OFF, OutputConfig, RowRanges, SereConfig
    from sere_fx.exporters.export import exported_program
    from tiny_models import calibration_file

    model = tiny_model("qwen3_moe", experts_implementation="grouped_mm")
    calib = calibration_file(find_moe_layers(model))
    singles = (OutputConfig(S=1, N=0.5), SereConfig(S=1, rho=0.0), OFF)
    ranges = RowRanges(((1, singles[0]), (4, singles[1]), (8, OFF)))
    plain = copy.deepcopy(model)
    alone = [sere_fx.transform(copy.deepcopy(model), calib, c, max_tokens=None) for c in singles[:2]] + [plain]
    ranged = sere_fx.transform(copy.deepcopy(model), calib, ranges, max_tokens=None, stats=True)
    unrecorded = sere_fx.transform(copy.deepcopy(model), calib, ranges, max_tokens=None)  # counters are eager-only
    program = exported_program(unrecorded, _inputs(model, batch=3, length=1)).module()
    for batch, which in ((1, 0), (3, 0), (4, 1), (7, 1), (8, 2), (11, 2)):
        x = _inputs(model, batch=batch, length=1, seed=batch)
        with torch.no_grad():
            want, got = alone[which](x).logits, ranged(x).logits
            exported = program(x)
        assert torch.equal(got, want), (batch, which)
        assert torch.allclose(getattr(exported, "logits", exported), want, atol=1e-5), (batch, which)
        if which < 2:
            assert not torch.allclose(want, plain(x).logits), "the range's setting must change these logits"
    counts = {i: s.range_calls for i, s in sere_fx.routing_stats(ranged).items()}
    assert all(c == {1: 2, 4: 2, 8: 2} for c in counts.values()), counts
    assert ranged.sere_settings.as_dict()["layers"]["1"]["ranges"][2] == {"min_rows": 8, "policy": "off"}


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_transforms_under_reusing_rewrite_copies_of_the_routers_found_before(family, monkeypatch):
    """``discovery.reusing`` (what ``tune``'s scorer wraps each pass's ``transform`` in): ``find_moe_layers``
    hands out copies of the layers found before, no router traced again, each with a graph of its own and
    its routing site on that graph's nodes; transforms under it, one plan after another, give the logits of
    transforms that traced, and the layers found before keep their graphs as they were."""
    import sere_fx.discovery as discovery

    model = tiny_model(family, seed=1)
    layers = find_moe_layers(model)
    sim = random_similarity(layers, seed=0)
    tokens = torch.randint(3, 90, (4, 7), generator=torch.Generator().manual_seed(0))
    # deepseek_v3's router gathers its weights by index: index policies only there
    middle = sere_fx.OEAConfig(S=2) if family == "qwen3_moe" else sere_fx.SereConfig(S=2, rho=0.0)
    plans = [sere_fx.SereConfig(S=1, rho=0.0), middle, sere_fx.SereConfig(S=1, rho=0.5)]
    expected = []
    with torch.no_grad():
        for c in plans:
            sere_fx.transform(model, sim, c, max_tokens=None)
            expected.append(model(input_ids=tokens).logits)
            sere_fx.restore(model)
        assert not torch.equal(expected[0], expected[1]) and not torch.equal(expected[1], expected[2])
        nodes = [[n.format_node() for n in layer.graph.nodes] for layer in layers]
        traced = []
        trace = discovery.trace_module
        monkeypatch.setattr(discovery, "trace_module", lambda m: traced.append(m) or trace(m))
        with discovery.reusing(model, layers):
            a, b = find_moe_layers(model), find_moe_layers(model)
            assert all(x.graph is not y.graph and x.graph is not l.graph for x, y, l in zip(a, b, layers))
            assert all(x.site.topk.graph is x.graph and x.site.indices.graph is x.graph for x in a)
            for c, want in zip(plans, expected):
                sere_fx.transform(model, sim, c, max_tokens=None)
                assert torch.equal(model(input_ids=tokens).logits, want)
                sere_fx.restore(model)
        assert not traced
        assert [[n.format_node() for n in layer.graph.nodes] for layer in layers] == nodes
        find_moe_layers(model)  # outside: traced again
        assert len(traced) >= len(layers)  # every router (and any other child of the block) traced
