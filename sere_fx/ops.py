"""The re-routing op: ``torch.ops.sere.reroute(topk_ids, similarity, S, rho)``.

Semantics, for ``topk_ids [T, K]`` whose slot order is rank order (slot 0 = best):

1. primary set P = union over all T tokens of ``topk_ids[:, :S]``;
2. every slot s >= S whose expert e is not in P is re-routed to
   ``b = argmax_{p in P} similarity[e, p]`` (ties: lowest expert index);
3. unless ``rho > 0`` and ``similarity[e, b] < rho``: then e is *critical* and kept.

``S >= K`` is the identity. The input is never mutated, router weights are never touched.

Every implementation here builds the same per-batch *remap table* ``table[e]``
(``e`` for primary and critical experts, ``b`` otherwise) and returns ``table[topk_ids]``.
Slots < S always hold primary experts, which the table maps to themselves, so one
gather covers every slot. Work is O(E^2 + T*K) with no loop over tokens.

Comparisons against ``rho`` are made in float32 everywhere (PyTorch, Triton, exported
graphs) so that all back-ends agree on borderline values.
"""

from __future__ import annotations

import torch
from torch.library import triton_op, wrap_triton

from sere_fx.kernels import reroute_triton

__all__ = ["reroute", "reroute_aten", "primary_mask", "remap_table", "decompositions", "use_triton"]


def primary_mask(ranked_ids: torch.Tensor, S: int, num_experts: int) -> torch.Tensor:
    """Boolean ``[E]``: experts among any token's first ``S`` slots."""
    primary = torch.zeros(num_experts, dtype=torch.bool, device=ranked_ids.device)
    return primary.index_fill(0, ranked_ids[:, :S].reshape(-1), True)


def remap_table(primary: torch.Tensor, similarity: torch.Tensor, rho: float,
                choice: torch.Tensor | None = None) -> torch.Tensor:
    """``table[e]`` for a boolean primary mask ``[E]`` and a similarity ``[E, E]`` (int64 ``[E]``).

    Critical experts are decided by the best primary match; a re-routed expert goes to that
    best match, or to ``choice[e]`` when given (the ablation policies pick other targets).
    """
    sim = similarity.to(torch.float32)
    num_experts = sim.shape[0]
    masked = sim.masked_fill(~primary.unsqueeze(0), float("-inf"))
    best = masked.argmax(dim=1)  # argmax returns the first (lowest) index among equal maxima
    best_sim = masked.gather(1, best.unsqueeze(1)).squeeze(1)
    experts = torch.arange(num_experts, device=sim.device)
    keep = primary
    if rho > 0:
        keep = keep | (best_sim < torch.tensor(rho, dtype=torch.float32, device=sim.device))
    return torch.where(keep, experts, best if choice is None else choice)


def reroute_aten(topk_ids: torch.Tensor, similarity: torch.Tensor, S: int, rho: float) -> torch.Tensor:
    """The vectorised PyTorch implementation (any device); also the decomposition exporters use."""
    _check_args(topk_ids, similarity, S)
    if S >= topk_ids.shape[1] or topk_ids.shape[0] == 0:
        return topk_ids.clone()
    table = remap_table(primary_mask(topk_ids, S, similarity.shape[0]), similarity, rho)
    return table[topk_ids]


def _check_args(topk_ids: torch.Tensor, similarity: torch.Tensor, S: int) -> None:
    # Shape/dtype checks only: they cost nothing and are valid on fake tensors.
    torch._check(topk_ids.dim() == 2, lambda: f"topk_ids: expected a 2-D [T, K] tensor, got shape {tuple(topk_ids.shape)}")
    torch._check(
        topk_ids.dtype == torch.int64, lambda: f"topk_ids: expected dtype torch.int64, got {topk_ids.dtype}"
    )
    torch._check(
        similarity.dim() == 2 and similarity.shape[0] == similarity.shape[1],
        lambda: f"similarity: expected a square [E, E] tensor, got shape {tuple(similarity.shape)}",
    )
    torch._check(
        similarity.dtype.is_floating_point, lambda: f"similarity: expected a floating dtype, got {similarity.dtype}"
    )
    torch._check(S >= 1, lambda: f"S: expected an integer >= 1, got {S}")


_FORCE_TRITON = False


class use_triton:
    """Context manager: route eager calls through the Triton kernel on any device.

    Meant for testing the kernel on the CPU under ``TRITON_INTERPRET=1``; on CUDA the
    kernel is used anyway.
    """

    def __init__(self, enabled: bool = True):
        self.enabled = enabled

    def __enter__(self):
        global _FORCE_TRITON
        self._prev, _FORCE_TRITON = _FORCE_TRITON, self.enabled
        return self

    def __exit__(self, *exc):
        global _FORCE_TRITON
        _FORCE_TRITON = self._prev


@triton_op("sere::reroute", mutates_args=())
def reroute(topk_ids: torch.Tensor, similarity: torch.Tensor, S: int, rho: float) -> torch.Tensor:
    """Re-route ``topk_ids [T, K]`` (rank-ordered) onto the batch's primary experts. See module doc."""
    _check_args(topk_ids, similarity, S)
    triton_ok = reroute_triton.AVAILABLE and (topk_ids.is_cuda or _FORCE_TRITON)
    if not triton_ok or S >= topk_ids.shape[1] or topk_ids.shape[0] == 0:
        return reroute_aten(topk_ids, similarity, S, rho)
    return reroute_triton.launch(wrap_triton, topk_ids, similarity, S, rho)


@reroute.register_fake
def _(topk_ids, similarity, S, rho):
    _check_args(topk_ids, similarity, S)
    return torch.empty_like(topk_ids)


def decompositions() -> dict:
    """Decomposition table that lowers ``sere.reroute`` to core ATen ops.

    For ``ExportedProgram.run_decompositions(decompositions())`` when the target runtime
    (ONNX, TensorRT, a plain C++ runner) does not know the op.
    """
    return {torch.ops.sere.reroute.default: reroute_aten}

