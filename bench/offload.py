"""Offloaded experts on a real slow tier: tokens/s and fetches per token, per policy, against exact LRU.

Two parts, one run:

1. **Routing traces** (what each policy makes the experts read): the test-bed, offloaded with a cache
   of ``--cache`` of each layer's 64 experts, teacher-forced decode of held-out windows (tokens
   40000: of its public text; the similarity from ``--sim``, calibrated on 0:40000) at each batch
   size, every policy from an empty cache. Each decode step's per-layer expert ids and weights are
   recorded as the experts modules receive them.
2. **Replay at the Qwen3-30B-A3B expert shape** (on a GPU, ``--device cuda``: host memory is the slower tier) (hidden 2048, expert intermediate 768, bf16: 9.4 MB
   an expert), ``--layers`` layers of 64 experts each, their weights in files on this machine's disk
   (``sere_fx.offload``'s disk tier: every fetch is an ``O_DIRECT`` read, so the page cache is not
   what is measured), the same cache size: each recorded step runs through the same
   ``OffloadedExperts`` code the model uses, fetching its misses from the disk. Policies and
   repeats are interleaved (round r runs every policy once), and each policy's median step time
   gives tokens/s; the speed-up is against exact LRU in the same round, median and [min, max].

The limit beside each figure: the disk's sequential ``O_DIRECT`` bandwidth measured first (expert
blocks read in a random order), so ``fetch bytes per token / bandwidth`` is the least time a token can
take; ``limit`` is LRU's fetch time over the policy's, what the fetch ratio alone allows.

    python bench/offload.py --sim sim.safetensors --store /var/tmp/sere-offload --out bench/results/offload.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

import sere_fx
from sere_fx.calibration import read_documents, token_windows
from sere_fx.evaluate import decode_scores, paired_bootstrap, parse_policy
from sere_fx.expert_cache import cache_stats, offload, offloaded_layers, reset_caches
from sere_fx.resources import testbed_model, testbed_text

POLICIES = ("lru", "prior:S=1,rho=0.1", "prior:S=1,rho=0.2", "output:S=1,rho=5")


class _Experts(nn.Module):
    """Experts in transformers' fused layout at a given shape (random weights: only bytes and FLOPs count)."""

    def __init__(self, experts: int, hidden: int, inter: int, dtype, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.num_experts = experts
        self.gate_up_proj = nn.Parameter((torch.randn(experts, 2 * inter, hidden, generator=g) * 0.02).to(dtype))
        self.down_proj = nn.Parameter((torch.randn(experts, hidden, inter, generator=g) * 0.02).to(dtype))
        self.act_fn = nn.SiLU()


class _Block(nn.Module):
    def __init__(self, experts: nn.Module):
        super().__init__()
        self.experts = experts


class _Layers(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.layers = nn.ModuleList(blocks)


def traces(args, spec_texts):
    """Per policy, per batch size: the decode steps' ``[(ids, weights) per layer]`` and the eval row."""
    model = AutoModelForCausalLM.from_pretrained(testbed_model(), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(testbed_model())
    offload(model, args.cache, os.path.join(args.store, "testbed"), progress=False)
    held = token_windows(tokenizer, read_documents(testbed_text()), args.prefill + args.steps + 1, args.windows,
                         token_range=(40000, None))
    recorded: list = []
    decoding = [0]  # the batch size being traced (0: none)

    def hook(index):
        def record(module, inputs):
            if inputs[1].shape[0] == decoding[0]:  # a decode step (a prefill carries 4 rows per sequence)
                recorded.append((index, inputs[1].clone(), inputs[2].clone()))
        return record

    caches = offloaded_layers(model)
    handles = [model.model.layers[i].mlp.experts.register_forward_pre_hook(hook(i)) for i in caches]
    out = {}
    for b in args.batch_sizes:
        n = held.shape[0] - held.shape[0] % b
        windows = held[:n]
        base = None
        for text in spec_texts:
            spec = parse_policy(text)
            if spec.kwargs is not None:
                sere_fx.transform(model, args.sim, spec.routing(None), max_tokens=None)
            recorded.clear()
            decoding[0] = b
            try:
                s = decode_scores(model, windows, batch_size=b, prefill=args.prefill, progress=False)
            finally:
                decoding[0] = 0
                if spec.kwargs is not None:
                    sere_fx.restore(model)
            base = base or s
            ci = paired_bootstrap(base, s)
            steps, step = [], {}
            for index, ids, w in recorded:  # layers in order within a forward
                step[index] = (ids, w)
                if len(step) == len(caches):
                    steps.append([step[i] for i in sorted(step)])
                    step = {}
            fetches = sum(c["misses"] for c in s.cache.values()) / sum(c["tokens"] for c in s.cache.values())
            out[(text, b)] = {"steps": steps, "row": {
                "policy": text, "batch": b, "windows": n, "retention": s.accuracy / base.accuracy,
                "retention_ci": ci["retention_ci"], "dnll": s.mean_nll - base.mean_nll, "dnll_ci": ci["dnll_ci"],
                "testbed_fetches_per_token_per_layer": fetches}}
            print(f"trace batch {b} {text}: retention {s.accuracy / base.accuracy:.4f} "
                  f"[{ci['retention_ci'][0]:.4f}, {ci['retention_ci'][1]:.4f}], fetches/token/layer {fetches:.3f}",
                  flush=True)
    for h in handles:
        h.remove()
    return out


def disk_bandwidth(cache, reads: int = 32) -> float:
    """Bytes per second of reads of whole expert blocks from ``cache``'s store, in a random order."""
    out = tuple(t[0] for t in cache.slots)  # into slot 0, as the cache fetches (run before the cache is used)
    rng = random.Random(0)
    order = [rng.randrange(cache.num_experts) for _ in range(reads)]
    start = time.perf_counter()
    for e in order:
        cache.store.fetch(e, out, 0)
    return reads * cache.store.expert_bytes / (time.perf_counter() - start)


def replay(args, traced):
    dtype = getattr(torch, args.dtype)
    layers = _Layers([_Block(_Experts(64, args.hidden, args.inter, dtype, seed=i)) for i in range(args.layers)])
    layers.to(args.device)  # the cache lives where the experts compute; the store is the slower tier
    offload(layers, args.cache, os.path.join(args.store, "qwen3-30b-a3b-shape"), tier=args.tier, progress=True)
    caches = offloaded_layers(layers)
    probe = caches[0]
    bandwidth = disk_bandwidth(probe)
    print(f"slower tier: {bandwidth / 1e9:.2f} GB/s ({'disk, O_DIRECT=' + str(probe.store.direct) if hasattr(probe.store, 'path') else 'host memory'}), "
          f"expert {probe.store.expert_bytes / 1e6:.2f} MB", flush=True)
    results = []
    for b in args.batch_sizes:
        texts = [t for t, bb in traced if bb == b]
        times = {t: [] for t in texts}
        fetched = {}
        for r in range(args.rounds):
            for text in texts:
                steps = traced[(text, b)]["steps"][: args.replay_steps]
                reset_caches(layers)
                x = torch.randn(b, args.hidden).to(device=args.device, dtype=dtype)
                per_step = []
                with torch.no_grad():
                    for step in steps:
                        start = time.perf_counter()
                        for i in range(args.layers):  # 30B-shaped layer i replays test-bed layer i mod 4
                            ids, w = step[i % len(step)]
                            layers.layers[i].experts(x, ids.to(args.device), w.to(device=args.device, dtype=dtype))
                        if args.device != "cpu":
                            torch.cuda.synchronize()
                        per_step.append(time.perf_counter() - start)
                warm = per_step[len(per_step) // 8:]  # the first steps fill an empty cache
                times[text].append(statistics.median(warm))
                stats = cache_stats(layers)
                fetched[text] = sum(c.misses for c in stats.values()) / sum(c.tokens for c in stats.values())
        lru = texts[0]
        for text in texts:
            ratios = [a / c for a, c in zip(times[lru], times[text])]
            fetch_s = fetched[text] * probe.store.expert_bytes / bandwidth  # per token per layer
            row = dict(traced[(text, b)]["row"])
            row.update({
                "step_ms_median": 1e3 * statistics.median(times[text]), "step_ms_rounds": [1e3 * t for t in times[text]],
                "tokens_per_s": b / statistics.median(times[text]),
                "speedup_vs_lru": statistics.median(ratios), "speedup_range": [min(ratios), max(ratios)],
                "replay_fetches_per_token_per_layer": fetched[text],
                "fetch_bytes_per_token_per_layer": fetched[text] * probe.store.expert_bytes,
                "disk_limit_tokens_per_s": 1 / (fetch_s * args.layers) if fetch_s else float("inf"),
                "limit_vs_lru": fetched[lru] / fetched[text] if fetched[text] else float("inf")})
            results.append(row)
            print(f"batch {b} {text:<22} {row['tokens_per_s']:7.2f} tok/s  x{row['speedup_vs_lru']:.2f} "
                  f"[{row['speedup_range'][0]:.2f}, {row['speedup_range'][1]:.2f}] vs lru  fetches/token/layer "
                  f"{fetched[text]:.3f} (limit x{row['limit_vs_lru']:.2f}; disk limit {row['disk_limit_tokens_per_s']:.1f} "
                  f"tok/s)  retention {row['retention']:.4f} [{row['retention_ci'][0]:.4f}, {row['retention_ci'][1]:.4f}]",
                  flush=True)
    return results, bandwidth, getattr(probe.store, "direct", None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sim", required=True, help="the test-bed's similarity file (sere-fx calibrate, tokens 0:40000)")
    p.add_argument("--store", required=True, help="a directory on the disk to measure (about 2.4 GB is written)")
    p.add_argument("--policies", nargs="+", default=list(POLICIES), help="eval specs; the first is the baseline (lru)")
    p.add_argument("--cache", type=float, default=0.25, help="experts cached per layer, a fraction (default 0.25)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--windows", type=int, default=64, help="held-out windows traced (default 64)")
    p.add_argument("--prefill", type=int, default=4)
    p.add_argument("--steps", type=int, default=64, help="scored decode steps per window (default 64)")
    p.add_argument("--layers", type=int, default=4, help="30B-shaped layers replayed (default 4: the test-bed's)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--replay-steps", type=int, default=96, help="decode steps replayed per round (default 96)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the replayed layers compute and cache (default cuda where there is one)")
    p.add_argument("--tier", choices=["disk", "memory"], default=None,
                   help="the slower tier (default: disk on the CPU, host memory on a GPU)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    start = time.time()
    traced = traces(args, args.policies)
    results, bandwidth, direct = replay(args, traced)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"config": {k: v for k, v in vars(args).items()}, "disk_bytes_per_s": bandwidth, "o_direct": direct,
                   "machine": f"{os.cpu_count()} cores, torch {torch.__version__}", "seconds": time.time() - start,
                   "results": results}, f, indent=1)
    print(f"wrote {args.out} ({time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
