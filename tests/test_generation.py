"""Free-running evaluation (``sere-fx eval --generate``, ``sere_fx.generation``)."""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest
import torch

import doc_pages
import sere_fx
from sere_fx.cli import main
from sere_fx.discovery import find_moe_layers
from sere_fx.generation import agreement, edit_similarity, evaluate_generation, generate_batched
from tiny_models import random_similarity, tiny_model


def levenshtein_loop(a, b) -> int:
    d = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] != b[j - 1]))
    return d[-1][-1]


def test_edit_similarity_and_agreement_equal_plain_loops():
    rng = random.Random(0)
    for _ in range(300):
        a = [rng.randrange(4) for _ in range(rng.randrange(0, 12))]
        b = [rng.randrange(4) for _ in range(rng.randrange(0, 12))]
        expected = 1.0 if not a and not b else 1.0 - levenshtein_loop(a, b) / max(len(a), len(b))
        assert edit_similarity(a, b) == pytest.approx(expected)
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert agreement(a, b) == first


@pytest.fixture(scope="module")
def setup():
    model = tiny_model("qwen3_moe", seed=2)
    windows = torch.randint(3, 96, (8, 10), generator=torch.Generator().manual_seed(1))
    return model, windows, random_similarity(find_moe_layers(model), seed=4)


@pytest.mark.parametrize("policy", [None, "sere", "oea"])
def test_batched_generation_is_what_generate_produces(setup, policy):
    """Against transformers' own greedy ``generate`` with a KV cache, batch by batch: with
    ``max_tokens`` = the batch, its prompt forward keeps the model's routing and each decode step
    (one token per sequence) is re-routed, as in ``generate_batched``."""
    model, windows, sim = setup
    batch, prefill, steps = 4, 3, 7
    if policy == "sere":
        sere_fx.transform(model, sim, S=1, rho=0.0, max_tokens=batch, stats=True)
    elif policy == "oea":
        sere_fx.transform(model, None, S=1, policy="oea", max_tokens=batch, stats=True)
    try:
        tokens, distinct = generate_batched(model, windows, batch_size=batch, prefill=prefill, steps=steps,
                                            progress=False)
        expected = torch.cat([model.generate(windows[i:i + batch, :prefill], max_new_tokens=steps, do_sample=False,
                                             min_new_tokens=steps, pad_token_id=0)[:, prefill:]
                              for i in range(0, windows.shape[0], batch)])
        if policy is not None:
            stats = sere_fx.routing_stats(model)
            assert all(s.slots_rerouted > 0 for s in stats.values())
    finally:
        sere_fx.restore(model)
    assert torch.equal(tokens, expected)
    assert sorted(distinct) == [layer.index for layer in find_moe_layers(model)]


def test_report_measures_each_policy_against_the_baseline(setup):
    model, windows, sim = setup
    report = evaluate_generation(model, windows, ["baseline", "sere:S=1,rho=0", "oea:S=1"], sim, batch_size=4,
                                 prefill=3, progress=False)
    assert [r.label for r in report.results] == ["baseline", "sere:S=1,rho=0", "oea:S=1"]
    base = report.results[0]
    steps = windows.shape[1] - 3
    assert report.config["steps"] == steps and base.agreement == steps and base.sim_baseline == 1.0
    assert base.dsim_reference == 0.0
    reference = windows[:, 3:].numpy()
    for r in report.results[1:]:
        tokens, base_tokens = report.tokens[r.label], report.tokens["baseline"]
        agree = [agreement(t, b) for t, b in zip(tokens, base_tokens)]
        assert r.agreement == pytest.approx(np.mean(agree)) and r.agreement_ci[0] <= r.agreement <= r.agreement_ci[1]
        d = [edit_similarity(t, x) - edit_similarity(b, x) for t, b, x in zip(tokens, base_tokens, reference)]
        assert r.dsim_reference == pytest.approx(np.mean(d))
        assert r.distinct < base.distinct
    assert any(report.results[i].agreement < steps for i in (1, 2)), "no policy changed any generated token"
    assert "agree: tokens equal to the baseline's before the first difference" in report.table()


def test_eval_generate_as_documented(tmp_path, capsys, monkeypatch):
    """The documented ``sere-fx eval --generate`` line on the test-bed, as typed except for its size
    (64 sequences of 8 tokens); its mistakes are one line each."""
    from sere_fx.resources import testbed_model, testbed_text

    block = doc_pages.block("evaluation.md", "bash", "sere-fx eval --generate")
    argv = block.replace("\\\n", " ").replace("DIR", testbed_model()).replace("text.txt", testbed_text()).split()[1:]
    monkeypatch.chdir(tmp_path)
    assert main(["calibrate", "--model", testbed_model(), "--data", testbed_text(), "--token-range", "0:40000",
                 "--num-seqs", "16", "--seq-len", "32", "--out", "sim.safetensors"]) == 0
    capsys.readouterr()
    assert main(argv + ["--num-seqs", "64", "--steps", "8"]) == 0
    out = capsys.readouterr().out
    report = json.load(open("generate/generate.json"))
    assert [r["label"] for r in report["results"]] == ["baseline", "sere:S=2,rho=0", "oea:S=2", "weight:S=1,N=0.6"]
    assert report["config"]["prefill"] == 32 and report["config"]["steps"] == 8 and report["config"]["sequences"] == 64
    assert re.search(r"^sere:S=2,rho=0 .*\[.*\]", out, re.M) and "edit similarity to the reference text" in out
    for extra, option in ((["--compare", "baseline", "oea:S=2"], "--compare"), (["--ep-ranks", "4"], "--ep-ranks")):
        rc = main(argv + extra)
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and err[0].startswith(f"sere-fx eval: error: {option}"), err

