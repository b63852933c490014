"""Exporters: pt2, aoti, onnx artifacts match the eager transformed model at two batch sizes."""

import copy
import subprocess
import sys

import pytest
import torch

import doc_pages

import sere_fx
from sere_fx import exporters
from sere_fx.discovery import find_moe_layers
from tiny_models import calibration_file, random_similarity, tiny_model

FAMILIES = ["qwen3_moe", "deepseek_v2"]  # qwen2_moe: the ONNX tests


def _models(family):
    model = tiny_model(family, experts_implementation="grouped_mm")
    sim = random_similarity(find_moe_layers(model), seed=9)
    original = copy.deepcopy(model)
    sere_fx.transform(model, sim, S=1, rho=0.0, max_tokens=None)
    return model, original


def _batches():
    return [torch.randint(3, 90, (b, 6), generator=torch.Generator().manual_seed(b)) for b in (1, 4)]


def _check(run, model, original):
    for ids in _batches():
        with torch.no_grad():
            expected = model(ids, use_cache=False).logits
            untransformed = original(ids, use_cache=False).logits
        got = torch.as_tensor(run(ids))
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
        assert (expected - untransformed).abs().max() > 1e-3, "routing must really differ"


@pytest.mark.parametrize("family", FAMILIES)
def test_pt2(family, tmp_path):
    model, original = _models(family)
    path = exporters.export(model, _batches()[1], tmp_path / "m.pt2", format="pt2")
    ep = torch.export.load(path)
    ops = [n for n in ep.graph.nodes if n.target == torch.ops.sere.reroute.default]
    assert len(ops) == len(find_moe_layers(original)), "sere.reroute stays one node per layer"
    sims = [s for s in ep.graph_signature.buffers_to_mutate.values()] + list(ep.state_dict)
    assert sum("sere_similarity" in s for s in sims) == len(ops)
    _check(lambda ids: ep.module()(ids), model, original)
    settings = exporters.read_settings(path)
    assert settings["sere_fx"] and settings["policy"] == "sere" and settings["layers"]["1"]["S"] == 1
    assert settings["similarity_fingerprint"] == model.sere_settings.similarity_fingerprint
    if family != "qwen3_moe":
        return
    # as the README says: a fresh process loads it after `import sere_fx`
    ids = _batches()[1]
    torch.save(ids, tmp_path / "ids.pt")
    code = (f"import torch, sere_fx; ids = torch.load({str(tmp_path / 'ids.pt')!r}); "
            f"torch.save(torch.export.load({str(path)!r}).module()(ids), {str(tmp_path / 'out.pt')!r})")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(torch.load(tmp_path / "out.pt"), model(ids, use_cache=False).logits, atol=1e-4,
                                   rtol=0)


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])  # qwen3_moe: the README test and the settings tests
def test_onnx_runs_in_plain_onnxruntime(family, tmp_path):
    import onnx
    import onnxruntime as ort

    model, original = _models(family)
    path = exporters.export(model, _batches()[1], tmp_path / "m.onnx", format="onnx")
    graph_ops = {n.op_type for n in onnx.load(path).graph.node}
    assert all(n.domain in ("", "ai.onnx") for n in onnx.load(path).graph.node), "standard ONNX ops only"
    assert {"ArgMax", "GatherElements"} & graph_ops or "ArgMax" in graph_ops
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    assert [i.name for i in sess.get_inputs()] == ["input_ids"] and [o.name for o in sess.get_outputs()] == ["logits"]
    _check(lambda ids: sess.run(["logits"], {"input_ids": ids.numpy()})[0], model, original)
    assert exporters.read_settings(path)["layers"]["0"] == {"policy": "sere", "S": 1, "rho": 0.0}
    # the experts implementation used for export was put back
    assert model.config._experts_implementation == "grouped_mm"


def test_onnx_refuses_complex_models_clearly(tmp_path):
    model, _ = _models("deepseek_v2")  # complex-valued rotary embeddings
    with pytest.raises(ValueError, match=r"model: computes in complex numbers .* Export it as 'pt2' or 'aoti'"):
        exporters.export(model, _batches()[1], tmp_path / "m.onnx", format="onnx")


def test_plain_export_of_an_untransformed_model(tmp_path):
    model = tiny_model("qwen3_moe", experts_implementation="grouped_mm")
    path = exporters.export(model, {"input_ids": _batches()[0]}, tmp_path / "plain.pt2")
    ep = torch.export.load(path)
    assert not any(n.target == torch.ops.sere.reroute.default for n in ep.graph.nodes)
    ids = _batches()[1]
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(ids), model(ids, use_cache=False).logits, atol=1e-5, rtol=0)
    assert exporters.read_settings(path) == {"sere_fx": False}


def test_export_errors(tmp_path):
    model = tiny_model("qwen3_moe", experts_implementation="grouped_mm")
    ids = _batches()[0]
    with pytest.raises(ValueError, match=r"format: expected one of \['pt2', 'aoti', 'onnx', 'tensorrt'\], got 'tflite'"):
        exporters.export(model, ids, tmp_path / "x", format="tflite")
    sere_fx.transform(model, random_similarity(find_moe_layers(model)), S=1, policy="topk")
    with pytest.raises(ValueError, match=r"max_tokens: policy 'topk' \(layers \[0, 1\]\) changes the number of routed "
                                         r"slots.* \(max_tokens=None\), got 256"):
        exporters.export(model, ids, tmp_path / "x.pt2")
    eager = tiny_model("olmoe", experts_implementation="eager")
    with pytest.raises(ValueError, match=r"model: the 'eager' experts implementation .* cannot be exported"):
        exporters.export(eager, ids, tmp_path / "x.pt2")
    with pytest.raises(TypeError, match=r"example_inputs: expected a tensor"):
        exporters.export(eager, "ids", tmp_path / "x.pt2")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA failure")
def test_tensorrt_fails_fast_without_cuda(tmp_path):
    model = tiny_model("qwen3_moe", experts_implementation="grouped_mm")
    with pytest.raises(RuntimeError, match=r"format 'tensorrt': needs a CUDA device; this machine has none"):
        exporters.export(model, _batches()[0], tmp_path / "m.ts", format="tensorrt")


def _settings_model(case):
    """A transformed tiny Qwen3-MoE with each kind of setting an artifact must carry."""
    model = tiny_model("qwen3_moe", experts_implementation="grouped_mm")
    layers = find_moe_layers(model)
    sim = calibration_file(layers, seed=9)
    kwargs = {
        "quantile": dict(S=1, rho=sere_fx.Quantile(0.5)),
        "mixed plan": dict(plan={"layers": {"0": {"policy": "sere", "S": 1, "rho": 0.4},
                                            "1": {"policy": "oea", "S": 2, "rho": None}}}),
        "topk": dict(policy="topk", S=2),
        "weight": dict(policy="weight", S=1, rho=0.5, N=0.5),  # a fraction: decided per call, in the graph
        "output": dict(policy="output", S=1, N=0.5),  # its predictor: a buffer of the graph
    }[case]
    return sere_fx.transform(model, sim, max_tokens=None, **kwargs)


# a fixed rho and OEA: the mixed plan's two layers
@pytest.mark.parametrize("case", ["quantile", "mixed plan", "topk", "weight", "output"])
def test_onnx_carries_every_kind_of_setting(case, tmp_path):
    import onnxruntime as ort

    model = _settings_model(case)
    ids = _batches()[1]
    path = exporters.export(model, ids, tmp_path / "m.onnx", format="onnx")
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
    got = torch.as_tensor(sess.run(None, {sess.get_inputs()[0].name: ids.numpy()})[0])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_pt2_carries_the_output_policy(tmp_path):
    model = _settings_model("output")
    ids = _batches()[1]
    path = exporters.export(model, ids, tmp_path / "m.pt2", format="pt2")
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
        as_weight = sere_fx.transform(sere_fx.restore(copy.deepcopy(model)), None, policy="weight", S=1, N=0.5,
                                      max_tokens=None)(ids, use_cache=False).logits
        torch.testing.assert_close(torch.export.load(path).module()(ids), expected, atol=1e-4, rtol=0)
    assert not torch.allclose(expected, as_weight, atol=1e-4)  # the artifact carries the predictor


def test_decomposed_op_with_a_critical_threshold(tmp_path):
    # rho > 0 used to build a tensor from the Python float inside the decomposition, which
    # made the decomposed graph non-functional (lift_fresh_copy + detach_); the mixed plan's
    # layer 0 has rho 0.4
    model = _settings_model("mixed plan")
    ids = _batches()[1]
    path = exporters.export(model, ids, tmp_path / "m.pt2", format="pt2")
    ep = torch.export.load(path).run_decompositions(sere_fx.ops.decompositions())
    assert not any(n.target == torch.ops.sere.reroute.default for n in ep.graph.nodes)
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(ids), model(ids, use_cache=False).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("format", ["pt2", "onnx"])  # aoti: the README test below
def test_prefill_branch_survives_export(format, tmp_path):
    # transform's default keeps a token-count branch: the artifact must decide per call as the
    # eager model does (6 tokens: re-routed; 24 tokens > max_tokens: the model's own routing)
    model = tiny_model("qwen3_moe", experts_implementation="grouped_mm")
    original = copy.deepcopy(model)
    sere_fx.transform(model, random_similarity(find_moe_layers(model), seed=9), S=1, max_tokens=10)
    small, large = _batches()
    path = exporters.export(model, large, tmp_path / f"m.{'onnx' if format == 'onnx' else 'pt2'}", format=format)
    if format == "pt2":
        ep = torch.export.load(path)
        assert sum(n.target == torch.ops.higher_order.cond for n in ep.graph.nodes) == 2, "one branch per MoE layer"
        run = ep.module()
    elif format == "aoti":
        run = torch._inductor.aoti_load_package(path)
    else:
        import onnx
        import onnxruntime as ort

        assert [n.op_type for n in onnx.load(path).graph.node].count("If") == 2
        sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        run = lambda ids: torch.as_tensor(sess.run(None, {"input_ids": ids.numpy()})[0])  # noqa: E731
    with torch.no_grad():
        for ids, rerouted in ((small, True), (large, False)):
            expected, plain = model(ids, use_cache=False).logits, original(ids, use_cache=False).logits
            assert ((expected - plain).abs().max() > 1e-3) == rerouted
            torch.testing.assert_close(torch.as_tensor(run(ids)), expected, atol=1e-4, rtol=0)
    assert exporters.read_settings(path)["max_tokens"] == 10


def _load_artifact(path: str, format: str):
    if format == "pt2":
        return torch.export.load(path).module()
    if format == "aoti":
        return torch._inductor.aoti_load_package(path)
    import onnxruntime as ort

    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return lambda ids: torch.as_tensor(sess.run(None, {"input_ids": ids.numpy()})[0])


def test_readme_export_commands_on_the_testbed(tmp_path, monkeypatch, capsys):
    """Every `sere-fx export` line of the README, as typed (defaults: S=2, rho=0.5, max_tokens=256)."""
    import re

    from transformers import AutoModelForCausalLM

    from sere_fx.calibration import calibrate
    from sere_fx.cli import main
    from sere_fx.resources import testbed_model

    commands = re.findall(r"`(sere-fx export --model DIR --sim sim\.safetensors --format (\w+) --out (\S+))`",
                          doc_pages.page("deployment.md"))
    assert [c[1] for c in commands] == ["pt2", "aoti", "onnx", "tensorrt"]
    model = AutoModelForCausalLM.from_pretrained(testbed_model(), dtype=torch.float32).eval()  # as the CLI loads it
    monkeypatch.chdir(tmp_path)
    text = torch.randint(0, model.config.vocab_size, (8, 32), generator=torch.Generator().manual_seed(0))
    calibrate(model, [text[:4], text[4:]]).save("sim.safetensors")
    eager = sere_fx.transform(copy.deepcopy(model), "sim.safetensors", S=2, rho=0.5)
    decode, prefill = (torch.randint(0, model.config.vocab_size, (b, 1), generator=torch.Generator().manual_seed(b))
                       for b in (8, 300))  # 8 tokens: re-routed; 300 > 256: the model's own routing
    for command, format, out in commands:
        argv = command.replace("DIR", testbed_model()).split()[1:]
        rc, err = main(argv), capsys.readouterr().err
        if format == "tensorrt":
            assert rc == 2 and err.strip().endswith("sere-fx export: error: format 'tensorrt': needs a CUDA device; "
                                                    "this machine has none") or torch.cuda.is_available(), err
            continue
        assert rc == 0, err
        run = _load_artifact(out, format)
        with torch.no_grad():
            for ids, rerouted in ((decode, True), (prefill, False)):
                expected, plain = eager(ids, use_cache=False).logits, model(ids, use_cache=False).logits
                assert ((expected - plain).abs().max() > 1e-3) == rerouted
                torch.testing.assert_close(run(ids), expected, atol=2e-4, rtol=0)
        assert exporters.read_settings(out)["max_tokens"] == 256
        if format == "aoti":
            # the package runs in a process that never imports sere_fx (transformers' grouped_mm
            # experts need their custom op, registered by transformers.integrations.moe)
            torch.save(decode, "ids.pt")
            code = ("import sys, torch, transformers.integrations.moe; "
                    f"out = torch._inductor.aoti_load_package({out!r})(torch.load('ids.pt')); "
                    "assert 'sere_fx' not in sys.modules; torch.save(out, 'out.pt')")
            subprocess.run([sys.executable, "-c", code], check=True)
            with torch.no_grad():
                torch.testing.assert_close(torch.load("out.pt"), eager(decode, use_cache=False).logits, atol=2e-4, rtol=0)
