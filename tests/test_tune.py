"""``tune``: the knapsack choice against brute force, and the budget on a tiny model."""

import itertools
import os
import random

import numpy as np
import pytest
import torch

import sere_fx
from sere_fx.discovery import find_moe_layers
from sere_fx.evaluate import decode_scores
from sere_fx.config import Quantile
from sere_fx.plan import LayerPlan
from sere_fx.tuning import Probe, _choose, default_candidates, tune
from tiny_models import random_similarity, tiny_model


@pytest.mark.parametrize("seed", range(25))
def test_choose_matches_brute_force(seed):
    rng = random.Random(seed)
    options = {}
    for layer in range(3):
        options[layer] = [Probe(layer, LayerPlan("sere", 8, 0.0), 0.0, 60.0)] + [
            Probe(layer, LayerPlan("oea", s, None), rng.uniform(-0.002, 0.03), rng.uniform(20, 60)) for s in range(1, 5)
        ]
    budget = rng.uniform(0.0, 0.05)
    picks = _choose(options, budget, resolution=2000)
    best = None
    for combo in itertools.product(*options.values()):
        if sum(max(p.loss, 0) for p in combo) <= budget:
            d = sum(p.distinct for p in combo)
            best = d if best is None else min(best, d)
    got = sum(p.distinct for p in picks.values())
    assert sum(max(p.loss, 0) for p in picks.values()) <= budget * (1 + 1e-9) + budget / 2000 * 3
    assert got <= best + 1e-9 or got == pytest.approx(best, abs=1e-6)


def test_default_candidates():
    cands = default_candidates(8)
    assert ("oea", 4, None) in cands and ("sere", 1, 0.0) in cands and ("weight", 1, None, 0.6) in cands
    assert all(1 <= c[1] < 8 for c in cands)
    assert all(c[1] <= 3 for c in cands if c[0] == "sere")


def _measured(model, sim, windows, scores=decode_scores, placement=None, **settings):
    """Decode scores of ``model`` transformed with ``settings``, measured apart from ``tune``."""
    sere_fx.transform(model, sim, max_tokens=None, **settings)
    try:
        kw = {} if placement is None else {"placement": placement}
        return scores(model, windows, batch_size=6, prefill=2, progress=False, **kw)
    finally:
        sere_fx.restore(model)


@pytest.fixture(scope="module")
def setup():
    model = tiny_model("olmoe", seed=2)
    layers = find_moe_layers(model)
    g = torch.Generator().manual_seed(1)
    windows = torch.randint(3, 96, (12, 8), generator=g)
    return model, random_similarity(layers, seed=4), windows


@pytest.mark.parametrize("max_loss", [0.0, 0.05, 1.0])
def test_tuned_plan_is_within_budget_when_measured_independently(setup, max_loss):
    model, sim, windows = setup
    result = tune(model, sim, windows, max_loss=max_loss, batch_size=6, prefill=2,
                  candidates=[("oea", 1, None), ("oea", 2, None), ("sere", 1, 0.0)], progress=False)
    assert not sere_fx.is_transformed(model)
    base = decode_scores(model, windows, batch_size=6, prefill=2, progress=False)
    s = _measured(model, sim, windows, plan=result.plan)
    loss = s.mean_nll - base.mean_nll
    # tune scores every step in one forward, this measures step by step: equal up to float rounding
    assert loss == pytest.approx(result.loss, abs=1e-6) and loss <= max_loss + 1e-6
    assert s.mean_distinct == pytest.approx(result.distinct)
    if max_loss == 1.0:  # a generous budget buys the cheapest candidates everywhere
        assert result.distinct < result.baseline_distinct * 0.8
    assert len(result.probes) == 2 * 4  # untouched + 3 candidates, per layer
    # never worse than the best uniform setting within budget, measured independently
    for policy, S in (("oea", 1), ("oea", 2)):
        sere_fx.transform(model, None, S=S, policy=policy, max_tokens=None)
        try:
            u = decode_scores(model, windows, batch_size=6, prefill=2, progress=False)
        finally:
            sere_fx.restore(model)
        if u.mean_nll - base.mean_nll <= max_loss:
            assert result.distinct <= u.mean_distinct + 1e-9


def test_bad_arguments(setup):
    model, sim, windows = setup
    with pytest.raises(ValueError, match=r"metric: expected one of \['nll', 'accuracy'\], got 'ppl'"):
        tune(model, sim, windows, metric="ppl")
    with pytest.raises(ValueError, match=r"max_loss: expected a finite number >= 0, got -1"):
        tune(model, sim, windows, max_loss=-1)
    with pytest.raises(ValueError, match=r"candidates: S=9 is outside \[1, 4\]"):
        tune(model, sim, windows, candidates=[("oea", 9, None)], progress=False, batch_size=6, prefill=2)


@pytest.mark.parametrize("seed", range(15))
def test_choose_within_matches_brute_force(seed):
    from sere_fx.tuning import _choose_within

    rng = random.Random(seed)
    options = {layer: [Probe(layer, LayerPlan("sere", 8, 0.0), 0.0, 60.0)] + [
        Probe(layer, LayerPlan("oea", s, None), rng.uniform(-0.002, 0.03), rng.uniform(20, 60)) for s in range(1, 5)
    ] for layer in range(3)}
    budget = rng.uniform(70, 170)
    fits = [c for c in itertools.product(*options.values()) if sum(p.distinct for p in c) <= budget]
    picks = _choose_within(options, budget, resolution=20000)
    if not fits:
        assert picks is None
        return
    best = min(sum(max(p.loss, 0) for p in c) for c in fits)
    assert sum(p.distinct for p in picks.values()) <= budget * (1 + 1e-3)
    assert sum(max(p.loss, 0) for p in picks.values()) == pytest.approx(best, abs=1e-9)


def test_expert_budget_plan_is_within_budget_when_measured_independently(setup):
    model, sim, windows = setup
    cands = [("oea", 1, None), ("oea", 2, None), ("sere", 1, 0.0)]
    result = tune(model, sim, windows, max_experts=0.8, batch_size=6, prefill=2, candidates=cands, progress=False)
    assert result.max_experts == 0.8 and result.max_loss is None
    base = decode_scores(model, windows, batch_size=6, prefill=2, progress=False)
    measured = {}
    for name, kwargs in (("plan", dict(plan=result.plan)), ("oea1", dict(policy="oea", S=1)),
                         ("oea2", dict(policy="oea", S=2))):
        measured[name] = _measured(model, sim if name == "plan" else None, windows, **kwargs)
    s = measured["plan"]
    assert s.mean_distinct <= 0.8 * base.mean_distinct + 1e-9 and s.mean_distinct == pytest.approx(result.distinct)
    assert s.mean_nll - base.mean_nll == pytest.approx(result.loss, abs=1e-6)
    # never worse than a uniform setting that fits the same budget
    for u in (measured["oea1"], measured["oea2"]):
        if u.mean_distinct <= 0.8 * base.mean_distinct:
            assert result.loss <= u.mean_nll - base.mean_nll + 1e-6
    with pytest.raises(ValueError, match=r"max_experts: no plan of these candidates reads at most 0.01 of the "
                                         r"baseline's"):
        tune(model, sim, windows, max_experts=0.01, batch_size=6, prefill=2, candidates=cands[:1], progress=False)
    with pytest.raises(ValueError, match=r"max_experts: give a quality budget \(max_loss\) or an expert budget"):
        tune(model, sim, windows, max_loss=0.1, max_experts=0.5)
    with pytest.raises(ValueError, match=r"max_experts: expected a fraction of the baseline's experts in \(0, 1\], "
                                         r"got 1.5"):
        tune(model, sim, windows, max_experts=1.5)


def test_paired_standard_error_matches_the_bootstrap():
    """The noise bar a per-layer plan must clear over the best uniform plan: one standard error of
    the paired loss difference, checked against the spread of a paired bootstrap."""
    from sere_fx.evaluate import DecodeScores, paired_bootstrap
    from sere_fx.tuning import _paired_se

    rng = np.random.default_rng(0)
    n, tokens = 400, np.full(400, 96)
    base = DecodeScores(rng.integers(20, 40, n), rng.normal(350, 30, n), tokens, {0: 60.0})
    a = DecodeScores(base.correct - rng.integers(0, 3, n), base.nll + rng.normal(2.0, 1.5, n), tokens, {0: 36.0})
    b = DecodeScores(base.correct - rng.integers(0, 4, n), base.nll + rng.normal(2.5, 1.5, n), tokens, {0: 36.0})
    assert _paired_se(base, a, a, "nll") == 0.0
    for metric in ("nll", "accuracy"):
        se = _paired_se(base, a, b, metric)
        # the bootstrap's 95% interval of b against a spans about 3.92 standard errors
        ci = paired_bootstrap(a, b, resamples=4000)["dnll_ci" if metric == "nll" else "retention_ci"]
        width = (ci[1] - ci[0]) * (1 if metric == "nll" else a.accuracy / base.accuracy)
        assert se == pytest.approx(width / 3.92, rel=0.15), metric


def test_expert_parallel_budget_counts_the_busiest_rank(setup):
    from sere_fx import Placement, WeightConfig

    model, sim, windows = setup
    placement = Placement(4)
    cands = [("oea", 1, None), WeightConfig(S=1, rank_budget=0.5, placement=placement)]
    result = tune(model, sim, windows, max_experts=0.7, batch_size=6, prefill=2, candidates=cands, progress=False,
                  placement=placement)
    base = decode_scores(model, windows, batch_size=6, prefill=2, progress=False, placement=placement)
    assert result.placement == placement and result.baseline_distinct == pytest.approx(base.mean_rank_distinct)
    s = _measured(model, None, windows, placement=placement, plan=result.plan)
    # measured independently: the busiest rank reads at most 0.7 of the baseline's busiest rank
    assert s.mean_rank_distinct <= 0.7 * base.mean_rank_distinct + 1e-9
    assert s.mean_rank_distinct == pytest.approx(result.distinct)
    assert "busiest-rank experts/layer (4 EP ranks, linear placement)" in result.summary()
    defaults = default_candidates(8, placement=placement)
    assert WeightConfig(S=1, rank_budget=0.5, placement=placement) in defaults


def test_probes_on_a_subset_of_windows(setup, monkeypatch):
    import sere_fx.tuning as tuning

    model, sim, windows = setup  # 12 windows
    sizes = []
    real = tuning.decode_scores

    def counted(model_, windows_, **kw):
        sizes.append(int(windows_.shape[0]))
        return real(model_, windows_, **kw)

    monkeypatch.setattr(tuning, "decode_scores", counted)
    cands = [("oea", 1, None), ("oea", 2, None)]
    result = tune(model, sim, windows, max_experts=0.8, batch_size=6, prefill=2, candidates=cands, progress=False,
                  probe_sequences=6)
    layers = len(find_moe_layers(model))
    # baseline on all, baseline of the probe windows, one probe per layer and candidate on 6 windows;
    # uniform plans and whole-plan checks on all 12
    assert sizes[:2] == [12, 6] and sizes[2:2 + layers * len(cands)] == [6] * (layers * len(cands))
    assert all(s == 12 for s in sizes[2 + layers * len(cands):])
    base = real(model, windows, batch_size=6, prefill=2, progress=False)
    s = _measured(model, sim, windows, scores=real, plan=result.plan)
    assert s.mean_distinct <= 0.8 * base.mean_distinct + 1e-9 and s.mean_distinct == pytest.approx(result.distinct)
    with pytest.raises(ValueError, match=r"^probe_sequences: expected an int in \[6, 12\] .* got 3$"):
        tune(model, sim, windows, max_experts=0.8, batch_size=6, prefill=2, candidates=cands, probe_sequences=3)


def test_ranges_are_each_tuned_at_their_batch_size(setup, tmp_path):
    """``tune_ranges``: each range's plan, measured apart at its own batch size, is within the budget;
    the plan file holds one range per size; a range the cost model says cannot pay is off."""
    from sere_fx.config import OffConfig, RowRanges
    from sere_fx.plan import load_plan, save_plan
    from sere_fx.tuning import CostModel, tune_ranges

    model, sim, windows = setup
    candidates = [("oea", 1, None), ("sere", 1, 0.0)]
    result = tune_ranges(model, sim, windows, batch_sizes=[1, 6], max_loss=1.0, prefill=2, candidates=candidates,
                         progress=False, cost=CostModel(1.0, 0.0, 0.0))
    assert [(r.min_rows, r.batch_size) for r in result.ranges] == [(1, 1), (6, 6)]
    for r in result.ranges:
        assert r.plan is not None, r.why_off
        base = decode_scores(model, windows, batch_size=r.batch_size, prefill=2, progress=False)
        sere_fx.transform(model, sim, plan=r.plan, max_tokens=None)
        try:
            s = decode_scores(model, windows, batch_size=r.batch_size, prefill=2, progress=False)
        finally:
            sere_fx.restore(model)
        # tune decodes small batches packed into larger forwards: the same routing, float rounding apart
        assert s.mean_nll - base.mean_nll == pytest.approx(r.loss, abs=1e-6) and r.loss <= 1.0
        assert s.mean_distinct == pytest.approx(r.distinct) and r.distinct < r.baseline_distinct
        assert r.predicted_speedup == pytest.approx(r.baseline_distinct / r.distinct)  # experts only
    save_plan(tmp_path / "p.json", result.plan)
    loaded = load_plan(tmp_path / "p.json")
    assert all(isinstance(c, RowRanges) and c.bounds == (1, 6) for c in loaded.values())
    assert {i: c.select(6) for i, c in loaded.items()} == result.ranges[1].plan
    assert "rows" in result.summary() and ">= 6" in result.summary()
    # an op that costs more than any expert it saves: every range is off
    off = tune_ranges(model, sim, windows, batch_sizes=[6], max_loss=1.0, prefill=2, candidates=candidates,
                      progress=False, cost=CostModel(1.0, 0.0, 1000.0))
    assert off.ranges[0].plan is None and "predicted x" in off.ranges[0].why_off
    assert all(isinstance(c, OffConfig) for c in off.plan.values()) or not off.plan
    with pytest.raises(ValueError, match=r"batch_sizes: expected ascending distinct positive ints, got \[6, 1\]"):
        tune_ranges(model, sim, windows, batch_sizes=[6, 1])
    with pytest.raises(ValueError, match=r"batch_sizes: the largest \(24\) is more than the 12 sequences"):
        tune_ranges(model, sim, windows, batch_sizes=[1, 24])


def test_docs_ranges_tune_command_as_typed_but_smaller(tmp_path, capsys, monkeypatch):
    """evaluation.md's `tune --batch-sizes` line on the test-bed, as typed except for its size (4
    sequences of 2 scored steps, batch sizes 1 and 4, three candidates a layer instead of the default
    twenty): the plan holds one range per size."""
    import json
    import shlex

    import doc_pages
    from sere_fx.cli import main
    from sere_fx.resources import testbed_model

    block = doc_pages.block("evaluation.md", "bash", "--batch-sizes 1 8 16 32 64 128")
    argv = shlex.split(block.replace("\\\n", " "))
    assert argv[:2] == ["sere-fx", "tune"]
    monkeypatch.chdir(tmp_path)
    doc_pages.demo_similarity()
    model_dir = testbed_model()
    argv = [a.replace("sere_fx/data/testbed/", os.path.dirname(model_dir) + "/") for a in argv[2:]]
    sizes = argv.index("--batch-sizes")
    argv = argv[:sizes + 1] + ["1", "4"] + argv[sizes + 7:] + ["--num-seqs", "4", "--steps", "2"]
    import sere_fx.tuning

    monkeypatch.setattr(sere_fx.tuning, "default_candidates",
                        lambda *a, **k: [("oea", 2, None), ("sere", 2, 0.0), ("output", 1, None, 0.5)])
    assert main(["tune", *argv]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    plan = json.load(open("plan_ranges.json"))
    assert [r["min_rows"] for r in plan["ranges"]] == [1, 4]
    assert [r["batch_size"] for r in plan["tuned"]["ranges"]] == [1, 4]
    for r in plan["tuned"]["ranges"]:
        assert r["off"] is not None or r["loss"] <= 0.01
    assert "tuned plan that follows the load (accuracy loss <= 0.01 in every range" in out


def test_batch_sizes_alone_tunes_the_default_ranges(tmp_path, capsys, monkeypatch):
    """``--batch-sizes`` with no sizes tunes ``DEFAULT_BATCH_SIZES`` (what the help says), on as many windows
    as the largest size when ``--num-seqs`` is not given (its default, 96, would be too few)."""
    import sere_fx.tuning
    from sere_fx.cli import main
    from sere_fx.resources import testbed_model, testbed_text

    seen = {}

    def fake(model, sim, windows, *, batch_sizes, **kw):
        seen["sizes"], seen["windows"] = list(batch_sizes), windows.shape[0]
        raise sere_fx.ArgumentError("batch_sizes", "batch_sizes: stop here")

    monkeypatch.setattr(sere_fx.tuning, "tune_ranges", fake)
    monkeypatch.chdir(tmp_path)
    import doc_pages

    doc_pages.demo_similarity()
    rc = main(["tune", "--model", testbed_model(), "--sim", "sere-demo/sim.safetensors", "--data", testbed_text(),
               "--steps", "2", "--batch-sizes", "--out", "plan.json"])
    assert rc != 0 and seen["sizes"] == [1, 8, 16, 32, 64, 128] == list(sere_fx.tuning.DEFAULT_BATCH_SIZES)
    assert seen["windows"] == 128
    assert "--batch-sizes: stop here" in capsys.readouterr().err  # the CLI names the option


@pytest.mark.parametrize("extra, message", [
    (["--cost", "1,2,3"], "--cost: only used with --batch-sizes (a plan that follows the load), got --cost without it"),
    (["--min-speedup", "1.1"], "--min-speedup: only used with --batch-sizes"),
    (["--batch-sizes", "1", "8", "--batch-size", "8"], "--batch-size: --batch-sizes tunes each range at its own size"),
    (["--batch-sizes", "1", "8", "--probe-sequences", "8"], "--probe-sequences: not used with --batch-sizes"),
    (["--margin", "-1"], "--margin: expected a number of standard errors >= 0, got -1"),
    (["--margin", "1", "--max-experts", "0.5"], "--margin: applies to the quality budget (--max-loss); got --margin 1 "
                                                "with --max-experts 0.5"),
    (["--batch-sizes", "1", "8", "--engine", "vllm"], "--batch-sizes: plans that follow the load are tuned on the "
                                                      "transformers path"),
])
def test_ranges_options_are_refused_in_one_line(tmp_path, capsys, extra, message):
    from sere_fx.cli import main

    rc = main(["tune", "--model", str(tmp_path), "--sim", "s", "--data", "d", "--out", str(tmp_path / "p.json"), *extra])
    err = capsys.readouterr().err
    assert rc != 0 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "p.json").exists()


def test_cost_option_is_checked_by_the_parser(capsys):
    from sere_fx.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["tune", "--model", "m", "--sim", "s", "--data", "d", "--out", "p", "--cost", "1,2"])
    assert exit_.value.code == 2
    assert "--cost: expected EXPERT_US,SLOT_US,OP_US (three numbers), got '1,2'" in capsys.readouterr().err


def test_early_stopping_keeps_the_exhaustive_choice():
    """Candidates stopped once their loss is out of budget (``STOP_Z`` standard errors over it) leave the
    chosen plan what the exhaustive search chooses, on a small grid of budgets, metrics and candidates
    (the trained test-bed: losses a random model cannot show), while stopping plainly bad candidates."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sere_fx.calibration import read_documents, token_windows
    from sere_fx.resources import testbed_model, testbed_text

    model = AutoModelForCausalLM.from_pretrained(testbed_model(), dtype=torch.float32).eval()
    windows = token_windows(AutoTokenizer.from_pretrained(testbed_model()), read_documents(testbed_text()), 11, 128,
                            token_range=(0, 40000))
    sim = random_similarity(find_moe_layers(model), seed=4)
    cands = [("oea", 1, None), ("sere", 1, 0.0), ("weight", 1, None, 0.5), ("weight", 1, None, 0.8)]
    stopped = 0
    for max_loss, metric in ((0.01, "accuracy"), (0.02, "nll")):
        kw = dict(max_loss=max_loss, metric=metric, batch_size=32, prefill=2, candidates=cands, progress=False,
                  verify_rounds=3)
        fast = tune(model, sim, windows, **kw)
        full = tune(model, sim, windows, early_stop=False, **kw)
        assert fast.plan == full.plan and fast.loss == full.loss, (max_loss, metric)
        assert full.stopped == 0 and fast.passes <= full.passes
        stopped += fast.stopped
    assert stopped > 0, "no candidate was out of budget early on this grid: the test checks nothing"


def test_out_of_budget_rule():
    """``_out_of_budget``: stop only when the loss so far is over the budget by more than STOP_Z standard errors."""
    from sere_fx.evaluate import DecodeScores
    from sere_fx.tuning import STOP_Z, _out_of_budget

    base = DecodeScores(np.full(40, 10), np.full(40, 20.0), np.full(40, 16), {})
    stop = _out_of_budget(base, "accuracy", 0.01)
    assert stop(np.full(20, 10), np.full(20, 20.0), 20) is False  # no loss
    assert stop(np.full(20, 5), np.full(20, 20.0), 20) is True  # half the accuracy, every sequence
    noisy = np.where(np.arange(20) % 2 == 0, 9, 11)  # +-1 per sequence: loss 0, spread wide
    assert stop(noisy, np.full(20, 20.0), 20) is False
    # a loss of 2 budgets (4 of 20 sequences lose a token) whose standard error is about one budget:
    # within STOP_Z of the budget, not stopped
    wide = np.where(np.arange(20) < 4, 9, 10)
    assert STOP_Z > 1.1 and stop(wide, np.full(20, 20.0), 20) is False
    nll = _out_of_budget(base, "nll", 0.01)
    assert nll(np.full(20, 10), np.full(20, 20.0 + 16 * 0.5), 20) is True  # +0.5 nats/token everywhere
    assert nll(np.full(20, 10), np.full(20, 20.0 + 16 * 0.005), 20) is False


def test_a_margin_holds_the_plan_to_its_loss_plus_standard_errors(setup):
    """``margin=Z``: the chosen plan's loss plus Z paired standard errors (measured apart from ``tune``) is
    within the budget, where the plan chosen without a margin may lean on its noise."""
    from sere_fx.tuning import _paired_se

    model, sim, windows = setup
    cands = [("oea", 1, None), ("oea", 2, None), ("sere", 1, 0.0)]
    base = decode_scores(model, windows, batch_size=6, prefill=2, progress=False)
    experts = []
    for margin in (0.0, 1.0, 3.0):
        r = tune(model, sim, windows, max_loss=2e-4, margin=margin, batch_size=6, prefill=2, candidates=cands,
                 progress=False)
        s = _measured(model, sim, windows, plan=r.plan)
        held = (s.mean_nll - base.mean_nll) + margin * _paired_se(base, s, base, "nll")
        assert held <= 2e-4 + 1e-6, (margin, held)
        experts.append(r.distinct)
    # on this model the cheapest plan within the loss alone is not within it by 3 standard errors
    assert experts[0] < experts[2] and experts == sorted(experts), experts
    for bad, message in ((dict(margin=-1.0), "margin: expected a number of standard errors >= 0, got -1.0"),
                         (dict(margin=1.0, max_experts=0.5), "margin: applies to a quality budget")):
        with pytest.raises(sere_fx.ArgumentError, match=message.replace("(", r"\(").replace(")", r"\)")):
            tune(model, sim, windows, batch_size=6, prefill=2, candidates=cands, progress=False, **bad)



@pytest.mark.parametrize("seed", range(3))
def test_nested_settings_read_nested_experts(seed):
    """``_nested``'s claim, on the op and policy functions tune runs: on one input, a setting of a family reads a
    subset of the experts a larger one of the same family reads (OEA by S, SERE by rho at one S, ``weight`` /
    ``output`` by N at one S)."""
    from sere_fx.config import OEAConfig, OutputConfig, SereConfig, WeightConfig
    from sere_fx.ops import reroute_aten
    from sere_fx.policies import oea_select, weight_select
    from sere_fx.tuning import _nested

    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(24, 32, generator=g)
    ids = scores.topk(8, dim=-1).indices
    sim = torch.rand(32, 32, generator=g)
    predictor = torch.rand(33, 32, generator=g)

    def read(c):
        if isinstance(c, OEAConfig):
            return set(oea_select(scores, 8, c.S, float("-inf"))[1].flatten().tolist())
        if isinstance(c, SereConfig):
            return set(reroute_aten(ids, sim, c.S, c.rho).flatten().tolist())
        pred = predictor if isinstance(c, OutputConfig) else None
        return set(weight_select(scores, 8, c.S, float("-inf"), N=c.N, predictor=pred)[1].flatten().tolist())

    families = [[OEAConfig(S=s) for s in (1, 2, 3, 4)],
                [SereConfig(S=1, rho=r) for r in (0.0, 0.3, 0.6, 0.9)],
                [SereConfig(S=2, rho=r) for r in (0.0, 0.9, 0.99)],
                [WeightConfig(S=1, N=n) for n in (0.4, 0.5, 0.7)],
                [OutputConfig(S=1, N=n) for n in (0.4, 0.45, 0.6, 0.8)]]
    for family in families:
        assert len({_nested(c)[0] for c in family}) == 1 and [_nested(c)[1] for c in family] == sorted(
            _nested(c)[1] for c in family)
        sets = [read(c) for c in family]
        assert all(a <= b for a, b in zip(sets, sets[1:])), family
        assert len(sets[0]) < len(sets[-1]), family  # the family's sizes differ on this input
    assert _nested(SereConfig(S=1, rho=Quantile(0.5))) is None  # an unresolved rho: no order known


def test_pruning_keeps_the_exhaustive_choice():
    """Probes inside a family member probed at no loss, and uniform plans whose probes read more than the best
    plan, are skipped (``prune``); the chosen plan and its loss are the exhaustive search's on a small grid of
    budgets and metrics (the trained test-bed)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sere_fx.calibration import read_documents, token_windows
    from sere_fx.resources import testbed_model, testbed_text

    model = AutoModelForCausalLM.from_pretrained(testbed_model(), dtype=torch.float32).eval()
    windows = token_windows(AutoTokenizer.from_pretrained(testbed_model()), read_documents(testbed_text()), 11, 64,
                            token_range=(0, 40000))
    sim = random_similarity(find_moe_layers(model), seed=4)
    cands = [("oea", 1, None), ("oea", 2, None), ("oea", 4, None), ("sere", 1, 0.0), ("sere", 1, Quantile(0.5)),
             ("weight", 1, None, 0.5), ("weight", 1, None, 0.8)]
    skipped = 0
    # batch 1: settings read whole numbers of experts (floor(N x 8)), where plans can tie (the next test makes one)
    for max_loss, metric, batch in ((0.01, "accuracy", 16), (0.03, "nll", 16), (0.01, "accuracy", 1)):
        kw = dict(max_loss=max_loss, metric=metric, batch_size=batch, pack=16 // batch, prefill=2, candidates=cands,
                  progress=False, verify_rounds=3, early_stop=False)
        fast = tune(model, sim, windows, **kw)
        full = tune(model, sim, windows, prune=False, **kw)
        assert fast.plan == full.plan and fast.loss == full.loss and fast.distinct == full.distinct, (max_loss, metric,
                                                                                                      batch)
        assert full.skipped == 0 and fast.rounds == full.rounds and full.passes > fast.passes
        # every probe left out has, on its layer, a probe at no loss that reads no more experts (measured)
        kept = {(p.layer, p.plan): p for p in fast.probes}
        for p in full.probes:
            if (p.layer, p.plan) in kept:
                assert kept[(p.layer, p.plan)].loss == p.loss
            else:
                assert any(q.layer == p.layer and q.loss <= 0 and q.distinct <= p.distinct for q in fast.probes), p
        skipped += fast.skipped
    assert skipped > 0


def test_pruning_keeps_the_exhaustive_tie_break():
    """Plans that read the same experts: the exhaustive search keeps the first in its order (uniform plans before
    the search's rounds). With ``prune`` the uniform plans run after the search, and still win those ties."""
    from sere_fx.config import LayerInfo, OEAConfig
    from sere_fx.evaluate import DecodeScores

    layers = [LayerInfo(i, f"model.layers.{i}.mlp.experts", 16, 8) for i in range(2)]
    # probes (layer, S) -> (loss in nats per token, experts): oea S=1 on both layers sums over the budget
    probes = {(0, 1): (0.003, 4.0), (0, 2): (0.001, 6.0), (1, 1): (0.008, 4.0), (1, 2): (0.001, 6.0)}

    class Scorer:
        def __init__(self):
            self.layers = layers

        def __call__(self, plan, windows, stop=None):
            changed = {} if plan is None else {i: c.S for i, c in plan.items() if isinstance(c, OEAConfig)}
            if not changed:
                loss, distinct = 0.0, {0: 8.0, 1: 8.0}
            elif len(changed) == 1:
                (i, S), = changed.items()
                loss, distinct = probes[(i, S)][0], {j: probes[(i, S)][1] if j == i else 8.0 for j in (0, 1)}
            else:  # whole plans: every one within the budget at 4 experts a layer, a tie
                loss, distinct = 0.005, {0: 4.0, 1: 4.0}
            n = windows.shape[0]
            return DecodeScores(np.full(n, 5), np.full(n, 10.0 * (1 + loss)), np.full(n, 10), distinct)

    sim = random_similarity(layers)
    kw = dict(max_loss=0.01, batch_size=2, candidates=[("oea", 1, None), ("oea", 2, None)], progress=False,
              verify_rounds=3)
    windows = torch.zeros(4, 6, dtype=torch.long)
    full = tune(None, sim, windows, prune=False, scorer=Scorer(), **kw)
    fast = tune(None, sim, windows, scorer=Scorer(), **kw)
    uniform = {0: OEAConfig(S=1), 1: OEAConfig(S=1)}
    assert full.plan == uniform and fast.plan == uniform  # not the search's mixed plan, measured at the same experts
    assert fast.skipped > 0  # uniform oea S=2 (6 experts a layer by its probes) was not run
