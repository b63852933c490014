"""Speculative decoding under the plugin: draft acceptance and distinct experts, plain vLLM vs SERE.

    python bench/vllm_spec_decode.py --out bench/results/vllm_spec_decode_testbed.json

ngram speculation (``--k`` draft tokens) on the test-bed model, greedy, prompts from the
test-bed's public text (code repeats itself, so n-gram drafts are accepted often). One engine
per setting, each in its own process: ``plain`` (no plugin), ``reroute`` (SERE S=2 rho=0, the
1+k verification rows re-routed: the default), ``keep`` (``spec_decode: "keep"``: requests
with drafts keep the model's routing). Reported per setting: acceptance rate (accepted over
drafted tokens, vLLM's own counters), mean accepted length, output tokens/s of the whole
generate call (one run: a first look, not a speed claim; the serving benchmark times), and,
for the plugin settings, distinct experts per layer per step before / after re-routing (the
bytes limit) from ``routing_stats``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TESTBED = os.path.abspath(os.path.join(HERE, "..", "..", "shared", "testbed"))
SETTINGS = {"plain": None, "reroute": {"S": 2, "rho": 0.0}, "keep": {"S": 2, "rho": 0.0, "spec_decode": "keep"}}


def one_engine(spec: dict) -> dict:
    """Runs inside the child process: one engine, one generate call."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    text = open(os.path.join(TESTBED, "eval_public.txt")).read()
    ids = tokenizer(text[:400_000])["input_ids"]
    prompts = [{"prompt_token_ids": ids[i * 997: i * 997 + spec["prompt_len"]]} for i in range(spec["prompts"])]
    sere = spec["sere"]
    if sere is not None:
        sere = {**sere, "sim": spec["sim"], "stats": True}
    llm = LLM(model=spec["model"], dtype="bfloat16", max_model_len=1024, max_num_seqs=spec["prompts"],
              additional_config={"sere": sere} if sere else {}, disable_log_stats=False, seed=0,
              speculative_config={"method": "ngram", "num_speculative_tokens": spec["k"], "prompt_lookup_max": 4,
                                  "prompt_lookup_min": 2})
    params = SamplingParams(max_tokens=spec["new_tokens"], temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    counters = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    drafted = counters.get("vllm:spec_decode_num_draft_tokens") or 0
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens") or 0
    drafts = counters.get("vllm:spec_decode_num_drafts") or 0
    result = {
        "tokens_per_s": sum(len(o.outputs[0].token_ids) for o in outputs) / seconds,
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_accepted_length": 1 + accepted / drafts if drafts else None,
        "drafted": drafted, "accepted": accepted,
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
    }
    if sere is not None:
        import sere_fx.vllm

        stats = sere_fx.vllm.routing_stats(llm)
        result["stats"] = {str(k): v for k, v in stats.items()}
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=96)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=3, help="draft tokens per step")
    parser.add_argument("--sim", default=None, help="similarity file (default: calibrated here on the public text)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        spec = json.load(open(args.child))
        json.dump(one_engine(spec), open(spec["out"], "w"))
        return {}
    model = os.path.join(TESTBED, "model")
    sim = args.sim
    if sim is None:
        sim = os.path.join(HERE, "results", ".testbed.sim.safetensors")
        subprocess.run([sys.executable, "-m", "sere_fx.cli", "calibrate", "--model", model, "--data",
                        os.path.join(TESTBED, "eval_public.txt"), "--num-seqs", "64", "--seq-len", "64",
                        "--out", sim], check=True)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
           "TOKENIZERS_PARALLELISM": "false"}
    results = {"config": {k: v for k, v in vars(args).items() if k != "child"}}
    for name, sere in SETTINGS.items():
        spec_path = os.path.join(HERE, "results", f".spec_{name}.json")
        out_path = spec_path.replace(".json", ".out.json")
        json.dump({"model": model, "sere": sere, "sim": sim, "out": out_path, "prompts": args.prompts,
                   "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "k": args.k}, open(spec_path, "w"))
        print(f"{name}: starting an engine ...", flush=True)
        subprocess.run([sys.executable, __file__, "--child", spec_path], check=True, env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        results[name] = json.load(open(out_path))
        os.remove(spec_path)
        os.remove(out_path)
    plain_tokens = results["plain"]["tokens"]
    print(f"ngram k={args.k}, {args.prompts} prompts x {args.new_tokens} tokens, test-bed, 2-core CPU")
    print(f"{'setting':8s} {'accept':>7s} {'mean len':>8s} {'tok/s':>7s} {'same as plain':>13s} "
          f"{'experts before -> after (bytes limit)':>40s}")
    for name in SETTINGS:
        r = results[name]
        same = sum(a == b for a, b in zip(r["tokens"], plain_tokens))
        experts = ""
        if "stats" in r:
            before = sum(v["distinct_before"] for v in r["stats"].values()) / len(r["stats"])
            after = sum(v["distinct_after"] for v in r["stats"].values()) / len(r["stats"])
            experts = f"{before:.1f} -> {after:.1f} ({before / after:.2f}x)"
            r["distinct_before"], r["distinct_after"] = before, after
        print(f"{name:8s} {r['acceptance_rate']:7.3f} {r['mean_accepted_length']:8.2f} {r['tokens_per_s']:7.0f} "
              f"{same:>6d}/{len(plain_tokens):<6d} {experts:>40s}")
        del r["tokens"]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
