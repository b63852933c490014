"""Expert placement under expert parallelism (EP): which of R ranks holds each expert.

Under EP a MoE layer takes as long as its most loaded rank, so what matters per decode step is
the *maximum over ranks* of the distinct experts each rank reads (weight bytes) and of the
token-slots it computes, not only their totals. ``Placement`` maps experts to ranks the way
vLLM does (``linear``: contiguous blocks, the first ``E % R`` ranks one expert more;
``round_robin``: expert e on rank e % R) or by an explicit map (e.g. an EPLB result).
``rank_load`` counts one call's load per rank; ``eval --ep-ranks`` and the ``weight`` policy's
per-rank budget (``WeightConfig(rank_budget=..., placement=...)``) read it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sere_fx.errors import ArgumentError, argument_error

STRATEGIES = ("linear", "round_robin", "explicit")


@dataclass(frozen=True)
class Placement:
    """``ranks`` EP ranks; ``strategy`` ``linear`` / ``round_robin`` (vLLM's), or ``explicit`` with
    ``owners`` (the rank of each expert, a tuple of E ints)."""

    ranks: int
    strategy: str = "linear"
    owners: tuple[int, ...] | None = None

    def __post_init__(self):
        if isinstance(self.ranks, bool) or not isinstance(self.ranks, int) or self.ranks < 1:
            raise argument_error("ranks", f"ranks: expected a positive int (EP ranks), got {self.ranks!r}")
        if self.strategy not in STRATEGIES:
            raise argument_error("strategy", f"strategy: expected one of {list(STRATEGIES)}, got {self.strategy!r}")
        if (self.owners is not None) != (self.strategy == "explicit"):
            raise argument_error("owners", "owners: expected a map exactly with strategy 'explicit', got "
                                           f"owners={self.owners!r} with strategy {self.strategy!r}")
        if self.owners is not None:
            object.__setattr__(self, "owners", tuple(self.owners))
            bad = [o for o in self.owners if isinstance(o, bool) or not isinstance(o, int) or not 0 <= o < self.ranks]
            if bad:
                raise argument_error("owners", f"owners: expected ranks in [0, {self.ranks}), got {bad[0]!r}")

    @classmethod
    def parse(cls, ranks: int, strategy: str = "linear") -> "Placement":
        return cls(ranks, strategy)

    def owner(self, num_experts: int, device=None) -> torch.Tensor:
        """The rank of each expert, int64 ``[num_experts]``."""
        if self.owners is None and self.ranks > num_experts:
            # vLLM refuses it too: a rank with no expert is not expert parallelism of this layer
            raise argument_error("ranks", f"ranks: expected at most {num_experts} EP ranks (the layer's experts: "
                                          f"each rank holds one or more), got {self.ranks}")
        if self.owners is not None:
            if len(self.owners) != num_experts:
                raise argument_error("owners", f"owners: expected a rank for each of the {num_experts} experts, "
                                               f"got {len(self.owners)}")
            return torch.tensor(self.owners, dtype=torch.int64, device=device)
        experts = torch.arange(num_experts, device=device)
        if self.strategy == "round_robin":
            return experts % self.ranks
        # linear, as vLLM: rank r holds [r * base + min(r, rest), ...) with base + 1 experts if r < rest
        base, rest = divmod(num_experts, self.ranks)
        starts = torch.tensor([r * base + min(r, rest) for r in range(1, self.ranks)], device=device)
        return torch.bucketize(experts, starts, right=True)

    def describe(self) -> str:
        return f"{self.ranks} EP ranks, {self.strategy} placement"


def check_layers(placement: Placement | None, layers) -> None:
    """Refuse a placement that does not fit some MoE layer (``layers``: with ``index`` and
    ``num_experts``), naming the layer, before any long work."""
    if placement is None:
        return
    for layer in layers:
        try:
            placement.owner(layer.num_experts)
        except ArgumentError as exc:
            raise exc.renamed("placement", words={"the layer's": f"layer {layer.index}'s"}) from None


def rank_load(ids: torch.Tensor, owner: torch.Tensor, ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One call's load per rank: (distinct experts read ``[R]``, token-slots computed ``[R]``) for
    expert ids ``[..., K]`` (negative ids: no expert). A slot repeated on one expert is computed
    twice, as the experts module receives it."""
    flat = ids.reshape(-1).to(torch.int64)
    flat = flat[flat >= 0]
    slots = torch.bincount(owner[flat], minlength=ranks)
    distinct = torch.bincount(owner[torch.unique(flat)], minlength=ranks)
    return distinct, slots
