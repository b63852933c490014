"""Prefix reuse in ``tune``'s scorer: a plan that routes its first layers as the model does scores the
same with its forwards started at the first layer it changes, those earlier layers do not run, and the
first layer run hands on the baseline's attention output instead of computing it (where the attention
returns no weights)."""

import numpy as np
import pytest
import torch

from sere_fx.config import OFF, SereConfig, config
from sere_fx.discovery import find_moe_layers
from sere_fx.prefix import PrefixRecord, decoder_stack
from sere_fx.tuning import ModelScorer
from tiny_models import random_similarity, tiny_model


def _windows(seed=0, n=12, length=14):
    return torch.randint(3, 96, (n, length), generator=torch.Generator().manual_seed(seed))


def _scorers(model, sim, **kw):
    args = dict(batch_size=3, prefill=2, max_tokens=None, placement=None, pack=2)
    return ModelScorer(model, sim, **args, reuse_prefix=False, **kw), ModelScorer(model, sim, **args, **kw)


def _same(a, b):
    np.testing.assert_array_equal(a.correct, b.correct)
    np.testing.assert_allclose(a.nll, b.nll, rtol=1e-6, atol=1e-6)
    assert a.distinct == pytest.approx(b.distinct, rel=1e-9)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_a_probe_scores_as_the_whole_forward_and_skips_the_layers_before(family):
    model = tiny_model(family, seed=3)
    layers = find_moe_layers(model)
    sim = random_similarity(layers, seed=1)
    whole, reused = _scorers(model, sim)
    windows = _windows()
    with torch.no_grad():
        _same(whole(None, windows), reused(None, windows))
        stack, position = decoder_stack(model)
        for layer in layers:
            plan = {i.index: SereConfig(S=i.top_k, rho=0.0) for i in layers}
            plan[layer.index] = config("sere", 1, 0.0)
            calls = [0] * len(stack)
            hooks = [stack[p].self_attn.o_proj.register_forward_hook(lambda *a, p=p: calls.__setitem__(p, calls[p] + 1))
                     for p in range(len(stack))]
            try:
                got = reused(plan, windows)
            finally:
                for h in hooks:
                    h.remove()
            _same(whole(plan, windows), got)
            forwards = 2  # 12 windows, 3 x 2 per forward
            # sdpa returns no attention weights: the first layer run replays its attention's output; gpt-oss's
            # eager attention (its sinks) returns weights a hook could read, so it runs
            first = position[layer.index] + (model.config._attn_implementation == "sdpa")
            assert calls == [0] * first + [forwards] * (len(stack) - first)
            assert reused._recorded[0][1].attention_complete == (model.config._attn_implementation == "sdpa")


def test_reuse_needs_the_baselines_windows_and_stops_early_as_the_whole_forward():
    model = tiny_model("olmoe", seed=2)
    layers = find_moe_layers(model)
    sim = random_similarity(layers, seed=4)
    whole, reused = _scorers(model, sim)
    windows, other = _windows(0), _windows(1)
    plan = {layers[0].index: OFF, layers[1].index: config("oea", 1)}
    with torch.no_grad():
        reused(None, windows)
        _same(whole(plan, other), reused(plan, other))  # no record of these windows: the whole forward
        assert reused._baseline(other) is None and reused._baseline(windows.clone()) is not None
        stops = []

        def stop(correct, nll, done):
            stops.append(done)
            return True

        assert reused(plan, windows, stop=stop) is None and stops == [6]


def test_a_record_over_its_bytes_keeps_every_mth_layer():
    model = tiny_model("deepseek_v3", seed=0)  # decoder layers 0 (dense), 1, 2 (MoE)
    rows, length = 8, 10
    assert PrefixRecord(model, rows, length).starts == [1, 2]
    one_layer = rows * length * model.config.hidden_size * 4
    # each start keeps its input and its attention's output, layer 0 its attention's: 5 layers' worth for
    # both starts, 3 for every second one
    assert PrefixRecord(model, rows, length, max_bytes=5 * one_layer).starts == [1, 2]
    thin = PrefixRecord(model, rows, length, max_bytes=3 * one_layer)
    assert thin.starts == [2] and list(thin.attention) == [0, 2]
    thin.complete = True
    assert thin.start_for(1) == 0 and thin.start_for(2) == 2 and thin.start_for(None) == 2
    assert PrefixRecord(model, rows, length).start_for(2) == 0  # nothing recorded yet


def test_a_layer_that_keeps_every_experts_is_scored_off(monkeypatch):
    """S = K (``tune``'s untouched setting) routes as the model does: the scorer runs such a layer off (no
    op call), with the baseline's scores, and only the changed layer gets the op."""
    import sere_fx.tuning as tuning

    model = tiny_model("qwen3_moe", seed=5)
    layers = find_moe_layers(model)
    whole, _ = _scorers(model, random_similarity(layers, seed=2))
    windows = _windows(3)
    untouched = {layer.index: SereConfig(S=layer.top_k, rho=0.0) for layer in layers}
    given = []
    transform = tuning.transform
    monkeypatch.setattr(tuning, "transform", lambda model, sim, plan, **kw: given.append(plan) or transform(model, sim, plan=plan, **kw))
    with torch.no_grad():
        _same(whole(None, windows), whole(untouched, windows))
        whole({**untouched, layers[1].index: config("sere", 1, 0.0)}, windows)
    assert all(c is OFF for c in given[0].values())
    assert given[1][layers[0].index] is OFF and given[1][layers[1].index] == config("sere", 1, 0.0)
