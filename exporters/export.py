"""``export(model, example_inputs, path, format)``: one entry point for every artifact format."""

from __future__ import annotations

import contextlib
import json
import os

import torch
from torch import nn
from torch.export import Dim

FORMATS = ("pt2", "aoti", "onnx", "tensorrt")
SETTINGS_KEY = "sere_settings.json"


class LogitsOnly(nn.Module):
    """A causal LM as ``input_ids -> logits`` (no cache): the graph an artifact holds."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


def settings_of(model: nn.Module) -> dict:
    """What an artifact records: the SERE settings, or that the model is untransformed."""
    s = getattr(model, "sere_settings", None)
    return {"sere_fx": True, **s.as_dict()} if s is not None else {"sere_fx": False}


def _as_args(example_inputs) -> tuple:
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, dict):
        if set(example_inputs) - {"input_ids"}:
            raise ValueError(f"example_inputs: only 'input_ids' is exported, got keys {sorted(example_inputs)}")
        return (example_inputs["input_ids"],)
    if isinstance(example_inputs, (tuple, list)) and all(isinstance(x, torch.Tensor) for x in example_inputs):
        return tuple(example_inputs)
    raise TypeError(f"example_inputs: expected a tensor, a tuple of tensors or {{'input_ids': tensor}}, "
                    f"got {type(example_inputs).__name__}")


@contextlib.contextmanager
def _experts_implementation(model: nn.Module, name: str | None):
    """Temporarily switch a transformers model's experts implementation."""
    config = getattr(model, "config", None)
    current = getattr(config, "_experts_implementation", None)
    if name is None or current is None or current == name or not hasattr(model, "set_experts_implementation"):
        yield
        return
    model.set_experts_implementation(name)
    try:
        yield
    finally:
        model.set_experts_implementation(current)


def exported_program(model: nn.Module, example_inputs, *, max_batch: int = 1024) -> torch.export.ExportedProgram:
    """``torch.export`` of the model's logits (transformers models) with a dynamic batch dim."""
    settings = getattr(model, "sere_settings", None)
    if settings is not None and settings.max_tokens is not None:
        topk = sorted(i for i, lp in settings.layers.items() if lp.policy == "topk")
        if topk:
            raise ValueError(
                f"max_tokens: policy 'topk' (layers {topk}) changes the number of routed slots, so a graph cannot keep "
                f"both sides of the prefill/decode branch; export it re-routing every call (max_tokens=None), "
                f"got {settings.max_tokens}"
            )
    args = _as_args(example_inputs)
    if getattr(model, "config", None) is not None and hasattr(model, "generate"):
        module = LogitsOnly(model).eval()
        if len(args) != 1:
            raise ValueError(f"example_inputs: a causal LM exports input_ids only, got {len(args)} tensors")
    else:
        module = model.eval()
    if getattr(getattr(model, "config", None), "_experts_implementation", None) == "eager":
        raise ValueError("model: the 'eager' experts implementation loops over experts with data-dependent control "
                         "flow and cannot be exported; call model.set_experts_implementation('grouped_mm') first")
    if args[0].shape[0] == 1:
        # A size-1 example gets specialised to 1 by tracing; a batch of 2 keeps the dim
        # symbolic (the artifact still takes batch 1).
        args = tuple(torch.cat([a, a]) for a in args)
    batch = Dim("batch", min=1, max=max_batch)
    dynamic = tuple({0: batch} for _ in args)
    return torch.export.export(module, args, dynamic_shapes=dynamic, strict=False)


def export(model: nn.Module, example_inputs, path: str | os.PathLike, format: str = "pt2", *,
           max_batch: int = 1024) -> str:
    """Write ``model`` (transformed by ``sere_fx.transform`` or not) as a deployable artifact.

    ``example_inputs``: ``input_ids [B, L]`` (a tensor, a 1-tuple or ``{"input_ids": ...}``),
    or the positional inputs of a plain ``nn.Module``. The batch dimension is dynamic in
    ``[1, max_batch]``; the sequence length is fixed by the example. Returns the path written.
    """
    if format not in FORMATS:
        raise ValueError(f"format: expected one of {list(FORMATS)}, got {format!r}")
    path = os.fspath(path)
    meta = json.dumps(settings_of(model), sort_keys=True)
    if format == "tensorrt":
        settings = getattr(model, "sere_settings", None)
        if settings is not None and settings.max_tokens is not None:
            raise ValueError(
                f"max_tokens: format 'tensorrt' cannot carry the prefill/decode branch (torch.cond); export it "
                f"re-routing every call (max_tokens=None), got {settings.max_tokens}"
            )
        from sere_fx.exporters.tensorrt import export_tensorrt

        return export_tensorrt(model, example_inputs, path, meta, max_batch=max_batch)
    if format == "onnx":
        from sere_fx.exporters.onnx import export_onnx

        # transformers' grouped_mm is a custom op ONNX cannot express; batched_mm is the same
        # math in standard ops.
        with _experts_implementation(model, "batched_mm"), torch.no_grad():
            ep = exported_program(model, example_inputs, max_batch=max_batch)
        return export_onnx(ep, path, meta)
    with torch.no_grad():
        ep = exported_program(model, example_inputs, max_batch=max_batch)
    if format == "pt2":
        torch.export.save(ep, path, extra_files={SETTINGS_KEY: meta})
        return path
    # aoti
    return torch._inductor.aoti_compile_and_package(
        ep, package_path=path, inductor_configs={"aot_inductor.metadata": {SETTINGS_KEY: meta}}
    )


def read_settings(path: str | os.PathLike) -> dict:
    """The SERE settings an artifact written by ``export`` records."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"path: no artifact at {path!r}")
    if path.endswith(".onnx"):
        import onnx

        props = {p.key: p.value for p in onnx.load(path, load_external_data=False).metadata_props}
        return json.loads(props[SETTINGS_KEY])
    if path.endswith(".ts"):
        extra = {SETTINGS_KEY: ""}
        torch.jit.load(path, _extra_files=extra, map_location="cpu")
        return json.loads(extra[SETTINGS_KEY])
    import zipfile

    with zipfile.ZipFile(path) as z:
        for name in z.namelist():
            if name.endswith("extra/" + SETTINGS_KEY):
                return json.loads(z.read(name))
    loader = torch._inductor.aoti_load_package(path)
    return json.loads(loader.get_metadata()[SETTINGS_KEY])
