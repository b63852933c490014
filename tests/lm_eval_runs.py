"""What the lm-evaluation-harness tests share: the tasks, one evaluation call, the scores it gives."""

from __future__ import annotations

import re
import shlex
import sys

import doc_pages

from sere_fx.resources import lm_eval_tasks

GEN, LL = "sere_next_line", "sere_next_line_ll"
LIMIT = 32  # documents per task: one batch of 32 decode rows


def evaluate(model, tasks=(GEN, LL), model_args=None, **kwargs) -> dict:
    """``lm_eval.simple_evaluate`` on sere-fx's tasks: ``{"scores": {task: {metric: value}},
    "responses": {task: [each document's response]}}``."""
    import lm_eval

    from sere_fx import harness

    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=list(tasks), limit=LIMIT,
                                  task_manager=harness.task_manager(), log_samples=True, bootstrap_iters=0, **kwargs)
    scores = {task: {k.split(",")[0]: v for k, v in metrics.items() if k.endswith(",none")}
              for task, metrics in out["results"].items()}
    responses = {task: [s["resps"] for s in sorted(samples, key=lambda s: s["doc_id"])]
                 for task, samples in out["samples"].items()}
    return {"scores": scores, "responses": responses}


def lm_eval_commands() -> dict[str, list[str]]:
    """The documentation's three lm-eval command lines, by model type, as argument lists."""
    block = doc_pages.block("evaluation.md", "bash", "--model sere-hf")
    lines = [" ".join(part.strip() for part in c.split("\\\n")) for c in re.split(r"\n(?=\S)", block.strip())]
    commands = {}
    for line in lines[1:]:
        argv = shlex.split(line.replace('"$TASKS"', lm_eval_tasks()))
        commands[argv[argv.index("--model") + 1]] = argv
    assert lines[0].startswith("TASKS=$(python -c") and sorted(commands) == ["local-completions", "sere-hf", "vllm"]
    return commands


def parsed(argv: list[str]):
    """lm-eval's own parser on a command line (``lm-eval run ...`` or ``python -m sere_fx.harness run ...``)."""
    from lm_eval._cli import HarnessCLI

    saved = sys.argv
    sys.argv = ["lm-eval", *argv[argv.index("run"):]]
    try:
        return HarnessCLI().parse_args()
    finally:
        sys.argv = saved
