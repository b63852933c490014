"""One MoE layer at real sizes (see ``sere_fx/layer_bench.py``; also ``sere-fx bench``).

    python bench/moe_layer.py            # the full grid -> bench/results/moe_layer.json/.png
"""

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

from sere_fx import layer_bench  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=layer_bench.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    layer_bench.add_arguments(parser, os.path.join(HERE, "results", "moe_layer.json"))
    sys.exit(layer_bench.main(parser.parse_args()))
