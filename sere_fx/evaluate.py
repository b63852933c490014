"""Batched-decode evaluation: how much quality a routing policy keeps, and how many experts it reads.

Teacher-forced *batched decode*: B sequences advance in lockstep with a KV cache, one token
per step, so at every step each MoE layer sees exactly the B tokens of a real decode batch.
A few tokens are prefilled first with the model's own routing (``sere_fx.bypass``). Each
decode step's prediction of the next token is scored: top-1 accuracy and negative
log-likelihood. Distinct experts are counted from what the experts modules actually
receive, per layer per decode step, whatever the policy.

Confidence intervals come from a paired bootstrap over sequences: every policy is scored on
the same sequences, and each resample draws the same sequences for the policy and the
baseline.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import os
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from sere_fx.config import calibration_need, config, needs_similarity, plan_for_layers, routing_spec
from sere_fx.discovery import find_moe_blocks, find_moe_layers
from sere_fx.errors import ArgumentError, ArgumentTypeError, ArgumentValueError, argument_error
from sere_fx.expert_cache import counting, offloaded_layers
from sere_fx.kernels.experts_cpu import grouped_mm_per_expert
from sere_fx.model_transform import restore, transform
from sere_fx.placement import Placement, check_layers, rank_load
from sere_fx.plan import Quantile, parse_budget
from sere_fx.policies import POLICIES, batch_groups, bypass
from sere_fx.similarity import as_similarity, layer_tensors, resolve


@dataclass(frozen=True)
class PolicySpec:
    """A labelled set of ``transform`` arguments; ``kwargs=None`` is the untransformed baseline."""

    label: str
    kwargs: dict | None

    def routing(self, placement: Placement | None = None):
        """The settings as configs (``config.routing_spec``: plan files read, values checked); errors
        name ``policy`` and the spec as typed. ``placement``: what a per-rank budget (``Nrank=``) caps."""
        try:
            if "rank_budget" in self.kwargs:  # one config: the per-rank budget is not a keyword of transform
                if placement is None:
                    raise ArgumentValueError("rank_budget", "rank_budget: a per-rank budget needs a placement "
                                                            "(--ep-ranks), got none")
                return config(**self.kwargs, placement=placement)
            return routing_spec(**self.kwargs)
        except ArgumentError as exc:
            raise argument_error("policy", f"policy: {self.label!r}: {exc.message}", exc._kind()) from None

    def calibration_need(self) -> str | None:
        """What the spec needs from ``--sim`` ("needs ...", ``config.calibration_need``), or None."""
        if self.kwargs is None:
            return None
        need = calibration_need(self.routing(Placement(1)))  # a per-rank budget is built on some placement
        return None if need is None else need[1]


def parse_policy(text: str) -> PolicySpec:
    """``baseline``, ``sere:S=2,rho=0.5``, ``sere:S=2,rho=q0.3`` (quantile), ``topk:S=2``,
    ``oea:S=2``, ``weight:S=1,N=36``, ``weight:S=1,N=0.6``, ``weight:S=1,rho=0.05``, ``random:S=2,rho=0``,
    ``least_similar:S=2,rho=0``, ``output:S=1,N=0.5``, ``plan:PATH``; ``weight:S=1,N=0.6,Nrank=0.5`` adds a per-rank budget
    (expert parallelism: the evaluation's placement)."""
    text = text.strip()
    if text == "baseline":
        return PolicySpec("baseline", None)
    if text == BASELINE_OFFLOAD:  # the model's own routing on an offloaded model: exact routing, LRU cache
        return PolicySpec(BASELINE_OFFLOAD, None)
    name, _, rest = text.partition(":")
    if name == "plan":
        if not rest:
            raise ArgumentValueError("policy", f"policy: expected 'plan:PATH', got {text!r}")
        return PolicySpec(f"plan:{os.path.basename(rest)}", {"plan": rest})
    if name not in POLICIES:
        raise ArgumentValueError("policy", f"policy: expected 'baseline', 'plan:PATH' or one of {list(POLICIES)}, got {name!r} in {text!r}")
    kwargs: dict = {"policy": name}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in ("S", "rho", "N", "Nrank"):
            raise ArgumentValueError("policy", f"policy: expected settings S=<int>, rho=<float>, rho=q<quantile>, "
                                               f"N=<int or fraction> or Nrank=<int or fraction>, got {item!r} in {text!r}")
        try:
            if key == "S":
                kwargs["S"] = int(value)
            elif key == "N":  # a count, or a fraction of the experts each call's tokens picked
                kwargs["N"] = parse_budget(value)
            elif key == "Nrank":  # the same, per expert-parallel rank
                kwargs["rank_budget"] = parse_budget(value)
            elif value.startswith("q"):
                kwargs["rho"] = Quantile(float(value[1:]))
            else:
                kwargs["rho"] = float(value)
        except ValueError as exc:
            wanted = {"S": "an int", "N": "an int or a fraction in (0, 1)",
                      "Nrank": "an int or a fraction in (0, 1)"}.get(key, "a float or q<quantile in [0, 1]>")
            raise ArgumentValueError("policy", f"policy: expected {key}={wanted}, got {item!r} in {text!r} ({exc})") from None
    return PolicySpec(text, kwargs)


BASELINE_OFFLOAD = "lru"  # the baseline's label on an offloaded model

# ``eval --offload``'s standard set: exact routing with LRU (the baseline), the Cache-Prior rule, and
# sere-fx's policies, which on an offloaded model see the cache's resident set (sere_fx.expert_cache):
# the importance rule by predicted output size (``output``; by routing share, ``weight``, where the
# similarity file has no predictors) and SERE toward the resident set. Thresholds from the test-bed
# at a cache of 25% (bench/RESULTS.md, "Experts that do not fit").
OFFLOAD_POLICIES = (
    "lru",
    "prior:S=1,rho=0.1",
    "prior:S=1,rho=0.2",
    "output:S=1,rho=2",
    "output:S=1,rho=5",
    "weight:S=1,rho=0.005",
    "sere:S=1,rho=0.5",
)


def offload_policies(sim) -> list[str]:
    """The standard offload set for what ``sim`` holds: without output-size predictors no ``output``
    row, without a similarity file neither ``output`` nor ``sere``."""
    if sim is None:
        return [p for p in OFFLOAD_POLICIES if not p.startswith(("output:", "sere:"))]
    if not as_similarity(sim).predictors:
        return [p for p in OFFLOAD_POLICIES if not p.startswith("output:")]
    return list(OFFLOAD_POLICIES)

DEFAULT_POLICIES = (
    "baseline",
    "sere:S=2,rho=0.5",
    "sere:S=2,rho=0",
    "topk:S=2",
    "random:S=2,rho=0",
    "least_similar:S=2,rho=0",
    "oea:S=2",
)


@dataclass
class DecodeScores:
    """Per-sequence sums from one pass over the data."""

    correct: np.ndarray  # [N] correct top-1 predictions per sequence
    nll: np.ndarray  # [N] summed negative log-likelihood per sequence
    tokens: np.ndarray  # [N] scored tokens per sequence
    distinct: dict[int, float]  # mean distinct experts per decode step, per MoE layer
    # with a placement (expert parallelism): per MoE layer, the mean over decode steps of the
    # most loaded rank's distinct experts and token-slots, and of all ranks' token-slots
    rank_distinct: dict[int, float] | None = None
    rank_slots: dict[int, float] | None = None
    slots: dict[int, float] | None = None
    # an offloaded model (``sere_fx.offload``): per MoE layer, its cache's counters over the decode steps
    cache: dict[int, dict] | None = None

    @property
    def accuracy(self) -> float:
        return float(self.correct.sum() / self.tokens.sum())

    @property
    def mean_nll(self) -> float:
        return float(self.nll.sum() / self.tokens.sum())

    @property
    def mean_distinct(self) -> float:
        return float(np.mean(list(self.distinct.values())))

    @property
    def mean_rank_distinct(self) -> float | None:
        return None if self.rank_distinct is None else float(np.mean(list(self.rank_distinct.values())))


def _expert_ids(args) -> torch.Tensor:
    for a in args[1:]:
        if isinstance(a, torch.Tensor) and not a.dtype.is_floating_point:
            return a
    raise RuntimeError("evaluate: an experts module was called without integer expert indices")


def cache_kwarg(model: nn.Module) -> str:
    """The name under which ``model.forward`` takes its KV cache: transformers renamed
    ``past_key_values`` to ``cache`` (5.2x; the old name warns until it is removed)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


# ``parallel`` decode hands each MoE layer every position of every window in one call (12,928 tokens for
# 128 windows of 101): the experts' sort, gather and intermediate buffers then outgrow a CPU's caches. The
# routing is decided on the whole call; the experts then run on at most this many tokens at a time (the
# same per-token math), which took 21% off the test-bed's decoder at 128 windows on the 2-core CI machine.
EXPERT_TOKENS = 4096


@contextlib.contextmanager
def experts_in_chunks(model: nn.Module, tokens: int | None = None):
    """On a CPU model, each experts module called with more than ``tokens`` rows (default ``EXPERT_TOKENS``)
    runs on equal chunks of at most that many (its hooks still see one call: ``ExpertCounter`` counts one),
    and transformers' ``grouped_mm`` experts run one expert at a time (``grouped_mm_per_expert``: the same
    output bit for bit; a test-bed decode pass at batch 32 in 21% less time)."""
    tokens = tokens or EXPERT_TOKENS
    device = next(model.parameters()).device
    blocks = find_moe_blocks(model) if device.type == "cpu" else []

    def chunked(experts):
        whole = grouped_mm_per_expert(experts) or type(experts).forward.__get__(experts)

        def forward(hidden, *args, **kwargs):
            n = hidden.shape[0] if isinstance(hidden, torch.Tensor) and hidden.dim() == 2 else 0
            rest = list(args) + list(kwargs.values())
            if n <= tokens or any(isinstance(a, torch.Tensor) and (a.dim() == 0 or a.shape[0] != n) for a in rest):
                return whole(hidden, *args, **kwargs)
            size = -(-n // -(-n // tokens))

            def part(a, i):
                return a[i : i + size] if isinstance(a, torch.Tensor) else a

            return torch.cat([whole(hidden[i : i + size], *(part(a, i) for a in args),
                                    **{k: part(v, i) for k, v in kwargs.items()}) for i in range(0, n, size)])

        return forward

    try:
        for b in blocks:
            b.experts.forward = chunked(b.experts)
        yield
    finally:
        for b in blocks:
            b.experts.__dict__.pop("forward", None)


# Model classes whose forward changes what the output embedding returns (scaling, soft-capping, a cast):
# scored on their own logits (``CachedDecode.whole``).
_HEAD_CHANGED: set[type] = set()
# Logits per scoring chunk: a chunk's [rows, V] logits stay in cache while they are scored.
SCORE_ELEMENTS = 1 << 21


def top1_hits(logits: torch.Tensor, targets: torch.Tensor, owned: bool = False) -> torch.Tensor:
    """``logits.argmax(-1) == targets`` (bool ``[...]``) from a max instead of an argmax: the target is
    argmax's pick where its logit is above every other one. A CPU ``argmax`` over the vocabulary is a
    scalar loop (5.4 ms for a test-bed forward's 16 x 96 x 4,096 logits) and ``amax`` a vectorised one
    (0.7 ms). Rows the max cannot decide, the target tied with another logit (argmax takes the first) or a
    NaN target logit, are decided by ``argmax`` itself, so the result is argmax's, NaNs included (argmax
    and ``amax`` both take NaN as the largest). ``owned``: ``logits`` may be written (it is restored);
    otherwise a copy is."""
    target = targets[..., None]
    if not owned:
        logits = logits.clone()
    picked = logits.gather(-1, target)
    logits.scatter_(-1, target, float("-inf"))  # every logit but the target's
    others = logits.amax(-1, keepdim=True)
    logits.scatter_(-1, target, picked)
    hits = (picked > others).squeeze(-1)
    undecided = ((picked == others) | picked.isnan()).squeeze(-1)
    if bool(undecided.any()):
        hits[undecided] = logits[undecided].argmax(-1) == targets[undecided]
    return hits


def next_token_scores(logits: torch.Tensor, targets: torch.Tensor, nll: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence summed NLL (float64) and correct top-1 counts of ``logits [B, T, V]`` against ``targets
    [B, T]``: NLL is ``logsumexp - target logit`` in float32, top-1 the argmax (``top1_hits``). ``nll=False``:
    top-1 only, the NLL NaN (the ``logsumexp`` over the vocabulary is not computed: 0.25 -> 0.21 s of the
    head and scoring of a test-bed pass, bench/RESULTS.md)."""
    return _scores_in_chunks(lambda i, j: logits[i:j], targets, logits.shape[-1], nll)


def _head_scores(head: nn.Linear, hidden: torch.Tensor, targets: torch.Tensor,
                 nll: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``next_token_scores`` of ``head(hidden)``, the head run one chunk of sequences at a time (its weight
    transposed once: a contiguous ``[H, V]`` right operand multiplies faster on a CPU) as one ``[rows, H]``
    matmul: ``hidden`` is a slice of the model's last hidden states, which ``@`` would multiply sequence by
    sequence (``bmm``, a fifth slower on the test-bed's head for the same products)."""
    weight = head.weight.t().contiguous()

    def logits(i, j):
        h = hidden[i:j]
        rows = h.reshape(-1, h.shape[-1])
        out = rows @ weight if head.bias is None else torch.addmm(head.bias, rows, weight)
        return out.view(*h.shape[:-1], -1)

    return _scores_in_chunks(logits, targets, head.out_features, nll, owned=True)


def _scores_in_chunks(logits_of, targets: torch.Tensor, vocab: int, nll: bool = True,
                      owned: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``next_token_scores`` a few sequences at a time: ``logits_of(i, j)`` gives sequences ``i:j``'s
    logits, scored while they are in cache (``SCORE_ELEMENTS`` per chunk). ``owned``: each chunk is a
    tensor of its own, which scoring may write to (``top1_hits``)."""
    nlls = torch.full((targets.shape[0],), 0.0 if nll else math.nan, dtype=torch.float64, device=targets.device)
    correct = torch.zeros(targets.shape[0], dtype=torch.int64, device=targets.device)
    step = max(1, SCORE_ELEMENTS // (targets.shape[1] * vocab))
    for i in range(0, targets.shape[0], step):
        chunk = logits_of(i, i + step)
        logits, target = chunk.float(), targets[i : i + step]
        if nll:
            nlls[i : i + step] = (torch.logsumexp(logits, -1) - logits.gather(-1, target[..., None]).squeeze(-1)).double().sum(-1)
        correct[i : i + step] = top1_hits(logits, target, owned=owned or logits is not chunk).sum(-1)
    return nlls, correct


def _plain_head(model: nn.Module) -> nn.Linear | None:
    """The model's output embedding where ``CachedDecode.whole`` may run it itself: a plain ``nn.Linear``
    on a real device, with no hooks or wrapped forward (accelerate's offload hooks move weights)."""
    if type(model) in _HEAD_CHANGED or not hasattr(model, "get_output_embeddings"):
        return None
    head = model.get_output_embeddings()
    if (type(head) is not nn.Linear or "forward" in head.__dict__ or head._forward_hooks or head._forward_pre_hooks
            or hasattr(head, "_hf_hook") or head.weight.device.type == "meta"):
        return None
    return head


class CachedDecode:
    """Batched decode with a KV cache: ``prefill`` (the model's own routing, under
    ``bypass``), then ``step`` one token per sequence at a time."""

    def __init__(self, model: nn.Module):
        self.model = model
        self._cache_arg = cache_kwarg(model)
        self._keeps = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._out = None

    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        """Prefill ``tokens [B, L]``; returns the next-token logits ``[B, V]``."""
        with bypass():
            self._out = self.model(input_ids=tokens, use_cache=True)
        return self._out.logits[:, -1]

    def whole(self, tokens: torch.Tensor, targets: torch.Tensor, nll: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward of ``tokens [B, L]`` with no cache, its last ``T`` positions scored against ``targets
        [B, T]`` (``next_token_scores``): per-sequence summed NLL and correct top-1 counts. Where the model
        returns its output embedding's result unchanged, the head runs here, a few sequences at a time
        with each chunk scored while it is in cache (``_head_scores``: the ``[B, T, V]`` logits
        never exist whole); otherwise on the model's own logits. ``nll=False``: top-1 only (NLL NaN)."""
        keep = targets.shape[1]
        kw = {"logits_to_keep": keep} if self._keeps else {}
        head = _plain_head(self.model)
        if head is None:
            return next_token_scores(self.model(input_ids=tokens, use_cache=False, **kw).logits[:, -keep:], targets, nll)
        seen = []

        def capture(hidden):  # the head's input, and a placeholder the size of its output (no memory)
            seen.append(hidden)
            seen.append(hidden.new_empty(()).expand(*hidden.shape[:-1], head.out_features))
            return seen[-1]

        head.forward = capture
        try:
            out = self.model(input_ids=tokens, use_cache=False, **kw)
        finally:
            del head.forward
        if len(seen) == 2 and out.logits is seen[1]:
            return _head_scores(head, seen[0][:, -keep:], targets, nll)
        _HEAD_CHANGED.add(type(self.model))  # the model changes its head's output: its own logits from now on
        return self.whole(tokens, targets, nll)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed ``tokens [B, 1]``; returns the next-token logits ``[B, V]``."""
        cache = getattr(self._out, "cache", None)
        cache = cache if cache is not None else self._out.past_key_values
        self._out = self.model(input_ids=tokens, use_cache=True, **{self._cache_arg: cache})
        return self._out.logits[:, -1]


class ExpertCounter:
    """Counts, per MoE layer, the distinct experts its experts module receives per decode call
    (hooks on the experts modules, whatever the policy), while ``decoding`` is set; with a
    ``placement`` also the most loaded EP rank's experts and token-slots, and all ranks' slots."""

    def __init__(self, model: nn.Module, placement: Placement | None = None, groups: batch_groups | None = None):
        """``groups``: count each batch that this ``batch_groups`` makes of a call as a call of its own (its
        prompt rows not at all); None or ``batch_groups(None)``: each call is one."""
        layers = find_moe_blocks(model)
        self.placement = placement
        self.groups = groups if groups is not None and groups.rows is not None else None
        self.decoding = False
        self.counts = {layer.index: [0, 0] for layer in layers}  # distinct-expert sum, decode calls
        self.ranked = {layer.index: [0, 0, 0] for layer in layers}  # max-rank distinct, max-rank slots, all slots
        self._owners = {} if placement is None else {layer.index: placement.owner(layer.num_experts) for layer in layers}
        self._handles = [layer.experts.register_forward_pre_hook(self._hook(layer.index)) for layer in layers]

    def _stacks(self, every: torch.Tensor) -> list[torch.Tensor]:
        """The decode batches of one experts call's ids ``[T, K]`` as stacks ``[G, r, K]`` of equal-size
        batches (``batch_groups.split``: the rule that routed them)."""
        if self.groups is None:
            return [every[None]]
        stacks, _ = self.groups.split(every.shape[0], every.device)
        return [every[stack] for stack in stacks]

    def _hook(self, index):
        def hook(module, args):
            if not self.decoding:
                return
            for stack in self._stacks(_expert_ids(args)):
                flat = stack.reshape(stack.shape[0], -1).to(torch.int64)
                seen = torch.zeros(flat.shape[0], int(flat.max()) + 1, dtype=torch.bool, device=flat.device)
                self.counts[index][0] += int(seen.scatter_(1, flat, True).sum())
                self.counts[index][1] += flat.shape[0]
                if self.placement is None:
                    continue
                for ids in stack:
                    distinct, slots = rank_load(ids.cpu(), self._owners[index], self.placement.ranks)
                    self.ranked[index][0] += int(distinct.max())
                    self.ranked[index][1] += int(slots.max())
                    self.ranked[index][2] += int(slots.sum())
        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    def distinct(self) -> dict[int, float]:
        return {i: s / max(c, 1) for i, (s, c) in self.counts.items()}

    def per_rank(self) -> list[dict[int, float]]:
        """Per layer, the means of the max-rank distinct experts, max-rank slots and all slots."""
        return [{i: r[j] / max(self.counts[i][1], 1) for i, r in self.ranked.items()} for j in range(3)]


def check_decode_args(windows: torch.Tensor, batch_size: int, prefill: int, after: int = 1) -> None:
    """``batch_size`` and ``prefill`` against ``windows [N, L]``: at least ``after`` tokens follow the prefill."""
    length = windows.shape[1]
    if batch_size < 1:
        raise ArgumentValueError("batch_size", f"batch_size: expected a positive int, got {batch_size}")
    if not 1 <= prefill < length - after:
        raise ArgumentValueError("prefill", f"prefill: expected an int in [1, {length - after - 1}] for windows of "
                                            f"{length} tokens, got {prefill}")


@torch.no_grad()
def decode_scores(model: nn.Module, windows: torch.Tensor, *, batch_size: int = 32, prefill: int = 4,
                  progress: bool = True, desc: str = "decode", placement: Placement | None = None,
                  pack: int = 1, parallel: bool = False, stop=None, nll: bool = True) -> DecodeScores | None:
    """Teacher-forced batched decode over ``windows [N, L]``; scores the L - prefill - 1 decode steps.
    ``placement``: also count, per decode step, the most loaded EP rank's experts and token-slots.
    ``pack``: decode ``pack`` batches of ``batch_size`` in one forward, each routed as its own batch
    (``sere_fx.policies.batch_groups``) and counted as its own (the same scores up to float rounding
    of the larger matmuls, in a fraction of the forwards when ``batch_size`` is small).
    ``parallel``: score every step of ``batch_size * pack`` sequences in one forward of their whole
    windows but the last token, which is only a target (no KV cache), each step's rows of each batch routed
    and counted as that decode step (``batch_groups(..., length=L - 1, steps=...)``); the prefill rows
    route as the model does. The same routing decisions and scores as step by step up to float rounding (attention
    over the whole window instead of a cache), in one forward instead of L - prefill; what ``tune`` uses.
    ``stop``: called after each forward's sequences with ``(correct, nll, done)`` (the per-sequence sums
    of the first ``done`` sequences); when it returns True the pass ends there and returns None (``tune``
    stops a candidate whose loss is already out of budget).
    ``nll=False``: top-1 counts only, every sequence's NLL NaN (``tune --metric accuracy`` reads no NLL: the
    vocabulary's ``logsumexp`` at every scored position is skipped)."""
    n, length = windows.shape
    check_decode_args(windows, batch_size, prefill)
    if isinstance(pack, bool) or not isinstance(pack, int) or pack < 1:
        raise ArgumentValueError("pack", f"pack: expected a positive int, got {pack!r}")
    if not isinstance(nll, bool):
        raise ArgumentValueError("nll", f"nll: expected True or False, got {nll!r}")
    caches = offloaded_layers(model)
    # an offloaded model's caches serve one batch at a time, in step order
    if caches and pack > 1:
        raise ArgumentValueError("pack", f"pack: an offloaded model's caches serve one batch at a time, in step order; "
                                         f"expected 1, got {pack}")
    if caches and parallel:
        raise ArgumentValueError("parallel", "parallel: an offloaded model's caches serve one batch at a time, in step "
                                             "order; expected False, got True")
    if parallel:
        groups = batch_groups(batch_size, length=length - 1, steps=(prefill, length - 1))
    else:
        groups = batch_groups(batch_size if pack > 1 else None)
    batch_size = batch_size * pack
    for c in caches.values():  # every policy starts from an empty cache
        c.reset()
    counter = ExpertCounter(model, placement, groups)
    device = next(model.parameters()).device
    decoder = CachedDecode(model)
    correct = np.zeros(n, dtype=np.int64)
    nlls = np.zeros(n, dtype=np.float64)
    steps = 1 if parallel else length - prefill - 1
    bar = tqdm(total=math.ceil(n / batch_size) * steps, desc=desc, unit="forward" if parallel else "step",
               leave=False, disable=not progress)

    def score(start: int, scores: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Add one batch's per-sequence (NLL, correct) to the sums of the sequences from ``start``."""
        nlls[start : start + scores[0].shape[0]] += scores[0].cpu().numpy()
        correct[start : start + scores[1].shape[0]] += scores[1].cpu().numpy()

    try:
        for start in range(0, n, batch_size):
            batch = windows[start : start + batch_size].to(device)
            if parallel:
                counter.decoding = True
                with groups, experts_in_chunks(model):  # the last token is only a target: not fed
                    score(start, decoder.whole(batch[:, :-1], batch[:, prefill + 1:], nll))
                bar.update(1)
            else:
                counter.decoding = False
                with counting(model, False):  # prefill fills the caches, as in serving, and is not counted
                    decoder.prefill(batch[:, :prefill])
                counter.decoding = True
                for t in range(prefill, length - 1):
                    with groups:  # one row per sequence: with pack, each run of batch-size rows is a batch
                        logits = decoder.step(batch[:, t : t + 1])
                    score(start, next_token_scores(logits[:, None], batch[:, t + 1 : t + 2], nll))
                    bar.update(1)
            done = start + batch.shape[0]
            if stop is not None and done < n and stop(correct[:done], nlls[:done], done):
                return None
    finally:
        counter.remove()
        bar.close()
    tokens = np.full(n, length - prefill - 1, dtype=np.int64)
    cache = {i: c.counters.as_dict() for i, c in caches.items()} or None
    if placement is None:
        return DecodeScores(correct, nlls, tokens, counter.distinct(), cache=cache)
    return DecodeScores(correct, nlls, tokens, counter.distinct(), *counter.per_rank(), cache=cache)


def paired_bootstrap(base: DecodeScores, other: DecodeScores, resamples: int = 2000, seed: int = 0) -> dict:
    """95% intervals of retention (accuracy ratio) and NLL difference, resampling sequences."""
    rng = np.random.default_rng(seed)
    n = base.correct.shape[0]
    idx = rng.integers(0, n, size=(resamples, n))
    tok = base.tokens[idx].sum(1)
    base_correct = base.correct[idx].sum(1)
    with np.errstate(divide="ignore", invalid="ignore"):
        retention = np.where(base_correct > 0, other.correct[idx].sum(1) / base_correct, np.nan)
    dnll = (other.nll[idx].sum(1) - base.nll[idx].sum(1)) / tok
    if np.isnan(retention).all():
        retention_ci = [math.nan, math.nan]
    else:
        retention_ci = [float(np.nanpercentile(retention, 2.5)), float(np.nanpercentile(retention, 97.5))]
    return {
        "retention_ci": retention_ci,
        "dnll_ci": [float(np.percentile(dnll, 2.5)), float(np.percentile(dnll, 97.5))],
    }


@dataclass
class PolicyResult:
    label: str
    accuracy: float
    nll: float
    perplexity: float
    distinct: float
    distinct_per_layer: dict
    retention: float
    retention_ci: list
    dnll: float
    dnll_ci: list
    settings: dict | None = None
    # with ``placement``: the most loaded EP rank per layer per decode step (mean over layers)
    max_rank_distinct: float | None = None
    max_rank_slots: float | None = None
    slots: float | None = None  # all ranks' token-slots per layer per step
    max_rank_distinct_per_layer: dict | None = None
    # an offloaded model: experts fetched (cache misses) and bytes read per decode token per layer
    # (means over layers), the cache's hit rate, and each layer's counters
    fetches_per_token: float | None = None
    bytes_per_token: float | None = None
    hit_rate: float | None = None
    cache_per_layer: dict | None = None


@dataclass
class EvalReport:
    results: list[PolicyResult]
    config: dict = field(default_factory=dict)
    scores: dict[str, DecodeScores] = field(default_factory=dict, repr=False)  # per-sequence, by label

    def compare(self, a: str, b: str) -> dict:
        """Paired bootstrap of policy ``b`` against policy ``a`` (accuracy ratio b/a, NLL b - a)."""
        for label in (a, b):
            if label not in self.scores:
                raise KeyError(f"compare: no policy labelled {label!r}; have {list(self.scores)}")
        sa, sb = self.scores[a], self.scores[b]
        ci = paired_bootstrap(sa, sb)
        ratio = sb.accuracy / sa.accuracy if sa.accuracy else math.nan
        return {"a": a, "b": b, "ratio": ratio, "ratio_ci": ci["retention_ci"],
                "dnll": sb.mean_nll - sa.mean_nll, "dnll_ci": ci["dnll_ci"]}

    def table(self) -> str:
        base = self.results[0]
        lines = [
            f"{'policy':<28} {'acc':>6} {'retention [95% CI]':>24} {'NLL':>7} {'dNLL [95% CI]':>26} "
            f"{'experts/layer':>14} {'vs base':>8}"
        ]
        ep = base.max_rank_distinct is not None
        offload = base.fetches_per_token is not None
        if ep:
            lines[0] += f" {'max-rank experts':>17} {'max-rank slots':>15}"
        if offload:
            lines[0] += f" {'fetches/token/layer':>20} {'vs ' + base.label:>8} {'KiB/token/layer':>16} {'hit rate':>9}"
        for r in self.results:
            lines.append(
                f"{r.label:<28} {r.accuracy:>6.4f} {r.retention:>7.4f} [{r.retention_ci[0]:.4f}, {r.retention_ci[1]:.4f}]"
                f" {r.nll:>7.4f} {r.dnll:>+8.4f} [{r.dnll_ci[0]:+.4f}, {r.dnll_ci[1]:+.4f}]"
                f" {r.distinct:>14.1f} {100 * (r.distinct / base.distinct - 1):>+7.1f}%"
                + (f" {r.max_rank_distinct:>17.2f} {r.max_rank_slots:>15.1f}" if ep else "")
                + (f" {r.fetches_per_token:>20.3f} {_ratio(r.fetches_per_token, base.fetches_per_token):>8}"
                   f" {r.bytes_per_token / 1024:>16.1f} {r.hit_rate:>9.3f}" if offload else "")
            )
        if offload:
            lines.append(f"(fetches: experts read from the slower tier (cache misses) per decode token, mean over layers; "
                         f"cache of {self.config['offload']['cache']} per layer, {self.config['offload']['tier']} tier)")
        if ep:
            lines.append(f"(max-rank: the most loaded of {self.config['ep']['ranks']} EP ranks "
                         f"({self.config['ep']['strategy']} placement) per layer per decode step, mean over layers)")
        return "\n".join(lines)

    def save(self, out_dir: str | os.PathLike) -> dict[str, str]:
        os.makedirs(out_dir, exist_ok=True)
        paths = {"json": os.path.join(out_dir, "eval.json"), "png": os.path.join(out_dir, "pareto.png")}
        with open(paths["json"], "w") as f:
            json.dump({"config": self.config, "results": [asdict(r) for r in self.results]}, f, indent=1)
        pareto_plot(self, paths["png"])
        if self.config.get("ep"):  # the same fronts against what an expert-parallel layer waits for
            paths["ep_png"] = os.path.join(out_dir, "pareto_ep.png")
            ep = self.config["ep"]
            pareto_plot(self, paths["ep_png"], x="max_rank_distinct",
                        xlabel=f"distinct experts on the most loaded of {ep['ranks']} EP ranks ({ep['strategy']}) "
                               "per layer per decode step")
        return paths


def _ratio(value: float, base: float) -> str:
    return f"x{value / base:.2f}" if base else "-"


def _annotate(ax, points) -> list:
    """Label each point with its full spec (``oea:S=2``, not ``S=2``). A label that would cover an
    earlier one moves up (with a thin line to its point) until it is clear, measured in pixels."""
    ax.figure.canvas.draw()  # fixes the axis limits, so data -> pixel positions are final
    renderer = ax.figure.canvas.get_renderer()
    placed, texts = [], []
    finite = [p for p in points if math.isfinite(p[0]) and math.isfinite(p[1])]  # NaN retention: not drawn
    for x, y, label in sorted(finite, key=lambda p: (p[1], p[0])):
        text = ax.annotate(label, (x, y), textcoords="offset pixels", xytext=(6, 4), fontsize=7)
        box = text.get_window_extent(renderer)
        for _ in range(2 * len(placed)):  # labels are placed bottom-up: a few moves clear the ones below
            if not any(box.overlaps(other) for other in placed):
                break
            text.xyann = (text.xyann[0], text.xyann[1] + box.height + 1)
            box = text.get_window_extent(renderer)
        if text.xyann[1] > 4:  # moved: the same label again, with a line to its point
            offset = text.xyann
            text.remove()
            text = ax.annotate(label, (x, y), textcoords="offset pixels", xytext=offset, fontsize=7,
                               arrowprops=dict(arrowstyle="-", lw=0.4, alpha=0.5))
        placed.append(box)
        texts.append(text)
    return texts


def _family(label: str) -> str:
    """A plot's line: the policy, with per-rank budgets apart from global ones."""
    name = label.split(":", 1)[0]
    return f"{name} (per-rank budget)" if "Nrank=" in label else name


def pareto_plot(report: EvalReport, path: str, x: str = "distinct",
                xlabel: str = "distinct experts per layer per decode step (lower = faster)") -> None:
    """Retention and NLL increase vs distinct experts (or ``x``, another ``PolicyResult`` field),
    with 95% intervals: one colour per policy, its settings joined by a line (sorted by ``x``), so
    each policy's front reads at a glance."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 5.5))
    families: dict[str, list[PolicyResult]] = {}
    for r in report.results:
        families.setdefault(_family(r.label), []).append(r)
    panels = ((axes[0], "retention", "retention_ci", "accuracy retention vs baseline (95% CI)"),
              (axes[1], "dnll", "dnll_ci", "NLL increase vs baseline, nats/token (95% CI)"))
    for ax, key, ci, ylabel in panels:
        labelled = []
        for name, rs in families.items():
            rs = sorted(rs, key=lambda r: getattr(r, x))
            y = [getattr(r, key) for r in rs]
            yerr = [[v - getattr(r, ci)[0] for v, r in zip(y, rs)], [getattr(r, ci)[1] - v for v, r in zip(y, rs)]]
            ax.errorbar([getattr(r, x) for r in rs], y, yerr=yerr, fmt="o-" if len(rs) > 1 else "o", capsize=3,
                        label=name, alpha=0.85)
            labelled.extend((getattr(r, x), v, r.label) for r, v in zip(rs, y))
        _annotate(ax, labelled)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="lower right")
    cfg = report.config
    fig.suptitle(f"batched decode, batch {cfg.get('batch_size')}, {cfg.get('scored_tokens')} scored tokens")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def checked_policies(model: nn.Module, policies, sim=None, placement: Placement | None = None):
    """``(specs, routings, sim)``: the non-baseline ``policies`` as ``PolicySpec``, each one's configs
    by label, and ``sim`` loaded. Everything the model decides (S against each layer's top-k, the
    similarity's layers and shapes, quantiles, predictors) fails here, before any decoding."""
    specs = [p if isinstance(p, PolicySpec) else parse_policy(p) for p in policies]
    specs = [s for s in specs if s.kwargs is not None]
    routings = {s.label: s.routing(placement) for s in specs}  # plan files read, values checked
    for s in specs:
        if sim is None and (need := calibration_need(routings[s.label])) is not None:
            raise ArgumentValueError("sim", f"sim: policy {s.label!r} {need[1]}, got None")
    layers = find_moe_layers(model)
    check_layers(placement, layers)
    matrices = None
    if sim is not None:
        sim = as_similarity(sim)
        matrices = resolve(sim, layers)
    for s in specs:
        try:
            plans = plan_for_layers(routings[s.label], layers, matrices)
        except ArgumentError as exc:
            raise argument_error("policy", f"policy: {s.label!r}: {exc.message}", exc._kind()) from None
        if sim is not None:
            layer_tensors(sim, layers, plans, matrices)  # output's predictors are in the file
    return specs, routings, sim


def evaluate(model: nn.Module, windows: torch.Tensor, policies, sim=None, *, batch_size: int = 32, prefill: int = 4,
             max_tokens: int | None = None, progress: bool = True, baseline: DecodeScores | None = None,
             placement: Placement | None = None) -> EvalReport:
    """Score ``policies`` (``PolicySpec`` or strings for ``parse_policy``) on the same windows.

    The first result is always the untransformed baseline. ``max_tokens`` is passed to
    ``transform`` (decode steps carry ``batch_size`` tokens; prefill is bypassed anyway).
    ``placement``: also report the most loaded EP rank's experts and token-slots.
    """
    if placement is not None and not isinstance(placement, Placement):
        raise ArgumentTypeError("placement", f"placement: expected a sere_fx.Placement, got {type(placement).__name__}")
    if placement is not None and baseline is not None and baseline.rank_distinct is None:
        raise ArgumentValueError("baseline", "baseline: scored without a placement; pass scores from "
                                             "decode_scores(..., placement=...) or none")
    specs, routings, sim = checked_policies(model, policies, sim, placement)
    n = int(windows.shape[0])
    if not isinstance(batch_size, int) or not 1 <= batch_size <= n:
        raise ArgumentValueError("batch_size", f"batch_size: expected an int in [1, {n}] (the number of sequences), got {batch_size!r}: "
                         "every decode step must carry a full batch")
    # Every scored step carries exactly batch_size tokens: a smaller last batch would be a
    # different workload, so its sequences are left out and counted in the report.
    dropped = n % batch_size
    windows = windows[: n - dropped]
    if baseline is None:
        baseline = decode_scores(model, windows, batch_size=batch_size, prefill=prefill, progress=progress,
                                 desc="baseline", placement=placement)
    caches = offloaded_layers(model)
    scored = [(BASELINE_OFFLOAD if caches else "baseline", baseline, None)]
    for spec in specs:
        routing = routings[spec.label]
        transform(model, sim if needs_similarity(routing) else None, routing, max_tokens=max_tokens)
        try:
            settings = model.sere_settings.as_dict()
            scored.append((spec.label, decode_scores(model, windows, batch_size=batch_size, prefill=prefill,
                                                     progress=progress, desc=spec.label, placement=placement),
                           settings))
        finally:
            restore(model)
    config = {"batch_size": batch_size, "prefill": prefill, "sequences": int(windows.shape[0]),
              "dropped_sequences": dropped,
              "window": int(windows.shape[1]), "scored_tokens": int(baseline.tokens.sum()), "max_tokens": max_tokens}
    if placement is not None:
        config["ep"] = {"ranks": placement.ranks, "strategy": placement.strategy}
    if caches:
        sizes = sorted({c.capacity for c in caches.values()})
        config["offload"] = {"cache": sizes[0] if len(sizes) == 1 else {str(i): c.capacity for i, c in caches.items()},
                             "tier": "disk" if all(hasattr(c.store, "path") for c in caches.values()) else "memory"}
    return build_report(scored, config, placement)


def _cache_fields(cache: dict[int, dict]) -> dict:
    """``PolicyResult``'s offload fields from per-layer cache counters."""
    def per_token(key):
        return float(np.mean([c[key] / c["tokens"] if c["tokens"] else 0.0 for c in cache.values()]))

    hits, misses = sum(c["hits"] for c in cache.values()), sum(c["misses"] for c in cache.values())
    return dict(fetches_per_token=per_token("misses"), bytes_per_token=per_token("bytes"),
                hit_rate=hits / (hits + misses) if hits + misses else 0.0,
                cache_per_layer={str(i): c for i, c in cache.items()})


def build_report(scored, config: dict, placement: Placement | None = None) -> EvalReport:
    """The report of ``scored`` (``[(label, DecodeScores, settings)]``, the baseline first), each
    against the baseline with paired intervals (the transformers and the vLLM evaluations both)."""
    baseline = scored[0][1]
    results = []
    for label, s, settings in scored:
        ci = paired_bootstrap(baseline, s)
        results.append(PolicyResult(
            label=label, accuracy=s.accuracy, nll=s.mean_nll, perplexity=math.exp(s.mean_nll), distinct=s.mean_distinct,
            distinct_per_layer={str(k): v for k, v in s.distinct.items()},
            retention=s.accuracy / baseline.accuracy if baseline.accuracy else math.nan, retention_ci=ci["retention_ci"],
            dnll=s.mean_nll - baseline.mean_nll, dnll_ci=ci["dnll_ci"], settings=settings,
            **({} if placement is None else dict(
                max_rank_distinct=s.mean_rank_distinct, max_rank_slots=float(np.mean(list(s.rank_slots.values()))),
                slots=float(np.mean(list(s.slots.values()))),
                max_rank_distinct_per_layer={str(k): v for k, v in s.rank_distinct.items()})),
            **({} if s.cache is None else _cache_fields(s.cache)),
        ))
    return EvalReport(results, config, {label: s for label, s, _ in scored})
