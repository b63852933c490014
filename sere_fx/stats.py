"""Optional per-layer routing statistics (off by default; nothing is recorded or computed when off)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from sere_fx.placement import Placement, rank_load


@dataclass
class LayerStats:
    """Counters for one MoE layer, summed over calls (``distinct_*`` are summed per call)."""

    calls: int = 0
    tokens: int = 0
    distinct_before: int = 0
    distinct_after: int = 0
    slots_rerouted: int = 0  # slots whose expert changed (or were dropped, for the ``topk`` policy)
    critical_kept: int = 0
    skipped_calls: int = 0  # calls above ``max_tokens`` (left to the model's own routing)
    skipped_tokens: int = 0
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
