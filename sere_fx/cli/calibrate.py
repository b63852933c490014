"""``sere-fx calibrate``: expert-similarity matrices of a model on a text, written to a .safetensors file
(transformers, or inside a vLLM engine)."""

from __future__ import annotations

from sere_fx.cli.common import (CliError, _check_data, _data_args, _engine_args, _engine_kwargs, _load_model,
                                 _load_model_dir_checks, _model_args, _output_dir_missing, _start_engine, _windows)


def add_parser(sub) -> None:
    from sere_fx.calibration.methods import DEFAULT_CKA_SAMPLE, METHODS

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
    c.set_defaults(func=run)


def run(args) -> int:
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
