"""Runs one vLLM engine in its own process for the engine tests: ``python vllm_driver.py SPEC.json OUT.json``,
or, as ``python vllm_driver.py --fork-server``, forks one child per engine from a process that has
imported vLLM already (``serve``).

SPEC: ``model``, ``sere`` (``additional_config["sere"]`` or null), ``eager``, ``prompts``,
``max_tokens``, engine sizes, ``speculative_config``, ``extra_args`` (one per prompt, or
null) and ``passes`` (each ``{"prompts", "max_tokens", "reset_stats"[, "extra_args"]}``; default: one pass over
``prompts``). OUT: per pass, greedy token ids per prompt and, with ``"stats": true``,
``sere_fx.vllm.routing_stats``; the first pass's also at the top level. A separate process
per engine keeps each engine's memory and plugin state apart, as in a real deployment.
"""

from __future__ import annotations

import json
import os
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
        distributed_executor_backend="uni",  # engine core and worker in this process (with VLLM_ENABLE_V1_MULTIPROCESSING=0)
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
    with open(out_path, "w") as f:
        json.dump({**results[0], "passes": results}, f)


def _leave(rc: int) -> None:
    # The results are written and engine core and worker live in this process (the tests run
    # vLLM's uni executor): leave without vLLM's interpreter teardown, about 6 s of a 30 s run here.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def serve() -> None:
    """Fork server: import vLLM once (about 15 s of every engine start on a 2-core machine), then, for
    each request line ``["SPEC.json", "OUT.json", "LOG"]`` on stdin, fork a child that runs ``main``
    with its stdout and stderr in LOG. Answers ``{"pid": ...}`` at the fork and ``{"rc": ...}`` when
    the child ends. Each engine still has a process of its own, started from the same imports as a
    fresh one; forking is refused where the imports left a second thread running."""
    import threading
    import traceback

    # requests and answers on the original stdout; whatever the imports print goes to stderr
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    import vllm.entrypoints.llm  # noqa: F401  (the import chain LLM(...) needs)

    # jemalloc's background thread (a library vLLM imports links jemalloc) is safe: jemalloc stops it
    # around fork(). Any other thread (an OpenMP pool, a Python thread) could hold a lock in the child.
    threads = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    others = [name for name in threads if name != "jemalloc_bg_thd"]
    if len(others) != 1 or threading.active_count() != 1:
        print(json.dumps({"refused": f"threads {threads} after importing vLLM: forking is unsafe"}), file=answers,
              flush=True)
        return
    print(json.dumps({"ready": True}), file=answers, flush=True)
    for line in sys.stdin:
        spec_path, out_path, log_path = json.loads(line)
        pid = os.fork()
        if pid == 0:
            fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            answers.close()
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            rc = 0
            try:
                main(spec_path, out_path)
            except SystemExit as exit_:
                rc = exit_.code if isinstance(exit_.code, int) else 1
            except BaseException:
                traceback.print_exc()
                rc = 1
            _leave(rc)
        print(json.dumps({"pid": pid}), file=answers, flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), file=answers, flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--fork-server"]:
        serve()
    else:
        main(sys.argv[1], sys.argv[2])
        _leave(0)
