"""GPU checks, as one script for a lent CUDA machine (nothing here runs in CI).

1. Triton re-routing kernels == PyTorch implementation on CUDA (many random cases, ties; rank
   values, valid and free rows, ids outside [0, E); prefill-sized steps of up to 8192 rows).
2. Kernel timing: 128 experts, top-8, batch 1..64 and a 4096-row prefill step with no decode
   row (the early exit), CUDA events, median of 200; target <= 10 us.
3. torch.compile on CUDA: SERE backend, fullgraph decode step of a tiny model == eager transform.
4. MoE-layer latency at Qwen3-30B-A3B size (bf16, grouped_mm): baseline vs SERE, speed-up vs limit.
5. TensorRT export of a tiny transformed model, if torch-tensorrt imports.
6. The serving benchmark on CUDA, if vLLM imports: bench/vllm_serve.py on the 2-layer
   Qwen3-30B-A3B-shaped model, plain / sere / oea, concurrency 1-64, one round, within
   --server-timeout seconds (its JSON and plot go to DIR).

    python bench/gpu_check.py [--out DIR]      # JSON summary to DIR/gpu_check.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import sere_fx  # noqa: E402
from sere_fx import ops  # noqa: E402
from sere_fx.benchmark import time_fn  # noqa: E402


def cuda_time_us(fn, repeats: int = 200) -> float:
    """Median microseconds per call on the GPU (``triton.testing.do_bench`` via ``time_fn``)."""
    return time_fn(fn, repeats=repeats, warmup=10, device="cuda").median_s * 1e6


def check_kernel() -> dict:
    g = torch.Generator().manual_seed(0)
    bad = 0
    for trial in range(300):
        e = int(torch.randint(2, 257, (1,), generator=g))
        k = int(torch.randint(1, min(e, 8) + 1, (1,), generator=g))
        t = int(torch.randint(1, 129, (1,), generator=g))
        s = int(torch.randint(1, k + 1, (1,), generator=g))
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).cuda()
        sim = (torch.round(torch.rand(e, e, generator=g) * 8) / 8).cuda()
        rho = [0.0, 0.5, 0.3][trial % 3]
        a = ops.reroute_aten(ids, sim, s, rho)
        b = torch.ops.sere.reroute(ids, sim, s, rho)  # Triton on CUDA
        bad += int(not torch.equal(a, b))
    # the engine's call: rank values, valid rows (decode), free rows (prompt rows), padding ids;
    # prefill-sized steps exercise the row-parallel first phase across many programs
    engine_bad = 0
    for trial, t in enumerate((1, 31, 33, 700, 4096, 8192)):
        e, k, s = 128, 8, 2
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
        ids[torch.rand(ids.shape, generator=g) < 0.02] = -1
        values = torch.rand(ids.shape, generator=g)
        valid = torch.rand(t, generator=g) < 0.5
        free = ~valid & (torch.rand(t, generator=g) < 0.5)
        sim = torch.rand(e, e, generator=g)
        args = [x.cuda() for x in (ids, sim)]
        for rho in (0.0, 0.5):
            a = ops.reroute_aten(args[0], args[1], s, rho, values.cuda(), valid.cuda(), free.cuda())
            b = torch.ops.sere.reroute(args[0], args[1], s, rho, values.cuda(), valid.cuda(), free.cuda())
            engine_bad += int(not torch.equal(a, b))
    return {"cases": 300, "mismatches": bad, "engine_cases": 12, "engine_mismatches": engine_bad}


def time_kernel() -> dict:
    out = {}
    sim = torch.rand(128, 128, device="cuda")
    for batch in (1, 16, 32, 64):
        ids = torch.stack([torch.randperm(128)[:8] for _ in range(batch)]).cuda()
        tri = cuda_time_us(lambda: torch.ops.sere.reroute(ids, sim, 2, 0.5))
        ref = cuda_time_us(lambda: ops.reroute_aten(ids, sim, 2, 0.5))
        out[batch] = {"triton_us": tri, "pytorch_us": ref}
        print(f"  reroute E=128 K=8 B={batch}: triton {tri:.1f} us, pytorch {ref:.1f} us", flush=True)
    ids = torch.stack([torch.randperm(128)[:8] for _ in range(4096)]).cuda()
    values, none = torch.rand(ids.shape, device="cuda"), torch.zeros(4096, dtype=torch.bool, device="cuda")
    out["prefill_4096_no_decode_rows"] = {"triton_us": cuda_time_us(
        lambda: torch.ops.sere.reroute(ids, sim, 2, 0.5, values, none, ~none))}
    print(f"  reroute 4096 prompt rows, no decode row: {out['prefill_4096_no_decode_rows']['triton_us']:.1f} us",
          flush=True)
    return out


def check_compile() -> dict:
    from transformers import StaticCache

    from sere_fx.discovery import find_moe_layers
    from sere_fx.evaluate import cache_kwarg
    from tiny_models import random_similarity, tiny_model

    model = tiny_model("qwen3_moe", experts_implementation="grouped_mm").cuda()
    sim = random_similarity(find_moe_layers(model), seed=5)
    ref = sere_fx.transform(copy.deepcopy(model), sim, S=1, rho=0.0)
    step = torch.compile(model, backend=sere_fx.backend(sim, S=1, rho=0.0), fullgraph=True)
    prompt = torch.randint(3, 90, (4, 5), device="cuda")
    nxt = torch.randint(3, 90, (4, 1), device="cuda")
    caches = [StaticCache(config=model.config, max_cache_len=16) for _ in range(2)]
    kw = cache_kwarg(model)
    with torch.no_grad(), sere_fx.bypass():
        model(prompt, **{kw: caches[0]}, use_cache=True)
        ref(prompt, **{kw: caches[1]}, use_cache=True)
    pos = torch.tensor([5], device="cuda")
    with torch.no_grad():
        got = step(nxt, **{kw: caches[0]}, use_cache=True, cache_position=pos).logits
        exp = ref(nxt, **{kw: caches[1]}, use_cache=True, cache_position=pos).logits
    return {"max_abs_diff": float((got - exp).abs().max())}


def moe_layer() -> list:
    from sere_fx.layer_bench import Holder, build_block

    block, cfg = build_block("qwen3-30b-a3b", torch.bfloat16)
    block = block.cuda()
    holder = Holder(block, cfg)
    g = torch.Generator().manual_seed(1)
    sim = torch.rand(128, 128, generator=g) * 0.62
    sim = ((sim + sim.T) / 2).fill_diagonal_(1.0)
    rows = []
    for batch in (1, 8, 16, 32, 64):
        h = torch.randn(batch, 1, 2048, device="cuda", dtype=torch.bfloat16)
        res = {}
        for label, kw in (("baseline", None), ("sere S=2 rho=0.5", dict(S=2, rho=0.5)), ("sere S=2 rho=0", dict(S=2, rho=0.0))):
            kw = kw or dict(S=8, rho=0.0)
            sere_fx.transform(holder, {0: sim}, max_tokens=None, stats=True, **kw)
            with torch.no_grad():
                block(h)
            st = sere_fx.routing_stats(holder)[0]
            sere_fx.restore(holder)
            sere_fx.transform(holder, {0: sim}, max_tokens=None, **kw)
            with torch.no_grad():
                us = cuda_time_us(lambda: block(h), repeats=50)
            sere_fx.restore(holder)
            res[label] = (us, st.distinct_after / st.calls)
        base_us, base_d = res["baseline"]
        for label, (us, d) in res.items():
            row = {"batch": batch, "policy": label, "us": us, "distinct": d, "speedup": base_us / us, "limit": base_d / d}
            row["efficiency"] = row["speedup"] / row["limit"]
            rows.append(row)
            print(f"  qwen3 layer bf16 B={batch} {label}: {us:.0f} us, experts {d:.0f}, x{row['speedup']:.2f} "
                  f"(limit {row['limit']:.2f}, eff {row['efficiency']:.2f})", flush=True)
    return rows


def tensorrt() -> dict:
    from sere_fx.discovery import find_moe_layers
    from sere_fx.exporters import export
    from tiny_models import random_similarity, tiny_model

    model = tiny_model("qwen3_moe", experts_implementation="grouped_mm")
    sere_fx.transform(model, random_similarity(find_moe_layers(model)), S=1, rho=0.0, max_tokens=None)
    path = export(model, torch.randint(3, 90, (2, 6)), "/tmp/sere_trt.ts", format="tensorrt")
    return {"path": path, "bytes": os.path.getsize(path)}


def server(out_dir: str, timeout_s: int) -> dict:
    import subprocess

    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        return {"skipped": f"vLLM does not import here ({exc})"}
    out = os.path.join(out_dir, "vllm_serve_cuda.json")
    cmd = [sys.executable, os.path.join(HERE, "vllm_serve.py"), "--model", "qwen3-30b-a3b-shape", "--policies",
           "plain", "sere", "oea", "--datasets", "random", "--output-len", "32", "--repeats", "1", "--out", out]
    done = subprocess.run(cmd, timeout=timeout_s, capture_output=True, text=True)
    print(done.stdout[-4000:], flush=True)
    if done.returncode != 0:
        raise RuntimeError(f"vllm_serve.py exited {done.returncode}: {done.stderr[-1500:]}")
    return {"json": out, "table": json.load(open(out))["table"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--server-timeout", type=int, default=330, help="seconds for the serving benchmark (check 6)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here")
        return 2
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    summary = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    os.makedirs(args.out, exist_ok=True)
    for name, fn in (("kernel", check_kernel), ("kernel_timing", time_kernel), ("compile", check_compile),
                     ("moe_layer", moe_layer), ("tensorrt", tensorrt),
                     ("server", lambda: server(args.out, args.server_timeout))):
        start = time.perf_counter()
        try:
            summary[name] = fn()
            status = "ok"
        except Exception as exc:  # report and go on: one failed check must not hide the others
            summary[name] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]}
            status = f"FAILED ({type(exc).__name__}: {str(exc)[:200]})"
        print(f"[{name}] {status} in {time.perf_counter() - start:.1f} s", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
