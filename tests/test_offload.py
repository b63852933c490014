"""Offloaded experts (sere_fx.expert_store, sere_fx.expert_cache): the store, the LRU cache against a
plain simulation, the model's outputs against the model as loaded, cache-aware routing against
plain-loop references, and the refusals of what cannot carry an offloaded model."""

from __future__ import annotations

import json
import os

import pytest
import torch

import doc_pages
from reference import _remap_loop
from tiny_models import random_similarity, tiny_model

import sere_fx
from sere_fx.discovery import find_moe_layers
from sere_fx.errors import ArgumentError
from sere_fx.expert_cache import cache_size, cache_stats, counting, offload, reset_caches
from sere_fx.expert_store import ALIGN, open_disk_store
from sere_fx.policies import prior_select, reroute_free, weight_select


def _experts(e=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(e, 10, 7, generator=g), torch.randn(e, 7, 5, generator=g))


def test_store_fetches_every_expert_as_written(tmp_path):
    tensors = _experts()
    store = open_disk_store(str(tmp_path), "layer0", tensors)
    assert os.path.getsize(store.path) % ALIGN == 0
    for e in range(6):
        out = (torch.empty(10, 7), torch.empty(7, 5))
        store.fetch(e, out)
        assert torch.equal(out[0], tensors[0][e]) and torch.equal(out[1], tensors[1][e])
    assert store.expert_bytes == (70 + 35) * 4


def test_a_store_left_half_written_or_stale_is_rebuilt_never_read(tmp_path):
    tensors = _experts()
    path = open_disk_store(str(tmp_path), "layer0", tensors).path
    said = []
    with open(path, "r+b") as f:  # a killed writer's file: cut short
        f.truncate(os.path.getsize(path) - ALIGN)
    open(path + ".partial", "wb").write(b"junk")
    store = open_disk_store(str(tmp_path), "layer0", tensors, log=said.append)
    assert len(said) == 1 and "rebuilding" in said[0] and not os.path.exists(path + ".partial")
    out = (torch.empty(10, 7), torch.empty(7, 5))
    store.fetch(5, out)
    assert torch.equal(out[1], tensors[1][5])
    other = _experts(seed=1)  # the same shapes, other weights: the digest tells them apart
    store = open_disk_store(str(tmp_path), "layer0", other, log=said.append)
    store.fetch(2, out)
    assert len(said) == 2 and torch.equal(out[0], other[0][2])
    open_disk_store(str(tmp_path), "layer0", other, log=said.append)  # complete and current: reused
    assert len(said) == 2


def test_store_that_cannot_be_written_is_one_argument_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ArgumentError) as err:
        open_disk_store(str(tmp_path / "file" / "store"), "layer0", _experts())
    assert err.value.arg == "store" and str(err.value).startswith("store: expected a directory")


@pytest.mark.parametrize("value,want", [(0.25, 4), (0.01, 1), (3, 3), (15, 15)])
def test_cache_size(value, want):
    assert cache_size(value, 16) == want


@pytest.mark.parametrize("value", [0, 16, 17, -1, 1.0, 0.0, True, "4"])
def test_cache_size_refused_in_one_line(value):
    with pytest.raises(ArgumentError) as err:
        cache_size(value, 16)
    assert err.value.arg == "cache" and "got" in str(err.value)


def _lru_reference(calls, capacity):
    """Exact routing with LRU eviction, straight from its rule: per call the distinct experts it
    computes; hits are those resident, each miss takes the least recently used slot."""
    order, hits, misses = [], 0, 0  # order: resident experts, least recent first
    for active in calls:
        present = [e for e in active if e in order]
        hits += len(present)
        for e in present:  # touched before any fetch
            order.remove(e)
            order.append(e)
        for e in active:
            if e in present:
                continue
            misses += 1
            if len(order) == capacity:
                order.pop(0)
            order.append(e)
    return hits, misses


def test_offloaded_model_computes_as_loaded_and_counts_as_lru(tmp_path):
    x = torch.randint(3, 96, (3, 12), generator=torch.Generator().manual_seed(0))
    sparse = tiny_model("qwen3_moe", experts_implementation="sere_sparse")
    eager = tiny_model("qwen3_moe")
    model = tiny_model("qwen3_moe")
    calls = {}

    def record(index):
        def hook(module, args):
            ids, weights = args[1], args[2]
            calls.setdefault(index, []).append(sorted({int(e) for e, w in zip(ids.reshape(-1), weights.reshape(-1))
                                                       if w != 0}))
        return hook

    offload(model, 3, str(tmp_path), progress=False)
    for layer in find_moe_layers(model):
        layer.experts.register_forward_pre_hook(record(layer.index))
    with torch.no_grad():
        want, got = sparse(x).logits, model(x).logits
        for t in range(3):  # a few decode-like calls of 3 tokens
            model(x[:, t:t + 1])
        assert torch.equal(got, want)  # the same kernel, weights from the cache
        assert torch.allclose(got, eager(x).logits, atol=1e-5)
    for index, counters in cache_stats(model).items():
        hits, misses = _lru_reference(calls[index], 3)
        assert (counters.hits, counters.misses) == (hits, misses) and misses > 3
        assert counters.bytes == misses * (2 * 16 * 32 + 32 * 16) * 4
        assert counters.tokens == 36 + 9 and counters.calls == 4
    reset_caches(model)
    with counting(model, False), torch.no_grad():
        model(x)
    assert all(c.calls == 0 for c in cache_stats(model).values())


def test_cache_aware_sere_takes_resident_experts_as_primaries():
    g = torch.Generator().manual_seed(1)
    e, k = 16, 4
    sim = random_similarity([type("L", (), {"index": 0, "num_experts": e})], seed=2)[0]
    for trial in range(20):
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(1 + trial % 5)])
        free = torch.rand(e, generator=g) < 0.3
        for S, rho in ((1, 0.0), (1, 0.5), (2, 0.7)):
            want = _remap_loop(ids, sim, S, rho, "best", free=[i for i in range(e) if free[i]])
            assert torch.equal(reroute_free(ids, sim, S, rho, free), want)


def _prior_loop(scores, k, S, strength, resident):
    out_values, out_ids = [], []
    for row in scores.tolist():
        own = sorted(range(len(row)), key=lambda i: (-row[i], i))[:k]
        span = max(row) - min(row)
        biased = [v + strength * span * (1.0 if resident[i] else 0.0) for i, v in enumerate(row)]
        rest = sorted((i for i in range(len(row)) if i not in own[:S]), key=lambda i: (-biased[i], i))
        chosen = sorted(own[:S] + rest[:k - S], key=lambda i: (-row[i], i))
        out_ids.append(chosen)
        out_values.append([row[i] for i in chosen])
    return torch.tensor(out_values), torch.tensor(out_ids)


def test_prior_rule_matches_a_plain_loop():
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(7, 16, generator=g).softmax(-1)
    resident = torch.rand(16, generator=g) < 0.25
    for strength in (0.0, 0.1, 0.5, 2.0):
        for S in (1, 2):
            values, ids, own = prior_select(scores, 4, S, strength, resident, 0.0)
            want_values, want_ids = _prior_loop(scores, 4, S, strength, resident)
            assert torch.equal(ids, want_ids) and torch.allclose(values, want_values)
            if strength == 0.0:  # no prior: the model's own selection
                assert torch.equal(ids.sort(-1).values, own.sort(-1).values)
    strong = prior_select(scores, 4, 1, 10.0, resident, 0.0)[1]
    assert all(resident[e] or e == scores[t].argmax() for t, row in enumerate(strong.tolist()) for e in row)


def test_importance_rule_fetches_only_important_missing_experts():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(5, 16, generator=g) * 2
    resident = torch.rand(16, generator=g) < 0.3
    rho = 0.05
    _, ids, own = weight_select(logits, 4, 1, float("-inf"), rho=rho, free=resident)
    shares = torch.zeros(5, 16).scatter(1, own, torch.topk(logits, 4).values.softmax(-1))
    importance = shares.square().sum(0)
    for e in ids.unique().tolist():  # read: resident, a token's top-1, or important enough to fetch
        assert resident[e] or e in own[:, 0].tolist() or importance[e] >= rho


def _decoded(model, x, steps=6):
    from sere_fx.evaluate import CachedDecode

    decoder = CachedDecode(model)
    with torch.no_grad():
        with counting(model, False):  # prefill fills the cache, uncounted
            decoder.prefill(x[:, :4])
        with counting(model, True):
            for t in range(4, 4 + steps):
                decoder.step(x[:, t:t + 1])
    return sum(c.misses for c in cache_stats(model).values())


def test_transform_after_offload_routes_with_the_cache_in_view(tmp_path):
    x = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(5))
    model = tiny_model("qwen3_moe")
    offload(model, 4, str(tmp_path), progress=False)
    reset_caches(model)
    lru = _decoded(model, x)
    sim = random_similarity(find_moe_layers(model), seed=0)
    for spec in (dict(S=1, rho=0.0), dict(policy="prior", S=1, rho=5.0)):
        sere_fx.transform(model, sim if "policy" not in spec else None, **spec)
        reset_caches(model)
        aware = _decoded(model, x)
        sere_fx.restore(model)
        # batch 1, S=1: at most the token's top-1 is fetched per layer call, far fewer than exact routing
        assert aware <= 6 * 2 < lru, (spec, aware, lru)
    router = find_moe_layers(model)[0].router
    assert "sere_resident" not in dict(router.named_buffers())  # restore took the routing's view away


def test_what_cannot_carry_an_offloaded_model_says_so(tmp_path):
    model = tiny_model("qwen3_moe")
    with pytest.raises(ArgumentError, match="^policy: 'prior' biases routing toward an offload cache"):
        sere_fx.transform(model, None, policy="prior", S=1, rho=0.5)
    sere_fx.transform(model, None, policy="oea", S=2)
    with pytest.raises(ArgumentError, match="^model: already transformed; call sere_fx.offload before"):
        offload(model, 4, str(tmp_path))
    sere_fx.restore(model)
    with pytest.raises(ArgumentError, match="^store: the disk tier needs a directory"):
        offload(model, 4)
    with pytest.raises(ArgumentError, match=r"^cache: expected a count in \[1, 15\]"):
        offload(model, 16, str(tmp_path))
    offload(model, 4, str(tmp_path), progress=False)
    with pytest.raises(ArgumentError, match="^model: its experts are offloaded already"):
        offload(model, 4, str(tmp_path))
    from sere_fx.exporters.export import exported_program

    with pytest.raises(ArgumentError, match="^model: its experts are offloaded"):
        exported_program(model, torch.ones(1, 4, dtype=torch.long))
    with pytest.raises(ArgumentError, match="^policy: 'prior' reads an offload cache's resident set"):
        sere_fx.backend(policy="prior", S=1, rho=0.5)
    from sere_fx.vllm.settings import SettingsError, parse

    with pytest.raises(SettingsError, match="'prior' biases routing toward an offload cache"):
        parse({"policy": "prior", "S": 1, "rho": 0.5})


def test_docs_offload_eval_command_as_typed_but_smaller(tmp_path, capsys, monkeypatch):
    """docs/offload.md's commands on the test-bed, as typed except for their size (and tune's search:
    two candidates a layer instead of the default thirteen)."""
    import re

    from sere_fx.cli import main
    from sere_fx.resources import testbed_model, testbed_text

    block = doc_pages.block("offload.md", "bash", "sere-fx eval --model DIR")
    commands = [" ".join(part.strip() for part in line.split("\\\n")) for line in re.split(r"\n(?=sere-fx )", block)]
    assert [c.split()[1] for c in commands] == ["calibrate", "eval", "tune"]
    monkeypatch.chdir(tmp_path)
    import sere_fx.tuning

    monkeypatch.setattr(sere_fx.tuning, "offload_candidates", lambda predictors: (("prior", 1, 0.2), ("output", 1, 5.0)))
    smaller = {"calibrate": ["--num-seqs", "16", "--seq-len", "32"], "eval": ["--num-seqs", "6", "--steps", "3"],
               "tune": ["--num-seqs", "2", "--steps", "2"]}
    outs = {}
    for command in commands:
        argv = command.replace("DIR", testbed_model()).replace("text.txt", testbed_text()).split()[1:]
        assert main(argv + smaller[argv[0]]) == 0, (command, capsys.readouterr().err)
        outs[argv[0]] = capsys.readouterr().out
    out = outs["eval"]
    plan = json.load(open("offload-plan.json"))
    assert plan["tuned"]["offload"] == {"cache": 0.25, "batch_size": 1, "cost": "fetches per token per layer"}
    assert plan["tuned"]["distinct"] <= plan["tuned"]["baseline_distinct"] and "fetches/token/layer" in outs["tune"]
    report = json.load(open("offload/eval.json"))
    rows = {r["label"]: r for r in report["results"]}
    assert list(rows)[0] == "lru" and any(label.startswith("prior:") for label in rows)
    assert report["config"]["offload"] == {"cache": 16, "tier": "disk"}
    for r in rows.values():
        layers = r["cache_per_layer"]
        assert sorted(layers) == ["0", "1", "2", "3"]
        assert r["fetches_per_token"] == pytest.approx(sum(c["misses"] / c["tokens"] for c in layers.values()) / 4)
        assert all(c["tokens"] == 6 * 3 for c in layers.values())  # decode tokens only, batch 1
    assert rows["sere:S=1,rho=0.5"]["fetches_per_token"] < rows["lru"]["fetches_per_token"]
    assert "fetches/token/layer" in out and os.path.isdir("offload/expert-store")


def test_docs_offload_python_example_as_written(tmp_path, monkeypatch, capsys):
    """docs/offload.md's first example with the demo's similarity file (calibrated here as the demo does)."""
    code = doc_pages.block("offload.md", "python", "sere_fx.offload(model, cache=0.25")
    monkeypatch.chdir(tmp_path)
    doc_pages.demo_similarity()
    scope = {}
    exec(compile(code, "docs/offload.md", "exec"), scope)
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split()[0] for line in lines] == ["0", "1", "2", "3"]
    stats = sere_fx.cache_stats(scope["model"])
    assert all(c.capacity == 16 for c in sere_fx.expert_cache.offloaded_layers(scope["model"]).values())
    assert all(0 < c.misses and c.hits > 0 for c in stats.values())
    assert sorted(os.listdir("expert-store")) == [f"layer{i}.experts" for i in range(4)]


def test_tune_on_an_offloaded_model_picks_the_fewest_fetches_within_the_budget(tmp_path):
    from sere_fx.tuning import tune

    model = tiny_model("qwen3_moe")
    offload(model, 4, str(tmp_path), progress=False)
    sim = sere_fx.Similarity(random_similarity(find_moe_layers(model), seed=0))
    windows = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(6))
    candidates = [("sere", 1, 0.0), ("prior", 1, 0.5), ("weight", 1, 0.05)]
    loose = tune(model, sim, windows, max_loss=10.0, candidates=candidates, batch_size=2, progress=False)
    assert loose.offloaded and "fetches/token/layer" in loose.summary()
    # a loose budget takes the uniform candidate with the fewest fetches, or something fewer still
    uniform = {}
    for policy, S, rho in candidates:
        sere_fx.transform(model, sim, policy=policy, S=S, rho=rho, max_tokens=None)
        try:
            from sere_fx.evaluate import decode_scores

            s = decode_scores(model, windows, batch_size=2, prefill=4, progress=False)
        finally:
            sere_fx.restore(model)
        uniform[policy] = sum(c["misses"] / c["tokens"] for c in s.cache.values()) / len(s.cache)
    assert loose.distinct <= min(uniform.values()) + 1e-9 < loose.baseline_distinct
    strict = tune(model, sim, windows, max_loss=0.0, candidates=candidates, batch_size=2, progress=False)
    assert strict.loss <= 0.0 and strict.distinct >= loose.distinct


def test_memory_tier_computes_as_loaded_and_takes_no_store():
    x = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(7))
    sparse = tiny_model("qwen3_moe", experts_implementation="sere_sparse")
    model = tiny_model("qwen3_moe")
    offload(model, 0.25, tier="memory", progress=False)
    with torch.no_grad():
        assert torch.equal(model(x).logits, sparse(x).logits)
    assert all(c.misses > 0 and c.bytes == c.misses * (2 * 16 * 32 + 32 * 16) * 4 for c in cache_stats(model).values())
    with pytest.raises(ArgumentError, match=r"^tier: expected one of \['disk', 'memory'\], got 'ssd'"):
        offload(tiny_model("qwen3_moe"), 4, tier="ssd")


def test_a_full_disk_is_one_line_and_leaves_no_partial_file(tmp_path, monkeypatch):
    import errno

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(ArgumentError) as err:
        open_disk_store(str(tmp_path), "layer0", _experts())
    assert err.value.arg == "store" and "No space left on device" in str(err.value)
    assert len(str(err.value).splitlines()) == 1 and os.listdir(tmp_path) == []
