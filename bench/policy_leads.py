"""Which loaded-set rule loses least at a fixed expert count? (issue 11's leads, on the tuning text)

Every variant reads about as many experts per layer per decode step as OEA S=2 and is compared
with it, paired, on the same sequences: batch-32 teacher-forced decode on tokens 0:40000 of the
test-bed's public text (the tuning part; held-out figures are in bench/RESULTS.md).

1. How to rank experts for a budget of N=36 (every token's top-1 kept first, tokens refill
   from the set as OEA does): by importance sum_t share^p for p = 1 (routing mass), 1.5,
   2 (the shipped ``weight`` policy), 3, and by the largest share (p -> infinity).
2. Token-aware substitution: SERE's primaries (union of top-2); a token's expert outside them
   goes to the primary that maximises alpha * similarity + (1 - alpha) * the token's own
   score (both min-max scaled per row, experts the token already has excluded), keeping the
   dropped expert's weight (alpha = 1 is SERE at rho = 0 with that exclusion), or taking the
   substitute's own weight.

The variants other than ``weight`` are not project policies: they are swapped in for the OEA
rule (``sere_fx.policies.oea_select``) during one evaluation each, so that they run through
the same rewrite and decode loop.

    python bench/policy_leads.py      # ~5 min on 2 cores -> bench/results/policy_leads.json
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

import torch

import sere_fx
import sere_fx.policies as policies
from sere_fx.calibration import batched, calibrate, read_documents, token_windows
from sere_fx.evaluate import decode_scores, paired_bootstrap
from sere_fx.ops import primary_mask
from sere_fx.resources import testbed_model, testbed_text

N = 36


def by_power(p: float | None):
    """The ``weight`` rule with importance sum_t share^p (None: the largest share)."""

    def select(scores, k, S, neutral, valid_rows=None):
        e = scores.shape[-1]
        values, own = torch.topk(scores, k, dim=-1)
        shares = torch.zeros_like(scores).scatter(1, own, values / values.sum(-1, keepdim=True))
        importance = shares.amax(0) if p is None else shares.pow(p).sum(0)
        kept = primary_mask(own, 1, e)
        key = torch.where(kept, importance + importance.sum() + 1.0, importance)
        key = key.masked_fill(~primary_mask(own, k, e), -1.0)
        loaded = torch.zeros(e, dtype=torch.bool).index_fill(0, key.topk(N).indices, True) & (key >= 0)
        out_values, ids = policies._refill(scores, k, loaded, neutral, valid_rows)
        return out_values, ids, own

    return select


def substitution(similarities, alpha: float, keep_weight: bool):
    """SERE's primaries, each outside expert to the best primary by a similarity / score mix."""
    calls = [0]

    def select(scores, k, S, neutral, valid_rows=None):
        sim = similarities[calls[0] % len(similarities)]  # MoE layers run in order each step
        calls[0] += 1
        e = scores.shape[-1]
        values, own = torch.topk(scores, k, dim=-1)
        primary = primary_mask(own, S, e)
        members = primary.nonzero().flatten()

        def scaled(x):
            lo, hi = x.min(1, keepdim=True).values, x.max(1, keepdim=True).values
            return (x - lo) / (hi - lo + 1e-9)

        sim_p, score_p = scaled(sim[:, members]), scaled(scores[:, members])
        ids, out_values = own.clone(), values.clone()
        for j in range(S, k):
            expert = own[:, j]
            mix = alpha * sim_p[expert] + (1 - alpha) * score_p
            has = (ids[:, :j].unsqueeze(2) == members.view(1, 1, -1)).any(1)
            choice = members[mix.masked_fill(has, -1e9).argmax(1)]
            outside = ~primary[expert]
            ids[:, j] = torch.where(outside, choice, expert)
            if not keep_weight:
                out_values[:, j] = torch.where(outside, scores.gather(1, choice[:, None]).squeeze(1), values[:, j])
        return out_values, ids, own

    return select


@contextlib.contextmanager
def oea_rule_replaced_by(select):
    original = policies.oea_select
    policies.oea_select = select
    try:
        yield
    finally:
        policies.oea_select = original


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(testbed_model(), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(testbed_model())
    docs = read_documents(testbed_text())
    cal = token_windows(tokenizer, docs, 128, 400, token_range=(0, 40_000))
    sim = calibrate(model, batched(cal, 16), "frobenius", progress=False)
    similarities = [sim[i].float() for i in sorted(sim.keys())]
    windows = token_windows(tokenizer, docs, 101, 384, token_range=(0, 40_000))
    base = decode_scores(model, windows, progress=False)

    def measure(**kwargs):
        sere_fx.transform(model, None, max_tokens=None, **kwargs)
        try:
            return decode_scores(model, windows, progress=False)
        finally:
            sere_fx.restore(model)

    runs = {"oea S=2": measure(policy="oea", S=2), f"weight S=1 N={N} (p=2)": measure(policy="weight", S=1, N=N)}
    for label, p in (("p=1 (mass)", 1.0), ("p=1.5", 1.5), ("p=3", 3.0), ("largest share", None)):
        with oea_rule_replaced_by(by_power(p)):
            runs[f"rank by {label}, N={N}"] = measure(policy="oea", S=1)
    for alpha, keep in ((1.0, True), (0.5, True), (0.0, True), (0.0, False)):
        with oea_rule_replaced_by(substitution(similarities, alpha, keep)):
            weight = "dropped expert's weight" if keep else "own weight"
            runs[f"substitute alpha={alpha}, {weight}"] = measure(policy="oea", S=2)
    oea = runs["oea S=2"]
    rows = []
    print(f"{'variant':<44} {'experts':>8} {'retention':>10} {'dNLL':>8}   {'dNLL - OEA S=2 [95% CI]':>28}")
    for label, s in runs.items():
        vs = paired_bootstrap(oea, s)
        row = {"variant": label, "experts": s.mean_distinct, "retention": s.accuracy / base.accuracy,
               "dnll": s.mean_nll - base.mean_nll, "dnll_vs_oea": s.mean_nll - oea.mean_nll,
               "dnll_vs_oea_ci": vs["dnll_ci"]}
        rows.append(row)
        print(f"{label:<44} {row['experts']:>8.1f} {row['retention']:>10.4f} {row['dnll']:>+8.4f}   "
              f"{row['dnll_vs_oea']:>+8.4f} [{vs['dnll_ci'][0]:+.4f}, {vs['dnll_ci'][1]:+.4f}]")
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "policy_leads.json")
    with open(out, "w") as f:
        json.dump({"text": "eval_public.txt tokens 0:40000", "windows": list(windows.shape), "batch_size": 32,
                   "baseline_distinct": base.mean_distinct, "rows": rows}, f, indent=1)
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
