"""Optional per-layer routing statistics (off by default; nothing is recorded or computed when off)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


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

    def record_skipped(self, tokens: int) -> None:
        self.skipped_calls += 1
        self.skipped_tokens += tokens

    def as_dict(self) -> dict:
        d = asdict(self)
        d["mean_distinct_before"] = self.distinct_before / self.calls if self.calls else 0.0
        d["mean_distinct_after"] = self.distinct_after / self.calls if self.calls else 0.0
        return d
