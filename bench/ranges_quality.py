"""Plans across batch sizes: retention and distinct experts of routing plans at every decode batch,
on held-out text (tokens 40000: of the test-bed's public text, or --token-range; the plans were tuned
on 0:40000).

For each batch size, teacher-forced batched decode of windows of 4 prefill tokens and --steps scored
steps (default 64: 69-token windows), baseline and each plan on the same windows, paired: top-1
retention (accuracy / baseline accuracy) with its 95% paired bootstrap interval, and distinct experts per layer per decode step
before and after. Batches below ``tuning.PACK_ROWS`` (16) rows are decoded packed (``decode_scores(pack=...)``:
each batch routed and counted as its own), as tune scores them. A plan of ranges takes each batch's own range.

    python bench/ranges_quality.py --plans plan_ranges.json sere:S=2,rho=0 \\
        --sim sim.safetensors --out bench/results/ranges_quality.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import sere_fx
from sere_fx.calibration import read_documents, token_windows
from sere_fx.calibration.data import parse_token_range
from sere_fx.evaluate import decode_scores, paired_bootstrap, parse_policy
from sere_fx.resources import testbed_model, testbed_text
from sere_fx.tuning import PACK_ROWS  # sequences per forward, as tune scores them

PREFILL = 4
# windows per batch size (PREFILL + --steps + 1 tokens each): 256 everywhere, 16,384 scored tokens per
# batch size at the default 64 steps
WINDOWS = {1: 256, 8: 256, 16: 256, 32: 256, 64: 256, 128: 256}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plans", nargs="+", required=True, help="eval specs: plan:PATH, a plan .json path, or e.g. sere:S=2,rho=0")
    p.add_argument("--sim", required=True)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=sorted(WINDOWS))
    p.add_argument("--steps", type=int, default=64, help=f"scored decode steps per window, after {PREFILL} prefill tokens (default 64)")
    p.add_argument("--token-range", default="40000:", metavar="START:END",
                   help="the span of the text's tokens the windows come from (default: the held-out part)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.steps < 1:
        p.error(f"--steps: expected a positive int, got {args.steps}")
    try:
        token_range = parse_token_range(args.token_range)
    except ValueError as e:
        p.error(f"--token-range: {str(e).removeprefix('token_range: ')}")
    model = AutoModelForCausalLM.from_pretrained(testbed_model(), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(testbed_model())
    docs = read_documents(testbed_text())
    held = token_windows(tokenizer, docs, PREFILL + args.steps + 1, max(WINDOWS.values()), token_range=token_range)
    if held.shape[0] < max(args.batch_sizes):
        p.error(f"--steps / --token-range: expected at least {max(args.batch_sizes)} windows (the largest --batch-sizes) "
                f"of {PREFILL + args.steps + 1} tokens in {args.token_range}, got {held.shape[0]}")
    specs = [parse_policy(f"plan:{s}" if s.endswith(".json") and not s.startswith("plan:") else s) for s in args.plans]
    rows = []
    for b in args.batch_sizes:
        n = min(WINDOWS.get(b, 128), held.shape[0])
        n -= n % b
        windows = held[:n]
        kw = dict(batch_size=b, prefill=PREFILL, progress=False, pack=max(1, PACK_ROWS // b), parallel=True)
        start = time.perf_counter()
        base = decode_scores(model, windows, **kw)
        for spec in specs:
            sere_fx.transform(model, args.sim, spec.routing(None), max_tokens=None)
            try:
                s = decode_scores(model, windows, **kw)
            finally:
                sere_fx.restore(model)
            ci = paired_bootstrap(base, s)
            row = {"batch": b, "windows": n, "plan": spec.label, "retention": s.accuracy / base.accuracy,
                   "retention_ci": ci["retention_ci"], "dnll": s.mean_nll - base.mean_nll, "dnll_ci": ci["dnll_ci"],
                   "experts_before": base.mean_distinct, "experts_after": s.mean_distinct}
            rows.append(row)
            print(f"batch {b:>3} ({n} windows) {spec.label:>28}: retention {row['retention']:.4f} "
                  f"[{ci['retention_ci'][0]:.4f}, {ci['retention_ci'][1]:.4f}], experts {base.mean_distinct:.1f} -> "
                  f"{s.mean_distinct:.1f} ({s.mean_distinct / base.mean_distinct - 1:+.0%})", flush=True)
        print(f"  ({time.perf_counter() - start:.0f} s)", flush=True)
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "plans": args.plans, "steps": args.steps, "token_range": args.token_range}, f, indent=1)


if __name__ == "__main__":
    main()
