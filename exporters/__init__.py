"""Exporters: deployable artifacts of (transformed) models, installed as ``sere_fx.exporters``.

    sere_fx.exporters.export(model, example_inputs, "model.pt2", format="pt2")

Formats: ``pt2`` (torch.export ExportedProgram; ``sere.reroute`` stays one node),
``aoti`` (AOTInductor package), ``onnx`` (standard ONNX ops; runs in plain onnxruntime),
``tensorrt`` (torch-tensorrt; CUDA only). Every artifact records the SERE settings
(``read_settings``). The batch dimension is dynamic.
"""

from sere_fx.exporters.export import FORMATS, LogitsOnly, export, read_settings

__all__ = ["export", "read_settings", "FORMATS", "LogitsOnly"]
