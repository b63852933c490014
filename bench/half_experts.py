"""Half the experts: what decides quality when a batch-32 decode step reads half the experts it picked?
(issue 20's leads, held-out text)

Every variant loads the same number of experts per layer per decode step as ``weight:S=1,N=0.5``
(every token's top-1 first, then by importance, half of what the step picked) and is compared with
it, paired, on the same sequences: batch-32 teacher-forced decode of 256 windows of tokens 40000: of
the test-bed's public text. Calibration (similarities, output-size predictors, per-expert drop
costs) uses tokens 0:40000 only.

1. Importance: ``weight`` (sum of squared shares), ``output`` (each squared share times the
   predicted squared output norm; the shipped policy), and squared shares times a per-expert
   mean drop cost ``E[||o_t - y_e(x_t)||^2]`` over the tokens routed to e (a constant per expert).
2. Where a dropped slot goes: refill from the loaded set by the token's own ranking (shipped),
   no refill (the model renormalises over what is left), the most similar loaded expert by cosine
   similarity keeping the dropped weight (SERE's substitution), or a refill that takes all of the
   dropped weight.
3. A budget that follows the batch: load experts by importance until they hold 93% of it (about
   the same mean count as N=0.5).
4. What knowing the experts' real outputs would buy (oracles, not deployable: they evaluate every
   expert on every token): importance with each token's real ``||y_e||^2`` or ``||y_e - o_t||^2``,
   and a greedy set that minimises the layer output's squared error.

The variants other than ``weight`` and ``output`` are not project policies: they replace
``sere_fx.policies.weight_select`` during one evaluation each, so that they run through the same
rewrite and decode loop.

    python bench/half_experts.py      # ~8 min on 2 cores -> bench/results/half_experts/leads.json
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
from unittest import mock

import torch

import sere_fx
import sere_fx.policies as policies
from sere_fx.calibration import batched, calibrate, read_documents, token_windows
from sere_fx.calibration.expert_outputs import ExpertOutputs
from sere_fx.discovery import find_moe_blocks
from sere_fx.evaluate import decode_scores, paired_bootstrap
from sere_fx.ops import primary_mask
from sere_fx.resources import testbed_model, testbed_text

N = 0.5
STATE: dict = {}  # the layer being routed and, for the oracles, its experts' outputs on this step's tokens


def _shares(scores, k):
    values, own = torch.topk(scores, k, dim=-1)
    values = values.float().clamp_min(0)
    return torch.zeros(scores.shape).scatter(1, own, values / values.sum(-1, keepdim=True)), own


def _budget(importance, own, k, count=None):
    """Every token's top-1 first, then by importance: half of what the step picked (or ``count``)."""
    e = importance.shape[0]
    picked, kept = primary_mask(own, k, e), primary_mask(own, 1, e)
    n = count if count is not None else max(1, int(picked.sum()) // 2)
    places = policies._places(importance.masked_fill(~picked, -1.0), first=kept)
    return picked & (places < n)


def variant(importance_fn=None, refill="rank", cover=None, greedy=False):
    def select(scores, k, S, neutral, **_):
        sh, own = _shares(scores, k)
        importance = (sh.square() if importance_fn is None else importance_fn(sh)).sum(0)
        if cover is not None:  # smallest importance-ordered set holding `cover` of the importance
            picked = primary_mask(own, k, scores.shape[-1])
            order = importance.masked_fill(~picked, -1.0).argsort(descending=True)
            before = importance[order].cumsum(0) - importance[order]
            count = int(((before < cover * importance[picked].sum()) & picked[order]).sum())
            loaded = _budget(importance, own, k, count) | primary_mask(own, 1, scores.shape[-1])
        elif greedy:
            loaded = _greedy_mse(sh, own, k)
        else:
            loaded = _budget(importance, own, k)
        if refill == "rank":
            values, ids = policies._refill(scores, k, loaded, neutral, None)
            return values, ids, own
        values = torch.gather(scores, 1, own)
        inside = loaded[own]
        if refill == "none":
            return values.masked_fill(~inside, neutral), torch.where(inside, own, own[:, :1]), own
        if refill == "similar":
            sim = STATE["similarity"][STATE["layer"]].masked_fill(~loaded.unsqueeze(0), -1e9)
            return values, torch.where(inside, own, sim.argmax(1)[own]), own
        # "all mass": refill by rank, the refilled slots share all of the dropped weight
        values, ids = policies._refill(scores, k, loaded, neutral, None)
        refilled = ~(ids.unsqueeze(2) == own.unsqueeze(1)).any(2) & (values > 0)
        dropped = (torch.gather(scores, 1, own) * ~inside).sum(1, keepdim=True)
        total = (values * refilled).sum(1, keepdim=True)
        scale = torch.where(total > 0, dropped / total.clamp_min(1e-12), torch.ones_like(total))
        return torch.where(refilled, values * scale, values), ids, own

    return select


def _greedy_mse(sh, own, k):
    y = STATE["outputs"].permute(1, 0, 2)  # [T, E, H]
    target = (sh.unsqueeze(-1) * y).sum(1)
    e = sh.shape[1]
    picked = primary_mask(own, k, e)
    loaded = primary_mask(own, 1, e)
    while int(loaded.sum()) < max(1, int(picked.sum()) // 2):
        best, choice = None, None
        for c in torch.nonzero(picked & ~loaded).flatten().tolist():
            trial = loaded.clone()
            trial[c] = True
            w = sh * trial
            w = w / w.sum(1, keepdim=True).clamp_min(1e-12)
            err = ((w.unsqueeze(-1) * y).sum(1) - target).square().sum()
            if best is None or err < best:
                best, choice = err, c
        loaded[choice] = True
    return loaded


def true_size(minus_output: bool):
    def importance(sh):
        y = STATE["outputs"].permute(1, 0, 2)
        if minus_output:
            y = y - (sh.unsqueeze(-1) * y).sum(1, keepdim=True)
        return sh.square() * y.square().sum(-1)

    return importance


def drop_costs(model, windows):
    """Per layer: each expert's mean ``||o_t - y_e(x_t)||^2`` over the tokens routed to it (what dropping
    it moves, before the share), and per expert the best other expert's mean ``||y_e - y_f||^2`` on
    the same tokens over that (below 1: some expert could stand in for it)."""
    blocks = find_moe_blocks(model)
    sums = {b.index: torch.zeros(b.num_experts, dtype=torch.float64) for b in blocks}
    counts = {b.index: torch.zeros(b.num_experts, dtype=torch.float64) for b in blocks}
    swaps = {b.index: torch.zeros(b.num_experts, b.num_experts, dtype=torch.float64) for b in blocks}

    def hook_for(block):
        outputs = ExpertOutputs(block.experts, block.num_experts)

        def hook(module, args):
            x, ids, w = args[0], args[1].reshape(args[0].shape[0], -1), args[2].reshape(args[0].shape[0], -1)
            y = outputs(x).float().permute(1, 0, 2)  # [T, E, H]
            mine = y.gather(1, ids.unsqueeze(-1).expand(-1, -1, y.shape[-1]))  # [T, K, H]
            o = (w.float().unsqueeze(-1) * mine).sum(1, keepdim=True)
            sums[block.index].index_add_(0, ids.flatten(), (o - mine).square().sum(-1).flatten().double())
            counts[block.index].index_add_(0, ids.flatten(), torch.ones(ids.numel(), dtype=torch.float64))
            gram = y @ y.transpose(1, 2)  # [T, E, E]
            norms = gram.diagonal(dim1=1, dim2=2)
            apart = norms.unsqueeze(2) + norms.unsqueeze(1) - 2 * gram  # ||y_e - y_f||^2
            routed = apart.gather(1, ids.unsqueeze(-1).expand(-1, -1, apart.shape[-1]))  # [T, K, E]
            swaps[block.index].index_add_(0, ids.flatten(), routed.reshape(-1, apart.shape[-1]).double())

        return hook

    handles = [b.experts.register_forward_pre_hook(hook_for(b)) for b in blocks]
    with torch.no_grad():
        for batch in batched(windows, 16):
            model(input_ids=batch, use_cache=False)
    for h in handles:
        h.remove()
    costs = {i: (sums[i] / counts[i].clamp_min(1)).float() for i in sums}
    best_swap = {}
    for i, m in swaps.items():
        ratio = m / sums[i].clamp_min(1e-30).unsqueeze(1)
        best_swap[i] = float(ratio.fill_diagonal_(float("inf")).min(dim=1).values.median())
    return costs, best_swap


def main(out="bench/results/half_experts/leads.json"):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    path = testbed_model()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    docs = read_documents(testbed_text())
    calib = token_windows(tokenizer, docs, 128, 256, token_range=(0, 40000))
    held = token_windows(tokenizer, docs, 69, 256, token_range=(40000, None))
    sim = calibrate(model, batched(calib, 16), "cosine", progress=False)  # cosine: similarity + predictors
    STATE["similarity"] = dict(sim)
    costs, best_swap = drop_costs(model, calib)
    print("best substitute's ||y_e - y_f||^2 over ||o_t - y_e||^2, median over experts, per layer:",
          {i: round(v, 3) for i, v in best_swap.items()}, flush=True)
    blocks = find_moe_blocks(model)
    for b in blocks:
        outputs = ExpertOutputs(b.experts, b.num_experts)

        def pre(module, args, index=b.index, outputs=outputs):
            STATE["layer"] = index
            if STATE.get("oracle"):
                STATE["outputs"] = outputs(args[0].reshape(-1, args[0].shape[-1])).float()

        b.block.register_forward_pre_hook(pre)
    base = decode_scores(model, held, batch_size=32, progress=False)
    runs = {
        "weight:S=1,N=0.5": (None, dict(policy="weight", S=1, N=N), False),
        "output:S=1,N=0.5": (None, dict(policy="output", S=1, N=N), False),
        "share^2 x per-expert drop cost": (variant(lambda sh: sh.square() * costs[STATE["layer"]]), None, False),
        "no refill (renormalise)": (variant(refill="none"), None, False),
        "refill: most similar loaded (cosine)": (variant(refill="similar"), None, False),
        "refill takes all dropped weight": (variant(refill="all"), None, False),
        "budget follows the batch (93% of importance)": (variant(cover=0.93), None, False),
        "oracle: real ||y_e||^2": (variant(true_size(False)), None, True),
        "oracle: real ||y_e - o_t||^2": (variant(true_size(True)), None, True),
        "oracle: greedy min output error": (variant(greedy=True), None, True),
    }
    results, scores = {}, {}
    for label, (fn, settings, oracle) in runs.items():
        m = copy.deepcopy(model)
        STATE["oracle"] = oracle
        with mock.patch.object(policies, "weight_select", fn) if fn is not None else contextlib.nullcontext():
            sere_fx.transform(m, sim if settings and settings["policy"] == "output" else None,
                              **(settings or dict(policy="weight", S=1, N=N)), max_tokens=None)
            s = scores[label] = decode_scores(m, held, batch_size=32, progress=False)
        ci = paired_bootstrap(base, s)
        vs = paired_bootstrap(scores["weight:S=1,N=0.5"], s)
        results[label] = {"retention": s.accuracy / base.accuracy, "retention_ci": ci["retention_ci"],
                          "dnll": s.mean_nll - base.mean_nll, "dnll_ci": ci["dnll_ci"],
                          "dnll_vs_weight": s.mean_nll - scores["weight:S=1,N=0.5"].mean_nll,
                          "dnll_vs_weight_ci": vs["dnll_ci"], "experts": s.mean_distinct,
                          "baseline_experts": base.mean_distinct}
        r = results[label]
        print(f"{label:46s} retention {r['retention']:.4f} [{r['retention_ci'][0]:.4f}, {r['retention_ci'][1]:.4f}]  "
              f"dNLL {r['dnll']:+.4f}  vs weight {r['dnll_vs_weight']:+.4f} [{r['dnll_vs_weight_ci'][0]:+.4f}, "
              f"{r['dnll_vs_weight_ci'][1]:+.4f}]  experts {r['experts']:.1f} of {r['baseline_experts']:.1f}", flush=True)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"variants": results, "best_substitute_ratio": best_swap}, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(*sys.argv[1:])
