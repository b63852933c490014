"""CPU kernel for ``sere.reroute``: NumPy on the tensors' own memory (no copy, nothing to build).

At decode sizes (T = 32 tokens, K = 8, E = 128) the work is tiny and the cost is per-op
overhead: the vectorised PyTorch version spends ~190 us in a dozen dispatches and two
E x E passes (masked fill, argmax). This kernel avoids the E x E passes:

- once per similarity matrix (cached): each expert's candidates sorted by similarity,
  descending, ties to the lower index, and the first ``PREFIX`` of them with their values;
- per call: the primary mask, then for each expert the first primary among its ``PREFIX``
  best candidates (an ``E x PREFIX`` lookup); the rare expert with no primary there falls back
  to a full row. That first primary is exactly ``argmax`` over primaries with the lowest
  index among ties, as the op's definition says.

NumPy calls cost ~1-2 us here against ~3-5 us for the same PyTorch call, so the whole
step stays around 20 us. Comparisons with rho are made in float32, like every back-end.
"""

from __future__ import annotations

import numpy as np
import torch

PREFIX = 16  # candidates looked at before falling back to a full row
_CACHE: dict[tuple, tuple] = {}
_CACHE_SIZE = 256


def _candidates(similarity: torch.Tensor):
    # The entry holds the tensor, so its memory (and hence the key's data_ptr) cannot be reused
    # while the entry exists; _version changes with any in-place update.
    key = (similarity.data_ptr(), tuple(similarity.shape), similarity.stride(), similarity.dtype,
           similarity._version)
    hit = _CACHE.get(key)
    if hit is None:
        sim = similarity.detach().to(torch.float32).contiguous().numpy()
        e = sim.shape[0]
        order = np.lexsort((np.broadcast_to(np.arange(e), (e, e)), -sim), axis=1)
        prefix = min(PREFIX, e)
        cand = np.ascontiguousarray(order[:, :prefix])
        hit = (similarity, sim, cand, np.arange(e) * prefix, np.arange(e))
        if len(_CACHE) >= _CACHE_SIZE:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = hit
    return hit[1:]


def _array(t: torch.Tensor, dtype: torch.dtype | None = None) -> np.ndarray:
    """The tensor's memory as an array (no copy when it is contiguous and of ``dtype`` already)."""
    if t.requires_grad:
        t = t.detach()
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    return (t if t.is_contiguous() else t.contiguous()).numpy()


_ROW_STARTS: dict[tuple[int, int], np.ndarray] = {}


def _row_starts(t: int, k: int) -> np.ndarray:
    starts = _ROW_STARTS.get((t, k))
    if starts is None:
        starts = _ROW_STARTS[(t, k)] = (np.arange(t) * k)[:, None]
    return starts


def reroute(topk_ids: torch.Tensor, similarity: torch.Tensor, S: int, rho: float,
            rank_values: torch.Tensor | None = None, valid_rows: torch.Tensor | None = None,
            free_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``sere.reroute`` for CPU tensors (same contract as ``sere_fx.ops.reroute_aten``)."""
    sim, cand, row_base, experts = _candidates(similarity)
    e = sim.shape[0]
    ids = _array(topk_ids)
    t, k = ids.shape
    # Ids outside [0, E) (padding, fused shared experts) are rare: one reduction over the ids read
    # as unsigned (-1 becomes the largest value) tells, and only then are they sent to the
    # scratch slot E and restored at the end.
    outside = None
    if t and ids.view(np.uint32 if ids.dtype == np.int32 else np.uint64).max() >= e:
        outside = (ids < 0) | (ids >= e)
        original, ids = ids, np.where(outside, e, ids)
    if rank_values is None:
        primary_ids = ids[:, :S]
    else:
        values = _array(rank_values, torch.float32)
        if S == 1:  # argmax takes the first (lowest) slot among equal values, like a stable sort
            best = values.argmax(axis=1)[:, None]
        else:
            best = np.argsort(-values, axis=1, kind="stable")[:, :S]
        primary_ids = ids.take(best + _row_starts(t, k))
    valid = None if valid_rows is None else _array(valid_rows)
    free = None if free_rows is None else (_array(free_rows) if valid is None else _array(free_rows) & ~valid)
    if valid is not None and valid.all():  # pure decode steps: every row counts
        valid = None
    if valid is not None:
        primary_ids = np.where(valid[:, None], primary_ids, e)  # invalid rows: a scratch slot
    primary = np.zeros(e + 1, dtype=bool)
    primary[primary_ids] = True
    if free is not None:  # every expert of the free rows is read anyway
        primary[ids[free]] = True
    primary = primary[:e]
    hits = primary.take(cand)
    first = row_base + hits.argmax(axis=1)
    table = cand.take(first)
    found = hits.take(first)
    keep = primary
    if not found.all():  # no primary among the prefix (or no valid row at all): full rows
        if not primary.any():  # no primary at all: nothing to re-route to
            keep = np.ones(e, dtype=bool)
        rows = np.flatnonzero(~found)
        table[rows] = np.where(primary[None, :], sim[rows], -np.inf).argmax(axis=1)
    if rho > 0:
        keep = keep | (sim[experts, table] < np.float32(rho))
    np.copyto(table, experts, where=keep)
    if outside is not None:
        table = np.append(table, e)  # the scratch slot maps to itself
        ids = original
        out = np.where(outside, ids, table.take(np.where(outside, e, ids)))
    else:
        out = table.take(ids)
    if valid is not None:
        out = np.where(valid[:, None], out, ids)
    return torch.from_numpy(out.astype(ids.dtype, copy=False))
