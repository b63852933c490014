"""Expert parallelism: placements, per-rank accounting in eval, and weight's per-rank budget."""

import pytest
import torch
from torch._dynamo.backends.debugging import aot_eager

import sere_fx
from reference import weight_loop
from sere_fx import Placement, WeightConfig
from sere_fx.compile import SereBackend
from sere_fx.evaluate import evaluate
from sere_fx.placement import rank_load
from sere_fx.policies import weight_select
from tiny_models import tiny_model


@pytest.mark.parametrize("experts,ranks", [(16, 4), (64, 8), (10, 4), (7, 3), (5, 5)])
@pytest.mark.parametrize("strategy", ["linear", "round_robin"])
def test_placements_are_vllms(experts, ranks, strategy):
    expert_map_manager = pytest.importorskip("vllm.model_executor.layers.fused_moe.expert_map_manager")
    owner = Placement(ranks, strategy).owner(experts)
    for rank in range(ranks):
        _, expert_map, _ = expert_map_manager.determine_expert_map(ranks, rank, experts, strategy)
        assert (owner == rank).tolist() == (expert_map >= 0).tolist(), (rank, owner.tolist())


def test_placement_checks_its_values():
    for build, arg, message in [
        (lambda: Placement(0), "ranks", r"^ranks: expected a positive int \(EP ranks\), got 0$"),
        (lambda: Placement(2, "striped"), "strategy", r"^strategy: expected one of \['linear', 'round_robin', 'explicit'\]"),
        (lambda: Placement(2, "explicit"), "owners", r"^owners: expected a map exactly with strategy 'explicit'"),
        (lambda: Placement(2, "explicit", (0, 2)), "owners", r"^owners: expected ranks in \[0, 2\), got 2$"),
    ]:
        with pytest.raises(ValueError, match=message) as info:
            build()
        assert info.value.arg == arg
    with pytest.raises(ValueError, match=r"^owners: expected a rank for each of the 4 experts, got 3$"):
        Placement(2, "explicit", (0, 1, 1)).owner(4)
    assert Placement(2, "explicit", [1, 0, 0, 1]).owner(4).tolist() == [1, 0, 0, 1]


def test_rank_load_counts_as_plain_sets():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 12, (9, 3), generator=g)
    ids[2, 1] = -1  # padding: no expert
    owner = Placement(4, "round_robin").owner(12)
    distinct, slots = rank_load(ids, owner, 4)
    flat = [e for e in ids.flatten().tolist() if e >= 0]
    for r in range(4):
        assert distinct[r] == len({e for e in flat if e % 4 == r})
        assert slots[r] == sum(1 for e in flat if e % 4 == r)


@pytest.mark.parametrize("rank_budget", [1, 2, 0.5, 0.25])
@pytest.mark.parametrize("strategy", ["linear", "round_robin"])
def test_weight_rank_budget_against_a_plain_loop(rank_budget, strategy):
    g = torch.Generator().manual_seed(7)
    e, k, t, ranks = 16, 4, 10, 4
    scores = torch.randn(t, e, generator=g).softmax(-1)
    owner = Placement(ranks, strategy).owner(e)
    for n in (None, 9):
        _, ids, _ = weight_select(scores, k, 1, 0.0, N=n if n else 0.99, rank_budget=rank_budget, owner=owner)
        expected = weight_loop(scores, k, 1, N=n if n else 0.99, rank_budget=rank_budget, owner=owner.tolist())
        for row, want in zip(ids.tolist(), expected):
            assert row[: len(want)] == want and set(row) <= set(want) | {want[0]}
        distinct, _ = rank_load(ids, owner, ranks)
        picked_per_rank = rank_load(torch.topk(scores, k).indices, owner, ranks)[0]
        cap = torch.full_like(distinct, rank_budget) if isinstance(rank_budget, int) else \
            (picked_per_rank.double() * rank_budget + 1e-9).floor().clamp_min(1).long()
        assert bool((distinct <= torch.maximum(cap, torch.zeros_like(cap))).all()), (distinct, cap)


def _tiny():
    model = tiny_model("qwen3_moe", experts_implementation="grouped_mm")  # 16 experts, top-4, layers 0 and 1
    ids = torch.randint(3, model.config.vocab_size, (8, 2), generator=torch.Generator().manual_seed(1))
    return model, ids


def test_rank_budget_through_transform_and_the_compile_backend(tmp_path):
    model, ids = _tiny()
    config = WeightConfig(S=1, N=0.9, rank_budget=2, placement=Placement(4, "round_robin"))
    with torch.no_grad():
        original = model(ids).logits
        sere_fx.transform(model, None, config, max_tokens=None, stats=True)
        eager = model(ids).logits
        stats = sere_fx.routing_stats(model)
        sere_fx.restore(model)
    assert not torch.equal(eager, original)
    # each call read at most 2 experts on each of the 4 ranks: at most 8 per call
    assert all(s.distinct_after <= 8 * s.calls for s in stats.values())
    torch._dynamo.reset()
    backend = SereBackend(None, config, max_tokens=None, inner=aot_eager)
    with torch.no_grad():
        compiled = torch.compile(model, backend=backend)(ids).logits
    assert backend.sites_rewritten == 2
    torch.testing.assert_close(compiled, eager)
    assert config.as_dict() == {"policy": "weight", "S": 1, "rho": None, "N": 0.9, "rank_budget": 2,
                                "placement": {"ranks": 4, "strategy": "round_robin"}}
    plan = {0: config, 1: WeightConfig(S=1, N=3)}
    sere_fx.save_plan(tmp_path / "p.json", plan)
    assert sere_fx.load_plan(tmp_path / "p.json") == plan


def test_rank_budget_needs_a_placement():
    with pytest.raises(ValueError, match=r"^placement: a per-rank budget needs a placement") as info:
        WeightConfig(S=1, N=4, rank_budget=2)
    assert info.value.arg == "placement"
    with pytest.raises(ValueError, match=r"^rank_budget: expected a positive int \(experts per rank per call\)"):
        WeightConfig(S=1, rank_budget=0, placement=Placement(2))


def test_eval_reports_the_most_loaded_rank():
    model, _ = _tiny()
    windows = torch.randint(3, model.config.vocab_size, (8, 6), generator=torch.Generator().manual_seed(2))
    report = evaluate(model, windows, ["oea:S=1", "weight:S=1,N=0.5"], batch_size=4, prefill=2, progress=False,
                      placement=Placement(4))
    k = 4
    for r in report.results:
        # the most loaded rank holds at least its share, at most all of them; slots likewise
        assert r.distinct / 4 - 1e-9 <= r.max_rank_distinct <= r.distinct
        assert r.slots == pytest.approx(4 * k)  # 4 tokens x top-4 slots reach the experts every step
        assert r.slots / 4 - 1e-9 <= r.max_rank_slots <= r.slots
    assert "max-rank experts" in report.table() and report.config["ep"] == {"ranks": 4, "strategy": "linear"}
    one = evaluate(model, windows, ["oea:S=1"], batch_size=4, prefill=2, progress=False, placement=Placement(1))
    assert all(r.max_rank_distinct == pytest.approx(r.distinct) for r in one.results)  # one rank holds every expert
    per_expert = evaluate(model, windows, [], batch_size=4, prefill=2, progress=False, placement=Placement(16))
    assert per_expert.results[0].max_rank_distinct == 1.0  # one expert per rank


def test_replay_counts_and_the_per_rank_cap_only_removes():
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    from ep_replay import replay

    g = torch.Generator().manual_seed(3)
    probs = torch.randn(2, 8, 4, 16, generator=g).softmax(-1)  # 2 layers, 8 steps of 4 tokens over 16 experts
    (row,) = replay(probs, 4, [8], 0.5, 0.5, k=4)
    assert row["experts"] == 64 and row["tokens_per_step"] == 16
    # plain: each quarter holds one recorded batch's union, by hand
    unions = [len(set(torch.topk(probs[layer, s], 4).indices.flatten().tolist()))
              for layer in range(2) for s0 in range(0, 8, 4) for s in range(s0, s0 + 4)]
    assert row["plain"]["distinct"] == pytest.approx(sum(unions) / (2 * 2))
    # the per-rank cap only removes from the global budget's loaded set
    assert row["per_rank"]["distinct"] <= row["global"]["distinct"] <= row["plain"]["distinct"]
    assert row["per_rank"]["max_rank_distinct"] <= row["global"]["max_rank_distinct"]


def test_routing_stats_count_the_busiest_rank():
    model, ids = _tiny()
    placement = Placement(4, "round_robin")
    sere_fx.transform(model, None, WeightConfig(S=1, N=0.9, rank_budget=2, placement=placement), max_tokens=None,
                      stats=placement)
    seen = {}

    def hook(index):
        def record(module, args):
            seen.setdefault(index, []).append(next(a for a in args[1:] if not a.dtype.is_floating_point).clone())
        return record

    for layer in sere_fx.discovery.find_moe_blocks(model):
        layer.experts.register_forward_pre_hook(hook(layer.index))
    with torch.no_grad():
        model(ids)
    owner = placement.owner(16)
    for index, s in sere_fx.routing_stats(model).items():
        d = s.as_dict()
        busiest = [int(rank_load(x, owner, 4)[0].max()) for x in seen[index]]
        assert s.max_rank_after == sum(busiest) and d["mean_max_rank_after"] <= 2  # the cap: 2 per rank
        assert s.max_rank_before >= s.max_rank_after
    with pytest.raises(ValueError, match=r"^stats: expected True, False or a sere_fx.Placement, got 4$"):
        sere_fx.transform(tiny_model("qwen3_moe"), None, WeightConfig(N=3), stats=4)
