"""Runs one vLLM engine in its own process for the engine tests: ``python vllm_driver.py SPEC.json OUT.json``.

SPEC: ``model``, ``sere`` (``additional_config["sere"]`` or null), ``eager``, ``prompts``,
``max_tokens``, ``tp``, engine sizes, ``speculative_config``, ``extra_args`` (one per prompt, or
null) and ``passes`` (each ``{"prompts", "max_tokens", "reset_stats"[, "extra_args"]}``; default: one pass over
``prompts``). OUT: per pass, greedy token ids per prompt and, with ``"stats": true``,
``sere_fx.vllm.routing_stats``; the first pass's also at the top level. A separate process
per engine keeps each engine's memory and plugin state apart, as in a real deployment.
"""

from __future__ import annotations

import json
import sys


def main(spec_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams

    spec = json.load(open(spec_path))
    sere = spec.get("sere")
    extra = {}
    if spec.get("speculative_config") is not None:
        extra["speculative_config"] = spec["speculative_config"]
    llm = LLM(
        model=spec["model"],
        dtype="bfloat16",
        enforce_eager=spec.get("eager", True),
        additional_config={"sere": sere} if sere is not None else {},
        tensor_parallel_size=spec.get("tp", 1),
        pipeline_parallel_size=spec.get("pp", 1),
        distributed_executor_backend=spec.get("executor"),
        max_model_len=spec.get("max_model_len", 512),
        max_num_seqs=spec.get("max_num_seqs", 16),
        max_num_batched_tokens=spec.get("max_num_batched_tokens", 128),
        gpu_memory_utilization=0.5,
        seed=0,
        **extra,
    )
    passes = spec.get("passes") or [{"prompts": spec["prompts"], "max_tokens": spec.get("max_tokens", 16)}]
    results = []
    for p in passes:
        if p.get("reset_stats"):
            import sere_fx.vllm

            sere_fx.vllm.reset_routing_stats(llm)
        extra_args = p.get("extra_args") or spec.get("extra_args") or [None] * len(p["prompts"])
        params = [SamplingParams(max_tokens=p.get("max_tokens", 16), temperature=0.0, ignore_eos=True, extra_args=x)
                  for x in extra_args]
        outputs = llm.generate(p["prompts"], params, use_tqdm=False)
        result = {"tokens": [list(o.outputs[0].token_ids) for o in outputs]}
        if sere is not None and sere.get("stats"):
            import sere_fx.vllm

            result["stats"] = {str(k): v for k, v in sere_fx.vllm.routing_stats(llm).items()}
        results.append(result)
    json.dump({**results[0], "passes": results}, open(out_path, "w"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
