"""Triton kernel for ``sere.reroute`` (used on CUDA; tested on the CPU with ``TRITON_INTERPRET=1``).

One program does the whole batch: the work is O(E^2 + T*K) with E <= a few hundred and
T*K <= a few thousand at decode, so a single CTA is faster than any multi-launch scheme
(the launch itself dominates). Three phases:

1. primary mask over experts, from ``topk_ids[:, :S]`` (compare-and-reduce, no atomics);
2. per expert row of the similarity matrix: best primary (ties: lowest index, like
   ``torch.argmax``), critical test against rho in float32, written to a remap table;
3. ``out = table[topk_ids]`` for every slot (slots < S are primary, hence fixed points).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    AVAILABLE = True
except ImportError:  # pragma: no cover - exercised on platforms without triton
    AVAILABLE = False


if AVAILABLE:

    @triton.jit
    def _reroute_kernel(
        ids_ptr,
        sim_ptr,
        table_ptr,
        out_ptr,
        T,
        K,
        E,
        S,
        rho,
        HAS_RHO: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        cols = tl.arange(0, BLOCK_E)

        # Phase 1: primary[e] = 1 if any token has e among its first S slots.
        primary = tl.zeros([BLOCK_E], dtype=tl.int32)
        for t0 in range(0, T, BLOCK_T):
            toks = t0 + tl.arange(0, BLOCK_T)
            for s in range(0, S):
                e = tl.load(ids_ptr + toks * K + s, mask=toks < T, other=-1)
                hit = (e[:, None] == cols[None, :]).to(tl.int32)
                primary = tl.maximum(primary, tl.max(hit, axis=0))

        # Phase 2: remap table, BLOCK_R similarity rows at a time.
        for r0 in range(0, E, BLOCK_R):
            rows = r0 + tl.arange(0, BLOCK_R)
            inside = (rows[:, None] < E) & (cols[None, :] < E)
            sim = tl.load(sim_ptr + rows[:, None] * E + cols[None, :], mask=inside, other=0.0).to(tl.float32)
            sim = tl.where((primary[None, :] > 0) & inside, sim, float("-inf"))
            best_sim = tl.max(sim, axis=1)
            is_best = (sim == best_sim[:, None]) & (primary[None, :] > 0)
            best = tl.min(tl.where(is_best, cols[None, :], BLOCK_E), axis=1)
            row_primary = tl.max(tl.where(cols[None, :] == rows[:, None], primary[None, :], 0), axis=1)
            keep = row_primary > 0
            if HAS_RHO:
                keep = keep | (best_sim < rho)
            table = tl.where(keep, rows, best)
            tl.store(table_ptr + rows, table.to(tl.int64), mask=rows < E)

        # The table was written by other threads of this program: make it visible.
        tl.debug_barrier()

        # Phase 3: out = table[ids].
        n = T * K
        for i0 in range(0, n, BLOCK_N):
            offs = i0 + tl.arange(0, BLOCK_N)
            e = tl.load(ids_ptr + offs, mask=offs < n, other=0)
            tl.store(out_ptr + offs, tl.load(table_ptr + e, mask=offs < n, other=0), mask=offs < n)


def launch(wrap, topk_ids: torch.Tensor, similarity: torch.Tensor, S: int, rho: float) -> torch.Tensor:
    """Launch the kernel; ``wrap`` is ``torch.library.wrap_triton`` (or identity for direct calls)."""
    if not AVAILABLE:
        raise RuntimeError("sere_fx.kernels.reroute_triton: triton is not installed")
    ids = topk_ids.contiguous()
    sim = similarity.to(torch.float32).contiguous()
    num_tokens, k = ids.shape
    num_experts = sim.shape[0]
    table = torch.empty(num_experts, dtype=torch.int64, device=ids.device)
    out = torch.empty_like(ids)
    block_e = max(16, triton.next_power_of_2(num_experts))
    wrap(_reroute_kernel)[(1,)](
        ids,
        sim,
        table,
        out,
        num_tokens,
        k,
        num_experts,
        S,
        float(rho),
        HAS_RHO=rho > 0,
        BLOCK_T=32,
        BLOCK_E=block_e,
        BLOCK_R=max(1, min(32, 4096 // block_e)),
        BLOCK_N=256,
    )
    return out
