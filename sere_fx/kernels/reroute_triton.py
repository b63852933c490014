"""Triton kernel for ``sere.reroute`` (used on CUDA; tested on the CPU with ``TRITON_INTERPRET=1``).

One program does the whole batch: the work is O(E^2 + T*K) with E <= a few hundred and
T*K <= a few thousand at decode, so a single CTA is faster than any multi-launch scheme
(the launch itself dominates). Three phases:

1. primary mask over experts, from each valid token's first S slots, or, with rank values,
   its S best-ranked slots (a slot's rank = slots with a larger value, or an equal value at
   a lower slot; compare-and-reduce, no atomics, no sort), and every slot of a free row;
2. per expert row of the similarity matrix: best primary (ties: lowest index, like
   ``torch.argmax``), critical test against rho in float32, written to a remap table;
3. ``out = table[topk_ids]`` for every slot of every valid row (primary slots are fixed
   points); invalid rows, and ids outside ``[0, E)``, are copied. Every load is masked.

Everything stays on the device with static launch shapes (no host sync), so the launch can
be captured in a CUDA graph.
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
        rank_ptr,
        valid_ptr,
        free_ptr,
        table_ptr,
        out_ptr,
        T,
        K,
        E,
        S,
        rho,
        HAS_RHO: tl.constexpr,
        HAS_RANK: tl.constexpr,
        HAS_VALID: tl.constexpr,
        HAS_FREE: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        cols = tl.arange(0, BLOCK_E)
        slots = tl.arange(0, BLOCK_K)

        # Phase 1: primary[e] = 1 if a valid token has e among its S best-ranked slots, or a free
        # row (read anyway, not re-routed) has e in any slot. Ids outside [0, E) count for nothing.
        primary = tl.zeros([BLOCK_E], dtype=tl.int32)
        for t0 in range(0, T, BLOCK_T):
            toks = t0 + tl.arange(0, BLOCK_T)
            row_in = toks < T
            row_ok = row_in
            if HAS_VALID:
                row_ok = row_in & (tl.load(valid_ptr + toks, mask=row_in, other=0) != 0)
            if HAS_FREE:
                free_ok = row_in & (tl.load(free_ptr + toks, mask=row_in, other=0) != 0) & ~row_ok
            if HAS_RANK:
                inside = row_ok[:, None] & (slots[None, :] < K)
                vals = tl.load(rank_ptr + toks[:, None] * K + slots[None, :], mask=inside, other=0.0).to(tl.float32)
            for s in range(0, K if (HAS_RANK or HAS_FREE) else S):
                e = tl.load(ids_ptr + toks * K + s, mask=row_in, other=-1).to(tl.int32)
                take = row_ok
                if HAS_RANK:
                    v = tl.load(rank_ptr + toks * K + s, mask=row_ok, other=0.0).to(tl.float32)
                    ahead = ((vals > v[:, None]) | ((vals == v[:, None]) & (slots[None, :] < s))) & inside
                    take = take & (tl.sum(ahead.to(tl.int32), axis=1) < S)
                else:
                    take = take & (s < S)
                if HAS_FREE:
                    take = take | free_ok
                e = tl.where(take & (e >= 0) & (e < E), e, -1)
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
            keep = (row_primary > 0) | (best_sim == float("-inf"))  # no primary: nothing to re-route to
            if HAS_RHO:
                keep = keep | (best_sim < rho)
            table = tl.where(keep, rows, best)
            tl.store(table_ptr + rows, table.to(tl.int64), mask=rows < E)

        # The table was written by other threads of this program: make it visible.
        tl.debug_barrier()

        # Phase 3: out = table[ids] on valid rows, ids elsewhere (and for ids outside [0, E)).
        n = T * K
        for i0 in range(0, n, BLOCK_N):
            offs = i0 + tl.arange(0, BLOCK_N)
            e = tl.load(ids_ptr + offs, mask=offs < n, other=0)
            known = (e >= 0) & (e < E)
            new = tl.load(table_ptr + e, mask=(offs < n) & known, other=0).to(e.dtype)
            new = tl.where(known, new, e)
            if HAS_VALID:
                ok = tl.load(valid_ptr + offs // K, mask=offs < n, other=0) != 0
                new = tl.where(ok, new, e)
            tl.store(out_ptr + offs, new, mask=offs < n)


def launch(wrap, topk_ids: torch.Tensor, similarity: torch.Tensor, S: int, rho: float,
           rank_values: torch.Tensor | None = None, valid_rows: torch.Tensor | None = None,
           free_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the kernel; ``wrap`` is ``torch.library.wrap_triton`` (or identity for direct calls)."""
    if not AVAILABLE:
        raise RuntimeError("sere_fx.kernels.reroute_triton: triton is not installed")
    ids = topk_ids.contiguous()
    sim = similarity.to(torch.float32).contiguous()
    num_tokens, k = ids.shape
    num_experts = sim.shape[0]
    table = torch.empty(num_experts, dtype=torch.int64, device=ids.device)
    out = torch.empty_like(ids)
    # Unused pointers get any tensor of the device: the kernel never reads them.
    rank = ids if rank_values is None else rank_values.contiguous()
    valid = ids if valid_rows is None else valid_rows.contiguous().view(torch.uint8)
    free = ids if free_rows is None else free_rows.contiguous().view(torch.uint8)
    block_e = max(16, triton.next_power_of_2(num_experts))
    wrap(_reroute_kernel)[(1,)](
        ids,
        sim,
        rank,
        valid,
        free,
        table,
        out,
        num_tokens,
        k,
        num_experts,
        S,
        float(rho),
        HAS_RHO=rho > 0,
        HAS_RANK=rank_values is not None,
        HAS_VALID=valid_rows is not None,
        HAS_FREE=free_rows is not None,
        BLOCK_T=32,
        BLOCK_K=max(2, triton.next_power_of_2(k)),
        BLOCK_E=block_e,
        BLOCK_R=max(1, min(32, 4096 // block_e)),
        BLOCK_N=256,
    )
    return out
