"""Raw outputs of every expert of one MoE layer on the same tokens: ``Y[e] = expert_e(X)``.

Calibration needs each expert applied to *all* tokens (not just those routed to it), with
no routing weight. Three ways, fastest first:

- fused 3-D weights in the common layout (``gate_up_proj [E, 2I, H]``, ``down_proj
  [E, H, I]``, ``act_fn``): two batched GEMMs over all experts at once. The layout is an
  assumption, so it is checked once per layer against the generic path and dropped if it
  does not reproduce it exactly;
- ``nn.ModuleList`` experts: each expert module called on X;
- any other experts module: called with every token routed to expert e at weight 1.
"""

from __future__ import annotations

import torch
from torch import nn


def _generic(experts: nn.Module, num_experts: int, x: torch.Tensor) -> torch.Tensor:
    if isinstance(experts, nn.ModuleList):
        return torch.stack([expert(x) for expert in experts])
    ones = torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device)
    out = []
    for e in range(num_experts):
        index = torch.full((x.shape[0], 1), e, dtype=torch.long, device=x.device)
        out.append(experts.forward(x, index, ones))  # .forward: skip hooks (calibration hooks this module)
    return torch.stack(out)


def _fused(experts: nn.Module, x: torch.Tensor) -> torch.Tensor:
    gate_up = torch.matmul(x, experts.gate_up_proj.transpose(1, 2))  # [E, T, 2I]
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.matmul(experts.act_fn(gate) * up, experts.down_proj.transpose(1, 2))  # [E, T, H]


def _has_fused_layout(experts: nn.Module, num_experts: int) -> bool:
    gu, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not (isinstance(gu, torch.Tensor) and isinstance(down, torch.Tensor) and hasattr(experts, "act_fn")):
        return False
    if gu.dim() != 3 or down.dim() != 3 or gu.shape[0] != num_experts or down.shape[0] != num_experts:
        return False
    hidden, inter2 = gu.shape[2], gu.shape[1]
    has_bias = any(getattr(experts, n, None) is not None for n in ("gate_up_proj_bias", "down_proj_bias"))
    return tuple(down.shape[1:]) == (hidden, inter2 // 2) and not has_bias


class ExpertOutputs:
    """``ExpertOutputs(experts, num_experts)(x) -> [E, T, H]`` for one layer."""

    def __init__(self, experts: nn.Module, num_experts: int):
        self.experts = experts
        self.num_experts = num_experts
        self.fused = _has_fused_layout(experts, num_experts)
        self._checked = False

    @torch.no_grad()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and not self._checked:
            probe = x[:4]
            self.fused = torch.allclose(_fused(self.experts, probe), _generic(self.experts, self.num_experts, probe),
                                        rtol=1e-4, atol=1e-5)
            self._checked = True
        if self.fused:
            return _fused(self.experts, x)
        return _generic(self.experts, self.num_experts, x)
