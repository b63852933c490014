"""End-to-end decode throughput of the test-bed model with generate(), batch 32.

Baseline vs SERE (S=2, rho=0) vs OEA (S=2): grouped_mm eager, grouped_mm under
torch.compile (static cache, "sere" backend; Inductor for the baseline), sere_sparse eager. Tokens/s = batch x new tokens / wall time of generate(), median
[p10, p90] over repeats after a warm-up; the prompt is 8 tokens, 64 new tokens.

    python bench/decode_e2e.py      # -> bench/results/decode_e2e.json
"""

from __future__ import annotations

import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))


def main() -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import sere_fx
    from sere_fx.benchmark import time_fn
    from sere_fx.calibration import batched, calibrate, read_documents, token_windows
    from sere_fx.resources import testbed_model, testbed_text

    tok = AutoTokenizer.from_pretrained(testbed_model())
    docs = read_documents(testbed_text())
    model = AutoModelForCausalLM.from_pretrained(testbed_model(), dtype=torch.float32).eval()
    sim = calibrate(model, batched(token_windows(tok, docs, 128, 100, token_range=(0, 40_000)), 16), progress=False)
    prompts = token_windows(tok, docs, 8, 32, token_range=(40_000, None))
    new = 64
    rows = []
    for impl, mode in (("grouped_mm", "eager"), ("grouped_mm", "compile"), ("sere_sparse", "eager")):
        if True:
            for label, kw in (("baseline", None), ("sere S=2 rho=0", dict(S=2, rho=0.0)), ("oea S=2", dict(policy="oea", S=2))):
                torch._dynamo.reset()
                m = AutoModelForCausalLM.from_pretrained(testbed_model(), dtype=torch.float32).eval()
                m.set_experts_implementation(impl)
                if kw is not None:
                    sere_fx.transform(m, sim if kw.get("policy", "sere") == "sere" else None, **kw)
                gen = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
                if mode == "compile":
                    gen["cache_implementation"] = "static"
                    m.forward = torch.compile(m.forward, backend="sere" if kw is not None else "inductor")
                with torch.no_grad():  # warm-up (and compilation), then 3 samples
                    t = time_fn(lambda: m.generate(prompts, **gen), repeats=3, warmup=1)
                tps = prompts.shape[0] * new / t.median_s
                rows.append(dict(impl=impl, mode=mode, policy=label, tokens_per_s=tps, median_s=t.median_s,
                                 p10_s=t.p10_s, p90_s=t.p90_s))
                base = next(r for r in rows if r["impl"] == impl and r["mode"] == mode and r["policy"] == "baseline")
                print(f"{impl:>11} {mode:>7} {label:<15} {tps:7.0f} tokens/s  generate {t.fmt(1, 's')}  "
                      f"x{tps / base['tokens_per_s']:.2f} vs baseline", flush=True)
    out = os.path.join(HERE, "results", "decode_e2e.json")
    with open(out, "w") as f:
        json.dump({"batch": 32, "prompt": 8, "new_tokens": new, "rows": rows}, f, indent=1)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
