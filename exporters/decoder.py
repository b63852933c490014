"""Decode artifacts: a causal LM exported with its KV cache, so the runtime runs the decode loop.

One call is ``input_ids [B, L]`` plus ``cache_position [L]`` (the positions those tokens take in
the cache: ``arange(L)`` for the prompt, ``[p]`` for each decode step) -> ``logits [B, L, V]``.
The batch ``B`` and the cache length are fixed at export; ``L`` is dynamic, so one artifact
serves prefill and decode. The re-routing (and its prefill/decode branch) is whatever the
transformed model does, exactly as in the logits-only graphs.

- pt2 / aoti: the cache lives in the module's buffers; each call writes its tokens at
  ``cache_position`` (transformers' own ``StaticCache`` code, so the graph follows it across
  versions instead of a copy of it).
- onnx: ONNX has no mutable state, so the cache is explicit, in Optimum's names:
  inputs ``past_key_values.<i>.key`` / ``.value`` ``[B, H, max_cache_len, D]``, outputs
  ``present.<i>.key`` / ``.value`` of the same shape (the inputs with the new tokens written
  in); the runner feeds each step's present back as the next step's past.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.export import Dim

from sere_fx.evaluate import cache_kwarg


@torch.no_grad()
def _initialised_cache(model: nn.Module, batch: int, max_cache_len: int):
    """A ``StaticCache`` with every layer allocated at its real key and value shapes.

    The shapes come from one eager call (transformers allocates each layer from its first
    keys/values), which is right for every attention kind, e.g. DeepSeek's MLA whose keys and
    values have different head sizes; the call runs under ``bypass`` and its entries are zeroed.
    """
    from transformers.cache_utils import StaticCache, StaticLayer, StaticSlidingWindowLayer

    from sere_fx.policies import bypass

    cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
    for i, layer in enumerate(cache.layers):
        # A sliding-window layer's roll is data-dependent control flow; as a plain static layer it
        # is exact up to the window (transformers' exportable module does the same).
        if isinstance(layer, StaticSlidingWindowLayer):
            cache.layers[i] = StaticLayer(max_cache_len)
    device = next(model.parameters()).device
    with bypass():
        model(input_ids=torch.zeros(batch, 1, dtype=torch.long, device=device), use_cache=True,
              **{cache_kwarg(model): cache})
    for layer in cache.layers:
        layer.keys.zero_()
        layer.values.zero_()
    return cache


class _CacheDecoder(nn.Module):
    def __init__(self, model: nn.Module, batch: int, max_cache_len: int):
        super().__init__()
        self.model = model
        self.cache = _initialised_cache(model, batch, max_cache_len)
        self.cache_arg = cache_kwarg(model)

    def run(self, input_ids: torch.Tensor, cache_position: torch.Tensor, tensors) -> torch.Tensor:
        """The model's logits with ``tensors`` (``[(keys, values)]`` per layer) as its cache; the cache
        code writes the new tokens into them in place."""
        for layer, (keys, values) in zip(self.cache.layers, tensors):
            layer.keys, layer.values = keys, values
            # Where this call's tokens go: a fresh tensor per call (the cache code adds to it in place).
            layer.cumulative_length = cache_position[0].clone()
        return self.model(input_ids=input_ids, attention_mask=None, use_cache=True, **{self.cache_arg: self.cache}).logits


class StaticCacheDecoder(_CacheDecoder):
    """pt2 / aoti: ``(input_ids, cache_position) -> logits``; the cache is the module's buffers."""

    def __init__(self, model: nn.Module, batch: int, max_cache_len: int):
        super().__init__(model, batch, max_cache_len)
        for i, layer in enumerate(self.cache.layers):
            self.register_buffer(f"key_cache_{i}", layer.keys, persistent=False)
            self.register_buffer(f"value_cache_{i}", layer.values, persistent=False)

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        n = len(self.cache.layers)
        return self.run(input_ids, cache_position,
                        [(getattr(self, f"key_cache_{i}"), getattr(self, f"value_cache_{i}")) for i in range(n)])


class ExplicitCacheDecoder(_CacheDecoder):
    """onnx: ``(input_ids, cache_position, *past) -> (logits, *present)``, past/present interleaved
    (key 0, value 0, key 1, ...)."""

    def __init__(self, model: nn.Module, batch: int, max_cache_len: int):
        super().__init__(model, batch, max_cache_len)
        self.shapes = [(tuple(layer.keys.shape), tuple(layer.values.shape)) for layer in self.cache.layers]

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor, *past: torch.Tensor):
        # Clones: the in-place writes land in new tensors, which are the present outputs.
        tensors = [(past[2 * i].clone(), past[2 * i + 1].clone()) for i in range(len(self.shapes))]
        logits = self.run(input_ids, cache_position, tensors)
        return (logits, *[t for pair in tensors for t in pair])


def kv_names(num_layers: int) -> tuple[list[str], list[str]]:
    past = [f"past_key_values.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]
    present = [f"present.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]
    return past, present


def cache_example(input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefill call's inputs: the prompt and its positions."""
    return input_ids, torch.arange(input_ids.shape[1], device=input_ids.device)


def export_static(model: nn.Module, input_ids: torch.Tensor, max_cache_len: int) -> torch.export.ExportedProgram:
    """``torch.export`` of the static-cache decoder (pt2 / aoti); batch fixed, length dynamic."""
    module = StaticCacheDecoder(model, input_ids.shape[0], max_cache_len).eval()
    seq = Dim("seq", min=1, max=max_cache_len)
    ids, positions = cache_example(input_ids)
    return torch.export.export(module, (), {"input_ids": ids, "cache_position": positions},
                               dynamic_shapes={"input_ids": {1: seq}, "cache_position": {0: seq}}, strict=False)


def export_explicit(model: nn.Module, input_ids: torch.Tensor, max_cache_len: int):
    """``torch.export`` of the explicit-cache decoder (onnx); returns (program, past names, present names)."""
    module = ExplicitCacheDecoder(model, input_ids.shape[0], max_cache_len).eval()
    past = [torch.zeros(shape, dtype=model.dtype, device=input_ids.device)
            for pair in module.shapes for shape in pair]
    seq = Dim("seq", min=1, max=max_cache_len)
    ids, positions = cache_example(input_ids)
    ep = torch.export.export(module, (ids, positions, *past),
                             dynamic_shapes=({1: seq}, {0: seq}, (None,) * len(past)), strict=False)
    names = kv_names(len(module.shapes))
    return ep, names[0], names[1]
