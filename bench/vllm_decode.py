"""Decode throughput of vLLM on the CPU with and without the sere-fx plugin.

    python bench/vllm_decode.py --model testbed --out bench/results/vllm_decode_testbed.json
    python bench/vllm_decode.py --model qwen3-30b-a3b-shape --out bench/results/vllm_decode_qwen3_30b.json

For each policy (``baseline`` = plain vLLM, ``sere`` = S=2 rho=0, ``oea`` = S=2) one engine
is started in its own process with vLLM's default compilation; at each batch size B it
generates ``--new-tokens`` greedy tokens for B short prompts (``ignore_eos``), ``--repeats``
times, and reports output tokens/s (median and range) and the ratio to the baseline of the
same batch size. Each plugin policy then runs once more in a second engine with ``stats`` on
(an extra op per layer that costs more than the re-routing itself, so that engine is not
timed) for the distinct experts per layer per decode step before and after re-routing:
``limit`` = before / after is what the MoE layers' weight traffic allows at most.

Models: ``testbed`` (../shared/testbed/model) or ``qwen3-30b-a3b-shape``: a Qwen3-MoE with
Qwen3-30B-A3B's MoE and attention sizes (128 experts, top-8, hidden 2048, expert 768, 32 x
128 query heads, 4 KV heads) but ``--layers`` decoder layers and the test-bed's 4k
vocabulary, random bf16 weights written once to ``--cache``. Its similarity is random (at
rho = 0 the distinct-expert count does not depend on it; quality is not measured here).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TESTBED = os.path.abspath(os.path.join(HERE, "..", "..", "shared", "testbed"))
POLICIES = {"baseline": None, "sere": {"S": 2, "rho": 0.0}, "oea": {"policy": "oea", "S": 2}}


def build_qwen3_30b_shape(out_dir: str, layers: int) -> str:
    import shutil

    import torch
    import transformers

    if os.path.isfile(os.path.join(out_dir, "config.json")):
        return out_dir
    print(f"writing a {layers}-layer Qwen3-30B-A3B-shaped model to {out_dir} ...", flush=True)
    config = transformers.Qwen3MoeConfig(
        vocab_size=4096, hidden_size=2048, intermediate_size=6144, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, norm_topk_prob=True, max_position_embeddings=2048, tie_word_embeddings=True,
        eos_token_id=0, pad_token_id=0, bos_token_id=0,
    )
    torch.manual_seed(0)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    model.save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(TESTBED, "model", name), out_dir)
    return out_dir


def similarity_for(model_dir: str, out: str, random: bool) -> str:
    if os.path.isfile(out):
        return out
    if random:
        import json as _json

        import torch

        from sere_fx import Similarity

        cfg = _json.load(open(os.path.join(model_dir, "config.json")))
        g = torch.Generator().manual_seed(0)
        e = cfg.get("num_experts") or cfg["num_local_experts"]
        mats = {}
        for i in range(cfg["num_hidden_layers"]):
            m = torch.rand(e, e, generator=g)
            mats[i] = ((m + m.T) / 2).fill_diagonal_(1.0)
        Similarity(mats, {"architecture": cfg["architectures"][0], "method": "random"}).save(out)
    else:
        subprocess.run([sys.executable, "-m", "sere_fx.cli", "calibrate", "--model", model_dir, "--data",
                        os.path.join(TESTBED, "eval_public.txt"), "--token-range", "0:40000", "--num-seqs", "256",
                        "--seq-len", "128", "--out", out], check=True)
    return out


def engine_run(spec: dict) -> dict:
    """Runs inside the child process: one engine, every batch size."""
    from vllm import LLM, SamplingParams

    import sere_fx.vllm

    sere = spec["sere"]
    llm = LLM(model=spec["model"], dtype="bfloat16", additional_config={"sere": sere} if sere else {},
              max_model_len=512, max_num_seqs=max(spec["batches"]), gpu_memory_utilization=0.5, seed=0)
    words = ["def", "class", "import", "return", "for", "while", "with", "if"]
    params = SamplingParams(max_tokens=spec["new_tokens"], temperature=0.0, ignore_eos=True)
    rows = []
    for batch in spec["batches"]:
        prompts = [f"{words[i % 8]} item_{i}(self, value):" for i in range(batch)]
        if sere and sere.get("stats"):  # the counting engine: one pass, not timed
            sere_fx.vllm.reset_routing_stats(llm)
            llm.generate(prompts, params, use_tqdm=False)
            stats = sere_fx.vllm.routing_stats(llm)
            row = {"batch": batch, "distinct_before": statistics.mean(s["distinct_before"] for s in stats.values()),
                   "distinct_after": statistics.mean(s["distinct_after"] for s in stats.values())}
            rows.append(row)
            print(json.dumps(row), flush=True)
            continue
        llm.generate(prompts, params, use_tqdm=False)  # warm-up at this batch size
        rates = []
        for _ in range(spec["repeats"]):
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed)
        row = {"batch": batch, "tokens_per_s": statistics.median(rates), "min": min(rates), "max": max(rates)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return {"rows": rows}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["testbed", "qwen3-30b-a3b-shape"], default="testbed")
    p.add_argument("--layers", type=int, default=2, help="decoder layers of the Qwen3-30B-A3B-shaped model")
    p.add_argument("--batches", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--policies", nargs="+", choices=list(POLICIES), default=list(POLICIES))
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cache", default="/tmp/sere-bench", help="where the generated model and similarity go")
    p.add_argument("--out", required=True)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        spec = json.load(open(args.child))
        json.dump(engine_run(spec), open(spec["result"], "w"))
        return
    os.makedirs(args.cache, exist_ok=True)
    if args.model == "testbed":
        model = os.path.join(TESTBED, "model")
        sim = similarity_for(model, os.path.join(args.cache, "testbed.sim.safetensors"), random=False)
    else:
        model = build_qwen3_30b_shape(os.path.join(args.cache, f"qwen3_30b_a3b_shape_{args.layers}l"), args.layers)
        sim = similarity_for(model, os.path.join(args.cache, f"qwen3_30b_a3b_shape_{args.layers}l.sim.safetensors"),
                             random=True)
    results = {"model": args.model, "model_dir": model, "config": vars(args), "policies": {}}
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    def child(name, sere):
        spec = {"model": model, "sere": sere, "batches": args.batches, "new_tokens": args.new_tokens,
                "repeats": args.repeats, "result": os.path.join(args.cache, f"{name}.result.json")}
        spec_path = os.path.join(args.cache, f"{name}.spec.json")
        json.dump(spec, open(spec_path, "w"))
        print(f"== {name}", flush=True)
        subprocess.run([sys.executable, os.path.abspath(__file__), "--out", args.out, "--child", spec_path],
                       check=True, env=env, stdout=sys.stdout, stderr=subprocess.DEVNULL)
        return json.load(open(spec["result"]))["rows"]

    for policy in args.policies:
        sere = None if POLICIES[policy] is None else dict(POLICIES[policy])
        if sere and sere.get("policy", "sere") == "sere":
            sere["sim"] = sim
        rows = child(policy, sere)
        if sere:
            for row, counted in zip(rows, child(f"{policy}-stats", {**sere, "stats": True})):
                row.update(distinct_before=counted["distinct_before"], distinct_after=counted["distinct_after"])
        results["policies"][policy] = rows
    base = {r["batch"]: r["tokens_per_s"] for r in results["policies"].get("baseline", [])}
    print(f"\n{args.model}: output tokens/s, median [min, max] of {args.repeats}; ratio to baseline; "
          "distinct experts per layer per decode step before -> after; limit = before / after")
    for policy, rows in results["policies"].items():
        for r in rows:
            ratio = r["tokens_per_s"] / base[r["batch"]] if r["batch"] in base else float("nan")
            r["ratio"] = ratio
            line = f"  {policy:8s} B={r['batch']:3d}  {r['tokens_per_s']:8.1f} [{r['min']:.1f}, {r['max']:.1f}]  x{ratio:.2f}"
            if "distinct_after" in r:
                r["limit"] = r["distinct_before"] / r["distinct_after"]
                line += f"  experts {r['distinct_before']:.1f} -> {r['distinct_after']:.1f}  limit x{r['limit']:.2f}"
            print(line)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
