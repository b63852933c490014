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
import os
import time

from vllm_children import (TESTBED, TESTBED_MODEL, config_of, parse_common, run_settings, testbed_similarity,
                           write_results)

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
    args = parse_common(parser, one_engine, argv)
    if args is None:  # a child process: its engine ran
        return {}
    spec = {"model": TESTBED_MODEL, "sim": testbed_similarity(args.sim), "prompts": args.prompts,
            "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "k": args.k}
    results = {"config": config_of(args),
               **run_settings(__file__, SETTINGS, spec)}
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
    return write_results(args.out, results)


if __name__ == "__main__":
    main()
