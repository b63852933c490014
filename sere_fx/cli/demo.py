"""``sere-fx demo``: calibrate, transform, evaluate and time the embedded test-bed model."""

from __future__ import annotations

from sere_fx.cli.common import _error, _out_dir_unusable


def add_parser(sub) -> None:
    d = sub.add_parser("demo", help="calibrate, transform, evaluate and time the embedded test-bed model")
    d.add_argument("--out-dir", default="sere-demo", help="where the report, plots and similarity go (default sere-demo/)")
    d.add_argument("--num-seqs", type=int, default=64, help="evaluation sequences (default 64)")
    d.add_argument("--steps", type=int, default=64, help="scored decode steps per sequence (default 64)")
    d.set_defaults(func=run)


def run(args) -> int:
    from sere_fx.demo import run as run_demo

    if args.num_seqs < 32:
        return _error("demo", f"--num-seqs: expected at least 32 (the demo decodes batches of 32), got {args.num_seqs}")
    if (failed := _out_dir_unusable("demo", "--out-dir", args.out_dir)) is not None:
        return failed
    run_demo(args.out_dir, num_eval_seqs=args.num_seqs, steps=args.steps)
    return 0
