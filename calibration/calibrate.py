"""``calibrate(model, batches, method)``: expert-similarity matrices for every MoE layer.

A forward pre-hook on each layer's experts module sees exactly the hidden states the
experts get; padding rows are dropped with the batch's attention mask, and the layer's
accumulator is updated right there, so no activations are kept between batches.

The same pass fits each layer's output-size predictor (``calibration.predictors``, read by
the ``output`` policy): a pre-hook on the router reads the routing features at the routing
site, and the experts' hook pairs them with the experts' output norms on the same tokens.
"""

from __future__ import annotations

import functools
import time

import torch
from torch import nn
from tqdm.auto import tqdm

from sere_fx.calibration.expert_outputs import ExpertOutputs
from sere_fx.calibration.methods import DEFAULT_CKA_SAMPLE, METHODS, accumulator
from sere_fx.calibration.predictors import PredictorFit, features_hook
from sere_fx.discovery import find_moe_layers, model_identity
from sere_fx.errors import ArgumentTypeError, ArgumentValueError
from sere_fx.similarity import Similarity


def _fit_rows(fit: PredictorFit, features: torch.Tensor, start: int, outputs: torch.Tensor) -> None:
    """Feed one chunk of expert outputs ``[E, chunk, H]`` (rows ``start:``) to a predictor fit."""
    fit.update(features[start:start + outputs.shape[1]], outputs)


def _as_batch(batch):
    if isinstance(batch, torch.Tensor):
        ids, mask = batch, None
    elif isinstance(batch, dict) and "input_ids" in batch:
        ids, mask = batch["input_ids"], batch.get("attention_mask")
    else:
        raise ArgumentTypeError("batches", f"batches: expected input_ids tensors [B, L] or dicts with 'input_ids', got {type(batch).__name__}")
    if ids.dim() != 2:
        raise ArgumentValueError("batches", f"batches: expected input_ids of shape [B, L], got {list(ids.shape)}")
    if mask is not None and mask.shape != ids.shape:
        raise ArgumentValueError("batches", f"batches: attention_mask shape {list(mask.shape)} differs from input_ids {list(ids.shape)}")
    return ids, mask


@torch.no_grad()
def calibrate(
    model: nn.Module,
    batches,
    method: str = "frobenius",
    *,
    cka_sample: int = DEFAULT_CKA_SAMPLE,
    progress: bool = True,
    total: int | None = None,
    extra_metadata: dict | None = None,
    predictors: bool = True,
) -> Similarity:
    """Similarity matrices ``{decoder_layer_index: [E, E]}`` of ``model`` on ``batches``.

    ``batches``: an iterable of ``input_ids`` tensors ``[B, L]`` or dicts with ``input_ids``
    and optionally ``attention_mask`` (0 = padding, excluded). ``method``: one of
    ``frobenius`` (default), ``cosine``, ``cka`` (uses a reservoir sample of ``cka_sample``
    tokens per layer). ``total``: number of batches, for the progress bar.
    """
    if method not in METHODS:
        raise ArgumentValueError("method", f"method: expected one of {list(METHODS)}, got {method!r}")
    from sere_fx.model_transform import is_transformed

    if is_transformed(model):
        raise ArgumentValueError("model", "model: calibrate the untransformed model (call sere_fx.restore(model) first)")
    layers = find_moe_layers(model)
    accs = {
        layer.index: accumulator(method, ExpertOutputs(layer.experts, layer.num_experts), layer.num_experts, cka_sample)
        for layer in layers
    }
    fits = {layer.index: PredictorFit(layer.num_experts) for layer in layers} if predictors else {}
    state = {"mask": None}
    features: dict[int, torch.Tensor] = {}  # this batch's routing features, per layer, until its experts run

    def make_hook(index):
        def hook(module, args):
            x = args[0]
            x = x.reshape(-1, x.shape[-1])
            mask = state["mask"]
            if mask is not None:
                if mask.numel() != x.shape[0]:
                    raise RuntimeError(
                        f"calibrate: layer {index}'s experts got {x.shape[0]} rows for a batch of {mask.numel()} tokens"
                    )
                x = x[mask]
            also = None
            if fits:
                f = features.pop(index)
                f = f if mask is None else f[mask]
                if f.shape[0] != x.shape[0]:
                    raise RuntimeError(f"calibrate: layer {index}'s router scored {f.shape[0]} rows, its experts got "
                                       f"{x.shape[0]}")
                also = functools.partial(_fit_rows, fits[index], f)  # reads the accumulator's own outputs
            accs[index].update(x, also=also)

        return hook

    handles = [layer.experts.register_forward_pre_hook(make_hook(layer.index)) for layer in layers]
    if fits:
        handles += [layer.router.register_forward_pre_hook(features_hook(layer, features, layer.index), with_kwargs=True)
                    for layer in layers]
    device = next(model.parameters()).device
    tokens, start = 0, time.perf_counter()
    bar = tqdm(total=total, desc=f"calibrate ({method})", unit="batch", disable=not progress)
    try:
        was_training = model.training
        model.eval()
        for batch in batches:
            ids, mask = _as_batch(batch)
            ids = ids.to(device)
            mask = None if mask is None else mask.to(device)
            state["mask"] = None if mask is None else mask.reshape(-1).bool()
            model(input_ids=ids, attention_mask=mask, use_cache=False)
            tokens += int(mask.sum()) if mask is not None else ids.numel()
            bar.update(1)
            bar.set_postfix(tokens=tokens, tok_per_s=f"{tokens / (time.perf_counter() - start):.0f}", refresh=False)
        model.train(was_training)
    finally:
        for h in handles:
            h.remove()
        bar.close()
    if tokens == 0:
        raise ArgumentValueError("batches", "batches: no calibration tokens (empty iterable or all padding)")
    matrices = {index: acc.finalize() for index, acc in accs.items()}
    fitted = {index: fit.finalize() for index, fit in fits.items()}
    metadata = {"method": method, "tokens": tokens, **model_identity(model, layers)}
    if method == "cka":
        metadata["cka_sample"] = min(cka_sample, tokens)
    metadata.update(extra_metadata or {})
    return Similarity(matrices, metadata, fitted)
