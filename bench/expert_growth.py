"""Distinct experts per MoE layer vs decode batch size, for each top-K.

Routing replayed from the test-bed model (64 experts per layer, real text) next to uniform
independent routing (the expected count E * (1 - (1 - K/E)^B)). The union is what a decode
step must read without re-routing.

    python bench/expert_growth.py     # -> bench/results/expert_growth.json/.png
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

    from sere_fx.calibration import read_documents, token_windows
    from sere_fx.resources import testbed_model, testbed_text

    model = AutoModelForCausalLM.from_pretrained(testbed_model(), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(testbed_model())
    windows = token_windows(tok, read_documents(testbed_text()), 128, 96)
    with torch.no_grad():
        logits = [r.reshape(-1, 64) for r in model(windows, output_router_logits=True).router_logits]
    e = 64
    batches = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    g = torch.Generator().manual_seed(0)
    result = {"batches": batches, "replay": {}, "uniform": {}}
    for k in (1, 2, 4, 6, 8):
        means = []
        for b in batches:
            counts = []
            for layer in logits:
                ids = layer.topk(k, dim=-1).indices
                for _ in range(50):
                    rows = torch.randint(0, ids.shape[0], (b,), generator=g)
                    counts.append(ids[rows].unique().numel())
            means.append(sum(counts) / len(counts))
        result["replay"][k] = means
        result["uniform"][k] = [e * (1 - (1 - k / e) ** b) for b in batches]
        print(f"top-{k}: " + "  ".join(f"B={b}:{m:.1f}" for b, m in zip(batches, means)), flush=True)
    out = os.path.join(HERE, "results", "expert_growth.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.3))
    for k in result["replay"]:
        line = ax.plot(batches, result["replay"][k], "o-", label=f"top-{k} (test-bed routing)")[0]
        ax.plot(batches, result["uniform"][k], "--", color=line.get_color(), alpha=0.5)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("decode batch size")
    ax.set_ylabel("distinct experts per layer (of 64)")
    ax.set_title("expert union vs batch (dashed: uniform independent routing)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(os.path.splitext(out)[0] + ".png", dpi=100, bbox_inches="tight")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
