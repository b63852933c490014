"""Calibration against a direct float64 computation of the definitions."""

import json
import os

import pytest
import torch
import torch.nn.functional as F

import sere_fx
from sere_fx.calibration import batched, calibrate, read_documents, token_windows
from sere_fx.calibration.expert_outputs import ExpertOutputs
from sere_fx.discovery import find_moe_layers
from tiny_models import tiny_model


def _capture_inputs(model, batch, mask):
    """X per MoE layer (real tokens only), captured by an independent hook."""
    layers = find_moe_layers(model)
    xs, handles = {}, []
    for layer in layers:
        def hook(module, args, index=layer.index):
            xs.setdefault(index, []).append(args[0].reshape(-1, args[0].shape[-1]).detach().clone())
        handles.append(layer.experts.register_forward_pre_hook(hook))
    with torch.no_grad():
        model(input_ids=batch, attention_mask=mask, use_cache=False)
    for h in handles:
        h.remove()
    keep = mask.reshape(-1).bool()
    return {k: torch.cat(v)[keep] for k, v in xs.items()}, layers


def _qwen_expert_outputs_f64(experts, x):
    """Y[e] for fused Qwen3-MoE experts, one expert at a time, in float64."""
    x = x.double()
    out = []
    for e in range(experts.num_experts):
        gate, up = F.linear(x, experts.gate_up_proj[e].double()).chunk(2, dim=-1)
        out.append(F.linear(F.silu(gate) * up, experts.down_proj[e].double()))
    return torch.stack(out)


def _definitions(y, method):
    e = y.shape[0]
    sim = torch.empty(e, e, dtype=torch.float64)
    if method == "frobenius":
        d = torch.tensor([[torch.linalg.norm(y[i] - y[j]).item() for j in range(e)] for i in range(e)], dtype=torch.float64)
        sim = 1 - d / d.max()
    elif method == "cosine":
        for i in range(e):
            for j in range(e):
                sim[i, j] = (F.cosine_similarity(y[i], y[j], dim=-1, eps=1e-30).mean() + 1) / 2
    else:
        yc = y - y.mean(dim=1, keepdim=True)
        for i in range(e):
            for j in range(e):
                num = torch.linalg.norm(yc[j].T @ yc[i]) ** 2
                den = torch.linalg.norm(yc[i].T @ yc[i]) * torch.linalg.norm(yc[j].T @ yc[j])
                sim[i, j] = (num / den).clamp(0, 1)
    return sim.fill_diagonal_(1)


@pytest.fixture(scope="module")
def data():
    model = tiny_model("qwen3_moe", seed=4)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 96, (6, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    mask[4, 7:] = 0  # right padding
    return model, ids, mask


@pytest.mark.parametrize("method", ["frobenius", "cosine", "cka"])
def test_matches_float64_definitions_with_padding_over_batches(data, method):
    model, ids, mask = data
    xs, layers = _capture_inputs(model, ids, mask)
    batches = [{"input_ids": ids[i : i + 2], "attention_mask": mask[i : i + 2]} for i in range(0, 6, 2)]
    sim = calibrate(model, batches, method, progress=False, cka_sample=10_000)
    assert sim.metadata["tokens"] == int(mask.sum()) == 54
    for layer in layers:
        expected = _definitions(_qwen_expert_outputs_f64(layer.experts, xs[layer.index]), method)
        torch.testing.assert_close(sim[layer.index].double(), expected, atol=2e-5, rtol=0)
        assert sim[layer.index].dtype == torch.float32


@pytest.mark.parametrize("method", ["frobenius", "cosine", "cka"])
def test_streaming_equals_one_shot(data, method):
    model, ids, _ = data
    one = calibrate(model, [ids], method, progress=False, cka_sample=10_000)
    many = calibrate(model, list(batched(ids, 1)), method, progress=False, cka_sample=10_000)
    for k in one:
        torch.testing.assert_close(many[k], one[k], atol=1e-6, rtol=0)


def test_cka_sample_bounds_memory_and_is_deterministic(data):
    model, ids, _ = data
    a = calibrate(model, list(batched(ids, 2)), "cka", progress=False, cka_sample=16)
    b = calibrate(model, list(batched(ids, 2)), "cka", progress=False, cka_sample=16)
    full = calibrate(model, [ids], "cka", progress=False, cka_sample=10_000)
    assert a.metadata["cka_sample"] == 16
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.allclose(a[k], full[k]) for k in a)  # a sample really was taken


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3", "qwen2_moe"])
def test_expert_outputs_match_routing_each_token_to_the_expert(family):
    model = tiny_model(family)
    x = torch.randn(7, model.config.hidden_size)
    for layer in find_moe_layers(model):
        outputs = ExpertOutputs(layer.experts, layer.num_experts)
        y = outputs(x)
        for e in (0, layer.num_experts - 1):
            idx = torch.full((7, 1), e)
            ref = layer.experts(x, idx, torch.ones(7, 1))
            torch.testing.assert_close(y[e], ref, atol=1e-5, rtol=1e-5)
        # GPT-OSS fuses its weights in another layout (and has biases): it must not take the fast path
        assert outputs.fused == (family != "gpt_oss")


def test_modulelist_experts():
    from torch import nn

    class Expert(nn.Module):
        def __init__(self, scale):
            super().__init__()
            self.scale = scale

        def forward(self, x):
            return x * self.scale

    experts = nn.ModuleList([Expert(s) for s in (1.0, 2.0, -1.0)])
    y = ExpertOutputs(experts, 3)(torch.ones(2, 4))
    assert y.shape == (3, 2, 4) and y[:, 0, 0].tolist() == [1.0, 2.0, -1.0]


def test_predictors_match_a_float64_ridge_fit(data, tmp_path):
    """Each layer's output-size predictor against an independent fit: the router's log-probabilities
    (floored at -30) and a 1, against log ||expert_e(x)||^2 from float64 expert outputs, ridge
    ``1e-2 * tokens`` on every column but the constant; padding tokens left out."""
    from sere_fx.calibration.predictors import DEFAULT_RIDGE

    model, ids, mask = data
    xs, layers = _capture_inputs(model, ids, mask)
    batches = [{"input_ids": ids[i : i + 2], "attention_mask": mask[i : i + 2]} for i in range(0, 6, 2)]
    sim = calibrate(model, batches, "frobenius", progress=False)
    for layer in layers:
        x = xs[layer.index].double()
        logp = F.linear(x, layer.router.weight.double()).log_softmax(dim=-1).clamp_min(-30.0)
        features = torch.cat([logp, torch.ones(x.shape[0], 1, dtype=torch.float64)], dim=1)
        target = _qwen_expert_outputs_f64(layer.experts, x).square().sum(-1).T.log()
        penalty = torch.eye(features.shape[1], dtype=torch.float64) * DEFAULT_RIDGE * x.shape[0]
        penalty[-1, -1] = 0
        expected = torch.linalg.solve(features.T @ features + penalty, features.T @ target)
        got = sim.predictors[layer.index]
        assert got.shape == (layer.num_experts + 1, layer.num_experts) and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), expected, atol=2e-3, rtol=1e-3)
        # the fit predicts: its sizes rank experts much as the real ones do on these tokens
        fitted = (features @ got.double()).flatten()
        assert torch.corrcoef(torch.stack([fitted, target.flatten()]))[0, 1] > 0.5
    sim.save(tmp_path / "s.safetensors")
    loaded = sere_fx.Similarity.load(tmp_path / "s.safetensors")
    assert sorted(loaded.predictors) == sorted(sim.predictors)
    for i in sim.predictors:
        assert torch.equal(loaded.predictors[i], sim.predictors[i])
    assert calibrate(model, [ids], "frobenius", progress=False, predictors=False).predictors == {}


def test_metadata_and_shape_mismatch(data, tmp_path):
    model, ids, mask = data
    sim = calibrate(model, [ids], "frobenius", progress=False)
    meta = sim.metadata
    assert meta["architecture"] == "Qwen3MoeForCausalLM" and meta["moe_layers"] == [0, 1]
    assert meta["num_experts"] == {"0": 16, "1": 16} and len(meta["weights_fingerprint"]) == 16
    sim.save(tmp_path / "s.safetensors")
    loaded = sere_fx.Similarity.load(tmp_path / "s.safetensors")
    assert loaded.metadata == meta
    with pytest.raises(ValueError, match=r"sim: expected matrices for the MoE decoder layers \[1, 2\], got layers \[0, 1\]"):
        sere_fx.transform(tiny_model("deepseek_v3"), loaded)
    with pytest.raises(ValueError, match=r"sim\[0\]: expected shape \[8, 8\]"):
        sere_fx.transform(tiny_model("mixtral"), loaded)
    # same shapes, other model: allowed, but said
    with pytest.warns(UserWarning, match=r"sim: calibrated on a model with architecture 'Qwen3MoeForCausalLM'"):
        sere_fx.transform(tiny_model("gpt_oss"), loaded)
    with pytest.warns(UserWarning, match=r"weights_fingerprint"):
        sere_fx.transform(tiny_model("qwen3_moe", seed=99), loaded)


def test_bad_arguments(data):
    model, ids, _ = data
    with pytest.raises(ValueError, match=r"method: expected one of \['frobenius', 'cosine', 'cka'\], got 'l2'"):
        calibrate(model, [ids], "l2")
    with pytest.raises(ValueError, match="no calibration tokens"):
        calibrate(model, [], progress=False)
    with pytest.raises(TypeError, match="batches: expected input_ids tensors"):
        calibrate(model, [[1, 2, 3]], progress=False)


def test_data_formats(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    class Tok:
        def __call__(self, text, verbose=False):
            return {"input_ids": [ord(c) for c in text]}

    (tmp_path / "a.txt").write_text("abcdefgh\nxy\nabcdefghij\n")
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "abcdefgh"}) + "\n" + json.dumps({"text": "xy"}) + "\n")
    pq.write_table(pa.table({"text": ["abcdefgh", "xy"]}), tmp_path / "a.parquet")
    assert token_windows(Tok(), read_documents(tmp_path / "a.txt", "line"), 4).tolist() == [
        [97, 98, 99, 100], [101, 102, 103, 104], [97, 98, 99, 100], [101, 102, 103, 104]
    ]
    assert token_windows(Tok(), read_documents(tmp_path / "a.txt", "file"), 4, num_seqs=2).shape == (2, 4)
    for name in ("a.jsonl", "a.parquet"):
        assert token_windows(Tok(), read_documents(tmp_path / name), 4).shape == (2, 4)  # "xy" is too short
    with pytest.raises(ValueError, match="data: expected a file ending in one of"):
        (tmp_path / "a.csv").write_text("x")
        read_documents(tmp_path / "a.csv")
    with pytest.raises(ValueError, match="num_seqs: expected a positive int, got 0"):
        token_windows(Tok(), ["abcdefgh"], 4, num_seqs=0)
    with pytest.raises(ValueError, match="batch_size: expected a positive int, got 0"):
        list(batched(torch.zeros(3, 4), 0))
    with pytest.raises(ValueError, match="no document has more than 100 tokens"):
        token_windows(Tok(), ["abc"], 100)
    # exactly seq_len tokens is not "more than": skipped, and token ranges still count it
    assert token_windows(Tok(), ["abcd", "efghijkl"], 4).tolist() == [[101, 102, 103, 104], [105, 106, 107, 108]]
    assert token_windows(Tok(), ["abcd", "efghijkl"], 4, token_range=(8, None)).tolist() == [[105, 106, 107, 108]]
    # a range that starts past the end of the text says so (not that documents are too short)
    with pytest.raises(ValueError, match="token_range: expected START below the text's 12 tokens, got 40:"):
        token_windows(Tok(), ["abcd", "efghijkl"], 4, token_range=(40, None))


def test_cli_end_to_end_on_testbed(tmp_path, capsys):
    from sere_fx.cli import main
    from sere_fx.resources import testbed_model, testbed_text

    out = tmp_path / "sim.safetensors"
    assert main(["calibrate", "--model", testbed_model(), "--data", testbed_text(),
                 "--num-seqs", "8", "--seq-len", "32", "--batch-size", "4", "--out", str(out)]) == 0
    sim = sere_fx.Similarity.load(out)
    assert sorted(sim) == [0, 1, 2, 3] and sim.metadata["tokens"] == 256 and sim.metadata["seq_len"] == 32
    assert main(["inspect", str(out), "--rho", "0.5", "--plot", str(tmp_path / "plots")]) == 0
    text = capsys.readouterr().out
    assert "critical@0.5" in text and text.count("\n    ") >= 4
    pngs = sorted(os.listdir(tmp_path / "plots"))
    assert pngs == ["layer_0.png", "layer_1.png", "layer_2.png", "layer_3.png", "overview.png"]
    assert all(os.path.getsize(tmp_path / "plots" / p) > 5000 for p in pngs)
