"""Routing configs: one dataclass per policy, the same routing as the keyword spelling, checked
values that name their argument, all-or-nothing ``transform``, and the compile backend's reports."""

import json
import warnings

import pytest
import torch
from torch._dynamo.backends.debugging import aot_eager
from torch._dynamo.utils import counters

import doc_pages

import sere_fx
from sere_fx import LeastSimilarConfig, OEAConfig, Quantile, RandomConfig, SereConfig, TopKConfig, WeightConfig
from sere_fx.compile import SereBackend
from sere_fx.config import Keywords, LayerInfo, plan_for_layers, routing_spec
from sere_fx.discovery import find_moe_layers
from sere_fx.errors import ArgumentError
from sere_fx.passes.matcher import RoutingMatchError
from tiny_models import random_similarity, tiny_model


def _ids(model, batch=6, length=3, seed=0):
    return torch.randint(3, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "config,keywords",
    [
        (SereConfig(S=1, rho=0.0), dict(S=1, rho=0.0)),
        (SereConfig(), dict()),  # the defaults of both spellings: sere, S=2, rho=0.5
        (SereConfig(S=1, rho=Quantile(0.3)), dict(S=1, rho=Quantile(0.3))),
        (LeastSimilarConfig(S=1, rho=0.0), dict(policy="least_similar", S=1, rho=0.0)),
        (OEAConfig(S=1), dict(policy="oea", S=1)),
        (TopKConfig(S=3), dict(policy="topk", S=3)),
        (WeightConfig(S=1, N=0.6), dict(policy="weight", S=1, N=0.6)),
        (WeightConfig(S=1, N=5, min_importance=0.05), dict(policy="weight", S=1, N=5, rho=0.05)),
    ],
)
def test_config_spelling_routes_as_the_keyword_spelling(config, keywords):
    model = tiny_model("qwen3_moe")
    sim = random_similarity(find_moe_layers(model), seed=3)
    ids = _ids(model)
    with torch.no_grad():
        original = model(ids).logits
        sere_fx.transform(model, sim, **keywords, max_tokens=None)
        expected, by_keywords = model(ids).logits, model.sere_settings.layers
        sere_fx.restore(model)
        sere_fx.transform(model, sim, config, max_tokens=None)
        got = model(ids).logits
    assert model.sere_settings.layers == by_keywords
    assert torch.equal(got, expected)
    assert not torch.equal(got, original) or config.S >= 4, "the policy changed nothing"


def test_per_layer_configs_equal_per_layer_keywords():
    model = tiny_model("qwen3_moe")  # MoE decoder layers 0 and 1, top-4 of 16
    sim = random_similarity(find_moe_layers(model), seed=2)
    ids = _ids(model, batch=8)
    with torch.no_grad():
        sere_fx.transform(model, sim, {0: SereConfig(S=1, rho=0.0), 1: OEAConfig(S=2)}, max_tokens=None)
        by_config, layers = model(ids).logits, dict(model.sere_settings.layers)
        sere_fx.restore(model)
        sere_fx.transform(model, sim, policy={0: "sere", 1: "oea"}, S={0: 1, 1: 2}, rho={0: 0.0, 1: None},
                          max_tokens=None)
        by_keywords = model(ids).logits
    assert torch.equal(by_config, by_keywords)
    assert layers == model.sere_settings.layers == {0: SereConfig(S=1, rho=0.0), 1: OEAConfig(S=2)}
    assert model.sere_settings.policy == "mixed"


@pytest.mark.parametrize(
    "build,kind,arg,message",
    [
        (lambda: SereConfig(S=0), ValueError, "S", r"^S: expected an integer >= 1, got 0$"),
        (lambda: OEAConfig(S=2.0), TypeError, "S", r"^S: expected an int, got 2.0 \(float\)$"),
        (lambda: SereConfig(rho=float("nan")), ValueError, "rho", r"^rho: expected a finite float, got nan$"),
        (lambda: RandomConfig(rho="0.5"), TypeError, "rho", r"^rho: expected a finite float, got '0.5' \(str\)$"),
        (lambda: WeightConfig(S=1), ValueError, "N", r"^N: policy 'weight' needs N \(experts per call\), "
                                                     r"min_importance \(an importance threshold\) or both; got neither$"),
        (lambda: WeightConfig(N=1.0), ValueError, "N", r"^N: expected a positive int .* got 1.0$"),
        (lambda: WeightConfig(N=4, min_importance=-1), ValueError, "min_importance",
         r"^min_importance: expected an importance threshold >= 0 for policy 'weight', got -1.0$"),
        (lambda: WeightConfig(N=4, min_importance=Quantile(0.5)), ValueError, "min_importance",
         r"^min_importance: policy 'weight' takes an importance threshold"),
        (lambda: Quantile(2), ValueError, "Quantile.q", r"^Quantile.q: expected a number in \[0, 1\], got 2$"),
    ],
)
def test_configs_check_their_values_and_name_the_argument(build, kind, arg, message):
    with pytest.raises(kind, match=message) as info:
        build()
    assert isinstance(info.value, ArgumentError) and info.value.arg == arg


def test_configs_are_frozen_and_say_what_they_need():
    c = SereConfig(S=1, rho=0.25)
    with pytest.raises(AttributeError):
        c.S = 3
    assert c.needs_similarity and LeastSimilarConfig().needs_similarity and RandomConfig().needs_similarity
    assert not any(cls().needs_similarity for cls in (OEAConfig, TopKConfig)) and not WeightConfig(N=3).needs_similarity
    assert WeightConfig(S=1, N=0.5, min_importance=0.1).rho == 0.1  # the keyword spelling's name for it
    assert c.as_dict() == {"policy": "sere", "S": 1, "rho": 0.25}
    assert WeightConfig(S=1, N=6).as_dict() == {"policy": "weight", "S": 1, "rho": None, "N": 6}
    assert OEAConfig(S=3).as_dict() == {"policy": "oea", "S": 3, "rho": None}


def test_spellings_do_not_mix(tmp_path):
    model = tiny_model("qwen3_moe")
    sim = random_similarity(find_moe_layers(model))
    for kwargs, arg, message in [
        (dict(S=2), "S", r"^S: the config sets it; got S=2 as well$"),
        (dict(rho=0.1), "rho", r"^rho: the config sets it; got rho=0.1 as well$"),
        (dict(plan={"layers": {}}), "plan", r"^plan: give a config or a plan, not both; got both$"),
    ]:
        with pytest.raises(ValueError, match=message) as info:
            sere_fx.transform(model, sim, SereConfig(), **kwargs)
        assert info.value.arg == arg and not sere_fx.is_transformed(model)
    with pytest.raises(ValueError, match=r"^S: given by position \(2\) and by name \(1\); give it once$"):
        sere_fx.transform(model, sim, 2, S=1)
    with pytest.raises(TypeError, match=r"^config\[0\]: expected a RoutingConfig .* got str$"):
        sere_fx.transform(model, sim, {0: "sere", 1: SereConfig()})
    with pytest.raises(ValueError, match=r"^config: expected configs for the MoE decoder layers \[0, 1\], got layers \[0\]$"):
        sere_fx.transform(model, sim, {0: SereConfig()})
    with pytest.raises(ValueError, match=r"^S\[1\]: expected an integer in \[1, 4\] \(top-k of .*\), got 5$"):
        sere_fx.transform(model, sim, {0: SereConfig(), 1: OEAConfig(S=5)})
    assert not sere_fx.is_transformed(model)


def test_plans_hold_configs_and_old_plan_files_still_load(tmp_path):
    plan = {0: SereConfig(S=1, rho=0.125), 1: WeightConfig(S=1, N=0.6, min_importance=0.05), 2: OEAConfig(S=2)}
    sere_fx.save_plan(tmp_path / "p.json", plan, note="x")
    assert sere_fx.load_plan(tmp_path / "p.json") == plan
    # as plan files were written before configs: weight's threshold under "rho", no "N" for the others
    old = {"layers": {"0": {"policy": "sere", "S": 1, "rho": 0.125}, "1": {"policy": "weight", "S": 1, "rho": 0.05, "N": 0.6},
                      "2": {"policy": "oea", "S": 2, "rho": None}}, "tuned": {"metric": "nll"}}
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert sere_fx.load_plan(tmp_path / "old.json") == plan
    (tmp_path / "bad.json").write_text(json.dumps({"layers": {"3": {"policy": "oea", "S": 2, "rho": 0.5}}}))
    with pytest.raises(ValueError, match=r"^plan\[3\]: rho: policy 'oea' does not use rho \(leave it None\), got 0.5$") as info:
        sere_fx.load_plan(tmp_path / "bad.json")
    assert info.value.arg == "plan" and info.value.layer == 3
    (tmp_path / "junk.json").write_text("not json")
    with pytest.raises(ValueError, match=r"^plan: .*junk.json' is not a plan file"):
        sere_fx.load_plan(tmp_path / "junk.json")


def test_keywords_are_checked_without_a_model_and_against_each_layer():
    spec = routing_spec(policy={0: "sere", 3: "weight"}, S=1, N={0: None, 3: 4})
    assert isinstance(spec, Keywords) and spec.policies == {"sere", "weight"}
    layers = [LayerInfo(0, "model.layers.0.mlp", 8, 2), LayerInfo(3, "model.layers.3.mlp", 8, 2)]
    assert plan_for_layers(spec, layers) == {0: SereConfig(S=1), 3: WeightConfig(S=1, N=4)}
    with pytest.raises(ValueError, match=r"^N\[5\]: expected a positive int") as info:
        routing_spec(policy="weight", N={5: 0})
    assert info.value.arg == "N"
    with pytest.raises(ValueError, match=r"^rho: expected an importance threshold >= 0 for policy 'weight', got -1.0$"):
        routing_spec(policy="weight", N=3, rho=-1.0)


def test_transform_installs_nothing_when_a_router_fails(monkeypatch):
    import sere_fx.model_transform as mt

    model = tiny_model("qwen3_moe")
    sim = random_similarity(find_moe_layers(model))
    ids = _ids(model)
    with torch.no_grad():
        original = model(ids).logits
    real = mt._install_forward
    calls = []

    def fail_on_second(router, graph, layer_index):
        calls.append(layer_index)
        if len(calls) == 2:
            raise RuntimeError("install failed")
        real(router, graph, layer_index)

    monkeypatch.setattr(mt, "_install_forward", fail_on_second)
    with pytest.raises(RuntimeError, match="install failed"):
        sere_fx.transform(model, sim, SereConfig(S=1, rho=0.0), max_tokens=None)
    assert calls == [0, 1]  # the first router had been installed, and was taken out again
    assert not sere_fx.is_transformed(model) and not hasattr(model, "sere_settings")
    assert not any(name.endswith("sere_similarity") for name, _ in model.named_buffers())
    with torch.no_grad():
        assert torch.equal(model(ids).logits, original)
    monkeypatch.setattr(mt, "_install_forward", real)
    sere_fx.transform(model, sim, SereConfig(S=1, rho=0.0), max_tokens=None)  # a retry is not "already transformed"
    assert sere_fx.is_transformed(model)


def _compile_and_run(model, backend):
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        return compiled(_ids(model)).logits


def test_compile_backend_reports_routing_it_leaves_alone():
    model = tiny_model("qwen3_moe", experts_implementation="grouped_mm")
    sim = random_similarity(find_moe_layers(model), seed=5)
    only_first = {0: sim[0]}  # layer 1 has no matrix: its routing must not pass unrewritten in silence
    counters.clear()
    backend = SereBackend(only_first, SereConfig(S=1, rho=0.0), inner=aot_eager)
    with pytest.warns(UserWarning, match=r"routing top-k .* of decoder layer 1 \(16 experts\) left as it is: the "
                                         r"settings cover layers \[0\]"):
        _compile_and_run(model, backend)
    assert backend.sites_rewritten == 1 and backend.layers_rewritten == {0}
    assert counters["sere"]["sites_rewritten"] == 1 and counters["sere"]["graphs_rewritten"] == 1
    strict = SereBackend(only_first, SereConfig(S=1, rho=0.0), strict=True, inner=aot_eager)
    with pytest.raises(Exception, match=r"decoder layer 1 .* left as it is") as info:
        _compile_and_run(model, strict)
    assert isinstance(info.value, RoutingMatchError) or isinstance(info.value.__cause__, RoutingMatchError) or \
        "RoutingMatchError" in repr(info.value)
    # a configured layer no graph shows: check() says so
    extra = dict(sim.items()) | {7: torch.eye(16)}
    wide = SereBackend(extra, SereConfig(S=1, rho=0.0), inner=aot_eager)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _compile_and_run(model, wide)  # layers 0 and 1 rewritten: nothing to report yet
    with pytest.warns(UserWarning, match=r"configured MoE decoder layers \[7\] never appeared in a compiled graph"):
        wide.check()


def test_compile_backend_reports_a_graph_whose_top_k_fits_no_matrix():
    model = tiny_model("qwen3_moe", experts_implementation="grouped_mm")
    wrong = {0: torch.eye(8), 1: torch.eye(8)}  # the model has 16 experts per layer
    backend = SereBackend(wrong, SereConfig(S=1, rho=0.0), inner=aot_eager)
    with pytest.warns(UserWarning, match=r"top-ks over \[16\] entries in decoder layers, but none is a routing site "
                                         r"over the similarity's expert counts \[8\]"):
        _compile_and_run(model, backend)
    assert backend.sites_rewritten == 0


def test_readme_config_example_as_written(tmp_path, monkeypatch, capsys):
    import os

    from sere_fx import Similarity

    blocks = [doc_pages.block("transform.md", "python", "# the config spelling")]
    monkeypatch.chdir(tmp_path)
    os.makedirs("sere-demo")
    g = torch.Generator().manual_seed(0)
    Similarity({i: torch.rand(64, 64, generator=g) for i in range(4)}).save("sere-demo/sim.safetensors")  # as the demo writes
    scope = {}
    exec(compile(blocks[0], "docs/transform.md", "exec"), scope)
    model = scope["model"]
    assert model.sere_settings.layers == {0: OEAConfig(S=2), 1: WeightConfig(S=1, N=0.6), 2: TopKConfig(S=4),
                                          3: WeightConfig(S=1, N=24, min_importance=0.05)}
    assert "1: WeightConfig(S=1, N=0.6, min_importance=None" in capsys.readouterr().out


def test_readme_transformers_quick_start_as_written(tmp_path, monkeypatch, capsys):
    """The README's transformers example, with the demo's similarity file (the test's own, calibrated
    on the test-bed as the demo does)."""
    code = doc_pages.block("README.md", "python", "sere_fx.transform(model, \"sere-demo/sim.safetensors\"")
    monkeypatch.chdir(tmp_path)
    doc_pages.demo_similarity()
    scope = {}
    exec(compile(code, "README.md", "exec"), scope)
    stats = sere_fx.routing_stats(scope["model"])
    assert sorted(stats) == [0, 1, 2, 3]
    decode = [s for s in stats.values()]
    assert all(s.calls > 0 and s.distinct_after < s.distinct_before for s in decode)
    assert scope["out"].shape == (3, scope["batch"]["input_ids"].shape[1] + 16)
    assert "'mean_distinct_after'" in capsys.readouterr().out


def test_plans_that_follow_the_load_round_trip_and_refuse_bad_ranges(tmp_path):
    from sere_fx.config import OFF, OffConfig, RowRanges, load_plan
    from sere_fx.plan import plan_dict, save_plan

    ranges = RowRanges(((1, SereConfig(S=2, rho=0.5)), (16, WeightConfig(S=1, N=0.6)), (128, OFF)))
    assert [ranges.select(r) for r in (0, 1, 15, 16, 127, 128, 10**6)] == [
        ranges.configs[0], ranges.configs[0], ranges.configs[0], ranges.configs[1], ranges.configs[1], OFF, OFF]
    plan = {3: ranges, 5: OEAConfig(S=2)}  # a one-setting layer is the same in every range
    save_plan(tmp_path / "p.json", plan)
    data = json.loads((tmp_path / "p.json").read_text())
    assert [r["min_rows"] for r in data["ranges"]] == [1, 16, 128]
    assert data["ranges"][2]["layers"] == {"3": {"policy": "off"}, "5": {"policy": "oea", "S": 2, "rho": None}}
    loaded = load_plan(tmp_path / "p.json")
    assert loaded[3] == ranges and [loaded[5].select(r) for r in (1, 16, 128)] == [OEAConfig(S=2)] * 3
    assert load_plan(plan_dict(loaded)) == loaded
    # a whole range may be "off"; a layer's own entry may carry its ranges (the settings exporters record)
    whole = load_plan({"ranges": [{"min_rows": 1, "layers": {"0": {"policy": "topk", "S": 1, "rho": None}}},
                                  {"min_rows": 8, "layers": "off"}]})
    assert isinstance(whole[0].select(8), OffConfig)
    assert load_plan({"layers": {"3": ranges.as_dict()}})[3] == ranges
    for bad, message in (
        ({"ranges": [{"min_rows": 2, "layers": {"0": {"policy": "off"}}}]}, r"plan\[0\]: ranges: the first range must start at min_rows 1"),
        ({"ranges": [{"min_rows": 1, "layers": {"0": {"policy": "off"}}}, {"min_rows": 1, "layers": "off"}]},
         r"plan\[0\]: ranges: expected min_rows an int > 1 \(ascending\), got 1"),
        ({"ranges": [{"min_rows": 1, "layers": "off"}]}, r"every range is 'off'"),
        ({"ranges": [{"min_rows": 1, "layers": {"0": {"policy": "off"}}}, {"min_rows": 4, "layers": {"1": {"policy": "off"}}}]},
         r"the range at min_rows 4 names layers \[1\], expected \[0\]"),
        ({"ranges": [{"min_rows": 1}]}, r"expected each range to have keys min_rows and layers, got \['min_rows'\]"),
        ({"layers": {"0": {"policy": "off", "S": 2}}}, r"plan\[0\]: policy 'off' takes no settings, got keys \['S', 'policy'\]"),
    ):
        with pytest.raises(ArgumentError, match=message) as err:
            load_plan(bad)
        assert err.value.arg == "plan"
    with pytest.raises(ArgumentError, match=r"ranges: expected \(min_rows, config\) pairs, got 3"):
        RowRanges((3,))
    layer = LayerInfo(0, "model.layers.0.mlp", 8, 2)
    with pytest.raises(ArgumentError, match=r"S \(rows >= 4\): expected an integer in \[1, 2\]"):
        RowRanges(((1, OFF), (4, SereConfig(S=3)))).for_layer(layer)


def test_docs_ranges_example_as_written(tmp_path, monkeypatch):
    import os

    from sere_fx import OFF, OutputConfig, RowRanges, SereConfig
    from tiny_models import calibration_file

    code = doc_pages.block("transform.md", "python", "RowRanges(((1,")
    monkeypatch.chdir(tmp_path)
    os.makedirs("sere-demo")
    calibration_file([LayerInfo(i, f"model.layers.{i}.mlp", 64, 8) for i in range(4)]).save("sere-demo/sim.safetensors")
    scope = {}
    exec(compile(code, "docs/transform.md", "exec"), scope)
    model = scope["model"]
    want = RowRanges(((1, OutputConfig(S=1, N=0.5)), (32, SereConfig(S=2, rho=0.0)), (128, OFF)))
    assert model.sere_settings.layers == dict.fromkeys(range(4), want)
    assert [r["min_rows"] for r in json.load(open("ranges.json"))["ranges"]] == [1, 32, 128]
    assert sere_fx.load_plan("ranges.json") == model.sere_settings.layers
    x = torch.randint(3, 100, (40, 1), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(x[:5])
        model(x)
    assert all(s.range_calls == {1: 1, 32: 1} for s in sere_fx.routing_stats(model).values())
