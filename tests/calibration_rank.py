"""One rank for ``test_calibration_parallel.py``: a MoE layer's experts sharded as vLLM shards them
(``tp``: each rank a slice of the intermediate dimension; ``ep``: each rank whole experts, zeros for
the others), every expert's output through ``KernelExpertOutputs`` with a gloo all-reduce.
Writes the outputs and a Frobenius accumulator's matrix."""

import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

from sere_fx.calibration.engine import KernelExpertOutputs
from sere_fx.calibration.methods import accumulator
from sere_fx.discovery import find_moe_layers
from tiny_models import tiny_model

mode, rank, world, port, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)

layer = find_moe_layers(tiny_model("qwen3_moe"))[0]
experts, E = layer.experts, layer.num_experts
gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()  # [E, 2I, H], [E, H, I]
inter = down.shape[2]
if mode == "tp":  # this rank's slice of the intermediate dimension: partial sums of every expert
    part = slice(rank * inter // world, (rank + 1) * inter // world)
    gate_up = torch.cat([gate_up[:, :inter][:, part], gate_up[:, inter:][:, part]], dim=1)
    down = down[:, :, part]
    local = torch.ones(E, dtype=torch.bool)
else:  # ep: whole experts, this rank's block of them
    local = torch.zeros(E, dtype=torch.bool)
    local[rank * E // world:(rank + 1) * E // world] = True


def forward_modular(x, topk_weights, topk_ids):
    """The fused-MoE contract: sum over slots of weight x expert(x), 0 for experts not held here."""
    e = topk_ids[:, 0].long()
    g, u = torch.einsum("th,tih->ti", x, gate_up[e]).chunk(2, dim=-1)
    y = torch.einsum("ti,thi->th", experts.act_fn(g) * u, down[e])
    return y * topk_weights * local[e].unsqueeze(1)


runner = SimpleNamespace(routed_experts=SimpleNamespace(forward_modular=forward_modular,
                                                        _ensure_moe_quant_config_init=lambda: None),
                         _quant_method=SimpleNamespace(topk_indices_dtype=None))


def all_reduce(y):
    dist.all_reduce(y)
    return y


outputs = KernelExpertOutputs(runner, E, all_reduce)
x = torch.randn(37, gate_up.shape[2], generator=torch.Generator().manual_seed(3))
acc = accumulator("frobenius", outputs, E)
acc.update(x)
torch.save({"outputs": outputs(x), "frobenius": acc.finalize(), "x": x}, out)
dist.destroy_process_group()
