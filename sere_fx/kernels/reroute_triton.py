"""Triton kernels for ``sere.reroute`` (used on CUDA; tested on the CPU with ``TRITON_INTERPRET=1``).

Three launches, each parallel over its own axis, so that a large prefill step (thousands of
rows) costs a few programs per phase instead of one program looping over every row:

1. ``_primary_kernel``, one program per ``BLOCK_T`` rows: each valid row's S best-ranked
   slots (without rank values, its first S slots; a slot's rank = slots with a larger value,
   or an equal value at a lower slot: compare-and-reduce, no sort) and every slot of a free
   row mark their experts in ``primary [E]``. Programs only ever write 1, so the race between
   them is benign and needs no atomics; a program with no valid or free row loads nothing.
   Two flags follow the E entries: some expert is primary, some row is valid.
2. ``_table_kernel``, one program per ``BLOCK_R`` experts: the best primary expert of each
   row of the similarity matrix (ties: lowest index, like ``torch.argmax``), the critical
   test against rho in float32, written to a remap table. A step with no valid row (no decode
   row) reads no similarity row: those loads are masked off.
3. ``_apply_kernel``, one program per ``BLOCK_N`` slots: ``out = table[ids]`` on valid rows,
   ``ids`` elsewhere and for ids outside ``[0, E)``; without a valid row or a primary expert,
   a copy that reads no table entry.

Every load is masked. Everything stays on the device with launch shapes that depend only on
the tensors' sizes (no host sync), so the launches can be captured in a CUDA graph.
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
    def _primary_kernel(ids_ptr, rank_ptr, valid_ptr, free_ptr, primary_ptr, T, K, E, S,
                        HAS_RANK: tl.constexpr, HAS_VALID: tl.constexpr, HAS_FREE: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
        toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        slots = tl.arange(0, BLOCK_K)
        row_in = toks < T
        row_ok = row_in
        if HAS_VALID:
            row_ok = row_in & (tl.load(valid_ptr + toks, mask=row_in, other=0) != 0)
        take_all = toks < 0  # no row
        if HAS_FREE:
            take_all = row_in & (tl.load(free_ptr + toks, mask=row_in, other=0) != 0) & ~row_ok
        inside = (row_ok | take_all)[:, None] & (slots[None, :] < K)
        e = tl.load(ids_ptr + toks[:, None] * K + slots[None, :], mask=inside, other=-1).to(tl.int32)
        if HAS_RANK:
            vals = tl.load(rank_ptr + toks[:, None] * K + slots[None, :], mask=inside, other=0.0).to(tl.float32)
            ahead = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
            for j in range(0, K):  # slot j is ahead of slot s if its value is larger, or equal at j < s
                vj = tl.load(rank_ptr + toks * K + j, mask=row_ok, other=0.0).to(tl.float32)
                beats = (vj[:, None] > vals) | ((vj[:, None] == vals) & (j < slots[None, :]))
                ahead += beats.to(tl.int32)
            top = ahead < S
        else:
            top = slots[None, :] < S
        take = ((row_ok[:, None] & top) | take_all[:, None]) & inside & (e >= 0) & (e < E)
        tl.store(primary_ptr + e, tl.full([BLOCK_T, BLOCK_K], 1, tl.int32), mask=take)
        any_taken = tl.max(tl.max(take.to(tl.int32), axis=1), axis=0)
        tl.store(primary_ptr + E, any_taken, mask=any_taken > 0)
        any_valid = tl.max(row_ok.to(tl.int32), axis=0)
        tl.store(primary_ptr + E + 1, any_valid, mask=any_valid > 0)

    @triton.jit
    def _table_kernel(sim_ptr, primary_ptr, table_ptr, E, rho, HAS_RHO: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_E)
        # a step with no valid (decode) row reads no similarity row
        any_valid = tl.load(primary_ptr + E + 1 + cols * 0, mask=cols < E, other=0) != 0
        primary = (tl.load(primary_ptr + cols, mask=cols < E, other=0) != 0) & any_valid
        inside = (rows[:, None] < E) & primary[None, :]
        sim = tl.load(sim_ptr + rows[:, None] * E + cols[None, :], mask=inside, other=float("-inf")).to(tl.float32)
        best_sim = tl.max(sim, axis=1)
        is_best = (sim == best_sim[:, None]) & inside
        best = tl.min(tl.where(is_best, cols[None, :], BLOCK_E), axis=1)
        row_primary = tl.load(primary_ptr + rows, mask=rows < E, other=0) != 0
        keep = row_primary | (best_sim == float("-inf"))
        if HAS_RHO:
            keep = keep | (best_sim < rho)
        tl.store(table_ptr + rows, tl.where(keep, rows, best).to(tl.int64), mask=rows < E)

    @triton.jit
    def _apply_kernel(ids_ptr, valid_ptr, primary_ptr, table_ptr, out_ptr, N, K, E,
                      HAS_VALID: tl.constexpr, BLOCK_N: tl.constexpr):
        offs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        in_range = offs < N
        e = tl.load(ids_ptr + offs, mask=in_range, other=0)
        # flags [E]: any primary expert, [E + 1]: any valid row (broadcast per slot); else a copy
        flags = tl.load(primary_ptr + E + offs * 0, mask=in_range, other=0) & tl.load(
            primary_ptr + E + 1 + offs * 0, mask=in_range, other=0)
        known = in_range & (e >= 0) & (e < E) & (flags != 0)
        if HAS_VALID:
            known = known & (tl.load(valid_ptr + offs // K, mask=in_range, other=0) != 0)
        new = tl.load(table_ptr + e, mask=known, other=0).to(e.dtype)
        tl.store(out_ptr + offs, tl.where(known, new, e), mask=in_range)


def launch(wrap, topk_ids: torch.Tensor, similarity: torch.Tensor, S: int, rho: float,
           rank_values: torch.Tensor | None = None, valid_rows: torch.Tensor | None = None,
           free_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the kernels; ``wrap`` is ``torch.library.wrap_triton`` (or identity for direct calls)."""
    if not AVAILABLE:
        raise RuntimeError("sere_fx.kernels.reroute_triton: triton is not installed")
    ids = topk_ids.contiguous()
    sim = similarity.to(torch.float32).contiguous()
    num_tokens, k = ids.shape
    num_experts = sim.shape[0]
    # [E]: experts; then flags: any primary expert, any valid row
    primary = torch.zeros(num_experts + 2, dtype=torch.int32, device=ids.device)
    table = torch.empty(num_experts, dtype=torch.int64, device=ids.device)
    out = torch.empty_like(ids)
    # Unused pointers get any tensor of the device: the kernels never read them.
    rank = ids if rank_values is None else rank_values.contiguous()
    valid = ids if valid_rows is None else valid_rows.contiguous().view(torch.uint8)
    free = ids if free_rows is None else free_rows.contiguous().view(torch.uint8)
    block_t, block_e, block_n = 32, max(16, triton.next_power_of_2(num_experts)), 256
    block_r = max(1, min(32, 4096 // block_e))
    wrap(_primary_kernel)[(triton.cdiv(num_tokens, block_t),)](
        ids, rank, valid, free, primary, num_tokens, k, num_experts, S,
        HAS_RANK=rank_values is not None, HAS_VALID=valid_rows is not None, HAS_FREE=free_rows is not None,
        BLOCK_T=block_t, BLOCK_K=max(2, triton.next_power_of_2(k)))
    wrap(_table_kernel)[(triton.cdiv(num_experts, block_r),)](
        sim, primary, table, num_experts, float(rho), HAS_RHO=rho > 0, BLOCK_R=block_r, BLOCK_E=block_e)
    wrap(_apply_kernel)[(triton.cdiv(num_tokens * k, block_n),)](
        ids, valid, primary, table, out, num_tokens * k, k, num_experts,
        HAS_VALID=valid_rows is not None, BLOCK_N=block_n)
    return out
