"""Bad inputs to ``transform`` raise errors naming the argument, the expected and the actual value."""

import math

import pytest
import torch

import sere_fx
from sere_fx import Similarity
from sere_fx.discovery import find_moe_layers
from tiny_models import random_similarity, tiny_model


@pytest.fixture(scope="module")
def setup():
    model = tiny_model("qwen3_moe")  # 2 MoE layers, 16 experts, top-4
    layers = find_moe_layers(model)
    return model, layers, random_similarity(layers)


@pytest.mark.parametrize(
    "kwargs,exc,message",
    [
        (dict(S=0), ValueError, r"S: expected an integer in \[1, 4\] \(top-k of model.layers.0.mlp\), got 0"),
        (dict(S=5), ValueError, r"S: expected an integer in \[1, 4\] .* got 5"),
        (dict(S=2.0), TypeError, r"S: expected an int, got 2.0 \(float\)"),
        (dict(S=True), TypeError, r"S: expected an int, got True"),
        (dict(rho=math.nan), ValueError, r"rho: expected a finite float, got nan"),
        (dict(rho=math.inf), ValueError, r"rho: expected a finite float, got inf"),
        (dict(rho="0.5"), TypeError, r"rho: expected a finite float, got '0.5' \(str\)"),
        (dict(max_tokens=0), ValueError, r"max_tokens: expected a positive int or None, got 0"),
    ],
)
def test_bad_settings(setup, kwargs, exc, message):
    model, layers, sim = setup
    args = dict(S=2, rho=0.5) | kwargs
    with pytest.raises(exc, match=message):
        sere_fx.transform(model, sim, **args)
    assert not sere_fx.is_transformed(model)


def _bad(sim, **changes):
    out = dict(sim)
    out.update(changes)
    return out


@pytest.mark.parametrize(
    "make,exc,message",
    [
        (lambda s: [s[0]], ValueError, r"sim: expected 2 matrices \(one per MoE layer, decoder layers \[0, 1\]\), got 1"),
        (lambda s: {0: s[0]}, ValueError, r"sim: expected matrices for the MoE decoder layers \[0, 1\], got layers \[0\]"),
        (lambda s: {0: s[0], 3: s[1]}, ValueError, r"got layers \[0, 3\]"),
        (lambda s: _bad(s, **{}) | {1: torch.rand(8, 8)}, ValueError,
         r"sim\[1\]: expected shape \[16, 16\] \(experts of model.layers.1.mlp\), got \[8, 8\]"),
        (lambda s: s | {0: s[0].clone().index_put_((torch.tensor(2), torch.tensor(3)), torch.tensor(math.nan))},
         ValueError, r"sim\[0\]: expected finite values, got nan at \[2, 3\] \(1 non-finite entries\)"),
        (lambda s: s | {1: s[1] * math.inf}, ValueError, r"sim\[1\]: expected finite values"),
        (lambda s: s | {0: torch.ones(16, 16, dtype=torch.int64)}, TypeError, r"sim\[0\]: expected a floating-point"),
        (lambda s: {"0": s[0], "1": s[1]}, TypeError, r"sim: mapping keys must be decoder-layer indices \(int\), got '0'"),
        (lambda s: {0: s[0].numpy(), 1: s[1]}, TypeError, r"sim\[0\]: expected a torch.Tensor, got ndarray"),
        (lambda s: 0.5, TypeError, r"sim: expected a Similarity, a path .* got float"),
        (lambda s: "/nonexistent/sim.safetensors", FileNotFoundError, r"sim: no similarity file at '/nonexistent"),
    ],
)
def test_bad_similarity(setup, make, exc, message):
    model, layers, sim = setup
    with pytest.raises(exc, match=message):
        sere_fx.transform(model, make(sim), S=2)
    assert not sere_fx.is_transformed(model)


def test_similarity_file_round_trip_and_every_accepted_form(setup, tmp_path):
    model, layers, sim = setup
    path = tmp_path / "sim.safetensors"
    Similarity(sim, {"method": "frobenius"}).save(path)
    loaded = Similarity.load(path)
    assert loaded.metadata == {"method": "frobenius"} and sorted(loaded) == [0, 1]
    assert all(torch.equal(loaded[k], sim[k]) for k in sim)
    ids = torch.randint(3, 90, (4, 3))
    outputs = []
    for form in (sim, [sim[0], sim[1]], loaded, str(path), path):
        m = tiny_model("qwen3_moe")
        sere_fx.transform(m, form, S=1, rho=0.0)
        with torch.no_grad():
            outputs.append(m(ids).logits)
    assert all(torch.equal(o, outputs[0]) for o in outputs)


def test_similarity_file_with_foreign_keys(tmp_path):
    from safetensors.torch import save_file

    save_file({"weights": torch.rand(2, 2)}, str(tmp_path / "x.safetensors"))
    with pytest.raises(ValueError, match=r"has tensor 'weights'; expected keys 'layer.<decoder layer index>'"):
        Similarity.load(tmp_path / "x.safetensors")


def test_similarity_files_get_the_users_umask(setup, tmp_path):
    # every other output is 0644 under the usual umask; a server running as another user reads the file
    import os

    old = os.umask(0o022)
    try:
        Similarity(setup[2]).save(tmp_path / "sim.safetensors")
        os.umask(0o077)
        Similarity(setup[2]).save(tmp_path / "private.safetensors")
    finally:
        os.umask(old)
    assert oct(os.stat(tmp_path / "sim.safetensors").st_mode & 0o777) == oct(0o644)
    assert oct(os.stat(tmp_path / "private.safetensors").st_mode & 0o777) == oct(0o600)
    assert sorted(Similarity.load(tmp_path / "sim.safetensors")) == sorted(setup[2])
