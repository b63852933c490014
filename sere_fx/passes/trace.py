"""Bring an eager module to a graph the matcher can read, and back to a forward method.

``trace_module`` uses ``torch.fx.symbolic_trace`` (Python level): the graph keeps
``get_attr`` access to the module's own parameters and its dtype-dependent casts
(``x.to(logits.dtype)``), so the rewritten module still follows ``.to(device/dtype)``,
``state_dict()`` and ``load_state_dict()`` exactly like the original.
"""

from __future__ import annotations

import linecache
import itertools

import torch
from torch import fx, nn


def trace_module(module: nn.Module) -> fx.Graph:
    return fx.Tracer().trace(module)


class _ShapeRecorder(fx.Interpreter):
    def run_node(self, n):
        result = super().run_node(n)
        if isinstance(result, torch.Tensor):
            n.meta["val"] = result.detach()
        return result


@torch.no_grad()
def annotate_shapes(module: nn.Module, graph: fx.Graph, *example_inputs) -> None:
    """Run ``graph`` (as ``module``'s forward) on real example inputs; record each value in ``meta["val"]``."""
    gm = fx.GraphModule(module, graph)
    _ShapeRecorder(gm).run(*example_inputs)
    graph.owning_module = None  # the graph goes on to be rewritten for ``module``, not ``gm``


_counter = itertools.count()


def graph_forward(graph: fx.Graph):
    """Compile ``graph`` into a plain function ``forward(self, ...)`` reading attributes of ``self``."""
    code = graph.python_code(root_module="self")
    filename = f"<sere_fx-forward-{next(_counter)}>"
    # Register the source so tracebacks and debuggers show the generated code.
    linecache.cache[filename] = (len(code.src), None, code.src.splitlines(keepends=True), filename)
    namespace = dict(code.globals)
    exec(compile(code.src, filename, "exec"), namespace)
    forward = namespace["forward"]
    forward.__sere_source__ = code.src
    return forward
