"""Every routing policy against an independent reference, through the same pass."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

import sere_fx
from reference import least_similar_loop, oea_loop, reroute_loop, weight_loop
from router_reference import _selection_scores
from sere_fx.discovery import find_moe_layers
from sere_fx.policies import ablation_reroute, weight_select
from tiny_models import calibration_file, random_similarity, tiny_model


def _ids(model, batch=6, length=1, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.config.vocab_size, (batch, length), generator=g)


@pytest.mark.parametrize("seed", range(20))
def test_least_similar_matches_loop(seed):
    g = torch.Generator().manual_seed(seed)
    e, k, t = 12, 4, 5
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    sim = torch.round(torch.rand(e, e, generator=g) * 6) / 6
    for S, rho in [(1, 0.0), (2, 0.5)]:
        assert torch.equal(ablation_reroute(ids, sim, S, rho, "least_similar"), least_similar_loop(ids, sim, S, rho))


def test_random_keeps_sere_sets_and_varies_target():
    g = torch.Generator().manual_seed(0)
    e, k, t = 32, 6, 8
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    sim = torch.rand(e, e, generator=g)
    gen = torch.Generator().manual_seed(1)
    sere = reroute_loop(ids, sim, 2, 0.5)
    primary = set(ids[:, :2].flatten().tolist())
    targets = set()
    for _ in range(10):
        out = ablation_reroute(ids, sim, 2, 0.5, "random", gen)
        moved = sere != ids  # exactly the slots SERE moves are moved (to a primary, never to themselves)
        assert torch.equal(out != ids, moved)
        assert set(out[moved].tolist()) <= primary
        targets |= set(out[moved].tolist())
    assert len(targets) > 2
    a = ablation_reroute(ids, sim, 2, 0.5, "random", torch.Generator().manual_seed(5))
    b = ablation_reroute(ids, sim, 2, 0.5, "random", torch.Generator().manual_seed(5))
    assert torch.equal(a, b)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v2", "gpt_oss"])
def test_topk_policy_equals_a_model_with_smaller_top_k(family):
    model = tiny_model(family)
    layers = find_moe_layers(model)
    S = 1
    reference = copy.deepcopy(model)
    for layer in layers:
        reference.get_submodule(layer.router_name).top_k = S
    ids = _ids(model)
    with torch.no_grad():
        expected = reference(ids).logits
        got = sere_fx.transform(model, None, S=S, policy="topk", max_tokens=None)(ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def _oea_weights(family, router, x, chosen, k):
    """The family's own weight formula over each token's OEA set (independent re-implementation)."""
    x = x.reshape(-1, router.weight.shape[1])
    logits = F.linear(x.float(), router.weight.float(), getattr(router, "bias", None))
    weights = torch.zeros(x.shape[0], k)
    ids = torch.zeros(x.shape[0], k, dtype=torch.int64)
    for t, picks in enumerate(chosen):
        picks_t = torch.tensor(picks)
        if family == "gpt_oss":
            w = torch.softmax(logits[t, picks_t], dim=0)
        else:
            p = torch.softmax(logits[t], dim=0)[picks_t]
            if family in ("qwen3_moe", "mixtral"):
                w = p / p.sum()
            elif family == "deepseek_v2":
                w = p * router.routed_scaling_factor
            else:
                w = p
        weights[t, : len(picks)] = w
        ids[t, : len(picks)] = picks_t
        ids[t, len(picks):] = picks[0]
    return weights, ids


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v2", "gpt_oss"])
@pytest.mark.parametrize("k0", [1, 2])
def test_oea_matches_loop_reference(family, k0):
    model = tiny_model(family)
    layers = find_moe_layers(model)
    k = layers[0].top_k
    if k0 >= k:
        pytest.skip("k0 >= K is the identity")
    reference = copy.deepcopy(model)
    unfilled = []
    for layer in layers:
        router = reference.get_submodule(layer.router_name)

        def hook(module, args, output):
            logits = output[0]
            scores = _selection_scores(module, args[0])
            chosen = oea_loop(scores, k, k0)
            unfilled.append(sum(k - len(c) for c in chosen))
            weights, ids = _oea_weights(family, module, args[0], chosen, k)
            return logits, weights.to(output[1].dtype), ids

        router.register_forward_hook(hook)
    ids = _ids(model, batch=7)
    with torch.no_grad():
        expected = reference(ids).logits
        got = sere_fx.transform(model, None, S=k0, policy="oea", max_tokens=None, stats=True)(ids).logits
        original = sere_fx.restore(copy.deepcopy(model))(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, original)
    stats = sere_fx.routing_stats(model)
    assert all(s.critical_kept == 0 for s in stats.values())  # OEA never loads beyond L


def _filled(values, ids, neutral):
    return [[e for e, v in zip(i, x) if v != neutral] for i, x in zip(ids.tolist(), values.tolist())]


@pytest.mark.parametrize("seed", range(12))
def test_weight_select_matches_loop(seed):
    g = torch.Generator().manual_seed(seed)
    t, e, k = 9, 16, 4
    logits = torch.randn(t, e, generator=g) * 2
    valid = torch.rand(t, generator=g) > 0.3
    for S, rho, N in [(1, None, 5), (2, None, 7), (1, 0.3, None), (1, 0.2, 6), (2, 0.0, 3), (1, None, 16),
                      (1, None, 0.6), (2, 0.25, 0.5), (1, None, 0.01)]:
        for as_logits in (False, True):
            scores, neutral = (logits, float("-inf")) if as_logits else (logits.softmax(-1), 0.0)
            values, ids, own = weight_select(scores, k, S, neutral, rho=rho, N=N)
            expected = weight_loop(scores, k, S, rho, N, logits=as_logits)
            assert _filled(values, ids, neutral) == expected, (S, rho, N, as_logits)
            picked = len(set(own.flatten().tolist()))
            cap = N if isinstance(N, int) else e if N is None else max(1, int(N * picked + 1e-9))
            assert len(set(ids.flatten().tolist())) <= cap
            assert torch.equal(own, torch.topk(scores, k).indices)
            values, ids, _ = weight_select(scores, k, S, neutral, rho=rho, N=N, valid_rows=valid)
            assert _filled(values, ids, neutral) == weight_loop(scores, k, S, rho, N, logits=as_logits, valid=valid)
        # the router's probabilities given beside the scores rank and weigh exactly as probability scores do
        values, ids, _ = weight_select(logits, k, S, float("-inf"), rho=rho, N=N, probs=logits.softmax(-1))
        assert _filled(values, ids, float("-inf")) == weight_loop(logits, k, S, rho, N, logits=True)


@pytest.mark.parametrize("traced", [False, True])
def test_places_is_the_budget_order_on_both_paths(monkeypatch, traced):
    """The budget's fill order (``_places``): eager by stable sorts, traced by E x E compares (ONNX has
    no stable sort); both are a plain loop's ranks: ``first`` ahead, then descending key, ties (signed
    zeros too) to the lower index; under ``torch.vmap`` as per row."""
    from sere_fx import policies

    if traced:
        monkeypatch.setattr(policies, "eager", lambda t: False)
    g = torch.Generator().manual_seed(3)

    def loop(key, first):
        rank = sorted(range(len(key)), key=lambda i: (not bool(first[i]) if first is not None else 0, -key[i], i))
        return [rank.index(i) for i in range(len(key))]

    for trial in range(60):
        e = 1 + trial % 23
        key = torch.randint(-2, 3, (e,), generator=g).float() if trial % 2 else torch.randn(e, generator=g)
        key = torch.where(key == 0, -0.0 if trial % 4 == 1 else 0.0, key)
        first = torch.rand(e, generator=g) < 0.3 if trial % 3 else None
        assert policies._places(key, first=first).tolist() == loop(key.tolist(), first), (trial, key, first)
    keys, firsts = torch.randint(0, 3, (40, 16), generator=g).float(), torch.rand(40, 16, generator=g) < 0.25
    batched = torch.vmap(lambda k, f: policies._places(k, first=f))(keys, firsts)
    assert batched.tolist() == [loop(k.tolist(), f) for k, f in zip(keys, firsts)]


@pytest.mark.parametrize("seed", range(8))
def test_output_select_matches_loop(seed):
    """``output``: weight's rule with each squared share scaled by the predicted output size."""
    g = torch.Generator().manual_seed(seed)
    t, e, k = 9, 16, 4
    logits = torch.randn(t, e, generator=g) * 2
    predictor = torch.randn(e + 1, e, generator=g)
    valid = torch.rand(t, generator=g) > 0.3
    differs = 0
    for S, rho, N in [(1, None, 5), (2, None, 7), (1, 0.3, None), (1, None, 0.6), (2, 0.25, 0.5), (1, None, 16)]:
        for as_logits in (False, True):
            scores, neutral = (logits, float("-inf")) if as_logits else (logits.softmax(-1), 0.0)
            values, ids, _ = weight_select(scores, k, S, neutral, rho=rho, N=N, predictor=predictor)
            expected = weight_loop(scores, k, S, rho, N, logits=as_logits, predictor=predictor)
            assert _filled(values, ids, neutral) == expected, (S, rho, N, as_logits)
            differs += expected != weight_loop(scores, k, S, rho, N, logits=as_logits)
            values, ids, _ = weight_select(scores, k, S, neutral, rho=rho, N=N, valid_rows=valid, predictor=predictor)
            assert _filled(values, ids, neutral) == weight_loop(scores, k, S, rho, N, logits=as_logits, valid=valid,
                                                                predictor=predictor)
        # the engine's spelling: logits to rank, probabilities for the shares and the predictor's inputs
        values, ids, _ = weight_select(logits, k, S, float("-inf"), rho=rho, N=N, probs=logits.softmax(-1),
                                       predictor=predictor)
        assert _filled(values, ids, float("-inf")) == weight_loop(logits, k, S, rho, N, logits=True,
                                                                  predictor=predictor)
    assert differs  # the predicted sizes change which experts load


def test_output_features_floor_zero_probabilities():
    """A probability of 0 (a masked expert) is the floor, not -inf: the prediction stays finite."""
    from sere_fx.policies import LOG_PROB_FLOOR, output_features, predicted_output_size

    probs = torch.tensor([[0.5, 0.5, 0.0, 0.0]])
    f = output_features(probs, 0.0)
    assert f.tolist()[0] == pytest.approx([math.log(0.5), math.log(0.5), LOG_PROB_FLOOR, LOG_PROB_FLOOR, 1.0])
    assert torch.isfinite(predicted_output_size(f, torch.full((5, 4), 10.0))).all()


def test_output_needs_predictors():
    model = tiny_model("qwen3_moe")
    layers = find_moe_layers(model)
    with pytest.raises(ValueError, match=r"sim: policy 'output' needs the output-size predictors of a similarity "
                                         r"file \(sere-fx calibrate writes them\), got None"):
        sere_fx.transform(model, None, sere_fx.OutputConfig(S=1, N=0.5))
    with pytest.raises(ValueError, match=r"sim: policy 'output' needs an output-size predictor for layer "
                                         r"\d+; this similarity file has none"):
        sere_fx.transform(model, random_similarity(layers), policy="output", S=1, N=0.5)
    assert not sere_fx.is_transformed(model)
    bad = calibration_file(layers)
    bad.predictors[layers[0].index] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"sim.predictors\[\d+\]: expected shape \[\d+, \d+\]"):
        sere_fx.transform(model, bad, policy="output", S=1, N=0.5)


@pytest.mark.parametrize("policy", ["weight", "output"])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_budget_policies_match_loop_reference(family, policy):
    """Through the whole model: the loop's sets, weighted by the family's own formula; ``output``
    with its predictors read from the calibration file."""
    model = tiny_model(family)
    layers = find_moe_layers(model)
    k = layers[0].top_k
    N = 3 if k == 2 else (6 if policy == "weight" else 8)
    rho = 0.5 if policy == "weight" else None
    sim = calibration_file(layers, seed=4) if policy == "output" else None
    reference = copy.deepcopy(model)
    sizes = []
    for layer in layers:
        router = reference.get_submodule(layer.router_name)

        def hook(module, args, output, index=layer.index):
            scores = _selection_scores(module, args[0])
            chosen = weight_loop(scores, k, 1, rho, N, logits=family == "gpt_oss",  # gpt-oss selects on logits
                                 predictor=None if sim is None else sim.predictors[index])
            sizes.append(len({e for c in chosen for e in c}))
            weights, ids = _oea_weights(family, module, args[0], chosen, k)
            return output[0], weights.to(output[1].dtype), ids

        router.register_forward_hook(hook)
    ids = _ids(model, batch=7)
    with torch.no_grad():
        expected = reference(ids).logits
        got = sere_fx.transform(model, sim, S=1, rho=rho, N=N, policy=policy, max_tokens=None)(ids).logits
        original = sere_fx.restore(copy.deepcopy(model))(ids).logits
        as_weight = sere_fx.transform(sere_fx.restore(copy.deepcopy(model)), None, S=1, N=N, policy="weight",
                                      max_tokens=None)(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, original)
    assert max(sizes) <= N
    if policy == "output":
        assert not torch.allclose(got, as_weight)  # the predicted sizes mattered


def test_oea_refuses_routers_that_gather_weights_by_index():
    model = tiny_model("deepseek_v3")
    with pytest.raises(sere_fx.RoutingMatchError, match=r"model.layers.1.mlp.gate: policy 'oea' needs routing weights"):
        sere_fx.transform(model, None, S=2, policy="oea")


@pytest.mark.parametrize("policy", ["sere", "least_similar", "random", "topk", "oea", "weight"])
def test_bypass_and_prefill_routing_are_the_models_own(policy):
    model = tiny_model("qwen3_moe")
    layers = find_moe_layers(model)
    ids = _ids(model, batch=3, length=4)
    with torch.no_grad():
        original = model(ids).logits
        sim = random_similarity(layers) if policy in sere_fx.policies.INDEX_POLICIES else None
        budget = {"N": 4} if policy == "weight" else {}
        sere_fx.transform(model, sim, S=1, policy=policy, max_tokens=None, **budget)
        changed = model(ids).logits
        with sere_fx.bypass():
            bypassed = model(ids).logits
        sere_fx.restore(model)
        sere_fx.transform(model, sim, S=1, policy=policy, max_tokens=11, **budget)  # 12 tokens: prefill
        prefill = model(ids).logits
    assert not torch.equal(changed, original)
    assert torch.equal(bypassed, original) and torch.equal(prefill, original)


def test_per_layer_settings_and_plans(tmp_path):
    model = tiny_model("qwen3_moe")
    layers = find_moe_layers(model)
    sim = random_similarity(layers, seed=2)
    ids = _ids(model, batch=5)
    with torch.no_grad():
        sere_fx.transform(model, sim, policy={0: "sere", 1: "oea"}, S={0: 1, 1: 2},
                          rho={0: sere_fx.Quantile(0.25), 1: None}, max_tokens=None)
        mixed = model(ids).logits
        settings = model.sere_settings
        assert settings.policy == "mixed"
        q = float(torch.quantile(sim[0][~torch.eye(16, dtype=torch.bool)].double(), 0.25))
        assert settings.layers[0] == sere_fx.LayerPlan("sere", 1, q)
        assert settings.layers[1] == sere_fx.LayerPlan("oea", 2, None)
        sere_fx.save_plan(tmp_path / "plan.json", settings.layers, note="test")
        sere_fx.restore(model)
        sere_fx.transform(model, sim, plan=tmp_path / "plan.json", max_tokens=None)
        assert torch.equal(model(ids).logits, mixed)
        sere_fx.restore(model)
        # the same, by hand: layer 0 SERE, layer 1 OEA
        sere_fx.transform(model, sim, policy={0: "sere", 1: "oea"}, S={0: 1, 1: 2}, rho={0: q, 1: None},
                          max_tokens=None)
        assert torch.equal(model(ids).logits, mixed)


@pytest.mark.parametrize(
    "kwargs,exc,message",
    [
        (dict(policy="fast"), ValueError, r"policy: expected one of \['sere', 'least_similar', 'random', 'topk', 'oea', 'weight', 'output', 'prior'\], got 'fast'"),
        (dict(policy={0: "sere", 1: "nope"}), ValueError, r"policy\[1\]: expected one of"),
        (dict(policy="oea", rho=0.5), ValueError, r"rho: policy 'oea' does not use rho \(leave it None\), got 0.5"),
        (dict(S={0: 1}), ValueError, r"S: expected values for the MoE decoder layers \[0, 1\], got layers \[0\]"),
        (dict(S={0: 1, 1: 9}), ValueError, r"S\[1\]: expected an integer in \[1, 4\]"),
        (dict(rho={0: 0.5, 1: float("nan")}), ValueError, r"rho\[1\]: expected a finite float, got nan"),
        (dict(plan={"layers": {}}, S=3), ValueError, r"S: a plan sets it per layer; got S=3 as well"),
        (dict(plan="/nonexistent.json"), FileNotFoundError, r"plan: no plan file at '/nonexistent.json'"),
        (dict(plan={"layers": {"0": {"policy": "sere", "k": 2}}}), ValueError,
         r"plan\[0\]: expected keys policy, S, rho and N, got \['k', 'policy'\]"),
        (dict(policy="weight"), ValueError, r"N: policy 'weight' needs N \(experts per call\), rho \(an importance "
                                            r"threshold\) or both; got neither"),
        (dict(policy="weight", N=0), ValueError, r"N: expected a positive int \(experts per call\), a float in \(0, 1\) "
                                                 r"\(a fraction of the experts the call's tokens picked\) or None, got 0"),
        (dict(policy="weight", N=1.0), ValueError, r"N: expected a positive int .* or None, got 1.0"),
        (dict(policy="weight", rho=-0.1), ValueError, r"rho: expected an importance threshold >= 0 for policy 'weight', got -0.1"),
        (dict(policy="weight", rho=sere_fx.Quantile(0.5)), ValueError, r"rho: policy 'weight' takes an importance threshold"),
        (dict(policy="oea", N=8), ValueError, r"N: only policies \['weight', 'output'\] take an expert budget \(leave it None for 'oea'\), got 8"),
    ],
)
def test_bad_policy_settings(kwargs, exc, message):
    model = tiny_model("qwen3_moe")
    sim = random_similarity(find_moe_layers(model))
    with pytest.raises(exc, match=message):
        sere_fx.transform(model, sim, **kwargs)
    assert not sere_fx.is_transformed(model)


def test_index_policy_without_similarity():
    with pytest.raises(ValueError, match=r"sim: policy 'sere' needs expert-similarity matrices, got None"):
        sere_fx.transform(tiny_model("olmoe"), None)


def test_quantile_validation():
    with pytest.raises(ValueError, match=r"Quantile.q: expected a number in \[0, 1\], got 1.5"):
        sere_fx.Quantile(1.5)


@pytest.mark.parametrize("family,policy", [(f, "sere") for f in ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe",
                                                                  "deepseek_v2", "deepseek_v3"]]
                         + [(f, "oea") for f in ["qwen3_moe", "qwen2_moe", "deepseek_v2"]])  # OEA: weights from values
def test_sparse_experts_implementation_matches_eager(family, policy):
    """``sere_sparse`` (active experts only, duplicate slots merged, weight-0 slots skipped) computes
    what ``eager`` does: SERE duplicates (token, expert) slots, OEA fills slots at weight 0."""
    model = tiny_model(family)
    sim = random_similarity(find_moe_layers(model), seed=6)
    if policy == "sere":
        sere_fx.transform(model, sim, S=1, rho=0.0, max_tokens=None)
    else:
        sere_fx.transform(model, None, S=1, policy="oea", max_tokens=None)
    ids = _ids(model, batch=5, length=3)
    with torch.no_grad():
        expected = model(ids).logits
        model.set_experts_implementation("sere_sparse")
        got = model(ids).logits
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


def test_merged_slots_generate_the_test_beds_tokens():
    """On the test-bed in float32, SERE's re-routing through ``sere_sparse`` (each token's distinct
    experts computed once, weight-0 slots skipped) generates the tokens transformers' own
    ``grouped_mm`` (every slot computed) does."""
    from transformers import AutoModelForCausalLM

    from sere_fx.resources import testbed_model

    model = AutoModelForCausalLM.from_pretrained(testbed_model(), dtype=torch.float32).eval()
    sim = random_similarity(find_moe_layers(model), seed=9)
    prompts = torch.randint(1, model.config.vocab_size, (8, 6), generator=torch.Generator().manual_seed(3))
    outputs = {}
    for implementation in ("grouped_mm", "sere_sparse"):
        sere_fx.transform(model, sim, S=2, rho=0.0, stats=True, experts_implementation=implementation)
        with torch.no_grad():
            outputs[implementation] = model.generate(prompts, max_new_tokens=16, do_sample=False, pad_token_id=0)
        stats = sere_fx.routing_stats(model)
        sere_fx.restore(model)
    assert all(s.slots_after < s.slots_before for s in stats.values())  # there were slots to merge
    assert torch.equal(outputs["sere_sparse"], outputs["grouped_mm"])
