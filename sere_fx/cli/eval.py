"""``sere-fx eval``: batched-decode quality and distinct experts of routing policies, teacher-forced
or free-running (``--generate``)."""

from __future__ import annotations

import sys

from sere_fx.cli.common import (CliError, _check_data, _check_offload_args, _data_args, _engine_args, _engine_kwargs,
                                 _ep_args, _error, _load_model, _load_model_dir_checks, _load_sim, _max_tokens,
                                 _model_args, _offload_args, _offload_model, _out_dir_unusable, _placement,
                                 _start_decode_engine, _windows)


def add_parser(sub) -> None:
    e = sub.add_parser("eval", help="batched-decode quality and distinct experts of routing policies")
    e.add_argument("--model", required=True, help="a local transformers model directory")
    e.add_argument("--sim", help="similarity file (needed by sere, least_similar, random)")
    _data_args(e, 128)
    e.add_argument("--batch-size", type=int, default=32, help="sequences decoded in lockstep (default 32)")
    e.add_argument("--prefill", type=int, default=4, help="tokens prefilled with the model's own routing (default 4)")
    e.add_argument("--steps", type=int, default=96, help="scored decode steps per sequence (default 96)")
    e.add_argument("--policies", nargs="+", default=None, metavar="SPEC",
                   help="baseline, sere:S=2,rho=0.5, sere:S=2,rho=q0.3, topk:S=2, oea:S=2, weight:S=1,N=0.6, weight:S=1,N=0.6,Nrank=0.5 (with --ep-ranks), "
                        "output:S=1,N=0.5 (needs --sim with output-size predictors), weight:S=1,rho=0.05, random:S=2,rho=0, least_similar:S=2,rho=0, plan:PATH "
                        "(default: the standard comparison set; with --offload, the standard offload set: lru, "
                        "prior:S=1,rho=0.5 and sere-fx's policies with the cache in view)")
    e.add_argument("--max-tokens", type=_max_tokens, default=None,
                   help="passed to transform (default None: every decode step is re-routed)")
    _ep_args(e, "also report, per layer per decode step, the most loaded of R expert-parallel ranks (distinct "
                "experts read and token-slots), next to the totals")
    e.add_argument("--compare", nargs=2, action="append", metavar=("A", "B"),
                   help="also print a paired comparison of policy B against policy A (repeatable)")
    e.add_argument("--generate", action="store_true",
                   help="free-running instead of teacher-forced: greedy batched decode of --steps tokens from each "
                        "window's first --prefill tokens; reports agreement with the baseline and edit similarity to "
                        "the baseline's and the reference continuation (generate.json)")
    _offload_args(e)
    _model_args(e)
    _engine_args(e)
    e.add_argument("--out-dir", default="sere-eval",
                   help="where eval.json and pareto.png go, or generate.json with --generate (default sere-eval/)")
    e.set_defaults(func=run)


def run(args) -> int:
    from sere_fx.config import cache_policy
    from sere_fx.errors import ArgumentError
    from sere_fx.evaluate import BASELINE_OFFLOAD, DEFAULT_POLICIES, evaluate, offload_policies, parse_policy

    if args.policies is None and args.offload is not None:
        args.policies = offload_policies(_load_sim(args.sim))
    args.policies = args.policies or list(DEFAULT_POLICIES)
    placement = _placement(args)
    specs = []
    for spec in args.policies:  # before any model is loaded: syntax, values, plan files
        try:
            specs.append(parse_policy(spec))
            if specs[-1].kwargs is not None:
                specs[-1].routing(placement)
        except (ValueError, ArgumentError) as exc:
            return _error("eval", f"--policies: {exc}")
    baseline = "baseline" if args.offload is None else BASELINE_OFFLOAD
    for s in specs:
        if s.kwargs is None and s.label != baseline:
            return _error("eval", f"--policies: the model's own routing is labelled {baseline!r} "
                                  f"{'without' if args.offload is None else 'with'} --offload, got {s.label!r}")
        if args.offload is None and s.kwargs is not None and (p := cache_policy(s.routing(placement))) is not None:
            return _error("eval", f"--policies: {s.label!r} biases routing toward cached experts; expected --offload "
                                  "with it, got none")
    labels = list(dict.fromkeys([baseline] + [s.label for s in specs]))
    for pair in args.compare or []:
        for label in pair:
            if label not in labels:
                return _error("eval", f"--compare: expected labels among --policies {labels}, got {label!r}")
    if (failed := _out_dir_unusable("eval", "--out-dir", args.out_dir)) is not None:
        return failed
    _check_offload_args(args, args.out_dir)
    if args.num_seqs < args.batch_size:
        return _error("eval", f"--batch-size: expected at most --num-seqs ({args.num_seqs}), got {args.batch_size}: "
                              "every decode step must carry a full batch")
    _check_data(args)
    _load_model_dir_checks(args.model)
    needing = next(((s, need) for s in specs if (need := s.calibration_need()) is not None), None)
    if needing is not None and args.sim is None:
        return _error("eval", f"--sim: policy {needing[0].label!r} {needing[1]}, got None")
    sim = _load_sim(args.sim)
    engine_kwargs = _engine_kwargs(args)
    if engine_kwargs is not None and args.max_tokens is not None:
        raise CliError(f"--max-tokens: the engine tells prompt rows from decode rows itself; expected none with "
                       f"--engine vllm, got {args.max_tokens}")
    if args.offload is not None and (engine_kwargs is not None or placement is not None or args.generate):
        what = "--engine vllm" if engine_kwargs is not None else "--ep-ranks" if placement is not None else "--generate"
        raise CliError(f"--offload: runs teacher-forced on the transformers path with one device's cache; expected "
                       f"no {what} with it, got {what}")
    if engine_kwargs is not None and placement is not None:
        raise CliError(f"--ep-ranks: the engine counts its own expert-parallel ranks; expected none with --engine "
                       f"vllm, got {args.ep_ranks}")
    if args.generate:
        return _eval_generate(args, specs, sim, engine_kwargs, placement)
    if engine_kwargs is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
    else:
        model, tokenizer = _load_model(args)
        if args.offload is not None:
            _offload_model(args, model)
    windows = _windows(args, tokenizer, args.prefill + args.steps + 1)
    if windows.shape[0] < args.batch_size:
        return _error("eval", f"--batch-size: expected at most the {windows.shape[0]} sequences {args.data} gives, "
                              f"got {args.batch_size}")
    def decode():
        if engine_kwargs is not None:
            from sere_fx.vllm.evaluate import evaluate_engine

            llm = _start_decode_engine(args, engine_kwargs)
            return evaluate_engine(llm, windows, args.policies, args.sim, batch_size=args.batch_size,
                                   prefill=args.prefill)
        return evaluate(model, windows, args.policies, sim, batch_size=args.batch_size, prefill=args.prefill,
                        max_tokens=args.max_tokens, placement=placement)

    report = _evaluated(decode, windows, args.batch_size)
    if isinstance(report, int):
        return report
    print(report.table())
    for a, b in args.compare or []:
        c = report.compare(a, b)
        print(f"{b} vs {a}: accuracy ratio {c['ratio']:.4f} [{c['ratio_ci'][0]:.4f}, {c['ratio_ci'][1]:.4f}], "
              f"dNLL {c['dnll']:+.4f} [{c['dnll_ci'][0]:+.4f}, {c['dnll_ci'][1]:+.4f}] (paired bootstrap, 95%)")
    paths = report.save(args.out_dir)
    print(f"wrote {paths['json']} and {paths['png']}")
    return 0


def _evaluated(run, windows, batch_size: int):
    """``run()``'s report, or the exit status when the model refuses a spec (S above a layer's
    top-k: found before the baseline pass); says how many sequences a partial batch left out."""
    from sere_fx.errors import ArgumentError

    try:
        report = run()
    except ArgumentError as exc:
        if exc.arg == "policy":
            return _error("eval", f"--policies: {exc}")
        raise
    dropped = report.config["dropped_sequences"]
    if dropped:
        print(f"note: {dropped} of {windows.shape[0]} sequences left out: not a full batch of {batch_size}",
              file=sys.stderr)
    return report


def _eval_generate(args, specs, sim, engine_kwargs, placement) -> int:
    """``eval --generate``: free-running batched greedy decode (``sere_fx.generation``)."""
    from sere_fx.generation import evaluate_generation

    if engine_kwargs is not None:
        raise CliError("--generate: free-running evaluation runs on the transformers path; expected no --engine vllm "
                       "with it (inside vLLM, run lm-evaluation-harness against the engine: docs/evaluation.md)")
    if placement is not None:
        raise CliError(f"--ep-ranks: not counted by --generate; expected none with it, got {args.ep_ranks}")
    if args.compare:
        raise CliError(f"--compare: --generate compares every policy with the baseline; expected no --compare with "
                       f"it, got {' '.join(args.compare[0])}")
    model, tokenizer = _load_model(args)
    windows = _windows(args, tokenizer, args.prefill + args.steps)
    if windows.shape[0] < args.batch_size:
        return _error("eval", f"--batch-size: expected at most the {windows.shape[0]} sequences {args.data} gives, "
                              f"got {args.batch_size}")
    report = _evaluated(lambda: evaluate_generation(model, windows, specs, sim, batch_size=args.batch_size,
                                                    prefill=args.prefill, max_tokens=args.max_tokens),
                        windows, args.batch_size)
    if isinstance(report, int):
        return report
    print(report.table())
    print(f"wrote {report.save(args.out_dir)}")
    return 0
