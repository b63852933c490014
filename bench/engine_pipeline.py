"""``eval`` and ``tune`` inside vLLM against the transformers path, on the test-bed: agreement and cost.

    python bench/engine_pipeline.py [--tp 1] [--out bench/results/engine_pipeline.json]

Runs the CLI as a user would, each command in its own process, fp32: ``tune --max-experts 0.5``
on the tuning half (tokens 0:40000) with each path, then ``eval`` of baseline, SERE, OEA,
``weight`` and both tuned plans on held-out windows (tokens 40000:) with each path. Reports each
command's wall time (engine start included), whether the two tuned plans are the same, and per
policy the accuracy, NLL and distinct experts of both evaluations.
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

from vllm_children import TESTBED, TESTBED_MODEL, testbed_similarity  # noqa: E402


def cli(argv: list[str], env: dict) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "sere_fx.cli", *argv], check=True, env=env, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return round(time.perf_counter() - start, 1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--out", default=os.path.join(HERE, "results", "engine_pipeline.json"))
    p.add_argument("--scratch", default=os.path.join(HERE, "results", ".engine_pipeline"))
    args = p.parse_args()
    os.makedirs(args.scratch, exist_ok=True)
    sim = testbed_similarity()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    if args.tp == 2:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    else:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    common = ["--model", TESTBED_MODEL, "--data", os.path.join(TESTBED, "eval_public.txt"), "--sim", sim,
              "--batch-size", "32"]
    engine = ["--engine", "vllm", "--tensor-parallel-size", str(args.tp)]
    plans = {name: os.path.join(args.scratch, f"plan_{name}.json") for name in ("transformers", "vllm")}
    tuning = [*common, "--token-range", "0:40000", "--num-seqs", "32", "--steps", "16", "--max-experts", "0.5"]
    seconds = {}
    seconds["tune transformers"] = cli(["tune", *tuning, "--out", plans["transformers"]], env)
    seconds["tune vllm"] = cli(["tune", *tuning, *engine, "--out", plans["vllm"]], env)
    tuned = {name: json.load(open(path)) for name, path in plans.items()}
    policies = ["baseline", "sere:S=2,rho=0", "oea:S=2", "weight:S=1,N=0.6", *(f"plan:{p}" for p in plans.values())]
    held_out = [*common, "--token-range", "40000:", "--num-seqs", "64", "--steps", "16", "--policies", *policies]
    outs = {name: os.path.join(args.scratch, f"eval_{name}") for name in ("transformers", "vllm")}
    seconds["eval transformers"] = cli(["eval", *held_out, "--out-dir", outs["transformers"]], env)
    seconds["eval vllm"] = cli(["eval", *held_out, *engine, "--out-dir", outs["vllm"]], env)
    reports = {name: json.load(open(os.path.join(path, "eval.json"))) for name, path in outs.items()}
    rows = []
    for a, b in zip(reports["transformers"]["results"], reports["vllm"]["results"]):
        rows.append({"label": a["label"], "accuracy": [a["accuracy"], b["accuracy"]], "nll": [a["nll"], b["nll"]],
                     "distinct": [a["distinct"], b["distinct"]]})
    result = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
              "tp": args.tp, "seconds": seconds,
              "same_plan": tuned["transformers"]["layers"] == tuned["vllm"]["layers"],
              "plans": {k: v["layers"] for k, v in tuned.items()},
              "scored_tokens": reports["vllm"]["config"]["scored_tokens"], "eval": rows}
    json.dump(result, open(args.out, "w"), indent=1)
    for name, s in seconds.items():
        print(f"{name}: {s} s")
    print("same tuned plan:", result["same_plan"])
    for r in rows:
        print(f"{r['label']:<28} acc {r['accuracy'][0]:.4f} / {r['accuracy'][1]:.4f}  nll {r['nll'][0]:.4f} / "
              f"{r['nll'][1]:.4f}  experts {r['distinct'][0]:.2f} / {r['distinct'][1]:.2f}  (transformers / vLLM)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
