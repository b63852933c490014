"""TensorRT through torch-tensorrt (CUDA only).

The re-routing op reaches TensorRT through its ATen decomposition (gather, argmax, where,
index ...), which torch-tensorrt's converters cover; a hand-written TensorRT plugin would
only pay off if the op showed up in profiles, and on the MoE layer it is microseconds
against the experts' milliseconds. Without CUDA or torch-tensorrt this fails at once with
a message that says which is missing.
"""

from __future__ import annotations

import torch


def available() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "format 'tensorrt': needs a CUDA device; this machine has none"
    try:
        import torch_tensorrt  # noqa: F401
    except Exception as exc:  # an ImportError, or a driver error raised at import
        return False, f"format 'tensorrt': torch-tensorrt is not usable here ({type(exc).__name__}: {exc}); " \
                      "install it with `pip install sere-fx[tensorrt]` on a CUDA machine"
    return True, ""


def export_tensorrt(model, args: tuple, path: str, meta: str, key: str, program, *, max_batch: int) -> str:
    """``program(model, args)`` (the exporter's ExportedProgram) compiled by Torch-TensorRT on CUDA,
    saved as TorchScript with ``meta`` (the settings' JSON) recorded under ``key``."""
    ok, why = available()
    if not ok:
        raise RuntimeError(why)
    import torch_tensorrt

    from sere_fx.ops import decompositions

    args = tuple(a.cuda() for a in args)
    model = model.cuda()
    with torch.no_grad():
        ep = program(model, args).run_decompositions(decompositions())
        inputs = [torch_tensorrt.Input(min_shape=(1, *a.shape[1:]), opt_shape=a.shape, max_shape=(max_batch, *a.shape[1:]),
                                       dtype=a.dtype) for a in args]
        trt = torch_tensorrt.dynamo.compile(ep, inputs=inputs)
        torch_tensorrt.save(trt, path, output_format="torchscript", inputs=list(args))
    # record the settings next to the TorchScript payload
    scripted = torch.jit.load(path)
    torch.jit.save(scripted, path, _extra_files={key: meta})
    return path
