"""Cost of the plugin's routing step per MoE layer call, on vLLM's own CPU router.

    python bench/vllm_routing.py [--tokens 32] [--experts 128] [--top-k 8] [--repeats 2000]

Times, in one process with one thread (as a vLLM CPU worker runs): the router alone
(``CPURouter._compute_routing``, the baseline), the router with each policy installed, and
the engine ops alone (``sere_native.engine_reroute``: the SERE step's op on the CPU;
``sere.engine_reroute``: its Python op, used where the native one cannot be built;
``sere.engine_rows``: the row mask the other policies read, and its native op) and ``sere.reroute`` as a plain
eager call. Reports median and [p10, p90] of 15 batches of ``--repeats`` calls each; all rows are decode rows. These are
warm-cache figures: inside an engine, between two layers' big matrix products, each call
starts with cold caches and costs more (see bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import os
import sys
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vllm_children import write_results  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from sere_fx.benchmark import time_fn  # noqa: E402


def timed(fn, repeats: int, batches: int = 15):
    """Microseconds per call: median and spread over ``batches`` samples of ``repeats`` calls."""
    t = time_fn(fn, repeats=batches, warmup=repeats // 4, number=repeats)
    return {"median_us": t.median_s * 1e6, "p10_us": t.p10_s * 1e6, "p90_us": t.p90_s * 1e6}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--S", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2000)
    p.add_argument("--out", default=None, help="also write the results as JSON here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter

    import sere_fx  # noqa: F401  (registers sere.reroute)
    from sere_fx import OEAConfig, SereConfig, TopKConfig, WeightConfig
    from sere_fx.vllm import engine
    from sere_fx.vllm.routing import LayerRouting, RouterScores, install

    T, E, K = args.tokens, args.experts, args.top_k
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(T, E, generator=g)
    hidden = torch.zeros(T, 16)
    sim = torch.rand(E, E, generator=g)
    engine.ENGINE.allocate(max(T, 1), max(T, 1), "cpu")
    step = SimpleNamespace(scheduled_new_reqs=[], finished_req_ids=set(), scheduled_spec_decode_tokens={})
    engine.ENGINE.plan_step(step, [str(i) for i in range(T)], np.zeros(T, dtype=bool),  # T decode requests
                            torch.arange(T + 1, dtype=torch.int32))
    engine.ENGINE.refresh()

    results = {"config": vars(args)}
    torch.inference_mode().__enter__()  # as vLLM runs its forward passes
    plain = CPURouter(top_k=K, global_num_experts=E, renormalize=True)
    results["router"] = timed(lambda: plain._compute_routing(hidden, logits, None), args.repeats)
    for name, plan in [("sere", SereConfig(S=args.S, rho=0.0)), ("oea", OEAConfig(S=args.S)),
                       ("topk", TopKConfig(S=args.S)), ("weight", WeightConfig(S=1, N=0.6))]:
        router = CPURouter(top_k=K, global_num_experts=E, renormalize=True)
        install(router, LayerRouting(0, plan, RouterScores.of(router), sim, E, False, native_rows=engine.ENGINE.native))
        results[f"router+{name}"] = timed(lambda r=router: r._compute_routing(hidden, logits, None), args.repeats)
    weights, ids = plain._compute_routing(hidden, logits, None)
    rows, _ = torch.ops.sere.engine_rows(ids, E)
    results["engine_rows op"] = timed(lambda: torch.ops.sere.engine_rows(ids, E), args.repeats)
    results["engine_reroute op"] = timed(lambda: torch.ops.sere.engine_reroute(ids, sim, args.S, 0.0, weights),
                                         args.repeats)
    from sere_fx.kernels import reroute_cpu

    if engine.ENGINE.native:  # the SERE step the plugin runs on the CPU (router+sere calls it too)
        sim32, cand = reroute_cpu.candidates(sim)
        native = torch.ops.sere_native.engine_reroute.default
        results["engine_reroute native op"] = timed(lambda: native(ids, sim32, cand, args.S, 0.0, weights), args.repeats)
        rows_native = torch.ops.sere_native.engine_rows.default
        results["engine_rows native op"] = timed(lambda: rows_native(ids, E), args.repeats)
    results["reroute op"] = timed(lambda: torch.ops.sere.reroute(ids, sim, args.S, 0.0, weights, rows), args.repeats)
    base = results["router"]["median_us"]
    print(f"T={T} E={E} K={K} S={args.S}, 1 thread; per layer call, median [p10, p90] in us")
    for name, r in results.items():
        if name == "config":
            continue
        extra = f"  (+{r['median_us'] - base:.1f} us over the router)" if name.startswith("router+") else ""
        print(f"  {name:16s} {r['median_us']:8.1f}  [{r['p10_us']:.1f}, {r['p90_us']:.1f}]{extra}")
    return write_results(args.out, results)


if __name__ == "__main__":
    main()
