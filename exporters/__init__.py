"""Exporters: deployable artifacts of (transformed) models, installed as ``sere_fx.exporters``.

    sere_fx.exporters.export(model, example_inputs, "model.pt2", format="pt2")

Formats: ``pt2`` (torch.export ExportedProgram; ``sere.reroute`` stays one node),
``aoti`` (AOTInductor package), ``onnx`` (standard ONNX ops; runs in plain onnxruntime),
``tensorrt`` (torch-tensorrt; CUDA only). Every artifact records the SERE settings
(``read_settings``). The batch dimension is dynamic.

``export(..., cache="static", max_cache_len=N)`` writes a decoder with its KV cache instead
(``exporters/decoder.py``); ``load(path).generate(input_ids, max_new_tokens)`` runs it.
"""

from sere_fx.exporters.export import CACHES, FORMATS, LogitsOnly, export, read_settings
from sere_fx.exporters.runners import load

__all__ = ["export", "load", "read_settings", "FORMATS", "CACHES", "LogitsOnly"]
