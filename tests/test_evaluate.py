"""The batched-decode evaluation harness."""

import json
import math

import numpy as np
import pytest
import torch
from torch import nn

import sere_fx
from sere_fx.discovery import find_moe_layers
from sere_fx.evaluate import CachedDecode, PolicySpec, decode_scores, evaluate, paired_bootstrap, parse_policy
from tiny_models import random_similarity, tiny_model


@pytest.fixture(scope="module")
def setup():
    model = tiny_model("qwen3_moe", seed=1)
    g = torch.Generator().manual_seed(0)
    windows = torch.randint(3, 96, (10, 9), generator=g)
    sim = random_similarity(find_moe_layers(model), seed=3)
    return model, windows, sim


def test_cached_decode_scores_equal_a_full_forward(setup):
    model, windows, _ = setup
    prefill = 3
    s = decode_scores(model, windows, batch_size=4, prefill=prefill, progress=False)
    with torch.no_grad():
        logp = torch.log_softmax(model(windows).logits.double(), dim=-1)
    pos = torch.arange(prefill, windows.shape[1] - 1)
    target = windows[:, pos + 1]
    nll = -logp[:, pos].gather(2, target[..., None]).squeeze(-1)
    correct = logp[:, pos].argmax(-1) == target
    assert s.tokens.tolist() == [5] * 10
    np.testing.assert_allclose(s.nll, nll.sum(1).numpy(), rtol=1e-5)
    assert s.correct.tolist() == correct.sum(1).tolist()


def test_distinct_experts_are_what_the_experts_receive(setup):
    model, windows, sim = setup
    layers = find_moe_layers(model)
    seen = {layer.index: [] for layer in layers}
    handles = []
    for layer in layers:
        def hook(module, args, out, index=layer.index):
            seen[index].append(len(set(out[2].flatten().tolist())))
        handles.append(layer.router.register_forward_hook(hook))
    base = decode_scores(model, windows, batch_size=5, prefill=2, progress=False)
    for h in handles:
        h.remove()
    for index, counts in seen.items():
        decode_counts = [c for i, c in enumerate(counts) if i % 7 != 0]  # each batch: 1 prefill + 6 decode calls
        assert base.distinct[index] == pytest.approx(sum(decode_counts) / len(decode_counts))
    sere_fx.transform(model, sim, S=1, rho=0.0, max_tokens=None, stats=True)
    try:
        s = decode_scores(model, windows, batch_size=5, prefill=2, progress=False)
        stats = sere_fx.routing_stats(model)
    finally:
        sere_fx.restore(model)
    for index, st in stats.items():
        assert st.calls == 12 and s.distinct[index] == pytest.approx(st.distinct_after / st.calls)
        assert s.distinct[index] < base.distinct[index]


def test_bootstrap_intervals():
    from sere_fx.evaluate import DecodeScores

    rng = np.random.default_rng(0)
    tokens = np.full(50, 20)
    base = DecodeScores(rng.integers(5, 15, 50), rng.random(50) * 40, tokens, {0: 10.0})
    same = paired_bootstrap(base, base)
    assert same["retention_ci"] == [1.0, 1.0] and same["dnll_ci"] == [0.0, 0.0]
    # one fewer correct token in every sequence, 0.5 nats more per sequence
    other = DecodeScores(base.correct - 1, base.nll + 0.5, tokens, {0: 5.0})
    ci = paired_bootstrap(base, other)
    assert ci["dnll_ci"][0] == pytest.approx(0.025) and ci["dnll_ci"][1] == pytest.approx(0.025)
    point = other.correct.sum() / base.correct.sum()
    assert ci["retention_ci"][0] < point < ci["retention_ci"][1] < 1.0
    assert paired_bootstrap(base, other) == ci  # seeded
    zero = DecodeScores(np.zeros(50, dtype=int), base.nll, tokens, {0: 1.0})
    assert all(math.isnan(v) for v in paired_bootstrap(zero, base)["retention_ci"])


def test_evaluate_report_and_files(setup, tmp_path):
    model, windows, sim = setup
    report = evaluate(model, windows, ["baseline", "sere:S=1,rho=0", "oea:S=1", "topk:S=2"], sim,
                      batch_size=5, prefill=2, progress=False)
    assert not sere_fx.is_transformed(model)
    labels = [r.label for r in report.results]
    assert labels == ["baseline", "sere:S=1,rho=0", "oea:S=1", "topk:S=2"]
    base = report.results[0]
    assert base.dnll == 0.0 and base.dnll_ci == [0.0, 0.0]
    for r in report.results[1:]:
        assert r.dnll_ci[0] <= r.dnll <= r.dnll_ci[1]
        assert r.distinct < base.distinct and math.isclose(r.perplexity, math.exp(r.nll))
    assert report.results[1].settings["layers"]["0"] == {"policy": "sere", "S": 1, "rho": 0.0}
    c = report.compare("sere:S=1,rho=0", "oea:S=1")
    assert c["dnll"] == pytest.approx(report.results[2].nll - report.results[1].nll)
    with pytest.raises(KeyError, match="no policy labelled 'x'"):
        report.compare("x", "oea:S=1")
    paths = report.save(tmp_path)
    data = json.load(open(paths["json"]))
    assert data["config"]["scored_tokens"] == 60 and len(data["results"]) == 4
    assert open(paths["png"], "rb").read(4) == b"\x89PNG"
    assert "retention [95% CI]" in report.table()


@pytest.mark.parametrize(
    "text,expected",
    [
        ("baseline", PolicySpec("baseline", None)),
        ("sere:S=2,rho=0.5", PolicySpec("sere:S=2,rho=0.5", {"policy": "sere", "S": 2, "rho": 0.5})),
        ("sere:S=1,rho=q0.3", PolicySpec("sere:S=1,rho=q0.3", {"policy": "sere", "S": 1, "rho": sere_fx.Quantile(0.3)})),
        ("oea:S=2", PolicySpec("oea:S=2", {"policy": "oea", "S": 2})),
        ("plan:/x/p.json", PolicySpec("plan:p.json", {"plan": "/x/p.json"})),
    ],
)
def test_parse_policy(text, expected):
    assert parse_policy(text) == expected


@pytest.mark.parametrize(
    "text,message",
    [("fast:S=2", r"policy: expected 'baseline', 'plan:PATH' or one of"), ("sere:K=2", r"expected settings S=<int>"),
     ("plan:", r"expected 'plan:PATH'"),
     ("sere:S=2,rho=abc", r"policy: expected rho=a float or q<quantile in \[0, 1\]>, got 'rho=abc' in 'sere:S=2,rho=abc'"),
     ("sere:S=two", r"policy: expected S=an int, got 'S=two' in 'sere:S=two'"),
     ("sere:S=2,rho=q7", r"policy: expected rho=a float or q<quantile in \[0, 1\]>, got 'rho=q7' in 'sere:S=2,rho=q7'")],
)
def test_parse_policy_errors(text, message):
    with pytest.raises(ValueError, match=message):
        parse_policy(text)


def test_eval_needs_similarity_for_sere(setup):
    model, windows, _ = setup
    with pytest.raises(ValueError, match=r"sim: policy 'sere:S=1' needs expert-similarity matrices"):
        evaluate(model, windows, ["sere:S=1"], None, progress=False)
    with pytest.raises(ValueError, match=r"prefill: expected an int in \[1, 7\]"):
        decode_scores(model, windows, prefill=8, progress=False)


def test_batches_are_always_full(setup):
    model, windows, sim = setup  # 10 sequences
    with pytest.raises(ValueError, match=r"batch_size: expected an int in \[1, 10\] \(the number of sequences\), got 32"):
        evaluate(model, windows, ["oea:S=1"], progress=False, batch_size=32)
    report = evaluate(model, windows, ["oea:S=1"], progress=False, batch_size=4, prefill=2)
    assert report.config["sequences"] == 8 and report.config["dropped_sequences"] == 2
    assert report.config["scored_tokens"] == 8 * (windows.shape[1] - 2 - 1)


def test_similarity_is_checked_before_the_baseline_pass(setup, monkeypatch):
    import sere_fx.evaluate as ev

    model, windows, _ = setup

    def no_decoding(*args, **kwargs):
        raise AssertionError("decoded before the similarity was checked")

    monkeypatch.setattr(ev, "decode_scores", no_decoding)
    with pytest.raises(ValueError, match=r"sim: expected matrices for the MoE decoder layers"):
        evaluate(model, windows, ["sere:S=1,rho=0"], {7: torch.eye(16)}, batch_size=5, progress=False)
    with pytest.raises(FileNotFoundError, match="sim: no similarity file at"):
        evaluate(model, windows, ["sere:S=1,rho=0"], "/nonexistent.safetensors", batch_size=5, progress=False)


def test_decode_loop_uses_the_current_cache_argument(setup):
    # transformers renamed past_key_values to cache and warns on the old name: the project's own
    # decode loop must not trigger that warning on any supported version
    import warnings

    model = setup[0]
    windows = torch.randint(3, 90, (2, 8), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        decoder = CachedDecode(model)
        decoder.prefill(windows[:, :4])
        decoder.step(windows[:, 4:5])


def test_pareto_labels_name_the_policy_and_do_not_overlap():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sere_fx.evaluate import _annotate

    # the demo's crowded corner: four settings within half an expert of each other
    points = [(60.0, 1.0, "baseline"), (36.0, 0.970, "sere:S=2,rho=0"), (36.3, 0.980, "oea:S=2"),
              (35.8, 0.9805, "weight:S=1,N=0.6"), (36.1, 0.9702, "topk:S=2"), (50.0, 0.99, "sere:S=2,rho=0.5")]
    fig, ax = plt.subplots(figsize=(7, 5.5))
    ax.scatter([p[0] for p in points], [p[1] for p in points])
    texts = _annotate(ax, points + [(36.2, float("nan"), "nan-retention")])  # not labelled (retention of 0 accuracy)
    fig.canvas.draw()
    from matplotlib.text import Text

    boxes = [Text.get_window_extent(t) for t in texts]  # the label itself, not its line to the point
    assert sorted(t.get_text() for t in texts) == sorted(p[2] for p in points)
    for i in range(len(boxes)):
        for j in range(i):
            assert not boxes[i].overlaps(boxes[j]), (texts[i].get_text(), texts[j].get_text())
    plt.close(fig)


def test_packed_batches_score_as_separate_batches():
    """``decode_scores(pack=P)``: P batches per forward, each routed and counted as its own batch, give
    the scores of decoding them one batch at a time (for batch-aware policies of every kind)."""
    import sere_fx
    from sere_fx.discovery import find_moe_layers
    from sere_fx.evaluate import decode_scores
    from tiny_models import calibration_file, tiny_model

    model = tiny_model("qwen3_moe", experts_implementation="grouped_mm")
    calib = calibration_file(find_moe_layers(model))
    windows = torch.randint(3, 90, (12, 9), generator=torch.Generator().manual_seed(0))
    for config in (sere_fx.SereConfig(S=1, rho=0.0), sere_fx.OutputConfig(S=1, N=0.5), sere_fx.OEAConfig(S=1)):
        sere_fx.transform(model, calib, config, max_tokens=None)
        try:
            for batch, pack in ((1, 12), (3, 2), (3, 4)):
                alone = decode_scores(model, windows, batch_size=batch, prefill=2, progress=False)
                packed = decode_scores(model, windows, batch_size=batch, prefill=2, progress=False, pack=pack)
                assert np.array_equal(alone.correct, packed.correct)
                assert np.allclose(alone.nll, packed.nll, rtol=0, atol=1e-4)
                assert alone.distinct == packed.distinct, (config, batch, pack)
            big = decode_scores(model, windows, batch_size=12, prefill=2, progress=False)
            assert big.distinct[0] > alone.distinct[0], "the packed batches must not be routed as one"
        finally:
            sere_fx.restore(model)


def test_batch_groups_split_rows_as_the_decode_steps_would():
    """``batch_groups(rows, length=L, steps=...)``: each batch is one decode step of a run of ``rows``
    sequences (the last run may be shorter), the other positions are prompt rows; against a plain loop."""
    length, first, stop = 7, 2, 6
    for seqs, rows in ((5, 2), (6, 3), (1, 4), (4, 1)):
        stacks, prompt = sere_fx.batch_groups(rows, length=length, steps=(first, stop)).split(seqs * length)
        got = sorted(tuple(int(i) for i in batch) for stack in stacks for batch in stack)
        want = sorted(tuple(s * length + t for s in range(run, min(run + rows, seqs)))
                      for run in range(0, seqs, rows) for t in range(first, stop))
        assert got == want
        assert sorted(prompt.tolist()) == [s * length + t for s in range(seqs) for t in range(length)
                                           if not first <= t < stop]
        assert len({stack.shape[1] for stack in stacks}) == len(stacks)  # one stack per batch size
    stacks, prompt = sere_fx.batch_groups(3).split(8)
    assert [b.tolist() for s in stacks for b in s] == [[0, 1, 2], [3, 4, 5], [6, 7]] and prompt is None


@pytest.mark.parametrize("kwargs, message", [
    (dict(rows=2, length=7), "steps: give length and steps together"),
    (dict(rows=2, length=7, steps=(5, 9)), "steps: expected (first, stop) with 0 <= first < stop <= length=7"),
    (dict(rows=0), "rows: expected a positive int or None, got 0"),
])
def test_batch_groups_bad_arguments(kwargs, message):
    rows = kwargs.pop("rows")
    with pytest.raises(sere_fx.ArgumentError, match=message.replace("(", r"\(").replace(")", r"\)")):
        sere_fx.batch_groups(rows, **kwargs)


def test_routing_batches_together_equals_one_call_per_batch():
    """Batches of one size are routed in one vmapped call: every policy gives exactly what routing
    each batch on its own gives (the one-by-one path, ``batched=False``), the op's batching rule
    included (rank values, valid and free rows)."""
    from sere_fx import policies
    from sere_fx.ops import reroute_aten, reroute_kernel

    g = torch.Generator().manual_seed(0)
    e, k = 16, 4
    scores = torch.randn(30, e, generator=g)
    sim = torch.rand(e, e, generator=g)
    predictor = torch.randn(e + 1, e, generator=g) * 0.1
    ids = torch.topk(scores, k).indices
    values = torch.rand(30, k, generator=g)  # an unsorted top-k: slots ranked by these
    settings = [dict(policy="oea", S=1), dict(policy="weight", S=1, N=0.5), dict(policy="weight", S=1, rho=0.05),
                dict(policy="output", S=1, N=0.5), dict(policy="topk", S=2)]
    with sere_fx.batch_groups(4, length=6, steps=(1, 5)):
        for setting in settings:
            extra = {"predictor": predictor} if setting["policy"] == "output" else {}

            def route(rows, setting=setting, extra=extra):
                return tuple(policies.select_topk(rows, k, neutral=float("-inf"), **setting, **extra))

            def exact(rows):
                return tuple(torch.topk(rows, k))

            if setting["policy"] == "topk":  # fewer slots than the prompt rows' own top-k
                with pytest.raises(sere_fx.ArgumentError, match="changes the slot count"):
                    policies._route_groups((scores,), route, exact, True)
                continue
            together = policies._route_groups((scores,), route, exact, True)
            alone = policies._route_groups((scores,), route, exact, False)
            assert all(torch.equal(a, b) for a, b in zip(together, alone)), setting
        for S, rho in ((1, 0.0), (2, 0.4)):
            def reroute(rows, vals, S=S, rho=rho):
                return (policies.remap_ids(rows, vals, sim, policy="sere", S=S, rho=rho),)

            together = policies._route_groups((ids, values), reroute, lambda r, v: (r.clone(),), True)
            alone = policies._route_groups((ids, values), reroute, lambda r, v: (r.clone(),), False)
            assert torch.equal(together[0], alone[0]) and not torch.equal(together[0], ids)
    # the op's batching rule with every optional argument (on the CPU: the C kernel over all batches in one
    # call), against one op call per batch and the op's PyTorch implementation per batch
    valid = torch.rand(5, 6, generator=g) > 0.3
    free = torch.rand(5, 6, generator=g) > 0.7
    for dtype in (torch.int64, torch.int32):
        batched = ids.view(5, 6, k).to(dtype)
        out = torch.vmap(lambda i, v, a, f: torch.ops.sere.reroute(i, sim, 2, 0.3, v, a, f))(batched, values.view(5, 6, k),
                                                                                          valid, free)
        assert out.dtype == dtype and not torch.equal(out, batched)
        for b in range(5):
            args = (batched[b], sim, 2, 0.3, values.view(5, 6, k)[b], valid[b], free[b])
            assert torch.equal(out[b], reroute_kernel(*args)) and torch.equal(out[b], reroute_aten(*args))
    # optional tensors shared by every batch (not batched) take the one-call-per-batch path: the same rule
    shared = torch.vmap(lambda i: torch.ops.sere.reroute(i, sim, 1, 0.0, None, valid[0]))(ids.view(5, 6, k))
    for b in range(5):
        assert torch.equal(shared[b], reroute_aten(ids.view(5, 6, k)[b], sim, 1, 0.0, None, valid[0]))


@pytest.mark.parametrize("placement", [None, sere_fx.Placement(4)])
def test_parallel_decode_scores_equal_step_by_step(placement):
    """``decode_scores(parallel=True)`` (every step in one forward of the whole windows) routes, counts
    and scores each decode step as stepping through them with a KV cache does: for batch-aware
    policies of every kind, a plan whose range goes off at larger batches, packed and partial batches."""
    from tiny_models import calibration_file

    model = tiny_model("qwen3_moe", experts_implementation="grouped_mm")
    calib = calibration_file(find_moe_layers(model))
    windows = torch.randint(3, 90, (11, 9), generator=torch.Generator().manual_seed(0))
    ranged = sere_fx.RowRanges(((1, sere_fx.OutputConfig(S=1, N=0.5)), (3, sere_fx.OFF)))
    for config in (sere_fx.SereConfig(S=1, rho=0.0), sere_fx.OutputConfig(S=1, N=0.5), sere_fx.OEAConfig(S=1),
                   sere_fx.WeightConfig(S=1, min_importance=0.05), ranged, None):
        if config is not None:
            sere_fx.transform(model, calib, config, max_tokens=None)
        try:
            for batch, pack in ((1, 4), (2, 1), (4, 2), (11, 1)):
                kw = dict(batch_size=batch, prefill=2, progress=False, placement=placement, pack=pack)
                step = decode_scores(model, windows, **kw)
                whole = decode_scores(model, windows, parallel=True, **kw)
                assert np.array_equal(step.correct, whole.correct), (config, batch)
                assert np.allclose(step.nll, whole.nll, rtol=0, atol=1e-4)
                assert step.distinct == whole.distinct, (config, batch, pack)
                for top1 in (decode_scores(model, windows, nll=False, **kw),  # top-1 only: the same counts
                             decode_scores(model, windows, parallel=True, nll=False, **kw)):
                    assert np.isnan(top1.nll).all() and np.array_equal(top1.correct, step.correct)
                if placement is not None:
                    assert (step.rank_distinct, step.rank_slots) == (whole.rank_distinct, whole.rank_slots)
        finally:
            if config is not None:
                sere_fx.restore(model)


def test_decode_scores_names_a_bad_nll_switch():
    model = tiny_model("qwen3_moe")
    windows = torch.randint(3, 90, (2, 9), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"^nll: expected True or False, got 'no'$"):
        decode_scores(model, windows, batch_size=2, prefill=2, progress=False, nll="no")


@pytest.mark.parametrize("owned", [False, True])
def test_top1_hits_are_argmaxs_with_ties_infinities_and_nans(owned):
    """``top1_hits`` decides from a max what ``argmax == target`` decides, on logits with ties at the
    maximum (before and after the target), +-inf, NaNs (at, before and after the target), and rows of
    -inf only; the logits come back as they were."""
    from sere_fx.evaluate import top1_hits

    g = torch.Generator().manual_seed(0)
    rows, vocab = 400, 12
    logits = torch.round(torch.randn(rows, vocab, generator=g) * 2) / 2  # few distinct values: many ties
    targets = torch.randint(0, vocab, (rows,), generator=g)
    special = torch.rand(rows, vocab, generator=g)
    logits[special < 0.02] = float("nan")
    logits[(special > 0.02) & (special < 0.04)] = float("inf")
    logits[(special > 0.04) & (special < 0.06)] = float("-inf")
    logits[:10] = float("-inf")
    top = logits.nan_to_num(nan=-1e9).amax(-1)
    targets[10:60] = (logits[10:60] == top[10:60, None]).int().argmax(-1)  # the target at the maximum: ties decide
    logits[60:80] = torch.randn(20, vocab, generator=g).clamp(max=2.5)  # finite, below the tie
    logits[60:80, 0] = 3.0  # a tie at the maximum before the target
    targets[60:80] = torch.randint(1, vocab, (20,), generator=g)
    logits[60:80] = logits[60:80].scatter(-1, targets[60:80, None], 3.0)
    expected = logits.argmax(-1) == targets
    assert 0 < int(expected.sum()) < rows and bool(logits[60:80].argmax(-1).eq(0).all())
    before = logits.clone()
    for shape in ((rows, vocab), (20, 20, vocab)):  # [rows, V] and [B, T, V]
        got = top1_hits(logits.view(shape), targets.view(shape[:-1]), owned=owned)
        assert got.dtype == torch.bool and torch.equal(got.flatten(), expected)
    assert torch.equal(logits.isnan(), before.isnan()) and torch.equal(logits.nan_to_num(0), before.nan_to_num(0))


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "gpt_oss"])
def test_parallel_decode_runs_the_experts_in_chunks_with_the_same_scores(family, monkeypatch):
    """The whole-window forward's experts run on at most ``EXPERT_TOKENS`` rows at a time: the same
    scores and counts (one call per layer forward, as routed on the whole call) as in one piece."""
    import sere_fx.evaluate as ev
    from sere_fx.discovery import find_moe_blocks

    model = tiny_model(family, seed=4, experts_implementation="grouped_mm")
    windows = torch.randint(3, 90, (8, 9), generator=torch.Generator().manual_seed(2))
    sere_fx.transform(model, random_similarity(find_moe_layers(model), seed=5), sere_fx.SereConfig(S=1, rho=0.0),
                      max_tokens=None)
    experts = type(find_moe_blocks(model)[0].experts)
    rows = []

    def spy(self, hidden, *args, **kwargs):
        rows.append(hidden.shape[0])
        return whole(self, hidden, *args, **kwargs)

    whole = experts.forward
    monkeypatch.setattr(experts, "forward", spy)
    monkeypatch.setattr(ev, "grouped_mm_per_expert", lambda experts: None)  # the class forward, which the spy sees
    try:
        kw = dict(batch_size=4, prefill=2, progress=False, parallel=True)
        one = decode_scores(model, windows, **kw)
        assert set(rows) == {4 * 8}  # a forward of 4 windows of 9 tokens, the last only a target: one call per layer
        monkeypatch.setattr(ev, "EXPERT_TOKENS", 10)
        rows.clear()
        chunked = decode_scores(model, windows, **kw)
    finally:
        sere_fx.restore(model)
    assert rows and max(rows) <= 10 and sum(rows) == 2 * len(find_moe_blocks(model)) * 4 * 8
    assert np.array_equal(one.correct, chunked.correct)
    assert np.allclose(one.nll, chunked.nll, rtol=0, atol=1e-5)
    assert one.distinct == chunked.distinct


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3"])
def test_grouped_mm_per_expert_is_grouped_mm_bit_for_bit(family):
    """One expert at a time gives transformers' grouped_mm output exactly: single tokens, experts no token
    picked, a token sent twice to one expert (re-routed slots), weights that do not sum to one."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    from sere_fx.discovery import find_moe_blocks
    from sere_fx.kernels.experts_cpu import grouped_mm_per_expert

    model = tiny_model(family, seed=1, experts_implementation="grouped_mm")
    experts = find_moe_blocks(model)[-1].experts
    forward = grouped_mm_per_expert(experts)
    assert forward is not None
    g = torch.Generator().manual_seed(3)
    E, H = experts.gate_up_proj.shape[0], experts.gate_up_proj.shape[-1]
    k = 4 if E >= 16 else 2
    for n in (1, 3, 37, 300):
        hidden = torch.randn(n, H, generator=g)
        index = torch.randint(0, E, (n, k), generator=g)
        index[:, -1] = index[:, 0]  # one expert twice for every token
        if n > 3:
            index[index == 5] = 6  # expert 5 gets no rows
        weight = torch.rand(n, k, generator=g)
        with torch.no_grad():
            assert torch.equal(forward(hidden, index, weight), grouped_mm_experts_forward(experts, hidden, index, weight)), n


def test_grouped_mm_per_expert_applies_only_where_it_is_exact(monkeypatch):
    """None for another implementation or layout; a slot marked "no expert" goes to transformers' forward;
    a first call that differs from transformers' warns and hands every later call to it."""
    import sere_fx.kernels.experts_cpu as kernel
    from sere_fx.discovery import find_moe_blocks

    assert kernel.grouped_mm_per_expert(find_moe_blocks(tiny_model("qwen3_moe"))[0].experts) is None  # eager
    assert kernel.grouped_mm_per_expert(find_moe_blocks(tiny_model("gpt_oss", experts_implementation="grouped_mm"))[0]
                                        .experts) is None  # biased experts
    experts = find_moe_blocks(tiny_model("qwen3_moe", experts_implementation="grouped_mm"))[0].experts
    hidden, weight = torch.randn(5, experts.gate_up_proj.shape[-1]), torch.rand(5, 4)
    index = torch.randint(0, 16, (5, 4), generator=torch.Generator().manual_seed(0))
    calls = []
    original = type(experts).forward

    def reference(self, *args):
        calls.append(args[1].clone())
        return original(self, *args) + 1  # a transformers that computes something else
    monkeypatch.setattr(type(experts), "forward", reference)
    monkeypatch.setattr(kernel, "_SAME_AS_GROUPED_MM", None)
    forward = kernel.grouped_mm_per_expert(experts)
    with torch.no_grad():
        marked = index.clone()
        marked[0, 0] = 16  # "no expert": not this path's to compute, and not a check of it
        forward(hidden, marked, weight)  # (transformers leaves such a slot's row unset: no output to compare)
        assert len(calls) == 1 and torch.equal(calls[0], marked) and kernel._SAME_AS_GROUPED_MM is None
        forward(hidden.double(), index, weight)  # inputs not in the weights' dtype: transformers casts them
        assert len(calls) == 2 and kernel._SAME_AS_GROUPED_MM is None
        with pytest.warns(UserWarning, match="grouped_mm_per_expert"):
            out = forward(hidden, index, weight)
        assert torch.equal(out, original(experts, hidden, index, weight) + 1)
        assert kernel._SAME_AS_GROUPED_MM is False and len(calls) == 3
        assert torch.equal(forward(hidden, index, weight), out) and len(calls) == 4
    assert kernel.grouped_mm_per_expert(experts) is None


def test_parallel_decode_scores_are_the_same_with_experts_one_at_a_time(monkeypatch):
    """``decode_scores`` of a re-routed grouped_mm model: the same sums, to the bit, with and without
    ``grouped_mm_per_expert``."""
    import sere_fx.evaluate as ev

    model = tiny_model("qwen3_moe", seed=2, experts_implementation="grouped_mm")
    windows = torch.randint(3, 90, (8, 12), generator=torch.Generator().manual_seed(4))
    sere_fx.transform(model, random_similarity(find_moe_layers(model), seed=1), sere_fx.SereConfig(S=1, rho=0.2))
    try:
        kw = dict(batch_size=4, prefill=2, progress=False, parallel=True)
        fast = decode_scores(model, windows, **kw)
        monkeypatch.setattr(ev, "grouped_mm_per_expert", lambda experts: None)
        plain = decode_scores(model, windows, **kw)
    finally:
        sere_fx.restore(model)
    assert np.array_equal(fast.nll, plain.nll) and np.array_equal(fast.correct, plain.correct)
    assert fast.distinct == plain.distinct


def _reference_scores(logits: torch.Tensor, targets: torch.Tensor):
    """Per-sequence summed NLL and top-1 hits of ``logits [B, T, V]``, in float64."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    return (-logp.gather(2, targets[..., None]).squeeze(-1).sum(1).numpy(),
            (logp.argmax(-1) == targets).sum(1).numpy())


@pytest.mark.parametrize("family,bias", [("qwen3_moe", False), ("mixtral", False), ("gpt_oss", False), ("qwen3_moe", True)])
def test_whole_window_scores_match_the_models_logits_in_float64(family, bias, monkeypatch):
    """The head run by ``CachedDecode.whole`` in chunks of sequences (here one sequence per chunk) scores what
    the model's own logits score in float64, with or without a bias on the head."""
    import sere_fx.evaluate as ev

    model = tiny_model(family, seed=6)
    if bias:
        old = model.get_output_embeddings()
        head = nn.Linear(old.in_features, old.out_features, bias=True)
        with torch.no_grad():
            head.weight.copy_(old.weight)
            head.bias.normal_(0, 1.0, generator=torch.Generator().manual_seed(8))
        model.lm_head = head
    windows = torch.randint(3, 90, (5, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = _reference_scores(model(windows[:, :-1]).logits[:, 3:], windows[:, 4:])
        for elements in (1, ev.SCORE_ELEMENTS):  # one sequence per chunk; all five in one [rows, H] matmul
            monkeypatch.setattr(ev, "SCORE_ELEMENTS", elements)
            nll, correct = CachedDecode(model).whole(windows[:, :-1], windows[:, 4:])
            np.testing.assert_allclose(nll.numpy(), ref[0], rtol=1e-5)
            assert correct.tolist() == ref[1].tolist()
            nll, correct = CachedDecode(model).whole(windows[:, :-1], windows[:, 4:], nll=False)  # top-1 only
            assert torch.isnan(nll).all() and correct.tolist() == ref[1].tolist()
    assert type(model) not in ev._HEAD_CHANGED


class _ScaledLogits(nn.Module):
    """A causal LM whose forward changes what its output embedding returns (logits / 2)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()

    def forward(self, input_ids, use_cache=False, logits_to_keep=0):
        out = self.inner(input_ids=input_ids, use_cache=use_cache, logits_to_keep=logits_to_keep)
        out.logits = out.logits / 2
        return out


def test_whole_window_scores_a_changed_or_hooked_head_on_the_models_own_logits():
    """Where the model changes its head's output, or the head has a hook, ``whole`` scores the model's own
    logits (here scaled by 1/2, which moves the NLL), not the head's."""
    import sere_fx.evaluate as ev

    inner = tiny_model("qwen3_moe", seed=7)
    windows = torch.randint(3, 90, (4, 9), generator=torch.Generator().manual_seed(5))
    tokens, targets = windows[:, :-1], windows[:, 4:]
    with torch.no_grad():
        ref = _reference_scores(inner(tokens).logits[:, 3:] / 2, targets)
        scaled = _ScaledLogits(inner)
        got = CachedDecode(scaled).whole(tokens, targets)
        assert _ScaledLogits in ev._HEAD_CHANGED
        again = CachedDecode(scaled).whole(tokens, targets)  # remembered: the model's logits at once
        handle = inner.get_output_embeddings().register_forward_hook(lambda m, i, out: out / 2)
        try:
            hooked = CachedDecode(inner).whole(tokens, targets)
        finally:
            handle.remove()
    ev._HEAD_CHANGED.discard(_ScaledLogits)
    for nll, correct in (got, again, hooked):
        np.testing.assert_allclose(nll.numpy(), ref[0], rtol=1e-5)
        assert correct.tolist() == ref[1].tolist()
