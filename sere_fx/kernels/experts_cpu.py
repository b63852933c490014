"""An experts implementation that touches only the active experts' weights, built for decode.

Registered with transformers as the experts implementation ``"sere_sparse"``
(``model.set_experts_implementation("sere_sparse")``, or ``sere_fx.transform(...,
experts_implementation="sere_sparse")``). Why it exists: in batched decode each active
expert sees a handful of rows, so the expert matmuls are memory-bound GEMMs with tiny N, and
how the weights are streamed decides whether fewer experts turn into less time.

- (token, expert) pairs are deduplicated first, their routing weights summed: re-routing
  often sends several slots of one token to the same primary expert, and one row with the
  summed weight is the same math done once (fewer FLOPs, which matter on a CPU); a pair whose
  summed weight is 0 (the top-k policies fill slots they cannot fill with weight-0 copies of the
  token's first expert) is not computed at all;
- rows are grouped by expert with one sort; one Python-level loop runs over *active*
  experts only, each doing ``W @ X^T`` with the weight as the row-major left operand (MKL
  streams it well for small N, better than ``F.linear``'s transposed form);
- results are scattered back with one ``index_add_``.

Layouts other than transformers' default (``gate_up_proj [E, 2I, H]`` concatenated,
``down_proj [E, H, I]``, no bias) and non-CPU devices fall back to ``grouped_mm``.
"""

from __future__ import annotations

import warnings

import torch

NAME = "sere_sparse"


def standard_layout(experts) -> bool:
    return (
        getattr(experts, "has_gate", True)
        and not getattr(experts, "has_bias", False)
        and not getattr(experts, "is_transposed", False)
        and getattr(experts, "is_concatenated", True)
        and not getattr(experts, "has_post_expert_norm", False)
        and isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor)
        and isinstance(getattr(experts, "down_proj", None), torch.Tensor)
    )


def grouped_rows(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, num_experts: int, num_tokens: int):
    """The (token, expert) pairs of a call as rows sorted by expert, duplicates summed, weight-0 pairs
    and slots marked "no expert" (index ``num_experts``) left out: (row_token ``[R]``, row_weight
    ``[R]`` float32, rows per expert as a list of ``E`` ints)."""
    k = top_k_index.shape[-1]
    ids = top_k_index.reshape(-1)
    weights = top_k_weights.reshape(-1)
    tokens = torch.arange(num_tokens, device=ids.device).repeat_interleave(k)
    valid = ids < num_experts  # an index == num_experts marks a slot with no expert
    if not bool(valid.all()):
        ids, weights, tokens = ids[valid], weights[valid], tokens[valid]
    # One row per distinct (expert, token), sorted by expert; duplicate slots sum their weights.
    keys, inverse = torch.unique(ids * num_tokens + tokens, return_inverse=True)
    row_weight = torch.zeros(keys.shape[0], dtype=torch.float32, device=ids.device)
    row_weight.index_add_(0, inverse, weights.float())
    nonzero = row_weight != 0  # weight-0 slots (the top-k policies' fill) add nothing: not computed
    if not bool(nonzero.all()):
        keys, row_weight = keys[nonzero], row_weight[nonzero]
    counts = torch.bincount(keys // num_tokens, minlength=num_experts).tolist()
    return keys % num_tokens, row_weight, counts


def expert_rows(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act_fn, weight: torch.Tensor) -> torch.Tensor:
    """One expert on its rows ``x [c, H]``, scaled by each row's routing ``weight``: ``[c, H]``."""
    gate_up_out = torch.mm(gate_up, x.T)  # [2I, c]: the weight as the row-major left operand
    gate, up = gate_up_out.chunk(2, dim=0)
    y = torch.mm(down, act_fn(gate) * up)  # [H, c]
    return (y * weight.to(y.dtype)).T


def run_experts(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, num_experts: int,
                act_fn, weights_of) -> torch.Tensor:
    """The experts of a call, one active expert at a time: ``weights_of(active)`` yields ``(expert,
    gate_up [2I, H], down [H, I])`` for each expert of ``active`` (in any order; an offload cache
    fetches as it goes)."""
    num_tokens = hidden_states.shape[0]
    row_token, row_weight, counts = grouped_rows(top_k_index, top_k_weights, num_experts, num_tokens)
    starts, start = [0] * num_experts, 0
    for e, c in enumerate(counts):
        starts[e], start = start, start + c
    x = hidden_states[row_token]
    out = torch.empty_like(x)
    for e, gate_up, down in weights_of([e for e, c in enumerate(counts) if c]):
        s, c = starts[e], counts[e]
        out[s:s + c] = expert_rows(x[s:s + c], gate_up, down, act_fn, row_weight[s:s + c])
    final = torch.zeros_like(hidden_states)
    final.index_add_(0, row_token, out)
    return final


def sparse_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor) -> torch.Tensor:
    if hidden_states.device.type != "cpu" or not standard_layout(self):
        from transformers.integrations.moe import grouped_mm_experts_forward

        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    return run_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj.shape[0], self.act_fn,
                       lambda active: ((e, self.gate_up_proj[e], self.down_proj[e]) for e in active))


# Whether ``grouped_mm_per_expert`` gave transformers' output bit for bit on its first call in this process
# (None: not checked yet). It relies on the CPU ``grouped_mm`` multiplying each expert's rows with one ``mm``.
_SAME_AS_GROUPED_MM: bool | None = None


def grouped_mm_per_expert(experts):
    """transformers' ``grouped_mm`` experts forward for ``experts``, computed one expert at a time: the same
    sort, per-expert matmuls, gate, weighting and per-token sum, so the same output bit for bit, but each
    expert's rows are gathered, multiplied and written back while they are in cache instead of streaming
    every slot's ``[S, H]`` rows through memory four times (one test-bed experts call: 62 -> 35 ms; a
    decode pass at batch 32: 2.26 -> 1.78 s, bench/RESULTS.md). The first call in a process is checked
    against transformers' own forward; if they differ, that one is used from then on. None where the
    layout or the setting differs: another implementation, another layout (``standard_layout``), expert
    parallel, or not on a CPU; a call whose inputs are not in the weights' dtype (transformers casts them)
    or that has a slot with no expert goes to transformers' forward."""
    config = getattr(experts, "config", None)
    if (getattr(config, "_experts_implementation", None) != "grouped_mm" or not standard_layout(experts)
            or getattr(experts, "_is_expert_parallel", False) or experts.gate_up_proj.device.type != "cpu"
            or _SAME_AS_GROUPED_MM is False):
        return None
    reference = type(experts).forward.__get__(experts)
    num_experts = experts.gate_up_proj.shape[0]

    def per_expert(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        n, k = top_k_index.shape
        ids, perm = torch.sort(top_k_index.reshape(-1))
        if (n == 0 or int(ids[0]) < 0 or int(ids[-1]) >= num_experts  # a slot with no expert
                or hidden_states.dtype != experts.gate_up_proj.dtype):  # transformers casts to the weights' dtype
            return None
        counts = torch.bincount(ids, minlength=num_experts).tolist()
        token, weight = perm // k, top_k_weights.reshape(-1).index_select(0, perm)
        out = torch.empty(n * k, hidden_states.shape[-1], dtype=hidden_states.dtype, device=hidden_states.device)
        start = 0
        for e, c in enumerate(counts):
            if c:
                rows = slice(start, start + c)
                # x @ W.T on the [2I, H] / [H, I] weights: the operands grouped_mm hands to mm
                h = experts._apply_gate(torch.mm(hidden_states.index_select(0, token[rows]), experts.gate_up_proj[e].T))
                y = torch.mm(h, experts.down_proj[e].T).mul_(weight[rows].unsqueeze(-1))
                out.index_copy_(0, perm[rows], y)  # each slot back at its (token, k) place
                start += c
        return out.view(n, k, -1).sum(dim=1)

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        global _SAME_AS_GROUPED_MM
        if _SAME_AS_GROUPED_MM is False:
            return reference(hidden_states, top_k_index, top_k_weights)
        out = per_expert(hidden_states, top_k_index, top_k_weights)
        if out is None:
            return reference(hidden_states, top_k_index, top_k_weights)
        if _SAME_AS_GROUPED_MM is None:
            expected = reference(hidden_states, top_k_index, top_k_weights)
            _SAME_AS_GROUPED_MM = torch.equal(out, expected)
            if not _SAME_AS_GROUPED_MM:
                warnings.warn("grouped_mm_per_expert: this torch's CPU grouped_mm does not match one mm per expert "
                              "bit for bit; using transformers' grouped_mm experts forward", stacklevel=2)
                return expected
        return out

    return forward


def register() -> None:
    """Make ``"sere_sparse"`` a transformers experts implementation (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if NAME not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(NAME, sparse_experts_forward)
