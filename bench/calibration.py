"""Calibration time and peak memory on the test-bed model, per method, at 1x and 4x tokens.

Each (method, num_seqs) runs in a fresh process so peak RSS is its own. "extra peak" is
the growth of peak RSS during ``calibrate`` over the RSS after loading the model and data.
The children run with ``MALLOC_MMAP_THRESHOLD_=1048576``: glibc otherwise raises its mmap
threshold after freeing large blocks and keeps later ones on the heap, which shows up as
peak-RSS drift between runs that has nothing to do with what the code holds.

    python bench/calibration.py [--testbed DIR (default: the packaged test-bed)] [--out bench/results/calibration.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

from sere_fx.resources import testbed_dir

HERE = os.path.dirname(os.path.abspath(__file__))


def child(testbed: str, method: str, num_seqs: int, seq_len: int) -> dict:
    import resource
    import time

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sere_fx.calibration import batched, calibrate, read_documents, token_windows

    model = AutoModelForCausalLM.from_pretrained(f"{testbed}/model", dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(f"{testbed}/model")
    windows = token_windows(tok, read_documents(f"{testbed}/eval_public.txt"), seq_len, num_seqs)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    start = time.perf_counter()
    sim = calibrate(model, batched(windows, 16), method, progress=False)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "method": method,
        "num_seqs": int(windows.shape[0]),
        "seq_len": seq_len,
        "tokens": sim.metadata["tokens"],
        "seconds": round(seconds, 2),
        "tokens_per_s": round(sim.metadata["tokens"] / seconds),
        "rss_before_mib": round(before / 1024, 1),
        "extra_peak_mib": round((peak - before) / 1024, 1),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--testbed", default=testbed_dir())
    p.add_argument("--methods", nargs="+", default=["frobenius", "cosine", "cka"])
    p.add_argument("--num-seqs", type=int, nargs="+", default=[100, 400])
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--out", default=os.path.join(HERE, "results", "calibration.json"))
    p.add_argument("--child", nargs=3, metavar=("METHOD", "NUM_SEQS", "SEQ_LEN"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.testbed, args.child[0], int(args.child[1]), int(args.child[2]))))
        return 0
    rows = []
    for method in args.methods:
        for n in args.num_seqs:
            out = subprocess.run(
                [sys.executable, __file__, "--testbed", args.testbed, "--child", method, str(n), str(args.seq_len)],
                check=True, capture_output=True, text=True,
                env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "1048576"},
            ).stdout.strip().splitlines()[-1]
            rows.append(json.loads(out))
            r = rows[-1]
            print(f"{r['method']:>10} {r['num_seqs']:>4}x{r['seq_len']} tokens={r['tokens']:>6} "
                  f"time={r['seconds']:>6.1f}s ({r['tokens_per_s']} tok/s) extra peak={r['extra_peak_mib']:.0f} MiB",
                  flush=True)
    machine = {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
    import torch

    machine["torch"] = torch.__version__
    machine["threads"] = torch.get_num_threads()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"machine": machine, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
