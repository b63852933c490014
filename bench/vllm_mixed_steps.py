"""Mixed prefill/decode steps: what free experts (the kept rows' experts) buy the decode rows.

    python bench/vllm_mixed_steps.py --out bench/results/vllm_mixed_steps_testbed.json
    python bench/vllm_mixed_steps.py --code OLD_CHECKOUT ...   # the same workload on another sere-fx

A workload where continuous batching mixes prompt chunks into most decode steps: ``--prompts``
prompts of 32-224 tokens from the test-bed's public text, ``max_num_seqs`` 16, a 128-token step
budget, greedy decoding. One engine per setting, each in its own process: plain vLLM, then SERE
(S=2, rho=0) and OEA (S=2) with statistics. Reported: distinct experts per layer per decode step
before / after re-routing and how many of the after were free (read anyway by kept rows), and
quality as agreement with plain vLLM's greedy tokens: the mean fraction of each request's
tokens before its first difference (a request that never differs scores 1). ``--code DIR`` puts
another sere-fx source tree first on the engines' path, to run the same workload on it.
"""

from __future__ import annotations

import argparse
import os

from vllm_children import (TESTBED, TESTBED_MODEL, config_of, parse_common, run_settings, testbed_similarity,
                           write_results)

SETTINGS = {"plain": None, "sere": {"S": 2, "rho": 0.0}, "oea": {"policy": "oea", "S": 2}}


def one_engine(spec: dict) -> dict:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    ids = tokenizer(open(os.path.join(TESTBED, "eval_public.txt")).read()[:400_000])["input_ids"]
    prompts = [{"prompt_token_ids": ids[i * 1009: i * 1009 + 32 + (i * 37) % 193]} for i in range(spec["prompts"])]
    sere = spec["sere"]
    if sere is not None:
        sere = {**sere, "stats": True, **({"sim": spec["sim"]} if sere.get("policy", "sere") == "sere" else {})}
    llm = LLM(model=spec["model"], dtype="bfloat16", max_model_len=512, max_num_seqs=16, max_num_batched_tokens=128,
              additional_config={"sere": sere} if sere else {}, seed=0)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=spec["new_tokens"], temperature=0.0, ignore_eos=True),
                           use_tqdm=False)
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outputs]}
    if sere is not None:
        import sere_fx.vllm

        result["stats"] = {str(k): v for k, v in sere_fx.vllm.routing_stats(llm).items()}
    return result


def agreement(tokens, reference) -> float:
    """Mean over requests of the fraction of tokens before the first difference from ``reference``."""
    scores = []
    for a, b in zip(tokens, reference):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(b))
        scores.append(same / len(b))
    return sum(scores) / len(scores)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--code", default=None, help="another sere-fx source tree to run the engines on")
    args = parse_common(parser, one_engine, argv)
    if args is None:  # a child process: its engine ran
        return {}
    spec = {"model": TESTBED_MODEL, "sim": testbed_similarity(args.sim), "prompts": args.prompts,
            "new_tokens": args.new_tokens}
    env = {"PYTHONPATH": os.path.abspath(args.code) + os.pathsep + os.environ.get("PYTHONPATH", "")} if args.code else None
    results = {"config": config_of(args),
               **run_settings(__file__, SETTINGS, spec, env)}
    reference = results["plain"].pop("tokens")
    print(f"{args.prompts} prompts of 32-224 tokens, {args.new_tokens} new tokens, 128-token steps, test-bed")
    print(f"{'setting':8s} {'agreement':>9s} {'before':>7s} {'after':>7s} {'free':>6s} {'kept rows':>9s}")
    for name in list(SETTINGS)[1:]:
        r = results[name]
        r["agreement"] = agreement(r.pop("tokens"), reference)
        layers = list(r["stats"].values())
        for field in ("distinct_before", "distinct_after", "free_after", "prefill_rows"):
            r[field] = sum(v.get(field, float("nan")) for v in layers) / len(layers)
        print(f"{name:8s} {r['agreement']:9.3f} {r['distinct_before']:7.1f} {r['distinct_after']:7.1f} "
              f"{r['free_after']:6.1f} {r['prefill_rows']:9.1f}")
    return write_results(args.out, results)


if __name__ == "__main__":
    main()
