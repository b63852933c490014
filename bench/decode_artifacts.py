"""Decode throughput of the test-bed model's decode artifacts (export(..., cache="static")), batch 32.

For each runtime (eager transformers generate, the aoti package, onnxruntime): the baseline
(untransformed) against SERE S=2 rho=0 (max_tokens=None), each greedy-decoding 64 new tokens
after an 8-token prompt. Tokens/s = batch x new tokens / wall time of one generate; the
sides alternate within each repeat after a warm-up of both, and the speed-up is the median
[p10, p90] of the per-pair ratios. The limit next to it is what the distinct experts read
allow on the MoE layers alone (measured by the eager model's routing statistics).

    python bench/decode_artifacts.py [--repeats 5]     # -> bench/results/decode_artifacts.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

BATCH, PROMPT, NEW = 32, 8, 64


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "decode_artifacts.json"))
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    import sere_fx
    from sere_fx import exporters
    from sere_fx.benchmark import Timing, time_paired
    from sere_fx.calibration import batched, calibrate, read_documents, token_windows
    from sere_fx.resources import testbed_model, testbed_text

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(testbed_model())
    docs = read_documents(testbed_text())
    plain = AutoModelForCausalLM.from_pretrained(testbed_model(), dtype=torch.float32).eval()
    sim = calibrate(plain, batched(token_windows(tok, docs, 128, 100, token_range=(0, 40_000)), 16), progress=False)
    sere = sere_fx.transform(copy.deepcopy(plain), sim, S=2, rho=0.0, max_tokens=None, stats=True)
    prompts = token_windows(tok, docs, PROMPT, BATCH, token_range=(40_000, None))

    def eager(model):
        def run():
            with torch.no_grad():
                return model.generate(prompts, max_new_tokens=NEW, do_sample=False,
                                      attention_mask=torch.ones_like(prompts))
        return run

    # distinct experts per layer per decode step, from the eager SERE model's own statistics
    eager(sere)()
    stats = sere_fx.routing_stats(sere)
    before = sum(s.distinct_before for s in stats.values()) / sum(s.calls for s in stats.values())
    after = sum(s.distinct_after for s in stats.values()) / sum(s.calls for s in stats.values())
    sere_fx.restore(sere)
    sere = sere_fx.transform(copy.deepcopy(plain), sim, S=2, rho=0.0, max_tokens=None)

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        runtimes = {"eager generate": (eager(plain), eager(sere))}
        for fmt, name in (("aoti", "aoti package"), ("onnx", "onnxruntime")):
            sides = []
            for label, model in (("base", plain), ("sere", sere)):
                path = os.path.join(tmp, f"{label}.{'onnx' if fmt == 'onnx' else 'pt2'}")
                t0 = time.perf_counter()
                exporters.export(model, prompts, path, format=fmt, cache="static", max_cache_len=PROMPT + NEW)
                print(f"exported {label} {fmt} in {time.perf_counter() - t0:.0f} s", flush=True)
                runner = exporters.load(path)
                sides.append(lambda r=runner: r.generate(prompts, NEW))
            runtimes[name] = tuple(sides)
        reference = eager(plain)()
        for name, (base, pol) in runtimes.items():
            assert torch.equal(base(), reference), f"{name}: baseline tokens differ from the plain model's"
            samples = time_paired({"baseline": base, "sere": pol}, args.repeats)
            tb, tp = samples["baseline"], samples["sere"]
            tps = lambda ts: Timing.of([BATCH * NEW / t for t in ts])  # noqa: E731
            ratio = Timing.of([b / p for b, p in zip(tb, tp)])
            rows.append({"runtime": name, "baseline_tok_s": tps(tb).__dict__, "sere_tok_s": tps(tp).__dict__,
                         "speedup": ratio.__dict__})
            print(f"{name:16s} baseline {tps(tb).median_s:7.0f} tok/s [{tps(tb).p10_s:.0f}, {tps(tb).p90_s:.0f}]  "
                  f"SERE {tps(tp).median_s:7.0f} tok/s [{tps(tp).p10_s:.0f}, {tps(tp).p90_s:.0f}]  speed-up "
                  f"{ratio.median_s:.2f}x [{ratio.p10_s:.2f}, {ratio.p90_s:.2f}]", flush=True)
    limit = before / after
    print(f"distinct experts per layer per call (64 decode calls and the prefill): baseline {before:.1f}, SERE {after:.1f}; limit {limit:.2f}x "
          "on the MoE layers alone")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"batch": BATCH, "prompt": PROMPT, "new_tokens": NEW, "repeats": args.repeats,
                   "distinct_before": before, "distinct_after": after, "limit": limit, "rows": rows,
                   "torch": torch.__version__}, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
