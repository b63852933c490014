"""Optional per-layer routing statistics (off by default; nothing is recorded or computed when off)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from sere_fx.placement import Placement, rank_load


def repeated_slots(ids: torch.Tensor) -> torch.Tensor:
    """Bool ``[T, K]``: slots whose expert an earlier slot of the same token already has. A kernel
    that merges slots computes the others, each token's distinct experts (weight-0 fill slots of
    the top-k policies repeat the token's first expert, so they are among the repeated)."""
    k = ids.shape[-1]
    earlier = torch.ones(k, k, dtype=torch.bool, device=ids.device).tril(-1)  # [i, j]: slot j before slot i
    return ((ids.unsqueeze(-1) == ids.unsqueeze(-2)) & earlier).any(dim=-1)


@dataclass
class LayerStats:
    """Counters for one MoE layer, summed over calls (``distinct_*`` are summed per call)."""

    calls: int = 0
    tokens: int = 0
    distinct_before: int = 0
    distinct_after: int = 0
    slots_rerouted: int = 0  # slots whose expert changed (or were dropped, for the ``topk`` policy)
    critical_kept: int = 0
    # token-slots before (T x K) and after: each token's distinct experts, what a kernel that merges a
    # token's slots of one expert computes (``sere_sparse``, the vLLM plugin's CPU kernel); transformers'
    # own experts implementations compute every slot
    slots_before: int = 0
    slots_after: int = 0
    skipped_calls: int = 0  # calls above ``max_tokens`` (left to the model's own routing)
    skipped_tokens: int = 0
    # plans that follow the load (``RowRanges``): calls per range, by the range's ``min_rows``
    range_calls: dict[int, int] = field(default_factory=dict)
    # with a placement (``transform(stats=Placement(...))``): the busiest EP rank's distinct experts
    # before / after and token-slots after, summed over calls
    max_rank_before: int = 0
    max_rank_after: int = 0
    max_rank_slots_after: int = 0
    placement: Placement | None = field(default=None, repr=False)
    num_experts: int | None = field(default=None, repr=False)
    _owner: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)

    def record(self, ranked_ids: torch.Tensor, rerouted: torch.Tensor, S: int) -> None:
        with torch.no_grad():
            primary = torch.unique(ranked_ids[:, :S])
            after = torch.unique(rerouted)
            self.calls += 1
            self.tokens += ranked_ids.shape[0]
            self.distinct_before += int(torch.unique(ranked_ids).numel())
            self.distinct_after += int(after.numel())
            if rerouted.shape == ranked_ids.shape:
                self.slots_rerouted += int((ranked_ids != rerouted).sum())
            else:  # top-k reduction: the dropped slots
                self.slots_rerouted += ranked_ids.numel() - rerouted.numel()
            self.critical_kept += int((~torch.isin(after, primary)).sum())
            self.slots_before += ranked_ids.numel()
            self.slots_after += rerouted.numel() - int(repeated_slots(rerouted).sum())
            if self.placement is not None:
                if self._owner is None:  # once: the map does not change between calls
                    self._owner = self.placement.owner(self.num_experts)
                before, _ = rank_load(ranked_ids.cpu(), self._owner, self.placement.ranks)
                after_rank, slots = rank_load(rerouted.cpu(), self._owner, self.placement.ranks)
                self.max_rank_before += int(before.max())
                self.max_rank_after += int(after_rank.max())
                self.max_rank_slots_after += int(slots.max())

    def record_skipped(self, tokens: int) -> None:
        self.skipped_calls += 1
        self.skipped_tokens += tokens

    def record_range(self, min_rows: int) -> None:
        self.range_calls[min_rows] = self.range_calls.get(min_rows, 0) + 1

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("placement"), d.pop("num_experts"), d.pop("_owner")
        d["mean_distinct_before"] = self.distinct_before / self.calls if self.calls else 0.0
        d["mean_distinct_after"] = self.distinct_after / self.calls if self.calls else 0.0
        if self.placement is None:
            for name in ("max_rank_before", "max_rank_after", "max_rank_slots_after"):
                del d[name]
        else:
            for name in ("max_rank_before", "max_rank_after"):
                d[f"mean_{name}"] = d[name] / self.calls if self.calls else 0.0
        return d
