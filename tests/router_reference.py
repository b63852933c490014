"""A reference SERE model built without the pass: forward hooks on the untransformed routers
replace their indices output by the plain-loop reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from reference import reroute_loop, reroute_unsorted_loop


def _selection_scores(router, x):
    """The scores each family's top-k selects on (independent re-implementation)."""
    x = x.reshape(-1, router.weight.shape[1])
    name = type(router).__name__
    if name.startswith("GptOss"):
        return F.linear(x, router.weight, router.bias)
    logits = F.linear(x.float(), router.weight.float())
    if name.startswith("DeepseekV3"):
        return logits.sigmoid() + router.e_score_correction_bias
    return logits.softmax(dim=-1, dtype=torch.float32)


def hook_reference(model, layers, sim, S, rho, max_tokens=None, unsorted=False, record=None):
    """Register hooks on ``model``'s routers (found by name from ``layers``); returns the handles."""
    modules = dict(model.named_modules())
    handles = []
    for layer in layers:
        router = modules[layer.router_name]
        matrix = sim[layer.index]

        def hook(module, args, output, matrix=matrix, index=layer.index):
            logits, weights, ids = output
            flat = ids.reshape(-1, ids.shape[-1])
            if max_tokens is not None and flat.shape[0] > max_tokens:
                return output
            if unsorted:
                values = _selection_scores(module, args[0]).gather(1, flat)
                new = reroute_unsorted_loop(flat, values, matrix, S, rho)
            else:
                new = reroute_loop(flat, matrix, S, rho)
            if record is not None:
                record.setdefault(index, []).append((flat.clone(), new.clone()))
            return logits, weights, new.reshape(ids.shape)

        handles.append(router.register_forward_hook(hook))
    return handles
