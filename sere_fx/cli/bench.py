"""``sere-fx bench``: time one MoE layer at real sizes, baseline against policies and the limit
(``sere_fx.layer_bench``)."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    from sere_fx import layer_bench

    b = sub.add_parser("bench", help="time one MoE layer at real sizes: baseline vs policies, against the limit",
                       description=layer_bench.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    layer_bench.add_arguments(b, "sere-bench/moe_layer.json")
    b.set_defaults(func=run)


def run(args) -> int:
    from sere_fx import layer_bench

    return layer_bench.main(args)
