"""Routing policies: what a rewritten routing site calls. Each policy's rule lives here, once.

Index policies re-route the top-k *indices* and never touch routing weights:

- ``sere``: ``torch.ops.sere.reroute`` (see ``sere_fx.ops``): a secondary expert goes to its
  most similar primary expert unless that similarity is below ``rho`` (critical: kept).
- ``least_similar`` / ``random`` (ablations): the same primary set and the same critical
  experts as ``sere`` (decided by the best match), but a re-routed slot goes to the least
  similar primary expert / a uniformly random primary expert.

Top-k policies replace the router's top-k itself and need the full score vector:

- ``topk`` (direct top-K reduction): each token keeps only its top-S experts; the model's own
  weight computation then runs over those S (re-normalising where the model does).
- ``oea`` (Opportunistic Expert Activation): each token keeps its top-S (``k0``); the batch's
  loaded set L is the union of those; each token then walks down its own ranking and adds
  experts in L until it has K or runs out. Unfilled slots get the token's first expert with
  a *neutral* score (0 for probabilities, -inf for logits), so the model's own weight
  computation gives them weight 0 and no new expert is loaded.
- ``weight`` (criticality by routing weight, and a fixed expert budget): an expert's
  *importance* to the batch is the sum over tokens of the square of its *share* (its weight
  over the sum of the token's top-K weights): dropping an expert moves a token's output in
  proportion to the share it loses, and the loss grows with the square of that move, so
  the sum is a second-order estimate of what dropping the expert costs the batch. The
  loaded set L is every token's top-S, plus each expert whose importance is at least ``rho``,
  and at most ``N`` experts in all: top-S members first, then by importance (ties to the lower
  expert index). ``N`` is a count (an int), or a fraction in (0, 1) of the experts the call's
  tokens picked (rounded down, at least 1). Only experts some token picked are ever loaded,
  so a batch that already needs at most ``N`` keeps its routing. Tokens then refill from L by
  their own ranking, exactly as ``oea`` does. A count fixes a deployment's expert reads per
  step; a fraction fixes the saving on every step, whatever the batch. Under expert
  parallelism a layer takes as long as its most loaded rank: a *per-rank budget* (a count, or
  a fraction of what the call picked on that rank) then caps each rank's share of L, filled
  in the same order (``sere_fx.placement`` says which rank holds each expert).
- ``output`` (``weight`` with importance by output size): the same rule, with each token's
  squared share of an expert multiplied by the squared norm that expert's output is predicted
  to have for that token: dropping an expert moves the token's output by its share *times*
  what the expert adds, and expert outputs differ in size by a factor of several. The
  prediction is ``exp(features @ P)``, ``features`` the token's log routing probabilities
  and a 1 (``output_features``), ``P`` (``[E + 1, E]``) a least-squares fit of the log squared
  output norm made by calibration (``sere_fx.calibration``): the router's scores are all it
  reads, so no expert weight is touched to decide what to load.

Engines that keep some rows on the model's routing (a mixed step's prompt rows) read those
rows' experts anyway. ``free`` (bool ``[E]``) names such experts: for ``sere`` and the
ablations they join the primary set (``sere.reroute``'s ``free_rows``); for ``oea`` and
``weight`` they join the loaded set, outside ``N``'s count.

Every policy leaves calls with more than ``max_tokens`` tokens, and every call inside
``with sere_fx.bypass():``, exactly as the model would have routed them.

Data-parallel ranks route their own batches but read experts from the same expert-parallel
ranks. ``reduce`` (a sum all-reduce over the DP group, one call per layer, on the device) makes
them agree on one primary / loaded set: each rank's set is what the policy would pick for all
ranks' tokens together, so every token is re-routed as it would be in one batch of all of them.
"""

from __future__ import annotations

import torch

from sere_fx.config import INDEX_POLICIES, POLICIES, range_index  # noqa: F401  (the policy names live with their configs)
from sere_fx.errors import argument_error
from sere_fx.ops import apply_table, eager, primary_mask, remap_table

TOPK_POLICIES = tuple(p for p in POLICIES if p not in INDEX_POLICIES)  # replace the router's top-k
REFILL_POLICIES = ("oea", "weight", "output")  # tokens refill from the loaded set; weights come from the model
CACHE_POLICIES = ("prior",)  # read an offload cache's resident set (``sere_fx.expert_cache``)

_BYPASS = False


class bypass:
    """Context manager: every transformed router routes like the original model inside it."""

    def __enter__(self):
        global _BYPASS
        self._prev, _BYPASS = _BYPASS, True
        return self

    def __exit__(self, *exc):
        global _BYPASS
        _BYPASS = self._prev


_GROUPS: "batch_groups | None" = None


class batch_groups:
    """Context manager: every transformed router routes a call's rows as several batches of their own
    (primary and loaded sets, budgets, the plan's range), as if the call were that many separate calls.
    ``tune`` and ``evaluate`` decode many small batches in one forward this way.

    ``batch_groups(rows)``: each run of ``rows`` consecutive rows is a batch (one row per sequence in a
    decode step: batch 1 costs no more forwards than batch 32).
    ``batch_groups(rows, length=L, steps=(first, stop))``: the call's rows are whole sequences of ``L``
    positions, one after the other (a teacher-forced forward of ``[N, L]`` tokens); the rows at each
    position in ``range(first, stop)`` of each run of ``rows`` sequences are a batch (the decode step
    those sequences would take together), and rows at other positions are prompt rows, routed as the
    model routes them. One forward then scores every decode step of every batch.

    Batches of one size are routed together (``torch.vmap`` over them; the same rule, and the same
    result as one call per batch) unless a site records stats or draws random numbers: then one by one."""

    def __init__(self, rows: int | None, *, length: int | None = None, steps: tuple[int, int] | None = None):
        if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
            raise argument_error("rows", f"rows: expected a positive int or None, got {rows!r}")
        if (length is None) != (steps is None):
            raise argument_error("steps", f"steps: give length and steps together, got length={length!r} and "
                                          f"steps={steps!r}")
        if length is not None and not (isinstance(length, int) and len(steps) == 2 and 0 <= steps[0] < steps[1] <= length):
            raise argument_error("steps", f"steps: expected (first, stop) with 0 <= first < stop <= length={length!r}, "
                                          f"got {steps!r}")
        self.rows, self.length, self.steps = rows, length, steps

    def __enter__(self):
        global _GROUPS
        self._prev, _GROUPS = _GROUPS, (None if self.rows is None else self)
        return self

    def __exit__(self, *exc):
        global _GROUPS
        _GROUPS = self._prev

    def split(self, tokens: int, device=None) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """A call of ``tokens`` rows as its batches: stacks of equal-size batches (int64 ``[G, r]`` row
        indices each), and the prompt rows (``[P]``; None when every row is in a batch)."""
        if self.length is None:
            full = tokens - tokens % self.rows
            stacks = [torch.arange(full, device=device).view(-1, self.rows)] if full else []
            if full < tokens:
                stacks.append(torch.arange(full, tokens, device=device).view(1, -1))
            return stacks, None
        if tokens % self.length:
            raise argument_error("length", f"length: a call under batch_groups(length={self.length}) must hold whole "
                                           f"sequences; got {tokens} rows")
        seqs, (first, stop) = tokens // self.length, self.steps
        index = torch.arange(tokens, device=device).view(seqs, self.length)
        full = seqs - seqs % self.rows
        stacks = []
        for block in (index[:full], index[full:]):  # whole runs of ``rows`` sequences, then the rest
            if block.shape[0]:
                r = min(self.rows, block.shape[0])
                # [runs, r, steps] -> one batch per (run, step), its rows the run's sequences at that step
                stacks.append(block[:, first:stop].reshape(-1, r, stop - first).transpose(1, 2).reshape(-1, r))
        prompt = torch.cat([index[:, :first], index[:, stop:]], dim=1).flatten()
        return stacks, (prompt if prompt.numel() else None)


def _grouped(tokens) -> bool:
    """Whether this call is split into ``batch_groups`` (eager calls only: traced graphs never are)."""
    if _GROUPS is None or _BYPASS or not isinstance(tokens, int):
        return False
    return _GROUPS.length is not None or tokens > _GROUPS.rows


def _route_groups(inputs: tuple, route, exact, batched: bool) -> tuple:
    """``route(*rows)`` on each batch that ``batch_groups`` makes of the rows of ``inputs`` (tensors ``[T, ...]``),
    ``exact(*rows)`` (the model's own routing) on its prompt rows; each returns a tuple of ``[rows, w]``
    tensors, and the results come back in row order. ``batched``: batches of one size run as one
    ``torch.vmap`` call (the op has a batching rule), else one call per batch."""
    groups = _GROUPS
    stacks, prompt = groups.split(inputs[0].shape[0], inputs[0].device)
    pieces, where = [], []
    with batch_groups(None):  # inside, each batch is a call of its own
        for stack in stacks:
            if batched and stack.shape[0] > 1:
                out = torch.vmap(route)(*(x[stack] for x in inputs))
                pieces.append(tuple(o.flatten(0, 1) for o in out))
            else:
                parts = [route(*(x[rows] for x in inputs)) for rows in stack]
                pieces.append(tuple(torch.cat(p) for p in zip(*parts)))
            where.append(stack.flatten())
        if prompt is not None:
            with bypass():
                pieces.append(exact(*(x[prompt] for x in inputs)))
            where.append(prompt)
    if len({p[0].shape[1:] for p in pieces}) > 1:
        raise argument_error("policy", "policy: a policy that changes the slot count ('topk') cannot share a forward "
                                       "with prompt rows; decode step by step (decode_scores(parallel=False))")
    order = torch.cat(where)
    return tuple(torch.empty((order.shape[0], *ps[0].shape[1:]), dtype=ps[0].dtype, device=ps[0].device)
                 .index_copy_(0, order, torch.cat(ps)) for ps in zip(*pieces))


def cond_chain(fns, takes):
    """``fns`` (one per range, in order) as one function of the operands, a ``torch.cond`` chain in a
    traced graph: range ``i`` runs where ``takes(i, *operands)`` (a bool scalar: the call is in range
    ``i``, not a later one) holds for it and for no earlier range. The one branching every graph that
    keeps all its ranges uses (exported artifacts, ``_by_rows``; the vLLM plugin's ranged layers)."""

    def chained(i: int):
        if i + 1 == len(fns):
            return fns[i]
        rest = chained(i + 1)
        return lambda *ops: torch.cond(takes(i, *ops), fns[i], rest, ops)

    return chained(0)


def _by_rows(tokens, max_tokens: int | None, stats, branches, model_fn, operands: tuple, count: bool = True):
    """Route a call by its size: ``branches`` is ``((min_rows, fn), ...)`` (ascending from 1; ``fn`` None:
    the model's own routing); a call of ``tokens`` rows runs the last branch whose ``min_rows`` it
    reaches (``range_index``). Calls of more than ``max_tokens`` tokens, and every call inside
    ``bypass()``, run ``model_fn`` (the model's own routing). ``count``: this site records the range
    it took in ``stats`` (one site per layer counts).

    Under ``torch.export`` the token count is a symbolic size: ``torch.cond`` keeps every branch in
    the graph, so an artifact decides per call exactly as the eager model does. ``torch.compile``
    guards on the bounds instead: one graph per range a model meets (and one for prefill), never one
    per batch size. (A ``torch.cond`` there has Dynamo trace its branches again, with the policy's
    constants as separate symbols, which it then refuses to merge.)
    """
    if _BYPASS:
        return model_fn(*operands)
    if isinstance(tokens, int) or not torch.compiler.is_exporting():
        # eager, or compiled: a compiled graph guards on the bounds (one graph per range taken)
        if max_tokens is not None and tokens > max_tokens:
            if stats is not None:
                stats.record_skipped(tokens)
            return model_fn(*operands)
        i = 0 if len(branches) == 1 else range_index([low for low, _ in branches], tokens)
        if stats is not None and count and len(branches) > 1:
            stats.record_range(branches[i][0])
        return (branches[i][1] or model_fn)(*operands)

    run = cond_chain([fn or model_fn for _, fn in branches], lambda i, *_: tokens < branches[i + 1][0])
    if max_tokens is None:
        return run(*operands)
    return torch.cond(tokens <= max_tokens, run, model_fn, operands)


def _one_range(ranges, **setting) -> tuple:
    """A site's ``ranges`` (``((min_rows, setting or None), ...)``), or its single setting as one range."""
    return ((1, setting),) if ranges is None else tuple(ranges)


def ablation_reroute(ranked: torch.Tensor, similarity: torch.Tensor, S: int, rho: float, target: str,
                     generator: torch.Generator | None = None, rank_values: torch.Tensor | None = None,
                     valid_rows: torch.Tensor | None = None, free: torch.Tensor | None = None) -> torch.Tensor:
    """``least_similar`` / ``random`` re-routing of ids ``[T, K]`` (see module doc).

    ``rank_values`` / ``valid_rows`` as for ``sere.reroute``: without them the slots are in
    rank order and every row counts; ``free``: experts read anyway (module doc).
    """
    if S >= ranked.shape[1] or ranked.shape[0] == 0:
        return ranked.clone()
    sim = similarity.to(torch.float32)
    e = sim.shape[0]
    primary = primary_mask(ranked, S, e, rank_values, valid_rows)
    if free is not None:
        primary = primary | free
    if target == "least_similar":
        choice = sim.masked_fill(~primary, float("inf")).argmin(dim=1)
    elif target == "random":
        noise = torch.rand(e, e, generator=generator, device=sim.device if generator is None else generator.device)
        choice = noise.to(sim.device).masked_fill(~primary, -1.0).argmax(dim=1)
    else:
        raise argument_error("target", f"target: expected 'least_similar' or 'random', got {target!r}")
    return apply_table(remap_table(primary, sim, rho, choice), ranked, valid_rows)


def remap_ids(
    topk_ids: torch.Tensor,
    topk_values: torch.Tensor | None,
    similarity: torch.Tensor,
    *,
    policy: str = "sere",
    S: int | None = None,
    rho: float | None = None,
    ranges: tuple | None = None,
    max_tokens: int | None = None,
    stats=None,
    generator: torch.Generator | None = None,
    count_ranges: bool = True,
    free: torch.Tensor | None = None,
) -> torch.Tensor:
    """An index policy at a routing site.

    ``topk_ids`` may have leading batch dims (``[..., K]``: flattened into tokens).
    ``topk_values`` is given when the site's top-k is unsorted: slots are put in rank order
    (by these values, descending, stable) for the policy and put back afterwards, so each
    slot keeps its own routing weight. ``stats``: a ``LayerStats`` or None (no cost).
    ``ranges``: settings that follow the load, ``((min_rows, {"policy", "S", "rho"} or None), ...)``
    in place of ``policy`` / ``S`` / ``rho`` (None: the model's routing in that range; ``_by_rows``).
    ``free``: bool ``[E]``, experts read anyway (an offload cache's resident set): primaries too.
    """
    k = topk_ids.shape[-1]
    tokens = topk_ids.numel() // k
    if _grouped(tokens):
        flat = (topk_ids.reshape(-1, k),) + (() if topk_values is None else (topk_values.reshape(-1, k),))

        def route(ids, *values):
            return (remap_ids(ids, values[0] if values else None, similarity, policy=policy, S=S, rho=rho, ranges=ranges,
                              max_tokens=max_tokens, stats=stats, generator=generator, count_ranges=count_ranges,
                              free=free),)

        settings = _one_range(ranges, policy=policy, S=S, rho=rho)
        batched = stats is None and all(s is None or s["policy"] != "random" for _, s in settings)
        (out,) = _route_groups(flat, route, lambda ids, *values: (ids.clone(),), batched)
        return out.reshape(topk_ids.shape)

    def branch(setting):
        if setting is None:
            return None
        policy, S, rho = setting["policy"], setting["S"], setting["rho"]

        def policy_fn(topk_ids, similarity, *values):
            ids = topk_ids.reshape(-1, k).to(torch.int64)
            if values:
                order = values[0].reshape(-1, k).argsort(dim=-1, descending=True, stable=True)
                ranked = ids.gather(1, order)
            else:
                ranked = ids
            if policy == "sere":
                out = (torch.ops.sere.reroute(ranked, similarity, S, rho) if free is None
                       else reroute_free(ranked, similarity, S, rho, free))
            else:
                out = ablation_reroute(ranked, similarity, S, rho, policy, generator, free=free)
            if stats is not None:
                stats.record(ranked, out, S)
            if values:
                out = torch.empty_like(out).scatter(1, order, out)
            return out.to(topk_ids.dtype).reshape(topk_ids.shape)

        return policy_fn

    def model_fn(topk_ids, similarity, *values):
        return topk_ids.clone()  # a branch output may not alias an input

    branches = tuple((low, branch(setting)) for low, setting in _one_range(ranges, policy=policy, S=S, rho=rho))
    operands = (topk_ids, similarity) + (() if topk_values is None else (topk_values,))
    return _by_rows(tokens, max_tokens, stats, branches, model_fn, operands, count_ranges)


def _refill(scores: torch.Tensor, k: int, loaded: torch.Tensor, neutral: float,
            valid_rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each (valid) token's best ``k`` experts within ``loaded`` (bool ``[E]``), by its own scores.

    Unfilled slots repeat the token's first expert with the ``neutral`` score, so the model's
    weight computation gives them 0 and nothing outside ``loaded`` is read. Rows outside
    ``valid_rows`` get their own top-k.
    """
    allowed = loaded.unsqueeze(0) if valid_rows is None else loaded.unsqueeze(0) | ~valid_rows.unsqueeze(1)
    masked = scores.masked_fill(~allowed, neutral)
    values, ids = torch.topk(masked, k, dim=-1)
    filled = allowed.expand_as(scores).gather(1, ids)
    ids = torch.where(filled, ids, ids[:, :1])
    return values.masked_fill(~filled, neutral), ids


def mask_rows(mask: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    """``ceil(E / k)`` rows of ``k`` slots that hold exactly the experts of ``mask`` (bool ``[E]``; a slot
    past them repeats one of them): appended to a call as *free* rows, they make ``sere.reroute`` treat
    those experts as primaries, with no change to the op and no host sync."""
    e = mask.shape[0]
    experts = torch.arange(e + (-e) % k, device=mask.device) % e
    first = mask.to(torch.int32).argmax()  # some expert of the mask (any will do)
    return torch.where(mask[experts], experts, first).reshape(-1, k).to(dtype)


def reroute_free(topk_ids: torch.Tensor, similarity: torch.Tensor, S: int, rho: float, free: torch.Tensor,
                 rank_values=None, valid_rows=None) -> torch.Tensor:
    """``sere.reroute`` with the experts of ``free`` (bool ``[E]``: read anyway, e.g. resident in an
    offload cache, or every data-parallel rank's primaries) among the primaries."""
    t = topk_ids.shape[0]
    rows = mask_rows(free, topk_ids.shape[1], topk_ids.dtype)
    n = rows.shape[0]
    valid = torch.ones(t, dtype=torch.bool, device=topk_ids.device) if valid_rows is None else valid_rows
    if rank_values is None:  # slots in rank order: any decreasing values say the same
        rank_values = torch.arange(topk_ids.shape[1], 0, -1, device=topk_ids.device).expand(t, -1).float()
    out = torch.ops.sere.reroute(torch.cat([topk_ids, rows]), similarity, S, rho,
                                 torch.cat([rank_values, rank_values.new_zeros(n, rank_values.shape[1])]),
                                 torch.cat([valid, valid.new_zeros(n)]),
                                 torch.cat([valid.new_zeros(t), free.any().expand(n)]))
    return out[:t]


def agreed_primary(topk_ids: torch.Tensor, S: int, num_experts: int, reduce, rank_values=None,
                   valid_rows=None, free=None) -> torch.Tensor:
    """SERE's primary set agreed across data-parallel ranks (bool ``[E]``): each rank's (its valid rows'
    top-S, plus ``free``: experts it reads anyway), summed over the ranks by ``reduce``."""
    primary = primary_mask(topk_ids, S, num_experts, rank_values, valid_rows)
    if free is not None:
        primary = primary | free
    return reduce(primary.to(torch.float32)) > 0


def reroute_agreed(topk_ids: torch.Tensor, similarity: torch.Tensor, S: int, rho: float, reduce,
                   rank_values=None, valid_rows=None, free=None) -> torch.Tensor:
    """``sere.reroute`` toward the primary set of all data-parallel ranks (``agreed_primary``);
    ``free``: bool ``[E]``, experts this rank reads anyway."""
    primary = agreed_primary(topk_ids, S, similarity.shape[0], reduce, rank_values, valid_rows, free)
    return reroute_free(topk_ids, similarity, S, rho, primary, rank_values, valid_rows)


def oea_select(scores: torch.Tensor, k: int, k0: int, neutral: float, valid_rows: torch.Tensor | None = None,
               free: torch.Tensor | None = None, reduce=None):
    """OEA on flat scores ``[T, E]``: returns (values, ids, own), each ``[T, k]``, rank-ordered.

    ``own`` is every token's own top-k. With ``valid_rows`` (bool ``[T]``) only those rows form
    the loaded set and are re-selected; the other rows get their own top-k. ``free``: experts
    read anyway, added to the loaded set. ``reduce``: agree on the loaded set across
    data-parallel ranks (module doc).
    """
    own = torch.topk(scores, k, dim=-1).indices
    loaded = primary_mask(own, k0, scores.shape[-1], valid_rows=valid_rows)  # the same rule as SERE's primaries
    if free is not None:
        loaded = loaded | free
    if reduce is not None:
        loaded = reduce(loaded.to(torch.float32)) > 0
    values, ids = _refill(scores, k, loaded, neutral, valid_rows)
    return values, ids, own


def _places(key: torch.Tensor, group: torch.Tensor | None = None, first: torch.Tensor | None = None) -> torch.Tensor:
    """Each expert's place in the order of ``key`` (descending, ties to the lower index), counted
    within its ``group`` (bool ``[E, E]``: experts compared with each other), else over all; experts
    in ``first`` (bool ``[E]``) come before all others whatever their key (an exact lexicographic
    order: lifting their keys by a constant would round away small differences in float32).
    Traced (an exported or compiled graph): E x E compares, since ONNX has no stable sort; eager
    without ``group``: two stable sorts, the same order in O(E log E) (a tuning pass routes thousands
    of one-row batches, where the compares cost seconds)."""
    index = torch.arange(key.shape[0], device=key.device)
    if group is None and eager(key):
        order = torch.sort(key, descending=True, stable=True).indices  # ties keep the lower index first
        if first is not None:  # then ``first`` ahead, each part keeping that order
            order = order[torch.sort(first[order].to(torch.int8), descending=True, stable=True).indices]
        return torch.zeros_like(order).scatter(0, order, index)
    ahead = (key.unsqueeze(0) > key.unsqueeze(1)) | ((key.unsqueeze(0) == key.unsqueeze(1))
                                                     & (index.unsqueeze(0) < index.unsqueeze(1)))
    if first is not None:  # [i, j]: is j ahead of i
        ahead = (first.unsqueeze(0) & ~first.unsqueeze(1)) | ((first.unsqueeze(0) == first.unsqueeze(1)) & ahead)
    return (ahead if group is None else ahead & group).sum(dim=1)


# Log-probabilities below this are all "not routed here": the floor keeps a probability of 0
# (a group-limited router's masked experts) from becoming -inf in the predictor's inputs.
LOG_PROB_FLOOR = -30.0
# exp() of the predicted log squared norm stays finite in float32 for inputs far from calibration.
_LOG_SIZE_CLAMP = 80.0


def output_features(scores: torch.Tensor, neutral: float, probs: torch.Tensor | None = None) -> torch.Tensor:
    """The output-size predictor's inputs for flat scores ``[T, E]``: each token's log routing
    probabilities (``log probs`` when given, else ``log_softmax`` of logits (``neutral`` -inf) or the
    log of probability scores), floored at ``LOG_PROB_FLOOR``, and a constant 1: ``[T, E + 1]``.
    Calibration fits on exactly these, so the fit and its use cannot disagree."""
    if probs is not None:
        logp = probs.float().clamp_min(0.0).log()
    elif neutral == float("-inf"):
        logp = scores.float().log_softmax(dim=-1)
    else:
        logp = scores.float().clamp_min(0.0).log()
    logp = logp.clamp_min(LOG_PROB_FLOOR)
    return torch.cat([logp, logp.new_ones(logp.shape[0], 1)], dim=1)


def predicted_output_size(features: torch.Tensor, predictor: torch.Tensor) -> torch.Tensor:
    """``[T, E]``: the squared output norm each expert is predicted to have for each token."""
    return (features @ predictor.to(features.dtype)).clamp(-_LOG_SIZE_CLAMP, _LOG_SIZE_CLAMP).exp()


def weight_select(scores: torch.Tensor, k: int, S: int, neutral: float, *, rho: float | None = None,
                  N: int | float | None = None, probs: torch.Tensor | None = None, valid_rows: torch.Tensor | None = None,
                  free: torch.Tensor | None = None, rank_budget: int | float | None = None,
                  owner: torch.Tensor | None = None, reduce=None, predictor: torch.Tensor | None = None):
    """The ``weight`` policy on flat scores ``[T, E]`` (see module doc); returns (values, ids, own) as
    ``oea_select`` does. Give ``rho``, ``N`` or both. ``free``: experts read anyway, added to the
    loaded set after the budget (they cost nothing, so ``N`` does not count them).
    ``rank_budget`` with ``owner`` (int ``[E]``, each expert's EP rank): after ``N``, at most
    ``rank_budget`` loaded experts on any rank (a float in (0, 1): that fraction of the experts the
    call's tokens picked on the rank, rounded down, at least 1), filled in the same order.
    ``reduce``: agree on importance, picked, top-S and free experts across data-parallel ranks
    (one all-reduce of ``4 E`` floats), so every rank loads what one batch of all ranks' tokens would.
    ``predictor`` (``[E + 1, E]``): the ``output`` policy: importance weighs each token's squared share
    by the expert's predicted squared output norm (``predicted_output_size``).

    Shares come from ``probs`` (``[T, E]``, the router's probabilities) when given, else from the
    scores: a softmax of the top-k values where they are logits (``neutral`` -inf), the values
    over their sum where they are probabilities.
    """
    num_experts = scores.shape[-1]
    own_values, own = torch.topk(scores, k, dim=-1)
    if probs is not None:
        own_values = probs.gather(1, own)
    if probs is None and neutral == float("-inf"):
        shares = own_values.float().softmax(dim=-1)
    else:
        own_values = own_values.float().clamp_min(0.0)
        shares = own_values / own_values.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    if valid_rows is not None:
        shares = shares.masked_fill(~valid_rows.unsqueeze(1), 0.0)
    shares = torch.zeros(scores.shape, dtype=torch.float32, device=scores.device).scatter(1, own, shares)
    cost = shares.square()  # [T, E]: what dropping each expert costs each token, up to its output's size
    if predictor is not None:
        cost = cost * predicted_output_size(output_features(scores, neutral, probs), predictor)
    importance = cost.sum(dim=0)  # [E]
    picked = primary_mask(own, k, num_experts, valid_rows=valid_rows)  # what the model itself would read
    kept = primary_mask(own, S, num_experts, valid_rows=valid_rows)
    if reduce is not None:
        local_free = torch.zeros_like(picked) if free is None else free
        summed = reduce(torch.cat([importance, picked.float(), kept.float(), local_free.float()]))
        importance, picked, kept, free = summed[:num_experts], *(summed[i * num_experts:(i + 1) * num_experts] > 0
                                                                  for i in range(1, 4))
    loaded = picked if rho is None else kept | (picked & (importance >= rho))
    if free is not None:
        loaded = loaded & ~free  # read anyway: outside the budget, added back below
    if isinstance(N, float):  # a fraction of what this call picked: a tensor, decided per call
        N = (picked.sum().double() * N + 1e-9).floor().clamp_min(1)  # float64: 0.6 * 5 is 3, not 2.99
    # budgets fill in one order: top-S members first, then by importance, ties to the lower index
    order = importance.masked_fill(~loaded, -1.0)
    if N is not None and (isinstance(N, torch.Tensor) or N < num_experts):
        loaded = loaded & (_places(order, first=kept & loaded) < N)
        order = order.masked_fill(~loaded, -1.0)
    if rank_budget is not None:  # expert parallelism: at most this many experts read on any rank
        same_rank = owner.unsqueeze(0) == owner.unsqueeze(1)
        cap = rank_budget
        if isinstance(rank_budget, float):  # a fraction of what this call's tokens picked on the expert's rank
            demand = (same_rank & picked.unsqueeze(0)).sum(dim=1).double()
            cap = (demand * rank_budget + 1e-9).floor().clamp_min(1)
        loaded = loaded & (_places(order, same_rank, first=kept & loaded) < cap)
    if free is not None:
        loaded = loaded | free
    values, ids = _refill(scores, k, loaded, neutral, valid_rows)
    return values, ids, own


def keep_top_s(scores: torch.Tensor, k: int, S: int, neutral: float, valid_rows: torch.Tensor | None = None):
    """The ``topk`` rule for engines whose kernels take exactly ``k`` slots per token.

    Each (valid) token keeps its top-S; its other ``k - S`` slots repeat its first expert with
    the neutral score, so they get weight 0 and load nothing. Returns (values, ids, own) as
    ``oea_select`` does.
    """
    values, own = torch.topk(scores, k, dim=-1)
    dropped = torch.arange(k, device=scores.device).unsqueeze(0) >= S
    if valid_rows is not None:
        dropped = dropped & valid_rows.unsqueeze(1)
    ids = torch.where(dropped, own[:, :1], own)
    return values.masked_fill(dropped, neutral), ids, own


def prior_select(scores: torch.Tensor, k: int, S: int, strength: float, resident: torch.Tensor, neutral: float):
    """The ``prior`` rule (Cache-Prior) on flat scores ``[T, E]``: each token keeps its top-S, and picks
    its other ``k - S`` experts by its scores with the resident experts' lifted by ``strength`` times
    the token's score range (max - min over finite scores), so a resident expert wins a slot over a
    missing one unless the missing one is ahead by more than that. Selected slots keep the model's
    own scores (so its weight computation is unchanged), in descending order. Returns (values, ids,
    own) as ``oea_select`` does."""
    own = torch.topk(scores, k, dim=-1).indices
    finite = torch.isfinite(scores)  # a group-limited router's masked experts are -inf: not in the range
    span = (scores.masked_fill(~finite, float("-inf")).amax(-1)
            - scores.masked_fill(~finite, float("inf")).amin(-1)).clamp_min(0)
    biased = scores.float() + strength * span.float().unsqueeze(1) * resident.to(torch.float32).unsqueeze(0)
    keep = torch.zeros_like(scores, dtype=torch.bool).scatter(1, own[:, :S], True)
    biased = biased.masked_fill(keep, float("inf"))  # a token's top-S are its own whatever the cache holds
    ids = torch.topk(biased, k, dim=-1).indices
    values = scores.gather(1, ids)
    values, order = torch.sort(values, dim=-1, descending=True, stable=True)
    return values, ids.gather(1, order), own


def select_topk(
    scores: torch.Tensor,
    k: int,
    dim: int = -1,
    largest: bool = True,
    sorted: bool = True,
    *,
    policy: str | None = None,
    S: int | None = None,
    neutral: float,
    rho: float | None = None,
    N: int | float | None = None,
    rank_budget: int | float | None = None,
    owners: tuple[int, ...] | None = None,
    ranges: tuple | None = None,
    max_tokens: int | None = None,
    stats=None,
    predictor: torch.Tensor | None = None,
    count_ranges: bool = True,
    free: torch.Tensor | None = None,
):
    """A top-k policy in place of the site's ``torch.topk(scores, k, dim, largest, sorted)``.

    ``rho``, ``N``, ``rank_budget`` and ``owners`` (each expert's EP rank): the ``weight`` / ``output``
    policies' importance threshold, expert budget and per-rank budget; ``predictor``: ``output``'s
    output-size predictor (``[E + 1, E]``). ``ranges``: settings that follow the load,
    ``((min_rows, {"policy", "S", "rho", "N", "rank_budget", "owners"} or None), ...)`` in place of
    the single setting (None: the model's own top-k in that range; ``_by_rows``). ``free``: bool ``[E]``,
    experts read anyway (an offload cache's resident set): loaded for ``oea`` / ``weight`` / ``output``
    outside their budget, and what ``prior`` biases toward."""
    e = scores.shape[-1]
    if _grouped(scores.numel() // e) and dim in (-1, scores.dim() - 1):
        def route(rows):
            return tuple(select_topk(rows, k, -1, largest, sorted, policy=policy, S=S, neutral=neutral, rho=rho, N=N,
                                     rank_budget=rank_budget, owners=owners, ranges=ranges, max_tokens=max_tokens,
                                     stats=stats, predictor=predictor, count_ranges=count_ranges, free=free))

        def exact(rows):
            return tuple(torch.topk(rows, k, dim=-1, largest=largest, sorted=sorted))

        values, ids = _route_groups((scores.reshape(-1, e),), route, exact, stats is None)
        shape = scores.shape[:-1] + (ids.shape[-1],)
        return torch.return_types.topk((values.reshape(shape), ids.reshape(shape)))
    settings = _one_range(ranges, policy=policy, S=S, rho=rho, N=N, rank_budget=rank_budget, owners=owners)
    outputs = {s["policy"] for _, s in settings if s is not None and s["policy"] == "output"}
    for _, setting in settings:
        if setting is not None and setting["policy"] not in TOPK_POLICIES:
            raise argument_error("policy", f"policy: expected one of {list(TOPK_POLICIES)}, got {setting['policy']!r}")
        if setting is not None and setting["policy"] in CACHE_POLICIES and free is None:
            raise argument_error("free", f"free: policy {setting['policy']!r} biases toward an offload cache's "
                                         "resident experts; got none (sere_fx.offload the model first)")
    if (predictor is not None) != bool(outputs):
        raise argument_error("predictor", f"predictor: policy 'output' needs one and only it takes one; got policies "
                                          f"{sorted({s['policy'] for _, s in settings if s})} with "
                                          f"predictor={'a tensor' if predictor is not None else None}")

    def branch(setting):
        if setting is None:
            return None
        policy, S = setting["policy"], setting["S"]

        def policy_fn(scores, *predictor_):  # an operand, not a closure: torch.cond hands its branches tensors
            flat = scores.reshape(-1, e)
            if policy == "topk":
                values, ids = torch.topk(flat, S, dim=-1)
                before = torch.topk(flat, k, dim=-1).indices if stats is not None else None
            elif policy == "oea":
                values, ids, before = oea_select(flat, k, S, neutral, free=free)
            elif policy == "prior":
                values, ids, before = prior_select(flat, k, S, setting["rho"], free, neutral)
            else:
                owners = setting.get("owners")
                owner = None if owners is None else torch.tensor(owners, dtype=torch.int64, device=flat.device)
                values, ids, before = weight_select(flat, k, S, neutral, rho=setting.get("rho"), N=setting.get("N"),
                                                    rank_budget=setting.get("rank_budget"), owner=owner, free=free,
                                                    predictor=predictor_[0] if policy == "output" else None)
            if stats is not None:
                stats.record(before, ids, S)
            shape = scores.shape[:-1] + (ids.shape[-1],)
            return values.reshape(shape), ids.reshape(shape)

        return policy_fn

    def model_fn(scores, *predictor_):
        return tuple(torch.topk(scores, k, dim=dim, largest=largest, sorted=sorted))

    branches = tuple((low, branch(setting)) for low, setting in settings)
    operands = (scores,) if predictor is None else (scores, predictor)
    values, ids = _by_rows(scores.numel() // e, max_tokens, stats, branches, model_fn, operands, count_ranges)
    return torch.return_types.topk((values, ids))
