"""Calibration inside vLLM against the transformers path: agreement of the files, and cost.

    python bench/calibration_engine.py [--out bench/results/calibration_engine.json]

Agreement (test-bed, 32 windows x 64 tokens of the public text, the same windows for every run):
engine fp32 at TP=1 and TP=2 and engine bf16 against transformers at the same dtype, and, for
scale, transformers bf16 against transformers fp32: per layer the largest |difference| of the
matrices and predictors, and how often each expert's most similar other expert is the same.
Cost: seconds of the calibration pass itself (after the engine or model is loaded), per 100k
tokens, on the test-bed and on a 2-layer Qwen3-30B-A3B-shaped model (bf16, random weights) with
a small token count (calibration is linear in tokens). Each configuration runs in its own
process.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from vllm_children import TESTBED, TESTBED_MODEL, build_qwen3_30b_shape  # noqa: E402


def windows_of(model: str, num_seqs: int, seq_len: int):
    from transformers import AutoTokenizer

    from sere_fx.calibration import read_documents, token_windows

    return token_windows(AutoTokenizer.from_pretrained(model), read_documents(os.path.join(TESTBED, "eval_public.txt")),
                         seq_len, num_seqs)


def child(spec: dict) -> dict:
    """One calibration run: ``spec`` = engine, model, dtype, method, tp, num_seqs, seq_len, out."""
    import torch

    windows = windows_of(spec["model"], spec["num_seqs"], spec["seq_len"])
    if spec["engine"] == "vllm":
        from vllm import LLM

        from sere_fx.calibration import calibrate_engine

        llm = LLM(model=spec["model"], dtype=spec["dtype"], enforce_eager=True, enable_prefix_caching=False,
                  tensor_parallel_size=spec["tp"], max_model_len=spec["seq_len"] + 1, seed=0)
        start = time.perf_counter()
        sim = calibrate_engine(llm, windows, spec["method"], progress=False)
    else:
        from transformers import AutoModelForCausalLM

        from sere_fx.calibration import batched, calibrate

        model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=getattr(torch, spec["dtype"])).eval()
        start = time.perf_counter()
        sim = calibrate(model, batched(windows, 16), spec["method"], progress=False)
    seconds = time.perf_counter() - start
    sim.save(spec["out"])
    return {**spec, "tokens": sim.metadata["tokens"], "seconds": round(seconds, 2),
            "seconds_per_100k_tokens": round(seconds * 1e5 / sim.metadata["tokens"], 1)}


def run(spec: dict) -> dict:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    if spec.get("tp", 1) == 2:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    else:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    path = spec["out"] + ".json"
    subprocess.run([sys.executable, __file__, "--child", json.dumps(spec), path], check=True, env=env,
                   stdout=subprocess.DEVNULL)
    return json.load(open(path))


def agreement(a_path: str, b_path: str) -> dict:
    import torch

    from sere_fx import Similarity

    a, b = Similarity.load(a_path), Similarity.load(b_path)
    best = lambda m: (m - 2 * torch.eye(m.shape[0])).argmax(dim=1)  # noqa: E731
    return {str(layer): {"max_abs_sim": float((a[layer] - b[layer]).abs().max()),
                         "max_abs_predictor": float((a.predictors[layer] - b.predictors[layer]).abs().max()),
                         "best_match_agreement": float((best(a[layer]) == best(b[layer])).float().mean())}
            for layer in sorted(a)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(HERE, "results", "calibration_engine.json"))
    p.add_argument("--scratch", default=os.path.join(HERE, "results", ".calibration_engine"))
    p.add_argument("--big-tokens", type=int, default=512, help="tokens for the 30B-shaped cost runs")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        json.dump(child(json.loads(args.child[0])), open(args.child[1], "w"))
        return 0
    os.makedirs(args.scratch, exist_ok=True)
    small = dict(model=TESTBED_MODEL, num_seqs=32, seq_len=64)
    runs = {}
    for method in ("frobenius", "cka"):
        for name, spec in [("hf_fp32", dict(engine="transformers", dtype="float32")),
                           ("hf_bf16", dict(engine="transformers", dtype="bfloat16")),
                           ("vllm_fp32_tp1", dict(engine="vllm", dtype="float32", tp=1)),
                           ("vllm_fp32_tp2", dict(engine="vllm", dtype="float32", tp=2)),
                           ("vllm_bf16_tp1", dict(engine="vllm", dtype="bfloat16", tp=1))]:
            if method == "cka" and name == "vllm_fp32_tp2":
                continue
            key = f"{name}_{method}"
            runs[key] = run({**small, **spec, "tp": spec.get("tp", 1), "method": method,
                             "out": os.path.join(args.scratch, f"{key}.safetensors")})
            print(key, runs[key]["seconds"], "s", flush=True)
    pairs = {f"{method}: {a} vs {b}": agreement(runs[f"{a}_{method}"]["out"], runs[f"{b}_{method}"]["out"])
             for method in ("frobenius", "cka")
             for a, b in [("vllm_fp32_tp1", "hf_fp32"), ("vllm_fp32_tp2", "hf_fp32"), ("vllm_bf16_tp1", "hf_bf16"),
                          ("hf_bf16", "hf_fp32")] if f"{a}_{method}" in runs}
    big_model = build_qwen3_30b_shape(os.path.join(args.scratch, "qwen3_30b_shape_2l"), 2)
    big = dict(model=big_model, num_seqs=args.big_tokens // 64, seq_len=64, method="frobenius", dtype="bfloat16")
    cost = {name: run({**big, **spec, "out": os.path.join(args.scratch, f"big_{name}.safetensors")})
            for name, spec in [("transformers", dict(engine="transformers", tp=1)),
                               ("vllm_tp1", dict(engine="vllm", tp=1)), ("vllm_tp2", dict(engine="vllm", tp=2))]}
    result = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
              "agreement": pairs, "testbed_runs": runs, "qwen3_30b_shape_2_layers": cost}
    json.dump(result, open(args.out, "w"), indent=1)
    for name, layers in pairs.items():
        worst = {k: max(v[k] for v in layers.values()) for k in ("max_abs_sim", "max_abs_predictor")}
        print(f"{name}: max|dsim| {worst['max_abs_sim']:.2e}, max|dpredictor| {worst['max_abs_predictor']:.2e}, "
              f"best match same {min(v['best_match_agreement'] for v in layers.values()):.3f}")
    for name, r in cost.items():
        print(f"30B shape, 2 layers, {name}: {r['seconds']} s for {r['tokens']} tokens = "
              f"{r['seconds_per_100k_tokens']} s per 100k tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
