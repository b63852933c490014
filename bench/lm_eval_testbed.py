"""lm-evaluation-harness scores of routing policies inside vLLM on the test-bed, with the plugin's
counters beside each score and paired intervals against plain vLLM.

One eager engine (lm-eval's ``vllm`` model, as ``python -m sere_fx.harness run --model vllm``
builds it) runs sere-fx's generate-until task (``sere_next_line``) once per policy, switching the
routing between passes (``sere_switch_routing``), and the log-likelihood task
(``sere_next_line_ll``) plain and with SERE (prompt processing: the scores must be equal). Every
document is scored by every policy, so differences to plain vLLM are paired per document (95%
bootstrap intervals of the mean difference, ``sere_fx.generation.mean_interval``).

    python bench/lm_eval_testbed.py --out bench/results/lm_eval_testbed.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vllm_children import POLICIES, TESTBED_MODEL, policy_settings, testbed_similarity, write_results  # noqa: E402

GEN, LL = "sere_next_line", "sere_next_line_ll"
GEN_METRICS = ("exact_match", "edit_similarity")


def evaluate(lm, task: str, limit: int) -> dict:
    """``{"scores": {metric: mean}, "docs": {metric: [per document, by doc_id]}}`` of one task."""
    import lm_eval

    from sere_fx.harness import task_manager

    out = lm_eval.simple_evaluate(model=lm, tasks=[task], limit=limit, log_samples=True, bootstrap_iters=0,
                                  task_manager=task_manager())
    samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
    metrics = [k.split(",")[0] for k in out["results"][task] if k.endswith(",none") and "stderr" not in k]
    return {"scores": {m: out["results"][task][f"{m},none"] for m in metrics},
            "docs": {m: [float(s[m]) for s in samples] for m in metrics}}


def routed(lm, sere: dict | None, task: str, limit: int) -> dict:
    """``evaluate`` with the plugin's settings ``sere`` on every worker (None: plain), and the
    counters of that pass; the engine routes plainly again afterwards (counters cleared)."""
    import sere_fx.vllm

    if sere is None:
        return evaluate(lm, task, limit)
    lm.model.collective_rpc("sere_switch_routing", args=(sere,))
    try:
        return {**evaluate(lm, task, limit), "counters": layer_means(sere_fx.vllm.routing_stats(lm.model))}
    finally:
        lm.model.collective_rpc("sere_switch_routing", args=(None,))


def layer_means(stats: dict) -> dict:
    """The plugin's counters averaged over MoE layers (each a mean per decode step)."""
    fields = next(iter(stats.values())).keys()
    return {f: sum(layer[f] for layer in stats.values()) / len(stats) for f in fields}


def run(args) -> dict:
    import numpy as np

    from sere_fx.generation import mean_interval
    from sere_fx.harness import vllm_model_class

    sim = testbed_similarity(args.sim)
    settings = {name: policy_settings(name, sim, stats=True) for name in args.policies}
    sere = policy_settings("sere", sim, stats=True)  # the log-likelihood pass's, whatever --policies holds
    # started with the plugin (it attaches to the engine at start), then switched per pass
    lm = vllm_model_class()(pretrained=TESTBED_MODEL, additional_config={"sere": sere},
                            enforce_eager=True, max_model_len=1024, dtype="bfloat16", batch_size="auto", seed=0)
    lm.model.collective_rpc("sere_switch_routing", args=(None,))
    results = {"config": vars(args), "policies": {}}
    for name, raw in settings.items():
        started = time.time()
        results["policies"][name] = routed(lm, raw, GEN, args.limit)
        print(f"{name}: {results['policies'][name]['scores']} ({time.time() - started:.0f} s)", flush=True)
    base = results["policies"]["plain"]["docs"]
    for run_ in results["policies"].values():
        run_["paired"] = {}
        for m in GEN_METRICS:
            d = np.array(run_["docs"][m]) - np.array(base[m])
            run_["paired"][m] = {"mean": float(d.mean()), "ci95": mean_interval(d)}
    results["loglikelihood"] = {"plain": routed(lm, None, LL, args.limit)["scores"],
                                "sere": routed(lm, sere, LL, args.limit)["scores"]}
    return results


def markdown(results: dict) -> str:
    lines = [f"{GEN}, {results['config']['limit']} documents; d = policy - plain per document, mean "
             "[95% paired bootstrap interval]; experts = distinct experts per layer per decode step before -> "
             "after, and the prompt rows that shared those steps", "",
             "| policy | exact match | d | edit similarity | d | experts | decode + prompt rows per step |",
             "|---|---|---|---|---|---|---|"]
    for name, r in results["policies"].items():
        s, p, c = r["scores"], r["paired"], r.get("counters")
        cells = [f"{s['exact_match']:.3f}", "" if name == "plain" else
                 f"{p['exact_match']['mean']:+.3f} [{p['exact_match']['ci95'][0]:+.3f}, {p['exact_match']['ci95'][1]:+.3f}]",
                 f"{s['edit_similarity']:.3f}", "" if name == "plain" else
                 f"{p['edit_similarity']['mean']:+.3f} [{p['edit_similarity']['ci95'][0]:+.3f}, "
                 f"{p['edit_similarity']['ci95'][1]:+.3f}]",
                 "" if c is None else f"{c['distinct_before']:.1f} -> {c['distinct_after']:.1f}",
                 "" if c is None else f"{c['decode_rows']:.1f} + {c['prefill_rows']:.1f}"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    ll = results["loglikelihood"]
    lines += ["", f"{LL}: " + "; ".join(f"{n} nll/char {v['nll_per_char']:.4f}, acc {v['acc']:.3f}" for n, v in ll.items())]
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--policies", nargs="+", choices=[n for n in POLICIES if n not in ("sere_unmerged", "output50")],
                   default=["plain", "sere", "oea", "weight"])
    p.add_argument("--limit", type=int, default=256, help="documents per task (the tasks hold 256)")
    p.add_argument("--sim", default=None, help="similarity file (default: calibrated on the public text)")
    p.add_argument("--out", default=None, help="results JSON")
    p.add_argument("--markdown", default=None, metavar="JSON", help="print an earlier run's table, and stop")
    args = p.parse_args(argv)
    if args.markdown:
        with open(args.markdown) as f:
            print(markdown(json.load(f)))
        return {}
    if "plain" not in args.policies:
        p.error(f"--policies: expected a list with plain (the paired baseline), got {args.policies}")
    if not 1 <= args.limit <= 256:
        p.error(f"--limit: expected an integer in [1, 256], got {args.limit}")
    results = write_results(args.out, run(args))
    print(markdown(results))
    return results


if __name__ == "__main__":
    main()
