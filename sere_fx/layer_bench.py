"""One MoE layer at real sizes: does re-routing turn fewer experts into less time?

For each (model layer, dtype, experts implementation, routing, batch, policy) row: distinct
experts, expert bytes read, latency median [p10, p90] over --repeats timed calls (after
warm-up), speed-up vs the baseline measured in the same run, the limit
distinct(baseline)/distinct(policy), efficiency = speed-up / limit, the re-routing op's own
time, and the roofline of the row: max(bytes / bandwidth, FLOPs / peak), both measured on
this machine at start.

Layers are the real transformers modules with random weights:
  qwen3-30b-a3b    128 experts, top-8, hidden 2048, expert 768
  qwen1.5-moe      60 experts + shared expert, top-4, hidden 2048, expert 1408
  deepseek-v2-lite 64 experts + 2 shared, top-6, hidden 2048, expert 1408
Routing: "uniform" (random router weights: near-uniform, the pessimistic case for the
union) or "replay" (router scores replayed from the test-bed model on real text: 64
experts per test-bed layer; 128 = two layers side by side, 60 = the first 60).
Similarity: with uniform routing a synthetic matrix (symmetric, uniform in [0, 0.62], the
range of the test-bed's Frobenius similarities); with replayed routing the test-bed's own
Frobenius similarities of the replayed layers (cross-layer pairs 0). Speed depends on how
many experts survive, which every row prints.

    sere-fx bench --layers qwen3-30b-a3b --batches 32 --quick
    python bench/moe_layer.py            # the full grid -> bench/results/moe_layer.json/.png
"""

from __future__ import annotations

import argparse
import json
import os
import platform

import torch

import sere_fx
from sere_fx.benchmark import time_fn

LAYERS = {
    "qwen3-30b-a3b": dict(family="qwen3_moe", experts=128, top_k=8, hidden=2048, inter=768, shared=0),
    "qwen1.5-moe": dict(family="qwen2_moe", experts=60, top_k=4, hidden=2048, inter=1408, shared=5632),
    "deepseek-v2-lite": dict(family="deepseek_v2", experts=64, top_k=6, hidden=2048, inter=1408, shared=2),
}


def build_block(name: str, dtype: torch.dtype):
    import transformers

    spec = LAYERS[name]
    common = dict(hidden_size=spec["hidden"], num_experts_per_tok=spec["top_k"], moe_intermediate_size=spec["inter"])
    if spec["family"] == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block

        cfg = transformers.Qwen3MoeConfig(num_experts=spec["experts"], norm_topk_prob=True, **common)
    elif spec["family"] == "qwen2_moe":
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock as Block

        cfg = transformers.Qwen2MoeConfig(num_experts=spec["experts"], shared_expert_intermediate_size=spec["shared"],
                                          norm_topk_prob=False, **common)
    else:
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe as Block

        cfg = transformers.DeepseekV2Config(n_routed_experts=spec["experts"], n_shared_experts=spec["shared"],
                                            topk_method="greedy", n_group=1, topk_group=1, **common)
    cfg._experts_implementation = "grouped_mm"
    torch.manual_seed(0)
    block = Block(cfg).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02)
        gate = block.gate.weight
        gate.normal_(0.0, 1.0)  # spread router scores: top-k by a margin, as trained routers do
    return block.to(dtype), cfg


class Holder(torch.nn.Module):
    """Wraps one block as ``model.layers.0.mlp`` so ``sere_fx.transform`` sees a model."""

    def __init__(self, block, cfg):
        super().__init__()
        self.config = cfg
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([torch.nn.Module()])
        self.model.layers[0].mlp = block


class ReplayRouter(torch.nn.Module):
    """Returns routing from stored router logits (one row per token) instead of a matmul."""

    def __init__(self, logits: torch.Tensor, top_k: int, normalize: bool):
        super().__init__()
        # a Parameter, not a buffer: torch.fx traces parameter reads as graph nodes
        self.logits = torch.nn.Parameter(logits, requires_grad=False)
        self.top_k = top_k
        self.normalize = normalize
        self.weight = torch.nn.Parameter(torch.zeros(logits.shape[1], 1))  # keeps `.weight` users happy

    def forward(self, hidden_states):
        logits = self.logits[: hidden_states.reshape(-1, hidden_states.shape[-1]).shape[0]]
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        values, indices = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            values = values / values.sum(dim=-1, keepdim=True)
        return logits, values.to(hidden_states.dtype), indices


def testbed_routing(num_tokens: int, experts: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits of the test-bed model for ``num_tokens`` random real positions, and the
    matching [E, E] similarity (calibrated on other text than the replayed positions)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sere_fx.calibration import read_documents, token_windows
    from sere_fx.resources import testbed_model, testbed_text

    from sere_fx.calibration import batched, calibrate

    model = AutoModelForCausalLM.from_pretrained(testbed_model(), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(testbed_model())
    docs = read_documents(testbed_text())
    windows = token_windows(tok, docs, 128, 64, token_range=(40_000, None))
    cal = calibrate(model, batched(token_windows(tok, docs, 128, 100, token_range=(0, 40_000)), 16), progress=False)
    with torch.no_grad():
        out = model(windows, output_router_logits=True)
    per_layer = [r.reshape(-1, 64) for r in out.router_logits]
    g = torch.Generator().manual_seed(seed)
    rows = torch.randperm(per_layer[0].shape[0], generator=g)[:num_tokens]
    if experts <= 64:
        return per_layer[1][rows, :experts].contiguous(), cal[1][:experts, :experts].clone()
    sim = torch.block_diag(cal[1], cal[2])[:experts, :experts].clone()
    return torch.cat([per_layer[1][rows], per_layer[2][rows]], dim=1)[:, :experts].contiguous(), sim


def machine_limits() -> dict:
    x = torch.empty(256 * 1024 * 1024 // 4).normal_()
    bw = x.numel() * 4 / time_fn(lambda: x.sum(), repeats=5).median_s
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    peak = 2 * 2048**3 / time_fn(lambda: a @ b, repeats=5).median_s
    a16, b16 = a.bfloat16(), b.bfloat16()
    peak16 = 2 * 2048**3 / time_fn(lambda: a16 @ b16, repeats=3).median_s
    return {"bandwidth_gbs": bw / 1e9, "peak_gflops_float32": peak / 1e9, "peak_gflops_bfloat16": peak16 / 1e9}


def policies_for(top_k: int) -> list[tuple[str, dict | None]]:
    half = max(1, top_k // 2)
    rows = [("baseline", None)]
    for S in sorted({1, 2, half}):
        for rho in (0.0, 0.5):
            rows.append((f"sere S={S} rho={rho:g}", dict(policy="sere", S=S, rho=rho)))
    rows.append(("oea S=2", dict(policy="oea", S=2)))
    rows.append(("topk S=2", dict(policy="topk", S=2)))
    return rows


def expert_bytes(spec: dict, dtype: torch.dtype) -> int:
    return 3 * spec["hidden"] * spec["inter"] * torch.finfo(dtype).bits // 8


def run(args) -> dict:
    limits = machine_limits()
    print(f"machine: read bandwidth {limits['bandwidth_gbs']:.1f} GB/s, peak {limits['peak_gflops_float32']:.0f} "
          f"GFLOP/s float32, {limits['peak_gflops_bfloat16']:.0f} GFLOP/s bfloat16", flush=True)
    rows = []
    for name in args.layers:
        spec = LAYERS[name]
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            block, cfg = build_block(name, dtype)
            holder = Holder(block, cfg)
            g = torch.Generator().manual_seed(1)
            router = block.gate
            for routing in args.routing:
                if routing == "replay":
                    replay, sim = testbed_routing(max(args.batches), spec["experts"])
                    block.gate = ReplayRouter(replay, spec["top_k"], normalize=spec["family"] == "qwen3_moe")
                else:
                    block.gate = router
                    sim = torch.rand(spec["experts"], spec["experts"], generator=g) * 0.62
                    sim = ((sim + sim.T) / 2).fill_diagonal_(1.0)
                for impl in args.impls:
                    cfg._experts_implementation = impl
                    for batch in args.batches:
                        h = torch.randn(batch, 1, spec["hidden"], generator=g).to(dtype)
                        base_t = None
                        for label, kw in policies_for(spec["top_k"]):
                            if args.quick and label not in ("baseline", "sere S=2 rho=0.5", "sere S=2 rho=0", "oea S=2"):
                                continue
                            if kw is not None:
                                sere_fx.transform(holder, {0: sim} if kw["policy"] == "sere" else None,
                                                  max_tokens=None, **kw)
                            try:
                                with torch.no_grad():
                                    # the router's indices output is what the experts receive
                                    flat = h.reshape(-1, spec["hidden"])
                                    distinct = float(block.gate(flat)[2].unique().numel())
                                    t = time_fn(lambda b=block: b(h), repeats=args.repeats, warmup=2)
                                    op_us = None
                                    if kw is not None and kw["policy"] == "sere":
                                        with sere_fx.bypass():
                                            ids = block.gate(flat)[2]  # the op's real input
                                        op = time_fn(lambda: torch.ops.sere.reroute(ids, sim, kw["S"], kw["rho"]),
                                                     repeats=50)
                                        op_us = op.median_s * 1e6
                            finally:
                                if kw is not None:
                                    sere_fx.restore(holder)
                            if base_t is None:
                                base_t, base_distinct = t, distinct
                            nbytes = distinct * expert_bytes(spec, dtype)
                            flops = 2 * batch * spec["top_k"] * 3 * spec["hidden"] * spec["inter"]
                            peak = limits["peak_gflops_bfloat16" if dtype == torch.bfloat16 else "peak_gflops_float32"]
                            roof = max(nbytes / (limits["bandwidth_gbs"] * 1e9), flops / (peak * 1e9))
                            speedup = base_t.median_s / t.median_s
                            limit = base_distinct / distinct
                            row = dict(layer=name, dtype=dtype_name, impl=impl, routing=routing, batch=batch, policy=label,
                                       distinct=distinct, gbytes=nbytes / 1e9, median_ms=t.median_s * 1e3,
                                       p10_ms=t.p10_s * 1e3, p90_ms=t.p90_s * 1e3, repeats=t.repeats, speedup=speedup,
                                       limit=limit, efficiency=speedup / limit, op_us=op_us,
                                       op_pct=None if op_us is None else 100 * op_us / (t.median_s * 1e6),
                                       roofline_ms=roof * 1e3, roofline_bytes_ms=nbytes / (limits["bandwidth_gbs"] * 1e6),
                                       roofline_flops_ms=flops / (peak * 1e6))
                            rows.append(row)
                            op = "" if op_us is None else f" op {op_us:.0f}us ({row['op_pct']:.2f}%)"
                            print(f"{name:>16} {dtype_name:>8} {impl:>11} {routing:>7} B={batch:<3} {label:<17} "
                                  f"experts {distinct:6.1f} {nbytes / 1e9:5.2f} GB  {t.fmt()}  x{speedup:4.2f} "
                                  f"(limit {limit:4.2f}, eff {speedup / limit:4.2f})  roofline {roof * 1e3:6.1f} ms{op}",
                                  flush=True)
            del block, holder
    return {"machine": {**limits, "cpu_count": os.cpu_count(), "platform": platform.platform(),
                        "torch": torch.__version__, "threads": torch.get_num_threads()}, "rows": rows}


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = {}
    for r in result["rows"]:
        if r["policy"] == "baseline":
            continue
        groups.setdefault((r["layer"], r["dtype"], r["impl"], r["routing"], r["policy"]), []).append(r)
    keys = sorted({k[:4] for k in groups})
    cols = min(4, len(keys))
    nrows = -(-len(keys) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 4.0 * nrows), squeeze=False)
    for ax in axes.flat[len(keys):]:
        ax.axis("off")
    for ax, key in zip(axes.flat, keys):
        for k, rs in sorted(groups.items()):
            if k[:4] != key:
                continue
            rs = sorted(rs, key=lambda r: r["batch"])
            line = ax.plot([r["batch"] for r in rs], [r["speedup"] for r in rs], "o-", label=k[4])[0]
            ax.plot([r["batch"] for r in rs], [r["limit"] for r in rs], "--", color=line.get_color(), alpha=0.5)
        ax.set_xscale("log", base=2)
        ax.set_title(" / ".join(key), fontsize=9)
        ax.set_xlabel("batch (decode tokens)")
        ax.set_ylabel("speed-up vs baseline (dashed: limit)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser, default_out: str) -> None:
    p.add_argument("--layers", nargs="+", default=list(LAYERS), choices=list(LAYERS))
    p.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    p.add_argument("--impls", nargs="+", default=["grouped_mm", "sere_sparse"],
                   choices=["grouped_mm", "sere_sparse", "eager", "batched_mm"])
    p.add_argument("--routing", nargs="+", default=["uniform", "replay"], choices=["uniform", "replay"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 4, 8, 16, 32, 64])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="only baseline, SERE S=2 (rho 0 and 0.5) and OEA S=2")
    p.add_argument("--out", default=default_out)
    p.add_argument("--replot", action="store_true", help="only redraw the PNG from an existing --out JSON")


def main(args) -> int:
    if args.replot:
        with open(args.out) as f:
            plot(json.load(f), os.path.splitext(args.out)[0] + ".png")
        return 0
    # Made before the grid runs, so a run cannot end by failing to write (a bare file name has
    # no directory part: its folder is the working directory).
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    result = run(args)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.splitext(args.out)[0] + ".png")
    print(f"wrote {args.out} and {os.path.splitext(args.out)[0]}.png")
    return 0

