"""The re-routing op: ``torch.ops.sere.reroute(topk_ids, similarity, S, rho)``.

Semantics, for ``topk_ids [T, K]`` (int64 or int32) whose slot order is rank order (slot 0 = best):

1. primary set P = union over all T tokens of ``topk_ids[:, :S]``;
2. every slot s >= S whose expert e is not in P is re-routed to
   ``b = argmax_{p in P} similarity[e, p]`` (ties: lowest expert index);
3. unless ``rho > 0`` and ``similarity[e, b] < rho``: then e is *critical* and kept.

``S >= K`` is the identity. The input is never mutated, router weights are never touched.

Three optional arguments serve engines whose top-k is unsorted and whose batches mix phases:
``rank_values [T, K]`` ranks each token's slots (descending, ties to the lower slot) instead of
their order; ``valid_rows [T]`` (bool) limits both the primary set and the re-routing to
those rows, and other rows come back unchanged; ``free_rows [T]`` (bool) marks rows among the
others whose experts are read anyway (a mixed step's prompt rows): all K of their experts join
the primary set (a row both valid and free counts as valid). Slots keep their places either
way: slots ranked below S hold primary experts, which the table maps to themselves, so no
permutation is needed.

Ids outside ``[0, E)`` (an engine's padding rows write -1; fused shared experts sit past E) are
left as they are and take no part in the primary set.

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

from sere_fx.kernels import reroute_cpu, reroute_triton

__all__ = ["reroute", "reroute_aten", "reroute_kernel", "primary_mask", "remap_table", "apply_table", "decompositions",
           "use_triton", "free_experts"]


def primary_mask(topk_ids: torch.Tensor, S: int, num_experts: int, rank_values: torch.Tensor | None = None,
                 valid_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean ``[E]``: experts among the first ``S`` ranked slots of any valid token.

    Slots are ranked by ``rank_values`` (descending, ties to the lower slot) when given, else
    taken in their order. Rows where ``valid_rows`` is False, and ids outside ``[0, E)``, do
    not contribute.
    """
    if rank_values is None:
        top = topk_ids[:, :S]
    else:
        top = topk_ids.gather(1, rank_values.argsort(dim=1, descending=True, stable=True)[:, :S])
    top = top.to(torch.int64)
    outside = (top < 0) | (top >= num_experts)
    if valid_rows is not None:
        outside = outside | ~valid_rows.unsqueeze(1)
    top = top.masked_fill(outside, num_experts)  # a scratch slot past the last expert
    primary = torch.zeros(num_experts + 1, dtype=torch.bool, device=topk_ids.device)
    # index_put with the 2-D index (no flattening view): a view to a size computed inside a
    # torch.cond branch does not survive the ONNX exporter's re-tracing.
    return primary.index_put((top,), primary.new_ones(()))[:num_experts]


def free_experts(topk_ids: torch.Tensor, num_experts: int, free_rows: torch.Tensor | None) -> torch.Tensor | None:
    """Boolean ``[E]``: every expert of the ``free_rows`` (all K slots), or None without them."""
    if free_rows is None:
        return None
    return primary_mask(topk_ids, topk_ids.shape[1], num_experts, valid_rows=free_rows)


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
    keep = primary | torch.isneginf(best_sim)  # no primary expert at all: nothing to re-route to
    if rho > 0:
        # A Python scalar against a float32 tensor compares in float32, and it stays a scalar
        # in exported graphs (a tensor built from it would not be functional).
        keep = keep | (best_sim < rho)
    return torch.where(keep, experts, best if choice is None else choice)


def apply_table(table: torch.Tensor, topk_ids: torch.Tensor, valid_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``table[topk_ids]`` in the ids' dtype; rows where ``valid_rows`` is False, and ids outside
    the table, are left as they are."""
    ids = topk_ids.to(torch.int64)
    inside = (ids >= 0) & (ids < table.shape[0])
    out = table[ids.clamp(0, table.shape[0] - 1)].to(topk_ids.dtype)
    keep = inside if valid_rows is None else inside & valid_rows.unsqueeze(1)
    return torch.where(keep, out, topk_ids)


def reroute_aten(topk_ids: torch.Tensor, similarity: torch.Tensor, S: int, rho: float,
                 rank_values: torch.Tensor | None = None, valid_rows: torch.Tensor | None = None,
                 free_rows: torch.Tensor | None = None) -> torch.Tensor:
    """The vectorised PyTorch implementation (any device); also the decomposition exporters use."""
    _check_args(topk_ids, similarity, S, rank_values, valid_rows, free_rows)
    if S >= topk_ids.shape[1] or topk_ids.shape[0] == 0:
        return topk_ids.clone()
    e = similarity.shape[0]
    primary = primary_mask(topk_ids, S, e, rank_values, valid_rows)
    if free_rows is not None:
        primary = primary | free_experts(topk_ids, e, free_rows if valid_rows is None else free_rows & ~valid_rows)
    return apply_table(remap_table(primary, similarity, rho), topk_ids, valid_rows)


def _check(cond, message) -> None:
    # Real tensors give plain bools: a Python test costs ~0.1 us where torch._check costs ~1.5 us
    # (this runs in every MoE layer of every decode step). Symbolic sizes go to torch._check.
    if isinstance(cond, bool):
        if not cond:
            raise RuntimeError(message())
    else:
        torch._check(cond, message)


def _check_args(topk_ids: torch.Tensor, similarity: torch.Tensor, S: int, rank_values=None, valid_rows=None,
                free_rows=None) -> None:
    # Shape/dtype checks only: they cost nothing and are valid on fake tensors.
    _check(topk_ids.dim() == 2, lambda: f"topk_ids: expected a 2-D [T, K] tensor, got shape {tuple(topk_ids.shape)}")
    _check(
        topk_ids.dtype in (torch.int64, torch.int32),
        lambda: f"topk_ids: expected dtype torch.int64 or torch.int32, got {topk_ids.dtype}",
    )
    _check(
        similarity.dim() == 2 and similarity.shape[0] == similarity.shape[1],
        lambda: f"similarity: expected a square [E, E] tensor, got shape {tuple(similarity.shape)}",
    )
    _check(similarity.dtype.is_floating_point, lambda: f"similarity: expected a floating dtype, got {similarity.dtype}")
    _check(S >= 1, lambda: f"S: expected an integer >= 1, got {S}")
    if rank_values is not None:
        _check(
            rank_values.shape == topk_ids.shape,
            lambda: f"rank_values: expected shape {tuple(topk_ids.shape)} (as topk_ids), got {tuple(rank_values.shape)}",
        )
    for name, rows in (("valid_rows", valid_rows), ("free_rows", free_rows)):
        if rows is not None:
            _check(
                rows.dim() == 1 and rows.shape[0] == topk_ids.shape[0] and rows.dtype == torch.bool,
                lambda name=name, rows=rows: f"{name}: expected a bool [{topk_ids.shape[0]}] tensor, got "
                f"{rows.dtype} {tuple(rows.shape)}",
            )


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


def eager(t: torch.Tensor) -> bool:
    """A real tensor outside any tracing (compile, export, jit and dispatch-mode tracing see fake,
    functional or proxy tensors): code may then take paths that graphs and ONNX cannot hold."""
    return (type(t) is torch.Tensor and not torch.compiler.is_compiling() and not torch.jit.is_tracing()
            and torch._C._len_torch_dispatch_stack() == 0)


def _eager_cpu(t: torch.Tensor) -> bool:
    """A real CPU tensor outside any tracing (fake, functional and proxy tensors take the ATen path)."""
    return t.device.type == "cpu" and eager(t)


def _c_kernel_takes(topk_ids: torch.Tensor, similarity: torch.Tensor) -> bool:
    """Whether ``reroute_kernel`` gives a call on these ids (``[..., T, K]``) to the C kernel: a real CPU tensor
    within the kernel's sizes, not sent to Triton."""
    return (not (reroute_triton.AVAILABLE and _FORCE_TRITON) and _eager_cpu(topk_ids)
            and reroute_cpu.fits(similarity.shape[0], topk_ids.shape[-1]))


def reroute_kernel(topk_ids: torch.Tensor, similarity: torch.Tensor, S: int, rho: float,
                   rank_values: torch.Tensor | None = None, valid_rows: torch.Tensor | None = None,
                   free_rows: torch.Tensor | None = None, wrap=lambda kernel: kernel) -> torch.Tensor:
    """Run the op's rule with the fastest implementation for the tensors: the Triton kernel on CUDA
    (``wrap`` is ``wrap_triton`` inside the registered op), the C kernel on the CPU, else ATen."""
    if S >= topk_ids.shape[1] or topk_ids.shape[0] == 0:
        return topk_ids.clone()
    if reroute_triton.AVAILABLE and (topk_ids.is_cuda or _FORCE_TRITON):
        return reroute_triton.launch(wrap, topk_ids, similarity, S, rho, rank_values, valid_rows, free_rows)
    if _c_kernel_takes(topk_ids, similarity):
        return reroute_cpu.reroute(topk_ids, similarity, S, rho, rank_values, valid_rows, free_rows)
    return reroute_aten(topk_ids, similarity, S, rho, rank_values, valid_rows, free_rows)


@triton_op("sere::reroute", mutates_args=())
def reroute(topk_ids: torch.Tensor, similarity: torch.Tensor, S: int, rho: float,
            rank_values: torch.Tensor | None = None, valid_rows: torch.Tensor | None = None,
            free_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Re-route ``topk_ids [T, K]`` onto the batch's primary experts. See module doc.

    Compilers see through this op (``triton_op``): Inductor inlines its Triton kernel on CUDA
    and its ATen implementation elsewhere; ``torch.export`` keeps it as one node.
    """
    _check_args(topk_ids, similarity, S, rank_values, valid_rows, free_rows)
    return reroute_kernel(topk_ids, similarity, S, rho, rank_values, valid_rows, free_rows, wrap_triton)


@reroute.register_fake
def _(topk_ids, similarity, S, rho, rank_values=None, valid_rows=None, free_rows=None):
    _check_args(topk_ids, similarity, S, rank_values, valid_rows, free_rows)
    return torch.empty_like(topk_ids)


@torch.library.register_vmap("sere::reroute")
def _(info, in_dims, topk_ids, similarity, S, rho, rank_values=None, valid_rows=None, free_rows=None):
    # A batch of independent calls (``policies.batch_groups`` routes many small batches at once): each
    # call runs the op's own implementation, so no second copy of the rule exists to drift from it. On
    # the CPU the C kernel takes the stacked calls in one call (1,536 batches of one row per test-bed
    # forward: ~20 ms of per-call overhead otherwise); elsewhere one call each.
    tensors = (topk_ids, similarity, rank_values, valid_rows, free_rows)
    dims = tuple(in_dims[:2]) + tuple(in_dims[4:]) + (None,) * (7 - len(in_dims))
    stacked = dims[0] == 0 and dims[1] is None and all(t is None or d == 0 for t, d in zip(tensors[2:], dims[2:]))
    if stacked and S < topk_ids.shape[-1] and topk_ids.shape[1] > 0 and _c_kernel_takes(topk_ids, similarity):
        return reroute_cpu.reroute(topk_ids, similarity, S, rho, rank_values, valid_rows, free_rows), 0

    def pick(i: int):
        return [t if d is None or t is None else t.select(d, i) for t, d in zip(tensors, dims)]

    outs = []
    for i in range(info.batch_size):
        ids, sim, *rest = pick(i)
        outs.append(reroute_kernel(ids, sim, S, rho, *rest))
    return torch.stack(outs), 0


def decompositions() -> dict:
    """Decomposition table that lowers ``sere.reroute`` to core ATen ops.

    For ``ExportedProgram.run_decompositions(decompositions())`` when the target runtime
    (ONNX, TensorRT, a plain C++ runner) does not know the op.
    """
    return {torch.ops.sere.reroute.default: reroute_aten}

