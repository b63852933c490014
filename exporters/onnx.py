"""ONNX: the re-routing op is lowered to standard ONNX ops through its ATen decomposition.

``sere.reroute`` decomposes into index_fill / masked_fill / argmax / gather / where /
index (``sere_fx.ops.decompositions``): O(E^2 + T*K) work and no per-token loop, all
standard opset-18 operators, so the model runs in plain onnxruntime with no custom-op library.
"""

from __future__ import annotations

import torch

from sere_fx.errors import ArgumentValueError
from sere_fx.ops import decompositions


def _complex_node(ep: torch.export.ExportedProgram):
    for node in ep.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dtype.is_complex:
            return node
    return None


def export_onnx(ep: torch.export.ExportedProgram, path: str, meta: str, key: str, input_names=("input_ids",),
                output_names=("logits",)) -> str:
    import onnx

    node = _complex_node(ep)
    if node is not None:
        raise ArgumentValueError(
            "model",
            f"model: computes in complex numbers (node {node.name!r}: {node.format_node()[:120]}...), e.g. complex "
            "rotary embeddings (DeepSeek-V2); ONNX has no complex tensors. Export it as 'pt2' or 'aoti' instead"
        )

    # Names ONNX Runtime users expect (the exporter would otherwise name the output after its last node).
    program = torch.onnx.export(ep.run_decompositions(decompositions()), dynamo=True, verbose=False,
                                input_names=list(input_names), output_names=list(output_names))
    program.save(path)
    model = onnx.load(path)
    entry = model.metadata_props.add()
    entry.key, entry.value = key, meta
    onnx.save(model, path)
    return path
