"""``sere-fx inspect``: summarise a similarity file; optionally plot heat maps."""

from __future__ import annotations

from sere_fx.cli.common import _finite_float, _load_sim, _out_dir_unusable


def add_parser(sub) -> None:
    i = sub.add_parser("inspect", help="summarise a similarity file; optionally plot heat maps")
    i.add_argument("sim", help="a similarity .safetensors file")
    i.add_argument("--rho", type=_finite_float, default=0.5,
                   help="threshold for counting critical experts (default 0.5)")
    i.add_argument("--plot", metavar="DIR", help="write layer_<i>.png heat maps and overview.png here")
    i.set_defaults(func=run)


def run(args) -> int:
    from sere_fx.calibration.inspect import format_summary, plot

    if args.plot and (failed := _out_dir_unusable("inspect", "--plot", args.plot)) is not None:
        return failed
    sim = _load_sim(args.sim, option="sim")
    print(format_summary(sim, args.rho))
    if args.plot:
        paths = plot(sim, args.plot)
        print(f"plots: {len(paths)} files in {args.plot} (overview: {paths[-1]})")
    return 0
