"""Independent plain-loop references, written straight from the documented rules."""

from __future__ import annotations

import math

import torch


def _remap_loop(topk_ids, similarity, S: int, rho: float, target: str, free=()):
    """Nested Python loops over tokens and slots. Critical = the best primary match is below
    rho (float32 comparison); a re-routed slot goes to the most (``target="best"``) or least
    (``"least"``) similar primary, ties to the lowest expert index."""
    ids = [[int(e) for e in row] for row in topk_ids.tolist()]
    if not ids or S >= len(ids[0]):
        return torch.tensor(ids, dtype=torch.int64).reshape(topk_ids.shape)
    sim = similarity.to(torch.float32).tolist()
    primary = sorted({row[s] for row in ids for s in range(S)} | set(free))
    rho32 = float(torch.tensor(rho, dtype=torch.float32))
    out = []
    for row in ids:
        new_row = list(row)
        for s in range(S, len(row)):
            e = row[s]
            if e in primary:
                continue
            best, best_sim = None, None
            for p in primary:  # ascending, strict '>' keeps the lowest index on ties
                if best is None or sim[e][p] > best_sim:
                    best, best_sim = p, sim[e][p]
            if rho > 0 and best_sim < rho32:
                continue  # critical: kept
            new_row[s] = best if target == "best" else min(primary, key=lambda p: (sim[e][p], p))
        out.append(new_row)
    return torch.tensor(out, dtype=torch.int64)


def reroute_loop(topk_ids, similarity, S: int, rho: float):
    """``sere.reroute``, straight from its rules."""
    return _remap_loop(topk_ids, similarity, S, rho, "best")


def rank_order(topk_ids, topk_values):
    """Slot permutation putting each token's slots in descending value order (stable)."""
    perms = []
    for vals in topk_values.tolist():
        perms.append(sorted(range(len(vals)), key=lambda s: (-vals[s], s)))
    return torch.tensor(perms, dtype=torch.int64).reshape(topk_ids.shape)


def reroute_unsorted_loop(topk_ids, topk_values, similarity, S: int, rho: float):
    """Re-route slots that are not in rank order: rank, re-route, put each slot back."""
    perm = rank_order(topk_ids, topk_values)
    ranked = torch.gather(topk_ids, 1, perm)
    rerouted = reroute_loop(ranked, similarity, S, rho)
    out = topk_ids.clone()
    for t in range(out.shape[0]):
        for j in range(out.shape[1]):
            out[t, perm[t, j]] = rerouted[t, j]
    return out


def engine_reroute_loop(topk_ids, topk_values, valid_rows, free_rows, similarity, S: int, rho: float):
    """``sere.reroute`` with every optional argument, straight from its rules: the primary set
    is the valid rows' S best-ranked slots plus every slot of the free rows that are not valid;
    ids outside [0, E) take no part and are kept; only valid rows are re-routed."""
    e_count = similarity.shape[0]
    ids = [[int(e) for e in row] for row in topk_ids.tolist()]
    values = topk_values.tolist()
    valid = [bool(v) for v in valid_rows.tolist()]
    free = [bool(v) and not ok for v, ok in zip(free_rows.tolist(), valid)] if free_rows is not None else [False] * len(ids)
    ranks = [sorted(range(len(v)), key=lambda s: (-v[s], s)) for v in values]
    primary = set()
    for row, rank, ok, fr in zip(ids, ranks, valid, free):
        slots = rank[:S] if ok else (rank if fr else [])
        primary.update(row[s] for s in slots if 0 <= row[s] < e_count)
    sim = similarity.to(torch.float32).tolist()
    rho32 = float(torch.tensor(rho, dtype=torch.float32))
    out = []
    for row, rank, ok in zip(ids, ranks, valid):
        new = list(row)
        for s in (rank[S:] if ok else []):
            e = row[s]
            if not 0 <= e < e_count or e in primary or not primary:
                continue
            best = min(primary, key=lambda p: (-sim[e][p], p))
            if rho > 0 and sim[e][best] < rho32:
                continue
            new[s] = best
        out.append(new)
    return torch.tensor(out, dtype=topk_ids.dtype).reshape(topk_ids.shape)


def least_similar_loop(topk_ids, similarity, S: int, rho: float, free=()):
    """``least_similar``: SERE's primary and critical sets, target = least similar primary;
    ``free``: experts that join the primary set (read anyway)."""
    return _remap_loop(topk_ids, similarity, S, rho, "least", free)


def oea_loop(scores, k: int, k0: int, valid=None, free=()):
    """OEA selection per token (plain loops): list of expert lists, rank order, length <= k.

    Rows where ``valid`` is False keep their own top-k and take no part; ``free``: experts
    loaded anyway."""
    rows = scores.tolist()
    valid = [True] * len(rows) if valid is None else [bool(v) for v in valid]
    ranking = [sorted(range(len(r)), key=lambda e: (-r[e], e)) for r in rows]
    loaded = {e for rank, ok in zip(ranking, valid) if ok for e in rank[:k0]} | set(free)
    chosen = []
    for rank, ok in zip(ranking, valid):
        if not ok:
            chosen.append(rank[:k])
            continue
        picks = list(rank[:k0])
        for e in rank[k0:]:
            if len(picks) == k:
                break
            if e in loaded:
                picks.append(e)
        chosen.append(picks)
    return chosen


def reroute_rows_loop(topk_ids, topk_values, valid_rows, similarity, S: int, rho: float):
    """``sere.reroute`` with ``rank_values`` and ``valid_rows``: only the valid rows form the
    primary set and are re-routed (each slot put back in place); the other rows are copied."""
    valid = [bool(v) for v in valid_rows.tolist()]
    keep = [t for t, ok in enumerate(valid) if ok]
    out = topk_ids.clone()
    if not keep:
        return out
    index = torch.tensor(keep, dtype=torch.int64)
    sub = reroute_unsorted_loop(topk_ids[index].to(torch.int64), topk_values[index], similarity, S, rho)
    for i, t in enumerate(keep):
        out[t] = sub[i].to(out.dtype)
    return out


def output_sizes_loop(row, logits: bool, predictor):
    """The ``output`` policy's predicted squared output norm of every expert for one token (float64):
    exp of (log routing probabilities floored at -30, then 1) times the predictor's columns."""
    if logits:
        top = max(row)
        lse = top + math.log(sum(math.exp(v - top) for v in row))
        logp = [v - lse for v in row]
    else:
        logp = [math.log(v) if v > 0 else -math.inf for v in row]
    features = [max(v, -30.0) for v in logp] + [1.0]
    p = predictor.double().tolist()
    return [math.exp(min(max(sum(f * p[i][e] for i, f in enumerate(features)), -80.0), 80.0))
            for e in range(len(row))]


def weight_loop(scores, k: int, S: int, rho=None, N=None, logits: bool = False, valid=None, probs=None, free=(),
                rank_budget=None, owner=None, predictor=None):
    """The ``weight`` policy per token (plain loops, float64): list of expert lists, rank order.

    ``logits``: shares are a softmax of each token's top-k scores, else the scores over their
    sum; ``probs``: shares from these instead (the scores only rank). Rows where ``valid`` is
    False keep their own top-k and take no part. ``free``: experts loaded anyway, outside the
    budget. ``rank_budget`` with ``owner`` (a list: each expert's rank): after N, at most that
    many loaded experts per rank (a float: of the experts picked on the rank). ``predictor``
    (``[E + 1, E]``): the ``output`` policy: each squared share times ``output_sizes_loop``.
    """
    rows = scores.double().tolist()
    weights = rows if probs is None else probs.double().tolist()
    valid = [True] * len(rows) if valid is None else [bool(v) for v in valid]
    ranking = [sorted(range(len(r)), key=lambda e: (-r[e], e)) for r in rows]
    importance, picked, kept = {}, set(), set()
    for r, rank, ok in zip(weights, ranking, valid):
        if not ok:
            continue
        top = rank[:k]
        mass = [math.exp(r[e] - r[top[0]]) if logits and probs is None else r[e] for e in top]
        size = [1.0] * len(r) if predictor is None else output_sizes_loop(r, logits and probs is None, predictor)
        for e, m in zip(top, mass):
            importance[e] = importance.get(e, 0.0) + (m / sum(mass)) ** 2 * size[e]
        picked.update(top)
        kept.update(rank[:S])
    loaded = set(picked) if rho is None else kept | {e for e in picked if importance[e] >= rho}
    loaded -= set(free)
    if N is not None:
        count = N if isinstance(N, int) else max(1, math.floor(N * len(picked) + 1e-9))
        loaded = set(sorted(loaded, key=lambda e: (e not in kept, -importance[e], e))[:count])
    if rank_budget is not None:
        capped = set()
        for r in set(owner):
            on_rank = sorted((e for e in loaded if owner[e] == r), key=lambda e: (e not in kept, -importance[e], e))
            demand = sum(1 for e in picked if owner[e] == r)
            cap = rank_budget if isinstance(rank_budget, int) else max(1, math.floor(rank_budget * demand + 1e-9))
            capped |= set(on_rank[:cap])
        loaded = capped
    loaded |= set(free)
    return [rank[:k] if not ok else [e for e in rank if e in loaded][:k] for rank, ok in zip(ranking, valid)]
