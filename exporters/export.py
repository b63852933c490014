"""``export(model, example_inputs, path, format)``: one entry point for every artifact format."""

from __future__ import annotations

import contextlib
import json
import os

import torch
from torch import nn
from torch.export import Dim

from sere_fx.config import RowRanges

from sere_fx.errors import ArgumentFileNotFoundError, ArgumentTypeError, ArgumentValueError

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
            raise ArgumentValueError("example_inputs", f"example_inputs: only 'input_ids' is exported, got keys {sorted(example_inputs)}")
        return (example_inputs["input_ids"],)
    if isinstance(example_inputs, (tuple, list)) and all(isinstance(x, torch.Tensor) for x in example_inputs):
        return tuple(example_inputs)
    raise ArgumentTypeError("example_inputs", f"example_inputs: expected a tensor, a tuple of tensors or {{'input_ids': tensor}}, "
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


def _check_exportable(model: nn.Module) -> None:
    from sere_fx.expert_cache import is_offloaded

    if is_offloaded(model):
        raise ArgumentValueError("model", "model: its experts are offloaded (sere_fx.offload): an artifact holds every "
                                          "weight in its graph and has no expert cache; export the model as loaded")
    settings = getattr(model, "sere_settings", None)
    ranged = sorted(i for i, lp in (settings.layers.items() if settings is not None else ())
                    if isinstance(lp, RowRanges) and any(c.policy == "topk" for _, c in lp.ranges))
    if ranged:
        raise ArgumentValueError(
            "plan", f"plan: policy 'topk' in a range (layers {ranged}) changes the number of routed slots, so a graph "
                    "cannot keep it beside the other ranges' branches; use 'oea' or 'weight' there, which keep K slots")
    if settings is not None and settings.max_tokens is not None:
        topk = sorted(i for i, lp in settings.layers.items() if lp.policy == "topk")
        if topk:
            raise ArgumentValueError(
                "max_tokens",
                f"max_tokens: policy 'topk' (layers {topk}) changes the number of routed slots, so a graph cannot keep "
                f"both sides of the prefill/decode branch; export it re-routing every call (max_tokens=None), "
                f"got {settings.max_tokens}"
            )
    if getattr(getattr(model, "config", None), "_experts_implementation", None) == "eager":
        raise ArgumentValueError("model", "model: the 'eager' experts implementation loops over experts with data-dependent control "
                         "flow and cannot be exported; call model.set_experts_implementation('grouped_mm') first")


def exported_program(model: nn.Module, example_inputs, *, max_batch: int = 1024) -> torch.export.ExportedProgram:
    """``torch.export`` of the model's logits (transformers models) with a dynamic batch dim."""
    args = _as_args(example_inputs)
    _check_exportable(model)
    if getattr(model, "config", None) is not None and hasattr(model, "generate"):
        module = LogitsOnly(model).eval()
        if len(args) != 1:
            raise ArgumentValueError("example_inputs", f"example_inputs: a causal LM exports input_ids only, got {len(args)} tensors")
    else:
        module = model.eval()
    if args[0].shape[0] == 1:
        # A size-1 example gets specialised to 1 by tracing; a batch of 2 keeps the dim
        # symbolic (the artifact still takes batch 1).
        args = tuple(torch.cat([a, a]) for a in args)
    batch = Dim("batch", min=1, max=max_batch)
    dynamic = tuple({0: batch} for _ in args)
    return torch.export.export(module, args, dynamic_shapes=dynamic, strict=False)


CACHES = (None, "static")


def _cache_inputs(model: nn.Module, example_inputs, max_cache_len) -> torch.Tensor:
    """The prompt a cache export traces with, after checking the cache arguments."""
    if not hasattr(model, "generate") or getattr(model, "config", None) is None:
        raise ArgumentValueError("cache", f"cache: 'static' needs a transformers causal LM, got {type(model).__name__}")
    if isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int) or max_cache_len < 2:
        raise ArgumentValueError("max_cache_len", f"max_cache_len: expected an int >= 2 with cache='static', got {max_cache_len!r}")
    args = _as_args(example_inputs)
    ids = args[0]
    if len(args) != 1 or ids.dim() != 2:
        raise ArgumentValueError("example_inputs", f"example_inputs: expected one input_ids [B, L] tensor, got {len(args)} tensors, the first "
                         f"of shape {tuple(ids.shape)}")
    # A length-1 example would specialise the (dynamic) length to 1.
    ids = ids if ids.shape[1] >= 2 else torch.cat([ids, ids], dim=1)
    return ids[:, : max_cache_len]


def export(model: nn.Module, example_inputs, path: str | os.PathLike, format: str = "pt2", *,
           max_batch: int | None = None, cache: str | None = None, max_cache_len: int | None = None) -> str:
    """Write ``model`` (transformed by ``sere_fx.transform`` or not) as a deployable artifact.

    ``example_inputs``: ``input_ids [B, L]`` (a tensor, a 1-tuple or ``{"input_ids": ...}``),
    or the positional inputs of a plain ``nn.Module``. Returns the path written.

    ``cache=None`` (default): ``input_ids -> logits`` with no cache; the batch is dynamic in
    ``[1, max_batch]`` (default 1024), the sequence length is the example's.
    ``cache="static"``: a decoder with a KV cache of ``max_cache_len`` positions
    (``sere_fx.exporters.decoder``): ``input_ids [B, L]`` + ``cache_position [L]`` -> logits, L
    dynamic, so the same artifact prefills and decodes; the batch is fixed to the example's
    (SERE's saving depends on it). Run it with ``sere_fx.exporters.load(path).generate(...)``.
    """
    if format not in FORMATS:
        raise ArgumentValueError("format", f"format: expected one of {list(FORMATS)}, got {format!r}")
    if cache not in CACHES:
        raise ArgumentValueError("cache", f"cache: expected one of {list(CACHES)}, got {cache!r}")
    if cache is None and max_cache_len is not None:
        raise ArgumentValueError("max_cache_len", f"max_cache_len: only used with cache='static', got {max_cache_len} with cache=None")
    if cache is not None and max_batch is not None:
        raise ArgumentValueError("max_batch", f"max_batch: a cache export's batch is fixed to the example's, got max_batch={max_batch}")
    path = os.fspath(path)
    settings = settings_of(model)
    if format == "tensorrt":
        if cache is not None:
            raise ArgumentValueError("cache", "cache: format 'tensorrt' does not carry a KV cache here; export cache='static' as "
                             "'aoti' (CUDA too) or 'onnx' (ONNX Runtime's TensorRT provider), got cache='static'")
        if settings.get("max_tokens") is not None:
            raise ArgumentValueError(
                "max_tokens",
                f"max_tokens: format 'tensorrt' cannot carry the prefill/decode branch (torch.cond); export it "
                f"re-routing every call (max_tokens=None), got {settings['max_tokens']}"
            )
        from sere_fx.exporters.tensorrt import export_tensorrt

        meta = json.dumps(settings, sort_keys=True)
        batch = max_batch or 1024
        return export_tensorrt(model, _as_args(example_inputs), path, meta, SETTINGS_KEY,
                               lambda m, args: exported_program(m, args, max_batch=batch), max_batch=batch)
    if cache is None:
        return _write(format, path, settings, lambda: exported_program(model, example_inputs,
                                                                       max_batch=max_batch or 1024), model)
    from sere_fx.exporters import decoder

    _check_exportable(model)
    ids = _cache_inputs(model, example_inputs, max_cache_len)
    generation = getattr(model, "generation_config", None)
    eos = getattr(generation, "eos_token_id", None)
    settings["cache"] = {"kind": "static", "batch": int(ids.shape[0]), "max_cache_len": max_cache_len,
                         "vocab_size": int(model.config.vocab_size),
                         # greedy decoding stops as the model's generate does
                         "eos_token_ids": [eos] if isinstance(eos, int) else list(eos or []),
                         "pad_token_id": getattr(generation, "pad_token_id", None)}
    if format == "onnx":
        def program():
            ep, past, present = decoder.export_explicit(model, ids, max_cache_len)
            settings["cache"].update(past=past, present=present)
            return ep, ["input_ids", "cache_position", *past], ["logits", *present]

        return _write(format, path, settings, program, model)
    return _write(format, path, settings, lambda: decoder.export_static(model, ids, max_cache_len), model)


def _write(format: str, path: str, settings: dict, program, model: nn.Module) -> str:
    """Trace with ``program()`` (an ExportedProgram, or for onnx also its input and output names)
    and write the artifact with ``settings`` recorded in it."""
    if format == "onnx":
        from sere_fx.exporters.onnx import export_onnx

        # transformers' grouped_mm is a custom op ONNX cannot express; batched_mm is the same
        # math in standard ops.
        with _experts_implementation(model, "batched_mm"), torch.no_grad():
            traced = program()
        ep, inputs, outputs = traced if isinstance(traced, tuple) else (traced, ["input_ids"], ["logits"])
        return export_onnx(ep, path, json.dumps(settings, sort_keys=True), SETTINGS_KEY, inputs, outputs)
    with torch.no_grad():
        ep = program()
    meta = json.dumps(settings, sort_keys=True)
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
        raise ArgumentFileNotFoundError("path", f"path: no artifact at {path!r}")
    if path.endswith(".onnx"):
        import onnx

        props = {p.key: p.value for p in onnx.load(path, load_external_data=False).metadata_props}
        return json.loads(props[SETTINGS_KEY])
    if path.endswith(".ts"):
        extra = {SETTINGS_KEY: ""}
        torch.jit.load(path, _extra_files=extra, map_location="cpu")
        return json.loads(extra[SETTINGS_KEY])
    settings = pt2_settings(path)
    return settings if settings is not None else package_settings(torch._inductor.aoti_load_package(path))


def pt2_settings(path: str) -> dict | None:
    """The settings a pt2 file keeps as an extra file; None for any other zip (an aoti package)."""
    import zipfile

    if not zipfile.is_zipfile(path):
        raise ArgumentValueError("path", f"path: {path!r} is not a sere-fx artifact (pt2 and aoti artifacts are zip "
                                         "archives; onnx ones end in .onnx)")
    with zipfile.ZipFile(path) as z:
        for name in z.namelist():
            if name.endswith("extra/" + SETTINGS_KEY):
                return json.loads(z.read(name))
    return None


def package_settings(loader) -> dict:
    """The settings a loaded AOTInductor package keeps in its metadata."""
    return json.loads(loader.get_metadata()[SETTINGS_KEY])
