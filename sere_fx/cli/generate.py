"""``sere-fx generate``: greedy text from a ``--cache static`` artifact, in the artifact's own runtime."""

from __future__ import annotations

import os

from sere_fx.cli.common import CliError, _first_line, _load_model_dir_checks


def add_parser(sub) -> None:
    g = sub.add_parser("generate", help="greedy text from a --cache static artifact, in the artifact's own runtime")
    g.add_argument("--artifact", required=True, help="a file from `sere-fx export --cache static` (pt2, aoti, onnx)")
    g.add_argument("--model", required=True, help="the model directory the artifact came from (for its tokenizer)")
    g.add_argument("--prompt", required=True, action="append",
                   help="prompt text; repeat it: exactly the artifact's batch of prompts, all of one token length")
    g.add_argument("--max-new-tokens", type=int, default=16, help="tokens to generate (default 16)")
    g.set_defaults(func=run)


def run(args) -> int:
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
