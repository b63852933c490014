"""``sere-fx tune``: the per-layer policy/S/rho with the fewest experts within a quality budget (or the
best quality within an expert budget), written as a plan; ``--batch-sizes``: one range per batch size."""

from __future__ import annotations

import argparse
import math
import os

from sere_fx.cli.common import (CliError, _check_data, _check_offload_args, _data_args, _engine_args, _engine_kwargs,
                                 _ep_args, _error, _load_model, _load_model_dir_checks, _load_sim, _max_tokens,
                                 _model_args, _offload_args, _offload_model, _output_dir_missing, _placement,
                                 _positive_int, _start_decode_engine, _windows)


NUM_SEQS = 96  # tuning windows when --num-seqs is not given (at least the largest of --batch-sizes)


def add_parser(sub) -> None:
    t = sub.add_parser("tune", help="per-layer policy/S/rho with the fewest experts within a quality budget")
    t.add_argument("--model", required=True, help="a local transformers model directory")
    t.add_argument("--sim", required=True, help="similarity file")
    _data_args(t, None, f"{NUM_SEQS}; with --batch-sizes, the largest size where that is more: 128 for the "
                        f"default sizes")
    budget = t.add_mutually_exclusive_group()
    budget.add_argument("--max-loss", type=float, default=None,
                        help="quality budget, for the fewest experts within it: mean NLL increase in nats/token "
                             "(--metric nll; default 0.02 when no budget is given) or relative accuracy drop "
                             "(--metric accuracy)")
    budget.add_argument("--max-experts", type=float, default=None, metavar="F",
                        help="expert budget, for the best quality within it: at most F times the baseline's distinct "
                             "experts per layer per decode step (0 < F <= 1; e.g. 0.6 reads 40%% fewer); with "
                             "--offload, F times exact LRU's experts fetched per token")
    t.add_argument("--metric", choices=["nll", "accuracy"], default="nll")
    t.add_argument("--margin", type=float, default=0.0, metavar="Z",
                   help="with the quality budget: a plan is within it when its loss plus Z standard errors of its "
                        "paired difference from the baseline on the tuning text is (default 0: its loss alone)")
    _ep_args(t, "tune for expert parallelism: count the busiest of R ranks' experts (--max-experts is then a "
                "fraction of the baseline's busiest-rank count) and add per-rank weight budgets to the candidates")
    t.add_argument("--batch-size", type=int, default=None, help="decode batch to tune at (default 32)")
    t.add_argument("--batch-sizes", type=_positive_int, nargs="*", default=None, metavar="B",
                   help="tune a plan that follows the load: one range per batch size (ascending; the range of B holds "
                        "steps of B rows up to the next size, the first from 1 row), each tuned at its size within "
                        "the budget; alone: 1 8 16 32 64 128 (--num-seqs: at least the largest; its default "
                        "grows to it)")
    t.add_argument("--cost", type=_cost, default=None, metavar="EXPERT_US,SLOT_US,OP_US",
                   help="with --batch-sizes: the MoE kernel's cost per distinct expert, per token-slot and of the "
                        "re-routing op (bench/vllm_step_profile.py measures them; default: the Qwen3-30B-A3B shape "
                        "in vLLM's CPU kernel, 280,20,170); a range predicted below --min-speedup is off")
    t.add_argument("--min-speedup", type=float, default=1.0,
                   help="with --batch-sizes: a range whose predicted MoE-layer speed-up is below this is off "
                        "(default 1.0)")
    t.add_argument("--prefill", type=int, default=4)
    t.add_argument("--probe-sequences", type=_positive_int, default=None, metavar="N",
                   help="run the per-layer probes (most of tune's passes) on the first N sequences only; whole plans "
                        "are still checked on all (default: all)")
    t.add_argument("--steps", type=int, default=96)
    t.add_argument("--max-tokens", type=_max_tokens, default=None, help="passed to transform (default None)")
    _offload_args(t)
    _model_args(t)
    _engine_args(t)
    t.add_argument("--out", required=True, help="plan .json to write")
    t.set_defaults(func=run)


def run(args) -> int:
    from sere_fx.plan import save_plan
    from sere_fx.tuning import tune

    if (failed := _output_dir_missing("tune", args.out)) is not None:
        return failed
    if not (math.isfinite(args.margin) and args.margin >= 0):
        raise CliError(f"--margin: expected a number of standard errors >= 0, got {args.margin:g}")
    if args.margin and args.max_experts is not None:
        raise CliError(f"--margin: applies to the quality budget (--max-loss); got --margin {args.margin:g} with "
                       f"--max-experts {args.max_experts:g}")
    if args.batch_sizes == []:  # the option alone: the default ranges
        from sere_fx.tuning import DEFAULT_BATCH_SIZES

        args.batch_sizes = list(DEFAULT_BATCH_SIZES)
    if args.num_seqs is None:  # every range tunes on at least one batch of its size
        args.num_seqs = max([NUM_SEQS, *(args.batch_sizes or [])])
    if args.batch_sizes is None:
        for option, value, default in (("--cost", args.cost, None), ("--min-speedup", args.min_speedup, 1.0)):
            if value != default:
                raise CliError(f"{option}: only used with --batch-sizes (a plan that follows the load), got "
                               f"{option} without it")
    else:
        if args.batch_size is not None:
            raise CliError(f"--batch-size: --batch-sizes tunes each range at its own size; give one of them, got "
                           f"--batch-size {args.batch_size} and --batch-sizes {' '.join(map(str, args.batch_sizes))}")
        if args.engine == "vllm":
            raise CliError("--batch-sizes: plans that follow the load are tuned on the transformers path (each range "
                           "decodes at its own batch size); expected no --engine vllm, got it")
        if args.probe_sequences is not None:
            raise CliError(f"--probe-sequences: not used with --batch-sizes (each range tunes on the largest multiple "
                           f"of its batch size), got {args.probe_sequences}")
    args.batch_size = 32 if args.batch_size is None else args.batch_size
    placement = _placement(args)
    _check_offload_args(args, os.path.dirname(os.path.abspath(args.out)))
    if args.offload is not None and (args.batch_sizes is not None or args.engine == "vllm" or placement is not None):
        what = ("--batch-sizes" if args.batch_sizes is not None else "--engine vllm" if args.engine == "vllm"
                else "--ep-ranks")
        raise CliError(f"--offload: tunes one batch size on the transformers path with one device's cache; expected "
                       f"no {what} with it, got {what}")
    if args.probe_sequences is not None and not args.batch_size <= args.probe_sequences <= args.num_seqs:
        raise CliError(f"--probe-sequences: expected an int in [--batch-size, --num-seqs] = [{args.batch_size}, "
                       f"{args.num_seqs}], got {args.probe_sequences}")
    _check_data(args)
    sim = _load_sim(args.sim)
    engine_kwargs = _engine_kwargs(args)
    scorer, model = None, None
    if engine_kwargs is not None:
        import tempfile

        from transformers import AutoTokenizer

        from sere_fx.vllm.evaluate import EngineScorer

        if placement is not None or args.max_tokens is not None:
            option, value = ("--ep-ranks", args.ep_ranks) if placement is not None else ("--max-tokens", args.max_tokens)
            raise CliError(f"{option}: not used with --engine vllm (the engine tells prompt rows from decode rows "
                           f"and counts its own ranks), got {value}")
        _load_model_dir_checks(args.model)
        windows = _windows(args, AutoTokenizer.from_pretrained(args.model), args.prefill + args.steps + 1)
        llm = _start_decode_engine(args, engine_kwargs)
        scratch = tempfile.mkdtemp(prefix="sere-fx-tune-")
        scorer = EngineScorer(llm, os.path.abspath(args.sim), scratch, batch_size=args.batch_size,
                              prefill=args.prefill, windows=windows)
    else:
        model, tokenizer = _load_model(args)
        if args.offload is not None:
            _offload_model(args, model)
        windows = _windows(args, tokenizer, args.prefill + args.steps + 1)
    common = dict(max_loss=args.max_loss, max_experts=args.max_experts, metric=args.metric, prefill=args.prefill,
                  max_tokens=args.max_tokens, placement=placement, probe_sequences=args.probe_sequences,
                  margin=args.margin)
    if args.batch_sizes is not None:
        return _tune_ranges(args, model, sim, windows, common)
    result = tune(model, sim, windows, batch_size=args.batch_size, scorer=scorer, **common)
    print(result.summary())
    save_plan(args.out, result.plan, tuned={"metric": result.metric, "max_loss": result.max_loss, "margin": args.margin,
                                            "max_experts": result.max_experts, "loss": result.loss,
                                            "distinct": result.distinct, "baseline_distinct": result.baseline_distinct,
                                            "data": str(args.data), "token_range": args.token_range,
                                            "sequences": int(windows.shape[0]), "engine": args.engine,
                                            "offload": None if args.offload is None else {
                                                "cache": args.offload, "batch_size": args.batch_size,
                                                "cost": "fetches per token per layer"},
                                            "ep": None if placement is None else {"ranks": placement.ranks,
                                                                                  "strategy": placement.strategy}})
    print(f"wrote {args.out}; use it with sere_fx.transform(model, sim, plan={args.out!r}) or --policies plan:{args.out}")
    return 0


def _tune_ranges(args, model, sim, windows, common) -> int:
    """``tune --batch-sizes``: a plan that follows the load, one range per batch size."""
    from sere_fx.plan import save_plan
    from sere_fx.tuning import tune_ranges

    result = tune_ranges(model, sim, windows, batch_sizes=args.batch_sizes, cost=args.cost,
                         min_speedup=args.min_speedup, **common)
    print(result.summary())
    if all(r.plan is None for r in result.ranges):
        return _error("tune", "--batch-sizes: every range is off (nothing within the budget is predicted to pay); "
                              f"expected at least one range that re-routes, got {args.batch_sizes}")
    save_plan(args.out, result.plan, tuned={
        "metric": result.metric, "max_loss": result.max_loss, "max_experts": result.max_experts, "margin": args.margin,
        "cost_us": {"expert": result.cost.expert_us, "slot": result.cost.slot_us, "op": result.cost.op_us},
        "min_speedup": args.min_speedup, "seconds": round(result.seconds, 1), "data": str(args.data),
        "token_range": args.token_range, "sequences": int(windows.shape[0]),
        "ranges": [{"min_rows": r.min_rows, "batch_size": r.batch_size, "loss": r.loss, "distinct": r.distinct,
                    "baseline_distinct": r.baseline_distinct, "predicted_speedup": r.predicted_speedup,
                    "off": r.why_off} for r in result.ranges]})
    print(f"wrote {args.out}; use it with sere_fx.transform(model, sim, plan={args.out!r}) or --policies plan:{args.out}")
    return 0


def _cost(text: str):
    from sere_fx.tuning import CostModel

    parts = text.split(",")
    try:
        values = [float(p) for p in parts]
    except ValueError:
        values = []
    if len(values) != 3:
        raise argparse.ArgumentTypeError(f"expected EXPERT_US,SLOT_US,OP_US (three numbers), got {text!r}")
    from sere_fx.errors import ArgumentError

    try:
        return CostModel(*values)
    except ArgumentError as exc:
        raise argparse.ArgumentTypeError(exc.message.removeprefix("cost: ")) from None
