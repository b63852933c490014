"""The vLLM plugin's host work before each forward (``_Engine.refresh``: the step's range and
row masks), timed alone: a step that re-routes refills the masks, a step whose range is ``off``
on every layer leaves them. Both are timed in one run, interleaved (``time_paired``), on one
thread, as an engine worker runs them; no engine is started.

    python bench/vllm_refresh.py [--batches 1 8 32] [--repeats 30]
"""

import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from sere_fx.benchmark import time_paired  # noqa: E402
from sere_fx.vllm import engine  # noqa: E402

MAX_TOKENS, MAX_REQUESTS = 2048, 256  # vLLM's CPU defaults: max_num_batched_tokens, max_num_seqs


def step(off: bool, batch: int):
    """One refresh of a decode step of ``batch`` requests (one row each) under a two-range plan,
    whose first range (1 row up) is off on every layer (``off``) or re-routes."""
    state = engine._Engine()
    state.allocate(MAX_TOKENS, MAX_REQUESTS, "cpu")
    state.bounds = (1, MAX_TOKENS + 1)  # every step of this bench is in the first range
    state.off_ranges = frozenset({0}) if off else frozenset()
    flags, qsl = np.ones(batch, dtype=bool), torch.arange(batch + 1, dtype=torch.int32)

    def run():
        state.pending = (flags, qsl, batch)
        state.refresh()
        assert state.range == 0

    return run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--repeats", type=int, default=30, help="samples per side (200 refreshes each)")
    args = p.parse_args(argv)
    for name, value in (("--repeats", args.repeats), *(("--batches", b) for b in args.batches)):
        if not 1 <= value <= MAX_REQUESTS:
            p.error(f"{name}: expected an integer in [1, {MAX_REQUESTS}], got {value}")
    torch.set_num_threads(1)
    print(f"us per refresh, median [min, max] of {args.repeats} samples of 200, torch {torch.__version__}")
    for batch in args.batches:
        fns = {"re-routing step (masks refilled)": step(False, batch), "off step (masks left)": step(True, batch)}
        samples = time_paired(fns, repeats=args.repeats, warmup=20, number=200)
        print(f"batch {batch}: " + "; ".join(
            f"{name} {statistics.median(v) * 1e6:.1f} [{min(v) * 1e6:.1f}, {max(v) * 1e6:.1f}]"
            for name, v in samples.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
