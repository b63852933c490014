"""Where a ``sere-fx tune`` run spends its time: the command as a user types it, every scored pass logged.

    python bench/tune_passes.py --log passes.json -- tune --model sere_fx/data/testbed/model \
        --sim sim.safetensors --data sere_fx/data/testbed/eval_public.txt --token-range 0:40000 \
        --max-loss 0.01 --metric accuracy --batch-sizes --out plan.json

Everything after ``--`` is ``sere-fx``'s own command line, run unchanged in this process. Each pass that
``tuning.ModelScorer`` scores is written to ``--log`` (JSON, one record per pass: the batch size, the
plan by layer, baseline or not, its seconds, stopped early or not, accuracy, mean NLL and distinct experts
per layer), then the seconds are summed per batch size and per kind of pass: baseline, a probe of one
layer (the others untouched), a uniform plan (one setting on every layer) or a whole-plan check.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

from sere_fx import tuning
from sere_fx.config import OFF, is_exact


def _describe(plan) -> dict | None:
    if plan is None:
        return None
    return {str(i): ("off" if c is OFF else c.as_dict() if hasattr(c, "as_dict") else repr(c)) for i, c in plan.items()}


def _kind(plan, top_k: dict[int, int]) -> str:
    if plan is None:
        return "baseline"
    changed = {i: c for i, c in plan.items() if not is_exact(c, top_k[i])}
    if len(changed) <= 1:
        return "probe"
    return "uniform" if len({repr(c) for c in changed.values()}) == 1 else "whole plan"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("tune_passes: expected `--` and then sere-fx's command line, e.g. `--log passes.json -- tune ...`",
              file=sys.stderr)
        return 2
    cut = argv.index("--")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--log", required=True, help="where the per-pass JSON goes")
    args = p.parse_args(argv[:cut])
    records = []
    scored = tuning.ModelScorer.__call__

    def logged(self, plan, windows, stop=None):
        start = time.perf_counter()
        s = scored(self, plan, windows, stop=stop)
        records.append({
            "batch_size": self.kw["batch_size"], "kind": _kind(plan, self._top_k), "plan": _describe(plan),
            "sequences": int(windows.shape[0]), "seconds": time.perf_counter() - start, "stopped": s is None,
            "accuracy": None if s is None else s.accuracy, "mean_nll": None if s is None else s.mean_nll,
            "distinct": None if s is None else {str(i): d for i, d in s.distinct.items()}})
        return s

    tuning.ModelScorer.__call__ = logged
    from sere_fx.cli import main as cli

    start = time.perf_counter()
    rc = cli(argv[cut + 1:])
    wall = time.perf_counter() - start
    Path(args.log).write_text(json.dumps({"argv": argv[cut + 1:], "seconds": wall, "passes": records}, indent=1))
    total = defaultdict(lambda: [0, 0.0])
    for r in records:
        for key in ((r["batch_size"], r["kind"]), (r["batch_size"], "all"), ("all", r["kind"])):
            total[key][0] += 1
            total[key][1] += r["seconds"]
    print(f"{len(records)} passes, {sum(r['seconds'] for r in records):.1f} s of {wall:.1f} s in the command")
    print(f"{'batch':>6}  {'kind':>10}  {'passes':>6}  {'seconds':>8}  {'s/pass':>7}")
    for (b, kind), (count, seconds) in sorted(total.items(), key=lambda kv: (str(kv[0][0]).zfill(4), kv[0][1])):
        print(f"{b!s:>6}  {kind:>10}  {count:>6}  {seconds:8.1f}  {seconds / count:7.2f}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
