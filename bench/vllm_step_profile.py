"""Where a decode step's time goes inside a running vLLM engine, by the PyTorch profiler.

    python bench/vllm_step_profile.py --model qwen3-30b-a3b-shape --batches 1 8 16 32 64 \
        --out bench/results/vllm_step_profile_30b.json

For each policy one engine (in-process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the profiler
sees the worker; default compilation, Inductor kernels profiled by name) serves, at each of
``--batches``, that many 16-token prompts to ``--warmup`` + ``--tokens`` greedy tokens three
times: to warm up, timed, and under ``torch.profiler``. Reported per policy and batch:

- per MoE layer call: CPU time of the plugin's ops (``sere_native::engine_reroute``, the SERE
  step on the CPU, or ``sere::engine_reroute`` where the native op could not be built;
  ``sere::engine_rows``, the row mask the other policies read; their own work is in Inductor's
  fused kernels), of vLLM's fused-MoE op and of the router's kernels;
- per step: the wall time of an unprofiled pass over the same steps, and the part of it
  outside the MoE experts' kernel (the *non-MoE time*, which bounds any MoE speed-up; compare
  the end-to-end limit of ``bench/vllm_serve.py``).

Profiling adds ~1 us per recorded op; the figures are upper bounds of the unprofiled cost.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vllm_children import (MODELS, POLICIES, check_plan, config_of, model_and_similarity, parse_common, plan_settings,  # noqa: E402
                           policy_settings, run_settings, write_results)

MOE_KERNEL_NAMES = ("moe", "grouped_mm", "fused_experts")  # vLLM's CPU fused-MoE op names contain one of these


def one_engine(spec: dict) -> dict:
    import torch
    import torch._inductor.config as inductor_config
    from vllm import LLM, SamplingParams

    inductor_config.cpp.enable_kernel_profile = True  # Inductor kernels appear in the profile by name
    sere = spec["sere"]
    llm = LLM(model=spec["model"], dtype="bfloat16", additional_config={"sere": sere} if sere else {},
              max_model_len=512, max_num_seqs=max(spec["batches"]), seed=0, enable_prefix_caching=False)
    out = {}
    for batch in spec["batches"]:
        prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 4000 + 10 for j in range(16)]} for i in range(batch)]
        params = SamplingParams(max_tokens=spec["warmup"] + spec["tokens"], temperature=0.0, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)  # compile and warm every shape
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)  # the step time, unprofiled
        step_us = (time.perf_counter() - start) / (spec["warmup"] + spec["tokens"]) * 1e6
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            llm.generate(prompts, params, use_tqdm=False)
        events = {e.key: {"count": e.count, "total_us": e.cpu_time_total, "self_us": e.self_cpu_time_total}
                  for e in prof.key_averages()}
        out[str(batch)] = {"events": events, "step_us": step_us}
    return out


def off_plan(model: str, sim: str, cache: str) -> dict:
    """The plugin's settings for the 'off' policy: a two-range plan file (SERE S=2 at 1 row, off from 2)."""
    import sere_fx

    layers = json.load(open(os.path.join(model, "config.json")))["num_hidden_layers"]
    ranges = sere_fx.RowRanges(((1, sere_fx.SereConfig(S=2, rho=0.0)), (2, sere_fx.OFF)))
    path = os.path.join(cache, "off_from_2.plan.json")
    os.makedirs(cache, exist_ok=True)
    sere_fx.save_plan(path, {i: ranges for i in range(layers)})
    return {"plan": path, "sim": sim}


def summarize(name: str, events: dict, step_us: float, layers: int, steps: int) -> dict:
    def pick(pred):
        hits = {k: v for k, v in events.items() if pred(k)}
        return hits, sum(v["total_us"] for v in hits.values())

    sere_ops = {k: v for k, v in events.items() if k.startswith(("sere::", "sere_native::"))}
    moe, moe_us = pick(lambda k: any(n in k.lower() for n in MOE_KERNEL_NAMES) and k not in sere_ops
                       and "cpp_fused" not in k)
    out = {"policy": name, "per_call_us": {k: v["total_us"] / max(v["count"], 1) for k, v in sere_ops.items()},
           "calls": {k: v["count"] for k, v in sere_ops.items()}, "moe_kernels": sorted(moe)}
    out["moe_us_per_layer_call"] = moe_us / max(1, layers * steps)
    out["step_us"] = step_us  # wall time per step of an unprofiled pass (prefill step included)
    out["non_moe_us_per_step"] = step_us - layers * out["moe_us_per_layer_call"]
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=MODELS, default="qwen3-30b-a3b-shape")
    p.add_argument("--layers", type=int, default=2, help="decoder layers of the Qwen3-30B-A3B-shaped model")
    p.add_argument("--batches", type=int, nargs="+", default=[32], help="batch sizes (concurrent requests)")
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--policies", nargs="+", choices=list(POLICIES) + ["off", "plan"],
                   default=["plain", "sere", "oea", "weight"],
                   help="'off': a plan that follows the load, SERE at 1 row and off from 2 rows, so every step "
                        "of a batch >= 2 takes the ranged path's off branch (what an off step costs); "
                        "'plan': the plan file --plan")
    p.add_argument("--plan", default=None, help="the plan file of policy 'plan'")
    p.add_argument("--cache", default="/tmp/sere-bench", help="where a generated model goes")
    p.add_argument("--top", type=int, default=0, help="also print the N most expensive ops of each engine")
    args = parse_common(p, one_engine, argv)
    if args is None:  # a child process: its engine ran
        return {}
    check_plan(p, args)
    model, sim = model_and_similarity(args.model, args.cache, args.layers, args.sim)
    layers = json.load(open(os.path.join(model, "config.json")))["num_hidden_layers"]
    special = {"off": lambda: off_plan(model, sim, args.cache), "plan": lambda: plan_settings(args.plan, sim)}
    settings = {name: special[name]() if name in special else policy_settings(name, sim) for name in args.policies}
    raw = run_settings(os.path.abspath(__file__), settings,
                       {"model": model, "batches": args.batches, "warmup": args.warmup, "tokens": args.tokens},
                       env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    steps = args.warmup + args.tokens  # decode steps in the profiled pass (one prefill step besides)
    results = {"config": config_of(args), "policies": {}}
    for batch in map(str, args.batches):
        print(f"{args.model}, batch {batch}: per MoE layer call (profiled) and per step, us")
        for name, per_batch in raw.items():
            r = per_batch[batch]
            s = summarize(name, r["events"], r["step_us"], layers, steps)
            results["policies"].setdefault(name, {})[batch] = {**s, "events": r["events"]}
            ops = ", ".join(f"{k} {v:.1f}" for k, v in s["per_call_us"].items()) or "-"
            print(f"  {name:7s} plugin ops per call: {ops}; fused-MoE {s['moe_us_per_layer_call']:.0f} per layer call; "
                  f"step {s['step_us']:.0f} (unprofiled), of which non-MoE {s['non_moe_us_per_step']:.0f}")
            if args.top:
                top = sorted(r["events"].items(), key=lambda kv: -kv[1]["self_us"])[: args.top]
                for k, v in top:
                    print(f"      {v['self_us'] / max(v['count'], 1):9.1f} us x {v['count']:6d}  {k[:90]}")
    return write_results(args.out, results)


if __name__ == "__main__":
    main()
