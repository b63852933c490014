"""``sere-fx export``: a deployable artifact (pt2, aoti, onnx, tensorrt) of a model, re-routed by a policy
or a plan, or untransformed."""

from __future__ import annotations

from sere_fx.cli.common import CliError, _budget, _load_model, _load_sim, _max_tokens, _model_args, _output_dir_missing


def add_parser(sub) -> None:
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
    x.set_defaults(func=run)


def run(args) -> int:
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
