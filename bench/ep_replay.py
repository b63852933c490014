"""Expert-parallel load by replay: recorded test-bed routing, scaled to a DeepSeek-V3-like layer.

The test-bed routes each decode step's B tokens over 64 experts (top-8). A DeepSeek-V3-like layer
has 256 experts (top-8) on R = 8..64 EP ranks. The replay puts G = 4 recorded decode batches (of
the same layer, different sequences) side by side: batch g's router probabilities become experts
64 g .. 64 g + 63 of a 256-expert layer, so each quarter of the wide layer is routed as the
test-bed routes, and a step carries 4 B tokens. On each replayed step the ``weight`` policy runs
with a global budget (N, a fraction of what the step picked) and with a per-rank budget (Nrank,
a fraction of what each rank's share picked), and the script counts, per step, the distinct
experts in all and on the most loaded rank (linear placement, as vLLM's default), and the
token-slots of the most loaded rank. No quality is measured here (the test-bed has 64 experts):
``sere-fx eval --ep-ranks`` measures it on the test-bed itself.

    python bench/ep_replay.py --out bench/results/ep_replay.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))


def record(batch: int, steps: int, seqs: int):
    """Router probabilities of every MoE layer per decode step: ``[layers, steps * seqs / batch, batch, 64]``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sere_fx.calibration import read_documents, token_windows
    from sere_fx.evaluate import cache_kwarg
    from sere_fx.resources import testbed_model, testbed_text

    model = AutoModelForCausalLM.from_pretrained(testbed_model(), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(testbed_model())
    windows = token_windows(tokenizer, read_documents(testbed_text()), 4 + steps, seqs, token_range=(40000, None))
    kw = cache_kwarg(model)
    out = []
    with torch.no_grad():
        for start in range(0, windows.shape[0] - batch + 1, batch):
            ids = windows[start : start + batch]
            res = model(input_ids=ids[:, :4], use_cache=True)
            for t in range(4, 4 + steps):
                cache = getattr(res, "cache", None) or res.past_key_values
                res = model(input_ids=ids[:, t : t + 1], use_cache=True, output_router_logits=True, **{kw: cache})
                out.append(torch.stack([r.float().softmax(-1) for r in res.router_logits]))  # [layers, B, 64]
    return torch.stack(out, dim=1)  # [layers, steps, B, 64]


def replay(probs: torch.Tensor, groups: int, ranks_list, n: float, nrank: float, k: int = 8) -> list[dict]:
    from sere_fx.placement import Placement, rank_load
    from sere_fx.policies import weight_select

    layers, steps, batch, e = probs.shape
    wide = e * groups
    rows = []
    for ranks in ranks_list:
        owner = Placement(ranks).owner(wide)
        acc = {name: [] for name in ("plain", "global", "per_rank")}
        for layer in range(layers):
            for s in range(0, steps - groups + 1, groups):
                scores = torch.zeros(groups * batch, wide)
                for g in range(groups):
                    scores[g * batch:(g + 1) * batch, g * e:(g + 1) * e] = probs[layer, s + g]
                own = torch.topk(scores, k).indices
                _, glob, _ = weight_select(scores, k, 1, 0.0, N=n)
                _, local, _ = weight_select(scores, k, 1, 0.0, N=n, rank_budget=nrank, owner=owner)
                for name, ids in (("plain", own), ("global", glob), ("per_rank", local)):
                    distinct, slots = rank_load(ids, owner, ranks)
                    acc[name].append((int(distinct.sum()), int(distinct.max()), int(slots.max())))
        row = {"ranks": ranks, "tokens_per_step": groups * batch, "experts": wide}
        for name, values in acc.items():
            v = np.array(values, dtype=float)
            row[name] = {"distinct": float(v[:, 0].mean()), "max_rank_distinct": float(v[:, 1].mean()),
                         "max_rank_distinct_p90": float(np.percentile(v[:, 1], 90)),
                         "max_rank_slots": float(v[:, 2].mean())}
        rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[16, 32, 64], help="recorded decode batch sizes")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--seqs", type=int, default=128)
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--N", type=float, default=0.5, help="weight's global budget (fraction)")
    p.add_argument("--Nrank", type=float, default=0.5, help="weight's per-rank budget (fraction)")
    p.add_argument("--out", default=os.path.join(HERE, "results", "ep_replay.json"))
    args = p.parse_args(argv)
    torch.manual_seed(0)
    results = []
    for batch in args.batches:
        probs = record(batch, args.steps, args.seqs)
        for row in replay(probs, 4, args.ranks, args.N, args.Nrank):
            row["recorded_batch"] = batch
            results.append(row)
            print(f"B={row['tokens_per_step']:4d} R={row['ranks']:3d}  " + "  ".join(
                f"{name}: {row[name]['distinct']:6.1f} experts, max/rank {row[name]['max_rank_distinct']:5.2f} "
                f"(p90 {row[name]['max_rank_distinct_p90']:.0f}), max/rank slots {row[name]['max_rank_slots']:6.1f}"
                for name in ("plain", "global", "per_rank")), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"N": args.N, "Nrank": args.Nrank, "groups": 4, "rows": results}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
